//! The socket registry: which TCP connections of a tenant vRDMA carries.
//!
//! The preload library (`vrdma-sockets`, `docs/sockets.md`) keeps every
//! application descriptor a real kernel TCP socket and decides per
//! connection, through the daemon and never in the stream, whether both
//! ends are vRDMA libraries. This is the daemon's half of that decision,
//! with no I/O and no clock (time is passed in):
//!
//! - a listening socket registers its address (`listen`);
//! - before `connect`, a client asks whether a listener of its tenant owns
//!   the destination ([`Registry::lookup`]) and, if so, announces its
//!   4-tuple ([`Registry::announce`]);
//! - after `accept`, the server claims the accepted connection's 4-tuple
//!   ([`Registry::claim`]): yes only if it is announced and still pending;
//! - the client learns the outcome ([`Registry::resolve`]) before it moves
//!   a byte: carried once claimed, TCP once refused, still pending before
//!   the server accepted. A client that waited long enough gives up, which
//!   turns a pending announcement into TCP for both ends;
//! - a server that claimed a connection and is about to `exec` a program
//!   that inherits it declines it ([`Registry::decline`]): TCP for both,
//!   if the client has not resolved it yet.
//!
//! Every transition is made here, one call at a time, so the two ends
//! always agree: an announcement is either claimed (both carry) or gone
//! before any claim (both stay TCP). Pending announcements expire after
//! [`PENDING_TTL`] (the server never accepted); a claimed one stays until
//! the client has resolved it or its context closed, since expiring it
//! would let the two ends disagree. Another tenant's listeners and
//! announcements are invisible: every key holds the tenant.
//!
//! Addresses are IPv4 or IPv6 ([`key`] makes every one the same key as
//! its connection's other end names it: a v4-mapped IPv6 address is its
//! IPv4 one, flow label and scope id are dropped). A listener on an
//! unspecified address owns that family's local destinations only, as
//! the kernel's: `0.0.0.0` the IPv4 ones, `[::]` the IPv6 ones; a
//! dual-stack `::` socket registers both. A link-local IPv6 address
//! (`fe80::/10`) names an address only with its interface, so its key
//! keeps its scope id (the interface's index, as both ends of a
//! connection on one host name it: `fe80::1%2` and `fe80::1%3` are two
//! keys); one without a scope names nothing and is owned by no listener,
//! and a link-local destination is owned only when the client found it
//! its own host's (`local`): scope ids are per host, so another host's
//! link-local address is never this registry's. An unspecified IPv6
//! listener owns link-local destinations only when its library said it
//! names scopes (`listen`'s `link_local`, a registration through
//! `Request::SockScoped`): a library of an older build never claims a
//! link-local connection, and its client would wait for that claim.

pub mod peer;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::hca::{ContextId, TenantId};
use crate::time::Instant;

/// How long an announcement waits for the server's claim.
pub const PENDING_TTL: Duration = Duration::from_secs(30);
/// Listening addresses one tenant may register.
pub const MAX_LISTENERS: usize = 1024;
/// Announcements one tenant may hold at once (pending or claimed).
pub const MAX_ANNOUNCED: usize = 16 * 1024;

/// A TCP connection as both ends name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Tuple {
    /// The connecting end's address.
    pub client: SocketAddr,
    /// The accepting end's address.
    pub server: SocketAddr,
}

impl Tuple {
    /// Both ends as [`key`]s.
    pub fn key(self) -> Tuple {
        Tuple { client: key(self.client), server: key(self.server) }
    }
}

/// `a` as the registry keys it: a v4-mapped IPv6 address (a dual-stack
/// socket's IPv4 connection) is its IPv4 address, and an IPv6 one has no
/// flow label (it does not name the address) and no scope id, except a
/// link-local one, which keeps its scope (its interface: the kernel names
/// a link-local end with it, and the same on both ends of a connection on
/// one host, while it gives every other address scope 0).
pub fn key(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V4(_) => a,
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), v6.port()),
            None => {
                let scope = if is_link_local(IpAddr::V6(*v6.ip())) { v6.scope_id() } else { 0 };
                SocketAddr::V6(SocketAddrV6::new(*v6.ip(), v6.port(), 0, scope))
            }
        },
    }
}

/// Whether `ip` is a link-local IPv6 address (`fe80::/10`): one that
/// names an address only with its interface (its scope id).
pub fn is_link_local(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V6(v6) => v6.segments()[0] & 0xffc0 == 0xfe80,
        IpAddr::V4(_) => false,
    }
}

