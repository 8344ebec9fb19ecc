//! One tenant connection: a context and everything it creates.
//!
//! The session thread parses requests, maps and creates shared memory
//! (system calls stay off the engine's critical section), and makes the
//! object changes on the engine's state, under its lock, between two of
//! the engine's passes (`engine::handle`). When the socket closes, for whatever reason including
//! SIGKILL of the tenant, the context and all its objects are destroyed.

// An `Answer` is the reply to send whichever way a request ends; it is not
// on the data path, so its size in `Result` does not matter.
#![allow(clippy::result_large_err)]

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use vrdma_core::hca::{ContextId, HcaError, StatCursor, StatView, TenantId};
use vrdma_core::log_limit::Source;
use vrdma_core::memory::{Backing, Region};
use vrdma_core::proto::{
    self, CmReply, CmRequest, Reply, Request, RingSpec, ASYNC_EVENT_SIZE, ASYNC_RING_CAPACITY, MAX_FDS,
    MAX_MESSAGE, MAX_REPLY_FDS, POSTED_RING_CAPACITY, POSTED_SLOT_SIZE, PROTOCOL_VERSION,
};
use vrdma_core::ring::{recv_stride, send_stride, CQE_SIZE};
use vrdma_shm::{fdpass, page_size, ring_bytes, Doorbell, Mapping, RingView, Segment};

use super::guest_memory::{GuestMemory, RingMemory};
use super::ring_pool::RingPool;
use super::Shared;
use crate::engine::{ContextRings, CqRing, InRing, QpRings};
use crate::vm::{Kind, Place};

mod adopt;
mod cm_batch;
mod comp_channel;
mod mr_pieces;
pub(super) use mr_pieces::map_pieces;
mod vm_region;

const EINVAL: i32 = 22;
const EPROTO: i32 = 71;
const EBUSY: i32 = 16;
const ENOMEM: i32 = 12;

/// What travels with a reply where a host tenant gets a descriptor.
pub(super) enum Carry {
    /// A descriptor (to a guest: proxied, see `guest`).
    Fd(OwnedFd),
    /// Guest sessions: bytes of the VM's region, where a host tenant would
    /// get a memfd.
    Extent { offset: u64, len: u64 },
    /// Host sessions: a ring in chunk `chunk` of the context's ring pool
    /// (`ring_pool`), `len` bytes long; [`Session::pooled`] makes the
    /// reply say so, with the chunk's memfd the first time.
    Pool { chunk: u32, len: u64 },
}

impl From<OwnedFd> for Carry {
    fn from(fd: OwnedFd) -> Carry {
        Carry::Fd(fd)
    }
}

impl From<Doorbell> for Carry {
    fn from(d: Doorbell) -> Carry {
        Carry::Fd(d.into())
    }
}

/// The ring's own memfd, where `carry` is one.
fn own_fd(carry: &Carry) -> Option<&OwnedFd> {
    match carry {
        Carry::Fd(f) => Some(f),
        _ => None,
    }
}

/// A reply and what travels with it.
pub(super) struct Answer {
    pub reply: Reply,
    pub fds: Vec<Carry>,
}

impl From<Reply> for Answer {
    fn from(reply: Reply) -> Self {
        Answer { reply, fds: Vec::new() }
    }
}

pub(super) fn error(errno: i32, message: impl Into<String>) -> Answer {
    Reply::Error { errno, message: message.into() }.into()
}

impl From<HcaError> for Answer {
    fn from(e: HcaError) -> Self {
        error(e.errno(), e.to_string())
    }
}

impl From<std::io::Error> for Answer {
    fn from(e: std::io::Error) -> Self {
        error(e.raw_os_error().unwrap_or(ENOMEM), e.to_string())
    }
}

fn engine_gone() -> Answer {
    error(libc::ENODEV, "the device engine has stopped")
}

pub(super) struct Session {
    ctx: ContextId,
    tenant: TenantId,
    pid: i32,
    /// The peer's uid as the kernel told it (0 for a guest session, whose
    /// peer is QEMU and counts for nothing).
    uid: u32,
    /// Set for a guest session: its VM and its part of the VM's region.
    guest: Option<GuestMemory>,
    shared: Arc<Shared>,
    open: bool,
    /// Holds a numbered tenant while the session lives; dropped after the
    /// context is closed (fields drop after `Drop::drop`).
    _seat: super::Seat,
    /// The tenant's admission and shares of the daemon's mappings and
    /// descriptors, from Hello on; dropped, like the seat, after the
    /// context is closed.
    admitted: Option<super::admission::Admitted>,
    /// A host context's ring pool, made when its first ring is
    /// (`ring_pool`); its rings hold it, and it ends with the last.
    pool: Option<Arc<RingPool>>,
}

/// How long a new connection may take to open its context with Hello.
const HELLO_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);
/// Completion channels one tenant may hold: each keeps a descriptor in the
/// daemon (see `create_channel`).
pub(crate) const MAX_CHANNELS_PER_TENANT: usize = 1024;

/// How long a reply may wait for the tenant to make room for it. A tenant
/// that reads none of its replies for this long is gone or hostile: its
/// context is closed. (One that sent its own end of the connection through
/// it and exited would otherwise keep it, and its context, for ever.)
const REPLY_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

