//! Control frames: Hello, Auth, Keepalive, Close. Each is a fixed-length
//! header with no payload; offsets below are from the frame's start (the
//! 12-byte base header comes first).

use super::{
    check_zero, get_u16, get_u32, get_u64, put_u16, put_u32, put_u64, WireError, BASE_HEADER_LEN, MAX_CHUNK,
    MIN_CHUNK, MIN_VERSION, VERSION,
};
use crate::verbs::Gid;

pub(super) const HELLO_LEN: usize = BASE_HEADER_LEN + 68;
pub(super) const AUTH_LEN: usize = BASE_HEADER_LEN + 32;
pub(super) const KEEPALIVE_LEN: usize = BASE_HEADER_LEN + 12;
pub(super) const CLOSE_LEN: usize = BASE_HEADER_LEN + 8;

/// Bytes of an authentication tag (HMAC-SHA256) and of a Hello nonce.
pub const TAG_LEN: usize = 32;
pub const NONCE_LEN: usize = 32;

/// Which end of the TCP connection a daemon is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Role {
    /// The daemon that called `connect`.
    Initiator = 0,
    /// The daemon that accepted.
    Acceptor = 1,
}

impl Role {
    pub fn from_raw(v: u8) -> Result<Role, WireError> {
        match v {
            0 => Ok(Role::Initiator),
            1 => Ok(Role::Acceptor),
            _ => Err(WireError::UnknownRole(v)),
        }
    }
    pub fn peer(self) -> Role {
        match self {
            Role::Initiator => Role::Acceptor,
            Role::Acceptor => Role::Initiator,
        }
    }
}

/// The first frame each side sends.
///
/// ```text
/// 12 min_version u8  13 max_version u8  14 role u8  15 reserved u8
/// 16 max_chunk u32   20 daemon_id u64   28 gid [16]
/// 44 lid u16         46 reserved u16    48 nonce [32]      (80 bytes)
/// ```
///
/// A Hello (and a Close) is always framed with base-header version 1
/// ([`HELLO_VERSION`](super::HELLO_VERSION)), whatever versions it offers,
/// so that every version can read every Hello.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HelloRepr {
    pub min_version: u8,
    pub max_version: u8,
    pub role: Role,
    /// Largest chunk this daemon sends or accepts; the connection uses the
    /// smaller of the two. A power of two in `MIN_CHUNK..=MAX_CHUNK`.
    pub max_chunk: u32,
    /// The daemon's identity from its configuration; the key the peer
    /// looks up the pre-shared key by.
    pub daemon_id: u64,
    /// The host's port GID and LID, as the GRH of UD traffic names them.
    pub gid: Gid,
    pub lid: u16,
    /// A fresh random challenge; the peer's Auth tag covers it.
    pub nonce: [u8; NONCE_LEN],
}

impl HelloRepr {
    /// A Hello for this code's version range.
    pub fn new(role: Role, daemon_id: u64, gid: Gid, lid: u16, nonce: [u8; NONCE_LEN]) -> HelloRepr {
        HelloRepr {
            min_version: MIN_VERSION,
            max_version: VERSION,
            role,
            max_chunk: MAX_CHUNK,
            daemon_id,
            gid,
            lid,
            nonce,
        }
    }

    pub(super) fn check(&self) -> Result<(), WireError> {
        if self.min_version == 0 || self.min_version > self.max_version {
            return Err(WireError::BadVersionRange { min: self.min_version, max: self.max_version });
        }
        let c = self.max_chunk;
        if !(MIN_CHUNK..=MAX_CHUNK).contains(&c) || !c.is_power_of_two() {
            return Err(WireError::BadChunkSize(c));
        }
        Ok(())
    }

