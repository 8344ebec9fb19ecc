//! Address handles, the helpers that build one from a received datagram,
//! and rdma-core's "marshall" functions, which copy the kernel ABI's
//! structures into the verbs ones (librdmacm imports them).
//!
//! An address handle is a box whose first member is the C `struct ibv_ah`
//! the application holds, followed by the client library's handle;
//! `ibv_ah.handle` is the daemon's number for it, which is what a UD send
//! carries (see `post_send` in module `qp`). The PD cannot be deallocated
//! while address handles of it exist (`EBUSY`), as with the kernel's
//! reference counts.
//!
//! `ibv_init_ah_from_wc` follows rdma-core 44: the LID, SL and path bits
//! come from the work completion; with `IBV_WC_GRH` the handle is global,
//! its DGID is the GRH's SGID, its SGID index the entry of this port's
//! table holding the GRH's DGID (with the GID type the GRH's next header
//! implies), and its traffic class and hop limit those of the GRH.

use std::ffi::c_int;

use crate::abi::*;
use crate::context::{ibv_query_gid, ibv_query_gid_type};
use crate::mem::Pd;
use crate::qp::ah_from_c;
use crate::util::*;

/// `struct ibv_ah`.
#[repr(C)]
pub struct ibv_ah {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub handle: u32,
}

/// `struct ibv_grh`: the 40 bytes a UD receive buffer starts with.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_grh {
    /// Big-endian: IP version (4 bits), traffic class (8), flow label (20).
    pub version_tclass_flow: u32,
    pub paylen: u16,
    pub next_hdr: u8,
    pub hop_limit: u8,
    pub sgid: ibv_gid,
    pub dgid: ibv_gid,
}

#[repr(C)]
pub struct Ah {
    pub ah: ibv_ah,
    pub inner: vrdma::AddressHandle,
}

const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<ibv_ah>() == 24 && offset_of!(ibv_ah, pd) == 8 && offset_of!(ibv_ah, handle) == 16);
    assert!(size_of::<ibv_grh>() == 40);
    assert!(offset_of!(ibv_grh, paylen) == 4 && offset_of!(ibv_grh, next_hdr) == 6);
    assert!(offset_of!(ibv_grh, hop_limit) == 7 && offset_of!(ibv_grh, sgid) == 8);
    assert!(offset_of!(ibv_grh, dgid) == 24);
    // The application's pointer is the object's address.
    assert!(offset_of!(Ah, ah) == 0);
};

/// `ibv_create_ah`: NULL with `errno` when the daemon refuses the address
/// vector (a multicast LID or GID, an SGID index out of the table, ...).
pub unsafe extern "C" fn ibv_create_ah(pd: *mut ibv_pd, attr: *mut ibv_ah_attr) -> *mut ibv_ah {
    const W: &str = "ibv_create_ah";
    ret_ptr(W, || {
        // SAFETY: a live PD (the verb's contract).
        let p = unsafe { Pd::get(W, pd)? };
        non_null(W, attr, "attr")?;
        // SAFETY: a valid ibv_ah_attr.
        let a = ah_from_c(unsafe { &*attr });
        let inner = p.inner.create_ah(&a).map_err(|e| fail(W, &e))?;
        let ah = ibv_ah { context: p.pd.context, pd, handle: inner.handle() };
        Ok(Box::into_raw(Box::new(Ah { ah, inner })).cast())
    })
}

/// `ibv_destroy_ah`: 0 or an errno value.
pub unsafe extern "C" fn ibv_destroy_ah(ah: *mut ibv_ah) -> c_int {
    const W: &str = "ibv_destroy_ah";
    ret_code(W, || {
        non_null(W, ah, "the address handle")?;
        // SAFETY: the box made by ibv_create_ah, freed once (the verb's
        // contract).
        drop(unsafe { Box::from_raw(ah.cast::<Ah>()) });
        Ok(())
    })
}

