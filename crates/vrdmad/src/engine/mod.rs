//! The engine: the thread that is the HCA's data path.
//!
//! One thread works the [`Hca`] and every ring. Control requests run
//! between its passes, on the caller's thread, under the state's lock,
//! which the engine lets go of between passes while callers wait for it
//! and while it sleeps (see `handle`). The data path takes no lock of its
//! own: the engine holds the state's lock while it works, and looks once
//! per pass whether a caller waits. While there is work it spins; when
//! work dries up it spins a little longer (`spin_us`), polls while
//! yielding the CPU (`yield_us`), then announces that it sleeps in
//! every context's segment, looks once more (so a post that raced with
//! the announcement is not missed), and blocks on the contexts' doorbells
//! until a post, a control request or its next timer wakes it. With
//! `engine.link_wake`, a frame from another host that comes while it
//! idles is taken by a thread blocked on the links, which runs the pass
//! itself (`link_wake`).

mod handle;
mod late;
mod link_wake;
mod rings;
mod sleep;
mod sockets;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, MutexGuard};
use std::time::Duration;

use vrdma_core::hca::{ContextId, Hca, HcaError, Teardown};
use vrdma_core::proto::{CmReply, CmRequest};
use vrdma_core::time::Instant;
use vrdma_shm::Doorbell;

pub use handle::{EngineGone, EngineHandle};
pub use rings::{Channel, ContextRings, CqRing, InRing, QpRings, RingTable};
pub use sockets::{SockCall, FORWARD_WAIT};

use crate::config::EngineConfig;

/// A pass this long after the one before reads the links before it looks
/// at the QPs' timers (see `Engine::pass`): well under the shortest
/// transport timer programs use (timeout 8: 1 ms), well over the gap
/// between the passes of a busy engine.
const LATE_PASS: Duration = Duration::from_micros(200);

/// What the engine thread owns.
pub struct EngineState {
    pub hca: Hca,
    pub rings: RingTable,
    /// Links to other hosts' daemons, when the transport is configured.
    pub net: Option<crate::net::Net>,
    /// The connection manager (rdma_cm).
    pub cm: crate::cm::CmDriver,
    /// Its messages from the links (a buffer kept between passes).
    cm_in: Vec<(std::net::Ipv4Addr, vrdma_core::hca::LinkId, vrdma_core::cm::CmMessage)>,
    /// What QPs that name other hosts make the daemon log while the
    /// transport is off, limited per host.
    unreachable_log: vrdma_core::log_limit::LogLimiter,
    epoch: std::time::Instant,
    /// How often every QP that may be served gets one turn, whether or not
    /// it was woken (`engine.sweep_ms`; `None`: never): the bound on how
    /// long a QP whose wake-up was lost (a tenant that does not name its
    /// QPs after posting, or a bug, counted in
    /// [`vrdma_core::hca::Hca::missed_wakeups`]) waits while the engine
    /// is awake. A sleeping engine is woken by the post's doorbell, and the
    /// overdue sweep runs then. A sweep wakes a few hundred QPs a pass, so
    /// thousands of idle QPs never stretch one, and keeps the engine awake
    /// until it is done.
    sweep_every: Option<Duration>,
    last_sweep: Instant,
    /// When the last pass began.
    last_pass: Instant,
    /// Ends the session of a context whose tenant broke the shared-memory
    /// protocol (see [`RingTable::take_broken`]); the daemon sets it.
    pub on_broken: Option<Box<dyn Fn(ContextId) + Send>>,
    /// The direct path's grants in shared memory ([`crate::direct`]).
    pub direct: crate::direct::DirectDriver,
    /// Who made each context: an rdma_cm id and the QP attached to it may
    /// be of two contexts of one origin, as the drop-in `librdmacm.so.1`
    /// and the program's `libibverbs.so.1` each hold their own (see
    /// [`EngineState::handle_cm`]).
    pub processes: HashMap<ContextId, Origin>,
    /// The socket registry of the preload library (`docs/sockets.md`).
    pub sockets: vrdma_core::sockets::Registry,
    /// Its calls about other hosts' addresses, and theirs about ours.
    remote: sockets::RemoteSockets,
}

/// Where a context's calls come from, as far as the daemon can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// A process of this host, by the pid its socket's peer credentials
    /// gave.
    Process(i32),
    /// A VM, by its configured name: the daemon cannot tell the guest's
    /// processes apart (they share its port and its region, which every
    /// guest process allowed to map the device can read and write), so
    /// for the daemon they are one origin, as the VM is one tenant.
    Vm(String),
}

impl EngineState {
    fn new(
        mut hca: Hca,
        net: Option<crate::net::Net>,
        cm: crate::cm::CmDriver,
        sweep_ms: u64,
    ) -> EngineState {
        let epoch = std::time::Instant::now();
        // The per-turn times of the metrics, on the clock of `now()`.
        hca.set_clock(Box::new(move || Instant(epoch.elapsed().as_nanos() as u64)));
        EngineState {
            hca,
            rings: RingTable::default(),
            net,
            cm,
            cm_in: Vec::new(),
            unreachable_log: vrdma_core::log_limit::LogLimiter::new(),
            epoch,
            sweep_every: (sweep_ms > 0).then(|| Duration::from_millis(sweep_ms)),
            last_sweep: Instant::ZERO,
            last_pass: Instant::ZERO,
            on_broken: None,
            direct: crate::direct::DirectDriver::default(),
            processes: HashMap::new(),
            sockets: vrdma_core::sockets::Registry::new(),
            remote: sockets::RemoteSockets::default(),
        }
    }

    pub fn now(&self) -> Instant {
        Instant(self.epoch.elapsed().as_nanos() as u64)
    }

    /// Deregisters `ctx`'s memory region `key`. Frames already queued for
    /// other hosts from it keep the bytes it holds now (see
    /// [`crate::net::LinkIo::keep_payloads`]).
    ///
    /// Returns the direct-path windows whose copies in flight the caller
    /// must wait out ([`crate::direct::drain`]) before it answers.
    pub fn dereg_mr(&mut self, ctx: ContextId, key: u32) -> Result<Vec<vrdma_shm::WordPage>, HcaError> {
        self.hca.dereg_mr(ctx, key)?;
        self.direct.forget_region(key);
        self.keep_revoked_payloads();
        Ok(self.direct.sync(&mut self.hca))
    }

