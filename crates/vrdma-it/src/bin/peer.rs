//! The integration tests' other processes: a daemon, or a scriptable
//! tenant driven by JSON lines on stdin (see `vrdma_it::PeerProc`).

use std::io::BufRead;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use vrdma_it::protocol::{Command, Hello, Misbehavior, Said, Wc};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let flag =
        |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map(PathBuf::from);
    let socket = flag("--socket").context("--socket is required")?;
    match args.get(1).map(String::as_str) {
        Some("daemon") => daemon(socket, flag("--config")),
        Some("tenant") => {
            let mr_len = match flag("--mr-len") {
                Some(n) => n.to_str().and_then(|s| s.parse().ok()).context("--mr-len takes a byte count")?,
                None => 4 << 20,
            };
            tenant(socket, mr_len, args.iter().any(|a| a == "--channel"))
        }
        Some("vm-attach") => {
            let name = flag("--vm").context("--vm NAME is required")?;
            let said = match vrdma::vm::attach_at(&socket, &name.to_string_lossy()) {
                Ok(_) => Said::Ok,
                Err(e) => Said::Error { errno: e.errno(), message: e.to_string() },
            };
            println!("{}", serde_json::to_string(&said)?);
            Ok(())
        }
        Some("migrate-pause") => {
            let tenant = flag("--tenant")
                .and_then(|n| n.to_str().and_then(|s| s.parse().ok()))
                .context("--tenant UID is required")?;
            let said = match vrdma::migrate::pause(&socket, tenant) {
                Ok(_) => Said::Ok,
                Err(e) => Said::Error { errno: e.errno(), message: e.to_string() },
            };
            println!("{}", serde_json::to_string(&said)?);
            Ok(())
        }
        _ => bail!(
            "usage: vrdma-it-peer daemon|tenant|vm-attach|migrate-pause --socket PATH [--config FILE] \
             [--mr-len BYTES] [--channel] [--vm NAME] [--tenant UID]"
        ),
    }
}

