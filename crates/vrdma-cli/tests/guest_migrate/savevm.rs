//! Issue 19, item 2 with QEMU's own snapshots: `savevm` and `loadvm` in
//! the same QEMU (its state, the ivshmem region included, kept in the
//! VM's qcow2 scratch disk), with the daemon's step beside each
//! (`docs/migration.md`, "Snapshots with savevm and loadvm"):
//!
//! - save (`vrdma vm savevm --stay-stopped`): QEMU's `stop`, `vrdma
//!   migrate pause` and `export --region` (the tenant's state and its
//!   region's bytes, as QEMU saves them), then `savevm`;
//! - restore (`vrdma vm loadvm`): QEMU's `stop`, the running tenant
//!   dropped (`pause`, `finish`), `loadvm`, `import --region` and
//!   `resume`, `cont`.
//!
//! A guest on the daemon at `at` streams to B (`seqstream`, tag `sv`).
//! Restored while B still holds its QP (nothing ran on since the save),
//! the stream goes on, every message once; saved again and run on (the
//! tenant resumed where it was, `cont`), then restored after B moved on:
//! the restored QP fails `RETRY_EXC_ERR`, the rest flushed, in ERR, and
//! B gets nothing from it and stays in RTS. The guest's library finds
//! its session gone after `loadvm` (its port probed, `NoSession`) and
//! takes its context back on the same port.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use vrdma_guest::Guest;

use super::world::*;

const COUNT: u64 = MAX_COUNT - 1;
const PACE_US: u32 = 3000;
/// Messages B must have after each step.
const AFTER: u64 = 40;

/// Waits for `AFTER` more messages at B; the stream still runs.
fn goes_on(g: &mut Guest, received: &AtomicU64) {
    wait_received(received, received.load(Ordering::Acquire) + AFTER);
    guest_running(g, "sv");
}

/// The files `vrdma vm savevm` keeps for snapshot `tag` of VM `t`.
fn files(w: &World, tag: &str) -> [PathBuf; 2] {
    let d = w.dir.path();
    [d.join(format!("t@{tag}.snap")), d.join(format!("t@{tag}.region"))]
}

/// Runs `vrdma --socket AT vm VERB t --qmp QMP --tag TAG --dir DIR ...`
/// with the test's own QMP connection closed (QEMU's QMP takes one
/// client at a time); the connection again after it.
fn vm_command(w: &World, q: Qmp, qmp: &Path, at: &Path, verb: &str, tag: &str, extra: &[&str]) -> Qmp {
    drop(q);
    let out = std::process::Command::new(VRDMA)
        .arg("--socket")
        .arg(at)
        .args(["vm", verb, "t", "--tag", tag, "--dir"])
        .arg(w.dir.path())
        .arg("--qmp")
        .arg(qmp)
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "vrdma vm {verb} {tag}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Qmp::connect(qmp).unwrap()
}

/// The save (`vrdma vm savevm --stay-stopped`): the VM stopped, the
/// tenant paused and exported with its region, then QEMU's `savevm TAG`.
/// The VM stays stopped, the tenant paused.
fn save(w: &World, q: Qmp, qmp: &Path, at: &Path, tag: &str) -> Qmp {
    let mut q = vm_command(w, q, qmp, at, "savevm", tag, &["--stay-stopped"]);
    assert_eq!(q.status().unwrap(), "paused");
    q
}

