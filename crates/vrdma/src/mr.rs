//! Memory regions.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use vrdma_core::proto::{MrPiece, Reply, Request};
use vrdma_core::ring::Sge;
use vrdma_core::verbs::AccessFlags;
use vrdma_shm::Segment;

use crate::control;
use crate::error::{Error, Result};
use crate::pd::ProtectionDomain;
use crate::rebacking::{self, Span};

/// Where a region's bytes live; held only to be dropped after the region
/// is deregistered.
#[derive(Debug)]
#[allow(dead_code)]
enum Backing {
    /// Memory the region allocated and frees.
    Owned(Segment),
    /// Application memory re-backed by a shared span.
    Rebacked(Arc<Span>),
    /// Application memory re-backed by several spans, one after the other
    /// (`rebacking::pieces`).
    Pieces(Vec<Arc<Span>>),
    /// In guest mode: memory the region allocated in an extent of the
    /// VM's region (the BAR), given back after deregistration.
    Guest { seg: Segment, offset: u64 },
}

/// A registered memory region (`ibv_mr`).
///
/// Its key serves as both `lkey` and `rkey`. The daemon may read and write
/// the bytes at any time while work requests or remote peers use them, so
/// the region offers bounds-checked copies ([`read`](Self::read),
/// [`write`](Self::write)) and 8-byte atomics instead of slices. Dropping
/// the region deregisters it (and frees the memory of
/// [`alloc_mr`](ProtectionDomain::alloc_mr)).
#[derive(Debug)]
pub struct MemoryRegion {
    pd: ProtectionDomain,
    key: u32,
    ptr: *mut u8,
    len: usize,
    access: AccessFlags,
    _backing: Backing,
}

// SAFETY: the region's pointer addresses a mapping that lives as long as
// the region (owned segment or an Arc'd span, or memory the caller of
// `register_raw` promised to keep), valid from any thread. All access to
// the bytes goes through raw copies and atomics, which may race only with
// the daemon's own raw copies, never with a Rust reference.
unsafe impl Send for MemoryRegion {}
// SAFETY: see `Send`; `&MemoryRegion` never hands out references into the
// memory, so concurrent use from several threads is no different from the
// daemon writing concurrently.
unsafe impl Sync for MemoryRegion {}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // Deregister first: the backing is unmapped (or released) only
        // after the daemon stopped using the key. Direct writes of this
        // process stop reading it first (the removal waits for them).
        self.pd.inner.local_keys.remove(self.key);
        let control = &self.pd.context().inner.control;
        control.destroy(Request::DeregMr { key: self.key });
        if let Backing::Guest { offset, .. } = self._backing {
            control.destroy(Request::GuestFree { offset });
        }
    }
}

impl MemoryRegion {
    pub(crate) fn alloc(pd: &ProtectionDomain, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        if len == 0 {
            return Err(Error::invalid("cannot allocate a zero-length memory region"));
        }
        check_access(access)?;
        if let Some(link) = pd.context().inner.control.guest_link() {
            return Self::alloc_in_guest(pd, link, len, access);
        }
        let seg = Segment::create("vrdma-mr", len)?;
        let ptr = seg.as_ptr();
        let key = reg_mr(pd, ptr, len, access, Some(seg.fd()), 0)?;
        pd.inner.local_keys.insert(key, ptr as u64, len as u64, access);
        Ok(MemoryRegion { pd: pd.clone(), key, ptr, len, access, _backing: Backing::Owned(seg) })
    }

    /// [`alloc`](Self::alloc) in guest mode: the memory is an extent of
    /// the VM's region the daemon allocates for this session, mapped from
    /// the BAR.
    fn alloc_in_guest(
        pd: &ProtectionDomain,
        link: &crate::guest::GuestLink,
        len: usize,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        let control = &pd.context().inner.control;
        let req = Request::GuestAlloc { len: len as u64 };
        let (offset, span) = match control.call(&req, &[])?.reply {
            Reply::GuestExtent { offset, len } => (offset, len),
            other => return Err(control::unexpected(&req, &other)),
        };
        let made = (|| {
            let span = control::to_usize(span, "extent length")?;
            if span < len {
                return Err(Error::protocol(format!("an extent of {span} bytes for {len}")));
            }
            let seg = Segment::map_trusted_at(link.bar()?, offset, span)?;
            // A reused extent holds its last owner's bytes; a new region
            // starts zeroed, as a fresh memfd does.
            // SAFETY: `seg` maps `seg.len()` writable bytes; the daemon
            // does not touch them before they are registered.
            unsafe { std::ptr::write_bytes(seg.as_ptr(), 0, seg.len()) };
            let ptr = seg.as_ptr();
            let key = reg_mr(pd, ptr, len, access, None, offset)?;
            Ok((seg, ptr, key))
        })();
        let (seg, ptr, key) = match made {
            Ok(m) => m,
            Err(e) => {
                control.destroy(Request::GuestFree { offset });
                return Err(e);
            }
        };
        pd.inner.local_keys.insert(key, ptr as u64, len as u64, access);
        Ok(MemoryRegion { pd: pd.clone(), key, ptr, len, access, _backing: Backing::Guest { seg, offset } })
    }

