//! A VM's shared receive queue moves with it (issue 19, item 1;
//! `docs/migration.md`, "What moves, what does not"): its receives posted
//! and not yet taken (in its ring, in the VM's region), and its limit,
//! armed or not. The guest's session is spoken frame by frame
//! (`RawPort`), and its rings are read and written in the VM's region
//! where the guest's library would, so that each step is the test's.

use vrdma_core::hca::AsyncEvent;
use vrdma_core::proto::{decode_async_event, RingSpec, ASYNC_EVENT_SIZE, ASYNC_RING_CAPACITY};
use vrdma_core::verbs::{AsyncEventType, QpAttr, QpAttrMask, QpCap, QpInitAttr, QpType, SrqAttr};

use super::*;

/// The first PSN the guest's QPs send with.
const GUEST_PSN: u32 = 0x300;
/// Where the guest's memory region lies in its address space.
const ADDR: u64 = 0x7e00_0000_0000;
/// Bytes of each receive buffer; receive `k` (wr_id `RECV0 + k`) is at
/// `k * SLOT` of the guest's region.
const SLOT: u64 = 256;
/// The wr_id of the SRQ's first receive.
const RECV0: u64 = 1000;
/// The SRQ's depth.
const DEPTH: u32 = 16;
/// The SRQ's limit: the event fires when fewer receives than this are left.
const LIMIT: u32 = 3;
/// Bytes of each of B's messages.
const LEN: usize = 64;

/// A ring of the guest's in a VM's region: the extent `[at, +len)` its
/// object's segment lies on, `spec` inside it.
fn ring_in(region: &OwnedFd, at: u64, len: u64, spec: RingSpec) -> Result<vrdma_shm::RingView> {
    let map = vrdma_shm::Mapping::map_untrusted_in(region.try_clone()?, at, usize::try_from(len)?, None)?;
    Ok(vrdma_shm::RingView::in_segment(
        Arc::new(map),
        spec.offset as usize,
        spec.capacity,
        spec.stride as usize,
    )?)
}

/// Where a guest object's ring lies in the VM's region.
#[derive(Clone, Copy, Debug)]
struct Placed {
    at: u64,
    len: u64,
    spec: RingSpec,
}

impl Placed {
    fn of(handles: &[Handle], spec: RingSpec) -> Result<Placed> {
        match handles.first() {
            Some(Handle::Extent { offset, len }) => Ok(Placed { at: *offset, len: *len, spec }),
            h => bail!("a ring's extent: {h:?}"),
        }
    }

    fn view(&self, region: &OwnedFd) -> Result<vrdma_shm::RingView> {
        ring_in(region, self.at, self.len, self.spec)
    }
}

/// The guest's objects on A: one CQ for everything, an SRQ with its
/// limit, two RC QPs on it, a memory region of receive buffers.
struct SrqGuest {
    port: RawPort,
    ctx: u32,
    /// The context's own segment (its async-event ring at its start).
    segment: Placed,
    cq: Placed,
    srq: u32,
    srq_ring: Placed,
    qps: [u32; 2],
    key: u32,
    /// Where the guest's memory region lies in the VM's region.
    mem_at: u64,
}

impl SrqGuest {
    fn ok(port: &mut RawPort, req: Request) -> Result<(Reply, Vec<Handle>)> {
        let what = format!("{req:?}");
        match port.call(req)? {
            (Reply::Error { errno, message }, _) => bail!("{what}: errno {errno}: {message}"),
            r => Ok(r),
        }
    }

