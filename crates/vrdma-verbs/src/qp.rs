//! Queue pairs, with the `post_send` and `post_recv` operations of the
//! context's ops table.
//!
//! Posting is the data path. A chain of `struct ibv_send_wr` is converted
//! into [`vrdma::SendWr`]s in a small buffer on the stack, a few at a time,
//! and each batch goes to [`vrdma::QueuePair::post_send`], which checks the
//! requests against the QP as rdma-core does, writes the shared ring and
//! rings the engine's doorbell only if it sleeps. No allocation and no
//! lock beyond what that call takes. Inline data (`IBV_SEND_INLINE`) is
//! copied from the SGEs' addresses while posting, as the verbs require, so
//! the buffer may be reused as soon as the call returns. The first request
//! that cannot be posted is reported through `*bad_wr` with its errno
//! (`EINVAL` for a malformed one, `ENOMEM` when the queue is full); those
//! before it are posted.
//!
//! The QP object is laid out as an `ibv_qp_ex` (as rdma-core's
//! `verbs_qp`); QPs created by `ibv_create_qp_ex` with send operations
//! have the `ibv_wr_*` API (module `qp_ex`), which `ibv_qp_to_qp_ex`
//! hands out, and it returns NULL (`EOPNOTSUPP`) for the others.
//!
//! UD QPs: a send's `wr.ud.ah` is the application's `struct ibv_ah *`,
//! whose `handle` (the daemon's number for it, see module `ah`) travels in
//! the request with `remote_qpn` and `remote_qkey`. A send on a UD QP
//! without an address handle is refused with `EINVAL` when posted.

use std::ffi::c_int;
use std::mem::MaybeUninit;
use std::ptr::{self, addr_of, addr_of_mut};
use std::sync::atomic::{AtomicU32, Ordering};

use vrdma::{
    AccessFlags, AhAttr, Gid, Mtu, QpAttr, QpAttrMask, QpCap, QpInit, QpState, QpType, RecvWr, SendFlags,
    SendOpcode, SendWr, Sge, SgeList, UdDest, MAX_INLINE, MAX_SGE,
};

use crate::abi::*;
use crate::ah::ibv_ah;
use crate::context::Ctx;
use crate::cq::Cq;
use crate::mem::Pd;
use crate::srq::Srq;
use crate::util::*;

#[repr(C)]
pub struct Qp {
    pub ex: ibv_qp_ex,
    pub inner: vrdma::QueuePair,
    /// Async events handed out by `ibv_get_async_event`.
    pub events_reported: AtomicU32,
    /// The `ibv_wr_*` batch (module `qp_ex`); empty for a QP without them.
    pub batch: std::cell::UnsafeCell<crate::qp_ex::Batch>,
}

// The application's pointer is the object's address.
const _: () = assert!(std::mem::offset_of!(Qp, ex) == 0);

impl Qp {
    /// # Safety
    /// `p` must be NULL or a live QP from `ibv_create_qp`.
    unsafe fn get<'a>(what: &str, p: *mut ibv_qp) -> Res<&'a vrdma::QueuePair> {
        non_null(what, p, "the QP")?;
        // SAFETY: `ibv_qp` starts the boxed `Qp`; only the Rust-owned field
        // is borrowed.
        Ok(unsafe { &*addr_of!((*p.cast::<Qp>()).inner) })
    }
}

fn cap_from_c(c: &ibv_qp_cap) -> QpCap {
    QpCap {
        max_send_wr: c.max_send_wr,
        max_recv_wr: c.max_recv_wr,
        max_send_sge: c.max_send_sge,
        max_recv_sge: c.max_recv_sge,
        max_inline_data: c.max_inline_data,
    }
}

fn cap_to_c(c: &QpCap) -> ibv_qp_cap {
    ibv_qp_cap {
        max_send_wr: c.max_send_wr,
        max_recv_wr: c.max_recv_wr,
        max_send_sge: c.max_send_sge,
        max_recv_sge: c.max_recv_sge,
        max_inline_data: c.max_inline_data,
    }
}

