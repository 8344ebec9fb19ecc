//! The study's child processes: started in a network namespace (the
//! spawning thread joins it first, so the child is born there) and as a
//! tenant uid, their stdout collected, their stderr in a log file, every
//! wait bounded, and killed by pid when dropped.

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};

/// The environment variable every child carries, naming the study run:
/// what is left of a run can be found by it.
pub const RUN_ENV: &str = "VRDMA_STUDY_RUN";

/// Where and as whom a child runs.
#[derive(Debug, Clone, Default)]
pub struct Where {
    /// `/run/netns/NAME`, or this process's namespace.
    pub netns: Option<PathBuf>,
    /// A tenant uid (and the same gid, no supplementary groups).
    pub uid: Option<u32>,
}

/// A running child; killed (SIGTERM, then SIGKILL) and reaped on drop.
pub struct Proc {
    pub name: String,
    child: Child,
    lines: mpsc::Receiver<String>,
    log: PathBuf,
}

/// Starts `cmd` at `at`, its stderr appended to `log`.
pub fn spawn(name: &str, cmd: Command, at: &Where, run_id: &str, log: &Path) -> Result<Proc> {
    spawn_stdin(name, cmd, at, run_id, log, Stdio::null())
}

/// [`spawn`] with its stdin a pipe kept open for as long as it runs (a
/// `vrdma misbehave` stops when its stdin closes).
pub fn spawn_piped(name: &str, cmd: Command, at: &Where, run_id: &str, log: &Path) -> Result<Proc> {
    spawn_stdin(name, cmd, at, run_id, log, Stdio::piped())
}

fn spawn_stdin(
    name: &str,
    mut cmd: Command,
    at: &Where,
    run_id: &str,
    log: &Path,
    stdin: Stdio,
) -> Result<Proc> {
    let err = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("opening {}", log.display()))?;
    cmd.env(RUN_ENV, run_id).stdin(stdin).stdout(Stdio::piped()).stderr(Stdio::from(err));
    if let Some(uid) = at.uid {
        // std also drops the supplementary groups when root sets a uid.
        cmd.uid(uid).gid(uid);
    }
    let mut child = match &at.netns {
        None => cmd.spawn(),
        Some(ns) => std::thread::scope(|s| {
            s.spawn(|| -> std::io::Result<Child> {
                let f = std::fs::File::open(ns)?;
                // SAFETY: setns on a namespace fd we hold, for this thread only
                // (a network namespace is per thread); the child forked from
                // this thread is born in it. The thread ends right after.
                let rc = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&f), libc::CLONE_NEWNET) };
                if rc != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                cmd.spawn()
            })
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("the spawning thread panicked")))
        }),
    }
    .with_context(|| format!("starting {name} ({:?})", cmd.get_program()))?;
    let out = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(l) = line else { break };
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    Ok(Proc { name: name.to_string(), child, lines: rx, log: log.to_owned() })
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The next line of stdout, within `limit`.
    pub fn line(&mut self, limit: Duration) -> Result<String> {
        match self.lines.recv_timeout(limit) {
            Ok(l) => Ok(l),
            Err(_) => {
                let status = self.child.try_wait().ok().flatten();
                bail!(
                    "{} printed nothing within {limit:?}{}; {}",
                    self.name,
                    status.map_or(String::new(), |s| format!(" and exited ({s})")),
                    self.log_tail()
                )
            }
        }
    }

    /// Whether it still runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits for the exit within `limit` (else kills it); returns its
    /// stdout if it exited 0.
    pub fn finish(mut self, limit: Duration) -> Result<String> {
        let end = Instant::now() + limit;
        let status = loop {
            if let Some(s) = self.child.try_wait()? {
                break s;
            }
            if Instant::now() > end {
                self.kill();
                bail!("{} did not finish within {limit:?}; killed; {}", self.name, self.log_tail());
            }
            if super::run::interrupted() {
                self.kill();
                bail!("interrupted");
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        // The reader thread ends at EOF, right after the exit.
        let mut out = String::new();
        let until = Instant::now() + Duration::from_secs(5);
        while let Ok(l) = self.lines.recv_timeout(until.saturating_duration_since(Instant::now())) {
            out.push_str(&l);
            out.push('\n');
        }
        if !status.success() {
            bail!("{} exited with {status}; {}", self.name, self.log_tail());
        }
        Ok(out)
    }

    /// Its exit, if it has exited.
    fn exited(&mut self) -> Result<Option<std::process::ExitStatus>> {
        Ok(self.child.try_wait()?)
    }

    /// The last lines of its stderr log.
    pub fn log_tail(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut s);
        }
        let lines: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
        let tail = lines[lines.len().saturating_sub(3)..].join(" / ");
        if tail.is_empty() {
            format!("log {}", self.log.display())
        } else {
            format!("its log ends: {tail}")
        }
    }

    fn kill(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // The pid is our unreaped child's: it cannot have been reused.
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SAFETY: kill(2) on our unreaped child's pid.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
            let end = Instant::now() + Duration::from_secs(2);
            while Instant::now() < end {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            self.kill();
        }
    }
}

