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
//!
//! A namespace's inode number is reused once the namespace is freed, so a
//! numbered tenant holds its namespace open (pinned) while it has sessions
//! ([`Seat`]), and is forgotten with its last one: a later namespace that
//! gets the same inode is a new tenant with a new number. Numbers are
//! never reused.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

use vrdma_core::hca::TenantId;
use vrdma_core::limited_info;
use vrdma_core::log_limit::{LogLimiter, Source};
use vrdma_shm::fdpass::{peer_credentials, PeerCred};

pub use crate::config::TenantBy;

/// The largest number this daemon gives out; beyond, connections from
/// other namespaces are refused (after some 268 million tenants).
const LAST_NUMBER: u32 = u32::MAX - 1;

/// A network namespace: the device and inode of its `nsfs` file.
type Netns = (u64, u64);

/// A numbered tenant's key: a uid in a namespace.
type Key = (u32, Netns);

/// A tenant this daemon numbered: its number, its sessions, and the open
/// namespace that keeps the inode from naming another meanwhile.
struct Named {
    tenant: TenantId,
    sessions: usize,
    _pin: OwnedFd,
}

#[derive(Default)]
struct Numbering {
    named: HashMap<Key, Named>,
    /// The last number given out.
    last: u32,
    /// A process that can make network namespaces can make tenants at
    /// will: their lines are limited per uid.
    log: LogLimiter,
}

pub(crate) struct Tenancy {
    /// The daemon's own namespace, when tenants are told apart by
    /// namespace (`uid+netns`).
    own: Option<Netns>,
    numbering: Arc<Mutex<Numbering>>,
}

/// A session's hold on a numbered tenant (see the module's doc); `None`
/// for a tenant that is a uid.
pub(crate) struct Seat(Option<(Arc<Mutex<Numbering>>, Key)>);

impl Seat {
    /// No hold: for a tenant that is a uid (a VM's).
    pub fn none() -> Seat {
        Seat(None)
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        let Some((numbering, key)) = self.0.take() else { return };
        let mut n = numbering.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = n.named.get_mut(&key) {
            e.sessions -= 1;
            if e.sessions == 0 {
                n.named.remove(&key);
            }
        }
    }
}

impl Tenancy {
    /// Adds the occurrences of the lines this limits (per log message)
    /// to `out`, for the metrics.
    pub fn limited_inputs(&self, out: &mut std::collections::BTreeMap<&'static str, u64>) {
        let n = self.numbering.lock().unwrap_or_else(|p| p.into_inner());
        for (m, c) in n.log.occurred() {
            *out.entry(*m).or_default() += c;
        }
    }

    pub fn new(by: TenantBy) -> io::Result<Tenancy> {
        let own = match by {
            TenantBy::Uid => None,
            TenantBy::UidAndNetns => Some(netns_of(&open_netns("/proc/self/ns/net")?)?),
        };
        Ok(Tenancy { own, numbering: Arc::default() })
    }

    /// The tenant of the process at the other end of `sock`, its
    /// credentials, and the seat the session holds while it lives.
    pub fn identify(&self, sock: BorrowedFd<'_>) -> io::Result<(TenantId, PeerCred, Seat)> {
        let cred = peer_credentials(sock)?;
        let Some(own) = self.own else { return Ok((TenantId(cred.uid), cred, Seat(None))) };
        let (ns, pin) = peer_netns(sock, cred.pid)?;
        if ns == own {
            if TenantId(cred.uid).is_host_local() {
                // Such a uid would share its number with a numbered tenant.
                return Err(io::Error::other(format!(
                    "uid {} lies in the numbers kept for tenants of this host only",
                    cred.uid
                )));
            }
            return Ok((TenantId(cred.uid), cred, Seat(None)));
        }
        let (tenant, seat) = self.seat(cred.uid, ns, pin)?;
        Ok((tenant, cred, seat))
    }

    /// The tenant of `uid` in the namespace `ns` (held open by `pin`),
    /// numbered if it has no seat yet, and a seat in it.
    fn seat(&self, uid: u32, ns: Netns, pin: OwnedFd) -> io::Result<(TenantId, Seat)> {
        let mut n = self.numbering.lock().unwrap_or_else(|p| p.into_inner());
        let key = (uid, ns);
        if let Some(e) = n.named.get_mut(&key) {
            e.sessions += 1;
            return Ok((e.tenant, Seat(Some((self.numbering.clone(), key)))));
        }
        let next = n.last.max(TenantId::HOST_LOCAL_BASE) + 1;
        if next > LAST_NUMBER {
            return Err(io::Error::other("this daemon has numbered all the tenants it can"));
        }
        n.last = next;
        let tenant = TenantId(next);
        n.named.insert(key, Named { tenant, sessions: 1, _pin: pin });
        // The uid's own tenant stands for the uid.
        let (by_uid, now) = (Source::Tenant(TenantId(uid)), crate::logs::now());
        limited_info!(
            n.log,
            by_uid,
            now,
            "a new tenant of this host only",
            uid,
            netns = ns.1,
            tenant = tenant.0
        );
        Ok((tenant, Seat(Some((self.numbering.clone(), key)))))
    }
}

