//! The daemon's rdma_cm events, checked before the library keeps or hands
//! out any of them.
//!
//! Why: the library acts on what a reply says before the program sees
//! it: it takes one wake-up from the channel's descriptor for each the
//! reply counts (a system call each), keeps the events after the first
//! for later reads, and the drop-in librdmacm copies an event's private
//! data into a C struct. The daemon is trusted, but less than the
//! library's own state: a reply that counts more wake-ups than a channel
//! can hold, more events than were asked for, an event whose fields
//! cannot be (a status that is no errno nor REJ reason, private data
//! over any CM message's limit) is refused as a protocol error, and
//! nothing of it is kept or taken, rather than acted on in part (the
//! channel is unusable after it: `crate::cm`). A daemon hands out at
//! most `MAX_CM_UNREAD` wake-ups in a reply, all its entries together.

use vrdma_core::cm::{CmEvent, EventKind};
use vrdma_core::proto::{MAX_CM_EVENTS, MAX_CM_UNREAD};

use crate::{Error, Result};

/// Most private data an event carries: a REP's (the largest of the CM
/// messages': a REQ's is 56 bytes, a REJ's 148).
const MAX_PRIVATE_DATA: usize = 196;

/// Largest errno a negative status may name (the kernel's `MAX_ERRNO`).
const MAX_ERRNO: i32 = 4095;

/// Checks one event's fields.
pub(crate) fn check_event(ev: &CmEvent) -> Result<()> {
    let status_ok = match ev.kind {
        // 0, or the REJ's reason (16 bits).
        EventKind::Rejected => (0..=i32::from(u16::MAX)).contains(&ev.status),
        _ => (-MAX_ERRNO..=0).contains(&ev.status),
    };
    if !status_ok {
        return Err(Error::protocol(format!("an rdma_cm {:?} event with status {}", ev.kind, ev.status)));
    }
    if (ev.kind == EventKind::ConnectRequest) != ev.listen_id.is_some() {
        return Err(Error::protocol(format!(
            "an rdma_cm {:?} event with listener {:?}",
            ev.kind, ev.listen_id
        )));
    }
    if let Some(len) = ev.peer.as_ref().map(|p| p.private_data.len()).filter(|&l| l > MAX_PRIVATE_DATA) {
        return Err(Error::protocol(format!("an rdma_cm event with {len} bytes of private data")));
    }
    Ok(())
}

/// Checks one event a reply hands over with the wake-ups the library is
/// to take for it (`CmReply::Event`: a call's or `GetEvent`'s): an event
/// stands for at least its own wake-up, and no reply for more than a
/// channel holds.
pub(crate) fn check_entry(event: Option<&CmEvent>, wakeups: u32) -> Result<()> {
    if wakeups > MAX_CM_UNREAD {
        return Err(Error::protocol(format!(
            "an rdma_cm reply of {wakeups} wake-ups (at most {MAX_CM_UNREAD})"
        )));
    }
    match event {
        Some(_) if wakeups == 0 => Err(Error::protocol("an rdma_cm event without its wake-up")),
        Some(ev) => check_event(ev),
        None => Ok(()),
    }
}

