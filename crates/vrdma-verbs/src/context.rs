//! Device contexts: `ibv_open_device` and the queries, and async events.
//!
//! A context is one [`vrdma::Context`] (one connection to the daemon)
//! inside a [`Ctx`], whose first member is a `struct verbs_context`
//! ending with the `struct ibv_context` that the application holds.
//! `abi_compat` is `UINTPTR_MAX` and `sz` is `sizeof(struct
//! verbs_context)`, so `verbs_get_ctx_op()` finds the extended operations
//! the shim provides (`query_port`, `query_device_ex`, `create_cq_ex`,
//! `create_qp_ex`) and sees NULL, i.e.
//! "not supported", for the rest.
//!
//! The context also keeps a registry from the daemon's object numbers to
//! the C objects, because the daemon reports completion events (by CQ
//! number) and async events (by QP, CQ or SRQ number), and the verbs hand
//! the application its own pointers. Events are counted per object under
//! the registry lock, so that a destroy, which first removes the object
//! from the registry, then waits until the application has acknowledged
//! every event it was given, as rdma-core does.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::mem::{offset_of, size_of};
use std::os::fd::{AsFd, AsRawFd};
use std::ptr::{self, addr_of_mut};
use std::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use vrdma::{AsyncEventType, Gid, PortAttr};

use crate::abi::*;
use crate::cq::Cq;
use crate::device::{device_ptr, ours};
use crate::qp::Qp;
use crate::srq::Srq;
use crate::util::*;
use crate::{cq, qp, srq};

/// Objects by the daemon's numbers, for the events that name them.
#[derive(Default)]
pub struct Registry {
    pub cqs: HashMap<u32, *mut Cq>,
    pub qps: HashMap<u32, *mut Qp>,
    pub srqs: HashMap<u32, *mut Srq>,
}

/// An open context. The application holds `&vctx.context`.
#[repr(C)]
pub struct Ctx {
    pub vctx: verbs_context,
    /// The descriptor behind `cmd_fd`, closed with the context.
    _cmd: std::fs::File,
    pub inner: vrdma::Context,
    /// The port's link layer, fixed for the device: decides GID types.
    link_layer: u8,
    /// Ports of the device.
    phys_port_cnt: u8,
    registry: Mutex<Registry>,
}

// SAFETY: the raw pointers in the registry are only dereferenced by the
// verbs under the rules above; the map itself is behind a mutex.
unsafe impl Send for Registry {}

const CONTEXT_OFFSET: usize = offset_of!(Ctx, vctx) + offset_of!(verbs_context, context);

impl Ctx {
    /// The `Ctx` behind an application's context pointer.
    ///
    /// # Safety
    /// `p` must be non-NULL and come from `ibv_open_device`, not yet closed.
    pub unsafe fn from_ptr<'a>(p: *mut ibv_context) -> &'a Ctx {
        // SAFETY: per the contract, `p` points at `vctx.context` of a live
        // boxed `Ctx`; only Rust-owned fields are read through the shared
        // reference (C-visible fields are accessed by raw pointer).
        unsafe { &*(p.cast::<u8>().sub(CONTEXT_OFFSET).cast::<Ctx>()) }
    }

    /// Checks for NULL, then [`from_ptr`](Self::from_ptr).
    ///
    /// # Safety
    /// As `from_ptr` when non-NULL.
    pub unsafe fn get<'a>(what: &str, p: *mut ibv_context) -> Res<&'a Ctx> {
        non_null(what, p, "the context")?;
        // SAFETY: non-NULL; the rest is the caller's contract.
        Ok(unsafe { Ctx::from_ptr(p) })
    }

    pub fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The application's pointer for this context.
    pub fn as_ptr(&self) -> *mut ibv_context {
        ptr::from_ref(&self.vctx.context).cast_mut()
    }
}

