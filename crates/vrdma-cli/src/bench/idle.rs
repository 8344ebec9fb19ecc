//! Idle QPs for the default report's figure of what they cost others.
//!
//! A program may hold thousands of connected QPs and use a few (MPI ranks
//! keep one per peer). The engine serves only QPs with work, so these
//! must cost everyone else's latency nothing; the report measures that
//! beside the same latency without them.

use anyhow::{Context as _, Result};
use vrdma::{AccessFlags, Context, QpCap, QueuePair};

/// Connected QPs in RTS that never post, held open by one context.
pub struct IdleQps {
    qps: Vec<QueuePair>,
    _ctx: Context,
}

impl IdleQps {
    /// `n` QPs, each connected to itself, on the daemon at `sock`.
    pub fn create(sock: &std::path::Path, n: usize) -> Result<IdleQps> {
        let ctx = Context::open_at(sock).context("opening a context for the idle QPs")?;
        let pd = ctx.alloc_pd()?;
        let cq = ctx.create_cq(1, None)?;
        let cap =
            QpCap { max_send_wr: 1, max_recv_wr: 1, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let qps = (0..n)
            .map(|_| {
                let qp = pd.create_rc_qp(&cq, &cq, cap)?;
                qp.connect(&qp.endpoint(&ctx)?, AccessFlags::empty())?;
                Ok(qp)
            })
            .collect::<Result<Vec<_>>>()
            .with_context(|| format!("creating {n} idle QPs (the tenant's object quota may be lower)"))?;
        Ok(IdleQps { qps, _ctx: ctx })
    }

    pub fn len(&self) -> usize {
        self.qps.len()
    }
}
