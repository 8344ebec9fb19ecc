//! The C structures of `<infiniband/verbs.h>` (rdma-core 44, x86-64 and
//! other LP64 Linux targets), field for field.
//!
//! C programs compiled against rdma-core's headers read and write these
//! structures directly, and the data-path verbs (`ibv_post_send`,
//! `ibv_poll_cq`, ...) are `static inline` functions that jump through
//! [`ibv_context_ops`] inside [`ibv_context`]. So the layouts are the ABI:
//! every size and offset below is checked at compile time against the
//! values a C compiler gives for the real header (the numbers come from a
//! small C program printing `sizeof`/`offsetof` over
//! `/usr/include/infiniband/verbs.h`).
//!
//! Names follow the C ones so that a reader can hold this file next to
//! `verbs.h`. Function pointers the shim does not provide are
//! [`VoidFn`] (always `None`): the inline wrappers of `verbs.h` treat a
//! NULL operation as "not supported" (`EOPNOTSUPP`/`ENOSYS`) or take a
//! legacy path.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void};
use std::mem::{offset_of, size_of};

use libc::{pthread_cond_t, pthread_mutex_t};

/// A function pointer the shim leaves NULL.
pub type VoidFn = Option<unsafe extern "C" fn()>;

pub const IBV_SYSFS_NAME_MAX: usize = 64;
pub const IBV_SYSFS_PATH_MAX: usize = 256;

// enum ibv_node_type / ibv_transport_type
pub const IBV_NODE_CA: c_int = 1;
pub const IBV_TRANSPORT_IB: c_int = 0;

// enum ibv_link_layer
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;

// enum ibv_gid_type (struct ibv_gid_entry) and enum ibv_gid_type_sysfs
pub const IBV_GID_TYPE_IB: u32 = 0;
pub const IBV_GID_TYPE_ROCE_V2: u32 = 2;
pub const IBV_GID_TYPE_SYSFS_IB_ROCE_V1: c_int = 0;
pub const IBV_GID_TYPE_SYSFS_ROCE_V2: c_int = 1;

// enum ibv_fork_status
pub const IBV_FORK_UNNEEDED: c_int = 2;

// enum ibv_srq_attr_mask
pub const IBV_SRQ_MAX_WR: c_int = 1;
pub const IBV_SRQ_LIMIT: c_int = 2;

// enum ibv_qp_type
pub const IBV_QPT_UD: u32 = 4;

// enum ibv_access_flags: the "optional" range (IBV_ACCESS_OPTIONAL_FIRST
// = 1 << 20 up to IBV_ACCESS_OPTIONAL_LAST = 1 << 30, exclusive), which a
// device that does not know a flag in it must ignore.
pub const IBV_ACCESS_OPTIONAL_RANGE: u32 = ((1 << 30) - 1) & !((1 << 20) - 1);

/// `__VERBS_ABI_IS_EXTENDED`: `ibv_context.abi_compat` of a context that
/// has a `verbs_context` in front of it.
pub const VERBS_ABI_IS_EXTENDED: *mut c_void = usize::MAX as *mut c_void;

/// `union ibv_gid` (its `global` member makes it 8-byte aligned).
#[repr(C, align(8))]
#[derive(Clone, Copy, Default)]
pub struct ibv_gid {
    pub raw: [u8; 16],
}

#[repr(C)]
pub struct _ibv_device_ops {
    pub _dummy1: VoidFn,
    pub _dummy2: VoidFn,
}

#[repr(C)]
pub struct ibv_device {
    pub _ops: _ibv_device_ops,
    pub node_type: c_int,
    pub transport_type: c_int,
    pub name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_path: [c_char; IBV_SYSFS_PATH_MAX],
    pub ibdev_path: [c_char; IBV_SYSFS_PATH_MAX],
}

