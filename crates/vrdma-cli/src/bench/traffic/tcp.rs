//! tcp_bw and tcp_lat: plain TCP between the same two hosts, one data
//! connection per stream, for comparison with the RDMA figures.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};

use super::{Clock, Outcome, Side};

/// Socket timeouts: how often a blocked read or write looks at its clock.
const SLICE: Duration = Duration::from_millis(100);
/// How long connecting and accepting the data connections may take.
const CONNECT: Duration = Duration::from_secs(10);

fn prepare(s: &TcpStream) -> Result<()> {
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(SLICE))?;
    s.set_write_timeout(Some(SLICE))?;
    Ok(())
}

/// The client's data connections to the server's listener.
pub fn connect_streams(ip: IpAddr, port: u16, n: u32) -> Result<Vec<TcpStream>> {
    let addr = SocketAddr::new(ip, port);
    (0..n)
        .map(|_| {
            let s = TcpStream::connect_timeout(&addr, CONNECT)
                .with_context(|| format!("opening a data connection to {addr}"))?;
            prepare(&s)?;
            Ok(s)
        })
        .collect()
}

/// The server's side: `n` connections on `listener`, within a bounded time.
pub fn accept_streams(listener: &TcpListener, n: u32) -> Result<Vec<TcpStream>> {
    listener.set_nonblocking(true)?;
    let end = Instant::now() + CONNECT;
    let mut out = Vec::new();
    while out.len() < n as usize {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false)?;
                prepare(&s)?;
                out.push(s);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock && Instant::now() < end => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => bail!("{} of {n} data connections came: {e}", out.len()),
        }
    }
    Ok(out)
}

fn timed_out(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted)
}

/// Fills `buf`; `false` when the peer closed the connection at a message
/// boundary or the server was stopped.
fn read_full(s: &mut TcpStream, buf: &mut [u8], clock: &Clock) -> Result<bool> {
    let (mut got, since) = (0, Instant::now());
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => bail!("the data connection closed mid-message"),
            Ok(n) => got += n,
            Err(e) if timed_out(&e) => {
                if clock.idle(since)? {
                    return Ok(false);
                }
            }
            Err(e) => return Err(e).context("reading the data connection"),
        }
    }
    Ok(true)
}

fn write_full(s: &mut TcpStream, buf: &[u8], clock: &Clock) -> Result<()> {
    let (mut put, since) = (0, Instant::now());
    while put < buf.len() {
        match s.write(&buf[put..]) {
            Ok(0) => bail!("the data connection closed"),
            Ok(n) => put += n,
            Err(e) if timed_out(&e) => {
                if clock.idle(since)? {
                    bail!("stopped while writing");
                }
            }
            Err(e) => return Err(e).context("writing the data connection"),
        }
    }
    Ok(())
}

/// Ping-pong of `size`-byte messages; the client's samples are half the
/// round trip.
pub fn lat(s: &mut TcpStream, size: usize, clock: &Clock) -> Result<Outcome> {
    let mut buf = vec![0u8; size];
    let mut out = Outcome::default();
    let start = Instant::now();
    let mut i = 0u64;
    while clock.go(i)? {
        let t0 = Instant::now();
        if clock.side == Side::Client {
            write_full(s, &buf, clock)?;
            out.sent.add(size as u64);
        }
        if !read_full(s, &mut buf, clock)? {
            if clock.side == Side::Client {
                bail!("the server closed the data connection");
            }
            break;
        }
        out.received.add(size as u64);
        if clock.side == Side::Server {
            write_full(s, &buf, clock)?;
            out.sent.add(size as u64);
        } else {
            out.lat_ns.push(t0.elapsed().as_nanos() as f64 / 2.0);
        }
        i += 1;
    }
    out.seconds = start.elapsed().as_secs_f64();
    out.lat_ns = super::pingpong::warmed(out.lat_ns);
    Ok(out)
}

/// The client writes `size`-byte messages until its clock stops it, then
/// closes its half; the server reads to the end and times from its first
/// byte to the last.
pub fn bw(s: &mut TcpStream, size: usize, clock: &Clock) -> Result<Outcome> {
    let mut buf = vec![0u8; size];
    let mut out = Outcome::default();
    let start = Instant::now();
    if clock.side == Side::Client {
        let mut i = 0u64;
        while clock.go(i)? {
            write_full(s, &buf, clock)?;
            out.sent.add(size as u64);
            i += 1;
        }
        s.shutdown(std::net::Shutdown::Write)?;
        out.seconds = start.elapsed().as_secs_f64();
        return Ok(out);
    }
    let mut first = None;
    let mut since = Instant::now();
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                first.get_or_insert_with(Instant::now);
                out.received.bytes += n as u64;
                since = Instant::now();
            }
            Err(e) if timed_out(&e) => {
                if clock.idle(since)? {
                    break;
                }
            }
            Err(e) => return Err(e).context("reading the data connection"),
        }
    }
    out.received.messages = out.received.bytes / size as u64;
    out.seconds = first.map_or(0.0, |f| f.elapsed().as_secs_f64());
    Ok(out)
}
