//! `vrdma-companions`: stand-ins for rdma-core's provider libraries
//! `libmlx5.so.1` and `libefa.so.1`, for programs that run on vRDMA.
//!
//! Debian's perftest binaries (and UCX's `libuct_ib`, libfabric) are
//! linked against `libmlx5.so.1` and `libefa.so.1` for their direct-verbs
//! extensions (`mlx5dv_*`, `efadv_*`), and most of them with `BIND_NOW`,
//! so every one of those symbols must resolve when the program loads,
//! even though none is called on a device that is neither Mellanox's nor
//! EFA. rdma-core's own copies cannot load beside vRDMA's
//! `libibverbs.so.1`: they import rdma-core's private provider ABI
//! (`IBVERBS_PRIVATE_34`). This library exports exactly the functions
//! those programs import, under rdma-core 44's version nodes
//! (`MLX5_1.x`, `EFA_1.x`), and each one answers the way rdma-core's do
//! for a device that is not theirs: NULL or an error with `errno =
//! EOPNOTSUPP`, `false` from `mlx5dv_is_supported`. They never claim a
//! device.
//!
//! One shared object serves both sonames: `vrdma run` (and the tests of
//! `vrdma-verbs`) put a `libmlx5.so.1` and a `libefa.so.1` link to it in
//! the private library directory beside `libibverbs.so.1`. The dynamic
//! linker maps the file once (it recognises the same file under its
//! second name) and finds each version node a program asks for in it.
//!
//! The C prototypes follow rdma-core 44's `mlx5dv.h` and `efadv.h`; the
//! pointer arguments are opaque here, since no function reads them.

// The export trampolines are x86-64 code, as in vrdma-verbs; elsewhere
// the crate is empty.
#![cfg(all(target_os = "linux", target_arch = "x86_64"))]
// The functions are reached from assembly only (see `exports!`), which
// the unit-test build leaves out.
#![cfg_attr(test, allow(dead_code))]

use std::ffi::{c_int, c_void};

/// Exports each function under its C name bound to its version node, as
/// vrdma-verbs' macro of the same name does (see its documentation there:
/// a `.symver name, name@@NODE` directive must sit in the object file
/// that defines the symbol, so each export is a jump defined in
/// assembly next to its directive). Lists them in [`EXPORTS`].
macro_rules! exports {
    ($($name:ident @ $node:literal),* $(,)?) => {
        $(
            #[cfg(not(test))]
            std::arch::global_asm!(
                concat!(".globl ", stringify!($name), "_vrdma_export"),
                concat!(".type ", stringify!($name), "_vrdma_export, @function"),
                concat!(stringify!($name), "_vrdma_export:"),
                "jmp {f}",
                concat!(".size ", stringify!($name), "_vrdma_export, . - ", stringify!($name), "_vrdma_export"),
                concat!(".symver ", stringify!($name), "_vrdma_export, ", stringify!($name), "@@", $node),
                f = sym $name,
            );
        )*

        /// Every exported function with its version node.
        pub const EXPORTS: &[(&str, &str)] = &[$((stringify!($name), $node)),*];
    };
}

