//! The client against a minimal in-process stand-in for `vrdmad`.
//!
//! The fake daemon speaks the real control protocol over a socketpair and
//! hands out real segments, rings and doorbells; the tests then play the
//! engine by hand (popping work requests, pushing completions and events),
//! which checks the client's side of every shared-memory convention.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vrdma::wr::{self, SendWrExt};
use vrdma::{
    AccessFlags, AsyncEvent, AsyncEventType, Context, Cqe, Error, QpAttrMask, QpCap, QpInit, QpState,
    SendOpcode, SendWr, SrqAttr, WcOpcode, WcStatus,
};
use vrdma_core::hca::{HcaConfig, Path, QpCreated, QpPathReport, StatCursor, StatPage, StatReport};
use vrdma_core::proto::{self, Reply, Request, RingSpec};
use vrdma_core::ring::{recv_stride, send_stride, RecvWr, CQE_SIZE};
use vrdma_core::verbs::{QpAttr, QpType};
use vrdma_shm::{page_size, ring_bytes, Doorbell, RingView, Segment};

struct FakeQp {
    sq: RingView,
    rq: Option<RingView>,
    attr: QpAttr,
}

#[derive(Default)]
struct State {
    next: u32,
    requests: Vec<Request>,
    /// The async-event ring (daemon side) and its doorbell.
    ctx_ring: Option<Arc<RingView>>,
    /// Where the client names QPs it posted to (daemon side).
    posted_ring: Option<Arc<RingView>>,
    async_bell: Option<Arc<Doorbell>>,
    engine_bell: Option<Arc<Doorbell>>,
    cqs: HashMap<u32, Arc<RingView>>,
    cq_channel: HashMap<u32, u32>,
    channels: HashMap<u32, (Arc<RingView>, Arc<Doorbell>)>,
    qps: HashMap<u32, FakeQp>,
    srqs: HashMap<u32, Arc<RingView>>,
    /// key -> (daemon's mapping of the region's pages, offset of its first byte)
    mrs: HashMap<u32, (vrdma_shm::Mapping, usize)>,
    /// What `StatPage` requests are answered, in turn.
    stat_pages: std::collections::VecDeque<StatPage>,
}

#[derive(Clone)]
struct Fake(Arc<Mutex<State>>);

fn segment_with(rings: &[(u32, usize)]) -> (Arc<Segment>, Vec<(RingSpec, RingView)>) {
    let mut offset = 0usize;
    let mut specs = Vec::new();
    for &(cap, stride) in rings {
        specs.push(RingSpec { offset: offset as u64, capacity: cap, stride: stride as u32 });
        offset += ring_bytes(cap, stride).next_multiple_of(64);
    }
    let seg = Arc::new(Segment::create("fake-vrdmad", offset).unwrap());
    let views = specs
        .into_iter()
        .map(|s| {
            let v =
                RingView::in_segment(seg.clone(), s.offset as usize, s.capacity, s.stride as usize).unwrap();
            (s, v)
        })
        .collect();
    (seg, views)
}

impl Fake {
    fn start() -> (Fake, Context) {
        let (client, server) = vrdma_shm::seqpacket_pair().unwrap();
        let fake = Fake(Arc::new(Mutex::new(State { next: 0x100, ..State::default() })));
        let f = fake.clone();
        std::thread::spawn(move || f.serve(server));
        let ctx = Context::from_socket(client).unwrap();
        (fake, ctx)
    }

    fn st(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap()
    }

    fn serve(self, sock: OwnedFd) {
        let mut buf = vec![0u8; proto::MAX_MESSAGE];
        loop {
            let r = vrdma_shm::recv_msg(sock.as_fd(), &mut buf, 4).unwrap();
            if r.len == 0 {
                return;
            }
            let req = proto::decode_request(&buf[..r.len]).unwrap();
            let (reply, fds) = self.handle(&req, r.fds);
            self.st().requests.push(req);
            let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
            vrdma_shm::send_msg(sock.as_fd(), &proto::encode_reply(&reply), &borrowed).unwrap();
        }
    }

