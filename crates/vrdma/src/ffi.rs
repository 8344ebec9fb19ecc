//! Hooks for `vrdma-verbs`, the C ABI shim (`libibverbs.so.1`). Not a
//! stable API: hidden from the documentation, and only what the shim
//! needs that the public API does not say.
//!
//! libibverbs refuses to destroy an object that others still use
//! (`EBUSY` from `ibv_dealloc_pd`, `ibv_destroy_cq`, `ibv_destroy_srq`),
//! as the kernel's reference counts decide. Here the objects that use one
//! hold a handle to it (a QP holds its PD, CQs and SRQ; a memory region
//! its PD), so the number of live handles answers the same question.

use std::sync::Arc;

use crate::{CompletionQueue, ProtectionDomain, SharedReceiveQueue};

/// Live handles of the PD: this one, plus one per memory region, QP and
/// SRQ in it (and any clones the application made).
pub fn pd_handles(pd: &ProtectionDomain) -> usize {
    Arc::strong_count(&pd.inner)
}

/// Live handles of the CQ: this one, plus those of the QPs using it (one
/// per role, send or receive) and any clones.
pub fn cq_handles(cq: &CompletionQueue) -> usize {
    Arc::strong_count(&cq.inner)
}

/// Live handles of the SRQ: this one, plus one per QP taking receives
/// from it and any clones.
pub fn srq_handles(srq: &SharedReceiveQueue) -> usize {
    Arc::strong_count(&srq.inner)
}
