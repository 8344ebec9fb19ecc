//! `vrdma`: the application library of vRDMA, a user-space paravirtual
//! RDMA device.
//!
//! The device is a daemon, `vrdmad`, acting as a software HCA. This crate
//! talks to it over a Unix `SOCK_SEQPACKET` control socket for the control
//! path (contexts, PDs, memory registration, queue creation, QP state
//! changes) and over shared-memory rings for the data path: posting a work
//! request and polling a completion are plain memory operations, with a
//! doorbell system call only when the daemon's engine sleeps.
//!
//! The API follows the verbs of `libibverbs`, with Rust ownership:
//! objects keep their parents alive (a QP holds its CQs, PD and context),
//! and dropping an object destroys it in the daemon. Because the daemon
//! checks every key, bound and permission of every work request, posting
//! is a safe function: a bad request fails with an error or a failed work
//! completion, never with memory corruption.
//!
//! # Example
//!
//! A QP connected to itself (loopback) writes one buffer into another:
//!
//! ```no_run
//! use vrdma::wr::{self, SendWrExt};
//! use vrdma::{AccessFlags, Context, QpCap, WcOpcode, WcStatus};
//!
//! fn main() -> vrdma::Result<()> {
//!     let ctx = Context::open()?;
//!     let pd = ctx.alloc_pd()?;
//!     let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
//!     let src = pd.alloc_mr(4096, access)?;
//!     let dst = pd.alloc_mr(4096, access)?;
//!     src.write(0, b"hello, vRDMA")?;
//!
//!     let cq = ctx.create_cq(16, None)?;
//!     let cap = QpCap {
//!         max_send_wr: 16,
//!         max_recv_wr: 16,
//!         max_send_sge: 1,
//!         max_recv_sge: 1,
//!         max_inline_data: 64,
//!     };
//!     let qp = pd.create_rc_qp(&cq, &cq, cap)?;
//!
//!     // Normally the endpoints are exchanged with the peer out of band;
//!     // a QP may also connect to its own.
//!     let me = qp.endpoint(&ctx)?;
//!     qp.connect(&me, access)?;
//!
//!     let write = wr::rdma_write(1, &[src.sge(0, 12)?], dst.addr(), dst.rkey())?.signaled();
//!     qp.post_send(&[write])?;
//!
//!     let wc = loop {
//!         if let Some(wc) = cq.poll_one()? {
//!             break wc;
//!         }
//!     };
//!     assert_eq!((wc.wr_id, wc.status, wc.opcode), (1, WcStatus::Success, WcOpcode::RdmaWrite));
//!
//!     let mut got = [0u8; 12];
//!     dst.read(0, &mut got)?;
//!     assert_eq!(&got, b"hello, vRDMA");
//!     Ok(())
//! }
//! ```
//!
//! # Waiting instead of spinning
//!
//! [`CompletionQueue::poll`] never blocks (and yields the CPU after a
//! short spin). To sleep until completions arrive, create the CQ with a
//! [`CompletionChannel`] and either arm it and wait on the channel
//! ([`CompletionQueue::req_notify`], [`CompletionChannel::get_cq_event`],
//! or [`CompletionQueue::wait`]), or use [`CompletionQueue::stream`] in
//! a tokio runtime.
//!
//! # Memory
//!
//! [`ProtectionDomain::alloc_mr`] allocates shareable memory that the
//! region owns. [`ProtectionDomain::register_raw`] registers memory the
//! application already has by re-backing its pages with a shareable memfd
//! (see its documentation for the caveats).

#![warn(missing_debug_implementations)]

mod ah;
mod channel;
mod channel_core;
pub mod cm;
mod cm_fd;
mod cm_reply;
mod context;
mod control;
mod cq;
mod direct;
mod direct_ready;
mod direct_recv;
mod error;
#[doc(hidden)]
pub mod ffi;
pub mod guest;
pub mod idle;
pub mod migrate;
mod mr;
mod pd;
mod qp;
mod rebacking;
pub mod sockets;
mod srq;
mod stream;
pub mod vm;
pub mod wr;

use std::ffi::OsString;
use std::path::PathBuf;

/// This build of the library, as a marker that stays in every binary
/// that links it (a context's opening refers to it): `VRDMA-BUILD-ID:`
/// and a hash of the sources of this crate, `vrdma-core` and `vrdma-shm`
/// (`build.rs`). `vrdma bench` looks for it in the drop-in library's file
/// to tell a stale one ([`build_id`]).
pub const BUILD_ID: &str = concat!("VRDMA-BUILD-ID:", env!("VRDMA_BUILD_ID"));

