//! The connection manager's messages between daemons: the payload of a
//! [`FrameType::Cm`](super::FrameType::Cm) frame.
//!
//! A message is the [`CmMessage`] value in postcard's encoding (as the
//! control socket's messages are), at most [`MAX_CM_PAYLOAD`] bytes: the
//! largest, a REP with 196 bytes of private data, takes some 230. The
//! decoder bounds every length by the bytes it has and never panics, and
//! what decodes is checked against rdma_cm's private-data limits, so a
//! peer cannot make this side hold more than a frame's worth.

use crate::cm::message::{
    MAX_REJ_PRIVATE_DATA, MAX_REP_PRIVATE_DATA, MAX_REQ_PRIVATE_DATA, MAX_SIDR_REP_PRIVATE_DATA,
    MAX_SIDR_REQ_PRIVATE_DATA,
};
use crate::cm::CmMessage;

use super::WireError;

/// Largest payload of a connection manager's frame.
pub const MAX_CM_PAYLOAD: u32 = 1024;

/// The payload that carries `msg`.
pub fn encode(msg: &CmMessage) -> Vec<u8> {
    // Serialising a value of plain fields into a Vec cannot fail.
    postcard::to_allocvec(msg).expect("a CmMessage serialises")
}

/// The message a payload carries, checked against rdma_cm's limits.
pub fn decode(payload: &[u8]) -> Result<CmMessage, WireError> {
    let msg: CmMessage = postcard::from_bytes(payload).map_err(|_| WireError::BadCmMessage)?;
    let (len, max) = match &msg {
        CmMessage::Req { ps, conn, .. } if ps.is_ud() => (conn.private_data.len(), MAX_SIDR_REQ_PRIVATE_DATA),
        CmMessage::Req { conn, .. } => (conn.private_data.len(), MAX_REQ_PRIVATE_DATA),
        CmMessage::Rep { conn, .. } => {
            (conn.private_data.len(), MAX_REP_PRIVATE_DATA.max(MAX_SIDR_REP_PRIVATE_DATA))
        }
        CmMessage::Rej { private_data, .. } => (private_data.len(), MAX_REJ_PRIVATE_DATA),
        _ => (0, 0),
    };
    if len > max {
        return Err(WireError::BadCmMessage);
    }
    Ok(msg)
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, SocketAddrV4};

    use super::*;
    use crate::cm::{ConnInfo, PortSpace};
    use crate::wire::{parse_frame, FrameRepr, BASE_HEADER_LEN};

    fn req(private: usize) -> CmMessage {
        let a = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), 40000);
        let b = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 2), 7471);
        let conn = ConnInfo { qp_num: 0x11, private_data: vec![7; private], ..ConnInfo::default() };
        CmMessage::Req { from: 3, tenant: 1000, ps: PortSpace::Tcp, src: a, dst: b, conn }
    }

    #[test]
    fn a_message_travels_in_a_frame_and_decodes_to_itself() {
        let msg = req(56);
        let payload = encode(&msg);
        let f = FrameRepr::Cm { len: payload.len() as u32 };
        let mut frame = vec![0u8; BASE_HEADER_LEN];
        assert_eq!(f.emit(&mut frame), Ok(BASE_HEADER_LEN));
        frame.extend_from_slice(&payload);
        let (parsed, body) = parse_frame(&frame).unwrap();
        assert_eq!(parsed, f);
        assert_eq!(decode(body), Ok(msg));
        let rep = CmMessage::Rep {
            to: 3,
            from: 4,
            conn: ConnInfo { private_data: vec![1; 196], ..ConnInfo::default() },
            qkey: 0,
        };
        assert!(encode(&rep).len() < MAX_CM_PAYLOAD as usize / 2);
    }

    #[test]
    fn frames_and_messages_over_their_limits_are_refused() {
        let mut frame = vec![0u8; BASE_HEADER_LEN];
        assert_eq!(FrameRepr::Cm { len: 0 }.emit(&mut frame), Err(WireError::BadCmLen(0)));
        assert_eq!(
            FrameRepr::Cm { len: MAX_CM_PAYLOAD + 1 }.emit(&mut frame),
            Err(WireError::BadCmLen(1025))
        );
        assert_eq!(decode(&encode(&req(57))), Err(WireError::BadCmMessage), "57 bytes with a REQ");
        for garbage in [&[][..], &[0xff; 3][..], &[6, 0xff, 0xff, 0xff, 0xff, 0x0f][..]] {
            assert!(decode(garbage).is_err());
        }
    }
}
