//! The daemon's side of live migration: the operator's control calls
//! (`proto::MigrateRequest`) driving the core's pause, export, import,
//! resume and finish (`vrdma_core::hca::migrate`).
//!
//! Who may: root and the daemon's own uid, the operator, never a guest.
//! A tenant must not pause, read or replace another tenant's device state,
//! nor its own (an import would let it forge its QPs' PSNs and keys), and
//! every process of the daemon's uid could already ptrace the daemon.
//!
//! How the snapshot travels: the operator's CLI carries it (export to a
//! file on the source, import from it on the destination), not the link
//! between daemons. The operator already has authority on both hosts and
//! must decide the destination anyway; a daemon link carrying snapshots
//! would let any authenticated daemon push device state into another
//! (the pre-shared key authenticates hosts, not operators), and would put
//! up to 256 MiB on the link the tenants' traffic shares. On one host the
//! file is a memfd; across hosts it goes by `scp` or a pipe over ssh.
//!
//! What an import maps: for a VM's tenant, its memory regions and rings at
//! the offsets of the VM's region the snapshot gives (`migrate_vm`); the
//! region's bytes moved with the VM. A tenant that is no VM's (a process)
//! has no memory here: an import with memory regions is refused (`no
//! memory for region`), and its QPs have no rings here (they keep their
//! connections, their peers follow them on resume, but post and complete
//! nothing).
//! While a tenant is paused (from `pause`, or its import here, to
//! `resume` or `finish`) its sessions' state-changing calls wait at its
//! gate (`pause_gate`): pause closes it, resume and finish open it.
//! `docs/migration.md` says what this round moves.

// An `Answer` is the reply to send whichever way a call ends (as in
// `session`); not on the data path, so its size in `Result` does not matter.
#![allow(clippy::result_large_err)]

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use rustix::fs::{MemfdFlags, SealFlags};
use vrdma_core::hca::migrate::{MigrateError, MAX_SNAPSHOT_BYTES};
use vrdma_core::hca::{ContextId, TenantId};
use vrdma_core::proto::{MigrateReply, MigrateRequest, Reply};

use super::session::{error, Answer, Carry};
use super::Shared;

/// How long an export waits for the engine to finish placing a frame's
/// payload for one of the tenant's QPs (the core refuses a snapshot
/// mid-frame; frames end within one chunk's bytes).
const EXPORT_WAIT: Duration = Duration::from_secs(2);
/// How long a pause (or an import) waits for the tenant's state-changing
/// calls under way to end (`pause_gate`).
const CALLS_WAIT: Duration = Duration::from_secs(2);

/// Whether the peer of a control connection is the host's operator: it
/// may drive migrations, and `vrdma stat` shows it the daemon's totals.
pub(super) fn is_operator(uid: u32) -> bool {
    uid == 0 || uid == rustix::process::geteuid().as_raw()
}

fn refused(e: MigrateError) -> Answer {
    let errno = match e {
        MigrateError::NoSuchTenant(_) => libc::ENOENT,
        MigrateError::HostLocal(_) | MigrateError::Unsupported(_) => libc::EOPNOTSUPP,
        MigrateError::NotPaused(_) => libc::EINVAL,
        MigrateError::Busy(_) => libc::EBUSY,
    };
    error(errno, e.to_string())
}

fn gone() -> Answer {
    error(libc::ENODEV, "the device engine has stopped")
}

