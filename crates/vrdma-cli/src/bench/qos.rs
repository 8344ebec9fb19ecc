//! The default report's figures of tenant QoS (issue 21, items 4, 5 and
//! 8): fairness among equal tenants, shares by weight, a rate limit's
//! error, and a latency-class tenant's latency beside a hog.
//!
//! Each group runs on a daemon of its own (`embedded::private_device_with`),
//! configured with the weights, limit or class it measures, and with the
//! direct path off (a tenant's writes go through the engine, whose
//! service order is what is measured). Tenants are uids, so the streaming
//! tenants are children of this binary (`vrdma misbehave --how stream`)
//! run as uids 65534 down to 65531, which needs root. Each streams 1 MiB
//! RDMA writes over its own QPs (the hog of the latency figures, 64 KiB
//! writes over 64 QPs, as the isolation figures' hog); the parent asks them all for their byte
//! counts at the start and end of a window, so their rates cover the same
//! second. Every figure is printed beside its anchor from the same run:
//! the ideal (an index of 1, the configured share, the configured limit)
//! or the same measurement without the load or the setting.
//!
//! The four tenants' total is also split into its two factors, each
//! beside the same run's "alone": the CPU the kernel gave the engine's
//! thread over the window (`/proc/self/task/*/schedstat`: its run time,
//! and its wait for a CPU while runnable), and the bytes it moved per
//! second of that CPU, which is the engine's own cost per byte. On a
//! machine with fewer cores than busy threads the first moves with the
//! machine's load from window to window; the second is what the engine's
//! sharing among tenants can change (see docs/qos.md, "Where the four
//! equal tenants' shortfall goes", for what it showed: the copy's cache
//! footprint, not the scheduler's bookkeeping).

use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use super::anchors::Stat;
use super::attack::{Attacker, How, NOBODY};
use super::suite::{latency, measure, median_of, Figure};
use super::worker;

/// The streaming tenants' uids.
const UIDS: [u32; 4] = [NOBODY, NOBODY - 1, NOBODY - 2, NOBODY - 3];
/// Each streaming tenant's QPs, and its message size: 16 writes of 1 MiB
/// in flight on each QP keep its queue full through a time slice of its
/// process (some milliseconds of the engine's copying), so that the
/// engine, not the CPU the tenants' processes get, decides the shares.
const QPS: u32 = 4;
const SIZE: usize = 1 << 20;
/// The rate limit measured.
const RATE: u64 = 200_000_000;

/// How long and how often.
pub struct Plan {
    pub runs: usize,
    /// The window of the fairness and weight figures.
    pub window: Duration,
    /// Round trips of the latency figures.
    pub lat_iters: u64,
    pub cores: usize,
}

/// A daemon of our own, configured by `toml`, direct path off.
fn daemon(engine: &vrdmad::EngineConfig, toml: &str) -> Result<crate::embedded::Device> {
    crate::embedded::private_device_with(engine.clone(), false, toml)
}

/// The CPU time the engine threads of this process (the embedded
/// daemons') have had, and the time they waited runnable for a CPU, in
/// seconds (`/proc/self/task/*/schedstat`); `None` where the kernel does
/// not say.
fn engine_cpu() -> Option<(f64, f64)> {
    let (mut run, mut wait, mut found) = (0u64, 0u64, false);
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.trim() != "vrdma-engine" {
            continue;
        }
        let stat = std::fs::read_to_string(task.path().join("schedstat")).ok()?;
        let mut f = stat.split_whitespace().map(|v| v.parse::<u64>().ok());
        run += f.next()??;
        wait += f.next()??;
        found = true;
    }
    found.then(|| (run as f64 / 1e9, wait as f64 / 1e9))
}

/// What the engine had over a window of [`rates_and_cpu`]: its CPU time
/// and its wait for a CPU, each a fraction of the window.
#[derive(Clone, Copy, Default)]
struct EngineCpu {
    run: f64,
    wait: f64,
}

