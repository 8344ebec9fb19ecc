//! `vrdma bench-hosts --qos`: a latency-sensitive tenant's 8-byte
//! messages beside a bandwidth tenant across hosts (issue 21, items 5 and
//! 8), with and without `latency_class = "latency"`.
//!
//! On one host the engine's turns are what a victim waits for (`vrdma
//! bench --qos`); across hosts it is the link: the hog's frames ahead of
//! the victim's in the daemon's round, in the daemon's queue and in the
//! kernel's socket buffers. So both tenants cross the link: the victim
//! (our uid, a tenant of each daemon) ping-pongs 8-byte sends between a QP
//! on host 1 and one on host 2, and the hog (uid 65534, a child of this
//! binary: `vrdma misbehave --how stream --to`) streams 64 KiB RDMA writes
//! over 64 QPs from host 1 to host 2. Each class gets daemons of its own
//! (configured with the class for our uid, or not), and in each run the
//! victim's unloaded latency, the hog alone, then both at once, then the
//! victim beside a CPU-only load (threads that spin as the hog keeps the
//! two engines and its own process busy) are measured; the figures are medians over the runs, each
//! beside the unloaded (or alone, or CPU-only) figure of the same runs
//! and the ratio. On a machine with fewer cores than busy threads the
//! last says how much of the victim's wait beside the hog is the CPUs'
//! rather than the link's.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use vrdma::wr::{self as wrs, SendWrExt as _};
use vrdma::{AccessFlags, Context, QpCap, WcStatus, WorkCompletion};
use vrdma_core::hca::{LinkQueues, Sampled};

use super::hosts::{check_interrupt, Hosts};
use crate::bench::attack::{Attacker, How, NOBODY};
use crate::cmd::run::LibDir;

/// The hog's QPs and message size (as `vrdma bench --qos`'s hog).
const HOG_QPS: u32 = 64;
const HOG_SIZE: usize = 64 << 10;
/// Receives kept posted on each victim QP.
const RECVS: u64 = 64;

/// One ping-pong QP of the victim on one host.
struct End {
    _ctx: Context,
    qp: vrdma::QueuePair,
    cq: vrdma::CompletionQueue,
    mr: vrdma::MemoryRegion,
}

impl End {
    fn open(sock: &Path) -> Result<End> {
        let ctx =
            Context::open_at(sock).with_context(|| format!("opening a context at {}", sock.display()))?;
        let pd = ctx.alloc_pd()?;
        let mr = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE)?;
        let cq = ctx.create_cq(2 * RECVS as u32, None)?;
        let cap = QpCap {
            max_send_wr: 16,
            max_recv_wr: RECVS as u32,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let qp = pd.create_rc_qp(&cq, &cq, cap)?;
        Ok(End { _ctx: ctx, qp, cq, mr })
    }

    fn post_recv(&self, id: u64) -> Result<()> {
        self.qp.post_recv(&[wrs::recv(id, &[self.mr.sge(64, 8)?])?]).map_err(|e| e.error)?;
        Ok(())
    }
}

/// The victim: a QP on host 1 and one on host 2, connected.
struct Victim {
    a: End,
    b: End,
}

impl Victim {
    fn new(h: &Hosts) -> Result<Victim> {
        let (a, b) = (End::open(&h.hosts[0].socket)?, End::open(&h.hosts[1].socket)?);
        a.qp.connect(&b.qp.endpoint(&b._ctx)?, AccessFlags::empty())?;
        b.qp.connect(&a.qp.endpoint(&a._ctx)?, AccessFlags::empty())?;
        for e in [&a, &b] {
            for i in 0..RECVS {
                e.post_recv(i)?;
            }
        }
        Ok(Victim { a, b })
    }

    /// One 8-byte send each way; half the round trip.
    fn one_way(&self, i: u64) -> Result<Duration> {
        let t0 = Instant::now();
        for (from, to) in [(&self.a, &self.b), (&self.b, &self.a)] {
            from.qp.post_send(&[wrs::send(i, &[from.mr.sge(0, 8)?])?.signaled()]).map_err(|e| e.error)?;
            for e in [from, to] {
                let wc = spin_one(&e.cq)?;
                if wc.status != WcStatus::Success {
                    bail!("the victim's round trip {i}: {}", wc.status.as_str());
                }
                if wc.opcode == vrdma::WcOpcode::Recv {
                    e.post_recv(i)?;
                }
            }
        }
        Ok(t0.elapsed() / 2)
    }

    /// `iters` one-way latencies (or as many as `span` allows), sorted.
    fn sample(&self, iters: u64, span: Duration) -> Result<Vec<Duration>> {
        let end = Instant::now() + span;
        let mut v = Vec::new();
        for i in 0..iters {
            if Instant::now() > end {
                break;
            }
            v.push(self.one_way(i)?);
        }
        v.sort_unstable();
        Ok(v)
    }
}

