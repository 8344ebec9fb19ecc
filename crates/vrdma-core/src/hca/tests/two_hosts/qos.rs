//! Weights and rate limits on a link: what a tenant sends to another
//! host is shared by bytes and held to its rate limit as on one host.
//!
//! A simulated link carries A's frames one at a time, each taking time in
//! proportion to its bytes on the wire (the link's speed), while B's
//! answers cross at once; tenants stream RDMA writes, reposting each as
//! it completes. Time is passed in, so the figures are exact and the
//! tests deterministic.

use super::*;

/// Nanoseconds a byte takes on the simulated link (25 MB/s).
const NS_PER_BYTE: u64 = 40;
const CHUNK: u32 = 16 << 10;
const SECOND: Duration = Duration::from_secs(1);

/// A QP of A that streams writes of `len` bytes to its peer on B.
struct Stream {
    tenant: usize,
    a: End,
    b: End,
    len: u32,
    /// Each completed write is posted again.
    repost: bool,
}

struct LinkSim {
    t: TwoHosts,
    streams: Vec<Stream>,
    now: Instant,
    /// Payload bytes of A's request frames, per tenant index.
    bytes: Vec<u64>,
    /// Polls of A's link that found nothing while a rate limit held a
    /// tenant back (the engine would sleep until the link's timer).
    throttled_waits: u64,
    /// Every frame A sent: when it ended, its source QP, its payload.
    sent: Vec<(Instant, u32, u32)>,
}

impl LinkSim {
    fn new() -> LinkSim {
        LinkSim {
            t: TwoHosts::new(CHUNK),
            streams: Vec::new(),
            now: T0,
            bytes: vec![0; 2],
            throttled_waits: 0,
            sent: Vec::new(),
        }
    }

    /// Tenant 0 is `TENANT` (context C1), tenant 1 `OTHER_TENANT` (C3):
    /// `qps` more QPs of it stream writes of `len` bytes.
    fn stream(&mut self, tenant: usize, qps: u32, len: u32) {
        let ctx = [C1, C3][tenant];
        for _ in 0..qps {
            let (a, b) = (self.t.a.env.end(ctx), self.t.b.env.end(ctx));
            self.t.connect(a.qpn, b.qpn, conn());
            for i in 0..8 {
                self.t.a.env.io.post_send(
                    a.qpn,
                    rdma(i, SendOpcode::RdmaWrite, &[a.buf.sge(0, len)], b.buf.addr, b.buf.key),
                );
            }
            self.streams.push(Stream { tenant, a, b, len, repost: true });
        }
    }

    /// A connected QP of tenant `tenant` that sends only what the test
    /// posts ([`LinkSim::ping`]); its index in the streams.
    fn prober(&mut self, tenant: usize) -> usize {
        let ctx = [C1, C3][tenant];
        let (a, b) = (self.t.a.env.end(ctx), self.t.b.env.end(ctx));
        self.t.connect(a.qpn, b.qpn, conn());
        self.streams.push(Stream { tenant, a, b, len: 8, repost: false });
        self.streams.len() - 1
    }

    /// Posts one 8-byte write on stream `i`.
    fn ping(&mut self, i: usize) {
        let s = &self.streams[i];
        self.t.a.env.io.post_send(
            s.a.qpn,
            rdma(0, SendOpcode::RdmaWrite, &[s.a.buf.sge(0, 8)], s.b.buf.addr, s.b.buf.key),
        );
    }

    /// Posts a ping on stream `i` at `at` (the frame on the wire then
    /// ends first: frames go whole) and runs until it went out; returns
    /// how long it waited from `at` to the end of its own frame, and how
    /// many frames went out after `at` before it.
    fn ping_wait(&mut self, i: usize, at: Instant) -> (Duration, usize) {
        self.run_until(at);
        let qpn = self.streams[i].a.qpn;
        let from = self.sent.len();
        self.ping(i);
        for _ in 0..100_000 {
            self.round();
            if let Some(k) = self.sent[from..].iter().position(|f| f.1 == qpn) {
                return (self.sent[from + k].0.saturating_since(at), k);
            }
        }
        panic!("the ping never went out");
    }

    fn set_qos(&mut self, tenant: usize, qos: Qos) {
        self.t.a.env.hca.set_qos([TENANT, OTHER_TENANT][tenant], qos).unwrap();
    }

    /// Runs until `until`; returns the payload bytes each tenant sent
    /// meanwhile.
    fn run_until(&mut self, until: Instant) -> Vec<u64> {
        let before = self.bytes.clone();
        // Bounded: each round sends a frame (time passes), waits for a
        // timer, or passes a microsecond.
        for _ in 0..10_000_000 {
            if self.now >= until {
                break;
            }
            self.round();
        }
        assert!(self.now >= until, "the simulation did not reach its end");
        self.bytes.iter().zip(&before).map(|(a, b)| a - b).collect()
    }

