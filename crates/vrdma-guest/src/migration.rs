//! The QEMUs of one VM that migrates between daemons: each runs under
//! `vrdma --socket S vm run NAME --` (which adds the VM contract's
//! arguments, [`crate::vm_args`], from that daemon's VM), answers QMP on
//! a socket of its own, and a destination starts stopped, waiting for the
//! VM (`-S -incoming URI`).
//!
//! One definition because two harnesses start these QEMUs: `vrdma bench
//! --migrate` measures the downtime of the very migrations that the
//! real-guest tests (`tests/guest_migrate`) check; were their QEMUs built
//! apart, the figures would be of another VM than the one tested.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::{Error, Guest, GuestSpec, Image, Qmp, Result};

/// The VM's memory (MiB).
pub const MEMORY_MIB: u32 = 256;
/// How long a source may take to boot (TCG on loaded cores) or a
/// destination to start.
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(180);

/// A VM that QEMU moves between the daemons of several hosts.
pub struct MigrationVm {
    pub image: Image,
    /// The `vrdma` executable whose `vm run` execs QEMU.
    pub vrdma: PathBuf,
    /// The VM's name in the daemons' configurations.
    pub name: String,
    pub memory_mib: u32,
    /// QEMU arguments every QEMU of the VM gets (a disk shared by source
    /// and destination), before a call's own.
    pub extra_args: Vec<OsString>,
    /// Where [`MigrationVm::incoming`] puts a destination's QMP socket.
    pub dir: PathBuf,
}

impl MigrationVm {
    pub fn new(image: Image, vrdma: PathBuf, name: &str, dir: &Path) -> MigrationVm {
        MigrationVm {
            image,
            vrdma,
            name: name.into(),
            memory_mib: MEMORY_MIB,
            extra_args: Vec::new(),
            dir: dir.into(),
        }
    }

    /// The VM on the daemon at `socket`, its QMP at `qmp`, `more` QEMU
    /// arguments after the VM's own.
    pub fn spec(&self, socket: &Path, qmp: &Path, more: &[&str]) -> GuestSpec {
        let mut s = GuestSpec::new(self.image.clone());
        s.memory_mib = self.memory_mib;
        s.launcher = vec![
            self.vrdma.clone().into(),
            "--socket".into(),
            socket.into(),
            "vm".into(),
            "run".into(),
            self.name.clone().into(),
            "--".into(),
        ];
        s.extra_args = vec!["-qmp".into(), format!("unix:{},server=on,wait=off", qmp.display()).into()];
        s.extra_args.extend(self.extra_args.iter().cloned());
        s.extra_args.extend(more.iter().map(Into::into));
        s.boot_timeout = BOOT_TIMEOUT;
        s
    }

    /// A destination for `like`'s VM on the daemon at `socket`: QEMU with
    /// its CPUs stopped, waiting for the VM from `incoming` (a QEMU
    /// `-incoming` URI), its QMP (at `qmp-TAG.sock` in the VM's folder)
    /// connected and that socket's path.
    pub fn incoming(
        &self,
        tag: &str,
        socket: &Path,
        incoming: &str,
        like: &Guest,
    ) -> Result<(Guest, Qmp, PathBuf)> {
        let qmp = self.dir.join(format!("qmp-{tag}.sock"));
        let g = Guest::incoming(self.spec(socket, &qmp, &["-S", "-incoming", incoming]), like)?;
        let mut q = Qmp::connect(&qmp)?;
        let st = q.status()?;
        if st != "inmigrate" {
            return Err(Error::Invalid(format!("the destination QEMU is {st}, not waiting for the VM")));
        }
        Ok((g, q, qmp))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_runs_qemu_under_vm_run_with_its_qmp_then_the_vms_then_the_calls_arguments() {
        let image = Image { kernel: "/k".into(), initramfs: "/i".into(), release: "6.1".into() };
        let mut vm = MigrationVm::new(image, "/bin/vrdma".into(), "t", Path::new("/w"));
        vm.extra_args = vec!["-drive".into(), "file=d".into()];
        let s = vm.spec(Path::new("/a.sock"), Path::new("/w/q.sock"), &["-S"]);
        let l: Vec<&str> = s.launcher.iter().map(|a| a.to_str().unwrap()).collect();
        assert_eq!(l, ["/bin/vrdma", "--socket", "/a.sock", "vm", "run", "t", "--"]);
        let a: Vec<&str> = s.extra_args.iter().map(|a| a.to_str().unwrap()).collect();
        assert_eq!(a, ["-qmp", "unix:/w/q.sock,server=on,wait=off", "-drive", "file=d", "-S"]);
        assert_eq!((s.memory_mib, s.boot_timeout), (MEMORY_MIB, BOOT_TIMEOUT));
    }
}
