//! `vrdma-companions`: stand-ins for rdma-core 44's provider libraries
//! `libmlx5.so.1`, `libmlx4.so.1`, `libefa.so.1` and `libmana.so.1`, for
//! programs that run on vRDMA.
//!
//! Debian's `ibverbs-providers` ships these four libraries for their
//! direct-verbs extensions (`mlx5dv_*`, `mlx4dv_*`, `efadv_*`,
//! `manadv_*`), and programs link against them: perftest (all eight
//! `ib_*` binaries), UCX's `libuct_ib`, libfabric. Most are linked with
//! `BIND_NOW`, so every symbol they import must resolve when they load,
//! even though none is called on a device that is none of those vendors'.
//! rdma-core's own copies cannot load beside vRDMA's `libibverbs.so.1`:
//! they import rdma-core's private provider ABI (`IBVERBS_PRIVATE_34`).
//!
//! This library exports every public function of the four, each at its
//! version (`MLX5_1.0` ... `MLX5_1.24`, `MLX4_1.0`, `EFA_1.0` ...
//! `EFA_1.2`, `MANA_1.0`; [`EXPORTS`] lists all 141 symbols: 129 of
//! libmlx5, among them `mlx5dv_init_obj` at both its versions, 4 of
//! libmlx4, 6 of libefa, 2 of libmana), and each answers the way rdma-core
//! answers for a device of another vendor:
//!
//! - `mlx5dv_is_supported`: `false`;
//! - functions returning a pointer: `NULL`, with `errno = EOPNOTSUPP`;
//! - functions returning `int`: `EOPNOTSUPP` (rdma-core's convention for
//!   nearly all of them: "0 on success or the value of errno"), and
//!   `errno` set to it too; except `mlx5dv_qp_cancel_posted_send_wrs`,
//!   which returns `-errno`, and `mlx5dv_vfio_get_events_fd`, which
//!   returns a file descriptor, so -1;
//! - `mlx5dv_devx_get_event` (`ssize_t`): -1 with `errno = EOPNOTSUPP`;
//! - functions returning `void` (the `free`/`destroy` ones of objects
//!   that can never be created here, and two domain settings): nothing.
//!
//! No function reads its arguments, so none can be led to dereference a
//! pointer, and no function claims a device: the library is no provider
//! (vRDMA's `libibverbs.so.1` loads none), so `ibv_get_device_list` is
//! unchanged by it.
//!
//! One shared object serves all four sonames ([`SONAMES`]): `vrdma run`
//! (and the tests of `vrdma-verbs`) put a link to it under each name in
//! the private library directory beside `libibverbs.so.1`. The dynamic
//! linker maps the file once (it recognises the same file under another
//! name) and finds each version node a program asks for in it.
//!
//! The table below was generated once from rdma-core 44's exports
//! (`objdump -T` of Debian bookworm's libraries) and its headers
//! (`mlx5dv.h`, `mlx4dv.h`, `efadv.h`, `manadv.h`, whose prototypes the
//! comments quote without parameter names); building needs neither. The
//! package's tests check it against the installed libraries.

// The export trampolines are x86-64 code, as in vrdma-verbs; elsewhere
// the crate is empty.
#![cfg(all(target_os = "linux", target_arch = "x86_64"))]
// The answers are reached from assembly only (see `stand_ins!`), which
// the unit-test build leaves out.
#![cfg_attr(test, allow(dead_code))]

/// The sonames this library stands in for, as `vrdma run` links them.
pub const SONAMES: [&str; 4] = ["libmlx5.so.1", "libmlx4.so.1", "libefa.so.1", "libmana.so.1"];

/// One exported symbol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Export {
    /// The C function.
    pub name: &'static str,
    /// Its version node.
    pub node: &'static str,
    /// Whether this is the default version (`name@@node`, which new links
    /// bind to) rather than an older one kept for binaries linked before
    /// (`name@node`).
    pub default: bool,
    /// The function of [`answers`] that answers it.
    pub answer: &'static str,
}

/// Exports each function under its C name bound to its version node, as
/// vrdma-verbs' `exports!` does (see its documentation there: a `.symver
/// name, name@@NODE` directive must sit in the object file that defines
/// the symbol, so each export is a jump defined in assembly next to its
/// directive), and any older versions (`+ "NODE"`) with `name@NODE`.
/// Lists them all in [`EXPORTS`].
///
/// Every export jumps to one of the few functions of [`answers`], which
/// take no parameters: in the x86-64 System V ABI the caller passes
/// arguments in registers (and, past six, on a stack it cleans up
/// itself), so a callee that ignores them needs no matching signature.
/// The return type is what must match the C prototype quoted above each
/// entry: `int` (`eax`), `ssize_t` and pointers (`rax`), `bool` (`al`).
macro_rules! stand_ins {
    ($($name:ident @ $node:literal $(+ $old:literal)* => $answer:ident),* $(,)?) => {
        $(
            #[cfg(not(test))]
            std::arch::global_asm!(
                concat!(".globl ", stringify!($name), "_vrdma_export"),
                concat!(".type ", stringify!($name), "_vrdma_export, @function"),
                concat!(stringify!($name), "_vrdma_export:"),
                "jmp {f}",
                concat!(".size ", stringify!($name), "_vrdma_export, . - ", stringify!($name), "_vrdma_export"),
                concat!(".symver ", stringify!($name), "_vrdma_export, ", stringify!($name), "@@", $node),
                f = sym answers::$answer,
            );
            $(
                #[cfg(not(test))]
                std::arch::global_asm!(
                    concat!(".globl ", stringify!($name), "_vrdma_export_", $old),
                    concat!(".type ", stringify!($name), "_vrdma_export_", $old, ", @function"),
                    concat!(stringify!($name), "_vrdma_export_", $old, ":"),
                    "jmp {f}",
                    concat!(
                        ".size ", stringify!($name), "_vrdma_export_", $old,
                        ", . - ", stringify!($name), "_vrdma_export_", $old
                    ),
                    concat!(".symver ", stringify!($name), "_vrdma_export_", $old, ", ", stringify!($name), "@", $old),
                    f = sym answers::$answer,
                );
            )*
        )*

        /// Every exported symbol: each function at its version, and the
        /// older version of those that have one.
        pub const EXPORTS: &[Export] = &[$(
            Export { name: stringify!($name), node: $node, default: true, answer: stringify!($answer) },
            $(Export { name: stringify!($name), node: $old, default: false, answer: stringify!($answer) },)*
        )*];
    };
}

