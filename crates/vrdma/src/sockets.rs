//! The socket registry's calls (`docs/sockets.md`): how the preload
//! library `vrdma-sockets` decides, through the daemon and never in a
//! stream, which TCP connections vRDMA carries. Addresses are IPv4 or
//! IPv6 (`docs/sockets.md`, "IPv6").

use std::net::SocketAddr;

use vrdma_core::proto::{Reply, Request, SockReply, SockRequest};
pub use vrdma_core::sockets::{is_link_local, key, Outcome, SockCounts, Tuple};

use crate::control;
use crate::error::{Error, Result};
use crate::Context;

impl Context {
    fn sock_call(&self, req: SockRequest) -> Result<SockReply> {
        // A link-local address's scope (its interface) is in the
        // registry's key, and only `SockScoped` carries it.
        let req = match req.scopes() {
            [0, 0] => Request::Sock(req),
            scopes => Request::SockScoped { scopes, req },
        };
        match self.inner.control.call(&req, &[])?.reply {
            Reply::Sock(r) => Ok(r),
            other => Err(control::unexpected(&req, &other)),
        }
    }

    fn sock_bool(&self, req: SockRequest) -> Result<bool> {
        match self.sock_call(req)? {
            SockReply::Yes => Ok(true),
            SockReply::No => Ok(false),
            other => Err(Error::Protocol(format!("the daemon answered a socket call with {other:?}"))),
        }
    }

    /// Registers a listening socket at `addr` for this context's tenant.
    pub fn sock_listen(&self, addr: impl Into<SocketAddr>) -> Result<()> {
        self.sock_done(SockRequest::Listen { addr: addr.into() })
    }

    /// Registers a listening socket at `addr` that also owns this host's
    /// link-local destinations of its port when `addr` is `[::]`: this
    /// library names their scopes and claims their connections, which it
    /// tells the daemon by the call's kind (`Request::SockScoped`; a plain
    /// `Sock` registration, as an older build's, owns none). A daemon
    /// without `SockScoped` refuses it (`EINVAL`): the listener is then
    /// registered plainly (such a daemon keys no link-local address).
    pub fn sock_listen_link_local(&self, addr: impl Into<SocketAddr>) -> Result<()> {
        let req = SockRequest::Listen { addr: addr.into() };
        let scoped = Request::SockScoped { scopes: req.scopes(), req: req.clone() };
        match self.inner.control.call(&scoped, &[]).map(|a| a.reply) {
            Ok(Reply::Sock(SockReply::Done)) => Ok(()),
            _ => self.sock_done(req),
        }
    }

    /// The listening socket at `addr` closed.
    pub fn sock_unlisten(&self, addr: impl Into<SocketAddr>) -> Result<()> {
        self.sock_done(SockRequest::Unlisten { addr: addr.into() })
    }

    fn sock_done(&self, req: SockRequest) -> Result<()> {
        match self.sock_call(req)? {
            SockReply::Done => Ok(()),
            other => Err(Error::Protocol(format!("the daemon answered a socket call with {other:?}"))),
        }
    }

    /// Whether a listener of this tenant owns `dst` (`local`: `dst` is an
    /// address of this host).
    pub fn sock_lookup(&self, dst: impl Into<SocketAddr>, local: bool) -> Result<bool> {
        self.sock_bool(SockRequest::Lookup { dst: dst.into(), local })
    }

    /// Announces a connection about to be made along `tuple`; true when
    /// recorded (it may be carried), false for plain TCP.
    pub fn sock_announce(&self, tuple: Tuple, local: bool) -> Result<bool> {
        self.sock_bool(SockRequest::Announce { tuple, local })
    }

    /// Claims an accepted connection; true when its client announced it
    /// (both ends carry it).
    pub fn sock_claim(&self, tuple: Tuple) -> Result<bool> {
        self.sock_bool(SockRequest::Claim { tuple })
    }

    /// Gives up a claimed connection before the first call on it (the
    /// process execs a program that inherits it): true when its client
    /// had not resolved it (TCP for both, nothing in the stream), false
    /// when the client resolved it as carried (its hello comes) or it is
    /// gone.
    pub fn sock_decline(&self, tuple: Tuple) -> Result<bool> {
        self.sock_bool(SockRequest::Decline { tuple })
    }

    /// Takes over another context's announcement of `tuple` (a child
    /// process making the first call on a connection its parent
    /// announced): true when this context may now resolve it.
    pub fn sock_adopt(&self, tuple: Tuple) -> Result<bool> {
        self.sock_bool(SockRequest::Adopt { tuple })
    }

    /// The outcome of this context's announcement of `tuple`; `give_up`
    /// turns a pending one into TCP.
    pub fn sock_resolve(&self, tuple: Tuple, give_up: bool) -> Result<Outcome> {
        match self.sock_call(SockRequest::Resolve { tuple, give_up })? {
            SockReply::Outcome(o) => Ok(o),
            other => Err(Error::Protocol(format!("the daemon answered a socket call with {other:?}"))),
        }
    }

    /// This tenant's socket registry counts.
    pub fn sock_counts(&self) -> Result<SockCounts> {
        match self.sock_call(SockRequest::Counts)? {
            SockReply::Counts(c) => Ok(c),
            other => Err(Error::Protocol(format!("the daemon answered a socket call with {other:?}"))),
        }
    }
}
