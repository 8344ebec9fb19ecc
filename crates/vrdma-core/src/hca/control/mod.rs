//! The control operations (`ibv_alloc_pd`, `ibv_reg_mr`, `ibv_modify_qp`,
//! ...), one file per kind of object. Each checks ownership, quotas and
//! the verbs rules before it changes the object tables.

mod context;
mod cq;
mod memory;
mod qp;
mod srq;
