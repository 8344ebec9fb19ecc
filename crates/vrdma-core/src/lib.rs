//! The vRDMA device without I/O.
//!
//! This crate is the "HCA" as pure logic: the verbs object model, the QP
//! state machine with `ibv_modify_qp`'s attribute rules, the decisions an RC
//! requester and responder make for every work request, the byte layouts of
//! the shared-memory queue entries, and the control protocol's messages.
//!
//! It owns no sockets, threads or clocks. The daemon drives it: it feeds
//! work requests in through [`hca::Queues`], passes the current time into
//! [`hca::Hca::process`], and carries out what comes back. That keeps every
//! semantic rule deterministic and testable without a daemon (see the unit
//! tests in [`hca`]), and lets a later transport (TCP, a real HCA) reuse the
//! same rules.

pub mod cm;
pub mod extents;
pub mod hca;
pub mod log_limit;
pub mod memory;
pub mod proto;
pub mod qp;
pub mod ring;
pub mod sockets;
pub mod time;
pub mod verbs;
pub mod wire;
