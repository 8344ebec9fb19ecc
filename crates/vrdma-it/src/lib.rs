//! Harness for the integration tests: a daemon in its own process, and
//! peer processes that play the other end of a connection.
//!
//! Every process a test starts is owned by a guard that kills it by pid and
//! reaps it on drop, and every wait is bounded, so a failing test can neither
//! hang nor leave processes behind. Calls into the library, which have no
//! timeout of their own, are bounded by a watchdog that kills a daemon that
//! outlives [`daemon_lifetime`] (a hung daemon then fails those calls).
//!
//! Besides the processes, the harness has helpers for the test process's
//! own tenants ([`Side`], [`poll_n`], [`wait_until`], ...) and a raw control
//! connection ([`RawConn`]) for sending what the library never would.

pub mod control_proxy;
pub mod harness;
pub mod isolation;
mod pingpong;
pub mod protocol;
mod three_hosts;

pub use pingpong::PingPong;
pub use three_hosts::ThreeHosts;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command as OsCommand, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use protocol::{Command, Hello, Said, Wc};

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

    /// Stops the process (SIGSTOP) and waits at most `limit` until all its
    /// threads have stopped. `kill` returns before that: one thread takes
    /// the signal and stops the others only once it runs, and until then
    /// they go on (a daemon stopped this way acknowledged frames sent after
    /// `kill` returned, on a loaded machine).
    pub fn stop(&mut self, limit: Duration) -> Result<()> {
        self.kill(libc::SIGSTOP);
        let end = Instant::now() + limit;
        loop {
            // SAFETY: an all-zero siginfo_t is valid (waitid fills it in).
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: waitid(2) on our unreaped child, writing into `info`;
            // WNOWAIT leaves its state to be waited for again, so
            // `self.child` still reaps it.
            let r = unsafe {
                libc::waitid(
                    libc::P_PID,
                    self.pid() as libc::id_t,
                    &mut info,
                    libc::WSTOPPED | libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
                )
            };
            if r != 0 {
                bail!("waitid on {}: {}", self.pid(), std::io::Error::last_os_error());
            }
            // SAFETY: waitid filled `info` in for a child (or left it zero).
            let (pid, code) = unsafe { (info.si_pid(), info.si_code) };
            if pid != 0 {
                match code {
                    libc::CLD_STOPPED => return Ok(()),
                    libc::CLD_EXITED | libc::CLD_KILLED | libc::CLD_DUMPED => {
                        bail!("process {} ended instead of stopping", self.pid())
                    }
                    _ => {}
                }
            }
            if Instant::now() > end {
                bail!("process {} not stopped after {limit:?}", self.pid());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
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
    /// The network namespace it runs in (`ip netns exec`), if not ours.
    pub netns: Option<String>,
    watchdog: Watchdog,
    _dir: tempfile::TempDir,
}

/// How long a daemon may serve one test: `VRDMA_IT_DAEMON_LIFETIME_S`
/// seconds, 90 by default. Calls into the library (control requests) have
/// no timeout of their own; should the daemon hang, the watchdog kills it
/// after this long, so those calls fail instead of hanging the test.
pub fn daemon_lifetime() -> Duration {
    let secs = std::env::var("VRDMA_IT_DAEMON_LIFETIME_S").ok().and_then(|s| s.parse().ok());
    Duration::from_secs(secs.unwrap_or(90))
}

/// Kills the daemon (through a pidfd, so never another process) if the
/// test still runs after [`daemon_lifetime`].
struct Watchdog {
    pidfd: std::sync::Arc<std::sync::Mutex<Option<std::os::fd::OwnedFd>>>,
    /// Dropping it (with the daemon) stops the watchdog.
    _stop: std::sync::mpsc::Sender<()>,
}

impl Watchdog {
    fn start(pid: i32) -> Watchdog {
        let pidfd = std::sync::Arc::new(std::sync::Mutex::new(pidfd_of(pid)));
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let fd = pidfd.clone();
        let limit = daemon_lifetime();
        std::thread::spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(limit) {
                eprintln!("watchdog: the test ran over {limit:?}; killing its daemon");
                if let Some(fd) = fd.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
                    let _ = rustix::process::pidfd_send_signal(fd, rustix::process::Signal::KILL);
                }
            }
        });
        Watchdog { pidfd, _stop: stop }
    }

    /// Watches a new daemon process instead.
    fn rearm(&self, pid: i32) {
        *self.pidfd.lock().unwrap_or_else(|p| p.into_inner()) = pidfd_of(pid);
    }
}

fn pidfd_of(pid: i32) -> Option<std::os::fd::OwnedFd> {
    let pid = rustix::process::Pid::from_raw(pid)?;
    rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok()
}

impl DaemonProc {
    pub fn start() -> Result<DaemonProc> {
        Self::start_with_config("")
    }

    /// Starts a daemon with extra TOML configuration.
    pub fn start_with_config(toml: &str) -> Result<DaemonProc> {
        Self::start_in(None, toml)
    }

    /// Starts a daemon in the network namespace `netns` (by `ip netns
    /// exec`, which execs the daemon: the pid is the daemon's), else in
    /// ours. Its control socket is a file, reachable from any namespace.
    pub fn start_in(netns: Option<&str>, toml: &str) -> Result<DaemonProc> {
        let dir = tempfile::tempdir()?;
        // Tenants of other uids (see `PeerProc::spawn_as`) must reach the
        // socket, which the daemon creates 0666.
        std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
        let socket = dir.path().join("vrdma.sock");
        let config = dir.path().join("vrdma.toml");
        std::fs::write(&config, toml)?;
        let proc = spawn_daemon(&socket, &config, netns)?;
        let watchdog = Watchdog::start(proc.pid());
        Ok(DaemonProc { proc, socket, netns: netns.map(str::to_owned), watchdog, _dir: dir })
    }

    /// Kills the daemon (SIGKILL) and starts a new one on the same socket.
    pub fn restart(&mut self) -> Result<()> {
        self.proc.kill(libc::SIGKILL);
        self.proc.wait_timeout(Duration::from_secs(10))?;
        let config = self._dir.path().join("vrdma.toml");
        self.proc = spawn_daemon(&self.socket, &config, self.netns.as_deref())?;
        self.watchdog.rearm(self.proc.pid());
        Ok(())
    }

    pub fn context(&self) -> Result<vrdma::Context> {
        Ok(vrdma::Context::open_at(&self.socket)?)
    }

    /// Whether the daemon process is still running (not exited, not killed).
    pub fn is_alive(&mut self) -> bool {
        matches!(self.proc.child.try_wait(), Ok(None))
    }

    /// Descriptors the daemon process holds open now.
    pub fn open_fds(&self) -> Result<usize> {
        Ok(std::fs::read_dir(format!("/proc/{}/fd", self.proc.pid()))?.count())
    }

    /// Threads of the daemon process now.
    pub fn threads(&self) -> Result<usize> {
        Ok(std::fs::read_dir(format!("/proc/{}/task", self.proc.pid()))?.count())
    }
}

/// Set to a directory, each daemon a test starts writes its log (its
/// stderr, filtered by `VRDMA_LOG`) to a file of its own there, named
/// after its network namespace (whose name ends in the host's index: `-0`
/// is host A, `-1` B) or, outside one, after a counter, instead of into
/// the test's output, where the lines of several daemons cannot be told
/// apart. A file is appended to, never truncated.
pub const DAEMON_LOGS_ENV: &str = "VRDMA_IT_DAEMON_LOGS";

