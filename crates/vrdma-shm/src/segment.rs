//! Shared-memory segments: `memfd` files mapped `MAP_SHARED`.
//!
//! A segment is the unit of memory the daemon and a tenant share: the
//! queues' rings live in segments the daemon creates, and a tenant's
//! registered memory arrives as a segment it created itself. Either way
//! the file descriptor travels over the control socket and each side maps
//! it.
//!
//! Mapping a file that someone else controls is dangerous: if the owner
//! truncates it, touching the now-missing pages raises `SIGBUS` in every
//! process that maps them. [`Mapping::map_untrusted`] therefore accepts
//! only files that carry `F_SEAL_SHRINK`, which the kernel enforces for
//! everybody, owner included, for the rest of the file's life.
//!
//! A [`Mapping`] keeps no descriptor: the mapping holds the file by
//! itself. The daemon maps every registered region that way, so a tenant
//! with thousands of regions costs the daemon no descriptors, which all
//! tenants share.
//!
//! Mappings are a budget every tenant shares: the kernel bounds a
//! process's mappings (`vm.max_map_count`), and the daemon bounds the ones
//! it makes for tenants below that ([`set_mapping_limit`]). So that no
//! tenant can spend the others' part, each mapping the daemon makes for a
//! tenant is also charged to that tenant's [`MappingBudget`] for as long
//! as the mapping lives (the charge goes with the [`Mapping`] and is given
//! back when it is unmapped, whoever holds it last), and refused once the
//! tenant holds its share.

use std::fmt;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

mod pieced;
pub use pieced::{Piece, PiecedMapping};

/// Why a file descriptor from a peer could not be mapped.
#[derive(Debug, thiserror::Error)]
pub enum SegmentError {
    /// The file is on hugetlbfs, which the daemon does not map for tenants.
    #[error("memory on hugetlbfs cannot be shared with the daemon; use ordinary shared memory")]
    HugeTlb,
    /// The descriptor does not support seals, so it is not a memfd (or
    /// other shmem/hugetlbfs file) and its size cannot be pinned.
    #[error("not a sealable memfd: {0}")]
    NotMemfd(#[source] io::Error),
    /// The file can still shrink: `F_SEAL_SHRINK` is missing.
    #[error("memfd lacks F_SEAL_SHRINK")]
    NotSealed,
    /// The file is not a regular file.
    #[error("not a regular file")]
    NotRegular,
    /// `[offset, offset+len)` does not lie within the file.
    #[error("file of {size} bytes is too small for [{offset}, +{len})")]
    TooSmall { size: u64, offset: u64, len: usize },
    /// The offset is not a multiple of the page size.
    #[error("offset {offset} is not page-aligned")]
    Unaligned { offset: u64 },
    /// A mapping of zero bytes was asked for.
    #[error("zero-length mapping")]
    Empty,
    /// A system call failed.
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl From<SegmentError> for io::Error {
    fn from(e: SegmentError) -> io::Error {
        match e {
            SegmentError::Io(e) => e,
            other => io::Error::new(io::ErrorKind::InvalidInput, other),
        }
    }
}

/// A live `MAP_SHARED`, read-write mapping of (part of) a memfd, without
/// its descriptor.
pub struct Mapping {
    ptr: NonNull<u8>,
    /// Bytes the caller may use, starting at `ptr`.
    len: usize,
    /// Bytes actually mapped (`len` rounded up to a page), for `munmap`.
    map_len: usize,
    /// The owner's budget this mapping is charged to, if any.
    budget: Option<Arc<MappingBudget>>,
}

/// One owner's share of the process's mappings (in the daemon: one
/// tenant's). A [`Mapping`] made with a budget counts against it from the
/// `mmap` to the `munmap`; a mapping past the limit is refused before it
/// is made.
#[derive(Debug)]
pub struct MappingBudget {
    live: AtomicUsize,
    limit: usize,
}

impl MappingBudget {
    /// A budget of at most `limit` live mappings.
    pub fn new(limit: usize) -> Arc<MappingBudget> {
        Arc::new(MappingBudget { live: AtomicUsize::new(0), limit })
    }

    /// Mappings charged to this budget now.
    pub fn live(&self) -> usize {
        self.live.load(Ordering::Acquire)
    }

    /// The most it may hold.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Takes one mapping from the budget, or says why not.
    fn take(&self) -> io::Result<()> {
        let taken = self
            .live
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < self.limit).then_some(n + 1));
        taken.map(|_| ()).map_err(|_| {
            io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!(
                    "this tenant holds its share of {} memory mappings in the daemon (max_mappings / max_tenants)",
                    self.limit
                ),
            )
        })
    }

    fn give_back(&self) {
        self.live.fetch_sub(1, Ordering::AcqRel);
    }
}