/// rdma-core's `get_grh_header_version`: 6 for an IPv6-style header (IB
/// and RoCE v1, or RoCE v2 over IPv6), 4 for RoCE v2 over IPv4 (the IPv4
/// header sits in the last 20 bytes, with a valid checksum).
fn grh_header_version(grh: &[u8; 40]) -> Res<u8> {
    let ip4 = &grh[20..40];
    if grh[0] >> 4 != 6 {
        return if ip4[0] >> 4 == 4 { Ok(4) } else { Err(libc::EPROTONOSUPPORT) };
    }
    if ip4[0] & 0xf != 5 {
        return Ok(6);
    }
    // The one's-complement sum over the header, its checksum field zeroed,
    // in native 16-bit words as rdma-core adds them.
    let mut sum = 0u32;
    for (i, w) in ip4.chunks_exact(2).enumerate() {
        if i != 5 {
            sum += u32::from(u16::from_ne_bytes([w[0], w[1]]));
        }
    }
    let sum = (sum & 0xffff) + (sum >> 16);
    let check = !(sum as u16);
    Ok(if u16::from_ne_bytes([ip4[10], ip4[11]]) == check { 4 } else { 6 })
}

/// rdma-core's `ibv_find_gid_index`: the index of `gid` with sysfs type
/// `sysfs_type` in the port's table.
///
/// # Safety
/// `context` must be a live context.
unsafe fn find_gid_index(context: *mut ibv_context, port: u8, gid: &[u8; 16], sysfs_type: c_int) -> Res<u8> {
    for i in 0..=c_int::from(u8::MAX) {
        let mut g = ibv_gid::default();
        let mut t: c_int = 0;
        // SAFETY: a live context and valid outputs.
        let found = unsafe {
            if ibv_query_gid(context, port, i, &mut g) != 0
                || ibv_query_gid_type(context, port, i as u32, &mut t) != 0
            {
                return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::ENOENT));
            }
            g.raw == *gid && t == sysfs_type
        };
        if found {
            return Ok(i as u8);
        }
    }
    Err(libc::ENOENT)
}

