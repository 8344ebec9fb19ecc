//! The guest transport: control frames on a byte stream.
//!
//! A QEMU guest reaches the daemon through a virtio-serial port, a byte
//! stream that carries no file descriptors. Each guest process's session
//! is one port; on it the control protocol's requests and replies travel
//! as length-prefixed frames, and what would have been descriptors become
//! *handles*: an extent of the VM's shared region (where a host tenant
//! would get a memfd) or a numbered doorbell proxy (where it would get one
//! end of a doorbell socket pair). See `docs/vms.md`.
//!
//! A frame is an 8-byte header, then `len` bytes of body:
//!
//! ```text
//! u32 len (little-endian, at most MAX_FRAME_BODY) | u8 kind | 3 zero bytes | body
//! ```
//!
//! This module encodes and decodes frames without doing I/O
//! ([`FrameDecoder`] is fed whatever bytes arrived). Everything a guest
//! sends is hostile input: oversized lengths, unknown kinds, nonzero
//! reserved bytes and malformed bodies are errors, never panics (a fuzz
//! target in `fuzz/` holds the decoder to that).

use serde::{Deserialize, Serialize};

use super::{ProtoError, Reply, Request, MAX_MESSAGE};

/// Bytes of a frame header.
pub const HEADER: usize = 8;
/// Largest frame body either side sends or accepts: a control message
/// and its handles.
pub const MAX_FRAME_BODY: usize = MAX_MESSAGE + 1024;
/// Most channels a context that moved takes back in one reply: a
/// tenant's completion channels
/// ([`crate::hca::migrate::MAX_CHANNELS_PER_TENANT`]) and rdma_cm event
/// channels (the daemon's limit, 256).
pub const MAX_MOVED_CHANNELS: usize = crate::hca::migrate::MAX_CHANNELS_PER_TENANT + 256;
/// Most handles one reply carries. A call's reply carries what a host
/// process would get as fds ([`super::MAX_FDS`]), but an adoption's
/// (`AdoptContext`, answered as `Hello`) carries the context's segment,
/// doorbell and event signal and then a doorbell for each channel that
/// moved with the context: a program with two rdma_cm event channels
/// (perftest's `-R`: its test connection's and its exchange's) needs five,
/// and with the fds' four its context was never taken back after a move.
/// Bounded all the same (the frame's length bounds it too).
pub const MAX_HANDLES: usize = 3 + MAX_MOVED_CHANNELS;
/// The guest transport's version, in [`Frame::Hello`].
pub const GUEST_VERSION: u32 = 1;
/// The nonce of the [`Frame::Ping`] a daemon sends first after a port's
/// [`Frame::Hello`]: what the guest reads on the port before it was
/// written for an earlier opener (QEMU keeps what the daemon writes while
/// no program has the port open, and hands it to the next), so the guest
/// drops it. Its periodic pings count from 1 and never reach it.
pub const HELLO_ACK: u64 = u64::MAX;
/// The nonce of the [`Frame::Ping`] that answers a guest's probe (a
/// [`Frame::Pong`] with nonce 0) on a port whose session is live: a guest
/// whose probes go unanswered for long knows the daemon is gone, also
/// where the port's hang-up never reaches it.
pub const PROBE_ACK: u64 = u64::MAX - 1;

/// What stands for a descriptor in a reply to a guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Handle {
    /// Bytes `[offset, offset + len)` of the VM's region (page-aligned):
    /// the guest maps its BAR there.
    Extent { offset: u64, len: u64 },
    /// A doorbell the daemon proxies as proxy `id`: the guest makes a
    /// local socket pair (`SOCK_SEQPACKET` when `hangup`, else
    /// `SOCK_DGRAM`), hands one end on and forwards [`Frame::Bell`]s
    /// between the other and the port.
    Bell { id: u32, hangup: bool },
}

