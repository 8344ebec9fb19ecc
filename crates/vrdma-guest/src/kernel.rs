//! The guest's kernel: Debian's cloud kernel package, fetched with
//! `apt-get download` and extracted with `dpkg-deb -x` into the cache,
//! never installed.
//!
//! Which package: `VRDMA_GUEST_KERNEL` if set (a package name such as
//! `linux-image-6.1.0-56-cloud-amd64`), else the one the metapackage
//! `linux-image-cloud-amd64` depends on, as `apt-cache depends` says. The
//! cloud flavour boots fastest (no drivers for hardware a VM lacks) and
//! has virtio as modules and PCI built in. Where the download fails (no
//! network) but the same kernel is installed on the host, that one is
//! used, with a warning.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{cache, Error, Result};

pub const KERNEL_ENV: &str = "VRDMA_GUEST_KERNEL";
const METAPACKAGE: &str = "linux-image-cloud-amd64";
const PREFIX: &str = "linux-image-";

/// An extracted kernel.
#[derive(Clone, Debug)]
pub struct Kernel {
    /// The kernel release (`uname -r` in the guest).
    pub release: String,
    /// The bootable image.
    pub vmlinuz: PathBuf,
    /// `lib/modules/<release>`.
    pub modules: PathBuf,
}

/// Runs a host tool, returning its stdout or its failure.
pub(crate) fn tool(cmd: &mut Command) -> Result<String> {
    let shown = format!("{cmd:?}");
    let out = cmd.output().map_err(|e| Error::io(format!("run {shown}"), e))?;
    if !out.status.success() {
        return Err(Error::Tool {
            command: shown,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The kernel package to use (see the module documentation).
pub fn package() -> Result<String> {
    if let Ok(p) = std::env::var(KERNEL_ENV) {
        return check_name(p.trim());
    }
    let text = tool(Command::new("apt-cache").args(["depends", METAPACKAGE]))?;
    let dep = parse_depends(&text).ok_or_else(|| {
        Error::Invalid(format!("apt-cache depends {METAPACKAGE} names no {PREFIX}* package:\n{text}"))
    })?;
    check_name(&dep)
}

/// The first `Depends: linux-image-...` line of `apt-cache depends`.
fn parse_depends(text: &str) -> Option<String> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("Depends:"))
        .map(str::trim)
        .find(|p| p.starts_with(PREFIX))
        .map(str::to_string)
}

fn check_name(p: &str) -> Result<String> {
    let ok = p.starts_with(PREFIX)
        && p.len() > PREFIX.len()
        && p.bytes().all(|b| b.is_ascii_alphanumeric() || b"-.+_".contains(&b));
    if ok {
        Ok(p.to_string())
    } else {
        Err(Error::Invalid(format!("{p:?} is not a {PREFIX}* package name")))
    }
}

/// The kernel, fetched and extracted if the cache lacks it.
pub fn get() -> Result<Kernel> {
    let pkg = package()?;
    let release = pkg[PREFIX.len()..].to_string();
    let dest = cache::dir()?.join("kernel").join(&pkg);
    let fetched = cache::publish(&dest, |tmp| fetch(&pkg, tmp));
    let root = match fetched {
        Ok(root) => root,
        Err(e) => {
            let host = Kernel {
                release: release.clone(),
                vmlinuz: PathBuf::from(format!("/boot/vmlinuz-{release}")),
                modules: PathBuf::from(format!("/lib/modules/{release}")),
            };
            if host.vmlinuz.is_file() && host.modules.join("kernel").is_dir() {
                tracing::warn!("fetching {pkg} failed ({e}); using the host's installed copy");
                return Ok(host);
            }
            return Err(e);
        }
    };
    let vmlinuz = root.join("boot").join(format!("vmlinuz-{release}"));
    let modules = ["lib", "usr/lib"]
        .iter()
        .map(|l| root.join(l).join("modules").join(&release))
        .find(|m| m.is_dir())
        .ok_or_else(|| Error::Invalid(format!("{pkg} has no lib/modules/{release} ({})", root.display())))?;
    if !vmlinuz.is_file() {
        return Err(Error::Invalid(format!("{pkg} has no {}", vmlinuz.display())));
    }
    Ok(Kernel { release, vmlinuz, modules })
}

/// Downloads `pkg` into `dir` and extracts it there.
fn fetch(pkg: &str, dir: &Path) -> Result<()> {
    tracing::info!("downloading {pkg} with apt-get download");
    tool(Command::new("apt-get").args(["download", "-qq", pkg]).current_dir(dir))?;
    let deb = std::fs::read_dir(dir)
        .map_err(|e| Error::path("read", dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or_else(|| Error::Invalid(format!("apt-get download {pkg} left no .deb in {}", dir.display())))?;
    tool(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(dir))?;
    std::fs::remove_file(&deb).map_err(|e| Error::path("remove", &deb, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metapackages_dependency_is_read_and_names_are_checked() {
        let text = "linux-image-cloud-amd64\n  Depends: linux-image-6.1.0-56-cloud-amd64\n";
        assert_eq!(parse_depends(text).as_deref(), Some("linux-image-6.1.0-56-cloud-amd64"));
        assert_eq!(parse_depends("x\n  Depends: <virtual>\n"), None);
        assert!(check_name("linux-image-6.1.0-56-cloud-amd64").is_ok());
        assert!(check_name("linux-image-").is_err());
        assert!(check_name("linux-image-x; rm -rf /").is_err());
        assert!(check_name("bash").is_err());
    }
}