impl fmt::Debug for Mapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mapping").field("ptr", &self.ptr).field("len", &self.len).finish()
    }
}

/// A [`Mapping`] together with the descriptor it maps.
pub struct Segment {
    fd: OwnedFd,
    map: Mapping,
}

impl fmt::Debug for Segment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Segment")
            .field("fd", &self.fd)
            .field("ptr", &self.map.ptr)
            .field("len", &self.map.len)
            .finish()
    }
}

/// Mappings this process holds through [`Mapping`] (and so [`Segment`]).
static LIVE_MAPPINGS: AtomicUsize = AtomicUsize::new(0);
/// How many it may hold: unbounded unless [`set_mapping_limit`] says.
static MAPPING_LIMIT: AtomicUsize = AtomicUsize::new(usize::MAX);

/// Bounds the mappings this process makes through [`Mapping`]. The kernel
/// bounds a process's mappings (`vm.max_map_count`); a daemon that maps
/// every tenant's regions and rings must refuse the next one with a clear
/// error well before the kernel refuses its own allocations (a failed
/// `malloc` aborts a Rust program).
pub fn set_mapping_limit(limit: usize) {
    MAPPING_LIMIT.store(limit, Ordering::Relaxed);
}

/// Mappings this process holds through [`Mapping`] now.
pub fn live_mappings() -> usize {
    LIVE_MAPPINGS.load(Ordering::Relaxed)
}

/// The system page size.
pub fn page_size() -> usize {
    rustix::param::page_size()
}

/// `len` rounded up to a whole number of pages, if that fits in `usize`.
fn round_to_page(len: usize) -> Option<usize> {
    let page = page_size();
    len.checked_next_multiple_of(page)
}

impl Segment {
    /// A new anonymous segment of `len` bytes (rounded up to whole pages),
    /// zero-filled, sealed against shrinking, growing and further sealing,
    /// and mapped read-write.
    pub fn create(name: &str, len: usize) -> io::Result<Segment> {
        Segment::create_in(name, len, None)
    }

    /// [`create`](Segment::create), but sealed against shrinking only:
    /// its owner may grow it later (`ftruncate`), which changes nothing for
    /// a peer that mapped part of it (`F_SEAL_SHRINK` is all
    /// [`Mapping::map_untrusted`] relies on). Re-backed registered memory
    /// uses it to extend a span over the pages after it.
    pub fn create_growable(name: &str, len: usize) -> io::Result<Segment> {
        Segment::create_sealed(name, len, None, SealFlags::SHRINK)
    }

