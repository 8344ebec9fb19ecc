//! Large RDMA writes on the direct path (issue 17's bandwidth item): a
//! write of up to `vrdma::DIRECT_MAX_RDMA_BYTES` (1 MiB) is one copy
//! straight into the peer's region by the requester, as the engine's is
//! (in 64 KiB turns). Bytes, order with a following SEND and with an
//! engine-path write, and errors (bad rkey, bounds) as the engine gives
//! them.

use super::*;

const MIB: usize = 1 << 20;

#[test]
fn a_one_mib_write_is_carried_and_lands_before_a_following_send() -> Result<()> {
    assert_eq!(vrdma::DIRECT_MAX_RDMA_BYTES, MIB as u64);
    let d = DaemonProc::start_with_config(ON)?;
    let (a, b) = pair(&d, 2 * MIB + 4096)?;
    let data = pattern(MIB, 11);
    a.mr.write(0, &data)?;
    a.mr.write(MIB, b"after!!!")?;
    b.mr.fill(0, 2 * MIB + 4096, 0)?;
    b.qp.post_recv(&[wr::recv(77, &[b.mr.sge(2 * MIB, 64)?])?])?;
    // One call: the 1 MiB write at an odd offset, then a SEND whose
    // receive completion the peer sees only after the write's bytes.
    a.qp.post_send(&[
        wr::rdma_write(1, &[a.mr.sge(0, MIB)?], b.mr.addr() + 3, b.mr.rkey())?.signaled(),
        wr::send(2, &[a.mr.sge(MIB, 8)?])?.signaled(),
    ])?;
    let wcs = poll_n(&a.cq, 2, WAIT)?;
    let got: Vec<_> = wcs.iter().map(|w| (w.wr_id, w.status, w.opcode)).collect();
    assert_eq!(got, [(1, WcStatus::Success, WcOpcode::RdmaWrite), (2, WcStatus::Success, WcOpcode::Send)]);
    assert_eq!(carried(&a), 2, "the 1 MiB write and the send took the direct path");
    let wc = poll_one(&b.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status, wc.byte_len), (77, WcStatus::Success, 8));
    let mut landed = vec![0u8; MIB + 6];
    b.mr.read(0, &mut landed)?;
    assert_eq!(&landed[..3], &[0, 0, 0], "a byte before the write's address changed");
    assert!(landed[3..3 + MIB] == data[..], "the write's bytes");
    assert_eq!(&landed[3 + MIB..], &[0, 0, 0], "a byte after the write changed");
    let mut sent = [0u8; 8];
    b.mr.read(2 * MIB, &mut sent)?;
    assert_eq!(&sent, b"after!!!");
    Ok(())
}

#[test]
fn direct_large_writes_and_an_engine_one_land_in_order() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let big = 2 * MIB; // above the direct limit: the engine's
    assert!(big as u64 > vrdma::DIRECT_MAX_RDMA_BYTES);
    let (a, b) = pair(&d, 2 * big)?;
    a.mr.fill(0, MIB, 0x11)?;
    a.mr.fill(MIB, MIB, 0x22)?;
    a.mr.fill(big, big, 0x33)?;
    // Direct (0x11 over the first MiB), then the engine's 2 MiB (0x33 over
    // both), then another 1 MiB (0x22 over the first), which waits for
    // the engine's and goes there with it: the first MiB ends 0x22, the
    // second 0x33.
    a.qp.post_send(&[
        wr::rdma_write(1, &[a.mr.sge(0, MIB)?], b.mr.addr(), b.mr.rkey())?.signaled(),
        wr::rdma_write(2, &[a.mr.sge(big, big)?], b.mr.addr(), b.mr.rkey())?.signaled(),
        wr::rdma_write(3, &[a.mr.sge(MIB, MIB)?], b.mr.addr(), b.mr.rkey())?.signaled(),
    ])?;
    let ids: Vec<u64> = poll_n(&a.cq, 3, WAIT)?.iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, [1, 2, 3]);
    assert_eq!(carried(&a), 1, "only the first was carried");
    let got = b.mr.to_vec();
    assert!(got[..MIB].iter().all(|&x| x == 0x22), "order lost in the first MiB");
    assert!(got[MIB..big].iter().all(|&x| x == 0x33), "order lost in the second MiB");
    // All polled: the next 1 MiB write is carried again.
    a.qp.post_send(&[
        wr::rdma_write(4, &[a.mr.sge(0, MIB)?], b.mr.addr() + MIB as u64, b.mr.rkey())?.signaled()
    ])?;
    assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::Success);
    assert_eq!(carried(&a), 2);
    assert!(b.mr.to_vec()[MIB..big].iter().all(|&x| x == 0x11));
    Ok(())
}

#[test]
fn a_large_write_with_a_bad_key_or_bounds_is_a_remote_access_error_and_lands_nothing() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    for case in 0..2 {
        let (a, b) = pair(&d, MIB)?;
        a.qp.post_send(&[wr::rdma_write(1, &[a.mr.sge(0, MIB)?], b.mr.addr(), b.mr.rkey())?.signaled()])?;
        assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::Success);
        assert_eq!(carried(&a), 1, "a 1 MiB write is carried");
        b.mr.fill(0, MIB, 0x5a)?;
        a.mr.fill(0, MIB, 0x01)?;
        let bad = match case {
            // One byte past the region's end.
            0 => wr::rdma_write(2, &[a.mr.sge(0, MIB)?], b.mr.addr() + 1, b.mr.rkey())?,
            _ => wr::rdma_write(2, &[a.mr.sge(0, MIB)?], b.mr.addr(), b.mr.rkey() ^ 0x5555)?,
        };
        super::a_bad_write_breaks_both_and_lands_nothing(&a, &b, bad, case)?;
    }
    Ok(())
}
