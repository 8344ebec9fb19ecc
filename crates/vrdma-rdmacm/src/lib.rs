//! `vrdma-rdmacm`: a drop-in `librdmacm.so.1` for vRDMA.
//!
//! rdma-core's librdmacm talks to the kernel's connection manager
//! (`/dev/infiniband/rdma_cm`), which a host without RDMA hardware does
//! not have: Debian's library fails in `rdma_create_event_channel`
//! ("No such file or directory"). This library keeps rdma-core 44's C
//! interface and puts the vRDMA daemon's connection manager behind it
//! ([`vrdma::cm`]), so unmodified programs such as `rping` and
//! `ucmatose` (Debian's `rdmacm-utils`) connect QPs by IP address and
//! port on vRDMA.
//!
//! # Using it
//!
//! `vrdma run -- PROGRAM ARGS...` links `librdmacm.so.1` to this library
//! in its private library directory, beside the drop-in
//! `libibverbs.so.1`. By hand, as for `vrdma-verbs`:
//!
//! ```text
//! cargo build --release -p vrdma-verbs -p vrdma-rdmacm
//! mkdir -p /tmp/vrdma-lib
//! ln -sf "$PWD/target/release/libvrdma_verbs.so" /tmp/vrdma-lib/libibverbs.so.1
//! ln -sf "$PWD/target/release/libvrdma_rdmacm.so" /tmp/vrdma-lib/librdmacm.so.1
//! export LD_LIBRARY_PATH=/tmp/vrdma-lib VRDMA_SOCKET=/tmp/vrdma.sock
//! rping -s -a 127.0.0.1 -v -C 10 &  rping -c -a 127.0.0.1 -v -C 10
//! ```
//!
//! `VRDMA_RDMACM_DEBUG=1` prints one line on stderr for every call that
//! fails, with the reason.
//!
//! # How it fits
//!
//! - **The device** is the program's libibverbs: `id->verbs` is the
//!   `ibv_context` that library's `ibv_open_device` returned for its first
//!   device, opened once per connection to the daemon (module `verbs`;
//!   after a daemon restart, new ids get the new daemon's), so the program's
//!   `ibv_alloc_pd(id->verbs)` and `ibv_create_cq(id->verbs, ...)` work
//!   as with rdma-core.
//! - **The connection manager** is the daemon's, reached through a
//!   `vrdma::Context` of this library's own: the same tenant as the
//!   program's libibverbs, so the daemon takes that library's QP numbers
//!   in a connect or an accept.
//! - **QPs** are made through the program's libibverbs, as rdma-core
//!   makes them; a connected one is then attached to its id in the
//!   daemon, which moves it from there as the kernel's CM would (a UD QP
//!   is moved by this library; module `cma`).
//!
//! # The ABI
//!
//! The soname is `librdmacm.so.1`; every symbol of rdma-core 44's
//! `librdmacm.map` is exported at its version (`RDMACM_1.0` ...
//! `RDMACM_1.3`; see [`EXPORTS`]), because programs linked with
//! `BIND_NOW` (all of Debian's) need every import to resolve when they
//! load. The structures are rdma-core's, checked at compile time and
//! against the C headers by a unit test (module `abi`). As in rdma-core,
//! calls fail with -1 and `errno` (`rdma_getaddrinfo` with the
//! resolver's `EAI_*` code).
//!
//! As in rdma-core, an id created without a channel gets one of its own
//! and is *synchronous*: `rdma_resolve_addr`, `rdma_resolve_route`,
//! `rdma_connect`, `rdma_accept` and `rdma_disconnect` on it return once
//! their event came (kept in `id->event`), failing as it failed.
//! `rdma_migrate_id` to a program's channel makes such an id
//! asynchronous, and to NULL synchronous (libfabric's verbs provider
//! resolves an endpoint's address synchronously and goes on on its event
//! queue's channel). The
//! endpoint helpers build on that: `rdma_create_ep` (a passive endpoint
//! bound to `ai_src_addr`, or an active one with its address and route
//! resolved and, given attributes, its QP), `rdma_get_request` (the next
//! connect request's id, synchronous, with a QP made from the passive
//! endpoint's attributes) and `rdma_destroy_ep`. `rdma_create_qp` given
//! no CQs makes them (each with a completion channel, the id as their
//! context, as `rdma_verbs.h`'s `rdma_get_send_comp` expects), and
//! `rdma_destroy_qp` destroys them. `ai_connect` private data is not
//! kept by `rdma_create_ep` (`rdma_getaddrinfo` gives none).
//!
//! The rsocket API (`rsocket`, `rconnect`, `rpoll`, ... all the `r*`
//! functions) runs on vRDMA's sockets carrier (`docs/sockets.md`,
//! "rsocket"; module `rsocket`): an rsocket is a kernel socket whose
//! stream connections the carrier negotiates through the daemons and
//! carries over vRDMA, or leaves TCP; datagram rsockets are kernel UDP.
//! Direct placement (`riomap`, `riounmap`, `riowrite`) works on carried
//! connections (`riostream` runs).
//!
//! Not implemented yet, failing with `ENOSYS` and one line on stderr
//! naming the function the first time it is called: multicast
//! (`rdma_join_multicast*`, `rdma_leave_multicast`, and already
//! `rdma_resolve_addr` to a multicast group, which is where `mckey`
//! stops), `rdma_notify`, `rdma_create_srq*` / `rdma_destroy_srq`, the
//! ECE pair (`rdma_set_local_ece`, `rdma_get_remote_ece`;
//! `rdma_reject_ece` rejects).
//!
//! # Differences from rdma-core that programs can observe
//!
//! - Addresses are IPv4 (an IPv6 socket address is taken only as the
//!   wildcard `::` or an IPv4-mapped address); `route.path_rec` is NULL.
//! - Timeouts given to `rdma_resolve_addr` / `rdma_resolve_route` are not
//!   used: both resolve at once on one host.
//! - `rdma_destroy_id` does not wait for the id's unacknowledged events.
//! - `rdma_bind_addr` to a loopback address other than the daemon's own
//!   succeeds (the kernel has no device behind `lo`), with `id->verbs`
//!   NULL as after a wildcard bind: libfabric then publishes the device's
//!   interface address instead of loopback.

