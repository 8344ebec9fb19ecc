//! Re-backing memory the process already owns with a shareable memfd.
//!
//! The daemon can only reach memory it can map, and it maps only the
//! memfds a process sends it. For
//! [`ProtectionDomain::register_raw`](crate::ProtectionDomain::register_raw)
//! the memory already exists (a
//! heap `Vec`, `posix_memalign`, an anonymous `mmap`), so its pages are
//! *re-backed*: a memfd the size of the covering pages is created, the
//! current contents are copied into it, and it is mapped `MAP_SHARED |
//! MAP_FIXED` over the very same addresses. The application keeps its
//! pointer and its bytes; from then on those pages are shared with the
//! daemon.
//!
//! Only private anonymous memory (including `[heap]` and `MAP_HUGETLB`
//! huge pages, which are re-backed whole huge pages at a time by ordinary
//! shared memory: the daemon refuses hugetlbfs files, see
//! `vrdma_shm::Mapping::map_untrusted`) is re-backed. The
//! main thread's `[stack]` and the calling thread's stack, file mappings
//! (whose contents belong to the file; but the writable data segment of
//! the program or a loaded library, private to the process, is re-backed
//! too) and read-only or unmapped pages are refused. A range lying fully
//! inside an earlier, still registered span reuses that span's memfd. A
//! range that starts inside a span and ends past it *grows* the span: its
//! memfd (sealed against shrinking only) is extended and the pages after
//! the span are mapped from the extension, so the regions over the old
//! pages (which the daemon mapped from the same file) and the new one
//! share one file. Small buffers that share a page are the common case
//! (two heap allocations, each registered on its own). A range that
//! begins before a span it overlaps, or that covers several, cannot be
//! one piece of one file (a file grows only at its end, and the regions
//! over a span's pages keep the daemon's mappings of its file): it is
//! made of pieces ([`pieces`]), each span's part and new pages for the
//! gaps, which the daemon maps one after the other into one range.
//!
//! A process-global registry remembers the live spans. It holds them
//! weakly: when the last memory region over a span is deregistered the
//! span's memfd is closed, while the application's pages stay mapped from
//! it (the mapping holds its own reference); the next `fork` moves them
//! back to private memory where it can ([`idle_pages`]). Such pages may
//! be re-backed again later. Before a span is reused its mapping is checked against
//! `/proc/self/maps`, so memory the application unmapped and mapped anew
//! at the same address is never mistaken for the old span.
//!
//! The child of a `fork` gets private copies of re-backed pages ([`fork`]).

mod fds;
mod fence;
mod fork;
mod guest;
mod idle_pages;
mod move_back;
mod pieces;
mod uffd;

pub(crate) use fork::note_guest_bar;
pub(crate) use guest::{context_closing as guest_context_closing, reback_guest, GuestSource};

use std::collections::BTreeMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, Weak};

use rustix::mm::{MapFlags, ProtFlags};
use vrdma_shm::{page_size, Segment};

use crate::error::{Error, Result};

/// The memfd name of re-backed spans, as `/proc/self/maps` shows it.
const MEMFD_NAME: &str = "vrdma-rebacked";
const MAPS_PATH_PREFIX: &str = "/memfd:vrdma-rebacked";
/// How `/proc/self/maps` names `MAP_HUGETLB | MAP_ANONYMOUS` memory.
const ANON_HUGE_PATH_PREFIX: &str = "/anon_hugepage";

/// Page-aligned addresses `[start, start + len)` now mapped from `fd`.
#[derive(Debug)]
pub(crate) struct Span {
    start: usize,
    len: usize,
    fd: OwnedFd,
    /// The memfd's inode, to recognise its mapping in `/proc/self/maps`.
    ino: u64,
    /// Whether its file may grow (ordinary pages; huge-page spans don't).
    growable: bool,
    /// In guest mode: the span is an extent of the VM's region (the BAR),
    /// and `fd` the BAR.
    guest: Option<guest::GuestSpan>,
}

impl Span {
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    #[cfg(test)]
    pub(crate) fn start(&self) -> usize {
        self.start
    }

    pub(crate) fn end(&self) -> usize {
        self.start + self.len
    }
}

/// A re-backed range: the span holding it and the range's offset in the
/// span's memfd (the byte offset of the range's first byte).
#[derive(Debug)]
pub(crate) struct Rebacked {
    pub span: Arc<Span>,
    pub fd_offset: u64,
    /// For a range over several spans ([`pieces`]): each span's part, in
    /// order (the first is `span`'s from `fd_offset`); empty for a range
    /// in one span.
    pub pieces: Vec<Piece>,
}

impl Rebacked {
    fn one(span: Arc<Span>, fd_offset: u64) -> Rebacked {
        Rebacked { span, fd_offset, pieces: Vec::new() }
    }
}

/// A part of a range re-backed by several spans: `len` bytes of `span`'s
/// file from `fd_offset` (in a guest: of the VM's region).
#[derive(Debug)]
pub(crate) struct Piece {
    pub span: Arc<Span>,
    pub fd_offset: u64,
    pub len: usize,
}

/// Live spans by start address, each with its generations (a span that
/// grew is a new `Span` over the same file: the regions made before hold
/// the old one). An entry lives while any generation does; the largest
/// live one says how far the span reaches. Spans never overlap.
type Spans = BTreeMap<usize, Vec<Weak<Span>>>;

/// The largest live generation of an entry.
fn largest(gens: &[Weak<Span>]) -> Option<Arc<Span>> {
    gens.iter().filter_map(Weak::upgrade).max_by_key(|s| s.len)
}
static REGISTRY: Mutex<Spans> = Mutex::new(BTreeMap::new());

