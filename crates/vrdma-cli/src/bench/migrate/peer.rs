//! B's end of the guest's stream: `seqstream` started in the guest (sends
//! with immediate and RDMA writes with immediate, each carrying its
//! sequence number, one every `pace` µs, 16 in flight, checking its own
//! completions come once, in order), and a QP on B connected to it whose
//! receiver checks every message's bytes as it comes and notes when it
//! came. Every wait is bounded.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _, Result};
use vrdma::{WcOpcode, WcStatus};
use vrdma_guest::Guest;

/// A guest command's limit.
pub const T: Duration = Duration::from_secs(120);
/// Every message's length.
const LEN: usize = 64;
/// B's receives, 256 bytes each at `RECV_AT`; the writes land below it.
const RECVS: u64 = 256;
const RECV_AT: usize = 4 << 20;
/// The most messages a stream may carry (its writes fit below `RECV_AT`).
pub const MAX_COUNT: u64 = (RECV_AT / LEN) as u64;

/// Starts `cmd` in the background in `g` under `timeout SECS`, its output
/// and status in `/tmp/TAG.out` and `/tmp/TAG.st`.
fn guest_bg(g: &mut Guest, tag: &str, secs: u32, cmd: &str) -> Result<()> {
    g.check(
        &format!(
            "rm -f /tmp/{tag}.*; ( timeout {secs} {cmd} >/tmp/{tag}.out 2>&1; echo $? >/tmp/{tag}.st ) \
             </dev/null >/dev/null 2>&1 &"
        ),
        T,
    )?;
    Ok(())
}

/// Waits (at most 90 s) for a line starting `prefix` in `tag`'s output.
fn guest_line(g: &mut Guest, tag: &str, prefix: &str) -> Result<String> {
    let script = format!(
        "i=0; while [ $i -lt 900 ]; do l=$(grep '^{prefix}' /tmp/{tag}.out) && {{ echo \"$l\"; exit 0; }}; \
         [ -e /tmp/{tag}.st ] && {{ echo ended; cat /tmp/{tag}.out; exit 1; }}; sleep 0.1; i=$((i+1)); done; \
         echo 'no {prefix}'; cat /tmp/{tag}.out; exit 1"
    );
    g.check(&script, T).with_context(|| format!("{tag} in the guest"))
}

/// What the guest's stream printed last, and whether it ended.
pub fn stream_tail(g: &mut Guest) -> String {
    g.run("tail -5 /tmp/seq.out; cat /tmp/seq.st 2>/dev/null || echo '(still running)'", T)
        .map_or_else(|e| format!("(the guest did not answer: {e})"), |(_, out)| out)
}

/// Fails unless the guest's stream still runs.
pub fn stream_running(g: &mut Guest) -> Result<()> {
    let (st, out) = g.run("cat /tmp/seq.out; [ ! -e /tmp/seq.st ]", T)?;
    ensure!(st == 0, "the guest's stream ended:\n{out}");
    Ok(())
}

pub struct Peer {
    _ctx: vrdma::Context,
    mr: vrdma::MemoryRegion,
    cq: vrdma::CompletionQueue,
    qp: vrdma::QueuePair,
    count: u64,
}

