//! rdma-core's direct placement (`riomap`, `riounmap`, `riowrite`: a
//! peer's writes into a buffer this end mapped, which the receiver does
//! not read through a call) is not carried: it would need the buffer
//! registered and its key sent beside the carrier's rings, and
//! `riowrite`'s bytes ordered in the stream. Each fails with `ENOSYS` and
//! says so once on stderr, so `riostream` stops at its `riomap`.

use std::sync::atomic::{AtomicBool, Ordering};

use libc::{c_int, c_void, off_t, size_t};

use super::set_errno;

fn no_iomap(name: &str, told: &AtomicBool) {
    if !told.swap(true, Ordering::Relaxed) {
        eprintln!(
            "vrdma librdmacm: {name} is not implemented: vRDMA's rsockets carry streams, not writes into a peer's \
             mapped buffer; failing with ENOSYS"
        );
    }
    set_errno(libc::ENOSYS);
}

pub unsafe extern "C" fn riomap(
    _fd: c_int,
    _buf: *mut c_void,
    _len: size_t,
    _prot: c_int,
    _flags: c_int,
    _offset: off_t,
) -> off_t {
    static TOLD: AtomicBool = AtomicBool::new(false);
    no_iomap("riomap", &TOLD);
    -1
}

pub unsafe extern "C" fn riounmap(_fd: c_int, _buf: *mut c_void, _len: size_t) -> c_int {
    static TOLD: AtomicBool = AtomicBool::new(false);
    no_iomap("riounmap", &TOLD);
    -1
}

pub unsafe extern "C" fn riowrite(
    _fd: c_int,
    _buf: *const c_void,
    _n: size_t,
    _offset: off_t,
    _flags: c_int,
) -> size_t {
    static TOLD: AtomicBool = AtomicBool::new(false);
    no_iomap("riowrite", &TOLD);
    size_t::MAX
}
