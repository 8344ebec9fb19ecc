//! Guest mode: the library inside a QEMU guest, with no kernel module.
//!
//! Inside a VM the daemon is reached through a virtio-serial port (a byte
//! stream: no descriptors can pass) and the memory it shares is the VM's
//! ivshmem BAR, which the library maps from user space (`docs/vms.md`).
//! This module is the guest's end of that transport:
//!
//! - which port and BAR to use ([`GuestConfig`]): `VRDMA_GUEST_PORT` and
//!   `VRDMA_GUEST_BAR` when set (a host test emulates a guest with the
//!   VM's port socket and its region memfd as `/proc/self/fd/N`), else,
//!   when no host daemon's socket is there, the ports named `org.vrdma.K`
//!   in `/sys/class/virtio-ports` and `resource2` of the ivshmem PCI
//!   device (`1af4:1110`);
//! - a [`GuestLink`] per context: one port, one session. Requests go out
//!   as frames ([`vrdma_core::proto::guest`]); a thread reads the port,
//!   hands replies to the caller, answers the daemon's pings, and proxies
//!   doorbells: for each descriptor the daemon would have passed, it makes
//!   a local socket pair, gives one end to the rest of the library (which
//!   polls it as it would the daemon's) and forwards wake-ups between the
//!   other end and the port ([`link`]);
//! - taking the context back when the VM moved to another host
//!   ([`reattach`]): the daemon the context left says so on the port
//!   ([`vrdma_core::proto::guest::EndReason`]), and the link reopens the
//!   port, adopts the context on the daemon it now reaches, and rebinds
//!   the context's doorbells under the application's live handles.

mod link;
mod reattach;
#[cfg(test)]
mod reattach_tests;

pub(crate) use link::{GuestLink, MovedCmChannel};

use std::path::{Path, PathBuf};
use std::time::Duration;

/// The port to open (a character device or, to emulate a guest on the
/// host, a Unix stream socket).
pub const PORT_ENV: &str = "VRDMA_GUEST_PORT";
/// The BAR to map (sysfs `resource2`, or a region memfd as
/// `/proc/self/fd/N`).
pub const BAR_ENV: &str = "VRDMA_GUEST_BAR";
/// The virtio-serial port names QEMU is given (`org.vrdma.K`).
const PORT_NAME_PREFIX: &str = "org.vrdma.";

/// How long (milliseconds) a context that moved waits to be taken back
/// on the destination, and calls that need the daemon wait meanwhile
/// (default [`REATTACH_LIMIT`]); after it the device is gone.
pub const REATTACH_ENV: &str = "VRDMA_GUEST_REATTACH_MS";
/// [`REATTACH_ENV`]'s default.
pub const REATTACH_LIMIT: Duration = Duration::from_secs(30);

/// The bound on taking a moved context back: [`REATTACH_ENV`], else
/// [`REATTACH_LIMIT`].
fn reattach_limit() -> Duration {
    std::env::var(REATTACH_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(REATTACH_LIMIT, Duration::from_millis)
}

/// Where guest mode finds its port(s) and BAR.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestConfig {
    /// Tried in order until one opens (a virtio port is exclusive).
    pub ports: Vec<PathBuf>,
    pub bar: PathBuf,
}

impl GuestConfig {
    /// From `VRDMA_GUEST_PORT` and `VRDMA_GUEST_BAR`, when both are set.
    pub fn from_env() -> Option<GuestConfig> {
        let port = std::env::var_os(PORT_ENV)?;
        let bar = std::env::var_os(BAR_ENV)?;
        Some(GuestConfig { ports: vec![port.into()], bar: bar.into() })
    }

    /// The vRDMA ports and ivshmem BAR of this machine, if it is a guest
    /// QEMU gave them to.
    pub fn detect() -> Option<GuestConfig> {
        detect_in(Path::new("/sys"), Path::new("/dev"))
    }
}

/// What a scan of `/sys` found: vRDMA's ports (in order of K) and the
/// ivshmem BAR, each possibly absent.
fn scan_in(sys: &Path, dev: &Path) -> (Vec<PathBuf>, Option<PathBuf>) {
    let mut ports: Vec<(u32, PathBuf)> = std::fs::read_dir(sys.join("class/virtio-ports"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    let name = std::fs::read_to_string(e.path().join("name")).ok()?;
                    let k: u32 = name.trim().strip_prefix(PORT_NAME_PREFIX)?.parse().ok()?;
                    Some((k, dev.join(e.file_name())))
                })
                .collect()
        })
        .unwrap_or_default();
    ports.sort();
    let bar = std::fs::read_dir(sys.join("bus/pci/devices")).ok().and_then(|d| {
        d.flatten().find_map(|e| {
            let read = |f: &str| std::fs::read_to_string(e.path().join(f)).map(|s| s.trim().to_string());
            (read("vendor").ok()? == "0x1af4" && read("device").ok()? == "0x1110")
                .then(|| e.path().join("resource2"))
        })
    });
    (ports.into_iter().map(|(_, p)| p).collect(), bar)
}

