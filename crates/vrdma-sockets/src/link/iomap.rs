//! Direct placement on a carried connection (rdma-core's `riomap`,
//! `riounmap`, `riowrite`, which the drop-in librdmacm's rsocket API
//! calls through this library: `docs/sockets.md`, "rsocket").
//!
//! A mapping is the program's buffer registered for remote writes, and
//! an entry in a small table in the peer's ring region ([`super::IOMAP`]),
//! written there by an RDMA write on the connection's QP. Being on the
//! same QP as the stream's bytes, the entry lands before any byte this end
//! sends after mapping, and a peer's `riowrite` lands before any byte the
//! peer sends after it: the order rdma-core gives, where a program learns
//! of a mapping or a write through a message that follows it (riostream
//! does). The peer's table is read where it lies, untrusted: an entry is
//! taken only whole (its generation word at both ends) and with lengths
//! that do not wrap, and a write goes only inside the entry's range (the
//! daemon's key checks protect the memory itself).

use std::sync::atomic::Ordering;

use vrdma::wr::{self, SendWrExt as _};
use vrdma::{AccessFlags, MemoryRegion};

use super::{lock, Link, Res, IOMAP, S_IOMAP};

/// Entries of each end's table: mappings a connection may have at once.
pub const SLOTS: usize = 16;
/// Bytes of an entry: generation, offset, address, length, key,
/// generation again (little-endian words).
pub const ENTRY: usize = 48;
/// The largest mapping taken (a registration is bounded far below).
const MAX_LEN: u64 = 1 << 40;
/// The staging region of writes the direct path does not take: slots of
/// [`PIECE`] bytes, one more for a write's last byte.
const PIECE: usize = 32 * 1024;
const PIECES: usize = 4;
/// Direct writes (unsignaled) between two signaled ones.
const UNSIGNALED: u32 = 6;

/// A peer's mapping, as its table entry says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub offset: u64,
    pub addr: u64,
    pub len: u64,
    pub rkey: u32,
}

/// The words of an entry of generation `gen` (`None`: unmapped).
pub fn encode(gen: u64, e: Option<Entry>) -> [u64; ENTRY / 8] {
    match e {
        Some(e) => [gen, e.offset, e.addr, e.len, u64::from(e.rkey), gen],
        None => [gen, 0, 0, 0, 0, gen],
    }
}

/// A peer's entry, if whole (both generation words alike and not 0, not
/// caught half-written) and sane: a length of 1 to [`MAX_LEN`], offsets
/// and addresses that do not wrap, a 32-bit key.
pub fn decode(w: &[u64; ENTRY / 8]) -> Option<Entry> {
    let [g, offset, addr, len, rkey, g2] = *w;
    if g == 0 || g != g2 || len == 0 || len > MAX_LEN {
        return None;
    }
    offset.checked_add(len)?;
    addr.checked_add(len)?;
    let rkey = u32::try_from(rkey).ok()?;
    Some(Entry { offset, addr, len, rkey })
}

/// Where a write of `count` bytes at `offset` goes in the first entry
/// that holds `offset`: the remote address, its key and how many bytes
/// fit (a write past the mapping's end is short, as a stream write may
/// be). `None`: no entry holds `offset`.
pub fn place(entries: &[Entry], offset: u64, count: usize) -> Option<(u64, u32, usize)> {
    let e = entries.iter().find(|e| offset >= e.offset && offset - e.offset < e.len)?;
    let skip = offset - e.offset;
    let n = (e.len - skip).min(count as u64) as usize;
    Some((e.addr + skip, e.rkey, n))
}

/// Whether `[offset, offset + len)` overlaps a mapping in `maps`.
fn overlaps(maps: &[Mapping], offset: u64, len: u64) -> bool {
    maps.iter().any(|m| offset < m.offset + m.len as u64 && m.offset < offset + len)
}

struct Mapping {
    slot: usize,
    buf: usize,
    len: usize,
    offset: u64,
    _mr: MemoryRegion,
}

/// This end's mappings, and each slot's last generation.
#[derive(Default)]
pub struct Local {
    maps: Vec<Mapping>,
    gens: [u64; SLOTS],
    /// Where writes the direct path does not take are copied (made at
    /// the first such write).
    stage: Option<Stage>,
}

impl Local {
    /// Whether this end has mappings for the peer's direct placement.
    pub(super) fn has_maps(&self) -> bool {
        !self.maps.is_empty()
    }
}

struct Stage {
    mr: MemoryRegion,
    /// The work request id of each slot's last write (reused once done).
    busy: [u64; PIECES + 1],
    next: usize,
}

