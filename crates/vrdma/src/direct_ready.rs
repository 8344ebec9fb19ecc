//! A CQ's *ready set* (the direct path, `docs/direct-path.md`, "Many QPs
//! on one CQ"): which of the CQ's inboxes may hold completions, so that a
//! poll looks at those and not at every QP receiving into the CQ.
//!
//! The set is 480 bits in the CQ ring's second aux cache line
//! ([`proto::CQ_AUX_READY_FIRST`], 15 words) and a summary word
//! ([`proto::CQ_AUX_READY_SUMMARY`]) with one bit per data word. A QP's
//! bucket is its number modulo 480, so up to 480 QPs on one CQ have a bit
//! each (for consecutive numbers) and more share buckets.
//!
//! Why no completion is lost (every access `SeqCst`):
//! - the requester pushes into the inbox, then sets the data bit, then
//!   the summary bit ([`ReadySet::mark`]);
//! - the poller clears the summary bit, then reads the data word; for each
//!   set bit it clears the bit, then drains the bucket's inboxes, and sets
//!   the bit again if it could not empty them (its `out` is full); after
//!   a word it sets the summary bit again if the word is not zero
//!   ([`ReadySet::scan`]).
//!
//! A push the poller's drain missed came after the poller cleared the
//! data bit (the bit's modification order: the requester's set is then
//! later, and the bit stays set), and the requester's summary set comes
//! after that, so after the poller cleared the summary bit: the next scan
//! finds both. A set that the poller's clear overtook happened before the
//! drain, which then sees the push.
//!
//! Fairness: the scan starts where the last one stopped (the bucket after
//! the last it served), so a busy QP early in the set cannot keep a later
//! one waiting for more than one poll that fills its `out`.
//!
//! The words are tenant memory: the poller computes every bucket index
//! itself (a bit position in a fixed word, never a number read from the
//! page), so a scribbled word costs at most a look at empty inboxes, or,
//! cleared, the tenant's own completions waiting for the next mark.

use std::sync::atomic::{AtomicU32, Ordering::SeqCst};

use vrdma_core::proto::{
    cq_ready_bucket, for_each_ready_bucket, CQ_AUX_READY_FIRST, CQ_AUX_READY_SUMMARY, CQ_READY_BUCKETS,
    CQ_READY_WORDS,
};
use vrdma_shm::RingView;

/// The summary bits that name a data word.
const VALID: u32 = (1 << CQ_READY_WORDS) - 1;

/// What serving one bucket did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Served {
    /// Every inbox of the bucket was found empty at the end.
    pub(crate) emptied: bool,
    /// The caller's `out` has room for more.
    pub(crate) room: bool,
}

/// The ready set in a CQ ring's header (the owner's mapping or a
/// requester's).
#[derive(Clone, Copy)]
pub(crate) struct ReadySet<'a> {
    ring: &'a RingView,
}