fn open_netns(path: &str) -> io::Result<OwnedFd> {
    Ok(rustix::fs::open(
        path,
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?)
}

fn netns_of(fd: &OwnedFd) -> io::Result<Netns> {
    let st = rustix::fs::fstat(fd)?;
    Ok((st.st_dev, st.st_ino))
}

/// The network namespace of the process that connected `sock`, whose pid
/// `SO_PEERCRED` gave as `pid`, and a descriptor that holds it open.
fn peer_netns(sock: BorrowedFd<'_>, pid: i32) -> io::Result<(Netns, OwnedFd)> {
    let pidfd = peer_pidfd(sock)?;
    let pin = open_netns(&format!("/proc/{pid}/ns/net"))?;
    // A pidfd turns readable when its process exits.
    let mut fds = [rustix::event::PollFd::new(&pidfd, rustix::event::PollFlags::IN)];
    let zero = rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 };
    rustix::event::poll(&mut fds, Some(&zero))?;
    if !fds[0].revents().is_empty() {
        return Err(io::Error::other("the connecting process has exited"));
    }
    Ok((netns_of(&pin)?, pin))
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
        let (id, cred, _) = t.identify(a.as_fd()).unwrap();
        assert_eq!(id, TenantId(rustix::process::getuid().as_raw()));
        assert_eq!(cred.pid, rustix::process::getpid().as_raw_pid());
    }

    /// A stand-in for a namespace's descriptor.
    fn pin() -> OwnedFd {
        open_netns("/proc/self/ns/net").unwrap()
    }

    #[test]
    fn a_numbered_tenant_lasts_while_it_has_sessions_and_its_number_is_never_reused() {
        let t = Tenancy::new(TenantBy::UidAndNetns).unwrap();
        let ns = (4, 4026532317);
        let (a, seat_a) = t.seat(0, ns, pin()).unwrap();
        assert!(a.is_host_local());
        // Another session in the same namespace: the same tenant.
        let (b, seat_b) = t.seat(0, ns, pin()).unwrap();
        assert_eq!(a, b);
        // Another uid there, or the same uid elsewhere: other tenants.
        let (c, _seat_c) = t.seat(1000, ns, pin()).unwrap();
        let (d, _seat_d) = t.seat(0, (4, 4026532318), pin()).unwrap();
        assert!(c != a && d != a && c != d);
        drop((seat_a, seat_b));
        // The namespace is gone and its inode number comes back for a new
        // one: a new tenant, never an old number.
        let (e, _seat_e) = t.seat(0, ns, pin()).unwrap();
        assert!(![a, c, d].contains(&e), "{e:?} reused");
        assert_eq!(t.numbering.lock().unwrap().named.len(), 3);
    }

    /// A process that can make namespaces makes tenants at will: the log
    /// gets a line for its first and a count for the rest.
    #[test]
    fn new_tenants_of_one_uid_cost_the_log_a_few_lines() {
        let t = Tenancy::new(TenantBy::UidAndNetns).unwrap();
        const MADE: u64 = 300;
        let _seats: Vec<Seat> =
            (0..MADE).map(|i| t.seat(1000, (4, 4026540000 + i), pin()).unwrap().1).collect();
        let _other_uid = t.seat(1001, (4, 4026540000), pin()).unwrap();
        let n = t.numbering.lock().unwrap();
        let lines = MADE - n.log.suppressed().get("a new tenant of this host only").copied().unwrap_or(0);
        assert!((1..=3).contains(&lines), "{lines} lines for {MADE} tenants");
        assert_eq!(n.log.len(), 2, "another uid is limited apart");
    }

    #[test]
    fn by_uid_and_netns_a_peer_in_our_namespace_is_its_uid() {
        let (a, _b) = vrdma_shm::fdpass::seqpacket_pair().unwrap();
        let t = Tenancy::new(TenantBy::UidAndNetns).unwrap();
        let (id, _, _) = t.identify(a.as_fd()).unwrap();
        assert_eq!(id, TenantId(rustix::process::getuid().as_raw()));
    }
}
