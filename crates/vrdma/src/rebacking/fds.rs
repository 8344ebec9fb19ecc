//! Where re-backed spans keep their memfd descriptors.
//!
//! Each live span holds its memfd open (a later registration inside it
//! sends the daemon the same file), while real pinning costs a process no
//! descriptor at all. A program that registers a few thousand separate
//! buffers would run out of descriptors under the common soft limit of
//! 1024, and those descriptors would take the low numbers that
//! `select(2)`-based code needs. So span descriptors live at 1024
//! (`FD_SETSIZE`) and above, out of the program's way, and where the soft
//! `RLIMIT_NOFILE` leaves no room there, re-backing raises it to the hard
//! limit, as the JVM and the Go runtime do at start. Where the hard limit
//! leaves no room either, they take ordinary numbers, as before.

use std::os::fd::{BorrowedFd, OwnedFd};

use rustix::io::Errno;
use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};

/// The lowest descriptor a span's memfd takes: `FD_SETSIZE`, the first one
/// `select(2)` cannot watch.
pub(crate) const SPAN_FD_BASE: i32 = 1024;

/// Where the hard limit is infinite, the soft one goes up to this (the
/// kernel's default `fs.nr_open`).
const INFINITE_HARD_LIMIT_CAP: u64 = 1 << 20;

/// Raises the soft descriptor limit to the hard one.
fn raise_soft_limit() {
    let lim = getrlimit(Resource::Nofile);
    let hard = lim.maximum.unwrap_or(INFINITE_HARD_LIMIT_CAP);
    if lim.current.is_some_and(|soft| soft < hard) {
        let raised = Rlimit { current: Some(hard), maximum: lim.maximum };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => {
                tracing::debug!(from = lim.current, to = hard, "vrdma: raised the soft descriptor limit")
            }
            Err(e) => tracing::debug!(error = %e, "vrdma: cannot raise the soft descriptor limit"),
        }
    }
}

/// A duplicate of `fd` for a span to hold, numbered from [`SPAN_FD_BASE`]
/// where the limit allows.
pub(crate) fn span_fd(fd: BorrowedFd<'_>) -> std::io::Result<OwnedFd> {
    let high = || rustix::io::fcntl_dupfd_cloexec(fd, SPAN_FD_BASE);
    match high() {
        Ok(h) => return Ok(h),
        // The soft limit is at or below the base (EINVAL), or every number
        // from the base up to it is taken (EMFILE).
        Err(Errno::INVAL | Errno::MFILE) => raise_soft_limit(),
        Err(e) => return Err(e.into()),
    }
    match high() {
        Ok(h) => Ok(h),
        Err(Errno::INVAL | Errno::MFILE) => Ok(rustix::io::fcntl_dupfd_cloexec(fd, 0)?),
        Err(e) => Err(e.into()),
    }
}