stand_ins! {
    // libmlx5.so.1 (mlx5dv.h)
    // int mlx5dv_query_device(struct ibv_context *, struct mlx5dv_context *)
    mlx5dv_query_device @ "MLX5_1.0" => unsupported,
    // struct ibv_cq_ex *mlx5dv_create_cq(struct ibv_context *, struct ibv_cq_init_attr_ex *,
    //     struct mlx5dv_cq_init_attr *)
    mlx5dv_create_cq @ "MLX5_1.1" => null,
    // int mlx5dv_init_obj(struct mlx5dv_obj *, uint64_t)
    mlx5dv_init_obj @ "MLX5_1.2" + "MLX5_1.0" => unsupported,
    // int mlx5dv_set_context_attr(struct ibv_context *, enum mlx5dv_set_ctx_attr_type, void *)
    mlx5dv_set_context_attr @ "MLX5_1.2" => unsupported,
    // struct ibv_qp *mlx5dv_create_qp(struct ibv_context *, struct ibv_qp_init_attr_ex *,
    //     struct mlx5dv_qp_init_attr *)
    mlx5dv_create_qp @ "MLX5_1.3" => null,
    // struct ibv_wq *mlx5dv_create_wq(struct ibv_context *, struct ibv_wq_init_attr *,
    //     struct mlx5dv_wq_init_attr *)
    mlx5dv_create_wq @ "MLX5_1.3" => null,
    // int mlx5dv_get_clock_info(struct ibv_context *, struct mlx5dv_clock_info *)
    mlx5dv_get_clock_info @ "MLX5_1.4" => unsupported,
    // struct ibv_flow_action *mlx5dv_create_flow_action_esp(struct ibv_context *,
    //     struct ibv_flow_action_esp_attr *, struct mlx5dv_flow_action_esp *)
    mlx5dv_create_flow_action_esp @ "MLX5_1.5" => null,
    // struct ibv_flow *mlx5dv_create_flow(struct mlx5dv_flow_matcher *,
    //     struct mlx5dv_flow_match_parameters *, size_t, struct mlx5dv_flow_action_attr *)
    mlx5dv_create_flow @ "MLX5_1.6" => null,
    // struct mlx5dv_flow_matcher *mlx5dv_create_flow_matcher(struct ibv_context *,
    //     struct mlx5dv_flow_matcher_attr *)
    mlx5dv_create_flow_matcher @ "MLX5_1.6" => null,
    // int mlx5dv_destroy_flow_matcher(struct mlx5dv_flow_matcher *)
    mlx5dv_destroy_flow_matcher @ "MLX5_1.6" => unsupported,
    // struct ibv_flow_action *mlx5dv_create_flow_action_modify_header(struct ibv_context *, size_t,
    //     uint64_t *, enum mlx5_ib_uapi_flow_table_type)
    mlx5dv_create_flow_action_modify_header @ "MLX5_1.7" => null,
    // struct ibv_flow_action *mlx5dv_create_flow_action_packet_reformat(struct ibv_context *, size_t,
    //     void *, enum mlx5_ib_uapi_flow_action_packet_reformat_type, enum mlx5_ib_uapi_flow_table_type)
    mlx5dv_create_flow_action_packet_reformat @ "MLX5_1.7" => null,
    // struct mlx5dv_devx_uar *mlx5dv_devx_alloc_uar(struct ibv_context *, uint32_t)
    mlx5dv_devx_alloc_uar @ "MLX5_1.7" => null,
    // void mlx5dv_devx_free_uar(struct mlx5dv_devx_uar *)
    mlx5dv_devx_free_uar @ "MLX5_1.7" => nothing,
    // int mlx5dv_devx_general_cmd(struct ibv_context *, const void *, size_t, void *, size_t)
    mlx5dv_devx_general_cmd @ "MLX5_1.7" => unsupported,
    // struct mlx5dv_devx_obj *mlx5dv_devx_obj_create(struct ibv_context *, const void *, size_t, void *,
    //     size_t)
    mlx5dv_devx_obj_create @ "MLX5_1.7" => null,
    // int mlx5dv_devx_obj_destroy(struct mlx5dv_devx_obj *)
    mlx5dv_devx_obj_destroy @ "MLX5_1.7" => unsupported,
    // int mlx5dv_devx_obj_modify(struct mlx5dv_devx_obj *, const void *, size_t, void *, size_t)
    mlx5dv_devx_obj_modify @ "MLX5_1.7" => unsupported,
    // int mlx5dv_devx_obj_query(struct mlx5dv_devx_obj *, const void *, size_t, void *, size_t)
    mlx5dv_devx_obj_query @ "MLX5_1.7" => unsupported,
    // int mlx5dv_devx_query_eqn(struct ibv_context *, uint32_t, uint32_t *)
    mlx5dv_devx_query_eqn @ "MLX5_1.7" => unsupported,
    // int mlx5dv_devx_umem_dereg(struct mlx5dv_devx_umem *)
    mlx5dv_devx_umem_dereg @ "MLX5_1.7" => unsupported,
    // struct mlx5dv_devx_umem *mlx5dv_devx_umem_reg(struct ibv_context *, void *, size_t, uint32_t)
    mlx5dv_devx_umem_reg @ "MLX5_1.7" => null,
    // struct ibv_context *mlx5dv_open_device(struct ibv_device *, struct mlx5dv_context_attr *)
    mlx5dv_open_device @ "MLX5_1.7" => null,
    // int mlx5dv_devx_cq_modify(struct ibv_cq *, const void *, size_t, void *, size_t)
    mlx5dv_devx_cq_modify @ "MLX5_1.8" => unsupported,
    // int mlx5dv_devx_cq_query(struct ibv_cq *, const void *, size_t, void *, size_t)
    mlx5dv_devx_cq_query @ "MLX5_1.8" => unsupported,
    // int mlx5dv_devx_ind_tbl_modify(struct ibv_rwq_ind_table *, const void *, size_t, void *, size_t)
    mlx5dv_devx_ind_tbl_modify @ "MLX5_1.8" => unsupported,
    // int mlx5dv_devx_ind_tbl_query(struct ibv_rwq_ind_table *, const void *, size_t, void *, size_t)
    mlx5dv_devx_ind_tbl_query @ "MLX5_1.8" => unsupported,
    // int mlx5dv_devx_qp_modify(struct ibv_qp *, const void *, size_t, void *, size_t)
    mlx5dv_devx_qp_modify @ "MLX5_1.8" => unsupported,
    // int mlx5dv_devx_qp_query(struct ibv_qp *, const void *, size_t, void *, size_t)
    mlx5dv_devx_qp_query @ "MLX5_1.8" => unsupported,
    // int mlx5dv_devx_srq_modify(struct ibv_srq *, const void *, size_t, void *, size_t)
    mlx5dv_devx_srq_modify @ "MLX5_1.8" => unsupported,
    // int mlx5dv_devx_srq_query(struct ibv_srq *, const void *, size_t, void *, size_t)
    mlx5dv_devx_srq_query @ "MLX5_1.8" => unsupported,
    // int mlx5dv_devx_wq_modify(struct ibv_wq *, const void *, size_t, void *, size_t)
    mlx5dv_devx_wq_modify @ "MLX5_1.8" => unsupported,
    // int mlx5dv_devx_wq_query(struct ibv_wq *, const void *, size_t, void *, size_t)
    mlx5dv_devx_wq_query @ "MLX5_1.8" => unsupported,
    // bool mlx5dv_is_supported(struct ibv_device *)
    mlx5dv_is_supported @ "MLX5_1.8" => no,
    // struct mlx5dv_devx_cmd_comp *mlx5dv_devx_create_cmd_comp(struct ibv_context *)
    mlx5dv_devx_create_cmd_comp @ "MLX5_1.9" => null,
    // void mlx5dv_devx_destroy_cmd_comp(struct mlx5dv_devx_cmd_comp *)
    mlx5dv_devx_destroy_cmd_comp @ "MLX5_1.9" => nothing,
    // int mlx5dv_devx_get_async_cmd_comp(struct mlx5dv_devx_cmd_comp *,
    //     struct mlx5_ib_uapi_devx_async_cmd_hdr *, size_t)
    mlx5dv_devx_get_async_cmd_comp @ "MLX5_1.9" => unsupported,
    // int mlx5dv_devx_obj_query_async(struct mlx5dv_devx_obj *, const void *, size_t, size_t, uint64_t,
    //     struct mlx5dv_devx_cmd_comp *)
    mlx5dv_devx_obj_query_async @ "MLX5_1.9" => unsupported,
    // struct ibv_dm *mlx5dv_alloc_dm(struct ibv_context *, struct ibv_alloc_dm_attr *,
    //     struct mlx5dv_alloc_dm_attr *)
    mlx5dv_alloc_dm @ "MLX5_1.10" => null,
    // struct mlx5dv_mkey *mlx5dv_create_mkey(struct mlx5dv_mkey_init_attr *)
    mlx5dv_create_mkey @ "MLX5_1.10" => null,
    // int mlx5dv_destroy_mkey(struct mlx5dv_mkey *)
    mlx5dv_destroy_mkey @ "MLX5_1.10" => unsupported,
    // struct mlx5dv_dr_action *mlx5dv_dr_action_create_dest_ibv_qp(struct ibv_qp *)
    mlx5dv_dr_action_create_dest_ibv_qp @ "MLX5_1.10" => null,
    // struct mlx5dv_dr_action *mlx5dv_dr_action_create_dest_table(struct mlx5dv_dr_table *)
    mlx5dv_dr_action_create_dest_table @ "MLX5_1.10" => null,
    // struct mlx5dv_dr_action *mlx5dv_dr_action_create_dest_vport(struct mlx5dv_dr_domain *, uint32_t)
    mlx5dv_dr_action_create_dest_vport @ "MLX5_1.10" => null,
    // struct mlx5dv_dr_action *mlx5dv_dr_action_create_drop(void)
    mlx5dv_dr_action_create_drop @ "MLX5_1.10" => null,
    // struct mlx5dv_dr_action *mlx5dv_dr_action_create_flow_counter(struct mlx5dv_devx_obj *, uint32_t)
    mlx5dv_dr_action_create_flow_counter @ "MLX5_1.10" => null,
    // struct mlx5dv_dr_action *mlx5dv_dr_action_create_modify_header(struct mlx5dv_dr_domain *, uint32_t,
    //     size_t, __be64 *)
    mlx5dv_dr_action_create_modify_header @ "MLX5_1.10" => null,
    // struct mlx5dv_dr_action *mlx5dv_dr_action_create_packet_reformat(struct mlx5dv_dr_domain *, uint32_t,
    //     enum mlx5_ib_uapi_flow_action_packet_reformat_type, size_t, void *)
    mlx5dv_dr_action_create_packet_reformat @ "MLX5_1.10" => null,
    // struct mlx5dv_dr_action *mlx5dv_dr_action_create_tag(uint32_t)
    mlx5dv_dr_action_create_tag @ "MLX5_1.10" => null,
    // int mlx5dv_dr_action_destroy(struct mlx5dv_dr_action *)
    mlx5dv_dr_action_destroy @ "MLX5_1.10" => unsupported,
    // struct mlx5dv_dr_domain *mlx5dv_dr_domain_create(struct ibv_context *, enum mlx5dv_dr_domain_type)
    mlx5dv_dr_domain_create @ "MLX5_1.10" => null,
    // int mlx5dv_dr_domain_destroy(struct mlx5dv_dr_domain *)
    mlx5dv_dr_domain_destroy @ "MLX5_1.10" => unsupported,
    // int mlx5dv_dr_domain_sync(struct mlx5dv_dr_domain *, uint32_t)
    mlx5dv_dr_domain_sync @ "MLX5_1.10" => unsupported,
    // struct mlx5dv_dr_matcher *mlx5dv_dr_matcher_create(struct mlx5dv_dr_table *, uint16_t, uint8_t,
    //     struct mlx5dv_flow_match_parameters *)
    mlx5dv_dr_matcher_create @ "MLX5_1.10" => null,
    // int mlx5dv_dr_matcher_destroy(struct mlx5dv_dr_matcher *)
    mlx5dv_dr_matcher_destroy @ "MLX5_1.10" => unsupported,
    // struct mlx5dv_dr_rule *mlx5dv_dr_rule_create(struct mlx5dv_dr_matcher *,
    //     struct mlx5dv_flow_match_parameters *, size_t, struct mlx5dv_dr_action **)
    mlx5dv_dr_rule_create @ "MLX5_1.10" => null,
    // int mlx5dv_dr_rule_destroy(struct mlx5dv_dr_rule *)
    mlx5dv_dr_rule_destroy @ "MLX5_1.10" => unsupported,
    // struct mlx5dv_dr_table *mlx5dv_dr_table_create(struct mlx5dv_dr_domain *, uint32_t)
    mlx5dv_dr_table_create @ "MLX5_1.10" => null,
    // int mlx5dv_dr_table_destroy(struct mlx5dv_dr_table *)
    mlx5dv_dr_table_destroy @ "MLX5_1.10" => unsupported,
    // struct mlx5dv_qp_ex *mlx5dv_qp_ex_from_ibv_qp_ex(struct ibv_qp_ex *)
    mlx5dv_qp_ex_from_ibv_qp_ex @ "MLX5_1.10" => null,
    // struct mlx5dv_devx_event_channel *mlx5dv_devx_create_event_channel(struct ibv_context *,
    //     enum mlx5_ib_uapi_devx_create_event_channel_flags)
    mlx5dv_devx_create_event_channel @ "MLX5_1.11" => null,
    // void mlx5dv_devx_destroy_event_channel(struct mlx5dv_devx_event_channel *)
    mlx5dv_devx_destroy_event_channel @ "MLX5_1.11" => nothing,
    // ssize_t mlx5dv_devx_get_event(struct mlx5dv_devx_event_channel *,
    //     struct mlx5_ib_uapi_devx_async_event_hdr *, size_t)
    mlx5dv_devx_get_event @ "MLX5_1.11" => minus_one_ssize,
    // int mlx5dv_devx_subscribe_devx_event(struct mlx5dv_devx_event_channel *, struct mlx5dv_devx_obj *,
    //     uint16_t, uint16_t *, uint64_t)
    mlx5dv_devx_subscribe_devx_event @ "MLX5_1.11" => unsupported,
    // int mlx5dv_devx_subscribe_devx_event_fd(struct mlx5dv_devx_event_channel *, int,
    //     struct mlx5dv_devx_obj *, uint16_t)
    mlx5dv_devx_subscribe_devx_event_fd @ "MLX5_1.11" => unsupported,
    // struct mlx5dv_var *mlx5dv_alloc_var(struct ibv_context *, uint32_t)
    mlx5dv_alloc_var @ "MLX5_1.12" => null,
    // struct mlx5dv_dr_action *mlx5dv_dr_action_create_flow_meter(struct mlx5dv_dr_flow_meter_attr *)
    mlx5dv_dr_action_create_flow_meter @ "MLX5_1.12" => null,
    // int mlx5dv_dr_action_modify_flow_meter(struct mlx5dv_dr_action *, struct mlx5dv_dr_flow_meter_attr *,
    //     __be64)
    mlx5dv_dr_action_modify_flow_meter @ "MLX5_1.12" => unsupported,
    // int mlx5dv_dump_dr_domain(FILE *, struct mlx5dv_dr_domain *)
    mlx5dv_dump_dr_domain @ "MLX5_1.12" => unsupported,
    // int mlx5dv_dump_dr_matcher(FILE *, struct mlx5dv_dr_matcher *)
    mlx5dv_dump_dr_matcher @ "MLX5_1.12" => unsupported,
    // int mlx5dv_dump_dr_rule(FILE *, struct mlx5dv_dr_rule *)
    mlx5dv_dump_dr_rule @ "MLX5_1.12" => unsupported,
    // int mlx5dv_dump_dr_table(FILE *, struct mlx5dv_dr_table *)
    mlx5dv_dump_dr_table @ "MLX5_1.12" => unsupported,
    // void mlx5dv_free_var(struct mlx5dv_var *)
    mlx5dv_free_var @ "MLX5_1.12" => nothing,
    // struct mlx5dv_pp *mlx5dv_pp_alloc(struct ibv_context *, size_t, const void *, uint32_t)
    mlx5dv_pp_alloc @ "MLX5_1.13" => null,
    // void mlx5dv_pp_free(struct mlx5dv_pp *)
    mlx5dv_pp_free @ "MLX5_1.13" => nothing,
    // struct mlx5dv_dr_action *mlx5dv_dr_action_create_default_miss(void)
    mlx5dv_dr_action_create_default_miss @ "MLX5_1.14" => null,
    // void mlx5dv_dr_domain_set_reclaim_device_memory(struct mlx5dv_dr_domain *, bool)
    mlx5dv_dr_domain_set_reclaim_device_memory @ "MLX5_1.14" => nothing,
    // int mlx5dv_modify_qp_lag_port(struct ibv_qp *, uint8_t)
    mlx5dv_modify_qp_lag_port @ "MLX5_1.14" => unsupported,
    // int mlx5dv_query_qp_lag_port(struct ibv_qp *, uint8_t *, uint8_t *)
    mlx5dv_query_qp_lag_port @ "MLX5_1.14" => unsupported,
    // struct mlx5dv_dr_action *mlx5dv_dr_action_create_dest_devx_tir(struct mlx5dv_devx_obj *)
    mlx5dv_dr_action_create_dest_devx_tir @ "MLX5_1.15" => null,
    // struct mlx5dv_dr_action *mlx5dv_dr_action_create_dest_array(struct mlx5dv_dr_domain *, size_t,
    //     struct mlx5dv_dr_action_dest_attr **)
    mlx5dv_dr_action_create_dest_array @ "MLX5_1.16" => null,
    // struct mlx5dv_dr_action *mlx5dv_dr_action_create_flow_sampler(struct mlx5dv_dr_flow_sampler_attr *)
    mlx5dv_dr_action_create_flow_sampler @ "MLX5_1.16" => null,
    // struct mlx5dv_dr_action *mlx5dv_dr_action_create_aso(struct mlx5dv_dr_domain *,
    //     struct mlx5dv_devx_obj *, uint32_t, uint32_t, uint8_t)
    mlx5dv_dr_action_create_aso @ "MLX5_1.17" => null,
    // struct mlx5dv_dr_action *mlx5dv_dr_action_create_pop_vlan(void)
    mlx5dv_dr_action_create_pop_vlan @ "MLX5_1.17" => null,
    // struct mlx5dv_dr_action *mlx5dv_dr_action_create_push_vlan(struct mlx5dv_dr_domain *, __be32)
    mlx5dv_dr_action_create_push_vlan @ "MLX5_1.17" => null,
    // int mlx5dv_dr_action_modify_aso(struct mlx5dv_dr_action *, uint32_t, uint32_t, uint8_t)
    mlx5dv_dr_action_modify_aso @ "MLX5_1.17" => unsupported,
    // int mlx5dv_modify_qp_sched_elem(struct ibv_qp *, const struct mlx5dv_sched_leaf *,
    //     const struct mlx5dv_sched_leaf *)
    mlx5dv_modify_qp_sched_elem @ "MLX5_1.17" => unsupported,
    // int mlx5dv_modify_qp_udp_sport(struct ibv_qp *, uint16_t)
    mlx5dv_modify_qp_udp_sport @ "MLX5_1.17" => unsupported,
    // struct mlx5dv_sched_leaf *mlx5dv_sched_leaf_create(struct ibv_context *,
    //     const struct mlx5dv_sched_attr *)
    mlx5dv_sched_leaf_create @ "MLX5_1.17" => null,
    // int mlx5dv_sched_leaf_destroy(struct mlx5dv_sched_leaf *)
    mlx5dv_sched_leaf_destroy @ "MLX5_1.17" => unsupported,
    // int mlx5dv_sched_leaf_modify(struct mlx5dv_sched_leaf *, const struct mlx5dv_sched_attr *)
    mlx5dv_sched_leaf_modify @ "MLX5_1.17" => unsupported,
    // struct mlx5dv_sched_node *mlx5dv_sched_node_create(struct ibv_context *,
    //     const struct mlx5dv_sched_attr *)
    mlx5dv_sched_node_create @ "MLX5_1.17" => null,
    // int mlx5dv_sched_node_destroy(struct mlx5dv_sched_node *)
    mlx5dv_sched_node_destroy @ "MLX5_1.17" => unsupported,
    // int mlx5dv_sched_node_modify(struct mlx5dv_sched_node *, const struct mlx5dv_sched_attr *)
    mlx5dv_sched_node_modify @ "MLX5_1.17" => unsupported,
    // int mlx5dv_reserved_qpn_alloc(struct ibv_context *, uint32_t *)
    mlx5dv_reserved_qpn_alloc @ "MLX5_1.18" => unsupported,
    // int mlx5dv_reserved_qpn_dealloc(struct ibv_context *, uint32_t)
    mlx5dv_reserved_qpn_dealloc @ "MLX5_1.18" => unsupported,
    // int _mlx5dv_query_port(struct ibv_context *, uint32_t, struct mlx5_ib_uapi_query_port *, size_t)
    _mlx5dv_query_port @ "MLX5_1.19" => unsupported,
    // struct mlx5dv_devx_umem *mlx5dv_devx_umem_reg_ex(struct ibv_context *, struct mlx5dv_devx_umem_in *)
    mlx5dv_devx_umem_reg_ex @ "MLX5_1.19" => null,
    // void *mlx5dv_dm_map_op_addr(struct ibv_dm *, uint8_t)
    mlx5dv_dm_map_op_addr @ "MLX5_1.19" => null,
    // int _mlx5dv_mkey_check(struct mlx5dv_mkey *, struct mlx5dv_mkey_err *, size_t)
    _mlx5dv_mkey_check @ "MLX5_1.20" => unsupported,
    // void mlx5dv_dr_domain_allow_duplicate_rules(struct mlx5dv_dr_domain *, bool)
    mlx5dv_dr_domain_allow_duplicate_rules @ "MLX5_1.20" => nothing,
    // int mlx5dv_map_ah_to_qp(struct ibv_ah *, uint32_t)
    mlx5dv_map_ah_to_qp @ "MLX5_1.20" => unsupported,
    // int mlx5dv_qp_cancel_posted_send_wrs(struct mlx5dv_qp_ex *, uint64_t)
    mlx5dv_qp_cancel_posted_send_wrs @ "MLX5_1.20" => negative_unsupported,
    // int mlx5dv_crypto_login(struct ibv_context *, struct mlx5dv_crypto_login_attr *)
    mlx5dv_crypto_login @ "MLX5_1.21" => unsupported,
    // int mlx5dv_crypto_login_query_state(struct ibv_context *, enum mlx5dv_crypto_login_state *)
    mlx5dv_crypto_login_query_state @ "MLX5_1.21" => unsupported,
    // int mlx5dv_crypto_logout(struct ibv_context *)
    mlx5dv_crypto_logout @ "MLX5_1.21" => unsupported,
    // int mlx5dv_dci_stream_id_reset(struct ibv_qp *, uint16_t)
    mlx5dv_dci_stream_id_reset @ "MLX5_1.21" => unsupported,
    // struct mlx5dv_dek *mlx5dv_dek_create(struct ibv_context *, struct mlx5dv_dek_init_attr *)
    mlx5dv_dek_create @ "MLX5_1.21" => null,
    // int mlx5dv_dek_destroy(struct mlx5dv_dek *)
    mlx5dv_dek_destroy @ "MLX5_1.21" => unsupported,
    // int mlx5dv_dek_query(struct mlx5dv_dek *, struct mlx5dv_dek_attr *)
    mlx5dv_dek_query @ "MLX5_1.21" => unsupported,
    // struct mlx5dv_dr_action *mlx5dv_dr_action_create_dest_ib_port(struct mlx5dv_dr_domain *, uint32_t)
    mlx5dv_dr_action_create_dest_ib_port @ "MLX5_1.21" => null,
    // int mlx5dv_dr_matcher_set_layout(struct mlx5dv_dr_matcher *, struct mlx5dv_dr_matcher_layout *)
    mlx5dv_dr_matcher_set_layout @ "MLX5_1.21" => unsupported,
    // struct ibv_device **mlx5dv_get_vfio_device_list(struct mlx5dv_vfio_context_attr *)
    mlx5dv_get_vfio_device_list @ "MLX5_1.21" => null,
    // int mlx5dv_vfio_get_events_fd(struct ibv_context *)
    mlx5dv_vfio_get_events_fd @ "MLX5_1.21" => minus_one,
    // int mlx5dv_vfio_process_events(struct ibv_context *)
    mlx5dv_vfio_process_events @ "MLX5_1.21" => unsupported,
    // int mlx5dv_dr_aso_other_domain_link(struct mlx5dv_devx_obj *, struct mlx5dv_dr_domain *,
    //     struct mlx5dv_dr_domain *, uint32_t, uint8_t)
    mlx5dv_dr_aso_other_domain_link @ "MLX5_1.22" => unsupported,
    // int mlx5dv_dr_aso_other_domain_unlink(struct mlx5dv_devx_obj *, struct mlx5dv_dr_domain *)
    mlx5dv_dr_aso_other_domain_unlink @ "MLX5_1.22" => unsupported,
    // struct mlx5dv_devx_msi_vector *mlx5dv_devx_alloc_msi_vector(struct ibv_context *)
    mlx5dv_devx_alloc_msi_vector @ "MLX5_1.23" => null,
    // struct mlx5dv_devx_eq *mlx5dv_devx_create_eq(struct ibv_context *, const void *, size_t, void *,
    //     size_t)
    mlx5dv_devx_create_eq @ "MLX5_1.23" => null,
    // int mlx5dv_devx_destroy_eq(struct mlx5dv_devx_eq *)
    mlx5dv_devx_destroy_eq @ "MLX5_1.23" => unsupported,
    // int mlx5dv_devx_free_msi_vector(struct mlx5dv_devx_msi_vector *)
    mlx5dv_devx_free_msi_vector @ "MLX5_1.23" => unsupported,
    // struct mlx5dv_steering_anchor *mlx5dv_create_steering_anchor(struct ibv_context *,
    //     struct mlx5dv_steering_anchor_attr *)
    mlx5dv_create_steering_anchor @ "MLX5_1.24" => null,
    // struct mlx5dv_crypto_login_obj *mlx5dv_crypto_login_create(struct ibv_context *,
    //     struct mlx5dv_crypto_login_attr_ex *)
    mlx5dv_crypto_login_create @ "MLX5_1.24" => null,
    // int mlx5dv_crypto_login_destroy(struct mlx5dv_crypto_login_obj *)
    mlx5dv_crypto_login_destroy @ "MLX5_1.24" => unsupported,
    // int mlx5dv_crypto_login_query(struct mlx5dv_crypto_login_obj *,
    //     struct mlx5dv_crypto_login_query_attr *)
    mlx5dv_crypto_login_query @ "MLX5_1.24" => unsupported,
    // int mlx5dv_destroy_steering_anchor(struct mlx5dv_steering_anchor *)
    mlx5dv_destroy_steering_anchor @ "MLX5_1.24" => unsupported,
    // struct mlx5dv_dr_action *mlx5dv_dr_action_create_dest_root_table(struct mlx5dv_dr_table *, uint16_t)
    mlx5dv_dr_action_create_dest_root_table @ "MLX5_1.24" => null,

    // libmlx4.so.1 (mlx4dv.h)
    // struct ibv_qp *mlx4dv_create_qp(struct ibv_context *, struct ibv_qp_init_attr_ex *,
    //     struct mlx4dv_qp_init_attr *)
    mlx4dv_create_qp @ "MLX4_1.0" => null,
    // int mlx4dv_init_obj(struct mlx4dv_obj *, uint64_t)
    mlx4dv_init_obj @ "MLX4_1.0" => unsupported,
    // int mlx4dv_query_device(struct ibv_context *, struct mlx4dv_context *)
    mlx4dv_query_device @ "MLX4_1.0" => unsupported,
    // int mlx4dv_set_context_attr(struct ibv_context *, enum mlx4dv_set_ctx_attr_type, void *)
    mlx4dv_set_context_attr @ "MLX4_1.0" => unsupported,

    // libefa.so.1 (efadv.h)
    // struct ibv_qp *efadv_create_driver_qp(struct ibv_pd *, struct ibv_qp_init_attr *, uint32_t)
    efadv_create_driver_qp @ "EFA_1.0" => null,
    // struct ibv_qp *efadv_create_qp_ex(struct ibv_context *, struct ibv_qp_init_attr_ex *,
    //     struct efadv_qp_init_attr *, uint32_t)
    efadv_create_qp_ex @ "EFA_1.1" => null,
    // int efadv_query_ah(struct ibv_ah *, struct efadv_ah_attr *, uint32_t)
    efadv_query_ah @ "EFA_1.1" => unsupported,
    // int efadv_query_device(struct ibv_context *, struct efadv_device_attr *, uint32_t)
    efadv_query_device @ "EFA_1.1" => unsupported,
    // struct efadv_cq *efadv_cq_from_ibv_cq_ex(struct ibv_cq_ex *)
    efadv_cq_from_ibv_cq_ex @ "EFA_1.2" => null,
    // struct ibv_cq_ex *efadv_create_cq(struct ibv_context *, struct ibv_cq_init_attr_ex *,
    //     struct efadv_cq_init_attr *, uint32_t)
    efadv_create_cq @ "EFA_1.2" => null,

    // libmana.so.1 (manadv.h)
    // int manadv_init_obj(struct manadv_obj *, uint64_t)
    manadv_init_obj @ "MANA_1.0" => unsupported,
    // int manadv_set_context_attr(struct ibv_context *, enum manadv_set_ctx_attr_type, void *)
    manadv_set_context_attr @ "MANA_1.0" => unsupported,
}