/// A link-local address without its scope id (as [`key`] names `a`):
/// one that names no interface, which the kernel refuses to connect to
/// and no key of a connection holds.
pub fn is_unscoped(a: SocketAddr) -> bool {
    matches!(a, SocketAddr::V6(v6) if is_link_local(IpAddr::V6(*v6.ip())) && v6.scope_id() == 0)
}

/// Whether `t`'s ends are either both link-local on one interface (one
/// scope) or neither link-local: the kernel makes no other connection (a
/// link-local address reaches its own link only), and a library never
/// claims another.
fn one_link(t: Tuple) -> bool {
    let scope = |a: SocketAddr| match a {
        SocketAddr::V6(v6) if is_link_local(a.ip()) => Some(v6.scope_id()),
        _ => None,
    };
    scope(t.client) == scope(t.server)
}

/// The unspecified address of `ip`'s family.
fn unspecified_like(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

/// What a client learns about its announced connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// The server has not accepted it yet.
    Pending,
    /// The server claimed it: both ends carry it over vRDMA.
    Carried,
    /// Plain TCP for both ends.
    Tcp,
}

/// Counts one tenant's registry has seen, for `vrdma stat` and the tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SockCounts {
    pub listeners: u32,
    pub pending: u32,
    pub announced: u64,
    pub carried: u64,
    /// Claims that found no announcement (a plain client, or one too late).
    pub refused_claims: u64,
    /// Announcements that ended as TCP (expired, given up, or declined by
    /// their server after its claim).
    pub abandoned: u64,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SockError {
    #[error("the tenant already registers {MAX_LISTENERS} listening addresses")]
    TooManyListeners,
    #[error("port 0 cannot be listened on or announced")]
    PortZero,
}

impl SockError {
    pub fn errno(&self) -> i32 {
        match self {
            SockError::TooManyListeners => 105, // ENOBUFS
            SockError::PortZero => 22,          // EINVAL
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Pending { since: Instant },
    Claimed,
}

/// Who announced a connection: a context of this daemon, or a context
/// of another host's daemon (the client runs there, its destination is
/// here), named by that daemon's address, the link it asked by (this
/// daemon's number for it: a daemon of that address restarted makes a
/// second link while the first is not yet found dead, and each link's
/// end takes only its own entries) and its number for the context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Owner {
    Local(ContextId),
    Remote { host: Ipv4Addr, link: u32, ctx: u32 },
}

impl From<ContextId> for Owner {
    fn from(c: ContextId) -> Owner {
        Owner::Local(c)
    }
}

#[derive(Debug)]
struct Entry {
    owner: Owner,
    state: State,
}

/// The registry of one daemon (all tenants, each apart).
#[derive(Debug, Default)]
pub struct Registry {
    /// (tenant, address) → the contexts listening there (a listener may be
    /// shared by processes, after fork).
    listeners: HashMap<(TenantId, SocketAddr), Vec<ContextId>>,
    /// The unspecified IPv6 listeners (`[::]:port`) that own link-local
    /// destinations too: their library names scopes ([`Self::listen`]).
    link_owners: HashMap<(TenantId, SocketAddr), Vec<ContextId>>,
    announced: HashMap<(TenantId, Tuple), Entry>,
    counts: HashMap<TenantId, SockCounts>,
}

impl Registry {
    pub fn new() -> Registry {
        Registry::default()
    }

    fn counts(&mut self, tenant: TenantId) -> &mut SockCounts {
        self.counts.entry(tenant).or_default()
    }

    /// `ctx` of `tenant` listens on `addr` (its unspecified address means
    /// every local one of its family: a dual-stack `::` socket registers
    /// `0.0.0.0` and `[::]`), owning no link-local destination through an
    /// unspecified address ([`Self::listen_with`]).
    pub fn listen(&mut self, ctx: ContextId, tenant: TenantId, addr: SocketAddr) -> Result<(), SockError> {
        self.listen_with(ctx, tenant, addr, false)
    }

