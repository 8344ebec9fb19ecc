//! The socket registry through a real daemon (`docs/sockets.md`), and the
//! preload library `libvrdma_sockets.so` under unmodified std::net
//! programs: carried over vRDMA between two libraries, plain TCP when
//! either end is not one.

use std::net::SocketAddrV4;

use anyhow::Result;
use vrdma::sockets::{Outcome, Tuple};
use vrdma_it::DaemonProc;

fn addr(s: &str) -> SocketAddrV4 {
    s.parse().unwrap()
}

#[test]
fn the_registry_decides_through_the_daemon() -> Result<()> {
    let _one = vrdma_it::harness::one_at_a_time();
    let d = DaemonProc::start()?;
    let server = d.context()?;
    let client = d.context()?;
    let tuple = Tuple { client: addr("127.0.0.1:41000"), server: addr("127.0.0.1:5999") };
    assert!(!client.sock_lookup(tuple.server, true)?);
    server.sock_listen(addr("0.0.0.0:5999"))?;
    assert!(client.sock_lookup(tuple.server, true)?);
    // Not local: a wildcard listener does not own it.
    assert!(!client.sock_lookup(tuple.server, false)?);
    assert!(client.sock_announce(tuple, true)?);
    assert_eq!(client.sock_resolve(tuple, false)?, Outcome::Pending);
    assert!(server.sock_claim(tuple)?);
    assert_eq!(client.sock_resolve(tuple, false)?, Outcome::Carried);
    // A connection nobody announced is refused: plain TCP.
    let plain = Tuple { client: addr("127.0.0.1:41001"), ..tuple };
    assert!(!server.sock_claim(plain)?);
    // Given up before the claim: TCP for both.
    let late = Tuple { client: addr("127.0.0.1:41002"), ..tuple };
    assert!(client.sock_announce(late, true)?);
    assert_eq!(client.sock_resolve(late, true)?, Outcome::Tcp);
    assert!(!server.sock_claim(late)?);
    let c = client.sock_counts()?;
    assert_eq!((c.listeners, c.announced, c.carried, c.refused_claims, c.abandoned), (1, 2, 1, 2, 1));
    // Port 0 is refused with an error, and the connection lives on.
    assert!(server.sock_listen(addr("0.0.0.0:0")).is_err());
    // The listener goes with its context.
    drop(server);
    vrdma_it::wait_until(std::time::Duration::from_secs(10), "listener gone", || {
        client.sock_lookup(tuple.server, true).ok() == Some(false)
    })?;
    Ok(())
}