pub(crate) fn run(
    sock: OwnedFd,
    id: u32,
    tenant: TenantId,
    cred: fdpass::PeerCred,
    seat: super::Seat,
    shared: Arc<Shared>,
) {
    let mut s = Session {
        ctx: ContextId(id),
        tenant,
        pid: cred.pid,
        uid: cred.uid,
        guest: None,
        shared,
        open: false,
        _seat: seat,
        admitted: None,
        pool: Some(RingPool::new()),
    };
    tracing::debug!(ctx = id, pid = cred.pid, uid = cred.uid, tenant = tenant.0, "tenant connected");
    let mut buf = vec![0u8; MAX_MESSAGE];
    // A connection that never opens its context would hold a thread and two
    // descriptors for ever.
    use rustix::net::sockopt::{set_socket_timeout, Timeout};
    let timeout = |t| set_socket_timeout(&sock, Timeout::Recv, t);
    if set_socket_timeout(&sock, Timeout::Send, Some(REPLY_LIMIT)).is_err() {
        return;
    }
    // A deadline, not a pause between messages: requests other than Hello
    // do not keep a context-less connection open.
    let hello_by = std::time::Instant::now() + HELLO_LIMIT;
    let mut saying_hello = true;
    loop {
        if saying_hello && s.open {
            saying_hello = false;
            if timeout(None).is_err() {
                break;
            }
        }
        if saying_hello {
            let left = hello_by.saturating_duration_since(std::time::Instant::now());
            // At least 1 ms: a timeout that rounds to zero would mean none.
            let left = left.max(std::time::Duration::from_millis(1));
            if hello_by <= std::time::Instant::now() || timeout(Some(left)).is_err() {
                tracing::debug!(ctx = id, "no Hello within {HELLO_LIMIT:?}; closing");
                break;
            }
        }
        if !saying_hello {
            // A tenant's next request often follows its last reply within
            // microseconds (a connection's setup is several calls in a
            // row): a short look first where cores are spare.
            vrdma_shm::spin::before_blocking_on(sock.as_fd());
        }
        let msg = match fdpass::recv_msg(sock.as_fd(), &mut buf, MAX_FDS) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) if saying_hello && e.kind() == std::io::ErrorKind::WouldBlock => {
                tracing::debug!(ctx = id, "no Hello within {HELLO_LIMIT:?}; closing");
                break;
            }
            Err(e) => {
                tracing::debug!(ctx = id, error = %e, "control socket error");
                break;
            }
        };
        if msg.len == 0 && !msg.truncated {
            break;
        }
        if s.shared.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            break;
        }
        let answer = if msg.truncated {
            error(EINVAL, format!("message larger than {MAX_MESSAGE} bytes or with more than {MAX_FDS} fds"))
        } else {
            match proto::decode_request(&buf[..msg.len]) {
                Err(e) => error(EINVAL, e.to_string()),
                Ok(req) if msg.fds.len() != req.expected_fds() => {
                    error(EINVAL, format!("request needs {} fds, {} came", req.expected_fds(), msg.fds.len()))
                }
                Ok(req) => s.handle(req, msg.fds),
            }
        };
        let answer = if answer.fds.len() > MAX_REPLY_FDS {
            // A reply the client could not read whole: the daemon's own
            // mistake, answered as an error rather than cut in the kernel.
            tracing::error!(ctx = id, fds = answer.fds.len(), reply = ?answer.reply, "reply with too many descriptors");
            error(EPROTO, format!("the daemon's reply carried more than {MAX_REPLY_FDS} descriptors"))
        } else {
            answer
        };
        let bytes = proto::encode_reply(&answer.reply);
        let fds: Vec<BorrowedFd> = answer
            .fds
            .iter()
            .filter_map(|c| match c {
                Carry::Fd(f) => Some(f.as_fd()),
                // Made for guest sessions only.
                Carry::Extent { .. } => None,
                // Turned into descriptors by `Session::pooled`.
                Carry::Pool { .. } => None,
            })
            .collect();
        if let Err(e) = fdpass::send_msg(sock.as_fd(), &bytes, &fds) {
            if e.kind() == std::io::ErrorKind::WouldBlock {
                const DEAF: &str = "the tenant read no reply in time; closing its context";
                let (log, now) = (&s.shared.log, crate::logs::now());
                vrdma_core::limited_warn!(
                    crate::logs::lock(log), Source::Tenant(tenant), now, DEAF,
                    ctx = id, limit = ?REPLY_LIMIT
                );
            } else {
                tracing::debug!(ctx = id, error = %e, "cannot reply; closing");
            }
            break;
        }
    }
    // Session's Drop closes the context, also if handling a request panicked.
}

impl Drop for Session {
    fn drop(&mut self) {
        self.close();
        // The context's regions are gone: its memory extents are free.
        if let Some(g) = self.guest.take() {
            g.vm.placed().forget_context(self.ctx.0);
            let mut ext = g.vm.extents();
            for offset in g.memory.keys() {
                ext.free(*offset);
            }
        }
        let id = self.ctx.0;
        self.shared.take_moved(id);
        let mut sessions = self.shared.sessions.lock().unwrap_or_else(|p| p.into_inner());
        sessions.retain(|(i, ..)| *i != id);
    }
}

impl Session {
    fn close(&mut self) {
        if !std::mem::take(&mut self.open) {
            return;
        }
        let ctx = self.ctx;
        let r = self.shared.engine.call(move |e| {
            let channels = e.rings.channels.values().filter(|ch| ch.ctx == ctx).count();
            for _ in 0..channels {
                e.hca.refund_object(ctx);
            }
            let now = e.now();
            e.cm.close_context(ctx);
            e.run_cm(now);
            let t = e.close_context(ctx);
            e.rings.remove_torn_down(&t);
            e.rings.channels.retain(|_, ch| ch.ctx != ctx);
            e.rings.contexts.remove(&ctx);
        });
        if r.is_ok() {
            tracing::debug!(ctx = ctx.0, pid = self.pid, "context closed; its objects are destroyed");
        }
    }

    /// The budget the mappings made for this tenant are charged to.
    fn budget(&self) -> Option<&Arc<vrdma_shm::MappingBudget>> {
        self.admitted.as_ref().map(|a| a.budget())
    }

