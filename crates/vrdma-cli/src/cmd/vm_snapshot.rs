//! `vrdma vm savevm` and `vrdma vm loadvm`: QEMU's own snapshots of a VM
//! with vRDMA attached, with the daemon's step beside each (issue 19,
//! `docs/migration.md`, "Snapshots with savevm and loadvm").
//!
//! QEMU's `savevm` keeps the VM's memory, the vRDMA region with it, in
//! the VM's qcow2 disk, but not the daemon's state of the VM's tenant
//! (QPs' PSNs, keys, counts of the rings), and a `loadvm` alone writes the
//! saved region back under a daemon whose state ran on: the guest's next
//! post fails. These commands make the step QEMU cannot: the tenant's
//! snapshot and the region's bytes as of the save go to two files (0600:
//! the region is guest memory) named after the VM and QEMU's tag
//! (`NAME@TAG.snap`, `NAME@TAG.region`), and a
//! load drops the running copy's state, loads QEMU's snapshot and imports
//! the saved state, in the order the document gives. A VM with no vRDMA
//! context when saved gets an empty state file: its load imports nothing.
//!
//! Before it changes anything a load checks that QEMU has the tag and the
//! files are there and fit the VM's region, so that a typo leaves the VM
//! as it was; a save that fails puts the VM back as it was (the tenant
//! resumed, the CPUs continued if they ran).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use vrdma_guest::qmp::Qmp;

use super::vm_qemu::{check_runs_vm, qmp};

use super::migrate::{load_region, read_all, save_region};

/// How long QEMU's `savevm`/`loadvm` may take (they write or read the
/// VM's whole memory).
const SNAPSHOT_LIMIT: Duration = Duration::from_secs(300);

/// The CLI's arguments of `vrdma vm savevm` / `loadvm`.
#[derive(clap::Args)]
pub struct Args {
    /// The VM's name in the daemon's config.
    pub name: String,
    /// The VM's QEMU's QMP socket (`-qmp unix:PATH,server=on,wait=off`).
    #[arg(long, value_name = "PATH")]
    pub qmp: PathBuf,
    /// QEMU's snapshot tag (HMP's `savevm TAG`).
    #[arg(long, value_name = "TAG")]
    pub tag: String,
    /// Where the tenant's state and the region's bytes of the snapshot are kept (NAME@TAG.snap, NAME@TAG.region).
    #[arg(long, value_name = "DIR")]
    pub dir: PathBuf,
}

/// `vrdma vm savevm`'s: [`Args`] and what to do after the save.
#[derive(clap::Args)]
pub struct SaveArgs {
    #[command(flatten)]
    pub vm: Args,
    /// Leave the VM stopped and its tenant paused after the save.
    #[arg(long)]
    pub stay_stopped: bool,
}

struct Files {
    snap: PathBuf,
    region: PathBuf,
}

impl Args {
    fn files(&self) -> Result<Files> {
        let ok = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
        anyhow::ensure!(
            ok(&self.tag) && !self.tag.starts_with('.'),
            "the tag {:?}: letters, digits, '-', '_' and '.' (not first) only (it names files)",
            self.tag
        );
        // '@' is in neither a VM's name nor a tag: one file per pair.
        let base = format!("{}@{}", self.name, self.tag);
        Ok(Files {
            snap: self.dir.join(format!("{base}.snap")),
            region: self.dir.join(format!("{base}.region")),
        })
    }
}

/// Runs an HMP command through QMP; its text is empty on success.
fn hmp(q: &mut Qmp, line: &str) -> Result<String> {
    let cmd = serde_json::json!({"execute": "human-monitor-command", "arguments": {"command-line": line}});
    let out = q.exec_within(&cmd.to_string(), SNAPSHOT_LIMIT).with_context(|| format!("QEMU's {line:?}"))?;
    Ok(out.as_str().unwrap_or_default().to_string())
}