/// `ibv_create_qp`. Writes the capacities granted back into
/// `qp_init_attr->cap`, as the kernel path of rdma-core does.
pub unsafe extern "C" fn ibv_create_qp(pd: *mut ibv_pd, qp_init_attr: *mut ibv_qp_init_attr) -> *mut ibv_qp {
    const W: &str = "ibv_create_qp";
    ret_ptr(W, || {
        non_null(W, qp_init_attr, "qp_init_attr")?;
        // SAFETY: a live PD and a valid ibv_qp_init_attr (the verb's contract).
        unsafe { create(W, pd, &mut *qp_init_attr, None) }
    })
}

/// vRDMA's own: `ibv_create_qp`, with the QP attached to the rdma_cm id
/// `cm_id` (of vRDMA's drop-in `librdmacm.so.1`, a context of this
/// process) in the same call to the daemon, which moves it from there as
/// the kernel's CM moves an id's QP. The drop-in librdmacm looks it up
/// (`vrdma_create_qp_cm_id@VRDMA_PRIVATE_1`) for `rdma_create_qp`: one
/// control round trip where `ibv_create_qp` and the attach took two. Not
/// an interface for programs.
pub unsafe extern "C" fn vrdma_create_qp_cm_id(
    pd: *mut ibv_pd,
    qp_init_attr: *mut ibv_qp_init_attr,
    cm_id: u32,
) -> *mut ibv_qp {
    const W: &str = "rdma_create_qp";
    ret_ptr(W, || {
        non_null(W, qp_init_attr, "qp_init_attr")?;
        // SAFETY: a live PD and a valid ibv_qp_init_attr (the caller's
        // contract, as for ibv_create_qp).
        unsafe { create_for(W, pd, &mut *qp_init_attr, None, Some(cm_id)) }
    })
}

/// Creates a QP for `ibv_create_qp` and `ibv_create_qp_ex`; `send_ops`:
/// the `IBV_QP_EX_WITH_*` operations of the `ibv_wr_*` API, for a QP that
/// `ibv_qp_to_qp_ex` hands out.
///
/// # Safety
/// `pd` must be NULL or a live PD; the CQs and SRQ `a` names live objects.
#[allow(non_snake_case)] // `W`, the verb's name, as in the other verbs
pub unsafe fn create(
    W: &str,
    pd: *mut ibv_pd,
    a: &mut ibv_qp_init_attr,
    send_ops: Option<u64>,
) -> Res<*mut ibv_qp> {
    // SAFETY: the caller's contract.
    unsafe { create_for(W, pd, a, send_ops, None) }
}