/// One line of `/proc/self/maps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MapEntry {
    pub start: usize,
    pub end: usize,
    /// `rwxp` / `rw-s` ...
    pub perms: [u8; 4],
    pub offset: u64,
    pub inode: u64,
    /// The path or pseudo-path (`[heap]`, `[stack]`, `[anon:name]`), or "".
    pub path: String,
}

impl MapEntry {
    fn readable_writable(&self) -> bool {
        self.perms[0] == b'r' && self.perms[1] == b'w'
    }

    fn private(&self) -> bool {
        self.perms[3] == b'p'
    }

    fn is_our_memfd(&self) -> bool {
        self.perms[3] == b's' && self.path.starts_with(MAPS_PATH_PREFIX)
    }

    fn is_private_anonymous(&self) -> bool {
        self.private()
            && self.inode == 0
            && (self.path.is_empty() || self.path == "[heap]" || self.path.starts_with("[anon:"))
    }

    /// Private anonymous huge pages (`MAP_PRIVATE | MAP_ANONYMOUS |
    /// MAP_HUGETLB`), which the kernel shows as a deleted hugetlbfs file.
    fn is_private_hugetlb(&self) -> bool {
        self.private() && self.path.starts_with(ANON_HUGE_PATH_PREFIX)
    }

    /// Mapped in huge pages (hugetlb memory; our re-backing of it uses
    /// ordinary pages, whole huge pages at a time).
    fn is_huge(&self) -> bool {
        self.path.starts_with(ANON_HUGE_PATH_PREFIX)
    }
}

/// Splits off the first whitespace-separated token.
fn token(s: &str) -> Option<(&str, &str)> {
    let s = s.trim_start();
    if s.is_empty() {
        return None;
    }
    let end = s.find(char::is_whitespace).unwrap_or(s.len());
    Some((&s[..end], &s[end..]))
}

/// Parses one `/proc/<pid>/maps` line.
pub(crate) fn parse_maps_line(line: &str) -> Option<MapEntry> {
    let (range, rest) = token(line)?;
    let (perms, rest) = token(rest)?;
    let (offset, rest) = token(rest)?;
    let (_dev, rest) = token(rest)?;
    let (inode, rest) = token(rest)?;
    let (start, end) = range.split_once('-')?;
    let perms: [u8; 4] = perms.as_bytes().try_into().ok()?;
    Some(MapEntry {
        start: usize::from_str_radix(start, 16).ok()?,
        end: usize::from_str_radix(end, 16).ok()?,
        perms,
        offset: u64::from_str_radix(offset, 16).ok()?,
        inode: inode.parse().ok()?,
        path: rest.trim().to_string(),
    })
}

/// Parses a whole maps file, skipping lines it cannot read.
pub(crate) fn parse_maps(text: &str) -> Vec<MapEntry> {
    text.lines().filter_map(parse_maps_line).collect()
}

fn read_maps() -> Result<Vec<MapEntry>> {
    let text = std::fs::read_to_string("/proc/self/maps").map_err(|e| {
        Error::Io(std::io::Error::new(
            e.kind(),
            format!("cannot read /proc/self/maps to register memory: {e}"),
        ))
    })?;
    Ok(parse_maps(&text))
}

/// The entries covering `[start, end)`, in address order, or an error
/// naming the first address not mapped.
fn covering(maps: &[MapEntry], start: usize, end: usize) -> Result<Vec<&MapEntry>> {
    let mut at = start;
    let mut out = Vec::new();
    for e in maps {
        if at >= end {
            break;
        }
        if e.end <= at {
            continue;
        }
        if e.start > at {
            break;
        }
        out.push(e);
        at = e.end;
    }
    if at < end {
        return Err(Error::invalid(format!(
            "memory at {at:#x} is not mapped (registering [{start:#x}, {end:#x}))"
        )));
    }
    Ok(out)
}

/// Whether `[start, end)` is mapped, rw, from the memfd with inode `ino`
/// at file offset `addr - span_start` for every address.
fn still_mapped(maps: &[MapEntry], span_start: usize, end: usize, ino: u64) -> bool {
    covering(maps, span_start, end).is_ok_and(|entries| {
        entries.iter().all(|e| {
            e.is_our_memfd()
                && e.readable_writable()
                && e.inode == ino
                && e.start >= span_start
                && e.offset == (e.start - span_start) as u64
        })
    })
}

/// Checks that every page of `[start, end)` may be re-backed: private
/// anonymous read-write memory, or pages of an earlier span no longer
/// registered.
pub(crate) fn check_rebackable(maps: &[MapEntry], start: usize, end: usize) -> Result<()> {
    for e in covering(maps, start, end)? {
        let what = |why: &str| {
            Error::invalid(format!(
                "cannot register [{start:#x}, {end:#x}): the pages at [{:#x}, {:#x}) {why}",
                e.start, e.end
            ))
        };
        if e.path == "[stack]" {
            return Err(what("are the main thread's stack"));
        }
        if !e.readable_writable() {
            return Err(what("are not readable and writable"));
        }
        if e.is_private_anonymous() || e.is_private_hugetlb() || e.is_our_memfd() {
            continue;
        }
        if e.private() && is_loaded_object_data(maps, e) {
            continue;
        }
        if e.path.starts_with('[') {
            return Err(what(&format!("are the special mapping {}", e.path)));
        }
        if e.private() {
            return Err(what(&format!("are backed by the file {:?}", e.path)));
        }
        return Err(what(&format!("are a shared mapping of {:?}, not private anonymous memory", e.path)));
    }
    Ok(())
}