/// `ibv_init_ah_from_wc`: the address vector that answers the sender of
/// the datagram `wc` completed. 0, or -1 with `errno` set.
pub unsafe extern "C" fn ibv_init_ah_from_wc(
    context: *mut ibv_context,
    port_num: u8,
    wc: *mut ibv_wc,
    grh: *mut ibv_grh,
    ah_attr: *mut ibv_ah_attr,
) -> c_int {
    const W: &str = "ibv_init_ah_from_wc";
    ret_minus1(W, || {
        non_null(W, context, "the context")?;
        non_null(W, wc, "wc")?;
        non_null(W, ah_attr, "ah_attr")?;
        // SAFETY: a valid work completion (the verb's contract).
        let wc = unsafe { &*wc };
        let has_grh = wc.wc_flags & IBV_WC_GRH != 0;
        if has_grh {
            non_null(W, grh, "grh")?;
        }
        // SAFETY: the 40 bytes of the receive buffer's GRH area, readable
        // when not NULL (the contract); any bit pattern is a valid array.
        let g: Option<[u8; 40]> =
            (!grh.is_null()).then(|| unsafe { grh.cast::<[u8; 40]>().read_unaligned() });
        let mut a = ibv_ah_attr::default();
        if let Some(g) = &g {
            a.grh.flow_label = u32::from_be_bytes([g[0], g[1], g[2], g[3]]) & 0xf_ffff;
        }
        a.dlid = wc.slid;
        a.sl = wc.sl;
        a.src_path_bits = wc.dlid_path_bits;
        a.port_num = port_num;
        if let (true, Some(g)) = (has_grh, g) {
            a.is_global = 1;
            let sgid: [u8; 16] = g[8..24].try_into().expect("16 bytes");
            let dgid: [u8; 16] = g[24..40].try_into().expect("16 bytes");
            match grh_header_version(&g) {
                Ok(4) => {
                    // RoCE v2 over IPv4: the addresses are IPv4-mapped GIDs.
                    let ip4 = &g[20..40];
                    let (saddr, daddr) = (&ip4[12..16], &ip4[16..20]);
                    if daddr[0] & 0xf0 == 0xe0 {
                        return Err(refuse(W, "a multicast destination", libc::EINVAL));
                    }
                    let mapped = |v4: &[u8]| {
                        let mut m = [0u8; 16];
                        m[10] = 0xff;
                        m[11] = 0xff;
                        m[12..].copy_from_slice(v4);
                        m
                    };
                    // SAFETY: a live context (checked non-NULL above; the
                    // contract).
                    let idx = unsafe {
                        find_gid_index(context, port_num, &mapped(daddr), IBV_GID_TYPE_SYSFS_ROCE_V2)?
                    };
                    a.grh.dgid = ibv_gid { raw: mapped(saddr) };
                    a.grh.sgid_index = idx;
                    a.grh.hop_limit = ip4[8];
                    a.grh.traffic_class = ip4[1];
                }
                Ok(_) => {
                    if dgid[0] == 0xff {
                        return Err(refuse(W, "a multicast destination", libc::EINVAL));
                    }
                    a.grh.dgid = ibv_gid { raw: sgid };
                    let sysfs_type = match g[6] {
                        IPPROTO_UDP => IBV_GID_TYPE_SYSFS_ROCE_V2,
                        IB_NEXT_HDR => IBV_GID_TYPE_SYSFS_IB_ROCE_V1,
                        _ => return Err(refuse(W, "unknown GRH next header", libc::EPROTONOSUPPORT)),
                    };
                    // SAFETY: as above.
                    a.grh.sgid_index = unsafe { find_gid_index(context, port_num, &dgid, sysfs_type)? };
                    a.grh.hop_limit = g[7];
                    a.grh.traffic_class = ((u32::from_be_bytes([g[0], g[1], g[2], g[3]]) >> 20) & 0xff) as u8;
                }
                Err(e) => return Err(refuse(W, "the GRH is neither IPv6 nor IPv4", e)),
            }
        }
        // SAFETY: a writable ibv_ah_attr.
        unsafe { ah_attr.write(a) };
        Ok(())
    })
}

/// `ibv_create_ah_from_wc`: `ibv_init_ah_from_wc` then `ibv_create_ah`;
/// NULL with `errno` set on failure.
pub unsafe extern "C" fn ibv_create_ah_from_wc(
    pd: *mut ibv_pd,
    wc: *mut ibv_wc,
    grh: *mut ibv_grh,
    port_num: u8,
) -> *mut ibv_ah {
    const W: &str = "ibv_create_ah_from_wc";
    let mut attr = ibv_ah_attr::default();
    let context = ret_ptr(W, || {
        // SAFETY: a live PD (the verb's contract).
        let p = unsafe { Pd::get(W, pd)? };
        Ok(p.pd.context)
    });
    if context.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: the context of a live PD; the rest is the caller's contract.
    if unsafe { ibv_init_ah_from_wc(context, port_num, wc, grh, &mut attr) } != 0 {
        return std::ptr::null_mut();
    }
    // SAFETY: as above.
    unsafe { ibv_create_ah(pd, &mut attr) }
}

/// `IPPROTO_UDP`: the next header of a RoCE v2 GRH.
const IPPROTO_UDP: u8 = 17;
/// The next header of an InfiniBand GRH (the IBA transport).
const IB_NEXT_HDR: u8 = 0x1b;
/// `IBV_WC_GRH`.
const IBV_WC_GRH: u32 = 1;

// The kernel ABI's structures (`<rdma/ib_user_verbs.h>`,
// `<rdma/ib_user_sa.h>`) and the verbs path record (`<infiniband/sa.h>`),
// for the marshall functions.