    /// Destroys everything `ctx` holds (its process closed the device or
    /// died), keeping queued frames' bytes as [`Self::dereg_mr`] does.
    pub fn close_context(&mut self, ctx: ContextId) -> Teardown {
        let t = self.hca.close_context(ctx, &mut self.rings);
        self.processes.remove(&ctx);
        self.sockets.close_context(ctx);
        self.close_remote_sockets(ctx);
        // The process is gone: nothing of it copies any more, and its
        // peers' windows are closed (no wait: the pages stay mapped in the
        // peers, whose copies land in memory no one else uses).
        self.direct.forget_context(ctx);
        self.direct.sync(&mut self.hca);
        self.keep_revoked_payloads();
        t
    }

    /// Runs in the engine command that revoked regions, before its caller
    /// hears of it: the tenant cannot have reused the memory yet.
    fn keep_revoked_payloads(&mut self) {
        if let Some(net) = self.net.as_mut() {
            let n = net.keep_payloads(&|r| r.is_revoked());
            if n > 0 {
                tracing::debug!(bytes = n, "kept queued payloads of revoked regions");
            }
        }
    }

    /// Runs the connection manager: what the links brought, its timers,
    /// and its messages out, here or over the links. Returns its next timer.
    pub fn run_cm(&mut self, now: Instant) -> Option<Instant> {
        // (The socket registry's messages ride the same links.)
        self.run_sockets(now);
        if let Some(net) = self.net.as_mut() {
            // Links up and down first, in the order they were (a dial's
            // failure and a link that came after it): what a link brought
            // came after it was up, what the manager held for a dial went
            // by it, and a link that went down is gone with what it read.
            for ev in net.cm_links.drain(..) {
                match ev {
                    crate::net::CmLink::Up(host, link, verified) => self.cm.cm.link_up(host, link, verified),
                    crate::net::CmLink::Down(host, link) => self.cm.cm.link_down(host, link),
                }
            }
            let mut came = std::mem::take(&mut self.cm_in);
            net.take_cm_in(&mut came);
            for (host, link, msg) in came.drain(..) {
                // A link whose peer claims one of this host's own addresses
                // must not speak for this host's connections.
                if self.cm.cm.is_local(host) {
                    tracing::debug!(%host, "a connection manager's message from a link that claims this host; dropped");
                    continue;
                }
                self.cm.cm.handle_message_by(host, Some(link), msg);
            }
            self.cm_in = came;
        }
        let net = &mut self.net;
        let (hca, rings) = (&mut self.hca, &mut self.rings);
        let mut modify = |c, qp, attr: &_, mask| hca.modify_qp(c, qp, attr, mask, rings).map(drop);
        let mut sent = false;
        let next = self.cm.run(
            now,
            |host, link, msg| match net.as_mut() {
                Some(n) => {
                    sent = true;
                    n.send_cm(host, link, msg)
                }
                None => {
                    Err("the transport between daemons is off: set net.psk (or net.psk_file) on both hosts")
                }
            },
            &mut modify,
        );
        // What was held for a dial of a connection that ended meanwhile
        // (closed, destroyed, timed out: its REQ, and the REJ its end sent
        // after it) is not sent by the link that comes: the peer never
        // heard of it. (A REJ of no connection, `from` 0, stays.)
        let cm = &self.cm.cm;
        if let Some(n) = self.net.as_mut() {
            n.retain_held_cm(|host, m| m.from() == 0 || cm.awaits_link(host, m.from()));
        }
        // What the manager sent to other hosts goes now: a call runs on
        // its caller's thread, and the engine's next pass may be a wake-up
        // away.
        if let Some(n) = self.net.as_mut().filter(|_| sent) {
            n.write_now();
        }
        next
    }

    /// A connection manager's call of `ctx`'s, then the manager's run,
    /// so that what the call set off goes at once. A resolve's or an
    /// accept's reply carries the id's event when the run produced it
    /// (see `CmDriver::take_ready`).
    pub fn handle_cm(
        &mut self,
        ctx: ContextId,
        tenant: vrdma_core::hca::TenantId,
        req: CmRequest,
    ) -> Result<CmReply, crate::cm::CmCallError> {
        let now = self.now();
        // The id and the QP an attach names may each be of another context
        // of the caller's process and tenant: the drop-in librdmacm's ids
        // are its own context's, the QPs its libibverbs' (which makes them
        // attached in one call, naming the id). Of another process, or
        // none, they are no id or QP of the caller's.
        let attach_owner = match req {
            CmRequest::AttachQp { id, qp } => {
                let ours = |c: ContextId| c == ctx || self.same_process(c, ctx);
                let id_ctx = self.cm.cm.owner(id).filter(|&c| ours(c));
                let qp_ctx = self.hca.qp_owner(qp).filter(|&(c, t)| t == tenant && ours(c)).map(|(c, _)| c);
                Some((id_ctx, qp_ctx))
            }
            _ => None,
        };
        let (hca, rings) = (&mut self.hca, &mut self.rings);
        let mut modify = |c, qp, attr: &_, mask| hca.modify_qp(c, qp, attr, mask, rings).map(drop);
        // The calls whose event usually follows at once (see
        // `CmDriver::take_ready`).
        let ready_for = match req {
            CmRequest::ResolveAddr { id, .. }
            | CmRequest::ResolveRoute { id }
            | CmRequest::Accept { id, .. } => Some(id),
            _ => None,
        };
        let r = match req {
            CmRequest::AttachQp { id, qp } => match attach_owner {
                Some((Some(id_ctx), Some(qp_ctx))) => self
                    .cm
                    .attach_qp(id_ctx, id, qp_ctx, qp, &mut modify)
                    .map(|()| CmReply::Event { event: None, wakeups: 0 }),
                Some((None, _)) => Err(vrdma_core::cm::CmError::NoSuchId.into()),
                _ => Err(vrdma_core::hca::HcaError::NoSuchObject { kind: "QP", id: qp }.into()),
            },
            req => self.cm.handle(ctx, tenant, req, now, &mut modify),
        };
        self.run_cm(now);
        self.direct.sync(&mut self.hca);
        match (r, ready_for) {
            (Ok(CmReply::Event { event: None, wakeups: 0 }), Some(id)) => {
                let (event, wakeups) = self.cm.take_ready(ctx, id).map_or((None, 0), |e| (Some(e), 1));
                Ok(CmReply::Event { event, wakeups })
            }
            (r, _) => r,
        }
    }

    /// Whether contexts `a` and `b` are of one origin of one tenant (one
    /// local process, or one VM).
    fn same_process(&self, a: ContextId, b: ContextId) -> bool {
        match (self.processes.get(&a), self.processes.get(&b)) {
            (Some(p), Some(q)) => {
                p == q && self.hca.tenant(a).is_some() && self.hca.tenant(a) == self.hca.tenant(b)
            }
            _ => false,
        }
    }

