//! Round trips, fragmentation, truncation, corruption and authentication.

use super::auth::{self, AuthError};
use super::*;
use crate::verbs::Gid;

/// A small deterministic generator, so the tests need no crate.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn hello(role: Role, id: u64, nonce_byte: u8) -> HelloRepr {
    HelloRepr::new(role, id, Gid::from_ipv4([10, 0, 0, id as u8]), 7, [nonce_byte; NONCE_LEN])
}

/// A valid data header for every opcode, with a payload length that fits.
fn sample(op: Opcode) -> DataRepr {
    let mut d = DataRepr::new(op, 0x00ab_cdef, 0x12_3456, 0x65_4321, 0xff_fffe);
    let e = op.exts();
    if op.carries_payload() {
        d.payload_len = 100;
    }
    if op.is_middle() || op.is_last() {
        d.msg_offset = 4096;
    }
    if e.ud {
        d.ud = Some(UdEth {
            qkey: 0x1111_2222,
            sgid: Gid::from_ipv4([192, 168, 1, 2]),
            slid: 3,
            global: true,
            sl: 0xa,
            hop_limit: 64,
        });
    }
    if e.reth {
        let dma_len = if matches!(op, Opcode::WriteFirst) { 1 << 20 } else { d.payload_len };
        d.reth = Some(Reth { va: 0x7fff_0000_1000, rkey: 0xdead_beef, dma_len });
    }
    if op == Opcode::ReadRequest {
        d.reth = Some(Reth { va: 0x1000, rkey: 9, dma_len: 1 << 20 });
    }
    if e.atomic {
        d.atomic = Some(AtomicEth { va: 0x2000, rkey: 5, swap_add: u64::MAX, compare: 1 });
    }
    if e.aeth {
        d.aeth = Some(Aeth { syndrome: Syndrome::Ack, msn: 0xff_ffff });
    }
    if e.atomic_ack {
        d.atomic_ack = Some(0x0123_4567_89ab_cdef);
    }
    if e.imm {
        d.imm = Some(0xcafe_f00d);
    }
    if op.may_be_solicited() {
        d.flags |= DataFlags::SOLICITED;
    }
    if op.may_request_ack() {
        d.flags |= DataFlags::ACK_REQ;
    }
    d
}

/// One of every frame: every control type, every opcode, every syndrome.
fn all_frames() -> Vec<FrameRepr> {
    let mut v = vec![
        FrameRepr::Hello(hello(Role::Initiator, 1, 0xaa)),
        FrameRepr::Hello(hello(Role::Acceptor, u64::MAX, 0x55)),
        FrameRepr::Auth([0x42; TAG_LEN]),
        FrameRepr::Keepalive(KeepaliveRepr { seq: 17, reply: false }),
        FrameRepr::Keepalive(KeepaliveRepr { seq: u64::MAX, reply: true }),
        FrameRepr::Close(CloseRepr { reason: CloseReason::ProtocolError, detail: 0x10 }),
        FrameRepr::Close(CloseRepr { reason: CloseReason::KeepaliveTimeout, detail: 0 }),
        FrameRepr::Moved(MovedRepr { vnet: 1000, qpn: 0x11, peer_qpn: MAX_24, epoch: 1 }),
        FrameRepr::Moved(MovedRepr { vnet: u32::MAX, qpn: 2, peer_qpn: 3, epoch: u32::MAX }),
        FrameRepr::Sock { len: 1 },
        FrameRepr::Sock { len: sock::MAX_SOCK_PAYLOAD },
    ];
    v.extend(Opcode::ALL.iter().map(|op| FrameRepr::Data(sample(*op))));
    let mut ack = sample(Opcode::Acknowledge);
    for s in [
        Syndrome::RnrNak { timer: 31 },
        Syndrome::Nak(NakCode::PsnSequenceError),
        Syndrome::Nak(NakCode::InvalidRequest),
        Syndrome::Nak(NakCode::RemoteAccessError),
        Syndrome::Nak(NakCode::RemoteOperationalError),
        Syndrome::Nak(NakCode::QpPaused),
    ] {
        ack.aeth = Some(Aeth { syndrome: s, msn: 3 });
        v.push(FrameRepr::Data(ack));
    }
    v
}

/// The frame's bytes, with a payload of a recognisable pattern.
fn encode(f: &FrameRepr) -> Vec<u8> {
    let mut b = vec![0u8; f.buffer_len()];
    let hl = f.emit(&mut b).unwrap();
    for (i, x) in b[hl..].iter_mut().enumerate() {
        *x = (i * 7 + 3) as u8;
    }
    b
}

