//! Reference measurements ("anchors") printed beside vRDMA's own benchmark figures.
//!
//! Absolute latency and bandwidth figures drift from machine to machine, and on one
//! machine from run to run (CPU model, frequency scaling, cache topology, other load).
//! A vRDMA figure on its own therefore says little. What transfers between machines is
//! the *ratio* of a vRDMA figure to what raw shared memory achieves on the same box in
//! the same run: vRDMA's data path is shared memory, so raw shared memory is its floor
//! (latency) and its ceiling (bandwidth). The benchmark measures these anchors in the
//! same process and run as its own figures and prints both with the ratio.
//!
//! Two anchors are measured here:
//!
//! * [`memcpy_bandwidth`]: single-thread memcpy bandwidth between two page-aligned
//!   buffers, the ceiling for any data movement that copies.
//! * [`shm_pingpong_one_way_ns`]: one-way latency of a cache-line ping-pong between
//!   two processes through a `MAP_SHARED` anonymous mapping, the floor for any
//!   cross-process notification (on an idle 2-core box roughly 70 ns).
//!
//! Each anchor is repeated and reported as a [`Stat`] (median, min, max). Every loop
//! here is bounded in time: the ping-pong child exits when told to stop or when its own
//! wall-clock deadline passes, and the parent always reaps it (killing it if needed).

use std::alloc::{self, Layout};
use std::hint::black_box;
use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, WaitOptions};
use rustix::thread::CpuSet;

/// Median and spread of repeated runs.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Stat {
    /// Median of the samples (mean of the middle two for an even count).
    pub median: f64,
    /// Smallest sample.
    pub min: f64,
    /// Largest sample.
    pub max: f64,
    /// Number of samples.
    pub runs: usize,
}

