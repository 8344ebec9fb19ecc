//! Re-backing in guest mode: registered pages move into the VM's region.
//!
//! In a guest the daemon reaches only the VM's shared region (the ivshmem
//! BAR). So a registration asks the daemon for an extent of it (for this
//! context's session), copies the pages' bytes there and maps the BAR at
//! that extent over the same addresses, as the host re-backs with a memfd
//! (see the parent module). Differences: huge pages are refused, a span is
//! reused only by registrations through the same context (the daemon
//! checks that a region lies in an extent of the session registering it).
//!
//! When the last region over a span goes, its pages stay mapped from the
//! extent, which the context keeps (the kept set): moving them back to
//! private memory cannot be fenced in a guest (see [`super::move_back`])
//! and they are usually heap pages that other threads are using, so they
//! move only when they must: when the context closes (its session's end
//! frees the extent for anything else of the VM), when a registration of
//! another context or with other page bounds needs their place, or when
//! the VM's region is full, or when they would hold more than a quarter
//! of it (the region is all the VM's processes'), or before a `fork`
//! (glibc's reset of its allocator in the child would write into a kept
//! heap page's arena header for the parent: [`fork_preparing`]; their
//! extents then go back at the next registration). A registration on kept pages reuses the
//! span, as on a live one; an extent whose pages the application unmapped
//! goes back at the next registration, with nothing to move. The cost:
//! a context's deregistered heap pages hold their extent of the region
//! until then.
//!
//! A range that starts inside a live span of the same context and ends
//! past it *grows* the span, as on the host (two heap buffers sharing a
//! page, each registered on its own, are the common case): the daemon
//! grows the span's extent in place (`Request::GuestGrow`) into the free
//! bytes right after it, then the new pages' bytes are copied into the
//! extension and the BAR is mapped there over them. Nothing mapped
//! before moves, so the regions over the old pages keep their offsets and
//! the daemon's mappings of them. The daemon allocates memory extents with
//! headroom that other allocations leave free while they fit elsewhere,
//! so the bytes after an extent are usually free; where they are not
//! (taken, or past the region's end) the registration is refused with the
//! daemon's reason (`ENOMEM`). There is no fallback to a fresh extent: the
//! span is live only while a region holds it, and that region's
//! daemon-side mapping still points at the old extent. The generations of
//! a grown span share one [`GuestExtent`], which moves the pages back and
//! gives the extent back when the last of them goes. A range that begins
//! before a span it overlaps, or that covers several, is made of pieces
//! as on the host (`super::pieces`), except that each gap between the
//! spans becomes a new extent of its own (growing one needs free bytes
//! after it; a fresh one does not), and the pieces are offsets of the
//! region, with no descriptors to count.
//!
//! After `fork` the child gets private copies of the BAR's mappings, as
//! of the host's memfd spans (`super::fork`): its writes never reach the
//! parent's registered pages or the heap objects beside them.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex};

use rustix::mm::{MapFlags, ProtFlags};
use vrdma_shm::Segment;

use super::move_back::move_back_to_private;
use super::{check_rebackable, MapEntry, Spans, REGISTRY};
use super::{covering, fds, fence, huge_page_size, largest, read_maps, Piece, Rebacked, Span};
use crate::error::{Error, Result};

/// What makes a span an extent of the VM's region.
pub(crate) struct GuestSpan {
    /// The extent's offset in the BAR.
    pub offset: u64,
    /// The offset `/proc/self/maps` shows for the span's first page. Not
    /// `offset` in a real guest: the kernel's mapping of a PCI BAR
    /// through sysfs (`resource2`) adds the BAR's physical page number to
    /// the mapping's page offset (`pci_mmap_resource_range`), so maps
    /// shows the BAR's bus address plus `offset`; the region memfd that
    /// host tests map shows `offset` itself.
    maps_offset: u64,
    /// The context whose session holds the extent.
    pub owner: usize,
    /// The extent, shared by the span's generations.
    extent: Arc<GuestExtent>,
}

impl std::fmt::Debug for GuestSpan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestSpan").field("offset", &self.offset).field("owner", &self.owner).finish()
    }
}