    /// One pass over the shared-memory queues and the links.
    fn pass(&mut self) -> vrdma_core::hca::Activity {
        let now = self.now();
        // After a late pass (the engine slept, or was not scheduled), the
        // frames that came meanwhile are read before the QPs' timers are
        // looked at: an ACK waiting in a socket must not lose to its own
        // request's timer, which would send the request again, or fail a
        // QP out of retries.
        let late = now.saturating_since(self.last_pass) >= LATE_PASS;
        self.last_pass = now;
        self.rings.now = now;
        let mut read_first = false;
        if let (true, Some(n)) = (late, self.net.as_mut()) {
            read_first = n.receive_waiting(&mut self.hca, &mut self.rings, now);
        }
        if self.sweep_every.is_some_and(|every| now.saturating_since(self.last_sweep) >= every) {
            self.last_sweep = now;
            self.hca.sweep();
        }
        self.rings.now = now;
        let mut act = self.hca.process(now, &mut self.rings);
        act.busy |= read_first;
        match self.net.as_mut() {
            Some(n) => {
                act.busy |= n.drive(&mut self.hca, &mut self.rings, now);
                // A tenant's rate limit held its frames back: transmit
                // again when it allows.
                if let Some(t) = self.hca.take_link_timer() {
                    act.timer(t);
                }
                n.log.sweep(now);
            }
            None => {
                let wanted = self.hca.take_wanted_peers();
                no_transport(&mut self.unreachable_log, &wanted, now);
            }
        }
        // Counts of floods that stopped (once a second at most).
        self.rings.log.sweep(now);
        self.hca.log.sweep(now);
        act.busy |= self.hca.needs_pass();
        if let Some(t) = self.run_cm(now) {
            act.timer(t);
        }
        // QPs the pass (or the connection manager) put in ERR lose their
        // direct windows; nobody waits on this pass, so nothing drains.
        self.direct.sync(&mut self.hca);
        for ctx in self.rings.take_broken() {
            match &self.on_broken {
                Some(end) => end(ctx),
                None => tracing::debug!(ctx = ctx.0, "a broken context has no session to end"),
            }
        }
        act
    }
}

/// Says, once per host (then as a count now and then), that QPs name
/// hosts this daemon cannot reach because its transport is off: their
/// requests end in RETRY_EXC_ERR after their timer, and the operator
/// learns why and what turns the transport on.
fn no_transport(
    log: &mut vrdma_core::log_limit::LogLimiter,
    wanted: &[vrdma_core::verbs::Gid],
    now: Instant,
) {
    for gid in wanted {
        let host = gid.ipv4().map(std::net::Ipv4Addr::from);
        let source = match host {
            Some(ip) => vrdma_core::log_limit::Source::Address(ip.into()),
            None => vrdma_core::log_limit::Source::Anyone,
        };
        let host = host.map_or_else(|| gid.to_string(), |ip| ip.to_string());
        const OFF: &str = "a QP names another host, and the transport between daemons is off: its requests \
                           will end in RETRY_EXC_ERR; set net.psk (or net.psk_file) in the [net] table on both \
                           hosts to turn it on";
        vrdma_core::limited_warn!(log, source, now, OFF, %host);
    }
    log.sweep(now);
}

/// Counters the engine publishes (relaxed atomics: a scrape reads them
/// without asking the engine).
#[derive(Debug)]
pub struct EngineStats {
    pub passes: AtomicU64,
    pub sleeps: AtomicU64,
    pub wakeups: AtomicU64,
    /// Time spent in passes that did work (ns): the engine's busy time.
    pub busy_ns: AtomicU64,
    /// When the engine started.
    pub started: std::time::Instant,
}

impl Default for EngineStats {
    fn default() -> Self {
        EngineStats {
            passes: AtomicU64::new(0),
            sleeps: AtomicU64::new(0),
            wakeups: AtomicU64::new(0),
            busy_ns: AtomicU64::new(0),
            started: std::time::Instant::now(),
        }
    }
}

impl EngineState {
    /// What the limiters the engine owns have counted, per message.
    pub fn limited_inputs(&self, out: &mut std::collections::BTreeMap<&'static str, u64>) {
        let net = self.net.as_ref().map(|n| &n.log);
        let cm = Some(self.cm.log());
        for l in [Some(&self.hca.log), Some(&self.unreachable_log), net, cm].into_iter().flatten() {
            for (m, n) in l.occurred() {
                *out.entry(*m).or_default() += n;
            }
        }
    }
}

pub struct Engine {
    handle: EngineHandle,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The links' waker and its thread, when there are links to wait on.
    link_wake: Option<(Arc<link_wake::LinkWake>, std::thread::JoinHandle<()>)>,
}

impl Engine {
    pub fn start(
        hca: Hca,
        cm: crate::cm::CmDriver,
        config: EngineConfig,
        net: Option<Arc<crate::net::NetSetup>>,
    ) -> std::io::Result<Engine> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let (wake_tx, wake) = Doorbell::pair()?;
        let (wake_tx, wake) = (Arc::new(wake_tx), Arc::new(wake));
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(EngineStats::default());
        // The handle (which the links keep) comes before the state that
        // holds it: the state goes into its core after.
        let core = Arc::new(handle::Core::new(rx));
        let handle = EngineHandle::new(tx, wake_tx, stats.clone(), core.clone());
        let net = net.map(|setup| {
            let mut n = crate::net::Net::new(setup);
            n.set_handle(handle.clone());
            n
        });
        let waker = match net.as_ref().and_then(|n| n.readiness()) {
            Some(links) if config.link_wake && !config.busy_poll => match link_wake::LinkWake::new(links) {
                Ok(w) => Some(Arc::new(w)),
                Err(e) => {
                    tracing::warn!(error = %e, "no links' waker; the engine alone reads the links");
                    None
                }
            },
            _ => None,
        };
        *core.lock() = Some(EngineState::new(hca, net, cm, config.sweep_ms));
        let link_wake = match waker.clone() {
            Some(w) => {
                let (core, bell, stats) = (core.clone(), handle.wake.clone(), stats.clone());
                let w2 = w.clone();
                let t = std::thread::Builder::new()
                    .name("vrdma-linkwake".into())
                    .spawn(move || link_wake::run(w2, core, bell, stats))?;
                Some((w, t))
            }
            None => None,
        };
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("vrdma-engine".into())
            .spawn(move || run(core, wake, s, stats, config, waker))?;
        Ok(Engine { handle, stop, thread: Some(thread), link_wake })
    }

    /// Passes the links' waker ran (0 without one).
    pub fn link_wake_passes(&self) -> u64 {
        self.link_wake.as_ref().map_or(0, |(w, _)| w.passes.load(Ordering::Relaxed))
    }

    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.handle.wake.ring();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some((w, t)) = self.link_wake.take() {
            w.stop();
            let _ = t.join();
        }
    }
}

