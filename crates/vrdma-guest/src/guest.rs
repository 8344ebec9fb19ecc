//! The boot harness: runs QEMU on an [`Image`], waits for the guest's
//! shell on the serial console, runs commands in it, and kills QEMU when
//! dropped.
//!
//! The harness does not type into the serial console (under TCG the
//! emulated UART stopped delivering input after a few commands): it
//! talks over a virtio-serial port of its own, named
//! `vrdma-guest.harness` (not `org.vrdma.K`, so the guest library never
//! takes it), whose host end is a Unix socket the harness listens on and
//! QEMU connects to at start. `/init` reads command lines from the port
//! in a `read` loop (see `init.sh`). Each command travels base64-encoded
//! in lines of at most 1 KiB (so that no quoting matters), runs in a
//! child `sh` with its standard input from `/dev/null` and its output to
//! the port, framed by `@@VRDMA-BEGIN n` and `@@VRDMA-DONE n STATUS`
//! lines that the harness waits for, each wait bounded by a deadline.
//! The serial console (QEMU's stdout) is kept for error messages.
//!
//! QEMU is started by a thread that lives as long as the [`Guest`], with
//! `PR_SET_PDEATHSIG` = SIGKILL: if the test process dies, or exits with
//! a guest never dropped (a `static` one), QEMU dies with it. Otherwise
//! dropping the guest kills QEMU by its pid and reaps it.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::accel::{self, Accel, Choice};
use crate::{Error, Image, Result};

/// The QEMU binary.
pub const QEMU: &str = "qemu-system-x86_64";
/// Console bytes kept unread at most; older ones are dropped.
const CONSOLE_CAP: usize = 16 << 20;
/// How much of the console an error shows.
const TAIL: usize = 6000;
const READY: &str = "@@VRDMA-READY ";
/// The harness's port's name in the guest.
pub const HARNESS_PORT: &str = "vrdma-guest.harness";
/// On the kernel command line: `/init` gives a shell on the serial
/// console instead of waiting for the harness's port (for a person at
/// the console, as `vrdma vm run` will be).
pub const CONSOLE_SHELL_ARG: &str = "vrdma-guest.shell";

/// How to run a guest.
pub struct GuestSpec {
    pub image: Image,
    pub memory_mib: u32,
    pub cpus: u32,
    /// `None`: `VRDMA_GUEST_ACCEL`, else auto (see [`crate::accel`]).
    pub accel: Option<Accel>,
    /// More QEMU arguments (e.g. [`crate::vm_args`]).
    pub extra_args: Vec<OsString>,
    /// More kernel command line.
    pub append: String,
    /// How long the guest may take to reach its shell.
    pub boot_timeout: Duration,
    /// A command that runs QEMU: empty for [`QEMU`] itself, else a
    /// program and arguments that QEMU's arguments follow and that must
    /// exec QEMU (so that its pid is QEMU's), such as `vrdma vm run NAME
    /// --` (which adds the VM's arguments) or `ip netns exec NS
    /// qemu-system-x86_64`.
    pub launcher: Vec<OsString>,
    inherit: Vec<OwnedFd>,
}

impl GuestSpec {
    pub fn new(image: Image) -> GuestSpec {
        GuestSpec {
            image,
            memory_mib: 512,
            cpus: 1,
            accel: None,
            extra_args: Vec::new(),
            append: String::new(),
            boot_timeout: Duration::from_secs(120),
            launcher: Vec::new(),
            inherit: Vec::new(),
        }
    }

    /// Hands `fd` to QEMU under the same number, which this returns
    /// (`/proc/self/fd/N` in QEMU's arguments); the guest keeps it open
    /// until it is dropped.
    pub fn inherit(&mut self, fd: OwnedFd) -> RawFd {
        let n = fd.as_raw_fd();
        self.inherit.push(fd);
        n
    }
}

/// QEMU's arguments for `spec` under `accel` (everything after the
/// program name): no default devices, no display, the serial console on
/// stdio, no reboot (a guest that panics or powers off ends QEMU).
pub fn qemu_args(spec: &GuestSpec, accel: Accel) -> Vec<OsString> {
    let mut a: Vec<OsString> = [
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-serial",
        "stdio",
        "-no-reboot",
        "-accel",
        accel.name(),
        "-m",
        &spec.memory_mib.to_string(),
        "-smp",
        &spec.cpus.to_string(),
        "-kernel",
    ]
    .iter()
    .map(OsString::from)
    .collect();
    a.push(spec.image.kernel.clone().into());
    a.push("-initrd".into());
    a.push(spec.image.initramfs.clone().into());
    a.push("-append".into());
    a.push(format!("console=ttyS0 quiet panic=-1 {}", spec.append).trim_end().into());
    a.extend(spec.extra_args.iter().cloned());
    a
}