    /// [`create`](Segment::create), the mapping charged to `budget` (when
    /// given) for as long as it lives; refused if the budget is spent.
    pub fn create_in(name: &str, len: usize, budget: Option<&Arc<MappingBudget>>) -> io::Result<Segment> {
        Segment::create_sealed(name, len, budget, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
    }

    fn create_sealed(
        name: &str,
        len: usize,
        budget: Option<&Arc<MappingBudget>>,
        seals: SealFlags,
    ) -> io::Result<Segment> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "zero-length segment"));
        }
        let size = round_to_page(len)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "segment length overflows"))?;
        let base = MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING;
        // Ask for a non-executable memfd where the kernel knows the flag
        // (Linux 6.3+; required when `vm.memfd_noexec = 2`), plain otherwise.
        let fd = match rustix::fs::memfd_create(name, base | MemfdFlags::NOEXEC_SEAL) {
            Err(rustix::io::Errno::INVAL) => rustix::fs::memfd_create(name, base)?,
            other => other?,
        };
        rustix::fs::ftruncate(&fd, size as u64)?;
        rustix::fs::fcntl_add_seals(&fd, seals)?;
        let map = Mapping::map(&fd, 0, size, budget)?;
        Ok(Segment { fd, map })
    }

    /// Maps the first `len` bytes of a descriptor from a trusted source,
    /// such as a ring segment the daemon created (and sealed) for us.
    ///
    /// No seal is required, but the file must be at least `len` bytes.
    pub fn map_trusted(fd: OwnedFd, len: usize) -> Result<Segment, SegmentError> {
        if len == 0 {
            return Err(SegmentError::Empty);
        }
        check_size(&fd, 0, len)?;
        Ok(Segment::map(fd, 0, len)?)
    }

    /// [`map_trusted`](Segment::map_trusted) of `[offset, offset+len)`
    /// (`offset` page-aligned): a piece of a larger file, such as a guest's
    /// view of its VM's shared region (the ivshmem BAR).
    pub fn map_trusted_at(fd: OwnedFd, offset: u64, len: usize) -> Result<Segment, SegmentError> {
        if len == 0 {
            return Err(SegmentError::Empty);
        }
        if !offset.is_multiple_of(page_size() as u64) {
            return Err(SegmentError::Unaligned { offset });
        }
        check_size(&fd, offset, len)?;
        Ok(Segment::map(fd, offset, len)?)
    }

    fn map(fd: OwnedFd, offset: u64, len: usize) -> io::Result<Segment> {
        let map = Mapping::map(&fd, offset, len, None)?;
        Ok(Segment { fd, map })
    }

    /// The descriptor and the mapping apart: a daemon sends the descriptor
    /// to the tenant and keeps only the mapping, so that the tenant's
    /// queues cost it no descriptors.
    pub fn into_parts(self) -> (OwnedFd, Mapping) {
        (self.fd, self.map)
    }

    /// The mapped descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// A new descriptor for the same file, e.g. to send to a peer.
    pub fn try_clone_fd(&self) -> io::Result<OwnedFd> {
        self.fd.try_clone()
    }

    /// Start of the mapping (page-aligned).
    ///
    /// The memory may be written by another process at any time: read and
    /// write it with raw copies or atomics, never through references.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_ptr()
    }

    /// Usable bytes from [`as_ptr`](Segment::as_ptr). For
    /// [`create`](Segment::create) this is the size rounded up to pages.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Always false: a segment has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

impl Mapping {
    /// Maps `[offset, offset+len)` of a descriptor received from a peer
    /// that may be hostile.
    ///
    /// The file must be a memfd sealed with `F_SEAL_SHRINK` (so that it can
    /// never lose the pages we map), at least `offset + len` bytes long,
    /// and `offset` must be page-aligned. The descriptor is closed once
    /// mapped.
    pub fn map_untrusted(fd: OwnedFd, offset: u64, len: usize) -> Result<Mapping, SegmentError> {
        Mapping::map_untrusted_in(fd, offset, len, None)
    }

    /// [`map_untrusted`](Mapping::map_untrusted), the mapping charged to
    /// `budget` (when given) for as long as it lives; refused with
    /// [`io::ErrorKind::OutOfMemory`] if the budget is spent.
    pub fn map_untrusted_in(
        fd: OwnedFd,
        offset: u64,
        len: usize,
        budget: Option<&Arc<MappingBudget>>,
    ) -> Result<Mapping, SegmentError> {
        check_untrusted(fd.as_fd(), offset, len)?;
        // The descriptor closes here; the mapping keeps the file.
        Ok(Mapping::map(&fd, offset, len, budget)?)
    }

