//! `vrdma run -- PROGRAM ARGS...`: runs an unmodified verbs program on
//! vRDMA.
//!
//! The program loads `libibverbs.so.1` by its soname; `vrdma run` makes
//! the dynamic linker find vRDMA's (the `vrdma-verbs` cdylib) first. It
//! creates a private directory holding a `libibverbs.so.1` link to the
//! library, prepends it to `LD_LIBRARY_PATH`, points `VRDMA_SOCKET` at a
//! daemon (the one answering on `--socket`/`VRDMA_SOCKET`/the default
//! path, else one started inside this process, as `vrdma bench` does),
//! runs the program, and exits with its exit status once it is done and
//! the embedded daemon, if any, is stopped. Inside a QEMU guest given
//! vRDMA's ports and BAR (`docs/vms.md`), it starts no daemon and sets no
//! `VRDMA_SOCKET`: the program's drop-in finds the VM's device as
//! `vrdma run` did (the ports and BAR, or `VRDMA_GUEST_PORT` and
//! `VRDMA_GUEST_BAR`, which it inherits), and so uses the host's daemon;
//! a daemon in the guest would be one no other VM or host could reach.
//!
//! The library is `libvrdma_verbs.so` next to the `vrdma` executable
//! (where cargo puts both), or the file `VRDMA_VERBS_LIB` names.
//!
//! The directory also gets `libmlx5.so.1`, `libmlx4.so.1`, `libefa.so.1`
//! and `libmana.so.1` links to the `vrdma-companions` library
//! (`libvrdma_companions.so` next to the executable, or the file
//! `VRDMA_COMPANIONS_LIB` names), which programs linked against rdma-core's
//! provider libraries (perftest, UCX, libfabric) need in order to load:
//! rdma-core's own copies import its private provider ABI. Without it the links are left out and such
//! programs fail to load, saying which library they miss.
//!
//! And it gets `librdmacm.so.1`, linked to vRDMA's connection manager
//! library (the `vrdma-rdmacm` cdylib: `libvrdma_rdmacm.so` next to the
//! executable, or the file `VRDMA_RDMACM_LIB` names), so that programs
//! that connect through rdma_cm (`rping`, `ucmatose`, perftest's `-R`)
//! reach the daemon's connection manager: rdma-core's own librdmacm
//! needs the kernel's (`/dev/infiniband/rdma_cm`). Without it the link is
//! left out, and such programs fail as they do without vRDMA.
//!
//! With `--sockets` it also preloads `libvrdma_sockets.so` (next to the
//! executable, or the file `VRDMA_SOCKETS_LIB` names; `LD_PRELOAD` first,
//! before any the caller set), which carries the program's TCP connections
//! over vRDMA where the peer runs it too (`docs/sockets.md`).
//!
//! For UCX (and so Open MPI's `pml ucx`), two more things:
//!
//! - UCX lists a verbs device only if `/dev/infiniband/<dev_name>` is a
//!   character device it may read and write. `vrdma run` makes that
//!   marker node where it is missing and it may ([`vrdmad::devnode`]: a
//!   `/dev/null` node, which grants nothing), as the daemon does at start;
//!   where it cannot (not root) it says so once, with the command that
//!   fixes it, and runs the program anyway.
//! - UCX allocates its verbs transports' buffers from SysV huge pages
//!   first (`shmget(SHM_HUGETLB)`) when the machine has huge pages
//!   reserved, and registers them; vRDMA can only register memory it can
//!   re-back, which a SysV segment (shared, by its nature) is not, and
//!   UCX does not fall back to other memory when that registration fails.
//!   So `vrdma run` sets `UCX_IB_ALLOC=thp,mmap,heap` (UCX's default list
//!   without `huge` and `md`) unless the caller set it. Children
//!   (`mpirun`'s ranks on this host) inherit it, as they inherit
//!   `LD_LIBRARY_PATH` and `VRDMA_SOCKET`.

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _, Result};

#[derive(clap::Args)]
pub struct Args {
    /// Also preload the sockets library (`libvrdma_sockets.so`, or the
    /// file `VRDMA_SOCKETS_LIB` names): the program's TCP connections to
    /// another such program of the tenant on this host go over vRDMA, the
    /// others stay TCP (docs/sockets.md).
    #[arg(long)]
    sockets: bool,
    /// The program and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true, value_name = "PROGRAM")]
    command: Vec<OsString>,
}