/// [`create`], the QP attached to the rdma_cm id `cm_id` if given.
///
/// # Safety
/// As for [`create`].
#[allow(non_snake_case)] // `W`, the verb's name, as in the other verbs
unsafe fn create_for(
    W: &str,
    pd: *mut ibv_pd,
    a: &mut ibv_qp_init_attr,
    send_ops: Option<u64>,
    cm_id: Option<u32>,
) -> Res<*mut ibv_qp> {
    {
        // SAFETY: a live PD (the verb's contract).
        let p = unsafe { Pd::get(W, pd)? };
        let qp_type = u8::try_from(a.qp_type)
            .ok()
            .and_then(QpType::from_raw)
            .ok_or_else(|| refuse(W, "unsupported QP type", libc::EOPNOTSUPP))?;
        // SAFETY: the CQs and SRQ are live objects of the application.
        let (send_cq, recv_cq) = unsafe { (Cq::get(W, a.send_cq)?, Cq::get(W, a.recv_cq)?) };
        let srq = if a.srq.is_null() {
            None
        } else {
            // SAFETY: a live SRQ.
            Some(unsafe { Srq::get(W, a.srq)? })
        };
        // rdma-core's kernel path accepts a queue of 0 work requests (a
        // QP that only receives, or only sends); vRDMA QPs have at least
        // one slot in each ring, and granting more than asked is what the
        // verbs allow (the capacities granted are written back below).
        // qperf creates such QPs.
        let mut cap = cap_from_c(&a.cap);
        cap.max_send_wr = cap.max_send_wr.max(1);
        if srq.is_none() {
            cap.max_recv_wr = cap.max_recv_wr.max(1);
        }
        let init = QpInit { qp_type, send_cq, recv_cq, srq, cap, sq_sig_all: a.sq_sig_all != 0 };
        let inner = match cm_id {
            None => p.inner.create_qp(&init),
            Some(id) => p.inner.create_qp_for_cm_id(&init, id),
        }
        .map_err(|e| fail_in_guest(W, p.inner.context(), &e))?;
        a.cap = cap_to_c(&inner.cap());
        let qpn = inner.qpn();
        let qp = ibv_qp {
            context: p.pd.context,
            qp_context: a.qp_context,
            pd,
            send_cq: a.send_cq,
            recv_cq: a.recv_cq,
            srq: a.srq,
            handle: qpn,
            qp_num: qpn,
            state: u32::from(QpState::Reset.raw()),
            qp_type: a.qp_type,
            // SAFETY: zeroed storage, initialised by pthread_*_init below.
            mutex: unsafe { std::mem::zeroed() },
            // SAFETY: as above.
            cond: unsafe { std::mem::zeroed() },
            events_completed: 0,
        };
        let ex = ibv_qp_ex {
            qp_base: qp,
            comp_mask: 0,
            wr_id: 0,
            wr_flags: 0,
            wr_atomic_cmp_swp: None,
            wr_atomic_fetch_add: None,
            wr_bind_mw: None,
            wr_local_inv: None,
            wr_rdma_read: None,
            wr_rdma_write: None,
            wr_rdma_write_imm: None,
            wr_send: None,
            wr_send_imm: None,
            wr_send_inv: None,
            wr_send_tso: None,
            wr_set_ud_addr: None,
            wr_set_xrc_srqn: None,
            wr_set_inline_data: None,
            wr_set_inline_data_list: None,
            wr_set_sge: None,
            wr_set_sge_list: None,
            wr_start: None,
            wr_complete: None,
            wr_abort: None,
            wr_atomic_write: None,
        };
        let mut ex = ex;
        let batch = match send_ops {
            Some(ops) => {
                crate::qp_ex::install(&mut ex, ops);
                crate::qp_ex::Batch::new(inner.cap().max_send_wr, ops, a.qp_type == IBV_QPT_UD)
            }
            None => crate::qp_ex::Batch::default(),
        };
        let q = Box::into_raw(Box::new(Qp {
            ex,
            inner,
            events_reported: AtomicU32::new(0),
            batch: std::cell::UnsafeCell::new(batch),
        }));
        // SAFETY: `q` is a fresh box; its context is live.
        unsafe {
            init_mutex_cond(addr_of_mut!((*q).ex.qp_base.mutex), addr_of_mut!((*q).ex.qp_base.cond));
            Ctx::from_ptr(p.pd.context).registry().qps.insert(qpn, q);
        }
        Ok(q.cast())
    }
}

/// `ibv_destroy_qp`: waits until the application acknowledged every
/// async event it took for the QP.
pub unsafe extern "C" fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int {
    const W: &str = "ibv_destroy_qp";
    ret_code(W, || {
        // SAFETY: a live QP (the verb's contract).
        let inner = unsafe { Qp::get(W, qp)? };
        let q = qp.cast::<Qp>();
        // SAFETY: `q` is live until dropped at the end; its context is live.
        unsafe {
            Ctx::from_ptr((*qp).context).registry().qps.remove(&inner.qpn());
            wait_acked(
                addr_of_mut!((*qp).mutex),
                addr_of_mut!((*qp).cond),
                &[(addr_of!((*qp).events_completed), (*q).events_reported.load(Ordering::Relaxed))],
            );
            destroy_mutex_cond(addr_of_mut!((*qp).mutex), addr_of_mut!((*qp).cond));
            drop(Box::from_raw(q));
        }
        Ok(())
    })
}

/// Acknowledges one async event of `qp` (from `ibv_ack_async_event`).
///
/// # Safety
/// `qp` must be NULL or a live QP.
pub unsafe fn ack_async(qp: *mut ibv_qp) {
    if qp.is_null() {
        return;
    }
    // SAFETY: per the contract; written under the QP's mutex.
    unsafe {
        let _lock = PthreadLock::new(addr_of_mut!((*qp).mutex));
        (*qp).events_completed = (*qp).events_completed.wrapping_add(1);
        libc::pthread_cond_signal(addr_of_mut!((*qp).cond));
    }
}

fn state_from(what: &str, raw: u32) -> Res<QpState> {
    u8::try_from(raw)
        .ok()
        .and_then(QpState::from_raw)
        .ok_or_else(|| refuse(what, "bad QP state", libc::EINVAL))
}