    /// `mmap(MAP_SHARED, RW)` of `[offset, offset+len)`, whole pages,
    /// charged to `budget` (if any) and to the process's limit.
    fn map(
        fd: &OwnedFd,
        offset: u64,
        len: usize,
        budget: Option<&Arc<MappingBudget>>,
    ) -> io::Result<Mapping> {
        let map_len = round_to_page(len)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "segment length overflows"))?;
        charge(1, budget)?;
        match Self::mmap(fd, offset, map_len) {
            Ok(ptr) => Ok(Mapping { ptr, len, map_len, budget: budget.cloned() }),
            Err(e) => {
                uncharge(1, budget);
                Err(e)
            }
        }
    }

    fn mmap(fd: &OwnedFd, offset: u64, map_len: usize) -> io::Result<NonNull<u8>> {
        // SAFETY: a fresh mapping at an address the kernel picks (null hint,
        // no MAP_FIXED) cannot replace or alias any existing Rust object.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                map_len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd,
                offset,
            )?
        };
        NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned a null mapping"))
    }

    /// Start of the mapping (page-aligned).
    ///
    /// The memory may be written by another process at any time: read and
    /// write it with raw copies or atomics, never through references.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Usable bytes from [`as_ptr`](Mapping::as_ptr).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a mapping has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The checks a file from a peer that may be hostile passes before
/// `[offset, offset + len)` of it is mapped: a memfd sealed against
/// shrinking, not hugetlbfs, the offset page-aligned, the bytes there.
fn check_untrusted(fd: BorrowedFd<'_>, offset: u64, len: usize) -> Result<(), SegmentError> {
    if len == 0 {
        return Err(SegmentError::Empty);
    }
    let seals = rustix::fs::fcntl_get_seals(fd).map_err(|e| SegmentError::NotMemfd(e.into()))?;
    if !seals.contains(SealFlags::SHRINK) {
        return Err(SegmentError::NotSealed);
    }
    // A hole punched into a hugetlbfs file frees its reservation; once
    // the huge pages are gone, touching the hole raises SIGBUS. No seal
    // prevents hole punching, so such files are refused outright.
    if is_hugetlbfs(fd)? {
        return Err(SegmentError::HugeTlb);
    }
    // The page size is a power of two.
    if offset & (page_size() as u64 - 1) != 0 {
        return Err(SegmentError::Unaligned { offset });
    }
    // The size is checked after the seal: from now on it cannot drop.
    check_size(fd, offset, len)
}

/// Charges `n` mappings to `budget` (when given) and to the process's
/// limit, or neither. The owner's share first: a tenant past its share
/// is told so, not that the daemon as a whole is full.
fn charge(n: usize, budget: Option<&Arc<MappingBudget>>) -> io::Result<()> {
    let mut taken = 0;
    if let Some(b) = budget {
        while taken < n {
            if let Err(e) = b.take() {
                (0..taken).for_each(|_| b.give_back());
                return Err(e);
            }
            taken += 1;
        }
    }
    let limit = MAPPING_LIMIT.load(Ordering::Relaxed);
    if LIVE_MAPPINGS.fetch_add(n, Ordering::Relaxed).saturating_add(n) > limit {
        LIVE_MAPPINGS.fetch_sub(n, Ordering::Relaxed);
        if let Some(b) = budget {
            (0..taken).for_each(|_| b.give_back());
        }
        return Err(io::Error::new(
            io::ErrorKind::OutOfMemory,
            format!("the daemon holds its limit of {limit} memory mappings (see vm.max_map_count)"),
        ));
    }
    Ok(())
}

/// Gives back what [`charge`] took for `n` mappings.
fn uncharge(n: usize, budget: Option<&Arc<MappingBudget>>) {
    LIVE_MAPPINGS.fetch_sub(n, Ordering::Relaxed);
    if let Some(b) = budget {
        (0..n).for_each(|_| b.give_back());
    }
}

