//! Who a connecting process is: its tenant.
//!
//! The kernel vouches for a Unix socket's peer (`SO_PEERCRED`): its uid,
//! and through its pid, its namespaces; what the process says of itself
//! counts for nothing. By default a tenant is a uid, the same on every host
//! and so the tenant's network across hosts. Containers that share a uid
//! (commonly root, without user namespaces) then share a tenant. With
//! `tenant_by = "uid+netns"`, a process in a network namespace other than
//! the daemon's is a tenant of its own per (uid, namespace), numbered by
//! this daemon from [`TenantId::HOST_LOCAL_BASE`] and confined to this
//! host, since no other host knows that number.
//!
//! A pid is reused once its process is gone, so the namespace read through
//! `/proc/<pid>` is only trusted if the process the kernel recorded at
//! `connect` (its pidfd, `SO_PEERPIDFD`, Linux 6.5) still lives after the
//! read: then the pid was still its own. Without `SO_PEERPIDFD` the
//! namespace cannot be known safely, and such connections are refused.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Mutex;

use vrdma_core::hca::TenantId;
use vrdma_shm::fdpass::{peer_credentials, PeerCred};

pub use crate::config::TenantBy;

/// Tenants a daemon may number itself; beyond, connections are refused.
const MAX_NAMED: usize = 1 << 20;

/// A network namespace: the device and inode of its `nsfs` file.
type Netns = (u64, u64);

pub(crate) struct Tenancy {
    by: TenantBy,
    own: Option<Netns>,
    named: Mutex<HashMap<(u32, Netns), TenantId>>,
}

impl Tenancy {
    pub fn new(by: TenantBy) -> io::Result<Tenancy> {
        let own = match by {
            TenantBy::Uid => None,
            TenantBy::UidAndNetns => Some(netns_at("/proc/self/ns/net")?),
        };
        Ok(Tenancy { by, own, named: Mutex::new(HashMap::new()) })
    }

    /// The tenant of the process at the other end of `sock`, and its
    /// credentials.
    pub fn identify(&self, sock: BorrowedFd<'_>) -> io::Result<(TenantId, PeerCred)> {
        let cred = peer_credentials(sock)?;
        let Some(own) = self.own else { return Ok((TenantId(cred.uid), cred)) };
        debug_assert_eq!(self.by, TenantBy::UidAndNetns);
        let ns = peer_netns(sock, cred.pid)?;
        if ns == own {
            return Ok((TenantId(cred.uid), cred));
        }
        let mut named = self.named.lock().unwrap_or_else(|p| p.into_inner());
        let n = named.len();
        if let Some(&t) = named.get(&(cred.uid, ns)) {
            return Ok((t, cred));
        }
        if n >= MAX_NAMED {
            return Err(io::Error::other("too many tenants named by this daemon"));
        }
        let t = TenantId(TenantId::HOST_LOCAL_BASE + n as u32 + 1);
        named.insert((cred.uid, ns), t);
        tracing::info!(uid = cred.uid, netns = ns.1, tenant = t.0, "a new tenant of this host only");
        Ok((t, cred))
    }
}

fn netns_at(path: &str) -> io::Result<Netns> {
    let st = rustix::fs::stat(path)?;
    Ok((st.st_dev, st.st_ino))
}

/// The network namespace of the process that connected `sock`, whose pid
/// `SO_PEERCRED` gave as `pid`.
fn peer_netns(sock: BorrowedFd<'_>, pid: i32) -> io::Result<Netns> {
    let pidfd = peer_pidfd(sock)?;
    let ns = netns_at(&format!("/proc/{pid}/ns/net"))?;
    // A pidfd turns readable when its process exits.
    let mut fds = [rustix::event::PollFd::new(&pidfd, rustix::event::PollFlags::IN)];
    let zero = rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 };
    rustix::event::poll(&mut fds, Some(&zero))?;
    if !fds[0].revents().is_empty() {
        return Err(io::Error::other("the connecting process has exited"));
    }
    Ok(ns)
}

/// `SO_PEERPIDFD`: a pidfd of the process that connected `sock`.
fn peer_pidfd(sock: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `fd`, an int of
    // that size that outlives the call.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERPIDFD,
            (&mut fd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if r != 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(
            e.kind(),
            format!("cannot know the peer's network namespace safely without SO_PEERPIDFD (Linux 6.5): {e}"),
        ));
    }
    if fd < 0 {
        return Err(io::Error::other("the kernel gave no pidfd for the peer"));
    }
    // SAFETY: the kernel just created this descriptor for us; nothing else
    // owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use super::*;

    #[test]
    fn by_uid_a_peer_is_its_uid() {
        let (a, _b) = vrdma_shm::fdpass::seqpacket_pair().unwrap();
        let t = Tenancy::new(TenantBy::Uid).unwrap();
        let (id, cred) = t.identify(a.as_fd()).unwrap();
        assert_eq!(id, TenantId(rustix::process::getuid().as_raw()));
        assert_eq!(cred.pid, rustix::process::getpid().as_raw_pid());
    }

    #[test]
    fn by_uid_and_netns_a_peer_in_our_namespace_is_its_uid() {
        let (a, _b) = vrdma_shm::fdpass::seqpacket_pair().unwrap();
        let t = Tenancy::new(TenantBy::UidAndNetns).unwrap();
        let (id, _) = t.identify(a.as_fd()).unwrap();
        assert_eq!(id, TenantId(rustix::process::getuid().as_raw()));
    }
}