    fn round(&mut self) {
        let now = self.now;
        let t = &mut self.t;
        t.a.env.step(now);
        t.b.env.step(now);
        // B's answers cross at once.
        for _ in 0..1000 {
            if !TwoHosts::carry(&mut t.b, &mut t.a, now, '<', &mut Vec::new()) {
                break;
            }
        }
        // Each completed write is posted again.
        for s in &self.streams {
            for c in t.a.env.poll(s.a.cq) {
                if !s.repost {
                    continue;
                }
                assert_eq!(c.status, WcStatus::Success);
                t.a.env.io.post_send(
                    s.a.qpn,
                    rdma(c.wr_id, SendOpcode::RdmaWrite, &[s.a.buf.sge(0, s.len)], s.b.buf.addr, s.b.buf.key),
                );
            }
        }
        match t.a.env.hca.poll_transmit(t.a.link, now, &mut t.a.env.io) {
            Some(tx) => {
                let d = data_header(&tx);
                if let Some(s) = self.streams.iter().find(|s| s.a.qpn == d.src_qpn) {
                    self.bytes[s.tenant] += u64::from(d.payload_len);
                }
                TwoHosts::deliver(&tx, &mut t.b, now, '>', &mut Vec::new());
                self.now = now + Duration::from_nanos(tx.len() as u64 * NS_PER_BYTE);
                self.sent.push((self.now, d.src_qpn, d.payload_len));
            }
            None => match t.a.env.hca.take_link_timer() {
                Some(at) if at > now => {
                    self.throttled_waits += 1;
                    self.now = at;
                }
                _ => self.now = now + Duration::from_micros(1),
            },
        }
    }
}

fn weighted(weight: u32) -> Qos {
    Qos { weight, ..Qos::default() }
}

fn jain(x: &[u64]) -> f64 {
    let s: f64 = x.iter().map(|&v| v as f64).sum();
    let s2: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    s * s / (x.len() as f64 * s2)
}

#[test]
fn equal_weights_share_a_link_by_bytes_whatever_the_qps_and_message_sizes() {
    let mut sim = LinkSim::new();
    // Four QPs of full chunks against one of small writes: turns by
    // frames would give the small writer an eighth of the bytes.
    sim.stream(0, 4, CHUNK);
    sim.stream(1, 1, 2 << 10);
    sim.run_until(T0 + SECOND / 10);
    let bytes = sim.run_until(T0 + SECOND);
    let j = jain(&bytes);
    assert!(j >= 0.99, "Jain's index {j}: {bytes:?}");
}

#[test]
fn a_link_is_shared_by_weight() {
    let mut sim = LinkSim::new();
    sim.set_qos(0, weighted(1));
    sim.set_qos(1, weighted(3));
    sim.stream(0, 4, CHUNK);
    sim.stream(1, 2, 8 << 10);
    sim.run_until(T0 + SECOND / 10);
    let bytes = sim.run_until(T0 + SECOND);
    let ratio = bytes[1] as f64 / bytes[0] as f64;
    assert!((ratio / 3.0 - 1.0).abs() < 0.05, "ratio {ratio:.3}, not 3: {bytes:?}");
}

/// A limited tenant's bytes across the link per 1 s window of simulated
/// time: within 5 % of its limit, alone and beside an unlimited tenant;
/// and while it waits for its bucket the link reports when to come back
/// rather than making the engine spin.
#[test]
fn a_rate_limit_holds_for_what_a_tenant_sends_to_another_host() {
    const RATE: u64 = 5_000_000; // a fifth of the link
    for beside in [false, true] {
        let mut sim = LinkSim::new();
        sim.set_qos(0, Qos { bytes_per_s: Some(RATE), ..Qos::default() });
        sim.stream(0, 4, CHUNK);
        if beside {
            sim.stream(1, 2, CHUNK);
        }
        for w in 1..=3u32 {
            let bytes = sim.run_until(T0 + w * SECOND);
            let err = bytes[0] as f64 / RATE as f64 - 1.0;
            assert!(err.abs() < 0.05, "beside: {beside}, window {w}: {bytes:?}, error {err:.4}");
            if beside {
                assert!(bytes[1] > 3 * RATE, "the other tenant keeps the rest of the link: {bytes:?}");
            }
        }
        if !beside {
            assert!(sim.throttled_waits > 100, "the limit held it back {} times", sim.throttled_waits);
            assert!(sim.throttled_waits < 3 * 1100, "{} waits: about one a millisecond", sim.throttled_waits);
        }
    }
}

