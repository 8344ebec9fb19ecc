//! The frame: a 12-byte base header, a type-specific header, a payload.
//!
//! ```text
//! base header, every frame:
//!  0 magic u16 = 0x7652 ("vR")   2 version u8   3 frame_type u8
//!  4 flags u8                    5 reserved u8  6 header_len u16
//!  8 payload_len u32
//! data frame (type 0x10), after the base header:
//! 12 opcode u8   13 reserved [3]   16 vnet u32   20 dest_qpn u32 (24 bits)
//! 24 src_qpn u32 (24 bits)   28 psn u32 (24 bits)   32 msg_offset u32
//! 36 extension headers, in this order, as the opcode says:
//!    UD     qkey u32, sgid [16], slid u16, address bits u16  24 bytes
//!    RETH   va u64, rkey u32, dma_len u32                     16 bytes
//!    AtomicETH va u64, rkey u32, swap_add u64, compare u64    28 bytes
//!    AETH   syndrome u8, msn u24                               4 bytes
//!    AtomicAckETH original u64                                 8 bytes
//!    ImmDt  imm u32                                            4 bytes
//! then payload_len bytes of payload
//! ```
//!
//! Multi-byte fields are big-endian.

use super::control::{AUTH_LEN, CLOSE_LEN, HELLO_LEN, KEEPALIVE_LEN, TAG_LEN};
use super::moved::{MovedRepr, MOVED_LEN};
use super::opcode::{ATOMIC_ACK_LEN, ATOMIC_LEN, IMM_LEN, RETH_LEN, UD_LEN};
use super::{
    check_24, check_zero, get_u16, get_u32, get_u64, put_u16, put_u32, put_u64, Aeth, CloseRepr, Exts,
    HelloRepr, KeepaliveRepr, Opcode, Syndrome, WireError, BASE_HEADER_LEN, DATA_HEADER_LEN, FRAME_VERSION,
    HELLO_VERSION, MAGIC, MAX_DATA_HEADER_LEN, MAX_FRAME_PAYLOAD,
};
use crate::verbs::Gid;

mod field {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 2;
    pub const TYPE: usize = 3;
    pub const FLAGS: usize = 4;
    pub const RESERVED: usize = 5;
    pub const HEADER_LEN: usize = 6;
    pub const PAYLOAD_LEN: usize = 8;
    pub const OPCODE: usize = 12;
    pub const BTH_RESERVED: usize = 13;
    pub const VNET: usize = 16;
    pub const DEST_QPN: usize = 20;
    pub const SRC_QPN: usize = 24;
    pub const PSN: usize = 28;
    pub const MSG_OFFSET: usize = 32;
}

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameType {
    Hello = 0x01,
    Auth = 0x02,
    Keepalive = 0x03,
    Close = 0x04,
    /// A connection manager's message (REQ, REP, …) in the payload.
    Cm = 0x05,
    /// A migrated QP's new location (see [`super::MovedRepr`]).
    Moved = 0x06,
    /// A socket registry's message between daemons (see [`super::sock`]);
    /// wire version 3 and up.
    Sock = 0x07,
    Data = 0x10,
}

impl FrameType {
    /// The base-header version this frame carries: Hello and Close
    /// [`HELLO_VERSION`] (readable by every version), the rest
    /// [`FRAME_VERSION`].
    pub fn base_version(self) -> u8 {
        match self {
            FrameType::Hello | FrameType::Close => HELLO_VERSION,
            _ => FRAME_VERSION,
        }
    }

    pub fn from_raw(v: u8) -> Option<FrameType> {
        Some(match v {
            0x01 => FrameType::Hello,
            0x02 => FrameType::Auth,
            0x03 => FrameType::Keepalive,
            0x04 => FrameType::Close,
            0x05 => FrameType::Cm,
            0x06 => FrameType::Moved,
            0x07 => FrameType::Sock,
            0x10 => FrameType::Data,
            _ => return None,
        })
    }