/// One frame of the guest transport.
#[derive(Debug, Clone, PartialEq)]
pub enum Frame {
    /// Guest to daemon, first on a port: a new session begins (a session
    /// already on the port ends as if its process had gone).
    Hello { version: u32 },
    /// Guest to daemon: a control request.
    Call(Request),
    /// Daemon to guest: the reply to the last call, with its handles.
    Reply { reply: Reply, handles: Vec<Handle> },
    /// Either way: `count` wake-ups (datagrams) for proxy `id`.
    Bell { id: u32, count: u32 },
    /// Either way: proxy `id` is closed (the daemon's end hung up, or the
    /// guest dropped its end).
    Close { id: u32 },
    /// Daemon to guest: are you there?
    Ping { nonce: u64 },
    /// Guest to daemon: the answer to [`Frame::Ping`].
    Pong { nonce: u64 },
    /// Daemon to guest: the port's session ended, and why. Sent before the
    /// [`Frame::Close`]s of its proxies, so that the guest can tell a
    /// context that moved to another host (and may be taken back there)
    /// from a device that is gone. A port closed without it is the
    /// daemon's death or the device's removal.
    Ended { reason: EndReason },
    /// Guest to daemon: a control request numbered by the guest, per
    /// context, from 1 (kind 9, appended in protocol 7). The daemon
    /// remembers the number and reply of the last one it answered: the
    /// same number again (a call re-sent after its reply was lost in a
    /// move) is answered from memory without running, an older one is
    /// refused, a newer one runs. `docs/vms.md`, "Numbered calls".
    NumberedCall { number: u64, req: Request },
}

/// Why a port's session ended ([`Frame::Ended`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum EndReason {
    /// The VM's tenant moved to another host (the operator's `finish` on
    /// this one): the context lives on there, to be adopted
    /// (`Request::AdoptContext`) when the VM's ports reach that daemon.
    Moved = 1,
    /// A frame other than Hello came on a port with no session (a guest
    /// whose VM resumed on this host, its port reconnected to this daemon
    /// under a live context): the guest should adopt its context.
    NoSession = 2,
}

impl EndReason {
    /// The reason numbered `v`, if known.
    pub fn from_u32(v: u32) -> Option<EndReason> {
        match v {
            1 => Some(EndReason::Moved),
            2 => Some(EndReason::NoSession),
            _ => None,
        }
    }
}

const HELLO: u8 = 1;
const CALL: u8 = 2;
const REPLY: u8 = 3;
const BELL: u8 = 4;
const CLOSE: u8 = 5;
const PING: u8 = 6;
const PONG: u8 = 7;
const ENDED: u8 = 8;
const NUMBERED_CALL: u8 = 9;
/// The last kind this decoder knows (kinds are appended only).
const LAST_KIND: u8 = NUMBERED_CALL;

/// The most bytes of an encoded reply body ([`encode_reply_body`]) a daemon
/// remembers for a numbered call, and a snapshot may carry per context. A
/// reply that changes state is far smaller (a handle or two, a few
/// numbers; an error's message); a larger one (a query's) is remembered
/// as answered, without its bytes, and a query sent again runs again.
pub const MAX_REMEMBERED_REPLY: usize = 4096;

/// Why a frame could not be decoded. Any of them ends the session: the
/// stream can no longer be trusted to be in step.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {0} bytes exceeds the {MAX_FRAME_BODY}-byte limit")]
    TooLarge(u64),
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("frame header has nonzero reserved bytes")]
    Reserved,
    #[error("frame kind {kind} needs a body of {want} bytes, not {got}")]
    BadLength { kind: u8, want: usize, got: usize },
    #[error("unknown reason {0} for a session's end")]
    UnknownReason(u32),
    #[error("{0} handles in one reply; at most {MAX_HANDLES}")]
    TooManyHandles(usize),
    #[error(transparent)]
    Body(#[from] ProtoError),
}

impl FrameError {
    /// Whether the stream is out of step after it (a bad header); the
    /// others concern one frame's body, which was skipped whole.
    pub fn is_fatal(&self) -> bool {
        matches!(self, FrameError::TooLarge(_) | FrameError::UnknownKind(_) | FrameError::Reserved)
    }
}

#[derive(Serialize, Deserialize)]
struct ReplyBody {
    reply: Reply,
    handles: Vec<Handle>,
}