/// Answers one migration call of a connection whose peer is `uid`
/// (`guest`: a VM's session, never an operator).
pub(super) fn handle(
    shared: &Arc<Shared>,
    uid: u32,
    guest: bool,
    req: MigrateRequest,
    mut fds: Vec<OwnedFd>,
) -> Result<Answer, Answer> {
    if guest || !is_operator(uid) {
        return Err(error(
            libc::EPERM,
            format!(
                "migration is for the operator (root or the daemon's uid {}), not uid {uid}",
                rustix::process::geteuid().as_raw()
            ),
        ));
    }
    let engine = &shared.engine;
    Ok(match req {
        MigrateRequest::Pause { tenant } => {
            // The tenant's state-changing calls wait from here, and those
            // under way end first (`pause_gate`).
            if !shared.gate.close(TenantId(tenant), CALLS_WAIT) {
                return Err(error(
                    libc::EBUSY,
                    format!("a call of tenant {tenant} that changes its state is still running after {CALLS_WAIT:?}"),
                ));
            }
            let r = engine.call(move |e| {
                let r = e.hca.pause_tenant(TenantId(tenant));
                if r.is_ok() {
                    // Its rdma_cm ids hold still too (they move with it).
                    e.cm.cm.pause_tenant(TenantId(tenant));
                }
                (r, e.hca.is_paused(TenantId(tenant)))
            });
            let (qps, paused) = r.map_err(|_| gone())?;
            shared.gate.sync(TenantId(tenant), paused);
            let qps = qps.map_err(refused)?;
            tracing::info!(tenant, qps, "operator paused a tenant for a migration");
            Reply::Migrated(MigrateReply::Paused { qps: qps as u32 }).into()
        }
        MigrateRequest::Export { tenant } => {
            let deadline = std::time::Instant::now() + EXPORT_WAIT;
            let (mut snap, positions, bindings, cm) = loop {
                let r = engine
                    .call(move |e| {
                        e.hca.snapshot_tenant(TenantId(tenant)).map(|s| {
                            let ctxs: Vec<_> = s.contexts.iter().map(|&c| ContextId(c)).collect();
                            let cm = e.cm.export(&ctxs);
                            // The SQ positions the daemon keeps outside the
                            // rings, for a VM's placement.
                            let at: std::collections::HashMap<u32, (u32, u32)> = s
                                .qps
                                .iter()
                                .filter_map(|q| Some((q.qpn, e.rings.qps.get(&q.qpn)?.positions())))
                                .collect();
                            // Each CQ's completion channel.
                            let on: std::collections::HashMap<u32, u32> = s
                                .cqs
                                .iter()
                                .filter_map(|c| Some((c.cq, e.rings.cqs.get(&c.cq)?.channel?)))
                                .collect();
                            (s, at, on, cm)
                        })
                    })
                    .map_err(|_| gone())?;
                match r {
                    Ok(done) => break done,
                    Err(MigrateError::Busy(_)) if std::time::Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(e) => return Err(refused(e)),
                }
            };
            // A VM's tenant: where its objects lie in the VM's region.
            if let Some(vm) = super::migrate_vm::vm_of(shared, tenant) {
                snap.placement = super::migrate_vm::placement(vm, &snap, &positions, &bindings)?;
                // Its guests' remembered answers: taken after the pause,
                // which waited for every state-changing call's answer to
                // be remembered (`guest_answers`).
                if snap.placement.is_some() {
                    snap.answers = super::guest_answers::of(vm, &snap.contexts);
                    // A guest's rdma_cm ids and channels move with it (its
                    // library keeps the channels' descriptors); a host
                    // process's connections end with it, as before.
                    snap.cm = cm;
                }
            }
            let (bytes, qps) = (snap.encode(), snap.qps.len());
            let fd = sealed_memfd(&bytes).map_err(Answer::from)?;
            tracing::info!(tenant, bytes = bytes.len(), qps, "operator exported a paused tenant");
            Answer {
                reply: Reply::Migrated(MigrateReply::Exported { len: bytes.len() as u64, qps: qps as u32 }),
                fds: vec![Carry::Fd(fd)],
            }
        }
        MigrateRequest::Import => {
            let fd = fds.pop().ok_or_else(|| error(libc::EINVAL, "an import needs the snapshot's fd"))?;
            let bytes = read_snapshot(&fd)?;
            // Bytes that are no snapshot are refused here, without taking
            // the engine from its tenants (the import decodes again, under
            // the engine's lock, with every other check).
            let snap = vrdma_core::hca::migrate::TenantSnapshot::decode(&bytes)
                .map_err(|e| error(libc::EINVAL, e.to_string()))?;
            // A VM's tenant: its regions and rings mapped where the
            // snapshot places them in the VM's region here.
            // The tenant arrives paused: its calls here (other processes'
            // of the same tenant, or a guest's that adopts its context
            // before resume) wait until resume, as at the source.
            let tenant = TenantId(snap.tenant);
            if !shared.gate.close(tenant, CALLS_WAIT) {
                return Err(error(
                    libc::EBUSY,
                    format!("a call of tenant {} that changes its state is still running", tenant.0),
                ));
            }
            let synced = |shared: &Arc<Shared>| {
                let paused = engine.call(move |e| e.hca.is_paused(tenant)).unwrap_or(false);
                shared.gate.sync(tenant, paused);
            };
            let attached = super::migrate_vm::attach(shared, &snap);
            let mut attached = match attached {
                Ok(a) => a,
                Err(e) => {
                    synced(shared);
                    return Err(e);
                }
            };
            let mut regions = attached.as_mut().map(|a| std::mem::take(&mut a.regions)).unwrap_or_default();
            let channels: Vec<u32> =
                snap.placement.iter().flat_map(|p| p.channels.iter().map(|c| c.id)).collect();
            let cm_snap = snap.cm.clone();
            let r = engine
                .call(move |e| {
                    if let Some(id) = channels.iter().find(|id| e.cm.has_channel(**id)) {
                        return Err(vrdma_core::hca::migrate::SnapshotError::Collision(format!(
                            "completion channel {id:#x} is in use here"
                        )));
                    }
                    let rings = &e.rings;
                    e.cm.check_import(tenant, &cm_snap, |n| {
                        rings.channels.contains_key(&n) || channels.contains(&n)
                    })?;
                    // Channels keep their numbers, as the core's objects do.
                    if let Some(id) = channels.iter().find(|id| e.rings.channels.contains_key(id)) {
                        return Err(vrdma_core::hca::migrate::SnapshotError::Collision(format!(
                            "completion channel {id:#x} is in use here"
                        )));
                    }
                    let now = e.now();
                    // A tenant without a placement has no memory here: a
                    // process's memory does not move (module doc).
                    // A completion channel is an object of its context, as
                    // when it was made: the core's quota check counts them
                    // with the rest, so an import that cannot hold them is
                    // refused before anything changes (the tenant's other
                    // contexts here untouched).
                    let t = e.hca.import_tenant_with(
                        &bytes,
                        now,
                        &mut |m| regions.remove(&m.key),
                        channels.len() as u32,
                    )?;
                    // Checked above, before anything changed; a doorbell
                    // that cannot be made undoes the import.
                    let cm_made = match e.cm.import(t, &cm_snap) {
                        Ok(made) => made,
                        Err(err) => {
                            let _ = e.hca.finish_export(t);
                            return Err(err);
                        }
                    };
                    // (Ids that cannot go on here have their events now.)
                    e.run_cm(now);
                    Ok::<_, vrdma_core::hca::migrate::SnapshotError>((
                        t,
                        e.hca.tenant_contexts(t).len(),
                        cm_made,
                    ))
                })
                .map_err(|_| gone());
            let r = match r {
                Ok(Ok(done)) => Ok(done),
                Ok(Err(e)) => Err(error(libc::EINVAL, e.to_string())),
                Err(e) => Err(e),
            };
            let (t, contexts, cm_made) = match r {
                Ok(done) => done,
                Err(e) => {
                    if let Some(a) = attached {
                        a.give_back();
                    }
                    synced(shared);
                    return Err(e);
                }
            };
            if let Some(a) = attached {
                // The tenant is paused: its rings are in place before resume.
                let vm = a.vm.clone();
                engine.call(move |e| a.install(&mut e.rings)).map_err(|_| gone())?;
                // The guests' remembered answers (checked by the core's
                // import), for the sessions that adopt their contexts.
                super::guest_answers::brought(&vm, &snap.answers);
                // Its rdma_cm channels wait for the adopting sessions as
                // its completion channels do.
                let mut placed = vm.placed();
                for c in cm_made {
                    placed.moved_channels.entry(c.ctx.0).or_default().push(crate::vm::MovedChannel {
                        id: c.id,
                        tenant_end: c.tenant_end,
                        produced_at_import: 0,
                    });
                }
            }
            let qps = engine
                .call(move |e| e.hca.snapshot_tenant(t).map_or(0, |s| s.qps.len()))
                .map_err(|_| gone())?;
            tracing::info!(tenant = t.0, contexts, qps, "operator imported a tenant, paused");
            Reply::Migrated(MigrateReply::Imported { tenant: t.0, qps: qps as u32 }).into()
        }
        MigrateRequest::Resume { tenant } => {
            let (qps, paused) = engine
                .call(move |e| {
                    let now = e.now();
                    let r = e.hca.resume_tenant(TenantId(tenant), now);
                    if r.is_ok() {
                        // Its connections tell their peers where they are.
                        e.cm.cm.resume_tenant(TenantId(tenant), now);
                        e.run_cm(now);
                    }
                    (r, e.hca.is_paused(TenantId(tenant)))
                })
                .map_err(|_| gone())?;
            // Its held calls run now (a cancelled migration: here).
            shared.gate.sync(TenantId(tenant), paused);
            let qps = qps.map_err(refused)?;
            tracing::info!(tenant, qps, "operator resumed a tenant");
            Reply::Migrated(MigrateReply::Resumed { qps: qps as u32 }).into()
        }
        MigrateRequest::VmTenant { name } => {
            let vm = shared
                .vms
                .get(&name)
                .ok_or_else(|| error(libc::ENOENT, format!("no VM {name:?} is configured in this daemon")))?;
            Reply::Migrated(MigrateReply::VmTenant { tenant: vm.config.tenant }).into()
        }
        MigrateRequest::Finish { tenant } => {
            let noted = shared.clone();
            let r = engine
                .call(move |e| {
                    let t = TenantId(tenant);
                    let ctxs = e.hca.tenant_contexts(t);
                    let td = e.hca.finish_export(t)?;
                    // Noted before the engine runs anything else: a guest's
                    // call it runs from now on fails only because its
                    // context left, and must not be answered (`guest::Port`).
                    for c in &ctxs {
                        noted.mark_moved(c.0);
                    }
                    // A guest's rdma_cm ids moved (its peers follow it);
                    // a host process's end with its session, as before.
                    // (After the note: a port that sees its channel's
                    // doorbell hang up tells its guest that it moved.)
                    let guests: Vec<ContextId> = (ctxs.iter())
                        .filter(|c| !matches!(e.processes.get(c), Some(crate::engine::Origin::Process(_))))
                        .copied()
                        .collect();
                    e.cm.forget(t, &guests);
                    let qps = td.qps.len();
                    e.rings.remove_torn_down(&td);
                    // Its completion channels (their rings move with the
                    // VM's region; a session's own close finds none left).
                    e.rings.channels.retain(|_, ch| !ctxs.contains(&ch.ctx));
                    // Event rings of contexts never adopted here (theirs
                    // move with the region too).
                    e.rings.forget_awaiting(&ctxs);
                    for c in &ctxs {
                        e.direct.forget_context(*c);
                    }
                    e.direct.sync(&mut e.hca);
                    Ok::<_, MigrateError>((ctxs, qps))
                })
                .map_err(|_| gone())?;
            let (ctxs, qps) = match r {
                Ok(done) => done,
                Err(e) => {
                    let paused = engine.call(move |e| e.hca.is_paused(TenantId(tenant))).unwrap_or(false);
                    shared.gate.sync(TenantId(tenant), paused);
                    return Err(refused(e));
                }
            };
            // The tenant lives elsewhere now: its processes' connections
            // here end (each session's close finds nothing left to free).
            for c in &ctxs {
                shared.end_session_moved(c.0);
            }
            // Its held calls find their sessions moved and are not run
            // (after the ends: a host session's answer finds its
            // connection closed).
            shared.gate.sync(TenantId(tenant), false);
            if let Some(vm) = super::migrate_vm::vm_of(shared, tenant) {
                super::migrate_vm::moved_away(vm, &ctxs);
            }
            tracing::info!(tenant, qps, contexts = ctxs.len(), "tenant moved away; its sessions here ended");
            Reply::Migrated(MigrateReply::Finished { qps: qps as u32, contexts: ctxs.len() as u32 }).into()
        }
    })
}

