//! The operator's live-migration steps (`docs/migration.md`): pause,
//! export, import, resume and finish a tenant's device state, each on the
//! daemon at `socket`. The daemon answers root and its own uid only.
//!
//! The snapshot comes and goes as a file descriptor: [`export`] returns a
//! sealed memfd, [`import`] takes a regular file or memfd.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::Path;

use vrdma_core::proto::{MigrateReply, MigrateRequest, Reply, Request};

use crate::control::{unexpected, Control};
use crate::error::{Error, Result};

fn step(socket: &Path, m: MigrateRequest, fds: &[BorrowedFd<'_>]) -> Result<(MigrateReply, Vec<OwnedFd>)> {
    let control = Control::connect(socket)?;
    let req = Request::Migrate(m);
    let answer = control.call(&req, fds)?;
    match answer.reply {
        Reply::Migrated(r) => {
            let n = usize::from(matches!(r, MigrateReply::Exported { .. }));
            Ok((r, answer.take_fds(n, "Migrated")?))
        }
        ref other => Err(unexpected(&req, other)),
    }
}

fn odd(what: &str, r: MigrateReply) -> Error {
    Error::protocol(format!("{what} answered {r:?}"))
}

/// The tenant of the daemon's VM `name` (its configured `tenant`).
pub fn vm_tenant(socket: &Path, name: &str) -> Result<u32> {
    match step(socket, MigrateRequest::VmTenant { name: name.to_string() }, &[])? {
        (MigrateReply::VmTenant { tenant }, _) => Ok(tenant),
        (r, _) => Err(odd("vm-tenant", r)),
    }
}

/// Pauses tenant (uid) `tenant`'s QPs; returns how many.
pub fn pause(socket: &Path, tenant: u32) -> Result<u32> {
    match step(socket, MigrateRequest::Pause { tenant }, &[])? {
        (MigrateReply::Paused { qps }, _) => Ok(qps),
        (r, _) => Err(odd("pause", r)),
    }
}

/// The paused tenant's snapshot: a sealed memfd, its length, its QPs.
pub fn export(socket: &Path, tenant: u32) -> Result<(OwnedFd, u64, u32)> {
    match step(socket, MigrateRequest::Export { tenant }, &[])? {
        (MigrateReply::Exported { len, qps }, mut fds) => {
            let fd = fds.pop().ok_or_else(|| Error::protocol("Exported without its memfd"))?;
            Ok((fd, len, qps))
        }
        (r, _) => Err(odd("export", r)),
    }
}

/// Imports the snapshot in `snapshot` (a regular file or memfd), paused;
/// returns its tenant and QPs.
pub fn import(socket: &Path, snapshot: BorrowedFd<'_>) -> Result<(u32, u32)> {
    match step(socket, MigrateRequest::Import, &[snapshot])? {
        (MigrateReply::Imported { tenant, qps }, _) => Ok((tenant, qps)),
        (r, _) => Err(odd("import", r)),
    }
}

/// Resumes the paused tenant; returns how many QPs it has.
pub fn resume(socket: &Path, tenant: u32) -> Result<u32> {
    match step(socket, MigrateRequest::Resume { tenant }, &[])? {
        (MigrateReply::Resumed { qps }, _) => Ok(qps),
        (r, _) => Err(odd("resume", r)),
    }
}

/// Drops the paused tenant's objects at the source and ends its sessions
/// there; returns the QPs and contexts dropped.
pub fn finish(socket: &Path, tenant: u32) -> Result<(u32, u32)> {
    match step(socket, MigrateRequest::Finish { tenant }, &[])? {
        (MigrateReply::Finished { qps, contexts }, _) => Ok((qps, contexts)),
        (r, _) => Err(odd("finish", r)),
    }
}
