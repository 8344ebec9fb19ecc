//! The device context: the connection to the daemon and what it shares.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vrdma_core::hca::AsyncEvent;
use vrdma_core::proto::{self, Reply, Request, PROTOCOL_VERSION};
use vrdma_core::verbs::{DeviceAttr, Gid, PortAttr};
use vrdma_shm::{Doorbell, RingView, Segment};

use crate::channel::CompletionChannel;
use crate::control::{self, Control};
use crate::cq::CompletionQueue;
use crate::error::{Error, Result};
use crate::pd::ProtectionDomain;

/// An open device context (`ibv_context`): one connection to the daemon.
///
/// Cheap to clone (all clones share the connection) and usable from any
/// thread. Every object made from a context keeps it alive; the connection
/// closes, and the daemon frees whatever is left, when the last clone and
/// the last object are gone.
#[derive(Clone, Debug)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

#[derive(Debug)]
pub(crate) struct ContextInner {
    pub(crate) control: Control,
    id: u32,
    tenant: u32,
    device_name: String,
    /// The async-event ring; its aux words also hold the engine's state.
    async_ring: RingView,
    /// Where QPs are named to the engine after a post.
    posted_ring: RingView,
    /// Wakes the daemon's engine when it sleeps.
    doorbell: Doorbell,
    /// Signalled by the daemon after it pushes an async event; hangs up
    /// when the daemon goes away.
    async_fd: Doorbell,
    /// Whether `IBV_EVENT_DEVICE_FATAL` was reported for the daemon's
    /// going (once; the calls after it fail).
    fatal_reported: AtomicBool,
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // Before the session ends: its deregistered pages that the
        // library kept in the VM's region move back to private memory.
        if self.control.guest_link().is_some() {
            crate::rebacking::guest_context_closing(self as *const ContextInner as usize);
        }
    }
}

impl ContextInner {
    /// The doorbell rule, to be called after pushing into a work ring:
    /// ring the engine's doorbell only if the engine said it sleeps.
    ///
    /// The `SeqCst` fence orders our slot publication before the load of
    /// the flag, pairing with the engine's "set flag, fence, re-check the
    /// rings" before it sleeps: either it sees our slot or we see its flag.
    #[inline]
    pub(crate) fn kick(&self) {
        fence(Ordering::SeqCst);
        if self.async_ring.aux(proto::CTX_AUX_ENGINE_SLEEPING).load(Ordering::SeqCst) != 0 {
            self.doorbell.ring();
        }
    }

    /// Names QP `qpn` to the engine after a post to it, unless it was
    /// named and the engine has not left it idle since (the send ring's
    /// [`proto::SQ_AUX_NOTIFIED`] word says which). The engine serves only
    /// QPs with work; this is how an idle QP gets its turn.
    pub(crate) fn name_posted(&self, sq: &RingView, qpn: u32) {
        // Our slots before the swap, pairing with the engine's "store 0,
        // fence, look at the ring" before it leaves the QP idle.
        fence(Ordering::SeqCst);
        if sq.aux(proto::SQ_AUX_NOTIFIED).swap(1, Ordering::SeqCst) != 0 {
            return;
        }
        let mut slot = [0u8; proto::POSTED_SLOT_SIZE];
        slot[..4].copy_from_slice(&qpn.to_le_bytes());
        if !matches!(self.posted_ring.try_push_bytes(&slot), Ok(true)) {
            // Full: the engine then looks at every QP of this context.
            self.posted_ring.aux(proto::POSTED_AUX_OVERFLOW).store(1, Ordering::SeqCst);
        }
    }
}

/// What a broken or hostile tenant can do to the memory it shares with
/// the daemon, for the tests and benchmarks that show the device stays
/// fair to everyone else (see [`Context::misbehave`]).
#[doc(hidden)]
#[derive(Debug)]
pub struct Misbehave<'a>(&'a ContextInner);

