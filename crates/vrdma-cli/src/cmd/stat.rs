//! `vrdma stat`: the links to other hosts' daemons, and the path each QP
//! of the caller's tenant takes (shared memory on this host, or a link).

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use vrdma::Context;
use vrdma_core::hca::{Path, StatReport};

#[derive(clap::Args)]
pub struct Args {
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(socket: Option<PathBuf>, args: Args) -> Result<()> {
    let path = socket.unwrap_or_else(vrdmad::default_socket_path);
    let ctx = Context::open_at(&path).with_context(|| {
        format!("no vRDMA daemon answers on {}; start one with `vrdma daemon`", path.display())
    })?;
    let s = ctx.stat()?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        print!("{}", render(&s));
    }
    Ok(())
}

/// The text form, also used by `vrdma devinfo`.
pub fn render_links(s: &StatReport) -> String {
    let mut out = String::new();
    if s.links.is_empty() {
        out.push_str("links:\t\tnone (same-host transfers only; see [net] in the daemon config)\n");
    }
    for l in &s.links {
        out.push_str(&format!(
            "link {}:\t\tpeer gid {} lid {} chunk {} {}, {} QPs, out {} frames / {} B, in {} frames / {} B, dropped {}\n",
            l.id.0,
            l.info.gid,
            l.info.lid,
            l.info.chunk,
            if l.up { "UP" } else { "DOWN" },
            l.qps,
            l.stats.frames_out,
            l.stats.payload_out,
            l.stats.frames_in,
            l.stats.payload_in,
            l.stats.dropped_in
        ));
    }
    out
}

fn render(s: &StatReport) -> String {
    let mut out = render_links(s);
    if s.qps.is_empty() {
        out.push_str("qps:\t\tnone of this tenant\n");
    }
    for q in &s.qps {
        let path = match q.path {
            Path::None => "not connected".to_string(),
            Path::SharedMemory => "shared memory (same host)".to_string(),
            Path::Link(Some(l)) => format!("tcp link {}", l.0),
            Path::Link(None) => "tcp (no link yet)".to_string(),
        };
        out.push_str(&format!(
            "qp {:#08x}:\t{:?} {:?} -> qpn {:#08x}, {}\n",
            q.qpn, q.qp_type, q.state, q.dest_qpn, path
        ));
    }
    if s.missed_wakeups > 0 {
        out.push_str(&format!(
            "missed wake-ups:	{} (QPs found with work by the engine's sweep, not named after a post)
",
            s.missed_wakeups
        ));
    }
    out
}
