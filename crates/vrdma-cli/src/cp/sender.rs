//! The sending side of `vrdma cp`.

use std::fs::File;
use std::io::Read;
use std::net::{TcpStream, ToSocketAddrs};
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use sha2::{Digest, Sha256};
use vrdma::wr::{self, SendWrExt};
use vrdma::AccessFlags;

use super::protocol::{endpoint, hex, Accept, Control, Done, Offer, Verdict, VERSION};

/// The receiver's address: HOST or HOST:PORT.
fn resolve(dest: &str) -> Result<std::net::SocketAddr> {
    let with_port = if dest.parse::<std::net::SocketAddr>().is_ok()
        || dest.rsplit_once(':').is_some_and(|(_, p)| p.parse::<u16>().is_ok()) && !dest.contains("::")
    {
        dest.to_string()
    } else {
        format!("{dest}:{}", super::DEFAULT_PORT)
    };
    with_port
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve {dest:?}"))?
        .next()
        .with_context(|| format!("{dest:?} has no address"))
}

pub fn run(socket: &Path, src: &Path, dest: &str, segment: u64, slots: u32, show: bool) -> Result<()> {
    let mut file = File::open(src).with_context(|| format!("cannot open {}", src.display()))?;
    let size = file.metadata()?.len();
    let addr = resolve(dest)?;
    let tcp = TcpStream::connect_timeout(&addr, super::PEER_TIMEOUT)
        .with_context(|| format!("no `vrdma cp --recv` answers on {addr}"))?;
    let mut ctl = Control::new(tcp)?;

    let ctx = vrdma::Context::open_at(socket)?;
    let pd = ctx.alloc_pd()?;
    let buf = pd.alloc_mr((segment * u64::from(slots)) as usize, AccessFlags::LOCAL_WRITE)?;
    let channel = ctx.create_comp_channel()?;
    let depth = 2 * slots + 8;
    let cq = ctx.create_cq(depth, Some(&channel))?;
    let cap = vrdma::QpCap {
        max_send_wr: slots,
        max_recv_wr: slots,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let qp = pd.create_rc_qp(&cq, &cq, cap)?;
    qp.to_init(vrdma::defaults::PORT, AccessFlags::empty())?;
    // One receive per credit the receiver may return.
    for i in 0..slots {
        qp.post_recv(&[wr::recv(u64::from(i), &[])?])?;
    }
    ctl.send(&Offer {
        version: VERSION,
        size,
        segment,
        slots,
        endpoint: hex(&qp.endpoint(&ctx)?.to_bytes()),
    })?;
    let acc: Accept = ctl.recv("window")?;
    qp.connect(&endpoint(&acc.endpoint)?, AccessFlags::empty())?;

    let bar = super::progress(size, show, "sending");
    let start = Instant::now();
    let segments = size.div_ceil(segment);
    let mut hasher = Sha256::new();
    let mut credits = slots;
    let mut in_flight = 0u32;
    let mut wcs = vrdma::wc_buffer(64);
    let mut chunk = vec![0u8; segment as usize];
    for seq in 0..segments {
        while credits == 0 || in_flight == slots {
            let n = super::poll_some(&cq, &mut wcs)?;
            for wc in &wcs[..n] {
                if wc.opcode == vrdma::WcOpcode::Recv {
                    credits += 1;
                    qp.post_recv(&[wr::recv(wc.wr_id, &[])?])?;
                } else {
                    in_flight -= 1;
                }
            }
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
        credits -= 1;
        in_flight += 1;
        bar.inc(len as u64);
    }
    while in_flight > 0 {
        let n = super::poll_some(&cq, &mut wcs)?;
        in_flight -= wcs[..n].iter().filter(|w| w.opcode != vrdma::WcOpcode::Recv).count() as u32;
    }
    let secs = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let sha = hex(&hasher.finalize());
    ctl.send(&Done { sha256: sha.clone() })?;
    let v: Verdict = ctl.recv("verdict")?;
    if !v.ok || v.sha256 != sha {
        bail!("integrity check failed: sent sha256 {sha}, the receiver wrote {}", v.sha256);
    }
    println!(
        "sent {} bytes in {:.3} s: {:.3} GB/s ({} segments of {} bytes, window {} slots); sha256 {sha} verified by the receiver",
        size,
        secs,
        size as f64 / secs.max(1e-9) / 1e9,
        segments,
        segment,
        slots
    );
    Ok(())
}
