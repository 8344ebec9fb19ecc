//! Shared receive queues.

use std::sync::Arc;

use vrdma_core::proto::{Reply, Request};
use vrdma_core::ring::{RecvWr, RECV_HEADER};
use vrdma_core::verbs::SrqAttr;
use vrdma_shm::RingView;

use crate::context::Context;
use crate::control;
use crate::error::{Error, PostError, Result};
use crate::pd::ProtectionDomain;
use crate::qp::push_recvs;

/// A shared receive queue (`ibv_srq`): receive requests that any QP
/// created with it consumes.
///
/// Cheap to clone; destroyed when the last clone and the last QP using it
/// are gone.
#[derive(Clone, Debug)]
pub struct SharedReceiveQueue {
    pub(crate) inner: Arc<SrqInner>,
}

#[derive(Debug)]
pub(crate) struct SrqInner {
    pd: ProtectionDomain,
    srqn: u32,
    attr: SrqAttr,
    ring: RingView,
}

impl Drop for SrqInner {
    fn drop(&mut self) {
        self.pd.context().inner.control.destroy(Request::DestroySrq { srq: self.srqn });
    }
}

impl SharedReceiveQueue {
    pub(crate) fn create(pd: &ProtectionDomain, attr: SrqAttr) -> Result<SharedReceiveQueue> {
        let ctx = pd.context();
        let req = Request::CreateSrq { pd: pd.pd_id(), attr };
        let answer = ctx.inner.control.call(&req, &[])?;
        let Reply::Srq { srq, attr, segment_len, ring } = answer.reply else {
            return Err(control::unexpected(&req, &answer.reply));
        };
        let view = (|| -> Result<RingView> {
            let seg = answer
                .take_rings(1, "Srq")?
                .pop()
                .ok_or_else(|| Error::protocol("Srq reply lacks its descriptor"))?
                .segment(segment_len, "SRQ segment length")?;
            let view = RingView::in_segment(
                seg,
                control::to_usize(ring.offset, "SRQ ring offset")?,
                ring.capacity,
                ring.stride as usize,
            )?;
            if view.stride() < RECV_HEADER {
                return Err(Error::protocol(format!("SRQ slots of {} bytes", view.stride())));
            }
            Ok(view)
        })();
        let ring = match view {
            Ok(r) => r,
            Err(e) => {
                ctx.inner.control.destroy(Request::DestroySrq { srq });
                return Err(e);
            }
        };
        Ok(SharedReceiveQueue { inner: Arc::new(SrqInner { pd: pd.clone(), srqn: srq, attr, ring }) })
    }

    /// The daemon's number for this SRQ.
    pub fn srqn(&self) -> u32 {
        self.inner.srqn
    }

    /// The attributes granted at creation (`max_wr` rounded up; the limit
    /// as first set: [`query`](Self::query) reports the current one).
    pub fn attr(&self) -> SrqAttr {
        self.inner.attr
    }

    /// The protection domain the SRQ belongs to.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.inner.pd
    }

    /// The context the SRQ belongs to.
    pub fn context(&self) -> &Context {
        self.inner.pd.context()
    }

    /// `ibv_post_srq_recv`. Fails with `EINVAL` for a request with more
    /// SGEs than the SRQ's `max_sge`, with `ENOMEM`
    /// ([`Error::QueueFull`]) when the SRQ is full.
    pub fn post_recv(&self, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        if wrs.is_empty() {
            return Ok(());
        }
        push_recvs(self.context(), &self.inner.ring, self.inner.attr.max_sge, wrs, || true)
    }

    /// `ibv_modify_srq(IBV_SRQ_LIMIT)`: arms the limit event, which fires
    /// (as [`AsyncEventType::SrqLimitReached`](crate::AsyncEventType)) once
    /// fewer than `limit` requests remain; 0 disarms it.
    pub fn set_limit(&self, limit: u32) -> Result<()> {
        self.context().inner.control.call_done(&Request::ModifySrq {
            srq: self.inner.srqn,
            limit: Some(limit),
            resize: false,
        })
    }

    /// `ibv_query_srq`: the current attributes.
    pub fn query(&self) -> Result<SrqAttr> {
        let req = Request::QuerySrq { srq: self.inner.srqn };
        match self.context().inner.control.call(&req, &[])?.reply {
            Reply::SrqAttr(a) => Ok(a),
            other => Err(control::unexpected(&req, &other)),
        }
    }
}
