//! How a thread that polls an empty CQ waits.
//!
//! Verbs programs wait for completions by calling `ibv_poll_cq` in a
//! loop. On real hardware that costs nothing but the poller's own core.
//! Here the completions come from the daemon's engine, a thread that needs
//! a CPU too, and on a small machine (two cores: two applications and two
//! engines when a QP crosses hosts) a poller that never lets go takes the
//! CPU the engine needs to make progress. So an empty poll escalates:
//!
//! 1. it spins for [`spin_polls`] empty polls of the same CQ (cheap, and
//!    all a machine with cores to spare ever does);
//! 2. then every empty poll yields the CPU (`sched_yield`);
//! 3. once the *thread* has found nothing and posted nothing for
//!    `nap_after` (≤ 2 cores only, by default 200 µs), every empty poll
//!    sleeps ([`nap_length`]): an eighth of the silence so far, from
//!    [`NAP_MIN`] up to [`NAP_MAX`]. A yielding thread still claims its fair
//!    share of a CPU under the kernel's scheduler (measured: ~45 % of one
//!    CPU taken from the engine during a 1 MiB write stream); a sleeping one
//!    takes none, but every wake-up costs a context switch. A fixed 20 µs
//!    nap woke `ib_write_bw -q 4`'s client ~10 000 times a second between
//!    its completions (one per 100 MiB), 17 % of a CPU; growing naps make
//!    that ~9 %.
//!
//! A CQ whose last completions came from the direct path
//! (`docs/direct-path.md`: written by the peer program itself, no engine
//! involved) spins [`DIRECT_SPIN_POLLS`] empty polls in step 1 instead,
//! as long as that program last completed from another CPU: there a
//! yield helps no one who is needed and, on a loaded machine, costs the
//! poller its CPU. Where that program last ran on the poller's own CPU,
//! none: every empty poll yields at once, since the completion can come
//! only once the peer runs ([`Peer::Here`]; not for a CQ with a completion
//! channel, whose polls around an arming keep the usual spin, `cq.rs`).
//!
//! Step 3 counts per thread, not per CQ, so that a loop polling one idle
//! and one busy CQ, or spinning on memory and posting, never naps; it ends
//! on the first completion found or request posted. What it costs: a
//! completion that arrives after a silence of `t` ≥ 200 µs on a 2-core
//! machine is seen up to one nap later: `t`/8, at least 20 µs and at most
//! 250 µs, plus the kernel's timer slack (50 µs by default).

use std::cell::Cell;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The shortest nap (the kernel adds its timer slack to every nap).
pub const NAP_MIN: Duration = Duration::from_micros(20);

/// The longest nap: the most a completion can wait, past the timer
/// slack, to be seen after a long silence.
pub const NAP_MAX: Duration = Duration::from_micros(250);

/// How long an empty poll naps after the thread has been idle for `idle`:
/// an eighth of it, so that a completion is seen at most ~12 % later than
/// it arrived, within [`NAP_MIN`]..=[`NAP_MAX`].
pub fn nap_length(idle: Duration) -> Duration {
    (idle / 8).clamp(NAP_MIN, NAP_MAX)
}

/// The waiting rule, from the environment and the machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PollPolicy {
    /// Empty polls of one CQ in a row before each further one yields.
    pub spin_polls: u32,
    /// How long the thread finds nothing before empty polls nap; `None`:
    /// never.
    pub nap_after: Option<Duration>,
}

/// What an empty poll does before it returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    Spin,
    Yield,
    /// Sleep this long.
    Nap(Duration),
}

impl PollPolicy {
    /// The default for a machine with `cores` CPUs: spin long and never
    /// nap where cores are to spare; yield soon and nap after 200 µs of
    /// silence where there are two or fewer.
    pub fn for_cores(cores: usize) -> PollPolicy {
        if cores > 2 {
            PollPolicy { spin_polls: 1024, nap_after: None }
        } else {
            PollPolicy { spin_polls: 4, nap_after: Some(Duration::from_micros(200)) }
        }
    }

    /// [`for_cores`](Self::for_cores), overridden by `VRDMA_POLL_SPIN`
    /// (empty polls before yielding) and `VRDMA_POLL_NAP_US` (µs of
    /// silence before napping; 0 turns napping off). Values that do not
    /// parse are ignored.
    pub fn from_env(cores: usize, spin: Option<&str>, nap_us: Option<&str>) -> PollPolicy {
        let mut p = PollPolicy::for_cores(cores);
        if let Some(n) = spin.and_then(|v| v.trim().parse().ok()) {
            p.spin_polls = n;
        }
        if let Some(us) = nap_us.and_then(|v| v.trim().parse::<u64>().ok()) {
            p.nap_after = (us > 0).then(|| Duration::from_micros(us));
        }
        p
    }

