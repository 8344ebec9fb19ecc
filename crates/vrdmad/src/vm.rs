//! VMs: QEMU guests that reach the device through ivshmem and virtio-serial.
//!
//! For each `[vms.NAME]` of the configuration the daemon makes, at start,
//! the VM's shared region (a sealed memfd, the guest's ivshmem BAR) and a
//! listening stream socket `vm-NAME.sock` beside the control socket. QEMU
//! connects one virtio-serial port (chardev) to it per port; each
//! connection is one guest session (`server::guest`). The host learns the
//! region and the socket with `Request::VmAttach` on the control socket.
//!
//! A VM is a tenant the host configures: its sessions are the configured
//! uid's tenant, whatever the guest says and whoever QEMU runs as. Every
//! process in the guest that can open the BAR reaches the whole region,
//! so the isolation boundary is the VM: its sessions share one allocator
//! of extents ([`vrdma_core::extents`]) over the region, and nothing of
//! another VM or tenant lies in it. See `docs/vms.md`.

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
use vrdma_core::extents::Extents;

use crate::config::VmConfig;

/// One configured VM.
pub(crate) struct Vm {
    pub name: String,
    pub config: VmConfig,
    /// The shared region: `region_len` bytes, sealed against shrinking
    /// and growing.
    pub region: OwnedFd,
    pub region_len: u64,
    pub socket: PathBuf,
    listener: OwnedFd,
    /// Who holds which part of the region.
    pub extents: Mutex<Extents>,
    /// Where each object of the VM's contexts lies in the region, for a
    /// migration's snapshot (`server::migrate`).
    pub placed: Mutex<Placed>,
    /// Ports connected now (QEMU connects `ports` at most).
    pub connected: AtomicU32,
    /// Guest sessions open now (a guest process with a context), for the
    /// metrics (`server::guest` counts them).
    pub sessions: AtomicU32,
    /// Imports of the VM's tenant installed here. A port whose session
    /// ended (or that said `NoSession`) may say `NoSession` again after
    /// the next import: the same QEMU's guest, restored by `loadvm` to a
    /// point where its session was live, speaks on the port it had
    /// (`server::guest`).
    pub imports: AtomicU64,
    /// The port connections, shut down to end them when the daemon stops.
    conns: Mutex<(u64, Vec<(u64, OwnedFd)>)>,
}

impl std::fmt::Debug for Vm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vm").field("name", &self.name).field("socket", &self.socket).finish_non_exhaustive()
    }
}

/// The region of a VM: a memfd of `len` zero bytes that can neither
/// shrink nor grow (so no one, QEMU included, can take pages from under
/// the daemon's mappings).
fn create_region(name: &str, len: u64) -> std::io::Result<OwnedFd> {
    let fd = rustix::fs::memfd_create(
        format!("vrdma-vm-{name}"),
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )?;
    rustix::fs::ftruncate(&fd, len)?;
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
    Ok(fd)
}

/// Binds the VM's port socket, mode 0600: only the daemon's user (and
/// root) may connect QEMU to it. A stale file of a dead daemon is replaced.
fn bind(path: &Path) -> std::io::Result<OwnedFd> {
    if path.exists() {
        let probe =
            rustix::net::socket_with(AddressFamily::UNIX, SocketType::STREAM, SocketFlags::CLOEXEC, None)?;
        if rustix::net::connect(&probe, &SocketAddrUnix::new(path)?).is_ok() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                format!("a daemon already listens on {}", path.display()),
            ));
        }
        std::fs::remove_file(path)?;
    }
    let fd = rustix::net::socket_with(AddressFamily::UNIX, SocketType::STREAM, SocketFlags::CLOEXEC, None)?;
    // Made 0600 before anyone can connect: bound under a umask that
    // leaves the owner only.
    let old = rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o177));
    let bound = rustix::net::bind(&fd, &SocketAddrUnix::new(path)?);
    rustix::process::umask(old);
    bound?;
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    rustix::net::listen(&fd, 32)?;
    Ok(fd)
}

impl Vm {
    /// Makes VM `name`'s region and port socket in `dir`.
    pub fn create(name: &str, config: &VmConfig, dir: &Path) -> std::io::Result<Vm> {
        let region_len = config.region_len();
        let region = create_region(name, region_len)?;
        let socket = dir.join(format!("vm-{name}.sock"));
        let listener = bind(&socket)?;
        Ok(Vm {
            name: name.to_string(),
            config: config.clone(),
            region,
            region_len,
            socket,
            listener,
            extents: Mutex::new(Extents::new(region_len, vrdma_shm::page_size() as u64)),
            placed: Mutex::default(),
            connected: AtomicU32::new(0),
            sessions: AtomicU32::new(0),
            imports: AtomicU64::new(0),
            conns: Mutex::default(),
        })
    }

