//! One stream's RDMA resources: a PD, one CQ (with its own completion
//! channel under `--events`), `qps` QPs and one region holding, per QP, a
//! receive slot (where the peer's writes, sends and atomics land) and a
//! source slot (what we send, and what the peer reads).

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _, Result};
use serde::{Deserialize, Serialize};
use vrdma::{
    AccessFlags, AddressHandle, AhAttr, CompletionChannel, CompletionQueue, Context, Endpoint, MemoryRegion,
    ProtectionDomain, QpCap, QueuePair, RecvWr, SendFlags, SendOpcode, SendWr, SgeList, UdDest, WcOpcode,
    WcStatus, WorkCompletion, GRH_LEN,
};

use crate::bench::spec::{TestName, Transport};

/// Send and receive queue depth of each QP.
const SQ: u32 = 64;
const RQ: u32 = 64;
/// Messages up to this size are posted inline.
const INLINE: usize = 64;
/// The Q_Key of the UD tests.
const QKEY: u32 = 0x5652_4442;
/// The most a stream may register (both sides check their own).
const MAX_REGION: usize = 1 << 30;
/// How long one wait on the completion channel lasts before the caller
/// looks at its clock again.
const EVENT_SLICE: Duration = Duration::from_millis(50);

/// What the peer needs to reach one of our QPs and its memory.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
pub struct QpInfo {
    pub endpoint: Endpoint,
    /// Where the peer's writes and atomics go: our receive slot.
    pub recv_addr: u64,
    /// What the peer's reads read: our source slot.
    pub src_addr: u64,
    pub rkey: u32,
}

pub struct Rdma {
    ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    _channel: Option<CompletionChannel>,
    qps: Vec<QueuePair>,
    index: HashMap<u32, usize>,
    mr: MemoryRegion,
    ahs: Vec<AddressHandle>,
    peers: Vec<QpInfo>,
    size: usize,
    slot: usize,
    events: bool,
    ud: bool,
    /// The opcode of the test's data messages.
    op: SendOpcode,
}

impl Rdma {
    pub fn new(ctx: &Context, test: TestName, size: usize, qps: usize, events: bool) -> Result<Rdma> {
        let ud = test.transport() == Transport::Ud;
        // Room for a UD receive's GRH; 64-byte slots keep atomics aligned.
        let slot = (size.max(8) + GRH_LEN).div_ceil(64) * 64;
        let len = slot
            .checked_mul(2 * qps)
            .filter(|l| *l <= MAX_REGION)
            .ok_or_else(|| anyhow!("{qps} QPs of {size}-byte messages need more than 1 GiB of memory"))?;
        let pd = ctx.alloc_pd()?;
        let access = AccessFlags::LOCAL_WRITE
            | AccessFlags::REMOTE_WRITE
            | AccessFlags::REMOTE_READ
            | AccessFlags::REMOTE_ATOMIC;
        let mr = pd.alloc_mr(len, access).context("registering the test's memory")?;
        let channel = events.then(|| ctx.create_comp_channel()).transpose()?;
        let cq = ctx.create_cq(qps as u32 * (SQ + RQ), channel.as_ref())?;
        let cap = QpCap {
            max_send_wr: SQ,
            max_recv_wr: RQ,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: INLINE as u32,
        };
        let mut list = Vec::with_capacity(qps);
        for _ in 0..qps {
            list.push(if ud {
                pd.create_ud_qp(&cq, &cq, cap, QKEY)?
            } else {
                pd.create_rc_qp(&cq, &cq, cap)?
            });
        }
        let index = list.iter().enumerate().map(|(i, q)| (q.qpn(), i)).collect();
        let op = match test {
            TestName::RcRdmaWriteLat if events => SendOpcode::RdmaWriteWithImm,
            TestName::RcRdmaWriteLat | TestName::RcRdmaWriteBw => SendOpcode::RdmaWrite,
            TestName::RcRdmaReadBw | TestName::RcRdmaReadLat => SendOpcode::RdmaRead,
            _ => SendOpcode::Send,
        };
        Ok(Rdma {
            ctx: ctx.clone(),
            pd,
            cq,
            _channel: channel,
            qps: list,
            index,
            mr,
            ahs: Vec::new(),
            peers: Vec::new(),
            size,
            slot,
            events,
            ud,
            op,
        })
    }

    pub fn info(&self) -> Result<Vec<QpInfo>> {
        let base = self.mr.addr();
        (0..self.qps.len())
            .map(|q| {
                Ok(QpInfo {
                    endpoint: self.qps[q].endpoint(&self.ctx)?,
                    recv_addr: base + self.recv_off(q) as u64,
                    src_addr: base + self.src_off(q) as u64,
                    rkey: self.mr.rkey(),
                })
            })
            .collect()
    }

    /// Connects QP `i` to the peer's QP `i` (RC), or makes address handles
    /// for them (UD), and posts the receives the test needs.
    pub fn connect(&mut self, peers: &[QpInfo]) -> Result<()> {
        if peers.len() != self.qps.len() {
            bail!("the peer sent {} QPs for {}", peers.len(), self.qps.len());
        }
        let access = AccessFlags::LOCAL_WRITE
            | AccessFlags::REMOTE_WRITE
            | AccessFlags::REMOTE_READ
            | AccessFlags::REMOTE_ATOMIC;
        for (qp, peer) in self.qps.iter().zip(peers) {
            if self.ud {
                let attr = AhAttr {
                    dgid: peer.endpoint.gid,
                    dlid: peer.endpoint.lid,
                    is_global: true,
                    hop_limit: 64,
                    port_num: 1,
                    ..AhAttr::default()
                };
                self.ahs.push(self.pd.create_ah(&attr).context("an address handle for the peer")?);
            } else {
                qp.connect(&peer.endpoint, access).context("connecting to the peer's QP")?;
            }
        }
        self.peers = peers.to_vec();
        for q in 0..self.qps.len() {
            for _ in 0..RQ {
                self.post_recv(q)?;
            }
        }
        Ok(())
    }

