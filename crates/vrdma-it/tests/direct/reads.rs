//! RDMA reads on the direct path: the requester copies out of the granted
//! mapping into its own SGEs and completes locally; the responder takes
//! no part. Whatever the library cannot prove (the key's rights, bounds,
//! a local region it may not write) is the engine's to report.

use super::*;

#[test]
fn reads_carry_the_bytes_and_complete() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let (a, b) = pair(&d, 1 << 16)?;
    let data = pattern(4096, 7);
    b.mr.write(8192, &data)?;
    // 8 bytes, then 4 KiB scattered over two SGEs, in one call.
    let two = [a.mr.sge(100, 1000)?, a.mr.sge(5000, 3096)?];
    a.qp.post_send(&[
        wr::rdma_read(1, &[a.mr.sge(0, 8)?], b.mr.addr() + 8192, b.mr.rkey())?.signaled(),
        wr::rdma_read(2, &two, b.mr.addr() + 8192, b.mr.rkey())?.signaled(),
    ])?;
    let wcs = poll_n(&a.cq, 2, WAIT)?;
    for (wc, (id, len)) in wcs.iter().zip([(1, 8), (2, 4096)]) {
        assert_eq!(
            (wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.qp_num),
            (id, WcStatus::Success, WcOpcode::RdmaRead, len, a.qp.qpn())
        );
    }
    assert_eq!(carried(&a), 2, "the reads took the direct path");
    let mut got = vec![0u8; 4096];
    a.mr.read(0, &mut got[..8])?;
    assert_eq!(got[..8], data[..8]);
    a.mr.read(100, &mut got[..1000])?;
    a.mr.read(5000, &mut got[1000..])?;
    assert!(got == data);
    // Nothing for the responder, and its memory as it was.
    assert!(b.cq.poll_one()?.is_none());
    b.mr.read(8192, &mut got)?;
    assert!(got == data);
    Ok(())
}

#[test]
fn a_write_then_a_read_of_the_same_bytes_sees_the_write() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let (a, b) = pair(&d, 4 << 20)?;
    let big = 2 << 20; // the engine's (above the direct limit)
    assert!(big as u64 > vrdma::DIRECT_MAX_RDMA_BYTES);
    a.mr.fill(0, big, 0x3c)?;
    // Engine write, then a direct read of its last bytes: the read waits
    // for the write's completion to be polled, so it goes to the engine
    // with it, in order.
    a.qp.post_send(&[
        wr::rdma_write(1, &[a.mr.sge(0, big)?], b.mr.addr(), b.mr.rkey())?.signaled(),
        wr::rdma_read(2, &[a.mr.sge(big, 64)?], b.mr.addr() + big as u64 - 64, b.mr.rkey())?.signaled(),
    ])?;
    let ids: Vec<u64> = poll_n(&a.cq, 2, WAIT)?.iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, [1, 2]);
    let mut got = [0u8; 64];
    a.mr.read(big, &mut got)?;
    assert_eq!(got, [0x3c; 64]);
    // A direct write then a direct read of the same bytes.
    let before = carried(&a);
    a.mr.fill(0, 64, 0x5d)?;
    a.qp.post_send(&[
        wr::rdma_write(3, &[a.mr.sge(0, 64)?], b.mr.addr() + 4096, b.mr.rkey())?.signaled(),
        wr::rdma_read(4, &[a.mr.sge(big, 64)?], b.mr.addr() + 4096, b.mr.rkey())?.signaled(),
    ])?;
    assert_eq!(poll_n(&a.cq, 2, WAIT)?.iter().map(|w| w.wr_id).collect::<Vec<_>>(), [3, 4]);
    assert_eq!(carried(&a), before + 2);
    a.mr.read(big, &mut got)?;
    assert_eq!(got, [0x5d; 64]);
    Ok(())
}

#[test]
fn bad_reads_are_remote_access_errors_on_both_sides() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    for case in 0..3 {
        let (a, b) = pair(&d, 4096)?;
        // A region of b's without remote read (its key is granted for
        // writes only).
        let wo = b.pd.alloc_mr(4096, vrdma::AccessFlags::LOCAL_WRITE | vrdma::AccessFlags::REMOTE_WRITE)?;
        a.qp.post_send(&[wr::rdma_write(1, &[a.mr.sge(0, 8)?], wo.addr(), wo.rkey())?.signaled()])?;
        a.qp.post_send(&[wr::rdma_read(2, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?.signaled()])?;
        assert_eq!(poll_n(&a.cq, 2, WAIT)?.iter().filter(|w| w.status == WcStatus::Success).count(), 2);
        assert_eq!(carried(&a), 2, "both keys granted");
        a.mr.fill(0, 4096, 0xa5)?;
        let bad = match case {
            0 => wr::rdma_read(3, &[a.mr.sge(0, 16)?], b.mr.addr() + 4090, b.mr.rkey())?,
            1 => wr::rdma_read(3, &[a.mr.sge(0, 16)?], b.mr.addr(), b.mr.rkey() ^ 0x5555)?,
            _ => wr::rdma_read(3, &[a.mr.sge(0, 16)?], wo.addr(), wo.rkey())?,
        };
        a.qp.post_send(&[bad.signaled()])?;
        let wc = poll_one(&a.cq, WAIT)?;
        assert_eq!((wc.wr_id, wc.status), (3, WcStatus::RemAccessErr), "case {case}");
        wait_state(&a.qp, QpState::Err, WAIT)?;
        wait_state(&b.qp, QpState::Err, WAIT)?;
        assert_eq!(carried(&a), 2, "the bad read went to the engine");
        assert!(a.mr.to_vec().iter().all(|&x| x == 0xa5), "a byte was read");
        a.qp.post_send(&[wr::rdma_read(4, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?.signaled()])?;
        assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::WrFlushErr);
        assert_eq!(carried(&a), 2);
    }
    Ok(())
}

