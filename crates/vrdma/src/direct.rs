//! The direct path's front end (`docs/direct-path.md`): RDMA writes, RDMA
//! reads and atomics that this library performs itself, on a peer QP's
//! region that the daemon granted, when the peer is a QP of the same
//! tenant on the same host.
//!
//! The library is trusted here exactly as far as the kernel already
//! trusts it: a process may read and write the memory of another process
//! of its uid, so a grant exposes nothing new. What the daemon still
//! decides is *whether* and *until when*: every grant is checked as the
//! engine checks each opcode (pair, key, PD, access: the grant's rights)
//! and lives in a window
//! page whose words the daemon clears before a deregistration, a state
//! change or a destruction returns. Around each copy this module
//! announces itself in the window's in-flight count, then reads the open
//! word and the grant's generation (`SeqCst` on both sides: either the
//! daemon sees the count or the copy sees the cleared word).
//!
//! Atomics use the engine's own word operations (`AtomicU64`
//! compare-exchange and fetch-add, `SeqCst`) on the same memfd pages, so
//! they are atomic against the engine's atomics on the same word.
//!
//! Whatever this module cannot prove it may do (another opcode, a key
//! it has no grant for or no right of the opcode on, an address outside
//! the region or a misaligned atomic, an lkey it does not know or may not
//! write, work of the QP still on the engine path) goes to the engine
//! unchanged, which then does what it always did, errors included: the
//! direct path never reports an error of its own.

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, RwLock};

use vrdma_core::hca::DirectRefusal;
use vrdma_core::proto::{
    DirectGranted, Reply, Request, DIRECT_WINDOW_INFLIGHT, DIRECT_WINDOW_OPEN, DIRECT_WINDOW_RECV,
    DIRECT_WINDOW_SLOTS,
};
use vrdma_core::ring::{RecvSlot, SendWr, Sge};
use vrdma_core::verbs::{AccessFlags, SendOpcode};
use vrdma_shm::{page_size, Mapping, WordPage};

use crate::context::Context;

/// Largest SEND (with or without immediate) the library copies itself;
/// larger ones take the engine path, which cuts them into chunks.
pub const DIRECT_MAX_BYTES: u64 = 64 << 10;

/// Largest RDMA write (with or without immediate) or RDMA read the library
/// copies itself: one `memcpy` straight into (or out of) the peer's
/// region, where the engine would make the same copy in 64 KiB turns
/// (`docs/direct-path.md`, "Large writes"). Bounded so that a revocation
/// waits on at most one such copy (about 0.1 ms, far below the daemon's
/// `DRAIN_LIMIT`); larger ones take the engine path.
pub const DIRECT_MAX_RDMA_BYTES: u64 = 1 << 20;

/// How long a SEND that finds the peer behind (no receive posted, or its
/// inbox as full as its CQ may be) waits for it to catch up before the WR
/// goes to the engine (whose RNR timer and retries, or overrun check, then
/// apply). A receiver reposting its receives as it polls is often a
/// moment behind a sender that copies as fast as memory allows; without
/// the wait one such moment sent the WR to the engine, and the order rule
/// kept the QP's next sends there until the engine's were polled, which a
/// stream with WRs always in flight never does (a 64 KiB send stream was
/// mostly the engine's). 10 ms, not less: on a loaded machine a receiver
/// is often off its CPU for milliseconds, and with 1 ms a 64 KiB stream
/// still fell to the engine in about half the runs. Never inside an
/// announced copy. Only the timing differs from sending to the engine at
/// once: hardware, too, delivers the message once a receive is posted
/// (after its RNR timer), and a stream's sender would wait as long for
/// its completions.
pub(crate) const RECV_WAIT: std::time::Duration = std::time::Duration::from_millis(10);

/// The regions of a PD registered in this process, by key: what a direct
/// write may read its local SGEs from, and a direct read or atomic write
/// its results into (those need `LOCAL_WRITE`, as the engine checks). A
/// region leaves (under the write lock, so after every copy touching it)
/// before it is deregistered.
#[derive(Debug, Default)]
pub(crate) struct LocalKeys {
    keys: RwLock<HashMap<u32, LocalKey>>,
}

#[derive(Debug, Clone, Copy)]
struct LocalKey {
    addr: u64,
    len: u64,
    /// Registered with `LOCAL_WRITE`.
    writable: bool,
}

impl LocalKeys {
    pub(crate) fn insert(&self, key: u32, addr: u64, len: u64, access: AccessFlags) {
        let k = LocalKey { addr, len, writable: access.contains(AccessFlags::LOCAL_WRITE) };
        self.keys.write().unwrap_or_else(|p| p.into_inner()).insert(key, k);
    }