// As vrdma-verbs: x86-64 Linux only; elsewhere the crate is empty.
#![cfg(all(target_os = "linux", target_arch = "x86_64"))]
// The exported functions are reached from assembly (see `exports!`),
// which the unit-test build leaves out.
#![cfg_attr(test, allow(dead_code))]
// The functions' safety contracts are rdma-core's (its man pages and
// rdma_cma.h); each unsafe block says what it relies on.
#![allow(clippy::missing_safety_doc)]

mod abi;
mod addrinfo;
mod cma;
mod rsocket;
mod stubs;
mod verbs;

use std::ffi::c_int;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Why a call failed: the `errno` it sets and the reason
/// `VRDMA_RDMACM_DEBUG` prints.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The process cannot use vRDMA at all (no daemon, no drop-in
    /// libibverbs): `ENODEV`.
    #[error("{0}")]
    Setup(String),
    #[error("{why}")]
    Errno { errno: i32, why: String },
    /// An expected outcome, not worth a debug line (EAGAIN).
    #[error("errno {0}")]
    Quiet(i32),
}

impl Error {
    pub fn errno(&self) -> i32 {
        match self {
            Error::Setup(_) => libc::ENODEV,
            Error::Errno { errno, .. } | Error::Quiet(errno) => *errno,
        }
    }

    fn errno_of(errno: i32, why: impl Into<String>) -> Error {
        Error::Errno { errno, why: why.into() }
    }

    pub(crate) fn sys(errno: i32, why: &str) -> Error {
        Error::errno_of(errno, why)
    }

    pub(crate) fn quiet(errno: i32) -> Error {
        Error::Quiet(errno)
    }

    /// The `errno` a libibverbs call just left, with `why`.
    pub(crate) fn last(why: &str) -> Error {
        let e = std::io::Error::last_os_error();
        Error::errno_of(e.raw_os_error().unwrap_or(libc::EIO), format!("{why}: {e}"))
    }
}

impl From<vrdma::Error> for Error {
    fn from(e: vrdma::Error) -> Error {
        Error::errno_of(e.errno(), e.to_string())
    }
}

pub(crate) type Res<T> = Result<T, Error>;

fn debug() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("VRDMA_RDMACM_DEBUG").is_some_and(|v| v != "0"))
}

/// Runs an exported function's body: an error sets `errno` and returns
/// `failed`, and a panic never crosses into C (it fails with `EIO`).
pub(crate) fn guard<T>(what: &str, failed: T, body: impl FnOnce() -> Res<T>) -> T {
    let r = catch_unwind(AssertUnwindSafe(body))
        .unwrap_or_else(|_| Err(Error::errno_of(libc::EIO, "internal error (panic)")));
    match r {
        Ok(v) => v,
        Err(e) => {
            if debug() && !matches!(e, Error::Quiet(_)) {
                eprintln!("vrdma librdmacm: {what}: {e} (errno {})", e.errno());
            }
            // SAFETY: errno is this thread's.
            unsafe { *libc::__errno_location() = e.errno() as c_int };
            failed
        }
    }
}