/// Whether `e`, a private mapping of a file, is the writable data segment
/// (`.data`, and the first page of `.bss` where it shares one) of the
/// program or a library it loaded: a file the process also maps
/// executable. Such pages are the process's own, as anonymous memory is
/// (the file gave only their first contents), and programs register
/// their globals (rdma-core's `rdma_client` does); any other file
/// mapping is refused.
fn is_loaded_object_data(maps: &[MapEntry], e: &MapEntry) -> bool {
    e.inode != 0
        && !e.path.is_empty()
        && !e.path.starts_with('[')
        && maps.iter().any(|m| m.inode == e.inode && m.path == e.path && m.perms[2] == b'x')
}

/// The page size of the mapping that starts at `start`, from the
/// `KernelPageSize` line of its `/proc/self/smaps` entry.
fn kernel_page_size(start: usize) -> Result<usize> {
    let text = std::fs::read_to_string("/proc/self/smaps").map_err(|e| {
        Error::Io(std::io::Error::new(
            e.kind(),
            format!("cannot read /proc/self/smaps to register memory: {e}"),
        ))
    })?;
    let mut inside = false;
    for line in text.lines() {
        if let Some(e) = parse_maps_line(line) {
            inside = e.start == start;
        } else if let Some(v) = line.strip_prefix("KernelPageSize:").filter(|_| inside) {
            let kb: usize = v.trim().trim_end_matches("kB").trim().parse().map_err(|_| {
                Error::Io(std::io::Error::other(format!("unreadable KernelPageSize line {line:?}")))
            })?;
            return Ok(kb * 1024);
        }
    }
    Err(Error::Io(std::io::Error::other(format!(
        "no page size for the mapping at {start:#x} in /proc/self/smaps"
    ))))
}

/// The huge page size of the mappings covering `[start, end)`, if they
/// are huge pages (`None` for normal pages, or for a range that is not
/// wholly mapped, which `check_rebackable` reports).
fn huge_page_size(maps: &[MapEntry], start: usize, end: usize) -> Result<Option<usize>> {
    let Ok(entries) = covering(maps, start, end) else { return Ok(None) };
    if !entries.iter().any(|e| e.is_huge()) {
        return Ok(None);
    }
    let mut size = None;
    for e in &entries {
        let s = if e.is_huge() { kernel_page_size(e.start)? } else { page_size() };
        if size.is_some_and(|x| x != s) || s <= page_size() || !s.is_power_of_two() {
            return Err(Error::invalid(format!(
                "cannot register [{start:#x}, {end:#x}): it spans mappings of different page sizes"
            )));
        }
        size = Some(s);
    }
    Ok(size)
}

/// The calling thread's stack `[low, high)`, as pthreads reports it.
///
/// `/proc/self/maps` names only the main thread's stack; the stacks of
/// other threads are plain anonymous mappings there, so this is how a
/// registration of the caller's own stack is recognised.
fn current_thread_stack() -> Option<(usize, usize)> {
    // SAFETY: `pthread_getattr_np` initialises `attr` for the calling
    // thread (a zeroed attr is valid storage for it), which is read with
    // `pthread_attr_getstack` into locals and destroyed once.
    unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        if libc::pthread_getattr_np(libc::pthread_self(), &mut attr) != 0 {
            return None;
        }
        let mut addr: *mut libc::c_void = std::ptr::null_mut();
        let mut size: libc::size_t = 0;
        let rc = libc::pthread_attr_getstack(&attr, &mut addr, &mut size);
        libc::pthread_attr_destroy(&mut attr);
        (rc == 0 && !addr.is_null()).then(|| (addr as usize, (addr as usize).saturating_add(size)))
    }
}

/// The checks of a range to re-back, on a host or in a guest: not empty,
/// not wrapping, not on the calling thread's stack. Gives the range and
/// its page-aligned bounds, `(start, end, pstart, pend)`.
pub(super) fn registrable_pages(ptr: *mut u8, len: usize) -> Result<(usize, usize, usize, usize)> {
    if len == 0 {
        return Err(Error::invalid("cannot register zero bytes"));
    }
    let page = page_size();
    let start = ptr as usize;
    let end = start
        .checked_add(len)
        .ok_or_else(|| Error::invalid("memory range wraps around the address space"))?;
    let pstart = start & !(page - 1);
    let pend = end
        .checked_next_multiple_of(page)
        .ok_or_else(|| Error::invalid("memory range wraps around the address space"))?;

    // Re-backing the caller's own stack would remap pages its live frames
    // (this call's among them) are using: writes made meanwhile are lost.
    if let Some((low, high)) = current_thread_stack() {
        if pstart < high && low < pend {
            return Err(Error::invalid(format!(
                "cannot register [{start:#x}, {end:#x}): it is on the calling thread's stack \
                 [{low:#x}, {high:#x})"
            )));
        }
    }
    Ok((start, end, pstart, pend))
}

