//! The kernel modules the guest loads, with their dependencies.
//!
//! Debian's cloud kernel builds virtio, the virtio PCI transport and the
//! virtio console (which carries virtio-serial ports) as modules; PCI
//! (and so ivshmem's BAR in sysfs) is built in. The kernel package ships
//! no `modules.dep` (`depmod` writes it at install time, and the package
//! is never installed), so dependencies are read where depmod reads
//! them: the `depends=` entry of each module's `.modinfo` ELF section.
//! Modules compressed as `.ko.xz` or `.ko.zst` are decompressed with the
//! host's `xz`/`zstd`, since busybox's `insmod` may not do it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// What the guest needs: virtio-serial ports over PCI, and a virtio NIC
/// (for the out-of-band TCP exchange of verbs programs such as
/// `ibv_rc_pingpong`, over QEMU's user network when one is given).
pub const WANTED: [&str; 3] = ["virtio_pci", "virtio_console", "virtio_net"];

/// Bounds on what is read: the module tree's depth and a dependency
/// chain's length.
const MAX_DEPTH: usize = 12;
const MAX_CHAIN: usize = 32;

/// A module's name as the kernel spells it: its file name without the
/// `.ko*` suffix, `-` read as `_`.
fn module_name(file: &str) -> Option<String> {
    let stem = file
        .strip_suffix(".ko")
        .or_else(|| file.strip_suffix(".ko.xz"))
        .or_else(|| file.strip_suffix(".ko.zst"))?;
    Some(stem.replace('-', "_"))
}

/// Every module under `root` (`lib/modules/<release>`), by name.
pub fn index(root: &Path) -> Result<HashMap<String, PathBuf>> {
    let mut out = HashMap::new();
    let mut stack = vec![(root.join("kernel"), 0usize)];
    while let Some((dir, depth)) = stack.pop() {
        let rd = std::fs::read_dir(&dir).map_err(|e| Error::path("read", &dir, e))?;
        for entry in rd {
            let entry = entry.map_err(|e| Error::path("read", &dir, e))?;
            let p = entry.path();
            let ft = entry.file_type().map_err(|e| Error::path("stat", &p, e))?;
            if ft.is_dir() && depth < MAX_DEPTH {
                stack.push((p, depth + 1));
            } else if let Some(name) = p.file_name().and_then(|n| n.to_str()).and_then(module_name) {
                out.insert(name, p);
            }
        }
    }
    Ok(out)
}

/// Names listed in `modules.builtin` (paths such as
/// `kernel/drivers/pci/foo.ko`): wanted modules built into the kernel
/// need no loading.
pub fn builtin(root: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(root.join("modules.builtin")).unwrap_or_default();
    text.lines().filter_map(|l| l.rsplit('/').next()).filter_map(module_name).collect()
}

