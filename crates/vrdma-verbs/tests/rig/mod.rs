//! Two RC QPs connected to each other through the shim's C entry points,
//! on a daemon in this process: the set-up shared by `tests/no_alloc.rs`
//! and `examples/shim_cost.rs`. Everything here goes through the functions
//! and ops tables a C program reaches (`vrdma_verbs::raw`); the inline
//! verbs of `verbs.h` (`ibv_post_send`, `ibv_wr_*`, `ibv_start_poll`, ...)
//! are written out as the function-pointer calls they compile to.

#![allow(dead_code)]

use std::ffi::{c_int, c_void};
use std::mem::{offset_of, transmute};
use std::ptr::null_mut;

use vrdma_verbs::raw::*;

// verbs.h constants.
pub const IBV_ACCESS_LOCAL_WRITE: c_int = 1;
pub const IBV_ACCESS_REMOTE_WRITE: c_int = 2;
pub const IBV_ACCESS_REMOTE_READ: c_int = 4;
pub const IBV_QPT_RC: u32 = 2;
pub const IBV_QPS_INIT: u32 = 1;
pub const IBV_QPS_RTR: u32 = 2;
pub const IBV_QPS_RTS: u32 = 3;
pub const IBV_QP_STATE: c_int = 1;
pub const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
pub const IBV_QP_PKEY_INDEX: c_int = 1 << 4;
pub const IBV_QP_PORT: c_int = 1 << 5;
pub const IBV_QP_AV: c_int = 1 << 7;
pub const IBV_QP_PATH_MTU: c_int = 1 << 8;
pub const IBV_QP_TIMEOUT: c_int = 1 << 9;
pub const IBV_QP_RETRY_CNT: c_int = 1 << 10;
pub const IBV_QP_RNR_RETRY: c_int = 1 << 11;
pub const IBV_QP_RQ_PSN: c_int = 1 << 12;
pub const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
pub const IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
pub const IBV_QP_SQ_PSN: c_int = 1 << 16;
pub const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
pub const IBV_QP_DEST_QPN: c_int = 1 << 20;
pub const IBV_MTU_1024: u32 = 3;
pub const IBV_WR_RDMA_WRITE: u32 = 0;
pub const IBV_WR_SEND: u32 = 2;
pub const IBV_SEND_SIGNALED: u32 = 1 << 1;
pub const IBV_WC_SUCCESS: u32 = 0;
pub const IBV_WC_RDMA_WRITE: u32 = 1;
pub const IBV_WC_SEND: u32 = 0;
pub const IBV_WC_RECV: u32 = 128;
pub const IBV_QP_EX_WITH_RDMA_WRITE: u64 = 1 << 0;
pub const IBV_QP_EX_WITH_SEND: u64 = 1 << 2;
pub const IBV_WC_EX_WITH_BYTE_LEN: u64 = 1 << 0;
pub const IBV_WC_EX_WITH_QP_NUM: u64 = 1 << 2;

/// Bytes of each QP's registered buffer.
pub const BUF: usize = 4096;

/// One side: a QP (from `ibv_create_qp_ex`, so that it has both the ops
/// table and the `ibv_wr_*` builders), its CQ (from `ibv_create_cq_ex`,
/// polled both ways) and its registered buffer.
pub struct Side {
    pub cq: *mut ibv_cq_ex,
    pub qp: *mut ibv_qp,
    pub qpx: *mut ibv_qp_ex,
    pub buf: *mut u8,
    pub mr: *mut ibv_mr,
}

pub struct Pair {
    pub ctx: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub sides: [Side; 2],
    /// A CQ with a completion channel that no QP uses: `req_notify_cq`
    /// on it arms it for real, and no event ever fires.
    pub armed_cq: *mut ibv_cq,
    pub channel: *mut ibv_comp_channel,
}

/// The `struct verbs_context` in front of `ctx` (`verbs_get_ctx`).
///
/// # Safety
/// `ctx` must be a live context from `ibv_open_device`.
unsafe fn vctx(ctx: *mut ibv_context) -> *mut verbs_context {
    unsafe { ctx.cast::<u8>().sub(offset_of!(verbs_context, context)).cast() }
}

macro_rules! check {
    ($e:expr, $what:expr) => {{
        let r = $e;
        assert_eq!(r, 0, "{} failed: {}", $what, r);
    }};
}

