//! The daemon's side of the direct path (`docs/direct-path.md`): it turns
//! the core's grant rules ([`vrdma_core::hca`]'s `direct_*`) into shared
//! memory and descriptors, and revokes them.
//!
//! What it keeps:
//! - the memfd of every region that allows remote write, read or atomics,
//!   or local write (a SEND's bytes land in the peer's receive SGEs),
//!   while the switch is on (a region's descriptor is otherwise closed once mapped): the
//!   one thing the daemon cannot make again later, and what a grant
//!   hands to the requester's process;
//! - the segment of every CQ, while the switch is on: a requester
//!   completing a receive there marks the CQ's ready set (so that the
//!   owner's polls look only at inboxes with completions), and, with a
//!   completion channel, takes the CQ's armed word itself and rings the
//!   channel's doorbell (a dup of the daemon's end, handed out, not kept);
//! - per requester QP with grants, a *window* page (a memfd of its own):
//!   an open word, the count of the library's copies in flight, and one
//!   word per granted region holding the grant's generation.
//!
//! Each of these descriptors is charged to its tenant's descriptor share
//! ([`KeptDescriptor`], held beside the descriptor and given back with
//! it). At the limit the object is not kept and not granted: its work
//! requests take the engine path, which needs no descriptor.
//!
//! Revoking clears a word, then waits (bounded) until the in-flight count
//! drains: the library announces a copy before it reads the words, so a
//! copy either saw the cleared word or is counted. The wait runs on the
//! session's thread, after the engine command, so that the engine never
//! waits on a tenant's page; the engine reads nothing else there.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vrdma_core::hca::{ContextId, DirectRefusal, Hca, Revocation};
use vrdma_core::proto::{
    direct_window_bytes, DirectGranted, DirectRecvGranted, RingSpec, DIRECT_WINDOW_INFLIGHT,
    DIRECT_WINDOW_OPEN, DIRECT_WINDOW_RECV, DIRECT_WINDOW_SLOTS,
};
use vrdma_shm::{Segment, WordPage};

use crate::engine::RingTable;
use crate::server::KeptDescriptor;

/// How long a revocation waits for a requester's copies in flight. A copy
/// is at most the library's direct size limit, microseconds; only a
/// requester stopped or killed in the middle of one makes the wait run out
/// (see the design notes).
pub const DRAIN_LIMIT: Duration = Duration::from_millis(200);

/// A kept ring segment's memfd. Shared, not a copy: a host context's
/// pooled rings all lie in a few chunks (`server::ring_pool`), and a
/// descriptor of its own for each ring was a `fcntl(F_DUPFD)` on every
/// CQ and QP made (two on each side of an rdma_cm connection's setup) and
/// a `close` on each destroyed. A grant still hands out a copy.
pub type SegmentFd = Arc<OwnedFd>;

struct Region {
    ctx: ContextId,
    fd: OwnedFd,
    fd_offset: u64,
    _charge: KeptDescriptor,
}

struct Window {
    seg: Arc<Segment>,
    words: WordPage,
    _charge: KeptDescriptor,
}

/// A QP segment with an inbox (an RC QP, created with the switch on):
/// what a receive grant hands out. `rq` is `None` for a QP whose receives
/// come from an SRQ (its segment holds the inbox only).
struct QpSegment {
    ctx: ContextId,
    fd: SegmentFd,
    len: u64,
    rq: Option<RingSpec>,
    inbox: RingSpec,
    _charge: KeptDescriptor,
}

/// An SRQ's segment (created with the switch on): receive grants of QPs
/// taking their receives from it hand it out.
struct KeptSrq {
    ctx: ContextId,
    fd: SegmentFd,
    len: u64,
    ring: RingSpec,
    _charge: KeptDescriptor,
}

/// A CQ's segment (created with the switch on): receive grants of QPs
/// completing there hand it out, so that the requester marks the CQ's
/// ready set and, with a channel, takes the armed word itself.
struct KeptCq {
    ctx: ContextId,
    fd: SegmentFd,
    len: u64,
    ring: RingSpec,
    _charge: KeptDescriptor,
}