/// Whether `tag` is one of QEMU's snapshots (`info snapshots`' table, the
/// tag in its second column).
fn has_snapshot(q: &mut Qmp, tag: &str) -> Result<bool> {
    let table = hmp(q, "info snapshots")?;
    Ok(table.lines().any(|l| l.split_whitespace().nth(1) == Some(tag)))
}

fn cont(q: &mut Qmp) -> Result<()> {
    q.exec(r#"{"execute":"cont"}"#).context("continuing QEMU")?;
    Ok(())
}

/// Pauses the tenant; `false` where it has no context here (nothing of
/// vRDMA to save or drop).
fn pause(socket: &Path, tenant: u32) -> Result<bool> {
    match vrdma::migrate::pause(socket, tenant) {
        Ok(_) => Ok(true),
        Err(e) if e.errno() == libc::ENOENT => Ok(false),
        Err(e) => Err(e).with_context(|| format!("pause at {}", socket.display())),
    }
}

/// Writes `bytes` to a new file `path` (0600), through a temporary name
/// beside it.
fn write_private(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let tmp = temporary(path);
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("creating {}", tmp.display()))?;
    f.write_all(bytes).with_context(|| format!("writing {}", tmp.display()))?;
    Ok(())
}

fn temporary(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".part");
    path.with_file_name(name)
}

fn commit(path: &Path) -> Result<()> {
    std::fs::rename(temporary(path), path).with_context(|| format!("renaming into {}", path.display()))
}

