//! Which process drives a connection that `fork` shared.
//!
//! After `fork` parent and child hold the same kernel socket, and each
//! holds a copy of the library's [`crate::stream::Stream`] for it. Only one
//! of them may negotiate it and carry it: two hellos on one socket, or two
//! processes posting on one QP, would corrupt the stream. The choice is
//! one word in a page that every holder shares (`MAP_SHARED`, so a forked
//! child sees the same word), set by the first process that makes a call
//! on the connection ([`Owner::take`]):
//!
//! - [`FREE`]: nobody made a call yet; the first caller takes it (the
//!   classic forking server: accept in the parent, fork, the child
//!   serves: its first call exchanges the hellos through its own device);
//! - a process id: that process drives it; in any other process a call
//!   fails with `EIO` (the parent's QP and rings are not the child's to
//!   use, and the other way round), unless it was carried before the
//!   fork: then the driver demotes it to plain TCP for both ends, and
//!   every holder goes on over the kernel socket ([`Demote`],
//!   `crate::forkshare`);
//! - [`TCP`]: it turned out plain TCP: every holder passes its calls to
//!   the kernel.
//!
//! A process that takes the connection only to settle it as TCP before an
//! `exec` ([`crate::exec`]) says so in the page's *settler* word while it
//! does: another holder's call then waits for the outcome (TCP, or the
//! connection given back) instead of failing with `EIO`. ncat's `--exec`
//! forks a relay that polls and reads the connection while the relay's own
//! child, about to exec the command with the socket inherited, settles it:
//! the relay's read failed with `EIO` in about one connection in four.
//!
//! A process that does not drive the connection only closes its own
//! descriptors of it when the program closes them: the driver's rings,
//! QP and end of stream are untouched ([`crate::stream::Stream`]'s drop).
//!
//! Where the page cannot be mapped, the word is the creating process's
//! own memory, set to its id: a child never takes such a connection (it
//! fails with `EIO`, as before this module).
//!
//! The page's next words are the program's values of the socket options
//! the library keeps in the kernel on a carried connection, one each
//! ([`crate::kept::OPTIONS`]: `TCP_NODELAY`, `TCP_CORK`): options every
//! holder sees alike, as it would the kernel's.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Nobody made a call on the connection yet.
pub const FREE: u32 = 0;
/// The connection is plain TCP, for every holder.
pub const TCP: u32 = u32::MAX;

/// What [`Owner::take`] found.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Take {
    /// This process drives the connection (it took it now or before).
    Mine,
    /// It is plain TCP: the call goes to the kernel.
    Tcp,
    /// Another process drives it.
    Other,
}

pub struct Owner {
    page: Arc<Page>,
}

/// The shared page (or, where it could not be mapped, leaked heap), kept
/// mapped while the connection's stream or link lives
/// ([`Owner::page`]: the link's demotion uses it, `crate::forkshare`).
pub struct Page {
    /// The driver's word and the option words.
    words: *const Words,
    /// Whether `words` is a mapped page (unmapped at drop) or leaked heap.
    mapped: bool,
}

// SAFETY: `words` points to atomics that live as long as the Page (a
// page unmapped only by its drop, or leaked heap); atomics may be used
// from any thread.
unsafe impl Send for Page {}
// SAFETY: as above.
unsafe impl Sync for Page {}

const PAGE: usize = 4096;

/// The driver's word, one word per kept option, then the settler's word
/// (the id of the process settling it before an exec, or 0); then the
/// words of the demotion ([`Demote`]).
#[repr(C)]
struct Words {
    w: [AtomicU32; 2 + OPTIONS],
    demote: Demote,
}
const OPTIONS: usize = crate::kept::OPTIONS.len();
const SETTLER: usize = 1 + OPTIONS;

