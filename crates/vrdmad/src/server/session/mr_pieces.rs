//! `RegMrPieces`: a memory region whose pages come from several pieces.
//!
//! A program may register a buffer that begins before pages it registered
//! earlier, or covers several registrations and the pages between them
//! (hardware takes any readable range). Those earlier pages stay where
//! the earlier regions' mappings look (a memfd each on a host, an extent
//! of the VM's region in a guest), so the library sends the new region as
//! the pieces it is made of, and the daemon maps them one after the other
//! into one range ([`vrdma_shm::PiecedMapping`]). Everything about the
//! pieces is the tenant's word: their count, lengths, alignment and (in a
//! guest) extents are checked here, each failure a clear `EINVAL`.
//!
//! A pieced region is not kept for the direct path (`docs/direct-path.md`):
//! a peer could be granted only one file, so WRs on it go through the
//! engine.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use vrdma_core::memory::{Backing, Region};
use vrdma_core::proto::{MrPiece, Reply, MAX_MR_PIECES};
use vrdma_core::verbs::AccessFlags;
use vrdma_shm::{page_size, Piece, PiecedMapping};

use super::{error, Answer, Session, EINVAL, ENOMEM};
use crate::vm::{Kind, Place};

/// The pages of each piece to map: its file's page-aligned start and the
/// bytes from there, and the region's first byte's offset in the first
/// page. Checks what a tenant may get wrong.
pub(crate) fn piece_pages(
    pieces: &[MrPiece],
    len: u64,
    page: u64,
) -> Result<(Vec<(u64, usize)>, usize), String> {
    let n = pieces.len();
    if n == 0 || n > MAX_MR_PIECES {
        return Err(format!("a region of pieces has 1 to {MAX_MR_PIECES} pieces, not {n}"));
    }
    let mut sum = 0u64;
    let mut out = Vec::with_capacity(n);
    let mut inner = 0;
    for (i, p) in pieces.iter().enumerate() {
        if p.len == 0 {
            return Err(format!("piece {i} of the region is empty"));
        }
        sum = sum.checked_add(p.len).ok_or_else(|| "the pieces' lengths overflow".to_string())?;
        let end = p.fd_offset.checked_add(p.len).ok_or_else(|| format!("piece {i} wraps around"))?;
        let lead = p.fd_offset % page;
        if i > 0 && lead != 0 {
            return Err(format!("piece {i} begins at {:#x}, inside a page", p.fd_offset));
        }
        if i + 1 < n && end % page != 0 {
            return Err(format!("piece {i} ends at {end:#x}, inside a page (only the last may)"));
        }
        if i == 0 {
            inner = lead as usize;
        }
        let bytes = usize::try_from(p.len + lead).map_err(|_| format!("piece {i} is too large"))?;
        out.push((p.fd_offset - lead, bytes));
    }
    if sum != len {
        return Err(format!("the pieces hold {sum} bytes, the region {len}"));
    }
    Ok((out, inner))
}