fn daemon(socket: PathBuf, config: Option<PathBuf>) -> Result<()> {
    let filter = std::env::var("VRDMA_LOG").unwrap_or_else(|_| "warn".into());
    // Colours only on a terminal (not in a log file, `VRDMA_IT_DAEMON_LOGS`).
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt().with_env_filter(filter).with_ansi(ansi).with_writer(std::io::stderr).init();
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

/// `channel`: the CQ gets a completion channel (`ArmCq`, `CqEvent`).
fn tenant(socket: PathBuf, mr_len: usize, channel: bool) -> Result<()> {
    // An emulated guest (VRDMA_GUEST_PORT set) opens its port instead.
    let opened = if vrdma::guest::GuestConfig::from_env().is_some() {
        vrdma::Context::open()
    } else {
        vrdma::Context::open_at(&socket)
    };
    let ctx = match opened {
        Ok(c) => c,
        Err(e) => {
            // Said, so that the test sees why (some tests expect a refusal).
            let said = Said::Error { errno: e.errno(), message: e.to_string() };
            println!("{}", serde_json::to_string(&said).expect("serializable"));
            return Err(e.into());
        }
    };
    let pd = ctx.alloc_pd()?;
    let access = vrdma::AccessFlags::LOCAL_WRITE
        | vrdma::AccessFlags::REMOTE_WRITE
        | vrdma::AccessFlags::REMOTE_READ
        | vrdma::AccessFlags::REMOTE_ATOMIC;
    let mr = pd.alloc_mr(mr_len, access)?;
    let ch = if channel { Some(ctx.create_comp_channel()?) } else { None };
    let cq = ctx.create_cq(1024, ch.as_ref())?;
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
        tenant: ctx.tenant(),
        mr_len,
    }));
    let mut hoard: Vec<Box<dyn std::any::Any>> = Vec::new();
    let mut idle: Vec<vrdma::QueuePair> = Vec::new();
    let mut wcs = vrdma::wc_buffer(64);
    // The emulated guest's "vCPU": `SeqStream` posts and polls holding it,
    // `Freeze` takes it until `Thaw`.
    let vcpu = std::sync::Mutex::new(());
    // `CmConnect`/`CmListen`'s channel and id.
    let mut cm: Option<(vrdma::cm::EventChannel, vrdma::cm::CmId)> = None;
    std::thread::scope(|scope| -> Result<()> {
        let mut frozen = None;
        let mut streaming = None;
        for line in std::io::stdin().lock().lines() {
            let cmd: Command = serde_json::from_str(&line?)?;
            let reply = match cmd {
                Command::Connect { peer } => qp.connect(&peer, access).map(|_| Said::Ok),
                Command::ConnectTimeout { peer, timeout } => (|| {
                    use vrdma::defaults as d;
                    qp.to_init(d::PORT, access)?;
                    qp.to_rtr(&peer, ctx.query_port(d::PORT)?.active_mtu, d::MIN_RNR_TIMER)?;
                    qp.to_rts(qp.psn(), timeout, d::RETRY_CNT, d::RNR_RETRY)
                })()
                .map(|_| Said::Ok),
                Command::Reset => {
                    let attr = vrdma::QpAttr { qp_state: vrdma::QpState::Reset, ..Default::default() };
                    qp.modify(&attr, vrdma::QpAttrMask::STATE).map(|_| Said::Ok)
                }
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
                Command::Digest { offset, len } => {
                    let mut b = vec![0u8; len];
                    mr.read(offset, &mut b).map(|_| Said::Digest(vrdma_it::protocol::digest(&b)))
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
                Command::Flood { remote_addr, rkey, len, count } => mr.sge(0, len).and_then(|sge| {
                    flood(&qp, &cq, &mut wcs, count, |i| vrdma::wr::rdma_write(i, &[sge], remote_addr, rkey))
                }),
                Command::FloodSend { len, count } => mr
                    .sge(0, len)
                    .and_then(|sge| flood(&qp, &cq, &mut wcs, count, |i| vrdma::wr::send(i, &[sge]))),
                Command::FloodSendSeq { len, count } => mr.sge(0, len).and_then(|sge| {
                    flood(&qp, &cq, &mut wcs, count, |i| {
                        let mut wr = vrdma::wr::send(i, &[sge])?;
                        wr.opcode = vrdma::SendOpcode::SendWithImm;
                        wr.imm_data = i as u32;
                        Ok(wr)
                    })
                }),
                Command::Carried => Ok(Said::Carried(qp.direct_stats().0)),
                Command::Poll { count, timeout_ms } => (|| {
                    let mut got: Vec<Wc> = Vec::new();
                    let end = Instant::now() + Duration::from_millis(timeout_ms);
                    while got.len() < count && Instant::now() < end {
                        let n = cq.poll(&mut wcs)?;
                        got.extend(wcs[..n].iter().map(Wc::from));
                    }
                    Ok(Said::Completions(got))
                })(),
                Command::PollThenRead { timeout_ms, offset, len } => (|| {
                    let end = Instant::now() + Duration::from_millis(timeout_ms);
                    while Instant::now() < end {
                        if let Some(wc) = cq.poll_one()? {
                            let mut b = vec![0u8; len];
                            mr.read(offset, &mut b)?;
                            return Ok(Said::CompletionThenBytes(Wc::from(&wc), b));
                        }
                    }
                    Ok(Said::Completions(Vec::new()))
                })(),
                Command::Hoard => Ok(hoard_objects(&ctx, &mut hoard)),
                Command::State => Ok(Said::State(qp.state().raw())),
                Command::Query => qp.query().map(|(attr, _)| Said::State(attr.qp_state.raw())),
                Command::AsyncEvent { timeout_ms } => ctx
                    .get_async_event(Some(Duration::from_millis(timeout_ms)))
                    .map(|e| Said::Event(e.map(|e| u32::from(e.event_type.raw())))),
                Command::IdleQps { count } => (|| {
                    for _ in 0..count {
                        let q = pd.create_rc_qp(
                            &cq,
                            &cq,
                            vrdma::QpCap { max_send_wr: 4, max_recv_wr: 4, ..cap },
                        )?;
                        q.connect(&q.endpoint(&ctx)?, access)?;
                        idle.push(q);
                    }
                    Ok(Said::Ok)
                })(),
                Command::Misbehave { how, millis } => {
                    let qpns: Vec<u32> = idle.iter().map(|q| q.qpn()).collect();
                    let ctx = ctx.clone();
                    std::thread::spawn(move || misbehave(&ctx, how, &qpns, Duration::from_millis(millis)));
                    Ok(Said::Ok)
                }
                Command::Stream { qps, len, millis } => {
                    stream(&ctx, None, qps, len, Duration::from_millis(millis), |s| say(s))
                }
                Command::StreamTo { qps, len, millis, to } => {
                    stream(&ctx, Some(&to), qps, len, Duration::from_millis(millis), |s| say(s))
                }
                Command::AttachAcrossContexts => (|| {
                    let other = if vrdma::guest::GuestConfig::from_env().is_some() {
                        vrdma::Context::open()?
                    } else {
                        vrdma::Context::open_at(&socket)?
                    };
                    let channel = vrdma::cm::EventChannel::create(&other)?;
                    let id = vrdma::cm::CmId::create(&channel, vrdma::cm::PortSpace::Tcp)?;
                    id.resolve_addr(None, std::net::SocketAddrV4::new(std::net::Ipv4Addr::LOCALHOST, 7471))?;
                    let q = pd.create_rc_qp(&cq, &cq, cap)?;
                    id.attach_qp_num(q.qpn())?;
                    Ok(Said::State(q.state().raw()))
                })(),
                Command::SeqStream { count, len, remote_addr, rkey, pace_us, query_every } => {
                    let (qp, cq, mr, vcpu) = (&qp, &cq, &mr, &vcpu);
                    let s = SeqStream {
                        count,
                        len,
                        remote_addr,
                        rkey,
                        pace: Duration::from_micros(pace_us),
                        query_every,
                    };
                    streaming = Some(scope.spawn(move || s.run(qp, cq, mr, vcpu)));
                    Ok(Said::Ok)
                }
                Command::SeqStreamWait => match streaming.take().map(|t| t.join()) {
                    Some(Ok(Ok(got))) => Ok(Said::Completions(got)),
                    Some(Ok(Err(message))) => Ok(Said::Error { errno: 0, message }),
                    Some(Err(_)) => {
                        Ok(Said::Error { errno: 0, message: "the stream's thread panicked".into() })
                    }
                    None => Ok(Said::Error { errno: 0, message: "no stream".into() }),
                },
                Command::Freeze => {
                    frozen = Some(vcpu.lock().unwrap_or_else(|p| p.into_inner()));
                    Ok(Said::Ok)
                }
                Command::Thaw => {
                    frozen = None;
                    Ok(Said::Ok)
                }
                Command::MoveBar { to_fd } => Ok(match move_bar(to_fd) {
                    Ok(()) => Said::Ok,
                    Err(e) => Said::Error { errno: 0, message: format!("{e:#}") },
                }),
                Command::ArmCq { solicited_only } => cq.req_notify(solicited_only).map(|_| Said::Ok),
                Command::CqEvent { timeout_ms } => match &ch {
                    Some(ch) => ch.get_cq_event(Some(Duration::from_millis(timeout_ms))).map(Said::Event),
                    None => Ok(Said::Error { errno: 0, message: "no channel (--channel)".into() }),
                },
                Command::ChannelReadable { timeout_ms } => match &ch {
                    Some(ch) => Ok(Said::Readable(readable(ch.fd(), Duration::from_millis(timeout_ms)))),
                    None => Ok(Said::Error { errno: 0, message: "no channel (--channel)".into() }),
                },
                Command::CmConnect { to } => (|| {
                    use vrdma::cm::{CmId, ConnParam, EventChannel, EventKind, PortSpace};
                    let ch = EventChannel::create(&ctx)?;
                    let id = CmId::create(&ch, PortSpace::Tcp)?;
                    let expect = |kind: EventKind| -> vrdma::Result<()> {
                        match ch.get_event(Some(Duration::from_secs(10)))? {
                            Some(e) if e.kind == kind => Ok(()),
                            other => Err(vrdma::Error::Daemon {
                                errno: libc::EPROTO,
                                message: format!("expected {kind:?}, got {other:?}"),
                            }),
                        }
                    };
                    id.resolve_addr(None, to)?;
                    expect(EventKind::AddrResolved)?;
                    id.resolve_route()?;
                    expect(EventKind::RouteResolved)?;
                    id.attach_qp(&qp)?;
                    let param =
                        ConnParam { responder_resources: 1, initiator_depth: 1, ..ConnParam::default() };
                    id.connect(&param)?;
                    expect(EventKind::Established)?;
                    cm = Some((ch, id));
                    Ok(Said::Ok)
                })(),
                Command::CmListen { at } => (|| {
                    use vrdma::cm::{CmId, EventChannel, PortSpace};
                    let ch = EventChannel::create(&ctx)?;
                    let id = CmId::create(&ch, PortSpace::Tcp)?;
                    id.bind(at)?;
                    id.listen(8)?;
                    cm = Some((ch, id));
                    Ok(Said::Ok)
                })(),
                Command::CmEvent { timeout_ms } => match &cm {
                    Some((ch, _)) => ch
                        .get_event(Some(Duration::from_millis(timeout_ms)))
                        .map(|e| Said::Cm(e.map(|e| (e.kind as u32, e.status)))),
                    None => Ok(Said::Error { errno: 0, message: "no rdma_cm channel (CmConnect)".into() }),
                },
                Command::CmReadable { timeout_ms } => match &cm {
                    Some((ch, _)) => Ok(Said::Readable(readable(ch.fd(), Duration::from_millis(timeout_ms)))),
                    None => Ok(Said::Error { errno: 0, message: "no rdma_cm channel (CmConnect)".into() }),
                },
                Command::Exit => break,
                Command::Stat => ctx.stat().map(|s| Said::Stat(Box::new(s))),
            };
            match reply {
                Ok(s) => say(&s),
                Err(e) => say(&Said::Error { errno: e.errno(), message: e.to_string() }),
            }
        }
        drop(frozen);
        Ok(())
    })
}

