//! Memory the process already owns, registered with `register_raw`: its
//! pages are re-backed by a memfd the daemon maps, keep their bytes, and
//! serve as the target of remote writes and the source of remote reads.
//!
//! Re-backing remaps pages: writes other threads make to those pages
//! while it runs may be lost, so the tests of this file run one at a time
//! (the test harness's threads share one process and one heap).
//!
//! The tests that move data in and out of such memory run in both
//! topologies (`name::one_host`, `name::two_hosts`: the remote peer on
//! another daemon, across the TCP transport, which reads and writes the
//! same re-backed pages). Refusals at registration concern one daemon and
//! stay on one host.

use std::sync::{Mutex, MutexGuard};

use anyhow::{bail, Context as _, Result};
use vrdma::wr::{self, SendWrExt};
use vrdma::{Context, MemoryRegion, QpState, WcStatus};
use vrdma_it::{
    access_all, async_event, cap, in_both_topologies, pattern, poll_one, wait_state, DaemonProc, Hosts, Side,
    Topology, WAIT,
};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Copies `len` bytes at `ptr` out, without forming a reference to them.
///
/// # Safety
/// `ptr..ptr + len` must be readable.
unsafe fn snapshot(ptr: *const u8, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    // SAFETY: the caller's contract; `v` is a fresh private buffer.
    unsafe { std::ptr::copy_nonoverlapping(ptr, v.as_mut_ptr(), len) };
    v
}

/// Where the region's owner and a remote peer meet: a QP in the region's
/// PD (its own context) connected to `peer`'s QP (another context, on the
/// daemon `peer`: the owner's own, or another host's).
struct Meeting {
    cq: vrdma::CompletionQueue,
    qp: vrdma::QueuePair,
    peer: Side,
}

fn meet(pd: &vrdma::ProtectionDomain, peer: &DaemonProc, peer_len: usize) -> Result<Meeting> {
    let ctx = pd.context();
    let cq = ctx.create_cq(64, None)?;
    let qp = pd.create_rc_qp(&cq, &cq, cap(16, 1))?;
    let peer = Side::new(&peer.context()?, peer_len)?;
    qp.connect(&peer.endpoint()?, access_all())?;
    peer.qp.connect(&qp.endpoint(ctx)?, access_all())?;
    Ok(Meeting { cq, qp, peer })
}