/// What QEMU wrote, shared with the threads reading it.
#[derive(Default)]
struct Console {
    /// What came from the guest on the harness's port.
    out: Vec<u8>,
    /// Bytes of `out` already consumed (by the boot and by commands).
    consumed: usize,
    /// The harness's port closed (QEMU exited).
    closed: bool,
    /// The serial console (QEMU's stdout) and QEMU's stderr, for errors.
    serial: Vec<u8>,
    err: Vec<u8>,
}

/// Which stream a reader thread reads.
#[derive(Clone, Copy, PartialEq)]
enum Stream {
    Port,
    Serial,
    Stderr,
}

type Shared = Arc<(Mutex<Console>, Condvar)>;

fn tail(b: &[u8]) -> String {
    String::from_utf8_lossy(&b[b.len().saturating_sub(TAIL)..]).into_owned()
}

fn lock(s: &Shared) -> std::sync::MutexGuard<'_, Console> {
    s.0.lock().unwrap_or_else(|p| p.into_inner())
}

/// A running guest.
pub struct Guest {
    child: Child,
    reaped: Option<ExitStatus>,
    /// The harness's port, host end.
    port: Option<UnixStream>,
    /// Holds the harness's socket.
    _dir: HarnessDir,
    console: Shared,
    next: u64,
    accel: Accel,
    boot_time: Duration,
    release: String,
    /// Dropping this ends the thread that started QEMU.
    keep: Option<mpsc::Sender<()>>,
    spawner: Option<std::thread::JoinHandle<()>>,
    _inherited: Vec<OwnedFd>,
}

impl Guest {
    /// Boots `spec` and waits for the guest's shell.
    pub fn boot(spec: GuestSpec) -> Result<Guest> {
        let accel = choose_accel(&spec)?;
        let deadline = spec.boot_timeout;
        Guest::start(spec, accel, deadline, None)
    }

    /// The destination of a live migration of `from`: starts QEMU on
    /// `spec`, whose arguments must make it wait for the migration
    /// (`-incoming ...`, and `-S` to keep its CPUs stopped until the
    /// caller's `cont`), with a harness port of its own that QEMU
    /// connects at start. No guest boots: the guest arrives with the
    /// migration, its `/init` reading the harness's port, which QEMU
    /// now connects to this harness. Commands go on numbered after
    /// `from`'s. Run commands only once the migration is complete and
    /// the CPUs run (before, they wait their timeout).
    pub fn incoming(spec: GuestSpec, from: &Guest) -> Result<Guest> {
        let deadline = spec.boot_timeout;
        Guest::start(spec, from.accel, deadline, Some(from))
    }