    pub fn extents(&self) -> std::sync::MutexGuard<'_, Extents> {
        self.extents.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Why an extent of `len` bytes found no room, `free` bytes being
    /// free in all: for the guest program that asked (its registration's
    /// `ENOMEM`), which cannot see the region's size or who holds it.
    pub fn no_room(&self, len: u64, free: u64) -> String {
        let name = &self.name;
        format!(
            "VM {name:?}'s region ({} MiB, fixed by the host's [vms.{name}] memory_mib) has no run of \
             {len} bytes free ({free} bytes free in all; this VM's rings and registered memory hold the rest)",
            self.config.memory_mib
        )
    }

    pub fn placed(&self) -> std::sync::MutexGuard<'_, Placed> {
        self.placed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Accepts QEMU's port connections until [`shutdown`](Self::shutdown).
    pub fn serve(self: Arc<Self>, shared: Arc<crate::server::Shared>) {
        loop {
            let conn = match rustix::net::accept_with(&self.listener, SocketFlags::CLOEXEC) {
                Ok(c) => c,
                Err(rustix::io::Errno::INTR) => continue,
                Err(rustix::io::Errno::MFILE | rustix::io::Errno::NFILE) => {
                    std::thread::sleep(std::time::Duration::from_millis(100));
                    continue;
                }
                Err(e) => {
                    tracing::debug!(vm = %self.name, error = %e, "VM port socket closed");
                    return;
                }
            };
            // One connection per virtio-serial port: more is not QEMU.
            let held = self.connected.fetch_add(1, Ordering::AcqRel);
            if held >= self.config.ports {
                self.connected.fetch_sub(1, Ordering::AcqRel);
                const BEYOND: &str = "a connection beyond the VM's ports; closed";
                let (log, now) = (&shared.log, crate::logs::now());
                let source =
                    vrdma_core::log_limit::Source::Tenant(vrdma_core::hca::TenantId(self.config.tenant));
                vrdma_core::limited_warn!(
                    crate::logs::lock(log), source, now, BEYOND,
                    vm = %self.name, ports = self.config.ports
                );
                continue;
            }
            let (vm, sh) = (self.clone(), shared.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("vrdma-vm-{}", self.name))
                .spawn(move || crate::server::guest::run(conn, vm, sh));
            if let Err(e) = spawned {
                self.connected.fetch_sub(1, Ordering::AcqRel);
                tracing::error!(vm = %self.name, error = %e, "cannot start a VM port thread");
            }
        }
    }

    /// Remembers a port connection (a duplicate), to end it on
    /// [`shutdown`](Self::shutdown); the key forgets it.
    pub fn add_conn(&self, fd: OwnedFd) -> u64 {
        let mut c = self.conns.lock().unwrap_or_else(|p| p.into_inner());
        c.0 += 1;
        let key = c.0;
        c.1.push((key, fd));
        key
    }

    pub fn remove_conn(&self, key: u64) {
        self.conns.lock().unwrap_or_else(|p| p.into_inner()).1.retain(|(k, _)| *k != key);
    }

    /// Stops accepting and ends every port connection.
    pub fn shutdown(&self) {
        let _ = rustix::net::shutdown(self.listener.as_fd(), rustix::net::Shutdown::Both);
        for (_, fd) in self.conns.lock().unwrap_or_else(|p| p.into_inner()).1.iter() {
            let _ = rustix::net::shutdown(fd, rustix::net::Shutdown::Both);
        }
    }
}

/// Where one object of a VM's context lies in the VM's region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Place {
    /// A memory region's first byte.
    Mr(u64),
    /// A CQ's or SRQ's ring extent (offset, length).
    Ring(u64, u64),
    /// A QP's rings' extent (offset, length) and whether it has an inbox.
    Qp(u64, u64, bool),
    /// A memory region of several pieces (`RegMrPieces`): each piece's
    /// offset and length, in order.
    MrPieces(Vec<(u64, u64)>),
}

/// The places of the objects of a VM's contexts: recorded when a guest
/// session (or an import) makes an object, forgotten when it is destroyed
/// or its context closes, so that the table holds live objects only.
#[derive(Debug, Default)]
pub(crate) struct Placed {
    by_ctx: std::collections::HashMap<u32, std::collections::HashMap<(Kind, u32), Place>>,
    /// Extents an import took that no ring owns (the guest's memory, which
    /// a session would own): given back when the tenant moves away again.
    pub orphans: Vec<u64>,
    /// Per context an import brought and no session adopted yet, its
    /// completion channels (`MovedChannel`).
    pub moved_channels: std::collections::HashMap<u32, Vec<MovedChannel>>,
    /// Per guest context, the last numbered call its session answered
    /// (`server::guest_answers`): kept here, beside the places, because the
    /// export carries it and the import brings it for the adopter.
    pub answers: std::collections::HashMap<u32, crate::server::guest_answers::Remembered>,
    /// Per guest context, its memory extents (offset -> length): those its
    /// session took to register in (`GuestAlloc`, grown by `GuestGrow`),
    /// or an import brought for it. The export names each one's owner, so
    /// that the session adopting the context on the destination owns them
    /// all, not only those its memory regions lie on.
    memory: std::collections::HashMap<u32, std::collections::BTreeMap<u64, u64>>,
}