    pub(crate) fn remove(&self, key: u32) {
        self.keys.write().unwrap_or_else(|p| p.into_inner()).remove(&key);
    }
}

struct Grant {
    map: Mapping,
    /// Offset of the region's first byte in `map`.
    inner: usize,
    addr: u64,
    len: u64,
    /// The remote rights granted (`DIRECT_RIGHTS` of the core).
    rights: AccessFlags,
    slot: usize,
    generation: u32,
}

#[derive(Default)]
struct State {
    /// The daemon serves no direct path, or this QP never may.
    off: bool,
    window: Option<WordPage>,
    grants: HashMap<u32, Grant>,
    /// Keys the daemon refused for good (the engine reports them).
    refused: HashSet<u32>,
    /// After a refusal for now: WRs to leave to the engine before asking
    /// again, and the next such pause (doubling).
    pause: u32,
    next_pause: u32,
    /// The receive grant (RDMA writes with immediate), while it stands.
    recv: Option<crate::direct_recv::RecvTarget>,
    /// The daemon never grants this QP its peer's receives.
    recv_off: bool,
    /// As `pause` and `next_pause`, for the receive grant.
    recv_pause: u32,
    recv_next_pause: u32,
    /// Keys of the peer's receive SGEs a SEND found no grant for: asked
    /// for before the next SEND (never while a copy is announced).
    wanted: Vec<u32>,
    /// The last wait for the peer (`RECV_WAIT`) ran out: SENDs finding it
    /// behind go to the engine at once until one is carried (a program
    /// that posts its receive only after its peer's send is not made to
    /// wait on every message).
    recv_wait_failed: bool,
}

/// A QP's direct-path state.
#[derive(Default)]
pub(crate) struct DirectQp {
    state: Mutex<State>,
    /// WRs this QP carried itself (for tests and `bench`).
    pub(crate) carried: AtomicU64,
}

impl std::fmt::Debug for DirectQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectQp").field("carried", &self.carried.load(Ordering::Relaxed)).finish()
    }
}

/// What became of a WR offered to the direct path.
pub(crate) enum Carried {
    /// Done: placed at (or read from) the peer; the requester's
    /// completion, with this `byte_len` (the engine's: the message length
    /// for reads and atomics, 0 for writes), is the caller's.
    Done { byte_len: u32 },
    /// Not for the direct path: post it to the engine.
    Engine,
}

