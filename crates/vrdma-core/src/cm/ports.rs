//! The host's port space for rdma_cm, as the kernel keeps it: an id
//! binds an (address, port) in one of rdma_cm's port spaces, a wildcard
//! address overlaps every address, and a listener owns its port for
//! incoming requests. The space belongs to the host, not to a tenant,
//! like TCP's: a port one tenant holds is in use for every other.

use std::collections::HashMap;
use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

/// rdma_cm's port spaces (`enum rdma_port_space`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PortSpace {
    Ipoib,
    Tcp,
    Udp,
    Ib,
}

impl PortSpace {
    pub fn from_raw(ps: u32) -> Option<PortSpace> {
        Some(match ps {
            0x0002 => PortSpace::Ipoib,
            0x0106 => PortSpace::Tcp,
            0x0111 => PortSpace::Udp,
            0x013f => PortSpace::Ib,
            _ => return None,
        })
    }

    pub fn raw(self) -> u32 {
        match self {
            PortSpace::Ipoib => 0x0002,
            PortSpace::Tcp => 0x0106,
            PortSpace::Udp => 0x0111,
            PortSpace::Ib => 0x013f,
        }
    }

    /// Whether its ids use UD QPs (and SIDR instead of REQ/REP/RTU).
    pub fn is_ud(self) -> bool {
        matches!(self, PortSpace::Udp | PortSpace::Ipoib)
    }
}

/// The kernel's default `ip_local_port_range`, where unbound ids get a
/// port when they connect or listen.
pub const EPHEMERAL: std::ops::RangeInclusive<u16> = 32768..=60999;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Binding {
    ip: Ipv4Addr,
    id: u32,
    reuse: bool,
    listening: bool,
}

fn overlap(a: Ipv4Addr, b: Ipv4Addr) -> bool {
    a == b || a.is_unspecified() || b.is_unspecified()
}

/// Why a bind or listen failed: `EADDRINUSE` (or `EADDRNOTAVAIL` when no
/// port is free).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PortError {
    #[error("address already in use")]
    InUse,
    #[error("no free port")]
    Exhausted,
}

#[derive(Debug, Default)]
pub struct Ports {
    bound: HashMap<(PortSpace, u16), Vec<Binding>>,
    next_ephemeral: u16,
}

impl Ports {
    /// Binds `id` to `ip:port` (port 0: a free ephemeral port); returns the
    /// port.
    pub fn bind(
        &mut self,
        ps: PortSpace,
        ip: Ipv4Addr,
        port: u16,
        id: u32,
        reuse: bool,
    ) -> Result<u16, PortError> {
        let port = if port == 0 { self.free_port(ps)? } else { port };
        let list = self.bound.entry((ps, port)).or_default();
        let clash = list.iter().any(|b| overlap(b.ip, ip) && !(b.reuse && reuse && !b.listening));
        if clash {
            return Err(PortError::InUse);
        }
        list.push(Binding { ip, id, reuse, listening: false });
        Ok(port)
    }

    fn free_port(&mut self, ps: PortSpace) -> Result<u16, PortError> {
        let (lo, hi) = (*EPHEMERAL.start(), *EPHEMERAL.end());
        let span = u32::from(hi - lo) + 1;
        for _ in 0..span {
            let p = lo + self.next_ephemeral % (hi - lo + 1);
            self.next_ephemeral = self.next_ephemeral.wrapping_add(1) % (hi - lo + 1);
            if !self.bound.contains_key(&(ps, p)) {
                return Ok(p);
            }
        }
        Err(PortError::Exhausted)
    }

    /// Makes `id`'s binding a listener: no other listener may overlap it.
    pub fn listen(&mut self, ps: PortSpace, port: u16, id: u32) -> Result<(), PortError> {
        let Some(list) = self.bound.get_mut(&(ps, port)) else { return Err(PortError::InUse) };
        let Some(me) = list.iter().position(|b| b.id == id) else { return Err(PortError::InUse) };
        let ip = list[me].ip;
        if list.iter().any(|b| b.id != id && overlap(b.ip, ip) && (b.listening || !b.reuse)) {
            return Err(PortError::InUse);
        }
        list[me].listening = true;
        Ok(())
    }

