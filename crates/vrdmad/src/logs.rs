//! The daemon's side of rate-limited logging ([`vrdma_core::log_limit`]):
//! the clock of the limiters that the threads at the edges own (the
//! engine passes its own time to those it owns), and a lock that a panic
//! elsewhere does not poison for good.

use std::sync::{Mutex, MutexGuard, OnceLock};

use vrdma_core::log_limit::LogLimiter;
use vrdma_core::time::Instant;

/// Now on a clock that starts with the process.
pub(crate) fn now() -> Instant {
    static EPOCH: OnceLock<std::time::Instant> = OnceLock::new();
    Instant(EPOCH.get_or_init(std::time::Instant::now).elapsed().as_nanos() as u64)
}

/// A limiter shared by threads.
pub(crate) fn lock(l: &Mutex<LogLimiter>) -> MutexGuard<'_, LogLimiter> {
    l.lock().unwrap_or_else(|p| p.into_inner())
}
