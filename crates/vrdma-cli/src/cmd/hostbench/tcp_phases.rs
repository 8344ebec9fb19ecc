//! `vrdma tcp-phases` (hidden; `vrdma bench-hosts` runs it): TCP in
//! cmtime's phases between two hosts, the anchor of the cmtime rows
//! ([`super::cmtime`]).
//!
//! `vrdma bench --cm-setup` times TCP in cmtime's phases within one
//! process on loopback ([`crate::bench::cmtime::tcp_phases`]): N
//! non-blocking sockets made, then their N connects issued together to a
//! listener that accepts them, until all are connected and all accepted.
//! Across hosts the listener (`--listen`, in host 1) and the connecting
//! side (`--connect`, in host 2) are two processes, so each prints its own
//! instants on `CLOCK_MONOTONIC` (which both namespaces share) and
//! bench-hosts puts them together ([`phases`]): the listener exits after
//! its N-th accept, saying when that was.

use std::net::SocketAddrV4;
use std::time::Duration;

use anyhow::{Context as _, Result};

use crate::bench::cmtime::{accept_all, connect_all, tcp_listener, Connected};

#[derive(clap::Args)]
pub struct Args {
    /// Accept this many connections on this address, then exit.
    #[arg(long, conflicts_with = "connect", required_unless_present = "connect")]
    listen: Option<SocketAddrV4>,
    /// Connect this many times to the listener at this address.
    #[arg(long)]
    connect: Option<SocketAddrV4>,
    /// Connections, issued together.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    count: u32,
}

/// How long either side waits for the other: the listener from when it
/// listens (bench-hosts starts the client once it does).
const WAIT: Duration = Duration::from_secs(30);

pub fn run(a: Args) -> Result<()> {
    let n = a.count as usize;
    match (a.listen, a.connect) {
        (Some(at), _) => {
            let l = tcp_listener(at, n)?;
            let never = std::sync::atomic::AtomicBool::new(false);
            let last = accept_all(&l, n, &never, WAIT)?;
            println!("accepted {n}, the last at {} ns", last.as_nanos());
            Ok(())
        }
        (None, Some(at)) => {
            let c = connect_all(at, n, WAIT)?;
            println!(
                "connected {n}: start {} ns, issued {} ns, connected {} ns",
                c.start.as_nanos(),
                c.issued.as_nanos(),
                c.connected.as_nanos()
            );
            Ok(())
        }
        (None, None) => anyhow::bail!("give --listen or --connect"),
    }
}

/// Per connection, in ns, the sockets phase and the connect phase (to
/// all connected and accepted), from the client's line and the listener's,
/// both for `n` connections.
pub fn phases(client: &str, listener: &str, n: usize) -> Result<[f64; 2]> {
    let num = |s: &str| -> Result<u64> {
        s.trim().strip_suffix("ns").context("no \"ns\"")?.trim().parse().context("not a number")
    };
    let prefix = format!("connected {n}: start ");
    let line = client
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .with_context(|| format!("no \"{prefix}\" line in the client's output: {client:?}"))?;
    let (start, rest) = line.split_once(", issued ").context("no \", issued\"")?;
    let (issued, connected) = rest.split_once(", connected ").context("no \", connected\"")?;
    let prefix = format!("accepted {n}, the last at ");
    let accepted = listener
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .with_context(|| format!("no \"{prefix}\" line in the listener's output: {listener:?}"))?;
    let [start, issued, connected, accepted] =
        [num(start)?, num(issued)?, num(connected)?, num(accepted)?].map(Duration::from_nanos);
    anyhow::ensure!(
        start <= issued && issued <= connected && issued <= accepted,
        "instants out of order: start {start:?}, issued {issued:?}, connected {connected:?}, accepted {accepted:?}"
    );
    let c = Connected { start, issued, connected, socks: Vec::new() };
    Ok(c.per_conn_of(n, accepted))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn puts_the_two_sides_lines_together() {
        let client = "connected 4: start 1000 ns, issued 1400 ns, connected 2000 ns\n";
        // The listener's last accept after the client's last connect.
        let [sockets, connect] = phases(client, "accepted 4, the last at 2400 ns\n", 4).unwrap();
        assert_eq!((sockets, connect), (100.0, 250.0));
        // Or before it: the client's end counts.
        let [_, connect] = phases(client, "accepted 4, the last at 1900 ns\n", 4).unwrap();
        assert_eq!(connect, 150.0);
        // Another count, a missing line, instants out of order.
        assert!(phases(client, "accepted 4, the last at 2400 ns\n", 5).is_err());
        assert!(phases(client, "", 4).is_err());
        assert!(phases(client, "accepted 4, the last at 900 ns\n", 4).is_err());
        assert!(phases("connected 4: start 1000 ns, issued 1400\n", "accepted 4, the last at 2400 ns\n", 4)
            .is_err());
    }
}