fn set_realtime() {
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: sched_setscheduler on the calling thread (pid 0) with a valid
    // sched_param; it only changes scheduling.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) };
    if rc != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "engine.realtime: SCHED_FIFO refused; running at normal priority");
    } else {
        tracing::info!("engine thread runs SCHED_FIFO");
    }
}

fn pin_to(cpu: usize) {
    let mut set = rustix::thread::CpuSet::new();
    if cpu >= rustix::thread::CpuSet::MAX_CPU {
        tracing::warn!(cpu, "engine.cpu out of range; not pinned");
        return;
    }
    set.set(cpu);
    match rustix::thread::sched_setaffinity(None, &set) {
        Ok(()) => tracing::info!(cpu, "engine thread pinned"),
        Err(e) => tracing::warn!(cpu, error = %e, "engine.cpu: cannot pin the engine thread"),
    }
}

/// What the engine does after a pass.
enum Then {
    /// Another pass at once.
    Pass,
    /// Another pass after a yield (without the lock).
    Yield,
    /// Sleep, if nothing came meanwhile.
    Sleep,
}

fn run(
    core: Arc<handle::Core>,
    wake: Arc<Doorbell>,
    stop: Arc<AtomicBool>,
    stats: Arc<EngineStats>,
    cfg: EngineConfig,
    link_wake: Option<Arc<link_wake::LinkWake>>,
) {
    if cfg.realtime {
        set_realtime();
        core.realtime.store(true, Ordering::Relaxed);
    }
    if let Some(cpu) = cfg.cpu {
        pin_to(cpu);
    }
    let spin = Duration::from_micros(cfg.spin_us);
    // A real-time thread's sched_yield only yields to other real-time
    // threads: polling with yields would starve the applications, so a
    // real-time engine goes from spinning straight to sleep.
    let yield_until = if cfg.realtime { spin } else { Duration::from_micros(cfg.yield_us.max(cfg.spin_us)) };
    let mut idle_since: Option<std::time::Instant> = None;
    // Held while the engine works and sleeps; let go between passes to
    // callers that wait for it (see `handle`).
    let mut guard = core.lock();
    // The clock at the last boundary between parts of a turn (see `late`).
    let mut now = std::time::Instant::now();
    let mut turns = late::Turns::new(now);
    while !stop.load(Ordering::Relaxed) {
        turns.end_and_log(now);
        #[cfg(test)]
        if core.hold.load(Ordering::SeqCst) {
            drop(guard);
            core.held.store(true, Ordering::SeqCst);
            while core.hold.load(Ordering::SeqCst) && !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(1));
            }
            core.held.store(false, Ordering::SeqCst);
            guard = core.lock();
        }
        let Some(s) = guard.as_mut() else { break };
        if handle::run_queued(&core.rx, s) {
            idle_since = None;
            now = std::time::Instant::now();
            turns.lap(late::Part::Callers, now);
        }
        let started = now;
        let act = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.pass())) {
            Ok(a) => a,
            Err(_) => {
                tracing::error!("the engine pass panicked; continuing with the next pass");
                Default::default()
            }
        };
        now = std::time::Instant::now();
        turns.lap(late::Part::Pass, now);
        stats.passes.fetch_add(1, Ordering::Relaxed);
        // Frames the links' waker took since the last pass are work too:
        // the engine stays awake (polling) while they come.
        if link_wake.as_ref().is_some_and(|w| w.served.swap(false, Ordering::SeqCst)) {
            idle_since = None;
        }
        let then = if act.busy {
            stats
                .busy_ns
                .fetch_add(now.saturating_duration_since(started).as_nanos() as u64, Ordering::Relaxed);
            idle_since = None;
            // Tenants contend: let the others' threads have the CPU between
            // passes (see `engine.yield_when_contended`).
            if act.contended && cfg.yield_when_contended {
                Then::Yield
            } else {
                Then::Pass
            }
        } else if cfg.busy_poll {
            std::hint::spin_loop();
            Then::Pass
        } else {
            // Idle: the next frame from a link wakes the waker rather than
            // waiting for this thread's next turn.
            if let Some(w) = &link_wake {
                w.arm();
            }
            let idle = now.saturating_duration_since(*idle_since.get_or_insert(now));
            if idle < spin {
                std::hint::spin_loop();
                Then::Pass
            } else if idle < yield_until || act.pending {
                // Work may be waiting that this pass did not reach (idle
                // QPs a tenant woke, notices left for later): no sleep, but
                // a yield, so that a tenant waking idle QPs without end
                // cannot make the engine hold a CPU that others' threads
                // need.
                Then::Yield
            } else {
                Then::Sleep
            }
        };
        match then {
            Then::Pass => {}
            Then::Yield => {
                drop(guard);
                std::thread::yield_now();
                guard = core.lock_yielding();
                now = std::time::Instant::now();
                turns.lap(late::Part::Yield, now);
            }
            Then::Sleep => {
                guard = try_sleep(&core, guard, &wake, &stop, &stats, &mut turns);
                now = std::time::Instant::now();
                turns.lap(late::Part::Callers, now);
                idle_since = None;
            }
        }
        if core.waiting.load(Ordering::SeqCst) > 0 {
            // A call is work, as a queued one was: the engine stays awake
            // for the calls that follow.
            guard = core.let_callers_in(guard);
            now = std::time::Instant::now();
            turns.lap(late::Part::Callers, now);
            idle_since = None;
        }
    }
    let Some(mut s) = core.stop(guard) else { return };
    s.rings.set_sleeping(false);
    if let Some(n) = s.net.as_mut() {
        n.close_all(&mut s.hca);
    }
}

