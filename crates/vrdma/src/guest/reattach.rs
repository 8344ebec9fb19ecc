//! Taking a moved context back (`docs/migration.md`, "The guest takes
//! its context back").
//!
//! When the VM moves, QEMU moves its memory (the BAR with every ring and
//! region the library mapped, at the same offsets) and reconnects its
//! ports to the destination's daemon; the daemon the context left ends the
//! port's session with [`EndReason::Moved`] (the destination, reached
//! under a live context, answers [`EndReason::NoSession`]). The link's
//! reader thread then, up to the bound (`VRDMA_GUEST_REATTACH_MS`, 30 s):
//!
//! 1. keeps the library's ends of the context's doorbell, event signal,
//!    completion channels and rdma_cm event channels (the application's
//!    handles use them) and closes every other proxy;
//! 2. closes the port and opens one again (an emulated guest's socket;
//!    a virtio port, which QEMU reconnects to the destination, is the
//!    same device, closed first as it is exclusive) and says Hello, then
//!    `AdoptContext` with the
//!    context's number, again and again (the destination may not have
//!    imported it yet, the port may still reach the old host) until the
//!    daemon hands the context over, with its segment where it was;
//! 3. forwards the kept ends under the new proxies' numbers, reopens the
//!    BAR (the same file in a real guest), and rings the new doorbell once,
//!    so that the engine there looks at what was posted meanwhile. A
//!    completion channel the daemon handed back (by its number, in the
//!    reply) first has its fd's wake-ups matched to its events again
//!    (`crate::channel_core`: some of the source's never reached the
//!    VM), so that the fd is readable exactly while events are unread. A
//!    channel not handed back closes, as before.
//!
//! Meanwhile posts and polls go on in the rings (memory); calls that need
//! the daemon wait. After the bound the link is dead: calls fail, the
//! event signal hangs up (`IBV_EVENT_DEVICE_FATAL`).

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};
use vrdma_core::proto::guest::{self, EndReason, Frame, FrameDecoder, GUEST_VERSION, HELLO_ACK};
use vrdma_core::proto::{Reply, Request, PROTOCOL_VERSION};

use super::link::{
    lock, open_bar, open_port, write_within, Bound, Reader, State, BELLS_AT_ONCE, WRITE_LIMIT,
};

/// How long one adoption waits for the daemon's reply.
const ADOPT_REPLY_LIMIT: Duration = Duration::from_secs(5);
/// The first pause between tries, doubled up to [`MOST_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(10);
const MOST_PAUSE: Duration = Duration::from_millis(200);
/// Longest a move waits for the replies of the old port handed to callers
/// to be noted (see `Shared::unnoted`): a note takes microseconds; a
/// reply no caller takes is waited for this long.
const NOTE_WAIT: Duration = Duration::from_secs(1);

/// Why one try failed.
enum Failed {
    /// Worth another try (no port yet, the context not imported yet).
    Again(String),
    /// Not: the daemon handed over something else than the context.
    Never(String),
}

/// A port on which the context was adopted, and its new doorbells.
struct Adopted {
    port: File,
    dec: FrameDecoder,
    bound: Bound,
    /// The completion channels handed back: number -> new proxy, and the
    /// ring's producer index at the import.
    channels: HashMap<u32, (u32, u32)>,
}

impl Reader {
    /// Takes the context back after the session ended for `reason`; on
    /// success the reader serves the new port.
    pub(super) fn reattach(&mut self, reason: EndReason) -> Result<(), String> {
        let Some(bound) = *lock(&self.shared.bound) else {
            return Err(format!("the port's session ended ({reason:?}) before it had a context"));
        };
        tracing::info!(context = bound.context, ?reason, "vrdma: the VM's context moved; taking it back");
        // Completion and rdma_cm event channels are kept for the
        // destination; any other proxy closes now.
        {
            let mut p = lock(&self.shared.proxies);
            let mut chans = lock(&self.shared.channels);
            let mut cm = lock(&self.shared.cm_channels);
            p.1.retain(|id, _| {
                *id == bound.doorbell || *id == bound.events || chans.contains_key(id) || cm.contains_key(id)
            });
            chans.retain(|id, _| p.1.contains_key(id));
            cm.retain(|id, _| p.1.contains_key(id));
        }
        // The port is let go and opened again: a new connection for an
        // emulated guest's socket; for a virtio port (exclusive: it must be
        // closed first) the same device, which QEMU reconnects on the
        // destination, with nothing left of the old session's stream in
        // it. Either way no reply meant for a call of the old session can
        // be taken for the adoption's.
        let _ = rustix::net::shutdown(&self.port, rustix::net::Shutdown::Both);
        match File::open("/dev/null") {
            Ok(placeholder) => drop(std::mem::replace(&mut self.port, placeholder)),
            Err(e) => tracing::warn!(error = %e, "vrdma: cannot let the port go (no /dev/null)"),
        }
        let start = Instant::now();
        let end = start + self.shared.limit;
        let mut pause = FIRST_PAUSE;
        loop {
            if self.shared.quit.load(Ordering::Acquire) {
                return Err("the context was closed".into());
            }
            let last = match self.adopt(&bound) {
                Ok(a) => {
                    self.install(bound, a);
                    tracing::info!(context = bound.context, after = ?start.elapsed(), "vrdma: context taken back");
                    return Ok(());
                }
                Err(Failed::Never(why)) => return Err(why),
                Err(Failed::Again(why)) => why,
            };
            let now = Instant::now();
            if now >= end {
                return Err(format!(
                    "the VM's context {:#x} moved and was not taken back within {:?} (last try: {last})",
                    bound.context, self.shared.limit
                ));
            }
            self.nap(pause.min(end - now));
            pause = (pause * 2).min(MOST_PAUSE);
        }
    }

