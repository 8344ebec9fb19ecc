//! What every exported function needs: panic containment, `errno`, the
//! return conventions of libibverbs, and an opt-in trace of failures.
//!
//! A panic must never unwind into C (that aborts the process, or worse),
//! so every `extern "C"` body runs inside [`guard`], which turns a panic
//! into the function's error value with `errno = EIO`. The workspace
//! profile keeps `panic = "unwind"`, which `catch_unwind` needs.
//!
//! libibverbs has three conventions, kept function by function:
//! - most `int` verbs return 0 or a positive errno value ([`ret_code`]);
//! - a few return -1 and set `errno` (`ibv_query_gid`, `ibv_get_cq_event`,
//!   `ibv_get_async_event`, ...: [`ret_minus1`]);
//! - constructors return a pointer, or NULL with `errno` set
//!   ([`ret_ptr`]).
//!
//! The shim also sets `errno` where the first convention does not require
//! it; C callers that print `errno` (with `perror`) then see the cause.

use std::ffi::{c_char, c_int};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

/// The outcome of a verb: `Err` carries a positive errno value.
pub type Res<T> = Result<T, c_int>;

/// Sets the calling thread's `errno`.
pub fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns a valid pointer to this thread's
    // errno for the life of the thread.
    unsafe { *libc::__errno_location() = e };
}

/// Whether `VRDMA_VERBS_DEBUG` asks for a line on stderr per failure.
pub fn debug_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("VRDMA_VERBS_DEBUG").is_some_and(|v| !v.is_empty() && v != "0"))
}

/// Logs why a verb failed (with `VRDMA_VERBS_DEBUG=1`) and returns its errno.
pub fn fail(what: &str, err: &vrdma::Error) -> c_int {
    let e = err.errno();
    if debug_enabled() {
        eprintln!("vrdma-verbs: {what}: errno {e}: {err}");
    }
    e
}

/// As [`fail`], for a call that takes room in a guest's VM region (a
/// registration, or a queue's ring: CQ, QP, SRQ, completion channel).
/// Refused with `ENOMEM` there, the reason is said once per process on
/// stderr even without `VRDMA_VERBS_DEBUG`, as rdma-core warns of an
/// `RLIMIT_MEMLOCK` that will refuse registrations: the region's size is
/// fixed by the host's config whatever memory the guest has, so the
/// program's own message ("unable to create QP: Cannot allocate memory")
/// would send its user looking at the guest's memory. A client of a
/// server waiting for all its connections (`ucmatose -c 3 -C 16000` in a
/// 16 MiB region) left its server silent with only that message.
pub fn fail_in_guest(what: &str, ctx: &vrdma::Context, err: &vrdma::Error) -> c_int {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if err.errno() == libc::ENOMEM
        && ctx.is_guest()
        && !debug_enabled()
        && !SAID.swap(true, std::sync::atomic::Ordering::Relaxed)
    {
        eprintln!("libibverbs (vRDMA): Warning: {what}: {err}");
    }
    fail(what, err)
}

/// Logs a failure the shim itself decided, and returns `e`.
pub fn refuse(what: &str, why: &str, e: c_int) -> c_int {
    if debug_enabled() {
        eprintln!("vrdma-verbs: {what}: errno {e}: {why}");
    }
    e
}

/// Runs `f`; a panic becomes `on_panic` with `errno = EIO`.
pub fn guard<R>(what: &str, on_panic: R, f: impl FnOnce() -> R) -> R {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(_) => {
            if debug_enabled() {
                eprintln!("vrdma-verbs: {what}: internal error (panic), returning EIO");
            }
            set_errno(libc::EIO);
            on_panic
        }
    }
}

/// `0`, or the errno value (also stored in `errno`).
pub fn ret_code(what: &str, f: impl FnOnce() -> Res<()>) -> c_int {
    guard(what, libc::EIO, || match f() {
        Ok(()) => 0,
        Err(e) => {
            set_errno(e);
            e
        }
    })
}

/// `0`, or `-1` with `errno` set.
pub fn ret_minus1(what: &str, f: impl FnOnce() -> Res<()>) -> c_int {
    guard(what, -1, || match f() {
        Ok(()) => 0,
        Err(e) => {
            set_errno(e);
            -1
        }
    })
}

/// The pointer, or NULL with `errno` set.
pub fn ret_ptr<T>(what: &str, f: impl FnOnce() -> Res<*mut T>) -> *mut T {
    guard(what, std::ptr::null_mut(), || match f() {
        Ok(p) => p,
        Err(e) => {
            set_errno(e);
            std::ptr::null_mut()
        }
    })
}

