//! `vrdma vm`: the host operator's side of a VM (issue 18, `docs/vms.md`).
//!
//! - `vrdma vm run NAME [--qemu PATH] -- [QEMU ARGS...]` attaches the
//!   daemon's VM `NAME` (`vrdma::vm::attach`: its region memfd, port
//!   socket and port count), keeps the region open across `exec` under
//!   its own descriptor number, and replaces itself with QEMU given the
//!   contract's arguments (`vrdma_guest::vm_args`) followed by the user's.
//!   The full command line goes to stderr first, so that what runs is
//!   never a guess.
//! - `vrdma vm args NAME --fd N` prints those arguments for a region the
//!   operator's own launcher holds as descriptor `N` (it attaches with
//!   `vrdma::vm::attach` itself), shell-quoted on one line.
//! - `vrdma vm image --out DIR` builds the guest image
//!   (`vrdma_guest::image::export`): a Debian cloud kernel and an
//!   initramfs with this `vrdma`, the drop-in libraries `vrdma run` would
//!   use, and Debian's verbs tools, and the operator's own programs
//!   (`--program PATH`, at `/usr/bin/NAME` with their libraries).
//! - `vrdma vm migrate NAME --to SOCKET --qmp PATH --to-qmp PATH --uri
//!   URI` live-migrates the VM: QEMU's migration and the daemon step in
//!   their order ([`super::vm_migrate`]).
//! - `vrdma vm savevm|loadvm NAME --qmp PATH --tag TAG --dir DIR`: QEMU's
//!   snapshots with the daemon's step beside each ([`super::vm_snapshot`]).
//!
//! This module only turns the CLI into those calls and their errors into
//! messages an operator can act on.

use std::ffi::OsString;
use std::os::fd::IntoRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _, Result};

#[derive(clap::Subcommand)]
pub enum Command {
    /// Attach VM NAME (a `[vms.NAME]` of the daemon's config) and exec QEMU with its arguments, then yours.
    Run {
        /// The VM's name in the daemon's config.
        name: String,
        /// The QEMU binary.
        #[arg(long, default_value = vrdma_guest::guest::QEMU)]
        qemu: PathBuf,
        /// QEMU's other arguments (kernel, initrd, memory, accelerator, console), after `--`.
        #[arg(last = true, value_name = "QEMU ARGS")]
        qemu_args: Vec<OsString>,
    },
    /// Print the QEMU arguments that attach VM NAME, for a region your launcher holds as descriptor N.
    Args {
        /// The VM's name in the daemon's config.
        name: String,
        /// The descriptor number QEMU will have the region under (without close-on-exec).
        #[arg(long, value_name = "N")]
        fd: i32,
    },
    /// Build the guest image: a Debian cloud kernel and an initramfs with vrdma, its drop-in libraries and Debian's verbs tools.
    Image {
        /// Where `vmlinuz` and `initramfs.cpio` go.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Leave Debian's verbs tools (ibverbs-utils, perftest, qperf) out of the image.
        #[arg(long)]
        no_tools: bool,
        /// Also put this host program (a path, or a name on PATH) in the image at /usr/bin/NAME, with the libraries it loads (repeatable).
        #[arg(long, value_name = "PROGRAM")]
        program: Vec<String>,
    },
    /// Live-migrate VM NAME to another daemon: QEMU's migration, then the daemon step, then the destination's cont.
    Migrate(super::vm_migrate::Args),
    /// QEMU's savevm TAG with the daemon's step: the tenant's state and the region's bytes kept beside it in DIR.
    Savevm(super::vm_snapshot::SaveArgs),
    /// QEMU's loadvm TAG with the daemon's step: the running copy's state dropped, the saved one imported.
    Loadvm(super::vm_snapshot::Args),
}

impl Command {
    /// The subcommand's name where it asks the daemon (the host's:
    /// `embedded::host_only`); `image` needs none.
    pub fn needs_daemon(&self) -> Option<&'static str> {
        match self {
            Command::Run { .. } => Some("vm run"),
            Command::Args { .. } => Some("vm args"),
            Command::Image { .. } => None,
            Command::Migrate(_) => Some("vm migrate"),
            Command::Savevm(_) => Some("vm savevm"),
            Command::Loadvm(_) => Some("vm loadvm"),
        }
    }
}

