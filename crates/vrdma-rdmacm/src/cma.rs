//! The connection manager calls: rdma-core's `rdma_*` functions over
//! [`vrdma::cm`], with the QP moved through the program's libibverbs.
//!
//! Each C object is a box whose first member is the structure the
//! program sees, so the pointer the program holds is the box's:
//!
//! - [`Channel`]: `struct rdma_event_channel` (its `fd` is the client
//!   library's real descriptor: readable exactly while events wait) and
//!   the [`EventChannel`].
//! - [`Id`]: `struct rdma_cm_id` and the [`CmId`]. The ids of the process
//!   are also in a table by the daemon's id number, which is how an event
//!   finds its `rdma_cm_id` (and its listener's).
//! - [`Event`]: `struct rdma_cm_event` and the bytes its private data
//!   pointer points at, valid until `rdma_ack_cm_event` frees the box.
//!   Each holds its id (a connect request: its listener) as librdmacm's
//!   `events_reported`/`events_completed` do: `rdma_destroy_id` waits
//!   until every event handed out for the id was acknowledged, so an
//!   event never points at a freed id, and the lookup of an event's id
//!   in the table takes the hold under the table's lock, so that a
//!   destroy on another thread cannot free the id in between (found in
//!   review, 2026-11-28: a use after free of the C `rdma_cm_id`).
//!
//! QPs are the program's: libibverbs ones that `rdma_create_qp` makes with
//! `ibv_create_qp`. A connected (RC) QP is attached to the id in the
//! daemon, in the same call where the program's libibverbs is vRDMA's
//! (its `vrdma_create_qp_cm_id`), else with [`CmId::attach_qp_num`] (the
//! QP is of the program's libibverbs' context, another context of this
//! process, which the daemon allows for this), which moves it to INIT, and
//! from then on the daemon moves it as the kernel's CM would: to RTR and
//! RTS in `rdma_accept` before the reply goes out, and on the requester's
//! side when the reply comes in (the program sees ESTABLISHED, never the
//! CONNECT_RESPONSE, as librdmacm shows it for an id with a QP), and to
//! ERR in `rdma_disconnect`. That is what librdmacm does itself with an
//! `ibv_modify_qp` per state, each state two control round trips here
//! (its attributes, then the modify): about fifteen of them on the path
//! between the two sides of a connection, more than half its setup time.
//! The `state` field of the program's `ibv_qp` is written as the QP
//! moves, as libibverbs' modify would have. A UD QP is moved here (INIT,
//! RTR, RTS in `rdma_create_qp`, as librdmacm makes it ready to send at
//! once), and an id's QP that the program moves itself (no QP given to
//! `rdma_create_qp`) is the program's. In a guest, whose contexts the
//! daemon cannot tell to be of one process, it attaches none: there this
//! library moves the QPs through every state itself (`Lib::no_attach`).
//!
//! # Round trips per connection
//!
//! What rdma-core's `cmtime -c 100` costs the daemon per connection,
//! counted by request kind over a run (set-up and tear-down): its client
//! makes half of its ids with a round trip (the other half are the
//! channel's spares, `vrdma::cm`), then one `ResolveAddr` (whose reply
//! carries ADDR_RESOLVED; the route is resolved here), one `CreateQp`
//! (`vrdma_create_qp_cm_id`; the CQs are the first connection's, which
//! librdmacm writes into the attributes the program passes again) and
//! one `ConnectRouted`; its server one `CreateQp` and one `Accept` (whose
//! reply carries the server's ESTABLISHED where nothing is queued before
//! it). The Rust API's loop takes two on the client and one on the
//! server (`CmRequest::Batch` of the QP's creation and the connect or
//! accept): here `rdma_create_qp` returns the QP, whose number and state
//! the program reads and on which it may post receives before it
//! connects or accepts, so the creation cannot wait for the call after
//! it; and `rdma_connect` and `rdma_accept` report their errors
//! themselves, so their replies cannot be read later. Events that pile up
//! behind bare wake-ups (the server's 100 requests, the client's 100
//! ESTABLISHED) come several to a `GetEvents` round trip (`vrdma::cm`):
//! cmtime's server asked the daemon 229 and 189 times in two runs for
//! the 300 events of 100 connections, now 7 and 25 times.
//!
//! # When the daemon goes away
//!
//! Everything of one connection to the daemon is a [`Lib`]: the client
//! context, the table of ids, the libibverbs device context the ids name
//! in `id->verbs`. Channels and ids hold the `Lib` they were made in.
//! When the daemon dies or is restarted, that connection's channels report
//! DEVICE_REMOVAL for their ids with a device, then `ENODEV`, and calls on
//! its ids fail, while destroying them works, as after a device reset on
//! rdma-core (the program cleans up). The next `rdma_create_event_channel`
//! (or synchronous `rdma_create_id`) finds the connection gone and opens a
//! new `Lib` on the daemon that answers now, so that a program goes on
//! without a restart of its own, as it does after a device comes back.

use std::cell::UnsafeCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::ptr::{self, null_mut};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use vrdma::cm::{CmEvent, CmId, ConnParam, EventChannel, EventKind, PortSpace};
use vrdma::{QpAttr, QpAttrMask, QpState};

use crate::abi::*;
use crate::verbs::{verbs, Device};
use crate::{guard, Error, Res};

/// What the channels and ids of one connection to the daemon share: the
/// client context (the same tenant as the program's libibverbs, so the
/// daemon accepts that library's QP numbers), the table of its ids, and
/// the libibverbs device context they name.
///
/// Never freed: the first in a static, each later one (one per daemon
/// restart the process lives through) leaked, as its device context is
/// never closed. The first one in a static keeps the process's heap as it
/// was before generations existed: vRDMA re-backs registered heap pages
/// as spans, and a program's small buffers that happen to share a page in
/// a new layout can then fail to register (a limitation of re-backing).
struct Lib {
    ctx: vrdma::Context,
    ids: Mutex<HashMap<u32, usize>>,
    /// Opened on first use; never closed (see [`Device`]).
    device: OnceLock<Device>,
    opening: Mutex<()>,
    /// The daemon refused to attach a QP of the program's libibverbs to
    /// an id of this connection (a guest's contexts, which the daemon
    /// cannot tell to be of one process): this library moves the QPs
    /// itself, as before the daemon could.
    no_attach: AtomicBool,
}

impl Lib {
    fn ids(&self) -> MutexGuard<'_, HashMap<u32, usize>> {
        self.ids.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The device context of this connection, opened from a fresh device
    /// list the first time (after a restart, the new daemon's device).
    fn device(&self) -> Res<&Device> {
        if let Some(d) = self.device.get() {
            return Ok(d);
        }
        let _one = self.opening.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = self.device.get() {
            return Ok(d);
        }
        let opened = verbs()?.open_first()?;
        Ok(self.device.get_or_init(|| opened))
    }

    /// Opens the device context with the connection, as rdma-core's
    /// `ucma_init` takes the device list at the process's first
    /// librdmacm call (`rdma_create_event_channel`, `rdma_create_id`),
    /// not at the first bind or resolve: loading the program's
    /// libibverbs (`dlopen`), its device list and open (a connection to
    /// the daemon: `Hello`, `QueryDevice`) were about 0.5 ms of a fresh
    /// process's first `rdma_resolve_addr` (`cmtime -c 1`'s "resolve
    /// addr" step), where the kernel's CM resolves in tens of µs. The
    /// context is opened once per connection either way (never closed:
    /// see [`Device`]); a program that never binds an id now holds it
    /// too (one more of its tenant's `max_contexts`), as rdma-core's
    /// holds its device list. A failure here is not reported: the first
    /// call that needs the device tries again and fails with its error,
    /// as before.
    fn open_device_early(&self) {
        let _ = self.device();
    }
}

/// The connection to the daemon that new channels are made on: the one
/// made last, or a new one once its daemon is gone (restarted).
fn lib() -> Res<&'static Lib> {
    static FIRST: OnceLock<Lib> = OnceLock::new();
    static CURRENT: Mutex<Option<&'static Lib>> = Mutex::new(None);
    let mut cur = CURRENT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(l) = cur.filter(|l| !l.ctx.daemon_gone()) {
        return Ok(l);
    }
    let ctx = vrdma::Context::open().map_err(|e| {
        Error::Setup(format!("cannot reach the vRDMA daemon (is VRDMA_SOCKET set? try `vrdma run`): {e}"))
    })?;
    let l = Lib {
        ctx,
        ids: Mutex::default(),
        device: OnceLock::new(),
        opening: Mutex::new(()),
        no_attach: AtomicBool::new(false),
    };
    let l: &'static Lib = if FIRST.get().is_none() {
        // Under CURRENT's lock: nobody else sets it.
        FIRST.get_or_init(|| l)
    } else {
        Box::leak(Box::new(l))
    };
    *cur = Some(l);
    l.open_device_early();
    Ok(l)
}

/// `struct rdma_event_channel` and what stands behind it.
#[repr(C)]
pub struct Channel {
    c: rdma_event_channel,
    ch: EventChannel,
    lib: &'static Lib,
    /// Threads inside `rdma_get_cm_event` on this channel.
    waiters: AtomicU32,
}