    /// What an empty poll does: `empty` is how many polls of this CQ in a
    /// row came back empty before this one, `idle` how long the thread
    /// has found nothing and posted nothing.
    pub fn decide(&self, empty: u32, idle: Duration) -> Wait {
        if empty < self.spin_polls {
            Wait::Spin
        } else if self.nap_after.is_some_and(|after| idle >= after) {
            Wait::Nap(nap_length(idle))
        } else {
            Wait::Yield
        }
    }
}

/// This process's rule (read once).
pub fn policy() -> PollPolicy {
    static POLICY: OnceLock<PollPolicy> = OnceLock::new();
    *POLICY.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let spin = std::env::var("VRDMA_POLL_SPIN").ok();
        let nap = std::env::var("VRDMA_POLL_NAP_US").ok();
        PollPolicy::from_env(cores, spin.as_deref(), nap.as_deref())
    })
}

thread_local! {
    /// When this thread's current run of empty polls (past the spin)
    /// began; `None` after activity.
    static IDLE_SINCE: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// The thread found a completion or posted a request: it is not idle.
#[inline]
pub(crate) fn activity() {
    IDLE_SINCE.with(|c| c.set(None));
}

/// Empty polls in a row that a CQ spins before it yields, whatever the
/// machine, while its last completions came from the direct path
/// (`docs/direct-path.md`) and the peer program that writes them seems to
/// run on another CPU (the CPU it last completed from, in the inbox's
/// `INBOX_AUX_REQUESTER_CPU` word). Such completions need no engine, so a
/// yield frees the CPU for no one who is needed and costs the poller its
/// CPU when other programs wait for one; on a loaded 2-core machine that
/// trip through the scheduler was most of a direct SEND's latency. About
/// 50–80 µs of polling at most. Where the peer last ran on this CPU, the
/// poller yields at its first empty poll instead ([`Peer::Here`]):
/// spinning would only delay the peer (measured: 1024 polls made a
/// same-CPU ping-pong 70 µs one way, and even the usual 4 cost it some
/// 0.3 µs one way, `docs/direct-path.md`, round 11).
pub const DIRECT_SPIN_POLLS: u32 = 1024;

/// Where the program that last completed into a CQ from the direct path
/// ran, as its inbox's `INBOX_AUX_REQUESTER_CPU` word says, beside the
/// CPU of the thread that waits for the CQ's next completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Peer {
    /// Not known, or the CQ's last completions did not come from the
    /// direct path (the engine's may come from any CPU): the usual spin.
    Unknown,
    /// On this CPU: it can write the next completion only once this
    /// thread lets go of the CPU, so every empty look yields at once.
    Here,
    /// On another CPU: spin [`DIRECT_SPIN_POLLS`] looks before yielding.
    Elsewhere,
}

/// Empty polls (or looks at a completion channel) in a row before each
/// further one yields: [`policy`]'s spin, at least [`DIRECT_SPIN_POLLS`]
/// for a peer [`Peer::Elsewhere`], none for a peer [`Peer::Here`].
pub(crate) fn spin_limit(peer: Peer) -> u32 {
    let spin = policy().spin_polls;
    match peer {
        Peer::Unknown => spin,
        Peer::Here => 0,
        Peer::Elsewhere => spin.max(DIRECT_SPIN_POLLS),
    }
}

/// The CPU the calling thread runs on, plus one (never 0, the word's "not
/// known"), as the inbox's `INBOX_AUX_REQUESTER_CPU` holds it.
pub(crate) fn current_cpu_word() -> u32 {
    u32::try_from(rustix::thread::sched_getcpu()).map_or(u32::MAX, |c| c.saturating_add(1))
}

/// Called after an empty poll that was the `empty`-th in a row on its CQ:
/// spins, yields or naps as [`policy`] says, spinning [`spin_limit`]`(peer)`
/// polls.
pub(crate) fn wait_after_empty_poll(empty: u32, peer: Peer) {
    let p = PollPolicy { spin_polls: spin_limit(peer), ..policy() };
    match next_wait(&p, empty) {
        Wait::Spin => std::hint::spin_loop(),
        Wait::Yield => std::thread::yield_now(),
        Wait::Nap(d) => std::thread::sleep(d),
    }
}