    fn handle(&self, req: &Request, mut fds: Vec<OwnedFd>) -> (Reply, Vec<OwnedFd>) {
        let cfg = HcaConfig::for_host([10, 0, 0, 1]);
        let mut st = self.st();
        st.next += 1;
        let id = st.next;
        let done = (Reply::Done, Vec::new());
        match req {
            Request::Hello { version } => {
                assert_eq!(*version, proto::PROTOCOL_VERSION);
                let (seg, mut views) = segment_with(&[
                    (proto::ASYNC_RING_CAPACITY, proto::ASYNC_EVENT_SIZE),
                    (proto::POSTED_RING_CAPACITY, proto::POSTED_SLOT_SIZE),
                ]);
                let (posted_spec, posted) = views.pop().unwrap();
                let (spec, view) = views.pop().unwrap();
                st.posted_ring = Some(Arc::new(posted));
                let (engine, engine_tenant) = Doorbell::pair().unwrap();
                let (events, events_tenant) = Doorbell::pair().unwrap();
                let out = vec![seg.try_clone_fd().unwrap(), engine_tenant.into(), events_tenant.into()];
                st.ctx_ring = Some(Arc::new(view));
                st.engine_bell = Some(Arc::new(engine));
                st.async_bell = Some(Arc::new(events));
                let reply = Reply::Hello {
                    context: 7,
                    tenant: 1000,
                    device_name: "vrdma0".into(),
                    segment_len: seg.len() as u64,
                    async_ring: spec,
                    posted_ring: posted_spec,
                    channels: Vec::new(),
                };
                (reply, out)
            }
            Request::QueryDevice => (Reply::Device(cfg.device.clone()), vec![]),
            Request::QueryPort { .. } => (Reply::Port(cfg.port.clone()), vec![]),
            Request::QueryGid { .. } => (Reply::Gid(cfg.gids[0]), vec![]),
            Request::AllocPd => (Reply::Pd { pd: id }, vec![]),
            Request::RegMr { len, fd_offset, .. } => {
                assert_eq!(fds.len(), 1);
                let page = page_size() as u64;
                let base = fd_offset & !(page - 1);
                let inner = (fd_offset - base) as usize;
                let seg = vrdma_shm::Mapping::map_untrusted(fds.pop().unwrap(), base, inner + *len as usize)
                    .unwrap();
                st.mrs.insert(id, (seg, inner));
                (Reply::Mr { key: id }, vec![])
            }
            Request::CreateCompChannel => {
                let (seg, mut views) =
                    segment_with(&[(proto::CHANNEL_RING_CAPACITY, proto::CHANNEL_EVENT_SIZE)]);
                let (spec, view) = views.pop().unwrap();
                let (bell, tenant_end) = Doorbell::pair().unwrap();
                let out = vec![seg.try_clone_fd().unwrap(), tenant_end.into()];
                st.channels.insert(id, (Arc::new(view), Arc::new(bell)));
                let reply = Reply::CompChannel { channel: id, segment_len: seg.len() as u64, ring: spec };
                (reply, out)
            }
            Request::CreateCq { cqe, channel } => {
                let depth = cqe.next_power_of_two();
                let (seg, mut views) = segment_with(&[(depth, CQE_SIZE)]);
                let (spec, view) = views.pop().unwrap();
                st.cqs.insert(id, Arc::new(view));
                if let Some(ch) = channel {
                    st.cq_channel.insert(id, *ch);
                }
                let reply = Reply::Cq { cq: id, depth, segment_len: seg.len() as u64, ring: spec };
                (reply, vec![seg.try_clone_fd().unwrap()])
            }
            Request::CreateSrq { attr, .. } => {
                let granted = SrqAttr {
                    max_wr: attr.max_wr.next_power_of_two(),
                    max_sge: attr.max_sge.max(1),
                    srq_limit: attr.srq_limit,
                };
                let (seg, mut views) = segment_with(&[(granted.max_wr, recv_stride(granted.max_sge))]);
                let (spec, view) = views.pop().unwrap();
                st.srqs.insert(id, Arc::new(view));
                let reply = Reply::Srq { srq: id, attr: granted, segment_len: seg.len() as u64, ring: spec };
                (reply, vec![seg.try_clone_fd().unwrap()])
            }
            Request::CreateQp { init, .. } => {
                let c = init.cap;
                let cap = QpCap {
                    max_send_wr: c.max_send_wr.next_power_of_two(),
                    max_recv_wr: if init.srq.is_some() { 0 } else { c.max_recv_wr.next_power_of_two() },
                    max_send_sge: c.max_send_sge.max(1),
                    max_recv_sge: if init.srq.is_some() { 0 } else { c.max_recv_sge.max(1) },
                    max_inline_data: c.max_inline_data,
                };
                let mut shapes = vec![(cap.max_send_wr, send_stride(cap.max_send_sge, cap.max_inline_data))];
                if init.srq.is_none() {
                    shapes.push((cap.max_recv_wr, recv_stride(cap.max_recv_sge)));
                }
                let (seg, mut views) = segment_with(&shapes);
                let rq = (views.len() == 2).then(|| views.pop().unwrap());
                let (sq_spec, sq) = views.pop().unwrap();
                let reply = Reply::Qp {
                    created: QpCreated { qpn: id, cap },
                    segment_len: seg.len() as u64,
                    sq: sq_spec,
                    rq: rq.as_ref().map(|r| r.0),
                    inbox: None,
                };
                st.qps.insert(
                    id,
                    FakeQp { sq, rq: rq.map(|r| r.1), attr: QpAttr { cap, ..QpAttr::default() } },
                );
                (reply, vec![seg.try_clone_fd().unwrap()])
            }
            Request::ModifyQp { qp, attr, mask } => {
                let q = st.qps.get_mut(qp).unwrap();
                if mask.contains(QpAttrMask::STATE) {
                    q.attr.qp_state = attr.qp_state;
                    q.sq.aux(proto::SQ_AUX_STATE).store(attr.qp_state.raw() as u32, Ordering::SeqCst);
                    if attr.qp_state == QpState::Reset {
                        // Everything posted is dropped, and counted retired
                        // (this fake holds nothing it pulled).
                        let dropped = q.sq.discard_all().unwrap();
                        q.sq.aux(proto::SQ_AUX_RETIRED).fetch_add(dropped, Ordering::Release);
                    }
                }
                done
            }
            Request::QueryQp { qp } => {
                let q = &st.qps[qp];
                let init = vrdma_core::verbs::QpInitAttr {
                    qp_type: vrdma::QpType::Rc,
                    send_cq: 0,
                    recv_cq: 0,
                    srq: None,
                    cap: q.attr.cap,
                    sq_sig_all: false,
                };
                (Reply::QpAttr { attr: q.attr, init }, vec![])
            }
            Request::QuerySrq { .. } => {
                (Reply::SrqAttr(SrqAttr { max_wr: 8, max_sge: 1, srq_limit: 3 }), vec![])
            }
            Request::ModifySrq { limit, .. } => {
                if *limit == Some(999) {
                    (Reply::Error { errno: libc::EINVAL, message: "limit above depth".into() }, vec![])
                } else {
                    done
                }
            }
            Request::DeregMr { key } => {
                st.mrs.remove(key);
                done
            }
            Request::CreateAh { .. } => (Reply::Ah { ah: id }, vec![]),
            Request::Stat => (Reply::Stat(Default::default()), vec![]),
            // The connection manager is tested against the real daemon.
            Request::Cm(_) => (Reply::Error { errno: 95, message: "not in the fake daemon".into() }, vec![]),
            // A plain listener's registration is taken (as by a daemon
            // older than `SockScoped`, which refuses that); the rest of
            // the registry is the real daemon's.
            Request::Sock(proto::SockRequest::Listen { .. }) => (Reply::Sock(proto::SockReply::Done), vec![]),
            // VMs, migration, the socket registry and regions of pieces are
            // tested against the real daemon (vrdma-it's vm.rs, migrate.rs,
            // sockets.rs and memory.rs).
            Request::VmAttach { .. }
            | Request::RegMrPieces { .. }
            | Request::GuestAlloc { .. }
            | Request::GuestFree { .. }
            | Request::GuestGrow { .. }
            | Request::Migrate(_)
            | Request::AdoptContext { .. }
            | Request::Sock(_)
            | Request::SockScoped { .. } => {
                (Reply::Error { errno: 95, message: "not in the fake daemon".into() }, vec![])
            }
            // The fake daemon has no direct path (as a daemon with it off).
            Request::DirectGrant { .. } | Request::DirectRecvGrant { .. } | Request::DirectChannel { .. } => {
                (Reply::DirectRefused(vrdma_core::hca::DirectRefusal::Off), vec![])
            }
            // Never asked without a receive grant; a daemon with the path off
            // does nothing.
            Request::DirectSrqLimit { .. } => (Reply::Done, vec![]),
            Request::StatPage { .. } => {
                (Reply::StatPage(st.stat_pages.pop_front().unwrap_or_default()), vec![])
            }
            Request::DeallocPd { .. }
            | Request::DestroyAh { .. }
            | Request::DestroyCq { .. }
            | Request::DestroySrq { .. }
            | Request::DestroyQp { .. }
            | Request::DestroyCompChannel { .. } => done,
        }
    }

    fn requests(&self) -> Vec<Request> {
        self.st().requests.clone()
    }

    fn set_engine_sleeping(&self, sleeping: bool) {
        self.st()
            .ctx_ring
            .as_ref()
            .unwrap()
            .aux(proto::CTX_AUX_ENGINE_SLEEPING)
            .store(sleeping as u32, Ordering::SeqCst);
    }

    fn doorbells(&self) -> u64 {
        self.st().engine_bell.as_ref().unwrap().drain()
    }

    /// Takes a send WR and is done with it at once: it is retired, and
    /// completes into `cqn` if signaled.
    fn pop_send(&self, qpn: u32, cqn: u32) -> Option<SendWr> {
        let wr = self.pull_send(qpn)?;
        self.retire(qpn, cqn, &wr);
        Some(wr)
    }

    /// Retires a send WR as the engine does: the count first, then the
    /// completion (if signaled) noting it.
    fn retire(&self, qpn: u32, cqn: u32, wr: &SendWr) {
        let retired = {
            let st = self.st();
            st.qps[&qpn].sq.aux(proto::SQ_AUX_RETIRED).fetch_add(1, Ordering::Release).wrapping_add(1)
        };
        if wr.flags.contains(vrdma::SendFlags::SIGNALED) {
            self.complete_send(
                cqn,
                &Cqe::new(wr.wr_id, WcStatus::Success, WcOpcode::RdmaWrite, qpn),
                retired,
            );
        }
    }

