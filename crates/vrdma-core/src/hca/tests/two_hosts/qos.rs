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
}

impl LinkSim {
    fn new() -> LinkSim {
        LinkSim {
            t: TwoHosts::new(CHUNK),
            streams: Vec::new(),
            now: T0,
            bytes: vec![0; 2],
            throttled_waits: 0,
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
            self.streams.push(Stream { tenant, a, b, len });
        }
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
