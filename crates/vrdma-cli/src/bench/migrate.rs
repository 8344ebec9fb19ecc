//! `vrdma bench --migrate`: the downtime vRDMA adds to a VM's live
//! migration, and the peer's throughput dip (issue 19, item 5), beside
//! QEMU's own migration of the same VM without vRDMA traffic, in the same
//! run on the same daemons (`docs/migration.md`, "Downtime and the peer's
//! throughput dip").
//!
//! One guest (VM `t`, the image of `vrdma vm image` with `seqstream`) is
//! moved A → C → A ... `runs` times with no vRDMA context open in it
//! (QEMU's migration alone, no daemon step: the anchor), then `runs` times
//! while it streams to B (`vrdma migrate move --vm t` between QEMU's
//! completion and the destination's `cont`). Per hop: QEMU's `downtime`,
//! its completion to `cont`, the pause B saw, and B's throughput dip (its
//! rate in a steady window before the hop against the window from QEMU's
//! `migrate` to `AROUND_AFTER` after `cont`); the rows are their medians
//! ([`figures`]). B checks every message once, in order, with its bytes;
//! a fault there, or a hop that fails, ends the hops but not the report:
//! the rows are made from the hops done, the fault said beside them, and
//! the command fails after printing.
//!
//! The accelerator is named: under TCG (where KVM does not work) the
//! figures are functional, not comparable (the goal, at most 50 ms added,
//! is for KVM).

mod figures;
mod peer;
mod world;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use vrdma_guest::{Guest, Qmp};

use super::report::Skipped;
use super::Figure;
use figures::{BusyHop, Hop};
use peer::{Peer, T};
use world::{Missing, World};

/// The stream: as many messages as fit B's region, one every `PACE_US`.
const COUNT: u64 = peer::MAX_COUNT - 1;
const PACE_US: u32 = 3000;
/// The steady window before each hop: at least `BEFORE` messages and
/// `STEADY` long (about the window around a hop under TCG, so that the
/// machine's load weighs on both alike).
const BEFORE: u64 = 150;
const STEADY: Duration = Duration::from_secs(2);
/// Messages B takes after the previous window before the steady one
/// starts (the stream past its burst after the pause).
const SETTLE: u64 = 10;
/// How long after the destination's `cont` the window around a hop ends.
const AROUND_AFTER: Duration = Duration::from_secs(1);

/// What the run made: its rows, what it could not measure, and the fault
/// that ended it early (a lost message, a hop that failed), if one did.
pub struct Outcome {
    pub figures: Vec<Figure>,
    pub skipped: Vec<Skipped>,
    pub fault: Option<String>,
}

const ALL: &str = "VM migration: downtime with and without vRDMA traffic, the peer's pause and dip";

/// `runs` hops without traffic and `runs` with.
pub fn figures(runs: usize, cores: usize, progress: &dyn Fn(&str)) -> Outcome {
    let mut out = Outcome { figures: Vec::new(), skipped: Vec::new(), fault: None };
    let w = match World::new(progress) {
        Ok(w) => w,
        Err(e) => {
            if e.downcast_ref::<Missing>().is_none() {
                out.fault = Some(format!("setting up: {e:#}"));
            }
            out.skipped.push(Skipped { figures: ALL.into(), reason: format!("{e:#}") });
            return out;
        }
    };
    let mut run = Run { w: &w, idle: Vec::new(), busy: Vec::new(), arrived: Vec::new(), accel: "?" };
    let r = run.hops(runs, progress);
    let cx = figures::Context { accel: run.accel, cores, pace_us: PACE_US, around_after: AROUND_AFTER };
    out.figures = figures::rows(&run.idle, &run.busy, &run.arrived, &cx);
    if let Err(e) = r {
        out.fault = Some(format!("{e:#}"));
        out.skipped.push(Skipped {
            figures: format!(
                "{ALL}: the hops after the first {} without traffic and {} with",
                run.idle.len(),
                run.busy.len()
            ),
            reason: format!("{e:#}"),
        });
    } else {
        progress(&format!(
            "{} messages at B over {} hops with traffic: every one once, in order, with its bytes",
            run.arrived.len(),
            run.busy.len()
        ));
    }
    out
}

/// The hops done so far, and B's arrivals.
struct Run<'a> {
    w: &'a World,
    idle: Vec<Hop>,
    busy: Vec<BusyHop>,
    arrived: Vec<Instant>,
    accel: &'static str,
}

