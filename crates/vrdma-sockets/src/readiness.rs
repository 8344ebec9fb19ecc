//! The readiness calls, interposed to settle writes in flight before the
//! program waits: `poll`, `ppoll`, `select`, `pselect`, `epoll_wait`,
//! `epoll_pwait`, `epoll_pwait2` (and `__poll_chk`, `poll`'s
//! `_FORTIFY_SOURCE` form).
//!
//! What they report is the kernel's (`docs/sockets.md`: wake bytes keep a
//! carried socket's `POLLIN` right), with one correction: a carried socket
//! that reads ready only for stale wake bytes (a byte that reached the
//! socket after the arming that would have taken it) has them taken off
//! and its readability taken back, and the call waits again while nothing
//! else is ready. `poll`, `ppoll`, `select` and `pselect` know their
//! descriptors (`select` and `pselect` with a carried socket in their
//! sets are answered through `ppoll`'s path, so that a carried socket's
//! writability is its ring's there too); the epoll calls know the registrations of carried
//! connections that `epoll_ctl` made ([`crate::epoll`], which also keeps
//! their `EPOLLOUT` as the ring has it). But a write returns before its
//! bytes landed, and only a look at its completion afterwards sends the
//! wake byte an asleep reader needs ([`crate::progress`]). A program that
//! wrote and now waits for its peer's answer would wait for the progress
//! thread's next look; so a call that may wait first waits for this
//! process's writes in flight to land (an engine round trip at most), and
//! a call that does not wait (timeout 0) reaps what completed. A process
//! with nothing in flight pays one lock and an empty list.
//!
//! A connection not decided yet (claimed or announced, no call on it yet)
//! reads ready in the kernel when the peer's first message comes: its
//! hello, its decline, or its end. Those bytes are the library's, not the
//! program's: `poll`, `ppoll`, `select` and `pselect` decide such a
//! connection there and then ([`decide_readable`]: the exchange of hellos,
//! quick, since the peer is in its own) and answer for what it is then (a
//! carried connection's readability is its ring's). Before, a program told
//! "readable" read `EAGAIN` from a non-blocking socket, and one that takes
//! that for the end (ncat `--exec`'s relay) closed the connection. The
//! epoll waits do the same for the registrations `epoll_ctl` made before
//! a connection's first call, once the kernel reported one of them
//! ([`report`]: the kernel says which; the look is made in the same pass
//! under the registrations' lock that every report of a carried
//! connection gets, and costs a set with no undecided registration
//! nothing): an event loop told `EPOLLIN` for the hello read
//! `EAGAIN`, and one that reads once per report (or takes `EAGAIN` after
//! a report for an error) stalled or closed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use libc::{c_int, epoll_event, fd_set, nfds_t, pollfd, sigset_t, timespec, timeval};

use crate::link::Link;
use crate::real;
use crate::table::{self, keep_errno, Entry, Guard};

/// Settles the writes in flight; `wait`: the call may block.
fn settle(wait: bool) {
    if let Some(_g) = Guard::enter() {
        keep_errno(|| crate::progress::flush_all(wait));
    }
}

fn waits_ms(timeout: c_int) -> bool {
    timeout != 0
}

/// A null timespec waits for ever; a zero one does not wait.
fn waits_ts(ts: *const timespec) -> bool {
    // SAFETY: the caller's timespec, null or valid (the call's contract).
    unsafe { ts.as_ref() }.is_none_or(|t| t.tv_sec != 0 || t.tv_nsec != 0)
}

/// The carried link of `fd`, if it is one of this process's carried
/// connections (never negotiates).
fn carried(fd: c_int) -> Option<Arc<Link>> {
    match table::get(fd)? {
        // Another process drives it: if carried before the fork, that
        // process is asked to demote it (this wait then sees the kernel
        // socket's readiness, which the demotion makes right).
        Entry::Stream(s) if !s.owner.may_use() => {
            crate::forkshare::nudge(&s);
            None
        }
        Entry::Stream(s) => s.link_now(),
        _ => None,
    }
}

/// Whether bytes wait in `l`'s ring that its socket may not show (a lazy
/// read left it unarmed: [`Link::arm_for_readiness`], which arms it
/// otherwise).
fn unarmed_ready(l: &Arc<Link>) -> bool {
    match Guard::enter() {
        // Waited for here: its reads arm at once from now on (only an
        // epoll wait arms what they leave unarmed).
        Some(_g) => keep_errno(|| {
            l.never_lazy();
            l.arm_for_readiness()
        }),
        None => false,
    }
}

/// Whether `l`'s readability is only stale wake bytes (taken off now).
fn stale(l: &Link) -> bool {
    match Guard::enter() {
        Some(_g) => keep_errno(|| l.readable_is_stale()),
        None => false,
    }
}

