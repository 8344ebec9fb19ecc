//! Protection domains, memory regions and the fork-safety calls.
//!
//! `ibv_reg_mr` registers memory the program allocated itself, so it goes
//! through [`vrdma::ProtectionDomain::register_raw`], which re-backs the
//! pages with a shared memfd that the daemon maps (see its documentation
//! for what that means for neighbouring bytes, stacks and fork). The
//! region's key is both `lkey` and `rkey`.
//!
//! Fork: rdma-core's `ibv_fork_init` marks registered ranges
//! `MADV_DONTFORK` so that copy-on-write after `fork()` cannot move pages
//! under the device; on current kernels it needs nothing (the child gets
//! copies, `IBV_FORK_UNNEEDED`). Here the registered pages are `MAP_SHARED`
//! memfd mappings, which `fork()` never moves, so the parent's
//! registrations keep working, and the library gives the child private
//! copies of them as it starts (`vrdma`'s re-backing), so that it shares
//! nothing with the parent: `IBV_FORK_UNNEEDED` as well. `ibv_fork_init`,
//! `ibv_dontfork_range` and `ibv_dofork_range` succeed without doing
//! anything.

use std::ffi::{c_int, c_void};

use vrdma::AccessFlags;

use crate::abi::*;
use crate::context::Ctx;
use crate::util::*;

#[repr(C)]
pub struct Pd {
    pub pd: ibv_pd,
    pub inner: vrdma::ProtectionDomain,
}

impl Pd {
    /// # Safety
    /// `p` must be NULL or a live PD from `ibv_alloc_pd`.
    pub unsafe fn get<'a>(what: &str, p: *mut ibv_pd) -> Res<&'a Pd> {
        non_null(what, p, "the protection domain")?;
        // SAFETY: `ibv_pd` is the first member of the boxed `Pd`.
        Ok(unsafe { &*p.cast::<Pd>() })
    }
}

#[repr(C)]
pub struct Mr {
    pub mr: ibv_mr,
    pub inner: vrdma::MemoryRegion,
}

// The application's pointers are the objects' addresses.
const _: () = assert!(std::mem::offset_of!(Pd, pd) == 0 && std::mem::offset_of!(Mr, mr) == 0);

/// `ibv_alloc_pd`.
pub unsafe extern "C" fn ibv_alloc_pd(context: *mut ibv_context) -> *mut ibv_pd {
    const W: &str = "ibv_alloc_pd";
    ret_ptr(W, || {
        // SAFETY: a live context (the verb's contract).
        let ctx = unsafe { Ctx::get(W, context)? };
        let inner = ctx.inner.alloc_pd().map_err(|e| fail(W, &e))?;
        let pd = ibv_pd { context: ctx.as_ptr(), handle: inner.pd_id() };
        Ok(Box::into_raw(Box::new(Pd { pd, inner })).cast())
    })
}

/// `ibv_dealloc_pd`: `EBUSY` while memory regions, QPs or SRQs of the PD
/// exist (they hold the PD, as the kernel's reference counts do).
pub unsafe extern "C" fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int {
    const W: &str = "ibv_dealloc_pd";
    ret_code(W, || {
        // SAFETY: a live PD (the verb's contract).
        let p = unsafe { Pd::get(W, pd)? };
        if vrdma::ffi::pd_handles(&p.inner) > 1 {
            return Err(refuse(W, "the PD still has objects", libc::EBUSY));
        }
        // SAFETY: the box made by ibv_alloc_pd, freed once.
        drop(unsafe { Box::from_raw(pd.cast::<Pd>()) });
        Ok(())
    })
}