/// Registers `[ptr, +len)`, which holds `pattern(len, seed)`, and checks
/// that the bytes survive registration, that a remote write lands in the
/// very memory the pointer names, and that a remote read returns what the
/// application wrote through the pointer.
///
/// # Safety
/// `ptr..ptr + len` must be memory the caller owns, valid for reads and
/// writes, holding `pattern(len, seed)`, untouched by anybody else until
/// this returns.
unsafe fn exercise(peer: &DaemonProc, ctx: &Context, ptr: *mut u8, len: usize, seed: u64) -> Result<()> {
    let original = pattern(len, seed);
    // SAFETY: the caller's contract.
    assert!(unsafe { snapshot(ptr, len) } == original, "the test set the memory up wrong");
    let pd = ctx.alloc_pd()?;
    // SAFETY: the caller's contract; the region is dropped before we return.
    let mr = unsafe { pd.register_raw(ptr, len, access_all()) }?;
    assert_eq!(mr.addr(), ptr as u64);
    assert_eq!(mr.len(), len);
    // SAFETY: as above; registration keeps the memory mapped.
    assert!(unsafe { snapshot(ptr, len) } == original, "registration changed the bytes");
    assert!(mr.to_vec() == original);

    let m = meet(&pd, peer, len)?;
    // A remote write lands in the application's own memory, at an odd
    // offset, and nowhere else.
    let incoming = pattern(len / 2, seed + 1);
    let at = 3usize;
    m.peer.mr.write(0, &incoming)?;
    let w = wr::rdma_write(1, &[m.peer.mr.sge(0, incoming.len())?], mr.addr() + at as u64, mr.rkey())?;
    m.peer.qp.post_send(&[w.signaled()])?;
    let wc = poll_one(&m.peer.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::Success));
    let mut expect = original.clone();
    expect[at..at + incoming.len()].copy_from_slice(&incoming);
    // SAFETY: as above.
    assert!(unsafe { snapshot(ptr, len) } == expect, "the remote write did not land in the memory");

    // What the application writes through its pointer, a remote read sees.
    let written = pattern(len, seed + 2);
    // SAFETY: as above; nobody else writes the memory now.
    unsafe { std::ptr::copy_nonoverlapping(written.as_ptr(), ptr, len) };
    let r = wr::rdma_read(2, &[m.peer.mr.sge(0, len)?], mr.addr(), mr.rkey())?;
    m.peer.qp.post_send(&[r.signaled()])?;
    let wc = poll_one(&m.peer.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status, wc.byte_len as usize), (2, WcStatus::Success, len));
    let mut got = vec![0u8; len];
    m.peer.mr.read(0, &mut got)?;
    assert!(got == written, "the remote read returned other bytes");

    // Local use too: a send from the region through its own QP.
    m.peer.qp.post_recv(&[wr::recv(3, &[m.peer.mr.sge(0, 64)?])?])?;
    m.qp.post_send(&[wr::send(4, &[mr.sge(len - 64, 64)?])?.signaled()])?;
    assert_eq!(poll_one(&m.cq, WAIT)?.status, WcStatus::Success);
    assert_eq!(poll_one(&m.peer.cq, WAIT)?.status, WcStatus::Success);
    let mut tail = [0u8; 64];
    m.peer.mr.read(0, &mut tail)?;
    assert_eq!(tail[..], written[len - 64..]);

    drop(m);
    drop(mr);
    // Deregistered, the memory keeps its bytes and stays usable.
    // SAFETY: as above.
    assert!(unsafe { snapshot(ptr, len) } == written, "deregistration changed the bytes");
    // SAFETY: as above.
    unsafe { ptr.add(len - 1).write(0x5a) };
    Ok(())
}

fn heap_vec(t: Topology) -> Result<()> {
    let _g = serial();
    let hosts = Hosts::start(t)?;
    let (ctx, d) = (hosts.a().context()?, hosts.b());
    // Neither page-aligned nor a whole number of pages.
    let len = 100_003;
    let mut v = pattern(len, 11);
    // SAFETY: the Vec owns its buffer, which outlives the registration;
    // it is only touched through `ptr` meanwhile.
    unsafe { exercise(d, &ctx, v.as_mut_ptr(), len, 11) }?;
    // The Vec itself sees what happened to its memory.
    let mut want = pattern(len, 13);
    want[len - 1] = 0x5a;
    assert!(v == want);
    v.push(1);
    Ok(())
}

fn posix_memalign_buffer(t: Topology) -> Result<()> {
    let _g = serial();
    let hosts = Hosts::start(t)?;
    let (ctx, d) = (hosts.a().context()?, hosts.b());
    let len = 64 << 10;
    let mut p: *mut libc::c_void = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; alignment is a power of two and a
    // multiple of the pointer size.
    let rc = unsafe { libc::posix_memalign(&mut p, 4096, len) };
    assert_eq!(rc, 0);
    let ptr = p.cast::<u8>();
    let fill = pattern(len, 21);
    // SAFETY: `ptr` holds `len` bytes just allocated.
    unsafe { std::ptr::copy_nonoverlapping(fill.as_ptr(), ptr, len) };
    // SAFETY: ours until freed below, after the region is gone.
    let r = unsafe { exercise(d, &ctx, ptr, len, 21) };
    // SAFETY: allocated by posix_memalign, freed once.
    unsafe { libc::free(p) };
    r
}

/// `len` bytes of private anonymous memory from mmap, with `extra` flags.
fn map_anon(len: usize, extra: libc::c_int) -> std::io::Result<*mut u8> {
    // SAFETY: a fresh mapping at an address the kernel chooses.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | extra,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(p.cast())
}