    /// Runs `f` on the engine with this context's id.
    fn engine<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut crate::engine::EngineState, ContextId) -> R + Send + 'static,
    ) -> Result<R, Answer> {
        let ctx = self.ctx;
        self.shared.engine.call(move |e| f(e, ctx)).map_err(|_| engine_gone())
    }

    /// Queues `f` for the engine without waiting for it to run. For what
    /// the tenant cannot need before its next request that reaches the
    /// engine (which runs after `f`): the request is answered without
    /// waiting for the engine's lock a second time.
    fn post_to_engine(
        &self,
        f: impl FnOnce(&mut crate::engine::EngineState, ContextId) + Send + 'static,
    ) -> Result<(), Answer> {
        let ctx = self.ctx;
        self.shared.engine.post(move |e| f(e, ctx)).map_err(|_| engine_gone())
    }

    pub(super) fn handle(&mut self, req: Request, fds: Vec<OwnedFd>) -> Answer {
        let shared = self.shared.clone();
        let (answer, _pass) = self.handle_gated(&shared, req, fds);
        answer
    }

    /// [`handle`](Self::handle), and the pause gate's pass of a call that
    /// changes state (`gate` is this session's `Shared`): the call counts
    /// as running until the caller drops it, so that what the caller does
    /// with the answer first (a guest port remembers a numbered call's
    /// reply) happens before a pause, and so before an export.
    pub(super) fn handle_gated<'g>(
        &mut self,
        gate: &'g Shared,
        req: Request,
        fds: Vec<OwnedFd>,
    ) -> (Answer, Option<super::pause_gate::Pass<'g>>) {
        if !self.open
            && !matches!(
                req,
                Request::Hello { .. }
                    | Request::AdoptContext { .. }
                    | Request::VmAttach { .. }
                    | Request::Migrate(_)
            )
        {
            return (error(EPROTO, "the first request must be Hello"), None);
        }
        // A call that changes the tenant's device state waits while the
        // tenant is paused for a migration (`pause_gate`), and counts as
        // running until answered, so that a pause waits for it.
        let pass = if changes_state(&req) {
            let (tenant, id) = (self.tenant, self.ctx.0);
            match gate.gate.enter(tenant, || gate.is_moved(id)) {
                Ok(p) => Some(p),
                Err(super::pause_gate::Held::Moved) => {
                    // Not run: the guest's port ends the session as moved
                    // and the guest sends it again on the destination; a
                    // host session's connection is closed already.
                    let a = error(
                        libc::ENODEV,
                        "the context moved to another host while the call waited; it was not run here",
                    );
                    return (a, None);
                }
                Err(super::pause_gate::Held::TooLong(limit)) => {
                    let a = error(
                        libc::ETIMEDOUT,
                        format!(
                            "the tenant has been paused for a migration for more than {limit:?}; \
                             the call was not run"
                        ),
                    );
                    return (a, None);
                }
            }
        } else {
            None
        };
        let a = match self.dispatch(req, fds) {
            Ok(a) => self.pooled(a),
            Err(a) => a,
        };
        (a, pass)
    }

    /// An answer that places rings in the context's pool becomes
    /// `Reply::Pooled`: where each ring lies, and the memfd of each chunk
    /// the library has not mapped yet, once.
    fn pooled(&self, a: Answer) -> Answer {
        if !a.fds.iter().any(|c| matches!(c, Carry::Pool { .. })) {
            return a;
        }
        let Some(pool) = &self.pool else {
            return error(EPROTO, "a pooled ring without a pool");
        };
        let (mut rings, mut fds) = (Vec::with_capacity(a.fds.len()), Vec::with_capacity(a.fds.len()));
        for c in a.fds {
            match c {
                Carry::Pool { chunk, len } => {
                    let fd = match pool.fd_for_reply(chunk) {
                        Ok(fd) => fd,
                        Err(e) => return e.into(),
                    };
                    rings.push(proto::PoolRing::Chunk { chunk, len, fd: fd.is_some() });
                    fds.extend(fd.map(Carry::Fd));
                }
                Carry::Fd(f) => {
                    rings.push(proto::PoolRing::Own);
                    fds.push(Carry::Fd(f));
                }
                Carry::Extent { .. } => return error(EPROTO, "a guest's extent in a host's reply"),
            }
        }
        Answer { reply: Reply::Pooled { rings, reply: Box::new(a.reply) }, fds }
    }

    fn dispatch(&mut self, req: Request, mut fds: Vec<OwnedFd>) -> Result<Answer, Answer> {
        Ok(match req {
            Request::Hello { version } => self.hello(version)?,
            Request::AdoptContext { version, context } => self.adopt(version, context)?,
            Request::QueryDevice => Reply::Device(self.engine(|e, c| e.hca.device_attr(c))??).into(),
            Request::QueryPort { port } => {
                if port != 1 {
                    return Err(error(EINVAL, format!("no port {port}; the device has port 1")));
                }
                Reply::Port(self.engine(|e, _| e.hca.config().port.clone())?).into()
            }
            Request::QueryGid { port, index } => {
                let gid = self.engine(move |e, _| e.hca.config().gids.get(index as usize).copied())?;
                match (port, gid) {
                    (1, Some(g)) => Reply::Gid(g).into(),
                    _ => return Err(error(EINVAL, format!("no GID {index} on port {port}"))),
                }
            }
            Request::AllocPd => {
                let pd = self.engine(|e, c| e.hca.alloc_pd(c))??;
                Reply::Pd { pd }.into()
            }
            Request::DeallocPd { pd } => {
                self.engine(move |e, c| e.hca.dealloc_pd(c, pd))??;
                Reply::Done.into()
            }
            Request::RegMr { pd, addr, len, access, fd_offset } if self.guest.is_some() => {
                self.reg_guest_mr(pd, addr, len, access, fd_offset)?
            }
            Request::RegMr { pd, addr, len, access, fd_offset } => {
                let Some(fd) = fds.pop() else {
                    return Err(error(EINVAL, "RegMr needs the region's memfd"));
                };
                let direct =
                    self.engine(move |e, c| e.hca.may_register(c, len).map(|()| e.direct.enabled))??;
                // The direct path hands a remotely accessible region's
                // memfd to peers, and a locally writable one's (SENDs land
                // in receive SGEs).
                // Charged to the tenant's descriptors; at its limit the
                // region is not kept, and WRs on it take the engine.
                let kept = if direct
                    && access.intersects(vrdma_core::hca::DIRECT_RIGHTS | vrdma_core::hca::DIRECT_LOCAL)
                {
                    self.admitted
                        .as_ref()
                        .and_then(|a| a.charge_kept())
                        .and_then(|c| Some((fd.try_clone().ok()?, c)))
                } else {
                    None
                };
                let region = map_region(fd, fd_offset, len, self.budget())?;
                let key = self.engine(move |e, c| {
                    let key = e.hca.reg_mr(c, pd, addr, access, region)?;
                    if let Some((fd, charge)) = kept {
                        e.direct.keep_region(c, key, fd, fd_offset, charge);
                    }
                    Ok::<_, HcaError>(key)
                })??;
                Reply::Mr { key }.into()
            }
            Request::RegMrPieces { pd, addr, len, access, pieces } => {
                self.reg_mr_pieces(pd, addr, len, access, pieces, fds)?
            }
            Request::DeregMr { key } => {
                let wait = self.engine(move |e, c| e.dereg_mr(c, key))??;
                crate::direct::drain(&wait);
                if let Some(g) = self.guest.as_mut() {
                    g.deregistered(key);
                }
                self.unplace(Kind::Mr, key);
                Reply::Done.into()
            }
            // The direct path passes memfds, which cannot reach a guest.
            Request::DirectGrant { .. }
            | Request::DirectRecvGrant { .. }
            | Request::DirectSrqLimit { .. }
                if self.guest.is_some() =>
            {
                Reply::DirectRefused(vrdma_core::hca::DirectRefusal::Off).into()
            }
            Request::VmAttach { name } => self.vm_attach(&name)?,
            Request::Migrate(m) => {
                super::migrate::handle(&self.shared, self.uid, self.guest.is_some(), m, fds)?
            }
            Request::GuestAlloc { len } => self.guest_alloc(len)?,
            Request::GuestFree { offset } => self.guest_free(offset)?,
            Request::GuestGrow { offset, len } => self.guest_grow(offset, len)?,
            Request::DirectGrant { qp, rkey } => {
                let charge = self.admitted.as_ref().and_then(|a| a.charge_kept());
                match self.engine(move |e, c| e.direct.grant(&mut e.hca, c, qp, rkey, charge))? {
                    Ok((granted, fds)) => Answer {
                        reply: Reply::DirectGrant(granted),
                        fds: fds.into_iter().map(Carry::from).collect(),
                    },
                    Err(why) => Reply::DirectRefused(why).into(),
                }
            }
            Request::DirectRecvGrant { qp } => {
                let charge = self.admitted.as_ref().and_then(|a| a.charge_kept());
                match self.engine(move |e, c| e.direct.grant_recv(&mut e.hca, &e.rings, c, qp, charge))? {
                    Ok((granted, fds)) => Answer {
                        reply: Reply::DirectRecvGrant(granted),
                        fds: fds.into_iter().map(Carry::from).collect(),
                    },
                    Err(why) => Reply::DirectRefused(why).into(),
                }
            }
            Request::CreateCompChannel => {
                // Its doorbell is a descriptor in the daemon (see admission).
                let admitted = self.admitted.as_mut().ok_or_else(|| error(EPROTO, "no context"))?;
                admitted.charge_descriptor().map_err(|e| error(e.errno(), e.to_string()))?;
                let made = self.create_channel();
                if made.is_err() {
                    if let Some(a) = self.admitted.as_mut() {
                        a.refund_descriptor();
                    }
                }
                made?
            }
            Request::DestroyCompChannel { channel } => {
                self.engine(move |e, c| match e.rings.channels.get(&channel) {
                    Some(ch) if ch.ctx == c && ch.cqs > 0 => {
                        Err(error(EBUSY, "completion channel still has CQs"))
                    }
                    Some(ch) if ch.ctx == c => {
                        e.rings.channels.remove(&channel);
                        e.hca.refund_object(c);
                        Ok(())
                    }
                    _ => Err(error(EINVAL, format!("no completion channel {channel}"))),
                })??;
                self.unplace(Kind::Channel, channel);
                if let Some(a) = self.admitted.as_mut() {
                    a.refund_descriptor();
                }
                Reply::Done.into()
            }
            Request::CreateCq { cqe, channel } => self.create_cq(cqe, channel)?,
            Request::Cm(CmRequest::CreateChannel) => self.create_cm_channel()?,
            Request::Cm(CmRequest::CreateQp { id, pd, init }) => self.create_cm_qp(id, pd, init)?,
            Request::Cm(CmRequest::CreateQpWithCq { id, pd, cqe, init }) => {
                self.create_cm_qp_with_cq(id, pd, cqe, init)?
            }
            Request::Cm(CmRequest::Batch { ops }) => self.cm_batch(ops)?,
            Request::Cm(req) => {
                let (tenant, destroys) = (self.tenant, matches!(req, CmRequest::DestroyChannel { .. }));
                let r = self.engine(move |e, c| e.handle_cm(c, tenant, req))?;
                match r {
                    Ok(reply) => {
                        if destroys {
                            if let Some(a) = self.admitted.as_mut() {
                                a.refund_descriptor();
                            }
                        }
                        Reply::Cm(reply).into()
                    }
                    Err(e) => error(e.errno(), e.to_string()),
                }
            }
            Request::Sock(req) => self.sock(req, false)?,
            // A link-local address's scope travels beside the request
            // (`SockRequest`'s encoding drops it); its library names
            // scopes, so its `[::]` listener may own link-local ones.
            Request::SockScoped { scopes, req } => self.sock(req.with_scopes(scopes), true)?,
            Request::DirectChannel { .. } if self.guest.is_some() => {
                Reply::DirectRefused(vrdma_core::hca::DirectRefusal::Off).into()
            }
            Request::DirectChannel { cq } => {
                match self.engine(move |e, c| e.direct.channel_bell(&e.rings, c, cq))? {
                    Ok(fd) => Answer { reply: Reply::DirectChannel, fds: vec![Carry::from(fd)] },
                    Err(why) => Reply::DirectRefused(why).into(),
                }
            }
            Request::DestroyCq { cq } => {
                self.destroy_cq(cq)??;
                Reply::Done.into()
            }
            Request::CreateSrq { pd, attr } => self.create_srq(pd, attr)?,
            Request::ModifySrq { srq, limit, resize } => {
                self.engine(move |e, c| {
                    e.hca.modify_srq(c, srq, limit, resize)?;
                    // The armed limit, for the direct path's claimers.
                    let now = e.hca.query_srq(c, srq)?.srq_limit;
                    if let Some(r) = e.rings.srqs.get(&srq) {
                        r.ring
                            .aux(vrdma_core::proto::SRQ_AUX_LIMIT)
                            .store(now, std::sync::atomic::Ordering::SeqCst);
                    }
                    Ok::<_, HcaError>(())
                })??;
                Reply::Done.into()
            }
            Request::DirectSrqLimit { qp } => {
                self.engine(move |e, c| e.hca.direct_srq_limit(c, qp, &mut e.rings))?;
                Reply::Done.into()
            }
            Request::QuerySrq { srq } => {
                Reply::SrqAttr(self.engine(move |e, c| e.hca.query_srq(c, srq))??).into()
            }
            Request::DestroySrq { srq } => {
                self.engine(move |e, c| {
                    e.hca.destroy_srq(c, srq)?;
                    e.rings.srqs.remove(&srq);
                    e.direct.forget_srq(srq);
                    Ok::<_, HcaError>(())
                })??;
                self.unplace(Kind::Srq, srq);
                Reply::Done.into()
            }
            Request::CreateQp { pd, init } => self.create_qp(pd, init)?,
            Request::ModifyQp { qp, attr, mask } => {
                let wait = self.engine(move |e, c| {
                    e.hca.modify_qp(c, qp, &attr, mask, &mut e.rings)?;
                    Ok::<_, HcaError>(e.direct.sync(&mut e.hca))
                })??;
                crate::direct::drain(&wait);
                Reply::Done.into()
            }
            Request::QueryQp { qp } => {
                let (attr, init) = self.engine(move |e, c| e.hca.query_qp(c, qp))??;
                Reply::QpAttr { attr, init }.into()
            }
            Request::DestroyQp { qp } => {
                let wait = self.engine(move |e, c| {
                    e.hca.destroy_qp(c, qp, &mut e.rings)?;
                    e.rings.remove_qp(qp);
                    e.direct.forget_qp(qp);
                    Ok::<_, HcaError>(e.direct.sync(&mut e.hca))
                })??;
                crate::direct::drain(&wait);
                self.unplace(Kind::Qp, qp);
                Reply::Done.into()
            }
            Request::CreateAh { pd, attr } => {
                let ah = self.engine(move |e, c| e.hca.create_ah(c, pd, attr))??;
                Reply::Ah { ah }.into()
            }
            Request::DestroyAh { ah } => {
                self.engine(move |e, c| e.hca.destroy_ah(c, ah))??;
                Reply::Done.into()
            }
            Request::Stat => {
                let view = self.stat_view();
                Reply::Stat(self.engine(move |e, c| e.hca.stat(c, StatCursor::START, view))??.report).into()
            }
            Request::StatPage { from } => {
                let view = self.stat_view();
                Reply::StatPage(self.engine(move |e, c| e.hca.stat(c, from, view))??).into()
            }
        })
    }

    /// What `vrdma stat` shows this session: the links' totals over every
    /// tenant and the daemon's missed wake-ups to the operator (root or
    /// the daemon's uid, as for migrations; never a guest), its own
    /// tenant's share of them to anyone else (docs/trust.md, "What
    /// `vrdma stat` shows a tenant").
    fn stat_view(&self) -> StatView {
        if self.guest.is_none() && super::migrate::is_operator(self.uid) {
            StatView::Operator
        } else {
            StatView::Tenant
        }
    }

    /// Admits this session's tenant under its quota (`admission`),
    /// charging it a context's descriptors.
    fn admit(&self) -> Result<super::admission::Admitted, Answer> {
        let tenant = self.tenant;
        let q = self.engine(move |e, _| e.hca.quota(tenant))?;
        self.shared
            .admission
            .admit(tenant, q.max_mappings.unwrap_or(u32::MAX), q.max_descriptors.unwrap_or(u32::MAX))
            .map_err(|e| error(e.errno(), e.to_string()))
    }

    /// A socket registry call (`docs/sockets.md`).
    fn sock(&mut self, req: vrdma_core::proto::SockRequest, scoped: bool) -> Result<Answer, Answer> {
        let tenant = self.tenant;
        Ok(match self.engine(move |e, c| e.handle_sock_as(c, tenant, req, scoped))? {
            // Another host's answer is waited for here, off the engine's
            // lock.
            Ok(call) => Reply::Sock(call.reply()).into(),
            Err(e) => error(e.errno(), e.to_string()),
        })
    }

    fn hello(&mut self, version: u32) -> Result<Answer, Answer> {
        if self.open {
            return Err(error(EPROTO, "Hello was already said"));
        }
        check_version(version)?;
        // Admitted before anything is mapped for it (see admission).
        let admitted = self.admit()?;
        let tenant = self.tenant;
        let events_len = ring_bytes(ASYNC_RING_CAPACITY, ASYNC_EVENT_SIZE);
        let posted_at = events_len.next_multiple_of(64);
        let len = posted_at + ring_bytes(POSTED_RING_CAPACITY, POSTED_SLOT_SIZE);
        debug_assert_eq!(
            (posted_at as u64, len as u64),
            vrdma_core::proto::context_segment_layout(),
            "the core's layout (checked at import) is this one"
        );
        let (seg_fd, seg) = self.new_segment("vrdma-context", len, Some(admitted.budget()))?;
        // A guest's context segment is an extent of its VM's region: where
        // it lies moves with the tenant (its rings are rebuilt there).
        let ctx_place = match &seg_fd {
            Carry::Extent { offset, len } => Some(Place::Ring(*offset, *len)),
            _ => None,
        };
        let events = RingView::in_segment(seg.clone(), 0, ASYNC_RING_CAPACITY, ASYNC_EVENT_SIZE)
            .map_err(|e| error(ENOMEM, e.to_string()))?;
        let posted = RingView::in_segment(seg.clone(), posted_at, POSTED_RING_CAPACITY, POSTED_SLOT_SIZE)
            .map_err(|e| error(ENOMEM, e.to_string()))?;
        // The tenant gets the ringing end of its doorbell and the waiting
        // end of its event signal; the daemon keeps the other ends.
        let (doorbell, doorbell_tenant) = Doorbell::pair()?;
        let doorbell = Arc::new(doorbell);
        // The event signal hangs up when the daemon goes away, so that a
        // tenant polling `async_fd` wakes and hears IBV_EVENT_DEVICE_FATAL.
        let (event_fd, event_tenant) = Doorbell::pair_with_hangup()?;
        let fds = vec![seg_fd, doorbell_tenant.into(), event_tenant.into()];
        let seg_len = seg.len() as u64;
        let origin = match &self.guest {
            Some(g) => Some(crate::engine::Origin::Vm(g.vm.name.clone())),
            None => (self.pid > 0).then_some(crate::engine::Origin::Process(self.pid)),
        };
        self.engine(move |e, c| {
            e.hca.open_context(c, tenant)?;
            if let Some(o) = origin {
                e.processes.insert(c, o);
            }
            e.rings.contexts.insert(c, ContextRings::new(tenant, events, event_fd, doorbell, posted));
            Ok::<_, HcaError>(())
        })??;
        self.open = true;
        self.admitted = Some(admitted);
        if let Some(g) = &self.guest {
            let mut placed = g.vm.placed();
            placed.open_context(self.ctx.0);
            if let Some(p) = ctx_place {
                placed.record(self.ctx.0, Kind::Context, self.ctx.0, p);
            }
        }
        let name = self.shared.device_name.clone();
        Ok(Answer {
            reply: Reply::Hello {
                context: self.ctx.0,
                tenant: self.tenant.0,
                device_name: name,
                segment_len: seg_len,
                async_ring: RingSpec {
                    offset: 0,
                    capacity: ASYNC_RING_CAPACITY,
                    stride: ASYNC_EVENT_SIZE as u32,
                },
                posted_ring: RingSpec {
                    offset: posted_at as u64,
                    capacity: POSTED_RING_CAPACITY,
                    stride: POSTED_SLOT_SIZE as u32,
                },
                channels: Vec::new(),
            },
            fds,
        })
    }

    /// An rdma_cm event channel: a doorbell whose other end the tenant
    /// polls (`rdma_event_channel.fd`), readable while events wait.
    fn create_cm_channel(&mut self) -> Result<Answer, Answer> {
        let admitted = self.admitted.as_mut().ok_or_else(|| error(EPROTO, "no context"))?;
        admitted.charge_descriptor().map_err(|e| error(e.errno(), e.to_string()))?;
        let made = (|| {
            // With hang-up: the tenant's end turns readable if the daemon
            // goes away, and its library reports DEVICE_REMOVAL.
            let (fd, tenant_end) = Doorbell::pair_with_hangup()?;
            fd.reserve(crate::cm::MAX_UNREAD);
            let tenant = self.tenant;
            // A host tenant's library reads an event in its wake-up; a
            // guest's channel is signalled through its port.
            let carry = self.guest.is_none();
            let channel = self.engine(move |e, c| {
                let id = e.rings.free_channel_id(&e.hca, |n| e.cm.has_channel(n));
                e.cm.add_channel_as(id, c, tenant, fd, carry)
            })?;
            let channel = channel.map_err(|e| error(e.errno(), e.to_string()))?;
            Ok::<_, Answer>(Answer {
                reply: Reply::Cm(CmReply::Channel { channel }),
                fds: vec![tenant_end.into()],
            })
        })();
        if made.is_err() {
            if let Some(a) = self.admitted.as_mut() {
                a.refund_descriptor();
            }
        }
        made
    }

    fn create_cq(&mut self, cqe: u32, channel: Option<u32>) -> Result<Answer, Answer> {
        let (cq, depth, direct) = self.engine(move |e, c| {
            if let Some(ch) = channel {
                if e.rings.channels.get(&ch).is_none_or(|x| x.ctx != c) {
                    return Err(HcaError::NoSuchObject { kind: "completion channel", id: ch });
                }
            }
            e.hca.create_cq(c, cqe).map(|(cq, depth)| (cq, depth, e.direct.enabled))
        })??;
        let made = (|| {
            let (fd, seg) = self.new_ring("vrdma-cq", ring_bytes(depth, CQE_SIZE), self.budget())?;
            let ring = RingView::in_segment(seg.clone(), 0, depth, CQE_SIZE)
                .map_err(|e| error(ENOMEM, e.to_string()))?;
            Ok::<_, Answer>((seg, ring, fd))
        })();
        // Anything that fails after the core made the object destroys it:
        // the tenant, answered with an error, never learns its number.
        let (seg, ring, fd) = match made {
            Ok(x) => x,
            Err(a) => {
                let _ = self.engine(move |e, c| e.hca.destroy_cq(c, cq));
                return Err(a);
            }
        };
        // Where the tenant finds the ring: in its own segment, or in its
        // pool's chunk (offset from the chunk's start).
        let (base, seg_len) = seg.in_segment();
        let spec = RingSpec { offset: base, capacity: depth, stride: CQE_SIZE as u32 };
        // With the direct path on, a CQ keeps its segment's descriptor
        // (charged; at the limit, not kept: its QPs' receives stay on the
        // engine) for requesters that complete into it: they mark its
        // ready set and raise its channel's events.
        let kept = match direct {
            true => self
                .admitted
                .as_ref()
                .and_then(|a| a.charge_kept())
                .and_then(|charge| Some((seg.segment_fd(own_fd(&fd))?.ok()?, charge))),
            false => None,
        };
        // Not waited for (see `post_to_engine`): the engine writes to the
        // ring only for a QP that names the CQ, and that QP is created
        // by a later call.
        self.post_to_engine(move |e, c| {
            if let Some((f, charge)) = kept {
                e.direct.keep_cq(c, cq, f, seg_len, spec, charge);
            }
            if let Some(ch) = channel.and_then(|ch| e.rings.channels.get_mut(&ch)) {
                ch.cqs += 1;
            }
            e.rings.cqs.insert(cq, CqRing { ring, channel, inbox_qps: Vec::new() });
        })?;
        if let Carry::Extent { offset, len } = &fd {
            let (offset, len) = (*offset, *len);
            self.place(Kind::Cq, cq, Place::Ring(offset, len));
        }
        Ok(Answer { reply: Reply::Cq { cq, depth, segment_len: seg_len, ring: spec }, fds: vec![fd] })
    }

    fn create_srq(&mut self, pd: u32, attr: vrdma_core::verbs::SrqAttr) -> Result<Answer, Answer> {
        let (srq, granted, direct) =
            self.engine(move |e, c| e.hca.create_srq(c, pd, attr).map(|(s, g)| (s, g, e.direct.enabled)))??;
        let stride = recv_stride(granted.max_sge);
        let made = (|| {
            let (fd, seg) = self.new_ring("vrdma-srq", ring_bytes(granted.max_wr, stride), self.budget())?;
            let ring = RingView::in_segment(seg.clone(), 0, granted.max_wr, stride)
                .map_err(|e| error(ENOMEM, e.to_string()))?;
            Ok::<_, Answer>((seg, ring, fd))
        })();
        let (seg, ring, fd) = match made {
            Ok(x) => x,
            Err(a) => {
                let _ = self.engine(move |e, c| e.hca.destroy_srq(c, srq));
                return Err(a);
            }
        };
        let tenant = self.tenant;
        // With the direct path on, requesters claim the SRQ's receives too
        // (a compare-and-swap on its consumer, as the engine's pulls then
        // do) and the daemon keeps its segment to grant it, charged to the
        // tenant's descriptors (at the limit: not kept, the engine's alone).
        let charge = if direct { self.admitted.as_ref().and_then(|a| a.charge_kept()) } else { None };
        let kept = charge.and_then(|charge| Some((seg.segment_fd(own_fd(&fd))?.ok()?, charge)));
        let ((base, segment_len), limit) = (seg.in_segment(), granted.srq_limit);
        let spec = RingSpec { offset: base, capacity: granted.max_wr, stride: stride as u32 };
        self.engine(move |e, c| {
            // The armed limit, for the direct path's claimers
            // (`SRQ_AUX_LIMIT`).
            ring.aux(vrdma_core::proto::SRQ_AUX_LIMIT).store(limit, std::sync::atomic::Ordering::SeqCst);
            let shared = kept.is_some();
            let r = InRing::new(ring, tenant);
            e.rings.srqs.insert(srq, if shared { r.shared_srq() } else { r });
            if let Some((f, charge)) = kept {
                e.direct.keep_srq(c, srq, f, segment_len, spec, charge);
            }
        })?;
        if let Carry::Extent { offset, len } = &fd {
            let (offset, len) = (*offset, *len);
            self.place(Kind::Srq, srq, Place::Ring(offset, len));
        }
        Ok(Answer { reply: Reply::Srq { srq, attr: granted, segment_len, ring: spec }, fds: vec![fd] })
    }

    /// `rdma_create_qp` in one call: [`Self::create_qp`], then the QP
    /// attached to the id (`CmRequest::AttachQp`); a QP whose attach
    /// fails is destroyed, and the call fails with the attach's error.
    fn create_cm_qp(
        &mut self,
        id: u32,
        pd: u32,
        init: vrdma_core::verbs::QpInitAttr,
    ) -> Result<Answer, Answer> {
        let answer = self.create_qp(pd, init)?;
        let Reply::Qp { created, .. } = &answer.reply else {
            return Err(error(EPROTO, "the QP's creation answered with something else"));
        };
        let (qp, tenant) = (created.qpn, self.tenant);
        let attached = self.engine(move |e, c| e.handle_cm(c, tenant, CmRequest::AttachQp { id, qp }))?;
        if let Err(why) = attached {
            let wait = self.engine(move |e, c| {
                if e.hca.destroy_qp(c, qp, &mut e.rings).is_ok() {
                    e.rings.remove_qp(qp);
                }
                e.direct.sync(&mut e.hca)
            })?;
            crate::direct::drain(&wait);
            return Err(error(why.errno(), why.to_string()));
        }
        Ok(answer)
    }

    /// `rdma_create_qp` with no CQs given, in one call
    /// (`CmRequest::CreateQpWithCq`): [`Self::create_cq`] without a
    /// channel, then [`Self::create_cm_qp`] with that CQ for both queues;
    /// the CQ is destroyed if the QP's part fails.
    fn create_cm_qp_with_cq(
        &mut self,
        id: u32,
        pd: u32,
        cqe: u32,
        mut init: vrdma_core::verbs::QpInitAttr,
    ) -> Result<Answer, Answer> {
        let made = self.create_cq(cqe, None)?;
        let Reply::Cq { cq, depth, segment_len: cq_segment_len, ring: cq_ring } = made.reply else {
            return Err(error(EPROTO, "the CQ's creation answered with something else"));
        };
        init.send_cq = cq;
        init.recv_cq = cq;
        let qp = match self.create_cm_qp(id, pd, init) {
            Ok(a) => a,
            Err(a) => {
                // The tenant, answered with the error, never learns the
                // CQ's number.
                let _ = self.destroy_cq(cq);
                return Err(a);
            }
        };
        let Reply::Qp { created, segment_len, sq, rq, inbox } = qp.reply else {
            let _ = self.destroy_cq(cq);
            return Err(error(EPROTO, "the QP's creation answered with something else"));
        };
        let mut fds = made.fds;
        fds.extend(qp.fds);
        Ok(Answer {
            reply: Reply::CqQp { cq, depth, cq_segment_len, cq_ring, created, segment_len, sq, rq, inbox },
            fds,
        })
    }

    /// `ibv_destroy_cq` of one of this context's CQs (and, once it is
    /// gone, of where it lay in a guest's region).
    fn destroy_cq(&self, cq: u32) -> Result<Result<(), HcaError>, Answer> {
        let done = self.engine(move |e, c| {
            e.hca.destroy_cq(c, cq)?;
            e.direct.forget_cq(cq);
            if let Some(ch) = e.rings.cqs.remove(&cq).and_then(|r| r.channel) {
                if let Some(ch) = e.rings.channels.get_mut(&ch) {
                    ch.cqs = ch.cqs.saturating_sub(1);
                }
            }
            Ok::<_, HcaError>(())
        })?;
        if done.is_ok() {
            self.unplace(Kind::Cq, cq);
        }
        Ok(done)
    }

    fn create_qp(&mut self, pd: u32, init: vrdma_core::verbs::QpInitAttr) -> Result<Answer, Answer> {
        let (created, direct) =
            self.engine(move |e, c| e.hca.create_qp(c, pd, init).map(|q| (q, e.direct.enabled)))??;
        let cap = created.cap;
        // With the direct path on, an RC QP gets an inbox: completions of
        // its receives that a direct-path requester claimed
        // (`docs/direct-path.md`), as many as it has receive WRs; a QP of
        // an SRQ gets one as deep as the SRQ. Not a guest's: no requester
        // is ever granted its rings (an extent of the VM's region, kept by
        // no descriptor), and the inbox would take 64 bytes per receive WR
        // of the region, whose size the guest cannot change (1 MiB for
        // ucmatose's 16000, a third of a 16 MiB VM's region for three).
        let direct = direct && self.guest.is_none();
        let srq_depth = match init.srq {
            Some(srq) if direct && init.qp_type == vrdma_core::verbs::QpType::Rc => {
                self.engine(move |e, c| e.hca.query_srq(c, srq).map(|a| a.max_wr).ok())?
            }
            _ => None,
        };
        let inbox_depth = (init.srq.is_none())
            .then_some(cap.max_recv_wr)
            .or(srq_depth)
            .filter(|_| direct && init.qp_type == vrdma_core::verbs::QpType::Rc);
        let (sq, rq, inbox, total) = qp_layout(cap, init.srq.is_none(), inbox_depth);
        let qpn = created.qpn;
        let made = (|| {
            let (fd, seg) = self.new_ring("vrdma-qp", total, self.budget())?;
            let view = |r: RingSpec| {
                RingView::in_segment(seg.clone(), r.offset as usize, r.capacity, r.stride as usize)
                    .map_err(|e| error(ENOMEM, e.to_string()))
            };
            let shared = inbox.is_some();
            let rings = QpRings::new(
                self.ctx,
                InRing::new(view(sq)?, self.tenant),
                rq.map(view).transpose()?.map(|r| {
                    let r = InRing::new(r, self.tenant);
                    if shared {
                        r.shared()
                    } else {
                        r
                    }
                }),
            );
            let (rings, kept) = match inbox {
                Some(spec) => {
                    // The direct path keeps a descriptor of the segment to
                    // grant it (a host's: a guest's QP has no inbox).
                    // Charged to the tenant's descriptors; at its limit
                    // the segment is not kept (no receive grants for it).
                    let kept = match seg.segment_fd(own_fd(&fd)) {
                        Some(f) => match self.admitted.as_ref().and_then(|a| a.charge_kept()) {
                            Some(charge) => Some((f.map_err(|e| error(ENOMEM, e.to_string()))?, charge)),
                            None => None,
                        },
                        None => None,
                    };
                    (rings.with_inbox(init.recv_cq, view(spec)?), kept)
                }
                None => (rings, None),
            };
            Ok::<_, Answer>((seg.clone(), rings, fd, kept))
        })();
        let (seg, rings, fd, kept) = match made {
            Ok(x) => x,
            Err(a) => {
                let _ = self.engine(move |e, c| e.hca.destroy_qp(c, qpn, &mut e.rings));
                return Err(a);
            }
        };
        // The tenant's (and the direct path's) offsets count from the
        // start of the segment it maps: its pool chunk's, for a pooled QP.
        let (base, segment_len) = seg.in_segment();
        let shift = |r: RingSpec| RingSpec { offset: r.offset + base, ..r };
        let (sq, rq, inbox) = (shift(sq), rq.map(shift), inbox.map(shift));
        // Not waited for (see `post_to_engine`): a new QP is in RESET,
        // where nothing may be posted to it; it leaves RESET only through
        // a later call (ModifyQp, or the connection manager's).
        self.post_to_engine(move |e, c| {
            e.rings.add_qp(qpn, rings);
            if let (Some((fd, charge)), Some(inbox)) = (kept, inbox) {
                e.direct.keep_qp(c, qpn, fd, segment_len, rq, inbox, charge);
            }
        })?;
        if let Carry::Extent { offset, len } = &fd {
            let (offset, len) = (*offset, *len);
            self.place(Kind::Qp, qpn, Place::Qp(offset, len, inbox.is_some()));
        }
        Ok(Answer { reply: Reply::Qp { created, segment_len, sq, rq, inbox }, fds: vec![fd] })
    }
}

