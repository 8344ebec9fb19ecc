//! The shared libraries a host program loads, so that the guest gets
//! them too.
//!
//! Read with the host's `ldd` (glibc's: it runs the dynamic loader in
//! its listing mode, so the answer is the loader's own search, transitive
//! dependencies and the loader itself included), with `LD_LIBRARY_PATH`
//! and `LD_PRELOAD` cleared so that the caller's environment does not
//! change it. Libraries loaded with `dlopen` are not listed; the programs
//! the guest runs load none they need (the drop-in `libibverbs.so.1`
//! needs no provider).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{Error, Result};

/// The files `bin` loads, as absolute host paths (symlinks not
/// resolved: each is where the loader looks), the loader included.
/// Empty for a static program.
pub fn needed(bin: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(bin)
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("LD_PRELOAD")
        .output()
        .map_err(|e| Error::io(format!("run ldd {}", bin.display()), e))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        if text.contains("not a dynamic executable")
            || String::from_utf8_lossy(&out.stderr).contains("not a dynamic")
        {
            return Ok(Vec::new());
        }
        return Err(Error::Tool {
            command: format!("ldd {}", bin.display()),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    parse(&text).map_err(|why| Error::Invalid(format!("ldd {}: {why}", bin.display())))
}

/// Parses `ldd`'s listing.
fn parse(text: &str) -> std::result::Result<Vec<PathBuf>, String> {
    let mut out = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if line.contains("statically linked") {
            continue;
        }
        let path = match line.split_once("=>") {
            Some((soname, rest)) => {
                let rest = rest.trim();
                if rest.starts_with("not found") {
                    return Err(format!("{} not found", soname.trim()));
                }
                rest.split(" (").next().unwrap_or("").trim()
            }
            None => line.split(" (").next().unwrap_or("").trim(),
        };
        // The vDSO has no file; anything else without a path is unknown.
        if path.starts_with('/') {
            out.push(PathBuf::from(path));
        } else if !path.starts_with("linux-vdso") && !path.is_empty() {
            return Err(format!("unexpected line {line:?}"));
        }
    }
    Ok(out)
}

/// `name` as a program: itself if it has a `/`, else found on `PATH`.
pub fn which(name: &str) -> Option<PathBuf> {
    if name.contains('/') {
        return Some(PathBuf::from(name)).filter(|p| p.is_file());
    }
    std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join(name)).find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listings_parse_and_missing_libraries_are_errors() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                    \tlibibverbs.so.1 => /lib/x86_64-linux-gnu/libibverbs.so.1 (0x00007f)\n\
                    \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)\n\
                    \t/lib64/ld-linux-x86-64.so.2 (0x00007f)\n";
        let got = parse(text).unwrap();
        assert_eq!(
            got,
            [
                "/lib/x86_64-linux-gnu/libibverbs.so.1",
                "/lib/x86_64-linux-gnu/libc.so.6",
                "/lib64/ld-linux-x86-64.so.2"
            ]
            .map(PathBuf::from)
        );
        assert!(parse("\tlibfoo.so.1 => not found\n").unwrap_err().contains("libfoo.so.1"));
        assert!(parse("\tstatically linked\n").unwrap().is_empty());
    }

    #[test]
    fn the_hosts_shell_needs_libc_and_the_loader() {
        let sh = which("sh").expect("sh on PATH");
        let libs = needed(&sh.canonicalize().unwrap()).unwrap();
        assert!(libs.iter().any(|l| l.to_string_lossy().contains("libc.so")), "{libs:?}");
        assert!(libs.iter().any(|l| l.to_string_lossy().contains("ld-linux")), "{libs:?}");
    }
}
