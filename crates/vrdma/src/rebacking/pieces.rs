//! Re-backing a range that begins before a span it overlaps, or covers
//! several: the range becomes pieces.
//!
//! A span's file grows only at its end, and the regions over a span's
//! pages keep the daemon's mappings of its file, so such a range cannot
//! be one piece of one file. Instead each span it overlaps gives its
//! part, the pages between spans join the span before them (it grows over
//! them, as for a range that starts inside a span), and the pages before
//! the first span become a span of their own. The region is then
//! registered as the pieces (`Request::RegMrPieces`), which the daemon
//! maps one after the other. Every span keeps its place in the registry,
//! so later registrations, `fork` and deregistration in any order treat
//! them as any other. A host request carries at most `proto::MAX_FDS`
//! descriptors, one a piece, so a range over more spans than that is
//! refused.

use std::sync::Arc;

use vrdma_core::proto::MAX_FDS;

use super::{grow, new_span, MapEntry, Piece, Rebacked, Span, Spans};
use crate::error::{Error, Result};

/// [`super::reback`] of `range` (page bounds `pages`) over the live
/// spans `live` (sorted, growable, not all holding it), under the registry
/// lock.
pub(super) fn reback_pieces(
    reg: &mut Spans,
    maps: &[MapEntry],
    live: &[Arc<Span>],
    range: (usize, usize),
    pages: (usize, usize),
) -> Result<Rebacked> {
    let ((start, end), (pstart, pend)) = (range, pages);
    // Huge pages are re-backed whole, by a file that cannot grow; no range
    // ends in the middle of one.
    if let Some(s) = live.iter().find(|s| !s.growable) {
        return Err(Error::invalid(format!(
            "[{start:#x}, {end:#x}) overlaps a registration of huge pages with different page bounds \
             (pages [{:#x}, {:#x}) are re-backed as one span)",
            s.start,
            s.end()
        )));
    }
    let leading = live.first().is_some_and(|s| s.start > pstart);
    let n = live.len() + usize::from(leading);
    if n > MAX_FDS {
        return Err(Error::invalid(format!(
            "[{start:#x}, {end:#x}) covers {} registered spans{}: a region is made of at most {MAX_FDS} pieces",
            live.len(),
            if leading { " and pages before them" } else { "" },
        )));
    }
    // Every page between spans must be re-backable before any moves.
    let mut at = pstart;
    for s in live {
        if at < s.start {
            super::check_rebackable(maps, at, s.start)?;
        }
        at = s.end();
    }
    if at < pend {
        super::check_rebackable(maps, at, pend)?;
    }
    let mut pieces: Vec<Piece> = Vec::with_capacity(n);
    if leading {
        let span = new_span(reg, maps, pstart, live[0].start, None)?;
        pieces.push(Piece { len: span.len, fd_offset: 0, span });
    }
    for (i, s) in live.iter().enumerate() {
        let to = live.get(i + 1).map_or(pend, |next| next.start);
        let from = s.start.max(pstart);
        let span = if s.end() < to {
            let grown = grow(maps, s, to)?;
            reg.entry(grown.start).or_default().push(Arc::downgrade(&grown));
            grown
        } else {
            s.clone()
        };
        let to = to.min(span.end());
        pieces.push(Piece { fd_offset: (from - span.start) as u64, len: to - from, span });
    }
    // The range's own bytes: from `start` in the first page, to `end` in
    // the last.
    let first = pieces.first_mut().expect("at least one span");
    first.fd_offset += (start - pstart) as u64;
    first.len -= start - pstart;
    pieces.last_mut().expect("at least one span").len -= pend - end;
    let first = &pieces[0];
    Ok(Rebacked { span: first.span.clone(), fd_offset: first.fd_offset, pieces })
}