impl Session {
    /// A guest session of `vm`: its tenant is the VM's configured one.
    pub(super) fn guest(id: u32, vm: Arc<crate::vm::Vm>, shared: Arc<Shared>) -> Session {
        Session {
            ctx: ContextId(id),
            tenant: TenantId(vm.config.tenant),
            pid: 0,
            uid: 0,
            guest: Some(GuestMemory::new(vm)),
            shared,
            open: false,
            _seat: super::Seat::none(),
            admitted: None,
            pool: None,
        }
    }

    pub(super) fn id(&self) -> u32 {
        self.ctx.0
    }

    /// Records where a guest session's new object lies in its VM's region.
    fn place(&self, kind: Kind, id: u32, place: Place) {
        if let Some(g) = &self.guest {
            g.vm.placed().record(self.ctx.0, kind, id, place);
        }
    }

    fn unplace(&self, kind: Kind, id: u32) {
        if let Some(g) = &self.guest {
            g.vm.placed().forget(self.ctx.0, kind, id);
        }
    }

    /// Memory for a ring: a new memfd for a host tenant, an extent of the
    /// VM's region for a guest.
    fn new_segment(
        &self,
        name: &str,
        len: usize,
        budget: Option<&Arc<vrdma_shm::MappingBudget>>,
    ) -> Result<(Carry, Arc<RingMemory>), Answer> {
        match &self.guest {
            Some(g) => {
                let (offset, mem) = RingMemory::in_vm(&g.vm, len, budget)?;
                Ok((Carry::Extent { offset, len: mem.len() as u64 }, Arc::new(mem)))
            }
            None => {
                let (fd, map) = Segment::create_in(name, len, budget)?.into_parts();
                Ok((Carry::Fd(fd), Arc::new(RingMemory::host(map))))
            }
        }
    }

