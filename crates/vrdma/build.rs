//! The library's build id (`vrdma::BUILD_ID`): a hash of the sources of
//! this crate and of the two it shares its protocol with (`vrdma-core`,
//! `vrdma-shm`), so that a program linking one build of the library can
//! tell whether a drop-in library (`libvrdma_verbs.so`, which links it
//! too) was built from the same sources: `vrdma bench` refuses a stale one
//! with a clear message instead of failing in its first exchange with the
//! daemon.

use std::path::{Path, PathBuf};

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            files(&p, out);
        } else {
            out.push(p);
        }
    }
}

fn main() {
    let here = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let crates = here.parent().map(Path::to_path_buf).unwrap_or_else(|| here.clone());
    let mut all = Vec::new();
    for c in ["vrdma", "vrdma-core", "vrdma-shm"] {
        let dir = crates.join(c);
        for part in ["src", "Cargo.toml"] {
            let p = dir.join(part);
            // A directory is scanned whole by cargo for changes.
            println!("cargo:rerun-if-changed={}", p.display());
            if p.is_dir() {
                files(&p, &mut all);
            } else if p.is_file() {
                all.push(p);
            }
        }
    }
    all.sort();
    // FNV-1a, 64 bits, over each file's path below `crates` and contents.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for p in &all {
        eat(p.strip_prefix(&crates).unwrap_or(p).to_string_lossy().as_bytes());
        eat(&std::fs::read(p).unwrap_or_default());
    }
    println!("cargo:rustc-env=VRDMA_BUILD_ID={h:016x}");
}