/// The body of a [`Frame::Reply`]: what a daemon remembers of a numbered
/// call's answer.
pub fn encode_reply_body(reply: &Reply, handles: &[Handle]) -> Vec<u8> {
    postcard::to_stdvec(&ReplyBody { reply: reply.clone(), handles: handles.to_vec() })
        .expect("protocol values always serialize")
}

/// A [`Frame::Reply`]'s body decoded (untrusted: a remembered answer that
/// came in a snapshot), at most [`MAX_HANDLES`] handles.
pub fn decode_reply_body(body: &[u8]) -> Result<(Reply, Vec<Handle>), FrameError> {
    if body.len() > MAX_FRAME_BODY {
        return Err(FrameError::TooLarge(body.len() as u64));
    }
    let r: ReplyBody =
        postcard::from_bytes(body).map_err(|e| FrameError::Body(ProtoError::Malformed(e.to_string())))?;
    if r.handles.len() > MAX_HANDLES {
        return Err(FrameError::TooManyHandles(r.handles.len()));
    }
    Ok((r.reply, r.handles))
}

fn frame(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + body.len());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&[kind, 0, 0, 0]);
    out.extend_from_slice(body);
    out
}

/// The bytes of `f` on the stream.
pub fn encode(f: &Frame) -> Vec<u8> {
    let mut b = [0u8; 12];
    match f {
        Frame::Hello { version } => frame(HELLO, &version.to_le_bytes()),
        Frame::Call(r) => frame(CALL, &super::encode_request(r)),
        Frame::Reply { reply, handles } => frame(REPLY, &encode_reply_body(reply, handles)),
        Frame::Bell { id, count } => {
            b[..4].copy_from_slice(&id.to_le_bytes());
            b[4..8].copy_from_slice(&count.to_le_bytes());
            frame(BELL, &b[..8])
        }
        Frame::Close { id } => frame(CLOSE, &id.to_le_bytes()),
        Frame::Ping { nonce } => frame(PING, &nonce.to_le_bytes()),
        Frame::Pong { nonce } => frame(PONG, &nonce.to_le_bytes()),
        Frame::Ended { reason } => frame(ENDED, &(*reason as u32).to_le_bytes()),
        Frame::NumberedCall { number, req } => {
            let mut body = number.to_le_bytes().to_vec();
            body.extend(super::encode_request(req));
            frame(NUMBERED_CALL, &body)
        }
    }
}

fn fixed<const N: usize>(kind: u8, body: &[u8]) -> Result<[u8; N], FrameError> {
    body.try_into().map_err(|_| FrameError::BadLength { kind, want: N, got: body.len() })
}

/// Decodes one frame's body of `kind`.
pub fn decode_body(kind: u8, body: &[u8]) -> Result<Frame, FrameError> {
    if body.len() > MAX_FRAME_BODY {
        return Err(FrameError::TooLarge(body.len() as u64));
    }
    Ok(match kind {
        HELLO => Frame::Hello { version: u32::from_le_bytes(fixed(kind, body)?) },
        CALL => Frame::Call(super::decode_request(body)?),
        REPLY => {
            let (reply, handles) = decode_reply_body(body)?;
            Frame::Reply { reply, handles }
        }
        BELL => {
            let b: [u8; 8] = fixed(kind, body)?;
            Frame::Bell {
                id: u32::from_le_bytes(b[..4].try_into().expect("4 bytes")),
                count: u32::from_le_bytes(b[4..].try_into().expect("4 bytes")),
            }
        }
        CLOSE => Frame::Close { id: u32::from_le_bytes(fixed(kind, body)?) },
        PING => Frame::Ping { nonce: u64::from_le_bytes(fixed(kind, body)?) },
        PONG => Frame::Pong { nonce: u64::from_le_bytes(fixed(kind, body)?) },
        ENDED => {
            let v = u32::from_le_bytes(fixed(kind, body)?);
            Frame::Ended { reason: EndReason::from_u32(v).ok_or(FrameError::UnknownReason(v))? }
        }
        NUMBERED_CALL => {
            let (n, req) =
                body.split_at_checked(8).ok_or(FrameError::BadLength { kind, want: 8, got: body.len() })?;
            Frame::NumberedCall {
                number: u64::from_le_bytes(n.try_into().expect("8 bytes")),
                req: super::decode_request(req)?,
            }
        }
        k => return Err(FrameError::UnknownKind(k)),
    })
}

