//! The operator's live-migration calls on the control socket
//! (`docs/migration.md`, "Driving it").
//!
//! They come on a connection of their own, before (and instead of) Hello:
//! an operator's call opens no context and is no tenant's. The daemon
//! answers them for root and for its own uid only, never for a guest
//! (whose calls come over its VM's port, not this socket), whatever
//! tenant the caller would be.
//!
//! The snapshot travels as a file descriptor, not in the message (a
//! snapshot may be far above [`MAX_MESSAGE`](super::MAX_MESSAGE)): the
//! export's reply carries a sealed memfd of it, an import's request a
//! regular file or memfd holding it, which the daemon reads bounded by
//! [`MAX_SNAPSHOT_BYTES`](crate::hca::migrate::MAX_SNAPSHOT_BYTES) and
//! checks as the untrusted bytes they are.

use serde::{Deserialize, Serialize};

/// One step of a migration, on the daemon the step is for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MigrateRequest {
    /// Pause every QP of tenant (uid) `tenant` here; answered
    /// [`MigrateReply::Paused`].
    Pause { tenant: u32 },
    /// The paused tenant's snapshot; answered [`MigrateReply::Exported`]
    /// with one fd, a sealed memfd of `len` bytes.
    Export { tenant: u32 },
    /// With one fd (a regular file or memfd): import the snapshot it
    /// holds, paused; answered [`MigrateReply::Imported`].
    Import,
    /// Resume the paused tenant here (on the destination after an import,
    /// or on the source to cancel); answered [`MigrateReply::Resumed`].
    Resume { tenant: u32 },
    /// The tenant moved away: drop its objects here and end its sessions;
    /// answered [`MigrateReply::Finished`].
    Finish { tenant: u32 },
    /// The tenant of VM `name` (its `[vms.NAME]` `tenant`), for the steps
    /// above; answered [`MigrateReply::VmTenant`].
    VmTenant { name: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MigrateReply {
    Paused { qps: u32 },
    Exported { len: u64, qps: u32 },
    Imported { tenant: u32, qps: u32 },
    Resumed { qps: u32 },
    Finished { qps: u32, contexts: u32 },
    VmTenant { tenant: u32 },
}
