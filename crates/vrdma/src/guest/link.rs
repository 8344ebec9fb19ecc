//! The guest's end of one port: calls as frames, a thread that reads the
//! port, and the doorbell proxies.
//!
//! The port can change under a live context: when the VM moves to another
//! host, the daemon it left ends the session with
//! [`EndReason::Moved`](vrdma_core::proto::guest::EndReason) and the
//! reader thread takes the context back on the daemon the port reaches
//! next (`super::reattach`). So the port is numbered (a *generation*):
//! every reply the thread hands on carries the generation it came on, and
//! a call whose port ended before its reply came is sent again on the next
//! one (the daemon answered nothing on the old one: its reply would have
//! come before the end; and a call the source ran after the context left,
//! which failed only for that, it does not answer but ends the session,
//! `docs/migration.md`). A reply, or the source's end, can also be lost
//! with the source's port (written after QEMU stopped the VM): a call
//! that waits probes the port every second, and the destination answers
//! that it holds no session there, so the context is taken back and the
//! call sent again; so does the reader thread when the port has been
//! silent for a second (a guest that makes no call, waiting on a
//! completion channel, learns it moved the same way). Such a call may
//! have run on the source before the move: calls are numbered
//! (`Frame::NumberedCall`, per context, from 1; the same number when sent
//! again), and a daemon that answered that number already (the source's
//! answer moves with the snapshot) answers it from memory without running
//! it again. The library's ends of the context's doorbells
//! stay the same descriptors across a move; only the proxy numbers they
//! are forwarded under change.

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType};
use vrdma_core::proto::guest::{
    self, EndReason, Frame, FrameDecoder, Handle, GUEST_VERSION, HELLO_ACK, PROBE_ACK,
};
use vrdma_core::proto::{Reply, Request};

use super::GuestConfig;
use crate::error::{Error, Result};

/// How long a call waits for its reply: a daemon that answers nothing for
/// this long is treated as gone (host calls have the socket's hang-up).
const REPLY_LIMIT: Duration = Duration::from_secs(60);
/// How often a call that waits for its reply probes the port, and after
/// how long a silent port is probed (see the module's doc).
const PROBE_EVERY: Duration = Duration::from_secs(1);
/// A port that brought nothing for this long while the link probed it
/// every [`PROBE_EVERY`] reaches no daemon (a live session answers each
/// probe, `PROBE_ACK`): the device is gone. Longer than a tenant's pause
/// for a migration (a call held at the pause gate holds the port's
/// answers), which its peers' bound limits to 5 s.
const DAEMON_SILENT_LIMIT: Duration = Duration::from_secs(8);
/// How long a write may wait for the port to take bytes. A virtio port
/// whose host end died can stop taking them for good (QEMU throttles it
/// when its chardev's write fails): a write that blocked there held the
/// reader thread, which then never found the daemon silent, and a guest
/// program waited for ever (`wait_port_writable` in the guest kernel).
/// Longer than a tenant's longest pause (7 s), during which its port's
/// calls are held.
pub(super) const WRITE_LIMIT: Duration = Duration::from_secs(10);

/// Writes all of `bytes` on `port`, each piece only once the port says it
/// takes bytes (`POLLOUT`), within `limit` in all: an error when the port
/// takes nothing for that long, or fails.
pub(super) fn write_within(
    port: &File,
    mut bytes: &[u8],
    limit: Duration,
) -> std::result::Result<(), String> {
    let end = Instant::now() + limit;
    while !bytes.is_empty() {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("port write: the port took no bytes for {limit:?} (its host end is gone)"));
        }
        let mut fds = [PollFd::new(port, PollFlags::OUT)];
        let ts = rustix::event::Timespec { tv_sec: left.as_secs() as _, tv_nsec: left.subsec_nanos() as _ };
        match rustix::event::poll(&mut fds, Some(&ts)) {
            Ok(0) | Err(rustix::io::Errno::INTR) => continue,
            Ok(_) => {}
            Err(e) => return Err(format!("port write: poll: {e}")),
        }
        let r = fds[0].revents();
        if r.intersects(PollFlags::ERR | PollFlags::NVAL)
            || (r.contains(PollFlags::HUP) && !r.contains(PollFlags::OUT))
        {
            return Err("port write: the port hung up".into());
        }
        if !r.contains(PollFlags::OUT) {
            continue;
        }
        match write_port(port, bytes) {
            Ok(0) => return Err("port write: the port took nothing".into()),
            Ok(n) => bytes = &bytes[n..],
            Err(rustix::io::Errno::INTR | rustix::io::Errno::AGAIN) => {}
            Err(e) => return Err(format!("port write: {e}")),
        }
    }
    Ok(())
}

