//! Issue 19, item 4's faults with a real guest, one guest boot for all
//! of them: a TCG guest on A streams to B (`seqstream`, as in the move
//! test) while, in turn,
//!
//! 1. QEMU's migration to C is cancelled in its live pass
//!    (`migrate_cancel`): no daemon step, the VM runs on at A;
//! 2. the operator cancels after QEMU's switch-over, once the tenant was
//!    paused, exported and imported at C: `vrdma migrate finish` at C,
//!    `resume` at A and QEMU's `cont` there;
//! 3. C's daemon is killed (SIGKILL) after it imported the tenant, before
//!    A's `finish`: the operator resumes at A and `cont`s there;
//! 4. C's daemon is killed while C's QEMU receives the VM: `vrdma migrate
//!    move --vm t` then fails at C and resumes the tenant at A itself;
//!
//! in each, B gets every message once, in order, with its bytes (checked
//! as they come and at the end), the guest's program sees every
//! completion once, in order, successful (it stops at the first that is
//! not), and both go on after. Then
//!
//! 5. a snapshot: QEMU's migration to a file (written by this test from
//!    a Unix socket, so that the file is whole when QEMU says completed:
//!    an `exec:cat > FILE` child may still be writing then), the
//!    tenant paused and exported with its region (`export --region`) at
//!    A, then dropped there (the VM is off); restored on C (`-incoming
//!    "exec:cat FILE"`, then `import --region` and resume), the
//!    stream goes on where B held it, exactly once; that copy is stopped
//!    (paused, finished) and the same snapshot restored on C again: B
//!    has moved on, so B's daemon refuses the copy's Moved frame (its
//!    epoch is the one the first copy proved) and drops its frames; the
//!    guest's program sees its oldest request fail `RETRY_EXC_ERR`, the
//!    rest flushed, its QP in ERR, within its retry budget; B delivers
//!    nothing more and stays in RTS;
//! 6. QEMU's own snapshots (`savevm`/`loadvm`, on a blank qcow2 scratch
//!    disk every QEMU here has) of that guest, streaming anew
//!    (`savevm.rs`);
//! 7. the destination's cable cut between its import and its resume, and
//!    a destination daemon that dies after the source's `finish` (before
//!    its own resume, and after the whole move), each on a stream of its
//!    own (`lastfaults.rs`).
//!
//! The guest boots once; the savevm part runs only where `qemu-img`
//! exists (`apt-get install qemu-utils`).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use vrdma_guest::Guest;

use super::world::*;

/// The stream outlasts every fault (it never completes: the last fault
/// ends it); its RDMA writes fit B's region.
const COUNT: u64 = MAX_COUNT - 1;
const PACE_US: u32 = 3000;
/// Messages B must have after each fault (and before the next).
const AFTER: u64 = 40;

/// What the faults left to check once B's receiver stopped.
struct Outcome {
    /// Messages B had when the restored copy stopped for good.
    at_second_restore: u64,
    report: Vec<String>,
    /// The twice-restored guest (on C) and its QMP, for QEMU's own
    /// snapshots next (`savevm.rs`).
    guest: Guest,
    qmp: Qmp,
    qmp_path: PathBuf,
}