/// An extent mapped over the application's pages, shared by every
/// generation of its span (a grown span is a new `Span`; the regions made
/// before hold the old one). When the last goes, the pages go back to
/// private memory and the extent back to the daemon.
struct GuestExtent {
    /// The first page's address.
    start: usize,
    /// The extent's offset in the BAR.
    offset: u64,
    /// The BAR, to move the pages back through.
    bar: OwnedFd,
    /// The process that made it: a child of `fork` holds a copy of the
    /// parent's, whose extent is the parent's to give back.
    pid: u32,
    /// The BAR's inode.
    ino: u64,
    /// What `/proc/self/maps` shows for `start` ([`GuestSpan::maps_offset`]).
    maps_offset: u64,
    /// The pieces mapped from the extent, contiguous from `start`: the
    /// first mapping, then one per growth.
    pieces: Mutex<Vec<(usize, usize)>>,
    /// Gives the extent back (once, when the extent goes).
    release: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl GuestExtent {
    /// The end of the pages mapped from the extent.
    fn mapped_end(pieces: &[(usize, usize)], start: usize) -> usize {
        pieces.last().map_or(start, |&(s, l)| s + l)
    }

    /// What `/proc/self/maps` shows for `addr` of the extent's pages.
    fn maps_offset_of(&self, addr: usize) -> u64 {
        self.maps_offset + (addr - self.start) as u64
    }

    /// Moves what is still mapped from the extent of `pieces` back to
    /// private memory with its bytes; whether all of it went.
    fn move_back(&self, pieces: &[(usize, usize)]) -> bool {
        read_maps().is_ok_and(|maps| {
            pieces.iter().all(|&(at, len)| {
                bar_pages(&maps, at, at + len, self.ino, self.maps_offset_of(at)).into_iter().all(|(s, n)| {
                    let offset = self.offset + (s - self.start) as u64;
                    move_back_to_private(self.bar.as_fd(), offset, s, n)
                })
            })
        })
    }
}

/// How a guest context gets extents.
pub(crate) struct GuestSource<'a> {
    /// The context (its address): spans are reused only by their owner.
    pub owner: usize,
    /// The BAR.
    pub bar: BorrowedFd<'a>,
    /// Asks the daemon for an extent of at least the given bytes: its
    /// offset and length.
    pub alloc: &'a dyn Fn(u64) -> Result<(u64, u64)>,
    /// What gives the extent at an offset back.
    pub release: &'a dyn Fn(u64) -> Box<dyn FnOnce() + Send>,
    /// Asks the daemon to grow the extent at an offset in place to at
    /// least the given bytes: its new length.
    pub grow: &'a dyn Fn(u64, u64) -> Result<u64>,
}

#[cfg(test)]
/// Whether `[span_start, end)` is still mapped, rw and shared, from the
/// file with inode `ino`, where maps shows offset `base + (addr -
/// span_start)` for each address (`base`: [`GuestSpan::maps_offset`]).
fn still_in_bar(span_start: usize, end: usize, ino: u64, base: u64) -> bool {
    read_maps().is_ok_and(|maps| in_bar(&maps, span_start, end, ino, base))
}

/// [`still_in_bar`] on the lines `maps`.
fn in_bar(maps: &[super::MapEntry], span_start: usize, end: usize, ino: u64, base: u64) -> bool {
    covering(maps, span_start, end).is_ok_and(|entries| {
        entries.iter().all(|e| {
            // The first address of the span in this entry (an entry may
            // begin before the span where the kernel merged mappings).
            let at = e.start.max(span_start);
            e.readable_writable()
                && !e.private()
                && e.inode == ino
                && e.offset + (at - e.start) as u64 == base + (at - span_start) as u64
        })
    })
}

/// The offset `/proc/self/maps` shows for `addr`, mapped just now.
fn maps_offset_at(addr: usize) -> Result<u64> {
    let maps = read_maps()?;
    let e = covering(&maps, addr, addr + 1)?
        .into_iter()
        .next()
        .ok_or_else(|| Error::invalid(format!("{addr:#x} is not mapped")))?;
    Ok(e.offset + (addr - e.start) as u64)
}

/// Guest spans held after their last registration may have gone, so that
/// their pages stay mapped from the VM's region (see the module's doc),
/// by start: each span's largest generation.
struct Kept {
    /// The process whose spans these are (0 before the first).
    pid: u32,
    spans: BTreeMap<usize, Arc<Span>>,
}

impl Kept {
    /// The kept spans of this process. A child of `fork` forgets its
    /// parent's without dropping them: their extents are the parent's to
    /// give back, through the parent's connection.
    fn of_this_process(&mut self) -> &mut BTreeMap<usize, Arc<Span>> {
        let pid = std::process::id();
        if self.pid != pid {
            std::mem::forget(std::mem::take(&mut self.spans));
            self.pid = pid;
        }
        &mut self.spans
    }
}

/// Locked after [`REGISTRY`], only while it is held.
static KEPT: Mutex<Kept> = Mutex::new(Kept { pid: 0, spans: BTreeMap::new() });

/// Whether only the kept set holds `span` and its extent: no region lies
/// on its pages.
fn idle(span: &Arc<Span>) -> bool {
    Arc::strong_count(span) == 1 && span.guest.as_ref().is_some_and(|g| Arc::strong_count(&g.extent) == 1)
}

/// Stops keeping the span at `start`: with no region on it, it drops,
/// moving what is still mapped of its pages back to private memory and
/// giving its extent back.
fn unkeep(reg: &mut Spans, kept: &mut BTreeMap<usize, Arc<Span>>, start: usize) {
    if let Some(span) = kept.remove(&start) {
        if idle(&span) {
            reg.remove(&start);
        }
    }
}

/// Gives back the extents of idle kept spans whose pages the application
/// unmapped (or mapped over) since: nothing of them is left to move.
fn sweep(reg: &mut Spans, kept: &mut BTreeMap<usize, Arc<Span>>, maps: &[MapEntry]) {
    let gone: Vec<usize> = kept
        .iter()
        .filter(|(_, span)| idle(span))
        .filter(|(_, span)| {
            let g = span.guest.as_ref().expect("kept spans are guest spans");
            let pieces = g.extent.pieces.lock().unwrap_or_else(|p| p.into_inner());
            pieces.iter().all(|&(at, len)| {
                bar_pages(maps, at, at + len, g.extent.ino, g.extent.maps_offset_of(at)).is_empty()
            })
        })
        .map(|(&start, _)| start)
        .collect();
    for start in gone {
        unkeep(reg, kept, start);
    }
}

