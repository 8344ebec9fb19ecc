//! Completion channels and completion queues, with the `poll_cq` and
//! `req_notify_cq` operations of the context's ops table.
//!
//! `poll_cq` is the data path: it calls [`vrdma::CompletionQueue::poll`]
//! (which reads the shared ring, without a system call or a lock, and
//! yields the CPU after a bounded run of empty polls) into a small buffer
//! on the stack and converts each `vrdma::Cqe` into a `struct ibv_wc`,
//! whose status and opcode numbers are verbs.h's own. `req_notify_cq`
//! arms the CQ in shared memory.
//!
//! A completion channel's `fd` is the vrdma channel's doorbell, a real
//! descriptor that applications `poll`/`epoll`. As with rdma-core's, it is
//! readable exactly while an event is unread: the daemon queues one
//! datagram per event once it is published, and `ibv_get_cq_event` takes
//! it with the event. It starts out blocking,
//! as rdma-core's does; an application that sets `O_NONBLOCK` on it gets
//! `EAGAIN` from `ibv_get_cq_event` when no event is pending.
//! `ibv_get_cq_event` maps the CQ number the daemon reports back to the
//! application's `struct ibv_cq` and counts the event;
//! `ibv_ack_cq_events` adds to `comp_events_completed` under the CQ's
//! mutex, and `ibv_destroy_cq` waits until every event handed out was
//! acknowledged, all as rdma-core does.

use std::ffi::{c_int, c_void};
use std::mem::MaybeUninit;
use std::os::fd::AsRawFd;
use std::ptr::{self, addr_of, addr_of_mut};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use vrdma::Cqe;

use crate::abi::*;
use crate::context::Ctx;
use crate::util::*;

#[repr(C)]
pub struct Channel {
    pub ch: ibv_comp_channel,
    pub inner: vrdma::CompletionChannel,
}

/// A CQ, laid out as an `ibv_cq_ex`; a CQ from `ibv_create_cq_ex` has its
/// extended-poll operations (module `cq_ex`).
#[repr(C)]
pub struct Cq {
    pub ex: ibv_cq_ex,
    pub inner: vrdma::CompletionQueue,
    /// Completion events handed to the application by `ibv_get_cq_event`.
    pub comp_reported: AtomicU32,
    /// Async events handed out by `ibv_get_async_event`.
    pub async_reported: AtomicU32,
    /// The extended-poll state (module `cq_ex`); unused for a CQ from
    /// `ibv_create_cq`.
    pub poll: crate::cq_ex::PollState,
}

// The application's pointers are the objects' addresses.
const _: () = assert!(std::mem::offset_of!(Cq, ex) == 0 && std::mem::offset_of!(Channel, ch) == 0);

impl Cq {
    /// # Safety
    /// `p` must be NULL or a live CQ from `ibv_create_cq`.
    pub unsafe fn get<'a>(what: &str, p: *mut ibv_cq) -> Res<&'a vrdma::CompletionQueue> {
        non_null(what, p, "the CQ")?;
        // SAFETY: `ibv_cq` is the first member of the boxed `Cq`; only the
        // Rust-owned field is borrowed.
        Ok(unsafe { &*addr_of!((*p.cast::<Cq>()).inner) })
    }
}

/// `ibv_create_comp_channel@IBVERBS_1.0`.
pub unsafe extern "C" fn ibv_create_comp_channel(context: *mut ibv_context) -> *mut ibv_comp_channel {
    const W: &str = "ibv_create_comp_channel";
    ret_ptr(W, || {
        // SAFETY: a live context (the verb's contract).
        let ctx = unsafe { Ctx::get(W, context)? };
        let inner = ctx.inner.create_comp_channel().map_err(|e| fail_in_guest(W, &ctx.inner, &e))?;
        let fd = inner.fd().as_raw_fd();
        make_blocking(fd);
        let ch = ibv_comp_channel { context: ctx.as_ptr(), fd, refcnt: 0 };
        Ok(Box::into_raw(Box::new(Channel { ch, inner })).cast())
    })
}

/// `ibv_destroy_comp_channel@IBVERBS_1.0`: `EBUSY` while CQs use it.
pub unsafe extern "C" fn ibv_destroy_comp_channel(channel: *mut ibv_comp_channel) -> c_int {
    const W: &str = "ibv_destroy_comp_channel";
    ret_code(W, || {
        non_null(W, channel, "the channel")?;
        // SAFETY: a live channel (the verb's contract); its context is live
        // too. refcnt is guarded by the context's mutex, as in rdma-core.
        unsafe {
            let context = (*channel).context;
            let _lock = PthreadLock::new(addr_of_mut!((*context).mutex));
            if (*channel).refcnt != 0 {
                return Err(refuse(W, "CQs still use the channel", libc::EBUSY));
            }
            drop(Box::from_raw(channel.cast::<Channel>()));
        }
        Ok(())
    })
}

