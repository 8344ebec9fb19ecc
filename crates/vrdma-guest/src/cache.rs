//! Where built guest pieces are kept, and how they are keyed.
//!
//! The kernel package, the extracted kernel, the initramfs and the
//! accelerator probe's answer live under one directory: `VRDMA_GUEST_CACHE`
//! if set, else `guest/` in the cargo target directory the running
//! executable sits in (found by its `CACHEDIR.TAG`, which cargo writes
//! there), else a directory under the system's temporary directory. Each
//! piece goes in a subdirectory named by a hash of its inputs and is
//! written to a temporary name first and renamed into place, so that a
//! second test binary finds it complete or not at all.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::{Error, Result};

/// Environment variable naming the cache directory explicitly.
pub const CACHE_ENV: &str = "VRDMA_GUEST_CACHE";

/// The cache directory (see the module documentation); created if
/// missing.
pub fn dir() -> Result<PathBuf> {
    let d = if let Some(d) = std::env::var_os(CACHE_ENV) {
        PathBuf::from(d)
    } else if let Some(t) = target_dir() {
        t.join("guest")
    } else {
        std::env::temp_dir().join("vrdma-guest")
    };
    std::fs::create_dir_all(&d).map_err(|e| Error::path("create", &d, e))?;
    Ok(d)
}

/// The cargo target directory holding the running executable, if it is
/// in one.
pub fn target_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    exe.ancestors().skip(1).find(|d| d.join("CACHEDIR.TAG").is_file()).map(Path::to_path_buf)
}

/// The cargo profile directory (`target/debug`, `target/release`) holding
/// the running executable: the executable's own directory, or its parent
/// for test binaries (which sit in `deps/`).
pub fn profile_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    if dir.file_name().is_some_and(|n| n == "deps" || n == "examples") {
        dir.parent().map(Path::to_path_buf)
    } else {
        Some(dir.to_path_buf())
    }
}

/// Accumulates an input key.
#[derive(Default)]
pub struct Key(Sha256);

impl Key {
    pub fn new(kind: &str) -> Key {
        let mut k = Key(Sha256::new());
        k.add(kind.as_bytes());
        k
    }

    /// Adds a piece of input, length-prefixed so that pieces do not run
    /// into each other.
    pub fn add(&mut self, b: &[u8]) -> &mut Key {
        self.0.update((b.len() as u64).to_le_bytes());
        self.0.update(b);
        self
    }

    /// Adds a host file by its path, length and modification time (not
    /// its contents: the project's binaries are tens of MiB, and a
    /// rebuilt one gets a new mtime).
    pub fn add_file(&mut self, p: &Path) -> Result<&mut Key> {
        let m = std::fs::metadata(p).map_err(|e| Error::path("stat", p, e))?;
        let mtime =
            m.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).unwrap_or_default();
        self.add(p.as_os_str().as_encoded_bytes());
        self.add(&m.len().to_le_bytes());
        self.add(&mtime.as_nanos().to_le_bytes());
        Ok(self)
    }

    /// The key as 16 hex digits.
    pub fn hex(&self) -> String {
        self.0.clone().finalize()[..8].iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// Makes `dest` by running `make` on a fresh temporary directory next to
/// it, then renaming that into place; returns `dest` at once if it exists.
pub fn publish(dest: &Path, make: impl FnOnce(&Path) -> Result<()>) -> Result<PathBuf> {
    if dest.is_dir() {
        return Ok(dest.to_path_buf());
    }
    let parent = dest.parent().ok_or_else(|| Error::Invalid(format!("{} has no parent", dest.display())))?;
    std::fs::create_dir_all(parent).map_err(|e| Error::path("create", parent, e))?;
    let name = dest.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    // Unique per call, not only per process: two threads of one test
    // binary (two tests booting guests at once) may publish the same piece
    // together, and a shared name let one clear the other's half-made
    // directory under it.
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = parent.join(format!(".{name}.tmp-{}-{call}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::path("clear", &tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::path("create", &tmp, e))?;
    let made = make(&tmp);
    if let Err(e) = made {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if let Err(e) = std::fs::rename(&tmp, dest) {
        let _ = std::fs::remove_dir_all(&tmp);
        // Another process published it first: theirs is as good.
        if !dest.is_dir() {
            return Err(Error::path("rename into", dest, e));
        }
    }
    Ok(dest.to_path_buf())
}

/// Marks `used` (an entry of `dir`) as just used, and removes all but
/// the `keep` most recently used entries of `dir` (by modification time,
/// which marking sets). A process booting a removed image is not
/// disturbed: QEMU reads the initramfs when it starts.
pub fn keep_newest(dir: &Path, used: &Path, keep: usize) -> Result<()> {
    let f = std::fs::File::open(used).map_err(|e| Error::path("open", used, e))?;
    f.set_modified(std::time::SystemTime::now()).map_err(|e| Error::path("touch", used, e))?;
    let mut entries: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(dir)
        .map_err(|e| Error::path("read", dir, e))?
        .filter_map(|e| e.ok())
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    entries.sort_by_key(|e| std::cmp::Reverse(e.0));
    for (_, p) in entries.into_iter().skip(keep) {
        if p != used {
            let _ = std::fs::remove_dir_all(&p);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_threads_publishing_one_piece_at_once_both_get_it() {
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("kernel");
        // Both makers are inside `make` at once: each writes its file, waits
        // for the other, then finds its own file still there.
        let both = std::sync::Barrier::new(2);
        std::thread::scope(|s| {
            let runs: Vec<_> = (0..2)
                .map(|i| {
                    let (dest, both) = (&dest, &both);
                    s.spawn(move || {
                        publish(dest, |t| {
                            let f = t.join(format!("f{i}"));
                            std::fs::write(&f, b"1").map_err(|e| Error::io("write", e))?;
                            both.wait();
                            std::fs::read(&f).map(drop).map_err(|e| Error::io("read back", e))
                        })
                    })
                })
                .collect();
            for r in runs {
                let got = r.join().unwrap();
                assert!(got.is_ok(), "a publisher failed: {got:?}");
            }
        });
        assert!(dest.is_dir());
        let left: Vec<_> = std::fs::read_dir(d.path()).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(left, vec![std::ffi::OsString::from("kernel")], "temporary directories left: {left:?}");
    }

    #[test]
    fn keys_differ_by_input_and_publish_runs_once() {
        let a = Key::new("x").add(b"ab").add(b"c").hex();
        let b = Key::new("x").add(b"a").add(b"bc").hex();
        assert_ne!(a, b);
        assert_eq!(a.len(), 16);
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("piece");
        let mut runs = 0;
        for _ in 0..2 {
            publish(&dest, |t| {
                runs += 1;
                std::fs::write(t.join("f"), b"1").map_err(|e| Error::io("write", e))
            })
            .unwrap();
        }
        assert_eq!(runs, 1);
        assert_eq!(std::fs::read(dest.join("f")).unwrap(), b"1");
        let failed = publish(&d.path().join("bad"), |_| Err(Error::Invalid("no".into())));
        assert!(failed.is_err() && !d.path().join("bad").exists());
        for n in ["a", "b", "c"] {
            std::fs::create_dir(d.path().join(n)).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        // "a" is the oldest but just used: it stays with the newest other.
        keep_newest(d.path(), &d.path().join("a"), 2).unwrap();
        let mut left: Vec<String> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["a", "c"]);
    }
}