pub type PollCqFn = unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int;
pub type ReqNotifyCqFn = unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int;
pub type PostSrqRecvFn = unsafe extern "C" fn(*mut ibv_srq, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;
pub type PostSendFn = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int;
pub type PostRecvFn = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;

/// The operations the `static inline` verbs call. The `_compat_*` slots
/// belong to libibverbs 1.0 binaries and stay NULL.
#[repr(C)]
pub struct ibv_context_ops {
    pub _compat_query_device: VoidFn,
    pub _compat_query_port: VoidFn,
    pub _compat_alloc_pd: VoidFn,
    pub _compat_dealloc_pd: VoidFn,
    pub _compat_reg_mr: VoidFn,
    pub _compat_rereg_mr: VoidFn,
    pub _compat_dereg_mr: VoidFn,
    pub alloc_mw: VoidFn,
    pub bind_mw: VoidFn,
    pub dealloc_mw: VoidFn,
    pub _compat_create_cq: VoidFn,
    pub poll_cq: Option<PollCqFn>,
    pub req_notify_cq: Option<ReqNotifyCqFn>,
    pub _compat_cq_event: VoidFn,
    pub _compat_resize_cq: VoidFn,
    pub _compat_destroy_cq: VoidFn,
    pub _compat_create_srq: VoidFn,
    pub _compat_modify_srq: VoidFn,
    pub _compat_query_srq: VoidFn,
    pub _compat_destroy_srq: VoidFn,
    pub post_srq_recv: Option<PostSrqRecvFn>,
    pub _compat_create_qp: VoidFn,
    pub _compat_query_qp: VoidFn,
    pub _compat_modify_qp: VoidFn,
    pub _compat_destroy_qp: VoidFn,
    pub post_send: Option<PostSendFn>,
    pub post_recv: Option<PostRecvFn>,
    pub _compat_create_ah: VoidFn,
    pub _compat_destroy_ah: VoidFn,
    pub _compat_attach_mcast: VoidFn,
    pub _compat_detach_mcast: VoidFn,
    pub _compat_async_event: VoidFn,
}

#[repr(C)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: pthread_mutex_t,
    pub abi_compat: *mut c_void,
}

pub type QueryPortFn = unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr, usize) -> c_int;
pub type QueryDeviceExFn = unsafe extern "C" fn(
    *mut ibv_context,
    *const ibv_query_device_ex_input,
    *mut ibv_device_attr_ex,
    usize,
) -> c_int;

/// The extended operations, reached by `verbs_get_ctx_op()`: the
/// structure lies immediately before the `ibv_context` the application
/// holds, which is its last member.
#[repr(C)]
pub struct verbs_context {
    pub query_port: Option<QueryPortFn>,
    pub advise_mr: VoidFn,
    pub alloc_null_mr: VoidFn,
    pub read_counters: VoidFn,
    pub attach_counters_point_flow: VoidFn,
    pub create_counters: VoidFn,
    pub destroy_counters: VoidFn,
    pub reg_dm_mr: VoidFn,
    pub alloc_dm: VoidFn,
    pub free_dm: VoidFn,
    pub modify_flow_action_esp: VoidFn,
    pub destroy_flow_action: VoidFn,
    pub create_flow_action_esp: VoidFn,
    pub modify_qp_rate_limit: VoidFn,
    pub alloc_parent_domain: VoidFn,
    pub dealloc_td: VoidFn,
    pub alloc_td: VoidFn,
    pub modify_cq: VoidFn,
    pub post_srq_ops: VoidFn,
    pub destroy_rwq_ind_table: VoidFn,
    pub create_rwq_ind_table: VoidFn,
    pub destroy_wq: VoidFn,
    pub modify_wq: VoidFn,
    pub create_wq: VoidFn,
    pub query_rt_values: VoidFn,
    pub create_cq_ex: VoidFn,
    pub priv_: *mut c_void,
    pub query_device_ex: Option<QueryDeviceExFn>,
    pub ibv_destroy_flow: VoidFn,
    pub abi_placeholder2: VoidFn,
    pub ibv_create_flow: VoidFn,
    pub abi_placeholder1: VoidFn,
    pub open_qp: VoidFn,
    pub create_qp_ex: VoidFn,
    pub get_srq_num: VoidFn,
    pub create_srq_ex: VoidFn,
    pub open_xrcd: VoidFn,
    pub close_xrcd: VoidFn,
    pub abi_placeholder3: u64,
    pub sz: usize,
    pub context: ibv_context,
}