/// The share of the VM's region a process keeps for deregistered pages at
/// most (1/4): the region is all the VM's processes'.
const KEPT_SHARE: u64 = 4;

/// Moves idle kept spans back until they hold at most `limit` bytes of
/// the region. Returns whether any moved.
fn trim(reg: &mut Spans, kept: &mut BTreeMap<usize, Arc<Span>>, limit: u64) -> bool {
    let idle_spans: Vec<(usize, u64)> =
        kept.iter().filter(|(_, s)| idle(s)).map(|(&start, s)| (start, (reach(s) - start) as u64)).collect();
    let mut held: u64 = idle_spans.iter().map(|&(_, n)| n).sum();
    let mut moved = false;
    for (start, n) in idle_spans {
        if held <= limit {
            break;
        }
        unkeep(reg, kept, start);
        held -= n;
        moved = true;
    }
    moved
}

/// Called as the guest context `owner` closes (after its last region
/// went): its kept spans' pages move back to private memory before its
/// session ends, since the daemon then frees the session's extents for
/// anything else of the VM.
pub(crate) fn context_closing(owner: usize) {
    let mut reg = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
    let mut kept = KEPT.lock().unwrap_or_else(|p| p.into_inner());
    let kept = kept.of_this_process();
    let owned: Vec<usize> = kept
        .iter()
        .filter(|(_, s)| s.guest.as_ref().is_some_and(|g| g.owner == owner))
        .map(|(&start, _)| start)
        .collect();
    for start in owned {
        unkeep(&mut reg, kept, start);
    }
}

/// Called by the forking thread before `fork`, with the registry's lock
/// held: the pages of idle kept spans move back to private memory. In
/// the child, glibc resets each malloc arena's lock and thread count (in
/// the arena's header, at the start of its first heap) before any
/// handler of ours runs; a header in a page still mapped from the BAR
/// took those writes for the parent, whose thread of that arena then
/// aborted at its exit (`a->attached_threads > 0`). Deregistered heap
/// pages are what kept a header there for long; pages a live region lies
/// on stay (see `super::fork`). The spans stay kept, with nothing mapped
/// from their extents: the next registration's sweep, or the context's
/// close, gives the extents back (a daemon round trip, and a context
/// that might drop, have no place in a fork).
pub(crate) fn fork_preparing() {
    let mut kept = KEPT.lock().unwrap_or_else(|p| p.into_inner());
    for span in kept.of_this_process().values().filter(|s| idle(s)) {
        let g = span.guest.as_ref().expect("kept spans are guest spans");
        let pieces = g.extent.pieces.lock().unwrap_or_else(|p| p.into_inner()).clone();
        g.extent.move_back(&pieces);
    }
}

/// [`super::reback`] in guest mode (see the module's doc).
///
/// # Safety
/// As [`super::reback`].
pub(crate) unsafe fn reback_guest(ptr: *mut u8, len: usize, src: &GuestSource<'_>) -> Result<Rebacked> {
    let (start, end, pstart, pend) = super::registrable_pages(ptr, len)?;
    let mut reg = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
    reg.retain(|_, gens| {
        gens.retain(|w| w.strong_count() > 0);
        !gens.is_empty()
    });
    let mut kept = KEPT.lock().unwrap_or_else(|p| p.into_inner());
    let kept = kept.of_this_process();
    let maps = read_maps()?;
    sweep(&mut reg, kept, &maps);
    let region = u64::try_from(rustix::fs::fstat(src.bar)?.st_size).unwrap_or(0);
    let maps = if trim(&mut reg, kept, region / KEPT_SHARE) { read_maps()? } else { maps };
    if huge_page_size(&maps, pstart, pend)?.is_some() {
        return Err(Error::Unsupported("registering huge pages from a guest".into()));
    }
    // Taken before the spans below are cloned.
    let idle_starts: Vec<usize> = kept.iter().filter(|(_, s)| idle(s)).map(|(&s, _)| s).collect();
    let overlapping: Vec<Arc<Span>> =
        reg.range(..pend).filter_map(|(_, gens)| largest(gens)).filter(|s| reach(s) > pstart).collect();
    let mut live = Vec::new();
    // Whether pages moved back here: `maps` is stale then.
    let mut moved = false;
    for span in overlapping {
        let Some(g) = &span.guest else {
            return Err(Error::invalid(format!(
                "[{start:#x}, {end:#x}) overlaps memory re-backed for the host"
            )));
        };
        if !in_bar(&maps, span.start, span.end(), span.ino, g.maps_offset) {
            if !idle_starts.contains(&span.start) {
                tracing::warn!(
                    start = span.start,
                    len = span.len,
                    "vrdma: re-backed memory was unmapped while registered"
                );
            }
            reg.remove(&span.start);
            unkeep(&mut reg, kept, span.start);
            moved = true;
            continue;
        }
        live.push(span);
    }
    // Idle spans in this registration's way (another context's, or pages
    // it does not begin in) move back to private memory and make room.
    let fits = |s: &Arc<Span>| s.start <= pstart && s.guest.as_ref().is_some_and(|g| g.owner == src.owner);
    if live.len() > 1 || live.first().is_some_and(|s| !fits(s)) {
        live.retain(|s| {
            let in_the_way = idle_starts.contains(&s.start);
            if in_the_way {
                kept.remove(&s.start);
                reg.remove(&s.start);
                moved = true;
            }
            !in_the_way
        });
    }
    let maps = if moved { read_maps()? } else { maps };
    match live.as_slice() {
        [] => {}
        [span] if span.start <= pstart && pend <= span.end() => {
            let g = span.guest.as_ref().expect("checked above");
            if g.owner != src.owner {
                return Err(Error::invalid(format!(
                    "[{start:#x}, {end:#x}) lies in pages registered through another context; \
                     in a guest, pages are shared between registrations of one context only"
                )));
            }
            return Ok(Rebacked::one(span.clone(), g.offset + (start - span.start) as u64));
        }
        [span] if span.start <= pstart => {
            let g = span.guest.as_ref().expect("checked above");
            if g.owner != src.owner {
                return Err(Error::invalid(format!(
                    "[{start:#x}, {end:#x}) begins in pages registered through another context; \
                     in a guest, pages are shared between registrations of one context only"
                )));
            }
            let grown = grow(&maps, span, (start, end), pend, src)?;
            let fd_offset = g.offset + (start - grown.start) as u64;
            reg.entry(grown.start).or_default().push(Arc::downgrade(&grown));
            kept.insert(grown.start, grown.clone());
            return Ok(Rebacked::one(grown, fd_offset));
        }
        // Begins before a span, or covers several: re-backed by pieces.
        _ => return reback_guest_pieces(&mut reg, kept, &maps, &live, (start, end), (pstart, pend), src),
    }
    drop(live);
    let span = new_span(&mut reg, kept, &maps, pstart, pend, src)?;
    Ok(Rebacked::one(
        span.clone(),
        span.guest.as_ref().expect("a guest span").offset + (start - pstart) as u64,
    ))
}

