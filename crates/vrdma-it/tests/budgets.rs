//! No tenant can lock the others out of the daemon's shared budgets.
//!
//! The daemon's memory mappings (a context, each region, queue and
//! completion channel) are one budget for all tenants (`max_mappings`).
//! At most `max_tenants` tenants hold contexts at once, each held to its
//! share, so that tenants that fill their quotas leave every other
//! admitted tenant able to open a context and register up to its own.
//! Tenants are uids, so these tests need root (to run tenants as other
//! uids); without it they say so and pass vacuously.

use std::time::Duration;

use anyhow::{bail, Result};
use vrdma::AccessFlags;
use vrdma_core::proto::{Reply, Request};
use vrdma_it::protocol::{Command, Said};
use vrdma_it::{wait_until, DaemonProc, PeerProc, RawConn, PEER_TIMEOUT, WAIT};

/// Tenants of their own, out of the way of real users.
const HOARDERS: [u32; 2] = [61101, 61102];
const LATECOMER: u32 = 61103;
/// The daemon's budget and its tenants: a share of 40 each.
const MAX_MAPPINGS: usize = 120;
const MAX_TENANTS: usize = 3;
const SHARE: usize = MAX_MAPPINGS / MAX_TENANTS;

fn root() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    vrdma_it::skip("this test needs root (to run tenants as other uids)");
    false
}

/// Ends a peer and reaps it.
fn end(mut p: PeerProc) -> Result<()> {
    p.proc.kill(libc::SIGKILL);
    p.proc.wait_timeout(WAIT)?;
    Ok(())
}

fn reg_mr(pd: u32) -> Request {
    Request::RegMr { pd, addr: 0x7000_0000_0000, len: 4096, access: AccessFlags::LOCAL_WRITE, fd_offset: 0 }
}

/// A tenant that fills its share: a peer running as `uid` that makes
/// objects of every kind until the daemon refuses one, and keeps them.
fn hoard(d: &DaemonProc, uid: u32) -> Result<PeerProc> {
    let mut peer = PeerProc::spawn_as(&d.socket, "tenant", &[], Some(uid))?;
    let h = peer.hello()?;
    assert_eq!(h.tenant, uid);
    match peer.call(&Command::Hoard)? {
        Said::Hoarded { kinds, errno, message } => {
            assert_eq!(errno, libc::ENOMEM, "{message}");
            // Refused for its own share, long before the daemon's budget.
            assert!(message.contains(&format!("share of {SHARE} memory mappings")), "{message}");
            assert!(kinds.len() > 10, "refused after only {kinds:?}");
        }
        other => bail!("tenant {uid} answered {other:?} to Hoard"),
    }
    Ok(peer)
}

/// The keys of the regions of 4 KiB that the context on `c` registers
/// until refused (at most `SHARE`), and the refusal.
fn register_until_refused(c: &mut RawConn) -> Result<(Vec<u32>, i32, String)> {
    let pd = match c.call(&Request::AllocPd, &[])?.reply()? {
        Reply::Pd { pd } => pd,
        other => bail!("AllocPd answered {other:?}"),
    };
    let memory = vrdma_shm::Segment::create("it-budgets", 4096)?;
    let mut keys = Vec::new();
    loop {
        match c.call(&reg_mr(pd), &[memory.fd()])?.reply()? {
            Reply::Mr { key } => keys.push(key),
            Reply::Error { errno, message } => return Ok((keys, errno, message)),
            other => bail!("RegMr answered {other:?}"),
        }
        assert!(keys.len() <= SHARE, "a tenant registered more regions than its share of mappings");
    }
}