/// One write to the port. A Unix socket (an emulated guest's port, its
/// daemon's end gone or refusing a port more than the VM has) is sent to
/// with `MSG_NOSIGNAL`: `write(2)` would raise `SIGPIPE`, which kills a
/// C program (ucmatose died so, where it should have read an error); a
/// virtio-serial port is a character device (`ENOTSOCK`), written.
fn write_port(port: &File, bytes: &[u8]) -> rustix::io::Result<usize> {
    use std::sync::atomic::{AtomicBool, Ordering};
    static NOT_A_SOCKET: AtomicBool = AtomicBool::new(false);
    if !NOT_A_SOCKET.load(Ordering::Relaxed) {
        match rustix::net::send(port, bytes, rustix::net::SendFlags::NOSIGNAL) {
            Err(rustix::io::Errno::NOTSOCK) => NOT_A_SOCKET.store(true, Ordering::Relaxed),
            r => return r,
        }
    }
    rustix::io::write(port, bytes)
}

/// Most wake-ups one read of a proxy forwards in one frame.
pub(super) const BELLS_AT_ONCE: u32 = 1024;
/// Beyond the reattach bound, how long a call waits for the reader thread
/// to give its verdict (it checks the bound itself).
const VERDICT_GRACE: Duration = Duration::from_secs(5);

/// Opens `path` as a port: connects if it is a Unix socket, else opens
/// the character device read-write.
pub(super) fn open_port(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::FileTypeExt;
    if std::fs::metadata(path)?.file_type().is_socket() {
        let s = std::os::unix::net::UnixStream::connect(path)?;
        return Ok(File::from(OwnedFd::from(s)));
    }
    std::fs::OpenOptions::new().read(true).write(true).open(path)
}

/// Opens the BAR read-write and notes it for the fork handler.
pub(super) fn open_bar(path: &Path) -> Result<OwnedFd> {
    let bar = std::fs::OpenOptions::new().read(true).write(true).open(path).map_err(|e| {
        Error::Io(std::io::Error::new(e.kind(), format!("cannot open the BAR {}: {e}", path.display())))
    })?;
    // From now on a forked child copies this process's mappings of the
    // BAR (rings, regions) instead of sharing them with it and the
    // daemon (`crate::rebacking`'s fork handler).
    let st = rustix::fs::fstat(&bar)?;
    crate::rebacking::note_guest_bar(st.st_dev, st.st_ino);
    Ok(OwnedFd::from(bar))
}

/// What a call's reply brought: the reply, and per handle a descriptor
/// and the offset to map it at.
pub(crate) type Carried = Vec<(OwnedFd, u64)>;

/// What the reader thread hands the caller.
pub(super) enum Msg {
    /// A reply, from port generation `gen`.
    Reply { gen: u64, reply: Reply, handles: Vec<Handle> },
    /// Port generation `gen` ended: a call sent on it gets no reply.
    Ended { gen: u64 },
}

/// Whether the link has a port to call on.
#[derive(Debug, Clone)]
pub(super) enum State {
    Up {
        gen: u64,
    },
    /// The context moved; the reader thread is taking it back.
    Down {
        since: Instant,
    },
    /// For good: the device is gone, for this reason.
    Dead {
        why: String,
    },
}

/// The context the port's session has: what a move takes back, and the
/// proxies that are its doorbell and its event signal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Bound {
    pub context: u32,
    /// The context's segment in the VM's region: offset and length.
    pub segment: (u64, u64),
    pub doorbell: u32,
    pub events: u32,
}

impl Bound {
    /// The binding a Hello-like reply gives: the context, its segment
    /// (the first handle) and its two doorbells (the next two; an
    /// adoption's reply has its completion channels' after them).
    pub fn of(reply: &Reply, handles: &[Handle]) -> Option<Bound> {
        let Reply::Hello { context, .. } = reply else { return None };
        match handles {
            [Handle::Extent { offset, len }, Handle::Bell { id: doorbell, .. }, Handle::Bell { id: events, .. }, ..] => {
                Some(Bound {
                    context: *context,
                    segment: (*offset, *len),
                    doorbell: *doorbell,
                    events: *events,
                })
            }
            _ => None,
        }
    }
}

