//! Byte layouts of the entries in the shared-memory queues.
//!
//! The queues live in memory that both the tenant and the daemon map, so an
//! entry is a wire format: fixed little-endian offsets, encoded by the
//! producer and decoded by the consumer from a private copy, never read in
//! place. Each entry has a `Repr` (the decoded, validated value) and an
//! `encode`/`decode` pair over a byte slice, in the manner of smoltcp's
//! `wire` module.

mod cqe;
mod wqe;

pub use cqe::{Cqe, CQE_SIZE, CQE_STATUS_BYTE};
pub use wqe::{
    recv_stride, send_stride, RecvSlot, RecvWr, SendWr, Sge, SgeList, UdDest, WqeError, MAX_INLINE, MAX_SGE,
    RECV_HEADER, SEND_HEADER, SGE_SIZE,
};

#[inline]
fn get_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
#[inline]
fn get_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
#[inline]
fn get_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}
#[inline]
fn put_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
#[inline]
fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
#[inline]
fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
