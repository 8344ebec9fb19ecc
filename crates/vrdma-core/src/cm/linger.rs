//! A listener's port kept for its tenant a moment after the listener
//! goes, so that a request racing the tenant's next listen on that port
//! waits for it instead of being turned away.
//!
//! Why: perftest's `-R` mode connects twice to one port, the first time
//! to trade its parameters; between the two the server destroys its
//! listener and listens again. With the kernel's CM the client's second
//! request nearly always comes after that (its address and route
//! resolution take longer than the server's new listen), but vRDMA sets a
//! connection up in a few hundred microseconds, and under load the
//! request came up to 23 ms before the new listen. The kernel's answer to
//! a request for a port without a listener is a REJ (reason 8), which
//! Debian's perftest 4.5 does not survive (its retry crashes; fixed
//! upstream later). So a request of the listener's own tenant for a port
//! whose listener that tenant destroyed within [`CmConfig::listen_linger`]
//! is held: a new listener on the port takes it as if it had just come;
//! otherwise, when the time is up, it is refused as it would have been at
//! once. To the requester this is a network that was slow by at most the
//! linger; another tenant's request is refused at once, as for any port
//! without a listener of its own, so nothing leaks.
//!
//! [`CmConfig::listen_linger`]: super::CmConfig::listen_linger

use std::collections::HashMap;
use std::net::Ipv4Addr;

use super::message::CmMessage;
use super::ports::PortSpace;
use crate::hca::{LinkId, TenantId};
use crate::time::Instant;

/// Requests one lingering port holds at most; more are refused at once.
const HELD_PER_PORT: usize = 64;

/// A request held for a lingering port, from `host` by `link`.
struct Held {
    host: Ipv4Addr,
    link: Option<LinkId>,
    req: CmMessage,
}

/// A held request given back: its host, its link and itself.
pub(super) type Given = (Ipv4Addr, Option<LinkId>, CmMessage);

impl Held {
    fn given(self) -> Given {
        (self.host, self.link, self.req)
    }
}

/// Ports whose listener went a moment ago, and the requests they hold.
#[derive(Default)]
pub(super) struct Linger {
    ports: HashMap<(PortSpace, u16), Port>,
}

struct Port {
    tenant: TenantId,
    until: Instant,
    held: Vec<Held>,
}

impl Linger {
    /// `tenant`'s listener on `port` went; the port lingers for it until
    /// `until` (a new linger replaces an old one, whose held requests are
    /// returned to be refused).
    pub fn listener_gone(
        &mut self,
        ps: PortSpace,
        port: u16,
        tenant: TenantId,
        until: Instant,
    ) -> Vec<Given> {
        let old = self.ports.insert((ps, port), Port { tenant, until, held: Vec::new() });
        old.map(|p| p.held.into_iter().map(Held::given).collect()).unwrap_or_default()
    }

    /// Holds `req` (a REQ of `tenant` from `host` by `link`, numbered `from` there)
    /// if `port` lingers for `tenant` and has room; `false`: refuse it.
    /// A request sent again is held once.
    pub fn hold(
        &mut self,
        ps: PortSpace,
        port: u16,
        tenant: TenantId,
        host: Ipv4Addr,
        link: Option<LinkId>,
        req: CmMessage,
    ) -> bool {
        let Some(p) = self.ports.get_mut(&(ps, port)).filter(|p| p.tenant == tenant) else {
            return false;
        };
        let from = req.from();
        if p.held.iter().any(|h| h.host == host && h.link == link && h.req.from() == from) {
            return true;
        }
        if p.held.len() >= HELD_PER_PORT {
            return false;
        }
        p.held.push(Held { host, link, req });
        true
    }

    /// A new listener on `port`: it lingers no more; its held requests,
    /// in the order they came, to be handled now.
    pub fn listening(&mut self, ps: PortSpace, port: u16) -> Vec<Given> {
        let p = self.ports.remove(&(ps, port));
        p.map(|p| p.held.into_iter().map(Held::given).collect()).unwrap_or_default()
    }

    /// Ports whose time is up at `now` linger no more; the requests they
    /// held, to be refused.
    pub fn expire(&mut self, now: Instant) -> Vec<Given> {
        let mut refused = Vec::new();
        self.ports.retain(|_, p| {
            if p.until > now {
                return true;
            }
            refused.extend(p.held.drain(..).map(Held::given));
            false
        });
        refused
    }

    /// The requester gave up (its REJ, by `link`, names it by `from`),
    /// or (`from` `None`) `link` to its host went: its held requests go
    /// (another link's, to the same host, stay).
    pub fn forget(&mut self, host: Ipv4Addr, link: Option<LinkId>, from: Option<u32>) {
        for p in self.ports.values_mut() {
            p.held.retain(|h| h.host != host || h.link != link || from.is_some_and(|f| h.req.from() != f));
        }
    }

    /// When the earliest lingering port's time is up.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.ports.values().map(|p| p.until).min()
    }
}