    /// Memory for a CQ's, QP's or SRQ's rings: for a host tenant a block
    /// of its context's ring pool (`ring_pool`), or a memfd of its own
    /// where the pool has none (a ring larger than a chunk, a chunk the
    /// tenant's budgets refuse); as [`Self::new_segment`] for a guest.
    /// (Completion channels and the context's segment keep memfds of
    /// their own: one each per context, or a few.)
    fn new_ring(
        &self,
        name: &str,
        len: usize,
        budget: Option<&Arc<vrdma_shm::MappingBudget>>,
    ) -> Result<(Carry, Arc<RingMemory>), Answer> {
        if let (None, Some(pool)) = (&self.guest, &self.pool) {
            let charge = || self.admitted.as_ref().and_then(|a| a.charge_kept());
            if let Some(block) = pool.alloc(len, budget, charge)? {
                let (chunk, len) = (block.chunk().id(), block.chunk().len() as u64);
                return Ok((Carry::Pool { chunk, len }, Arc::new(RingMemory::pooled(block))));
            }
        }
        self.new_segment(name, len, budget)
    }

    /// RegMr from a guest: `fd_offset` names bytes of the VM's region,
    /// which must lie in one memory extent of this session.
    fn reg_guest_mr(
        &mut self,
        pd: u32,
        addr: u64,
        len: u64,
        access: vrdma_core::verbs::AccessFlags,
        fd_offset: u64,
    ) -> Result<Answer, Answer> {
        let g = self.guest.as_ref().ok_or_else(|| error(EPROTO, "not a guest session"))?;
        let extent = g.extent_of(fd_offset, len).ok_or_else(|| {
            error(
                EINVAL,
                format!("[{fd_offset}, +{len}) does not lie in a memory extent of this session (GuestAlloc)"),
            )
        })?;
        let fd = g.vm.region.try_clone().map_err(|e| error(ENOMEM, e.to_string()))?;
        self.engine(move |e, c| e.hca.may_register(c, len))??;
        let region = map_region(fd, fd_offset, len, self.budget())?;
        let key = self.engine(move |e, c| e.hca.reg_mr(c, pd, addr, access, region))??;
        if let Some(g) = self.guest.as_mut() {
            g.registered(key, extent);
        }
        self.place(Kind::Mr, key, Place::Mr(fd_offset));
        Ok(Reply::Mr { key }.into())
    }
}

