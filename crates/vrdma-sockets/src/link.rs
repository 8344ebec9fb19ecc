//! One carried connection's data path: an RC QP pair, a receive ring in
//! each end's registered memory, credits back, wake bytes on the TCP
//! socket (`docs/sockets.md`).
//!
//! Layout of each end's ring region: [`RING`] bytes of data that the peer
//! writes, then control words the peer writes: the peer's tail
//! (`WRITTEN`, for this end's reader), the peer reader's consumed count of
//! this end's bytes (`CONSUMED`, this end's writer's credits), the peer
//! reader's sleeping flag (`SLEEPING`, for this end's writer), the
//! peer's orderly close (`CLOSED`: its last descriptor is closed, every
//! byte it wrote has landed, and its QP is about to go) and the peer
//! writer's request for a credit wake-up (`WANT`, [`crate::credit`]:
//! this end's reader answers it with a send), the count of bytes the peer
//! wrote over the ring before it fell back to plain TCP (`DEMOTE`,
//! [`demote`]: a connection shared after fork), then the table of the
//! peer's mappings for direct placement (`IOMAP`, [`iomap`]). The staging
//! region mirrors it: bytes to send at their ring offsets, then the words
//! sent from.

use crate::connlock::ConnLock;
use std::collections::VecDeque;
use std::sync::atomic::{fence, AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libc::c_int;
use vrdma::wr::{self, SendWrExt as _};
use vrdma::{AccessFlags, CompletionQueue, Endpoint, MemoryRegion, QpCap, QueuePair, WcStatus};

use crate::blocking::Blocking;
use crate::dev::Dev;
use crate::owner::Page;
use crate::real;
use crate::stream::Sock;

mod demote;
mod iomap;
mod outq;

pub(crate) use demote::wait_ms as demote_wait;

/// Bytes of each direction's ring.
pub const RING: usize = 256 * 1024;
const WRITTEN: usize = RING;
const CONSUMED: usize = RING + 8;
const SLEEPING: usize = RING + 16;
const CLOSED: usize = RING + 24;
const WANT: usize = RING + 32;
/// The peer's demotion word: the exact count it wrote into this end's
/// ring before it fell back to the kernel socket, plus one (0: none;
/// `docs/sockets.md` "Sharing a carried connection after fork").
const DEMOTE: usize = RING + 40;
/// An exec demotion's read count: the demoting end read its ring up to it
/// and this end sends its bytes after it again, on the kernel socket
/// (`docs/sockets.md`, "Exec"; the `DEMOTE` word has [`EXEC_BIT`]).
const DEMOTE_RD: usize = RING + 48;
/// In the `DEMOTE` word: an exec demotion ([`DEMOTE_RD`] is written).
/// Only to a peer whose hello has [`CAP_EXEC`].
const EXEC_BIT: u64 = 1 << 63;
/// The peer's mappings ([`iomap`]).
const IOMAP: usize = RING + 64;
const REGION: usize = IOMAP + iomap::SLOTS * iomap::ENTRY;
/// A write's pieces of the caller's vector that the direct path takes at
/// once; a write gathered from more goes through the staging region.
const DIRECT_PIECES: usize = 8;
/// In the staging region: the tail a credit wait's probe sends, then
/// consumed and sleeping (16 bytes sent as one write into the peer's
/// `CONSUMED` and `SLEEPING`), then one tail word per write in flight
/// ([`TAIL_SLOTS`]: a write's tail must stay as it was posted until the
/// daemon read it, which is when its completion comes).
const S_PROBE: usize = RING;
const S_ACK: usize = RING + 16;
/// The word a close sends into the peer's `CLOSED`.
const S_CLOSE: usize = RING + 32;
/// The word a writer that waits for credits sends into the peer's `WANT`.
const S_WANT: usize = RING + 40;
/// The word a demotion sends into the peer's `DEMOTE`.
const S_DEMOTE: usize = RING + 48;
/// The word an exec demotion sends into the peer's `DEMOTE_RD`.
const S_DEMOTE_RD: usize = RING + 56;
const S_TAILS: usize = RING + 64;
const TAIL_SLOTS: usize = 16;
/// An arming's consumed count and word (16 bytes into the peer's
/// `CONSUMED` and `SLEEPING`), posted without waiting: a slot of its own,
/// untouched until its write completed.
const S_ARM: usize = S_TAILS + 8 * TAIL_SLOTS;
/// A mapping's entry, sent into the peer's table (waited for).
const S_IOMAP: usize = S_ARM + 16;
const STAGE: usize = S_IOMAP + iomap::ENTRY;
/// Writes posted and not completed, at most, per connection (two work
/// requests each, beside one word write of the reader's, a probe, a
/// `WANT`, the sends that answer the peer's and up to 12 of direct
/// placement's ([`iomap`]), in a send queue of [`SEND_WRS`]). Fewer than
/// [`TAIL_SLOTS`].
const IN_FLIGHT: usize = 12;
const SEND_WRS: u32 = 48;
/// Receives posted for the peer's answers to `WANT` (one owed at most).
const RECVS: usize = 2;

/// How long a blocked reader watches its ring, and a writer yields for
/// its completion, before sleeping.
const SPIN: Duration = Duration::from_micros(50);

/// How long a blocked reader watches its ring before it arms and sleeps:
/// [`SPIN`], or `VRDMA_SOCKETS_SPIN_US` (a slow build's tests, whose
/// answers take longer).
pub(crate) fn watch_for() -> Duration {
    static D: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *D.get_or_init(|| {
        std::env::var("VRDMA_SOCKETS_SPIN_US")
            .ok()
            .and_then(|s| s.parse().ok())
            .map_or(SPIN, Duration::from_micros)
    })
}

/// Whether epoll waits watch and arm the rings of connections that
/// non-blocking reads leave unarmed (off unless `VRDMA_SOCKETS_LAZY_EPOLL=1`:
/// `docs/sockets.md`, "Lazy arming under epoll", which lists the lost
/// wake-ups a review found that keep it off by default). Off, every
/// non-blocking read that empties its ring arms at once.
pub(crate) fn lazy_epoll() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("VRDMA_SOCKETS_LAZY_EPOLL").is_ok_and(|v| v == "1"))
}

/// How often a writer waiting for credits probes its peer (a peer that is
/// gone fails the probe).
const PROBE: Duration = Duration::from_millis(100);

/// The longest a blocked writer waits for an answer before it looks at
/// its credits itself: an answer is due when the reader's credit was
/// reaped, which for an arming is the reader's next call (or its
/// progress thread's look), so a reader that stops calling leaves it
/// to this.
const WAIT_MAX: Duration = Duration::from_millis(10);

/// The hello each end sends once both decided to carry.
pub const HELLO_LEN: usize = 64;
const MAGIC: &[u8; 4] = b"VRSK";
/// 2: the ring region holds the peer's mapping table ([`iomap`]). A peer
/// of another version is refused (`EPROTO`: the connection is reset).
const VERSION: u32 = 2;

/// In place of a hello: "this end stays plain TCP" (its program is about
/// to `exec` a program that inherits the connection, which must find a
/// clean stream). The magic with version 0; a library of version 1 that
/// predates it reads it as a protocol error (a reset), never as data.
pub fn decline() -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    b[0..4].copy_from_slice(MAGIC);
    b
}

/// Whether `b` is [`decline`].
pub fn is_decline(b: &[u8; HELLO_LEN]) -> bool {
    *b == decline()
}

/// Whether `b` (the first bytes a peer sent) may be the start of a hello
/// or a decline: the magic, as far as it goes.
pub fn may_be_hello(b: &[u8]) -> bool {
    let n = b.len().min(MAGIC.len());
    b[..n] == MAGIC[..n]
}

/// The byte each end sends once its QP is connected.
const READY: u8 = 0;

/// What [`Link::credits`] answers when a demotion ended its wait.
const DEMOTING: usize = usize::MAX;

/// The hello's byte that says this end answers a demotion (its reads stop
/// at a marker byte 0, its writes at the peer's `DEMOTE` word): zero in
/// an older library's hello, which ignores it in the peer's.
const CAPS: usize = 50;
const CAP_DEMOTE: u8 = 1;
/// This end answers an exec demotion (it reads the demoting end's ring
/// past its read count back, by an RDMA read, and sends those bytes again
/// after its marker), and its ring may be read so. Zero in the hello of
/// a library before 2026-11-28, which never gets one.
const CAP_EXEC: u8 = 2;

/// A demotion's marker and record on the kernel socket: the byte 0, the
/// record's version (1), six bytes of padding and the exact count of
/// bytes the sender wrote over the ring (little-endian).
pub(crate) const MARK_LEN: usize = 16;

