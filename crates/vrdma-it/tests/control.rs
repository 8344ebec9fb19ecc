//! The control socket under abuse: malformed, oversized, out-of-order and
//! badly accompanied messages on a raw `SOCK_SEQPACKET` connection. Each
//! gets an error reply with a fitting errno, the connection stays usable
//! where the protocol allows, and the daemon keeps serving everybody.

use std::os::fd::{AsFd, BorrowedFd};
use std::time::Duration;

use anyhow::{bail, Result};
use vrdma_core::proto::{self, Reply, Request, MAX_MESSAGE, PROTOCOL_VERSION};
use vrdma_core::verbs::{AccessFlags, QpAttr, QpAttrMask};
use vrdma_it::{pattern, wait_until, Answer, DaemonProc, RawConn, WAIT};

const EPROTO: i32 = libc::EPROTO;
const EINVAL: i32 = libc::EINVAL;

/// The daemon's descriptor count once it stopped changing (the harness's
/// start-up probes close asynchronously).
fn settled_fds(d: &DaemonProc) -> Result<usize> {
    let mut last = d.open_fds()?;
    for _ in 0..200 {
        std::thread::sleep(Duration::from_millis(20));
        let now = d.open_fds()?;
        if now == last {
            return Ok(now);
        }
        last = now;
    }
    Ok(last)
}

/// A normal context still works end to end.
fn still_serving(d: &mut DaemonProc) -> Result<()> {
    assert!(d.is_alive(), "the daemon died");
    let ctx = d.context()?;
    let pd = ctx.alloc_pd()?;
    let mr = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE)?;
    mr.write(0, b"ok")?;
    assert_eq!(ctx.query_port(1)?.state, 4);
    Ok(())
}

/// A valid request on `c` still gets its proper reply.
fn conn_works(c: &mut RawConn) -> Result<u32> {
    match c.call(&Request::AllocPd, &[])?.reply()? {
        Reply::Pd { pd } => Ok(pd),
        other => bail!("AllocPd answered {other:?}"),
    }
}

fn open(d: &DaemonProc) -> Result<RawConn> {
    let mut c = RawConn::connect(&d.socket)?;
    c.hello()?;
    Ok(c)
}

fn reg_mr(pd: u32, len: u64) -> Request {
    Request::RegMr { pd, addr: 0x7000_0000_0000, len, access: AccessFlags::LOCAL_WRITE, fd_offset: 0 }
}

#[test]
fn garbage_is_refused_and_the_connection_lives_on() -> Result<()> {
    let mut d = DaemonProc::start()?;
    let mut c = open(&d)?;
    let junk: Vec<Vec<u8>> = vec![
        vec![0xff; 32],
        pattern(200, 1),
        pattern(3000, 2),
        // A variant number past the last request.
        vec![0x7f, 1, 2, 3],
        // A varint that never ends.
        vec![0x80; 64],
        // One byte: Hello without its version.
        vec![0x00],
    ];
    for (i, j) in junk.iter().enumerate() {
        // Skip pseudo-random inputs that happen to decode.
        if proto::decode_request(j).is_ok() {
            continue;
        }
        let (errno, msg) = c.exchange(j, &[])?.errno()?;
        assert_eq!(errno, EINVAL, "junk {i}: {msg}");
        conn_works(&mut c)?;
    }
    // A valid request with a byte too many.
    let mut extra = proto::encode_request(&Request::AllocPd);
    extra.push(0);
    let (errno, msg) = c.exchange(&extra, &[])?.errno()?;
    assert_eq!(errno, EINVAL, "{msg}");
    // One-byte messages that are valid requests are served.
    let one = proto::encode_request(&Request::QueryDevice);
    assert_eq!(one.len(), 1);
    assert!(matches!(c.exchange(&one, &[])?.reply()?, Reply::Device(_)));
    conn_works(&mut c)?;
    still_serving(&mut d)
}

#[test]
fn an_empty_message_is_taken_as_a_hang_up() -> Result<()> {
    let mut d = DaemonProc::start()?;
    let mut c = open(&d)?;
    // On SOCK_SEQPACKET an empty message reads like the end of the
    // stream: the daemon may close the connection, or refuse the message.
    match c.exchange(&[], &[])? {
        Answer::Closed => {}
        Answer::Reply(Reply::Error { errno, .. }, _) => {
            assert_eq!(errno, EINVAL);
            conn_works(&mut c)?;
        }
        other => panic!("an empty message answered {other:?}"),
    }
    still_serving(&mut d)
}

