//! Debian's `ucmatose` and perftest's `ib_write_lat -R`, unmodified, on
//! the drop-in librdmacm, moving with the VM: each client in the guest,
//! its server a host process on B (on the drop-in too). B's servers print
//! line by line (`stdbuf -oL`), each line kept with the time it came, so
//! that the test knows where in their runs a move fell.
//!
//! `ucmatose -c 2 -C N`: once both connections are up, B's server sends
//! N messages on each, then waits for the guest's N replies on each; the
//! guest's client takes its N, then posts its replies, then both
//! disconnect. The move is started when B begins to send, so that QEMU's
//! switch-over (a live pass of about 1.5 s later) falls in the transfers
//! (seconds under TCG); the test checks that it did (B's sends began
//! before it, the guest's replies were all in only after it) and that
//! both exited 0. ucmatose waits for every completion it expects (a
//! message lost would leave it waiting until its `timeout`).
//!
//! `ib_write_lat -R -n N`: its exchanges (a write each way, each side
//! spinning on its buffer) run over a QP of the rdma_cm id, and its
//! parameters and its end go over a second rdma_cm connection: two event
//! channels on the librdmacm's context, which must come back after the
//! move (their doorbells in the adoption's reply), or the final
//! `rdma_disconnect` fails. The move is started once B runs its
//! exchanges; the test checks that B's results came after it.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vrdma_guest::Guest;

use crate::world::*;

const UCM_PORT: u16 = 7497;
const LAT_PORT: u16 = 7498;
/// ucmatose's connections and messages (each way, per connection; at
/// most the device's `max_qp_wr`, 16384: ucmatose sizes its queues so).
/// As many messages as that allows, so that the transfers outlast QEMU's
/// live pass (1.4-2.1 s under TCG): 10000 were once enough (6-8 s of
/// transfers), but on 2026-11-28 two runs in three finished theirs in
/// 1.2-1.4 s, before the switch-over; 16000 gave 2.1 s against the
/// switch-over's 1.7 s. Each connection's queues take 4.5 MiB of the
/// VM's 16 MiB region (two CQs of 16384 64-byte entries, a QP of 16384
/// 128-byte send and 32-byte receive slots): three fit, four do not
/// (the guest's client fails at its fourth QP, saying the region is
/// full, and B's server waits for the fourth connection for ever).
/// Before a guest's QPs stopped taking a direct-path inbox (1 MiB more
/// each), three did not fit either.
pub const UCM_CONNECTIONS: u32 = 2;
pub const UCM_MESSAGES: u32 = 16000;
/// ib_write_lat's exchanges (2 to 5 ms each under TCG on the loaded
/// machine: the move falls in them).
pub const LAT_ITERS: u32 = 3000;

/// A host process on B, killed (by its pid) and reaped if still running
/// when dropped; its lines, with the time each came.
pub struct HostTool {
    child: Child,
    what: String,
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
    err: Arc<Mutex<String>>,
}

