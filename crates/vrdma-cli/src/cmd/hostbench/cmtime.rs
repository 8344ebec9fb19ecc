//! bench-hosts' rows for an unmodified C program: rdma-core's own `cmtime`
//! (Debian's `rdmacm-utils`) between the two hosts, through the drop-in
//! `librdmacm.so.1` and `libibverbs.so.1`, beside TCP in cmtime's phases
//! on the same veth pair in the same run.
//!
//! What the rows read is what `vrdma bench --cm-setup` reads on one host
//! ([`crate::bench::cmtime`] says what cmtime counts): the sum of its
//! first five steps (create id to the client's `ESTABLISHED`) per
//! connection for `-c 1` and for `-c N`, and the connect step alone for
//! `-c N`. Here cmtime's server (`cmtime -b ADDR`) runs in host 1's
//! namespace on host 1's daemon, its client (`cmtime -s ADDR -c N`) in
//! host 2's on host 2's, so every connection crosses the daemons' link.
//! The anchor is TCP in the same phases across the same pair: `vrdma
//! tcp-phases --listen` in host 1, `--connect` in host 2
//! ([`super::tcp_phases`]).
//!
//! cmtime 44's server outlives only its first client (see
//! [`crate::bench::cmtime`]), so each client run gets a fresh server,
//! stopped by pid after it. rdma_cm listeners show in no socket table:
//! the client starts once host 1's daemon says the server listens
//! ([`vrdma::cm::is_listening`], bounded), and a client turned away anyway
//! (`REJECTED`, `UNREACHABLE`) runs again with a new server, at most
//! [`TRIES`] times. Its table is read strictly
//! ([`crate::bench::cmtime_table`]): a failed connection or an unknown
//! table is an error, not a figure.

use std::net::SocketAddrV4;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use vrdma::cm::PortSpace;

use super::hosts::Hosts;
use crate::bench::cmtime_table::{self, Table, SETUP};

/// The program, on `PATH`.
pub const PROGRAM: &str = "cmtime";

/// Client runs per table, the first included, while turned away.
const TRIES: usize = 3;
/// How long a client run may take before it counts as hung (cmtime's own
/// timeouts are 2 s a step).
const LIMIT: Duration = Duration::from_secs(60);
/// How long the TCP listener, which exits after its last accept, may take
/// to do so once the client is done.
const GRACE: Duration = Duration::from_secs(5);

/// Ports in host 1: the rdma_cm servers' on its daemon and the TCP
/// listeners' in its namespace; a new one per server, so that nothing of
/// the one before is in the way.
static PORT: AtomicU16 = AtomicU16::new(20_000);

fn next_port() -> u16 {
    PORT.fetch_add(1, Ordering::Relaxed)
}

/// One run's three figures, each (cmtime, TCP) in µs per connection:
/// `-c 1`'s five steps; `-c n`'s five steps; `-c n`'s connect step beside
/// TCP's connect phase alone.
pub fn measure(h: &mut Hosts, n: usize) -> Result<[(f64, f64); 3]> {
    let one = table(h, 1)?;
    let [sockets_1, connect_1] = tcp(h, 1)?;
    let many = table(h, n)?;
    let [sockets_n, connect_n] = tcp(h, n)?;
    Ok([
        (one.us_per_conn(&SETUP), (sockets_1 + connect_1) / 1e3),
        (many.us_per_conn(&SETUP), (sockets_n + connect_n) / 1e3),
        (many.us_per_conn(&["connect"]), connect_n / 1e3),
    ])
}

/// cmtime's table for `n` connections from host 2 to a fresh server in
/// host 1, tried again while turned away.
fn table(h: &mut Hosts, n: usize) -> Result<Table> {
    let ctx = vrdma::Context::open_at(&h.hosts[0].socket).context("opening a context on host 1's daemon")?;
    let addr = h.hosts[0].addr;
    let a = addr.to_string();
    for attempt in 1..=TRIES {
        let port = next_port();
        let at = SocketAddrV4::new(addr, port);
        let p = port.to_string();
        let mut listens = || Ok(vrdma::cm::is_listening(&ctx, PortSpace::Tcp, at)?);
        h.server_when(
            PROGRAM,
            &["-b", &a, "-p", &p],
            true,
            "listening (host 1's daemon says)",
            &mut listens,
        )?;
        let c = n.to_string();
        let (out, _) = client(h, PROGRAM, &["-s", &a, "-p", &p, "-c", &c], true, true)?;
        if cmtime_table::turned_away(&out) && attempt < TRIES {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        return cmtime_table::parse(&out, n).with_context(|| format!("cmtime -c {n} across the hosts"));
    }
    unreachable!("the last try returns")
}

/// TCP in cmtime's phases for `n` connections, host 2 to host 1: per
/// connection in ns, the sockets made and the connects to all connected
/// and accepted.
fn tcp(h: &mut Hosts, n: usize) -> Result<[f64; 2]> {
    let exe = std::env::current_exe().context("where is the vrdma executable")?;
    let exe = exe.to_str().context("the vrdma executable's path is not UTF-8")?.to_string();
    let port = next_port();
    let (at, c) = (format!("{}:{port}", h.hosts[0].addr), n.to_string());
    h.server(&exe, &["tcp-phases", "--listen", &at, "--count", &c], false, port)?;
    let (out, servers) = client(h, &exe, &["tcp-phases", "--connect", &at, "--count", &c], false, false)?;
    let listener = servers.first().map_or("", String::as_str);
    super::tcp_phases::phases(&out, listener, n).context("tcp-phases across the hosts")
}

/// Runs the client in host 2 to completion (bounded), then stops the
/// server: at once where it `serves` until stopped (cmtime's, which must
/// not have ended during the client's run), or once it ended on its own
/// (within [`GRACE`]). The client's output and the server's.
fn client(
    h: &mut Hosts,
    program: &str,
    args: &[&str],
    shim: bool,
    serves: bool,
) -> Result<(String, Vec<String>)> {
    let mut c = h.spawn(1, program, args, shim)?;
    let r = c.wait(LIMIT);
    let serving = h.servers_running();
    let servers = h.stop_servers(if serves { Duration::ZERO } else { GRACE });
    let status = r?;
    if !status.success() {
        h.check_daemons()?;
        bail!("{} failed ({status}){}", c.name, c.tail());
    }
    if serves && !serving {
        bail!("the server exited during {}{}", c.name, c.tail());
    }
    Ok((c.output(), servers))
}