impl Stat {
    /// Summarises `samples`. Never panics; an empty slice gives NaNs with `runs` 0.
    /// Samples are ordered with [`f64::total_cmp`], so NaN samples sort to an end
    /// rather than causing a panic.
    pub fn from_samples(samples: &[f64]) -> Stat {
        if samples.is_empty() {
            return Stat { median: f64::NAN, min: f64::NAN, max: f64::NAN, runs: 0 };
        }
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median = if n % 2 == 1 { sorted[n / 2] } else { (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0 };
        Stat { median, min: sorted[0], max: sorted[n - 1], runs: n }
    }
}

// ---------------------------------------------------------------------------
// memcpy bandwidth
// ---------------------------------------------------------------------------

/// Alignment of the memcpy buffers (one 4 KiB page).
const PAGE_ALIGN: usize = 4096;

/// A zero-initialised, page-aligned heap buffer.
struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl AlignedBuf {
    /// Allocates `size` bytes (at least 1), zeroed, aligned to [`PAGE_ALIGN`].
    fn new(size: usize) -> AlignedBuf {
        let layout = match Layout::from_size_align(size.max(1), PAGE_ALIGN) {
            Ok(layout) => layout,
            // Only reachable for sizes within a page of isize::MAX, which no allocator
            // can satisfy anyway.
            Err(_) => panic!("memcpy buffer of {size} bytes is too large"),
        };
        // SAFETY: `layout` has a non-zero size (`size.max(1)`), as `alloc_zeroed` requires.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        match NonNull::new(raw) {
            Some(ptr) => AlignedBuf { ptr, layout },
            None => alloc::handle_alloc_error(layout),
        }
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `layout.size()` initialised (zeroed) bytes that this
        // struct owns until drop; the shared borrow of `self` prevents mutation meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; the exclusive borrow of `self` makes this the only
        // reference to the bytes for its lifetime.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` was returned by `alloc_zeroed` with exactly this `layout` and is
        // freed only here, once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Single-thread memcpy bandwidth in GB/s (1e9 bytes copied per second) for a buffer of
/// `size` bytes, copying between two page-aligned buffers in a loop for `duration`,
/// repeated `runs` times (0 is treated as 1). A `size` of 0 is treated as 1 byte.
pub fn memcpy_bandwidth(size: usize, duration: Duration, runs: usize) -> Stat {
    let size = size.max(1);
    let mut src = AlignedBuf::new(size);
    let mut dst = AlignedBuf::new(size);
    // Touch every page of both buffers so page faults are not timed (a zeroed
    // allocation may still be backed by the shared zero page).
    for (i, b) in src.as_mut_slice().iter_mut().enumerate() {
        *b = i as u8;
    }
    dst.as_mut_slice().fill(0xA5);
    // Untimed warm-up copy.
    dst.as_mut_slice().copy_from_slice(black_box(src.as_slice()));
    black_box(dst.as_mut_slice());

    // Copies between clock reads: about 1 MiB per batch, so reading the clock costs
    // nothing measurable even for tiny buffers.
    let batch = ((1usize << 20) / size).max(1);
    let samples: Vec<f64> = (0..runs.max(1))
        .map(|_| {
            let mut copies: u64 = 0;
            let start = Instant::now();
            let elapsed = loop {
                for _ in 0..batch {
                    dst.as_mut_slice().copy_from_slice(black_box(src.as_slice()));
                    black_box(dst.as_mut_slice());
                }
                copies += batch as u64;
                let elapsed = start.elapsed();
                if elapsed >= duration {
                    break elapsed;
                }
            };
            let bytes = copies as f64 * size as f64;
            bytes / elapsed.as_secs_f64() / 1e9
        })
        .collect();
    Stat::from_samples(&samples)
}

// ---------------------------------------------------------------------------
// Shared-memory ping-pong
// ---------------------------------------------------------------------------

/// One atomic on its own 128-byte block: a separate 64-byte cache line, and also clear
/// of the adjacent-line prefetcher, which pulls cache lines in 128-byte pairs.
#[repr(C, align(128))]
struct Line(AtomicU64);

/// Layout of the shared page. All-zero bytes are a valid initial state.
#[repr(C)]
struct PingPage {
    /// Sequence number of the latest ping (written by the parent only).
    ping: Line,
    /// Echo of the latest ping seen (written by the child only).
    pong: Line,
    /// Non-zero once the parent wants the child to exit (written by the parent only).
    stop: Line,
    /// Child status: 0 starting, [`CHILD_READY`], or [`CHILD_PIN_FAILED`].
    ready: Line,
}

const _: () = assert!(std::mem::size_of::<PingPage>() <= PAGE_ALIGN);

const CHILD_READY: u64 = 1;
const CHILD_PIN_FAILED: u64 = 2;

/// An anonymous `MAP_SHARED` mapping holding one [`PingPage`]; unmapped on drop.
struct SharedPage {
    ptr: NonNull<PingPage>,
}

impl SharedPage {
    fn new() -> io::Result<SharedPage> {
        use rustix::mm::{mmap_anonymous, MapFlags, ProtFlags};
        // SAFETY: a fresh anonymous mapping at a kernel-chosen address (null hint)
        // aliases no existing memory.
        let raw = unsafe {
            mmap_anonymous(
                std::ptr::null_mut(),
                std::mem::size_of::<PingPage>(),
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
            )
        }?;
        let ptr = NonNull::new(raw.cast::<PingPage>())
            .ok_or_else(|| io::Error::other("mmap returned a null mapping"))?;
        Ok(SharedPage { ptr })
    }

    fn page(&self) -> &PingPage {
        // SAFETY: the mapping is page-aligned (so aligned for `PingPage`, whose alignment
        // is 128), at least `size_of::<PingPage>()` bytes long, zero-filled by the kernel
        // (all-zero `AtomicU64`s are valid), only ever accessed through atomics, and
        // stays mapped until `self` is dropped, which outlives the borrow.
        unsafe { self.ptr.as_ref() }
    }
}

impl Drop for SharedPage {
    fn drop(&mut self) {
        // SAFETY: `ptr`/len describe exactly the mapping created in `new`; no reference
        // into it outlives `self` (every `&PingPage` borrows from `self`). Unmapping here
        // affects only this process, not a child that inherited the mapping.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), std::mem::size_of::<PingPage>()) };
    }
}

/// CLOCK_MONOTONIC in nanoseconds, without allocation, locks or panics, so the forked
/// child may call it. Returns `u64::MAX` on (impossible) failure so a deadline test
/// against it fails safe, i.e. the child exits.
fn child_clock_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; clock_gettime is async-signal-safe.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    if rc != 0 {
        return u64::MAX;
    }
    (ts.tv_sec as u64).wrapping_mul(1_000_000_000).wrapping_add(ts.tv_nsec as u64)
}

/// Terminates the forked child immediately, without running any parent-owned cleanup.
fn child_exit(code: i32) -> ! {
    // SAFETY: `_exit` ends the process at once; it runs no atexit handlers or
    // destructors, so nothing of the parent's state copied by fork is touched.
    unsafe { libc::_exit(code) }
}

/// Body of the forked child: echo pings until told to stop or until `limit_ns` passes.
///
/// Runs after `fork` in a possibly multithreaded parent, so it must not allocate, lock,
/// panic or return: it uses only atomics on the shared page, the `sched_setaffinity`
/// and `clock_gettime` syscalls, wrapping arithmetic and `_exit`.
fn child_main(page: &PingPage, pin: Option<&CpuSet>, limit_ns: u64) -> ! {
    if let Some(set) = pin {
        if rustix::thread::sched_setaffinity(None, set).is_err() {
            page.ready.0.store(CHILD_PIN_FAILED, Ordering::Release);
            child_exit(2);
        }
    }
    let deadline = child_clock_ns().saturating_add(limit_ns);
    page.ready.0.store(CHILD_READY, Ordering::Release);
    let mut seen: u64 = 0;
    let mut spins: u32 = 0;
    loop {
        let v = page.ping.0.load(Ordering::Acquire);
        if v != seen {
            seen = v;
            page.pong.0.store(v, Ordering::Release);
            continue;
        }
        // Idle path: pure spin (no pause, no yield), but bounded by the stop flag and,
        // checked every 1024 idle spins, by the wall-clock deadline.
        if page.stop.0.load(Ordering::Relaxed) != 0 {
            child_exit(0);
        }
        spins = spins.wrapping_add(1);
        if spins & 1023 == 0 && child_clock_ns() >= deadline {
            child_exit(3);
        }
    }
}

/// Owns the forked child: `finish` stops and reaps it; drop kills and reaps it if that
/// has not happened (error or panic paths), so no child is left running or a zombie.
struct ChildGuard<'a> {
    pid: Pid,
    stop: &'a AtomicU64,
    reaped: bool,
}

