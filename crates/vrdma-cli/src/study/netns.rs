//! Network namespaces joined by veth pairs, as the integration tests make
//! them (crates/vrdma-it): `ip netns add`, a veth pair with one end in
//! each, an address on each end, `lo` up. Everything is deleted on drop;
//! the veth ends live in the namespaces and go with them.

use std::net::Ipv4Addr;
use std::path::PathBuf;

use anyhow::Result;

use super::proc::run_cmd;

/// The prefix of the study's namespace names: `vrdma-study-PID-TAG`.
pub const PREFIX: &str = "vrdma-study-";

/// Namespaces made by this run, deleted on drop.
#[derive(Default)]
pub struct Namespaces {
    names: Vec<String>,
}

/// Two namespaces joined by a veth pair.
#[derive(Debug, Clone)]
pub struct Pair {
    /// `/run/netns/NAME` of each end.
    pub path: [PathBuf; 2],
    pub addr: [Ipv4Addr; 2],
}

impl Namespaces {
    /// Makes namespaces `TAG-a` and `TAG-b` joined by veth, with the
    /// addresses 10.78.SUBNET.1/24 and .2/24.
    pub fn pair(&mut self, tag: &str, subnet: u8) -> Result<Pair> {
        let pid = std::process::id();
        let ns = [format!("{PREFIX}{pid}-{tag}-a"), format!("{PREFIX}{pid}-{tag}-b")];
        // Interface names have at most 15 bytes: "vs" + pid (at most 7) + tag.
        let veth = [format!("vs{pid}{tag}a"), format!("vs{pid}{tag}b")];
        let addr = [Ipv4Addr::new(10, 78, subnet, 1), Ipv4Addr::new(10, 78, subnet, 2)];
        for n in &ns {
            run_cmd(&["ip", "netns", "add", n])?;
            self.names.push(n.clone());
        }
        let made = run_cmd(&["ip", "link", "add", &veth[0], "type", "veth", "peer", "name", &veth[1]]);
        made?;
        let setup = || -> Result<()> {
            for i in 0..2 {
                run_cmd(&["ip", "link", "set", &veth[i], "netns", &ns[i]])?;
                run_cmd(&["ip", "-n", &ns[i], "addr", "add", &format!("{}/24", addr[i]), "dev", &veth[i]])?;
                run_cmd(&["ip", "-n", &ns[i], "link", "set", &veth[i], "up"])?;
                run_cmd(&["ip", "-n", &ns[i], "link", "set", "lo", "up"])?;
            }
            Ok(())
        };
        if let Err(e) = setup() {
            // An end still in our namespace would outlive the namespaces.
            let _ = run_cmd(&["ip", "link", "del", &veth[0]]);
            return Err(e);
        }
        Ok(Pair { path: ns.clone().map(|n| PathBuf::from(format!("/run/netns/{n}"))), addr })
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for n in self.names.drain(..) {
            if let Err(e) = run_cmd(&["ip", "netns", "del", &n]) {
                eprintln!("vrdma study: could not delete namespace {n}: {e:#}");
            }
        }
    }
}

/// Deletes namespaces left by study runs whose process is gone (killed
/// before it could clean up). Returns how many.
pub fn remove_stale() -> usize {
    let Ok(dir) = std::fs::read_dir("/run/netns") else { return 0 };
    let mut removed = 0;
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(rest) = name.strip_prefix(PREFIX) else { continue };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else { continue };
        if std::path::Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        if run_cmd(&["ip", "netns", "del", &name]).is_ok() {
            removed += 1;
        }
    }
    removed
}