#[test]
fn a_message_rate_limit_holds_on_a_link() {
    const RATE: u64 = 2_000;
    let mut sim = LinkSim::new();
    sim.set_qos(0, Qos { messages_per_s: Some(RATE), ..Qos::default() });
    sim.stream(0, 2, 64);
    let mut sent = 0;
    for w in 1..=2u32 {
        let bytes = sim.run_until(T0 + w * SECOND);
        let msgs = bytes[0] / 64;
        let err = msgs as f64 / RATE as f64 - 1.0;
        assert!(err.abs() < 0.05, "window {w}: {msgs} messages, error {err:.4}");
        sent += msgs;
    }
    assert!(sent > 0);
}

fn latency(weight: u32) -> Qos {
    Qos { weight, class: LatencyClass::Latency, ..Qos::default() }
}

/// A latency-class tenant's 8-byte write goes out before the frames the
/// hog (8 QPs, each with writes of a full chunk queued) has waiting, and
/// while it is active the hog's frames are cut to a quarter of the chunk:
/// its wait is one cut frame at most (the one on the wire when it came),
/// against one full frame or more for a normal tenant.
#[test]
fn a_latency_tenants_request_goes_before_the_hogs_queued_frames() {
    let cut = crate::hca::remote::cut_frame(CHUNK);
    assert!(cut < CHUNK);
    let mut waits = Vec::new();
    for class in [LatencyClass::Normal, LatencyClass::Latency] {
        let mut sim = LinkSim::new();
        sim.set_qos(1, Qos { class, ..Qos::default() });
        sim.stream(0, 8, CHUNK);
        let p = sim.prober(1);
        sim.run_until(T0 + SECOND / 100);
        // A first ping binds the QP to the link and earns the tenant its
        // credit in the round.
        sim.ping_wait(p, sim.now);
        sim.run_until(sim.now + Duration::from_micros(500));
        let mut worst = Duration::ZERO;
        for k in 0..20u32 {
            // Pings at moments that do not line up with the frames.
            let at = sim.now + Duration::from_micros(97 + 13 * u64::from(k));
            let from = sim.sent.len();
            let (wait, before) = sim.ping_wait(p, at);
            worst = worst.max(wait);
            if class == LatencyClass::Latency {
                assert_eq!(before, 0, "ping {k}: {before} frames of the hog went first");
                let hog = sim.sent[from.saturating_sub(4)..from].iter().map(|f| f.2).max().unwrap_or(0);
                assert!(hog <= cut, "the hog's frames are cut while the latency tenant is active: {hog}");
            }
        }
        waits.push(worst);
    }
    // At most the cut frame on the wire when it came, and its own.
    let frame_ns = |payload: u32| (u64::from(payload) + 2 * TX_HEADER_CAP as u64) * NS_PER_BYTE;
    assert!(waits[1] <= Duration::from_nanos(frame_ns(cut) + frame_ns(8)), "{waits:?}");
    assert!(waits[1] * 2 < waits[0], "with the class {:?}, without {:?}", waits[1], waits[0]);
}

/// Work conservation: a hog beside a latency-class tenant that stays idle
/// gets at least 90 % of the link, in full chunks again once the window
/// passed; beside one that pings every millisecond, still 90 %.
#[test]
fn the_hog_keeps_the_link_beside_a_latency_tenant_idle_or_pinging() {
    let capacity = |d: Duration| d.as_nanos() as f64 / NS_PER_BYTE as f64;
    let mut sim = LinkSim::new();
    sim.set_qos(1, latency(1));
    sim.stream(0, 8, CHUNK);
    let p = sim.prober(1);
    sim.run_until(T0 + SECOND / 100);
    sim.ping_wait(p, sim.now);
    // Pinging: a ping each millisecond for a second.
    let start = sim.now;
    let mut hog = 0;
    for _ in 0..1000 {
        let until = sim.now + Duration::from_millis(1);
        sim.ping(p);
        hog += sim.run_until(until)[0];
    }
    let share = hog as f64 / capacity(sim.now.saturating_since(start));
    assert!(share >= 0.90, "beside pings the hog got {share:.3} of the link");
    // Idle: after the window, full chunks and the whole link.
    sim.run_until(sim.now + crate::hca::schedule::LATENCY_WINDOW * 2);
    let (from, start) = (sim.sent.len(), sim.now);
    let hog = sim.run_until(start + SECOND)[0];
    let share = hog as f64 / capacity(SECOND);
    assert!(share >= 0.90, "beside an idle latency tenant the hog got {share:.3} of the link");
    let full = sim.sent[from..].iter().filter(|f| f.2 == CHUNK).count();
    assert!(full * 10 >= (sim.sent.len() - from) * 9, "{full} of {} frames full", sim.sent.len() - from);
}

