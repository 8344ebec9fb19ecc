//! Builders for work requests.
//!
//! [`SendWr`] and [`RecvWr`] are plain records; these functions fill the
//! fields each operation needs, and [`SendWrExt`] adds the flags:
//!
//! ```
//! use vrdma::wr::{self, SendWrExt};
//! use vrdma::Sge;
//!
//! let local = Sge { addr: 0x1000, length: 64, lkey: 7 };
//! let write = wr::rdma_write(1, &[local], 0x7f00_0000_0000, 42)?
//!     .with_imm(0xbeef)
//!     .signaled();
//! let hello = wr::send(2, &[])?.inline(b"hello")?.signaled();
//! let recv = wr::recv(3, &[local])?;
//! # let _ = (write, hello, recv);
//! # Ok::<(), vrdma::Error>(())
//! ```
//!
//! The functions taking SGE slices fail with `InvalidArgument` for more
//! than [`MAX_SGE`] entries (the QP's own `max_send_sge` is checked when
//! posting).

use vrdma_core::ring::{RecvWr, SendWr, Sge, SgeList, UdDest, MAX_INLINE, MAX_SGE};
use vrdma_core::verbs::{SendFlags, SendOpcode};

use crate::ah::AddressHandle;
use crate::error::{Error, Result};

fn sges(list: &[Sge]) -> Result<SgeList> {
    SgeList::from_slice(list).map_err(|_| too_many(list.len()))
}

fn with_sges(wr_id: u64, opcode: SendOpcode, list: &[Sge]) -> Result<SendWr> {
    let mut wr = SendWr::new(wr_id, opcode);
    wr.sg.set(list).map_err(|_| too_many(list.len()))?;
    Ok(wr)
}

fn too_many(n: usize) -> Error {
    Error::invalid(format!("{n} SGEs in one work request, at most {MAX_SGE}"))
}

/// A send of the bytes the SGEs gather, consuming a receive request at
/// the peer.
pub fn send(wr_id: u64, sges: &[Sge]) -> Result<SendWr> {
    with_sges(wr_id, SendOpcode::Send, sges)
}

/// A datagram send on a UD QP: the gathered bytes (at most the port's
/// MTU, 4096) go to QP `remote_qpn` at the address `ah` names, if that
/// QP's Q_Key is `remote_qkey` (with the high bit set: the sending QP's own
/// Q_Key). The receiver's buffer gets a 40-byte GRH area, then the bytes.
/// Add immediate data with [`SendWrExt::with_imm`].
pub fn ud_send(
    wr_id: u64,
    sges: &[Sge],
    ah: &AddressHandle,
    remote_qpn: u32,
    remote_qkey: u32,
) -> Result<SendWr> {
    let mut wr = with_sges(wr_id, SendOpcode::Send, sges)?;
    wr.ud = UdDest { remote_qpn, remote_qkey, ah: ah.handle() };
    Ok(wr)
}

/// An RDMA write of the gathered bytes to `remote_addr` in the peer's
/// region with key `rkey`.
pub fn rdma_write(wr_id: u64, sges: &[Sge], remote_addr: u64, rkey: u32) -> Result<SendWr> {
    let mut wr = with_sges(wr_id, SendOpcode::RdmaWrite, sges)?;
    wr.remote_addr = remote_addr;
    wr.rkey = rkey;
    Ok(wr)
}

/// An RDMA read of `remote_addr` (key `rkey`) into the SGEs.
pub fn rdma_read(wr_id: u64, sges: &[Sge], remote_addr: u64, rkey: u32) -> Result<SendWr> {
    let mut wr = with_sges(wr_id, SendOpcode::RdmaRead, sges)?;
    wr.remote_addr = remote_addr;
    wr.rkey = rkey;
    Ok(wr)
}

/// An atomic compare-and-swap of the 8-byte word at `remote_addr` (key
/// `rkey`, 8-byte aligned): if it equals `compare` it becomes `swap`. The
/// word's original value lands in `result` (an 8-byte SGE).
pub fn cmp_swap(wr_id: u64, result: Sge, remote_addr: u64, rkey: u32, compare: u64, swap: u64) -> SendWr {
    let mut wr = SendWr::new(wr_id, SendOpcode::AtomicCmpAndSwp);
    wr.sg = SgeList::from_slice(&[result]).expect("one SGE fits");
    wr.remote_addr = remote_addr;
    wr.rkey = rkey;
    wr.compare_add = compare;
    wr.swap = swap;
    wr
}

/// An atomic fetch-and-add of `add` to the 8-byte word at `remote_addr`
/// (key `rkey`, 8-byte aligned). The word's original value lands in
/// `result` (an 8-byte SGE).
pub fn fetch_add(wr_id: u64, result: Sge, remote_addr: u64, rkey: u32, add: u64) -> SendWr {
    let mut wr = SendWr::new(wr_id, SendOpcode::AtomicFetchAndAdd);
    wr.sg = SgeList::from_slice(&[result]).expect("one SGE fits");
    wr.remote_addr = remote_addr;
    wr.rkey = rkey;
    wr.compare_add = add;
    wr
}

/// A receive request scattering an incoming send into the SGEs.
pub fn recv(wr_id: u64, sges: &[Sge]) -> Result<RecvWr> {
    Ok(RecvWr { wr_id, sg: self::sges(sges)? })
}