exports! {
    // perftest (all eight ib_* binaries).
    mlx5dv_create_qp @ "MLX5_1.3",
    mlx5dv_open_device @ "MLX5_1.7",
    mlx5dv_devx_general_cmd @ "MLX5_1.7",
    mlx5dv_create_mkey @ "MLX5_1.10",
    mlx5dv_destroy_mkey @ "MLX5_1.10",
    mlx5dv_qp_ex_from_ibv_qp_ex @ "MLX5_1.10",
    mlx5dv_crypto_login @ "MLX5_1.21",
    mlx5dv_dek_create @ "MLX5_1.21",
    mlx5dv_dek_destroy @ "MLX5_1.21",
    efadv_create_qp_ex @ "EFA_1.1",
    efadv_query_device @ "EFA_1.1",
    // UCX's libuct_ib and libuct_rdmacm.
    mlx5dv_create_cq @ "MLX5_1.1",
    mlx5dv_init_obj @ "MLX5_1.2",
    mlx5dv_devx_alloc_uar @ "MLX5_1.7",
    mlx5dv_devx_free_uar @ "MLX5_1.7",
    mlx5dv_devx_obj_create @ "MLX5_1.7",
    mlx5dv_devx_obj_destroy @ "MLX5_1.7",
    mlx5dv_devx_obj_modify @ "MLX5_1.7",
    mlx5dv_devx_obj_query @ "MLX5_1.7",
    mlx5dv_devx_umem_reg @ "MLX5_1.7",
    mlx5dv_devx_umem_dereg @ "MLX5_1.7",
    mlx5dv_devx_qp_modify @ "MLX5_1.8",
    mlx5dv_devx_qp_query @ "MLX5_1.8",
    mlx5dv_is_supported @ "MLX5_1.8",
    mlx5dv_devx_create_event_channel @ "MLX5_1.11",
    mlx5dv_devx_destroy_event_channel @ "MLX5_1.11",
    mlx5dv_devx_get_event @ "MLX5_1.11",
    mlx5dv_devx_subscribe_devx_event @ "MLX5_1.11",
    // libfabric.
    efadv_query_ah @ "EFA_1.1",
    efadv_create_cq @ "EFA_1.2",
    efadv_cq_from_ibv_cq_ex @ "EFA_1.2",
}

type P = *mut c_void;

fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno, valid for the
    // thread's life.
    unsafe { *libc::__errno_location() = e };
}

/// NULL with `errno = EOPNOTSUPP`: the answer of rdma-core's constructors
/// for a device of another provider.
fn none() -> P {
    set_errno(libc::EOPNOTSUPP);
    std::ptr::null_mut()
}

/// `EOPNOTSUPP`, returned and stored in `errno`: the answer of rdma-core's
/// `int` functions for a device of another provider.
fn unsupported() -> c_int {
    set_errno(libc::EOPNOTSUPP);
    libc::EOPNOTSUPP
}

// mlx5dv.h

/// `struct ibv_qp *mlx5dv_create_qp(struct ibv_context *, struct ibv_qp_init_attr_ex *, struct mlx5dv_qp_init_attr *)`
extern "C" fn mlx5dv_create_qp(_ctx: P, _attr: P, _dv_attr: P) -> P {
    none()
}

/// `struct ibv_context *mlx5dv_open_device(struct ibv_device *, struct mlx5dv_context_attr *)`
extern "C" fn mlx5dv_open_device(_device: P, _attr: P) -> P {
    none()
}

/// `int mlx5dv_devx_general_cmd(struct ibv_context *, const void *in, size_t inlen, void *out, size_t outlen)`
extern "C" fn mlx5dv_devx_general_cmd(_ctx: P, _in: P, _inlen: usize, _out: P, _outlen: usize) -> c_int {
    unsupported()
}

/// `struct mlx5dv_mkey *mlx5dv_create_mkey(struct mlx5dv_mkey_init_attr *)`
extern "C" fn mlx5dv_create_mkey(_attr: P) -> P {
    none()
}

/// `int mlx5dv_destroy_mkey(struct mlx5dv_mkey *)`
extern "C" fn mlx5dv_destroy_mkey(_mkey: P) -> c_int {
    unsupported()
}

/// `struct mlx5dv_qp_ex *mlx5dv_qp_ex_from_ibv_qp_ex(struct ibv_qp_ex *)`:
/// no QP here is an mlx5 one.
extern "C" fn mlx5dv_qp_ex_from_ibv_qp_ex(_qp: P) -> P {
    none()
}

/// `int mlx5dv_crypto_login(struct ibv_context *, struct mlx5dv_crypto_login_attr *)`
extern "C" fn mlx5dv_crypto_login(_ctx: P, _attr: P) -> c_int {
    unsupported()
}

