//! The bandwidth half of `vrdma bench --direct` (issue 17, item 6): RDMA
//! write and send streams of 64 KiB and 1 MiB on a private daemon with the
//! direct path on and one with it off, each beside memcpy of the same size
//! and, when `ucx_perftest` is installed, UCX's posix transport of the same
//! size (`ucp_put_bw` for writes, `tag_bw` for sends), all measured in this
//! run, each figure the median of `runs` runs.
//!
//! Each row names the path it measured and proves it (`path::check`): the
//! direct path carries RDMA writes of up to `vrdma::DIRECT_MAX_RDMA_BYTES`
//! (1 MiB) and SENDs of up to `vrdma::DIRECT_MAX_BYTES` (64 KiB), so a
//! 1 MiB send stream on the daemon with the switch on is the engine's, and
//! its row says so rather than borrowing the direct path's name.

use std::time::Duration;

use anyhow::Result;

use super::path::{self, Path};
use super::suite::{measure, Figure, Outcome};
use super::{anchors, worker, Args};

/// The sizes issue 17 asks for.
const SIZES: [usize; 2] = [64 << 10, 1 << 20];

/// The floors: 1 MiB write at least 0.8x memcpy, 64 KiB send at
/// least 0.7x; the other rows are printed against 0.7x.
fn target(test: worker::Test, size: usize) -> &'static str {
    match (test, size) {
        (worker::Test::WriteBw, s) if s >= 1 << 20 => ">= 0.80x memcpy",
        _ => ">= 0.70x memcpy",
    }
}

fn human(size: usize) -> String {
    if size >= 1 << 20 {
        format!("{} MiB", size >> 20)
    } else {
        format!("{} KiB", size >> 10)
    }
}

/// A bandwidth figure in GB/s (1e9 B/s), the median of the runs.
fn figure(
    name: &str,
    runs: &[Outcome],
    anchor_name: &str,
    anchor: anchors::Stat,
    target: &str,
    cores: usize,
) -> Figure {
    Figure::beside(name, "GB/s", super::suite::gb_per_s(runs), anchor_name, anchor, target, cores)
}

pub fn figures(args: &Args, runs: usize, cores: usize, progress: &dyn Fn(&str)) -> Result<Vec<Figure>> {
    let bytes_per_run: u64 = if args.quick { 256 << 20 } else { 1 << 30 };
    let anchor_time = Duration::from_millis(if args.quick { 300 } else { 1000 });
    let tests =
        [(worker::Test::WriteBw, "RDMA write", "ucp_put_bw"), (worker::Test::SendBw, "send", "tag_bw")];
    let mut memcpy = Vec::new();
    let mut ucx = Vec::new();
    for size in SIZES {
        progress(&format!("memcpy {} bandwidth anchor", human(size)));
        memcpy.push(anchors::memcpy_bandwidth(size, anchor_time, runs));
        for (_, _, ucx_test) in tests {
            if !super::ucx::available() {
                continue;
            }
            progress(&format!("UCX posix {ucx_test} {} (ucx_perftest, UCX_TLS=posix,self)", human(size)));
            let iters = (bytes_per_run / size as u64).max(16);
            match super::ucx::posix_bw_gbs(ucx_test, size, iters, runs) {
                Ok(s) => ucx.push(((ucx_test, size), s)),
                Err(e) => eprintln!("UCX posix {ucx_test} {} not measured: {e:#}", human(size)),
            }
        }
    }
    if !super::ucx::available() && !args.json {
        eprintln!("ucx_perftest not installed (ucx-utils): no UCX posix bandwidth anchor");
    }
    let mut out = Vec::new();
    for (direct, switch) in [(true, "direct path on"), (false, "direct path off")] {
        let dev = crate::embedded::private_device(super::engine_config(args), direct)?;
        for (test, what, ucx_test) in tests {
            for (i, size) in SIZES.into_iter().enumerate() {
                // The daemon with the switch off must have measured the
                // engine; on it, a write stream of up to the direct limit
                // must have been carried, and a larger one must not; a send
                // stream's path depends on the receiver keeping up (see
                // `path::measured`), so its row names what it measured.
                let limit = match test {
                    worker::Test::WriteBw => vrdma::DIRECT_MAX_RDMA_BYTES,
                    _ => vrdma::DIRECT_MAX_BYTES,
                };
                let within = size as u64 <= limit;
                let claim = match (direct, test, within) {
                    (false, _, _) | (true, _, false) => Some(Path::Engine),
                    (true, worker::Test::WriteBw, true) => Some(Path::Direct),
                    (true, _, true) => None,
                };
                let above = if direct && !within {
                    format!(" (above the direct path's {})", human(limit as usize))
                } else {
                    String::new()
                };
                let what = format!("{what} {} bandwidth, {switch}", human(size));
                progress(&what);
                let iters = (bytes_per_run / size as u64).max(16);
                let bw = measure(dev.socket(), test, size, iters, runs)?;
                let measured = match claim {
                    Some(p) => {
                        path::check(&what, &bw, p)?;
                        p.as_str().to_string()
                    }
                    None => path::measured(&bw),
                };
                let name = format!("{what}: {measured}{above}");
                let t = target(test, size);
                out.push(figure(&name, &bw, "memcpy, 1 thread, same size", memcpy[i], t, cores));
                if let Some((_, u)) = ucx.iter().find(|(k, _)| *k == (ucx_test, size)) {
                    let anchor =
                        format!("UCX posix {ucx_test} {} (ucx_perftest, UCX_TLS=posix,self)", human(size));
                    out.push(figure(&name, &bw, &anchor, *u, "none (reference)", cores));
                }
            }
        }
    }
    Ok(out)
}
