//! The traffic of the named tests: what each side of one stream does.
//!
//! A stream is one thread on each side with its own QPs (or TCP
//! connection). The client decides how long a test runs (`--time` or
//! `--iters`); the server runs until told to stop. Every wait is bounded:
//! the client gives up when nothing progresses for [`STALL`], and either
//! side stops at once when its control connection says the peer is gone.

mod pingpong;
mod rdma;
mod stream;
mod tcp;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use serde::Serialize;

pub use rdma::{QpInfo, Rdma};
pub use tcp::{accept_streams, connect_streams};

use super::spec::{Limit, TestName, Transport};

/// A client waiting this long without progress gives up.
pub const STALL: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Client,
    Server,
}

/// Set by the thread that watches the control connection.
#[derive(Debug, Default)]
pub struct Flags {
    /// The client has finished: the server's streams end normally.
    pub stop: AtomicBool,
    /// The peer is gone or failed: every stream ends with an error.
    pub abort: AtomicBool,
}

/// When a stream goes on and when it gives up.
pub struct Clock<'a> {
    side: Side,
    limit: Limit,
    start: Instant,
    flags: &'a Flags,
}

impl<'a> Clock<'a> {
    pub fn new(side: Side, limit: Limit, flags: &'a Flags) -> Clock<'a> {
        Clock { side, limit, start: Instant::now(), flags }
    }

    fn aborted(&self) -> Result<()> {
        if self.flags.abort.load(Ordering::Relaxed) {
            bail!("stopped: the peer went away or failed");
        }
        Ok(())
    }

    /// Whether to start iteration `i` (from 0).
    pub fn go(&self, i: u64) -> Result<bool> {
        self.aborted()?;
        Ok(match (self.side, self.limit) {
            (Side::Server, _) => !self.flags.stop.load(Ordering::Relaxed),
            (Side::Client, Limit::Iters(n)) => i < n,
            (Side::Client, Limit::Time(d)) => self.start.elapsed() < d,
        })
    }

    /// Called while a wait that began at `since` finds nothing: `true`
    /// when the server has been told to stop; an error on abort, or when
    /// the client has seen no progress for [`STALL`].
    pub fn idle(&self, since: Instant) -> Result<bool> {
        self.aborted()?;
        match self.side {
            Side::Server => Ok(self.flags.stop.load(Ordering::Relaxed)),
            Side::Client if since.elapsed() > STALL => {
                bail!("nothing completed for {STALL:?}: the server stopped answering")
            }
            Side::Client => Ok(false),
        }
    }
}

#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Count {
    pub bytes: u64,
    pub messages: u64,
}

impl Count {
    pub fn add(&mut self, bytes: u64) {
        self.bytes += bytes;
        self.messages += 1;
    }
}

/// What one side of one stream measured.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Latency samples in ns: one way for ping-pongs, the whole
    /// operation for reads and atomics.
    pub lat_ns: Vec<f64>,
    pub sent: Count,
    pub received: Count,
    pub seconds: f64,
}

/// One stream's endpoint of a test, made before the test starts.
pub enum Stream {
    Rdma(Box<Rdma>),
    Tcp(std::net::TcpStream),
}

/// Runs one side of one stream of `test` until the clock says stop.
pub fn run(test: TestName, size: usize, stream: &mut Stream, clock: &Clock) -> Result<Outcome> {
    use TestName::*;
    let client = clock.side == Side::Client;
    match stream {
        Stream::Tcp(s) => match test {
            TcpLat => tcp::lat(s, size, clock),
            _ => tcp::bw(s, size, clock),
        },
        Stream::Rdma(r) => match test {
            RcLat | UdLat => pingpong::send(r, clock),
            RcRdmaWriteLat if r.events() => pingpong::send(r, clock),
            RcRdmaWriteLat => pingpong::write_spin(r, clock),
            RcRdmaReadLat | RcCompareSwapMr | RcFetchAddMr if client => {
                pingpong::one_at_a_time(r, test, clock)
            }
            RcBw | UdBw if client => stream::run(r, clock, true),
            RcBw | UdBw => stream::run(r, clock, false),
            RcBiBw => stream::run(r, clock, true),
            RcRdmaWriteBw | RcRdmaReadBw if client => stream::run(r, clock, true),
            _ => passive(clock),
        },
    }
}

/// The side that only lends its memory (reads, writes, atomics): waits to
/// be stopped.
fn passive(clock: &Clock) -> Result<Outcome> {
    let since = Instant::now();
    while !clock.idle(since)? {
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(Outcome::default())
}

/// Makes the RDMA side of one stream (TCP streams are connected later).
pub fn make_rdma(ctx: &vrdma::Context, test: TestName, size: usize, qps: u32, events: bool) -> Result<Rdma> {
    debug_assert!(test.transport() != Transport::Tcp);
    Rdma::new(ctx, test, size, qps as usize, events)
}

/// A stream running in its own thread; it hands its endpoint back so that
/// the caller decides when the QPs go away.
pub type Running = std::thread::JoinHandle<Result<(Outcome, Stream)>>;

pub fn spawn(
    test: TestName,
    size: usize,
    streams: Vec<Stream>,
    side: Side,
    limit: Limit,
    flags: &std::sync::Arc<Flags>,
) -> Result<Vec<Running>> {
    streams
        .into_iter()
        .enumerate()
        .map(|(i, mut stream)| {
            let flags = flags.clone();
            let t = std::thread::Builder::new().name(format!("bench-stream-{i}")).spawn(move || {
                let clock = Clock::new(side, limit, &flags);
                let r = run(test, size, &mut stream, &clock);
                if r.is_err() {
                    // One stream failing ends the others.
                    flags.abort.store(true, Ordering::Relaxed);
                }
                r.map(|o| (o, stream))
            })?;
            Ok(t)
        })
        .collect()
}

/// Joins the streams, waiting at most `limit` for them to end (each ends
/// within a bounded time once stopped or aborted); the first error wins.
pub fn join(running: Vec<Running>, limit: Duration) -> Result<Vec<(Outcome, Stream)>> {
    let end = Instant::now() + limit;
    while running.iter().any(|t| !t.is_finished()) {
        if Instant::now() > end {
            bail!("a stream did not end within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let mut out = Vec::new();
    for t in running {
        out.push(t.join().map_err(|_| anyhow::anyhow!("a stream thread panicked"))??);
    }
    Ok(out)
}

/// True once every stream has ended.
pub fn all_done(running: &[Running]) -> bool {
    running.iter().all(|t| t.is_finished())
}
