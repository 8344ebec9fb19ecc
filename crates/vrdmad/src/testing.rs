//! What the daemon's unit tests share.

use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use vrdma_core::hca::KeySource;
use vrdma_core::verbs::Gid;

use crate::net::{identity, NetSetup};

/// Memory keys from a counter.
pub(crate) struct Keys(pub u32);

impl KeySource for Keys {
    fn next_key(&mut self) -> u32 {
        self.0 += 1;
        self.0
    }
}

/// The transport setup of a daemon at `ip` (listening nowhere real).
pub(crate) fn setup(ip: [u8; 4], max_chunk: u32) -> NetSetup {
    NetSetup {
        identity: identity(1, Gid::from_ipv4(ip), 1, max_chunk, vec![7; 16]),
        listen: "127.0.0.1:0".parse().unwrap(),
        port: 4791,
        peers: Vec::new(),
        allow: Vec::new(),
        keepalive: Duration::from_secs(1),
        dead: Duration::from_secs(3),
    }
}

/// Both ends of a loopback TCP connection: ours, then the peer's.
pub(crate) fn loopback() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let ours = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let theirs = l.accept().unwrap().0;
    (ours, theirs)
}
