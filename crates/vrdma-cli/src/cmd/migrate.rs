//! `vrdma migrate`: the operator's live-migration steps
//! (`docs/migration.md`), each on the daemon of `--socket`:
//!
//! - `pause --tenant UID` (or `--vm NAME`, any step): the tenant's QPs
//!   stop; peers are told PAUSED.
//! - `export --tenant UID --out FILE`: the paused tenant's snapshot;
//!   with `--vm NAME --region RFILE`, the VM's region's bytes too (a
//!   snapshot of the VM, or a move between machines: the last pass over
//!   the region that QEMU's migration cannot make).
//! - `import --in FILE`: on the destination, paused; with `--vm NAME
//!   --region RFILE`, the region's bytes written into that VM's region
//!   first.
//! - `resume --tenant UID`: on the destination, or on the source to cancel.
//! - `finish --tenant UID`: on the source, once the destination resumed:
//!   its objects there go, its sessions there end.
//! - `move --tenant UID --to SOCKET`: all of them, from the daemon of
//!   `--socket` to the one of `--to` (both reachable from here, as on one
//!   machine; across machines, run the steps on each and carry the file),
//!   resuming at the source if the destination refuses; with `--vm NAME`
//!   it also copies the VM's region between the two daemons after the
//!   pause (QEMU's last pass cannot see the daemon's writes).
//!
//! The snapshot goes through the operator's hands (a file), not over the
//! link between daemons: see `vrdmad::server::migrate` for why.

use std::io::Write as _;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};

#[derive(clap::Subcommand)]
pub enum Command {
    /// Pause every QP of a tenant (its peers wait, told PAUSED).
    Pause {
        #[command(flatten)]
        who: Who,
    },
    /// Write the paused tenant's snapshot to FILE (`-`: stdout).
    Export {
        #[command(flatten)]
        who: Who,
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
        /// With --vm: write the VM's region's bytes to RFILE too (after the pause, so that the daemon's writes are in it).
        #[arg(long, value_name = "RFILE")]
        region: Option<PathBuf>,
    },
    /// Import a snapshot (FILE, `-`: stdin) into this daemon, paused.
    Import {
        #[arg(long = "in", value_name = "FILE")]
        input: PathBuf,
        /// Write RFILE (from `export --region`) into VM NAME's region first (once its QEMU loaded the VM, before it runs).
        #[arg(long, value_name = "RFILE")]
        region: Option<PathBuf>,
        /// The VM whose region RFILE fills.
        #[arg(long, value_name = "NAME")]
        vm: Option<String>,
    },
    /// Resume a paused tenant (on the destination; on the source: cancel the migration).
    Resume {
        #[command(flatten)]
        who: Who,
    },
    /// Drop a moved tenant's objects on the source and end its sessions there.
    Finish {
        #[command(flatten)]
        who: Who,
    },
    /// Every step from this daemon to the one at SOCKET: pause, export, import, finish, resume (with --vm, the VM's region copied too; run it once QEMU's migration completed).
    Move {
        #[command(flatten)]
        who: Who,
        /// The destination daemon's control socket.
        #[arg(long, value_name = "SOCKET")]
        to: PathBuf,
    },
}

/// Whose device state: a tenant (uid), or a VM of the daemon's config.
#[derive(clap::Args)]
#[group(required = true, multiple = false)]
pub struct Who {
    /// The tenant: a uid.
    #[arg(long)]
    tenant: Option<u32>,
    /// A VM of the daemon's config (`[vms.NAME]`): its configured tenant.
    #[arg(long, value_name = "NAME")]
    vm: Option<String>,
}

impl Who {
    fn tenant(&self, socket: &Path) -> Result<u32> {
        match (&self.tenant, &self.vm) {
            (Some(t), _) => Ok(*t),
            (None, Some(name)) => vrdma::migrate::vm_tenant(socket, name)
                .with_context(|| format!("the tenant of VM {name:?} (daemon at {})", socket.display())),
            (None, None) => anyhow::bail!("give --tenant UID or --vm NAME"),
        }
    }
}

