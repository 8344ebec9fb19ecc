//! The extended QP API: `ibv_create_qp_ex` (the context's `create_qp_ex`
//! operation) and the work-request builders of `struct ibv_qp_ex`
//! (`ibv_wr_start` ... `ibv_wr_complete`), which applications reach
//! through the function pointers of the structure, never by symbol.
//!
//! A QP created with `IBV_QP_INIT_ATTR_SEND_OPS_FLAGS` gets the builders
//! for the operations it asked for and a batch buffer of `max_send_wr`
//! [`vrdma::SendWr`]s, reserved once at creation: `ibv_wr_start` empties
//! it, each `ibv_wr_<opcode>` appends a request (with `wr_id` and
//! `wr_flags` read from the structure at that moment), the setters fill in
//! the last one, and `ibv_wr_complete` posts the whole batch with one call
//! of [`vrdma::QueuePair::post_send`]. No allocation per request.
//!
//! The builders return nothing, so the first error among them (an
//! operation the QP was not created for, a setter with no request, more
//! requests than the queue holds, too much inline data, unknown flags) is
//! kept and returned by `ibv_wr_complete`, which then posts nothing. An
//! error while posting (the ring full, a request the QP refuses) is
//! returned too; the requests before the failing one are posted, as with
//! `ibv_post_send`. `ibv_wr_abort` drops the batch.
//!
//! As in rdma-core, the application serialises the builders of one QP
//! (they are not thread safe).

use std::ffi::{c_int, c_void};
use std::ptr::addr_of;

use vrdma::{SendFlags, SendOpcode, SendWr, Sge, SgeList, UdDest, MAX_INLINE, MAX_SGE};

use crate::abi::*;
use crate::ah::ibv_ah;
use crate::qp::Qp;
use crate::util::*;

/// `IBV_QP_INIT_ATTR_*` (`enum ibv_qp_init_attr_mask`).
pub const IBV_QP_INIT_ATTR_PD: u32 = 1 << 0;
pub const IBV_QP_INIT_ATTR_CREATE_FLAGS: u32 = 1 << 2;
pub const IBV_QP_INIT_ATTR_SEND_OPS_FLAGS: u32 = 1 << 6;

/// `IBV_QP_EX_WITH_*` (`enum ibv_qp_create_send_ops_flags`).
const WITH_RDMA_WRITE: u64 = 1 << 0;
const WITH_RDMA_WRITE_WITH_IMM: u64 = 1 << 1;
const WITH_SEND: u64 = 1 << 2;
const WITH_SEND_WITH_IMM: u64 = 1 << 3;
const WITH_RDMA_READ: u64 = 1 << 4;
const WITH_ATOMIC_CMP_AND_SWP: u64 = 1 << 5;
const WITH_ATOMIC_FETCH_AND_ADD: u64 = 1 << 6;
/// The operations vRDMA provides.
pub const SUPPORTED_SEND_OPS: u64 = WITH_RDMA_WRITE
    | WITH_RDMA_WRITE_WITH_IMM
    | WITH_SEND
    | WITH_SEND_WITH_IMM
    | WITH_RDMA_READ
    | WITH_ATOMIC_CMP_AND_SWP
    | WITH_ATOMIC_FETCH_AND_ADD;

/// `struct ibv_qp_init_attr_ex`.
#[repr(C)]
pub struct ibv_qp_init_attr_ex {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub cap: ibv_qp_cap,
    pub qp_type: u32,
    pub sq_sig_all: c_int,
    pub comp_mask: u32,
    pub pd: *mut ibv_pd,
    pub xrcd: *mut c_void,
    pub create_flags: u32,
    pub max_tso_header: u16,
    pub rwq_ind_tbl: *mut c_void,
    pub rx_hash_function: u8,
    pub rx_hash_key_len: u8,
    pub rx_hash_key: *mut u8,
    pub rx_hash_fields_mask: u64,
    pub source_qpn: u32,
    pub send_ops_flags: u64,
}