fn anonymous_mmap(t: Topology) -> Result<()> {
    let _g = serial();
    let hosts = Hosts::start(t)?;
    let (ctx, d) = (hosts.a().context()?, hosts.b());
    let len = 5 * 4096;
    let ptr = map_anon(len, 0)?;
    let fill = pattern(len - 4096, 31);
    // SAFETY: the mapping holds `len` bytes.
    unsafe { std::ptr::copy_nonoverlapping(fill.as_ptr(), ptr.add(4096), len - 4096) };
    // Register the last four pages, not the first.
    // SAFETY: ours until unmapped below.
    let r = unsafe { exercise(d, &ctx, ptr.add(4096), len - 4096, 31) };
    // The page before the registration was not disturbed.
    // SAFETY: the mapping is still there.
    assert!(unsafe { snapshot(ptr, 4096) }.iter().all(|&b| b == 0));
    // SAFETY: unmapping what we mapped, once.
    unsafe { libc::munmap(ptr.cast(), len) };
    r
}

fn hugetlb_mmap(t: Topology) -> Result<()> {
    let _g = serial();
    // The default huge page size, and how many are free: the mapping
    // takes one, re-backing it as many again.
    let meminfo = std::fs::read_to_string("/proc/meminfo")?;
    let field = |name: &str| -> usize {
        let line = meminfo.lines().find(|l| l.starts_with(name)).unwrap_or_default();
        line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0)
    };
    let (huge_kb, free) = (field("Hugepagesize:"), field("HugePages_Free:"));
    if huge_kb == 0 || free < 2 {
        println!(
            "skipping the MAP_HUGETLB case: {free} huge pages free, 2 needed \
             (see /proc/sys/vm/nr_hugepages)"
        );
        return Ok(());
    }
    let huge = huge_kb * 1024;
    let ptr = match map_anon(huge, libc::MAP_HUGETLB) {
        Ok(p) => p,
        Err(e) => {
            println!("skipping the MAP_HUGETLB case: no huge page could be mapped ({e})");
            return Ok(());
        }
    };
    let hosts = Hosts::start(t)?;
    let (ctx, d) = (hosts.a().context()?, hosts.b());
    let result = (|| -> Result<()> {
        // Part of the huge page, at an odd offset: the whole huge page is
        // re-backed, and the bytes around the part keep their values.
        let (at, len) = (4096 + 3, 100_000);
        let around = pattern(huge, 40);
        let part = pattern(len, 41);
        // SAFETY: the mapping holds huge bytes; `at + len` is inside.
        unsafe {
            std::ptr::copy_nonoverlapping(around.as_ptr(), ptr, huge);
            std::ptr::copy_nonoverlapping(part.as_ptr(), ptr.add(at), len);
        }
        // SAFETY: ours until unmapped below.
        unsafe { exercise(d, &ctx, ptr.add(at), len, 41) }?;
        // SAFETY: the mapping is live.
        let now = unsafe { snapshot(ptr, huge) };
        assert!(now[..at] == around[..at] && now[at + len..] == around[at + len..], "neighbours changed");
        // Then the whole huge page, registered again.
        let whole = pattern(huge, 42);
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(whole.as_ptr(), ptr, huge) };
        // SAFETY: ours until unmapped below.
        unsafe { exercise(d, &ctx, ptr, huge, 42) }
    })();
    // SAFETY: unmapping what we mapped, once.
    unsafe { libc::munmap(ptr.cast(), huge) };
    result
}

/// The main thread's `[stack]` mapping, from `/proc/self/maps`.
fn main_stack() -> Result<(usize, usize)> {
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    let line = maps.lines().find(|l| l.ends_with("[stack]")).context("no [stack] in /proc/self/maps")?;
    let range = line.split_whitespace().next().context("maps line")?;
    let (a, b) = range.split_once('-').context("maps range")?;
    Ok((usize::from_str_radix(a, 16)?, usize::from_str_radix(b, 16)?))
}

fn expect_refused(r: vrdma::Result<MemoryRegion>, what: &str) -> Result<()> {
    match r {
        Err(vrdma::Error::InvalidArgument(m)) => {
            println!("{what}: refused: {m}");
            Ok(())
        }
        Err(e) => bail!("{what}: refused with {e:?}, not InvalidArgument"),
        Ok(_) => bail!("{what}: registered"),
    }
}