/// `ibv_create_cq`: a CQ of at least `cqe` entries (`cqe` reports the
/// depth granted, a power of two).
pub unsafe extern "C" fn ibv_create_cq(
    context: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> *mut ibv_cq {
    const W: &str = "ibv_create_cq";
    // SAFETY: the verb's contract.
    ret_ptr(W, || {
        unsafe { create(W, context, cqe, cq_context, channel, comp_vector, None) }.map(|p| p.cast())
    })
}

/// Creates a CQ for `ibv_create_cq` and `ibv_create_cq_ex`; `ex`: the
/// `IBV_WC_EX_WITH_*` fields and whether the CQ is single-threaded, for a
/// CQ polled with `ibv_start_poll` (module `cq_ex`).
///
/// # Safety
/// `context` must be NULL or a live context, `channel` NULL or a live
/// channel of it.
#[allow(non_snake_case)] // `W`, the verb's name, as in the other verbs
pub unsafe fn create(
    W: &str,
    context: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
    ex_flags: Option<(u64, bool)>,
) -> Res<*mut Cq> {
    {
        // SAFETY: a live context (the verb's contract).
        let ctx = unsafe { Ctx::get(W, context)? };
        let cqe =
            u32::try_from(cqe).ok().filter(|&n| n > 0).ok_or_else(|| refuse(W, "cqe < 1", libc::EINVAL))?;
        if comp_vector != 0 {
            return Err(refuse(W, "the device has one completion vector", libc::EINVAL));
        }
        let ch = if channel.is_null() {
            None
        } else {
            // SAFETY: a live channel (the verb's contract).
            Some(unsafe { &*addr_of!((*channel.cast::<Channel>()).inner) })
        };
        let inner = ctx.inner.create_cq(cqe, ch).map_err(|e| fail_in_guest(W, &ctx.inner, &e))?;
        let cq = ibv_cq {
            context,
            channel,
            cq_context,
            handle: inner.cqn(),
            cqe: int(inner.depth()),
            // SAFETY: zeroed storage, initialised by pthread_*_init below.
            mutex: unsafe { std::mem::zeroed() },
            // SAFETY: as above.
            cond: unsafe { std::mem::zeroed() },
            comp_events_completed: 0,
            async_events_completed: 0,
        };
        let ex = ibv_cq_ex {
            cq,
            comp_mask: 0,
            status: 0,
            wr_id: 0,
            start_poll: None,
            next_poll: None,
            end_poll: None,
            read_opcode: None,
            read_vendor_err: None,
            read_byte_len: None,
            read_imm_data: None,
            read_qp_num: None,
            read_src_qp: None,
            read_wc_flags: None,
            read_slid: None,
            read_sl: None,
            read_dlid_path_bits: None,
            read_completion_ts: None,
            read_cvlan: None,
            read_flow_tag: None,
            read_tm_info: None,
            read_completion_wallclock_ns: None,
        };
        let mut ex = ex;
        let poll = match ex_flags {
            Some((wc_flags, single)) => {
                crate::cq_ex::install(&mut ex, wc_flags);
                crate::cq_ex::PollState::new(single)
            }
            None => crate::cq_ex::PollState::new(true),
        };
        let cqn = inner.cqn();
        let p = Box::into_raw(Box::new(Cq {
            ex,
            inner,
            comp_reported: AtomicU32::new(0),
            async_reported: AtomicU32::new(0),
            poll,
        }));
        // SAFETY: `p` is a fresh box; the channel and context are live.
        unsafe {
            init_mutex_cond(addr_of_mut!((*p).ex.cq.mutex), addr_of_mut!((*p).ex.cq.cond));
            if !channel.is_null() {
                let _lock = PthreadLock::new(addr_of_mut!((*context).mutex));
                (*channel).refcnt += 1;
            }
        }
        ctx.registry().cqs.insert(cqn, p);
        Ok(p)
    }
}

/// `ibv_resize_cq`: vRDMA CQs keep their size; `EOPNOTSUPP`, as rdma-core
/// returns for a provider without the operation.
pub unsafe extern "C" fn ibv_resize_cq(_cq: *mut ibv_cq, _cqe: c_int) -> c_int {
    ret_code("ibv_resize_cq", || Err(refuse("ibv_resize_cq", "CQs cannot be resized", libc::EOPNOTSUPP)))
}

/// `ibv_destroy_cq`: `EBUSY` while QPs use the CQ; waits until the
/// application acknowledged every event it took for it.
pub unsafe extern "C" fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int {
    const W: &str = "ibv_destroy_cq";
    ret_code(W, || {
        // SAFETY: a live CQ (the verb's contract).
        let inner = unsafe { Cq::get(W, cq)? };
        if vrdma::ffi::cq_handles(inner) > 1 {
            return Err(refuse(W, "QPs still use the CQ", libc::EBUSY));
        }
        let p = cq.cast::<Cq>();
        // SAFETY: `p` is live until the Box is dropped at the end; its
        // context and channel are live (the application destroys them
        // after the CQ, which the channel's refcnt enforces).
        unsafe {
            let ctx = Ctx::from_ptr((*cq).context);
            ctx.registry().cqs.remove(&inner.cqn());
            wait_acked(
                addr_of_mut!((*cq).mutex),
                addr_of_mut!((*cq).cond),
                &[
                    (addr_of!((*cq).comp_events_completed), (*p).comp_reported.load(Ordering::Relaxed)),
                    (addr_of!((*cq).async_events_completed), (*p).async_reported.load(Ordering::Relaxed)),
                ],
            );
            let channel = (*cq).channel;
            if !channel.is_null() {
                let _lock = PthreadLock::new(addr_of_mut!((*(*cq).context).mutex));
                (*channel).refcnt -= 1;
            }
            destroy_mutex_cond(addr_of_mut!((*cq).mutex), addr_of_mut!((*cq).cond));
            drop(Box::from_raw(p));
        }
        Ok(())
    })
}

/// Completions converted per call into `vrdma::CompletionQueue::poll`.
const POLL_BATCH: usize = 32;

fn to_wc(c: &Cqe) -> ibv_wc {
    ibv_wc {
        wr_id: c.wr_id,
        status: u32::from(c.status.raw()),
        opcode: u32::from(c.opcode.raw()),
        vendor_err: c.vendor_err,
        byte_len: c.byte_len,
        imm_data: c.imm_data,
        qp_num: c.qp_num,
        src_qp: c.src_qp,
        wc_flags: c.wc_flags.bits(),
        pkey_index: c.pkey_index,
        slid: c.slid,
        sl: c.sl,
        dlid_path_bits: c.dlid_path_bits,
    }
}

/// `ops.poll_cq`: up to `num_entries` completions into `wc`; their number,
/// or a negative errno. No allocation, no lock.
pub unsafe extern "C" fn poll_cq(cq: *mut ibv_cq, num_entries: c_int, wc: *mut ibv_wc) -> c_int {
    const W: &str = "ibv_poll_cq";
    guard(W, -libc::EIO, || {
        let want = usize::try_from(num_entries).unwrap_or(0);
        if want == 0 {
            return 0;
        }
        if cq.is_null() || wc.is_null() {
            set_errno(libc::EINVAL);
            return -libc::EINVAL;
        }
        // SAFETY: a live CQ (the verb's contract).
        let inner = unsafe { &*addr_of!((*cq.cast::<Cq>()).inner) };
        let mut buf = [const { MaybeUninit::<Cqe>::uninit() }; POLL_BATCH];
        let mut done = 0usize;
        while done < want {
            let n = (want - done).min(POLL_BATCH);
            for slot in &mut buf[..n] {
                slot.write(Cqe::default());
            }
            // SAFETY: the first `n` entries were initialised just above.
            let got = match inner.poll(unsafe { &mut *(ptr::from_mut(&mut buf[..n]) as *mut [Cqe]) }) {
                Ok(g) => g,
                Err(e) => {
                    let e = fail(W, &e);
                    set_errno(e);
                    return if done > 0 { done as c_int } else { -e };
                }
            };
            for (i, slot) in buf[..got].iter().enumerate() {
                // SAFETY: `wc` holds `num_entries` entries (the verb's
                // contract) and `done + i < want <= num_entries`; the slot
                // was initialised and filled by poll.
                unsafe { wc.add(done + i).write(to_wc(slot.assume_init_ref())) };
            }
            done += got;
            if got < n {
                break;
            }
        }
        done as c_int
    })
}

/// `ops.req_notify_cq`: arms the CQ for its next completion (or next
/// solicited one). A CQ without a channel has nowhere to report events;
/// like hardware, arming it succeeds and does nothing.
pub unsafe extern "C" fn req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    const W: &str = "ibv_req_notify_cq";
    ret_code(W, || {
        // SAFETY: a live CQ (the verb's contract).
        let inner = unsafe { Cq::get(W, cq)? };
        if inner.channel().is_none() {
            return Ok(());
        }
        inner.req_notify(solicited_only != 0).map_err(|e| fail(W, &e))
    })
}

