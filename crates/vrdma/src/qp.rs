//! Queue pairs.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vrdma_core::hca::MAX_RD_ATOMIC;
use vrdma_core::proto::{self, Reply, Request};
use vrdma_core::ring::{RecvWr, SendWr, CQE_SIZE, RECV_HEADER, SEND_HEADER, SGE_SIZE};
use vrdma_core::verbs::{
    AccessFlags, AhAttr, Gid, Mtu, QpAttr, QpAttrMask, QpCap, QpInitAttr, QpState, QpType, SendOpcode,
};
use vrdma_shm::{RingView, Segment};

use crate::context::Context;
use crate::control;
use crate::cq::CompletionQueue;
use crate::error::{Error, PostError, Result};
use crate::pd::ProtectionDomain;
use crate::srq::SharedReceiveQueue;

/// What a QP is created with (`ibv_qp_init_attr`).
#[derive(Debug, Clone, Copy)]
pub struct QpInit<'a> {
    /// [`QpType::Rc`] or [`QpType::Ud`]; the daemon refuses UC.
    pub qp_type: QpType,
    pub send_cq: &'a CompletionQueue,
    pub recv_cq: &'a CompletionQueue,
    /// Take receive requests from this SRQ instead of a receive queue of
    /// the QP's own (`cap.max_recv_wr`/`max_recv_sge` are then ignored).
    pub srq: Option<&'a SharedReceiveQueue>,
    /// Requested queue sizes; the daemon may grant more (see
    /// [`QueuePair::cap`]).
    pub cap: QpCap,
    /// Whether every send completes with a work completion, not only the
    /// signalled ones.
    pub sq_sig_all: bool,
}

impl<'a> QpInit<'a> {
    /// An RC QP with its own receive queue, signalling only sends that ask.
    pub fn rc(send_cq: &'a CompletionQueue, recv_cq: &'a CompletionQueue, cap: QpCap) -> Self {
        QpInit { qp_type: QpType::Rc, send_cq, recv_cq, srq: None, cap, sq_sig_all: false }
    }

    /// A UD QP with its own receive queue, signalling only sends that ask.
    /// Each receive buffer must hold the 40-byte GRH area plus the payload.
    pub fn ud(send_cq: &'a CompletionQueue, recv_cq: &'a CompletionQueue, cap: QpCap) -> Self {
        QpInit { qp_type: QpType::Ud, ..QpInit::rc(send_cq, recv_cq, cap) }
    }

    /// The same, taking receive requests from `srq`.
    pub fn with_srq(mut self, srq: &'a SharedReceiveQueue) -> Self {
        self.srq = Some(srq);
        self
    }

    /// The same, with `sq_sig_all` set to `all`.
    pub fn sig_all(mut self, all: bool) -> Self {
        self.sq_sig_all = all;
        self
    }
}

/// What a peer needs to connect to a QP: exchange these out of band (a TCP
/// socket, a file) and pass the remote one to [`QueuePair::connect`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Endpoint {
    /// The port's LID; 0 when the peer is reached by GID only.
    pub lid: u16,
    /// The port's GID (index 0).
    pub gid: Gid,
    /// The QP number.
    pub qpn: u32,
    /// The first packet sequence number the QP sends with (24 bits).
    pub psn: u32,
}

impl Endpoint {
    /// Bytes of [`to_bytes`](Self::to_bytes).
    pub const WIRE_LEN: usize = 26;

    /// A fixed little-endian encoding: lid (2), gid (16), qpn (4), psn (4).
    pub fn to_bytes(&self) -> [u8; Self::WIRE_LEN] {
        let mut b = [0u8; Self::WIRE_LEN];
        b[0..2].copy_from_slice(&self.lid.to_le_bytes());
        b[2..18].copy_from_slice(&self.gid.0);
        b[18..22].copy_from_slice(&self.qpn.to_le_bytes());
        b[22..26].copy_from_slice(&self.psn.to_le_bytes());
        b
    }

    /// Decodes [`to_bytes`](Self::to_bytes)'s form; `None` if `b` is not
    /// exactly [`WIRE_LEN`](Self::WIRE_LEN) bytes.
    pub fn from_bytes(b: &[u8]) -> Option<Endpoint> {
        let b: &[u8; Self::WIRE_LEN] = b.try_into().ok()?;
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[2..18]);
        Some(Endpoint {
            lid: u16::from_le_bytes([b[0], b[1]]),
            gid: Gid(gid),
            qpn: u32::from_le_bytes([b[18], b[19], b[20], b[21]]),
            psn: u32::from_le_bytes([b[22], b[23], b[24], b[25]]),
        })
    }
}

