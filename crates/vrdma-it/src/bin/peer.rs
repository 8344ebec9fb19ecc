//! The integration tests' other processes: a daemon, or a scriptable
//! tenant driven by JSON lines on stdin (see `vrdma_it::PeerProc`).

use std::io::BufRead;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use vrdma_it::protocol::{Command, Hello, Said, Wc};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let flag =
        |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map(PathBuf::from);
    let socket = flag("--socket").context("--socket is required")?;
    match args.get(1).map(String::as_str) {
        Some("daemon") => daemon(socket, flag("--config")),
        Some("tenant") => tenant(socket),
        _ => bail!("usage: vrdma-it-peer daemon|tenant --socket PATH [--config FILE]"),
    }
}

fn daemon(socket: PathBuf, config: Option<PathBuf>) -> Result<()> {
    tracing_subscriber::fmt().with_env_filter("warn").with_writer(std::io::stderr).init();
    let mut cfg = match config {
        Some(p) => vrdmad::DaemonConfig::load(&p)?,
        None => vrdmad::DaemonConfig::default(),
    };
    cfg.socket = Some(socket);
    let _daemon = vrdmad::Daemon::start(cfg)?;
    // Until the test kills us by pid.
    loop {
        std::thread::park();
    }
}

fn tenant(socket: PathBuf) -> Result<()> {
    let ctx = vrdma::Context::open_at(&socket)?;
    let pd = ctx.alloc_pd()?;
    let access = vrdma::AccessFlags::LOCAL_WRITE
        | vrdma::AccessFlags::REMOTE_WRITE
        | vrdma::AccessFlags::REMOTE_READ
        | vrdma::AccessFlags::REMOTE_ATOMIC;
    let mr = pd.alloc_mr(4 << 20, access)?;
    let cq = ctx.create_cq(1024, None)?;
    let cap = vrdma::QpCap {
        max_send_wr: 256,
        max_recv_wr: 256,
        max_send_sge: 4,
        max_recv_sge: 4,
        max_inline_data: 64,
    };
    let qp = pd.create_rc_qp(&cq, &cq, cap)?;
    let say = |s: &Said| println!("{}", serde_json::to_string(s).expect("serializable"));
    say(&Said::Hello(Hello {
        endpoint: qp.endpoint(&ctx)?,
        addr: mr.addr(),
        rkey: mr.rkey(),
        pid: std::process::id(),
    }));
    let mut wcs = vrdma::wc_buffer(64);
    for line in std::io::stdin().lock().lines() {
        let cmd: Command = serde_json::from_str(&line?)?;
        let reply = match cmd {
            Command::Connect { peer } => qp.connect(&peer, access).map(|_| Said::Ok),
            Command::PostRecv { count, offset, len } => (|| {
                for i in 0..count {
                    let wr = vrdma::wr::recv(i as u64, &[mr.sge(offset, len)?])?;
                    qp.post_recv(&[wr]).map_err(|e| e.error)?;
                }
                Ok(Said::Ok)
            })(),
            Command::Fill { offset, data } => mr.write(offset, &data).map(|_| Said::Ok),
            Command::Read { offset, len } => {
                let mut b = vec![0u8; len];
                mr.read(offset, &mut b).map(|_| Said::Bytes(b))
            }
            Command::Send { wr_id, offset, len, imm } => (|| {
                let mut wr = vrdma::wr::send(wr_id, &[mr.sge(offset, len)?])?;
                if let Some(imm) = imm {
                    wr.opcode = vrdma::SendOpcode::SendWithImm;
                    wr.imm_data = imm;
                }
                wr.flags |= vrdma::SendFlags::SIGNALED;
                qp.post_send(&[wr]).map_err(|e| e.error)?;
                Ok(Said::Ok)
            })(),
            Command::Flood { remote_addr, rkey, len, count } => (|| {
                // Keep large writes in flight until `count` complete; the
                // test may kill us at any moment in between.
                let (mut posted, mut done) = (0u64, 0u64);
                let end = Instant::now() + Duration::from_secs(60);
                while done < count && Instant::now() < end {
                    while posted < count && posted - done < 32 {
                        let mut wr = vrdma::wr::rdma_write(posted, &[mr.sge(0, len)?], remote_addr, rkey)?;
                        wr.flags |= vrdma::SendFlags::SIGNALED;
                        qp.post_send(&[wr]).map_err(|e| e.error)?;
                        posted += 1;
                        if posted == 8 {
                            say(&Said::Flooding);
                        }
                    }
                    done += cq.poll(&mut wcs)? as u64;
                }
                Ok(Said::Ok)
            })(),
            Command::Poll { count, timeout_ms } => (|| {
                let mut got: Vec<Wc> = Vec::new();
                let end = Instant::now() + Duration::from_millis(timeout_ms);
                while got.len() < count && Instant::now() < end {
                    let n = cq.poll(&mut wcs)?;
                    got.extend(wcs[..n].iter().map(Wc::from));
                }
                Ok(Said::Completions(got))
            })(),
            Command::State => Ok(Said::State(qp.state().raw())),
            Command::Exit => break,
        };
        match reply {
            Ok(s) => say(&s),
            Err(e) => say(&Said::Error { errno: e.errno(), message: e.to_string() }),
        }
    }
    Ok(())
}
