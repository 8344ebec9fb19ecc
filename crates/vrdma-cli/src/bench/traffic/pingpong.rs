//! The latency tests: ping-pongs and one operation at a time. QPs take
//! turns, iteration `i` on QP `i % qps`.

use std::time::Instant;

use anyhow::{bail, Result};
use vrdma::{wc_buffer, WorkCompletion};

use super::rdma::{is_recv, Rdma};
use super::{Clock, Outcome, Side};
use crate::bench::spec::TestName;

/// How many empty spins between two looks at the clock.
const SPINS_PER_LOOK: u32 = 256;

/// Drops the first samples (page faults, caches): at most 100, a tenth.
pub fn warmed(mut samples: Vec<f64>) -> Vec<f64> {
    let skip = (samples.len() / 10).min(100);
    samples.drain(..skip);
    samples
}

/// Waits for one incoming message and posts a receive in its place;
/// `None` when the server is told to stop while waiting.
fn wait_recv(r: &Rdma, clock: &Clock, wcs: &mut [WorkCompletion]) -> Result<Option<usize>> {
    let since = Instant::now();
    loop {
        let n = r.poll(wcs)?;
        let mut got = None;
        for wc in &wcs[..n] {
            if is_recv(wc) {
                let q = r.qp_of(wc)?;
                r.post_recv(q)?;
                if got.replace(q).is_some() {
                    bail!("two messages arrived where one was expected");
                }
            }
        }
        if got.is_some() {
            return Ok(got);
        }
        if n == 0 && clock.idle(since)? {
            return Ok(None);
        }
    }
}

/// Send/receive ping-pong (rc_lat, ud_lat; rc_rdma_write_lat under
/// --events, with writes with immediate). Samples: half the round trip.
pub fn send(r: &Rdma, clock: &Clock) -> Result<Outcome> {
    let mut wcs = wc_buffer(32);
    let mut out = Outcome::default();
    let size = r.size() as u64;
    let start = Instant::now();
    let mut i = 0u64;
    while clock.go(i)? {
        let t0 = Instant::now();
        if clock.side == Side::Client {
            r.post((i % r.qps() as u64) as usize, i)?;
            out.sent.add(size);
        }
        let Some(q) = wait_recv(r, clock, &mut wcs)? else { break };
        out.received.add(size);
        if clock.side == Side::Server {
            r.post(q, i)?;
            out.sent.add(size);
        } else {
            out.lat_ns.push(t0.elapsed().as_nanos() as f64 / 2.0);
        }
        i += 1;
    }
    out.seconds = start.elapsed().as_secs_f64();
    out.lat_ns = warmed(out.lat_ns);
    Ok(out)
}

/// RDMA write ping-pong, each side spinning on the last byte of its
/// receive slot for the tag the peer wrote (ib_write_lat, qperf's
/// rc_rdma_write_lat). Samples: half the round trip.
pub fn write_spin(r: &Rdma, clock: &Clock) -> Result<Outcome> {
    let mut wcs = wc_buffer(32);
    let mut out = Outcome::default();
    let size = r.size() as u64;
    let start = Instant::now();
    let mut i = 0u64;
    while clock.go(i)? {
        let q = (i % r.qps() as u64) as usize;
        // QP q's i-th tag: never 0 (the memory's first value), never the previous one.
        let tag = ((i / r.qps() as u64) % 255 + 1) as u8;
        let t0 = Instant::now();
        if clock.side == Side::Client {
            r.set_tag(q, tag)?;
            r.post(q, i)?;
            out.sent.add(size);
        }
        let mut spins = 0u32;
        while r.received_tag(q)? != tag {
            // Reaps our own write completions (and yields where cores are few).
            r.poll(&mut wcs)?;
            spins += 1;
            if spins.is_multiple_of(SPINS_PER_LOOK) && clock.idle(t0)? {
                break;
            }
        }
        if r.received_tag(q)? != tag {
            break; // the server was stopped while waiting
        }
        out.received.add(size);
        if clock.side == Side::Server {
            r.set_tag(q, tag)?;
            r.post(q, i)?;
            out.sent.add(size);
        } else {
            out.lat_ns.push(t0.elapsed().as_nanos() as f64 / 2.0);
        }
        i += 1;
    }
    // Leaves no write of ours in flight at teardown.
    let end = Instant::now() + std::time::Duration::from_millis(50);
    while Instant::now() < end {
        r.poll(&mut wcs)?;
    }
    out.seconds = start.elapsed().as_secs_f64();
    out.lat_ns = warmed(out.lat_ns);
    Ok(out)
}

/// The client's side of rc_rdma_read_lat and the atomics: one operation
/// at a time; the sample is the whole operation. Atomics are checked:
/// each returns the value the one before it left.
pub fn one_at_a_time(r: &Rdma, test: TestName, clock: &Clock) -> Result<Outcome> {
    let mut wcs = wc_buffer(8);
    let mut out = Outcome::default();
    let mut expect = vec![0u64; r.qps()];
    let size = r.size() as u64;
    let atomic = test != TestName::RcRdmaReadLat;
    let start = Instant::now();
    let mut i = 0u64;
    while clock.go(i)? {
        let q = (i % r.qps() as u64) as usize;
        let t0 = Instant::now();
        if atomic {
            r.post_atomic(q, i, test, expect[q])?;
        } else {
            r.post(q, i)?;
        }
        while r.poll(&mut wcs)? == 0 {
            clock.idle(t0)?;
        }
        out.lat_ns.push(t0.elapsed().as_nanos() as f64);
        if atomic {
            let got = r.atomic_result(q)?;
            if got != expect[q] {
                bail!("{} returned {got}, expected {}", test.name(), expect[q]);
            }
            expect[q] += 1;
        }
        out.received.add(size);
        i += 1;
    }
    out.seconds = start.elapsed().as_secs_f64();
    out.lat_ns = warmed(out.lat_ns);
    Ok(out)
}