/// Starts a streaming tenant per `uids` entry, lets them run 200 ms, and
/// returns each one's bytes a second over `window`.
fn rates(sock: &std::path::Path, uids: &[u32], qps: u32, window: Duration) -> Result<Vec<f64>> {
    Ok(rates_and_cpu(sock, uids, qps, window)?.0)
}

/// [`rates`], with the engine's CPU over the window.
fn rates_and_cpu(
    sock: &std::path::Path,
    uids: &[u32],
    qps: u32,
    window: Duration,
) -> Result<(Vec<f64>, Option<EngineCpu>)> {
    let mut tenants = uids
        .iter()
        .map(|&u| Attacker::start_as(sock, How::Stream, qps, SIZE, u))
        .collect::<Result<Vec<_>>>()?;
    std::thread::sleep(Duration::from_millis(200));
    let counts = |ts: &mut [Attacker]| -> Result<Vec<u64>> {
        for t in ts.iter_mut() {
            t.ask()?;
        }
        ts.iter_mut().map(Attacker::bytes).collect()
    };
    let (b0, c0, t0) = (counts(&mut tenants)?, engine_cpu(), Instant::now());
    std::thread::sleep(window);
    let (b1, c1, secs) = (counts(&mut tenants)?, engine_cpu(), t0.elapsed().as_secs_f64());
    for t in tenants {
        t.stop();
    }
    let cpu = c0.zip(c1).map(|(a, b)| EngineCpu { run: (b.0 - a.0) / secs, wait: (b.1 - a.1) / secs });
    Ok((b0.iter().zip(&b1).map(|(a, b)| (b - a) as f64 / secs).collect(), cpu))
}

/// `n` threads of ours that do nothing but yield the CPU for `window`:
/// the CPU a polling process takes on a machine with fewer cores than
/// busy threads, without touching the daemon.
fn yielding_threads(n: usize, window: Duration) {
    let end = Instant::now() + window;
    std::thread::scope(|s| {
        for _ in 0..n {
            // Bounded by `window`.
            s.spawn(|| {
                while Instant::now() < end {
                    std::thread::yield_now();
                }
            });
        }
    });
}

fn jain(x: &[f64]) -> f64 {
    let s: f64 = x.iter().sum();
    let s2: f64 = x.iter().map(|v| v * v).sum();
    s * s / (x.len() as f64 * s2)
}

/// A figure of `value` against `anchor`, both over the runs.
fn figure(
    name: String,
    unit: &'static str,
    value: &[f64],
    anchor_name: &str,
    anchor: &[f64],
    target: &str,
    cores: usize,
) -> Figure {
    Figure::beside(
        name,
        unit,
        Stat::from_samples(value),
        anchor_name,
        Stat::from_samples(anchor),
        target,
        cores,
    )
}