    /// The header lengths this type allows: exact for control frames, the
    /// range of all opcodes' lengths for data frames.
    fn header_len_range(self) -> (usize, usize) {
        match self {
            FrameType::Hello => (HELLO_LEN, HELLO_LEN),
            FrameType::Auth => (AUTH_LEN, AUTH_LEN),
            FrameType::Keepalive => (KEEPALIVE_LEN, KEEPALIVE_LEN),
            FrameType::Close => (CLOSE_LEN, CLOSE_LEN),
            FrameType::Cm | FrameType::Sock => (BASE_HEADER_LEN, BASE_HEADER_LEN),
            FrameType::Moved => (MOVED_LEN, MOVED_LEN),
            FrameType::Data => (DATA_HEADER_LEN, MAX_DATA_HEADER_LEN),
        }
    }
}

bitflags::bitflags! {
    /// Base-header flags. Control frames carry none.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct DataFlags: u8 {
        /// IB's SE bit: the receiver's completion is a solicited event.
        const SOLICITED = 0x01;
        /// IB's AckReq bit: the requester wants an ACK for this frame
        /// promptly (the WR is signaled, or the send queue is filling).
        const ACK_REQ = 0x02;
    }
}

/// What the 12-byte base header says, once checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Base {
    pub frame_type: FrameType,
    pub header_len: usize,
    pub payload_len: u32,
}

/// Checks a base header on its own (the streaming decoder does this as soon
/// as 12 bytes are in, before it waits for more): magic, version, type,
/// reserved byte, header length for the type, payload bound.
pub(super) fn check_base(b: &[u8]) -> Result<Base, WireError> {
    if b.len() < BASE_HEADER_LEN {
        return Err(WireError::Truncated);
    }
    let magic = get_u16(b, field::MAGIC);
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    let version = b[field::VERSION];
    if version != FRAME_VERSION && version != HELLO_VERSION {
        return Err(WireError::UnsupportedVersion(version));
    }
    let t = b[field::TYPE];
    let frame_type = FrameType::from_raw(t).ok_or(WireError::UnknownFrameType(t))?;
    if version != frame_type.base_version() {
        return Err(WireError::UnsupportedVersion(version));
    }
    check_zero(&b[field::RESERVED..field::RESERVED + 1], "base.reserved")?;
    let header_len = get_u16(b, field::HEADER_LEN);
    let (min, max) = frame_type.header_len_range();
    if !(min..=max).contains(&(header_len as usize)) {
        return Err(WireError::BadHeaderLen { got: header_len, min: min as u16, max: max as u16 });
    }
    let payload_len = get_u32(b, field::PAYLOAD_LEN);
    if payload_len > MAX_FRAME_PAYLOAD {
        return Err(WireError::PayloadTooLong(payload_len));
    }
    if frame_type != FrameType::Data {
        if b[field::FLAGS] != 0 {
            return Err(WireError::BadFlags(b[field::FLAGS]));
        }
        match frame_type {
            FrameType::Cm if payload_len == 0 || payload_len > super::cm::MAX_CM_PAYLOAD => {
                return Err(WireError::BadCmLen(payload_len));
            }
            FrameType::Cm => {}
            FrameType::Sock if payload_len == 0 || payload_len > super::sock::MAX_SOCK_PAYLOAD => {
                return Err(WireError::BadSockLen(payload_len));
            }
            FrameType::Sock => {}
            _ if payload_len != 0 => return Err(WireError::UnexpectedPayload),
            _ => {}
        }
    }
    Ok(Base { frame_type, header_len: header_len as usize, payload_len })
}