impl Link {
    /// `riomap(buf, len, PROT_WRITE, offset)`: registers the buffer and
    /// tells the peer (waited for: the entry is in the peer's table before
    /// anything this end sends next). Returns the offset (`-1`: the
    /// buffer's address). `EINVAL` for a null or empty buffer, an offset
    /// below -1 or one overlapping another mapping; `ENOMEM` with every
    /// slot taken.
    pub fn iomap(&self, buf: *mut u8, len: usize, offset: i64) -> Res<i64> {
        if buf.is_null() || len == 0 || len as u64 > MAX_LEN || offset < -1 {
            return Err(libc::EINVAL);
        }
        let offset = if offset == -1 { buf as u64 } else { offset as u64 };
        if offset.checked_add(len as u64).is_none_or(|e| e > i64::MAX as u64) {
            return Err(libc::EINVAL);
        }
        let dev = crate::dev::dev().ok_or(libc::EIO)?;
        let tx = self.tx.lock();
        if tx.shut || self.peer_closed() {
            return Err(libc::EPIPE);
        }
        let mut l = lock(&self.iomaps);
        if overlaps(&l.maps, offset, len as u64) {
            return Err(libc::EINVAL);
        }
        let slot = (0..SLOTS).find(|s| !l.maps.iter().any(|m| m.slot == *s)).ok_or(libc::ENOMEM)?;
        // SAFETY: the program maps memory it owns (riomap's contract: the
        // buffer stays valid until riounmap or the close), which the
        // region does not free; it is read and written only by the daemon
        // and the program, never through a Rust reference.
        let mr =
            unsafe { dev.pd.register_raw(buf, len, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE) }
                .map_err(|e| e.errno())?;
        let gen = l.gens[slot] + 1;
        let entry = Entry { offset, addr: mr.addr(), len: len as u64, rkey: mr.rkey() };
        self.send_entry(slot, encode(gen, Some(entry)))?;
        l.gens[slot] = gen;
        l.maps.push(Mapping { slot, buf: buf as usize, len, offset, _mr: mr });
        // (The maps' lock first: the lines said under the send lock are
        // said as it goes, `crate::connlock`.)
        drop(l);
        drop(tx);
        Ok(offset as i64)
    }

    /// `riounmap(buf, len)`: the mapping of exactly that buffer (else
    /// `EINVAL`) leaves the peer's table (in order with the stream, as the
    /// mapping came), then its registration goes. A peer's write still on
    /// its way then fails its connection, as in rdma-core.
    pub fn iounmap(&self, buf: *mut u8, len: usize) -> Res<()> {
        let _tx = self.tx.lock();
        let mut l = lock(&self.iomaps);
        let i = l.maps.iter().position(|m| m.buf == buf as usize && m.len == len).ok_or(libc::EINVAL)?;
        let slot = l.maps[i].slot;
        let gen = l.gens[slot] + 1;
        // A peer that is gone reads no table.
        if !self.peer_closed() && self.send_entry(slot, encode(gen, None)).is_ok() {
            l.gens[slot] = gen;
        }
        l.maps.swap_remove(i);
        Ok(())
    }

    /// Writes `words` into slot `slot` of the peer's table, waited for.
    fn send_entry(&self, slot: usize, words: [u64; ENTRY / 8]) -> Res<()> {
        for (i, w) in words.iter().enumerate() {
            self.stage.write_u64(S_IOMAP + 8 * i, *w).map_err(|e| e.errno())?;
        }
        self.write_word(S_IOMAP, ENTRY, IOMAP + slot * ENTRY)
    }

    /// The peer's mappings, from its table in this end's ring region. An
    /// entry's words are read last to first: the write that brings one
    /// stores them first to last (a copy of 48 bytes, head before tail),
    /// so a new last generation word means the rest is new too, and an
    /// entry caught half-written has generation words that differ.
    fn peer_entries(&self) -> Vec<Entry> {
        (0..SLOTS)
            .filter_map(|s| {
                let mut w = [0u64; ENTRY / 8];
                for (i, x) in w.iter_mut().enumerate().rev() {
                    *x = self.ring.read_u64(IOMAP + s * ENTRY + 8 * i).ok()?;
                }
                decode(&w)
            })
            .collect()
    }

    /// At the close: this end's mappings are deregistered (a peer's
    /// `riowrite` that comes after fails, as with rdma-core, instead of
    /// landing in a buffer the program may free once `rclose` returned).
    pub(super) fn unmap_all(&self) {
        let mut local = lock(&self.iomaps);
        local.maps.clear();
        local.stage = None;
    }

    /// `riowrite(buf, count, offset)`: RDMA-writes the bytes into the
    /// peer's mapping that holds `offset`, on the stream's QP after every
    /// byte written before (so before any written after). Returns the
    /// bytes written: short where the mapping ends first; `EINVAL` where
    /// no mapping of the peer holds `offset` (none yet, or unmapped).
    /// The last byte goes in a write of its own, after the others: a
    /// program that watches the last byte of its buffer (riostream) sees
    /// the rest there once it changed.
    pub fn iowrite(&self, buf: *const u8, count: usize, offset: i64) -> Res<usize> {
        if count == 0 {
            return Ok(0);
        }
        let tx = self.tx.lock();
        // Demoted (after the fork) while this waited for the send lock:
        // no byte into the peer's memory after the marker.
        if super::after_send_lock(self.d_state()) == super::Recheck::Demoted {
            return Err(libc::ECONNRESET);
        }
        if tx.shut {
            return Err(libc::EPIPE);
        }
        if self.peer_closed() {
            return Err(libc::EPIPE);
        }
        self.reap()?;
        let offset = u64::try_from(offset).map_err(|_| libc::EINVAL)?;
        let (addr, rkey, n) = place(&self.peer_entries(), offset, count).ok_or(libc::EINVAL)?;
        // SAFETY: the caller's buffer of `count >= n` bytes, readable for
        // the call (the C front end refused a null one).
        let src = unsafe { std::slice::from_raw_parts(buf, n) };
        self.iowrites.fetch_add(1, Ordering::Relaxed);
        let (body, last) = src.split_at(n - 1);
        self.put(body, addr, rkey, false)?;
        self.put(last, addr + body.len() as u64, rkey, true)?;
        drop(tx);
        Ok(n)
    }

