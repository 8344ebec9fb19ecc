//! Re-backed pages in the child of a `fork`.
//!
//! `fork` copies private memory on write but shares `MAP_SHARED` mappings,
//! and re-backed pages are shared mappings of a memfd. Left alone, a child
//! would share the parent's registered buffers, and the heap objects next
//! to them, with the parent and the device: its writes (`malloc`'s among
//! them) would land in the parent's memory. rdma-core on current kernels
//! gives the child a copy of registered pages (`IBV_FORK_UNNEEDED`), and so
//! does this: a handler that runs in every child right after `fork`
//! replaces each re-backed mapping with a private copy of its bytes. The
//! parent, its registrations and the device are untouched.
//!
//! The handler must not touch the heap before it is done: the child's
//! heap pages may still be the parent's. So it reads `/proc/self/maps` into
//! an anonymous mapping with raw system calls and parses it in place. It
//! is registered when this library is loaded, so that it runs before the
//! child handlers of libraries loaded later; glibc's own reset of its
//! allocator's locks in the child, and handlers registered earlier, still
//! run before it.
//!
//! A fork must also not split a re-backing in two: the thread that forks
//! is the child's only one, so a registry lock another thread held at that
//! moment would stay held in the child for ever, and its next registration
//! would wait for it. The prepare handler takes the lock (waiting for a
//! re-backing in progress to finish) and both sides release it after.
//!
//! In a guest (`docs/vms.md`) re-backed pages are shared mappings of the
//! VM's BAR (sysfs `resource2`, or the region memfd a host test maps), not
//! of our memfds: the BAR's file is noted when a guest context opens it
//! ([`note_guest_bar`]) and the child copies the parts of its shared
//! mappings that lie in a re-backed span's pages, noted in a static table
//! by the prepare handler under the registry's lock (the child must not
//! read the registry itself: see [`NOTED`]). The rings and `alloc_mr`
//! memory mapped from the BAR stay shared, as a host child shares the
//! memfds they are made of: the same program behaves the same on a host
//! and in a guest, and a fork copies only what must be copied. Where
//! nothing was noted (the lock not taken, or more spans than the table
//! holds), every shared mapping of the BAR is copied, as the safe side.
//!
//! glibc's own reset of its allocator in the child writes into the
//! arenas' headers (each thread arena's lock, free-list link and thread
//! count, at the start of its first heap) before this handler runs: a
//! header in a page still mapped from a guest's BAR took those writes for
//! the parent, which aborted at the exit of that arena's thread. So the
//! prepare handler moves kept guest spans' pages (deregistered, see
//! [`super::guest`]) back to private memory first, and on a host the
//! pages of spans whose last region went ([`super::idle_pages`]); pages
//! a live region lies on stay shared, since the device may write them.
//!
//! What it costs and leaves: every `fork` copies the re-backed pages, as
//! the kernel copies pinned pages for rdma-core; the copy is taken as the
//! child starts, so bytes the parent's other threads or the device write
//! in between may be in it. Pages it cannot copy (no memory for the copy,
//! or pages the program made unreadable) become inaccessible in the child
//! rather than stay shared.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::MutexGuard;

use super::{Spans, REGISTRY};

/// Whether this process ever re-backed memory: until then a child has
/// nothing to do.
static REBACKED: AtomicBool = AtomicBool::new(false);

/// Registers the child handler when the library is loaded.
#[used]
#[link_section = ".init_array"]
static REGISTER_AT_LOAD: extern "C" fn() = register;

extern "C" fn register() {
    // SAFETY: registers handlers that do not unwind; the lock `prepare`
    // takes is released by `in_parent` or `in_child` in the same thread.
    unsafe { libc::pthread_atfork(Some(prepare), Some(in_parent), Some(in_child)) };
}

thread_local! {
    /// The registry's lock, held by the forking thread across `fork`.
    static HELD: RefCell<Option<MutexGuard<'static, Spans>>> =
        const { RefCell::new(None) };
}

