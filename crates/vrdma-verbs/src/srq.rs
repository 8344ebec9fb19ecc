//! Shared receive queues, with the `post_srq_recv` operation of the
//! context's ops table (the same conversion loop as `post_recv`, into
//! [`vrdma::SharedReceiveQueue::post_recv`]).

use std::ffi::c_int;
use std::ptr::{addr_of, addr_of_mut};
use std::sync::atomic::{AtomicU32, Ordering};

use vrdma::SrqAttr;

use crate::abi::*;
use crate::context::Ctx;
use crate::mem::Pd;
use crate::qp::{post_chain, recv_wr};
use crate::util::*;

#[repr(C)]
pub struct Srq {
    pub srq: ibv_srq,
    pub inner: vrdma::SharedReceiveQueue,
    /// Async events handed out by `ibv_get_async_event`.
    pub events_reported: AtomicU32,
}

// The application's pointer is the object's address.
const _: () = assert!(std::mem::offset_of!(Srq, srq) == 0);

impl Srq {
    /// # Safety
    /// `p` must be NULL or a live SRQ from `ibv_create_srq`.
    pub unsafe fn get<'a>(what: &str, p: *mut ibv_srq) -> Res<&'a vrdma::SharedReceiveQueue> {
        non_null(what, p, "the SRQ")?;
        // SAFETY: `ibv_srq` starts the boxed `Srq`; only the Rust-owned
        // field is borrowed.
        Ok(unsafe { &*addr_of!((*p.cast::<Srq>()).inner) })
    }
}

/// `ibv_create_srq`. Writes the granted `max_wr` and `max_sge` back into
/// `srq_init_attr->attr`, as the kernel path of rdma-core does.
pub unsafe extern "C" fn ibv_create_srq(
    pd: *mut ibv_pd,
    srq_init_attr: *mut ibv_srq_init_attr,
) -> *mut ibv_srq {
    const W: &str = "ibv_create_srq";
    ret_ptr(W, || {
        // SAFETY: a live PD (the verb's contract).
        let p = unsafe { Pd::get(W, pd)? };
        non_null(W, srq_init_attr, "srq_init_attr")?;
        // SAFETY: a valid ibv_srq_init_attr.
        let a = unsafe { &mut *srq_init_attr };
        let want = SrqAttr { max_wr: a.attr.max_wr, max_sge: a.attr.max_sge, srq_limit: a.attr.srq_limit };
        let inner = p.inner.create_srq(want).map_err(|e| fail_in_guest(W, p.inner.context(), &e))?;
        let got = inner.attr();
        a.attr.max_wr = got.max_wr;
        a.attr.max_sge = got.max_sge;
        let srqn = inner.srqn();
        let srq = ibv_srq {
            context: p.pd.context,
            srq_context: a.srq_context,
            pd,
            handle: srqn,
            // SAFETY: zeroed storage, initialised by pthread_*_init below.
            mutex: unsafe { std::mem::zeroed() },
            // SAFETY: as above.
            cond: unsafe { std::mem::zeroed() },
            events_completed: 0,
        };
        let s = Box::into_raw(Box::new(Srq { srq, inner, events_reported: AtomicU32::new(0) }));
        // SAFETY: `s` is a fresh box; its context is live.
        unsafe {
            init_mutex_cond(addr_of_mut!((*s).srq.mutex), addr_of_mut!((*s).srq.cond));
            Ctx::from_ptr(p.pd.context).registry().srqs.insert(srqn, s);
        }
        Ok(s.cast())
    })
}

