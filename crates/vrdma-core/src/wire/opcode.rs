//! Data-frame opcodes: InfiniBand's RC and UD opcode values, and which
//! extension headers each one carries.

use super::DATA_HEADER_LEN;

/// The operation a data frame carries. Values are InfiniBand's RC
/// (`0x00..=0x14`) and UD (`0x64`, `0x65`) opcodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    SendFirst = 0x00,
    SendMiddle = 0x01,
    SendLast = 0x02,
    SendLastImm = 0x03,
    SendOnly = 0x04,
    SendOnlyImm = 0x05,
    WriteFirst = 0x06,
    WriteMiddle = 0x07,
    WriteLast = 0x08,
    WriteLastImm = 0x09,
    WriteOnly = 0x0a,
    WriteOnlyImm = 0x0b,
    ReadRequest = 0x0c,
    ReadResponseFirst = 0x0d,
    ReadResponseMiddle = 0x0e,
    ReadResponseLast = 0x0f,
    ReadResponseOnly = 0x10,
    /// ACK, RNR NAK or NAK, as the AETH syndrome says.
    Acknowledge = 0x11,
    AtomicAcknowledge = 0x12,
    CompareSwap = 0x13,
    FetchAdd = 0x14,
    UdSendOnly = 0x64,
    UdSendOnlyImm = 0x65,
}

/// Which extension headers follow the BTH part, in this order on the wire:
/// UD (DETH + source address), RETH, AtomicETH, AETH, AtomicAckETH, ImmDt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Exts {
    pub ud: bool,
    pub reth: bool,
    pub atomic: bool,
    pub aeth: bool,
    pub atomic_ack: bool,
    pub imm: bool,
}

pub(super) const UD_LEN: usize = 24;
pub(super) const RETH_LEN: usize = 16;
pub(super) const ATOMIC_LEN: usize = 28;
pub(super) const AETH_LEN: usize = 4;
pub(super) const ATOMIC_ACK_LEN: usize = 8;
pub(super) const IMM_LEN: usize = 4;