const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<ibv_qp_init_attr_ex>() == 136);
    assert!(offset_of!(ibv_qp_init_attr_ex, comp_mask) == 60);
    assert!(offset_of!(ibv_qp_init_attr_ex, pd) == 64);
    assert!(offset_of!(ibv_qp_init_attr_ex, create_flags) == 80);
    assert!(offset_of!(ibv_qp_init_attr_ex, rwq_ind_tbl) == 88);
    assert!(offset_of!(ibv_qp_init_attr_ex, source_qpn) == 120);
    assert!(offset_of!(ibv_qp_init_attr_ex, send_ops_flags) == 128);
};

/// `struct ibv_data_buf`.
#[repr(C)]
pub struct ibv_data_buf {
    pub addr: *mut c_void,
    pub length: usize,
}

/// The work requests being built on one QP.
#[derive(Default)]
pub struct Batch {
    wrs: Vec<SendWr>,
    /// The most requests one batch holds: the send queue's size.
    limit: usize,
    /// The first error of the builders since `ibv_wr_start` (0: none).
    err: c_int,
    /// `IBV_QP_EX_WITH_*` the QP was created with.
    ops: u64,
    ud: bool,
}

impl Batch {
    /// A batch for `max_send_wr` requests of the operations `ops`.
    pub fn new(max_send_wr: u32, ops: u64, ud: bool) -> Self {
        let limit = max_send_wr.max(1) as usize;
        Batch { wrs: Vec::with_capacity(limit), limit, err: 0, ops, ud }
    }

    fn latch(&mut self, e: c_int) {
        if self.err == 0 {
            self.err = e;
        }
    }

    /// Appends a request, or records why not.
    fn push(&mut self, ex: &ibv_qp_ex, op: u64, opcode: SendOpcode) -> Option<&mut SendWr> {
        if self.err != 0 {
            return None;
        }
        if self.ops & op == 0 {
            self.latch(libc::EOPNOTSUPP);
            return None;
        }
        if self.wrs.len() >= self.limit {
            self.latch(libc::ENOMEM);
            return None;
        }
        let Some(flags) = SendFlags::from_bits(ex.wr_flags) else {
            self.latch(libc::EINVAL);
            return None;
        };
        let mut s = SendWr::new(ex.wr_id, opcode);
        s.flags = flags;
        // Within the capacity reserved at creation (`limit`): no allocation.
        self.wrs.push(s);
        self.wrs.last_mut()
    }

    /// The request the setters fill in.
    fn last(&mut self) -> Option<&mut SendWr> {
        if self.err != 0 {
            return None;
        }
        if self.wrs.is_empty() {
            self.latch(libc::EINVAL);
            return None;
        }
        self.wrs.last_mut()
    }
}

/// The batch of the QP behind `qp`.
///
/// # Safety
/// `qp` must be a live QP from `create_qp_ex`, used by one thread at a time
/// (the `ibv_wr_*` contract).
unsafe fn batch<'a>(qp: *mut ibv_qp_ex) -> &'a mut Batch {
    // SAFETY: per the contract; the batch is only reached from here.
    unsafe { &mut *(*addr_of!((*qp.cast::<Qp>()).batch)).get() }
}

/// Runs a builder body, mapping a panic to a latched `EIO`.
///
/// # Safety
/// As [`batch`].
unsafe fn build(qp: *mut ibv_qp_ex, f: impl FnOnce(&ibv_qp_ex, &mut Batch)) {
    guard("ibv_wr_*", (), || {
        if qp.is_null() {
            return;
        }
        // SAFETY: per the contract.
        let (ex, b) = unsafe { (&*qp, batch(qp)) };
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(ex, b))).is_err() {
            // SAFETY: as above.
            unsafe { batch(qp) }.latch(libc::EIO);
        }
    })
}

unsafe extern "C" fn wr_start(qp: *mut ibv_qp_ex) {
    // SAFETY: the builders' contract.
    unsafe {
        build(qp, |_, b| {
            b.wrs.clear();
            b.err = 0;
        })
    }
}

unsafe extern "C" fn wr_abort(qp: *mut ibv_qp_ex) {
    // SAFETY: the builders' contract.
    unsafe {
        build(qp, |_, b| {
            b.wrs.clear();
            b.err = 0;
        })
    }
}

