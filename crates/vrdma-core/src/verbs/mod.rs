//! Verbs vocabulary: the enums, flags and attribute records that
//! `libibverbs` defines, with the numeric values of `<infiniband/verbs.h>`
//! so that the C shim can pass them through unchanged.

mod attr;
mod types;

pub use attr::*;
pub use types::*;
