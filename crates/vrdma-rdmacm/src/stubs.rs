//! The exports that are not implemented yet: each fails with `ENOSYS`
//! and says so on stderr once, naming itself, so that a program that
//! reaches one is told what it lacks instead of failing obscurely.
//!
//! They take no arguments here: on x86-64 a C caller's arguments sit in
//! registers the callee may ignore, and every one of them returns an
//! integer (an int, `ssize_t`, `off_t` or `size_t`: -1 in the whole
//! register is -1 in each of those) or nothing.

use std::sync::atomic::{AtomicBool, Ordering};

fn fail(name: &str, told: &AtomicBool) {
    if !told.swap(true, Ordering::Relaxed) {
        eprintln!("vrdma librdmacm: {name} is not implemented yet; failing with ENOSYS");
    }
    // SAFETY: errno is this thread's.
    unsafe { *libc::__errno_location() = libc::ENOSYS };
}

macro_rules! stubs {
    ($($name:ident),* $(,)?) => {
        $(
            pub unsafe extern "C" fn $name() -> isize {
                static TOLD: AtomicBool = AtomicBool::new(false);
                fail(stringify!($name), &TOLD);
                -1
            }
        )*
    };
}

stubs!(
    rdma_notify,
    rdma_join_multicast,
    rdma_leave_multicast,
    rdma_join_multicast_ex,
    rdma_create_srq,
    rdma_create_srq_ex,
    rdma_get_remote_ece,
    rdma_set_local_ece,
);

/// `void rdma_destroy_srq(struct rdma_cm_id *)`: no SRQ can exist.
pub unsafe extern "C" fn rdma_destroy_srq() {
    static TOLD: AtomicBool = AtomicBool::new(false);
    fail("rdma_destroy_srq", &TOLD);
}