pub fn figures(engine: &vrdmad::EngineConfig, plan: &Plan, progress: &dyn Fn(&str)) -> Result<Vec<Figure>> {
    let mut out = Vec::new();
    let (runs, cores) = (plan.runs, plan.cores);

    progress("four equal tenants streaming at once, and one alone");
    let d = daemon(engine, "")?;
    let (mut j, mut total, mut alone, mut one_tenant) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // The engine's CPU over each window (fractions of a CPU), and the
    // bytes it moved per second of it, alone and with four tenants.
    let (mut cpu_alone, mut cpu_four, mut per_cpu_alone, mut per_cpu_four) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut wait_alone, mut wait_four, mut per_cpu_one_tenant) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..runs {
        let (one, c1) = rates_and_cpu(d.socket(), &UIDS[..1], QPS, plan.window)?;
        alone.push(one[0] / 1e9);
        let (four, c4) = rates_and_cpu(d.socket(), &UIDS, QPS, plan.window)?;
        j.push(jain(&four));
        total.push(four.iter().sum::<f64>() / 1e9);
        if let (Some(c1), Some(c4)) = (c1, c4) {
            cpu_alone.push(c1.run);
            cpu_four.push(c4.run);
            wait_alone.push(c1.wait);
            wait_four.push(c4.wait);
            per_cpu_alone.push(one[0] / 1e9 / c1.run.max(1e-6));
            per_cpu_four.push(four.iter().sum::<f64>() / 1e9 / c4.run.max(1e-6));
        }
        // The same four processes and QPs as one tenant: what four
        // streaming processes cost on this machine's CPUs, without the
        // engine's sharing among tenants.
        let (same, c) = rates_and_cpu(d.socket(), &[UIDS[0]; 4], QPS, plan.window)?;
        let same = same.iter().sum::<f64>() / 1e9;
        one_tenant.push(same);
        if let Some(c) = c {
            per_cpu_one_tenant.push(same / c.run.max(1e-6));
        }
    }
    drop(d);
    let four = format!("four tenants streaming 1 MiB RDMA writes at once ({QPS} QPs each), equal weights");
    out.push(figure(
        format!("{four}: Jain's index"),
        "",
        &j,
        "equal shares",
        &vec![1.0; runs],
        ">= 0.99",
        cores,
    ));
    out.push(figure(
        format!("{four}: their total"),
        "GB/s",
        &total,
        "one tenant alone",
        &alone,
        ">= 0.90x alone",
        cores,
    ));
    out.push(figure(
        format!("{four}: their total"),
        "GB/s",
        &total,
        "the same four processes as one tenant",
        &one_tenant,
        "reference: the engine's cost of four tenants",
        cores,
    ));
    // Where the total goes: the engine's CPU (what the kernel gave its
    // thread beside the tenants' processes) and what it moved per second
    // of it (its own cost of serving four tenants, per byte).
    if !cpu_four.is_empty() {
        out.push(figure(
            format!("{four}: the engine thread's CPU"),
            "CPUs",
            &cpu_four,
            "one tenant alone",
            &cpu_alone,
            "reference: the CPU the kernel gives the engine",
            cores,
        ));
        out.push(figure(
            format!("{four}: the engine thread's wait for a CPU (runnable, not running)"),
            "CPUs",
            &wait_four,
            "one tenant alone",
            &wait_alone,
            "reference",
            cores,
        ));
        out.push(figure(
            format!("{four}: their total per second of the engine's CPU"),
            "GB/CPU-s",
            &per_cpu_four,
            "one tenant alone",
            &per_cpu_alone,
            "reference: the engine's cost per byte of four tenants",
            cores,
        ));
    }
    if !per_cpu_one_tenant.is_empty() && per_cpu_one_tenant.len() == per_cpu_four.len() {
        out.push(figure(
            format!("{four}: their total per second of the engine's CPU"),
            "GB/CPU-s",
            &per_cpu_four,
            "the same four processes as one tenant",
            &per_cpu_one_tenant,
            "reference: the engine's cost per byte of sharing among tenants",
            cores,
        ));
    }

    progress("four tenants of weights 1:2:3:4 streaming at once");
    let toml: String = UIDS.iter().zip(1..).map(|(u, w)| format!("[tenants.{u}]\nweight = {w}\n")).collect();
    let d = daemon(engine, &toml)?;
    let mut shares = vec![Vec::new(); UIDS.len()];
    for _ in 0..runs {
        let r = rates(d.socket(), &UIDS, QPS, plan.window)?;
        let sum: f64 = r.iter().sum();
        for (s, v) in shares.iter_mut().zip(&r) {
            s.push(100.0 * v / sum);
        }
    }
    drop(d);
    for (w, s) in (1..).zip(&shares) {
        out.push(figure(
            format!("weights 1:2:3:4 streaming at once: share of the tenant of weight {w}"),
            "%",
            s,
            "configured share",
            &vec![10.0 * f64::from(w); runs],
            "within 5 % (0.95x-1.05x)",
            cores,
        ));
    }

    progress("a rate-limited tenant streaming alone");
    let d = daemon(engine, &format!("[tenants.{}]\nrate_bytes_per_s = {RATE}\n", UIDS[0]))?;
    let mut rate = Vec::new();
    for _ in 0..runs {
        rate.push(rates(d.socket(), &UIDS[..1], QPS, Duration::from_secs(1))?[0] / 1e6);
    }
    drop(d);
    out.push(figure(
        format!("a tenant limited to {} MB/s streaming alone, over 1 s", RATE / 1_000_000),
        "MB/s",
        &rate,
        "its limit",
        &vec![RATE as f64 / 1e6; runs],
        "within 5 % (0.95x-1.05x)",
        cores,
    ));

    // Our own uid is the victim's tenant (the workers run as us).
    let me = rustix::process::getuid().as_raw();
    for (class, toml) in
        [("normal", String::new()), ("latency", format!("[tenants.{me}]\nlatency_class = \"latency\"\n"))]
    {
        progress(&format!("8 B send latency beside a 64-QP hog, latency_class = \"{class}\""));
        let d = daemon(engine, &toml)?;
        let unloaded = median_of(&measure(d.socket(), worker::Test::SendLat, 8, plan.lat_iters, runs)?);
        let (mut loaded, mut hog, mut hog_alone, mut hog_cpu) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..runs {
            let mut other = Attacker::start(d.socket(), How::Stream, 64)?;
            std::thread::sleep(Duration::from_millis(100));
            // The hog's bytes a second while `during` runs.
            let mut hog_over = |during: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
                other.ask()?;
                let (b0, t0) = (other.bytes()?, Instant::now());
                during()?;
                other.ask()?;
                Ok((other.bytes()? - b0) as f64 / t0.elapsed().as_secs_f64() / 1e9)
            };
            // The hog alone, beside the victim's ping-pong, beside two
            // threads that only yield the CPU (what the victim's two
            // polling processes take from the engine's CPUs, without a
            // message), and alone again: its "alone" is the mean of the
            // first and the last, as its rate drifts over a run (it read
            // 1.10-1.15x alone beside the unprotected victim with "alone"
            // taken only before).
            let mut alone = hog_over(&mut || {
                std::thread::sleep(plan.window);
                Ok(())
            })?;
            hog.push(hog_over(&mut || {
                // Ten times the unloaded round trips, so that the window
                // is mostly the ping-pong, not its two processes' start
                // (some 100 ms of opening contexts and connecting, which
                // was most of the window with as many as unloaded).
                loaded.extend(measure(d.socket(), worker::Test::SendLat, 8, 10 * plan.lat_iters, 1)?);
                Ok(())
            })?);
            hog_cpu.push(hog_over(&mut || {
                yielding_threads(2, plan.window);
                Ok(())
            })?);
            alone += hog_over(&mut || {
                std::thread::sleep(plan.window);
                Ok(())
            })?;
            hog_alone.push(alone / 2.0);
            other.stop();
        }
        drop(d);
        let mut f = latency(
            &format!("send 8 B, one way (poll CQ), latency_class = \"{class}\", beside a tenant streaming over 64 QPs"),
            loaded,
            "the same, unloaded, same daemon",
            Some(unloaded),
            cores,
        );
        f.target = "<= 2x unloaded".into();
        out.push(f);
        if hog.is_empty() {
            bail!("no hog measured");
        }
        out.push(figure(
            format!("the 64-QP hog beside the latency_class = \"{class}\" tenant's ping-pong"),
            "GB/s",
            &hog,
            "the hog alone, same runs",
            &hog_alone,
            ">= 0.90x",
            cores,
        ));
        out.push(figure(
            format!("the 64-QP hog beside the latency_class = \"{class}\" tenant's ping-pong"),
            "GB/s",
            &hog,
            "the hog beside two threads that only yield, same runs",
            &hog_cpu,
            "reference: the victim's cost beyond its CPU",
            cores,
        ));
    }
    Ok(out)
}
