//! Which accelerator runs the guest: `VRDMA_GUEST_ACCEL=kvm|tcg|auto`
//! (default auto).
//!
//! Auto tries KVM once, where `/dev/kvm` opens for reading and writing,
//! by booting the image with a short deadline, and remembers the answer
//! in the cache directory (one file per guest kernel release), so later
//! boots do not pay for a KVM that hangs. Where `/dev/kvm` is served by
//! `kvm_pvm` alone (PVM, the "Pagetable-based Virtual Machine" some
//! cloud sandboxes run KVM on, with no hardware virtualisation under
//! it), auto does not probe at all: PVM runs only guest kernels built
//! for it, and a stock Debian kernel spins in its decompressor (bzImage)
//! or stalls right after its first lines (PVH entry), so the probe could
//! only burn its deadline. Otherwise TCG, QEMU's emulator, which boots
//! the cloud kernel in seconds.

use std::time::Duration;

use crate::{cache, Error, Result};

pub const ACCEL_ENV: &str = "VRDMA_GUEST_ACCEL";
/// How long the KVM probe waits for the guest's shell.
pub const PROBE_DEADLINE: Duration = Duration::from_secs(20);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    pub fn name(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }

    pub fn parse(s: &str) -> Option<Accel> {
        match s {
            "kvm" => Some(Accel::Kvm),
            "tcg" => Some(Accel::Tcg),
            _ => None,
        }
    }
}

/// What the caller asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    Fixed(Accel),
    Auto,
}

/// `VRDMA_GUEST_ACCEL`, read.
pub fn choice() -> Result<Choice> {
    match std::env::var(ACCEL_ENV).as_deref() {
        Err(_) | Ok("") | Ok("auto") => Ok(Choice::Auto),
        Ok(s) => Accel::parse(s)
            .map(Choice::Fixed)
            .ok_or_else(|| Error::Invalid(format!("{ACCEL_ENV}={s}: say kvm, tcg or auto"))),
    }
}

/// Whether this process may use KVM at all.
pub fn kvm_usable() -> bool {
    std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm").is_ok()
}

/// Why KVM cannot run a stock guest here although `/dev/kvm` opens, if
/// the loaded modules say so: `kvm_pvm` without `kvm_amd` or `kvm_intel`.
pub fn kvm_unsuitable() -> Option<String> {
    unsuitable_with(|m| std::path::Path::new("/sys/module").join(m).exists())
}

fn unsuitable_with(loaded: impl Fn(&str) -> bool) -> Option<String> {
    let hardware = loaded("kvm_amd") || loaded("kvm_intel");
    (loaded("kvm_pvm") && !hardware).then(|| {
        "/dev/kvm is kvm_pvm (Pagetable-based Virtual Machine, no hardware virtualisation), \
         which boots only guest kernels built for PVM, not the stock cloud kernel"
            .to_string()
    })
}

/// The remembered outcome of the KVM probe for a kernel release, if any.
pub fn remembered(release: &str) -> Result<Option<(Accel, String)>> {
    let p = cache::dir()?.join(format!("accel-{release}"));
    let Ok(text) = std::fs::read_to_string(&p) else { return Ok(None) };
    let (a, why) = text.split_once('\n').unwrap_or((text.as_str(), ""));
    Ok(Accel::parse(a.trim()).map(|a| (a, why.trim().to_string())))
}

/// Remembers the probe's outcome.
pub fn remember(release: &str, a: Accel, why: &str) -> Result<()> {
    let p = cache::dir()?.join(format!("accel-{release}"));
    std::fs::write(&p, format!("{}\n{why}\n", a.name())).map_err(|e| Error::path("write", &p, e))
}

/// An exclusive lock on the probe (`flock` on a file in the cache
/// directory), held until dropped.
pub fn lock() -> Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    let p = cache::dir()?.join("accel.lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&p)
        .map_err(|e| Error::path("open", &p, e))?;
    loop {
        // SAFETY: flock on a descriptor this function owns (through `f`).
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0 {
            return Ok(f);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::path("lock", &p, e));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::unsuitable_with;

    #[test]
    fn pvm_alone_rules_kvm_out_and_hardware_kvm_does_not() {
        assert!(unsuitable_with(|m| m == "kvm_pvm" || m == "kvm").is_some());
        assert!(unsuitable_with(|m| m == "kvm_amd" || m == "kvm").is_none());
        assert!(unsuitable_with(|m| m == "kvm_intel" || m == "kvm_pvm").is_none());
        assert!(unsuitable_with(|_| false).is_none());
    }
}