pub fn run(socket: Option<PathBuf>, cmd: Command) -> Result<()> {
    let socket = socket.unwrap_or_else(vrdmad::default_socket_path);
    match cmd {
        Command::Run { name, qemu, qemu_args } => exec_qemu(&socket, &name, &qemu, qemu_args),
        Command::Args { name, fd } => {
            let a = attach(&socket, &name)?;
            let args = vrdma_guest::vm_args(fd, a.region_len, &a.port_socket, a.ports)?;
            println!("{}", shell_line(&args));
            Ok(())
        }
        Command::Image { out, no_tools, program } => image(&out, no_tools, &program),
        Command::Migrate(a) => super::vm_migrate::run(&super::vm_migrate::Request {
            name: &a.name,
            from: &socket,
            to: &a.to,
            qmp: &a.qmp,
            to_qmp: &a.to_qmp,
            uri: &a.uri,
            quit_source: a.quit_source,
        }),
        Command::Savevm(a) => super::vm_snapshot::save(&socket, &a),
        Command::Loadvm(a) => super::vm_snapshot::load(&socket, &a),
    }
}

/// Attaches `name`, with messages that say what to do.
fn attach(socket: &Path, name: &str) -> Result<vrdma::vm::VmAttachment> {
    vrdma::vm::attach_at(socket, name).map_err(|e| attach_error(socket, name, e))
}

/// An operator's reading of why attaching failed.
fn attach_error(socket: &Path, name: &str, e: vrdma::Error) -> anyhow::Error {
    match e {
        vrdma::Error::Connect { path, source } => anyhow::anyhow!(
            "no vRDMA daemon answers on {} ({source}); start one with `vrdma daemon --config FILE` \
             whose config has a [vms.{name}] table",
            path.display()
        ),
        vrdma::Error::Daemon { errno: libc::ENOENT, message } => anyhow::anyhow!(
            "the daemon on {} has no VM {name:?} ({message}); add a [vms.{name}] table to its config and restart it",
            socket.display()
        ),
        vrdma::Error::Daemon { errno: libc::EPERM, message } => {
            anyhow::anyhow!("not allowed to attach VM {name:?}: {message}")
        }
        e => anyhow::Error::new(e).context(format!("attaching VM {name:?} through {}", socket.display())),
    }
}

/// The whole command line: QEMU, the contract's arguments, the user's.
pub fn qemu_command(qemu: &Path, contract: Vec<OsString>, user: Vec<OsString>) -> Vec<OsString> {
    let mut v = vec![qemu.as_os_str().to_owned()];
    v.extend(contract);
    v.extend(user);
    v
}

fn exec_qemu(socket: &Path, name: &str, qemu: &Path, user: Vec<OsString>) -> Result<()> {
    let a = attach(socket, name)?;
    let fd = a.region.into_raw_fd();
    // The region must survive exec: QEMU opens /proc/self/fd/N.
    // SAFETY: `fd` is the region descriptor this process just took
    // ownership of; clearing its flags (FD_CLOEXEC) touches nothing else.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, 0) } != 0 {
        bail!("keeping the VM's region open for QEMU: {}", std::io::Error::last_os_error());
    }
    let contract = vrdma_guest::vm_args(fd, a.region_len, &a.port_socket, a.ports)?;
    let line = qemu_command(qemu, contract, user);
    eprintln!("vrdma vm run: {}", shell_line(&line));
    let err = std::process::Command::new(&line[0]).args(&line[1..]).exec();
    let hint = if err.kind() == std::io::ErrorKind::NotFound {
        " (install qemu-system-x86, or name the binary with --qemu)"
    } else {
        ""
    };
    bail!("cannot run {}: {err}{hint}", qemu.display())
}