/// `EINVAL` for a NULL pointer argument (rdma-core would crash on most;
/// refusing is the friendlier reading of "invalid argument").
pub fn non_null<T>(what: &str, p: *const T, name: &str) -> Res<()> {
    if p.is_null() {
        Err(refuse(what, &format!("{name} is NULL"), libc::EINVAL))
    } else {
        Ok(())
    }
}

/// Copies `s` into a fixed C character array, truncated and always
/// NUL-terminated.
pub fn copy_cstr(dst: &mut [c_char], s: &str) {
    let n = s.len().min(dst.len().saturating_sub(1));
    for (d, &b) in dst.iter_mut().zip(&s.as_bytes()[..n]) {
        *d = b as c_char;
    }
    if let Some(end) = dst.get_mut(n) {
        *end = 0;
    }
}

/// Saturates a `u32` limit into the `int` fields of the C attributes.
pub fn int(v: u32) -> c_int {
    c_int::try_from(v).unwrap_or(c_int::MAX)
}

/// Whether `fd` has `O_NONBLOCK` set (the application asked for a
/// non-blocking `ibv_get_cq_event`/`ibv_get_async_event`).
pub fn is_nonblocking(fd: c_int) -> bool {
    // SAFETY: F_GETFL reads the flags of a descriptor; an invalid one
    // yields -1, which we treat as blocking.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    flags >= 0 && flags & libc::O_NONBLOCK != 0
}

/// Clears `O_NONBLOCK` on `fd` so that it starts out blocking, as the
/// descriptors of rdma-core do. The vrdma client never relies on the flag
/// (its doorbell reads and writes pass `MSG_DONTWAIT`), so the flag is
/// left to the application, which may set it to make the event calls
/// non-blocking.
pub fn make_blocking(fd: c_int) {
    // SAFETY: F_GETFL/F_SETFL on a descriptor we own; failures leave the
    // flags as they were.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags >= 0 && flags & libc::O_NONBLOCK != 0 {
            libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK);
        }
    }
}

/// An embedded pthread mutex locked for the guard's life.
pub struct PthreadLock(*mut libc::pthread_mutex_t);

impl PthreadLock {
    /// # Safety
    /// `m` must point to an initialised mutex that outlives the guard.
    pub unsafe fn new(m: *mut libc::pthread_mutex_t) -> PthreadLock {
        // SAFETY: the caller guarantees an initialised, live mutex.
        unsafe { libc::pthread_mutex_lock(m) };
        PthreadLock(m)
    }
}

impl Drop for PthreadLock {
    fn drop(&mut self) {
        // SAFETY: locked by `new` on this thread; still live (contract of `new`).
        unsafe { libc::pthread_mutex_unlock(self.0) };
    }
}

/// Initialises an embedded mutex and condition variable, as rdma-core
/// does for every object that carries them.
///
/// # Safety
/// Both must point to writable, unused storage.
pub unsafe fn init_mutex_cond(m: *mut libc::pthread_mutex_t, c: *mut libc::pthread_cond_t) {
    // SAFETY: the caller provides valid storage; default attributes.
    unsafe {
        libc::pthread_mutex_init(m, std::ptr::null());
        libc::pthread_cond_init(c, std::ptr::null());
    }
}

/// Destroys what [`init_mutex_cond`] initialised.
///
/// # Safety
/// Both must be initialised and no longer used by anyone.
pub unsafe fn destroy_mutex_cond(m: *mut libc::pthread_mutex_t, c: *mut libc::pthread_cond_t) {
    // SAFETY: the caller guarantees initialised, unused objects.
    unsafe {
        libc::pthread_cond_destroy(c);
        libc::pthread_mutex_destroy(m);
    }
}

/// Waits, under the object's mutex, until the application has
/// acknowledged as many events as were handed to it (`events_completed ==
/// reported`), as rdma-core's destroy verbs do: an event the application
/// still holds names the object, so it must outlive the event.
///
/// # Safety
/// `m`, `c` and `completed` must be the live mutex, condition variable
/// and counter of one object; `completed` is only written under `m`.
pub unsafe fn wait_acked(
    m: *mut libc::pthread_mutex_t,
    c: *mut libc::pthread_cond_t,
    completed: &[(*const u32, u32)],
) {
    // SAFETY: per the contract, `m` is live; the counters are read under it.
    unsafe {
        let _lock = PthreadLock::new(m);
        while completed.iter().any(|&(p, want)| std::ptr::read_volatile(p) != want) {
            libc::pthread_cond_wait(c, m);
        }
    }
}