/// Re-backs the pages covering `[ptr, ptr + len)` (or finds the span that
/// already does) and returns the span with the range's offset in it.
///
/// # Safety
/// `[ptr, ptr + len)` must be memory this process owns and may write. The
/// covering pages are remapped: writes by other threads to those pages
/// while this runs wait for the new mapping where the kernel allows
/// ([`fence`]), and may be lost elsewhere.
pub(crate) unsafe fn reback(ptr: *mut u8, len: usize) -> Result<Rebacked> {
    let (start, end, pstart, pend) = registrable_pages(ptr, len)?;

    fork::note_rebacking();
    let mut reg = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
    reg.retain(|_, gens| {
        gens.retain(|w| w.strong_count() > 0);
        !gens.is_empty()
    });
    let maps = read_maps()?;

    // Huge pages are re-backed whole, by a memfd of the same huge pages.
    let huge = huge_page_size(&maps, pstart, pend)?;
    let (pstart, pend) = match huge {
        None => (pstart, pend),
        Some(h) => (
            start & !(h - 1),
            end.checked_next_multiple_of(h)
                .ok_or_else(|| Error::invalid("memory range wraps around the address space"))?,
        ),
    };

    // Spans overlapping the page range: those starting before its end and
    // ending after its start.
    let overlapping: Vec<Arc<Span>> =
        reg.range(..pend).filter_map(|(_, gens)| largest(gens)).filter(|s| s.end() > pstart).collect();
    let mut live = Vec::new();
    for span in overlapping {
        if span.guest.is_some() {
            return Err(Error::invalid(format!(
                "[{start:#x}, {end:#x}) overlaps memory registered through a guest context"
            )));
        }
        if !still_mapped(&maps, span.start, span.end(), span.ino) {
            // The application unmapped it (its regions are then dangling,
            // which is its own bug); forget it and re-back afresh.
            tracing::warn!(
                start = span.start,
                len = span.len,
                "vrdma: re-backed memory was unmapped while registered"
            );
            reg.remove(&span.start);
            continue;
        }
        live.push(span);
    }
    match live.as_slice() {
        [] => {}
        [span] if span.start <= pstart && pend <= span.end() => {
            return Ok(Rebacked::one(span.clone(), (start - span.start) as u64));
        }
        [span] if span.start <= pstart && huge.is_none() && span.growable => {
            let grown = grow(&maps, span, pend)?;
            reg.entry(grown.start).or_default().push(Arc::downgrade(&grown));
            return Ok(Rebacked::one(grown.clone(), (start - grown.start) as u64));
        }
        [span, ..] if huge.is_some() || !span.growable => {
            return Err(Error::invalid(format!(
                "[{start:#x}, {end:#x}) overlaps a registration of huge pages with different page bounds \
                 (pages [{:#x}, {:#x}) are re-backed as one span)",
                span.start,
                span.end()
            )));
        }
        // Begins before a span, or covers several: re-backed by pieces.
        _ => return pieces::reback_pieces(&mut reg, &maps, &live, (start, end), (pstart, pend)),
    }

    let span = new_span(&mut reg, &maps, pstart, pend, huge)?;
    Ok(Rebacked::one(span, (start - pstart) as u64))
}

/// Re-backs the pages `[pstart, pend)` (no span's) by a new span and
/// enters it in the registry `reg` (held).
fn new_span(
    reg: &mut Spans,
    maps: &[MapEntry],
    pstart: usize,
    pend: usize,
    huge: Option<usize>,
) -> Result<Arc<Span>> {
    check_rebackable(maps, pstart, pend)?;
    let span_len = pend - pstart;
    let seg = match huge {
        None => Segment::create_growable(MEMFD_NAME, span_len)?,
        // Whole huge pages are re-backed by ordinary shared memory: the
        // daemon refuses hugetlbfs files, because a hole punched into one
        // (which no seal prevents) makes its next access a SIGBUS.
        Some(_) => Segment::create(MEMFD_NAME, span_len)?,
    };
    debug_assert_eq!(seg.len(), span_len);
    // Other threads' writes to the range wait from here until the memfd is
    // mapped (where the kernel allows: see `fence`). Until the fence
    // drops, this thread neither allocates nor writes to the range.
    let fence = fence::WriteFence::raise(pstart, span_len);
    // SAFETY: `[pstart, pend)` is mapped readable (checked against
    // /proc/self/maps just now, under the registry lock, and the caller
    // owns the memory) and `seg` is a fresh private mapping of the same
    // length, so the two ranges are valid and disjoint.
    unsafe { std::ptr::copy_nonoverlapping(pstart as *const u8, seg.as_ptr(), span_len) };
    // SAFETY: the caller owns `[ptr, ptr + len)` and the covering pages
    // are private anonymous memory of this process (checked above); the
    // new mapping holds the same bytes (just copied), so every pointer
    // into those pages stays valid and sees the same contents. Only the
    // backing changes, from anonymous pages to the memfd's.
    let mapped = unsafe {
        rustix::mm::mmap(
            pstart as *mut std::ffi::c_void,
            span_len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED | MapFlags::FIXED,
            seg.fd(),
            0,
        )
    };
    drop(fence);
    let mapped = mapped.map_err(|e| {
        Error::Io(std::io::Error::new(
            std::io::Error::from(e).kind(),
            format!("cannot re-back [{pstart:#x}, {pend:#x}) with a memfd: {e}"),
        ))
    })?;
    if mapped as usize != pstart {
        return Err(Error::Io(std::io::Error::other("MAP_FIXED mapping landed at a different address")));
    }
    let fd = fds::span_fd(seg.fd())?;
    let ino = rustix::fs::fstat(&fd)?.st_ino;
    // The temporary mapping goes; the file lives on in `fd` and in the
    // application's mapping.
    drop(seg);
    let span =
        Arc::new(Span { start: pstart, len: span_len, fd, ino, growable: huge.is_none(), guest: None });
    reg.insert(pstart, vec![Arc::downgrade(&span)]);
    Ok(span)
}

