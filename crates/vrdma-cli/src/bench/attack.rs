//! The default report's figures of isolation: a victim's 8-byte send
//! latency beside another tenant that misbehaves (issue 21, items 1 and 5).
//!
//! The engine serves every tenant from one thread, so a tenant that makes
//! a pass long (thousands of QPs that say they have work, a doorbell rung
//! without end, a ring it has scribbled on, a stream of large writes)
//! makes every other tenant wait. Before each tenant got its share of a
//! pass, such a neighbour raised the victim's one-way latency from ~5 µs
//! to 2–9 ms on a 2-core machine; a test can only bound that loosely, so
//! the figures live here, each beside the unloaded latency of the same
//! run and their ratio.
//!
//! The group runs on a daemon of its own with the direct path off: the
//! victim's two QPs are one tenant's on one host, which the default path
//! carries without the engine, and the engine is what is attacked.
//!
//! The attacker must be another tenant, and a tenant is a uid: so it runs
//! as uid 65534 (nobody), a child of this very binary (`vrdma misbehave`,
//! hidden), which needs root. Without root the group is reported skipped,
//! never measured as our own uid (that would be one tenant hurting
//! itself, which the engine does not promise to prevent). The attacker
//! holds its QPs, prints `ready N` (N: the QPs it holds, its share of the
//! daemon's mappings may be fewer than asked), then misbehaves until its
//! stdin closes or `--millis` pass; the parent kills it by pid if it
//! lingers.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use vrdma::wr::{self, SendWrExt};
use vrdma::{AccessFlags, Context, QpCap, WcStatus, WorkCompletion};

use super::idle::IdleQps;

/// The uid (and gid) the attacker runs as.
pub const NOBODY: u32 = 65534;

/// What the other tenant does.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum How {
    /// Holds idle QPs and wakes every 50 µs without writing anything: the
    /// control, what another busy process costs the victim on its own.
    Quiet,
    /// Holds idle QPs and keeps its posted-QP ring's overflow flag set
    /// (one store every 50 µs): every QP of its context may have work.
    Overflow,
    /// Names its idle QPs in its posted-QP ring without posting to them.
    NameIdle,
    /// Holds idle QPs and rings the engine's doorbell (64 rings every 500 µs).
    Doorbells,
    /// Holds idle QPs and writes garbage into its posted-QP ring's producer
    /// index once; the daemon closes its context.
    Scribble,
    /// Streams RDMA writes (`--size`, 16 in flight per QP) over `--qps`
    /// QPs, each connected to itself: a hog, not an attack.
    Stream,
}

impl How {
    fn as_str(self) -> &'static str {
        match self {
            How::Quiet => "quiet",
            How::Overflow => "overflow",
            How::NameIdle => "name-idle",
            How::Doorbells => "doorbells",
            How::Scribble => "scribble",
            How::Stream => "stream",
        }
    }
}

/// `vrdma misbehave`: a tenant that breaks the rules on purpose.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[arg(long, value_enum)]
    pub how: How,
    /// QPs to hold (idle ones; fewer if the tenant's share allows fewer),
    /// or to stream over.
    #[arg(long, default_value_t = 1000)]
    pub qps: u32,
    /// Stop after this long even if stdin stays open.
    #[arg(long, default_value_t = 600_000)]
    pub millis: u64,
    /// The stream's message size in bytes.
    #[arg(long, default_value_t = 64 << 10)]
    pub size: usize,
    /// Stream to QPs on the daemon at this socket (another host's) rather
    /// than each QP to itself.
    #[arg(long)]
    pub to: Option<PathBuf>,
}

/// RDMA writes in flight on each of the stream's QPs (rc_bw's depth).
const STREAM_DEPTH: u32 = 16;