/// `ibv_modify_srq`: `IBV_SRQ_LIMIT` arms the limit event. Resizing
/// (`IBV_SRQ_MAX_WR`) is refused with `EINVAL`, as by hardware without
/// `IBV_DEVICE_SRQ_RESIZE` (which vRDMA does not report).
pub unsafe extern "C" fn ibv_modify_srq(
    srq: *mut ibv_srq,
    srq_attr: *mut ibv_srq_attr,
    srq_attr_mask: c_int,
) -> c_int {
    const W: &str = "ibv_modify_srq";
    ret_code(W, || {
        // SAFETY: a live SRQ (the verb's contract).
        let inner = unsafe { Srq::get(W, srq)? };
        non_null(W, srq_attr, "srq_attr")?;
        if srq_attr_mask & !(IBV_SRQ_MAX_WR | IBV_SRQ_LIMIT) != 0 || srq_attr_mask & IBV_SRQ_MAX_WR != 0 {
            return Err(refuse(W, "only IBV_SRQ_LIMIT can be modified", libc::EINVAL));
        }
        if srq_attr_mask & IBV_SRQ_LIMIT != 0 {
            // SAFETY: a valid ibv_srq_attr.
            let limit = unsafe { (*srq_attr).srq_limit };
            inner.set_limit(limit).map_err(|e| fail(W, &e))?;
        }
        Ok(())
    })
}

/// `ibv_query_srq`.
pub unsafe extern "C" fn ibv_query_srq(srq: *mut ibv_srq, srq_attr: *mut ibv_srq_attr) -> c_int {
    const W: &str = "ibv_query_srq";
    ret_code(W, || {
        // SAFETY: a live SRQ (the verb's contract).
        let inner = unsafe { Srq::get(W, srq)? };
        non_null(W, srq_attr, "srq_attr")?;
        let a = inner.query().map_err(|e| fail(W, &e))?;
        // SAFETY: a valid output structure.
        unsafe {
            srq_attr.write(ibv_srq_attr { max_wr: a.max_wr, max_sge: a.max_sge, srq_limit: a.srq_limit })
        };
        Ok(())
    })
}

/// `ibv_destroy_srq`: `EBUSY` while QPs use it; waits until the
/// application acknowledged every async event it took for it.
pub unsafe extern "C" fn ibv_destroy_srq(srq: *mut ibv_srq) -> c_int {
    const W: &str = "ibv_destroy_srq";
    ret_code(W, || {
        // SAFETY: a live SRQ (the verb's contract).
        let inner = unsafe { Srq::get(W, srq)? };
        if vrdma::ffi::srq_handles(inner) > 1 {
            return Err(refuse(W, "QPs still use the SRQ", libc::EBUSY));
        }
        let s = srq.cast::<Srq>();
        // SAFETY: `s` is live until dropped at the end; its context is live.
        unsafe {
            Ctx::from_ptr((*srq).context).registry().srqs.remove(&inner.srqn());
            wait_acked(
                addr_of_mut!((*srq).mutex),
                addr_of_mut!((*srq).cond),
                &[(addr_of!((*srq).events_completed), (*s).events_reported.load(Ordering::Relaxed))],
            );
            destroy_mutex_cond(addr_of_mut!((*srq).mutex), addr_of_mut!((*srq).cond));
            drop(Box::from_raw(s));
        }
        Ok(())
    })
}

/// Acknowledges one async event of `srq` (from `ibv_ack_async_event`).
///
/// # Safety
/// `srq` must be NULL or a live SRQ.
pub unsafe fn ack_async(srq: *mut ibv_srq) {
    if srq.is_null() {
        return;
    }
    // SAFETY: per the contract; written under the SRQ's mutex.
    unsafe {
        let _lock = PthreadLock::new(addr_of_mut!((*srq).mutex));
        (*srq).events_completed = (*srq).events_completed.wrapping_add(1);
        libc::pthread_cond_signal(addr_of_mut!((*srq).cond));
    }
}

/// `ops.post_srq_recv`.
pub unsafe extern "C" fn post_srq_recv(
    srq: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    guard("ibv_post_srq_recv", libc::EIO, || {
        if srq.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: a live SRQ (the verb's contract).
        let inner = unsafe { &*addr_of!((*srq.cast::<Srq>()).inner) };
        // SAFETY: the application's chain (the verb's contract).
        unsafe {
            post_chain(wr, bad_wr, |w| w.next, |w, out| recv_wr(w, out), |batch| inner.post_recv(batch))
        }
    })
}
