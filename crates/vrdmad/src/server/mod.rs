//! The control socket: accepts tenant connections, one thread each.
//!
//! What tenants make the control plane log goes through [`Shared::log`],
//! limited per tenant ([`vrdma_core::log_limit`]).

mod admission;
pub(crate) mod guest;
pub(crate) mod guest_answers;
mod guest_memory;
mod migrate;
mod migrate_vm;
pub(crate) mod pause_gate;
mod ring_pool;
mod session;
mod tenancy;

pub(crate) use admission::{Admission, KeptDescriptor};
pub(crate) use tenancy::{Seat, Tenancy};

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

use vrdma_core::hca::TenantId;
use vrdma_core::limited_warn;
use vrdma_core::log_limit::{LogLimiter, Source};

use crate::engine::EngineHandle;

/// Shared by every session.
pub(crate) struct Shared {
    pub engine: EngineHandle,
    pub device_name: String,
    pub next_context: AtomicU32,
    pub tenancy: Tenancy,
    /// Which tenants hold contexts, and their shares of the mappings and
    /// descriptors (see `admission`).
    pub admission: Admission,
    /// Sessions' sockets, with their peers' tenants, shut down to end them
    /// when the daemon stops.
    pub sessions: Mutex<Vec<(u32, TenantId, OwnedFd)>>,
    /// Limits what tenants make the accept loop and sessions log (on the
    /// clock of [`crate::logs::now`]).
    pub log: Mutex<LogLimiter>,
    /// The configured VMs by name (see `crate::vm`).
    pub vms: std::collections::BTreeMap<String, Arc<crate::vm::Vm>>,
    /// The threads accepting the VMs' port connections (joined on stop).
    pub vm_acceptors: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// The daemon stops: sessions answer nothing more. Set before their
    /// sockets are shut down one by one, so that a tenant that saw one of
    /// its connections end (its rdma_cm channels hang up) cannot get an
    /// answer on another that is still to be shut down.
    pub stopping: std::sync::atomic::AtomicBool,
    /// Sessions ended because their tenant moved to another host (the
    /// operator's `finish`): a guest's port tells its guest so
    /// ([`vrdma_core::proto::guest::EndReason::Moved`]), which may then
    /// adopt its context there. Taken by the port, or by the session's end.
    pub moved: Mutex<std::collections::BTreeSet<u32>>,
    /// Holds a paused tenant's state-changing calls until its migration
    /// is finished or cancelled (`pause_gate`).
    pub gate: pause_gate::PauseGate,
}

impl Shared {
    /// Ends session `id`: its thread sees the connection end and closes
    /// the context, and the tenant sees its connection closed.
    pub fn end_session(&self, id: u32) {
        for (_, _, fd) in self.sessions.lock().unwrap_or_else(|p| p.into_inner()).iter().filter(|s| s.0 == id)
        {
            let _ = rustix::net::shutdown(fd, rustix::net::Shutdown::Both);
        }
    }

    /// Ends session `id` because its tenant moved away: as
    /// [`end_session`](Self::end_session), and a guest hears why.
    pub fn end_session_moved(&self, id: u32) {
        self.mark_moved(id);
        self.end_session(id);
    }

    /// Notes that session `id`'s context left this host. `finish` notes it
    /// on the engine's thread, with the tenant's objects gone, so that a
    /// guest's call the engine ran after that finds the note when it
    /// returns (`guest::Port`: its error is not answered).
    pub fn mark_moved(&self, id: u32) {
        self.moved.lock().unwrap_or_else(|p| p.into_inner()).insert(id);
    }

    /// Whether session `id`'s context left this host (the note stays).
    pub fn is_moved(&self, id: u32) -> bool {
        self.moved.lock().unwrap_or_else(|p| p.into_inner()).contains(&id)
    }

    /// Whether session `id` was ended because its tenant moved (once).
    pub fn take_moved(&self, id: u32) -> bool {
        self.moved.lock().unwrap_or_else(|p| p.into_inner()).remove(&id)
    }
}

/// Connections a tenant may hold beyond its quota of contexts: room for
/// ones still saying Hello or closing. Beyond, they are closed at once,
/// so that one tenant cannot use up the daemon's descriptors and threads.
pub(crate) const CONNECTIONS_BEYOND_CONTEXTS: u32 = 16;

/// The line of a connection closed for [`CONNECTIONS_BEYOND_CONTEXTS`].
const OVER_LIMIT: &str = "a tenant's connections are over its limit; connection closed";

pub(crate) struct Listener {
    fd: OwnedFd,
    path: PathBuf,
}