/// The restore of the stopped VM (`vrdma vm loadvm`): the running tenant
/// dropped, QEMU's `loadvm TAG`, the tenant's state and region imported
/// and resumed; the VM stays stopped, as it was (QEMU's own `loadvm`
/// keeps the run state too), and is continued here.
fn restore(w: &World, g: &mut Guest, q: Qmp, qmp: &Path, at: &Path, tag: &str) -> Qmp {
    let mut q = vm_command(w, q, qmp, at, "loadvm", tag, &[]);
    assert_eq!(q.status().unwrap(), "paused");
    q.exec(r#"{"execute":"cont"}"#).unwrap();
    assert_eq!(q.status().unwrap(), "running");
    let out = g.check("echo here", T).unwrap_or_else(|e| panic!("the guest after loadvm {tag}: {e}"));
    assert!(out.contains("here"), "{out}");
    q
}

/// Runs both cases on `g` (on the daemon at `at`, its QMP `q`, with the
/// world's scratch disk); returns what it saw.
pub fn savevm_and_loadvm(w: &World, g: &mut Guest, q: Qmp, qmp: &Path, at: &Path) -> (String, Qmp) {
    let peer = Peer::connect_as(&w.b, g, "sv", "", COUNT, PACE_US);
    let received = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let (seqs, outcome) = std::thread::scope(|s| {
        let receiver = s.spawn(|| peer.receive(&received, &stop, Duration::from_secs(240)));
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            wait_received(&received, AFTER);
            // 1. Saved, then restored at once: B still holds the QP
            //    (it has nothing newer than the snapshot).
            let t0 = Instant::now();
            let q = save(w, q, qmp, at, "sv1");
            let saved = t0.elapsed();
            let t1 = Instant::now();
            let q = restore(w, g, q, qmp, at, "sv1");
            let restored = t1.elapsed();
            goes_on(g, &received);
            // 2. Saved, and the VM runs on (the tenant resumed where it
            //    was): B moves on past the snapshot.
            let t3 = Instant::now();
            let mut q = save(w, q, qmp, at, "sv2");
            let saved2 = t3.elapsed();
            operator(at, &["resume", "--vm", "t"]);
            q.exec(r#"{"execute":"cont"}"#).unwrap();
            goes_on(g, &received);
            // Restored after that: the restored QP is a stale copy.
            q.exec(r#"{"execute":"stop"}"#).unwrap();
            operator(at, &["pause", "--vm", "t"]);
            std::thread::sleep(Duration::from_millis(300));
            let at_restore = received.load(Ordering::Acquire);
            let t2 = Instant::now();
            let q = restore(w, g, q, qmp, at, "sv2");
            let (st, out) = guest_wait(g, "sv");
            let failed = t2.elapsed();
            assert_eq!(st, 1, "the stream restored after B moved on:\n{out}");
            assert!(
                out.contains("FAIL completion") && out.contains(": transport retry counter exceeded"),
                "the restored stream's oldest request fails RETRY_EXC_ERR:\n{out}"
            );
            let drained = drained(&out);
            std::thread::sleep(Duration::from_millis(500));
            assert_eq!(
                received.load(Ordering::Acquire),
                at_restore,
                "B took a message from the restored copy"
            );
            for n in ["sv1", "sv2"] {
                for f in files(w, n) {
                    std::fs::remove_file(f).unwrap();
                }
            }
            (
                q,
                at_restore,
                format!(
                    "savevm then loadvm at once: went on (save {:.1} s, restore {:.1} s); savevm (save {:.1} s), \
                     ran on, loadvm: its QP failed in {:.1} s ({drained})",
                    saved.as_secs_f64(),
                    restored.as_secs_f64(),
                    saved2.as_secs_f64(),
                    failed.as_secs_f64()
                ),
            )
        }));
        stop.store(true, Ordering::Release);
        let (seqs, _) = receiver.join().expect("B's receiver");
        (seqs, outcome)
    });
    let (q, at_restore, report) = match outcome {
        Ok(o) => o,
        Err(p) => std::panic::resume_unwind(p),
    };
    assert_eq!(seqs, (0..at_restore).collect::<Vec<_>>(), "every message once, in order, at B, none after");
    assert!(
        vrdma_it::poll_for(&peer.side.cq, Duration::from_millis(50)).unwrap().is_empty(),
        "a message twice at B"
    );
    assert_eq!(peer.side.qp.query().unwrap().0.qp_state, vrdma::QpState::Rts);
    (report, q)
}
