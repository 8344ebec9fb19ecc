//! `vrdma-verbs`: a drop-in `libibverbs.so.1` for vRDMA.
//!
//! Unmodified programs built against rdma-core's libibverbs (the
//! `ibverbs-utils` examples, and later perftest, qperf, UCX, libfabric)
//! load this library instead of rdma-core's and run on the vRDMA software
//! HCA. It is a translation of rdma-core 44's C ABI onto the [`vrdma`]
//! client library and nothing more: every verb maps onto one call of the
//! client library, which owns the semantics (the QP state machine, work
//! request checks, events) together with the daemon.
//!
//! # Using it
//!
//! `vrdma run -- PROGRAM ARGS...` does everything below: it uses the
//! daemon that answers on `VRDMA_SOCKET` (or the default socket), or
//! starts one inside the `vrdma` process, points the program at this
//! library and at the daemon, and forwards the program's exit code.
//!
//! By hand: build the library (`cargo build --release -p vrdma-verbs`,
//! giving `target/release/libvrdma_verbs.so`), make a directory with a
//! `libibverbs.so.1` link to it, and put that directory first on
//! `LD_LIBRARY_PATH`, with `VRDMA_SOCKET` naming the daemon's socket:
//!
//! ```text
//! vrdma daemon --socket /tmp/vrdma.sock &
//! mkdir -p /tmp/vrdma-lib
//! ln -sf "$PWD/target/release/libvrdma_verbs.so" /tmp/vrdma-lib/libibverbs.so.1
//! export LD_LIBRARY_PATH=/tmp/vrdma-lib VRDMA_SOCKET=/tmp/vrdma.sock
//! ibv_devinfo -v
//! ibv_rc_pingpong &  ibv_rc_pingpong localhost
//! ```
//!
//! `VRDMA_VERBS_DEBUG=1` prints one line on stderr for every verb that
//! fails, with the reason.
//!
//! # The ABI
//!
//! - **Symbols and versions.** The library's soname is `libibverbs.so.1`
//!   and its symbols carry rdma-core's version nodes: the functions that
//!   exist in both `IBVERBS_1.0` and `IBVERBS_1.1` are exported as
//!   `@@IBVERBS_1.1` (what binaries import), the completion-channel pair
//!   and the sysfs and rate helpers only as `@@IBVERBS_1.0`, newer ones
//!   under `IBVERBS_1.5` ... `IBVERBS_1.14`, and `ibv_query_gid_type`
//!   under `IBVERBS_PRIVATE_34` (`ibv_devinfo` imports it); and one of
//!   vRDMA's own under `VRDMA_PRIVATE_1`, for its drop-in librdmacm
//!   (`vrdma_create_qp_cm_id`: a QP made attached to an rdma_cm id). See
//!   [`EXPORTS`] for the list and `build.rs` for the linking.
//! - **Structures** are mirrored field for field with compile-time checks
//!   of every size and offset (module `abi`).
//! - **Contexts** are rdma-core's `struct verbs_context` with the
//!   `struct ibv_context` last, `abi_compat = UINTPTR_MAX` and `sz` set, so
//!   the inline `verbs_get_ctx_op()` finds `query_port`,
//!   `query_device_ex`, `create_qp_ex` and `create_cq_ex`, and reads NULL (unsupported: the inline wrappers
//!   return `EOPNOTSUPP` or take their legacy path) for the rest.
//! - **The data path** (`ibv_post_send`, `ibv_post_recv`,
//!   `ibv_post_srq_recv`, `ibv_poll_cq`, `ibv_req_notify_cq`) is inline in
//!   the application and jumps through `ctx->ops`; those operations call
//!   straight into the client library's shared-memory rings, converting
//!   work requests and completions on the stack (no allocation, no lock).
//! - **Objects** (`Pd`, `Mr`, `Cq`, `Qp`, `Srq`, `Channel`) are boxes
//!   whose first member is the C structure the application sees, followed
//!   by the client library's handle. CQs are laid out as `ibv_cq_ex` and
//!   QPs as `ibv_qp_ex`: those from `ibv_create_cq_ex` /
//!   `ibv_create_qp_ex` (with send operations) have the extended polling
//!   and `ibv_wr_*` operations (modules `cq_ex`, `qp_ex`).
//! - **Descriptors**: a completion channel's `fd` and the context's
//!   `async_fd` are the client library's real, pollable doorbell
//!   descriptors.
//!
//! # Errors
//!
//! Every exported function either works or fails the way rdma-core
//! documents for it: NULL or -1 with `errno`, or an errno value. NULL
//! object pointers are refused with `EINVAL` where rdma-core would crash.
//! Features vRDMA lacks answer `EOPNOTSUPP` (dma-buf regions, an iova
//! other than the address, resizing CQs, ECE, multicast). A Rust panic never crosses into C: it becomes the
//! function's error with `errno = EIO`.
//!
//! # Differences from rdma-core that programs can observe
//!
//! - Registered memory is re-backed by a shared memfd (see
//!   [`vrdma::ProtectionDomain::register_raw`]): after `fork()` the child
//!   gets a private copy of it as it starts, as on kernels where rdma-core
//!   reports `IBV_FORK_UNNEEDED`, so `ibv_fork_init` has nothing to do
//!   (module `mem`). A `fork()` waits for a registration that another
//!   thread is re-backing at that moment.
//! - There is no kernel device: `cmd_fd` is a descriptor on `/dev/null`
//!   (valid, as programs check, but no command channel), the sysfs paths
//!   of the device do not exist, `ibv_get_device_index` is -1.
//! - A CQ created without a channel accepts `ibv_req_notify_cq` and does
//!   nothing with it, as hardware does.
//! - A QP asked for 0 send (or, without an SRQ, 0 receive) work requests
//!   gets 1, reported back in `cap` as the verbs allow.

