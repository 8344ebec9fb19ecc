//! The snapshot of a tenant's device state: what moves from one host's
//! daemon to another's when the tenant (a VM, later a checkpointed
//! process) migrates.
//!
//! The format is ours, versioned, and read as untrusted input: a 6-byte
//! header (`"vRMS"`, a big-endian u16 version) and then the body in
//! postcard (serde). Work requests are kept in the shared-memory ring's
//! own encoding, so that a WR from a snapshot passes the same decoder and
//! checks as one a tenant posts. Decoding here only parses; every id,
//! bound, reference and quota is checked by the import
//! (`super::import`), against the importing host's tables.
//!
//! What is NOT in a snapshot: the bytes of memory regions and of the
//! queue rings (send, receive, completion queues); they are in the
//! tenant's shared memory, which moves with the VM. Where they lie in it
//! is (version 2: [`super::placement`]; version 3 adds the completion
//! channels' rings there, version 6 the owners of a guest's memory
//! extents). Nor anything that
//! names a link or a host-local number: links are renumbered by the host
//! that resumes, requests by their serials.

use serde::{Deserialize, Serialize};

use super::placement::Placement;
use crate::ring::{RecvWr, SendWr};
use crate::verbs::{AhAttr, QpAttr, QpInitAttr, SrqAttr, WcStatus};

/// The first four bytes of a snapshot.
pub const SNAPSHOT_MAGIC: [u8; 4] = *b"vRMS";
/// The version this code writes and reads.
/// Version 2 added [`TenantSnapshot::placement`], version 3 its
/// completion channels ([`super::placement::ChannelAt`]), version 4 the
/// guests' remembered answers ([`TenantSnapshot::answers`]), version 5
/// the rdma_cm ids and event channels ([`TenantSnapshot::cm`]), version
/// 6 the owners of a guest's memory extents
/// ([`super::placement::MemoryAt`]) and the memory regions of pieces
/// ([`super::placement::MrPiecesAt`]), at the end of the placement:
/// postcard is not self-describing, so a field added anywhere is a new
/// version.
pub const SNAPSHOT_VERSION: u16 = 6;
/// Bytes before the body.
pub const SNAPSHOT_HEADER_LEN: usize = 6;
/// The largest snapshot accepted: far above what a tenant within its
/// quotas can hold (a WR is at most a few hundred bytes), and a bound on
/// what a forged one can make the importer parse.
pub const MAX_SNAPSHOT_BYTES: usize = 256 << 20;

/// Why a snapshot was refused (decoding or import).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    #[error("snapshot truncated: {0} bytes")]
    Truncated(usize),
    #[error("snapshot of {0} bytes, above the limit of {MAX_SNAPSHOT_BYTES}")]
    TooLarge(usize),
    #[error("not a vRDMA snapshot (bad magic)")]
    BadMagic,
    #[error("snapshot version {0}; this daemon reads version {SNAPSHOT_VERSION}")]
    UnsupportedVersion(u16),
    #[error("snapshot body does not decode: {0}")]
    Malformed(String),
    #[error("snapshot refused: {0}")]
    Invalid(String),
    #[error("snapshot collides with this host: {0}")]
    Collision(String),
    #[error("snapshot refused by the tenant's quota: {0}")]
    Quota(String),
}

pub(crate) fn invalid(msg: impl Into<String>) -> SnapshotError {
    SnapshotError::Invalid(msg.into())
}

/// A work request in the ring's encoding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WrBytes(pub Vec<u8>);

impl WrBytes {
    pub(crate) fn send(wr: &SendWr) -> WrBytes {
        let mut slot = vec![
            0u8;
            crate::ring::send_stride(crate::ring::MAX_SGE as u32, 0)
                .max(crate::ring::send_stride(0, crate::ring::MAX_INLINE as u32))
        ];
        // Every WR the core holds decoded from a slot of at most this size.
        if let Err(e) = wr.encode(&mut slot) {
            debug_assert!(false, "re-encoding a WR we decoded: {e:?}");
        }
        WrBytes(slot)
    }

