//! Debian's `ucmatose` with deep queues (`-C 16000`: per connection two
//! CQs of 16000 and an RC QP of 16000 WRs each way) with its client in an
//! emulated guest (`VRDMA_GUEST_PORT` = the VM's port socket,
//! `VRDMA_GUEST_BAR` = its region memfd inherited as `/proc/self/fd/100`)
//! of a 16 MiB VM, its server a host process of the VM's tenant.
//!
//! A guest's rings lie in its VM's region (`docs/vms.md`, "Memory").
//! Three connections fit 16 MiB (a guest's RC QP has no direct-path
//! inbox); before, the third QP did not, the client failed with "unable
//! to create QP: Cannot allocate memory" alone, and its server waited for
//! the third connection for ever (a real guest's `ucmatose -c 3 -C 16000`
//! "never began its data transfers"). Four do not fit: the client's
//! drop-in says why once on stderr, naming the host's `memory_mib`, even
//! without `VRDMA_VERBS_DEBUG`.
//!
//! Skipped, saying so, without `/usr/bin/ucmatose`. Every process runs
//! under a limit and is killed by its pid.

#![cfg(all(target_os = "linux", target_arch = "x86_64"))]

mod common;

use common::{built, free_port, one_at_a_time, spawn, Finished, Running};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const UCMATOSE: &str = "/usr/bin/ucmatose";
const LIMIT: Duration = Duration::from_secs(90);
const BAR_FD: i32 = 100;
/// Messages each way per connection (each queue's depth).
const MESSAGES: &str = "16000";

/// A daemon of this process with VM `t` (16 MiB) of our uid, the VM
/// attached, and the drop-in libraries' directory.
struct Vm {
    dir: tempfile::TempDir,
    vm: vrdma::vm::VmAttachment,
    /// The daemon's address (its GID's), where the host server listens.
    addr: String,
    _daemon: vrdmad::Daemon,
}

impl Vm {
    fn start() -> Option<Vm> {
        if !Path::new(UCMATOSE).exists() {
            vrdma_it::skip(format!("{UCMATOSE} is missing (apt-get install rdmacm-utils)"));
            return None;
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let lib = dir.path().join("lib");
        std::fs::create_dir(&lib).expect("lib dir");
        for (target, name) in
            [("libvrdma_verbs.so", "libibverbs.so.1"), ("libvrdma_rdmacm.so", "librdmacm.so.1")]
        {
            std::os::unix::fs::symlink(built(target), lib.join(name)).expect("symlink");
        }
        let socket = dir.path().join("vrdma.sock");
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        // Four ports: the client holds up to three contexts at once (with
        // two, its third was refused now and then, as a VM of two ports
        // would refuse it).
        let toml = format!("[vms.t]\ntenant = {uid}\nmemory_mib = 16\nports = 4\n");
        let mut config = vrdmad::DaemonConfig::from_toml(&toml).expect("config");
        config.socket = Some(socket.clone());
        let daemon = vrdmad::Daemon::start(config).expect("start daemon");
        let vm = vrdma::vm::attach_at(&socket, "t").expect("attach");
        let gid = vrdma::Context::open_at(&socket).and_then(|c| c.query_gid(1, 0)).expect("the daemon's GID");
        let addr = std::net::Ipv4Addr::from(gid.ipv4().expect("an IPv4 GID")).to_string();
        Some(Vm { dir, vm, addr, _daemon: daemon })
    }

    fn lib(&self) -> PathBuf {
        self.dir.path().join("lib")
    }

    /// The server on the host, through the daemon's socket.
    fn server(&self, port: &str, conns: &str) -> Running {
        let mut c = Command::new(UCMATOSE);
        c.env("LD_LIBRARY_PATH", self.lib())
            .env("VRDMA_SOCKET", self.dir.path().join("vrdma.sock"))
            .env("LD_BIND_NOW", "1")
            .args(["-p", port, "-c", conns, "-C", MESSAGES]);
        let mut r = spawn(c, &format!("ucmatose (host server) -c {conns}"));
        let at = std::net::SocketAddrV4::new(self.addr.parse().unwrap(), port.parse().unwrap());
        let socket = self.dir.path().join("vrdma.sock");
        assert!(
            common::wait_listening(&socket, (vrdma::cm::PortSpace::Tcp, at), &mut r, Duration::from_secs(30)),
            "the server never listened\n{}",
            r.finish(Duration::from_secs(1)).describe()
        );
        r
    }

    /// The client in an emulated guest of the VM (no debug output: what
    /// a user sees).
    fn client(&self, port: &str, conns: &str) -> Finished {
        let mut c = Command::new(UCMATOSE);
        c.env("LD_LIBRARY_PATH", self.lib())
            .env_remove("VRDMA_SOCKET")
            .env_remove("VRDMA_VERBS_DEBUG")
            .env_remove("VRDMA_RDMACM_DEBUG")
            .env(vrdma::guest::PORT_ENV, &self.vm.port_socket)
            .env(vrdma::guest::BAR_ENV, format!("/proc/self/fd/{BAR_FD}"))
            .env("LD_BIND_NOW", "1")
            .args(["-s", &self.addr, "-p", port, "-c", conns, "-C", MESSAGES]);
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
        spawn(c, &format!("ucmatose (guest client) -c {conns}")).finish(LIMIT)
    }
}

#[test]
fn three_deep_connections_from_a_16_mib_guest_transfer_all_their_messages() {
    // One daemon at a time (its VM, its port, its address's rdma_cm
    // port space), not only one pair of programs.
    let _turn = one_at_a_time();
    let Some(vm) = Vm::start() else { return };
    let port = free_port().to_string();
    let server = vm.server(&port, "3");
    let client = vm.client(&port, "3");
    if !client.status.success() {
        // Its server waits for the missing connection for ever: killed.
        drop(server);
        panic!("{}", client.describe());
    }
    let server = server.finish(LIMIT);
    for f in [&client, &server] {
        f.assert_ok();
        let all = format!("{}{}", f.stdout, f.stderr);
        for want in ["data transfers complete", "test complete", "return status 0"] {
            assert!(all.contains(want), "{want:?} missing\n{}", f.describe());
        }
        assert!(!all.contains("Warning"), "{}", f.describe());
    }
}

#[test]
fn four_deep_connections_from_a_16_mib_guest_fail_saying_the_region_is_full() {
    // One daemon at a time (its VM, its port, its address's rdma_cm
    // port space), not only one pair of programs.
    let _turn = one_at_a_time();
    let Some(vm) = Vm::start() else { return };
    let port = free_port().to_string();
    // Listening, so that the client's first three connections are not
    // turned away before it makes its fourth's queues. It then waits for
    // the fourth for ever (as on any device): killed when dropped.
    let _server = vm.server(&port, "4");
    let client = vm.client(&port, "4");
    assert!(!client.status.success(), "{}", client.describe());
    let warned: Vec<&str> =
        client.stderr.lines().filter(|l| l.starts_with("libibverbs (vRDMA): Warning:")).collect();
    assert_eq!(warned.len(), 1, "{}", client.describe());
    for want in ["VM \"t\"'s region (16 MiB", "[vms.t] memory_mib", "errno 12"] {
        assert!(warned[0].contains(want), "{want:?} missing\n{}", client.describe());
    }
    assert!(
        client.stdout.contains("Cannot allocate memory") || client.stderr.contains("Cannot allocate memory")
    );
}