/// What a stream decodes to: headers and payload bytes (with the header
/// bytes each header was parsed from), or the error that ended it.
#[derive(Debug, PartialEq)]
struct Decoded {
    frames: Vec<(FrameRepr, Vec<u8>)>,
    error: Option<WireError>,
}

fn decode_split(stream: &[u8], mut piece: impl FnMut() -> usize) -> Decoded {
    let mut dec = FrameDecoder::new();
    let mut out = Decoded { frames: vec![], error: None };
    let mut rest = stream;
    while !rest.is_empty() {
        let n = piece().clamp(1, rest.len());
        let mut input = &rest[..n];
        rest = &rest[n..];
        while !input.is_empty() {
            match dec.feed(input) {
                Err(e) => {
                    out.error = Some(e);
                    return out;
                }
                Ok((used, ev)) => {
                    assert!(used > 0 || ev.is_some(), "no progress");
                    match ev {
                        Some(Event::Header(h)) => out.frames.push((h, vec![])),
                        Some(Event::Payload { data, offset, remaining }) => {
                            let p = &mut out.frames.last_mut().unwrap().1;
                            assert_eq!(offset as usize, p.len());
                            p.extend_from_slice(data);
                            assert_eq!(
                                remaining == 0,
                                p.len() == out.frames.last().unwrap().0.payload_len() as usize
                            );
                        }
                        None => {}
                    }
                    input = &input[used..];
                }
            }
        }
    }
    if let Err(e) = dec.finish() {
        out.error = Some(e);
    }
    out
}

#[test]
fn every_frame_round_trips() {
    for f in all_frames() {
        let b = encode(&f);
        let (g, payload) = parse_frame(&b).unwrap_or_else(|e| panic!("{f:?}: {e}"));
        assert_eq!(g, f);
        assert_eq!(payload.len(), f.payload_len() as usize);
        let p = Packet::new_checked(&b[..]).unwrap();
        assert_eq!(p.magic(), MAGIC);
        let base = match f {
            FrameRepr::Hello(_) | FrameRepr::Close(_) => HELLO_VERSION,
            _ => FRAME_VERSION,
        };
        assert_eq!(p.version(), base, "{f:?}");
        assert_eq!(p.header_len() as usize, f.header_len());
        assert_eq!(FrameRepr::parse(&p).unwrap(), f);
        if let FrameRepr::Data(d) = f {
            assert_eq!(
                (p.dest_qpn(), p.src_qpn(), p.psn(), p.vnet()),
                (d.dest_qpn, d.src_qpn, d.psn, d.vnet)
            );
            assert!(f.header_len() <= MAX_DATA_HEADER_LEN);
        }
        assert!(f.header_len() <= MAX_HEADER_LEN);
    }
}

#[test]
fn stream_decodes_the_same_whole_byte_by_byte_and_split_at_random() {
    let frames = all_frames();
    let stream: Vec<u8> = frames.iter().flat_map(encode).collect();
    let whole = decode_split(&stream, || usize::MAX);
    assert_eq!(whole.error, None);
    assert_eq!(whole.frames.iter().map(|f| f.0).collect::<Vec<_>>(), frames);
    for (f, p) in &whole.frames {
        assert_eq!(*p, encode(f)[f.header_len()..]);
    }
    assert_eq!(decode_split(&stream, || 1), whole);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for _ in 0..200 {
        let max = 1 + rng.below(200);
        assert_eq!(decode_split(&stream, || 1 + rng.below(max)), whole);
    }
}