/// Splits a byte stream into frames. Feed it what arrived with
/// [`push`](Self::push), take frames with [`next_frame`](Self::next_frame). A frame
/// whose body is bad is skipped and reported; a bad header
/// ([`FrameError::is_fatal`]) fails the decoder for good. It holds
/// at most one frame's bytes beyond what it was given: a header that
/// announces more than [`MAX_FRAME_BODY`] is an error at once, before its
/// body arrives.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    /// Set after an error: the stream is out of step for good.
    failed: Option<FrameError>,
}

impl FrameDecoder {
    pub fn new() -> FrameDecoder {
        FrameDecoder::default()
    }

    /// Appends bytes from the stream.
    pub fn push(&mut self, bytes: &[u8]) {
        if self.failed.is_none() {
            self.buf.extend_from_slice(bytes);
        }
    }

    /// Bytes held that no complete frame used yet.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// How many more bytes the frame under way needs at least (for a
    /// reader that wants to read no further than one frame).
    pub fn wanted(&self) -> usize {
        if self.buf.len() < HEADER {
            return HEADER - self.buf.len();
        }
        let len = u32::from_le_bytes(self.buf[..4].try_into().expect("4 bytes")) as usize;
        (HEADER + len.min(MAX_FRAME_BODY)).saturating_sub(self.buf.len()).max(1)
    }