/// Waits for all of `procs` within `limit`, noting when each exited (to
/// 2 ms); returns each one's stdout (if it exited 0) and exit time.
pub fn finish_all(procs: Vec<Proc>, limit: Duration) -> Vec<(Result<String>, Instant)> {
    let end = Instant::now() + limit;
    let mut at: Vec<Option<Instant>> = vec![None; procs.len()];
    let mut procs = procs;
    while at.iter().any(Option::is_none) && Instant::now() < end && !super::run::interrupted() {
        for (p, t) in procs.iter_mut().zip(at.iter_mut()) {
            if t.is_none() && !matches!(p.exited(), Ok(None)) {
                *t = Some(Instant::now());
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    procs
        .into_iter()
        .zip(at)
        .map(|(p, t)| (p.finish(Duration::from_millis(1)), t.unwrap_or_else(Instant::now)))
        .collect()
}

/// Runs `f` on a thread in the namespace `netns` (or here).
pub fn in_netns<T: Send>(netns: Option<&Path>, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    let Some(ns) = netns else { return f() };
    std::thread::scope(|s| {
        s.spawn(|| -> Result<T> {
            let file = std::fs::File::open(ns).with_context(|| ns.display().to_string())?;
            // SAFETY: as in `spawn`: setns for this thread only, which ends after `f`.
            let rc = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&file), libc::CLONE_NEWNET) };
            if rc != 0 {
                bail!("setns {}: {}", ns.display(), std::io::Error::last_os_error());
            }
            f()
        })
        .join()
        .unwrap_or_else(|_| Err(anyhow!("a thread in {} panicked", ns.display())))
    })
}

/// A TCP port free on `ip` in the namespace `netns`.
pub fn free_port(netns: Option<&Path>, ip: std::net::IpAddr) -> Result<u16> {
    in_netns(netns, || Ok(std::net::TcpListener::bind((ip, 0))?.local_addr()?.port()))
}

/// Waits until `p` listens on `port`, within `limit`.
pub fn wait_listening(p: &mut Proc, port: u16, limit: Duration) -> Result<()> {
    let end = Instant::now() + limit;
    while !crate::tool_output::listening(Some(p.pid()), port) {
        if !p.running() {
            bail!("{} exited before listening on port {port}; {}", p.name, p.log_tail());
        }
        if Instant::now() > end {
            bail!("{} did not listen on port {port} within {limit:?}", p.name);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// Runs a short command (`ip ...`), bounded to 10 s; its stderr in the error.
pub fn run_cmd(args: &[&str]) -> Result<()> {
    let mut child = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawning {args:?}"))?;
    let end = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{args:?} did not finish within 10 s");
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    if !status.success() {
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        bail!("{}: {status}: {}", args.join(" "), err.trim());
    }
    Ok(())
}