/// Between the callers and the reader thread.
pub(super) struct Shared {
    pub cfg: GuestConfig,
    /// How long a moved context may take to be taken back.
    pub limit: Duration,
    /// The port calls and bells go out on, and its generation; `None`
    /// while the link is down.
    pub writer: Mutex<(u64, Option<File>)>,
    pub state: Mutex<State>,
    pub changed: Condvar,
    /// Proxies the reader thread serves (id -> its end), of the port
    /// generation in `.0`.
    pub proxies: Mutex<(u64, HashMap<u32, OwnedFd>)>,
    pub bound: Mutex<Option<Bound>>,
    /// The BAR (reopened after a move: the same file in a real guest).
    pub bar: Mutex<Arc<OwnedFd>>,
    /// The completion channels' proxies (proxy id -> the channel's
    /// number), which move with the context (`super::reattach`).
    pub channels: Mutex<HashMap<u32, u32>>,
    /// Each channel's ring and fd (the library's end of its proxy), by
    /// number: a move matches its wake-ups to its events again. Weak: the
    /// channel closes when the application drops it, and the reader
    /// thread never holds the last reference for long.
    pub channel_ends: Mutex<HashMap<u32, Weak<crate::channel_core::ChannelCore>>>,
    /// The rdma_cm event channels' proxies (proxy id -> the channel's
    /// number), which move with the context too (snapshot version 5).
    pub cm_channels: Mutex<HashMap<u32, u32>>,
    /// Each rdma_cm channel's library side, by number: a move matches its
    /// descriptor's wake-ups to its events again (`MovedCmChannel`).
    pub cm_ends: Mutex<HashMap<u32, Weak<dyn MovedCmChannel>>>,
    /// Set when the link is dropped: the reader thread ends, and with it
    /// the port is closed (so that the next opener may take it).
    pub quit: AtomicBool,
    /// Replies the reader thread handed to callers and whose notes
    /// (`call_noting`'s `note`, which keeps an rdma_cm reply's events)
    /// have not finished: a move waits for none before it matches the
    /// rdma_cm channels' wake-ups to their kept events again
    /// (`super::reattach`, `MovedCmChannel`). Noted after the move, a
    /// reply's event was kept with a wake-up the move had dropped and not
    /// rung again (found in review, 2026-11-28).
    pub unnoted: Mutex<u64>,
    /// Signalled as `unnoted` falls to 0.
    pub noted: Condvar,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every value under these locks stays consistent across a panic.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// A reply handed to callers was noted, or dropped (see `unnoted`).
    pub fn reply_noted(&self) {
        let mut n = lock(&self.unnoted);
        *n = n.saturating_sub(1);
        if *n == 0 {
            self.noted.notify_all();
        }
    }

    /// Waits until every reply handed to callers is noted, at most
    /// `limit`: one no caller takes (it gave up waiting) is dropped by the
    /// next call only.
    pub fn wait_replies_noted(&self, limit: Duration) {
        let end = Instant::now() + limit;
        let mut n = lock(&self.unnoted);
        while *n > 0 {
            let now = Instant::now();
            if now >= end {
                tracing::debug!(
                    unnoted = *n,
                    "vrdma: moving on with replies not noted (no caller took them)"
                );
                return;
            }
            n = self.noted.wait_timeout(n, end - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Writes `f` on port generation `gen`, if that is the port now.
    pub fn send(&self, gen: u64, f: &Frame) -> std::result::Result<(), String> {
        let mut w = lock(&self.writer);
        match &mut *w {
            (g, Some(port)) if *g == gen => write_within(port, &guest::encode(f), WRITE_LIMIT),
            _ => Err("the port changed".into()),
        }
    }

    pub fn set_state(&self, s: State) {
        *lock(&self.state) = s;
        self.changed.notify_all();
    }
}

/// The guest's end of one port.
pub(crate) struct GuestLink {
    shared: Arc<Shared>,
    /// One call at a time on a port: the reply that comes is ours. Under
    /// it, the number of the context's next numbered call (from 1).
    replies: Mutex<(Receiver<Msg>, u64)>,
    /// Written to make the reader thread poll the new proxies too, or
    /// notice that the link is dropped.
    wake: OwnedFd,
    /// The library's end of a pair whose other end the reader thread
    /// drops when the port dies for good: it hangs up then, as a host
    /// control socket does when the daemon goes.
    gone: OwnedFd,
}

impl Drop for GuestLink {
    fn drop(&mut self) {
        self.shared.quit.store(true, Ordering::Release);
        let _ = rustix::io::write(&self.wake, &[1]);
        // A socket (an emulated guest's port) closes for the daemon at
        // once; a character device is closed when the thread ends.
        let w = lock(&self.shared.writer);
        if let (_, Some(port)) = &*w {
            let _ = rustix::net::shutdown(port, rustix::net::Shutdown::Both);
        }
    }
}

impl std::fmt::Debug for GuestLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestLink").finish_non_exhaustive()
    }
}

impl GuestLink {
    /// Opens the first port of `cfg` that opens, maps nothing yet, and
    /// says Hello on it.
    pub fn open(cfg: &GuestConfig) -> Result<GuestLink> {
        Self::open_with(cfg, super::reattach_limit())
    }