/// `struct rdma_cm_id` and what stands behind it.
///
/// Several threads may use one id (rping's event thread handles its
/// events while the main thread calls on it), and the program reads and
/// writes the C structure itself, so the structure is an `UnsafeCell`
/// reached through raw pointers (this library writes the fields
/// librdmacm writes, at the points librdmacm writes them) and the Rust
/// side is behind a lock or atomic.
#[repr(C)]
pub struct Id {
    c: UnsafeCell<rdma_cm_id>,
    cm: Mutex<CmId>,
    /// The connection the id was made on.
    lib: &'static Lib,
    ps: PortSpace,
    /// The PD `rdma_create_qp` allocated for an id given none.
    own_pd: AtomicPtr<ibv_pd>,
    /// The channel `rdma_create_id` made for an id given none (or
    /// `rdma_get_request` for the ids of such a listener): librdmacm's
    /// synchronous ids, whose calls wait for the outcome they start
    /// ([`complete`]).
    own_channel: AtomicPtr<Channel>,
    /// The CQs and completion channels `rdma_create_qp` made for a QP
    /// given none, as librdmacm does: (send channel, send CQ, receive
    /// channel, receive CQ), destroyed with the QP.
    own_cqs: Mutex<[usize; 4]>,
    /// Whether the id's QP is attached to it in the daemon, which moves it
    /// (see the module's notes).
    attached: AtomicBool,
    /// A passive endpoint's QP attributes (`rdma_create_ep`), with which
    /// `rdma_get_request` gives each new id its QP.
    qp_init_attr: Mutex<Option<ibv_qp_init_attr>>,
    /// The requester's (responder resources, initiator depth), for an id
    /// a connect request made: an accept's defaults.
    request: Option<(u8, u8)>,
    /// Events handed out that hold this id, not yet acknowledged
    /// (librdmacm's `events_reported - events_completed`): its own, and a
    /// listener's connect requests. `rdma_destroy_id` waits for none.
    unacked: Mutex<u64>,
    /// Signalled as `unacked` falls.
    acked: Condvar,
}

/// `struct rdma_cm_event` and the private data it points at.
#[repr(C)]
pub struct Event {
    c: rdma_cm_event,
    private_data: Vec<u8>,
    /// The id this event holds (see [`Hold`]), let go when the event is
    /// freed (acknowledged).
    hold: Hold,
}

/// An event's hold on an id ([`Id::unacked`]): taken where the event's id
/// is looked up in the table, under its lock, and let go when dropped,
/// so that `rdma_destroy_id`, which takes the id out of the table first,
/// frees it only once no event holds it (librdmacm's contract: destroy
/// waits for the acknowledgements of the id's events).
struct Hold(*mut Id);

impl Hold {
    /// Holds the id the table has for `num`, if any.
    fn take(lib: &Lib, num: u32) -> Option<Hold> {
        let ids = lib.ids();
        let p = *ids.get(&num)? as *mut Id;
        // SAFETY: ids in the table are live; destroy takes one out (under
        // this lock) before it waits for the holds, then frees it.
        let i = unsafe { &*p };
        *i.unacked.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        drop(ids);
        Some(Hold(p))
    }

    fn id(&self) -> *mut Id {
        self.0
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        // SAFETY: a held id is live: its destroy waits for this.
        let i = unsafe { &*self.0 };
        let mut n = i.unacked.lock().unwrap_or_else(|p| p.into_inner());
        *n -= 1;
        if *n == 0 {
            i.acked.notify_all();
        }
    }
}

/// The `Channel` behind a program's pointer.
///
/// # Safety
/// `p` is NULL or came from `rdma_create_event_channel` and is live.
unsafe fn channel<'a>(p: *mut rdma_event_channel) -> Res<&'a Channel> {
    // SAFETY: per the contract, `p` is the first member of a live Channel.
    unsafe { p.cast::<Channel>().as_ref() }.ok_or(Error::sys(libc::EINVAL, "NULL event channel"))
}

/// The `Id` behind a program's pointer.
///
/// # Safety
/// `p` is NULL or came from this library (`rdma_create_id` or an event)
/// and is not destroyed.
unsafe fn id<'a>(p: *mut rdma_cm_id) -> Res<&'a Id> {
    // SAFETY: per the contract, `p` is the first member of a live Id.
    unsafe { p.cast::<Id>().as_ref() }.ok_or(Error::sys(libc::EINVAL, "NULL rdma_cm_id"))
}

/// An IPv4 address from a program's `sockaddr` (IPv6 only as the
/// wildcard or an IPv4-mapped address: vRDMA's addresses are IPv4).
///
/// # Safety
/// `sa` is NULL or points at a `sockaddr` of its family's size.
unsafe fn sockaddr_v4(sa: *const libc::sockaddr) -> Res<Option<SocketAddrV4>> {
    if sa.is_null() {
        return Ok(None);
    }
    // SAFETY: a non-NULL sockaddr has at least its family.
    let family = c_int::from(unsafe { (*sa).sa_family });
    match family {
        libc::AF_INET => {
            // SAFETY: AF_INET: the caller's structure is a sockaddr_in.
            let sin = unsafe { ptr::read_unaligned(sa.cast::<libc::sockaddr_in>()) };
            let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
            Ok(Some(SocketAddrV4::new(ip, u16::from_be(sin.sin_port))))
        }
        libc::AF_INET6 => {
            // SAFETY: AF_INET6: the caller's structure is a sockaddr_in6.
            let sin6 = unsafe { ptr::read_unaligned(sa.cast::<libc::sockaddr_in6>()) };
            let ip6 = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            let port = u16::from_be(sin6.sin6_port);
            if ip6.is_unspecified() {
                Ok(Some(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port)))
            } else if let Some(v4) = ip6.to_ipv4_mapped() {
                Ok(Some(SocketAddrV4::new(v4, port)))
            } else {
                Err(Error::sys(libc::EAFNOSUPPORT, "vRDMA's addresses are IPv4"))
            }
        }
        _ => Err(Error::sys(libc::EAFNOSUPPORT, "not an IP address")),
    }
}

fn write_sockaddr(out: &mut libc::sockaddr_storage, a: Option<SocketAddrV4>) {
    // SAFETY: sockaddr_storage is plain bytes; all-zero is a valid value.
    *out = unsafe { std::mem::zeroed() };
    if let Some(a) = a {
        let sin = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: a.port().to_be(),
            sin_addr: libc::in_addr { s_addr: u32::from(*a.ip()).to_be() },
            sin_zero: [0; 8],
        };
        // SAFETY: sockaddr_storage is larger than and as aligned as
        // sockaddr_in.
        unsafe { ptr::write((out as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>(), sin) };
    }
}

impl Id {
    /// The C structure, shared with the program.
    fn c(&self) -> *mut rdma_cm_id {
        self.c.get()
    }

    /// The id in the daemon (a lock held only for one call).
    fn cm(&self) -> std::sync::MutexGuard<'_, CmId> {
        self.cm.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The id's QP, NULL if it has none.
    fn qp_ptr(&self) -> *mut ibv_qp {
        // SAFETY: a read of a field of the live structure.
        unsafe { (*self.c()).qp }
    }

    /// Refreshes `route.addr` from the daemon (one call). The daemon sets
    /// both addresses of an id in the bind, the address resolution or the
    /// connect request that made it, and changes them no more; the events
    /// of the last two carry them ([`CmEvent`]'s `local` and `remote`),
    /// so that this is needed after a bind only.
    fn refresh_addrs(&self) -> Res<()> {
        let (local, remote) = self.cm().addrs()?;
        self.set_addrs(local, remote);
        Ok(())
    }

    fn set_addrs(&self, local: Option<SocketAddrV4>, remote: Option<SocketAddrV4>) {
        // SAFETY: fields of the live structure that only this library
        // writes (the program reads them after the call or event that
        // set them, as with librdmacm).
        unsafe {
            write_sockaddr(&mut (*self.c()).route.addr.src_storage, local);
            write_sockaddr(&mut (*self.c()).route.addr.dst_storage, remote);
        }
    }

    /// Names the device: `verbs`, `port_num` and the device's PD in `pd`
    /// (where no QP has set it yet), as once an id is bound to an address
    /// of a device.
    fn attach_device(&self) -> Res<()> {
        let d = self.lib.device()?;
        let pd = d.pd(verbs()?)?;
        // SAFETY: as in `refresh_addrs`.
        unsafe {
            (*self.c()).verbs = d.context;
            (*self.c()).port_num = 1;
            if (*self.c()).pd.is_null() {
                (*self.c()).pd = pd;
            }
        }
        Ok(())
    }

    fn qp(&self) -> Option<&ibv_qp> {
        // SAFETY: `qp` is NULL or the QP `rdma_create_qp` made, which the
        // program destroys only through rdma_destroy_qp (or after it is
        // done with the id).
        unsafe { self.qp_ptr().as_ref() }
    }

    /// Moves the id's QP to `state` with the daemon's attributes.
    fn modify_qp(&self, state: QpState) -> Res<()> {
        let qp = self.qp_ptr();
        if qp.is_null() {
            return Ok(());
        }
        let (attr, mask) = self.cm().init_qp_attr(state)?;
        modify_qp(qp, &attr, mask)
    }

    /// Whether the daemon moves the id's QP (see the module's notes).
    fn attached(&self) -> bool {
        self.attached.load(Ordering::Acquire)
    }

    /// Writes the state the daemon moved the id's QP to into the
    /// program's `ibv_qp`, as libibverbs' `ibv_modify_qp` does.
    fn qp_moved(&self, state: QpState) {
        let qp = self.qp_ptr();
        if !qp.is_null() {
            // SAFETY: the live QP `rdma_create_qp` made; `state` is the
            // field libibverbs writes after a modify (the program reads
            // it, if at all, as it would after librdmacm's own modify).
            unsafe { (*qp).state = u32::from(state.raw()) };
        }
    }

    /// librdmacm's bring-up of a connected QP: INIT again (the daemon's
    /// attributes may have changed with the request), RTR, RTS. Nothing
    /// for a UD QP, nor for an attached one (the daemon brings it up).
    fn bring_up(&self) -> Res<()> {
        if self.ps.is_ud() || self.attached() {
            return Ok(());
        }
        for s in [QpState::Init, QpState::Rtr, QpState::Rts] {
            self.modify_qp(s)?;
        }
        Ok(())
    }