/// Defaults of [`QueuePair::connect`].
pub mod defaults {
    /// Local ACK timeout exponent: 4.096 µs × 2^14 ≈ 67 ms.
    pub const TIMEOUT: u8 = 14;
    /// Transport retries.
    pub const RETRY_CNT: u8 = 7;
    /// RNR retries (7: retry for ever).
    pub const RNR_RETRY: u8 = 7;
    /// Minimal RNR NAK timer code (12: 0.64 ms).
    pub const MIN_RNR_TIMER: u8 = 12;
    /// Outstanding RDMA reads/atomics, as initiator and as target.
    pub const MAX_RD_ATOMIC: u8 = super::MAX_RD_ATOMIC as u8;
    /// Port used by the typed helpers unless `to_init` named another.
    pub const PORT: u8 = 1;
}

/// A queue pair (`ibv_qp`).
///
/// Posting writes the shared rings directly (no system call unless the
/// daemon's engine sleeps) and is a safe operation: the daemon checks
/// every key, bound and permission of every request, and reports a bad one
/// as a failed work completion. Usable from several threads: the requests
/// of one call keep their order, those of concurrent calls may interleave.
#[derive(Debug)]
pub struct QueuePair {
    ctx: Context,
    pd: ProtectionDomain,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    srq: Option<SharedReceiveQueue>,
    qpn: u32,
    cap: QpCap,
    init: QpInitAttr,
    psn: u32,
    port: AtomicU8,
    sq: RingView,
    rq: Option<RingView>,
    /// Send WRs whose slots are free again: those covered by polled
    /// completions (the send CQ moves it), or dropped by a reset.
    sq_freed: Arc<crate::cq::SendSlots>,
    /// The direct path's grants of this QP ([`crate::direct`]).
    direct: crate::direct::DirectQp,
    /// Keeps the rings' mapping alive (the rings hold it too).
    _segment: Arc<Segment>,
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        self.send_cq.inner.remove_send_queue(self.qpn);
        self.recv_cq.inner.remove_inbox(self.qpn);
        self.ctx.inner.control.destroy(Request::DestroyQp { qp: self.qpn });
    }
}

fn ring_in(seg: &Arc<Segment>, spec: proto::RingSpec, what: &str) -> Result<RingView> {
    Ok(RingView::in_segment(
        seg.clone(),
        control::to_usize(spec.offset, what)?,
        spec.capacity,
        spec.stride as usize,
    )?)
}

/// A random 24-bit PSN.
fn random_psn(qpn: u32) -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(qpn);
    if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    (h.finish() as u32) & 0x00ff_ffff
}

/// Checks a send request against the QP's limits and slot size.
pub(crate) fn check_send(wr: &SendWr, cap: &QpCap, stride: usize) -> Result<()> {
    if wr.is_inline() {
        if matches!(wr.opcode, SendOpcode::RdmaRead) || wr.opcode.is_atomic() {
            return Err(Error::invalid(format!("{:?} cannot carry inline data", wr.opcode)));
        }
        let n = wr.inline_len as usize;
        if n > cap.max_inline_data as usize || SEND_HEADER + n > stride {
            return Err(Error::invalid(format!("{n} inline bytes, the QP allows {}", cap.max_inline_data)));
        }
    } else {
        let n = wr.sg.as_slice().len();
        if n > cap.max_send_sge as usize || SEND_HEADER + n * SGE_SIZE > stride {
            return Err(Error::invalid(format!("{n} SGEs, the QP allows {} per send", cap.max_send_sge)));
        }
    }
    Ok(())
}

/// Checks what a send on a UD QP needs besides [`check_send`]: an address
/// handle (the daemon checks that it is one of the QP's PD).
pub(crate) fn check_ud_send(wr: &SendWr) -> Result<()> {
    if wr.ud.ah == 0 {
        return Err(Error::invalid("a send on a UD QP needs an address handle (see wr::ud_send)"));
    }
    Ok(())
}

/// Checks a receive request against a queue's SGE limit and slot size.
pub(crate) fn check_recv(wr: &RecvWr, max_sge: u32, stride: usize) -> Result<()> {
    let n = wr.sg.as_slice().len();
    if n > max_sge as usize || RECV_HEADER + n * SGE_SIZE > stride {
        return Err(Error::invalid(format!("{n} SGEs, the queue allows {max_sge} per receive")));
    }
    Ok(())
}

/// Pushes receive requests into `ring` (shared by QPs and SRQs).
pub(crate) fn push_recvs(
    ctx: &Context,
    ring: &RingView,
    max_sge: u32,
    wrs: &[RecvWr],
    after: impl FnOnce() -> bool,
) -> std::result::Result<(), PostError> {
    let stride = ring.stride();
    push_all(
        ctx,
        ring,
        wrs,
        |_| true,
        |wr| check_recv(wr, max_sge, stride),
        |wr, slot| wr.encode(slot).is_ok(),
        after,
    )
}

