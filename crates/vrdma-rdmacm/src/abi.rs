//! rdma-core 44's structures, field for field (x86-64, LP64 glibc), from
//! `<rdma/rdma_cma.h>` and the parts of `<infiniband/verbs.h>` this
//! library reads or fills.
//!
//! The compile-time checks below pin every size and offset a program can
//! see; the unit test `layouts_match_the_c_headers` compares them with
//! what a C compiler says for the installed headers.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void};
use std::mem::{offset_of, size_of};

use libc::{sockaddr, sockaddr_storage, socklen_t};

/// `union ibv_gid`: 16 bytes, aligned as its two `__be64` halves.
#[repr(C, align(8))]
#[derive(Clone, Copy, Default)]
pub struct ibv_gid {
    pub raw: [u8; 16],
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
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
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

/// `struct ibv_qp_init_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut c_void,
    pub recv_cq: *mut c_void,
    pub srq: *mut c_void,
    pub cap: ibv_qp_cap,
    pub qp_type: u32,
    pub sq_sig_all: c_int,
}

/// The start of `struct ibv_qp_init_attr_ex`, up to `pd`: what
/// `rdma_create_qp_ex` reads (it takes only the `IBV_QP_INIT_ATTR_PD`
/// member of `comp_mask`).
#[repr(C)]
pub struct ibv_qp_init_attr_ex_head {
    pub qp_context: *mut c_void,
    pub send_cq: *mut c_void,
    pub recv_cq: *mut c_void,
    pub srq: *mut c_void,
    pub cap: ibv_qp_cap,
    pub qp_type: u32,
    pub sq_sig_all: c_int,
    pub comp_mask: u32,
    pub pd: *mut ibv_pd,
}

/// `comp_mask` bit of `ibv_qp_init_attr_ex` naming its `pd`.
pub const IBV_QP_INIT_ATTR_PD: u32 = 1;

/// `struct ibv_pd`.
#[repr(C)]
pub struct ibv_pd {
    pub context: *mut c_void,
    pub handle: u32,
}

/// `struct ibv_qp` (its mutex and condition variable as opaque bytes).
#[repr(C)]
pub struct ibv_qp {
    pub context: *mut c_void,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut c_void,
    pub recv_cq: *mut c_void,
    pub srq: *mut c_void,
    pub handle: u32,
    pub qp_num: u32,
    pub state: u32,
    pub qp_type: u32,
    pub mutex: [u64; 5],
    pub cond: [u64; 6],
    pub events_completed: u32,
}

/// `enum ibv_qp_type` values this library uses.
pub const IBV_QPT_RC: u32 = 2;
pub const IBV_QPT_UD: u32 = 4;

/// `struct rdma_ib_addr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct rdma_ib_addr {
    pub sgid: ibv_gid,
    pub dgid: ibv_gid,
    pub pkey: u16,
}

/// `struct rdma_addr`: the unions of `sockaddr` kinds as their largest
/// member, `sockaddr_storage`.
#[repr(C)]
pub struct rdma_addr {
    pub src_storage: sockaddr_storage,
    pub dst_storage: sockaddr_storage,
    pub ibaddr: rdma_ib_addr,
}

/// `struct rdma_route`.
#[repr(C)]
pub struct rdma_route {
    pub addr: rdma_addr,
    pub path_rec: *mut c_void,
    pub num_paths: c_int,
}

/// `struct rdma_event_channel`.
#[repr(C)]
pub struct rdma_event_channel {
    pub fd: c_int,
}

/// `struct rdma_cm_id`.
#[repr(C)]
pub struct rdma_cm_id {
    pub verbs: *mut c_void,
    pub channel: *mut rdma_event_channel,
    pub context: *mut c_void,
    pub qp: *mut ibv_qp,
    pub route: rdma_route,
    pub ps: u32,
    pub port_num: u8,
    pub event: *mut rdma_cm_event,
    pub send_cq_channel: *mut c_void,
    pub send_cq: *mut c_void,
    pub recv_cq_channel: *mut c_void,
    pub recv_cq: *mut c_void,
    pub srq: *mut c_void,
    pub pd: *mut ibv_pd,
    pub qp_type: u32,
}

/// `struct rdma_conn_param`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct rdma_conn_param {
    pub private_data: *const c_void,
    pub private_data_len: u8,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub srq: u8,
    pub qp_num: u32,
}

/// `struct rdma_ud_param`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct rdma_ud_param {
    pub private_data: *const c_void,
    pub private_data_len: u8,
    pub ah_attr: ibv_ah_attr,
    pub qp_num: u32,
    pub qkey: u32,
}

/// The `param` union of `struct rdma_cm_event`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union rdma_cm_event_param {
    pub conn: rdma_conn_param,
    pub ud: rdma_ud_param,
}