/// Milliseconds left of `timeout` (negative: for ever) since `start`.
/// The connections among `fds` asked for reading that this process may
/// take (or that a sibling settles before its exec) and that are not
/// decided yet, by index.
fn undecided_in(fds: *const pollfd, n: nfds_t) -> Vec<(usize, c_int)> {
    let Some(_g) = Guard::enter() else { return Vec::new() };
    if fds.is_null() {
        return Vec::new();
    }
    keep_errno(|| {
        (0..n as usize)
            .filter_map(|i| {
                // SAFETY: `fds` holds `n` pollfds (poll's contract).
                let p = unsafe { &*fds.add(i) };
                if p.fd < 0 || p.events & libc::POLLIN == 0 {
                    return None;
                }
                // One that another process settles before its exec (it
                // takes the peer's message off) is decided here too: the
                // call waits for the outcome ([`crate::owner::Owner::take`]).
                match table::get(p.fd)? {
                    e @ Entry::Stream(_) if !e.ours() && !e.settled_elsewhere() => None,
                    Entry::Stream(s) if s.undecided() => Some((i, p.fd)),
                    _ => None,
                }
            })
            .collect()
    })
}

/// Decides each of `undecided` whose socket holds bytes (the peer's hello
/// or decline): the peer is in its exchange, so this one is quick.
/// Returns the indices of those left undecided (also those the peer ended
/// or that failed: their report is the kernel's, for the program's call).
fn decide_readable(undecided: &[(usize, c_int)]) -> Vec<usize> {
    undecided.iter().filter(|&&(_, fd)| decide_if_bytes(fd) != Some(true)).map(|&(i, _)| i).collect()
}

/// Decides `fd` if its socket holds bytes (the peer's hello or decline):
/// `Some(true)` decided (or tried), `Some(false)` nothing there, `None`
/// not known (the count failed).
fn decide_if_bytes(fd: c_int) -> Option<bool> {
    keep_errno(|| {
        // Bytes there (the peer's hello or decline) are counted, not
        // peeked: a peek of a socket with an error pending clears the
        // error (the kernel's `sock_error`), which the program's
        // `SO_ERROR` or read should get, and deciding a connection that
        // ended or failed before its first call could wait the whole
        // settle wait for a claim that never comes (found in review,
        // 2026-11-28). Those are left to the program's own call, as the
        // kernel reports them.
        let mut n: c_int = 0;
        // SAFETY: FIONREAD writes one int to the valid pointer given.
        let r = unsafe { real::ioctl(fd, libc::FIONREAD, (&raw mut n).cast()) };
        if r < 0 {
            return None;
        }
        if n <= 0 {
            return Some(false);
        }
        // Takes it and negotiates, as the program's read would.
        let _ = crate::interpose::target(fd);
        Some(true)
    })
}

/// Runs a readiness call (`once`, given the milliseconds left of
/// `timeout`) with the undecided connections among `fds` decided first
/// where their peer's first message is there, and again (with what is
/// left of the timeout) when such a message is what woke it: the call
/// then answers for the connection as it turned out ([`decide_readable`]).
///
/// # Safety
/// `fds` holds `n` pollfds, which `once` polls.
unsafe fn deciding(
    fds: *mut pollfd,
    n: nfds_t,
    timeout: c_int,
    mut once: impl FnMut(c_int) -> c_int,
) -> c_int {
    const WOKE: i16 = libc::POLLIN | libc::POLLHUP | libc::POLLERR;
    let start = Instant::now();
    let mut rounds = 0;
    loop {
        let left = decide_readable(&undecided_in(fds, n));
        let r = once(left_ms(timeout, start));
        rounds += 1;
        // SAFETY: each index is one of the caller's `n` pollfds.
        let woke = left.iter().any(|&i| unsafe { &*fds.add(i) }.revents & WOKE != 0);
        // Bounded: a message that no decision takes off (never seen) is
        // reported as the kernel has it.
        if r <= 0 || !woke || rounds >= 8 {
            return r;
        }
    }
}

fn left_ms(timeout: c_int, start: Instant) -> c_int {
    if timeout < 0 {
        return timeout;
    }
    let spent = start.elapsed().as_millis().min(c_int::MAX as u128) as c_int;
    (timeout - spent).max(0)
}

/// The carried links among `fds` asked for `POLLIN` or `POLLOUT`, with
/// their index.
fn carried_in(fds: *mut pollfd, n: nfds_t) -> Vec<(usize, Arc<Link>)> {
    match Guard::enter() {
        Some(_g) if !fds.is_null() => keep_errno(|| {
            let mut others = Vec::new();
            let links = (0..n as usize)
                .filter_map(|i| {
                    // SAFETY: `fds` holds `n` pollfds (poll's contract).
                    let p = unsafe { &*fds.add(i) };
                    if p.events & (libc::POLLIN | libc::POLLOUT) == 0 {
                        return None;
                    }
                    let l = carried(p.fd);
                    match &l {
                        Some(l) => l.never_lazy(),
                        None => others.push(p.fd),
                    }
                    l.map(|l| (i, l))
                })
                .collect();
            // An epoll set polled: its connections arm at once.
            if !others.is_empty() {
                crate::epoll::polled(others.into_iter());
            }
            links
        }),
        _ => Vec::new(),
    }
}

/// Threads of this process in a readiness call that may wait (from before
/// it arms what it waits for until its wait returned). A non-blocking
/// read leaves a connection's ring unarmed only while there are none
/// ([`Link::read`]): the wait of another thread may be for it.
pub(crate) static SLEEPERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Whether a thread of this process is in a readiness call that may wait.
pub(crate) fn sleeping() -> bool {
    SLEEPERS.load(std::sync::atomic::Ordering::SeqCst) != 0
}