/// `struct mlx5dv_dek *mlx5dv_dek_create(struct ibv_context *, struct mlx5dv_dek_init_attr *)`
extern "C" fn mlx5dv_dek_create(_ctx: P, _attr: P) -> P {
    none()
}

/// `int mlx5dv_dek_destroy(struct mlx5dv_dek *)`
extern "C" fn mlx5dv_dek_destroy(_dek: P) -> c_int {
    unsupported()
}

/// `struct ibv_cq_ex *mlx5dv_create_cq(struct ibv_context *, struct ibv_cq_init_attr_ex *, struct mlx5dv_cq_init_attr *)`
extern "C" fn mlx5dv_create_cq(_ctx: P, _attr: P, _dv_attr: P) -> P {
    none()
}

/// `int mlx5dv_init_obj(struct mlx5dv_obj *, uint64_t obj_type)`
extern "C" fn mlx5dv_init_obj(_obj: P, _obj_type: u64) -> c_int {
    unsupported()
}

/// `struct mlx5dv_devx_uar *mlx5dv_devx_alloc_uar(struct ibv_context *, uint32_t flags)`
extern "C" fn mlx5dv_devx_alloc_uar(_ctx: P, _flags: u32) -> P {
    none()
}

/// `void mlx5dv_devx_free_uar(struct mlx5dv_devx_uar *)`
extern "C" fn mlx5dv_devx_free_uar(_uar: P) {}

/// `struct mlx5dv_devx_obj *mlx5dv_devx_obj_create(struct ibv_context *, const void *in, size_t inlen, void *out, size_t outlen)`
extern "C" fn mlx5dv_devx_obj_create(_ctx: P, _in: P, _inlen: usize, _out: P, _outlen: usize) -> P {
    none()
}

/// `int mlx5dv_devx_obj_destroy(struct mlx5dv_devx_obj *)`
extern "C" fn mlx5dv_devx_obj_destroy(_obj: P) -> c_int {
    unsupported()
}

/// `int mlx5dv_devx_obj_modify(struct mlx5dv_devx_obj *, const void *in, size_t inlen, void *out, size_t outlen)`
extern "C" fn mlx5dv_devx_obj_modify(_obj: P, _in: P, _inlen: usize, _out: P, _outlen: usize) -> c_int {
    unsupported()
}

/// `int mlx5dv_devx_obj_query(struct mlx5dv_devx_obj *, const void *in, size_t inlen, void *out, size_t outlen)`
extern "C" fn mlx5dv_devx_obj_query(_obj: P, _in: P, _inlen: usize, _out: P, _outlen: usize) -> c_int {
    unsupported()
}

/// `struct mlx5dv_devx_umem *mlx5dv_devx_umem_reg(struct ibv_context *, void *addr, size_t size, uint32_t access)`
extern "C" fn mlx5dv_devx_umem_reg(_ctx: P, _addr: P, _size: usize, _access: u32) -> P {
    none()
}

/// `int mlx5dv_devx_umem_dereg(struct mlx5dv_devx_umem *)`
extern "C" fn mlx5dv_devx_umem_dereg(_umem: P) -> c_int {
    unsupported()
}

/// `int mlx5dv_devx_qp_modify(struct ibv_qp *, const void *in, size_t inlen, void *out, size_t outlen)`
extern "C" fn mlx5dv_devx_qp_modify(_qp: P, _in: P, _inlen: usize, _out: P, _outlen: usize) -> c_int {
    unsupported()
}

/// `int mlx5dv_devx_qp_query(struct ibv_qp *, const void *in, size_t inlen, void *out, size_t outlen)`
extern "C" fn mlx5dv_devx_qp_query(_qp: P, _in: P, _inlen: usize, _out: P, _outlen: usize) -> c_int {
    unsupported()
}

