//! A guest session's part of its VM's region.
//!
//! Where a host tenant gets memfds, a guest session gets extents of the
//! VM's region (`crate::vm`): its rings ([`RingMemory`], given back to the
//! VM's allocator when the ring's last holder drops it) and the extents it
//! asked for to register memory in ([`GuestMemory`], given back on
//! `GuestFree` or when the session ends). A registration must lie inside
//! one of the session's memory extents: never on a ring, never outside
//! the region.
//!
//! A memory extent may grow in place (`GuestGrow`): the guest library
//! re-backs the pages after a span with the bytes after its extent when a
//! registration starts inside the span and ends past it (two heap buffers
//! sharing a page). Granted only for an extent of this session and only
//! into free bytes of the region; nothing already mapped moves, so the
//! regions on the extent keep their offsets and the daemon's mappings of
//! them. To leave room for that, memory extents are allocated with
//! [`MEMORY_HEADROOM`] that other allocations avoid while they fit
//! elsewhere (`vrdma_core::extents`).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, OnceLock};

use vrdma_core::extents::GrowError;
use vrdma_core::memory::Backing;
use vrdma_shm::{Mapping, MappingBudget};

use crate::vm::Vm;

/// Memory a ring of a session lives in: a memfd's mapping or a block of
/// its context's ring pool (host), or an extent of the VM's region
/// (guest), freed with it.
pub(crate) struct RingMemory {
    map: Memory,
    /// The VM's extent this maps, given back on drop; set once only (an
    /// adoption's mapping gets it when nothing can fail any more:
    /// [`Self::own_extent`]).
    extent: OnceLock<(Arc<Vm>, u64)>,
}

enum Memory {
    Mapped(Mapping),
    Pooled(super::ring_pool::Block),
}

impl Memory {
    fn as_ptr(&self) -> *mut u8 {
        match self {
            Memory::Mapped(m) => m.as_ptr(),
            Memory::Pooled(b) => b.as_ptr(),
        }
    }
    fn len(&self) -> usize {
        match self {
            Memory::Mapped(m) => m.len(),
            Memory::Pooled(b) => b.len(),
        }
    }
}

impl From<Mapping> for Memory {
    fn from(m: Mapping) -> Memory {
        Memory::Mapped(m)
    }
}

impl RingMemory {
    pub fn host(map: Mapping) -> RingMemory {
        RingMemory { map: map.into(), extent: OnceLock::new() }
    }

    /// A block of a host context's ring pool.
    pub fn pooled(block: super::ring_pool::Block) -> RingMemory {
        RingMemory { map: Memory::Pooled(block), extent: OnceLock::new() }
    }

