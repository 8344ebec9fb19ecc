//! A short look before sleeping: spinning on a descriptor for a few
//! microseconds before blocking on it.
//!
//! A control call, an rdma_cm event and a session's next request are
//! usually answered within tens of microseconds. A thread that blocks in
//! the kernel for them pays a wake-up when the answer comes: an
//! inter-processor interrupt and the idle CPU's exit from its sleep
//! state, and in a virtual machine a halted vCPU's resumption, each of
//! which may cost more than the wait itself. With cores to spare, looking
//! for the answer for a while first saves that wake-up: an rdma_cm
//! connection's setup on 16 vCPUs, 77 µs with a 100 µs look against 110
//! µs without (docs/rdma-cm.md, "On a machine with cores to spare").
//! With two cores or fewer the spinner takes the CPU the answering
//! thread needs (the same setup
//! on 2 vCPUs: 332 µs with a 50 µs look against 116 µs without), so the
//! look is off there by default.
//!
//! `VRDMA_WAIT_SPIN_US` sets the look's length in microseconds for the library
//! and the daemon alike (0 turns it off; at most [`MAX_SPIN`]); unset or
//! unreadable, it is [`DEFAULT_SPIN`] with more than two CPUs and 0 with
//! two or fewer.

use std::os::fd::BorrowedFd;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};

/// The look's length where `VRDMA_WAIT_SPIN_US` is unset and the machine has
/// more than two CPUs.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(100);
/// The longest look `VRDMA_WAIT_SPIN_US` may ask for.
pub const MAX_SPIN: Duration = Duration::from_millis(1);

/// The look's length for this process (read once).
pub fn budget() -> Duration {
    static BUDGET: OnceLock<Duration> = OnceLock::new();
    *BUDGET.get_or_init(|| {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        budget_for(std::env::var("VRDMA_WAIT_SPIN_US").ok().as_deref(), cpus)
    })
}

/// The look's length given `VRDMA_WAIT_SPIN_US`'s value and the CPUs this
/// process may run on.
pub fn budget_for(env: Option<&str>, cpus: usize) -> Duration {
    match env.map(str::trim).and_then(|s| s.parse::<u64>().ok()) {
        Some(us) => Duration::from_micros(us).min(MAX_SPIN),
        None if cpus > 2 => DEFAULT_SPIN,
        None => Duration::ZERO,
    }
}

/// Calls `ready` until it says yes or `budget` has passed; whether it
/// said yes. A zero budget calls nothing.
pub fn spin_until(budget: Duration, mut ready: impl FnMut() -> bool) -> bool {
    if budget.is_zero() {
        return false;
    }
    let start = Instant::now();
    loop {
        if ready() {
            return true;
        }
        if start.elapsed() >= budget {
            return false;
        }
        std::hint::spin_loop();
    }
}

/// Whether `fd` has something to read now, or is hung up or in error (a
/// blocking read would not block): one poll that does not wait.
pub fn fd_ready(fd: BorrowedFd<'_>) -> bool {
    let mut fds = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
    matches!(rustix::event::poll(&mut fds, Some(&Timespec { tv_sec: 0, tv_nsec: 0 })), Ok(n) if n > 0)
}

/// Looks at `fd` for up to this process's [`budget`] before the caller
/// blocks on it; whether it became ready.
pub fn before_blocking_on(fd: BorrowedFd<'_>) -> bool {
    spin_until(budget(), || fd_ready(fd))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn the_budget_follows_the_variable_and_else_the_cpus() {
        assert_eq!(budget_for(None, 2), Duration::ZERO);
        assert_eq!(budget_for(None, 1), Duration::ZERO);
        assert_eq!(budget_for(None, 16), DEFAULT_SPIN);
        assert_eq!(budget_for(Some("0"), 16), Duration::ZERO);
        assert_eq!(budget_for(Some(" 20 "), 2), Duration::from_micros(20));
        assert_eq!(budget_for(Some("99999999"), 2), MAX_SPIN);
        // Unreadable: as if unset.
        assert_eq!(budget_for(Some("-5"), 16), DEFAULT_SPIN);
        assert_eq!(budget_for(Some("fast"), 2), Duration::ZERO);
    }

    #[test]
    fn a_look_ends_when_ready_or_when_its_time_is_up() {
        let mut calls = 0;
        assert!(!spin_until(Duration::ZERO, || {
            calls += 1;
            true
        }));
        assert_eq!(calls, 0, "a zero budget looks at nothing");

        let mut calls = 0;
        assert!(spin_until(Duration::from_millis(100), || {
            calls += 1;
            calls == 3
        }));
        assert_eq!(calls, 3);

        let start = Instant::now();
        assert!(!spin_until(Duration::from_millis(2), || false));
        assert!(start.elapsed() >= Duration::from_millis(2));
    }

    #[test]
    fn a_descriptor_is_ready_with_a_message_waiting_or_its_peer_gone() {
        let (a, b) = crate::seqpacket_pair().unwrap();
        assert!(!fd_ready(a.as_fd()));
        assert!(!spin_until(Duration::from_micros(200), || fd_ready(a.as_fd())));
        crate::send_msg(b.as_fd(), b"x", &[]).unwrap();
        assert!(fd_ready(a.as_fd()));
        let mut buf = [0u8; 4];
        crate::recv_msg(a.as_fd(), &mut buf, 0).unwrap();
        assert!(!fd_ready(a.as_fd()));
        drop(b);
        assert!(fd_ready(a.as_fd()), "a hung-up peer: a read would not block");
    }
}