/// `ibv_get_cq_event`: waits for the next CQ of `channel` that fired
/// (unless the fd is non-blocking: -1 with `EAGAIN`), returns it and its
/// `cq_context`. Events of CQs destroyed meanwhile are skipped.
///
/// The wait is interruptible as rdma-core's `read()` of the channel fd
/// is: a signal whose handler (installed without `SA_RESTART`) runs while
/// the call sleeps makes it fail with `EINTR` (qperf ends its timed tests
/// with `SIGALRM` that way; a wait that swallowed the signal would sleep
/// forever once the peer stopped). While the channel stays quiet the daemon is asked, once a
/// second, whether it is still there, so that its death ends the wait
/// with an error instead of a hang.
pub unsafe extern "C" fn ibv_get_cq_event(
    channel: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    const W: &str = "ibv_get_cq_event";
    ret_minus1(W, || {
        non_null(W, channel, "the channel")?;
        non_null(W, cq, "cq")?;
        non_null(W, cq_context, "cq_context")?;
        // SAFETY: a live channel whose context is live (the verb's contract).
        let (ch, ctx) =
            unsafe { (&*addr_of!((*channel.cast::<Channel>()).inner), Ctx::from_ptr((*channel).context)) };
        let fd = ch.fd().as_raw_fd();
        let nonblocking = is_nonblocking(fd);
        // The first look spins for the client library's short window (an
        // answer that comes within microseconds is taken without sleeping).
        let first = if nonblocking { Duration::ZERO } else { vrdma::event_spin() };
        let mut next = ch.get_cq_event(Some(first)).map_err(|e| fail(W, &e))?;
        // Whether the last poll saw the fd readable.
        let mut woke = false;
        loop {
            if let Some(cqn) = next {
                let reg = ctx.registry();
                if let Some(&p) = reg.cqs.get(&cqn) {
                    // SAFETY: registered CQs are live; counted under the
                    // registry lock, which ibv_destroy_cq takes before it
                    // waits.
                    unsafe {
                        (*p).comp_reported.fetch_add(1, Ordering::Relaxed);
                        *cq = p.cast();
                        *cq_context = (*p).ex.cq.cq_context;
                    }
                    return Ok(());
                }
            } else if nonblocking {
                return Err(libc::EAGAIN);
            } else {
                if woke {
                    // Readable, yet no event: another thread's, about to be
                    // taken, or a stale wake-up that the library drops
                    // after a while. Do not spin hot.
                    std::thread::sleep(Duration::from_micros(200));
                }
                let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
                // SAFETY: one valid pollfd.
                let r = unsafe { libc::poll(&mut pfd, 1, 1000) };
                if r < 0 {
                    let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
                    if e != libc::EINTR {
                        return Err(refuse(W, "poll failed", e));
                    }
                    if !all_handlers_restart() {
                        return Err(libc::EINTR);
                    }
                }
                if r == 0 {
                    ctx.inner.query_port(1).map_err(|e| fail(W, &e))?;
                }
                woke = r > 0;
            }
            next = ch.get_cq_event(Some(Duration::ZERO)).map_err(|e| fail(W, &e))?;
        }
    })
}