    /// The next complete frame, `Ok(None)` if more bytes are needed.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let r = self.take();
        if let Err(e) = &r {
            if e.is_fatal() {
                self.failed = Some(e.clone());
                self.buf = Vec::new();
            }
        }
        r
    }

    fn take(&mut self) -> Result<Option<Frame>, FrameError> {
        if self.buf.len() < HEADER {
            return Ok(None);
        }
        let len = u32::from_le_bytes(self.buf[..4].try_into().expect("4 bytes"));
        let kind = self.buf[4];
        if self.buf[5..8] != [0, 0, 0] {
            return Err(FrameError::Reserved);
        }
        if len as usize > MAX_FRAME_BODY {
            return Err(FrameError::TooLarge(len.into()));
        }
        if !(HELLO..=LAST_KIND).contains(&kind) {
            return Err(FrameError::UnknownKind(kind));
        }
        let end = HEADER + len as usize;
        if self.buf.len() < end {
            return Ok(None);
        }
        let f = decode_body(kind, &self.buf[HEADER..end]);
        self.buf.drain(..end);
        f.map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<Frame> {
        vec![
            Frame::Hello { version: GUEST_VERSION },
            Frame::Call(Request::AllocPd),
            Frame::Call(Request::GuestAlloc { len: 8192 }),
            Frame::Reply {
                reply: Reply::Pd { pd: 3 },
                handles: vec![
                    Handle::Extent { offset: 4096, len: 8192 },
                    Handle::Bell { id: 7, hangup: true },
                ],
            },
            Frame::Bell { id: 9, count: 2 },
            Frame::Close { id: 9 },
            Frame::Ping { nonce: u64::MAX },
            Frame::Pong { nonce: 1 },
            Frame::Ended { reason: EndReason::Moved },
            Frame::Ended { reason: EndReason::NoSession },
            Frame::NumberedCall { number: 1, req: Request::CreateCq { cqe: 16, channel: None } },
            Frame::NumberedCall { number: u64::MAX, req: Request::QueryDevice },
        ]
    }

    /// An adoption's reply: the context's segment, doorbell and event
    /// signal, then a doorbell per channel that moved with the context.
    fn adoption(channels: usize) -> (Reply, Vec<Handle>) {
        let ring = crate::proto::RingSpec { offset: u64::MAX, capacity: u32::MAX, stride: u32::MAX };
        let reply = Reply::Hello {
            context: u32::MAX,
            tenant: u32::MAX,
            device_name: "vrdma0".into(),
            segment_len: u64::MAX,
            async_ring: ring,
            posted_ring: ring,
            channels: (0..channels)
                .map(|k| crate::proto::MovedChannel { channel: u32::MAX - k as u32, raised_before: u32::MAX })
                .collect(),
        };
        let mut handles = vec![
            Handle::Extent { offset: u64::MAX, len: u64::MAX },
            Handle::Bell { id: u32::MAX, hangup: false },
            Handle::Bell { id: u32::MAX - 1, hangup: true },
        ];
        handles.extend((0..channels).map(|k| Handle::Bell { id: u32::MAX - 2 - k as u32, hangup: false }));
        (reply, handles)
    }

    #[test]
    fn an_adoptions_reply_carries_a_handle_for_each_channel_that_moved() {
        // perftest's -R holds two rdma_cm event channels on one context:
        // five handles, refused when a reply held the fds' four (the
        // guest never took its context back after a move).
        for channels in [2, 5, MAX_MOVED_CHANNELS] {
            let (reply, handles) = adoption(channels);
            let f = Frame::Reply { reply, handles };
            let bytes = encode(&f);
            assert!(bytes.len() - HEADER <= MAX_FRAME_BODY, "{channels} channels: {} bytes", bytes.len());
            let mut d = FrameDecoder::new();
            d.push(&bytes);
            assert_eq!(d.next_frame(), Ok(Some(f)), "{channels} channels");
        }
        let (reply, handles) = adoption(MAX_MOVED_CHANNELS + 1);
        let body = encode_reply_body(&reply, &handles);
        assert_eq!(decode_body(REPLY, &body), Err(FrameError::TooManyHandles(MAX_HANDLES + 1)));
    }

    #[test]
    fn kinds_and_reasons_keep_their_numbers() {
        // Released guests decode these numbers: appended only, never moved.
        let kinds: Vec<u8> = all().iter().map(|f| encode(f)[4]).collect();
        assert_eq!(kinds, [1, 2, 2, 3, 4, 5, 6, 7, 8, 8, 9, 9]);
        assert_eq!((EndReason::Moved as u32, EndReason::NoSession as u32), (1, 2));
        assert_eq!(&encode(&Frame::Ended { reason: EndReason::Moved })[8..], &1u32.to_le_bytes());
        // An unknown reason is a bad body: skipped, the stream in step.
        let mut d = FrameDecoder::new();
        d.push(&frame(ENDED, &9u32.to_le_bytes()));
        d.push(&encode(&Frame::Pong { nonce: 5 }));
        assert_eq!(d.next_frame(), Err(FrameError::UnknownReason(9)));
        assert_eq!(d.next_frame(), Ok(Some(Frame::Pong { nonce: 5 })));
    }

    #[test]
    fn frames_round_trip_whole_and_byte_by_byte() {
        let stream: Vec<u8> = all().iter().flat_map(encode).collect();
        let mut d = FrameDecoder::new();
        d.push(&stream);
        for f in all() {
            assert_eq!(d.next_frame().unwrap(), Some(f));
        }
        assert_eq!(d.next_frame().unwrap(), None);
        let mut d = FrameDecoder::new();
        let mut got = Vec::new();
        for b in &stream {
            assert!(d.wanted() >= 1);
            d.push(std::slice::from_ref(b));
            while let Some(f) = d.next_frame().unwrap() {
                got.push(f);
            }
        }
        assert_eq!(got, all());
        assert_eq!(d.pending(), 0);
    }

    #[test]
    fn bad_headers_are_errors_at_once_and_for_good() {
        let mut d = FrameDecoder::new();
        d.push(&[0xff, 0xff, 0xff, 0xff, CALL, 0, 0, 0]);
        assert!(matches!(d.next_frame(), Err(FrameError::TooLarge(_))));
        // Out of step for good, whatever comes next.
        d.push(&encode(&Frame::Ping { nonce: 1 }));
        assert!(d.next_frame().is_err());
        let mut d = FrameDecoder::new();
        d.push(&[0, 0, 0, 0, 99, 0, 0, 0]);
        assert_eq!(d.next_frame(), Err(FrameError::UnknownKind(99)));
        let mut d = FrameDecoder::new();
        d.push(&[0, 0, 0, 0, PING, 1, 0, 0]);
        assert_eq!(d.next_frame(), Err(FrameError::Reserved));
        let mut d = FrameDecoder::new();
        d.push(&frame(PING, &[1, 2, 3]));
        assert!(matches!(d.next_frame(), Err(FrameError::BadLength { want: 8, got: 3, .. })));
        // A bad body is skipped whole: the stream stays in step.
        let mut d = FrameDecoder::new();
        d.push(&frame(CALL, &[0xff; 16]));
        d.push(&encode(&Frame::Pong { nonce: 5 }));
        assert!(matches!(d.next_frame(), Err(FrameError::Body(_))));
        assert_eq!(d.next_frame(), Ok(Some(Frame::Pong { nonce: 5 })));
        // A reply with too many handles.
        let many = vec![Handle::Bell { id: 1, hangup: false }; MAX_HANDLES + 1];
        let body = postcard::to_stdvec(&ReplyBody { reply: Reply::Done, handles: many }).unwrap();
        assert_eq!(decode_body(REPLY, &body), Err(FrameError::TooManyHandles(MAX_HANDLES + 1)));
        // A largest-possible header waits for its body, holding no more.
        let mut d = FrameDecoder::new();
        d.push(&(MAX_FRAME_BODY as u32).to_le_bytes());
        d.push(&[CALL, 0, 0, 0]);
        assert_eq!(d.next_frame(), Ok(None));
        assert_eq!(d.wanted(), MAX_FRAME_BODY);
    }

    /// Kind 9: the number (u64 LE) first, then the request as in a Call;
    /// a body too short for the number, or with a bad request after it,
    /// is a bad body (skipped, the stream in step).
    #[test]
    fn a_numbered_call_carries_its_number_before_the_request() {
        let f = Frame::NumberedCall { number: 0x0102_0304_0506_0708, req: Request::AllocPd };
        let bytes = encode(&f);
        assert_eq!(bytes[4], 9);
        assert_eq!(&bytes[8..16], &0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(&bytes[16..], &crate::proto::encode_request(&Request::AllocPd)[..]);
        let mut d = FrameDecoder::new();
        d.push(&frame(NUMBERED_CALL, &[1, 2, 3]));
        d.push(&frame(NUMBERED_CALL, &[1, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]));
        d.push(&bytes);
        assert!(matches!(d.next_frame(), Err(FrameError::BadLength { kind: 9, want: 8, got: 3 })));
        assert!(matches!(d.next_frame(), Err(FrameError::Body(_))));
        assert_eq!(d.next_frame(), Ok(Some(f)));
        // A remembered answer's bytes are a Reply frame's body.
        let handles = [Handle::Extent { offset: 8192, len: 4096 }];
        let body = encode_reply_body(&Reply::Pd { pd: 9 }, &handles);
        assert_eq!(
            &encode(&Frame::Reply { reply: Reply::Pd { pd: 9 }, handles: handles.to_vec() })[8..],
            &body[..]
        );
        assert_eq!(decode_reply_body(&body), Ok((Reply::Pd { pd: 9 }, handles.to_vec())));
        assert!(decode_reply_body(&[0xff; 8]).is_err());
    }

    #[test]
    fn random_streams_never_panic() {
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let valid: Vec<u8> = all().iter().flat_map(encode).collect();
        for _ in 0..20_000 {
            let mut d = FrameDecoder::new();
            let mut buf = valid.clone();
            let i = (next() as usize) % buf.len();
            buf[i] = next() as u8;
            d.push(&buf);
            for _ in 0..all().len() + 1 {
                if let Ok(Some(f)) = d.next_frame() {
                    let mut again = FrameDecoder::new();
                    again.push(&encode(&f));
                    assert_eq!(again.next_frame().unwrap(), Some(f));
                }
            }
        }
    }
}
