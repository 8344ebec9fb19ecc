//! Send and receive work-queue entries.
//!
//! Send slot, `send_stride(max_sge, max_inline)` bytes:
//!
//! ```text
//!  0 wr_id u64        8 opcode u8   9 send_flags u8  10 num_sge u8  11 -
//! 12 imm_data u32    16 remote_addr u64              24 rkey u32
//! 28 inline_len u32  32 compare_add u64              40 swap u64
//! 48 ud_qpn u32      52 ud_qkey u32  56 ud_ah u32    60 -
//! 64 SGEs (addr u64, length u32, lkey u32) or inline bytes
//! ```
//!
//! Receive slot: `0 wr_id u64, 8 num_sge u8`, SGEs from 16.

use super::{get_u32, get_u64, put_u32, put_u64};
use crate::verbs::{SendFlags, SendOpcode};

/// Most scatter/gather entries in one work request.
pub const MAX_SGE: usize = 16;
/// Most inline bytes in one send work request.
pub const MAX_INLINE: usize = 256;
pub const SGE_SIZE: usize = 16;
pub const SEND_HEADER: usize = 64;
pub const RECV_HEADER: usize = 16;

/// Bytes per send slot for a QP with these limits, a multiple of 64.
pub fn send_stride(max_sge: u32, max_inline: u32) -> usize {
    let body = (max_sge as usize * SGE_SIZE).max(max_inline as usize);
    (SEND_HEADER + body).div_ceil(64) * 64
}

/// Bytes per receive slot, a multiple of 16.
pub fn recv_stride(max_sge: u32) -> usize {
    RECV_HEADER + max_sge as usize * SGE_SIZE
}

/// `struct ibv_sge`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// A bounded list of SGEs, kept inline so that decoding allocates nothing.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct SgeList {
    len: u8,
    items: [Sge; MAX_SGE],
}

impl Default for SgeList {
    fn default() -> Self {
        SgeList { len: 0, items: [Sge::default(); MAX_SGE] }
    }
}

impl std::fmt::Debug for SgeList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

impl SgeList {
    pub fn from_slice(sges: &[Sge]) -> Result<Self, WqeError> {
        let mut l = SgeList::default();
        l.set(sges)?;
        Ok(l)
    }
    /// Makes the list `sges`, in place (a list is a few hundred bytes: a
    /// work request filled where it lies is not copied again). A list
    /// too long leaves `self` as it was.
    #[inline]
    pub fn set(&mut self, sges: &[Sge]) -> Result<(), WqeError> {
        if sges.len() > MAX_SGE {
            return Err(WqeError::TooManySge(sges.len()));
        }
        self.items[..sges.len()].copy_from_slice(sges);
        self.len = sges.len() as u8;
        Ok(())
    }
    #[inline]
    pub fn as_slice(&self) -> &[Sge] {
        &self.items[..self.len as usize]
    }
    /// Sum of the lengths, which may exceed `u32`.
    #[inline]
    pub fn total_len(&self) -> u64 {
        self.as_slice().iter().map(|s| s.length as u64).sum()
    }
}

/// UD destination of a send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct UdDest {
    pub remote_qpn: u32,
    pub remote_qkey: u32,
    pub ah: u32,
}

/// A decoded send work request (`struct ibv_send_wr`, without the list link).
#[derive(Clone, PartialEq, Eq)]
pub struct SendWr {
    pub wr_id: u64,
    pub opcode: SendOpcode,
    pub flags: SendFlags,
    /// Immediate data exactly as posted (network order in verbs).
    pub imm_data: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    pub compare_add: u64,
    pub swap: u64,
    pub sg: SgeList,
    pub inline_len: u16,
    pub inline: [u8; MAX_INLINE],
    pub ud: UdDest,
}

impl std::fmt::Debug for SendWr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendWr")
            .field("wr_id", &self.wr_id)
            .field("opcode", &self.opcode)
            .field("flags", &self.flags)
            .field("remote_addr", &self.remote_addr)
            .field("rkey", &self.rkey)
            .field("sg", &self.sg)
            .field("inline_len", &self.inline_len)
            .finish()
    }
}