/// `ibv_open_device`: connects to the daemon the device list found (or
/// takes the list's spare context, see `device`).
pub unsafe extern "C" fn ibv_open_device(device: *mut ibv_device) -> *mut ibv_context {
    const W: &str = "ibv_open_device";
    ret_ptr(W, || {
        let dev = ours(W, device)?;
        // The context the device list was taken with, if it is still
        // there (see `device`); else a new one.
        let (inner, attr) = match dev.take_spare() {
            Some(s) => (s.ctx, s.attr),
            None => {
                let path = dev.socket.lock().unwrap_or_else(|e| e.into_inner()).clone();
                let opened = if path.as_os_str().is_empty() {
                    vrdma::Context::open()
                } else {
                    vrdma::Context::open_at(&path)
                };
                let inner = opened.map_err(|e| fail(W, &e))?;
                let attr = inner.query_device().map_err(|e| fail(W, &e))?;
                (inner, attr)
            }
        };
        let port = inner.query_port(1).map_err(|e| fail(W, &e))?;
        let async_fd = inner.async_event_fd().as_raw_fd();
        make_blocking(async_fd);
        // (std opens it close-on-exec.)
        let cmd = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")
            .map_err(|e| fail(W, &vrdma::Error::Io(e)))?;
        let ops = ibv_context_ops {
            _compat_query_device: None,
            _compat_query_port: None,
            _compat_alloc_pd: None,
            _compat_dealloc_pd: None,
            _compat_reg_mr: None,
            _compat_rereg_mr: None,
            _compat_dereg_mr: None,
            alloc_mw: None,
            bind_mw: None,
            dealloc_mw: None,
            _compat_create_cq: None,
            poll_cq: Some(cq::poll_cq),
            req_notify_cq: Some(cq::req_notify_cq),
            _compat_cq_event: None,
            _compat_resize_cq: None,
            _compat_destroy_cq: None,
            _compat_create_srq: None,
            _compat_modify_srq: None,
            _compat_query_srq: None,
            _compat_destroy_srq: None,
            post_srq_recv: Some(srq::post_srq_recv),
            _compat_create_qp: None,
            _compat_query_qp: None,
            _compat_modify_qp: None,
            _compat_destroy_qp: None,
            post_send: Some(qp::post_send),
            post_recv: Some(qp::post_recv),
            _compat_create_ah: None,
            _compat_destroy_ah: None,
            _compat_attach_mcast: None,
            _compat_detach_mcast: None,
            _compat_async_event: None,
        };
        let vctx = verbs_context {
            query_port: Some(query_port_op),
            advise_mr: None,
            alloc_null_mr: None,
            read_counters: None,
            attach_counters_point_flow: None,
            create_counters: None,
            destroy_counters: None,
            reg_dm_mr: None,
            alloc_dm: None,
            free_dm: None,
            modify_flow_action_esp: None,
            destroy_flow_action: None,
            create_flow_action_esp: None,
            modify_qp_rate_limit: None,
            alloc_parent_domain: None,
            dealloc_td: None,
            alloc_td: None,
            modify_cq: None,
            post_srq_ops: None,
            destroy_rwq_ind_table: None,
            create_rwq_ind_table: None,
            destroy_wq: None,
            modify_wq: None,
            create_wq: None,
            query_rt_values: None,
            // SAFETY: only the pointer's type changes; rdma-core calls it as
            // `struct ibv_cq_ex *(*)(struct ibv_context *, struct ibv_cq_init_attr_ex *)`.
            create_cq_ex: Some(unsafe {
                std::mem::transmute::<
                    unsafe extern "C" fn(
                        *mut ibv_context,
                        *mut crate::cq_ex::ibv_cq_init_attr_ex,
                    ) -> *mut ibv_cq_ex,
                    unsafe extern "C" fn(),
                >(crate::cq_ex::create_cq_ex)
            }),
            priv_: ptr::null_mut(),
            query_device_ex: Some(query_device_ex_op),
            ibv_destroy_flow: None,
            abi_placeholder2: None,
            ibv_create_flow: None,
            abi_placeholder1: None,
            open_qp: None,
            // SAFETY: only the pointer's type changes; rdma-core calls it as
            // `struct ibv_qp *(*)(struct ibv_context *, struct ibv_qp_init_attr_ex *)`.
            create_qp_ex: Some(unsafe {
                std::mem::transmute::<
                    unsafe extern "C" fn(
                        *mut ibv_context,
                        *mut crate::qp_ex::ibv_qp_init_attr_ex,
                    ) -> *mut ibv_qp,
                    unsafe extern "C" fn(),
                >(crate::qp_ex::create_qp_ex)
            }),
            get_srq_num: None,
            create_srq_ex: None,
            open_xrcd: None,
            close_xrcd: None,
            abi_placeholder3: 0,
            sz: size_of::<verbs_context>(),
            context: ibv_context {
                device: device_ptr(dev),
                ops,
                // There is no kernel command channel, but programs check
                // that the descriptor is valid: one on /dev/null, which
                // reads nothing, takes writes and refuses ioctls (ENOTTY).
                cmd_fd: std::os::fd::AsRawFd::as_raw_fd(&cmd),
                async_fd,
                num_comp_vectors: 1,
                // SAFETY: an all-zero pthread_mutex_t is a valid value to
                // overwrite; pthread_mutex_init runs below.
                mutex: unsafe { std::mem::zeroed() },
                abi_compat: VERBS_ABI_IS_EXTENDED,
            },
        };
        let ctx = Box::new(Ctx {
            vctx,
            _cmd: cmd,
            inner,
            link_layer: port.link_layer,
            phys_port_cnt: attr.phys_port_cnt,
            registry: Mutex::new(Registry::default()),
        });
        let p = Box::into_raw(ctx);
        // SAFETY: `p` is a fresh box; the mutex storage is unused.
        unsafe { libc::pthread_mutex_init(addr_of_mut!((*p).vctx.context.mutex), ptr::null()) };
        // SAFETY: `p` is live; hand out the embedded ibv_context.
        Ok(unsafe { addr_of_mut!((*p).vctx.context) })
    })
}

