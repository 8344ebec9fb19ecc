//! The extended CQ: `ibv_create_cq_ex` (the context's `create_cq_ex`
//! operation) and the polling operations of `struct ibv_cq_ex`
//! (`ibv_start_poll`, `ibv_next_poll`, `ibv_end_poll` and the
//! `ibv_wc_read_*` accessors), which applications reach through the
//! structure's function pointers.
//!
//! `start_poll` and `next_poll` take one completion from the ring
//! ([`vrdma::CompletionQueue::poll`], no system call, no allocation) into
//! the CQ's current entry and publish its `status` and `wr_id` in the
//! structure; the `read_*` operations read the current entry. Only the
//! accessors of the fields asked for in `wc_flags` (`IBV_WC_EX_WITH_*`)
//! are set, besides `read_opcode`, `read_vendor_err` and `read_wc_flags`,
//! which always are; the others are NULL, as with rdma-core's providers.
//!
//! As rdma-core does, `start_poll` locks the CQ until `end_poll` (or until
//! it fails, `ENOENT` for an empty CQ), unless the CQ was created with
//! `IBV_CREATE_CQ_ATTR_SINGLE_THREADED`: the lock is a flag in the CQ
//! object, spun on.

use std::cell::UnsafeCell;
use std::ffi::{c_int, c_void};
use std::ptr::addr_of;
use std::sync::atomic::{AtomicBool, Ordering};

use vrdma::Cqe;

use crate::abi::*;
use crate::cq::Cq;
use crate::util::*;

/// `IBV_WC_EX_WITH_*` (`enum ibv_create_cq_wc_flags`).
const WITH_BYTE_LEN: u64 = 1 << 0;
const WITH_IMM: u64 = 1 << 1;
const WITH_QP_NUM: u64 = 1 << 2;
const WITH_SRC_QP: u64 = 1 << 3;
const WITH_SLID: u64 = 1 << 4;
const WITH_SL: u64 = 1 << 5;
const WITH_DLID_PATH_BITS: u64 = 1 << 6;
/// The fields vRDMA provides (rdma-core's `IBV_WC_STANDARD_FLAGS`).
const SUPPORTED_WC_FLAGS: u64 =
    WITH_BYTE_LEN | WITH_IMM | WITH_QP_NUM | WITH_SRC_QP | WITH_SLID | WITH_SL | WITH_DLID_PATH_BITS;

/// `IBV_CQ_INIT_ATTR_MASK_FLAGS`, `IBV_CQ_INIT_ATTR_MASK_PD`.
const MASK_FLAGS: u32 = 1 << 0;
/// `IBV_CREATE_CQ_ATTR_SINGLE_THREADED`.
const SINGLE_THREADED: u32 = 1 << 0;

/// `struct ibv_cq_init_attr_ex`.
#[repr(C)]
pub struct ibv_cq_init_attr_ex {
    pub cqe: u32,
    pub cq_context: *mut c_void,
    pub channel: *mut ibv_comp_channel,
    pub comp_vector: u32,
    pub wc_flags: u64,
    pub comp_mask: u32,
    pub flags: u32,
    pub parent_domain: *mut ibv_pd,
}

const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<ibv_cq_init_attr_ex>() == 56);
    assert!(offset_of!(ibv_cq_init_attr_ex, comp_vector) == 24);
    assert!(offset_of!(ibv_cq_init_attr_ex, wc_flags) == 32);
    assert!(offset_of!(ibv_cq_init_attr_ex, comp_mask) == 40);
    assert!(offset_of!(ibv_cq_init_attr_ex, parent_domain) == 48);
};

/// `struct ibv_poll_cq_attr`.
#[repr(C)]
pub struct ibv_poll_cq_attr {
    pub comp_mask: u32,
}

/// The current entry of an extended CQ and its polling lock.
pub struct PollState {
    cur: UnsafeCell<Cqe>,
    busy: AtomicBool,
    single: bool,
}

impl PollState {
    pub fn new(single_threaded: bool) -> Self {
        PollState {
            cur: UnsafeCell::new(Cqe::default()),
            busy: AtomicBool::new(false),
            single: single_threaded,
        }
    }