// The structure layouts are checked for x86-64 Linux (LP64 glibc) and
// the export trampolines are x86-64 code; elsewhere the crate is empty,
// so that the workspace still builds.
#![cfg(all(target_os = "linux", target_arch = "x86_64"))]
// The exported functions are reached from assembly (see `exports!`),
// which the unit-test build leaves out.
#![cfg_attr(test, allow(dead_code))]
// The verbs' safety contracts are rdma-core's (its man pages and
// verbs.h); the module `raw` makes them public to this package's tests
// and examples only, and each one says what it relies on.
#![allow(clippy::missing_safety_doc)]

mod abi;
mod ah;
mod compat;
mod context;
mod cq;
mod cq_ex;
mod device;
mod mem;
mod qp;
mod qp_ex;
mod srq;
mod strings;
mod util;

/// The C entry points and structures for Rust callers in this package:
/// the allocation test (`tests/no_alloc.rs`) and the cost benchmark
/// (`examples/shim_cost.rs`) call the shim exactly as a C program does
/// (the exported symbols jump to these functions; the data path is
/// reached through the ops tables of the objects they return). Not an
/// interface for other crates.
#[doc(hidden)]
pub mod raw {
    pub use crate::abi::*;
    pub use crate::context::{ibv_close_device, ibv_open_device, ibv_query_port};
    pub use crate::cq::{ibv_create_comp_channel, ibv_create_cq, ibv_destroy_comp_channel, ibv_destroy_cq};
    pub use crate::cq_ex::{ibv_cq_init_attr_ex, ibv_poll_cq_attr};
    pub use crate::device::{ibv_free_device_list, ibv_get_device_list};
    pub use crate::mem::{ibv_alloc_pd, ibv_dealloc_pd, ibv_dereg_mr, ibv_reg_mr};
    pub use crate::qp::{ibv_create_qp, ibv_destroy_qp, ibv_modify_qp, ibv_qp_to_qp_ex};
    pub use crate::qp_ex::{ibv_qp_init_attr_ex, IBV_QP_INIT_ATTR_PD, IBV_QP_INIT_ATTR_SEND_OPS_FLAGS};
}