pub fn run(socket: Option<PathBuf>, cmd: Command) -> Result<()> {
    let socket = socket.unwrap_or_else(vrdmad::default_socket_path);
    let at = |what: &str| format!("{what} (daemon at {})", socket.display());
    match cmd {
        Command::Pause { who } => {
            let tenant = who.tenant(&socket)?;
            let qps = vrdma::migrate::pause(&socket, tenant).with_context(|| at("pause"))?;
            println!("tenant {tenant} paused: {qps} QPs");
        }
        Command::Export { who, out, region } => {
            anyhow::ensure!(
                region.is_none() || who.vm.is_some(),
                "--region goes with --vm NAME: only a VM's tenant has a region"
            );
            let tenant = who.tenant(&socket)?;
            let (fd, len, qps) = vrdma::migrate::export(&socket, tenant).with_context(|| at("export"))?;
            let bytes = read_all(fd, len)?;
            if out == Path::new("-") {
                std::io::stdout().write_all(&bytes).context("writing the snapshot to stdout")?;
            } else {
                std::fs::write(&out, &bytes).with_context(|| format!("writing {}", out.display()))?;
                eprintln!("tenant {tenant}: {len} bytes, {qps} QPs, in {}", out.display());
            }
            if let (Some(rfile), Some(name)) = (region, who.vm.as_deref()) {
                let n = save_region(&socket, name, &rfile)?;
                eprintln!("VM {name:?}: its region's {n} bytes in {}", rfile.display());
            }
        }
        Command::Import { input, region, vm } => {
            anyhow::ensure!(
                region.is_some() == vm.is_some(),
                "--region RFILE and --vm NAME go together: the VM whose region RFILE fills"
            );
            let file = snapshot_file(&input)?;
            if let (Some(rfile), Some(name)) = (region, vm.as_deref()) {
                load_region(&socket, name, &rfile)?;
            }
            let (tenant, qps) =
                vrdma::migrate::import(&socket, file.as_fd()).with_context(|| at("import"))?;
            println!("tenant {tenant} imported, paused: {qps} QPs");
        }
        Command::Resume { who } => {
            let tenant = who.tenant(&socket)?;
            let qps = vrdma::migrate::resume(&socket, tenant).with_context(|| at("resume"))?;
            println!("tenant {tenant} resumed: {qps} QPs");
        }
        Command::Finish { who } => {
            let tenant = who.tenant(&socket)?;
            let (qps, contexts) = vrdma::migrate::finish(&socket, tenant).with_context(|| at("finish"))?;
            println!("tenant {tenant} dropped here: {qps} QPs, {contexts} contexts");
        }
        Command::Move { who, to } => move_tenant(&socket, &to, who.tenant(&socket)?, who.vm.as_deref())?,
    }
    Ok(())
}

/// Why a [`move_tenant`] stopped, and where that left the tenant.
#[derive(Debug)]
pub(crate) enum MoveError {
    /// Nothing moved: the tenant serves on at the source (never paused,
    /// or resumed there after a refusal).
    AtSource(anyhow::Error),
    /// Stopped past the point of return, or the source's resume failed:
    /// the error says where the tenant is and what to do.
    Stuck(anyhow::Error),
}

impl MoveError {
    pub(crate) fn into_inner(self) -> anyhow::Error {
        match self {
            MoveError::AtSource(e) | MoveError::Stuck(e) => e,
        }
    }
}

/// What a [`move_tenant`] moved: QPs and bytes of device state.
pub(crate) struct Moved {
    pub qps: u32,
    pub bytes: u64,
}

fn move_tenant(from: &Path, to: &Path, tenant: u32, vm: Option<&str>) -> Result<()> {
    let m = move_steps(from, to, tenant, vm).map_err(MoveError::into_inner)?;
    println!("tenant {tenant} moved: {} QPs, {} bytes of device state", m.qps, m.bytes);
    Ok(())
}

/// Every step; a refusal after the pause resumes the tenant at the source.
/// For a VM (`vm`), the VM's region is copied from the source's daemon to
/// the destination's after the export: the last pass over the region that
/// QEMU's migration cannot make (it does not see the daemon's writes), so
/// this must run once QEMU's migration has completed (the destination
/// QEMU loaded, its CPUs not yet running: docs/migration.md).
pub(crate) fn move_steps(
    from: &Path,
    to: &Path,
    tenant: u32,
    vm: Option<&str>,
) -> std::result::Result<Moved, MoveError> {
    let qps = vrdma::migrate::pause(from, tenant)
        .with_context(|| format!("pause at {}", from.display()))
        .map_err(MoveError::AtSource)?;
    let cancel = |why: anyhow::Error| -> MoveError {
        match vrdma::migrate::resume(from, tenant) {
            Ok(_) => MoveError::AtSource(
                why.context(format!("migration cancelled; tenant {tenant} resumed at {}", from.display())),
            ),
            Err(e) => MoveError::Stuck(
                why.context(format!("migration failed and resuming at the source failed too: {e}")),
            ),
        }
    };
    let (snapshot, len, _) = vrdma::migrate::export(from, tenant)
        .with_context(|| format!("export at {}", from.display()))
        .map_err(cancel)?;
    if let Some(name) = vm {
        copy_region(from, to, name).map_err(cancel)?;
    }
    vrdma::migrate::import(to, snapshot.as_fd())
        .with_context(|| format!("import at {}", to.display()))
        .map_err(cancel)?;
    // From here the destination holds it: the source lets go first, so
    // that the two never both serve it.
    vrdma::migrate::finish(from, tenant)
        .with_context(|| {
            format!(
                "finish at {} (the tenant is imported, paused, at {}: pause and finish it there to cancel)",
                from.display(),
                to.display()
            )
        })
        .map_err(MoveError::Stuck)?;
    vrdma::migrate::resume(to, tenant)
        .with_context(|| format!("resume at {}", to.display()))
        .map_err(MoveError::Stuck)?;
    Ok(Moved { qps, bytes: len })
}

