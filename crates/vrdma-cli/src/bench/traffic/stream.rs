//! The bandwidth tests: a stream of messages, up to [`DEPTH`] in flight
//! on each QP, and/or the receiving end that keeps receives posted.

use std::time::Instant;

use anyhow::Result;
use vrdma::wc_buffer;

use super::rdma::{is_recv, Rdma};
use super::{Clock, Outcome, Side};

/// Messages in flight per QP.
pub const DEPTH: u32 = 16;

/// Sends (if `send`) and receives whatever comes until the clock stops the
/// sending and every message sent has completed. A receive-only side runs
/// until stopped.
pub fn run(r: &Rdma, clock: &Clock, send: bool) -> Result<Outcome> {
    let mut wcs = wc_buffer(64);
    let mut out = Outcome::default();
    let size = r.size() as u64;
    let mut in_flight = vec![0u32; r.qps()];
    let mut total_in_flight = 0u64;
    let (mut posted, mut next_q) = (0u64, 0usize);
    let mut sending = send;
    let start = Instant::now();
    let mut since = start;
    loop {
        if sending && !clock.go(posted)? {
            sending = false;
        }
        let mut progress = false;
        // Post round robin while QPs have room.
        while sending && in_flight[next_q] < DEPTH {
            r.post(next_q, posted)?;
            in_flight[next_q] += 1;
            total_in_flight += 1;
            posted += 1;
            next_q = (next_q + 1) % r.qps();
            progress = true;
            if !clock.go(posted)? {
                sending = false;
            }
        }
        let n = r.poll(&mut wcs)?;
        for wc in &wcs[..n] {
            let q = r.qp_of(wc)?;
            if is_recv(wc) {
                out.received.add(r.payload(wc));
                r.post_recv(q)?;
            } else {
                in_flight[q] = in_flight[q].saturating_sub(1);
                total_in_flight = total_in_flight.saturating_sub(1);
                out.sent.add(size);
            }
        }
        if n > 0 || progress {
            since = Instant::now();
        }
        // The client is done once its own messages have all completed;
        // a server runs until it is stopped.
        if send && !sending && total_in_flight == 0 && clock.side == Side::Client {
            break;
        }
        if n == 0 && clock.idle(since)? {
            break;
        }
    }
    out.seconds = start.elapsed().as_secs_f64();
    Ok(out)
}
