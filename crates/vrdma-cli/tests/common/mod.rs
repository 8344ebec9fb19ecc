//! What the CLI test files share: a child process killed by pid when
//! dropped, and a daemon process to run against. Every wait is bounded.

#![allow(dead_code)] // each test file uses a different part

use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub const VRDMA: &str = env!("CARGO_BIN_EXE_vrdma");

/// A child process, killed by pid and reaped when dropped.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.0.id()
    }

    /// Waits at most `limit` for the exit, then collects stdout and stderr.
    pub fn finish(mut self, limit: Duration) -> (ExitStatus, String, String) {
        let end = Instant::now() + limit;
        let status = loop {
            if let Some(s) = self.0.try_wait().unwrap() {
                break s;
            }
            assert!(Instant::now() < end, "vrdma did not exit within {limit:?}");
            std::thread::sleep(Duration::from_millis(10));
        };
        let mut out = String::new();
        let mut err = String::new();
        if let Some(mut o) = self.0.stdout.take() {
            o.read_to_string(&mut out).unwrap();
        }
        if let Some(mut e) = self.0.stderr.take() {
            e.read_to_string(&mut err).unwrap();
        }
        (status, out, err)
    }
}

/// `vrdma daemon` on `socket` (with a TOML config if given), once it answers.
pub fn daemon(socket: &Path, config: Option<&Path>) -> Proc {
    let mut c = Command::new(VRDMA);
    c.args(["daemon", "--socket"]).arg(socket);
    if let Some(cfg) = config {
        c.arg("--config").arg(cfg);
    }
    let p = Proc(
        c.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("spawn daemon"),
    );
    let end = Instant::now() + Duration::from_secs(20);
    while vrdma::Context::open_at(socket).is_err() {
        assert!(Instant::now() < end, "daemon did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    p
}