/// A read-only or read-write view of a frame in a buffer, with accessors
/// at fixed offsets. The accessors do not validate; [`Packet::new_checked`]
/// makes sure they stay in bounds, and [`FrameRepr::parse`] validates.
#[derive(Debug, Clone)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wraps a buffer without checking it; accessors may panic on a short
    /// buffer.
    pub fn new_unchecked(buffer: T) -> Packet<T> {
        Packet { buffer }
    }

    /// Wraps a buffer that holds at least the whole header the base header
    /// claims (the payload need not be there).
    pub fn new_checked(buffer: T) -> Result<Packet<T>, WireError> {
        let p = Packet::new_unchecked(buffer);
        p.check_len()?;
        Ok(p)
    }

    /// Checks that the base header is in the buffer, that the claimed
    /// header length covers at least the part every frame of its type has,
    /// and that the whole header is in the buffer.
    pub fn check_len(&self) -> Result<(), WireError> {
        let b = self.buffer.as_ref();
        if b.len() < BASE_HEADER_LEN {
            return Err(WireError::Truncated);
        }
        let hl = self.header_len() as usize;
        let min = match FrameType::from_raw(self.frame_type_raw()) {
            Some(t) => t.header_len_range().0,
            None => BASE_HEADER_LEN,
        };
        if hl < min {
            return Err(WireError::BadHeaderLen { got: hl as u16, min: min as u16, max: u16::MAX });
        }
        if b.len() < hl {
            return Err(WireError::Truncated);
        }
        Ok(())
    }

    pub fn into_inner(self) -> T {
        self.buffer
    }

    pub fn magic(&self) -> u16 {
        get_u16(self.buffer.as_ref(), field::MAGIC)
    }
    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::VERSION]
    }
    pub fn frame_type_raw(&self) -> u8 {
        self.buffer.as_ref()[field::TYPE]
    }
    pub fn flags_raw(&self) -> u8 {
        self.buffer.as_ref()[field::FLAGS]
    }
    pub fn header_len(&self) -> u16 {
        get_u16(self.buffer.as_ref(), field::HEADER_LEN)
    }
    pub fn payload_len(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::PAYLOAD_LEN)
    }
    /// The header bytes, base header included.
    pub fn header(&self) -> &[u8] {
        &self.buffer.as_ref()[..self.header_len() as usize]
    }
    /// The payload, if the whole of it is in the buffer.
    pub fn payload(&self) -> Result<&[u8], WireError> {
        let b = self.buffer.as_ref();
        let start = self.header_len() as usize;
        let end = start + self.payload_len() as usize;
        b.get(start..end).ok_or(WireError::Truncated)
    }

    // Data-frame fields: only meaningful when the frame type is Data.
    pub fn opcode_raw(&self) -> u8 {
        self.buffer.as_ref()[field::OPCODE]
    }
    pub fn vnet(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::VNET)
    }
    pub fn dest_qpn(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::DEST_QPN)
    }
    pub fn src_qpn(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::SRC_QPN)
    }
    pub fn psn(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::PSN)
    }
    pub fn msg_offset(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::MSG_OFFSET)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    fn buf(&mut self) -> &mut [u8] {
        self.buffer.as_mut()
    }
    /// Writes the base header (magic, version, reserved byte included).
    pub fn set_base(&mut self, frame_type: FrameType, flags: u8, header_len: u16, payload_len: u32) {
        let b = self.buf();
        put_u16(b, field::MAGIC, MAGIC);
        b[field::VERSION] = frame_type.base_version();
        b[field::TYPE] = frame_type as u8;
        b[field::FLAGS] = flags;
        b[field::RESERVED] = 0;
        put_u16(b, field::HEADER_LEN, header_len);
        put_u32(b, field::PAYLOAD_LEN, payload_len);
    }
    pub fn set_payload_len(&mut self, v: u32) {
        put_u32(self.buf(), field::PAYLOAD_LEN, v)
    }
    pub fn set_psn(&mut self, v: u32) {
        put_u32(self.buf(), field::PSN, v)
    }
    pub fn set_msg_offset(&mut self, v: u32) {
        put_u32(self.buf(), field::MSG_OFFSET, v)
    }
}