#[test]
fn every_truncation_of_a_valid_message_is_refused() -> Result<()> {
    let mut d = DaemonProc::start()?;
    let mut c = open(&d)?;
    let pd = conn_works(&mut c)?;
    let full = proto::encode_request(&Request::ModifyQp {
        qp: 0x11,
        attr: QpAttr::default(),
        mask: QpAttrMask::STATE | QpAttrMask::PORT,
    });
    for n in 1..full.len() {
        let (errno, msg) = c.exchange(&full[..n], &[])?.errno()?;
        assert_eq!(errno, EINVAL, "prefix of {n} bytes: {msg}");
    }
    let reg = proto::encode_request(&reg_mr(pd, 4096));
    let (errno, _) = c.exchange(&reg[..reg.len() - 1], &[])?.errno()?;
    assert_eq!(errno, EINVAL);
    conn_works(&mut c)?;
    still_serving(&mut d)
}

#[test]
fn an_oversized_message_is_refused() -> Result<()> {
    let mut d = DaemonProc::start()?;
    let mut c = open(&d)?;
    // A valid request padded past the limit, and plain bulk.
    let mut big = proto::encode_request(&Request::AllocPd);
    big.resize(MAX_MESSAGE + 1, 0);
    let (errno, msg) = c.exchange(&big, &[])?.errno()?;
    assert_eq!(errno, EINVAL, "{msg}");
    assert!(msg.contains("larger"), "{msg}");
    let (errno, _) = c.exchange(&pattern(MAX_MESSAGE * 2, 3), &[])?.errno()?;
    assert_eq!(errno, EINVAL);
    conn_works(&mut c)?;
    still_serving(&mut d)
}

#[test]
fn reg_mr_descriptors_are_checked() -> Result<()> {
    let mut d = DaemonProc::start()?;
    let before = settled_fds(&d)?;
    let mut c = open(&d)?;
    let pd = conn_works(&mut c)?;
    let req = reg_mr(pd, 4096);
    let sealed = vrdma_shm::Segment::create("it-sealed", 4096)?;
    let sealed2 = vrdma_shm::Segment::create("it-sealed", 4096)?;
    let (pipe_r, _pipe_w) = rustix::pipe::pipe()?;
    let unsealable = rustix::fs::memfd_create("it-unsealable", rustix::fs::MemfdFlags::CLOEXEC)?;
    rustix::fs::ftruncate(&unsealable, 4096)?;
    let unsealed = rustix::fs::memfd_create(
        "it-unsealed",
        rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
    )?;
    rustix::fs::ftruncate(&unsealed, 4096)?;
    let bells: Vec<_> = (0..5).map(|_| vrdma_shm::Doorbell::pair()).collect::<Result<_, _>>()?;
    let five: Vec<BorrowedFd> = bells.iter().map(|(a, _)| a.as_fd()).collect();

    let cases: Vec<(&str, Vec<BorrowedFd>)> = vec![
        ("no descriptor", vec![]),
        ("two descriptors", vec![sealed.fd(), sealed2.fd()]),
        ("five descriptors", five),
        ("a pipe", vec![pipe_r.as_fd()]),
        ("a memfd that cannot be sealed", vec![unsealable.as_fd()]),
        ("a memfd without seals", vec![unsealed.as_fd()]),
    ];
    for (what, fds) in &cases {
        let (errno, msg) = c.call(&req, fds)?.errno()?;
        assert_eq!(errno, EINVAL, "{what}: {msg}");
        conn_works(&mut c)?;
    }
    // A descriptor with a request that takes none.
    let (errno, msg) = c.call(&Request::AllocPd, &[sealed.fd()])?.errno()?;
    assert_eq!(errno, EINVAL, "{msg}");
    // Sealed but smaller than the region.
    let (errno, msg) = c.call(&reg_mr(pd, 8192), &[sealed.fd()])?.errno()?;
    assert_eq!(errno, EINVAL, "{msg}");
    // An offset past the end of the file.
    let far = Request::RegMr {
        pd,
        addr: 0x7000_0000_0000,
        len: 16,
        access: AccessFlags::LOCAL_WRITE,
        fd_offset: u64::MAX - 8,
    };
    let (errno, msg) = c.call(&far, &[sealed.fd()])?.errno()?;
    assert_eq!(errno, EINVAL, "{msg}");
    // A PD that does not exist.
    let (errno, msg) = c.call(&reg_mr(pd + 1000, 4096), &[sealed.fd()])?.errno()?;
    assert_eq!(errno, EINVAL, "{msg}");

    // And the real thing works on the same connection.
    let key = match c.call(&req, &[sealed.fd()])?.reply()? {
        Reply::Mr { key } => key,
        other => bail!("RegMr answered {other:?}"),
    };
    assert!(matches!(c.call(&Request::DeregMr { key }, &[])?.reply()?, Reply::Done));
    assert!(matches!(c.call(&Request::DeallocPd { pd }, &[])?.reply()?, Reply::Done));
    drop(c);
    // Every descriptor that came with a refused request was closed.
    wait_until(WAIT, "the daemon's descriptors back to their count", || {
        d.open_fds().is_ok_and(|n| n <= before)
    })?;
    still_serving(&mut d)
}

