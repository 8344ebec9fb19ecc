//! The control connection between `vrdma bench HOST` and `vrdma bench
//! --server`: one TCP connection carrying length-prefixed JSON messages.
//!
//! ```text
//! client                         server
//! Hello{version}            →
//!                           ←    Hello{version}
//! per test and size:
//! Setup{test, size, .., QPs} →                      (server makes its side, posts receives)
//!                           ←    Ready{QPs, tcp_port} | Error
//! Start                     →                      (both run; Ping/Pong keep each alive)
//! Stop                      →
//!                           ←    Done{sent, received, seconds} | Error
//! Bye                       →
//! ```
//!
//! Everything read here is untrusted: frames are bounded, decoding errors
//! are errors, and a peer that says nothing for [`SILENCE`] is gone.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::spec::{TestName, MAX_SIZE, UD_MAX_SIZE};
use super::traffic::QpInfo;

/// Bumped when a message changes.
pub const VERSION: u32 = 1;
/// The largest frame either side accepts.
pub const MAX_FRAME: usize = 1 << 20;
/// A peer silent this long (no message, not even a ping) is taken for gone.
pub const SILENCE: Duration = Duration::from_secs(10);
/// How often a side waiting on a running test pings the other.
pub const PING_EVERY: Duration = Duration::from_secs(1);
/// The most QPs in one stream, and streams in one test.
pub const MAX_QPS: u32 = 64;
pub const MAX_STREAMS: u32 = 16;
/// The most memory one test may have either side register.
pub const MAX_TEST_MEMORY: u64 = 2 << 30;

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum Msg {
    Hello { version: u32 },
    Setup(Setup),
    Ready(Ready),
    Start,
    Stop,
    Done(SideReport),
    Error { message: String },
    Ping,
    Pong,
    Bye,
}

/// One test at one size, with the client's QPs (one list per stream).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Setup {
    pub test: TestName,
    pub size: usize,
    pub qps: u32,
    pub streams: u32,
    pub events: bool,
    pub endpoints: Vec<Vec<QpInfo>>,
}

impl Setup {
    /// Checks what a server must not trust.
    pub fn check(&self) -> Result<(), String> {
        check_limits(self.test, self.size, self.qps, self.streams)?;
        let rdma = self.test.transport() != super::spec::Transport::Tcp;
        let expected = if rdma { self.streams as usize } else { 0 };
        if self.endpoints.len() != expected || self.endpoints.iter().any(|s| s.len() != self.qps as usize) {
            return Err(format!(
                "{} endpoint lists for {} streams of {} QPs",
                self.endpoints.len(),
                self.streams,
                self.qps
            ));
        }
        Ok(())
    }
}