/// The file a daemon's stderr goes to under [`DAEMON_LOGS_ENV`], if set.
fn daemon_log_file(netns: Option<&str>) -> Result<Option<std::fs::File>> {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let Some(dir) = std::env::var_os(DAEMON_LOGS_ENV) else { return Ok(None) };
    let name = match netns {
        Some(ns) => format!("{ns}.log"),
        None => format!(
            "daemon-{}-{}.log",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ),
    };
    let path = Path::new(&dir).join(name);
    let f = std::fs::OpenOptions::new().create(true).append(true).open(&path);
    Ok(Some(f.with_context(|| format!("the daemon's log {}", path.display()))?))
}

fn spawn_daemon(socket: &Path, config: &Path, netns: Option<&str>) -> Result<Proc> {
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = OsCommand::new("ip");
            c.args(["netns", "exec", ns]).arg(peer_exe());
            c
        }
        None => OsCommand::new(peer_exe()),
    };
    cmd.args(["daemon", "--socket"]).arg(socket).arg("--config").arg(config).stdin(Stdio::null());
    if let Some(f) = daemon_log_file(netns)? {
        cmd.stderr(f);
    }
    let child = cmd.spawn().context("spawning the daemon")?;
    let mut proc = Proc { child };
    let end = Instant::now() + Duration::from_secs(20);
    // Listening is enough: a probe that said Hello would hold a context
    // until the daemon saw it closed, after this returned, and a test
    // with a quota of one context could find it still open.
    while RawConn::connect(socket).is_err() {
        if let Ok(Some(status)) = proc.child.try_wait() {
            bail!("the daemon exited ({status}) before it listened on {}", socket.display());
        }
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
        Self::spawn_as(socket, role, args, None)
    }

    /// Like [`spawn`](Self::spawn), running the peer as `uid` (and the
    /// same gid, with no supplementary groups) when given; needs root.
    pub fn spawn_as(socket: &Path, role: &str, args: &[&str], uid: Option<u32>) -> Result<PeerProc> {
        use std::os::unix::process::CommandExt;
        let mut cmd = OsCommand::new(peer_exe());
        if let Some(uid) = uid {
            cmd.uid(uid).gid(uid);
        }
        Self::spawn_cmd(cmd, socket, role, args)
    }

    /// An emulated guest of the VM `vm` attached: a `role` peer whose
    /// library runs in guest mode, with the VM's port socket as its port
    /// and the region memfd (inherited as descriptor 100) as its BAR.
    pub fn spawn_guest(vm: &vrdma::vm::VmAttachment, role: &str, args: &[&str]) -> Result<PeerProc> {
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;
        const BAR_FD: i32 = 100;
        let mut cmd = OsCommand::new(peer_exe());
        cmd.env(vrdma::guest::PORT_ENV, &vm.port_socket)
            .env(vrdma::guest::BAR_ENV, format!("/proc/self/fd/{BAR_FD}"));
        let region = vm.region.as_raw_fd();
        // SAFETY: dup2 is async-signal-safe; between fork and exec the
        // child only moves the region (open in the parent, so in the
        // child) to BAR_FD, without close-on-exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::dup2(region, BAR_FD) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        // The socket is not used in guest mode; the peer wants one.
        Self::spawn_cmd(cmd, Path::new("/nonexistent"), role, args)
    }

    /// An emulated guest that can move between hosts: its port is
    /// `port` (a link the test points at the port socket of the host the
    /// VM runs on, as QEMU reconnects its ports there), its BAR
    /// descriptor 100, first `regions[0]`; `regions[i]` is also inherited
    /// as descriptor `101 + i`, for [`Command::MoveBar`](protocol::Command::MoveBar).
    /// `env` goes to the guest's environment too.
    pub fn spawn_movable_guest(
        port: &Path,
        regions: &[&std::os::fd::OwnedFd],
        env: &[(&str, &str)],
        role: &str,
        args: &[&str],
    ) -> Result<PeerProc> {
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;
        const BAR_FD: i32 = 100;
        anyhow::ensure!(!regions.is_empty() && regions.len() < 16, "1 to 15 regions");
        let mut cmd = OsCommand::new(peer_exe());
        cmd.env(vrdma::guest::PORT_ENV, port).env(vrdma::guest::BAR_ENV, format!("/proc/self/fd/{BAR_FD}"));
        cmd.envs(env.iter().copied());
        let raw: Vec<i32> = regions.iter().map(|r| r.as_raw_fd()).collect();
        anyhow::ensure!(raw.iter().all(|&r| r < BAR_FD), "a region's descriptor is in the way");
        // SAFETY: dup2 is async-signal-safe; between fork and exec the
        // child only copies the regions (open in the parent, so in the
        // child, all below 100) to 100.. without close-on-exec.
        unsafe {
            cmd.pre_exec(move || {
                for (i, &fd) in raw.iter().enumerate() {
                    if libc::dup2(fd, BAR_FD + 1 + i as i32) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                if libc::dup2(raw[0], BAR_FD) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Self::spawn_cmd(cmd, Path::new("/nonexistent"), role, args)
    }

    /// A peer in the network namespace `netns` (`ip netns exec`).
    pub fn spawn_in(socket: &Path, role: &str, args: &[&str], netns: &str) -> Result<PeerProc> {
        let mut cmd = OsCommand::new("ip");
        cmd.args(["netns", "exec", netns]).arg(peer_exe());
        Self::spawn_cmd(cmd, socket, role, args)
    }

    fn spawn_cmd(mut cmd: OsCommand, socket: &Path, role: &str, args: &[&str]) -> Result<PeerProc> {
        cmd.arg(role).arg("--socket").arg(socket).args(args).stdin(Stdio::piped()).stdout(Stdio::piped());
        let mut child = cmd.spawn().context("spawning a peer")?;
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

    /// The peer's greeting: its first line.
    pub fn hello(&self) -> Result<Hello> {
        match self.recv::<Said>(PEER_TIMEOUT)? {
            Said::Hello(h) => Ok(h),
            other => bail!("peer greeted with {other:?}"),
        }
    }

    /// Sends a command and returns the peer's answer (within 20 s).
    pub fn call(&mut self, cmd: &Command) -> Result<Said> {
        self.send(cmd)?;
        self.recv(PEER_TIMEOUT)
    }

    /// [`call`](Self::call) for commands answered `Ok`.
    pub fn call_ok(&mut self, cmd: &Command) -> Result<()> {
        match self.call(cmd)? {
            Said::Ok => Ok(()),
            other => bail!("peer answered {other:?} to {cmd:?}"),
        }
    }

    /// Reads `[offset, +len)` of the peer's region.
    pub fn read(&mut self, offset: usize, len: usize) -> Result<Vec<u8>> {
        match self.call(&Command::Read { offset, len })? {
            Said::Bytes(b) => Ok(b),
            other => bail!("peer answered {other:?} to Read"),
        }
    }

    /// Polls the peer's CQ for up to `count` completions for up to `limit`.
    pub fn poll(&mut self, count: usize, limit: Duration) -> Result<Vec<Wc>> {
        match self.call(&Command::Poll { count, timeout_ms: limit.as_millis() as u64 })? {
            Said::Completions(c) => Ok(c),
            other => bail!("peer answered {other:?} to Poll"),
        }
    }
}

/// How long a peer may take to answer one command.
pub const PEER_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a test waits for something that should happen at once.
pub const WAIT: Duration = Duration::from_secs(10);

// ---- helpers for the test process's own tenants ----

/// Local write and every remote access.
pub fn access_all() -> vrdma::AccessFlags {
    vrdma::AccessFlags::LOCAL_WRITE
        | vrdma::AccessFlags::REMOTE_WRITE
        | vrdma::AccessFlags::REMOTE_READ
        | vrdma::AccessFlags::REMOTE_ATOMIC
}

/// Queue sizes: `wr` requests each way, `sge` SGEs, 64 inline bytes.
pub fn cap(wr: u32, sge: u32) -> vrdma::QpCap {
    vrdma::QpCap {
        max_send_wr: wr,
        max_recv_wr: wr,
        max_send_sge: sge,
        max_recv_sge: sge,
        max_inline_data: 64,
    }
}

/// One end of a connection in the test process: a PD, a region, one CQ
/// for both queues and an RC QP.
pub struct Side {
    pub ctx: vrdma::Context,
    pub pd: vrdma::ProtectionDomain,
    pub mr: vrdma::MemoryRegion,
    pub cq: vrdma::CompletionQueue,
    pub qp: vrdma::QueuePair,
}

impl Side {
    /// A side with a region of `mr_len` bytes, a 1024-entry CQ and a QP
    /// of 256 requests and 4 SGEs each way.
    pub fn new(ctx: &vrdma::Context, mr_len: usize) -> Result<Side> {
        Self::with(ctx, mr_len, 1024, cap(256, 4), None)
    }

    pub fn with(
        ctx: &vrdma::Context,
        mr_len: usize,
        cq_depth: u32,
        cap: vrdma::QpCap,
        channel: Option<&vrdma::CompletionChannel>,
    ) -> Result<Side> {
        let pd = ctx.alloc_pd()?;
        let mr = pd.alloc_mr(mr_len, access_all())?;
        let cq = ctx.create_cq(cq_depth, channel)?;
        let qp = pd.create_rc_qp(&cq, &cq, cap)?;
        Ok(Side { ctx: ctx.clone(), pd, mr, cq, qp })
    }

    /// Another QP in the same PD, on the same CQ.
    pub fn another_qp(&self, cap: vrdma::QpCap) -> Result<vrdma::QueuePair> {
        Ok(self.pd.create_rc_qp(&self.cq, &self.cq, cap)?)
    }

    pub fn endpoint(&self) -> Result<vrdma::Endpoint> {
        Ok(self.qp.endpoint(&self.ctx)?)
    }
}

/// Connects two sides' QPs to each other with every remote access.
pub fn connect(a: &Side, b: &Side) -> Result<()> {
    a.qp.connect(&b.endpoint()?, access_all())?;
    b.qp.connect(&a.endpoint()?, access_all())?;
    Ok(())
}

/// Streams signaled RDMA writes of `len` bytes from `a`'s region into
/// `b`'s, 32 in flight, adding the bytes of each completed write to
/// `bytes`, until `stop`; then waits for the writes in flight. `idle` runs
/// after a poll that found nothing. `what` names the stream in errors.
pub fn stream_writes(
    a: &Side,
    b: &Side,
    len: usize,
    stop: &std::sync::atomic::AtomicBool,
    bytes: &std::sync::atomic::AtomicU64,
    what: &str,
    idle: impl Fn(),
) -> Result<()> {
    use std::sync::atomic::Ordering;
    let sge = a.mr.sge(0, len)?;
    let mut wcs = vrdma::wc_buffer(64);
    let (mut posted, mut done) = (0u64, 0u64);
    while !stop.load(Ordering::Relaxed) {
        while posted - done < 32 {
            let write = vrdma::wr::rdma_write(posted, &[sge], b.mr.addr(), b.mr.rkey())?;
            a.qp.post_send(&[vrdma::wr::SendWrExt::signaled(write)]).map_err(|e| e.error)?;
            posted += 1;
        }
        let n = a.cq.poll(&mut wcs)?;
        if let Some(wc) = wcs[..n].iter().find(|wc| wc.status != vrdma::WcStatus::Success) {
            bail!("{what}: {wc:?}");
        }
        done += n as u64;
        bytes.fetch_add((n * len) as u64, Ordering::Relaxed);
        if n == 0 {
            idle();
        }
    }
    poll_n(&a.cq, (posted - done) as usize, WAIT)?;
    Ok(())
}

/// Polls until `n` completions arrived; fails after `limit`.
pub fn poll_n(cq: &vrdma::CompletionQueue, n: usize, limit: Duration) -> Result<Vec<vrdma::WorkCompletion>> {
    let end = Instant::now() + limit;
    let mut got = Vec::with_capacity(n);
    let mut buf = vrdma::wc_buffer(64);
    while got.len() < n {
        let want = (n - got.len()).min(buf.len());
        let k = cq.poll(&mut buf[..want])?;
        got.extend_from_slice(&buf[..k]);
        if k == 0 {
            if Instant::now() > end {
                bail!("{} of {n} completions within {limit:?}: {got:?}", got.len());
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    Ok(got)
}

/// Polls one completion, within `limit`.
pub fn poll_one(cq: &vrdma::CompletionQueue, limit: Duration) -> Result<vrdma::WorkCompletion> {
    Ok(poll_n(cq, 1, limit)?[0])
}

/// Every completion that arrives within `span` (for "nothing more comes").
pub fn poll_for(cq: &vrdma::CompletionQueue, span: Duration) -> Result<Vec<vrdma::WorkCompletion>> {
    let end = Instant::now() + span;
    let mut got = Vec::new();
    let mut buf = vrdma::wc_buffer(64);
    loop {
        let k = cq.poll(&mut buf)?;
        got.extend_from_slice(&buf[..k]);
        if Instant::now() > end {
            return Ok(got);
        }
        if k == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Copies `len` bytes of one region memfd into another (QEMU's part).
pub fn copy_region(from: &std::os::fd::OwnedFd, to: &std::os::fd::OwnedFd, len: u64) -> Result<()> {
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0u64;
    while at < len {
        let n = (len - at).min(buf.len() as u64) as usize;
        let got = rustix::io::pread(from, &mut buf[..n], at)?;
        if got == 0 {
            bail!("the source region ends at {at}");
        }
        let mut done = 0;
        while done < got {
            done += rustix::io::pwrite(to, &buf[done..got], at + done as u64)?;
        }
        at += got as u64;
    }
    Ok(())
}

/// Waits until `f` holds; fails naming `what` after `limit`.
pub fn wait_until(limit: Duration, what: &str, mut f: impl FnMut() -> bool) -> Result<()> {
    let end = Instant::now() + limit;
    while !f() {
        if Instant::now() > end {
            bail!("{what}: not within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// Waits until the QP is in `state`.
pub fn wait_state(qp: &vrdma::QueuePair, state: vrdma::QpState, limit: Duration) -> Result<()> {
    wait_until(limit, &format!("QP {:#x} reaching {state:?} (it is {:?})", qp.qpn(), qp.state()), || {
        qp.state() == state
    })
}

/// The next async event of `ctx`, within `limit`.
pub fn async_event(ctx: &vrdma::Context, limit: Duration) -> Result<vrdma::AsyncEvent> {
    ctx.get_async_event(Some(limit))?.with_context(|| format!("no async event within {limit:?}"))
}

/// Runs `f` on a thread and waits at most `limit` for it, so that a call
/// that hangs fails the test instead of blocking it (the thread is then
/// left behind).
pub fn bounded<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).map_err(|_| anyhow::anyhow!("the call did not return within {limit:?}"))
}

/// A little-endian u64 as bytes.
pub fn le(v: u64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

/// `len` bytes of a pattern that depends on `seed` and the position.
/// `len` bytes of fresh private anonymous memory (page-aligned), left
/// mapped for the rest of the process: what a program's own buffer is
/// before it registers it (the registration re-backs it).
pub fn anon_pages(len: usize) -> *mut u8 {
    // SAFETY: a fresh private anonymous mapping, checked; never unmapped,
    // so pointers into it stay valid for the process's life.
    let buf = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(buf, libc::MAP_FAILED, "mmap of {len} bytes");
    buf.cast()
}

pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

// ---- the control socket spoken by hand ----

/// A raw connection to the daemon's control socket, for sending what the
/// library never would. Every receive is bounded (`SO_RCVTIMEO`).
pub struct RawConn {
    pub sock: std::os::fd::OwnedFd,
    buf: Vec<u8>,
}

/// What came back for one message.
#[derive(Debug)]
pub enum Answer {
    Reply(vrdma_core::proto::Reply, Vec<std::os::fd::OwnedFd>),
    /// The daemon closed the connection.
    Closed,
}

impl Answer {
    /// The reply, failing if the connection closed; a host context's
    /// `Reply::Pooled` is the reply it wraps (see [`Answer::pooled`]).
    pub fn reply(self) -> Result<vrdma_core::proto::Reply> {
        match self {
            Answer::Reply(vrdma_core::proto::Reply::Pooled { reply, .. }, _) => Ok(*reply),
            Answer::Reply(r, _) => Ok(r),
            Answer::Closed => bail!("the daemon closed the connection"),
        }
    }

    /// A `Reply::Pooled`'s rings, the reply it wraps and its descriptors.
    #[allow(clippy::type_complexity)]
    pub fn pooled(
        self,
    ) -> Result<(Vec<vrdma_core::proto::PoolRing>, vrdma_core::proto::Reply, Vec<std::os::fd::OwnedFd>)> {
        match self {
            Answer::Reply(vrdma_core::proto::Reply::Pooled { rings, reply }, fds) => Ok((rings, *reply, fds)),
            Answer::Reply(r, _) => bail!("expected a pooled reply, got {r:?}"),
            Answer::Closed => bail!("the daemon closed the connection"),
        }
    }

    /// The errno of a `Reply::Error`, failing on anything else.
    pub fn errno(self) -> Result<(i32, String)> {
        match self.reply()? {
            vrdma_core::proto::Reply::Error { errno, message } => Ok((errno, message)),
            other => bail!("expected an error reply, got {other:?}"),
        }
    }
}

impl RawConn {
    pub fn connect(path: &Path) -> Result<RawConn> {
        use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
        let sock =
            rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?;
        rustix::net::connect(&sock, &SocketAddrUnix::new(path)?)?;
        rustix::net::sockopt::set_socket_timeout(&sock, rustix::net::sockopt::Timeout::Recv, Some(WAIT))?;
        Ok(RawConn { sock, buf: vec![0; vrdma_core::proto::MAX_MESSAGE + 1024] })
    }

    /// Sends raw bytes with descriptors attached.
    pub fn send_raw(&self, bytes: &[u8], fds: &[std::os::fd::BorrowedFd<'_>]) -> Result<()> {
        use std::os::fd::AsFd;
        vrdma_shm::send_msg(self.sock.as_fd(), bytes, fds)?;
        Ok(())
    }

    /// Receives one reply (bounded by the socket's receive timeout).
    pub fn recv(&mut self) -> Result<Answer> {
        use std::os::fd::AsFd;
        let r = vrdma_shm::recv_msg(self.sock.as_fd(), &mut self.buf, vrdma_core::proto::MAX_REPLY_FDS)
            .context("no reply from the daemon")?;
        if r.len == 0 && !r.truncated {
            return Ok(Answer::Closed);
        }
        if r.truncated {
            bail!("reply truncated");
        }
        let reply = vrdma_core::proto::decode_reply(&self.buf[..r.len]).context("undecodable reply")?;
        Ok(Answer::Reply(reply, r.fds))
    }

    /// Sends raw bytes and receives the answer.
    pub fn exchange(&mut self, bytes: &[u8], fds: &[std::os::fd::BorrowedFd<'_>]) -> Result<Answer> {
        self.send_raw(bytes, fds)?;
        self.recv()
    }

    /// Sends a request and receives the answer.
    pub fn call(
        &mut self,
        req: &vrdma_core::proto::Request,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<Answer> {
        self.exchange(&vrdma_core::proto::encode_request(req), fds)
    }

    /// Says Hello with the right version; returns the tenant id.
    pub fn hello(&mut self) -> Result<u32> {
        let req = vrdma_core::proto::Request::Hello { version: vrdma_core::proto::PROTOCOL_VERSION };
        match self.call(&req, &[])?.reply()? {
            vrdma_core::proto::Reply::Hello { tenant, .. } => Ok(tenant),
            other => bail!("Hello answered {other:?}"),
        }
    }
}

/// Two daemons that play two hosts, joined by the TCP transport.
///
/// Without namespaces the hosts are two loopback addresses, 127.0.0.2 and
/// 127.0.0.3 (all of 127/8 is the loopback interface on Linux), each
/// daemon listening on its own address at one shared port, so that a GID
/// (`::ffff:127.0.0.x`) names a daemon exactly as a host address does.
/// The control sockets are files, so the test process reaches both.
pub struct TwoHosts {
    pub a: DaemonProc,
    pub b: DaemonProc,
    pub port: u16,
}

/// The pre-shared key of the test cluster.
pub const TEST_PSK: &str = "vrdma integration test key 0123";

/// A TCP port free on every address now (it binds on the wildcard
/// address), and one no other socket will be handed meanwhile: it lies
/// outside the kernel's ephemeral range, from which `connect` and
/// `bind(.., 0)` take theirs, and each call of a process gets another one.
/// A port taken from that range (the old way) could be bound by another
/// test's `free_port` or be the source port of another test's outgoing
/// connection before this test's daemon bound it, which then exited with
/// "Address already in use". The look binds without `SO_REUSEADDR` (as
/// [`bindable_without_reuse`]): a port that an earlier process's
/// connection keeps in `TIME_WAIT` is not free for a program that binds
/// so (Python's `socket.bind`, C servers), though std's `TcpListener`
/// (which sets `SO_REUSEADDR`) would take it.
pub fn free_port() -> Result<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    const BASE: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let (lo, hi) = ephemeral_ports();
    // Processes running at once start at different places.
    let start = std::process::id().wrapping_mul(2_654_435_761) % SPAN;
    for _ in 0..SPAN {
        let port = (BASE + (start + NEXT.fetch_add(1, Ordering::Relaxed)) % SPAN) as u16;
        if (lo..=hi).contains(&port) {
            continue;
        }
        if bindable_without_reuse(port) {
            return Ok(port);
        }
    }
    bail!("no free TCP port in {BASE}..{}", BASE + SPAN)
}

/// Whether a TCP socket without `SO_REUSEADDR` can bind `0.0.0.0:port`
/// now: nothing is bound to the port on any address, not even a
/// connection in `TIME_WAIT`. (A CI run's Python server, started on a
/// port an earlier test binary's server had closed a moment before,
/// failed its bind with "Address already in use": `free_port` looked
/// with std's `TcpListener`, which sets `SO_REUSEADDR`.)
pub fn bindable_without_reuse(port: u16) -> bool {
    // SAFETY: socket(2), no pointers; the descriptor is ours and closed
    // below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return false;
    }
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr { s_addr: libc::INADDR_ANY },
        sin_zero: [0; 8],
    };
    // SAFETY: bind(2) with our sockaddr_in and its size; close(2) of our
    // descriptor.
    unsafe {
        let r = libc::bind(
            fd,
            (&sin as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        );
        libc::close(fd);
        r == 0
    }
}

/// The kernel's range of ephemeral ports (`ip_local_port_range`).
fn ephemeral_ports() -> (u16, u16) {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    let mut it = text.split_whitespace().filter_map(|w| w.parse::<u16>().ok());
    match (it.next(), it.next()) {
        (Some(lo), Some(hi)) => (lo, hi),
        _ => (32_768, 60_999),
    }
}

/// The configuration of a daemon that is host `ip` of a two-host setup.
pub fn host_config(ip: &str, port: u16, peers: &[String], extra: &str) -> String {
    host_config_psk(ip, port, peers, extra, TEST_PSK)
}

/// [`host_config`] with another pre-shared key.
pub fn host_config_psk(ip: &str, port: u16, peers: &[String], extra: &str, psk: &str) -> String {
    let peers: Vec<String> = peers.iter().map(|p| format!("{p:?}")).collect();
    format!(
        "address = \"{ip}\"\n{extra}\n[net]\nlisten = \"{ip}:{port}\"\nport = {port}\npsk = \"{psk}\"\npeers = [{}]\nkeepalive_ms = 200\ndead_ms = 1500\n",
        peers.join(", ")
    )
}

impl TwoHosts {
    /// Two hosts; with `peered` each dials the other at start (as LID
    /// addressing needs), else links form when a QP names a GID.
    pub fn start(peered: bool) -> Result<TwoHosts> {
        Self::start_with(peered, "")
    }

    pub fn start_with(peered: bool, extra: &str) -> Result<TwoHosts> {
        Self::start_keys(peered, extra, TEST_PSK, TEST_PSK)
    }

    /// Two hosts whose daemons hold the pre-shared keys `psk_a` and `psk_b`.
    pub fn start_keys(peered: bool, extra: &str, psk_a: &str, psk_b: &str) -> Result<TwoHosts> {
        Self::start_full(peered, extra, [psk_a, psk_b], ["", ""])
    }

    /// Two hosts whose `[net]` tables end with the lines `net_a` and
    /// `net_b` (at 127.0.0.2 and 127.0.0.3); a key they set replaces the
    /// test default (`keepalive_ms = 200`, `dead_ms = 1500`).
    pub fn start_nets(peered: bool, net_a: &str, net_b: &str) -> Result<TwoHosts> {
        Self::start_full(peered, "", [TEST_PSK, TEST_PSK], [net_a, net_b])
    }

    fn start_full(peered: bool, extra: &str, psk: [&str; 2], net: [&str; 2]) -> Result<TwoHosts> {
        let port = free_port()?;
        let (ia, ib) = ("127.0.0.2", "127.0.0.3");
        let pa = if peered { vec![format!("{ib}:{port}")] } else { vec![] };
        let pb = if peered { vec![format!("{ia}:{port}")] } else { vec![] };
        let a = DaemonProc::start_with_config(&with_net_lines(
            host_config_psk(ia, port, &pa, extra, psk[0]),
            net[0],
        ))?;
        let b = DaemonProc::start_with_config(&with_net_lines(
            host_config_psk(ib, port, &pb, extra, psk[1]),
            net[1],
        ))?;
        // Unless a test keeps them apart (different keys, `net.allow`).
        if peered && psk[0] == psk[1] && !net.iter().any(|l| l.contains("allow")) {
            wait_linked(&a, &b)?;
        }
        Ok(TwoHosts { a, b, port })
    }
}

/// Waits (at most [`WAIT`]) until two peered daemons have a link up to each
/// other: the first dial may come before the peer listens and is retried
/// only after half a second, and a QP connected meanwhile spends its
/// transport timer (about 0.5 s by default) waiting for the link.
fn wait_linked(a: &DaemonProc, b: &DaemonProc) -> Result<()> {
    let (ca, cb) = (a.context()?, b.context()?);
    let up = |c: &vrdma::Context| -> Result<bool> { Ok(c.stat()?.links.iter().any(|l| l.up)) };
    let end = Instant::now() + WAIT;
    while !(up(&ca)? && up(&cb)?) {
        if Instant::now() > end {
            bail!("the two daemons did not link within {WAIT:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// `config` (whose `[net]` table comes last) with `lines` appended to that
/// table, each replacing a line of `config` that sets the same key.
fn with_net_lines(config: String, lines: &str) -> String {
    let key = |l: &str| l.split('=').next().map(|k| k.trim().to_string());
    let set: Vec<String> = lines.lines().filter_map(key).filter(|k| !k.is_empty()).collect();
    let mut out: String = config
        .lines()
        .filter(|l| !key(l).is_some_and(|k| set.contains(&k)))
        .map(|l| format!("{l}\n"))
        .collect();
    out.push_str(lines);
    out
}

/// Where a test's two endpoints live: both on one daemon (the shared-memory
/// path), or on two daemons joined by the TCP transport: over loopback
/// addresses ([`TwoHosts`]), or in two network namespaces joined by a veth
/// pair ([`NetnsHosts`]). A test written once against [`Hosts`] runs in
/// each; see [`in_both_topologies!`](crate::in_both_topologies).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topology {
    OneHost,
    TwoHosts,
    TwoHostsNetns,
}

/// The daemons of a [`Topology`]: host `a` and host `b`, the same daemon
/// twice on one host. Two hosts are peered at start, so endpoints connect
/// by LID exactly as on one host.
pub enum Hosts {
    One(DaemonProc),
    Two(TwoHosts),
    Netns(NetnsHosts),
}

impl Hosts {
    pub fn start(t: Topology) -> Result<Hosts> {
        Self::start_with(t, "")
    }

    /// With extra TOML configuration for every daemon (top-level keys and
    /// sections other than `[net]`).
    pub fn start_with(t: Topology, extra: &str) -> Result<Hosts> {
        Ok(match t {
            Topology::OneHost => Hosts::One(DaemonProc::start_with_config(extra)?),
            Topology::TwoHosts => Hosts::Two(TwoHosts::start_with(true, extra)?),
            Topology::TwoHostsNetns => match NetnsHosts::start(extra)? {
                Some(h) => Hosts::Netns(h),
                None => bail!("network namespaces cannot be made here"),
            },
        })
    }

    pub fn topology(&self) -> Topology {
        match self {
            Hosts::One(_) => Topology::OneHost,
            Hosts::Two(_) => Topology::TwoHosts,
            Hosts::Netns(_) => Topology::TwoHostsNetns,
        }
    }

    /// Whether the endpoints are on two daemons.
    pub fn two(&self) -> bool {
        self.topology() != Topology::OneHost
    }

    /// The first host's daemon.
    pub fn a(&self) -> &DaemonProc {
        match self {
            Hosts::One(d) => d,
            Hosts::Two(h) => &h.a,
            Hosts::Netns(h) => &h.a,
        }
    }

    /// The second host's daemon (the first's on one host).
    pub fn b(&self) -> &DaemonProc {
        match self {
            Hosts::One(d) => d,
            Hosts::Two(h) => &h.b,
            Hosts::Netns(h) => &h.b,
        }
    }

    /// Whether every daemon still runs.
    pub fn alive(&mut self) -> bool {
        match self {
            Hosts::One(d) => d.is_alive(),
            Hosts::Two(h) => h.a.is_alive() && h.b.is_alive(),
            Hosts::Netns(h) => h.a.is_alive() && h.b.is_alive(),
        }
    }
}

/// Turns test bodies `fn name(t: Topology) -> anyhow::Result<()>` into
/// tests on one host and on two: `name::one_host`, `name::two_hosts` (two
/// daemons on loopback addresses) and `name::two_hosts_netns` (two daemons
/// in network namespaces joined by a veth pair; it needs root and iproute2
/// and skips without them, except under [`STRICT_ENV`]).
#[macro_export]
macro_rules! in_both_topologies {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[test]
                fn one_host() -> anyhow::Result<()> {
                    super::$name($crate::Topology::OneHost)
                }

                #[test]
                fn two_hosts() -> anyhow::Result<()> {
                    super::$name($crate::Topology::TwoHosts)
                }

                #[test]
                fn two_hosts_netns() -> anyhow::Result<()> {
                    if let Some(why) = $crate::netns_unavailable() {
                        $crate::skip(format!("network namespaces need root and iproute2 ({why})"));
                        return Ok(());
                    }
                    super::$name($crate::Topology::TwoHostsNetns)
                }
            }
        )*
    };
}

// ---- hosts in network namespaces ----

/// Runs `cmd` (a program and its arguments), waiting at most 10 s; fails
/// with its stderr if it fails.
pub fn run_cmd(cmd: &[&str]) -> Result<()> {
    let child = OsCommand::new(cmd[0])
        .args(&cmd[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawning {cmd:?}"))?;
    let mut p = Proc { child };
    let status = p.wait_timeout(Duration::from_secs(10)).with_context(|| format!("{cmd:?}"))?;
    if !status.success() {
        let mut err = String::new();
        if let Some(mut e) = p.child.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut e, &mut err);
        }
        bail!("{cmd:?}: {status}: {}", err.trim());
    }
    Ok(())
}

/// Why the namespace tests cannot run here, if they cannot: they need
/// root and `ip` (iproute2) with network namespaces.
pub fn netns_unavailable() -> Option<String> {
    // SAFETY: geteuid cannot fail.
    let why = if unsafe { libc::geteuid() } != 0 {
        Some("not root".to_string())
    } else if run_cmd(&["ip", "-V"]).is_err() {
        Some("no `ip` command (iproute2)".into())
    } else {
        None
    };
    if let Some(w) = &why {
        assert!(!strict(), "{STRICT_ENV}=1, and network namespaces cannot be used: {w}");
    }
    why
}

/// Set to 1 by `.ci/run`, which runs as root and installs every tool the
/// tests use: a test that would skip for want of one of them (or of root,
/// or of network namespaces) fails instead, so that CI cannot pass by
/// skipping. What CI cannot provide (netem, huge pages) still skips.
pub const STRICT_ENV: &str = "VRDMA_TEST_STRICT";

/// Whether [`STRICT_ENV`] is set to 1.
pub fn strict() -> bool {
    std::env::var_os(STRICT_ENV).is_some_and(|v| v == "1")
}

/// A test that cannot run here says why and passes, unless [`strict`].
pub fn skip(why: impl std::fmt::Display) {
    skip_as(strict(), why)
}

fn skip_as(strict: bool, why: impl std::fmt::Display) {
    assert!(!strict, "{STRICT_ENV}=1, and this test would skip: {why}");
    eprintln!("skipping: {why}");
}

#[cfg(test)]
mod port_tests {
    #[test]
    fn free_ports_are_distinct_and_outside_the_ephemeral_range() {
        let (lo, hi) = super::ephemeral_ports();
        let ports: Vec<u16> = (0..50).map(|_| super::free_port().unwrap()).collect();
        for p in &ports {
            assert!(!(lo..=hi).contains(p), "{p} is in the ephemeral range {lo}-{hi}");
            assert!(std::net::TcpListener::bind(("0.0.0.0", *p)).is_ok(), "{p} is taken");
        }
        let mut sorted = ports.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), ports.len(), "a port was handed out twice: {ports:?}");
    }
}

#[cfg(test)]
mod time_wait_tests {
    use std::io::Read;
    use std::net::{TcpListener, TcpStream};

    /// A port whose server closed its connection first (the connection
    /// in `TIME_WAIT` on the port): std's `TcpListener` (`SO_REUSEADDR`)
    /// binds it, a plain bind does not, and `free_port` takes that look.
    #[test]
    fn a_port_held_in_time_wait_is_not_free() {
        let port = super::free_port().unwrap();
        let l = TcpListener::bind(("127.0.0.1", port)).unwrap();
        let c = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (s, _) = l.accept().unwrap();
        // The server closes first: its end goes to TIME_WAIT.
        drop(s);
        let mut b = [0u8; 1];
        assert_eq!((&c).read(&mut b).unwrap(), 0);
        drop(c);
        drop(l);
        assert!(TcpListener::bind(("0.0.0.0", port)).is_ok(), "std's bind (SO_REUSEADDR) takes it");
        assert!(!super::bindable_without_reuse(port), "a plain bind does not");
        // A port nothing holds is bindable.
        let free = super::free_port().unwrap();
        assert!(super::bindable_without_reuse(free));
    }
}

#[cfg(test)]
mod skip_tests {
    #[test]
    fn a_test_that_would_skip_fails_when_strict() {
        assert!(std::panic::catch_unwind(|| super::skip_as(true, "no such tool")).is_err());
        super::skip_as(false, "no such tool");
    }
}

/// Two network namespaces joined by a veth pair, removed on drop (the
/// veth ends live in the namespaces and go with them; the root end is
/// deleted too, should creation have stopped half way).
pub struct Netns {
    pub ns: [String; 2],
    pub veth: [String; 2],
    pub addr: [String; 2],
}

impl Netns {
    /// New namespaces named after the pid and a counter (unique among
    /// concurrent tests and test processes), prefixed `vrdma-it` or
    /// `VRDMA_IT_NETNS_PREFIX` where set (whoever shares the machine can
    /// tell theirs), `10.77.x.1/24` and `10.77.x.2/24` on the veth ends.
    pub fn create() -> Result<Netns> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pid = std::process::id();
        let prefix = std::env::var("VRDMA_IT_NETNS_PREFIX").unwrap_or_else(|_| "vrdma-it".into());
        // Interface names have at most 15 bytes.
        let net = Netns {
            ns: [format!("{prefix}-{pid}-{n}-a"), format!("{prefix}-{pid}-{n}-b")],
            veth: [format!("vi{pid}x{n}a"), format!("vi{pid}x{n}b")],
            addr: [format!("10.77.{}.1", n % 250), format!("10.77.{}.2", n % 250)],
        };
        let [na, nb] = &net.ns;
        let [va, vb] = &net.veth;
        run_cmd(&["ip", "netns", "add", na])?;
        run_cmd(&["ip", "netns", "add", nb])?;
        run_cmd(&["ip", "link", "add", va, "type", "veth", "peer", "name", vb])?;
        for i in 0..2 {
            let (ns, veth) = (&net.ns[i], &net.veth[i]);
            run_cmd(&["ip", "link", "set", veth, "netns", ns])?;
            run_cmd(&["ip", "-n", ns, "addr", "add", &format!("{}/24", net.addr[i]), "dev", veth])?;
            run_cmd(&["ip", "-n", ns, "link", "set", veth, "up"])?;
            run_cmd(&["ip", "-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(net)
    }

    /// Sets host `i`'s veth end up or down (from inside its namespace).
    pub fn link(&self, i: usize, up: bool) -> Result<()> {
        run_cmd(&["ip", "-n", &self.ns[i], "link", "set", &self.veth[i], if up { "up" } else { "down" }])
    }

    /// Runs `f` on a thread that joined host `i`'s network namespace
    /// (setns is per thread), so that its sockets are that host's; waits
    /// at most `limit`.
    pub fn on_host<T: Send + 'static>(
        &self,
        i: usize,
        limit: Duration,
        f: impl FnOnce() -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let path = format!("/run/netns/{}", self.ns[i]);
        bounded(limit, move || -> Result<T> {
            let ns = std::fs::File::open(&path).with_context(|| path.clone())?;
            // SAFETY: setns on a namespace fd we hold, for this thread only
            // (a network namespace is a per-thread attribute).
            let rc = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::CLONE_NEWNET) };
            if rc != 0 {
                bail!("setns {path}: {}", std::io::Error::last_os_error());
            }
            f()
        })?
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = run_cmd(&["ip", "link", "del", &self.veth[0]]);
        for ns in &self.ns {
            let _ = run_cmd(&["ip", "netns", "del", ns]);
        }
    }
}

/// Two hosts in network namespaces joined by a veth pair, one daemon in
/// each, listening on its veth address and peered with the other. The
/// daemons go first on drop, then the namespaces.
pub struct NetnsHosts {
    pub a: DaemonProc,
    pub b: DaemonProc,
    pub port: u16,
    pub net: Netns,
}

impl NetnsHosts {
    /// The hosts, or `None` with a printed notice where namespaces cannot
    /// be made (see [`netns_unavailable`]).
    pub fn start(extra: &str) -> Result<Option<NetnsHosts>> {
        if let Some(why) = netns_unavailable() {
            skip(format!("network namespaces need root and iproute2 ({why})"));
            return Ok(None);
        }
        let net = match Netns::create() {
            Ok(n) => n,
            Err(e) => {
                skip(format!("network namespaces cannot be made here: {e:#}"));
                return Ok(None);
            }
        };
        let port = DEFAULT_WIRE_PORT;
        let cfg = |i: usize| {
            let peer = format!("{}:{port}", net.addr[1 - i]);
            host_config(&net.addr[i], port, &[peer], extra)
        };
        let a = DaemonProc::start_in(Some(&net.ns[0]), &cfg(0))?;
        let b = DaemonProc::start_in(Some(&net.ns[1]), &cfg(1))?;
        wait_linked(&a, &b)?;
        Ok(Some(NetnsHosts { a, b, port, net }))
    }

    /// Whether `tc` can add a netem qdisc here (the kernel module may be
    /// missing); tries on host `i`'s veth and removes it again.
    pub fn has_netem(&self, i: usize) -> bool {
        let (ns, dev) = (&self.net.ns[i], &self.net.veth[i]);
        let ok =
            run_cmd(&["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "netem", "delay", "1ms"]).is_ok();
        if ok {
            let _ = run_cmd(&["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"]);
        }
        ok
    }
}

/// `n` hosts as network namespaces on one bridge (in a namespace of its
/// own, the switch), removed on drop: for tests of more than two hosts
/// (a veth pair joins two). Host `i` has `10.78.x.(i+1)/24`.
pub struct NetnsBridge {
    pub switch: String,
    pub ns: Vec<String>,
    pub addr: Vec<String>,
    /// Host `i`'s end of its veth pair, in its namespace.
    pub dev: Vec<String>,
}

impl NetnsBridge {
    /// Cuts host `i`'s cable (its veth end down) or plugs it back in
    /// (up): every link of that host to the others goes silent, as when
    /// a cable is pulled, without closing any connection.
    pub fn set_link(&self, i: usize, up: bool) -> Result<()> {
        let (ns, dev) = (self.ns.get(i).context("no such host")?, &self.dev[i]);
        run_cmd(&["ip", "-n", ns, "link", "set", dev, if up { "up" } else { "down" }])
    }

    /// The namespaces, named after the pid and a counter as [`Netns`]'s.
    pub fn create(n: usize) -> Result<NetnsBridge> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let k = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pid = std::process::id();
        let mut net = NetnsBridge {
            switch: format!("vrdma-it-{pid}-{k}-sw"),
            ns: Vec::new(),
            addr: Vec::new(),
            dev: Vec::new(),
        };
        run_cmd(&["ip", "netns", "add", &net.switch])?;
        let sw = net.switch.clone();
        run_cmd(&["ip", "-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        run_cmd(&["ip", "-n", &sw, "link", "set", "br0", "up"])?;
        for i in 0..n {
            let ns = format!("vrdma-it-{pid}-{k}-{i}");
            run_cmd(&["ip", "netns", "add", &ns])?;
            net.ns.push(ns.clone());
            let addr = format!("10.78.{}.{}", k % 250, i + 1);
            net.addr.push(addr.clone());
            // Interface names have at most 15 bytes; created in the
            // switch, so that nothing is left in ours if a step fails.
            let (host_end, sw_end) = (format!("wh{pid}x{k}{i}"), format!("ws{pid}x{k}{i}"));
            run_cmd(&["ip", "-n", &sw, "link", "add", &sw_end, "type", "veth", "peer", "name", &host_end])?;
            run_cmd(&["ip", "-n", &sw, "link", "set", &host_end, "netns", &ns])?;
            run_cmd(&["ip", "-n", &sw, "link", "set", &sw_end, "master", "br0"])?;
            run_cmd(&["ip", "-n", &sw, "link", "set", &sw_end, "up"])?;
            run_cmd(&["ip", "-n", &ns, "addr", "add", &format!("{addr}/24"), "dev", &host_end])?;
            run_cmd(&["ip", "-n", &ns, "link", "set", &host_end, "up"])?;
            run_cmd(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
            net.dev.push(host_end);
        }
        Ok(net)
    }
}

impl Drop for NetnsBridge {
    fn drop(&mut self) {
        // The veth pairs live in these namespaces and go with them.
        for ns in self.ns.iter().chain(std::iter::once(&self.switch)) {
            let _ = run_cmd(&["ip", "netns", "del", ns]);
        }
    }
}

/// The wire port of the daemons in [`NetnsHosts`]: each namespace has
/// its own port space.
pub const DEFAULT_WIRE_PORT: u16 = 4792;

/// Checks shared by the suites of two hosts (loopback addresses or
/// network namespaces).
pub mod across {
    use super::{access_all, pattern, poll_n, DaemonProc, Side, WAIT};
    use anyhow::Result;
    use vrdma::wr::{self, SendWrExt};
    use vrdma::{WcOpcode, WcStatus};

    /// A successful completion of `wr_id` with `opcode`.
    pub fn check(wc: &vrdma::WorkCompletion, wr_id: u64, opcode: WcOpcode) {
        assert_eq!((wc.wr_id, wc.status, wc.opcode), (wr_id, WcStatus::Success, opcode), "{wc:?}");
    }

    /// A side on each of two daemons, connected by LID, or by GID alone.
    pub fn pair(ha: &DaemonProc, hb: &DaemonProc, by_gid: bool) -> Result<(Side, Side)> {
        let a = Side::new(&ha.context()?, 1 << 20)?;
        let b = Side::new(&hb.context()?, 1 << 20)?;
        let (mut ea, mut eb) = (a.endpoint()?, b.endpoint()?);
        if by_gid {
            ea.lid = 0;
            eb.lid = 0;
        }
        a.qp.connect(&eb, access_all())?;
        b.qp.connect(&ea, access_all())?;
        Ok((a, b))
    }

    /// Every RC opcode between a side on `ha` and one on `hb`, checked.
    pub fn every_opcode(ha: &DaemonProc, hb: &DaemonProc, by_gid: bool) -> Result<()> {
        let (a, b) = pair(ha, hb, by_gid)?;
        let big = pattern(300_000, 5);
        a.mr.write(0, &big)?;
        // Send (several chunks), write, write with immediate.
        b.qp.post_recv(&[wr::recv(10, &[b.mr.sge(0, 300_000)?])?])?;
        b.qp.post_recv(&[wr::recv(11, &[])?])?;
        a.qp.post_send(&[wr::send(1, &[a.mr.sge(0, 300_000)?])?.signaled()])?;
        a.qp.post_send(&[
            wr::rdma_write(2, &[a.mr.sge(0, 200_000)?], b.mr.addr() + 400_000, b.mr.rkey())?.signaled()
        ])?;
        a.qp.post_send(&[wr::rdma_write(3, &[a.mr.sge(0, 1000)?], b.mr.addr() + 700_000, b.mr.rkey())?
            .with_imm(77)
            .signaled()])?;
        let wcs = poll_n(&a.cq, 3, WAIT)?;
        check(&wcs[0], 1, WcOpcode::Send);
        check(&wcs[1], 2, WcOpcode::RdmaWrite);
        check(&wcs[2], 3, WcOpcode::RdmaWrite);
        let wcs = poll_n(&b.cq, 2, WAIT)?;
        check(&wcs[0], 10, WcOpcode::Recv);
        assert_eq!((wcs[0].byte_len, wcs[0].src_qp), (300_000, a.qp.qpn()));
        check(&wcs[1], 11, WcOpcode::RecvRdmaWithImm);
        assert_eq!(wcs[1].imm_data, 77);
        let mut got = vec![0; 300_000];
        b.mr.read(0, &mut got)?;
        assert!(got == big, "send data differs");
        let mut got = vec![0; 200_000];
        b.mr.read(400_000, &mut got)?;
        assert!(got == big[..200_000], "write data differs");

        // Read back and atomics.
        b.mr.write(800_000, &pattern(100_000, 9))?;
        b.mr.write_u64(960_000, 40)?;
        a.qp.post_send(&[wr::rdma_read(
            4,
            &[a.mr.sge(500_000, 100_000)?],
            b.mr.addr() + 800_000,
            b.mr.rkey(),
        )?
        .signaled()])?;
        a.qp.post_send(&[wr::cmp_swap(
            5,
            a.mr.sge(900_000, 8)?,
            b.mr.addr() + 960_000,
            b.mr.rkey(),
            40,
            50,
        )
        .signaled()])?;
        a.qp.post_send(&[
            wr::fetch_add(6, a.mr.sge(900_008, 8)?, b.mr.addr() + 960_000, b.mr.rkey(), 2).signaled()
        ])?;
        let wcs = poll_n(&a.cq, 3, WAIT)?;
        check(&wcs[0], 4, WcOpcode::RdmaRead);
        check(&wcs[1], 5, WcOpcode::CompSwap);
        check(&wcs[2], 6, WcOpcode::FetchAdd);
        let mut got = vec![0; 100_000];
        a.mr.read(500_000, &mut got)?;
        assert!(got == pattern(100_000, 9), "read data differs");
        assert_eq!((a.mr.read_u64(900_000)?, a.mr.read_u64(900_008)?, b.mr.read_u64(960_000)?), (40, 50, 52));

        // The path shows: the QP goes over a link; one between two QPs of
        // the same host goes through shared memory.
        let local = Side::new(&ha.context()?, 4096)?;
        let local2 = Side::new(&ha.context()?, 4096)?;
        crate::connect(&local, &local2)?;
        let st = a.ctx.stat()?;
        assert!(st.links.iter().any(|l| l.up && l.stats.frames_out > 0), "{st:?}");
        let path = |qpn: u32| st.qps.iter().find(|q| q.qpn == qpn).map(|q| q.path);
        assert!(matches!(path(a.qp.qpn()), Some(vrdma_core::hca::Path::Link(Some(_)))), "{st:?}");
        assert_eq!(path(local.qp.qpn()), Some(vrdma_core::hca::Path::SharedMemory), "{st:?}");
        Ok(())
    }

    /// A new pair of QPs between `ha` and `hb` moves data, within `limit`:
    /// tries fresh pairs (a try ends when its write completes, in error
    /// while the link between the daemons is not back yet) until one
    /// works. Returns how many tries it took.
    pub fn new_pairs_work_again(ha: &DaemonProc, hb: &DaemonProc, limit: std::time::Duration) -> Result<u32> {
        let end = std::time::Instant::now() + limit;
        let mut tries = 0;
        loop {
            tries += 1;
            let (a, b) = pair(ha, hb, false)?;
            a.mr.write(0, b"again")?;
            a.qp.post_send(&[wr::rdma_write(9, &[a.mr.sge(0, 5)?], b.mr.addr(), b.mr.rkey())?.signaled()])?;
            let wc = super::poll_one(&a.cq, WAIT)?;
            if wc.status == WcStatus::Success {
                let mut got = [0u8; 5];
                b.mr.read(0, &mut got)?;
                assert_eq!(&got, b"again");
                return Ok(tries);
            }
            if std::time::Instant::now() > end {
                anyhow::bail!("no new pair worked within {limit:?} ({tries} tries, the last {wc:?})");
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }

    /// Posts `n` signaled 8-byte writes from `a` to `b` and expects them to
    /// end, while the peer cannot answer, in RETRY_EXC_ERR for the first
    /// and WR_FLUSH_ERR for the rest, each once, within `limit`. Returns
    /// how long that took.
    pub fn outstanding_writes_fail(
        a: &Side,
        b: &Side,
        n: u64,
        limit: std::time::Duration,
    ) -> Result<std::time::Duration> {
        let start = std::time::Instant::now();
        let wrs: Vec<_> = (0..n)
            .map(|i| Ok(wr::rdma_write(100 + i, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?.signaled()))
            .collect::<Result<_>>()?;
        a.qp.post_send(&wrs)?;
        let wcs = poll_n(&a.cq, n as usize, limit)?;
        let took = start.elapsed();
        let got: Vec<(u64, WcStatus)> = wcs.iter().map(|w| (w.wr_id, w.status)).collect();
        let want: Vec<(u64, WcStatus)> = (0..n)
            .map(|i| (100 + i, if i == 0 { WcStatus::RetryExcErr } else { WcStatus::WrFlushErr }))
            .collect();
        assert_eq!(got, want);
        super::wait_state(&a.qp, vrdma::QpState::Err, WAIT)?;
        let more = super::poll_for(&a.cq, std::time::Duration::from_millis(200))?;
        assert!(more.is_empty(), "completed twice: {more:?}");
        Ok(took)
    }
}