/// `RegMrPieces` from a host tenant: the pieces' count, lengths,
/// alignment, overlaps and files are the tenant's word, each wrong one a
/// clear EINVAL that leaves the connection working and no descriptor
/// behind; good pieces of two files make one region.
#[test]
fn reg_mr_pieces_are_checked() -> Result<()> {
    use vrdma_core::proto::MrPiece;
    let mut d = DaemonProc::start()?;
    let before = settled_fds(&d)?;
    let mut c = open(&d)?;
    let pd = conn_works(&mut c)?;
    let (one, two) =
        (vrdma_shm::Segment::create("it-piece", 8192)?, vrdma_shm::Segment::create("it-piece", 4096)?);
    let unsealed = rustix::fs::memfd_create("it-unsealed", rustix::fs::MemfdFlags::CLOEXEC)?;
    rustix::fs::ftruncate(&unsealed, 4096)?;
    let p = |fd_offset: u64, len: u64| MrPiece { fd_offset, len };
    let req = |len: u64, pieces: Vec<MrPiece>| Request::RegMrPieces {
        pd,
        addr: 0x7000_0000_0000,
        len,
        access: AccessFlags::LOCAL_WRITE,
        pieces,
    };
    let both = vec![one.fd(), two.fd()];
    let cases: Vec<(&str, Request, Vec<BorrowedFd>, &str)> = vec![
        ("no piece", req(0, vec![]), vec![], "1 to 64 pieces"),
        ("an empty piece", req(10, vec![p(0, 0), p(0, 10)]), both.clone(), "empty"),
        ("lengths that do not sum", req(4097, vec![p(0, 4096), p(0, 10)]), both.clone(), "the region 4097"),
        (
            "a first piece ending inside a page",
            req(20, vec![p(0, 10), p(0, 10)]),
            both.clone(),
            "inside a page",
        ),
        (
            "a piece beginning inside a page",
            req(4106, vec![p(0, 4096), p(8, 10)]),
            both.clone(),
            "inside a page",
        ),
        (
            "overlapping pieces of one file",
            req(8192, vec![p(0, 4096), p(0, 4096)]),
            vec![one.fd(), one.fd()],
            "overlap",
        ),
        ("a piece past its file", req(8192, vec![p(0, 4096), p(4096, 4096)]), both.clone(), "too small"),
        (
            "a file without seals",
            req(4106, vec![p(0, 4096), p(0, 10)]),
            vec![one.fd(), unsealed.as_fd()],
            "SEAL",
        ),
        ("fewer files than pieces", req(4106, vec![p(0, 4096), p(0, 10)]), vec![one.fd()], "fds"),
        ("a wrapping piece", req(10, vec![p(u64::MAX - 4, 10)]), vec![one.fd()], "wraps"),
    ];
    for (what, r, fds, says) in &cases {
        let (errno, msg) = c.call(r, fds)?.errno()?;
        assert_eq!(errno, EINVAL, "{what}: {msg}");
        assert!(msg.contains(says), "{what}: {msg}");
        conn_works(&mut c)?;
    }
    let key = match c
        .call(&req(4096 - 100 + 10, vec![p(8192 - 4096 + 100, 4096 - 100), p(0, 10)]), &both)?
        .reply()?
    {
        Reply::Mr { key } => key,
        other => bail!("RegMrPieces answered {other:?}"),
    };
    assert!(matches!(c.call(&Request::DeregMr { key }, &[])?.reply()?, Reply::Done));
    drop(c);
    wait_until(WAIT, "the daemon's descriptors back to their count", || {
        d.open_fds().is_ok_and(|n| n <= before)
    })?;
    still_serving(&mut d)
}