/// `ibv_close_device`. Objects the application did not destroy keep the
/// daemon connection open until they are gone (the daemon frees them all
/// when the process exits).
pub unsafe extern "C" fn ibv_close_device(context: *mut ibv_context) -> c_int {
    const W: &str = "ibv_close_device";
    ret_code(W, || {
        non_null(W, context, "the context")?;
        // SAFETY: a context from ibv_open_device (contract of the verb),
        // closed once: the box is reclaimed here.
        unsafe {
            let p = context.cast::<u8>().sub(CONTEXT_OFFSET).cast::<Ctx>();
            libc::pthread_mutex_destroy(addr_of_mut!((*p).vctx.context.mutex));
            drop(Box::from_raw(p));
        }
        Ok(())
    })
}

fn fill_device_attr(a: &vrdma::DeviceAttr, out: &mut ibv_device_attr) {
    copy_cstr(&mut out.fw_ver, &a.fw_ver);
    out.node_guid = a.node_guid.to_be();
    out.sys_image_guid = a.sys_image_guid.to_be();
    out.max_mr_size = a.max_mr_size;
    out.page_size_cap = a.page_size_cap;
    out.vendor_id = a.vendor_id;
    out.vendor_part_id = a.vendor_part_id;
    out.hw_ver = a.hw_ver;
    out.max_qp = int(a.max_qp);
    out.max_qp_wr = int(a.max_qp_wr);
    out.device_cap_flags = a.device_cap_flags;
    out.max_sge = int(a.max_sge);
    out.max_sge_rd = int(a.max_sge_rd);
    out.max_cq = int(a.max_cq);
    out.max_cqe = int(a.max_cqe);
    out.max_mr = int(a.max_mr);
    out.max_pd = int(a.max_pd);
    out.max_qp_rd_atom = int(a.max_qp_rd_atom);
    out.max_ee_rd_atom = int(a.max_ee_rd_atom);
    out.max_res_rd_atom = int(a.max_res_rd_atom);
    out.max_qp_init_rd_atom = int(a.max_qp_init_rd_atom);
    out.atomic_cap = a.atomic_cap;
    out.max_ah = int(a.max_ah);
    out.max_srq = int(a.max_srq);
    out.max_srq_wr = int(a.max_srq_wr);
    out.max_srq_sge = int(a.max_srq_sge);
    out.max_pkeys = a.max_pkeys;
    out.local_ca_ack_delay = a.local_ca_ack_delay;
    out.phys_port_cnt = a.phys_port_cnt;
}