impl SendWr {
    pub fn new(wr_id: u64, opcode: SendOpcode) -> Self {
        SendWr {
            wr_id,
            opcode,
            flags: SendFlags::empty(),
            imm_data: 0,
            remote_addr: 0,
            rkey: 0,
            compare_add: 0,
            swap: 0,
            sg: SgeList::default(),
            inline_len: 0,
            inline: [0; MAX_INLINE],
            ud: UdDest::default(),
        }
    }

    #[inline]
    pub fn is_inline(&self) -> bool {
        self.flags.contains(SendFlags::INLINE)
    }

    #[inline]
    pub fn inline_data(&self) -> &[u8] {
        &self.inline[..self.inline_len as usize]
    }

    /// Message length in bytes.
    #[inline]
    pub fn msg_len(&self) -> u64 {
        if self.is_inline() {
            self.inline_len as u64
        } else {
            self.sg.total_len()
        }
    }

    /// Encodes into a slot of at least `send_stride(..)` bytes.
    pub fn encode(&self, slot: &mut [u8]) -> Result<(), WqeError> {
        let body = if self.is_inline() { self.inline_len as usize } else { self.sg.len as usize * SGE_SIZE };
        if slot.len() < SEND_HEADER + body {
            return Err(WqeError::SlotTooSmall);
        }
        put_u64(slot, 0, self.wr_id);
        slot[8] = self.opcode.raw();
        slot[9] = self.flags.bits() as u8;
        slot[10] = self.sg.len;
        slot[11] = 0;
        put_u32(slot, 12, self.imm_data);
        put_u64(slot, 16, self.remote_addr);
        put_u32(slot, 24, self.rkey);
        put_u32(slot, 28, self.inline_len as u32);
        put_u64(slot, 32, self.compare_add);
        put_u64(slot, 40, self.swap);
        put_u32(slot, 48, self.ud.remote_qpn);
        put_u32(slot, 52, self.ud.remote_qkey);
        put_u32(slot, 56, self.ud.ah);
        put_u32(slot, 60, 0);
        if self.is_inline() {
            slot[SEND_HEADER..SEND_HEADER + body].copy_from_slice(self.inline_data());
        } else {
            encode_sges(&mut slot[SEND_HEADER..], self.sg.as_slice());
        }
        Ok(())
    }

    /// Decodes a slot that a tenant wrote. Every field is checked; `wr_id`
    /// is returned with the error so that the failure can be completed.
    pub fn decode(slot: &[u8]) -> Result<SendWr, (u64, WqeError)> {
        if slot.len() < SEND_HEADER {
            return Err((0, WqeError::SlotTooSmall));
        }
        let wr_id = get_u64(slot, 0);
        let fail = |e| Err((wr_id, e));
        let Some(opcode) = SendOpcode::from_raw(slot[8]) else {
            return fail(WqeError::BadOpcode(slot[8]));
        };
        let Some(flags) = SendFlags::from_bits(slot[9] as u32) else {
            return fail(WqeError::BadFlags(slot[9]));
        };
        let mut wr = SendWr::new(wr_id, opcode);
        wr.flags = flags;
        wr.imm_data = get_u32(slot, 12);
        wr.remote_addr = get_u64(slot, 16);
        wr.rkey = get_u32(slot, 24);
        wr.compare_add = get_u64(slot, 32);
        wr.swap = get_u64(slot, 40);
        wr.ud =
            UdDest { remote_qpn: get_u32(slot, 48), remote_qkey: get_u32(slot, 52), ah: get_u32(slot, 56) };
        let body = &slot[SEND_HEADER..];
        if flags.contains(SendFlags::INLINE) {
            let n = get_u32(slot, 28) as usize;
            if n > MAX_INLINE || n > body.len() {
                return fail(WqeError::InlineTooLong(n));
            }
            wr.inline_len = n as u16;
            wr.inline[..n].copy_from_slice(&body[..n]);
        } else {
            match decode_sges(body, slot[10] as usize) {
                Ok(sg) => wr.sg = sg,
                Err(e) => return fail(e),
            }
        }
        Ok(wr)
    }
}

/// A decoded receive work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvWr {
    pub wr_id: u64,
    pub sg: SgeList,
}

impl RecvWr {
    pub fn encode(&self, slot: &mut [u8]) -> Result<(), WqeError> {
        let n = self.sg.as_slice().len();
        if slot.len() < RECV_HEADER + n * SGE_SIZE {
            return Err(WqeError::SlotTooSmall);
        }
        put_u64(slot, 0, self.wr_id);
        slot[8] = n as u8;
        slot[9..RECV_HEADER].fill(0);
        encode_sges(&mut slot[RECV_HEADER..], self.sg.as_slice());
        Ok(())
    }