/// A sealed memfd holding `bytes`.
fn sealed_memfd(bytes: &[u8]) -> std::io::Result<OwnedFd> {
    let fd = rustix::fs::memfd_create("vrdma-snapshot", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
    let mut done = 0;
    while done < bytes.len() {
        done += rustix::io::write(&fd, &bytes[done..])?;
    }
    rustix::fs::fcntl_add_seals(
        &fd,
        SealFlags::WRITE | SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL,
    )?;
    Ok(fd)
}

/// The snapshot in the operator's fd: a regular file (or memfd) of at most
/// `MAX_SNAPSHOT_BYTES`, read from its start. Not a pipe or socket: a
/// writer that never closes would hold this session's thread.
fn read_snapshot(fd: &OwnedFd) -> Result<Vec<u8>, Answer> {
    let st = rustix::fs::fstat(fd).map_err(|e| Answer::from(std::io::Error::from(e)))?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
        return Err(error(libc::EINVAL, "the snapshot must come as a regular file or memfd"));
    }
    let len = u64::try_from(st.st_size).unwrap_or(u64::MAX);
    if len > MAX_SNAPSHOT_BYTES as u64 {
        return Err(error(
            libc::EFBIG,
            format!("a snapshot of {len} bytes is above the limit of {MAX_SNAPSHOT_BYTES}"),
        ));
    }
    let mut bytes = vec![0u8; len as usize];
    let mut done = 0usize;
    while done < bytes.len() {
        let n = rustix::io::pread(fd.as_fd(), &mut bytes[done..], done as u64)
            .map_err(|e| Answer::from(std::io::Error::from(e)))?;
        if n == 0 {
            // Shrunk under us: what is there is checked as it is.
            bytes.truncate(done);
            break;
        }
        done += n;
    }
    Ok(bytes)
}