unsafe extern "C" fn wr_complete(qp: *mut ibv_qp_ex) -> c_int {
    guard("ibv_wr_complete", libc::EIO, || {
        if qp.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: the builders' contract; `inner` is the Rust-owned field.
        let (b, inner) = unsafe { (batch(qp), &*addr_of!((*qp.cast::<Qp>()).inner)) };
        let r = if b.err != 0 {
            b.err
        } else if b.wrs.is_empty() {
            0
        } else {
            match inner.post_send(&b.wrs) {
                Ok(()) => 0,
                Err(e) => e.errno(),
            }
        };
        b.wrs.clear();
        b.err = 0;
        r
    })
}

unsafe extern "C" fn wr_send(qp: *mut ibv_qp_ex) {
    // SAFETY: the builders' contract.
    unsafe {
        build(qp, |ex, b| {
            b.push(ex, WITH_SEND, SendOpcode::Send);
        })
    }
}

unsafe extern "C" fn wr_send_imm(qp: *mut ibv_qp_ex, imm_data: u32) {
    // SAFETY: the builders' contract.
    unsafe {
        build(qp, |ex, b| {
            if let Some(s) = b.push(ex, WITH_SEND_WITH_IMM, SendOpcode::SendWithImm) {
                s.imm_data = imm_data;
            }
        })
    }
}

unsafe extern "C" fn wr_rdma_write(qp: *mut ibv_qp_ex, rkey: u32, remote_addr: u64) {
    // SAFETY: the builders' contract.
    unsafe {
        build(qp, |ex, b| {
            if let Some(s) = b.push(ex, WITH_RDMA_WRITE, SendOpcode::RdmaWrite) {
                s.rkey = rkey;
                s.remote_addr = remote_addr;
            }
        })
    }
}

unsafe extern "C" fn wr_rdma_write_imm(qp: *mut ibv_qp_ex, rkey: u32, remote_addr: u64, imm_data: u32) {
    // SAFETY: the builders' contract.
    unsafe {
        build(qp, |ex, b| {
            if let Some(s) = b.push(ex, WITH_RDMA_WRITE_WITH_IMM, SendOpcode::RdmaWriteWithImm) {
                s.rkey = rkey;
                s.remote_addr = remote_addr;
                s.imm_data = imm_data;
            }
        })
    }
}

unsafe extern "C" fn wr_rdma_read(qp: *mut ibv_qp_ex, rkey: u32, remote_addr: u64) {
    // SAFETY: the builders' contract.
    unsafe {
        build(qp, |ex, b| {
            if let Some(s) = b.push(ex, WITH_RDMA_READ, SendOpcode::RdmaRead) {
                s.rkey = rkey;
                s.remote_addr = remote_addr;
            }
        })
    }
}

unsafe extern "C" fn wr_atomic_cmp_swp(
    qp: *mut ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    compare: u64,
    swap: u64,
) {
    // SAFETY: the builders' contract.
    unsafe {
        build(qp, |ex, b| {
            if let Some(s) = b.push(ex, WITH_ATOMIC_CMP_AND_SWP, SendOpcode::AtomicCmpAndSwp) {
                s.rkey = rkey;
                s.remote_addr = remote_addr;
                s.compare_add = compare;
                s.swap = swap;
            }
        })
    }
}

unsafe extern "C" fn wr_atomic_fetch_add(qp: *mut ibv_qp_ex, rkey: u32, remote_addr: u64, add: u64) {
    // SAFETY: the builders' contract.
    unsafe {
        build(qp, |ex, b| {
            if let Some(s) = b.push(ex, WITH_ATOMIC_FETCH_AND_ADD, SendOpcode::AtomicFetchAndAdd) {
                s.rkey = rkey;
                s.remote_addr = remote_addr;
                s.compare_add = add;
            }
        })
    }
}

unsafe extern "C" fn wr_set_ud_addr(qp: *mut ibv_qp_ex, ah: *mut c_void, remote_qpn: u32, remote_qkey: u32) {
    // SAFETY: the builders' contract.
    unsafe {
        build(qp, |_, b| {
            let ud = b.ud;
            let Some(s) = b.last() else { return };
            if !ud {
                // Ignored on connected QPs, as by rdma-core's providers.
                return;
            }
            let ah = ah.cast::<ibv_ah>();
            if ah.is_null() {
                b.latch(libc::EINVAL);
                return;
            }
            // SAFETY: a live address handle (the verb's contract).
            let handle = (*ah).handle;
            s.ud = UdDest { remote_qpn, remote_qkey, ah: handle };
        })
    }
}