    fn to_err(&self) {
        let qp = self.qp_ptr();
        if !qp.is_null() {
            let attr = QpAttr { qp_state: QpState::Err, ..QpAttr::default() };
            let _ = modify_qp(qp, &attr, QpAttrMask::STATE);
        }
    }
}

/// `ibv_modify_qp` through the program's libibverbs.
fn modify_qp(qp: *mut ibv_qp, q: &QpAttr, mask: QpAttrMask) -> Res<()> {
    let mut attr = attr_to_c(q);
    // SAFETY: `qp` is a live QP of that library, `attr` a full structure.
    let rc = unsafe { (verbs()?.modify_qp)(qp, &mut attr, mask.bits() as c_int) };
    if rc != 0 {
        return Err(Error::sys(rc, "ibv_modify_qp failed"));
    }
    Ok(())
}

fn ah_to_c(a: &vrdma::AhAttr) -> ibv_ah_attr {
    ibv_ah_attr {
        grh: ibv_global_route {
            dgid: ibv_gid { raw: a.dgid.0 },
            flow_label: a.flow_label,
            sgid_index: a.sgid_index,
            hop_limit: a.hop_limit,
            traffic_class: a.traffic_class,
        },
        dlid: a.dlid,
        sl: a.sl,
        src_path_bits: a.src_path_bits,
        static_rate: a.static_rate,
        is_global: u8::from(a.is_global),
        port_num: a.port_num,
    }
}

/// The daemon's attributes as `struct ibv_qp_attr`.
fn attr_to_c(q: &QpAttr) -> ibv_qp_attr {
    ibv_qp_attr {
        qp_state: u32::from(q.qp_state.raw()),
        cur_qp_state: u32::from(q.cur_qp_state.raw()),
        path_mtu: u32::from(q.path_mtu.raw()),
        qkey: q.qkey,
        rq_psn: q.rq_psn,
        sq_psn: q.sq_psn,
        dest_qp_num: q.dest_qp_num,
        qp_access_flags: q.qp_access_flags.bits(),
        cap: ibv_qp_cap {
            max_send_wr: q.cap.max_send_wr,
            max_recv_wr: q.cap.max_recv_wr,
            max_send_sge: q.cap.max_send_sge,
            max_recv_sge: q.cap.max_recv_sge,
            max_inline_data: q.cap.max_inline_data,
        },
        ah_attr: ah_to_c(&q.ah_attr),
        pkey_index: q.pkey_index,
        en_sqd_async_notify: u8::from(q.en_sqd_async_notify),
        sq_draining: u8::from(q.sq_draining),
        max_rd_atomic: q.max_rd_atomic,
        max_dest_rd_atomic: q.max_dest_rd_atomic,
        min_rnr_timer: q.min_rnr_timer,
        port_num: q.port_num,
        timeout: q.timeout,
        retry_cnt: q.retry_cnt,
        rnr_retry: q.rnr_retry,
        ..ibv_qp_attr::default()
    }
}

/// A program's `struct rdma_conn_param` (NULL: librdmacm's defaults).
///
/// # Safety
/// `p` is NULL or a valid `rdma_conn_param` whose private data pointer
/// holds `private_data_len` bytes.
unsafe fn conn_param(p: *const rdma_conn_param) -> ConnParam {
    // SAFETY: per the contract.
    let Some(c) = (unsafe { p.as_ref() }) else {
        return ConnParam {
            qp_num: 0,
            start_psn: 0,
            responder_resources: RDMA_MAX_RESP_RES,
            initiator_depth: RDMA_MAX_RESP_RES,
            flow_control: 0,
            retry_count: 7,
            rnr_retry_count: 7,
            srq: false,
            private_data: Vec::new(),
        };
    };
    let private_data = if c.private_data.is_null() || c.private_data_len == 0 {
        Vec::new()
    } else {
        // SAFETY: per the contract, `private_data_len` readable bytes.
        unsafe { std::slice::from_raw_parts(c.private_data.cast::<u8>(), usize::from(c.private_data_len)) }
            .to_vec()
    };
    ConnParam {
        qp_num: c.qp_num & 0xff_ffff,
        start_psn: 0,
        responder_resources: c.responder_resources,
        initiator_depth: c.initiator_depth,
        flow_control: c.flow_control,
        retry_count: c.retry_count,
        rnr_retry_count: c.rnr_retry_count,
        srq: c.srq != 0,
        private_data,
    }
}

/// The device's limits: (responder resources, initiator depth).
fn rd_atom_limits(lib: &Lib) -> Res<(u8, u8)> {
    static LIMITS: OnceLock<(u8, u8)> = OnceLock::new();
    if let Some(l) = LIMITS.get() {
        return Ok(*l);
    }
    let d = lib.ctx.query_device()?;
    let cap = |v: u32| u8::try_from(v).unwrap_or(u8::MAX - 1);
    Ok(*LIMITS.get_or_init(|| (cap(d.max_qp_rd_atom), cap(d.max_qp_init_rd_atom))))
}

/// `RDMA_MAX_RESP_RES` / `RDMA_MAX_INIT_DEPTH` (and, for an accept, a
/// NULL parameter) mean "as many as can be": the device's limit, and for
/// an accept no more than the requester offered, as in librdmacm.
fn resolve_depths(id: &Id, param: &mut ConnParam, null: bool) -> Res<()> {
    let (max_resp, max_init) = rd_atom_limits(id.lib)?;
    let (offer_resp, offer_init) = id.request.unwrap_or((u8::MAX, u8::MAX));
    // Our responder resources serve their reads: no more than their
    // initiator depth; our initiator depth no more than their resources.
    if null || param.responder_resources == RDMA_MAX_RESP_RES {
        param.responder_resources = max_resp.min(offer_init);
    }
    if null || param.initiator_depth == RDMA_MAX_RESP_RES {
        param.initiator_depth = max_init.min(offer_resp);
    }
    Ok(())
}

/// The connection parameters with the QP of `id` where it has one.
fn with_qp(id: &Id, mut param: ConnParam) -> ConnParam {
    if let Some(qp) = id.qp() {
        param.qp_num = qp.qp_num;
        param.srq = !qp.srq.is_null();
    }
    param
}

// ---------------------------------------------------------------------
// Event channels

pub unsafe extern "C" fn rdma_create_event_channel() -> *mut rdma_event_channel {
    guard("rdma_create_event_channel", null_mut(), || {
        let lib = lib()?;
        let ch = EventChannel::create(&lib.ctx)?;
        let fd = ch.fd().as_raw_fd();
        // The kernel's rdma_cm descriptor starts blocking, and a program
        // that wants EAGAIN sets O_NONBLOCK itself (rdma_get_cm_event
        // looks). The client library reads it with MSG_DONTWAIT either way.
        // SAFETY: fcntl on the channel's own descriptor.
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            if flags >= 0 && flags & libc::O_NONBLOCK != 0 {
                libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK);
            }
        }
        let b = Box::new(Channel { c: rdma_event_channel { fd }, ch, lib, waiters: AtomicU32::new(0) });
        Ok(Box::into_raw(b).cast::<rdma_event_channel>())
    })
}

/// Destroys a channel, unless a thread waits in `rdma_get_cm_event` on it:
/// programs do that at exit (rping's event thread is still in its loop
/// when the main thread destroys the channel). With the kernel's
/// librdmacm that thread's `read` holds the file open: it goes on
/// waiting, and still gets the events that come (rping's prints its
/// DISCONNECTED); it sees no error (rping's would exit the process with
/// it) and no freed memory. So such a channel is left alive (its memory
/// and the daemon's side stay until the process ends), and its waiters
/// go on as before.
pub unsafe extern "C" fn rdma_destroy_event_channel(channel: *mut rdma_event_channel) {
    guard("rdma_destroy_event_channel", (), || {
        if !channel.is_null() {
            // SAFETY: from rdma_create_event_channel, destroyed once (the
            // program's contract).
            let ch = unsafe { &*channel.cast::<Channel>() };
            if ch.waiters.load(Ordering::SeqCst) == 0 {
                // SAFETY: as above; no thread waits on it.
                drop(unsafe { Box::from_raw(channel.cast::<Channel>()) });
            }
        }
        Ok(())
    })
}

// ---------------------------------------------------------------------
// Ids

/// # Safety
/// `ch` is a live channel.
unsafe fn new_id(ch: *mut Channel, cm: CmId, ps: PortSpace, context: *mut c_void) -> *mut Id {
    // SAFETY: all-zero is valid for the C structure (pointers NULL, plain
    // integers and bytes).
    let mut c: rdma_cm_id = unsafe { std::mem::zeroed() };
    c.channel = ch.cast::<rdma_event_channel>();
    c.context = context;
    c.ps = ps.raw();
    c.qp_type = if ps.is_ud() { IBV_QPT_UD } else { IBV_QPT_RC };
    Box::into_raw(Box::new(Id {
        c: UnsafeCell::new(c),
        cm: Mutex::new(cm),
        // SAFETY: the caller's contract.
        lib: unsafe { (*ch).lib },
        ps,
        own_pd: AtomicPtr::new(null_mut()),
        own_channel: AtomicPtr::new(null_mut()),
        own_cqs: Mutex::new([0; 4]),
        attached: AtomicBool::new(false),
        qp_init_attr: Mutex::new(None),
        request: None,
        unacked: Mutex::new(0),
        acked: Condvar::new(),
    }))
}

/// A new event channel of this library's own (for a synchronous id).
fn new_channel() -> Res<*mut Channel> {
    // SAFETY: no arguments.
    let c = unsafe { rdma_create_event_channel() };
    if c.is_null() {
        return Err(Error::sys(
            std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO),
            "no channel",
        ));
    }
    Ok(c.cast::<Channel>())
}