#[test]
fn stack_memory_is_refused() -> Result<()> {
    let _g = serial();
    let d = DaemonProc::start()?;
    let ctx = d.context()?;
    let pd = ctx.alloc_pd()?;

    // The main thread's stack, at its deepest page (not in use: the main
    // thread waits in the harness, far above it).
    let (start, _end) = main_stack()?;
    // SAFETY: refused before anything is remapped (that is the test); were
    // it not, the deepest page of the waiting main thread's stack is idle.
    let r = unsafe { pd.register_raw(start as *mut u8, 64, access_all()) };
    expect_refused(r, "the main thread's stack")?;

    // This thread's stack: a whole page inside a local buffer, so that no
    // live frame shares its page even if it were (wrongly) re-backed.
    let mut buf = [7u8; 3 * 4096];
    let base = buf.as_mut_ptr() as usize;
    let page = base.next_multiple_of(4096);
    // SAFETY: as above; the page lies inside `buf`, which outlives the call.
    let r = unsafe { pd.register_raw(page as *mut u8, 4096, access_all()) };
    expect_refused(r, "the calling thread's stack")?;
    assert!(std::hint::black_box(&buf).iter().all(|&b| b == 7));

    // Refusals leave the PD usable.
    let ok = pd.alloc_mr(4096, access_all())?;
    assert_eq!(ok.len(), 4096);
    Ok(())
}

fn deregistration_revokes_remote_access_at_once(t: Topology) -> Result<()> {
    let _g = serial();
    let hosts = Hosts::start(t)?;
    let (ctx, d) = (hosts.a().context()?, hosts.b());
    let len = 4 * 4096;
    let ptr = map_anon(len, 0)?;
    let result = (|| -> Result<()> {
        let pd = ctx.alloc_pd()?;
        // SAFETY: ours until unmapped below, after the region is gone.
        let mr = unsafe { pd.register_raw(ptr, len, access_all()) }?;
        let m = meet(&pd, d, 4096)?;
        let (addr, rkey) = (mr.addr(), mr.rkey());
        m.peer.mr.fill(0, 64, 0x11)?;
        let write = |id| wr::rdma_write(id, &[m.peer.mr.sge(0, 64)?], addr, rkey).map(|w| w.signaled());
        m.peer.qp.post_send(&[write(1)?])?;
        assert_eq!(poll_one(&m.peer.cq, WAIT)?.status, WcStatus::Success);
        // SAFETY: the mapping is live.
        assert!(unsafe { snapshot(ptr, 64) }.iter().all(|&b| b == 0x11));

        drop(mr);
        m.peer.mr.fill(0, 64, 0x22)?;
        m.peer.qp.post_send(&[write(2)?])?;
        let wc = poll_one(&m.peer.cq, WAIT)?;
        assert_eq!((wc.wr_id, wc.status), (2, WcStatus::RemAccessErr));
        // SAFETY: the mapping is live.
        assert!(unsafe { snapshot(ptr, 64) }.iter().all(|&b| b == 0x11), "written after deregistration");
        let ev = async_event(&ctx, WAIT)?;
        assert_eq!(ev.event_type, vrdma::AsyncEventType::QpAccessErr);
        assert_eq!(ev.element, m.qp.qpn());
        wait_state(&m.qp, QpState::Err, WAIT)?;

        // The same memory can be registered again, and works again.
        // SAFETY: as above.
        let again = unsafe { pd.register_raw(ptr, len, access_all()) }?;
        assert_ne!(again.rkey(), rkey);
        let m2 = meet(&pd, d, 4096)?;
        m2.peer.mr.fill(0, 64, 0x33)?;
        let w = wr::rdma_write(3, &[m2.peer.mr.sge(0, 64)?], again.addr(), again.rkey())?.signaled();
        m2.peer.qp.post_send(&[w])?;
        assert_eq!(poll_one(&m2.peer.cq, WAIT)?.status, WcStatus::Success);
        // SAFETY: the mapping is live.
        assert!(unsafe { snapshot(ptr, 64) }.iter().all(|&b| b == 0x33));
        Ok(())
    })();
    // SAFETY: unmapping what we mapped, once, after every region is gone.
    unsafe { libc::munmap(ptr.cast(), len) };
    result
}

