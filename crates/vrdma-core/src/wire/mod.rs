//! The daemon-to-daemon wire format: frames that carry verbs operations
//! between the daemons of two hosts over one TCP byte stream.
//!
//! The full specification, with every offset, is `docs/wire-protocol.md`;
//! this module is its one implementation.
//!
//! # Why this shape
//!
//! The format follows the InfiniBand RC/UD transport (BTH, RETH, AETH,
//! AtomicETH, AtomicAckETH, ImmDt, DETH/GRH), so that the requester and
//! responder rules the single-host datapath (`hca::datapath`) already
//! follows carry over one to one: a PSN per chunk, ACK/NAK syndromes that
//! map onto the work-completion statuses, RNR NAKs with the `min_rnr_timer`
//! encoding. What differs from IB is the framing: a byte stream has no
//! packet boundaries, so every frame starts with a fixed base header that
//! says how long the header is and how many payload bytes follow it.
//!
//! The code is sans-IO, in the manner of smoltcp's `wire` module:
//!
//! - [`Packet`] is a view over a byte buffer with field accessors at fixed
//!   offsets; [`FrameRepr`] (and the per-type `*Repr`s) are the decoded,
//!   validated values, with `parse`, `emit` and `header_len`.
//! - [`FrameDecoder`] turns a byte stream fed in arbitrary pieces into
//!   [`Event`]s. It hands out the header *before* the payload is read, so
//!   the transport can check the destination (QP, rkey, bounds, offset)
//!   and then read the payload from the socket straight into the mapped
//!   region, with no staging copy ([`FrameDecoder::payload_placed`]). On
//!   the sending side the header is emitted into a small buffer and the
//!   payload goes from the region to the socket beside it (one `writev`).
//! - [`auth`] is the pre-shared-key challenge-response, as pure functions:
//!   the nonces come in as parameters, nothing here draws randomness.
//!
//! Everything parsed here is hostile input. Every length is checked before
//! it is used, every reserved byte must be zero, unknown versions, frame
//! types, opcodes, flags, syndromes and reasons are rejected with a
//! [`WireError`] that names them, nothing panics, and nothing allocates:
//! the decoder's only buffer is a fixed array of [`MAX_HEADER_LEN`] bytes,
//! and a claimed payload length above [`MAX_FRAME_PAYLOAD`] is refused as
//! soon as the 12-byte base header is in. Because every field is checked
//! and reserved bytes are zero, an accepted header re-emits to exactly the
//! bytes it was parsed from (the tests and the fuzz target hold it to that).
//!
//! All multi-byte fields are big-endian (network order), unlike the
//! shared-memory ring entries, which are little-endian host memory.

mod aeth;
pub mod auth;
pub mod cm;
mod control;
mod decoder;
mod frame;
mod moved;
mod opcode;
pub mod sock;

#[cfg(test)]
mod tests;

pub use aeth::{Aeth, NakCode, Syndrome};
pub use control::{CloseReason, CloseRepr, HelloRepr, KeepaliveRepr, Role, NONCE_LEN, TAG_LEN};
pub use decoder::{Event, FrameDecoder, Want};
pub use frame::{parse_frame, AtomicEth, DataFlags, DataRepr, FrameRepr, FrameType, Packet, Reth, UdEth};
pub use moved::MovedRepr;
pub use opcode::{Exts, Opcode};

/// The first two bytes of every frame: `"vR"`.
pub const MAGIC: u16 = 0x7652;
/// The highest protocol version this code speaks; [`HelloRepr`] carries
/// the range each side supports, and a link uses the highest both do.
///
/// Version 2 is version 1 with the live-migration extension (the PAUSED
/// NAK and the Moved frame): a version-1 daemon ends a link on either, so
/// this code does not speak version 1 at all and a version-1 peer is
/// refused at the Hello (`VersionMismatch`), clearly, before any traffic.
///
/// Version 3 is version 2 with one more frame type, the socket registry's
/// Sock frame ([`sock`]), and nothing else changed: its frames keep the
/// base-header version [`FRAME_VERSION`], and a daemon sends Sock frames
/// only on a link that negotiated 3, so a version-2 daemon (which would
/// refuse the unknown frame type, `UnknownFrameType`, and end the link)
/// never gets one; its hosts' sockets stay plain TCP.
///
/// Version 4 is version 3 with more kinds of Sock message, appended
/// (IPv6 across hosts: a host's IPv6 addresses, and IPv6 lookups,
/// announcements and resolves, [`sock`]), and Sock payloads up to
/// [`sock::MAX_SOCK_PAYLOAD`] bytes (version 3: 128); nothing else
/// changed and the old kinds keep their bytes. A version-3 daemon's
/// decoder refuses an unknown kind and ends the link, so a daemon sends
/// the new kinds only on a link that negotiated 4; a version-3 peer's
/// hosts' IPv6 connections stay plain TCP.
pub const VERSION: u8 = 4;
/// The first version with the Sock frame.
pub const SOCK_VERSION: u8 = 3;
/// The first version with the IPv6 Sock messages.
pub const SOCK6_VERSION: u8 = 4;
/// The base-header version of every frame but Hello and Close: the frame
/// layout of version 2, which version 3 keeps.
pub const FRAME_VERSION: u8 = 2;
/// The oldest version this code speaks (see [`VERSION`]).
pub const MIN_VERSION: u8 = 2;
/// The base-header version Hello and Close frames always carry, whatever
/// the connection's version: every version reads every Hello, and the
/// Close that refuses a version it cannot speak.
pub const HELLO_VERSION: u8 = 1;
/// Bytes of the base header every frame starts with.
pub const BASE_HEADER_LEN: usize = 12;
/// Bytes of the base header plus the BTH-like part every data frame has.
pub const DATA_HEADER_LEN: usize = BASE_HEADER_LEN + 24;
/// Largest chunk of one message a single frame carries.
pub const MAX_CHUNK: u32 = 64 * 1024;
/// Smallest chunk size a daemon may offer in its Hello.
pub const MIN_CHUNK: u32 = 256;
/// Largest payload any frame may claim; a larger claim ends the connection.
pub const MAX_FRAME_PAYLOAD: u32 = MAX_CHUNK;
/// Largest header of any frame (the Hello's).
pub const MAX_HEADER_LEN: usize = control::HELLO_LEN;
/// Largest data-frame header (a UD send with immediate, or an atomic).
pub const MAX_DATA_HEADER_LEN: usize = DATA_HEADER_LEN + 28;
/// Largest QP number, PSN or MSN: they are 24-bit, as in InfiniBand.
pub const MAX_24: u32 = 0x00ff_ffff;