pub fn ah_from_c(a: &ibv_ah_attr) -> AhAttr {
    AhAttr {
        dgid: Gid(a.grh.dgid.raw),
        flow_label: a.grh.flow_label,
        sgid_index: a.grh.sgid_index,
        hop_limit: a.grh.hop_limit,
        traffic_class: a.grh.traffic_class,
        dlid: a.dlid,
        sl: a.sl,
        src_path_bits: a.src_path_bits,
        static_rate: a.static_rate,
        is_global: a.is_global != 0,
        port_num: a.port_num,
    }
}

fn ah_to_c(a: &AhAttr) -> ibv_ah_attr {
    ibv_ah_attr {
        grh: ibv_global_route {
            dgid: ibv_gid { raw: a.dgid.0 },
            flow_label: a.flow_label,
            sgid_index: a.sgid_index,
            hop_limit: a.hop_limit,
            traffic_class: a.traffic_class,
        },
        dlid: a.dlid,
        sl: a.sl,
        src_path_bits: a.src_path_bits,
        static_rate: a.static_rate,
        is_global: u8::from(a.is_global),
        port_num: a.port_num,
    }
}

/// The masked attributes of `a`; fields outside the mask are not read as
/// enums (applications leave them uninitialised).
fn attr_from_c(what: &str, a: &ibv_qp_attr, mask: QpAttrMask) -> Res<QpAttr> {
    type M = QpAttrMask;
    let mut q = QpAttr::default();
    if mask.contains(M::STATE) {
        q.qp_state = state_from(what, a.qp_state)?;
    }
    if mask.contains(M::CUR_STATE) {
        q.cur_qp_state = state_from(what, a.cur_qp_state)?;
    }
    if mask.contains(M::PATH_MTU) {
        q.path_mtu = u8::try_from(a.path_mtu)
            .ok()
            .and_then(Mtu::from_raw)
            .ok_or_else(|| refuse(what, "bad path MTU", libc::EINVAL))?;
    }
    if mask.contains(M::ACCESS_FLAGS) {
        q.qp_access_flags = AccessFlags::from_bits(a.qp_access_flags)
            .ok_or_else(|| refuse(what, "unknown access flags", libc::EINVAL))?;
    }
    if mask.contains(M::AV) {
        q.ah_attr = ah_from_c(&a.ah_attr);
    }
    q.qkey = a.qkey;
    q.rq_psn = a.rq_psn;
    q.sq_psn = a.sq_psn;
    q.dest_qp_num = a.dest_qp_num;
    q.cap = cap_from_c(&a.cap);
    q.pkey_index = a.pkey_index;
    q.en_sqd_async_notify = a.en_sqd_async_notify != 0;
    q.sq_draining = a.sq_draining != 0;
    q.max_rd_atomic = a.max_rd_atomic;
    q.max_dest_rd_atomic = a.max_dest_rd_atomic;
    q.min_rnr_timer = a.min_rnr_timer;
    q.port_num = a.port_num;
    q.timeout = a.timeout;
    q.retry_cnt = a.retry_cnt;
    q.rnr_retry = a.rnr_retry;
    Ok(q)
}

fn attr_to_c(q: &QpAttr) -> ibv_qp_attr {
    ibv_qp_attr {
        qp_state: u32::from(q.qp_state.raw()),
        cur_qp_state: u32::from(q.cur_qp_state.raw()),
        path_mtu: u32::from(q.path_mtu.raw()),
        qkey: q.qkey,
        rq_psn: q.rq_psn,
        sq_psn: q.sq_psn,
        dest_qp_num: q.dest_qp_num,
        qp_access_flags: q.qp_access_flags.bits(),
        cap: cap_to_c(&q.cap),
        ah_attr: ah_to_c(&q.ah_attr),
        pkey_index: q.pkey_index,
        en_sqd_async_notify: u8::from(q.en_sqd_async_notify),
        sq_draining: u8::from(q.sq_draining),
        max_rd_atomic: q.max_rd_atomic,
        max_dest_rd_atomic: q.max_dest_rd_atomic,
        min_rnr_timer: q.min_rnr_timer,
        port_num: q.port_num,
        timeout: q.timeout,
        retry_cnt: q.retry_cnt,
        rnr_retry: q.rnr_retry,
        ..ibv_qp_attr::default()
    }
}

