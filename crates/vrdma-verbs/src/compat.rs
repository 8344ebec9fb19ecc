//! Exports that programs' other libraries import from libibverbs but that
//! vRDMA cannot serve: Debian's `librdmacm.so.1` (DT_NEEDED by perftest
//! and qperf, linked `BIND_NOW`) imports the multicast verbs, so they must
//! resolve for those programs to load at all. (Its other imports, the
//! `ibv_copy_*_from_kern` converters and the address handles, are real:
//! module `ah`.)
//!
//! - Multicast groups are not part of vRDMA: `ibv_attach_mcast` and
//!   `ibv_detach_mcast` return `EOPNOTSUPP`.
//! - The rest of rdma-core's public exports, so that a program that links
//!   them (lazily or with `BIND_NOW`) loads and gets an error where it
//!   calls them, as from a device that lacks the feature: re-registering
//!   a region (`ibv_rereg_mr`: the region stays as it was), sharing
//!   objects between processes (`ibv_import_*`), and RoCE's Ethernet
//!   address resolution (the port's link layer is InfiniBand).

use std::ffi::{c_int, c_void};

use crate::abi::*;
use crate::util::*;

/// `ibv_attach_mcast`: `EOPNOTSUPP` (no multicast in vRDMA).
pub unsafe extern "C" fn ibv_attach_mcast(_qp: *mut ibv_qp, _gid: *const ibv_gid, _lid: u16) -> c_int {
    ret_code("ibv_attach_mcast", || Err(refuse("ibv_attach_mcast", "multicast", libc::EOPNOTSUPP)))
}

/// `ibv_detach_mcast`: `EOPNOTSUPP` (no multicast in vRDMA).
pub unsafe extern "C" fn ibv_detach_mcast(_qp: *mut ibv_qp, _gid: *const ibv_gid, _lid: u16) -> c_int {
    ret_code("ibv_detach_mcast", || Err(refuse("ibv_detach_mcast", "multicast", libc::EOPNOTSUPP)))
}

/// `IBV_REREG_MR_ERR_CMD`: the device refused; the region is unchanged.
const IBV_REREG_MR_ERR_CMD: c_int = -4;

/// `ibv_rereg_mr`: refused with `errno = EOPNOTSUPP`; the region keeps its
/// memory, keys and access (deregister and register again instead).
pub unsafe extern "C" fn ibv_rereg_mr(
    _mr: *mut ibv_mr,
    _flags: c_int,
    _pd: *mut ibv_pd,
    _addr: *mut c_void,
    _length: usize,
    _access: c_int,
) -> c_int {
    guard("ibv_rereg_mr", IBV_REREG_MR_ERR_CMD, || {
        set_errno(refuse(
            "ibv_rereg_mr",
            "re-registration (deregister and register again)",
            libc::EOPNOTSUPP,
        ));
        IBV_REREG_MR_ERR_CMD
    })
}

/// `ibv_import_device`: NULL with `errno = EOPNOTSUPP` (no sharing of a
/// context between processes).
pub unsafe extern "C" fn ibv_import_device(_cmd_fd: c_int) -> *mut ibv_context {
    ret_ptr("ibv_import_device", || Err(refuse("ibv_import_device", "importing objects", libc::EOPNOTSUPP)))
}

/// `ibv_import_pd`: NULL with `errno = EOPNOTSUPP`.
pub unsafe extern "C" fn ibv_import_pd(_context: *mut ibv_context, _handle: u32) -> *mut ibv_pd {
    ret_ptr("ibv_import_pd", || Err(refuse("ibv_import_pd", "importing objects", libc::EOPNOTSUPP)))
}

/// `ibv_import_mr`: NULL with `errno = EOPNOTSUPP`.
pub unsafe extern "C" fn ibv_import_mr(_pd: *mut ibv_pd, _handle: u32) -> *mut ibv_mr {
    ret_ptr("ibv_import_mr", || Err(refuse("ibv_import_mr", "importing objects", libc::EOPNOTSUPP)))
}

/// `ibv_import_dm`: NULL with `errno = EOPNOTSUPP` (no device memory).
pub unsafe extern "C" fn ibv_import_dm(_context: *mut ibv_context, _handle: u32) -> *mut c_void {
    ret_ptr("ibv_import_dm", || Err(refuse("ibv_import_dm", "device memory", libc::EOPNOTSUPP)))
}

/// `ibv_unimport_pd`: nothing to do (nothing can have been imported).
pub unsafe extern "C" fn ibv_unimport_pd(_pd: *mut ibv_pd) {}

/// `ibv_unimport_mr`: nothing to do.
pub unsafe extern "C" fn ibv_unimport_mr(_mr: *mut ibv_mr) {}

/// `ibv_unimport_dm`: nothing to do.
pub unsafe extern "C" fn ibv_unimport_dm(_dm: *mut c_void) {}

/// `ibv_resolve_eth_l2_from_gid`: `EOPNOTSUPP` (the port is InfiniBand, not
/// RoCE: there is no Ethernet address to resolve).
pub unsafe extern "C" fn ibv_resolve_eth_l2_from_gid(
    _context: *mut ibv_context,
    _attr: *mut ibv_ah_attr,
    _eth_mac: *mut u8,
    _vid: *mut u16,
) -> c_int {
    ret_code("ibv_resolve_eth_l2_from_gid", || {
        Err(refuse(
            "ibv_resolve_eth_l2_from_gid",
            "an InfiniBand port has no Ethernet address",
            libc::EOPNOTSUPP,
        ))
    })
}