fn set_sges(b: &mut Batch, list: &[ibv_sge]) {
    if list.len() > MAX_SGE {
        b.latch(libc::EINVAL);
        return;
    }
    let Some(s) = b.last() else { return };
    let mut items = [Sge::default(); MAX_SGE];
    for (d, g) in items.iter_mut().zip(list) {
        *d = Sge { addr: g.addr, length: g.length, lkey: g.lkey };
    }
    s.sg = SgeList::from_slice(&items[..list.len()]).unwrap_or_default();
    s.inline_len = 0;
    s.flags.remove(SendFlags::INLINE);
}

unsafe extern "C" fn wr_set_sge(qp: *mut ibv_qp_ex, lkey: u32, addr: u64, length: u32) {
    // SAFETY: the builders' contract.
    unsafe { build(qp, |_, b| set_sges(b, &[ibv_sge { addr, length, lkey }])) }
}

unsafe extern "C" fn wr_set_sge_list(qp: *mut ibv_qp_ex, num_sge: usize, sg_list: *const ibv_sge) {
    // SAFETY: the builders' contract.
    unsafe {
        build(qp, |_, b| {
            if num_sge == 0 {
                set_sges(b, &[]);
            } else if sg_list.is_null() || num_sge > MAX_SGE {
                b.latch(libc::EINVAL);
            } else {
                // SAFETY: the application's list of `num_sge` entries.
                set_sges(b, std::slice::from_raw_parts(sg_list, num_sge));
            }
        })
    }
}

/// Copies the buffers into the last request as its inline data.
fn set_inline(b: &mut Batch, bufs: &[ibv_data_buf]) {
    let mut total = 0usize;
    for d in bufs {
        if d.length > 0 && d.addr.is_null() {
            b.latch(libc::EINVAL);
            return;
        }
        total = total.saturating_add(d.length);
    }
    if total > MAX_INLINE {
        b.latch(libc::EINVAL);
        return;
    }
    let Some(s) = b.last() else { return };
    let mut at = 0usize;
    for d in bufs.iter().filter(|d| d.length > 0) {
        // SAFETY: the application names readable memory (the verbs
        // contract); `at + length <= total <= MAX_INLINE`.
        unsafe {
            std::ptr::copy_nonoverlapping(d.addr.cast::<u8>(), s.inline.as_mut_ptr().add(at), d.length)
        };
        at += d.length;
    }
    s.inline_len = total as u16;
    s.sg = SgeList::default();
    s.flags.insert(SendFlags::INLINE);
}

unsafe extern "C" fn wr_set_inline_data(qp: *mut ibv_qp_ex, addr: *mut c_void, length: usize) {
    // SAFETY: the builders' contract.
    unsafe { build(qp, |_, b| set_inline(b, &[ibv_data_buf { addr, length }])) }
}

unsafe extern "C" fn wr_set_inline_data_list(
    qp: *mut ibv_qp_ex,
    num_buf: usize,
    buf_list: *const ibv_data_buf,
) {
    // SAFETY: the builders' contract.
    unsafe {
        build(qp, |_, b| {
            if num_buf == 0 {
                set_inline(b, &[]);
            } else if buf_list.is_null() {
                b.latch(libc::EINVAL);
            } else {
                // SAFETY: the application's list of `num_buf` entries.
                set_inline(b, std::slice::from_raw_parts(buf_list, num_buf));
            }
        })
    }
}

/// A typed builder as the structure's untyped pointer.
macro_rules! op {
    ($f:expr, $t:ty) => {
        // SAFETY: only the pointer's type changes; C calls it with the
        // signature of its `struct ibv_qp_ex` member, which `$t` is.
        Some(unsafe { std::mem::transmute::<$t, unsafe extern "C" fn()>($f) })
    };
}