/// A module's contents, decompressed.
pub fn load(p: &Path) -> Result<Vec<u8>> {
    let name = p.to_string_lossy();
    let tool = if name.ends_with(".ko.xz") {
        "xz"
    } else if name.ends_with(".ko.zst") {
        "zstd"
    } else {
        return std::fs::read(p).map_err(|e| Error::path("read", p, e));
    };
    let out = std::process::Command::new(tool)
        .arg("-dc")
        .arg(p)
        .output()
        .map_err(|e| Error::io(format!("run {tool} -dc {}", p.display()), e))?;
    if !out.status.success() {
        return Err(Error::Tool {
            command: format!("{tool} -dc {}", p.display()),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    Ok(out.stdout)
}

/// The modules of `wanted` and everything they depend on, dependencies
/// first (the order to `insmod` them in), each as (name, contents).
pub fn closure(root: &Path, wanted: &[&str]) -> Result<Vec<(String, Vec<u8>)>> {
    let idx = index(root)?;
    let builtin = builtin(root);
    let mut done: Vec<(String, Vec<u8>)> = Vec::new();
    for w in wanted {
        visit(w, &idx, &builtin, &mut done, 0)?;
    }
    Ok(done)
}

fn visit(
    name: &str,
    idx: &HashMap<String, PathBuf>,
    builtin: &[String],
    done: &mut Vec<(String, Vec<u8>)>,
    chain: usize,
) -> Result<()> {
    if done.iter().any(|(n, _)| n == name) || builtin.iter().any(|b| b == name) {
        return Ok(());
    }
    if chain > MAX_CHAIN {
        return Err(Error::Invalid(format!(
            "module dependencies deeper than {MAX_CHAIN} at {name} (a cycle?)"
        )));
    }
    let p = idx.get(name).ok_or_else(|| Error::Invalid(format!("the kernel has no module {name}")))?;
    let data = load(p)?;
    for dep in depends(&data).map_err(|why| Error::Invalid(format!("{}: {why}", p.display())))? {
        visit(&dep, idx, builtin, done, chain + 1)?;
    }
    done.push((name.to_string(), data));
    Ok(())
}

/// The `depends=` entry of an ELF64 module's `.modinfo` section.
pub fn depends(elf: &[u8]) -> std::result::Result<Vec<String>, String> {
    let info = section(elf, ".modinfo")?;
    let deps = info
        .split(|b| *b == 0)
        .find_map(|kv| kv.strip_prefix(b"depends="))
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .unwrap_or_default();
    Ok(deps.split(',').filter(|d| !d.is_empty()).map(|d| d.replace('-', "_")).collect())
}

/// A little-endian ELF64 file's section by name.
fn section<'a>(elf: &'a [u8], want: &str) -> std::result::Result<&'a [u8], String> {
    let get = |at: usize, n: usize| elf.get(at..at + n).ok_or_else(|| format!("truncated at {at}"));
    let u16_at = |at| get(at, 2).map(|b| u16::from_le_bytes([b[0], b[1]]) as usize);
    let u64_at = |at| get(at, 8).map(|b| u64::from_le_bytes(b.try_into().unwrap()) as usize);
    if get(0, 6)? != b"\x7fELF\x02\x01" {
        return Err("not a little-endian ELF64 file".into());
    }
    let (shoff, shentsize, shnum, shstrndx) = (u64_at(0x28)?, u16_at(0x3a)?, u16_at(0x3c)?, u16_at(0x3e)?);
    if shentsize < 0x40 {
        return Err(format!("section header entries of {shentsize} bytes"));
    }
    let sh = |i: usize| -> std::result::Result<(usize, usize, usize), String> {
        let at = shoff.checked_add(i.checked_mul(shentsize).ok_or("overflow")?).ok_or("overflow")?;
        let name = get(at, 4).map(|b| u32::from_le_bytes(b.try_into().unwrap()) as usize)?;
        Ok((name, u64_at(at + 0x18)?, u64_at(at + 0x20)?))
    };
    let (_, str_off, str_size) = sh(shstrndx)?;
    let strtab = get(str_off, str_size)?;
    for i in 0..shnum {
        let (name, off, size) = sh(i)?;
        let n = strtab.get(name..).ok_or("section name outside the string table")?;
        let n = &n[..n.iter().position(|b| *b == 0).unwrap_or(n.len())];
        if n == want.as_bytes() {
            return get(off, size);
        }
    }
    Err(format!("no {want} section"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_bad_elves() {
        assert_eq!(module_name("virtio-rng.ko").as_deref(), Some("virtio_rng"));
        assert_eq!(module_name("virtio.ko.xz").as_deref(), Some("virtio"));
        assert_eq!(module_name("modules.dep"), None);
        assert!(depends(b"not an elf").is_err());
        let mut truncated = b"\x7fELF\x02\x01".to_vec();
        truncated.resize(0x40, 0xff);
        assert!(depends(&truncated).is_err());
    }

    /// Modules installed on the host, where there are any, read as
    /// depmod reads them (their `modules.dep` is the reference).
    #[test]
    fn depends_agrees_with_the_hosts_depmod() {
        let roots: Vec<PathBuf> = std::fs::read_dir("/lib/modules")
            .map(|d| {
                d.filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.join("modules.dep").is_file())
                    .collect()
            })
            .unwrap_or_default();
        let mut compared = 0;
        for root in &roots {
            let dep = std::fs::read_to_string(root.join("modules.dep")).unwrap();
            for line in dep.lines().filter(|l| l.contains("/virtio")).take(20) {
                let (m, deps) = line.split_once(':').unwrap();
                let Ok(data) = load(&root.join(m)) else { continue };
                let want: Vec<String> = deps
                    .split_whitespace()
                    .filter_map(|d| d.rsplit('/').next().and_then(module_name))
                    .collect();
                // modules.dep lists the whole closure; .modinfo the direct ones.
                let got = depends(&data).unwrap();
                assert!(got.iter().all(|g| want.contains(g)), "{m}: {got:?} not within {want:?}");
                assert_eq!(got.is_empty(), want.is_empty(), "{m}: {got:?} against {want:?}");
                compared += 1;
            }
        }
        eprintln!("compared {compared} modules with modules.dep in {roots:?}");
    }
}
