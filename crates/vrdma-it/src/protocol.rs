//! What the test process and a tenant peer say to each other.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hello {
    pub endpoint: vrdma::Endpoint,
    pub addr: u64,
    pub rkey: u32,
    pub pid: u32,
    /// The tenant the daemon placed the peer in (its uid).
    pub tenant: u32,
    /// Bytes of the peer's memory region (`--mr-len`, 4 MiB by default).
    pub mr_len: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Command {
    Connect {
        peer: vrdma::Endpoint,
    },
    /// `Connect` with the transport timer `timeout` (4.096 µs × 2^timeout
    /// per try) instead of the library's default 14 (67 ms).
    ConnectTimeout {
        peer: vrdma::Endpoint,
        timeout: u8,
    },
    /// Moves the peer's QP to RESET, ready to `Connect` again.
    Reset,
    /// Posts `count` receives (wr_id 0, 1, ...), each of `[offset, +len)`.
    PostRecv {
        count: usize,
        offset: usize,
        len: usize,
    },
    Fill {
        offset: usize,
        data: Vec<u8>,
    },
    Read {
        offset: usize,
        len: usize,
    },
    /// [`digest`] of `[offset, +len)` of the peer's region.
    Digest {
        offset: usize,
        len: usize,
    },
    Send {
        wr_id: u64,
        offset: usize,
        len: usize,
        imm: Option<u32>,
    },
    Flood {
        remote_addr: u64,
        rkey: u32,
        len: usize,
        count: u64,
    },
    /// Like `Flood`, with sends of `len` bytes (consuming receives).
    FloodSend {
        len: usize,
        count: u64,
    },
    /// Like `FloodSend`, each send with its sequence number (0, 1, ...)
    /// as its immediate, so that the receiver can check once and in order.
    FloodSendSeq {
        len: usize,
        count: u64,
    },
    /// How many of the QP's work requests the library carried on the
    /// direct path (`QueuePair::direct_stats`): `Carried`.
    Carried,
    Poll {
        count: usize,
        timeout_ms: u64,
    },
    /// Waits for one completion and reads `[offset, +len)` at once, so the
    /// bytes are those visible when the completion arrived.
    PollThenRead {
        timeout_ms: u64,
        offset: usize,
        len: usize,
    },
    /// Creates objects of every kind until the daemon refuses one; answers
    /// `Hoarded` and keeps them until the process ends.
    Hoard,
    State,
    /// Creates `count` more QPs, each connected to itself and left idle.
    IdleQps {
        count: u32,
    },
    /// Breaks the shared-memory protocol as `how` says, from a thread,
    /// for `millis` (answers at once).
    Misbehave {
        how: Misbehavior,
        millis: u64,
    },
    /// Streams RDMA writes of `len` bytes over `qps` new QPs, each
    /// connected to itself, 16 in flight on each, for `millis`: says
    /// `Flooding` once they are posted, then `Streamed` with the bytes
    /// completed (a hog, as `vrdma bench`'s, but one that sleeps 0.5 ms
    /// between polls of its CQ rather than spin).
    Stream {
        qps: u32,
        len: usize,
        millis: u64,
    },
    /// [`Command::Stream`], but each QP connected to a QP of its own on
    /// the daemon at the socket `to` (another host's), where the writes
    /// land.
    StreamTo {
        qps: u32,
        len: usize,
        millis: u64,
        to: std::path::PathBuf,
    },
    /// Opens a second context (as the drop-in `librdmacm.so.1` does
    /// beside the program's `libibverbs.so.1`), makes an rdma_cm id on it
    /// with its address resolved to 127.0.0.1, and attaches a new QP of
    /// the first context to it: `State` (INIT) or the daemon's refusal.
    AttachAcrossContexts,
    /// From a thread: `count` messages to the connected peer, each
    /// carrying its sequence number as immediate data (even ones sends
    /// with immediate, whose first 8 bytes are the number too; odd ones
    /// RDMA writes with immediate of `len` bytes to `remote_addr + seq *
    /// len`), one every `pace_us`, at most 16 in flight, the CQ polled
    /// between them; a `query_every`-th one also queries the QP (a call
    /// that needs the daemon). Each post and poll holds the guest's
    /// "vCPU" (see [`Command::Freeze`]). Answers at once; the result
    /// comes with [`Command::SeqStreamWait`]: every completion, in the
    /// order polled. After a failed completion, or a query that finds the
    /// QP out of RTS, it posts no more and waits (at most 10 s) for the
    /// completions of what it posted (flushed), so a stream that failed
    /// shows how: the caller checks the statuses and the count.
    SeqStream {
        count: u64,
        len: usize,
        remote_addr: u64,
        rkey: u32,
        pace_us: u64,
        query_every: u64,
    },
    /// Queries the QP (a call that needs the daemon): `State`, or the error.
    Query,
    /// The context's next async event within `timeout_ms`: `Event` with
    /// its type's number (`None`: none came), or the error.
    AsyncEvent {
        timeout_ms: u64,
    },
    /// Waits for the `SeqStream` thread: its completions, in the order
    /// polled, or its error.
    SeqStreamWait,
    /// An emulated guest's VM stops: no post or poll of `SeqStream` runs
    /// until [`Command::Thaw`] (what QEMU's last pass needs: the region
    /// copied while the guest writes nothing).
    Freeze,
    Thaw,
    /// An emulated guest's VM resumes on another host (what QEMU does to
    /// the guest's memory): every mapping of the BAR (descriptor 100) now
    /// maps the region inherited as descriptor `to_fd` at the same
    /// offsets, and descriptor 100 is that region.
    MoveBar {
        to_fd: i32,
    },
    /// Arms the CQ for its next completion (`ibv_req_notify_cq`; the peer
    /// started with `--channel`, whose CQ has a completion channel).
    ArmCq {
        solicited_only: bool,
    },
    /// The channel's next event within `timeout_ms`
    /// (`ibv_get_cq_event`): `Event` with the CQ's number, or `None`.
    CqEvent {
        timeout_ms: u64,
    },
    /// Whether the channel's fd turns readable within `timeout_ms`
    /// (`poll(2)`, taking nothing): `Readable`.
    ChannelReadable {
        timeout_ms: u64,
    },
    /// Connects the peer's QP through rdma_cm (a channel and an id of
    /// its context, as rping does): resolves `to`, attaches the QP (in
    /// RESET: no `Connect` before), connects and waits for ESTABLISHED
    /// (`Ok`), or the error.
    CmConnect {
        to: std::net::SocketAddrV4,
    },
    /// The rdma_cm channel's next event within `timeout_ms`
    /// (`rdma_get_cm_event`): `CmEvent`.
    CmEvent {
        timeout_ms: u64,
    },
    /// Whether the rdma_cm channel's fd turns readable within
    /// `timeout_ms` (`poll(2)`, taking nothing): `Readable`.
    CmReadable {
        timeout_ms: u64,
    },
    /// Listens through rdma_cm on `at` (a channel and an id of its
    /// context): `Ok`, or the error.
    CmListen {
        at: std::net::SocketAddrV4,
    },
    Exit,
    /// `vrdma stat` of the peer's context (`Context::stat`): `Stat`.
    Stat,
}

