//! The guest image: a kernel and an initramfs that boots to a shell the
//! harness drives, holding the programs a test or a user runs in the
//! guest.
//!
//! The initramfs holds busybox (`/bin/busybox`, its applets linked at
//! boot), the virtio modules ([`crate::modules`]), `/init` (`init.sh`
//! here), and the files of the [`ImageSpec`]: host programs with the
//! shared libraries they load ([`crate::libs`]) at the same paths as on
//! the host, and optionally the project's [`DropIn`] libraries laid out
//! as `vrdma run` lays them out on the host: `/opt/vrdma/bin` holds the
//! `vrdma` binary with `libvrdma_verbs.so`, `libvrdma_rdmacm.so` and
//! `libvrdma_companions.so` beside it (where `vrdma run` looks for them),
//! and `/opt/vrdma/lib` holds the soname links (`libibverbs.so.1`,
//! `librdmacm.so.1`, the provider sonames) that `/init` puts on every
//! program's `LD_LIBRARY_PATH`. The host's rdma-core libraries of those
//! sonames are left out, so a Debian tool in the guest can load only
//! vRDMA's. The project's files are copied with their debug information
//! stripped (where `strip` is installed), since a debug build's `vrdma`
//! is over 100 MiB and the initramfs is unpacked into the guest's memory.
//!
//! Built images are cached by their inputs ([`crate::cache`]).

use std::collections::BTreeMap;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{cache, cpio, kernel, libs, modules, Error, Result};

/// Where the drop-in libraries go in the guest (see the module
/// documentation).
pub const GUEST_BIN: &str = "/opt/vrdma/bin";
pub const GUEST_LIB: &str = "/opt/vrdma/lib";
/// The host's busybox (Debian's `busybox-static`).
pub const BUSYBOX: &str = "/bin/busybox";
/// Debian's verbs programs the joined tests run in the guest.
pub const DEBIAN_TOOLS: [&str; 6] =
    ["ibv_devinfo", "ibv_rc_pingpong", "ibv_ud_pingpong", "ib_write_lat", "ib_send_bw", "qperf"];
/// Debian's rdma_cm programs (`rdmacm-utils`), put in the image where
/// the host has them: they run on the drop-in `librdmacm.so.1`.
pub const RDMACM_TOOLS: [&str; 2] = ["rping", "ucmatose"];
/// File names of the project's build (as cargo names them).
const VRDMA_BIN: &str = "vrdma";
const VERBS_LIB: &str = "libvrdma_verbs.so";
const RDMACM_LIB: &str = "libvrdma_rdmacm.so";
const COMPANIONS_LIB: &str = "libvrdma_companions.so";
const INIT: &str = include_str!("init.sh");
/// Changes when the layout changes, so that old cached images are not
/// reused.
const FORMAT: &str = "vrdma-guest-image-1";
/// Images kept in the cache (each is tens of MiB): the most recently used.
const KEEP_IMAGES: usize = 4;

/// A host file to put in the guest.
#[derive(Clone, Debug)]
pub struct GuestFile {
    pub host: PathBuf,
    /// Absolute path in the guest.
    pub guest: String,
    /// Also copy the shared libraries it loads.
    pub libraries: bool,
}

/// The project's binary and drop-in libraries, from one cargo profile
/// directory.
#[derive(Clone, Debug)]
pub struct DropIn {
    pub vrdma: PathBuf,
    pub verbs: PathBuf,
    pub rdmacm: Option<PathBuf>,
    pub companions: Option<PathBuf>,
}