    /// The listener for a request to `ip:port`: one bound to that address
    /// before one bound to every address.
    pub fn listener(&self, ps: PortSpace, ip: Ipv4Addr, port: u16) -> Option<u32> {
        let list = self.bound.get(&(ps, port))?;
        let listening = || list.iter().filter(|b| b.listening);
        listening().find(|b| b.ip == ip).or_else(|| listening().find(|b| b.ip.is_unspecified())).map(|b| b.id)
    }

    pub fn unbind(&mut self, ps: PortSpace, port: u16, id: u32) {
        if let Some(list) = self.bound.get_mut(&(ps, port)) {
            list.retain(|b| b.id != id);
            if list.is_empty() {
                self.bound.remove(&(ps, port));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ANY: Ipv4Addr = Ipv4Addr::UNSPECIFIED;
    const A: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
    const B: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);

    #[test]
    fn a_port_is_taken_for_overlapping_addresses_only() {
        let mut p = Ports::default();
        assert_eq!(p.bind(PortSpace::Tcp, A, 7000, 1, false), Ok(7000));
        assert_eq!(p.bind(PortSpace::Tcp, A, 7000, 2, false), Err(PortError::InUse));
        assert_eq!(p.bind(PortSpace::Tcp, ANY, 7000, 2, false), Err(PortError::InUse));
        assert_eq!(p.bind(PortSpace::Tcp, B, 7000, 2, false), Ok(7000));
        assert_eq!(p.bind(PortSpace::Udp, A, 7000, 3, false), Ok(7000), "another port space");
        p.unbind(PortSpace::Tcp, 7000, 1);
        assert_eq!(p.bind(PortSpace::Tcp, A, 7000, 4, false), Ok(7000));
    }

    #[test]
    fn reuse_shares_a_port_until_one_listens() {
        let mut p = Ports::default();
        p.bind(PortSpace::Tcp, A, 7000, 1, true).unwrap();
        p.bind(PortSpace::Tcp, A, 7000, 2, true).unwrap();
        assert_eq!(p.listen(PortSpace::Tcp, 7000, 1), Ok(()));
        assert_eq!(p.listen(PortSpace::Tcp, 7000, 2), Err(PortError::InUse));
        assert_eq!(p.bind(PortSpace::Tcp, A, 7000, 3, true), Err(PortError::InUse));
    }

    #[test]
    fn a_request_finds_the_listener_of_its_address_before_the_wildcard() {
        let mut p = Ports::default();
        p.bind(PortSpace::Tcp, ANY, 7000, 1, true).unwrap();
        p.bind(PortSpace::Tcp, B, 7001, 2, false).unwrap();
        p.listen(PortSpace::Tcp, 7000, 1).unwrap();
        p.listen(PortSpace::Tcp, 7001, 2).unwrap();
        assert_eq!(p.listener(PortSpace::Tcp, A, 7000), Some(1));
        assert_eq!(p.listener(PortSpace::Tcp, A, 7001), None);
        assert_eq!(p.listener(PortSpace::Tcp, B, 7001), Some(2));
        assert_eq!(p.listener(PortSpace::Udp, B, 7001), None);
    }

    #[test]
    fn ephemeral_ports_are_distinct_and_in_range() {
        let mut p = Ports::default();
        let a = p.bind(PortSpace::Tcp, A, 0, 1, false).unwrap();
        let b = p.bind(PortSpace::Tcp, A, 0, 2, false).unwrap();
        assert_ne!(a, b);
        assert!(EPHEMERAL.contains(&a) && EPHEMERAL.contains(&b));
    }
}