/// Sleeps until a doorbell, a queued call or the next timer, unless
/// something came meanwhile, with the state's lock let go (see `sleep`).
///
/// Announces sleep to the tenants (in their segments), then looks once
/// more: a tenant that posted before it saw the flag is found here, one
/// that posts after rings. A caller that takes the lock while the engine
/// sleeps sees [`handle::Core::asleep`] and rings after its call.
fn try_sleep<'a>(
    core: &'a handle::Core,
    mut guard: MutexGuard<'a, Option<EngineState>>,
    wake: &Doorbell,
    stop: &AtomicBool,
    stats: &EngineStats,
    turns: &mut late::Turns,
) -> MutexGuard<'a, Option<EngineState>> {
    let Some(s) = guard.as_mut() else { return guard };
    if core.waiting.load(Ordering::SeqCst) > 0 {
        return guard;
    }
    s.rings.set_sleeping(true);
    std::sync::atomic::fence(Ordering::SeqCst);
    let now = s.now();
    let act = s.pass();
    turns.lap(late::Part::Pass, std::time::Instant::now());
    if act.again() || !core.rx.is_empty() || stop.load(Ordering::Relaxed) {
        s.rings.set_sleeping(false);
        return guard;
    }
    let set = match sleep::PollSet::of(s, act.next_timer.map(|t| t.saturating_since(now))) {
        Ok(set) => set,
        Err(e) => {
            // Out of descriptors: no sleep; the engine polls with yields
            // until it has them again.
            tracing::debug!(error = %e, "the engine cannot gather what it sleeps on; not sleeping");
            s.rings.set_sleeping(false);
            return guard;
        }
    };
    stats.sleeps.fetch_add(1, Ordering::Relaxed);
    core.going_to_sleep();
    drop(guard);
    turns.planned_sleep(set.timeout());
    // The part up to here (gathering the set) counts with the pass.
    turns.lap(late::Part::Pass, std::time::Instant::now());
    set.wait(wake);
    turns.lap(late::Part::Sleep, std::time::Instant::now());
    // The lock, taken next, counts with the callers (the loop's lap).
    let mut guard = core.lock();
    core.asleep.store(false, Ordering::SeqCst);
    stats.wakeups.fetch_add(1, Ordering::Relaxed);
    if let Some(s) = guard.as_mut() {
        s.rings.set_sleeping(false);
    }
    guard
}

#[cfg(test)]
mod tests {
    use std::net::TcpStream;

    use vrdma_core::hca::{HcaConfig, IoSeg, LinkInfo, TenantId, Transmit};
    use vrdma_core::memory::Region;
    use vrdma_core::verbs::{AccessFlags, Gid};

    use super::*;
    use crate::net::{LinkIo, Net};
    use crate::testing::{loopback, setup, Keys};

    /// An engine state with one link over loopback (the peer's end
    /// returned) and a context holding a region of `len` bytes of 0xab.
    fn state_with_region(len: usize) -> (EngineState, TcpStream, ContextId, u32, Region) {
        let mut hca = Hca::new(HcaConfig::for_host([10, 0, 0, 1]), Box::new(Keys(0)));
        let gid = Gid::from_ipv4([10, 0, 0, 2]);
        let id = hca.link_up(LinkInfo { gid, lid: 2, chunk: 65536, verified: true });
        let mut net = Net::new(Arc::new(setup([10, 0, 0, 1], 65536)));
        let (ours, theirs) = loopback();
        net.links.insert(id, LinkIo::new(id, ours, "10.0.0.2:4791".parse().unwrap(), gid, 9, false).unwrap());
        let ctx = ContextId(1);
        hca.open_context(ctx, TenantId(1000)).unwrap();
        let pd = hca.alloc_pd(ctx).unwrap();
        let r = Region::heap(len);
        r.write(0, &vec![0xab; len]).unwrap();
        let key = hca.reg_mr(ctx, pd, 0x10000, AccessFlags::LOCAL_WRITE, r.clone()).unwrap();
        let cm = crate::cm::CmDriver::new(vrdma_core::cm::ConnectionManager::new(
            Default::default(),
            vec![std::net::Ipv4Addr::new(10, 0, 0, 1)],
            Box::new(Keys(7)),
        ));
        (EngineState::new(hca, Some(net), cm, 100), theirs, ctx, key, r)
    }

    /// Queues on the link a frame: a 3-byte header, then all of `r`.
    fn queue_frame_of(s: &mut EngineState, r: &Region) {
        let mut t = Transmit::default();
        t.header.extend([1, 2, 3]);
        t.payload.push(IoSeg { region: r.clone(), off: 0, len: r.len() });
        s.net.as_mut().unwrap().links.values_mut().next().unwrap().queue(t);
    }

    /// Writes the link's queue out and reads it at the peer's end.
    fn sent(s: &mut EngineState, theirs: &mut TcpStream, n: usize) -> Vec<u8> {
        theirs.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        let mut got = Vec::new();
        let mut buf = vec![0u8; 64 << 10];
        let started = std::time::Instant::now();
        while got.len() < n && started.elapsed() < Duration::from_secs(10) {
            let now = s.now();
            s.net.as_mut().unwrap().drive(&mut s.hca, &mut s.rings, now);
            if let Ok(k) = std::io::Read::read(theirs, &mut buf) {
                got.extend_from_slice(&buf[..k]);
            }
        }
        got
    }

    /// An engine with the transport on and one link over loopback (the
    /// peer's end returned), yielding for a second after work before it
    /// would sleep.
    fn engine_with_link(link_wake: bool) -> (Engine, TcpStream) {
        let hca = Hca::new(HcaConfig::for_host([10, 0, 0, 1]), Box::new(Keys(0)));
        let cm = crate::cm::CmDriver::new(vrdma_core::cm::ConnectionManager::new(
            Default::default(),
            vec![std::net::Ipv4Addr::new(10, 0, 0, 1)],
            Box::new(Keys(7)),
        ));
        let cfg = EngineConfig { spin_us: 0, yield_us: 1_000_000, link_wake, ..EngineConfig::default() };
        let e = Engine::start(hca, cm, cfg, Some(Arc::new(setup([10, 0, 0, 1], 65536)))).unwrap();
        let (ours, theirs) = loopback();
        e.handle()
            .call(move |s| {
                let gid = Gid::from_ipv4([10, 0, 0, 2]);
                let hello = vrdma_core::wire::HelloRepr::new(
                    vrdma_core::wire::Role::Acceptor,
                    9,
                    gid,
                    2,
                    [0; vrdma_core::wire::NONCE_LEN],
                );
                let peer = crate::net::Peer { hello, chunk: 65536, version: vrdma_core::wire::VERSION };
                let addr = "10.0.0.2:4791".parse().unwrap();
                s.net.as_mut().unwrap().add(&mut s.hca, ours, peer, addr, None);
            })
            .unwrap();
        (e, theirs)
    }