impl DropIn {
    /// The files of the cargo profile directory `dir` (`target/debug`,
    /// `target/release`): `vrdma` and `libvrdma_verbs.so` are required,
    /// the other two libraries optional (as for `vrdma run`). A library
    /// is taken from `dir/deps` where it is there: cargo writes the
    /// cdylibs of every build there, and copies them up to `dir` only for
    /// `cargo build` (after `cargo test` alone, `dir`'s copy is missing
    /// or stale).
    pub fn from_profile_dir(dir: &Path) -> Result<DropIn> {
        let find =
            |name: &str| [dir.join("deps").join(name), dir.join(name)].into_iter().find(|p| p.is_file());
        let need = |name: &str| {
            if let Some(p) = find(name) {
                Ok(p)
            } else {
                let p = dir.join(name);
                Err(Error::Invalid(format!(
                    "{} is missing; build it (cargo build -p vrdma-cli -p vrdma-verbs -p vrdma-rdmacm -p vrdma-companions)",
                    p.display()
                )))
            }
        };
        let opt = |name: &str| find(name);
        Ok(DropIn {
            vrdma: need(VRDMA_BIN)?,
            verbs: need(VERBS_LIB)?,
            rdmacm: opt(RDMACM_LIB),
            companions: opt(COMPANIONS_LIB),
        })
    }

    /// The sonames the drop-in answers to in the guest, each with the
    /// library it links to.
    fn sonames(&self) -> Vec<(&'static str, &'static str)> {
        let mut v = vec![("libibverbs.so.1", VERBS_LIB)];
        if self.rdmacm.is_some() {
            v.push(("librdmacm.so.1", RDMACM_LIB));
        }
        if self.companions.is_some() {
            v.extend(vrdma_companions::SONAMES.iter().map(|s| (*s, COMPANIONS_LIB)));
        }
        v
    }

    /// (host file, its name in [`GUEST_BIN`]).
    fn files(&self) -> Vec<(&Path, &'static str)> {
        let mut v = vec![(self.vrdma.as_path(), VRDMA_BIN), (self.verbs.as_path(), VERBS_LIB)];
        v.extend(self.rdmacm.as_deref().map(|p| (p, RDMACM_LIB)));
        v.extend(self.companions.as_deref().map(|p| (p, COMPANIONS_LIB)));
        v
    }
}

/// What goes in an image besides busybox, the modules and `/init`.
#[derive(Clone, Debug)]
pub struct ImageSpec {
    pub files: Vec<GuestFile>,
    pub drop_in: Option<DropIn>,
    /// Strip the drop-in's debug information (where `strip` exists).
    pub strip: bool,
}

impl Default for ImageSpec {
    fn default() -> Self {
        ImageSpec { files: Vec::new(), drop_in: None, strip: true }
    }
}

impl ImageSpec {
    /// Adds the host program `name` (found on `PATH` unless it has a
    /// `/`) at `/usr/bin/<its file name>`, with its libraries.
    pub fn program(mut self, name: &str) -> Result<ImageSpec> {
        let host =
            libs::which(name).ok_or_else(|| Error::Invalid(format!("no program {name} on this host")))?;
        let file = host.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        self.files.push(GuestFile { host, guest: format!("/usr/bin/{file}"), libraries: true });
        Ok(self)
    }

    /// Adds [`DEBIAN_TOOLS`], and those of [`RDMACM_TOOLS`] the host has.
    pub fn debian_tools(self) -> Result<ImageSpec> {
        let s = DEBIAN_TOOLS.iter().try_fold(self, |s, t| s.program(t))?;
        RDMACM_TOOLS.iter().filter(|t| libs::which(t).is_some()).try_fold(s, |s, t| s.program(t))
    }

    pub fn with_drop_in(mut self, d: DropIn) -> ImageSpec {
        self.drop_in = Some(d);
        self
    }
}

/// A built image.
#[derive(Clone, Debug)]
pub struct Image {
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    /// The guest kernel's release.
    pub release: String,
}

/// One entry of the initramfs, by guest path (relative, no leading `/`).
enum Entry {
    Host { path: PathBuf, perm: u32, strip: bool },
    Data { data: Vec<u8>, perm: u32 },
    Link(String),
}