#[test]
fn hello_comes_first_and_once_in_the_right_version() -> Result<()> {
    let mut d = DaemonProc::start()?;
    let mut c = RawConn::connect(&d.socket)?;
    let (errno, msg) = c.call(&Request::AllocPd, &[])?.errno()?;
    assert_eq!(errno, EPROTO, "{msg}");
    let (errno, msg) = c.call(&Request::QueryDevice, &[])?.errno()?;
    assert_eq!(errno, EPROTO, "{msg}");
    let (errno, msg) = c.call(&Request::Hello { version: PROTOCOL_VERSION + 1 }, &[])?.errno()?;
    assert_eq!(errno, EPROTO, "{msg}");
    assert!(msg.contains("version"), "{msg}");
    let (errno, _) = c.call(&Request::Hello { version: 0 }, &[])?.errno()?;
    assert_eq!(errno, EPROTO);
    // The right version still opens the context after those.
    assert_eq!(c.hello()?, rustix::process::geteuid().as_raw());
    let (errno, msg) = c.call(&Request::Hello { version: PROTOCOL_VERSION }, &[])?.errno()?;
    assert_eq!(errno, EPROTO, "{msg}");
    conn_works(&mut c)?;
    still_serving(&mut d)
}

/// Hello is a deadline (5 s from connecting), not a pause between
/// messages: a connection that keeps sending other requests is closed too.
#[test]
fn a_connection_that_never_says_hello_is_closed_whatever_else_it_sends() -> Result<()> {
    let mut d = DaemonProc::start()?;
    let mut c = RawConn::connect(&d.socket)?;
    let started = std::time::Instant::now();
    let closed = loop {
        match c.call(&Request::QueryDevice, &[]) {
            Ok(Answer::Closed) | Err(_) => break started.elapsed(),
            Ok(a) => assert_eq!(a.errno()?.0, EPROTO),
        }
        assert!(started.elapsed() < Duration::from_secs(9), "still open after 9 s");
        std::thread::sleep(Duration::from_millis(500));
    };
    assert!(closed >= Duration::from_secs(4), "closed after {closed:?}");
    still_serving(&mut d)
}

#[test]
fn replies_to_objects_of_nobody_are_einval() -> Result<()> {
    let mut d = DaemonProc::start()?;
    let mut c = open(&d)?;
    for req in [
        Request::DeallocPd { pd: 12345 },
        Request::DeregMr { key: 1 },
        Request::DestroyCq { cq: 77 },
        Request::DestroyQp { qp: 0x11 },
        Request::DestroySrq { srq: 5 },
        Request::DestroyCompChannel { channel: 9 },
        Request::QueryQp { qp: 0x12 },
        Request::CreateCq { cqe: 16, channel: Some(4242) },
        Request::QueryPort { port: 2 },
        Request::QueryGid { port: 1, index: 7 },
        Request::CreateCq { cqe: 0, channel: None },
    ] {
        let (errno, msg) = c.call(&req, &[])?.errno()?;
        assert_eq!(errno, EINVAL, "{req:?}: {msg}");
    }
    conn_works(&mut c)?;
    still_serving(&mut d)
}

#[test]
fn many_short_connections_leave_nothing_behind() -> Result<()> {
    let mut d = DaemonProc::start()?;
    let fds = settled_fds(&d)?;
    let threads = d.threads()?;
    for i in 0..200u64 {
        let c = RawConn::connect(&d.socket)?;
        // Some say something and leave without reading the answer.
        if i % 4 == 1 {
            c.send_raw(&pattern(64, i), &[])?;
        } else if i % 4 == 2 {
            c.send_raw(&proto::encode_request(&Request::AllocPd), &[])?;
        }
        drop(c);
    }
    wait_until(WAIT, "the daemon's descriptors back to their count", || {
        d.open_fds().is_ok_and(|n| n <= fds)
    })?;
    wait_until(WAIT, "the daemon's session threads gone", || d.threads().is_ok_and(|n| n <= threads))?;
    still_serving(&mut d)
}