impl Misbehave<'_> {
    /// Says the posted-QP ring overflowed (every QP of the context may
    /// have work), as the library does when the ring is full.
    pub fn set_posted_overflow(&self) {
        self.0.posted_ring.aux(proto::POSTED_AUX_OVERFLOW).store(1, Ordering::SeqCst);
    }

    /// Names `qpn` in the posted-QP ring whether or not anything was
    /// posted to it; `false` when the ring is full.
    pub fn name_qp(&self, qpn: u32) -> bool {
        let mut slot = [0u8; proto::POSTED_SLOT_SIZE];
        slot[..4].copy_from_slice(&qpn.to_le_bytes());
        matches!(self.0.posted_ring.try_push_bytes(&slot), Ok(true))
    }

    /// Writes garbage into the posted-QP ring's producer index.
    pub fn scribble_posted_ring(&self) {
        self.0
            .posted_ring
            .scribble_producer_index(proto::POSTED_RING_CAPACITY.wrapping_mul(7).wrapping_add(3));
    }

    /// Rings the engine's doorbell whether or not it sleeps.
    pub fn ring_doorbell(&self) {
        self.0.doorbell.ring();
    }
}

impl Context {
    /// Breaks the rules of the shared-memory protocol on purpose: for
    /// tests and benchmarks of the daemon's fairness, never for programs.
    #[doc(hidden)]
    pub fn misbehave(&self) -> Misbehave<'_> {
        Misbehave(&self.inner)
    }

    /// Connects to the device: in a guest (see [`crate::guest`]: when
    /// `VRDMA_GUEST_PORT` and `VRDMA_GUEST_BAR` are set, or when no host
    /// daemon's socket is there and the machine has vRDMA virtio ports)
    /// through its port; else to the daemon at
    /// [`default_socket_path`](crate::default_socket_path).
    pub fn open() -> Result<Context> {
        if let Some(cfg) = crate::guest::GuestConfig::from_env() {
            return Context::open_guest(&cfg);
        }
        let path = crate::default_socket_path();
        if std::env::var_os(crate::SOCKET_ENV).is_none() && !path.exists() {
            if let Some(cfg) = crate::guest::GuestConfig::detect() {
                return Context::open_guest(&cfg);
            }
        }
        Context::open_at(path)
    }

    /// Opens a context in guest mode through `cfg`'s port and BAR.
    pub fn open_guest(cfg: &crate::guest::GuestConfig) -> Result<Context> {
        Context::hello(Control::guest(crate::guest::GuestLink::open(cfg)?)?)
    }

    /// Whether this context reaches the device from a guest.
    pub fn is_guest(&self) -> bool {
        self.inner.control.guest_link().is_some()
    }

    /// Connects to the daemon listening at `path`.
    pub fn open_at(path: impl AsRef<Path>) -> Result<Context> {
        Context::hello(Control::connect(path.as_ref())?)
    }

    /// Opens a context over an already connected `SOCK_SEQPACKET` socket
    /// (inherited, socket-activated, or one end of a `socketpair` whose
    /// other end a daemon serves).
    pub fn from_socket(sock: OwnedFd) -> Result<Context> {
        Context::hello(Control::from_socket(sock))
    }

    fn hello(control: Control) -> Result<Context> {
        // Keeps the build id's marker in every binary that opens a context
        // (the drop-in libraries included), where `vrdma bench` reads it.
        std::hint::black_box(crate::BUILD_ID);
        let req = Request::Hello { version: PROTOCOL_VERSION };
        let answer = control.call(&req, &[])?;
        let Reply::Hello { context, tenant, device_name, segment_len, async_ring, posted_ring, .. } =
            answer.reply.clone()
        else {
            return Err(control::unexpected(&req, &answer.reply));
        };
        let mut fds = answer.take_placed(3, "Hello")?.into_iter();
        let ((seg_fd, at), (bell_fd, _), (async_fd, _)) = match (fds.next(), fds.next(), fds.next()) {
            (Some(a), Some(b), Some(c)) => (a, b, c),
            _ => return Err(Error::protocol("Hello reply lacks descriptors")),
        };
        let seg = Arc::new(Segment::map_trusted_at(
            seg_fd,
            at,
            control::to_usize(segment_len, "context segment length")?,
        )?);
        let in_segment = |spec: proto::RingSpec, what: &str, least: usize| -> Result<RingView> {
            let ring = RingView::in_segment(
                seg.clone(),
                control::to_usize(spec.offset, what)?,
                spec.capacity,
                spec.stride as usize,
            )?;
            if ring.stride() < least {
                return Err(Error::protocol(format!(
                    "{what}: slots of {} bytes, need {least}",
                    ring.stride()
                )));
            }
            Ok(ring)
        };
        let ring = in_segment(async_ring, "async-event ring", proto::ASYNC_EVENT_SIZE)?;
        let posted_ring = in_segment(posted_ring, "posted ring", proto::POSTED_SLOT_SIZE)?;
        Ok(Context {
            inner: Arc::new(ContextInner {
                control,
                id: context,
                tenant,
                device_name,
                async_ring: ring,
                posted_ring,
                doorbell: Doorbell::from_fd(bell_fd),
                async_fd: Doorbell::from_fd(async_fd),
                fatal_reported: AtomicBool::new(false),
            }),
        })
    }

    /// The daemon's number for this context.
    pub fn context_id(&self) -> u32 {
        self.inner.id
    }

    /// The tenant the daemon placed this process in (from its credentials).
    pub fn tenant(&self) -> u32 {
        self.inner.tenant
    }

    /// Whether the daemon behind this context has gone away (it died or
    /// was stopped): then every object of the context is dead, as a
    /// device's after a reset, and a new context reaches the daemon that
    /// took its place. A look, without waiting.
    pub fn daemon_gone(&self) -> bool {
        self.inner.async_fd.hung_up() || self.inner.control.hung_up()
    }

    /// The device's name, as `ibv_get_device_name` would report it.
    pub fn device_name(&self) -> &str {
        &self.inner.device_name
    }

    /// `ibv_query_device`.
    pub fn query_device(&self) -> Result<DeviceAttr> {
        let req = Request::QueryDevice;
        match self.inner.control.call(&req, &[])?.reply {
            Reply::Device(d) => Ok(d),
            other => Err(control::unexpected(&req, &other)),
        }
    }

    /// This tenant's own figures (its counters as the metrics endpoint
    /// shows them, for it alone), the device's links to other hosts'
    /// daemons (with this tenant's own traffic on each; the daemon's
    /// totals when the caller is the host's operator: `totals`), and the
    /// path (shared memory or a link) each QP of this tenant takes.
    ///
    /// The daemon answers in pages; this asks for each in turn. Objects
    /// created or destroyed meanwhile may or may not show.
    pub fn stat(&self) -> Result<vrdma_core::hca::StatReport> {
        let mut all = vrdma_core::hca::StatReport::default();
        let mut from = vrdma_core::hca::StatCursor::START;
        // A list's cursor only moves up, until it is done (`None`): the
        // loop ends, even with a daemon that answers nonsense.
        let advances = |from: Option<u32>, next: Option<u32>| match (from, next) {
            (_, None) => true,
            (Some(a), Some(b)) => b > a,
            (None, Some(_)) => false,
        };
        loop {
            let req = Request::StatPage { from };
            let page = match self.inner.control.call(&req, &[])?.reply {
                Reply::StatPage(p) => p,
                other => return Err(control::unexpected(&req, &other)),
            };
            all.links.extend(page.report.links);
            all.qps.extend(page.report.qps);
            all.missed_wakeups = all.missed_wakeups.max(page.report.missed_wakeups);
            // The tenant's own figures, as of the first page.
            if all.tenant.is_none() {
                all.tenant = page.report.tenant;
            }
            all.totals = page.report.totals;
            match page.next {
                None => return Ok(all),
                Some(next) if advances(from.link, next.link) && advances(from.qpn, next.qpn) => from = next,
                Some(_) => return Err(Error::Protocol("the daemon's stat pages do not advance".into())),
            }
        }
    }

    /// `ibv_query_port`; ports are numbered from 1.
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        let req = Request::QueryPort { port };
        match self.inner.control.call(&req, &[])?.reply {
            Reply::Port(p) => Ok(p),
            other => Err(control::unexpected(&req, &other)),
        }
    }

    /// `ibv_query_gid`.
    pub fn query_gid(&self, port: u8, index: u32) -> Result<Gid> {
        let req = Request::QueryGid { port, index };
        match self.inner.control.call(&req, &[])?.reply {
            Reply::Gid(g) => Ok(g),
            other => Err(control::unexpected(&req, &other)),
        }
    }

    /// `ibv_alloc_pd`.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        ProtectionDomain::alloc(self)
    }

    /// `ibv_create_cq`: a CQ of at least `cqe` entries (the daemon rounds
    /// up to a power of two; see [`CompletionQueue::depth`]), reporting
    /// events to `channel` when armed.
    pub fn create_cq(&self, cqe: u32, channel: Option<&CompletionChannel>) -> Result<CompletionQueue> {
        CompletionQueue::create(self, cqe, channel)
    }

    /// `ibv_create_comp_channel`.
    pub fn create_comp_channel(&self) -> Result<CompletionChannel> {
        CompletionChannel::create(self)
    }

    /// The descriptor that becomes readable when an async event is
    /// pending (for `poll`/`epoll`); then call
    /// [`get_async_event`](Self::get_async_event).
    pub fn async_event_fd(&self) -> BorrowedFd<'_> {
        self.inner.async_fd.as_fd()
    }

    /// `ibv_get_async_event`: the next asynchronous event (QP fatal, SRQ
    /// limit reached, ...), waiting up to `timeout` (`None`: no limit)
    /// when none is pending. `Ok(None)` means the time ran out. Events
    /// need no acknowledgement. With `poll`/`epoll` on
    /// [`async_event_fd`](Self::async_event_fd), call it with a zero
    /// timeout until it returns `Ok(None)` (which also clears a stale
    /// readiness of the fd).
    ///
    /// When the daemon goes away (it died or was restarted) the fd turns
    /// readable for good, and this reports the events still pending, then
    /// [`AsyncEventType::DeviceFatal`] once (element 0), as rdma-core does
    /// when a device is reset; after that it fails (`EIO`, as the
    /// kernel's event file of a device gone) instead of waiting.
    pub fn get_async_event(&self, timeout: Option<Duration>) -> Result<Option<AsyncEvent>> {
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let mut slot = vec![0u8; self.inner.async_ring.stride()];
        loop {
            if let Some(ev) = self.pop_async_event(&mut slot)? {
                return Ok(Some(ev));
            }
            // Nothing pending: the wake-ups still queued on the fd belong to
            // events already taken. Consume them, then look once more, so
            // that the fd is not left readable for nothing. (A completion
            // channel's wake-ups are counted instead, one per event.)
            self.inner.async_fd.drain();
            if let Some(ev) = self.pop_async_event(&mut slot)? {
                return Ok(Some(ev));
            }
            if self.daemon_gone() {
                return self.device_fatal();
            }
            // `None` when there is no limit (or one too far ahead to represent).
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left == Some(Duration::ZERO) {
                return Ok(None);
            }
            // Rung or timed out, look at the ring again before deciding;
            // the daemon's going ends the wait, and is looked at above.
            match self.inner.control.wait_bell(&self.inner.async_fd, left) {
                Err(e) if !self.daemon_gone() => return Err(e),
                _ => {}
            }
        }
    }

    /// The daemon is gone: `DeviceFatal` the first time, then `EIO`.
    fn device_fatal(&self) -> Result<Option<AsyncEvent>> {
        if !self.inner.fatal_reported.swap(true, Ordering::AcqRel) {
            return Ok(Some(AsyncEvent {
                event_type: vrdma_core::verbs::AsyncEventType::DeviceFatal,
                element: 0,
            }));
        }
        Err(Error::Daemon {
            errno: libc::EIO,
            message: "the vRDMA daemon went away: the device is gone".into(),
        })
    }

    /// Pops the next known event from the async-event ring.
    fn pop_async_event(&self, slot: &mut [u8]) -> Result<Option<AsyncEvent>> {
        while self.inner.async_ring.try_pop(slot)? {
            match proto::decode_async_event(slot) {
                Some(ev) => return Ok(Some(ev)),
                None => tracing::warn!(kind = slot[0], "vrdma: skipping an unknown async event"),
            }
        }
        Ok(None)
    }

    /// How many async events the daemon dropped because the event ring
    /// was full (they were not read quickly enough).
    pub fn async_events_dropped(&self) -> u32 {
        self.inner.async_ring.aux(proto::CTX_AUX_EVENTS_DROPPED).load(Ordering::Relaxed)
    }
}