/// `rdma_create_id`: on `channel`, or (NULL) on a channel of its own, as
/// librdmacm's synchronous ids.
fn create_id(channel: *mut rdma_event_channel, context: *mut c_void, ps: u32) -> Res<*mut Id> {
    let ps = PortSpace::from_raw(ps).ok_or(Error::sys(libc::EINVAL, "unknown port space"))?;
    let (ch, own) =
        if channel.is_null() { (new_channel()?, true) } else { (channel.cast::<Channel>(), false) };
    // SAFETY: a live channel (the program's contract, or just made).
    let created = CmId::create(unsafe { &(*ch).ch }, ps);
    let cm = match created {
        Ok(cm) => cm,
        Err(e) => {
            if own {
                // SAFETY: made above, not shared.
                unsafe { rdma_destroy_event_channel(ch.cast()) };
            }
            return Err(e.into());
        }
    };
    let num = cm.id();
    // SAFETY: the live channel the id was made on.
    let p = unsafe { new_id(ch, cm, ps, context) };
    // SAFETY: just made, not yet shared.
    let i = unsafe { &*p };
    if own {
        i.own_channel.store(ch, Ordering::Release);
    }
    i.lib.ids().insert(num, p as usize);
    Ok(p)
}

pub unsafe extern "C" fn rdma_create_id(
    channel: *mut rdma_event_channel,
    out: *mut *mut rdma_cm_id,
    context: *mut c_void,
    ps: u32,
) -> c_int {
    guard("rdma_create_id", -1, || {
        if out.is_null() {
            return Err(Error::sys(libc::EINVAL, "NULL id pointer"));
        }
        let p = create_id(channel, context, ps)?;
        // SAFETY: `out` checked above.
        unsafe { *out = p.cast() };
        Ok(0)
    })
}

/// `rdma_destroy_id` of a live id, which the caller gives up.
fn destroy_id(p: *mut rdma_cm_id) -> Res<()> {
    // SAFETY: the caller's contract: a live id.
    let i = unsafe { id(p) }?;
    let num = i.cm().id();
    i.lib.ids().remove(&num);
    // A synchronous id's last event, as librdmacm acknowledges it.
    // SAFETY: librdmacm's field of the live structure.
    let ev = unsafe { std::mem::replace(&mut (*i.c()).event, null_mut()) };
    if !ev.is_null() {
        // SAFETY: an event of rdma_get_cm_event kept by `complete`.
        drop(unsafe { Box::from_raw(ev.cast::<Event>()) });
    }
    // Out of the table, no event holds it any more once those handed out
    // are acknowledged (as librdmacm's destroy waits; a program that
    // destroys an id before it acknowledges the id's events waits for
    // ever there too).
    let mut unacked = i.unacked.lock().unwrap_or_else(|p| p.into_inner());
    while *unacked > 0 {
        unacked = i.acked.wait(unacked).unwrap_or_else(|p| p.into_inner());
    }
    drop(unacked);
    // SAFETY: the id is the caller's to destroy, once.
    let b = unsafe { Box::from_raw(p.cast::<Id>()) };
    let (pd, ch) = (b.own_pd.load(Ordering::Acquire), b.own_channel.load(Ordering::Acquire));
    drop(b);
    if !pd.is_null() {
        // SAFETY: the PD this library allocated for the id.
        unsafe { (verbs()?.dealloc_pd)(pd) };
    }
    if !ch.is_null() {
        // SAFETY: the channel this library made for the id.
        unsafe { rdma_destroy_event_channel(ch.cast()) };
    }
    Ok(())
}

pub unsafe extern "C" fn rdma_destroy_id(p: *mut rdma_cm_id) -> c_int {
    guard("rdma_destroy_id", -1, || destroy_id(p).map(|()| 0))
}

/// librdmacm's `ucma_complete`: on a synchronous id (one with a channel
/// of its own) the call that started an exchange waits for its event,
/// which stays in `id->event` until the next wait or `rdma_destroy_id`
/// acknowledges it; a failing event is the call's failure.
fn complete(i: &Id) -> Res<()> {
    let ch = i.own_channel.load(Ordering::Acquire);
    if ch.is_null() {
        return Ok(());
    }
    // SAFETY: librdmacm's field of the live structure; a synchronous
    // id's events are this library's to take and acknowledge.
    let old = unsafe { std::mem::replace(&mut (*i.c()).event, null_mut()) };
    if !old.is_null() {
        // SAFETY: an event `complete` kept.
        drop(unsafe { Box::from_raw(old.cast::<Event>()) });
    }
    let e = next_event(ch.cast())?;
    // SAFETY: as above; `e` is live until acknowledged.
    let (kind, status) = unsafe {
        (*i.c()).event = e.cast();
        ((*e).c.event, (*e).c.status)
    };
    event_outcome(kind, status)
}

/// librdmacm's reading of a synchronous call's event.
fn event_outcome(kind: u32, status: c_int) -> Res<()> {
    if status == 0 {
        Ok(())
    } else if kind == EventKind::Rejected as u32 {
        Err(Error::sys(libc::ECONNREFUSED, "rejected"))
    } else {
        let errno = if status < 0 { -status } else { status };
        Err(Error::sys(errno, "the connection manager's event failed"))
    }
}

fn bind_addr(i: &Id, addr: *const libc::sockaddr) -> Res<()> {
    // SAFETY: the caller's sockaddr.
    let a = unsafe { sockaddr_v4(addr) }?.ok_or(Error::sys(libc::EINVAL, "NULL address"))?;
    let bound = i.cm().bind(a)?;
    if device_behind(i.lib, *bound.ip())? {
        i.attach_device()?;
    }
    i.refresh_addrs()
}

/// Whether binding to `ip` names the device, as binding to the address
/// of an RDMA netdev does in the kernel: not the wildcard, and not a
/// loopback address other than the device's own (the daemon's
/// `address`). The kernel has no device behind `lo` (a bind there
/// fails); here the bind succeeds, so that `rping -a 127.0.0.1` and the
/// like listen on loopback, but leaves `verbs` NULL as a wildcard bind
/// does. libfabric's verbs provider relies on that: it binds
/// "localhost" to find the address a listener publishes, and only when
/// no device is behind it takes the device's interface address
/// (`verbs;ofi_rxm` and `fi_pingpong` across hosts publish that address
/// to the peer, where 127.0.0.1 would name the peer itself).
fn device_behind(lib: &Lib, ip: Ipv4Addr) -> Res<bool> {
    if ip.is_unspecified() {
        return Ok(false);
    }
    if !ip.is_loopback() {
        return Ok(true);
    }
    let own = lib.ctx.query_gid(1, 0)?.ipv4().map(Ipv4Addr::from);
    Ok(own == Some(ip))
}

pub unsafe extern "C" fn rdma_bind_addr(p: *mut rdma_cm_id, addr: *mut libc::sockaddr) -> c_int {
    guard("rdma_bind_addr", -1, || {
        // SAFETY: the program's contract.
        let i = unsafe { id(p) }?;
        bind_addr(i, addr)?;
        Ok(0)
    })
}

fn resolve_addr(i: &Id, src: *const libc::sockaddr, dst: *const libc::sockaddr) -> Res<()> {
    // SAFETY: the caller's sockaddrs.
    let (s, d) = unsafe { (sockaddr_v4(src)?, sockaddr_v4(dst)?) };
    let d = d.ok_or(Error::sys(libc::EINVAL, "NULL destination"))?;
    if d.ip().is_multicast() {
        // What rdma_join_multicast would need first (mckey's path).
        static TOLD: AtomicBool = AtomicBool::new(false);
        if !TOLD.swap(true, Ordering::Relaxed) {
            eprintln!(
                "vrdma librdmacm: multicast is not implemented yet (rdma_resolve_addr to the group {}); \
                 failing with ENOSYS",
                d.ip()
            );
        }
        return Err(Error::sys(libc::ENOSYS, "multicast is not implemented yet"));
    }
    i.cm().resolve_addr(s, d)?;
    i.attach_device()?;
    if s.is_some() {
        // librdmacm binds to a given source first, which fills it in.
        i.refresh_addrs()?;
    } else {
        // As librdmacm: the destination now, the source with the event.
        // SAFETY: as in `Id::set_addrs`.
        unsafe { write_sockaddr(&mut (*i.c()).route.addr.dst_storage, Some(d)) };
    }
    complete(i)
}

pub unsafe extern "C" fn rdma_resolve_addr(
    p: *mut rdma_cm_id,
    src: *mut libc::sockaddr,
    dst: *mut libc::sockaddr,
    _timeout_ms: c_int,
) -> c_int {
    guard("rdma_resolve_addr", -1, || {
        // SAFETY: the program's contract.
        let i = unsafe { id(p) }?;
        resolve_addr(i, src, dst)?;
        Ok(0)
    })
}

fn resolve_route(i: &Id) -> Res<()> {
    i.cm().resolve_route()?;
    complete(i)
}

pub unsafe extern "C" fn rdma_resolve_route(p: *mut rdma_cm_id, _timeout_ms: c_int) -> c_int {
    guard("rdma_resolve_route", -1, || {
        // SAFETY: the program's contract.
        resolve_route(unsafe { id(p) }?)?;
        Ok(0)
    })
}

pub unsafe extern "C" fn rdma_listen(p: *mut rdma_cm_id, backlog: c_int) -> c_int {
    guard("rdma_listen", -1, || {
        // SAFETY: the program's contract.
        let i = unsafe { id(p) }?;
        // librdmacm's backlog 0 means the default.
        i.cm().listen(if backlog <= 0 { 1024 } else { backlog })?;
        Ok(0)
    })
}

