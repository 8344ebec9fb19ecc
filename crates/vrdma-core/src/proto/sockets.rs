//! The socket registry's requests and replies on the control socket (the
//! preload library's negotiation, `docs/sockets.md`). Addresses are IPv4
//! or IPv6 (`std::net::SocketAddr`, since protocol version 7). Their
//! encoding drops an IPv6 address's scope id: a request with a link-local
//! address travels as `Request::SockScoped`, which carries the scopes.

use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Serialize};

use crate::sockets::{is_link_local, key, Outcome, SockCounts, Tuple};

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

impl SockRequest {
    /// The scope ids of this request's client and server addresses (a
    /// listening address or a looked-up destination is the server's), as
    /// [`crate::sockets::key`] keeps them: 0 but for a link-local address.
    /// Both 0: the request needs no [`super::Request::SockScoped`].
    pub fn scopes(&self) -> [u32; 2] {
        let scope = |a: &SocketAddr| match key(*a) {
            SocketAddr::V6(v6) => v6.scope_id(),
            SocketAddr::V4(_) => 0,
        };
        match self {
            SockRequest::Listen { addr }
            | SockRequest::Unlisten { addr }
            | SockRequest::Lookup { dst: addr, .. } => [0, scope(addr)],
            SockRequest::Announce { tuple, .. }
            | SockRequest::Claim { tuple }
            | SockRequest::Resolve { tuple, .. }
            | SockRequest::Decline { tuple }
            | SockRequest::Adopt { tuple } => [scope(&tuple.client), scope(&tuple.server)],
            SockRequest::Counts => [0, 0],
        }
    }

    /// This request with `scopes` (as [`Self::scopes`] reads them) set on
    /// its link-local addresses; another address keeps none.
    pub fn with_scopes(mut self, scopes: [u32; 2]) -> SockRequest {
        let set = |a: &mut SocketAddr, scope: u32| {
            if let SocketAddr::V6(v6) = a {
                if is_link_local(IpAddr::V6(*v6.ip())) {
                    v6.set_scope_id(scope);
                }
            }
        };
        match &mut self {
            SockRequest::Listen { addr }
            | SockRequest::Unlisten { addr }
            | SockRequest::Lookup { dst: addr, .. } => set(addr, scopes[1]),
            SockRequest::Announce { tuple, .. }
            | SockRequest::Claim { tuple }
            | SockRequest::Resolve { tuple, .. }
            | SockRequest::Decline { tuple }
            | SockRequest::Adopt { tuple } => {
                set(&mut tuple.client, scopes[0]);
                set(&mut tuple.server, scopes[1]);
            }
            SockRequest::Counts => {}
        }
        self
    }
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