    /// A send completion claiming `retired` WRs retired (true or not).
    fn complete_send(&self, cqn: u32, cqe: &Cqe, retired: u32) {
        let st = self.st();
        let mut slot = [0u8; CQE_SIZE];
        cqe.encode(&mut slot);
        Cqe::set_sq_retired(&mut slot, retired);
        assert!(st.cqs[&cqn].try_push_bytes(&slot).unwrap());
    }

    /// Takes a send WR and keeps it: still outstanding.
    fn pull_send(&self, qpn: u32) -> Option<SendWr> {
        let st = self.st();
        let sq = &st.qps[&qpn].sq;
        let mut slot = vec![0u8; sq.stride()];
        sq.try_pop(&mut slot).unwrap().then(|| SendWr::decode(&slot).unwrap())
    }

    fn pop_recv(&self, qpn: u32) -> Option<RecvWr> {
        let st = self.st();
        let rq = st.qps[&qpn].rq.as_ref().unwrap();
        let mut slot = vec![0u8; rq.stride()];
        rq.try_pop(&mut slot).unwrap().then(|| RecvWr::decode(&slot).unwrap())
    }

    fn pop_srq(&self, srqn: u32) -> Option<RecvWr> {
        let st = self.st();
        let r = &st.srqs[&srqn];
        let mut slot = vec![0u8; r.stride()];
        r.try_pop(&mut slot).unwrap().then(|| RecvWr::decode(&slot).unwrap())
    }

    /// Completes into a CQ as the engine would, raising the channel event
    /// if the CQ is armed.
    fn complete(&self, cqn: u32, cqe: &Cqe) {
        let st = self.st();
        let ring = &st.cqs[&cqn];
        let mut slot = [0u8; CQE_SIZE];
        cqe.encode(&mut slot);
        assert!(ring.try_push_bytes(&slot).unwrap());
        std::sync::atomic::fence(Ordering::SeqCst);
        let armed = ring.aux(proto::CQ_AUX_ARMED).swap(proto::CQ_ARM_NONE, Ordering::SeqCst);
        if proto::arm_fires(armed, cqe.solicited, cqe.status == WcStatus::Success) {
            let (ch_ring, bell) = &st.channels[&st.cq_channel[&cqn]];
            assert!(ch_ring.try_push(|s| s[..4].copy_from_slice(&cqn.to_le_bytes())).unwrap());
            bell.ring();
        } else {
            ring.aux(proto::CQ_AUX_ARMED).store(armed, Ordering::SeqCst);
        }
    }

    fn armed(&self, cqn: u32) -> u32 {
        self.st().cqs[&cqn].aux(proto::CQ_AUX_ARMED).load(Ordering::SeqCst)
    }

    fn async_event(&self, ev: AsyncEvent) {
        let st = self.st();
        let ring = st.ctx_ring.as_ref().unwrap();
        assert!(ring.try_push(|s| proto::encode_async_event(&ev, s)).unwrap());
        st.async_bell.as_ref().unwrap().ring();
    }

    fn daemon_read(&self, key: u32, offset: usize, len: usize) -> Vec<u8> {
        let st = self.st();
        let (seg, inner) = &st.mrs[&key];
        let mut out = vec![0u8; len];
        // SAFETY: the range lies inside the daemon-side mapping, which
        // covers the whole region from `inner`.
        unsafe { std::ptr::copy_nonoverlapping(seg.as_ptr().add(inner + offset), out.as_mut_ptr(), len) };
        out
    }

    fn daemon_write(&self, key: u32, offset: usize, data: &[u8]) {
        let st = self.st();
        let (seg, inner) = &st.mrs[&key];
        // SAFETY: as in `daemon_read`.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), seg.as_ptr().add(inner + offset), data.len()) };
    }
}

fn cap() -> QpCap {
    QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 2, max_recv_sge: 2, max_inline_data: 64 }
}

fn wc(wr_id: u64, qpn: u32) -> Cqe {
    Cqe::new(wr_id, WcStatus::Success, WcOpcode::RdmaWrite, qpn)
}

#[test]
fn hello_and_queries() {
    let (_fake, ctx) = Fake::start();
    assert_eq!(ctx.context_id(), 7);
    assert_eq!(ctx.tenant(), 1000);
    assert_eq!(ctx.device_name(), "vrdma0");
    assert_eq!(ctx.query_device().unwrap().phys_port_cnt, 1);
    assert_eq!(ctx.query_port(1).unwrap().state, 4);
    assert_eq!(ctx.query_gid(1, 0).unwrap().ipv4(), Some([10, 0, 0, 1]));
    let clone = ctx.clone();
    assert_eq!(clone.context_id(), 7);
}

/// A daemon that refuses `SockScoped` (one older than it): a `[::]`
/// listener is registered plainly (owning no link-local destination), a
/// link-local one stays unregistered, and a link-local lookup fails at
/// once, which the preload library takes as plain TCP (no announcement,
/// so no wait for a claim).
#[test]
fn a_daemon_refusing_sock_scoped_leaves_link_local_plain() {
    use vrdma_core::proto::SockRequest;
    let (fake, ctx) = Fake::start();
    let any: std::net::SocketAddr = "[::]:5000".parse().unwrap();
    ctx.sock_listen_link_local(any).unwrap();
    let ll: std::net::SocketAddr = "[fe80::1%3]:5000".parse().unwrap();
    assert!(ctx.sock_listen(ll).is_err(), "a link-local listener stays unregistered");
    assert!(ctx.sock_lookup(ll, true).is_err(), "a link-local lookup is refused");
    let sock: Vec<Request> = fake
        .requests()
        .into_iter()
        .filter(|r| matches!(r, Request::Sock(_) | Request::SockScoped { .. }))
        .collect();
    let listen = SockRequest::Listen { addr: any };
    // The request's encoding drops the scope: it travels in `scopes`.
    let ll: std::net::SocketAddr = "[fe80::1]:5000".parse().unwrap();
    assert_eq!(
        sock,
        [
            Request::SockScoped { scopes: [0, 0], req: listen.clone() },
            Request::Sock(listen),
            Request::SockScoped { scopes: [0, 3], req: SockRequest::Listen { addr: ll } },
            Request::SockScoped { scopes: [0, 3], req: SockRequest::Lookup { dst: ll, local: true } },
        ]
    );
}

