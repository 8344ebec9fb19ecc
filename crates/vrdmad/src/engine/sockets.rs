//! The socket registry's calls (`docs/sockets.md`) on the engine: a
//! client's call about an address of this host is answered by this
//! daemon's registry; one about an address of another host goes to that
//! host's daemon over the link between them (a Sock frame, wire version
//! 3), dialled for it if need be, as the connection manager's messages
//! go, and that daemon's registry answers it as it answers a client of
//! its own. The client's session waits for the answer off the engine's
//! lock ([`SockCall::Wait`]); no answer in time, no link, a version-2
//! peer, another tenant: the connection stays plain TCP.
//!
//! Who announced what where: this daemon remembers, per context, the
//! tuples it announced at another host (their resolves go there too) and
//! tells that host when the context ends ([`SockMessage::Closed`]); the
//! owning daemon keeps the entries as the client's host's and context's
//! ([`Owner::Remote`]) and drops them with the link. Both sides key what
//! they keep by the link too (the one it was asked or answered by): a
//! daemon that restarted links again while its last link is not yet found
//! dead, and that link's end takes only its own entries, not the new
//! link's.
//!
//! IPv6: the daemons' links stay IPv4 (a daemon is found by its IPv4
//! address), so a daemon learns which daemon owns an IPv6 address from
//! that daemon: each tells its peers of wire version 4 its host's IPv6
//! addresses ([`SockMessage::Hosts6`]) when their link comes up and
//! whenever they change (a thread of its own reads them every
//! [`ADDR_SCAN`], off the engine's, and a listener of IPv6 registering
//! reads them at once, at most once per [`FORCE_GAP`]: a read is a netlink
//! dump, under the engine's lock). An IPv6 destination is answered here
//! when the client found it an address of its host or it is one of this
//! host's; it is asked of the daemon that advertised it (exactly one did)
//! in the IPv6 kinds of the exchange, as an IPv4 one is asked of the
//! daemon at that address; and it is plain TCP otherwise. The owning
//! daemon takes an IPv6 announcement only for a client address that the
//! asking daemon advertised (and no other daemon did), as it takes an IPv4
//! one only for the asking daemon's own address. A peer's list is kept
//! whole, this host's own addresses filtered out when it is used, so that
//! an address that moves from this host to a peer is the peer's once this
//! host no longer has it. Only a link that counts as its host's (one this
//! daemon dialled, or that came from its GID's address: see the
//! transport's `sock_host`) speaks for a host at all; where `net.peers` or
//! `net.allow` is configured, only the daemons they name are believed
//! about their addresses.
//!
//! A query held for a dial is the dialled link's once that link took it
//! (the transport reports it: `Net::sock_sent`), so that only that link's
//! end ends its wait; an announcement whose wait ended unanswered is
//! remembered a while ([`MAX_ABANDONED`]), so that a "yes" that still
//! comes is given up at its owner.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::mpsc;
use std::time::Duration;

use vrdma_core::hca::{ContextId, LinkId, TenantId};
use vrdma_core::proto::{SockReply, SockRequest};
use vrdma_core::sockets::peer::{Addrs6, Answer, Query, SockMessage};
use vrdma_core::sockets::{Outcome, Owner, SockError, Tuple};
use vrdma_core::time::Instant;

use super::EngineState;

/// How long a client's session waits for another host's answer: a dial
/// (one second at most to connect, then the handshake) and a round trip.
pub const FORWARD_WAIT: Duration = Duration::from_secs(4);
/// Queries waiting for an answer at once, and tuples announced at other
/// hosts, that this daemon keeps at most; past them, plain TCP.
const MAX_WAITING: usize = 4096;
const MAX_REMOTE_ANNOUNCED: usize = 64 * 1024;
/// Announcements whose wait ended before their answer came (the session
/// stopped waiting, the context ended, the wait went stale), kept this
/// many at most and this long: an answer "yes" that comes after is given
/// up at once at its owner (so that the server's claim is refused and
/// both ends agree on TCP), the oldest forgotten first past the count.
const MAX_ABANDONED: usize = 1024;
const ABANDONED_FOR: Duration = Duration::from_secs(60);
/// How often this daemon reads its host's IPv6 addresses (to tell its
/// peers when they changed).
pub const ADDR_SCAN: Duration = Duration::from_secs(1);
/// Reads of them at once (an IPv6 listener, an announcement from an
/// address not told yet) are at most one per this; a call within it is
/// served by the last read.
pub const FORCE_GAP: Duration = Duration::from_millis(100);

/// A call's answer: now, or from another host (the session waits on it
/// without the engine's lock, at most [`FORWARD_WAIT`]).
pub enum SockCall {
    Now(SockReply),
    Wait { rx: mpsc::Receiver<Answer>, query: Query },
}

impl SockCall {
    /// The reply for the client, waiting for another host's answer if it
    /// must.
    pub fn reply(self) -> SockReply {
        match self {
            SockCall::Now(r) => r,
            SockCall::Wait { rx, query } => {
                let a = rx.recv_timeout(FORWARD_WAIT).unwrap_or_else(|_| Answer::refusal(&query));
                reply_of(&query, a)
            }
        }
    }
}

fn reply_of(q: &Query, a: Answer) -> SockReply {
    match (q, a) {
        (Query::Resolve { .. } | Query::Resolve6 { .. }, Answer::Outcome(o)) => SockReply::Outcome(o),
        (Query::Resolve { .. } | Query::Resolve6 { .. }, _) => SockReply::Outcome(Outcome::Tcp),
        (_, a) => SockReply::from_bool(a == Answer::Yes),
    }
}

/// Whose registry answers a call about a destination.
enum Where {
    /// This daemon's.
    Here,
    /// The daemon of this host (found by its IPv4 address).
    Host(Ipv4Addr),
    /// None: plain TCP (an IPv6 address no linked daemon advertised).
    Nowhere,
}

struct Waiting {
    host: Ipv4Addr,
    /// The link the query went by (`None`: held for a dial).
    link: Option<LinkId>,
    ctx: ContextId,
    tenant: TenantId,
    query: Query,
    since: Instant,
    tx: mpsc::SyncSender<Answer>,
}

/// An announcement whose wait ended unanswered ([`MAX_ABANDONED`]).
struct Abandoned {
    host: Ipv4Addr,
    link: Option<LinkId>,
    ctx: ContextId,
    tenant: TenantId,
    tuple: Tuple,
    /// When its wait ended.
    since: Instant,
}

/// This daemon's side of the calls it sends to other hosts.
#[derive(Default)]
pub struct RemoteSockets {
    next_id: u32,
    waiting: HashMap<u32, Waiting>,
    abandoned: HashMap<u32, Abandoned>,
    /// When `abandoned` is next swept for entries past [`ABANDONED_FOR`]
    /// (once a second, not on every pass of the engine).
    abandoned_sweep: Option<Instant>,
    /// Tuples this daemon's contexts announced at another host (as the
    /// registry keys them), that host and the link it answered by.
    announced: HashMap<(ContextId, Tuple), (Ipv4Addr, LinkId)>,
    inbox: Vec<(LinkId, Ipv4Addr, SockMessage)>,
    /// This host's IPv6 addresses as last read (what its peers were
    /// told), and when the engine last polled them (`None`: never read).
    own6: Vec<Ipv6Addr>,
    scanned: Option<Instant>,
    /// How they are read (`None`: [`crate::host::ipv6_addrs`], every
    /// [`ADDR_SCAN`] by `watch`'s thread; tests set their own, read on the
    /// engine's passes).
    scan6: Option<fn() -> Vec<Ipv6Addr>>,
    /// The reads (made at the first run); `polled`: it has no thread, the
    /// engine's passes poll it.
    watch: Option<std::sync::Arc<crate::host::Ipv6Watch>>,
    polled: bool,
    /// [`FORCE_GAP`] unless a test says otherwise.
    force_gap: Option<Duration>,
    /// Whether more addresses than a `Hosts6` names were found (said once).
    truncated: bool,
    /// The IPv6 addresses each linked daemon advertised, by the link it
    /// told them on, with its host.
    hosts6: HashMap<LinkId, (Ipv4Addr, Vec<Ipv6Addr>)>,
}

impl RemoteSockets {
    /// A query id that no wait, and no abandoned announcement, has.
    fn next_id(&mut self) -> u32 {
        loop {
            self.next_id = self.next_id.wrapping_add(1);
            let id = self.next_id;
            if !self.waiting.contains_key(&id) && !self.abandoned.contains_key(&id) {
                return id;
            }
        }
    }

    /// Ends the waits that `gone` picks (their sessions go on as plain
    /// TCP); the announcements among them are remembered, so that an
    /// answer "yes" that still comes is given up ([`MAX_ABANDONED`]).
    fn abandon(&mut self, now: Instant, gone: impl Fn(&Waiting) -> bool) {
        let ids: Vec<u32> = self.waiting.iter().filter(|(_, w)| gone(w)).map(|(id, _)| *id).collect();
        for id in ids {
            let Some(w) = self.waiting.remove(&id) else { continue };
            let Some(tuple) = w.query.announced() else { continue };
            if self.abandoned.len() >= MAX_ABANDONED {
                if let Some(oldest) = self.abandoned.iter().min_by_key(|(_, a)| a.since).map(|(id, _)| *id) {
                    self.abandoned.remove(&oldest);
                }
            }
            let a = Abandoned { host: w.host, link: w.link, ctx: w.ctx, tenant: w.tenant, tuple, since: now };
            self.abandoned.insert(id, a);
        }
    }

    /// The host whose daemon advertised `ip`, when exactly one did (two
    /// links of one host, a restarted daemon's and its last, count once).
    fn advertiser6(&self, ip: Ipv6Addr) -> Option<Ipv4Addr> {
        let mut hosts = self.hosts6.values().filter(|(_, a)| a.contains(&ip)).map(|(h, _)| *h);
        let first = hosts.next()?;
        hosts.all(|h| h == first).then_some(first)
    }
}