    /// Writes `src` to `addr` (key `rkey`) of the peer: from the caller's
    /// buffer where the direct path takes it, else copied through the
    /// staging region (`last`: the write's last byte, in a slot of its
    /// own), piece by piece over [`PIECES`] slots, each reused once its
    /// write completed. Nothing waits for the last pieces: a `riowrite`
    /// returns once posted, as rdma-core's does (a later close lands them
    /// first: its `CLOSED` word follows them on the QP).
    fn put(&self, src: &[u8], addr: u64, rkey: u32, last: bool) -> Res<()> {
        if src.is_empty() {
            return Ok(());
        }
        if self.qp.write_now(&[src], addr, rkey).map_err(|e| e.errno())? {
            self.io_direct.fetch_add(1, Ordering::Relaxed);
            // An unsignaled write holds its send-queue slot until a later
            // signaled completion is polled: after a few, one (an empty
            // write, reaped by a later call), so that the stream's writes
            // keep their room.
            if self.io_unsignaled.fetch_add(1, Ordering::AcqRel) + 1 >= UNSIGNALED {
                self.io_unsignaled.store(0, Ordering::Release);
                let w = wr::rdma_write(0, &[], addr, rkey).map_err(|e| e.errno())?.signaled();
                self.post(&mut [w], None)?;
            }
            return Ok(());
        }
        let mut l = lock(&self.iomaps);
        if l.stage.is_none() {
            let dev = crate::dev::dev().ok_or(libc::EIO)?;
            let mr =
                dev.pd.alloc_mr(PIECE * (PIECES + 1), AccessFlags::LOCAL_WRITE).map_err(|e| e.errno())?;
            l.stage = Some(Stage { mr, busy: [0; PIECES + 1], next: 0 });
        }
        let st = l.stage.as_mut().expect("made above");
        for (i, piece) in src.chunks(PIECE).enumerate() {
            let slot = if last {
                PIECES
            } else {
                st.next = (st.next + 1) % PIECES;
                st.next
            };
            let busy = st.busy[slot];
            self.wait_until(|p| p.done >= busy)?;
            st.mr.write(slot * PIECE, piece).map_err(|e| e.errno())?;
            let sge = st.mr.sge(slot * PIECE, piece.len()).map_err(|e| e.errno())?;
            let at = addr + (i * PIECE) as u64;
            let w = wr::rdma_write(0, &[sge], at, rkey).map_err(|e| e.errno())?.signaled();
            // Send-queue room as a stream write takes it.
            self.wait_until(|p| p.pending.len() < super::IN_FLIGHT)?;
            st.busy[slot] = self.post(&mut [w], None)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(offset: u64, len: u64) -> Entry {
        Entry { offset, addr: 0x1000 + offset, len, rkey: 7 }
    }

    #[test]
    fn an_entry_is_taken_only_whole_and_sane() {
        let good = e(0, 4096);
        assert_eq!(decode(&encode(3, Some(good))), Some(good));
        // Unmapped, never written, or caught half-written.
        assert_eq!(decode(&encode(4, None)), None);
        assert_eq!(decode(&[0; 6]), None);
        let mut torn = encode(5, Some(good));
        torn[5] = 4;
        assert_eq!(decode(&torn), None);
        // Lengths and addresses that wrap, a key wider than 32 bits.
        assert_eq!(decode(&[1, u64::MAX - 10, 0, 100, 1, 1]), None);
        assert_eq!(decode(&[1, 0, u64::MAX - 10, 100, 1, 1]), None);
        assert_eq!(decode(&[1, 0, 0, MAX_LEN + 1, 1, 1]), None);
        assert_eq!(decode(&[1, 0, 0, 100, 1 << 32, 1]), None);
    }

    #[test]
    fn a_write_goes_only_inside_the_mapping_that_holds_its_offset() {
        let maps = [e(0, 100), e(1000, 50)];
        assert_eq!(place(&maps, 10, 20), Some((0x1000 + 10, 7, 20)));
        // Short at the mapping's end.
        assert_eq!(place(&maps, 90, 20), Some((0x1000 + 90, 7, 10)));
        assert_eq!(place(&maps, 1049, 5), Some((0x1000 + 1000 + 49, 7, 1)));
        // Between, past, at the end.
        assert_eq!(place(&maps, 100, 1), None);
        assert_eq!(place(&maps, 1050, 1), None);
        assert_eq!(place(&maps, u64::MAX, 1), None);
        assert_eq!(place(&[], 0, 1), None);
    }
}