/// Exports each function under its C name bound to its version node, and
/// lists them in [`EXPORTS`].
///
/// A `.symver name, name@@NODE` directive (the default version, which new
/// links import) must sit in the same object file as the symbol's
/// definition, and rustc places Rust functions in codegen units of its
/// choosing. So each export is a two-instruction trampoline defined in
/// assembly, next to its directive, that jumps to the Rust function (a
/// direct jump: the function is hidden inside the library). The data path
/// does not pay for the jump: applications reach it through the
/// context's ops table, which points at the Rust functions. Not built
/// into the unit-test executable, which has no version script.
///
/// The link needs rust-lld, the default linker of x86_64 Linux since
/// Rust 1.90 (hence this package's `rust-version`): rustc hands the linker
/// its own anonymous version script, which GNU ld refuses to combine with
/// the named nodes of `libibverbs.map`.
macro_rules! exports {
    ($($module:ident :: $name:ident @ $node:literal),* $(,)?) => {
        $(
            #[cfg(not(test))]
            std::arch::global_asm!(
                concat!(".globl ", stringify!($name), "_vrdma_export"),
                concat!(".type ", stringify!($name), "_vrdma_export, @function"),
                concat!(stringify!($name), "_vrdma_export:"),
                "jmp {f}",
                concat!(".size ", stringify!($name), "_vrdma_export, . - ", stringify!($name), "_vrdma_export"),
                concat!(".symver ", stringify!($name), "_vrdma_export, ", stringify!($name), "@@", $node),
                f = sym $module::$name,
            );
        )*

        /// Every exported function with its version node, as the library
        /// is linked.
        pub const EXPORTS: &[(&str, &str)] = &[$((stringify!($name), $node)),*];
    };
}