    /// Sleeps `d`, or less if the link is dropped.
    fn nap(&self, d: Duration) {
        let ts = Timespec::try_from(d).ok();
        let mut fds = [PollFd::new(&self.wake, PollFlags::IN)];
        let _ = rustix::event::poll(&mut fds, ts.as_ref());
    }

    /// One try: a port, Hello, `AdoptContext`, the reply.
    fn adopt(&self, bound: &Bound) -> Result<Adopted, Failed> {
        let mut errors = Vec::new();
        // Any of the VM's ports will do: the context is named.
        let mut port = self
            .shared
            .cfg
            .ports
            .iter()
            .find_map(|p| open_port(p).map_err(|e| errors.push(format!("{}: {e}", p.display()))).ok())
            .ok_or_else(|| Failed::Again(format!("no port opens ({})", errors.join(", "))))?;
        let adopt = Request::AdoptContext { version: PROTOCOL_VERSION, context: bound.context };
        let mut out = guest::encode(&Frame::Hello { version: GUEST_VERSION });
        out.extend(guest::encode(&Frame::Call(adopt)));
        write_within(&port, &out, WRITE_LIMIT).map_err(Failed::Again)?;
        // A try that was sent waits for its answer (bounded), even past
        // the reattach bound: the daemon answers it anyway, and an
        // answer left unread stays in a virtio port (QEMU reads the
        // chardev only while the guest holds the port open) for the
        // port's next opener, whose Hello then took this try's
        // `HELLO_ACK` and refusal ("nothing to adopt") as its own: the
        // device was not found (a real guest's next program after a
        // context that was never taken back, half of the runs under
        // load). A daemon alive answers in milliseconds; a dead one
        // costs this wait once.
        let until = Instant::now() + ADOPT_REPLY_LIMIT;
        let mut dec = FrameDecoder::new();
        let mut buf = vec![0u8; 64 << 10];
        // Frames before the daemon's `HELLO_ACK` were written for an
        // earlier opener of the port: not this adoption's reply.
        let mut synced = false;
        let (reply, handles) = loop {
            match dec.next_frame() {
                Ok(Some(Frame::Ping { nonce: HELLO_ACK })) => {
                    synced = true;
                    continue;
                }
                Ok(Some(Frame::Reply { reply, handles })) if synced => break (reply, handles),
                Ok(Some(Frame::Ping { nonce })) => {
                    write_within(&port, &guest::encode(&Frame::Pong { nonce }), WRITE_LIMIT)
                        .map_err(Failed::Again)?;
                    continue;
                }
                // Nothing else is ours before the reply.
                Ok(Some(_)) => continue,
                Ok(None) => {}
                Err(e) if e.is_fatal() => return Err(Failed::Again(format!("the frame stream broke: {e}"))),
                Err(_) => continue,
            }
            let now = Instant::now();
            if now >= until || self.shared.quit.load(Ordering::Acquire) {
                return Err(Failed::Again("no answer to the adoption".into()));
            }
            let ts = Timespec::try_from(until - now).ok();
            let mut fds = [PollFd::new(&port, PollFlags::IN), PollFd::new(&self.wake, PollFlags::IN)];
            match rustix::event::poll(&mut fds, ts.as_ref()) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(Failed::Again(format!("poll: {e}"))),
            }
            if fds[1].revents().contains(PollFlags::IN) {
                let _ = rustix::io::read(&self.wake, &mut [0u8; 64]);
            }
            if !fds[0].revents().intersects(PollFlags::IN | PollFlags::HUP | PollFlags::ERR) {
                continue;
            }
            match port.read(&mut buf) {
                Ok(0) => return Err(Failed::Again("the port closed".into())),
                Ok(n) => dec.push(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Failed::Again(format!("port read: {e}"))),
            }
        };
        match (&reply, Bound::of(&reply, &handles)) {
            (Reply::Error { errno, message }, _) => {
                Err(Failed::Again(format!("adopting: {message} (errno {errno})")))
            }
            (Reply::Hello { channels, .. }, Some(b))
                if b.context == bound.context && b.segment == bound.segment =>
            {
                let bells = handles.iter().skip(3).map(|h| match h {
                    guest::Handle::Bell { id, .. } => Some(*id),
                    guest::Handle::Extent { .. } => None,
                });
                let channels = (channels.iter().zip(bells))
                    .filter_map(|(c, id)| Some((c.channel, (id?, c.raised_before))))
                    .collect();
                Ok(Adopted { port, dec, bound: b, channels })
            }
            _ => Err(Failed::Never(format!(
                "the daemon handed over something else than context {:#x} at {:?}: {reply:?} {handles:?}",
                bound.context, bound.segment
            ))),
        }
    }

    /// Serves the adopting port from now on: the kept doorbell ends under
    /// their new numbers, the BAR reopened, the link up again.
    fn install(&mut self, old: Bound, a: Adopted) {
        let gen = self.gen + 1;
        // The replies of the old port handed to callers are noted first
        // (an rdma_cm reply's events kept): `moved` below counts the kept
        // events' wake-ups to ring again.
        self.shared.wait_replies_noted(NOTE_WAIT);
        match open_bar(&self.shared.cfg.bar) {
            Ok(bar) => *lock(&self.shared.bar) = Arc::new(bar),
            Err(e) => tracing::warn!(error = %e, "vrdma: the BAR did not reopen; keeping the old one"),
        }
        {
            let mut p = lock(&self.shared.proxies);
            let mut chans = lock(&self.shared.channels);
            let mut cm = lock(&self.shared.cm_channels);
            let mut next = HashMap::new();
            let mut next_chans = HashMap::new();
            let mut next_cm = HashMap::new();
            for (id, fd) in std::mem::take(&mut p.1) {
                if id == old.doorbell {
                    next.insert(a.bound.doorbell, fd);
                } else if id == old.events {
                    next.insert(a.bound.events, fd);
                } else if let Some(ch) = chans.remove(&id) {
                    // Not handed back: it closes (its waiters hear it).
                    let Some(&(new, raised_before)) = a.channels.get(&ch) else { continue };
                    // The source's wake-ups go, those of the events from
                    // before the import still unread are rung again; the
                    // destination's come after this, through the new proxy
                    // (`crate::channel_core`).
                    let core = lock(&self.shared.channel_ends).get(&ch).and_then(|e| e.upgrade());
                    if let Some(core) = core {
                        let (dropped, rung) = core.moved(raised_before, |n| {
                            for _ in 0..n.min(BELLS_AT_ONCE) {
                                if rustix::net::send(&fd, &[1], rustix::net::SendFlags::DONTWAIT).is_err() {
                                    break;
                                }
                            }
                        });
                        tracing::debug!(channel = ch, dropped, rung, "vrdma: a completion channel moved");
                    }
                    next.insert(new, fd);
                    next_chans.insert(new, ch);
                } else if let Some(ch) = cm.remove(&id) {
                    // An rdma_cm channel: not handed back, it closes (its
                    // waiters hear DEVICE_REMOVAL). Else the source's
                    // wake-ups go, and those of the events the library
                    // kept are rung again; the destination rang one for
                    // each event it holds, which follow on the new proxy.
                    let Some(&(new, _)) = a.channels.get(&ch) else { continue };
                    let end = lock(&self.shared.cm_ends).get(&ch).and_then(|e| e.upgrade());
                    if let Some(end) = end {
                        let (dropped, rung) = end.moved(&mut |n| {
                            // (At most a channel's unread events.)
                            for _ in 0..n.min(4096) {
                                if rustix::net::send(&fd, &[1], rustix::net::SendFlags::DONTWAIT).is_err() {
                                    break;
                                }
                            }
                        });
                        tracing::debug!(channel = ch, dropped, rung, "vrdma: an rdma_cm event channel moved");
                    }
                    next.insert(new, fd);
                    next_cm.insert(new, ch);
                }
            }
            *p = (gen, next);
            *chans = next_chans;
            *cm = next_cm;
        }
        *lock(&self.shared.bound) = Some(a.bound);
        let writer = a.port.try_clone();
        self.port = a.port;
        self.dec = a.dec;
        self.synced = true;
        self.gen = gen;
        match writer {
            Ok(w) => *lock(&self.shared.writer) = (gen, Some(w)),
            // No writer: the first call finds the port broken, and the
            // reader its end.
            Err(e) => tracing::warn!(error = %e, "vrdma: cannot write to the new port"),
        }
        self.shared.set_state(State::Up { gen });
        // What was posted while the context moved: the engine looks.
        let _ = self.shared.send(gen, &Frame::Bell { id: a.bound.doorbell, count: 1 });
    }
}
