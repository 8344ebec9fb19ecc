//! rdma-core's direct placement (`riomap`, `riounmap`, `riowrite`: a
//! peer's writes into a buffer this end mapped, which the program watches
//! rather than reads through a call), on the carrier's connections: the
//! carrier registers the buffer and puts its entry in the peer's table,
//! in order with the stream, and a `riowrite` is an RDMA write on the
//! stream's QP, so that it lands before any byte sent after it
//! (`docs/sockets.md`, "rsocket"). Here the arguments are checked as
//! rdma-core checks them; without a carrier (plain kernel sockets) each
//! call fails with `EOPNOTSUPP`.

use libc::{c_int, c_void, off_t, size_t};

use super::{carrier, fail};

fn no_carrier(what: &str) -> c_int {
    fail(what, libc::EOPNOTSUPP, "rsockets are plain kernel sockets here (no carrier): no direct placement")
}

/// `off_t riomap(int socket, void *buf, size_t len, int prot, int flags,
/// off_t offset)`: maps `buf` for the peer's `riowrite`s at `offset` (-1:
/// the buffer's address) and returns the offset. Only `PROT_WRITE`
/// (`EINVAL` otherwise, also for `PROT_NONE`, which rdma-core takes for a
/// mapping no one can use); `flags` is ignored, as in rdma-core.
pub unsafe extern "C" fn riomap(
    fd: c_int,
    buf: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    offset: off_t,
) -> off_t {
    if prot != libc::PROT_WRITE {
        return fail("riomap", libc::EINVAL, "only PROT_WRITE mappings") as off_t;
    }
    if buf.is_null() || len == 0 {
        return fail("riomap", libc::EINVAL, "a null or empty buffer") as off_t;
    }
    if !carrier::loaded() {
        return no_carrier("riomap") as off_t;
    }
    // SAFETY: the carrier's riomap with the caller's buffer of `len` bytes,
    // which rsocket's contract keeps valid until riounmap or the close.
    unsafe { carrier::vrdma_sockets_riomap(fd, buf, len, prot, flags, offset) }
}

/// `int riounmap(int socket, void *buf, size_t len)`: the mapping of
/// exactly `buf` and `len` (`EINVAL` for any other).
pub unsafe extern "C" fn riounmap(fd: c_int, buf: *mut c_void, len: size_t) -> c_int {
    if !carrier::loaded() {
        return no_carrier("riounmap");
    }
    // SAFETY: the carrier's riounmap; the pointer is only compared.
    unsafe { carrier::vrdma_sockets_riounmap(fd, buf, len) }
}

/// `size_t riowrite(int socket, const void *buf, size_t count, off_t
/// offset, int flags)`: the bytes written into the peer's mapping that
/// holds `offset` (short where it ends first), or `(size_t) -1` with
/// `errno`: `EINVAL` where no mapping of the peer holds `offset` (where
/// rdma-core returns 0, which a caller's loop takes as progress for
/// ever), `EFAULT` for a null buffer. `flags` is ignored: a write waits
/// only for its own completion, never for the reader.
pub unsafe extern "C" fn riowrite(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    offset: off_t,
    flags: c_int,
) -> size_t {
    if buf.is_null() && n > 0 {
        return fail("riowrite", libc::EFAULT, "a null buffer") as size_t;
    }
    if !carrier::loaded() {
        return no_carrier("riowrite") as size_t;
    }
    // SAFETY: the carrier's riowrite with the caller's buffer of `n` bytes.
    unsafe { carrier::vrdma_sockets_riowrite(fd, buf, n, offset, flags) as size_t }
}