#[test]
fn memory_regions_are_shared_with_the_daemon() {
    let (fake, ctx) = Fake::start();
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd.alloc_mr(10_000, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
    assert_eq!(mr.len(), 10_000);
    assert_eq!(mr.lkey(), mr.rkey());
    assert_eq!(mr.addr() % page_size() as u64, 0);
    mr.write(9_990, b"0123456789").unwrap();
    assert_eq!(fake.daemon_read(mr.lkey(), 9_990, 10), b"0123456789");
    fake.daemon_write(mr.lkey(), 0, b"from the device");
    let mut got = [0u8; 15];
    mr.read(0, &mut got).unwrap();
    assert_eq!(&got, b"from the device");
    assert_eq!(&mr.to_vec()[..15], b"from the device");
    assert!(mr.write(9_995, b"0123456789").is_err());
    assert!(mr.read(10_001, &mut []).is_err());
    mr.write_u64(8, 0x1122_3344_5566_7788).unwrap();
    assert_eq!(mr.read_u64(8).unwrap(), 0x1122_3344_5566_7788);
    assert_eq!(mr.read_u64(4).unwrap_err().errno(), libc::EINVAL);
    let sge = mr.sge(16, 32).unwrap();
    assert_eq!((sge.addr, sge.length, sge.lkey), (mr.addr() + 16, 32, mr.lkey()));
    assert!(mr.sge(10_000 - 31, 32).is_err());
    // Remote write without local write is refused before the daemon.
    assert_eq!(pd.alloc_mr(64, AccessFlags::REMOTE_WRITE).unwrap_err().errno(), libc::EINVAL);
    let key = mr.lkey();
    drop(mr);
    drop(pd);
    let reqs = fake.requests();
    let dereg = reqs.iter().position(|r| *r == Request::DeregMr { key }).unwrap();
    let dealloc = reqs.iter().position(|r| matches!(r, Request::DeallocPd { .. })).unwrap();
    assert!(dereg < dealloc, "the MR goes before its PD");
}

/// Whether `addr` lies in a re-backed (shared memfd) mapping of this
/// process, as `/proc/self/maps` says.
fn rebacked_at(addr: usize) -> bool {
    std::fs::read_to_string("/proc/self/maps").unwrap().lines().any(|l| {
        let (lo, hi) = l.split_whitespace().next().unwrap().split_once('-').unwrap();
        let (lo, hi) = (usize::from_str_radix(lo, 16).unwrap(), usize::from_str_radix(hi, 16).unwrap());
        l.contains("vrdma-rebacked") && lo <= addr && addr < hi
    })
}

#[test]
fn register_raw_rebacks_heap_memory() {
    let (fake, ctx) = Fake::start();
    let pd = ctx.alloc_pd().unwrap();
    let p = page_size();
    let layout = std::alloc::Layout::from_size_align(4 * p, p).unwrap();
    // SAFETY: non-zero size.
    let base = unsafe { std::alloc::alloc_zeroed(layout) };
    assert!(!base.is_null());
    // SAFETY: inside the allocation.
    let buf = unsafe { base.add(p + 123) };
    // SAFETY: inside the allocation, which nothing else uses.
    unsafe { std::ptr::copy_nonoverlapping(b"kept".as_ptr(), buf, 4) };
    // Refused access flags leave the memory as it was: not re-backed.
    let rebacked_here = || rebacked_at(buf as usize);
    for (bad, errno) in [
        (AccessFlags::REMOTE_WRITE, libc::EINVAL),
        (AccessFlags::LOCAL_WRITE | AccessFlags::ZERO_BASED, libc::EOPNOTSUPP),
        (AccessFlags::LOCAL_WRITE | AccessFlags::ON_DEMAND, libc::EOPNOTSUPP),
    ] {
        // SAFETY: as below.
        let e = unsafe { pd.register_raw(buf, 2 * p, bad) }.unwrap_err();
        assert_eq!(e.errno(), errno, "{bad:?}: {e}");
        assert!(!rebacked_here(), "{bad:?} was refused after the memory was re-backed");
    }
    // SAFETY: the allocation is ours, outlives the region, and no other
    // thread uses it.
    let mr = unsafe { pd.register_raw(buf, 2 * p, AccessFlags::LOCAL_WRITE) }.unwrap();
    assert_eq!(mr.addr(), buf as u64);
    assert!(rebacked_here());
    assert_eq!(fake.daemon_read(mr.lkey(), 0, 4), b"kept");
    // SAFETY: inside the allocation.
    unsafe { buf.add(100).write_volatile(0x42) };
    assert_eq!(fake.daemon_read(mr.lkey(), 100, 1), [0x42]);
    fake.daemon_write(mr.lkey(), 2 * p - 1, &[0x99]);
    // SAFETY: inside the allocation.
    assert_eq!(unsafe { buf.add(2 * p - 1).read_volatile() }, 0x99);

    // A second registration inside the same pages shares the span.
    // SAFETY: as above.
    let inner = unsafe { pd.register_raw(buf.add(8), 64, AccessFlags::LOCAL_WRITE) }.unwrap();
    assert_eq!(fake.daemon_read(inner.lkey(), 92, 1), [0x42]);
    // One that begins before the span is made of pieces (`RegMrPieces`,
    // tested on the real daemon: vrdma-it's `memory` and `vm` tests),
    // which this fake daemon does not map, and says so.
    // SAFETY: as above.
    let e = unsafe { pd.register_raw(base, 2 * p, AccessFlags::LOCAL_WRITE) }.unwrap_err();
    assert_eq!(e.errno(), libc::EOPNOTSUPP, "{e}");
    assert!(e.to_string().contains("not in the fake daemon"), "{e}");

    drop(inner);
    drop(mr);
    // SAFETY: allocated above with this layout; the regions are gone.
    unsafe { std::alloc::dealloc(base, layout) };
}

#[test]
fn a_forked_child_gets_a_private_copy_of_rebacked_memory() {
    let (fake, ctx) = Fake::start();
    let pd = ctx.alloc_pd().unwrap();
    let p = page_size();
    let layout = std::alloc::Layout::from_size_align(2 * p, p).unwrap();
    // SAFETY: non-zero size.
    let base = unsafe { std::alloc::alloc_zeroed(layout) };
    assert!(!base.is_null());
    // SAFETY: inside the allocation, which nothing else uses.
    unsafe { std::ptr::copy_nonoverlapping(b"parent".as_ptr(), base, 6) };
    // SAFETY: the allocation is ours and outlives the region.
    let mr = unsafe { pd.register_raw(base, 64, AccessFlags::LOCAL_WRITE) }.unwrap();
    assert!(rebacked_at(base as usize));
    // Another buffer registered and deregistered: the fork moves its
    // idle pages back to private memory, and only those (the daemon, in
    // this process, maps the live region's memfd too: not the
    // application's pages).
    let other = vec![0u8; 3 * p];
    // SAFETY: `other` outlives its region, dropped at once.
    drop(unsafe { pd.register_raw(other.as_ptr().add(p).cast_mut(), 64, AccessFlags::LOCAL_WRITE) }.unwrap());
    assert!(rebacked_at(other.as_ptr() as usize + p));
    // SAFETY: the child only reads and writes the buffer and /proc, then
    // leaves with _exit (no destructors, no test harness).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // SAFETY: the child's copy of the allocation.
        let got = unsafe { std::slice::from_raw_parts(base, 6) } == b"parent";
        let private = !rebacked_at(base as usize);
        // SAFETY: as above; the child's own copy.
        unsafe { base.write_volatile(b'C') };
        // SAFETY: ends the child at once.
        unsafe { libc::_exit(if got && private { 0 } else { 1 }) };
    }
    let mut status = 0;
    // SAFETY: waits for the child started above.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child saw shared or wrong bytes");
    // The child's write stayed in the child; the parent's registration
    // still reaches its own pages.
    // SAFETY: inside the allocation.
    assert_eq!(unsafe { base.read_volatile() }, b'p');
    assert_eq!(fake.daemon_read(mr.lkey(), 0, 6), b"parent");
    fake.daemon_write(mr.lkey(), 0, b"P");
    // SAFETY: inside the allocation.
    assert_eq!(unsafe { base.read_volatile() }, b'P');
    assert!(rebacked_at(base as usize));
    assert!(!rebacked_at(other.as_ptr() as usize + p), "the idle pages did not move back at the fork");
    drop(mr);
    // SAFETY: allocated above with this layout; the region is gone.
    unsafe { std::alloc::dealloc(base, layout) };
}