/// Whether `req` changes what a tenant's snapshot holds (its PDs, MRs,
/// CQs, SRQs, QPs and AHs, a guest's completion channels and extents in
/// its VM's region): such a call waits while the tenant is paused for a
/// migration. Queries, rdma_cm channels (which do not move) and the
/// direct path's grants do not.
pub(super) fn changes_state(req: &Request) -> bool {
    matches!(
        req,
        Request::AllocPd
            | Request::DeallocPd { .. }
            | Request::RegMr { .. }
            | Request::RegMrPieces { .. }
            | Request::DeregMr { .. }
            | Request::CreateCq { .. }
            | Request::DestroyCq { .. }
            | Request::CreateSrq { .. }
            | Request::ModifySrq { .. }
            | Request::DestroySrq { .. }
            | Request::CreateQp { .. }
            | Request::ModifyQp { .. }
            | Request::DestroyQp { .. }
            | Request::CreateAh { .. }
            | Request::DestroyAh { .. }
            | Request::GuestAlloc { .. }
            | Request::GuestFree { .. }
            | Request::GuestGrow { .. }
            | Request::CreateCompChannel
            | Request::DestroyCompChannel { .. }
    ) || matches!(
        req,
        // rdma_cm's ids and channels move with a VM's tenant (snapshot
        // version 5): every call but its queries changes what moves (a
        // `GetEvent` takes an event out of its channel).
        Request::Cm(r) if !matches!(
            r,
            CmRequest::QueryAddr { .. } | CmRequest::InitQpAttr { .. } | CmRequest::HasListener { .. }
        )
    )
}

