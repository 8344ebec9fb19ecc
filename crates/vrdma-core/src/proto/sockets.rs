//! The socket registry's requests and replies on the control socket (the
//! preload library's negotiation, `docs/sockets.md`). Addresses are IPv4
//! or IPv6 (`std::net::SocketAddr`, since protocol version 7).

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::sockets::{Outcome, SockCounts, Tuple};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum SockRequest {
    /// A listening socket at `addr`; answered [`SockReply::Done`].
    Listen { addr: SocketAddr },
    /// It closed; answered [`SockReply::Done`].
    Unlisten { addr: SocketAddr },
    /// Does a listener of the caller's tenant own `dst`? `local`: the
    /// caller found `dst` to be an address of its host. Answered
    /// [`SockReply::Yes`] or [`SockReply::No`].
    Lookup { dst: SocketAddr, local: bool },
    /// The caller will connect along `tuple`; answered `Yes` (announced)
    /// or `No` (plain TCP).
    Announce { tuple: Tuple, local: bool },
    /// The caller accepted `tuple`; answered `Yes` (carried) or `No`.
    Claim { tuple: Tuple },
    /// The caller's announcement's outcome; answered [`SockReply::Outcome`].
    Resolve { tuple: Tuple, give_up: bool },
    /// The tenant's counts; answered [`SockReply::Counts`].
    Counts,
    /// The caller claimed `tuple` and gives it up before its first call
    /// on it (it execs a program that inherits it); answered `Yes` (the
    /// client had not resolved it: TCP for both) or `No` (the client
    /// resolved it as carried, or it is gone). Added after `Counts`, so
    /// that the other requests keep their encoding; a daemon without it
    /// fails the call, and the library then reads the client's hello.
    Decline { tuple: Tuple },
    /// The caller takes over the announcement of `tuple` that another
    /// context of this daemon made (a client forked before its first
    /// call, whose child makes it); answered `Yes` (it may resolve it
    /// now) or `No` (gone, or another host's daemon holds it).
    Adopt { tuple: Tuple },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum SockReply {
    Done,
    Yes,
    No,
    Outcome(Outcome),
    Counts(SockCounts),
}

impl SockReply {
    pub fn from_bool(b: bool) -> SockReply {
        if b {
            SockReply::Yes
        } else {
            SockReply::No
        }
    }
}