/// Environment variable naming the shim library explicitly.
const LIB_ENV: &str = "VRDMA_VERBS_LIB";
const LIB_NAME: &str = "libvrdma_verbs.so";
/// The same for the companion library, and the sonames it stands in for.
const COMPANIONS_ENV: &str = "VRDMA_COMPANIONS_LIB";
const COMPANIONS_NAME: &str = "libvrdma_companions.so";
/// (`vrdma_companions::SONAMES`: every rdma-core 44 provider library with
/// a direct-verbs interface, as Debian's ibverbs-providers ships them.)
const COMPANION_SONAMES: [&str; 4] = ["libmlx5.so.1", "libmlx4.so.1", "libefa.so.1", "libmana.so.1"];
/// The same for the connection manager library.
const RDMACM_ENV: &str = "VRDMA_RDMACM_LIB";
const RDMACM_NAME: &str = "libvrdma_rdmacm.so";
const RDMACM_SONAME: &str = "librdmacm.so.1";
/// The same for the sockets preload library.
const SOCKETS_ENV: &str = "VRDMA_SOCKETS_LIB";
const SOCKETS_NAME: &str = "libvrdma_sockets.so";
/// UCX's memory for its verbs transports' buffers: its default methods
/// less SysV huge pages (see the module documentation) and `md` (which
/// only mlx5's direct verbs implement).
const UCX_ALLOC_ENV: &str = "UCX_IB_ALLOC";
const UCX_ALLOC: &str = "thp,mmap,heap";

/// vRDMA's `librdmacm.so.1`, if there is one (see the module
/// documentation).
pub(crate) fn find_rdmacm() -> Result<Option<PathBuf>> {
    if let Some(p) = std::env::var_os(RDMACM_ENV) {
        let p = PathBuf::from(p);
        if !p.is_file() {
            bail!("{RDMACM_ENV}={} does not name a file", p.display());
        }
        return Ok(Some(p));
    }
    let exe = std::env::current_exe().context("where is the vrdma executable")?;
    Ok(exe.parent().map(|d| d.join(RDMACM_NAME)).filter(|p| p.is_file()))
}

/// The companion library, if there is one (see the module documentation).
pub(crate) fn find_companions() -> Result<Option<PathBuf>> {
    if let Some(p) = std::env::var_os(COMPANIONS_ENV) {
        let p = PathBuf::from(p);
        if !p.is_file() {
            bail!("{COMPANIONS_ENV}={} does not name a file", p.display());
        }
        return Ok(Some(p));
    }
    let exe = std::env::current_exe().context("where is the vrdma executable")?;
    Ok(exe.parent().map(|d| d.join(COMPANIONS_NAME)).filter(|p| p.is_file()))
}

/// The sockets preload library (`--sockets`).
pub(crate) fn find_sockets() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(SOCKETS_ENV) {
        let p = PathBuf::from(p);
        if !p.is_file() {
            bail!("{SOCKETS_ENV}={} does not name a file", p.display());
        }
        return Ok(p);
    }
    let exe = std::env::current_exe().context("where is the vrdma executable")?;
    let lib = exe.parent().map(|d| d.join(SOCKETS_NAME)).filter(|p| p.is_file());
    lib.with_context(|| {
        format!(
            "{SOCKETS_NAME} not found next to {}; build it (cargo build -p vrdma-sockets, with the same \
             profile) or name it with {SOCKETS_ENV}",
            exe.display()
        )
    })
}

/// `LD_PRELOAD` with `lib` first (the dynamic linker takes a colon- or
/// space-separated list; a path with either cannot be preloaded).
fn preload_with(lib: &Path, old: Option<OsString>) -> Result<OsString> {
    let s = lib
        .to_str()
        .filter(|s| !s.contains([':', ' ']))
        .with_context(|| format!("{} cannot be preloaded: its path has a colon or a space", lib.display()))?;
    let mut v = OsString::from(s);
    if let Some(old) = old.filter(|o| !o.is_empty()) {
        v.push(":");
        v.push(old);
    }
    Ok(v)
}