#[test]
fn payload_read_straight_into_a_region() {
    // The transport's way: read the header only, check it, then read the
    // payload from the socket into the destination and report it.
    let mut d = sample(Opcode::WriteMiddle);
    d.payload_len = MAX_CHUNK;
    let f = FrameRepr::Data(d);
    let mut stream = encode(&f);
    stream.extend(encode(&FrameRepr::Keepalive(KeepaliveRepr { seq: 1, reply: false })));
    let mut dec = FrameDecoder::new();
    let mut at = 0;
    let mut region = vec![0u8; MAX_CHUNK as usize];
    let header = loop {
        let Want::Header(n) = dec.want() else { panic!() };
        let (used, ev) = dec.feed(&stream[at..at + n]).unwrap();
        at += used;
        if let Some(Event::Header(h)) = ev {
            break h;
        }
    };
    assert_eq!(header, f);
    assert_eq!(at, f.header_len(), "no payload byte was taken into the decoder");
    assert_eq!(dec.want(), Want::Payload(MAX_CHUNK));
    // "recv" straight into the region, in two reads.
    let half = (MAX_CHUNK / 2) as usize;
    region[..half].copy_from_slice(&stream[at..at + half]);
    assert_eq!(dec.payload_placed(half).unwrap(), MAX_CHUNK / 2);
    region[half..].copy_from_slice(&stream[at + half..at + 2 * half]);
    assert_eq!(dec.payload_placed(half).unwrap(), 0);
    at += 2 * half;
    assert_eq!(region, encode(&f)[f.header_len()..]);
    let (_, ev) = dec.feed(&stream[at..]).unwrap();
    assert!(matches!(ev, Some(Event::Header(FrameRepr::Keepalive(_)))));
    assert!(dec.is_idle());
    assert_eq!(dec.payload_placed(1), Err(WireError::PayloadOverrun));
}

#[test]
fn every_truncation_is_refused() {
    for f in all_frames() {
        let b = encode(&f);
        for k in 0..b.len() {
            assert_eq!(parse_frame(&b[..k]).map(|_| ()), Err(WireError::Truncated), "{f:?} cut at {k}");
            let d = decode_split(&b[..k], || 1);
            let want = if k == 0 { None } else { Some(WireError::Truncated) };
            assert_eq!(d.error, want, "{f:?} cut at {k}");
            assert!(d.frames.len() <= 1);
        }
    }
}

#[test]
fn every_single_byte_corruption_is_refused_or_parses_canonically() {
    let mut accepted = 0usize;
    let mut refused = 0usize;
    for f in all_frames() {
        let clean = encode(&f);
        let hl = f.header_len();
        // Header bytes only: payload bytes are opaque and always accepted.
        for at in 0..hl {
            for x in 1..=255u8 {
                let mut b = clean.clone();
                b[at] ^= x;
                let d = decode_split(&b, || usize::MAX);
                match parse_frame(&b) {
                    Ok((g, _)) => {
                        accepted += 1;
                        // Whatever parses re-emits to exactly the bytes it came from.
                        let mut again = vec![0u8; g.header_len()];
                        g.emit(&mut again).unwrap();
                        assert_eq!(again, b[..g.header_len()], "{f:?} byte {at} ^ {x:#x}");
                        assert_ne!(g, f);
                        if g.buffer_len() <= b.len() {
                            assert_eq!(d.frames.first().map(|x| x.0), Some(g));
                        }
                    }
                    Err(e) => {
                        refused += 1;
                        if e != WireError::Truncated {
                            assert_eq!(d.error, Some(e), "{f:?} byte {at} ^ {x:#x}");
                            assert!(d.frames.is_empty());
                        }
                    }
                }
            }
        }
    }
    // Magic, version, type, lengths, reserved bytes and enums catch most
    // flips; the rest are legitimate other values (another QPN, PSN, key).
    assert!(refused > accepted / 2, "refused {refused}, accepted {accepted}");
}

#[test]
fn oversize_lengths_are_refused_at_the_base_header() {
    let mut b = encode(&FrameRepr::Data(sample(Opcode::SendOnly)));
    b[8..12].copy_from_slice(&u32::MAX.to_be_bytes());
    let mut dec = FrameDecoder::new();
    assert_eq!(dec.feed(&b[..BASE_HEADER_LEN]), Err(WireError::PayloadTooLong(u32::MAX)));
    assert_eq!(dec.want(), Want::Failed(WireError::PayloadTooLong(u32::MAX)));
    // Sticky: the stream stays refused.
    assert_eq!(dec.feed(&b[BASE_HEADER_LEN..]), Err(WireError::PayloadTooLong(u32::MAX)));
    b[8..12].copy_from_slice(&(MAX_FRAME_PAYLOAD + 1).to_be_bytes());
    assert_eq!(parse_frame(&b).map(|_| ()), Err(WireError::PayloadTooLong(MAX_FRAME_PAYLOAD + 1)));
    // A claimed header length beyond the type's is refused before waiting for it.
    let mut b = encode(&FrameRepr::Data(sample(Opcode::SendOnly)));
    b[6..8].copy_from_slice(&u16::MAX.to_be_bytes());
    let mut dec = FrameDecoder::new();
    assert!(matches!(dec.feed(&b[..BASE_HEADER_LEN]), Err(WireError::BadHeaderLen { got: u16::MAX, .. })));
    // And emitting an oversized payload is refused too.
    let mut d = sample(Opcode::SendMiddle);
    d.payload_len = MAX_CHUNK + 1;
    assert_eq!(FrameRepr::Data(d).emit(&mut [0u8; 128]), Err(WireError::PayloadTooLong(MAX_CHUNK + 1)));
}