/// `ibv_query_device`. Returns 0 or an errno value.
pub unsafe extern "C" fn ibv_query_device(context: *mut ibv_context, attr: *mut ibv_device_attr) -> c_int {
    const W: &str = "ibv_query_device";
    ret_code(W, || {
        // SAFETY: a live context (the verb's contract).
        let ctx = unsafe { Ctx::get(W, context)? };
        non_null(W, attr, "device_attr")?;
        let a = ctx.inner.query_device().map_err(|e| fail(W, &e))?;
        // SAFETY: `attr` points to a struct ibv_device_attr; zeroed first so
        // that the fields vRDMA has no value for read 0.
        unsafe {
            ptr::write_bytes(attr, 0, 1);
            fill_device_attr(&a, &mut *attr);
        }
        Ok(())
    })
}

/// `verbs_context.query_device_ex`, behind the inline
/// `ibv_query_device_ex`: the basic attributes, and zero for every
/// extended capability (none is offered).
unsafe extern "C" fn query_device_ex_op(
    context: *mut ibv_context,
    input: *const ibv_query_device_ex_input,
    attr: *mut ibv_device_attr_ex,
    attr_size: usize,
) -> c_int {
    const W: &str = "ibv_query_device_ex";
    ret_code(W, || {
        // SAFETY: a live context (the verb's contract).
        let ctx = unsafe { Ctx::get(W, context)? };
        non_null(W, attr, "attr")?;
        // SAFETY: `input` is NULL or a valid input structure.
        if !input.is_null() && unsafe { (*input).comp_mask } != 0 {
            return Err(refuse(W, "unknown input comp_mask", libc::EINVAL));
        }
        if attr_size < size_of::<ibv_device_attr>() {
            return Err(refuse(W, "attr_size smaller than struct ibv_device_attr", libc::EINVAL));
        }
        let a = ctx.inner.query_device().map_err(|e| fail(W, &e))?;
        // SAFETY: the caller's buffer holds `attr_size` bytes, at least an
        // ibv_device_attr; the fields after it are written only if inside.
        unsafe {
            ptr::write_bytes(attr.cast::<u8>(), 0, attr_size);
            fill_device_attr(&a, &mut (*attr).orig_attr);
            if attr_size >= size_of::<ibv_device_attr_ex>() {
                (*attr).phys_port_cnt_ex = u32::from(a.phys_port_cnt);
            }
        }
        Ok(())
    })
}

fn fill_port_attr(p: &PortAttr) -> ibv_port_attr {
    ibv_port_attr {
        state: u32::from(p.state),
        max_mtu: u32::from(p.max_mtu.raw()),
        active_mtu: u32::from(p.active_mtu.raw()),
        gid_tbl_len: int(p.gid_tbl_len),
        port_cap_flags: p.port_cap_flags,
        max_msg_sz: p.max_msg_sz,
        pkey_tbl_len: p.pkey_tbl_len,
        lid: p.lid,
        sm_lid: p.sm_lid,
        lmc: p.lmc,
        max_vl_num: p.max_vl_num,
        sm_sl: p.sm_sl,
        active_width: p.active_width,
        active_speed: p.active_speed,
        phys_state: p.phys_state,
        link_layer: p.link_layer,
        ..ibv_port_attr::default()
    }
}

/// rdma-core's `__lib_query_port`: fills `len` bytes of the caller's
/// structure, which may be the older, smaller one.
unsafe fn query_port_len(
    what: &str,
    context: *mut ibv_context,
    port: u8,
    out: *mut u8,
    len: usize,
) -> Res<()> {
    // SAFETY: a live context (the verb's contract).
    let ctx = unsafe { Ctx::get(what, context)? };
    non_null(what, out, "port_attr")?;
    let p = ctx.inner.query_port(port).map_err(|e| fail(what, &e))?;
    let attr = fill_port_attr(&p);
    let n = len.min(size_of::<ibv_port_attr>());
    // SAFETY: the caller's buffer holds `len` bytes; `n <= len` bytes come
    // from `attr`, the rest (a newer, larger structure) is zeroed.
    unsafe {
        ptr::write_bytes(out, 0, len);
        ptr::copy_nonoverlapping(ptr::from_ref(&attr).cast::<u8>(), out, n);
    }
    Ok(())
}