impl Exts {
    /// Bytes the extension headers take.
    pub fn len(&self) -> usize {
        let mut n = 0;
        n += if self.ud { UD_LEN } else { 0 };
        n += if self.reth { RETH_LEN } else { 0 };
        n += if self.atomic { ATOMIC_LEN } else { 0 };
        n += if self.aeth { AETH_LEN } else { 0 };
        n += if self.atomic_ack { ATOMIC_ACK_LEN } else { 0 };
        n += if self.imm { IMM_LEN } else { 0 };
        n
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Opcode {
    pub const ALL: [Opcode; 23] = [
        Opcode::SendFirst,
        Opcode::SendMiddle,
        Opcode::SendLast,
        Opcode::SendLastImm,
        Opcode::SendOnly,
        Opcode::SendOnlyImm,
        Opcode::WriteFirst,
        Opcode::WriteMiddle,
        Opcode::WriteLast,
        Opcode::WriteLastImm,
        Opcode::WriteOnly,
        Opcode::WriteOnlyImm,
        Opcode::ReadRequest,
        Opcode::ReadResponseFirst,
        Opcode::ReadResponseMiddle,
        Opcode::ReadResponseLast,
        Opcode::ReadResponseOnly,
        Opcode::Acknowledge,
        Opcode::AtomicAcknowledge,
        Opcode::CompareSwap,
        Opcode::FetchAdd,
        Opcode::UdSendOnly,
        Opcode::UdSendOnlyImm,
    ];

    pub fn from_raw(v: u8) -> Option<Opcode> {
        Opcode::ALL.iter().copied().find(|o| *o as u8 == v)
    }

    pub fn raw(self) -> u8 {
        self as u8
    }

    /// The extension headers this opcode carries (as in IB: RETH only on
    /// the first or only frame of a write, AETH on the first, last and only
    /// read response).
    pub fn exts(self) -> Exts {
        use Opcode::*;
        let mut e = Exts::default();
        match self {
            SendFirst | SendMiddle | SendLast | SendOnly | WriteMiddle | WriteLast | ReadResponseMiddle => {}
            SendLastImm | SendOnlyImm | WriteLastImm => e.imm = true,
            WriteFirst | WriteOnly | ReadRequest => e.reth = true,
            WriteOnlyImm => {
                e.reth = true;
                e.imm = true;
            }
            ReadResponseFirst | ReadResponseLast | ReadResponseOnly | Acknowledge => e.aeth = true,
            AtomicAcknowledge => {
                e.aeth = true;
                e.atomic_ack = true;
            }
            CompareSwap | FetchAdd => e.atomic = true,
            UdSendOnly => e.ud = true,
            UdSendOnlyImm => {
                e.ud = true;
                e.imm = true;
            }
        }
        e
    }

    /// The exact header length of a data frame with this opcode.
    pub fn header_len(self) -> usize {
        DATA_HEADER_LEN + self.exts().len()
    }

    /// Frames that carry message bytes after the header.
    pub fn carries_payload(self) -> bool {
        use Opcode::*;
        !matches!(self, ReadRequest | Acknowledge | AtomicAcknowledge | CompareSwap | FetchAdd)
    }

    /// Sent by the requester (as opposed to responses and ACKs).
    pub fn is_request(self) -> bool {
        use Opcode::*;
        !matches!(
            self,
            ReadResponseFirst
                | ReadResponseMiddle
                | ReadResponseLast
                | ReadResponseOnly
                | Acknowledge
                | AtomicAcknowledge
        )
    }

    /// The first chunk of a message of several.
    pub fn is_first(self) -> bool {
        matches!(self, Opcode::SendFirst | Opcode::WriteFirst | Opcode::ReadResponseFirst)
    }

    pub fn is_middle(self) -> bool {
        matches!(self, Opcode::SendMiddle | Opcode::WriteMiddle | Opcode::ReadResponseMiddle)
    }

    /// The closing chunk of a message of several.
    pub fn is_last(self) -> bool {
        use Opcode::*;
        matches!(self, SendLast | SendLastImm | WriteLast | WriteLastImm | ReadResponseLast)
    }

    /// A message in one frame.
    pub fn is_only(self) -> bool {
        !(self.is_first() || self.is_middle() || self.is_last())
    }

    /// Whether the solicited-event flag may be set: on the frame that
    /// completes a SEND or a write with immediate, as IB's SE bit.
    pub fn may_be_solicited(self) -> bool {
        use Opcode::*;
        matches!(
            self,
            SendLast
                | SendLastImm
                | SendOnly
                | SendOnlyImm
                | WriteLastImm
                | WriteOnlyImm
                | UdSendOnly
                | UdSendOnlyImm
        )
    }

    /// Whether the ACK-request flag may be set: on RC requests.
    pub fn may_request_ack(self) -> bool {
        self.is_request() && !matches!(self, Opcode::UdSendOnly | Opcode::UdSendOnlyImm)
    }

    /// Whether the frame opens a message (its offset must be zero).
    pub fn starts_message(self) -> bool {
        self.is_first() || self.is_only()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_values_round_trip_and_unknown_ones_are_refused() {
        for op in Opcode::ALL {
            assert_eq!(Opcode::from_raw(op.raw()), Some(op));
        }
        let known = (0u8..=255).filter(|v| Opcode::from_raw(*v).is_some()).count();
        assert_eq!(known, Opcode::ALL.len());
        assert_eq!(Opcode::from_raw(0x15), None);
    }

    #[test]
    fn chunk_positions_partition_the_opcodes() {
        for op in Opcode::ALL {
            let n =
                [op.is_first(), op.is_middle(), op.is_last(), op.is_only()].iter().filter(|b| **b).count();
            assert_eq!(n, 1, "{op:?}");
        }
    }
}