/// The answers of the stand-ins: "not supported", in each of the return
/// conventions of rdma-core's direct-verbs functions.
pub mod answers {
    use std::ffi::{c_int, c_void};

    fn set_errno(e: c_int) {
        // SAFETY: __errno_location returns this thread's errno, valid for
        // the thread's life.
        unsafe { *libc::__errno_location() = e };
    }

    /// `NULL` with `errno = EOPNOTSUPP`: rdma-core's constructors for a
    /// device of another vendor.
    pub extern "C" fn null() -> *mut c_void {
        set_errno(libc::EOPNOTSUPP);
        std::ptr::null_mut()
    }

    /// `EOPNOTSUPP`, returned and stored in `errno`: rdma-core's `int`
    /// functions ("0 on success or the value of errno on failure").
    pub extern "C" fn unsupported() -> c_int {
        set_errno(libc::EOPNOTSUPP);
        libc::EOPNOTSUPP
    }

    /// `-EOPNOTSUPP`, and `errno = EOPNOTSUPP`: a count or `-errno`.
    pub extern "C" fn negative_unsupported() -> c_int {
        set_errno(libc::EOPNOTSUPP);
        -libc::EOPNOTSUPP
    }

    /// -1 with `errno = EOPNOTSUPP`: an `int` that is a file descriptor.
    pub extern "C" fn minus_one() -> c_int {
        set_errno(libc::EOPNOTSUPP);
        -1
    }