    /// The guest's objects, its QPs connected to `peers` (B's), in RTS.
    fn open(socket: &std::path::Path, peers: [vrdma::Endpoint; 2], mtu: vrdma::Mtu) -> Result<SrqGuest> {
        let mut port = RawPort::open(socket)?;
        let (ctx, segment) = match Self::ok(&mut port, Request::Hello { version: PROTOCOL_VERSION })? {
            (Reply::Hello { context, async_ring, .. }, h) => (context, Placed::of(&h, async_ring)?),
            r => bail!("Hello: {r:?}"),
        };
        let pd = match Self::ok(&mut port, Request::AllocPd)?.0 {
            Reply::Pd { pd } => pd,
            r => bail!("AllocPd: {r:?}"),
        };
        let (cqn, cq) = match Self::ok(&mut port, Request::CreateCq { cqe: 64, channel: None })? {
            (Reply::Cq { cq, ring, .. }, h) => (cq, Placed::of(&h, ring)?),
            r => bail!("CreateCq: {r:?}"),
        };
        let attr = SrqAttr { max_wr: DEPTH, max_sge: 1, srq_limit: 0 };
        let (srq, srq_ring) = match Self::ok(&mut port, Request::CreateSrq { pd, attr })? {
            (Reply::Srq { srq, attr, ring, .. }, h) => {
                anyhow::ensure!(attr.max_wr == DEPTH, "SRQ granted {attr:?}");
                (srq, Placed::of(&h, ring)?)
            }
            r => bail!("CreateSrq: {r:?}"),
        };
        let (mem_at, mem_len) = match Self::ok(&mut port, Request::GuestAlloc { len: 64 << 10 })?.0 {
            Reply::GuestExtent { offset, len } => (offset, len),
            r => bail!("GuestAlloc: {r:?}"),
        };
        let reg = Request::RegMr { pd, addr: ADDR, len: mem_len, access: access_all(), fd_offset: mem_at };
        let key = match Self::ok(&mut port, reg)?.0 {
            Reply::Mr { key } => key,
            r => bail!("RegMr: {r:?}"),
        };
        let mut qps = [0u32; 2];
        for (qpn, peer) in qps.iter_mut().zip(&peers) {
            let cap = QpCap {
                max_send_wr: 16,
                max_recv_wr: 0,
                max_send_sge: 1,
                max_recv_sge: 0,
                max_inline_data: 0,
            };
            let init = QpInitAttr {
                qp_type: QpType::Rc,
                send_cq: cqn,
                recv_cq: cqn,
                srq: Some(srq),
                cap,
                sq_sig_all: false,
            };
            *qpn = match Self::ok(&mut port, Request::CreateQp { pd, init })?.0 {
                Reply::Qp { created, rq, .. } => {
                    anyhow::ensure!(rq.is_none(), "a QP on an SRQ with a receive ring of its own");
                    created.qpn
                }
                r => bail!("CreateQp: {r:?}"),
            };
            for (attr, mask) in to_rts(peer, mtu) {
                Self::ok(&mut port, Request::ModifyQp { qp: *qpn, attr, mask })?;
            }
        }
        Ok(SrqGuest { port, ctx, segment, cq, srq, srq_ring, qps, key, mem_at })
    }

    /// Posts receives `ks` to the SRQ's ring in `region` (receive `k`'s
    /// buffer at `k * SLOT` of the guest's memory region).
    fn post(&self, region: &OwnedFd, ks: std::ops::Range<u64>) -> Result<()> {
        let ring = self.srq_ring.view(region)?;
        for k in ks {
            let sge = Sge { addr: ADDR + k * SLOT, length: SLOT as u32, lkey: self.key };
            let wr = RecvWr { wr_id: RECV0 + k, sg: SgeList::from_slice(&[sge])? };
            let mut slot = vec![0u8; ring.stride()];
            wr.encode(&mut slot)?;
            anyhow::ensure!(ring.try_push_bytes(&slot)?, "the SRQ's ring is full at receive {k}");
        }
        Ok(())
    }
}

/// The modifications that take a guest's RC QP to RTS, connected to `peer`.
fn to_rts(peer: &vrdma::Endpoint, mtu: vrdma::Mtu) -> [(QpAttr, QpAttrMask); 3] {
    let rd = vrdma_core::hca::MAX_RD_ATOMIC as u8;
    [
        (
            QpAttr {
                qp_state: QpState::Init,
                port_num: 1,
                qp_access_flags: access_all(),
                ..QpAttr::default()
            },
            QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
        ),
        (
            QpAttr {
                qp_state: QpState::Rtr,
                path_mtu: mtu,
                dest_qp_num: peer.qpn,
                rq_psn: peer.psn,
                max_dest_rd_atomic: rd,
                min_rnr_timer: 12,
                ah_attr: vrdma_core::verbs::AhAttr {
                    dgid: peer.gid,
                    is_global: true,
                    hop_limit: 64,
                    port_num: 1,
                    ..Default::default()
                },
                ..QpAttr::default()
            },
            QpAttrMask::STATE
                | QpAttrMask::AV
                | QpAttrMask::PATH_MTU
                | QpAttrMask::DEST_QPN
                | QpAttrMask::RQ_PSN
                | QpAttrMask::MAX_DEST_RD_ATOMIC
                | QpAttrMask::MIN_RNR_TIMER,
        ),
        (
            QpAttr {
                qp_state: QpState::Rts,
                sq_psn: GUEST_PSN,
                timeout: 14,
                retry_cnt: 7,
                rnr_retry: 7,
                max_rd_atomic: rd,
                ..QpAttr::default()
            },
            QpAttrMask::STATE
                | QpAttrMask::SQ_PSN
                | QpAttrMask::TIMEOUT
                | QpAttrMask::RETRY_CNT
                | QpAttrMask::RNR_RETRY
                | QpAttrMask::MAX_QP_RD_ATOMIC,
        ),
    ]
}