    /// [`open`](Self::open), taking a moved context back within `limit`.
    pub(super) fn open_with(cfg: &GuestConfig, limit: Duration) -> Result<GuestLink> {
        let mut last = None;
        let port = cfg.ports.iter().find_map(|p| match open_port(p) {
            Ok(f) => Some(f),
            Err(e) => {
                last = Some((p.clone(), e));
                None
            }
        });
        let port = match (port, last) {
            (Some(p), _) => p,
            (None, Some((path, source))) => return Err(Error::Connect { path, source }),
            (None, None) => return Err(Error::protocol("guest mode without a port")),
        };
        let bar = open_bar(&cfg.bar)?;
        let reader = port.try_clone()?;
        let (wake_tx, wake_rx) =
            rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC | rustix::pipe::PipeFlags::NONBLOCK)
                .map(|(r, w)| (w, r))?;
        let (gone, gone_far) =
            rustix::net::socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?;
        let (tx, rx) = std::sync::mpsc::channel();
        let shared = Arc::new(Shared {
            cfg: cfg.clone(),
            limit,
            writer: Mutex::new((1, Some(port))),
            state: Mutex::new(State::Up { gen: 1 }),
            changed: Condvar::new(),
            proxies: Mutex::new((1, HashMap::new())),
            bound: Mutex::new(None),
            bar: Mutex::new(Arc::new(bar)),
            channels: Mutex::new(HashMap::new()),
            channel_ends: Mutex::new(HashMap::new()),
            cm_channels: Mutex::new(HashMap::new()),
            cm_ends: Mutex::new(HashMap::new()),
            quit: AtomicBool::new(false),
            unnoted: Mutex::new(0),
            noted: Condvar::new(),
        });
        let thread = Reader {
            shared: shared.clone(),
            port: reader,
            gen: 1,
            dec: FrameDecoder::new(),
            synced: false,
            replies: tx,
            wake: wake_rx,
            _gone: gone_far,
        };
        std::thread::Builder::new().name("vrdma-guest".into()).spawn(move || thread.run())?;
        let link = GuestLink { shared, replies: Mutex::new((rx, 1)), wake: wake_tx, gone };
        link.shared
            .send(1, &Frame::Hello { version: GUEST_VERSION })
            .map_err(|e| Error::Io(std::io::Error::other(e)))?;
        Ok(link)
    }

    /// The descriptor that hangs up when the port dies for good.
    pub fn gone_fd(&self) -> &OwnedFd {
        &self.gone
    }