/// Checks a `CmReply::Events` (`GetEvents` for at most `max`): no more
/// entries than asked for (nor than [`MAX_CM_EVENTS`]), each one at least
/// one wake-up (an event's own, or those of events gone with their ids),
/// only the last one without an event (the daemon stops at the first
/// entry it finds none in), all of them together no more wake-ups than a
/// channel holds, and every event's fields in range.
pub(crate) fn check_events(events: &[(Option<CmEvent>, u32)], max: u32) -> Result<()> {
    let most = max.min(MAX_CM_EVENTS) as usize;
    if events.len() > most {
        return Err(Error::protocol(format!("GetEvents for {most} answered with {} events", events.len())));
    }
    let mut total: u32 = 0;
    for (i, (event, wakeups)) in events.iter().enumerate() {
        if *wakeups == 0 {
            return Err(Error::protocol(format!("GetEvents' entry {i} stands for no wake-up")));
        }
        if event.is_none() && i + 1 < events.len() {
            return Err(Error::protocol(format!("GetEvents' entry {i} has no event, and entries follow it")));
        }
        total = total.saturating_add(*wakeups);
        check_entry(event.as_ref(), total)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use vrdma_core::cm::ConnInfo;
    use vrdma_core::hca::ContextId;

    fn ev(kind: EventKind) -> CmEvent {
        CmEvent {
            ctx: ContextId(1),
            id: 7,
            kind,
            status: 0,
            listen_id: (kind == EventKind::ConnectRequest).then_some(3),
            peer: None,
            qkey: 0,
            local: None,
            remote: None,
        }
    }

    #[test]
    fn an_events_fields_are_checked() {
        assert!(check_event(&ev(EventKind::Established)).is_ok());
        assert!(check_event(&ev(EventKind::ConnectRequest)).is_ok());
        assert!(check_event(&CmEvent { status: -110, ..ev(EventKind::Unreachable) }).is_ok());
        assert!(check_event(&CmEvent { status: 28, ..ev(EventKind::Rejected) }).is_ok());
        assert!(check_event(&CmEvent { status: 28, ..ev(EventKind::Established) }).is_err());
        assert!(check_event(&CmEvent { status: -5000, ..ev(EventKind::Unreachable) }).is_err());
        assert!(check_event(&CmEvent { status: 70000, ..ev(EventKind::Rejected) }).is_err());
        assert!(check_event(&CmEvent { listen_id: None, ..ev(EventKind::ConnectRequest) }).is_err());
        assert!(check_event(&CmEvent { listen_id: Some(3), ..ev(EventKind::Established) }).is_err());
        let peer = |n| Some(ConnInfo { private_data: vec![0; n], ..ConnInfo::default() });
        assert!(check_event(&CmEvent { peer: peer(196), ..ev(EventKind::Established) }).is_ok());
        assert!(check_event(&CmEvent { peer: peer(197), ..ev(EventKind::Established) }).is_err());
    }

    #[test]
    fn a_replys_event_and_wake_ups_are_checked() {
        assert!(check_entry(None, 0).is_ok(), "nothing at all");
        assert!(check_entry(None, 3).is_ok(), "wake-ups of events gone with their ids");
        assert!(check_entry(Some(&ev(EventKind::Established)), 1).is_ok());
        assert!(check_entry(Some(&ev(EventKind::Established)), 0).is_err());
        assert!(check_entry(None, MAX_CM_UNREAD + 1).is_err());
    }

    #[test]
    fn a_get_events_reply_is_checked_against_what_was_asked() {
        let one = |w| (Some(ev(EventKind::Established)), w);
        assert!(check_events(&[], MAX_CM_EVENTS).is_ok());
        assert!(check_events(&[one(1), one(2), (None, 1)], MAX_CM_EVENTS).is_ok());
        assert!(check_events(&vec![one(1); 16], MAX_CM_EVENTS).is_ok());
        assert!(check_events(&vec![one(1); 17], MAX_CM_EVENTS).is_err(), "over MAX_CM_EVENTS");
        assert!(check_events(&vec![one(1); 17], 100).is_err(), "over MAX_CM_EVENTS, whatever was asked");
        assert!(check_events(&[one(1), one(1)], 1).is_err(), "more than asked for");
        assert!(check_events(&[one(1), one(0)], MAX_CM_EVENTS).is_err(), "an entry without its wake-up");
        assert!(check_events(&[(None, 1), one(1)], MAX_CM_EVENTS).is_err(), "an empty entry in the middle");
        assert!(check_events(&[one(MAX_CM_UNREAD), one(1)], MAX_CM_EVENTS).is_err(), "over a channel's");
        assert!(check_events(&[one(u32::MAX), one(u32::MAX)], MAX_CM_EVENTS).is_err(), "no overflow");
        let bad = (Some(CmEvent { status: 1, ..ev(EventKind::Established) }), 1);
        assert!(check_events(&[one(1), bad], MAX_CM_EVENTS).is_err(), "every event's fields");
    }
}
