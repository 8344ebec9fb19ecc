//! The socket registry's messages between daemons: the payload of a
//! [`FrameType::Sock`](super::FrameType::Sock) frame (wire version 3,
//! see [`super::VERSION`]).
//!
//! A message is the [`SockMessage`] value in postcard's encoding, at most
//! [`MAX_SOCK_PAYLOAD`] bytes (the largest, a resolve's query, takes some
//! 30). The decoder bounds every length by the bytes it has and never
//! panics; the values are plain (addresses, numbers, fixed enums), so
//! what decodes holds nothing that grows.

use crate::sockets::peer::SockMessage;

use super::WireError;

/// Largest payload of a socket registry's frame.
pub const MAX_SOCK_PAYLOAD: u32 = 128;

/// The payload that carries `msg`.
pub fn encode(msg: &SockMessage) -> Vec<u8> {
    // Serialising a value of plain fields into a Vec cannot fail.
    postcard::to_allocvec(msg).expect("a SockMessage serialises")
}

/// The message a payload carries; all of the payload must be the message.
pub fn decode(payload: &[u8]) -> Result<SockMessage, WireError> {
    match postcard::take_from_bytes::<SockMessage>(payload) {
        Ok((msg, [])) => Ok(msg),
        _ => Err(WireError::BadSockMessage),
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, SocketAddrV4};

    use super::*;
    use crate::sockets::peer::{Answer, PeerTuple, Query};
    use crate::sockets::Outcome;
    use crate::wire::{parse_frame, FrameRepr, BASE_HEADER_LEN};

    fn tuple() -> PeerTuple {
        PeerTuple {
            client: SocketAddrV4::new(Ipv4Addr::new(255, 255, 255, 255), u16::MAX),
            server: SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 2), 5001),
        }
    }

    fn all() -> Vec<SockMessage> {
        let big = u32::MAX;
        vec![
            SockMessage::Query {
                id: big,
                tenant: big,
                ctx: big,
                query: Query::Lookup { dst: tuple().server },
            },
            SockMessage::Query { id: 1, tenant: 1000, ctx: 2, query: Query::Announce { tuple: tuple() } },
            SockMessage::Query {
                id: big,
                tenant: big,
                ctx: big,
                query: Query::Resolve { tuple: tuple(), give_up: true },
            },
            SockMessage::Answer { id: 7, answer: Answer::Yes },
            SockMessage::Answer { id: big, answer: Answer::No },
            SockMessage::Answer { id: big, answer: Answer::Outcome(Outcome::Carried) },
            SockMessage::Closed { ctx: big },
        ]
    }

    #[test]
    fn every_message_travels_in_a_frame_and_decodes_to_itself() {
        for msg in all() {
            let payload = encode(&msg);
            assert!(payload.len() <= MAX_SOCK_PAYLOAD as usize / 2, "{msg:?}: {} bytes", payload.len());
            let f = FrameRepr::Sock { len: payload.len() as u32 };
            let mut frame = vec![0u8; BASE_HEADER_LEN];
            assert_eq!(f.emit(&mut frame), Ok(BASE_HEADER_LEN));
            frame.extend_from_slice(&payload);
            let (parsed, body) = parse_frame(&frame).unwrap();
            assert_eq!(parsed, f);
            assert_eq!(decode(body), Ok(msg));
        }
    }

    /// Wire version 3's bytes: the registry's addresses took IPv6, the
    /// daemons' exchange did not (its tuples are IPv4, encoded as before).
    #[test]
    fn an_announcement_keeps_wire_version_threes_bytes() {
        let tuple = PeerTuple {
            client: SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), 40000),
            server: SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 2), 5000),
        };
        let msg = SockMessage::Query { id: 1, tenant: 1000, ctx: 2, query: Query::Announce { tuple } };
        let want =
            [0x00, 0x01, 0xe8, 0x07, 0x02, 0x01, 10, 0, 0, 1, 0xc0, 0xb8, 0x02, 10, 0, 0, 2, 0x88, 0x27];
        assert_eq!(encode(&msg), want);
        let resolve = SockMessage::Query {
            id: 1,
            tenant: 1000,
            ctx: 2,
            query: Query::Resolve { tuple, give_up: true },
        };
        assert_eq!(encode(&resolve)[5..], [&[0x02][..], &want[6..], &[0x01][..]].concat());
    }

    #[test]
    fn frames_and_messages_out_of_bounds_are_refused() {
        let mut frame = vec![0u8; BASE_HEADER_LEN];
        assert_eq!(FrameRepr::Sock { len: 0 }.emit(&mut frame), Err(WireError::BadSockLen(0)));
        assert_eq!(
            FrameRepr::Sock { len: MAX_SOCK_PAYLOAD + 1 }.emit(&mut frame),
            Err(WireError::BadSockLen(MAX_SOCK_PAYLOAD + 1))
        );
        // A frame that claims too long a payload is refused at its base header.
        FrameRepr::Sock { len: 1 }.emit(&mut frame).unwrap();
        frame[8..12].copy_from_slice(&(MAX_SOCK_PAYLOAD + 1).to_be_bytes());
        assert_eq!(parse_frame(&frame).map(|f| f.0), Err(WireError::BadSockLen(MAX_SOCK_PAYLOAD + 1)));
        // Every truncation of every message, trailing bytes, unknown
        // variants and garbage: refused, never a panic.
        for msg in all() {
            let b = encode(&msg);
            for n in 0..b.len() {
                assert_eq!(decode(&b[..n]), Err(WireError::BadSockMessage), "{msg:?} cut at {n}");
            }
            let mut more = b.clone();
            more.push(0);
            assert_eq!(decode(&more), Err(WireError::BadSockMessage));
        }
        for garbage in [&[][..], &[3][..], &[0xff; 9][..], &[1, 0xff, 0xff, 0xff, 0xff, 0xff][..]] {
            assert_eq!(decode(garbage), Err(WireError::BadSockMessage));
        }
    }

    /// A version-2 daemon never gets a Sock frame: what it would do with
    /// one is refuse it, naming its type. Here: the frame type is known
    /// to this code, and an unknown one (the next number) is refused
    /// clearly.
    #[test]
    fn an_unknown_frame_type_is_refused_by_name() {
        let mut frame = vec![0u8; BASE_HEADER_LEN];
        FrameRepr::Sock { len: 1 }.emit(&mut frame).unwrap();
        frame.push(0);
        assert_eq!(frame[3], 0x07);
        frame[3] = 0x08;
        assert_eq!(parse_frame(&frame).map(|f| f.0), Err(WireError::UnknownFrameType(0x08)));
    }
}
