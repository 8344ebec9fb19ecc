//! Two "hosts" for `vrdma bench-hosts`: two network namespaces joined by a
//! veth pair, one vRDMA daemon in each, linked over the TCP transport.
//!
//! Everything this module creates is undone when [`Hosts`] drops, also on
//! an error or an interrupt: every process it started is stopped by pid
//! (its process group first, so that a server's forked children go too),
//! any straggler that carries this run's marker in its environment is
//! killed, then the namespaces (and with them the veth pair) are deleted.
//! Every wait is bounded.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};

use crate::cmd::run::LibDir;

/// The variable every process this run starts carries, so that none can
/// escape the cleanup (see [`sweep`]).
pub const MARKER_ENV: &str = "VRDMA_HOSTBENCH";

/// The daemons' transport port inside each namespace.
const WIRE_PORT: u16 = 4792;

/// Set by SIGINT, SIGTERM or SIGHUP; every wait looks at it.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Catches the stop signals so that they end the run through its cleanup.
/// The children run in process groups of their own, so a Ctrl-C at the
/// terminal reaches only this process, which then stops them in order.
pub fn catch_interrupts() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: installs an async-signal-safe handler (one atomic store);
        // sigaction is plain data initialised here.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// Fails with "interrupted" once a stop signal came.
pub fn check_interrupt() -> Result<()> {
    if interrupted() {
        bail!("interrupted");
    }
    Ok(())
}

/// Whether the child `pid` has exited, without reaping it (so its pid and
/// process group stay reserved until we do).
fn exited(pid: i32) -> bool {
    // SAFETY: waitid with WNOWAIT only inspects our own child; siginfo is
    // plain data it fills in.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        let rc = libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        );
        // ECHILD: already reaped.
        rc != 0 || info.si_pid() != 0
    }
}

fn kill_group(pgid: i32, sig: libc::c_int) {
    // SAFETY: kill(2) on the process group this run created and whose
    // leader it has not reaped yet, so the id cannot have been reused.
    unsafe {
        libc::kill(-pgid, sig);
    }
}

/// A process this run started, in a process group of its own, with its
/// output in files.
pub struct Proc {
    pub name: String,
    child: Child,
    pub stdout: PathBuf,
    pub stderr: PathBuf,
    status: Option<ExitStatus>,
}

impl Proc {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn running(&self) -> bool {
        self.status.is_none() && !exited(self.pid())
    }

    /// Reaps the child once it has exited, first killing whatever is left
    /// in its process group.
    fn reap(&mut self) -> Result<ExitStatus> {
        if let Some(s) = self.status {
            return Ok(s);
        }
        kill_group(self.pid(), libc::SIGKILL);
        let s = self.child.wait().with_context(|| format!("reaping {}", self.name))?;
        self.status = Some(s);
        Ok(s)
    }

    /// Waits at most `limit` for the process to exit; on a timeout or an
    /// interrupt it is killed and the wait fails.
    pub fn wait(&mut self, limit: Duration) -> Result<ExitStatus> {
        self.wait_for(limit, true)
    }

