//! The drop-in `libibverbs.so.1` in guest mode (`docs/vms.md`): unmodified
//! ibverbs-utils in an emulated guest (a host process with
//! `VRDMA_GUEST_PORT` = the VM's port socket and `VRDMA_GUEST_BAR` = its
//! region memfd, inherited as `/proc/self/fd/100`) against a daemon this
//! test runs, and `ibv_rc_pingpong` between such a guest and a host
//! process of the VM's tenant. Skipped, saying so, without ibverbs-utils.

#![cfg(all(target_os = "linux", target_arch = "x86_64"))]

mod common;

use common::{free_port, listening, one_at_a_time, spawn, Finished};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const DEVINFO: &str = "/usr/bin/ibv_devinfo";
const PINGPONG: &str = "/usr/bin/ibv_rc_pingpong";
const LIMIT: Duration = Duration::from_secs(120);
const BAR_FD: i32 = 100;

/// The cdylib cargo built for this test run (as in `tools.rs`).
fn shim() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let deps = exe.parent().expect("deps dir");
    let profile = if deps.ends_with("deps") { deps.parent().expect("profile dir") } else { deps };
    [deps, profile]
        .iter()
        .map(|d| d.join("libvrdma_verbs.so"))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("libvrdma_verbs.so was not built next to {}", exe.display()))
}

/// A daemon with VM `t` of our uid, the drop-in's directory and the VM
/// attached.
struct Vm {
    dir: tempfile::TempDir,
    vm: vrdma::vm::VmAttachment,
    _daemon: vrdmad::Daemon,
}

impl Vm {
    fn start() -> Option<Vm> {
        if !Path::new(DEVINFO).exists() {
            vrdma_it::skip(format!("{DEVINFO} is missing (apt-get install ibverbs-utils)"));
            return None;
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let lib = dir.path().join("lib");
        std::fs::create_dir(&lib).expect("lib dir");
        std::os::unix::fs::symlink(shim(), lib.join("libibverbs.so.1")).expect("symlink");
        let socket = dir.path().join("vrdma.sock");
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        let mut config =
            vrdmad::DaemonConfig::from_toml(&format!("[vms.t]\ntenant = {uid}\nmemory_mib = 16"))
                .expect("config");
        config.socket = Some(socket.clone());
        let daemon = vrdmad::Daemon::start(config).expect("start daemon");
        let vm = vrdma::vm::attach_at(&socket, "t").expect("attach");
        Some(Vm { dir, vm, _daemon: daemon })
    }

    /// `program` on the host, through the daemon's socket.
    fn host(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("LD_LIBRARY_PATH", self.dir.path().join("lib"))
            .env("VRDMA_SOCKET", self.dir.path().join("vrdma.sock"))
            .env("LD_BIND_NOW", "1");
        c
    }

    /// `program` in an emulated guest of the VM.
    fn guest(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("LD_LIBRARY_PATH", self.dir.path().join("lib"))
            .env_remove("VRDMA_SOCKET")
            .env(vrdma::guest::PORT_ENV, &self.vm.port_socket)
            .env(vrdma::guest::BAR_ENV, format!("/proc/self/fd/{BAR_FD}"))
            .env("LD_BIND_NOW", "1");
        let region = self.vm.region.as_raw_fd();
        // SAFETY: dup2 is async-signal-safe; the child only moves the
        // region (open in the parent) to BAR_FD without close-on-exec.
        unsafe {
            c.pre_exec(move || {
                if libc::dup2(region, BAR_FD) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        c
    }
}

#[test]
fn devinfo_in_an_emulated_guest_shows_the_device() {
    let Some(vm) = Vm::start() else { return };
    let f = spawn(vm.guest(DEVINFO), "ibv_devinfo (guest)").finish(LIMIT);
    f.assert_ok();
    for want in ["hca_id:\tvrdma0", "PORT_ACTIVE (4)", "vendor_id:\t\t\t0x5652"] {
        assert!(f.stdout.contains(want), "{want:?} missing\n{}", f.describe());
    }
}

/// `ibv_rc_pingpong` with `args`: the server in an emulated guest, the
/// client a host process.
fn pingpong_guest_to_host(args: &[&str]) {
    let Some(vm) = Vm::start() else { return };
    let _turn = one_at_a_time();
    let port = free_port().to_string();
    let mut common = vec!["-p", port.as_str()];
    common.extend_from_slice(args);
    let mut server_cmd = vm.guest(PINGPONG);
    server_cmd.args(&common);
    let mut server = spawn(server_cmd, &format!("ibv_rc_pingpong (guest server) {}", common.join(" ")));
    let end = Instant::now() + Duration::from_secs(30);
    let port_num: u16 = port.parse().expect("port");
    while !listening(port_num) {
        if server.exited() || Instant::now() > end {
            panic!("the server never listened\n{}", server.finish(LIMIT).describe());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut client_cmd = vm.host(PINGPONG);
    client_cmd.args(&common).arg("localhost");
    let client =
        spawn(client_cmd, &format!("ibv_rc_pingpong (host client) {}", common.join(" "))).finish(LIMIT);
    let server: Finished = server.finish(LIMIT);
    for f in [&client, &server] {
        f.assert_ok();
        assert!(f.stdout.contains(" bytes in ") && f.stdout.contains(" iters in "), "{}", f.describe());
        for bad in ["invalid data", "Failed status", "Couldn't"] {
            let all = format!("{}{}", f.stdout, f.stderr);
            assert!(!all.contains(bad), "{bad:?} in the output\n{}", f.describe());
        }
    }
}

#[test]
fn rc_pingpong_between_an_emulated_guest_and_a_host_process() {
    pingpong_guest_to_host(&["-c"]);
}

#[test]
fn rc_pingpong_with_events_between_an_emulated_guest_and_a_host_process() {
    pingpong_guest_to_host(&["-e", "-c"]);
}
