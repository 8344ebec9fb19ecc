//! Idle QPs for the default report's figure of what they cost others.
//!
//! A program may hold thousands of connected QPs and use a few (MPI ranks
//! keep one per peer). The engine serves only QPs with work, so these
//! must cost everyone else's latency nothing; the report measures that
//! beside the same latency without them.
//!
//! A tenant's QPs are bounded by its share of the daemon's mappings (one
//! per QP; `max_mappings / max_tenants`, about 3070 at the defaults), so
//! [`IdleQps::create_up_to`] holds as many as asked if the share allows,
//! else what it allows less a margin for the same tenant's other
//! contexts (the benchmark's workers), instead of failing the report.

use anyhow::{Context as _, Result};
use vrdma::{AccessFlags, Context, QpCap, QueuePair};

/// Mappings left to the tenant's other objects: a worker's context, region,
/// CQ and QP are four.
const MARGIN: usize = 64;

/// Connected QPs in RTS that never post, held open by one context.
pub struct IdleQps {
    qps: Vec<QueuePair>,
    ctx: Context,
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
        Ok(IdleQps { qps, ctx })
    }

    /// At most `n` QPs: fewer if this tenant's share of the device (as
    /// `ibv_query_device` shows it) is smaller, keeping [`MARGIN`] for its
    /// other objects.
    pub fn create_up_to(sock: &std::path::Path, n: usize) -> Result<IdleQps> {
        let room =
            Context::open_at(sock).context("opening a context to query the device")?.query_device()?.max_qp
                as usize;
        IdleQps::create(sock, n.min(room.saturating_sub(MARGIN)).max(1))
    }

    pub fn len(&self) -> usize {
        self.qps.len()
    }

    pub fn qpns(&self) -> Vec<u32> {
        self.qps.iter().map(|q| q.qpn()).collect()
    }

    pub fn context(&self) -> &Context {
        &self.ctx
    }
}
