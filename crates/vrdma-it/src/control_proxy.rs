//! A library's control connection through a thread of the test, on its
//! way to a real daemon: the test sees each request and its reply, and
//! may hold either (to put another thread's calls, or the daemon's own
//! events, in a chosen place around it) or change the reply (what a
//! daemon with a bug, or an attacker in its place, could send).
//!
//! Why: some orderings of a library's threads against the daemon
//! (a reply read while another thread waits for the connection, an
//! event rung while a fetch is on its way) last microseconds in a real
//! run and cannot be met on purpose otherwise; and the library's checks
//! of what the daemon says need replies the daemon never sends. The
//! proxy is in the test's process, so the daemon sees the same process
//! (its peer credentials) as through a direct connection.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

use anyhow::{Context as _, Result};
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
use vrdma_core::proto::{self, Request};

/// What the proxy shows its hook, in order, for each call.
#[derive(Debug)]
pub enum Seen<'a> {
    /// A request from the library, not yet sent on to the daemon (the
    /// hook may hold it there).
    Request(&'a Request),
    /// The daemon's reply to that request, its encoded bytes (the hook
    /// may hold it, or change it), not yet sent on to the library.
    Reply(&'a Request, &'a mut Vec<u8>),
}

/// A context of the daemon at `socket` whose control connection goes
/// through a thread that shows every request and reply to `hook` (see
/// the module's notes). The thread ends when the library closes its end.
pub fn context_through_proxy(
    socket: &Path,
    hook: impl FnMut(Seen<'_>) + Send + 'static,
) -> Result<vrdma::Context> {
    let daemon =
        rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?;
    rustix::net::connect(&daemon, &SocketAddrUnix::new(socket)?).context("connecting to the daemon")?;
    let (library, ours) = vrdma_shm::seqpacket_pair()?;
    std::thread::spawn(move || {
        if let Err(e) = forward(ours, daemon, hook) {
            eprintln!("control proxy: {e:#}");
        }
    });
    Ok(vrdma::Context::from_socket(library)?)
}

/// Requests from `library` to `daemon`, and each reply back, one call at
/// a time (the daemon answers in order, requests sent ahead included).
fn forward(library: OwnedFd, daemon: OwnedFd, mut hook: impl FnMut(Seen<'_>)) -> Result<()> {
    let mut buf = vec![0u8; proto::MAX_MESSAGE];
    loop {
        let Some((bytes, fds)) = pass(library.as_fd(), &mut buf)? else { return Ok(()) };
        let req = proto::decode_request(&bytes).context("a request the library sent")?;
        hook(Seen::Request(&req));
        send(daemon.as_fd(), &bytes, &fds)?;
        let Some((mut reply, fds)) = pass(daemon.as_fd(), &mut buf)? else { return Ok(()) };
        hook(Seen::Reply(&req, &mut reply));
        send(library.as_fd(), &reply, &fds)?;
    }
}

/// One message off `from`: its bytes and descriptors; `None` once the
/// other end closed.
fn pass(from: BorrowedFd<'_>, buf: &mut [u8]) -> Result<Option<(Vec<u8>, Vec<OwnedFd>)>> {
    let got = vrdma_shm::recv_msg(from, buf, 16)?;
    anyhow::ensure!(!got.truncated, "a message larger than {} bytes", buf.len());
    Ok((got.len > 0).then(|| (buf[..got.len].to_vec(), got.fds)))
}

fn send(to: BorrowedFd<'_>, bytes: &[u8], fds: &[OwnedFd]) -> Result<()> {
    let fds: Vec<BorrowedFd<'_>> = fds.iter().map(|f| f.as_fd()).collect();
    Ok(vrdma_shm::send_msg(to, bytes, &fds)?)
}