/// Writes VM `name`'s region on the daemon at `socket` to `out` (a new
/// file, mode 0600: it is the guest's memory); returns its length.
pub(crate) fn save_region(socket: &Path, name: &str, out: &Path) -> Result<u64> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let r = vrdma::vm::attach_at(socket, name)
        .with_context(|| format!("VM {name:?}'s region at {}", socket.display()))?;
    let (region, len) = (std::fs::File::from(r.region), r.region_len);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(out)
        .with_context(|| format!("creating {}", out.display()))?;
    copy_bytes(&region, &file, len, &format!("VM {name:?}'s region"), &out.display().to_string())?;
    Ok(len)
}

/// Writes `input` (from [`save_region`]) into VM `name`'s region on the
/// daemon at `socket`; its length must be the region's (the same
/// `[vms.NAME]` on both hosts).
pub(crate) fn load_region(socket: &Path, name: &str, input: &Path) -> Result<()> {
    let file = std::fs::File::open(input).with_context(|| format!("opening {}", input.display()))?;
    let meta = file.metadata().with_context(|| format!("reading {}", input.display()))?;
    anyhow::ensure!(meta.is_file(), "{} is not a regular file", input.display());
    let r = vrdma::vm::attach_at(socket, name)
        .with_context(|| format!("VM {name:?}'s region at {}", socket.display()))?;
    let (region, len) = (std::fs::File::from(r.region), r.region_len);
    anyhow::ensure!(
        meta.len() == len,
        "{} holds {} bytes, VM {name:?}'s region here {len}: configure the same [vms.{name}] on both",
        input.display(),
        meta.len()
    );
    copy_bytes(&file, &region, len, &input.display().to_string(), &format!("VM {name:?}'s region"))
}

/// Copies VM `name`'s region on the daemon at `from` into its region on
/// the daemon at `to` (both attached here, so both on this machine).
fn copy_region(from: &Path, to: &Path, name: &str) -> Result<()> {
    let a = vrdma::vm::attach_at(from, name)
        .with_context(|| format!("VM {name:?}'s region at {}", from.display()))?;
    let c = vrdma::vm::attach_at(to, name)
        .with_context(|| format!("VM {name:?}'s region at {}", to.display()))?;
    anyhow::ensure!(
        a.region_len == c.region_len,
        "VM {name:?} has a region of {} bytes at {} and of {} at {}: configure the same [vms.{name}] on both",
        a.region_len,
        from.display(),
        c.region_len,
        to.display()
    );
    let len = a.region_len;
    let (a, c) = (std::fs::File::from(a.region), std::fs::File::from(c.region));
    let what = format!("VM {name:?}'s region");
    copy_bytes(&a, &c, len, &format!("{what} at {}", from.display()), &format!("{what} at {}", to.display()))
}

/// Copies the first `len` bytes of `src` to the same offsets of `dst`, a
/// MiB at a time; `src_name` and `dst_name` say which in an error.
fn copy_bytes(
    src: &std::fs::File,
    dst: &std::fs::File,
    len: u64,
    src_name: &str,
    dst_name: &str,
) -> Result<()> {
    use std::os::unix::fs::FileExt as _;
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0u64;
    while at < len {
        let n = buf.len().min(usize::try_from(len - at).unwrap_or(usize::MAX));
        src.read_exact_at(&mut buf[..n], at).with_context(|| format!("reading {src_name} at {at}"))?;
        dst.write_all_at(&buf[..n], at).with_context(|| format!("writing {dst_name} at {at}"))?;
        at += n as u64;
    }
    Ok(())
}

/// The snapshot memfd's `len` bytes, read from its start: the
/// descriptor shares the daemon's file offset (it came over the socket),
/// which the daemon's writes left at the end, so a plain read gets none.
pub(crate) fn read_all(fd: std::os::fd::OwnedFd, len: u64) -> Result<Vec<u8>> {
    use std::os::unix::fs::FileExt as _;
    let file = std::fs::File::from(fd);
    let size = file.metadata().context("the snapshot's size")?.len();
    anyhow::ensure!(size >= len, "the daemon said the snapshot has {len} bytes, its memfd {size}");
    let mut bytes = vec![0u8; usize::try_from(len).context("the snapshot's size")?];
    file.read_exact_at(&mut bytes, 0).context("reading the snapshot")?;
    Ok(bytes)
}

/// The snapshot as a regular file (stdin is copied into a memfd first: the
/// daemon takes no pipes).
fn snapshot_file(input: &Path) -> Result<std::fs::File> {
    if input != Path::new("-") {
        return std::fs::File::open(input).with_context(|| format!("opening {}", input.display()));
    }
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut std::io::stdin(), &mut bytes)
        .context("reading the snapshot from stdin")?;
    let fd = rustix::fs::memfd_create("vrdma-snapshot", rustix::fs::MemfdFlags::CLOEXEC)?;
    let mut f = std::fs::File::from(fd);
    f.write_all(&bytes)?;
    Ok(f)
}
