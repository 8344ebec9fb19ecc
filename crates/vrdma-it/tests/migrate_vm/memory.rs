//! A guest's memory extents move with its VM whether or not a memory
//! region lies on them (`docs/migration.md`, "What moves, what does not"):
//! a guest library takes an extent (`GuestAlloc`) before it registers in
//! it, and keeps an extent after its last region there is deregistered
//! (rping's buffers); a move in between must leave the extent its
//! context's on the destination. The guests' sessions are spoken frame
//! by frame (`RawPort`), so that each step is the test's.

use vrdma_core::hca::migrate::MemoryAt;
use vrdma_core::verbs::{AhAttr, QpAttr, QpAttrMask, QpCap, QpInitAttr, QpType};

use super::*;

/// The first PSN the guest's QP sends with.
const GUEST_PSN: u32 = 0x100;

/// A guest session on a VM's port: opened (its context made, `Hello`),
/// or adopting a moved context.
struct Guest {
    port: RawPort,
    ctx: u32,
}

impl Guest {
    fn hello(socket: &std::path::Path) -> Result<Guest> {
        let mut port = RawPort::open(socket)?;
        match port.call(Request::Hello { version: PROTOCOL_VERSION })?.0 {
            Reply::Hello { context, .. } => Ok(Guest { port, ctx: context }),
            r => bail!("Hello: {r:?}"),
        }
    }

    /// A session that takes `ctx` back on the destination.
    fn adopt(socket: &std::path::Path, ctx: u32) -> Result<Guest> {
        let mut port = RawPort::open(socket)?;
        match port.call(adopt(ctx))?.0 {
            Reply::Hello { context, .. } if context == ctx => Ok(Guest { port, ctx }),
            r => bail!("adopting context {ctx}: {r:?}"),
        }
    }

    fn ok(&mut self, req: Request) -> Result<Reply> {
        let what = format!("{req:?}");
        match self.port.call(req)?.0 {
            Reply::Error { errno, message } => bail!("{what}: errno {errno}: {message}"),
            r => Ok(r),
        }
    }

    fn errno(&mut self, req: Request) -> Result<i32> {
        let what = format!("{req:?}");
        let (r, _) = self.port.call(req)?;
        errno_of(&r).with_context(|| format!("{what} was not refused: {r:?}"))
    }

    fn alloc(&mut self, len: u64) -> Result<(u64, u64)> {
        match self.ok(Request::GuestAlloc { len })? {
            Reply::GuestExtent { offset, len } => Ok((offset, len)),
            r => bail!("GuestAlloc: {r:?}"),
        }
    }

    fn pd(&mut self) -> Result<u32> {
        match self.ok(Request::AllocPd)? {
            Reply::Pd { pd } => Ok(pd),
            r => bail!("AllocPd: {r:?}"),
        }
    }