pub(crate) fn find_library() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(LIB_ENV) {
        let p = PathBuf::from(p);
        if !p.is_file() {
            bail!("{LIB_ENV}={} does not name a file", p.display());
        }
        return Ok(p);
    }
    let exe = std::env::current_exe().context("where is the vrdma executable")?;
    let dir = exe.parent().context("the vrdma executable has no directory")?;
    let lib = dir.join(LIB_NAME);
    if lib.is_file() {
        return Ok(lib);
    }
    bail!(
        "{} not found next to {}; build it (cargo build -p vrdma-verbs, with the same profile) \
         or name it with {LIB_ENV}",
        LIB_NAME,
        exe.display()
    )
}

/// Whether the drop-in library `lib` was built from the same sources of
/// `vrdma`, `vrdma-core` and `vrdma-shm` as this executable: it carries
/// the marker [`vrdma::BUILD_ID`] of its build, which must be ours. A
/// stale library (the workspace rebuilt without it, say `cargo build -p
/// vrdma-cli` after a protocol change) fails in ways that say nothing of
/// the cause (its first exchange with the daemon, or a shared-memory
/// layout read differently), so callers refuse it with this error.
pub(crate) fn check_build_id(lib: &Path) -> Result<()> {
    let bytes = std::fs::read(lib).with_context(|| format!("read {}", lib.display()))?;
    let mark = b"VRDMA-BUILD-ID:";
    let ours = vrdma::build_id();
    let theirs = bytes
        .windows(mark.len())
        .position(|w| w == mark)
        .and_then(|i| bytes.get(i + mark.len()..i + mark.len() + ours.len()))
        .map(|id| String::from_utf8_lossy(id).into_owned());
    let rebuild = "rebuild it with the same profile (cargo build [--release] -p vrdma-verbs -p vrdma-rdmacm)";
    match theirs {
        Some(id) if id == ours => Ok(()),
        Some(id) => bail!(
            "{} is stale: built from other sources of the vrdma library than this vrdma executable \
             (build id {id}, ours {ours}); {rebuild}",
            lib.display()
        ),
        None => {
            bail!("{} is stale: it carries no vRDMA build id (built before them); {rebuild}", lib.display())
        }
    }
}

/// A directory removed on drop, holding the `libibverbs.so.1` link.
pub(crate) struct LibDir(PathBuf);

impl LibDir {
    pub(crate) fn create(lib: &Path, companions: Option<&Path>) -> Result<LibDir> {
        let lib = lib.canonicalize().with_context(|| format!("resolve {}", lib.display()))?;
        let dir = std::env::temp_dir().join(format!("vrdma-run-{}", std::process::id()));
        if dir.exists() {
            std::fs::remove_dir_all(&dir).with_context(|| format!("clear {}", dir.display()))?;
        }
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        let d = LibDir(dir);
        std::os::unix::fs::symlink(&lib, d.0.join("libibverbs.so.1"))
            .with_context(|| format!("link libibverbs.so.1 to {}", lib.display()))?;
        if let Some(c) = companions {
            let c = c.canonicalize().with_context(|| format!("resolve {}", c.display()))?;
            for soname in COMPANION_SONAMES {
                std::os::unix::fs::symlink(&c, d.0.join(soname))
                    .with_context(|| format!("link {soname} to {}", c.display()))?;
            }
        }
        Ok(d)
    }

    /// Adds `librdmacm.so.1`, linked to `lib`.
    pub(crate) fn add_rdmacm(&self, lib: &Path) -> Result<()> {
        let lib = lib.canonicalize().with_context(|| format!("resolve {}", lib.display()))?;
        std::os::unix::fs::symlink(&lib, self.0.join(RDMACM_SONAME))
            .with_context(|| format!("link {RDMACM_SONAME} to {}", lib.display()))
    }

