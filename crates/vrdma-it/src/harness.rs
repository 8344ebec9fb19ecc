//! The process harness of the tests that run real programs (Debian's
//! verbs and rdma_cm tools, perftest, qperf) against the drop-in
//! libraries: every program a test starts is killed by pid when it
//! overruns its limit or the test ends, and its output is collected for
//! the failure message.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The ping-pong tests take turns: each pair spins on the CPU, and CI
/// machines have two cores.
pub fn one_at_a_time() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::new(());
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

/// A started process whose output is collected by two reader threads.
pub struct Running {
    name: String,
    child: Child,
    out: Option<JoinHandle<String>>,
    err: Option<JoinHandle<String>>,
}

pub struct Finished {
    pub name: String,
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Finished {
    pub fn describe(&self) -> String {
        format!("{}: {}\n--- stdout\n{}--- stderr\n{}", self.name, self.status, self.stdout, self.stderr)
    }

    pub fn assert_ok(&self) -> &Self {
        assert!(self.status.success(), "{}", self.describe());
        self
    }
}

fn reader(mut r: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = r.read_to_string(&mut s);
        s
    })
}

pub fn spawn(mut cmd: Command, name: &str) -> Running {
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {name}: {e}"));
    let out = child.stdout.take().map(reader);
    let err = child.stderr.take().map(reader);
    Running { name: name.to_string(), child, out, err }
}

impl Running {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// Waits until the process exits, killing it (by pid) at the deadline.
    pub fn finish(mut self, limit: Duration) -> Finished {
        let end = Instant::now() + limit;
        let status = loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                break s;
            }
            if Instant::now() > end {
                // SAFETY: kill(2) on our child, not yet reaped, so the pid
                // cannot have been reused.
                unsafe { libc::kill(self.pid(), libc::SIGKILL) };
                let s = self.child.wait().expect("wait");
                let f = self.collect(s);
                panic!("timed out after {limit:?}, killed\n{}", f.describe());
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        self.collect(status)
    }

    fn collect(&mut self, status: ExitStatus) -> Finished {
        let join =
            |h: Option<JoinHandle<String>>| h.map(|h| h.join().unwrap_or_default()).unwrap_or_default();
        Finished {
            name: self.name.clone(),
            status,
            stdout: join(self.out.take()),
            stderr: join(self.err.take()),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SAFETY: as in `finish`: our unreaped child.
            unsafe { libc::kill(self.pid(), libc::SIGKILL) };
            let _ = self.child.wait();
        }
    }
}

/// A TCP port nobody listens on now, on any address, and that no other
/// socket is handed meanwhile ([`crate::free_port`]): the tools' servers
/// listen on the wildcard address, and the daemons of `two_hosts.rs` on
/// 127.0.0.2 and 127.0.0.3.
pub fn free_port() -> u16 {
    crate::free_port().expect("a free TCP port")
}

/// Whether some socket listens on `port`, from /proc/net/tcp{,6}: looking
/// must not connect, or the ping-pong server would take us for its client.
pub fn listening(port: u16) -> bool {
    let want = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        std::fs::read_to_string(f).unwrap_or_default().lines().skip(1).any(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            cols.len() > 3 && cols[1].ends_with(&want) && cols[3] == "0A"
        })
    })
}

/// A cdylib cargo built for this test run, beside the test executable in
/// `target/<profile>/deps/` (or one level up).
pub fn built(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let deps = exe.parent().expect("deps dir");
    let profile = if deps.ends_with("deps") { deps.parent().expect("profile dir") } else { deps };
    [deps, profile]
        .iter()
        .map(|d| d.join(name))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("{name} was not built next to {}", exe.display()))
}

/// Whether `out` holds perftest's result table: the `#bytes` header
/// followed by a row of numbers.
pub fn has_results(out: &str) -> bool {
    let mut lines = out.lines().skip_while(|l| !l.trim_start().starts_with("#bytes"));
    lines.next().is_some()
        && lines.next().is_some_and(|row| {
            let cols: Vec<&str> = row.split_whitespace().collect();
            cols.len() >= 3 && cols.iter().all(|c| c.parse::<f64>().is_ok())
        })
}