impl Run<'_> {
    fn hops(&mut self, runs: usize, progress: &dyn Fn(&str)) -> Result<()> {
        let w = self.w;
        progress("booting the guest on A");
        let qmp_a = w.dir().join("qmp-a.sock");
        let mut g = Guest::boot(w.vm.spec(&w.a.socket, &qmp_a, &[])).context("booting the guest on A")?;
        self.accel = g.accel().name();
        let mut qmp = qmp_a;
        let ends = [w.a.socket.clone(), w.c.socket.clone()];
        let mut at = 0;
        // The anchor: no vRDMA context in the guest, QEMU's migration alone.
        for k in 0..runs {
            let (ng, nq, h) = hop(w, &format!("idle-{k}"), &ends[at], &ends[1 - at], g, &qmp, false)
                .with_context(|| format!("hop {k} without traffic"))?;
            progress(&format!(
                "hop {k} without vRDMA traffic: QEMU's downtime {:.0} ms, completion to cont {:.0} ms",
                h.qemu_ms,
                h.to_cont_ms()
            ));
            (g, qmp, at) = (ng, nq, 1 - at);
            self.idle.push(h);
        }
        // With traffic: the stream from wherever the guest is now.
        let peer = Peer::connect(&w.b.socket, &mut g, COUNT, PACE_US)?;
        let received = AtomicU64::new(0);
        let stop = AtomicBool::new(false);
        let limit = Duration::from_secs(120 + 20 * runs as u64);
        let busy = &mut self.busy;
        let (arrived, at_b, hops) = std::thread::scope(|s| {
            let receiver = s.spawn(|| peer.receive(&received, &stop, limit));
            let hops = (|| -> Result<()> {
                let mut window_end = Instant::now();
                for k in 0..runs {
                    let after =
                        if k == 0 { "before the first hop".into() } else { format!("after hop {}", k - 1) };
                    sleep_until(window_end);
                    wait_more(&received, SETTLE, &mut g, &after)?;
                    let steady_from = Instant::now();
                    wait_more(&received, BEFORE, &mut g, &after)?;
                    sleep_until(steady_from + STEADY);
                    let moved = hop(w, &format!("busy-{k}"), &ends[at], &ends[1 - at], g, &qmp, true);
                    let (ng, nq, h) = moved.with_context(|| format!("hop {k} with traffic"))?;
                    (g, qmp, at) = (ng, nq, 1 - at);
                    progress(&format!(
                        "hop {k} with vRDMA traffic and the daemon step: QEMU's downtime {:.0} ms, completion to \
                         cont {:.0} ms",
                        h.qemu_ms,
                        h.to_cont_ms()
                    ));
                    window_end = h.resumed + AROUND_AFTER;
                    busy.push(BusyHop { hop: h, steady_from });
                }
                sleep_until(window_end);
                wait_more(&received, BEFORE, &mut g, &format!("after hop {}", runs - 1))?;
                peer::stream_running(&mut g)
            })();
            stop.store(true, Ordering::Release);
            let (arrived, at_b) = receiver
                .join()
                .unwrap_or_else(|_| (Vec::new(), Err(anyhow::anyhow!("B's receiver panicked"))));
            (arrived, at_b, hops)
        });
        self.arrived = arrived;
        // B's fault first: it is what a hop's stall would follow from.
        at_b.context("B's check of the stream")?;
        hops
    }
}

/// Moves the guest from the daemon at `from` to the one at `to` with
/// QEMU's migration, with the operator's `move --vm t` after its
/// completion if `daemon_step`.
fn hop(
    w: &World,
    tag: &str,
    from: &Path,
    to: &Path,
    g: Guest,
    qmp: &Path,
    daemon_step: bool,
) -> Result<(Guest, PathBuf, Hop)> {
    let mig = w.dir().join(format!("mig-{tag}.sock"));
    let uri = format!("unix:{}", mig.display());
    let (mut next, mut qc, qmp_c) = w.vm.incoming(tag, to, &uri, &g).context("the destination QEMU")?;
    let mut qa = Qmp::connect(qmp)?;
    let start = Instant::now();
    qa.migrate(&uri)?;
    let m = qa.wait_completed()?;
    let completed = Instant::now();
    qc.wait_loaded()?;
    if daemon_step {
        w.move_vm(from, to)?;
    }
    qc.exec(r#"{"execute":"cont"}"#)?;
    let resumed = Instant::now();
    drop(qa);
    drop(g);
    let out = next.check("echo here", T).context("the guest after the hop")?;
    anyhow::ensure!(out.contains("here"), "the guest after the hop said {out:?}");
    let qemu_ms = m["downtime"].as_f64().unwrap_or(f64::NAN);
    Ok((next, qmp_c, Hop { qemu_ms, start, completed, resumed }))
}

/// Waits (at most 90 s: past the guest library's 60 s reply limit, so
/// that a call stuck across a hop has failed and says so) until B has
/// `more` messages beyond what it has now; else fails with what the
/// guest's stream printed.
fn wait_more(received: &AtomicU64, more: u64, g: &mut Guest, what: &str) -> Result<()> {
    let least = received.load(Ordering::Acquire) + more;
    let end = Instant::now() + Duration::from_secs(90);
    while received.load(Ordering::Acquire) < least {
        if Instant::now() > end {
            anyhow::bail!(
                "B stalled at {} messages {what} (waited 90 s for {least}); the guest's stream:\n{}",
                received.load(Ordering::Acquire),
                peer::stream_tail(g)
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// Sleeps until `t` (at most `STEADY` from now, as every `t` here is).
fn sleep_until(t: Instant) {
    if let Some(d) = t.checked_duration_since(Instant::now()) {
        std::thread::sleep(d.min(STEADY.max(AROUND_AFTER)));
    }
}
