//! Where `vrdma bench --migrate` runs: three daemons of its own playing
//! three hosts (A and C with VM `t`, B the peer) on three loopback
//! addresses, linked over the TCP transport, and the guest's image with
//! `seqstream` (the stream's program, compiled here from the source the
//! real-guest tests use). Loopback rather than namespaces: the bench needs
//! no root, and what it measures (QEMU's stop, the daemons' step, B's
//! pause) crosses the daemons' links either way.
//!
//! What it needs and may lack (QEMU, a compiler and the verbs headers, a
//! guest kernel) is a [`Missing`]: the report says why it has no rows.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use vrdma_guest::MigrationVm;

use crate::study::placement::{self, Env};
use crate::study::proc::Proc;

/// The stream's program, the same source `tests/guest_migrate` builds.
const SEQSTREAM_C: &str = include_str!("../../../tests/c/seqstream.c");
/// The VM's vRDMA region (MiB).
const REGION_MIB: u32 = 16;

/// Something the bench needs that this host lacks: no rows, and why.
#[derive(Debug)]
pub struct Missing(pub String);

impl std::fmt::Display for Missing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Missing {}

/// The run's directory, removed on drop (after everything in it stopped:
/// it is the last field of [`World`]).
struct WorkDir(PathBuf);

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One daemon: its process (stopped by pid on drop) and control socket.
pub struct Host {
    _proc: Proc,
    pub socket: PathBuf,
}

pub struct World {
    pub a: Host,
    pub b: Host,
    pub c: Host,
    /// VM `t`'s QEMUs (the same as the real-guest tests').
    pub vm: MigrationVm,
    exe: PathBuf,
    // Dropped last: the daemons' sockets and logs are in it.
    dir: WorkDir,
}

/// Fails with [`Missing`] where QEMU, `cc` or the verbs headers are absent.
fn check_tools() -> Result<()> {
    if vrdma_guest::libs::which(vrdma_guest::guest::QEMU).is_none() {
        bail!(Missing(format!(
            "{} is not installed (apt-get install qemu-system-x86 busybox-static)",
            vrdma_guest::guest::QEMU
        )));
    }
    if vrdma_guest::libs::which("cc").is_none() || !Path::new("/usr/include/infiniband/verbs.h").exists() {
        bail!(Missing(
            "the guest's stream program needs cc and the verbs headers (apt-get install gcc libibverbs-dev)"
                .into()
        ));
    }
    Ok(())
}

impl World {
    /// Builds the image (a [`Missing`] if the guest kernel cannot be had)
    /// and starts the three daemons, linked.
    pub fn new(progress: &dyn Fn(&str)) -> Result<World> {
        check_tools()?;
        let exe = std::env::current_exe().context("where is the vrdma executable")?;
        let dir = WorkDir(std::env::temp_dir().join(format!("vrdma-bench-migrate-{}", std::process::id())));
        let _ = std::fs::remove_dir_all(&dir.0);
        std::fs::create_dir_all(&dir.0)?;
        let prog = dir.0.join("seqstream");
        let src = dir.0.join("seqstream.c");
        std::fs::write(&src, SEQSTREAM_C)?;
        let cc =
            Command::new("cc").args(["-O1", "-Wall", "-o"]).arg(&prog).arg(&src).arg("-libverbs").output()?;
        if !cc.status.success() {
            bail!(Missing(format!("cc seqstream.c failed: {}", String::from_utf8_lossy(&cc.stderr).trim())));
        }
        progress("building the guest image");
        let drop_in = vrdma_guest::DropIn {
            vrdma: exe.clone(),
            verbs: crate::cmd::run::find_library()?,
            rdmacm: crate::cmd::run::find_rdmacm()?,
            companions: crate::cmd::run::find_companions()?,
        };
        let mut spec = vrdma_guest::ImageSpec::default().with_drop_in(drop_in);
        spec.files.push(vrdma_guest::GuestFile {
            host: prog,
            guest: "/usr/bin/seqstream".into(),
            libraries: true,
        });
        let image = vrdma_guest::image::build(&spec).map_err(|e| {
            Missing(format!("the guest image (a guest kernel, busybox) cannot be built here: {e}"))
        })?;

        progress("starting three daemons (A, C with VM t; B the peer)");
        let ips = ["127.0.0.2", "127.0.0.3", "127.0.0.4"];
        let port = crate::study::proc::free_port(None, ips[0].parse()?)?;
        let psk = placement::psk();
        // SAFETY: geteuid cannot fail.
        let uid = unsafe { libc::geteuid() };
        let vm = format!("[vms.t]\ntenant = {uid}\nmemory_mib = {REGION_MIB}\nports = 2\n");
        let run_id = format!("{}-bench-migrate", std::process::id());
        let env = Env { exe: &exe, dir: &dir.0, logs: &dir.0, run_id: &run_id };
        let start = |i: usize, name: &str, extra: &str| -> Result<Host> {
            let peers: Vec<String> =
                (0..3).filter(|&j| j != i).map(|j| format!("\"{}:{port}\"", ips[j])).collect();
            let toml = format!(
                "address = \"{ip}\"\n{extra}\n[net]\nlisten = \"{ip}:{port}\"\nport = {port}\npsk = \"{psk}\"\n\
                 peers = [{}]\n",
                peers.join(", "),
                ip = ips[i]
            );
            // A directory each: a VM's port socket lies beside its daemon's.
            let d = dir.0.join(name);
            std::fs::create_dir_all(&d)?;
            let socket = d.join(format!("{name}.sock"));
            let proc = placement::daemon(&env, name, &socket, None, &toml)?;
            Ok(Host { _proc: proc, socket })
        };
        let (a, b, c) = (start(0, "a", &vm)?, start(1, "b", "")?, start(2, "c", &vm)?);
        for h in [&a, &b, &c] {
            wait_links(&h.socket, 2)?;
        }
        let vm = MigrationVm::new(image, exe.clone(), "t", &dir.0);
        Ok(World { a, b, c, vm, exe, dir })
    }

    pub fn dir(&self) -> &Path {
        &self.dir.0
    }

    /// The operator's one daemon step: `vrdma --socket FROM migrate move
    /// --vm t --to TO`.
    pub fn move_vm(&self, from: &Path, to: &Path) -> Result<()> {
        let out = Command::new(&self.exe)
            .arg("--socket")
            .arg(from)
            .args(["migrate", "move", "--vm", "t", "--to"])
            .arg(to)
            .output()?;
        if !out.status.success() {
            bail!(
                "vrdma migrate move --vm t: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }
}

/// Waits (at most 20 s) until the daemon at `socket` has `n` links up.
fn wait_links(socket: &Path, n: usize) -> Result<()> {
    let ctx = vrdma::Context::open_at(socket).context("opening a daemon of the bench")?;
    let end = Instant::now() + Duration::from_secs(20);
    while ctx.stat()?.links.iter().filter(|l| l.up).count() < n {
        if Instant::now() > end {
            bail!("the bench's daemon at {} did not link to the other two within 20 s", socket.display());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}