    pub fn events(&self) -> bool {
        self.events
    }

    pub fn size(&self) -> usize {
        self.size
    }

    pub fn qps(&self) -> usize {
        self.qps.len()
    }

    /// Bytes of payload in a receive completion (a UD one counts its GRH).
    pub fn payload(&self, wc: &WorkCompletion) -> u64 {
        let grh = if self.ud { GRH_LEN as u32 } else { 0 };
        u64::from(wc.byte_len.saturating_sub(grh))
    }

    fn recv_off(&self, q: usize) -> usize {
        2 * q * self.slot
    }

    fn src_off(&self, q: usize) -> usize {
        (2 * q + 1) * self.slot
    }

    /// Which of our QPs a completion belongs to.
    pub fn qp_of(&self, wc: &WorkCompletion) -> Result<usize> {
        self.index
            .get(&wc.qp_num)
            .copied()
            .ok_or_else(|| anyhow!("a completion for unknown QP {}", wc.qp_num))
    }

    pub fn post_recv(&self, q: usize) -> Result<()> {
        let len = if self.ud { self.size + GRH_LEN } else { self.size };
        let wr = RecvWr { wr_id: q as u64, sg: SgeList::from_slice(&[self.mr.sge(self.recv_off(q), len)?])? };
        self.qps[q].post_recv(&[wr]).map_err(|e| anyhow!("post_recv: {e}"))
    }

    /// Posts one data message of the test on QP `q`, signaled.
    pub fn post(&self, q: usize, wr_id: u64) -> Result<()> {
        let peer = self.peers.get(q).ok_or_else(|| anyhow!("QP {q} is not connected"))?;
        let mut wr = SendWr::new(wr_id, self.op);
        wr.flags |= SendFlags::SIGNALED;
        if self.op == SendOpcode::RdmaRead {
            wr.sg = SgeList::from_slice(&[self.mr.sge(self.recv_off(q), self.size)?])?;
            wr.remote_addr = peer.src_addr;
        } else {
            if self.size <= INLINE {
                wr.flags |= SendFlags::INLINE;
                wr.inline_len = self.size as u16;
                self.mr.read(self.src_off(q), &mut wr.inline[..self.size])?;
            } else {
                wr.sg = SgeList::from_slice(&[self.mr.sge(self.src_off(q), self.size)?])?;
            }
            wr.remote_addr = peer.recv_addr;
        }
        wr.rkey = peer.rkey;
        if let Some(ah) = self.ahs.get(q) {
            wr.ud = UdDest { remote_qpn: peer.endpoint.qpn, remote_qkey: QKEY, ah: ah.handle() };
        }
        self.qps[q].post_send(&[wr]).map_err(|e| anyhow!("post_send: {e}"))
    }

    /// Posts one atomic on QP `q` on the peer's receive slot, its result
    /// landing in our receive slot.
    pub fn post_atomic(&self, q: usize, wr_id: u64, test: TestName, expect: u64) -> Result<()> {
        let peer = self.peers.get(q).ok_or_else(|| anyhow!("QP {q} is not connected"))?;
        let result = self.mr.sge(self.recv_off(q), 8)?;
        let wr = match test {
            TestName::RcCompareSwapMr => {
                vrdma::wr::cmp_swap(wr_id, result, peer.recv_addr, peer.rkey, expect, expect + 1)
            }
            _ => vrdma::wr::fetch_add(wr_id, result, peer.recv_addr, peer.rkey, 1),
        };
        let wr = vrdma::SendWrExt::signaled(wr);
        self.qps[q].post_send(&[wr]).map_err(|e| anyhow!("post_send: {e}"))
    }

    /// The value an atomic on QP `q` returned.
    pub fn atomic_result(&self, q: usize) -> Result<u64> {
        Ok(self.mr.read_u64(self.recv_off(q))?)
    }

    /// The last byte of QP `q`'s receive slot, where write ping-pongs tag.
    pub fn received_tag(&self, q: usize) -> Result<u8> {
        let mut b = [0u8];
        self.mr.read(self.recv_off(q) + self.size - 1, &mut b)?;
        Ok(b[0])
    }

    /// Sets the tag the next write from QP `q` carries.
    pub fn set_tag(&self, q: usize, tag: u8) -> Result<()> {
        Ok(self.mr.write(self.src_off(q) + self.size - 1, &[tag])?)
    }

    /// Takes completions: polls once, or under `--events` waits on the
    /// channel for up to a short slice. Any failed completion is an error.
    pub fn poll(&self, wcs: &mut [WorkCompletion]) -> Result<usize> {
        let n = if self.events { self.cq.wait(wcs, Some(EVENT_SLICE))? } else { self.cq.poll(wcs)? };
        for wc in &wcs[..n] {
            if wc.status != WcStatus::Success {
                bail!("a work request failed on QP {}: {}", wc.qp_num, wc.status.as_str());
            }
        }
        Ok(n)
    }
}

/// Whether a completion is an incoming message (a receive).
pub fn is_recv(wc: &WorkCompletion) -> bool {
    wc.opcode == WcOpcode::Recv || wc.opcode == WcOpcode::RecvRdmaWithImm
}
