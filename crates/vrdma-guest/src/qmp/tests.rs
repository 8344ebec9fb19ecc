//! The client against a fake QMP peer on a socket pair: no QEMU.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{Error, Qmp, MAX_LINE};

const GREETING: &str =
    r#"{"QMP": {"version": {"qemu": {"micro": 0, "minor": 2, "major": 7}}, "capabilities": []}}"#;
/// The fake peer's answers come at once; a test that waits for a silent
/// peer waits this long.
const SHORT: Duration = Duration::from_millis(300);

/// QEMU's end: reads a command, checks it names `expect`, writes `reply`.
struct Peer {
    r: BufReader<UnixStream>,
    w: UnixStream,
}

impl Peer {
    fn send(&mut self, line: &str) {
        let _ = self.w.write_all(format!("{line}\r\n").as_bytes());
    }

    fn answer(&mut self, expect: &str, replies: &[&str]) {
        let mut l = String::new();
        self.r.read_line(&mut l).unwrap();
        assert!(l.contains(expect), "the client sent {l:?}, not {expect}");
        for r in replies {
            self.send(r);
        }
    }

    /// The greeting and `qmp_capabilities`'s answer.
    fn hello(&mut self) {
        self.send(GREETING);
        self.answer("qmp_capabilities", &[r#"{"return": {}}"#]);
    }
}

/// A client's end and a thread running `script` as QEMU on the other.
fn fake(script: impl FnOnce(&mut Peer) + Send + 'static) -> (UnixStream, JoinHandle<()>) {
    let (a, b) = UnixStream::pair().unwrap();
    b.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let t = std::thread::spawn(move || {
        let mut p = Peer { r: BufReader::new(b.try_clone().unwrap()), w: b };
        script(&mut p);
    });
    (a, t)
}

#[test]
fn a_greeting_then_a_reply_after_an_interleaved_event() {
    let (s, t) = fake(|p| {
        p.hello();
        p.answer(
            "query-status",
            &[
                r#"{"timestamp": {"seconds": 1, "microseconds": 2}, "event": "STOP"}"#,
                r#"{"timestamp": {"seconds": 1, "microseconds": 3}, "event": "MIGRATION", "data": {"status": "active"}}"#,
                r#"{"return": {"status": "paused", "running": false}}"#,
            ],
        );
        p.answer("cont", &[r#"{"return": {}}"#, r#"{"event": "RESUME"}"#]);
        p.answer("query-status", &[r#"{"return": {"status": "running", "running": true}}"#]);
    });
    let mut q = Qmp::over(s, Duration::from_secs(10)).unwrap();
    assert_eq!(q.status().unwrap(), "paused");
    let ev = q.take_events();
    let names: Vec<&str> = ev.iter().map(|e| e["event"].as_str().unwrap()).collect();
    assert_eq!(names, ["STOP", "MIGRATION"]);
    assert_eq!(ev[1]["data"]["status"], "active");
    assert_eq!(q.exec(r#"{"execute":"cont"}"#).unwrap(), serde_json::json!({}));
    // The event after `cont`'s answer is not taken for the next answer.
    assert_eq!(q.status().unwrap(), "running");
    assert_eq!(q.take_events()[0]["event"], "RESUME");
    t.join().unwrap();
}

#[test]
fn an_error_reply_is_an_error_with_its_class_and_text() {
    let (s, t) = fake(|p| {
        p.hello();
        p.answer(
            "migrate",
            &[r#"{"error": {"class": "GenericError", "desc": "Failed to connect to socket: No such file"}}"#],
        );
    });
    let mut q = Qmp::over(s, Duration::from_secs(10)).unwrap();
    match q.migrate("unix:/nowhere") {
        Err(Error::Refused { command, class, desc }) => {
            assert!(command.contains("unix:/nowhere"), "{command}");
            assert_eq!(class, "GenericError");
            assert!(desc.contains("Failed to connect"), "{desc}");
        }
        r => panic!("{r:?}"),
    }
    t.join().unwrap();
}

#[test]
fn something_else_than_the_greeting_is_refused() {
    let (s, t) = fake(|p| p.send("Welcome to the HMP monitor"));
    match Qmp::over(s, Duration::from_secs(10)) {
        Err(Error::Greeting(l)) => assert!(l.contains("HMP"), "{l}"),
        r => panic!("{:?}", r.err()),
    }
    t.join().unwrap();
}

/// A client whose QEMU answers its next command with `raw` (as it is),
/// then closes, or holds the connection open silently if `hold`.
fn answering(raw: Vec<u8>, hold: bool) -> (Qmp, JoinHandle<()>) {
    let (s, t) = fake(move |p| {
        p.hello();
        p.answer("query-status", &[]);
        let _ = p.w.write_all(&raw);
        if hold {
            // Until the client gave up and closed.
            let mut l = String::new();
            let _ = p.r.read_line(&mut l);
        }
    });
    (Qmp::over(s, Duration::from_secs(10)).unwrap(), t)
}

#[test]
fn a_truncated_line_then_silence_times_out() {
    let (mut q, t) = answering(br#"{"return": {"sta"#.to_vec(), true);
    let t0 = Instant::now();
    match q.exec_within(r#"{"execute":"query-status"}"#, SHORT) {
        Err(Error::Timeout { limit, .. }) => assert_eq!(limit, SHORT),
        r => panic!("{r:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    drop(q);
    t.join().unwrap();
}

#[test]
fn a_truncated_line_then_the_end_is_closed() {
    let (mut q, t) = answering(br#"{"return": {"sta"#.to_vec(), false);
    assert!(matches!(q.status(), Err(Error::Closed { .. })));
    t.join().unwrap();
}

#[test]
fn events_that_never_end_in_an_answer_time_out() {
    let (s, t) = fake(|p| {
        p.hello();
        p.answer("query-status", &[]);
        // An event every 10 ms, for longer than the client waits.
        for _ in 0..100 {
            p.send(r#"{"event": "RTC_CHANGE", "data": {"offset": 0}}"#);
            std::thread::sleep(Duration::from_millis(10));
        }
    });
    let mut q = Qmp::over(s, Duration::from_secs(10)).unwrap();
    assert!(matches!(q.exec_within(r#"{"execute":"query-status"}"#, SHORT), Err(Error::Timeout { .. })));
    // Only the last MAX_EVENTS are kept.
    assert!(q.take_events().len() <= super::MAX_EVENTS);
    drop(q);
    t.join().unwrap();
}

#[test]
fn an_oversized_line_is_refused() {
    // Silent after it: the client must not wait for the line's end.
    let (mut q, t) = answering(vec![b'x'; MAX_LINE + 8192], true);
    assert!(matches!(q.status(), Err(Error::TooLong { .. })));
    drop(q);
    t.join().unwrap();
}

#[test]
fn garbage_is_an_error() {
    for junk in ["not json at all", "[1, 2]", r#"{"neither": "return nor event"}"#] {
        let (mut q, t) = answering(format!("{junk}\n").into_bytes(), false);
        match q.status() {
            Err(Error::Garbage { line, .. }) => assert_eq!(line, junk),
            r => panic!("{junk}: {r:?}"),
        }
        t.join().unwrap();
    }
}

#[test]
fn a_migration_is_polled_until_it_completes_or_fails() {
    let (s, t) = fake(|p| {
        p.hello();
        p.answer("migrate", &[r#"{"return": {}}"#]);
        for st in ["setup", "active", "device"] {
            p.answer("query-migrate", &[&format!(r#"{{"return": {{"status": "{st}"}}}}"#)]);
        }
        p.answer(
            "query-migrate",
            &[r#"{"return": {"status": "completed", "downtime": 12, "ram": {"dirty-sync-count": 3}}}"#],
        );
        p.answer("query-migrate", &[r#"{"return": {"status": "failed"}}"#]);
    });
    let mut q = Qmp::over(s, Duration::from_secs(10)).unwrap();
    q.migrate("unix:/m").unwrap();
    let m = q.wait_completed().unwrap();
    assert_eq!(m["ram"]["dirty-sync-count"], 3);
    assert!(matches!(q.wait_completed(), Err(Error::Migration(m)) if m["status"] == "failed"));
    t.join().unwrap();
}