    /// An RC QP (on a CQ of its own) connected to `peer`, in RTS.
    fn qp(&mut self, pd: u32, peer: &vrdma::Endpoint, mtu: vrdma::Mtu) -> Result<u32> {
        let cq = match self.ok(Request::CreateCq { cqe: 16, channel: None })? {
            Reply::Cq { cq, .. } => cq,
            r => bail!("CreateCq: {r:?}"),
        };
        let cap =
            QpCap { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let init =
            QpInitAttr { qp_type: QpType::Rc, send_cq: cq, recv_cq: cq, srq: None, cap, sq_sig_all: false };
        let qp = match self.ok(Request::CreateQp { pd, init })? {
            Reply::Qp { created, .. } => created.qpn,
            r => bail!("CreateQp: {r:?}"),
        };
        let rd = vrdma_core::hca::MAX_RD_ATOMIC as u8;
        let steps = [
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
                    ah_attr: AhAttr {
                        dgid: peer.gid,
                        is_global: true,
                        hop_limit: 64,
                        port_num: 1,
                        ..AhAttr::default()
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
        ];
        for (attr, mask) in steps {
            self.ok(Request::ModifyQp { qp, attr, mask })?;
        }
        Ok(qp)
    }
}

/// A registration of `[fd_offset, +len)` of the VM's region at `addr`.
fn reg(pd: u32, addr: u64, len: u64, fd_offset: u64) -> Request {
    Request::RegMr { pd, addr, len, access: access_all(), fd_offset }
}

/// Whether every byte of a VM's region is free on the daemon whose port
/// socket is `socket`, within [`WAIT`] (sessions that ended give theirs
/// back as their threads end): a new context (its segment, at the
/// region's start when all is free) takes all the rest and gives it back.
fn all_free(socket: &std::path::Path, region_len: u64) -> Result<()> {
    let page = vrdma_shm::page_size() as u64;
    let end = Instant::now() + WAIT;
    loop {
        let mut port = RawPort::open(socket)?;
        let segment = match port.call(Request::Hello { version: PROTOCOL_VERSION })?.0 {
            Reply::Hello { segment_len, .. } => segment_len.next_multiple_of(page),
            r => bail!("Hello: {r:?}"),
        };
        let (r, _) = port.call(Request::GuestAlloc { len: region_len - segment })?;
        match r {
            Reply::GuestExtent { offset, .. } => {
                let (r, _) = port.call(Request::GuestFree { offset })?;
                assert_eq!(r, Reply::Done);
                return Ok(());
            }
            r if Instant::now() > end => bail!("the VM's region is not all free after {WAIT:?}: {r:?}"),
            // This context's segment may lie between extents still held:
            // a new one, once they are gone.
            _ => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Three guest contexts of VM `t` on A, each with a memory extent no
/// memory region lies on at the move: context 1's registered once and
/// deregistered (kept, as a library keeps a span), with an RC QP
/// connected to B; context 2's and context 3's never registered. The VM
/// moves A → C. The snapshot names each extent's owner; A gives every
/// byte back at its finish. On C, context 1's adopter registers in its
/// extent (B's RDMA write lands there by the new key), grows it, registers
/// over the grown bytes and frees it; context 2's adopter grows its
/// extent and takes another, and cannot touch context 1's extent nor
/// context 1's its own; context 3 is never adopted. C's next export names the extents
/// left with their owners; once the tenant leaves C too, C's region is all
/// free again (the adopters' extents and the one never adopted).
#[test]
fn a_guests_extents_that_no_region_holds_move_with_their_contexts() -> Result<()> {
    let uid = rustix::process::geteuid().as_raw();
    let vm = format!("[vms.t]\ntenant = {uid}\nmemory_mib = 8\nports = 6\n");
    let h = ThreeHosts::start([&vm, "", &vm])?;
    let vm_a = vrdma::vm::attach_at(&h.a.socket, "t")?;
    let vm_c = vrdma::vm::attach_at(&h.c.socket, "t")?;
    let b = Side::new(&h.b.context()?, 1 << 16)?;
    let page = vrdma_shm::page_size() as u64;

    // On A.
    let mut g1 = Guest::hello(&vm_a.port_socket)?;
    let pd = g1.pd()?;
    let gid = match g1.ok(Request::QueryGid { port: 1, index: 0 })? {
        Reply::Gid(g) => g,
        r => bail!("QueryGid: {r:?}"),
    };
    let mut eb = b.endpoint()?;
    eb.lid = 0;
    let mtu = b.ctx.query_port(1)?.active_mtu;
    let qpn = g1.qp(pd, &eb, mtu)?;
    b.qp.connect(&vrdma::Endpoint { lid: 0, gid, qpn, psn: GUEST_PSN }, access_all())?;
    let e1 = g1.alloc(3 * page)?;
    let addr = 0x7f00_0000_0000u64;
    let req = reg(pd, addr, e1.1, e1.0);
    let key = match g1.ok(req)? {
        Reply::Mr { key } => key,
        r => bail!("RegMr on A: {r:?}"),
    };
    g1.ok(Request::DeregMr { key })?;
    let mut g2 = Guest::hello(&vm_a.port_socket)?;
    let e2 = g2.alloc(page)?;
    let mut g3 = Guest::hello(&vm_a.port_socket)?;
    let e3 = g3.alloc(2 * page)?;

    // The move.
    vrdma::migrate::pause(&h.a.socket, uid)?;
    let (snap_fd, _, _) = vrdma::migrate::export(&h.a.socket, uid)?;
    let snap = TenantSnapshot::decode(&read_all(&snap_fd)?)?;
    let p = snap.placement.clone().context("a VM's tenant is exported with its placement")?;
    let mut memory = p.memory.clone();
    memory.sort_unstable_by_key(|m| m.at);
    let mut want = vec![
        MemoryAt { ctx: g1.ctx, at: e1.0, len: e1.1 },
        MemoryAt { ctx: g2.ctx, at: e2.0, len: e2.1 },
        MemoryAt { ctx: g3.ctx, at: e3.0, len: e3.1 },
    ];
    want.sort_unstable_by_key(|m| m.at);
    assert_eq!(memory, want, "each extent with its owner, registered in or not");
    copy_region(&vm_a.region, &vm_c.region, vm_a.region_len)?;
    vrdma::migrate::import(&h.c.socket, snap_fd.as_fd())?;
    vrdma::migrate::finish(&h.a.socket, uid)?;
    vrdma::migrate::resume(&h.c.socket, uid)?;
    let (ctx1, ctx2, ctx3) = (g1.ctx, g2.ctx, g3.ctx);
    drop((g1, g2, g3));
    // A gave back every byte of the VM's region (the sessions' extents
    // with the sessions, the rings with their objects).
    all_free(&vm_a.port_socket, vm_a.region_len).context("A after its finish")?;

    // On C: context 1's extent is its adopter's. Its registration there
    // was refused before (EINVAL: in no memory extent of this session).
    let mut c1 = Guest::adopt(&vm_c.port_socket, ctx1)?;
    let req = reg(pd, addr, e1.1, e1.0);
    let key = match c1.ok(req).context("registering in the moved extent")? {
        Reply::Mr { key } => key,
        r => bail!("RegMr on C: {r:?}"),
    };
    // B's RDMA write by the new key lands in C's region, in the extent.
    let data = pattern(3000, 61);
    b.mr.write(0, &data)?;
    b.qp.post_send(&[wr::rdma_write(1, &[b.mr.sge(0, data.len())?], addr + 100, key)?.signaled()])?;
    let wc = poll_n(&b.cq, 1, WAIT)?;
    assert_eq!((wc[0].wr_id, wc[0].status), (1, WcStatus::Success));
    let mut got = vec![0u8; data.len()];
    rustix::io::pread(&vm_c.region, &mut got, e1.0 + 100)?;
    assert_eq!(got, data, "B's write in the moved extent on C");
    // Context 2's adopter grows its extent in place (before anything is
    // taken after it: the import reserved it without headroom), and an
    // extent it takes now is its own too. It cannot register in context
    // 1's extent nor free it; context 1's cannot free context 2's.
    let mut c2 = Guest::adopt(&vm_c.port_socket, ctx2)?;
    assert_eq!(
        c2.ok(Request::GuestGrow { offset: e2.0, len: 2 * page })?,
        Reply::GuestExtent { offset: e2.0, len: 2 * page }
    );
    let e4 = c2.alloc(page)?;
    let pd2 = c2.pd()?;
    let req = reg(pd2, addr, page, e1.0);
    assert_eq!(c2.errno(req)?, libc::EINVAL, "context 2 registering in context 1's extent");
    assert_eq!(c2.errno(Request::GuestFree { offset: e1.0 })?, libc::EINVAL);
    assert_eq!(c1.errno(Request::GuestFree { offset: e2.0 })?, libc::EINVAL);
    assert_eq!(c1.errno(Request::GuestFree { offset: e1.0 })?, libc::EBUSY, "a region lies on it");
    // Context 1's extent grows in place on C, a region covers the grown
    // bytes, and it goes once its regions are gone.
    let grown = match c1.ok(Request::GuestGrow { offset: e1.0, len: e1.1 + 2 * page })? {
        Reply::GuestExtent { offset, len } if offset == e1.0 && len >= e1.1 + 2 * page => len,
        r => bail!("GuestGrow on C: {r:?}"),
    };
    let req = reg(pd, addr, grown, e1.0);
    let key2 = match c1.ok(req).context("registering over the grown extent")? {
        Reply::Mr { key } => key,
        r => bail!("RegMr over the grown extent: {r:?}"),
    };
    c1.ok(Request::DeregMr { key })?;
    c1.ok(Request::DeregMr { key: key2 })?;
    assert_eq!(c1.ok(Request::GuestFree { offset: e1.0 })?, Reply::Done);
    assert_eq!(c1.errno(Request::GuestFree { offset: e1.0 })?, libc::EINVAL, "freed already");

    // The tenant leaves C (exported, dropped there): the snapshot names
    // the extents left with their owners (context 1's gone, context 2's
    // grown and the one its adopter took, context 3's never adopted).
    vrdma::migrate::pause(&h.c.socket, uid)?;
    let (back_fd, _, _) = vrdma::migrate::export(&h.c.socket, uid)?;
    let back = TenantSnapshot::decode(&read_all(&back_fd)?)?;
    let bp = back.placement.context("C's placement")?;
    let mut memory = bp.memory.clone();
    memory.sort_unstable_by_key(|m| m.at);
    let mut want = vec![
        MemoryAt { ctx: ctx2, at: e2.0, len: 2 * page },
        MemoryAt { ctx: ctx2, at: e4.0, len: e4.1 },
        MemoryAt { ctx: ctx3, at: e3.0, len: e3.1 },
    ];
    want.sort_unstable_by_key(|m| m.at);
    assert_eq!(memory, want, "C's extents with their owners");
    assert!(!bp.extents.iter().any(|e| e.at == e1.0), "context 1's extent was freed: {:?}", bp.extents);
    vrdma::migrate::finish(&h.c.socket, uid)?;
    // Every byte back: the adopters' extents with their sessions, the
    // one never adopted with the tenant.
    all_free(&vm_c.port_socket, vm_c.region_len).context("C after its finish")?;
    drop((c1, c2));
    Ok(())
}
