//! What the two sides of `vrdma cp` say to each other, and nothing else:
//! the offer rides the connect's private data, the window the accept's,
//! a refusal the reject's; the final check is two SENDs over the QP the
//! connection brought up. Each message is a few fixed-size fields, little
//! endian, behind a magic and a version, so that it fits the kernel CM's
//! private-data limits (connect 56 bytes, accept 196, reject 148) and a
//! stray or older peer is told apart from a broken one. Everything read
//! here comes from the network and is checked before use.

use anyhow::{bail, Result};

/// Bumped on any incompatible change (1 was JSON over a TCP connection).
pub const VERSION: u16 = 2;
const MAGIC: [u8; 4] = *b"vrcp";
/// The bytes of a control message's buffer (a SEND over the QP).
pub const CONTROL_LEN: usize = 64;
/// The longest reason a receiver gives with its refusal.
const MAX_REASON: usize = 140;

/// Sender → receiver, in the connect: what comes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offer {
    pub size: u64,
    pub segment: u64,
    pub slots: u32,
}

/// Receiver → sender, in the accept: the window to write into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accept {
    pub addr: u64,
    pub rkey: u32,
}

/// Sender → receiver at the end, a SEND: the file's SHA-256 as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Done {
    pub sha256: [u8; 32],
}

/// Receiver → sender, a SEND: the SHA-256 of what it wrote, read back
/// from disk, and whether it matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub sha256: [u8; 32],
    pub ok: bool,
}

/// A little-endian reader that fails rather than reading past the end.
struct Fields<'a>(&'a [u8]);

impl Fields<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.0.split_at_checked(N)?;
        self.0 = rest;
        head.try_into().ok()
    }
    fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_le_bytes)
    }
}

fn header(tag: u8) -> Vec<u8> {
    let mut v = MAGIC.to_vec();
    v.extend_from_slice(&VERSION.to_le_bytes());
    v.push(tag);
    v.push(0);
    v
}

/// The fields after a header with `tag`; `what` names the message in errors.
fn body<'a>(b: &'a [u8], tag: u8, what: &str) -> Result<Fields<'a>> {
    let mut f = Fields(b);
    if f.take::<4>() != Some(MAGIC) {
        bail!("the peer's {what} is not from `vrdma cp`");
    }
    let version = f.take::<2>().map(u16::from_le_bytes);
    if version != Some(VERSION) {
        bail!("the peer speaks version {version:?} of `vrdma cp`, this side {VERSION}");
    }
    if f.take::<2>().map(|t| t[0]) != Some(tag) {
        bail!("the peer sent something else where its {what} was due");
    }
    Ok(f)
}

impl Offer {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = header(b'O');
        v.extend_from_slice(&self.size.to_le_bytes());
        v.extend_from_slice(&self.segment.to_le_bytes());
        v.extend_from_slice(&self.slots.to_le_bytes());
        v
    }

    pub fn decode(b: &[u8]) -> Result<Offer> {
        let mut f = body(b, b'O', "offer")?;
        match (f.u64(), f.u64(), f.u32()) {
            (Some(size), Some(segment), Some(slots)) => Ok(Offer { size, segment, slots }),
            _ => bail!("the peer's offer is cut short ({} bytes)", b.len()),
        }
    }
}

impl Accept {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = header(b'A');
        v.extend_from_slice(&self.addr.to_le_bytes());
        v.extend_from_slice(&self.rkey.to_le_bytes());
        v
    }

    pub fn decode(b: &[u8]) -> Result<Accept> {
        let mut f = body(b, b'A', "window")?;
        match (f.u64(), f.u32()) {
            (Some(addr), Some(rkey)) => Ok(Accept { addr, rkey }),
            _ => bail!("the peer's window is cut short ({} bytes)", b.len()),
        }
    }
}

/// A refusal's private data: why, in words, cut to fit.
pub fn refusal(reason: &str) -> Vec<u8> {
    let mut v = header(b'R');
    let mut end = reason.len().min(MAX_REASON);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    v.extend_from_slice(&reason.as_bytes()[..end]);
    v
}

/// The reason in a refusal's private data, if it is one of ours.
pub fn reason(b: &[u8]) -> Option<String> {
    let f = body(b, b'R', "refusal").ok()?;
    Some(String::from_utf8_lossy(f.0).into_owned())
}

impl Done {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = header(b'D');
        v.extend_from_slice(&self.sha256);
        v
    }

    pub fn decode(b: &[u8]) -> Result<Done> {
        let mut f = body(b, b'D', "checksum")?;
        let sha256 = f.take().ok_or_else(|| anyhow::anyhow!("the peer's checksum is cut short"))?;
        Ok(Done { sha256 })
    }
}

impl Verdict {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = header(b'V');
        v.extend_from_slice(&self.sha256);
        v.push(u8::from(self.ok));
        v
    }

    pub fn decode(b: &[u8]) -> Result<Verdict> {
        let mut f = body(b, b'V', "verdict")?;
        match (f.take(), f.take::<1>()) {
            (Some(sha256), Some([ok @ (0 | 1)])) => Ok(Verdict { sha256, ok: ok == 1 }),
            _ => bail!("the peer's verdict is malformed ({} bytes)", b.len()),
        }
    }
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_within_the_cm_limits() {
        let o = Offer { size: 5 << 30, segment: 1 << 20, slots: 4 };
        assert!(o.encode().len() <= 56, "a connect carries 56 bytes");
        assert_eq!(Offer::decode(&o.encode()).unwrap(), o);
        let a = Accept { addr: 0x7f00_1234_5000, rkey: 0xdead_beef };
        assert_eq!(Accept::decode(&a.encode()).unwrap(), a);
        let d = Done { sha256: [7; 32] };
        assert!(d.encode().len() <= CONTROL_LEN);
        assert_eq!(Done::decode(&d.encode()).unwrap(), d);
        let v = Verdict { sha256: [9; 32], ok: true };
        assert!(v.encode().len() <= CONTROL_LEN);
        assert_eq!(Verdict::decode(&v.encode()).unwrap(), v);
        let long = "é".repeat(200);
        let r = refusal(&long);
        assert!(r.len() <= 148, "a reject carries 148 bytes");
        assert!(long.starts_with(&reason(&r).unwrap()));
    }

    #[test]
    fn garbage_short_and_foreign_messages_are_refused() {
        let o = Offer { size: 1, segment: 4096, slots: 1 }.encode();
        for cut in 0..o.len() {
            assert!(Offer::decode(&o[..cut]).is_err(), "{cut} bytes");
        }
        assert!(Accept::decode(&o).is_err(), "an offer is no window");
        let mut old = o.clone();
        old[4] = 1;
        assert!(Offer::decode(&old).unwrap_err().to_string().contains("version"));
        assert!(Offer::decode(b"GET / HTTP/1.1\r\n\r\n").is_err());
        let mut v = Verdict { sha256: [0; 32], ok: false }.encode();
        *v.last_mut().unwrap() = 2;
        assert!(Verdict::decode(&v).is_err());
        assert_eq!(reason(b"from someone else"), None);
    }
}
