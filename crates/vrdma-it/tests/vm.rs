//! VMs (`docs/vms.md`): the daemon keeps a region and a port socket per
//! configured VM and hands them to root or the VM's tenant uid; a guest,
//! emulated here by a host process whose library runs in guest mode
//! (`VRDMA_GUEST_PORT` = the port socket, `VRDMA_GUEST_BAR` = the region
//! memfd inherited as `/proc/self/fd/N`), reaches the device through them
//! alone. The cross-uid test needs root; without it it says so and passes
//! vacuously.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use vrdma::wr::{self, SendWrExt};
use vrdma::WcStatus;
use vrdma_core::proto::guest::{self, Frame, FrameDecoder, Handle, GUEST_VERSION};
use vrdma_core::proto::{Reply, Request};
use vrdma_it::protocol::{Command, Misbehavior, Said};
use vrdma_it::{access_all, pattern, poll_one, DaemonProc, PeerProc, Side, WAIT};

const NOBODY: u32 = 65534;

fn root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A daemon with VM `t` of the test's own uid (and `extra` in its table).
fn daemon_with_vm(extra: &str) -> Result<DaemonProc> {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    DaemonProc::start_with_config(&format!("[vms.t]\ntenant = {uid}\nmemory_mib = 8\nports = 2\n{extra}"))
}

#[test]
fn attach_hands_the_region_and_port_socket_to_the_vms_tenant_only() -> Result<()> {
    let d = daemon_with_vm("")?;
    let a = vrdma::vm::attach_at(&d.socket, "t")?;
    assert_eq!(a.region_len, 8 << 20);
    assert_eq!(a.ports, 2);
    assert_eq!(a.port_socket, d.socket.parent().unwrap().join("vm-t.sock"));
    let st = rustix::fs::fstat(&a.region)?;
    assert_eq!(st.st_size as u64, a.region_len);
    // Sealed: nobody can take pages from under the daemon.
    let seals = rustix::fs::fcntl_get_seals(&a.region)?;
    assert!(seals.contains(rustix::fs::SealFlags::SHRINK | rustix::fs::SealFlags::GROW), "{seals:?}");
    let meta = std::fs::metadata(&a.port_socket)?;
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777, 0o600);

    let e = vrdma::vm::attach_at(&d.socket, "nope").unwrap_err();
    assert_eq!(e.errno(), libc::ENOENT, "{e}");
    assert!(e.to_string().contains("no VM \"nope\""), "{e}");

    if !root() {
        vrdma_it::skip(format!("the cross-uid half needs root (to attach as uid {NOBODY})"));
        return Ok(());
    }
    let p = PeerProc::spawn_as(&d.socket, "vm-attach", &["--vm", "t"], Some(NOBODY))?;
    match p.recv::<Said>(Duration::from_secs(20))? {
        Said::Error { errno, message } => {
            assert_eq!(errno, libc::EPERM, "{message}");
            assert!(message.contains("only that uid or root"), "{message}");
        }
        other => panic!("uid {NOBODY} attached VM t: {other:?}"),
    }
    Ok(())
}

/// An emulated guest and a host process of the VM's tenant: the guest's
/// context, PD, CQ, QP and region are made through its port alone, and RC
/// sends and RDMA writes cross both ways.
#[test]
fn an_emulated_guest_exchanges_sends_and_writes_with_a_host_process() -> Result<()> {
    let d = daemon_with_vm("")?;
    let vm = vrdma::vm::attach_at(&d.socket, "t")?;
    let ctx = d.context()?;
    let me = Side::new(&ctx, 1 << 16)?;
    let mut guest = PeerProc::spawn_guest(&vm, "tenant", &["--mr-len", "65536"])?;
    let h = guest.hello()?;
    // The guest is the VM's tenant: ours (a host process of the same uid).
    assert_eq!(h.tenant, ctx.tenant());
    // Its region lies in the VM's region, not in a memfd of its own.
    assert!(bar_mapped(h.pid, &vm)?, "the guest's memory is not in the VM's region");
    me.qp.connect(&h.endpoint, access_all())?;
    guest.call_ok(&Command::Connect { peer: me.endpoint()? })?;

    // Host -> guest: a send, then an RDMA write into the guest's region.
    let data = pattern(3000, 7);
    me.mr.write(0, &data)?;
    guest.call_ok(&Command::PostRecv { count: 1, offset: 0, len: 4096 })?;
    me.qp.post_send(&[wr::send(1, &[me.mr.sge(0, data.len())?])?.signaled()])?;
    assert_eq!(poll_one(&me.cq, WAIT)?.status, WcStatus::Success);
    let wcs = guest.poll(1, WAIT)?;
    assert_eq!(wcs.len(), 1, "{wcs:?}");
    assert_eq!(guest.read(0, data.len())?, data);
    let more = pattern(5000, 8);
    me.mr.write(8192, &more)?;
    me.qp.post_send(&[
        wr::rdma_write(2, &[me.mr.sge(8192, more.len())?], h.addr + 20_000, h.rkey)?.signaled()
    ])?;
    let wc = poll_one(&me.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::Success));
    assert_eq!(guest.read(20_000, more.len())?, more);

    // Guest -> host: a send and a write.
    me.qp.post_recv(&[wr::recv(3, &[me.mr.sge(30_000, 4096)?])?])?;
    let from_guest = pattern(1000, 9);
    guest.call_ok(&Command::Fill { offset: 40_000, data: from_guest.clone() })?;
    guest.call_ok(&Command::Send { wr_id: 4, offset: 40_000, len: from_guest.len(), imm: Some(77) })?;
    let wc = poll_one(&me.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status, wc.byte_len as usize, wc.imm_data), (3, WcStatus::Success, 1000, 77));
    let mut got = vec![0u8; from_guest.len()];
    me.mr.read(30_000, &mut got)?;
    assert_eq!(got, from_guest);
    guest.call_ok(&Command::Flood {
        remote_addr: me.mr.addr() + 50_000,
        rkey: me.mr.rkey(),
        len: 4096,
        count: 3,
    })?;
    // The flood writes the guest's first 4 KiB: the send it received.
    let mut got = vec![0u8; 4096];
    me.mr.read(50_000, &mut got)?;
    assert_eq!(&got[..data.len()], &data[..]);
    assert_eq!(got, guest.read(0, 4096)?);
    Ok(())
}

/// Whether process `pid` maps the VM's region (its inode) anywhere.
fn bar_mapped(pid: u32, vm: &vrdma::vm::VmAttachment) -> Result<bool> {
    let ino = rustix::fs::fstat(&vm.region)?.st_ino;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    Ok(maps.lines().any(|l| l.split_whitespace().nth(4) == Some(&ino.to_string())))
}

/// A connection to a VM's port speaking raw frames: a guest that sends
/// what the library never would.
struct RawPort {
    conn: std::os::unix::net::UnixStream,
    dec: FrameDecoder,
    /// Why the daemon said the port's session ended, if it did.
    ended: Option<guest::EndReason>,
}

impl RawPort {
    fn connect(vm: &vrdma::vm::VmAttachment) -> Result<RawPort> {
        let conn = std::os::unix::net::UnixStream::connect(&vm.port_socket)?;
        conn.set_read_timeout(Some(Duration::from_millis(100)))?;
        Ok(RawPort { conn, dec: FrameDecoder::new(), ended: None })
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.conn.write_all(bytes)?;
        Ok(())
    }

    fn send(&mut self, f: &Frame) -> Result<()> {
        self.write(&guest::encode(f))
    }