/// Going first does not buy a latency-class tenant more than its weight:
/// streaming beside a normal tenant, each gets the link in the ratio of
/// the weights (within 5 %), whichever is heavier.
#[test]
fn a_streaming_latency_tenant_keeps_to_its_weight_on_a_link() {
    for (wl, wn) in [(1u32, 3u32), (3, 1)] {
        let mut sim = LinkSim::new();
        sim.set_qos(0, weighted(wn));
        sim.set_qos(1, latency(wl));
        sim.stream(0, 4, CHUNK);
        sim.stream(1, 2, CHUNK);
        sim.run_until(T0 + SECOND / 10);
        let bytes = sim.run_until(T0 + SECOND);
        let ratio = bytes[1] as f64 / bytes[0] as f64;
        let want = f64::from(wl) / f64::from(wn);
        assert!((ratio / want - 1.0).abs() < 0.05, "latency {wl} : normal {wn}: ratio {ratio:.3}: {bytes:?}");
    }
}

impl LinkSim {
    /// What A's link scheduler counted as held back.
    fn throttle(&self) -> crate::hca::LinkThrottle {
        self.t.a.env.hca.links().first().map(|l| l.stats.throttle).unwrap_or_default()
    }

    /// Tenant `tenant`'s time held back by its rate limit on links, in ns.
    fn tenant_link_throttled(&self, tenant: usize) -> u64 {
        self.t.a.env.hca.tenant_report([TENANT, OTHER_TENANT][tenant]).counters.link_throttled_ns
    }
}

/// What a link's scheduler holds back is counted (for the metrics and
/// `vrdma stat`): nothing while no tenant is limited or of the latency
/// class; a rate-limited tenant's held time, on the link and for the
/// tenant, about the part of the time its limit leaves the link to
/// others; and the frames cut for a latency-class tenant.
#[test]
fn what_a_link_holds_back_for_a_rate_limit_or_the_latency_class_is_counted() {
    // Two unlimited tenants of the normal class: nothing.
    let mut sim = LinkSim::new();
    sim.stream(0, 4, CHUNK);
    sim.stream(1, 1, CHUNK);
    sim.run_until(T0 + SECOND / 2);
    assert_eq!(sim.throttle(), crate::hca::LinkThrottle::default());
    assert_eq!((sim.tenant_link_throttled(0), sim.tenant_link_throttled(1)), (0, 0));

    // A tenant limited to a fifth of the link, alone, then beside an
    // unlimited one: held back about four fifths of the time.
    const RATE: u64 = 5_000_000;
    for beside in [false, true] {
        let mut sim = LinkSim::new();
        sim.set_qos(0, Qos { bytes_per_s: Some(RATE), ..Qos::default() });
        sim.stream(0, 4, CHUNK);
        if beside {
            sim.stream(1, 2, CHUNK);
        }
        sim.run_until(T0 + SECOND);
        let held = sim.throttle().rate_limited_ns;
        let s = SECOND.as_nanos() as u64;
        assert!(held > s / 2 && held < s, "beside: {beside}: held {held} ns of 1 s");
        assert_eq!(sim.tenant_link_throttled(0), held, "one tenant held: its time is the link's");
        assert_eq!(sim.tenant_link_throttled(1), 0, "the unlimited tenant is never held");
        assert_eq!((sim.throttle().cut_frames, sim.throttle().cut_bytes), (0, 0));
    }

    // A hog beside a tenant that pings every millisecond: its frames are
    // cut only while that tenant is of the latency class.
    let cut = u64::from(crate::hca::remote::cut_frame(CHUNK));
    for class in [LatencyClass::Normal, LatencyClass::Latency] {
        let mut sim = LinkSim::new();
        sim.set_qos(1, Qos { class, ..Qos::default() });
        sim.stream(0, 8, CHUNK);
        let p = sim.prober(1);
        sim.run_until(T0 + SECOND / 100);
        for _ in 0..50 {
            let until = sim.now + Duration::from_millis(1);
            sim.ping(p);
            sim.run_until(until);
        }
        let th = sim.throttle();
        assert_eq!(th.rate_limited_ns, 0);
        if class == LatencyClass::Latency {
            assert!(th.cut_frames > 50, "{th:?}");
            assert!(th.cut_bytes <= th.cut_frames * cut && th.cut_bytes * 2 > th.cut_frames * cut, "{th:?}");
        } else {
            assert_eq!((th.cut_frames, th.cut_bytes), (0, 0), "no latency tenant, no cut");
        }
    }
}