extern "C" fn prepare() {
    let _ = std::panic::catch_unwind(|| {
        let guard = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
        // Noted first: it drops the spans it looks at, and a last one
        // notes itself in the idle list, whose lock the sweep then holds.
        note_guest_ranges(&guard);
        // Kept and idle pages go back to private memory before the
        // child's glibc writes its allocator's state (see
        // `guest::fork_preparing` and `idle_pages`).
        if REBACKED.load(Ordering::SeqCst) {
            super::guest::fork_preparing();
            super::idle_pages::fork_preparing(&guard);
        }
        HELD.with(|h| *h.borrow_mut() = Some(guard));
    });
}

/// Guest spans' page ranges noted for the child at most; with more, the
/// child copies every shared mapping of the BAR.
const NOTED_MAX: usize = 256;

/// The pages the guest spans map from the BAR, `[start, reach)` each
/// (past a span's end where a larger generation, gone now, left its pages
/// mapped), noted by [`prepare`] in the parent under the registry's lock,
/// where the heap may be used. The child reads only these: the registry's
/// nodes and the spans' counts are heap objects, possibly on pages still
/// shared with the parent until they are copied, which the parent's other
/// threads may change under the child (and a count the child dropped to
/// zero would run a span's drop in the child).
static NOTED: [(AtomicUsize, AtomicUsize); NOTED_MAX] =
    [const { (AtomicUsize::new(0), AtomicUsize::new(0)) }; NOTED_MAX];
static NOTED_LEN: AtomicUsize = AtomicUsize::new(0);
/// More guest spans than [`NOTED`] holds: copy every BAR mapping.
static NOTED_ALL: AtomicBool = AtomicBool::new(false);

fn note_guest_ranges(spans: &Spans) {
    if !GUEST_BARS.iter().any(|(_, i)| i.load(Ordering::SeqCst) != 0) {
        return;
    }
    let mut n = 0;
    let mut all = false;
    for gens in spans.values() {
        let Some(span) = super::largest(gens) else { continue };
        if span.guest.is_none() {
            continue;
        }
        if n == NOTED_MAX {
            all = true;
            break;
        }
        NOTED[n].0.store(span.start, Ordering::SeqCst);
        NOTED[n].1.store(super::guest::reach(&span), Ordering::SeqCst);
        n += 1;
    }
    NOTED_LEN.store(n, Ordering::SeqCst);
    NOTED_ALL.store(all, Ordering::SeqCst);
}

/// Releases the lock `prepare` took. In the child the lock is a copy that
/// this thread, now the only one, holds: releasing it is a store, no heap.
fn release() {
    let _ = std::panic::catch_unwind(|| HELD.with(|h| h.borrow_mut().take()));
}

extern "C" fn in_parent() {
    release();
    let _ = std::panic::catch_unwind(|| super::idle_pages::forked(false));
}

/// Called before the first re-backing: from then on each child copies.
pub(crate) fn note_rebacking() {
    REBACKED.store(true, Ordering::SeqCst);
}

/// The VMs' BAR files this process re-backed pages with, as
/// `(major << 32 | minor, inode)` of the file (0, 0: a free slot); the
/// child reads them without the heap. One process maps one VM's BAR;
/// a few slots spare.
static GUEST_BARS: [(AtomicU64, AtomicU64); 4] = [const { (AtomicU64::new(0), AtomicU64::new(0)) }; 4];

/// Called when a guest context opens a VM's BAR and before each
/// re-backing with it (the file's device and inode, as `fstat` gives
/// them): from then on each child copies the shared mappings of that
/// file too.
pub(crate) fn note_guest_bar(dev: u64, ino: u64) {
    let dev = u64::from(rustix::fs::major(dev)) << 32 | u64::from(rustix::fs::minor(dev));
    for (d, i) in &GUEST_BARS {
        if (d.load(Ordering::SeqCst), i.load(Ordering::SeqCst)) == (dev, ino) {
            break;
        }
        if i.compare_exchange(0, ino, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            d.store(dev, Ordering::SeqCst);
            break;
        }
    }
    note_rebacking();
}