#[repr(C)]
pub struct ibv_device_attr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: u32,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: u32,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

/// `struct ibv_device_attr_ex`; vRDMA reports no extended capability, so
/// the members between `comp_mask` and `xrc_odp_caps` (ODP, TSO, RSS,
/// packet pacing, tag matching, CQ moderation, device memory, PCI atomics)
/// are kept as zeroed words.
#[repr(C)]
pub struct ibv_device_attr_ex {
    pub orig_attr: ibv_device_attr,
    pub comp_mask: u32,
    pub _pad: u32,
    pub _extended_caps: [u64; 19],
    pub xrc_odp_caps: u32,
    pub phys_port_cnt_ex: u32,
}

#[repr(C)]
pub struct ibv_query_device_ex_input {
    pub comp_mask: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_port_attr {
    pub state: u32,
    pub max_mtu: u32,
    pub active_mtu: u32,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

/// The `struct ibv_port_attr` of binaries that call the exported
/// `ibv_query_port` instead of the `verbs_context` operation: the same
/// without `port_cap_flags2`.
pub const COMPAT_PORT_ATTR_SIZE: usize = 48;

#[repr(C)]
pub struct ibv_gid_entry {
    pub gid: ibv_gid,
    pub gid_index: u32,
    pub port_num: u32,
    pub gid_type: u32,
    pub ndev_ifindex: u32,
}

#[repr(C)]
pub struct ibv_pd {
    pub context: *mut ibv_context,
    pub handle: u32,
}

#[repr(C)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

#[repr(C)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
    pub refcnt: c_int,
}

#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

/// `struct ibv_cq_ex`: an `ibv_cq` followed by the extended-poll
/// operations. Every CQ of the shim is laid out as one; the operations are
/// set for CQs from `ibv_create_cq_ex` (module `cq_ex`).
#[repr(C)]
pub struct ibv_cq_ex {
    pub cq: ibv_cq,
    pub comp_mask: u32,
    pub status: u32,
    pub wr_id: u64,
    pub start_poll: VoidFn,
    pub next_poll: VoidFn,
    pub end_poll: VoidFn,
    pub read_opcode: VoidFn,
    pub read_vendor_err: VoidFn,
    pub read_byte_len: VoidFn,
    pub read_imm_data: VoidFn,
    pub read_qp_num: VoidFn,
    pub read_src_qp: VoidFn,
    pub read_wc_flags: VoidFn,
    pub read_slid: VoidFn,
    pub read_sl: VoidFn,
    pub read_dlid_path_bits: VoidFn,
    pub read_completion_ts: VoidFn,
    pub read_cvlan: VoidFn,
    pub read_flow_tag: VoidFn,
    pub read_tm_info: VoidFn,
    pub read_completion_wallclock_ns: VoidFn,
}

#[repr(C)]
pub struct ibv_srq {
    pub context: *mut ibv_context,
    pub srq_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub handle: u32,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub events_completed: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_srq_attr {
    pub max_wr: u32,
    pub max_sge: u32,
    pub srq_limit: u32,
}

#[repr(C)]
pub struct ibv_srq_init_attr {
    pub srq_context: *mut c_void,
    pub attr: ibv_srq_attr,
}

#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub handle: u32,
    pub qp_num: u32,
    pub state: u32,
    pub qp_type: u32,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub events_completed: u32,
}

/// `struct ibv_qp_ex`: an `ibv_qp` followed by the work-request builder
/// operations (`ibv_wr_*`). Every QP of the shim is laid out as one (as
/// rdma-core's `struct verbs_qp` is); the operations are set for QPs from
/// `ibv_create_qp_ex` with send operations (module `qp_ex`).
#[repr(C)]
pub struct ibv_qp_ex {
    pub qp_base: ibv_qp,
    pub comp_mask: u64,
    pub wr_id: u64,
    pub wr_flags: u32,
    pub wr_atomic_cmp_swp: VoidFn,
    pub wr_atomic_fetch_add: VoidFn,
    pub wr_bind_mw: VoidFn,
    pub wr_local_inv: VoidFn,
    pub wr_rdma_read: VoidFn,
    pub wr_rdma_write: VoidFn,
    pub wr_rdma_write_imm: VoidFn,
    pub wr_send: VoidFn,
    pub wr_send_imm: VoidFn,
    pub wr_send_inv: VoidFn,
    pub wr_send_tso: VoidFn,
    pub wr_set_ud_addr: VoidFn,
    pub wr_set_xrc_srqn: VoidFn,
    pub wr_set_inline_data: VoidFn,
    pub wr_set_inline_data_list: VoidFn,
    pub wr_set_sge: VoidFn,
    pub wr_set_sge_list: VoidFn,
    pub wr_start: VoidFn,
    pub wr_complete: VoidFn,
    pub wr_abort: VoidFn,
    pub wr_atomic_write: VoidFn,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

#[repr(C)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub cap: ibv_qp_cap,
    pub qp_type: u32,
    pub sq_sig_all: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_attr {
    pub qp_state: u32,
    pub cur_qp_state: u32,
    pub path_mtu: u32,
    pub path_mig_state: u32,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: u32,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr_rdma {
    pub remote_addr: u64,
    pub rkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr_atomic {
    pub remote_addr: u64,
    pub compare_add: u64,
    pub swap: u64,
    pub rkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr_ud {
    pub ah: *mut c_void,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

/// The `wr` union of `struct ibv_send_wr`; the opcode says which member
/// is meaningful.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_send_wr_wr {
    pub rdma: ibv_send_wr_rdma,
    pub atomic: ibv_send_wr_atomic,
    pub ud: ibv_send_wr_ud,
}

#[repr(C)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: u32,
    pub send_flags: u32,
    /// `imm_data` (network order) or `invalidate_rkey`.
    pub imm_data: u32,
    pub wr: ibv_send_wr_wr,
    /// `qp_type.xrc.remote_srqn`.
    pub remote_srqn: u32,
    /// The `bind_mw`/`tso` union, unused by the opcodes vRDMA executes.
    pub _bind_mw_tso: [u64; 6],
}

#[repr(C)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: u32,
    pub opcode: u32,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// `imm_data` (network order) or `invalidated_rkey`.
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: u32,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_async_event_element {
    pub cq: *mut ibv_cq,
    pub qp: *mut ibv_qp,
    pub srq: *mut ibv_srq,
    pub wq: *mut c_void,
    pub port_num: c_int,
}

#[repr(C)]
pub struct ibv_async_event {
    pub element: ibv_async_event_element,
    pub event_type: u32,
}

#[repr(C)]
pub struct ibv_ece {
    pub vendor_id: u32,
    pub options: u32,
    pub comp_mask: u32,
}

/// Compile-time checks of sizes and offsets against the C compiler's
/// values for rdma-core 44's `verbs.h` on LP64 Linux.
macro_rules! layout {
    ($t:ty, $size:expr, { $($f:ident = $off:expr),* $(,)? }) => {
        const _: () = {
            assert!(size_of::<$t>() == $size, concat!("size of ", stringify!($t)));
            $(assert!(offset_of!($t, $f) == $off, concat!(stringify!($t), ".", stringify!($f)));)*
        };
    };
}

const _: () = assert!(size_of::<pthread_mutex_t>() == 40 && size_of::<pthread_cond_t>() == 48);
layout!(ibv_gid, 16, {});
layout!(ibv_device, 664, {
    _ops = 0, node_type = 16, transport_type = 20, name = 24, dev_name = 88, dev_path = 152,
    ibdev_path = 408,
});
layout!(ibv_context_ops, 256, {
    _compat_query_device = 0, _compat_query_port = 8, alloc_mw = 56, bind_mw = 64, dealloc_mw = 72,
    poll_cq = 88, req_notify_cq = 96, post_srq_recv = 160, post_send = 200, post_recv = 208,
    _compat_async_event = 248,
});
layout!(ibv_context, 328, {
    device = 0, ops = 8, cmd_fd = 264, async_fd = 268, num_comp_vectors = 272, mutex = 280,
    abi_compat = 320,
});
layout!(verbs_context, 648, {
    query_port = 0, advise_mr = 8, alloc_td = 128, modify_cq = 136, create_cq_ex = 200, priv_ = 208,
    query_device_ex = 216, open_qp = 256, create_qp_ex = 264, get_srq_num = 272, create_srq_ex = 280,
    open_xrcd = 288, close_xrcd = 296, abi_placeholder3 = 304, sz = 312, context = 320,
});
layout!(ibv_device_attr, 232, {
    fw_ver = 0, node_guid = 64, sys_image_guid = 72, max_mr_size = 80, page_size_cap = 88,
    vendor_id = 96, vendor_part_id = 100, hw_ver = 104, max_qp = 108, max_qp_wr = 112,
    device_cap_flags = 116, max_sge = 120, max_sge_rd = 124, max_cq = 128, max_cqe = 132,
    max_mr = 136, max_pd = 140, max_qp_rd_atom = 144, max_ee_rd_atom = 148, max_res_rd_atom = 152,
    max_qp_init_rd_atom = 156, max_ee_init_rd_atom = 160, atomic_cap = 164, max_ee = 168,
    max_rdd = 172, max_mw = 176, max_raw_ipv6_qp = 180, max_raw_ethy_qp = 184, max_mcast_grp = 188,
    max_mcast_qp_attach = 192, max_total_mcast_qp_attach = 196, max_ah = 200, max_fmr = 204,
    max_map_per_fmr = 208, max_srq = 212, max_srq_wr = 216, max_srq_sge = 220, max_pkeys = 224,
    local_ca_ack_delay = 226, phys_port_cnt = 227,
});
layout!(ibv_device_attr_ex, 400, {
    orig_attr = 0, comp_mask = 232, _extended_caps = 240, xrc_odp_caps = 392, phys_port_cnt_ex = 396,
});
layout!(ibv_query_device_ex_input, 4, { comp_mask = 0 });
layout!(ibv_port_attr, 52, {
    state = 0, max_mtu = 4, active_mtu = 8, gid_tbl_len = 12, port_cap_flags = 16, max_msg_sz = 20,
    bad_pkey_cntr = 24, qkey_viol_cntr = 28, pkey_tbl_len = 32, lid = 34, sm_lid = 36, lmc = 38,
    max_vl_num = 39, sm_sl = 40, subnet_timeout = 41, init_type_reply = 42, active_width = 43,
    active_speed = 44, phys_state = 45, link_layer = 46, flags = 47, port_cap_flags2 = 48,
});
const _: () = assert!(offset_of!(ibv_port_attr, port_cap_flags2) == COMPAT_PORT_ATTR_SIZE);
layout!(ibv_gid_entry, 32, { gid = 0, gid_index = 16, port_num = 20, gid_type = 24, ndev_ifindex = 28 });
layout!(ibv_pd, 16, { context = 0, handle = 8 });
layout!(ibv_mr, 48, { context = 0, pd = 8, addr = 16, length = 24, handle = 32, lkey = 36, rkey = 40 });
layout!(ibv_comp_channel, 16, { context = 0, fd = 8, refcnt = 12 });
layout!(ibv_cq, 128, {
    context = 0, channel = 8, cq_context = 16, handle = 24, cqe = 28, mutex = 32, cond = 72,
    comp_events_completed = 120, async_events_completed = 124,
});
layout!(ibv_cq_ex, 288, {
    comp_mask = 128, status = 132, wr_id = 136, start_poll = 144, next_poll = 152, end_poll = 160,
    read_opcode = 168, read_completion_wallclock_ns = 280,
});
layout!(ibv_srq, 128, {
    context = 0, srq_context = 8, pd = 16, handle = 24, mutex = 32, cond = 72, events_completed = 120,
});
layout!(ibv_srq_attr, 12, { max_wr = 0, max_sge = 4, srq_limit = 8 });
layout!(ibv_srq_init_attr, 24, { srq_context = 0, attr = 8 });
layout!(ibv_qp, 160, {
    context = 0, qp_context = 8, pd = 16, send_cq = 24, recv_cq = 32, srq = 40, handle = 48,
    qp_num = 52, state = 56, qp_type = 60, mutex = 64, cond = 104, events_completed = 152,
});
layout!(ibv_qp_ex, 352, {
    qp_base = 0, comp_mask = 160, wr_id = 168, wr_flags = 176, wr_atomic_cmp_swp = 184,
    wr_rdma_write = 224, wr_send = 240, wr_set_sge = 304, wr_start = 320, wr_complete = 328,
    wr_abort = 336, wr_atomic_write = 344,
});
layout!(ibv_qp_cap, 20, {
    max_send_wr = 0, max_recv_wr = 4, max_send_sge = 8, max_recv_sge = 12, max_inline_data = 16,
});
layout!(ibv_qp_init_attr, 64, {
    qp_context = 0, send_cq = 8, recv_cq = 16, srq = 24, cap = 32, qp_type = 52, sq_sig_all = 56,
});
layout!(ibv_global_route, 24, { dgid = 0, flow_label = 16, sgid_index = 20, hop_limit = 21, traffic_class = 22 });
layout!(ibv_ah_attr, 32, {
    grh = 0, dlid = 24, sl = 26, src_path_bits = 27, static_rate = 28, is_global = 29, port_num = 30,
});
layout!(ibv_qp_attr, 144, {
    qp_state = 0, cur_qp_state = 4, path_mtu = 8, path_mig_state = 12, qkey = 16, rq_psn = 20,
    sq_psn = 24, dest_qp_num = 28, qp_access_flags = 32, cap = 36, ah_attr = 56, alt_ah_attr = 88,
    pkey_index = 120, alt_pkey_index = 122, en_sqd_async_notify = 124, sq_draining = 125,
    max_rd_atomic = 126, max_dest_rd_atomic = 127, min_rnr_timer = 128, port_num = 129, timeout = 130,
    retry_cnt = 131, rnr_retry = 132, alt_port_num = 133, alt_timeout = 134, rate_limit = 136,
});
layout!(ibv_sge, 16, { addr = 0, length = 8, lkey = 12 });
layout!(ibv_send_wr_wr, 32, {});
layout!(ibv_send_wr_rdma, 16, { remote_addr = 0, rkey = 8 });
layout!(ibv_send_wr_atomic, 32, { remote_addr = 0, compare_add = 8, swap = 16, rkey = 24 });
layout!(ibv_send_wr_ud, 16, { ah = 0, remote_qpn = 8, remote_qkey = 12 });
layout!(ibv_send_wr, 128, {
    wr_id = 0, next = 8, sg_list = 16, num_sge = 24, opcode = 28, send_flags = 32, imm_data = 36,
    wr = 40, remote_srqn = 72, _bind_mw_tso = 80,
});
layout!(ibv_recv_wr, 32, { wr_id = 0, next = 8, sg_list = 16, num_sge = 24 });
layout!(ibv_wc, 48, {
    wr_id = 0, status = 8, opcode = 12, vendor_err = 16, byte_len = 20, imm_data = 24, qp_num = 28,
    src_qp = 32, wc_flags = 36, pkey_index = 40, slid = 42, sl = 44, dlid_path_bits = 45,
});
layout!(ibv_async_event, 16, { element = 0, event_type = 8 });
layout!(ibv_ece, 12, { vendor_id = 0, options = 4, comp_mask = 8 });
