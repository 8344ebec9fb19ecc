//! Issue 19, item 4 with a real guest: a TCG guest on host A streams
//! sequence-numbered RDMA traffic to a process on host B through vRDMA,
//! and QEMU live-migrates the VM to host C (QEMU's own `migrate`, over
//! QMP, to a second QEMU started with `-incoming` against C's daemon)
//! while the traffic runs, with the operator's steps (`vrdma migrate
//! pause|export|import|finish|resume`) around QEMU's switch-over, as
//! `docs/migration.md` ("Worked example: QEMU moves a VM") describes.
//!
//! The three hosts are daemons (`vrdma daemon`) in three network
//! namespaces on a bridge, each linked to the others; VM `t` is
//! configured on A and C alike. Both QEMUs run here (their ports and
//! region are Unix sockets and memfds, which reach across namespaces);
//! the migration stream goes over a Unix socket.
//!
//! The guest runs `tests/c/seqstream.c` (built here with `cc` against
//! the host's verbs headers, put in the image, run on vRDMA's drop-in):
//! sends with immediate and RDMA writes with immediate carrying their
//! sequence numbers, one every 3 ms, 16 in flight, querying its QP
//! every 20th; it checks that every completion comes once and in order.
//! B's receiver (this test, through the library) checks that every
//! message arrives once, in order, with its bytes. Nothing tells the
//! guest's program or its library about the move: the library finds
//! its port answered by C's daemon (`Ended { NoSession }`), adopts its
//! context there and carries on. Beside it, in the same guest, a second
//! `seqstream` to a second QP on B waits on a completion channel
//! (`seqstream ... chan`: it takes completions only after an event), so
//! a waiter on its channel moves A -> C -> A while its traffic flows;
//! an event lost would leave it stuck (it fails after 30 s without one).
//! And beside both, Debian's `rping` (where the host has it): its client
//! in the guest, connected through rdma_cm to its server on B, moves
//! with the VM and finishes its iterations and its disconnect cleanly.
//!
//! One guest boots per test (TCG: seconds to tens of seconds); the
//! binary prints its times and the pause B saw. The faults (a
//! destination daemon killed, a cancelled migration, a snapshot restored
//! twice) are in `faults.rs`, on a guest of their own, the last ones (the
//! destination's cable cut, the destination dead after the source's
//! `finish`) in `lastfaults.rs`; the downtime with
//! and without vRDMA traffic and B's throughput dip (a figure, run by
//! hand with `--ignored`, its number of hops from `VRDMA_DOWNTIME_HOPS`)
//! in `downtime.rs`; what they share is in `world.rs`.

#[path = "guest_migrate/cmtools.rs"]
mod cmtools;
#[path = "guest_migrate/downtime.rs"]
mod downtime;
#[path = "guest_migrate/faults.rs"]
mod faults;
#[path = "guest_migrate/lastfaults.rs"]
mod lastfaults;
#[path = "guest_migrate/savevm.rs"]
mod savevm;
#[path = "guest_migrate/world.rs"]
mod world;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use vrdma_guest::Guest;
use world::*;

/// Messages streamed, the pace.
const COUNT: u64 = 3000;
const PACE_US: u32 = 3000;
/// Messages B must have before each move (since the last).
const BEFORE: u64 = 60;
/// rping's iterations (`-C`) and port, for the rdma_cm program that
/// moves beside the streams.
const RPING_COUNT: u32 = 1000;
const RPING_PORT: u16 = 7496;

/// A host process, killed (by its pid) and reaped if still running when
/// dropped.
struct Reaped(std::process::Child);