/// The bounds on one test's size, QPs, streams and memory.
pub fn check_limits(test: TestName, size: usize, qps: u32, streams: u32) -> Result<(), String> {
    let limit = if test.transport() == super::spec::Transport::Ud { UD_MAX_SIZE } else { MAX_SIZE };
    if size == 0 || size > limit {
        return Err(format!("message size {size} out of range 1..={limit}"));
    }
    if !(1..=MAX_QPS).contains(&qps) || !(1..=MAX_STREAMS).contains(&streams) {
        return Err(format!(
            "{qps} QPs x {streams} streams: at most {MAX_QPS} QPs and {MAX_STREAMS} streams"
        ));
    }
    // What each side registers: two slots per QP (see traffic::Rdma).
    let bytes = (size as u64 + 64) * 2 * u64::from(qps) * u64::from(streams);
    if bytes > MAX_TEST_MEMORY {
        return Err(format!(
            "{streams} streams x {qps} QPs of {size}-byte messages need more than {} MiB",
            MAX_TEST_MEMORY >> 20
        ));
    }
    Ok(())
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Ready {
    /// The server's QPs, one list per stream (empty for TCP tests).
    pub endpoints: Vec<Vec<QpInfo>>,
    /// TCP tests: the port of the data listener, on the control connection's address.
    pub tcp_port: Option<u16>,
}

/// What one side counted, summed over its streams.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, Default, PartialEq)]
pub struct SideReport {
    pub sent_bytes: u64,
    pub sent_messages: u64,
    pub received_bytes: u64,
    pub received_messages: u64,
    /// The longest stream's time.
    pub seconds: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum RecvError {
    #[error("the peer said nothing in time")]
    Timeout,
    #[error("{0}")]
    Closed(String),
}

/// One end of a control connection. A reader thread turns frames into
/// messages; dropping the connection shuts the socket, which ends it.
pub struct Conn {
    writer: Arc<Mutex<TcpStream>>,
    rx: Receiver<Result<Msg, String>>,
    last_heard: Instant,
    pub peer: String,
}

impl Conn {
    pub fn new(stream: TcpStream) -> std::io::Result<Conn> {
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(SILENCE))?;
        let peer = stream.peer_addr().map_or_else(|_| "?".to_string(), |a| a.to_string());
        let mut reader = stream.try_clone()?;
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new().name("bench-control".into()).spawn(move || loop {
            let msg = read_frame(&mut reader);
            let end = msg.is_err();
            if tx.send(msg).is_err() || end {
                break;
            }
        })?;
        Ok(Conn { writer: Arc::new(Mutex::new(stream)), rx, last_heard: Instant::now(), peer })
    }

    pub fn local_ip(&self) -> std::io::Result<std::net::IpAddr> {
        let w = self.writer.lock().map_err(|_| std::io::Error::other("control socket poisoned"))?;
        Ok(w.local_addr()?.ip())
    }

    pub fn send(&self, msg: &Msg) -> anyhow::Result<()> {
        let body = serde_json::to_vec(msg)?;
        let len = u32::try_from(body.len()).ok().filter(|l| (*l as usize) <= MAX_FRAME);
        let len = len.ok_or_else(|| anyhow::anyhow!("control message of {} bytes too large", body.len()))?;
        let mut w = self.writer.lock().map_err(|_| anyhow::anyhow!("control socket poisoned"))?;
        let mut frame = len.to_be_bytes().to_vec();
        frame.extend_from_slice(&body);
        w.write_all(&frame).map_err(|e| anyhow::anyhow!("sending to {}: {e}", self.peer))
    }

    /// The next message other than a ping or pong, waiting up to `limit`;
    /// pings are answered. Fails when the connection closed, broke or
    /// carried something that is not a message.
    pub fn recv(&mut self, limit: Duration) -> Result<Msg, RecvError> {
        let end = Instant::now() + limit;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(Ok(m)) => {
                    self.last_heard = Instant::now();
                    match m {
                        Msg::Ping => {
                            self.send(&Msg::Pong).map_err(|e| RecvError::Closed(e.to_string()))?;
                        }
                        Msg::Pong => {}
                        m => return Ok(m),
                    }
                }
                Ok(Err(e)) => return Err(RecvError::Closed(e)),
                Err(RecvTimeoutError::Timeout) => return Err(RecvError::Timeout),
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(RecvError::Closed("the control connection closed".into()))
                }
            }
        }
    }

    /// How long since the peer last said anything.
    pub fn silent_for(&self) -> Duration {
        self.last_heard.elapsed()
    }

    /// Waits for one message, answering pings and giving up after
    /// `limit`, with the error that names what was expected.
    pub fn expect(&mut self, limit: Duration, what: &str) -> anyhow::Result<Msg> {
        match self.recv(limit) {
            Ok(Msg::Error { message }) => anyhow::bail!("{} reports: {message}", self.peer),
            Ok(m) => Ok(m),
            Err(RecvError::Timeout) => anyhow::bail!("no {what} from {} within {limit:?}", self.peer),
            Err(RecvError::Closed(e)) => anyhow::bail!("waiting for {what} from {}: {e}", self.peer),
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let Ok(w) = self.writer.lock() {
            let _ = w.shutdown(Shutdown::Both);
        }
    }
}

/// One frame: a big-endian u32 length, then that many bytes of JSON.
fn read_frame(r: &mut impl Read) -> Result<Msg, String> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => "the peer closed the control connection".to_string(),
        _ => format!("control connection: {e}"),
    })?;
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(format!("control frame of {len} bytes (at most {MAX_FRAME})"));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).map_err(|e| format!("control connection: {e}"))?;
    serde_json::from_slice(&body).map_err(|e| format!("bad control message: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(body: &[u8]) -> Vec<u8> {
        let mut f = (body.len() as u32).to_be_bytes().to_vec();
        f.extend_from_slice(body);
        f
    }

    #[test]
    fn frames_decode_or_fail_cleanly() {
        let ok = frame(br#"{"msg":"hello","version":1}"#);
        assert_eq!(read_frame(&mut &ok[..]), Ok(Msg::Hello { version: 1 }));
        for bad in [
            frame(b"{}"),
            frame(b"\xff\xfe"),
            frame(br#"{"msg":"setup","test":"rc_nope"}"#),
            frame(br#"{"msg":"done","sent_bytes":-1}"#),
            vec![0, 0],
            u32::MAX.to_be_bytes().to_vec(),
            frame(b"")[..3].to_vec(),
        ] {
            assert!(read_frame(&mut &bad[..]).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn setups_are_checked() {
        let s = Setup {
            test: TestName::UdBw,
            size: 8192,
            qps: 1,
            streams: 1,
            events: false,
            endpoints: vec![vec![]],
        };
        assert!(s.check().is_err());
        let tcp = Setup { test: TestName::TcpBw, size: 10, endpoints: vec![], ..s.clone() };
        assert!(tcp.check().is_ok());
        assert!(Setup { qps: 0, ..tcp.clone() }.check().is_err());
        assert!(Setup { streams: 1000, ..tcp.clone() }.check().is_err());
        assert!(Setup { endpoints: vec![vec![]], ..tcp.clone() }.check().is_err());
        let huge = Setup { size: 64 << 20, qps: 64, streams: 16, endpoints: vec![], ..tcp };
        assert!(huge.check().unwrap_err().contains("need more than"));
    }
}
