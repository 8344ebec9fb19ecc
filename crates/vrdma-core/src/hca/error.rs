use crate::qp::fsm::ModifyError;

/// Why a control operation failed. Each maps to the errno that rdma-core
/// returns for the same mistake.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HcaError {
    #[error("no {kind} {id:#x} in this context")]
    NoSuchObject { kind: &'static str, id: u32 },
    #[error("{0} is still in use")]
    Busy(&'static str),
    #[error("tenant quota exceeded: {0}")]
    QuotaExceeded(String),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("modify_qp rejected: {0}")]
    Modify(#[from] ModifyError),
    #[error("not supported: {0}")]
    Unsupported(&'static str),
    #[error("device limit reached: {0}")]
    Exhausted(&'static str),
    /// The tenant is paused for a migration: a call that would change its
    /// device state is not run (the snapshot would not hold it). The
    /// daemon holds such calls before they reach the core
    /// (`docs/migration.md`, "Calls while a tenant is paused").
    #[error("tenant {0} is paused for a migration; the call was not run")]
    TenantPaused(u32),
}

impl HcaError {
    /// The errno a verbs call returns for this error.
    pub fn errno(&self) -> i32 {
        match self {
            HcaError::NoSuchObject { .. } | HcaError::InvalidArgument(_) | HcaError::Modify(_) => {
                22 // EINVAL
            }
            HcaError::Busy(_) => 16,                                   // EBUSY
            HcaError::QuotaExceeded(_) | HcaError::Exhausted(_) => 12, // ENOMEM
            HcaError::Unsupported(_) => 95,                            // EOPNOTSUPP
            HcaError::TenantPaused(_) => 11,                           // EAGAIN
        }
    }

    pub(crate) fn invalid(msg: impl Into<String>) -> Self {
        HcaError::InvalidArgument(msg.into())
    }
}
