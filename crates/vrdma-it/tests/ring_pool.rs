//! A host context's ring pool (`vrdmad::server::ring_pool`): its CQ, QP
//! and SRQ rings lie in a few shared chunks, each sent to the library
//! once, instead of a memfd each; a freed ring's space is reused, reset;
//! and a tenant whose descriptors are spent still gets its rings, each in
//! a memfd of its own as before.
//!
//! The tests that count this process's mappings, or map a chunk in it,
//! run one at a time (the test harness's threads share one process: a
//! chunk another test unmapped meanwhile read as no chunk mapped).

use std::sync::{Mutex, MutexGuard};

use anyhow::{bail, ensure, Result};
use vrdma::wr::{self, SendWrExt};
use vrdma::WcStatus;
use vrdma_core::proto::{CmReply, CmRequest, PoolRing, Reply, Request};
use vrdma_it::{cap, connect, pattern, poll_one, DaemonProc, RawConn, Side, WAIT};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// This process's mappings of memfds whose name starts with `name`.
fn mapped(name: &str) -> Result<usize> {
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    let needle = format!("/memfd:{name}");
    Ok(maps.lines().filter(|l| l.contains(&needle)).count())
}

#[test]
fn many_rings_of_one_context_lie_in_one_chunk_mapped_once() -> Result<()> {
    const N: usize = 24;
    let _s = serial();
    let d = DaemonProc::start()?;
    let ctx = d.context()?;
    let before = (mapped("vrdma-ring-pool")?, mapped("vrdma-cq")?, mapped("vrdma-qp")?);
    let a = Side::new(&ctx, 4096)?;
    let b = Side::new(&ctx, 4096)?;
    let pd = ctx.alloc_pd()?;
    let mut made = Vec::new();
    for _ in 0..N {
        let cq = ctx.create_cq(64, None)?;
        let qp = pd.create_rc_qp(&cq, &cq, cap(16, 1))?;
        made.push((cq, qp));
    }
    let after = (mapped("vrdma-ring-pool")?, mapped("vrdma-cq")?, mapped("vrdma-qp")?);
    // Without the pool: a mapping (and a memfd) per CQ and per QP.
    assert_eq!((after.1, after.2), (before.1, before.2), "rings in memfds of their own");
    ensure!(
        after.0 - before.0 == 1,
        "{} CQs and QPs map {} pool chunks in the library, expected 1",
        N + 2,
        after.0 - before.0
    );
    // The pooled rings carry data: an RDMA write and its completions,
    // through rings that share a chunk.
    connect(&a, &b)?;
    let data = pattern(4096, 7);
    a.mr.write(0, &data)?;
    let w = wr::rdma_write(9, &[a.mr.sge(0, data.len())?], b.mr.addr(), b.mr.rkey())?;
    a.qp.post_send(&[w.signaled()])?;
    let wc = poll_one(&a.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (9, WcStatus::Success));
    assert!(b.mr.to_vec() == data, "the write did not land");
    Ok(())
}

/// A CQ's creation over the raw socket: its number, its pool placement,
/// its ring's offset in the chunk and the descriptors that came.
fn raw_cq(c: &mut RawConn, cqe: u32) -> Result<(u32, PoolRing, u64, Vec<std::os::fd::OwnedFd>)> {
    let (rings, reply, fds) = c.call(&Request::CreateCq { cqe, channel: None }, &[])?.pooled()?;
    let Reply::Cq { cq, ring, segment_len, .. } = reply else { bail!("CreateCq answered {reply:?}") };
    let [place] = rings[..] else { bail!("a CQ placed {} rings", rings.len()) };
    if let PoolRing::Chunk { len, .. } = place {
        assert_eq!(len, segment_len, "a pooled ring's segment is its chunk");
    }
    Ok((cq, place, ring.offset, fds))
}

