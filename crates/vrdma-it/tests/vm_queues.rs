//! Deep queues in a guest (`docs/vms.md`, "Memory"): a guest's rings lie
//! in its VM's region, whose size the host fixes (`memory_mib`), so what
//! a queue takes there is what decides how many a guest can have. An
//! emulated guest (this process's library in guest mode on the VM's port
//! socket and region memfd) makes the queues of Debian's
//! `ucmatose -C 16000` per connection: two CQs of 16000 and an RC QP of
//! 16000 WRs each way. Three such connections fit a 16 MiB region, with
//! the direct path on (the daemon's default): a guest's RC QP gets no
//! inbox, which no direct-path requester ever fills for a guest and which
//! took 1 MiB of the region per QP here (three connections did not fit,
//! and `ucmatose -c 3 -C 16000` in a real guest never began its
//! transfers: its client failed, its server waited for the third
//! connection). A fourth is refused with `ENOMEM` and the daemon's reason,
//! naming the host's `memory_mib`.

use std::os::fd::AsRawFd;

use anyhow::Result;
use vrdma::{CompletionQueue, QpCap, QpInit, QueuePair};
use vrdma_it::DaemonProc;

/// ucmatose's `-C`: each queue's depth (granted as 16384).
const DEPTH: u32 = 16000;

/// The queues of one ucmatose connection (its PD made first).
fn connection(pd: &vrdma::ProtectionDomain) -> vrdma::Result<(CompletionQueue, CompletionQueue, QueuePair)> {
    let ctx = pd.context();
    let send_cq = ctx.create_cq(DEPTH, None)?;
    let recv_cq = ctx.create_cq(DEPTH, None)?;
    let cap = QpCap {
        max_send_wr: DEPTH,
        max_recv_wr: DEPTH,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let qp = pd.create_qp(&QpInit::rc(&send_cq, &recv_cq, cap))?;
    Ok((send_cq, recv_cq, qp))
}

#[test]
fn three_connections_of_deep_queues_fit_a_16_mib_guest_region_and_a_fourth_is_refused_saying_why(
) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let d = DaemonProc::start_with_config(&format!("[vms.t]\ntenant = {uid}\nmemory_mib = 16\nports = 2\n"))?;
    let vm = vrdma::vm::attach_at(&d.socket, "t")?;
    let cfg = vrdma::guest::GuestConfig {
        ports: vec![vm.port_socket.clone()],
        bar: format!("/proc/self/fd/{}", vm.region.as_raw_fd()).into(),
    };
    let gctx = vrdma::Context::open_guest(&cfg)?;
    let pds: Vec<_> = (0..4).map(|_| gctx.alloc_pd()).collect::<vrdma::Result<_>>()?;
    let mut held = Vec::new();
    for (i, pd) in pds.iter().take(3).enumerate() {
        let c = connection(pd).unwrap_or_else(|e| panic!("connection {i}'s queues: {e}"));
        assert_eq!(c.2.cap().max_recv_wr, 16384);
        held.push(c);
    }
    let Err(e) = connection(&pds[3]) else { panic!("a fourth connection's queues in 16 MiB") };
    assert_eq!(e.errno(), libc::ENOMEM, "{e}");
    let text = e.to_string();
    assert!(text.contains("VM \"t\"'s region (16 MiB") && text.contains("memory_mib"), "{text}");
    drop(held);
    // Given back: a fourth fits again.
    connection(&pds[3])?;
    Ok(())
}
