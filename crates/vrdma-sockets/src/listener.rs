//! A listening socket registered with the daemon: unregistered when its
//! last descriptor closes.

use std::net::SocketAddr;

pub struct Listener {
    /// The addresses it registered: two for a dual-stack `::` socket
    /// (`0.0.0.0` and `[::]` of its port), else one.
    pub addrs: Vec<SocketAddr>,
    /// The process that registered it.
    pub pid: u32,
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Some(d) = crate::dev::dev() {
            for &a in &self.addrs {
                let _ = d.ctx.sock_unlisten(a);
            }
        }
    }
}
