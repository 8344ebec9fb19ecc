//! A guest's numbered calls: each runs at most once, and a call sent
//! again gets the answer the first one got (issue 19).
//!
//! A reply can be lost in a live migration: written into the source's
//! port after QEMU stopped the VM, it never reaches the guest, whose
//! library then takes its context back on the destination and sends the
//! call again. A query answers the same there; a call that changed state
//! may have run on the source before the export, and must not run again
//! (a second CQ, a leaked one; a modify to RTS of a QP in RTS already
//! fails). So the guest's library numbers its calls per context
//! (`Frame::NumberedCall`, from 1), and the daemon remembers, per
//! context, the number and the encoded reply of the last one it answered:
//!
//! - the same number again is answered from memory, not run;
//! - an older number is refused (`EINVAL`): it was answered, and its
//!   answer is no longer kept;
//! - a newer one runs, and its reply is remembered in place of the last.
//!
//! The memory is kept beside the VM's places (`vm::Placed::answers`),
//! written by the port's thread while the call still holds the pause
//! gate's pass (so that a pause, and the export after it, see the answer
//! of every call that ran); the export carries it (snapshot version 4,
//! `TenantSnapshot::answers`) and the import brings it for the adopting
//! session, so a call re-sent on the destination is answered with the
//! source's reply. A reply is kept up to `MAX_REMEMBERED_REPLY` bytes (a
//! state-changing call's reply is a few numbers and handles, or an
//! error); a larger one (a query's) is kept as answered, without its
//! bytes, and sent again it runs again if it changes nothing, else it is
//! refused (`EIO`).
//!
//! A remembered reply that came with the move names the source port's
//! doorbell proxies: a completion channel's or an rdma_cm event channel's
//! is the one the adoption handed over for that channel (the port's
//! `moved_bells`), any other is refused (`ENODEV`).

use std::collections::HashMap;

use vrdma_core::hca::migrate::AnswerSnap;
use vrdma_core::proto::guest::{decode_reply_body, encode_reply_body, Handle, MAX_REMEMBERED_REPLY};
use vrdma_core::proto::Reply;

use crate::vm::Vm;

/// The last numbered call a guest context's session answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Remembered {
    pub number: u64,
    /// Its reply, a `Reply` frame's body; empty when it was too large to
    /// keep.
    pub reply: Vec<u8>,
    /// Brought by an import: its doorbells are the source port's.
    pub moved: bool,
}

/// What a numbered call's number says.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Seen {
    /// Newer than the last answered (or the first): it runs.
    New,
    /// The last answered, sent again: its reply.
    Again(Remembered),
    /// Older than the last answered (its number).
    Older(u64),
}

/// Where numbered call `number` of context `ctx` stands.
pub(super) fn seen(vm: &Vm, ctx: u32, number: u64) -> Seen {
    match vm.placed().answers.get(&ctx) {
        Some(r) if r.number == number => Seen::Again(r.clone()),
        Some(r) if r.number > number => Seen::Older(r.number),
        _ => Seen::New,
    }
}

/// Remembers `reply` (with `handles`) as the answer of numbered call
/// `number` of context `ctx`.
pub(super) fn remember(vm: &Vm, ctx: u32, number: u64, reply: &Reply, handles: &[Handle]) {
    let mut bytes = encode_reply_body(reply, handles);
    if bytes.len() > MAX_REMEMBERED_REPLY {
        bytes = Vec::new();
    }
    vm.placed().answers.insert(ctx, Remembered { number, reply: bytes, moved: false });
}