    /// An extent of `len` bytes of `vm`'s region, mapped and zeroed:
    /// its offset and memory.
    pub fn in_vm(
        vm: &Arc<Vm>,
        len: usize,
        budget: Option<&Arc<MappingBudget>>,
    ) -> std::io::Result<(u64, RingMemory)> {
        let mut extents = vm.extents();
        let allocated = extents.alloc(len as u64);
        let free = extents.free_bytes();
        drop(extents);
        let (offset, span) = allocated.ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::OutOfMemory, vm.no_room(len as u64, free))
        })?;
        let mapped = vm
            .region
            .try_clone()
            .and_then(|fd| Mapping::map_untrusted_in(fd, offset, span as usize, budget).map_err(Into::into));
        let map = match mapped {
            Ok(m) => m,
            Err(e) => {
                vm.extents().free(offset);
                return Err(e);
            }
        };
        // A reused extent holds what its last owner left: a ring must
        // start from zeros as a new memfd's does.
        // SAFETY: `map` is a live writable mapping of `map.len()` bytes;
        // the guest may write it meanwhile, which a byte fill tolerates
        // (it forms no reference).
        unsafe { std::ptr::write_bytes(map.as_ptr(), 0, map.len()) };
        Ok((offset, RingMemory { map: map.into(), extent: OnceLock::from((vm.clone(), offset)) }))
    }

    /// The extent `[offset, offset + len)` of `vm`'s region, which the
    /// caller reserved in its allocator, mapped as it is (a moved VM's
    /// ring, whose indices and entries are in it); given back on drop.
    pub fn reserved_in_vm(vm: &Arc<Vm>, offset: u64, len: usize) -> std::io::Result<RingMemory> {
        let m = Self::unowned_in_vm(vm, offset, len)?;
        m.own_extent(vm, offset);
        Ok(m)
    }

    /// [`Self::reserved_in_vm`], the extent not given back on drop until
    /// [`Self::own_extent`]: an adoption maps a moved context's segment
    /// while the engine may still push events into it
    /// (`RingTable::awaiting`), so a failed adoption must leave the
    /// extent reserved, never free for a moment (issue 19, L1).
    pub fn unowned_in_vm(vm: &Arc<Vm>, offset: u64, len: usize) -> std::io::Result<RingMemory> {
        let map = vm
            .region
            .try_clone()
            .and_then(|fd| Mapping::map_untrusted_in(fd, offset, len, None).map_err(Into::into))?;
        Ok(RingMemory { map: map.into(), extent: OnceLock::new() })
    }

    /// The extent at `offset` of `vm`'s region, which this maps, is given
    /// back when the last holder drops it (no effect if it owns one).
    pub fn own_extent(&self, vm: &Arc<Vm>, offset: u64) {
        let _ = self.extent.set((vm.clone(), offset));
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Where this ring's memory starts in the segment the tenant maps,
    /// and that segment's length: a pool block's offset in its chunk and
    /// the chunk's length, or 0 and its own length.
    pub fn in_segment(&self) -> (u64, u64) {
        match &self.map {
            Memory::Pooled(b) => (b.offset(), b.chunk().len() as u64),
            Memory::Mapped(m) => (0, m.len() as u64),
        }
    }

    /// A descriptor of the segment the tenant maps, for the direct path
    /// to keep: the pool chunk's, shared (no new descriptor), or `own`
    /// (the ring's memfd) cloned; `None` for a guest's extent.
    pub fn segment_fd(
        &self,
        own: Option<&std::os::fd::OwnedFd>,
    ) -> Option<std::io::Result<crate::direct::SegmentFd>> {
        match (&self.map, own) {
            (Memory::Pooled(b), _) => Some(Ok(b.chunk().shared_fd())),
            (Memory::Mapped(_), Some(f)) => Some(f.try_clone().map(std::sync::Arc::new)),
            (Memory::Mapped(_), None) => None,
        }
    }
}

// SAFETY: delegates to the `Mapping` or pool block, a live mapping of
// `len()` bytes for as long as `self` holds it.
unsafe impl Backing for RingMemory {
    fn as_ptr(&self) -> *mut u8 {
        self.map.as_ptr()
    }
    fn len(&self) -> usize {
        self.map.len()
    }
}

impl Drop for RingMemory {
    fn drop(&mut self) {
        if let Some((vm, offset)) = self.extent.take() {
            vm.extents().free(offset);
        }
    }
}

/// The memory extents of one guest session and the regions on them.
pub(crate) struct GuestMemory {
    pub vm: Arc<Vm>,
    /// Extent offset -> (length, memory regions registered on it).
    pub memory: BTreeMap<u64, (u64, u32)>,
    /// Memory region key -> the extents it lies on (one, or several for
    /// a region of pieces).
    mrs: HashMap<u32, Vec<u64>>,
}

/// Most memory extents one guest session holds (each costs the daemon a
/// little bookkeeping; the region bounds their bytes).
pub(crate) const MAX_EXTENTS: usize = 4096;

/// Bytes after each memory extent that later allocations leave free while
/// they fit elsewhere, for the extent to grow into: 16 pages, enough for
/// the small heap buffers that share a page with a registered one. Soft:
/// it never makes an allocation fail.
pub(crate) const MEMORY_HEADROOM: u64 = 64 << 10;

impl GuestMemory {
    pub fn new(vm: Arc<Vm>) -> GuestMemory {
        GuestMemory { vm, memory: BTreeMap::new(), mrs: HashMap::new() }
    }