/// Re-backs the pages `[pstart, pend)` (no span's) by a new extent of the
/// VM's region and enters the span in the registry `reg` and the kept set
/// (both held).
fn new_span(
    reg: &mut Spans,
    kept: &mut BTreeMap<usize, Arc<Span>>,
    maps: &[MapEntry],
    pstart: usize,
    pend: usize,
    src: &GuestSource<'_>,
) -> Result<Arc<Span>> {
    check_rebackable(maps, pstart, pend)?;
    let span_len = pend - pstart;
    let (offset, _) = match (src.alloc)(span_len as u64) {
        // The region is full: idle spans' extents make room.
        Err(e) if e.errno() == libc::ENOMEM && kept.values().any(idle) => {
            let idle_now: Vec<usize> = kept.iter().filter(|(_, s)| idle(s)).map(|(&s, _)| s).collect();
            tracing::debug!(
                spans = idle_now.len(),
                "vrdma: the VM's region is full; deregistered pages move back"
            );
            for s in idle_now {
                unkeep(reg, kept, s);
            }
            (src.alloc)(span_len as u64)?
        }
        r => r?,
    };
    let release = (src.release)(offset);
    let made = (|| {
        // A child forked from now on copies the BAR's shared mappings
        // (the fork waits for the registry lock this holds).
        let st = rustix::fs::fstat(src.bar)?;
        super::fork::note_guest_bar(st.st_dev, st.st_ino);
        let bar = fds::span_fd(src.bar)?;
        map_extent_over(src.bar, offset, pstart, span_len)?;
        let fd = fds::span_fd(src.bar.as_fd())?;
        let ino = rustix::fs::fstat(&fd)?.st_ino;
        // Unreadable maps (never seen) leave the span unrecognised later,
        // not the extent given back under mapped pages.
        let maps_offset = maps_offset_at(pstart).unwrap_or_else(|e| {
            tracing::warn!(pstart, "vrdma: cannot read the re-backed span's mapping: {e}");
            offset
        });
        Ok((fd, bar, ino, maps_offset))
    })();
    let (fd, bar, ino, maps_offset) = match made {
        Ok(x) => x,
        Err(e) => {
            release();
            return Err(e);
        }
    };
    let extent = Arc::new(GuestExtent {
        start: pstart,
        offset,
        bar,
        pid: std::process::id(),
        ino,
        maps_offset,
        pieces: Mutex::new(vec![(pstart, span_len)]),
        release: Mutex::new(Some(release)),
    });
    let guest = GuestSpan { offset, maps_offset, owner: src.owner, extent };
    let span = Arc::new(Span { start: pstart, len: span_len, fd, ino, growable: false, guest: Some(guest) });
    reg.insert(pstart, vec![Arc::downgrade(&span)]);
    kept.insert(pstart, span.clone());
    Ok(span)
}