#[test]
fn overlapping_registrations_share_grow_or_are_refused() -> Result<()> {
    let _g = serial();
    let d = DaemonProc::start()?;
    let ctx = d.context()?;
    let page = 4096;
    let ptr = map_anon(4 * page, 0)?;
    let result = (|| -> Result<()> {
        let pd = ctx.alloc_pd()?;
        // SAFETY (all registrations below): the mapping is ours until
        // unmapped at the end, after every region is gone.
        let first = unsafe { pd.register_raw(ptr, 2 * page, access_all()) }?;
        // Inside the first one's pages: shares its memory.
        let inner = unsafe { pd.register_raw(ptr.add(page + 10), 90, access_all()) }?;
        assert_ne!(inner.rkey(), first.rkey());
        let m = meet(&pd, &d, 4096)?;
        m.peer.mr.fill(0, 90, 0x66)?;
        let w = wr::rdma_write(1, &[m.peer.mr.sge(0, 90)?], inner.addr(), inner.rkey())?.signaled();
        m.peer.qp.post_send(&[w])?;
        assert_eq!(poll_one(&m.peer.cq, WAIT)?.status, WcStatus::Success);
        let mut seen = vec![0u8; 92];
        first.read(page + 9, &mut seen)?;
        assert_eq!(seen[0], 0);
        assert_eq!(seen[1..91], [0x66; 90]);
        assert_eq!(seen[91], 0);
        // A range from inside the first one's pages to past them (two
        // small buffers sharing a page, the second crossing into the
        // next): the span grows, and one remote write across the old and
        // the new pages lands in both, seen by both regions and the
        // application's pointer.
        let straddle = unsafe { pd.register_raw(ptr.add(2 * page - 50), 100, access_all()) }?;
        m.peer.mr.fill(0, 100, 0x77)?;
        let w = wr::rdma_write(2, &[m.peer.mr.sge(0, 100)?], straddle.addr(), straddle.rkey())?.signaled();
        m.peer.qp.post_send(&[w])?;
        assert_eq!(poll_one(&m.peer.cq, WAIT)?.status, WcStatus::Success);
        let mut tail = [0u8; 50];
        first.read(2 * page - 50, &mut tail)?;
        assert_eq!(tail, [0x77; 50], "the first region sees the write into its last page");
        // SAFETY: inside the mapping.
        assert!(unsafe { snapshot(ptr.add(2 * page - 50), 100) } == [0x77; 100], "the pointer sees it");
        // SAFETY: inside the mapping.
        assert_eq!(unsafe { ptr.add(page + 10).read() }, 0x66, "earlier bytes stay");
        // (A range beginning before a live span it overlaps is made of
        // pieces: `registrations_before_and_over_registered_spans_are_made_of_pieces`.)
        // Once no region is left, the pages are re-backed anew with their
        // bytes.
        drop((first, inner, straddle));
        let again = unsafe { pd.register_raw(ptr.add(page), 2 * page, access_all()) }?;
        let mut b = [0u8; 1];
        again.read(10, &mut b)?;
        assert_eq!(b, [0x66], "the bytes did not survive re-backing anew");
        Ok(())
    })();
    // SAFETY: unmapping what we mapped, once.
    unsafe { libc::munmap(ptr.cast(), 4 * page) };
    result
}

/// A peer's RDMA write of `n` bytes at `off` of `mr` lands in the
/// program's bytes there, and its RDMA read from there returns what the
/// program wrote after.
fn through(m: &Meeting, mr: &MemoryRegion, off: usize, n: usize, seed: u64) -> Result<()> {
    let data = pattern(n, seed);
    m.peer.mr.write(0, &data)?;
    let w = wr::rdma_write(seed, &[m.peer.mr.sge(0, n)?], mr.addr() + off as u64, mr.rkey())?.signaled();
    m.peer.qp.post_send(&[w])?;
    let wc = poll_one(&m.peer.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (seed, WcStatus::Success), "the write through the region");
    // SAFETY: inside the region's memory, which the test owns.
    let seen = unsafe { snapshot(mr.as_ptr().add(off), n) };
    assert!(seen == data, "the write at {off} of {n} bytes did not land in the program's bytes");
    let back = pattern(n, seed + 1000);
    // SAFETY: as above.
    unsafe { std::ptr::copy_nonoverlapping(back.as_ptr(), mr.as_ptr().add(off), n) };
    let r = wr::rdma_read(seed, &[m.peer.mr.sge(8192, n)?], mr.addr() + off as u64, mr.rkey())?.signaled();
    m.peer.qp.post_send(&[r])?;
    let wc = poll_one(&m.peer.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (seed, WcStatus::Success), "the read through the region");
    let mut got = vec![0u8; n];
    m.peer.mr.read(8192, &mut got)?;
    assert!(got == back, "the read at {off} of {n} bytes did not return the program's bytes");
    Ok(())
}