/// The hash part of [`BUILD_ID`] (16 hex digits).
pub fn build_id() -> &'static str {
    env!("VRDMA_BUILD_ID")
}

pub use ah::AddressHandle;
pub use channel::{event_spin, CompletionChannel};
pub use context::Context;
pub use cq::{spin_polls, wc_array, wc_buffer, CompletionQueue, WorkCompletion};
pub use direct::{DIRECT_MAX_BYTES, DIRECT_MAX_RDMA_BYTES};
pub use error::{Error, PostError, Result};
pub use mr::MemoryRegion;
pub use pd::ProtectionDomain;
pub use qp::{defaults, Endpoint, QpInit, QueuePair};
pub use srq::SharedReceiveQueue;
pub use stream::CompletionStream;
/// The work-request builders of [`wr`] under the name `WorkRequest`, so
/// that `WorkRequest::rdma_write(..)` reads like a constructor.
pub use wr as WorkRequest;
pub use wr::SendWrExt;

pub use vrdma_core::hca::{AsyncEvent, GRH_LEN};
pub use vrdma_core::ring::{Cqe, RecvWr, SendWr, Sge, SgeList, UdDest, MAX_INLINE, MAX_SGE};
pub use vrdma_core::verbs::*;

/// Environment variable naming the daemon's socket.
pub const SOCKET_ENV: &str = "VRDMA_SOCKET";
/// Socket path used when neither `VRDMA_SOCKET` nor `XDG_RUNTIME_DIR` is set.
pub const SYSTEM_SOCKET_PATH: &str = "/run/vrdma/vrdma.sock";

/// Where the daemon listens, as [`Context::open`] looks for it:
/// `$VRDMA_SOCKET` if set, else `$XDG_RUNTIME_DIR/vrdma/vrdma.sock` if
/// `XDG_RUNTIME_DIR` is set, else `/run/vrdma/vrdma.sock` (the daemon's
/// own rule, so both agree without configuration).
pub fn default_socket_path() -> PathBuf {
    socket_path_from(std::env::var_os(SOCKET_ENV), std::env::var_os("XDG_RUNTIME_DIR"))
}

fn socket_path_from(socket: Option<OsString>, runtime_dir: Option<OsString>) -> PathBuf {
    if let Some(p) = socket {
        return PathBuf::from(p);
    }
    if let Some(dir) = runtime_dir {
        return PathBuf::from(dir).join("vrdma").join("vrdma.sock");
    }
    PathBuf::from(SYSTEM_SOCKET_PATH)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_path_selection() {
        let os = |s: &str| Some(OsString::from(s));
        assert_eq!(socket_path_from(os("/tmp/x.sock"), os("/run/user/1000")), PathBuf::from("/tmp/x.sock"));
        assert_eq!(
            socket_path_from(None, os("/run/user/1000")),
            PathBuf::from("/run/user/1000/vrdma/vrdma.sock")
        );
        assert_eq!(socket_path_from(None, None), PathBuf::from("/run/vrdma/vrdma.sock"));
        assert_eq!(socket_path_from(os("/s"), None), PathBuf::from("/s"));
    }

    #[test]
    fn default_path_reads_the_environment() {
        // Only reads: the process environment is shared by parallel tests.
        let p = default_socket_path();
        match std::env::var_os(SOCKET_ENV) {
            Some(s) => assert_eq!(p, PathBuf::from(s)),
            None => assert!(p.ends_with("vrdma/vrdma.sock")),
        }
    }

    #[test]
    fn work_request_alias() {
        let s = Sge { addr: 1, length: 2, lkey: 3 };
        let w = WorkRequest::rdma_write(7, &[s], 0x10, 9).unwrap().signaled();
        assert_eq!(w.opcode, SendOpcode::RdmaWrite);
        assert!(w.flags.contains(SendFlags::SIGNALED));
    }

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn handles_are_send_and_sync() {
        assert_send_sync::<Context>();
        assert_send_sync::<ProtectionDomain>();
        assert_send_sync::<MemoryRegion>();
        assert_send_sync::<CompletionChannel>();
        assert_send_sync::<CompletionQueue>();
        assert_send_sync::<QueuePair>();
        assert_send_sync::<SharedReceiveQueue>();
        assert_send_sync::<CompletionStream>();
        assert_send_sync::<Error>();
        assert_send_sync::<PostError>();
    }
}