#[test]
fn a_destroyed_rings_space_is_reused_and_starts_from_zeros() -> Result<()> {
    // It maps a chunk in this process: not while another test counts.
    let _s = serial();
    let d = DaemonProc::start()?;
    let mut c = RawConn::connect(&d.socket)?;
    c.hello()?;
    let (cq, first, at, mut fds) = raw_cq(&mut c, 256)?;
    let PoolRing::Chunk { chunk, len, fd: true } = first else {
        bail!("the first ring came as {first:?}, not in a new chunk with its descriptor")
    };
    ensure!(fds.len() == 1, "{} descriptors with the first ring", fds.len());
    let seg = vrdma_shm::Segment::map_trusted(fds.remove(0), len as usize)?;
    let ring_bytes = 256 * vrdma_core::ring::CQE_SIZE;
    let ring = |at: u64| {
        ensure!(at as usize + ring_bytes <= seg.len(), "a ring at {at} beyond its chunk");
        // SAFETY: the ring's bytes lie in the chunk (checked), which `seg`
        // maps; the daemon writes none of them meanwhile (no QP uses it).
        Ok(unsafe { std::slice::from_raw_parts_mut(seg.as_ptr().add(at as usize), ring_bytes) })
    };
    // The tenant scribbles over its CQ's ring.
    ring(at)?.fill(0xa5);
    // A second CQ shares the chunk and comes without a descriptor.
    let (_, second, at2, fds2) = raw_cq(&mut c, 256)?;
    assert_eq!(second, PoolRing::Chunk { chunk, len, fd: false });
    assert!(fds2.is_empty(), "a descriptor came for a chunk the tenant has");
    assert!(at2.abs_diff(at) >= ring_bytes as u64, "two live rings overlap");
    // The first CQ goes; the next CQ takes its place, emptied.
    assert!(matches!(c.call(&Request::DestroyCq { cq }, &[])?.reply()?, Reply::Done));
    let (_, third, at3, fds3) = raw_cq(&mut c, 256)?;
    assert_eq!((third, at3), (PoolRing::Chunk { chunk, len, fd: false }, at), "the freed space is reused");
    assert!(fds3.is_empty());
    assert!(ring(at3)?.iter().all(|&b| b == 0), "a reused ring holds its last owner's bytes");
    Ok(())
}

/// A tenant whose descriptors are spent gets no new chunk (the daemon
/// keeps each chunk's memfd, charged to them): its rings come in memfds
/// of their own, as before the pool, and work.
#[test]
fn without_descriptors_for_a_chunk_rings_get_memfds_of_their_own() -> Result<()> {
    // A context takes `DESCRIPTORS_PER_CONTEXT` of its tenant's
    // descriptors and an rdma_cm event channel one: the least share the
    // daemon accepts, spent.
    let share = vrdmad::config::DESCRIPTORS_PER_CONTEXT + 1;
    let d = DaemonProc::start_with_config(&format!("[quota]\nmax_descriptors = {share}\n"))?;
    let mut c = RawConn::connect(&d.socket)?;
    c.hello()?;
    match c.call(&Request::Cm(CmRequest::CreateChannel), &[])?.reply()? {
        Reply::Cm(CmReply::Channel { .. }) => {}
        other => bail!("CreateChannel answered {other:?}"),
    }
    let mut own = 0;
    for _ in 0..4 {
        let (rings, reply, fds) = match c.call(&Request::CreateCq { cqe: 64, channel: None }, &[])? {
            a @ vrdma_it::Answer::Reply(Reply::Pooled { .. }, _) => a.pooled()?,
            vrdma_it::Answer::Reply(Reply::Cq { .. }, fds) => {
                own += 1;
                ensure!(fds.len() == 1, "a CQ of its own came with {} descriptors", fds.len());
                continue;
            }
            other => bail!("CreateCq answered {other:?}"),
        };
        bail!("a chunk beyond the tenant's descriptors: {rings:?} {reply:?} with {} fds", fds.len());
    }
    assert_eq!(own, 4);
    Ok(())
}
