//! The daemon decodes every byte a peer daemon (or a stranger) sends over
//! TCP. No input may panic the frame decoder; the outcome may not depend on
//! how the stream was split into reads, nor on whether the payload was fed
//! through the decoder or placed by the caller; and every accepted header
//! re-emits to exactly the bytes it was parsed from. A connection
//! manager's frame and a socket registry's frame carry a message the
//! decoders check as hostile too.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vrdma_core::wire::{parse_frame, Event, FrameDecoder, FrameRepr, WireError, MAX_HEADER_LEN};

#[derive(Debug, PartialEq)]
struct Outcome {
    headers: Vec<FrameRepr>,
    payload: Vec<u8>,
    error: Option<WireError>,
}

/// Decodes `stream` in pieces whose sizes come from `splits`; when `place`
/// is set, payload is "read into the region" by the caller and reported
/// with `payload_placed` instead of being fed.
fn run(stream: &[u8], splits: &[u8], place: bool) -> Outcome {
    let mut dec = FrameDecoder::new();
    let mut out = Outcome { headers: vec![], payload: vec![], error: None };
    let mut pos = 0;
    let mut s = 0;
    while pos < stream.len() {
        let piece = splits.get(s).map_or(stream.len(), |b| *b as usize + 1);
        s += 1;
        let end = (pos + piece).min(stream.len());
        while pos < end {
            if place {
                if let vrdma_core::wire::Want::Payload(n) = dec.want() {
                    let n = (n as usize).min(end - pos);
                    out.payload.extend_from_slice(&stream[pos..pos + n]);
                    dec.payload_placed(n).expect("placing what the decoder asked for");
                    pos += n;
                    continue;
                }
            }
            match dec.feed(&stream[pos..end]) {
                Err(e) => {
                    out.error = Some(e);
                    return out;
                }
                Ok((used, ev)) => {
                    assert!(used > 0 || ev.is_some());
                    match ev {
                        Some(Event::Header(h)) => {
                            // Canonical: the header re-emits to the bytes it came from.
                            let hl = h.header_len();
                            let mut again = [0u8; MAX_HEADER_LEN];
                            assert_eq!(h.emit(&mut again), Ok(hl));
                            let start = pos + used - hl;
                            assert_eq!(&again[..hl], &stream[start..pos + used]);
                            out.headers.push(h);
                        }
                        Some(Event::Payload { data, .. }) => out.payload.extend_from_slice(data),
                        None => {}
                    }
                    pos += used;
                }
            }
        }
    }
    if let Err(e) = dec.finish() {
        out.error = Some(e);
    }
    out
}

/// Writes the magic and version at every frame boundary the stream's own
/// length fields imply, so that the fuzzer spends its time past the first
/// three bytes of each frame instead of guessing them.
fn stamp_magic(stream: &mut [u8]) {
    let mut pos = 0usize;
    while pos + 3 <= stream.len() {
        stream[pos..pos + 3].copy_from_slice(&[0x76, 0x52, 0x01]);
        let Some(b) = stream.get(pos..pos + 12) else { break };
        let header = u16::from_be_bytes([b[6], b[7]]).max(12) as usize;
        let payload = u32::from_be_bytes([b[8], b[9], b[10], b[11]]) as usize;
        pos = pos.saturating_add(header).saturating_add(payload);
    }
}

fuzz_target!(|data: &[u8]| {
    // First byte: bits 0..5 how many split sizes follow, bit 7 whether to
    // stamp the magic at frame boundaries; then the sizes; then the stream.
    let (&n, rest) = match data.split_first() {
        Some(x) => x,
        None => return,
    };
    let stamp = n & 0x80 != 0;
    let n = (n as usize % 32).min(rest.len());
    let (splits, stream) = rest.split_at(n);
    let mut owned;
    let stream = if stamp {
        owned = stream.to_vec();
        stamp_magic(&mut owned);
        &owned[..]
    } else {
        stream
    };
    let whole = run(stream, &[], false);
    assert_eq!(run(stream, splits, false), whole);
    assert_eq!(run(stream, splits, true), whole);
    // The one-shot parser agrees with the decoder on the first frame, and
    // a connection manager's message decodes (or not) without panicking
    // and re-encodes to a message that decodes to itself.
    match parse_frame(stream) {
        Ok((h, payload)) => {
            assert_eq!(whole.headers.first(), Some(&h));
            if let (FrameRepr::Cm { .. }, Ok(m)) = (h, vrdma_core::wire::cm::decode(payload)) {
                assert_eq!(vrdma_core::wire::cm::decode(&vrdma_core::wire::cm::encode(&m)), Ok(m));
            }
            // A socket registry's message likewise; and one that decodes
            // took all of the payload, so it re-encodes to those bytes.
            // A host's IPv6 address list (wire version 4) never holds more
            // than its bound, whatever count it claimed.
            if let (FrameRepr::Sock { .. }, Ok(m)) = (h, vrdma_core::wire::sock::decode(payload)) {
                if let vrdma_core::sockets::peer::SockMessage::Hosts6 { addrs } = &m {
                    assert!(addrs.as_slice().len() <= vrdma_core::sockets::peer::MAX_HOST6);
                }
                assert_eq!(vrdma_core::wire::sock::decode(&vrdma_core::wire::sock::encode(&m)), Ok(m));
            }
        }
        Err(WireError::Truncated) => {}
        Err(e) => assert_eq!(whole.error, Some(e)),
    }
});