/// The decision for this thread, starting its idle clock at its first
/// poll past the spin.
fn next_wait(p: &PollPolicy, empty: u32) -> Wait {
    if empty < p.spin_polls {
        return Wait::Spin;
    }
    let idle = IDLE_SINCE.with(|c| {
        let now = Instant::now();
        let since = c.get().unwrap_or_else(|| {
            c.set(Some(now));
            now
        });
        now.duration_since(since)
    });
    p.decide(empty, idle)
}

/// How long the calling thread has been polling empty CQs (past the
/// spin) without finding a completion or posting a request; `None` if it
/// has not been, since its last completion or post.
pub fn idle_for() -> Option<Duration> {
    IDLE_SINCE.with(|c| c.get()).map(|t| t.elapsed())
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: fn(u64) -> Duration = Duration::from_micros;

    #[test]
    fn small_machines_yield_soon_and_nap_after_silence() {
        let p = PollPolicy::for_cores(2);
        assert_eq!(p.decide(0, US(0)), Wait::Spin);
        assert_eq!(p.decide(3, US(0)), Wait::Spin);
        assert_eq!(p.decide(4, US(0)), Wait::Yield);
        assert_eq!(p.decide(4, US(199)), Wait::Yield);
        assert_eq!(p.decide(4, US(200)), Wait::Nap(US(25)));
        assert_eq!(p.decide(1000, US(5000)), Wait::Nap(US(250)));
    }

    #[test]
    fn naps_grow_with_the_silence_within_bounds() {
        assert_eq!(nap_length(US(0)), NAP_MIN);
        assert_eq!(nap_length(US(160)), NAP_MIN);
        assert_eq!(nap_length(US(800)), US(100));
        assert_eq!(nap_length(US(2000)), NAP_MAX);
        assert_eq!(nap_length(Duration::from_secs(3600)), NAP_MAX);
        // Monotonic: a longer silence never naps shorter.
        let mut last = Duration::ZERO;
        for us in (0..5000).step_by(7) {
            let n = nap_length(US(us));
            assert!(n >= last, "{us} µs");
            last = n;
        }
    }

    #[test]
    fn a_peer_on_this_cpu_is_yielded_to_at_once_and_one_elsewhere_spun_for() {
        assert_eq!(spin_limit(Peer::Here), 0);
        assert_eq!(spin_limit(Peer::Unknown), policy().spin_polls);
        assert!(spin_limit(Peer::Elsewhere) >= DIRECT_SPIN_POLLS);
        let p = PollPolicy { spin_polls: spin_limit(Peer::Here), ..PollPolicy::for_cores(2) };
        assert_eq!(p.decide(0, US(0)), Wait::Yield, "the first empty poll yields");
    }

    #[test]
    fn machines_with_cores_to_spare_never_nap() {
        let p = PollPolicy::for_cores(16);
        assert_eq!(p.decide(1023, US(1_000_000)), Wait::Spin);
        assert_eq!(p.decide(1024, US(1_000_000)), Wait::Yield);
    }

    #[test]
    fn the_environment_overrides_and_zero_turns_napping_off() {
        let p = PollPolicy::from_env(16, Some("8"), Some("50"));
        assert_eq!(p, PollPolicy { spin_polls: 8, nap_after: Some(US(50)) });
        assert_eq!(PollPolicy::from_env(2, None, Some("0")).nap_after, None);
        assert_eq!(PollPolicy::from_env(2, Some("x"), Some("-1")), PollPolicy::for_cores(2));
    }

    #[test]
    fn the_thread_naps_only_after_its_own_silence_and_activity_ends_it() {
        // On a thread of its own: the idle clock is per thread.
        std::thread::spawn(|| {
            let p = PollPolicy::for_cores(2);
            activity();
            assert_eq!(next_wait(&p, 0), Wait::Spin);
            assert_eq!(IDLE_SINCE.with(|c| c.get()), None, "spinning polls do not start the clock");
            assert_eq!(next_wait(&p, 4), Wait::Yield);
            let started = IDLE_SINCE.with(|c| c.get()).expect("the first yielding poll starts the clock");
            std::thread::sleep(US(250));
            assert!(matches!(next_wait(&p, 5), Wait::Nap(d) if d >= US(31)), "an eighth of ≥ 250 µs");
            assert_eq!(IDLE_SINCE.with(|c| c.get()), Some(started), "later polls keep the start");
            activity();
            assert_eq!(next_wait(&p, 6), Wait::Yield, "activity ends the silence");
            let never = PollPolicy::for_cores(16);
            std::thread::sleep(US(250));
            assert_eq!(next_wait(&never, 2000), Wait::Yield);
            assert!(idle_for().is_some_and(|d| d >= US(250)));
        })
        .join()
        .unwrap();
    }
}