    /// [`Self::listen`]; with `link_local`, an unspecified IPv6
    /// `addr` owns this host's link-local destinations of its port too:
    /// the listener's library names scopes and claims such connections
    /// (one of an older build refuses them, and must not own them).
    pub fn listen_with(
        &mut self,
        ctx: ContextId,
        tenant: TenantId,
        addr: SocketAddr,
        link_local: bool,
    ) -> Result<(), SockError> {
        if addr.port() == 0 {
            return Err(SockError::PortZero);
        }
        let key = (tenant, key(addr));
        if !self.listeners.contains_key(&key) {
            if self.counts(tenant).listeners as usize >= MAX_LISTENERS {
                return Err(SockError::TooManyListeners);
            }
            self.counts(tenant).listeners += 1;
        }
        let owners = self.listeners.entry(key).or_default();
        if !owners.contains(&ctx) {
            owners.push(ctx);
        }
        if link_local && key.1.ip() == IpAddr::V6(Ipv6Addr::UNSPECIFIED) {
            let owners = self.link_owners.entry(key).or_default();
            if !owners.contains(&ctx) {
                owners.push(ctx);
            }
        }
        Ok(())
    }

    /// `ctx` no longer listens on `addr`; unknown ones are ignored.
    pub fn unlisten(&mut self, ctx: ContextId, tenant: TenantId, addr: SocketAddr) {
        let key = (tenant, key(addr));
        if let Some(owners) = self.link_owners.get_mut(&key) {
            owners.retain(|&c| c != ctx);
            if owners.is_empty() {
                self.link_owners.remove(&key);
            }
        }
        if let Some(owners) = self.listeners.get_mut(&key) {
            owners.retain(|&c| c != ctx);
            if owners.is_empty() {
                self.listeners.remove(&key);
                let c = self.counts(tenant);
                c.listeners = c.listeners.saturating_sub(1);
            }
        }
    }

    /// Whether a listener of `tenant` owns `dst`: one on that exact
    /// address, or on its port at the unspecified address of its family
    /// when the caller says `dst` is an address of its own host (`local`).
    /// A link-local IPv6 destination is owned only with its scope and
    /// when `local` (another host's link-local address is never ours), by
    /// a listener on it or an unspecified one that names scopes.
    pub fn lookup(&self, tenant: TenantId, dst: SocketAddr, local: bool) -> bool {
        let dst = key(dst);
        let link = is_link_local(dst.ip());
        if dst.port() == 0 || is_unscoped(dst) || (link && !local) {
            return false;
        }
        let any = (tenant, SocketAddr::new(unspecified_like(dst.ip()), dst.port()));
        let anys = if link { &self.link_owners } else { &self.listeners };
        self.listeners.contains_key(&(tenant, dst)) || (local && anys.contains_key(&any))
    }

    /// `ctx` of `tenant` will connect from `tuple.client` to
    /// `tuple.server`. True when a listener owns the destination and the
    /// announcement is recorded (pending); false means plain TCP, as for
    /// a tuple whose ends are of two families or whose link-local client
    /// has no scope.
    pub fn announce(
        &mut self,
        owner: impl Into<Owner>,
        tenant: TenantId,
        tuple: Tuple,
        local: bool,
        now: Instant,
    ) -> bool {
        self.expire(now);
        let tuple = tuple.key();
        // Two families (after `key`) name no connection the kernel
        // makes; a link-local client without its scope is as unkeyable
        // as such a server (`lookup` refuses that one). Another host's
        // daemon's announcement has no scope (the wire carries none):
        // link-local stays on its host.
        let mixed = tuple.client.is_ipv4() != tuple.server.is_ipv4();
        if tuple.client.port() == 0 || mixed || is_unscoped(tuple.client) || !one_link(tuple) {
            return false;
        }
        let owner = owner.into();
        if matches!(owner, Owner::Remote { .. })
            && (is_link_local(tuple.client.ip()) || is_link_local(tuple.server.ip()))
        {
            return false;
        }
        if !self.lookup(tenant, tuple.server, local) {
            return false;
        }
        let key = (tenant, tuple);
        // The kernel never has two live connections of one 4-tuple: an old
        // entry belongs to a connection that is gone.
        let held = self.announced.keys().filter(|(t, _)| *t == tenant).count();
        if !self.announced.contains_key(&key) && held >= MAX_ANNOUNCED {
            return false;
        }
        self.announced.insert(key, Entry { owner, state: State::Pending { since: now } });
        self.counts(tenant).announced += 1;
        true
    }

    /// The server of `tenant` accepted `tuple`: true (carried) when it was
    /// announced and is still pending; it is claimed then.
    pub fn claim(&mut self, tenant: TenantId, tuple: Tuple, now: Instant) -> bool {
        self.expire(now);
        match self.announced.get_mut(&(tenant, tuple.key())) {
            Some(e) if matches!(e.state, State::Pending { .. }) => {
                e.state = State::Claimed;
                self.counts(tenant).carried += 1;
                true
            }
            _ => {
                self.counts(tenant).refused_claims += 1;
                false
            }
        }
    }

