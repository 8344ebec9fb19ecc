//! Weights and rate limits across hosts: two daemons in two network
//! namespaces joined by a veth (`NetnsHosts`), where what tenants contend
//! for is the link. A rate-limited tenant's writes to the other host's
//! daemon are counted per 1 s window and stay near its limit; of two
//! tenants writing over the link at once, the one of weight 3 gets more
//! of it (asserted, as in `qos.rs`, only with `VRDMA_TEST_QOS_RATIO=1`).
//! The bounds are loose as in `qos.rs` (2 noisy cores, debug
//! builds); the 5 % figures are the core's simulated-link tests
//! (`hca::tests::two_hosts::qos`). They need root (namespaces, and a
//! tenant as uid 65534).
//!
//! In a file of its own: tearing namespaces down keeps the kernel busy for
//! a while after a test, which would load `qos.rs`'s latency measurements.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use vrdma_it::protocol::{Command, Said};
use vrdma_it::{DaemonProc, NetnsHosts, PeerProc, PingPong, Side, WAIT};

const NOBODY: u32 = 65534;
/// The tests of this file run one at a time: each measures.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
const LEN: usize = 64 << 10;
/// Writes of the weighted test, 32 in flight (see `qos.rs`).
const BIG: usize = 1 << 20;

fn root() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    vrdma_it::skip(format!("this test needs root (namespaces, and a tenant as uid {NOBODY})"));
    false
}

/// What the link scheduler of `d` counted as held back by rate limits:
/// on its links (summed), and for our own tenant (uid 0), in ns; read
/// with `vrdma stat`'s call, as the tenant.
fn held_back(d: &DaemonProc) -> Result<(u64, u64)> {
    let s = d.context()?.stat()?;
    let link: u64 = s.links.iter().map(|l| l.stats.throttle.rate_limited_ns).sum();
    let ours = s.tenant.map_or(0, |t| t.counters.link_throttled_ns);
    Ok((link, ours))
}

