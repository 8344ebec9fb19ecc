//! One contiguous view of several pieces of (possibly several) files.
//!
//! A memory region is one range of the tenant's addresses, but its pages
//! may come from several files: a registration that covers pages
//! registered before (each span its own memfd, or its own extent of a
//! VM's region) and new pages between them. The daemon's copy engine
//! needs the region as one contiguous piece of its own address space, so
//! it reserves the whole range inaccessible and maps each piece over its
//! part of the reservation. Every piece is checked as a lone mapping of
//! an untrusted file is ([`Mapping::map_untrusted_in`]) and counts as one
//! mapping against the owner's budget and the process's limit: the
//! kernel keeps one mapping (VMA) per piece.

use std::io;
use std::os::fd::BorrowedFd;
use std::ptr::NonNull;
use std::sync::Arc;

use rustix::mm::{MapFlags, ProtFlags};

use super::{charge, check_untrusted, page_size, round_to_page, uncharge, MappingBudget, SegmentError};

/// One piece: `len` bytes of `fd` from `offset` (page-aligned).
#[derive(Debug, Clone, Copy)]
pub struct Piece<'a> {
    pub fd: BorrowedFd<'a>,
    pub offset: u64,
    pub len: usize,
}

/// Pieces of files mapped `MAP_SHARED`, read-write, one after the other
/// into one range (see the module's doc), without their descriptors.
pub struct PiecedMapping {
    ptr: NonNull<u8>,
    /// Bytes the caller may use, starting at `ptr`.
    len: usize,
    /// Bytes reserved (`len` rounded up to a page), for `munmap`.
    map_len: usize,
    /// Mappings charged (one per piece).
    pieces: usize,
    budget: Option<Arc<MappingBudget>>,
}

impl std::fmt::Debug for PiecedMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PiecedMapping")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("pieces", &self.pieces)
            .finish()
    }
}

impl PiecedMapping {
    /// Maps `pieces` of files received from a peer that may be hostile,
    /// one after the other. Each file must be a memfd sealed against
    /// shrinking (not hugetlbfs) holding its piece; each piece's offset
    /// must be page-aligned, and every piece but the last whole pages
    /// long. Charged one mapping per piece to `budget` (when given) and to
    /// the process's limit, refused with [`io::ErrorKind::OutOfMemory`]
    /// past either. The mappings hold the files; the caller's descriptors
    /// may close.
    pub fn map_untrusted_in(
        pieces: &[Piece<'_>],
        budget: Option<&Arc<MappingBudget>>,
    ) -> Result<PiecedMapping, SegmentError> {
        let page = page_size();
        let n = pieces.len();
        if n == 0 {
            return Err(SegmentError::Empty);
        }
        let mut len = 0usize;
        for (i, p) in pieces.iter().enumerate() {
            if i + 1 < n && !p.len.is_multiple_of(page) {
                return Err(SegmentError::Io(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("piece {i} of {n} is {} bytes, not whole pages", p.len),
                )));
            }
            check_untrusted(p.fd, p.offset, p.len)?;
            len = len.checked_add(p.len).ok_or_else(overflow)?;
        }
        let map_len = round_to_page(len).ok_or_else(overflow)?;
        charge(n, budget)?;
        match Self::map(pieces, map_len) {
            Ok(ptr) => Ok(PiecedMapping { ptr, len, map_len, pieces: n, budget: budget.cloned() }),
            Err(e) => {
                uncharge(n, budget);
                Err(e.into())
            }
        }
    }

    /// Reserves `map_len` bytes and maps the pieces over them.
    fn map(pieces: &[Piece<'_>], map_len: usize) -> io::Result<NonNull<u8>> {
        // SAFETY: a fresh, inaccessible anonymous reservation at an address
        // the kernel picks (no MAP_FIXED): it replaces or aliases nothing.
        let base = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                map_len,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::NORESERVE,
            )?
        };
        let unreserve = || {
            // SAFETY: the reservation made above, which nothing else uses
            // (its address was never handed out).
            let _ = unsafe { rustix::mm::munmap(base, map_len) };
        };
        let mut at = 0usize;
        for p in pieces {
            let plen = round_to_page(p.len).unwrap_or(usize::MAX).min(map_len - at);
            // SAFETY: `[base + at, base + at + plen)` lies inside the
            // reservation made above (the pieces' rounded lengths sum to
            // `map_len`), which this function owns; MAP_FIXED replaces only
            // that part of it. The file was checked to hold the piece and
            // to be sealed against shrinking.
            let mapped = unsafe {
                rustix::mm::mmap(
                    base.cast::<u8>().add(at).cast(),
                    plen,
                    ProtFlags::READ | ProtFlags::WRITE,
                    MapFlags::SHARED | MapFlags::FIXED,
                    p.fd,
                    p.offset,
                )
            };
            match mapped {
                // SAFETY: pointer arithmetic inside the reservation, as above.
                Ok(m) if m == unsafe { base.cast::<u8>().add(at) }.cast() => {}
                Ok(_) => {
                    unreserve();
                    return Err(io::Error::other("MAP_FIXED mapping landed at a different address"));
                }
                Err(e) => {
                    unreserve();
                    return Err(e.into());
                }
            }
            at += plen;
        }
        NonNull::new(base.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned a null mapping"))
    }

