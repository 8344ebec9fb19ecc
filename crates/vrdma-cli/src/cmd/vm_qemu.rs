//! What `vrdma vm migrate|savevm|loadvm` ask of a QEMU before they act:
//! its QMP connection, and whether it is the VM they were named.
//!
//! Those commands pair QEMU's step (migrate, savevm, loadvm) with the
//! daemon's step for VM NAME's tenant. Given the QMP socket of another
//! QEMU by mistake, they would move or snapshot one VM's vRDMA state
//! beside another VM's memory: the VM that runs on would find a device
//! state that is not its own, and the right VM's would be gone. So they
//! first check that the QEMU runs VM NAME of that daemon: one of its
//! chardevs is connected to the port socket the daemon keeps for NAME
//! (`vrdma vm run` connects them so; `query-chardev` lists them, and a
//! connected client socket's address is its QOM property `addr`), and
//! refuse before any step where none is.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use vrdma_guest::qmp::Qmp;

/// How long a QMP socket may take to accept: the QEMUs run already.
const QMP_CONNECT: Duration = Duration::from_secs(5);

/// Connects to `whose` QEMU's QMP socket at `path` ("the source's", ...).
pub fn qmp(path: &Path, whose: &str) -> Result<Qmp> {
    Qmp::connect_within(path, QMP_CONNECT).with_context(|| {
        format!("{whose} QEMU's QMP socket {} (QEMU's `-qmp unix:PATH,server=on,wait=off`)", path.display())
    })
}

/// Fails unless the QEMU behind `q` (QMP socket `qmp_path`, `whose` in
/// messages) runs VM `name` of the daemon at `daemon`.
pub fn check_runs_vm(q: &mut Qmp, qmp_path: &Path, whose: &str, daemon: &Path, name: &str) -> Result<()> {
    let port = vrdma::vm::attach_at(daemon, name)
        .with_context(|| format!("VM {name:?} at the daemon at {}", daemon.display()))?
        .port_socket;
    let chardevs =
        q.exec(r#"{"execute":"query-chardev"}"#).with_context(|| format!("{whose} QEMU's chardevs"))?;
    let files: Vec<(String, String)> = chardevs
        .as_array()
        .map(|a| {
            a.iter()
                .map(|c| {
                    let s = |k: &str| c[k].as_str().unwrap_or_default().to_string();
                    (s("label"), s("filename"))
                })
                .collect()
        })
        .unwrap_or_default();
    let mut listed = Vec::new();
    for (label, file) in &files {
        let Some(path) = unix_path(file) else {
            listed.push(format!("{label}={file}"));
            continue;
        };
        // A connected client socket's filename names no path (`unix:`,
        // its local end's): its address is the chardev's `addr`.
        let path = match path.is_empty() {
            false => path.to_string(),
            true => {
                let get = serde_json::json!({"execute": "qom-get",
                    "arguments": {"path": format!("/chardevs/{label}"), "property": "addr"}});
                match q.exec(&get.to_string()) {
                    Ok(addr) => addr["path"].as_str().unwrap_or_default().to_string(),
                    Err(_) => continue,
                }
            }
        };
        if same_path(Path::new(&path), &port) {
            return Ok(());
        }
        listed.push(format!("{label}=unix:{path}"));
    }
    bail!(
        "{whose} QEMU ({}) does not run VM {name:?} of the daemon at {}: none of its chardevs is connected \
         to the VM's port socket {} (its chardevs: {}); nothing was done",
        qmp_path.display(),
        daemon.display(),
        port.display(),
        if listed.is_empty() { "none".to_string() } else { listed.join(", ") }
    )
}

/// The socket path of a chardev's `filename` as `query-chardev` shows a
/// Unix socket's (`unix:PATH,server=on` for a listener,
/// `disconnected:unix:PATH` for a client not connected, and `unix:`, no
/// path, for a connected client: then empty).
fn unix_path(filename: &str) -> Option<&str> {
    let f = filename.strip_prefix("disconnected:").unwrap_or(filename);
    let p = f.strip_prefix("unix:")?;
    Some(p.split(',').next().unwrap_or(p))
}

fn same_path(a: &Path, b: &Path) -> bool {
    a == b || matches!((a.canonicalize(), b.canonicalize()), (Ok(x), Ok(y)) if x == y)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_unix_chardev_filenames() {
        assert_eq!(unix_path("unix:/run/vrdma/vm-t.sock"), Some("/run/vrdma/vm-t.sock"));
        assert_eq!(unix_path("disconnected:unix:/run/x.sock"), Some("/run/x.sock"));
        assert_eq!(unix_path("unix:/run/x.sock,server=on"), Some("/run/x.sock"));
        assert_eq!(unix_path("unix:"), Some(""));
        assert_eq!(unix_path("pty:/dev/pts/3"), None);
        assert_eq!(unix_path("stdio"), None);
    }
}