pub struct Link {
    /// The connection's shared page: the words of a demotion
    /// ([`crate::forkshare`]).
    page: Arc<Page>,
    /// The peer's hello said it answers a demotion.
    peer_demotes: bool,
    /// And an exec demotion ([`CAP_EXEC`]).
    peer_exec: bool,
    /// The process that made it (whose context its QP and regions are).
    pid: u32,
    /// As the peer of a demotion: this end's writes went to the kernel
    /// socket (its marker sent), and its reads too (the peer's marker
    /// taken).
    p_wr: AtomicBool,
    p_rd: AtomicBool,
    /// As the peer: this end's switch of its writes began sending (its
    /// marker, an exec's resend): a failure after that is final
    /// (`demote`, `Link::p_switch_writes`).
    p_wr_began: AtomicBool,
    /// As the peer of an exec demotion: the resend's bytes the kernel did
    /// not take at once ([`outq`]), their count (0: none) and the process
    /// whose queue it is.
    out: ConnLock<outq::OutQ>,
    out_len: AtomicUsize,
    out_pid: AtomicU32,
    /// A push of the queue failed with this errno (0: none): the
    /// program's next call on the connection returns it, and only then is
    /// the connection plain TCP ([`outq`]; the failing send consumed the
    /// socket's own error, so the kernel would not say it).
    out_err: AtomicI32,
    /// The queue was cut short and the connection reset: it never
    /// becomes plain TCP for this end's holders.
    out_reset: AtomicBool,
    /// That reset could not disconnect the socket (its fallback, a linger
    /// of 0, resets it only at the last close): the connection is still
    /// up behind the bytes dropped, so every later call of the program on
    /// it fails with `ECONNRESET` (`Link::take_out_err`), as one reset.
    out_stuck: AtomicBool,
    /// A `shutdown(SHUT_WR)` waits for the queue (a flag, not under the
    /// queue's lock, which a blocking writer may hold), and whether the
    /// kernel socket's `SHUT_WR` was done since.
    out_shut: AtomicBool,
    out_shut_done: AtomicBool,
    /// The socket's own `SO_LINGER`, kept while the queue holds bytes and
    /// the socket lingers 0 ([`outq`]: a process end that runs no handler
    /// resets the connection rather than end it with a FIN behind a
    /// truncated resend); `None`: not armed.
    out_linger: Mutex<Option<libc::linger>>,
    /// The library's own descriptor of the kernel socket (and whether a
    /// readiness call knows it).
    owner_sock: Arc<Sock>,
    sock: c_int,
    cq: CompletionQueue,
    /// Where the peer's answers to `WANT` complete, on the process's
    /// channel; `None`: no channel, a writer waits by looking.
    rcq: Option<CompletionQueue>,
    qp: QueuePair,
    ring: MemoryRegion,
    stage: MemoryRegion,
    peer_addr: u64,
    peer_rkey: u32,
    /// Held while posting and while reaping completions (never across a
    /// wait).
    post: Mutex<Post>,
    /// Whether the progress thread has this link in its list.
    pub(crate) queued: AtomicBool,
    /// A non-blocking write found the peer's ring full: the program's
    /// epoll registrations of it have `EPOLLOUT` taken out until credits
    /// come back ([`crate::epoll`]).
    write_blocked: AtomicBool,
    /// `Tx::wr`, readable without the writer's lock (a blocking writer
    /// holds it while it waits for credits).
    wr_now: AtomicU64,
    /// A `WANT` was sent and its answer not taken yet (the receive CQ is
    /// armed for it).
    asked: AtomicBool,
    /// Held while asking and while taking answers.
    ask: Mutex<()>,
    /// Waits of blocking writes for an answer, those an answer ended, and
    /// those that ran out (no answer) with credits there: a lost or late
    /// wake-up (`VRDMA_SOCKETS_DEBUG` prints them at the close).
    waits: AtomicU32,
    woken: AtomicU32,
    missed: AtomicU32,
    /// Slow looks of the progress thread that found credits back while
    /// an answer was still awaited: an answer lost or never sent (each
    /// cost its waiter up to a second; `VRDMA_SOCKETS_DEBUG` prints them
    /// at the close).
    late: AtomicU32,
    /// Armings posted and wake bytes sent (`VRDMA_SOCKETS_DEBUG` prints
    /// them at the close).
    armings: AtomicU32,
    wakes: AtomicU32,
    /// Ring writes posted, and those of them the direct path took from
    /// the caller's buffer (`VRDMA_SOCKETS_DEBUG` prints them at the
    /// close).
    writes: AtomicU32,
    direct_writes: AtomicU32,
    /// `riowrite`s, their pieces the direct path took from the caller's
    /// buffer (`VRDMA_SOCKETS_DEBUG` prints them at the close), and those
    /// since the last signaled write ([`iomap`]).
    iowrites: AtomicU32,
    io_direct: AtomicU32,
    io_unsignaled: AtomicU32,
    rx: ConnLock<Rx>,
    /// A non-blocking read left the ring unarmed (the connection is
    /// waited for only in epoll sets: [`Self::lazy_look`]); cleared by an
    /// arming.
    unarmed: AtomicBool,
    tx: ConnLock<Tx>,
    /// This end's mappings for the peer's direct placement (taken after
    /// `tx`).
    iomaps: Mutex<iomap::Local>,
}

struct Rx {
    /// Bytes read from the ring (a running count).
    rd: u64,
    /// `rd` as last sent to the peer.
    acked: u64,
    eof: bool,
    /// The generation last armed (1..=255; each wake byte is the
    /// generation it answers).
    gen: u32,
    /// Armed since the last bytes were read.
    armed: bool,
    /// The arming's write (its work request id) while it may not have
    /// landed; 0 once it did.
    arm_id: u64,
    /// The look at the ring after the arming landed was made (and the
    /// stale wake bytes taken off).
    settled: bool,
}

#[derive(Default)]
struct Tx {
    /// Bytes written into the peer's ring (a running count), posted: they
    /// land in order, each write's tail once its completion came.
    wr: u64,
    /// Writes posted so far (picks the tail slot).
    posts: u64,
    shut: bool,
    /// The peer closed (its `CLOSED` word) and one write was taken as
    /// over TCP (its bytes lost with the peer); the next ones fail.
    reset: bool,
}

/// The send queue's bookkeeping: what was posted, what completed.
#[derive(Default)]
struct Post {
    /// The last work request id given (ids run 1, 2, ...).
    next: u64,
    /// The highest id completed (RC completes in order: every id up to it
    /// is done).
    done: u64,
    /// Writes in flight: the id of each one's signaled tail write, and the
    /// tail it carries, oldest first.
    pending: VecDeque<(u64, u64)>,
    /// The tail of the last write whose completion came: every byte below
    /// it is in the peer's ring, its tail too.
    landed: u64,
    /// A completion failed: the connection is gone.
    failed: bool,
    /// The id of an arming's write not reaped yet (0: none): its
    /// completion answers a peer writer's `WANT`.
    arm: u64,
}

/// What [`Link::ask_credits`] did.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Ask {
    /// Asked before, not answered yet: the caller may wait for the answer
    /// once it looked at its credits after this.
    Pending,
    /// Asked now (the `WANT` landed): look at the credits again before
    /// waiting.
    Sent,
    /// No answer can come (no channel, no progress thread, a failed
    /// write): wait by looking.
    No,
}

/// What [`Link::lazy_look`] found.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Look {
    /// Bytes wait (or the stream ended) with no wake byte for them.
    Bytes,
    /// Nothing to report (armed, or empty and not asked to arm).
    Quiet,
    /// A read of the program holds the ring.
    Busy,
}

/// Errors are errnos, as the interposed calls return them.
pub type Res<T> = Result<T, c_int>;

/// The resources of one end, before the peer's hello.
pub struct Half {
    cq: CompletionQueue,
    rcq: Option<CompletionQueue>,
    qp: QueuePair,
    ring: MemoryRegion,
    stage: MemoryRegion,
    hello: [u8; HELLO_LEN],
}