#[test]
fn a_dead_destination_a_cancelled_migration_a_cut_cable_and_a_snapshot_restored_twice() {
    let started = Instant::now();
    let Some(mut w) = World::new() else { return };
    // A scratch disk for QEMU's savevm, at the end.
    let disk = w.with_disk();
    let qmp_a = w.dir.path().join("qmp-fa.sock");
    let mut guest = Guest::boot(w.vm.spec(&w.a.socket, &qmp_a, &[])).expect("boot the guest on A");
    let boot = guest.boot_time();
    let peer = Peer::connect(&w.b, &mut guest, COUNT, PACE_US);
    let received = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let (seqs, outcome) = std::thread::scope(|s| {
        let receiver = s.spawn(|| peer.receive(&received, &stop, Duration::from_secs(300)));
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            faults(&mut w, guest, &qmp_a, &received)
        }));
        // The stream never completes here: the last fault ends it.
        stop.store(true, Ordering::Release);
        let (seqs, _) = receiver.join().expect("B's receiver");
        (seqs, outcome)
    });
    let mut outcome = match outcome {
        Ok(o) => o,
        Err(p) => std::panic::resume_unwind(p),
    };
    let n = outcome.at_second_restore;
    assert_eq!(seqs, (0..n).collect::<Vec<_>>(), "every message once, in order, at B, and none after");
    assert!(
        vrdma_it::poll_for(&peer.side.cq, Duration::from_millis(50)).unwrap().is_empty(),
        "a message twice at B"
    );
    assert_eq!(peer.side.qp.query().unwrap().0.qp_state, vrdma::QpState::Rts);
    // QEMU's own snapshots (savevm, loadvm) of the same guest, on C.
    if disk {
        let t0 = Instant::now();
        let (r, q) = super::savevm::savevm_and_loadvm(
            &w,
            &mut outcome.guest,
            outcome.qmp,
            &outcome.qmp_path,
            &w.c.socket,
        );
        outcome.qmp = q;
        outcome.report.push(format!("{r} ({:.1} s)", t0.elapsed().as_secs_f64()));
    }
    // The faults that end the guest's streams, then its device, for good
    // (`lastfaults.rs`): the destination's cable cut, a destination that
    // dies after the source's finish.
    let Outcome { guest, qmp, mut report, .. } = outcome;
    report.extend(super::lastfaults::cut_and_dead_destination(&mut w, guest, qmp));
    eprintln!(
        "guest_migrate faults: boot {:.1} s; {}; {n} messages at B; {:.1} s in all",
        boot.as_secs_f64(),
        report.join("; "),
        started.elapsed().as_secs_f64()
    );
}

/// Waits for `AFTER` more messages at B, and checks the guest's program
/// still runs (it ends at the first completion that is not a success).
fn goes_on(g: &mut Guest, received: &AtomicU64) {
    wait_received(received, received.load(Ordering::Acquire) + AFTER);
    guest_running(g, "seq");
}

/// QEMU's migration bandwidth, bytes/s.
fn bandwidth(q: &mut Qmp) -> u64 {
    q.exec(r#"{"execute":"query-migrate-parameters"}"#).unwrap()["max-bandwidth"]
        .as_u64()
        .expect("max-bandwidth")
}

fn set_bandwidth(q: &mut Qmp, bytes_per_s: u64) {
    let cmd =
        serde_json::json!({"execute": "migrate-set-parameters", "arguments": {"max-bandwidth": bytes_per_s}});
    q.exec(&cmd.to_string()).unwrap();
}

/// Until QEMU's migration is under way, some RAM sent.
fn sending(m: &serde_json::Value) -> bool {
    m["status"].as_str() == Some("active") && m["ram"]["transferred"].as_u64().unwrap_or(0) > 0
}

/// A's VM runs again (its CPUs), after a migration that did not happen.
fn runs_again(qa: &mut Qmp) {
    if qa.status().unwrap() != "running" {
        qa.exec(r#"{"execute":"cont"}"#).unwrap();
    }
    assert_eq!(qa.status().unwrap(), "running");
}

/// Accepts QEMU's migration on `socket` and writes it to `file` until
/// QEMU closes it (bounded: 60 s to connect, 30 s without a byte);
/// returns the bytes written.
fn save_to(socket: &std::path::Path, file: &std::path::Path) -> std::thread::JoinHandle<u64> {
    let listener = std::os::unix::net::UnixListener::bind(socket).unwrap();
    listener.set_nonblocking(true).unwrap();
    let file = file.to_path_buf();
    std::thread::spawn(move || {
        let end = Instant::now() + Duration::from_secs(60);
        let mut s = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    assert!(Instant::now() < end, "QEMU never connected to save its state");
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => panic!("accept QEMU's migration: {e}"),
            }
        };
        s.set_nonblocking(false).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut f = std::fs::File::create(&file).unwrap();
        let n = std::io::copy(&mut s, &mut f).expect("QEMU's state");
        f.sync_all().unwrap();
        n
    })
}

