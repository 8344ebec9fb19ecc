//! The control connection of `vrdma cp`: one JSON line each way to set up,
//! one each way to check. Everything read here comes from the network and
//! is checked before use.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;

use anyhow::{bail, Context as _, Result};
use serde::{Deserialize, Serialize};

/// Bumped on any incompatible change.
pub const VERSION: u32 = 1;
/// The longest line either side accepts.
const MAX_LINE: u64 = 4096;

/// Sender → receiver: what comes, and where to connect.
#[derive(Debug, Serialize, Deserialize)]
pub struct Offer {
    pub version: u32,
    pub size: u64,
    pub segment: u64,
    pub slots: u32,
    /// `vrdma::Endpoint::to_bytes`, hex.
    pub endpoint: String,
}

/// Receiver → sender: the window to write into.
#[derive(Debug, Serialize, Deserialize)]
pub struct Accept {
    pub endpoint: String,
    pub addr: u64,
    pub rkey: u32,
}

/// Sender → receiver at the end: the file's SHA-256 as read.
#[derive(Debug, Serialize, Deserialize)]
pub struct Done {
    pub sha256: String,
}

/// Receiver → sender: the SHA-256 of what it wrote, read back from disk.
#[derive(Debug, Serialize, Deserialize)]
pub struct Verdict {
    pub sha256: String,
    pub ok: bool,
}

pub struct Control {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Control {
    pub fn new(s: TcpStream) -> Result<Control> {
        s.set_read_timeout(Some(super::PEER_TIMEOUT))?;
        s.set_write_timeout(Some(super::PEER_TIMEOUT))?;
        s.set_nodelay(true)?;
        Ok(Control { reader: BufReader::new(s.try_clone()?), writer: s })
    }

    pub fn send<T: Serialize>(&mut self, v: &T) -> Result<()> {
        let mut line = serde_json::to_vec(v)?;
        line.push(b'\n');
        self.writer.write_all(&line).context("the peer's control connection")?;
        Ok(())
    }

    pub fn recv<T: for<'de> Deserialize<'de>>(&mut self, what: &str) -> Result<T> {
        let mut line = String::new();
        let n = (&mut self.reader)
            .take(MAX_LINE)
            .read_line(&mut line)
            .with_context(|| format!("waiting for the peer's {what}"))?;
        if n == 0 {
            bail!("the peer closed the control connection before its {what}");
        }
        if !line.ends_with('\n') {
            bail!("the peer's {what} is longer than {MAX_LINE} bytes");
        }
        serde_json::from_str(&line).with_context(|| format!("the peer's {what} is malformed"))
    }
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || s.len() > 256 {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

pub fn endpoint(s: &str) -> Result<vrdma::Endpoint> {
    unhex(s).and_then(|b| vrdma::Endpoint::from_bytes(&b)).context("the peer sent a malformed endpoint")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_refuses_garbage() {
        assert_eq!(unhex(&hex(&[0, 1, 0xfe])), Some(vec![0, 1, 0xfe]));
        assert_eq!(unhex("abc"), None);
        assert_eq!(unhex("zz"), None);
        assert!(endpoint("00").is_err());
    }
}