impl<'a> ReadySet<'a> {
    pub(crate) fn of(ring: &'a RingView) -> ReadySet<'a> {
        ReadySet { ring }
    }

    fn summary(&self) -> &AtomicU32 {
        self.ring.aux(CQ_AUX_READY_SUMMARY)
    }

    /// Data word `w` (`w < CQ_READY_WORDS`, by the callers' construction).
    fn word(&self, w: usize) -> &AtomicU32 {
        self.ring.aux(CQ_AUX_READY_FIRST + w)
    }

    /// The requester's side: marks the inbox of QP `qpn` ready, after a
    /// completion was pushed into it.
    pub(crate) fn mark(&self, qpn: u32) {
        self.mark_bucket(cq_ready_bucket(qpn));
    }

    fn mark_bucket(&self, bucket: u32) {
        let (w, b) = ((bucket / 32) as usize, bucket % 32);
        self.word(w).fetch_or(1 << b, SeqCst);
        self.summary().fetch_or(1 << w, SeqCst);
    }

    /// Whether any bucket may be ready (one load: an empty poll's cost).
    pub(crate) fn any(&self) -> bool {
        self.summary().load(SeqCst) != 0
    }

    /// The buckets whose bits are set now, in order (for counting what the
    /// inboxes hold; nothing is cleared).
    pub(crate) fn for_each_set(&self, f: impl FnMut(u32)) {
        for_each_ready_bucket(|i| self.ring.aux(i).load(SeqCst), f);
    }

    /// The poller's side: serves the set buckets, from bucket `start` on
    /// and around, each once, with `serve(bucket)` (which drains the
    /// bucket's inboxes into the caller's `out`), until `out` is full or
    /// every set bucket was served. Returns where the next scan starts
    /// (the bucket after the last served; `start` if none was).
    pub(crate) fn scan(&self, start: u32, mut serve: impl FnMut(u32) -> Served) -> u32 {
        let summary = self.summary();
        let s = summary.load(SeqCst);
        let junk = s & !VALID;
        if junk != 0 {
            // Bits naming no word (scribbled): dropped, so that the empty
            // poll stays one load.
            summary.fetch_and(!junk, SeqCst);
        }
        let s = s & VALID;
        if s == 0 {
            return start;
        }
        let start = start % CQ_READY_BUCKETS;
        let (sw, sb) = ((start / 32) as usize, start % 32);
        let mut next = start;
        // The start word twice: its bits from `sb` first, those below it
        // last.
        for (step, w) in marked_words(s, sw) {
            let mask = match step {
                0 => u32::MAX << sb,
                CQ_READY_WORDS => (1u32 << sb).wrapping_sub(1),
                _ => u32::MAX,
            };
            if mask == 0 {
                continue;
            }
            summary.fetch_and(!(1 << w), SeqCst);
            let word = self.word(w);
            let mut bits = word.load(SeqCst) & mask;
            let mut full = false;
            while bits != 0 {
                let b = bits.trailing_zeros();
                bits &= bits - 1;
                word.fetch_and(!(1 << b), SeqCst);
                let bucket = w as u32 * 32 + b;
                let done = serve(bucket);
                next = (bucket + 1) % CQ_READY_BUCKETS;
                if !done.emptied {
                    word.fetch_or(1 << b, SeqCst);
                }
                if !done.room {
                    full = true;
                    break;
                }
            }
            if word.load(SeqCst) != 0 {
                summary.fetch_or(1 << w, SeqCst);
            }
            if full {
                break;
            }
        }
        next
    }
}

/// The data words a scan starting in word `sw` visits, given the
/// summary `s` (only its [`VALID`] bits): `(step, word)` for each word
/// whose summary bit is set, in the order `sw, sw + 1, …` around, and
/// `sw` once more last (step `CQ_READY_WORDS`, for its bits below the
/// start). The same as looking at every step `0..=CQ_READY_WORDS` and
/// skipping clear words, without the look (and the division) per word.
fn marked_words(s: u32, sw: usize) -> impl Iterator<Item = (usize, usize)> {
    let s = s & VALID;
    // Rotated right by `sw` within the 15 bits: bit k is word sw + k.
    let rotated = ((s >> sw) | (s << (CQ_READY_WORDS - sw))) & VALID;
    let again = (rotated & 1 != 0).then_some((CQ_READY_WORDS, sw));
    let mut bits = rotated;
    std::iter::from_fn(move || {
        if bits == 0 {
            return None;
        }
        let k = bits.trailing_zeros() as usize;
        bits &= bits - 1;
        Some((k, (sw + k) % CQ_READY_WORDS))
    })
    .chain(again)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use vrdma_shm::{ring_bytes, Segment};

    use super::*;

    /// A ring as the CQ's (its header's aux words), mapped twice as two
    /// processes would.
    fn cq_pair() -> (RingView, RingView) {
        let seg = Arc::new(Segment::create("vrdma-ready", ring_bytes(4, 64)).unwrap());
        let other = Arc::new(Segment::map_trusted(seg.try_clone_fd().unwrap(), seg.len()).unwrap());
        (RingView::in_segment(seg, 0, 4, 64).unwrap(), RingView::in_segment(other, 0, 4, 64).unwrap())
    }

    /// An inbox of `capacity` 8-byte entries, mapped twice.
    fn inbox_pair(capacity: u32) -> (RingView, RingView) {
        let seg = Arc::new(Segment::create("vrdma-inbox", ring_bytes(capacity, 8)).unwrap());
        let other = Arc::new(Segment::map_trusted(seg.try_clone_fd().unwrap(), seg.len()).unwrap());
        (
            RingView::in_segment(seg, 0, capacity, 8).unwrap(),
            RingView::in_segment(other, 0, capacity, 8).unwrap(),
        )
    }

    /// Pops what `inbox` holds into `got` (at most `room`); what serving
    /// its bucket did.
    fn drain(inbox: &RingView, got: &mut Vec<u64>, room: usize) -> Served {
        let mut slot = [0u8; 8];
        let mut taken = 0;
        while taken < room {
            match inbox.try_pop(&mut slot) {
                Ok(true) => {
                    got.push(u64::from_le_bytes(slot));
                    taken += 1;
                }
                _ => return Served { emptied: true, room: taken < room },
            }
        }
        Served { emptied: false, room: false }
    }

    /// The words a scan visits, in order, are those of a look at every
    /// step with the clear ones skipped, for every start word and many
    /// summaries (junk bits above the valid ones included).
    #[test]
    fn marked_words_are_every_step_with_a_set_summary_bit() {
        let every_step = |s: u32, sw: usize| -> Vec<(usize, usize)> {
            (0..=CQ_READY_WORDS)
                .map(|step| (step, (sw + step) % CQ_READY_WORDS))
                .filter(|&(_, w)| s & (1 << w) != 0)
                .collect()
        };
        let mut summaries: Vec<u32> = (0..CQ_READY_WORDS).map(|w| 1 << w).collect();
        summaries.extend([0, VALID, u32::MAX, 0b101, 0x4001, 0x5555, 0x2aaa, 0x7ffe, 0x8000_0003]);
        summaries.extend((0..64u32).map(|i| i.wrapping_mul(0x9e37_79b9) >> 7));
        for s in summaries {
            for sw in 0..CQ_READY_WORDS {
                assert_eq!(
                    marked_words(s, sw).collect::<Vec<_>>(),
                    every_step(s & VALID, sw),
                    "s {s:#x} sw {sw}"
                );
            }
        }
    }

    #[test]
    fn an_empty_set_serves_nothing_and_marks_are_found_once() {
        let (req, own) = cq_pair();
        let set = ReadySet::of(&own);
        assert!(!set.any());
        let mut served = Vec::new();
        assert_eq!(
            set.scan(0, |b| {
                served.push(b);
                Served { emptied: true, room: true }
            }),
            0
        );
        assert!(served.is_empty());
        // Two QPs in different words, one whose number wraps.
        ReadySet::of(&req).mark(5);
        ReadySet::of(&req).mark(CQ_READY_BUCKETS + 100);
        assert!(set.any());
        set.scan(0, |b| {
            served.push(b);
            Served { emptied: true, room: true }
        });
        assert_eq!(served, vec![5, 100]);
        assert!(!set.any(), "served buckets are cleared, and their summary bits with them");
    }

    #[test]
    fn a_scribbled_summary_costs_a_look_and_no_more() {
        let (_, own) = cq_pair();
        let set = ReadySet::of(&own);
        own.aux(CQ_AUX_READY_SUMMARY).store(u32::MAX, Ordering::SeqCst);
        own.aux(CQ_AUX_READY_FIRST + CQ_READY_WORDS - 1).store(u32::MAX, Ordering::SeqCst);
        let mut served = Vec::new();
        set.scan(7, |b| {
            served.push(b);
            Served { emptied: true, room: true }
        });
        // Every bucket of the last word, each once, none outside the set.
        let last: Vec<u32> = (CQ_READY_BUCKETS - 32..CQ_READY_BUCKETS).collect();
        assert_eq!(served, last);
        assert!(!set.any(), "the junk bits are dropped");
    }

    #[test]
    fn a_bucket_left_full_stays_marked_and_the_scan_goes_on_after_it() {
        let (req, own) = cq_pair();
        let set = ReadySet::of(&own);
        for q in [3, 40, 41] {
            ReadySet::of(&req).mark(q);
        }
        // `out` fills in bucket 3, which is not emptied.
        let next = set.scan(0, |b| Served { emptied: b != 3, room: false });
        assert_eq!(next, 4);
        let mut served = Vec::new();
        let next = set.scan(next, |b| {
            served.push(b);
            Served { emptied: true, room: true }
        });
        // From 4 on and around: 40, 41, then 3 (still marked).
        assert_eq!(served, vec![40, 41, 3]);
        assert_eq!(next, 4);
        assert!(!set.any());
    }

    /// Fairness: a QP whose inbox never empties (refilled before every
    /// poll), early in the set, and one later QP with one entry: with
    /// room for one completion per poll, the later one is served within
    /// two polls, and the busy one keeps being served too.
    #[test]
    fn a_busy_early_qp_does_not_starve_a_later_one() {
        let (req, own) = cq_pair();
        let set = ReadySet::of(&own);
        let (busy_in, busy_out) = inbox_pair(64);
        let (late_in, late_out) = inbox_pair(64);
        let (busy, late) = (1u32, 200u32);
        let mut got = Vec::new();
        let mut start = 0;
        let mut late_seen_at = None;
        let mut busy_seen = 0;
        for poll in 0..6u64 {
            // The busy QP always has more than one poll can take.
            while busy_in.try_push_bytes(&(1000 + poll).to_le_bytes()) == Ok(true) && busy_in.len() != Ok(8) {
            }
            ReadySet::of(&req).mark(busy);
            if poll == 0 {
                late_in.try_push_bytes(&7u64.to_le_bytes()).unwrap();
                ReadySet::of(&req).mark(late);
            }
            let before = got.len();
            start = set.scan(start, |b| match b {
                b if b == busy => drain(&busy_out, &mut got, 1),
                b if b == late => drain(&late_out, &mut got, 1),
                _ => Served { emptied: true, room: true },
            });
            assert_eq!(got.len(), before + 1, "each poll takes one");
            match got[before] {
                7 => late_seen_at = Some(poll),
                _ => busy_seen += 1,
            }
        }
        assert!(late_seen_at.is_some_and(|p| p <= 1), "the later QP waited {late_seen_at:?} polls");
        assert_eq!(busy_seen, 5, "the busy QP is served in every other poll");
    }

    /// Two threads, as two processes: a requester pushes `N` numbered
    /// completions, each followed by its mark, into three inboxes in
    /// turn, in bursts of 1 to 4 after each of which it waits until the
    /// poller has taken all (so that the last push of every burst must be
    /// found through its mark alone); the poller finds them only through
    /// the set (clear, then drain, then mark again if not emptied). Every
    /// completion arrives once and in order per inbox, within bounded
    /// time. The test fails (a burst never taken) if the poller cleared a
    /// bit after draining, or the requester marked before pushing: a push
    /// between the two is then left unmarked.
    #[test]
    fn pushes_racing_the_poller_are_never_lost() {
        const N: u64 = 40_000;
        const QPS: [u32; 3] = [9, 9 + CQ_READY_BUCKETS, 33];
        let (req, own) = cq_pair();
        let inboxes: Vec<(RingView, RingView)> = QPS.iter().map(|_| inbox_pair(16)).collect();
        let (pushers, pollers): (Vec<RingView>, Vec<RingView>) = inboxes.into_iter().unzip();
        let taken = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let failed = Arc::new(AtomicBool::new(false));
        let (seen, stop) = (taken.clone(), failed.clone());
        let producer = std::thread::spawn(move || -> Result<(), String> {
            let deadline = Instant::now() + Duration::from_secs(30);
            let set = ReadySet::of(&req);
            let mut i = 0u64;
            while i < N {
                let burst = 1 + (i * 7919 % 4);
                for _ in 0..burst.min(N - i) {
                    let k = (i % 3) as usize;
                    if pushers[k].try_push_bytes(&i.to_le_bytes()) != Ok(true) {
                        return Err(format!("inbox {k} full at {i}"));
                    }
                    set.mark(QPS[k]);
                    i += 1;
                }
                while seen.load(Ordering::SeqCst) < i {
                    if Instant::now() > deadline || stop.load(Ordering::SeqCst) {
                        stop.store(true, Ordering::SeqCst);
                        return Err(format!("the poller never took up to {i}: a mark was lost"));
                    }
                    std::hint::spin_loop();
                }
            }
            Ok(())
        });
        let set = ReadySet::of(&own);
        let mut got: Vec<Vec<u64>> = vec![Vec::new(); 3];
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut start = 0;
        let total = |got: &Vec<Vec<u64>>| got.iter().map(Vec::len).sum::<usize>() as u64;
        while total(&got) < N && !failed.load(Ordering::SeqCst) {
            if Instant::now() > deadline {
                failed.store(true, Ordering::SeqCst);
                break;
            }
            // Room for 2 per scan, so that buckets are left full too.
            let mut room = 2usize;
            start = set.scan(start, |b| {
                let mut emptied = true;
                for (k, q) in QPS.iter().enumerate() {
                    if cq_ready_bucket(*q) == b && room > 0 {
                        let before = got[k].len();
                        let s = drain(&pollers[k], &mut got[k], room);
                        room -= got[k].len() - before;
                        emptied &= s.emptied;
                    } else if cq_ready_bucket(*q) == b {
                        emptied = false;
                    }
                }
                Served { emptied, room: room > 0 }
            });
            taken.store(total(&got), Ordering::SeqCst);
        }
        let produced = producer.join().unwrap();
        assert_eq!(produced, Ok(()));
        for (k, g) in got.iter().enumerate() {
            let want: Vec<u64> = (0..N).filter(|i| (i % 3) as usize == k).collect();
            assert_eq!(*g, want, "inbox {k}");
        }
    }
}
