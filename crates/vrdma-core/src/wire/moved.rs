//! The Moved frame: "QP `qpn` of virtual network `vnet`, connected to your
//! QP `peer_qpn`, now lives at the host that sends this, in migration
//! epoch `epoch`" (see `docs/migration.md`).
//!
//! It is the proof a peer's daemon accepts that a migrated QP answers
//! from a new link: it arrives on an authenticated link between daemons,
//! names the peer QP and the tenant's network, and carries an epoch that
//! must be higher than any the peer accepted for that QP before, so that
//! the host a QP left can never take it back with a stale claim.
//!
//! ```text
//! 12 vnet u32   16 qpn u32 (24 bits)   20 peer_qpn u32 (24 bits)
//! 24 epoch u32 (>= 1)                                  (28 bytes)
//! ```

use super::{check_24, get_u32, put_u32, WireError, BASE_HEADER_LEN};

pub(super) const MOVED_LEN: usize = BASE_HEADER_LEN + 16;

/// A migrated QP announces its new location to its peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MovedRepr {
    /// The tenant's virtual network (its uid), as in data frames.
    pub vnet: u32,
    /// The QP that moved (its number is the same on the new host).
    pub qpn: u32,
    /// The receiver's QP it is connected to.
    pub peer_qpn: u32,
    /// The QP's migration generation: 1 after its first move, one more
    /// after each.
    pub epoch: u32,
}

impl MovedRepr {
    pub(super) fn check(&self) -> Result<(), WireError> {
        check_24("moved.qpn", self.qpn)?;
        check_24("moved.peer_qpn", self.peer_qpn)?;
        if self.epoch == 0 {
            return Err(WireError::OutOfRange { field: "moved.epoch", value: 0 });
        }
        Ok(())
    }

    pub(super) fn read(b: &[u8]) -> Result<MovedRepr, WireError> {
        let m = MovedRepr {
            vnet: get_u32(b, 12),
            qpn: get_u32(b, 16),
            peer_qpn: get_u32(b, 20),
            epoch: get_u32(b, 24),
        };
        m.check()?;
        Ok(m)
    }

    pub(super) fn write(&self, b: &mut [u8]) {
        put_u32(b, 12, self.vnet);
        put_u32(b, 16, self.qpn);
        put_u32(b, 20, self.peer_qpn);
        put_u32(b, 24, self.epoch);
    }
}
