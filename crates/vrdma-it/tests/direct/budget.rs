//! Descriptors the direct path keeps in the daemon (region memfds, QP
//! segments with an inbox, CQ segments, window pages) are charged to the tenant's
//! share (`max_descriptors`): at the limit nothing is kept, the work
//! requests take the engine path and still complete, and every one comes
//! back once the objects are gone. The share is measured by what is
//! left of it: how many completion channels (one descriptor each) a
//! context can still make.

use std::time::Instant;

use anyhow::{bail, Result};
use vrdma::wr::{self, SendWrExt};
use vrdma::{WcOpcode, WcStatus};
use vrdma_it::{poll_one, DaemonProc, WAIT};

use super::{carried, pair, ON};

/// A context's descriptors in the daemon.
const PER_CONTEXT: usize = 8;

/// How many completion channels `ctx` can still make (each one
/// descriptor of the tenant's share); gives them back.
fn channels_left(ctx: &vrdma::Context) -> Result<usize> {
    let mut held = Vec::new();
    while let Ok(ch) = ctx.create_comp_channel() {
        held.push(ch);
        if held.len() > 200 {
            bail!("more channels than the share allows");
        }
    }
    Ok(held.len())
}

/// Waits (bounded) until `want` channels are left: contexts close on the
/// daemon's session threads after the process let go of them.
fn wait_channels_left(ctx: &vrdma::Context, want: usize) -> Result<()> {
    let end = Instant::now() + WAIT;
    loop {
        let got = channels_left(ctx)?;
        if got == want {
            return Ok(());
        }
        if Instant::now() > end {
            bail!("{got} channels left, not {want}: the direct path's descriptors did not come back");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn daemon(share: usize) -> Result<DaemonProc> {
    DaemonProc::start_with_config(&format!("{ON}[quota]\nmax_descriptors = {share}\n"))
}

/// One write and one write with immediate from `a` to `b`, checked.
fn exchange(a: &vrdma_it::Side, b: &vrdma_it::Side) -> Result<()> {
    a.mr.write(0, b"budgeted")?;
    b.qp.post_recv(&[wr::recv(7, &[])?])?;
    a.qp.post_send(&[wr::rdma_write(1, &[a.mr.sge(0, 8)?], b.mr.addr() + 64, b.mr.rkey())?.signaled()])?;
    let wc = poll_one(&a.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status, wc.opcode), (1, WcStatus::Success, WcOpcode::RdmaWrite));
    a.qp.post_send(&[wr::rdma_write(2, &[a.mr.sge(0, 8)?], b.mr.addr() + 128, b.mr.rkey())?
        .with_imm(9)
        .signaled()])?;
    let wc = poll_one(&a.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::Success));
    let wc = poll_one(&b.cq, WAIT)?;
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.imm_data),
        (7, WcStatus::Success, WcOpcode::RecvRdmaWithImm, 9)
    );
    let mut got = [0u8; 8];
    b.mr.read(64, &mut got)?;
    assert_eq!(&got, b"budgeted");
    b.mr.read(128, &mut got)?;
    assert_eq!(&got, b"budgeted");
    Ok(())
}

#[test]
fn a_tenant_at_its_descriptor_share_takes_the_engine_and_gets_them_back() -> Result<()> {
    // Three contexts and four kept descriptors: the first context's pool
    // chunk, its CQ's and QP's segments and its region; the second
    // context's find no room, nor does the window.
    let share = 3 * PER_CONTEXT + 4;
    let d = daemon(share)?;
    let keeper = d.context()?;
    assert_eq!(channels_left(&keeper)?, share - PER_CONTEXT);
    let (a, b) = pair(&d, 1 << 16)?;
    assert_eq!(channels_left(&keeper)?, 0, "the direct path's descriptors count against the share");
    exchange(&a, &b)?;
    assert_eq!(carried(&a), 0, "no window without a descriptor: the engine carried them");
    drop((a, b));
    wait_channels_left(&keeper, share - PER_CONTEXT)
}

#[test]
fn descriptors_the_direct_path_keeps_are_counted_and_given_back() -> Result<()> {
    let share = 3 * PER_CONTEXT + 10;
    let d = daemon(share)?;
    let keeper = d.context()?;
    let (a, b) = pair(&d, 1 << 16)?;
    exchange(&a, &b)?;
    assert_eq!(carried(&a), 2, "room enough: carried");
    // Two regions, two QP segments and two CQ segments (each its
    // context's ring pool chunk, kept for the grant), one window; and the
    // daemon's own descriptor of each context's pool chunk.
    assert_eq!(channels_left(&keeper)?, share - 3 * PER_CONTEXT - 9);
    // A deregistered region gives its descriptor back at once.
    drop(b.mr);
    assert_eq!(channels_left(&keeper)?, share - 3 * PER_CONTEXT - 8);
    drop(a);
    drop((b.qp, b.cq, b.pd, b.ctx));
    wait_channels_left(&keeper, share - PER_CONTEXT)
}