    pub(super) fn read(b: &[u8]) -> Result<HelloRepr, WireError> {
        check_zero(&b[15..16], "hello.reserved1")?;
        check_zero(&b[46..48], "hello.reserved2")?;
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[28..44]);
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&b[48..80]);
        let h = HelloRepr {
            min_version: b[12],
            max_version: b[13],
            role: Role::from_raw(b[14])?,
            max_chunk: get_u32(b, 16),
            daemon_id: get_u64(b, 20),
            gid: Gid(gid),
            lid: get_u16(b, 44),
            nonce,
        };
        h.check()?;
        Ok(h)
    }

    pub(super) fn write(&self, b: &mut [u8]) {
        b[12] = self.min_version;
        b[13] = self.max_version;
        b[14] = self.role as u8;
        b[15] = 0;
        put_u32(b, 16, self.max_chunk);
        put_u64(b, 20, self.daemon_id);
        b[28..44].copy_from_slice(&self.gid.0);
        put_u16(b, 44, self.lid);
        put_u16(b, 46, 0);
        b[48..80].copy_from_slice(&self.nonce);
    }

    /// The version both daemons use: the highest that both ranges and this
    /// code contain.
    pub fn negotiate_version(&self, peer: &HelloRepr) -> Result<u8, WireError> {
        let hi = self.max_version.min(peer.max_version).min(VERSION);
        let lo = self.min_version.max(peer.min_version);
        if hi < lo {
            Err(WireError::NoCommonVersion {
                min: self.min_version,
                max: self.max_version,
                peer_min: peer.min_version,
                peer_max: peer.max_version,
            })
        } else {
            Ok(hi)
        }
    }

    /// The chunk size the connection uses: the smaller offer.
    pub fn negotiate_chunk(&self, peer: &HelloRepr) -> u32 {
        self.max_chunk.min(peer.max_chunk)
    }
}

/// Liveness probe; a `reply: false` frame is answered with the same `seq`
/// and `reply: true`.
///
/// ```text
/// 12 seq u64  20 reply u8 (0 or 1)  21 reserved [3]      (24 bytes)
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeepaliveRepr {
    pub seq: u64,
    pub reply: bool,
}

impl KeepaliveRepr {
    pub(super) fn read(b: &[u8]) -> Result<KeepaliveRepr, WireError> {
        check_zero(&b[21..24], "keepalive.reserved")?;
        let reply = match b[20] {
            0 => false,
            1 => true,
            v => return Err(WireError::OutOfRange { field: "keepalive.reply", value: v.into() }),
        };
        Ok(KeepaliveRepr { seq: get_u64(b, 12), reply })
    }

    pub(super) fn write(&self, b: &mut [u8]) {
        put_u64(b, 12, self.seq);
        b[20] = self.reply as u8;
        b[21..24].fill(0);
    }
}

/// Why a daemon closes the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum CloseReason {
    /// Orderly close: no QP uses the connection any more.
    Normal = 0,
    /// The daemon is shutting down; its QPs go to the error state.
    Shutdown = 1,
    /// The peer sent a frame the decoder refused.
    ProtocolError = 2,
    /// The peer's Auth tag did not verify, or its daemon id is unknown.
    AuthFailed = 3,
    /// The Hellos have no version in common.
    VersionMismatch = 4,
    /// No frame from the peer within the keepalive timeout.
    KeepaliveTimeout = 5,
}

impl CloseReason {
    pub fn from_raw(v: u16) -> Result<CloseReason, WireError> {
        use CloseReason::*;
        Ok(match v {
            0 => Normal,
            1 => Shutdown,
            2 => ProtocolError,
            3 => AuthFailed,
            4 => VersionMismatch,
            5 => KeepaliveTimeout,
            _ => return Err(WireError::UnknownCloseReason(v)),
        })
    }
}

/// The last frame a daemon sends before closing the socket.
///
/// ```text
/// 12 reason u16  14 reserved u16  16 detail u32      (20 bytes)
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CloseRepr {
    pub reason: CloseReason,
    /// Free for diagnostics (for example the offending frame's type).
    pub detail: u32,
}

impl CloseRepr {
    pub(super) fn read(b: &[u8]) -> Result<CloseRepr, WireError> {
        check_zero(&b[14..16], "close.reserved")?;
        Ok(CloseRepr { reason: CloseReason::from_raw(get_u16(b, 12))?, detail: get_u32(b, 16) })
    }

    pub(super) fn write(&self, b: &mut [u8]) {
        put_u16(b, 12, self.reason as u16);
        put_u16(b, 14, 0);
        put_u32(b, 16, self.detail);
    }
}
