//! The receiving side of `vrdma cp`: an rdma_cm listener that takes one
//! sender, refusing (with the reason, in the reject's private data) any
//! offer it will not serve and waiting on for the next.

use std::fs::File;
use std::io::{Read, Write};
use std::net::SocketAddrV4;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use sha2::{Digest, Sha256};
use vrdma::cm::{CmEvent, CmId, ConnParam, EventChannel, EventKind, PortSpace};
use vrdma::wr::{self, SendWrExt};
use vrdma::AccessFlags;

use crate::embedded::Opener;

use super::protocol::{hex, refusal, Accept, Done, Offer, Verdict, CONTROL_LEN};

/// The largest window a sender may ask for.
const MAX_WINDOW: u64 = 1 << 30;
/// The wr_id of the verdict's SEND (credits count from 1).
const VERDICT: u64 = 0;

pub fn run(device: &Opener, out: &Path, listen: SocketAddrV4, show: bool) -> Result<()> {
    let ctx = device.open()?;
    let ch = EventChannel::create(&ctx)?;
    let listener = CmId::create(&ch, PortSpace::Tcp)?;
    let at = listener.bind(listen).with_context(|| format!("cannot listen on {listen}"))?;
    listener.listen(4)?;
    eprintln!("waiting for a sender on {at}");
    let (req, offer) = loop {
        // A receiver waits for its sender as long as it takes, as a TCP
        // server's accept does; an offer it cannot serve is refused and
        // it waits on.
        let Some(ev) = ch.get_event(None)? else { continue };
        if ev.kind != EventKind::ConnectRequest {
            continue;
        }
        let from = ev.peer.as_ref().map(|p| p.private_data.as_slice()).unwrap_or(&[]);
        match Offer::decode(from).and_then(check) {
            Ok(offer) => break (ev, offer),
            Err(e) => {
                eprintln!("refused a sender: {e:#}");
                let id = CmId::from_request(&ch, &ev, PortSpace::Tcp)?;
                id.reject(&refusal(&format!("{e:#}")))?;
            }
        }
    };
    let id = CmId::from_request(&ch, &req, PortSpace::Tcp)?;
    let peer = id.peer_addr()?.map_or_else(|| "?".to_string(), |a| a.to_string());
    let mut file = File::create(out).with_context(|| format!("cannot create {}", out.display()))?;

    let pd = ctx.alloc_pd()?;
    let window = offer.segment * u64::from(offer.slots);
    let win = pd.alloc_mr(window as usize, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    // The first half takes the sender's checksum, the second holds the
    // verdict as it goes out.
    let control = pd.alloc_mr(2 * CONTROL_LEN, AccessFlags::LOCAL_WRITE)?;
    let channel = ctx.create_comp_channel()?;
    let cq = ctx.create_cq(2 * offer.slots + 8, Some(&channel))?;
    // The credits' completions have their own CQ, which post_credit polls
    // when the send queue is full: a send slot is free only once the
    // completion covering it is polled.
    let credit_cq = ctx.create_cq(offer.slots + 1, None)?;
    let cap = vrdma::QpCap {
        max_send_wr: offer.slots,
        max_recv_wr: offer.slots + 1,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let qp = pd.create_rc_qp(&credit_cq, &cq, cap)?;
    // Signaled often enough that the unsignaled credits between two
    // signaled ones never fill the send queue.
    let signal_every = (offer.slots / 2).clamp(1, 16);
    id.attach_qp(&qp)?;
    // One receive per slot (each write's immediate consumes one) and one
    // for the checksum; all point at the checksum's buffer, which only
    // the checksum fills.
    for i in 0..=offer.slots {
        qp.post_recv(&[wr::recv(u64::from(i), &[control.sge(0, CONTROL_LEN)?])?])?;
    }
    let accept = Accept { addr: win.addr(), rkey: win.rkey() };
    id.accept(&ConnParam { private_data: accept.encode(), ..ConnParam::default() })?;
    super::expect(&ch, EventKind::Established, "the sender's confirmation")?;

    let bar = super::progress(offer.size, show, "receiving");
    let start = Instant::now();
    let segments = offer.size.div_ceil(offer.segment);
    let mut next = 0u64;
    let mut wcs = vrdma::wc_buffer(64);
    let mut chunk = vec![0u8; offer.segment as usize];
    let mut credits_out = 0u32;
    let mut done = None;
    while done.is_none() {
        let n = super::poll_some(&cq, &mut wcs, &ch)?;
        for wc in &wcs[..n] {
            match wc.opcode {
                vrdma::WcOpcode::RecvRdmaWithImm if next < segments => {
                    // RC keeps the writes in order: the immediate must be
                    // the next segment's number.
                    if u64::from(wc.imm_data) != next & 0xffff_ffff {
                        bail!("segment {} arrived where {next} was due", wc.imm_data);
                    }
                    let len = offer.segment.min(offer.size - next * offer.segment) as usize;
                    if wc.byte_len as usize != len {
                        bail!("segment {next} has {} bytes, {len} expected", wc.byte_len);
                    }
                    let slot = next % u64::from(offer.slots);
                    win.read((slot * offer.segment) as usize, &mut chunk[..len])?;
                    file.write_all(&chunk[..len]).with_context(|| format!("writing {}", out.display()))?;
                    next += 1;
                    bar.inc(len as u64);
                    qp.post_recv(&[wr::recv(wc.wr_id, &[control.sge(0, CONTROL_LEN)?])?])?;
                    // The slot is free again: one credit back.
                    let credit = wr::send(u64::from(credits_out) + 1, &[])?.with_imm(1);
                    let credit = if credits_out % signal_every == signal_every - 1 {
                        credit.signaled()
                    } else {
                        credit
                    };
                    post_credit(&qp, &credit_cq, credit)?;
                    credits_out += 1;
                }
                vrdma::WcOpcode::Recv if next == segments => {
                    let mut b = vec![0u8; (wc.byte_len as usize).min(CONTROL_LEN)];
                    control.read(0, &mut b)?;
                    done = Some(Done::decode(&b)?);
                }
                other => bail!(
                    "unexpected completion {other:?} from the sender after {next} of {segments} segments"
                ),
            }
        }
    }
    // The transfer's time; the flush to disk after it is the disk's.
    let secs = start.elapsed().as_secs_f64();
    file.sync_all()?;
    drop(file);
    bar.finish_and_clear();
    let done = done.expect("the loop ends with the checksum");
    let sha256: [u8; 32] = {
        let mut hasher = Sha256::new();
        let mut f = File::open(out)?;
        let mut b = vec![0u8; 1 << 20];
        loop {
            let n = f.read(&mut b)?;
            if n == 0 {
                break;
            }
            hasher.update(&b[..n]);
        }
        hasher.finalize().into()
    };
    let ok = sha256 == done.sha256;
    let verdict = Verdict { sha256, ok }.encode();
    control.write(CONTROL_LEN, &verdict)?;
    let send = wr::send(VERDICT, &[control.sge(CONTROL_LEN, verdict.len())?])?.signaled();
    post_credit(&qp, &credit_cq, send)?;
    wait_sent(&credit_cq)?;
    // The sender hangs up once it has the verdict.
    let _: CmEvent = super::expect(&ch, EventKind::Disconnected, "the sender's disconnect")?;
    if !ok {
        bail!(
            "integrity check failed: the sender read sha256 {}, the file written has {}",
            hex(&done.sha256),
            hex(&sha256)
        );
    }
    println!(
        "received {} bytes from {peer} into {} in {:.3} s: {:.3} GB/s; sha256 {} matches the sender's",
        offer.size,
        out.display(),
        secs,
        offer.size as f64 / secs.max(1e-9) / 1e9,
        hex(&sha256)
    );
    Ok(())
}

/// An offer this receiver serves.
fn check(offer: Offer) -> Result<Offer> {
    let window = offer.segment.saturating_mul(u64::from(offer.slots));
    if offer.slots == 0 || offer.segment == 0 || offer.segment > 16 << 20 || window > MAX_WINDOW {
        bail!("an unreasonable window: {} slots of {} bytes", offer.slots, offer.segment);
    }
    Ok(offer)
}

/// Waits for the verdict's completion among the credits' (their CQ has
/// no channel: it is polled, for a bounded time).
fn wait_sent(credit_cq: &vrdma::CompletionQueue) -> Result<()> {
    let end = Instant::now() + super::PEER_TIMEOUT;
    let mut wcs = vrdma::wc_buffer(16);
    while Instant::now() < end {
        let n = credit_cq.poll(&mut wcs)?;
        if let Some(bad) = wcs[..n].iter().find(|w| w.status != vrdma::WcStatus::Success) {
            bail!("sending the verdict failed: {:?}", bad.status);
        }
        if wcs[..n].iter().any(|w| w.wr_id == VERDICT) {
            return Ok(());
        }
        if n == 0 {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }
    bail!("the verdict was not sent within {} s", super::PEER_TIMEOUT.as_secs())
}

/// Posts a credit. Credits already sent occupy the send queue until a
/// signaled one's completion is polled from `credit_cq` (the sender
/// acknowledges them a little later, with its next segment): a full queue
/// is waited out, polling, for a bounded time.
fn post_credit(
    qp: &vrdma::QueuePair,
    credit_cq: &vrdma::CompletionQueue,
    credit: vrdma::SendWr,
) -> Result<()> {
    let end = Instant::now() + super::PEER_TIMEOUT;
    let mut wcs = vrdma::wc_buffer(16);
    loop {
        match qp.post_send(std::slice::from_ref(&credit)) {
            Ok(()) => return Ok(()),
            Err(e) if e.errno() == libc::ENOMEM && Instant::now() < end => {
                let n = credit_cq.poll(&mut wcs)?;
                if let Some(bad) = wcs[..n].iter().find(|w| w.status != vrdma::WcStatus::Success) {
                    bail!("returning a credit failed: {:?}", bad.status);
                }
                if n == 0 {
                    std::thread::sleep(std::time::Duration::from_micros(50));
                }
            }
            Err(e) => bail!("returning a credit: {e}"),
        }
    }
}