/// `struct ib_uverbs_global_route`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ib_uverbs_global_route {
    pub dgid: [u8; 16],
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub reserved: u8,
}

/// `struct ib_uverbs_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ib_uverbs_ah_attr {
    pub grh: ib_uverbs_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
    pub reserved: u8,
}

/// `struct ib_uverbs_qp_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ib_uverbs_qp_attr {
    pub qp_attr_mask: u32,
    pub qp_state: u32,
    pub cur_qp_state: u32,
    pub path_mtu: u32,
    pub path_mig_state: u32,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: u32,
    pub ah_attr: ib_uverbs_ah_attr,
    pub alt_ah_attr: ib_uverbs_ah_attr,
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
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
    pub reserved: [u8; 5],
}

/// `struct ib_user_path_rec` (the kernel's; `dlid`, `slid`, `flow_label`
/// and `pkey` big-endian, copied as they are).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ib_user_path_rec {
    pub dgid: [u8; 16],
    pub sgid: [u8; 16],
    pub dlid: u16,
    pub slid: u16,
    pub raw_traffic: u32,
    pub flow_label: u32,
    pub reversible: u32,
    pub mtu: u32,
    pub pkey: u16,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub numb_path: u8,
    pub sl: u8,
    pub mtu_selector: u8,
    pub rate_selector: u8,
    pub rate: u8,
    pub packet_life_time_selector: u8,
    pub packet_life_time: u8,
    pub preference: u8,
}

/// `struct ibv_sa_path_rec`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_sa_path_rec {
    pub dgid: ibv_gid,
    pub sgid: ibv_gid,
    pub dlid: u16,
    pub slid: u16,
    pub raw_traffic: c_int,
    pub flow_label: u32,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub reversible: c_int,
    pub numb_path: u8,
    pub pkey: u16,
    pub sl: u8,
    pub mtu_selector: u8,
    pub mtu: u8,
    pub rate_selector: u8,
    pub rate: u8,
    pub packet_life_time_selector: u8,
    pub packet_life_time: u8,
    pub preference: u8,
}

// Sizes and offsets as a C compiler gives them for the installed headers.
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<ib_uverbs_ah_attr>() == 32);
    assert!(offset_of!(ib_uverbs_ah_attr, dlid) == 24 && offset_of!(ib_uverbs_ah_attr, port_num) == 30);
    assert!(size_of::<ib_uverbs_qp_attr>() == 144);
    assert!(offset_of!(ib_uverbs_qp_attr, ah_attr) == 40 && offset_of!(ib_uverbs_qp_attr, alt_ah_attr) == 72);
    assert!(offset_of!(ib_uverbs_qp_attr, max_send_wr) == 104);
    assert!(offset_of!(ib_uverbs_qp_attr, pkey_index) == 124);
    assert!(offset_of!(ib_uverbs_qp_attr, alt_timeout) == 138);
    assert!(size_of::<ib_user_path_rec>() == 64);
    assert!(offset_of!(ib_user_path_rec, dlid) == 32 && offset_of!(ib_user_path_rec, mtu) == 48);
    assert!(offset_of!(ib_user_path_rec, pkey) == 52 && offset_of!(ib_user_path_rec, preference) == 63);
    assert!(size_of::<ibv_sa_path_rec>() == 64);
    assert!(offset_of!(ibv_sa_path_rec, hop_limit) == 44 && offset_of!(ibv_sa_path_rec, reversible) == 48);
    assert!(offset_of!(ibv_sa_path_rec, numb_path) == 52 && offset_of!(ibv_sa_path_rec, pkey) == 54);
    assert!(offset_of!(ibv_sa_path_rec, sl) == 56 && offset_of!(ibv_sa_path_rec, mtu) == 58);
    assert!(offset_of!(ibv_sa_path_rec, preference) == 63);
};

