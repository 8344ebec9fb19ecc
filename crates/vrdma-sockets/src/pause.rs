//! Test-only pauses at named points of the demotion's races
//! (`VRDMA_SOCKETS_TEST_PAUSE=POINT:MICROSECONDS`), so that the
//! integration tests can force an interleaving of a program's thread and
//! the library's demotion that otherwise needs a lucky schedule (the
//! window is a few instructions wide), and one failure (`fails`). Unset, a point costs one load of
//! a cached value.

use std::sync::OnceLock;
use std::time::Duration;

/// A point where a test may pause the calling thread.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Point {
    /// `write`: its look at the demotion state done, before it takes the
    /// send lock.
    SendLock,
    /// `write`: its look at whether the peer demoted done (not yet),
    /// before its ring write.
    RingWrite,
    /// A peer's `read`: its look at whether the reads switched done,
    /// before it takes the receive lock.
    RecvLock,
    /// A demoted read: the ring found empty, before it looks at the
    /// socket.
    RingThenSocket,
    /// The driver's demotion: its state gone to `D_DEMOTING`, before it
    /// takes the send lock (a `shutdown` of its process may take the lock
    /// first: the window the third review fixed).
    DemoteLock,
    /// Not a pause: the peer's resend for an exec demotion sends half of
    /// its bytes (its marker and part of the range) and fails, as a send
    /// that timed out (`fails`).
    ResendFails,
    /// Not a pause: the reset of a connection whose exec resend was cut
    /// short cannot disconnect it (as where `connect(AF_UNSPEC)` fails):
    /// its fallback, a linger of 0, is taken (`fails`).
    ResetFallsBack,
}

impl Point {
    fn name(self) -> &'static str {
        match self {
            Point::SendLock => "send-lock",
            Point::RingWrite => "ring-write",
            Point::RecvLock => "recv-lock",
            Point::RingThenSocket => "ring-then-socket",
            Point::DemoteLock => "demote-lock",
            Point::ResendFails => "resend-fails",
            Point::ResetFallsBack => "reset-falls-back",
        }
    }
}

/// The configured point and pause, if any.
fn config() -> Option<(&'static str, Duration)> {
    static C: OnceLock<Option<(String, Duration)>> = OnceLock::new();
    C.get_or_init(|| parse(&std::env::var("VRDMA_SOCKETS_TEST_PAUSE").ok()?))
        .as_ref()
        .map(|(p, d)| (p.as_str(), *d))
}

fn parse(v: &str) -> Option<(String, Duration)> {
    let (p, us) = v.split_once(':')?;
    Some((p.to_string(), Duration::from_micros(us.parse().ok()?)))
}

/// Pauses here if the tests asked for it.
pub(crate) fn at(point: Point) {
    if let Some((p, d)) = config() {
        if p == point.name() {
            std::thread::sleep(d);
        }
    }
}

/// Whether the tests asked this point to fail (its pause is ignored).
pub(crate) fn fails(point: Point) -> bool {
    config().is_some_and(|(p, _)| p == point.name())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pause_names_its_point_and_length() {
        assert_eq!(parse("send-lock:2000"), Some(("send-lock".into(), Duration::from_millis(2))));
        assert_eq!(parse("send-lock"), None);
        assert_eq!(parse("send-lock:x"), None);
    }
}