/// Fills in the builders of `ex` for the operations in `ops` (the
/// setters and `start`/`complete`/`abort` always).
pub fn install(ex: &mut ibv_qp_ex, ops: u64) {
    type Q = *mut ibv_qp_ex;
    let has = |bit: u64| ops & bit != 0;
    ex.wr_start = op!(wr_start, unsafe extern "C" fn(Q));
    ex.wr_complete = op!(wr_complete, unsafe extern "C" fn(Q) -> c_int);
    ex.wr_abort = op!(wr_abort, unsafe extern "C" fn(Q));
    if has(WITH_SEND) {
        ex.wr_send = op!(wr_send, unsafe extern "C" fn(Q));
    }
    if has(WITH_SEND_WITH_IMM) {
        ex.wr_send_imm = op!(wr_send_imm, unsafe extern "C" fn(Q, u32));
    }
    if has(WITH_RDMA_WRITE) {
        ex.wr_rdma_write = op!(wr_rdma_write, unsafe extern "C" fn(Q, u32, u64));
    }
    if has(WITH_RDMA_WRITE_WITH_IMM) {
        ex.wr_rdma_write_imm = op!(wr_rdma_write_imm, unsafe extern "C" fn(Q, u32, u64, u32));
    }
    if has(WITH_RDMA_READ) {
        ex.wr_rdma_read = op!(wr_rdma_read, unsafe extern "C" fn(Q, u32, u64));
    }
    if has(WITH_ATOMIC_CMP_AND_SWP) {
        ex.wr_atomic_cmp_swp = op!(wr_atomic_cmp_swp, unsafe extern "C" fn(Q, u32, u64, u64, u64));
    }
    if has(WITH_ATOMIC_FETCH_AND_ADD) {
        ex.wr_atomic_fetch_add = op!(wr_atomic_fetch_add, unsafe extern "C" fn(Q, u32, u64, u64));
    }
    ex.wr_set_ud_addr = op!(wr_set_ud_addr, unsafe extern "C" fn(Q, *mut c_void, u32, u32));
    ex.wr_set_sge = op!(wr_set_sge, unsafe extern "C" fn(Q, u32, u64, u32));
    ex.wr_set_sge_list = op!(wr_set_sge_list, unsafe extern "C" fn(Q, usize, *const ibv_sge));
    ex.wr_set_inline_data = op!(wr_set_inline_data, unsafe extern "C" fn(Q, *mut c_void, usize));
    ex.wr_set_inline_data_list =
        op!(wr_set_inline_data_list, unsafe extern "C" fn(Q, usize, *const ibv_data_buf));
}

/// `verbs_context.create_qp_ex`, behind `ibv_create_qp_ex`: the PD and
/// the send operations are the extensions vRDMA honours.
pub unsafe extern "C" fn create_qp_ex(_ctx: *mut ibv_context, attr: *mut ibv_qp_init_attr_ex) -> *mut ibv_qp {
    const W: &str = "ibv_create_qp_ex";
    ret_ptr(W, || {
        non_null(W, attr, "qp_init_attr_ex")?;
        // SAFETY: a valid ibv_qp_init_attr_ex (the verb's contract).
        let a = unsafe { &mut *attr };
        let known = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_CREATE_FLAGS | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
        if a.comp_mask & !known != 0 {
            return Err(refuse(W, "unsupported comp_mask bits", libc::EOPNOTSUPP));
        }
        if a.comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS != 0 && a.create_flags != 0 {
            return Err(refuse(W, "create flags", libc::EOPNOTSUPP));
        }
        if a.comp_mask & IBV_QP_INIT_ATTR_PD == 0 || a.pd.is_null() {
            return Err(refuse(W, "no PD", libc::EINVAL));
        }
        let ops = if a.comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS != 0 {
            if a.send_ops_flags & !SUPPORTED_SEND_OPS != 0 {
                return Err(refuse(W, "unsupported send_ops_flags", libc::EOPNOTSUPP));
            }
            Some(a.send_ops_flags)
        } else {
            None
        };
        let mut init = ibv_qp_init_attr {
            qp_context: a.qp_context,
            send_cq: a.send_cq,
            recv_cq: a.recv_cq,
            srq: a.srq,
            cap: a.cap,
            qp_type: a.qp_type,
            sq_sig_all: a.sq_sig_all,
        };
        // SAFETY: the PD and the objects named are the application's.
        let qp = unsafe { crate::qp::create(W, a.pd, &mut init, ops)? };
        a.cap = init.cap;
        Ok(qp)
    })
}
