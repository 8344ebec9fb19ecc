//! The receiving side of `vrdma cp`.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use sha2::{Digest, Sha256};
use vrdma::wr::{self, SendWrExt};
use vrdma::AccessFlags;

use super::protocol::{endpoint, hex, Accept, Control, Done, Offer, Verdict, VERSION};

/// The largest window a sender may ask for.
const MAX_WINDOW: u64 = 1 << 30;

pub fn run(socket: &Path, out: &Path, listen: SocketAddr, show: bool) -> Result<()> {
    let listener = TcpListener::bind(listen).with_context(|| format!("cannot listen on {listen}"))?;
    eprintln!("waiting for a sender on {}", listener.local_addr()?);
    let (tcp, peer) = listener.accept()?;
    let mut ctl = Control::new(tcp)?;
    let offer: Offer = ctl.recv("offer")?;
    if offer.version != VERSION {
        bail!("the sender speaks version {}, this receiver {VERSION}", offer.version);
    }
    let window = offer.segment.saturating_mul(u64::from(offer.slots));
    if offer.slots == 0 || offer.segment == 0 || offer.segment > 16 << 20 || window > MAX_WINDOW {
        bail!("the sender asks for an unreasonable window: {} slots of {} bytes", offer.slots, offer.segment);
    }
    let mut file = File::create(out).with_context(|| format!("cannot create {}", out.display()))?;

    let ctx = vrdma::Context::open_at(socket)?;
    let pd = ctx.alloc_pd()?;
    let win = pd.alloc_mr(window as usize, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    let channel = ctx.create_comp_channel()?;
    let cq = ctx.create_cq(2 * offer.slots + 8, Some(&channel))?;
    // The credits' completions have their own CQ, which post_credit polls
    // when the send queue is full: a send slot is free only once the
    // completion covering it is polled.
    let credit_cq = ctx.create_cq(offer.slots, None)?;
    let cap = vrdma::QpCap {
        max_send_wr: offer.slots,
        max_recv_wr: offer.slots,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let qp = pd.create_rc_qp(&credit_cq, &cq, cap)?;
    // Signaled often enough that the unsignaled credits between two
    // signaled ones never fill the send queue.
    let signal_every = (offer.slots / 2).clamp(1, 16);
    qp.to_init(vrdma::defaults::PORT, AccessFlags::REMOTE_WRITE)?;
    // One receive per slot: each write's immediate consumes one.
    for i in 0..offer.slots {
        qp.post_recv(&[wr::recv(u64::from(i), &[])?])?;
    }
    qp.connect(&endpoint(&offer.endpoint)?, AccessFlags::REMOTE_WRITE)?;
    ctl.send(&Accept { endpoint: hex(&qp.endpoint(&ctx)?.to_bytes()), addr: win.addr(), rkey: win.rkey() })?;

    let bar = super::progress(offer.size, show, "receiving");
    let start = Instant::now();
    let segments = offer.size.div_ceil(offer.segment);
    let mut next = 0u64;
    let mut wcs = vrdma::wc_buffer(64);
    let mut chunk = vec![0u8; offer.segment as usize];
    let mut credits_out = 0u32;
    while next < segments {
        let n = super::poll_some(&cq, &mut wcs)?;
        for wc in &wcs[..n] {
            match wc.opcode {
                vrdma::WcOpcode::RecvRdmaWithImm => {
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
                    qp.post_recv(&[wr::recv(wc.wr_id, &[])?])?;
                    // The slot is free again: one credit back.
                    let credit = wr::send(next, &[])?.with_imm(1);
                    let credit = if credits_out % signal_every == signal_every - 1 {
                        credit.signaled()
                    } else {
                        credit
                    };
                    post_credit(&qp, &credit_cq, credit)?;
                    credits_out += 1;
                }
                other => bail!("unexpected completion {other:?} from the sender"),
            }
        }
    }
    // The transfer's time; the flush to disk after it is the disk's.
    let secs = start.elapsed().as_secs_f64();
    file.sync_all()?;
    drop(file);
    bar.finish_and_clear();
    let done: Done = ctl.recv("checksum")?;
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
    let sha = hex(&hasher.finalize());
    let ok = sha == done.sha256;
    ctl.send(&Verdict { sha256: sha.clone(), ok })?;
    if !ok {
        bail!("integrity check failed: the sender read sha256 {}, the file written has {sha}", done.sha256);
    }
    println!(
        "received {} bytes from {peer} into {} in {:.3} s: {:.3} GB/s; sha256 {sha} matches the sender's",
        offer.size,
        out.display(),
        secs,
        offer.size as f64 / secs.max(1e-9) / 1e9
    );
    Ok(())
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