#[test]
fn posting_follows_the_doorbell_rule() {
    let (fake, ctx) = Fake::start();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(8, None).unwrap();
    let qp = pd.create_rc_qp(&cq, &cq, cap()).unwrap();
    assert_eq!(qp.state(), QpState::Reset);
    let mr = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let w = wr::rdma_write(1, &[mr.sge(0, 8).unwrap()], 0x1000, 5).unwrap().signaled();

    // No sends before RTS.
    let e = qp.post_send(std::slice::from_ref(&w)).unwrap_err();
    assert_eq!((e.index, e.errno()), (0, libc::EINVAL));

    let me = qp.endpoint(&ctx).unwrap();
    assert_eq!(me.qpn, qp.qpn());
    assert_eq!(me.psn, qp.psn());
    qp.connect(&me, AccessFlags::REMOTE_WRITE).unwrap();
    assert_eq!(qp.state(), QpState::Rts);
    let modifies: Vec<_> = fake
        .requests()
        .into_iter()
        .filter_map(|r| match r {
            Request::ModifyQp { attr, mask, .. } => Some((attr, mask)),
            _ => None,
        })
        .collect();
    assert_eq!(modifies.len(), 3);
    assert_eq!(modifies[0].0.qp_state, QpState::Init);
    assert_eq!(
        modifies[0].1,
        QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS
    );
    assert_eq!(modifies[1].0.qp_state, QpState::Rtr);
    assert_eq!(modifies[1].0.dest_qp_num, qp.qpn());
    assert_eq!(modifies[1].0.rq_psn, qp.psn());
    assert_eq!(modifies[1].0.ah_attr.dlid, me.lid);
    assert!(!modifies[1].0.ah_attr.is_global);
    assert_eq!(modifies[1].0.min_rnr_timer, 12);
    assert_eq!(modifies[2].0.qp_state, QpState::Rts);
    assert_eq!(modifies[2].0.sq_psn, qp.psn());
    assert_eq!((modifies[2].0.timeout, modifies[2].0.retry_cnt, modifies[2].0.rnr_retry), (14, 7, 7));
    // The daemon's engine is awake: no doorbell.
    fake.doorbells();
    qp.post_send(&[w.clone(), w.clone()]).unwrap();
    assert_eq!(fake.doorbells(), 0);
    assert_eq!(fake.pop_send(qp.qpn(), cq.cqn()).unwrap(), w);
    assert_eq!(fake.pop_send(qp.qpn(), cq.cqn()).unwrap(), w);
    assert!(fake.pop_send(qp.qpn(), cq.cqn()).is_none());
    assert_eq!(cq.poll(&mut vrdma::wc_buffer(4)).unwrap(), 2);

    // Asleep: one ring per post_send call; none for a receive posted to a
    // QP that is not in ERR (the engine needs no wake-up for it: a
    // message that found no receive waits for its RNR timer).
    fake.set_engine_sleeping(true);
    qp.post_send(&[w.clone(), w.clone()]).unwrap();
    assert_eq!(fake.doorbells(), 1);
    qp.post_recv(&[wr::recv(9, &[mr.sge(0, 64).unwrap()]).unwrap()]).unwrap();
    assert_eq!(fake.doorbells(), 0);
    assert_eq!(fake.pop_recv(qp.qpn()).unwrap().wr_id, 9);

    // Full ring: ENOMEM at the first request that did not fit (4 slots,
    // 2 used), and the ones before it are posted.
    let e = qp.post_send(&[w.clone(), w.clone(), w.clone()]).unwrap_err();
    assert_eq!((e.index, e.errno()), (2, libc::ENOMEM));
    assert_eq!(fake.doorbells(), 1);

    // Per-request checks.
    while fake.pop_send(qp.qpn(), cq.cqn()).is_some() {}
    assert_eq!(cq.poll(&mut vrdma::wc_buffer(8)).unwrap(), 4);
    let too_many = wr::send(2, &[mr.sge(0, 1).unwrap(); 3]).unwrap();
    let e = qp.post_send(&[w.clone(), too_many]).unwrap_err();
    assert_eq!((e.index, e.errno()), (1, libc::EINVAL));
    // The request before the bad one was posted.
    assert_eq!(fake.pop_send(qp.qpn(), cq.cqn()).unwrap(), w);
    assert!(fake.pop_send(qp.qpn(), cq.cqn()).is_none());
    let long = wr::send(3, &[]).unwrap().inline(&[1; 65]).unwrap();
    assert_eq!(qp.post_send(&[long]).unwrap_err().errno(), libc::EINVAL);
    let read_inline = wr::rdma_read(4, &[], 0, 0).unwrap().inline(b"x").unwrap();
    assert_eq!(qp.post_send(&[read_inline]).unwrap_err().errno(), libc::EINVAL);
    let ok_inline = wr::send(5, &[]).unwrap().inline(&[7; 64]).unwrap();
    qp.post_send(&[ok_inline]).unwrap();
    let got = fake.pop_send(qp.qpn(), cq.cqn()).unwrap();
    assert_eq!(got.opcode, SendOpcode::Send);
    assert_eq!(got.inline_data(), &[7; 64]);

    let (attr, _) = qp.query().unwrap();
    assert_eq!(attr.qp_state, QpState::Rts);
    // connect needs RESET or INIT.
    assert_eq!(qp.connect(&me, AccessFlags::empty()).unwrap_err().errno(), libc::EINVAL);
}

impl Fake {
    /// The QPs the client named since the last call, and whether it said
    /// it could not name them all.
    fn named(&self) -> (Vec<u32>, bool) {
        let ring = self.st().posted_ring.clone().unwrap();
        let mut slot = [0u8; proto::POSTED_SLOT_SIZE];
        let mut v = Vec::new();
        while ring.try_pop(&mut slot).unwrap() {
            v.push(u32::from_le_bytes(slot[..4].try_into().unwrap()));
        }
        (v, ring.aux(proto::POSTED_AUX_OVERFLOW).swap(0, Ordering::SeqCst) != 0)
    }

    /// What the engine does before it leaves a QP idle.
    fn rearm(&self, qpn: u32) {
        self.st().qps[&qpn].sq.aux(proto::SQ_AUX_NOTIFIED).store(0, Ordering::SeqCst);
    }
}