/// Whether every signal handler the program installed asks for
/// `SA_RESTART`. `poll` is never restarted, while rdma-core's `read()` of
/// the channel fd is restarted after such a handler; the interrupting
/// signal is not known, so the wait goes on only when no handler could
/// have wanted the `EINTR`.
fn all_handlers_restart() -> bool {
    (1..libc::SIGRTMAX()).all(|sig| {
        // SAFETY: queries the disposition only (no new action).
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        if unsafe { libc::sigaction(sig, ptr::null(), &mut old) } != 0 {
            return true;
        }
        old.sa_sigaction == libc::SIG_DFL
            || old.sa_sigaction == libc::SIG_IGN
            || old.sa_flags & libc::SA_RESTART != 0
    })
}

/// `ibv_ack_cq_events`: acknowledges `nevents` events of `cq`.
pub unsafe extern "C" fn ibv_ack_cq_events(cq: *mut ibv_cq, nevents: u32) {
    guard("ibv_ack_cq_events", (), || {
        if cq.is_null() {
            return;
        }
        // SAFETY: a live CQ (the verb's contract); the counter is written
        // under the CQ's mutex, and the destroyer waits on the condition.
        unsafe {
            let _lock = PthreadLock::new(addr_of_mut!((*cq).mutex));
            (*cq).comp_events_completed = (*cq).comp_events_completed.wrapping_add(nevents);
            libc::pthread_cond_signal(addr_of_mut!((*cq).cond));
        }
    })
}

/// Acknowledges one async event of `cq` (from `ibv_ack_async_event`).
///
/// # Safety
/// `cq` must be NULL or a live CQ.
pub unsafe fn ack_async(cq: *mut ibv_cq) {
    if cq.is_null() {
        return;
    }
    // SAFETY: per the contract; written under the CQ's mutex.
    unsafe {
        let _lock = PthreadLock::new(addr_of_mut!((*cq).mutex));
        (*cq).async_events_completed = (*cq).async_events_completed.wrapping_add(1);
        libc::pthread_cond_signal(addr_of_mut!((*cq).cond));
    }
}