impl Pair {
    /// Opens the device of the daemon on `VRDMA_SOCKET` and connects two
    /// RC QPs of `depth` send and receive requests to each other.
    pub fn new(depth: u32) -> Pair {
        // SAFETY: the verbs' contracts, kept below: live objects, valid
        // attribute structures, the buffers mapped for the pair's life.
        unsafe {
            let mut n: c_int = 0;
            let list = ibv_get_device_list(&mut n);
            assert!(!list.is_null() && n == 1, "no vRDMA device (is VRDMA_SOCKET set?)");
            let ctx = ibv_open_device(*list);
            ibv_free_device_list(list);
            assert!(!ctx.is_null(), "ibv_open_device");
            let mut port: ibv_port_attr = std::mem::zeroed();
            check!(ibv_query_port(ctx, 1, (&raw mut port).cast()), "ibv_query_port");
            let pd = ibv_alloc_pd(ctx);
            assert!(!pd.is_null(), "ibv_alloc_pd");
            let v = vctx(ctx);
            let create_cq_ex: unsafe extern "C" fn(
                *mut ibv_context,
                *mut ibv_cq_init_attr_ex,
            ) -> *mut ibv_cq_ex = transmute((*v).create_cq_ex.expect("create_cq_ex"));
            let create_qp_ex: unsafe extern "C" fn(
                *mut ibv_context,
                *mut ibv_qp_init_attr_ex,
            ) -> *mut ibv_qp = transmute((*v).create_qp_ex.expect("create_qp_ex"));
            let side = |_: usize| {
                let mut ca = ibv_cq_init_attr_ex {
                    cqe: depth * 2,
                    cq_context: null_mut(),
                    channel: null_mut(),
                    comp_vector: 0,
                    wc_flags: IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_QP_NUM,
                    comp_mask: 0,
                    flags: 0,
                    parent_domain: null_mut(),
                };
                let cq = create_cq_ex(ctx, &mut ca);
                assert!(!cq.is_null(), "ibv_create_cq_ex");
                let mut qa: ibv_qp_init_attr_ex = std::mem::zeroed();
                qa.send_cq = cq.cast();
                qa.recv_cq = cq.cast();
                qa.cap = ibv_qp_cap {
                    max_send_wr: depth,
                    max_recv_wr: depth,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline_data: 0,
                };
                qa.qp_type = IBV_QPT_RC;
                qa.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
                qa.pd = pd;
                qa.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_SEND;
                let qp = create_qp_ex(ctx, &mut qa);
                assert!(!qp.is_null(), "ibv_create_qp_ex");
                let qpx = ibv_qp_to_qp_ex(qp);
                assert!(!qpx.is_null(), "ibv_qp_to_qp_ex");
                let buf = libc::mmap(
                    null_mut(),
                    BUF,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                );
                assert!(buf != libc::MAP_FAILED, "mmap");
                let access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
                let mr = ibv_reg_mr(pd, buf, BUF, access);
                assert!(!mr.is_null(), "ibv_reg_mr");
                Side { cq, qp, qpx, buf: buf.cast(), mr }
            };
            let sides = [side(0), side(1)];
            for (me, peer) in [(0, 1), (1, 0)] {
                let qp = sides[me].qp;
                let mut a: ibv_qp_attr = std::mem::zeroed();
                a.qp_state = IBV_QPS_INIT;
                a.port_num = 1;
                a.qp_access_flags =
                    (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ) as u32;
                check!(
                    ibv_modify_qp(
                        qp,
                        &mut a,
                        IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS
                    ),
                    "modify to INIT"
                );
                let mut a: ibv_qp_attr = std::mem::zeroed();
                a.qp_state = IBV_QPS_RTR;
                a.path_mtu = IBV_MTU_1024;
                a.dest_qp_num = (*sides[peer].qp).qp_num;
                a.rq_psn = 0;
                a.max_dest_rd_atomic = 1;
                a.min_rnr_timer = 12;
                a.ah_attr.dlid = port.lid;
                a.ah_attr.port_num = 1;
                check!(
                    ibv_modify_qp(
                        qp,
                        &mut a,
                        IBV_QP_STATE
                            | IBV_QP_AV
                            | IBV_QP_PATH_MTU
                            | IBV_QP_DEST_QPN
                            | IBV_QP_RQ_PSN
                            | IBV_QP_MAX_DEST_RD_ATOMIC
                            | IBV_QP_MIN_RNR_TIMER
                    ),
                    "modify to RTR"
                );
                let mut a: ibv_qp_attr = std::mem::zeroed();
                a.qp_state = IBV_QPS_RTS;
                a.sq_psn = 0;
                a.timeout = 14;
                a.retry_cnt = 7;
                a.rnr_retry = 7;
                a.max_rd_atomic = 1;
                check!(
                    ibv_modify_qp(
                        qp,
                        &mut a,
                        IBV_QP_STATE
                            | IBV_QP_SQ_PSN
                            | IBV_QP_TIMEOUT
                            | IBV_QP_RETRY_CNT
                            | IBV_QP_RNR_RETRY
                            | IBV_QP_MAX_QP_RD_ATOMIC
                    ),
                    "modify to RTS"
                );
            }
            let channel = ibv_create_comp_channel(ctx);
            assert!(!channel.is_null(), "ibv_create_comp_channel");
            let armed_cq = ibv_create_cq(ctx, 1, null_mut(), channel, 0);
            assert!(!armed_cq.is_null(), "ibv_create_cq");
            Pair { ctx, pd, sides, armed_cq, channel }
        }
    }

