//! The embedded default: use the daemon that runs, or start one in-process.
//!
//! A benchmark or demo must work on a fresh machine with nothing set up.
//! If no daemon answers on the socket, we start one inside this process on
//! that socket (or, if we may not create it, on a private one that the
//! processes we spawn are pointed at), and stop it when done. Programs
//! that outlive this one need a daemon of their own: `vrdma daemon`.

use std::path::{Path, PathBuf};

use anyhow::Result;

pub enum Device {
    External(PathBuf),
    /// A daemon in this process; `_dir` is the private directory of its
    /// socket when it could not serve on the shared path.
    Embedded {
        daemon: Box<vrdmad::Daemon>,
        _dir: Option<PathBuf>,
    },
}

impl Device {
    pub fn socket(&self) -> &Path {
        match self {
            Device::External(p) => p,
            Device::Embedded { daemon, .. } => daemon.socket_path(),
        }
    }
}

/// Opens contexts on a device: a daemon's socket, or a guest's ports.
#[derive(Clone, Debug)]
pub enum Opener {
    Socket(PathBuf),
    Guest(vrdma::guest::GuestConfig),
}

impl Opener {
    pub fn open(&self) -> vrdma::Result<vrdma::Context> {
        match self {
            Opener::Socket(p) => vrdma::Context::open_at(p),
            Opener::Guest(cfg) => vrdma::Context::open_guest(cfg),
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        if let Device::Embedded { _dir: Some(dir), .. } = self {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn answers(path: &Path) -> bool {
    vrdma::Context::open_at(path).is_ok()
}

/// In a QEMU guest given vRDMA's ports and region (`docs/vms.md`), when
/// no socket is named and none is at the default path: the guest's
/// device, as [`vrdma::Context::open`] finds it. A program that would
/// start an embedded daemon asks this first: a daemon inside the guest
/// would be a device no other VM or host could reach. A VM with part of
/// the device only (its ports without the ivshmem BAR, or the reverse)
/// is an error saying what is missing, rather than a daemon of its own.
pub fn guest(socket: Option<&Path>) -> Result<Option<vrdma::guest::GuestConfig>> {
    if socket.is_some() {
        return Ok(None);
    }
    if let Some(cfg) = vrdma::guest::GuestConfig::from_env() {
        return Ok(Some(cfg));
    }
    if vrdmad::default_socket_path().exists() {
        return Ok(None);
    }
    let Some(cfg) = vrdma::guest::GuestConfig::detect() else {
        if let Some(why) = vrdma::guest::GuestConfig::missing_part() {
            anyhow::bail!("vRDMA's device in this VM is incomplete: {why}");
        }
        return Ok(None);
    };
    tracing::info!("in a VM with vRDMA's ports: using the host's daemon through them");
    Ok(Some(cfg))
}

/// Refuses a host operator's command (`vrdma vm run`/`args`, `vrdma
/// migrate`, `vrdma daemon` on the default socket) in a QEMU guest that
/// has vRDMA's device, when no daemon socket is named (`--socket`,
/// `VRDMA_SOCKET`, a daemon config's `socket`) and none is at the default
/// path: the VM's device is the host's daemon, which these commands
/// cannot reach from inside (its control socket is the host's), and a
/// daemon started in the guest on the default path would hide that
/// device from the guest's programs, which would then see only the
/// guest's own daemon. `what` names the command; `hint` says what to do.
pub fn host_only(what: &str, socket: Option<&Path>, hint: &str) -> Result<()> {
    if socket.is_some() || vrdmad::default_socket_path().exists() {
        return Ok(());
    }
    let Some(cfg) = vrdma::guest::GuestConfig::from_env().or_else(vrdma::guest::GuestConfig::detect) else {
        return Ok(());
    };
    anyhow::bail!(
        "`vrdma {what}` is the host operator's command, and this is a QEMU guest whose vRDMA device is \
         the host's daemon (BAR {}): {hint}",
        cfg.bar.display()
    )
}

/// A context on the device: the VM's (through its ports, see [`guest`])
/// where this is a guest, else the daemon's at `socket` or the default
/// path; for the commands that only ask the device (`vrdma stat`,
/// `vrdma devinfo`). The error says where it looked.
pub fn open_existing(socket: Option<PathBuf>) -> Result<vrdma::Context> {
    use anyhow::Context as _;
    if let Some(cfg) = guest(socket.as_deref())? {
        let names: Vec<String> = cfg.ports.iter().map(|p| p.display().to_string()).collect();
        return vrdma::Context::open_guest(&cfg).with_context(|| {
            format!(
                "the host's vRDMA daemon does not answer through this VM's ports ({}; BAR {})",
                names.join(", "),
                cfg.bar.display()
            )
        });
    }
    let path = socket.unwrap_or_else(vrdmad::default_socket_path);
    vrdma::Context::open_at(&path).with_context(|| {
        format!(
            "no vRDMA daemon answers on {}; start one with `vrdma daemon` (nor is this a VM with \
             vRDMA's ports)",
            path.display()
        )
    })
}

/// The daemon at `socket` (or the default path) if one answers, else a new
/// one in this process.
pub fn device(socket: Option<PathBuf>, engine: vrdmad::EngineConfig) -> Result<Device> {
    let path = socket.unwrap_or_else(vrdmad::default_socket_path);
    if answers(&path) {
        tracing::info!(socket = %path.display(), "using the running daemon");
        return Ok(Device::External(path));
    }
    // Serve on the path other programs look at, so that a second program
    // started meanwhile (the other side of a ping-pong) finds this daemon
    // instead of starting its own, which it could never reach.
    let config =
        vrdmad::DaemonConfig { socket: Some(path.clone()), engine: engine.clone(), ..Default::default() };
    match vrdmad::Daemon::start(config) {
        Ok(daemon) => {
            tracing::info!(socket = %path.display(), "no daemon running: started one in this process");
            return Ok(Device::Embedded { daemon: Box::new(daemon), _dir: None });
        }
        Err(vrdmad::DaemonError::Bind { source, .. }) if source.kind() == std::io::ErrorKind::AddrInUse => {
            // Another program won the race to start one: use it.
            tracing::info!(socket = %path.display(), "using the daemon another program just started");
            return Ok(Device::External(path));
        }
        Err(e) => tracing::info!(error = %e, "cannot serve on the default socket; using a private one"),
    }
    let dir = std::env::temp_dir().join(format!("vrdma-embedded-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let sock = dir.join("vrdma.sock");
    let config = vrdmad::DaemonConfig { socket: Some(sock.clone()), engine, ..Default::default() };
    let daemon = vrdmad::Daemon::start(config)?;
    tracing::info!(socket = %sock.display(), "no daemon running: started one in this process");
    Ok(Device::Embedded { daemon: Box::new(daemon), _dir: Some(dir) })
}

/// A daemon of this process's own on a private socket, with the direct
/// path (`docs/direct-path.md`) switched as `direct` says, whatever
/// daemon runs elsewhere: for figures of one path beside the other's.
pub fn private_device(engine: vrdmad::EngineConfig, direct: bool) -> Result<Device> {
    private_device_with(engine, direct, "")
}

/// [`private_device`] configured by the daemon TOML `toml` besides (its
/// `[qos]` and `[tenants.UID]` tables, say).
pub fn private_device_with(engine: vrdmad::EngineConfig, direct: bool, toml: &str) -> Result<Device> {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("vrdma-private-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let sock = dir.join("vrdma.sock");
    let config = vrdmad::DaemonConfig {
        socket: Some(sock),
        engine,
        direct: vrdmad::DirectConfig { enabled: direct },
        ..vrdmad::DaemonConfig::from_toml(toml)?
    };
    let daemon = vrdmad::Daemon::start(config)?;
    Ok(Device::Embedded { daemon: Box::new(daemon), _dir: Some(dir) })
}