/// The direct path's shared state, owned by the engine thread.
#[derive(Default)]
pub struct DirectDriver {
    /// The daemon's `direct.enabled`.
    pub enabled: bool,
    regions: HashMap<u32, Region>,
    windows: HashMap<u32, Window>,
    qps: HashMap<u32, QpSegment>,
    cqs: HashMap<u32, KeptCq>,
    srqs: HashMap<u32, KeptSrq>,
}

impl DirectDriver {
    /// Keeps the memfd of a region just registered, if grants may need it.
    pub fn keep_region(
        &mut self,
        ctx: ContextId,
        key: u32,
        fd: OwnedFd,
        fd_offset: u64,
        charge: KeptDescriptor,
    ) {
        if self.enabled {
            self.regions.insert(key, Region { ctx, fd, fd_offset, _charge: charge });
        }
    }

    /// Forgets the descriptors of a deregistered region.
    pub fn forget_region(&mut self, key: u32) {
        self.regions.remove(&key);
    }

    /// Keeps the segment of a QP created with an inbox.
    #[allow(clippy::too_many_arguments)]
    pub fn keep_qp(
        &mut self,
        ctx: ContextId,
        qpn: u32,
        fd: SegmentFd,
        len: u64,
        rq: Option<RingSpec>,
        inbox: RingSpec,
        charge: KeptDescriptor,
    ) {
        if self.enabled {
            self.qps.insert(qpn, QpSegment { ctx, fd, len, rq, inbox, _charge: charge });
        }
    }

    pub fn forget_qp(&mut self, qpn: u32) {
        self.qps.remove(&qpn);
    }

    /// Keeps the segment of a CQ.
    pub fn keep_cq(
        &mut self,
        ctx: ContextId,
        cqn: u32,
        fd: SegmentFd,
        len: u64,
        ring: RingSpec,
        charge: KeptDescriptor,
    ) {
        if self.enabled {
            self.cqs.insert(cqn, KeptCq { ctx, fd, len, ring, _charge: charge });
        }
    }

    pub fn forget_cq(&mut self, cqn: u32) {
        self.cqs.remove(&cqn);
    }

    /// Keeps the segment of an SRQ.
    pub fn keep_srq(
        &mut self,
        ctx: ContextId,
        srqn: u32,
        fd: SegmentFd,
        len: u64,
        ring: RingSpec,
        charge: KeptDescriptor,
    ) {
        if self.enabled {
            self.srqs.insert(srqn, KeptSrq { ctx, fd, len, ring, _charge: charge });
        }
    }

    pub fn forget_srq(&mut self, srqn: u32) {
        self.srqs.remove(&srqn);
    }

    /// Forgets the descriptors of every region, QP and CQ of a closed
    /// context.
    pub fn forget_context(&mut self, ctx: ContextId) {
        self.regions.retain(|_, r| r.ctx != ctx);
        self.qps.retain(|_, q| q.ctx != ctx);
        self.cqs.retain(|_, q| q.ctx != ctx);
        self.srqs.retain(|_, q| q.ctx != ctx);
    }

    /// The doorbell (the daemon's end, duplicated) of the completion
    /// channel of `ctx`'s CQ `cq`: the library raises the CQ's events for
    /// the completions it queues itself. Nothing is kept for it.
    pub fn channel_bell(&self, rings: &RingTable, ctx: ContextId, cq: u32) -> Result<OwnedFd, DirectRefusal> {
        if !self.enabled {
            return Err(DirectRefusal::Off);
        }
        let ch = rings.cqs.get(&cq).and_then(|r| r.channel).ok_or(DirectRefusal::NotGranted)?;
        let ch = rings.channels.get(&ch).filter(|c| c.ctx == ctx).ok_or(DirectRefusal::NotGranted)?;
        ch.fd.as_fd().try_clone_to_owned().map_err(|_| DirectRefusal::NotNow)
    }

    /// Windows open now.
    pub fn windows(&self) -> usize {
        self.windows.len()
    }

    /// Descriptors kept now (regions, QP, SRQ and CQ segments, windows).
    pub fn kept(&self) -> usize {
        self.regions.len() + self.qps.len() + self.windows.len() + self.srqs.len() + self.cqs.len()
    }