/// `verbs_context.query_port`, behind the `ibv_query_port` macro.
unsafe extern "C" fn query_port_op(
    context: *mut ibv_context,
    port_num: u8,
    port_attr: *mut ibv_port_attr,
    port_attr_len: usize,
) -> c_int {
    // SAFETY: the verb's contract: a live context, a buffer of the length.
    ret_code("ibv_query_port", || unsafe {
        query_port_len("ibv_query_port", context, port_num, port_attr.cast(), port_attr_len)
    })
}

/// `ibv_query_port@IBVERBS_1.1`: the exported form, for binaries whose
/// `verbs.h` did not route through `verbs_context` (its structure lacks
/// `port_cap_flags2`).
pub unsafe extern "C" fn ibv_query_port(
    context: *mut ibv_context,
    port_num: u8,
    port_attr: *mut c_void,
) -> c_int {
    // SAFETY: the verb's contract: a live context, a compat structure.
    ret_code("ibv_query_port", || unsafe {
        query_port_len("ibv_query_port", context, port_num, port_attr.cast(), COMPAT_PORT_ATTR_SIZE)
    })
}

/// The type of a GID: RoCE v2 for an IPv4-mapped GID on an Ethernet port,
/// else IB (an InfiniBand port's GIDs).
fn gid_type(link_layer: u8, gid: &Gid) -> u32 {
    if link_layer == IBV_LINK_LAYER_ETHERNET && gid.ipv4().is_some() {
        IBV_GID_TYPE_ROCE_V2
    } else {
        IBV_GID_TYPE_IB
    }
}

fn gid_index(what: &str, index: c_int) -> Res<u32> {
    u32::try_from(index).map_err(|_| refuse(what, "negative GID index", libc::EINVAL))
}

/// `ibv_query_gid`: 0, or -1 with `errno` set.
pub unsafe extern "C" fn ibv_query_gid(
    context: *mut ibv_context,
    port_num: u8,
    index: c_int,
    gid: *mut ibv_gid,
) -> c_int {
    const W: &str = "ibv_query_gid";
    ret_minus1(W, || {
        // SAFETY: a live context (the verb's contract).
        let ctx = unsafe { Ctx::get(W, context)? };
        non_null(W, gid, "gid")?;
        let g = ctx.inner.query_gid(port_num, gid_index(W, index)?).map_err(|e| fail(W, &e))?;
        // SAFETY: `gid` points to a union ibv_gid.
        unsafe { (*gid).raw = g.0 };
        Ok(())
    })
}

/// `ibv_query_gid_type@IBVERBS_PRIVATE_34` (used by `ibv_devinfo`): the
/// sysfs-style type, `IB/RoCE v1` (0) or `RoCE v2` (1).
pub unsafe extern "C" fn ibv_query_gid_type(
    context: *mut ibv_context,
    port_num: u8,
    index: u32,
    type_: *mut c_int,
) -> c_int {
    const W: &str = "ibv_query_gid_type";
    ret_minus1(W, || {
        // SAFETY: a live context (the verb's contract).
        let ctx = unsafe { Ctx::get(W, context)? };
        non_null(W, type_, "type")?;
        let g = ctx.inner.query_gid(port_num, index).map_err(|e| fail(W, &e))?;
        let t = match gid_type(ctx.link_layer, &g) {
            IBV_GID_TYPE_ROCE_V2 => IBV_GID_TYPE_SYSFS_ROCE_V2,
            _ => IBV_GID_TYPE_SYSFS_IB_ROCE_V1,
        };
        // SAFETY: `type_` points to an enum ibv_gid_type_sysfs.
        unsafe { *type_ = t };
        Ok(())
    })
}

fn fill_gid_entry(ctx: &Ctx, port: u8, index: u32, gid: Gid, out: *mut ibv_gid_entry) {
    let e = ibv_gid_entry {
        gid: ibv_gid { raw: gid.0 },
        gid_index: index,
        port_num: u32::from(port),
        gid_type: gid_type(ctx.link_layer, &gid),
        ndev_ifindex: 0,
    };
    // SAFETY: callers pass storage for one entry.
    unsafe { out.write(e) };
}