/// The words with which the holders of a connection carried before a
/// fork share it (`crate::forkshare`, `docs/sockets.md` "Sharing a carried
/// connection after fork").
#[repr(C)]
pub struct Demote {
    /// The process that asks the driver to demote it (0: nobody).
    pub req: AtomicU32,
    /// [`D_NONE`], [`D_DEMOTING`], [`D_DEMOTED`], [`D_DONE`] or [`D_FAILED`].
    pub state: AtomicU32,
    /// The process reading the ring now (a lock between processes), or 0.
    pub lock: AtomicU32,
    /// Set by the driver's fork handler: a process forked while it
    /// carried the connection (its close demotes it instead of ending it).
    pub forked: AtomicU32,
    /// Bytes read from the ring (a running count), by any holder.
    pub rd: AtomicU64,
    /// Forked children that hold it (their ids, 0: a free slot), each
    /// cleared at its close or exec; and whether more came than the slots
    /// hold. The driver's close demotes it only while one may hold it.
    pub holders: [AtomicU32; HOLDERS],
    pub overflow: AtomicU32,
    /// Forks begun whose child has not recorded itself yet (the parent
    /// may close at once after the fork, before the child's handler ran).
    pub pending: AtomicU32,
    /// When the last fork began (monotonic milliseconds): a pending count
    /// older than [`PENDING_AGE`] is stale (a fork that failed, whose
    /// parent handler ran all the same, or a child that could not record
    /// itself), not a holder for ever.
    pub pending_at: AtomicU64,
}

/// How long a fork begun may leave its child unrecorded.
pub const PENDING_AGE: Duration = Duration::from_secs(5);

/// The monotonic clock (the same in every process), in milliseconds.
fn now_ms() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime(2) into a valid timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec as u64 * 1000 + t.tv_nsec as u64 / 1_000_000
}

/// Whether a `kill(pid, 0)` that returned `r` (errno `errno`) says the
/// process is gone: only `ESRCH` does (`EPERM`: it exists, another
/// user's).
pub fn gone(r: i32, errno: i32) -> bool {
    r != 0 && errno == libc::ESRCH
}

/// Whether process `pid` exists (a zombie not reaped yet included).
pub fn exists(pid: u32) -> bool {
    // (0 and the negative ids name groups, not a process.)
    if pid == 0 || pid > i32::MAX as u32 {
        return false;
    }
    // SAFETY: kill(2) with signal 0 only asks whether the process exists.
    let r = unsafe { libc::kill(pid as i32, 0) };
    !gone(r, if r != 0 { crate::table::errno() } else { 0 })
}

/// Slots for forked holders ([`Demote::holders`]).
pub const HOLDERS: usize = 8;

/// Not demoted.
pub const D_NONE: u32 = 0;
/// The driver took the request and demotes it now.
pub const D_DEMOTING: u32 = 1;
/// This end's marker is sent: every holder writes to the kernel socket
/// and reads the ring, then the peer's marker, then the kernel socket.
pub const D_DEMOTED: u32 = 2;
/// The peer's marker was taken: plain TCP (the driver word says so too).
pub const D_DONE: u32 = 3;
/// The demotion failed half way (the peer is gone): every call fails.
pub const D_FAILED: u32 = 4;

impl Demote {
    /// A fork begins: its child will hold it.
    pub fn forking(&self) {
        self.pending_at.store(now_ms(), Ordering::Release);
        self.pending.fetch_add(1, Ordering::AcqRel);
    }