/// The metrics endpoint of `d` (in its network namespace) scraped with
/// `curl` there.
fn scrape_in(d: &DaemonProc, port: u16) -> Result<String> {
    let ns = d.netns.as_deref().unwrap_or_default();
    let url = format!("http://127.0.0.1:{port}/metrics");
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", ns, "curl", "-sS", "--fail", "--max-time", "20", &url])
        .output()?;
    if !out.status.success() {
        bail!("curl {url} in {ns}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8(out.stdout)?)
}

/// The values of the samples of `name` whose labels contain `with`.
fn samples(text: &str, name: &str, with: &str) -> Vec<f64> {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(with))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect()
}

/// Starts `count` writes of `len` from `p` and returns once they began.
fn start_flood(p: &mut PeerProc, addr: u64, rkey: u32, len: usize, count: u64) -> Result<()> {
    p.send(&Command::Flood { remote_addr: addr, rkey, len, count })?;
    match p.recv::<Said>(WAIT)? {
        Said::Flooding => Ok(()),
        other => bail!("the peer answered {other:?} to Flood"),
    }
}

fn end_flood(p: &mut PeerProc) -> Result<()> {
    match p.recv::<Said>(Duration::from_secs(60))? {
        Said::Ok => Ok(()),
        other => bail!("the flood ended with {other:?}"),
    }
}

/// Our own tenant streams 1 MiB writes from a side on `ha` to one on
/// `hb` from a thread, counting the bytes written, until `stop`.
fn stream_across(
    ha: &DaemonProc,
    hb: &DaemonProc,
    stop: Arc<AtomicBool>,
    bytes: Arc<AtomicU64>,
) -> Result<std::thread::JoinHandle<Result<()>>> {
    let (ca, cb) = (ha.context()?, hb.context()?);
    let (a, b) = (Side::new(&ca, 4 << 20)?, Side::new(&cb, 4 << 20)?);
    a.qp.connect(&b.endpoint()?, vrdma_it::access_all())?;
    b.qp.connect(&a.endpoint()?, vrdma_it::access_all())?;
    Ok(std::thread::spawn(move || {
        let (_ca, _cb, b) = (ca, cb, b);
        vrdma_it::stream_writes(&a, &b, BIG, &stop, &bytes, "our write across hosts", || {
            std::thread::sleep(Duration::from_micros(100))
        })
    }))
}

/// Across hosts the link is what the tenants contend for: of two tenants
/// writing from host a to host b at once, the one of weight 3 gets more
/// of it than ours of weight 1.
#[test]
fn across_hosts_the_heavier_weight_gets_more_of_the_link() -> Result<()> {
    if !root() {
        return Ok(());
    }
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let extra =
        format!("[direct]\nenabled = false\n[tenants.0]\nweight = 1\n[tenants.{NOBODY}]\nweight = 3\n");
    let Some(h) = NetnsHosts::start(&extra)? else { return Ok(()) };
    let (stop, ours) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
    let streamer = stream_across(&h.a, &h.b, stop.clone(), ours.clone())?;
    let mut p1 = PeerProc::spawn_as(&h.a.socket, "tenant", &[], Some(NOBODY))?;
    let mut p2 = PeerProc::spawn_as(&h.b.socket, "tenant", &[], Some(NOBODY))?;
    let (h1, h2) = (p1.hello()?, p2.hello()?);
    p1.call_ok(&Command::Connect { peer: h2.endpoint })?;
    p2.call_ok(&Command::Connect { peer: h1.endpoint })?;
    std::thread::sleep(Duration::from_millis(200));
    let count = (256u64 << 20) / BIG as u64;
    let (t0, c0) = (Instant::now(), ours.load(Ordering::Relaxed));
    start_flood(&mut p1, h2.addr, h2.rkey, BIG, count)?;
    end_flood(&mut p1)?;
    let (elapsed, c1) = (t0.elapsed(), ours.load(Ordering::Relaxed));
    stop.store(true, Ordering::Relaxed);
    streamer.join().expect("the streaming thread")?;
    let (heavy, light) = (count * BIG as u64, c1 - c0);
    let ratio = heavy as f64 / light.max(1) as f64;
    eprintln!(
        "across hosts, weights 1:3 over {elapsed:?}: {light} B and {heavy} B, shares {:.3}:{:.3} (ideal 0.25:0.75), \
         ratio {ratio:.2}",
        light as f64 / (light + heavy) as f64,
        heavy as f64 / (light + heavy) as f64
    );
    // A timed figure (the standards keep those in benchmarks; the shares
    // themselves are the simulated-link tests'): asserted only where
    // asked, as in `qos.rs`; both streams must still have moved.
    if light == 0 || heavy == 0 {
        bail!("across hosts a tenant moved nothing: {light} B and {heavy} B");
    }
    if ratio < 1.3 {
        let msg = format!(
            "across hosts the tenant of weight 3 moved {heavy} B while the one of weight 1 moved {light} B"
        );
        if std::env::var_os("VRDMA_TEST_QOS_RATIO").is_some() {
            bail!("{msg}");
        }
        eprintln!("not asserted (VRDMA_TEST_QOS_RATIO=1 asserts it): {msg}");
    }
    // Weights hold nothing back: no rate limit counted on the link.
    let held = held_back(&h.a)?;
    if held != (0, 0) {
        bail!("no tenant is rate-limited, yet the link and our tenant were held back {held:?} ns");
    }
    Ok(())
}

/// Our own tenant (uid 0 on both hosts), limited to 40 MB/s on host a,
/// streams 64 KiB writes to a region on host b for 3 s: the bytes
/// completed in each 1 s window are close to the limit.
#[test]
fn a_rate_limit_holds_for_what_a_tenant_sends_to_another_host() -> Result<()> {
    if !root() {
        return Ok(());
    }
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    const RATE: u64 = 40_000_000;
    // Each daemon serves its metrics on its own namespace's loopback.
    const PORT: u16 = 9464;
    let extra = format!(
        "metrics_listen = \"127.0.0.1:{PORT}\"\n[direct]\nenabled = false\n[tenants.0]\nrate_bytes_per_s = \"40M\"\n"
    );
    let Some(h) = NetnsHosts::start(&extra)? else { return Ok(()) };
    let (a, b) = vrdma_it::across::pair(&h.a, &h.b, false)?;
    let sge = a.mr.sge(0, LEN)?;
    let mut wcs = vrdma::wc_buffer(64);
    // One write first: the QP's first request binds it to the link.
    a.qp.post_send(&[vrdma::wr::SendWrExt::signaled(vrdma::wr::rdma_write(
        u64::MAX,
        &[a.mr.sge(0, 8)?],
        b.mr.addr(),
        b.mr.rkey(),
    )?)])
    .map_err(|e| e.error)?;
    vrdma_it::poll_one(&a.cq, WAIT)?;
    let (mut posted, mut done) = (0u64, 0u64);
    let t0 = Instant::now();
    // Bytes completed in each window of 1 s.
    let mut windows = [0u64; 3];
    // Bounded by time: at the limit, 3 s; the loop ends by then, or by
    // WAIT more if completions stop.
    let end = t0 + Duration::from_secs(3);
    while Instant::now() < end {
        while posted - done < 16 {
            let wr = vrdma::wr::SendWrExt::signaled(vrdma::wr::rdma_write(
                posted,
                &[sge],
                b.mr.addr(),
                b.mr.rkey(),
            )?);
            a.qp.post_send(&[wr]).map_err(|e| e.error)?;
            posted += 1;
        }
        let n = a.cq.poll(&mut wcs)?;
        let at = t0.elapsed().as_secs() as usize;
        for wc in &wcs[..n] {
            if wc.status != vrdma::WcStatus::Success {
                bail!("a write across hosts: {wc:?}");
            }
            if let Some(w) = windows.get_mut(at) {
                *w += LEN as u64;
            }
        }
        done += n as u64;
        if n == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    // What is still in flight completes (or the test fails by WAIT).
    vrdma_it::poll_n(&a.cq, (posted - done) as usize, WAIT)?;
    let errs: Vec<f64> = windows.iter().map(|&w| w as f64 / RATE as f64 - 1.0).collect();
    for (i, (w, e)) in windows.iter().zip(&errs).enumerate() {
        eprintln!("across hosts, limit {RATE} B/s: window {i}: {w} B/s (error {:+.1} %)", e * 100.0);
    }
    for (i, e) in errs.iter().enumerate() {
        if e.abs() > 0.25 {
            bail!("window {i}: a tenant limited to {RATE} B/s sent {} B/s to another host", windows[i]);
        }
    }
    // What the limit held back is counted: on the link, for our tenant,
    // in `vrdma stat`'s reply and in the metrics; never more than the
    // time the stream ran, and nothing for the latency class.
    let (link, ours) = held_back(&h.a)?;
    let ran = t0.elapsed().as_nanos() as u64;
    eprintln!(
        "across hosts, limit {RATE} B/s: held back {link} ns on the link, {ours} ns for the tenant, of {ran}"
    );
    if link == 0 || ours == 0 || link > ran || ours > ran {
        bail!("the limit held the tenant back {ours} ns and the link {link} ns in {ran} ns");
    }
    let text = scrape_in(&h.a, PORT)?;
    let rate = samples(&text, "vrdma_link_throttled_seconds_total", "reason=\"rate_limit\"");
    let cap = samples(&text, "vrdma_link_throttled_seconds_total", "reason=\"queue_cap\"");
    let tenant = samples(&text, "vrdma_tenant_link_throttled_seconds_total", "tenant=\"uid:0\"");
    let cut = samples(&text, "vrdma_link_cut_frames_total", "link=");
    if rate.iter().sum::<f64>() <= 0.0 || tenant.first().is_none_or(|&t| t <= 0.0) {
        bail!("the metrics show no time held back by the rate limit: {rate:?} {tenant:?}\n{text}");
    }
    if cap.iter().any(|&c| c != 0.0) || cut.iter().any(|&c| c != 0.0) || cap.is_empty() || cut.is_empty() {
        bail!("no latency-class tenant, yet a queue cap or cut frames: {cap:?} {cut:?}");
    }
    // The other host's daemon held nothing back.
    let text = scrape_in(&h.b, PORT)?;
    let b_rate = samples(&text, "vrdma_link_throttled_seconds_total", "reason=\"rate_limit\"");
    if b_rate.iter().any(|&r| r != 0.0) {
        bail!("host b has no limited tenant, yet its link counted {b_rate:?}");
    }
    Ok(())
}

/// The victim's median alone and beside the hog, and the hog's bytes a
/// second, across hosts.
struct BesideHog {
    alone: Duration,
    median: Duration,
    hog: f64,
}

/// Our tenant (of the latency class if `protected`) ping-pongs 8-byte
/// sends between the two hosts beside uid 65534 streaming 64 KiB writes
/// over 64 QPs from host a to host b, on daemons of their own.
fn beside_a_hog_across(protected: bool) -> Result<Option<BesideHog>> {
    let class = if protected { "[tenants.0]\nlatency_class = \"latency\"\n" } else { "" };
    let Some(h) = NetnsHosts::start(&format!("[direct]\nenabled = false\n{class}"))? else { return Ok(None) };
    // Our tenant's ping-pong across hosts: a side on each daemon.
    let (a, b) = (Side::new(&h.a.context()?, 4096)?, Side::new(&h.b.context()?, 4096)?);
    a.qp.connect(&b.endpoint()?, vrdma_it::access_all())?;
    b.qp.connect(&a.endpoint()?, vrdma_it::access_all())?;
    let victim = PingPong::new(a, b)?;
    victim.sample(Duration::from_millis(50), 100_000)?;
    let alone = victim.sample(Duration::from_millis(300), 100_000)?;
    let mut hog = PeerProc::spawn_as(&h.a.socket, "tenant", &[], Some(NOBODY))?;
    hog.hello()?;
    hog.send(&Command::StreamTo { qps: 64, len: 64 << 10, millis: 1500, to: h.b.socket.clone() })?;
    match hog.recv::<Said>(Duration::from_secs(60))? {
        Said::Flooding => {}
        other => bail!("the hog answered {other:?} to StreamTo"),
    }
    std::thread::sleep(Duration::from_millis(100));
    let loaded = victim.sample(Duration::from_millis(1000), 100_000)?;
    let hog = match hog.recv::<Said>(Duration::from_secs(30))? {
        Said::Streamed { bytes, micros } => bytes as f64 / (micros.max(1) as f64 / 1e6),
        other => bail!("the hog's stream ended with {other:?}"),
    };
    let med = |v: &[Duration]| v.get(v.len() / 2).copied().unwrap_or_default();
    Ok(Some(BesideHog { alone: med(&alone), median: med(&loaded), hog }))
}

/// Across hosts what a victim waits behind is the link: the hog's frames
/// in the daemon's round, its queue and the kernel's socket. With
/// `latency_class = "latency"` the victim's median beside the hog is
/// lower than without; up to three pairs of runs (2 noisy cores), the
/// first in which it is counts. Only the order is asserted; the figures
/// with their anchors are `vrdma bench-hosts --qos`'s.
#[test]
#[ignore = "on 2 shared cores the two classes' medians across hosts (20-110 ms beside the hog) differ by less than their run-to-run noise, so three pairs still lose now and then; the wait is the CPUs' (`vrdma bench-hosts --qos`: the victim waits as long beside a CPU-only load of the hog's busy threads, no byte on the link); run by hand with --ignored, and read `vrdma bench-hosts --qos`"]
fn across_hosts_a_latency_class_tenant_waits_less_beside_a_hog() -> Result<()> {
    if !root() {
        return Ok(());
    }
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let mut pairs = Vec::new();
    for _ in 0..3 {
        let Some(plain) = beside_a_hog_across(false)? else { return Ok(()) };
        let Some(protected) = beside_a_hog_across(true)? else { return Ok(()) };
        for (what, f) in [("normal", &plain), ("latency", &protected)] {
            eprintln!(
                "across hosts, class {what}: victim alone {:?}, beside a 64-QP hog {:?} ({:.1}x); hog {:.0} MB/s",
                f.alone,
                f.median,
                f.median.as_secs_f64() / f.alone.as_secs_f64().max(1e-9),
                f.hog / 1e6
            );
        }
        let better = protected.median < plain.median;
        pairs.push((plain.median, protected.median));
        if better {
            return Ok(());
        }
    }
    bail!("with latency_class = \"latency\" the victim's median across hosts was never below its median without: {pairs:?}")
}