pub fn save(socket: &Path, s: &SaveArgs) -> Result<()> {
    let a = &s.vm;
    let files = a.files()?;
    let tenant = vrdma::migrate::vm_tenant(socket, &a.name)
        .with_context(|| format!("the tenant of VM {:?} (daemon at {})", a.name, socket.display()))?;
    let mut q = qmp(&a.qmp, "the")?;
    check_runs_vm(&mut q, &a.qmp, "the", socket, &a.name)?;
    let running = q.status()? == "running";
    if running {
        q.exec(r#"{"execute":"stop"}"#).context("stopping QEMU")?;
    }
    let mut paused = false;
    let saved = (|| -> Result<(u64, u64)> {
        paused = pause(socket, tenant)?;
        let (state, region) = if paused {
            let (fd, len, _) = vrdma::migrate::export(socket, tenant)
                .with_context(|| format!("export at {}", socket.display()))?;
            write_private(&files.snap, &read_all(fd, len)?)?;
            let _ = std::fs::remove_file(temporary(&files.region));
            (len, save_region(socket, &a.name, &temporary(&files.region))?)
        } else {
            write_private(&files.snap, &[])?;
            (0, 0)
        };
        let said = hmp(&mut q, &format!("savevm {}", a.tag))?;
        if !said.trim().is_empty() {
            bail!("QEMU's savevm {}: {}", a.tag, said.trim());
        }
        commit(&files.snap)?;
        if paused {
            commit(&files.region)?;
        } else {
            // A region file of an earlier save under this tag is not this one's.
            let _ = std::fs::remove_file(&files.region);
        }
        Ok((state, region))
    })();
    if saved.is_err() {
        let _ = std::fs::remove_file(temporary(&files.snap));
        let _ = std::fs::remove_file(temporary(&files.region));
    }
    let go_on = saved.is_err() || !s.stay_stopped;
    if go_on {
        // Both are tried whatever the other did, and each failure said.
        let resumed = match paused {
            true => vrdma::migrate::resume(socket, tenant)
                .with_context(|| format!("resuming the tenant at {} (it stays paused)", socket.display())),
            false => Ok(0),
        };
        let continued = match running {
            true => cont(&mut q).context("the VM stays stopped"),
            false => Ok(()),
        };
        let undone = match (resumed.err(), continued.err()) {
            (Some(r), Some(c)) => Some(r.context(format!("{c:#}"))),
            (r, c) => r.or(c),
        };
        if let Some(u) = undone {
            let what = match &saved {
                Ok(_) => "saved, but going on failed".to_string(),
                Err(e) => format!("nothing saved ({e:#}), and going on failed"),
            };
            return Err(u.context(what));
        }
    }
    let (state, region) = saved.map_err(|e| e.context("nothing saved; the VM goes on as before"))?;
    let after = match (go_on, running) {
        (true, true) => "it runs on",
        (true, false) => "it stays stopped, as it was",
        (false, _) => {
            "it stays stopped, its tenant paused (`vrdma migrate resume --vm NAME` and QEMU's cont to go on)"
        }
    };
    match paused {
        true => println!(
            "VM {:?} saved as {:?}: {state} bytes of vRDMA state in {}, its region's {region} bytes in {}; {after}",
            a.name,
            a.tag,
            files.snap.display(),
            files.region.display()
        ),
        false => println!(
            "VM {:?} saved as {:?}, with no vRDMA context open (an empty {}); {after}",
            a.name,
            a.tag,
            files.snap.display()
        ),
    }
    Ok(())
}

pub fn load(socket: &Path, a: &Args) -> Result<()> {
    let files = a.files()?;
    let tenant = vrdma::migrate::vm_tenant(socket, &a.name)
        .with_context(|| format!("the tenant of VM {:?} (daemon at {})", a.name, socket.display()))?;
    let state = std::fs::read(&files.snap).with_context(|| {
        format!("{} (was {:?} saved with `vrdma vm savevm`, into this --dir?)", files.snap.display(), a.tag)
    })?;
    if !state.is_empty() {
        let len = std::fs::metadata(&files.region).with_context(|| files.region.display().to_string())?.len();
        let vm = vrdma::vm::attach_at(socket, &a.name)
            .with_context(|| format!("VM {:?}'s region at {}", a.name, socket.display()))?;
        anyhow::ensure!(
            len == vm.region_len,
            "{} holds {len} bytes, VM {:?}'s region {}",
            files.region.display(),
            a.name,
            vm.region_len
        );
    }
    let mut q = qmp(&a.qmp, "the")?;
    check_runs_vm(&mut q, &a.qmp, "the", socket, &a.name)?;
    anyhow::ensure!(has_snapshot(&mut q, &a.tag)?, "QEMU has no snapshot {:?} (`info snapshots`)", a.tag);
    let running = q.status()? == "running";
    if running {
        q.exec(r#"{"execute":"stop"}"#).context("stopping QEMU")?;
    }
    // The running copy's state goes first (its guest sessions end); from
    // here the VM can only go on from the snapshot.
    if pause(socket, tenant)? {
        vrdma::migrate::finish(socket, tenant).with_context(|| format!("finish at {}", socket.display()))?;
    }
    let stuck = |e: anyhow::Error| e.context("the VM's running vRDMA state was dropped: it stays stopped");
    let said = hmp(&mut q, &format!("loadvm {}", a.tag)).map_err(stuck)?;
    if !said.trim().is_empty() {
        return Err(stuck(anyhow::anyhow!("QEMU's loadvm {}: {}", a.tag, said.trim())));
    }
    let mut qps = 0;
    if !state.is_empty() {
        load_region(socket, &a.name, &files.region).map_err(stuck)?;
        let file = std::fs::File::open(&files.snap).with_context(|| files.snap.display().to_string())?;
        (_, qps) = vrdma::migrate::import(socket, std::os::fd::AsFd::as_fd(&file))
            .with_context(|| format!("import at {}", socket.display()))
            .map_err(stuck)?;
        vrdma::migrate::resume(socket, tenant)
            .with_context(|| format!("resume at {}", socket.display()))
            .map_err(stuck)?;
    }
    if running {
        cont(&mut q)?;
    }
    let after = if running { "it runs" } else { "it stays stopped, as it was" };
    println!("VM {:?} restored from {:?}: {qps} QPs of vRDMA state; {after}", a.name, a.tag);
    Ok(())
}
