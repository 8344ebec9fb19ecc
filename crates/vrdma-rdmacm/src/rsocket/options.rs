//! `rsetsockopt` / `rgetsockopt`: rsocket's own `SOL_RDMA` level is
//! accepted here and has no effect (the carrier sizes its own queues and
//! rings; `rgetsockopt` gives rdma-core 44's defaults, and for
//! `RDMA_IOMAPSIZE` the mappings a connection holds); every other level
//! is the carrier's (which keeps `TCP_NODELAY` and `TCP_CORK` of a carried
//! connection) and the kernel's.

use libc::{c_int, c_void, socklen_t};

use super::{carrier, fail};

/// rsocket.h's option level for its RDMA options, and the options.
const SOL_RDMA: c_int = 0x10000;
const RDMA_SQSIZE: c_int = 0;
const RDMA_RQSIZE: c_int = 1;
const RDMA_INLINE: c_int = 2;
const RDMA_IOMAPSIZE: c_int = 3;
const RDMA_ROUTE: c_int = 4;

/// The direct-placement mappings a carried connection holds at once
/// (`riomap`), whatever `RDMA_IOMAPSIZE` was set to: the carrier's table
/// (`vrdma_sockets::link::iomap::SLOTS`; `tests/c/riomap_check.c` checks
/// that this reads what the table takes).
const IOMAP_SLOTS: u32 = 16;

/// What an integer `SOL_RDMA` option reads: rdma-core 44's defaults,
/// except the mappings, which are what a connection really holds (rdma-core
/// reads 0 there, and maps nothing until a program raises it).
fn rdma_default(name: c_int) -> Option<u32> {
    match name {
        RDMA_SQSIZE | RDMA_RQSIZE => Some(384),
        RDMA_INLINE => Some(64),
        RDMA_IOMAPSIZE => Some(IOMAP_SLOTS),
        _ => None,
    }
}

/// Whether `fd` is a socket (else the kernel's errno).
fn is_socket(fd: c_int) -> Result<(), c_int> {
    let mut ty: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as socklen_t;
    // SAFETY: getsockopt(2) into our int.
    let r = unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_TYPE, (&raw mut ty).cast(), &mut len) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EBADF))
    }
}

pub unsafe extern "C" fn rsetsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    if level != SOL_RDMA {
        // SAFETY: the carrier's setsockopt (it keeps TCP_NODELAY's and
        // TCP_CORK's values of a carried connection); the kernel checks
        // the rest.
        return unsafe { carrier::setsockopt(fd, level, name, val, len) };
    }
    if let Err(e) = is_socket(fd) {
        return fail("rsetsockopt", e, "not a socket");
    }
    match name {
        RDMA_ROUTE => 0,
        _ if rdma_default(name).is_some() => {
            if val.is_null() || (len as usize) < std::mem::size_of::<u32>() {
                return fail("rsetsockopt", libc::EINVAL, "SOL_RDMA takes an integer");
            }
            // Accepted: the carrier sizes its own queues and rings.
            0
        }
        _ => fail("rsetsockopt", libc::ENOPROTOOPT, "unknown SOL_RDMA option"),
    }
}

pub unsafe extern "C" fn rgetsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    if level != SOL_RDMA {
        // SAFETY: the carrier's getsockopt; the kernel checks the pointers.
        return unsafe { carrier::getsockopt(fd, level, name, val, len) };
    }
    if let Err(e) = is_socket(fd) {
        return fail("rgetsockopt", e, "not a socket");
    }
    let Some(v) = rdma_default(name) else {
        return fail("rgetsockopt", libc::ENOPROTOOPT, "no such SOL_RDMA option to read");
    };
    if val.is_null() || len.is_null() {
        return fail("rgetsockopt", libc::EFAULT, "a null value or length");
    }
    // SAFETY: the caller's length, not null.
    let room = unsafe { *len } as usize;
    if room < std::mem::size_of::<u32>() {
        return fail("rgetsockopt", libc::EINVAL, "room for less than an integer");
    }
    // SAFETY: `val` has `room` (at least 4) bytes; unaligned is allowed.
    unsafe {
        val.cast::<u32>().write_unaligned(v);
        *len = std::mem::size_of::<u32>() as socklen_t;
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errno() -> c_int {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }

    #[test]
    fn sol_rdma_options_are_taken_and_read_back_as_rdma_cores_defaults_and_the_mappings_held() {
        // SAFETY: a socket of this test, closed at the end; our buffers.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
            assert!(fd >= 0);
            let v: u32 = 1000;
            let p = (&raw const v).cast();
            assert_eq!(rsetsockopt(fd, SOL_RDMA, RDMA_SQSIZE, p, 4), 0);
            assert_eq!(rsetsockopt(fd, SOL_RDMA, RDMA_SQSIZE, p, 2), -1);
            assert_eq!(errno(), libc::EINVAL);
            assert_eq!(rsetsockopt(fd, SOL_RDMA, 42, p, 4), -1);
            assert_eq!(errno(), libc::ENOPROTOOPT);
            for (name, want) in
                [(RDMA_SQSIZE, 384), (RDMA_RQSIZE, 384), (RDMA_INLINE, 64), (RDMA_IOMAPSIZE, 16)]
            {
                let mut got: u32 = 7;
                let mut len: socklen_t = 8;
                assert_eq!(rgetsockopt(fd, SOL_RDMA, name, (&raw mut got).cast(), &mut len), 0);
                assert_eq!((got, len), (want, 4));
            }
            let mut got: u32 = 0;
            let mut len: socklen_t = 2;
            assert_eq!(rgetsockopt(fd, SOL_RDMA, RDMA_INLINE, (&raw mut got).cast(), &mut len), -1);
            assert_eq!(errno(), libc::EINVAL);
            assert_eq!(rgetsockopt(fd, SOL_RDMA, RDMA_ROUTE, (&raw mut got).cast(), &mut len), -1);
            assert_eq!(errno(), libc::ENOPROTOOPT);
            libc::close(fd);
            // A closed descriptor is the kernel's EBADF.
            assert_eq!(rsetsockopt(fd, SOL_RDMA, RDMA_SQSIZE, p, 4), -1);
            assert_eq!(errno(), libc::EBADF);
        }
    }
}