/// Where a QP's rings lie in its segment: the send ring first, then the
/// receive ring (none for a QP of an SRQ) and the inbox (`inbox_depth`
/// entries, with the direct path), each at the next multiple of 64 bytes;
/// and the segment's length. A moved QP's rings are found again with it.
pub(super) fn qp_layout(
    cap: vrdma_core::verbs::QpCap,
    has_rq: bool,
    inbox_depth: Option<u32>,
) -> (RingSpec, Option<RingSpec>, Option<RingSpec>, usize) {
    let sq = RingSpec {
        offset: 0,
        capacity: cap.max_send_wr,
        stride: send_stride(cap.max_send_sge, cap.max_inline_data) as u32,
    };
    let sq_bytes = ring_bytes(sq.capacity, sq.stride as usize);
    let rq = has_rq.then(|| RingSpec {
        offset: sq_bytes.div_ceil(64) as u64 * 64,
        capacity: cap.max_recv_wr,
        stride: recv_stride(cap.max_recv_sge) as u32,
    });
    let rq_end = rq.map_or(sq_bytes, |r| r.offset as usize + ring_bytes(r.capacity, r.stride as usize));
    let inbox = inbox_depth.map(|capacity| RingSpec {
        offset: rq_end.div_ceil(64) as u64 * 64,
        capacity,
        stride: CQE_SIZE as u32,
    });
    let total = inbox.map_or(rq_end, |r| r.offset as usize + ring_bytes(r.capacity, r.stride as usize));
    (sq, rq, inbox, total)
}

