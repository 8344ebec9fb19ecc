//! The sending side of `vrdma cp`: an rdma_cm client whose connect
//! carries the offer and whose accept brings the window.

use std::fs::File;
use std::io::Read;
use std::net::{SocketAddrV4, ToSocketAddrs};
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use sha2::{Digest, Sha256};
use vrdma::cm::{CmId, ConnParam, EventChannel, EventKind, PortSpace};
use vrdma::wr::{self, SendWrExt};
use vrdma::AccessFlags;

use crate::embedded::Opener;

use super::protocol::{hex, reason, Accept, Done, Offer, Verdict, CONTROL_LEN};

/// The receiver's address: HOST or HOST:PORT (IPv4: rdma_cm's addresses
/// here are).
fn resolve(dest: &str) -> Result<SocketAddrV4> {
    let with_port = if dest.rsplit_once(':').is_some_and(|(_, p)| p.parse::<u16>().is_ok()) {
        dest.to_string()
    } else {
        format!("{dest}:{}", super::DEFAULT_PORT)
    };
    with_port
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve {dest:?}"))?
        .find_map(|a| match a {
            std::net::SocketAddr::V4(v4) => Some(v4),
            std::net::SocketAddr::V6(_) => None,
        })
        .with_context(|| format!("{dest:?} has no IPv4 address"))
}