/// `_ibv_query_gid_ex` (behind `ibv_query_gid_ex`): 0 or an errno value.
pub unsafe extern "C" fn _ibv_query_gid_ex(
    context: *mut ibv_context,
    port_num: u32,
    gid_index: u32,
    entry: *mut ibv_gid_entry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    const W: &str = "ibv_query_gid_ex";
    ret_code(W, || {
        // SAFETY: a live context (the verb's contract).
        let ctx = unsafe { Ctx::get(W, context)? };
        non_null(W, entry, "entry")?;
        if flags != 0 || entry_size < size_of::<ibv_gid_entry>() {
            return Err(refuse(W, "unknown flags or short entry", libc::EINVAL));
        }
        let port = u8::try_from(port_num).map_err(|_| refuse(W, "no such port", libc::EINVAL))?;
        let g = ctx.inner.query_gid(port, gid_index).map_err(|e| fail(W, &e))?;
        if g.is_zero() {
            return Err(libc::ENODATA);
        }
        fill_gid_entry(ctx, port, gid_index, g, entry);
        Ok(())
    })
}

/// `_ibv_query_gid_table` (behind `ibv_query_gid_table`): the valid GIDs
/// of every port, as many as fit; their number, or a negative errno.
pub unsafe extern "C" fn _ibv_query_gid_table(
    context: *mut ibv_context,
    entries: *mut ibv_gid_entry,
    max_entries: usize,
    flags: u32,
    entry_size: usize,
) -> isize {
    const W: &str = "ibv_query_gid_table";
    guard(W, -(libc::EIO as isize), || {
        let run = || -> Res<isize> {
            // SAFETY: a live context (the verb's contract).
            let ctx = unsafe { Ctx::get(W, context)? };
            if flags != 0 || entry_size < size_of::<ibv_gid_entry>() || (entries.is_null() && max_entries > 0)
            {
                return Err(refuse(W, "bad arguments", libc::EINVAL));
            }
            let mut n = 0usize;
            for port in 1..=ctx.phys_port_cnt {
                let len = ctx.inner.query_port(port).map_err(|e| fail(W, &e))?.gid_tbl_len;
                for i in 0..len {
                    let g = ctx.inner.query_gid(port, i).map_err(|e| fail(W, &e))?;
                    if g.is_zero() {
                        continue;
                    }
                    if n == max_entries {
                        return Err(refuse(W, "more GIDs than entries", libc::EINVAL));
                    }
                    // SAFETY: entry `n` of `max_entries`, each `entry_size` bytes.
                    let at = unsafe { entries.cast::<u8>().add(n * entry_size).cast::<ibv_gid_entry>() };
                    fill_gid_entry(ctx, port, i, g, at);
                    n += 1;
                }
            }
            Ok(n as isize)
        };
        run().unwrap_or_else(|e| {
            set_errno(e);
            -(e as isize)
        })
    })
}

/// `ibv_query_pkey`: the port has one P_Key, the default full-membership
/// 0xffff (in network order), at index 0. 0, or -1 with `errno` set.
pub unsafe extern "C" fn ibv_query_pkey(
    context: *mut ibv_context,
    port_num: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    const W: &str = "ibv_query_pkey";
    ret_minus1(W, || {
        // SAFETY: a live context (the verb's contract).
        let ctx = unsafe { Ctx::get(W, context)? };
        non_null(W, pkey, "pkey")?;
        let p = ctx.inner.query_port(port_num).map_err(|e| fail(W, &e))?;
        match u16::try_from(index) {
            Ok(i) if i < p.pkey_tbl_len => {
                // SAFETY: `pkey` points to a __be16.
                unsafe { *pkey = 0xffffu16.to_be() };
                Ok(())
            }
            _ => Err(refuse(W, "P_Key index out of the table", libc::EINVAL)),
        }
    })
}

/// `ibv_get_pkey_index`: the index of `pkey` (network order), or -1.
pub unsafe extern "C" fn ibv_get_pkey_index(context: *mut ibv_context, port_num: u8, pkey: u16) -> c_int {
    guard("ibv_get_pkey_index", -1, || {
        let mut i = 0;
        loop {
            let mut p = 0u16;
            // SAFETY: forwards the caller's context; `p` is a local.
            if unsafe { ibv_query_pkey(context, port_num, i, &mut p) } != 0 {
                return -1;
            }
            if p == pkey {
                return i;
            }
            i += 1;
        }
    })
}