/// [`GuestConfig::detect`] under other roots (for tests).
fn detect_in(sys: &Path, dev: &Path) -> Option<GuestConfig> {
    match scan_in(sys, dev) {
        (ports, Some(bar)) if !ports.is_empty() => Some(GuestConfig { ports, bar }),
        _ => None,
    }
}

/// [`GuestConfig::missing_part`] under other roots (for tests).
fn missing_part_in(sys: &Path, dev: &Path) -> Option<String> {
    match scan_in(sys, dev) {
        (ports, None) if !ports.is_empty() => Some(format!(
            "this VM has vRDMA's ports ({}) but no ivshmem device (PCI 1af4:1110) whose BAR holds \
             the VM's memory: QEMU needs the -object memory-backend-file and -device ivshmem-plain \
             arguments `vrdma vm args` prints",
            ports.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        )),
        (ports, Some(bar)) if ports.is_empty() => Some(format!(
            "this VM has an ivshmem device ({}) but no virtio-serial port named {PORT_NAME_PREFIX}K \
             in /sys/class/virtio-ports: QEMU needs the virtio-serial arguments `vrdma vm args` \
             prints, and the guest the virtio_console module",
            bar.display()
        )),
        _ => None,
    }
}

impl GuestConfig {
    /// Where this machine has part of a guest's vRDMA device only (its
    /// ports without the ivshmem BAR, or the BAR without ports), what is
    /// missing and how to fix it: [`GuestConfig::detect`] finds nothing
    /// there, and a program that would otherwise start a daemon of its
    /// own (which nothing outside the VM could reach) should say this
    /// instead. `None` where it has all of it or none.
    pub fn missing_part() -> Option<String> {
        missing_part_in(Path::new("/sys"), Path::new("/dev"))
    }

    /// Whether the BAR and at least one port are there (a check before
    /// handing the configuration to a program; opening one would take a
    /// port for a moment): what is missing, else `Ok`.
    pub fn check(&self) -> std::result::Result<(), String> {
        if !self.bar.exists() {
            return Err(format!("the VM's BAR {} is not there", self.bar.display()));
        }
        if !self.ports.iter().any(|p| p.exists()) {
            let names: Vec<String> = self.ports.iter().map(|p| p.display().to_string()).collect();
            return Err(format!("no vRDMA port of the VM is there ({})", names.join(", ")));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_named_ports_in_order_and_the_ivshmem_bar() {
        let d = tempfile_dir();
        let sys = d.join("sys");
        for (entry, name) in
            [("vport1p3", "org.vrdma.1"), ("vport1p2", "org.vrdma.0"), ("vport1p1", "org.qemu.guest_agent.0")]
        {
            let p = sys.join("class/virtio-ports").join(entry);
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join("name"), format!("{name}\n")).unwrap();
        }
        for (dev, vendor, device) in
            [("0000:00:03.0", "0x1af4", "0x1003"), ("0000:00:04.0", "0x1af4", "0x1110")]
        {
            let p = sys.join("bus/pci/devices").join(dev);
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join("vendor"), format!("{vendor}\n")).unwrap();
            std::fs::write(p.join("device"), format!("{device}\n")).unwrap();
        }
        let c = detect_in(&sys, Path::new("/dev")).unwrap();
        assert_eq!(c.ports, vec![PathBuf::from("/dev/vport1p2"), PathBuf::from("/dev/vport1p3")]);
        assert_eq!(c.bar, sys.join("bus/pci/devices/0000:00:04.0/resource2"));
        assert_eq!(detect_in(&d.join("none"), Path::new("/dev")), None);
        assert_eq!(missing_part_in(&sys, Path::new("/dev")), None);
        assert_eq!(missing_part_in(&d.join("none"), Path::new("/dev")), None);
        // The BAR without ports, then ports without the BAR.
        std::fs::remove_dir_all(sys.join("class")).unwrap();
        assert_eq!(detect_in(&sys, Path::new("/dev")), None);
        let why = missing_part_in(&sys, Path::new("/dev")).unwrap();
        assert!(why.contains("no virtio-serial port named org.vrdma.K"), "{why}");
        std::fs::remove_dir_all(sys.join("bus")).unwrap();
        let p = sys.join("class/virtio-ports/vport1p2");
        std::fs::create_dir_all(&p).unwrap();
        std::fs::write(p.join("name"), "org.vrdma.0\n").unwrap();
        assert_eq!(detect_in(&sys, Path::new("/dev")), None);
        let why = missing_part_in(&sys, Path::new("/dev")).unwrap();
        assert!(why.contains("/dev/vport1p2") && why.contains("no ivshmem device"), "{why}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("vrdma-guest-detect-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
