//! The exports that are not implemented yet: each fails with `ENOSYS`
//! and says so on stderr once, naming itself, so that a program that
//! reaches one is told what it lacks instead of failing obscurely.
//!
//! They take no arguments here: on x86-64 a C caller's arguments sit in
//! registers the callee may ignore, and every one of them returns an
//! integer (an int, `ssize_t`, `off_t` or `size_t`: -1 in the whole
//! register is -1 in each of those) or nothing.

use std::sync::atomic::{AtomicBool, Ordering};

fn fail(name: &str, told: &AtomicBool, rsocket: bool) {
    if !told.swap(true, Ordering::Relaxed) {
        if rsocket {
            eprintln!(
                "vrdma librdmacm: {name} is not implemented: the rsocket API comes with vRDMA's socket \
                 support (the sockets issue); failing with ENOSYS"
            );
        } else {
            eprintln!("vrdma librdmacm: {name} is not implemented yet; failing with ENOSYS");
        }
    }
    // SAFETY: errno is this thread's.
    unsafe { *libc::__errno_location() = libc::ENOSYS };
}

macro_rules! stubs {
    ($rsocket:literal: $($name:ident),* $(,)?) => {
        $(
            pub unsafe extern "C" fn $name() -> isize {
                static TOLD: AtomicBool = AtomicBool::new(false);
                fail(stringify!($name), &TOLD, $rsocket);
                -1
            }
        )*
    };
}

stubs!(false:
    rdma_notify,
    rdma_join_multicast,
    rdma_leave_multicast,
    rdma_join_multicast_ex,
    rdma_create_srq,
    rdma_create_srq_ex,
    rdma_get_remote_ece,
    rdma_set_local_ece,
);

stubs!(true:
    rsocket, rbind, rlisten, raccept, rconnect, rshutdown, rclose, rrecv, rrecvfrom, rrecvmsg, rsend,
    rsendto, rsendmsg, rread, rreadv, rwrite, rwritev, rpoll, rselect, rgetpeername, rgetsockname,
    rsetsockopt, rgetsockopt, rfcntl, riomap, riounmap, riowrite,
);

/// `void rdma_destroy_srq(struct rdma_cm_id *)`: no SRQ can exist.
pub unsafe extern "C" fn rdma_destroy_srq() {
    static TOLD: AtomicBool = AtomicBool::new(false);
    fail("rdma_destroy_srq", &TOLD, false);
}
