//! One authenticated link, driven by the engine thread: frames in from a
//! non-blocking socket into the core, frames out of the core into it.
//!
//! Payloads move between the socket and tenant memory with `readv` and
//! `writev` on the mapped regions themselves. Reads go through a small
//! buffer only while a header is awaited, so that a stream of small frames
//! (ACKs, short sends) costs one system call for many frames. A payload is
//! read straight into its region, together with the next header: in a
//! stream of large frames one `readv` per frame, and of each payload only
//! the few bytes that came in with its header pass through the buffer (at
//! most 4 KiB after an idle link or small frames).
//!
//! A TCP link is one ordered stream: a latency-class tenant's 8-byte
//! frame waits for every byte written before it, in the daemon's queue,
//! in the kernel's send buffer, in flight and in the peer's receive
//! buffer, which autotuning grows to megabytes. While such a tenant is
//! active on the link the core sends its frames first and cuts the
//! others' (`hca::remote`), and this side bounds each of those queues to
//! `net.max_queued_kib` (see [`DEFAULT_MAX_QUEUED_KIB`]), for
//! [`BOUND_LINGER`] after the tenant was last active, so that one slow
//! round trip does not let the kernel's buffers fill again. In the
//! daemon's own queue that tenant's frame goes ahead of the others'
//! (`net.latency_first`), behind the frame being written: it waits there
//! for one frame, not for the queue. What waits ahead of such a frame at
//! each stage is sampled into the link's `LinkQueues` (`vrdma stat`,
//! `vrdma bench-hosts --qos`).

use std::collections::VecDeque;
use std::io::{ErrorKind, Read};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant as Clock};

use arrayvec::ArrayVec;
use vrdma_core::hca::{Hca, IoSeg, LinkId, LinkQueues, Sampled, Sink, Transmit};
use vrdma_core::memory::Region;
use vrdma_core::ring::MAX_SGE;
use vrdma_core::time::Instant;
use vrdma_core::wire::{CloseReason, CloseRepr, Event, FrameDecoder, FrameRepr, KeepaliveRepr, Want};

use crate::engine::RingTable;

/// Bytes read at once while a header is awaited.
const READ_BUF: usize = 4096;
/// Frames handled per link per engine pass, so one busy link cannot
/// starve the others or the shared-memory queues.
const FRAMES_PER_PASS: usize = 64;
/// Bytes taken from the core ahead of the socket, all of them written with
/// one `writev`. Each call pays for locking the socket, pushing what it
/// queued and taking in the ACKs that came meanwhile, so on a link that
/// has the CPU of its sending engine as its limit larger writes carry more:
/// with 4 QPs on a 16-core host, 128 KiB gave 27–28 Gbit/s and 512 KiB
/// 32–34 (runs interleaved), 1 MiB no more. Not larger, so that the
/// core's turn-taking between QPs is not undone by a deep queue here: a
/// frame posted meanwhile waits behind at most this much (about 0.1 ms at
/// 40 Gbit/s, less than what the socket's own buffer may hold).
const TX_AHEAD: usize = 512 << 10;
const TX_FRAMES_AHEAD: usize = 32;
/// The default of `net.max_queued_kib`: while a latency-class tenant is
/// active on a link (it sent within the core's `LATENCY_WINDOW`), the
/// bytes queued ahead of its next frame are bounded by this: in the
/// daemon's own queue (rather than `TX_AHEAD`), unsent in the kernel
/// (`TCP_NOTSENT_LOWAT`), in flight towards us (`TCP_WINDOW_CLAMP`, our
/// receive window) and read per pass. Otherwise nothing changes, so a bulk
/// tenant alone keeps its throughput whatever this is.
///
/// Chosen by `vrdma bench-hosts --qos --net max_queued_kib=N` on the
/// 2-core machine (2026-11-26, release build, 3 runs each, other builds
/// running): the protected victim's median beside the 64-QP hog was
/// 1.2-2.2 ms at 128 KiB, 1.6-4.1 ms at 32 KiB and 22 ms at 1 MiB (5-15 ms
/// without the class in every run); smaller bought nothing measurable
/// there, and each KiB less is a write and a wake-up more per KiB moved.
pub const DEFAULT_MAX_QUEUED_KIB: u32 = 128;

/// How long the bounds of [`DEFAULT_MAX_QUEUED_KIB`] hold after the core
/// last said a latency-class tenant was active on the link (it sent there
/// within `LATENCY_WINDOW`, 10 ms). Without it a victim whose round trip
/// once took longer than the window (its frame behind what the kernel
/// took in while unbounded) let the bounds lapse on both hosts; the hog
/// then filled the kernel's buffers again (megabytes: 3 MB on average,
/// up to 26, waited in the receiver's socket as its passes began, on the
/// 2-core machine), and the victim's next frame waited behind them: a
/// cycle of round trips of tens of milliseconds. A hog alone keeps its
/// throughput once the victim has been idle this long.
const BOUND_LINGER: Duration = Duration::from_millis(100);

/// While a latency-class tenant is active, one pass in this many samples
/// the queues ahead of its next frame (three `ioctl`s a sampled pass),
/// and one of its frames in this many the kernel's queue ahead of it
/// (one `ioctl`: [`count_latency_frame`]).
const SAMPLE_EVERY: u32 = 8;

/// Counts a latency-class frame handed to the driver with `ahead` bytes
/// ahead of it in the daemon's queue, and samples the kernel's queue
/// (`kernel`, an `ioctl`) for one such frame in [`SAMPLE_EVERY`]: the
/// link's first, then every [`SAMPLE_EVERY`]th. The victim's frames are
/// small and many; a system call each would cost it more than the
/// figure is worth. The same rate as the passes' samples, for the same
/// reason; the count of samples is kept beside their sum, so the mean is
/// over the sampled frames.
fn count_latency_frame(q: &mut LinkQueues, ahead: u64, kernel: impl FnOnce() -> Option<u64>) {
    if q.latency_frames.is_multiple_of(u64::from(SAMPLE_EVERY)) {
        q.ahead_kernel_samples += 1;
        q.ahead_kernel.add(kernel().unwrap_or(0));
    }
    q.latency_frames += 1;
    q.ahead_daemon.add(ahead);
}

/// `ioctl`s of a TCP socket (linux/sockios.h): bytes not yet acknowledged
/// by the peer (unsent and in flight), and bytes not yet sent.
const SIOCOUTQ: libc::c_ulong = 0x5411;
const SIOCOUTQNSD: libc::c_ulong = 0x894B;

/// An `ioctl` of `fd` that reads an int (bytes queued), if it succeeds.
fn queued_bytes(fd: std::os::fd::RawFd, req: libc::c_ulong) -> Option<u64> {
    let mut v: libc::c_int = 0;
    // SAFETY: each request used here writes one int at the pointer, which
    // is valid for writes for the call.
    let r = unsafe { libc::ioctl(fd, req as _, &mut v as *mut libc::c_int) };
    (r == 0 && v >= 0).then_some(v as u64)
}

/// Bytes read after a large payload: a data header and no more, so that
/// in a stream of large frames each one's payload is read straight into
/// its region rather than its first 4 KiB through the header buffer.
const TAIL_AFTER_LARGE: usize = vrdma_core::wire::MAX_DATA_HEADER_LEN;
/// iovecs per `writev`/`readv`.
const IOV_MAX: usize = 64;

/// What goes on the wire in place of the bytes of a revoked region whose
/// queued payload was not kept (`LinkIo::keep_payloads`; a bug, logged):
/// the frame's header may be out, so a payload must follow, but never from
/// memory the tenant may have reused.
static ZEROS: [u8; vrdma_core::wire::MAX_CHUNK as usize] = [0; vrdma_core::wire::MAX_CHUNK as usize];

// One per link, reused for every frame.
#[allow(clippy::large_enum_variant)]
enum RxSink {
    Place { segs: ArrayVec<IoSeg, MAX_SGE>, done: usize },
    Discard,
}