impl Listener {
    /// Binds the control socket, replacing a stale socket file left by a
    /// daemon that died, but never one a live daemon answers on.
    pub fn bind(path: &Path) -> std::io::Result<Listener> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        if path.exists() {
            if connect(path).is_ok() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    format!("a daemon already listens on {}", path.display()),
                ));
            }
            std::fs::remove_file(path)?;
        }
        let fd =
            rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?;
        let addr = SocketAddrUnix::new(path)?;
        rustix::net::bind(&fd, &addr)?;
        // Tenants of any uid may connect; isolation is by peer credentials.
        std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o666))?;
        rustix::net::listen(&fd, 128)?;
        Ok(Listener { fd, path: path.to_owned() })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Accepts until the listener is shut down.
    pub fn serve(self: Arc<Self>, shared: Arc<Shared>) {
        loop {
            let conn = match rustix::net::accept_with(&self.fd, SocketFlags::CLOEXEC) {
                Ok(c) => c,
                Err(rustix::io::Errno::INTR) => continue,
                Err(rustix::io::Errno::MFILE | rustix::io::Errno::NFILE) => {
                    const NO_FDS: &str = "out of file descriptors; refusing connections for 100 ms";
                    limited_warn!(crate::logs::lock(&shared.log), Source::Anyone, crate::logs::now(), NO_FDS);
                    std::thread::sleep(std::time::Duration::from_millis(100));
                    continue;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "control socket closed");
                    return;
                }
            };
            let (tenant, cred, seat) = match shared.tenancy.identify(conn.as_fd()) {
                Ok(t) => t,
                Err(e) => {
                    const UNKNOWN: &str = "cannot tell the tenant of a connection; closed";
                    let now = crate::logs::now();
                    limited_warn!(crate::logs::lock(&shared.log), Source::Anyone, now, UNKNOWN, error = %e);
                    continue;
                }
            };
            let quota = shared.engine.call(move |st| st.hca.quota(tenant).max_contexts);
            let limit = quota.unwrap_or(0).saturating_add(CONNECTIONS_BEYOND_CONTEXTS) as usize;
            let held = shared
                .sessions
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .filter(|s| s.1 == tenant)
                .count();
            if held >= limit {
                let (log, now) = (&shared.log, crate::logs::now());
                limited_warn!(
                    crate::logs::lock(log),
                    Source::Tenant(tenant),
                    now,
                    OVER_LIMIT,
                    tenant = tenant.0,
                    held
                );
                continue;
            }
            let id = shared.next_context.fetch_add(1, Ordering::Relaxed);
            // Registered before the thread starts, so that the thread's
            // own removal at its end cannot come first.
            if let Ok(dup) = conn.try_clone() {
                shared.sessions.lock().unwrap_or_else(|p| p.into_inner()).push((id, tenant, dup));
            }
            let sh = shared.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("vrdma-ctx-{id}"))
                .spawn(move || session::run(conn, id, tenant, cred, seat, sh));
            if let Err(e) = spawned {
                // The connection went with the closure and is closed; drop
                // our duplicate too, so the client sees the hang-up.
                shared.sessions.lock().unwrap_or_else(|p| p.into_inner()).retain(|(i, ..)| *i != id);
                const NO_THREAD: &str = "cannot start a session thread";
                let (log, now) = (&shared.log, crate::logs::now());
                vrdma_core::limited_error!(
                    crate::logs::lock(log), Source::Tenant(tenant), now, NO_THREAD,
                    error = %e
                );
            }
        }
    }

    pub fn shutdown(&self) {
        let _ = rustix::net::shutdown(self.fd.as_fd(), rustix::net::Shutdown::Both);
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Connects a SOCK_SEQPACKET socket to `path`.
pub fn connect(path: &Path) -> std::io::Result<OwnedFd> {
    let fd =
        rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?;
    rustix::net::connect(&fd, &SocketAddrUnix::new(path)?)?;
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tenant that keeps connecting over its limit has each connection
    /// closed at once, and costs the log a line and a count or two, not a
    /// line per connection.
    #[test]
    fn connections_over_the_limit_cost_the_log_a_few_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vrdma.sock");
        let mut cfg = crate::DaemonConfig { socket: Some(path.clone()), ..Default::default() };
        cfg.quota.max_contexts = 1;
        let daemon = crate::Daemon::start(cfg).unwrap();
        // Held while the rest are refused (they say no Hello, so they would
        // be closed after 5 s: the test takes far less).
        let _held: Vec<OwnedFd> =
            (0..1 + CONNECTIONS_BEYOND_CONTEXTS).map(|_| connect(&path).unwrap()).collect();
        const REFUSED: u64 = 300;
        for _ in 0..REFUSED {
            let c = connect(&path).unwrap();
            use rustix::net::sockopt::{set_socket_timeout, Timeout};
            set_socket_timeout(&c, Timeout::Recv, Some(std::time::Duration::from_secs(5))).unwrap();
            // The daemon closes it, after its line or its count.
            let n = rustix::net::recv(&c, &mut [0u8; 8], rustix::net::RecvFlags::empty()).unwrap();
            assert_eq!(n.0, 0, "a connection over the limit was answered");
        }
        let suppressed = crate::logs::lock(&daemon.shared.log).suppressed().get(OVER_LIMIT).copied();
        let lines = REFUSED - suppressed.unwrap_or(0);
        // At once, then after 1 and 3 s if the machine is slow.
        assert!((1..=3).contains(&lines), "{lines} lines for {REFUSED} connections over the limit");
    }
}
