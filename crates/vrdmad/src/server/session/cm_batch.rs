//! `CmRequest::Batch`: several connection-manager calls in one message.
//!
//! A connection's setup is a chain of calls that each wait for a round
//! trip (two thread wake-ups, most of a call's cost on a loaded host);
//! some follow one another with nothing of the first's reply needed by
//! the second (`rdma_create_qp`, then `rdma_accept`, whose QP number the
//! daemon takes from the attached QP). A batch runs such calls in order,
//! each exactly as if it came alone, and stops at the first that fails:
//! what ran before it stays done, as it would have apart, and the reply
//! says which failed. The calls a batch may carry are a type of their own
//! (`CmBatchOp`), so a batch cannot hold a batch, and their count is
//! bounded (`MAX_CM_BATCH`).

use vrdma_core::proto::{CmBatchOp, CmRequest, Reply, Request, MAX_CM_BATCH};

use super::{error, Answer, Session, EINVAL};

const EOPNOTSUPP: i32 = libc::EOPNOTSUPP;

impl Session {
    /// Runs `ops` in order (see the module's notes); answered
    /// `Reply::Batch`, with each call's descriptors in order.
    pub(super) fn cm_batch(&mut self, ops: Vec<CmBatchOp>) -> Result<Answer, Answer> {
        if self.guest.is_some() {
            // A guest's rings are extents its port describes one reply at
            // a time; it sends its calls one by one.
            return Err(error(EOPNOTSUPP, "a batch of rdma_cm calls is for host contexts"));
        }
        if ops.is_empty() || ops.len() > MAX_CM_BATCH {
            return Err(error(
                EINVAL,
                format!("a batch of {} rdma_cm calls (1 to {MAX_CM_BATCH})", ops.len()),
            ));
        }
        let mut replies = Vec::with_capacity(ops.len());
        let mut fds = Vec::new();
        let mut failed = None;
        for (i, op) in ops.into_iter().enumerate() {
            let answer = match self.dispatch(Request::Cm(CmRequest::from(op)), Vec::new()) {
                Ok(a) | Err(a) => a,
            };
            match answer.reply {
                Reply::Error { errno, message } => {
                    // What the earlier calls made stays theirs, as apart:
                    // their replies and descriptors go back with this.
                    replies
                        .push(Reply::Error { errno, message: format!("call {i} of the batch: {message}") });
                    failed = Some(i as u32);
                    break;
                }
                reply => {
                    replies.push(reply);
                    fds.extend(answer.fds);
                }
            }
        }
        Ok(Answer { reply: Reply::Batch { replies, failed }, fds })
    }
}