/// Whether `(dev, ino)` (maps' device as `major << 32 | minor`) is a
/// noted BAR file.
fn is_guest_bar(dev: u64, ino: u64) -> bool {
    ino != 0
        && GUEST_BARS.iter().any(|(d, i)| i.load(Ordering::SeqCst) == ino && d.load(Ordering::SeqCst) == dev)
}

extern "C" fn in_child() {
    // A panic must not unwind into the C caller of fork. The registry's
    // lock is released after the copies, which read the registry.
    if REBACKED.load(Ordering::SeqCst) {
        let _ = std::panic::catch_unwind(privatize_all);
    }
    release();
    if REBACKED.load(Ordering::SeqCst) {
        let _ = std::panic::catch_unwind(|| super::idle_pages::forked(true));
    }
}

fn privatize_all() {
    // SAFETY: open, read, mmap, mremap, munmap and close on descriptors
    // and mappings this function owns; no heap.
    unsafe {
        let fd = libc::open(c"/proc/self/maps".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return;
        }
        let mut cap: usize = 1 << 20;
        let mut buf = libc::mmap(
            std::ptr::null_mut(),
            cap,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if buf == libc::MAP_FAILED {
            libc::close(fd);
            return;
        }
        let mut len = 0;
        loop {
            if len == cap {
                let grown = libc::mremap(buf, cap, cap * 2, libc::MREMAP_MAYMOVE);
                if grown == libc::MAP_FAILED {
                    break;
                }
                (buf, cap) = (grown, cap * 2);
            }
            let n = libc::read(fd, buf.cast::<u8>().add(len).cast(), cap - len);
            if n <= 0 {
                break;
            }
            len += n as usize;
        }
        libc::close(fd);
        let text = std::slice::from_raw_parts(buf.cast::<u8>(), len);
        // Noted by this fork's `prepare` only where it took the lock.
        let noted = HELD.with(|h| h.borrow().is_some()) && !NOTED_ALL.load(Ordering::SeqCst);
        for line in text.split(|&b| b == b'\n') {
            let Some((start, end, perms)) = rebacked_mapping(line, is_guest_bar) else { continue };
            match noted && !line_is_ours(line) {
                true => in_noted_ranges(start, end, |s, e| privatize(s, e, perms)),
                false => privatize(start, end, perms),
            }
        }
        libc::munmap(buf, cap);
    }
}

/// Whether a maps line is a mapping of our memfd (the host's re-backed
/// pages, copied whole) rather than of a VM's BAR.
fn line_is_ours(line: &[u8]) -> bool {
    let path = line.split(|&b| b == b' ').filter(|f| !f.is_empty()).nth(5).unwrap_or(&[]);
    path.starts_with(super::MAPS_PATH_PREFIX.as_bytes())
}

/// Calls `each` with the parts of `[start, end)` that lie in a noted
/// guest span's pages ([`NOTED`]); allocates nothing.
fn in_noted_ranges(start: usize, end: usize, mut each: impl FnMut(usize, usize)) {
    let n = NOTED_LEN.load(Ordering::SeqCst).min(NOTED_MAX);
    for (a, b) in &NOTED[..n] {
        let (s, e) = (a.load(Ordering::SeqCst).max(start), b.load(Ordering::SeqCst).min(end));
        if s < e {
            each(s, e);
        }
    }
}

/// `(start, end, perms)` of a maps line that is a re-backed mapping
/// (shared, of our memfd, or of a file `guest_bar` says is a VM's BAR:
/// given maps' device as `major << 32 | minor` and the inode); parsed
/// without allocating.
fn rebacked_mapping(line: &[u8], guest_bar: impl Fn(u64, u64) -> bool) -> Option<(usize, usize, [u8; 4])> {
    let mut fields = line.split(|&b| b == b' ').filter(|f| !f.is_empty());
    let range = fields.next()?;
    let perms: [u8; 4] = fields.next()?.try_into().ok()?;
    let _offset = fields.next()?;
    let dev = fields.next()?;
    let inode = fields.next()?;
    // The path, absent for anonymous mappings.
    let path = fields.next().unwrap_or(&[]);
    if perms[3] != b's' {
        return None;
    }
    let ours = path.starts_with(super::MAPS_PATH_PREFIX.as_bytes()) || {
        let colon = dev.iter().position(|&b| b == b':')?;
        let dev = (hex(&dev[..colon])? as u64) << 32 | hex(&dev[colon + 1..])? as u64;
        guest_bar(dev, decimal(inode)?)
    };
    if !ours {
        return None;
    }
    let dash = range.iter().position(|&b| b == b'-')?;
    Some((hex(&range[..dash])?, hex(&range[dash + 1..])?, perms))
}

fn decimal(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || digits.len() > 19 {
        return None;
    }
    digits.iter().try_fold(0u64, |v, &d| Some(v * 10 + u64::from((d as char).to_digit(10)?)))
}

fn hex(digits: &[u8]) -> Option<usize> {
    if digits.is_empty() || digits.len() > 16 {
        return None;
    }
    digits.iter().try_fold(0usize, |v, &d| Some(v << 4 | (d as char).to_digit(16)? as usize))
}

/// Replaces the shared mapping `[start, end)` by private anonymous pages
/// holding the same bytes, with the same protection; pages it cannot
/// copy become inaccessible instead.
///
/// # Safety
/// `[start, end)` must be a mapping of this (single-threaded, just forked)
/// process with protection `perms`.
unsafe fn privatize(start: usize, end: usize, perms: [u8; 4]) {
    let len = end - start;
    let at = start as *mut libc::c_void;
    let mut prot = 0;
    for (flag, bit) in [(b'r', libc::PROT_READ), (b'w', libc::PROT_WRITE), (b'x', libc::PROT_EXEC)] {
        if perms.contains(&flag) {
            prot |= bit;
        }
    }
    let anon = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    // SAFETY: a fresh anonymous mapping, checked below.
    let tmp =
        unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, anon, -1, 0) };
    if tmp == libc::MAP_FAILED || prot & libc::PROT_READ == 0 {
        if tmp != libc::MAP_FAILED {
            // SAFETY: ours, unused.
            unsafe { libc::munmap(tmp, len) };
        }
        // SAFETY: the caller's mapping; inaccessible private pages take
        // its place, so the child cannot write to the parent's.
        unsafe { libc::mmap(at, len, libc::PROT_NONE, anon | libc::MAP_FIXED, -1, 0) };
        return;
    }
    // SAFETY: `[start, end)` is readable (`perms`) and `tmp` is a distinct
    // mapping of the same length; then `tmp` atomically takes the shared
    // mapping's place at the same addresses, so every pointer into those
    // pages stays valid and sees the same bytes, now private.
    unsafe {
        std::ptr::copy_nonoverlapping(start as *const u8, tmp.cast::<u8>(), len);
        if prot != libc::PROT_READ | libc::PROT_WRITE {
            libc::mprotect(tmp, len, prot);
        }
        if libc::mremap(tmp, len, len, libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED, at) == libc::MAP_FAILED {
            libc::munmap(tmp, len);
            libc::mmap(at, len, libc::PROT_NONE, anon | libc::MAP_FIXED, -1, 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::sync::{mpsc, Mutex};
    use std::time::{Duration, Instant};

    use super::super::guest::{context_closing, reback_guest, GuestSource};
    use crate::error::Error;

    /// Set in the process the arena test runs alone in.
    const ALONE: &str = "VRDMA_TEST_FORK_ARENA_ALONE";

    /// glibc reserves a thread arena's heaps at multiples of this (64 MiB
    /// on 64-bit): the arena's header lies at the start of its first one.
    const HEAP_MAX: usize = 64 << 20;

    /// In the test harness's process: runs the test `name` in a process
    /// of its own, asserts that it passed there, and says so (the caller
    /// returns). In that process (`ALONE` set): false, the test runs.
    fn ran_alone(name: &str) -> bool {
        if std::env::var_os(ALONE).is_some() {
            return false;
        }
        let (passed, out) = alone(name);
        assert!(passed, "the test failed in its own process: {out}");
        true
    }

    /// Runs the test `name` of this binary in a process of its own (a
    /// lost arena update aborts the whole process at a thread's exit):
    /// whether it passed, and its output.
    fn alone(name: &str) -> (bool, String) {
        let exe = std::env::current_exe().unwrap();
        let mut child = std::process::Command::new(exe)
            .args(["--exact", name, "--test-threads=1", "--nocapture"])
            .env(ALONE, "1")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Read as the child writes, so that a full pipe never stalls it;
        // each reader hands its text over a channel, waited for with a
        // bound (a descendant that outlives the child keeps the pipe open).
        let (tx, rx) = mpsc::channel();
        let mut readers = 0;
        for mut out in [
            child.stdout.take().map(|o| Box::new(o) as Box<dyn std::io::Read + Send>),
            child.stderr.take().map(|e| Box::new(e) as Box<dyn std::io::Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let tx = tx.clone();
            readers += 1;
            std::thread::spawn(move || {
                let mut text = String::new();
                let _ = out.read_to_string(&mut text);
                let _ = tx.send(text);
            });
        }
        let end = Instant::now() + Duration::from_secs(120);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if Instant::now() > end {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut text = String::new();
        for _ in 0..readers {
            match rx.recv_timeout(Duration::from_secs(10)) {
                Ok(part) => text.push_str(&part),
                Err(_) => text.push_str("\n(an output pipe stayed open 10 s after the child ended)\n"),
            }
        }
        let passed = status.is_some_and(|s| s.success()) && text.contains("1 passed");
        (passed, format!("{status:?}\n{text}"))
    }

    /// A thread arena's header (`malloc_state`, at the start of the
    /// arena's first heap) in pages kept in the VM's region after their
    /// region went, and a `fork`: glibc resets every arena's thread count
    /// and lock in the child, before any handler of ours runs, and those
    /// writes reached the parent's arena through the shared page; the
    /// parent aborted when the arena's thread exited ("malloc assertion
    /// failure in __malloc_arena_thread_freeres: a->attached_threads >
    /// 0"). Now a fork moves kept pages back to private memory first.
    #[test]
    fn a_fork_leaves_a_thread_arenas_header_in_kept_pages_whole() {
        let name = "rebacking::fork::tests::a_fork_leaves_a_thread_arenas_header_in_kept_pages_whole";
        if ran_alone(name) {
            return;
        }
        let page = vrdma_shm::page_size();
        let bar = rustix::fs::memfd_create("vrdma-test-bar", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&bar, 64 * page as u64).unwrap();
        let ext = Mutex::new(vrdma_core::extents::Extents::new(64 * page as u64, page as u64));
        let alloc = |len: u64| ext.lock().unwrap().alloc(len).ok_or(Error::QueueFull);
        let release = |_: u64| -> Box<dyn FnOnce() + Send> { Box::new(|| {}) };
        let grow = |_: u64, _: u64| -> crate::error::Result<u64> { Err(Error::QueueFull) };
        let src = GuestSource { owner: 11, bar: bar.as_fd(), alloc: &alloc, release: &release, grow: &grow };
        fork_over_a_thread_arenas_header(
            // SAFETY: the last bytes of the arena's first page: the
            // registration reads and shares them, nothing more.
            |at| drop(unsafe { reback_guest(at as *mut u8, 64, &src) }.unwrap()),
            || context_closing(11),
        );
    }

    /// As above on a host: the pages of a span whose last region went stay
    /// mapped from its memfd (the abort was reproduced so); a fork moves
    /// them back to private memory first.
    #[test]
    fn a_fork_leaves_a_thread_arenas_header_in_idle_host_pages_whole() {
        let name = "rebacking::fork::tests::a_fork_leaves_a_thread_arenas_header_in_idle_host_pages_whole";
        if ran_alone(name) {
            return;
        }
        fork_over_a_thread_arenas_header(
            // SAFETY: as above.
            |at| drop(unsafe { super::super::reback(at as *mut u8, 64) }.unwrap()),
            || {},
        );
    }

    /// Three times: a fresh thread's arena, the last 64 bytes of its first
    /// page registered and deregistered by `register_and_drop`, a `fork`
    /// whose child only exits, the thread's exit (where glibc checks its
    /// arena's thread count), then `after`.
    fn fork_over_a_thread_arenas_header(register_and_drop: impl Fn(usize), after: impl Fn()) {
        let page = vrdma_shm::page_size();
        let mut tried = 0;
        for _ in 0..3 {
            let (tx_at, rx_at) = mpsc::channel();
            let (tx_go, rx_go) = mpsc::channel::<()>();
            // A fresh thread: its first allocation attaches it to an arena
            // of its own (this process runs one test).
            let t = std::thread::spawn(move || {
                let b = Box::new([7u8; 64]);
                tx_at.send(b.as_ptr() as usize).unwrap();
                let _ = rx_go.recv_timeout(Duration::from_secs(60));
                drop(b);
            });
            let h = rx_at.recv_timeout(Duration::from_secs(60)).unwrap() & !(HEAP_MAX - 1);
            let maps = super::super::read_maps().unwrap();
            // The heap's header (`heap_info`) begins with its arena's
            // address, right after it.
            let arena = super::super::covering(&maps, h, h + page).is_ok_and(|e| {
                e.iter().all(|e| e.readable_writable() && e.private())
                    // SAFETY: the first word of a mapped, readable page.
                    && (h + 8..h + 128).contains(&unsafe { (h as *const usize).read() })
            });
            if arena {
                tried += 1;
                register_and_drop(h + page - 64);
                // SAFETY: the child only exits.
                let pid = unsafe { libc::fork() };
                if pid == 0 {
                    // SAFETY: ends the child at once.
                    unsafe { libc::_exit(0) };
                }
                assert!(pid > 0, "fork failed");
                let mut st = 0;
                // SAFETY: waits for the child forked above.
                assert_eq!(unsafe { libc::waitpid(pid, &mut st, 0) }, pid);
            }
            // The thread exits: glibc checks its arena's thread count.
            tx_go.send(()).unwrap();
            t.join().unwrap();
            after();
        }
        assert!(tried > 0, "no thread arena found");
    }

    #[test]
    fn finds_rebacked_mappings_in_maps_lines_without_allocating() {
        let ours = b"7f0000100000-7f0000102000 rw-s 00000000 00:01 4242                       /memfd:vrdma-rebacked (deleted)";
        let none = |_, _| false;
        assert_eq!(rebacked_mapping(ours, none), Some((0x7f00_0010_0000, 0x7f00_0010_2000, *b"rw-s")));
        // A VM's BAR (sysfs resource2, device 00:15, inode 321) once noted.
        let bar = b"7f0000200000-7f0000204000 rw-s fe005000 00:15 321                        /sys/devices/pci0000:00/0000:00:04.0/resource2";
        let noted = |dev, ino| (dev, ino) == (0x15, 321);
        assert_eq!(rebacked_mapping(bar, noted), Some((0x7f00_0020_0000, 0x7f00_0020_4000, *b"rw-s")));
        assert_eq!(rebacked_mapping(bar, none), None, "a BAR not noted");
        assert_eq!(rebacked_mapping(bar, |dev, ino| (dev, ino) == (0x16, 321)), None, "another device");
        let private = b"7f0000200000-7f0000204000 rw-p fe005000 00:15 321 /sys/devices/pci0000:00/0000:00:04.0/resource2";
        assert_eq!(rebacked_mapping(private, noted), None, "a private mapping of it");
        for other in [
            &b"7f0000102000-7f0000103000 rw-s 00000000 00:01 99                         /dev/shm/other"[..],
            b"7f0000100000-7f0000102000 rw-p 00000000 00:01 4242                       /memfd:vrdma-rebacked (deleted)",
            b"55d0c5a4d000-55d0c5a6e000 rw-p 00000000 00:00 0                          [heap]",
            b"7f0000000000-7f0000021000 rw-p 00000000 00:00 0 ",
            b"",
            b"garbage",
            b"zz-10 rw-s 0 0 0 /memfd:vrdma-rebacked",
        ] {
            assert_eq!(rebacked_mapping(other, none), None, "{}", String::from_utf8_lossy(other));
        }
    }
}