fn ah_attr_from_kern(s: &ib_uverbs_ah_attr) -> ibv_ah_attr {
    ibv_ah_attr {
        grh: ibv_global_route {
            dgid: ibv_gid { raw: s.grh.dgid },
            flow_label: s.grh.flow_label,
            sgid_index: s.grh.sgid_index,
            hop_limit: s.grh.hop_limit,
            traffic_class: s.grh.traffic_class,
        },
        dlid: s.dlid,
        sl: s.sl,
        src_path_bits: s.src_path_bits,
        static_rate: s.static_rate,
        is_global: s.is_global,
        port_num: s.port_num,
    }
}

/// `ibv_copy_ah_attr_from_kern@IBVERBS_1.1`, as rdma-core's marshall.c.
pub unsafe extern "C" fn ibv_copy_ah_attr_from_kern(dst: *mut ibv_ah_attr, src: *mut ib_uverbs_ah_attr) {
    guard("ibv_copy_ah_attr_from_kern", (), || {
        if dst.is_null() || src.is_null() {
            return;
        }
        // SAFETY: valid structures (the function's contract).
        unsafe { dst.write(ah_attr_from_kern(&*src)) };
    })
}

/// `ibv_copy_qp_attr_from_kern@IBVERBS_1.0`, as rdma-core's marshall.c:
/// every field but `qp_state` (and `rate_limit`, which the kernel
/// structure lacks) is copied; those two are left as they were.
pub unsafe extern "C" fn ibv_copy_qp_attr_from_kern(dst: *mut ibv_qp_attr, src: *mut ib_uverbs_qp_attr) {
    guard("ibv_copy_qp_attr_from_kern", (), || {
        if dst.is_null() || src.is_null() {
            return;
        }
        // SAFETY: valid structures (the function's contract).
        let (d, s) = unsafe { (&mut *dst, &*src) };
        d.cur_qp_state = s.cur_qp_state;
        d.path_mtu = s.path_mtu;
        d.path_mig_state = s.path_mig_state;
        d.qkey = s.qkey;
        d.rq_psn = s.rq_psn;
        d.sq_psn = s.sq_psn;
        d.dest_qp_num = s.dest_qp_num;
        d.qp_access_flags = s.qp_access_flags;
        d.cap = ibv_qp_cap {
            max_send_wr: s.max_send_wr,
            max_recv_wr: s.max_recv_wr,
            max_send_sge: s.max_send_sge,
            max_recv_sge: s.max_recv_sge,
            max_inline_data: s.max_inline_data,
        };
        d.ah_attr = ah_attr_from_kern(&s.ah_attr);
        d.alt_ah_attr = ah_attr_from_kern(&s.alt_ah_attr);
        d.pkey_index = s.pkey_index;
        d.alt_pkey_index = s.alt_pkey_index;
        d.en_sqd_async_notify = s.en_sqd_async_notify;
        d.sq_draining = s.sq_draining;
        d.max_rd_atomic = s.max_rd_atomic;
        d.max_dest_rd_atomic = s.max_dest_rd_atomic;
        d.min_rnr_timer = s.min_rnr_timer;
        d.port_num = s.port_num;
        d.timeout = s.timeout;
        d.retry_cnt = s.retry_cnt;
        d.rnr_retry = s.rnr_retry;
        d.alt_port_num = s.alt_port_num;
        d.alt_timeout = s.alt_timeout;
    })
}