    /// The ops table of the context.
    pub fn ops(&self) -> &ibv_context_ops {
        // SAFETY: the context lives as long as the pair.
        unsafe { &(*self.ctx).ops }
    }

    /// `ibv_post_send` on side `s` of a signaled 8-byte RDMA write of the
    /// start of its buffer to the peer's buffer.
    pub fn post_write(&self, s: usize, wr_id: u64) {
        let (me, peer) = (&self.sides[s], &self.sides[1 - s]);
        // SAFETY: live objects of the pair.
        let (lkey, rkey) = unsafe { ((*me.mr).lkey, (*peer.mr).rkey) };
        let mut sge = ibv_sge { addr: me.buf as u64, length: 8, lkey };
        let mut wr = ibv_send_wr {
            wr_id,
            next: null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
            opcode: IBV_WR_RDMA_WRITE,
            send_flags: IBV_SEND_SIGNALED,
            imm_data: 0,
            wr: ibv_send_wr_wr { rdma: ibv_send_wr_rdma { remote_addr: peer.buf as u64 + 64, rkey } },
            remote_srqn: 0,
            _bind_mw_tso: [0; 6],
        };
        let mut bad = null_mut();
        // SAFETY: as `ibv_post_send` (verbs.h) calls it.
        let r = unsafe { (self.ops().post_send.expect("post_send"))(me.qp, &mut wr, &mut bad) };
        assert_eq!(r, 0, "post_send");
    }

    /// `ibv_post_send` on side `s` of a signaled 8-byte send.
    pub fn post_send(&self, s: usize, wr_id: u64) {
        let me = &self.sides[s];
        // SAFETY: live objects of the pair.
        let lkey = unsafe { (*me.mr).lkey };
        let mut sge = ibv_sge { addr: me.buf as u64, length: 8, lkey };
        let mut wr = ibv_send_wr {
            wr_id,
            next: null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
            opcode: IBV_WR_SEND,
            send_flags: IBV_SEND_SIGNALED,
            imm_data: 0,
            wr: ibv_send_wr_wr { rdma: ibv_send_wr_rdma { remote_addr: 0, rkey: 0 } },
            remote_srqn: 0,
            _bind_mw_tso: [0; 6],
        };
        let mut bad = null_mut();
        // SAFETY: as `ibv_post_send` (verbs.h) calls it.
        let r = unsafe { (self.ops().post_send.expect("post_send"))(me.qp, &mut wr, &mut bad) };
        assert_eq!(r, 0, "post_send");
    }

    /// `ibv_post_recv` on side `s` of a 64-byte receive into its buffer.
    pub fn post_recv(&self, s: usize, wr_id: u64) {
        let me = &self.sides[s];
        // SAFETY: live objects of the pair.
        let lkey = unsafe { (*me.mr).lkey };
        let mut sge = ibv_sge { addr: me.buf as u64 + 1024, length: 64, lkey };
        let mut wr = ibv_recv_wr { wr_id, next: null_mut(), sg_list: &mut sge, num_sge: 1 };
        let mut bad = null_mut();
        // SAFETY: as `ibv_post_recv` (verbs.h) calls it.
        let r = unsafe { (self.ops().post_recv.expect("post_recv"))(me.qp, &mut wr, &mut bad) };
        assert_eq!(r, 0, "post_recv");
    }

    /// The `ibv_wr_*` API on side `s`: one signaled 8-byte RDMA write
    /// (`send` false) or send, posted by `ibv_wr_complete`.
    pub fn wr_post(&self, s: usize, wr_id: u64, send: bool) {
        let (me, peer) = (&self.sides[s], &self.sides[1 - s]);
        let q = me.qpx;
        type Q = *mut ibv_qp_ex;
        // SAFETY: the builders as verbs.h's inline `ibv_wr_*` call them, on
        // a live QP created with these operations.
        unsafe {
            let (lkey, rkey) = ((*me.mr).lkey, (*peer.mr).rkey);
            let start: unsafe extern "C" fn(Q) = transmute((*q).wr_start.expect("wr_start"));
            let complete: unsafe extern "C" fn(Q) -> c_int =
                transmute((*q).wr_complete.expect("wr_complete"));
            let set_sge: unsafe extern "C" fn(Q, u32, u64, u32) =
                transmute((*q).wr_set_sge.expect("wr_set_sge"));
            start(q);
            (*q).wr_id = wr_id;
            (*q).wr_flags = IBV_SEND_SIGNALED;
            if send {
                let op: unsafe extern "C" fn(Q) = transmute((*q).wr_send.expect("wr_send"));
                op(q);
            } else {
                let op: unsafe extern "C" fn(Q, u32, u64) =
                    transmute((*q).wr_rdma_write.expect("wr_rdma_write"));
                op(q, rkey, peer.buf as u64 + 64);
            }
            set_sge(q, lkey, me.buf as u64, 8);
            assert_eq!(complete(q), 0, "ibv_wr_complete");
        }
    }