impl EngineState {
    /// A socket registry call of `ctx`'s, from a library that names no
    /// scopes ([`Self::handle_sock_as`]).
    pub fn handle_sock(
        &mut self,
        ctx: ContextId,
        tenant: TenantId,
        req: SockRequest,
    ) -> Result<SockCall, SockError> {
        self.handle_sock_as(ctx, tenant, req, false)
    }

    /// A socket registry call of `ctx`'s; `scoped`: it came as
    /// `Request::SockScoped`, from a library that names link-local scopes
    /// and claims link-local connections, so that its `[::]` listener
    /// owns this host's link-local destinations of its port (one of an
    /// older build never claims them: its client would wait for nothing).
    pub fn handle_sock_as(
        &mut self,
        ctx: ContextId,
        tenant: TenantId,
        req: SockRequest,
        scoped: bool,
    ) -> Result<SockCall, SockError> {
        let now = self.now();
        let reply = match req {
            SockRequest::Listen { addr } => {
                self.sockets.listen_with(ctx, tenant, addr, scoped)?;
                // A listener of IPv6: its host's addresses are read (and
                // told, where they changed) now, not at the next scan.
                if addr.is_ipv6() {
                    self.refresh6(now, true);
                }
                SockReply::Done
            }
            SockRequest::Unlisten { addr } => {
                self.sockets.unlisten(ctx, tenant, addr);
                SockReply::Done
            }
            SockRequest::Lookup { dst, local } => match self.elsewhere(dst.ip(), local) {
                Where::Here => SockReply::from_bool(self.sockets.lookup(tenant, dst, local)),
                Where::Host(host) => return Ok(self.forward(ctx, tenant, host, Query::lookup(dst), now)),
                Where::Nowhere => SockReply::No,
            },
            SockRequest::Announce { tuple, local } => match self.elsewhere(tuple.server.ip(), local) {
                Where::Here => SockReply::from_bool(self.sockets.announce(ctx, tenant, tuple, local, now)),
                // A link-local end (its scope is this host's) is never
                // sent to another host: `Query::announce` has none.
                Where::Host(host) => match Query::announce(tuple) {
                    Some(q) => {
                        // The owner takes an IPv6 client address only if
                        // this daemon advertised it: one new since the
                        // last scan is read, and told (before the query,
                        // on the same link), now.
                        if let IpAddr::V6(ip) = tuple.key().client.ip() {
                            if !self.remote.own6.contains(&ip) {
                                self.refresh6(now, true);
                            }
                        }
                        return Ok(self.forward(ctx, tenant, host, q, now));
                    }
                    None => SockReply::No,
                },
                Where::Nowhere => SockReply::No,
            },
            SockRequest::Claim { tuple } => SockReply::from_bool(self.sockets.claim(tenant, tuple, now)),
            SockRequest::Resolve { tuple, give_up } => {
                // Announced at another host: resolved there, by the link
                // it was announced by.
                let there = self.remote.announced.get(&(ctx, tuple.key())).copied();
                match (there, Query::resolve(tuple, give_up)) {
                    (Some((host, link)), Some(q)) => {
                        return Ok(self.forward_by(ctx, tenant, host, Some(link), q, now))
                    }
                    _ => SockReply::Outcome(self.sockets.resolve(ctx, tenant, tuple, give_up, now)),
                }
            }
            SockRequest::Counts => SockReply::Counts(self.sockets.stats(tenant)),
            // Local, as the claim is: the announcement lives at the
            // server's daemon, also for a client of another host.
            SockRequest::Decline { tuple } => SockReply::from_bool(self.sockets.decline(tenant, tuple)),
            // An announcement made at another host's daemon stays its
            // announcing context's (the forwarding is keyed by it).
            SockRequest::Adopt { tuple } => SockReply::from_bool(
                !self.remote.announced.keys().any(|(_, t)| *t == tuple.key())
                    && self.sockets.adopt(ctx, tenant, tuple),
            ),
        };
        Ok(SockCall::Now(reply))
    }

