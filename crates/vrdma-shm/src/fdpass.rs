//! Messages with file descriptors over a `SOCK_SEQPACKET` Unix socket.
//!
//! The control protocol sends one message per `sendmsg`; seqpacket keeps
//! the boundaries and delivers the descriptors attached to a message with
//! exactly that message. Received descriptors are close-on-exec from the
//! moment they exist (`MSG_CMSG_CLOEXEC`), and any the caller did not make
//! room for are closed, never leaked.

use std::io;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};

use rustix::io::Errno;
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
};

/// Most descriptors one message may carry (the kernel's `SCM_MAX_FD`).
pub const MAX_FDS_PER_MSG: usize = 253;

/// One message read by [`recv_msg`].
#[derive(Debug)]
pub struct Received {
    /// Bytes stored at the start of the buffer; 0 means the peer closed
    /// the connection (or sent an empty message, which the protocol never
    /// does).
    pub len: usize,
    /// The descriptors that came with it, close-on-exec.
    pub fds: Vec<OwnedFd>,
    /// The message or its descriptors did not fit (`MSG_TRUNC`,
    /// `MSG_CTRUNC`, or more descriptors than asked for): the rest is
    /// lost and the message should be treated as malformed.
    pub truncated: bool,
}

/// Credentials of the process at the other end of a Unix socket, as the
/// kernel recorded them at `connect`/`socketpair` time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
}

/// Sends `bytes` as one message with `fds` attached.
///
/// Never raises `SIGPIPE`: a closed peer is reported as `BrokenPipe`.
pub fn send_msg(sock: BorrowedFd<'_>, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if fds.len() > MAX_FDS_PER_MSG {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "too many descriptors in one message"));
    }
    let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other("control buffer too small for descriptors"));
    }
    let iov = [IoSlice::new(bytes)];
    let sent = loop {
        match rustix::net::sendmsg(sock, &iov, &mut control, SendFlags::NOSIGNAL) {
            Err(Errno::INTR) => continue,
            other => break other?,
        }
    };
    if sent != bytes.len() {
        return Err(io::Error::new(io::ErrorKind::WriteZero, "message sent in part"));
    }
    Ok(())
}

/// Receives one message into `buf`, accepting up to `max_fds` descriptors.
pub fn recv_msg(sock: BorrowedFd<'_>, buf: &mut [u8], max_fds: usize) -> io::Result<Received> {
    let max_fds = max_fds.min(MAX_FDS_PER_MSG);
    let space_len = if max_fds == 0 { 0 } else { rustix::cmsg_space!(ScmRights(max_fds)) };
    let mut space = vec![MaybeUninit::<u8>::uninit(); space_len];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let buf_len = buf.len();
    let mut iov = [IoSliceMut::new(buf)];
    let msg = loop {
        match rustix::net::recvmsg(sock, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC) {
            Err(Errno::INTR) => continue,
            other => break other?,
        }
    };
    let mut truncated = msg.flags.intersects(ReturnFlags::TRUNC | ReturnFlags::CTRUNC);
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = m {
            for fd in received {
                if fds.len() < max_fds {
                    fds.push(fd);
                } else {
                    // Room in the cmsg padding let an extra one in; close it.
                    truncated = true;
                }
            }
        }
    }
    Ok(Received { len: msg.bytes.min(buf_len), fds, truncated })
}

/// The peer's pid, uid and gid (`SO_PEERCRED`).
pub fn peer_credentials(sock: BorrowedFd<'_>) -> io::Result<PeerCred> {
    let cred = rustix::net::sockopt::socket_peercred(sock)?;
    Ok(PeerCred { pid: cred.pid.as_raw_pid(), uid: cred.uid.as_raw(), gid: cred.gid.as_raw() })
}