pub struct LinkIo {
    pub id: LinkId,
    pub peer: std::net::SocketAddr,
    /// The peer daemon's GID, from its Hello.
    pub gid: vrdma_core::verbs::Gid,
    /// The peer daemon's id (new at each start), from its Hello.
    pub daemon_id: u64,
    /// This daemon dialled the connection (it did not accept it).
    pub dialled: bool,
    /// The peer's address vouches for its GID
    /// ([`vrdma_core::hca::LinkInfo::verified`]); set by [`super::Net::add`].
    pub verified: bool,
    /// Its connection left from this daemon's GID address (where it was
    /// dialled): the peer counts it verified, and makes no check-dial back.
    pub from_our_gid: bool,
    /// An unverified link whose peer's GID's address was dialled once, to
    /// check it (see [`super::Net::add`]): no more dials for it.
    pub checked: bool,
    sock: TcpStream,
    dec: FrameDecoder,
    rbuf: Box<[u8; READ_BUF]>,
    rstart: usize,
    rend: usize,
    /// The last read returned less than it asked for: the socket was
    /// empty then, so this pass reads no more (a read that would only say
    /// EAGAIN costs as much as one that brings data).
    drained: bool,
    sink: Option<RxSink>,
    /// Payload bytes placed by copying them out of the header buffer (they
    /// came in with a header), and straight from the socket by `readv`.
    placed_from_buffer: u64,
    placed_direct: u64,
    /// The last data frame's payload was large: the next header is read
    /// with no more than a header's worth after it, so that the payload
    /// behind it goes straight to its region too.
    after_large: bool,
    /// A region the current payload was going to was deregistered: the
    /// rest is discarded, and the core told so at the frame's end.
    lost: bool,
    txq: VecDeque<Transmit>,
    /// Bytes of `txq[0]` already written.
    tx_off: usize,
    /// The socket refused more: wait for POLLOUT.
    pub want_write: bool,
    /// Since when the socket has taken no byte of what is queued; a link
    /// whose peer reads nothing for the dead time ends.
    stalled_since: Option<Clock>,
    /// Bytes kept queued ahead of the next frame while a latency-class
    /// tenant is active on the link (see [`DEFAULT_MAX_QUEUED_KIB`]).
    max_queued: usize,
    /// Whether that bound holds now (the socket's `TCP_NOTSENT_LOWAT` and
    /// `TCP_WINDOW_CLAMP` are set to it).
    bounded: bool,
    /// Since when the daemon's queue for the link is held at that bound
    /// (it stopped taking frames from the core because of it), and the
    /// time it was held so, in ns, for the metrics.
    capped_since: Option<Instant>,
    capped_ns: u64,
    /// Passes of `receive` and `transmit` while bounded, for sampling
    /// one in [`SAMPLE_EVERY`] (see [`vrdma_core::hca::LinkQueues`]).
    rx_passes: u32,
    tx_passes: u32,
    /// When the core last said a latency-class tenant was active on the
    /// link (see [`BOUND_LINGER`]).
    active_at: Option<Instant>,
    /// `net.latency_first` (see [`Self::set_latency_first`]).
    latency_first: bool,
    /// When each latency-class frame in `txq` was queued, in their order
    /// (they keep it among themselves).
    latency_marks: VecDeque<Clock>,
    /// Their waits since the core last took them.
    latency_waits: Sampled,
    /// The socket's receive buffer (`SO_RCVBUF`, as the kernel reports
    /// it) when the bound began, given back when it ends (0: none taken).
    rcvbuf: libc::c_int,
    /// The socket's window clamp when the link came up, given back when
    /// the bound ends (0: unknown; the clamp is then never set).
    window_clamp: libc::c_int,
    /// The peer asked for a keepalive reply: the sequence number of its
    /// latest request. One reply answers any number of requests, so a peer
    /// that floods requests and never reads queues at most one.
    reply_due: Option<u64>,
    last_rx: Clock,
    last_tx: Clock,
    keepalive_seq: u64,
    /// When the probe numbered `keepalive_seq` went out, until its reply.
    probe_sent: Option<Clock>,
    /// The round trip of the last probe answered (for the metrics).
    pub rtt: Option<Duration>,
    /// Where the payload of the connection manager's frame being read
    /// goes (a small heap region, so that it takes the payload path every
    /// frame takes), and the messages read whole, for the engine.
    cm_rx: Option<Region>,
    pub cm_in: Vec<vrdma_core::cm::CmMessage>,
    /// The frame whose payload `cm_rx` takes is a socket registry's
    /// (read the same way), and the messages read whole, for the engine.
    rx_sock: bool,
    pub sock_in: Vec<vrdma_core::sockets::peer::SockMessage>,
    /// The wire version the link speaks (see `vrdma_core::wire::VERSION`):
    /// Sock frames go only where it is `SOCK_VERSION` or later.
    pub version: u8,
}

/// Connection manager's messages a link holds for the engine at most;
/// past them the peer is breaking the protocol (the engine takes them
/// every pass).
const CM_IN_MAX: usize = 1024;

/// Why a link ended.
pub type LinkEnd = String;

/// An integer option of a TCP socket.
fn tcp_option(fd: std::os::fd::RawFd, opt: libc::c_int) -> Option<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `v` and `len` are valid for writes for the call and `len`
    // is `v`'s size; the kernel writes at most that much.
    let r = unsafe {
        libc::getsockopt(fd, libc::IPPROTO_TCP, opt, (&mut v as *mut libc::c_int).cast(), &mut len)
    };
    (r == 0).then_some(v)
}

/// An integer option of a socket (`SOL_SOCKET`).
fn socket_option(fd: std::os::fd::RawFd, opt: libc::c_int) -> Option<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: as in `tcp_option`.
    let r =
        unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, opt, (&mut v as *mut libc::c_int).cast(), &mut len) };
    (r == 0).then_some(v)
}

/// Sets an integer option of a socket (`SOL_SOCKET`).
fn set_socket_option(fd: std::os::fd::RawFd, opt: libc::c_int, v: libc::c_int) -> std::io::Result<()> {
    set_option(fd, libc::SOL_SOCKET, opt, v)
}

/// Sets an integer option of a TCP socket.
fn set_tcp_option(fd: std::os::fd::RawFd, opt: libc::c_int, v: libc::c_int) -> std::io::Result<()> {
    set_option(fd, libc::IPPROTO_TCP, opt, v)
}

fn set_option(
    fd: std::os::fd::RawFd,
    level: libc::c_int,
    opt: libc::c_int,
    v: libc::c_int,
) -> std::io::Result<()> {
    // SAFETY: a plain integer option; the pointer and length are those of
    // `v`, which outlives the call.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            opt,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn would_block(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted)
}