    /// Start of the mapping (page-aligned). As for [`Mapping`](super::Mapping):
    /// read and write it with raw copies or atomics, never references.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Usable bytes from [`as_ptr`](PiecedMapping::as_ptr).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a mapping has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How many pieces (kernel mappings) it holds.
    pub fn pieces(&self) -> usize {
        self.pieces
    }
}

fn overflow() -> SegmentError {
    SegmentError::Io(io::Error::new(io::ErrorKind::InvalidInput, "pieces' lengths overflow"))
}

impl Drop for PiecedMapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`map_len` are exactly the reservation made in
        // `map` (its pieces replaced parts of it), unmapped only here;
        // every borrower of the memory holds the mapping alive.
        if let Err(e) = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.map_len) } {
            tracing::warn!(error = %e, "munmap of a pieced mapping failed");
        }
        uncharge(self.pieces, self.budget.as_ref());
    }
}

// SAFETY: as for `Mapping`: it owns its mapping outright; the pointer is
// an address of process-wide memory valid from any thread until Drop.
unsafe impl Send for PiecedMapping {}
// SAFETY: `&PiecedMapping` exposes only the address and lengths.
unsafe impl Sync for PiecedMapping {}

// SAFETY: `as_ptr()..as_ptr()+len()` lies inside the reservation, every
// page of which a piece mapped read-write and shared (the pieces' lengths
// sum to `len`, each rounded up only where it is the last), never moved
// or remapped and unmapped only in Drop. No file can shrink under it:
// each was refused unless sealed against shrinking.
unsafe impl vrdma_core::memory::Backing for PiecedMapping {
    fn as_ptr(&self) -> *mut u8 {
        PiecedMapping::as_ptr(self)
    }
    fn len(&self) -> usize {
        PiecedMapping::len(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Segment;
    use std::os::fd::AsFd;

    fn sealed(len: usize, fill: u8) -> Segment {
        let s = Segment::create("vrdma-pieced-test", len).unwrap();
        // SAFETY: the segment's own fresh mapping.
        unsafe { std::ptr::write_bytes(s.as_ptr(), fill, s.len()) };
        s
    }

    #[test]
    fn pieces_of_two_files_read_as_one_range_and_share_their_pages() {
        let page = page_size();
        let (a, b) = (sealed(3 * page, 0xa1), sealed(2 * page, 0xb2));
        let budget = MappingBudget::new(8);
        let m = PiecedMapping::map_untrusted_in(
            &[
                Piece { fd: a.fd(), offset: page as u64, len: 2 * page },
                Piece { fd: b.fd(), offset: 0, len: page + 10 },
            ],
            Some(&budget),
        )
        .unwrap();
        assert_eq!((m.len(), m.pieces(), budget.live()), (3 * page + 10, 2, 2));
        // SAFETY: inside the mappings.
        unsafe {
            assert_eq!(m.as_ptr().add(2 * page - 1).read_volatile(), 0xa1);
            assert_eq!(m.as_ptr().add(2 * page).read_volatile(), 0xb2);
            m.as_ptr().add(5).write_volatile(0x11);
            m.as_ptr().add(2 * page + 7).write_volatile(0x22);
            assert_eq!(a.as_ptr().add(page + 5).read_volatile(), 0x11);
            assert_eq!(b.as_ptr().add(7).read_volatile(), 0x22);
        }
        drop(m);
        assert_eq!(budget.live(), 0);
    }

    #[test]
    fn bad_pieces_are_refused_and_charge_nothing() {
        let page = page_size();
        let a = sealed(2 * page, 1);
        let budget = MappingBudget::new(1);
        let piece = |offset: u64, len: usize| Piece { fd: a.fd(), offset, len };
        let map = |p: Vec<Piece<'_>>| PiecedMapping::map_untrusted_in(&p, Some(&budget)).unwrap_err();
        assert!(matches!(map(vec![]), SegmentError::Empty));
        assert!(matches!(map(vec![piece(0, 0)]), SegmentError::Empty));
        assert!(matches!(map(vec![piece(1, 10)]), SegmentError::Unaligned { .. }));
        assert!(map(vec![piece(0, 10), piece(0, 10)]).to_string().contains("not whole pages"));
        assert!(matches!(map(vec![piece(page as u64, 2 * page)]), SegmentError::TooSmall { .. }));
        // Past the budget: one mapping a piece.
        let e = map(vec![piece(0, page), piece(0, page)]);
        assert!(matches!(&e, SegmentError::Io(e) if e.kind() == io::ErrorKind::OutOfMemory), "{e}");
        assert_eq!(budget.live(), 0);
        // An unsealed file.
        let fd = rustix::fs::memfd_create("vrdma-unsealed", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, page as u64).unwrap();
        assert!(matches!(
            map(vec![Piece { fd: fd.as_fd(), offset: 0, len: page }]),
            SegmentError::NotMemfd(_) | SegmentError::NotSealed
        ));
    }
}