/// RDMA extended transport header: where a write lands or a read reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Reth {
    pub va: u64,
    pub rkey: u32,
    /// Length of the whole message (not of this chunk).
    pub dma_len: u32,
}

/// Atomic extended transport header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AtomicEth {
    pub va: u64,
    pub rkey: u32,
    /// The swap value of a compare-and-swap, the addend of a fetch-and-add.
    pub swap_add: u64,
    /// The compare value of a compare-and-swap (zero for fetch-and-add).
    pub compare: u64,
}

/// What a UD datagram carries beyond the BTH: IB's DETH (the Q_Key; the
/// source QPN is in the BTH part), the source address of the GRH, and what
/// of the sender's address handle the receiver reports: whether it was
/// global (a GRH is delivered), its service level and hop limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct UdEth {
    pub qkey: u32,
    pub sgid: Gid,
    pub slid: u16,
    pub global: bool,
    /// 4 bits on the wire (higher bits are not sent).
    pub sl: u8,
    pub hop_limit: u8,
}

impl UdEth {
    const GLOBAL: u16 = 1 << 15;
    const RESERVED: u16 = 0x7000;

    fn address_bits(&self) -> u16 {
        (if self.global { Self::GLOBAL } else { 0 })
            | (u16::from(self.sl & 0xf) << 8)
            | u16::from(self.hop_limit)
    }
}

/// A data frame's header, decoded and validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DataRepr {
    pub opcode: Opcode,
    pub flags: DataFlags,
    /// The tenant's virtual network: QPs only talk inside one.
    pub vnet: u32,
    pub dest_qpn: u32,
    pub src_qpn: u32,
    pub psn: u32,
    /// Where in the message this chunk's payload goes: 0 on a first or
    /// only frame, the bytes sent so far on a middle or last one.
    pub msg_offset: u32,
    pub payload_len: u32,
    pub ud: Option<UdEth>,
    pub reth: Option<Reth>,
    pub atomic: Option<AtomicEth>,
    pub aeth: Option<Aeth>,
    /// AtomicAckETH: the value at the target before the atomic.
    pub atomic_ack: Option<u64>,
    pub imm: Option<u32>,
}

impl DataRepr {
    /// A header with no extension headers set; fill in the ones
    /// `opcode.exts()` names before emitting.
    pub fn new(opcode: Opcode, vnet: u32, dest_qpn: u32, src_qpn: u32, psn: u32) -> DataRepr {
        DataRepr {
            opcode,
            flags: DataFlags::empty(),
            vnet,
            dest_qpn,
            src_qpn,
            psn,
            msg_offset: 0,
            payload_len: 0,
            ud: None,
            reth: None,
            atomic: None,
            aeth: None,
            atomic_ack: None,
            imm: None,
        }
    }

    fn exts(&self) -> Exts {
        Exts {
            ud: self.ud.is_some(),
            reth: self.reth.is_some(),
            atomic: self.atomic.is_some(),
            aeth: self.aeth.is_some(),
            atomic_ack: self.atomic_ack.is_some(),
            imm: self.imm.is_some(),
        }
    }

    pub fn header_len(&self) -> usize {
        self.opcode.header_len()
    }