/// Registers `addr..addr + length` with verbs access flags `access`.
fn reg_mr(
    what: &str,
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: u32,
) -> Res<*mut ibv_mr> {
    // SAFETY: a live PD (the verb's contract).
    let p = unsafe { Pd::get(what, pd)? };
    if iova != addr as u64 {
        // Remote peers would address the region by `iova`; vRDMA regions
        // are addressed by their virtual address.
        return Err(refuse(what, "an iova other than the address", libc::EOPNOTSUPP));
    }
    // Flags of the optional range may be ignored by a device that does not
    // know them (rdma-core clears them likewise).
    let access = AccessFlags::from_bits(access & !IBV_ACCESS_OPTIONAL_RANGE)
        .ok_or_else(|| refuse(what, "unknown access flags", libc::EINVAL))?;
    // SAFETY: the application registers memory it owns and keeps mapped
    // until ibv_dereg_mr (the verbs contract, which is register_raw's).
    let inner = unsafe { p.inner.register_raw(addr.cast(), length, access) }
        .map_err(|e| fail_in_guest(what, p.inner.context(), &e))?;
    let key = inner.lkey();
    let mr = ibv_mr { context: p.pd.context, pd, addr, length, handle: key, lkey: key, rkey: inner.rkey() };
    Ok(Box::into_raw(Box::new(Mr { mr, inner })).cast())
}

/// `ibv_reg_mr@IBVERBS_1.1` (the `ibv_reg_mr` macro calls it, or
/// `ibv_reg_mr_iova2`).
pub unsafe extern "C" fn ibv_reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> *mut ibv_mr {
    ret_ptr("ibv_reg_mr", || reg_mr("ibv_reg_mr", pd, addr, length, addr as u64, access as u32))
}

/// `ibv_reg_mr_iova`: only `iova == addr` is supported (`EOPNOTSUPP`
/// otherwise).
pub unsafe extern "C" fn ibv_reg_mr_iova(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_int,
) -> *mut ibv_mr {
    ret_ptr("ibv_reg_mr_iova", || reg_mr("ibv_reg_mr_iova", pd, addr, length, iova, access as u32))
}

/// `ibv_reg_mr_iova2`: only `iova == addr` is supported (`EOPNOTSUPP`
/// otherwise).
pub unsafe extern "C" fn ibv_reg_mr_iova2(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: u32,
) -> *mut ibv_mr {
    ret_ptr("ibv_reg_mr_iova2", || reg_mr("ibv_reg_mr_iova2", pd, addr, length, iova, access))
}

/// `ibv_reg_dmabuf_mr`: vRDMA cannot reach device memory behind a dma-buf;
/// NULL with `errno = EOPNOTSUPP`.
pub unsafe extern "C" fn ibv_reg_dmabuf_mr(
    _pd: *mut ibv_pd,
    _offset: u64,
    _length: usize,
    _iova: u64,
    _fd: c_int,
    _access: c_int,
) -> *mut ibv_mr {
    ret_ptr("ibv_reg_dmabuf_mr", || Err(refuse("ibv_reg_dmabuf_mr", "dma-buf regions", libc::EOPNOTSUPP)))
}

/// `ibv_dereg_mr`: the daemon's access ends before this returns.
pub unsafe extern "C" fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int {
    const W: &str = "ibv_dereg_mr";
    ret_code(W, || {
        non_null(W, mr, "the memory region")?;
        // SAFETY: the box made by reg_mr, freed once (the verb's contract).
        drop(unsafe { Box::from_raw(mr.cast::<Mr>()) });
        Ok(())
    })
}

/// `ibv_fork_init`: 0 (see the module documentation).
pub unsafe extern "C" fn ibv_fork_init() -> c_int {
    0
}

/// `ibv_is_fork_initialized`: `IBV_FORK_UNNEEDED`, registrations survive
/// `fork()` in the parent (see the module documentation).
pub unsafe extern "C" fn ibv_is_fork_initialized() -> c_int {
    IBV_FORK_UNNEEDED
}

/// `ibv_dontfork_range`: 0; registered pages need no protection from
/// `fork()` (see the module documentation).
pub unsafe extern "C" fn ibv_dontfork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

/// `ibv_dofork_range`: 0, the counterpart of `ibv_dontfork_range`.
pub unsafe extern "C" fn ibv_dofork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}