    pub(crate) fn recv(wr: &RecvWr) -> WrBytes {
        let mut slot = vec![0u8; crate::ring::recv_stride(crate::ring::MAX_SGE as u32)];
        if let Err(e) = wr.encode(&mut slot) {
            debug_assert!(false, "re-encoding a WR we decoded: {e:?}");
        }
        WrBytes(slot)
    }

    pub(crate) fn decode_send(&self) -> Result<SendWr, SnapshotError> {
        SendWr::decode(&self.0).map_err(|(id, e)| invalid(format!("send WR {id:#x}: {e}")))
    }

    pub(crate) fn decode_recv(&self) -> Result<RecvWr, SnapshotError> {
        RecvWr::decode(&self.0).map_err(|(id, e)| invalid(format!("receive WR {id:#x}: {e}")))
    }
}

/// A tenant's device state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantSnapshot {
    pub tenant: u32,
    pub contexts: Vec<u32>,
    pub pds: Vec<PdSnap>,
    pub mrs: Vec<MrSnap>,
    pub cqs: Vec<CqSnap>,
    pub srqs: Vec<SrqSnap>,
    pub ahs: Vec<AhSnap>,
    pub qps: Vec<QpSnap>,
    /// For a VM's tenant: where each memory region and ring lies in the
    /// VM's region (filled by the daemon, which knows; `None` for a
    /// tenant whose memory is not one region).
    pub placement: Option<Placement>,
    /// For a VM's tenant (version 4): per guest context, the number and
    /// encoded reply of the last numbered call its session answered
    /// (filled by the daemon), so that the same call re-sent on the
    /// destination after its reply was lost in the move is answered from
    /// there, not run a second time.
    pub answers: Vec<AnswerSnap>,
    /// The tenant's rdma_cm ids and event channels (version 5; filled by
    /// the daemon, which keeps the channels; `crate::cm::migrate`).
    pub cm: crate::cm::migrate::CmSnapshot,
}

/// The last numbered call a guest context's session answered: its number
/// and its reply, a guest `Reply` frame's body
/// (`proto::guest::encode_reply_body`), at most
/// `proto::guest::MAX_REMEMBERED_REPLY` bytes; empty when the reply was
/// larger (a query's: sent again, it runs again).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AnswerSnap {
    pub ctx: u32,
    pub number: u64,
    pub reply: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PdSnap {
    pub pd: u32,
    pub ctx: u32,
}

/// A memory region: its key (lkey = rkey) and where it sits in the
/// tenant's address space; its bytes stay in the tenant's memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MrSnap {
    pub key: u32,
    pub ctx: u32,
    pub pd: u32,
    pub addr: u64,
    pub len: u64,
    pub access: u32,
}

/// A completion queue; its pending completions are in its ring.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CqSnap {
    pub cq: u32,
    pub ctx: u32,
    pub ring_bytes: u64,
    pub overrun: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SrqSnap {
    pub srq: u32,
    pub ctx: u32,
    pub pd: u32,
    pub attr: SrqAttr,
    pub ring_bytes: u64,
    /// Receive WRs taken for a message that was abandoned.
    pub requeued: Vec<WrBytes>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AhSnap {
    pub ah: u32,
    pub ctx: u32,
    pub pd: u32,
    pub attr: AhAttr,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QpSnap {
    pub qpn: u32,
    pub ctx: u32,
    pub pd: u32,
    pub init: QpInitAttr,
    pub attr: QpAttr,
    pub resets: u32,
    pub sqd_notify: bool,
    /// The QP's migration generation on the host that resumes it.
    pub epoch: u32,
    pub requeued: Vec<WrBytes>,
    pub send: Option<SendSnap>,
    pub recv: Option<RecvSnap>,
}

/// The requester half of an RC QP across hosts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendSnap {
    pub next_psn: u32,
    /// The chunk size its requests were numbered at (PSNs per request).
    pub chunk: u32,
    pub sent: Vec<SentSnap>,
    pub blocked: Option<(WrBytes, WcStatus)>,
    pub rnr_left: u8,
    pub retries_left: u8,
}

/// An outstanding (unacknowledged) work request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SentSnap {
    pub wr: WrBytes,
    pub first_psn: u32,
    pub npsn: u32,
    pub status: Option<WcStatus>,
    pub went_out: bool,
}