/// Two tenants fill their shares of a small budget; a third can still
/// open a context and register exactly what `ibv_query_device` promised
/// it; a fourth is told the daemon serves its limit of tenants, until one
/// of the others is gone.
#[test]
fn tenants_that_fill_their_shares_leave_the_others_theirs() -> Result<()> {
    if !root() {
        return Ok(());
    }
    let d = DaemonProc::start_with_config(&format!(
        "max_mappings = {MAX_MAPPINGS}\nmax_tenants = {MAX_TENANTS}\n[quota]\nmax_contexts = 4\n"
    ))?;
    let mut hoarders = Vec::new();
    for uid in HOARDERS {
        hoarders.push(hoard(&d, uid)?);
    }
    // We (root, tenant 0) are the third tenant: we get a context, and the
    // device shows what we can have beside it.
    let mut c = RawConn::connect(&d.socket)?;
    assert_eq!(c.hello()?, 0);
    let max_mr = match c.call(&Request::QueryDevice, &[])?.reply()? {
        Reply::Device(attr) => attr.max_mr as usize,
        other => bail!("QueryDevice answered {other:?}"),
    };
    assert_eq!(max_mr, SHARE - 1, "the context takes one of the share");
    let (keys, errno, message) = register_until_refused(&mut c)?;
    let made = keys.len();
    assert_eq!(made, max_mr, "registered {made} regions, the device promised {max_mr}: {message}");
    assert_eq!(errno, libc::ENOMEM, "{message}");
    assert!(message.contains(&format!("share of {SHARE} memory mappings")), "{message}");

    // Every share is taken: a fourth tenant is refused its context with
    // a clear error, not a closed connection.
    let mut late = PeerProc::spawn_as(&d.socket, "tenant", &[], Some(LATECOMER))?;
    match late.recv::<Said>(PEER_TIMEOUT)? {
        Said::Error { errno, message } => {
            assert_eq!(errno, libc::EUSERS, "{message}");
            assert!(message.contains("limit of 3 tenants") && message.contains("max_tenants"), "{message}");
        }
        other => bail!("the fourth tenant was greeted with {other:?}"),
    }
    late.proc.wait_timeout(WAIT)?;
    // A tenant already in is not counted again: another context of ours
    // opens as soon as our share has room for it.
    let key = keys[0];
    assert!(matches!(c.call(&Request::DeregMr { key }, &[])?.reply()?, Reply::Done));
    let mut second = RawConn::connect(&d.socket)?;
    assert_eq!(second.hello()?, 0);
    drop((c, second));

    // Once a hoarder is gone, its room is another tenant's, who can reach
    // the whole of its share.
    end(hoarders.remove(0))?;
    let mut late = None;
    wait_until(Duration::from_secs(10), "the gone tenant's room freed", || {
        let Ok(p) = PeerProc::spawn_as(&d.socket, "tenant", &[], Some(LATECOMER)) else { return false };
        match p.recv::<Said>(PEER_TIMEOUT) {
            Ok(Said::Hello(_)) => {
                late = Some(p);
                true
            }
            _ => {
                let _ = end(p);
                std::thread::sleep(Duration::from_millis(50));
                false
            }
        }
    })?;
    let mut late = late.expect("admitted");
    match late.call(&Command::Hoard)? {
        Said::Hoarded { errno, message, .. } => {
            assert_eq!(errno, libc::ENOMEM, "{message}");
            assert!(message.contains(&format!("share of {SHARE} memory mappings")), "{message}");
        }
        other => bail!("the latecomer answered {other:?} to Hoard"),
    }
    end(late)?;
    for h in hoarders {
        end(h)?;
    }
    Ok(())
}

/// Without admission the same budget would be first come, first served:
/// here one tenant may hold it all (`max_tenants = 1`), and a second
/// tenant is refused its context with EUSERS, never with the mappings of
/// a full daemon or a closed connection.
#[test]
fn a_tenant_beyond_max_tenants_is_told_so() -> Result<()> {
    if !root() {
        return Ok(());
    }
    let d = DaemonProc::start_with_config("max_mappings = 40\nmax_tenants = 1\n")?;
    let mut c = RawConn::connect(&d.socket)?;
    c.hello()?;
    let (keys, errno, message) = register_until_refused(&mut c)?;
    assert_eq!((keys.len(), errno), (39, libc::ENOMEM), "{message}");
    let mut other = PeerProc::spawn_as(&d.socket, "tenant", &[], Some(LATECOMER))?;
    match other.recv::<Said>(PEER_TIMEOUT)? {
        Said::Error { errno, message } => assert_eq!(errno, libc::EUSERS, "{message}"),
        other => bail!("the second tenant was greeted with {other:?}"),
    }
    other.proc.wait_timeout(WAIT)?;
    Ok(())
}

