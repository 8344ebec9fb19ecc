//! Address handles.

use std::sync::Arc;

use vrdma_core::proto::{Reply, Request};
use vrdma_core::verbs::AhAttr;

use crate::context::Context;
use crate::control;
use crate::error::Result;
use crate::pd::ProtectionDomain;

/// An address handle (`ibv_ah`): where a UD send goes. Name it in a send
/// with [`wr::ud_send`](crate::wr::ud_send); the QP posting it must belong
/// to the same protection domain, else the send completes with
/// `LocQpOpErr`.
///
/// Cheap to clone; destroyed when the last clone is gone. Keep it alive
/// until the sends naming it have completed: a send whose handle is gone
/// when the device reaches it fails with `LocQpOpErr`.
#[derive(Clone, Debug)]
pub struct AddressHandle {
    inner: Arc<AhInner>,
}

#[derive(Debug)]
struct AhInner {
    pd: ProtectionDomain,
    ah: u32,
    attr: AhAttr,
}

impl Drop for AhInner {
    fn drop(&mut self) {
        self.pd.context().inner.control.destroy(Request::DestroyAh { ah: self.ah });
    }
}

impl AddressHandle {
    pub(crate) fn create(pd: &ProtectionDomain, attr: &AhAttr) -> Result<AddressHandle> {
        let req = Request::CreateAh { pd: pd.pd_id(), attr: *attr };
        match pd.context().inner.control.call(&req, &[])?.reply {
            Reply::Ah { ah } => {
                Ok(AddressHandle { inner: Arc::new(AhInner { pd: pd.clone(), ah, attr: *attr }) })
            }
            other => Err(control::unexpected(&req, &other)),
        }
    }

    /// The daemon's number for this handle, which a [`SendWr`](crate::SendWr)
    /// carries in `ud.ah` (never 0).
    pub fn handle(&self) -> u32 {
        self.inner.ah
    }

    /// The address vector it was created with.
    pub fn attr(&self) -> AhAttr {
        self.inner.attr
    }

    /// The protection domain the handle belongs to.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.inner.pd
    }

    /// The context the handle belongs to.
    pub fn context(&self) -> &Context {
        self.inner.pd.context()
    }
}