/// B's message `seq` on its QP `q`: the QP and the number in its first
/// bytes, a pattern after.
fn message(q: usize, seq: u64) -> Vec<u8> {
    let mut m = pattern(LEN, 100 * q as u64 + seq);
    m[0] = q as u8;
    m[1..9].copy_from_slice(&seq.to_le_bytes());
    m
}

/// B: one host process, two RC QPs on one CQ, each sending numbered
/// messages to one of the guest's QPs.
struct Sender {
    side: Side,
    /// B's second QP (its first is `side.qp`).
    other: vrdma::QueuePair,
    next: [u64; 2],
    /// B's send completions expected and not yet polled.
    owed: usize,
}

impl Sender {
    fn qp(&self, q: usize) -> &vrdma::QueuePair {
        if q == 0 {
            &self.side.qp
        } else {
            &self.other
        }
    }

    /// B's next message on QP `q` (wr_id `q << 32 | seq`), posted.
    fn send(&mut self, q: usize) -> Result<()> {
        let seq = self.next[q];
        self.next[q] += 1;
        let at = (q * 64 + seq as usize) * LEN;
        self.side.mr.write(at, &message(q, seq))?;
        let wr = wr::send((q as u64) << 32 | seq, &[self.side.mr.sge(at, LEN)?])?.signaled();
        self.qp(q).post_send(&[wr])?;
        self.owed += 1;
        Ok(())
    }

    /// B's sends so far completed, once each, every one a success.
    fn completed(&mut self) -> Result<()> {
        let wcs = poll_n(&self.side.cq, self.owed, WAIT)?;
        for w in &wcs {
            anyhow::ensure!(w.status == WcStatus::Success, "B's send {:#x}: {:?}", w.wr_id, w.status);
        }
        self.owed = 0;
        Ok(())
    }
}

/// What the guest's CQ said so far, checked as it comes.
#[derive(Default)]
struct Received {
    /// Per guest QP, the sequence numbers in the order they completed.
    seqs: [Vec<u64>; 2],
    /// The SRQ's receives completed, in completion order.
    wr_ids: Vec<u64>,
}

impl Received {
    /// Takes `n` receive completions from the guest's CQ ring in `region`,
    /// each a success on one of the guest's QPs, its bytes in the buffer
    /// of the receive it names, in `region`.
    fn take(&mut self, g: &SrqGuest, region: &OwnedFd, n: usize) -> Result<()> {
        let ring = g.cq.view(region)?;
        let cq = GuestCq { ring };
        for c in cq.poll(n)? {
            anyhow::ensure!(
                (c.status, c.opcode) == (WcStatus::Success, WcOpcode::Recv),
                "a completion in the guest's CQ: {c:?}"
            );
            let q =
                g.qps.iter().position(|&x| x == c.qp_num).with_context(|| format!("{c:?}: no QP of ours"))?;
            anyhow::ensure!(c.byte_len as usize == LEN, "{c:?}");
            let k = c.wr_id.checked_sub(RECV0).with_context(|| format!("{c:?}: not an SRQ receive"))?;
            let mut got = vec![0u8; LEN];
            rustix::io::pread(region, &mut got, g.mem_at + k * SLOT)?;
            anyhow::ensure!(got[0] as usize == q, "receive {k} on QP {q} holds QP {}'s message", got[0]);
            let seq = u64::from_le_bytes(got[1..9].try_into()?);
            anyhow::ensure!(got == message(q, seq), "receive {k}: message {seq} of QP {q}'s bytes");
            self.seqs[q].push(seq);
            self.wr_ids.push(c.wr_id);
        }
        Ok(())
    }
}

