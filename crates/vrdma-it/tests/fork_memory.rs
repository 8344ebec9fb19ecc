//! A region allocated before `fork` is shared with the child: remote
//! writes that land in it after the fork are seen by the child too.
//!
//! The sockets library's design for sharing a carried connection after
//! fork (`docs/sockets.md`, "Sharing a carried connection after fork")
//! relies on it: every process that holds the connection reads the
//! bytes its peer wrote into the ring, which the driver allocated with
//! `alloc_mr` (a memfd mapped `MAP_SHARED`, without `MADV_DONTFORK`).
//! A change that made such regions private to the process that made them
//! (copy-on-write, or not inherited at all) fails here.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use vrdma::wr::{self, SendWrExt};
use vrdma::WcStatus;
use vrdma_it::{connect, pattern, poll_one, DaemonProc, Side, WAIT};

const LEN: usize = 4096;

#[test]
fn a_forked_child_sees_remote_writes_into_a_region_made_before_the_fork() -> Result<()> {
    let d = DaemonProc::start()?;
    let ctx = d.context()?;
    let (a, b) = (Side::new(&ctx, LEN)?, Side::new(&ctx, LEN)?);
    connect(&a, &b)?;
    let data = pattern(LEN, 7);
    let target = b.mr.as_ptr() as usize;
    let mut fds = [0; 2];
    // SAFETY: pipe(2) into our array.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        bail!("pipe: {}", std::io::Error::last_os_error());
    }
    // SAFETY: fork(2) in a test; the child only reads the region's bytes
    // (no allocation, no lock, no call into the library), writes one byte
    // to the pipe and leaves with _exit.
    let child = unsafe { libc::fork() };
    if child == 0 {
        let end = Instant::now() + Duration::from_secs(20);
        let mut seen = false;
        while !seen && Instant::now() < end {
            // SAFETY: the region's `LEN` bytes stay mapped in the child
            // (inherited); volatile reads, as the daemon writes them.
            seen = (0..LEN).all(|i| unsafe { std::ptr::read_volatile((target + i) as *const u8) } == data[i]);
        }
        let b = [seen as u8];
        // SAFETY: write(2) of one byte to our pipe, then _exit.
        unsafe {
            libc::write(fds[1], b.as_ptr().cast(), 1);
            libc::_exit(0);
        }
    }
    if child < 0 {
        bail!("fork: {}", std::io::Error::last_os_error());
    }
    // After the fork: the child's mapping exists already.
    a.mr.write(0, &data)?;
    let w = wr::rdma_write(1, &[a.mr.sge(0, LEN)?], b.mr.addr(), b.mr.rkey())?;
    a.qp.post_send(&[w.signaled()]).map_err(|e| e.error)?;
    let wc = poll_one(&a.cq, WAIT)?;
    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    let mut seen = [0u8; 1];
    let mut status = 0;
    // SAFETY: the parent's write end closed (a child that dies unsaid
    // reads as the end), read(2) of one byte from our pipe, waitpid on our
    // child; the pipe's two ends closed once.
    let got = unsafe {
        libc::close(fds[1]);
        let got = libc::read(fds[0], seen.as_mut_ptr().cast(), 1);
        libc::waitpid(child, &mut status, 0);
        libc::close(fds[0]);
        got
    };
    assert_eq!(got, 1, "the child ended without an answer (status {status:#x})");
    assert_eq!(seen[0], 1, "the child did not see the bytes written into the region after the fork");
    Ok(())
}