impl Half {
    pub fn new(dev: &Dev) -> vrdma::Result<Half> {
        // (Read by the peer's answer to an exec demotion: [`CAP_EXEC`].)
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        let cq = dev.ctx.create_cq(2 * SEND_WRS, None)?;
        let rcq =
            crate::credit::channel(dev).and_then(|ch| dev.ctx.create_cq(2 * RECVS as u32, Some(ch)).ok());
        let cap = QpCap {
            max_send_wr: SEND_WRS,
            max_recv_wr: RECVS as u32,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let qp = dev.pd.create_rc_qp(&cq, rcq.as_ref().unwrap_or(&cq), cap)?;
        let ring = dev.pd.alloc_mr(REGION, access)?;
        let stage = dev.pd.alloc_mr(STAGE, AccessFlags::LOCAL_WRITE)?;
        let ep = qp.endpoint(&dev.ctx)?;
        let mut hello = [0u8; HELLO_LEN];
        hello[0..4].copy_from_slice(MAGIC);
        hello[4..8].copy_from_slice(&VERSION.to_le_bytes());
        hello[8..8 + Endpoint::WIRE_LEN].copy_from_slice(&ep.to_bytes());
        hello[34..42].copy_from_slice(&ring.addr().to_le_bytes());
        hello[42..46].copy_from_slice(&ring.rkey().to_le_bytes());
        hello[46..50].copy_from_slice(&(RING as u32).to_le_bytes());
        hello[CAPS] = CAP_DEMOTE | CAP_EXEC;
        Ok(Half { cq, rcq, qp, ring, stage, hello })
    }

    pub fn hello(&self) -> &[u8; HELLO_LEN] {
        &self.hello
    }

    /// Connects to the peer whose hello is `peer` (checked: any other
    /// bytes are a protocol error).
    pub fn connect(self, sock_owner: Arc<Sock>, page: Arc<Page>, peer: &[u8; HELLO_LEN]) -> Res<Link> {
        let u32_at = |i: usize| u32::from_le_bytes([peer[i], peer[i + 1], peer[i + 2], peer[i + 3]]);
        if &peer[0..4] != MAGIC || u32_at(4) != VERSION || u32_at(46) as usize != RING {
            return Err(libc::EPROTO);
        }
        let ep = Endpoint::from_bytes(&peer[8..8 + Endpoint::WIRE_LEN]).ok_or(libc::EPROTO)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(&peer[34..42]);
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        self.qp.connect(&ep, access).map_err(|e| e.errno())?;
        // The reader starts asleep, having read nothing: the first write
        // wakes it.
        self.ring.write_u64(SLEEPING, armed_word(0, 1)).map_err(|e| e.errno())?;
        // Receives for the peer's answers; without them, no asking.
        let rcq = self.rcq.filter(|_| {
            let wrs: Vec<_> = (0..RECVS).filter_map(|_| wr::recv(0, &[]).ok()).collect();
            wrs.len() == RECVS && self.qp.post_recv(&wrs).is_ok()
        });
        crate::forkshare::init();
        Ok(Link {
            page,
            peer_demotes: peer[CAPS] & CAP_DEMOTE != 0,
            peer_exec: peer[CAPS] & CAP_DEMOTE != 0 && peer[CAPS] & CAP_EXEC != 0,
            pid: crate::pid::get(),
            p_wr: AtomicBool::new(false),
            p_rd: AtomicBool::new(false),
            p_wr_began: AtomicBool::new(false),
            out: ConnLock::new(outq::OutQ::default()),
            out_len: AtomicUsize::new(0),
            out_pid: AtomicU32::new(0),
            out_err: AtomicI32::new(0),
            out_reset: AtomicBool::new(false),
            out_stuck: AtomicBool::new(false),
            out_shut: AtomicBool::new(false),
            out_shut_done: AtomicBool::new(false),
            out_linger: Mutex::new(None),
            sock: sock_owner.0,
            owner_sock: sock_owner,
            cq: self.cq,
            rcq,
            qp: self.qp,
            ring: self.ring,
            stage: self.stage,
            peer_addr: u64::from_le_bytes(a),
            peer_rkey: u32_at(42),
            post: Mutex::new(Post::default()),
            queued: AtomicBool::new(false),
            write_blocked: AtomicBool::new(false),
            unarmed: AtomicBool::new(false),
            wr_now: AtomicU64::new(0),
            asked: AtomicBool::new(false),
            ask: Mutex::new(()),
            waits: AtomicU32::new(0),
            woken: AtomicU32::new(0),
            missed: AtomicU32::new(0),
            late: AtomicU32::new(0),
            armings: AtomicU32::new(0),
            wakes: AtomicU32::new(0),
            writes: AtomicU32::new(0),
            direct_writes: AtomicU32::new(0),
            iowrites: AtomicU32::new(0),
            io_direct: AtomicU32::new(0),
            io_unsignaled: AtomicU32::new(0),
            // Both ends start armed with generation 1 (set just above).
            rx: ConnLock::new(Rx {
                rd: 0,
                acked: 0,
                eof: false,
                gen: 1,
                armed: true,
                arm_id: 0,
                settled: true,
            }),
            tx: ConnLock::new(Tx::default()),
            iomaps: Mutex::new(iomap::Local::default()),
        })
    }
}

pub fn ready_byte() -> u8 {
    READY
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Link {
    /// Posts `wrs` (the last one signaled) and returns the last one's id;
    /// `tail`: they are a write whose bytes below `tail` land with it.
    fn post(&self, wrs: &mut [vrdma::SendWr], tail: Option<u64>) -> Res<u64> {
        self.post_locked(&mut lock(&self.post), wrs, tail)
    }

    /// [`Self::post`] under the post lock.
    fn post_locked(&self, p: &mut Post, wrs: &mut [vrdma::SendWr], tail: Option<u64>) -> Res<u64> {
        if p.failed {
            return Err(libc::EPIPE);
        }
        for w in wrs.iter_mut() {
            p.next += 1;
            w.wr_id = p.next;
        }
        let last = p.next;
        self.qp.post_send(wrs).map_err(|e| e.error.errno())?;
        if let Some(t) = tail {
            p.pending.push_back((last, t));
        }
        Ok(last)
    }

    /// Polls the completions there are (without waiting) and, where a
    /// write landed, wakes an armed reader. Polls only while something is
    /// in flight (an empty poll costs the CQ's back-off).
    fn reap_locked(&self, p: &mut Post) -> Res<()> {
        if p.done >= p.next || p.failed {
            return if p.failed { Err(libc::EPIPE) } else { Ok(()) };
        }
        let mut wc = vrdma::wc_array::<16>();
        let n = self.cq.poll(&mut wc).map_err(|e| e.errno())?;
        let before = p.landed;
        for c in &wc[..n] {
            if c.status != WcStatus::Success {
                crate::dev::debug(&format!("work completion {:?}", c.status));
                p.failed = true;
                return Err(libc::EPIPE);
            }
            p.done = p.done.max(c.wr_id);
        }
        while let Some(&(id, t)) = p.pending.front() {
            if id > p.done {
                break;
            }
            p.landed = t;
            p.pending.pop_front();
        }
        if p.landed != before {
            // The bytes landed: an armed reader gets a wake byte, its
            // generation (the wake protocol reads the word only now),
            // unless it armed after reading them.
            self.wake(p.landed);
        }
        if p.arm != 0 && p.done >= p.arm {
            // This end's arming landed, with its credits: a peer writer
            // that asked for a sound gets it now.
            p.arm = 0;
            self.answer_want(p);
        }
        Ok(())
    }

    /// [`Self::reap_locked`] under the post lock.
    fn reap(&self) -> Res<()> {
        self.reap_locked(&mut lock(&self.post))
    }

    /// For the progress thread: reaps if no one else is, and says whether
    /// writes are still in flight (false once the connection failed).
    pub(crate) fn progress(&self) -> bool {
        let mut p = match self.post.try_lock() {
            Ok(p) => p,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return true,
        };
        let _ = self.reap_locked(&mut p);
        let flying = !p.failed && (!p.pending.is_empty() || p.arm != 0);
        drop(p);
        // An exec's resend still queued: pushed as far as the kernel takes.
        let queued = !self.push_out(false);
        self.still_blocked() || flying || self.asked.load(Ordering::Acquire) || queued
    }

    /// Waits until every write in flight landed; false once none is (or
    /// the connection failed) and no write waits for credits, as
    /// [`Self::progress`] says.
    pub(crate) fn flush_all_writes(&self) -> bool {
        let _ = self.flush();
        // This end's arming too: once landed, a peer writer that asked
        // for a sound meanwhile is answered before this program sleeps.
        let _ = self.wait_until(|p| p.arm == 0);
        self.still_blocked() || self.in_flight()
    }

    /// Whether the progress thread must keep looking at it: writes in
    /// flight, a write that found the ring full, or an answer to take.
    pub(crate) fn needs_watch(&self) -> bool {
        self.in_flight()
            || self.write_blocked.load(Ordering::SeqCst)
            || self.asked.load(Ordering::SeqCst)
            || self.out_queued()
    }

    /// Whether only the peer's answer is awaited (asked, with a channel
    /// for it, nothing in flight): the progress thread needs no look
    /// until the answer's event.
    pub(crate) fn awaits_answer_only(&self) -> bool {
        self.rcq.is_some() && self.asked.load(Ordering::SeqCst) && !self.in_flight()
    }

    /// Asks the peer's reader for a sound when it gives credits back
    /// ([`crate::credit`]): arms the receive CQ and sends `WANT`, waited
    /// for (the caller's next look at its credits must come after it
    /// landed), and puts the connection on the progress thread's list,
    /// which takes the answer.
    pub(crate) fn ask_credits(self: &Arc<Self>) -> Ask {
        let Some(rcq) = &self.rcq else { return Ask::No };
        // In a demotion no credits come (only an exec's queue to send).
        if self.in_demotion() {
            return Ask::No;
        }
        {
            let _g = lock(&self.ask);
            if self.asked.load(Ordering::Acquire) {
                return if self.queued.load(Ordering::Acquire) { Ask::Pending } else { Ask::No };
            }
            if rcq.req_notify(false).is_err() {
                return Ask::No;
            }
            // Asked, and on the progress thread's list, before the `WANT`
            // goes: its answer can come before this end reaps the `WANT`'s
            // own completion (the peer's placement comes before the ack),
            // and the thread takes an answer only for a connection it
            // lists; an event it finds no connection for is lost with the
            // answer (the CQ stays unarmed, and the writer sleeps on).
            self.asked.store(true, Ordering::SeqCst);
            crate::progress::watch(self);
            let _ = self.stage.write_u64(S_WANT, 1);
            if self.write_word(S_WANT, 8, WANT).is_err() {
                self.asked.store(false, Ordering::SeqCst);
                return Ask::No;
            }
        }
        if self.queued.load(Ordering::Acquire) {
            Ask::Sent
        } else {
            Ask::No
        }
    }

    /// For the progress thread's slow look (no answer's event for a
    /// while): credits back while the answer is still awaited are an
    /// answer lost or never sent, counted.
    pub(crate) fn note_slow_look(&self) {
        if self.asked.load(Ordering::Acquire) && self.writable() {
            self.late.fetch_add(1, Ordering::Relaxed);
            crate::dev::debug("credits came back with no answer seen");
        }
    }

    /// The number of the CQ where the peer's answers complete.
    pub(crate) fn answer_cq(&self) -> Option<u32> {
        self.rcq.as_ref().map(|c| c.cqn())
    }

    /// For the progress thread, on an event of [`Self::answer_cq`]: takes
    /// the peer's answers and posts their receives again; the next wait
    /// asks again. Whether an answer was there.
    pub(crate) fn take_answers(&self) -> bool {
        let Some(rcq) = &self.rcq else { return false };
        let _g = lock(&self.ask);
        let mut wc = vrdma::wc_array::<RECVS>();
        let mut n = rcq.poll(&mut wc).unwrap_or(0);
        if n == 0 && self.asked.load(Ordering::Acquire) {
            // No answer behind the event (yet): armed again for the one
            // owed, and a look after the arming (an answer that came
            // before it raises no event).
            let _ = rcq.req_notify(false);
            n = rcq.poll(&mut wc).unwrap_or(0);
            crate::dev::debug(&format!("credit event without an answer, {n} after arming again"));
        }
        let ok = wc[..n].iter().filter(|c| c.status == WcStatus::Success).count();
        if ok > 0 {
            let wrs: Vec<_> = (0..ok).filter_map(|_| wr::recv(0, &[]).ok()).collect();
            let _ = self.qp.post_recv(&wrs);
        }
        if n > 0 {
            self.asked.store(false, Ordering::Release);
        }
        ok > 0
    }

    /// After a credit of this end's reader landed: a peer writer that
    /// asked for a sound (`WANT`) gets it, a zero-length send
    /// ([`crate::credit`]).
    fn answer_want(&self, p: &mut Post) {
        let word = self.ring.as_ptr().wrapping_add(WANT);
        // SAFETY: `WANT` is an 8-aligned offset inside the ring region
        // (page-aligned, living as long as `self`); the peer writes the
        // word only with aligned 8-byte stores, so an atomic view is right.
        let word = unsafe { std::sync::atomic::AtomicU64::from_ptr(word.cast()) };
        if word.load(Ordering::SeqCst) == 0 || word.swap(0, Ordering::SeqCst) == 0 {
            return;
        }
        if let Ok(w) = wr::send(0, &[]) {
            let _ = self.post_locked(p, &mut [w.signaled()], None);
        }
    }

    /// Whether writes are in flight (an arming too).
    pub(crate) fn in_flight(&self) -> bool {
        let p = lock(&self.post);
        !p.failed && (!p.pending.is_empty() || p.arm != 0)
    }

    /// Whether a write would find room now: credits, or an end that
    /// makes the write fail at once (a failed connection, a peer that
    /// closed).
    pub(crate) fn writable(&self) -> bool {
        // In a demotion the kernel socket says (a writer blocked on a
        // full ring is told writable when the peer demoted, and its
        // write switches).
        // An exec's resend still queued: not before it is sent (pushed
        // now, as far as the kernel takes it).
        if self.in_demotion() || self.peer_demoted().is_some() {
            return self.push_out(false);
        }
        let consumed = self.ring.read_u64(CONSUMED).unwrap_or(0);
        let used = self.wr_now.load(Ordering::Acquire).saturating_sub(consumed);
        (used as usize) < RING || self.peer_closed() || lock(&self.post).failed
    }

    /// Whether a non-blocking write found the ring full and no credits
    /// came back since.
    pub(crate) fn write_blocked(&self) -> bool {
        self.write_blocked.load(Ordering::Acquire)
    }

    /// For a write-blocked link: once it is writable again, its epoll
    /// registrations get `EPOLLOUT` back (which makes the kernel report
    /// it, also edge-triggered). Whether it is still blocked.
    pub(crate) fn still_blocked(&self) -> bool {
        if !self.write_blocked.load(Ordering::Acquire) {
            return false;
        }
        if !self.writable() {
            return true;
        }
        self.unblock();
        false
    }

    /// A non-blocking write found no room: the program's epoll
    /// registrations lose `EPOLLOUT` until there is (the caller puts the
    /// link on the progress thread's list, which gives it back).
    fn write_blocked_now(&self) {
        if !self.write_blocked.swap(true, Ordering::SeqCst) {
            crate::epoll::write_blocked(self);
            // An unblock (the progress thread, on credits) that
            // ran between the flag and the strip found nothing
            // to give back: `EPOLLOUT` would stay out for good.
            if !self.write_blocked.load(Ordering::Acquire) {
                crate::epoll::writable_again(self);
            }
        }
    }

    /// An exec's resend queued: the progress thread pushes it while the
    /// program makes no call.
    fn watch_out(self: &Arc<Self>) {
        if self.out_queued() {
            crate::progress::watch(self);
        }
    }

    /// Clears the write-blocked state and gives `EPOLLOUT` back.
    fn unblock(&self) {
        if self.write_blocked.swap(false, Ordering::AcqRel) {
            crate::epoll::writable_again(self);
        }
    }

    /// Whether the peer closed its last descriptor of the connection (an
    /// orderly close: its `CLOSED` word, written after its last byte
    /// landed and before its QP went away).
    pub(crate) fn peer_closed(&self) -> bool {
        let c = self.ring.read_u64(CLOSED).unwrap_or(0) != 0;
        fence(Ordering::SeqCst);
        c
    }

    /// Reaps until `done(post)` holds: a completion, or room for a write.
    fn wait_until(&self, done: impl Fn(&Post) -> bool) -> Res<()> {
        let mut spins = 0u32;
        // (The clock is read only once the condition failed: most calls
        // find it true at once.)
        let mut start = None;
        loop {
            {
                let mut p = lock(&self.post);
                self.reap_locked(&mut p)?;
                if done(&p) {
                    return Ok(());
                }
            }
            let start = *start.get_or_insert_with(Instant::now);
            // A peer that closed destroys its QP once its `CLOSED` word
            // landed: what goes there now completes only at the QP's retry
            // timeout (and in error). Nothing it would do is needed.
            if self.peer_closed() {
                return Err(libc::EPIPE);
            }
            spins += 1;
            if spins.is_multiple_of(1024) && crate::dev::dev().is_none_or(|d| d.ctx.daemon_gone()) {
                return Err(libc::ECONNRESET);
            }
            // Yield for a while first: a sleep costs the timer's slack
            // (50 µs by default), more than most completions.
            if spins > 256 && start.elapsed() > SPIN {
                std::thread::sleep(Duration::from_micros(20));
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Waits until every work request posted so far completed (the
    /// answers' sends too).
    fn flush_sends(&self) -> Res<()> {
        let last = lock(&self.post).next;
        self.wait_until(|p| p.done >= last)
    }

    /// Waits until every write posted so far has landed (and its wake
    /// byte, if one was due, is sent).
    fn flush(&self) -> Res<()> {
        self.wait_until(|p| p.pending.is_empty())
    }

    fn write_word(&self, from: usize, len: usize, to: usize) -> Res<()> {
        let sge = self.stage.sge(from, len).map_err(|e| e.errno())?;
        let w = wr::rdma_write(0, &[sge], self.peer_addr + to as u64, self.peer_rkey)
            .map_err(|e| e.errno())?
            .signaled();
        let id = self.post(&mut [w], None)?;
        self.wait_until(|p| p.done >= id)
    }

    /// Bytes waiting in this end's ring (a peer's tail that is behind or
    /// more than a ring ahead is taken as nothing yet).
    fn waiting(&self, rd: u64) -> usize {
        let written = self.ring.read_u64(WRITTEN).unwrap_or(rd);
        fence(Ordering::SeqCst);
        match written.checked_sub(rd) {
            Some(n) if n as usize <= RING => n as usize,
            _ => 0,
        }
    }

    /// Bytes a read would find now, for `FIONREAD`: those waiting in the
    /// ring; none while another thread's read holds it (that read is
    /// taking them, or waits for more).
    ///
    /// `None`: the kernel's count is the answer (the reads went to the
    /// kernel socket in a demotion). Demoted at this end, the ring's
    /// bytes from the shared read count (the socket holds wake bytes and
    /// the peer's marker before its data).
    pub fn readable_bytes(&self) -> Option<usize> {
        if self.p_reads_switched() || self.d_state() == crate::owner::D_DONE {
            return None;
        }
        if self.d_demoted() {
            return Some(self.demoted_waiting());
        }
        Some(match self.rx.try_lock() {
            Ok(rx) => self.waiting(rx.rd),
            Err(_) => 0,
        })
    }

    /// Reads into `iov` (total `cap` bytes): at least one byte, 0 at the
    /// end of the stream, or an errno (`EAGAIN` when `nonblocking` and
    /// nothing waits). `peek` leaves the bytes in the ring; `all` waits
    /// for `cap` bytes or the end.
    ///
    /// Whenever a read leaves the ring empty, the reader arms ([`Self::sleep`]),
    /// so that the kernel socket is readable exactly while bytes wait.
    pub fn read(
        self: &Arc<Self>,
        iov: &[(*mut u8, usize)],
        nonblocking: bool,
        peek: bool,
        all: bool,
    ) -> Res<usize> {
        let cap = vector_len(iov.iter().map(|&(p, n)| (p.is_null(), n)))?;
        if cap == 0 {
            return Ok(0);
        }
        // Demoted (`demote`): before the receive lock, which a forked
        // holder's copy may hold for ever.
        if self.d_demoted() {
            return self.read_demoted(iov, cap, 0, nonblocking, peek, all);
        }
        if self.p_reads_switched() {
            return self.read_kernel(iov, 0, nonblocking, peek, all);
        }
        crate::pause::at(crate::pause::Point::RecvLock);
        let mut rx = self.rx.lock();
        // Switched by another reader thread while this one waited for
        // the receive lock: the socket's head is data now, no marker.
        if self.p_reads_switched() {
            drop(rx);
            return self.read_kernel(iov, 0, nonblocking, peek, all);
        }
        // This end's writes in flight: their wakes go out now (a write's
        // errors are the writer's to see).
        let _ = self.reap();
        // A blocking read of a connection that no readiness call knows
        // arms only when it is about to wait: see `Self::arm_for_readiness`.
        let lazy = !nonblocking && !self.owner_sock.watched();
        // A non-blocking read of a connection waited for only in epoll
        // sets leaves the ring unarmed: the epoll wait arms it before it
        // sleeps, and watches the ring a moment first (`Self::lazy_look`).
        let lazy_nb = nonblocking && self.owner_sock.lazy_ok();
        let mut spun = false;
        let mut done = 0usize;
        loop {
            if self.d_demoted() {
                // Demoted while this read waited: the shared count rules.
                drop(rx);
                return self.read_demoted(iov, cap, done, nonblocking, peek, all);
            }
            let avail = self.waiting(rx.rd);
            if avail > 0 && peek {
                let n = avail.min(cap);
                if self.locked_ring(|| self.copy_out(rx.rd, n, iov, 0)).is_none() {
                    continue;
                }
                return Ok(n);
            }
            if avail > 0 {
                let n = avail.min(cap - done);
                // Under the lock between the processes that may share the
                // ring after a fork (`demote`).
                let copied = self.locked_ring(|| {
                    self.copy_out(rx.rd, n, iov, done);
                    rx.rd += n as u64;
                    self.share_rd(rx.rd);
                });
                if copied.is_none() {
                    continue;
                }
                done += n;
                rx.armed = false;
                let empty = self.waiting(rx.rd) == 0;
                // (A lazy non-blocking read arms only if a thread of the
                // process waits: `Self::leave_unarmed`.)
                let arm = if lazy_nb { !self.leave_unarmed() } else { !lazy };
                if empty && arm {
                    self.sleep(&mut rx);
                } else if rx.rd - rx.acked >= (RING / 4) as u64 {
                    // Credits back. A peer that is gone no longer needs
                    // them; its end is seen on the socket.
                    let _ = self.credit(rx.rd);
                    rx.acked = rx.rd;
                }
                if !all || done == cap {
                    return Ok(done);
                }
                continue;
            }
            if done > 0 && nonblocking {
                return Ok(done);
            }
            if rx.eof {
                return Ok(done);
            }
            if self.p_at_mark(rx.rd) {
                // The demoting peer's bytes are all read: its marker, then
                // the kernel socket.
                if done > 0 {
                    return Ok(done);
                }
                if !self.p_writes_switched() {
                    // Its writes switch first (an exec's resend may be
                    // long): not under the receive lock, which another
                    // reader thread may want meanwhile.
                    drop(rx);
                    self.p_switch_writes_now()?;
                    self.watch_out();
                    rx = self.rx.lock();
                    if self.p_reads_switched() {
                        drop(rx);
                        return self.read_kernel(iov, 0, nonblocking, peek, all);
                    }
                    continue;
                }
                return match self.p_switch_reads(&mut rx, nonblocking)? {
                    demote::PSwitch::Kernel => {
                        drop(rx);
                        self.read_kernel(iov, 0, nonblocking, peek, all)
                    }
                    demote::PSwitch::End => match self.out_err_at_end() {
                        Some(e) => Err(e),
                        None => Ok(0),
                    },
                    demote::PSwitch::Demoted => {
                        drop(rx);
                        self.read_demoted(iov, cap, 0, nonblocking, peek, all)
                    }
                };
            }
            if !rx.armed && lazy_nb && !self.peer_closed() && self.leave_unarmed() {
                return Err(libc::EAGAIN);
            }
            if !rx.armed {
                // Not armed yet (a lazy read): watch the ring a moment
                // first; an answer that comes meanwhile is read with no
                // arming and no wake byte at all.
                if lazy && !spun {
                    spun = true;
                    if self.spin_for_bytes(rx.rd) {
                        continue;
                    }
                }
                self.sleep(&mut rx);
                continue;
            }
            if !rx.settled {
                // The arming must have landed before the look that lets
                // this read wait (or say EAGAIN).
                self.settle(&mut rx);
                continue;
            }
            // Armed and empty, blocking: watch the ring a moment before
            // waiting in the kernel, so that an answer that comes soon is
            // read without the wake byte's trip through the socket (the
            // byte still comes, and the next arming takes it as stale).
            if !nonblocking && !spun {
                spun = true;
                if self.spin_for_bytes(rx.rd) {
                    continue;
                }
            }
            // A blocking read waits in the kernel only once this end's
            // writes landed and woke their reader (a request is answered
            // only after its bytes are read).
            if !nonblocking {
                let _ = self.flush();
            }
            // Armed and empty: look at the socket (a blocking read waits
            // there): its end, or a byte, which stays for the readiness it
            // gives (a stale one is taken by the next arming).
            let mut b = [0u8; 1];
            let flags = if nonblocking { libc::MSG_PEEK | libc::MSG_DONTWAIT } else { libc::MSG_PEEK };
            // SAFETY: `b` is valid for one byte.
            let r = unsafe { real::recv(self.sock, b.as_mut_ptr().cast(), 1, flags) };
            match r {
                0 => rx.eof = true,
                // A 0 with no `DEMOTE` word (which lands before a demoting
                // peer sends its marker) and no demotion here: no wake
                // byte, nothing that the protocol sends; every take-off
                // stops before it, so it would stay for ever.
                1.. if b[0] == 0 && self.peer_demoted().is_none() && !self.in_demotion() => {
                    crate::dev::debug("a 0 byte with no demotion on the socket: a protocol error");
                    return if done > 0 { Ok(done) } else { Err(libc::ECONNRESET) };
                }
                1.. => rx.armed = false,
                _ => match crate::table::errno() {
                    libc::EINTR if !nonblocking => {}
                    e => return if done > 0 { Ok(done) } else { Err(e) },
                },
            }
        }
    }

    /// For a non-blocking read that leaves the ring empty and unarmed:
    /// marks it so ([`Self::lazy_look`]), then whether it may stay so: no
    /// thread of this process is in a readiness call's wait (which
    /// marked itself before it looked at the marks: either it sees this
    /// mark, or this sees it: `crate::readiness::SLEEPERS`).
    fn leave_unarmed(&self) -> bool {
        self.unarmed.store(true, Ordering::SeqCst);
        crate::readiness::SLEEPERS.load(Ordering::SeqCst) == 0
    }

    /// Waited for by `poll` or `select`: reads arm at once, for good.
    pub(crate) fn never_lazy(&self) {
        self.owner_sock.never_lazy();
    }

    /// For an epoll registration: the next wait on its set looks at the
    /// ring (and arms it) as if a non-blocking read had left it unarmed.
    pub(crate) fn mark_unarmed(&self) {
        self.unarmed.store(true, Ordering::SeqCst);
    }

    /// Whether a non-blocking read left the ring unarmed.
    pub(crate) fn is_unarmed(&self) -> bool {
        self.unarmed.load(Ordering::SeqCst)
    }

    /// For an epoll wait, about a connection a non-blocking read left
    /// unarmed ([`Self::is_unarmed`]): whether bytes wait (or the stream
    /// ended), which no wake byte announces: the wait reports them. With
    /// `arm` (the wait is about to sleep) an empty ring is armed, and
    /// looked at again once the arming landed (the wake protocol's second
    /// look, which takes stale bytes off). `Busy`: a read of the program
    /// holds the ring.
    pub(crate) fn lazy_look(self: &Arc<Self>, arm: bool) -> Look {
        if self.in_demotion() {
            return if self.demoted_bytes() { Look::Bytes } else { Look::Quiet };
        }
        let Ok(mut rx) = self.rx.try_lock() else { return Look::Busy };
        if rx.armed || rx.eof {
            self.unarmed.store(false, Ordering::SeqCst);
            return Look::Quiet;
        }
        if self.waiting(rx.rd) > 0 {
            return Look::Bytes;
        }
        if !arm {
            return Look::Quiet;
        }
        self.sleep(&mut rx);
        self.settle(&mut rx);
        if rx.eof || self.waiting(rx.rd) > 0 {
            Look::Bytes
        } else {
            Look::Quiet
        }
    }

    /// Whether bytes came into the ring within [`watch_for`] (yielding between
    /// looks, so that on a busy machine the writer and the daemon run).
    fn spin_for_bytes(&self, rd: u64) -> bool {
        let start = Instant::now();
        loop {
            // A look after the last yield too: on a loaded machine one
            // yield can outlast the whole spin, and the bytes came
            // meanwhile.
            if self.waiting(rd) > 0 {
                return true;
            }
            if start.elapsed() >= watch_for() {
                return false;
            }
            let _ = self.reap();
            std::thread::yield_now();
        }
    }

    /// The ring is empty: arms a new generation (sends the consumed count
    /// and the generation into the writer's `SLEEPING` word). The write is
    /// posted, not waited for: a read that emptied the ring returns at once
    /// (an engine round trip less between a request read and its answer
    /// written). What needs the arming landed waits for it first
    /// ([`Self::settle`]): a read that would wait or say `EAGAIN`, and a
    /// readiness call's look at stale bytes.
    ///
    /// Readiness meanwhile: bytes that land before the arming did meet the
    /// writer's look at the word before it, which holds either the
    /// previous arming (the writer takes it and sends its byte) or nothing,
    /// once the previous arming's byte was sent; that byte is taken off
    /// only by a look that comes after this arming landed and finds the
    /// ring empty, so it stays in the socket while those bytes wait.
    ///
    /// A peer that closed is not armed towards (its QP is gone, and the
    /// arming would wait for the retry timeout): its `CLOSED` word came
    /// after its last byte, so an empty ring then is the end of the
    /// stream, as TCP's FIN after the last byte.
    fn sleep(self: &Arc<Self>, rx: &mut Rx) {
        if self.peer_closed() {
            if self.waiting(rx.rd) == 0 {
                rx.eof = true;
            }
            return;
        }
        // The previous arming's slot is read by its write: landed first.
        if rx.arm_id != 0 {
            let id = rx.arm_id;
            let _ = self.wait_until(|p| p.done >= id);
            rx.arm_id = 0;
        }
        rx.gen = if rx.gen >= 255 { 1 } else { rx.gen + 1 };
        let _ = self.stage.write_u64(S_ARM, rx.rd);
        let _ = self.stage.write_u64(S_ARM + 8, armed_word(rx.rd, rx.gen));
        // A peer that is gone gets no ack; its end shows on the socket.
        if let Ok(id) = self.post_arm() {
            self.armings.fetch_add(1, Ordering::Relaxed);
            rx.arm_id = id;
            // A peer writer waiting for these credits is answered once
            // they landed: now, rather than at this end's next call (a
            // `WANT` that lands later is seen when the arming is reaped).
            if self.want_set() {
                let _ = self.wait_until(|p| p.done >= id);
                rx.arm_id = 0;
            } else {
                // A `WANT` that lands after this look is seen when the
                // arming is reaped, and that must not wait for this end's
                // next call: the program may next wait for the very bytes
                // the peer's writer holds until it is answered (both ends
                // asleep). The progress thread reaps it, and a readiness
                // call that waits first lets it land ([`Self::flush_all_writes`]).
                crate::progress::watch(self);
            }
        }
        rx.acked = rx.rd;
        rx.armed = true;
        rx.settled = false;
        self.unarmed.store(false, Ordering::SeqCst);
    }

    /// Whether a peer writer asked for a sound (`WANT` set).
    fn want_set(&self) -> bool {
        self.ring.read_u64(WANT).unwrap_or(0) != 0
    }

    /// Posts the arming in [`S_ARM`] (signaled); its id.
    fn post_arm(&self) -> Res<u64> {
        let sge = self.stage.sge(S_ARM, 16).map_err(|e| e.errno())?;
        let w = wr::rdma_write(0, &[sge], self.peer_addr + CONSUMED as u64, self.peer_rkey)
            .map_err(|e| e.errno())?
            .signaled();
        let mut p = lock(&self.post);
        let id = self.post_locked(&mut p, &mut [w], None)?;
        p.arm = id;
        Ok(id)
    }

    /// The look after the arming landed (waited for here): bytes that
    /// came meanwhile are read by the caller; an empty ring takes the
    /// wake bytes of older generations off the socket, which are stale:
    /// a byte of an older generation was sent after its bytes landed,
    /// which was before this arming landed, so this look saw them, and
    /// they were read. A byte of this generation stays: its bytes landed
    /// after this look, and wait.
    fn settle(&self, rx: &mut Rx) {
        if !rx.armed || rx.settled {
            return;
        }
        if rx.arm_id != 0 {
            let id = rx.arm_id;
            // Gives up (an error) once the peer closed or failed: the
            // looks below see that.
            let _ = self.wait_until(|p| p.done >= id);
            rx.arm_id = 0;
        }
        rx.settled = true;
        if self.waiting(rx.rd) > 0 {
            return;
        }
        // The peer closed while the arming was on its way (and the wait
        // for it gave up): the end, as in `sleep`.
        if self.peer_closed() {
            rx.eof = self.waiting(rx.rd) == 0;
            return;
        }
        if let Ok(true) = self.take_stale(rx.gen as u8) {
            rx.eof = true;
        }
    }

    /// For a readiness call about to look at this connection: it knows it
    /// from now on (reads that empty the ring arm at once, as the wake
    /// protocol needs for a program that waits in `poll` or `epoll`),
    /// and an arming a lazy read left undone is made now. A blocking read
    /// of a connection that no readiness call knows does not arm when it
    /// empties the ring, only when it is about to wait (after watching
    /// the ring for [`watch_for`]): a request/response exchange whose answer
    /// comes while the reader watches then costs no arming (an RDMA
    /// write), no wake byte (a `send`) and no stale byte taken off (two
    /// `recv`s) per message. But bytes that land while the reader is not
    /// armed make the socket readable for nobody; so here an unarmed
    /// empty ring arms and, once the arming landed, looks again (the wake
    /// protocol's second look; the stale bytes are taken off with it).
    /// Once per connection: its reads arm at once from now on.
    /// Whether bytes wait (or the stream ended) without the socket having
    /// to say so: the call reports the connection readable itself. A
    /// reader in a call of its own holds the lock and arms itself before
    /// it waits: false.
    pub(crate) fn arm_for_readiness(self: &Arc<Self>) -> bool {
        self.owner_sock.watch();
        if self.in_demotion() {
            return self.demoted_bytes();
        }
        let Ok(mut rx) = self.rx.try_lock() else { return false };
        if rx.armed || rx.eof {
            return false;
        }
        if self.waiting(rx.rd) > 0 {
            return true;
        }
        self.sleep(&mut rx);
        self.settle(&mut rx);
        rx.eof || self.waiting(rx.rd) > 0
    }

    /// Whether bytes wait in the ring while the reader is not armed (no
    /// wake byte announces them); true while a read of the program holds
    /// the ring (it may be so).
    pub(crate) fn unannounced_bytes(&self) -> bool {
        if self.in_demotion() {
            return self.demoted_bytes();
        }
        let Ok(rx) = self.rx.try_lock() else { return true };
        !rx.armed && !rx.eof && self.waiting(rx.rd) > 0
    }

    /// For a readiness call that found the socket readable: whether that
    /// readiness is only stale wake bytes (now taken off), the ring empty
    /// and armed, no end of stream. A stale byte can reach the socket after
    /// the arming that would have taken it (the writer took the older
    /// arming and its byte crossed the network late): a program told
    /// "readable" would then block in its read. A reader in a call of its
    /// own holds the lock and settles this itself: false.
    pub(crate) fn readable_is_stale(&self) -> bool {
        if self.in_demotion() {
            return false;
        }
        let Ok(mut rx) = self.rx.try_lock() else { return false };
        if !rx.armed || rx.eof {
            return false;
        }
        // The look must come after the arming landed (`sleep`).
        self.settle(&mut rx);
        if rx.eof || self.waiting(rx.rd) > 0 {
            return false;
        }
        match self.take_stale(rx.gen as u8) {
            Ok(true) => {
                rx.eof = true;
                false
            }
            Ok(false) => {
                let mut b = [0u8; 1];
                // SAFETY: `b` is valid for one byte; a peek takes nothing.
                let r = unsafe {
                    real::recv(self.sock, b.as_mut_ptr().cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT)
                };
                r < 0 && crate::table::errno() == libc::EAGAIN && self.waiting(rx.rd) == 0
            }
            Err(_) => false,
        }
    }

    /// As [`Self::readable_is_stale`], for a ring a non-blocking read
    /// left unarmed (`None` if it is armed): every wake byte in the
    /// socket is stale (each was sent after its bytes landed, and the
    /// reader read every byte since, or it would still be armed), so all
    /// are taken off, and the ring is looked at after that (bytes that
    /// landed meanwhile are reported: the socket is readable for them).
    pub(crate) fn unarmed_is_stale(&self) -> Option<bool> {
        if self.in_demotion() {
            return Some(false);
        }
        let Ok(mut rx) = self.rx.try_lock() else { return Some(false) };
        if rx.armed {
            return None;
        }
        if rx.eof {
            return Some(false);
        }
        match self.take_stale(0) {
            Ok(true) => {
                rx.eof = true;
                Some(false)
            }
            // A demoting peer's marker left at the head: readable.
            Ok(false) => Some(self.waiting(rx.rd) == 0 && !self.zero_at_head()),
            Err(_) => Some(false),
        }
    }

    /// Takes wake bytes other than `keep` off the socket, up to the first
    /// `keep`; true at the socket's end.
    fn take_stale(&self, keep: u8) -> Res<bool> {
        // Never once demoted (`demote`): the socket may hold data then.
        self.unless_demoted(|| self.take_stale_now(keep)).unwrap_or(Ok(false))
    }

    /// [`Self::take_stale`], not demoted.
    fn take_stale_now(&self, keep: u8) -> Res<bool> {
        let mut b = [0u8; 256];
        loop {
            // SAFETY: `b` is valid for its length.
            let r = unsafe {
                real::recv(self.sock, b.as_mut_ptr().cast(), b.len(), libc::MSG_PEEK | libc::MSG_DONTWAIT)
            };
            let n = match r {
                0 => return Ok(true),
                1.. => r as usize,
                _ => {
                    return match crate::table::errno() {
                        libc::EAGAIN | libc::EINTR => Ok(false),
                        e => Err(e),
                    }
                }
            };
            // A 0 is a demoting peer's marker (`demote`), never stale.
            let stale = b[..n].iter().position(|&x| x == keep || x == 0).unwrap_or(n);
            if stale == 0 {
                return Ok(false);
            }
            // SAFETY: as above; takes the `stale` bytes just peeked.
            unsafe { real::recv(self.sock, b.as_mut_ptr().cast(), stale, libc::MSG_DONTWAIT) };
            if stale < n {
                return Ok(false);
            }
        }
    }

    /// Sends this end's consumed count (credits) to the peer's writer.
    fn credit(&self, rd: u64) -> Res<()> {
        let _ = self.stage.write_u64(S_ACK, rd);
        self.write_word(S_ACK, 8, CONSUMED)?;
        self.answer_want(&mut lock(&self.post));
        Ok(())
    }

    /// Takes every byte waiting on the socket; true at its end.
    fn drain_wakes(&self) -> Res<bool> {
        let mut b = [0u8; 256];
        loop {
            // SAFETY: `b` is valid for its length.
            let r = unsafe { real::recv(self.sock, b.as_mut_ptr().cast(), b.len(), libc::MSG_DONTWAIT) };
            match r {
                0 => return Ok(true),
                1.. => continue,
                _ => {
                    let e = crate::table::errno();
                    return match e {
                        libc::EAGAIN | libc::EINTR => Ok(false),
                        e => Err(e),
                    };
                }
            }
        }
    }

    fn copy_out(&self, from: u64, n: usize, iov: &[(*mut u8, usize)], skip: usize) {
        let base = self.ring.as_ptr();
        let mut pos = (from % RING as u64) as usize;
        let mut left = n;
        let mut skip = skip;
        for &(p, len) in iov {
            if skip >= len {
                skip -= len;
                continue;
            }
            let mut off = skip;
            skip = 0;
            while off < len && left > 0 {
                let k = (len - off).min(left).min(RING - pos);
                // SAFETY: `pos + k <= RING` lies in the ring region, which
                // only the daemon writes (not these bytes, which the peer
                // wrote before the tail that made them waiting); `p + off`
                // is in the caller's buffer of `len` bytes.
                unsafe { std::ptr::copy_nonoverlapping(base.add(pos), p.add(off), k) };
                off += k;
                left -= k;
                pos = (pos + k) % RING;
            }
            if left == 0 {
                break;
            }
        }
    }

    /// Writes `iov` (total `len`), all of it unless `nonblocking` (then
    /// what fits, or `EAGAIN`).
    ///
    /// Pipelined: a write returns once its bytes are in the staging region
    /// and posted. Their completions are reaped later ([`Self::reap`]: in
    /// this connection's next call, while a write waits for credits or a
    /// send-queue slot, and by the progress thread for a writer that does
    /// not call again), and each one that lands checks the reader's
    /// arming, as the wake protocol asks. At most [`IN_FLIGHT`] writes and
    /// a ring's worth of bytes are in flight per connection.
    pub fn write(self: &Arc<Self>, iov: &[(*const u8, usize)], nonblocking: &Blocking) -> Res<usize> {
        let total = vector_len(iov.iter().map(|&(p, n)| (p.is_null(), n)))?;
        // Demoted (`demote`): before the send lock, which the demoting
        // driver holds, and a forked holder's copy may hold for ever.
        if let Some(r) = self.write_demoted(iov, nonblocking.nonblocking()) {
            return r;
        }
        crate::pause::at(crate::pause::Point::SendLock);
        let mut tx = self.tx.lock();
        if after_send_lock(self.d_state()) == Recheck::Demoted {
            // Waited for the send lock while the driver demoted (it held
            // it): its marker is sent, so nothing more may go into the
            // ring; the demoted way.
            drop(tx);
            return self.write_demoted(iov, nonblocking.nonblocking()).unwrap_or(Err(libc::ECONNRESET));
        }
        if tx.shut {
            return Err(libc::EPIPE);
        }
        if self.p_writes_switch() {
            self.p_switch_writes(&mut tx)?;
            drop(tx);
            self.watch_out();
            // Behind an exec's resend still queued.
            if let Some(r) = self.write_behind_out(iov, nonblocking.nonblocking()) {
                return r;
            }
            return self.write_kernel(iov, nonblocking.nonblocking());
        }
        crate::pause::at(crate::pause::Point::RingWrite);
        if self.peer_closed() {
            // As TCP after the peer's close: the first write is taken
            // (its bytes are lost with the peer, which answers with a
            // reset), the next ones fail.
            if tx.reset {
                return Err(libc::EPIPE);
            }
            tx.reset = true;
            return Ok(total);
        }
        self.reap()?;
        let mut done = 0usize;
        let (mut vi, mut voff) = (0usize, 0usize);
        while done < total {
            let free = self.credits(tx.wr, nonblocking)?;
            if free == DEMOTING {
                // Left its wait for a demotion: the rest goes the
                // demoted way (a short write, or all of it).
                if done > 0 {
                    return Ok(done);
                }
                drop(tx);
                return self.write(iov, nonblocking);
            }
            if free == 0 {
                // The ring is full (a non-blocking write): the program
                // waits for writability; epoll must not report it until
                // credits come back, and must report it then, also
                // edge-triggered ([`crate::epoll`]).
                self.write_blocked_now();
                crate::progress::watch(self);
                // A sound when credits come back (the progress thread
                // gives EPOLLOUT back then), and credits that came back
                // meanwhile (after the ask landed).
                let _ = self.ask_credits();
                let _ = self.still_blocked();
                break;
            }
            // A tail slot (and send-queue room) for this write.
            self.wait_until(|p| p.pending.len() < IN_FLIGHT)?;
            let pos = (tx.wr % RING as u64) as usize;
            let n = free.min(total - done).min(RING - pos);
            // Same host: straight from the caller's buffer into the peer's
            // ring where the direct path takes it (one copy, not two).
            let direct = self.write_direct(iov, vi, voff, n, pos)?;
            // Else gather into the staging region at the ring offset.
            let stage = self.stage.as_ptr();
            let mut put = if direct { n } else { 0 };
            if direct {
                advance(iov, &mut vi, &mut voff, n);
            }
            while put < n {
                let (p, len) = iov[vi];
                let k = (len - voff).min(n - put);
                // SAFETY: `p + voff .. + k` is in the caller's buffer;
                // `pos + put + k <= RING` is in the staging region, which
                // the daemon only reads, and whose bytes there belong to
                // ring bytes the reader consumed (credits), so their write
                // completed before it.
                unsafe { std::ptr::copy_nonoverlapping(p.add(voff), stage.add(pos + put), k) };
                put += k;
                voff += k;
                if voff == len {
                    vi += 1;
                    voff = 0;
                }
            }
            let tail_at = S_TAILS + 8 * (tx.posts % TAIL_SLOTS as u64) as usize;
            let end = tx.wr + n as u64;
            let _ = self.stage.write_u64(tail_at, end);
            let tail = self.stage.sge(tail_at, 8).map_err(|e| e.errno())?;
            let tail = wr::rdma_write(0, &[tail], self.peer_addr + WRITTEN as u64, self.peer_rkey)
                .map_err(|e| e.errno())?
                .signaled();
            // (A work request is a few hundred bytes: the data's is made
            // only where the direct path did not take the bytes.)
            if direct {
                self.post(&mut [tail], Some(end))?;
            } else {
                let data = self.stage.sge(pos, n).map_err(|e| e.errno())?;
                let data = wr::rdma_write(0, &[data], self.peer_addr + pos as u64, self.peer_rkey)
                    .map_err(|e| e.errno())?;
                self.post(&mut [data, tail], Some(end))?;
            }
            self.writes.fetch_add(1, Ordering::Relaxed);
            if direct {
                self.direct_writes.fetch_add(1, Ordering::Relaxed);
            }
            tx.posts += 1;
            tx.wr = end;
            self.wr_now.store(end, Ordering::Release);
            done += n;
        }
        if done == 0 && total > 0 {
            return Err(libc::EAGAIN);
        }
        // Look once: a completion that is there already wakes the reader
        // now; the rest are the progress thread's unless this connection
        // is called again first.
        let _ = self.reap();
        if self.needs_watch() {
            crate::progress::watch(self);
        }
        Ok(done)
    }

    /// Writes the `n` bytes of `iov` from entry `vi`, offset `voff`, to the
    /// peer's ring at `pos` with the direct path, if it takes them now
    /// (`false`: nothing written; they go through the staging region).
    /// At most [`DIRECT_PIECES`] pieces of the caller's vector at once.
    fn write_direct(
        &self,
        iov: &[(*const u8, usize)],
        vi: usize,
        voff: usize,
        n: usize,
        pos: usize,
    ) -> Res<bool> {
        let mut pieces: [&[u8]; DIRECT_PIECES] = [&[]; DIRECT_PIECES];
        let (mut k, mut left, mut off) = (0, n, voff);
        for &(p, len) in &iov[vi..] {
            if left == 0 {
                break;
            }
            let take = (len - off).min(left);
            if take == 0 {
                // An empty entry (perhaps a null one): no piece, and no
                // slice of its pointer.
                off = 0;
                continue;
            }
            if k == DIRECT_PIECES {
                return Ok(false);
            }
            // SAFETY: the caller's buffer: `p .. p + len` is readable for
            // the call (the staging path reads the same bytes), and
            // `off + take <= len`.
            pieces[k] = unsafe { std::slice::from_raw_parts(p.add(off), take) };
            k += 1;
            left -= take;
            off = 0;
        }
        self.qp.write_now(&pieces[..k], self.peer_addr + pos as u64, self.peer_rkey).map_err(|e| e.errno())
    }

    /// Sends the armed generation as a wake byte, once, if the reader
    /// armed before it had read every byte below `landed` (all landed).
    /// A reader that armed having read them all needs no byte for them:
    /// the word stays armed for the next write that lands (a byte sent
    /// for bytes already read is a readiness with an empty ring, and a
    /// blocking read after it waits: `docs/sockets.md`).
    fn wake(&self, landed: u64) {
        let word = self.ring.as_ptr().wrapping_add(SLEEPING);
        // SAFETY: `SLEEPING` is an 8-aligned offset inside the ring region
        // (whose mapping is page-aligned and lives as long as `self`); the
        // daemon writes the word (the peer's arming) only with aligned
        // 8-byte stores, so an atomic view of it is right.
        let word = unsafe { std::sync::atomic::AtomicU64::from_ptr(word.cast()) };
        let w = word.load(Ordering::SeqCst);
        let Some((rd, g)) = parse_armed(w) else { return };
        if !needs_wake(rd, landed) {
            return;
        }
        if word.compare_exchange(w, 0, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            self.wakes.fetch_add(1, Ordering::Relaxed);
            let b = [g];
            // SAFETY: `b` is valid for one byte.
            unsafe { real::send(self.sock, b.as_ptr().cast(), 1, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
        }
    }

    /// Room in the peer's ring; waits for some unless `nonblocking`.
    /// While waiting, a probe write every 100 ms finds a peer that is gone.
    fn credits(self: &Arc<Self>, wr: u64, nonblocking: &Blocking) -> Res<usize> {
        // Most writes find room at once: then no clock is read and the
        // descriptor is not asked whether it blocks.
        let consumed = self.ring.read_u64(CONSUMED).unwrap_or(0);
        let used = wr.saturating_sub(consumed) as usize;
        if used < RING {
            return Ok(RING - used);
        }
        let nonblocking = nonblocking.nonblocking();
        let start = Instant::now();
        let mut probe = start;
        let mut spins = 0u32;
        loop {
            // A demotion (as the driver or as its peer) ends the wait.
            if self.d_state() == crate::owner::D_DEMOTING || self.p_writes_switch() {
                return Ok(DEMOTING);
            }
            // Read before the look: answers that come after it end the wait.
            let seen = crate::credit::seq();
            let consumed = self.ring.read_u64(CONSUMED).unwrap_or(0);
            let used = wr.saturating_sub(consumed) as usize;
            if used < RING {
                return Ok(RING - used);
            }
            // A peer that closed gives no more credits.
            if self.peer_closed() {
                return Err(libc::EPIPE);
            }
            // The reader may be asleep until the bytes in flight wake it.
            self.reap()?;
            if nonblocking {
                // One more look after a yield, so that a program that
                // polls for POLLOUT (which the kernel socket always has)
                // and writes again lets the reader run between tries
                // rather than spinning on EAGAIN.
                if spins > 0 {
                    // A peer that is gone (its kernel reset the socket)
                    // gives no more credits: EPIPE, not EAGAIN for ever.
                    let mut b = [0u8; 1];
                    // SAFETY: `b` is valid for one byte; a peek takes nothing.
                    let r = unsafe {
                        real::recv(self.sock, b.as_mut_ptr().cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT)
                    };
                    if r < 0 && matches!(crate::table::errno(), libc::ECONNRESET | libc::EPIPE) {
                        return Err(libc::EPIPE);
                    }
                    return Ok(0);
                }
                spins += 1;
                std::thread::yield_now();
                continue;
            }
            spins += 1;
            if spins > 64 {
                // Asked for a sound before this look: wait for it (until
                // the next probe at most); asked now: look once more
                // first; no sound to come: look again in a while.
                match self.ask_credits() {
                    Ask::Pending => {
                        self.waits.fetch_add(1, Ordering::Relaxed);
                        let max = PROBE.saturating_sub(probe.elapsed()).min(WAIT_MAX);
                        let answered = crate::credit::wait(seen, max);
                        let consumed = self.ring.read_u64(CONSUMED).unwrap_or(0);
                        if answered {
                            self.woken.fetch_add(1, Ordering::Relaxed);
                        } else if (wr.saturating_sub(consumed) as usize) < RING {
                            self.missed.fetch_add(1, Ordering::Relaxed);
                            // An answer that came without being taken
                            // (no event seen) would keep this end from
                            // asking again: taken here.
                            self.take_answers();
                        }
                    }
                    Ask::Sent => {}
                    Ask::No => std::thread::sleep(Duration::from_micros(50)),
                }
            } else {
                std::thread::yield_now();
            }
            if probe.elapsed() > PROBE {
                probe = Instant::now();
                let _ = self.stage.write_u64(S_PROBE, wr);
                self.write_word(S_PROBE, 8, WRITTEN)?;
            }
        }
    }

    /// `shutdown(SHUT_WR)`: waits until every write has landed (and its
    /// wake byte is sent), so that the kernel's FIN comes after the last
    /// byte.
    ///
    /// Whether the kernel socket's `SHUT_WR` must wait: an exec's resend
    /// is still queued ([`outq`]); the FIN goes once it is sent.
    pub fn shut_write(&self) -> bool {
        if self.shut_demoted() {
            return self.shut_behind_out();
        }
        let mut tx = self.tx.lock();
        // Demoted while this waited for the send lock (the driver's count
        // and marker went): as above. A demotion that only began
        // (`D_DEMOTING`) has not had the send lock yet: this shut goes
        // first, and the driver, finding `tx.shut`, sends no marker (the
        // peer reads the ring up to the count, then the end). Taking it
        // as demoted let the kernel's FIN go ahead of the marker, whose
        // send then failed and the demotion with it (review, 2026-11-28).
        if self.shut_demoted() {
            drop(tx);
            return self.shut_behind_out();
        }
        let _ = self.flush();
        tx.shut = true;
        false
    }

    /// Before the last descriptor closes: every write lands first (as
    /// for `shutdown`), then the wake bytes still queued are read off, so
    /// that the kernel sends FIN, not RST.
    ///
    /// Then the peer is told of the close (`CLOSED`, waited for: it lands
    /// before this end's QP goes), so that its reads end at once, as at
    /// a FIN, instead of arming towards a QP that is gone, which waits
    /// for the QP's retry timeout. A peer that closed first is not told.
    pub fn finish(&self) {
        if self.in_demotion() {
            // Its stream goes on (or ends) over the kernel socket.
            self.close_in_demotion();
            self.unblock();
            return;
        }
        // The demoting peer's marker (its `DEMOTE` word came, this end
        // never wrote since): taken off before the wake bytes.
        self.p_take_mark_at_close();
        let _ = self.flush();
        if !self.peer_closed() {
            let _ = self.stage.write_u64(S_CLOSE, 1);
            if self.write_word(S_CLOSE, 8, CLOSED).is_ok() {
                // A writer waiting for credits learns of the close now.
                self.answer_want(&mut lock(&self.post));
                let _ = self.flush_sends();
            }
        }
        let _ = self.drain_wakes();
        self.unmap_all();
        // A program still waiting on it through another thread is told.
        self.unblock();
        crate::dev::debug(&format!(
            "credit waits {}, woken {}, missed {}, late {}",
            self.waits.load(Ordering::Relaxed),
            self.woken.load(Ordering::Relaxed),
            self.missed.load(Ordering::Relaxed),
            self.late.load(Ordering::Relaxed)
        ));
        crate::dev::debug(&format!(
            "armings {}, wake bytes sent {}",
            self.armings.load(Ordering::Relaxed),
            self.wakes.load(Ordering::Relaxed)
        ));
        crate::dev::debug(&format!(
            "ring writes {}, from the caller's buffer {}",
            self.writes.load(Ordering::Relaxed),
            self.direct_writes.load(Ordering::Relaxed)
        ));
        let io = self.iowrites.load(Ordering::Relaxed);
        if io > 0 {
            crate::dev::debug(&format!(
                "riowrites {io}, pieces from the caller's buffer {}",
                self.io_direct.load(Ordering::Relaxed)
            ));
        }
        crate::dev::debug(&format!(
            "readiness calls without a timeout that yielded (this process) {}",
            crate::readiness::SPIN_YIELDS.load(Ordering::Relaxed)
        ));
    }
}

/// The total length of a program's I/O vector, given each entry's
/// (null, length), as the kernel checks it: `EFAULT` for a null buffer of
/// some length, `EINVAL` for a total above `ssize_t`'s range.
fn vector_len(iov: impl Iterator<Item = (bool, usize)>) -> Res<usize> {
    let mut total = 0usize;
    for (null, n) in iov {
        if null && n > 0 {
            return Err(libc::EFAULT);
        }
        total = total.checked_add(n).filter(|&t| t <= isize::MAX as usize).ok_or(libc::EINVAL)?;
    }
    Ok(total)
}

/// Moves `(vi, voff)` `n` bytes further along `iov`, as the staging
/// loop of [`Link::write`] does while it copies.
fn advance(iov: &[(*const u8, usize)], vi: &mut usize, voff: &mut usize, n: usize) {
    let mut put = 0;
    while put < n {
        let len = iov[*vi].1;
        let k = (len - *voff).min(n - put);
        put += k;
        *voff += k;
        if *voff == len {
            *vi += 1;
            *voff = 0;
        }
    }
}

/// The reader's arming as one word (so that the writer reads both at
/// once): the consumed count when it armed, in the high 56 bits, and the
/// generation (1..=255) in the low byte. 0: not armed.
fn armed_word(rd: u64, gen: u32) -> u64 {
    ((rd & RD_MASK) << 8) | u64::from(gen as u8)
}

const RD_MASK: u64 = (1 << 56) - 1;

/// The consumed count (low 56 bits) and the generation of an armed word;
/// `None` when not armed.
fn parse_armed(w: u64) -> Option<(u64, u8)> {
    let g = (w & 0xff) as u8;
    (g != 0).then_some((w >> 8, g))
}

/// Whether a reader that armed having consumed `rd` (low 56 bits) needs a
/// wake byte for bytes landed below `landed`: only if some of them were
/// not read when it armed. A reader can be ahead of `landed` (it reads
/// bytes whose completion the writer did not reap yet).
fn needs_wake(rd: u64, landed: u64) -> bool {
    let ahead = (landed & RD_MASK).wrapping_sub(rd) & RD_MASK;
    ahead != 0 && ahead < (1 << 55)
}

/// What a ring writer does once it holds the send lock.
#[derive(Debug, PartialEq, Eq)]
enum Recheck {
    /// No demotion of this end: the ring.
    Ring,
    /// A demotion of this end began (the driver held the lock meanwhile,
    /// and its marker may have gone): no ring byte any more.
    Demoted,
}

/// The check every ring writer (`write`, `iowrite`; `shutdown` looks at [`Link::shut_demoted`] instead) makes
/// again once it holds the send lock: its first look at the demotion
/// state came before it waited for the lock, which the demoting driver
/// holds while it sends its count and marker.
fn after_send_lock(d_state: u32) -> Recheck {
    if d_state == crate::owner::D_NONE {
        Recheck::Ring
    } else {
        Recheck::Demoted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_writer_that_got_the_send_lock_after_a_demotion_leaves_the_ring() {
        use crate::owner::{D_DEMOTED, D_DEMOTING, D_DONE, D_FAILED, D_NONE};
        assert_eq!(after_send_lock(D_NONE), Recheck::Ring);
        for s in [D_DEMOTING, D_DEMOTED, D_DONE, D_FAILED] {
            assert_eq!(after_send_lock(s), Recheck::Demoted);
        }
    }

    #[test]
    fn a_shutdown_that_got_the_send_lock_as_a_demotion_began_shuts_the_ring() {
        use crate::owner::{D_DEMOTED, D_DEMOTING, D_DONE, D_FAILED, D_NONE};
        use demote::shut_goes_to_the_kernel as kernel;
        // Begun, not sent: the shut goes first (FIN after the ring's last
        // byte, and the driver sends no marker).
        assert!(!kernel(D_NONE, false) && !kernel(D_DEMOTING, false));
        for s in [D_DEMOTED, D_DONE, D_FAILED] {
            assert!(kernel(s, false));
        }
        assert!(kernel(D_NONE, true) && kernel(D_DEMOTING, true));
    }

    #[test]
    fn a_vectors_length_is_checked_as_the_kernel_checks_it() {
        assert_eq!(vector_len([(false, 3), (true, 0), (false, 4)].into_iter()), Ok(7));
        assert_eq!(vector_len([(false, 3), (true, 1)].into_iter()), Err(libc::EFAULT));
        assert_eq!(vector_len([(false, usize::MAX), (false, 1)].into_iter()), Err(libc::EINVAL));
        assert_eq!(vector_len([(false, isize::MAX as usize + 1)].into_iter()), Err(libc::EINVAL));
    }

    #[test]
    fn an_arming_that_read_every_landed_byte_gets_no_wake_byte() {
        let w = armed_word(4096, 7);
        assert_eq!(parse_armed(w), Some((4096, 7)));
        // The reader drained the write's bytes and re-armed before the
        // writer reaped its completion: no byte (it would read ready with
        // an empty ring).
        assert!(!needs_wake(4096, 4096));
        // It read past what the writer reaped so far.
        assert!(!needs_wake(8192, 4096));
        // It armed before these bytes: they wait, the byte is due.
        assert!(needs_wake(4096, 4097));
        assert!(needs_wake(0, 1));
        assert_eq!(parse_armed(0), None);
        assert_eq!(parse_armed(armed_word(0, 1)), Some((0, 1)));
        // Near the 56-bit wrap.
        assert!(needs_wake(RD_MASK, RD_MASK + 2));
        assert!(!needs_wake(1, RD_MASK + 2));
    }
}