/// `rdma_create_qp` and `rdma_create_qp_ex` once the PD is known.
fn create_qp(i: &Id, pd: *mut ibv_pd, attr: &mut ibv_qp_init_attr) -> Res<()> {
    let c = i.c();
    // SAFETY: reads of fields of the live structure.
    let (ctx, old) = unsafe { ((*c).verbs, (*c).qp) };
    if ctx.is_null() {
        return Err(Error::sys(libc::EINVAL, "the id is not bound to the device yet"));
    }
    if !old.is_null() {
        return Err(Error::sys(libc::EINVAL, "the id has a QP already"));
    }
    let v = verbs()?;
    // SAFETY: a field of the live structure (a passive endpoint's PD).
    let pd = if pd.is_null() { unsafe { (*c).pd } } else { pd };
    let pd = if pd.is_null() {
        let mut own = i.own_pd.load(Ordering::Acquire);
        if own.is_null() {
            // SAFETY: the id's open device context.
            own = unsafe { (v.alloc_pd)(ctx) };
            if own.is_null() {
                return Err(Error::last("ibv_alloc_pd failed"));
            }
            i.own_pd.store(own, Ordering::Release);
        }
        own
    } else {
        // SAFETY: the program's PD.
        if unsafe { (*pd).context } != ctx {
            return Err(Error::sys(libc::EINVAL, "the PD is of another device context"));
        }
        pd
    };
    // As librdmacm: a QP given no CQs gets its own, each with a
    // completion channel, the id their context (rdma_verbs.h's
    // rdma_get_send_comp and rdma_get_recv_comp wait on them).
    let made = own_cqs(i, attr)?;
    // A connected QP is the daemon's to move: made attached to the id in
    // one call where the program's libibverbs is vRDMA's drop-in, else
    // made, then attached.
    let mut attach = !i.ps.is_ud() && attr.qp_type == IBV_QPT_RC && !i.lib.no_attach.load(Ordering::Relaxed);
    let mut one_call = v.create_qp_cm_id.filter(|_| attach);
    let mut qp = match one_call {
        // SAFETY: as for ibv_create_qp, and the id's number.
        Some(f) => unsafe { f(pd, attr, i.cm().id()) },
        // SAFETY: a PD of the context and the program's attributes.
        None => unsafe { (v.create_qp)(pd, attr) },
    };
    let refused = || std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOENT);
    if qp.is_null() && one_call.is_some() && refused() {
        // The daemon does not take the id as one of this process's (a
        // guest's: ENOENT, no such id): the QP made apart and moved here,
        // for this connection's ids from now on.
        i.lib.no_attach.store(true, Ordering::Relaxed);
        (attach, one_call) = (false, None);
        // SAFETY: as above.
        qp = unsafe { (v.create_qp)(pd, attr) };
    }
    if qp.is_null() {
        let e = Error::last("ibv_create_qp failed");
        destroy_cqs(made);
        return Err(e);
    }
    // SAFETY: librdmacm's fields of the live structure, which the program
    // reads once rdma_create_qp returns.
    unsafe { (*c).qp = qp };
    let init = if attach {
        let attached = if one_call.is_some() {
            Ok(())
        } else {
            // SAFETY: the QP just made.
            let qpn = unsafe { (*qp).qp_num };
            i.cm().attach_qp_num(qpn).map_err(Error::from)
        };
        attached.map(|()| {
            i.attached.store(true, Ordering::Release);
            i.qp_moved(QpState::Init);
        })
    } else {
        i.modify_qp(QpState::Init)
    };
    let init = init.and_then(|()| {
        if i.ps.is_ud() {
            // A UD QP is ready to send at once, as librdmacm makes it.
            let rtr = QpAttr { qp_state: QpState::Rtr, ..QpAttr::default() };
            modify_qp(qp, &rtr, QpAttrMask::STATE)?;
            let rts = QpAttr { qp_state: QpState::Rts, ..QpAttr::default() };
            modify_qp(qp, &rts, QpAttrMask::STATE | QpAttrMask::SQ_PSN)?;
        }
        Ok(())
    });
    if let Err(e) = init {
        // SAFETY: as above.
        unsafe { (*c).qp = null_mut() };
        // SAFETY: the QP just made, not yet handed out.
        unsafe { (v.destroy_qp)(qp) };
        destroy_cqs(made);
        return Err(e);
    }
    *i.own_cqs.lock().unwrap_or_else(|p| p.into_inner()) = made;
    // SAFETY: as above.
    unsafe {
        (*c).pd = pd;
        (*c).send_cq = attr.send_cq;
        (*c).recv_cq = attr.recv_cq;
        (*c).srq = attr.srq;
        (*c).qp_type = attr.qp_type;
        if made[1] != 0 {
            (*c).send_cq_channel = made[0] as *mut c_void;
        }
        if made[3] != 0 {
            (*c).recv_cq_channel = made[2] as *mut c_void;
        }
    }
    Ok(())
}

/// librdmacm's `ucma_create_cqs`: a CQ (of the queue's depth) and its
/// completion channel for each of the send and receive sides `attr`
/// names no CQ for; returns what it made, as `Id::own_cqs` keeps it.
fn own_cqs(i: &Id, attr: &mut ibv_qp_init_attr) -> Res<[usize; 4]> {
    let v = verbs()?;
    let context = i.lib.device()?.context;
    let mut made = [0usize; 4];
    for (side, want) in [(0, attr.cap.max_send_wr), (2, attr.cap.max_recv_wr)] {
        let cq = if side == 0 { attr.send_cq } else { attr.recv_cq };
        if !cq.is_null() {
            continue;
        }
        // SAFETY: the id's open device context.
        let ch = unsafe { (v.create_comp_channel)(context) };
        if ch.is_null() {
            let e = Error::last("ibv_create_comp_channel failed");
            destroy_cqs(made);
            return Err(e);
        }
        made[side] = ch as usize;
        let depth = c_int::try_from(want.max(1)).unwrap_or(c_int::MAX);
        // SAFETY: the context, a channel of it, the id as the context.
        let cq = unsafe { (v.create_cq)(context, depth, i.c().cast(), ch, 0) };
        if cq.is_null() {
            let e = Error::last("ibv_create_cq failed");
            destroy_cqs(made);
            return Err(e);
        }
        made[side + 1] = cq as usize;
    }
    if made[1] != 0 {
        attr.send_cq = made[1] as *mut c_void;
    }
    if made[3] != 0 {
        attr.recv_cq = made[3] as *mut c_void;
    }
    Ok(made)
}

/// Destroys the CQs and channels [`own_cqs`] made (CQs first).
fn destroy_cqs(made: [usize; 4]) {
    let Ok(v) = verbs() else { return };
    for k in [1, 3, 0, 2] {
        let p = made[k] as *mut c_void;
        if p.is_null() {
            continue;
        }
        // SAFETY: objects this library made and nobody else destroys.
        unsafe {
            if k % 2 == 1 {
                (v.destroy_cq)(p);
            } else {
                (v.destroy_comp_channel)(p);
            }
        }
    }
}

pub unsafe extern "C" fn rdma_create_qp(
    p: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    attr: *mut ibv_qp_init_attr,
) -> c_int {
    guard("rdma_create_qp", -1, || {
        // SAFETY: the program's contract.
        let i = unsafe { id(p) }?;
        // SAFETY: the program's attributes, written back with the caps.
        let a = unsafe { attr.as_mut() }.ok_or(Error::sys(libc::EINVAL, "NULL attributes"))?;
        create_qp(i, pd, a)?;
        Ok(0)
    })
}

pub unsafe extern "C" fn rdma_create_qp_ex(p: *mut rdma_cm_id, attr: *mut ibv_qp_init_attr_ex_head) -> c_int {
    guard("rdma_create_qp_ex", -1, || {
        // SAFETY: the program's contract.
        let i = unsafe { id(p) }?;
        // SAFETY: the program's attributes.
        let a = unsafe { attr.as_mut() }.ok_or(Error::sys(libc::EINVAL, "NULL attributes"))?;
        if a.comp_mask & !IBV_QP_INIT_ATTR_PD != 0 {
            return Err(Error::sys(
                libc::EOPNOTSUPP,
                "only the PD of ibv_qp_init_attr_ex is supported (no extended QP attributes yet)",
            ));
        }
        let pd = if a.comp_mask & IBV_QP_INIT_ATTR_PD != 0 { a.pd } else { null_mut() };
        let mut base = ibv_qp_init_attr {
            qp_context: a.qp_context,
            send_cq: a.send_cq,
            recv_cq: a.recv_cq,
            srq: a.srq,
            cap: a.cap,
            qp_type: a.qp_type,
            sq_sig_all: a.sq_sig_all,
        };
        create_qp(i, pd, &mut base)?;
        // The capabilities granted, as ibv_create_qp_ex writes them back.
        a.cap = base.cap;
        Ok(0)
    })
}

fn destroy_qp(i: &Id) -> Res<()> {
    // (The daemon forgets the QP when it finds it gone.)
    i.attached.store(false, Ordering::Release);
    // SAFETY: librdmacm's field of the live structure.
    let qp = unsafe { std::mem::replace(&mut (*i.c()).qp, null_mut()) };
    if !qp.is_null() {
        // SAFETY: the QP rdma_create_qp made.
        unsafe { (verbs()?.destroy_qp)(qp) };
    }
    let made = std::mem::take(&mut *i.own_cqs.lock().unwrap_or_else(|p| p.into_inner()));
    if made != [0; 4] {
        // SAFETY: as above.
        unsafe {
            let c = i.c();
            if made[1] != 0 {
                (*c).send_cq = null_mut();
                (*c).send_cq_channel = null_mut();
            }
            if made[3] != 0 {
                (*c).recv_cq = null_mut();
                (*c).recv_cq_channel = null_mut();
            }
        }
        destroy_cqs(made);
    }
    Ok(())
}

