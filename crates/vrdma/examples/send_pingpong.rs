//! The direct path's 8-byte SEND round trip, both sides in one thread.
//!
//! Two RC QPs of one process, each on its own CQ, connected to each
//! other: A sends, B polls until the receive completes, reposts it and
//! sends back, A does the same. One thread does both sides, so no
//! program ever waits for another CPU: what `perf stat -e task-clock`
//! counts divided by the round trips printed is the library's CPU per
//! round trip (two `post_send`s, two receive completions, two
//! `post_recv`s, two send completions polled), the figure that a noisy
//! machine with few CPUs can still measure (docs/direct-path.md, round
//! 17). The WRs are built as `vrdma bench`'s workers build them (8 bytes
//! inline, signaled).
//!
//! ```text
//! vrdma daemon --socket /tmp/x.sock &
//! VRDMA_SOCKET=/tmp/x.sock perf stat -e task-clock \
//!     target/release/examples/send_pingpong 200000
//! ```

use vrdma::{
    AccessFlags, CompletionQueue, Context, MemoryRegion, QpCap, QueuePair, RecvWr, SendFlags, SendOpcode,
    SendWr, SgeList, WorkCompletion,
};

const SIZE: usize = 8;
const DEPTH: u32 = 16;

struct Side {
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
}

impl Side {
    fn send(&self, wr_id: u64) -> vrdma::Result<()> {
        let mut wr = SendWr::new(wr_id, SendOpcode::Send);
        wr.flags |= SendFlags::INLINE | SendFlags::SIGNALED;
        wr.inline_len = SIZE as u16;
        self.mr.read(SIZE, &mut wr.inline[..SIZE])?;
        self.qp.post_send(&[wr]).map_err(|e| e.error)
    }

    fn post_recv(&self, wr_id: u64) -> vrdma::Result<()> {
        let mut wr = RecvWr { wr_id, sg: SgeList::default() };
        wr.sg.set(&[self.mr.sge(0, SIZE)?]).expect("one SGE fits");
        self.qp.post_recv(&[wr]).map_err(|e| e.error)
    }

    /// Polls until a receive completes (send completions are reaped on
    /// the way); `false` if none came within `polls` polls.
    fn wait_recv(&self, wcs: &mut [WorkCompletion], polls: u32) -> Result<bool, Box<dyn std::error::Error>> {
        for _ in 0..polls {
            let n = self.cq.poll(wcs)?;
            for wc in &wcs[..n] {
                if wc.status != vrdma::WcStatus::Success {
                    return Err(format!("wr {} failed: {}", wc.wr_id, wc.status.as_str()).into());
                }
            }
            if wcs[..n].iter().any(|w| w.opcode.is_recv()) {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

fn side(ctx: &Context, pd: &vrdma::ProtectionDomain) -> vrdma::Result<Side> {
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let mr = pd.alloc_mr(2 * SIZE, access)?;
    let cq = ctx.create_cq(4 * DEPTH, None)?;
    let cap = QpCap {
        max_send_wr: 4 * DEPTH,
        max_recv_wr: 4 * DEPTH,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 64,
    };
    let qp = pd.create_rc_qp(&cq, &cq, cap)?;
    Ok(Side { cq, qp, mr })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let iters: u64 = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(200_000);
    let ctx = Context::open()?;
    let pd = ctx.alloc_pd()?;
    let (a, b) = (side(&ctx, &pd)?, side(&ctx, &pd)?);
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    a.qp.connect(&b.qp.endpoint(&ctx)?, access)?;
    b.qp.connect(&a.qp.endpoint(&ctx)?, access)?;
    for r in 0..DEPTH as u64 {
        a.post_recv(r)?;
        b.post_recv(r)?;
    }
    let mut wcs = vrdma::wc_array::<16>();
    let start = std::time::Instant::now();
    for i in 1..=iters {
        a.send(i)?;
        if !b.wait_recv(&mut wcs, 1 << 20)? {
            return Err(format!("B got no message at round trip {i}").into());
        }
        b.post_recv(i)?;
        b.send(i)?;
        if !a.wait_recv(&mut wcs, 1 << 20)? {
            return Err(format!("A got no message at round trip {i}").into());
        }
        a.post_recv(i)?;
    }
    let elapsed = start.elapsed();
    let (carried, _) = a.qp.direct_stats();
    println!(
        "{iters} round trips, {:.0} ns each (one thread), {carried} of A's sends carried by the direct path",
        elapsed.as_nanos() as f64 / iters as f64
    );
    Ok(())
}