    fn lock(&self) {
        if self.single {
            return;
        }
        while self.busy.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            std::hint::spin_loop();
        }
    }

    fn unlock(&self) {
        if !self.single {
            self.busy.store(false, Ordering::Release);
        }
    }
}

/// The Rust-owned parts of the CQ (the application's `ibv_cq_ex` is not
/// borrowed: `take` writes its `status` and `wr_id`).
///
/// # Safety
/// `cq` must be a live CQ from `create_cq_ex`.
unsafe fn parts<'a>(cq: *mut ibv_cq_ex) -> (&'a vrdma::CompletionQueue, &'a PollState) {
    let c = cq.cast::<Cq>();
    // SAFETY: per the contract.
    unsafe { (&*addr_of!((*c).inner), &*addr_of!((*c).poll)) }
}

/// The current entry.
///
/// # Safety
/// As [`cq_of`], between a successful `start_poll` and `end_poll`.
unsafe fn cur<'a>(cq: *mut ibv_cq_ex) -> &'a Cqe {
    // SAFETY: per the contract; written only by start/next_poll, by the
    // thread that holds the polling lock.
    unsafe { &*parts(cq).1.cur.get() }
}

/// Takes one completion into the current entry: 0, `ENOENT` or an errno.
///
/// # Safety
/// As [`cur`], the polling lock held.
unsafe fn take(cq: *mut ibv_cq_ex) -> c_int {
    // SAFETY: per the contract.
    let (inner, poll) = unsafe { parts(cq) };
    match inner.poll_one() {
        Ok(Some(e)) => {
            // SAFETY: per the contract; the application's fields are
            // written through the raw pointer.
            unsafe {
                (*cq).status = u32::from(e.status.raw());
                (*cq).wr_id = e.wr_id;
                *poll.cur.get() = e;
            }
            0
        }
        Ok(None) => libc::ENOENT,
        Err(e) => fail("ibv_start_poll", &e),
    }
}

