//! The registry's calls between daemons: a client whose destination is
//! an address of another host asks that host's daemon, whose registry
//! answers as it answers a client of its own (`docs/sockets.md`, "Other
//! hosts"). They travel in the daemons' Sock frames
//! (`crate::wire::sock`, `docs/wire-protocol.md`).
//!
//! The asking daemon names its client by its own number for the context
//! (`ctx`), so that the owning daemon can tell one client's announcements
//! from another's and drop them when that context ends ([`SockMessage::Closed`])
//! or the link goes down. `tenant` is the client's tenant, mapped across
//! hosts as the connection manager maps it: the same number on both hosts,
//! and a tenant numbered by its daemon (host-local) is no tenant of any
//! other host, so its calls are answered "not vRDMA".
//!
//! The exchange is IPv4 only, and its encoding stays wire version 3's:
//! the daemons' links and hosts are IPv4, so an IPv6 destination is one
//! of this host or plain TCP, never asked about here. [`PeerTuple`] is
//! the registry's [`Tuple`] of two IPv4 ends, converted at the engine's
//! edge.

use std::net::{SocketAddr, SocketAddrV4};

use serde::{Deserialize, Serialize};

use super::{Outcome, Tuple};

/// A connection of two IPv4 ends, as the daemons' exchange names it (the
/// same fields, so the same encoding, as the registry's tuple had before
/// it took IPv6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PeerTuple {
    pub client: SocketAddrV4,
    pub server: SocketAddrV4,
}

impl PeerTuple {
    /// `t` when both its ends are IPv4 (v4-mapped ones included).
    pub fn of(t: Tuple) -> Option<PeerTuple> {
        let t = t.key();
        match (t.client, t.server) {
            (SocketAddr::V4(client), SocketAddr::V4(server)) => Some(PeerTuple { client, server }),
            _ => None,
        }
    }
}

impl From<PeerTuple> for Tuple {
    fn from(t: PeerTuple) -> Tuple {
        Tuple { client: t.client.into(), server: t.server.into() }
    }
}

/// What a daemon asks about a client of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Query {
    /// Does a listener of the tenant own `dst`?
    Lookup { dst: SocketAddrV4 },
    /// The client will connect along `tuple`.
    Announce { tuple: PeerTuple },
    /// The announcement's outcome (`give_up`: end a pending one as TCP).
    Resolve { tuple: PeerTuple, give_up: bool },
}

/// The owning daemon's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Answer {
    /// To a lookup or an announcement.
    Yes,
    No,
    /// To a resolve.
    Outcome(Outcome),
}

impl Answer {
    /// The answer a query gets when it cannot be asked (no link, another
    /// tenant's, a peer that does not speak these frames): plain TCP.
    pub fn refusal(q: &Query) -> Answer {
        match q {
            Query::Resolve { .. } => Answer::Outcome(Outcome::Tcp),
            _ => Answer::No,
        }
    }

    pub fn from_bool(b: bool) -> Answer {
        if b {
            Answer::Yes
        } else {
            Answer::No
        }
    }
}

/// One message of the registry's exchange between two daemons.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SockMessage {
    /// `id`: the asker's number for the query, which the answer repeats.
    Query {
        id: u32,
        tenant: u32,
        ctx: u32,
        query: Query,
    },
    Answer {
        id: u32,
        answer: Answer,
    },
    /// The asker's context `ctx` ended: what it announced goes.
    Closed {
        ctx: u32,
    },
}