pub unsafe extern "C" fn rdma_destroy_qp(p: *mut rdma_cm_id) {
    guard("rdma_destroy_qp", (), || {
        // SAFETY: the program's contract.
        destroy_qp(unsafe { id(p) }?)
    })
}

pub unsafe extern "C" fn rdma_connect(p: *mut rdma_cm_id, param: *mut rdma_conn_param) -> c_int {
    guard("rdma_connect", -1, || {
        // SAFETY: the program's contract.
        let i = unsafe { id(p) }?;
        // SAFETY: the program's parameters.
        let mut param = with_qp(i, unsafe { conn_param(param) });
        resolve_depths(i, &mut param, false)?;
        i.cm().connect(&param)?;
        complete(i)?;
        Ok(0)
    })
}

pub unsafe extern "C" fn rdma_accept(p: *mut rdma_cm_id, param: *mut rdma_conn_param) -> c_int {
    guard("rdma_accept", -1, || {
        // SAFETY: the program's contract.
        let i = unsafe { id(p) }?;
        let null = param.is_null();
        // SAFETY: the program's parameters.
        let mut param = with_qp(i, unsafe { conn_param(param) });
        resolve_depths(i, &mut param, null)?;
        if let Err(e) = i.bring_up() {
            i.to_err();
            let _ = i.cm().reject(&[]);
            return Err(e);
        }
        if let Err(e) = i.cm().accept(&param) {
            if i.attached() {
                // The daemon's bring-up or the accept failed: as when
                // this library's own bring-up fails.
                i.to_err();
                let _ = i.cm().reject(&[]);
            }
            return Err(e.into());
        }
        if i.attached() {
            i.qp_moved(QpState::Rts);
        }
        complete(i)?;
        Ok(0)
    })
}

pub unsafe extern "C" fn rdma_reject(p: *mut rdma_cm_id, private_data: *const c_void, len: u8) -> c_int {
    guard("rdma_reject", -1, || {
        // SAFETY: the program's contract.
        let i = unsafe { id(p) }?;
        let data = if private_data.is_null() || len == 0 {
            &[][..]
        } else {
            // SAFETY: the program's `len` bytes.
            unsafe { std::slice::from_raw_parts(private_data.cast::<u8>(), usize::from(len)) }
        };
        i.cm().reject(data)?;
        Ok(0)
    })
}

/// `rdma_reject_ece`: a reject (vRDMA has no ECE to carry).
pub unsafe extern "C" fn rdma_reject_ece(p: *mut rdma_cm_id, private_data: *const c_void, len: u8) -> c_int {
    // SAFETY: the same contract as rdma_reject.
    unsafe { rdma_reject(p, private_data, len) }
}

pub unsafe extern "C" fn rdma_establish(p: *mut rdma_cm_id) -> c_int {
    guard("rdma_establish", -1, || {
        // SAFETY: the program's contract.
        unsafe { id(p) }?.cm().establish()?;
        Ok(0)
    })
}

pub unsafe extern "C" fn rdma_disconnect(p: *mut rdma_cm_id) -> c_int {
    guard("rdma_disconnect", -1, || {
        // SAFETY: the program's contract.
        let i = unsafe { id(p) }?;
        // As librdmacm: the QP to ERR first, so its work is flushed (the
        // daemon does it for an attached QP, in the disconnect).
        if !i.attached() {
            i.to_err();
        }
        if let Err(e) = i.cm().disconnect() {
            if i.attached() {
                i.to_err();
            }
            return Err(e.into());
        }
        if i.attached() {
            i.qp_moved(QpState::Err);
        }
        complete(i)?;
        Ok(0)
    })
}

pub unsafe extern "C" fn rdma_init_qp_attr(
    p: *mut rdma_cm_id,
    attr: *mut ibv_qp_attr,
    mask: *mut c_int,
) -> c_int {
    guard("rdma_init_qp_attr", -1, || {
        // SAFETY: the program's contract.
        let i = unsafe { id(p) }?;
        if attr.is_null() || mask.is_null() {
            return Err(Error::sys(libc::EINVAL, "NULL attributes or mask"));
        }
        // SAFETY: the program's attributes, of which it sets qp_state.
        let want = unsafe { (*attr).qp_state };
        let state = u8::try_from(want)
            .ok()
            .and_then(QpState::from_raw)
            .ok_or(Error::sys(libc::EINVAL, "bad QP state"))?;
        let (q, m) = i.cm().init_qp_attr(state)?;
        // SAFETY: both checked non-NULL above.
        unsafe {
            *attr = attr_to_c(&q);
            *mask = m.bits() as c_int;
        }
        Ok(0)
    })
}

pub unsafe extern "C" fn rdma_set_option(
    p: *mut rdma_cm_id,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: usize,
) -> c_int {
    guard("rdma_set_option", -1, || {
        // SAFETY: the program's contract.
        let i = unsafe { id(p) }?;
        if val.is_null() {
            return Err(Error::sys(libc::EINVAL, "NULL option value"));
        }
        match (level, name) {
            (RDMA_OPTION_ID, RDMA_OPTION_ID_REUSEADDR) => {
                if len != std::mem::size_of::<c_int>() {
                    return Err(Error::sys(libc::EINVAL, "REUSEADDR takes an int"));
                }
                // SAFETY: an int, checked by its length.
                let on = unsafe { ptr::read_unaligned(val.cast::<c_int>()) } != 0;
                i.cm().set_reuseaddr(on)?;
            }
            // Accepted and without effect: vRDMA has no traffic classes,
            // IPv6 or timers of this kind.
            (RDMA_OPTION_ID, RDMA_OPTION_ID_TOS | RDMA_OPTION_ID_AFONLY | RDMA_OPTION_ID_ACK_TIMEOUT) => {}
            (RDMA_OPTION_IB, _) => {
                return Err(Error::sys(libc::ENOSYS, "IB path options are not supported"));
            }
            _ => return Err(Error::sys(libc::EINVAL, "unknown option")),
        }
        Ok(0)
    })
}

/// `rdma_migrate_id`, as librdmacm: to the program's `channel`, or
/// (NULL) to a channel of the id's own, which makes it synchronous. A
/// synchronous id moved to the program's channel is asynchronous from
/// then on: its own channel and kept event go, and its calls no longer
/// wait (libfabric's verbs provider resolves an endpoint's address on a
/// synchronous id, then moves the id to its event queue's channel and
/// resolves the route and connects asynchronously).
fn migrate_id(i: &Id, channel: *mut rdma_event_channel) -> Res<()> {
    let old_own = i.own_channel.load(Ordering::Acquire);
    let (target, own) = if channel.is_null() {
        if !old_own.is_null() {
            return Err(Error::sys(libc::EINVAL, "the id is synchronous already"));
        }
        (new_channel()?, true)
    } else {
        (channel.cast::<Channel>(), false)
    };
    // SAFETY: a live channel (the program's contract, or just made).
    if let Err(e) = i.cm().migrate(unsafe { &(*target).ch }) {
        if own {
            // SAFETY: made above, not shared.
            unsafe { rdma_destroy_event_channel(target.cast()) };
        }
        return Err(e.into());
    }
    // SAFETY: librdmacm's field of the live structure.
    unsafe { (*i.c()).channel = target.cast() };
    i.own_channel.store(if own { target } else { null_mut() }, Ordering::Release);
    if !old_own.is_null() {
        // SAFETY: as above: the synchronous id's last event, kept by
        // `complete`, is this library's to acknowledge.
        let ev = unsafe { std::mem::replace(&mut (*i.c()).event, null_mut()) };
        if !ev.is_null() {
            // SAFETY: an event `complete` kept.
            drop(unsafe { Box::from_raw(ev.cast::<Event>()) });
        }
        // SAFETY: the channel this library made for the id; the id's
        // unread events moved with it.
        unsafe { rdma_destroy_event_channel(old_own.cast()) };
    }
    Ok(())
}

pub unsafe extern "C" fn rdma_migrate_id(p: *mut rdma_cm_id, channel: *mut rdma_event_channel) -> c_int {
    guard("rdma_migrate_id", -1, || {
        // SAFETY: the program's contract.
        let i = unsafe { id(p) }?;
        migrate_id(i, channel)?;
        Ok(0)
    })
}

