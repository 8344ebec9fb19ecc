//! Harness for the integration tests: a daemon in its own process, and
//! peer processes that play the other end of a connection.
//!
//! Every process a test starts is owned by a guard that kills it by pid and
//! reaps it on drop, and every wait is bounded, so a failing test can neither
//! hang nor leave processes behind.

pub mod protocol;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};

/// The peer binary, built beside the test executables
/// (`target/<profile>/vrdma-it-peer`, tests in `target/<profile>/deps/`).
pub fn peer_exe() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().expect("deps dir");
    let dir = if dir.ends_with("deps") { dir.parent().expect("profile dir") } else { dir };
    dir.join("vrdma-it-peer")
}

/// A child process, killed and reaped on drop.
pub struct Proc {
    pub child: Child,
}

impl Proc {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn kill(&mut self, signal: i32) {
        // SAFETY: kill(2) on the pid of a child we have not reaped yet, so
        // the pid cannot have been reused.
        unsafe { libc::kill(self.pid(), signal) };
    }

    /// Waits at most `limit` for the process to exit.
    pub fn wait_timeout(&mut self, limit: Duration) -> Result<std::process::ExitStatus> {
        let end = Instant::now() + limit;
        loop {
            if let Some(s) = self.child.try_wait()? {
                return Ok(s);
            }
            if Instant::now() > end {
                bail!("process {} still running after {limit:?}", self.pid());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill(libc::SIGKILL);
            let _ = self.child.wait();
        }
    }
}

/// A daemon in its own process, on a private socket.
pub struct DaemonProc {
    pub proc: Proc,
    pub socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl DaemonProc {
    pub fn start() -> Result<DaemonProc> {
        Self::start_with_config("")
    }

    /// Starts a daemon with extra TOML configuration.
    pub fn start_with_config(toml: &str) -> Result<DaemonProc> {
        let dir = tempfile::tempdir()?;
        let socket = dir.path().join("vrdma.sock");
        let config = dir.path().join("vrdma.toml");
        std::fs::write(&config, toml)?;
        let proc = spawn_daemon(&socket, &config)?;
        Ok(DaemonProc { proc, socket, _dir: dir })
    }

    /// Kills the daemon (SIGKILL) and starts a new one on the same socket.
    pub fn restart(&mut self) -> Result<()> {
        self.proc.kill(libc::SIGKILL);
        self.proc.wait_timeout(Duration::from_secs(10))?;
        let config = self._dir.path().join("vrdma.toml");
        self.proc = spawn_daemon(&self.socket, &config)?;
        Ok(())
    }

    pub fn context(&self) -> Result<vrdma::Context> {
        Ok(vrdma::Context::open_at(&self.socket)?)
    }
}

fn spawn_daemon(socket: &Path, config: &Path) -> Result<Proc> {
    let child = Command::new(peer_exe())
        .args(["daemon", "--socket"])
        .arg(socket)
        .arg("--config")
        .arg(config)
        .stdin(Stdio::null())
        .spawn()
        .context("spawning the daemon")?;
    let proc = Proc { child };
    let end = Instant::now() + Duration::from_secs(20);
    while vrdma::Context::open_at(socket).is_err() {
        if Instant::now() > end {
            bail!("daemon did not answer on {} within 20 s", socket.display());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(proc)
}

/// A peer process driven by JSON lines over its stdin/stdout.
pub struct PeerProc {
    pub proc: Proc,
    stdin: ChildStdin,
    lines: std::sync::mpsc::Receiver<String>,
}

impl PeerProc {
    pub fn spawn(socket: &Path, role: &str, args: &[&str]) -> Result<PeerProc> {
        let mut child = Command::new(peer_exe())
            .arg(role)
            .arg("--socket")
            .arg(socket)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("spawning a peer")?;
        let stdin = child.stdin.take().expect("piped");
        let stdout: ChildStdout = child.stdout.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(l) = line else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Ok(PeerProc { proc: Proc { child }, stdin, lines: rx })
    }

    pub fn send<T: serde::Serialize>(&mut self, v: &T) -> Result<()> {
        writeln!(self.stdin, "{}", serde_json::to_string(v)?)?;
        self.stdin.flush()?;
        Ok(())
    }

    /// The next line the peer prints, within `limit`.
    pub fn recv<T: serde::de::DeserializeOwned>(&self, limit: Duration) -> Result<T> {
        let line = self.lines.recv_timeout(limit).context("peer said nothing in time")?;
        serde_json::from_str(&line).with_context(|| format!("peer printed {line:?}"))
    }
}