    pub fn decode(slot: &[u8]) -> Result<RecvWr, (u64, WqeError)> {
        if slot.len() < RECV_HEADER {
            return Err((0, WqeError::SlotTooSmall));
        }
        let wr_id = get_u64(slot, 0);
        decode_sges(&slot[RECV_HEADER..], slot[8] as usize)
            .map(|sg| RecvWr { wr_id, sg })
            .map_err(|e| (wr_id, e))
    }
}

/// A receive slot read where it lies: what [`RecvWr::decode`] checks,
/// without building the decoded request (a [`SgeList`] of [`MAX_SGE`]
/// entries, a few hundred bytes, zeroed and then moved on every claim: a
/// direct-path requester looks at the peer's receive once per SEND).
#[derive(Debug, Clone, Copy)]
pub struct RecvSlot<'a> {
    /// The request's `wr_id`.
    pub wr_id: u64,
    /// The SGEs' bytes, exactly `len() * SGE_SIZE` of them.
    body: &'a [u8],
}

impl<'a> RecvSlot<'a> {
    /// Checks `slot` as [`RecvWr::decode`] does (the same errors, with
    /// `wr_id`), reading nothing but the header yet.
    #[inline]
    pub fn parse(slot: &'a [u8]) -> Result<RecvSlot<'a>, (u64, WqeError)> {
        if slot.len() < RECV_HEADER {
            return Err((0, WqeError::SlotTooSmall));
        }
        let wr_id = get_u64(slot, 0);
        let n = slot[8] as usize;
        if n > MAX_SGE {
            return Err((wr_id, WqeError::TooManySge(n)));
        }
        let body = slot[RECV_HEADER..].get(..n * SGE_SIZE).ok_or((wr_id, WqeError::SlotTooSmall))?;
        Ok(RecvSlot { wr_id, body })
    }

    /// Number of SGEs.
    #[inline]
    pub fn len(&self) -> usize {
        self.body.len() / SGE_SIZE
    }

    /// Whether the request has no SGE.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.body.is_empty()
    }

    /// The SGEs, in order.
    #[inline]
    pub fn sges(&self) -> impl Iterator<Item = Sge> + 'a {
        self.body.chunks_exact(SGE_SIZE).map(|b| Sge {
            addr: get_u64(b, 0),
            length: get_u32(b, 8),
            lkey: get_u32(b, 12),
        })
    }

    /// Sum of the lengths, which may exceed `u32`.
    #[inline]
    pub fn total_len(&self) -> u64 {
        self.sges().map(|s| u64::from(s.length)).sum()
    }
}

fn encode_sges(body: &mut [u8], sges: &[Sge]) {
    for (i, s) in sges.iter().enumerate() {
        let at = i * SGE_SIZE;
        put_u64(body, at, s.addr);
        put_u32(body, at + 8, s.length);
        put_u32(body, at + 12, s.lkey);
    }
}

fn decode_sges(body: &[u8], n: usize) -> Result<SgeList, WqeError> {
    if n > MAX_SGE {
        return Err(WqeError::TooManySge(n));
    }
    if n * SGE_SIZE > body.len() {
        return Err(WqeError::SlotTooSmall);
    }
    let mut l = SgeList { len: n as u8, ..Default::default() };
    for i in 0..n {
        let at = i * SGE_SIZE;
        l.items[i] =
            Sge { addr: get_u64(body, at), length: get_u32(body, at + 8), lkey: get_u32(body, at + 12) };
    }
    Ok(l)
}