    /// The next frame other than a ping (answered) within `limit`;
    /// `Ok(None)` if the daemon closed the port.
    fn recv(&mut self, limit: Duration) -> Result<Option<Frame>> {
        let end = Instant::now() + limit;
        let mut buf = [0u8; 4096];
        loop {
            match self.dec.next_frame()? {
                Some(Frame::Ping { nonce }) => self.send(&Frame::Pong { nonce })?,
                Some(f) => return Ok(Some(f)),
                None => {}
            }
            if Instant::now() > end {
                bail!("no frame from the daemon within {limit:?}");
            }
            match self.conn.read(&mut buf) {
                Ok(0) => return Ok(None),
                Ok(n) => self.dec.push(&buf[..n]),
                Err(e)
                    if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok(None),
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// A call and its reply (the wake-ups of doorbells that come first,
    /// an rdma_cm call's, are dropped).
    fn call(&mut self, req: Request) -> Result<(Reply, Vec<Handle>)> {
        self.send(&Frame::Call(req))?;
        let mut next = self.recv(WAIT)?;
        if let Some(Frame::Ended { reason }) = next {
            self.ended = Some(reason);
            next = self.recv(WAIT)?;
        }
        while let Some(Frame::Bell { .. }) = next {
            next = self.recv(WAIT)?;
        }
        match next {
            Some(Frame::Reply { reply, handles }) => Ok((reply, handles)),
            other => bail!("expected a reply, got {other:?}"),
        }
    }

    /// Hello on the port, then the control protocol's Hello: a context.
    fn open(&mut self) -> Result<Vec<Handle>> {
        self.send(&Frame::Hello { version: GUEST_VERSION })?;
        let (reply, handles) = self.call(Request::Hello { version: vrdma_core::proto::PROTOCOL_VERSION })?;
        assert!(matches!(reply, Reply::Hello { .. }), "{reply:?}");
        Ok(handles)
    }

    /// Whether the daemon closes the port within `limit` (frames that come
    /// first are dropped).
    fn closed_within(&mut self, limit: Duration) -> Result<bool> {
        let end = Instant::now() + limit;
        while Instant::now() < end {
            match self.recv(end.saturating_duration_since(Instant::now())) {
                Ok(None) => return Ok(true),
                Ok(Some(_)) => {}
                Err(_) => return Ok(false),
            }
        }
        Ok(false)
    }
}

fn errno_of(reply: &Reply) -> Option<i32> {
    match reply {
        Reply::Error { errno, .. } => Some(*errno),
        _ => None,
    }
}

/// A fresh pair of host contexts still moves data: the daemon serves.
fn daemon_serves(d: &DaemonProc) -> Result<()> {
    let a = Side::new(&d.context()?, 4096)?;
    let b = Side::new(&d.context()?, 4096)?;
    vrdma_it::connect(&a, &b)?;
    a.mr.write(0, b"still here")?;
    a.qp.post_send(&[wr::rdma_write(1, &[a.mr.sge(0, 10)?], b.mr.addr(), b.mr.rkey())?.signaled()])?;
    assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::Success);
    let mut got = [0u8; 10];
    b.mr.read(0, &mut got)?;
    assert_eq!(&got, b"still here");
    Ok(())
}

#[test]
fn a_guest_that_breaks_the_frame_stream_is_disconnected_and_the_daemon_serves_on() -> Result<()> {
    let d = daemon_with_vm("")?;
    let vm = vrdma::vm::attach_at(&d.socket, "t")?;
    // A length past the bound, before any body.
    let mut p = RawPort::connect(&vm)?;
    p.open()?;
    p.write(&[0xff, 0xff, 0xff, 0x7f, 2, 0, 0, 0])?;
    assert!(p.closed_within(WAIT)?, "an oversized frame did not end the port");
    // An unknown kind; nonzero reserved bytes; pure garbage.
    for bad in [&[0u8, 0, 0, 0, 200, 0, 0, 0][..], &[8, 0, 0, 0, 6, 1, 2, 3], &[0x5a; 64]] {
        let mut p = RawPort::connect(&vm)?;
        p.write(bad)?;
        assert!(p.closed_within(WAIT)?, "{bad:?} did not end the port");
    }
    // A bad body in a good frame: an error reply, and the port serves on.
    let mut p = RawPort::connect(&vm)?;
    p.open()?;
    p.write(&[4, 0, 0, 0, 2, 0, 0, 0, 0xff, 0xff, 0xff, 0xff])?;
    match p.recv(WAIT)? {
        Some(Frame::Reply { reply, .. }) => assert_eq!(errno_of(&reply), Some(libc::EINVAL), "{reply:?}"),
        other => panic!("a malformed call was answered {other:?}"),
    }
    let (reply, _) = p.call(Request::AllocPd)?;
    assert!(matches!(reply, Reply::Pd { .. }), "{reply:?}");
    // A call before Hello on a fresh port is refused.
    let mut q = RawPort::connect(&vm)?;
    let (reply, _) = q.call(Request::AllocPd)?;
    assert_eq!(errno_of(&reply), Some(libc::EPROTO), "{reply:?}");
    assert!(format!("{reply:?}").contains("send Hello first"), "{reply:?}");
    // Told first that the port has no session (a guest whose VM resumed
    // on this host would adopt its context), once.
    assert_eq!(q.ended.take(), Some(guest::EndReason::NoSession));
    let (reply, _) = q.call(Request::AllocPd)?;
    assert_eq!(errno_of(&reply), Some(libc::EPROTO), "{reply:?}");
    assert_eq!(q.ended, None);
    // A guest's probe (a Pong while it waits for a reply) on a port with
    // no session is told so; on a port with one it is ignored.
    // (On a port of its own: q's is given back once the daemon saw it
    // close.)
    drop(q);
    let end = Instant::now() + WAIT;
    let told = loop {
        let mut r = RawPort::connect(&vm)?;
        // Closed at once while q's port is still counted: again.
        let got = if r.send(&Frame::Pong { nonce: 0 }).is_ok() { r.recv(WAIT)? } else { None };
        match got {
            None if Instant::now() < end => std::thread::sleep(Duration::from_millis(20)),
            told => break told,
        }
    };
    assert_eq!(told, Some(Frame::Ended { reason: guest::EndReason::NoSession }));
    p.send(&Frame::Pong { nonce: 0 })?;
    let (reply, _) = p.call(Request::AllocPd)?;
    assert!(matches!(reply, Reply::Pd { .. }), "{reply:?}");
    assert_eq!(p.ended, None);
    // VmAttach from a guest is refused; the host-only direct path is off.
    let (reply, _) = p.call(Request::VmAttach { name: "t".into() })?;
    assert_eq!(errno_of(&reply), Some(libc::EPERM), "{reply:?}");
    daemon_serves(&d)?;
    Ok(())
}

#[test]
fn a_guest_registers_only_inside_its_own_extents() -> Result<()> {
    let d = daemon_with_vm("")?;
    let vm = vrdma::vm::attach_at(&d.socket, "t")?;
    let mut p = RawPort::connect(&vm)?;
    let handles = p.open()?;
    let ring = match handles.first() {
        Some(Handle::Extent { offset, .. }) => *offset,
        other => panic!("the context segment came as {other:?}"),
    };
    let pd = match p.call(Request::AllocPd)?.0 {
        Reply::Pd { pd } => pd,
        other => panic!("{other:?}"),
    };
    let (offset, len) = match p.call(Request::GuestAlloc { len: 8192 })?.0 {
        Reply::GuestExtent { offset, len } => (offset, len),
        other => panic!("{other:?}"),
    };
    assert!(offset + len <= vm.region_len);
    let access = vrdma::AccessFlags::LOCAL_WRITE | vrdma::AccessFlags::REMOTE_WRITE;
    let reg = |fd_offset: u64, len: u64| Request::RegMr { pd, addr: 0x1000, len, access, fd_offset };
    for (what, req) in [
        ("past its extent", reg(offset + 4096, 8192)),
        ("on its context's ring", reg(ring, 64)),
        ("outside the region", reg(vm.region_len + 4096, 4096)),
        ("wrapping around", reg(u64::MAX - 10, 100)),
        ("in free space", reg(vm.region_len - 4096, 4096)),
    ] {
        let (reply, _) = p.call(req)?;
        assert_eq!(errno_of(&reply), Some(libc::EINVAL), "a registration {what}: {reply:?}");
    }
    let key = match p.call(reg(offset + 100, 5000))?.0 {
        Reply::Mr { key } => key,
        other => panic!("a registration inside the extent: {other:?}"),
    };
    // Another session of the same VM cannot register in this one's extent.
    let mut q = RawPort::connect(&vm)?;
    q.open()?;
    let qpd = match q.call(Request::AllocPd)?.0 {
        Reply::Pd { pd } => pd,
        other => panic!("{other:?}"),
    };
    let (reply, _) = q.call(Request::RegMr { pd: qpd, addr: 0, len: 4096, access, fd_offset: offset })?;
    assert_eq!(errno_of(&reply), Some(libc::EINVAL), "{reply:?}");
    // The extent is not given back while a region lies on it, nor one
    // that is not the session's.
    assert_eq!(errno_of(&p.call(Request::GuestFree { offset })?.0), Some(libc::EBUSY));
    assert_eq!(errno_of(&q.call(Request::GuestFree { offset })?.0), Some(libc::EINVAL));
    assert_eq!(errno_of(&p.call(Request::GuestFree { offset: 12345 })?.0), Some(libc::EINVAL));
    assert_eq!(p.call(Request::DeregMr { key })?.0, Reply::Done);
    assert_eq!(p.call(Request::GuestFree { offset })?.0, Reply::Done);
    // A request larger than the region is refused.
    assert_eq!(errno_of(&p.call(Request::GuestAlloc { len: vm.region_len + 1 })?.0), Some(libc::ENOMEM));
    daemon_serves(&d)?;
    Ok(())
}

/// `RegMrPieces` from a guest: each piece must lie in a memory extent of
/// the session, the pieces must not overlap and must be at most 64; a
/// region of pieces in two extents holds both until it goes.
#[test]
fn a_guests_region_of_pieces_lies_only_in_its_own_extents() -> Result<()> {
    use vrdma_core::proto::MrPiece;
    let d = daemon_with_vm("")?;
    let vm = vrdma::vm::attach_at(&d.socket, "t")?;
    let mut p = RawPort::connect(&vm)?;
    let handles = p.open()?;
    let ring = match handles.first() {
        Some(Handle::Extent { offset, .. }) => *offset,
        other => panic!("the context segment came as {other:?}"),
    };
    let pd = match p.call(Request::AllocPd)?.0 {
        Reply::Pd { pd } => pd,
        other => panic!("{other:?}"),
    };
    let mut extent = || match p.call(Request::GuestAlloc { len: 8192 }) {
        Ok((Reply::GuestExtent { offset, .. }, _)) => Ok(offset),
        other => bail!("{other:?}"),
    };
    let (x, y) = (extent()?, extent()?);
    let access = vrdma::AccessFlags::LOCAL_WRITE | vrdma::AccessFlags::REMOTE_WRITE;
    let piece = |fd_offset: u64, len: u64| MrPiece { fd_offset, len };
    let reg = |pieces: Vec<MrPiece>| Request::RegMrPieces {
        pd,
        addr: 0x1000,
        len: pieces.iter().map(|q| q.len).sum(),
        access,
        pieces,
    };
    for (what, req) in [
        ("past its extent", reg(vec![piece(x, 4096), piece(x + 8192, 4096)])),
        ("on its context's ring", reg(vec![piece(x, 4096), piece(ring, 64)])),
        ("in free space", reg(vec![piece(x, 4096), piece(vm.region_len - 4096, 64)])),
        ("outside the region", reg(vec![piece(x, 4096), piece(vm.region_len + 4096, 64)])),
        ("overlapping", reg(vec![piece(x, 8192), piece(x + 4096, 64)])),
        ("65 pieces", reg((0..65).map(|i| piece(x + (i % 2) * 4096, 4096)).collect())),
    ] {
        let (reply, _) = p.call(req)?;
        assert_eq!(errno_of(&reply), Some(libc::EINVAL), "a region of pieces {what}: {reply:?}");
    }
    let key = match p.call(reg(vec![piece(y + 100, 4096 - 100), piece(x, 5000)]))?.0 {
        Reply::Mr { key } => key,
        other => panic!("a region of pieces in two extents: {other:?}"),
    };
    for offset in [x, y] {
        assert_eq!(errno_of(&p.call(Request::GuestFree { offset })?.0), Some(libc::EBUSY), "{offset}");
    }
    assert_eq!(p.call(Request::DeregMr { key })?.0, Reply::Done);
    assert_eq!(p.call(Request::GuestFree { offset: x })?.0, Reply::Done);
    assert_eq!(p.call(Request::GuestFree { offset: y })?.0, Reply::Done);
    daemon_serves(&d)?;
    Ok(())
}

#[test]
fn a_silent_guest_session_is_torn_down_after_dead_ms() -> Result<()> {
    // dead_ms well above a stall of this test's thread on a loaded
    // machine (600 ms was met once in 40 runs: "unexpected Close").
    let d = daemon_with_vm("ping_ms = 100\ndead_ms = 1000")?;
    let vm = vrdma::vm::attach_at(&d.socket, "t")?;
    let mut p = RawPort::connect(&vm)?;
    p.send(&Frame::Hello { version: GUEST_VERSION })?;
    p.send(&Frame::Call(Request::Hello { version: vrdma_core::proto::PROTOCOL_VERSION }))?;
    // Read, but answer no ping.
    let start = Instant::now();
    let mut pings = 0;
    let mut closes = Vec::new();
    let mut buf = [0u8; 4096];
    while start.elapsed() < WAIT && closes.len() < 2 {
        match p.conn.read(&mut buf) {
            Ok(0) => bail!("the daemon closed the port instead of ending the session"),
            Ok(n) => p.dec.push(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(e) => return Err(e.into()),
        }
        while let Some(f) = p.dec.next_frame()? {
            match f {
                Frame::Ping { .. } => pings += 1,
                Frame::Close { id } => closes.push(id),
                Frame::Reply { .. } => {}
                other => bail!("unexpected {other:?}"),
            }
        }
    }
    // Its proxies (the doorbell and the async-event fd) were closed.
    assert_eq!(closes.len(), 2, "after {:?}, {pings} pings", start.elapsed());
    assert!(pings >= 2, "{pings} pings before the teardown");
    assert!(start.elapsed() >= Duration::from_millis(1000), "torn down after {:?}", start.elapsed());
    // The port stays, the session is gone (for good: no reason given,
    // then or now); a new Hello opens another.
    let (reply, _) = p.call(Request::AllocPd)?;
    assert_eq!(errno_of(&reply), Some(libc::EPROTO), "{reply:?}");
    // Saying why, not that no Hello came.
    assert!(format!("{reply:?}").contains("nothing came from the guest"), "{reply:?}");
    assert_eq!(p.ended, None);
    p.open()?;
    // A session that answers its pings stays past dead_ms.
    let end = Instant::now() + Duration::from_millis(2200);
    while Instant::now() < end {
        match p.recv(Duration::from_millis(100)) {
            Ok(Some(f)) => bail!("unexpected {f:?}"),
            Ok(None) => bail!("the daemon closed the port"),
            Err(_) => {} // nothing but pings, answered
        }
    }
    let (reply, _) = p.call(Request::AllocPd)?;
    assert!(matches!(reply, Reply::Pd { .. }), "{reply:?}");
    Ok(())
}

/// The emulated guest dies mid-transfer (its port connection closes, as
/// when QEMU dies): its session is torn down like a killed host process's
/// context, so the host peer's QP goes to the error state with its
/// receives flushed, and the daemon serves on.
#[test]
fn killing_an_emulated_guest_mid_flood_breaks_its_host_peer() -> Result<()> {
    const LEN: usize = 1 << 20;
    let d = daemon_with_vm("")?;
    let vm = vrdma::vm::attach_at(&d.socket, "t")?;
    let ctx = d.context()?;
    let me = Side::with(&ctx, LEN, 64, vrdma_it::cap(16, 1), None)?;
    let mut guest = PeerProc::spawn_guest(&vm, "tenant", &["--mr-len", "1048576"])?;
    let h = guest.hello()?;
    me.qp.connect(&h.endpoint, access_all())?;
    guest.call_ok(&Command::Connect { peer: me.endpoint()? })?;
    let mark = pattern(4096, 5);
    guest.call_ok(&Command::Fill { offset: 0, data: mark.clone() })?;
    let recvs: Vec<_> =
        (0..4).map(|i| wr::recv(100 + i, &[me.mr.sge(0, 64)?])).collect::<Result<_, vrdma::Error>>()?;
    me.qp.post_recv(&recvs)?;
    guest.send(&Command::Flood {
        remote_addr: me.mr.addr(),
        rkey: me.mr.rkey(),
        len: LEN,
        count: 1 << 40,
    })?;
    match guest.recv::<Said>(vrdma_it::PEER_TIMEOUT)? {
        Said::Flooding => {}
        other => bail!("the guest answered {other:?} to Flood"),
    }
    vrdma_it::wait_until(WAIT, "the flood reaching our region", || {
        let mut b = vec![0u8; mark.len()];
        me.mr.read(0, &mut b).is_ok() && b == mark
    })?;
    guest.proc.kill(libc::SIGKILL);
    guest.proc.wait_timeout(WAIT)?;
    vrdma_it::wait_state(&me.qp, vrdma::QpState::Err, WAIT)?;
    let ev = vrdma_it::async_event(&ctx, WAIT)?;
    assert_eq!(ev, vrdma::AsyncEvent { event_type: vrdma::AsyncEventType::QpFatal, element: me.qp.qpn() });
    let wcs = vrdma_it::poll_n(&me.cq, 4, WAIT)?;
    for (i, wc) in wcs.iter().enumerate() {
        assert_eq!(
            (wc.wr_id, wc.status, wc.opcode),
            (100 + i as u64, WcStatus::WrFlushErr, vrdma::WcOpcode::Recv)
        );
    }
    daemon_serves(&d)?;
    // The VM's port is free again: another guest opens a context.
    let mut again = PeerProc::spawn_guest(&vm, "tenant", &["--mr-len", "4096"])?;
    assert_eq!(again.hello()?.tenant, ctx.tenant());
    again.proc.kill(libc::SIGKILL);
    Ok(())
}

/// Guest contexts opened and dropped one after another give their ports
/// back: more of them than the VM has ports, in this process.
#[test]
fn dropped_guest_contexts_give_their_ports_back() -> Result<()> {
    use std::os::fd::AsRawFd;
    let d = daemon_with_vm("")?;
    let vm = vrdma::vm::attach_at(&d.socket, "t")?;
    let cfg = vrdma::guest::GuestConfig {
        ports: vec![vm.port_socket.clone()],
        bar: format!("/proc/self/fd/{}", vm.region.as_raw_fd()).into(),
    };
    for round in 0..2 * vm.ports {
        let end = Instant::now() + WAIT;
        // The daemon frees the port once it saw it close: a moment.
        let ctx = loop {
            match vrdma::Context::open_guest(&cfg) {
                Ok(c) => break c,
                Err(e) if Instant::now() > end => bail!("round {round}: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        };
        assert!(ctx.is_guest());
        let pd = ctx.alloc_pd()?;
        let mr = pd.alloc_mr(4096, access_all())?;
        mr.write(0, b"guest")?;
        let mut got = [0u8; 5];
        mr.read(0, &mut got)?;
        assert_eq!(&got, b"guest");
    }
    Ok(())
}

/// A guest that makes and destroys completion channels, over and over,
/// holds no descriptor in the daemon for those it destroyed: each one's
/// doorbell proxy closes with it (the guest is told, so its library
/// closes its end too). They stayed open until the session ended, one
/// per channel ever destroyed: a guest looping on it ran the daemon out
/// of descriptors, for every tenant.
#[test]
fn a_destroyed_completion_channels_doorbell_closes_with_it() -> Result<()> {
    const ROUNDS: usize = 64;
    let d = daemon_with_vm("")?;
    let open_fds = || std::fs::read_dir(format!("/proc/{}/fd", d.proc.pid())).map(|r| r.count());
    let vm = vrdma::vm::attach_at(&d.socket, "t")?;
    let mut p = RawPort::connect(&vm)?;
    p.open()?;
    let before = open_fds()?;
    // Unnumbered calls, and numbered ones as the guest's library sends.
    let mut number = 0;
    let mut call = |p: &mut RawPort, round: usize, req: Request| -> Result<(Reply, Vec<Handle>)> {
        if round.is_multiple_of(2) {
            return p.call(req);
        }
        number += 1;
        p.send(&Frame::NumberedCall { number, req })?;
        match p.recv(WAIT)? {
            Some(Frame::Reply { reply, handles }) => Ok((reply, handles)),
            other => bail!("expected a reply, got {other:?}"),
        }
    };
    for round in 0..ROUNDS {
        let (reply, handles) = call(&mut p, round, Request::CreateCompChannel)?;
        let Reply::CompChannel { channel, .. } = reply else { bail!("round {round}: {reply:?}") };
        let bell = match handles.as_slice() {
            [.., Handle::Bell { id, .. }] => *id,
            other => bail!("round {round}: the channel came with {other:?}"),
        };
        let (reply, _) = call(&mut p, round, Request::DestroyCompChannel { channel })?;
        assert_eq!(reply, Reply::Done, "round {round}");
        match p.recv(WAIT)? {
            Some(Frame::Close { id }) => assert_eq!(id, bell, "round {round}"),
            other => bail!("round {round}: expected the doorbell's close, got {other:?}"),
        }
    }
    // A channel still in use keeps its doorbell; a failed destroy too.
    let (reply, _) = p.call(Request::CreateCompChannel)?;
    let Reply::CompChannel { channel, .. } = reply else { bail!("{reply:?}") };
    let cq = match p.call(Request::CreateCq { cqe: 4, channel: Some(channel) })?.0 {
        Reply::Cq { cq, .. } => cq,
        other => bail!("{other:?}"),
    };
    let (reply, _) = p.call(Request::DestroyCompChannel { channel })?;
    assert_eq!(errno_of(&reply), Some(libc::EBUSY), "{reply:?}");
    assert_eq!(p.call(Request::DestroyCq { cq })?.0, Reply::Done);
    let after = open_fds()?;
    assert!(
        after < before + ROUNDS / 4,
        "the daemon holds {after} descriptors, {before} before {ROUNDS} channels"
    );
    assert_eq!(p.call(Request::DestroyCompChannel { channel })?.0, Reply::Done);
    assert!(matches!(p.recv(WAIT)?, Some(Frame::Close { .. })));
    daemon_serves(&d)?;
    Ok(())
}

/// The drop-in `librdmacm.so.1` holds a context of its own beside the
/// program's `libibverbs.so.1`: an rdma_cm id of one and a QP of the
/// other are joined in one call when both contexts are of one origin, a
/// host process or a VM (whose guest processes the daemon cannot tell
/// apart: they share its ports and its region). A guest's was refused
/// (its contexts had no pid), so the drop-in's `rdma_create_qp` in a
/// guest fell back to two calls.
#[test]
fn an_id_and_a_qp_of_two_contexts_of_one_origin_are_joined() -> Result<()> {
    let d = daemon_with_vm("")?;
    let vm = vrdma::vm::attach_at(&d.socket, "t")?;
    let peers = [
        ("guest", PeerProc::spawn_guest(&vm, "tenant", &[])?),
        ("host", PeerProc::spawn(&d.socket, "tenant", &[])?),
    ];
    for (what, mut peer) in peers {
        peer.hello()?;
        match peer.call(&Command::AttachAcrossContexts)? {
            Said::State(s) => {
                assert_eq!(s, vrdma::QpState::Init.raw(), "{what}: the QP is the id's, in INIT")
            }
            other => bail!("{what}: {other:?}"),
        }
    }
    Ok(())
}

/// Forks this process (a guest-mode library in it) and runs `child` in
/// the child, which leaves with `_exit` of its result; the child's exit
/// status, or why there is none.
fn in_forked_child(child: impl FnOnce() -> i32) -> Result<i32> {
    // SAFETY: the child only reads and writes memory of this test and
    // leaves with _exit or exec (no heap, no lock: the test harness's
    // other threads are not in it); the library's fork handler runs first.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        bail!("fork: {}", std::io::Error::last_os_error());
    }
    if pid == 0 {
        let code = child();
        // SAFETY: ends the child at once.
        unsafe { libc::_exit(code) };
    }
    let end = Instant::now() + WAIT;
    let mut status = 0;
    loop {
        // SAFETY: our child; WNOHANG, bounded by `end`.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            break;
        }
        if Instant::now() > end {
            // SAFETY: our child, not reaped yet.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            // SAFETY: as above.
            unsafe { libc::waitpid(pid, &mut status, 0) };
            bail!("the forked child did not end within {WAIT:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    if !libc::WIFEXITED(status) {
        bail!("the forked child died: status {status:#x}");
    }
    Ok(libc::WEXITSTATUS(status))
}

/// `fork` in a guest, with rdma-core's semantics (as for host processes,
/// `crates/vrdma/src/rebacking/fork.rs`): registered memory re-backed by
/// the VM's region is copied for the child, whose writes reach neither
/// the parent's pages nor the device; a child that execs leaves nothing
/// behind; the parent's region and QP work on after both; memory the
/// library allocated in the region (`alloc_mr`) stays shared, as on a
/// host. (Before the child copied the BAR's mappings its writes landed in
/// the parent's registered buffer; later it copied every mapping of the
/// BAR, the `alloc_mr` memory and the rings too.)
#[test]
fn a_forked_guest_child_gets_copies_and_the_parent_works_on() -> Result<()> {
    use std::os::fd::AsRawFd;
    let d = daemon_with_vm("")?;
    let vm = vrdma::vm::attach_at(&d.socket, "t")?;
    let cfg = vrdma::guest::GuestConfig {
        ports: vec![vm.port_socket.clone()],
        bar: format!("/proc/self/fd/{}", vm.region.as_raw_fd()).into(),
    };
    let gctx = vrdma::Context::open_guest(&cfg)?;
    let host = d.context()?;
    let me = Side::new(&host, 1 << 16)?;

    // The application's own pages, registered: re-backed by an extent.
    const LEN: usize = 4 * 4096;
    let buf = vrdma_it::anon_pages(LEN);
    let first = pattern(LEN, 21);
    // SAFETY: `buf` holds LEN bytes, ours.
    unsafe { std::ptr::copy_nonoverlapping(first.as_ptr(), buf, LEN) };
    let pd = gctx.alloc_pd()?;
    // SAFETY: the mapping lives until the end of this test, after the
    // region; it is read and written through the region or raw pointers.
    let mr = unsafe { pd.register_raw(buf, LEN, access_all()) }?;
    assert!(bar_mapped(std::process::id(), &vm)?, "the registered pages are not in the VM's region");
    // Pages a larger registration grew a span over, still mapped from the
    // region after that registration went (a smaller one lives on over
    // the first page): copied for the child too.
    const GROWN: usize = 16 * 4096;
    let grown = vrdma_it::anon_pages(GROWN);
    // SAFETY: `grown` holds GROWN bytes, ours.
    unsafe { std::ptr::write_bytes(grown, 0x5a, GROWN) };
    // SAFETY: the mapping lives until the end of this test.
    let small = unsafe { pd.register_raw(grown, 4096, access_all()) }?;
    // SAFETY: as above.
    drop(unsafe { pd.register_raw(grown, GROWN, access_all()) }?);
    // And memory the library allocated in the region (`alloc_mr`).
    let amr = pd.alloc_mr(4096, access_all())?;
    amr.write(0, &first[..4096])?;
    let cq = gctx.create_cq(64, None)?;
    let qp = pd.create_rc_qp(&cq, &cq, vrdma_it::cap(16, 1))?;
    qp.connect(&me.endpoint()?, access_all())?;
    me.qp.connect(&qp.endpoint(&gctx)?, access_all())?;

    // A child that reads the parent's bytes (its copy) and overwrites
    // them all, and the `alloc_mr` region (shared), then leaves.
    let addr = buf as usize;
    let aaddr = amr.addr() as usize;
    let gaddr = grown as usize;
    let expected = first.as_slice();
    let code = in_forked_child(move || {
        let p = addr as *mut u8;
        // SAFETY: the child's copy of the mapping, LEN bytes (`expected`
        // is read only: no allocation in the child).
        let same = (0..LEN).all(|i| unsafe { p.add(i).read_volatile() } == expected[i]);
        if !same {
            return 2;
        }
        // SAFETY: as above.
        unsafe { std::ptr::write_bytes(p, 0xee, LEN) };
        // SAFETY: the `alloc_mr` mapping, shared with the parent, 4096
        // bytes that the parent reads only after this child exited.
        unsafe { std::ptr::write_bytes(aaddr as *mut u8, 0xee, 4096) };
        // SAFETY: the child's copy of the grown span's pages.
        unsafe { std::ptr::write_bytes(gaddr as *mut u8, 0xee, GROWN) };
        0
    })?;
    assert_eq!(code, 0, "the child did not see the parent's bytes (2) or failed");
    let mut got = vec![0u8; LEN];
    mr.read(0, &mut got)?;
    let changed = got.iter().zip(&first).filter(|(a, b)| a != b).count();
    assert_eq!(changed, 0, "the forked child wrote {changed} bytes of the parent's registered memory");
    // SAFETY: `grown` holds GROWN bytes; the child has exited.
    let g = unsafe { std::slice::from_raw_parts(grown, GROWN) };
    let changed = g.iter().filter(|&&b| b != 0x5a).count();
    assert_eq!(
        changed, 0,
        "the child wrote {changed} bytes of pages a span reaches past its live registration"
    );
    drop(small);
    // The library's own memory in the region (`alloc_mr`, and the rings)
    // stays shared, as a host child shares the memfds it is made of: the
    // fork copies only the re-backed pages.
    let mut got = vec![0u8; 4096];
    amr.read(0, &mut got)?;
    assert!(
        got.iter().all(|&b| b == 0xee),
        "the child's writes to an alloc_mr region were not shared, as on a host"
    );

    // A child that execs: nothing of it stays.
    let code = in_forked_child(|| {
        let prog = c"/bin/true";
        let argv = [prog.as_ptr(), std::ptr::null()];
        // SAFETY: a NUL-terminated path and argv; on failure the child
        // leaves with 127.
        unsafe { libc::execv(prog.as_ptr(), argv.as_ptr()) };
        127
    })?;
    assert_eq!(code, 0, "the exec'd child");

    // The parent's QP and region work on: the host writes into the
    // guest's pages, and the guest sends from them.
    let more = pattern(5000, 22);
    me.mr.write(0, &more)?;
    me.qp.post_send(&[
        wr::rdma_write(1, &[me.mr.sge(0, more.len())?], mr.addr() + 100, mr.rkey())?.signaled()
    ])?;
    let wc = poll_one(&me.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::Success));
    // SAFETY: the registered mapping, LEN bytes; the write completed.
    let seen = unsafe { std::slice::from_raw_parts(buf.add(100), more.len()) }.to_vec();
    assert_eq!(seen, more, "the host's RDMA write after the forks");
    me.qp.post_recv(&[wr::recv(2, &[me.mr.sge(8192, 4096)?])?])?;
    qp.post_send(&[wr::send(3, &[mr.sge(100, 3000)?])?.signaled()])?;
    assert_eq!(poll_one(&cq, WAIT)?.status, WcStatus::Success);
    let wc = poll_one(&me.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status, wc.byte_len), (2, WcStatus::Success, 3000));
    let mut back = vec![0u8; 3000];
    me.mr.read(8192, &mut back)?;
    assert_eq!(back, more[..3000]);
    drop((qp, cq, mr, amr, pd));
    // SAFETY: the mapping made above; its region is gone.
    unsafe { libc::munmap(buf.cast(), LEN) };
    Ok(())
}

/// Whether `[addr, addr + len)` of this process is all mapped shared from
/// the file with inode `ino` (the VM's region).
fn mapped_from(addr: usize, len: usize, ino: u64) -> Result<bool> {
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    let mut at = addr;
    for line in maps.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (Some(range), Some(perms), Some(inode)) = (f.first(), f.get(1), f.get(4)) else { continue };
        let Some((s, e)) = range.split_once('-') else { continue };
        let (s, e) = (usize::from_str_radix(s, 16)?, usize::from_str_radix(e, 16)?);
        if s <= at && at < e {
            if !perms.ends_with('s') || inode.parse::<u64>()? != ino {
                return Ok(false);
            }
            at = e;
            if at >= addr + len {
                return Ok(true);
            }
        }
    }
    Ok(false)
}

/// Two buffers sharing a page, each registered on its own through a guest
/// context (two heap allocations, the common case): the second starts in
/// the first one's page and ends two pages on, so the span's extent of
/// the VM's region grows in place (`Request::GuestGrow`), though the
/// context's rings were allocated between the two registrations. Bytes
/// written through the application's pointers into both reach the host by
/// a send and an RDMA write, and the host's RDMA writes into both (the new
/// pages too) are seen through the pointers. A registration whose growth
/// cannot fit the region is refused with a clear error, the first region
/// of that span working on. When the regions go the pages stay in the
/// region, and when the context closes they are private again with their
/// bytes. (Before, the second registration was refused:
/// in a guest a span did not grow.)
#[test]
fn a_guest_registration_that_begins_in_a_registered_page_grows_its_span() -> Result<()> {
    use std::os::fd::AsRawFd;
    let d = daemon_with_vm("")?;
    let vm = vrdma::vm::attach_at(&d.socket, "t")?;
    let ino = rustix::fs::fstat(&vm.region)?.st_ino;
    let cfg = vrdma::guest::GuestConfig {
        ports: vec![vm.port_socket.clone()],
        bar: format!("/proc/self/fd/{}", vm.region.as_raw_fd()).into(),
    };
    let gctx = vrdma::Context::open_guest(&cfg)?;
    let host = d.context()?;
    let me = Side::new(&host, 1 << 16)?;
    let page = 4096;
    let map = |len: usize| {
        // SAFETY: a fresh private anonymous mapping, checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        p.cast::<u8>()
    };
    const LEN: usize = 4 * 4096;
    let buf = map(LEN);
    let first = pattern(LEN, 31);
    // SAFETY: `buf` holds LEN bytes, ours.
    unsafe { std::ptr::copy_nonoverlapping(first.as_ptr(), buf, LEN) };
    let (a_off, a_len, b_off, b_len) = (100, 1000, 3000, 6000);
    let pd = gctx.alloc_pd()?;
    // SAFETY: the mapping lives until the end of this test, after the
    // regions; it is read and written through raw pointers and the regions.
    let mr_a = unsafe { pd.register_raw(buf.add(a_off), a_len, access_all()) }?;
    assert!(mapped_from(buf as usize, page, ino)?, "the first page is not in the VM's region");
    // Rings allocated between the two registrations.
    let cq = gctx.create_cq(64, None)?;
    let qp = pd.create_rc_qp(&cq, &cq, vrdma_it::cap(16, 1))?;
    // SAFETY: as above.
    let mr_b = unsafe { pd.register_raw(buf.add(b_off), b_len, access_all()) }?;
    assert!(mapped_from(buf as usize, 3 * page, ino)?, "the grown span's pages are not all in the region");
    assert!(!mapped_from(buf as usize + 3 * page, page, ino)?, "the fourth page was not registered");
    // SAFETY: inside the mapping.
    let kept = unsafe { std::slice::from_raw_parts(buf, LEN) }.to_vec();
    assert_eq!(kept, first, "re-backing changed the application's bytes");
    qp.connect(&me.endpoint()?, access_all())?;
    me.qp.connect(&qp.endpoint(&gctx)?, access_all())?;

    // Through the application's pointers, into both buffers.
    let (x, y) = (pattern(a_len, 32), pattern(b_len, 33));
    // SAFETY: both inside the mapping.
    unsafe {
        std::ptr::copy_nonoverlapping(x.as_ptr(), buf.add(a_off), a_len);
        std::ptr::copy_nonoverlapping(y.as_ptr(), buf.add(b_off), b_len);
    }
    // A send from the first, an RDMA write from the second: the daemon's
    // copies read what the pointers wrote.
    me.qp.post_recv(&[wr::recv(1, &[me.mr.sge(0, 4096)?])?])?;
    qp.post_send(&[wr::send(2, &[mr_a.sge(0, a_len)?])?.signaled()])?;
    assert_eq!(poll_one(&cq, WAIT)?.status, WcStatus::Success);
    let wc = poll_one(&me.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status, wc.byte_len as usize), (1, WcStatus::Success, a_len));
    let mut got = vec![0u8; a_len];
    me.mr.read(0, &mut got)?;
    assert_eq!(got, x, "the send from the first buffer");
    qp.post_send(
        &[wr::rdma_write(3, &[mr_b.sge(0, b_len)?], me.mr.addr() + 8192, me.mr.rkey())?.signaled()],
    )?;
    let wc = poll_one(&cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (3, WcStatus::Success));
    let mut got = vec![0u8; b_len];
    me.mr.read(8192, &mut got)?;
    assert_eq!(got, y, "the RDMA write from the second buffer (its new pages too)");

    // The host writes into both; the pointers see it.
    let (z, w) = (pattern(4000, 34), pattern(500, 35));
    me.mr.write(20_000, &z)?;
    me.mr.write(30_000, &w)?;
    me.qp.post_send(&[
        wr::rdma_write(4, &[me.mr.sge(20_000, z.len())?], mr_b.addr() + 2000, mr_b.rkey())?,
        wr::rdma_write(5, &[me.mr.sge(30_000, w.len())?], mr_a.addr() + 200, mr_a.rkey())?.signaled(),
    ])?;
    let wc = poll_one(&me.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (5, WcStatus::Success));
    // SAFETY: inside the mapping; the writes completed.
    let seen = |off: usize, n: usize| unsafe { std::slice::from_raw_parts(buf.add(off), n) }.to_vec();
    assert_eq!(seen(b_off + 2000, z.len()), z, "the host's write into the grown pages");
    assert_eq!(seen(a_off + 200, w.len()), w, "the host's write into the first buffer");

    // A growth the region cannot hold (a span in another mapping, then a
    // range from inside it to 9 MiB on, in an 8 MiB region): refused, and
    // that span's region works on.
    let big_len = 10 << 20;
    let big = map(big_len);
    // SAFETY: inside the `big` mapping, which lives until the end of this test.
    let mr_c = unsafe { pd.register_raw(big.add(16), 64, access_all()) }?;
    // SAFETY: as above; refused before anything is remapped.
    let e = unsafe { pd.register_raw(big.add(32), 9 << 20, access_all()) }.unwrap_err();
    assert_eq!(e.errno(), libc::ENOMEM, "{e}");
    let msg = e.to_string();
    assert!(msg.contains("cannot grow") && msg.contains("past the region's end"), "{msg}");
    assert!(!mapped_from(big as usize + page, page, ino)?, "a refused growth remapped pages");
    me.qp.post_recv(&[wr::recv(6, &[me.mr.sge(40_000, 4096)?])?])?;
    // SAFETY: inside the `big` mapping.
    unsafe { std::ptr::write_bytes(big.add(16), 0x5a, 64) };
    qp.post_send(&[wr::send(7, &[mr_c.sge(0, 64)?])?.signaled()])?;
    assert_eq!(poll_one(&cq, WAIT)?.status, WcStatus::Success);
    assert_eq!(poll_one(&me.cq, WAIT)?.byte_len, 64);
    let mut got = vec![0u8; 64];
    me.mr.read(40_000, &mut got)?;
    assert!(got.iter().all(|&b| b == 0x5a), "{got:?}");

    // The first region goes, then the second: only then are the pages
    // private again, with their bytes.
    // SAFETY: inside the mapping.
    let before = unsafe { std::slice::from_raw_parts(buf, LEN) }.to_vec();
    drop(mr_a);
    assert!(mapped_from(buf as usize, 3 * page, ino)?, "the second region still needs the span");
    drop((qp, cq, mr_b, mr_c, pd));
    // Deregistered, the pages stay in the region while the context is
    // open (moving them back cannot be fenced in a guest); they move as
    // it closes, before its session's end frees the extent.
    assert!(mapped_from(buf as usize, 3 * page, ino)?, "the context's deregistered pages left the region");
    assert_eq!(seen(0, LEN), before);
    drop(gctx);
    assert!(!mapped_from(buf as usize, page, ino)?, "the pages stayed in the region");
    assert!(!mapped_from(buf as usize + 2 * page, page, ino)?, "the grown pages stayed in the region");
    assert_eq!(seen(0, LEN), before, "the pages lost bytes going back to private memory");
    // SAFETY: the mappings made above; their regions are gone.
    unsafe {
        libc::munmap(buf.cast(), LEN);
        libc::munmap(big.cast(), big_len);
    }
    Ok(())
}

/// The host side's RDMA write of `n` bytes at `off` of the guest's `mr`
/// lands in the application's bytes there, and its RDMA read from there
/// returns what the application wrote after.
fn through_guest_mr(me: &Side, mr: &vrdma::MemoryRegion, off: usize, n: usize, seed: u64) -> Result<()> {
    let data = pattern(n, seed);
    me.mr.write(0, &data)?;
    let w = wr::rdma_write(seed, &[me.mr.sge(0, n)?], mr.addr() + off as u64, mr.rkey())?.signaled();
    me.qp.post_send(&[w])?;
    let wc = poll_one(&me.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (seed, WcStatus::Success), "the write through the region");
    // SAFETY: inside the region's memory, which the test owns.
    let seen = unsafe { std::slice::from_raw_parts(mr.as_ptr().add(off), n) }.to_vec();
    assert!(seen == data, "the write at {off} of {n} bytes did not land in the application's bytes");
    let back = pattern(n, seed + 1000);
    // SAFETY: as above.
    unsafe { std::ptr::copy_nonoverlapping(back.as_ptr(), mr.as_ptr().add(off), n) };
    let r = wr::rdma_read(seed, &[me.mr.sge(8192, n)?], mr.addr() + off as u64, mr.rkey())?.signaled();
    me.qp.post_send(&[r])?;
    let wc = poll_one(&me.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (seed, WcStatus::Success), "the read through the region");
    let mut got = vec![0u8; n];
    me.mr.read(8192, &mut got)?;
    assert!(got == back, "the read at {off} of {n} bytes did not return the application's bytes");
    Ok(())
}

/// From an emulated guest, registrations over pages registered before
/// (rping's buffers; a guest's `rping -c` failed `start_buf reg_mr
/// failed`): (a) a range beginning before a registered span and ending
/// inside it, (b) one covering two spans and the gap between them, (c)
/// one covering a span with pages on both sides. Each is made of pieces
/// of the VM's region (the spans' extents, a new extent for each gap):
/// the host's RDMA writes and reads through each land in the
/// application's bytes at the right offsets, the earlier regions keep
/// working, the bytes survive, the regions go in any order, and the pages
/// go back to private memory with their bytes when the context closes.
/// (Before, (a)-(c) were refused with EINVAL.)
#[test]
fn guest_registrations_before_and_over_registered_spans_are_made_of_pieces() -> Result<()> {
    use std::os::fd::AsRawFd;
    let d = daemon_with_vm("")?;
    let vm = vrdma::vm::attach_at(&d.socket, "t")?;
    let ino = rustix::fs::fstat(&vm.region)?.st_ino;
    let cfg = vrdma::guest::GuestConfig {
        ports: vec![vm.port_socket.clone()],
        bar: format!("/proc/self/fd/{}", vm.region.as_raw_fd()).into(),
    };
    let gctx = vrdma::Context::open_guest(&cfg)?;
    let host = d.context()?;
    let me = Side::new(&host, 1 << 16)?;
    let page = 4096;
    const PAGES: usize = 10;
    const LEN: usize = PAGES * 4096;
    let buf = vrdma_it::anon_pages(LEN);
    let orig = pattern(LEN, 41);
    // SAFETY: `buf` holds LEN bytes, ours.
    unsafe { std::ptr::copy_nonoverlapping(orig.as_ptr(), buf, LEN) };
    // SAFETY: inside the mapping.
    let seen = || unsafe { std::slice::from_raw_parts(buf, LEN) }.to_vec();
    let pd = gctx.alloc_pd()?;
    let cq = gctx.create_cq(64, None)?;
    let qp = pd.create_rc_qp(&cq, &cq, vrdma_it::cap(16, 1))?;
    qp.connect(&me.endpoint()?, access_all())?;
    me.qp.connect(&qp.endpoint(&gctx)?, access_all())?;
    // SAFETY (all registrations below): the mapping lives until the end of
    // this test, after the regions.
    let a = unsafe { pd.register_raw(buf.add(2 * page + 100), 100, access_all()) }?;
    let b = unsafe { pd.register_raw(buf.add(5 * page + 8), 8, access_all()) }?;
    let c = unsafe { pd.register_raw(buf.add(7 * page + 5), 5, access_all()) }?;
    // (a) From page 1 into a's page.
    let before = unsafe { pd.register_raw(buf.add(page + 10), page + 40, access_all()) }?;
    // (b) From a's page over pages 3-4 into b's page.
    let over = unsafe { pd.register_raw(buf.add(2 * page + 150), 3 * page - 138, access_all()) }?;
    // (c) Page 6, c's page 7, page 8.
    let around = unsafe { pd.register_raw(buf.add(6 * page + 100), 3 * page - 200, access_all()) }?;
    assert!(mapped_from(buf as usize + page, 8 * page, ino)?, "pages 1-8 are not all in the VM's region");
    assert!(!mapped_from(buf as usize, page, ino)?, "page 0 was not registered");
    assert!(seen() == orig, "re-backing changed the application's bytes");
    through_guest_mr(&me, &before, 0, before.len(), 1)?;
    through_guest_mr(&me, &before, page - 60, 100, 2)?;
    through_guest_mr(&me, &over, 0, over.len(), 3)?;
    through_guest_mr(&me, &over, page - 200, 400, 4)?;
    through_guest_mr(&me, &over, 3 * page - 200, 62, 17)?;
    through_guest_mr(&me, &around, 0, around.len(), 5)?;
    through_guest_mr(&me, &around, page - 200, page + 300, 6)?;
    for (mr, seed) in [(&a, 7), (&b, 8), (&c, 9)] {
        through_guest_mr(&me, mr, 0, mr.len(), seed)?;
    }
    // The guest's own send from a region of pieces reads its pages.
    me.qp.post_recv(&[wr::recv(20, &[me.mr.sge(16384, 3 * page)?])?])?;
    qp.post_send(&[wr::send(21, &[over.sge(0, over.len())?])?.signaled()])?;
    assert_eq!(poll_one(&cq, WAIT)?.status, WcStatus::Success);
    assert_eq!(poll_one(&me.cq, WAIT)?.byte_len as usize, over.len());
    let mut got = vec![0u8; over.len()];
    me.mr.read(16384, &mut got)?;
    // SAFETY: inside the mapping.
    assert!(got == unsafe { std::slice::from_raw_parts(over.as_ptr(), over.len()) }, "the send");
    // Deregistered out of order: the others keep working.
    drop(a);
    through_guest_mr(&me, &over, 0, 100, 11)?;
    through_guest_mr(&me, &before, before.len() - 40, 40, 12)?;
    drop(over);
    through_guest_mr(&me, &b, 0, 8, 13)?;
    through_guest_mr(&me, &before, 0, 100, 14)?;
    drop((before, c));
    through_guest_mr(&me, &around, 0, around.len(), 15)?;
    drop(around);
    through_guest_mr(&me, &b, 0, 8, 16)?;
    drop(b);
    let last = seen();
    drop((qp, cq, pd));
    drop(gctx);
    assert!(!mapped_from(buf as usize + page, page, ino)?, "the pages stayed in the region");
    assert!(seen() == last, "the pages lost bytes going back to private memory");
    // SAFETY: the mapping made above; its regions are gone.
    unsafe { libc::munmap(buf.cast(), LEN) };
    Ok(())
}

/// Set in the process a test runs alone in ([`alone`]).
const ALONE: &str = "VRDMA_IT_VM_ALONE";

/// Runs this binary's test `name` in a process of its own, bounded in
/// time: `Ok` where it passed there.
fn alone(name: &str) -> Result<()> {
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args(["--exact", name, "--test-threads=1"])
        .env(ALONE, "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    // Read as the child writes, so that a full pipe never stalls it; each
    // reader hands its text over a channel, waited for with a bound (a
    // descendant that outlives the child keeps the pipe open).
    let (tx, rx) = std::sync::mpsc::channel();
    let mut readers = 0;
    for mut out in [
        child.stdout.take().map(|o| Box::new(o) as Box<dyn Read + Send>),
        child.stderr.take().map(|e| Box::new(e) as Box<dyn Read + Send>),
    ]
    .into_iter()
    .flatten()
    {
        let tx = tx.clone();
        readers += 1;
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = out.read_to_string(&mut text);
            let _ = tx.send(text);
        });
    }
    let end = Instant::now() + Duration::from_secs(180);
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut text = String::new();
    for _ in 0..readers {
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(part) => text.push_str(&part),
            Err(_) => text.push_str("\n(an output pipe stayed open 10 s after the child ended)\n"),
        }
    }
    if !status.is_some_and(|s| s.success()) || !text.contains("1 passed") {
        bail!("{name} in a process of its own: {status:?}\n{text}");
    }
    Ok(())
}

