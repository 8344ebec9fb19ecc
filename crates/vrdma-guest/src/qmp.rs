//! A QMP client (QEMU Machine Protocol, `-qmp unix:PATH,server=on,wait=off`)
//! for the harnesses that drive a guest's QEMUs: the benchmark of
//! migration and the real-guest migration tests share this one.
//!
//! QEMU is the host's own program, but what it writes is still parsed as
//! untrusted: every answer is waited for against a deadline (not only
//! each read), a line longer than [`MAX_LINE`] or that is not a JSON
//! object is an error, and the events that come between a command and
//! its answer (MIGRATION, STOP, RESUME, ...) are kept, the last
//! [`MAX_EVENTS`] of them, instead of being taken for the answer. A QEMU
//! that hangs, closes, or sends garbage gives an [`Error`], never a hang.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The longest line taken from QEMU (its answers here are a few KiB; its
/// whole schema, `query-qmp-schema`, about 200 KiB).
pub const MAX_LINE: usize = 1 << 20;
/// Events kept unread at most; older ones are dropped.
pub const MAX_EVENTS: usize = 64;
/// Lines read for one answer at most (events before it included).
const MAX_LINES: usize = 1000;
/// How long [`Qmp::connect`] retries while QEMU starts, and how long a
/// command waits for its answer unless it says otherwise.
pub const LIMIT: Duration = Duration::from_secs(30);
/// How long [`Qmp::wait_completed`] and [`Qmp::wait_migration`] poll.
pub const MIGRATION_LIMIT: Duration = Duration::from_secs(240);
/// How long [`Qmp::wait_loaded`] waits for a destination to load the VM.
pub const LOAD_LIMIT: Duration = Duration::from_secs(60);
/// Between two polls of `query-migrate` or `query-status`.
const POLL: Duration = Duration::from_millis(10);

/// Why a QMP exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The socket did not accept a connection in time.
    #[error("QMP at {}: {source}", path.display())]
    Connect {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Reading or writing the socket failed.
    #[error("QMP, {what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// QEMU closed the connection.
    #[error("QMP closed {what}")]
    Closed { what: String },
    /// No complete line came in time.
    #[error("QMP did not answer {what} within {limit:?}")]
    Timeout { what: String, limit: Duration },
    /// A line over [`MAX_LINE`] bytes.
    #[error("QMP sent a line of over {MAX_LINE} bytes {what}")]
    TooLong { what: String },
    /// A line that is not a JSON object, or not one QMP sends.
    #[error("QMP said {line:?} {what}")]
    Garbage { what: String, line: String },
    /// The first line is not QMP's greeting.
    #[error("QMP's greeting was {0:?}")]
    Greeting(String),
    /// QEMU answered a command with an error.
    #[error("QMP {command}: {class}: {desc}")]
    Refused { command: String, class: String, desc: String },
    /// More than the lines one answer may take, none of them the answer.
    #[error("no answer to QMP {0} in {MAX_LINES} lines")]
    NoAnswer(String),
    /// QEMU's migration ended otherwise than completed.
    #[error("QEMU's migration: {0}")]
    Migration(Value),
    /// A poll did not see what it waited for in time (its last answer).
    #[error("{what} not within {limit:?} (last: {last})")]
    Waited { what: String, limit: Duration, last: Value },
}

pub type Result<T> = std::result::Result<T, Error>;

/// A connection to one QEMU's QMP, in command mode.
pub struct Qmp {
    s: UnixStream,
    /// Bytes read past the last line taken.
    buf: Vec<u8>,
    /// How long a command waits for its answer.
    limit: Duration,
    events: VecDeque<Value>,
}

impl Qmp {
    /// Connects (retrying for up to [`LIMIT`] while QEMU starts), reads
    /// the greeting and enters command mode.
    pub fn connect(path: &Path) -> Result<Qmp> {
        Qmp::connect_within(path, LIMIT)
    }