impl DirectQp {
    /// Whether the daemon ever served this QP directly (a window came).
    pub(crate) fn has_window(&self) -> bool {
        self.lock().window.is_some()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts a carried WR. Every count is made holding the state lock
    /// (`_held` proves it), so a load and a store do, without the atomic
    /// read-modify-write (a locked instruction per WR); readers only load.
    fn count_carried(&self, _held: &mut State) {
        let n = self.carried.load(Ordering::Relaxed);
        self.carried.store(n.wrapping_add(1), Ordering::Relaxed);
    }

    /// Carries `wr` (an RDMA write, an RDMA read or an atomic, already
    /// checked against the QP's limits) itself if it can; checks local
    /// SGEs through `local`.
    pub(crate) fn try_carry(&self, ctx: &Context, qpn: u32, local: &LocalKeys, wr: &SendWr) -> Carried {
        if matches!(wr.opcode, SendOpcode::Send | SendOpcode::SendWithImm) {
            return self.carry_send(ctx, qpn, local, wr);
        }
        self.carry_rdma(ctx, qpn, local, wr, None)
    }

    /// Carries an RDMA write (`wr`'s opcode, address and key; no SGEs)
    /// whose payload is `src`, memory of the caller that need not be
    /// registered: copied before this returns, as inline bytes are.
    ///
    /// The source pages are touched first, before the copy is announced in
    /// the window: memory that is not registered may be swapped out or
    /// behind a fault handler, and a revocation waits for an announced
    /// copy only a bounded time (`DRAIN_LIMIT` in the daemon), which a
    /// copy that faults must not outlast.
    pub(crate) fn try_write_from(
        &self,
        ctx: &Context,
        qpn: u32,
        local: &LocalKeys,
        wr: &SendWr,
        src: &[&[u8]],
    ) -> Carried {
        debug_assert_eq!(wr.opcode, SendOpcode::RdmaWrite);
        let page = page_size();
        for b in src {
            for i in (0..b.len()).step_by(page).chain(b.len().checked_sub(1)) {
                // SAFETY: `i < b.len()`: a byte of the borrowed slice.
                unsafe { std::ptr::read_volatile(b.as_ptr().add(i)) };
            }
        }
        self.carry_rdma(ctx, qpn, local, wr, Some(src))
    }

    /// [`Self::try_carry`] of an RDMA write, read or atomic; a write's
    /// payload is `src` where given, else `wr`'s.
    fn carry_rdma(
        &self,
        ctx: &Context,
        qpn: u32,
        local: &LocalKeys,
        wr: &SendWr,
        src: Option<&[&[u8]]>,
    ) -> Carried {
        let len = match src {
            Some(s) => s.iter().map(|b| b.len() as u64).sum(),
            None => wr.msg_len(),
        };
        // The right the opcode needs and the remote bytes it touches.
        // Inline reads and atomics, and atomics shorter than their word,
        // are the engine's errors to report.
        let (right, remote_len) = match wr.opcode {
            SendOpcode::RdmaWrite | SendOpcode::RdmaWriteWithImm => (AccessFlags::REMOTE_WRITE, len),
            SendOpcode::RdmaRead if !wr.is_inline() => (AccessFlags::REMOTE_READ, len),
            SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd if !wr.is_inline() && len >= 8 => {
                (AccessFlags::REMOTE_ATOMIC, 8)
            }
            _ => return Carried::Engine,
        };
        if len > DIRECT_MAX_RDMA_BYTES {
            return Carried::Engine;
        }
        // A write with immediate consumes the peer's receive: it needs the
        // receive grant too (`crate::direct_recv`).
        let needs_recv = wr.opcode == SendOpcode::RdmaWriteWithImm;
        let mut guard = self.lock();
        let st = &mut *guard;
        if st.off || st.refused.contains(&wr.rkey) || (needs_recv && st.recv_off) {
            return Carried::Engine;
        }
        if len == 0 {
            // Nothing to place; the engine's checks (state, peer) decide.
            return Carried::Engine;
        }
        if !st.grants.contains_key(&wr.rkey) && !obtain(st, ctx, qpn, wr.rkey) {
            return Carried::Engine;
        }
        if needs_recv && st.recv.is_none() && !obtain_recv(st, ctx, qpn) {
            return Carried::Engine;
        }
        if !st.grants.contains_key(&wr.rkey) {
            // The receive grant came with a new window: the key grants of
            // the old one are gone with it.
            return Carried::Engine;
        }
        let Some(window) = st.window.clone() else { return Carried::Engine };
        let g = st.grants.get(&wr.rkey).expect("present");
        // The opcode's right, and bounds within the region (the engine
        // says REM_ACCESS_ERR otherwise).
        if !g.rights.contains(right) {
            return Carried::Engine;
        }
        let Some(off) = wr
            .remote_addr
            .checked_sub(g.addr)
            .filter(|o| o.checked_add(remote_len).is_some_and(|e| e <= g.len))
        else {
            return Carried::Engine;
        };
        let dst = g.inner + off as usize;
        // An atomic's word is 8-aligned in the address the requester names
        // and in memory (the engine says REM_INV_REQ otherwise; the
        // mapping starts on a page, as the daemon's does).
        if right == AccessFlags::REMOTE_ATOMIC
            && (!wr.remote_addr.is_multiple_of(8) || !(g.map.as_ptr() as usize + dst).is_multiple_of(8))
        {
            return Carried::Engine;
        }
        let keys = local.keys.read().unwrap_or_else(|p| p.into_inner());
        // Every local SGE inside a region of this PD registered here, one
        // registered with local write where the result lands there (the
        // engine says LOC_PROT_ERR otherwise).
        if src.is_none() && !local_ok(&keys, wr, wr.opcode.writes_local()) {
            return Carried::Engine;
        }
        let (Some(inflight), Some(open), Some(slot), Some(recv_word)) = (
            window.word(DIRECT_WINDOW_INFLIGHT),
            window.word(DIRECT_WINDOW_OPEN),
            window.word(DIRECT_WINDOW_SLOTS + g.slot),
            window.word(DIRECT_WINDOW_RECV),
        ) else {
            return Carried::Engine;
        };
        inflight.fetch_add(1, Ordering::SeqCst);
        let key_ok = open.load(Ordering::SeqCst) == 1 && slot.load(Ordering::SeqCst) == g.generation;
        let recv_ok =
            !needs_recv || st.recv.as_ref().is_some_and(|r| recv_word.load(Ordering::SeqCst) == r.generation);
        let granted = key_ok && recv_ok;
        let mut busy = false;
        if granted && needs_recv {
            let target = st.recv.as_mut().expect("checked above");
            // SAFETY: as for a write below (the same checks, the same
            // announced copy).
            let place = || unsafe { copy_into(&g.map, dst, wr) };
            busy = !matches!(
                target.deliver(qpn, wr, |_| Some(()), |_, ()| place()),
                crate::direct_recv::Delivered::Done
            );
        } else if granted {
            // SAFETY: `dst..dst+remote_len` lies inside the region (checked
            // above against the grant's length, and the mapping spans the
            // region from `inner`; an atomic's word is 8-aligned), which
            // the grant still stands for (the words read after announcing
            // the copy). Local memory is the inline bytes or regions
            // registered in this process (writable where written), checked
            // above and kept registered by the read lock held.
            unsafe {
                match right {
                    AccessFlags::REMOTE_WRITE => match src {
                        Some(src) => copy_slices(&g.map, dst, src),
                        None => copy_into(&g.map, dst, wr),
                    },
                    AccessFlags::REMOTE_READ => scatter(wr, g.map.as_ptr().add(dst), len as usize),
                    _ => {
                        let old = atomic_op(g.map.as_ptr().add(dst), wr).to_le_bytes();
                        scatter(wr, old.as_ptr(), old.len());
                    }
                }
            }
        }
        inflight.fetch_sub(1, Ordering::SeqCst);
        drop(keys);
        if !granted {
            // Revoked: forget it; the next WR asks again (and is refused
            // if the key is gone, so the engine reports it).
            if open.load(Ordering::SeqCst) != 1 {
                st.window = None;
                st.grants.clear();
                st.recv = None;
            } else if !key_ok {
                st.grants.remove(&wr.rkey);
            } else {
                st.recv = None;
            }
            return Carried::Engine;
        }
        if busy {
            // No receive now, or its completion could not be delivered in
            // order or within the CQ: the engine's (RNR, overrun).
            return Carried::Engine;
        }
        if needs_recv {
            srq_limit(st, ctx, qpn);
        }
        self.count_carried(st);
        Carried::Done { byte_len: if right == AccessFlags::REMOTE_WRITE { 0 } else { len as u32 } }
    }

    /// Carries a SEND (with or without immediate) if it can: claims the
    /// peer's next receive and copies the message into its SGEs, each of
    /// which must lie in a region of the peer's PD with local write that
    /// the daemon granted (asked for before the next SEND when missing),
    /// the receive holding no more SGEs than the peer QP's `max_recv_sge`
    /// and at least the message's length; else the receive stays and the
    /// engine reports its LOC_LEN_ERR / LOC_PROT_ERR.
    fn carry_send(&self, ctx: &Context, qpn: u32, local: &LocalKeys, wr: &SendWr) -> Carried {
        let len = wr.msg_len();
        // Empty messages place nothing: the engine's.
        if len == 0 || len > DIRECT_MAX_BYTES {
            return Carried::Engine;
        }
        let mut guard = self.lock();
        let st = &mut *guard;
        if st.off || (st.recv.is_none() && !obtain_recv(st, ctx, qpn)) {
            return Carried::Engine;
        }
        // A receive whose SGEs lie in regions without a grant yet is left
        // unclaimed; their grants are asked for (never while a copy is
        // announced) and the receive tried once more. The peer behind (no
        // receive, its inbox full): tried again until it caught up or
        // `RECV_WAIT` passed.
        let mut attempt = 0;
        let mut waiting: Option<std::time::Instant> = None;
        let mut looks = 0u32;
        loop {
            for key in std::mem::take(&mut st.wanted) {
                if !st.grants.contains_key(&key) {
                    obtain(st, ctx, qpn, key);
                }
            }
            match send_once(st, qpn, local, wr, len) {
                SendAttempt::Done => {
                    st.recv_wait_failed = false;
                    srq_limit(st, ctx, qpn);
                    self.count_carried(st);
                    return Carried::Done { byte_len: 0 };
                }
                SendAttempt::Retry if attempt == 0 => attempt += 1,
                SendAttempt::NoReceive if !st.recv_wait_failed => {
                    let since = *waiting.get_or_insert_with(std::time::Instant::now);
                    if since.elapsed() >= RECV_WAIT {
                        st.recv_wait_failed = true;
                        return Carried::Engine;
                    }
                    // Spin a little, then let a receiver sharing this CPU run.
                    looks += 1;
                    if looks.is_multiple_of(64) {
                        std::thread::yield_now();
                    } else {
                        std::hint::spin_loop();
                    }
                }
                _ => return Carried::Engine,
            }
        }
    }
}

/// Where a SEND's bytes go in the receive it claims, as `fits` found it
/// in [`send_once`].
enum Dest {
    /// The receive's one non-empty SGE, at this address of its grant's
    /// mapping, this long.
    One(*mut u8, usize),
    /// Several: each looked up again as it is filled.
    Each,
}

/// What one try of [`DirectQp::carry_send`] came to.
enum SendAttempt {
    Done,
    /// The receive's SGEs need grants this QP lacks (now in `wanted`).
    Retry,
    /// The peer is behind (`Delivered::Behind`; nothing claimed, nothing
    /// copied).
    NoReceive,
    Engine,
}

/// One try to claim the peer's next receive for the SEND `wr` and copy
/// it there (see [`DirectQp::carry_send`]).
fn send_once(st: &mut State, qpn: u32, local: &LocalKeys, wr: &SendWr, len: u64) -> SendAttempt {
    let State { window, grants, recv, wanted, refused, .. } = st;
    let Some(window) = window.as_ref() else { return SendAttempt::Engine };
    // Inline bytes are the WR's own: no local key to check or hold.
    let keys = match wr.is_inline() {
        true => None,
        false => Some(local.keys.read().unwrap_or_else(|p| p.into_inner())),
    };
    if keys.as_ref().is_some_and(|k| !local_ok(k, wr, false)) {
        return SendAttempt::Engine;
    }
    let (Some(inflight), Some(open), Some(recv_word)) = (
        window.word(DIRECT_WINDOW_INFLIGHT),
        window.word(DIRECT_WINDOW_OPEN),
        window.word(DIRECT_WINDOW_RECV),
    ) else {
        return SendAttempt::Engine;
    };
    let Some(target) = recv.as_mut() else { return SendAttempt::Engine };
    inflight.fetch_add(1, Ordering::SeqCst);
    let window_ok = open.load(Ordering::SeqCst) == 1;
    let recv_ok = window_ok && recv_word.load(Ordering::SeqCst) == target.generation;
    let standing = |g: &Grant| {
        window.word(DIRECT_WINDOW_SLOTS + g.slot).is_some_and(|w| w.load(Ordering::SeqCst) == g.generation)
    };
    let max_sge = target.max_recv_sge as usize;
    let mut stale = Vec::new();
    let mut empty = false;
    let grants = &*grants;
    let delivered = recv_ok && {
        // `Some` if it fits, with the one destination of a receive with one
        // non-empty SGE (the usual case: no second grant look-up to place
        // it).
        let fits = |r: &RecvSlot| -> Option<Dest> {
            if r.len() > max_sge || r.total_len() < len {
                return None;
            }
            let mut dest = None;
            let mut places = 0;
            for s in r.sges().filter(|s| s.length > 0) {
                let Some(g) = grants.get(&s.lkey) else {
                    if !refused.contains(&s.lkey) && !wanted.contains(&s.lkey) {
                        wanted.push(s.lkey);
                    }
                    return None;
                };
                let Some(at) = recv_sge_at(g, &s, standing) else {
                    if !standing(g) {
                        stale.push(s.lkey);
                    }
                    return None;
                };
                // SAFETY: `at..at+length` lies inside the grant's mapping
                // (checked against the grant's length).
                dest = Some((unsafe { g.map.as_ptr().add(at) }, s.length as usize));
                places += 1;
            }
            Some(match (places, dest) {
                (1, Some((p, n))) => Dest::One(p, n),
                _ => Dest::Each,
            })
        };
        // The claimed receive passed `fits`: each SGE in a granted,
        // standing region (words read after announcing the copy).
        let place = |r: &RecvSlot, dest: Dest| {
            let (one, each) = match dest {
                Dest::One(p, n) => (Some((p, n)), None),
                Dest::Each => (None, Some(r.sges())),
            };
            let each = each.into_iter().flatten().filter(|s| s.length > 0).filter_map(|s| {
                let g = grants.get(&s.lkey)?;
                let at = recv_sge_at(g, &s, |_| true)?;
                // SAFETY: `at..at+length` lies inside the grant's mapping
                // (checked against the grant's length).
                Some((unsafe { g.map.as_ptr().add(at) }, s.length as usize))
            });
            let dst = one.into_iter().chain(each);
            // SAFETY: the destinations lie in granted regions that still
            // stand (checked by `fits` inside the announced copy) and
            // total at least the message; the sources are inline bytes or
            // local regions registered here (read lock held, unless
            // inline).
            unsafe { gather_to(wr, dst) }
        };
        let d = target.deliver(qpn, wr, fits, place);
        empty = matches!(d, crate::direct_recv::Delivered::Behind);
        matches!(d, crate::direct_recv::Delivered::Done)
    };
    inflight.fetch_sub(1, Ordering::SeqCst);
    drop(keys);
    if !window_ok {
        st.window = None;
        st.grants.clear();
        st.recv = None;
        return SendAttempt::Engine;
    }
    if !recv_ok {
        st.recv = None;
        return SendAttempt::Engine;
    }
    for k in stale {
        st.grants.remove(&k);
    }
    if !delivered {
        return if !st.wanted.is_empty() {
            SendAttempt::Retry
        } else if empty {
            SendAttempt::NoReceive
        } else {
            SendAttempt::Engine
        };
    }
    SendAttempt::Done
}

/// After a carried receive (no copy announced any more): if its claim
/// left the peer's SRQ below its armed limit, the daemon checks it and
/// raises the limit event (once: it disarms the limit). The answer does
/// not matter to the WR, which is done.
fn srq_limit(st: &mut State, ctx: &Context, qpn: u32) {
    if let Some(target) = st.recv.as_mut().filter(|t| t.limit_due) {
        target.limit_due = false;
        let _ = ctx.inner.control.call(&Request::DirectSrqLimit { qp: qpn }, &[]);
    }
}

/// Asks for a grant of `key` unless paused; says whether it stands now
/// (with a window). Refusals are remembered as the daemon says.
fn obtain(st: &mut State, ctx: &Context, qpn: u32, key: u32) -> bool {
    if st.refused.contains(&key) {
        return false;
    }
    if st.pause > 0 {
        st.pause -= 1;
        return false;
    }
    match ask(ctx, qpn, key) {
        Ok((g, window, map)) => {
            if let Some(w) = window {
                st.window = Some(w);
            }
            if st.window.is_none() {
                return false;
            }
            st.next_pause = 0;
            let inner = (g.fd_offset % page_size() as u64) as usize;
            let grant = Grant {
                map,
                inner,
                addr: g.addr,
                len: g.len,
                rights: g.rights,
                slot: g.slot as usize,
                generation: g.generation,
            };
            st.grants.insert(key, grant);
            true
        }
        Err(Some(DirectRefusal::NotGranted)) | Err(Some(DirectRefusal::Full)) => {
            st.refused.insert(key);
            false
        }
        Err(Some(DirectRefusal::Off)) => {
            st.off = true;
            false
        }
        Err(_) => {
            st.next_pause = (st.next_pause * 2).clamp(16, 1 << 16);
            st.pause = st.next_pause;
            false
        }
    }
}

/// Asks for the receive grant unless paused; says whether it stands now.
fn obtain_recv(st: &mut State, ctx: &Context, qpn: u32) -> bool {
    if st.recv_off {
        return false;
    }
    if st.recv_pause > 0 {
        st.recv_pause -= 1;
        return false;
    }
    match crate::direct_recv::ask(ctx, qpn) {
        Ok((target, window)) => {
            if let Some(w) = window {
                // A new window: the key grants of the old one are gone
                // with it.
                st.window = Some(w);
                st.grants.clear();
            }
            st.recv = Some(target);
            st.recv_next_pause = 0;
            st.window.is_some()
        }
        Err(Some(DirectRefusal::NotGranted | DirectRefusal::Full | DirectRefusal::Off)) => {
            st.recv_off = true;
            false
        }
        Err(_) => {
            st.recv_next_pause = (st.recv_next_pause * 2).clamp(16, 1 << 16);
            st.recv_pause = st.recv_next_pause;
            false
        }
    }
}

/// Whether every local SGE of `wr` lies inside a region of the PD
/// registered in this process, one with local write where `writes` (the
/// engine says LOC_PROT_ERR otherwise).
fn local_ok(keys: &HashMap<u32, LocalKey>, wr: &SendWr, writes: bool) -> bool {
    wr.is_inline()
        || wr.sg.as_slice().iter().filter(|s| s.length > 0).all(|s| {
            keys.get(&s.lkey).is_some_and(|k| {
                (k.writable || !writes)
                    && s.addr.checked_sub(k.addr).is_some_and(|o| o + u64::from(s.length) <= k.len)
            })
        })
}

/// Where a receive SGE lands in a grant's mapping: its offset there, if
/// the grant has local write, still stands (`standing`: its slot word
/// still holds its generation) and holds the SGE whole.
fn recv_sge_at(g: &Grant, s: &Sge, standing: impl Fn(&Grant) -> bool) -> Option<usize> {
    if !g.rights.contains(AccessFlags::LOCAL_WRITE) || !standing(g) {
        return None;
    }
    let off = s.addr.checked_sub(g.addr)?;
    (off.checked_add(u64::from(s.length))? <= g.len).then_some(g.inner + off as usize)
}

/// Copies `wr`'s payload (inline bytes or its local SGEs) into `dst`,
/// chunk by chunk, in order (nothing allocated: the data path's rule).
///
/// # Safety
/// Each `dst` chunk must address `len` writable bytes, together at least
/// `wr.msg_len()`; each non-inline SGE of `wr` `length` readable bytes of
/// this process.
unsafe fn gather_to(wr: &SendWr, dst: impl Iterator<Item = (*mut u8, usize)>) {
    let mut d = dst.filter(|&(_, n)| n > 0);
    let mut cur: Option<(*mut u8, usize)> = d.next();
    let mut put = |mut src: *const u8, mut n: usize| {
        while n > 0 {
            let Some((p, room)) = cur else { return };
            let k = room.min(n);
            // SAFETY: the caller's contract; raw copies only, both sides
            // may be shared memory.
            unsafe { copy_bytes(src, p, k) };
            // SAFETY: within the chunks just checked.
            unsafe {
                src = src.add(k);
                cur = if k == room { d.next() } else { Some((p.add(k), room - k)) };
            }
            n -= k;
        }
    };
    if wr.is_inline() {
        let b = wr.inline_data();
        put(b.as_ptr(), b.len());
    } else {
        for s in wr.sg.as_slice() {
            put(s.addr as *const u8, s.length as usize);
        }
    }
}

/// `std::ptr::copy(src, dst, n)` (the ranges may overlap). From 4 to 16
/// bytes (the small messages that latency is measured with) as two words
/// that may overlap each other, both read before either is written: a
/// length known only at run time is otherwise a call to `memmove`, which
/// costs more than such a copy.
///
/// # Safety
/// As `std::ptr::copy`: `src` readable and `dst` writable for `n` bytes.
#[inline]
unsafe fn copy_bytes(src: *const u8, dst: *mut u8, n: usize) {
    // SAFETY: the caller's contract; every access is unaligned and inside
    // `..n` (the second word ends at byte `n`); both words are read before
    // either is written, so overlapping ranges copy as `ptr::copy` does.
    unsafe {
        match n {
            8..=16 => {
                let (a, b) =
                    (src.cast::<u64>().read_unaligned(), src.add(n - 8).cast::<u64>().read_unaligned());
                dst.cast::<u64>().write_unaligned(a);
                dst.add(n - 8).cast::<u64>().write_unaligned(b);
            }
            4..=7 => {
                let (a, b) =
                    (src.cast::<u32>().read_unaligned(), src.add(n - 4).cast::<u32>().read_unaligned());
                dst.cast::<u32>().write_unaligned(a);
                dst.add(n - 4).cast::<u32>().write_unaligned(b);
            }
            _ => std::ptr::copy(src, dst, n),
        }
    }
}

/// Copies `wr`'s payload to `dst` in `map`.
///
/// # Safety
/// `dst + wr.msg_len()` must lie within `map`, and each non-inline SGE
/// must address `length` readable bytes of this process.
unsafe fn copy_into(map: &Mapping, mut dst: usize, wr: &SendWr) {
    let base = map.as_ptr();
    if wr.is_inline() {
        let src = wr.inline_data();
        // SAFETY: the caller's contract; `src` is private memory of `wr`.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), base.add(dst), src.len()) };
        return;
    }
    for s in wr.sg.as_slice() {
        let n = s.length as usize;
        // SAFETY: the caller's contract: `s.addr` holds `n` bytes of a
        // registered region of this process, `dst..dst+n` is in `map`.
        // Raw copies only: both may be shared memory.
        unsafe { std::ptr::copy(s.addr as *const u8, base.add(dst), n) };
        dst += n;
    }
}

/// Copies `src`, slice after slice, to `dst` in `map`.
///
/// # Safety
/// `dst` plus the slices' total must lie within `map`.
unsafe fn copy_slices(map: &Mapping, mut dst: usize, src: &[&[u8]]) {
    let base = map.as_ptr();
    for b in src {
        // SAFETY: the caller's contract for the destination; `b` is
        // borrowed memory of this process. Raw copies: the destination is
        // shared memory.
        unsafe { std::ptr::copy(b.as_ptr(), base.add(dst), b.len()) };
        dst += b.len();
    }
}

/// Scatters `n` bytes from `src` into `wr`'s SGEs, in order (a read's
/// payload, an atomic's old value).
///
/// # Safety
/// `src` must address `n` readable bytes, and each SGE of `wr` `length`
/// writable bytes of this process; `n` is at most the SGEs' total.
unsafe fn scatter(wr: &SendWr, src: *const u8, n: usize) {
    let mut done = 0;
    for s in wr.sg.as_slice() {
        let k = (s.length as usize).min(n - done);
        // SAFETY: the caller's contract. Raw copies only: the source is
        // shared memory that the peer may write at the same time.
        unsafe { std::ptr::copy(src.add(done), s.addr as *mut u8, k) };
        done += k;
        if done == n {
            break;
        }
    }
}

/// The atomic of `wr` on the word at `word`; returns its old value. The
/// engine's own operations (`vrdma_core::memory::Region`'s
/// `compare_swap`/`fetch_add`): `SeqCst` read-modify-writes on the word,
/// so the two paths' atomics on one word are atomic against each other.
///
/// # Safety
/// `word` must be 8-aligned and valid for 8 bytes, and every access to
/// it made atomically (the engine's and this path's are).
unsafe fn atomic_op(word: *mut u8, wr: &SendWr) -> u64 {
    // SAFETY: the caller's contract; `AtomicU64` has the layout of `u64`.
    let a = unsafe { &*(word as *const AtomicU64) };
    match wr.opcode {
        SendOpcode::AtomicCmpAndSwp => {
            match a.compare_exchange(wr.compare_add, wr.swap, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(v) | Err(v) => v,
            }
        }
        _ => a.fetch_add(wr.compare_add, Ordering::SeqCst),
    }
}

type Asked = (DirectGranted, Option<WordPage>, Mapping);

/// Asks the daemon for a grant; `Err(None)` when the call itself failed.
fn ask(ctx: &Context, qpn: u32, rkey: u32) -> Result<Asked, Option<DirectRefusal>> {
    let req = Request::DirectGrant { qp: qpn, rkey };
    let answer = ctx.inner.control.call(&req, &[]).map_err(|_| None)?;
    let g = match answer.reply {
        Reply::DirectGrant(g) => g,
        Reply::DirectRefused(why) => return Err(Some(why)),
        // A daemon that does not know the request: no direct path.
        _ => return Err(Some(DirectRefusal::Off)),
    };
    let want = if g.window_len > 0 { 2 } else { 1 };
    let mut fds = answer.take_fds(want, "DirectGrant").map_err(|_| None)?;
    let region_fd = fds.pop().ok_or(None)?;
    let window = match fds.pop() {
        Some(fd) => {
            let len = usize::try_from(g.window_len).map_err(|_| None)?;
            let m = Mapping::map_untrusted(fd, 0, len).map_err(|_| None)?;
            Some(WordPage::of_mapping(m))
        }
        None => None,
    };
    let page = page_size() as u64;
    let start = g.fd_offset - g.fd_offset % page;
    let span = usize::try_from(g.fd_offset - start + g.len).map_err(|_| None)?;
    let map = Mapping::map_untrusted(region_fd, start, span).map_err(|_| None)?;
    if g.len == 0 || map.len() < span {
        return Err(None);
    }
    Ok((g, window, map))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A copy is `ptr::copy`'s, byte for byte, for every short length,
    /// between distinct buffers and within one (overlapping, either way).
    #[test]
    fn a_short_copy_is_a_memmove() {
        let pattern: Vec<u8> = (0..96u8).map(|b| b.wrapping_mul(13).wrapping_add(5)).collect();
        for n in 0..=40 {
            let mut got = vec![0xeeu8; 64];
            let mut want = got.clone();
            // SAFETY: `n <= 40` bytes inside each 64- or 96-byte buffer.
            unsafe {
                copy_bytes(pattern.as_ptr().add(3), got.as_mut_ptr().add(5), n);
                std::ptr::copy(pattern.as_ptr().add(3), want.as_mut_ptr().add(5), n);
            }
            assert_eq!(got, want, "{n} bytes between buffers");
            for (from, to) in [(0, 3), (3, 0), (10, 11), (11, 10), (8, 8)] {
                let (mut got, mut want) = (pattern.clone(), pattern.clone());
                // SAFETY: `from`/`to` + `n` <= 51 < 96: inside the buffer.
                unsafe {
                    let (g, w) = (got.as_mut_ptr(), want.as_mut_ptr());
                    copy_bytes(g.add(from), g.add(to), n);
                    std::ptr::copy(w.add(from), w.add(to), n);
                }
                assert_eq!(got, want, "{n} bytes from {from} to {to} in one buffer");
            }
        }
    }
}
