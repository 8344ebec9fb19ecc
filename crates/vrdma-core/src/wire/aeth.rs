//! The ACK extended transport header: a syndrome (ACK, RNR NAK, NAK) and
//! the responder's message sequence number, and how each maps onto the
//! requester's work completion.

use super::{check_24, get_u32, put_u32, WireError, MAX_24};
use crate::verbs::WcStatus;

/// Why a responder refused a request (the low five bits of a NAK syndrome).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum NakCode {
    /// The request's PSN is ahead of the one expected: the requester goes
    /// back and resends from the PSN the NAK carries.
    PsnSequenceError = 0,
    /// An opcode out of sequence, a length the QP cannot take, a request
    /// the QP's state does not allow.
    InvalidRequest = 1,
    /// Bad rkey, bounds or access flags.
    RemoteAccessError = 2,
    /// The responder failed in a way the request did not cause (its
    /// receive WR was malformed, its CQ overflowed).
    RemoteOperationalError = 3,
    /// The responder QP is paused: its tenant is being migrated to another
    /// host (`docs/migration.md`). Not final: the requester keeps what is
    /// outstanding, spends no retry, probes again after an interval and
    /// fails `RETRY_EXC_ERR` only once the pause outlasts its bound.
    QpPaused = 4,
}

impl NakCode {
    pub fn from_raw(v: u8) -> Option<NakCode> {
        Some(match v {
            0 => NakCode::PsnSequenceError,
            1 => NakCode::InvalidRequest,
            2 => NakCode::RemoteAccessError,
            3 => NakCode::RemoteOperationalError,
            4 => NakCode::QpPaused,
            _ => return None,
        })
    }

    /// The status of the requester's work completion when this NAK ends a
    /// request; `None` for a PSN sequence error, which is not final: the
    /// requester retransmits (and completes `RetryExcErr` once `retry_cnt`
    /// retransmissions have not helped).
    pub fn completion_status(self) -> Option<WcStatus> {
        match self {
            NakCode::PsnSequenceError | NakCode::QpPaused => None,
            NakCode::InvalidRequest => Some(WcStatus::RemInvReqErr),
            NakCode::RemoteAccessError => Some(WcStatus::RemAccessErr),
            NakCode::RemoteOperationalError => Some(WcStatus::RemOpErr),
        }
    }
}

/// The AETH syndrome, encoded as IB does in one byte: top three bits
/// `000` ACK, `001` RNR NAK (low five bits: the `min_rnr_timer` code),
/// `011` NAK (low five bits: [`NakCode`]). In v1 an ACK's low five bits
/// (IB's credit count, unused here) must be zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Syndrome {
    Ack,
    /// Receiver not ready: no receive WR was posted. `timer` is the
    /// five-bit `min_rnr_timer` encoding (see `qp::timers::rnr_delay`).
    RnrNak {
        timer: u8,
    },
    Nak(NakCode),
}

impl Syndrome {
    pub fn from_raw(v: u8) -> Result<Syndrome, WireError> {
        let low = v & 0x1f;
        match v >> 5 {
            0b000 if low == 0 => Ok(Syndrome::Ack),
            0b001 => Ok(Syndrome::RnrNak { timer: low }),
            0b011 => NakCode::from_raw(low).map(Syndrome::Nak).ok_or(WireError::BadSyndrome(v)),
            _ => Err(WireError::BadSyndrome(v)),
        }
    }

    pub fn raw(self) -> u8 {
        match self {
            Syndrome::Ack => 0,
            Syndrome::RnrNak { timer } => 0b001_00000 | (timer & 0x1f),
            Syndrome::Nak(code) => 0b011_00000 | code as u8,
        }
    }

    fn check(self) -> Result<(), WireError> {
        match self {
            Syndrome::RnrNak { timer } if timer > 0x1f => Err(WireError::BadSyndrome(timer)),
            _ => Ok(()),
        }
    }
}

/// ACK extended transport header, 4 bytes: syndrome u8, MSN u24.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Aeth {
    pub syndrome: Syndrome,
    /// Message sequence number: how many requests the responder has
    /// completed (modulo 2^24).
    pub msn: u32,
}

impl Aeth {
    pub(super) fn read(b: &[u8]) -> Result<Aeth, WireError> {
        let w = get_u32(b, 0);
        Ok(Aeth { syndrome: Syndrome::from_raw((w >> 24) as u8)?, msn: w & MAX_24 })
    }

    pub(super) fn check(&self) -> Result<(), WireError> {
        self.syndrome.check()?;
        check_24("MSN", self.msn)
    }

    pub(super) fn write(&self, b: &mut [u8]) {
        put_u32(b, 0, (u32::from(self.syndrome.raw()) << 24) | (self.msn & MAX_24));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_syndrome_byte_is_parsed_or_refused_and_round_trips() {
        let mut ok = 0;
        for v in 0..=255u8 {
            if let Ok(s) = Syndrome::from_raw(v) {
                assert_eq!(s.raw(), v);
                ok += 1;
            }
        }
        assert_eq!(ok, 1 + 32 + 5);
    }

    #[test]
    fn naks_map_onto_completion_statuses() {
        assert_eq!(NakCode::RemoteAccessError.completion_status(), Some(WcStatus::RemAccessErr));
        assert_eq!(NakCode::InvalidRequest.completion_status(), Some(WcStatus::RemInvReqErr));
        assert_eq!(NakCode::RemoteOperationalError.completion_status(), Some(WcStatus::RemOpErr));
        assert_eq!(NakCode::PsnSequenceError.completion_status(), None);
        assert_eq!(NakCode::QpPaused.completion_status(), None);
    }
}