/// `struct rdma_cm_event`.
#[repr(C)]
pub struct rdma_cm_event {
    pub id: *mut rdma_cm_id,
    pub listen_id: *mut rdma_cm_id,
    pub event: u32,
    pub status: c_int,
    pub param: rdma_cm_event_param,
}

/// `struct rdma_addrinfo`.
#[repr(C)]
pub struct rdma_addrinfo {
    pub ai_flags: c_int,
    pub ai_family: c_int,
    pub ai_qp_type: c_int,
    pub ai_port_space: c_int,
    pub ai_src_len: socklen_t,
    pub ai_dst_len: socklen_t,
    pub ai_src_addr: *mut sockaddr,
    pub ai_dst_addr: *mut sockaddr,
    pub ai_src_canonname: *mut c_char,
    pub ai_dst_canonname: *mut c_char,
    pub ai_route_len: usize,
    pub ai_route: *mut c_void,
    pub ai_connect_len: usize,
    pub ai_connect: *mut c_void,
    pub ai_next: *mut rdma_addrinfo,
}

pub const RAI_PASSIVE: c_int = 1;
pub const RAI_NUMERICHOST: c_int = 2;

/// `enum rdma_port_space`.
pub const RDMA_PS_TCP: u32 = 0x0106;
pub const RDMA_PS_UDP: u32 = 0x0111;

/// `rdma_set_option` levels and names.
pub const RDMA_OPTION_ID: c_int = 0;
pub const RDMA_OPTION_IB: c_int = 1;
pub const RDMA_OPTION_ID_TOS: c_int = 0;
pub const RDMA_OPTION_ID_REUSEADDR: c_int = 1;
pub const RDMA_OPTION_ID_AFONLY: c_int = 2;
pub const RDMA_OPTION_ID_ACK_TIMEOUT: c_int = 3;

/// `RDMA_MAX_RESP_RES` / `RDMA_MAX_INIT_DEPTH`.
pub const RDMA_MAX_RESP_RES: u8 = 0xff;

// The layouts of rdma-core 44 on x86-64 (the unit test below checks them
// against the C headers where those are installed).
const _: () = {
    assert!(size_of::<ibv_ah_attr>() == 32);
    assert!(size_of::<ibv_qp_attr>() == 144);
    assert!(offset_of!(ibv_qp_attr, ah_attr) == 56);
    assert!(offset_of!(ibv_qp_attr, pkey_index) == 120);
    assert!(offset_of!(ibv_qp_attr, rate_limit) == 136);
    assert!(size_of::<ibv_qp_init_attr>() == 64);
    assert!(offset_of!(ibv_qp_init_attr_ex_head, comp_mask) == 60);
    assert!(offset_of!(ibv_qp_init_attr_ex_head, pd) == 64);
    assert!(size_of::<ibv_qp>() == 160);
    assert!(offset_of!(ibv_qp, qp_num) == 52);
    assert!(offset_of!(ibv_qp, events_completed) == 152);
    assert!(size_of::<rdma_addr>() == 296);
    assert!(size_of::<rdma_route>() == 312);
    assert!(offset_of!(rdma_route, num_paths) == 304);
    assert!(size_of::<rdma_event_channel>() == 4);
    assert!(size_of::<rdma_cm_id>() == 416);
    assert!(offset_of!(rdma_cm_id, route) == 32);
    assert!(offset_of!(rdma_cm_id, ps) == 344);
    assert!(offset_of!(rdma_cm_id, port_num) == 348);
    assert!(offset_of!(rdma_cm_id, event) == 352);
    assert!(offset_of!(rdma_cm_id, pd) == 400);
    assert!(offset_of!(rdma_cm_id, qp_type) == 408);
    assert!(size_of::<rdma_conn_param>() == 24);
    assert!(offset_of!(rdma_conn_param, qp_num) == 16);
    assert!(size_of::<rdma_ud_param>() == 56);
    assert!(offset_of!(rdma_ud_param, ah_attr) == 16);
    assert!(offset_of!(rdma_ud_param, qkey) == 52);
    assert!(size_of::<rdma_cm_event>() == 80);
    assert!(offset_of!(rdma_cm_event, param) == 24);
    assert!(size_of::<rdma_addrinfo>() == 96);
    assert!(offset_of!(rdma_addrinfo, ai_src_addr) == 24);
    assert!(offset_of!(rdma_addrinfo, ai_next) == 88);
};