unsafe extern "C" fn start_poll(cq: *mut ibv_cq_ex, attr: *mut ibv_poll_cq_attr) -> c_int {
    guard("ibv_start_poll", libc::EIO, || {
        if cq.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: a live CQ (the verb's contract); `attr` is NULL or valid.
        unsafe {
            if !attr.is_null() && (*attr).comp_mask != 0 {
                return libc::EINVAL;
            }
            let poll = parts(cq).1;
            poll.lock();
            let r = take(cq);
            if r != 0 {
                poll.unlock();
            }
            r
        }
    })
}

unsafe extern "C" fn next_poll(cq: *mut ibv_cq_ex) -> c_int {
    // SAFETY: a live CQ, after a successful `start_poll` (the contract).
    guard("ibv_next_poll", libc::EIO, || unsafe { take(cq) })
}

unsafe extern "C" fn end_poll(cq: *mut ibv_cq_ex) {
    // SAFETY: a live CQ, after a successful `start_poll` (the contract).
    guard("ibv_end_poll", (), || unsafe { parts(cq) }.1.unlock())
}

/// Defines `read_*` accessors of the current entry.
macro_rules! readers {
    ($($name:ident -> $t:ty = |$c:ident| $e:expr;)*) => {
        $(
            unsafe extern "C" fn $name(cq: *mut ibv_cq_ex) -> $t {
                // SAFETY: a live CQ between a successful `start_poll` and
                // `end_poll` (the contract).
                let $c = unsafe { cur(cq) };
                $e
            }
        )*
    };
}

readers! {
    read_opcode -> u32 = |c| u32::from(c.opcode.raw());
    read_vendor_err -> u32 = |c| c.vendor_err;
    read_byte_len -> u32 = |c| c.byte_len;
    read_imm_data -> u32 = |c| c.imm_data;
    read_qp_num -> u32 = |c| c.qp_num;
    read_src_qp -> u32 = |c| c.src_qp;
    read_wc_flags -> u32 = |c| c.wc_flags.bits();
    read_slid -> u32 = |c| u32::from(c.slid);
    read_sl -> u8 = |c| c.sl;
    read_dlid_path_bits -> u8 = |c| c.dlid_path_bits;
}

/// A typed operation as the structure's untyped pointer.
macro_rules! op {
    ($f:expr, $t:ty) => {
        // SAFETY: only the pointer's type changes; C calls it with the
        // signature of its `struct ibv_cq_ex` member, which `$t` is.
        Some(unsafe { std::mem::transmute::<$t, unsafe extern "C" fn()>($f) })
    };
}

/// Fills in the polling operations of `ex` and the accessors of the
/// fields in `wc_flags`.
pub fn install(ex: &mut ibv_cq_ex, wc_flags: u64) {
    type C = *mut ibv_cq_ex;
    let has = |bit: u64| wc_flags & bit != 0;
    ex.start_poll = op!(start_poll, unsafe extern "C" fn(C, *mut ibv_poll_cq_attr) -> c_int);
    ex.next_poll = op!(next_poll, unsafe extern "C" fn(C) -> c_int);
    ex.end_poll = op!(end_poll, unsafe extern "C" fn(C));
    ex.read_opcode = op!(read_opcode, unsafe extern "C" fn(C) -> u32);
    ex.read_vendor_err = op!(read_vendor_err, unsafe extern "C" fn(C) -> u32);
    ex.read_wc_flags = op!(read_wc_flags, unsafe extern "C" fn(C) -> u32);
    if has(WITH_BYTE_LEN) {
        ex.read_byte_len = op!(read_byte_len, unsafe extern "C" fn(C) -> u32);
    }
    if has(WITH_IMM) {
        ex.read_imm_data = op!(read_imm_data, unsafe extern "C" fn(C) -> u32);
    }
    if has(WITH_QP_NUM) {
        ex.read_qp_num = op!(read_qp_num, unsafe extern "C" fn(C) -> u32);
    }
    if has(WITH_SRC_QP) {
        ex.read_src_qp = op!(read_src_qp, unsafe extern "C" fn(C) -> u32);
    }
    if has(WITH_SLID) {
        ex.read_slid = op!(read_slid, unsafe extern "C" fn(C) -> u32);
    }
    if has(WITH_SL) {
        ex.read_sl = op!(read_sl, unsafe extern "C" fn(C) -> u8);
    }
    if has(WITH_DLID_PATH_BITS) {
        ex.read_dlid_path_bits = op!(read_dlid_path_bits, unsafe extern "C" fn(C) -> u8);
    }
}

/// `verbs_context.create_cq_ex`, behind `ibv_create_cq_ex`.
pub unsafe extern "C" fn create_cq_ex(
    context: *mut ibv_context,
    attr: *mut ibv_cq_init_attr_ex,
) -> *mut ibv_cq_ex {
    const W: &str = "ibv_create_cq_ex";
    ret_ptr(W, || {
        non_null(W, attr, "cq_attr")?;
        // SAFETY: a valid ibv_cq_init_attr_ex (the verb's contract).
        let a = unsafe { &*attr };
        if a.comp_mask & !MASK_FLAGS != 0 {
            return Err(refuse(W, "a parent domain", libc::EOPNOTSUPP));
        }
        let flags = if a.comp_mask & MASK_FLAGS != 0 { a.flags } else { 0 };
        if flags & !SINGLE_THREADED != 0 {
            return Err(refuse(W, "unsupported flags", libc::EOPNOTSUPP));
        }
        if a.wc_flags & !SUPPORTED_WC_FLAGS != 0 {
            return Err(refuse(W, "unsupported wc_flags", libc::EOPNOTSUPP));
        }
        let cqe = c_int::try_from(a.cqe).map_err(|_| refuse(W, "cqe too large", libc::EINVAL))?;
        let vector =
            c_int::try_from(a.comp_vector).map_err(|_| refuse(W, "bad comp_vector", libc::EINVAL))?;
        let ex = Some((a.wc_flags, flags & SINGLE_THREADED != 0));
        // SAFETY: the context and channel are the application's live objects.
        let cq = unsafe { crate::cq::create(W, context, cqe, a.cq_context, a.channel, vector, ex)? };
        Ok(cq.cast())
    })
}