    /// The outcome of `ctx`'s announcement of `tuple`. A final outcome
    /// removes the entry. With `give_up`, a pending announcement ends as
    /// TCP (the server's later claim is refused).
    pub fn resolve(
        &mut self,
        owner: impl Into<Owner>,
        tenant: TenantId,
        tuple: Tuple,
        give_up: bool,
        now: Instant,
    ) -> Outcome {
        let ctx = owner.into();
        self.expire(now);
        let key = (tenant, tuple.key());
        match self.announced.get(&key) {
            Some(e) if e.owner != ctx => Outcome::Tcp,
            Some(Entry { state: State::Claimed, .. }) => {
                self.announced.remove(&key);
                Outcome::Carried
            }
            Some(Entry { state: State::Pending { .. }, .. }) if give_up => {
                self.announced.remove(&key);
                self.counts(tenant).abandoned += 1;
                Outcome::Tcp
            }
            Some(_) => Outcome::Pending,
            None => Outcome::Tcp,
        }
    }

    /// The server of `tenant` gives up carrying `tuple`, which it claimed
    /// (it is about to `exec` a program that inherits the connection
    /// before its first call on it). True when the client had not
    /// resolved it yet: the entry goes, so the client's resolve reads TCP
    /// and neither end puts a byte of negotiation in the stream. False
    /// when it is not claimed and waiting for its client (the client
    /// resolved it as carried, and its hello is on its way; or it is
    /// gone, or still pending, which no claim of this server made).
    pub fn decline(&mut self, tenant: TenantId, tuple: Tuple) -> bool {
        let key = (tenant, tuple.key());
        match self.announced.get(&key) {
            Some(Entry { state: State::Claimed, .. }) => {
                self.announced.remove(&key);
                self.counts(tenant).abandoned += 1;
                true
            }
            _ => false,
        }
    }

    /// `owner` (a context of this daemon) takes over the announcement of
    /// `tuple` that another context of this daemon made: a client's
    /// connection announced in a process that forked before its first
    /// call, whose child makes the first call (the child drives it, and
    /// only the announcement's context may resolve it). True when there
    /// was one, pending or claimed; false when it is gone (the announcing
    /// context closed, or it expired) or another host's daemon holds it,
    /// and then the caller cannot learn its outcome.
    pub fn adopt(&mut self, owner: ContextId, tenant: TenantId, tuple: Tuple) -> bool {
        match self.announced.get_mut(&(tenant, tuple.key())) {
            Some(e) if matches!(e.owner, Owner::Local(_)) => {
                e.owner = Owner::Local(owner);
                true
            }
            _ => false,
        }
    }

    /// Drops pending announcements older than [`PENDING_TTL`].
    pub fn expire(&mut self, now: Instant) {
        let mut gone = Vec::new();
        self.announced.retain(|(t, _), e| match e.state {
            State::Pending { since } if now.saturating_since(since) >= PENDING_TTL => {
                gone.push(*t);
                false
            }
            _ => true,
        });
        for t in gone {
            self.counts(t).abandoned += 1;
        }
    }

    /// Everything `ctx` registered or announced goes with it.
    pub fn close_context(&mut self, ctx: ContextId) {
        let keys: Vec<_> = self.listeners.iter().filter(|(_, o)| o.contains(&ctx)).map(|(k, _)| *k).collect();
        for (tenant, addr) in keys {
            self.unlisten(ctx, tenant, addr);
        }
        self.announced.retain(|_, e| e.owner != Owner::Local(ctx));
    }

    /// What a context of the daemon at `host` announced by `link` goes
    /// with it (`ctx`: that context; `None`: every one of that link, which
    /// went down). Another link's, to the same host, stays.
    pub fn forget_remote(&mut self, host: Ipv4Addr, link: u32, ctx: Option<u32>) {
        self.announced.retain(|_, e| match e.owner {
            Owner::Remote { host: h, link: l, ctx: c } => {
                h != host || l != link || ctx.is_some_and(|x| x != c)
            }
            Owner::Local(_) => true,
        });
    }

    /// `tenant`'s counts.
    pub fn stats(&self, tenant: TenantId) -> SockCounts {
        let mut c = self.counts.get(&tenant).copied().unwrap_or_default();
        c.pending = self
            .announced
            .iter()
            .filter(|((t, _), e)| *t == tenant && matches!(e.state, State::Pending { .. }))
            .count() as u32;
        c
    }
}