/// The port of an address of the id, network order.
fn port_of(s: &libc::sockaddr_storage) -> u16 {
    match c_int::from(s.ss_family) {
        libc::AF_INET | libc::AF_INET6 => {
            // SAFETY: both sockaddr_in and sockaddr_in6 have the port
            // right after the family.
            unsafe { (*(s as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>()).sin_port }
        }
        _ => 0,
    }
}

pub unsafe extern "C" fn rdma_get_src_port(p: *mut rdma_cm_id) -> u16 {
    guard("rdma_get_src_port", 0, || {
        // SAFETY: the program's contract.
        let c = unsafe { id(p) }?.c();
        // SAFETY: a field of the live structure.
        Ok(port_of(unsafe { &(*c).route.addr.src_storage }))
    })
}

pub unsafe extern "C" fn rdma_get_dst_port(p: *mut rdma_cm_id) -> u16 {
    guard("rdma_get_dst_port", 0, || {
        // SAFETY: the program's contract.
        let c = unsafe { id(p) }?.c();
        // SAFETY: a field of the live structure.
        Ok(port_of(unsafe { &(*c).route.addr.dst_storage }))
    })
}

pub unsafe extern "C" fn rdma_get_devices(num: *mut c_int) -> *mut *mut c_void {
    guard("rdma_get_devices", null_mut(), || {
        let ctx = lib()?.device()?.context;
        let list = Box::into_raw(Box::new([ctx, null_mut()])).cast::<*mut c_void>();
        if !num.is_null() {
            // SAFETY: the program's int.
            unsafe { *num = 1 };
        }
        Ok(list)
    })
}

pub unsafe extern "C" fn rdma_free_devices(list: *mut *mut c_void) {
    if !list.is_null() {
        // SAFETY: from rdma_get_devices, freed once.
        drop(unsafe { Box::from_raw(list.cast::<[*mut c_void; 2]>()) });
    }
}

pub unsafe extern "C" fn rdma_event_str(event: u32) -> *const c_char {
    let s: &'static CStr = match event {
        0 => c"RDMA_CM_EVENT_ADDR_RESOLVED",
        1 => c"RDMA_CM_EVENT_ADDR_ERROR",
        2 => c"RDMA_CM_EVENT_ROUTE_RESOLVED",
        3 => c"RDMA_CM_EVENT_ROUTE_ERROR",
        4 => c"RDMA_CM_EVENT_CONNECT_REQUEST",
        5 => c"RDMA_CM_EVENT_CONNECT_RESPONSE",
        6 => c"RDMA_CM_EVENT_CONNECT_ERROR",
        7 => c"RDMA_CM_EVENT_UNREACHABLE",
        8 => c"RDMA_CM_EVENT_REJECTED",
        9 => c"RDMA_CM_EVENT_ESTABLISHED",
        10 => c"RDMA_CM_EVENT_DISCONNECTED",
        11 => c"RDMA_CM_EVENT_DEVICE_REMOVAL",
        12 => c"RDMA_CM_EVENT_MULTICAST_JOIN",
        13 => c"RDMA_CM_EVENT_MULTICAST_ERROR",
        14 => c"RDMA_CM_EVENT_ADDR_CHANGE",
        15 => c"RDMA_CM_EVENT_TIMEWAIT_EXIT",
        _ => c"UNKNOWN EVENT",
    };
    s.as_ptr()
}

// ---------------------------------------------------------------------
// Events

/// Turns the daemon's event into the program's, doing librdmacm's part
/// on the way; `None` for an event of an id already destroyed.
fn convert(ch: *mut Channel, ev: CmEvent) -> Res<Option<*mut Event>> {
    let mut kind = ev.kind;
    let mut status = ev.status;
    let mut listen: *mut Id = null_mut();
    // The id this event holds (its listener's, for a request: the new id
    // is the program's from now on, and librdmacm counts the request on
    // the listener).
    let hold;
    let idp: *mut Id = if kind == EventKind::ConnectRequest {
        let lnum = ev.listen_id.ok_or(Error::sys(libc::EPROTO, "a connect request without its listener"))?;
        // SAFETY: the channel the event came from is live (we are in
        // rdma_get_cm_event on it).
        let lib = unsafe { (*ch).lib };
        let Some(h) = Hold::take(lib, lnum) else { return Ok(None) };
        listen = h.id();
        hold = h;
        // SAFETY: held: live until the hold goes.
        let (ps, context) = unsafe { ((*listen).ps, (*(*listen).c()).context) };
        // SAFETY: the channel the event came from is live (we are in
        // rdma_get_cm_event on it).
        let cm = CmId::from_request(unsafe { &(*ch).ch }, &ev, ps)?;
        // SAFETY: as above.
        let p = unsafe { new_id(ch, cm, ps, context) };
        if let Some(q) = &ev.peer {
            // SAFETY: just made, not yet shared.
            unsafe { (*p).request = Some((q.responder_resources, q.initiator_depth)) };
        }
        lib.ids().insert(ev.id, p as usize);
        p
    } else {
        // SAFETY: as above.
        let Some(h) = Hold::take(unsafe { (*ch).lib }, ev.id) else { return Ok(None) };
        let p = h.id();
        hold = h;
        p
    };
    // SAFETY: held (or just made, and the program's only from this event).
    let i = unsafe { &*idp };
    match kind {
        // The addresses the resolution or the request set (librdmacm
        // queries them here).
        EventKind::ConnectRequest | EventKind::AddrResolved => {
            i.attach_device()?;
            i.set_addrs(ev.local, ev.remote);
        }
        // The daemon moved an attached QP to RTS before it reported this.
        EventKind::Established if i.attached() => i.qp_moved(QpState::Rts),
        EventKind::ConnectResponse if !i.qp_ptr().is_null() => {
            // librdmacm's reply handling for an id with a QP.
            let up = i.bring_up().and_then(|()| i.cm().establish().map_err(Error::from));
            match up {
                Ok(()) => kind = EventKind::Established,
                Err(e) => {
                    i.to_err();
                    let _ = i.cm().reject(&[]);
                    kind = EventKind::ConnectError;
                    status = -e.errno();
                }
            }
            i.refresh_addrs()?;
        }
        EventKind::Rejected => i.to_err(),
        _ => {}
    }
    let peer = ev.peer.clone().unwrap_or(ConnParam {
        qp_num: 0,
        start_psn: 0,
        responder_resources: 0,
        initiator_depth: 0,
        flow_control: 0,
        retry_count: 0,
        rnr_retry_count: 0,
        srq: false,
        private_data: Vec::new(),
    });
    let mut e = Box::new(Event {
        // SAFETY: all-zero is valid for the C structure.
        c: unsafe { std::mem::zeroed() },
        private_data: peer.private_data.clone(),
        hold,
    });
    e.c.id = idp.cast();
    e.c.listen_id = listen.cast();
    e.c.event = kind as u32;
    e.c.status = status;
    let (pd_ptr, pd_len) = if e.private_data.is_empty() {
        (ptr::null(), 0)
    } else {
        (e.private_data.as_ptr().cast::<c_void>(), e.private_data.len().min(255) as u8)
    };
    if i.ps.is_ud() {
        // The peer's address vector, which the daemon gives beside a UD
        // id's RTR attributes once the peer is known.
        let ah_attr = match kind {
            EventKind::ConnectRequest | EventKind::Established => {
                i.cm().init_qp_attr(QpState::Rtr).ok().map(|(a, _)| ah_to_c(&a.ah_attr))
            }
            _ => None,
        };
        e.c.param.ud = rdma_ud_param {
            private_data: pd_ptr,
            private_data_len: pd_len,
            ah_attr: ah_attr.unwrap_or(ibv_ah_attr { port_num: 1, ..ibv_ah_attr::default() }),
            qp_num: peer.qp_num,
            qkey: ev.qkey,
        };
    } else {
        e.c.param.conn = rdma_conn_param {
            private_data: pd_ptr,
            private_data_len: pd_len,
            responder_resources: peer.responder_resources,
            initiator_depth: peer.initiator_depth,
            flow_control: peer.flow_control,
            retry_count: peer.retry_count,
            rnr_retry_count: peer.rnr_retry_count,
            srq: u8::from(peer.srq),
            qp_num: peer.qp_num,
        };
    }
    Ok(Some(Box::into_raw(e)))
}

pub unsafe extern "C" fn rdma_get_cm_event(
    channel: *mut rdma_event_channel,
    out: *mut *mut rdma_cm_event,
) -> c_int {
    guard("rdma_get_cm_event", -1, || {
        if out.is_null() {
            return Err(Error::sys(libc::EINVAL, "NULL event pointer"));
        }
        let e = next_event(channel)?;
        // SAFETY: checked non-NULL above.
        unsafe { *out = e.cast() };
        Ok(0)
    })
}

/// The channel's next event, waiting for it unless the descriptor is
/// non-blocking.
fn next_event(channel: *mut rdma_event_channel) -> Res<*mut Event> {
    // SAFETY: the caller's contract: a live channel.
    let ch = unsafe { self::channel(channel) }?;
    ch.waiters.fetch_add(1, Ordering::SeqCst);
    struct Leave<'a>(&'a AtomicU32);
    impl Drop for Leave<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
    let _leave = Leave(&ch.waiters);
    let nonblocking = || {
        // SAFETY: fcntl(F_GETFL) on the channel's descriptor.
        let flags = unsafe { libc::fcntl(ch.c.fd, libc::F_GETFL) };
        flags >= 0 && flags & libc::O_NONBLOCK != 0
    };
    let round = |wait: Option<Duration>| -> Res<Round<*mut Event>> {
        let ev = match wait {
            None => ch.ch.try_get_event()?,
            Some(w) => ch.ch.get_event(Some(w))?,
        };
        match ev {
            None => Ok(Round::Nothing),
            Some(ev) => Ok(convert(channel.cast::<Channel>(), ev)?.map_or(Round::Skipped, Round::Got)),
        }
    };
    wait_event(nonblocking, round, WAIT_SLICE)
}

/// What one look at a channel found.
#[derive(Debug)]
enum Round<T> {
    /// The program's event.
    Got(T),
    /// An event of an id already destroyed: taken, nothing to report.
    Skipped,
    /// No event (the wait's time passed).
    Nothing,
}

/// How long a blocking `rdma_get_cm_event` waits at a time before it
/// looks again whether the program made the descriptor non-blocking.
const WAIT_SLICE: Duration = Duration::from_secs(1);
/// Empty looks in a row that came back well before their time (a
/// descriptor readable with nothing to read) after which the call fails
/// with `EIO` rather than go on for ever; each is followed by a pause.
const MAX_EARLY_EMPTY: u32 = 100;
/// The pause after an empty look that came back early: no busy spin.
const EARLY_PAUSE: Duration = Duration::from_millis(10);