/// Polls one completion, busy, within 10 s.
fn spin_one(cq: &vrdma::CompletionQueue) -> Result<WorkCompletion> {
    let end = Instant::now() + Duration::from_secs(10);
    let mut wc = vrdma::wc_buffer(1);
    loop {
        if cq.poll(&mut wc)? == 1 {
            return Ok(wc[0]);
        }
        if Instant::now() > end {
            bail!("the victim had no completion within 10 s");
        }
        std::hint::spin_loop();
    }
}

fn pct(v: &[Duration], p: usize) -> f64 {
    v.get(v.len().saturating_sub(1) * p / 100).copied().unwrap_or_default().as_secs_f64() * 1e6
}

/// One run's figures: the victim's median and p99 (µs) unloaded and
/// beside the hog; the hog's GB/s alone and beside the victim; and the
/// victim's median and p99 beside a CPU-only load of as many busy
/// threads as the hog brings ([`CPU_LOAD`]: its process and the two
/// daemons' engines), without a byte on the link.
#[derive(Debug, Clone, Copy)]
pub struct Run {
    pub median: [f64; 2],
    pub p99: [f64; 2],
    pub hog: [f64; 2],
    pub cpu: [f64; 2],
    /// Each host's samples of its link's queues while the victim ran
    /// beside the hog (see [`LinkQueues`]; none without the class).
    pub queues: [LinkQueues; 2],
}

/// The samples of each host's link (one link each) so far.
fn link_queues(v: &Victim) -> Result<[LinkQueues; 2]> {
    let mut out = [LinkQueues::default(); 2];
    for (o, e) in out.iter_mut().zip([&v.a, &v.b]) {
        *o = e._ctx.stat()?.links.iter().map(|l| l.stats.queues).next().unwrap_or_default();
    }
    Ok(out)
}

/// `b`'s samples less `a`'s (the sums and counts; a largest value is
/// `b`'s, since the daemon started).
fn since(a: &LinkQueues, b: &LinkQueues) -> LinkQueues {
    let d = |x: &Sampled, y: &Sampled| Sampled { sum: y.sum.saturating_sub(x.sum), max: y.max };
    LinkQueues {
        tx_samples: b.tx_samples.saturating_sub(a.tx_samples),
        daemon: d(&a.daemon, &b.daemon),
        unsent: d(&a.unsent, &b.unsent),
        in_flight: d(&a.in_flight, &b.in_flight),
        rx_samples: b.rx_samples.saturating_sub(a.rx_samples),
        rx_waiting: d(&a.rx_waiting, &b.rx_waiting),
        rx_frames: d(&a.rx_frames, &b.rx_frames),
        rx_payload: d(&a.rx_payload, &b.rx_payload),
        latency_frames: b.latency_frames.saturating_sub(a.latency_frames),
        ahead_daemon: d(&a.ahead_daemon, &b.ahead_daemon),
        ahead_kernel: d(&a.ahead_kernel, &b.ahead_kernel),
        daemon_wait_ns: d(&a.daemon_wait_ns, &b.daemon_wait_ns),
        capped_ns: b.capped_ns.saturating_sub(a.capped_ns),
        ahead_kernel_samples: b.ahead_kernel_samples.saturating_sub(a.ahead_kernel_samples),
    }
}

/// The CPU-only load: threads that spin without yielding, as the two
/// daemons' engines do while the hog keeps them busy (a busy engine
/// starts its next pass without a yield), and threads that spin with
/// yields, as the hog's own polling process does.
const CPU_LOAD: (usize, usize) = (2, 1);

/// `f` while `load.0` threads of ours spin and `load.1` spin with yields.
fn beside_busy<T>(load: (usize, usize), f: impl FnOnce() -> Result<T>) -> Result<T> {
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        for i in 0..load.0 + load.1 {
            let yields = i >= load.0;
            let stop = &stop;
            // Bounded: `f` returns (or fails) within its span, and then
            // `stop` is set.
            s.spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if yields {
                        std::thread::yield_now();
                    } else {
                        std::hint::spin_loop();
                    }
                }
            });
        }
        let r = f();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        r
    })
}

/// The hog's bytes a second over `window`.
fn hog_rate(hog: &mut Attacker, window: Duration, during: impl FnOnce() -> Result<()>) -> Result<f64> {
    hog.ask()?;
    let (b0, t0) = (hog.bytes()?, Instant::now());
    let end = t0 + window;
    during()?;
    if let Some(left) = end.checked_duration_since(Instant::now()) {
        std::thread::sleep(left);
    }
    hog.ask()?;
    let b1 = hog.bytes()?;
    Ok((b1 - b0) as f64 / t0.elapsed().as_secs_f64() / 1e9)
}

