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
//! The exchange began IPv4 only (wire version 3, [`PeerTuple`]), and
//! those messages keep their encoding. Wire version 4 appends the IPv6
//! ones (`docs/sockets.md`, "IPv6" and "Other hosts"): each daemon tells
//! its linked peers its host's IPv6 addresses ([`SockMessage::Hosts6`]),
//! which is how a daemon learns which daemon owns an IPv6 destination
//! (the daemons stay found, and linked, by IPv4), and asks about IPv6
//! destinations and tuples with [`Query::Lookup6`], [`Query::Announce6`]
//! and [`Query::Resolve6`]. A version-3 daemon's decoder refuses an
//! unknown kind and ends the link, so these go only on a link that
//! negotiated version 4 ([`SockMessage::min_version`]).
//! [`PeerTuple`] and [`PeerTuple6`] are the registry's [`Tuple`] of two
//! ends of one family, converted at the engine's edge.

use std::net::{Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

use serde::{Deserialize, Serialize};

use super::{is_link_local, Outcome, Tuple};

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

/// A connection of two IPv6 ends (neither v4-mapped), as the daemons'
/// exchange names it from wire version 4 on: each end its 16 bytes and
/// its port (no flow label and no scope id: a scope names an interface
/// of one host, and only a link-local address's key has one, which never
/// leaves its host: [`PeerTuple6::of`] takes no link-local end).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PeerTuple6 {
    pub client: SocketAddrV6,
    pub server: SocketAddrV6,
}

impl PeerTuple6 {
    /// `t` when both its ends are IPv6 and not v4-mapped (those are
    /// IPv4, a [`PeerTuple`]) and neither is link-local (its scope is
    /// this host's: such a connection is never asked of another).
    pub fn of(t: Tuple) -> Option<PeerTuple6> {
        let t = t.key();
        if is_link_local(t.client.ip()) || is_link_local(t.server.ip()) {
            return None;
        }
        match (t.client, t.server) {
            (SocketAddr::V6(client), SocketAddr::V6(server)) => Some(PeerTuple6 { client, server }),
            _ => None,
        }
    }
}

impl From<PeerTuple6> for Tuple {
    fn from(t: PeerTuple6) -> Tuple {
        Tuple { client: t.client.into(), server: t.server.into() }.key()
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
    /// [`Query::Lookup`] of an IPv6 destination (wire version 4).
    Lookup6 { dst: SocketAddrV6 },
    /// [`Query::Announce`] of an IPv6 tuple (wire version 4).
    Announce6 { tuple: PeerTuple6 },
    /// [`Query::Resolve`] of an IPv6 tuple (wire version 4).
    Resolve6 { tuple: PeerTuple6, give_up: bool },
}

impl Query {
    /// The lookup of `dst`, of its family's kind.
    pub fn lookup(dst: SocketAddr) -> Query {
        // Another host's link-local address is nobody's: its daemon's
        // caller answers it, never asks (`docs/sockets.md`).
        debug_assert!(!is_link_local(dst.ip()), "a link-local destination asked of another host");
        match crate::sockets::key(dst) {
            SocketAddr::V4(dst) => Query::Lookup { dst },
            SocketAddr::V6(dst) => Query::Lookup6 { dst },
        }
    }

    /// The announcement of `t`, of its family's kind; `None` for a tuple
    /// of two families.
    pub fn announce(t: Tuple) -> Option<Query> {
        PeerTuple::of(t)
            .map(|tuple| Query::Announce { tuple })
            .or_else(|| PeerTuple6::of(t).map(|tuple| Query::Announce6 { tuple }))
    }

    /// The resolve of `t`, of its family's kind; `None` for a tuple of
    /// two families.
    pub fn resolve(t: Tuple, give_up: bool) -> Option<Query> {
        PeerTuple::of(t)
            .map(|tuple| Query::Resolve { tuple, give_up })
            .or_else(|| PeerTuple6::of(t).map(|tuple| Query::Resolve6 { tuple, give_up }))
    }

    /// The tuple an announcement announces.
    pub fn announced(&self) -> Option<Tuple> {
        match *self {
            Query::Announce { tuple } => Some(tuple.into()),
            Query::Announce6 { tuple } => Some(tuple.into()),
            _ => None,
        }
    }

    /// The tuple a resolve resolves.
    pub fn resolved(&self) -> Option<Tuple> {
        match *self {
            Query::Resolve { tuple, .. } => Some(tuple.into()),
            Query::Resolve6 { tuple, .. } => Some(tuple.into()),
            _ => None,
        }
    }

    /// The oldest wire version that has this kind.
    pub fn min_version(&self) -> u8 {
        match self {
            Query::Lookup { .. } | Query::Announce { .. } | Query::Resolve { .. } => {
                crate::wire::SOCK_VERSION
            }
            Query::Lookup6 { .. } | Query::Announce6 { .. } | Query::Resolve6 { .. } => {
                crate::wire::SOCK6_VERSION
            }
        }
    }
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
            Query::Resolve { .. } | Query::Resolve6 { .. } => Answer::Outcome(Outcome::Tcp),
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

/// Most IPv6 addresses one [`SockMessage::Hosts6`] names (a host's
/// addresses past them are not advertised: their connections from other
/// hosts stay plain TCP).
pub const MAX_HOST6: usize = 32;

/// A host's IPv6 addresses, as [`SockMessage::Hosts6`] carries them: a
/// varint count, then each address's 16 bytes. At most [`MAX_HOST6`]:
/// the decoder refuses a longer list after that many, without reserving
/// room for what the count claims.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Addrs6(Vec<Ipv6Addr>);

impl Addrs6 {
    /// The first [`MAX_HOST6`] of `addrs`.
    pub fn new(mut addrs: Vec<Ipv6Addr>) -> Addrs6 {
        addrs.truncate(MAX_HOST6);
        Addrs6(addrs)
    }

    pub fn as_slice(&self) -> &[Ipv6Addr] {
        &self.0
    }
}

impl Serialize for Addrs6 {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de> Deserialize<'de> for Addrs6 {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Addrs6, D::Error> {
        struct Bounded;
        impl<'de> serde::de::Visitor<'de> for Bounded {
            type Value = Addrs6;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                write!(f, "at most {MAX_HOST6} IPv6 addresses")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Addrs6, A::Error> {
                let mut v = Vec::new();
                while let Some(a) = seq.next_element::<Ipv6Addr>()? {
                    if v.len() == MAX_HOST6 {
                        return Err(serde::de::Error::invalid_length(MAX_HOST6 + 1, &self));
                    }
                    v.push(a);
                }
                Ok(Addrs6(v))
            }
        }
        d.deserialize_seq(Bounded)
    }
}

/// One message of the registry's exchange between two daemons.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
    /// The sender's host's IPv6 addresses, all of them (they replace what
    /// it told before), sent when a link of wire version 4 comes up and
    /// whenever they change (wire version 4).
    Hosts6 {
        addrs: Addrs6,
    },
}

impl SockMessage {
    /// The oldest wire version that has this message: a link of an older
    /// one must not carry it (its peer's decoder would end the link).
    pub fn min_version(&self) -> u8 {
        match self {
            SockMessage::Query { query, .. } => query.min_version(),
            SockMessage::Answer { .. } | SockMessage::Closed { .. } => crate::wire::SOCK_VERSION,
            SockMessage::Hosts6 { .. } => crate::wire::SOCK6_VERSION,
        }
    }
}