/// Which number space an object's number is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    Mr,
    Cq,
    Srq,
    Qp,
    /// A context's own segment (event and posted rings), by context id.
    Context,
    /// A completion channel's ring (its events), by channel number.
    Channel,
}

/// A completion channel an import installed for a context no session
/// has adopted yet: the tenant's end of its new doorbell, handed over at
/// the adoption, and its ring's producer index at the import (events
/// before it were raised where the tenant was; their wake-ups did not
/// move: the guest's library rings again for those still unread,
/// `proto::MovedChannel`).
#[derive(Debug)]
pub(crate) struct MovedChannel {
    pub id: u32,
    pub tenant_end: vrdma_shm::Doorbell,
    pub produced_at_import: u32,
}

impl Placed {
    pub fn record(&mut self, ctx: u32, kind: Kind, id: u32, place: Place) {
        self.by_ctx.entry(ctx).or_default().insert((kind, id), place);
    }

    /// A guest context opened (it may hold no object yet).
    pub fn open_context(&mut self, ctx: u32) {
        self.by_ctx.entry(ctx).or_default();
    }

    pub fn forget(&mut self, ctx: u32, kind: Kind, id: u32) {
        if let Some(m) = self.by_ctx.get_mut(&ctx) {
            m.remove(&(kind, id));
        }
    }

    pub fn forget_context(&mut self, ctx: u32) {
        self.by_ctx.remove(&ctx);
        self.moved_channels.remove(&ctx);
        self.answers.remove(&ctx);
        self.memory.remove(&ctx);
    }

    /// Context `ctx`'s memory extent at `at` is `len` bytes long now (new,
    /// or grown).
    pub fn memory_is(&mut self, ctx: u32, at: u64, len: u64) {
        self.memory.entry(ctx).or_default().insert(at, len);
    }

    /// Context `ctx`'s memory extent at `at` was given back.
    pub fn memory_freed(&mut self, ctx: u32, at: u64) {
        if let Some(m) = self.memory.get_mut(&ctx) {
            m.remove(&at);
            if m.is_empty() {
                self.memory.remove(&ctx);
            }
        }
    }

    /// The memory extents recorded under `from` are `to`'s now (a session
    /// that took memory before it adopted a moved context).
    pub fn memory_moves(&mut self, from: u32, to: u32) {
        if from == to {
            return;
        }
        if let Some(m) = self.memory.remove(&from) {
            self.memory.entry(to).or_default().extend(m);
        }
    }

    /// Context `ctx`'s memory extents (offset, length), by offset.
    pub fn memory_of(&self, ctx: u32) -> Vec<(u64, u64)> {
        self.memory.get(&ctx).map(|m| m.iter().map(|(&a, &l)| (a, l)).collect()).unwrap_or_default()
    }

    pub fn get(&self, ctx: u32, kind: Kind, id: u32) -> Option<Place> {
        self.by_ctx.get(&ctx)?.get(&(kind, id)).cloned()
    }

    /// The memory regions of context `ctx` and where each begins (each
    /// piece, for a region of several).
    pub fn mrs_of(&self, ctx: u32) -> Vec<(u32, Vec<u64>)> {
        let Some(m) = self.by_ctx.get(&ctx) else { return Vec::new() };
        m.iter()
            .filter_map(|((k, id), p)| match (k, p) {
                (Kind::Mr, Place::Mr(at)) => Some((*id, vec![*at])),
                (Kind::Mr, Place::MrPieces(v)) => Some((*id, v.iter().map(|&(at, _)| at).collect())),
                _ => None,
            })
            .collect()
    }

    /// The completion channels placed for `ctx`: number, offset, length.
    pub fn channels_of(&self, ctx: u32) -> Vec<(u32, u64, u64)> {
        let Some(m) = self.by_ctx.get(&ctx) else { return Vec::new() };
        let mut v: Vec<_> = m
            .iter()
            .filter_map(|((k, id), p)| match (k, p) {
                (Kind::Channel, Place::Ring(at, len)) => Some((*id, *at, *len)),
                _ => None,
            })
            .collect();
        v.sort_unstable();
        v
    }

    pub fn has_context(&self, ctx: u32) -> bool {
        self.by_ctx.contains_key(&ctx)
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.socket);
    }
}

#[cfg(test)]
mod tests {
    use super::Placed;

    /// Memory a guest session took before it adopted a moved context is
    /// the adopted context's (its snapshot names that owner), none left
    /// under the session's first number.
    #[test]
    fn memory_taken_before_an_adoption_moves_to_the_adopted_context() {
        let mut p = Placed::default();
        p.memory_is(7, 0x1000, 0x2000);
        p.memory_is(9, 0x8000, 0x1000);
        p.memory_moves(7, 9);
        assert_eq!(p.memory_of(7), vec![]);
        assert_eq!(p.memory_of(9), vec![(0x1000, 0x2000), (0x8000, 0x1000)]);
        p.memory_moves(9, 9);
        assert_eq!(p.memory_of(9).len(), 2);
    }
}