/// Registrations over pages registered before, as hardware takes them
/// (two heap buffers registered one after the other, the second lower in
/// the heap; rping's buffers): (a) a range beginning before a registered
/// span and ending inside it, (b) one covering two spans and the gap
/// between them, (c) one covering a span with pages on both sides. Each
/// is made of pieces (the spans' files, the gaps grown into the span
/// before them or a new span): RDMA writes and reads through each land in
/// the program's bytes at the right offsets, the earlier regions keep
/// working, the program's bytes survive, and the regions go in any order.
/// (Before, (a)-(c) were refused with EINVAL.)
#[test]
fn registrations_before_and_over_registered_spans_are_made_of_pieces() -> Result<()> {
    let _g = serial();
    let d = DaemonProc::start()?;
    let ctx = d.context()?;
    let page = 4096;
    let pages = 10;
    let ptr = map_anon(pages * page, 0)?;
    let orig = pattern(pages * page, 7);
    // SAFETY: the mapping holds `pages` pages, ours.
    unsafe { std::ptr::copy_nonoverlapping(orig.as_ptr(), ptr, orig.len()) };
    let result = (|| -> Result<()> {
        let pd = ctx.alloc_pd()?;
        let m = meet(&pd, &d, 1 << 16)?;
        // SAFETY (all registrations below): the mapping is ours until
        // unmapped at the end, after every region is gone.
        let a = unsafe { pd.register_raw(ptr.add(2 * page + 100), 100, access_all()) }?;
        let b = unsafe { pd.register_raw(ptr.add(5 * page + 8), 8, access_all()) }?;
        let c = unsafe { pd.register_raw(ptr.add(7 * page + 5), 5, access_all()) }?;
        // (a) From page 1 into a's page.
        let before = unsafe { pd.register_raw(ptr.add(page + 10), page + 40, access_all()) }?;
        // (b) From a's page over pages 3-4 into b's page.
        let over = unsafe { pd.register_raw(ptr.add(2 * page + 150), 3 * page - 138, access_all()) }?;
        // (c) Page 6, c's page 7, page 8.
        let around = unsafe { pd.register_raw(ptr.add(6 * page + 100), 3 * page - 200, access_all()) }?;
        // SAFETY: inside the mapping.
        let now = unsafe { snapshot(ptr, pages * page) };
        assert!(now == orig, "re-backing changed the program's bytes");
        through(&m, &before, 0, before.len(), 1)?;
        through(&m, &before, page - 60, 100, 2)?;
        through(&m, &over, 0, over.len(), 3)?;
        through(&m, &over, page - 200, 400, 4)?;
        through(&m, &over, 3 * page - 200, 62, 17)?;
        through(&m, &around, 0, around.len(), 5)?;
        through(&m, &around, page - 200, page + 300, 6)?;
        for (mr, seed) in [(&a, 7), (&b, 8), (&c, 9)] {
            through(&m, mr, 0, mr.len(), seed)?;
        }
        // A write through `over` is seen by `a` where they share a page.
        through(&m, &over, 0, 50, 10)?;
        let mut x = [0u8; 50];
        a.read(50, &mut x)?;
        assert_eq!(x[..], pattern(50, 1010)[..], "a sees the program's bytes written into over's first page");
        // Deregistered out of order: the others keep working.
        drop(a);
        through(&m, &over, 0, 100, 11)?;
        through(&m, &before, before.len() - 40, 40, 12)?;
        drop(over);
        through(&m, &b, 0, 8, 13)?;
        through(&m, &before, 0, 100, 14)?;
        drop(before);
        drop(c);
        through(&m, &around, 0, around.len(), 15)?;
        drop(around);
        through(&m, &b, 0, 8, 16)?;
        drop(b);
        // A host request carries at most 4 descriptors, one a piece: a
        // range over 5 registered spans is refused, clearly.
        let five: Vec<MemoryRegion> = (0..5)
            .map(|i| unsafe { pd.register_raw(ptr.add(2 * i * page + 8), 8, access_all()) })
            .collect::<vrdma::Result<_>>()?;
        let all = unsafe { pd.register_raw(ptr.add(4), 9 * page, access_all()) };
        match all {
            Err(vrdma::Error::InvalidArgument(m)) if m.contains("at most 4 pieces") => {}
            other => bail!("a range over 5 spans: {other:?}"),
        }
        through(&m, &five[4], 0, 8, 18)?;
        drop(five);
        Ok(())
    })();
    // SAFETY: unmapping what we mapped, once.
    unsafe { libc::munmap(ptr.cast(), pages * page) };
    result
}