    /// Whether a keepalive request written by the peer while the engine
    /// thread takes no turns (as when it is not scheduled) is answered
    /// within `within`.
    fn answered_while_the_engine_is_held(link_wake: bool, within: Duration) -> bool {
        use std::io::{Read, Write};
        use vrdma_core::wire::{FrameRepr, KeepaliveRepr};
        let (e, mut theirs) = engine_with_link(link_wake);
        let core = e.handle().core.clone();
        // The engine goes idle (arming the waker), then stops taking turns.
        std::thread::sleep(Duration::from_millis(50));
        core.hold.store(true, Ordering::SeqCst);
        let started = std::time::Instant::now();
        while !core.held.load(Ordering::SeqCst) {
            assert!(started.elapsed() < Duration::from_secs(10), "the engine was never held");
            std::thread::sleep(Duration::from_millis(1));
        }
        let f = FrameRepr::Keepalive(KeepaliveRepr { seq: 7, reply: false });
        let mut b = vec![0u8; f.header_len()];
        f.emit(&mut b).unwrap();
        theirs.write_all(&b).unwrap();
        // The reply: a keepalive frame with `reply` set (the link may have
        // sent a request of its own first).
        theirs.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 256];
        let started = std::time::Instant::now();
        let want = {
            let r = FrameRepr::Keepalive(KeepaliveRepr { seq: 7, reply: true });
            let mut v = vec![0u8; r.header_len()];
            r.emit(&mut v).unwrap();
            v
        };
        let mut answered = false;
        while started.elapsed() < within {
            if let Ok(n) = theirs.read(&mut buf) {
                got.extend_from_slice(&buf[..n]);
            }
            if got.windows(want.len()).any(|w| w == want) {
                answered = true;
                break;
            }
        }
        if answered && link_wake {
            // (It counts its pass after the pass wrote the reply.)
            let started = std::time::Instant::now();
            while e.link_wake_passes() == 0 && started.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(1));
            }
            assert!(e.link_wake_passes() > 0, "answered, but not by the waker");
        }
        core.hold.store(false, Ordering::SeqCst);
        answered
    }

    /// A frame that comes while the engine idles is acted on by the links'
    /// waker, without the engine thread taking a turn; without the waker
    /// it waits for the engine (here: held for good, so unanswered).
    #[test]
    fn a_frame_that_comes_while_the_engine_idles_is_handled_by_the_links_waker() {
        assert!(answered_while_the_engine_is_held(true, Duration::from_secs(10)), "the waker did not answer");
        assert!(
            !answered_while_the_engine_is_held(false, Duration::from_millis(300)),
            "without the waker, a held engine answered: the test shows nothing"
        );
    }

    /// With the transport off, QPs naming other hosts make one warning per
    /// host, whatever their number and however often they ask.
    #[test]
    fn qps_that_name_hosts_with_the_transport_off_are_logged_once_per_host() {
        let mut log = vrdma_core::log_limit::LogLimiter::new();
        let (b, c) = (Gid::from_ipv4([10, 0, 0, 2]), Gid::from_ipv4([10, 0, 0, 3]));
        let out = crate::testing::traced(|| {
            for pass in 0..1000u64 {
                no_transport(&mut log, &[b, c, b], Instant(pass * 1000));
            }
        });
        let lines: Vec<&str> =
            out.lines().filter(|l| l.contains("transport between daemons is off")).collect();
        assert_eq!(lines.len(), 2, "{out}");
        assert!(lines.iter().any(|l| l.contains("10.0.0.2")) && lines.iter().any(|l| l.contains("10.0.0.3")));
        assert!(lines[0].contains("net.psk"), "the line says what turns it on: {}", lines[0]);
    }

    #[test]
    fn a_frame_queued_before_deregistration_or_close_carries_the_regions_bytes() {
        for close in [false, true] {
            let (mut s, mut theirs, ctx, key, r) = state_with_region(4096);
            queue_frame_of(&mut s, &r);
            if close {
                s.close_context(ctx);
            } else {
                s.dereg_mr(ctx, key).unwrap();
            }
            assert!(r.is_revoked());
            // The tenant reuses the memory once its call returned.
            r.write(0, &[0xcd; 4096]).unwrap();
            let got = sent(&mut s, &mut theirs, 3 + 4096);
            assert_eq!(got.len(), 3 + 4096, "close {close}: the frame went out");
            assert!(got[3..].iter().all(|&b| b == 0xab), "close {close}: not the bytes the region held");
        }
    }

    /// A connect with no link up held its REQ for a dial; the dial failed
    /// (the peer refused our crossing dial) and the peer's own link came up
    /// between two engine passes. The manager hears both in that order:
    /// the connection ends at once (review, links3 A: it was bound to the
    /// new link that never carried its REQ, and waited out its timeout).
    #[test]
    fn a_failed_dial_then_a_new_link_end_the_held_connect_at_once() {
        use vrdma_core::cm::{ConnInfo, PortSpace, State};
        let (mut s, _peer, _, _, _) = state_with_region(16);
        let (b, gid) = (std::net::Ipv4Addr::new(10, 0, 0, 3), Gid::from_ipv4([10, 0, 0, 3]));
        let (ctx, tenant) = (ContextId(1), TenantId(1000));
        let now = s.now();
        let cm = &mut s.cm.cm;
        let id = cm.create_id(ctx, tenant, PortSpace::Tcp).unwrap();
        cm.resolve_addr(ctx, id, None, std::net::SocketAddrV4::new(b, 7471)).unwrap();
        cm.resolve_route(ctx, id).unwrap();
        cm.connect(ctx, id, ConnInfo { qp_num: 0x11, ..ConnInfo::default() }, now).unwrap();
        s.run_cm(now);
        let net = s.net.as_mut().unwrap();
        net.dial_failed(std::net::SocketAddr::from((b, 4791)), "refused");
        let link = s.hca.link_up(LinkInfo { gid, lid: 3, chunk: 65536, verified: true });
        let (ours, _theirs) = loopback();
        let net = s.net.as_mut().unwrap();
        net.links
            .insert(link, LinkIo::new(link, ours, "10.0.0.3:40000".parse().unwrap(), gid, 5, false).unwrap());
        net.cm_links.push(crate::net::CmLink::Up(b, link, true));
        s.run_cm(now);
        assert_eq!(s.cm.cm.state(ctx, id), Some(State::Closed), "the held connect ended with its dial");
    }

    /// A connect whose REQ waits for our dial to the host's GID's address
    /// is neither sent by nor bound to an unverified link that comes in
    /// meanwhile (from another address, claiming the host's GID): it waits
    /// for the dial. The verified link the dial makes takes it (that
    /// link's end ends it, the other's does not); if the dial fails, it
    /// goes by the unverified link and is bound to it, so that its answers
    /// there are its own and that link's end ends it at once (issue 16).
    #[test]
    fn a_held_connect_waits_for_the_dial_to_the_gids_address_and_is_bound_to_the_link_it_went_by() {
        use vrdma_core::cm::{ConnInfo, PortSpace, State};
        use vrdma_core::wire::{HelloRepr, Role};
        for dial_fails in [false, true] {
            let (mut s, _peer, _, _, _) = state_with_region(16);
            let b = std::net::Ipv4Addr::new(10, 0, 0, 3);
            let (gid, b_addr) = (Gid::from_ipv4(b.octets()), std::net::SocketAddr::from((b, 4791)));
            let (ctx, tenant) = (ContextId(1), TenantId(1000));
            s.net.as_mut().unwrap().record_dials();
            let now = s.now();
            let cm = &mut s.cm.cm;
            let id = cm.create_id(ctx, tenant, PortSpace::Tcp).unwrap();
            cm.resolve_addr(ctx, id, None, std::net::SocketAddrV4::new(b, 7471)).unwrap();
            cm.resolve_route(ctx, id).unwrap();
            cm.connect(ctx, id, ConnInfo { qp_num: 0x11, ..ConnInfo::default() }, now).unwrap();
            s.run_cm(now);
            assert_eq!(s.net.as_ref().unwrap().held_cm(b), 1, "the REQ waits for the dial");
            // A daemon claiming b's GID links in from elsewhere.
            // (A peer of wire version 3: no IPv6 addresses are queued on
            // its link, only what the manager sends.)
            let add = |s: &mut EngineState, from: &str, dialled: Option<std::net::SocketAddr>| {
                let (ours, theirs) = loopback();
                let hello = HelloRepr::new(Role::Initiator, 9, gid, 3, [0; vrdma_core::wire::NONCE_LEN]);
                let peer = crate::net::Peer { hello, chunk: 65536, version: vrdma_core::wire::SOCK_VERSION };
                let net = s.net.as_mut().unwrap();
                net.add(&mut s.hca, ours, peer, from.parse().unwrap(), dialled);
                (*net.links.keys().next_back().unwrap(), theirs)
            };
            let (claim, _t1) = add(&mut s, "192.0.2.9:40000", None);
            s.run_cm(now);
            let net = s.net.as_ref().unwrap();
            assert!(!net.links[&claim].has_output(), "the REQ went by the unverified link");
            assert_eq!(net.held_cm(b), 1);
            let went_by = if dial_fails {
                s.net.as_mut().unwrap().dial_failed(b_addr, "refused");
                claim
            } else {
                add(&mut s, "10.0.0.3:4791", Some(b_addr)).0
            };
            s.run_cm(now);
            let net = s.net.as_ref().unwrap();
            assert_eq!(net.held_cm(b), 0, "dial fails {dial_fails}");
            assert!(net.links[&went_by].has_output(), "dial fails {dial_fails}");
            assert_eq!(s.cm.cm.state(ctx, id), Some(State::ReqSent));
            if went_by != claim {
                assert!(!net.links[&claim].has_output());
                let net = s.net.as_mut().unwrap();
                net.cm_links.push(crate::net::CmLink::Down(b, Some(claim)));
                s.run_cm(now);
                assert_eq!(s.cm.cm.state(ctx, id), Some(State::ReqSent), "bound to the unverified link");
            }
            s.net.as_mut().unwrap().cm_links.push(crate::net::CmLink::Down(b, Some(went_by)));
            s.run_cm(now);
            assert_eq!(
                s.cm.cm.state(ctx, id),
                Some(State::Closed),
                "dial fails {dial_fails}: not bound to the link it went by"
            );
        }
    }

    /// Two links to a host came up (an unverified one, then a verified
    /// one) and a connect was made before the manager heard of either:
    /// its REQ went by no link of the manager's, so the driver chose, the
    /// verified one. The connection is bound to that link, not to the
    /// first one reported: the REP that comes by it is taken, and the
    /// other link's end leaves it alone (review 2 of linkdefer, finding 1:
    /// it was bound to the first, and the REP by the link its REQ went by
    /// was dropped).
    #[test]
    fn a_connect_made_before_its_hosts_links_are_told_is_bound_to_the_link_its_req_went_by() {
        use vrdma_core::cm::{CmMessage, ConnInfo, PortSpace, State};
        let (mut s, _peer, _, _, _) = state_with_region(16);
        let b = std::net::Ipv4Addr::new(10, 0, 0, 3);
        let gid = Gid::from_ipv4(b.octets());
        let (ctx, tenant) = (ContextId(1), TenantId(1000));
        let link = |s: &mut EngineState, verified: bool, from: &str| {
            let id = s.hca.link_up(LinkInfo { gid, lid: 3, chunk: 65536, verified });
            let (ours, theirs) = loopback();
            let mut l = LinkIo::new(id, ours, from.parse().unwrap(), gid, 5, false).unwrap();
            l.verified = verified;
            let net = s.net.as_mut().unwrap();
            net.links.insert(id, l);
            net.cm_links.push(crate::net::CmLink::Up(b, id, verified));
            (id, theirs)
        };
        let (other, mut t_other) = link(&mut s, false, "192.0.2.9:40000");
        let (own, mut t_own) = link(&mut s, true, "10.0.0.3:40000");
        // Whether a connection manager's frame (type 0x05) came (the
        // socket registry's go by every link).
        let read = |t: &mut TcpStream| {
            use std::io::Read;
            t.set_nonblocking(true).unwrap();
            let mut buf = [0; 4096];
            let n = t.read(&mut buf).unwrap_or(0);
            buf[..n].windows(4).any(|w| w[..2] == *b"vR" && w[3] == 0x05)
        };
        // (What a new link sends first is out of the way.)
        s.net.as_mut().unwrap().write_now();
        let _ = (read(&mut t_own), read(&mut t_other));
        let now = s.now();
        let cm = &mut s.cm.cm;
        let id = cm.create_id(ctx, tenant, PortSpace::Tcp).unwrap();
        cm.resolve_addr(ctx, id, None, std::net::SocketAddrV4::new(b, 7471)).unwrap();
        cm.resolve_route(ctx, id).unwrap();
        cm.connect(ctx, id, ConnInfo { qp_num: 0x11, ..ConnInfo::default() }, now).unwrap();
        s.run_cm(now);
        let net = s.net.as_ref().unwrap();
        assert!(!net.links[&own].has_output() && !net.links[&other].has_output());
        let (by_own, by_other) = (read(&mut t_own), read(&mut t_other));
        assert!(by_own && !by_other, "the REQ went by the verified link");
        let rep = CmMessage::Rep {
            to: id,
            from: 7,
            conn: ConnInfo { qp_num: 0x22, ..ConnInfo::default() },
            qkey: 0,
        };
        s.cm.cm.handle_message_by(b, Some(own), rep);
        s.run_cm(now);
        assert_ne!(
            s.cm.cm.state(ctx, id),
            Some(State::ReqSent),
            "the REP by the link the REQ went by was dropped"
        );
        s.net.as_mut().unwrap().cm_links.push(crate::net::CmLink::Down(b, Some(other)));
        s.run_cm(now);
        assert_ne!(s.cm.cm.state(ctx, id), Some(State::Closed), "bound to the link its REQ did not go by");
    }

    /// A connection moved here: its Moved waited for the dial to the
    /// peer's GID's address while an unverified link claiming the host
    /// came in; the dial failed, so the Moved went by that link, and the
    /// connection is bound to it. A verified link came in and the program
    /// disconnected before the manager heard of either link: its DREQ,
    /// queued by no link, goes by the connection's link, where the peer
    /// knows it, not by the verified one, and the connection stays bound
    /// to its link (review 3 of linkdefer, B: the DREQ went by the
    /// verified link, the peer dropped it, and the connection was moved
    /// there).
    #[test]
    fn a_moved_connections_dreq_goes_by_the_link_its_moved_went_by() {
        use vrdma_core::cm::migrate::CmIdSnap;
        use vrdma_core::cm::{ConnInfo, PortSpace, State};
        use vrdma_core::wire::{HelloRepr, Role};
        let (mut s, _peer, _, _, _) = state_with_region(16);
        let b = std::net::Ipv4Addr::new(10, 0, 0, 3);
        let (gid, b_addr) = (Gid::from_ipv4(b.octets()), std::net::SocketAddr::from((b, 4791)));
        let (ctx, tenant, id) = (ContextId(1), TenantId(1000), 0x0100_0005);
        s.net.as_mut().unwrap().record_dials();
        let snap = CmIdSnap {
            id,
            ctx: ctx.0,
            channel: 1,
            ps: PortSpace::Tcp,
            state: State::Established,
            local: Some(std::net::SocketAddrV4::new(std::net::Ipv4Addr::UNSPECIFIED, 40000)),
            remote: Some(std::net::SocketAddrV4::new(b, 7471)),
            reuse: false,
            peer: Some((b, 7)),
            backlog: 0,
            active: true,
            psn: 1,
            ours: Some(ConnInfo { qp_num: 0x11, ..ConnInfo::default() }),
            theirs: Some(ConnInfo { qp_num: 0x22, ..ConnInfo::default() }),
            qp: None,
        };
        let now = s.now();
        s.cm.cm.import_ids(tenant, &[snap]).unwrap();
        s.cm.cm.resume_tenant(tenant, now);
        s.run_cm(now);
        assert_eq!(s.net.as_ref().unwrap().held_cm(b), 1, "the Moved waits for the dial");
        let add = |s: &mut EngineState, from: &str| {
            let (ours, theirs) = loopback();
            let hello = HelloRepr::new(Role::Initiator, 9, gid, 3, [0; vrdma_core::wire::NONCE_LEN]);
            let peer = crate::net::Peer { hello, chunk: 65536, version: vrdma_core::wire::SOCK_VERSION };
            let net = s.net.as_mut().unwrap();
            net.add(&mut s.hca, ours, peer, from.parse().unwrap(), None);
            (*net.links.keys().next_back().unwrap(), theirs)
        };
        // Whether a connection manager's frame (type 0x05) came.
        let read = |t: &mut TcpStream| {
            use std::io::Read;
            t.set_nonblocking(true).unwrap();
            let mut buf = [0; 4096];
            let n = t.read(&mut buf).unwrap_or(0);
            buf[..n].windows(4).any(|w| w[..2] == *b"vR" && w[3] == 0x05)
        };
        let (claim, mut t_claim) = add(&mut s, "192.0.2.9:40000");
        s.run_cm(now);
        s.net.as_mut().unwrap().dial_failed(b_addr, "refused");
        let net = s.net.as_mut().unwrap();
        assert_eq!(net.held_cm(b), 0);
        net.write_now();
        assert!(read(&mut t_claim), "the Moved went by the unverified link");
        // Before the manager hears of the links: a verified one, and the
        // program's disconnect.
        let (own, mut t_own) = add(&mut s, "10.0.0.3:40000");
        let net = s.net.as_mut().unwrap();
        assert!(net.links[&own].verified);
        net.write_now();
        let _ = read(&mut t_own);
        s.cm.cm.disconnect(ctx, id, now).unwrap();
        s.run_cm(now);
        s.net.as_mut().unwrap().write_now();
        let (by_own, by_claim) = (read(&mut t_own), read(&mut t_claim));
        assert!(!by_own && by_claim, "the DREQ went by the verified link");
        assert_eq!(s.cm.cm.state(ctx, id), Some(State::DreqSent));
        s.net.as_mut().unwrap().cm_links.push(crate::net::CmLink::Down(b, Some(own)));
        s.run_cm(now);
        assert_eq!(s.cm.cm.state(ctx, id), Some(State::DreqSent), "bound to the link its DREQ went by");
        s.net.as_mut().unwrap().cm_links.push(crate::net::CmLink::Down(b, Some(claim)));
        s.run_cm(now);
        assert_eq!(s.cm.cm.state(ctx, id), Some(State::Closed), "not bound to the link its Moved went by");
    }

    /// A connect whose REQ waits for a dial, destroyed meanwhile: its REQ
    /// (and the REJ its end sent) are dropped, not sent by the host's next
    /// link to a listener for a connection already ended (review links4
    /// finding 3).
    #[test]
    fn a_held_req_of_a_connection_that_ended_is_not_sent() {
        use vrdma_core::cm::{ConnInfo, PortSpace};
        let (mut s, _peer, _, _, _) = state_with_region(16);
        let b = std::net::Ipv4Addr::new(10, 0, 0, 3);
        let (ctx, tenant) = (ContextId(1), TenantId(1000));
        let now = s.now();
        let cm = &mut s.cm.cm;
        let id = cm.create_id(ctx, tenant, PortSpace::Tcp).unwrap();
        cm.resolve_addr(ctx, id, None, std::net::SocketAddrV4::new(b, 7471)).unwrap();
        cm.resolve_route(ctx, id).unwrap();
        cm.connect(ctx, id, ConnInfo { qp_num: 0x11, ..ConnInfo::default() }, now).unwrap();
        s.run_cm(now);
        assert_eq!(s.net.as_ref().unwrap().held_cm(b), 1, "the REQ waits for the dial");
        s.cm.cm.destroy_id(ctx, id, now).unwrap();
        s.run_cm(now);
        assert_eq!(s.net.as_ref().unwrap().held_cm(b), 0, "the ended connection's REQ was dropped");
    }
}