/// Checks and pushes each request in turn, stopping at the first that
/// fails; if anything was posted, calls `after` (which names the QP to the
/// engine where it must, and says whether the engine must hear of the
/// posts) and then, if it must, rings the engine's doorbell once. A push
/// happens only while the ring has room and `admit` (given the producer
/// index, under the ring's producer lock) allows it.
fn push_all<W>(
    ctx: &Context,
    ring: &RingView,
    wrs: &[W],
    admit: impl Fn(u32) -> bool,
    check: impl Fn(&W) -> Result<()>,
    encode: impl Fn(&W, &mut [u8]) -> bool,
    after: impl FnOnce() -> bool,
) -> std::result::Result<(), PostError> {
    crate::idle::activity();
    let mut posted = 0usize;
    let mut result = Ok(());
    for (i, wr) in wrs.iter().enumerate() {
        if let Err(e) = check(wr) {
            result = Err(PostError::new(i, e));
            break;
        }
        match ring.try_push_if(&admit, |slot| {
            let ok = encode(wr, slot);
            debug_assert!(ok, "a checked request failed to encode");
        }) {
            Ok(true) => posted += 1,
            Ok(false) => {
                result = Err(PostError::new(i, Error::QueueFull));
                break;
            }
            Err(e) => {
                result = Err(PostError::new(i, e.into()));
                break;
            }
        }
    }
    if posted > 0 && after() {
        ctx.inner.kick();
    }
    result
}

/// What the daemon says of a QP it made (`Reply::Qp`, or the QP's part
/// of `Reply::CqQp`).
pub(crate) struct QpMade {
    pub created: vrdma_core::hca::QpCreated,
    pub segment_len: u64,
    pub sq: proto::RingSpec,
    pub rq: Option<proto::RingSpec>,
    pub inbox: Option<proto::RingSpec>,
}

impl QueuePair {
    pub(crate) fn create(pd: &ProtectionDomain, init: &QpInit<'_>) -> Result<QueuePair> {
        QueuePair::create_for(pd, init, None)
    }

    /// The QP, attached in the same call to the connection manager's id
    /// `attach` when there is one (`rdma_create_qp`).
    pub(crate) fn create_for(
        pd: &ProtectionDomain,
        init: &QpInit<'_>,
        attach: Option<u32>,
    ) -> Result<QueuePair> {
        pd.same_context(init.send_cq.context(), "the send CQ")?;
        pd.same_context(init.recv_cq.context(), "the receive CQ")?;
        if let Some(srq) = init.srq {
            pd.same_context(srq.context(), "the SRQ")?;
        }
        let ctx = pd.context();
        let attr = QpInitAttr {
            qp_type: init.qp_type,
            send_cq: init.send_cq.cqn(),
            recv_cq: init.recv_cq.cqn(),
            srq: init.srq.map(|s| s.srqn()),
            cap: init.cap,
            sq_sig_all: init.sq_sig_all,
        };
        let req = match attach {
            None => Request::CreateQp { pd: pd.pd_id(), init: attr },
            Some(id) => Request::Cm(proto::CmRequest::CreateQp { id, pd: pd.pd_id(), init: attr }),
        };
        let answer = ctx.inner.control.call(&req, &[])?;
        let Reply::Qp { created, segment_len, sq, rq, inbox } = answer.reply else {
            return Err(control::unexpected(&req, &answer.reply));
        };
        let placed = answer
            .take_rings(1, "Qp")
            .and_then(|mut p| p.pop().ok_or_else(|| Error::protocol("Qp reply lacks its descriptor")));
        QueuePair::from_reply(pd, init, attr, QpMade { created, segment_len, sq, rq, inbox }, placed)
    }