#[test]
fn a_post_names_the_qp_once_until_the_engine_rearms_it() {
    let (fake, ctx) = Fake::start();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64, None).unwrap();
    let qp = pd.create_rc_qp(&cq, &cq, QpCap { max_send_wr: 16, ..cap() }).unwrap();
    let me = qp.endpoint(&ctx).unwrap();
    qp.connect(&me, AccessFlags::REMOTE_WRITE).unwrap();
    let mr = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let w = wr::rdma_write(1, &[mr.sge(0, 8).unwrap()], 0x1000, 5).unwrap();
    let r = wr::recv(9, &[mr.sge(0, 64).unwrap()]).unwrap();
    assert_eq!(fake.named(), (vec![], false));
    qp.post_send(&[w.clone(), w.clone()]).unwrap();
    qp.post_send(std::slice::from_ref(&w)).unwrap();
    assert_eq!(fake.named(), (vec![qp.qpn()], false), "named once while the engine serves it");
    qp.post_send(std::slice::from_ref(&w)).unwrap();
    assert_eq!(fake.named(), (vec![], false));
    fake.rearm(qp.qpn());
    qp.post_send(std::slice::from_ref(&w)).unwrap();
    assert_eq!(fake.named(), (vec![qp.qpn()], false), "named again once re-armed");
    // Receives need the engine only in ERR, where it flushes them.
    fake.rearm(qp.qpn());
    qp.post_recv(std::slice::from_ref(&r)).unwrap();
    assert_eq!(fake.named(), (vec![], false));
    qp.modify(&QpAttr { qp_state: QpState::Err, ..QpAttr::default() }, QpAttrMask::STATE).unwrap();
    fake.set_engine_sleeping(true);
    fake.doorbells();
    qp.post_recv(std::slice::from_ref(&r)).unwrap();
    assert_eq!(fake.named(), (vec![qp.qpn()], false));
    assert_eq!(fake.doorbells(), 1, "a sleeping engine is woken to flush");
    fake.set_engine_sleeping(false);
    // A failed post names nothing.
    fake.rearm(qp.qpn());
    let bad = wr::send(2, &[mr.sge(0, 1).unwrap(); 3]).unwrap();
    assert!(qp.post_send(&[bad]).is_err());
    assert_eq!(fake.named(), (vec![], false));
}

#[test]
fn a_full_posted_ring_says_so_instead_of_naming() {
    let (fake, ctx) = Fake::start();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64, None).unwrap();
    let mr = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let w = wr::rdma_write(1, &[mr.sge(0, 8).unwrap()], 0x1000, 5).unwrap();
    let ring = fake.st().posted_ring.clone().unwrap();
    // Fill the ring with other numbers, as a busy context could.
    for n in 0..proto::POSTED_RING_CAPACITY {
        assert!(ring.try_push_bytes(&[n as u8; proto::POSTED_SLOT_SIZE]).unwrap());
    }
    let qp = pd.create_rc_qp(&cq, &cq, cap()).unwrap();
    qp.connect(&qp.endpoint(&ctx).unwrap(), AccessFlags::empty()).unwrap();
    qp.post_send(std::slice::from_ref(&w)).unwrap();
    let (named, overflow) = fake.named();
    assert_eq!(named.len(), proto::POSTED_RING_CAPACITY as usize);
    assert!(!named.contains(&qp.qpn()));
    assert!(overflow, "the client said it could not name the QP");
}

#[test]
fn send_slots_are_freed_as_completions_are_polled() {
    let (fake, ctx) = Fake::start();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(8, None).unwrap();
    let qp = pd.create_rc_qp(&cq, &cq, cap()).unwrap();
    let me = qp.endpoint(&ctx).unwrap();
    qp.connect(&me, AccessFlags::REMOTE_WRITE).unwrap();
    let mr = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let w = wr::rdma_write(1, &[mr.sge(0, 8).unwrap()], 0x1000, 5).unwrap().signaled();
    let quiet = wr::rdma_write(2, &[mr.sge(0, 8).unwrap()], 0x1000, 5).unwrap();
    let one = std::slice::from_ref(&w);
    let enomem = |r: Result<(), vrdma::PostError>| {
        let e = r.unwrap_err();
        assert_eq!((e.index, e.errno()), (0, libc::ENOMEM));
    };
    let mut wcs = vrdma::wc_buffer(8);
    qp.post_send(&[w.clone(), w.clone(), w.clone(), w.clone()]).unwrap();
    // The daemon takes two out of the ring and is not done with them:
    // the ring has room, the send queue has none.
    let (a, b) = (fake.pull_send(qp.qpn()).unwrap(), fake.pull_send(qp.qpn()).unwrap());
    enomem(qp.post_send(one));
    // Done with both: their completions wait in the CQ, unpolled, and
    // the queue is still full (a CQ of the queue's depth cannot overflow).
    fake.retire(qp.qpn(), cq.cqn(), &a);
    fake.retire(qp.qpn(), cq.cqn(), &b);
    enomem(qp.post_send(one));
    // Each completion polled frees its slot.
    assert_eq!(cq.poll(&mut wcs[..1]).unwrap(), 1);
    qp.post_send(one).unwrap();
    enomem(qp.post_send(one));
    assert_eq!(cq.poll(&mut wcs).unwrap(), 1);
    qp.post_send(one).unwrap();
    enomem(qp.post_send(one));

    // 6 posted, 2 freed, 4 in the ring. An unsignaled WR's slot is freed
    // by the next signaled completion polled.
    while let Some(x) = fake.pop_send(qp.qpn(), cq.cqn()) {
        assert_eq!(x, w);
    }
    assert_eq!(cq.poll(&mut wcs).unwrap(), 4);
    qp.post_send(&[quiet.clone(), quiet.clone(), w.clone()]).unwrap();
    for _ in 0..2 {
        fake.pop_send(qp.qpn(), cq.cqn()).unwrap();
    }
    qp.post_send(one).unwrap();
    enomem(qp.post_send(one));
    fake.pop_send(qp.qpn(), cq.cqn()).unwrap();
    assert_eq!(cq.poll(&mut wcs).unwrap(), 1, "one completion covers three WRs");
    qp.post_send(&[w.clone(), w.clone(), w.clone()]).unwrap();
    enomem(qp.post_send(one));

    // 13 posted, 9 freed. A daemon whose completions claim more than was
    // posted gets a full queue, never a panic; one that claims
    // everything retired still cannot overfill the ring.
    for bogus in [14, 1000, u32::MAX, 0x8000_0000] {
        fake.complete_send(cq.cqn(), &Cqe::new(7, WcStatus::Success, WcOpcode::Send, qp.qpn()), bogus);
        cq.poll(&mut wcs).unwrap();
        enomem(qp.post_send(one));
    }
    // A reset drops what was posted: every slot is free again.
    qp.modify(&vrdma::QpAttr { qp_state: QpState::Reset, ..Default::default() }, QpAttrMask::STATE).unwrap();
    qp.connect(&me, AccessFlags::REMOTE_WRITE).unwrap();
    qp.post_send(&[w.clone(), w.clone(), w.clone(), w.clone()]).unwrap();
    enomem(qp.post_send(one));
}