/// Whether the daemon closed `c` within `limit` (end of stream).
fn closed_within(c: &RawConn, limit: Duration) -> Result<bool> {
    rustix::net::sockopt::set_socket_timeout(&c.sock, rustix::net::sockopt::Timeout::Recv, Some(limit))?;
    let mut b = [0u8; 64];
    match rustix::net::recv(&c.sock, &mut b, rustix::net::RecvFlags::empty()) {
        Ok((0, _)) => Ok(true),
        Ok(_) => bail!("the daemon said something unasked"),
        Err(rustix::io::Errno::AGAIN) => Ok(false),
        Err(rustix::io::Errno::CONNRESET) => Ok(true),
        Err(e) => Err(e.into()),
    }
}

#[test]
fn a_connection_that_never_says_hello_is_closed() -> Result<()> {
    let mut d = DaemonProc::start()?;
    let c = RawConn::connect(&d.socket)?;
    assert!(closed_within(&c, Duration::from_secs(20))?, "a silent connection was kept for 20 s");
    still_serving(&mut d)
}

#[test]
fn a_tenant_cannot_hold_more_connections_than_its_contexts_allow() -> Result<()> {
    // Two contexts and the margin of 16: 18 connections at most.
    let mut d = DaemonProc::start_with_config("[quota]\nmax_contexts = 2\n")?;
    let conns: Vec<RawConn> = (0..40).map(|_| RawConn::connect(&d.socket)).collect::<Result<_>>()?;
    let mut closed = 0;
    for c in &conns {
        if closed_within(c, Duration::from_millis(100))? {
            closed += 1;
        }
    }
    assert!((22..40).contains(&closed), "{closed} of 40 closed at once");
    drop(conns);
    wait_until(WAIT, "a context once the others are gone", || d.context().is_ok())?;
    still_serving(&mut d)
}

/// The daemon's peak virtual memory, in KiB.
fn vm_peak_kib(d: &DaemonProc) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{}/status", d.proc.pid()))?;
    let line =
        status.lines().find(|l| l.starts_with("VmPeak:")).ok_or_else(|| anyhow::anyhow!("no VmPeak"))?;
    Ok(line.split_whitespace().nth(1).unwrap_or("0").parse()?)
}

#[test]
fn a_region_over_the_size_limit_is_refused_before_it_is_mapped() -> Result<()> {
    let mut d = DaemonProc::start()?;
    let mut c = open(&d)?;
    let pd = conn_works(&mut c)?;
    // A sealed, sparse memfd of 2 TiB: mapping it costs nothing but
    // address space, which is what the check protects.
    let len: u64 = 2 << 40;
    let f = rustix::fs::memfd_create(
        "it-huge",
        rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
    )?;
    rustix::fs::ftruncate(&f, len)?;
    rustix::fs::fcntl_add_seals(&f, rustix::fs::SealFlags::SHRINK)?;
    let before = vm_peak_kib(&d)?;
    let (errno, msg) = c.call(&reg_mr(pd, len), &[f.as_fd()])?.errno()?;
    assert_eq!(errno, EINVAL, "{msg}");
    let grew = vm_peak_kib(&d)?.saturating_sub(before);
    assert!(grew < 1 << 30, "the daemon mapped {grew} KiB for a region it refused");
    conn_works(&mut c)?;
    still_serving(&mut d)
}