#[test]
fn a_read_into_a_region_without_local_write_is_the_engines_local_protection_error() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let (a, b) = pair(&d, 4096)?;
    let ro = a.pd.alloc_mr(4096, vrdma::AccessFlags::empty())?;
    a.qp.post_send(&[wr::rdma_read(1, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?.signaled()])?;
    assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::Success);
    assert_eq!(carried(&a), 1);
    b.mr.fill(0, 8, 0x11)?;
    a.qp.post_send(&[wr::rdma_read(2, &[ro.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?.signaled()])?;
    let wc = poll_one(&a.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::LocProtErr));
    assert_eq!(carried(&a), 1, "not carried");
    assert!(ro.to_vec().iter().all(|&x| x == 0));
    Ok(())
}

#[test]
fn no_read_returns_a_byte_once_deregistration_returned() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let (a, b) = pair(&d, 4096)?;
    let mut mem = vec![0x66u8; 8192];
    let ptr = mem.as_mut_ptr();
    // SAFETY: `mem` outlives the region (dropped below, before `mem`) and
    // nothing else touches it meanwhile.
    let mr = unsafe { b.pd.register_raw(ptr, mem.len(), vrdma_it::access_all())? };
    let (addr, rkey) = (mr.addr(), mr.rkey());
    a.qp.post_send(&[wr::rdma_read(1, &[a.mr.sge(0, 64)?], addr, rkey)?.signaled()])?;
    assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::Success);
    assert_eq!(carried(&a), 1, "granted and carried");
    assert!(a.mr.to_vec()[..64].iter().all(|&x| x == 0x66));
    drop(mr);
    // SAFETY: the region is gone; `ptr` still addresses `mem`'s bytes,
    // written raw since the daemon no longer reaches them.
    unsafe { std::ptr::write_bytes(ptr, 0x99, 8192) };
    a.mr.fill(0, 64, 0)?;
    a.qp.post_send(&[wr::rdma_read(2, &[a.mr.sge(0, 64)?], addr, rkey)?.signaled()])?;
    let wc = poll_one(&a.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::RemAccessErr));
    assert_eq!(carried(&a), 1);
    assert!(a.mr.to_vec()[..64].iter().all(|&x| x == 0), "a read returned bytes after deregistration");
    drop(mem);
    Ok(())
}

#[test]
fn reads_racing_a_deregistration_never_return_bytes_written_after_it() -> Result<()> {
    const MAX_READS: u64 = 1_000_000;
    let d = DaemonProc::start_with_config(ON)?;
    let (a, b) = pair(&d, 4096)?;
    let mut mem = vec![0x11u8; 4096];
    let ptr = mem.as_mut_ptr();
    // SAFETY: `mem` outlives the region and every read of it (the reader
    // is joined before `mem` drops); only raw writes touch it meanwhile.
    let mr = unsafe { b.pd.register_raw(ptr, mem.len(), vrdma_it::access_all())? };
    let (addr, rkey) = (mr.addr(), mr.rkey());
    let (last, stale, ok) = std::thread::scope(|sc| -> Result<_> {
        // Reads one after another until one fails.
        let reader = sc.spawn(|| -> Result<(WcStatus, u64, u64)> {
            let end = std::time::Instant::now() + std::time::Duration::from_secs(30);
            let (mut stale, mut ok) = (0u64, 0u64);
            for i in 0..MAX_READS {
                anyhow::ensure!(std::time::Instant::now() < end, "the reads never failed");
                a.qp.post_send(&[wr::rdma_read(i, &[a.mr.sge(0, 64)?], addr, rkey)?.signaled()])?;
                let wc = poll_one(&a.cq, WAIT)?;
                if wc.status != WcStatus::Success {
                    return Ok((wc.status, stale, ok));
                }
                ok += 1;
                if a.mr.to_vec()[..64].iter().any(|&x| x != 0x11) {
                    stale += 1;
                }
            }
            anyhow::bail!("{MAX_READS} reads and none failed")
        });
        vrdma_it::wait_until(WAIT, "direct reads", || carried(&a) >= 200)?;
        drop(mr);
        // SAFETY: as above; the region is gone, so no read may see this.
        unsafe { std::ptr::write_bytes(ptr, 0x22, 4096) };
        reader.join().unwrap_or_else(|_| Err(anyhow::anyhow!("the reader panicked")))
    })?;
    assert_eq!(last, WcStatus::RemAccessErr);
    assert!(ok >= 200 && carried(&a) >= ok, "{ok} reads, {} carried", carried(&a));
    assert_eq!(stale, 0, "a read returned bytes written after deregistration returned");
    drop(mem);
    Ok(())
}