    /// The QP the daemon made (`made`, its segment `placed`), set up
    /// here; on failure the daemon's QP is destroyed.
    pub(crate) fn from_reply(
        pd: &ProtectionDomain,
        init: &QpInit<'_>,
        attr: QpInitAttr,
        made: QpMade,
        placed: Result<control::Placed>,
    ) -> Result<QueuePair> {
        let ctx = pd.context();
        let QpMade { created, segment_len, sq, rq, inbox } = made;
        let qpn = created.qpn;
        type Rings = (Arc<Segment>, RingView, Option<RingView>, Option<RingView>);
        let rings = (|| -> Result<Rings> {
            let seg = placed?.segment(segment_len, "QP segment length")?;
            let sq = ring_in(&seg, sq, "send ring offset")?;
            if sq.stride() < SEND_HEADER {
                return Err(Error::protocol(format!("send slots of {} bytes", sq.stride())));
            }
            let rq = match (init.srq, rq) {
                (Some(_), _) => None,
                (None, Some(spec)) => {
                    let rq = ring_in(&seg, spec, "receive ring offset")?;
                    if rq.stride() < RECV_HEADER {
                        return Err(Error::protocol(format!("receive slots of {} bytes", rq.stride())));
                    }
                    Some(rq)
                }
                (None, None) => {
                    return Err(Error::protocol("a QP without an SRQ came without a receive ring"))
                }
            };
            // An inbox with its own receive queue or an SRQ's.
            let inbox = match (&rq, inbox) {
                (_, Some(spec)) => {
                    let r = ring_in(&seg, spec, "inbox offset")?;
                    if r.stride() != CQE_SIZE {
                        return Err(Error::protocol(format!("inbox slots of {} bytes", r.stride())));
                    }
                    Some(r)
                }
                _ => None,
            };
            Ok((seg, sq, rq, inbox))
        })();
        let (segment, sq, rq, inbox) = match rings {
            Ok(r) => r,
            Err(e) => {
                ctx.inner.control.destroy(Request::DestroyQp { qp: qpn });
                return Err(e);
            }
        };
        let mut init_attr = attr;
        init_attr.cap = created.cap;
        let sq_freed = Arc::new(crate::cq::SendSlots::default());
        init.send_cq.inner.add_send_queue(qpn, sq_freed.clone());
        if let Some(inbox) = inbox {
            init.recv_cq.inner.add_inbox(qpn, Arc::new(inbox));
        }
        Ok(QueuePair {
            ctx: ctx.clone(),
            pd: pd.clone(),
            send_cq: init.send_cq.clone(),
            recv_cq: init.recv_cq.clone(),
            srq: init.srq.cloned(),
            qpn,
            cap: created.cap,
            init: init_attr,
            psn: random_psn(qpn),
            port: AtomicU8::new(defaults::PORT),
            sq,
            rq,
            sq_freed,
            direct: Default::default(),
            _segment: segment,
        })
    }

    /// The QP number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// The queue sizes granted (at least those asked for).
    pub fn cap(&self) -> QpCap {
        self.cap
    }

    /// The QP's type.
    pub fn qp_type(&self) -> QpType {
        self.init.qp_type
    }

    /// The attributes the QP was created with (granted capacities).
    pub fn init_attr(&self) -> QpInitAttr {
        self.init
    }

    /// The first PSN this QP sends with once connected; [`endpoint`](Self::endpoint)
    /// publishes it and [`connect`](Self::connect) uses it.
    pub fn psn(&self) -> u32 {
        self.psn
    }

    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    pub fn send_cq(&self) -> &CompletionQueue {
        &self.send_cq
    }

    pub fn recv_cq(&self) -> &CompletionQueue {
        &self.recv_cq
    }

    pub fn srq(&self) -> Option<&SharedReceiveQueue> {
        self.srq.as_ref()
    }

    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// The QP's current state, as the daemon last published it (it changes
    /// on [`modify`](Self::modify) and when the QP fails into
    /// [`QpState::Err`]). No system call.
    pub fn state(&self) -> QpState {
        let raw = self.sq.aux(proto::SQ_AUX_STATE).load(Ordering::Acquire);
        u8::try_from(raw).ok().and_then(QpState::from_raw).unwrap_or(QpState::Err)
    }