fn image(out: &Path, no_tools: bool, programs: &[String]) -> Result<()> {
    // The libraries `vrdma run` would give a program on this host (beside
    // this executable, or the files VRDMA_VERBS_LIB, VRDMA_RDMACM_LIB and
    // VRDMA_COMPANIONS_LIB name), so that guests run what hosts run.
    let drop_in = vrdma_guest::DropIn {
        vrdma: std::env::current_exe().context("finding this executable")?,
        verbs: super::run::find_library()?,
        rdmacm: super::run::find_rdmacm()?,
        companions: super::run::find_companions()?,
    };
    let mut spec = vrdma_guest::ImageSpec::default().with_drop_in(drop_in);
    if !no_tools {
        spec = spec.debian_tools().context(
            "Debian's verbs tools go in the image (apt-get install ibverbs-utils perftest qperf, or --no-tools)",
        )?;
    }
    // The operator's own programs; their libibverbs (and the other
    // drop-in sonames) is the drop-in's, as for Debian's tools.
    for p in programs {
        spec = spec.program(p).with_context(|| format!("--program {p}"))?;
    }
    let img = vrdma_guest::image::export(&spec, out)?;
    println!("kernel:    {} ({})", img.kernel.display(), img.release);
    println!("initramfs: {}", img.initramfs.display());
    println!(
        "run it:    vrdma vm run NAME -- -accel kvm -m 1024 -nographic -kernel {} -initrd {} \
         -append 'console=ttyS0 {}' -nic user,model=virtio-net-pci",
        img.kernel.display(),
        img.initramfs.display(),
        vrdma_guest::guest::CONSOLE_SHELL_ARG
    );
    Ok(())
}

/// `args` as one line a POSIX shell reads back as the same words.
pub fn shell_line(args: &[OsString]) -> String {
    args.iter().map(|a| shell_quote(&a.to_string_lossy())).collect::<Vec<_>>().join(" ")
}

fn shell_quote(s: &str) -> String {
    let plain = !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=,:+@%".contains(c));
    if plain {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_qemu_then_the_contract_then_the_users() {
        let contract = vrdma_guest::vm_args(5, 8 << 20, Path::new("/run/v/vm-a.sock"), 1).unwrap();
        let n = contract.len();
        let line = qemu_command(Path::new("/usr/bin/qemu"), contract, vec!["-m".into(), "512".into()]);
        assert_eq!(line[0], "/usr/bin/qemu");
        assert_eq!(
            line[1..3],
            ["-object", "memory-backend-file,id=vrdma-mem,share=on,mem-path=/proc/self/fd/5,size=8388608"]
        );
        assert_eq!(line[n + 1..], ["-m", "512"]);
    }

    #[test]
    fn shell_lines_read_back_as_the_same_words() {
        let words: Vec<OsString> = ["qemu", "-append", "console=ttyS0 quiet", "it's", "", "a,b=c"]
            .iter()
            .map(OsString::from)
            .collect();
        let line = shell_line(&words);
        assert_eq!(line, r#"qemu -append 'console=ttyS0 quiet' 'it'\''s' '' a,b=c"#);
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("for w in {line}; do printf '[%s]' \"$w\"; done"))
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "[qemu][-append][console=ttyS0 quiet][it's][][a,b=c]"
        );
    }

    #[test]
    fn attach_errors_say_what_to_do() {
        let s = Path::new("/run/x.sock");
        let no_daemon =
            vrdma::Error::Connect { path: s.into(), source: std::io::Error::from_raw_os_error(libc::ENOENT) };
        let m = attach_error(s, "a", no_daemon).to_string();
        assert!(m.contains("no vRDMA daemon answers on /run/x.sock") && m.contains("[vms.a]"), "{m}");
        let unknown = vrdma::Error::Daemon { errno: libc::ENOENT, message: "no VM".into() };
        let m = attach_error(s, "a", unknown).to_string();
        assert!(m.contains("has no VM \"a\"") && m.contains("add a [vms.a] table"), "{m}");
        let perm = vrdma::Error::Daemon { errno: libc::EPERM, message: "belongs to uid 7".into() };
        let m = attach_error(s, "a", perm).to_string();
        assert!(m.contains("not allowed to attach VM \"a\": belongs to uid 7"), "{m}");
    }
}