/// [`Command::SeqStream`]'s parameters.
struct SeqStream {
    count: u64,
    len: usize,
    remote_addr: u64,
    rkey: u32,
    pace: Duration,
    query_every: u64,
}

impl SeqStream {
    /// Messages in flight at most.
    const DEPTH: u64 = 16;

    fn run(
        &self,
        qp: &vrdma::QueuePair,
        cq: &vrdma::CompletionQueue,
        mr: &vrdma::MemoryRegion,
        vcpu: &std::sync::Mutex<()>,
    ) -> std::result::Result<Vec<Wc>, String> {
        self.stream(qp, cq, mr, vcpu).map_err(|e| format!("{e:#}"))
    }

    fn stream(
        &self,
        qp: &vrdma::QueuePair,
        cq: &vrdma::CompletionQueue,
        mr: &vrdma::MemoryRegion,
        vcpu: &std::sync::Mutex<()>,
    ) -> Result<Vec<Wc>> {
        let end = Instant::now() + Duration::from_secs(120);
        let mut wcs = vrdma::wc_buffer(64);
        let mut got: Vec<Wc> = Vec::new();
        let mut poll = |got: &mut Vec<Wc>| -> Result<()> {
            let _vcpu = vcpu.lock().unwrap_or_else(|p| p.into_inner());
            let n = cq.poll(&mut wcs)?;
            got.extend(wcs[..n].iter().map(Wc::from));
            Ok(())
        };
        let failed = |got: &[Wc]| got.iter().any(|w| w.status != vrdma::WcStatus::Success.raw());
        let mut posted = 0u64;
        for seq in 0..self.count {
            loop {
                poll(&mut got)?;
                if seq - (got.len() as u64).min(seq) < Self::DEPTH {
                    break;
                }
                if Instant::now() > end {
                    bail!("message {seq}: {} completions in two minutes", got.len());
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            if failed(&got) {
                break;
            }
            {
                let _vcpu = vcpu.lock().unwrap_or_else(|p| p.into_inner());
                // Source slots are reused only far behind what is in flight.
                let at = (seq as usize % 256) * self.len;
                let mut data = vec![seq as u8; self.len];
                data[..8].copy_from_slice(&seq.to_le_bytes());
                mr.write(at, &data)?;
                let sge = mr.sge(at, self.len)?;
                let mut wr = if seq % 2 == 0 {
                    let mut w = vrdma::wr::send(seq, &[sge])?;
                    w.opcode = vrdma::SendOpcode::SendWithImm;
                    w
                } else {
                    let mut w = vrdma::wr::rdma_write(
                        seq,
                        &[sge],
                        self.remote_addr + seq * self.len as u64,
                        self.rkey,
                    )?;
                    w.opcode = vrdma::SendOpcode::RdmaWriteWithImm;
                    w
                };
                wr.imm_data = seq as u32;
                wr.flags |= vrdma::SendFlags::SIGNALED;
                qp.post_send(&[wr]).map_err(|e| e.error).with_context(|| format!("posting message {seq}"))?;
                posted += 1;
            }
            // A call that needs the daemon: it waits while the VM moves.
            if self.query_every > 0 && seq % self.query_every == 0 {
                let (attr, _) = qp.query().with_context(|| format!("querying the QP after message {seq}"))?;
                if attr.qp_state != vrdma::QpState::Rts {
                    break;
                }
            }
            std::thread::sleep(self.pace);
        }
        // What was posted completes, flushed if the QP failed.
        let end = end.min(Instant::now() + Duration::from_secs(10));
        while (got.len() as u64) < posted && Instant::now() < end {
            poll(&mut got)?;
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(got)
    }
}

/// [`Command::MoveBar`]: what QEMU does to a guest's memory when the VM
/// resumes on another host, for an emulated guest: the same addresses,
/// the same offsets, the destination's region under them.
fn move_bar(to_fd: i32) -> Result<()> {
    const BAR_FD: i32 = 100;
    // SAFETY: descriptors 100 and `to_fd` were inherited for this (see
    // `PeerProc::spawn_movable_guest`) and stay open; fstat only reads.
    let st = rustix::fs::fstat(unsafe { std::os::fd::BorrowedFd::borrow_raw(BAR_FD) })?;
    let dev = format!("{:02x}:{:02x}", rustix::fs::major(st.st_dev), rustix::fs::minor(st.st_dev));
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    let mut moved = 0;
    for line in maps.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 5 || f[3] != dev || f[4].parse::<u64>().ok() != Some(st.st_ino) {
            continue;
        }
        let perms = f[1].as_bytes();
        if perms.get(3) != Some(&b's') {
            continue;
        }
        let (start, end) = f[0].split_once('-').context("a maps range")?;
        let (start, end) = (usize::from_str_radix(start, 16)?, usize::from_str_radix(end, 16)?);
        let offset = i64::from_str_radix(f[2], 16)?;
        let mut prot = 0;
        if perms[0] == b'r' {
            prot |= libc::PROT_READ;
        }
        if perms[1] == b'w' {
            prot |= libc::PROT_WRITE;
        }
        // SAFETY: `[start, end)` is a shared mapping of the old region
        // (read from /proc/self/maps just now, nothing else maps or
        // unmaps it while the VM is frozen); it is replaced by the same
        // bytes of the new region (copied there by the test), so every
        // pointer into it stays valid.
        let p = unsafe {
            libc::mmap(
                start as *mut libc::c_void,
                end - start,
                prot,
                libc::MAP_SHARED | libc::MAP_FIXED,
                to_fd,
                offset,
            )
        };
        if p == libc::MAP_FAILED {
            bail!("remapping {line}: {}", std::io::Error::last_os_error());
        }
        moved += 1;
    }
    if moved == 0 {
        bail!("no mapping of the BAR ({dev} inode {})", st.st_ino);
    }
    // SAFETY: both are open descriptors of this process (above).
    if unsafe { libc::dup2(to_fd, BAR_FD) } < 0 {
        bail!("dup2: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// Breaks the shared-memory protocol as `how` says for `span`.
fn misbehave(ctx: &vrdma::Context, how: Misbehavior, qpns: &[u32], span: Duration) {
    let bad = ctx.misbehave();
    let end = Instant::now() + span;
    if how == Misbehavior::Scribble {
        bad.scribble_posted_ring();
        return;
    }
    while Instant::now() < end {
        match how {
            Misbehavior::Overflow => bad.set_posted_overflow(),
            Misbehavior::NameIdle => {
                for &q in qpns {
                    if !bad.name_qp(q) {
                        break;
                    }
                }
            }
            Misbehavior::Doorbells => (0..64).for_each(|_| bad.ring_doorbell()),
            Misbehavior::Scribble => {}
        }
        let pause = if how == Misbehavior::Doorbells { 500 } else { 50 };
        std::thread::sleep(Duration::from_micros(pause));
    }
}

/// Creates objects of every kind, round after round, until the daemon
/// refuses one (or 1000 rounds pass); they stay in `held`.
fn hoard_objects(ctx: &vrdma::Context, held: &mut Vec<Box<dyn std::any::Any>>) -> Said {
    let cap =
        vrdma::QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let srq_attr = vrdma::SrqAttr { max_wr: 4, max_sge: 1, srq_limit: 0 };
    let mut kinds = Vec::new();
    let mut round = || -> vrdma::Result<()> {
        let pd = ctx.alloc_pd()?;
        kinds.push("pd".to_string());
        held.push(Box::new(pd.clone()));
        held.push(Box::new(pd.alloc_mr(4096, vrdma::AccessFlags::LOCAL_WRITE)?));
        kinds.push("mr".into());
        let ch = ctx.create_comp_channel()?;
        kinds.push("channel".into());
        held.push(Box::new(ch.clone()));
        let cq = ctx.create_cq(16, Some(&ch))?;
        kinds.push("cq".into());
        held.push(Box::new(cq.clone()));
        let srq = pd.create_srq(srq_attr)?;
        kinds.push("srq".into());
        held.push(Box::new(srq.clone()));
        held.push(Box::new(pd.create_qp(&vrdma::QpInit::rc(&cq, &cq, cap).with_srq(&srq))?));
        kinds.push("qp-srq".into());
        held.push(Box::new(pd.create_rc_qp(&cq, &cq, cap)?));
        kinds.push("qp".into());
        Ok(())
    };
    for _ in 0..1000 {
        if let Err(e) = round() {
            return Said::Hoarded { kinds, errno: e.errno(), message: e.to_string() };
        }
    }
    Said::Hoarded { kinds, errno: 0, message: "no refusal in 1000 rounds".into() }
}

/// Keeps large requests in flight until `count` complete (or a minute
/// passes), saying `Flooding` once eight are posted; the test may kill us
/// at any moment in between.
fn flood(
    qp: &vrdma::QueuePair,
    cq: &vrdma::CompletionQueue,
    wcs: &mut [vrdma::WorkCompletion],
    count: u64,
    make: impl Fn(u64) -> vrdma::Result<vrdma::SendWr>,
) -> vrdma::Result<Said> {
    let (mut posted, mut done) = (0u64, 0u64);
    let end = Instant::now() + Duration::from_secs(60);
    while done < count && Instant::now() < end {
        while posted < count && posted - done < 32 {
            let mut wr = make(posted)?;
            wr.flags |= vrdma::SendFlags::SIGNALED;
            qp.post_send(&[wr]).map_err(|e| e.error)?;
            posted += 1;
            if posted == 8 {
                println!("{}", serde_json::to_string(&Said::Flooding).expect("serializable"));
            }
        }
        done += cq.poll(wcs)? as u64;
    }
    Ok(Said::Ok)
}

/// Writes in flight on each QP of [`Command::Stream`].
const STREAM_DEPTH: u32 = 16;

/// [`Command::Stream`]: says `Flooding` once every QP has its writes
/// posted, and returns `Streamed`.
fn stream(
    ctx: &vrdma::Context,
    to: Option<&std::path::Path>,
    qps: u32,
    len: usize,
    span: Duration,
    say: impl Fn(&Said),
) -> vrdma::Result<Said> {
    let pd = ctx.alloc_pd()?;
    let access = vrdma::AccessFlags::LOCAL_WRITE | vrdma::AccessFlags::REMOTE_WRITE;
    // [0, len): the source; [len, 2 len): where every write lands.
    let mr = pd.alloc_mr(2 * len, access)?;
    let cq = ctx.create_cq(qps * STREAM_DEPTH, None)?;
    let cap = vrdma::QpCap {
        max_send_wr: STREAM_DEPTH,
        max_recv_wr: 1,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    // Across hosts: a context on the other daemon, a QP there for each
    // of ours, and the region the writes land in.
    let far = match to {
        Some(to) => {
            let fctx = vrdma::Context::open_at(to)?;
            let fpd = fctx.alloc_pd()?;
            let fmr = fpd.alloc_mr(len, access)?;
            let fcq = fctx.create_cq(qps, None)?;
            Some((fctx, fpd, fmr, fcq, Vec::new()))
        }
        None => None,
    };
    let mut far = far;
    let mut all = Vec::new();
    for _ in 0..qps {
        let q = pd.create_rc_qp(&cq, &cq, cap)?;
        match &mut far {
            Some((fctx, fpd, _, fcq, fqps)) => {
                let f = fpd.create_rc_qp(fcq, fcq, cap)?;
                q.connect(&f.endpoint(fctx)?, access)?;
                f.connect(&q.endpoint(ctx)?, access)?;
                fqps.push(f);
            }
            None => q.connect(&q.endpoint(ctx)?, access)?,
        }
        all.push(q);
    }
    let src = mr.sge(0, len)?;
    let (dst, rkey) = match &far {
        Some((_, _, fmr, _, _)) => (fmr.addr(), fmr.rkey()),
        None => (mr.addr() + len as u64, mr.rkey()),
    };
    let post = |q: usize| -> vrdma::Result<()> {
        let w = vrdma::wr::rdma_write(q as u64, &[src], dst, rkey)?;
        all[q].post_send(&[vrdma::wr::SendWrExt::signaled(w)]).map_err(|e| e.error)
    };
    for q in 0..all.len() {
        for _ in 0..STREAM_DEPTH {
            post(q)?;
        }
    }
    say(&Said::Flooding);
    let start = Instant::now();
    let mut wcs = vrdma::wc_buffer(64);
    let mut bytes = 0u64;
    while start.elapsed() < span {
        let n = cq.poll(&mut wcs)?;
        for wc in &wcs[..n] {
            if wc.status != vrdma::WcStatus::Success {
                return Ok(Said::Error { errno: 0, message: format!("a streamed write: {wc:?}") });
            }
            bytes += len as u64;
            post(wc.wr_id as usize)?;
        }
        // With 16 writes in flight on each QP the engine has milliseconds
        // of work queued: the hog sleeps between polls, so that on a small
        // machine what a test measures beside it is the engine's order of
        // service, not which of the spinning threads the kernel runs.
        if n < wcs.len() {
            std::thread::sleep(Duration::from_micros(500));
        }
    }
    let micros = start.elapsed().as_micros() as u64;
    // What is in flight completes before the QPs go.
    let end = Instant::now() + Duration::from_secs(10);
    let mut left = all.len() as u64 * u64::from(STREAM_DEPTH);
    while left > 0 && Instant::now() < end {
        left = left.saturating_sub(cq.poll(&mut wcs)? as u64);
    }
    Ok(Said::Streamed { bytes, micros })
}

/// Whether `fd` turns readable within `within` (poll, taking nothing).
fn readable(fd: std::os::fd::BorrowedFd<'_>, within: Duration) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::new(&fd, PollFlags::IN)];
    let ts = Timespec::try_from(within).ok();
    matches!(rustix::event::poll(&mut fds, ts.as_ref()), Ok(n) if n > 0)
        && fds[0].revents().contains(PollFlags::IN)
}