/// [`reback_guest`] of `range` (page bounds `pages`) over the live spans
/// `live` (sorted, in the VM's region, not all holding it), under the
/// registry lock: the parent module's `pieces`, except that the pages
/// between spans become spans of their own (a new extent each: an extent
/// grows only into free bytes after it, which a fresh one need not find),
/// and there is no descriptor to count (the daemon bounds the pieces,
/// `proto::MAX_MR_PIECES`).
fn reback_guest_pieces(
    reg: &mut Spans,
    kept: &mut BTreeMap<usize, Arc<Span>>,
    maps: &[MapEntry],
    live: &[Arc<Span>],
    (start, end): (usize, usize),
    (pstart, pend): (usize, usize),
    src: &GuestSource<'_>,
) -> Result<Rebacked> {
    if let Some(s) = live.iter().find(|s| s.guest.as_ref().is_none_or(|g| g.owner != src.owner)) {
        return Err(Error::invalid(format!(
            "[{start:#x}, {end:#x}) covers pages [{:#x}, {:#x}) registered through another context; \
             in a guest, pages are shared between registrations of one context only",
            s.start,
            s.end()
        )));
    }
    // The parts: each span's, and the gaps around them. A span's part
    // reaches over the pages a larger generation (gone now) grew it over,
    // where they are still mapped from its extent.
    let mut parts: Vec<(usize, usize, Option<&Arc<Span>>)> = Vec::new();
    let mut at = pstart;
    for (i, s) in live.iter().enumerate() {
        if at < s.start {
            parts.push((at, s.start, None));
        }
        let g = s.guest.as_ref().expect("checked above");
        let limit = live.get(i + 1).map_or(pend, |next| next.start.min(pend));
        let r = reach(s).min(limit);
        let whole = r > s.end() && in_bar(maps, s.end(), r, g.extent.ino, g.extent.maps_offset_of(s.end()));
        let to = if whole { r } else { s.end().min(pend) };
        parts.push((at.max(s.start), to, Some(s)));
        at = to;
    }
    if at < pend {
        parts.push((at, pend, None));
    }
    if parts.len() > vrdma_core::proto::MAX_MR_PIECES {
        return Err(Error::invalid(format!(
            "[{start:#x}, {end:#x}) covers {} registered spans and the pages between them: \
             a region is made of at most {} pieces",
            live.len(),
            vrdma_core::proto::MAX_MR_PIECES
        )));
    }
    for &(from, to, s) in &parts {
        if s.is_none() {
            check_rebackable(maps, from, to)?;
        }
    }
    let mut pieces = Vec::with_capacity(parts.len());
    for (from, to, s) in parts {
        let span = match s {
            Some(s) => s.clone(),
            None => new_span(reg, kept, maps, from, to, src)?,
        };
        let offset = span.guest.as_ref().expect("a guest span").offset;
        pieces.push(Piece { fd_offset: offset + (from - span.start) as u64, len: to - from, span });
    }
    let first = pieces.first_mut().expect("at least one span");
    first.fd_offset += (start - pstart) as u64;
    first.len -= start - pstart;
    pieces.last_mut().expect("at least one span").len -= pend - end;
    let first = &pieces[0];
    Ok(Rebacked { span: first.span.clone(), fd_offset: first.fd_offset, pieces })
}

/// How far a span's pages are mapped from its extent: past the span's
/// end where a larger generation, gone now, grew it (its pages stay
/// mapped from the extent, which the span holds, and a registration on
/// them takes them back as a growth).
pub(super) fn reach(span: &Span) -> usize {
    span.guest.as_ref().map_or(span.end(), |g| {
        let pieces = g.extent.pieces.lock().unwrap_or_else(|p| p.into_inner());
        GuestExtent::mapped_end(&pieces, g.extent.start).max(span.end())
    })
}

/// Extends the guest span `span` over the pages from its end to `pend`
/// for the registration `range` (see the module's doc): the extent grows
/// in place where no generation grew it that far already, the pages'
/// bytes go into the extension and the BAR is mapped there over them.
/// Returns the new generation; the caller holds the registry lock.
fn grow(
    maps: &[MapEntry],
    span: &Arc<Span>,
    range: (usize, usize),
    pend: usize,
    src: &GuestSource<'_>,
) -> Result<Arc<Span>> {
    let g = span.guest.as_ref().ok_or_else(|| Error::invalid("not a guest span"))?;
    let ext = &g.extent;
    let mut pieces = ext.pieces.lock().unwrap_or_else(|p| p.into_inner());
    let mapped_end = GuestExtent::mapped_end(&pieces, ext.start);
    // Pages a larger generation (gone now) mapped from the extension must
    // still be so: the new region lies on them.
    let kept_end = mapped_end.min(pend);
    if span.end() < kept_end && !in_bar(maps, span.end(), kept_end, ext.ino, ext.maps_offset_of(span.end())) {
        return Err(Error::invalid(format!(
            "[{:#x}, {:#x}) were re-backed by the VM's region and have been remapped by the application",
            span.end(),
            kept_end
        )));
    }
    if pend > mapped_end {
        check_rebackable(maps, mapped_end, pend)?;
        let new_len = (pend - ext.start) as u64;
        (src.grow)(g.offset, new_len).map_err(|e| match e {
            Error::Daemon { errno, message } => Error::Daemon {
                errno,
                message: format!(
                    "[{:#x}, {:#x}) begins in the registered pages [{:#x}, {:#x}) and ends past them, \
                     and their extent of the VM's region cannot grow: {message}",
                    range.0,
                    range.1,
                    span.start,
                    span.end()
                ),
            },
            e => e,
        })?;
        let at = g.offset + (mapped_end - ext.start) as u64;
        map_extent_over(src.bar, at, mapped_end, pend - mapped_end)?;
        pieces.push((mapped_end, pend - mapped_end));
    }
    let fd = fds::span_fd(span.fd())?;
    let guest =
        GuestSpan { offset: g.offset, maps_offset: g.maps_offset, owner: g.owner, extent: ext.clone() };
    Ok(Arc::new(Span {
        start: span.start,
        len: pend - span.start,
        fd,
        ino: span.ino,
        growable: false,
        guest: Some(guest),
    }))
}

