//! Three hosts for the migration tests: a tenant moves from A to C while
//! its peer stays on B, so every daemon must be linked to the other two.

use std::time::Instant;

use anyhow::{bail, Result};

use crate::{DaemonProc, NetnsBridge, WAIT};

/// Network namespaces on one bridge where the test may make them (root
/// and iproute2), else three loopback addresses (as `two_hosts.rs`); a
/// daemon on each, peered with the other two, linked. The daemons go
/// first on drop, then the namespaces.
pub struct ThreeHosts {
    pub a: DaemonProc,
    pub b: DaemonProc,
    pub c: DaemonProc,
    /// The hosts' addresses, A's first.
    pub ips: Vec<String>,
    _net: Option<NetnsBridge>,
}

impl ThreeHosts {
    /// Starts the three daemons, `extra[i]` appended to host `i`'s
    /// configuration, and waits (at most [`WAIT`]) until each has both
    /// its links up.
    pub fn start(extra: [&str; 3]) -> Result<ThreeHosts> {
        Self::start_nets(extra, "")
    }

    /// [`start`](Self::start), every daemon's `[net]` table ending with
    /// the lines `net`; a key they set replaces the test default
    /// (`keepalive_ms = 200`, `dead_ms = 1500`).
    pub fn start_nets(extra: [&str; 3], net_lines: &str) -> Result<ThreeHosts> {
        let net = match crate::netns_unavailable() {
            None => NetnsBridge::create(3)
                .map_err(|e| eprintln!("three loopback addresses: namespaces cannot be made here: {e:#}"))
                .ok(),
            Some(why) => {
                eprintln!("three loopback addresses, not namespaces: {why}");
                None
            }
        };
        let (ips, port) = match &net {
            Some(n) => (n.addr.clone(), crate::DEFAULT_WIRE_PORT),
            None => (["127.0.0.2", "127.0.0.3", "127.0.0.4"].map(String::from).to_vec(), crate::free_port()?),
        };
        let start = |i: usize| {
            let peers: Vec<String> =
                (0..3).filter(|&j| j != i).map(|j| format!("{}:{port}", ips[j])).collect();
            let cfg = crate::with_net_lines(crate::host_config(&ips[i], port, &peers, extra[i]), net_lines);
            DaemonProc::start_in(net.as_ref().map(|n| n.ns[i].as_str()), &cfg)
        };
        let h = ThreeHosts { a: start(0)?, b: start(1)?, c: start(2)?, ips, _net: net };
        let end = Instant::now() + WAIT;
        for d in [&h.a, &h.b, &h.c] {
            let ctx = d.context()?;
            while ctx.stat()?.links.iter().filter(|l| l.up).count() < 2 {
                if Instant::now() > end {
                    bail!("the three daemons did not link within {WAIT:?}");
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
        Ok(h)
    }

    /// Whether the hosts are namespaces with cables to cut ([`set_link`](Self::set_link)).
    pub fn has_cables(&self) -> bool {
        self._net.is_some()
    }

    /// Cuts (`up` false) or restores host `i`'s cable (0 A, 1 B, 2 C): its
    /// veth end down or up, its links silent meanwhile. An error where the
    /// hosts are loopback addresses.
    pub fn set_link(&self, i: usize, up: bool) -> Result<()> {
        match &self._net {
            Some(n) => n.set_link(i, up),
            None => bail!("the hosts are loopback addresses: no cable to cut"),
        }
    }

    /// Host `i`'s GID (its address as an IPv4-mapped GID).
    pub fn gid(&self, i: usize) -> vrdma::Gid {
        let ip: std::net::Ipv4Addr = self.ips[i].parse().expect("an address");
        vrdma::Gid::from_ipv4(ip.octets())
    }
}