    /// Every rule a data header obeys on its own, without QP state.
    pub fn check(&self) -> Result<(), WireError> {
        let op = self.opcode;
        if self.exts() != op.exts() {
            return Err(WireError::ExtMismatch);
        }
        check_24("dest_qpn", self.dest_qpn)?;
        check_24("src_qpn", self.src_qpn)?;
        check_24("psn", self.psn)?;
        if DataFlags::from_bits(self.flags.bits()).is_none()
            || (self.flags.contains(DataFlags::SOLICITED) && !op.may_be_solicited())
            || (self.flags.contains(DataFlags::ACK_REQ) && !op.may_request_ack())
        {
            return Err(WireError::BadFlags(self.flags.bits()));
        }
        if self.payload_len > MAX_FRAME_PAYLOAD {
            return Err(WireError::PayloadTooLong(self.payload_len));
        }
        if !op.carries_payload() && self.payload_len != 0 {
            return Err(WireError::UnexpectedPayload);
        }
        if (op.is_first() || op.is_middle()) && self.payload_len == 0 {
            return Err(WireError::EmptyChunk);
        }
        if op.starts_message() != (self.msg_offset == 0) {
            return Err(WireError::BadOffset(self.msg_offset));
        }
        if self.msg_offset.checked_add(self.payload_len).is_none() {
            return Err(WireError::RangeOverflow);
        }
        if let Some(r) = self.reth {
            if r.va.checked_add(u64::from(r.dma_len)).is_none() {
                return Err(WireError::RangeOverflow);
            }
            match op {
                Opcode::WriteOnly | Opcode::WriteOnlyImm if self.payload_len != r.dma_len => {
                    return Err(WireError::LengthMismatch)
                }
                Opcode::WriteFirst if self.payload_len >= r.dma_len => return Err(WireError::LengthMismatch),
                _ => {}
            }
        }
        if let Some(a) = self.atomic {
            if a.va.checked_add(8).is_none() {
                return Err(WireError::RangeOverflow);
            }
        }
        if let Some(a) = self.aeth {
            a.check()?;
            if op != Opcode::Acknowledge && a.syndrome != Syndrome::Ack {
                return Err(WireError::BadSyndrome(a.syndrome.raw()));
            }
        }
        Ok(())
    }

    fn read(b: &[u8], flags: u8, payload_len: u32) -> Result<DataRepr, WireError> {
        let raw = b[field::OPCODE];
        let opcode = Opcode::from_raw(raw).ok_or(WireError::UnknownOpcode(raw))?;
        let want = opcode.header_len();
        if b.len() != want {
            return Err(WireError::BadHeaderLen { got: b.len() as u16, min: want as u16, max: want as u16 });
        }
        check_zero(&b[field::BTH_RESERVED..field::VNET], "bth.reserved")?;
        let flags = DataFlags::from_bits(flags).ok_or(WireError::BadFlags(flags))?;
        let mut d = DataRepr::new(
            opcode,
            get_u32(b, field::VNET),
            get_u32(b, field::DEST_QPN),
            get_u32(b, field::SRC_QPN),
            get_u32(b, field::PSN),
        );
        d.flags = flags;
        d.msg_offset = get_u32(b, field::MSG_OFFSET);
        d.payload_len = payload_len;
        let e = opcode.exts();
        let mut at = DATA_HEADER_LEN;
        if e.ud {
            let bits = get_u16(b, at + 22);
            check_zero(&(bits & UdEth::RESERVED).to_be_bytes(), "ud.reserved")?;
            let mut g = [0u8; 16];
            g.copy_from_slice(&b[at + 4..at + 20]);
            d.ud = Some(UdEth {
                qkey: get_u32(b, at),
                sgid: Gid(g),
                slid: get_u16(b, at + 20),
                global: bits & UdEth::GLOBAL != 0,
                sl: (bits >> 8) as u8 & 0xf,
                hop_limit: bits as u8,
            });
            at += UD_LEN;
        }
        if e.reth {
            d.reth =
                Some(Reth { va: get_u64(b, at), rkey: get_u32(b, at + 8), dma_len: get_u32(b, at + 12) });
            at += RETH_LEN;
        }
        if e.atomic {
            d.atomic = Some(AtomicEth {
                va: get_u64(b, at),
                rkey: get_u32(b, at + 8),
                swap_add: get_u64(b, at + 12),
                compare: get_u64(b, at + 20),
            });
            at += ATOMIC_LEN;
        }
        if e.aeth {
            d.aeth = Some(Aeth::read(&b[at..])?);
            at += super::opcode::AETH_LEN;
        }
        if e.atomic_ack {
            d.atomic_ack = Some(get_u64(b, at));
            at += ATOMIC_ACK_LEN;
        }
        if e.imm {
            d.imm = Some(get_u32(b, at));
            at += IMM_LEN;
        }
        debug_assert_eq!(at, want);
        d.check()?;
        Ok(d)
    }