/// The responder half of an RC QP across hosts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecvSnap {
    pub epsn: u32,
    pub msn: u32,
    pub cur: Option<InMsgSnap>,
    /// The last atomics executed, by PSN, with the value each returned.
    pub atomics: Vec<(u32, u64)>,
}

/// A message the responder has received part of.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum InMsgSnap {
    Send { recv: WrBytes, got: u64 },
    Write { va: u64, rkey: u32, dma_len: u64, got: u64 },
    WriteImm { recv: WrBytes },
}

impl TenantSnapshot {
    /// Checks the remembered answers (untrusted, like the rest): each of
    /// a context of the snapshot, one per context, numbered (not 0), its
    /// reply at most `MAX_REMEMBERED_REPLY` bytes and, unless empty, a
    /// reply frame's body.
    pub fn check_answers(&self) -> Result<(), SnapshotError> {
        use crate::proto::guest::{decode_reply_body, MAX_REMEMBERED_REPLY};
        let mut seen = std::collections::HashSet::with_capacity(self.answers.len().min(self.contexts.len()));
        for a in &self.answers {
            let what = format!("the remembered answer of context {}", a.ctx);
            if !self.contexts.contains(&a.ctx) {
                return Err(invalid(format!("{what}: not a context of the snapshot")));
            }
            if !seen.insert(a.ctx) {
                return Err(invalid(format!("{what}: appears twice")));
            }
            if a.number == 0 {
                return Err(invalid(format!("{what}: call number 0 (calls are numbered from 1)")));
            }
            if a.reply.len() > MAX_REMEMBERED_REPLY {
                return Err(invalid(format!(
                    "{what}: {} bytes, above the limit of {MAX_REMEMBERED_REPLY}",
                    a.reply.len()
                )));
            }
            if !a.reply.is_empty() {
                decode_reply_body(&a.reply).map_err(|e| invalid(format!("{what}: {e}")))?;
            }
        }
        Ok(())
    }

    /// Checks the rdma_cm part (untrusted, like the rest): see
    /// [`crate::cm::migrate::CmSnapshot::check`].
    pub fn check_cm(&self) -> Result<(), SnapshotError> {
        if self.placement.is_none() && (!self.cm.channels.is_empty() || !self.cm.ids.is_empty()) {
            return Err(invalid("rdma_cm state without a placement: only a VM's tenant moves its ids"));
        }
        let qps: Vec<(u32, u32)> = self.qps.iter().map(|q| (q.ctx, q.qpn)).collect();
        self.cm.check(&self.contexts, &qps)
    }

    /// The snapshot's bytes: header, then the body.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(1024);
        out.extend_from_slice(&SNAPSHOT_MAGIC);
        out.extend_from_slice(&SNAPSHOT_VERSION.to_be_bytes());
        // Serialising these plain structs into a Vec does not fail; if it
        // did, the empty result is a snapshot every importer refuses.
        postcard::to_extend(self, out).unwrap_or_else(|e| {
            debug_assert!(false, "postcard into a Vec: {e}");
            Vec::new()
        })
    }

    /// Parses a snapshot's bytes (untrusted): header, size, body. The body
    /// must be consumed exactly.
    pub fn decode(bytes: &[u8]) -> Result<TenantSnapshot, SnapshotError> {
        if bytes.len() > MAX_SNAPSHOT_BYTES {
            return Err(SnapshotError::TooLarge(bytes.len()));
        }
        if bytes.len() < SNAPSHOT_HEADER_LEN {
            return Err(SnapshotError::Truncated(bytes.len()));
        }
        if bytes[..4] != SNAPSHOT_MAGIC {
            return Err(SnapshotError::BadMagic);
        }
        let version = u16::from_be_bytes([bytes[4], bytes[5]]);
        if version != SNAPSHOT_VERSION {
            return Err(SnapshotError::UnsupportedVersion(version));
        }
        let (snap, rest) = postcard::take_from_bytes::<TenantSnapshot>(&bytes[SNAPSHOT_HEADER_LEN..])
            .map_err(|e| SnapshotError::Malformed(e.to_string()))?;
        if !rest.is_empty() {
            return Err(SnapshotError::Malformed(format!("{} bytes after the body", rest.len())));
        }
        Ok(snap)
    }
}