    /// The directory, to prepend to `LD_LIBRARY_PATH`.
    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for LibDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Sets how SIGINT and SIGQUIT are handled in this process, returning the
/// previous handlers.
fn set_interrupt_handlers(handler: [libc::sighandler_t; 2]) -> [libc::sighandler_t; 2] {
    // SAFETY: signal(2) with SIG_IGN or a handler it returned earlier,
    // which are valid dispositions.
    unsafe { [libc::signal(libc::SIGINT, handler[0]), libc::signal(libc::SIGQUIT, handler[1])] }
}

/// The program's pidfd while it runs, for [`forward`]; -1 when none.
static CHILD_PIDFD: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

/// A termination signal that came before the program's pidfd was known,
/// for `run` to pass on once it is; 0 when none.
static PENDING: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// Hands a termination signal sent to `vrdma run` on to the program,
/// which ends; `run` then stops the daemon and removes the library
/// folder as after any exit, instead of dying with both left behind.
/// (Installed before the program starts, so that a signal sent as soon as
/// it exists does not kill `vrdma run` instead: until its pidfd is known
/// the signal waits in [`PENDING`].)
extern "C" fn forward(sig: libc::c_int) {
    let fd = CHILD_PIDFD.load(std::sync::atomic::Ordering::SeqCst);
    if fd < 0 {
        PENDING.store(sig, std::sync::atomic::Ordering::SeqCst);
    } else {
        // SAFETY: pidfd_send_signal(2) is a plain system call, safe in a
        // signal handler; `fd` is the program's pidfd, open until `run`
        // has reaped the program and reset CHILD_PIDFD (a pidfd names
        // that process only, even once its pid is reused).
        unsafe {
            libc::syscall(libc::SYS_pidfd_send_signal, fd, sig, std::ptr::null::<libc::siginfo_t>(), 0);
        }
    }
}

/// Sets how SIGTERM and SIGHUP are handled, returning the previous
/// handlers.
fn set_termination_handlers(handler: [libc::sighandler_t; 2]) -> [libc::sighandler_t; 2] {
    // SAFETY: signal(2) with `forward` (an extern "C" fn that only makes
    // an async-signal-safe system call) or a disposition it returned
    // earlier; glibc's signal restarts interrupted calls, so the wait for
    // the program goes on.
    unsafe { [libc::signal(libc::SIGTERM, handler[0]), libc::signal(libc::SIGHUP, handler[1])] }
}

/// Runs the program; returns the exit code to leave with (128 + the
/// signal number if a signal ended it, as shells report).
pub fn run(socket: Option<PathBuf>, args: Args) -> Result<i32> {
    let (program, rest) = args.command.split_first().context("no program to run")?;
    let sockets = if args.sockets { Some(find_sockets()?) } else { None };
    let lib = find_library()?;
    let dir = LibDir::create(&lib, find_companions()?.as_deref())?;
    if let Some(cm) = find_rdmacm()? {
        dir.add_rdmacm(&cm)?;
    }
    // In a guest, the host's daemon through the VM's ports, which the
    // program's drop-in finds as `vrdma run` does; else a daemon (started
    // in this process if none runs), named by VRDMA_SOCKET.
    let device = match crate::embedded::guest(socket.as_deref())? {
        Some(cfg) => {
            if let Err(why) = cfg.check() {
                bail!("vRDMA's device in this VM is not usable: {why}");
            }
            None
        }
        None => Some(crate::embedded::device(socket, vrdmad::EngineConfig::default())?),
    };
    // (A daemon started here has said so already, with the same fix.)
    let node = vrdmad::devnode::ensure(vrdmad::DEVICE_NAME);
    if let (vrdmad::devnode::NodeState::Unavailable(why), None | Some(crate::embedded::Device::External(_))) =
        (node, &device)
    {
        eprintln!(
            "vrdma run: UCX (and Open MPI over UCX) will not see the vRDMA device: {why}. \
             Make the node once as root: {}",
            vrdmad::devnode::fix_command(vrdmad::DEVICE_NAME)
        );
    }

    let mut path = dir.0.clone().into_os_string();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|v| !v.is_empty()) {
        path.push(":");
        path.push(old);
    }
    let mut command = Command::new(program);
    command.args(rest).env("LD_LIBRARY_PATH", path);
    if let Some(d) = &device {
        command.env(vrdma::SOCKET_ENV, d.socket());
    }
    if std::env::var_os(UCX_ALLOC_ENV).is_none() {
        command.env(UCX_ALLOC_ENV, UCX_ALLOC);
    }
    if let Some(lib) = &sockets {
        command.env("LD_PRELOAD", preload_with(lib, std::env::var_os("LD_PRELOAD"))?);
    }
    // A caught signal is reset to its default in the program by exec.
    let f = forward as extern "C" fn(libc::c_int) as libc::sighandler_t;
    let old_term = set_termination_handlers([f, f]);
    let spawned = command.spawn();
    let mut child = match spawned {
        Ok(c) => c,
        // As a shell reports them: 127 for a program not found, 126 for
        // one that cannot be executed.
        Err(e) => {
            set_termination_handlers(old_term);
            eprintln!("vrdma run: cannot run {}: {e}", program.to_string_lossy());
            return Ok(if e.kind() == std::io::ErrorKind::NotFound { 127 } else { 126 });
        }
    };
    // Ctrl-C goes to the whole foreground group: let the program decide,
    // and stay alive to stop the embedded daemon after it. (Set after the
    // spawn, so the program does not inherit the ignored dispositions.)
    let old = set_interrupt_handlers([libc::SIG_IGN, libc::SIG_IGN]);
    // SIGTERM or SIGHUP for `vrdma run` (a service manager, `kill`) goes
    // on to the program, and the cleanup below still runs.
    let pidfd = rustix::process::Pid::from_raw(child.id() as i32)
        .and_then(|p| rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok());
    if let Some(fd) = &pidfd {
        CHILD_PIDFD.store(std::os::fd::AsRawFd::as_raw_fd(fd), std::sync::atomic::Ordering::SeqCst);
        let early = PENDING.swap(0, std::sync::atomic::Ordering::SeqCst);
        if early != 0 {
            forward(early);
        }
    }
    let status = child.wait();
    set_termination_handlers(old_term);
    CHILD_PIDFD.store(-1, std::sync::atomic::Ordering::SeqCst);
    PENDING.store(0, std::sync::atomic::Ordering::SeqCst);
    drop(pidfd);
    set_interrupt_handlers(old);
    let status = status.context("waiting for the program")?;
    drop(device);
    drop(dir);
    Ok(status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sockets_library_is_preloaded_first() {
        let lib = Path::new("/opt/v/libvrdma_sockets.so");
        assert_eq!(preload_with(lib, None).unwrap(), "/opt/v/libvrdma_sockets.so");
        assert_eq!(preload_with(lib, Some("".into())).unwrap(), "/opt/v/libvrdma_sockets.so");
        assert_eq!(preload_with(lib, Some("/x/a.so".into())).unwrap(), "/opt/v/libvrdma_sockets.so:/x/a.so");
        assert!(preload_with(Path::new("/a b/l.so"), None).is_err());
        assert!(preload_with(Path::new("/a:b/l.so"), None).is_err());
    }

    /// A drop-in library is current only if it carries this build's id:
    /// one of another build, or one without an id, is stale, and the
    /// error says so and how to rebuild it.
    #[test]
    fn a_drop_in_library_of_another_build_is_stale() {
        let dir = std::env::temp_dir().join(format!("vrdma-build-id-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let lib = dir.join("libvrdma_verbs.so");
        let with = |body: &[u8]| {
            let mut bytes = b"\x7fELF....".to_vec();
            bytes.extend_from_slice(body);
            bytes.extend_from_slice(b"\0more");
            std::fs::write(&lib, bytes).unwrap();
            check_build_id(&lib)
        };
        assert!(with(vrdma::BUILD_ID.as_bytes()).is_ok(), "this build's id");
        let other = format!("VRDMA-BUILD-ID:{}", "0".repeat(vrdma::build_id().len()));
        assert_ne!(other, vrdma::BUILD_ID);
        let e = format!("{:#}", with(other.as_bytes()).unwrap_err());
        assert!(e.contains("is stale") && e.contains("cargo build"), "{e}");
        let e = format!("{:#}", with(b"no marker").unwrap_err());
        assert!(e.contains("carries no vRDMA build id"), "{e}");
        assert!(with(b"VRDMA-BUILD-ID:12").is_err(), "a marker cut short");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The library as cargo builds it next to this test carries the id of
    /// its own build: a library built from these sources is current.
    #[test]
    fn the_marker_is_in_every_binary_that_links_the_library() {
        let exe = std::env::current_exe().unwrap();
        let bytes = std::fs::read(exe).unwrap();
        let mark = vrdma::BUILD_ID.as_bytes();
        assert!(bytes.windows(mark.len()).any(|w| w == mark), "no {} in the test binary", vrdma::BUILD_ID);
    }
}
