//! `CreateCompChannel`: a completion channel, a ring of CQ numbers whose
//! events the engine raises (`engine::rings`) and a doorbell whose other
//! end is the channel's fd in the tenant.
//!
//! Apart from `session` because a channel is the driver's object, not the
//! core's: the session makes its ring and doorbell, charges it to the
//! tenant's objects itself, and places a guest's in the VM's region, so
//! that it moves with the VM (`migrate_vm`; its adoption on the
//! destination is in `adopt`).

use vrdma_core::hca::HcaError;
use vrdma_core::proto::{Reply, RingSpec, CHANNEL_EVENT_SIZE, CHANNEL_RING_CAPACITY};
use vrdma_shm::{ring_bytes, Doorbell, RingView};

use super::{error, Answer, Carry, Session, ENOMEM, MAX_CHANNELS_PER_TENANT};
use crate::engine::Channel;
use crate::vm::{Kind, Place};

impl Session {
    pub(super) fn create_channel(&mut self) -> Result<Answer, Answer> {
        let len = ring_bytes(CHANNEL_RING_CAPACITY, CHANNEL_EVENT_SIZE);
        let (seg_fd, seg) = self.new_segment("vrdma-channel", len, self.budget())?;
        let ring = RingView::in_segment(seg.clone(), 0, CHANNEL_RING_CAPACITY, CHANNEL_EVENT_SIZE)
            .map_err(|e| error(ENOMEM, e.to_string()))?;
        let (fd, tenant_end) = Doorbell::pair()?;
        // One datagram per unread event (see engine::rings): room for as
        // many as the ring holds, as far as net.core.wmem_max allows.
        let max_unread =
            fd.reserve(CHANNEL_RING_CAPACITY as usize).clamp(1, CHANNEL_RING_CAPACITY as usize) as u32;
        let extent = match &seg_fd {
            Carry::Extent { offset, len } => Some((*offset, *len)),
            _ => None,
        };
        let fds = vec![seg_fd, tenant_end.into()];
        let seg_len = seg.len() as u64;
        // A channel counts against the tenant's object quota: it holds a
        // mapping and descriptors in the daemon. The descriptor cannot be
        // spared (the daemon signals the tenant's end through it), so a
        // tenant's channels are bounded apart, well below the objects: the
        // daemon's descriptors are shared by every tenant.
        let tenant = self.tenant;
        let channel = self.engine(move |e, c| {
            let held = e.rings.channels.values().filter(|ch| ch.tenant == tenant).count();
            if held >= MAX_CHANNELS_PER_TENANT {
                return Err(HcaError::QuotaExceeded(format!(
                    "a tenant may hold at most {MAX_CHANNELS_PER_TENANT} completion channels"
                )));
            }
            e.hca.charge_object(c)?;
            let id = e.rings.free_channel_id(&e.hca, |n| e.cm.has_channel(n));
            e.rings.channels.insert(id, Channel { ctx: c, tenant, ring, fd, cqs: 0, max_unread });
            Ok::<_, HcaError>(id)
        })??;
        // A guest's channel ring is in the VM's region: placed, so that it
        // moves with the VM (`migrate_vm`).
        if let Some((offset, len)) = extent {
            self.place(Kind::Channel, channel, Place::Ring(offset, len));
        }
        Ok(Answer {
            reply: Reply::CompChannel {
                channel,
                segment_len: seg_len,
                ring: RingSpec {
                    offset: 0,
                    capacity: CHANNEL_RING_CAPACITY,
                    stride: CHANNEL_EVENT_SIZE as u32,
                },
            },
            fds,
        })
    }
}