/// `ibv_modify_qp`: the daemon applies the kernel's attribute rules.
/// Returns 0 or an errno value; on success with `IBV_QP_STATE` the
/// application-visible `qp->state` follows.
pub unsafe extern "C" fn ibv_modify_qp(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, attr_mask: c_int) -> c_int {
    const W: &str = "ibv_modify_qp";
    ret_code(W, || {
        // SAFETY: a live QP (the verb's contract).
        let inner = unsafe { Qp::get(W, qp)? };
        non_null(W, attr, "attr")?;
        let mask = QpAttrMask::from_bits(attr_mask as u32)
            .ok_or_else(|| refuse(W, "unknown attr_mask bits", libc::EINVAL))?;
        // SAFETY: a valid ibv_qp_attr.
        let q = attr_from_c(W, unsafe { &*attr }, mask)?;
        inner.modify(&q, mask).map_err(|e| fail(W, &e))?;
        if mask.contains(QpAttrMask::STATE) {
            // SAFETY: the QP is live; the field is the application's view.
            unsafe { (*qp).state = u32::from(q.qp_state.raw()) };
        }
        Ok(())
    })
}

/// `ibv_query_qp`: every attribute (whatever the mask) and the init
/// attributes. Returns 0 or an errno value.
pub unsafe extern "C" fn ibv_query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    attr_mask: c_int,
    init_attr: *mut ibv_qp_init_attr,
) -> c_int {
    const W: &str = "ibv_query_qp";
    ret_code(W, || {
        // SAFETY: a live QP (the verb's contract).
        let inner = unsafe { Qp::get(W, qp)? };
        non_null(W, attr, "attr")?;
        non_null(W, init_attr, "init_attr")?;
        let (q, init) = inner.query().map_err(|e| fail(W, &e))?;
        // SAFETY: valid output structures; the QP is live.
        unsafe {
            attr.write(attr_to_c(&q));
            init_attr.write(ibv_qp_init_attr {
                qp_context: (*qp).qp_context,
                send_cq: (*qp).send_cq,
                recv_cq: (*qp).recv_cq,
                srq: (*qp).srq,
                cap: cap_to_c(&init.cap),
                qp_type: u32::from(init.qp_type.raw()),
                sq_sig_all: c_int::from(init.sq_sig_all),
            });
            if attr_mask & QpAttrMask::STATE.bits() as c_int != 0 {
                (*qp).state = u32::from(q.qp_state.raw());
            }
        }
        Ok(())
    })
}

/// `ibv_qp_to_qp_ex`: the QP's `struct ibv_qp_ex` when it was created by
/// `ibv_create_qp_ex` with `IBV_QP_INIT_ATTR_SEND_OPS_FLAGS` (module
/// `qp_ex`); otherwise NULL with `errno = EOPNOTSUPP` (rdma-core returns
/// NULL for a QP without the `ibv_wr_*` API).
pub unsafe extern "C" fn ibv_qp_to_qp_ex(qp: *mut ibv_qp) -> *mut ibv_qp_ex {
    const W: &str = "ibv_qp_to_qp_ex";
    ret_ptr(W, || {
        // SAFETY: a live QP (the verb's contract).
        unsafe { Qp::get(W, qp)? };
        let q = qp.cast::<Qp>();
        // SAFETY: as above; `wr_start` is set at creation only.
        if unsafe { (*q).ex.wr_start }.is_none() {
            return Err(refuse(W, "a QP not created with IBV_QP_INIT_ATTR_SEND_OPS_FLAGS", libc::EOPNOTSUPP));
        }
        // SAFETY: as above.
        Ok(unsafe { addr_of_mut!((*q).ex) })
    })
}

/// `ibv_query_qp_data_in_order`: 0, i.e. no promise that data lands in
/// order, which is always a correct answer.
pub unsafe extern "C" fn ibv_query_qp_data_in_order(_qp: *mut ibv_qp, _op: u32, _flags: u32) -> c_int {
    0
}

/// `ibv_query_ece`: vRDMA has no enhanced connection establishment;
/// `EOPNOTSUPP`, as rdma-core returns without the provider operation.
pub unsafe extern "C" fn ibv_query_ece(_qp: *mut ibv_qp, _ece: *mut ibv_ece) -> c_int {
    ret_code("ibv_query_ece", || Err(refuse("ibv_query_ece", "ECE", libc::EOPNOTSUPP)))
}