    fn wait_for(&mut self, limit: Duration, heed_interrupt: bool) -> Result<ExitStatus> {
        let end = Instant::now() + limit;
        while self.running() {
            if heed_interrupt && interrupted() {
                self.stop();
                bail!("interrupted");
            }
            if Instant::now() >= end {
                self.stop();
                bail!("{} did not finish within {:?}{}", self.name, limit, self.tail());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.reap()
    }

    /// Stops the process: SIGTERM to its group, then SIGKILL after a
    /// bounded grace period.
    pub fn stop(&mut self) {
        if self.status.is_some() {
            return;
        }
        if self.running() {
            kill_group(self.pid(), libc::SIGTERM);
            let end = Instant::now() + Duration::from_secs(3);
            while self.running() && Instant::now() < end {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        if self.running() {
            kill_group(self.pid(), libc::SIGKILL);
            let end = Instant::now() + Duration::from_secs(3);
            while self.running() && Instant::now() < end {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        if !self.running() {
            let _ = self.reap();
        } else {
            eprintln!("vrdma bench-hosts: {} (pid {}) survived SIGKILL", self.name, self.pid());
        }
    }

    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    /// The last lines of its output, to quote in an error.
    pub fn tail(&self) -> String {
        let mut all = self.output();
        all.push_str(&std::fs::read_to_string(&self.stderr).unwrap_or_default());
        let lines: Vec<&str> = all.lines().collect();
        let start = lines.len().saturating_sub(15);
        if lines.is_empty() {
            String::new()
        } else {
            format!("\n  --- {} output (last lines) ---\n  {}", self.name, lines[start..].join("\n  "))
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Runs a short command (setup and teardown: `ip`) to completion, bounded.
/// Teardown runs it after an interrupt too, so it does not heed one.
fn run_short(dir: &Path, args: &[&str], marker: &str, heed_interrupt: bool) -> Result<()> {
    if heed_interrupt {
        check_interrupt()?;
    }
    let mut p = spawn_in(dir, None, "ip", args, &[], marker, "ip")?;
    let what = format!("ip {}", args.join(" "));
    let status = p.wait_for(Duration::from_secs(10), heed_interrupt).with_context(|| what.clone())?;
    if !status.success() {
        bail!("{what} failed ({status}){}", p.tail());
    }
    Ok(())
}

static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Spawns `program args` (inside namespace `ns` when given, through
/// `ip netns exec`), in a process group of its own, output to files in
/// `dir`.
fn spawn_in(
    dir: &Path,
    ns: Option<&str>,
    program: &str,
    args: &[&str],
    env: &[(&str, &std::ffi::OsStr)],
    marker: &str,
    name: &str,
) -> Result<Proc> {
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    let stem: String = name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
    let stdout = dir.join(format!("{n:03}-{stem}.out"));
    let stderr = dir.join(format!("{n:03}-{stem}.err"));
    let mut cmd = match ns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, program]);
            c
        }
        None => Command::new(program),
    };
    cmd.args(args)
        .env(MARKER_ENV, marker)
        .stdin(Stdio::null())
        .stdout(File::create(&stdout).with_context(|| format!("create {}", stdout.display()))?)
        .stderr(File::create(&stderr).with_context(|| format!("create {}", stderr.display()))?)
        .process_group(0);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd.spawn().with_context(|| format!("cannot start {program}"))?;
    Ok(Proc { name: name.to_string(), child, stdout, stderr, status: None })
}

/// Kills every process still carrying this run's marker (a child's child
/// that left its process group, say). Returns how many it found.
pub fn sweep(marker: &str) -> usize {
    let needle = format!("{MARKER_ENV}={marker}");
    let me = std::process::id();
    let mut found = 0;
    let Ok(entries) = std::fs::read_dir("/proc") else { return 0 };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        if pid == me {
            continue;
        }
        let Ok(env) = std::fs::read(e.path().join("environ")) else { continue };
        if env.split(|&b| b == 0).any(|v| v == needle.as_bytes()) {
            found += 1;
            // SAFETY: kill(2) on a pid whose environment we just read and
            // which carries this run's marker.
            unsafe {
                libc::kill(pid as i32, libc::SIGKILL);
            }
        }
    }
    found
}

/// One side: a namespace, its address and its daemon's socket.
pub struct Host {
    pub ns: String,
    pub addr: std::net::Ipv4Addr,
    pub socket: PathBuf,
}

pub struct Hosts {
    pub hosts: [Host; 2],
    /// Private directory: configs, sockets, output files.
    pub dir: PathBuf,
    pub lib: LibDir,
    pub marker: String,
    daemons: Vec<Proc>,
    /// Tools running now (servers), stopped with the rest.
    procs: Vec<Proc>,
    namespaces: Vec<String>,
}

impl Hosts {
    /// Creates the namespaces, the veth pair and the daemons, and waits
    /// until the daemons are linked.
    pub fn create(lib: LibDir, engine: &[String], net: &[String], verbose: bool) -> Result<Hosts> {
        Self::create_with(lib, engine, net, "", verbose)
    }

    /// [`Hosts::create`], with `extra` TOML (tables) at the end of both
    /// daemons' configurations.
    pub fn create_with(
        lib: LibDir,
        engine: &[String],
        net: &[String],
        extra: &str,
        verbose: bool,
    ) -> Result<Hosts> {
        let pid = std::process::id();
        let dir = std::env::temp_dir().join(format!("vrdma-hostbench-{pid}"));
        if dir.exists() {
            std::fs::remove_dir_all(&dir).with_context(|| format!("clear {}", dir.display()))?;
        }
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        // `VRDMA_HOSTBENCH_NS`: the namespaces' name prefix (default
        // `vrdma-hb`), for machines where each user of it keeps to names
        // of its own.
        let prefix = std::env::var("VRDMA_HOSTBENCH_NS")
            .ok()
            .filter(|p| {
                !p.is_empty() && p.len() <= 24 && p.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            })
            .unwrap_or_else(|| "vrdma-hb".into());
        let mk = |i: usize| Host {
            ns: format!("{prefix}{pid}-{}", i + 1),
            addr: std::net::Ipv4Addr::new(10, 78, 0, i as u8 + 1),
            socket: dir.join(format!("host{}.sock", i + 1)),
        };
        let mut h = Hosts {
            hosts: [mk(0), mk(1)],
            dir,
            lib,
            marker: format!("{pid}"),
            daemons: Vec::new(),
            procs: Vec::new(),
            namespaces: Vec::new(),
        };
        h.network()?;
        h.start_daemons(engine, net, extra, verbose)?;
        Ok(h)
    }

    fn ip(&self, args: &[&str]) -> Result<()> {
        run_short(&self.dir, args, &self.marker, true)
    }

    fn network(&mut self) -> Result<()> {
        for i in 0..2 {
            let ns = self.hosts[i].ns.clone();
            self.ip(&["netns", "add", &ns])?;
            self.namespaces.push(ns);
        }
        let pid = std::process::id();
        let (va, vb) = (format!("vhb{pid}a"), format!("vhb{pid}b"));
        let [a, b] = [&self.hosts[0].ns, &self.hosts[1].ns];
        // Created inside the namespaces, so it never exists outside them
        // and goes away with them.
        self.ip(&["link", "add", &va, "netns", a, "type", "veth", "peer", "name", &vb, "netns", b])?;
        for (host, dev) in self.hosts.iter().zip([&va, &vb]) {
            let addr = format!("{}/24", host.addr);
            self.ip(&["-n", &host.ns, "addr", "add", &addr, "dev", dev])?;
            self.ip(&["-n", &host.ns, "link", "set", dev, "up"])?;
            self.ip(&["-n", &host.ns, "link", "set", "lo", "up"])?;
        }
        Ok(())
    }

    fn start_daemons(&mut self, engine: &[String], net: &[String], extra: &str, verbose: bool) -> Result<()> {
        let exe = std::env::current_exe().context("where is the vrdma executable")?;
        let exe = exe.to_str().context("the vrdma executable's path is not UTF-8")?.to_string();
        let mut engine_table = String::from("\n[engine]\n");
        for kv in engine {
            let Some((k, v)) = kv.split_once('=') else { bail!("--engine {kv:?}: want KEY=VALUE") };
            engine_table.push_str(&format!("{} = {}\n", k.trim(), v.trim()));
        }
        let mut net_keys = String::new();
        for kv in net {
            let Some((k, v)) = kv.split_once('=') else { bail!("--net {kv:?}: want KEY=VALUE") };
            net_keys.push_str(&format!("{} = {}\n", k.trim(), v.trim()));
        }
        let psk = format!("vrdma bench-hosts key {} {:x}", std::process::id(), random());
        for i in 0..2 {
            let (me, peer) = (&self.hosts[i], &self.hosts[1 - i]);
            let config = format!(
                "address = \"{addr}\"\n\n[net]\nlisten = \"{addr}:{WIRE_PORT}\"\npsk = \"{psk}\"\n\
                 port = {WIRE_PORT}\npeers = [\"{peer}:{WIRE_PORT}\"]\n",
                addr = me.addr,
                peer = peer.addr,
            );
            let config = config + &net_keys + &engine_table + "\n" + extra;
            // The daemon would say the same, but only in its log.
            vrdmad::DaemonConfig::from_toml(&config).context("the daemons' configuration (--engine?)")?;
            let path = self.dir.join(format!("host{}.toml", i + 1));
            std::fs::write(&path, config).with_context(|| format!("write {}", path.display()))?;
            let socket = me.socket.to_str().context("socket path is not UTF-8")?.to_string();
            let conf = path.to_str().context("config path is not UTF-8")?.to_string();
            check_interrupt()?;
            let log = std::ffi::OsString::from(if verbose { "info" } else { "warn" });
            let p = spawn_in(
                &self.dir,
                Some(&me.ns),
                &exe,
                &["daemon", "--socket", &socket, "--config", &conf],
                &[("VRDMA_LOG", &log)],
                &self.marker,
                &format!("vrdma daemon in {}", me.ns),
            )?;
            self.daemons.push(p);
        }
        // Both up, then both linked.
        let end = Instant::now() + Duration::from_secs(20);
        loop {
            check_interrupt()?;
            for d in &self.daemons {
                if !d.running() {
                    bail!("{} exited{}", d.name, d.tail());
                }
            }
            if self.hosts.iter().all(|h| linked(&h.socket)) {
                return Ok(());
            }
            if Instant::now() > end {
                let tails: String = self.daemons.iter().map(|d| d.tail()).collect();
                bail!("the two daemons did not link over the veth pair within 20 s{tails}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Fails if a daemon died (a measurement would then only time out).
    pub fn check_daemons(&self) -> Result<()> {
        for d in &self.daemons {
            if !d.running() {
                bail!("{} exited{}", d.name, d.tail());
            }
        }
        Ok(())
    }

    /// Starts `program` in host `i`'s namespace; `shim` runs it on vRDMA
    /// (the drop-in library, that host's daemon).
    pub fn spawn(&mut self, i: usize, program: &str, args: &[&str], shim: bool) -> Result<Proc> {
        let mut env: Vec<(&str, &std::ffi::OsStr)> = Vec::new();
        if shim {
            env.push(("LD_LIBRARY_PATH", self.lib.path().as_os_str()));
            env.push((vrdma::SOCKET_ENV, self.hosts[i].socket.as_os_str()));
        }
        self.spawn_env(i, program, args, &env)
    }

    /// Starts `program` under the sockets preload `lib` (its TCP
    /// connections carried over vRDMA where the peer runs it too), on
    /// host `i`'s daemon; the library says which connections it carried
    /// on stderr (`VRDMA_SOCKETS_DEBUG`).
    pub fn spawn_sockets(&mut self, i: usize, program: &str, args: &[&str], lib: &Path) -> Result<Proc> {
        let socket = self.hosts[i].socket.clone();
        let env: [(&str, &std::ffi::OsStr); 3] = [
            ("LD_PRELOAD", lib.as_os_str()),
            (vrdma::SOCKET_ENV, socket.as_os_str()),
            ("VRDMA_SOCKETS_DEBUG", std::ffi::OsStr::new("1")),
        ];
        self.spawn_env(i, program, args, &env)
    }

    fn spawn_env(
        &self,
        i: usize,
        program: &str,
        args: &[&str],
        env: &[(&str, &std::ffi::OsStr)],
    ) -> Result<Proc> {
        check_interrupt()?;
        let name = format!("{} {} in {}", program, args.join(" "), self.hosts[i].ns);
        spawn_in(&self.dir, Some(&self.hosts[i].ns), program, args, env, &self.marker, &name)
    }

    /// Starts a server in host 0 and waits until it listens on `port`. It
    /// is kept here so that cleanup stops it whatever happens; `stop_servers`
    /// stops it after the measurement.
    pub fn server(&mut self, program: &str, args: &[&str], shim: bool, port: u16) -> Result<()> {
        let p = self.spawn(0, program, args, shim)?;
        self.serve(p, port)
    }

    /// [`Hosts::server`] under the sockets preload (see [`Hosts::spawn_sockets`]).
    /// It is ready once the library registered its listener with the
    /// daemon (its line says so), not only once the kernel listens: a
    /// client before that would stay plain TCP.
    pub fn server_sockets(&mut self, program: &str, args: &[&str], lib: &Path, port: u16) -> Result<()> {
        let p = self.spawn_sockets(0, program, args, lib)?;
        self.serve(p, port)?;
        let end = Instant::now() + Duration::from_secs(20);
        let p = self.procs.last().expect("just served");
        while !std::fs::read_to_string(&p.stderr).unwrap_or_default().contains("]: listening on") {
            check_interrupt()?;
            if !p.running() || Instant::now() > end {
                bail!("{} did not register its listener with the daemon{}", p.name, p.tail());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    fn serve(&mut self, p: Proc, port: u16) -> Result<()> {
        let pid = u32::try_from(p.pid()).ok();
        self.serve_when(p, &format!("listening on port {port}"), &mut || {
            Ok(crate::tool_output::listening(pid, port))
        })
    }

    /// Starts a server in host 0 and waits until `ready` says it is
    /// (`what` it waits for, to say in an error), as [`Hosts::server`]:
    /// for a server whose readiness no socket table shows (an rdma_cm
    /// listener, which its daemon knows of).
    pub fn server_when(
        &mut self,
        program: &str,
        args: &[&str],
        shim: bool,
        what: &str,
        ready: &mut dyn FnMut() -> Result<bool>,
    ) -> Result<()> {
        let p = self.spawn(0, program, args, shim)?;
        self.serve_when(p, what, ready)
    }

    fn serve_when(&mut self, p: Proc, what: &str, ready: &mut dyn FnMut() -> Result<bool>) -> Result<()> {
        self.procs.push(p);
        let end = Instant::now() + Duration::from_secs(20);
        while !ready()? {
            check_interrupt()?;
            let p = self.procs.last().expect("just pushed");
            if !p.running() {
                bail!("{} exited before {what}{}", p.name, p.tail());
            }
            if Instant::now() > end {
                bail!("{}: not {what} after 20 s{}", p.name, p.tail());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    /// Whether every server started since the last [`Hosts::stop_servers`]
    /// still runs.
    pub fn servers_running(&self) -> bool {
        self.procs.iter().all(|p| p.running())
    }

    /// Waits a bounded time for the servers to finish on their own (they
    /// may still be printing their side's report), then stops them.
    /// Returns their output (stdout), in the order they started.
    pub fn stop_servers(&mut self, grace: Duration) -> Vec<String> {
        let end = Instant::now() + grace;
        while self.procs.iter().any(|p| p.running()) && Instant::now() < end && !interrupted() {
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut out = Vec::new();
        for mut p in self.procs.drain(..).rev() {
            p.stop();
            out.push(p.output());
        }
        out.reverse();
        out
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for mut p in self.procs.drain(..).rev() {
            p.stop();
        }
        for mut d in self.daemons.drain(..).rev() {
            d.stop();
        }
        let left = sweep(&self.marker);
        if left > 0 {
            eprintln!("vrdma bench-hosts: killed {left} leftover process(es)");
        }
        for ns in self.namespaces.drain(..).rev() {
            if let Err(e) = run_short(&self.dir, &["netns", "del", &ns], "cleanup", false) {
                eprintln!("vrdma bench-hosts: cannot delete namespace {ns}: {e:#}");
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Whether the daemon at `socket` answers and has a link up.
fn linked(socket: &Path) -> bool {
    vrdma::Context::open_at(socket).and_then(|c| c.stat()).is_ok_and(|s| s.links.iter().any(|l| l.up))
}

fn random() -> u64 {
    let mut b = [0u8; 8];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .is_err()
    {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        return t.as_nanos() as u64;
    }
    u64::from_le_bytes(b)
}