/// Builds the image (or finds it in the cache).
pub fn build(spec: &ImageSpec) -> Result<Image> {
    let k = kernel::get()?;
    let entries = entries(spec)?;
    let mut key = cache::Key::new(FORMAT);
    key.add(k.release.as_bytes()).add(k.vmlinuz.as_os_str().as_encoded_bytes()).add(INIT.as_bytes());
    key.add(&[spec.strip as u8]);
    for (guest, e) in &entries {
        key.add(guest.as_bytes());
        match e {
            Entry::Host { path, perm, strip } => {
                key.add_file(path)?.add(&perm.to_le_bytes()).add(&[*strip as u8]);
            }
            Entry::Data { data, perm } => {
                key.add(data).add(&perm.to_le_bytes());
            }
            Entry::Link(t) => {
                key.add(t.as_bytes());
            }
        }
    }
    let images = cache::dir()?.join("images");
    let dest = images.join(key.hex());
    let dir = cache::publish(&dest, |tmp| write(&k, &entries, tmp))?;
    cache::keep_newest(&images, &dir, KEEP_IMAGES)?;
    Ok(Image { kernel: k.vmlinuz, initramfs: dir.join("initramfs.cpio"), release: k.release })
}

/// `vrdma vm image --out DIR`: builds the image and copies its kernel
/// (`vmlinuz`) and initramfs (`initramfs.cpio`) into `out`.
pub fn export(spec: &ImageSpec, out: &Path) -> Result<Image> {
    let img = build(spec)?;
    std::fs::create_dir_all(out).map_err(|e| Error::path("create", out, e))?;
    let kernel = out.join("vmlinuz");
    let initramfs = out.join("initramfs.cpio");
    std::fs::copy(&img.kernel, &kernel).map_err(|e| Error::path("copy to", &kernel, e))?;
    std::fs::copy(&img.initramfs, &initramfs).map_err(|e| Error::path("copy to", &initramfs, e))?;
    Ok(Image { kernel, initramfs, release: img.release })
}

/// Everything but the modules, by guest path.
fn entries(spec: &ImageSpec) -> Result<BTreeMap<String, Entry>> {
    let mut out = BTreeMap::new();
    let skip: Vec<&str> =
        spec.drop_in.as_ref().map(|d| d.sonames().iter().map(|s| s.0).collect()).unwrap_or_default();
    let add_host =
        |out: &mut BTreeMap<String, Entry>, host: &Path, guest: &str, libraries: bool, strip: bool| {
            let perm = perm_of(host)?;
            out.insert(rel(guest)?, Entry::Host { path: host.to_path_buf(), perm, strip });
            if libraries {
                for lib in libs::needed(host)? {
                    let name = lib.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                    if skip.contains(&name.as_str()) {
                        continue;
                    }
                    let g = rel(&lib.to_string_lossy())?;
                    let perm = perm_of(&lib)?;
                    out.entry(g).or_insert(Entry::Host { path: lib, perm, strip: false });
                }
            }
            Ok::<(), Error>(())
        };
    add_host(&mut out, Path::new(BUSYBOX), BUSYBOX, true, false)?;
    for f in &spec.files {
        add_host(&mut out, &f.host, &f.guest, f.libraries, false)?;
    }
    if let Some(d) = &spec.drop_in {
        for (host, name) in d.files() {
            add_host(&mut out, host, &format!("{GUEST_BIN}/{name}"), true, spec.strip)?;
        }
        for (soname, lib) in d.sonames() {
            out.insert(rel(&format!("{GUEST_LIB}/{soname}"))?, Entry::Link(format!("../bin/{lib}")));
        }
    }
    out.insert("init".into(), Entry::Data { data: INIT.as_bytes().to_vec(), perm: 0o755 });
    Ok(out)
}

/// A guest path made relative (cpio names have no leading `/`).
fn rel(guest: &str) -> Result<String> {
    let r = guest.trim_start_matches('/');
    if !guest.starts_with('/') || r.is_empty() || r.split('/').any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err(Error::Invalid(format!("{guest:?} is not a plain absolute guest path")));
    }
    Ok(r.to_string())
}

fn perm_of(p: &Path) -> Result<u32> {
    use std::os::unix::fs::PermissionsExt;
    let m = std::fs::metadata(p).map_err(|e| Error::path("stat", p, e))?;
    if !m.is_file() {
        return Err(Error::Invalid(format!("{} is not a file", p.display())));
    }
    Ok(m.permissions().mode() & 0o7777)
}