/// `runs` runs on daemons of their own, our uid of `latency_class =
/// "latency"` if `protected`.
#[allow(clippy::too_many_arguments)]
pub fn measure(
    lib: &Path,
    engine: &[String],
    net: &[String],
    protected: bool,
    runs: usize,
    iters: u64,
    window: Duration,
    verbose: bool,
) -> Result<Vec<Run>> {
    let me = rustix::process::getuid().as_raw();
    let extra =
        if protected { format!("[tenants.{me}]\nlatency_class = \"latency\"\n") } else { String::new() };
    let h = Hosts::create_with(LibDir::create(lib, None)?, engine, net, &extra, verbose)?;
    let victim = Victim::new(&h)?;
    victim.sample(iters / 10, window)?;
    let mut out = Vec::new();
    for _ in 0..runs {
        check_interrupt()?;
        let unloaded = victim.sample(iters, window * 2)?;
        let mut hog = Attacker::start_to(
            &h.hosts[0].socket,
            Some(&h.hosts[1].socket),
            How::Stream,
            HOG_QPS,
            HOG_SIZE,
            NOBODY,
        )?;
        std::thread::sleep(Duration::from_millis(200));
        let alone = hog_rate(&mut hog, window, || Ok(()))?;
        let mut loaded = Vec::new();
        let q0 = link_queues(&victim)?;
        let beside = hog_rate(&mut hog, Duration::ZERO, || {
            loaded = victim.sample(iters, window * 2)?;
            Ok(())
        })?;
        let q1 = link_queues(&victim)?;
        hog.stop();
        let cpu = beside_busy(CPU_LOAD, || victim.sample(iters, window * 2))?;
        h.check_daemons()?;
        if unloaded.is_empty() || loaded.is_empty() || cpu.is_empty() {
            bail!("the victim measured nothing");
        }
        out.push(Run {
            median: [pct(&unloaded, 50), pct(&loaded, 50)],
            p99: [pct(&unloaded, 99), pct(&loaded, 99)],
            hog: [alone, beside],
            cpu: [pct(&cpu, 50), pct(&cpu, 99)],
            queues: [since(&q0[0], &q1[0]), since(&q0[1], &q1[1])],
        });
    }
    Ok(out)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The table: per class, the victim's median and p99 beside the hog with
/// their unloaded figures, and the hog's throughput beside the victim
/// with its own alone; medians over the runs and their ratio. Then the
/// victim's figures beside the hog against the same beside a CPU-only
/// load of as many busy threads: a ratio near 1 says the wait is the
/// CPUs', not the link's.
pub fn render(classes: &[(&str, Vec<Run>)]) -> String {
    let mut out = String::from(
        "8 B send, one way, across hosts, beside a tenant streaming 64 KiB RDMA writes over 64 QPs \
         (host 1 to host 2)\nmedians over the runs; each figure beside its anchor from the same runs\n\n",
    );
    for (class, runs) in classes {
        let m = |f: &dyn Fn(&Run) -> f64| median(runs.iter().map(f).collect());
        let rows = [
            ("victim median", "µs", m(&|r| r.median[1]), "unloaded", m(&|r| r.median[0]), "<= 2x"),
            ("victim p99", "µs", m(&|r| r.p99[1]), "unloaded", m(&|r| r.p99[0]), "<= 2x"),
            ("hog beside the victim", "GB/s", m(&|r| r.hog[1]), "alone", m(&|r| r.hog[0]), ">= 0.90x"),
            ("victim median", "µs", m(&|r| r.median[1]), "cpu-only", m(&|r| r.cpu[0]), "reference"),
            ("victim p99", "µs", m(&|r| r.p99[1]), "cpu-only", m(&|r| r.cpu[1]), "reference"),
        ];
        for (what, unit, v, anchor, a, target) in rows {
            let ratio = v / a.max(1e-12);
            let met = match target {
                "<= 2x" => Some(ratio <= 2.0),
                ">= 0.90x" => Some(ratio >= 0.90),
                _ => None,
            };
            out.push_str(&format!(
                "latency_class = {class:<9} {what:<22} {v:>9.2} {unit:<4} {anchor:<8} {a:>9.2} {unit:<4} {ratio:>7.2}x  \
                 {target:<9} {}\n",
                match met {
                    Some(true) => "met",
                    Some(false) => "NOT met",
                    None => "",
                }
            ));
        }
        out.push_str(&breakdown(class, runs));
    }
    out
}

/// Where the victim's frames waited, per host, from the daemons' samples
/// of their link's queues while the victim ran beside the hog (summed
/// over the runs; a pass in a few is sampled, only while the class is
/// active): sending, the daemon's own queue, the kernel's unsent bytes
/// and its bytes in flight; receiving, the bytes waiting in the kernel as
/// a pass began, and the frames and payload a pass took. Host 1 sends the
/// hog's writes and receives its ACKs; host 2 the other way.
fn breakdown(class: &str, runs: &[Run]) -> String {
    let mut out = String::new();
    for h in 0..2 {
        let mut q = LinkQueues::default();
        for r in runs {
            let x = &r.queues[h];
            q.tx_samples += x.tx_samples;
            q.rx_samples += x.rx_samples;
            q.capped_ns += x.capped_ns;
            q.latency_frames += x.latency_frames;
            q.ahead_kernel_samples += x.ahead_kernel_samples;
            for (a, b) in [
                (&mut q.daemon, &x.daemon),
                (&mut q.unsent, &x.unsent),
                (&mut q.in_flight, &x.in_flight),
                (&mut q.rx_waiting, &x.rx_waiting),
                (&mut q.rx_frames, &x.rx_frames),
                (&mut q.rx_payload, &x.rx_payload),
                (&mut q.ahead_daemon, &x.ahead_daemon),
                (&mut q.ahead_kernel, &x.ahead_kernel),
                (&mut q.daemon_wait_ns, &x.daemon_wait_ns),
            ] {
                a.sum += b.sum;
                a.max = a.max.max(b.max);
            }
        }
        if q.tx_samples == 0 && q.rx_samples == 0 && q.latency_frames == 0 {
            continue;
        }
        let kib = |s: &Sampled, n: u64| format!("{:.0}/{:.0}", s.mean(n) / 1024.0, s.max as f64 / 1024.0);
        out.push_str(&format!(
            "latency_class = {class:<9} host {} link queues, KiB mean/max: daemon {} unsent {} in flight {}              ({} tx samples, capped {:.1} ms); rx waiting {} KiB, a pass {} KiB in {:.1}/{} frames ({} rx samples)\n",
            h + 1,
            kib(&q.daemon, q.tx_samples),
            kib(&q.unsent, q.tx_samples),
            kib(&q.in_flight, q.tx_samples),
            q.tx_samples,
            q.capped_ns as f64 / 1e6,
            kib(&q.rx_waiting, q.rx_samples),
            kib(&q.rx_payload, q.rx_samples),
            q.rx_frames.mean(q.rx_samples),
            q.rx_frames.max,
            q.rx_samples,
        ));
        if q.latency_frames > 0 {
            let n = q.latency_frames;
            out.push_str(&format!(
                "latency_class = {class:<9} host {} victim frames sent {n}: ahead of each, KiB mean/max: daemon {} \
                 kernel (unsent + in flight) {} ({} sampled); its wait to be written, µs mean/max {:.1}/{:.1}\n",
                h + 1,
                kib(&q.ahead_daemon, n),
                kib(&q.ahead_kernel, q.ahead_kernel_samples),
                q.ahead_kernel_samples,
                q.daemon_wait_ns.mean(n) / 1e3,
                q.daemon_wait_ns.max as f64 / 1e3,
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_gives_each_figure_its_anchor_and_ratio() {
        let run = Run {
            median: [10.0, 15.0],
            p99: [20.0, 50.0],
            hog: [2.0, 1.9],
            cpu: [30.0, 100.0],
            queues: [LinkQueues::default(); 2],
        };
        let t = render(&[("\"latency\"", vec![run, run, run])]);
        assert!(t.contains("victim median") && t.contains("1.50x"), "{t}");
        assert!(t.contains("2.50x  <= 2x     NOT met"), "{t}");
        assert!(t.contains("0.95x  >= 0.90x  met"), "{t}");
        assert!(t.contains("cpu-only") && t.contains("0.50x  reference"), "{t}");
    }

    /// The kernel's queue ahead of the victim's frames is sampled for one
    /// frame in a few: its mean is over the sampled frames, not all.
    #[test]
    fn the_kernel_queue_ahead_of_the_victim_is_a_mean_over_its_samples() {
        let mut q = LinkQueues {
            latency_frames: 16,
            ahead_daemon: Sampled { sum: 16 << 10, max: 1 << 10 },
            ahead_kernel: Sampled { sum: 8 << 10, max: 6 << 10 },
            ahead_kernel_samples: 2,
            ..LinkQueues::default()
        };
        q.daemon_wait_ns = Sampled { sum: 16_000, max: 2_000 };
        let run = Run { median: [1.0; 2], p99: [1.0; 2], hog: [1.0; 2], cpu: [1.0; 2], queues: [q, q] };
        let t = breakdown("\"latency\"", &[run, run]);
        assert!(t.contains("victim frames sent 32: ahead of each, KiB mean/max: daemon 1/1 kernel (unsent + in flight) 4/6 (4 sampled)"), "{t}");
    }
}
