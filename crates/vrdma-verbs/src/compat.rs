//! Exports that programs' other libraries import from libibverbs but that
//! vRDMA cannot serve: Debian's `librdmacm.so.1` (DT_NEEDED by perftest
//! and qperf, linked `BIND_NOW`) imports the multicast verbs, so they must
//! resolve for those programs to load at all. (Its other imports, the
//! `ibv_copy_*_from_kern` converters and the address handles, are real:
//! module `ah`.)
//!
//! - Multicast groups are not part of vRDMA: `ibv_attach_mcast` and
//!   `ibv_detach_mcast` return `EOPNOTSUPP`.

use std::ffi::c_int;

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