    /// The error of a link that is gone for good.
    fn dead(&self) -> Error {
        let why = match &*lock(&self.shared.state) {
            State::Dead { why } => why.clone(),
            _ => "the port closed".into(),
        };
        Error::Io(std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            format!("the vRDMA device is gone: {why}"),
        ))
    }

    /// The port generation to call on, waiting while the context is being
    /// taken back (up to the bound, and a grace for the verdict).
    fn wait_up(&self) -> Result<u64> {
        let mut st = lock(&self.shared.state);
        loop {
            let until = match &*st {
                State::Up { gen } => return Ok(*gen),
                State::Dead { .. } => {
                    drop(st);
                    return Err(self.dead());
                }
                State::Down { since } => *since + self.shared.limit + VERDICT_GRACE,
            };
            let now = Instant::now();
            if now >= until {
                drop(st);
                return Err(self.dead());
            }
            st = self.shared.changed.wait_timeout(st, until - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Waits (briefly) until port generation `gen` is no longer the one
    /// up: its write failed, and the reader thread will see why.
    fn wait_past(&self, gen: u64) {
        let st = lock(&self.shared.state);
        if matches!(&*st, State::Up { gen: g } if *g == gen) {
            let _ = self.shared.changed.wait_timeout(st, Duration::from_millis(100));
        }
    }

    /// [`call_noting`](Self::call_noting) with nothing to note.
    #[cfg(test)]
    pub fn call(&self, req: &Request) -> Result<(Reply, Carried)> {
        self.call_noting(req, |_| ()).map(|(answer, ())| answer)
    }

    /// Sends `req` and waits for its reply; the handles become
    /// descriptors (a BAR descriptor and the extent's offset, or the
    /// library's end of a new proxy and 0). While the context is being
    /// taken back after a move, the call waits for it (bounded); a call
    /// the old port did not answer goes again on the new one. `note` runs
    /// on the reply before the port takes another call (see
    /// `Control::call_noting`).
    pub fn call_noting<R>(
        &self,
        req: &Request,
        note: impl FnOnce(&Reply) -> R,
    ) -> Result<((Reply, Carried), R)> {
        let mut calls = lock(&self.replies);
        // Numbered, but for the calls that open a context: sent again
        // after a move (below), it is answered with the first one's reply
        // if the source ran it, and not run twice (`docs/vms.md`,
        // "Numbered calls"). The number is the call's, whichever port.
        let frame = if matches!(req, Request::Hello { .. } | Request::AdoptContext { .. }) {
            Frame::Call(req.clone())
        } else {
            let number = calls.1;
            calls.1 += 1;
            Frame::NumberedCall { number, req: req.clone() }
        };
        let replies = &calls.0;
        loop {
            let gen = self.wait_up()?;
            if self.shared.send(gen, &frame).is_err() {
                self.wait_past(gen);
                continue;
            }
            let sent = Instant::now();
            let answered = loop {
                match replies.recv_timeout(PROBE_EVERY) {
                    Ok(Msg::Reply { gen: g, reply, handles }) if g == gen => break Some((reply, handles)),
                    Ok(Msg::Ended { gen: g }) if g == gen => break None,
                    // From a port before this call's: not ours.
                    Ok(Msg::Reply { .. }) => self.shared.reply_noted(),
                    Ok(_) => {}
                    Err(RecvTimeoutError::Timeout) if sent.elapsed() >= REPLY_LIMIT => {
                        return Err(crate::control::gone())
                    }
                    // A reply the VM's move lost (written into the source
                    // host's port after QEMU stopped the VM) never comes,
                    // nor does the source's `Ended`: a probe lets the daemon
                    // the port reaches now say that it holds no session
                    // (`NoSession`), and the context is taken back there,
                    // this call sent again. A daemon holding the session
                    // ignores it.
                    Err(RecvTimeoutError::Timeout) => {
                        let _ = self.shared.send(gen, &Frame::Pong { nonce: 0 });
                    }
                    Err(RecvTimeoutError::Disconnected) => return Err(self.dead()),
                }
            };
            // The port ended before answering: the call again, on the next.
            let Some((reply, handles)) = answered else { continue };
            let noted = note(&reply);
            self.shared.reply_noted();
            drop(calls);
            if matches!(req, Request::Hello { .. } | Request::AdoptContext { .. }) {
                if let Some(b) = Bound::of(&reply, &handles) {
                    *lock(&self.shared.bound) = Some(b);
                }
            }
            let mut carried = Vec::new();
            let bells: Vec<u32> = handles
                .iter()
                .filter_map(|h| if let Handle::Bell { id, .. } = h { Some(*id) } else { None })
                .collect();
            for h in handles {
                carried.push(match h {
                    Handle::Extent { offset, .. } => (self.bar()?, offset),
                    Handle::Bell { id, hangup } => (self.proxy(gen, id, hangup)?, 0),
                });
            }
            // A completion channel's doorbell (its only bell): noted, so
            // that the channel moves with the context.
            if let (Reply::CompChannel { channel, .. }, [id]) = (&reply, bells.as_slice()) {
                lock(&self.shared.channels).insert(*id, *channel);
            }
            // An rdma_cm event channel's too.
            if let (Reply::Cm(vrdma_core::proto::CmReply::Channel { channel }), [id]) =
                (&reply, bells.as_slice())
            {
                lock(&self.shared.cm_channels).insert(*id, *channel);
            }
            return Ok(((reply, carried), noted));
        }
    }

    /// Makes proxy `id` of port generation `gen`: the reader thread keeps
    /// one end, the library gets the other.
    fn proxy(&self, gen: u64, id: u32, hangup: bool) -> Result<OwnedFd> {
        let ty = if hangup { SocketType::SEQPACKET } else { SocketType::DGRAM };
        let (mine, theirs) = rustix::net::socketpair(
            AddressFamily::UNIX,
            ty,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )?;
        {
            let mut p = lock(&self.shared.proxies);
            if p.0 != gen {
                return Err(Error::protocol("the VM moved while a doorbell was being made"));
            }
            p.1.insert(id, theirs);
        }
        let _ = rustix::io::write(&self.wake, &[1]);
        Ok(mine)
    }

    /// Notes completion channel `channel`'s ring and fd, so that a move
    /// matches its wake-ups to its events again (`crate::channel_core`).
    pub(crate) fn note_channel(&self, channel: u32, end: Weak<crate::channel_core::ChannelCore>) {
        let mut ends = lock(&self.shared.channel_ends);
        ends.retain(|_, e| e.strong_count() > 0);
        ends.insert(channel, end);
    }

    /// Notes rdma_cm event channel `channel`'s library side, so that a
    /// move matches its descriptor's wake-ups to its events again.
    pub(crate) fn note_cm_channel(&self, channel: u32, end: Weak<dyn MovedCmChannel>) {
        let mut ends = lock(&self.shared.cm_ends);
        ends.retain(|_, e| e.strong_count() > 0);
        ends.insert(channel, end);
    }

    /// The BAR, to map extents of it.
    pub fn bar_fd(&self) -> Arc<OwnedFd> {
        lock(&self.shared.bar).clone()
    }

    /// A descriptor of the BAR, to map extents of it.
    pub fn bar(&self) -> Result<OwnedFd> {
        Ok(self.bar_fd().try_clone()?)
    }
}

/// Why [`Reader::serve`] stopped.
enum Stop {
    /// The link was dropped.
    Quit,
    /// The daemon ended the session and said why.
    Ended(EndReason),
    /// The port broke or closed: the device is gone.
    Lost(String),
}

/// The thread that reads the port.
pub(super) struct Reader {
    pub shared: Arc<Shared>,
    pub port: File,
    /// The port's generation.
    pub gen: u64,
    pub dec: FrameDecoder,
    /// The daemon's `HELLO_ACK` came on this port: frames before it were
    /// written for an earlier opener and are dropped.
    pub synced: bool,
    replies: Sender<Msg>,
    pub wake: OwnedFd,
    /// Dropped with the thread: the library's `gone` end hangs up.
    _gone: OwnedFd,
}

impl Reader {
    fn run(mut self) {
        loop {
            match self.serve() {
                Stop::Quit => break,
                Stop::Lost(why) => {
                    tracing::debug!(%why, "vrdma guest port closed");
                    self.shared.set_state(State::Dead { why });
                    break;
                }
                Stop::Ended(reason) => {
                    // Calls wait from now on; one waiting for a reply on
                    // this port goes again on the next.
                    *lock(&self.shared.writer) = (self.gen, None);
                    self.shared.set_state(State::Down { since: Instant::now() });
                    let _ = self.replies.send(Msg::Ended { gen: self.gen });
                    if let Err(why) = self.reattach(reason) {
                        tracing::warn!(%why, "vrdma: the VM's context could not be taken back");
                        self.shared.set_state(State::Dead { why });
                        break;
                    }
                }
            }
        }
        // Every proxy end closes: hang-up ends wake their pollers.
        lock(&self.shared.proxies).1.clear();
    }

    fn send(&self, f: &Frame) -> std::result::Result<(), String> {
        self.shared.send(self.gen, f)
    }

    /// Serves the port until it ends.
    fn serve(&mut self) -> Stop {
        match self.serve_inner() {
            Ok(stop) | Err(stop) => stop,
        }
    }

    fn serve_inner(&mut self) -> std::result::Result<Stop, Stop> {
        let mut buf = vec![0u8; 64 << 10];
        let lost = Stop::Lost;
        // Frames that came with the reply that opened this port.
        if let Some(stop) = self.frames()? {
            return Ok(stop);
        }
        // When the port last brought a byte, and when this thread last
        // probed it (see `probe_if_silent`).
        let mut heard = Instant::now();
        let mut probed = heard;
        loop {
            // Snapshot of the proxies to poll (raw numbers: the map may
            // change meanwhile, a stale number only costs a spurious read).
            let ids: Vec<(u32, i32)> =
                lock(&self.shared.proxies).1.iter().map(|(id, fd)| (*id, fd.as_raw_fd())).collect();
            let mut ready = Vec::new();
            let port_ready;
            {
                // SAFETY: each raw fd is owned by `shared.proxies`. Entries
                // are removed only by this thread (Close frames, hang-ups
                // and moves, handled after the poll); another thread only
                // inserts, under ids the daemon numbers afresh within a
                // session (never one in the map), so no fd polled here is
                // closed meanwhile.
                let borrowed: Vec<_> =
                    ids.iter().map(|(_, fd)| unsafe { std::os::fd::BorrowedFd::borrow_raw(*fd) }).collect();
                let mut fds =
                    vec![PollFd::new(&self.port, PollFlags::IN), PollFd::new(&self.wake, PollFlags::IN)];
                fds.extend(borrowed.iter().map(|b| PollFd::new(b, PollFlags::IN)));
                let quiet =
                    PROBE_EVERY.saturating_sub(heard.max(probed).elapsed()).max(Duration::from_millis(1));
                let timeout = rustix::event::Timespec {
                    tv_sec: quiet.as_secs() as _,
                    tv_nsec: quiet.subsec_nanos() as _,
                };
                match rustix::event::poll(&mut fds, Some(&timeout)) {
                    Ok(_) => {}
                    Err(rustix::io::Errno::INTR) => continue,
                    Err(e) => return Err(lost(format!("poll: {e}"))),
                }
                let hit = |r: PollFlags| r.intersects(PollFlags::IN | PollFlags::HUP | PollFlags::ERR);
                port_ready = hit(fds[0].revents());
                if hit(fds[1].revents()) {
                    let _ = rustix::io::read(&self.wake, &mut [0u8; 64]);
                }
                for ((id, _), f) in ids.iter().zip(fds.iter().skip(2)) {
                    if hit(f.revents()) {
                        ready.push(*id);
                    }
                }
            }
            if self.shared.quit.load(Ordering::Acquire) {
                return Ok(Stop::Quit);
            }
            for id in ready {
                self.forward(id).map_err(lost)?;
            }
            if !port_ready {
                self.probe_if_silent(heard, &mut probed).map_err(lost)?;
                continue;
            }
            heard = Instant::now();
            let n = match self.port.read(&mut buf) {
                Ok(0) => return Err(lost("the daemon closed the port".into())),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(lost(format!("port read: {e}"))),
            };
            self.dec.push(&buf[..n]);
            if let Some(stop) = self.frames()? {
                return Ok(stop);
            }
        }
    }

    /// Probes the port (`Pong` with nonce 0) once a second while it is
    /// silent and the link has a context. A daemon holding the session
    /// pings it every `ping_ms` and ignores the probe; a port that stays
    /// silent may reach a daemon with no session on it: the destination
    /// of a move whose source's `Ended` was lost with the source QEMU.
    /// That daemon answers `Ended { NoSession }`, and the context is
    /// taken back. Without the probe nothing would tell a guest that
    /// makes no call (a program waiting on a completion channel, its
    /// CQ's wake-ups held in the destination's doorbell until the
    /// adoption) that it moved: it would wait for ever.
    ///
    /// A daemon holding the session answers the probe (`PROBE_ACK`), so a
    /// port silent for [`DAEMON_SILENT_LIMIT`] reaches no daemon: the
    /// device is gone (a daemon killed under a running guest; the port's
    /// hang-up did not reach the guest in 4 of 18 real-guest runs, and
    /// its program, making no call, waited for ever).
    fn probe_if_silent(&self, heard: Instant, probed: &mut Instant) -> std::result::Result<(), String> {
        if heard.elapsed() < PROBE_EVERY || probed.elapsed() < PROBE_EVERY {
            return Ok(());
        }
        *probed = Instant::now();
        if lock(&self.shared.bound).is_some() {
            if heard.elapsed() >= DAEMON_SILENT_LIMIT {
                return Err(format!("the daemon answered no probe of the port for {:?}", heard.elapsed()));
            }
            let _ = self.send(&Frame::Pong { nonce: 0 });
        }
        Ok(())
    }

    /// Handles the complete frames decoded; `Some` when the session ended.
    fn frames(&mut self) -> std::result::Result<Option<Stop>, Stop> {
        loop {
            match self.dec.next_frame() {
                Ok(Some(f)) if !self.synced => self.before_ack(f),
                Ok(Some(Frame::Ended { reason })) => return Ok(Some(Stop::Ended(reason))),
                Ok(Some(f)) => self.on_frame(f).map_err(Stop::Lost)?,
                Ok(None) => return Ok(None),
                Err(e) if e.is_fatal() => {
                    return Err(Stop::Lost(format!("the daemon broke the frame stream: {e}")))
                }
                // A bad body (an end for a reason this library does not
                // know, from a newer daemon): skipped.
                Err(e) => tracing::debug!(error = %e, "vrdma: skipping a frame from the daemon"),
            }
        }
    }

    /// Forwards what the library rang on proxy `id`.
    fn forward(&self, id: u32) -> std::result::Result<(), String> {
        let mut count = 0;
        let mut closed = false;
        {
            let proxies = lock(&self.shared.proxies);
            let Some(fd) = proxies.1.get(&id) else { return Ok(()) };
            let seqpacket =
                rustix::net::sockopt::socket_type(fd.as_fd()).is_ok_and(|t| t == SocketType::SEQPACKET);
            while count < BELLS_AT_ONCE {
                match rustix::net::recv(fd, &mut [0u8; 8], RecvFlags::DONTWAIT) {
                    Ok((0, _)) if seqpacket => {
                        closed = true;
                        break;
                    }
                    Ok(_) => count += 1,
                    Err(rustix::io::Errno::INTR) => {}
                    Err(_) => break,
                }
            }
            if count == 0 && !closed {
                closed = true;
            }
        }
        if count > 0 {
            self.send(&Frame::Bell { id, count })?;
        }
        if closed {
            lock(&self.shared.proxies).1.remove(&id);
            self.send(&Frame::Close { id })?;
        }
        Ok(())
    }

    /// A frame before the daemon's `HELLO_ACK`: the ack syncs the port;
    /// anything else was written for an earlier opener of the port (a
    /// program that exited before reading its last reply, or an `Ended`
    /// for its session) and is dropped: taken as this program's, a stale
    /// reply answered its Hello and the device was not found.
    fn before_ack(&mut self, f: Frame) {
        match f {
            Frame::Ping { nonce: HELLO_ACK } => self.synced = true,
            f => {
                tracing::debug!(frame = ?f, "vrdma: dropping a frame written for the port's previous opener")
            }
        }
    }

    fn on_frame(&self, f: Frame) -> std::result::Result<(), String> {
        match f {
            Frame::Reply { reply, handles } => {
                // No caller waiting (it timed out): dropped by the next.
                *lock(&self.shared.unnoted) += 1;
                if self.replies.send(Msg::Reply { gen: self.gen, reply, handles }).is_err() {
                    self.shared.reply_noted();
                }
            }
            Frame::Bell { id, count } => {
                let proxies = lock(&self.shared.proxies);
                if let Some(fd) = proxies.1.get(&id) {
                    for _ in 0..count.min(BELLS_AT_ONCE) {
                        if rustix::net::send(fd, &[1], SendFlags::DONTWAIT).is_err() {
                            break;
                        }
                    }
                }
            }
            Frame::Close { id } => {
                lock(&self.shared.proxies).1.remove(&id);
                // A destroyed channel's: nothing of it moves any more.
                lock(&self.shared.channels).remove(&id);
                lock(&self.shared.cm_channels).remove(&id);
            }
            // Answers to this link's own probes and Hello: nothing owed.
            Frame::Ping { nonce: PROBE_ACK | HELLO_ACK } => {}
            Frame::Ping { nonce } => self.send(&Frame::Pong { nonce })?,
            // `frames` stops at an end before handing frames here.
            Frame::Ended { .. } => {}
            Frame::Hello { .. } | Frame::Call(_) | Frame::NumberedCall { .. } | Frame::Pong { .. } => {
                return Err("the daemon sent a guest's frame".into());
            }
        }
        Ok(())
    }
}

/// An rdma_cm event channel's library side, told that its context moved
/// (`super::reattach`). Its events wait in the daemon (they moved with
/// the snapshot, and the destination rang one wake-up for each on the new
/// doorbell); the wake-ups the source rang do not move (some never reached
/// the VM). So, with its readers held off: every wake-up its descriptor
/// holds is dropped, and `ring` is told how many to ring again for the
/// events the library kept from replies whose wake-ups were in it. The
/// count of (dropped, rung).
pub(crate) trait MovedCmChannel: Send + Sync {
    fn moved(&self, ring: &mut dyn FnMut(usize)) -> (usize, usize);
}

#[cfg(test)]
mod write_tests {
    use super::*;

    fn pair() -> (File, OwnedFd) {
        let (a, b) =
            rustix::net::socketpair(AddressFamily::UNIX, SocketType::STREAM, SocketFlags::CLOEXEC, None)
                .unwrap();
        (File::from(a), b)
    }

    /// A write on a port socket whose far end is gone is an error, not a
    /// `SIGPIPE`: checked in a child process of this test binary with the
    /// signal's default action (Rust programs ignore it; C programs do
    /// not), where the signal would kill the child.
    #[test]
    fn a_write_on_a_port_whose_far_end_is_gone_raises_no_sigpipe() {
        const CHILD: &str = "VRDMA_TEST_SIGPIPE_CHILD";
        if std::env::var_os(CHILD).is_some() {
            // SAFETY: restores the default action of one signal.
            unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
            let (port, far) = pair();
            drop(far);
            let r = write_within(&port, b"hello", Duration::from_secs(1));
            assert!(r.is_err(), "{r:?}");
            return;
        }
        let name = "guest::link::write_tests::a_write_on_a_port_whose_far_end_is_gone_raises_no_sigpipe";
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([name, "--exact", "--nocapture", "--test-threads", "1"])
            .env(CHILD, "1")
            .output()
            .unwrap();
        let said =
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "the child: {:?}\n{said}", out.status);
        assert!(said.contains("1 passed"), "the child ran no test\n{said}");
    }

    /// A port whose far end takes no more bytes (a throttled virtio port,
    /// a daemon that stopped reading) fails the write within its limit
    /// instead of holding the writer for ever; one that hung up fails at
    /// once; a reading one takes every byte.
    #[test]
    fn a_write_on_a_port_that_takes_nothing_fails_within_its_limit() {
        let (port, far) = pair();
        let chunk = vec![0x5au8; 64 << 10];
        // Fill what the socket buffers hold: the far end never reads.
        let start = Instant::now();
        let e = loop {
            if let Err(e) = write_within(&port, &chunk, Duration::from_millis(200)) {
                break e;
            }
            assert!(start.elapsed() < Duration::from_secs(20), "the buffers never filled");
        };
        assert!(e.contains("took no bytes"), "{e}");
        drop(far);
        let e = write_within(&port, b"x", Duration::from_secs(20)).unwrap_err();
        assert!(e.contains("hung up") || e.contains("port write"), "{e}");
        assert!(start.elapsed() < Duration::from_secs(20));

        let (port, far) = pair();
        let reader = std::thread::spawn(move || {
            let mut got = 0usize;
            let mut buf = vec![0u8; 64 << 10];
            while let Ok(n @ 1..) = rustix::io::read(&far, &mut buf) {
                got += n;
            }
            got
        });
        let big = vec![7u8; 4 << 20];
        write_within(&port, &big, Duration::from_secs(20)).unwrap();
        drop(port);
        assert_eq!(reader.join().unwrap(), big.len());
    }
}