    fn start(spec: GuestSpec, accel: Accel, deadline: Duration, from: Option<&Guest>) -> Result<Guest> {
        let started = Instant::now();
        let dir = harness_dir()?;
        let sock = dir.0.join("harness.sock");
        let listener = UnixListener::bind(&sock).map_err(|e| Error::path("listen on", &sock, e))?;
        let mut cmd = match spec.launcher.split_first() {
            None => Command::new(QEMU),
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args);
                c
            }
        };
        cmd.args(qemu_args(&spec, accel)).args(harness_args(&sock)?);
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let fds: Vec<RawFd> = spec.inherit.iter().map(|f| f.as_raw_fd()).collect();
        // SAFETY: getpid has no preconditions.
        let parent = unsafe { libc::getpid() };
        // SAFETY: the closure runs in the forked child before exec; fcntl,
        // prctl, getppid and _exit are async-signal-safe, and `fds` and
        // `parent` were made before the fork and are only read.
        unsafe {
            cmd.pre_exec(move || {
                for &fd in &fds {
                    if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let (tx, rx) = mpsc::channel();
        let (keep, keep_rx) = mpsc::channel::<()>();
        let spawner = std::thread::Builder::new()
            .name("vrdma-guest-qemu".into())
            .spawn(move || {
                let _ = tx.send(cmd.spawn());
                // Returns when the Guest drops its sender.
                let _ = keep_rx.recv();
            })
            .map_err(|e| Error::io("start the thread that runs QEMU", e))?;
        let spawned = rx.recv().map_err(|_| Error::Invalid("the thread that runs QEMU ended".into()));
        let mut child = match spawned
            .and_then(|r| r.map_err(|e| Error::io(format!("run {QEMU} (is qemu-system-x86 installed?)"), e)))
        {
            Ok(c) => c,
            Err(e) => {
                drop(keep);
                let _ = spawner.join();
                return Err(e);
            }
        };
        let console: Shared = Arc::default();
        read_into(child.stdout.take().expect("piped"), console.clone(), Stream::Serial)?;
        read_into(child.stderr.take().expect("piped"), console.clone(), Stream::Stderr)?;
        let mut g = Guest {
            child,
            reaped: None,
            port: None,
            _dir: dir,
            console,
            next: 0,
            accel,
            boot_time: Duration::ZERO,
            release: String::new(),
            keep: Some(keep),
            spawner: Some(spawner),
            _inherited: spec.inherit,
        };
        let boot_error = |g: &mut Guest, why: String| {
            let _ = g.kill();
            Error::Boot {
                why: format!(
                    "{why}, {:.1} s after QEMU started under {}",
                    started.elapsed().as_secs_f64(),
                    accel.name()
                ),
                console: g.console_tail(),
            }
        };
        // QEMU connects its chardev as it starts, before the guest runs.
        match accept(&listener, &mut g.child, started + deadline) {
            Ok(s) => {
                let r = s.try_clone().map_err(|e| Error::io("clone the harness's socket", e))?;
                read_into(r, g.console.clone(), Stream::Port)?;
                g.port = Some(s);
            }
            Err(why) => return Err(boot_error(&mut g, why)),
        }
        if let Some(from) = from {
            g.next = from.next;
            g.release = from.release.clone();
            return Ok(g);
        }
        let line = g.wait_for(started + deadline, |out| {
            let at = find(out, READY.as_bytes(), 0)?;
            let end = at + find(&out[at..], b"\n", 0)?;
            Some((String::from_utf8_lossy(&out[at + READY.len()..end]).into_owned(), end + 1))
        });
        let (line, end) = match line {
            Ok(x) => x,
            Err(why) => return Err(boot_error(&mut g, why)),
        };
        lock(&g.console).consumed += end;
        g.boot_time = started.elapsed();
        for kv in line.split_whitespace() {
            match kv.split_once('=') {
                Some(("accel", a)) if a != accel.name() => {
                    return Err(boot_error(
                        &mut g,
                        format!("QEMU was asked for {} but the guest reports {a}", accel.name()),
                    ))
                }
                Some(("release", r)) => g.release = r.to_string(),
                _ => {}
            }
        }
        Ok(g)
    }

    /// Waits until `found` finds something in the console's output past
    /// what commands consumed, QEMU's output ends, or `deadline` passes.
    fn wait_for<T>(
        &self,
        deadline: Instant,
        mut found: impl FnMut(&[u8]) -> Option<T>,
    ) -> std::result::Result<T, String> {
        let mut c = lock(&self.console);
        loop {
            let from = c.consumed.min(c.out.len());
            if let Some(t) = found(&c.out[from..]) {
                return Ok(t);
            }
            if c.closed {
                return Err("the harness's port closed (QEMU exited?)".into());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err("deadline passed".into());
            }
            c = self.console.1.wait_timeout(c, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Runs `command` with `sh` in the guest, waiting up to `timeout`;
    /// returns its exit status and its output (stdout and stderr
    /// together). After a timeout the command may still run, and later
    /// commands wait behind it.
    pub fn run(&mut self, command: &str, timeout: Duration) -> Result<(i32, String)> {
        let n = self.next;
        self.next += 1;
        let b64 = base64(command.as_bytes());
        let mut script = String::new();
        for chunk in b64.as_bytes().chunks(1024) {
            script.push_str("c ");
            script.push_str(std::str::from_utf8(chunk).expect("base64 is ASCII"));
            script.push('\n');
        }
        script.push_str(&format!("r {n}\n"));
        let gone = |g: &Guest, why: String| Error::Gone { why, console: g.console_tail() };
        let mut port = self.port.as_ref().ok_or_else(|| Error::Invalid("the guest was killed".into()))?;
        if let Err(e) = port.write_all(script.as_bytes()) {
            return Err(gone(self, format!("writing to the harness's port: {e}")));
        }
        let begin = format!("@@VRDMA-BEGIN {n}\n");
        let done = format!("\n@@VRDMA-DONE {n} ");
        let deadline = Instant::now() + timeout;
        let got = self.wait_for(deadline, |out| {
            let b = find(out, begin.as_bytes(), 0)? + begin.len();
            let d = find(out, done.as_bytes(), b)?;
            let s = d + done.len();
            let e = s + find(&out[s..], b"\n", 0)?;
            let status = String::from_utf8_lossy(&out[s..e]).trim().parse::<i32>().unwrap_or(-1);
            Some((status, String::from_utf8_lossy(&out[b..d]).into_owned(), e + 1))
        });
        match got {
            Ok((status, output, end)) => {
                lock(&self.console).consumed += end;
                Ok((status, output))
            }
            Err(why) if why.contains("deadline") => {
                let c = lock(&self.console);
                let from = c.consumed.min(c.out.len());
                let so_far = String::from_utf8_lossy(&c.out[from..]);
                let begun = so_far.contains(begin.as_str());
                let so_far = so_far.split_once(begin.as_str()).map(|x| x.1).unwrap_or("").to_string();
                let console = format!(
                    "{}\n-- QEMU's stderr:\n{}\n-- (the guest {} the command)",
                    tail(&c.serial),
                    tail(&c.err),
                    if begun { "began" } else { "never began" }
                );
                Err(Error::Timeout {
                    command: command.to_string(),
                    secs: timeout.as_secs(),
                    output: so_far,
                    console,
                })
            }
            Err(why) => Err(gone(self, why)),
        }
    }

    /// [`Guest::run`], failing unless the command exits with status 0;
    /// returns its output.
    pub fn check(&mut self, command: &str, timeout: Duration) -> Result<String> {
        match self.run(command, timeout)? {
            (0, out) => Ok(out),
            (st, out) => Err(Error::Invalid(format!("`{command}` exited with {st} in the guest:\n{out}"))),
        }
    }

    /// Kills QEMU (SIGKILL, by its pid) and reaps it.
    pub fn kill(&mut self) -> Result<ExitStatus> {
        if let Some(st) = self.reaped {
            return Ok(st);
        }
        if let Some(p) = self.port.take() {
            let _ = p.shutdown(std::net::Shutdown::Both);
        }
        // Child::kill sends SIGKILL to the child's pid, which this process
        // has not reaped yet, so the pid is still QEMU's.
        if let Err(e) = self.child.kill() {
            if e.kind() != std::io::ErrorKind::InvalidInput {
                return Err(Error::io("kill QEMU", e));
            }
        }
        let st = self.child.wait().map_err(|e| Error::io("reap QEMU", e))?;
        self.reaped = Some(st);
        Ok(st)
    }

    /// QEMU's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The accelerator the guest runs under (as it reported it).
    pub fn accel(&self) -> Accel {
        self.accel
    }

    /// From starting QEMU to the guest's shell.
    pub fn boot_time(&self) -> Duration {
        self.boot_time
    }

    /// The guest kernel's release.
    pub fn release(&self) -> &str {
        &self.release
    }

    /// The serial console's last few KiB, what came on the harness's
    /// port, and QEMU's stderr, for messages.
    pub fn console_tail(&self) -> String {
        let c = lock(&self.console);
        format!(
            "{}\n-- the harness's port:\n{}\n-- QEMU's stderr:\n{}",
            tail(&c.serial),
            tail(&c.out),
            tail(&c.err)
        )
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        if let Err(e) = self.kill() {
            tracing::warn!("guest QEMU (pid {}): {e}", self.child.id());
        }
        drop(self.keep.take());
        if let Some(t) = self.spawner.take() {
            let _ = t.join();
        }
    }
}

/// A private directory for the harness's socket, removed on drop.
struct HarnessDir(PathBuf);

impl Drop for HarnessDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh [`HarnessDir`].
fn harness_dir() -> Result<HarnessDir> {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("vrdma-guest-{}-{n}", std::process::id()));
    if d.exists() {
        std::fs::remove_dir_all(&d).map_err(|e| Error::path("clear", &d, e))?;
    }
    // Private: whoever connects to the socket first is taken for QEMU.
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().mode(0o700).create(&d).map_err(|e| Error::path("create", &d, e))?;
    Ok(HarnessDir(d))
}

/// QEMU's arguments for the harness's port, connecting to `sock`.
fn harness_args(sock: &Path) -> Result<Vec<OsString>> {
    let sock = sock.to_str().ok_or_else(|| Error::Invalid(format!("{} is not UTF-8", sock.display())))?;
    Ok([
        "-device".to_string(),
        "virtio-serial-pci,id=vrdma-guest-harness".into(),
        "-chardev".into(),
        format!("socket,id=vrdma-guest-h,path={}", sock.replace(',', ",,")),
        "-device".into(),
        format!("virtserialport,bus=vrdma-guest-harness.0,chardev=vrdma-guest-h,name={HARNESS_PORT}"),
    ]
    .into_iter()
    .map(OsString::from)
    .collect())
}

/// Accepts QEMU's connection to the harness's socket, polling, until
/// `deadline` or QEMU's exit.
fn accept(l: &UnixListener, child: &mut Child, deadline: Instant) -> std::result::Result<UnixStream, String> {
    l.set_nonblocking(true).map_err(|e| format!("harness socket: {e}"))?;
    loop {
        match l.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).map_err(|e| format!("harness socket: {e}"))?;
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(format!("accepting QEMU's connection to the harness's socket: {e}")),
        }
        if let Ok(Some(st)) = child.try_wait() {
            return Err(format!("QEMU exited ({st}) before connecting the harness's port"));
        }
        if Instant::now() >= deadline {
            return Err("QEMU did not connect the harness's port before the deadline".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The accelerator for `spec`: its own, else `VRDMA_GUEST_ACCEL`, else
/// auto (see [`crate::accel`]).
pub fn choose_accel(spec: &GuestSpec) -> Result<Accel> {
    match spec.accel.map(Choice::Fixed).map(Ok).unwrap_or_else(accel::choice)? {
        Choice::Fixed(a) => Ok(a),
        Choice::Auto => auto(&spec.image),
    }
}

/// QEMU's arguments for a person at the console (`vrdma vm run`): as
/// [`qemu_args`], with QEMU's monitor on the console too (Ctrl-A X
/// quits, Ctrl-A C switches) and `/init` giving a shell there instead of
/// waiting for the harness.
pub fn console_args(spec: &GuestSpec, accel: Accel) -> Vec<OsString> {
    let mut a = qemu_args(spec, accel);
    for arg in a.iter_mut() {
        if arg == "stdio" {
            *arg = "mon:stdio".into();
        } else if arg.to_string_lossy().starts_with("console=ttyS0 ") {
            arg.push(format!(" {CONSOLE_SHELL_ARG}"));
        }
    }
    a
}

/// Runs QEMU on `spec` with this process's terminal as the guest's
/// console (see [`console_args`]), handing it `spec`'s inherited
/// descriptors, and waits for it to end.
pub fn run_on_console(spec: GuestSpec, accel: Accel) -> Result<ExitStatus> {
    let mut cmd = Command::new(QEMU);
    cmd.args(console_args(&spec, accel));
    let fds: Vec<RawFd> = spec.inherit.iter().map(|f| f.as_raw_fd()).collect();
    // SAFETY: the closure runs in the forked child before exec; fcntl is
    // async-signal-safe, and `fds` was made before the fork and is only
    // read.
    unsafe {
        cmd.pre_exec(move || {
            for &fd in &fds {
                if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let st = cmd.status().map_err(|e| Error::io(format!("run {QEMU}"), e));
    drop(spec);
    st
}

/// Whether KVM runs guests here (see [`crate::accel`]): remembered, or
/// probed once with a bare guest.
fn auto(image: &Image) -> Result<Accel> {
    if !accel::kvm_usable() {
        return Ok(Accel::Tcg);
    }
    if let Some(why) = accel::kvm_unsuitable() {
        tracing::info!("using TCG: {why}");
        return Ok(Accel::Tcg);
    }
    if let Some((a, _)) = accel::remembered(&image.release)? {
        return Ok(a);
    }
    // One probe at a time, across threads and processes; a waiter finds
    // the answer remembered.
    let _lock = accel::lock()?;
    if let Some((a, _)) = accel::remembered(&image.release)? {
        return Ok(a);
    }
    let probe = Guest::start(GuestSpec::new(image.clone()), Accel::Kvm, accel::PROBE_DEADLINE, None);
    let (a, why) = match probe {
        Ok(g) => {
            (Accel::Kvm, format!("a KVM guest reached its shell in {:.1} s", g.boot_time().as_secs_f64()))
        }
        Err(e) => {
            let why = match e {
                Error::Boot { why, .. } => format!("a KVM guest did not reach its shell: {why}"),
                e => e.to_string().lines().next().unwrap_or("").to_string(),
            };
            tracing::warn!("KVM does not run guests here; using TCG: {why}");
            (Accel::Tcg, why)
        }
    };
    accel::remember(&image.release, a, &why)?;
    Ok(a)
}

/// A thread appending what `r` yields to the console, keeping at most
/// [`CONSOLE_CAP`] bytes of each stream (carriage returns dropped from
/// the serial console's).
fn read_into(mut r: impl Read + Send + 'static, console: Shared, which: Stream) -> Result<()> {
    std::thread::Builder::new()
        .name("vrdma-guest-console".into())
        .spawn(move || {
            let mut buf = [0u8; 8192];
            loop {
                let n = match r.read(&mut buf) {
                    Ok(0) | Err(_) => 0,
                    Ok(n) => n,
                };
                let mut c = lock(&console);
                if n == 0 {
                    if which == Stream::Port {
                        c.closed = true;
                    }
                    console.1.notify_all();
                    return;
                }
                let c = &mut *c;
                match which {
                    Stream::Port => {
                        c.out.extend_from_slice(&buf[..n]);
                        if c.out.len() > CONSOLE_CAP {
                            // Consumed bytes go first; then the oldest unread
                            // ones (a command printing this much loses its
                            // start, and its run times out saying so).
                            let cut = c.consumed.max(c.out.len() - CONSOLE_CAP / 2).min(c.out.len());
                            c.out.drain(..cut);
                            c.consumed = c.consumed.saturating_sub(cut);
                        }
                    }
                    Stream::Serial | Stream::Stderr => {
                        let v = if which == Stream::Serial { &mut c.serial } else { &mut c.err };
                        v.extend(buf[..n].iter().copied().filter(|b| *b != b'\r'));
                        if v.len() > CONSOLE_CAP {
                            v.drain(..v.len() - CONSOLE_CAP / 2);
                        }
                    }
                }
                console.1.notify_all();
            }
        })
        .map(|_| ())
        .map_err(|e| Error::io("start a console reader", e))
}

/// The first `needle` in `hay` at or after `from`.
fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    hay.get(from..)?.windows(needle.len()).position(|w| w == needle).map(|p| p + from)
}

/// Standard base64 with padding (busybox's `base64 -d` reads it).
fn base64(data: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for c in data.chunks(3) {
        let b = [c[0], *c.get(1).unwrap_or(&0), *c.get(2).unwrap_or(&0)];
        let v = (b[0] as u32) << 16 | (b[1] as u32) << 8 | b[2] as u32;
        for i in 0..4 {
            if i <= c.len() {
                out.push(A[(v >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_for_the_harness_and_for_a_person() {
        let img = Image { kernel: "/k".into(), initramfs: "/i".into(), release: "r".into() };
        let mut spec = GuestSpec::new(img);
        spec.extra_args = vec!["-device".into(), "x".into()];
        let a: Vec<String> =
            qemu_args(&spec, Accel::Tcg).iter().map(|s| s.to_string_lossy().into_owned()).collect();
        let at = |k: &str| a[a.iter().position(|x| x == k).unwrap() + 1].clone();
        assert_eq!(
            (at("-accel"), at("-serial"), at("-kernel"), at("-initrd")),
            ("tcg".into(), "stdio".into(), "/k".into(), "/i".into())
        );
        assert_eq!(at("-append"), "console=ttyS0 quiet panic=-1");
        assert_eq!(a[a.len() - 2..], ["-device", "x"]);
        let c: Vec<String> =
            console_args(&spec, Accel::Kvm).iter().map(|s| s.to_string_lossy().into_owned()).collect();
        let at = |k: &str| c[c.iter().position(|x| x == k).unwrap() + 1].clone();
        assert_eq!((at("-accel"), at("-serial")), ("kvm".into(), "mon:stdio".into()));
        assert_eq!(at("-append"), format!("console=ttyS0 quiet panic=-1 {CONSOLE_SHELL_ARG}"));
        let h: Vec<String> = harness_args(Path::new("/t/h.sock"))
            .unwrap()
            .iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect();
        assert!(h.contains(&format!(
            "virtserialport,bus=vrdma-guest-harness.0,chardev=vrdma-guest-h,name={HARNESS_PORT}"
        )));
        assert!(
            !HARNESS_PORT.starts_with("org.vrdma"),
            "the guest library must never take the harness's port"
        );
    }

    #[test]
    fn base64_and_find() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
        assert_eq!(find(b"abcabc", b"bc", 2), Some(4));
        assert_eq!(find(b"abc", b"x", 0), None);
        assert_eq!(find(b"abc", b"a", 9), None);
    }
}