    /// `ibv_modify_qp`. The daemon applies the kernel's rules: each
    /// transition needs exactly its required attributes in `mask`.
    pub fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        self.ctx.inner.control.call_done(&Request::ModifyQp { qp: self.qpn, attr: *attr, mask })?;
        if mask.contains(QpAttrMask::STATE) && attr.qp_state == QpState::Reset {
            // The reset dropped what was posted, without completions, and
            // the daemon counted it retired: every slot is free. Completions
            // from before the reset, polled later, note less and are ignored.
            // A store, not an advance: it also recovers a count that a
            // confused daemon's completions moved past what was posted.
            self.sq_freed
                .freed
                .store(self.sq.aux(proto::SQ_AUX_RETIRED).load(Ordering::Acquire), Ordering::Release);
            // Carried WRs completed inside their post; a reset frees their
            // slots as it frees the engine's.
            let carried = self.sq_freed.carried.load(Ordering::Acquire);
            self.sq_freed.carried_freed.store(carried, Ordering::Release);
        }
        if mask.contains(QpAttrMask::PORT) {
            self.port.store(attr.port_num, Ordering::Relaxed);
        }
        Ok(())
    }

    /// `ibv_query_qp`: every attribute and the init attributes.
    pub fn query(&self) -> Result<(QpAttr, QpInitAttr)> {
        let req = Request::QueryQp { qp: self.qpn };
        match self.ctx.inner.control.call(&req, &[])?.reply {
            Reply::QpAttr { attr, init } => Ok((attr, init)),
            other => Err(control::unexpected(&req, &other)),
        }
    }

    /// RESET → INIT on `port` with pkey index 0, granting remote peers
    /// `access` (`REMOTE_WRITE`, `REMOTE_READ`, `REMOTE_ATOMIC`).
    pub fn to_init(&self, port: u8, access: AccessFlags) -> Result<()> {
        let attr = QpAttr {
            qp_state: QpState::Init,
            pkey_index: 0,
            port_num: port,
            qp_access_flags: access,
            ..QpAttr::default()
        };
        self.modify(
            &attr,
            QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
        )
    }

    /// INIT → RTR towards `remote`: receive from its QP starting at its
    /// PSN. The address vector uses the LID when `remote.lid` is not 0,
    /// else a GRH with `remote.gid`.
    pub fn to_rtr(&self, remote: &Endpoint, path_mtu: Mtu, min_rnr_timer: u8) -> Result<()> {
        let port = self.port.load(Ordering::Relaxed);
        let global = remote.lid == 0;
        let attr = QpAttr {
            qp_state: QpState::Rtr,
            path_mtu,
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn & 0x00ff_ffff,
            max_dest_rd_atomic: defaults::MAX_RD_ATOMIC,
            min_rnr_timer,
            ah_attr: AhAttr {
                dgid: remote.gid,
                dlid: remote.lid,
                is_global: global,
                sgid_index: 0,
                hop_limit: if global { 64 } else { 0 },
                port_num: port,
                ..AhAttr::default()
            },
            ..QpAttr::default()
        };
        self.modify(
            &attr,
            QpAttrMask::STATE
                | QpAttrMask::AV
                | QpAttrMask::PATH_MTU
                | QpAttrMask::DEST_QPN
                | QpAttrMask::RQ_PSN
                | QpAttrMask::MAX_DEST_RD_ATOMIC
                | QpAttrMask::MIN_RNR_TIMER,
        )
    }

    /// RTR → RTS: send starting at `sq_psn` (normally [`psn`](Self::psn)),
    /// with the ACK `timeout` exponent and the transport and RNR retry
    /// counts (7 = infinite RNR retries).
    pub fn to_rts(&self, sq_psn: u32, timeout: u8, retry_cnt: u8, rnr_retry: u8) -> Result<()> {
        let attr = QpAttr {
            qp_state: QpState::Rts,
            sq_psn: sq_psn & 0x00ff_ffff,
            timeout,
            retry_cnt,
            rnr_retry,
            max_rd_atomic: defaults::MAX_RD_ATOMIC,
            ..QpAttr::default()
        };
        self.modify(
            &attr,
            QpAttrMask::STATE
                | QpAttrMask::SQ_PSN
                | QpAttrMask::TIMEOUT
                | QpAttrMask::RETRY_CNT
                | QpAttrMask::RNR_RETRY
                | QpAttrMask::MAX_QP_RD_ATOMIC,
        )
    }

    /// UD: RESET → INIT on `port` with pkey index 0 and the Q_Key
    /// datagrams to this QP must carry (a send whose WR Q_Key has the high
    /// bit set uses this QP's own Q_Key instead).
    pub fn to_init_ud(&self, port: u8, qkey: u32) -> Result<()> {
        let attr =
            QpAttr { qp_state: QpState::Init, pkey_index: 0, port_num: port, qkey, ..QpAttr::default() };
        self.modify(&attr, QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::QKEY)
    }

    /// UD: INIT → RTR. From here the QP receives datagrams.
    pub fn to_rtr_ud(&self) -> Result<()> {
        self.modify(&QpAttr { qp_state: QpState::Rtr, ..QpAttr::default() }, QpAttrMask::STATE)
    }

    /// UD: RTR → RTS, sending from `sq_psn` (24 bits). From here the QP
    /// sends datagrams.
    pub fn to_rts_ud(&self, sq_psn: u32) -> Result<()> {
        let attr = QpAttr { qp_state: QpState::Rts, sq_psn: sq_psn & 0x00ff_ffff, ..QpAttr::default() };
        self.modify(&attr, QpAttrMask::STATE | QpAttrMask::SQ_PSN)
    }

    /// Brings the QP from RESET (or INIT) to RTS connected to `remote`,
    /// granting it `access`: [`to_init`](Self::to_init) on port 1,
    /// [`to_rtr`](Self::to_rtr) with the port's active MTU and a minimal
    /// RNR timer of 12, [`to_rts`](Self::to_rts) from [`psn`](Self::psn)
    /// with timeout 14, 7 retries and 7 (infinite) RNR retries; 16
    /// outstanding reads/atomics each way. A QP may connect to its own
    /// endpoint (loopback).
    pub fn connect(&self, remote: &Endpoint, access: AccessFlags) -> Result<()> {
        match self.state() {
            QpState::Reset => self.to_init(defaults::PORT, access)?,
            QpState::Init => {}
            s => return Err(Error::invalid(format!("connect needs a QP in RESET or INIT, not {s:?}"))),
        }
        let port = self.port.load(Ordering::Relaxed);
        let mtu = self.ctx.query_port(port)?.active_mtu;
        self.to_rtr(remote, mtu, defaults::MIN_RNR_TIMER)?;
        self.to_rts(self.psn, defaults::TIMEOUT, defaults::RETRY_CNT, defaults::RNR_RETRY)
    }

    /// This QP's endpoint for a peer: the LID and GID (index 0) of its
    /// port as `ctx` reports them, its QPN and [`psn`](Self::psn). `ctx`
    /// must be the QP's own context.
    pub fn endpoint(&self, ctx: &Context) -> Result<Endpoint> {
        if !Arc::ptr_eq(&ctx.inner, &self.ctx.inner) {
            return Err(Error::invalid("the context is not the QP's own"));
        }
        let port = self.port.load(Ordering::Relaxed);
        Ok(Endpoint {
            lid: ctx.query_port(port)?.lid,
            gid: ctx.query_gid(port, 0)?,
            qpn: self.qpn,
            psn: self.psn,
        })
    }

    /// `ibv_post_send`. Requests are checked against the QP as rdma-core
    /// checks them, then written to the send ring in order.
    ///
    /// Fails with `EINVAL` in RESET, INIT or RTR (nothing is posted), and
    /// for a request with more SGEs than `cap().max_send_sge`, more inline
    /// bytes than `cap().max_inline_data`, or inline data on a read or
    /// atomic, or (on a UD QP) without an address handle in `ud.ah`; with
    /// `ENOMEM` ([`Error::QueueFull`]) when the send queue is full: it
    /// holds `cap().max_send_wr` outstanding requests, each from its post
    /// until its completion is polled, or, if unsignaled, until the
    /// completion of a later request of the QP is polled (as on hardware,
    /// a program that never signals fills the queue), or a reset drops it.
    /// [`PostError::index`] names the first request not posted; those
    /// before it were posted. Posting in ERR (and, for UD, in SQE) is
    /// allowed: the requests complete with `WrFlushErr`.
    pub fn post_send(&self, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
        if wrs.is_empty() {
            return Ok(());
        }
        let state = self.state();
        if matches!(state, QpState::Reset | QpState::Init | QpState::Rtr) {
            return Err(PostError::new(0, Error::invalid(format!("cannot post sends to a QP in {state:?}"))));
        }
        let stride = self.sq.stride();
        let ud = self.init.qp_type == QpType::Ud;
        // Outstanding: posted (the producer index) minus freed (by polled
        // completions, as on hardware: not by completions still in the
        // CQ, so that a CQ as deep as the queue cannot overflow).
        // Wrapping arithmetic; a count from a confused daemon that runs
        // ahead of what was posted reads as a full queue, never as room
        // the ring lacks (the ring refuses on its own when full).
        let freed = &self.sq_freed;
        let start = if ud { 0 } else { self.post_direct(state, wrs)? };
        if start == wrs.len() {
            return Ok(());
        }
        let max = self.cap.max_send_wr;
        // WRs the direct path carried hold slots too, until their
        // completions (or later ones) are polled.
        let admit = |posted: u32| {
            posted
                .wrapping_sub(freed.freed.load(Ordering::Acquire))
                .saturating_add(freed.carried_outstanding())
                < max
        };
        push_all(
            &self.ctx,
            &self.sq,
            &wrs[start..],
            admit,
            |wr| {
                check_send(wr, &self.cap, stride)?;
                if ud {
                    check_ud_send(wr)?;
                }
                Ok(())
            },
            |wr, slot| wr.encode(slot).is_ok(),
            || {
                self.ctx.inner.name_posted(&self.sq, self.qpn);
                true
            },
        )
        .map_err(|mut e| {
            e.index += start;
            e
        })
    }

    /// The direct path ([`crate::direct`]): carries the leading WRs of
    /// `wrs` itself while it may, and returns how many it carried. It may
    /// while the QP is in RTS, its send CQ's completion channel (if it has
    /// one) lent this library its doorbell, and every WR it posted to the
    /// engine has completed and been polled (so that the engine's WRs and
    /// these keep their order, in the peer's memory and in the CQ).
    fn post_direct(&self, state: QpState, wrs: &[SendWr]) -> std::result::Result<usize, PostError> {
        if state != QpState::Rts {
            return Ok(0);
        }
        // With a channel, each carried completion raises the CQ's event as
        // the engine's would (`cq::raise_event`).
        let bell = match self.send_cq.inner.has_channel() {
            false => None,
            true => match self.send_cq.inner.direct_bell() {
                Some(b) => Some(b),
                None => return Ok(0),
            },
        };
        let stride = self.sq.stride();
        let slots = &self.sq_freed;
        let mut done = 0;
        for wr in wrs {
            // The engine has nothing of the QP unpolled, and the queue has
            // a free slot (else the engine path refuses it: ENOMEM).
            if self.sq.produced() != slots.freed.load(Ordering::Acquire)
                || slots.carried_outstanding() >= self.cap.max_send_wr
            {
                break;
            }
            check_send(wr, &self.cap, stride).map_err(|e| PostError::new(done, e))?;
            let signaled = wr.flags.contains(vrdma_core::verbs::SendFlags::SIGNALED) || self.init.sq_sig_all;
            // A completion that would not fit goes to the engine with its
            // WR, which then reports the overrun as it always does
            // (CQ_ERR, the QP to ERR).
            if signaled && !self.send_cq.inner.has_room() {
                break;
            }
            let byte_len = match self.direct.try_carry(&self.ctx, self.qpn, &self.pd.inner.local_keys, wr) {
                crate::direct::Carried::Engine => break,
                crate::direct::Carried::Done { byte_len } => byte_len,
            };
            let seq = slots.carried.fetch_add(1, Ordering::AcqRel).wrapping_add(1);
            if signaled {
                let mut wc = vrdma_core::ring::Cqe::new(
                    wr.wr_id,
                    vrdma_core::verbs::WcStatus::Success,
                    wr.opcode.wc_opcode(),
                    self.qpn,
                );
                wc.byte_len = byte_len;
                self.send_cq.inner.push_local(wc, Some((slots.clone(), seq)));
                if let Some(bell) = bell {
                    // A send completion is not solicited (the engine's).
                    self.send_cq.inner.raise_direct(bell, false, true);
                }
            }
            done += 1;
        }
        if done > 0 {
            crate::idle::activity();
        }
        Ok(done)
    }

    /// An unsignaled RDMA write of `src` (in order, `remote_addr` on) to
    /// the peer's region `rkey`, carried by the direct path within this
    /// call, from memory that need not be registered: the bytes are copied
    /// into the peer's region before it returns, as a hardware QP copies
    /// inline data into its work request. `Ok(false)`, nothing posted,
    /// where the direct path cannot take it now (the QP is not in RTS,
    /// its peer is not on this host or of this tenant, no grant for the
    /// key, work still on the engine path, the send queue full): the
    /// caller then posts it the usual way, from registered memory. What
    /// it posts after this keeps its order after it (the write landed).
    ///
    /// It holds a send-queue slot until a later signaled completion of the
    /// QP is polled, as any unsignaled WR does. A QP made with
    /// `sq_sig_all` takes none (its every WR completes).
    pub fn write_now(&self, src: &[&[u8]], remote_addr: u64, rkey: u32) -> Result<bool> {
        // A QP that signals every WR (`sq_sig_all`) has no unsignaled write.
        if self.init.qp_type != QpType::Rc || self.init.sq_sig_all || self.state() != QpState::Rts {
            return Ok(false);
        }
        let bell_needed = self.send_cq.inner.has_channel() && self.send_cq.inner.direct_bell().is_none();
        let slots = &self.sq_freed;
        if bell_needed
            || self.sq.produced() != slots.freed.load(Ordering::Acquire)
            || slots.carried_outstanding() >= self.cap.max_send_wr
        {
            return Ok(false);
        }
        let wr = crate::wr::rdma_write(0, &[], remote_addr, rkey)?;
        match self.direct.try_write_from(&self.ctx, self.qpn, &self.pd.inner.local_keys, &wr, src) {
            crate::direct::Carried::Engine => Ok(false),
            crate::direct::Carried::Done { .. } => {
                slots.carried.fetch_add(1, Ordering::AcqRel);
                crate::idle::activity();
                Ok(true)
            }
        }
    }

    /// How many of this QP's work requests the library carried itself
    /// on the direct path (`docs/direct-path.md`), and whether the daemon
    /// ever granted it a window.
    pub fn direct_stats(&self) -> (u64, bool) {
        (self.direct.carried.load(Ordering::Relaxed), self.direct.has_window())
    }

    /// `ibv_post_recv` to the QP's own receive queue.
    ///
    /// Fails with `EINVAL` for a QP in RESET or one that takes its
    /// receives from an SRQ (post to the SRQ instead), and for a request
    /// with more SGEs than `cap().max_recv_sge`; with `ENOMEM`
    /// ([`Error::QueueFull`]) when the receive queue is full.
    pub fn post_recv(&self, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        if wrs.is_empty() {
            return Ok(());
        }
        let Some(rq) = &self.rq else {
            return Err(PostError::new(
                0,
                Error::invalid("the QP takes its receives from an SRQ; post to the SRQ"),
            ));
        };
        if self.state() == QpState::Reset {
            return Err(PostError::new(0, Error::invalid("cannot post receives to a QP in Reset")));
        }
        push_recvs(&self.ctx, rq, self.cap.max_recv_sge, wrs, || {
            // A QP in ERR flushes its receives, so the engine must hear of
            // them. The fence orders the slots before the state is read,
            // pairing with the engine's publishing ERR before it flushes.
            std::sync::atomic::fence(Ordering::SeqCst);
            if self.state() == QpState::Err {
                self.ctx.inner.name_posted(&self.sq, self.qpn);
                return true;
            }
            // Otherwise the engine need not wake for a receive: it looks
            // at the queue when a message arrives, and a message that
            // found none waits for its RNR timer, not for this post. A
            // woken engine would take a CPU from the two programs of a
            // ping-pong (issue 17: once per message on the direct path).
            false
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vrdma_core::ring::{send_stride, Sge, SgeList};
    use vrdma_core::verbs::SendFlags;

    fn cap() -> QpCap {
        QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 2, max_recv_sge: 2, max_inline_data: 32 }
    }

    #[test]
    fn endpoint_bytes_round_trip() {
        let e = Endpoint { lid: 0x1234, gid: Gid::from_ipv4([10, 0, 0, 7]), qpn: 0x11, psn: 0xabcdef };
        let b = e.to_bytes();
        assert_eq!(Endpoint::from_bytes(&b), Some(e));
        assert_eq!(Endpoint::from_bytes(&b[..25]), None);
    }

    #[test]
    fn psn_is_24_bits() {
        for q in 0..100 {
            assert!(random_psn(q) <= 0xff_ffff);
        }
    }

    #[test]
    fn send_checks() {
        let c = cap();
        let stride = send_stride(c.max_send_sge, c.max_inline_data);
        let sge = Sge { addr: 1, length: 1, lkey: 1 };
        let mut wr = SendWr::new(1, SendOpcode::Send);
        wr.sg = SgeList::from_slice(&[sge; 2]).unwrap();
        assert!(check_send(&wr, &c, stride).is_ok());
        wr.sg = SgeList::from_slice(&[sge; 3]).unwrap();
        assert_eq!(check_send(&wr, &c, stride).unwrap_err().errno(), libc::EINVAL);

        let mut wr = SendWr::new(2, SendOpcode::Send);
        wr.flags = SendFlags::INLINE;
        wr.inline_len = 32;
        assert!(check_send(&wr, &c, stride).is_ok());
        wr.inline_len = 33;
        assert_eq!(check_send(&wr, &c, stride).unwrap_err().errno(), libc::EINVAL);
        wr.inline_len = 8;
        for op in [SendOpcode::RdmaRead, SendOpcode::AtomicCmpAndSwp, SendOpcode::AtomicFetchAndAdd] {
            wr.opcode = op;
            assert_eq!(check_send(&wr, &c, stride).unwrap_err().errno(), libc::EINVAL);
        }
        // A slot too small for what the cap claims is refused, not overrun.
        let mut wr = SendWr::new(3, SendOpcode::RdmaWrite);
        wr.sg = SgeList::from_slice(&[sge; 2]).unwrap();
        assert!(check_send(&wr, &c, SEND_HEADER + SGE_SIZE).is_err());
    }

    #[test]
    fn recv_checks() {
        let sge = Sge::default();
        let wr = RecvWr { wr_id: 1, sg: SgeList::from_slice(&[sge; 2]).unwrap() };
        assert!(check_recv(&wr, 2, RECV_HEADER + 2 * SGE_SIZE).is_ok());
        assert!(check_recv(&wr, 1, RECV_HEADER + 2 * SGE_SIZE).is_err());
        assert!(check_recv(&wr, 2, RECV_HEADER + SGE_SIZE).is_err());
    }
}