/// Maps the pages of a tenant's memfd that hold `[fd_offset, fd_offset+len)`,
/// charged to the tenant's `budget`.
pub(super) fn map_region(
    fd: OwnedFd,
    fd_offset: u64,
    len: u64,
    budget: Option<&Arc<vrdma_shm::MappingBudget>>,
) -> Result<Region, Answer> {
    if len == 0 {
        return Err(error(EINVAL, "a memory region needs at least one byte"));
    }
    // Map the whole pages of the file that hold the region (hugetlbfs
    // files are refused by map_untrusted, so pages are the base size).
    let page = page_size() as u64;
    let too_large = || error(EINVAL, format!("region of {len} bytes is too large"));
    let start = fd_offset - fd_offset % page;
    let inner = (fd_offset - start) as usize;
    let span = usize::try_from(len)
        .ok()
        .and_then(|l| inner.checked_add(l))
        .and_then(|n| n.checked_next_multiple_of(page as usize))
        .ok_or_else(too_large)?;
    let seg = Mapping::map_untrusted_in(fd, start, span, budget).map_err(|e| match e {
        vrdma_shm::SegmentError::Io(e) if e.kind() == std::io::ErrorKind::OutOfMemory => {
            error(ENOMEM, e.to_string())
        }
        e => error(EINVAL, e.to_string()),
    })?;
    let backing: Arc<dyn Backing> = Arc::new(seg);
    Region::new(backing, inner, len as usize).map_err(|e| error(EINVAL, e.to_string()))
}

/// Hello's (and AdoptContext's) check of the library's protocol version.
fn check_version(version: u32) -> Result<(), Answer> {
    if version != PROTOCOL_VERSION {
        return Err(error(
            EPROTO,
            format!("protocol version {version} is not supported; the daemon speaks {PROTOCOL_VERSION}"),
        ));
    }
    Ok(())
}