/// Maps the region of `pieces` (of `len` bytes), piece `i` from
/// `files[i]`, charged to `budget`: what `RegMrPieces` registers, and what
/// a migration's import maps again.
pub(crate) fn map_pieces(
    files: &[BorrowedFd<'_>],
    pieces: &[MrPiece],
    len: u64,
    budget: Option<&Arc<vrdma_shm::MappingBudget>>,
) -> Result<Region, Answer> {
    let (pages, inner) = piece_pages(pieces, len, page_size() as u64).map_err(|m| error(EINVAL, m))?;
    if files.len() != pages.len() {
        return Err(error(EINVAL, format!("{} pieces need as many files, not {}", pages.len(), files.len())));
    }
    let list: Vec<Piece<'_>> =
        files.iter().zip(&pages).map(|(&fd, &(offset, len))| Piece { fd, offset, len }).collect();
    let map = PiecedMapping::map_untrusted_in(&list, budget).map_err(|e| match e {
        vrdma_shm::SegmentError::Io(e) if e.kind() == std::io::ErrorKind::OutOfMemory => {
            error(ENOMEM, e.to_string())
        }
        e => error(EINVAL, e.to_string()),
    })?;
    let backing: Arc<dyn Backing> = Arc::new(map);
    Region::new(backing, inner, len as usize).map_err(|e| error(EINVAL, e.to_string()))
}

/// Whether two of `ranges` (file, start, length), of one file each,
/// overlap: the first such pair.
fn overlapping<F: PartialEq + Copy>(ranges: &[(F, u64, usize)]) -> Option<(usize, usize)> {
    for (i, a) in ranges.iter().enumerate() {
        for (j, b) in ranges.iter().enumerate().skip(i + 1) {
            if a.0 == b.0 && a.1 < b.1 + b.2 as u64 && b.1 < a.1 + a.2 as u64 {
                return Some((i, j));
            }
        }
    }
    None
}

impl Session {
    /// `RegMrPieces` (see the module's doc): on a host `fds` holds one
    /// memfd per piece; a guest's pieces are offsets of its VM's region,
    /// each inside a memory extent of this session.
    pub(super) fn reg_mr_pieces(
        &mut self,
        pd: u32,
        addr: u64,
        len: u64,
        access: AccessFlags,
        pieces: Vec<MrPiece>,
        fds: Vec<OwnedFd>,
    ) -> Result<Answer, Answer> {
        let (pages, _) = piece_pages(&pieces, len, page_size() as u64).map_err(|m| error(EINVAL, m))?;
        let bad_overlap =
            |(i, j): (usize, usize)| error(EINVAL, format!("pieces {i} and {j} of the region overlap"));
        // In a guest: the extent each piece lies in, and the VM's region.
        let (extents, region) = match &self.guest {
            Some(g) => {
                if !fds.is_empty() {
                    return Err(error(
                        EINVAL,
                        "a guest's pieces are offsets of the VM's region, with no fds",
                    ));
                }
                let mut extents = Vec::with_capacity(pieces.len());
                for (i, p) in pieces.iter().enumerate() {
                    let e = g.extent_of(p.fd_offset, p.len).ok_or_else(|| {
                        error(
                            EINVAL,
                            format!(
                                "piece {i} [{}, +{}) does not lie in a memory extent of this session (GuestAlloc)",
                                p.fd_offset, p.len
                            ),
                        )
                    })?;
                    extents.push(e);
                }
                let ranges: Vec<((), u64, usize)> = pages.iter().map(|&(s, n)| ((), s, n)).collect();
                if let Some(pair) = overlapping(&ranges) {
                    return Err(bad_overlap(pair));
                }
                (extents, Some(g.vm.region.try_clone().map_err(|e| error(ENOMEM, e.to_string()))?))
            }
            None => {
                if fds.len() != pieces.len() {
                    return Err(error(
                        EINVAL,
                        format!("{} pieces need as many memfds, {} came", pieces.len(), fds.len()),
                    ));
                }
                let mut ranges = Vec::with_capacity(fds.len());
                for (fd, &(s, n)) in fds.iter().zip(&pages) {
                    let st =
                        rustix::fs::fstat(fd).map_err(|e| error(EINVAL, format!("a piece's fd: {e}")))?;
                    ranges.push(((st.st_dev, st.st_ino), s, n));
                }
                if let Some(pair) = overlapping(&ranges) {
                    return Err(bad_overlap(pair));
                }
                (Vec::new(), None)
            }
        };
        self.engine(move |e, c| e.hca.may_register(c, len))??;
        let mr = {
            let files: Vec<BorrowedFd<'_>> = match &region {
                Some(r) => vec![r.as_fd(); pages.len()],
                None => fds.iter().map(|f| f.as_fd()).collect(),
            };
            map_pieces(&files, &pieces, len, self.budget())
        };
        // The mapping holds the files.
        drop((region, fds));
        let mr = mr?;
        let key = self.engine(move |e, c| e.hca.reg_mr(c, pd, addr, access, mr))??;
        if let Some(g) = self.guest.as_mut() {
            let mut held = extents.clone();
            held.sort_unstable();
            held.dedup();
            g.registered_in(key, &held);
            let at = pieces.iter().map(|p| (p.fd_offset, p.len)).collect();
            self.place(Kind::Mr, key, Place::MrPieces(at));
        }
        Ok(Reply::Mr { key }.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = 4096;

    fn p(fd_offset: u64, len: u64) -> MrPiece {
        MrPiece { fd_offset, len }
    }

    #[test]
    fn pieces_are_checked() {
        let ok = piece_pages(&[p(P + 100, P - 100), p(8 * P, 2 * P), p(0, 10)], 3 * P - 90, P).unwrap();
        assert_eq!(ok, (vec![(P, P as usize), (8 * P, 2 * P as usize), (0, 10)], 100));
        let err = |v: &[MrPiece], len| piece_pages(v, len, P).unwrap_err();
        assert!(err(&[], 0).contains("1 to 64 pieces"));
        assert!(err(&vec![p(0, P); 65], 65 * P).contains("not 65"));
        assert!(err(&[p(0, 0)], 0).contains("empty"));
        assert!(err(&[p(0, P), p(8, 10)], P + 10).contains("piece 1 begins at 0x8, inside a page"));
        assert!(err(&[p(0, 10), p(P, 10)], 20).contains("piece 0 ends at 0xa, inside a page"));
        assert!(err(&[p(0, P), p(P, 10)], P + 11).contains("hold 4106 bytes, the region 4107"));
        assert!(err(&[p(u64::MAX - 5, 10)], 10).contains("wraps"));
        assert!(err(&[p(0, P), p(0, u64::MAX - P + 1)], 0).contains("overflow"));
    }

    #[test]
    fn overlaps_are_found_within_one_file_only() {
        assert_eq!(overlapping(&[(1, 0, 4096), (1, 4096, 4096)]), None);
        assert_eq!(overlapping(&[(1, 0, 8192), (2, 4096, 4096)]), None);
        assert_eq!(overlapping(&[(1, 0, 4096), (2, 0, 10), (1, 0, 8192)]), Some((0, 2)));
    }
}
