//! A 64 KiB SEND stream on the direct path, both sides in one thread.
//!
//! Two RC QPs of one process, each on its own CQ, connected to each
//! other, as `vrdma bench --direct-bw`'s workers make them (`DEPTH` sends
//! in flight, `4 * DEPTH` receives posted ahead, one SGE each). One thread
//! does both sides: A posts sends one at a time while fewer than `DEPTH`
//! are outstanding, B polls its CQ and reposts each receive that
//! completed, A polls its own. Nothing waits for another CPU and no cache
//! line moves between CPUs, so the time per message against `memcpy`'s
//! (the `write` and `memcpy` modes, same sizes and buffers' alignment) is
//! the library's own per-message CPU on top of the copy
//! (docs/direct-path.md, round 18).
//!
//! ```text
//! vrdma daemon --socket /tmp/x.sock &
//! VRDMA_SOCKET=/tmp/x.sock target/release/examples/send_stream send 100000
//! VRDMA_SOCKET=/tmp/x.sock target/release/examples/send_stream write 100000
//! target/release/examples/send_stream memcpy 100000
//! ```

use vrdma::{
    AccessFlags, CompletionQueue, Context, MemoryRegion, QpCap, QueuePair, RecvWr, SendFlags, SendOpcode,
    SendWr, SgeList,
};

const SIZE: usize = 64 << 10;
const DEPTH: u64 = 16;

struct Side {
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
}

fn side(ctx: &Context, pd: &vrdma::ProtectionDomain) -> vrdma::Result<Side> {
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let mr = pd.alloc_mr(2 * SIZE, access)?;
    let cq = ctx.create_cq(4 * DEPTH as u32, None)?;
    let cap = QpCap {
        max_send_wr: 4 * DEPTH as u32,
        max_recv_wr: 4 * DEPTH as u32,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 64,
    };
    let qp = pd.create_rc_qp(&cq, &cq, cap)?;
    Ok(Side { cq, qp, mr })
}

fn memcpy(iters: u64) -> std::time::Duration {
    let src = vec![1u8; SIZE + 4096];
    let mut dst = vec![0u8; SIZE + 4096];
    // Both page-aligned, as the regions are.
    let (s, d) = (src.as_ptr().align_offset(4096), dst.as_ptr().align_offset(4096));
    let start = std::time::Instant::now();
    for _ in 0..iters {
        dst[d..d + SIZE].copy_from_slice(std::hint::black_box(&src[s..s + SIZE]));
        std::hint::black_box(&mut dst);
    }
    start.elapsed()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mode = std::env::args().nth(1).unwrap_or_else(|| "send".into());
    let iters: u64 = std::env::args().nth(2).map(|s| s.parse()).transpose()?.unwrap_or(100_000);
    if mode == "memcpy" {
        let t = memcpy(iters);
        println!("memcpy: {:.0} ns per 64 KiB", t.as_nanos() as f64 / iters as f64);
        return Ok(());
    }
    let op = match mode.as_str() {
        "send" => SendOpcode::Send,
        "write" => SendOpcode::RdmaWrite,
        _ => return Err(format!("mode {mode:?}: send, write or memcpy").into()),
    };
    let ctx = Context::open()?;
    let pd = ctx.alloc_pd()?;
    let (a, b) = (side(&ctx, &pd)?, side(&ctx, &pd)?);
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    a.qp.connect(&b.qp.endpoint(&ctx)?, access)?;
    b.qp.connect(&a.qp.endpoint(&ctx)?, access)?;
    // B's receives, built once (the receive WR is the same every time).
    let recv = RecvWr { wr_id: 0, sg: SgeList::from_slice(&[b.mr.sge(0, SIZE)?])? };
    let ahead = 4 * DEPTH;
    if op == SendOpcode::Send {
        for _ in 0..ahead {
            b.qp.post_recv(std::slice::from_ref(&recv)).map_err(|e| e.error)?;
        }
    }
    let mut wr = SendWr::new(0, op);
    wr.flags |= SendFlags::SIGNALED;
    wr.sg = SgeList::from_slice(&[a.mr.sge(SIZE, SIZE)?])?;
    wr.remote_addr = b.mr.addr();
    wr.rkey = b.mr.rkey();
    let mut wcs = vrdma::wc_array::<16>();
    let (mut posted, mut done) = (0u64, 0u64);
    let warmup = iters / 10;
    let mut start = std::time::Instant::now();
    let mut timed_from = None;
    while done < iters + warmup {
        if timed_from.is_none() && done >= warmup {
            timed_from = Some(done);
            start = std::time::Instant::now();
        }
        while posted < iters + warmup && posted - done < DEPTH {
            wr.wr_id = posted;
            a.qp.post_send(std::slice::from_ref(&wr)).map_err(|e| e.error)?;
            posted += 1;
        }
        if op == SendOpcode::Send {
            let n = b.cq.poll(&mut wcs)?;
            for wc in &wcs[..n] {
                if wc.status != vrdma::WcStatus::Success {
                    return Err(format!("receive {} failed: {}", wc.wr_id, wc.status.as_str()).into());
                }
                b.qp.post_recv(std::slice::from_ref(&recv)).map_err(|e| e.error)?;
            }
        }
        let n = a.cq.poll(&mut wcs)?;
        for wc in &wcs[..n] {
            if wc.status != vrdma::WcStatus::Success {
                return Err(format!("wr {} failed: {}", wc.wr_id, wc.status.as_str()).into());
            }
        }
        done += n as u64;
    }
    let elapsed = start.elapsed();
    let timed = iters + warmup - timed_from.unwrap_or(0);
    let (carried, _) = a.qp.direct_stats();
    println!(
        "{mode}: {:.0} ns per 64 KiB message (one thread, {timed} timed), {carried} of {} carried",
        elapsed.as_nanos() as f64 / timed as f64,
        iters + warmup
    );
    Ok(())
}
