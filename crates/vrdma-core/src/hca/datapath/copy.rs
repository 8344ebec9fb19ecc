//! Moving the bytes of a message between lists of segments, without
//! allocating: the one copy of the data path.

use super::{Seg, Segs, Source};
use crate::memory::OutOfBounds;

/// `segs` without their first `n` bytes.
pub(super) fn skip<'a>(segs: &[Seg<'a>], mut n: usize) -> Segs<'a> {
    let mut out = Segs::new();
    for s in segs {
        if n >= s.len {
            n -= s.len;
            continue;
        }
        out.push(Seg { region: s.region, off: s.off + n, len: s.len - n });
        n = 0;
    }
    out
}

/// Copies bytes `[start, start+len)` of a message from `src` into the same
/// bytes of `dst`, both given as lists of segments.
pub(super) fn copy_message(dst: &[Seg], src: &Source, start: u64, len: u64) -> Result<(), OutOfBounds> {
    match src {
        Source::Segs(segs) => copy_spans(dst, segs, start, len, |d, doff, si, soff, n| {
            let s = &segs[si];
            d.region.copy_from(d.off + doff, s.region, s.off + soff, n)
        }),
        Source::Inline(b) => copy_spans(dst, &[b.len()], start, len, |d, doff, _, soff, n| {
            d.region.write(d.off + doff, &b[soff..soff + n])
        }),
    }
}

/// Walks `dst` and `src` from message offset `start` for `len` bytes and
/// calls `copy(dst_seg, dst_off, src_index, src_off, n)` for each piece.
fn copy_spans<T: Span>(
    dst: &[Seg],
    src: &[T],
    start: u64,
    len: u64,
    mut copy: impl FnMut(&Seg, usize, usize, usize, usize) -> Result<(), OutOfBounds>,
) -> Result<(), OutOfBounds> {
    let mut d = Cursor::new(dst, start);
    let mut s = Cursor::new(src, start);
    let mut left = len as usize;
    while left > 0 {
        let (Some((di, doff, dleft)), Some((si, soff, sleft))) = (d.at(), s.at()) else {
            return Err(OutOfBounds { offset: start as usize, len: len as usize, region_len: 0 });
        };
        let n = left.min(dleft).min(sleft);
        copy(&dst[di], doff, si, soff, n)?;
        d.advance(n);
        s.advance(n);
        left -= n;
    }
    Ok(())
}

/// Something with a length: a segment, or the length of inline data.
trait Span {
    fn span(&self) -> usize;
}

impl Span for Seg<'_> {
    fn span(&self) -> usize {
        self.len
    }
}

impl Span for usize {
    fn span(&self) -> usize {
        *self
    }
}

/// A position in a list of spans: which one, and how far into it.
struct Cursor<'s, T> {
    spans: &'s [T],
    idx: usize,
    off: usize,
}

impl<'s, T: Span> Cursor<'s, T> {
    fn new(spans: &'s [T], start: u64) -> Self {
        let mut c = Cursor { spans, idx: 0, off: 0 };
        c.advance(start as usize);
        c
    }

    fn advance(&mut self, n: usize) {
        self.off += n;
        while self.idx < self.spans.len() && self.off >= self.spans[self.idx].span() {
            self.off -= self.spans[self.idx].span();
            self.idx += 1;
        }
    }

    /// (span index, offset in it, bytes left in it)
    fn at(&self) -> Option<(usize, usize, usize)> {
        let s = self.spans.get(self.idx)?;
        Some((self.idx, self.off, s.span() - self.off))
    }
}
