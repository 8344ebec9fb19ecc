//! A TCP ping-pong that never sleeps: the reference for what TCP itself
//! costs one way on a link, without the wakeups.
//!
//! `qperf tcp_lat` blocks in `recv`, so its figure includes waking a
//! sleeping thread (and, on a VM whose idle CPUs halt, waking the CPU):
//! 11 µs one way on one 2-vCPU VM, 40 µs on another with the same kernel.
//! vRDMA's engines and perftest never sleep during a latency run, so that
//! anchor flatters or punishes vRDMA depending on the machine. This
//! ping-pong polls its non-blocking socket instead, as perftest polls its
//! memory; `vrdma bench-hosts` shows it beside qperf for reference.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};

/// `vrdma tcp-pingpong` (hidden; `vrdma bench-hosts` runs it).
#[derive(clap::Args)]
pub struct Args {
    /// Answer one client on this address, then exit.
    #[arg(long, conflicts_with = "connect", required_unless_present = "connect")]
    listen: Option<SocketAddr>,
    /// Ping the server at this address and print the median one-way time.
    #[arg(long)]
    connect: Option<SocketAddr>,
    /// Round trips measured (after 10 % more for warm-up).
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    iters: u32,
    /// Message size in bytes.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=65536))]
    size: u32,
}

/// How long the whole exchange may take before it counts as hung.
const LIMIT: Duration = Duration::from_secs(60);

pub fn run(a: Args) -> Result<()> {
    let deadline = Instant::now() + LIMIT;
    match (a.listen, a.connect) {
        (Some(addr), _) => {
            let l = TcpListener::bind(addr).with_context(|| format!("listen on {addr}"))?;
            serve(&l, deadline)
        }
        (None, Some(addr)) => {
            let s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
                .with_context(|| format!("connect to {addr}"))?;
            let one_way = ping(s, a.iters, a.size as usize, deadline)?;
            println!("one-way median: {:.3} us", one_way.as_secs_f64() * 1e6);
            Ok(())
        }
        (None, None) => bail!("give --listen or --connect"),
    }
}

/// Accepts one client and echoes what it sends until it closes.
pub fn serve(l: &TcpListener, deadline: Instant) -> Result<()> {
    l.set_nonblocking(true)?;
    let s = loop {
        match l.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    bail!("no client within {} s", LIMIT.as_secs());
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(e).context("accept"),
        }
    };
    prepare(&s)?;
    let mut buf = vec![0u8; 65536];
    loop {
        let n = match spin_read(&s, &mut buf, deadline) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) => return Err(e),
        };
        spin_write_all(&s, &buf[..n], deadline)?;
    }
}

/// `iters` timed round trips of `size` bytes (after a warm-up); each
/// answer must be the bytes sent. Returns the median of round trip / 2.
pub fn ping(s: TcpStream, iters: u32, size: usize, deadline: Instant) -> Result<Duration> {
    prepare(&s)?;
    let warmup = (iters / 10).max(1);
    let mut msg = vec![0u8; size];
    let mut back = vec![0u8; size];
    let mut samples = Vec::with_capacity(iters as usize);
    for i in 0..warmup + iters {
        msg.fill((i % 251) as u8);
        let t = Instant::now();
        spin_write_all(&s, &msg, deadline)?;
        let mut got = 0;
        while got < size {
            match spin_read(&s, &mut back[got..], deadline)? {
                0 => bail!("the server closed the connection"),
                n => got += n,
            }
        }
        let rtt = t.elapsed();
        if back != msg {
            bail!("round trip {i}: the answer differs from what was sent");
        }
        if i >= warmup {
            samples.push(rtt / 2);
        }
    }
    samples.sort();
    Ok(samples[samples.len() / 2])
}

fn prepare(s: &TcpStream) -> Result<()> {
    s.set_nodelay(true)?;
    s.set_nonblocking(true)?;
    Ok(())
}

/// Reads what is there, polling until something is (0: closed).
fn spin_read(mut s: &TcpStream, buf: &mut [u8], deadline: Instant) -> Result<usize> {
    loop {
        match s.read(buf) {
            Ok(n) => return Ok(n),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                if Instant::now() > deadline {
                    bail!("no answer within {} s", LIMIT.as_secs());
                }
                std::hint::spin_loop();
            }
            Err(e) => return Err(e).context("read"),
        }
    }
}

fn spin_write_all(mut s: &TcpStream, mut buf: &[u8], deadline: Instant) -> Result<()> {
    while !buf.is_empty() {
        match s.write(buf) {
            Ok(n) => buf = &buf[n..],
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                if Instant::now() > deadline {
                    bail!("the socket took nothing for {} s", LIMIT.as_secs());
                }
                std::hint::spin_loop();
            }
            Err(e) => return Err(e).context("write"),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ping_pong_on_loopback_echoes_and_times() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let server = std::thread::spawn(move || serve(&l, deadline));
        let one_way = ping(TcpStream::connect(addr).unwrap(), 200, 100, deadline).unwrap();
        assert!(one_way > Duration::ZERO && one_way < Duration::from_secs(1), "{one_way:?}");
        server.join().unwrap().unwrap();
    }

    #[test]
    fn a_server_that_answers_wrong_bytes_is_caught() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut b = [0u8; 8];
            s.read_exact(&mut b).unwrap();
            s.write_all(&[0xee; 8]).unwrap();
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        let e = ping(TcpStream::connect(addr).unwrap(), 10, 8, deadline).unwrap_err();
        assert!(e.to_string().contains("differs"), "{e:#}");
        server.join().unwrap();
    }
}