fn element_of(reg: &Registry, ev: &vrdma::AsyncEvent) -> Option<ibv_async_event_element> {
    use AsyncEventType as T;
    let id = ev.element;
    // Counting under the registry lock: a destroy removes the object from
    // the registry first, then waits for the acknowledgements.
    match ev.event_type {
        T::CqErr => reg.cqs.get(&id).map(|&c| {
            // SAFETY: registered CQs are live (removed before they are freed).
            unsafe { (*c).async_reported.fetch_add(1, Ordering::Relaxed) };
            ibv_async_event_element { cq: c.cast() }
        }),
        T::QpFatal
        | T::QpReqErr
        | T::QpAccessErr
        | T::CommEst
        | T::SqDrained
        | T::PathMig
        | T::PathMigErr
        | T::QpLastWqeReached => reg.qps.get(&id).map(|&q| {
            // SAFETY: registered QPs are live (removed before they are freed).
            unsafe { (*q).events_reported.fetch_add(1, Ordering::Relaxed) };
            ibv_async_event_element { qp: q.cast() }
        }),
        T::SrqErr | T::SrqLimitReached => reg.srqs.get(&id).map(|&s| {
            // SAFETY: registered SRQs are live (removed before they are freed).
            unsafe { (*s).events_reported.fetch_add(1, Ordering::Relaxed) };
            ibv_async_event_element { srq: s.cast() }
        }),
        T::DeviceFatal => Some(ibv_async_event_element { port_num: 0 }),
        T::PortActive
        | T::PortErr
        | T::LidChange
        | T::PkeyChange
        | T::SmChange
        | T::ClientReregister
        | T::GidChange => Some(ibv_async_event_element { port_num: id as c_int }),
    }
}

/// `ibv_get_async_event`: the next event, waiting for one unless the
/// application made `async_fd` non-blocking (then -1 with `EAGAIN`).
/// Events naming an object already destroyed are skipped.
pub unsafe extern "C" fn ibv_get_async_event(
    context: *mut ibv_context,
    event: *mut ibv_async_event,
) -> c_int {
    const W: &str = "ibv_get_async_event";
    ret_minus1(W, || {
        // SAFETY: a live context (the verb's contract).
        let ctx = unsafe { Ctx::get(W, context)? };
        non_null(W, event, "event")?;
        let fd = ctx.inner.async_event_fd().as_fd().as_raw_fd();
        loop {
            let timeout = is_nonblocking(fd).then_some(Duration::ZERO);
            let Some(ev) = ctx.inner.get_async_event(timeout).map_err(|e| fail(W, &e))? else {
                return Err(libc::EAGAIN);
            };
            if let Some(element) = element_of(&ctx.registry(), &ev) {
                // SAFETY: `event` points to a struct ibv_async_event.
                unsafe {
                    event.write(ibv_async_event { element, event_type: u32::from(ev.event_type.raw()) })
                };
                return Ok(());
            }
        }
    })
}

/// `ibv_ack_async_event`: counts the event as handled on its object, so
/// that destroying the object can proceed.
pub unsafe extern "C" fn ibv_ack_async_event(event: *mut ibv_async_event) {
    guard("ibv_ack_async_event", (), || {
        if event.is_null() {
            return;
        }
        // SAFETY: an event filled by ibv_get_async_event whose object is
        // still alive (destroys wait for this acknowledgement).
        unsafe {
            let ev = &*event;
            let Some(t) = u8::try_from(ev.event_type).ok().and_then(AsyncEventType::from_raw) else {
                return;
            };
            use AsyncEventType as T;
            match t {
                T::CqErr => cq::ack_async(ev.element.cq),
                T::SrqErr | T::SrqLimitReached => srq::ack_async(ev.element.srq),
                T::QpFatal
                | T::QpReqErr
                | T::QpAccessErr
                | T::CommEst
                | T::SqDrained
                | T::PathMig
                | T::PathMigErr
                | T::QpLastWqeReached => qp::ack_async(ev.element.qp),
                _ => {}
            }
        }
    })
}