/// Flags and immediate data for [`SendWr`], builder style.
pub trait SendWrExt: Sized {
    /// Requests a work completion for this request (`IBV_SEND_SIGNALED`).
    fn signaled(self) -> Self;
    /// Asks the peer's CQ to raise a solicited event (`IBV_SEND_SOLICITED`).
    fn solicited(self) -> Self;
    /// Waits for earlier reads and atomics to finish (`IBV_SEND_FENCE`).
    fn fenced(self) -> Self;
    /// Adds immediate data, turning a send into `SendWithImm` and an RDMA
    /// write into `RdmaWriteWithImm` (other opcodes are unchanged and
    /// carry no immediate). `imm` travels as given; verbs code usually
    /// passes a big-endian value.
    fn with_imm(self, imm: u32) -> Self;
    /// Carries `data` in the request itself instead of gathering it
    /// (`IBV_SEND_INLINE`); any SGEs are dropped. Fails for more than
    /// [`MAX_INLINE`] bytes (the QP's own limit is checked when posting).
    fn inline(self, data: &[u8]) -> Result<Self>;
}

impl SendWrExt for SendWr {
    fn signaled(mut self) -> Self {
        self.flags |= SendFlags::SIGNALED;
        self
    }

    fn solicited(mut self) -> Self {
        self.flags |= SendFlags::SOLICITED;
        self
    }

    fn fenced(mut self) -> Self {
        self.flags |= SendFlags::FENCE;
        self
    }

    fn with_imm(mut self, imm: u32) -> Self {
        let with_imm = match self.opcode {
            SendOpcode::Send | SendOpcode::SendWithImm => SendOpcode::SendWithImm,
            SendOpcode::RdmaWrite | SendOpcode::RdmaWriteWithImm => SendOpcode::RdmaWriteWithImm,
            _ => return self,
        };
        self.opcode = with_imm;
        self.imm_data = imm;
        self
    }

    fn inline(mut self, data: &[u8]) -> Result<Self> {
        if data.len() > MAX_INLINE {
            return Err(Error::invalid(format!("{} inline bytes, at most {MAX_INLINE}", data.len())));
        }
        self.flags |= SendFlags::INLINE;
        self.inline[..data.len()].copy_from_slice(data);
        self.inline_len = data.len() as u16;
        self.sg = SgeList::default();
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Sge = Sge { addr: 0x1000, length: 8, lkey: 5 };

    #[test]
    fn builders_fill_fields() {
        let w = rdma_write(1, &[S, S], 0x2000, 9).unwrap();
        assert_eq!(w.opcode, SendOpcode::RdmaWrite);
        assert_eq!((w.remote_addr, w.rkey), (0x2000, 9));
        assert_eq!(w.sg.as_slice(), &[S, S]);
        assert!(w.flags.is_empty());

        let r = rdma_read(2, &[S], 0x3000, 4).unwrap();
        assert_eq!(r.opcode, SendOpcode::RdmaRead);

        let c = cmp_swap(3, S, 0x4000, 1, 10, 20);
        assert_eq!(c.opcode, SendOpcode::AtomicCmpAndSwp);
        assert_eq!((c.compare_add, c.swap), (10, 20));
        let f = fetch_add(4, S, 0x4000, 1, 5);
        assert_eq!(f.opcode, SendOpcode::AtomicFetchAndAdd);
        assert_eq!(f.compare_add, 5);

        let rv = recv(5, &[S]).unwrap();
        assert_eq!(rv.wr_id, 5);
        assert_eq!(rv.sg.as_slice(), &[S]);
    }

    #[test]
    fn flags_and_imm() {
        let s = send(1, &[S]).unwrap().signaled().solicited().fenced();
        assert!(s.flags.contains(SendFlags::SIGNALED | SendFlags::SOLICITED | SendFlags::FENCE));
        let s = s.with_imm(77);
        assert_eq!(s.opcode, SendOpcode::SendWithImm);
        assert_eq!(s.imm_data, 77);
        let w = rdma_write(1, &[S], 0, 0).unwrap().with_imm(8);
        assert_eq!(w.opcode, SendOpcode::RdmaWriteWithImm);
        let r = rdma_read(1, &[S], 0, 0).unwrap().with_imm(8);
        assert_eq!(r.opcode, SendOpcode::RdmaRead);
        assert_eq!(r.imm_data, 0);
    }

    #[test]
    fn inline_data() {
        let s = send(1, &[S]).unwrap().inline(b"hello").unwrap();
        assert!(s.is_inline());
        assert_eq!(s.inline_data(), b"hello");
        assert!(s.sg.as_slice().is_empty());
        assert_eq!(s.msg_len(), 5);
        assert!(send(1, &[]).unwrap().inline(&[0; MAX_INLINE]).is_ok());
        let e = send(1, &[]).unwrap().inline(&[0; MAX_INLINE + 1]).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
    }

    #[test]
    fn too_many_sges() {
        let many = [S; MAX_SGE + 1];
        assert_eq!(send(1, &many).unwrap_err().errno(), libc::EINVAL);
        assert!(rdma_write(1, &many, 0, 0).is_err());
        assert!(recv(1, &many).is_err());
        assert!(send(1, &many[..MAX_SGE]).is_ok());
    }

    #[test]
    fn encodes_into_a_slot() {
        let w = rdma_write(9, &[S], 0x10, 3).unwrap().signaled();
        let mut slot = vec![0u8; vrdma_core::ring::send_stride(1, 0)];
        w.encode(&mut slot).unwrap();
        assert_eq!(SendWr::decode(&slot).unwrap(), w);
    }
}