    /// [`Qmp::connect`], retrying for up to `limit` (an operator's
    /// command, whose QEMU runs already, need not wait for one to start).
    pub fn connect_within(path: &Path, limit: Duration) -> Result<Qmp> {
        let end = Instant::now() + limit;
        let s = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(source) if Instant::now() > end => {
                    return Err(Error::Connect { path: path.into(), source })
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        Qmp::over(s, LIMIT)
    }

    /// QMP over a connected stream, each answer (the greeting's too)
    /// within `limit`.
    pub fn over(s: UnixStream, limit: Duration) -> Result<Qmp> {
        let mut q = Qmp { s, buf: Vec::new(), limit, events: VecDeque::new() };
        let line = q.line("for its greeting", Instant::now() + limit, limit)?;
        match serde_json::from_str::<Value>(&line) {
            Ok(v) if v.get("QMP").is_some() => {}
            _ => return Err(Error::Greeting(line)),
        }
        q.exec(r#"{"execute":"qmp_capabilities"}"#)?;
        Ok(q)
    }

    /// Sends `cmd` (a JSON object, one line), returns its answer's
    /// `return`; events that come first are kept ([`Qmp::take_events`]).
    pub fn exec(&mut self, cmd: &str) -> Result<Value> {
        self.exec_within(cmd, self.limit)
    }

    /// [`Qmp::exec`], its answer within `limit` (a `savevm` or `loadvm`
    /// writes or reads the VM's whole state).
    pub fn exec_within(&mut self, cmd: &str, limit: Duration) -> Result<Value> {
        let end = Instant::now() + limit;
        let what = format!("after {cmd}");
        self.s
            .write_all(format!("{cmd}\n").as_bytes())
            .map_err(|source| Error::Io { what: format!("sending {cmd}"), source })?;
        for _ in 0..MAX_LINES {
            let line = self.line(&what, end, limit)?;
            let v: Value = serde_json::from_str(&line)
                .ok()
                .filter(Value::is_object)
                .ok_or_else(|| Error::Garbage { what: what.clone(), line: line.clone() })?;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                let s = |k: &str| e[k].as_str().unwrap_or("?").to_string();
                return Err(Error::Refused { command: cmd.to_string(), class: s("class"), desc: s("desc") });
            }
            if v.get("event").is_none() {
                return Err(Error::Garbage { what, line });
            }
            if self.events.len() == MAX_EVENTS {
                self.events.pop_front();
            }
            self.events.push_back(v);
        }
        Err(Error::NoAnswer(cmd.to_string()))
    }

    /// The events that came since the last call (the last [`MAX_EVENTS`]).
    pub fn take_events(&mut self) -> Vec<Value> {
        self.events.drain(..).collect()
    }

    /// `query-status`'s `status` (`running`, `paused`, `inmigrate`, ...).
    pub fn status(&mut self) -> Result<String> {
        Ok(self.exec(r#"{"execute":"query-status"}"#)?["status"].as_str().unwrap_or("?").to_string())
    }

    /// Starts QEMU's migration to `uri` (`unix:PATH`, `exec:CMD`).
    pub fn migrate(&mut self, uri: &str) -> Result<()> {
        self.exec(&serde_json::json!({"execute": "migrate", "arguments": {"uri": uri}}).to_string())?;
        Ok(())
    }

    /// Polls `query-migrate` (every 10 ms, for at most [`MIGRATION_LIMIT`])
    /// until `done` says so; its last answer.
    pub fn wait_migration(&mut self, done: impl Fn(&Value) -> bool) -> Result<Value> {
        let end = Instant::now() + MIGRATION_LIMIT;
        loop {
            let m = self.exec(r#"{"execute":"query-migrate"}"#)?;
            if done(&m) {
                return Ok(m);
            }
            if Instant::now() > end {
                return Err(Error::Waited {
                    what: "QEMU's migration".into(),
                    limit: MIGRATION_LIMIT,
                    last: m,
                });
            }
            std::thread::sleep(POLL);
        }
    }

    /// Waits until QEMU's migration neither sets up nor runs; its last
    /// `query-migrate` answer (`downtime`, `ram.dirty-sync-count`, ...),
    /// an error unless it completed.
    pub fn wait_completed(&mut self) -> Result<Value> {
        let m = self.wait_migration(|m| {
            !matches!(m["status"].as_str(), Some("active" | "setup" | "device" | "pre-switchover") | None)
        })?;
        if m["status"].as_str() != Some("completed") {
            return Err(Error::Migration(m));
        }
        Ok(m)
    }

    /// Waits (at most [`LOAD_LIMIT`]) until a QEMU started with
    /// `-incoming` loaded the VM.
    pub fn wait_loaded(&mut self) -> Result<()> {
        let end = Instant::now() + LOAD_LIMIT;
        loop {
            let st = self.status()?;
            if st != "inmigrate" {
                return Ok(());
            }
            if Instant::now() > end {
                return Err(Error::Waited {
                    what: "the destination QEMU loading the VM".into(),
                    limit: LOAD_LIMIT,
                    last: Value::String(st),
                });
            }
            std::thread::sleep(POLL);
        }
    }

    /// The next line (without its end), by `end` (`limit` from the start).
    fn line(&mut self, what: &str, end: Instant, limit: Duration) -> Result<String> {
        let mut chunk = [0u8; 4096];
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                if i > MAX_LINE {
                    return Err(Error::TooLong { what: what.into() });
                }
                let rest = self.buf.split_off(i + 1);
                let line = std::mem::replace(&mut self.buf, rest);
                return Ok(String::from_utf8_lossy(&line[..i]).trim_end().to_string());
            }
            if self.buf.len() > MAX_LINE {
                return Err(Error::TooLong { what: what.into() });
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout { what: what.into(), limit });
            }
            self.s.set_read_timeout(Some(left)).map_err(|source| Error::Io { what: what.into(), source })?;
            match self.s.read(&mut chunk) {
                Ok(0) => return Err(Error::Closed { what: what.into() }),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(source) => return Err(Error::Io { what: what.into(), source }),
            }
        }
    }
}

#[cfg(test)]
mod tests;
