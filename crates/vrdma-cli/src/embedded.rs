//! The embedded default: use the daemon that runs, or start one in-process.
//!
//! A benchmark or demo must work on a fresh machine with nothing set up.
//! If no daemon answers on the socket, we start one inside this process on
//! a private socket, point `VRDMA_SOCKET` at it for the processes we spawn,
//! and stop it when done.

use std::path::{Path, PathBuf};

use anyhow::Result;

pub enum Device {
    External(PathBuf),
    Embedded { daemon: vrdmad::Daemon, _dir: PathBuf },
}

impl Device {
    pub fn socket(&self) -> &Path {
        match self {
            Device::External(p) => p,
            Device::Embedded { daemon, .. } => daemon.socket_path(),
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        if let Device::Embedded { _dir, .. } = self {
            let _ = std::fs::remove_dir_all(_dir);
        }
    }
}

fn answers(path: &Path) -> bool {
    vrdma::Context::open_at(path).is_ok()
}

/// The daemon at `socket` (or the default path) if one answers, else a new
/// one in this process.
pub fn device(socket: Option<PathBuf>, engine: vrdmad::EngineConfig) -> Result<Device> {
    let path = socket.unwrap_or_else(vrdmad::default_socket_path);
    if answers(&path) {
        tracing::info!(socket = %path.display(), "using the running daemon");
        return Ok(Device::External(path));
    }
    let dir = std::env::temp_dir().join(format!("vrdma-embedded-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let sock = dir.join("vrdma.sock");
    let config = vrdmad::DaemonConfig { socket: Some(sock.clone()), engine, ..Default::default() };
    let daemon = vrdmad::Daemon::start(config)?;
    tracing::info!(socket = %sock.display(), "no daemon running: started one in this process");
    Ok(Device::Embedded { daemon, _dir: dir })
}