impl Drop for HostTool {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl HostTool {
    fn start(w: &World, what: &str, program: &str, args: &[&str]) -> HostTool {
        let mut child = w
            .host(1, "stdbuf")
            .args(["-oL", program])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{what} on B: {e}"));
        let lines = Arc::new(Mutex::new(Vec::new()));
        let out = child.stdout.take().expect("piped");
        let kept = lines.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                kept.lock().unwrap().push((Instant::now(), l));
            }
        });
        let err = Arc::new(Mutex::new(String::new()));
        let mut e = child.stderr.take().expect("piped");
        let kept = err.clone();
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = e.read_to_string(&mut s);
            *kept.lock().unwrap() = s;
        });
        HostTool { child, what: what.into(), lines, err }
    }

    /// Waits (bounded) until B has a listener on `port`.
    fn wait_listening(&mut self, w: &World, port: u16) {
        let ctx = vrdma::Context::open_at(&w.b.socket).expect("a context on B");
        let at = std::net::SocketAddrV4::new(w.addr(1).parse().unwrap(), port);
        let end = Instant::now() + Duration::from_secs(30);
        while !vrdma::cm::is_listening(&ctx, vrdma::cm::PortSpace::Tcp, at).expect("HasListener") {
            let gone = !matches!(self.child.try_wait(), Ok(None));
            if gone || Instant::now() > end {
                std::thread::sleep(Duration::from_millis(200));
                let out: Vec<String> = self.lines.lock().unwrap().iter().map(|(_, l)| l.clone()).collect();
                panic!(
                    "{} on B never listened on {at} (exited: {gone}):\n{}\n{}",
                    self.what,
                    out.join("\n"),
                    self.err.lock().unwrap()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits (bounded, 60 s) for the process to end: its status and
    /// what it printed, each line with its time since `t0`.
    fn finish(mut self, t0: Instant) -> (Option<std::process::ExitStatus>, String) {
        let end = Instant::now() + Duration::from_secs(60);
        let st = loop {
            if let Ok(Some(s)) = self.child.try_wait() {
                break Some(s);
            }
            if Instant::now() > end {
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        // Its reader threads see the pipes close.
        std::thread::sleep(Duration::from_millis(100));
        let lines = self.lines.lock().unwrap();
        let mut text: String = lines
            .iter()
            .map(|(t, l)| format!("[{:7.3}] {l}\n", t.duration_since(t0).as_secs_f64()))
            .collect();
        text.push_str(&self.err.lock().unwrap());
        (st, text)
    }
}

impl HostTool {
    /// When a line starting with `prefix` came (leading blanks ignored).
    fn line_at(&self, prefix: &str) -> Option<Instant> {
        self.lines.lock().unwrap().iter().find(|(_, l)| l.trim_start().starts_with(prefix)).map(|(t, _)| *t)
    }
}

/// A server on B and its client started in the guest (tag `tag`).
pub struct Pair {
    server: HostTool,
    tag: &'static str,
    pub started: Instant,
}

/// The guest's drop-in says why a call failed (in the client's output).
const DEBUG_ENV: &str = "env VRDMA_RDMACM_DEBUG=1 VRDMA_VERBS_DEBUG=1";

/// `ucmatose` on B (server), then in the guest (client, tag `ucm`).
pub fn start_ucmatose(w: &World, g: &mut Guest) -> Pair {
    let args = format!("-p {UCM_PORT} -c {UCM_CONNECTIONS} -C {UCM_MESSAGES}");
    let a: Vec<&str> = args.split(' ').collect();
    let mut server = HostTool::start(w, "ucmatose (server)", "/usr/bin/ucmatose", &a);
    server.wait_listening(w, UCM_PORT);
    let started = Instant::now();
    guest_bg(g, "ucm", 300, &format!("{DEBUG_ENV} ucmatose -s {} {args}", w.addr(1)));
    Pair { server, tag: "ucm", started }
}

/// Waits (bounded, 120 s) until B's ucmatose has all its connections
/// and begins to send; if it never does, fails with what the guest's
/// client said (B's server waits for ever for a connection its client
/// could not make, e.g. for want of room in the VM's region).
pub fn wait_data(t: &Pair, g: &mut Guest) {
    let end = Instant::now() + Duration::from_secs(120);
    while t.server.line_at("initiating data transfers").is_none() {
        if Instant::now() > end {
            let tag = t.tag;
            let now =
                format!("cat /tmp/{tag}.out; [ -e /tmp/{tag}.st ] || exit 124; exit $(cat /tmp/{tag}.st)");
            let (st, out) = g.run(&now, T).unwrap_or_else(|e| panic!("{tag} in the guest: {e}"));
            panic!(
                "ucmatose never began its data transfers; the guest's (status {st}, 124: running):\n{out}"
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Both ucmatose exited 0 with every message, and the move at
/// `switchover` fell in their data transfers.
pub fn check_ucmatose(g: &mut Guest, t: Pair, switchover: Instant) {
    let (st, out) = guest_wait(g, t.tag);
    let (sending, replied) =
        (t.server.line_at("receiving data transfers"), t.server.line_at("data transfers complete"));
    let began = t.server.line_at("initiating data transfers");
    let started = t.started;
    let (server_st, server_out) = t.server.finish(started);
    let all = format!(
        "the switch-over at {:.3} s\nthe guest's ucmatose (status {st}):\n{out}\nB's ucmatose ({server_st:?}):\n{server_out}",
        switchover.saturating_duration_since(started).as_secs_f64()
    );
    assert_eq!(st, 0, "{all}");
    assert!(server_st.is_some_and(|s| s.success()), "{all}");
    for want in ["data transfers complete", "test complete", "return status 0"] {
        assert!(out.contains(want) && server_out.contains(want), "{want:?} missing\n{all}");
    }
    assert!(server_out.contains("disconnected"), "{all}");
    for bad in ["vrdma librdmacm:", "vrdma-verbs:", "failed", "error"] {
        assert!(!out.contains(bad), "the guest's ucmatose said {bad:?}\n{all}");
    }
    assert!(
        began.is_some_and(|b| b < switchover) && replied.is_some_and(|d| d > switchover),
        "the move did not fall in the data transfers\n{all}"
    );
    let secs = |t: Option<Instant>| t.map_or(f64::NAN, |t| t.duration_since(began.unwrap()).as_secs_f64());
    eprintln!(
        "guest_migrate: ucmatose -c {UCM_CONNECTIONS} -C {UCM_MESSAGES}: from B's first send, B's sends done \
         after {:.1} s, the switch-over after {:.1} s, the guest's replies all in after {:.1} s",
        secs(sending),
        secs(Some(switchover)),
        secs(replied)
    );
}

/// `ib_write_lat -R` on B (server), then in the guest (client, tag
/// `lat`); returns once B runs its exchanges (bounded, 120 s).
pub fn start_lat(w: &World, g: &mut Guest) -> Pair {
    let args = format!("-R -F -d vrdma0 -p {LAT_PORT} -n {LAT_ITERS}");
    let a: Vec<&str> = args.split(' ').collect();
    let mut server = HostTool::start(w, "ib_write_lat -R (server)", "/usr/bin/ib_write_lat", &a);
    server.wait_listening(w, LAT_PORT);
    let started = Instant::now();
    guest_bg(g, "lat", 300, &format!("{DEBUG_ENV} ib_write_lat {args} {}", w.addr(1)));
    let end = Instant::now() + Duration::from_secs(120);
    while server.line_at("#bytes").is_none() {
        assert!(Instant::now() < end, "ib_write_lat never began its exchanges");
        std::thread::sleep(Duration::from_millis(10));
    }
    Pair { server, tag: "lat", started }
}

/// Both ib_write_lat exited 0 with their results, the guest's said
/// nothing of a failure (its `rdma_disconnect` after the move did, when
/// its context was not taken back), and the move at `switchover` fell in
/// the exchanges (B's results came after it).
pub fn check_lat(g: &mut Guest, t: Pair, switchover: Instant) {
    let (st, out) = guest_wait(g, t.tag);
    let running = t.server.line_at("#bytes");
    let started = t.started;
    let lines = t.server.lines.clone();
    let (server_st, server_out) = t.server.finish(started);
    let server_raw: String = lines.lock().unwrap().iter().map(|(_, l)| format!("{l}\n")).collect();
    // Its results' line (`#bytes #iterations ...` values: " 2  3000 ...").
    let results = lines
        .lock()
        .unwrap()
        .iter()
        .find(|(_, l)| l.split_whitespace().nth(1) == Some(LAT_ITERS.to_string().as_str()))
        .map(|(t, _)| *t);
    let all = format!(
        "the switch-over at {:.3} s\nthe guest's ib_write_lat (status {st}):\n{out}\nB's ({server_st:?}):\n{server_out}",
        switchover.saturating_duration_since(started).as_secs_f64()
    );
    assert_eq!(st, 0, "{all}");
    assert!(server_st.is_some_and(|s| s.success()), "{all}");
    for (who, text) in [("the guest's", out.as_str()), ("B's", server_raw.as_str())] {
        assert!(vrdma_it::harness::has_results(text), "{who}: no results\n{all}");
    }
    for bad in ["vrdma librdmacm:", "vrdma-verbs:", "Failed", "ERRNO", "error"] {
        assert!(!out.contains(bad), "the guest's ib_write_lat said {bad:?}\n{all}");
    }
    assert!(
        running.is_some_and(|r| r < switchover) && results.is_some_and(|d| d > switchover),
        "the move did not fall in the exchanges\n{all}"
    );
    eprintln!(
        "guest_migrate: ib_write_lat -R -n {LAT_ITERS}: the switch-over {:.1} s into its exchanges, which ended \
         {:.1} s after it; the guest's results: {}",
        switchover.saturating_duration_since(running.unwrap()).as_secs_f64(),
        results.unwrap().saturating_duration_since(switchover).as_secs_f64(),
        out.lines().rev().nth(1).unwrap_or("").trim()
    );
}