/// `ibv_set_ece`: `EOPNOTSUPP`, see `ibv_query_ece`.
pub unsafe extern "C" fn ibv_set_ece(_qp: *mut ibv_qp, _ece: *mut ibv_ece) -> c_int {
    ret_code("ibv_set_ece", || Err(refuse("ibv_set_ece", "ECE", libc::EOPNOTSUPP)))
}

/// Work requests converted per call into the vrdma posting functions.
const POST_BATCH: usize = 8;

/// The SGEs of a C work request, checked.
///
/// # Safety
/// `list` must hold `num` entries when `num > 0`.
unsafe fn sges<'a>(list: *const ibv_sge, num: c_int) -> Res<&'a [ibv_sge]> {
    let n = usize::try_from(num).map_err(|_| libc::EINVAL)?;
    if n == 0 {
        return Ok(&[]);
    }
    if n > MAX_SGE || list.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: per the contract.
    Ok(unsafe { std::slice::from_raw_parts(list, n) })
}

/// Makes `dst` the list `s`, in place (a list is a few hundred bytes: a
/// request's list built elsewhere and moved in costs a copy per request).
fn set_sges(dst: &mut SgeList, s: &[ibv_sge]) {
    let mut items = [Sge::default(); MAX_SGE];
    for (d, s) in items.iter_mut().zip(s) {
        *d = Sge { addr: s.addr, length: s.length, lkey: s.lkey };
    }
    // `s.len() <= MAX_SGE` was checked by `sges`.
    if dst.set(&items[..s.len().min(MAX_SGE)]).is_err() {
        *dst = SgeList::default();
    }
}

/// Converts one C send request, in place in `out` (which a failed
/// conversion may leave written: a `SendWr` owns nothing to drop).
///
/// # Safety
/// `wr` must be a valid request whose SGE list (and, with
/// `IBV_SEND_INLINE`, the memory the SGEs name) is readable.
/// `ud`: the QP is a UD QP, whose sends name an address handle.
unsafe fn send_wr(wr: &ibv_send_wr, ud: bool, out: &mut MaybeUninit<SendWr>) -> Res<()> {
    let opcode = u8::try_from(wr.opcode).ok().and_then(SendOpcode::from_raw).ok_or(libc::EINVAL)?;
    let flags = SendFlags::from_bits(wr.send_flags).ok_or(libc::EINVAL)?;
    // SAFETY: per the contract.
    let list = unsafe { sges(wr.sg_list, wr.num_sge)? };
    // Built in place in the caller's buffer: the request is large (its
    // inline buffer), and a copy per request is measurable.
    let s = out.write(SendWr::new(wr.wr_id, opcode));
    s.flags = flags;
    if opcode.has_imm() {
        s.imm_data = wr.imm_data;
    }
    match opcode {
        // SAFETY: the opcode selects the union member.
        SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd => unsafe {
            s.remote_addr = wr.wr.atomic.remote_addr;
            s.rkey = wr.wr.atomic.rkey;
            s.compare_add = wr.wr.atomic.compare_add;
            s.swap = wr.wr.atomic.swap;
        },
        // SAFETY: as above.
        SendOpcode::RdmaWrite | SendOpcode::RdmaWriteWithImm | SendOpcode::RdmaRead => unsafe {
            s.remote_addr = wr.wr.rdma.remote_addr;
            s.rkey = wr.wr.rdma.rkey;
        },
        SendOpcode::Send | SendOpcode::SendWithImm if ud => {
            // SAFETY: the `ud` member is the one a send on a UD QP fills.
            let d = unsafe { wr.wr.ud };
            let ah = d.ah.cast::<ibv_ah>();
            if ah.is_null() {
                return Err(libc::EINVAL);
            }
            // SAFETY: a live address handle (the verb's contract).
            let handle = unsafe { (*ah).handle };
            s.ud = UdDest { remote_qpn: d.remote_qpn, remote_qkey: d.remote_qkey, ah: handle };
        }
        SendOpcode::Send | SendOpcode::SendWithImm => {}
    }
    // Inline data is gathered now; reads and atomics cannot carry any, and
    // the QP refuses them with the flag (their SGEs are not read).
    if flags.contains(SendFlags::INLINE) && !opcode.writes_local() {
        let mut total = 0usize;
        for g in list {
            total = total.checked_add(g.length as usize).ok_or(libc::EINVAL)?;
        }
        if total > MAX_INLINE {
            return Err(libc::EINVAL);
        }
        let mut at = 0usize;
        for g in list.iter().filter(|g| g.length > 0) {
            if g.addr == 0 {
                return Err(libc::EINVAL);
            }
            let n = g.length as usize;
            // SAFETY: the application names readable memory in the SGEs of
            // an inline send (the verbs contract); `at + n <= total <=
            // MAX_INLINE`, the inline buffer's size.
            unsafe { ptr::copy_nonoverlapping(g.addr as *const u8, s.inline.as_mut_ptr().add(at), n) };
            at += n;
        }
        s.inline_len = total as u16;
    } else {
        set_sges(&mut s.sg, list);
    }
    Ok(())
}