/// Every checked member as (C expression, offset or size in Rust): the
/// unit test prints the C side with a compiler.
#[cfg(test)]
pub fn layout_table() -> Vec<(&'static str, usize)> {
    macro_rules! t {
        ($($c:literal => $v:expr),* $(,)?) => { vec![$(($c, $v)),*] };
    }
    t! {
        "sizeof(struct ibv_ah_attr)" => size_of::<ibv_ah_attr>(),
        "sizeof(struct ibv_qp_attr)" => size_of::<ibv_qp_attr>(),
        "offsetof(struct ibv_qp_attr, ah_attr)" => offset_of!(ibv_qp_attr, ah_attr),
        "offsetof(struct ibv_qp_attr, alt_ah_attr)" => offset_of!(ibv_qp_attr, alt_ah_attr),
        "offsetof(struct ibv_qp_attr, pkey_index)" => offset_of!(ibv_qp_attr, pkey_index),
        "offsetof(struct ibv_qp_attr, max_rd_atomic)" => offset_of!(ibv_qp_attr, max_rd_atomic),
        "offsetof(struct ibv_qp_attr, rnr_retry)" => offset_of!(ibv_qp_attr, rnr_retry),
        "offsetof(struct ibv_qp_attr, rate_limit)" => offset_of!(ibv_qp_attr, rate_limit),
        "sizeof(struct ibv_qp_init_attr)" => size_of::<ibv_qp_init_attr>(),
        "offsetof(struct ibv_qp_init_attr, qp_type)" => offset_of!(ibv_qp_init_attr, qp_type),
        "offsetof(struct ibv_qp_init_attr_ex, comp_mask)" => offset_of!(ibv_qp_init_attr_ex_head, comp_mask),
        "offsetof(struct ibv_qp_init_attr_ex, pd)" => offset_of!(ibv_qp_init_attr_ex_head, pd),
        "sizeof(struct ibv_qp)" => size_of::<ibv_qp>(),
        "offsetof(struct ibv_qp, qp_num)" => offset_of!(ibv_qp, qp_num),
        "offsetof(struct ibv_qp, qp_type)" => offset_of!(ibv_qp, qp_type),
        "offsetof(struct ibv_qp, events_completed)" => offset_of!(ibv_qp, events_completed),
        "sizeof(struct ibv_pd)" => size_of::<ibv_pd>(),
        "sizeof(struct rdma_addr)" => size_of::<rdma_addr>(),
        "offsetof(struct rdma_addr, dst_addr)" => offset_of!(rdma_addr, dst_storage),
        "offsetof(struct rdma_addr, addr.ibaddr.pkey)" => offset_of!(rdma_addr, ibaddr) + offset_of!(rdma_ib_addr, pkey),
        "sizeof(struct rdma_route)" => size_of::<rdma_route>(),
        "offsetof(struct rdma_route, path_rec)" => offset_of!(rdma_route, path_rec),
        "offsetof(struct rdma_route, num_paths)" => offset_of!(rdma_route, num_paths),
        "sizeof(struct rdma_event_channel)" => size_of::<rdma_event_channel>(),
        "sizeof(struct rdma_cm_id)" => size_of::<rdma_cm_id>(),
        "offsetof(struct rdma_cm_id, channel)" => offset_of!(rdma_cm_id, channel),
        "offsetof(struct rdma_cm_id, context)" => offset_of!(rdma_cm_id, context),
        "offsetof(struct rdma_cm_id, qp)" => offset_of!(rdma_cm_id, qp),
        "offsetof(struct rdma_cm_id, route)" => offset_of!(rdma_cm_id, route),
        "offsetof(struct rdma_cm_id, ps)" => offset_of!(rdma_cm_id, ps),
        "offsetof(struct rdma_cm_id, port_num)" => offset_of!(rdma_cm_id, port_num),
        "offsetof(struct rdma_cm_id, event)" => offset_of!(rdma_cm_id, event),
        "offsetof(struct rdma_cm_id, send_cq_channel)" => offset_of!(rdma_cm_id, send_cq_channel),
        "offsetof(struct rdma_cm_id, send_cq)" => offset_of!(rdma_cm_id, send_cq),
        "offsetof(struct rdma_cm_id, recv_cq_channel)" => offset_of!(rdma_cm_id, recv_cq_channel),
        "offsetof(struct rdma_cm_id, recv_cq)" => offset_of!(rdma_cm_id, recv_cq),
        "offsetof(struct rdma_cm_id, srq)" => offset_of!(rdma_cm_id, srq),
        "offsetof(struct rdma_cm_id, pd)" => offset_of!(rdma_cm_id, pd),
        "offsetof(struct rdma_cm_id, qp_type)" => offset_of!(rdma_cm_id, qp_type),
        "sizeof(struct rdma_conn_param)" => size_of::<rdma_conn_param>(),
        "offsetof(struct rdma_conn_param, private_data_len)" => offset_of!(rdma_conn_param, private_data_len),
        "offsetof(struct rdma_conn_param, responder_resources)" => offset_of!(rdma_conn_param, responder_resources),
        "offsetof(struct rdma_conn_param, initiator_depth)" => offset_of!(rdma_conn_param, initiator_depth),
        "offsetof(struct rdma_conn_param, flow_control)" => offset_of!(rdma_conn_param, flow_control),
        "offsetof(struct rdma_conn_param, retry_count)" => offset_of!(rdma_conn_param, retry_count),
        "offsetof(struct rdma_conn_param, rnr_retry_count)" => offset_of!(rdma_conn_param, rnr_retry_count),
        "offsetof(struct rdma_conn_param, srq)" => offset_of!(rdma_conn_param, srq),
        "offsetof(struct rdma_conn_param, qp_num)" => offset_of!(rdma_conn_param, qp_num),
        "sizeof(struct rdma_ud_param)" => size_of::<rdma_ud_param>(),
        "offsetof(struct rdma_ud_param, ah_attr)" => offset_of!(rdma_ud_param, ah_attr),
        "offsetof(struct rdma_ud_param, qp_num)" => offset_of!(rdma_ud_param, qp_num),
        "offsetof(struct rdma_ud_param, qkey)" => offset_of!(rdma_ud_param, qkey),
        "sizeof(struct rdma_cm_event)" => size_of::<rdma_cm_event>(),
        "offsetof(struct rdma_cm_event, listen_id)" => offset_of!(rdma_cm_event, listen_id),
        "offsetof(struct rdma_cm_event, event)" => offset_of!(rdma_cm_event, event),
        "offsetof(struct rdma_cm_event, status)" => offset_of!(rdma_cm_event, status),
        "offsetof(struct rdma_cm_event, param)" => offset_of!(rdma_cm_event, param),
        "sizeof(struct rdma_addrinfo)" => size_of::<rdma_addrinfo>(),
        "offsetof(struct rdma_addrinfo, ai_src_len)" => offset_of!(rdma_addrinfo, ai_src_len),
        "offsetof(struct rdma_addrinfo, ai_dst_len)" => offset_of!(rdma_addrinfo, ai_dst_len),
        "offsetof(struct rdma_addrinfo, ai_src_addr)" => offset_of!(rdma_addrinfo, ai_src_addr),
        "offsetof(struct rdma_addrinfo, ai_dst_addr)" => offset_of!(rdma_addrinfo, ai_dst_addr),
        "offsetof(struct rdma_addrinfo, ai_src_canonname)" => offset_of!(rdma_addrinfo, ai_src_canonname),
        "offsetof(struct rdma_addrinfo, ai_route_len)" => offset_of!(rdma_addrinfo, ai_route_len),
        "offsetof(struct rdma_addrinfo, ai_route)" => offset_of!(rdma_addrinfo, ai_route),
        "offsetof(struct rdma_addrinfo, ai_connect_len)" => offset_of!(rdma_addrinfo, ai_connect_len),
        "offsetof(struct rdma_addrinfo, ai_connect)" => offset_of!(rdma_addrinfo, ai_connect),
        "offsetof(struct rdma_addrinfo, ai_next)" => offset_of!(rdma_addrinfo, ai_next),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::process::Command;

    /// Compiles a C program against the installed `<rdma/rdma_cma.h>`
    /// that prints each entry of [`super::layout_table`], and compares.
    #[test]
    fn layouts_match_the_c_headers() {
        if !Path::new("/usr/include/rdma/rdma_cma.h").exists() {
            vrdma_it::skip("/usr/include/rdma/rdma_cma.h is missing (apt-get install librdmacm-dev)");
            return;
        }
        let table = super::layout_table();
        let mut src = String::from(
            "#include <stdio.h>\n#include <stddef.h>\n#include <rdma/rdma_cma.h>\nint main(void) {\n",
        );
        for (expr, _) in &table {
            src.push_str(&format!("  printf(\"%zu\\n\", (size_t)({expr}));\n"));
        }
        src.push_str("  return 0;\n}\n");
        let dir = tempfile::tempdir().expect("temp dir");
        let c = dir.path().join("layout.c");
        let exe = dir.path().join("layout");
        std::fs::write(&c, src).expect("write C source");
        let cc = Command::new("cc").arg("-o").arg(&exe).arg(&c).output().expect("run cc");
        assert!(cc.status.success(), "cc failed: {}", String::from_utf8_lossy(&cc.stderr));
        let out = Command::new(&exe).output().expect("run the layout program");
        let lines: Vec<usize> =
            String::from_utf8_lossy(&out.stdout).lines().map(|l| l.parse().expect("a number")).collect();
        assert_eq!(lines.len(), table.len());
        let wrong: Vec<String> = table
            .iter()
            .zip(&lines)
            .filter(|((_, rust), c)| rust != *c)
            .map(|((expr, rust), c)| format!("{expr}: C {c}, Rust {rust}"))
            .collect();
        assert!(wrong.is_empty(), "layouts differ:\n{}", wrong.join("\n"));
    }
}