/// Extends `span` over the pages from its end to `pend`: the file grows
/// (where no generation made it that long already), the pages' current
/// bytes go into the extension, and the extension is mapped over them.
/// Returns the new generation; the caller holds the registry lock.
fn grow(maps: &[MapEntry], span: &Arc<Span>, pend: usize) -> Result<Arc<Span>> {
    let (from, add) = (span.end(), pend - span.end());
    check_rebackable(maps, from, pend)?;
    let new_len = pend - span.start;
    let size = rustix::fs::fstat(&span.fd)?.st_size as u64;
    if size < new_len as u64 {
        rustix::fs::ftruncate(&span.fd, new_len as u64).map_err(|e| {
            Error::Io(std::io::Error::new(
                std::io::Error::from(e).kind(),
                format!("cannot grow the re-backed span at {:#x} to {new_len} bytes: {e}", span.start),
            ))
        })?;
    }
    // As for a new span: other threads' writes to the pages wait until
    // the new mapping is in place.
    let fence = fence::WriteFence::raise(from, add);
    // SAFETY: `[from, pend)` is mapped readable and private anonymous
    // (checked just now, under the registry lock), and the caller owns it.
    let bytes = unsafe { std::slice::from_raw_parts(from as *const u8, add) };
    let copied = pwrite_all(span.fd.as_fd(), bytes, span.len as u64);
    // SAFETY: as for a new span: the pages are the caller's private
    // anonymous memory, and the file's extension now holds their bytes, so
    // every pointer into them stays valid and sees the same contents.
    let mapped = copied.and_then(|()| unsafe {
        rustix::mm::mmap(
            from as *mut std::ffi::c_void,
            add,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED | MapFlags::FIXED,
            &span.fd,
            span.len as u64,
        )
        .map_err(std::io::Error::from)
    });
    drop(fence);
    let mapped = mapped.map_err(|e| {
        Error::Io(std::io::Error::new(e.kind(), format!("cannot re-back [{from:#x}, {pend:#x}): {e}")))
    })?;
    if mapped as usize != from {
        return Err(Error::Io(std::io::Error::other("MAP_FIXED mapping landed at a different address")));
    }
    let fd = fds::span_fd(span.fd.as_fd())?;
    Ok(Arc::new(Span { start: span.start, len: new_len, fd, ino: span.ino, growable: true, guest: None }))
}