pub fn run(device: &Opener, src: &Path, dest: &str, segment: u64, slots: u32, show: bool) -> Result<()> {
    let mut file = File::open(src).with_context(|| format!("cannot open {}", src.display()))?;
    let size = file.metadata()?.len();
    let addr = resolve(dest)?;

    let ctx = device.open()?;
    let ch = EventChannel::create(&ctx)?;
    let id = CmId::create(&ch, PortSpace::Tcp)?;
    id.resolve_addr(None, addr)?;
    super::expect(&ch, EventKind::AddrResolved, "the receiver's address")?;
    id.resolve_route()?;
    super::expect(&ch, EventKind::RouteResolved, "the route to the receiver")?;

    let pd = ctx.alloc_pd()?;
    let buf = pd.alloc_mr((segment * u64::from(slots)) as usize, AccessFlags::LOCAL_WRITE)?;
    // The first half takes the verdict, the second holds the checksum as
    // it goes out.
    let control = pd.alloc_mr(2 * CONTROL_LEN, AccessFlags::LOCAL_WRITE)?;
    let channel = ctx.create_comp_channel()?;
    let cq = ctx.create_cq(2 * slots + 8, Some(&channel))?;
    let cap = vrdma::QpCap {
        max_send_wr: slots,
        max_recv_wr: slots + 1,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let qp = pd.create_rc_qp(&cq, &cq, cap)?;
    id.attach_qp(&qp)?;
    // One receive per credit the receiver may return, and one for its
    // verdict; all point at the verdict's buffer, which only it fills.
    for i in 0..=slots {
        qp.post_recv(&[wr::recv(u64::from(i), &[control.sge(0, CONTROL_LEN)?])?])?;
    }
    let offer = Offer { size, segment, slots };
    id.connect(&ConnParam { private_data: offer.encode(), ..ConnParam::default() })?;
    let ev = super::event(&ch, "the receiver's answer")?;
    let acc = match ev.kind {
        EventKind::Established => {
            Accept::decode(ev.peer.as_ref().map(|p| p.private_data.as_slice()).unwrap_or(&[]))?
        }
        EventKind::Rejected => {
            let why = ev.peer.as_ref().and_then(|p| reason(&p.private_data));
            match why {
                Some(why) => bail!("the receiver on {addr} refused: {why}"),
                None => bail!("no `vrdma cp --recv` listens on {addr} (rejected, reason {})", ev.status),
            }
        }
        EventKind::Unreachable => bail!("no `vrdma cp --recv` answers on {addr} (status {})", ev.status),
        EventKind::ConnectError => {
            bail!("the connection to {addr} failed while it was set up (status {})", ev.status)
        }
        other => bail!("unexpected rdma_cm event {other:?} while connecting to {addr}"),
    };

    let bar = super::progress(size, show, "sending");
    let start = Instant::now();
    let segments = size.div_ceil(segment);
    let mut hasher = Sha256::new();
    let mut t = Tally { credits: slots, in_flight: 0, verdict: None };
    let mut wcs = vrdma::wc_buffer(64);
    let mut chunk = vec![0u8; segment as usize];
    for seq in 0..segments {
        while t.credits == 0 || t.in_flight == slots {
            let n = super::poll_some(&cq, &mut wcs, &ch)?;
            t.take(&wcs[..n], &qp, &control)?;
        }
        let len = segment.min(size - seq * segment) as usize;
        file.read_exact(&mut chunk[..len]).with_context(|| format!("reading {}", src.display()))?;
        hasher.update(&chunk[..len]);
        let slot = seq % u64::from(slots);
        let off = (slot * segment) as usize;
        buf.write(off, &chunk[..len])?;
        let w = wr::rdma_write(seq, &[buf.sge(off, len)?], acc.addr + off as u64, acc.rkey)?
            .with_imm(seq as u32)
            .signaled();
        qp.post_send(&[w]).map_err(|e| anyhow::anyhow!("posting segment {seq}: {e}"))?;
        t.credits -= 1;
        t.in_flight += 1;
        bar.inc(len as u64);
    }
    while t.in_flight > 0 {
        let n = super::poll_some(&cq, &mut wcs, &ch)?;
        t.take(&wcs[..n], &qp, &control)?;
    }
    let secs = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let sha256: [u8; 32] = hasher.finalize().into();
    let done = Done { sha256 }.encode();
    control.write(CONTROL_LEN, &done)?;
    qp.post_send(&[wr::send(u64::MAX, &[control.sge(CONTROL_LEN, done.len())?])?.signaled()])
        .map_err(|e| anyhow::anyhow!("sending the checksum: {e}"))?;
    t.in_flight += 1;
    while t.in_flight > 0 || t.verdict.is_none() {
        let n = super::poll_some(&cq, &mut wcs, &ch)?;
        t.take(&wcs[..n], &qp, &control)?;
    }
    let v = t.verdict.expect("the loop ends with the verdict");
    id.disconnect()?;
    super::expect(&ch, EventKind::Disconnected, "the end of the connection")?;
    if !v.ok || v.sha256 != sha256 {
        bail!("integrity check failed: sent sha256 {}, the receiver wrote {}", hex(&sha256), hex(&v.sha256));
    }
    println!(
        "sent {} bytes in {:.3} s: {:.3} GB/s ({} segments of {} bytes, window {} slots); sha256 {} verified by the receiver",
        size,
        secs,
        size as f64 / secs.max(1e-9) / 1e9,
        segments,
        segment,
        slots,
        hex(&sha256)
    );
    Ok(())
}

/// The sender's view of the connection: credits the receiver has given,
/// writes not yet complete, and the receiver's verdict once it comes.
struct Tally {
    credits: u32,
    in_flight: u32,
    verdict: Option<Verdict>,
}

impl Tally {
    fn take(
        &mut self,
        wcs: &[vrdma::WorkCompletion],
        qp: &vrdma::QueuePair,
        control: &vrdma::MemoryRegion,
    ) -> Result<()> {
        for wc in wcs {
            match wc.opcode {
                // A credit is empty; the verdict is not.
                vrdma::WcOpcode::Recv if wc.byte_len == 0 => {
                    self.credits += 1;
                    qp.post_recv(&[wr::recv(wc.wr_id, &[control.sge(0, CONTROL_LEN)?])?])?;
                }
                vrdma::WcOpcode::Recv => {
                    let mut b = vec![0u8; (wc.byte_len as usize).min(CONTROL_LEN)];
                    control.read(0, &mut b)?;
                    self.verdict = Some(Verdict::decode(&b)?);
                }
                _ => self.in_flight = self.in_flight.saturating_sub(1),
            }
        }
        Ok(())
    }
}