/// One thread counted in [`SLEEPERS`] while it lives.
struct Sleeper;

impl Sleeper {
    fn new(waits: bool) -> Option<Sleeper> {
        waits.then(|| {
            SLEEPERS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Sleeper
        })
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        SLEEPERS.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Runs `call` (a poll given the milliseconds left of `timeout` since its
/// start) until something is ready that is not only stale wake bytes on a
/// carried socket (whose `POLLIN` is taken back), or the time is up.
///
/// `POLLOUT` of a carried socket is the ring's: while the ring is full
/// the socket is not asked for it (the kernel socket has it). Instead the
/// call asks the peer's reader for a sound when it gives credits back
/// ([`crate::credit`]: `WANT`, answered by a send that the progress
/// thread takes) and polls a [`crate::credit::Waiter`] of its own beside
/// the program's descriptors, which the answer makes readable; so a call
/// that waits on a full ring sleeps until credits come (or something else
/// is ready), with no periodic look. Where no sound can come (no
/// completion channel, a peer library without answers), it looks at the
/// ring every [`FULL_SLICE`], as before.
///
/// `call` polls the pollfds it is given for the time it is given
/// (`None`: for ever).
///
/// # Safety
/// `fds` holds `n` pollfds.
unsafe fn poll_filtered(
    fds: *mut pollfd,
    n: nfds_t,
    links: &[(usize, Arc<Link>)],
    timeout: c_int,
    mut call: impl FnMut(*mut pollfd, nfds_t, Option<Duration>) -> c_int,
) -> c_int {
    const OUT: i16 = libc::POLLOUT | libc::POLLWRNORM;
    const IN: i16 = libc::POLLIN | libc::POLLRDNORM;
    let deadline = u64::try_from(timeout).ok().map(|ms| Instant::now() + Duration::from_millis(ms));
    let left = || deadline.map(|d| d.saturating_duration_since(Instant::now()));
    let mut yielded = false;
    let _sleeper = Sleeper::new(timeout != 0);
    // Bytes that wait without a wake byte (left by a lazy read): readable.
    let mut ready_in: Vec<usize> = links
        .iter()
        .filter(|(i, l)| {
            // SAFETY: `i` indexes one of the caller's `n` pollfds.
            unsafe { &*fds.add(*i) }.events & libc::POLLIN != 0 && unarmed_ready(l)
        })
        .map(|(i, _)| *i)
        .collect();
    loop {
        let mut full = Vec::new();
        for (i, l) in links {
            // SAFETY: `i` indexes one of the caller's `n` pollfds.
            let p = unsafe { &mut *fds.add(*i) };
            if p.events & libc::POLLOUT != 0 && !l.writable() {
                full.push((*i, l, p.events));
                p.events &= !OUT;
            }
        }
        let waiter = (!full.is_empty() && left() != Some(Duration::ZERO))
            .then(|| sound_for_credits(full.iter().map(|f| f.1)))
            .flatten();
        // Credits that came before the asks landed: no wait.
        let came = waiter.is_some() && full.iter().any(|f| f.1.writable());
        // Only exec resends queued (`link/outq.rs`): each look pushes
        // them; the kernel takes more only as the program there reads.
        let full_slice = if full.iter().all(|f| f.1.out_queued()) { Link::OUT_SLICE } else { FULL_SLICE };
        let slice = match (full.is_empty() || waiter.is_some(), left()) {
            _ if came || !ready_in.is_empty() => Some(Duration::ZERO),
            (true, l) => l,
            (false, None) => Some(full_slice),
            (false, Some(l)) => Some(l.min(full_slice)),
        };
        let mut r = match &waiter {
            None => call(fds, n, slice),
            Some(w) => {
                // The program's pollfds and the waiter's, in a copy.
                // SAFETY: `fds` holds `n` pollfds.
                let mut all = unsafe { std::slice::from_raw_parts(fds, n as usize) }.to_vec();
                all.push(pollfd { fd: w.fd(), events: libc::POLLIN, revents: 0 });
                let mut r = call(all.as_mut_ptr(), all.len() as nfds_t, slice);
                if r > 0 && all[n as usize].revents != 0 {
                    r -= 1;
                }
                for (k, p) in all[..n as usize].iter().enumerate() {
                    // SAFETY: `k < n`.
                    unsafe { (*fds.add(k)).revents = p.revents };
                }
                r
            }
        };
        drop(waiter);
        for &(i, l, events) in &full {
            // SAFETY: as above.
            let p = unsafe { &mut *fds.add(i) };
            p.events = events;
            if r >= 0 && l.writable() {
                if p.revents == 0 {
                    r += 1;
                }
                p.revents |= events & OUT;
            }
        }
        if r < 0 {
            return r;
        }
        for i in ready_in.drain(..) {
            // SAFETY: `i` indexes one of the caller's `n` pollfds.
            let p = unsafe { &mut *fds.add(i) };
            if p.revents == 0 {
                r += 1;
            }
            p.revents |= p.events & IN;
        }
        for (i, l) in links {
            // SAFETY: `i` indexes one of the caller's `n` pollfds.
            let p = unsafe { &mut *fds.add(*i) };
            if p.revents & libc::POLLIN != 0 && stale(l) {
                p.revents &= !(libc::POLLIN | libc::POLLRDNORM);
                if p.revents == 0 {
                    r -= 1;
                }
            }
        }
        if r > 0 {
            return r;
        }
        if left() == Some(Duration::ZERO) {
            // A call that does not wait, and nothing ready: a program
            // spinning on it would hold the CPU its peer needs to make it
            // ready ([`spin_yield`]); one more look after the yield.
            if timeout == 0 && !yielded && spin_yield() {
                yielded = true;
                continue;
            }
            return r;
        }
    }
}

/// For a readiness call that does not wait (a zero timeout) and found
/// nothing ready among descriptors that include a carried connection:
/// if this thread's previous such call (one that found nothing) came
/// less than [`TIGHT`] ago, the program spins on them, and the call gives
/// the CPU up once (whether it did: the caller then looks once more). A program that
/// spins so (rstream's asynchronous mode, a busy-polling event loop)
/// waits for its peer to read or write the ring; where the two share a
/// CPU, the spinner would otherwise hold it for the rest of its time
/// slice (milliseconds) each time the ring's 256 KiB are full or empty,
/// where a kernel socket's buffers (megabytes) hand over far less often
/// (`docs/sockets.md`, "Costs, and the benchmark"). A program that looks
/// now and then between work of its own (a frame loop) is not a spinner
/// and keeps its CPU. Alone on its CPU the yield returns at once.
/// (Yielding only after 50 µs of such calls was tried: two spinners
/// sharing a CPU then paid the 50 µs at each hand-over, a 64-byte round
/// trip of 140 µs against 32.)
fn spin_yield() -> bool {
    let now = Instant::now();
    let last = LAST_EMPTY.with(|c| c.replace(Some(now)));
    if last.is_none_or(|t| now.duration_since(t) >= TIGHT) {
        return false;
    }
    SPIN_YIELDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    std::thread::yield_now();
    LAST_EMPTY.with(|c| c.set(Some(Instant::now())));
    true
}

/// Calls that find nothing this close together are a spin ([`spin_yield`]).
const TIGHT: Duration = Duration::from_micros(20);

thread_local! {
    /// When this thread's last readiness call that did not wait found
    /// nothing ready ([`spin_yield`]).
    static LAST_EMPTY: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

/// How many times [`spin_yield`] gave the CPU up (the library's
/// `VRDMA_SOCKETS_DEBUG` output at a close).
pub(crate) static SPIN_YIELDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A [`crate::credit::Waiter`] that the answers of each of `full` will
/// ring (registered first, then each asks: an answer that comes after the
/// ask finds it); `None` where one of them cannot be answered (the caller
/// looks at the rings itself).
fn sound_for_credits<'a>(full: impl Iterator<Item = &'a Arc<Link>>) -> Option<crate::credit::Waiter> {
    let _g = Guard::enter()?;
    keep_errno(|| {
        let w = crate::credit::Waiter::new()?;
        let mut full = full;
        full.all(|l| l.ask_credits() != crate::link::Ask::No).then_some(w)
    })
}

/// How long a poll waits at a time while a carried socket it asks for
/// `POLLOUT` has its ring full and no sound can come for its credits
/// (100 µs: a 256 KiB ring drains in about 200 µs at 10 Gbit/s).
const FULL_SLICE: Duration = Duration::from_micros(100);

/// A duration as a timespec (`None`: none, for ever).
fn dur_ts(d: Option<Duration>) -> Option<timespec> {
    d.map(|d| timespec { tv_sec: d.as_secs().min(i32::MAX as u64) as _, tv_nsec: d.subsec_nanos() as _ })
}

/// `poll`, with the readability of a carried socket that is only stale
/// wake bytes taken back (and waited again while nothing else is ready
/// and time is left): a program told `POLLIN` reads, and a blocking read
/// with an empty ring would wait (`docs/sockets.md`).
#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int {
    settle(waits_ms(timeout));
    // SAFETY: the caller's `n` pollfds, polled by `poll_once`.
    unsafe { deciding(fds, n, timeout, |timeout| poll_once(fds, n, timeout)) }
}

/// `poll` with the undecided connections as they are.
///
/// # Safety
/// `fds` holds `n` pollfds (poll's contract).
unsafe fn poll_once(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int {
    let links = carried_in(fds, n);
    if links.is_empty() {
        // SAFETY: libc's poll with the caller's arguments.
        return unsafe { real::poll(fds, n, timeout) };
    }
    // SAFETY: libc's poll with the caller's arguments, its timeout less
    // the time spent.
    // (ppoll without a signal mask is poll, with a finer timeout.)
    unsafe {
        poll_filtered(fds, n, &links, timeout, |fds, n, d| {
            let t = dur_ts(d);
            real::ppoll(
                fds,
                n,
                t.as_ref().map_or(std::ptr::null(), |t| t as *const timespec),
                std::ptr::null(),
            )
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn __poll_chk(fds: *mut pollfd, n: nfds_t, timeout: c_int, len: usize) -> c_int {
    if (n as usize).saturating_mul(std::mem::size_of::<pollfd>()) > len {
        const MSG: &[u8] = b"*** buffer overflow detected ***: terminated\n";
        // SAFETY: write(2) of a static buffer to stderr, then abort, as
        // glibc's __chk_fail does.
        unsafe {
            libc::syscall(libc::SYS_write, 2, MSG.as_ptr(), MSG.len());
            libc::abort()
        }
    }
    // SAFETY: `poll` with the caller's arguments, checked as glibc does.
    unsafe { poll(fds, n, timeout) }
}

#[no_mangle]
pub unsafe extern "C" fn ppoll(
    fds: *mut pollfd,
    n: nfds_t,
    ts: *const timespec,
    mask: *const sigset_t,
) -> c_int {
    settle(waits_ts(ts));
    if carried_in(fds, n).is_empty() && undecided_in(fds, n).is_empty() {
        // SAFETY: libc's ppoll with the caller's arguments.
        return unsafe { real::ppoll(fds, n, ts, mask) };
    }
    // As `poll` (milliseconds: a finer timeout is rounded up).
    // SAFETY: libc's ppoll with the caller's arguments, its timeout less
    // the time spent.
    unsafe {
        deciding(fds, n, ts_ms(ts), |timeout| {
            let links = carried_in(fds, n);
            poll_filtered(fds, n, &links, timeout, |fds, n, d| {
                let t = dur_ts(d);
                real::ppoll(fds, n, t.as_ref().map_or(std::ptr::null(), |t| t as *const timespec), mask)
            })
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn select(
    n: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
    tv: *mut timeval,
) -> c_int {
    // SAFETY: the caller's timeval, null or valid (select's contract).
    let asked_tv = unsafe { tv.as_ref() }.copied();
    settle(asked_tv.is_none_or(|t| t.tv_sec != 0 || t.tv_usec != 0));
    // SAFETY: each set null or valid (select's contract).
    let Some(mut fds) = (unsafe { sets_to_pollfds(n, [r, w, e]) }) else {
        // SAFETY: libc's select with the caller's arguments.
        return unsafe { real::select(n, r, w, e, tv) };
    };
    // Microseconds rounded up to milliseconds.
    let timeout = asked_tv.map_or(-1, |t| {
        let ms = (t.tv_sec.max(0) as u128) * 1000 + (t.tv_usec.max(0) as u128).div_ceil(1000);
        ms.min(c_int::MAX as u128) as c_int
    });
    let start = Instant::now();
    // SAFETY: `fds` is ours; each set null or valid (select's contract).
    let k = unsafe { select_by_poll(&mut fds, [r, w, e], timeout, std::ptr::null()) };
    // Linux's select leaves the time left in `tv`.
    // SAFETY: the caller's timeval, null or valid (select's contract).
    if let Some(t) = unsafe { tv.as_mut() } {
        let left = left_ms(timeout, start);
        t.tv_sec = (left / 1000) as _;
        t.tv_usec = ((left % 1000) * 1000) as _;
    }
    k
}

/// `pselect`, as `select` (the timeout in milliseconds, a finer one
/// rounded up, as `ppoll`'s; `pselect` leaves it as it was).
#[no_mangle]
pub unsafe extern "C" fn pselect(
    n: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
    ts: *const timespec,
    mask: *const sigset_t,
) -> c_int {
    settle(waits_ts(ts));
    // SAFETY: each set null or valid (pselect's contract).
    let Some(mut fds) = (unsafe { sets_to_pollfds(n, [r, w, e]) }) else {
        // SAFETY: libc's pselect with the caller's arguments.
        return unsafe { real::pselect(n, r, w, e, ts, mask) };
    };
    // SAFETY: `fds` is ours; each set null or valid; `mask` null or valid.
    unsafe { select_by_poll(&mut fds, [r, w, e], ts_ms(ts), mask) }
}

/// The descriptors of the sets `r`, `w`, `e` (null: none) as pollfds
/// (`POLLIN`, `POLLOUT`, `POLLPRI`), if one of them is a carried
/// connection asked for reading or writing, or an undecided one asked for
/// reading; `None`: none is, the kernel's select answers as it is.
///
/// # Safety
/// Each set is null or a valid fd_set.
unsafe fn sets_to_pollfds(n: c_int, sets: [*mut fd_set; 3]) -> Option<Vec<pollfd>> {
    let _g = Guard::enter()?;
    let events = [libc::POLLIN, libc::POLLOUT, libc::POLLPRI];
    let fds: Vec<pollfd> = (0..n.clamp(0, libc::FD_SETSIZE as c_int))
        .filter_map(|fd| {
            let ev = sets.iter().zip(events).fold(0, |ev, (&set, bit)| {
                // SAFETY: `set` is null or a valid fd_set; `fd` is below
                // FD_SETSIZE.
                if !set.is_null() && unsafe { libc::FD_ISSET(fd, set) } {
                    ev | bit
                } else {
                    ev
                }
            });
            (ev != 0).then_some(pollfd { fd, events: ev, revents: 0 })
        })
        .collect();
    let any = fds.iter().any(|p| p.events & (libc::POLLIN | libc::POLLOUT) != 0 && carried(p.fd).is_some());
    drop(_g);
    (any || !undecided_in(fds.as_ptr(), fds.len() as nfds_t).is_empty()).then_some(fds)
}

/// `select` (and `pselect`, with `mask`) as `poll` answers the pollfds of
/// its sets ([`poll_filtered`]: a carried socket's readability without
/// stale wake bytes, its writability the ring's), written back into the
/// sets as Linux's select reads a poll mask: readable on `POLLIN`,
/// `POLLHUP` or `POLLERR`, writable on `POLLOUT` or `POLLERR`, exceptional
/// on `POLLPRI`; a descriptor not open fails the call with `EBADF`. The
/// count is of the bits set. A descriptor reported for a condition the
/// sets do not ask for (a hang-up of one asked only for writing) is left
/// out of the next round rather than waking it again and again.
///
/// # Safety
/// Each set is null or a valid fd_set; `fds` are their descriptors
/// ([`sets_to_pollfds`]); `mask` is null or a valid sigset_t.
unsafe fn select_by_poll(
    fds: &mut [pollfd],
    sets: [*mut fd_set; 3],
    timeout: c_int,
    mask: *const sigset_t,
) -> c_int {
    const RD: i16 = libc::POLLIN | libc::POLLRDNORM | libc::POLLRDBAND | libc::POLLHUP | libc::POLLERR;
    const WR: i16 = libc::POLLOUT | libc::POLLWRNORM | libc::POLLWRBAND | libc::POLLERR;
    const EX: i16 = libc::POLLPRI;
    let start = Instant::now();
    let (ptr, len) = (fds.as_mut_ptr(), fds.len() as nfds_t);
    loop {
        // SAFETY: `ptr` holds our `len` pollfds, which `call` polls.
        let k = unsafe {
            deciding(ptr, len, left_ms(timeout, start), |timeout| {
                let links = carried_in(ptr, len);
                poll_filtered(ptr, len, &links, timeout, |ptr, len, d| {
                    let t = dur_ts(d);
                    real::ppoll(ptr, len, t.as_ref().map_or(std::ptr::null(), |t| t as *const timespec), mask)
                })
            })
        };
        if k < 0 {
            return k;
        }
        if fds.iter().any(|p| p.fd >= 0 && p.revents & libc::POLLNVAL != 0) {
            // SAFETY: errno of this thread.
            unsafe { *libc::__errno_location() = libc::EBADF };
            return -1;
        }
        let ready = |p: &pollfd, kind: usize| {
            let (asked, got) = [(libc::POLLIN, RD), (libc::POLLOUT, WR), (libc::POLLPRI, EX)][kind];
            p.events & asked != 0 && p.revents & got != 0
        };
        let count: usize = fds.iter().map(|p| (0..3).filter(|&s| ready(p, s)).count()).sum();
        if count > 0 || left_ms(timeout, start) == 0 {
            for (s, &set) in sets.iter().enumerate() {
                if set.is_null() {
                    continue;
                }
                // SAFETY: `set` is the caller's valid set.
                unsafe { libc::FD_ZERO(set) };
                for p in fds.iter().filter(|p| p.fd >= 0 && ready(p, s)) {
                    // SAFETY: as above; `p.fd` is below FD_SETSIZE.
                    unsafe { libc::FD_SET(p.fd, set) };
                }
            }
            return count as c_int;
        }
        // Only conditions not asked for: those descriptors sit the next
        // rounds out (poll ignores a negative descriptor).
        for p in fds.iter_mut().filter(|p| p.revents != 0) {
            p.fd = !p.fd;
        }
    }
}

/// A timespec's milliseconds (rounded up; null: -1, for ever).
fn ts_ms(ts: *const timespec) -> c_int {
    // SAFETY: the caller's timespec, null or valid.
    match unsafe { ts.as_ref() } {
        None => -1,
        Some(t) => {
            let ms = (t.tv_sec.max(0) as u128) * 1000 + (t.tv_nsec.max(0) as u128).div_ceil(1_000_000);
            ms.min(c_int::MAX as u128) as c_int
        }
    }
}

/// Milliseconds as a timespec (negative: none, for ever).
fn ms_ts(ms: c_int) -> Option<timespec> {
    (ms >= 0).then(|| timespec { tv_sec: (ms / 1000) as _, tv_nsec: ((ms % 1000) * 1_000_000) as _ })
}

/// Whether `ep` holds registrations of carried connections.
fn tracked(ep: c_int) -> bool {
    match Guard::enter() {
        Some(_g) => keep_errno(|| crate::epoll::tracks(ep)),
        None => false,
    }
}

/// After an epoll wait on `ep` reported the `n` events at `ev`: the
/// connections among them not decided yet whose report may be the peer's
/// first message are decided now, as `poll` does ([`decide_if_bytes`]),
/// and their events answer for what they turned out: plain TCP, the
/// kernel's readiness, so `EPOLLIN` is taken back where the socket holds
/// nothing after the decline; carried, the ring's, which
/// [`crate::epoll::reported`] then sees to (readability that is only the
/// socket's, with an empty ring, is taken back as stale). A report left
/// empty is dropped (a one-shot registration armed again), and the wait
/// goes on. Nothing is lost to an edge-triggered registration: bytes that
/// came before the look are reported now, and those that come after it
/// raise an edge of their own (a wake byte, once carried). Returns the
/// events left ([`crate::epoll::reported`]).
///
/// Another thread's wait given the same report is answered the same: one
/// whose message is gone from the socket when it counts waits for the
/// decision that took it (the first thread's, still running) and answers
/// as it turned out, and so does one that finds it decided already
/// ([`crate::epoll::report_or_undecided`]). One whose message is gone and
/// that nobody decides (the peer's end or an error: nothing can follow
/// them) is not looked at again ([`crate::epoll::nothing_to_decide`]).
/// The wait for another thread's decision is bounded by `left`, the
/// milliseconds left of the wait's timeout (negative: none;
/// [`crate::stream::Stream::decided_after`]): one not known by then is
/// answered as the kernel reported it, and looked at again at the next
/// report.
///
/// # Safety
/// `ev` holds `n` events.
unsafe fn report(ep: c_int, ev: *mut epoll_event, n: c_int, left: c_int) -> c_int {
    #[cfg(test)]
    hook::after_kernel();
    // SAFETY: `ev` holds `n` events.
    let undecided = match unsafe { crate::epoll::report_or_undecided(ep, ev, n) } {
        Ok(n) => return n,
        Err(u) => u,
    };
    let mut nothing = Vec::new();
    // (One bound for all of them: the wait's time left.)
    let (start, left) = (Instant::now(), (left >= 0).then(|| Duration::from_millis(left as u64)));
    for u in &undecided {
        let within = left.map(|l| l.saturating_sub(start.elapsed()));
        let decided = match &u.stream {
            Some(stream) if !u.decided => match decide_if_bytes(u.fd) {
                Some(true) => true,
                // Nothing there: perhaps another thread's decision took
                // the message off (its negotiation still running).
                Some(false) => match stream.decided_after(within) {
                    Some(true) => true,
                    // (One that another process settles now before its
                    // exec, or took meanwhile, is left as it is.)
                    Some(false) => {
                        if stream.owner.may_use() {
                            nothing.push((u.fd, Arc::downgrade(stream)));
                        }
                        false
                    }
                    // Not known in the wait's time: the next report looks
                    // again.
                    None => false,
                },
                None => false,
            },
            // Decided since, or gone (plain TCP).
            _ => true,
        };
        if decided && tcp_and_empty(u.fd) {
            // SAFETY: `index < n`; read and written by value (the struct
            // may be packed).
            unsafe {
                let mut e = std::ptr::read(ev.add(u.index));
                e.events &= !(libc::EPOLLIN | libc::EPOLLRDNORM) as u32;
                std::ptr::write(ev.add(u.index), e);
            }
        }
    }
    #[cfg(test)]
    hook::before_nothing();
    crate::epoll::nothing_to_decide(ep, &nothing);
    // SAFETY: `ev` holds `n` events.
    unsafe { crate::epoll::reported(ep, ev, n) }
}

/// Whether `fd`, just decided, turned out plain TCP with nothing to read
/// (no byte, no end, no error).
fn tcp_and_empty(fd: c_int) -> bool {
    let Some(_g) = Guard::enter() else { return false };
    keep_errno(|| {
        if matches!(table::get(fd), Some(Entry::Stream(_))) {
            return false;
        }
        // A poll, not a peek: a peek would clear an error pending (above).
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd, no wait.
        let r = unsafe { real::poll(&mut p, 1, 0) };
        r == 0 || (r > 0 && p.revents & (libc::POLLIN | libc::POLLERR | libc::POLLHUP) == 0)
    })
}

/// Runs `call` (an epoll wait given the milliseconds left of `timeout`)
/// until it reports something that is not only stale wake bytes of a
/// carried socket, or the time is up ([`crate::epoll::reported`]), the
/// connections it reports before their first call decided first
/// ([`report`]).
///
/// # Safety
/// `ev` has room for the events `call` reports.
unsafe fn epoll_filtered(
    ep: c_int,
    ev: *mut epoll_event,
    max: c_int,
    timeout: c_int,
    mut call: impl FnMut(c_int) -> c_int,
) -> c_int {
    let start = Instant::now();
    let mut yielded = false;
    if timeout != 0 && crate::link::lazy_epoll() {
        // Connections that non-blocking reads left unarmed: their rings
        // are watched a moment before the wait arms them and sleeps, so
        // that bytes that come meanwhile cost their writer no wake byte
        // (a `send`) and this end no kernel wake-up.
        let watch = crate::link::watch_for();
        loop {
            let (found, any, _) = crate::epoll::lazy_scan(ep, false);
            if !any || !found.is_empty() {
                break;
            }
            let n = call(0);
            if n < 0 {
                return n;
            }
            if n > 0 {
                // SAFETY: `call` wrote `n` events at `ev`.
                let n = unsafe { report(ep, ev, n, left_ms(timeout, start)) };
                if n > 0 {
                    return n;
                }
            }
            if start.elapsed() >= watch {
                break;
            }
            std::thread::yield_now();
        }
    }
    // From here this thread may sleep: other threads' reads arm at once.
    let _sleeper = Sleeper::new(timeout != 0);
    loop {
        // Bytes that no wake byte announces: reported without waiting;
        // rings left unarmed and empty are armed before the wait sleeps.
        let mut extra = crate::epoll::pending(ep);
        let (lazy, _, busy) = crate::epoll::lazy_scan(ep, timeout != 0);
        extra.extend(lazy);
        let left = left_ms(timeout, start);
        // A ring a read held could not be armed: a short wait, then again.
        let ms = match left {
            _ if !extra.is_empty() => 0,
            l if busy && !(0..=1).contains(&l) => 1,
            l => l,
        };
        let mut n = call(ms);
        if n < 0 {
            return n;
        }
        for x in extra {
            // SAFETY: `call` wrote `n` events at `ev`, which has room for
            // `max`; read and written by value (the struct may be packed).
            let same = (0..n as usize).find(|&i| unsafe { std::ptr::read(ev.add(i)) }.u64 == x.u64);
            match same {
                // SAFETY: `i < n`, an event `call` wrote.
                Some(i) => unsafe {
                    let mut e = std::ptr::read(ev.add(i));
                    e.events |= x.events;
                    std::ptr::write(ev.add(i), e);
                },
                None if n < max => {
                    // SAFETY: as above, `n < max`.
                    unsafe { std::ptr::write(ev.add(n as usize), x) };
                    n += 1;
                }
                None => {}
            }
        }
        let waited = n == 0;
        if n > 0 {
            // SAFETY: `call` wrote `n` events at `ev`.
            n = unsafe { report(ep, ev, n, left_ms(timeout, start)) };
        }
        if n > 0 || (waited && !busy) || left_ms(timeout, start) == 0 {
            // As `poll_filtered`: a program spinning on calls that do not
            // wait lets its peer run.
            if n == 0 && timeout == 0 && !yielded && spin_yield() {
                yielded = true;
                continue;
            }
            return n;
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_wait(ep: c_int, ev: *mut epoll_event, max: c_int, timeout: c_int) -> c_int {
    settle(waits_ms(timeout));
    if !tracked(ep) {
        // SAFETY: libc's epoll_wait with the caller's arguments.
        return unsafe { real::epoll_wait(ep, ev, max, timeout) };
    }
    // SAFETY: libc's epoll_wait with the caller's arguments, its timeout
    // less the time spent.
    unsafe { epoll_filtered(ep, ev, max, timeout, |ms| real::epoll_wait(ep, ev, max, ms)) }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait(
    ep: c_int,
    ev: *mut epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const sigset_t,
) -> c_int {
    settle(waits_ms(timeout));
    if !tracked(ep) {
        // SAFETY: libc's epoll_pwait with the caller's arguments.
        return unsafe { real::epoll_pwait(ep, ev, max, timeout, mask) };
    }
    // SAFETY: as `epoll_wait`.
    unsafe { epoll_filtered(ep, ev, max, timeout, |ms| real::epoll_pwait(ep, ev, max, ms, mask)) }
}

/// `epoll_pwait2` (a timespec timeout; glibc 2.35 and later).
#[no_mangle]
pub unsafe extern "C" fn epoll_pwait2(
    ep: c_int,
    ev: *mut epoll_event,
    max: c_int,
    ts: *const timespec,
    mask: *const sigset_t,
) -> c_int {
    settle(waits_ts(ts));
    if !tracked(ep) {
        // SAFETY: libc's epoll_pwait2 with the caller's arguments.
        return unsafe { real::epoll_pwait2(ep, ev, max, ts, mask) };
    }
    // SAFETY: as `epoll_wait` (milliseconds: a finer timeout is rounded up).
    unsafe {
        epoll_filtered(ep, ev, max, ts_ms(ts), |ms| {
            let left = ms_ts(ms);
            real::epoll_pwait2(
                ep,
                ev,
                max,
                left.as_ref().map_or(std::ptr::null(), |t| t as *const timespec),
                mask,
            )
        })
    }
}

/// Test only: what a test runs in a wait of its thread right after the
/// kernel's report, before the library looks at it (another thread's
/// decision in that window).
#[cfg(test)]
pub(crate) mod hook {
    use std::cell::RefCell;

    type Hook = RefCell<Option<Box<dyn FnOnce()>>>;

    thread_local! {
        static AFTER_KERNEL: Hook = const { RefCell::new(None) };
        static BEFORE_NOTHING: Hook = const { RefCell::new(None) };
    }

    /// `f` runs once, in this thread's next report.
    pub fn set(f: impl FnOnce() + 'static) {
        AFTER_KERNEL.with(|h| *h.borrow_mut() = Some(Box::new(f)));
    }

    /// `f` runs once, in this thread's next report that decided its
    /// connections, before it says which had nothing to decide on (the
    /// program's close and a new connection in that window).
    pub fn set_before_nothing(f: impl FnOnce() + 'static) {
        BEFORE_NOTHING.with(|h| *h.borrow_mut() = Some(Box::new(f)));
    }

    pub(super) fn after_kernel() {
        run(&AFTER_KERNEL);
    }

    pub(super) fn before_nothing() {
        run(&BEFORE_NOTHING);
    }

    fn run(h: &'static std::thread::LocalKey<Hook>) {
        if let Some(f) = h.with(|h| h.borrow_mut().take()) {
            f();
        }
    }
}