    /// A new memory extent of at least `len` bytes.
    pub fn alloc(&mut self, len: u64) -> Result<(u64, u64), String> {
        if self.memory.len() >= MAX_EXTENTS {
            return Err(format!("a guest session holds at most {MAX_EXTENTS} memory extents"));
        }
        let mut extents = self.vm.extents();
        let allocated = extents.alloc_with_headroom(len, MEMORY_HEADROOM);
        let free = extents.free_bytes();
        drop(extents);
        let (offset, span) = allocated.ok_or_else(|| self.vm.no_room(len, free))?;
        self.memory.insert(offset, (span, 0));
        Ok((offset, span))
    }

    /// Grows this session's memory extent at `offset` in place to at
    /// least `len` bytes: its new length.
    pub fn grow(&mut self, offset: u64, len: u64) -> Result<u64, (i32, String)> {
        let Some((have, _)) = self.memory.get_mut(&offset) else {
            return Err((libc::EINVAL, format!("no memory extent of this session at {offset}")));
        };
        let grown = self.vm.extents().grow(offset, len).map_err(|e| {
            let errno = match e {
                GrowError::Taken { .. } | GrowError::PastEnd { .. } => libc::ENOMEM,
                GrowError::NotAnExtent | GrowError::Overflow => libc::EINVAL,
            };
            (
                errno,
                format!(
                    "cannot grow the memory extent at {offset} ({have} bytes) to {len} bytes in place: {e}"
                ),
            )
        })?;
        *have = grown;
        Ok(grown)
    }

    /// Gives back the memory extent at `offset`.
    pub fn free(&mut self, offset: u64) -> Result<(), (i32, String)> {
        match self.memory.get(&offset) {
            None => Err((libc::EINVAL, format!("no memory extent of this session at {offset}"))),
            Some((_, n)) if *n > 0 => {
                Err((libc::EBUSY, format!("{n} memory regions lie on the extent at {offset}")))
            }
            Some(_) => {
                self.memory.remove(&offset);
                self.vm.extents().free(offset);
                Ok(())
            }
        }
    }

    /// The memory extent of this session holding `[offset, offset+len)`.
    pub fn extent_of(&self, offset: u64, len: u64) -> Option<u64> {
        let end = offset.checked_add(len)?;
        let (&start, &(span, _)) = self.memory.range(..=offset).next_back()?;
        (len > 0 && end <= start + span).then_some(start)
    }

    pub fn registered(&mut self, key: u32, extent: u64) {
        self.registered_in(key, &[extent]);
    }

    /// A region on the extents `extents` (distinct): several for a region
    /// of pieces (`RegMrPieces`).
    pub fn registered_in(&mut self, key: u32, extents: &[u64]) {
        for &extent in extents {
            if let Some((_, n)) = self.memory.get_mut(&extent) {
                *n += 1;
                self.mrs.entry(key).or_default().push(extent);
            }
        }
    }

