//! `vrdma cm-setup` (hidden; `vrdma bench-hosts` runs it): rdma_cm
//! connection setup between two processes, each on its own daemon, beside
//! TCP connect + accept between the same two, in one run.
//!
//! The listener (`--listen ADDR`, in host 1) listens with rdma_cm on
//! ADDR:PORT and with TCP on ADDR:PORT+1, then opens a control port
//! (ADDR:PORT+2) last, so that bench-hosts' wait for that port means all
//! three listen. The client (`--connect ADDR`, in host 2) takes the control
//! connection, runs `vrdma bench --cm-setup`'s loops
//! ([`crate::bench::cm_setup`]) for rdma_cm, then TCP, and prints the first
//! connection's time and the median of the rest for each. The listener
//! sends over the control connection when each connection was established
//! on its side (`CLOCK_MONOTONIC`, which both namespaces share), so that a
//! connection counts until both sides have it, as on one host; the control
//! message is sent after the listener's time is taken and read after the
//! client's, outside what is measured.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};

use crate::bench::cm_setup::{self, CmListener};

#[derive(clap::Args)]
pub struct Args {
    /// Serve one client's connections on this address, then exit.
    #[arg(long, conflicts_with = "connect", required_unless_present = "connect")]
    listen: Option<Ipv4Addr>,
    /// Connect to the listener at this address and print the figures.
    #[arg(long)]
    connect: Option<Ipv4Addr>,
    /// The rdma_cm port; TCP's anchor uses the next, the control connection the one after.
    #[arg(long, default_value_t = 19780)]
    port: u16,
    /// Connections in a row, each way.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
    count: u32,
}

/// The time that says "this connection failed on the listener's side".
const FAILED: u64 = u64::MAX;
/// How long the client waits for the listener's word on one connection.
const WAIT: Duration = Duration::from_secs(20);

pub fn run(socket: Option<PathBuf>, a: Args) -> Result<()> {
    let sock = socket.unwrap_or_else(vrdmad::default_socket_path);
    let n = a.count as usize;
    let (cm_port, tcp_port, ctl_port) = (a.port, a.port.wrapping_add(1), a.port.wrapping_add(2));
    match (a.listen, a.connect) {
        (Some(addr), _) => {
            let cm = CmListener::bind(&sock, SocketAddrV4::new(addr, cm_port), n)?;
            let tcp = TcpListener::bind((addr, tcp_port))
                .with_context(|| format!("listen on {addr}:{tcp_port}"))?;
            let ctl = TcpListener::bind((addr, ctl_port))
                .with_context(|| format!("listen on {addr}:{ctl_port}"))?;
            let (mut ctl, _) = ctl.accept().context("accept the control connection")?;
            ctl.set_nodelay(true)?;
            let mut tell = |r: Result<Duration, String>| {
                let t = match r {
                    Ok(t) => t.as_nanos() as u64,
                    Err(e) => {
                        eprintln!("vrdma cm-setup: {e}");
                        FAILED
                    }
                };
                let _ = ctl.write_all(&t.to_le_bytes());
            };
            cm_setup::serve_rdma_cm(cm, n, &mut tell).context("rdma_cm")?;
            cm_setup::serve_tcp(&tcp, n, &mut tell).context("TCP")?;
            // Until the client has read everything and closed.
            let _ = ctl.read(&mut [0u8; 1]);
            Ok(())
        }
        (None, Some(addr)) => {
            let mut ctl = TcpStream::connect_timeout(&SocketAddrV4::new(addr, ctl_port).into(), WAIT)
                .context("connect to the listener's control port")?;
            ctl.set_nodelay(true)?;
            ctl.set_read_timeout(Some(WAIT))?;
            let mut heard = || -> Result<Duration> {
                let mut b = [0u8; 8];
                ctl.read_exact(&mut b).context("the listener's word on a connection")?;
                match u64::from_le_bytes(b) {
                    FAILED => bail!("the listener failed (its stderr says why)"),
                    ns => Ok(Duration::from_nanos(ns)),
                }
            };
            let cm = cm_setup::connect_rdma_cm(&sock, SocketAddrV4::new(addr, cm_port), n, &mut heard)
                .context("rdma_cm")?;
            let tcp =
                cm_setup::connect_tcp(SocketAddrV4::new(addr, tcp_port), n, &mut heard).context("TCP")?;
            for (name, times) in [("rdma_cm", cm), ("tcp", tcp)] {
                let s = cm_setup::summary(&times);
                println!(
                    "{name} first: {:.3} us, each: {:.3} us",
                    s.first.as_secs_f64() * 1e6,
                    s.each.median / 1e3
                );
            }
            Ok(())
        }
        (None, None) => bail!("give --listen or --connect"),
    }
}

/// The first connection's and each one's (median) setup time in µs, from
/// the client's line `NAME first: X us, each: Y us`.
pub fn parse(out: &str, name: &str) -> Result<(f64, f64)> {
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(" first:"))
        .with_context(|| format!("no \"{name} first:\" line"))?;
    let (first, each) = line.split_once(", each:").context("no \", each:\"")?;
    let num = |s: &str| -> Result<f64> {
        s.trim().strip_suffix("us").context("no \"us\"")?.trim().parse().context("not a number")
    };
    Ok((num(first)?, num(each)?))
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn parses_the_clients_lines() {
        let out = "rdma_cm first: 812.500 us, each: 401.250 us\ntcp first: 95.000 us, each: 30.125 us\n";
        assert_eq!(parse(out, "rdma_cm").unwrap(), (812.5, 401.25));
        assert_eq!(parse(out, "tcp").unwrap(), (95.0, 30.125));
        assert!(parse("nothing", "tcp").is_err());
    }
}