/// Why a work-queue entry could not be encoded or decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WqeError {
    #[error("slot too small for the entry")]
    SlotTooSmall,
    #[error("unknown opcode {0}")]
    BadOpcode(u8),
    #[error("unknown send flags {0:#x}")]
    BadFlags(u8),
    #[error("{0} scatter/gather entries, more than the queue allows")]
    TooManySge(usize),
    #[error("{0} inline bytes, more than the queue allows")]
    InlineTooLong(usize),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_set_in_place_is_the_new_one_or_unchanged() {
        let a = Sge { addr: 1, length: 2, lkey: 3 };
        let b = Sge { addr: 4, length: 5, lkey: 6 };
        let mut l = SgeList::from_slice(&[a, a, a]).unwrap();
        l.set(&[b]).unwrap();
        assert_eq!(l.as_slice(), &[b]);
        assert!(l.set(&[a; MAX_SGE + 1]).is_err());
        assert_eq!(l.as_slice(), &[b], "a list too long leaves it as it was");
        l.set(&[]).unwrap();
        assert!(l.as_slice().is_empty());
    }

    /// A slot read in place says what its decoding says, for every SGE
    /// count the slot may claim (hostile ones included).
    #[test]
    fn a_receive_slot_read_in_place_agrees_with_its_decoding() {
        let sges: Vec<Sge> = (0..MAX_SGE as u64)
            .map(|i| Sge { addr: 0x1000 * i + 1, length: i as u32 * 3, lkey: 7 + i as u32 })
            .collect();
        for stride_sges in [0, 1, 2, MAX_SGE] {
            let mut slot = vec![0u8; recv_stride(stride_sges as u32)];
            for n in 0..=stride_sges {
                let wr = RecvWr { wr_id: 40 + n as u64, sg: SgeList::from_slice(&sges[..n]).unwrap() };
                wr.encode(&mut slot).unwrap();
                let view = RecvSlot::parse(&slot).unwrap();
                assert_eq!(view.wr_id, wr.wr_id);
                assert_eq!((view.len(), view.is_empty()), (n, n == 0));
                assert_eq!(view.sges().collect::<Vec<_>>(), wr.sg.as_slice());
                assert_eq!(view.total_len(), wr.sg.total_len());
            }
            for claimed in [stride_sges + 1, MAX_SGE + 1, 255] {
                slot[8] = claimed as u8;
                let (decoded, viewed) = (RecvWr::decode(&slot), RecvSlot::parse(&slot));
                assert_eq!(viewed.map(|v| v.wr_id), decoded.map(|d| d.wr_id), "{claimed} SGEs claimed");
            }
        }
        assert_eq!(RecvSlot::parse(&[0u8; 3]).map(|v| v.wr_id), Err((0, WqeError::SlotTooSmall)));
    }

    #[test]
    fn send_round_trip_sge_and_inline() {
        let mut wr = SendWr::new(7, SendOpcode::RdmaWriteWithImm);
        wr.flags = SendFlags::SIGNALED | SendFlags::SOLICITED;
        wr.imm_data = 0xdead_beef;
        wr.remote_addr = 0x1000;
        wr.rkey = 42;
        wr.sg = SgeList::from_slice(&[Sge { addr: 1, length: 2, lkey: 3 }; 3]).unwrap();
        let mut slot = vec![0u8; send_stride(4, 64)];
        wr.encode(&mut slot).unwrap();
        assert_eq!(SendWr::decode(&slot).unwrap(), wr);

        let mut wr = SendWr::new(8, SendOpcode::Send);
        wr.flags = SendFlags::INLINE;
        wr.inline_len = 5;
        wr.inline[..5].copy_from_slice(b"hello");
        wr.encode(&mut slot).unwrap();
        let d = SendWr::decode(&slot).unwrap();
        assert_eq!(d.inline_data(), b"hello");
    }

    #[test]
    fn hostile_slots_are_rejected_not_trusted() {
        let mut slot = vec![0u8; SEND_HEADER + SGE_SIZE];
        slot[0] = 9;
        slot[8] = 77;
        assert_eq!(SendWr::decode(&slot), Err((9, WqeError::BadOpcode(77))));
        slot[8] = SendOpcode::Send.raw();
        slot[10] = 200;
        assert_eq!(SendWr::decode(&slot), Err((9, WqeError::TooManySge(200))));
        slot[10] = 2; // claims two SGEs in a one-SGE slot
        assert_eq!(SendWr::decode(&slot), Err((9, WqeError::SlotTooSmall)));
        slot[10] = 0;
        slot[9] = SendFlags::INLINE.bits() as u8;
        slot[28] = 0xff;
        slot[29] = 0xff;
        assert!(matches!(SendWr::decode(&slot), Err((9, WqeError::InlineTooLong(_)))));
        assert!(RecvWr::decode(&[0u8; 3]).is_err());
    }
}