/// `ibv_copy_path_rec_from_kern@IBVERBS_1.0`, as rdma-core's marshall.c
/// (field by field; the big-endian fields stay big-endian).
pub unsafe extern "C" fn ibv_copy_path_rec_from_kern(dst: *mut ibv_sa_path_rec, src: *mut ib_user_path_rec) {
    guard("ibv_copy_path_rec_from_kern", (), || {
        if dst.is_null() || src.is_null() {
            return;
        }
        // SAFETY: valid structures (the function's contract).
        let s = unsafe { &*src };
        let d = ibv_sa_path_rec {
            dgid: ibv_gid { raw: s.dgid },
            sgid: ibv_gid { raw: s.sgid },
            dlid: s.dlid,
            slid: s.slid,
            raw_traffic: s.raw_traffic as c_int,
            flow_label: s.flow_label,
            hop_limit: s.hop_limit,
            traffic_class: s.traffic_class,
            reversible: s.reversible as c_int,
            numb_path: s.numb_path,
            pkey: s.pkey,
            sl: s.sl,
            mtu_selector: s.mtu_selector,
            // The kernel's `u32` narrows to the verbs' `uint8_t`, as in C.
            mtu: s.mtu as u8,
            rate_selector: s.rate_selector,
            rate: s.rate,
            packet_life_time_selector: s.packet_life_time_selector,
            packet_life_time: s.packet_life_time,
            preference: s.preference,
        };
        // SAFETY: as above; the write covers the padding too.
        unsafe { dst.write(d) };
    })
}

/// `ibv_copy_path_rec_to_kern@IBVERBS_1.0`, the reverse of
/// [`ibv_copy_path_rec_from_kern`]; the kernel structure's bytes not
/// named by a field keep their values.
pub unsafe extern "C" fn ibv_copy_path_rec_to_kern(dst: *mut ib_user_path_rec, src: *mut ibv_sa_path_rec) {
    guard("ibv_copy_path_rec_to_kern", (), || {
        if dst.is_null() || src.is_null() {
            return;
        }
        // SAFETY: valid structures (the function's contract).
        let (d, s) = unsafe { (&mut *dst, &*src) };
        d.dgid = s.dgid.raw;
        d.sgid = s.sgid.raw;
        d.dlid = s.dlid;
        d.slid = s.slid;
        d.raw_traffic = s.raw_traffic as u32;
        d.flow_label = s.flow_label;
        d.hop_limit = s.hop_limit;
        d.traffic_class = s.traffic_class;
        d.reversible = s.reversible as u32;
        d.numb_path = s.numb_path;
        d.pkey = s.pkey;
        d.sl = s.sl;
        d.mtu_selector = s.mtu_selector;
        d.mtu = u32::from(s.mtu);
        d.rate_selector = s.rate_selector;
        d.rate = s.rate;
        d.packet_life_time = s.packet_life_time;
        d.preference = s.preference;
        d.packet_life_time_selector = s.packet_life_time_selector;
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grh_versions() {
        let mut g = [0u8; 40];
        g[0] = 0x60;
        assert_eq!(grh_header_version(&g), Ok(6));
        g[0] = 0;
        assert_eq!(grh_header_version(&g), Err(libc::EPROTONOSUPPORT));
        // An IPv4 header (version 4, IHL 5) in the last 20 bytes.
        g[20] = 0x45;
        assert_eq!(grh_header_version(&g), Ok(4));
    }

    #[test]
    fn path_record_round_trip() {
        let mut k: ib_user_path_rec = unsafe { std::mem::zeroed() };
        k.dgid = [1; 16];
        k.sgid = [2; 16];
        k.dlid = 0x1234;
        k.mtu = 5;
        k.pkey = 0xffff;
        k.preference = 9;
        let mut v: ibv_sa_path_rec = unsafe { std::mem::zeroed() };
        unsafe { ibv_copy_path_rec_from_kern(&mut v, &mut k) };
        assert_eq!((v.dgid.raw, v.dlid, v.mtu, v.pkey, v.preference), ([1; 16], 0x1234, 5, 0xffff, 9));
        let mut back: ib_user_path_rec = unsafe { std::mem::zeroed() };
        unsafe { ibv_copy_path_rec_to_kern(&mut back, &mut v) };
        assert_eq!((back.sgid, back.dlid, back.mtu, back.preference), ([2; 16], 0x1234, 5, 9));
    }
}