    fn write(&self, b: &mut [u8]) {
        b[field::OPCODE] = self.opcode.raw();
        b[field::BTH_RESERVED..field::VNET].fill(0);
        put_u32(b, field::VNET, self.vnet);
        put_u32(b, field::DEST_QPN, self.dest_qpn);
        put_u32(b, field::SRC_QPN, self.src_qpn);
        put_u32(b, field::PSN, self.psn);
        put_u32(b, field::MSG_OFFSET, self.msg_offset);
        let mut at = DATA_HEADER_LEN;
        if let Some(u) = self.ud {
            put_u32(b, at, u.qkey);
            b[at + 4..at + 20].copy_from_slice(&u.sgid.0);
            put_u16(b, at + 20, u.slid);
            put_u16(b, at + 22, u.address_bits());
            at += UD_LEN;
        }
        if let Some(r) = self.reth {
            put_u64(b, at, r.va);
            put_u32(b, at + 8, r.rkey);
            put_u32(b, at + 12, r.dma_len);
            at += RETH_LEN;
        }
        if let Some(a) = self.atomic {
            put_u64(b, at, a.va);
            put_u32(b, at + 8, a.rkey);
            put_u64(b, at + 12, a.swap_add);
            put_u64(b, at + 20, a.compare);
            at += ATOMIC_LEN;
        }
        if let Some(a) = self.aeth {
            a.write(&mut b[at..]);
            at += super::opcode::AETH_LEN;
        }
        if let Some(v) = self.atomic_ack {
            put_u64(b, at, v);
            at += ATOMIC_ACK_LEN;
        }
        if let Some(v) = self.imm {
            put_u32(b, at, v);
        }
    }
}

/// A frame's header, decoded and validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FrameRepr {
    Hello(HelloRepr),
    /// The HMAC-SHA256 tag that proves the sender holds the pre-shared
    /// key (see [`super::auth`]).
    Auth([u8; TAG_LEN]),
    Keepalive(KeepaliveRepr),
    Close(CloseRepr),
    /// A connection manager's message of `len` bytes follows (see
    /// [`super::cm`]).
    Cm {
        len: u32,
    },
    /// A migrated QP's new location.
    Moved(MovedRepr),
    /// A socket registry's message of `len` bytes follows (see
    /// [`super::sock`]).
    Sock {
        len: u32,
    },
    Data(DataRepr),
}

impl FrameRepr {
    /// Parses and validates the header of a packet. The payload need not
    /// be in the buffer.
    pub fn parse<T: AsRef<[u8]>>(packet: &Packet<T>) -> Result<FrameRepr, WireError> {
        let all = packet.buffer.as_ref();
        let base = check_base(all)?;
        let b = all.get(..base.header_len).ok_or(WireError::Truncated)?;
        Ok(match base.frame_type {
            FrameType::Hello => FrameRepr::Hello(HelloRepr::read(b)?),
            FrameType::Auth => {
                let mut tag = [0u8; TAG_LEN];
                tag.copy_from_slice(&b[BASE_HEADER_LEN..AUTH_LEN]);
                FrameRepr::Auth(tag)
            }
            FrameType::Keepalive => FrameRepr::Keepalive(KeepaliveRepr::read(b)?),
            FrameType::Close => FrameRepr::Close(CloseRepr::read(b)?),
            FrameType::Cm => FrameRepr::Cm { len: base.payload_len },
            FrameType::Moved => FrameRepr::Moved(MovedRepr::read(b)?),
            FrameType::Sock => FrameRepr::Sock { len: base.payload_len },
            FrameType::Data => FrameRepr::Data(DataRepr::read(b, b[field::FLAGS], base.payload_len)?),
        })
    }

