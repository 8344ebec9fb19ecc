//! Completion-queue entries.
//!
//! ```text
//!  0 wr_id u64      8 status u8  9 opcode u8  10 wc_flags u8  11 solicited u8
//! 12 vendor_err u32 16 byte_len u32  20 imm_data u32  24 qp_num u32  28 src_qp u32
//! 32 pkey_index u16 34 slid u16  36 sl u8  37 dlid_path_bits u8
//! 38 sq_retired present u8       40 sq_retired u32               44..64 reserved
//! ```
//!
//! `sq_retired` is not part of `ibv_wc`: in a completion of a send WR the
//! daemon notes how many of the QP's send WRs it had retired with this one
//! (in the numbering of the send ring's producer index). A send queue slot
//! is free again only once the program has polled the completion that
//! covers it, as on hardware: a CQ as deep as the send queue then never
//! overflows, however long the program waits before polling.

use super::{get_u16, get_u32, get_u64, put_u16, put_u32, put_u64};
use crate::verbs::{WcFlags, WcOpcode, WcStatus};

pub const CQE_SIZE: usize = 64;
/// The byte of an encoded completion that holds its status (a
/// direct-path requester turns its staged flush into a success with one
/// store there, `docs/direct-path.md`).
pub const CQE_STATUS_BYTE: usize = 8;

/// `struct ibv_wc`, plus whether the event was solicited (for
/// `ibv_req_notify_cq(cq, 1)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cqe {
    pub wr_id: u64,
    pub status: WcStatus,
    pub opcode: WcOpcode,
    pub wc_flags: WcFlags,
    pub solicited: bool,
    pub vendor_err: u32,
    pub byte_len: u32,
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

impl Default for Cqe {
    fn default() -> Self {
        Cqe::new(0, WcStatus::Success, WcOpcode::Send, 0)
    }
}

impl Cqe {
    #[inline]
    pub fn new(wr_id: u64, status: WcStatus, opcode: WcOpcode, qp_num: u32) -> Cqe {
        Cqe {
            wr_id,
            status,
            opcode,
            wc_flags: WcFlags::empty(),
            solicited: false,
            vendor_err: 0,
            byte_len: 0,
            imm_data: 0,
            qp_num,
            src_qp: 0,
            pkey_index: 0,
            slid: 0,
            sl: 0,
            dlid_path_bits: 0,
        }
    }

    #[inline]
    pub fn encode(&self, slot: &mut [u8; CQE_SIZE]) {
        put_u64(slot, 0, self.wr_id);
        slot[CQE_STATUS_BYTE] = self.status.raw();
        slot[9] = self.opcode.raw();
        slot[10] = self.wc_flags.bits() as u8;
        slot[11] = self.solicited as u8;
        put_u32(slot, 12, self.vendor_err);
        put_u32(slot, 16, self.byte_len);
        put_u32(slot, 20, self.imm_data);
        put_u32(slot, 24, self.qp_num);
        put_u32(slot, 28, self.src_qp);
        put_u16(slot, 32, self.pkey_index);
        put_u16(slot, 34, self.slid);
        slot[36] = self.sl;
        slot[37] = self.dlid_path_bits;
        slot[38..].fill(0);
    }

    /// Notes in an encoded send completion the send WRs retired with it.
    pub fn set_sq_retired(slot: &mut [u8; CQE_SIZE], retired: u32) {
        slot[38] = 1;
        put_u32(slot, 40, retired);
    }

    /// What [`set_sq_retired`](Self::set_sq_retired) noted, if anything.
    #[inline]
    pub fn sq_retired(slot: &[u8; CQE_SIZE]) -> Option<u32> {
        (slot[38] != 0).then(|| get_u32(slot, 40))
    }

    /// Decodes an entry the daemon wrote. The client trusts the daemon, but a
    /// value outside the enums still decodes (as a general error) rather than
    /// panicking.
    #[inline]
    pub fn decode(slot: &[u8; CQE_SIZE]) -> Cqe {
        Cqe {
            wr_id: get_u64(slot, 0),
            status: WcStatus::from_raw(slot[8]).unwrap_or(WcStatus::GeneralErr),
            opcode: WcOpcode::from_raw(slot[9]).unwrap_or(WcOpcode::Send),
            wc_flags: WcFlags::from_bits_truncate(slot[10] as u32),
            solicited: slot[11] != 0,
            vendor_err: get_u32(slot, 12),
            byte_len: get_u32(slot, 16),
            imm_data: get_u32(slot, 20),
            qp_num: get_u32(slot, 24),
            src_qp: get_u32(slot, 28),
            pkey_index: get_u16(slot, 32),
            slid: get_u16(slot, 34),
            sl: slot[36],
            dlid_path_bits: slot[37],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let mut c = Cqe::new(5, WcStatus::RemAccessErr, WcOpcode::RecvRdmaWithImm, 17);
        c.wc_flags = WcFlags::WITH_IMM;
        c.imm_data = 0x1234;
        c.byte_len = 4096;
        c.solicited = true;
        let mut slot = [0u8; CQE_SIZE];
        c.encode(&mut slot);
        assert_eq!(Cqe::decode(&slot), c);
    }
}