exports! {
    // Only in IBVERBS_1.0 in rdma-core.
    cq::ibv_create_comp_channel @ "IBVERBS_1.0",
    cq::ibv_destroy_comp_channel @ "IBVERBS_1.0",
    device::ibv_get_sysfs_path @ "IBVERBS_1.0",
    device::ibv_read_sysfs_file @ "IBVERBS_1.0",
    strings::ibv_rate_to_mult @ "IBVERBS_1.0",
    strings::mult_to_ibv_rate @ "IBVERBS_1.0",
    // IBVERBS_1.1: the current versions of the 1.0 verbs, and the rest.
    device::ibv_get_device_list @ "IBVERBS_1.1",
    device::ibv_free_device_list @ "IBVERBS_1.1",
    device::ibv_get_device_name @ "IBVERBS_1.1",
    device::ibv_get_device_guid @ "IBVERBS_1.1",
    context::ibv_open_device @ "IBVERBS_1.1",
    context::ibv_close_device @ "IBVERBS_1.1",
    context::ibv_get_async_event @ "IBVERBS_1.1",
    context::ibv_ack_async_event @ "IBVERBS_1.1",
    context::ibv_query_device @ "IBVERBS_1.1",
    context::ibv_query_port @ "IBVERBS_1.1",
    context::ibv_query_gid @ "IBVERBS_1.1",
    context::ibv_query_pkey @ "IBVERBS_1.1",
    mem::ibv_alloc_pd @ "IBVERBS_1.1",
    mem::ibv_dealloc_pd @ "IBVERBS_1.1",
    mem::ibv_reg_mr @ "IBVERBS_1.1",
    mem::ibv_dereg_mr @ "IBVERBS_1.1",
    cq::ibv_create_cq @ "IBVERBS_1.1",
    cq::ibv_resize_cq @ "IBVERBS_1.1",
    cq::ibv_destroy_cq @ "IBVERBS_1.1",
    cq::ibv_get_cq_event @ "IBVERBS_1.1",
    cq::ibv_ack_cq_events @ "IBVERBS_1.1",
    srq::ibv_create_srq @ "IBVERBS_1.1",
    srq::ibv_modify_srq @ "IBVERBS_1.1",
    srq::ibv_query_srq @ "IBVERBS_1.1",
    srq::ibv_destroy_srq @ "IBVERBS_1.1",
    qp::ibv_create_qp @ "IBVERBS_1.1",
    qp::ibv_query_qp @ "IBVERBS_1.1",
    qp::ibv_modify_qp @ "IBVERBS_1.1",
    qp::ibv_destroy_qp @ "IBVERBS_1.1",
    mem::ibv_fork_init @ "IBVERBS_1.1",
    mem::ibv_dontfork_range @ "IBVERBS_1.1",
    mem::ibv_dofork_range @ "IBVERBS_1.1",
    strings::ibv_node_type_str @ "IBVERBS_1.1",
    strings::ibv_port_state_str @ "IBVERBS_1.1",
    strings::ibv_event_type_str @ "IBVERBS_1.1",
    strings::ibv_wc_status_str @ "IBVERBS_1.1",
    strings::ibv_rate_to_mbps @ "IBVERBS_1.1",
    strings::mbps_to_ibv_rate @ "IBVERBS_1.1",
    context::ibv_get_pkey_index @ "IBVERBS_1.5",
    qp::ibv_qp_to_qp_ex @ "IBVERBS_1.6",
    mem::ibv_reg_mr_iova @ "IBVERBS_1.7",
    mem::ibv_reg_mr_iova2 @ "IBVERBS_1.8",
    device::ibv_get_device_index @ "IBVERBS_1.9",
    qp::ibv_query_ece @ "IBVERBS_1.10",
    qp::ibv_set_ece @ "IBVERBS_1.10",
    context::_ibv_query_gid_ex @ "IBVERBS_1.11",
    context::_ibv_query_gid_table @ "IBVERBS_1.11",
    mem::ibv_reg_dmabuf_mr @ "IBVERBS_1.12",
    mem::ibv_is_fork_initialized @ "IBVERBS_1.13",
    qp::ibv_query_qp_data_in_order @ "IBVERBS_1.14",
    context::ibv_query_gid_type @ "IBVERBS_PRIVATE_34",
    // vRDMA's own, for its drop-in librdmacm (module qp).
    qp::vrdma_create_qp_cm_id @ "VRDMA_PRIVATE_1",
    // Imported by Debian's librdmacm.so.1 and perftest (modules compat, ah).
    ah::ibv_copy_qp_attr_from_kern @ "IBVERBS_1.0",
    ah::ibv_copy_path_rec_from_kern @ "IBVERBS_1.0",
    ah::ibv_copy_path_rec_to_kern @ "IBVERBS_1.0",
    ah::ibv_copy_ah_attr_from_kern @ "IBVERBS_1.1",
    compat::ibv_attach_mcast @ "IBVERBS_1.1",
    compat::ibv_detach_mcast @ "IBVERBS_1.1",
    ah::ibv_create_ah @ "IBVERBS_1.1",
    ah::ibv_create_ah_from_wc @ "IBVERBS_1.1",
    ah::ibv_init_ah_from_wc @ "IBVERBS_1.1",
    ah::ibv_destroy_ah @ "IBVERBS_1.1",
    // The rest of rdma-core's public exports: errors, so that programs
    // linking them load.
    compat::ibv_rereg_mr @ "IBVERBS_1.1",
    compat::ibv_resolve_eth_l2_from_gid @ "IBVERBS_1.1",
    compat::ibv_import_device @ "IBVERBS_1.10",
    compat::ibv_import_pd @ "IBVERBS_1.10",
    compat::ibv_import_mr @ "IBVERBS_1.10",
    compat::ibv_unimport_pd @ "IBVERBS_1.10",
    compat::ibv_unimport_mr @ "IBVERBS_1.10",
    compat::ibv_import_dm @ "IBVERBS_1.13",
    compat::ibv_unimport_dm @ "IBVERBS_1.13",
}