/// Writes all of `bytes` at `offset` of `fd`.
fn pwrite_all(fd: BorrowedFd<'_>, mut bytes: &[u8], mut offset: u64) -> std::io::Result<()> {
    while !bytes.is_empty() {
        let n = rustix::io::pwrite(fd, bytes, offset)?;
        if n == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::WriteZero, "pwrite wrote nothing"));
        }
        bytes = &bytes[n..];
        offset += n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::alloc::{alloc_zeroed, dealloc, Layout};
    use std::os::fd::AsRawFd;

    const SAMPLE: &str = "\
55d0c4a00000-55d0c4a2a000 r--p 00000000 08:01 1234                       /usr/bin/app
55d0c5a4d000-55d0c5a6e000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0000021000 rw-p 00000000 00:00 0 
7f0000021000-7f0000022000 ---p 00000000 00:00 0 
7f0000100000-7f0000102000 rw-s 00000000 00:01 4242                       /memfd:vrdma-rebacked (deleted)
7f0000102000-7f0000103000 rw-s 00000000 00:01 99                         /dev/shm/other
7f0000200000-7f0000201000 rw-p 00000000 00:00 0                          [anon:my arena]
7f0000201000-7f0000202000 rw-p 00003000 08:01 77                         /usr/lib/libfoo.so
7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0                          [stack]
";

    #[test]
    fn parses_lines() {
        let m = parse_maps(SAMPLE);
        assert_eq!(m.len(), 9);
        assert_eq!(m[1].path, "[heap]");
        assert_eq!(m[1].start, 0x55d0c5a4d000);
        assert_eq!(m[2].path, "");
        assert_eq!(&m[4].perms, b"rw-s");
        assert_eq!(m[4].inode, 4242);
        assert_eq!(m[4].path, "/memfd:vrdma-rebacked (deleted)");
        assert_eq!(m[7].offset, 0x3000);
        assert!(parse_maps_line("garbage").is_none());
        assert!(parse_maps_line("").is_none());
    }

    #[test]
    fn classifies() {
        let m = parse_maps(SAMPLE);
        let ok = |s, e| check_rebackable(&m, s, e);
        assert!(ok(0x55d0c5a4d000, 0x55d0c5a4f000).is_ok(), "heap");
        assert!(ok(0x7f0000000000, 0x7f0000021000).is_ok(), "anonymous");
        assert!(ok(0x7f0000200000, 0x7f0000201000).is_ok(), "named anonymous");
        assert!(ok(0x7f0000100000, 0x7f0000102000).is_ok(), "our old memfd");
        let err = |s, e| ok(s, e).unwrap_err().to_string();
        assert!(err(0x7ffc00000000, 0x7ffc00001000).contains("stack"));
        assert!(err(0x55d0c4a00000, 0x55d0c4a01000).contains("readable and writable"));
        assert!(err(0x7f0000201000, 0x7f0000202000).contains("file \"/usr/lib/libfoo.so\""));
        assert!(err(0x7f0000102000, 0x7f0000103000).contains("shared mapping"));
        assert!(err(0x7f0000020000, 0x7f0000022000).contains("readable and writable"));
        assert!(err(0x7f0000300000, 0x7f0000301000).contains("not mapped"));
        // A good mapping followed by a foreign shared one, then a gap.
        assert!(err(0x7f0000101000, 0x7f0000103000).contains("shared"));
        assert!(err(0x7f0000101000, 0x7f0000201000).contains("not mapped"));
        assert!(err(0x7f0000103000, 0x7f0000201000).contains("not mapped"));
        assert!(check_rebackable(&m, 0xe00000000000, 0xe00000001000).is_err());
        assert!(check_rebackable(&[], 0x1000, 0x2000).is_err());
    }

    /// The data segment of a loaded object (its file also mapped
    /// executable) is re-backed; a private mapping of a file that is no
    /// loaded object is not.
    #[test]
    fn a_loaded_objects_data_segment_is_rebackable() {
        let m = parse_maps(
            "\
55d0c4a00000-55d0c4a01000 r--p 00000000 08:01 1234                       /usr/bin/app
55d0c4a01000-55d0c4a02000 r-xp 00001000 08:01 1234                       /usr/bin/app
55d0c4a03000-55d0c4a04000 rw-p 00003000 08:01 1234                       /usr/bin/app
55d0c4a04000-55d0c4a05000 rw-p 00000000 00:00 0 
7f0000201000-7f0000202000 rw-p 00003000 08:01 77                         /tmp/data
",
        );
        assert!(check_rebackable(&m, 0x55d0c4a03000, 0x55d0c4a05000).is_ok(), "data and bss");
        assert!(check_rebackable(&m, 0x55d0c4a01000, 0x55d0c4a02000).is_err(), "text");
        let err = check_rebackable(&m, 0x7f0000201000, 0x7f0000202000).unwrap_err().to_string();
        assert!(err.contains("file \"/tmp/data\""), "{err}");
    }

    #[test]
    fn still_mapped_checks_inode_and_offset() {
        let m = parse_maps(SAMPLE);
        assert!(still_mapped(&m, 0x7f0000100000, 0x7f0000102000, 4242));
        assert!(!still_mapped(&m, 0x7f0000100000, 0x7f0000102000, 4243));
        assert!(!still_mapped(&m, 0x7f00000ff000, 0x7f0000102000, 4242));
        assert!(!still_mapped(&m, 0x7f0000000000, 0x7f0000001000, 0));
    }

    /// A page-aligned allocation owned outright by the test, so that
    /// re-backing its pages cannot race with other tests' allocations.
    struct Pages {
        ptr: *mut u8,
        layout: Layout,
    }

    impl Pages {
        fn new(n: usize) -> Pages {
            let layout = Layout::from_size_align(n * page_size(), page_size()).unwrap();
            // SAFETY: the layout has non-zero size.
            let ptr = unsafe { alloc_zeroed(layout) };
            assert!(!ptr.is_null());
            Pages { ptr, layout }
        }
    }

    impl Drop for Pages {
        fn drop(&mut self) {
            // SAFETY: allocated in `new` with this layout.
            unsafe { dealloc(self.ptr, self.layout) }
        }
    }

    #[test]
    fn rebacks_and_shares() {
        let p = page_size();
        let pages = Pages::new(3);
        // SAFETY: inside the 3-page allocation.
        unsafe {
            for i in 0..3 * p {
                pages.ptr.add(i).write((i % 251) as u8);
            }
        }
        // A range starting mid-page and ending mid-page.
        // SAFETY: the allocation is ours and no other thread touches it.
        let r = unsafe { reback(pages.ptr.add(100), p + 50) }.unwrap();
        assert_eq!(r.fd_offset, 100);
        assert_eq!(r.span.start(), pages.ptr as usize);
        assert_eq!(r.span.end(), pages.ptr as usize + 2 * p);
        // Contents survived.
        // SAFETY: inside the allocation.
        unsafe {
            for i in 0..3 * p {
                assert_eq!(pages.ptr.add(i).read(), (i % 251) as u8, "byte {i}");
            }
        }
        // The memfd and the application's pointer see the same bytes.
        let other = Segment::map_trusted(r.span.fd().try_clone_to_owned().unwrap(), 2 * p).unwrap();
        // SAFETY: both inside their mappings.
        unsafe {
            pages.ptr.add(100).write(0xee);
            assert_eq!(other.as_ptr().add(100).read_volatile(), 0xee);
            other.as_ptr().add(p + 7).write_volatile(0x11);
            assert_eq!(pages.ptr.add(p + 7).read_volatile(), 0x11);
        }
        let maps = read_maps().unwrap();
        assert!(still_mapped(&maps, r.span.start(), r.span.end(), r.span.ino));

        // Fully inside: the same span, no remapping.
        // SAFETY: as above.
        let inner = unsafe { reback(pages.ptr.add(p + 8), 16) }.unwrap();
        assert!(Arc::ptr_eq(&inner.span, &r.span));
        assert_eq!(inner.fd_offset, (p + 8) as u64);

        // A range from inside the span to past its end grows it: one file,
        // the old pages and the new, seen alike through old and new.
        // SAFETY: inside the allocation.
        unsafe { pages.ptr.add(2 * p + 9).write(0x42) };
        // SAFETY: as above.
        let grown = unsafe { reback(pages.ptr.add(p), 2 * p) }.unwrap();
        assert_eq!((grown.span.start(), grown.span.end()), (pages.ptr as usize, pages.ptr as usize + 3 * p));
        assert_eq!(grown.fd_offset, p as u64);
        assert_eq!(grown.span.ino, r.span.ino, "the same file");
        let whole = Segment::map_trusted(grown.span.fd().try_clone_to_owned().unwrap(), 3 * p).unwrap();
        // SAFETY: inside the allocation and the mappings.
        unsafe {
            assert_eq!(pages.ptr.add(2 * p + 9).read(), 0x42, "the new page kept its byte");
            assert_eq!(whole.as_ptr().add(2 * p + 9).read_volatile(), 0x42);
            pages.ptr.add(2 * p + 10).write(0x43);
            assert_eq!(whole.as_ptr().add(2 * p + 10).read_volatile(), 0x43);
            // The first generation's view (what the daemon mapped for the
            // first region) still shares the old pages.
            pages.ptr.add(101).write(0x44);
            assert_eq!(other.as_ptr().add(101).read_volatile(), 0x44);
        }
        // Inside the old pages, the span is found while either generation
        // lives.
        drop(grown);
        // SAFETY: as above.
        let again_inner = unsafe { reback(pages.ptr.add(8), 16) }.unwrap();
        assert_eq!(again_inner.span.ino, r.span.ino);
        drop(again_inner);
        drop(whole);

        // A range beginning before a span it overlaps is made of pieces:
        // a new span for the page before, and the span's part. (With no
        // region left over the old span, the middle page is re-backed as
        // a span of its own first.)
        drop((inner, r, other));
        // SAFETY: as above.
        let inside = unsafe { reback(pages.ptr.add(p + 8), 16) }.unwrap();
        assert_eq!(inside.span.start(), pages.ptr as usize + p);
        // SAFETY: as above.
        let pieced = unsafe { reback(pages.ptr.add(5), 2 * p - 10) }.unwrap();
        let shape: Vec<(usize, u64, usize)> =
            pieced.pieces.iter().map(|x| (x.span.start(), x.fd_offset, x.len)).collect();
        assert_eq!(shape, vec![(pages.ptr as usize, 5, p - 5), (pages.ptr as usize + p, 0, p - 5)]);
        assert!(Arc::ptr_eq(&pieced.pieces[1].span, &inside.span), "the span's own file");
        assert_eq!((pieced.span.start(), pieced.fd_offset), (pages.ptr as usize, 5));
        // SAFETY: inside the allocation.
        unsafe {
            assert_eq!(pages.ptr.add(100).read(), 0xee, "kept its bytes");
            assert_eq!(pages.ptr.add(p + 7).read(), 0x11);
        }

        // Once no region holds the spans, their pages may be re-backed
        // anew with other bounds.
        drop((inside, pieced));
        // SAFETY: as above.
        let again = unsafe { reback(pages.ptr, 3 * p) }.unwrap();
        assert_eq!(again.span.start(), pages.ptr as usize);
        assert_eq!(again.span.end(), pages.ptr as usize + 3 * p);
        // SAFETY: inside the allocation.
        unsafe {
            assert_eq!(pages.ptr.add(100).read(), 0xee);
            assert_eq!(pages.ptr.add(p + 7).read(), 0x11);
            assert_eq!(pages.ptr.add(2 * p + 5).read(), ((2 * p + 5) % 251) as u8);
        }
    }

    #[test]
    fn writes_of_other_threads_during_rebacking_are_not_lost() {
        if !fence::available() {
            eprintln!("skipping: no userfaultfd write protection here; re-backing cannot hold writers off");
            return;
        }
        // Another thread keeps writing to the page being re-backed, and
        // reads each write back: a write that went to the old pages after
        // the copy would read back as the copy's older value.
        let mut lost = 0;
        let mut writes = 0;
        for _ in 0..200 {
            let pages = Pages::new(1);
            let base = pages.ptr as usize;
            let stop = std::sync::atomic::AtomicBool::new(false);
            let started = std::sync::atomic::AtomicBool::new(false);
            let r = std::thread::scope(|s| {
                let writer = s.spawn(|| {
                    let at = (base + 8) as *mut u32;
                    let (mut n, mut lost) = (0u32, 0);
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        n += 1;
                        // SAFETY: inside the page, which only this thread
                        // writes (re-backing copies it).
                        unsafe { at.write_volatile(n) };
                        // SAFETY: as above.
                        if unsafe { at.read_volatile() } != n {
                            lost += 1;
                        }
                        started.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                    (n, lost)
                });
                while !started.load(std::sync::atomic::Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
                // SAFETY: the page is ours; its other bytes are the writer's,
                // which is what this test is about.
                let r = unsafe { reback((base + 64) as *mut u8, 64) }.unwrap();
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
                let (n, l) = writer.join().unwrap();
                writes += n;
                lost += l;
                r
            });
            drop(r);
        }
        assert_eq!(lost, 0, "{lost} of {writes} writes were lost while their page was re-backed");
    }

    /// Heap chunks on re-backed pages, half of them freed, then a fork
    /// whose child only leaves: if the child's allocator reused those
    /// chunks while the pages were still shared, its chunk headers would
    /// land in the parent's heap. Run in a forked, single-threaded process,
    /// so that no other thread's allocations touch the chunks; returns the
    /// number of bytes of the freed chunks that changed.
    fn bytes_a_child_changes_in_freed_heap_chunks() -> usize {
        let chunks: Vec<(*mut u8, usize)> = (0..32)
            .map(|i| {
                let n = 32 << (i % 8);
                // SAFETY: plain malloc, checked.
                let p = unsafe { libc::malloc(n) }.cast::<u8>();
                assert!(!p.is_null());
                (p, n)
            })
            .collect();
        let first = chunks[0].0 as usize;
        let chunks: Vec<_> =
            chunks.into_iter().filter(|c| (c.0 as usize).abs_diff(first) < 256 << 10).collect();
        // SAFETY: plain malloc; it keeps the heap from shrinking under the
        // freed chunks.
        let _guard = unsafe { libc::malloc(64) };
        let lo = chunks.iter().map(|c| c.0 as usize).min().unwrap();
        let hi = chunks.iter().map(|c| c.0 as usize + c.1).max().unwrap();
        // SAFETY: the pages hold our chunks and the allocator's neighbours,
        // which keep their bytes.
        let r = unsafe { reback(lo as *mut u8, hi - lo) }.unwrap();
        let freed: Vec<_> = chunks.iter().copied().step_by(2).collect();
        let total: usize = freed.iter().map(|c| c.1).sum();
        // Snapshots go to fresh mappings: nothing allocates from here on.
        let map = || {
            // SAFETY: a fresh anonymous mapping, checked.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    total,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            p.cast::<u8>()
        };
        let (before, after) = (map(), map());
        let snapshot = |to: *mut u8| {
            let mut off = 0;
            for &(p, n) in &freed {
                // SAFETY: the chunks stay mapped (the guard follows them);
                // `to` holds `total` bytes.
                unsafe { std::ptr::copy_nonoverlapping(p, to.add(off), n) };
                off += n;
            }
        };
        for &(p, _) in &freed {
            // SAFETY: malloc'd above, freed once.
            unsafe { libc::free(p.cast()) };
        }
        snapshot(before);
        // SAFETY: the child only leaves, with _exit (the fork handler runs
        // first).
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: ends the child at once.
            unsafe { libc::_exit(0) };
        }
        let mut status = 0;
        // SAFETY: our child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        snapshot(after);
        // SAFETY: both mappings hold `total` bytes.
        let changed = (0..total).filter(|&i| unsafe { before.add(i).read() != after.add(i).read() }).count();
        drop(r);
        changed
    }

    #[test]
    fn a_forked_child_leaves_the_parents_heap_alone() {
        // SAFETY: the child runs the check single-threaded and leaves with
        // _exit, its status saying how it went.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let changed = std::panic::catch_unwind(bytes_a_child_changes_in_freed_heap_chunks).unwrap_or(255);
            // SAFETY: ends the child at once.
            unsafe { libc::_exit(changed.min(255) as i32) };
        }
        let mut status = 0;
        // SAFETY: our child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "the check died: status {status:#x}");
        let changed = libc::WEXITSTATUS(status);
        assert_eq!(changed, 0, "a forked child wrote {changed} bytes (255: or more, or the check failed) of the parent's freed heap chunks");
    }

    /// Under a soft descriptor limit of 64, re-backs 400 separate buffers;
    /// returns 0 if all went and the span descriptors kept out of the
    /// program's low numbers, else a code saying what failed.
    fn many_spans_under_a_low_descriptor_limit() -> i32 {
        let lim = rustix::process::getrlimit(rustix::process::Resource::Nofile);
        let low = rustix::process::Rlimit { current: Some(64), maximum: lim.maximum };
        if rustix::process::setrlimit(rustix::process::Resource::Nofile, low).is_err() {
            return 1;
        }
        // Separate allocations of two pages, of which the first is
        // registered: no two share a page, so each is its own span.
        let bufs: Vec<Pages> = (0..400).map(|_| Pages::new(2)).collect();
        let mut spans = Vec::new();
        for b in &bufs {
            // SAFETY: a page this test owns, written by no other thread.
            match unsafe { reback(b.ptr, 16) } {
                Ok(r) => spans.push(r),
                Err(_) => return 2,
            }
        }
        if spans.iter().any(|r| r.span.fd().as_raw_fd() < fds::SPAN_FD_BASE) {
            return 3;
        }
        let probe = std::fs::File::open("/dev/null").map(|f| f.as_raw_fd());
        if !matches!(probe, Ok(n) if n < 64) {
            return 4;
        }
        drop(spans);
        0
    }

    #[test]
    fn hundreds_of_spans_fit_under_a_low_descriptor_limit_and_leave_low_numbers_alone() {
        // SAFETY: the child runs the check and leaves with _exit, its
        // status saying how it went; the limit it lowers is its own.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let code = std::panic::catch_unwind(many_spans_under_a_low_descriptor_limit).unwrap_or(255);
            // SAFETY: ends the child at once.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: our child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "the check died: status {status:#x}");
        let what = match libc::WEXITSTATUS(status) {
            0 => return,
            1 => "cannot lower the limit",
            2 => "a registration failed (out of descriptors?)",
            3 => "a span's descriptor took a number below 1024",
            4 => "the program's next descriptor is not a low number",
            _ => "the check panicked",
        };
        panic!("{what}");
    }

    #[test]
    fn a_child_forked_while_another_thread_re_backs_can_re_back_memory() {
        // Another thread holds the registry, as it does all through a
        // re-backing, when this one forks. The fork waits for it; before
        // the fork handlers did, the child inherited the lock held and its
        // own registration waited for ever.
        let (held, holding) = std::sync::mpsc::channel();
        let holder = std::thread::spawn(move || {
            let reg = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
            held.send(()).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(200));
            drop(reg);
        });
        holding.recv().unwrap();
        // SAFETY: the child re-backs a page of its own and leaves with
        // _exit, its status saying how it went.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let pages = Pages::new(1);
            // SAFETY: a page the child owns, written by no other thread.
            let code = match unsafe { reback(pages.ptr, 16) } {
                Ok(_) => 0,
                Err(_) => 2,
            };
            // SAFETY: ends the child at once.
            unsafe { libc::_exit(code) };
        }
        holder.join().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut status = 0;
        // SAFETY: our child.
        while unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == 0 {
            if std::time::Instant::now() > deadline {
                // SAFETY: our child, which is stuck.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                // SAFETY: reaps it.
                unsafe { libc::waitpid(pid, &mut status, 0) };
                panic!("the child's registration still waits after 10 s: it inherited a held registry lock");
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(libc::WIFEXITED(status), "the child died: status {status:#x}");
        assert_eq!(libc::WEXITSTATUS(status), 0, "the child's registration failed");
    }

    #[test]
    fn refuses_file_backed_and_empty() {
        fn probe() {}
        let code = probe as fn() as usize as *mut u8;
        // SAFETY: refused before anything is remapped (the code pages are
        // not writable).
        let e = unsafe { reback(code, 16) }.unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
        assert!(e.to_string().contains("readable and writable"), "{e}");
        let pages = Pages::new(1);
        // SAFETY: zero bytes are refused at once.
        let e = unsafe { reback(pages.ptr, 0) }.unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
        // SAFETY: refused before any access (the range wraps).
        let e = unsafe { reback(usize::MAX as *mut u8, 2) }.unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
    }
}