/// The async events in a context's ring in `region`, taken.
fn events(g: &SrqGuest, region: &OwnedFd) -> Result<Vec<AsyncEvent>> {
    let ring = g.segment.view(region)?;
    let mut out = Vec::new();
    let mut slot = [0u8; ASYNC_EVENT_SIZE];
    while ring.try_pop(&mut slot)? {
        out.push(decode_async_event(&slot).with_context(|| format!("an async event {slot:?}"))?);
    }
    Ok(out)
}

/// A new session on the VM's port at `socket` adopts context `ctx`: its
/// port, once the daemon rang the adopted context's new event signal
/// (handle 2 of the reply, forwarded as a `Bell`) for the events that
/// wait in its ring.
fn adopt_srq_guest(socket: &std::path::Path, ctx: u32) -> Result<RawPort> {
    let mut port = RawPort::open(socket)?;
    let handles = match port.call(adopt(ctx))? {
        (Reply::Hello { context, .. }, h) if context == ctx => h,
        r => bail!("adopting context {ctx}: {r:?}"),
    };
    let Some(&Handle::Bell { id, .. }) = handles.get(2) else {
        bail!("the adopted context's event signal: {handles:?}");
    };
    port.rung(id).context("the adopted context's event signal, rung for the event waiting in its ring")?;
    Ok(port)
}

/// The extents of the VM's region (the memfd `region` is a descriptor
/// of) that process `pid` maps, as (offset, length).
fn mapped_extents(pid: i32, region: &OwnedFd) -> Result<Vec<(u64, u64)>> {
    let ino = rustix::fs::fstat(region)?.st_ino.to_string();
    let mut out = Vec::new();
    for l in std::fs::read_to_string(format!("/proc/{pid}/maps"))?.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.get(4) != Some(&ino.as_str()) {
            continue;
        }
        let Some((start, end)) = f[0].split_once('-') else { bail!("{l}") };
        let len = u64::from_str_radix(end, 16)? - u64::from_str_radix(start, 16)?;
        out.push((u64::from_str_radix(f[2], 16)?, len));
    }
    Ok(out)
}

/// Both tests' start: VM `t` on A and C (its tenant this test's uid), B's
/// two RC QPs connected to the guest's two, which share its SRQ.
struct World {
    h: ThreeHosts,
    vm_a: vrdma::vm::VmAttachment,
    vm_c: vrdma::vm::VmAttachment,
    g: SrqGuest,
    b: Sender,
}

impl World {
    fn start() -> Result<World> {
        let uid = rustix::process::geteuid().as_raw();
        let vm = format!("[vms.t]\ntenant = {uid}\nmemory_mib = 8\nports = 3\n");
        let h = ThreeHosts::start([&vm, "", &vm])?;
        let vm_a = vrdma::vm::attach_at(&h.a.socket, "t")?;
        let vm_c = vrdma::vm::attach_at(&h.c.socket, "t")?;
        let side = Side::new(&h.b.context()?, 1 << 16)?;
        let other = side.another_qp(vrdma_it::cap(64, 1))?;
        let mtu = side.ctx.query_port(1)?.active_mtu;
        let mut peers = [side.endpoint()?, other.endpoint(&side.ctx)?];
        for p in &mut peers {
            p.lid = 0;
        }
        let mut g = SrqGuest::open(&vm_a.port_socket, peers, mtu)?;
        let gid = match SrqGuest::ok(&mut g.port, Request::QueryGid { port: 1, index: 0 })?.0 {
            Reply::Gid(gid) => gid,
            r => bail!("QueryGid: {r:?}"),
        };
        for (qp, &qpn) in [&side.qp, &other].into_iter().zip(&g.qps) {
            qp.connect(&vrdma::Endpoint { lid: 0, gid, qpn, psn: GUEST_PSN }, access_all())?;
        }
        Ok(World { h, vm_a, vm_c, g, b: Sender { side, other, next: [0; 2], owed: 0 } })
    }
}

