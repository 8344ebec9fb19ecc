//! The socket registry's messages between daemons: the payload of a
//! [`FrameType::Sock`](super::FrameType::Sock) frame (wire version 3;
//! version 4 appends the IPv6 kinds, see [`super::VERSION`]).
//!
//! A message is the [`SockMessage`] value in postcard's encoding, at most
//! [`MAX_SOCK_PAYLOAD`] bytes: version 3's kinds take at most
//! [`MAX_SOCK_PAYLOAD_V3`] (the largest, a resolve's query, some 30), an
//! IPv6 resolve some 50, and a host's IPv6 addresses 2 + 16 each, at most
//! [`MAX_HOST6`](crate::sockets::peer::MAX_HOST6) of them. The decoder
//! bounds every length by the bytes it has and never panics; the values
//! are plain (addresses, numbers, fixed enums) but for the address list,
//! whose decoder stops at its bound whatever count it claims.

use crate::sockets::peer::SockMessage;

use super::WireError;

/// Largest payload of a socket registry's frame (wire version 4).
pub const MAX_SOCK_PAYLOAD: u32 = 1024;
/// Largest payload of a socket registry's frame that a version-3 daemon
/// takes: every kind version 3 has fits in it, and only those go on a
/// link of version 3.
pub const MAX_SOCK_PAYLOAD_V3: u32 = 128;

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
    use std::net::{Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6};

    use super::*;
    use crate::sockets::peer::{Addrs6, Answer, PeerTuple, PeerTuple6, Query, MAX_HOST6};
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

    fn tuple6() -> PeerTuple6 {
        PeerTuple6 {
            client: SocketAddrV6::new(Ipv6Addr::from([0xff; 16]), u16::MAX, 0, 0),
            server: SocketAddrV6::new("fd00::2".parse().unwrap(), 5001, 0, 0),
        }
    }

    /// Wire version 4's kinds, at their largest.
    fn all6() -> Vec<SockMessage> {
        let big = u32::MAX;
        let many = (0..MAX_HOST6 as u128).map(|i| Ipv6Addr::from(u128::MAX - i)).collect();
        vec![
            SockMessage::Query {
                id: big,
                tenant: big,
                ctx: big,
                query: Query::Lookup6 { dst: tuple6().server },
            },
            SockMessage::Query {
                id: big,
                tenant: big,
                ctx: big,
                query: Query::Announce6 { tuple: tuple6() },
            },
            SockMessage::Query {
                id: big,
                tenant: big,
                ctx: big,
                query: Query::Resolve6 { tuple: tuple6(), give_up: true },
            },
            SockMessage::Hosts6 { addrs: Addrs6::default() },
            SockMessage::Hosts6 { addrs: Addrs6::new(vec![Ipv6Addr::LOCALHOST]) },
            SockMessage::Hosts6 { addrs: Addrs6::new(many) },
        ]
    }

    #[test]
    fn every_message_travels_in_a_frame_and_decodes_to_itself() {
        for msg in all().into_iter().chain(all6()) {
            let payload = encode(&msg);
            assert!(payload.len() <= MAX_SOCK_PAYLOAD as usize / 2 + 16, "{msg:?}: {} bytes", payload.len());
            let f = FrameRepr::Sock { len: payload.len() as u32 };
            let mut frame = vec![0u8; BASE_HEADER_LEN];
            assert_eq!(f.emit(&mut frame), Ok(BASE_HEADER_LEN));
            frame.extend_from_slice(&payload);
            let (parsed, body) = parse_frame(&frame).unwrap();
            assert_eq!(parsed, f);
            assert_eq!(decode(body), Ok(msg));
        }
    }

    /// What a version-3 daemon may get: its kinds, within its bound; the
    /// IPv6 kinds are version 4's (a version-3 decoder ends the link on
    /// them, so they never go on a version-3 link).
    #[test]
    fn version_threes_kinds_fit_its_bound_and_the_ipv6_ones_are_version_four() {
        for msg in all() {
            assert_eq!(msg.min_version(), crate::wire::SOCK_VERSION, "{msg:?}");
            assert!(encode(&msg).len() <= MAX_SOCK_PAYLOAD_V3 as usize, "{msg:?}");
        }
        for msg in all6() {
            assert_eq!(msg.min_version(), crate::wire::SOCK6_VERSION, "{msg:?}");
        }
        assert_eq!(crate::wire::SOCK6_VERSION, crate::wire::VERSION);
        // A version-3 decoder reads the first byte of a message as its
        // kind (0..=2) and the kind of a query as 0..=2: the new ones are
        // past both, so it refuses them (and ends the link) rather than
        // reading them as something else.
        for msg in all6() {
            let b = encode(&msg);
            assert!(b[0] == 3 || (b[0] == 0 && b[16] >= 3), "{msg:?}: {b:?}");
        }
    }

    /// The IPv6 kinds' bytes (wire version 4): the same shape as the IPv4
    /// ones, each address its 16 bytes, after the kinds version 3 has.
    #[test]
    fn the_ipv6_kinds_have_these_bytes() {
        let a = |s: &str| SocketAddrV6::new(s.parse().unwrap(), 0, 0, 0);
        let tuple = PeerTuple6 {
            client: SocketAddrV6::new(*a("fd00::1").ip(), 40000, 0, 0),
            server: SocketAddrV6::new(*a("fd00::2").ip(), 5000, 0, 0),
        };
        let msg = SockMessage::Query { id: 1, tenant: 1000, ctx: 2, query: Query::Announce6 { tuple } };
        let fd = |last: u8| [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, last];
        let want =
            [&[0x00, 0x01, 0xe8, 0x07, 0x02, 0x04][..], &fd(1), &[0xc0, 0xb8, 0x02], &fd(2), &[0x88, 0x27]]
                .concat();
        assert_eq!(encode(&msg), want);
        let lookup =
            SockMessage::Query { id: 1, tenant: 1000, ctx: 2, query: Query::Lookup6 { dst: tuple.server } };
        assert_eq!(encode(&lookup)[5..], [&[0x03][..], &want[25..]].concat());
        let resolve = Query::Resolve6 { tuple, give_up: false };
        let resolve = SockMessage::Query { id: 1, tenant: 1000, ctx: 2, query: resolve };
        assert_eq!(encode(&resolve)[5..], [&[0x05][..], &want[6..], &[0x00][..]].concat());
        let hosts = SockMessage::Hosts6 { addrs: Addrs6::new(vec![*tuple.client.ip(), *tuple.server.ip()]) };
        assert_eq!(encode(&hosts), [&[0x03, 0x02][..], &fd(1), &fd(2)].concat());
    }

    /// A host's address list longer than its bound is refused whatever
    /// its count claims (no room is reserved for the count); a list is
    /// cut to the bound when made.
    #[test]
    fn an_address_list_past_its_bound_is_refused() {
        let addr = [0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
        let list = |n: usize, claim: &[u8]| {
            let mut b = vec![0x03];
            b.extend_from_slice(claim);
            for _ in 0..n {
                b.extend_from_slice(&addr);
            }
            b
        };
        assert!(
            matches!(decode(&list(MAX_HOST6, &[MAX_HOST6 as u8])), Ok(SockMessage::Hosts6 { addrs }) if addrs.as_slice().len() == MAX_HOST6)
        );
        assert_eq!(decode(&list(MAX_HOST6 + 1, &[MAX_HOST6 as u8 + 1])), Err(WireError::BadSockMessage));
        assert_eq!(decode(&list(2, &[0xff, 0xff, 0xff, 0xff, 0x0f])), Err(WireError::BadSockMessage));
        assert_eq!(decode(&list(2, &[3])), Err(WireError::BadSockMessage));
        let long = Addrs6::new(vec![Ipv6Addr::LOCALHOST; MAX_HOST6 + 5]);
        assert_eq!(long.as_slice().len(), MAX_HOST6);
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
        for msg in all().into_iter().chain(all6()) {
            let b = encode(&msg);
            for n in 0..b.len() {
                assert_eq!(decode(&b[..n]), Err(WireError::BadSockMessage), "{msg:?} cut at {n}");
            }
            let mut more = b.clone();
            more.push(0);
            assert_eq!(decode(&more), Err(WireError::BadSockMessage));
        }
        for garbage in [&[][..], &[3][..], &[4][..], &[0xff; 9][..], &[1, 0xff, 0xff, 0xff, 0xff, 0xff][..]] {
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
