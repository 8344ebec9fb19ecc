//! Completion queues.

use rustc_hash::FxHashMap as HashMap;
use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vrdma_core::proto::{self, Reply, Request};
use vrdma_core::ring::{Cqe, CQE_SIZE};
use vrdma_core::verbs::{WcOpcode, WcStatus};
use vrdma_shm::RingView;

use crate::channel::CompletionChannel;
use crate::context::Context;
use crate::control;
use crate::direct_ready::{ReadySet, Served};
use crate::error::{Error, Result};
use crate::idle::{self, Peer};
use crate::stream::CompletionStream;

/// A work completion (`ibv_wc`), as the daemon reports it.
pub type WorkCompletion = Cqe;

/// How many empty polls in a row a CQ spins before every further empty
/// poll yields the CPU (see [`crate::idle`]): `VRDMA_POLL_SPIN`, else 4 on
/// a machine with two cores or fewer (where the engine needs the CPU the
/// poller holds) and 1024 where cores are to spare.
pub fn spin_polls() -> u32 {
    crate::idle::policy().spin_polls
}

fn blank() -> WorkCompletion {
    Cqe::new(0, WcStatus::Success, WcOpcode::Send, 0)
}

/// `n` placeholder completions, a buffer for [`CompletionQueue::poll`].
pub fn wc_buffer(n: usize) -> Vec<WorkCompletion> {
    vec![blank(); n]
}

/// `N` placeholder completions on the stack: a buffer for
/// [`CompletionQueue::poll`] on a path that polls often (no allocation).
pub fn wc_array<const N: usize>() -> [WorkCompletion; N] {
    [blank(); N]
}

/// A completion queue (`ibv_cq`).
///
/// Polling reads the shared ring directly, without a system call. Cheap
/// to clone; destroyed when the last clone and the last QP using it are
/// gone.
#[derive(Clone, Debug)]
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
}

#[derive(Debug)]
pub(crate) struct CqInner {
    pub(crate) ctx: Context,
    pub(crate) cqn: u32,
    depth: u32,
    ring: RingView,
    pub(crate) channel: Option<CompletionChannel>,
    /// Consecutive empty polls, for the spin-then-yield rule.
    empty_polls: AtomicU32,
    /// The last poll that found anything found only completions of the
    /// direct path (the local queue, inboxes): the next ones will most
    /// likely come from a program, not the engine, so empty polls may spin
    /// longer before they yield ([`crate::idle::DIRECT_SPIN_POLLS`]).
    direct_fed: std::sync::atomic::AtomicBool,
    /// The send queues completing here, by QP number: how many of each
    /// QP's send WRs the polled completions have freed.
    send_queues: Mutex<HashMap<u32, Arc<SendSlots>>>,
    /// Completions of WRs this process carried itself (the direct path),
    /// polled before the ring: a QP takes the direct path only while none
    /// of its WRs is unpolled in the ring, so its own completions keep
    /// their order (see `docs/direct-path.md`). They count against the
    /// CQ's depth with the ring's entries: their number is published in
    /// the ring's [`proto::CQ_AUX_LOCAL`] word, which the engine reads
    /// before it pushes.
    local: Mutex<std::collections::VecDeque<LocalWc>>,
    local_len: std::sync::atomic::AtomicUsize,
    /// The inboxes of the QPs whose receives complete here (the direct
    /// path on): completions a direct-path requester pushed for receives
    /// it claimed. Polled after the local queue and before the ring: a
    /// requester claims a QP's receive only while every receive
    /// completion of the QP the engine pushed into the ring was polled
    /// (counted in the inbox's [`proto::INBOX_AUX_ENGINE_PUSHED`] and
    /// [`proto::INBOX_AUX_ENGINE_POLLED`] words), and those pushed after it
    /// wait behind the inbox (`docs/direct-path.md`). Their entries count
    /// against the depth (the engine adds them up before it pushes).
    /// Found through the CQ ring's ready set ([`crate::direct_ready`]):
    /// a poll looks at the inboxes of the buckets a requester marked, not
    /// at every QP's.
    inboxes: std::sync::RwLock<Inboxes>,
    inbox_count: std::sync::atomic::AtomicUsize,
    /// Where the next scan of the ready set starts (fairness: the bucket
    /// after the last one served).
    ready_next: AtomicU32,
    /// The ready-set bucket whose inboxes the last poll that found
    /// anything there took completions from ([`NO_BUCKET`]: none yet):
    /// whose requester the poller is most likely waiting for.
    last_fed: AtomicU32,
    /// The doorbell of the CQ's completion channel (the daemon's end),
    /// asked for once the direct path first completes here; `None`: not
    /// granted (the direct path then leaves this CQ's QPs to the engine).
    bell: std::sync::OnceLock<Option<vrdma_shm::Doorbell>>,
}