    /// `ibv_poll_cq` on side `s` until one completion comes; returns it.
    pub fn poll_one(&self, s: usize) -> ibv_wc {
        let cq = self.sides[s].cq.cast::<ibv_cq>();
        let poll = self.ops().poll_cq.expect("poll_cq");
        let mut wc = ibv_wc::default();
        loop {
            // SAFETY: as `ibv_poll_cq` (verbs.h) calls it.
            let n = unsafe { poll(cq, 1, &mut wc) };
            assert!(n >= 0, "poll_cq: {n}");
            if n == 1 {
                return wc;
            }
        }
    }

    /// `ibv_start_poll` / `ibv_end_poll` on side `s` until one completion
    /// comes; returns its `(wr_id, status, opcode, byte_len)`.
    pub fn poll_one_ex(&self, s: usize) -> (u64, u32, u32, u32) {
        let cq = self.sides[s].cq;
        type C = *mut ibv_cq_ex;
        // SAFETY: the extended-poll operations as verbs.h's inline
        // wrappers call them, on a CQ from `ibv_create_cq_ex`.
        unsafe {
            let start: unsafe extern "C" fn(C, *mut ibv_poll_cq_attr) -> c_int =
                transmute((*cq).start_poll.expect("start_poll"));
            let end: unsafe extern "C" fn(C) = transmute((*cq).end_poll.expect("end_poll"));
            let opcode: unsafe extern "C" fn(C) -> u32 = transmute((*cq).read_opcode.expect("read_opcode"));
            let byte_len: unsafe extern "C" fn(C) -> u32 =
                transmute((*cq).read_byte_len.expect("read_byte_len"));
            let mut attr = ibv_poll_cq_attr { comp_mask: 0 };
            loop {
                match start(cq, &mut attr) {
                    0 => {
                        let r = ((*cq).wr_id, (*cq).status, opcode(cq), byte_len(cq));
                        end(cq);
                        return r;
                    }
                    libc::ENOENT => continue,
                    e => panic!("ibv_start_poll: {e}"),
                }
            }
        }
    }

    /// `ibv_next_poll` with nothing to take: checks the operation too.
    pub fn next_poll_empty(&self, s: usize) {
        let cq = self.sides[s].cq;
        type C = *mut ibv_cq_ex;
        // SAFETY: as in `poll_one_ex`.
        unsafe {
            let start: unsafe extern "C" fn(C, *mut ibv_poll_cq_attr) -> c_int =
                transmute((*cq).start_poll.expect("start_poll"));
            let next: unsafe extern "C" fn(C) -> c_int = transmute((*cq).next_poll.expect("next_poll"));
            let end: unsafe extern "C" fn(C) = transmute((*cq).end_poll.expect("end_poll"));
            let mut attr = ibv_poll_cq_attr { comp_mask: 0 };
            if start(cq, &mut attr) == 0 {
                while next(cq) == 0 {}
                end(cq);
            }
        }
    }

    /// `ibv_req_notify_cq` on the CQ with a channel.
    pub fn req_notify(&self) {
        // SAFETY: as `ibv_req_notify_cq` (verbs.h) calls it.
        let r = unsafe { (self.ops().req_notify_cq.expect("req_notify_cq"))(self.armed_cq, 0) };
        assert_eq!(r, 0, "req_notify_cq");
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        // SAFETY: the pair's own objects, destroyed once, in order.
        unsafe {
            for s in &self.sides {
                check!(ibv_destroy_qp(s.qp), "ibv_destroy_qp");
            }
            for s in &self.sides {
                check!(ibv_dereg_mr(s.mr), "ibv_dereg_mr");
                check!(ibv_destroy_cq(s.cq.cast()), "ibv_destroy_cq");
                libc::munmap(s.buf.cast::<c_void>(), BUF);
            }
            check!(ibv_destroy_cq(self.armed_cq), "ibv_destroy_cq");
            check!(ibv_destroy_comp_channel(self.channel), "ibv_destroy_comp_channel");
            check!(ibv_dealloc_pd(self.pd), "ibv_dealloc_pd");
            check!(ibv_close_device(self.ctx), "ibv_close_device");
        }
    }
}