    /// A grant of `ctx`'s QP `qp` on its peer's region `rkey`, with the
    /// descriptors to send (the window's first, when new). `charge` pays
    /// for a new window page; without it a grant that needs one is
    /// refused `NotNow` (the tenant holds its share of descriptors).
    pub fn grant(
        &mut self,
        hca: &mut Hca,
        ctx: ContextId,
        qp: u32,
        rkey: u32,
        charge: Option<KeptDescriptor>,
    ) -> Result<(DirectGranted, Vec<OwnedFd>), DirectRefusal> {
        if !self.enabled {
            return Err(DirectRefusal::Off);
        }
        let g = hca.direct_grant(ctx, qp, rkey)?;
        let region = self.regions.get(&rkey).ok_or(DirectRefusal::NotGranted)?;
        let region_fd = region.fd.try_clone().map_err(|_| DirectRefusal::NotNow)?;
        let fd_offset = region.fd_offset;
        let mut fds = Vec::with_capacity(2);
        let window_len = self.ensure_window(qp, g.new_window, charge, &mut fds)?;
        let w = &self.windows[&qp];
        let slot = w.words.word(DIRECT_WINDOW_SLOTS + g.slot as usize).ok_or(DirectRefusal::Full)?;
        slot.store(g.generation, Ordering::SeqCst);
        fds.push(region_fd);
        debug_assert!(w.seg.len() >= direct_window_bytes());
        Ok((
            DirectGranted {
                responder: g.responder,
                addr: g.addr,
                len: g.len,
                fd_offset,
                rights: g.rights,
                slot: g.slot,
                generation: g.generation,
                window_len,
            },
            fds,
        ))
    }

    /// The window page of `qp`, made (and its fd pushed to `fds`) if the
    /// core just made the window or the driver has none; its length when
    /// made, else 0.
    fn ensure_window(
        &mut self,
        qp: u32,
        new: bool,
        charge: Option<KeptDescriptor>,
        fds: &mut Vec<OwnedFd>,
    ) -> Result<u64, DirectRefusal> {
        if !new && self.windows.contains_key(&qp) {
            return Ok(0);
        }
        // Without a descriptor to spare the core's window stays without a
        // page; the next grant (after the library's pause) makes it.
        let charge = charge.ok_or(DirectRefusal::NotNow)?;
        let seg = Segment::create("vrdma-direct-window", direct_window_bytes())
            .map(Arc::new)
            .map_err(|_| DirectRefusal::NotNow)?;
        let fd = seg.try_clone_fd().map_err(|_| DirectRefusal::NotNow)?;
        let words = WordPage::of_segment(seg.clone());
        words.word(DIRECT_WINDOW_OPEN).expect("in the page").store(1, Ordering::SeqCst);
        let len = seg.len() as u64;
        fds.push(fd);
        self.windows.insert(qp, Window { seg, words, _charge: charge });
        Ok(len)
    }