/// No ready-set bucket (see `CqInner::last_fed`).
const NO_BUCKET: u32 = u32::MAX;

/// The inboxes of a CQ's QPs, by ready-set bucket
/// ([`proto::cq_ready_bucket`] of the QP's number): a bucket holds one QP
/// unless more than [`proto::CQ_READY_BUCKETS`] receive here.
#[derive(Debug, Default)]
pub(crate) struct Inboxes {
    by_bucket: HashMap<u32, Vec<(u32, Arc<RingView>)>>,
}

impl Inboxes {
    fn bucket(&self, bucket: u32) -> &[(u32, Arc<RingView>)] {
        self.by_bucket.get(&bucket).map_or(&[], Vec::as_slice)
    }

    fn get(&self, qpn: u32) -> Option<&Arc<RingView>> {
        self.bucket(proto::cq_ready_bucket(qpn)).iter().find(|(q, _)| *q == qpn).map(|(_, r)| r)
    }
}

/// A send queue's slot counts, shared by its QP (which admits WRs) and
/// its send CQ (whose polls free them).
#[derive(Debug, Default)]
pub(crate) struct SendSlots {
    /// Engine-path WRs whose slots are free again: those covered by polled
    /// completions, or dropped by a reset (in the ring's producer numbering).
    pub(crate) freed: AtomicU32,
    /// WRs the direct path carried (free-running).
    pub(crate) carried: AtomicU32,
    /// Carried WRs whose slots are free again: up to a polled local
    /// completion's number, or all carried before a polled engine
    /// completion of the QP (an unsignaled WR's slot is freed by a later
    /// signaled completion, as on hardware).
    pub(crate) carried_freed: AtomicU32,
}

impl SendSlots {
    /// Carried WRs still holding a slot.
    pub(crate) fn carried_outstanding(&self) -> u32 {
        self.carried.load(Ordering::Acquire).wrapping_sub(self.carried_freed.load(Ordering::Acquire))
    }
}

/// A completion in a CQ's local queue; a send completion frees its QP's
/// carried WRs up to `seq` when polled.
#[derive(Debug)]
pub(crate) struct LocalWc {
    pub(crate) wc: WorkCompletion,
    pub(crate) frees: Option<(Arc<SendSlots>, u32)>,
}