    /// A forked child holds it now: a free slot, or one whose process is
    /// gone (a child that exited without closing it).
    pub fn hold(&self, pid: u32) {
        let _ = self.pending.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| Some(n.saturating_sub(1)));
        for h in &self.holders {
            let p = h.load(Ordering::Acquire);
            let free = p == 0 || (p != pid && !exists(p));
            if free && h.compare_exchange(p, pid, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                return;
            }
        }
        self.overflow.store(1, Ordering::Release);
    }

    /// Whether forks begun may still have children that did not record
    /// themselves yet (stale after [`PENDING_AGE`]).
    fn pending_now(&self) -> bool {
        self.pending.load(Ordering::Acquire) != 0
            && now_ms().saturating_sub(self.pending_at.load(Ordering::Acquire))
                < PENDING_AGE.as_millis() as u64
    }

    /// A forked child let it go (its close, or its exec).
    pub fn unhold(&self, pid: u32) {
        for h in &self.holders {
            let _ = h.compare_exchange(pid, 0, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    /// Whether a process other than this one may still hold it (a
    /// recorded child that exists, an exited one not reaped yet included,
    /// or more children than the slots hold).
    pub fn held_elsewhere(&self) -> bool {
        let me = crate::pid::get();
        self.overflow.load(Ordering::Acquire) != 0
            || self.pending_now()
            || self.holders.iter().any(|h| {
                let p = h.load(Ordering::Acquire);
                p != 0 && p != me && exists(p)
            })
    }
}

impl Page {
    fn words(&self) -> &Words {
        // SAFETY: see the `Send` impl: valid while `self` lives.
        unsafe { &*self.words }
    }

    /// The demotion's words; `None` where they are this process's own
    /// memory (not shared with a forked child).
    pub fn demote(&self) -> Option<&Demote> {
        self.mapped.then(|| &self.words().demote)
    }

    /// The driver found it plain TCP (or the demotion ended): so it is
    /// for every holder.
    pub fn set_tcp(&self) {
        self.words().w[0].store(TCP, Ordering::Release);
    }

    /// The driver's word: the process that drives it, [`FREE`] or [`TCP`].
    pub fn driver(&self) -> u32 {
        self.words().w[0].load(Ordering::Acquire)
    }

    /// The program's value of kept option `slot` ([`Owner::option`]).
    pub fn option(&self, slot: usize) -> &AtomicU32 {
        &self.words().w[1 + slot]
    }
}

impl Drop for Page {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: this process's mapping of the page, made in `new`
            // (or inherited through fork), unmapped once; the atomics are
            // not used after (the Page is going).
            unsafe { libc::munmap(self.words as *mut libc::c_void, PAGE) };
        }
    }
}