/// A connected pair of close-on-exec `SOCK_SEQPACKET` Unix sockets.
pub fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    Ok(rustix::net::socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::segment::{Mapping, Segment};
    use std::os::fd::AsFd;

    #[test]
    fn plain_message() {
        let (a, b) = seqpacket_pair().unwrap();
        send_msg(a.as_fd(), b"ping", &[]).unwrap();
        let mut buf = [0u8; 64];
        let r = recv_msg(b.as_fd(), &mut buf, 4).unwrap();
        assert_eq!(r.len, 4);
        assert_eq!(&buf[..4], b"ping");
        assert!(r.fds.is_empty());
        assert!(!r.truncated);
    }

    #[test]
    fn memfd_travels_and_maps() {
        let (a, b) = seqpacket_pair().unwrap();
        let seg = Segment::create("vrdma-fdpass", 4096).unwrap();
        let (db, theirs) = crate::Doorbell::pair().unwrap();
        send_msg(a.as_fd(), b"mr", &[seg.fd(), theirs.as_fd()]).unwrap();

        let mut buf = [0u8; 16];
        let mut r = recv_msg(b.as_fd(), &mut buf, 2).unwrap();
        assert_eq!((r.len, r.fds.len(), r.truncated), (2, 2, false));
        for fd in &r.fds {
            let fl = rustix::io::fcntl_getfd(fd).unwrap();
            assert!(fl.contains(rustix::io::FdFlags::CLOEXEC));
        }
        let db_fd = r.fds.pop().unwrap();
        let seg_fd = r.fds.pop().unwrap();
        let peer = Mapping::map_untrusted(seg_fd, 0, 4096).unwrap();
        // SAFETY: offset 100 is inside both 4096-byte mappings.
        unsafe {
            seg.as_ptr().add(100).write_volatile(0x5a);
            assert_eq!(peer.as_ptr().add(100).read_volatile(), 0x5a);
        }
        let peer_db = crate::Doorbell::from_fd(db_fd);
        peer_db.ring();
        assert_eq!(db.drain(), 1);
    }

    #[test]
    fn peer_credentials_are_ours() {
        let (a, _b) = seqpacket_pair().unwrap();
        let c = peer_credentials(a.as_fd()).unwrap();
        assert_eq!(c.pid, rustix::process::getpid().as_raw_pid());
        assert_eq!(c.uid, rustix::process::getuid().as_raw());
        assert_eq!(c.gid, rustix::process::getgid().as_raw());
    }

    #[test]
    fn truncation_detected() {
        let (a, b) = seqpacket_pair().unwrap();
        send_msg(a.as_fd(), b"0123456789", &[]).unwrap();
        let mut small = [0u8; 4];
        let r = recv_msg(b.as_fd(), &mut small, 0).unwrap();
        assert!(r.truncated);
        assert_eq!(r.len, 4);
        assert_eq!(&small, b"0123");

        // Too many descriptors: some are dropped (and closed), flagged.
        let d: Vec<_> = (0..4).map(|_| crate::Doorbell::pair().unwrap().0).collect();
        let fds: Vec<_> = d.iter().map(|x| x.as_fd()).collect();
        send_msg(a.as_fd(), b"x", &fds).unwrap();
        let mut buf = [0u8; 8];
        let r = recv_msg(b.as_fd(), &mut buf, 1).unwrap();
        assert!(r.truncated);
        assert!(r.fds.len() <= 1);
        assert_eq!(r.len, 1);

        // Descriptors where none were expected.
        send_msg(a.as_fd(), b"y", &fds[..1]).unwrap();
        let r = recv_msg(b.as_fd(), &mut buf, 0).unwrap();
        assert!(r.truncated);
        assert!(r.fds.is_empty());
    }

    #[test]
    fn closed_peer() {
        let (a, b) = seqpacket_pair().unwrap();
        drop(a);
        let mut buf = [0u8; 8];
        let r = recv_msg(b.as_fd(), &mut buf, 1).unwrap();
        assert_eq!(r.len, 0);
        let e = send_msg(b.as_fd(), b"z", &[]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::BrokenPipe);
    }

    #[test]
    fn too_many_fds_refused() {
        let (a, _b) = seqpacket_pair().unwrap();
        let fds = vec![a.as_fd(); MAX_FDS_PER_MSG + 1];
        assert!(send_msg(a.as_fd(), b"", &fds).is_err());
    }
}
