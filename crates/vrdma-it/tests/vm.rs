//! VMs (`docs/vms.md`): the daemon keeps a region and a port socket per
//! configured VM and hands them to root or the VM's tenant uid; a guest,
//! emulated here by a host process whose library runs in guest mode
//! (`VRDMA_GUEST_PORT` = the port socket, `VRDMA_GUEST_BAR` = the region
//! memfd inherited as `/proc/self/fd/N`), reaches the device through them
//! alone. The cross-uid test needs root; without it it says so and passes
//! vacuously.

use std::time::Duration;

use anyhow::Result;
use vrdma::wr::{self, SendWrExt};
use vrdma::WcStatus;
use vrdma_it::protocol::{Command, Said};
use vrdma_it::{access_all, pattern, poll_one, DaemonProc, PeerProc, Side, WAIT};

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

/// An emulated guest and a host process of the VM's tenant: the guest's
/// context, PD, CQ, QP and region are made through its port alone, and RC
/// sends and RDMA writes cross both ways.
#[test]
fn an_emulated_guest_exchanges_sends_and_writes_with_a_host_process() -> Result<()> {
    let d = daemon_with_vm("")?;
    let vm = vrdma::vm::attach_at(&d.socket, "t")?;
    let ctx = d.context()?;
    let me = Side::new(&ctx, 1 << 16)?;
    let mut guest = PeerProc::spawn_guest(&vm, "tenant", &["--mr-len", "65536"])?;
    let h = guest.hello()?;
    // The guest is the VM's tenant: ours (a host process of the same uid).
    assert_eq!(h.tenant, ctx.tenant());
    // Its region lies in the VM's region, not in a memfd of its own.
    assert!(bar_mapped(h.pid, &vm)?, "the guest's memory is not in the VM's region");
    me.qp.connect(&h.endpoint, access_all())?;
    guest.call_ok(&Command::Connect { peer: me.endpoint()? })?;

    // Host -> guest: a send, then an RDMA write into the guest's region.
    let data = pattern(3000, 7);
    me.mr.write(0, &data)?;
    guest.call_ok(&Command::PostRecv { count: 1, offset: 0, len: 4096 })?;
    me.qp.post_send(&[wr::send(1, &[me.mr.sge(0, data.len())?])?.signaled()])?;
    assert_eq!(poll_one(&me.cq, WAIT)?.status, WcStatus::Success);
    let wcs = guest.poll(1, WAIT)?;
    assert_eq!(wcs.len(), 1, "{wcs:?}");
    assert_eq!(guest.read(0, data.len())?, data);
    let more = pattern(5000, 8);
    me.mr.write(8192, &more)?;
    me.qp.post_send(&[
        wr::rdma_write(2, &[me.mr.sge(8192, more.len())?], h.addr + 20_000, h.rkey)?.signaled()
    ])?;
    let wc = poll_one(&me.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::Success));
    assert_eq!(guest.read(20_000, more.len())?, more);

    // Guest -> host: a send and a write.
    me.qp.post_recv(&[wr::recv(3, &[me.mr.sge(30_000, 4096)?])?])?;
    let from_guest = pattern(1000, 9);
    guest.call_ok(&Command::Fill { offset: 40_000, data: from_guest.clone() })?;
    guest.call_ok(&Command::Send { wr_id: 4, offset: 40_000, len: from_guest.len(), imm: Some(77) })?;
    let wc = poll_one(&me.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status, wc.byte_len as usize, wc.imm_data), (3, WcStatus::Success, 1000, 77));
    let mut got = vec![0u8; from_guest.len()];
    me.mr.read(30_000, &mut got)?;
    assert_eq!(got, from_guest);
    guest.call_ok(&Command::Flood {
        remote_addr: me.mr.addr() + 50_000,
        rkey: me.mr.rkey(),
        len: 4096,
        count: 3,
    })?;
    // The flood writes the guest's first 4 KiB: the send it received.
    let mut got = vec![0u8; 4096];
    me.mr.read(50_000, &mut got)?;
    assert_eq!(&got[..data.len()], &data[..]);
    assert_eq!(got, guest.read(0, 4096)?);
    Ok(())
}

/// Whether process `pid` maps the VM's region (its inode) anywhere.
fn bar_mapped(pid: u32, vm: &vrdma::vm::VmAttachment) -> Result<bool> {
    let ino = rustix::fs::fstat(&vm.region)?.st_ino;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    Ok(maps.lines().any(|l| l.split_whitespace().nth(4) == Some(&ino.to_string())))
}