impl Peer {
    /// Starts `seqstream COUNT LEN PACE_US` in `guest` and connects a QP
    /// of the daemon at `b` to it.
    pub fn connect(b: &std::path::Path, guest: &mut Guest, count: u64, pace_us: u32) -> Result<Peer> {
        ensure!(count <= MAX_COUNT, "{count} messages: at most {MAX_COUNT}");
        let peerfile = "/tmp/peer-seq";
        guest_bg(guest, "seq", 3600, &format!("seqstream {count} {LEN} {pace_us} {peerfile}"))?;
        let local = guest_line(guest, "seq", "LOCAL ")?;
        let f: Vec<&str> = local.split_whitespace().collect();
        ensure!(f.len() == 5 && f[4].len() == 32, "the guest's stream said {local:?}");
        let mut gid = [0u8; 16];
        for (i, g) in gid.iter_mut().enumerate() {
            *g = u8::from_str_radix(&f[4][2 * i..2 * i + 2], 16).with_context(|| local.clone())?;
        }
        let eg = vrdma::Endpoint {
            lid: 0,
            gid: vrdma::Gid(gid),
            qpn: f[2].parse().with_context(|| local.clone())?,
            psn: f[3].parse().with_context(|| local.clone())?,
        };
        let ctx = vrdma::Context::open_at(b).context("opening B's device")?;
        let all = vrdma::AccessFlags::LOCAL_WRITE
            | vrdma::AccessFlags::REMOTE_WRITE
            | vrdma::AccessFlags::REMOTE_READ
            | vrdma::AccessFlags::REMOTE_ATOMIC;
        let pd = ctx.alloc_pd()?;
        let mr = pd.alloc_mr(RECV_AT + RECVS as usize * 256, all)?;
        let cq = ctx.create_cq(1024, None)?;
        let cap = vrdma::QpCap {
            max_send_wr: 256,
            max_recv_wr: 256,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 64,
        };
        let qp = pd.create_rc_qp(&cq, &cq, cap)?;
        qp.connect(&eg, all)?;
        let p = Peer { _ctx: ctx.clone(), mr, cq, qp, count };
        for k in 0..RECVS {
            p.recv(k)?;
        }
        let eb = p.qp.endpoint(&ctx)?;
        let gb: String = eb.gid.0.iter().map(|x| format!("{x:02x}")).collect();
        guest.check(
            &format!(
                "echo '0 {} {} {gb} {} {}' >{peerfile}.new && mv {peerfile}.new {peerfile}",
                eb.qpn,
                eb.psn,
                p.mr.addr(),
                p.mr.rkey()
            ),
            T,
        )?;
        Ok(p)
    }

    fn recv(&self, k: u64) -> Result<()> {
        let sge = self.mr.sge(RECV_AT + (k % RECVS) as usize * 256, 256)?;
        self.qp.post_recv(&[vrdma::wr::recv(k, &[sge])?])?;
        Ok(())
    }

    fn seq_of(&self, imm: u32) -> u64 {
        // The drop-in takes the immediate in network order; accept either.
        if u64::from(imm) < self.count {
            u64::from(imm)
        } else {
            u64::from(imm.swap_bytes())
        }
    }

    /// Takes messages until `count` came, `stop` is set, or `limit` passed;
    /// checks each one's bytes and that each comes once, in order, counts
    /// them in `received`. Their arrival times, and the first fault if one
    /// came (the times up to it kept).
    pub fn receive(
        &self,
        received: &AtomicU64,
        stop: &AtomicBool,
        limit: Duration,
    ) -> (Vec<Instant>, Result<()>) {
        let mut arrived = Vec::new();
        let r = self.take(&mut arrived, received, stop, limit);
        (arrived, r)
    }

    fn take(
        &self,
        arrived: &mut Vec<Instant>,
        received: &AtomicU64,
        stop: &AtomicBool,
        limit: Duration,
    ) -> Result<()> {
        let mut buf = vrdma::wc_buffer(64);
        let end = Instant::now() + limit;
        let mut next = 0u64;
        while next < self.count && !stop.load(Ordering::Acquire) && Instant::now() < end {
            let n = self.cq.poll(&mut buf)?;
            if n == 0 {
                std::thread::sleep(Duration::from_micros(200));
            }
            for wc in &buf[..n] {
                ensure!(wc.status == WcStatus::Success, "at B after {next} messages: {wc:?}");
                let seq = self.seq_of(wc.imm_data);
                ensure!(
                    seq == next,
                    "at B: message {seq} where {next} was due (lost, twice or out of order)"
                );
                let mut expect = vec![seq as u8; LEN];
                expect[..8].copy_from_slice(&seq.to_le_bytes());
                let mut got = vec![0u8; LEN];
                match wc.opcode {
                    WcOpcode::Recv => self.mr.read(RECV_AT + (wc.wr_id % RECVS) as usize * 256, &mut got)?,
                    WcOpcode::RecvRdmaWithImm => self.mr.read(seq as usize * LEN, &mut got)?,
                    o => bail!("at B: {o:?}"),
                }
                ensure!(got == expect, "message {seq}'s bytes at B ({:?})", wc.opcode);
                arrived.push(Instant::now());
                next += 1;
                received.fetch_add(1, Ordering::AcqRel);
                // A write with immediate takes a receive too.
                self.recv(wc.wr_id + RECVS)?;
            }
        }
        Ok(())
    }
}