impl ChildGuard<'_> {
    /// Non-blocking reap; `Ok(true)` once the child is gone.
    fn try_reap(&mut self) -> io::Result<bool> {
        loop {
            match rustix::process::waitpid(Some(self.pid), WaitOptions::NOHANG) {
                Ok(Some(_)) => {
                    self.reaped = true;
                    return Ok(true);
                }
                Ok(None) => return Ok(false),
                Err(rustix::io::Errno::INTR) => continue,
                // ECHILD: already reaped elsewhere (e.g. SIGCHLD set to SIG_IGN).
                Err(rustix::io::Errno::CHILD) => {
                    self.reaped = true;
                    return Ok(true);
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Kill (SIGKILL) and blocking reap; idempotent.
    fn kill_and_reap(&mut self) {
        if self.reaped {
            return;
        }
        self.stop.store(1, Ordering::Release);
        let _ = rustix::process::kill_process(self.pid, Signal::KILL);
        // Retry on EINTR; anything else means reaped, nothing left to reap, or an error
        // we cannot act on.
        while let Err(rustix::io::Errno::INTR) =
            rustix::process::waitpid(Some(self.pid), WaitOptions::empty())
        {}
        self.reaped = true;
    }

    /// Ask the child to stop and reap it, killing it if it has not exited within
    /// `grace`.
    fn finish(&mut self, grace: Duration) -> io::Result<()> {
        self.stop.store(1, Ordering::Release);
        let deadline = Instant::now() + grace;
        while !self.try_reap()? {
            if Instant::now() >= deadline {
                self.kill_and_reap();
                break;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        Ok(())
    }
}

impl Drop for ChildGuard<'_> {
    fn drop(&mut self) {
        self.kill_and_reap();
    }
}

/// Restores the calling thread's CPU affinity on drop.
struct AffinityGuard {
    saved: CpuSet,
}

impl Drop for AffinityGuard {
    fn drop(&mut self) {
        let _ = rustix::thread::sched_setaffinity(None, &self.saved);
    }
}

fn single_cpu_set(cpu: usize) -> io::Result<CpuSet> {
    if cpu >= CpuSet::MAX_CPU {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("cpu {cpu} out of range (max {})", CpuSet::MAX_CPU - 1),
        ));
    }
    let mut set = CpuSet::new();
    set.set(cpu);
    Ok(set)
}

fn timed_out(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, format!("shm ping-pong: {what} before the deadline"))
}

/// One fork + measure + reap cycle; returns the one-way latency in ns.
fn pingpong_once(duration: Duration, limit: Duration, child_pin: Option<&CpuSet>) -> io::Result<f64> {
    let shared = SharedPage::new()?;
    let page = shared.page();
    let limit_ns = u64::try_from(limit.as_nanos()).unwrap_or(u64::MAX);
    let hard_deadline = Instant::now().checked_add(limit);
    let past_deadline = |now: Instant| hard_deadline.is_some_and(|d| now >= d);

    // SAFETY: fork is sound here even if this process is multithreaded because the child
    // runs only `child_main`, which never returns and does nothing but atomic accesses
    // to the already-mapped shared page, async-signal-safe syscalls (sched_setaffinity
    // with a CpuSet built before the fork, clock_gettime) and `_exit`: no allocation,
    // no locks, no panics, no destructors.
    let raw_pid = unsafe { libc::fork() };
    if raw_pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if raw_pid == 0 {
        child_main(page, child_pin, limit_ns);
    }
    let pid = match Pid::from_raw(raw_pid) {
        Some(pid) => pid,
        None => return Err(io::Error::other("fork returned pid 0 in the parent")),
    };
    let mut child = ChildGuard { pid, stop: &page.stop.0, reaped: false };

    // Wait for the child to start (and pin itself). Not part of the measurement, so
    // yielding here is fine and helps when both parties share a CPU.
    loop {
        match page.ready.0.load(Ordering::Acquire) {
            CHILD_READY => break,
            CHILD_PIN_FAILED => {
                child.finish(Duration::from_secs(1))?;
                return Err(io::Error::other("shm ping-pong: child could not set its CPU affinity"));
            }
            _ => {}
        }
        if child.try_reap()? {
            return Err(io::Error::other("shm ping-pong: child exited before starting"));
        }
        if past_deadline(Instant::now()) {
            return Err(timed_out("child did not start"));
        }
        std::thread::yield_now();
    }

    let mut pings: u64 = 0;
    let mut spins: u32 = 0;
    // Round trips between clock reads: grows from 1 up to 256 while a batch stays short,
    // so a slow round trip (e.g. both parties on one CPU) cannot overshoot `duration` by
    // much, and a fast one pays for the clock read only once per 256 round trips.
    let mut batch: u32 = 1;
    let start = Instant::now();
    let mut batch_start = start;
    let elapsed = loop {
        for _ in 0..batch {
            pings += 1;
            page.ping.0.store(pings, Ordering::Release);
            while page.pong.0.load(Ordering::Acquire) != pings {
                spins = spins.wrapping_add(1);
                if spins & 4095 == 0 && past_deadline(Instant::now()) {
                    // The guard kills and reaps the child.
                    return Err(timed_out("child stopped answering"));
                }
            }
        }
        let now = Instant::now();
        let elapsed = now - start;
        if elapsed >= duration {
            break elapsed;
        }
        if batch < 256 && now - batch_start < Duration::from_micros(100) {
            batch *= 2;
        }
        batch_start = now;
    };
    child.finish(Duration::from_secs(1))?;
    Ok(elapsed.as_nanos() as f64 / pings as f64 / 2.0)
}

/// One-way latency in nanoseconds of a cache-line ping-pong between two PROCESSES
/// through a `MAP_SHARED` anonymous mapping (fork; the child only spins on atomics and
/// calls `libc::_exit`, so fork is safe in a multithreaded parent). RTT/2, for
/// `duration`, repeated `runs` times (0 is treated as 1), one child per run.
///
/// `cpus`: optional pair of CPUs to pin parent and child to (`sched_setaffinity`);
/// `None` = unpinned. The calling thread's previous affinity is restored on return.
///
/// Bounded in time: the child exits when the parent sets the stop flag, or on its own
/// once `duration * 4 + 2 s` has passed; the parent gives up with
/// [`io::ErrorKind::TimedOut`] after the same limit, and always reaps the child, killing
/// it if it has not exited within 1 s of being told to stop.
pub fn shm_pingpong_one_way_ns(
    duration: Duration,
    runs: usize,
    cpus: Option<(usize, usize)>,
) -> io::Result<Stat> {
    let limit = duration.saturating_mul(4).saturating_add(Duration::from_secs(2));
    let (_affinity, child_pin) = match cpus {
        Some((parent_cpu, child_cpu)) => {
            let parent_set = single_cpu_set(parent_cpu)?;
            let child_set = single_cpu_set(child_cpu)?;
            let saved = rustix::thread::sched_getaffinity(None)?;
            rustix::thread::sched_setaffinity(None, &parent_set)?;
            (Some(AffinityGuard { saved }), Some(child_set))
        }
        None => (None, None),
    };
    let mut samples = Vec::with_capacity(runs.max(1));
    for _ in 0..runs.max(1) {
        samples.push(pingpong_once(duration, limit, child_pin.as_ref())?);
    }
    Ok(Stat::from_samples(&samples))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHORT: Duration = Duration::from_millis(50);

    #[test]
    fn stat_odd_count() {
        let s = Stat::from_samples(&[3.0, 1.0, 2.0]);
        assert_eq!((s.median, s.min, s.max, s.runs), (2.0, 1.0, 3.0, 3));
    }

    #[test]
    fn stat_even_count_takes_mean_of_middle_two() {
        let s = Stat::from_samples(&[4.0, 1.0, 3.0, 2.0]);
        assert_eq!((s.median, s.min, s.max, s.runs), (2.5, 1.0, 4.0, 4));
    }

    #[test]
    fn stat_empty_is_nan() {
        let s = Stat::from_samples(&[]);
        assert!(s.median.is_nan() && s.min.is_nan() && s.max.is_nan());
        assert_eq!(s.runs, 0);
    }

    #[test]
    fn memcpy_positive_finite() {
        let s = memcpy_bandwidth(1 << 20, SHORT, 1);
        assert_eq!(s.runs, 1);
        assert!(s.median.is_finite() && s.median > 0.0, "{s:?}");
    }

    #[test]
    fn memcpy_zero_runs_is_one() {
        let s = memcpy_bandwidth(4096, Duration::from_millis(5), 0);
        assert_eq!(s.runs, 1);
    }

    #[test]
    fn pingpong_positive_finite() {
        let s = shm_pingpong_one_way_ns(SHORT, 1, None).expect("ping-pong");
        assert_eq!(s.runs, 1);
        // No bound on the figure: a loaded machine may take milliseconds.
        assert!(s.median.is_finite() && s.median > 0.0, "{s:?}");
    }

    #[test]
    fn pingpong_pinned_if_two_cpus() {
        let allowed = rustix::thread::sched_getaffinity(None).expect("getaffinity");
        let cpus: Vec<usize> = (0..CpuSet::MAX_CPU).filter(|&c| allowed.is_set(c)).collect();
        if cpus.len() < 2 {
            return;
        }
        let s = shm_pingpong_one_way_ns(SHORT, 1, Some((cpus[0], cpus[1]))).expect("pinned");
        // No bound on the figure: a loaded machine may take milliseconds.
        assert!(s.median.is_finite() && s.median > 0.0, "{s:?}");
        // Affinity of the calling thread is restored.
        let after = rustix::thread::sched_getaffinity(None).expect("getaffinity");
        assert!(after == allowed);
    }

    #[test]
    fn pingpong_bad_cpu_is_invalid_input() {
        let err = shm_pingpong_one_way_ns(SHORT, 1, Some((0, usize::MAX))).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }
}