#[test]
fn srq_and_recv_rules() {
    let (fake, ctx) = Fake::start();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(8, None).unwrap();
    let srq = pd.create_srq(SrqAttr { max_wr: 5, max_sge: 1, srq_limit: 0 }).unwrap();
    assert_eq!(srq.attr().max_wr, 8);
    let qp = pd.create_qp(&QpInit::rc(&cq, &cq, cap()).with_srq(&srq)).unwrap();
    let r = wr::recv(1, &[]).unwrap();
    let e = qp.post_recv(&[r]).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL);
    srq.post_recv(&[r, wr::recv(2, &[]).unwrap()]).unwrap();
    assert_eq!(fake.pop_srq(srq.srqn()).unwrap().wr_id, 1);
    assert_eq!(fake.pop_srq(srq.srqn()).unwrap().wr_id, 2);
    let two = wr::recv(3, &[vrdma::Sge::default(); 2]).unwrap();
    assert_eq!(srq.post_recv(&[two]).unwrap_err().errno(), libc::EINVAL);
    srq.set_limit(3).unwrap();
    assert_eq!(srq.query().unwrap().srq_limit, 3);
    assert_eq!(srq.set_limit(999).unwrap_err().errno(), libc::EINVAL);

    // A QP with its own receive queue refuses receives only in RESET.
    let qp2 = pd.create_rc_qp(&cq, &cq, cap()).unwrap();
    assert_eq!(qp2.post_recv(&[r]).unwrap_err().errno(), libc::EINVAL);
    qp2.to_init(1, AccessFlags::empty()).unwrap();
    qp2.post_recv(&[r]).unwrap();
    drop(qp);
    drop(qp2);
    drop(srq);
    let reqs = fake.requests();
    let last_qp = reqs.iter().rposition(|r| matches!(r, Request::DestroyQp { .. })).unwrap();
    let srq_gone = reqs.iter().position(|r| matches!(r, Request::DestroySrq { .. })).unwrap();
    assert!(last_qp < srq_gone);
}

#[test]
fn cq_poll_arm_and_channel() {
    let (fake, ctx) = Fake::start();
    let ch = ctx.create_comp_channel().unwrap();
    let cq = ctx.create_cq(3, Some(&ch)).unwrap();
    assert_eq!(cq.depth(), 4);
    let mut out = vrdma::wc_buffer(8);
    // Many empty polls: spin, then yield; never an error.
    for _ in 0..200 {
        assert_eq!(cq.poll(&mut out).unwrap(), 0);
    }
    fake.complete(cq.cqn(), &wc(1, 5));
    fake.complete(cq.cqn(), &wc(2, 5));
    assert_eq!(cq.poll(&mut out).unwrap(), 2);
    assert_eq!((out[0].wr_id, out[1].wr_id), (1, 2));
    assert_eq!(out[0].status, WcStatus::Success);

    assert_eq!(ch.get_cq_event(Some(Duration::ZERO)).unwrap(), None);
    cq.req_notify(false).unwrap();
    assert_eq!(fake.armed(cq.cqn()), proto::CQ_ARM_NEXT);
    cq.req_notify(true).unwrap();
    assert_eq!(fake.armed(cq.cqn()), proto::CQ_ARM_SOLICITED);
    cq.req_notify(false).unwrap();
    let f = fake.clone();
    let cqn = cq.cqn();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        f.complete(cqn, &wc(3, 5));
    });
    assert_eq!(ch.get_cq_event(Some(Duration::from_secs(5))).unwrap(), Some(cqn));
    t.join().unwrap();
    assert_eq!(cq.poll_one().unwrap().unwrap().wr_id, 3);
    assert!(cq.poll_one().unwrap().is_none());

    // wait() on a channel dedicated to this CQ.
    let f = fake.clone();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        f.complete(cqn, &wc(4, 5));
    });
    assert_eq!(cq.wait(&mut out, Some(Duration::from_secs(5))).unwrap(), 1);
    assert_eq!(out[0].wr_id, 4);
    t.join().unwrap();
    assert_eq!(cq.wait(&mut out, Some(Duration::from_millis(10))).unwrap(), 0);
    let cq2 = ctx.create_cq(3, Some(&ch)).unwrap();
    assert_eq!(cq.wait(&mut out, Some(Duration::ZERO)).unwrap_err().errno(), libc::EINVAL);
    drop(cq2);
    // A CQ without a channel cannot be armed.
    let plain = ctx.create_cq(1, None).unwrap();
    assert_eq!(plain.req_notify(false).unwrap_err().errno(), libc::EINVAL);
    assert!(plain.stream().is_err());
}

#[test]
fn async_events() {
    let (fake, ctx) = Fake::start();
    assert_eq!(ctx.get_async_event(Some(Duration::ZERO)).unwrap(), None);
    assert_eq!(ctx.get_async_event(Some(Duration::from_millis(10))).unwrap(), None);
    let ev = AsyncEvent { event_type: AsyncEventType::QpFatal, element: 0x11 };
    let f = fake.clone();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        f.async_event(ev);
    });
    assert_eq!(ctx.get_async_event(None).unwrap(), Some(ev));
    t.join().unwrap();
    let async_fd = ctx.async_event_fd();
    let mut fds = [rustix::event::PollFd::new(&async_fd, rustix::event::PollFlags::IN)];
    assert_eq!(rustix::event::poll(&mut fds, Some(&rustix::event::Timespec::default())).unwrap(), 0);
    assert_eq!(ctx.async_events_dropped(), 0);
}

fn stream_test(rt: tokio::runtime::Runtime) {
    let (fake, ctx) = Fake::start();
    let ch = ctx.create_comp_channel().unwrap();
    let cq = ctx.create_cq(16, Some(&ch)).unwrap();
    let cq2 = ctx.create_cq(16, Some(&ch)).unwrap();
    let cqn = cq.cqn();
    let cqn2 = cq2.cqn();
    rt.block_on(async move {
        // Created outside a runtime it fails; inside it works.
        let mut s = cq.stream().unwrap();
        let mut s2 = cq2.stream().unwrap();
        fake.complete(cqn, &wc(1, 1));
        assert_eq!(s.next().await.unwrap().unwrap().wr_id, 1);
        let f = fake.clone();
        let producer = std::thread::spawn(move || {
            for i in 2..50u64 {
                std::thread::sleep(Duration::from_millis(1));
                f.complete(if i % 2 == 0 { cqn } else { cqn2 }, &wc(i, 1));
            }
        });
        let mut seen = Vec::new();
        let mut seen2 = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while seen.len() + seen2.len() < 48 {
            tokio::select! {
                wc = s.next() => seen.push(wc.unwrap().unwrap().wr_id),
                wc = s2.next() => seen2.push(wc.unwrap().unwrap().wr_id),
                _ = tokio::time::sleep_until(deadline) => panic!("stream stalled: {seen:?} {seen2:?}"),
            }
        }
        producer.join().unwrap();
        assert_eq!(seen, (2..50).step_by(2).collect::<Vec<_>>());
        assert_eq!(seen2, (3..50).step_by(2).collect::<Vec<_>>());
    });
}

#[test]
fn stream_current_thread() {
    stream_test(tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap());
}

#[test]
fn stream_multi_thread() {
    stream_test(tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap());
}

#[test]
fn stream_needs_a_runtime() {
    let (_fake, ctx) = Fake::start();
    let ch = ctx.create_comp_channel().unwrap();
    let cq = ctx.create_cq(1, Some(&ch)).unwrap();
    assert_eq!(cq.stream().unwrap_err().errno(), libc::EINVAL);
}

#[test]
fn objects_from_other_contexts_are_refused() {
    let (_f1, ctx1) = Fake::start();
    let (_f2, ctx2) = Fake::start();
    let pd = ctx1.alloc_pd().unwrap();
    let cq = ctx2.create_cq(1, None).unwrap();
    let e = pd.create_rc_qp(&cq, &cq, cap()).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL);
    let ch = ctx2.create_comp_channel().unwrap();
    assert!(ctx1.create_cq(1, Some(&ch)).is_err());
}