#[test]
fn garbage_is_refused_with_a_precise_error() {
    let good = encode(&FrameRepr::Keepalive(KeepaliveRepr { seq: 1, reply: false }));
    let with = |at: usize, v: u8| {
        let mut b = good.clone();
        b[at] = v;
        parse_frame(&b).map(|_| ())
    };
    assert_eq!(parse_frame(b"GET / HTTP/1.1\r\n\r\n").map(|_| ()), Err(WireError::BadMagic(0x4745)));
    assert_eq!(with(2, 3), Err(WireError::UnsupportedVersion(3)));
    assert_eq!(with(2, 0), Err(WireError::UnsupportedVersion(0)));
    // A version-1 keepalive (a daemon without the migration extension):
    // refused; only Hello and Close are framed as version 1.
    assert_eq!(with(2, 1), Err(WireError::UnsupportedVersion(1)));
    assert_eq!(with(3, 0x7f), Err(WireError::UnknownFrameType(0x7f)));
    assert_eq!(with(4, 1), Err(WireError::BadFlags(1)));
    assert_eq!(with(5, 1), Err(WireError::ReservedNotZero("base.reserved")));
    assert_eq!(with(11, 1), Err(WireError::UnexpectedPayload));
    assert!(matches!(with(20, 2), Err(WireError::OutOfRange { field: "keepalive.reply", .. })));

    let data = encode(&FrameRepr::Data(sample(Opcode::SendOnly)));
    let with = |at: usize, v: u8| {
        let mut b = data.clone();
        b[at] = v;
        parse_frame(&b).map(|_| ())
    };
    assert_eq!(with(12, 0x15), Err(WireError::UnknownOpcode(0x15)));
    // An opcode whose header is longer than the frame's header length.
    assert!(matches!(with(12, Opcode::CompareSwap.raw()), Err(WireError::BadHeaderLen { .. })));
    assert_eq!(with(20, 1), Err(WireError::OutOfRange { field: "dest_qpn", value: 0x0112_3456 }));
    assert_eq!(with(28, 1), Err(WireError::OutOfRange { field: "psn", value: 0x01ff_fffe }));
    assert_eq!(with(4, 0x80), Err(WireError::BadFlags(0x80)));
    assert_eq!(with(35, 1), Err(WireError::BadOffset(1)));
}

#[test]
fn semantic_rules_hold_on_emit_and_parse() {
    let emit = |d: DataRepr| FrameRepr::Data(d).emit(&mut [0u8; MAX_HEADER_LEN]).map(|_| ());
    let mut d = sample(Opcode::WriteFirst);
    d.flags = DataFlags::SOLICITED;
    assert_eq!(emit(d), Err(WireError::BadFlags(1)));
    let mut d = sample(Opcode::ReadRequest);
    d.payload_len = 1;
    assert_eq!(emit(d), Err(WireError::UnexpectedPayload));
    let mut d = sample(Opcode::SendFirst);
    d.payload_len = 0;
    assert_eq!(emit(d), Err(WireError::EmptyChunk));
    let mut d = sample(Opcode::SendFirst);
    d.msg_offset = 8;
    assert_eq!(emit(d), Err(WireError::BadOffset(8)));
    let mut d = sample(Opcode::SendLast);
    d.msg_offset = 0;
    assert_eq!(emit(d), Err(WireError::BadOffset(0)));
    let mut d = sample(Opcode::WriteOnly);
    d.reth.as_mut().unwrap().dma_len += 1;
    assert_eq!(emit(d), Err(WireError::LengthMismatch));
    let mut d = sample(Opcode::ReadRequest);
    d.reth.as_mut().unwrap().va = u64::MAX;
    assert_eq!(emit(d), Err(WireError::RangeOverflow));
    let mut d = sample(Opcode::ReadResponseFirst);
    d.aeth = Some(Aeth { syndrome: Syndrome::Nak(NakCode::RemoteAccessError), msn: 0 });
    assert_eq!(emit(d), Err(WireError::BadSyndrome(0x62)));
    let mut d = sample(Opcode::SendOnly);
    d.imm = Some(1);
    assert_eq!(emit(d), Err(WireError::ExtMismatch));
    let mut d = sample(Opcode::UdSendOnly);
    d.flags = DataFlags::ACK_REQ;
    assert_eq!(emit(d), Err(WireError::BadFlags(2)));
    assert_eq!(
        FrameRepr::Data(sample(Opcode::FetchAdd)).emit(&mut [0u8; 40]),
        Err(WireError::BufferTooSmall)
    );
}