    pub fn deregistered(&mut self, key: u32) {
        for at in self.mrs.remove(&key).unwrap_or_default() {
            if let Some((_, n)) = self.memory.get_mut(&at) {
                *n = n.saturating_sub(1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A VM of `mib` MiB whose files live in a fresh directory.
    fn vm(mib: u64) -> (Arc<Vm>, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("vrdmad-guest-memory-{}-{mib}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let config = crate::config::VmConfig { memory_mib: mib, ..crate::config::VmConfig::new(0) };
        (Arc::new(Vm::create("g", &config, &dir).unwrap()), dir)
    }

    /// The direct path keeps one descriptor for all the rings of a pool
    /// chunk, not a copy per ring (a `fcntl` on each CQ and QP made).
    #[test]
    fn pooled_rings_keep_their_chunks_descriptor_not_a_copy_each() {
        use std::os::fd::AsRawFd;
        let pool = super::super::ring_pool::RingPool::new();
        let ring = || {
            let block = pool
                .alloc(4096, None, || Some(super::super::admission::KeptDescriptor::for_test()))
                .unwrap()
                .expect("room in the pool");
            RingMemory::pooled(block)
        };
        let (cq, qp) = (ring(), ring());
        let kept_cq = cq.segment_fd(None).expect("a host ring").unwrap();
        let kept_qp = qp.segment_fd(None).expect("a host ring").unwrap();
        assert_eq!(kept_cq.as_raw_fd(), kept_qp.as_raw_fd(), "one descriptor for both");
    }

    /// A registration the region cannot hold is refused with what the
    /// guest cannot see for itself: the VM, the region's fixed size and
    /// where it comes from, and the bytes free.
    #[test]
    fn an_allocation_past_the_free_bytes_says_what_the_region_lacks() {
        let (vm, dir) = vm(8);
        let mut a = GuestMemory::new(vm.clone());
        let (_, held) = a.alloc(7 << 20).unwrap();
        let e = a.alloc(2 << 20).unwrap_err();
        let free = (8 << 20) - held;
        for want in [
            "VM \"g\"'s region (8 MiB, fixed by the host's [vms.g] memory_mib)".to_string(),
            format!("no run of {} bytes free ({free} bytes free in all", 2 << 20),
        ] {
            assert!(e.contains(&want), "{want:?} not in {e:?}");
        }
        let e = RingMemory::in_vm(&vm, 2 << 20, None).map(|_| ()).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::OutOfMemory);
        assert!(e.to_string().contains("fixed by the host's [vms.g] memory_mib"), "{e}");
        drop((a, vm));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_session_grows_only_its_own_extents_into_free_bytes() {
        let (vm, dir) = vm(4);
        let page = vrdma_shm::page_size() as u64;
        let region = vm.region_len;
        let (mut a, mut b) = (GuestMemory::new(vm.clone()), GuestMemory::new(vm.clone()));
        let (x, xl) = a.alloc(1).unwrap();
        assert_eq!(xl, page);
        // Owned, free after (its headroom): grown, registrations fit it.
        assert_eq!(a.grow(x, 3 * page), Ok(3 * page));
        assert_eq!(a.extent_of(x + 2 * page, page), Some(x));
        assert_eq!(a.grow(x, page), Ok(3 * page), "already that long");
        // Not owned: another session's extent, no extent's start.
        let e = b.grow(x, 4 * page).unwrap_err();
        assert_eq!(e.0, libc::EINVAL, "{}", e.1);
        assert!(e.1.contains("no memory extent of this session"), "{}", e.1);
        assert_eq!(a.grow(x + page, 4 * page).unwrap_err().0, libc::EINVAL);
        // Taken after: a ring placed right after it (once nothing else fits).
        let (y, _) = b.alloc(1).unwrap();
        assert_ne!(y, x + 3 * page, "headroom left free");
        let fillers: Vec<u64> =
            (0..region / page).map_while(|_| vm.extents().alloc(page)).map(|e| e.0).collect();
        assert_eq!(vm.extents().free_bytes(), 0);
        let e = a.grow(x, 4 * page).unwrap_err();
        assert_eq!(e.0, libc::ENOMEM, "{}", e.1);
        assert!(e.1.contains("only 0 bytes after it are free"), "{}", e.1);
        assert_eq!(a.extent_of(x, 3 * page), Some(x), "unchanged");
        for f in fillers {
            vm.extents().free(f);
        }
        // Past the region's end, and lengths that overflow.
        let e = a.grow(x, region + page).unwrap_err();
        assert_eq!(e.0, libc::ENOMEM, "{}", e.1);
        assert!(e.1.contains("past the region's end"), "{}", e.1);
        assert_eq!(a.grow(x, u64::MAX).unwrap_err().0, libc::EINVAL);
        // A migration's snapshot carries the grown extent as one (the
        // extents in use), which the destination reserves whole.
        let used: Vec<(u64, u64)> = vm.extents().used().collect();
        assert!(used.contains(&(x, 3 * page)), "{used:?}");
        let mut there = vrdma_core::extents::Extents::new(region, page);
        for &(at, len) in &used {
            assert_eq!(there.reserve(at, len), Some(len));
        }
        assert_eq!(there.containing(x + 2 * page, 10), Some((x, 3 * page)));
        // The grown extent is freed whole.
        a.free(x).unwrap();
        b.free(y).unwrap();
        assert_eq!(vm.extents().free_bytes(), region);
        drop(vm);
        let _ = std::fs::remove_dir_all(dir);
    }
}