/// The attacker's side: runs until stdin closes or `--millis` pass.
pub fn misbehave(socket: Option<PathBuf>, args: Args) -> Result<()> {
    let sock = socket.unwrap_or_else(vrdma::default_socket_path);
    let stop = Arc::new(AtomicBool::new(false));
    // Lines read on stdin: a streaming tenant answers each with its count.
    let asked = Arc::new(AtomicU64::new(0));
    let (s, a) = (stop.clone(), asked.clone());
    std::thread::spawn(move || {
        let mut sink = String::new();
        let mut stdin = std::io::stdin().lock();
        while matches!(stdin.read_line(&mut sink), Ok(n) if n > 0) {
            sink.clear();
            a.fetch_add(1, Ordering::SeqCst);
        }
        s.store(true, Ordering::SeqCst);
    });
    let end = Instant::now() + Duration::from_millis(args.millis);
    let going = || !stop.load(Ordering::SeqCst) && Instant::now() < end;
    if args.how == How::Stream {
        return stream(&sock, args.to.as_deref(), args.qps, args.size, going, &asked);
    }
    let idle = IdleQps::create_up_to(&sock, args.qps as usize)?;
    let qpns = idle.qpns();
    ready(qpns.len())?;
    let bad = idle.context().misbehave();
    if args.how == How::Scribble {
        bad.scribble_posted_ring();
        // Say when the daemon has closed the context (a request fails).
        while going() {
            if idle.context().query_device().is_err() {
                say("closed")?;
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    while going() {
        match args.how {
            How::Overflow => bad.set_posted_overflow(),
            How::NameIdle => {
                for &q in &qpns {
                    if !bad.name_qp(q) {
                        break;
                    }
                }
            }
            How::Doorbells => (0..64).for_each(|_| bad.ring_doorbell()),
            How::Quiet | How::Scribble | How::Stream => {}
        }
        let pause = match args.how {
            How::Doorbells => 500,
            How::Scribble => 5_000,
            _ => 50,
        };
        std::thread::sleep(Duration::from_micros(pause));
    }
    Ok(())
}

fn say(line: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")?;
    out.flush()?;
    Ok(())
}

fn ready(qps: usize) -> Result<()> {
    say(&format!("ready {qps}"))
}

/// The QPs of the daemon at `to` that a stream across hosts writes to:
/// one per streaming QP, with the region every write lands in.
struct Far {
    ctx: Context,
    qps: Vec<vrdma::QueuePair>,
    _cq: vrdma::CompletionQueue,
    mr: vrdma::MemoryRegion,
}

impl Far {
    fn open(to: &Path, qps: u32, size: usize, access: AccessFlags, cap: QpCap) -> Result<Far> {
        let ctx = Context::open_at(to).context("opening the streaming tenant's context on the other host")?;
        let pd = ctx.alloc_pd()?;
        let mr = pd.alloc_mr(size, access)?;
        let cq = ctx.create_cq(qps, None)?;
        let qps = (0..qps).map(|_| pd.create_rc_qp(&cq, &cq, cap)).collect::<vrdma::Result<Vec<_>>>()?;
        Ok(Far { ctx, qps, _cq: cq, mr })
    }
}

/// RDMA writes of `size` bytes over `qps` QPs, each connected to itself
/// (or, with `to`, to a QP of its own on the daemon at `to`, another
/// host's), `STREAM_DEPTH` in flight on each, until `going` says stop.
/// Whenever `asked` grows (a line on stdin), says `bytes N`: the bytes its
/// writes completed since `ready`.
fn stream(
    sock: &Path,
    to: Option<&Path>,
    qps: u32,
    size: usize,
    going: impl Fn() -> bool,
    asked: &AtomicU64,
) -> Result<()> {
    let ctx = Context::open_at(sock).context("opening the streaming tenant's context")?;
    let pd = ctx.alloc_pd()?;
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    // [0, size): the source; [size, 2 size): where every write lands.
    let mr = pd.alloc_mr(2 * size, access)?;
    let cq = ctx.create_cq(qps * STREAM_DEPTH, None)?;
    let cap = QpCap {
        max_send_wr: STREAM_DEPTH,
        max_recv_wr: 1,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let far = match to {
        Some(to) => Some(Far::open(to, qps, size, access, cap)?),
        None => None,
    };
    let qps = (0..qps as usize)
        .map(|i| {
            let qp = pd.create_rc_qp(&cq, &cq, cap)?;
            match &far {
                Some(f) => {
                    let (fctx, fqp) = (&f.ctx, &f.qps[i]);
                    qp.connect(&fqp.endpoint(fctx)?, access)?;
                    fqp.connect(&qp.endpoint(&ctx)?, access)?;
                }
                None => qp.connect(&qp.endpoint(&ctx)?, access)?,
            }
            Ok(qp)
        })
        .collect::<Result<Vec<_>>>()
        .context("creating the stream's QPs")?;
    let src = mr.sge(0, size)?;
    let (dst, rkey) = match &far {
        Some(f) => (f.mr.addr(), f.mr.rkey()),
        None => (mr.addr() + size as u64, mr.rkey()),
    };
    let post = |q: usize| -> Result<()> {
        let w = wr::rdma_write(q as u64, &[src], dst, rkey)?.signaled();
        qps[q].post_send(&[w]).map_err(|e| anyhow!("post_send: {}", e.error))
    };
    for q in 0..qps.len() {
        for _ in 0..STREAM_DEPTH {
            post(q)?;
        }
    }
    ready(qps.len())?;
    let mut wcs = [WorkCompletion::default(); 64];
    let (mut bytes, mut answered) = (0u64, 0u64);
    while going() {
        let n = cq.poll(&mut wcs)?;
        for wc in &wcs[..n] {
            if wc.status != WcStatus::Success {
                bail!("a streamed write failed: {}", wc.status.as_str());
            }
            bytes += size as u64;
            post(wc.wr_id as usize)?;
        }
        let a = asked.load(Ordering::Relaxed);
        if a != answered {
            answered = a;
            say(&format!("bytes {bytes}"))?;
        }
    }
    Ok(())
}

/// The other tenant, as the parent sees it: a child process of ours
/// running as [`NOBODY`], stopped (stdin closed, then killed by pid) when
/// dropped.
pub struct Attacker {
    proc: super::suite::WorkerProc,
    /// The QPs it holds or streams over.
    pub qps: usize,
}

impl Attacker {
    /// Starts `vrdma misbehave` as uid [`NOBODY`] on the daemon at `sock`
    /// and waits until it holds its QPs and misbehaves.
    pub fn start(sock: &Path, how: How, qps: u32) -> Result<Attacker> {
        Self::start_as(sock, how, qps, 64 << 10, NOBODY)
    }

    /// [`Attacker::start`] as uid `uid` (a tenant of its own), streaming
    /// messages of `size` bytes if it streams.
    pub fn start_as(sock: &Path, how: How, qps: u32, size: usize, uid: u32) -> Result<Attacker> {
        Self::start_to(sock, None, how, qps, size, uid)
    }

    /// [`Attacker::start_as`]; with `to`, a stream's QPs write to QPs of
    /// the daemon at `to` (another host's).
    pub fn start_to(
        sock: &Path,
        to: Option<&Path>,
        how: How,
        qps: u32,
        size: usize,
        uid: u32,
    ) -> Result<Attacker> {
        use std::os::unix::process::CommandExt;
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg("--socket")
            .arg(sock)
            .args(["misbehave", "--how", how.as_str(), "--qps", &qps.to_string()])
            .args(["--size", &size.to_string()]);
        if let Some(to) = to {
            cmd.arg("--to").arg(to);
        }
        cmd
            // Not a warning per object whose destruction a closed context refuses.
            .env("VRDMA_LOG", "error")
            .uid(uid)
            .gid(uid)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        let proc = super::suite::WorkerProc::start(cmd).context("starting the other tenant")?;
        let line = proc.line(Duration::from_secs(60)).context("waiting for the other tenant's QPs")?;
        let qps = line
            .strip_prefix("ready ")
            .and_then(|n| n.trim().parse().ok())
            .ok_or_else(|| anyhow!("the other tenant said {line:?}"))?;
        Ok(Attacker { proc, qps })
    }

    /// Asks a streaming tenant for its bytes completed so far (on its
    /// stdin); [`Attacker::bytes`] reads the answer.
    pub fn ask(&mut self) -> Result<()> {
        self.proc.tell("")
    }

    /// The answer to [`Attacker::ask`].
    pub fn bytes(&mut self) -> Result<u64> {
        let line = self.proc.line(Duration::from_secs(10)).context("asking a streaming tenant its bytes")?;
        line.strip_prefix("bytes ")
            .and_then(|n| n.trim().parse().ok())
            .ok_or_else(|| anyhow!("the streaming tenant said {line:?}"))
    }

    /// Whether it said its context was closed, within `limit`.
    pub fn closed_within(&self, limit: Duration) -> bool {
        matches!(self.proc.line(limit), Ok(l) if l == "closed")
    }

    /// Closes its stdin and waits a little for it to exit; the drop kills
    /// it by pid otherwise.
    pub fn stop(self) {
        let _ = self.proc.finish(Duration::from_secs(2));
    }
}

/// Whether we may start a process as another uid.
pub fn may_switch_uid() -> bool {
    rustix::process::geteuid().is_root()
}

/// One attack of the group: what the attacker does, how many QPs it
/// holds, and the figure's name and target.
pub struct Case {
    pub how: How,
    pub qps: u32,
    pub target: &'static str,
}

impl Case {
    pub fn name(&self, held: usize) -> String {
        let beside = match self.how {
            How::Quiet => format!("{held} idle QPs, waking every 50 µs, writing nothing (control)"),
            How::Overflow => format!("{held} idle QPs, overflow flag kept set"),
            How::NameIdle => format!("naming its {held} idle QPs"),
            How::Doorbells => format!("{held} idle QPs, doorbell flooded"),
            How::Scribble => format!("{held} idle QPs, scribbled posted ring"),
            How::Stream => {
                format!("streaming 64 KiB RDMA writes over {held} QP{}", if held == 1 { "" } else { "s" })
            }
        };
        format!("send 8 B, one way (poll CQ), beside a tenant: {beside}")
    }
}

/// The attacks of issue 21 item 1 with `idle` idle QPs, then the hog of
/// item 5 over 64 QPs and over 1.
pub fn cases(idle: u32) -> Vec<Case> {
    let attack = "<= 2x unloaded";
    let hog = "<= 2x";
    vec![
        Case { how: How::Quiet, qps: idle, target: "none (control)" },
        Case { how: How::Overflow, qps: idle, target: attack },
        Case { how: How::NameIdle, qps: idle, target: attack },
        Case { how: How::Doorbells, qps: idle, target: attack },
        Case { how: How::Scribble, qps: idle, target: attack },
        Case { how: How::Stream, qps: 64, target: hog },
        Case { how: How::Stream, qps: 1, target: hog },
    ]
}