impl Drop for CqInner {
    fn drop(&mut self) {
        self.ctx.inner.control.destroy(Request::DestroyCq { cq: self.cqn });
        if let Some(ch) = &self.channel {
            ch.inner.cqs.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl CqInner {
    /// Pops up to `out.len()` completions, without the spin accounting.
    pub(crate) fn poll_raw(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let mut slot = [0u8; CQE_SIZE];
        // The latest count per QP in this batch (completions of one QP come
        // in order, so the last is the highest); on the stack, as polling
        // never allocates. More QPs in one batch than it holds: it is
        // applied and starts again.
        let mut freed = [(0u32, 0u32); 8];
        let mut held = 0;
        let mut n = 0;
        if self.local_len.load(Ordering::Acquire) > 0 {
            let mut local = self.local.lock().unwrap_or_else(|p| p.into_inner());
            while n < out.len() {
                let Some(c) = local.pop_front() else { break };
                out[n] = c.wc;
                n += 1;
                if let Some((slots, seq)) = c.frees {
                    advance(&slots.carried_freed, seq);
                }
            }
            self.publish_local(local.len());
        }
        let inboxes = self.inbox_count.load(Ordering::Acquire) > 0;
        if inboxes {
            n += self.poll_inboxes(&mut out[n..]);
        }
        let from_ring = n;
        while n < out.len() {
            match self.ring.try_pop(&mut slot) {
                Ok(true) => {}
                Ok(false) => break,
                // What was taken counts: its slots are freed, and it is
                // returned; the error comes with the next poll.
                Err(_) if n > 0 => break,
                Err(e) => return Err(e.into()),
            }
            out[n] = Cqe::decode(&slot);
            n += 1;
            let Some(retired) = Cqe::sq_retired(&slot) else { continue };
            let qpn = out[n - 1].qp_num;
            if let Some(f) = freed[..held].iter_mut().find(|(q, _)| *q == qpn) {
                f.1 = retired;
                continue;
            }
            if held == freed.len() {
                self.free_send_slots(&freed[..held]);
                held = 0;
            }
            freed[held] = (qpn, retired);
            held += 1;
        }
        self.free_send_slots(&freed[..held]);
        // Only receive completions taken from the ring count (and the
        // inboxes' lock is not taken for a poll that took none there).
        if inboxes && n > from_ring {
            self.polled_from_ring(&out[from_ring..n]);
        }
        if n > 0 {
            let direct = n == from_ring;
            if self.direct_fed.load(Ordering::Relaxed) != direct {
                self.direct_fed.store(direct, Ordering::Relaxed);
            }
        }
        Ok(n)
    }

    /// Pops what the marked inboxes hold into `out`; how many. An empty
    /// poll reads the ready set's summary word and nothing else.
    fn poll_inboxes(&self, out: &mut [WorkCompletion]) -> usize {
        let set = ReadySet::of(&self.ring);
        if out.is_empty() || !set.any() {
            return 0;
        }
        let mut slot = [0u8; CQE_SIZE];
        let mut n = 0;
        let mut fed = NO_BUCKET;
        let inboxes = self.inboxes.read().unwrap_or_else(|p| p.into_inner());
        let start = self.ready_next.load(Ordering::Relaxed);
        let next = set.scan(start, |bucket| {
            let mut emptied = true;
            for (_, inbox) in inboxes.bucket(bucket) {
                let before = n;
                loop {
                    if n == out.len() {
                        emptied = false;
                        break;
                    }
                    if !matches!(inbox.try_pop(&mut slot), Ok(true)) {
                        break;
                    }
                    out[n] = Cqe::decode(&slot);
                    n += 1;
                }
                if n > before {
                    fed = bucket;
                }
            }
            Served { emptied, room: n < out.len() }
        });
        self.ready_next.store(next, Ordering::Relaxed);
        if fed != NO_BUCKET && self.last_fed.load(Ordering::Relaxed) != fed {
            self.last_fed.store(fed, Ordering::Relaxed);
        }
        n
    }

    /// Counts receive completions of QPs with an inbox polled from the
    /// ring (see `inboxes`).
    fn polled_from_ring(&self, wcs: &[WorkCompletion]) {
        let inboxes = self.inboxes.read().unwrap_or_else(|p| p.into_inner());
        for wc in wcs.iter().filter(|w| w.opcode.is_recv()) {
            if let Some(inbox) = inboxes.get(wc.qp_num) {
                inbox.aux(proto::INBOX_AUX_ENGINE_POLLED).fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    /// Where the program that last completed into this CQ's inboxes
    /// (those of the bucket the last poll took inbox completions from;
    /// `INBOX_AUX_REQUESTER_CPU`) last ran, beside our CPU: `Here` when one
    /// ran on ours, `Elsewhere` when all known ran on others.
    fn peer_cpu(&self) -> Peer {
        if self.inbox_count.load(Ordering::Acquire) == 0 {
            return Peer::Unknown;
        }
        let fed = self.last_fed.load(Ordering::Relaxed);
        if fed == NO_BUCKET {
            return Peer::Unknown;
        }
        let me = crate::idle::current_cpu_word();
        let inboxes = self.inboxes.read().unwrap_or_else(|p| p.into_inner());
        let mut peer = Peer::Unknown;
        for (_, inbox) in inboxes.bucket(fed) {
            match inbox.aux(proto::INBOX_AUX_REQUESTER_CPU).load(Ordering::Relaxed) {
                0 => {}
                cpu if cpu == me => return Peer::Here,
                _ => peer = Peer::Elsewhere,
            }
        }
        peer
    }

    /// Entries the inboxes of the marked buckets hold (they count against
    /// the depth). An inbox holds entries only while its bucket is marked,
    /// except between a requester's push and its mark, and between a
    /// poller's clearing of the mark and its drain (another thread's poll
    /// of this CQ): the check is then short by what those hold, as it is
    /// already racy against the engine (`docs/direct-path.md`).
    fn inbox_entries(&self) -> usize {
        if self.inbox_count.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let set = ReadySet::of(&self.ring);
        if !set.any() {
            return 0;
        }
        let inboxes = self.inboxes.read().unwrap_or_else(|p| p.into_inner());
        let mut held = 0usize;
        set.for_each_set(|bucket| {
            for (_, r) in inboxes.bucket(bucket) {
                held = held.saturating_add(r.len().unwrap_or(0) as usize);
            }
        });
        held
    }

    /// Polls `qpn`'s inbox from now on (a QP created with the direct path
    /// on, whose receives complete here).
    pub(crate) fn add_inbox(&self, qpn: u32, inbox: Arc<RingView>) {
        let mut inboxes = self.inboxes.write().unwrap_or_else(|p| p.into_inner());
        inboxes.by_bucket.entry(proto::cq_ready_bucket(qpn)).or_default().push((qpn, inbox));
        self.inbox_count.fetch_add(1, Ordering::Release);
    }

    /// Stops polling `qpn`'s inbox (the QP is destroyed); what it still
    /// holds moves to the local queue, as the ring keeps a destroyed
    /// QP's completions.
    pub(crate) fn remove_inbox(&self, qpn: u32) {
        let mut inboxes = self.inboxes.write().unwrap_or_else(|p| p.into_inner());
        let bucket = proto::cq_ready_bucket(qpn);
        let Some(list) = inboxes.by_bucket.get_mut(&bucket) else { return };
        let Some(i) = list.iter().position(|(q, _)| *q == qpn) else { return };
        let (_, inbox) = list.swap_remove(i);
        if list.is_empty() {
            inboxes.by_bucket.remove(&bucket);
        }
        self.inbox_count.fetch_sub(1, Ordering::Release);
        drop(inboxes);
        let mut slot = [0u8; CQE_SIZE];
        while matches!(inbox.try_pop(&mut slot), Ok(true)) {
            self.push_local(Cqe::decode(&slot), None);
        }
    }

    /// Moves the freed-slot counts of the QPs in `freed`.
    fn free_send_slots(&self, freed: &[(u32, u32)]) {
        if freed.is_empty() {
            return;
        }
        let queues = self.send_queues.lock().unwrap_or_else(|p| p.into_inner());
        for (qpn, retired) in freed {
            if let Some(q) = queues.get(qpn) {
                // WRs are carried only while the engine has nothing of the
                // QP unpolled, so an engine completion that frees anything
                // (not one from before a reset) is of a WR posted after
                // every carried one: it frees them all. Carried first: a
                // WR carried once `freed` moves is after this completion.
                let carried = q.carried.load(Ordering::Acquire);
                if is_ahead(&q.freed, *retired) {
                    advance(&q.carried_freed, carried);
                }
                advance(&q.freed, *retired);
            }
        }
    }

    /// Publishes the local queue's length (called holding its lock).
    /// `Release`, not `SeqCst`: the engine's overrun check reads the word
    /// as a count, with no store of its own that this store must be
    /// ordered against (the check and this library's `has_room` are not
    /// one atomic step either way: `docs/direct-path.md`, "Queue
    /// limits"), and a `SeqCst` store is a locked instruction, twice per
    /// carried signaled WR (its push and its poll).
    fn publish_local(&self, len: usize) {
        self.local_len.store(len, Ordering::Release);
        let len = u32::try_from(len).unwrap_or(u32::MAX);
        self.ring.aux(proto::CQ_AUX_LOCAL).store(len, Ordering::Release);
    }

    /// Whether one more completion fits: the ring's entries and the local
    /// queue's together below the depth. (The engine checks the same sum
    /// before it pushes; see `docs/direct-path.md` for the one race left.)
    pub(crate) fn has_room(&self) -> bool {
        let ring = self.ring.len().unwrap_or(self.depth);
        let direct_in = self.inbox_entries();
        (ring as usize).saturating_add(self.local_len.load(Ordering::Acquire)).saturating_add(direct_in)
            < self.depth as usize
    }

    /// Queues a completion of a WR carried by the direct path.
    pub(crate) fn push_local(&self, wc: WorkCompletion, frees: Option<(Arc<SendSlots>, u32)>) {
        let mut local = self.local.lock().unwrap_or_else(|p| p.into_inner());
        local.push_back(LocalWc { wc, frees });
        self.publish_local(local.len());
    }

    /// Whether the CQ reports to a completion channel.
    pub(crate) fn has_channel(&self) -> bool {
        self.channel.is_some()
    }

    /// The channel's doorbell for events the direct path raises, asked
    /// for on first use (`None`: no channel, or not granted).
    pub(crate) fn direct_bell(&self) -> Option<&vrdma_shm::Doorbell> {
        self.channel.as_ref()?;
        self.bell
            .get_or_init(|| {
                let req = Request::DirectChannel { cq: self.cqn };
                let answer = self.ctx.inner.control.call(&req, &[]).ok()?;
                if !matches!(answer.reply, Reply::DirectChannel) {
                    return None;
                }
                let fd = answer.take_fds(1, "DirectChannel").ok()?.pop()?;
                Some(vrdma_shm::Doorbell::from_fd(fd))
            })
            .as_ref()
    }

    /// Raises the CQ's event, if armed for it, for a completion the direct
    /// path just queued (with the doorbell from
    /// [`direct_bell`](Self::direct_bell)).
    pub(crate) fn raise_direct(&self, bell: &vrdma_shm::Doorbell, solicited: bool, success: bool) {
        raise_event(&self.ring, bell, solicited, success);
    }

    /// Where the programs writing this CQ's completions last ran, when its
    /// last completions came from the direct path (`Unknown` otherwise): a
    /// waiter for its next one spins or yields by it ([`idle::spin_limit`]).
    pub(crate) fn peer(&self) -> Peer {
        if self.direct_fed.load(Ordering::Relaxed) {
            self.peer_cpu()
        } else {
            Peer::Unknown
        }
    }

    /// This CQ's [`proto::CQ_AUX_WAITER`] word.
    pub(crate) fn waiter(&self) -> &AtomicU32 {
        self.ring.aux(proto::CQ_AUX_WAITER)
    }

    /// Whether the direct path raised an event for this CQ that no one
    /// took yet (a look; [`take_direct_event`](Self::take_direct_event)
    /// takes it).
    pub(crate) fn has_direct_event(&self) -> bool {
        self.ring.aux(proto::CQ_AUX_DIRECT_EVENTS).load(Ordering::Acquire) != 0
    }

    /// Takes one event the direct path raised for this CQ, if any.
    pub(crate) fn take_direct_event(&self) -> bool {
        self.ring
            .aux(proto::CQ_AUX_DIRECT_EVENTS)
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    /// Frees the send slots of `qpn` as its completions are polled.
    pub(crate) fn add_send_queue(&self, qpn: u32, freed: Arc<SendSlots>) {
        self.send_queues.lock().unwrap_or_else(|p| p.into_inner()).insert(qpn, freed);
    }

    pub(crate) fn remove_send_queue(&self, qpn: u32) {
        self.send_queues.lock().unwrap_or_else(|p| p.into_inner()).remove(&qpn);
    }

    /// Arms the CQ, then fences so that a following poll cannot be
    /// ordered before the arming (the race rule: arm, poll, then sleep).
    pub(crate) fn arm(&self, solicited_only: bool) {
        let how = if solicited_only { proto::CQ_ARM_SOLICITED } else { proto::CQ_ARM_NEXT };
        self.ring.aux(proto::CQ_AUX_ARMED).store(how, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }
}

/// The engine's `notify_channel` for a completion the direct path pushed
/// (into a CQ's local queue or a QP's inbox) just before: the armed word,
/// read after a fence, is taken with a compare-and-swap, so whichever of
/// the engine and the direct path completes first after an arming raises
/// the one event; the event is counted in the CQ's
/// [`proto::CQ_AUX_DIRECT_EVENTS`] word, then one datagram rung on the
/// channel's doorbell (what the engine does with its ring slot).
pub(crate) fn raise_event(cq_ring: &RingView, bell: &vrdma_shm::Doorbell, solicited: bool, success: bool) {
    let armed = cq_ring.aux(proto::CQ_AUX_ARMED);
    fence(Ordering::SeqCst);
    let a = armed.load(Ordering::SeqCst);
    if !proto::arm_fires(a, solicited, success) {
        return;
    }
    if armed.compare_exchange(a, proto::CQ_ARM_NONE, Ordering::SeqCst, Ordering::SeqCst).is_err() {
        return;
    }
    cq_ring.aux(proto::CQ_AUX_DIRECT_EVENTS).fetch_add(1, Ordering::SeqCst);
    // The owner is looking for it in shared memory: no wake-up needed
    // (`channel.rs`, "Quiet events").
    if proto::claim_quiet_event(cq_ring.aux(proto::CQ_AUX_WAITER)) {
        return;
    }
    if !bell.ring_one() {
        // The owner's end is gone or full: the event is there, its wake-up
        // is not (as the engine's).
        tracing::debug!("completion channel doorbell full: wake-up lost");
    }
}

/// Whether `to` is ahead of the free-running `count`.
fn is_ahead(count: &AtomicU32, to: u32) -> bool {
    (to.wrapping_sub(count.load(Ordering::Acquire)) as i32) > 0
}

/// Moves a free-running count forward to `to`, never back: completions
/// polled out of order by racing threads, or after a reset moved it on,
/// must not undo a later count.
pub(crate) fn advance(count: &AtomicU32, to: u32) {
    if !is_ahead(count, to) {
        return;
    }
    let _ = count.fetch_update(Ordering::Release, Ordering::Relaxed, |now| {
        ((to.wrapping_sub(now) as i32) > 0).then_some(to)
    });
}

impl CompletionQueue {
    pub(crate) fn create(
        ctx: &Context,
        cqe: u32,
        channel: Option<&CompletionChannel>,
    ) -> Result<CompletionQueue> {
        if let Some(ch) = channel {
            if !Arc::ptr_eq(&ch.inner.ctx.inner, &ctx.inner) {
                return Err(Error::invalid("the completion channel belongs to another context"));
            }
        }
        let req = Request::CreateCq { cqe, channel: channel.map(|c| c.channel_id()) };
        let answer = ctx.inner.control.call(&req, &[])?;
        let Reply::Cq { cq, depth, segment_len, ring } = answer.reply else {
            return Err(control::unexpected(&req, &answer.reply));
        };
        let placed = answer
            .take_rings(1, "Cq")
            .and_then(|mut p| p.pop().ok_or_else(|| Error::protocol("Cq reply lacks its descriptor")));
        CompletionQueue::from_reply(ctx, channel, (cq, depth, segment_len, ring), placed)
    }

    /// The CQ the daemon made (`cq`, `depth`, `segment_len`, `ring` as
    /// `Reply::Cq` says them; its segment `placed`), set up here; on
    /// failure the daemon's CQ is destroyed.
    pub(crate) fn from_reply(
        ctx: &Context,
        channel: Option<&CompletionChannel>,
        (cq, depth, segment_len, ring): (u32, u32, u64, vrdma_core::proto::RingSpec),
        placed: Result<control::Placed>,
    ) -> Result<CompletionQueue> {
        // From here on a failure must still destroy the daemon's CQ.
        let setup = (|| -> Result<RingView> {
            let seg = placed?.segment(segment_len, "CQ segment length")?;
            if ring.stride as usize != CQE_SIZE {
                return Err(Error::protocol(format!(
                    "CQ slots of {} bytes, expected {CQE_SIZE}",
                    ring.stride
                )));
            }
            Ok(RingView::in_segment(
                seg,
                control::to_usize(ring.offset, "CQ ring offset")?,
                ring.capacity,
                CQE_SIZE,
            )?)
        })();
        let ring = match setup {
            Ok(r) => r,
            Err(e) => {
                ctx.inner.control.destroy(Request::DestroyCq { cq });
                return Err(e);
            }
        };
        if let Some(ch) = channel {
            ch.inner.cqs.fetch_add(1, Ordering::Relaxed);
        }
        let cq = CompletionQueue {
            inner: Arc::new(CqInner {
                ctx: ctx.clone(),
                cqn: cq,
                depth,
                ring,
                channel: channel.cloned(),
                empty_polls: AtomicU32::new(0),
                direct_fed: Default::default(),
                send_queues: Mutex::new(HashMap::default()),
                local: Mutex::default(),
                local_len: Default::default(),
                inboxes: Default::default(),
                inbox_count: Default::default(),
                ready_next: AtomicU32::new(0),
                last_fed: AtomicU32::new(NO_BUCKET),
                bell: Default::default(),
            }),
        };
        if let Some(ch) = channel {
            ch.inner.watch(&cq.inner);
        }
        Ok(cq)
    }

    /// The daemon's number for this CQ (what
    /// [`get_cq_event`](CompletionChannel::get_cq_event) returns).
    pub fn cqn(&self) -> u32 {
        self.inner.cqn
    }

    /// Entries the CQ holds (the requested size rounded up).
    pub fn depth(&self) -> u32 {
        self.inner.depth
    }

    /// The channel the CQ reports to, if any.
    pub fn channel(&self) -> Option<&CompletionChannel> {
        self.inner.channel.as_ref()
    }

    /// The context the CQ belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// `ibv_poll_cq`: moves up to `out.len()` completions into `out` and
    /// returns how many. Never blocks.
    ///
    /// Busy-polling loops are kind to small machines: after
    /// [`spin_polls`] consecutive empty polls of this CQ, every further
    /// empty poll yields the CPU (`sched_yield`) so that the daemon's
    /// engine, which produces the completions, can run (after
    /// [`DIRECT_SPIN_POLLS`](crate::idle::DIRECT_SPIN_POLLS) where the
    /// CQ's last completions came from the direct path, which needs no
    /// engine, written by a program on another CPU; at once where that
    /// program ran on this CPU, unless the CQ has a completion channel); on a machine with
    /// two cores or fewer, once the calling thread has found nothing and
    /// posted nothing for 200 µs, empty polls sleep briefly instead
    /// ([`crate::idle`] has the rule and its knobs). The count resets when a
    /// poll finds something.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        let n = self.inner.poll_raw(out)?;
        let empty = &self.inner.empty_polls;
        if n > 0 {
            crate::idle::activity();
            if empty.load(Ordering::Relaxed) != 0 {
                empty.store(0, Ordering::Relaxed);
            }
        } else {
            let count = empty.load(Ordering::Relaxed);
            // Completions the direct path writes: past the usual spin, spin
            // on only for a program on another CPU; for one on ours, yield
            // at once (`idle::DIRECT_SPIN_POLLS`), but for a CQ with a
            // completion channel. There the poll is the one before or after
            // arming, and a yield in it lets the peer complete while no
            // thread waits in `get_cq_event`: the event, if armed, then
            // costs the peer a doorbell, and an arming left standing (the
            // completion found by the poll after it) costs our own next
            // carried send one (measured: a second system call per message
            // in a same-CPU ping-pong; docs/direct-path.md, round 11).
            let peer = match self.inner.peer() {
                Peer::Here if self.inner.has_channel() => Peer::Unknown,
                p => p,
            };
            if count < idle::spin_limit(peer) {
                empty.store(count + 1, Ordering::Relaxed);
            }
            idle::wait_after_empty_poll(count, peer);
        }
        Ok(n)
    }

    /// Polls one completion.
    pub fn poll_one(&self) -> Result<Option<WorkCompletion>> {
        let mut wc = [blank()];
        Ok((self.poll(&mut wc)? == 1).then_some(wc[0]))
    }

    /// `ibv_req_notify_cq`: arms the CQ so that its next completion (with
    /// `solicited_only`: its next solicited or failed completion) raises an
    /// event on its channel. One event per arming.
    ///
    /// Poll again after arming: completions that arrived before the arming
    /// raise no event.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        if self.inner.channel.is_none() {
            return Err(Error::invalid("the CQ has no completion channel to notify"));
        }
        self.inner.arm(solicited_only);
        Ok(())
    }

    /// Blocks until at least one completion is available or `timeout`
    /// passes (`None`: no limit), then moves up to `out.len()` into `out`
    /// and returns how many (0: timed out). Fails, instead of waiting,
    /// once the daemon has gone away.
    ///
    /// Needs a completion channel that serves this CQ alone (events of
    /// other CQs would be consumed here); it uses the channel's events, so
    /// do not also call [`get_cq_event`](CompletionChannel::get_cq_event)
    /// on it.
    pub fn wait(&self, out: &mut [WorkCompletion], timeout: Option<Duration>) -> Result<usize> {
        let ch = self.dedicated_channel("wait")?;
        if out.is_empty() {
            return Ok(0);
        }
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let mut slot = ch.inner.slot_buf();
        loop {
            let n = self.inner.poll_raw(out)?;
            if n > 0 {
                return Ok(n);
            }
            self.inner.arm(false);
            let n = self.inner.poll_raw(out)?;
            if n > 0 {
                return Ok(n);
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left == Some(Duration::ZERO) {
                return Ok(0);
            }
            self.inner.ctx.inner.control.wait_readable(&ch.inner.core.event, left)?;
            // The events name this CQ only; the completions are polled above.
            while ch.inner.take_or_clean(&mut slot)?.is_some() {}
        }
    }

    /// An async stream of this CQ's completions for tokio (current-thread
    /// or multi-thread runtime, with I/O enabled). Must be called inside
    /// the runtime.
    ///
    /// Needs a completion channel. Several streams may share a channel
    /// (each watches its own CQ), but the stream consumes the channel's
    /// events, so do not mix it with
    /// [`get_cq_event`](CompletionChannel::get_cq_event) on that channel.
    pub fn stream(&self) -> Result<CompletionStream> {
        CompletionStream::new(self.clone())
    }

    fn dedicated_channel(&self, what: &str) -> Result<&CompletionChannel> {
        let ch =
            self.inner.channel.as_ref().ok_or_else(|| {
                Error::invalid(format!("{what} needs a CQ created with a completion channel"))
            })?;
        if ch.inner.cqs.load(Ordering::Relaxed) != 1 {
            return Err(Error::invalid(format!("{what} needs a completion channel serving this CQ alone")));
        }
        Ok(ch)
    }
}
