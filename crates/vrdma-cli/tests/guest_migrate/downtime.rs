//! Issue 19, item 5, as a figure run by hand (`--ignored`): the downtime
//! vRDMA adds over QEMU's own migration of the same VM. One guest, moved
//! A → C → A ... `HOPS` times with no vRDMA context open in it (QEMU's
//! migration alone: no daemon step; the anchor), then `HOPS` times while
//! `seqstream` streams to B (with `vrdma migrate move --vm t` between
//! QEMU's completion and `cont`), in the same run, on the same daemons.
//! Per hop: QEMU's own `downtime` (query-migrate), the time from QEMU's
//! completion to the destination's `cont` answered (what the operator's
//! step adds), and, with traffic, the pause B saw. Printed as medians
//! with the ratio of traffic to anchor; under TCG the figures are
//! functional only (the goal, at most 50 ms added, is for KVM). It
//! checks what it can: every message once, in order, at B, and the
//! guest's stream still running after every hop.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use vrdma_guest::Guest;

use super::world::*;

const HOPS: usize = 5;
const COUNT: u64 = MAX_COUNT - 1;
const PACE_US: u32 = 3000;
const BEFORE: u64 = 40;

/// One hop's figures.
struct Hop {
    /// QEMU's `downtime` (ms): the source stopped to the migration's end.
    qemu_ms: f64,
    /// QEMU's completion (seen by polling) to the destination's `cont`.
    to_cont_ms: f64,
    /// When QEMU's completion was seen.
    completed: Instant,
}

/// Moves the guest from the daemon at `from` to the one at `to` with
/// QEMU's migration, with `move --vm t` after its completion if
/// `daemon_step`.
fn hop(
    w: &World,
    tag: &str,
    from: &Path,
    to: &Path,
    g: Guest,
    qmp: &Path,
    daemon_step: bool,
) -> (Guest, PathBuf, Hop) {
    let mig = w.dir.path().join(format!("mig-{tag}.sock"));
    let (mut next, mut qc, qmp_c) = w.incoming(tag, to, &format!("unix:{}", mig.display()), &g);
    let mut qa = Qmp::connect(qmp);
    qa.migrate(&format!("unix:{}", mig.display()));
    qa.wait_completed();
    let completed = Instant::now();
    let m = qa.exec(r#"{"execute":"query-migrate"}"#);
    qc.wait_loaded();
    if daemon_step {
        operator(from, &["move", "--vm", "t", "--to", to.to_str().unwrap()]);
    }
    qc.exec(r#"{"execute":"cont"}"#);
    let to_cont_ms = completed.elapsed().as_secs_f64() * 1e3;
    drop(qa);
    drop(g);
    let out = next.check("echo here", T).unwrap_or_else(|e| panic!("the guest after hop {tag}: {e}"));
    assert!(out.contains("here"), "{out}");
    let qemu_ms = m["downtime"].as_f64().unwrap_or(f64::NAN);
    (next, qmp_c, Hop { qemu_ms, to_cont_ms, completed })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[test]
#[ignore = "a figure (issue 19 item 5), not a test: 2 x 5 migrations of a TCG guest, about a minute; run by hand \
            with --ignored --nocapture"]
fn downtime_with_and_without_vrdma_traffic() {
    let Some(w) = World::new() else { return };
    let qmp_a = w.dir.path().join("qmp-da.sock");
    let mut g = Guest::boot(w.spec(&w.a.socket, &qmp_a, &[])).expect("boot the guest on A");
    let accel = g.accel().name();
    let mut qmp = qmp_a;
    let ends = [w.a.socket.clone(), w.c.socket.clone()];
    let mut at = 0;
    // The anchor: no vRDMA context in the guest, QEMU's migration alone.
    let mut idle = Vec::new();
    for k in 0..HOPS {
        let (ng, nq, h) = hop(&w, &format!("idle-{k}"), &ends[at], &ends[1 - at], g, &qmp, false);
        (g, qmp, at) = (ng, nq, 1 - at);
        idle.push(h);
    }
    // With traffic: the stream from wherever the guest is now.
    let peer = Peer::connect(&w.b, &mut g, COUNT, PACE_US);
    let received = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let (seqs, arrived, busy) = std::thread::scope(|s| {
        let receiver = s.spawn(|| peer.receive(&received, &stop, Duration::from_secs(300)));
        let busy = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut hops = Vec::new();
            for k in 0..HOPS {
                wait_received(&received, received.load(Ordering::Acquire) + BEFORE);
                let (ng, nq, h) = hop(&w, &format!("busy-{k}"), &ends[at], &ends[1 - at], g, &qmp, true);
                (g, qmp, at) = (ng, nq, 1 - at);
                hops.push(h);
            }
            wait_received(&received, received.load(Ordering::Acquire) + BEFORE);
            guest_running(&mut g, "seq");
            hops
        }));
        stop.store(true, Ordering::Release);
        let (seqs, arrived) = receiver.join().expect("B's receiver");
        (seqs, arrived, busy)
    });
    let busy = busy.unwrap_or_else(|p| std::panic::resume_unwind(p));
    assert_eq!(seqs, (0..seqs.len() as u64).collect::<Vec<_>>(), "every message once, in order, at B");
    let pauses: Vec<f64> = busy
        .iter()
        .filter_map(|h| pause_around(&arrived, h.completed))
        .map(|d| d.as_secs_f64() * 1e3)
        .collect();
    let (qi, qb) =
        (median(idle.iter().map(|h| h.qemu_ms).collect()), median(busy.iter().map(|h| h.qemu_ms).collect()));
    let (ci, cb) = (
        median(idle.iter().map(|h| h.to_cont_ms).collect()),
        median(busy.iter().map(|h| h.to_cont_ms).collect()),
    );
    eprintln!(
        "guest_migrate downtime ({accel}{}; medians of {HOPS} hops each, the same VM and daemons): QEMU's \
         downtime {qb:.0} ms with vRDMA traffic, {qi:.0} ms without (x{:.2}); QEMU's completion to the \
         destination's cont {cb:.0} ms with traffic and the daemon step, {ci:.0} ms without (x{:.2}, {:+.0} ms); \
         the pause B saw {:.0} ms (median of {}); {} messages at B",
        if accel == "tcg" { ", functional figures only" } else { "" },
        qb / qi,
        cb / ci,
        cb - ci,
        if pauses.is_empty() { f64::NAN } else { median(pauses.clone()) },
        pauses.len(),
        seqs.len()
    );
}