fn faults(w: &mut World, mut guest: Guest, qmp_a: &std::path::Path, received: &AtomicU64) -> Outcome {
    let mut report = Vec::new();
    let (a, c) = (w.a.socket.clone(), w.c.socket.clone());
    let dir = w.dir.path().to_path_buf();
    let mig = |k: &str| format!("unix:{}", dir.join(format!("mig-{k}.sock")).display());
    let snap = dir.join("t.snap");
    let snap_s = snap.to_str().unwrap().to_string();
    let rfile = dir.join("t.region");
    let rfile_s = rfile.to_str().unwrap().to_string();
    wait_received(received, AFTER);
    let mut qa = Qmp::connect(qmp_a).unwrap();
    let full = bandwidth(&mut qa);

    // 1. QEMU's migration cancelled in its live pass (slowed so that the
    //    cancel falls in it): the daemons were never told; the VM runs on.
    let (dest, _qc, _) = w.vm.incoming("cancel", &c, &mig("cancel"), &guest).expect("the destination QEMU");
    set_bandwidth(&mut qa, 4 << 20);
    qa.migrate(&mig("cancel")).unwrap();
    qa.wait_migration(sending).unwrap();
    qa.exec(r#"{"execute":"migrate_cancel"}"#).unwrap();
    let m = qa
        .wait_migration(|m| m["status"].as_str().is_some_and(|s| s != "active" && s != "cancelling"))
        .unwrap();
    assert_eq!(m["status"].as_str(), Some("cancelled"), "{m}");
    set_bandwidth(&mut qa, full);
    assert_eq!(qa.status().unwrap(), "running");
    drop(dest);
    goes_on(&mut guest, received);
    report.push("QEMU's migrate_cancel in the live pass: the VM ran on at A".to_string());

    // 2. Cancelled by the operator after QEMU's switch-over, the tenant
    //    paused and exported: resume at A, A's CPUs again.
    let (dest, mut qc, _) = w.vm.incoming("abort", &c, &mig("abort"), &guest).expect("the destination QEMU");
    qa.migrate(&mig("abort")).unwrap();
    qa.wait_completed().unwrap();
    let stopped = Instant::now();
    qc.wait_loaded().unwrap();
    operator(&a, &["pause", "--vm", "t"]);
    operator(&a, &["export", "--vm", "t", "--out", &snap_s, "--region", &rfile_s]);
    operator(&c, &["import", "--in", &snap_s, "--vm", "t", "--region", &rfile_s]);
    // The operator changes their mind: C lets go of its (never resumed)
    // copy, A resumes.
    operator(&c, &["finish", "--vm", "t"]);
    operator(&a, &["resume", "--vm", "t"]);
    runs_again(&mut qa);
    let held = stopped.elapsed();
    drop(dest);
    std::fs::remove_file(&snap).unwrap();
    std::fs::remove_file(&rfile).unwrap();
    goes_on(&mut guest, received);
    report.push(format!("cancelled after the switch-over: VM stopped {:.0} ms", held.as_secs_f64() * 1e3));

    // 3. C's daemon killed after its import, before A's finish: the
    //    operator resumes at A.
    let (dest, mut qc, _) = w.vm.incoming("dies", &c, &mig("dies"), &guest).expect("the destination QEMU");
    qa.migrate(&mig("dies")).unwrap();
    qa.wait_completed().unwrap();
    qc.wait_loaded().unwrap();
    operator(&a, &["pause", "--vm", "t"]);
    operator(&a, &["export", "--vm", "t", "--out", &snap_s, "--region", &rfile_s]);
    operator(&c, &["import", "--in", &snap_s, "--vm", "t", "--region", &rfile_s]);
    w.c.kill();
    let (ok, text) = operator_try(&c, &["resume", "--vm", "t"]);
    assert!(!ok, "a resume at the dead daemon succeeded: {text}");
    operator(&a, &["resume", "--vm", "t"]);
    runs_again(&mut qa);
    drop(dest);
    std::fs::remove_file(&snap).unwrap();
    std::fs::remove_file(&rfile).unwrap();
    goes_on(&mut guest, received);
    report.push("C's daemon killed after its import: resumed at A".to_string());

    // 4. C's daemon killed while C's QEMU receives the VM: `move` fails
    //    at C and resumes the tenant at A by itself.
    w.c.restart();
    for d in [&w.a, &w.b, &w.c] {
        d.wait_links(2);
    }
    let (dest, _qc, _) =
        w.vm.incoming("dies-early", &c, &mig("dies-early"), &guest).expect("the destination QEMU");
    set_bandwidth(&mut qa, 4 << 20);
    qa.migrate(&mig("dies-early")).unwrap();
    qa.wait_migration(sending).unwrap();
    w.c.kill();
    set_bandwidth(&mut qa, full);
    let m =
        qa.wait_migration(|m| m["status"].as_str().is_some_and(|s| s != "active" && s != "setup")).unwrap();
    let how = match m["status"].as_str() {
        Some("completed") => {
            let (ok, text) = operator_try(&a, &["move", "--vm", "t", "--to", c.to_str().unwrap()]);
            assert!(!ok && text.contains("resumed at"), "move to a dead daemon: {text}");
            "QEMU's migration completed, `move` failed at C and resumed at A"
        }
        // The destination QEMU gave up: the source runs on by itself.
        Some("failed") => "QEMU's migration failed",
        _ => panic!("QEMU's migration: {m}"),
    };
    runs_again(&mut qa);
    drop(dest);
    goes_on(&mut guest, received);
    report.push(format!("C's daemon killed while QEMU received: {how}; the VM ran on at A"));
    w.c.restart();
    for d in [&w.a, &w.b, &w.c] {
        d.wait_links(2);
    }

    // 5. A snapshot: QEMU's migration to a file, the tenant's state and
    //    region saved at A, the VM off (its tenant dropped at A).
    let file = dir.join("vm.state");
    let saving = save_to(&dir.join("save.sock"), &file);
    qa.migrate(&format!("unix:{}", dir.join("save.sock").display())).unwrap();
    qa.wait_completed().unwrap();
    let saved = saving.join().expect("the saver");
    assert!(saved > 1 << 20, "QEMU's state: {saved} bytes");
    operator(&a, &["pause", "--vm", "t"]);
    operator(&a, &["export", "--vm", "t", "--out", &snap_s, "--region", &rfile_s]);
    operator(&a, &["finish", "--vm", "t"]);
    drop(qa);
    guest.kill().unwrap();
    let restore = |tag: &str| {
        let (mut g, mut q, path) =
            w.vm.incoming(tag, &c, &format!("exec:cat {}", file.display()), &guest)
                .expect("the destination QEMU");
        q.wait_loaded().unwrap();
        operator(&c, &["import", "--in", &snap_s, "--vm", "t", "--region", &rfile_s]);
        operator(&c, &["resume", "--vm", "t"]);
        q.exec(r#"{"execute":"cont"}"#).unwrap();
        assert_eq!(q.status().unwrap(), "running");
        let out = g.check("echo here", T).unwrap_or_else(|e| panic!("the restored guest: {e}"));
        assert!(out.contains("here"), "{out}");
        (g, q, path)
    };
    // Restored once: the stream goes on where B held it.
    let (mut g1, mut q1, _) = restore("restore-1");
    goes_on(&mut g1, received);
    // That copy stops for good.
    q1.exec(r#"{"execute":"stop"}"#).unwrap();
    operator(&c, &["pause", "--vm", "t"]);
    operator(&c, &["finish", "--vm", "t"]);
    g1.kill().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let at_second_restore = received.load(Ordering::Acquire);
    // Restored again, after B moved on: the copy's QP fails cleanly.
    let t0 = Instant::now();
    let (mut g2, q2, qmp_path) = restore("restore-2");
    let (st, out) = guest_wait(&mut g2, "seq");
    let failed = t0.elapsed();
    assert_eq!(st, 1, "the twice-restored stream:\n{out}");
    assert!(
        out.contains("FAIL completion") && out.contains(": transport retry counter exceeded"),
        "the twice-restored stream's oldest request fails RETRY_EXC_ERR:\n{out}"
    );
    let drained = drained(&out);
    // Nothing more reaches B.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(received.load(Ordering::Acquire), at_second_restore, "B took a message from the stale copy");
    std::fs::remove_file(&file).unwrap();
    std::fs::remove_file(&snap).unwrap();
    std::fs::remove_file(&rfile).unwrap();
    report.push(format!(
        "a snapshot restored once went on ({} messages at B), restored twice its QP failed in {:.1} s ({drained})",
        at_second_restore,
        failed.as_secs_f64()
    ));
    Outcome { at_second_restore, report, guest: g2, qmp: q2, qmp_path }
}