/// The reply of a call sent again, from memory: `None` when it was too
/// large to keep. A reply that came with the move has its completion
/// (or rdma_cm event) channel's doorbell renamed to the proxy the adoption made for it
/// (`moved_bells`: channel number -> proxy); any other doorbell did not
/// move, and the call is answered with an error saying so.
pub(super) fn replay(r: &Remembered, moved_bells: &HashMap<u32, u32>) -> Option<(Reply, Vec<Handle>)> {
    if r.reply.is_empty() {
        return None;
    }
    let (reply, mut handles) = match decode_reply_body(&r.reply) {
        Ok(d) => d,
        // Checked when remembered, or at the import.
        Err(e) => return Some((not_kept(&format!("its remembered reply does not decode: {e}")), Vec::new())),
    };
    if !r.moved || !handles.iter().any(|h| matches!(h, Handle::Bell { .. })) {
        return Some((reply, handles));
    }
    let proxy = match &reply {
        Reply::CompChannel { channel, .. } | Reply::Cm(vrdma_core::proto::CmReply::Channel { channel }) => {
            moved_bells.get(channel).copied()
        }
        _ => None,
    };
    let Some(proxy) = proxy else {
        let why =
            "the call ran on the host the context left, and the doorbell its reply carried did not move";
        return Some((Reply::Error { errno: libc::ENODEV, message: why.into() }, Vec::new()));
    };
    for h in &mut handles {
        if let Handle::Bell { id, .. } = h {
            *id = proxy;
        }
    }
    Some((reply, handles))
}

/// The error for a call sent again whose answer is not kept.
pub(super) fn not_kept(why: &str) -> Reply {
    Reply::Error {
        errno: libc::EIO,
        message: format!(
            "this numbered call was answered already and changed state; {why}: it is not run again"
        ),
    }
}

/// The remembered answers of `contexts`, for the export.
pub(super) fn of(vm: &Vm, contexts: &[u32]) -> Vec<AnswerSnap> {
    let placed = vm.placed();
    let mut out: Vec<AnswerSnap> = contexts
        .iter()
        .filter_map(|c| {
            let r = placed.answers.get(c)?;
            Some(AnswerSnap { ctx: *c, number: r.number, reply: r.reply.clone() })
        })
        .collect();
    out.sort_unstable_by_key(|a| a.ctx);
    out
}

/// The answers an import brought (checked by the core's import), for the
/// sessions that adopt their contexts.
pub(super) fn brought(vm: &Vm, answers: &[AnswerSnap]) {
    let mut placed = vm.placed();
    for a in answers {
        placed.answers.insert(a.ctx, Remembered { number: a.number, reply: a.reply.clone(), moved: true });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept(reply: Reply, handles: &[Handle], moved: bool) -> Remembered {
        Remembered { number: 3, reply: encode_reply_body(&reply, handles), moved }
    }

    /// A reply from memory is the one remembered; one that came with the
    /// move has its completion channel's doorbell renamed to the proxy
    /// the adoption made, and any other doorbell refused; one too large to
    /// keep is not replayed.
    #[test]
    fn a_moved_replys_doorbell_is_the_adopters_or_refused() {
        let seg = Handle::Extent { offset: 8192, len: 4096 };
        let ring = vrdma_core::proto::RingSpec { offset: 0, capacity: 8, stride: 4 };
        let chan = Reply::CompChannel { channel: 0x300_0001, segment_len: 4096, ring };
        let bells = HashMap::from([(0x300_0001, 9)]);
        let here = kept(chan.clone(), &[seg, Handle::Bell { id: 4, hangup: false }], false);
        assert_eq!(
            replay(&here, &bells),
            Some((chan.clone(), vec![seg, Handle::Bell { id: 4, hangup: false }]))
        );
        let moved = Remembered { moved: true, ..here.clone() };
        assert_eq!(
            replay(&moved, &bells),
            Some((chan.clone(), vec![seg, Handle::Bell { id: 9, hangup: false }]))
        );
        match replay(&moved, &HashMap::new()) {
            Some((Reply::Error { errno, .. }, h)) => assert_eq!((errno, h.len()), (libc::ENODEV, 0)),
            other => panic!("a doorbell that did not move: {other:?}"),
        }
        // An rdma_cm event channel's too (snapshot version 5).
        let cm = Reply::Cm(vrdma_core::proto::CmReply::Channel { channel: 0x300_0001 });
        let cm_moved = kept(cm.clone(), &[Handle::Bell { id: 4, hangup: true }], true);
        assert_eq!(replay(&cm_moved, &bells), Some((cm, vec![Handle::Bell { id: 9, hangup: true }])));
        let cq = Reply::Pd { pd: 5 };
        assert_eq!(replay(&kept(cq.clone(), &[seg], true), &bells), Some((cq, vec![seg])));
        assert_eq!(replay(&Remembered { reply: Vec::new(), ..here }, &bells), None);
    }
}
