//! VMs (`docs/vms.md`): the daemon keeps a region and a port socket per
//! configured VM and hands them to root or the VM's tenant uid; a guest,
//! emulated here by a host process whose library runs in guest mode
//! (`VRDMA_GUEST_PORT` = the port socket, `VRDMA_GUEST_BAR` = the region
//! memfd inherited as `/proc/self/fd/N`), reaches the device through them
//! alone. The cross-uid test needs root; without it it says so and passes
//! vacuously.

use std::time::Duration;

use anyhow::Result;
use vrdma_it::protocol::Said;
use vrdma_it::{DaemonProc, PeerProc};

const NOBODY: u32 = 65534;

fn root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A daemon with VM `t` of the test's own uid (and `extra` in its table).
fn daemon_with_vm(extra: &str) -> Result<DaemonProc> {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    DaemonProc::start_with_config(&format!("[vms.t]\ntenant = {uid}\nmemory_mib = 8\nports = 2\n{extra}"))
}

#[test]
fn attach_hands_the_region_and_port_socket_to_the_vms_tenant_only() -> Result<()> {
    let d = daemon_with_vm("")?;
    let a = vrdma::vm::attach_at(&d.socket, "t")?;
    assert_eq!(a.region_len, 8 << 20);
    assert_eq!(a.ports, 2);
    assert_eq!(a.port_socket, d.socket.parent().unwrap().join("vm-t.sock"));
    let st = rustix::fs::fstat(&a.region)?;
    assert_eq!(st.st_size as u64, a.region_len);
    // Sealed: nobody can take pages from under the daemon.
    let seals = rustix::fs::fcntl_get_seals(&a.region)?;
    assert!(seals.contains(rustix::fs::SealFlags::SHRINK | rustix::fs::SealFlags::GROW), "{seals:?}");
    let meta = std::fs::metadata(&a.port_socket)?;
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777, 0o600);

    let e = vrdma::vm::attach_at(&d.socket, "nope").unwrap_err();
    assert_eq!(e.errno(), libc::ENOENT, "{e}");
    assert!(e.to_string().contains("no VM \"nope\""), "{e}");

    if !root() {
        vrdma_it::skip(format!("the cross-uid half needs root (to attach as uid {NOBODY})"));
        return Ok(());
    }
    let p = PeerProc::spawn_as(&d.socket, "vm-attach", &["--vm", "t"], Some(NOBODY))?;
    match p.recv::<Said>(Duration::from_secs(20))? {
        Said::Error { errno, message } => {
            assert_eq!(errno, libc::EPERM, "{message}");
            assert!(message.contains("only that uid or root"), "{message}");
        }
        other => panic!("uid {NOBODY} attached VM t: {other:?}"),
    }
    Ok(())
}