impl LinkIo {
    /// The local address of the link's connection.
    pub fn local_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        self.sock.local_addr()
    }

    /// A link over `sock` to `peer`, whose daemon's Hello said `gid` and
    /// `daemon_id`; `dialled` if this daemon opened the connection.
    pub fn new(
        id: LinkId,
        sock: TcpStream,
        peer: std::net::SocketAddr,
        gid: vrdma_core::verbs::Gid,
        daemon_id: u64,
        dialled: bool,
    ) -> std::io::Result<LinkIo> {
        sock.set_nonblocking(true)?;
        sock.set_nodelay(true)?;
        let window_clamp = tcp_option(sock.as_raw_fd(), libc::TCP_WINDOW_CLAMP).unwrap_or(0);
        let now = Clock::now();
        Ok(LinkIo {
            id,
            peer,
            gid,
            daemon_id,
            dialled,
            verified: false,
            from_our_gid: false,
            checked: false,
            sock,
            dec: FrameDecoder::new(),
            rbuf: Box::new([0; READ_BUF]),
            rstart: 0,
            rend: 0,
            drained: false,
            sink: None,
            placed_from_buffer: 0,
            placed_direct: 0,
            after_large: false,
            lost: false,
            txq: VecDeque::new(),
            tx_off: 0,
            want_write: false,
            stalled_since: None,
            reply_due: None,
            last_rx: now,
            last_tx: now,
            keepalive_seq: 0,
            probe_sent: None,
            rtt: None,
            cm_rx: None,
            cm_in: Vec::new(),
            rx_sock: false,
            sock_in: Vec::new(),
            version: vrdma_core::wire::VERSION,
            max_queued: DEFAULT_MAX_QUEUED_KIB as usize * 1024,
            bounded: false,
            capped_since: None,
            capped_ns: 0,
            rx_passes: 0,
            tx_passes: 0,
            active_at: None,
            latency_first: true,
            latency_marks: VecDeque::new(),
            latency_waits: Sampled::default(),
            window_clamp,
            rcvbuf: 0,
        })
    }

    /// Sets the bytes kept queued while a latency-class tenant is active
    /// (`net.max_queued_kib`).
    pub fn set_max_queued(&mut self, bytes: usize) {
        self.max_queued = bytes.max(1);
    }

    /// Whether a latency-class tenant's frame goes ahead of the other
    /// frames in the daemon's queue (`net.latency_first`), behind the one
    /// being written and that tenant's own earlier ones: it then waits
    /// there for at most one frame of another tenant (64 KiB and a
    /// header), not for the queue's `max_queued` or `TX_AHEAD`. Frames of
    /// different QPs carry no order between them on the wire (each QP's
    /// are numbered), and a latency tenant's own stay in order.
    pub fn set_latency_first(&mut self, on: bool) {
        self.latency_first = on;
    }

    /// Bounds what the kernel holds for the link to about `max_queued`
    /// each way (`bound`), or gives it back its defaults. Unsent bytes:
    /// `TCP_NOTSENT_LOWAT`, so a non-blocking write stops once that much
    /// is unsent, and the socket polls writable only below it. Bytes the
    /// peer sends us: `TCP_WINDOW_CLAMP`, so the window we advertise (what
    /// the peer may have in flight and in our receive buffer, ahead of its
    /// next latency frame) shrinks to it as we read; the kernel never
    /// retracts a window it advertised, so nothing is dropped.
    fn bound_kernel_queue(&mut self, bound: bool) {
        if bound == self.bounded {
            return;
        }
        let q = self.max_queued.min(i32::MAX as usize) as libc::c_int;
        // 0: the system's default (`net.ipv4.tcp_notsent_lowat`).
        let lowat = if bound { q } else { 0 };
        let clamp = if bound { q } else { self.window_clamp };
        let fd = self.sock.as_raw_fd();
        for (opt, v) in [(libc::TCP_NOTSENT_LOWAT, lowat), (libc::TCP_WINDOW_CLAMP, clamp)] {
            if opt == libc::TCP_WINDOW_CLAMP && v <= 0 {
                continue; // The clamp it came up with is unknown: left alone.
            }
            if let Err(e) = set_tcp_option(fd, opt, v) {
                // The daemon's own queue stays bounded; the kernel's is not.
                tracing::debug!(error = %e, opt, "a TCP option refused");
            }
        }
        // The window clamp bounds each window we advertise, not what waits
        // unread: the peer may send a clamp's worth more at every ACK until
        // the receive buffer is full (megabytes once autotuning grew it),
        // so the buffer is bounded too. The kernel doubles what it is
        // given (for its bookkeeping) and reports the doubled figure.
        // Setting it ends autotuning for the socket: when the bound ends
        // the buffer gets back the size it had grown to.
        if bound {
            self.rcvbuf = socket_option(fd, libc::SO_RCVBUF).unwrap_or(0);
        }
        let rcvbuf = if bound { q } else { self.rcvbuf / 2 };
        if rcvbuf > 0 {
            // Given back past `net.core.rmem_max` only with CAP_NET_ADMIN
            // (`SO_RCVBUFFORCE`); without, the kernel caps it there.
            let r = if bound {
                set_socket_option(fd, libc::SO_RCVBUF, rcvbuf)
            } else {
                set_socket_option(fd, libc::SO_RCVBUFFORCE, rcvbuf)
                    .or_else(|_| set_socket_option(fd, libc::SO_RCVBUF, rcvbuf))
            };
            if let Err(e) = r {
                tracing::debug!(error = %e, "SO_RCVBUF refused");
            }
        }
        self.bounded = bound;
    }

    /// Whether the link's bounds hold at `now`, the core saying whether a
    /// latency-class tenant is `active` on it: while it is and for
    /// [`BOUND_LINGER`] after.
    fn bound_at(&mut self, active: bool, now: Instant) -> bool {
        if active {
            self.active_at = Some(now);
        }
        self.active_at.is_some_and(|t| now.saturating_since(t) < BOUND_LINGER)
    }

    /// Queues a connection manager's message for the peer.
    pub fn queue_cm(&mut self, msg: &vrdma_core::cm::CmMessage) {
        let payload = vrdma_core::wire::cm::encode(msg);
        self.queue_small(FrameRepr::Cm { len: payload.len() as u32 }, payload);
    }

    /// Queues a socket registry's message for the peer; false if the link
    /// does not speak it (a version-2 peer; a version-3 one for the IPv6
    /// kinds, whose decoder would end the link on them).
    pub fn queue_sock(&mut self, msg: &vrdma_core::sockets::peer::SockMessage) -> bool {
        if self.version < msg.min_version() {
            return false;
        }
        let payload = vrdma_core::wire::sock::encode(msg);
        self.queue_small(FrameRepr::Sock { len: payload.len() as u32 }, payload);
        true
    }

    /// Queues a frame whose payload is `payload` (a message, not data).
    fn queue_small(&mut self, f: FrameRepr, payload: Vec<u8>) {
        let mut t = Transmit::default();
        t.header.extend(std::iter::repeat_n(0, f.header_len()));
        if f.emit(&mut t.header).is_err() {
            tracing::error!(len = payload.len(), frame = ?f, "a message too long for its frame; not sent");
            return;
        }
        let region = Region::heap(payload.len());
        if region.write(0, &payload).is_err() {
            return;
        }
        t.payload.push(IoSeg { region, off: 0, len: payload.len() });
        self.push(t);
    }

    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.sock.as_fd()
    }

    /// Queues a control frame ahead of nothing: it goes after what is
    /// queued. Returns its length.
    fn queue_control(&mut self, f: FrameRepr) -> usize {
        let mut t = Transmit::default();
        t.header.extend(std::iter::repeat_n(0, f.header_len()));
        if f.emit(&mut t.header).is_err() {
            return 0;
        }
        let n = t.len();
        self.push(t);
        n
    }

    /// Tells the peer we are leaving (best effort, never blocks).
    pub fn close(&mut self, reason: CloseReason) {
        let mut b = [0u8; vrdma_core::wire::MAX_HEADER_LEN];
        if let Ok(n) = FrameRepr::Close(CloseRepr { reason, detail: 0 }).emit(&mut b) {
            use std::io::Write;
            let _ = (&self.sock).write(&b[..n]);
        }
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }

    /// Reads and handles what the peer sent, up to a bound.
    pub fn receive(&mut self, hca: &mut Hca, rings: &mut RingTable, now: Instant) -> Result<bool, LinkEnd> {
        // While a latency-class tenant is active on the link, a pass reads
        // no more than `max_queued` bytes of payload, so that the engine
        // serves that tenant's QPs on this host between passes rather than
        // after 64 frames of a hog (4 MiB, milliseconds of copying).
        let bounded = self.bound_at(hca.link_latency_active(self.id, now), now);
        let budget = if bounded { self.max_queued } else { usize::MAX };
        let sample = bounded && {
            self.rx_passes = self.rx_passes.wrapping_add(1);
            self.rx_passes.is_multiple_of(SAMPLE_EVERY)
        };
        let waiting = if sample {
            queued_bytes(self.sock.as_raw_fd(), libc::FIONREAD as libc::c_ulong)
                .map(|n| n + (self.rend - self.rstart) as u64)
        } else {
            None
        };
        let (mut frames, mut bytes) = (0, 0);
        let r = self.receive_pass(hca, rings, now, budget, &mut frames, &mut bytes);
        if let (Some(w), Some(q)) = (waiting, hca.link_queues_mut(self.id)) {
            q.rx_samples += 1;
            q.rx_waiting.add(w);
            q.rx_frames.add(frames as u64);
            q.rx_payload.add(bytes as u64);
        }
        r
    }

    /// One pass of [`Self::receive`]: up to [`FRAMES_PER_PASS`] frames and
    /// `budget` payload bytes, counted in `frames` and `bytes`.
    fn receive_pass(
        &mut self,
        hca: &mut Hca,
        rings: &mut RingTable,
        now: Instant,
        budget: usize,
        frames: &mut usize,
        bytes: &mut usize,
    ) -> Result<bool, LinkEnd> {
        let mut busy = false;
        self.drained = false;
        while *frames < FRAMES_PER_PASS && *bytes < budget {
            match self.dec.want() {
                Want::Failed(e) => return Err(format!("protocol error: {e}")),
                Want::Header(_) => {
                    if self.rstart == self.rend && (self.drained || !self.fill()?) {
                        return Ok(busy);
                    }
                    let (used, ev) = self
                        .dec
                        .feed(&self.rbuf[self.rstart..self.rend])
                        .map_err(|e| format!("protocol error: {e}"))?;
                    self.rstart += used;
                    if let Some(Event::Header(f)) = ev {
                        *frames += 1;
                        busy = true;
                        if let FrameRepr::Data(d) = &f {
                            *bytes += d.payload_len as usize;
                        }
                        self.on_header(f, hca, rings, now)?;
                    }
                }
                Want::Payload(left) => {
                    if self.rstart < self.rend {
                        let n = (left as usize).min(self.rend - self.rstart);
                        let (a, b) = (self.rstart, self.rstart + n);
                        self.sink_copy(hca, a, b);
                        self.rstart = b;
                        self.dec.payload_placed(n).map_err(|e| format!("protocol error: {e}"))?;
                    } else if self.drained || !self.read_payload(hca, left as usize)? {
                        return Ok(busy);
                    }
                    busy = true;
                    if matches!(self.dec.want(), Want::Header(_)) {
                        self.sink = None;
                        let sock = std::mem::take(&mut self.rx_sock);
                        if let Some(r) = self.cm_rx.take_if(|_| sock) {
                            let mut buf = vec![0u8; r.len()];
                            let _ = r.read(0, &mut buf);
                            let msg = vrdma_core::wire::sock::decode(&buf)
                                .map_err(|e| format!("protocol error: {e}"))?;
                            // A kind of a later version than the link's
                            // is refused as that version's peer would.
                            if msg.min_version() > self.version {
                                return Err(format!(
                                    "protocol error: a socket registry's message of wire version {} on a link of wire version {}",
                                    msg.min_version(),
                                    self.version
                                ));
                            }
                            self.sock_in.push(msg);
                        } else if let Some(r) = self.cm_rx.take() {
                            let mut buf = vec![0u8; r.len()];
                            let _ = r.read(0, &mut buf);
                            let msg = vrdma_core::wire::cm::decode(&buf)
                                .map_err(|e| format!("protocol error: {e}"))?;
                            self.cm_in.push(msg);
                        } else if std::mem::take(&mut self.lost) {
                            hca.data_lost(self.id, rings);
                        } else {
                            hca.data_placed(self.id, now, rings);
                        }
                    }
                }
            }
        }
        Ok(busy)
    }

    /// Reads into the header buffer. Returns false if nothing was there.
    fn fill(&mut self) -> Result<bool, LinkEnd> {
        self.rstart = 0;
        self.rend = 0;
        let cap = if self.after_large { TAIL_AFTER_LARGE } else { READ_BUF };
        match self.sock.read(&mut self.rbuf[..cap]) {
            Ok(0) => Err("the peer closed the connection".into()),
            Ok(n) => {
                self.rend = n;
                self.drained = n < cap;
                self.last_rx = Clock::now();
                Ok(true)
            }
            Err(e) if would_block(&e) => Ok(false),
            Err(e) => Err(format!("read: {e}")),
        }
    }

    fn on_header(
        &mut self,
        f: FrameRepr,
        hca: &mut Hca,
        rings: &mut RingTable,
        now: Instant,
    ) -> Result<(), LinkEnd> {
        match f {
            FrameRepr::Data(d) => {
                self.after_large = d.payload_len as usize >= READ_BUF;
                let sink = hca.handle_data(self.id, &d, now, rings);
                if d.payload_len == 0 {
                    hca.data_placed(self.id, now, rings);
                } else {
                    self.sink = Some(match sink {
                        Sink::Place(segs) => RxSink::Place { segs, done: 0 },
                        Sink::Discard => RxSink::Discard,
                    });
                }
                Ok(())
            }
            FrameRepr::Keepalive(k) => {
                if !k.reply {
                    self.reply_due = Some(k.seq);
                } else if k.seq == self.keepalive_seq {
                    // The reply to our latest probe: its round trip (the
                    // peer answers probes as it reads them; behind a
                    // queue of data frames this is the link's queueing
                    // delay too).
                    if let Some(sent) = self.probe_sent.take() {
                        self.rtt = Some(sent.elapsed());
                    }
                }
                Ok(())
            }
            FrameRepr::Close(c) => Err(format!("the peer closed the link ({:?})", c.reason)),
            FrameRepr::Cm { len } => {
                if self.cm_in.len() >= CM_IN_MAX {
                    return Err(
                        "protocol error: connection manager's messages faster than they are read".into()
                    );
                }
                let region = Region::heap(len as usize);
                let mut segs = ArrayVec::new();
                segs.push(IoSeg { region: region.clone(), off: 0, len: len as usize });
                self.sink = Some(RxSink::Place { segs, done: 0 });
                self.cm_rx = Some(region);
                self.after_large = false;
                Ok(())
            }
            FrameRepr::Sock { len } => {
                if self.version < vrdma_core::wire::SOCK_VERSION {
                    return Err(format!(
                        "protocol error: a socket registry's frame on a link of wire version {}",
                        self.version
                    ));
                }
                if self.version < vrdma_core::wire::SOCK6_VERSION
                    && len > vrdma_core::wire::sock::MAX_SOCK_PAYLOAD_V3
                {
                    return Err(format!(
                        "protocol error: a socket registry's frame of {len} bytes on a link of wire version {}",
                        self.version
                    ));
                }
                if self.sock_in.len() >= CM_IN_MAX {
                    return Err("protocol error: socket registry's messages faster than they are read".into());
                }
                let region = Region::heap(len as usize);
                let mut segs = ArrayVec::new();
                segs.push(IoSeg { region: region.clone(), off: 0, len: len as usize });
                self.sink = Some(RxSink::Place { segs, done: 0 });
                self.cm_rx = Some(region);
                self.rx_sock = true;
                self.after_large = false;
                Ok(())
            }
            FrameRepr::Moved(m) => {
                // A migrated QP's new location: the core checks it.
                hca.handle_moved(self.id, &m, now);
                Ok(())
            }
            FrameRepr::Hello(_) | FrameRepr::Auth(_) => {
                Err("protocol error: a handshake frame on an open link".into())
            }
        }
    }

    /// Once a region the payload goes to is deregistered (the tenant may
    /// reuse its memory at once), the rest of the payload is thrown away.
    /// And once the QP it goes to failed, was reset or destroyed (the
    /// core says so), it is thrown away too, though not lost: what the QP
    /// had claimed may already be another's.
    fn check_sink(&mut self, hca: &Hca) {
        if self.cm_rx.is_some() {
            // The connection manager's own buffer: nothing revokes it.
            return;
        }
        if let Some(RxSink::Place { segs, .. }) = &self.sink {
            if segs.iter().any(|s| s.region.is_revoked()) {
                self.sink = Some(RxSink::Discard);
                self.lost = true;
            } else if hca.placement_cancelled(self.id) {
                self.sink = Some(RxSink::Discard);
            }
        }
    }

    /// Copies buffered payload bytes `rbuf[a..b]` to where they go.
    fn sink_copy(&mut self, hca: &Hca, a: usize, b: usize) {
        self.check_sink(hca);
        let Some(RxSink::Place { segs, done }) = self.sink.as_mut() else { return };
        let mut src = &self.rbuf[a..b];
        let mut skip = *done;
        for s in segs.iter() {
            if src.is_empty() {
                break;
            }
            if skip >= s.len {
                skip -= s.len;
                continue;
            }
            let n = (s.len - skip).min(src.len());
            // The windows were bounds-checked by the core; an error here
            // would be a bug, and the bytes are simply not placed.
            let _ = s.region.write(s.off + skip, &src[..n]);
            src = &src[n..];
            *done += n;
            self.placed_from_buffer += n as u64;
            skip = 0;
        }
    }

    /// Reads up to `left` payload bytes straight into the destination, and
    /// in the same `readv` what follows into the header buffer (after a
    /// large payload only a header's worth: the next frame's header,
    /// usually), so that a stream of large frames costs one system call
    /// per frame. Returns false if the socket had nothing. Called only
    /// with the header buffer empty.
    fn read_payload(&mut self, hca: &Hca, left: usize) -> Result<bool, LinkEnd> {
        debug_assert_eq!(self.rstart, self.rend, "payload read with buffered bytes");
        self.check_sink(hca);
        let (payload, n, asked) = match self.sink.as_mut() {
            Some(RxSink::Place { segs, done }) => {
                let mut iov: ArrayVec<libc::iovec, { MAX_SGE + 1 }> = ArrayVec::new();
                let mut skip = *done;
                let mut want = left;
                for s in segs.iter() {
                    if want == 0 {
                        break;
                    }
                    if skip >= s.len {
                        skip -= s.len;
                        continue;
                    }
                    let n = (s.len - skip).min(want);
                    let Ok(p) = s.region.io_ptr(s.off + skip, n) else { break };
                    iov.push(libc::iovec { iov_base: p.cast(), iov_len: n });
                    want -= n;
                    skip = 0;
                }
                if iov.is_empty() {
                    return Err("internal error: payload has no destination".into());
                }
                let payload = left - want;
                let tail = match want {
                    0 if self.after_large => TAIL_AFTER_LARGE,
                    0 => READ_BUF,
                    _ => 0,
                };
                if tail > 0 {
                    iov.push(libc::iovec { iov_base: self.rbuf.as_mut_ptr().cast(), iov_len: tail });
                }
                // SAFETY: every iovec but the last points into a mapped
                // region that the IoSegs in `segs` keep alive for this call,
                // within bounds the core checked (`io_ptr` checks them
                // again); the kernel writes tenant memory the way a DMA
                // engine does, and no Rust reference to it exists. The last,
                // if `tail > 0`, is `self.rbuf`, which nothing else borrows
                // during the call.
                let r = unsafe { libc::readv(self.sock.as_raw_fd(), iov.as_ptr(), iov.len() as i32) };
                if r < 0 {
                    let e = std::io::Error::last_os_error();
                    if would_block(&e) {
                        return Ok(false);
                    }
                    return Err(format!("read: {e}"));
                }
                let r = r as usize;
                *done += r.min(payload);
                self.placed_direct += r.min(payload) as u64;
                (payload, r, payload + tail)
            }
            Some(RxSink::Discard) | None => {
                let cap = left.min(READ_BUF);
                match self.sock.read(&mut self.rbuf[..cap]) {
                    // All of it is payload, thrown away.
                    Ok(n) => (n, n, cap),
                    Err(e) if would_block(&e) => return Ok(false),
                    Err(e) => return Err(format!("read: {e}")),
                }
            }
        };
        if n == 0 {
            return Err("the peer closed the connection".into());
        }
        self.drained = n < asked;
        self.last_rx = Clock::now();
        let placed = n.min(payload);
        self.dec.payload_placed(placed).map_err(|e| format!("protocol error: {e}"))?;
        // What followed the payload waits in the header buffer.
        self.rstart = 0;
        self.rend = n - placed;
        Ok(true)
    }

    /// Copies out of tenant memory the payloads of queued frames that come
    /// from a region being revoked (deregistered, or its process gone), so
    /// that they go out as the region held them at that moment.
    /// A queued frame's header may already be out: its payload must
    /// follow, and zeros in its place would complete the peer's message
    /// with bytes nobody sent. Frames not yet queued never leave: the core
    /// looks their keys up again. Returns the bytes copied (at most about
    /// `TX_AHEAD`).
    pub fn keep_payloads(&mut self, doomed: &dyn Fn(&Region) -> bool) -> usize {
        let mut copied = 0;
        for t in self.txq.iter_mut() {
            if !t.payload.iter().any(|s| doomed(&s.region)) {
                continue;
            }
            // `data` goes out before `payload`, so appending the payload to
            // it keeps every byte, and `tx_off`, where it was.
            for s in std::mem::take(&mut t.payload) {
                let at = t.data.len();
                t.data.resize(at + s.len, 0);
                if s.region.read(s.off, &mut t.data[at..]).is_err() {
                    debug_assert!(false, "a queued segment outside its region");
                }
                copied += s.len;
            }
        }
        copied
    }

    #[cfg(test)]
    pub(crate) fn queue(&mut self, t: Transmit) {
        self.push(t);
    }

    /// Writes what the core has for this link until the socket is full.
    pub fn transmit(&mut self, hca: &mut Hca, rings: &mut RingTable, now: Instant) -> Result<bool, LinkEnd> {
        // While a latency-class tenant is active, what waits ahead of its
        // next frame is bounded here and in the kernel.
        let bound = self.bound_at(hca.link_latency_active(self.id, now), now);
        self.bound_kernel_queue(bound);
        let r = self.transmit_pass(hca, rings, now, bound);
        if self.latency_waits != Sampled::default() {
            let w = std::mem::take(&mut self.latency_waits);
            if let Some(q) = hca.link_queues_mut(self.id) {
                q.daemon_wait_ns.sum = q.daemon_wait_ns.sum.saturating_add(w.sum);
                q.daemon_wait_ns.max = q.daemon_wait_ns.max.max(w.max);
            }
        }
        let sample = bound && {
            self.tx_passes = self.tx_passes.wrapping_add(1);
            self.tx_passes.is_multiple_of(SAMPLE_EVERY)
        };
        if sample {
            let fd = self.sock.as_raw_fd();
            let daemon = self.queued_bytes() as u64;
            let (outq, unsent) = (queued_bytes(fd, SIOCOUTQ), queued_bytes(fd, SIOCOUTQNSD));
            let capped = self.capped_ns(now);
            if let Some(q) = hca.link_queues_mut(self.id) {
                q.tx_samples += 1;
                q.daemon.add(daemon);
                q.unsent.add(unsent.unwrap_or(0));
                q.in_flight.add(outq.unwrap_or(0).saturating_sub(unsent.unwrap_or(0)));
                q.capped_ns = capped;
            }
        }
        r
    }

    /// Queues `t` last.
    fn push(&mut self, t: Transmit) {
        self.txq.push_back(t);
    }

    /// Bytes in the daemon's queue for the link, not yet written.
    fn queued_bytes(&self) -> usize {
        self.txq.iter().map(Transmit::len).sum::<usize>() - self.tx_off
    }

    fn transmit_pass(
        &mut self,
        hca: &mut Hca,
        rings: &mut RingTable,
        now: Instant,
        bound: bool,
    ) -> Result<bool, LinkEnd> {
        let mut busy = false;
        let ahead = if bound { self.max_queued.min(TX_AHEAD) } else { TX_AHEAD };
        for _ in 0..FRAMES_PER_PASS {
            let mut queued = self.queued_bytes();
            while queued < ahead && self.txq.len() < TX_FRAMES_AHEAD {
                if let Some(seq) = self.reply_due.take() {
                    queued += self.queue_control(FrameRepr::Keepalive(KeepaliveRepr { seq, reply: true }));
                    continue;
                }
                match hca.poll_transmit(self.id, now, rings) {
                    Some(t) => {
                        queued += t.len();
                        self.enqueue(hca, t);
                    }
                    None => break,
                }
            }
            // Held at the bound: the queue would take more without it.
            self.note_capped(ahead < TX_AHEAD && queued >= ahead, now);
            if self.txq.is_empty() {
                self.want_write = false;
                return Ok(busy);
            }
            match self.write_queued() {
                Ok(true) => busy = true,
                Ok(false) => {
                    self.want_write = true;
                    return Ok(busy);
                }
                Err(e) => return Err(format!("write: {e}")),
            }
        }
        Ok(busy)
    }

    /// Queues a frame the core handed over. A latency-class tenant's goes
    /// ahead of the others' if `latency_first`, and what waits ahead of it
    /// in the daemon's queue and in the kernel's is counted, and then its
    /// wait to be written ([`vrdma_core::hca::LinkQueues`]).
    fn enqueue(&mut self, hca: &mut Hca, t: Transmit) {
        if !t.latency {
            self.txq.push_back(t);
            return;
        }
        let at = if self.latency_first {
            // Behind the frame being written, and this class's own.
            let own = self.txq.iter().rposition(|x| x.latency).map_or(0, |i| i + 1);
            own.max(usize::from(self.tx_off > 0)).min(self.txq.len())
        } else {
            self.txq.len()
        };
        let ahead =
            self.txq.iter().take(at).map(Transmit::len).sum::<usize>() - if at > 0 { self.tx_off } else { 0 };
        if let Some(q) = hca.link_queues_mut(self.id) {
            let fd = self.sock.as_raw_fd();
            count_latency_frame(q, ahead as u64, || queued_bytes(fd, SIOCOUTQ));
        }
        self.latency_marks.push_back(Clock::now());
        self.txq.insert(at, t);
    }

    /// The daemon's queue for the link is held at `max_queued` at `now`
    /// (`capped`), or not: counts the time it is.
    fn note_capped(&mut self, capped: bool, now: Instant) {
        match (self.capped_since, capped) {
            (None, true) => self.capped_since = Some(now),
            (Some(since), false) => {
                self.capped_since = None;
                self.capped_ns = self.capped_ns.saturating_add(now.saturating_since(since).as_nanos() as u64);
            }
            _ => {}
        }
    }

    /// Time the daemon's queue for the link was held at `max_queued`
    /// while a latency-class tenant was active, up to `now`, in ns.
    pub fn capped_ns(&self, now: Instant) -> u64 {
        let open = self.capped_since.map_or(0, |s| now.saturating_since(s).as_nanos() as u64);
        self.capped_ns.saturating_add(open)
    }

    /// One `writev` of the queued frames. Returns false if the socket took
    /// nothing.
    fn write_queued(&mut self) -> std::io::Result<bool> {
        let mut iov: ArrayVec<libc::iovec, IOV_MAX> = ArrayVec::new();
        let mut skip = self.tx_off;
        'frames: for t in &self.txq {
            let pieces =
                [(t.header.as_ptr() as *mut u8, t.header.len()), (t.data.as_ptr() as *mut u8, t.data.len())]
                    .into_iter()
                    .filter(|(_, len)| *len > 0)
                    .chain(t.payload.iter().filter_map(|s| {
                        if s.region.is_revoked() {
                            tracing::error!("a queued payload of a revoked region was not kept; zeros sent");
                            // The core's chunks are at most MAX_CHUNK long.
                            return (s.len <= ZEROS.len()).then_some((ZEROS.as_ptr() as *mut u8, s.len));
                        }
                        s.region.io_ptr(s.off, s.len).ok().map(|p| (p, s.len))
                    }));
            for (p, len) in pieces {
                if skip >= len {
                    skip -= len;
                    continue;
                }
                if iov.is_full() {
                    break 'frames;
                }
                // SAFETY: `skip < len`, so the pointer stays inside the piece.
                iov.push(libc::iovec { iov_base: unsafe { p.add(skip) }.cast(), iov_len: len - skip });
                skip = 0;
            }
        }
        // SAFETY: the iovecs point into headers owned by `self.txq`, into
        // mapped regions kept alive by its IoSegs, all within bounds, or
        // into the static `ZEROS`; the kernel only reads them.
        let r = unsafe { libc::writev(self.sock.as_raw_fd(), iov.as_ptr(), iov.len() as i32) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if would_block(&e) {
                self.stalled_since.get_or_insert_with(Clock::now);
                return Ok(false);
            }
            return Err(e);
        }
        self.last_tx = Clock::now();
        self.stalled_since = None;
        let mut n = r as usize + self.tx_off;
        while let Some(t) = self.txq.front() {
            let len = t.len();
            if n < len {
                break;
            }
            n -= len;
            if self.txq.pop_front().is_some_and(|t| t.latency) {
                // Written whole: its wait in the daemon's queue.
                if let Some(at) = self.latency_marks.pop_front() {
                    self.latency_waits.add(at.elapsed().as_nanos() as u64);
                }
            }
        }
        self.tx_off = n;
        Ok(r > 0)
    }

    /// Probes an idle link; ends a silent one. Returns when to look again.
    pub fn keepalive(&mut self, every: Duration, dead: Duration) -> Result<Clock, LinkEnd> {
        let now = Clock::now();
        if now.duration_since(self.last_rx) >= dead {
            return Err(format!("no frame for {} ms", dead.as_millis()));
        }
        // A peer that sends but reads nothing keeps `last_rx` fresh while
        // our frames (and the QPs behind them) wait for ever.
        if self.stalled_since.is_some_and(|t| now.duration_since(t) >= dead) {
            return Err(format!("the peer read nothing for {} ms", dead.as_millis()));
        }
        if now.duration_since(self.last_tx) >= every && self.txq.is_empty() {
            self.keepalive_seq += 1;
            self.queue_control(FrameRepr::Keepalive(KeepaliveRepr { seq: self.keepalive_seq, reply: false }));
            self.last_tx = now;
            self.probe_sent = Some(now);
        }
        Ok((self.last_tx + every).min(self.last_rx + dead))
    }

    /// Bytes read but not yet handled (a pass stopped at its frame bound):
    /// the socket's readiness does not show them.
    pub fn has_input(&self) -> bool {
        self.rstart < self.rend
    }

    pub fn has_output(&self) -> bool {
        !self.txq.is_empty() || self.reply_due.is_some()
    }

    /// Writes what is queued, as far as the socket takes it, without
    /// taking more from the HCA: a connection manager's frame that a
    /// control call just queued leaves at once, not at the engine's next
    /// pass (which may be a wake-up away). An error is left for that pass
    /// to meet again and end the link.
    pub fn write_now(&mut self) {
        while !self.txq.is_empty() {
            match self.write_queued() {
                Ok(true) => {}
                Ok(false) => {
                    self.want_write = true;
                    return;
                }
                Err(_) => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::TcpStream;

    use vrdma_core::hca::{ContextId, HcaConfig, TenantId};
    use vrdma_core::verbs::{
        AccessFlags, AhAttr, Gid, Mtu, QpAttr, QpAttrMask, QpCap, QpInitAttr, QpState, QpType,
    };
    use vrdma_core::wire::{DataRepr, Event, Opcode, Reth};

    use super::*;
    use crate::testing::{loopback, Keys};

    /// A link over loopback, and the peer's end of its socket.
    fn pair() -> (LinkIo, TcpStream, Hca, RingTable) {
        let (ours, theirs) = loopback();
        // Small fixed buffers (no autotuning): a peer that reads nothing
        // closes the window after a few frames.
        for (s, opt) in [(&ours, libc::SO_SNDBUF), (&theirs, libc::SO_RCVBUF)] {
            let v: libc::c_int = 64 << 10;
            // SAFETY: a valid socket and an int option of the right size.
            let r = unsafe {
                libc::setsockopt(s.as_raw_fd(), libc::SOL_SOCKET, opt, (&v as *const libc::c_int).cast(), 4)
            };
            assert_eq!(r, 0);
        }
        let mut hca = Hca::new(HcaConfig::for_host([10, 0, 0, 1]), Box::new(Keys(0)));
        let gid = Gid::from_ipv4([10, 0, 0, 2]);
        let id = hca.link_up(vrdma_core::hca::LinkInfo { gid, lid: 2, chunk: 65536, verified: true });
        let link = LinkIo::new(id, ours, "10.0.0.2:4791".parse().unwrap(), gid, 9, false).unwrap();
        (link, theirs, hca, RingTable::default())
    }

    /// The bytes of `f`'s header, as a peer sends them.
    fn header(f: FrameRepr) -> Vec<u8> {
        let mut b = vec![0u8; f.header_len()];
        f.emit(&mut b).unwrap();
        b
    }

    fn keepalive_request() -> Vec<u8> {
        header(FrameRepr::Keepalive(KeepaliveRepr { seq: 7, reply: false }))
    }

    /// Fills the socket (the peer reads nothing) until it refuses more.
    fn stall(link: &mut LinkIo, hca: &mut Hca, rings: &mut RingTable) {
        for _ in 0..10_000 {
            if link.stalled_since.is_some() {
                return;
            }
            link.push(Transmit { data: vec![0; 60 << 10], ..Transmit::default() });
            link.transmit(hca, rings, Instant::ZERO).unwrap();
        }
        panic!("600 MB did not fill a socket of 64 KiB");
    }

    /// A connection manager's frame written at once goes out whole, no
    /// pass of the engine needed; on a full socket it stays queued, and
    /// the link asks to be written when the socket drains.
    #[test]
    fn write_now_sends_what_is_queued_or_leaves_it_for_the_engine() {
        let (mut link, mut theirs, mut hca, mut rings) = pair();
        let msg = vrdma_core::cm::CmMessage::Rtu { to: 7, from: 9 };
        link.queue_cm(&msg);
        let want: usize = link.txq.iter().map(Transmit::len).sum();
        link.write_now();
        assert!(link.txq.is_empty() && !link.want_write);
        theirs.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut got = vec![0u8; want];
        std::io::Read::read_exact(&mut theirs, &mut got).unwrap();
        let payload = vrdma_core::wire::cm::encode(&msg);
        assert_eq!(got[want - payload.len()..], payload[..], "the frame ends with the message");

        stall(&mut link, &mut hca, &mut rings);
        let before = link.txq.len();
        link.queue_cm(&msg);
        link.write_now();
        assert_eq!(link.txq.len(), before + 1, "a full socket took nothing");
        assert!(link.want_write, "the engine is to write it when the socket drains");
    }

    /// The bounds hold while the core says a latency-class tenant is
    /// active and for `BOUND_LINGER` after, however long its own window.
    #[test]
    fn the_bounds_linger_after_the_latency_tenant_was_last_active() {
        let (mut link, _theirs, _hca, _rings) = pair();
        let ms = |n: u64| Instant::ZERO + Duration::from_millis(n);
        assert!(!link.bound_at(false, ms(1)), "never active: unbounded");
        assert!(link.bound_at(true, ms(10)));
        assert!(link.bound_at(false, ms(30)), "20 ms on: past the core's window, still bounded");
        assert!(link.bound_at(false, ms(10) + (BOUND_LINGER - Duration::from_nanos(1))));
        assert!(!link.bound_at(false, ms(10) + BOUND_LINGER), "idle for the linger: the hog's own settings");
        assert!(link.bound_at(true, ms(500)), "active again");
    }

    /// The time the queue sits at its bound is counted from the pass
    /// that finds it there to the first that does not, and read at any
    /// moment with the span under way included.
    #[test]
    fn time_held_at_the_queue_bound_is_counted() {
        let (mut link, _theirs, _hca, _rings) = pair();
        link.note_capped(false, Instant(50));
        assert_eq!(link.capped_ns(Instant(1000)), 0);
        link.note_capped(true, Instant(100));
        link.note_capped(true, Instant(180));
        assert_eq!(link.capped_ns(Instant(150)), 50, "the span under way");
        link.note_capped(false, Instant(300));
        link.note_capped(false, Instant(400));
        assert_eq!(link.capped_ns(Instant(1000)), 200);
        link.note_capped(true, Instant(500));
        link.note_capped(false, Instant(510));
        assert_eq!(link.capped_ns(Instant(1000)), 210);
    }

    /// While bounded the socket holds at most `max_queued` unsent and
    /// advertises at most that much window; after, its own settings again.
    #[test]
    fn the_kernel_queue_bound_is_set_and_given_back() {
        let (mut link, _theirs, _hca, _rings) = pair();
        let fd = link.sock.as_raw_fd();
        let clamp = tcp_option(fd, libc::TCP_WINDOW_CLAMP).unwrap();
        link.set_max_queued(48 << 10);
        link.bound_kernel_queue(true);
        assert_eq!(tcp_option(fd, libc::TCP_NOTSENT_LOWAT), Some(48 << 10));
        assert_eq!(tcp_option(fd, libc::TCP_WINDOW_CLAMP), Some(48 << 10));
        link.bound_kernel_queue(false);
        assert_eq!(tcp_option(fd, libc::TCP_WINDOW_CLAMP), Some(clamp));
        assert_ne!(tcp_option(fd, libc::TCP_NOTSENT_LOWAT), Some(48 << 10));
    }

    /// Writes every queued frame while the peer reads them; returns the
    /// bytes it read, in order, with the `before` bytes written earlier
    /// (the peer had read nothing).
    fn write_all_queued(link: &mut LinkIo, theirs: &mut TcpStream, before: usize) -> Vec<u8> {
        let want = link.queued_bytes() + before;
        let mut r = theirs.try_clone().unwrap();
        r.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; want];
            std::io::Read::read_exact(&mut r, &mut got).map(|_| got)
        });
        // Bounded: the peer reads everything within 10 s.
        let end = Clock::now() + Duration::from_secs(10);
        while !link.txq.is_empty() && Clock::now() < end {
            if !link.write_queued().unwrap() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        assert!(link.txq.is_empty(), "the peer read nothing for 10 s");
        reader.join().unwrap().unwrap()
    }

    /// A latency-class tenant's frame handed over behind 2 MiB of another
    /// tenant's frames in the daemon's queue is written after at most the
    /// frame being written when it came (`net.latency_first`), its own
    /// class's frames keep their order, and the bytes ahead of it are
    /// counted; without `latency_first` it waits for the whole queue.
    #[test]
    fn a_latency_frame_queued_behind_megabytes_of_bulk_frames_is_written_after_at_most_one() {
        const BULK: usize = 64 << 10;
        const FRAMES: usize = 32;
        for first in [true, false] {
            let (mut link, mut theirs, mut hca, _rings) = pair();
            link.set_latency_first(first);
            for _ in 0..FRAMES {
                link.push(Transmit { data: vec![0xAA; BULK], ..Transmit::default() });
            }
            // A frame is under way when the latency frames come.
            assert!(link.write_queued().unwrap());
            let before = FRAMES * BULK - link.queued_bytes();
            assert!(link.tx_off > 0 && before < BULK * FRAMES / 2, "{before} written");
            let under_way_ends = before.div_ceil(BULK) * BULK;
            for b in [0x55u8, 0x66] {
                link.enqueue(&mut hca, Transmit { data: vec![b; 8], latency: true, ..Transmit::default() });
            }
            let got = write_all_queued(&mut link, &mut theirs, before);
            let at = |b: u8| got.iter().position(|&x| x == b).unwrap();
            assert_eq!(got.len(), FRAMES * BULK + 16);
            assert!(at(0x55) < at(0x66), "the latency class's own frames keep their order");
            let q = hca.link_queues_mut(link.id).unwrap();
            assert_eq!(q.latency_frames, 2);
            assert_eq!(q.ahead_kernel_samples, 1, "the kernel's queue asked for the first frame only");
            if first {
                assert_eq!(at(0x55), under_way_ends, "written right after the frame under way");
                assert!(q.ahead_daemon.max <= BULK as u64, "{q:?}");
            } else {
                assert_eq!(at(0x55), FRAMES * BULK, "behind the whole queue");
                assert!(q.ahead_daemon.max >= (FRAMES * BULK - under_way_ends) as u64, "{q:?}");
            }
            assert!(link.latency_marks.is_empty(), "each latency frame's wait counted once written");
        }
    }

    /// Of K latency-class frames the kernel's queue is asked for
    /// ceil(K / SAMPLE_EVERY), the link's first and every
    /// `SAMPLE_EVERY`th, and the mean is over those: the bytes ahead in
    /// the daemon's queue are still counted for each frame.
    #[test]
    fn the_kernel_queue_ahead_of_latency_frames_is_asked_for_one_frame_in_sample_every() {
        let n = u64::from(SAMPLE_EVERY);
        for k in [1, n - 1, n, n + 1, 3 * n + 2] {
            let mut q = LinkQueues::default();
            let mut asked = Vec::new();
            for i in 0..k {
                count_latency_frame(&mut q, 10, || {
                    asked.push(i);
                    Some(1000 * (i + 1))
                });
            }
            let sampled: Vec<u64> = (0..k).step_by(n as usize).collect();
            assert_eq!(asked, sampled, "K = {k}: one ioctl per {n} frames");
            assert_eq!(q.ahead_kernel_samples, k.div_ceil(n));
            assert_eq!(q.latency_frames, k);
            assert_eq!(q.ahead_daemon.sum, 10 * k, "the daemon's queue counted for every frame");
            let mean = sampled.iter().map(|i| 1000 * (i + 1)).sum::<u64>() as f64 / sampled.len() as f64;
            assert_eq!(q.ahead_kernel.mean(q.ahead_kernel_samples), mean, "K = {k}");
            assert_eq!(q.ahead_kernel.max, 1000 * (sampled.last().unwrap() + 1));
        }
    }

    /// While bounded, what the peer can leave unread in our socket is
    /// about `max_queued`, however large autotuning had grown the receive
    /// buffer (the window clamp alone bounds each window, not the sum);
    /// after, the buffer is as large as before.
    #[test]
    fn while_bounded_the_peer_leaves_at_most_about_the_bound_unread() {
        let (mut link, mut theirs, _hca, _rings) = pair();
        let fd = link.sock.as_raw_fd();
        set_socket_option(fd, libc::SO_RCVBUF, 4 << 20).unwrap();
        let grown = socket_option(fd, libc::SO_RCVBUF).unwrap();
        link.set_max_queued(64 << 10);
        link.bound_kernel_queue(true);
        theirs.set_nonblocking(true).unwrap();
        let chunk = vec![0u8; 64 << 10];
        // Bounded: 64 MB at most, and three rounds of window updates.
        for _ in 0..3 {
            for _ in 0..1000 {
                match theirs.write(&chunk) {
                    Ok(_) => {}
                    Err(e) if would_block(&e) => break,
                    Err(e) => panic!("{e}"),
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let unread = queued_bytes(fd, libc::FIONREAD as libc::c_ulong).unwrap();
        assert!(unread <= 4 * (64 << 10), "{unread} bytes unread behind a bound of 64 KiB");
        link.bound_kernel_queue(false);
        assert_eq!(socket_option(fd, libc::SO_RCVBUF), Some(grown));
    }

    #[test]
    fn a_peer_that_floods_keepalive_requests_and_reads_nothing_queues_one_reply() {
        let (mut link, mut theirs, mut hca, mut rings) = pair();
        stall(&mut link, &mut hca, &mut rings);
        let before = link.txq.len();
        let burst: Vec<u8> = keepalive_request().repeat(170);
        for _ in 0..100 {
            theirs.write_all(&burst).unwrap();
            while link.receive(&mut hca, &mut rings, Instant::ZERO).unwrap() {}
            link.transmit(&mut hca, &mut rings, Instant::ZERO).unwrap();
        }
        assert!(link.txq.len() <= before + 1, "17 000 requests queued {} frames", link.txq.len() - before);
    }

    /// `[off, off+n)` of `r`.
    fn bytes(r: &vrdma_core::memory::Region, off: usize, n: usize) -> Vec<u8> {
        let mut v = vec![0; n];
        r.read(off, &mut v).unwrap();
        v
    }

    /// A heap region of `n` bytes, every one `fill`.
    fn region(n: usize, fill: u8) -> vrdma_core::memory::Region {
        let r = vrdma_core::memory::Region::heap(n);
        r.write(0, &vec![fill; n]).unwrap();
        r
    }

    /// Reads `n` bytes from `theirs` while `link` writes what it has queued.
    fn drain(
        link: &mut LinkIo,
        theirs: &mut TcpStream,
        hca: &mut Hca,
        rings: &mut RingTable,
        n: usize,
    ) -> Vec<u8> {
        theirs.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        let mut got = Vec::with_capacity(n);
        let mut buf = vec![0u8; 64 << 10];
        let started = Clock::now();
        while got.len() < n && started.elapsed() < Duration::from_secs(10) {
            link.transmit(hca, rings, Instant::ZERO).unwrap();
            match std::io::Read::read(theirs, &mut buf) {
                Ok(k) => got.extend_from_slice(&buf[..k]),
                Err(e) if would_block(&e) => {}
                Err(e) => panic!("read: {e}"),
            }
        }
        got
    }

    #[test]
    fn a_frame_queued_from_a_region_being_revoked_goes_out_as_the_region_held_it() {
        let (mut link, mut theirs, mut hca, mut rings) = pair();
        // More than the two socket buffers hold, so that the frame's header
        // and part of its payload are out when the region goes.
        const LEN: usize = 1 << 20;
        let r = region(LEN, 0xab);
        let mut t = Transmit::default();
        t.header.extend([1, 2, 3]);
        for k in 0..4 {
            t.payload.push(IoSeg { region: r.clone(), off: k * (LEN / 4), len: LEN / 4 });
        }
        link.push(t);
        link.transmit(&mut hca, &mut rings, Instant::ZERO).unwrap();
        assert!(link.tx_off > 3 && link.tx_off < 3 + LEN, "partly written: {}", link.tx_off);
        // The tenant deregisters, then reuses the memory.
        r.revoke();
        assert_eq!(link.keep_payloads(&|r| r.is_revoked()), LEN);
        r.write(0, &vec![0xcd; LEN]).unwrap();
        let got = drain(&mut link, &mut theirs, &mut hca, &mut rings, 3 + LEN);
        assert_eq!(got.len(), 3 + LEN, "the whole frame went out");
        assert_eq!(got[..3], [1, 2, 3]);
        let wrong = got[3..].iter().filter(|&&b| b != 0xab).count();
        assert_eq!(wrong, 0, "bytes other than the region's at revocation went out");
        assert_eq!(link.keep_payloads(&|_| true), 0, "nothing left queued");
    }

    #[test]
    fn a_revoked_region_whose_payload_was_not_kept_never_leaves_the_host() {
        let (mut link, mut theirs, mut hca, mut rings) = pair();
        let r = region(4096, 0xab);
        let mut t = Transmit::default();
        t.header.extend([1, 2, 3]);
        t.payload.push(IoSeg { region: r.clone(), off: 0, len: 4096 });
        link.push(t);
        r.revoke();
        link.transmit(&mut hca, &mut rings, Instant::ZERO).unwrap();
        let mut got = vec![0xff; 3 + 4096];
        std::io::Read::read_exact(&mut theirs, &mut got).unwrap();
        assert_eq!(got[..3], [1, 2, 3], "the header as queued");
        assert!(got[3..].iter().all(|&b| b == 0), "bytes of a deregistered region left the host");
    }

    #[test]
    fn a_payload_whose_region_is_deregistered_meanwhile_is_not_placed() {
        use vrdma_core::wire::{DataRepr, Opcode, Reth};
        for revoked in [false, true] {
            let (mut link, mut theirs, mut hca, mut rings) = pair();
            // The header came and the core said where the payload goes...
            let mut d = DataRepr::new(Opcode::WriteOnly, 1, 0x11, 0x12, 5);
            d.payload_len = 8192;
            d.reth = Some(Reth { va: 0x1000, rkey: 9, dma_len: 8192 });
            let h = header(FrameRepr::Data(d));
            assert!(matches!(link.dec.feed(&h).unwrap(), (_, Some(Event::Header(_)))));
            let r = region(8192, 0);
            let mut segs = ArrayVec::new();
            segs.push(IoSeg { region: r.clone(), off: 0, len: 8192 });
            link.sink = Some(RxSink::Place { segs, done: 0 });
            // ...half of it is in, then the region is deregistered.
            theirs.write_all(&[0xcd; 4096]).unwrap();
            while link.receive(&mut hca, &mut rings, Instant::ZERO).unwrap() {}
            if revoked {
                r.revoke();
            }
            theirs.write_all(&[0xcd; 1024]).unwrap();
            while link.receive(&mut hca, &mut rings, Instant::ZERO).unwrap() {}
            assert_eq!(link.lost, revoked, "the loss is seen at the next bytes");
            assert_eq!(matches!(link.sink, Some(RxSink::Discard)), revoked);
            theirs.write_all(&[0xcd; 3072]).unwrap();
            let started = Clock::now();
            while link.sink.is_some() && started.elapsed() < Duration::from_secs(5) {
                link.receive(&mut hca, &mut rings, Instant::ZERO).unwrap();
            }
            assert!(link.sink.is_none(), "the frame ended");
            assert!(!link.lost, "the loss was reported at the frame's end");
            let dropped = hca.links()[0].stats.dropped_in;
            assert_eq!(dropped, u64::from(revoked), "the core was told of the loss (and only then)");
            let mut after = vec![0u8; 8192];
            r.read(0, &mut after).unwrap();
            assert!(after[..4096].iter().all(|&b| b == 0xcd));
            let second: Vec<u8> = after[4096..].to_vec();
            if revoked {
                assert!(second.iter().all(|&b| b == 0), "written after deregistration");
            } else {
                assert!(second.iter().all(|&b| b == 0xcd));
            }
        }
    }

    /// A QP of tenant 1000 in RTR, connected to QP 0x12 on the link's host
    /// (10.0.0.2) with its next PSN 5, and a region of `len` bytes at
    /// 0x10_0000 it lets that peer write: (QPN, rkey, region).
    fn qp_in_rtr(hca: &mut Hca, rings: &mut RingTable, len: usize) -> (u32, u32, vrdma_core::memory::Region) {
        let ctx = ContextId(1);
        hca.open_context(ctx, TenantId(1000)).unwrap();
        let pd = hca.alloc_pd(ctx).unwrap();
        let r = region(len, 0);
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        let key = hca.reg_mr(ctx, pd, 0x10_0000, access, r.clone()).unwrap();
        let (cq, _) = hca.create_cq(ctx, 16).unwrap();
        let cap =
            QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let init =
            QpInitAttr { qp_type: QpType::Rc, send_cq: cq, recv_cq: cq, srq: None, cap, sq_sig_all: false };
        let qpn = hca.create_qp(ctx, pd, init).unwrap().qpn;
        let to_init =
            QpAttr { qp_state: QpState::Init, port_num: 1, qp_access_flags: access, ..QpAttr::default() };
        let m = QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS;
        hca.modify_qp(ctx, qpn, &to_init, m, rings).unwrap();
        let ah = AhAttr {
            is_global: true,
            dgid: Gid::from_ipv4([10, 0, 0, 2]),
            hop_limit: 1,
            port_num: 1,
            ..AhAttr::default()
        };
        let to_rtr = QpAttr {
            qp_state: QpState::Rtr,
            path_mtu: Mtu::Mtu1024,
            dest_qp_num: 0x12,
            rq_psn: 5,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 1,
            ah_attr: ah,
            ..QpAttr::default()
        };
        let m = QpAttrMask::STATE
            | QpAttrMask::AV
            | QpAttrMask::PATH_MTU
            | QpAttrMask::DEST_QPN
            | QpAttrMask::RQ_PSN
            | QpAttrMask::MAX_DEST_RD_ATOMIC
            | QpAttrMask::MIN_RNR_TIMER;
        hca.modify_qp(ctx, qpn, &to_rtr, m, rings).unwrap();
        (qpn, key, r)
    }

    /// The driver's side of `Hca::placement_cancelled`: a write arriving
    /// for a QP that fails half way through stops being placed at once
    /// (what it had claimed may be another's by then), and the frame still
    /// ends in step with the stream.
    #[test]
    fn a_payload_for_a_qp_that_failed_meanwhile_is_not_placed() {
        let (mut link, mut theirs, mut hca, mut rings) = pair();
        let ctx = ContextId(1);
        let (qpn, key, r) = qp_in_rtr(&mut hca, &mut rings, 8192);
        // A write of 8 KiB into the region: its header and half of it come.
        let mut d = DataRepr::new(Opcode::WriteOnly, 1000, qpn, 0x12, 5);
        d.payload_len = 8192;
        d.reth = Some(Reth { va: 0x10_0000, rkey: key, dma_len: 8192 });
        let h = header(FrameRepr::Data(d));
        theirs.write_all(&h).unwrap();
        theirs.write_all(&[0xcd; 4096]).unwrap();
        let started = Clock::now();
        while !bytes(&r, 0, 4096).iter().all(|&b| b == 0xcd) && started.elapsed() < Duration::from_secs(5) {
            link.receive(&mut hca, &mut rings, Instant::ZERO).unwrap();
        }
        assert!(matches!(link.sink, Some(RxSink::Place { .. })), "the write is being placed");
        // The QP fails; the rest of the payload comes.
        let err = QpAttr { qp_state: QpState::Err, ..QpAttr::default() };
        hca.modify_qp(ctx, qpn, &err, QpAttrMask::STATE, &mut rings).unwrap();
        theirs.write_all(&[0xcd; 4096]).unwrap();
        while link.sink.is_some() && started.elapsed() < Duration::from_secs(5) {
            link.receive(&mut hca, &mut rings, Instant::ZERO).unwrap();
        }
        assert!(link.sink.is_none(), "the frame ended");
        assert!(!hca.placement_cancelled(link.id), "cleared at the frame's end");
        let after = bytes(&r, 0, 8192);
        assert!(after[..4096].iter().all(|&b| b == 0xcd));
        assert!(after[4096..].iter().all(|&b| b == 0), "written after the QP failed");
    }

    /// Payload goes from the socket straight into the region: of a stream
    /// of large frames only the first frame's first bytes, and then a few
    /// bytes behind a header, pass through the header buffer.
    #[test]
    fn large_payloads_are_read_straight_into_the_region() {
        let (mut link, mut theirs, mut hca, mut rings) = pair();
        const FRAMES: usize = 16;
        const LEN: usize = 64 << 10;
        let (qpn, key, r) = qp_in_rtr(&mut hca, &mut rings, FRAMES * LEN);
        let mut stream = Vec::new();
        for i in 0..FRAMES {
            let mut d = DataRepr::new(Opcode::WriteOnly, 1000, qpn, 0x12, 5 + i as u32);
            d.payload_len = LEN as u32;
            d.reth = Some(Reth { va: 0x10_0000 + (i * LEN) as u64, rkey: key, dma_len: LEN as u32 });
            let h = header(FrameRepr::Data(d));
            stream.extend(h);
            stream.extend(std::iter::repeat_n(i as u8 + 1, LEN));
        }
        let writer = std::thread::spawn(move || theirs.write_all(&stream).map(|()| theirs));
        let total = (FRAMES * LEN) as u64;
        let started = Clock::now();
        while link.placed_from_buffer + link.placed_direct < total
            && started.elapsed() < Duration::from_secs(10)
        {
            link.receive(&mut hca, &mut rings, Instant::ZERO).unwrap();
        }
        let _theirs = writer.join().unwrap().unwrap();
        let want: Vec<u8> = (0..FRAMES).flat_map(|i| std::iter::repeat_n(i as u8 + 1, LEN)).collect();
        assert!(bytes(&r, 0, FRAMES * LEN) == want, "the writes' bytes are in the region");
        // The first frame's first bytes, and then at most what a header
        // shorter than the longest leaves room for.
        let staged = link.placed_from_buffer;
        let bound = (READ_BUF + FRAMES * vrdma_core::wire::MAX_DATA_HEADER_LEN) as u64;
        assert!(staged <= bound, "{staged} of {total} payload bytes went through the header buffer");
    }

    #[test]
    fn a_peer_that_reads_nothing_ends_the_link_after_the_dead_time() {
        let (mut link, mut theirs, mut hca, mut rings) = pair();
        // A dead time no stretch of this test outlasts, however slow the
        // machine (with 300 ms, a thread preempted that long between the
        // keepalive read and a check below failed the check); the stall
        // is backdated past it where the test wants it over.
        let (every, dead) = (Duration::from_millis(100), Duration::from_secs(30));
        stall(&mut link, &mut hca, &mut rings);
        let since = link.stalled_since.expect("a refused write starts the stall");
        // It sends (our `last_rx` stays fresh) and reads nothing.
        theirs.write_all(&keepalive_request()).unwrap();
        while link.receive(&mut hca, &mut rings, Instant::ZERO).unwrap() {}
        assert!(link.keepalive(every, dead).is_ok(), "not yet the dead time");
        link.transmit(&mut hca, &mut rings, Instant::ZERO).unwrap();
        link.stalled_since = Some(since - dead);
        let why = link.keepalive(every, dead).expect_err("stalled for the dead time");
        assert!(why.contains("read nothing"), "{why}");

        // A peer that reads again ends the stall.
        link.push(Transmit { data: vec![0; 60 << 10], ..Transmit::default() });
        theirs.set_nonblocking(true).unwrap();
        let mut sink = vec![0u8; 1 << 20];
        let started = Clock::now();
        while link.stalled_since.is_some() && started.elapsed() < Duration::from_secs(10) {
            let _ = std::io::Read::read(&mut theirs, &mut sink);
            link.transmit(&mut hca, &mut rings, Instant::ZERO).unwrap();
        }
        assert_eq!(link.stalled_since, None, "a write that goes through ends the stall");
        assert!(link.keepalive(every, dead).is_ok());
    }
}