/// rping's server on B and the lines it printed (a thread drains them:
/// `-v` prints one per iteration, more than a pipe holds).
struct RpingServer {
    proc: Reaped,
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Drop for Reaped {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

#[test]
fn qemu_moves_a_streaming_guest_to_another_host() {
    let started = Instant::now();
    let Some(w) = World::new() else { return };

    // The guest on A, its program streaming to B.
    let qmp_a = w.dir.path().join("qmp-a.sock");
    let mut guest = Guest::boot(w.vm.spec(&w.a.socket, &qmp_a, &[])).expect("boot the guest on A");
    eprintln!(
        "guest_migrate: accelerator {}, shell after {:.1} s, set up in {:.1} s",
        guest.accel().name(),
        guest.boot_time().as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    // Two programs, a port each, and rping's two (VM `t` has four).
    guest_ports(&mut guest, if w.rping { 4 } else { 2 });
    let peer = Peer::connect(&w.b, &mut guest, COUNT, PACE_US);
    // Beside it, the same stream from a program that waits on a
    // completion channel (`seqstream ... chan`), to a second QP on B.
    let chan_peer = Peer::connect_as(&w.b, &mut guest, "chan", "chan", COUNT, PACE_US);
    // And Debian's rping, unmodified, on the drop-in librdmacm: its
    // client in the guest, connected through rdma_cm to its server on B,
    // moves with the VM (its event channel, id and QP); it must finish
    // its iterations (`-V`: each validated) and disconnect cleanly.
    let rping_server = w.rping.then(|| start_rping_server(&w));
    if let Some(server) = &rping_server {
        let cmd = format!("rping -c -a {} -p {RPING_PORT} -C {RPING_COUNT} -V", w.addr(1));
        guest_bg(&mut guest, "rping", 170, &cmd);
        // Connected and its buffers registered before the first move (a
        // region the guest registers while its VM moves is a gap of its
        // own: docs/migration.md, "Memory not registered").
        let end = Instant::now() + Duration::from_secs(60);
        while server.lines.lock().unwrap().is_empty() {
            if Instant::now() >= end {
                // What each end said: the guest's client (and its status,
                // if it ended) and the daemons' view of the links.
                let guest_side = guest
                    .run("cat /tmp/rping.out; echo \"status: $(cat /tmp/rping.st 2>/dev/null || echo running)\"", T)
                    .map_or_else(|e| format!("(the guest did not answer: {e})"), |(_, out)| out);
                let stat = |socket: &Path| {
                    let out =
                        std::process::Command::new(VRDMA).arg("--socket").arg(socket).arg("stat").output();
                    out.map_or_else(|e| e.to_string(), |o| String::from_utf8_lossy(&o.stdout).into_owned())
                };
                panic!(
                    "rping's first ping never reached B in 60 s\nthe guest's rping -c:\n{guest_side}\nA's \
                     stat:\n{}\nB's stat:\n{}",
                    stat(&w.a.socket),
                    stat(&w.b.socket)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let rping_started = Instant::now();
    let mut rping_spans = Vec::new();

    let received = AtomicU64::new(0);
    let chan_received = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let (seqs, arrived, chan_seqs, moved) = std::thread::scope(|s| {
        let receiver = s.spawn(|| peer.receive(&received, &stop, Duration::from_secs(120)));
        let chan_receiver = s.spawn(|| chan_peer.receive(&chan_received, &stop, Duration::from_secs(120)));
        let moved = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut g = guest;
            let mut qmp = qmp_a;
            let mut reports = Vec::new();
            let mut switchovers = Vec::new();
            // A -> C -> A, each move with at least BEFORE messages of each
            // stream before it and both still running after it.
            for (k, (from, to)) in
                [(&w.a.socket, &w.c.socket), (&w.c.socket, &w.a.socket)].into_iter().enumerate()
            {
                let (at, chan_at) = (received.load(Ordering::Acquire), chan_received.load(Ordering::Acquire));
                wait_received(&received, at + BEFORE);
                wait_received(&chan_received, chan_at + BEFORE);
                let rping_before = rping_server.is_some() && rping_running(&mut g);
                let (mut next, q, r, stopped) = migrate(&w, k, from, to, g, &qmp);
                if rping_server.is_some() {
                    // Whether rping's connection was up across the move
                    // (running before it, and still after).
                    rping_spans.push(rping_before && rping_running(&mut next));
                }
                switchovers.push(stopped);
                assert!(received.load(Ordering::Acquire) < COUNT, "the stream ended before move {}", k + 1);
                assert!(
                    chan_received.load(Ordering::Acquire) < COUNT,
                    "the channel's stream ended before move {}",
                    k + 1
                );
                reports.push(format!("move {}: {r}", k + 1));
                g = next;
                qmp = q;
            }
            (g, qmp, reports.join("; "), switchovers)
        }));
        if moved.is_err() {
            stop.store(true, Ordering::Release);
        }
        let (seqs, gap) = receiver.join().expect("B's receiver");
        let (chan_seqs, _) = chan_receiver.join().expect("B's receiver of the channel's stream");
        (seqs, gap, chan_seqs, moved)
    });
    let (mut guest, qmp, report, switchovers) = match moved {
        Ok(x) => x,
        Err(p) => std::panic::resume_unwind(p),
    };
    let (st, out) = guest_wait(&mut guest, "seq");
    let (chan_st, chan_out) = guest_wait(&mut guest, "chan");
    if let Some(server) = rping_server {
        check_rping(&mut guest, server, &rping_spans, rping_started);
    }
    if seqs.len() as u64 != COUNT || chan_seqs.len() as u64 != COUNT {
        let stat = std::process::Command::new(VRDMA)
            .arg("--socket")
            .arg(&w.a.socket)
            .args(["stat"])
            .output()
            .unwrap();
        eprintln!(
            "the guest's stream:\n{out}\nthe channel's stream:\n{chan_out}\nA's stat:\n{}",
            String::from_utf8_lossy(&stat.stdout)
        );
    }
    assert_eq!(seqs, (0..COUNT).collect::<Vec<_>>(), "every message once, in order, at B");
    assert_eq!(
        chan_seqs,
        (0..COUNT).collect::<Vec<_>>(),
        "every message of the channel's stream once, in order, at B"
    );
    assert_eq!(st, 0, "the guest's stream:\n{out}");
    assert!(out.contains(&format!("DONE completions={COUNT} in_order=1")), "the guest's stream:\n{out}");
    // The channel's program took every completion after an event, none
    // lost (it would have failed "event lost" or "stalled").
    assert_eq!(chan_st, 0, "the channel's stream:\n{chan_out}");
    let chan_done = chan_out.lines().find(|l| l.starts_with("DONE")).unwrap_or("");
    assert!(
        chan_done.starts_with(&format!("DONE completions={COUNT} in_order=1")),
        "the channel's stream:\n{chan_out}"
    );
    let events: u64 = chan_done
        .split_whitespace()
        .find_map(|f| f.strip_prefix("events="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("the channel's stream:\n{chan_out}"));
    assert!((1..=COUNT).contains(&events), "the channel's events: {chan_done}");
    std::thread::sleep(Duration::from_millis(200));
    for p in [&peer, &chan_peer] {
        assert!(
            vrdma_it::poll_for(&p.side.cq, Duration::from_millis(50)).unwrap().is_empty(),
            "a message twice at B"
        );
        assert_eq!(p.side.qp.query().unwrap().0.qp_state, vrdma::QpState::Rts);
    }
    // The pause B saw at each switch-over: from its last message before
    // QEMU's migration completed to its first after.
    let pauses: Vec<String> = switchovers
        .iter()
        .map(|&at| match pause_around(&arrived, at) {
            Some(p) => format!("{:.0} ms", p.as_secs_f64() * 1e3),
            None => "none measured".into(),
        })
        .collect();
    eprintln!(
        "guest_migrate: {report}; the pause B saw at each switch-over (last message before to first \
         after): {}; the guest: {}; the channel's: {chan_done}; {:.1} s in all",
        pauses.join(", "),
        out.lines().find(|l| l.starts_with("DONE")).unwrap_or(""),
        started.elapsed().as_secs_f64()
    );
    // A third move, A -> C, in the middle of Debian's ucmatose's data
    // transfers (two connections, 16000 messages each way on each:
    // `cmtools.rs`), on the
    // same boot (the streams and rping ended: their ports are free).
    // And a fourth, C -> A, in the middle of perftest's ib_write_lat -R
    // (its exchanges; two rdma_cm event channels on one context).
    if w.cm_tools {
        let t0 = Instant::now();
        let t = cmtools::start_ucmatose(&w, &mut guest);
        cmtools::wait_data(&t, &mut guest);
        let (mut g, qmp, r, stopped) = migrate(&w, 2, &w.a.socket, &w.c.socket, guest, &qmp);
        cmtools::check_ucmatose(&mut g, t, stopped);
        eprintln!("guest_migrate: move 3 (ucmatose): {r}; {:.1} s", t0.elapsed().as_secs_f64());
        let t0 = Instant::now();
        let t = cmtools::start_lat(&w, &mut g);
        let (mut g, _, r, stopped) = migrate(&w, 3, &w.c.socket, &w.a.socket, g, &qmp);
        cmtools::check_lat(&mut g, t, stopped);
        eprintln!("guest_migrate: move 4 (ib_write_lat): {r}; {:.1} s", t0.elapsed().as_secs_f64());
    }
}

/// QEMU moves the VM from A to C while it runs, the operator's steps
/// around the switch-over. Returns the guest on C and what it measured.
fn migrate(
    w: &World,
    k: usize,
    a: &Path,
    c: &Path,
    from: Guest,
    qmp_a: &Path,
) -> (Guest, PathBuf, String, Instant) {
    let mig = w.dir.path().join(format!("migration-{k}.sock"));
    let (mut to, mut qc, qmp_c) =
        w.vm.incoming(&k.to_string(), c, &format!("unix:{}", mig.display()), &from)
            .expect("the destination QEMU");
    if k % 2 == 1 {
        // The operator's one command: QEMU's migration, the daemon step
        // and the destination's cont, over both QEMUs' QMP (which takes
        // one client at a time: ours goes first).
        drop(qc);
        return migrate_in_one_command(a, c, from, to, qmp_a, qmp_c, &mig);
    }
    let mut qa = Qmp::connect(qmp_a).unwrap();
    let t0 = Instant::now();
    qa.migrate(&format!("unix:{}", mig.display())).unwrap();
    let passes = qa.wait_completed().unwrap()["ram"]["dirty-sync-count"].as_u64().unwrap_or(0);
    // The source's CPUs stopped at the switch-over; from here the guest
    // is paused until the destination's `cont`.
    let stopped = Instant::now();
    let live = stopped - t0;
    qc.wait_loaded().unwrap();
    if k == 0 {
        // The operator's steps one by one, the region's bytes carried
        // as a file beside the snapshot (as between two machines).
        let (snap, region) = (w.dir.path().join("t.snap"), w.dir.path().join("t.region"));
        let (snap_s, region_s) = (snap.to_str().unwrap(), region.to_str().unwrap());
        operator(a, &["pause", "--vm", "t"]);
        operator(a, &["export", "--vm", "t", "--out", snap_s, "--region", region_s]);
        operator(c, &["import", "--in", snap_s, "--vm", "t", "--region", region_s]);
        operator(a, &["finish", "--vm", "t"]);
        operator(c, &["resume", "--vm", "t"]);
        std::fs::remove_file(&snap).unwrap();
        std::fs::remove_file(&region).unwrap();
    } else {
        // The one daemon step: `move --vm` copies the region itself.
        operator(a, &["move", "--vm", "t", "--to", c.to_str().unwrap()]);
    }
    qc.exec(r#"{"execute":"cont"}"#).unwrap();
    let paused = stopped.elapsed();
    assert_eq!(qc.status().unwrap(), "running");
    drop(from);
    // The guest answers on C.
    let out = to.check("echo here", T).unwrap_or_else(|e| panic!("the guest on C: {e}"));
    assert!(out.contains("here"), "{out}");
    let report = format!(
        "QEMU's live pass {:.1} s ({passes} dirty syncs), VM stopped {:.0} ms from the switch-over to the \
         destination's cont (operator steps and the region's copy included)",
        live.as_secs_f64(),
        paused.as_secs_f64() * 1e3
    );
    (to, qmp_c, report, stopped)
}

/// [`migrate`] by `vrdma vm migrate`; the switch-over's time from what
/// it printed (the VM's stop, from QEMU's completion to the cont).
fn migrate_in_one_command(
    a: &Path,
    c: &Path,
    from: Guest,
    mut to: Guest,
    qmp_a: &Path,
    qmp_c: PathBuf,
    mig: &Path,
) -> (Guest, PathBuf, String, Instant) {
    let uri = format!("unix:{}", mig.display());
    let out = std::process::Command::new(VRDMA)
        .arg("--socket")
        .arg(a)
        .args(["vm", "migrate", "t", "--to"])
        .arg(c)
        .arg("--qmp")
        .arg(qmp_a)
        .arg("--to-qmp")
        .arg(&qmp_c)
        .args(["--uri", &uri])
        .output()
        .unwrap();
    let done = Instant::now();
    let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "vrdma vm migrate: {said}\n{err}");
    assert!(!err.contains("late-block-activate"), "QEMU refused the capability: {err}");
    let stopped_ms: f64 = said
        .split("the VM stopped ")
        .nth(1)
        .and_then(|r| r.split(" ms").next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("vrdma vm migrate said {said:?}"));
    let stopped = done - Duration::from_secs_f64(stopped_ms / 1e3);
    let mut qc = Qmp::connect(&qmp_c).unwrap();
    assert_eq!(qc.status().unwrap(), "running");
    drop(qc);
    drop(from);
    let out = to.check("echo here", T).unwrap_or_else(|e| panic!("the guest on C: {e}"));
    assert!(out.contains("here"), "{out}");
    (to, qmp_c, format!("by `vrdma vm migrate`: {said}"), stopped)
}

/// rping's server on B (`-s`, every address, `RPING_COUNT` iterations),
/// on the drop-in librdmacm, listening.
fn start_rping_server(w: &World) -> RpingServer {
    let mut server = w
        .host(1, "rping")
        .args(["-s", "-v", "-a", "0.0.0.0", "-p", &RPING_PORT.to_string(), "-C", &RPING_COUNT.to_string()])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("rping -s on B");
    let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let out = server.stdout.take().expect("piped");
    let kept = lines.clone();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            kept.lock().unwrap().push(l);
        }
    });
    let server = RpingServer { proc: Reaped(server), lines };
    let ctx = vrdma::Context::open_at(&w.b.socket).expect("a context on B");
    let at = std::net::SocketAddrV4::new(w.addr(1).parse().unwrap(), RPING_PORT);
    let end = Instant::now() + Duration::from_secs(20);
    while !vrdma::cm::is_listening(&ctx, vrdma::cm::PortSpace::Tcp, at).expect("HasListener") {
        assert!(Instant::now() < end, "rping -s on B never listened on {at}");
        std::thread::sleep(Duration::from_millis(50));
    }
    server
}

/// Whether the guest's rping is still running (its status not written).
fn rping_running(g: &mut Guest) -> bool {
    g.run("test ! -e /tmp/rping.st", T).map(|(st, _)| st == 0).unwrap_or(false)
}

/// The guest's rping finished its iterations, each validated, and both
/// ends exited 0 (the client disconnects at the end; the server exits
/// on its DISCONNECTED); its connection was up across at least the
/// first move.
fn check_rping(guest: &mut Guest, server: RpingServer, spans: &[bool], started: Instant) {
    let RpingServer { proc: mut server, lines } = server;
    let (st, out) = guest_wait(guest, "rping");
    let took = started.elapsed();
    let end = Instant::now() + Duration::from_secs(30);
    let server_st = loop {
        if let Some(s) = server.0.try_wait().expect("rping -s") {
            break Some(s);
        }
        if Instant::now() > end {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let server_out = match server_st {
        Some(_) => {
            let mut o = String::new();
            use std::io::Read;
            if let Some(mut p) = server.0.stderr.take() {
                let _ = p.read_to_string(&mut o);
            }
            o
        }
        None => "(still running after 30 s)".into(),
    };
    eprintln!(
        "guest_migrate: rping -c -C {RPING_COUNT} in the guest: status {st} after {:.1} s; up across the moves: \
         {spans:?}",
        took.as_secs_f64()
    );
    assert_eq!(st, 0, "the guest's rping:\n{out}\nB's rping -s:\n{server_out}");
    for bad in ["error", "failed", "mismatch", "vrdma"] {
        assert!(!out.contains(bad), "the guest's rping said {bad:?}:\n{out}");
    }
    assert!(server_st.is_some_and(|s| s.success()), "B's rping -s: {server_st:?}\n{server_out}");
    // Every iteration once, in order, at B.
    let lines = lines.lock().unwrap();
    let pings: Vec<&String> =
        lines.iter().filter(|l| l.starts_with("server ping data: rdma-ping-")).collect();
    assert_eq!(pings.len(), RPING_COUNT as usize, "B's rping -s printed:\n{}", lines.join("\n"));
    for (n, l) in pings.iter().enumerate() {
        assert!(l.starts_with(&format!("server ping data: rdma-ping-{n}: ")), "B's ping {n}: {l:?}");
    }
    assert!(spans.first() == Some(&true), "rping's connection did not span the first move: {spans:?}");
}
