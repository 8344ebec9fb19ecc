//! The streaming frame decoder: bytes in, in whatever pieces TCP delivers
//! them, frame headers and payload out.

use super::frame::check_base;
use super::{FrameRepr, Packet, WireError, BASE_HEADER_LEN, MAX_HEADER_LEN};

/// What the decoder produced from the bytes fed to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event<'a> {
    /// A whole, validated header. `repr.payload_len()` bytes of payload
    /// follow; check where they go before reading them.
    Header(FrameRepr),
    /// A piece of the current frame's payload, borrowed from the input:
    /// `offset` bytes of this frame's payload came before it, `remaining`
    /// come after it (zero on the frame's last piece).
    Payload { data: &'a [u8], offset: u32, remaining: u32 },
}

/// What the decoder needs next, so that a transport reads no further than
/// the current frame's header (and can then read the payload elsewhere).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// This many more header bytes, at most; feed them with
    /// [`FrameDecoder::feed`].
    Header(usize),
    /// This many payload bytes: feed them, or read them straight into
    /// their destination and report them with
    /// [`FrameDecoder::payload_placed`].
    Payload(u32),
    /// The decoder refused the stream; close the connection.
    Failed(WireError),
}

#[derive(Debug, Clone, Copy)]
enum State {
    Header,
    Payload { total: u32, done: u32 },
    Failed(WireError),
}

/// Sans-IO decoder of a stream of frames.
///
/// It owns one fixed buffer of [`MAX_HEADER_LEN`] bytes and nothing else:
/// no claimed length makes it allocate or wait for more than that many
/// header bytes. The base header is checked as soon as its 12 bytes are
/// in, so garbage is refused at the same byte offset of the stream however
/// the stream was split; and once it has refused, it keeps refusing with
/// the same error (there is no resynchronisation in a byte stream).
#[derive(Debug, Clone)]
pub struct FrameDecoder {
    buf: [u8; MAX_HEADER_LEN],
    have: usize,
    /// Header length once the base header is checked.
    need: usize,
    state: State,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        FrameDecoder::new()
    }
}

impl FrameDecoder {
    pub fn new() -> FrameDecoder {
        FrameDecoder { buf: [0; MAX_HEADER_LEN], have: 0, need: BASE_HEADER_LEN, state: State::Header }
    }

    pub fn want(&self) -> Want {
        match self.state {
            State::Header => Want::Header(self.need - self.have),
            State::Payload { total, done } => Want::Payload(total - done),
            State::Failed(e) => Want::Failed(e),
        }
    }

    /// At a frame boundary: where a clean end of stream may fall.
    pub fn is_idle(&self) -> bool {
        matches!(self.state, State::Header) && self.have == 0
    }

    /// Call at end of stream: an error if it fell inside a frame.
    pub fn finish(&self) -> Result<(), WireError> {
        match self.state {
            State::Failed(e) => Err(e),
            _ if self.is_idle() => Ok(()),
            _ => Err(WireError::Truncated),
        }
    }

    fn fail(&mut self, e: WireError) -> WireError {
        self.state = State::Failed(e);
        e
    }

    /// Consumes bytes from the front of `input`, up to the end of the
    /// current header or payload, and returns how many it took and the
    /// event they completed, if any. Call again with the rest. It never
    /// takes bytes beyond the current frame's header in one call, so a
    /// caller may stop after an [`Event::Header`] and read the payload
    /// some other way.
    pub fn feed<'a>(&mut self, input: &'a [u8]) -> Result<(usize, Option<Event<'a>>), WireError> {
        match self.state {
            State::Failed(e) => Err(e),
            State::Header => {
                let n = (self.need - self.have).min(input.len());
                self.buf[self.have..self.have + n].copy_from_slice(&input[..n]);
                self.have += n;
                if self.have < self.need {
                    return Ok((n, None));
                }
                if self.need == BASE_HEADER_LEN {
                    let base = check_base(&self.buf[..BASE_HEADER_LEN]).map_err(|e| self.fail(e))?;
                    if base.header_len > BASE_HEADER_LEN {
                        self.need = base.header_len;
                        // Take what of the rest of the header is already here.
                        let (m, ev) = self.feed(&input[n..])?;
                        return Ok((n + m, ev));
                    }
                }
                let repr = FrameRepr::parse(&Packet::new_unchecked(&self.buf[..self.have]))
                    .map_err(|e| self.fail(e))?;
                self.have = 0;
                self.need = BASE_HEADER_LEN;
                let total = repr.payload_len();
                if total > 0 {
                    self.state = State::Payload { total, done: 0 };
                }
                Ok((n, Some(Event::Header(repr))))
            }
            State::Payload { total, done } => {
                if input.is_empty() {
                    return Ok((0, None));
                }
                let n = ((total - done) as usize).min(input.len());
                let offset = done;
                let done = done + n as u32;
                self.state = if done == total { State::Header } else { State::Payload { total, done } };
                Ok((n, Some(Event::Payload { data: &input[..n], offset, remaining: total - done })))
            }
        }
    }

    /// Tells the decoder that `n` payload bytes of the current frame were
    /// read from the stream by the caller itself (straight into the mapped
    /// region). Returns the bytes still to come of this frame's payload.
    pub fn payload_placed(&mut self, n: usize) -> Result<u32, WireError> {
        match self.state {
            State::Failed(e) => Err(e),
            State::Payload { total, done } => {
                if n > (total - done) as usize {
                    return Err(self.fail(WireError::PayloadOverrun));
                }
                let done = done + n as u32;
                self.state = if done == total { State::Header } else { State::Payload { total, done } };
                Ok(total - done)
            }
            State::Header if n == 0 => Ok(0),
            State::Header => Err(self.fail(WireError::PayloadOverrun)),
        }
    }
}