/// Checks that the file behind `fd` covers `[offset, offset+len)`.
fn check_size(fd: impl AsFd, offset: u64, len: usize) -> Result<(), SegmentError> {
    let st = rustix::fs::fstat(fd).map_err(io::Error::from)?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
        return Err(SegmentError::NotRegular);
    }
    let size = u64::try_from(st.st_size).unwrap_or(0);
    let fits = u64::try_from(len).ok().and_then(|l| offset.checked_add(l)).is_some_and(|end| end <= size);
    if !fits {
        return Err(SegmentError::TooSmall { size, offset, len });
    }
    Ok(())
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`map_len` are exactly the mapping made in `map`,
        // unmapped only here; every borrower of the memory (rings, regions)
        // holds the segment alive, so nothing uses it after this point.
        if let Err(e) = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.map_len) } {
            tracing::warn!(error = %e, "munmap of a segment failed");
        }
        LIVE_MAPPINGS.fetch_sub(1, Ordering::Relaxed);
        if let Some(b) = &self.budget {
            b.give_back();
        }
    }
}

// SAFETY: a Mapping owns its mapping outright; the raw pointer is only an
// address of process-wide memory, valid from any thread until Drop, and
// the type itself offers no unsynchronised mutation (users reach the bytes
// through raw copies and atomics).
unsafe impl Send for Mapping {}
// SAFETY: `&Mapping` exposes only the address and length, both immutable;
// concurrent access to the mapped bytes is the users' business and already
// has to tolerate a concurrent writer in the other process.
unsafe impl Sync for Mapping {}

// SAFETY: `as_ptr()..as_ptr()+len()` lies inside a read-write MAP_SHARED
// mapping that is created in `map`, never moved or remapped, and unmapped
// only in Drop, so it stays live while the Mapping lives. The file cannot
// shrink underneath it: created segments are sealed by us, untrusted ones
// are refused unless F_SEAL_SHRINK is set, and trusted ones come from a
// daemon that seals them.
unsafe impl vrdma_core::memory::Backing for Mapping {
    fn as_ptr(&self) -> *mut u8 {
        Mapping::as_ptr(self)
    }
    fn len(&self) -> usize {
        Mapping::len(self)
    }
}

// SAFETY: a Segment's bytes are its Mapping's (above), which it owns.
unsafe impl vrdma_core::memory::Backing for Segment {
    fn as_ptr(&self) -> *mut u8 {
        Segment::as_ptr(self)
    }
    fn len(&self) -> usize {
        Segment::len(self)
    }
}

/// `HUGETLBFS_MAGIC` of `statfs(2)`.
const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;

