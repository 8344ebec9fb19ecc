//! The victim of the isolation and QoS tests: 8-byte sends bounced
//! between two connected sides, measured beside another tenant.
//!
//! Completions are polled with a yield between polls, not a sleep: a sleep
//! would measure the sleep.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use vrdma::wr::{self, SendWrExt as _};

use crate::{Side, WAIT};

/// Two connected sides, each with receives posted.
pub struct PingPong {
    pub a: Side,
    pub b: Side,
}

impl PingPong {
    /// Posts 64 receives of 8 bytes on each of `a` and `b`, which are
    /// connected to each other.
    pub fn new(a: Side, b: Side) -> Result<PingPong> {
        for s in [&a, &b] {
            for i in 0..64 {
                s.qp.post_recv(&[wr::recv(i, &[s.mr.sge(64, 8)?])?]).map_err(|e| e.error)?;
            }
        }
        Ok(PingPong { a, b })
    }

    /// One 8-byte send each way; returns half the round trip.
    pub fn one_way(&self, i: u64) -> Result<Duration> {
        let t0 = Instant::now();
        for (from, to) in [(&self.a, &self.b), (&self.b, &self.a)] {
            from.qp.post_send(&[wr::send(i, &[from.mr.sge(0, 8)?])?.signaled()]).map_err(|e| e.error)?;
            for s in [from, to] {
                let wc = spin_one(&s.cq)?;
                if wc.status != vrdma::WcStatus::Success {
                    bail!("round trip {i}: {wc:?}");
                }
                if wc.opcode == vrdma::WcOpcode::Recv {
                    s.qp.post_recv(&[wr::recv(i, &[s.mr.sge(64, 8)?])?]).map_err(|e| e.error)?;
                }
            }
        }
        Ok(t0.elapsed() / 2)
    }

    /// One-way latencies for `span` (at most `max` of them), sorted.
    pub fn sample(&self, span: Duration, max: usize) -> Result<Vec<Duration>> {
        let end = Instant::now() + span;
        let mut v = Vec::new();
        while Instant::now() < end && v.len() < max {
            v.push(self.one_way(v.len() as u64)?);
        }
        v.sort_unstable();
        Ok(v)
    }
}

/// Polls one completion, yielding between polls, within `WAIT`.
fn spin_one(cq: &vrdma::CompletionQueue) -> Result<vrdma::WorkCompletion> {
    let end = Instant::now() + WAIT;
    let mut wc = vrdma::wc_buffer(1);
    loop {
        if cq.poll(&mut wc)? == 1 {
            return Ok(wc[0]);
        }
        if Instant::now() > end {
            bail!("no completion within {WAIT:?}");
        }
        std::thread::yield_now();
    }
}