/// Why bytes from the wire were refused, or a frame could not be emitted.
/// Every error from the decoder ends the connection: the stream has no
/// resynchronisation point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("frame truncated")]
    Truncated,
    #[error("bad magic {0:#06x}")]
    BadMagic(u16),
    #[error("unsupported frame version {0}")]
    UnsupportedVersion(u8),
    #[error("unknown frame type {0:#04x}")]
    UnknownFrameType(u8),
    #[error("unknown opcode {0:#04x}")]
    UnknownOpcode(u8),
    #[error("header length {got}, expected {min}..={max}")]
    BadHeaderLen { got: u16, min: u16, max: u16 },
    #[error("payload of {0} bytes exceeds the limit of {MAX_FRAME_PAYLOAD}")]
    PayloadTooLong(u32),
    #[error("a payload on a frame that carries none")]
    UnexpectedPayload,
    #[error("a connection manager's message of {0} bytes (1..={max} allowed)", max = cm::MAX_CM_PAYLOAD)]
    BadCmLen(u32),
    #[error("a connection manager's message that does not decode")]
    BadCmMessage,
    #[error("a socket registry's message of {0} bytes (1..={max} allowed)", max = sock::MAX_SOCK_PAYLOAD)]
    BadSockLen(u32),
    #[error("a socket registry's message that does not decode")]
    BadSockMessage,
    #[error("an empty payload on a first or middle chunk")]
    EmptyChunk,
    #[error("reserved field {0} is not zero")]
    ReservedNotZero(&'static str),
    #[error("flags {0:#04x} are not allowed on this frame")]
    BadFlags(u8),
    #[error("{field} {value:#x} is out of range")]
    OutOfRange { field: &'static str, value: u64 },
    #[error("bad AETH syndrome {0:#04x} for this opcode")]
    BadSyndrome(u8),
    #[error("unknown close reason {0}")]
    UnknownCloseReason(u16),
    #[error("unknown role {0}")]
    UnknownRole(u8),
    #[error("bad version range {min}..={max}")]
    BadVersionRange { min: u8, max: u8 },
    #[error(
        "no wire protocol version both daemons speak: the peer speaks {peer_min}..={peer_max}, this daemon \
         {min}..={max} (version 2 is the live-migration extension; a daemon that speaks only 1 must be upgraded)"
    )]
    NoCommonVersion { min: u8, max: u8, peer_min: u8, peer_max: u8 },
    #[error("bad chunk size {0}")]
    BadChunkSize(u32),
    #[error("message offset {0} is not allowed for this opcode")]
    BadOffset(u32),
    #[error("RDMA address range overflows")]
    RangeOverflow,
    #[error("chunk length does not agree with the RETH DMA length")]
    LengthMismatch,
    #[error("extension headers do not match the opcode")]
    ExtMismatch,
    #[error("buffer too small for the frame")]
    BufferTooSmall,
    #[error("more payload bytes placed than the frame has")]
    PayloadOverrun,
}

/// `a + n` in 24-bit PSN arithmetic.
pub fn psn_add(a: u32, n: u32) -> u32 {
    a.wrapping_add(n) & MAX_24
}

/// Signed distance from `b` to `a` in 24-bit PSN arithmetic: positive when
/// `a` is ahead of `b` (within half the PSN space).
pub fn psn_diff(a: u32, b: u32) -> i32 {
    let d = a.wrapping_sub(b) & MAX_24;
    if d & 0x0080_0000 != 0 {
        d as i32 - 0x0100_0000
    } else {
        d as i32
    }
}

/// Chunks (and so PSNs) a message of `len` bytes takes at chunk size
/// `chunk`: a zero-length message still takes one.
pub fn chunk_count(len: u64, chunk: u32) -> u64 {
    len.div_ceil(u64::from(chunk.max(1))).max(1)
}

fn get_u16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn get_u32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn get_u64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(x)
}
fn put_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_be_bytes());
}
fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_be_bytes());
}
fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_be_bytes());
}

fn check_zero(b: &[u8], field: &'static str) -> Result<(), WireError> {
    if b.iter().all(|&x| x == 0) {
        Ok(())
    } else {
        Err(WireError::ReservedNotZero(field))
    }
}

fn check_24(field: &'static str, value: u32) -> Result<(), WireError> {
    if value > MAX_24 {
        Err(WireError::OutOfRange { field, value: value.into() })
    } else {
        Ok(())
    }
}