/// Copies the `len` bytes of the pages at `addr` (private anonymous, the
/// caller checked) into the BAR at `offset` and maps the BAR there over
/// them.
fn map_extent_over(bar: BorrowedFd<'_>, offset: u64, addr: usize, len: usize) -> Result<()> {
    let temp = Segment::map_trusted_at(bar.try_clone_to_owned()?, offset, len)?;
    let fence = fence::WriteFence::raise(addr, len);
    // SAFETY: `[addr, addr + len)` is mapped readable (checked against
    // /proc/self/maps under the registry lock; the caller owns it) and
    // `temp` is a separate mapping of `len` bytes.
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, temp.as_ptr(), len) };
    // SAFETY: as in `reback`: the pages are the caller's private
    // anonymous memory (checked by the caller) and the BAR at `offset`
    // holds their bytes now, so every pointer into them stays valid and
    // sees the same contents.
    let mapped = unsafe {
        rustix::mm::mmap(
            addr as *mut std::ffi::c_void,
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED | MapFlags::FIXED,
            bar,
            offset,
        )
    };
    drop(fence);
    let mapped = mapped.map_err(|e| {
        Error::Io(std::io::Error::new(
            std::io::Error::from(e).kind(),
            format!("cannot re-back [{addr:#x}, {:#x}) with the VM's region: {e}", addr + len),
        ))
    })?;
    if mapped as usize != addr {
        return Err(Error::Io(std::io::Error::other("MAP_FIXED mapping landed at a different address")));
    }
    Ok(())
}

impl Drop for GuestExtent {
    fn drop(&mut self) {
        if self.pid != std::process::id() {
            return;
        }
        // What is still mapped of the pages goes back to private memory
        // with its bytes (the application may have unmapped some): the
        // extent may be anyone's in the VM once given back. Where that
        // fails the extent is kept.
        let pieces = std::mem::take(self.pieces.get_mut().unwrap_or_else(|p| p.into_inner()));
        let moved = self.move_back(&pieces);
        let release = self.release.get_mut().unwrap_or_else(|p| p.into_inner()).take();
        match release {
            Some(release) if moved => release(),
            Some(_) => tracing::warn!(
                start = self.start,
                "vrdma: guest pages could not move back to private memory; their extent stays taken"
            ),
            None => {}
        }
    }
}