/// Writes `initramfs.cpio` into `dir`.
fn write(k: &kernel::Kernel, entries: &BTreeMap<String, Entry>, dir: &Path) -> Result<()> {
    let mods = modules::closure(&k.modules, &modules::WANTED)?;
    let path = dir.join("initramfs.cpio");
    let f = std::fs::File::create(&path).map_err(|e| Error::path("create", &path, e))?;
    let mut w = cpio::Writer::new(BufWriter::new(f));
    let io = |e| Error::path("write", &path, e);
    // Directories first, parents before children.
    let mut dirs: Vec<String> =
        ["dev", "proc", "sys", "tmp", "run", "root", "etc/vrdma-guest", "lib/modules/vrdma-guest"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    for name in entries.keys() {
        if let Some((d, _)) = name.rsplit_once('/') {
            dirs.push(d.to_string());
        }
    }
    let mut all: Vec<String> = Vec::new();
    for d in dirs {
        let mut acc = String::new();
        for c in d.split('/') {
            acc = if acc.is_empty() { c.to_string() } else { format!("{acc}/{c}") };
            all.push(acc.clone());
        }
    }
    all.sort();
    all.dedup();
    for d in &all {
        w.dir(d, if d == "tmp" { 0o1777 } else { 0o755 }).map_err(io)?;
    }
    w.char_device("dev/console", 0o600, 5, 1).map_err(io)?;
    let mut order = String::new();
    for (name, data) in &mods {
        w.file(&format!("lib/modules/vrdma-guest/{name}.ko"), 0o644, data).map_err(io)?;
        order.push_str(name);
        order.push('\n');
    }
    w.file("etc/vrdma-guest/modules", 0o644, order.as_bytes()).map_err(io)?;
    for (name, e) in entries {
        match e {
            Entry::Data { data, perm } => w.file(name, *perm, data).map_err(io)?,
            Entry::Link(t) => w.symlink(name, t).map_err(io)?,
            Entry::Host { path, perm, strip } => {
                let src = if *strip { stripped(path, dir)? } else { None };
                let src = src.as_deref().unwrap_or(path);
                let f = std::fs::File::open(src).map_err(|e| Error::path("open", src, e))?;
                let len = f.metadata().map_err(|e| Error::path("stat", src, e))?.len();
                w.file_from(name, *perm, len, f).map_err(|e| Error::path("copy", src, e))?;
            }
        }
    }
    w.finish().map_err(io)?;
    // The stripped copies were only needed while writing.
    let scratch = dir.join("stripped");
    if scratch.exists() {
        std::fs::remove_dir_all(&scratch).map_err(|e| Error::path("remove", &scratch, e))?;
    }
    Ok(())
}

/// A copy of `p` without debug information, in `dir/stripped/`; `None`
/// where the host has no `strip`.
fn stripped(p: &Path, dir: &Path) -> Result<Option<PathBuf>> {
    if libs::which("strip").is_none() {
        tracing::warn!(
            "no strip on this host: {} goes into the image with its debug information",
            p.display()
        );
        return Ok(None);
    }
    let scratch = dir.join("stripped");
    std::fs::create_dir_all(&scratch).map_err(|e| Error::path("create", &scratch, e))?;
    let out = scratch.join(p.file_name().unwrap_or_default());
    kernel::tool(Command::new("strip").arg("--strip-debug").arg("-o").arg(&out).arg(p))?;
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_paths_must_be_plain_and_absolute() {
        assert_eq!(rel("/usr/bin/x").unwrap(), "usr/bin/x");
        for bad in ["usr/bin/x", "/", "/a/../b", "/a//b", "/a/./b"] {
            assert!(rel(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_drop_in_answers_to_every_soname_vrdma_run_links() {
        let d = DropIn {
            vrdma: "v".into(),
            verbs: "a".into(),
            rdmacm: Some("b".into()),
            companions: Some("c".into()),
        };
        let names: Vec<&str> = d.sonames().iter().map(|s| s.0).collect();
        assert!(names.contains(&"libibverbs.so.1") && names.contains(&"librdmacm.so.1"));
        for s in vrdma_companions::SONAMES {
            assert!(names.contains(&s), "{s}");
        }
        let bare = DropIn { rdmacm: None, companions: None, ..d };
        assert_eq!(bare.sonames(), vec![("libibverbs.so.1", VERBS_LIB)]);
    }
}
