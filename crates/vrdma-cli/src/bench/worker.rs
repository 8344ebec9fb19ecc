//! One side of a benchmark: a separate process with its own context, QP
//! and memory, as an RDMA application would be.
//!
//! Protocol with the parent: print our endpoint as one JSON line, read the
//! peer's, connect, run; the client prints an [`Outcome`] line, the server
//! runs until its stdin closes.

use std::io::BufRead;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use serde::{Deserialize, Serialize};
use vrdma::{
    AccessFlags, CompletionChannel, CompletionQueue, Context, Endpoint, MemoryRegion, QpCap, QueuePair,
    RecvWr, SendFlags, SendOpcode, SendWr, SgeList, WcStatus, WorkCompletion,
};

use super::suite::Outcome;

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Client,
    Server,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Client => "client",
            Role::Server => "server",
        }
    }
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Test {
    /// Ping-pong of RDMA writes, each side spinning on its own memory (ib_write_lat).
    WriteLat,
    /// Ping-pong of sends, each side polling its CQ (ib_send_lat).
    SendLat,
    /// Ping-pong of sends, each side waiting on a completion channel (ib_send_lat -e).
    SendLatEvent,
    /// A stream of RDMA writes, `DEPTH` in flight (ib_write_bw).
    WriteBw,
    /// Signaled RDMA reads one at a time, polling the CQ; the sample is the
    /// whole read (a round trip), as ib_read_lat reports it.
    ReadLat,
    /// A stream of RDMA reads, `DEPTH` in flight (ib_read_bw).
    ReadBw,
    /// Ping-pong of RDMA writes with immediate, each side polling its CQ
    /// for the receive each consumes (ib_write_lat with immediate).
    WriteImmLat,
    /// Signaled fetch-and-adds of 1 on the peer's first word, one at a
    /// time, polling the CQ; the sample is the whole atomic (a round trip,
    /// as ib_atomic_lat reports it).
    FetchAddLat,
    /// A stream of sends, `DEPTH` in flight, into receives the server keeps
    /// posted (ib_send_bw).
    SendBw,
}

impl Test {
    pub fn as_str(self) -> &'static str {
        match self {
            Test::WriteLat => "write-lat",
            Test::SendLat => "send-lat",
            Test::SendLatEvent => "send-lat-event",
            Test::WriteBw => "write-bw",
            Test::ReadLat => "read-lat",
            Test::ReadBw => "read-bw",
            Test::FetchAddLat => "fetch-add-lat",
            Test::WriteImmLat => "write-imm-lat",
            Test::SendBw => "send-bw",
        }
    }
}

#[derive(Serialize, Deserialize)]
struct Hello {
    endpoint: Endpoint,
    addr: u64,
    rkey: u32,
}

const DEPTH: u32 = 16;

struct Side {
    cq: CompletionQueue,
    channel: Option<CompletionChannel>,
    qp: QueuePair,
    mr: MemoryRegion,
    peer: Hello,
    size: usize,
}