#[test]
fn version_and_chunk_negotiation() {
    let a = hello(Role::Initiator, 1, 1);
    let mut b = hello(Role::Acceptor, 2, 2);
    assert_eq!((a.min_version, a.max_version), (2, 4), "this code speaks versions 2 to 4");
    assert_eq!(a.negotiate_version(&b), Ok(4));
    // A daemon without the IPv6 Sock messages: version 3, which this
    // code speaks (no IPv6 kinds on that link).
    b.max_version = 3;
    assert_eq!(a.negotiate_version(&b), Ok(3), "a version-3 peer gets version 3 (no IPv6 Sock messages)");
    // A daemon without the Sock frame: version 2, which this code speaks.
    b.max_version = 2;
    assert_eq!(a.negotiate_version(&b), Ok(2), "a version-2 peer gets version 2 (no Sock frames)");
    // A daemon without the migration extension: refused, saying why.
    b.min_version = 1;
    b.max_version = 1;
    let e = a.negotiate_version(&b).unwrap_err();
    assert_eq!(e, WireError::NoCommonVersion { min: 2, max: 4, peer_min: 1, peer_max: 1 });
    assert!(e.to_string().contains("peer speaks 1..=1") && e.to_string().contains("upgraded"), "{e}");
    b.min_version = 5;
    b.max_version = 6;
    assert!(matches!(a.negotiate_version(&b), Err(WireError::NoCommonVersion { .. })));
    b.min_version = 1;
    assert_eq!(a.negotiate_version(&b), Ok(4), "the highest both speak, and this code speaks 4");
    b.max_chunk = 4096;
    assert_eq!(a.negotiate_chunk(&b), 4096);
    b.max_chunk = 4095;
    assert_eq!(FrameRepr::Hello(b).emit(&mut [0u8; MAX_HEADER_LEN]), Err(WireError::BadChunkSize(4095)));
    b.max_chunk = 4096;
    b.min_version = 7;
    assert_eq!(
        FrameRepr::Hello(b).emit(&mut [0u8; MAX_HEADER_LEN]),
        Err(WireError::BadVersionRange { min: 7, max: 6 })
    );
}

#[test]
fn psn_arithmetic_wraps_at_24_bits() {
    assert_eq!(psn_add(MAX_24, 1), 0);
    assert_eq!(psn_diff(0, MAX_24), 1);
    assert_eq!(psn_diff(MAX_24, 0), -1);
    assert_eq!(psn_diff(5, 5), 0);
    assert_eq!(chunk_count(0, 4096), 1);
    assert_eq!(chunk_count(4097, 4096), 2);
    assert_eq!(chunk_count(1 << 31, MAX_CHUNK), 1 << 15);
}

