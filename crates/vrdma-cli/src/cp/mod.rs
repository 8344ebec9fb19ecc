//! `vrdma cp`: a file from one tenant or host to another, the way RDMA
//! applications move bulk data.
//!
//! The receiver registers a window of `slots` segments and tells the
//! sender its address and rkey. The sender reads the file segment by
//! segment into its own registered buffer and RDMA-writes each one, with
//! the segment's sequence number as immediate data, into the next slot of
//! the window; the immediate consumes a receive at the receiver, which is
//! how it learns that the slot is full. Flow control is by credits: the
//! sender starts with one credit per slot and spends one per segment; the
//! receiver returns a credit (a zero-length SEND with immediate) once it
//! has written a slot's bytes to the file. So a file of any size streams
//! through a window of fixed size, and the receiver's memory is never
//! overwritten before it has been read.
//!
//! Integrity is end to end: the sender hashes the file as it reads it
//! (SHA-256), the receiver hashes what it wrote, read back from its disk,
//! and both sides compare.
//!
//! The two sides meet through the connection manager, as RDMA
//! applications do (`rdma_cm`: this is the project's example of it from
//! Rust): the receiver listens on an address and port, the sender's
//! connect carries its offer (size, segment, slots) as private data, the
//! receiver's accept carries the window's address and rkey back, or its
//! reject the reason it will not serve the offer. The checksums are two
//! SENDs over the QP; the sender disconnects at the end. Nothing but
//! vRDMA carries a byte: no socket of its own, no port besides the
//! rdma_cm port.

mod protocol;
mod receiver;
mod sender;

use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use vrdma::cm::{CmEvent, EventChannel, EventKind};

/// The default rdma_cm port of `vrdma cp --recv`.
pub const DEFAULT_PORT: u16 = 19766;
/// How long either side waits for the other before giving up.
const PEER_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Receive one file into OUTPUT (the receiving side), instead of sending.
    #[arg(long, value_name = "OUTPUT", conflicts_with_all = ["source", "dest"])]
    pub recv: Option<PathBuf>,
    /// Where the receiver listens for its sender (an rdma_cm address and
    /// port; 0.0.0.0 takes requests for any of the device's addresses).
    #[arg(long, default_value_t = SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, DEFAULT_PORT))]
    pub listen: SocketAddrV4,
    /// The file to send.
    #[arg(required_unless_present = "recv")]
    pub source: Option<PathBuf>,
    /// The receiver: HOST or HOST:PORT.
    #[arg(required_unless_present = "recv")]
    pub dest: Option<String>,
    /// Bytes per RDMA write (a power of two, 4 KiB to 16 MiB).
    #[arg(long, default_value = "256K", value_parser = parse_size)]
    pub segment: u64,
    /// Bytes of the receiver's registered window (a multiple of the segment).
    #[arg(long, default_value = "4M", value_parser = parse_size)]
    pub window: u64,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

/// `4096`, `64K`, `4M`, `1G` (powers of 1024).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, 'K' | 'k')) => (&s[..i], 1u64 << 10),
        Some((i, 'M' | 'm')) => (&s[..i], 1 << 20),
        Some((i, 'G' | 'g')) => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    let n: u64 = num.parse().map_err(|_| format!("{s:?} is not a size (like 4096, 64K, 4M)"))?;
    n.checked_mul(mult).ok_or_else(|| format!("{s:?} is too large"))
}

pub fn run(socket: Option<PathBuf>, args: Args) -> Result<()> {
    if !args.segment.is_power_of_two() || !(4096..=16 << 20).contains(&args.segment) {
        bail!("--segment must be a power of two from 4K to 16M, not {}", args.segment);
    }
    if args.window < args.segment || !args.window.is_multiple_of(args.segment) || args.window > 1 << 30 {
        bail!("--window must be a multiple of --segment ({}) up to 1G, not {}", args.segment, args.window);
    }
    let slots = (args.window / args.segment) as u32;
    // In a guest, the host's daemon through the VM's ports; else a daemon
    // (started in this process if none runs).
    let (_device, opener) = match crate::embedded::guest(socket.as_deref())? {
        Some(cfg) => (None, crate::embedded::Opener::Guest(cfg)),
        None => {
            let d = crate::embedded::device(socket, vrdmad::EngineConfig::default())?;
            let o = crate::embedded::Opener::Socket(d.socket().to_owned());
            (Some(d), o)
        }
    };
    match (&args.recv, &args.source, &args.dest) {
        (Some(out), _, _) => receiver::run(&opener, out, args.listen, !args.quiet),
        (None, Some(src), Some(dest)) => sender::run(&opener, src, dest, args.segment, slots, !args.quiet),
        _ => bail!("give SOURCE and DEST to send, or --recv OUTPUT to receive"),
    }
}

/// A progress bar on a terminal, nothing elsewhere.
fn progress(total: u64, show: bool, what: &str) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if !show || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total);
    let style = indicatif::ProgressStyle::with_template(
        "{msg} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
    )
    .map(|s| s.progress_chars("=> "));
    if let Ok(s) = style {
        bar.set_style(s);
    }
    bar.set_message(what.to_string());
    bar
}

/// Waits for completions on `cq`, failing if one is in error, the peer
/// disconnects (an event on `ch`), or none comes for [`PEER_TIMEOUT`].
fn poll_some(
    cq: &vrdma::CompletionQueue,
    buf: &mut [vrdma::WorkCompletion],
    ch: &EventChannel,
) -> Result<usize> {
    let end = Instant::now() + PEER_TIMEOUT;
    let n = loop {
        let n = cq.wait(buf, Some(Duration::from_secs(1)))?;
        if n > 0 {
            break n;
        }
        if let Some(ev) = ch.try_get_event()? {
            bail!("the peer went away: {:?} (status {})", ev.kind, ev.status);
        }
        if Instant::now() >= end {
            bail!("no completion for {} s: the peer stopped", PEER_TIMEOUT.as_secs());
        }
    };
    for wc in &buf[..n] {
        if wc.status != vrdma::WcStatus::Success {
            bail!("a transfer failed: {:?} (wr {})", wc.status, wc.wr_id);
        }
    }
    Ok(n)
}

/// The next rdma_cm event, waiting up to [`PEER_TIMEOUT`] for `what`.
fn event(ch: &EventChannel, what: &str) -> Result<CmEvent> {
    match ch.get_event(Some(PEER_TIMEOUT))? {
        Some(ev) => Ok(ev),
        None => bail!("no sign of {what} for {} s", PEER_TIMEOUT.as_secs()),
    }
}

/// The next event, which must be `kind`.
fn expect(ch: &EventChannel, kind: EventKind, what: &str) -> Result<CmEvent> {
    let ev = event(ch, what)?;
    if ev.kind != kind {
        bail!("waiting for {what}: {:?} (status {})", ev.kind, ev.status);
    }
    Ok(ev)
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("4M"), Ok(4 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
    }
}