/// `rdma_get_cm_event`'s loop: `round(None)` looks without waiting (the
/// descriptor is non-blocking: `EAGAIN` when nothing is there),
/// `round(Some(slice))` waits up to `slice`. A blocking call waits as long
/// as the program's event takes, as the kernel's does, but in slices that
/// really wait: an empty look that came back early is followed by a
/// pause, and [`MAX_EARLY_EMPTY`] of them in a row fail the call (`EIO`).
/// A daemon that went away ends the wait through `round`, whose channel
/// then reports DEVICE_REMOVAL, then fails with `ENODEV`.
fn wait_event<T>(
    nonblocking: impl Fn() -> bool,
    mut round: impl FnMut(Option<Duration>) -> Res<Round<T>>,
    slice: Duration,
) -> Res<T> {
    let mut early = 0u32;
    loop {
        if nonblocking() {
            match round(None)? {
                Round::Got(e) => return Ok(e),
                Round::Skipped => continue,
                Round::Nothing => return Err(Error::quiet(libc::EAGAIN)),
            }
        }
        let started = Instant::now();
        match round(Some(slice))? {
            Round::Got(e) => return Ok(e),
            Round::Skipped => early = 0,
            Round::Nothing if started.elapsed() >= slice / 2 => early = 0,
            Round::Nothing => {
                early += 1;
                if early >= MAX_EARLY_EMPTY {
                    return Err(Error::sys(
                        libc::EIO,
                        "the event channel keeps waking with no event (is the daemon well?)",
                    ));
                }
                std::thread::sleep(EARLY_PAUSE);
            }
        }
    }
}

pub unsafe extern "C" fn rdma_ack_cm_event(event: *mut rdma_cm_event) -> c_int {
    guard("rdma_ack_cm_event", -1, || {
        if event.is_null() {
            return Err(Error::sys(libc::EINVAL, "NULL event"));
        }
        // SAFETY: from rdma_get_cm_event, acknowledged once.
        drop(unsafe { Box::from_raw(event.cast::<Event>()) });
        Ok(0)
    })
}

// ---------------------------------------------------------------------
// Endpoints: librdmacm's synchronous helpers over the calls above

/// `rdma_create_ep`: a synchronous id for `res`. A passive one
/// (`RAI_PASSIVE`) is bound to the source address and keeps `pd` and
/// `qp_init_attr` for the ids `rdma_get_request` returns; an active one
/// has its address and route resolved and, given `qp_init_attr`, its QP.
pub unsafe extern "C" fn rdma_create_ep(
    out: *mut *mut rdma_cm_id,
    res: *mut rdma_addrinfo,
    pd: *mut ibv_pd,
    qp_init_attr: *mut ibv_qp_init_attr,
) -> c_int {
    guard("rdma_create_ep", -1, || {
        // SAFETY: the program's addrinfo, from rdma_getaddrinfo.
        let r = unsafe { res.as_ref() }.ok_or(Error::sys(libc::EINVAL, "NULL rdma_addrinfo"))?;
        if out.is_null() {
            return Err(Error::sys(libc::EINVAL, "NULL id pointer"));
        }
        let ps = u32::try_from(r.ai_port_space).unwrap_or(0);
        let p = create_id(null_mut(), null_mut(), ps)?;
        // SAFETY: just made.
        let i = unsafe { &*p };
        let qp_type = u32::try_from(r.ai_qp_type).unwrap_or(IBV_QPT_RC);
        let set_up = || -> Res<()> {
            if r.ai_flags & RAI_PASSIVE != 0 {
                bind_addr(i, r.ai_src_addr)?;
                if !pd.is_null() {
                    // SAFETY: librdmacm's field of the id, not yet shared.
                    unsafe { (*i.c()).pd = pd };
                }
                // SAFETY: the program's attributes, if any.
                if let Some(a) = unsafe { qp_init_attr.as_ref() } {
                    let a = ibv_qp_init_attr { qp_type, ..*a };
                    *i.qp_init_attr.lock().unwrap_or_else(|p| p.into_inner()) = Some(a);
                }
                return Ok(());
            }
            resolve_addr(i, r.ai_src_addr, r.ai_dst_addr)?;
            resolve_route(i)?;
            // SAFETY: the program's attributes, if any (written back).
            if let Some(a) = unsafe { qp_init_attr.as_mut() } {
                a.qp_type = qp_type;
                create_qp(i, pd, a)?;
            }
            Ok(())
        };
        if let Err(e) = set_up() {
            let _ = destroy_qp(i);
            let _ = destroy_id(p.cast());
            return Err(e);
        }
        // SAFETY: checked non-NULL above.
        unsafe { *out = p.cast() };
        Ok(0)
    })
}

/// `rdma_get_request`: waits on a passive endpoint for a connect request
/// and returns its new id, synchronous on a channel of its own, with a
/// QP made from the endpoint's attributes. The request event stays in
/// the new id's `event` (the listener's, when the call fails).
pub unsafe extern "C" fn rdma_get_request(listen: *mut rdma_cm_id, out: *mut *mut rdma_cm_id) -> c_int {
    guard("rdma_get_request", -1, || {
        // SAFETY: the program's contract.
        let l = unsafe { id(listen) }?;
        let lch = l.own_channel.load(Ordering::Acquire);
        if lch.is_null() || out.is_null() {
            return Err(Error::sys(libc::EINVAL, "not an endpoint of rdma_create_ep (or NULL id pointer)"));
        }
        // SAFETY: the listener's field; its events are this library's.
        let old = unsafe { std::mem::replace(&mut (*l.c()).event, null_mut()) };
        if !old.is_null() {
            // SAFETY: an event kept by an earlier call.
            drop(unsafe { Box::from_raw(old.cast::<Event>()) });
        }
        let e = next_event(lch.cast())?;
        // SAFETY: live until acknowledged.
        let (kind, status, newp) = unsafe { ((*e).c.event, (*e).c.status, (*e).c.id) };
        let fail = |err: Error| {
            // SAFETY: as above: the listener keeps the event.
            unsafe { (*l.c()).event = e.cast() };
            Err(err)
        };
        if let Err(err) = event_outcome(kind, status) {
            return fail(err);
        }
        if kind != EventKind::ConnectRequest as u32 {
            return fail(Error::sys(libc::EINVAL, "an event other than a connect request"));
        }
        // SAFETY: the request's new id, live, not yet the program's.
        let n = unsafe { &*newp.cast::<Id>() };
        // Its own channel, as librdmacm gives a synchronous listener's ids.
        let got = new_channel().and_then(|ch| {
            // SAFETY: just made.
            if let Err(err) = n.cm().migrate(unsafe { &(*ch).ch }) {
                // SAFETY: made above, not shared.
                unsafe { rdma_destroy_event_channel(ch.cast()) };
                return Err(err.into());
            }
            // SAFETY: the new id's fields, not yet shared.
            unsafe { (*n.c()).channel = ch.cast() };
            n.own_channel.store(ch, Ordering::Release);
            let attr = *l.qp_init_attr.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(mut a) = attr {
                // SAFETY: the listener's PD field (NULL: one of the id's own).
                create_qp(n, unsafe { (*l.c()).pd }, &mut a)?;
            }
            Ok(())
        });
        if let Err(err) = got {
            return fail(err);
        }
        // SAFETY: the new id's field; `out` checked above.
        unsafe {
            (*n.c()).event = e.cast();
            *out = newp;
        }
        Ok(0)
    })
}

/// `rdma_destroy_ep`: the id's QP (and the CQs made for it), then the id.
pub unsafe extern "C" fn rdma_destroy_ep(p: *mut rdma_cm_id) {
    guard("rdma_destroy_ep", (), || {
        // SAFETY: the program's contract.
        destroy_qp(unsafe { id(p) }?)?;
        destroy_id(p)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A channel that always comes back at once with nothing (a
    /// descriptor readable with nothing to read) ends the wait with EIO
    /// after a bounded number of looks, pausing between them, where the
    /// loop once went round for ever.
    #[test]
    fn a_wait_that_keeps_finding_nothing_ends() {
        let mut looks = 0u32;
        let started = Instant::now();
        let r: Res<()> = wait_event(
            || false,
            |_| {
                looks += 1;
                assert!(looks <= MAX_EARLY_EMPTY, "looked {looks} times");
                Ok(Round::Nothing)
            },
            WAIT_SLICE,
        );
        assert_eq!(r.unwrap_err().errno(), libc::EIO);
        assert_eq!(looks, MAX_EARLY_EMPTY);
        assert!(started.elapsed() >= EARLY_PAUSE * (MAX_EARLY_EMPTY - 1), "paused between looks");
    }

    /// Empty looks that waited their time are a blocking call's wait (it
    /// goes on); skipped events are progress; the event ends it.
    #[test]
    fn a_wait_goes_on_through_real_waits_and_skipped_events() {
        let slice = Duration::from_millis(2);
        let mut n = 0u32;
        let r = wait_event(
            || false,
            |w| {
                n += 1;
                assert_eq!(w, Some(slice));
                Ok(match n {
                    k if k < 3 * MAX_EARLY_EMPTY && k % 2 == 0 => Round::Skipped,
                    k if k < 3 * MAX_EARLY_EMPTY => {
                        std::thread::sleep(slice);
                        Round::Nothing
                    }
                    _ => Round::Got(7),
                })
            },
            slice,
        );
        assert_eq!(r.unwrap(), 7);
    }

    /// A non-blocking descriptor: EAGAIN when nothing is there, after the
    /// skipped events.
    #[test]
    fn non_blocking_is_eagain() {
        let mut n = 0;
        let r: Res<()> = wait_event(
            || true,
            |w| {
                assert_eq!(w, None);
                n += 1;
                Ok(if n < 3 { Round::Skipped } else { Round::Nothing })
            },
            WAIT_SLICE,
        );
        assert_eq!(r.unwrap_err().errno(), libc::EAGAIN);
        assert_eq!(n, 3);
    }
}