#[test]
fn stat_lists_thousands_of_qps_in_pages() -> Result<()> {
    // More QPs than one control message can list.
    const QPS: usize = 12_000;
    // Each QP is a mapping in the daemon: one tenant needs more than the
    // default share (max_mappings / 16).
    let mut d = DaemonProc::start_with_config("max_tenants = 1\n")?;
    let mut c = open(&d)?;
    let pd = conn_works(&mut c)?;
    let cq = match c.call(&Request::CreateCq { cqe: 16, channel: None }, &[])?.reply()? {
        Reply::Cq { cq, .. } => cq,
        other => bail!("CreateCq answered {other:?}"),
    };
    let init = vrdma_core::verbs::QpInitAttr {
        qp_type: vrdma_core::verbs::QpType::Rc,
        send_cq: cq,
        recv_cq: cq,
        srq: None,
        cap: vrdma_core::verbs::QpCap {
            max_send_wr: 1,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        sq_sig_all: false,
    };
    let mut qpns = Vec::with_capacity(QPS);
    for _ in 0..QPS {
        match c.call(&Request::CreateQp { pd, init }, &[])?.reply()? {
            Reply::Qp { created, .. } => qpns.push(created.qpn),
            other => bail!("CreateQp answered {other:?}"),
        }
    }
    // Another process of the tenant lists them all, page by page.
    let st = d.context()?.stat()?;
    let listed: Vec<u32> = st.qps.iter().map(|q| q.qpn).collect();
    qpns.sort_unstable();
    assert_eq!(listed, qpns);
    let whole = proto::encode_reply(&Reply::Stat(st)).len();
    assert!(whole > MAX_MESSAGE, "{whole} bytes would fit one message: the test needs more QPs");
    // A client that does not page gets the first page, not a message
    // too long for it.
    match c.call(&Request::Stat, &[])?.reply()? {
        Reply::Stat(s) => assert_eq!(s.qps.len(), vrdma_core::hca::STAT_PAGE_QPS),
        other => bail!("Stat answered {other:?}"),
    }
    conn_works(&mut c)?;
    still_serving(&mut d)
}

/// The daemon maps a registered region, or a queue's ring, and closes its
/// descriptor: a tenant's objects, up to its quota, must not use up the
/// descriptors that every tenant's connections need. With the direct path
/// on (the default; `VRDMA_DIRECT=0` turns it off, `docs/direct-path.md`) the daemon keeps a
/// region's memfd to grant it (a SEND lands in receive SGEs), but only
/// within the tenant's share of descriptors (`max_descriptors`): the rest
/// of the regions are not kept, and every one is given back with its
/// region.
#[test]
fn regions_and_queues_hold_no_descriptors_in_the_daemon() -> Result<()> {
    const SHARE: usize = 64;
    const PER_CONTEXT: usize = 8;
    // The daemon takes the default of `[direct]`, as this reads it.
    let direct = vrdmad::DirectConfig::enabled_by_default();
    let d = DaemonProc::start_with_config(&format!("[quota]\nmax_descriptors = {SHARE}\n"))?;
    let mut c = open(&d)?;
    let pd = conn_works(&mut c)?;
    let before = settled_fds(&d)?;
    let sealed = vrdma_shm::Segment::create("it-many", 4096)?;
    let mut keys = Vec::new();
    for _ in 0..300 {
        match c.call(&reg_mr(pd, 4096), &[sealed.fd()])?.reply()? {
            Reply::Mr { key } => keys.push(key),
            other => bail!("RegMr answered {other:?}"),
        }
    }
    let with_mrs = settled_fds(&d)?;
    let held = with_mrs.saturating_sub(before);
    if direct {
        // The share, less the context's and what `conn_works` made.
        assert!(held <= SHARE - PER_CONTEXT, "300 regions hold {held} descriptors, above the tenant's share");
        assert!(held + 10 >= SHARE - PER_CONTEXT, "the direct path kept only {held} region descriptors");
    } else {
        assert!(held < 10, "300 regions hold {held} descriptors in the daemon");
    }
    for _ in 0..300 {
        match c.call(&Request::CreateCq { cqe: 16, channel: None }, &[])?.reply()? {
            Reply::Cq { .. } => {}
            other => bail!("CreateCq answered {other:?}"),
        }
    }
    let with_cqs = settled_fds(&d)?;
    assert!(with_cqs < with_mrs + 10, "300 CQs hold {} descriptors in the daemon", with_cqs - with_mrs);
    for key in keys {
        assert!(matches!(c.call(&Request::DeregMr { key }, &[])?.reply()?, Reply::Done));
    }
    let after = settled_fds(&d)?;
    assert!(after < before + 10, "deregistered regions still hold {} descriptors", after - before);
    Ok(())
}

/// Each completion channel keeps a descriptor in the daemon (its end of
/// the tenant's doorbell), so a tenant's channels are bounded apart from
/// its objects: 1024, and the daemon's descriptors grow by no more.
#[test]
fn a_tenants_completion_channels_are_bounded() -> Result<()> {
    // One tenant: its share of the daemon's descriptors is the whole of
    // them, so the bound met is the channels', whatever `ulimit -n` is.
    let d = DaemonProc::start_with_config("max_tenants = 1\n")?;
    let mut c = open(&d)?;
    conn_works(&mut c)?;
    let before = settled_fds(&d)?;
    let mut made = 0;
    let refusal = loop {
        match c.call(&Request::CreateCompChannel, &[])?.reply()? {
            Reply::CompChannel { .. } => made += 1,
            Reply::Error { errno, message } => break (errno, message),
            other => bail!("CreateCompChannel answered {other:?}"),
        }
        assert!(made <= 1024, "more than 1024 channels");
    };
    assert_eq!(made, 1024, "refused after {made}: {refusal:?}");
    assert!(refusal.1.contains("1024 completion channels"), "{refusal:?}");
    let after = settled_fds(&d)?;
    assert!(after <= before + 1024 + 8, "1024 channels hold {} descriptors in the daemon", after - before);
    conn_works(&mut c)?;
    Ok(())
}

/// A tenant that stops reading replies blocks its session thread in
/// sendmsg. If it then sends its own end of the connection to the daemon
/// (SCM_RIGHTS) and exits, that end lives on in the daemon's receive
/// queue, so the daemon never sees a hang-up: only the reply time limit
/// (10 s) ends the session and closes the dead process's context.
#[test]
fn a_dead_tenants_context_is_closed_even_if_it_stopped_reading() -> Result<()> {
    use rustix::net::{sockopt, SendFlags};
    let mut d = DaemonProc::start_with_config("[quota]\nmax_contexts = 1\n")?;
    let threads = d.threads()?;
    {
        let mut c = open(&d)?;
        conn_works(&mut c)?;
        // Requests without reading the replies, until our own buffer is full.
        let req = proto::encode_request(&Request::QueryDevice);
        let mut sent = 0;
        loop {
            match rustix::net::send(&c.sock, &req, SendFlags::DONTWAIT | SendFlags::NOSIGNAL) {
                Ok(_) => sent += 1,
                Err(rustix::io::Errno::AGAIN) => break,
                Err(e) => return Err(e.into()),
            }
            assert!(sent < 1_000_000);
        }
        std::thread::sleep(Duration::from_millis(300));
        // Room for one more message: our end of the connection itself.
        sockopt::set_socket_send_buffer_size(&c.sock, 1 << 20)?;
        c.send_raw(&req, &[c.sock.as_fd()])?;
        // The process "dies": every descriptor it had is closed.
        drop(c);
    }
    // Its context should be closed, so that the tenant can open another.
    let reopened = wait_until(Duration::from_secs(15), "the dead tenant's context closed", || {
        RawConn::connect(&d.socket).and_then(|mut c| c.hello()).is_ok()
    });
    assert!(d.is_alive());
    assert!(
        reopened.is_ok(),
        "15 s after the tenant closed every descriptor its context is still open; daemon threads {} (were {threads})",
        d.threads()?
    );
    Ok(())
}

/// The daemon bounds the memory mappings it makes for tenants (regions,
/// rings, contexts) below the kernel's bound on the process: past it, the
/// next one is refused with ENOMEM and a clear message, and the daemon's
/// own allocations, and the tenants already served, go on. (With one
/// tenant, its share is the whole budget; tests/budgets.rs shares it.)
#[test]
fn the_daemons_memory_mappings_are_bounded() -> Result<()> {
    let mut d = DaemonProc::start_with_config("max_mappings = 40\nmax_tenants = 1\n")?;
    let mut c = open(&d)?;
    let pd = conn_works(&mut c)?;
    let sealed = vrdma_shm::Segment::create("it-maps", 4096)?;
    let mut keys = Vec::new();
    let refusal = loop {
        match c.call(&reg_mr(pd, 4096), &[sealed.fd()])?.reply()? {
            Reply::Mr { key } => keys.push(key),
            Reply::Error { errno, message } => break (errno, message),
            other => bail!("RegMr answered {other:?}"),
        }
        assert!(keys.len() <= 40, "more regions than mappings allowed");
    };
    assert_eq!(refusal.0, libc::ENOMEM, "{refusal:?}");
    assert!(refusal.1.contains("memory mappings"), "{refusal:?}");
    assert!(keys.len() >= 30, "only {} regions before the limit", keys.len());
    // A region given back makes room for the next.
    let key = keys.pop().expect("some");
    assert!(matches!(c.call(&Request::DeregMr { key }, &[])?.reply()?, Reply::Done));
    assert!(matches!(c.call(&reg_mr(pd, 4096), &[sealed.fd()])?.reply()?, Reply::Mr { .. }));
    // Room for another tenant's context once these go.
    for key in keys {
        assert!(matches!(c.call(&Request::DeregMr { key }, &[])?.reply()?, Reply::Done));
    }
    still_serving(&mut d)
}