/// What a hostile tenant does to the memory it shares with the daemon
/// (see `vrdma::Context::misbehave`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Misbehavior {
    /// Keeps its posted-QP ring's overflow flag set (every 50 µs).
    Overflow,
    /// Names its idle QPs in its posted-QP ring as fast as the engine
    /// takes them, without posting anything.
    NameIdle,
    /// Writes garbage into its posted-QP ring's indices, once.
    Scribble,
    /// Rings its doorbell in bursts of 64 (more than the engine reads of
    /// one tenant per wake-up), every 500 µs.
    Doorbells,
}

/// A completion as the peer reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wc {
    pub wr_id: u64,
    pub status: u8,
    pub opcode: u8,
    pub byte_len: u32,
    pub imm: Option<u32>,
    pub src_qp: u32,
}

impl From<&vrdma::WorkCompletion> for Wc {
    fn from(w: &vrdma::WorkCompletion) -> Wc {
        Wc {
            wr_id: w.wr_id,
            status: w.status.raw(),
            opcode: w.opcode.raw(),
            byte_len: w.byte_len,
            imm: w.wc_flags.contains(vrdma::WcFlags::WITH_IMM).then_some(w.imm_data),
            src_qp: w.src_qp,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Said {
    Hello(Hello),
    Ok,
    Flooding,
    Bytes(Vec<u8>),
    Digest(u64),
    Completions(Vec<Wc>),
    /// A completion and the bytes read right after it.
    CompletionThenBytes(Wc, Vec<u8>),
    /// Objects created by `Hoard` (by kind), and the errno of the refusal
    /// that stopped it.
    Hoarded {
        kinds: Vec<String>,
        errno: i32,
        message: String,
    },
    State(u8),
    /// The answer to `Carried`.
    Carried(u64),
    /// An async event's type (`vrdma::AsyncEventType` as a number), if one came.
    Event(Option<u32>),
    /// Whether the channel's fd was readable (`ChannelReadable`).
    Readable(bool),
    /// Bytes a `Stream` completed, over how long (µs).
    Streamed {
        bytes: u64,
        micros: u64,
    },
    Error {
        errno: i32,
        message: String,
    },
    /// An rdma_cm event (`CmEvent`): its kind (`enum rdma_cm_event_type`)
    /// and status, or `None` if none came.
    Cm(Option<(u32, i32)>),
    /// The answer to `Stat`.
    Stat(Box<vrdma_core::hca::StatReport>),
}

/// FNV-1a over `bytes`: a cheap digest to compare large buffers across
/// processes without shipping them.
pub fn digest(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}