#[test]
fn memory_that_cannot_be_shared_is_refused() -> Result<()> {
    let _g = serial();
    let d = DaemonProc::start()?;
    let ctx = d.context()?;
    let pd = ctx.alloc_pd()?;
    let page = 4096;
    // Read-only memory.
    let ro = map_anon(page, 0)?;
    // SAFETY: our own mapping.
    assert_eq!(unsafe { libc::mprotect(ro.cast(), page, libc::PROT_READ) }, 0);
    // SAFETY (all registrations below): refused before anything is
    // remapped, and the memory named is ours or not mapped at all.
    expect_refused(unsafe { pd.register_raw(ro, page, access_all()) }, "read-only memory")?;
    // Memory of a file.
    let file = tempfile::tempfile()?;
    file.set_len(page as u64)?;
    // SAFETY: a fresh private mapping of our own file.
    let fp = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE,
            std::os::fd::AsRawFd::as_raw_fd(&file),
            0,
        )
    };
    assert_ne!(fp, libc::MAP_FAILED);
    expect_refused(unsafe { pd.register_raw(fp.cast(), 16, access_all()) }, "a file mapping")?;
    // Shared anonymous memory (shared with whom it may be already).
    // SAFETY: a fresh mapping at an address the kernel chooses.
    let sh = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(sh, libc::MAP_FAILED);
    expect_refused(unsafe { pd.register_raw(sh.cast(), 16, access_all()) }, "shared anonymous memory")?;
    // Unmapped memory: the page after a mapping we just removed.
    let gone = map_anon(page, 0)?;
    // SAFETY: unmapping what we mapped.
    unsafe { libc::munmap(gone.cast(), page) };
    expect_refused(unsafe { pd.register_raw(gone, 16, access_all()) }, "unmapped memory")?;
    expect_refused(unsafe { pd.register_raw(std::ptr::null_mut(), 16, access_all()) }, "a null pointer")?;
    let heap = Box::into_raw(Box::new([0u8; 64]));
    expect_refused(unsafe { pd.register_raw(heap.cast(), 0, access_all()) }, "zero bytes")?;
    // SAFETY: the box we leaked above, freed once; re-backing was refused.
    drop(unsafe { Box::from_raw(heap) });
    // SAFETY: unmapping what we mapped, once.
    unsafe {
        libc::munmap(ro.cast(), page);
        libc::munmap(fp, page);
        libc::munmap(sh, page);
    }
    // And the PD still registers good memory.
    let mut v = vec![1u8; 5000];
    // SAFETY: the Vec outlives the region (dropped first below).
    let mr = unsafe { pd.register_raw(v.as_mut_ptr(), v.len(), access_all()) }?;
    assert_eq!(mr.to_vec(), vec![1u8; 5000]);
    drop(mr);
    v.clear();
    Ok(())
}

in_both_topologies!(
    heap_vec,
    posix_memalign_buffer,
    anonymous_mmap,
    hugetlb_mmap,
    deregistration_revokes_remote_access_at_once,
);