/// File descriptors are shared the same way: a tenant that fills its share
/// with completion channels (each a descriptor in the daemon) is refused
/// the next channel, and its next context, with EMFILE; another tenant
/// still opens its context and channels.
#[test]
fn a_tenant_that_fills_its_descriptors_leaves_the_others_theirs() -> Result<()> {
    if !root() {
        return Ok(());
    }
    // Room for three contexts (8 each) and six channels, or one context
    // and 22 channels.
    const SHARE: usize = 30;
    let d = DaemonProc::start_with_config(&format!("max_tenants = 2\n[quota]\nmax_descriptors = {SHARE}\n"))?;
    let mut c = RawConn::connect(&d.socket)?;
    c.hello()?;
    let mut channels = Vec::new();
    let (errno, message) = loop {
        match c.call(&Request::CreateCompChannel, &[])?.reply()? {
            Reply::CompChannel { channel, .. } => channels.push(channel),
            Reply::Error { errno, message } => break (errno, message),
            other => bail!("CreateCompChannel answered {other:?}"),
        }
        assert!(channels.len() <= SHARE, "more channels than descriptors");
    };
    assert_eq!(channels.len(), SHARE - 8, "{message}");
    assert_eq!(errno, libc::EMFILE, "{message}");
    assert!(message.contains(&format!("share of {SHARE} file descriptors")), "{message}");
    let (errno, message) = RawConn::connect(&d.socket)?
        .call(&Request::Hello { version: vrdma_core::proto::PROTOCOL_VERSION }, &[])?
        .errno()?;
    assert_eq!(errno, libc::EMFILE, "{message}");
    // Another tenant is not touched by it.
    let other = PeerProc::spawn_as(&d.socket, "tenant", &[], Some(LATECOMER))?;
    assert_eq!(other.hello()?.tenant, LATECOMER);
    end(other)?;
    // A channel given back is room for the next.
    match c.call(&Request::CreateCompChannel, &[])?.reply()? {
        Reply::Error { errno, .. } => assert_eq!(errno, libc::EMFILE),
        other => bail!("CreateCompChannel answered {other:?}"),
    }
    match c.call(&Request::DestroyCompChannel { channel: channels[0] }, &[])?.reply()? {
        Reply::Done => {}
        other => bail!("DestroyCompChannel answered {other:?}"),
    }
    assert!(matches!(c.call(&Request::CreateCompChannel, &[])?.reply()?, Reply::CompChannel { .. }));
    Ok(())
}

/// Queue rings are memory the daemon creates: a tenant that fills its
/// share with deep CQs is refused the next with ENOMEM, and another
/// tenant still opens its context and makes its queues.
#[test]
fn a_tenant_that_fills_its_queue_memory_leaves_the_others_theirs() -> Result<()> {
    if !root() {
        return Ok(());
    }
    const SHARE: u64 = 2 << 20;
    let d = DaemonProc::start_with_config(&format!("max_tenants = 2\nmax_queue_memory = {}\n", 2 * SHARE))?;
    let mut c = RawConn::connect(&d.socket)?;
    c.hello()?;
    let mut cqs = 0u64;
    let (errno, message) = loop {
        match c.call(&Request::CreateCq { cqe: 4096, channel: None }, &[])?.reply()? {
            Reply::Cq { .. } => cqs += 1,
            Reply::Error { errno, message } => break (errno, message),
            other => bail!("CreateCq answered {other:?}"),
        }
        assert!(cqs <= SHARE / 4096, "more CQs than the share of queue memory holds");
    };
    let ring = vrdma_core::ring::CQE_SIZE as u64 * 4096;
    assert_eq!(cqs, SHARE / ring, "{message}");
    assert_eq!(errno, libc::ENOMEM, "{message}");
    assert!(message.contains(&format!("limit {SHARE}")) && message.contains("queue rings"), "{message}");
    // Another tenant makes its CQ and QP (the peer does at start).
    let other = PeerProc::spawn_as(&d.socket, "tenant", &[], Some(LATECOMER))?;
    assert_eq!(other.hello()?.tenant, LATECOMER);
    end(other)?;
    Ok(())
}
