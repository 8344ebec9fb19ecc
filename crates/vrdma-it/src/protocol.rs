//! What the test process and a tenant peer say to each other.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hello {
    pub endpoint: vrdma::Endpoint,
    pub addr: u64,
    pub rkey: u32,
    pub pid: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Command {
    Connect { peer: vrdma::Endpoint },
    PostRecv { count: usize, offset: usize, len: usize },
    Fill { offset: usize, data: Vec<u8> },
    Read { offset: usize, len: usize },
    Send { wr_id: u64, offset: usize, len: usize, imm: Option<u32> },
    Flood { remote_addr: u64, rkey: u32, len: usize, count: u64 },
    Poll { count: usize, timeout_ms: u64 },
    State,
    Exit,
}

/// A completion as the peer reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wc {
    pub wr_id: u64,
    pub status: u8,
    pub opcode: u8,
    pub byte_len: u32,
    pub imm: Option<u32>,
    pub src_qp: u32,
}

impl From<&vrdma::WorkCompletion> for Wc {
    fn from(w: &vrdma::WorkCompletion) -> Wc {
        Wc {
            wr_id: w.wr_id,
            status: w.status.raw(),
            opcode: w.opcode.raw(),
            byte_len: w.byte_len,
            imm: w.wc_flags.contains(vrdma::WcFlags::WITH_IMM).then_some(w.imm_data),
            src_qp: w.src_qp,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Said {
    Hello(Hello),
    Ok,
    Flooding,
    Bytes(Vec<u8>),
    Completions(Vec<Wc>),
    State(u8),
    Error { errno: i32, message: String },
}