fn is_hugetlbfs(fd: impl AsFd) -> Result<bool, SegmentError> {
    let st = rustix::fs::fstatfs(fd).map_err(|e| SegmentError::Io(e.into()))?;
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between targets
    Ok(st.f_type as i64 == HUGETLBFS_MAGIC)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hugetlbfs_files_are_refused() {
        use rustix::fs::{MemfdFlags, SealFlags};
        let fd = match rustix::fs::memfd_create(
            "vrdma-huge-test",
            MemfdFlags::HUGETLB | MemfdFlags::ALLOW_SEALING,
        ) {
            Ok(fd) => fd,
            Err(e) => {
                println!("skipping: this kernel makes no hugetlb memfd ({e})");
                return;
            }
        };
        if rustix::fs::ftruncate(&fd, 1 << 30).is_err() && rustix::fs::ftruncate(&fd, 2 << 20).is_err() {
            println!("skipping: cannot size a hugetlb memfd");
            return;
        }
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK).unwrap();
        assert!(matches!(Mapping::map_untrusted(fd, 0, 4096), Err(SegmentError::HugeTlb)));
    }
    use std::sync::atomic::{AtomicU64, Ordering};

    /// The bytes of a segment or a mapping.
    trait Bytes {
        fn as_ptr(&self) -> *mut u8;
        fn len(&self) -> usize;
    }
    impl Bytes for Segment {
        fn as_ptr(&self) -> *mut u8 {
            Segment::as_ptr(self)
        }
        fn len(&self) -> usize {
            Segment::len(self)
        }
    }
    impl Bytes for Mapping {
        fn as_ptr(&self) -> *mut u8 {
            Mapping::as_ptr(self)
        }
        fn len(&self) -> usize {
            Mapping::len(self)
        }
    }

    fn write_byte(seg: &dyn Bytes, at: usize, v: u8) {
        assert!(at < seg.len());
        // SAFETY: `at` is within the mapping (asserted).
        unsafe { seg.as_ptr().add(at).write_volatile(v) }
    }

    fn read_byte(seg: &dyn Bytes, at: usize) -> u8 {
        assert!(at < seg.len());
        // SAFETY: `at` is within the mapping (asserted).
        unsafe { seg.as_ptr().add(at).read_volatile() }
    }

    #[test]
    fn create_rounds_and_seals() {
        let seg = Segment::create("vrdma-test", 100).unwrap();
        assert_eq!(seg.len(), page_size());
        assert!(!seg.is_empty());
        let seals = rustix::fs::fcntl_get_seals(seg.fd()).unwrap();
        assert!(seals.contains(SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL));
        assert!(rustix::fs::ftruncate(seg.fd(), 0).is_err());
        assert_eq!(read_byte(&seg, 99), 0);
        assert!(Segment::create("vrdma-test", 0).is_err());
    }

    #[test]
    fn second_mapping_sees_writes() {
        let a = Segment::create("vrdma-test", 3 * page_size()).unwrap();
        let b = Mapping::map_untrusted(a.try_clone_fd().unwrap(), 0, a.len()).unwrap();
        let c = Segment::map_trusted(a.try_clone_fd().unwrap(), a.len()).unwrap();
        write_byte(&a, 5, 0xab);
        assert_eq!(read_byte(&b, 5), 0xab);
        assert_eq!(read_byte(&c, 5), 0xab);
        write_byte(&b, a.len() - 1, 7);
        assert_eq!(read_byte(&a, a.len() - 1), 7);

        // An offset mapping sees the right page.
        let p = page_size();
        let d = Mapping::map_untrusted(a.try_clone_fd().unwrap(), p as u64, 10).unwrap();
        write_byte(&a, p + 3, 42);
        assert_eq!(read_byte(&d, 3), 42);
        assert_eq!(d.len(), 10);
    }

    #[test]
    fn backing_region_round_trip() {
        use vrdma_core::memory::Region;
        let seg = std::sync::Arc::new(Segment::create("vrdma-test", 4096).unwrap());
        let peer = Segment::map_trusted(seg.try_clone_fd().unwrap(), 4096).unwrap();
        let region = Region::new(seg.clone(), 16, 64).unwrap();
        region.write(0, b"hello").unwrap();
        assert_eq!(read_byte(&peer, 16), b'h');
        assert_eq!(read_byte(&peer, 20), b'o');
    }

    #[test]
    fn atomics_cross_mappings() {
        let a = Segment::create("vrdma-test", 64).unwrap();
        let b = Segment::map_trusted(a.try_clone_fd().unwrap(), 64).unwrap();
        // SAFETY: both pointers are page-aligned, hence 8-aligned, and the
        // mappings are live for the duration of the references.
        let (wa, wb) = unsafe { (&*(a.as_ptr() as *const AtomicU64), &*(b.as_ptr() as *const AtomicU64)) };
        wa.store(0xdead_beef, Ordering::Release);
        assert_eq!(wb.load(Ordering::Acquire), 0xdead_beef);
    }

    fn unsealed_memfd(len: u64) -> OwnedFd {
        let fd = rustix::fs::memfd_create("vrdma-unsealed", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .unwrap();
        rustix::fs::ftruncate(&fd, len).unwrap();
        fd
    }

    #[test]
    fn untrusted_rejects_unsealed() {
        let fd = unsealed_memfd(4096);
        assert!(matches!(Mapping::map_untrusted(fd, 0, 4096), Err(SegmentError::NotSealed)));
        // Without ALLOW_SEALING the kernel sets F_SEAL_SEAL only.
        let fd = rustix::fs::memfd_create("vrdma-nosealing", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, 4096).unwrap();
        assert!(matches!(Mapping::map_untrusted(fd, 0, 4096), Err(SegmentError::NotSealed)));
    }

    #[test]
    fn untrusted_rejects_too_small() {
        let seg = Segment::create("vrdma-test", 4096).unwrap();
        let size = seg.len();
        let e = Mapping::map_untrusted(seg.try_clone_fd().unwrap(), 0, size + 1).unwrap_err();
        assert!(matches!(e, SegmentError::TooSmall { .. }), "{e}");
        let e = Mapping::map_untrusted(seg.try_clone_fd().unwrap(), page_size() as u64, 1).unwrap_err();
        assert!(matches!(e, SegmentError::TooSmall { .. }), "{e}");
        let e = Mapping::map_untrusted(seg.try_clone_fd().unwrap(), u64::MAX - 4095, usize::MAX).unwrap_err();
        assert!(matches!(e, SegmentError::TooSmall { .. } | SegmentError::Unaligned { .. }), "{e}");
        let e = Segment::map_trusted(seg.try_clone_fd().unwrap(), size + 1).unwrap_err();
        assert!(matches!(e, SegmentError::TooSmall { .. }), "{e}");
    }

    #[test]
    fn untrusted_rejects_unaligned_and_empty() {
        let seg = Segment::create("vrdma-test", 2 * page_size()).unwrap();
        let e = Mapping::map_untrusted(seg.try_clone_fd().unwrap(), 1, 16).unwrap_err();
        assert!(matches!(e, SegmentError::Unaligned { offset: 1 }), "{e}");
        let e = Mapping::map_untrusted(seg.try_clone_fd().unwrap(), 0, 0).unwrap_err();
        assert!(matches!(e, SegmentError::Empty), "{e}");
        let e = Segment::map_trusted(seg.try_clone_fd().unwrap(), 0).unwrap_err();
        assert!(matches!(e, SegmentError::Empty), "{e}");
    }

    /// A budget bounds the mappings charged to it, whichever way they are
    /// made, and gets each back when its mapping goes, even one that
    /// outlived the request that made it (a clone of a shared `Arc`).
    #[test]
    fn a_budget_bounds_its_mappings_until_they_are_unmapped() {
        let budget = MappingBudget::new(3);
        let other = MappingBudget::new(1);
        let a = Segment::create_in("vrdma-test", 4096, Some(&budget)).unwrap();
        let b = Mapping::map_untrusted_in(a.try_clone_fd().unwrap(), 0, 4096, Some(&budget)).unwrap();
        let c =
            Arc::new(Mapping::map_untrusted_in(a.try_clone_fd().unwrap(), 0, 4096, Some(&budget)).unwrap());
        assert_eq!(budget.live(), 3);
        let e = Mapping::map_untrusted_in(a.try_clone_fd().unwrap(), 0, 4096, Some(&budget)).unwrap_err();
        assert!(e.to_string().contains("share of 3 memory mappings"), "{e}");
        let e = Segment::create_in("vrdma-test", 4096, Some(&budget)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::OutOfMemory);
        assert_eq!(budget.live(), 3, "a refusal charges nothing");
        // Another owner's budget is its own, and unbudgeted mappings are
        // bounded only by the process's limit.
        let d = Segment::create_in("vrdma-test", 4096, Some(&other)).unwrap();
        let _free = Segment::create("vrdma-test", 4096).unwrap();
        assert_eq!((budget.live(), other.live()), (3, 1));
        drop(b);
        assert_eq!(budget.live(), 2);
        let held = c.clone();
        drop(c);
        assert_eq!(budget.live(), 2, "still mapped through another holder");
        drop(held);
        assert_eq!(budget.live(), 1);
        let again = Segment::create_in("vrdma-test", 4096, Some(&budget)).unwrap();
        assert_eq!(budget.live(), 2);
        drop((a, again, d));
        assert_eq!((budget.live(), other.live()), (0, 0));
    }

    #[test]
    fn untrusted_rejects_non_memfd() {
        let (r, w) = rustix::pipe::pipe().unwrap();
        assert!(matches!(Mapping::map_untrusted(r, 0, 4096), Err(SegmentError::NotMemfd(_))));
        // A pipe is not a regular file either, which map_trusted checks.
        assert!(matches!(Segment::map_trusted(w, 4096), Err(SegmentError::NotRegular)));
        let e: io::Error = SegmentError::NotSealed.into();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }
}