/// `idle_qps`: QPs on the worker's CQ, each connected to itself, that
/// never post (on the direct path each has an inbox the CQ's poll looks
/// at: `vrdma bench --direct`'s many-QP rows).
pub fn run(role: Role, test: Test, size: usize, iters: u64, idle_qps: u32) -> Result<()> {
    let size = size.max(8);
    let ctx = Context::open().context("connecting to the daemon")?;
    let pd = ctx.alloc_pd()?;
    // Two halves: [0, size) receives, [size, 2*size) is the source.
    let access = AccessFlags::LOCAL_WRITE
        | AccessFlags::REMOTE_WRITE
        | AccessFlags::REMOTE_READ
        | AccessFlags::REMOTE_ATOMIC;
    let mr = pd.alloc_mr(2 * size, access)?;
    let channel = (test == Test::SendLatEvent).then(|| ctx.create_comp_channel()).transpose()?;
    let cq = ctx.create_cq(4 * DEPTH, channel.as_ref())?;
    let cap = QpCap {
        max_send_wr: 4 * DEPTH,
        max_recv_wr: 4 * DEPTH,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 64,
    };
    let qp = pd.create_rc_qp(&cq, &cq, cap)?;
    let idle_cap =
        QpCap { max_send_wr: 1, max_recv_wr: 1, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let _idle = (0..idle_qps)
        .map(|_| {
            let q = pd.create_rc_qp(&cq, &cq, idle_cap)?;
            q.connect(&q.endpoint(&ctx)?, AccessFlags::empty())?;
            Ok(q)
        })
        .collect::<Result<Vec<_>>>()
        .with_context(|| format!("creating {idle_qps} idle QPs"))?;
    let hello = Hello { endpoint: qp.endpoint(&ctx)?, addr: mr.addr(), rkey: mr.rkey() };
    println!("{}", serde_json::to_string(&hello)?);
    let mut stdin = std::io::stdin().lock();
    let mut line = String::new();
    stdin.read_line(&mut line)?;
    let peer: Hello = serde_json::from_str(line.trim()).context("reading the peer's endpoint")?;
    qp.connect(&peer.endpoint, access)?;
    // Both QPs connected before either posts (perftest synchronises the
    // same way): a first WR posted while the peer's QP is not yet
    // connected back would take the engine path and, on the direct path,
    // put the grant off ("NotNow"), so the figure would not be the path's.
    println!("connected");
    line.clear();
    stdin.read_line(&mut line)?;
    if line.trim() != "go" {
        bail!("expected \"go\" from the bench, got {:?}", line.trim());
    }
    let mut side = Side { cq, channel, qp, mr, peer, size };
    let mut outcome = match test {
        Test::WriteLat => side.write_lat(role, iters)?,
        Test::SendLat => side.send_lat(role, iters, false, SendOpcode::Send)?,
        Test::SendLatEvent => side.send_lat(role, iters, true, SendOpcode::Send)?,
        Test::WriteImmLat => side.send_lat(role, iters, false, SendOpcode::RdmaWriteWithImm)?,
        Test::WriteBw => side.stream_bw(role, iters, SendOpcode::RdmaWrite)?,
        Test::ReadLat => side.one_at_a_time(role, iters, SendOpcode::RdmaRead)?,
        Test::FetchAddLat => side.one_at_a_time(role, iters, SendOpcode::AtomicFetchAndAdd)?,
        Test::ReadBw => side.stream_bw(role, iters, SendOpcode::RdmaRead)?,
        Test::SendBw if role == Role::Server => side.send_bw_server(iters)?,
        Test::SendBw => side.stream_bw(role, iters, SendOpcode::Send)?,
    };
    if role == Role::Client {
        // A stream reports what its warm-up carried: only the timed WRs count.
        outcome.carried = side.qp.direct_stats().0.saturating_sub(outcome.carried);
        println!("{}", serde_json::to_string(&outcome)?);
    }
    // Both sides stay until the parent closes stdin, so that neither tears
    // its QP down while the other still uses it.
    let mut rest = String::new();
    while stdin.read_line(&mut rest)? > 0 {
        rest.clear();
    }
    Ok(())
}

impl Side {
    fn wr(&self, wr_id: u64, op: SendOpcode, local_off: usize, signaled: bool) -> Result<SendWr> {
        let mut wr = SendWr::new(wr_id, op);
        // Reads land in local memory: never inline.
        if self.size <= 64 && op != SendOpcode::RdmaRead {
            wr.flags |= SendFlags::INLINE;
            wr.inline_len = self.size as u16;
            self.mr.read(local_off, &mut wr.inline[..self.size])?;
        } else {
            wr.sg = SgeList::from_slice(&[self.mr.sge(local_off, self.size)?])?;
        }
        if signaled {
            wr.flags |= SendFlags::SIGNALED;
        }
        wr.remote_addr = self.peer.addr;
        wr.rkey = self.peer.rkey;
        Ok(wr)
    }

    /// Reaps completions; fails on any error status.
    fn reap(&self, wcs: &mut [WorkCompletion]) -> Result<usize> {
        let n = self.cq.poll(wcs)?;
        for wc in &wcs[..n] {
            if wc.status != WcStatus::Success {
                bail!("work request {} failed: {}", wc.wr_id, wc.status.as_str());
            }
        }
        Ok(n)
    }

    fn last_byte(&self) -> Result<u8> {
        let mut b = [0u8; 1];
        self.mr.read(self.size - 1, &mut b)?;
        Ok(b[0])
    }

    fn write_lat(&mut self, role: Role, iters: u64) -> Result<Outcome> {
        let mut wcs = [WorkCompletion::default(); 16];
        let mut samples = Vec::with_capacity(iters as usize);
        let deadline = Instant::now() + Duration::from_secs(120);
        for i in 1..=iters {
            let tag = (i % 251 + 1) as u8;
            let start = Instant::now();
            if role == Role::Client {
                self.send_tag(i, tag)?;
            }
            // Spin on our own memory as ib_write_lat does; the CQ poll in
            // between yields the CPU after vrdma::spin_polls() empty polls,
            // which the engine needs where cores are few.
            let mut polls = 0u32;
            while self.last_byte()? != tag {
                self.reap(&mut wcs)?;
                // The clock only now and then (see `wait_recv`).
                polls = polls.wrapping_add(1);
                if polls.is_multiple_of(256) && Instant::now() > deadline {
                    bail!("no answer from the peer at iteration {i}");
                }
            }
            if role == Role::Server {
                self.send_tag(i, tag)?;
            } else {
                samples.push(start.elapsed().as_nanos() as f64 / 2.0);
            }
        }
        self.drain(&mut wcs)?;
        Ok(Outcome { lat_ns: samples, messages: iters, ..Default::default() })
    }

    fn send_tag(&self, i: u64, tag: u8) -> Result<()> {
        self.mr.write(2 * self.size - 1, &[tag])?;
        let wr = self.wr(i, SendOpcode::RdmaWrite, self.size, i.is_multiple_of(DEPTH as u64))?;
        self.qp.post_send(&[wr]).map_err(|e| anyhow!("post_send: {e}"))
    }

    /// Waits for the last signaled writes so none is in flight at teardown.
    fn drain(&self, wcs: &mut [WorkCompletion]) -> Result<()> {
        let end = Instant::now() + Duration::from_millis(200);
        while Instant::now() < end {
            if self.reap(wcs)? == 0 {
                std::thread::yield_now();
            }
        }
        Ok(())
    }

    fn post_recv(&self, wr_id: u64) -> Result<()> {
        let wr = RecvWr { wr_id, sg: SgeList::from_slice(&[self.mr.sge(0, self.size)?])? };
        self.qp.post_recv(&[wr]).map_err(|e| anyhow!("post_recv: {e}"))
    }

    /// Waits for one receive completion, by polling or on the channel.
    fn wait_recv(&self, wcs: &mut [WorkCompletion], event: bool, deadline: Instant) -> Result<()> {
        let mut empty = 0u32;
        loop {
            let n = self.reap(wcs)?;
            if wcs[..n].iter().any(|w| w.opcode.is_recv()) {
                return Ok(());
            }
            if n > 0 {
                continue;
            }
            // The clock only now and then: reading it at every empty poll
            // would add its cost to every message's latency (perftest does
            // not read it while polling either).
            empty = empty.wrapping_add(1);
            if (event || empty.is_multiple_of(256)) && Instant::now() > deadline {
                bail!("no message from the peer");
            }
            if let Some(ch) = &self.channel {
                if event {
                    self.cq.req_notify(false)?;
                    // The race rule: poll once more after arming.
                    let n = self.reap(wcs)?;
                    if wcs[..n].iter().any(|w| w.opcode.is_recv()) {
                        return Ok(());
                    }
                    ch.get_cq_event(Some(Duration::from_secs(5)))?;
                }
            }
        }
    }

    /// `op`: sends, or RDMA writes with immediate into the peer's receive
    /// half (each consuming a receive too).
    fn send_lat(&mut self, role: Role, iters: u64, event: bool, op: SendOpcode) -> Result<Outcome> {
        let mut wcs = [WorkCompletion::default(); 16];
        for r in 0..DEPTH as u64 {
            self.post_recv(r)?;
        }
        let mut samples = Vec::with_capacity(iters as usize);
        let deadline = Instant::now() + Duration::from_secs(120);
        for i in 1..=iters {
            let start = Instant::now();
            if role == Role::Client {
                self.qp.post_send(&[self.wr(i, op, self.size, true)?]).map_err(|e| anyhow!("{e}"))?;
            }
            self.wait_recv(&mut wcs, event, deadline)?;
            self.post_recv(i)?;
            if role == Role::Server {
                self.qp.post_send(&[self.wr(i, op, self.size, true)?]).map_err(|e| anyhow!("{e}"))?;
            } else {
                samples.push(start.elapsed().as_nanos() as f64 / 2.0);
            }
        }
        self.drain(&mut wcs)?;
        Ok(Outcome { lat_ns: samples, messages: iters, ..Default::default() })
    }

    /// Reads (of the peer's source half) or fetch-and-adds (of 1 on the
    /// peer's first word, the old value into our first 8 bytes), one at a
    /// time; each sample is a whole operation.
    fn one_at_a_time(&mut self, role: Role, iters: u64, op: SendOpcode) -> Result<Outcome> {
        if role == Role::Server {
            return Ok(Outcome::default());
        }
        let mut wcs = [WorkCompletion::default(); 16];
        let mut samples = Vec::with_capacity(iters as usize);
        let deadline = Instant::now() + Duration::from_secs(120);
        for i in 1..=iters {
            let wr = if op == SendOpcode::AtomicFetchAndAdd {
                let mut wr = SendWr::new(i, op);
                wr.sg = SgeList::from_slice(&[self.mr.sge(0, 8)?])?;
                wr.flags |= SendFlags::SIGNALED;
                (wr.remote_addr, wr.rkey, wr.compare_add) = (self.peer.addr, self.peer.rkey, 1);
                wr
            } else {
                let mut wr = self.wr(i, op, 0, true)?;
                wr.remote_addr = self.peer.addr + self.size as u64;
                wr
            };
            let start = Instant::now();
            self.qp.post_send(&[wr]).map_err(|e| anyhow!("post_send: {e}"))?;
            while self.reap(&mut wcs)? == 0 {
                if Instant::now() > deadline {
                    bail!("{op:?} {i} never completed");
                }
            }
            samples.push(start.elapsed().as_nanos() as f64);
        }
        Ok(Outcome { lat_ns: samples, messages: iters, ..Default::default() })
    }

    /// The receiving side of the send stream: keeps receives posted until
    /// the client's `iters` plus its untimed warm-up have arrived.
    fn send_bw_server(&mut self, iters: u64) -> Result<Outcome> {
        let total = iters + iters / 10;
        let mut wcs = [WorkCompletion::default(); 16];
        let ahead = (4 * DEPTH as u64).min(total);
        for r in 0..ahead {
            self.post_recv(r)?;
        }
        let (mut posted, mut got) = (ahead, 0u64);
        let deadline = Instant::now() + Duration::from_secs(120);
        while got < total {
            let n = self.reap(&mut wcs)?;
            for _ in wcs[..n].iter().filter(|w| w.opcode.is_recv()) {
                got += 1;
                if posted < total {
                    self.post_recv(posted)?;
                    posted += 1;
                }
            }
            if n == 0 && Instant::now() > deadline {
                bail!("only {got} of {total} messages arrived");
            }
        }
        Ok(Outcome::default())
    }

    /// A stream of `op` (write, read or send) of `size` bytes, `DEPTH` in
    /// flight, timed at the client.
    fn stream_bw(&mut self, role: Role, iters: u64, op: SendOpcode) -> Result<Outcome> {
        if role == Role::Server {
            return Ok(Outcome::default());
        }
        let mut wcs = [WorkCompletion::default(); 16];
        let (mut posted, mut done) = (0u64, 0u64);
        // The first tenth warms caches and faults in pages; it is not timed.
        let warmup = iters / 10;
        let mut start = Instant::now();
        let deadline = start + Duration::from_secs(120);
        let iters = iters + warmup;
        let mut timed_from = None;
        let mut warm_carried = 0;
        while done < iters {
            if timed_from.is_none() && done >= warmup {
                timed_from = Some(done);
                warm_carried = self.qp.direct_stats().0;
                start = Instant::now();
            }
            while posted < iters && posted - done < DEPTH as u64 {
                let wr = if op == SendOpcode::RdmaRead {
                    let mut wr = self.wr(posted, op, 0, true)?;
                    wr.remote_addr = self.peer.addr + self.size as u64;
                    wr
                } else {
                    self.wr(posted, op, self.size, true)?
                };
                self.qp.post_send(&[wr]).map_err(|e| anyhow!("post_send: {e}"))?;
                posted += 1;
            }
            let n = self.reap(&mut wcs)?;
            done += n as u64;
            if n == 0 && Instant::now() > deadline {
                bail!("work requests stopped completing after {done} of {iters}");
            }
        }
        let seconds = start.elapsed().as_secs_f64();
        let timed = iters - timed_from.unwrap_or(0);
        Ok(Outcome {
            bytes: timed * self.size as u64,
            seconds,
            messages: timed,
            carried: warm_carried,
            ..Default::default()
        })
    }
}