/// Converts one C receive request.
///
/// # Safety
/// `wr` must be a valid request with a readable SGE list.
pub unsafe fn recv_wr(wr: &ibv_recv_wr, out: &mut MaybeUninit<RecvWr>) -> Res<()> {
    // SAFETY: per the contract.
    let list = unsafe { sges(wr.sg_list, wr.num_sge)? };
    let r = out.write(RecvWr { wr_id: wr.wr_id, sg: SgeList::default() });
    set_sges(&mut r.sg, list);
    Ok(())
}

/// The common loop of the posting operations: converts the chain from
/// `first` in batches and posts each batch; on the first failure stores
/// the failed request in `bad` and returns its errno.
///
/// # Safety
/// `first` must be a valid chain; `bad` NULL or writable; `convert` as
/// [`send_wr`]/[`recv_wr`] require.
pub unsafe fn post_chain<C, R>(
    first: *mut C,
    bad: *mut *mut C,
    next: impl Fn(&C) -> *mut C,
    convert: impl Fn(&C, &mut MaybeUninit<R>) -> Res<()>,
    post: impl Fn(&[R]) -> Result<(), vrdma::PostError>,
) -> c_int {
    let mut buf = [const { MaybeUninit::<R>::uninit() }; POST_BATCH];
    let mut wrs = [ptr::null_mut::<C>(); POST_BATCH];
    let mut cur = first;
    let report = |at: *mut C, e: c_int| {
        if !bad.is_null() {
            // SAFETY: `bad` is writable (the contract).
            unsafe { *bad = at };
        }
        e
    };
    while !cur.is_null() {
        let mut n = 0;
        let mut failed = None;
        while n < POST_BATCH && !cur.is_null() {
            // SAFETY: `cur` is an element of the valid chain.
            let wr = unsafe { &*cur };
            if let Err(e) = convert(wr, &mut buf[n]) {
                failed = Some(e);
                break;
            }
            wrs[n] = cur;
            n += 1;
            cur = next(wr);
        }
        if n > 0 {
            // SAFETY: the first `n` entries were written by `convert`;
            // `MaybeUninit<R>` has the layout of `R`.
            let batch = unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<R>(), n) };
            let posted = post(batch);
            // SAFETY: each initialised entry is dropped exactly once (the
            // records own no resources today; this keeps it right if they do).
            unsafe { buf[..n].iter_mut().for_each(|b| b.assume_init_drop()) };
            if let Err(e) = posted {
                return report(wrs[e.index.min(n - 1)], e.errno());
            }
        }
        if let Some(e) = failed {
            return report(cur, e);
        }
    }
    0
}

/// `ops.post_send`.
pub unsafe extern "C" fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    guard("ibv_post_send", libc::EIO, || {
        if qp.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: a live QP (the verb's contract).
        let inner = unsafe { &*addr_of!((*qp.cast::<Qp>()).inner) };
        // SAFETY: as above; `qp_type` is set at creation and never changes.
        let ud = unsafe { (*qp).qp_type } == IBV_QPT_UD;
        // SAFETY: the application's chain and buffers (the verb's contract).
        unsafe {
            post_chain(wr, bad_wr, |w| w.next, |w, out| send_wr(w, ud, out), |batch| inner.post_send(batch))
        }
    })
}

/// `ops.post_recv`.
pub unsafe extern "C" fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    guard("ibv_post_recv", libc::EIO, || {
        if qp.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: a live QP (the verb's contract).
        let inner = unsafe { &*addr_of!((*qp.cast::<Qp>()).inner) };
        // SAFETY: the application's chain (the verb's contract).
        unsafe {
            post_chain(wr, bad_wr, |w| w.next, |w, out| recv_wr(w, out), |batch| inner.post_recv(batch))
        }
    })
}