    /// Whose registry answers about `ip`: this daemon's, when the client
    /// found `ip` to be its host's (`local`) or this daemon owns it (then
    /// the client's word on locality stands, as on one host: a client in
    /// another network namespace than the daemon's has loopback and
    /// addresses of its own); else the daemon of the host `ip` names.
    /// An IPv6 address is asked of the daemon that advertised it.
    fn elsewhere(&self, ip: IpAddr, local: bool) -> Where {
        let ip = match ip {
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => v4,
                None => return self.elsewhere6(v6, local),
            },
            IpAddr::V4(v4) => v4,
        };
        // Addresses no host's daemon can own (unspecified, broadcast,
        // multicast) are asked of no other host: this registry answers.
        let nobody = ip.is_unspecified() || ip.is_broadcast() || ip.is_multicast();
        if local || nobody || self.cm.cm.is_local(ip) {
            return Where::Here;
        }
        Where::Host(ip)
    }

    /// [`Self::elsewhere`] of an IPv6 address: this daemon's when the
    /// client found it its host's, when it is one of this host's, or when
    /// no host can own it (loopback, link-local, multicast, unspecified:
    /// the registry answers, no for the link-local ones); the daemon's
    /// that advertised it, when exactly one linked daemon did; nobody's
    /// otherwise (plain TCP: no host's daemon is dialled for an IPv6
    /// address, which names no daemon).
    fn elsewhere6(&self, ip: Ipv6Addr, local: bool) -> Where {
        if local || self.remote.own6.contains(&ip) || !crate::host::is_advertisable(ip) {
            return Where::Here;
        }
        match self.remote.advertiser6(ip) {
            Some(host) => Where::Host(host),
            None => Where::Nowhere,
        }
    }

    /// This host's IPv6 addresses: read now when `force`d (a control
    /// call's; at most once per [`FORCE_GAP`], else as last read) or
    /// never read yet, else as the watch's thread read them every
    /// [`ADDR_SCAN`] (a watch with no thread, or a test's reader: polled
    /// here when that has passed); tells every peer of wire version 4
    /// when they changed, and says whether it did.
    fn refresh6(&mut self, now: Instant, force: bool) -> bool {
        let r = &mut self.remote;
        let first_read = r.watch.is_none();
        let mut addrs = if let Some(w) = r.watch.as_ref() {
            if force {
                w.read_now(r.force_gap.unwrap_or(FORCE_GAP))
            } else {
                if r.polled && r.scanned.is_none_or(|t| now.saturating_since(t) >= ADDR_SCAN) {
                    r.scanned = Some(now);
                    w.poll();
                }
                match w.take() {
                    Some(addrs) => addrs,
                    None => return false,
                }
            }
        } else {
            let read = r.scan6.unwrap_or(crate::host::ipv6_addrs);
            let first = read();
            // (A thread only where there are peers to tell.)
            let thread = match r.scan6.is_none() && self.net.is_some() {
                true => crate::host::Ipv6Watch::spawn(ADDR_SCAN, first.clone()),
                false => None,
            };
            r.polled = thread.is_none();
            r.watch = Some(thread.unwrap_or_else(|| crate::host::Ipv6Watch::unthreaded(read, first.clone())));
            r.scanned = Some(now);
            first
        };
        let max = vrdma_core::sockets::peer::MAX_HOST6;
        if addrs.len() > max && !r.truncated {
            r.truncated = true;
            tracing::warn!(
                found = addrs.len(),
                told = max,
                "this host has more IPv6 addresses than its daemon tells its peers; \
                 connections from other hosts to the others stay plain TCP (said once)"
            );
        }
        addrs.truncate(max);
        let changed = addrs != r.own6;
        if !changed && !first_read {
            return false;
        }
        if changed {
            tracing::debug!(?addrs, "this host's IPv6 addresses changed; telling the linked daemons");
            r.own6 = addrs;
        }
        // The transport keeps the list for the links that come up (told
        // it before anything else), and tells it now where it changed or
        // to the links that came up before this first read.
        let msg = SockMessage::Hosts6 { addrs: Addrs6::new(r.own6.clone()) };
        if let Some(net) = self.net.as_mut() {
            net.set_hosts6(msg, changed);
            net.write_now();
        }
        changed
    }

    /// Sends `query` to `host`'s daemon; the answer comes to the returned
    /// call. Refused at once where it cannot go.
    fn forward(
        &mut self,
        ctx: ContextId,
        tenant: TenantId,
        host: Ipv4Addr,
        query: Query,
        now: Instant,
    ) -> SockCall {
        self.forward_by(ctx, tenant, host, None, query, now)
    }

    /// [`Self::forward`] by `link` when given (refused if it is gone),
    /// else by the host's newest link (dialled if need be).
    fn forward_by(
        &mut self,
        ctx: ContextId,
        tenant: TenantId,
        host: Ipv4Addr,
        by: Option<LinkId>,
        query: Query,
        now: Instant,
    ) -> SockCall {
        let refused = SockCall::Now(reply_of(&query, Answer::refusal(&query)));
        // A tenant numbered by this daemon exists on this host only.
        if tenant.is_host_local() || self.remote.waiting.len() >= MAX_WAITING {
            return refused;
        }
        if query.announced().is_some() && self.remote.announced.len() >= MAX_REMOTE_ANNOUNCED {
            return refused;
        }
        if self.net.is_none() {
            return refused;
        }
        let id = self.remote.next_id();
        let Some(net) = self.net.as_mut() else { return refused };
        let msg = SockMessage::Query { id, tenant: tenant.0, ctx: ctx.0, query };
        let sent = match by {
            Some(l) if net.send_sock_on(l, &msg) => Ok(Some(l)),
            Some(_) => Err("the link it was announced by is gone"),
            None => net.send_sock(host, &msg),
        };
        let link = match sent {
            Ok(link) => link,
            Err(why) => {
                tracing::debug!(%host, why, "a socket registry's query cannot reach its host: plain TCP");
                return refused;
            }
        };
        net.write_now();
        let (tx, rx) = mpsc::sync_channel(1);
        self.remote.waiting.insert(id, Waiting { host, link, ctx, tenant, query, since: now, tx });
        SockCall::Wait { rx, query }
    }

    /// What the links brought for the socket registry: other hosts'
    /// queries (answered), answers to this host's (delivered to the
    /// waiting sessions), ended contexts; and hosts that went away.
    pub(super) fn run_sockets(&mut self, now: Instant) {
        let Some(net) = self.net.as_mut() else { return };
        let mut inbox = std::mem::take(&mut self.remote.inbox);
        net.take_sock_in(&mut inbox);
        let down: Vec<(Ipv4Addr, Option<LinkId>)> = net.sock_down.drain(..).collect();
        // Queries held for a dial that went by the link it made: their
        // waits are that link's from now on (another link's end to the
        // same host, before the answer, leaves them waiting).
        for (host, link, id) in net.sock_sent.drain(..) {
            if let Some(w) = self.remote.waiting.get_mut(&id).filter(|w| w.host == host && w.link.is_none()) {
                w.link = Some(link);
            }
        }
        let mut answers = Vec::new();
        for (link, host, msg) in inbox.drain(..) {
            // A link whose peer claims one of this host's own addresses
            // speaks for no client of another host.
            if self.cm.cm.is_local(host) {
                tracing::debug!(%host, "a socket registry's message from a link that claims this host; dropped");
                continue;
            }
            match msg {
                SockMessage::Query { id, tenant, ctx, query } => {
                    let answer = self.answer(host, link, TenantId(tenant), ctx, query, now);
                    answers.push((link, SockMessage::Answer { id, answer }));
                }
                SockMessage::Answer { id, answer } => self.answered(host, link, id, answer),
                SockMessage::Closed { ctx } => self.sockets.forget_remote(host, link.0, Some(ctx)),
                SockMessage::Hosts6 { addrs } => {
                    // Where net.peers or net.allow is configured, a daemon
                    // they do not name is not believed about its host's
                    // addresses (it could draw connections to any).
                    if !self.net.as_ref().is_some_and(|n| n.trusts_hosts6(host)) {
                        tracing::debug!(%host, "IPv6 addresses from a daemon outside net.peers and net.allow; ignored");
                        continue;
                    }
                    // Kept whole: this host's own addresses among them are
                    // filtered out where the list is used, so that one
                    // this host gives up is the peer's from then on.
                    let theirs: Vec<Ipv6Addr> = addrs
                        .as_slice()
                        .iter()
                        .copied()
                        .filter(|a| crate::host::is_advertisable(*a))
                        .collect();
                    tracing::debug!(%host, addrs = ?theirs, "a linked daemon's IPv6 addresses");
                    self.remote.hosts6.insert(link, (host, theirs));
                }
            }
        }
        self.remote.inbox = inbox;
        // This host's IPv6 addresses: all linked peers of version 4 learn
        // them when they changed (the transport tells a link that comes
        // up). Nothing is copied on a pass where they did not: this runs
        // on every pass of the engine.
        self.refresh6(now, false);
        for (host, link) in down {
            // What went by that link goes; another link's to the same
            // host (its daemon restarted) stays.
            let Some(link) = link else {
                // Held for a dial that failed, or for a link that does
                // not speak them (and not sent: those are the link's):
                // those senders' waits end as plain TCP.
                self.remote.abandon(now, |w| w.link.is_none() && w.host == host);
                continue;
            };
            self.sockets.forget_remote(host, link.0, None);
            self.remote.hosts6.remove(&link);
            self.remote.announced.retain(|_, (_, l)| *l != link);
            // Their senders go: the sessions' waits end as plain TCP.
            self.remote.abandon(now, |w| w.link == Some(link));
        }
        // Queries whose answer never came (the sessions stopped waiting).
        let stale = FORWARD_WAIT * 2;
        if self.remote.waiting.values().any(|w| now.saturating_since(w.since) >= stale) {
            self.remote.abandon(now, |w| now.saturating_since(w.since) >= stale);
        }
        let r = &mut self.remote;
        if !r.abandoned.is_empty() && r.abandoned_sweep.is_none_or(|t| now >= t) {
            r.abandoned_sweep = Some(now + Duration::from_secs(1));
            r.abandoned.retain(|_, a| now.saturating_since(a.since) < ABANDONED_FOR);
        }
        if let Some(net) = self.net.as_mut().filter(|_| !answers.is_empty()) {
            for (link, msg) in &answers {
                // Answered on the link the query came by; a link that
                // went since takes the asker's wait with it.
                let _ = net.send_sock_on(*link, msg);
            }
            net.write_now();
        }
    }

    /// Another host's daemon asks about its client `ctx` of `tenant`: this
    /// registry answers as for a client of its own. Tenants map across
    /// hosts as the connection manager maps them: the same number, and
    /// none numbered by its daemon.
    fn answer(
        &mut self,
        host: Ipv4Addr,
        link: LinkId,
        tenant: TenantId,
        ctx: u32,
        query: Query,
        now: Instant,
    ) -> Answer {
        if tenant.is_host_local() {
            return Answer::refusal(&query);
        }
        let owner = Owner::Remote { host, link: link.0, ctx };
        let r = &mut self.sockets;
        match query {
            Query::Lookup { dst } => {
                let local = self.cm.cm.is_local(*dst.ip());
                Answer::from_bool(r.lookup(tenant, dst.into(), local))
            }
            // The client's address must be its daemon's, the one the link
            // names (no NAT between namespaces or hosts): the 4-tuple the
            // server accepts is then the one announced, and a daemon cannot
            // announce for addresses of other hosts.
            Query::Announce { tuple } if *tuple.client.ip() != host => Answer::No,
            Query::Announce { tuple } => {
                let local = self.cm.cm.is_local(*tuple.server.ip());
                Answer::from_bool(r.announce(owner, tenant, tuple.into(), local, now))
            }
            Query::Resolve { tuple, give_up } => {
                Answer::Outcome(r.resolve(owner, tenant, tuple.into(), give_up, now))
            }
            // Loopback, link-local and the like name no address of this
            // host for a client of another (its own `::1` is its own).
            Query::Lookup6 { dst } if !crate::host::is_advertisable(*dst.ip()) => Answer::No,
            Query::Lookup6 { dst } => {
                let local = self.remote.own6.contains(dst.ip());
                Answer::from_bool(r.lookup(tenant, dst.into(), local))
            }
            // The client's address must be one the asking daemon
            // advertised as its host's on this link (and not this host's,
            // nor another daemon's too): as for IPv4, the 4-tuple the
            // server accepts is then the one announced, and a daemon
            // cannot announce for addresses of other hosts.
            Query::Announce6 { tuple }
                if self.remote.own6.contains(tuple.client.ip())
                    || !crate::host::is_advertisable(*tuple.server.ip())
                    || !self.remote.hosts6.get(&link).is_some_and(|(_, a)| a.contains(tuple.client.ip()))
                    || self.remote.advertiser6(*tuple.client.ip()) != Some(host) =>
            {
                Answer::No
            }
            Query::Announce6 { tuple } => {
                let local = self.remote.own6.contains(tuple.server.ip());
                Answer::from_bool(r.announce(owner, tenant, tuple.into(), local, now))
            }
            Query::Resolve6 { tuple, give_up } => {
                Answer::Outcome(r.resolve(owner, tenant, tuple.into(), give_up, now))
            }
        }
    }

    /// The answer to this daemon's query `id` came from `host` by `link`.
    fn answered(&mut self, host: Ipv4Addr, link: LinkId, id: u32, answer: Answer) {
        // Only the host asked answers, by the link asked by (a stale or
        // forged id is dropped).
        let asked = |h: Ipv4Addr, l: Option<LinkId>| h == host && l.is_none_or(|l| l == link);
        if self.remote.waiting.get(&id).is_none_or(|w| !asked(w.host, w.link)) {
            // An announcement whose wait ended before this answer: a yes
            // is given up at once.
            if let Some(a) = self.remote.abandoned.remove(&id) {
                if !asked(a.host, a.link) {
                    self.remote.abandoned.insert(id, a);
                } else if answer == Answer::Yes {
                    self.give_up(link, a.ctx, a.tenant, a.tuple);
                }
            }
            return;
        }
        let Some(w) = self.remote.waiting.remove(&id) else { return };
        // The session may have stopped waiting (its client went on as
        // plain TCP): then no one reads it.
        let delivered = w.tx.try_send(answer).is_ok();
        match (w.query.announced(), w.query.resolved(), answer) {
            (Some(tuple), _, Answer::Yes) if delivered => {
                self.remote.announced.insert((w.ctx, tuple), (host, link));
            }
            (Some(tuple), _, Answer::Yes) => self.give_up(link, w.ctx, w.tenant, tuple),
            (_, Some(_), Answer::Outcome(Outcome::Pending)) => {}
            (_, Some(tuple), _) => {
                self.remote.announced.remove(&(w.ctx, tuple));
            }
            _ => {}
        }
    }

    /// `tuple` was announced (by `link`) after its client stopped waiting:
    /// given up at once, so that the server's claim is refused and both
    /// ends agree on TCP (the answer to this is for no one).
    fn give_up(&mut self, link: LinkId, ctx: ContextId, tenant: TenantId, tuple: Tuple) {
        let Some(query) = Query::resolve(tuple, true) else { return };
        let id = self.remote.next_id();
        let msg = SockMessage::Query { id, tenant: tenant.0, ctx: ctx.0, query };
        if let Some(net) = self.net.as_mut() {
            let _ = net.send_sock_on(link, &msg);
            net.write_now();
        }
    }

    /// `ctx` ended: the hosts it announced at drop what it announced (told
    /// by the links it was announced by).
    pub(super) fn close_remote_sockets(&mut self, ctx: ContextId) {
        let mut links: Vec<LinkId> =
            self.remote.announced.iter().filter(|((c, _), _)| *c == ctx).map(|(_, (_, l))| *l).collect();
        self.remote.announced.retain(|(c, _), _| *c != ctx);
        let now = self.now();
        self.remote.abandon(now, |w| w.ctx == ctx);
        links.sort_unstable();
        links.dedup();
        if let Some(net) = self.net.as_mut().filter(|_| !links.is_empty()) {
            for link in links {
                let _ = net.send_sock_on(link, &SockMessage::Closed { ctx: ctx.0 });
            }
            net.write_now();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{SocketAddrV4, TcpStream};

    use vrdma_core::hca::{Hca, HcaConfig, LinkInfo};
    use vrdma_core::verbs::Gid;
    use vrdma_core::wire::{parse_frame, FrameRepr, HelloRepr, Role, BASE_HEADER_LEN, NONCE_LEN};

    use vrdma_core::sockets::peer::{PeerTuple, PeerTuple6};

    use super::*;
    use crate::net::{LinkIo, Net, Peer};
    use crate::testing::{loopback, setup, Keys};

    const PEER: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);
    const US: TenantId = TenantId(1000);

    fn addr(s: &str) -> SocketAddrV4 {
        s.parse().unwrap()
    }

    /// This daemon at 10.0.0.1 with a link to 10.0.0.2's daemon (its end
    /// returned) of wire version `version`, and a context of tenant 1000.
    fn state(version: u8) -> (EngineState, TcpStream, ContextId) {
        state_with(version, |_| {})
    }

    /// [`state`], its transport's setup changed by `f`.
    fn state_with(
        version: u8,
        f: impl FnOnce(&mut crate::net::NetSetup),
    ) -> (EngineState, TcpStream, ContextId) {
        let mut hca = Hca::new(HcaConfig::for_host([10, 0, 0, 1]), Box::new(Keys(0)));
        let gid = Gid::from_ipv4(PEER.octets());
        let id = hca.link_up(LinkInfo { gid, lid: 2, chunk: 65536, verified: true });
        let mut setup = setup([10, 0, 0, 1], 65536);
        f(&mut setup);
        let mut net = Net::new(std::sync::Arc::new(setup));
        let (ours, theirs) = loopback();
        let mut link = LinkIo::new(id, ours, "10.0.0.2:4791".parse().unwrap(), gid, 9, false).unwrap();
        link.version = version;
        net.links.insert(id, link);
        let ctx = ContextId(1);
        hca.open_context(ctx, US).unwrap();
        let cm = crate::cm::CmDriver::new(vrdma_core::cm::ConnectionManager::new(
            Default::default(),
            vec![Ipv4Addr::new(10, 0, 0, 1)],
            Box::new(Keys(7)),
        ));
        let mut s = EngineState::new(hca, Some(net), cm, 100);
        // This host has no IPv6 address unless a test says so.
        s.remote.scan6 = Some(Vec::new);
        (s, theirs, ctx)
    }

    /// The next Sock frame's message the peer's end reads (keepalives
    /// skipped).
    fn read_msg(theirs: &mut TcpStream) -> SockMessage {
        theirs.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        for _ in 0..100 {
            let mut head = [0u8; BASE_HEADER_LEN];
            theirs.read_exact(&mut head).unwrap();
            let hl = u16::from_be_bytes([head[6], head[7]]) as usize;
            let len = u32::from_be_bytes([head[8], head[9], head[10], head[11]]) as usize;
            let mut frame = head.to_vec();
            frame.resize(hl.max(BASE_HEADER_LEN) + len, 0);
            theirs.read_exact(&mut frame[BASE_HEADER_LEN..]).unwrap();
            match parse_frame(&frame).unwrap() {
                (FrameRepr::Sock { .. }, payload) => return vrdma_core::wire::sock::decode(payload).unwrap(),
                (FrameRepr::Keepalive(_), _) => continue,
                (f, _) => panic!("{f:?}"),
            }
        }
        panic!("no Sock frame in 100");
    }

    /// The links' next pass: what the peers sent is read.
    fn receive(s: &mut EngineState) -> Result<bool, String> {
        let now = s.now();
        let net = s.net.as_mut().unwrap();
        if net.links.is_empty() {
            return Err("no link".into());
        }
        let mut any = false;
        for l in net.links.values_mut() {
            any |= l.receive(&mut s.hca, &mut s.rings, now)?;
        }
        Ok(any)
    }

    /// The first link's id (the one [`state`] made).
    fn first_link(s: &EngineState) -> LinkId {
        *s.net.as_ref().unwrap().links.keys().next().unwrap()
    }

    /// A second link to the peer's address, of wire version 4: its
    /// daemon restarted and linked again (its end returned).
    fn second_link(s: &mut EngineState) -> (LinkId, TcpStream) {
        let gid = Gid::from_ipv4(PEER.octets());
        let id = s.hca.link_up(LinkInfo { gid, lid: 2, chunk: 65536, verified: true });
        let (ours, theirs) = loopback();
        let mut link = LinkIo::new(id, ours, "10.0.0.2:4791".parse().unwrap(), gid, 10, false).unwrap();
        link.version = 4;
        s.net.as_mut().unwrap().links.insert(id, link);
        (id, theirs)
    }

    /// A link as [`Net::add`] makes it (a dial's or an accept's): to the
    /// daemon whose Hello says `gid`, of wire version `version`, whose
    /// connection's far end is `from` (the address dialled, or the one the
    /// connection came from); its end returned.
    fn added_link(
        s: &mut EngineState,
        gid: Ipv4Addr,
        from: &str,
        dialled: bool,
        version: u8,
    ) -> (LinkId, TcpStream) {
        let (ours, theirs) = loopback();
        let gid = Gid::from_ipv4(gid.octets());
        let hello = HelloRepr::new(Role::Initiator, 50, gid, 2, [0; NONCE_LEN]);
        let addr: std::net::SocketAddr = from.parse().unwrap();
        let EngineState { hca, net, .. } = s;
        let net = net.as_mut().unwrap();
        let before: Vec<LinkId> = net.links.keys().copied().collect();
        net.add(hca, ours, Peer { hello, chunk: 65536, version }, addr, dialled.then_some(addr));
        net.write_now();
        let id = *net.links.keys().find(|id| !before.contains(id)).expect("the link was added");
        (id, theirs)
    }

    /// The link `id` ends as the transport ends it.
    fn end_link(s: &mut EngineState, host: Ipv4Addr, id: LinkId) {
        let net = s.net.as_mut().unwrap();
        net.links.remove(&id);
        s.hca.link_down(id);
        net.sock_down.push((host, Some(id)));
    }

    /// The peer sends `msg`; the engine runs until it has read it.
    fn send_msg(s: &mut EngineState, theirs: &mut TcpStream, msg: SockMessage) {
        let payload = vrdma_core::wire::sock::encode(&msg);
        let mut frame = vec![0u8; BASE_HEADER_LEN];
        FrameRepr::Sock { len: payload.len() as u32 }.emit(&mut frame).unwrap();
        frame.extend_from_slice(&payload);
        theirs.write_all(&frame).unwrap();
        let started = std::time::Instant::now();
        while started.elapsed() < Duration::from_secs(10) {
            receive(s).unwrap();
            if s.net.as_ref().unwrap().links.values().any(|l| !l.sock_in.is_empty()) {
                break;
            }
        }
        let now = s.now();
        s.run_sockets(now);
    }

    fn wait(call: SockCall) -> (mpsc::Receiver<Answer>, Query) {
        match call {
            SockCall::Wait { rx, query } => (rx, query),
            SockCall::Now(r) => panic!("answered at once: {r:?}"),
        }
    }

    /// A client's calls about the peer's address go to the peer's daemon
    /// and come back with its answers; the announcement's resolve follows
    /// it there, and the context's end is told.
    #[test]
    fn a_clients_calls_about_another_host_are_asked_there() {
        let (mut s, mut theirs, ctx) = state(3);
        let tuple = PeerTuple { client: addr("10.0.0.1:40000"), server: addr("10.0.0.2:5000") };
        let (rx, q) = wait(
            s.handle_sock(ctx, US, SockRequest::Lookup { dst: tuple.server.into(), local: false }).unwrap(),
        );
        let SockMessage::Query { id, tenant, ctx: c, query } = read_msg(&mut theirs) else { panic!() };
        assert_eq!((tenant, c, query), (1000, 1, q));
        // An answer from no query, then the real one.
        send_msg(&mut s, &mut theirs, SockMessage::Answer { id: id + 100, answer: Answer::No });
        assert!(rx.try_recv().is_err());
        send_msg(&mut s, &mut theirs, SockMessage::Answer { id, answer: Answer::Yes });
        assert_eq!(SockCall::Wait { rx, query: q }.reply(), SockReply::Yes);

        let (rx, q) = wait(
            s.handle_sock(ctx, US, SockRequest::Announce { tuple: tuple.into(), local: false }).unwrap(),
        );
        let SockMessage::Query { id, .. } = read_msg(&mut theirs) else { panic!() };
        send_msg(&mut s, &mut theirs, SockMessage::Answer { id, answer: Answer::Yes });
        assert_eq!(SockCall::Wait { rx, query: q }.reply(), SockReply::Yes);
        // The resolve goes where the announcement is.
        let (rx, q) = wait(
            s.handle_sock(ctx, US, SockRequest::Resolve { tuple: tuple.into(), give_up: false }).unwrap(),
        );
        let SockMessage::Query { id, query, .. } = read_msg(&mut theirs) else { panic!() };
        assert_eq!(query, Query::Resolve { tuple, give_up: false });
        send_msg(&mut s, &mut theirs, SockMessage::Answer { id, answer: Answer::Outcome(Outcome::Pending) });
        assert_eq!(SockCall::Wait { rx, query: q }.reply(), SockReply::Outcome(Outcome::Pending));
        // Still there: the context's end tells the peer.
        s.close_remote_sockets(ctx);
        assert_eq!(read_msg(&mut theirs), SockMessage::Closed { ctx: 1 });
        // A host with no link, that is no configured peer and not in
        // net.allow, is not dialled for a connect: plain TCP at once.
        let r = s
            .handle_sock(ctx, US, SockRequest::Lookup { dst: addr("10.0.0.3:5000").into(), local: false })
            .unwrap();
        assert!(matches!(r, SockCall::Now(SockReply::No)));
        // A tenant numbered by this daemon is asked nowhere.
        let local_only = TenantId(TenantId::HOST_LOCAL_BASE + 1);
        let r = s
            .handle_sock(ctx, local_only, SockRequest::Lookup { dst: tuple.server.into(), local: false })
            .unwrap();
        assert!(matches!(r, SockCall::Now(SockReply::No)));
    }

    /// The peer's daemon asks about its clients: this registry answers as
    /// for its own, for the same tenant only, and only for clients at the
    /// peer's own address.
    #[test]
    fn another_hosts_calls_are_answered_by_this_registry() {
        let (mut s, mut theirs, ctx) = state(3);
        s.handle_sock(ctx, US, SockRequest::Listen { addr: addr("0.0.0.0:5000").into() }).unwrap();
        let mut ask = |s: &mut EngineState, id: u32, tenant: TenantId, query: Query| {
            send_msg(s, &mut theirs, SockMessage::Query { id, tenant: tenant.0, ctx: 4, query });
            match read_msg(&mut theirs) {
                SockMessage::Answer { id: got, answer } if got == id => answer,
                other => panic!("{other:?}"),
            }
        };
        let dst = addr("10.0.0.1:5000");
        let tuple = PeerTuple { client: addr("10.0.0.2:40000"), server: dst };
        assert_eq!(ask(&mut s, 1, US, Query::Lookup { dst }), Answer::Yes);
        assert_eq!(ask(&mut s, 2, TenantId(1001), Query::Lookup { dst }), Answer::No, "another tenant");
        let host_local = TenantId(TenantId::HOST_LOCAL_BASE);
        assert_eq!(ask(&mut s, 3, host_local, Query::Lookup { dst }), Answer::No, "a host-local tenant");
        assert_eq!(ask(&mut s, 4, US, Query::Lookup { dst: addr("10.0.0.9:5000") }), Answer::No, "not ours");
        let spoofed = PeerTuple { client: addr("10.0.0.3:40000"), server: dst };
        assert_eq!(
            ask(&mut s, 5, US, Query::Announce { tuple: spoofed }),
            Answer::No,
            "not the peer's address"
        );
        assert_eq!(ask(&mut s, 6, TenantId(1001), Query::Announce { tuple }), Answer::No);
        assert_eq!(ask(&mut s, 7, US, Query::Announce { tuple }), Answer::Yes);
        assert!(matches!(
            s.handle_sock(ctx, US, SockRequest::Claim { tuple: tuple.into() }).unwrap(),
            SockCall::Now(SockReply::Yes)
        ));
        let resolve = Query::Resolve { tuple, give_up: false };
        assert_eq!(ask(&mut s, 8, US, resolve), Answer::Outcome(Outcome::Carried));
        // Closed, and a link that goes down, drop what the peer announced.
        assert_eq!(ask(&mut s, 9, US, Query::Announce { tuple }), Answer::Yes);
        send_msg(&mut s, &mut theirs, SockMessage::Closed { ctx: 4 });
        assert!(matches!(
            s.handle_sock(ctx, US, SockRequest::Claim { tuple: tuple.into() }).unwrap(),
            SockCall::Now(SockReply::No)
        ));
        assert_eq!(s.sockets.stats(US).pending, 0);
    }

    /// An IPv6 destination is answered by this registry when the client
    /// found it local, and is plain TCP at once when no linked daemon
    /// advertised it (here: a link of wire version 3, whose peer cannot):
    /// never asked about at another host. A v4-mapped one is its IPv4
    /// address, asked about as before.
    #[test]
    fn an_ipv6_destination_is_this_hosts_or_plain_tcp() {
        let (mut s, mut theirs, ctx) = state(3);
        let v6 = |a: &str| -> std::net::SocketAddr { a.parse().unwrap() };
        let now = |r: SockCall| match r {
            SockCall::Now(r) => r,
            SockCall::Wait { query, .. } => panic!("asked another host: {query:?}"),
        };
        s.handle_sock(ctx, US, SockRequest::Listen { addr: v6("[::]:5000") }).unwrap();
        let lookup = |dst: &str, local| SockRequest::Lookup { dst: v6(dst), local };
        assert_eq!(now(s.handle_sock(ctx, US, lookup("[::1]:5000", true)).unwrap()), SockReply::Yes);
        assert_eq!(now(s.handle_sock(ctx, US, lookup("[fd00::2]:5000", false)).unwrap()), SockReply::No);
        let far = vrdma_core::sockets::Tuple { client: v6("[fd00::1]:40000"), server: v6("[fd00::2]:5000") };
        let r = s.handle_sock(ctx, US, SockRequest::Announce { tuple: far, local: false }).unwrap();
        assert_eq!(now(r), SockReply::No);
        let r = s.handle_sock(ctx, US, SockRequest::Resolve { tuple: far, give_up: false }).unwrap();
        assert_eq!(now(r), SockReply::Outcome(Outcome::Tcp));
        let near = vrdma_core::sockets::Tuple { client: v6("[::1]:40000"), server: v6("[::1]:5000") };
        let r = s.handle_sock(ctx, US, SockRequest::Announce { tuple: near, local: true }).unwrap();
        assert_eq!(now(r), SockReply::Yes);
        assert_eq!(s.sockets.stats(US).pending, 1);
        // The first message on the link is the v4-mapped destination's
        // lookup: nothing went for the IPv6 ones.
        let (_rx, q) = wait(s.handle_sock(ctx, US, lookup("[::ffff:10.0.0.2]:5000", false)).unwrap());
        assert_eq!(q, Query::Lookup { dst: addr("10.0.0.2:5000") });
        let SockMessage::Query { query, .. } = read_msg(&mut theirs) else { panic!() };
        assert_eq!(query, q);
    }

    fn v6(a: &str) -> std::net::SocketAddr {
        a.parse().unwrap()
    }

    /// A link-local destination is answered here, never asked of another
    /// host: owned with its scope when the client found it its host's,
    /// and nobody's otherwise (another host's link-local address, or one
    /// without a scope).
    #[test]
    fn a_link_local_destination_is_this_hosts_with_its_scope_or_plain_tcp() {
        let (mut s, _theirs, ctx) = state(4);
        let now = |r: SockCall| match r {
            SockCall::Now(r) => r,
            SockCall::Wait { query, .. } => panic!("asked another host: {query:?}"),
        };
        s.handle_sock(ctx, US, SockRequest::Listen { addr: v6("[fe80::1%3]:5000") }).unwrap();
        let lookup = |dst: &str, local| SockRequest::Lookup { dst: v6(dst), local };
        for (dst, local, yes) in [
            ("[fe80::1%3]:5000", true, true),
            ("[fe80::1%4]:5000", true, false),
            ("[fe80::1]:5000", true, false),
            ("[fe80::1%3]:5000", false, false),
            ("[fe80::2%3]:5000", false, false),
        ] {
            let r = now(s.handle_sock(ctx, US, lookup(dst, local)).unwrap());
            assert_eq!(r, SockReply::from_bool(yes), "{dst} local {local}");
        }
        let tuple =
            vrdma_core::sockets::Tuple { client: v6("[fe80::1%3]:40000"), server: v6("[fe80::1%3]:5000") };
        let r = s.handle_sock(ctx, US, SockRequest::Announce { tuple, local: true }).unwrap();
        assert_eq!(now(r), SockReply::Yes);
        // A `[::]` listener owns link-local destinations only when it was
        // registered by a library that names scopes (`SockScoped`).
        s.handle_sock(ctx, US, SockRequest::Listen { addr: v6("[::]:6000") }).unwrap();
        assert_eq!(now(s.handle_sock(ctx, US, lookup("[fe80::1%3]:6000", true)).unwrap()), SockReply::No);
        s.handle_sock_as(ctx, US, SockRequest::Listen { addr: v6("[::]:6000") }, true).unwrap();
        assert_eq!(now(s.handle_sock(ctx, US, lookup("[fe80::1%3]:6000", true)).unwrap()), SockReply::Yes);
        let other =
            vrdma_core::sockets::Tuple { client: v6("[fe80::1%4]:40000"), server: v6("[fe80::1%4]:5000") };
        assert_eq!(now(s.handle_sock(ctx, US, SockRequest::Claim { tuple: other }).unwrap()), SockReply::No);
        assert_eq!(now(s.handle_sock(ctx, US, SockRequest::Claim { tuple }).unwrap()), SockReply::Yes);
    }

    fn hosts6(addrs: &[&str]) -> SockMessage {
        SockMessage::Hosts6 { addrs: Addrs6::new(addrs.iter().map(|a| a.parse().unwrap()).collect()) }
    }

    /// An IPv6 destination that the peer's daemon advertised is asked of
    /// it in the IPv6 kinds, as an IPv4 one is: the lookup, the
    /// announcement and its resolve go there; one nobody advertised, one
    /// that two daemons claim, and a link-local one stay plain TCP at
    /// once; the link's end forgets what the peer advertised.
    #[test]
    fn an_ipv6_destination_is_asked_of_the_daemon_that_advertised_it() {
        let (mut s, mut theirs, ctx) = state(4);
        let now = |r: SockCall| match r {
            SockCall::Now(r) => r,
            SockCall::Wait { query, .. } => panic!("asked another host: {query:?}"),
        };
        let lookup = |dst: &str| SockRequest::Lookup { dst: v6(dst), local: false };
        // Before the advertisement: nobody's.
        assert_eq!(now(s.handle_sock(ctx, US, lookup("[fd00::2]:5000")).unwrap()), SockReply::No);
        send_msg(&mut s, &mut theirs, hosts6(&["fd00::2", "fe80::2", "::1"]));
        let (rx, q) = wait(s.handle_sock(ctx, US, lookup("[fd00::2]:5000")).unwrap());
        assert_eq!(q, Query::Lookup6 { dst: "[fd00::2]:5000".parse().unwrap() });
        let SockMessage::Query { id, tenant, ctx: c, query } = read_msg(&mut theirs) else { panic!() };
        assert_eq!((tenant, c, query), (1000, 1, q));
        send_msg(&mut s, &mut theirs, SockMessage::Answer { id, answer: Answer::Yes });
        assert_eq!(SockCall::Wait { rx, query: q }.reply(), SockReply::Yes);

        let tuple = Tuple { client: v6("[fd00::1]:40000"), server: v6("[fd00::2]:5000") };
        let (rx, q) = wait(s.handle_sock(ctx, US, SockRequest::Announce { tuple, local: false }).unwrap());
        let SockMessage::Query { id, query, .. } = read_msg(&mut theirs) else { panic!() };
        assert_eq!(query, Query::announce(tuple).unwrap());
        assert!(matches!(query, Query::Announce6 { .. }));
        send_msg(&mut s, &mut theirs, SockMessage::Answer { id, answer: Answer::Yes });
        assert_eq!(SockCall::Wait { rx, query: q }.reply(), SockReply::Yes);
        // The resolve follows the announcement there, IPv6 as well.
        let (rx, q) = wait(s.handle_sock(ctx, US, SockRequest::Resolve { tuple, give_up: false }).unwrap());
        let SockMessage::Query { id, query, .. } = read_msg(&mut theirs) else { panic!() };
        assert_eq!(query, Query::Resolve6 { tuple: PeerTuple6::of(tuple).unwrap(), give_up: false });
        send_msg(&mut s, &mut theirs, SockMessage::Answer { id, answer: Answer::Outcome(Outcome::Carried) });
        assert_eq!(SockCall::Wait { rx, query: q }.reply(), SockReply::Outcome(Outcome::Carried));
        assert!(s.remote.announced.is_empty());

        // A link-local client (which only a non-conforming library names
        // with a global server) is not sent there: no at once.
        let odd = Tuple { client: v6("[fe80::1%3]:40001"), server: v6("[fd00::2]:5000") };
        let r = s.handle_sock(ctx, US, SockRequest::Announce { tuple: odd, local: false }).unwrap();
        assert_eq!(now(r), SockReply::No);
        // Addresses nobody advertised, and the ones the peer cannot have
        // (link-local and loopback ones name no other host's).
        for dst in ["[fd00::3]:5000", "[fe80::2]:5000"] {
            assert_eq!(now(s.handle_sock(ctx, US, lookup(dst)).unwrap()), SockReply::No, "{dst}");
        }
        // The peer's next advertisement replaces its last.
        send_msg(&mut s, &mut theirs, hosts6(&["fd00::3"]));
        assert_eq!(now(s.handle_sock(ctx, US, lookup("[fd00::2]:5000")).unwrap()), SockReply::No);
        let _ = wait(s.handle_sock(ctx, US, lookup("[fd00::3]:5000")).unwrap());
        // Claimed by two daemons (here: by this host too, as a daemon
        // of this host would): not asked elsewhere.
        s.remote.hosts6.insert(LinkId(99), (Ipv4Addr::new(10, 0, 0, 3), vec!["fd00::3".parse().unwrap()]));
        assert_eq!(now(s.handle_sock(ctx, US, lookup("[fd00::3]:5000")).unwrap()), SockReply::No);
        // The link's end forgets the peer's addresses.
        let link = first_link(&s);
        s.net.as_mut().unwrap().sock_down.push((PEER, Some(link)));
        let t = s.now();
        s.run_sockets(t);
        assert!(!s.remote.hosts6.contains_key(&link));
    }

    /// A daemon of the peer's address restarted and linked again while its
    /// last link was not yet found dead: when that one goes down, what
    /// the new link brought stays (its IPv6 addresses, what its clients
    /// announced here, IPv4 and IPv6) and so do this daemon's
    /// announcements and queries there by the new link (review: the old
    /// link's end wiped them all, by host, for IPv4 too).
    #[test]
    fn an_old_links_end_leaves_a_restarted_peers_new_link_whole() {
        let (mut s, mut old, ctx) = state(4);
        let old_link = first_link(&s);
        s.handle_sock(ctx, US, SockRequest::Listen { addr: "0.0.0.0:5000".parse().unwrap() }).unwrap();
        s.handle_sock(ctx, US, SockRequest::Listen { addr: v6("[::]:5000") }).unwrap();
        s.remote.own6 = vec!["fd00::1".parse().unwrap()];
        send_msg(&mut s, &mut old, hosts6(&["fd00::2"]));
        let (new_link, mut new) = second_link(&mut s);
        send_msg(&mut s, &mut new, hosts6(&["fd00::2"]));
        // The new daemon's clients announce here, IPv4 and IPv6, by the
        // new link (answered by it).
        let tuple4 = PeerTuple { client: addr("10.0.0.2:40000"), server: addr("10.0.0.1:5000") };
        let tuple6 = PeerTuple6 {
            client: "[fd00::2]:40000".parse().unwrap(),
            server: "[fd00::1]:5000".parse().unwrap(),
        };
        for (id, query) in [(1, Query::Announce { tuple: tuple4 }), (2, Query::Announce6 { tuple: tuple6 })] {
            send_msg(&mut s, &mut new, SockMessage::Query { id, tenant: US.0, ctx: 4, query });
            assert_eq!(read_msg(&mut new), SockMessage::Answer { id, answer: Answer::Yes });
        }
        // This daemon's client asks there: by the newest link; and one
        // announcement there is answered.
        let tuple = Tuple { client: v6("[fd00::1]:40001"), server: v6("[fd00::2]:6000") };
        let (rx, q) = wait(s.handle_sock(ctx, US, SockRequest::Announce { tuple, local: false }).unwrap());
        let SockMessage::Query { id, .. } = read_msg(&mut new) else { panic!() };
        send_msg(&mut s, &mut new, SockMessage::Answer { id, answer: Answer::Yes });
        assert_eq!(SockCall::Wait { rx, query: q }.reply(), SockReply::Yes);
        let lookup = SockRequest::Lookup { dst: v6("[fd00::2]:6000"), local: false };
        let (rx, _) = wait(s.handle_sock(ctx, US, lookup).unwrap());
        let SockMessage::Query { id: lookup_id, .. } = read_msg(&mut new) else { panic!() };

        // The old link goes down.
        s.net.as_mut().unwrap().sock_down.push((PEER, Some(old_link)));
        let t = s.now();
        s.run_sockets(t);
        assert!(!s.remote.hosts6.contains_key(&old_link));
        assert_eq!(s.remote.hosts6.get(&new_link).map(|(h, a)| (*h, a.len())), Some((PEER, 1)));
        assert_eq!(s.remote.announced.len(), 1, "this daemon's announcement there stays");
        assert_eq!(s.sockets.stats(US).pending, 2, "the new link's clients' announcements stay");
        for t in [Tuple::from(tuple4), Tuple::from(tuple6)] {
            assert!(matches!(
                s.handle_sock(ctx, US, SockRequest::Claim { tuple: t }).unwrap(),
                SockCall::Now(SockReply::Yes)
            ));
        }
        // The query waiting on the new link is still answered.
        send_msg(&mut s, &mut new, SockMessage::Answer { id: lookup_id, answer: Answer::Yes });
        assert_eq!(rx.try_recv(), Ok(Answer::Yes));
        // And its resolve goes by the link it was announced by.
        let _ = wait(s.handle_sock(ctx, US, SockRequest::Resolve { tuple, give_up: false }).unwrap());
        assert!(matches!(read_msg(&mut new), SockMessage::Query { query: Query::Resolve6 { .. }, .. }));
        // The new link's own end takes the rest.
        s.net.as_mut().unwrap().sock_down.push((PEER, Some(new_link)));
        let t = s.now();
        s.run_sockets(t);
        assert!(s.remote.hosts6.is_empty() && s.remote.announced.is_empty() && s.remote.waiting.is_empty());
    }

    /// A query held for a dial goes by the link the dial made and is that
    /// link's: another link to the same host that comes up and ends
    /// before the answer leaves it waiting, and the answer comes through
    /// (review: any link's end to the host ended it, and the "yes" that
    /// came after found no wait: the client went plain TCP while the
    /// server's daemon kept the announcement for a hello that never came).
    #[test]
    fn a_query_held_for_a_dial_is_the_links_it_went_by() {
        const HOST: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 3);
        let (mut s, _theirs, ctx) = state_with(4, |n| n.peers = vec!["10.0.0.3:4791".parse().unwrap()]);
        let tuple = PeerTuple { client: addr("10.0.0.1:40000"), server: addr("10.0.0.3:5000") };
        let (rx, q) = wait(
            s.handle_sock(ctx, US, SockRequest::Announce { tuple: tuple.into(), local: false }).unwrap(),
        );
        let (_, mut dialled) = added_link(&mut s, HOST, "10.0.0.3:4791", true, 4);
        let SockMessage::Query { id, query, .. } = read_msg(&mut dialled) else { panic!() };
        assert_eq!(query, q);
        // A second link to the host (its daemon dialled too) comes up and
        // ends before the answer.
        let (second, _end) = added_link(&mut s, HOST, "10.0.0.3:40100", false, 4);
        end_link(&mut s, HOST, second);
        let t = s.now();
        s.run_sockets(t);
        send_msg(&mut s, &mut dialled, SockMessage::Answer { id, answer: Answer::Yes });
        assert_eq!(rx.try_recv(), Ok(Answer::Yes), "the announcement's wait ended with the other link");
        assert_eq!(s.remote.announced.len(), 1);
    }

    /// Of the queries held for a dial, the ones the link made takes stay
    /// waiting when one it cannot take (a version-3 link, an IPv6 kind)
    /// ends the rest (review: all of them ended, the sent ones too).
    #[test]
    fn queries_held_for_a_dial_that_went_stay_when_the_rest_cannot() {
        const HOST: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 3);
        let (mut s, _theirs, ctx) = state_with(4, |n| n.peers = vec!["10.0.0.3:4791".parse().unwrap()]);
        // (An address the host advertised by a link since gone: as a
        // test can have it.)
        s.remote.hosts6.insert(LinkId(99), (HOST, vec!["fd00::3".parse().unwrap()]));
        let tuple = PeerTuple { client: addr("10.0.0.1:40000"), server: addr("10.0.0.3:5000") };
        let announce = SockRequest::Announce { tuple: tuple.into(), local: false };
        let (sent, _) = wait(s.handle_sock(ctx, US, announce).unwrap());
        let lookup6 = SockRequest::Lookup { dst: v6("[fd00::3]:5000"), local: false };
        let (unsent, _) = wait(s.handle_sock(ctx, US, lookup6).unwrap());
        let (_, mut dialled) = added_link(&mut s, HOST, "10.0.0.3:4791", true, 3);
        let SockMessage::Query { id, query, .. } = read_msg(&mut dialled) else { panic!() };
        assert!(matches!(query, Query::Announce { .. }));
        let t = s.now();
        s.run_sockets(t);
        assert_eq!(unsent.try_recv(), Err(mpsc::TryRecvError::Disconnected), "the IPv6 one ended");
        send_msg(&mut s, &mut dialled, SockMessage::Answer { id, answer: Answer::Yes });
        assert_eq!(sent.try_recv(), Ok(Answer::Yes), "the sent one ended too");
    }

    /// An announcement whose wait ended before its answer (the context
    /// ended, the wait went stale): a "yes" that comes after is given up
    /// at the owner at once, so that its server's claim is refused
    /// (review: it found no wait, and nothing was given up); the ones
    /// kept are bounded in count and in age.
    #[test]
    fn a_late_yes_to_an_abandoned_announcement_is_given_up() {
        let (mut s, mut theirs, ctx) = state(3);
        let announce = |port: u16| {
            let tuple =
                PeerTuple { client: addr(&format!("10.0.0.1:{port}")), server: addr("10.0.0.2:5000") };
            (tuple, SockRequest::Announce { tuple: tuple.into(), local: false })
        };
        // The context ends while its announcement waits.
        let (tuple, req) = announce(40000);
        let (_rx, _) = wait(s.handle_sock(ctx, US, req).unwrap());
        let SockMessage::Query { id, .. } = read_msg(&mut theirs) else { panic!() };
        s.close_remote_sockets(ctx);
        send_msg(&mut s, &mut theirs, SockMessage::Answer { id, answer: Answer::Yes });
        let SockMessage::Query { query, ctx: c, .. } = read_msg(&mut theirs) else { panic!() };
        assert_eq!((query, c), (Query::Resolve { tuple, give_up: true }, ctx.0));
        // A wait that went stale.
        let (tuple, req) = announce(40001);
        let (_rx, _) = wait(s.handle_sock(ctx, US, req).unwrap());
        let SockMessage::Query { id, .. } = read_msg(&mut theirs) else { panic!() };
        let t = s.now();
        s.run_sockets(t + FORWARD_WAIT * 2);
        assert!(s.remote.waiting.is_empty());
        send_msg(&mut s, &mut theirs, SockMessage::Answer { id, answer: Answer::Yes });
        let SockMessage::Query { query, .. } = read_msg(&mut theirs) else { panic!() };
        assert_eq!(query, Query::Resolve { tuple, give_up: true });
        assert!(s.remote.abandoned.is_empty(), "answered: forgotten");
        // Bounded: at most so many, each for so long.
        for port in 0..MAX_ABANDONED as u16 + 10 {
            let _ = wait(s.handle_sock(ctx, US, announce(10000 + port).1).unwrap());
        }
        s.close_remote_sockets(ctx);
        assert_eq!(s.remote.abandoned.len(), MAX_ABANDONED);
        let t = s.now();
        s.run_sockets(t + ABANDONED_FOR);
        assert!(s.remote.abandoned.is_empty());
    }

    /// A link of version 4 that comes up once this host's IPv6 addresses
    /// were read is told them before anything else it carries: a query
    /// that goes by it at once (it is the host's newest) comes after
    /// (review: they went at the engine's next pass, and an Announce6
    /// ahead of them was refused, its client's address not told yet).
    #[test]
    fn a_link_that_comes_up_hears_this_hosts_addresses_first() {
        let (mut s, mut theirs, ctx) = state(4);
        s.remote.scan6 = Some(|| vec!["fd00::1".parse().unwrap()]);
        let t = s.now();
        s.run_sockets(t);
        assert_eq!(read_msg(&mut theirs), hosts6(&["fd00::1"]));
        send_msg(&mut s, &mut theirs, hosts6(&["fd00::2"]));
        // The peer's daemon restarted and linked again.
        let (_, mut new) = added_link(&mut s, PEER, "10.0.0.2:40100", false, 4);
        let tuple = Tuple { client: v6("[fd00::1]:40000"), server: v6("[fd00::2]:5000") };
        let _ = wait(s.handle_sock(ctx, US, SockRequest::Announce { tuple, local: false }).unwrap());
        assert_eq!(read_msg(&mut new), hosts6(&["fd00::1"]));
        assert!(matches!(read_msg(&mut new), SockMessage::Query { query: Query::Announce6 { .. }, .. }));
    }

    /// A daemon that holds the key, connects from another address and
    /// claims a configured peer's GID speaks for no host: its IPv6
    /// addresses are not believed, its queries are refused at once, and
    /// the host's queries keep going by the host's own link (review: the
    /// Hello's GID alone was looked at, and the newcomer, the host's
    /// newest link, took over its queries).
    #[test]
    fn a_link_from_another_address_than_its_gids_speaks_for_no_host() {
        let (mut s, mut theirs, ctx) = state_with(4, |n| n.peers = vec!["10.0.0.2:4791".parse().unwrap()]);
        s.handle_sock(ctx, US, SockRequest::Listen { addr: addr("0.0.0.0:5000").into() }).unwrap();
        let (_, mut impostor) = added_link(&mut s, PEER, "10.0.0.9:40100", false, 4);
        send_msg(&mut s, &mut impostor, hosts6(&["fd00::2"]));
        let lookup6 = SockRequest::Lookup { dst: v6("[fd00::2]:5000"), local: false };
        assert!(matches!(s.handle_sock(ctx, US, lookup6).unwrap(), SockCall::Now(SockReply::No)));
        let tuple = PeerTuple { client: addr("10.0.0.2:40000"), server: addr("10.0.0.1:5000") };
        let query = Query::Announce { tuple };
        send_msg(&mut s, &mut impostor, SockMessage::Query { id: 7, tenant: US.0, ctx: 4, query });
        s.net.as_mut().unwrap().write_now();
        assert_eq!(read_msg(&mut impostor), hosts6(&[]), "told this host's addresses, as any link");
        assert_eq!(read_msg(&mut impostor), SockMessage::Answer { id: 7, answer: Answer::No });
        assert_eq!(s.sockets.stats(US).pending, 0);
        let lookup = SockRequest::Lookup { dst: addr("10.0.0.2:5000").into(), local: false };
        let (_rx, q) = wait(s.handle_sock(ctx, US, lookup).unwrap());
        let SockMessage::Query { query, .. } = read_msg(&mut theirs) else { panic!() };
        assert_eq!(query, q, "asked by the host's own link");
    }

    /// A peer's list is kept whole: an address that this host had, and
    /// the peer advertised too, is the peer's once this host no longer
    /// has it (review: it was dropped from the peer's list at receipt,
    /// and never learned).
    #[test]
    fn an_address_that_moves_from_this_host_to_a_peer_is_learned() {
        static ADDRS: std::sync::Mutex<Vec<Ipv6Addr>> = std::sync::Mutex::new(Vec::new());
        *ADDRS.lock().unwrap() = vec!["fd00::5".parse().unwrap()];
        let (mut s, mut theirs, ctx) = state(4);
        s.remote.scan6 = Some(|| ADDRS.lock().unwrap().clone());
        let t = s.now();
        s.run_sockets(t);
        assert_eq!(read_msg(&mut theirs), hosts6(&["fd00::5"]));
        send_msg(&mut s, &mut theirs, hosts6(&["fd00::2", "fd00::5"]));
        let lookup = || SockRequest::Lookup { dst: v6("[fd00::5]:5000"), local: false };
        assert!(
            matches!(s.handle_sock(ctx, US, lookup()).unwrap(), SockCall::Now(SockReply::No)),
            "ours, no listener"
        );
        // It moves: this host loses it (at the next scan).
        ADDRS.lock().unwrap().clear();
        s.run_sockets(t + ADDR_SCAN);
        assert_eq!(read_msg(&mut theirs), hosts6(&[]));
        let (_rx, q) = wait(s.handle_sock(ctx, US, lookup()).unwrap());
        assert_eq!(q, Query::Lookup6 { dst: "[fd00::5]:5000".parse().unwrap() });
    }

    /// The owner refuses an IPv6 announcement whose client address
    /// another linked daemon advertises too, as lookups do (review: the
    /// asking daemon's advertisement alone was checked).
    #[test]
    fn an_announcement_from_an_address_two_daemons_claim_is_refused() {
        let (mut s, mut theirs, ctx) = state(4);
        s.remote.scan6 = Some(|| vec!["fd00::1".parse().unwrap()]);
        s.handle_sock(ctx, US, SockRequest::Listen { addr: v6("[::]:5000") }).unwrap();
        assert_eq!(read_msg(&mut theirs), hosts6(&["fd00::1"]));
        send_msg(&mut s, &mut theirs, hosts6(&["fd00::2"]));
        let other = (Ipv4Addr::new(10, 0, 0, 3), vec!["fd00::2".parse().unwrap()]);
        s.remote.hosts6.insert(LinkId(99), other);
        let sa = |a: &str| a.parse::<std::net::SocketAddrV6>().unwrap();
        let tuple = PeerTuple6 { client: sa("[fd00::2]:40000"), server: sa("[fd00::1]:5000") };
        let mut ask = |s: &mut EngineState, id: u32| {
            send_msg(
                s,
                &mut theirs,
                SockMessage::Query { id, tenant: US.0, ctx: 4, query: Query::Announce6 { tuple } },
            );
            let SockMessage::Answer { answer, .. } = read_msg(&mut theirs) else { panic!() };
            answer
        };
        assert_eq!(ask(&mut s, 1), Answer::No, "claimed by two daemons");
        s.remote.hosts6.remove(&LinkId(99));
        assert_eq!(ask(&mut s, 2), Answer::Yes, "by the asker alone");
    }

    /// Where net.peers or net.allow is configured, a daemon they do not
    /// name is not believed about its host's IPv6 addresses; one they
    /// name is; with neither list, any keyed daemon is.
    #[test]
    fn ipv6_addresses_are_believed_from_configured_peers_only() {
        type Setup = fn(&mut crate::net::NetSetup);
        let cases: [(&str, Setup, bool); 5] = [
            ("no list", |_| {}, true),
            ("another peer", |n| n.peers = vec!["10.0.0.3:4791".parse().unwrap()], false),
            ("a peer", |n| n.peers = vec!["10.0.0.2:4791".parse().unwrap()], true),
            ("inside net.allow", |n| n.allow = vec!["10.0.0.0/24".parse().unwrap()], true),
            ("outside net.allow", |n| n.allow = vec!["10.0.1.0/24".parse().unwrap()], false),
        ];
        for (what, f, believed) in cases {
            let (mut s, mut theirs, ctx) = state_with(4, f);
            send_msg(&mut s, &mut theirs, hosts6(&["fd00::2"]));
            let r = s
                .handle_sock(ctx, US, SockRequest::Lookup { dst: v6("[fd00::2]:5000"), local: false })
                .unwrap();
            assert_eq!(matches!(r, SockCall::Wait { .. }), believed, "{what}");
        }
    }

    /// A link of wire version 4 that comes up is told this host's IPv6
    /// addresses, and every such link is told again when they change; a
    /// link of version 3 is told nothing (its decoder would end it).
    #[test]
    fn this_hosts_ipv6_addresses_are_told_to_peers_of_version_four() {
        static ADDRS: std::sync::Mutex<Vec<Ipv6Addr>> = std::sync::Mutex::new(Vec::new());
        let scan: fn() -> Vec<Ipv6Addr> = || ADDRS.lock().unwrap().clone();
        *ADDRS.lock().unwrap() = vec!["fd00::1".parse().unwrap()];
        let (mut s, mut theirs, _) = state(4);
        s.remote.scan6 = Some(scan);
        let link = first_link(&s);
        s.net.as_mut().unwrap().sock6_up.push(link);
        let t = s.now();
        s.run_sockets(t);
        assert_eq!(read_msg(&mut theirs), hosts6(&["fd00::1"]));
        // A new address: told at the next scan.
        ADDRS.lock().unwrap().push("fd00::9".parse().unwrap());
        let later = t + ADDR_SCAN;
        s.run_sockets(later);
        assert_eq!(read_msg(&mut theirs), hosts6(&["fd00::1", "fd00::9"]));
        // A listener of IPv6 reads them at once (forced reads are one per
        // gap: an hour here, so that the next is within it whatever the
        // machine's pace).
        s.remote.force_gap = Some(Duration::from_secs(3600));
        ADDRS.lock().unwrap().remove(0);
        s.handle_sock(ContextId(1), US, SockRequest::Listen { addr: v6("[::]:5000") }).unwrap();
        assert_eq!(read_msg(&mut theirs), hosts6(&["fd00::9"]));
        // An announcement from an address new since the last read, within
        // the gap: served by that read (not read again), the announcement
        // goes alone (its owner will refuse it: plain TCP).
        ADDRS.lock().unwrap().push("fd00::5".parse().unwrap());
        send_msg(&mut s, &mut theirs, hosts6(&["fd00::2"]));
        let tuple = Tuple { client: v6("[fd00::5]:40000"), server: v6("[fd00::2]:5000") };
        let _ = wait(s.handle_sock(ContextId(1), US, SockRequest::Announce { tuple, local: false }).unwrap());
        assert!(matches!(read_msg(&mut theirs), SockMessage::Query { query: Query::Announce6 { .. }, .. }));
        assert_eq!(s.remote.own6, vec!["fd00::9".parse::<Ipv6Addr>().unwrap()]);
        // Past the gap (none now): the forced read is made, the addresses
        // go first (the owner takes the client's address only if it was
        // told it), then the announcement.
        s.remote.force_gap = Some(Duration::ZERO);
        let tuple = Tuple { client: v6("[fd00::5]:40001"), server: v6("[fd00::2]:5000") };
        let _ = wait(s.handle_sock(ContextId(1), US, SockRequest::Announce { tuple, local: false }).unwrap());
        assert_eq!(read_msg(&mut theirs), hosts6(&["fd00::9", "fd00::5"]));
        assert!(matches!(read_msg(&mut theirs), SockMessage::Query { query: Query::Announce6 { .. }, .. }));

        // A peer of version 3: nothing (its next frame is a keepalive's
        // or an IPv4 query's, here the query).
        let (mut s, mut theirs, ctx) = state(3);
        s.remote.scan6 = Some(scan);
        let t = s.now();
        s.run_sockets(t);
        assert_eq!(s.remote.own6, ADDRS.lock().unwrap().clone());
        let _ = wait(
            s.handle_sock(ctx, US, SockRequest::Lookup { dst: addr("10.0.0.2:5000").into(), local: false })
                .unwrap(),
        );
        assert!(matches!(read_msg(&mut theirs), SockMessage::Query { query: Query::Lookup { .. }, .. }));
    }

    /// The peer's daemon asks about IPv6 destinations and its clients'
    /// IPv6 tuples: answered as for IPv4, an announcement taken only for
    /// a client address the peer advertised (not this host's, not one it
    /// did not advertise).
    #[test]
    fn another_hosts_ipv6_calls_are_answered_for_the_addresses_it_advertised() {
        let (mut s, mut theirs, ctx) = state(4);
        s.remote.scan6 = Some(|| vec!["fd00::1".parse().unwrap()]);
        s.handle_sock(ctx, US, SockRequest::Listen { addr: v6("[::]:5000") }).unwrap();
        assert_eq!(read_msg(&mut theirs), hosts6(&["fd00::1"]));
        send_msg(&mut s, &mut theirs, hosts6(&["fd00::2"]));
        let mut ask = |s: &mut EngineState, id: u32, query: Query| {
            send_msg(s, &mut theirs, SockMessage::Query { id, tenant: US.0, ctx: 4, query });
            match read_msg(&mut theirs) {
                SockMessage::Answer { id: got, answer } if got == id => answer,
                other => panic!("{other:?}"),
            }
        };
        let sa = |a: &str| a.parse::<std::net::SocketAddrV6>().unwrap();
        let dst = sa("[fd00::1]:5000");
        assert_eq!(ask(&mut s, 1, Query::Lookup6 { dst }), Answer::Yes, "this host's, on [::]");
        assert_eq!(ask(&mut s, 2, Query::Lookup6 { dst: sa("[fd00::7]:5000") }), Answer::No, "not ours");
        // Loopback and link-local name no address of this host for a
        // client of another: "not ours", whatever listens here (a
        // listener on [::1] answered yes).
        s.handle_sock(ctx, US, SockRequest::Listen { addr: v6("[::1]:5001") }).unwrap();
        for (id, dst) in [(20, "[::1]:5000"), (21, "[::1]:5001"), (22, "[fe80::1]:5000")] {
            assert_eq!(ask(&mut s, id, Query::Lookup6 { dst: sa(dst) }), Answer::No, "{dst}");
        }
        let t = |c: &str| PeerTuple6 { client: sa(c), server: dst };
        for (id, client) in [(3, "[fd00::9]:40000"), (4, "[fd00::1]:40000")] {
            assert_eq!(ask(&mut s, id, Query::Announce6 { tuple: t(client) }), Answer::No, "{client}");
        }
        let tuple = t("[fd00::2]:40000");
        assert_eq!(ask(&mut s, 5, Query::Announce6 { tuple }), Answer::Yes);
        assert!(matches!(
            s.handle_sock(ctx, US, SockRequest::Claim { tuple: tuple.into() }).unwrap(),
            SockCall::Now(SockReply::Yes)
        ));
        let resolve = Query::Resolve6 { tuple, give_up: false };
        assert_eq!(ask(&mut s, 6, resolve), Answer::Outcome(Outcome::Carried));
    }

    /// A peer of version 3 that sends a kind of version 4, or a Sock
    /// payload past version 3's bound, breaks the protocol as its
    /// version's decoder would see it: the link ends.
    #[test]
    fn a_version_three_peer_sending_what_version_four_has_ends_its_link() {
        let long: Vec<&str> = vec!["fd00::2"; 10];
        for (msg, why) in
            [(hosts6(&["fd00::2"]), "message of wire version 4"), (hosts6(&long), "of 162 bytes")]
        {
            let (mut s, mut theirs, _) = state(3);
            let ended = sock_frame_ends_the_link(&mut s, &mut theirs, &msg);
            assert!(ended.contains("protocol error") && ended.contains("wire version 3"), "{ended}");
            assert!(ended.contains(why), "{ended}");
        }
    }

    /// Sends `msg` in a Sock frame from the peer's end, and returns why the
    /// link ended on it (it must, within 10 s).
    fn sock_frame_ends_the_link(s: &mut EngineState, theirs: &mut TcpStream, msg: &SockMessage) -> String {
        let payload = vrdma_core::wire::sock::encode(msg);
        let mut frame = vec![0u8; BASE_HEADER_LEN];
        FrameRepr::Sock { len: payload.len() as u32 }.emit(&mut frame).unwrap();
        frame.extend_from_slice(&payload);
        theirs.write_all(&frame).unwrap();
        let started = std::time::Instant::now();
        loop {
            match receive(s) {
                Err(why) => return why,
                Ok(_) if started.elapsed() < Duration::from_secs(10) => continue,
                Ok(_) => panic!("the link took {msg:?}"),
            }
        }
    }

    /// A peer that speaks wire version 2 gets no Sock frame: the call is
    /// answered plain TCP at once; and one that sends a Sock frame
    /// anyway breaks the protocol (its link ends).
    #[test]
    fn a_version_two_peer_is_never_asked() {
        let (mut s, mut theirs, ctx) = state(2);
        let r = s
            .handle_sock(ctx, US, SockRequest::Lookup { dst: addr("10.0.0.2:5000").into(), local: false })
            .unwrap();
        assert!(matches!(r, SockCall::Now(SockReply::No)));
        let ended = sock_frame_ends_the_link(&mut s, &mut theirs, &SockMessage::Closed { ctx: 1 });
        assert!(ended.contains("protocol error") && ended.contains("wire version 2"), "{ended}");
    }
}