fn qp_report(qpn: u32) -> QpPathReport {
    QpPathReport {
        qpn,
        qp_type: QpType::Rc,
        state: QpState::Reset,
        dest_qpn: 0,
        path: Path::None,
        direct_grants: 0,
    }
}

#[test]
fn stat_joins_the_daemons_pages() {
    let (fake, ctx) = Fake::start();
    let next = StatCursor { link: None, qpn: Some(9) };
    fake.st().stat_pages.extend([
        StatPage {
            report: StatReport {
                links: vec![],
                qps: vec![qp_report(3), qp_report(5)],
                missed_wakeups: 0,
                tenant: None,
                totals: false,
            },
            next: Some(next),
        },
        StatPage {
            report: StatReport {
                links: vec![],
                qps: vec![qp_report(9)],
                missed_wakeups: 2,
                tenant: None,
                totals: false,
            },
            next: None,
        },
    ]);
    let st = ctx.stat().unwrap();
    assert_eq!(st.qps.iter().map(|q| q.qpn).collect::<Vec<_>>(), vec![3, 5, 9]);
    assert_eq!(st.missed_wakeups, 2, "the largest count of any page");
    let asked: Vec<StatCursor> = fake
        .st()
        .requests
        .iter()
        .filter_map(|r| match r {
            Request::StatPage { from } => Some(*from),
            _ => None,
        })
        .collect();
    assert_eq!(asked, vec![StatCursor::START, next]);
}

#[test]
fn stat_pages_that_do_not_advance_are_a_protocol_error() {
    let (fake, ctx) = Fake::start();
    // A cursor going back, in both lists or in one: a daemon answering so
    // could keep the client asking for ever.
    for next in [StatCursor::START, StatCursor { link: None, qpn: Some(0) }] {
        let mut pages = vec![StatPage { report: StatReport::default(), next: Some(next) }; 2];
        pages[0].next = Some(StatCursor { link: Some(4), qpn: Some(4) });
        fake.st().stat_pages.extend(pages);
        assert!(matches!(ctx.stat(), Err(Error::Protocol(_))));
        fake.st().stat_pages.clear();
    }
}

#[test]
fn ud_qps_address_handles_and_datagram_sends() {
    use vrdma::{AhAttr, QpType, UdDest};
    let (fake, ctx) = Fake::start();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(8, None).unwrap();
    let attr = AhAttr { dlid: 1, port_num: 1, sl: 3, ..AhAttr::default() };
    let ah = pd.create_ah(&attr).unwrap();
    assert_ne!(ah.handle(), 0);
    assert_eq!(ah.attr(), attr);
    assert_eq!(ah.pd().pd_id(), pd.pd_id());
    assert!(fake.requests().contains(&Request::CreateAh { pd: pd.pd_id(), attr }));

    // The convenience brings the QP to RTS with the UD masks.
    let qp = pd.create_ud_qp(&cq, &cq, cap(), 0x1234).unwrap();
    assert_eq!(qp.qp_type(), QpType::Ud);
    assert_eq!(qp.state(), QpState::Rts);
    let reqs = fake.requests();
    assert!(reqs.iter().any(|r| matches!(r, Request::CreateQp { init, .. } if init.qp_type == QpType::Ud)));
    let modifies: Vec<_> = reqs
        .into_iter()
        .filter_map(|r| match r {
            Request::ModifyQp { attr, mask, .. } => Some((attr, mask)),
            _ => None,
        })
        .collect();
    assert_eq!(modifies.len(), 3);
    assert_eq!(
        modifies[0].1,
        QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::QKEY
    );
    assert_eq!(
        (modifies[0].0.qp_state, modifies[0].0.qkey, modifies[0].0.port_num),
        (QpState::Init, 0x1234, 1)
    );
    assert_eq!((modifies[1].0.qp_state, modifies[1].1), (QpState::Rtr, QpAttrMask::STATE));
    assert_eq!(modifies[2].1, QpAttrMask::STATE | QpAttrMask::SQ_PSN);
    assert_eq!((modifies[2].0.qp_state, modifies[2].0.sq_psn), (QpState::Rts, qp.psn()));

    let mr = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let w = wr::ud_send(1, &[mr.sge(0, 8).unwrap()], &ah, 0x99, 0x8000_0000).unwrap().with_imm(5).signaled();
    assert_eq!(w.opcode, SendOpcode::SendWithImm);
    assert_eq!(w.ud, UdDest { remote_qpn: 0x99, remote_qkey: 0x8000_0000, ah: ah.handle() });
    qp.post_send(std::slice::from_ref(&w)).unwrap();
    assert_eq!(fake.pop_send(qp.qpn(), cq.cqn()).unwrap(), w);
    // A send without an address handle is refused on a UD QP...
    let bare = wr::send(2, &[mr.sge(0, 8).unwrap()]).unwrap();
    let e = qp.post_send(&[w.clone(), bare.clone()]).unwrap_err();
    assert_eq!((e.index, e.errno()), (1, libc::EINVAL));
    assert_eq!(fake.pop_send(qp.qpn(), cq.cqn()).unwrap(), w);
    assert!(fake.pop_send(qp.qpn(), cq.cqn()).is_none());
    // ...and inline data keeps the destination.
    let inline = wr::ud_send(3, &[], &ah, 0x99, 7).unwrap().inline(b"dgram").unwrap();
    qp.post_send(std::slice::from_ref(&inline)).unwrap();
    let got = fake.pop_send(qp.qpn(), cq.cqn()).unwrap();
    assert_eq!((got.inline_data(), got.ud.ah), (&b"dgram"[..], ah.handle()));
    // An RC QP does not look at the UD fields.
    let rc = pd.create_rc_qp(&cq, &cq, cap()).unwrap();
    rc.connect(&rc.endpoint(&ctx).unwrap(), AccessFlags::empty()).unwrap();
    rc.post_send(&[bare]).unwrap();

    // Step by step, on a QP created with QpInit::ud.
    let qp2 = pd.create_qp(&QpInit::ud(&cq, &cq, cap())).unwrap();
    assert_eq!(qp2.qp_type(), QpType::Ud);
    qp2.to_init_ud(1, 9).unwrap();
    qp2.to_rtr_ud().unwrap();
    assert_eq!(qp2.state(), QpState::Rtr);
    qp2.to_rts_ud(0x0123_4567).unwrap();
    match fake.requests().last().unwrap() {
        Request::ModifyQp { attr, .. } => assert_eq!(attr.sq_psn, 0x23_4567, "24 bits"),
        other => panic!("{other:?}"),
    }

    // A clone keeps the handle; the last drop destroys it, before its PD.
    let h = ah.handle();
    let clone = ah.clone();
    drop(ah);
    assert!(!fake.requests().contains(&Request::DestroyAh { ah: h }));
    drop(clone);
    drop((qp, qp2, rc, mr));
    drop(pd);
    let reqs = fake.requests();
    let destroy = reqs.iter().position(|r| *r == Request::DestroyAh { ah: h }).unwrap();
    let dealloc = reqs.iter().position(|r| matches!(r, Request::DeallocPd { .. })).unwrap();
    assert!(destroy < dealloc, "the AH goes before its PD");
}