impl Owner {
    /// A new connection's word: free, in a shared page.
    pub fn new() -> Owner {
        // SAFETY: a fresh anonymous mapping; no existing memory is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            // Ours only: a child will not take it.
            let w: &'static Words = Box::leak(Box::new(Words {
                w: std::array::from_fn(|i| AtomicU32::new(if i == 0 { crate::pid::get() } else { 0 })),
                demote: Demote {
                    req: AtomicU32::new(0),
                    state: AtomicU32::new(0),
                    lock: AtomicU32::new(0),
                    forked: AtomicU32::new(0),
                    rd: AtomicU64::new(0),
                    holders: std::array::from_fn(|_| AtomicU32::new(0)),
                    overflow: AtomicU32::new(0),
                    pending: AtomicU32::new(0),
                    pending_at: AtomicU64::new(0),
                },
            }));
            return Owner { page: Arc::new(Page { words: w, mapped: false }) };
        }
        // An anonymous mapping is zeroed: the word reads FREE, the option
        // words "the kernel's", the demotion's words none.
        const _: () = assert!(std::mem::size_of::<Words>() <= PAGE);
        Owner { page: Arc::new(Page { words: p.cast::<Words>(), mapped: true }) }
    }

    /// The shared page, for the connection's link.
    pub fn page(&self) -> Arc<Page> {
        self.page.clone()
    }

    fn word(&self) -> &AtomicU32 {
        &self.page.words().w[0]
    }

    /// The program's value of kept option `slot` on the connection,
    /// shared by every holder ([`crate::kept`]; 0 until the connection is
    /// carried).
    pub fn option(&self, slot: usize) -> &AtomicU32 {
        self.page.option(slot)
    }

    fn settler(&self) -> &AtomicU32 {
        &self.page.words().w[SETTLER]
    }

    /// The demotion's words, where the page is shared.
    pub fn demote(&self) -> Option<&Demote> {
        self.page.demote()
    }

    /// Takes the connection for this process if nobody has it. While
    /// another process that took it settles it before an exec
    /// ([`Owner::settling`]), waits for the outcome, at most `bound()`
    /// (the longest a settling waits for its peer, and some).
    pub fn take(&self, bound: impl Fn() -> Duration) -> Take {
        let me = crate::pid::get();
        let mut since: Option<Instant> = None;
        loop {
            // Every call asks: a load where it is decided already.
            let w = match self.word().load(Ordering::Acquire) {
                w if w == me => return Take::Mine,
                TCP => return Take::Tcp,
                FREE => match self.word().compare_exchange(FREE, me, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return Take::Mine,
                    Err(w) if w == me => return Take::Mine,
                    Err(TCP) => return Take::Tcp,
                    Err(w) => w,
                },
                w => w,
            };
            // Another process has it. The settler's word is cleared only
            // after the driver's word changed (to TCP, or given back), so
            // a settler seen here has not finished yet.
            if self.settler().load(Ordering::Acquire) != w {
                return Take::Other;
            }
            let start = *since.get_or_insert_with(Instant::now);
            if start.elapsed() > bound() {
                return Take::Other;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Whether another process settles it before an exec now: this one
    /// waits for the outcome at its next call ([`Owner::take`]).
    pub fn settled_elsewhere(&self) -> bool {
        let w = self.word().load(Ordering::Acquire);
        w != crate::pid::get() && w != FREE && w != TCP && self.settler().load(Ordering::Acquire) == w
    }

    /// This process, which took the connection, settles it before an exec
    /// (`on`), or is done (after [`Owner::set_tcp`] or
    /// [`Owner::release`]): see [`Owner::take`].
    pub fn settling(&self, on: bool) {
        self.settler().store(if on { crate::pid::get() } else { 0 }, Ordering::Release);
    }

    /// The other process that drives it now (it took it and is not
    /// settling it before an exec: this one's calls fail with `EIO`, and
    /// a readiness call need not try to decide it, [`crate::epoll`]), if
    /// any. Each word is read once: two reads of the driver's word could
    /// mix two states (another process's id, then `TCP`).
    pub fn driver_elsewhere(&self) -> Option<u32> {
        let w = self.word().load(Ordering::Acquire);
        if w == FREE || w == TCP || w == crate::pid::get() {
            return None;
        }
        (self.settler().load(Ordering::Acquire) != w).then_some(w)
    }

    /// Whether it turned out plain TCP (for every holder: never changes
    /// again).
    pub fn is_tcp(&self) -> bool {
        self.word().load(Ordering::Acquire) == TCP
    }

    /// Whether this process drives the connection, or may still take it
    /// (nobody made a call yet).
    pub fn may_use(&self) -> bool {
        let w = self.word().load(Ordering::Acquire);
        w == FREE || w == TCP || w == crate::pid::get()
    }

    /// Whether this process drives the connection (took it).
    pub fn mine(&self) -> bool {
        self.word().load(Ordering::Acquire) == crate::pid::get()
    }

    /// This process gives back a connection it took and could not use
    /// (nothing was sent on it): another holder may take it.
    pub fn release(&self) {
        let me = crate::pid::get();
        let _ = self.word().compare_exchange(me, FREE, Ordering::AcqRel, Ordering::Acquire);
    }

    /// The driver found it plain TCP: so it is for every holder.
    pub fn set_tcp(&self) {
        self.word().store(TCP, Ordering::Release);
    }

    /// The driver's word: the process that drives it, [`FREE`] or [`TCP`].
    pub fn driver(&self) -> u32 {
        self.page.driver()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_wait() -> Duration {
        Duration::ZERO
    }

    #[test]
    fn only_esrch_says_a_process_is_gone() {
        assert!(gone(-1, libc::ESRCH));
        // Another user's process: it exists.
        assert!(!gone(-1, libc::EPERM));
        assert!(!gone(0, 0));
        assert!(exists(crate::pid::get()));
    }

    #[test]
    fn a_gone_holders_slot_is_reused_and_a_stale_fork_ages_out() {
        let o = Owner::new();
        let d = o.demote().expect("shared words");
        // A child that exited without closing it, in every slot.
        let dead = {
            let mut c = std::process::Command::new("true").spawn().expect("spawn");
            let id = c.id();
            c.wait().expect("wait");
            id
        };
        for h in &d.holders {
            h.store(dead, Ordering::Release);
        }
        assert!(!d.held_elsewhere());
        // A new child records itself (no overflow): it holds it.
        let live = std::process::Command::new("sleep").arg("5").spawn().expect("spawn");
        d.hold(live.id());
        assert_eq!(d.overflow.load(Ordering::Acquire), 0);
        assert!(d.held_elsewhere());
        d.unhold(live.id());
        assert!(!d.held_elsewhere());
        // A fork begun whose child never recorded itself: held a while,
        // then stale.
        d.forking();
        assert!(d.held_elsewhere());
        d.pending_at.store(now_ms() - PENDING_AGE.as_millis() as u64 - 1, Ordering::Release);
        assert!(!d.held_elsewhere());
        let mut live = live;
        let _ = live.kill();
        let _ = live.wait();
    }

    #[test]
    fn the_first_caller_takes_it_and_tcp_is_everyones() {
        let o = Owner::new();
        assert!(o.may_use());
        assert!(!o.mine());
        assert_eq!(o.take(no_wait), Take::Mine);
        assert!(o.mine());
        assert_eq!(o.take(no_wait), Take::Mine);
        assert!(!o.is_tcp());
        o.set_tcp();
        assert_eq!(o.take(no_wait), Take::Tcp);
        assert!(o.is_tcp() && o.driver_elsewhere().is_none());
        assert!(o.may_use());
        assert!(!o.mine());
    }

    /// A forked child sees the same word: the process that calls first
    /// drives the connection, the other is told so.
    #[test]
    fn a_forked_child_and_its_parent_see_one_word() {
        let o = Owner::new();
        let took = crate::pid::in_forked_child(|| o.take(no_wait) == Take::Mine && o.mine());
        assert!(took, "the child did not take the free word");
        assert_eq!(o.take(no_wait), Take::Other, "the parent took what its child drives");
        assert!(!o.may_use());
        assert!(o.driver_elsewhere().is_some());
    }

    /// A forked child that recorded itself holds the connection for its
    /// parent (whose close then demotes it) until it lets it go; a fork
    /// whose child has not recorded itself yet counts too.
    #[test]
    fn a_recorded_child_holds_it_until_it_lets_it_go() {
        let o = Owner::new();
        let d = o.demote().expect("a shared page");
        assert!(!d.held_elsewhere());
        d.forking();
        assert!(d.held_elsewhere(), "a fork whose child has not recorded itself");
        let child = crate::pid::in_forked_child(|| {
            d.hold(crate::pid::get());
            true
        });
        assert!(child);
        // The child exited and was reaped: it holds nothing any more.
        assert!(!d.held_elsewhere());
        // A live holder (this process's parent stands in for a child).
        // SAFETY: getppid(2) has no arguments.
        let live = unsafe { libc::getppid() } as u32;
        d.hold(live);
        assert!(d.held_elsewhere());
        d.unhold(live);
        assert!(!d.held_elsewhere());
    }

    /// A holder whose sibling settles the connection before an exec waits
    /// for the outcome (TCP) instead of being told another process drives
    /// it (`EIO`: ncat `--exec`'s relay).
    #[test]
    fn a_holder_waits_while_another_settles_it_before_an_exec() {
        let o = std::sync::Arc::new(Owner::new());
        assert_eq!(o.take(no_wait), Take::Mine);
        o.settling(true);
        let settler = {
            let o = o.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(200));
                o.set_tcp();
                o.settling(false);
            })
        };
        let waited = crate::pid::in_forked_child(|| o.take(|| Duration::from_secs(20)) == Take::Tcp);
        settler.join().unwrap();
        assert!(waited, "the child did not wait for the settling parent");
        // Not settling: another process's connection, at once.
        let o = Owner::new();
        assert_eq!(o.take(no_wait), Take::Mine);
        let other = crate::pid::in_forked_child(|| o.take(|| Duration::from_secs(20)) == Take::Other);
        assert!(other);
    }
}