#[test]
fn auth_succeeds_with_the_shared_key_and_fails_otherwise() {
    let psk = b"0123456789abcdef-shared-secret";
    let i = hello(Role::Initiator, 1, 0x11);
    let a = hello(Role::Acceptor, 2, 0x22);
    // Each side computes its tag; the other verifies it.
    let ti = auth::local_tag(psk, &i, &a).unwrap();
    let ta = auth::local_tag(psk, &a, &i).unwrap();
    assert_ne!(ti, ta, "the role is in the MAC");
    assert_eq!(auth::verify_peer(psk, &a, &i, &ti), Ok(()));
    assert_eq!(auth::verify_peer(psk, &i, &a, &ta), Ok(()));
    assert_eq!(ti, auth::auth_tag(psk, Role::Initiator, &i, &a).unwrap());
    // Through the wire and back.
    let (FrameRepr::Auth(t), _) = parse_frame(&encode(&FrameRepr::Auth(ti))).unwrap() else { panic!() };
    assert_eq!(auth::verify_peer(psk, &a, &i, &t), Ok(()));

    // A wrong key, a reflected tag, any flipped bit, a short tag: refused.
    assert_eq!(auth::verify_peer(b"another-key-of-enough-len", &a, &i, &ti), Err(AuthError::BadTag));
    assert_eq!(auth::verify_peer(psk, &i, &a, &ti), Err(AuthError::BadTag));
    for bit in 0..TAG_LEN * 8 {
        let mut t = ti;
        t[bit / 8] ^= 1 << (bit % 8);
        assert_eq!(auth::verify_peer(psk, &a, &i, &t), Err(AuthError::BadTag));
    }
    assert_eq!(auth::verify_peer(psk, &a, &i, &ti[..31]), Err(AuthError::BadTag));
    // A tag for another connection's nonces, or another daemon id: refused.
    let mut i2 = i;
    i2.nonce[0] ^= 1;
    assert_eq!(auth::verify_peer(psk, &a, &i2, &ti), Err(AuthError::BadTag));
    let mut i3 = i;
    i3.daemon_id = 99;
    assert_eq!(auth::verify_peer(psk, &a, &i3, &ti), Err(AuthError::BadTag));
    // A peer that echoes our Hello, or claims our role, or a short key.
    let mut echo = a;
    echo.role = Role::Initiator;
    echo.nonce = a.nonce;
    let mut a_same_nonce = a;
    a_same_nonce.nonce = i.nonce;
    assert_eq!(auth::local_tag(psk, &i, &a_same_nonce), Err(AuthError::NonceReuse));
    assert_eq!(auth::local_tag(psk, &a, &echo), Err(AuthError::NonceReuse));
    let other_initiator = hello(Role::Initiator, 3, 0x33);
    assert_eq!(auth::local_tag(psk, &i, &other_initiator), Err(AuthError::RoleMismatch));
    assert_eq!(auth::local_tag(b"short", &i, &a), Err(AuthError::KeyTooShort(5)));
}

/// A Moved frame names 24-bit QPs and an epoch of at least 1; anything
/// else is refused on the way out and on the way in.
#[test]
fn moved_frames_refuse_an_epoch_of_zero_and_wide_qpns() {
    let good = MovedRepr { vnet: 7, qpn: 0x11, peer_qpn: 0x12, epoch: 1 };
    for bad in [
        MovedRepr { epoch: 0, ..good },
        MovedRepr { qpn: MAX_24 + 1, ..good },
        MovedRepr { peer_qpn: 1 << 31, ..good },
    ] {
        assert!(FrameRepr::Moved(bad).emit(&mut [0u8; 64]).is_err(), "{bad:?} emitted");
        let mut b = encode(&FrameRepr::Moved(good));
        let at = if bad.epoch == 0 {
            24
        } else if bad.qpn != good.qpn {
            16
        } else {
            20
        };
        let v = if bad.epoch == 0 {
            0
        } else if bad.qpn != good.qpn {
            bad.qpn
        } else {
            bad.peer_qpn
        };
        b[at..at + 4].copy_from_slice(&v.to_be_bytes());
        assert!(parse_frame(&b).is_err(), "{bad:?} parsed");
    }
}

/// A version-1 daemon's Hello (framed as version 1, offering 1..=1) is
/// read, so that the refusal can say what the peer speaks; our own Hello
/// and Close are framed as version 1 for it to read them.
#[test]
fn a_version_one_hello_is_read_and_ours_is_readable_by_version_one() {
    let mut old = hello(Role::Initiator, 1, 1);
    old.min_version = 1;
    old.max_version = 1;
    let b = encode(&FrameRepr::Hello(old));
    assert_eq!(b[2], 1);
    assert_eq!(parse_frame(&b).unwrap().0, FrameRepr::Hello(old));
    let ours = encode(&FrameRepr::Hello(hello(Role::Acceptor, 2, 2)));
    assert_eq!(ours[2], 1, "a Hello is framed as version 1");
    let close = encode(&FrameRepr::Close(CloseRepr { reason: CloseReason::VersionMismatch, detail: 0 }));
    assert_eq!(close[2], 1, "so is a Close");
    assert!(parse_frame(&close).is_ok());
    // And a version-2 Hello base header is not a thing.
    let mut bad = ours.clone();
    bad[2] = 2;
    assert_eq!(parse_frame(&bad).map(|_| ()), Err(WireError::UnsupportedVersion(2)));
}
