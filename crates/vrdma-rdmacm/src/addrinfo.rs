//! `rdma_getaddrinfo` / `rdma_freeaddrinfo`: names and services to the
//! addresses the connection manager takes, through the system resolver.
//!
//! vRDMA's device addresses are IPv4, so the resolver is asked for IPv4
//! unless the program's hints name a family (a passive lookup without a
//! node gives `0.0.0.0`, the wildcard the daemon binds, where glibc might
//! otherwise list `::` first). There are no IB routes to add: `ai_route`
//! and `ai_connect` stay empty, as rdma-core leaves them for IP port
//! spaces. Everything is allocated with `malloc`, one list entry only.

use std::ffi::{c_char, c_int};
use std::ptr::{self, null_mut};

use crate::abi::*;
use crate::{guard, Error};

/// A `malloc`ed copy of `len` bytes of the address at `sa`.
///
/// # Safety
/// `sa` points at `len` readable bytes.
unsafe fn copy_addr(sa: *const libc::sockaddr, len: libc::socklen_t) -> Result<*mut libc::sockaddr, Error> {
    // SAFETY: malloc of a positive size.
    let p = unsafe { libc::malloc(len.max(1) as usize) }.cast::<libc::sockaddr>();
    if p.is_null() {
        return Err(Error::sys(libc::ENOMEM, "out of memory"));
    }
    // SAFETY: `len` bytes each side, distinct allocations.
    unsafe { ptr::copy_nonoverlapping(sa.cast::<u8>(), p.cast::<u8>(), len as usize) };
    Ok(p)
}

pub unsafe extern "C" fn rdma_getaddrinfo(
    node: *const c_char,
    service: *const c_char,
    hints: *const rdma_addrinfo,
    res: *mut *mut rdma_addrinfo,
) -> c_int {
    guard("rdma_getaddrinfo", -1, || {
        if res.is_null() || (node.is_null() && service.is_null() && hints.is_null()) {
            return Err(Error::sys(libc::EINVAL, "nothing to look up"));
        }
        // SAFETY: the program's hints, if any.
        let h = unsafe { hints.as_ref() };
        let flags = h.map_or(0, |h| h.ai_flags);
        let ps = h.map_or(0, |h| h.ai_port_space);
        let ps = if ps == 0 { RDMA_PS_TCP as c_int } else { ps };
        let qp_type = match h.map_or(0, |h| h.ai_qp_type) {
            0 if ps == RDMA_PS_UDP as c_int => IBV_QPT_UD as c_int,
            0 => IBV_QPT_RC as c_int,
            t => t,
        };
        // SAFETY: calloc of one structure; all-zero is a valid value.
        let rai = unsafe { libc::calloc(1, std::mem::size_of::<rdma_addrinfo>()) }.cast::<rdma_addrinfo>();
        if rai.is_null() {
            return Err(Error::sys(libc::ENOMEM, "out of memory"));
        }
        let fill = || -> Result<c_int, Error> {
            // SAFETY: allocated above, ours until returned.
            let r = unsafe { &mut *rai };
            r.ai_flags = flags;
            r.ai_port_space = ps;
            r.ai_qp_type = qp_type;
            r.ai_family = h.map_or(0, |h| h.ai_family);
            if !node.is_null() || !service.is_null() {
                // SAFETY: all-zero is a valid `addrinfo` for hints.
                let mut ai_hints: libc::addrinfo = unsafe { std::mem::zeroed() };
                ai_hints.ai_family = if r.ai_family == 0 { libc::AF_INET } else { r.ai_family };
                ai_hints.ai_socktype = libc::SOCK_STREAM;
                if flags & RAI_PASSIVE != 0 {
                    ai_hints.ai_flags |= libc::AI_PASSIVE;
                }
                if flags & RAI_NUMERICHOST != 0 {
                    ai_hints.ai_flags |= libc::AI_NUMERICHOST;
                }
                let mut ai: *mut libc::addrinfo = null_mut();
                // SAFETY: C strings or NULL from the program; our hints.
                let rc = unsafe { libc::getaddrinfo(node, service, &ai_hints, &mut ai) };
                if rc != 0 {
                    // As rdma-core: the resolver's EAI_* code.
                    return Ok(rc);
                }
                // SAFETY: getaddrinfo succeeded: at least one entry.
                let a = unsafe { &*ai };
                r.ai_family = a.ai_family;
                // SAFETY: the entry's address of its length.
                let copied = unsafe { copy_addr(a.ai_addr, a.ai_addrlen) };
                // SAFETY: the list getaddrinfo returned.
                unsafe { libc::freeaddrinfo(ai) };
                let copied = copied?;
                if flags & RAI_PASSIVE != 0 {
                    r.ai_src_addr = copied;
                    r.ai_src_len = a_len(copied);
                } else {
                    r.ai_dst_addr = copied;
                    r.ai_dst_len = a_len(copied);
                }
            } else if let Some(h) = h.filter(|h| h.ai_dst_len > 0 && !h.ai_dst_addr.is_null()) {
                // SAFETY: the hints' address of its length.
                r.ai_dst_addr = unsafe { copy_addr(h.ai_dst_addr, h.ai_dst_len) }?;
                r.ai_dst_len = h.ai_dst_len;
            }
            if let Some(h) = h.filter(|h| h.ai_src_len > 0 && !h.ai_src_addr.is_null()) {
                if r.ai_src_addr.is_null() {
                    // SAFETY: the hints' address of its length.
                    r.ai_src_addr = unsafe { copy_addr(h.ai_src_addr, h.ai_src_len) }?;
                    r.ai_src_len = h.ai_src_len;
                }
            }
            Ok(0)
        };
        match fill() {
            Ok(0) => {
                // SAFETY: checked non-NULL above.
                unsafe { *res = rai };
                Ok(0)
            }
            other => {
                // SAFETY: ours, not handed out.
                unsafe { rdma_freeaddrinfo(rai) };
                other
            }
        }
    })
}

/// The length of a `sockaddr` by its family.
fn a_len(sa: *const libc::sockaddr) -> libc::socklen_t {
    // SAFETY: a copied address, at least its family long.
    let family = c_int::from(unsafe { (*sa).sa_family });
    let n = if family == libc::AF_INET6 {
        std::mem::size_of::<libc::sockaddr_in6>()
    } else {
        std::mem::size_of::<libc::sockaddr_in>()
    };
    n as libc::socklen_t
}

pub unsafe extern "C" fn rdma_freeaddrinfo(mut res: *mut rdma_addrinfo) {
    while !res.is_null() {
        // SAFETY: a list from rdma_getaddrinfo, each member malloc'ed or
        // NULL, freed once.
        unsafe {
            let r = &*res;
            let next = r.ai_next;
            libc::free(r.ai_src_addr.cast());
            libc::free(r.ai_dst_addr.cast());
            libc::free(r.ai_src_canonname.cast());
            libc::free(r.ai_dst_canonname.cast());
            libc::free(r.ai_route);
            libc::free(r.ai_connect);
            libc::free(res.cast());
            res = next;
        }
    }
}