/// A VM's tenant on A has an SRQ of 16 receives shared by two RC QPs,
/// each connected to one of B's QPs; 12 receives posted, the limit armed
/// at 3. B sends numbered messages on both QPs: 2 each before the move
/// (taken on A), 2 each while A is paused (held, then taken on C), and 5
/// each after the resume on C: the SRQ's 8 receives left at the move
/// are taken there, then 8 that the guest posts on C after it adopted
/// its context. The snapshot carries the SRQ with its limit armed; the
/// limit armed on A fires on C (in the context's event ring in the VM's
/// region) once, only when fewer than 3 receives are left, although the
/// guest has not yet taken its context back then; armed again on C, it
/// fires again, once. Every message lands once, in order per QP, in the
/// buffer of the receive that completed it; every receive completes at
/// most once, the first 18 posted, none lost; no QP leaves RTS.
#[test]
fn a_vm_tenants_srq_moves_with_its_receives_and_its_armed_limit() -> Result<()> {
    let uid = rustix::process::geteuid().as_raw();
    let World { h, vm_a, vm_c, mut g, mut b } = World::start()?;
    let mut got = Received::default();
    let (ctx, srq) = (g.ctx, g.srq);
    let srq_limit = |e: &AsyncEvent| e.event_type == AsyncEventType::SrqLimitReached && e.element == srq;

    // Before the move, on A: 12 receives posted, the limit armed at 3;
    // B's messages 0 and 1 on each QP take 4 of them.
    g.post(&vm_a.region, 0..12)?;
    SrqGuest::ok(&mut g.port, Request::ModifySrq { srq, limit: Some(LIMIT), resize: false })?;
    for _ in 0..2 {
        b.send(0)?;
        b.send(1)?;
    }
    b.completed()?;
    got.take(&g, &vm_a.region, 4)?;
    assert_eq!(events(&g, &vm_a.region)?, Vec::new(), "8 receives left of 12, the limit 3");

    // Paused: B's messages 2 and 3 on each QP are held.
    assert_eq!(vrdma::migrate::pause(&h.a.socket, uid)?, 2);
    for _ in 0..2 {
        b.send(0)?;
        b.send(1)?;
    }
    let held = vrdma_it::poll_for(&b.side.cq, Duration::from_millis(300))?;
    assert!(held.is_empty(), "completed while paused: {held:?}");
    let (snap_fd, _, qps) = vrdma::migrate::export(&h.a.socket, uid)?;
    assert_eq!(qps, 2);
    let snap = TenantSnapshot::decode(&read_all(&snap_fd)?)?;
    // The SRQ moves with its limit armed, both QPs on it, its ring placed
    // where it is in the VM's region.
    assert_eq!(snap.srqs.len(), 1, "{:?}", snap.srqs);
    assert_eq!(
        (snap.srqs[0].srq, snap.srqs[0].attr.srq_limit, snap.srqs[0].attr.max_wr),
        (srq, LIMIT, DEPTH)
    );
    assert!(snap.qps.iter().all(|q| q.init.srq == Some(srq)), "{:?}", snap.qps);
    let p = snap.placement.as_ref().context("a VM's tenant is exported with its placement")?;
    assert_eq!(p.srqs.iter().map(|r| (r.id, r.at)).collect::<Vec<_>>(), vec![(srq, g.srq_ring.at)]);
    copy_region(&vm_a.region, &vm_c.region, vm_a.region_len)?;
    assert_eq!(vrdma::migrate::import(&h.c.socket, snap_fd.as_fd())?, (uid, 2));
    vrdma::migrate::finish(&h.a.socket, uid)?;
    assert_eq!(vrdma::migrate::resume(&h.c.socket, uid)?, 2);

    // On C, the guest not back yet (its context not adopted): the held
    // messages take 4 of the 8 receives left; the next two take 2 more,
    // the second leaving 2, fewer than the limit: the limit armed on A
    // fires then, once.
    b.completed()?;
    got.take(&g, &vm_c.region, 4)?;
    b.send(0)?;
    b.completed()?;
    got.take(&g, &vm_c.region, 1)?;
    assert_eq!(events(&g, &vm_c.region)?, Vec::new(), "3 receives left, the limit 3");
    b.send(1)?;
    b.completed()?;
    got.take(&g, &vm_c.region, 1)?;
    // The guest takes its context back on C, is woken on its new event
    // signal, and finds the event in its ring, once.
    drop(g.port);
    g.port = adopt_srq_guest(&vm_c.port_socket, ctx)?;
    let evs = events(&g, &vm_c.region)?;
    assert_eq!(evs, vec![AsyncEvent { event_type: AsyncEventType::SrqLimitReached, element: srq }]);
    match SrqGuest::ok(&mut g.port, Request::QuerySrq { srq })?.0 {
        Reply::SrqAttr(a) => assert_eq!((a.srq_limit, a.max_wr), (0, DEPTH), "the limit fired: disarmed"),
        r => bail!("QuerySrq: {r:?}"),
    }

    // After the adoption: the guest posts 8 more receives (on C's ring)
    // and arms the limit again; B's messages 5 to 8 on each QP take the
    // 2 left and 6 new ones, leaving 2: the limit fires again, once.
    g.post(&vm_c.region, 12..20)?;
    SrqGuest::ok(&mut g.port, Request::ModifySrq { srq, limit: Some(LIMIT), resize: false })?;
    for _ in 0..4 {
        b.send(0)?;
        b.send(1)?;
    }
    b.completed()?;
    got.take(&g, &vm_c.region, 8)?;
    let end = Instant::now() + WAIT;
    let mut evs = events(&g, &vm_c.region)?;
    while evs.is_empty() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(10));
        evs = events(&g, &vm_c.region)?;
    }
    assert!(evs.iter().all(srq_limit), "{evs:?}");
    assert_eq!(evs.len(), 1, "the limit armed on C fires once: {evs:?}");

    // Every message once, in order, per QP; every receive completed once,
    // the first 18 posted; none lost, nothing more anywhere.
    let sent = b.next;
    assert_eq!(sent, [9, 9]);
    for (q, (seqs, n)) in got.seqs.iter().zip(sent).enumerate() {
        assert_eq!(seqs, &(0..n).collect::<Vec<_>>(), "QP {q}'s messages, once each, in order");
    }
    let mut wr_ids = got.wr_ids.clone();
    wr_ids.sort_unstable();
    assert_eq!(wr_ids, (RECV0..RECV0 + 18).collect::<Vec<_>>(), "the SRQ's first 18 receives, once each");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(GuestCq { ring: g.cq.view(&vm_c.region)? }.pending()?, 0, "a completion twice");
    assert!(vrdma_it::poll_for(&b.side.cq, Duration::from_millis(50))?.is_empty());
    assert_eq!(events(&g, &vm_c.region)?, Vec::new(), "an event twice");
    assert_eq!(g.srq_ring.view(&vm_c.region)?.len()?, 2, "the SRQ's two receives left");
    // No QP left RTS, the guest's nor B's.
    for q in 0..2 {
        assert_eq!(b.qp(q).query()?.0.qp_state, QpState::Rts, "B's QP {q}");
        match SrqGuest::ok(&mut g.port, Request::QueryQp { qp: g.qps[q] })?.0 {
            Reply::QpAttr { attr, .. } => assert_eq!(attr.qp_state, QpState::Rts, "the guest's QP {q}"),
            r => bail!("QueryQp: {r:?}"),
        }
    }
    Ok(())
}