    /// -1 with `errno = EOPNOTSUPP`: a `ssize_t` byte count.
    pub extern "C" fn minus_one_ssize() -> isize {
        set_errno(libc::EOPNOTSUPP);
        -1
    }

    /// `false`: no vRDMA device is the vendor's (`*_is_supported`).
    pub extern "C" fn no() -> bool {
        false
    }

    /// Nothing, for `void` functions: their objects never exist here.
    pub extern "C" fn nothing() {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errno() -> Option<i32> {
        std::io::Error::last_os_error().raw_os_error()
    }

    #[test]
    fn every_answer_refuses() {
        let clear = || {
            // SAFETY: as in `answers::set_errno`.
            unsafe { *libc::__errno_location() = 0 };
        };
        clear();
        assert!(answers::null().is_null());
        assert_eq!(errno(), Some(libc::EOPNOTSUPP));
        clear();
        assert_eq!(answers::unsupported(), libc::EOPNOTSUPP);
        assert_eq!(errno(), Some(libc::EOPNOTSUPP));
        clear();
        assert_eq!(answers::negative_unsupported(), -libc::EOPNOTSUPP);
        assert_eq!(errno(), Some(libc::EOPNOTSUPP));
        clear();
        assert_eq!(answers::minus_one(), -1);
        assert_eq!(errno(), Some(libc::EOPNOTSUPP));
        clear();
        assert_eq!(answers::minus_one_ssize(), -1);
        assert_eq!(errno(), Some(libc::EOPNOTSUPP));
        clear();
        assert!(!answers::no());
        answers::nothing();
        assert_eq!(errno(), Some(0));
    }

    #[test]
    fn exports_are_unique_and_versioned() {
        let mut symbols: Vec<_> = EXPORTS.iter().map(|e| (e.name, e.node)).collect();
        symbols.sort_unstable();
        symbols.dedup();
        assert_eq!(symbols.len(), EXPORTS.len());
        let mut defaults: Vec<_> = EXPORTS.iter().filter(|e| e.default).map(|e| e.name).collect();
        defaults.sort_unstable();
        defaults.dedup();
        assert_eq!(defaults.len(), EXPORTS.iter().filter(|e| e.default).count(), "one default each");
        for e in EXPORTS {
            let prefix = [
                ("mlx5dv_", "MLX5_1."),
                ("mlx4dv_", "MLX4_1."),
                ("efadv_", "EFA_1."),
                ("manadv_", "MANA_1."),
            ]
            .iter()
            .any(|(f, n)| e.name.trim_start_matches('_').starts_with(f) && e.node.starts_with(n));
            assert!(prefix, "{}@{}", e.name, e.node);
            assert!(e.default || EXPORTS.iter().any(|d| d.default && d.name == e.name), "{}", e.name);
        }
        let count = |n: &str| EXPORTS.iter().filter(|e| e.node.starts_with(n)).count();
        assert_eq!([count("MLX5_"), count("MLX4_"), count("EFA_"), count("MANA_")], [129, 4, 6, 2]);
    }

    #[test]
    fn answers_follow_the_names() {
        for e in EXPORTS {
            let known = [
                "null",
                "unsupported",
                "negative_unsupported",
                "minus_one",
                "minus_one_ssize",
                "no",
                "nothing",
            ];
            assert!(known.contains(&e.answer), "{}: {}", e.name, e.answer);
            if e.name.ends_with("_is_supported") {
                assert_eq!(e.answer, "no", "{}", e.name);
            }
            let object = e.name.contains("_create") || e.name.contains("_alloc_") || e.name.contains("_reg");
            if object && !e.name.contains("_dereg") {
                // Constructors return objects, and ones that cannot exist.
                assert!(matches!(e.answer, "null"), "{}: {}", e.name, e.answer);
            }
        }
    }
}