    /// A receive grant of `ctx`'s QP `qp` (RDMA writes with immediate),
    /// with the descriptors to send: the window's first when new, then
    /// the responder's QP segment (its receive queue and inbox), its
    /// SRQ's segment if it has one, its receive CQ's segment, and that
    /// CQ's channel's doorbell if it has one.
    pub fn grant_recv(
        &mut self,
        hca: &mut Hca,
        rings: &RingTable,
        ctx: ContextId,
        qp: u32,
        charge: Option<KeptDescriptor>,
    ) -> Result<(DirectRecvGranted, Vec<OwnedFd>), DirectRefusal> {
        if !self.enabled {
            return Err(DirectRefusal::Off);
        }
        let g = hca.direct_grant_recv(ctx, qp)?;
        // A responder without an inbox (made before the switch, or not
        // RC), or whose receive CQ was not kept (made before the switch, or
        // no descriptor to spare: its ready set cannot be marked): not for
        // this QP.
        let q = self.qps.get(&g.responder).ok_or(DirectRefusal::NotGranted)?;
        let cq = rings.cqs.get(&g.recv_cq).ok_or(DirectRefusal::NotGranted)?;
        let cq_depth = cq.ring.capacity();
        let kept = self.cqs.get(&g.recv_cq).ok_or(DirectRefusal::NotGranted)?;
        let bell = match cq.channel {
            None => None,
            Some(ch) => {
                let ch = rings.channels.get(&ch).ok_or(DirectRefusal::NotGranted)?;
                Some(ch.fd.as_fd().try_clone_to_owned().map_err(|_| DirectRefusal::NotNow)?)
            }
        };
        let cq_fd = kept.fd.try_clone().map_err(|_| DirectRefusal::NotNow)?;
        let (cq_segment_len, cq_ring) = (kept.len, kept.ring);
        let qp_fd = q.fd.try_clone().map_err(|_| DirectRefusal::NotNow)?;
        let (qp_segment_len, inbox) = (q.len, q.inbox);
        // The receive queue: the QP's own, or its SRQ's (kept when made
        // with the switch on; else not for this QP).
        let (rq, srq) = match (g.srq, q.rq) {
            (None, Some(rq)) => (rq, None),
            (Some(s), None) => {
                let k = self.srqs.get(&s).ok_or(DirectRefusal::NotGranted)?;
                (k.ring, Some((k.fd.try_clone().map_err(|_| DirectRefusal::NotNow)?, k.len)))
            }
            _ => return Err(DirectRefusal::NotGranted),
        };
        let mut fds = Vec::with_capacity(5);
        let window_len = self.ensure_window(qp, g.new_window, charge, &mut fds)?;
        let word = self.windows[&qp].words.word(DIRECT_WINDOW_RECV).ok_or(DirectRefusal::NotNow)?;
        word.store(g.generation, Ordering::SeqCst);
        fds.push(qp_fd);
        let mut srq_segment_len = 0;
        if let Some((fd, len)) = srq {
            fds.push(fd);
            srq_segment_len = len;
        }
        fds.push(cq_fd);
        let channel = bell.is_some();
        if let Some(bell) = bell {
            fds.push(bell);
        }
        Ok((
            DirectRecvGranted {
                responder: g.responder,
                generation: g.generation,
                window_len,
                qp_segment_len,
                rq,
                inbox,
                cq_depth,
                lid: g.lid,
                max_recv_sge: g.max_recv_sge,
                cq_segment_len,
                cq_ring,
                srq_segment_len,
                channel,
            },
            fds,
        ))
    }

    /// Applies what the core revoked since the last call; returns the
    /// pages whose copies in flight the caller must wait out (with
    /// [`drain`]) before it answers the operation that revoked them.
    pub fn sync(&mut self, hca: &mut Hca) -> Vec<WordPage> {
        let revoked = hca.direct_revocations();
        let mut wait = Vec::new();
        for r in revoked {
            match r {
                Revocation::Window { requester } => {
                    if let Some(w) = self.windows.remove(&requester) {
                        if let Some(open) = w.words.word(DIRECT_WINDOW_OPEN) {
                            open.store(0, Ordering::SeqCst);
                        }
                        wait.push(w.words);
                    }
                }
                Revocation::Recv { requester } => {
                    if let Some(w) = self.windows.get(&requester) {
                        if let Some(word) = w.words.word(DIRECT_WINDOW_RECV) {
                            word.store(0, Ordering::SeqCst);
                        }
                        wait.push(w.words.clone());
                    }
                }
                Revocation::Slot { requester, slot } => {
                    if let Some(w) = self.windows.get(&requester) {
                        if let Some(word) = w.words.word(DIRECT_WINDOW_SLOTS + slot as usize) {
                            word.store(0, Ordering::SeqCst);
                        }
                        wait.push(w.words.clone());
                    }
                }
            }
        }
        wait
    }
}

/// Waits until no copy is in flight in any of `pages`, at most
/// [`DRAIN_LIMIT`] in all; says whether they drained.
pub fn drain(pages: &[WordPage]) -> bool {
    let start = Instant::now();
    for p in pages {
        let Some(inflight) = p.word(DIRECT_WINDOW_INFLIGHT) else { continue };
        let mut spins = 0u32;
        while inflight.load(Ordering::SeqCst) != 0 {
            if start.elapsed() > DRAIN_LIMIT {
                tracing::warn!(
                    "a direct-path window kept copies in flight past {DRAIN_LIMIT:?} (its process stopped or died in one)"
                );
                return false;
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
    true
}