/// The SRQ's limit armed on A fires on C before the guest takes its
/// context back there (the event waits in the context's ring, in the VM's
/// region, C mapping it for that); the VM moves on to A, its context
/// still not adopted: C forgets that ring at its `Finish` (it maps
/// nothing of the context's segment any more), and the guest adopting its
/// context on A is woken and finds C's event there, once, the limit
/// disarmed.
#[test]
fn an_event_raised_before_the_adoption_moves_on_with_the_vm_to_where_the_guest_adopts() -> Result<()> {
    let uid = rustix::process::geteuid().as_raw();
    let World { h, vm_a, vm_c, mut g, mut b } = World::start()?;
    let mut got = Received::default();
    let (ctx, srq) = (g.ctx, g.srq);
    let limit = AsyncEvent { event_type: AsyncEventType::SrqLimitReached, element: srq };
    let c_pid = h.c.proc.pid();
    let c_maps_segment = |g: &SrqGuest| -> Result<bool> {
        Ok(mapped_extents(c_pid, &vm_c.region)?.iter().any(|m| m.0 == g.segment.at))
    };

    // On A: 8 receives posted, the limit armed at 3. Moved to C, nothing
    // in flight; the guest's session on A ends with A's part.
    g.post(&vm_a.region, 0..8)?;
    SrqGuest::ok(&mut g.port, Request::ModifySrq { srq, limit: Some(LIMIT), resize: false })?;
    assert_eq!(vrdma::migrate::pause(&h.a.socket, uid)?, 2);
    let (snap_fd, _, _) = vrdma::migrate::export(&h.a.socket, uid)?;
    copy_region(&vm_a.region, &vm_c.region, vm_a.region_len)?;
    assert_eq!(vrdma::migrate::import(&h.c.socket, snap_fd.as_fd())?, (uid, 2));
    vrdma::migrate::finish(&h.a.socket, uid)?;
    assert_eq!(vrdma::migrate::resume(&h.c.socket, uid)?, 2);
    // A connection without a session stands for the guest's, closed.
    drop(std::mem::replace(&mut g.port, RawPort::connect(&vm_c.port_socket)?));

    // On C, not adopted: B's 6 messages take 6 of the 8 receives, 2 left:
    // the limit fires, into the context's ring in C's region, which C
    // maps for it.
    for _ in 0..3 {
        b.send(0)?;
        b.send(1)?;
    }
    b.completed()?;
    got.take(&g, &vm_c.region, 6)?;
    let ring = g.segment.view(&vm_c.region)?;
    let end = Instant::now() + WAIT;
    while ring.len()? == 0 && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(ring.len()?, 1, "the limit's event waits in the context's ring on C");
    assert!(c_maps_segment(&g)?, "C maps the context's segment for its waiting event ring");
    let (_, ctx_need) = vrdma_core::proto::context_segment_layout();
    let ring_pages = vrdma_shm::ring_bytes(ASYNC_RING_CAPACITY, ASYNC_EVENT_SIZE)
        .next_multiple_of(vrdma_shm::page_size()) as u64;
    let held: Vec<_> =
        mapped_extents(c_pid, &vm_c.region)?.into_iter().filter(|m| m.0 == g.segment.at).collect();
    assert!(ring_pages < ctx_need, "a segment larger than its event ring's pages");
    assert_eq!(held, vec![(g.segment.at, ring_pages)], "the event ring's pages alone, not the posted ring's");

    // Moved on to A, the context still not adopted.
    assert_eq!(vrdma::migrate::pause(&h.c.socket, uid)?, 2);
    let (back_fd, _, _) = vrdma::migrate::export(&h.c.socket, uid)?;
    copy_region(&vm_c.region, &vm_a.region, vm_c.region_len)?;
    // (A's region is free once the guest's session there has ended.)
    let end = Instant::now() + WAIT;
    loop {
        match vrdma::migrate::import(&h.a.socket, back_fd.as_fd()) {
            Ok(r) => {
                assert_eq!(r, (uid, 2));
                break;
            }
            Err(e) if e.errno() == libc::EBUSY && Instant::now() < end => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => return Err(e.into()),
        }
    }
    vrdma::migrate::finish(&h.c.socket, uid)?;
    assert_eq!(vrdma::migrate::resume(&h.a.socket, uid)?, 2);
    assert!(!c_maps_segment(&g)?, "C forgot the waiting event ring of the context that moved on");

    // The guest adopts its context on A: woken, it finds C's event, once.
    g.port = adopt_srq_guest(&vm_a.port_socket, ctx)?;
    assert_eq!(events(&g, &vm_a.region)?, vec![limit]);
    match SrqGuest::ok(&mut g.port, Request::QuerySrq { srq })?.0 {
        Reply::SrqAttr(a) => assert_eq!(a.srq_limit, 0, "the limit fired on C: disarmed"),
        r => bail!("QuerySrq: {r:?}"),
    }
    // Its QPs run on A: B's next message on each takes one of the 2
    // receives left.
    b.send(0)?;
    b.send(1)?;
    b.completed()?;
    got.take(&g, &vm_a.region, 2)?;
    assert_eq!(got.seqs, [vec![0, 1, 2, 3], vec![0, 1, 2, 3]], "every message once, in order");
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(events(&g, &vm_a.region)?, Vec::new(), "an event twice");
    Ok(())
}