/// Exports each function under its C name bound to its version node, and
/// lists them in [`EXPORTS`]; the same trampolines as vrdma-verbs'
/// `exports!` (see there for why: a `.symver` directive must sit in the
/// object file that defines the symbol, and rustc picks the codegen units
/// of Rust functions).
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
    cma::rdma_create_event_channel @ "RDMACM_1.0",
    cma::rdma_destroy_event_channel @ "RDMACM_1.0",
    cma::rdma_create_id @ "RDMACM_1.0",
    cma::rdma_destroy_id @ "RDMACM_1.0",
    cma::rdma_bind_addr @ "RDMACM_1.0",
    cma::rdma_resolve_addr @ "RDMACM_1.0",
    cma::rdma_resolve_route @ "RDMACM_1.0",
    cma::rdma_create_qp @ "RDMACM_1.0",
    cma::rdma_destroy_qp @ "RDMACM_1.0",
    cma::rdma_connect @ "RDMACM_1.0",
    cma::rdma_listen @ "RDMACM_1.0",
    cma::rdma_accept @ "RDMACM_1.0",
    cma::rdma_reject @ "RDMACM_1.0",
    stubs::rdma_notify @ "RDMACM_1.0",
    cma::rdma_disconnect @ "RDMACM_1.0",
    cma::rdma_get_cm_event @ "RDMACM_1.0",
    cma::rdma_ack_cm_event @ "RDMACM_1.0",
    cma::rdma_get_src_port @ "RDMACM_1.0",
    cma::rdma_get_dst_port @ "RDMACM_1.0",
    stubs::rdma_join_multicast @ "RDMACM_1.0",
    stubs::rdma_leave_multicast @ "RDMACM_1.0",
    cma::rdma_get_devices @ "RDMACM_1.0",
    cma::rdma_free_devices @ "RDMACM_1.0",
    cma::rdma_event_str @ "RDMACM_1.0",
    cma::rdma_set_option @ "RDMACM_1.0",
    cma::rdma_migrate_id @ "RDMACM_1.0",
    addrinfo::rdma_getaddrinfo @ "RDMACM_1.0",
    addrinfo::rdma_freeaddrinfo @ "RDMACM_1.0",
    cma::rdma_get_request @ "RDMACM_1.0",
    cma::rdma_create_ep @ "RDMACM_1.0",
    cma::rdma_destroy_ep @ "RDMACM_1.0",
    stubs::rdma_create_srq @ "RDMACM_1.0",
    stubs::rdma_destroy_srq @ "RDMACM_1.0",
    stubs::rdma_create_srq_ex @ "RDMACM_1.0",
    cma::rdma_create_qp_ex @ "RDMACM_1.0",
    rsocket::rsocket @ "RDMACM_1.0",
    rsocket::rbind @ "RDMACM_1.0",
    rsocket::rlisten @ "RDMACM_1.0",
    rsocket::raccept @ "RDMACM_1.0",
    rsocket::rconnect @ "RDMACM_1.0",
    rsocket::rshutdown @ "RDMACM_1.0",
    rsocket::rclose @ "RDMACM_1.0",
    rsocket::rrecv @ "RDMACM_1.0",
    rsocket::rrecvfrom @ "RDMACM_1.0",
    rsocket::rrecvmsg @ "RDMACM_1.0",
    rsocket::rsend @ "RDMACM_1.0",
    rsocket::rsendto @ "RDMACM_1.0",
    rsocket::rsendmsg @ "RDMACM_1.0",
    rsocket::rread @ "RDMACM_1.0",
    rsocket::rreadv @ "RDMACM_1.0",
    rsocket::rwrite @ "RDMACM_1.0",
    rsocket::rwritev @ "RDMACM_1.0",
    rsocket::rpoll @ "RDMACM_1.0",
    rsocket::rselect @ "RDMACM_1.0",
    rsocket::rgetpeername @ "RDMACM_1.0",
    rsocket::rgetsockname @ "RDMACM_1.0",
    rsocket::rsetsockopt @ "RDMACM_1.0",
    rsocket::rgetsockopt @ "RDMACM_1.0",
    rsocket::rfcntl @ "RDMACM_1.0",
    rsocket::riomap @ "RDMACM_1.0",
    rsocket::riounmap @ "RDMACM_1.0",
    rsocket::riowrite @ "RDMACM_1.0",
    stubs::rdma_join_multicast_ex @ "RDMACM_1.1",
    cma::rdma_establish @ "RDMACM_1.2",
    cma::rdma_init_qp_attr @ "RDMACM_1.2",
    stubs::rdma_get_remote_ece @ "RDMACM_1.3",
    cma::rdma_reject_ece @ "RDMACM_1.3",
    stubs::rdma_set_local_ece @ "RDMACM_1.3",
}

#[cfg(test)]
mod tests {
    /// The exports are rdma-core 44's librdmacm.map, symbol for symbol
    /// and version for version (68 functions).
    #[test]
    fn exports_are_rdma_core_44s_map() {
        let mut seen = std::collections::HashSet::new();
        for (name, node) in super::EXPORTS {
            assert!(seen.insert(*name), "{name} exported twice");
            assert!(["RDMACM_1.0", "RDMACM_1.1", "RDMACM_1.2", "RDMACM_1.3"].contains(node), "{name}@{node}");
        }
        assert_eq!(super::EXPORTS.len(), 68);
    }
}