    /// # Safety
    /// As [`ProtectionDomain::register_raw`].
    pub(crate) unsafe fn register(
        pd: &ProtectionDomain,
        ptr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        if ptr.is_null() {
            return Err(Error::invalid("cannot register a null pointer"));
        }
        // Refused before the memory is re-backed: a registration that
        // fails leaves the program's memory as it was.
        check_access(access)?;
        if let Some(link) = pd.context().inner.control.guest_link() {
            // SAFETY: as below.
            return unsafe { Self::register_in_guest(pd, link, ptr, len, access) };
        }
        // SAFETY: the caller owns `ptr..ptr + len` (this function's
        // contract); `reback` checks the rest against /proc/self/maps.
        let r = unsafe { rebacking::reback(ptr, len)? };
        if !r.pieces.is_empty() {
            return Self::register_pieces(pd, ptr, len, access, r.pieces, true);
        }
        let key = reg_mr(pd, ptr, len, access, Some(r.span.fd()), r.fd_offset)?;
        pd.inner.local_keys.insert(key, ptr as u64, len as u64, access);
        Ok(MemoryRegion { pd: pd.clone(), key, ptr, len, access, _backing: Backing::Rebacked(r.span) })
    }

    /// [`register`](Self::register) in guest mode: the pages are
    /// re-backed by an extent of the VM's region (`rebacking::guest`).
    ///
    /// # Safety
    /// As [`ProtectionDomain::register_raw`].
    unsafe fn register_in_guest(
        pd: &ProtectionDomain,
        link: &crate::guest::GuestLink,
        ptr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        let ctx = pd.context().clone();
        let alloc = |len: u64| {
            let req = Request::GuestAlloc { len };
            match ctx.inner.control.call(&req, &[])?.reply {
                Reply::GuestExtent { offset, len } => Ok((offset, len)),
                other => Err(control::unexpected(&req, &other)),
            }
        };
        // Not holding the context: a kept span (`rebacking::guest`) must
        // not keep it open. Once the context is gone its session's end
        // freed the extent.
        let release = |offset: u64| -> Box<dyn FnOnce() + Send> {
            let ctx = Arc::downgrade(&ctx.inner);
            Box::new(move || {
                if let Some(inner) = ctx.upgrade() {
                    inner.control.destroy(Request::GuestFree { offset })
                }
            })
        };
        let grow = |offset: u64, len: u64| {
            let req = Request::GuestGrow { offset, len };
            match ctx.inner.control.call(&req, &[])?.reply {
                Reply::GuestExtent { len, .. } => Ok(len),
                other => Err(control::unexpected(&req, &other)),
            }
        };
        let bar = link.bar_fd();
        let src = rebacking::GuestSource {
            owner: Arc::as_ptr(&ctx.inner) as usize,
            bar: bar.as_fd(),
            alloc: &alloc,
            release: &release,
            grow: &grow,
        };
        // SAFETY: the caller's contract, as for `reback`.
        let r = unsafe { rebacking::reback_guest(ptr, len, &src)? };
        if !r.pieces.is_empty() {
            return Self::register_pieces(pd, ptr, len, access, r.pieces, false);
        }
        let key = reg_mr(pd, ptr, len, access, None, r.fd_offset)?;
        pd.inner.local_keys.insert(key, ptr as u64, len as u64, access);
        Ok(MemoryRegion { pd: pd.clone(), key, ptr, len, access, _backing: Backing::Rebacked(r.span) })
    }

    /// Registers `[ptr, ptr + len)`, re-backed by `pieces` of several
    /// spans (`Request::RegMrPieces`): on a host (`with_fds`) each piece's
    /// span's memfd goes with it; in a guest the offsets are the VM's
    /// region's.
    fn register_pieces(
        pd: &ProtectionDomain,
        ptr: *mut u8,
        len: usize,
        access: AccessFlags,
        pieces: Vec<rebacking::Piece>,
        with_fds: bool,
    ) -> Result<MemoryRegion> {
        tracing::debug!(
            addr = ptr as usize,
            len,
            pieces = pieces.len(),
            "vrdma: a registration over earlier spans, made of pieces"
        );
        let req = Request::RegMrPieces {
            pd: pd.pd_id(),
            addr: ptr as u64,
            len: len as u64,
            access,
            pieces: pieces.iter().map(|p| MrPiece { fd_offset: p.fd_offset, len: p.len as u64 }).collect(),
        };
        let fds: Vec<BorrowedFd<'_>> =
            if with_fds { pieces.iter().map(|p| p.span.fd()).collect() } else { Vec::new() };
        let key = match pd.context().inner.control.call(&req, &fds)?.reply {
            Reply::Mr { key } => key,
            other => return Err(control::unexpected(&req, &other)),
        };
        drop(fds);
        pd.inner.local_keys.insert(key, ptr as u64, len as u64, access);
        let spans = pieces.into_iter().map(|p| p.span).collect();
        Ok(MemoryRegion { pd: pd.clone(), key, ptr, len, access, _backing: Backing::Pieces(spans) })
    }

