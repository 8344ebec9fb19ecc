//! A listening socket registered with the daemon: unregistered when its
//! last descriptor closes.

use std::net::SocketAddrV4;

pub struct Listener {
    pub addr: SocketAddrV4,
    /// The process that registered it.
    pub pid: u32,
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Some(d) = crate::dev::dev() {
            let _ = d.ctx.sock_unlisten(self.addr);
        }
    }
}