    pub fn frame_type(&self) -> FrameType {
        match self {
            FrameRepr::Hello(_) => FrameType::Hello,
            FrameRepr::Auth(_) => FrameType::Auth,
            FrameRepr::Keepalive(_) => FrameType::Keepalive,
            FrameRepr::Close(_) => FrameType::Close,
            FrameRepr::Cm { .. } => FrameType::Cm,
            FrameRepr::Moved(_) => FrameType::Moved,
            FrameRepr::Sock { .. } => FrameType::Sock,
            FrameRepr::Data(_) => FrameType::Data,
        }
    }

    /// Bytes of the header [`FrameRepr::emit`] writes (smoltcp's
    /// `buffer_len`, less the payload).
    pub fn header_len(&self) -> usize {
        match self {
            FrameRepr::Hello(_) => HELLO_LEN,
            FrameRepr::Auth(_) => AUTH_LEN,
            FrameRepr::Keepalive(_) => KEEPALIVE_LEN,
            FrameRepr::Close(_) => CLOSE_LEN,
            FrameRepr::Cm { .. } | FrameRepr::Sock { .. } => BASE_HEADER_LEN,
            FrameRepr::Moved(_) => MOVED_LEN,
            FrameRepr::Data(d) => d.header_len(),
        }
    }

    pub fn payload_len(&self) -> u32 {
        match self {
            FrameRepr::Data(d) => d.payload_len,
            FrameRepr::Cm { len } | FrameRepr::Sock { len } => *len,
            _ => 0,
        }
    }

    /// Header plus payload.
    pub fn buffer_len(&self) -> usize {
        self.header_len() + self.payload_len() as usize
    }

    /// Checks the frame and writes its header into the start of `buf`;
    /// returns the header length. The payload (`payload_len` bytes) goes
    /// right after, written by the caller (typically straight from the
    /// mapped region into the socket).
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        let hl = self.header_len();
        if buf.len() < hl {
            return Err(WireError::BufferTooSmall);
        }
        let b = &mut buf[..hl];
        let mut flags = 0;
        match self {
            FrameRepr::Hello(h) => {
                h.check()?;
                h.write(b);
            }
            FrameRepr::Auth(tag) => b[BASE_HEADER_LEN..AUTH_LEN].copy_from_slice(tag),
            FrameRepr::Keepalive(k) => k.write(b),
            FrameRepr::Close(c) => c.write(b),
            FrameRepr::Cm { len } if *len == 0 || *len > super::cm::MAX_CM_PAYLOAD => {
                return Err(WireError::BadCmLen(*len));
            }
            FrameRepr::Cm { .. } => {}
            FrameRepr::Sock { len } if *len == 0 || *len > super::sock::MAX_SOCK_PAYLOAD => {
                return Err(WireError::BadSockLen(*len));
            }
            FrameRepr::Sock { .. } => {}
            FrameRepr::Moved(m) => {
                m.check()?;
                m.write(b);
            }
            FrameRepr::Data(d) => {
                d.check()?;
                d.write(b);
                flags = d.flags.bits();
            }
        }
        Packet::new_unchecked(b).set_base(self.frame_type(), flags, hl as u16, self.payload_len());
        Ok(hl)
    }
}

/// Parses one whole frame at the start of `buf`: the header and a slice
/// of its payload. Bytes after the frame are left alone; the frame is
/// `header_len() + payload.len()` bytes long.
pub fn parse_frame(buf: &[u8]) -> Result<(FrameRepr, &[u8]), WireError> {
    let repr = FrameRepr::parse(&Packet::new_unchecked(buf))?;
    let start = repr.header_len();
    let payload = buf.get(start..start + repr.payload_len() as usize).ok_or(WireError::Truncated)?;
    Ok((repr, payload))
}