    /// The local key, for SGEs.
    pub fn lkey(&self) -> u32 {
        self.key
    }

    /// The remote key, for peers' RDMA and atomic requests. Equal to
    /// [`lkey`](Self::lkey).
    pub fn rkey(&self) -> u32 {
        self.key
    }

    /// The region's first byte's address in this process, as SGEs and
    /// remote peers name it.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: regions are at least one byte long.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The access rights granted at registration.
    pub fn access(&self) -> AccessFlags {
        self.access
    }

    /// The protection domain the region belongs to.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// Pointer to the first byte. The daemon may write the memory at any
    /// time; access it with raw copies or atomics, not references.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    fn check(&self, offset: usize, len: usize) -> Result<*mut u8> {
        match offset.checked_add(len) {
            // SAFETY: offset + len <= self.len, so the pointer stays within
            // the region's live mapping.
            Some(end) if end <= self.len => Ok(unsafe { self.ptr.add(offset) }),
            _ => Err(Error::invalid(format!(
                "[{offset}, +{len}) is outside a memory region of {} bytes",
                self.len
            ))),
        }
    }

    /// Copies `dst.len()` bytes from `offset` in the region.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let src = self.check(offset, dst.len())?;
        // SAFETY: `src` is valid for `dst.len()` bytes (checked) and `dst`
        // is private memory of the caller, so the ranges do not overlap.
        // The copy is raw: no reference into the shared bytes is formed.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` into the region at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        let dst = self.check(offset, src.len())?;
        // SAFETY: `dst` is valid for `src.len()` bytes (checked). `src` is a
        // shared Rust slice, which cannot be a `&` into this region (the
        // region never hands any out), so the ranges do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// Fills `[offset, offset + len)` with `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        let dst = self.check(offset, len)?;
        // SAFETY: `dst` is valid for `len` bytes (checked).
        unsafe { std::ptr::write_bytes(dst, byte, len) };
        Ok(())
    }

    /// A copy of the whole region.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        // SAFETY: the region is `len` bytes; `v` is a fresh private buffer.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr, v.as_mut_ptr(), self.len) };
        v
    }

    fn word(&self, offset: usize) -> Result<&AtomicU64> {
        let p = self.check(offset, 8)?;
        if (p as usize) & 7 != 0 {
            return Err(Error::invalid(format!(
                "offset {offset} is not 8-byte aligned (address {:#x})",
                p as usize
            )));
        }
        // SAFETY: `p` is 8-aligned and valid for 8 bytes for as long as
        // `self` (checked above). The daemon accesses 8-byte words of
        // regions only with atomics (as RDMA atomics require), and this
        // region hands out no other references, so an `&AtomicU64` is the
        // right view of the word.
        Ok(unsafe { AtomicU64::from_ptr(p.cast()) })
    }

    /// Atomically loads the 8-byte word at `offset` (little-endian as
    /// RDMA atomics see it on this host; `offset` must leave the address
    /// 8-byte aligned).
    pub fn read_u64(&self, offset: usize) -> Result<u64> {
        Ok(self.word(offset)?.load(Ordering::SeqCst))
    }

    /// Atomically stores `value` into the 8-byte word at `offset` (the
    /// address must be 8-byte aligned).
    pub fn write_u64(&self, offset: usize, value: u64) -> Result<()> {
        self.word(offset)?.store(value, Ordering::SeqCst);
        Ok(())
    }

    /// A scatter/gather entry for `[offset, offset + len)` of the region.
    pub fn sge(&self, offset: usize, len: usize) -> Result<Sge> {
        let p = self.check(offset, len)?;
        let length = u32::try_from(len)
            .map_err(|_| Error::invalid(format!("an SGE holds at most 4 GiB, not {len} bytes")))?;
        Ok(Sge { addr: p as u64, length, lkey: self.key })
    }

    /// An SGE covering the whole region (at most 4 GiB).
    pub fn sge_all(&self) -> Result<Sge> {
        self.sge(0, self.len)
    }
}

/// The checks of `ibv_reg_mr` on its access flags (the daemon makes them
/// too).
fn check_access(access: AccessFlags) -> Result<()> {
    if !access.is_consistent() {
        return Err(Error::invalid("remote write or atomic access requires LOCAL_WRITE"));
    }
    if !AccessFlags::FOR_REGIONS.contains(access) {
        return Err(Error::Unsupported(format!(
            "access flags {:?} (memory windows, zero-based, on-demand and huge-page regions)",
            access.difference(AccessFlags::FOR_REGIONS)
        )));
    }
    Ok(())
}

fn reg_mr(
    pd: &ProtectionDomain,
    ptr: *mut u8,
    len: usize,
    access: AccessFlags,
    fd: Option<BorrowedFd<'_>>,
    fd_offset: u64,
) -> Result<u32> {
    let req = Request::RegMr { pd: pd.pd_id(), addr: ptr as u64, len: len as u64, access, fd_offset };
    let fds: Vec<BorrowedFd<'_>> = fd.into_iter().collect();
    match pd.context().inner.control.call(&req, &fds)?.reply {
        Reply::Mr { key } => Ok(key),
        other => Err(control::unexpected(&req, &other)),
    }
}
