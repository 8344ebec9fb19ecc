//! Issue 19, item 2 with QEMU's own snapshots: `savevm` and `loadvm` in
//! the same QEMU (its state, the ivshmem region included, kept in the
//! VM's qcow2 scratch disk), with the daemon's step beside each
//! (`docs/migration.md`, "Snapshots with savevm and loadvm"):
//!
//! - save: QEMU's `stop`, `vrdma migrate pause` and `export --region`
//!   (the tenant's state and its region's bytes, as QEMU saves them), then
//!   `savevm`;
//! - restore: QEMU's `stop`, the running tenant dropped (`pause`,
//!   `finish`), `loadvm`, `import --region` and `resume`, `cont`.
//!
//! A guest on the daemon at `at` streams to B (`seqstream`, tag `sv`).
//! Restored while B still holds its QP (nothing ran on since the save),
//! the stream goes on, every message once; saved again and run on (the
//! tenant resumed where it was, `cont`), then restored after B moved on:
//! the restored QP fails `RETRY_EXC_ERR`, the rest flushed, in ERR, and
//! B gets nothing from it and stays in RTS. The guest's library finds
//! its session gone after `loadvm` (its port probed, `NoSession`) and
//! takes its context back on the same port.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use vrdma_guest::Guest;

use super::world::*;

const COUNT: u64 = MAX_COUNT - 1;
const PACE_US: u32 = 3000;
/// Messages B must have after each step.
const AFTER: u64 = 40;

/// An HMP command through QMP (its answer within 120 s); its text must
/// be empty (HMP reports errors as text).
fn hmp(q: &mut Qmp, line: &str) {
    let cmd = serde_json::json!({"execute": "human-monitor-command", "arguments": {"command-line": line}});
    let out = q.exec_within(&cmd.to_string(), Duration::from_secs(120)).unwrap();
    let text = out.as_str().unwrap_or("");
    assert!(text.trim().is_empty(), "QEMU's `{line}`: {text}");
}

/// Waits for `AFTER` more messages at B; the stream still runs.
fn goes_on(g: &mut Guest, received: &AtomicU64) {
    wait_received(received, received.load(Ordering::Acquire) + AFTER);
    guest_running(g, "sv");
}

/// The files of snapshot `name`: the tenant's state and its region.
fn files(w: &World, name: &str) -> (String, String) {
    let d = w.dir.path();
    let f = |ext: &str| d.join(format!("{name}.{ext}")).to_str().unwrap().to_string();
    (f("snap"), f("region"))
}

/// The save: the VM stopped, the tenant paused and exported with its
/// region, then QEMU's `savevm NAME`. The VM stays stopped, the tenant
/// paused.
fn save(w: &World, q: &mut Qmp, at: &Path, name: &str) {
    let (snap, region) = files(w, name);
    q.exec(r#"{"execute":"stop"}"#).unwrap();
    operator(at, &["pause", "--vm", "t"]);
    operator(at, &["export", "--vm", "t", "--out", &snap, "--region", &region]);
    hmp(q, &format!("savevm {name}"));
}

/// The restore, the VM stopped: the running tenant dropped, QEMU's
/// `loadvm NAME`, the tenant's state and region imported and resumed,
/// `cont`.
fn restore(w: &World, g: &mut Guest, q: &mut Qmp, at: &Path, name: &str) {
    let (snap, region) = files(w, name);
    operator(at, &["finish", "--vm", "t"]);
    hmp(q, &format!("loadvm {name}"));
    operator(at, &["import", "--in", &snap, "--vm", "t", "--region", &region]);
    operator(at, &["resume", "--vm", "t"]);
    q.exec(r#"{"execute":"cont"}"#).unwrap();
    assert_eq!(q.status().unwrap(), "running");
    let out = g.check("echo here", T).unwrap_or_else(|e| panic!("the guest after loadvm {name}: {e}"));
    assert!(out.contains("here"), "{out}");
}

/// Runs both cases on `g` (on the daemon at `at`, its QMP `q`, with the
/// world's scratch disk); returns what it saw.
pub fn savevm_and_loadvm(w: &World, g: &mut Guest, q: &mut Qmp, at: &Path) -> String {
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
            save(w, q, at, "sv1");
            let saved = t0.elapsed();
            let t1 = Instant::now();
            restore(w, g, q, at, "sv1");
            let restored = t1.elapsed();
            goes_on(g, &received);
            // 2. Saved, and the VM runs on (the tenant resumed where it
            //    was): B moves on past the snapshot.
            let t3 = Instant::now();
            save(w, q, at, "sv2");
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
            restore(w, g, q, at, "sv2");
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
                let (snap, region) = files(w, n);
                std::fs::remove_file(snap).unwrap();
                std::fs::remove_file(region).unwrap();
            }
            (
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
    let (at_restore, report) = match outcome {
        Ok(o) => o,
        Err(p) => std::panic::resume_unwind(p),
    };
    assert_eq!(seqs, (0..at_restore).collect::<Vec<_>>(), "every message once, in order, at B, none after");
    assert!(
        vrdma_it::poll_for(&peer.side.cq, Duration::from_millis(50)).unwrap().is_empty(),
        "a message twice at B"
    );
    assert_eq!(peer.side.qp.query().unwrap().0.qp_state, vrdma::QpState::Rts);
    report
}