/// Heap buffers registered and deregistered from an emulated guest again
/// and again while other threads allocate, write, check and free beside
/// them (often in the same pages), then the context closed under the
/// same load: every heap object keeps its bytes. (A guest's `rping` died
/// of a corrupted heap, "double free or corruption", after its regions
/// went: moving the pages back to private memory let other threads read
/// zeros, and write into pages about to be replaced.) In a process of
/// its own: the other tests' guest contexts may register pages of the
/// same heap, which a guest shares between registrations of one context
/// only (`docs/vms.md`). (A `fork` beside kept heap pages, as the other
/// tests' daemon starts made, is `vrdma`'s
/// `a_fork_leaves_a_thread_arenas_header_in_kept_pages_whole`.)
#[test]
fn deregistering_heap_buffers_beside_busy_threads_keeps_the_heap_whole() -> Result<()> {
    use std::os::fd::AsRawFd;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    if std::env::var_os(ALONE).is_none() {
        return alone("deregistering_heap_buffers_beside_busy_threads_keeps_the_heap_whole");
    }
    let d = daemon_with_vm("")?;
    let vm = vrdma::vm::attach_at(&d.socket, "t")?;
    let cfg = vrdma::guest::GuestConfig {
        ports: vec![vm.port_socket.clone()],
        bar: format!("/proc/self/fd/{}", vm.region.as_raw_fd()).into(),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let busy: Vec<_> = (0..2u8)
        .map(|t| {
            let stop = stop.clone();
            std::thread::spawn(move || -> Result<u64> {
                let end = Instant::now() + Duration::from_secs(120);
                let mut live: Vec<Vec<u8>> = Vec::new();
                let mut n = 0u64;
                while !stop.load(Ordering::SeqCst) && Instant::now() < end {
                    let len = 16 + (n as usize * 37 + usize::from(t) * 11) % 400;
                    live.push(vec![(n as u8) ^ t; len]);
                    if live.len() > 64 {
                        let v = live.swap_remove((n as usize * 7) % live.len());
                        let b = v[0];
                        if v.iter().any(|&x| x != b) {
                            bail!("thread {t}: a heap object lost its bytes after {n} rounds");
                        }
                    }
                    n += 1;
                }
                Ok(n)
            })
        })
        .collect();
    for round in 0..3 {
        let gctx = vrdma::Context::open_guest(&cfg)?;
        let pd = gctx.alloc_pd()?;
        for i in 0..100usize {
            let len = 64 + (i * 53) % 3000;
            let mut buf = vec![0x3cu8; len];
            // SAFETY: `buf` lives until after its region is dropped below.
            let mr = unsafe { pd.register_raw(buf.as_mut_ptr(), len, access_all()) }?;
            mr.write(0, &[round as u8; 8])?;
            drop(mr);
            if buf[..8] != [round as u8; 8] || buf[8..].iter().any(|&b| b != 0x3c) {
                bail!("round {round}, buffer {i}: the registered buffer lost its bytes");
            }
        }
        drop(pd);
        drop(gctx);
    }
    stop.store(true, Ordering::SeqCst);
    for t in busy {
        let n = t.join().map_err(|_| anyhow::anyhow!("a busy thread panicked"))??;
        assert!(n > 0);
    }
    daemon_serves(&d)?;
    Ok(())
}

// ---------------------------------------------------------------------
// Tenant isolation seen from a guest (issue 18): a VM's tenant is held to
// exactly what a host tenant is held to (`tests/isolation.rs`,
// `tests/fairness.rs`). VM `o` is another tenant's (uid NOBODY) than the
// test's (its host processes and VM `t`); the guest of `o` is a context of
// this process in guest mode on `o`'s port and region, the victims a host
// process and an emulated guest of `t`. They need root (to attach VM `o`
// of another uid); without it they say so and pass vacuously.

/// A daemon with VM `t` of the test's uid (`extra_t` in its table) and VM
/// `o` of uid NOBODY, each of 16 MiB and 8 ports; `extra` at the top.
fn daemon_with_two_tenants_vms(extra: &str, extra_t: &str) -> Result<DaemonProc> {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    DaemonProc::start_with_config(&format!(
        "{extra}\n[vms.t]\ntenant = {uid}\nmemory_mib = 16\nports = 8\n{extra_t}\n\
         [vms.o]\ntenant = {NOBODY}\nmemory_mib = 16\nports = 8\n"
    ))
}

/// A context of this process in guest mode on VM `vm`'s port and region.
fn guest_context(vm: &vrdma::vm::VmAttachment) -> Result<vrdma::Context> {
    use std::os::fd::AsRawFd;
    let cfg = vrdma::guest::GuestConfig {
        ports: vec![vm.port_socket.clone()],
        bar: format!("/proc/self/fd/{}", vm.region.as_raw_fd()).into(),
    };
    let ctx = vrdma::Context::open_guest(&cfg)?;
    assert!(ctx.is_guest());
    Ok(ctx)
}

fn root_or_skip() -> bool {
    if root() {
        return true;
    }
    vrdma_it::skip(format!("this test needs root (to attach a VM of uid {NOBODY})"));
    false
}

/// (a) A guest's RC QP connected to another tenant's QP (a host process's,
/// another VM's guest's) on its daemon never carries a byte either way:
/// its send, RDMA write and read end in `RetryExcErr`, the victim's
/// receive buffers and region stay as they were and neither side gets a
/// receive. The same from a guest of the victims' own tenant (VM `t`)
/// succeeds before and after (the control), and a host process never
/// reaches the guest of `o` either.
#[test]
fn a_guests_qp_never_reaches_another_tenants_qp() -> Result<()> {
    use vrdma_it::isolation::{every_way_to_the_peer, ONE_HOST};
    if !root_or_skip() {
        return Ok(());
    }
    let d = daemon_with_two_tenants_vms("", "")?;
    let (o, t) = (vrdma::vm::attach_at(&d.socket, "o")?, vrdma::vm::attach_at(&d.socket, "t")?);
    let (attacker, friend) = (guest_context(&o)?, guest_context(&t)?);
    let host = d.context()?;
    assert_eq!((attacker.tenant(), friend.tenant()), (NOBODY, host.tenant()));
    let mut on_host = PeerProc::spawn(&d.socket, "tenant", &["--mr-len", "65536"])?;
    let hh = on_host.hello()?;
    let mut in_t = PeerProc::spawn_guest(&t, "tenant", &["--mr-len", "65536"])?;
    let ht = in_t.hello()?;
    assert_eq!((hh.tenant, ht.tenant), (host.tenant(), host.tenant()));
    for (what, peer, h) in [("a host process", &mut on_host, &hh), ("VM t's guest", &mut in_t, &ht)] {
        eprintln!("the guest of VM o against {what}");
        every_way_to_the_peer(&friend, peer, h, true, ONE_HOST)?;
        every_way_to_the_peer(&attacker, peer, h, false, ONE_HOST)?;
        // Its own send failed, so its QP is in ERR now.
        assert!(matches!(peer.call(&Command::State)?, Said::State(6)), "{what}");
        every_way_to_the_peer(&friend, peer, h, true, ONE_HOST)?;
    }
    // The other way: a host process of the test's tenant never reaches a
    // guest of VM o.
    let mut in_o = PeerProc::spawn_guest(&o, "tenant", &["--mr-len", "65536"])?;
    let ho = in_o.hello()?;
    assert_eq!(ho.tenant, NOBODY);
    every_way_to_the_peer(&host, &mut in_o, &ho, false, ONE_HOST)?;
    every_way_to_the_peer(&attacker, &mut in_o, &ho, true, ONE_HOST)?;
    daemon_serves(&d)?;
    Ok(())
}

/// (b) Another tenant's address and key, used from a guest through a
/// connection of the guest's own: `RemAccessErr` for an RDMA write and
/// read, `LocProtErr` as a local key; the victim's memory unchanged.
#[test]
fn a_guest_cannot_use_another_tenants_keys() -> Result<()> {
    use vrdma_it::isolation::another_tenants_key_is_refused;
    if !root_or_skip() {
        return Ok(());
    }
    let d = daemon_with_two_tenants_vms("", "")?;
    let (o, t) = (vrdma::vm::attach_at(&d.socket, "o")?, vrdma::vm::attach_at(&d.socket, "t")?);
    let attacker = guest_context(&o)?;
    let mut on_host = PeerProc::spawn(&d.socket, "tenant", &["--mr-len", "65536"])?;
    let hh = on_host.hello()?;
    let mut in_t = PeerProc::spawn_guest(&t, "tenant", &["--mr-len", "65536"])?;
    let ht = in_t.hello()?;
    another_tenants_key_is_refused(&attacker, &mut on_host, &hh)?;
    another_tenants_key_is_refused(&attacker, &mut in_t, &ht)?;
    daemon_serves(&d)?;
    Ok(())
}

/// The numbers of a victim's objects, named in the attacker's calls.
#[derive(Debug, Clone, Copy)]
struct Numbers {
    pd: u32,
    cq: u32,
    qp: u32,
    srq: u32,
    channel: u32,
    rkey: u32,
    lkey: u32,
    cm_id: u32,
}

impl Numbers {
    /// Numbers of no object at all, each beside the victim's.
    fn ghost(&self) -> Numbers {
        let far = |n: u32| n.wrapping_add(0x1000);
        let key = |k: u32| k ^ 0x0055_aa00;
        Numbers {
            pd: far(self.pd),
            cq: far(self.cq),
            qp: far(self.qp),
            srq: far(self.srq),
            channel: far(self.channel),
            rkey: key(self.rkey),
            lkey: key(self.lkey),
            cm_id: far(self.cm_id),
        }
    }

    fn all(&self) -> [u32; 8] {
        [self.pd, self.cq, self.qp, self.srq, self.channel, self.rkey, self.lkey, self.cm_id]
    }
}

/// A victim's objects of every kind (kept alive by the holder).
struct Victim {
    side: Side,
    srq: vrdma::SharedReceiveQueue,
    _channel: vrdma::CompletionChannel,
    _channel_cq: vrdma::CompletionQueue,
    _cm: (vrdma::cm::EventChannel, vrdma::cm::CmId),
    numbers: Numbers,
}

impl Victim {
    fn new(ctx: &vrdma::Context) -> Result<Victim> {
        let side = Side::new(ctx, 4096)?;
        side.qp.connect(&side.endpoint()?, access_all())?;
        let srq = side.pd.create_srq(vrdma::SrqAttr { max_wr: 4, max_sge: 1, srq_limit: 0 })?;
        let channel = ctx.create_comp_channel()?;
        let channel_cq = ctx.create_cq(4, Some(&channel))?;
        let cm_ch = vrdma::cm::EventChannel::create(ctx)?;
        let cm_id = vrdma::cm::CmId::create(&cm_ch, vrdma::cm::PortSpace::Tcp)?;
        let numbers = Numbers {
            pd: side.pd.pd_id(),
            cq: side.cq.cqn(),
            qp: side.qp.qpn(),
            srq: srq.srqn(),
            channel: channel.channel_id(),
            rkey: side.mr.rkey(),
            lkey: side.mr.lkey(),
            cm_id: cm_id.id(),
        };
        Ok(Victim { side, srq, _channel: channel, _channel_cq: channel_cq, _cm: (cm_ch, cm_id), numbers })
    }

    /// Everything as it was: the QP in RTS moves data through the region,
    /// the SRQ answers.
    fn unharmed(&self) -> Result<()> {
        let s = &self.side;
        assert_eq!(s.qp.state(), vrdma::QpState::Rts);
        s.mr.write(0, b"mine")?;
        let w = wr::rdma_write(1, &[s.mr.sge(0, 4)?], s.mr.addr() + 8, s.mr.rkey())?.signaled();
        s.qp.post_send(&[w])?;
        assert_eq!(poll_one(&s.cq, WAIT)?.status, WcStatus::Success);
        let mut got = [0u8; 4];
        s.mr.read(8, &mut got)?;
        assert_eq!(&got, b"mine");
        self.srq.query()?;
        Ok(())
    }
}

/// The calls of a guest that name the objects `n` (the rest of each call
/// is the guest's own: its PD `pd`, CQ `cq`, the memory extent at
/// `extent`, its rdma_cm id `id` with a route to nowhere resolved).
fn calls_naming(n: &Numbers, pd: u32, cq: u32, extent: u64, id: u32) -> Vec<Request> {
    use vrdma::{QpAttr, QpAttrMask, QpCap, QpState, QpType};
    use vrdma_core::proto::CmRequest;
    use vrdma_core::verbs::QpInitAttr;
    let cap = QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let init = |pd: u32, send_cq: u32, srq: Option<u32>| Request::CreateQp {
        pd,
        init: QpInitAttr { qp_type: QpType::Rc, send_cq, recv_cq: cq, srq, cap, sq_sig_all: false },
    };
    let to_err = QpAttr { qp_state: QpState::Err, ..QpAttr::default() };
    let access = vrdma::AccessFlags::LOCAL_WRITE | vrdma::AccessFlags::REMOTE_WRITE;
    let srq_attr = vrdma::SrqAttr { max_wr: 4, max_sge: 1, srq_limit: 0 };
    vec![
        Request::DeallocPd { pd: n.pd },
        Request::RegMr { pd: n.pd, addr: 0x1000, len: 4096, access, fd_offset: extent },
        Request::DeregMr { key: n.rkey },
        Request::DeregMr { key: n.lkey },
        Request::DestroyCompChannel { channel: n.channel },
        Request::CreateCq { cqe: 4, channel: Some(n.channel) },
        Request::DestroyCq { cq: n.cq },
        Request::CreateSrq { pd: n.pd, attr: srq_attr },
        Request::ModifySrq { srq: n.srq, limit: Some(1), resize: false },
        Request::QuerySrq { srq: n.srq },
        Request::DestroySrq { srq: n.srq },
        init(n.pd, cq, None),
        init(pd, n.cq, None),
        init(pd, cq, Some(n.srq)),
        Request::ModifyQp { qp: n.qp, attr: to_err, mask: QpAttrMask::STATE },
        Request::QueryQp { qp: n.qp },
        Request::DestroyQp { qp: n.qp },
        Request::CreateAh { pd: n.pd, attr: vrdma_core::verbs::AhAttr { port_num: 1, ..Default::default() } },
        Request::DirectGrant { qp: n.qp, rkey: n.rkey },
        Request::DirectRecvGrant { qp: n.qp },
        Request::DirectChannel { cq: n.cq },
        Request::DirectSrqLimit { qp: n.qp },
        Request::Cm(CmRequest::AttachQp { id, qp: n.qp }),
        Request::Cm(CmRequest::DestroyId { id: n.cm_id }),
        Request::Cm(CmRequest::QueryAddr { id: n.cm_id }),
        Request::Cm(CmRequest::Listen { id: n.cm_id, backlog: 1 }),
        Request::Cm(CmRequest::Disconnect { id: n.cm_id }),
    ]
}

/// What `reply` says beyond the numbers it was given (`numbers`).
fn without_numbers(reply: &Reply, numbers: &[u32]) -> String {
    let text = match reply {
        // The errno as it is, the words without the numbers.
        Reply::Error { errno, message } => return format!("errno {errno}: {}", words(message, numbers)),
        other => format!("{other:?}"),
    };
    words(&text, numbers)
}

/// `text` with every number of `numbers` (in hex or decimal) written `N`.
fn words(text: &str, numbers: &[u32]) -> String {
    let names: Vec<String> = numbers.iter().flat_map(|n| [format!("{n:#x}"), n.to_string()]).collect();
    let mut out = String::new();
    let mut word = String::new();
    for c in text.chars().chain(std::iter::once(' ')) {
        if c.is_ascii_alphanumeric() {
            word.push(c);
            continue;
        }
        out.push_str(if names.contains(&word) { "N" } else { &word });
        word.clear();
        out.push(c);
    }
    out
}

/// (c) Every control call of a guest that names an object of another
/// tenant (a host context's, another VM's guest's) is answered exactly as
/// the same call naming a number of no object: the same error, the same
/// words; and the objects are unharmed.
#[test]
fn a_guest_naming_another_tenants_objects_is_answered_as_for_no_object() -> Result<()> {
    if !root_or_skip() {
        return Ok(());
    }
    let d = daemon_with_two_tenants_vms("", "")?;
    let (o, t) = (vrdma::vm::attach_at(&d.socket, "o")?, vrdma::vm::attach_at(&d.socket, "t")?);
    let host = d.context()?;
    let in_t = guest_context(&t)?;
    let victims = [("a host context", Victim::new(&host)?), ("VM t's guest", Victim::new(&in_t)?)];
    let mut p = RawPort::connect(&o)?;
    p.open()?;
    let pd = match p.call(Request::AllocPd)?.0 {
        Reply::Pd { pd } => pd,
        other => bail!("{other:?}"),
    };
    let cq = match p.call(Request::CreateCq { cqe: 4, channel: None })?.0 {
        Reply::Cq { cq, .. } => cq,
        other => bail!("{other:?}"),
    };
    let extent = match p.call(Request::GuestAlloc { len: 8192 })?.0 {
        Reply::GuestExtent { offset, .. } => offset,
        other => bail!("{other:?}"),
    };
    let ch = match p.call(Request::Cm(vrdma_core::proto::CmRequest::CreateChannel))?.0 {
        Reply::Cm(vrdma_core::proto::CmReply::Channel { channel }) => channel,
        other => bail!("{other:?}"),
    };
    let id = match p.call(Request::Cm(vrdma_core::proto::CmRequest::CreateId { channel: ch, ps: 0x0106 }))?.0
    {
        Reply::Cm(vrdma_core::proto::CmReply::Id { id }) => id,
        other => bail!("{other:?}"),
    };
    let dst = std::net::SocketAddrV4::new(std::net::Ipv4Addr::LOCALHOST, vrdma_it::free_port()?);
    let (reply, _) = p.call(Request::Cm(vrdma_core::proto::CmRequest::ResolveAddr { id, src: None, dst }))?;
    assert!(errno_of(&reply).is_none(), "{reply:?}");
    for (what, v) in &victims {
        let ghost = v.numbers.ghost();
        // Numbers are per kind: none of the victim's (or the ghosts') is
        // the guest's own of its kind.
        for n in [&v.numbers, &ghost] {
            assert!(n.pd != pd && n.cq != cq && n.cm_id != id, "{what}: {n:?} names the guest's own");
        }
        let real = calls_naming(&v.numbers, pd, cq, extent, id);
        let none = calls_naming(&ghost, pd, cq, extent, id);
        for (req, absent) in real.into_iter().zip(none) {
            let (got, _) = p.call(req.clone())?;
            let (want, _) = p.call(absent)?;
            // (The direct path is off for guests: refused, as for a host's
            // QP without a peer.)
            let refused = matches!(got, Reply::Error { .. } | Reply::DirectRefused(_));
            assert!(refused, "{what}: {req:?} was run: {got:?}");
            assert_eq!(
                without_numbers(&got, &v.numbers.all()),
                without_numbers(&want, &ghost.all()),
                "{what}: {req:?} is answered otherwise than for an object that does not exist"
            );
        }
        v.unharmed()?;
    }
    // The guest's own objects are its own.
    assert_eq!(p.call(Request::DestroyCq { cq })?.0, Reply::Done);
    assert_eq!(p.call(Request::DeallocPd { pd })?.0, Reply::Done);
    daemon_serves(&d)?;
    Ok(())
}

/// (d) rdma_cm: a guest's request to another tenant's listener (a host
/// process's on loopback, a guest's of VM `t` on `t`'s address) is
/// answered as one to a port where no one listens (REJ 8), and the
/// listener hears nothing; the same request from the listener's tenant
/// reaches it (the control). The guest cannot bind VM `t`'s address.
#[test]
fn a_guest_meets_another_tenants_listener_as_no_listener() -> Result<()> {
    use std::net::{Ipv4Addr, SocketAddrV4};
    use vrdma::cm::{reject, CmId, ConnParam, EventChannel, EventKind, PortSpace};
    if !root_or_skip() {
        return Ok(());
    }
    const T_ADDR: Ipv4Addr = Ipv4Addr::new(10, 76, 35, 2);
    let d = daemon_with_two_tenants_vms("", &format!("address = \"{T_ADDR}\"\n"))?;
    let (o, t) = (vrdma::vm::attach_at(&d.socket, "o")?, vrdma::vm::attach_at(&d.socket, "t")?);
    let (attacker, in_t, host) = (guest_context(&o)?, guest_context(&t)?, d.context()?);
    let event = |ch: &EventChannel, within: Duration| -> Result<Option<vrdma::cm::CmEvent>> {
        Ok(ch.get_event(Some(within))?)
    };
    // The first event of a connect from `ctx` to `to`, and its status.
    let connect_from =
        |ctx: &vrdma::Context, to: SocketAddrV4| -> Result<(EventKind, i32, CmId, EventChannel)> {
            let ch = EventChannel::create(ctx)?;
            let id = CmId::create(&ch, PortSpace::Tcp)?;
            id.resolve_addr(None, to)?;
            let ev = event(&ch, WAIT)?.ok_or_else(|| anyhow::anyhow!("no event"))?;
            assert_eq!(ev.kind, EventKind::AddrResolved, "{ev:?}");
            id.resolve_route()?;
            let ev = event(&ch, WAIT)?.ok_or_else(|| anyhow::anyhow!("no event"))?;
            assert_eq!(ev.kind, EventKind::RouteResolved, "{ev:?}");
            id.connect(&ConnParam { responder_resources: 1, initiator_depth: 1, ..ConnParam::default() })?;
            let ev = event(&ch, WAIT)?.ok_or_else(|| anyhow::anyhow!("no answer to the connect"))?;
            Ok((ev.kind, ev.status, id, ch))
        };
    let listen = |ctx: &vrdma::Context, at: SocketAddrV4| -> Result<(CmId, EventChannel)> {
        let ch = EventChannel::create(ctx)?;
        let id = CmId::create(&ch, PortSpace::Tcp)?;
        assert_eq!(id.bind(at)?, at);
        id.listen(8)?;
        Ok((id, ch))
    };
    let on_host = SocketAddrV4::new(Ipv4Addr::LOCALHOST, vrdma_it::free_port()?);
    let on_t = SocketAddrV4::new(T_ADDR, vrdma_it::free_port()?);
    let (_l1, host_ch) = listen(&host, on_host)?;
    let (_l2, t_ch) = listen(&in_t, on_t)?;
    for (what, at, ch, friend) in
        [("a host process's", on_host, &host_ch, &in_t), ("VM t's", on_t, &t_ch, &host)]
    {
        let nobody_there = SocketAddrV4::new(*at.ip(), vrdma_it::free_port()?);
        let (kind, status, _, _) = connect_from(&attacker, nobody_there)?;
        assert_eq!((kind, status), (EventKind::Rejected, i32::from(reject::INVALID_SERVICE_ID)));
        let (kind2, status2, _, _) = connect_from(&attacker, at)?;
        assert_eq!((kind2, status2), (kind, status), "the guest of VM o at {what} listener {at}");
        assert!(event(ch, Duration::from_millis(200))?.is_none(), "{what} listener heard the other tenant");
        assert!(!vrdma::cm::is_listening(&attacker, PortSpace::Tcp, at)?, "{what} listener shows to VM o");
        // The control: the listener's own tenant reaches it (its id and
        // channel kept until the listener heard it).
        let _asking = {
            let ch2 = EventChannel::create(friend)?;
            let id = CmId::create(&ch2, PortSpace::Tcp)?;
            id.resolve_addr(None, at)?;
            assert_eq!(event(&ch2, WAIT)?.map(|e| e.kind), Some(EventKind::AddrResolved));
            id.resolve_route()?;
            assert_eq!(event(&ch2, WAIT)?.map(|e| e.kind), Some(EventKind::RouteResolved));
            id.connect(&ConnParam { responder_resources: 1, initiator_depth: 1, ..ConnParam::default() })?;
            (id, ch2)
        };
        let req = event(ch, WAIT)?
            .ok_or_else(|| anyhow::anyhow!("{what} listener heard nothing of its own tenant"))?;
        assert_eq!(req.kind, EventKind::ConnectRequest, "{req:?}");
    }
    // VM t's address is its tenant's alone.
    let id = CmId::create(&EventChannel::create(&attacker)?, PortSpace::Tcp)?;
    let e = id.bind(SocketAddrV4::new(T_ADDR, vrdma_it::free_port()?)).unwrap_err();
    assert_eq!(e.errno(), libc::EADDRNOTAVAIL, "{e}");
    daemon_serves(&d)?;
    Ok(())
}

/// A host tenant's ping-pong of 8-byte sends between two QPs of one
/// context: `rounds` round trips, each within `WAIT`.
fn host_ping_pong(d: &DaemonProc, rounds: u64) -> Result<()> {
    let ctx = d.context()?;
    let (a, b) = (Side::new(&ctx, 4096)?, Side::new(&ctx, 4096)?);
    vrdma_it::connect(&a, &b)?;
    let pp = vrdma_it::PingPong::new(a, b)?;
    for i in 0..rounds {
        pp.one_way(i)?;
    }
    Ok(())
}

/// Until a call of guest `g` fails (its session ended): the error's text.
fn guest_call_fails(g: &mut PeerProc) -> Result<String> {
    let end = Instant::now() + WAIT;
    loop {
        match g.call(&Command::Query)? {
            Said::Error { message, .. } => return Ok(message),
            other if Instant::now() > end => bail!("the scribbler's context still answers: {other:?}"),
            _ => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// (e) A guest that scribbles on what it shares with the daemon loses its
/// session alone: garbage in its posted-QP ring's index (as
/// `a_tenant_that_scribbles_on_its_posted_ring_loses_its_context_alone`
/// writes it), then garbage over the whole of its VM's region (every
/// ring and queue of every session of the VM, as a guest kernel could
/// write it) while it rings its doorbell. Each time its calls fail, a
/// host tenant's ping-pong through the engine goes on before and after,
/// the daemon lives, and the VM's next context works.
#[test]
fn a_guest_that_scribbles_on_its_rings_loses_its_session_alone() -> Result<()> {
    use std::os::fd::AsRawFd;
    if !root_or_skip() {
        return Ok(());
    }
    // The engine path, whatever the default (see `tests/fairness.rs`).
    let mut d = daemon_with_two_tenants_vms("[direct]\nenabled = false\n", "")?;
    let o = vrdma::vm::attach_at(&d.socket, "o")?;
    host_ping_pong(&d, 100)?;

    // Garbage in the posted-QP ring's producer index.
    let mut g = PeerProc::spawn_guest(&o, "tenant", &["--mr-len", "65536"])?;
    assert_eq!(g.hello()?.tenant, NOBODY);
    g.call_ok(&Command::IdleQps { count: 8 })?;
    g.call_ok(&Command::Misbehave { how: Misbehavior::Scribble, millis: 0 })?;
    // (The engine looks at the ring when it has work or a doorbell.)
    g.call_ok(&Command::Misbehave { how: Misbehavior::Doorbells, millis: 200 })?;
    // Told why first, as a host tenant is.
    let fatal = u32::from(vrdma::AsyncEventType::DeviceFatal.raw());
    match g.call(&Command::AsyncEvent { timeout_ms: WAIT.as_millis() as u64 })? {
        Said::Event(Some(e)) => assert_eq!(e, fatal, "the scribbler's first async event"),
        other => bail!("the scribbler heard no IBV_EVENT_DEVICE_FATAL: {other:?}"),
    }
    let told = guest_call_fails(&mut g)?;
    eprintln!("the guest that scribbled on its posted ring is told: {told}");
    assert!(told.contains("the daemon closed its context"), "{told}");
    host_ping_pong(&d, 100)?;
    assert!(d.is_alive());
    drop(g);

    // Garbage over the whole region, under a guest with work posted.
    let mut g = PeerProc::spawn_guest(&o, "tenant", &["--mr-len", "65536"])?;
    let h = g.hello()?;
    g.call_ok(&Command::Connect { peer: h.endpoint })?;
    g.call_ok(&Command::PostRecv { count: 8, offset: 0, len: 4096 })?;
    g.call_ok(&Command::IdleQps { count: 8 })?;
    let len = o.region_len as usize;
    // SAFETY: a fresh shared mapping of the VM's region (a memfd of `len`
    // bytes, sealed against shrinking), written through a pointer that
    // lives only here and unmapped at once.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            o.region.as_raw_fd(),
            0,
        );
        assert_ne!(p, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
        let bytes = std::slice::from_raw_parts_mut(p.cast::<u8>(), len);
        // Not random, so that a failure repeats: a pattern of every byte value.
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_right(29) as u8;
        }
        libc::munmap(p, len);
    }
    g.call_ok(&Command::Misbehave { how: Misbehavior::Doorbells, millis: 300 })?;
    std::thread::sleep(Duration::from_millis(300));
    host_ping_pong(&d, 100)?;
    assert!(d.is_alive());
    // (Its async events' ring is garbage too: it may hear nothing first.)
    let told = guest_call_fails(&mut g)?;
    eprintln!("the guest whose region was scribbled over is told: {told}");
    assert!(told.contains("the daemon closed its context"), "{told}");
    host_ping_pong(&d, 100)?;
    assert!(d.is_alive());
    drop(g);

    // The VM's device still serves: a new guest context, data through it.
    let mut again = PeerProc::spawn_guest(&o, "tenant", &["--mr-len", "65536"])?;
    let h = again.hello()?;
    again.call_ok(&Command::Connect { peer: h.endpoint })?;
    again.call_ok(&Command::PostRecv { count: 1, offset: 4096, len: 4096 })?;
    again.call_ok(&Command::Fill { offset: 0, data: b"after".to_vec() })?;
    again.call_ok(&Command::Send { wr_id: 1, offset: 0, len: 5, imm: None })?;
    let wcs = again.poll(2, WAIT)?;
    assert_eq!(wcs.iter().filter(|w| w.status == WcStatus::Success.raw()).count(), 2, "{wcs:?}");
    assert_eq!(again.read(4096, 5)?, b"after");
    daemon_serves(&d)?;
    Ok(())
}

/// The extents of VM `vm`'s region that process `pid` maps, as (offset,
/// length), in the order of their offsets.
fn mapped_extents(pid: u32, vm: &vrdma::vm::VmAttachment) -> Result<Vec<(u64, u64)>> {
    let ino = rustix::fs::fstat(&vm.region)?.st_ino.to_string();
    let mut out = Vec::new();
    for l in std::fs::read_to_string(format!("/proc/{pid}/maps"))?.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.get(4) != Some(&ino.as_str()) {
            continue;
        }
        let Some((start, end)) = f[0].split_once('-') else { bail!("{l}") };
        let len = u64::from_str_radix(end, 16)? - u64::from_str_radix(start, 16)?;
        out.push((u64::from_str_radix(f[2], 16)?, len));
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// Writes a fixed pattern of every byte value over `[offset, +len)` of
/// VM `vm`'s region, for each range.
fn scribble_region(vm: &vrdma::vm::VmAttachment, ranges: &[(u64, u64)]) -> Result<()> {
    use std::os::fd::AsRawFd;
    let len = vm.region_len as usize;
    // SAFETY: a fresh shared mapping of the VM's region (a memfd of `len`
    // bytes, sealed against shrinking), written through a slice that lives
    // only here, within its bounds, and unmapped at once.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            vm.region.as_raw_fd(),
            0,
        );
        if p == libc::MAP_FAILED {
            bail!("mapping the region: {}", std::io::Error::last_os_error());
        }
        let bytes = std::slice::from_raw_parts_mut(p.cast::<u8>(), len);
        for &(offset, n) in ranges {
            let (from, to) = (offset as usize, (offset + n).min(len as u64) as usize);
            for (i, b) in bytes[from..to].iter_mut().enumerate() {
                // Not random, so that a failure repeats.
                *b = ((from + i) as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_right(29) as u8;
            }
        }
        libc::munmap(p, len);
    }
    Ok(())
}

/// (e, continued) A guest that scribbles on its queues' rings in its
/// region (every extent it maps but its context's, so that its posted-QP
/// ring stays sound: its CQ's, its QPs' and its memory) and then names its
/// QPs to the engine: the engine reads no more from a corrupt work queue,
/// the QP goes to ERR and the CQ raises `IBV_EVENT_CQ_ERR` (the guest's
/// own library finds its rings corrupt too); the context still answers,
/// the daemon lives, a host tenant's ping-pong through the engine goes
/// on before and after, and the VM's next context works.
#[test]
fn a_guest_that_scribbles_on_its_queues_gets_their_errors_alone() -> Result<()> {
    if !root_or_skip() {
        return Ok(());
    }
    let mut d = daemon_with_two_tenants_vms("[direct]\nenabled = false\n", "")?;
    let o = vrdma::vm::attach_at(&d.socket, "o")?;
    host_ping_pong(&d, 100)?;
    let mut g = PeerProc::spawn_guest(&o, "tenant", &["--mr-len", "65536"])?;
    let h = g.hello()?;
    g.call_ok(&Command::Connect { peer: h.endpoint })?;
    g.call_ok(&Command::PostRecv { count: 8, offset: 0, len: 4096 })?;
    g.call_ok(&Command::IdleQps { count: 8 })?;
    // The first session on a fresh region: its context's extent (the
    // first one allocated) is at offset 0.
    let extents = mapped_extents(h.pid, &o)?;
    assert_eq!(extents.first().map(|e| e.0), Some(0), "{extents:x?}");
    assert!(extents.len() >= 4, "{extents:x?}");
    scribble_region(&o, &extents[1..])?;
    g.call_ok(&Command::Misbehave { how: Misbehavior::NameIdle, millis: 300 })?;
    g.call_ok(&Command::Misbehave { how: Misbehavior::Doorbells, millis: 300 })?;
    // The library's own post finds its send queue corrupt.
    match g.call(&Command::Send { wr_id: 1, offset: 0, len: 5, imm: None })? {
        Said::Error { errno, message } => assert_eq!(errno, libc::EIO, "{message}"),
        other => bail!("a post on a scribbled send queue: {other:?}"),
    }
    host_ping_pong(&d, 100)?;
    assert!(d.is_alive());
    // The daemon's word: the QP in ERR (a call the daemon answers: the
    // context lives), the CQ's error.
    vrdma_it::wait_until(WAIT, "the scribbled QP in ERR", || {
        matches!(g.call(&Command::Query), Ok(Said::State(6)))
    })?;
    let cq_err = u32::from(vrdma::AsyncEventType::CqErr.raw());
    let mut events = Vec::new();
    while let Said::Event(Some(e)) = g.call(&Command::AsyncEvent { timeout_ms: 300 })? {
        events.push(e);
    }
    assert!(events.contains(&cq_err), "async events {events:?}");
    host_ping_pong(&d, 100)?;
    assert!(d.is_alive());
    drop(g);

    // The VM's device still serves: a new guest context, data through it.
    let mut again = PeerProc::spawn_guest(&o, "tenant", &["--mr-len", "65536"])?;
    let h = again.hello()?;
    again.call_ok(&Command::Connect { peer: h.endpoint })?;
    again.call_ok(&Command::PostRecv { count: 1, offset: 4096, len: 4096 })?;
    again.call_ok(&Command::Fill { offset: 0, data: b"after".to_vec() })?;
    again.call_ok(&Command::Send { wr_id: 1, offset: 0, len: 5, imm: None })?;
    let wcs = again.poll(2, WAIT)?;
    assert_eq!(wcs.iter().filter(|w| w.status == WcStatus::Success.raw()).count(), 2, "{wcs:?}");
    assert_eq!(again.read(4096, 5)?, b"after");
    daemon_serves(&d)?;
    Ok(())
}
