//! Queue-pair rules that do not depend on any other object: the
//! `ibv_modify_qp` state machine and the IB timer encodings.

pub mod fsm;
pub mod timers;