/// The parts of `[start, end)` mapped rw and shared from the file with
/// inode `ino`, at the offsets maps shows `base + (addr - start)` for (as
/// [`in_bar`], but what of the range is still so).
fn bar_pages(maps: &[MapEntry], start: usize, end: usize, ino: u64, base: u64) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for e in maps.iter().filter(|e| e.start < end && start < e.end) {
        let (at, to) = (e.start.max(start), e.end.min(end));
        let ours = e.readable_writable()
            && !e.private()
            && e.inode == ino
            && e.offset + (at - e.start) as u64 == base + (at - start) as u64;
        if !ours {
            continue;
        }
        match out.last_mut() {
            Some((s, n)) if *s + *n == at => *n += to - at,
            _ => out.push((at, to - at)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::parse_maps;
    use super::*;
    use vrdma_core::extents::Extents;

    /// `n` fresh private anonymous pages, filled with a pattern.
    fn pages(n: usize) -> *mut u8 {
        let len = n * vrdma_shm::page_size();
        // SAFETY: a fresh private anonymous mapping at an address the
        // kernel chooses.
        let p = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
        }
        .unwrap()
        .cast::<u8>();
        for i in 0..len {
            // SAFETY: inside the mapping.
            unsafe { p.add(i).write((i % 251) as u8) };
        }
        p
    }

    /// The byte at `offset` of the file `fd`.
    fn byte_at(fd: BorrowedFd<'_>, offset: u64) -> u8 {
        let mut b = [0u8];
        assert_eq!(rustix::io::pread(fd, &mut b, offset).unwrap(), 1);
        b[0]
    }

    /// A span grows in place in its extent of a stand-in BAR (a memfd,
    /// with the daemon's allocator and headroom), its generations share
    /// the extent, a registration on pages a gone generation grew over
    /// takes them back, the extent goes back once after the last, and a
    /// growth the region cannot hold is refused clearly.
    #[test]
    fn a_span_grows_in_its_extent_and_the_extent_goes_back_after_the_last_generation() {
        let page = vrdma_shm::page_size();
        let bar = rustix::fs::memfd_create("vrdma-test-bar", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&bar, 64 * page as u64).unwrap();
        let ino = rustix::fs::fstat(&bar).unwrap().st_ino;
        let ext = Mutex::new(Extents::new(64 * page as u64, page as u64));
        let released = Arc::new(Mutex::new(Vec::new()));
        let alloc =
            |len: u64| ext.lock().unwrap().alloc_with_headroom(len, 16 * page as u64).ok_or(Error::QueueFull);
        let grow = |offset: u64, len: u64| {
            ext.lock()
                .unwrap()
                .grow(offset, len)
                .map_err(|e| Error::Daemon { errno: libc::ENOMEM, message: format!("cannot grow: {e}") })
        };
        let release = |offset: u64| -> Box<dyn FnOnce() + Send> {
            let r = released.clone();
            Box::new(move || r.lock().unwrap().push(offset))
        };
        let src = GuestSource { owner: 1, bar: bar.as_fd(), alloc: &alloc, release: &release, grow: &grow };
        let p = pages(4);
        let base = p as usize;
        // SAFETY: pages of this test, written by no other thread.
        let a = unsafe { reback_guest(p.add(100), 100, &src) }.unwrap();
        let o = a.fd_offset - 100;
        // A thread's stand-in rings land after a's headroom.
        let (ring, _) = ext.lock().unwrap().alloc(page as u64).unwrap();
        assert_eq!(ring, o + 17 * page as u64);
        // Another context's registration may not grow it.
        let other = GuestSource { owner: 2, ..src };
        // SAFETY: as above; refused before anything is remapped.
        let e = unsafe { reback_guest(p.add(3000), 6000, &other) }.unwrap_err();
        assert!(e.to_string().contains("another context"), "{e}");
        // SAFETY: as above.
        let b = unsafe { reback_guest(p.add(3000), 6000, &src) }.unwrap();
        assert_eq!(b.fd_offset, o + 3000);
        assert_eq!((b.span.start, b.span.end()), (base, base + 3 * page));
        assert!(Arc::ptr_eq(&a.span.guest.as_ref().unwrap().extent, &b.span.guest.as_ref().unwrap().extent));
        assert_eq!(ext.lock().unwrap().containing(o, 3 * page as u64), Some((o, 3 * page as u64)));
        assert!(still_in_bar(base, base + 3 * page, ino, o));
        assert_eq!(byte_at(bar.as_fd(), o + 2 * page as u64 + 5), ((2 * page + 5) % 251) as u8, "copied");
        // SAFETY: inside the pages.
        unsafe { p.add(2 * page + 10).write(0x42) };
        assert_eq!(byte_at(bar.as_fd(), o + 2 * page as u64 + 10), 0x42, "shared");
        // The larger generation goes; its pages stay in the extent, which
        // the first holds, and a registration there takes them back.
        drop(b);
        assert!(still_in_bar(base, base + 3 * page, ino, o));
        // SAFETY: as above.
        let c = unsafe { reback_guest(p.add(page + 8), 16, &src) }.unwrap();
        assert_eq!(c.fd_offset, o + page as u64 + 8);
        assert!(released.lock().unwrap().is_empty());
        drop(a);
        drop(c);
        // Kept after the last region: still in the extent, not given back,
        // and a registration there reuses it.
        assert!(released.lock().unwrap().is_empty(), "given back with the pages still mapped");
        assert!(still_in_bar(base, base + 3 * page, ino, o));
        // SAFETY: as above.
        let again = unsafe { reback_guest(p.add(page + 8), 16, &src) }.unwrap();
        assert_eq!(again.fd_offset, o + page as u64 + 8, "the kept span reused");
        drop(again);
        // Another context's registration there moves the pages back and
        // takes a new extent; their bytes go with them.
        // SAFETY: as above.
        let theirs = unsafe { reback_guest(p.add(100), 100, &other) }.unwrap();
        assert_eq!(*released.lock().unwrap(), vec![o], "given back once");
        assert_ne!(theirs.fd_offset - 100, o);
        assert!(!still_in_bar(base + 2 * page, base + 3 * page, ino, o + 2 * page as u64), "moved back");
        // SAFETY: inside the pages.
        unsafe {
            assert_eq!(p.add(2 * page + 10).read(), 0x42);
            assert_eq!(p.add(3 * page + 1).read(), ((3 * page + 1) % 251) as u8);
        }
        assert_eq!(byte_at(bar.as_fd(), theirs.fd_offset - 100 + 10), 10, "copied into the new extent");
        let o2 = theirs.fd_offset - 100;
        drop(theirs);
        // That context closes: its kept pages move back, with their bytes.
        context_closing(2);
        assert_eq!(*released.lock().unwrap(), vec![o, o2]);
        assert!(!still_in_bar(base, base + page, ino, o2), "moved back as the context closed");
        // SAFETY: inside the pages.
        assert_eq!(unsafe { p.add(10).read() }, 10);

        // Kept pages the application unmapped: their extent goes back at
        // the next registration, with nothing to move.
        let r = pages(1);
        // SAFETY: as above.
        let gone = unsafe { reback_guest(r.add(8), 8, &src) }.unwrap();
        let o3 = gone.fd_offset - 8;
        drop(gone);
        // SAFETY: the test's own mapping; its region is gone.
        unsafe { rustix::mm::munmap(r.cast(), page).unwrap() };
        assert_eq!(released.lock().unwrap().len(), 2);
        // SAFETY: as above.
        let next = unsafe { reback_guest(p.add(page + 8), 16, &src) }.unwrap();
        assert_eq!(*released.lock().unwrap(), vec![o, o2, o3], "the unmapped span's extent");
        drop(next);

        // More than a quarter of the region kept: the next registration
        // moves it back.
        let big = pages(20);
        // SAFETY: as above.
        let whole = unsafe { reback_guest(big, 20 * page, &src) }.unwrap();
        let o4 = whole.fd_offset;
        drop(whole);
        assert!(still_in_bar(big as usize, big as usize + 20 * page, ino, o4), "kept");
        // SAFETY: as above.
        let next = unsafe { reback_guest(p.add(page + 8), 16, &src) }.unwrap();
        assert_eq!(released.lock().unwrap().last(), Some(&o4), "trimmed");
        assert!(!still_in_bar(big as usize, big as usize + page, ino, o4));
        drop(next);
        // SAFETY: the test's own mapping, no longer registered.
        unsafe { rustix::mm::munmap(big.cast(), 20 * page).unwrap() };

        // No room after the extent: refused, nothing remapped.
        let q = pages(3);
        // SAFETY: as above.
        let d = unsafe { reback_guest(q.add(16), 16, &src) }.unwrap();
        while ext.lock().unwrap().alloc(page as u64).is_some() {}
        // SAFETY: as above; refused before anything is remapped.
        let e = unsafe { reback_guest(q.add(32), 2 * page, &src) }.unwrap_err();
        assert_eq!(e.errno(), libc::ENOMEM);
        assert!(e.to_string().contains("cannot grow: only 0 bytes after it are free"), "{e}");
        assert!(!still_in_bar(q as usize + page, q as usize + 2 * page, ino, d.fd_offset - 16 + page as u64));
        drop(d);
        context_closing(1);
        assert_eq!(released.lock().unwrap().len(), 6, "p's and q's kept extents");
        for m in [p, q] {
            // SAFETY: the test's own mappings, no longer registered.
            unsafe { rustix::mm::munmap(m.cast(), if m == p { 4 * page } else { 3 * page }).unwrap() };
        }
    }

    /// A range beginning before a span that grew, and ending past it: the
    /// span's part covers its grown pages (the kept generation), and new
    /// extents hold the pages before and after; every page keeps its
    /// bytes.
    #[test]
    fn pieces_take_a_spans_grown_pages_and_new_extents_around_it() {
        let page = vrdma_shm::page_size();
        let bar = rustix::fs::memfd_create("vrdma-test-bar", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&bar, 64 * page as u64).unwrap();
        let ext = Mutex::new(Extents::new(64 * page as u64, page as u64));
        let alloc =
            |len: u64| ext.lock().unwrap().alloc_with_headroom(len, 4 * page as u64).ok_or(Error::QueueFull);
        let grow = |offset: u64, len: u64| {
            ext.lock()
                .unwrap()
                .grow(offset, len)
                .map_err(|e| Error::Daemon { errno: libc::ENOMEM, message: format!("cannot grow: {e}") })
        };
        let release = |_: u64| -> Box<dyn FnOnce() + Send> { Box::new(|| {}) };
        let src = GuestSource { owner: 7, bar: bar.as_fd(), alloc: &alloc, release: &release, grow: &grow };
        let p = pages(6);
        let base = p as usize;
        // SAFETY: pages of this test, written by no other thread.
        let a = unsafe { reback_guest(p.add(2 * page + 8), 8, &src) }.unwrap();
        // SAFETY: as above.
        let grown = unsafe { reback_guest(p.add(2 * page + 16), 2 * page, &src) }.unwrap();
        assert_eq!(grown.span.end(), base + 5 * page);
        drop(grown);
        // SAFETY: as above.
        let r = unsafe { reback_guest(p.add(page + 3), 5 * page - 6, &src) }.unwrap();
        let shape: Vec<(usize, usize)> = r.pieces.iter().map(|x| (x.span.start, x.len)).collect();
        assert_eq!(
            shape,
            vec![(base + page, page - 3), (base + 2 * page, 3 * page), (base + 5 * page, page - 3)]
        );
        let o = a.fd_offset - 8;
        assert_eq!(r.pieces[1].fd_offset, o, "the span's extent, grown pages and all");
        let extent = |s: &Span| s.guest.as_ref().unwrap().extent.clone();
        assert!(Arc::ptr_eq(&extent(&r.pieces[1].span), &extent(&a.span)));
        for (i, x) in r.pieces.iter().enumerate() {
            let first = if i == 0 { page + 3 } else { x.span.start - base };
            assert_eq!(byte_at(bar.as_fd(), x.fd_offset), (first % 251) as u8, "piece {i}'s first byte");
        }
        drop((r, a));
        context_closing(7);
        // SAFETY: inside the pages, private again.
        assert_eq!(unsafe { p.add(4 * page + 1).read() }, ((4 * page + 1) % 251) as u8);
        // SAFETY: the test's own mapping, no longer registered.
        unsafe { rustix::mm::munmap(p.cast(), 6 * page).unwrap() };
    }

    /// A real guest's maps show a sysfs BAR mapping at the BAR's bus
    /// address plus the extent's offset (here 0xfe000000 + 0x5000); the
    /// span is recognised by the offset maps showed when it was made.
    #[test]
    fn a_span_is_recognised_by_the_offset_maps_showed_at_its_making() {
        let maps = parse_maps(
            "7f0000100000-7f0000102000 rw-s fe005000 00:15 321                        /sys/devices/pci0000:00/0000:00:04.0/resource2\n\
             7f0000102000-7f0000103000 rw-p 00000000 00:00 0 \n",
        );
        let (s, e) = (0x7f00_0010_0000, 0x7f00_0010_2000);
        assert!(in_bar(&maps, s, e, 321, 0xfe00_5000));
        assert!(!in_bar(&maps, s, e, 321, 0x5000), "the extent's own offset is not what maps shows");
        assert!(!in_bar(&maps, s, e, 322, 0xfe00_5000), "another file");
        // A span in the second page of a merged mapping.
        assert!(in_bar(&maps, s + 0x1000, e, 321, 0xfe00_6000));
        assert!(!in_bar(&maps, s + 0x1000, e, 321, 0xfe00_5000));
        // Pages past the BAR's mapping are private: not the span's.
        assert!(!in_bar(&maps, s, e + 0x1000, 321, 0xfe00_5000));
    }
}