/// `bool mlx5dv_is_supported(struct ibv_device *)`: no vRDMA device is an
/// mlx5 one.
extern "C" fn mlx5dv_is_supported(_device: P) -> bool {
    false
}

/// `struct mlx5dv_devx_event_channel *mlx5dv_devx_create_event_channel(struct ibv_context *, enum mlx5dv_devx_create_event_channel_flags)`
extern "C" fn mlx5dv_devx_create_event_channel(_ctx: P, _flags: c_int) -> P {
    none()
}

/// `void mlx5dv_devx_destroy_event_channel(struct mlx5dv_devx_event_channel *)`
extern "C" fn mlx5dv_devx_destroy_event_channel(_channel: P) {}

/// `ssize_t mlx5dv_devx_get_event(struct mlx5dv_devx_event_channel *, struct mlx5dv_devx_async_event_hdr *, size_t)`:
/// -1 with `errno`.
extern "C" fn mlx5dv_devx_get_event(_channel: P, _data: P, _len: usize) -> isize {
    set_errno(libc::EOPNOTSUPP);
    -1
}

/// `int mlx5dv_devx_subscribe_devx_event(struct mlx5dv_devx_event_channel *, struct mlx5dv_devx_obj *, uint16_t, uint16_t *, uint64_t)`
extern "C" fn mlx5dv_devx_subscribe_devx_event(
    _channel: P,
    _obj: P,
    _len: u16,
    _list: P,
    _cookie: u64,
) -> c_int {
    unsupported()
}

// efadv.h

/// `struct ibv_qp *efadv_create_qp_ex(struct ibv_context *, struct ibv_qp_init_attr_ex *, struct efadv_qp_init_attr *, uint32_t inlen)`
extern "C" fn efadv_create_qp_ex(_ctx: P, _attr: P, _efa_attr: P, _inlen: u32) -> P {
    none()
}

/// `int efadv_query_device(struct ibv_context *, struct efadv_device_attr *, uint32_t inlen)`
extern "C" fn efadv_query_device(_ctx: P, _attr: P, _inlen: u32) -> c_int {
    unsupported()
}

/// `int efadv_query_ah(struct ibv_ah *, struct efadv_ah_attr *, uint32_t inlen)`
extern "C" fn efadv_query_ah(_ah: P, _attr: P, _inlen: u32) -> c_int {
    unsupported()
}

/// `struct ibv_cq_ex *efadv_create_cq(struct ibv_context *, struct ibv_cq_init_attr_ex *, struct efadv_cq_init_attr *, uint32_t inlen)`
extern "C" fn efadv_create_cq(_ctx: P, _attr: P, _efa_attr: P, _inlen: u32) -> P {
    none()
}

/// `struct efadv_cq *efadv_cq_from_ibv_cq_ex(struct ibv_cq_ex *)`
extern "C" fn efadv_cq_from_ibv_cq_ex(_cq: P) -> P {
    none()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_function_refuses() {
        let n = std::ptr::null_mut();
        assert!(mlx5dv_open_device(n, n).is_null());
        assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EOPNOTSUPP));
        assert_eq!(mlx5dv_devx_general_cmd(n, n, 0, n, 0), libc::EOPNOTSUPP);
        assert!(!mlx5dv_is_supported(n));
        assert_eq!(mlx5dv_devx_get_event(n, n, 0), -1);
        assert!(efadv_create_qp_ex(n, n, n, 0).is_null());
        assert_eq!(efadv_query_device(n, n, 0), libc::EOPNOTSUPP);
    }

    #[test]
    fn exports_are_unique_and_versioned() {
        let mut names: Vec<_> = EXPORTS.iter().map(|e| e.0).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), EXPORTS.len());
        for (name, node) in EXPORTS {
            let ok = (name.starts_with("mlx5dv_") && node.starts_with("MLX5_1."))
                || (name.starts_with("efadv_") && node.starts_with("EFA_1."));
            assert!(ok, "{name}@{node}");
        }
    }
}
