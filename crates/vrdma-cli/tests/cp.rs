//! `vrdma cp` as a user runs it: a daemon process (or two, as two hosts),
//! a receiver and a sender process, a real file; the two meet through
//! the connection manager. And peers that are not `vrdma cp`, written
//! here with the Rust API: a sender with an offer no receiver serves, a
//! receiver that gives a window it does not have and goes away.

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::{daemon, Proc, VRDMA};

fn free_port() -> u16 {
    vrdma_it::free_port().expect("a free TCP port")
}

fn random_file(path: &Path, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for b in v.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    std::fs::write(path, &v).unwrap();
    v
}

/// A receiver on `socket`, listening on `ip`:`port`; returns once it listens.
fn receiver(socket: &Path, out: &Path, ip: &str, port: u16) -> Proc {
    let mut p = Proc(
        Command::new(VRDMA)
            .arg("--socket")
            .arg(socket)
            .args(["cp", "--quiet", "--recv"])
            .arg(out)
            .args(["--listen", &format!("{ip}:{port}")])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut err = BufReader::new(p.0.stderr.take().unwrap());
    let mut line = String::new();
    let end = Instant::now() + Duration::from_secs(20);
    while !line.contains("waiting for a sender") {
        line.clear();
        assert!(err.read_line(&mut line).unwrap() > 0, "the receiver exited before listening");
        assert!(Instant::now() < end);
    }
    std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
    p
}

fn send(socket: &Path, src: &Path, dest: &str, extra: &[&str]) -> Proc {
    Proc(
        Command::new(VRDMA)
            .arg("--socket")
            .arg(socket)
            .args(["cp", "--quiet"])
            .arg(src)
            .arg(dest)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    )
}

/// A copy from `send_socket`'s daemon to a receiver of `recv_socket`'s
/// daemon listening on `ip`.
fn copy_and_check(recv_socket: &Path, send_socket: &Path, ip: &str, dir: &Path) {
    let src = dir.join("in.bin");
    let out = dir.join("out.bin");
    // Five MiB and a bit through a window of four 64 KiB slots: the file
    // streams through the window some twenty times.
    let data = random_file(&src, (5 << 20) + 12_345);
    let port = free_port();
    let r = receiver(recv_socket, &out, ip, port);
    let (s, so, se) =
        send(send_socket, &src, &format!("{ip}:{port}"), &["--window", "256K", "--segment", "64K"])
            .finish(Duration::from_secs(60));
    assert!(s.success(), "sender: {so}{se}");
    assert!(so.contains("verified by the receiver"), "{so}");
    assert!(!se.contains("WARN"), "the sender warned: {se}");
    let (s, ro, re) = r.finish(Duration::from_secs(30));
    assert!(s.success(), "receiver: {ro}{re}");
    assert!(ro.contains("matches the sender's"), "{ro}");
    assert!(std::fs::read(&out).unwrap() == data, "the copy differs");
}

#[test]
fn copies_a_file_between_two_tenants_through_a_window_smaller_than_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("v.sock");
    let _d = daemon(&sock, None);
    copy_and_check(&sock, &sock, "127.0.0.1", dir.path());
}

#[test]
fn copies_a_file_between_two_hosts() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut daemons = Vec::new();
    let ips = ["127.0.0.2", "127.0.0.3"];
    for (i, ip) in ips.iter().enumerate() {
        let cfg = dir.path().join(format!("h{i}.toml"));
        std::fs::write(
            &cfg,
            format!(
                "address = \"{ip}\"\n[net]\nlisten = \"{ip}:{port}\"\nport = {port}\npsk = \"cp test key 0123456789\"\npeers = [\"{}:{port}\"]\n",
                ips[1 - i]
            ),
        )
        .unwrap();
        daemons.push(daemon(&dir.path().join(format!("h{i}.sock")), Some(&cfg)));
    }
    // The receiver on the second host, the sender on the first.
    copy_and_check(&dir.path().join("h1.sock"), &dir.path().join("h0.sock"), ips[1], dir.path());
    // The bytes crossed between the daemons.
    let st = vrdma::Context::open_at(dir.path().join("h0.sock")).unwrap().stat().unwrap();
    assert!(st.links.iter().map(|l| l.stats.payload_out).sum::<u64>() >= 5 << 20, "{st:?}");
}

#[test]
fn bad_input_gets_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("v.sock");
    let _d = daemon(&sock, None);
    let missing = dir.path().join("no-such-file");
    let (s, _, e) = send(&sock, &missing, "127.0.0.1:1", &[]).finish(Duration::from_secs(20));
    assert!(!s.success() && e.contains("cannot open"), "{e}");
    let src = dir.path().join("f");
    random_file(&src, 10);
    let (s, _, e) = send(&sock, &src, "127.0.0.1:1", &["--segment", "1000"]).finish(Duration::from_secs(20));
    assert!(!s.success() && e.contains("--segment must be a power of two"), "{e}");
    // No one listens: refused at once, as a closed TCP port is.
    let port = free_port();
    let start = Instant::now();
    let (s, _, e) = send(&sock, &src, &format!("127.0.0.1:{port}"), &[]).finish(Duration::from_secs(40));
    assert!(!s.success() && e.contains("no `vrdma cp --recv` listens on"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(20), "took {:?}", start.elapsed());
    let (s, _, e) = send(&sock, &src, "no-such-host.invalid", &[]).finish(Duration::from_secs(40));
    assert!(!s.success() && e.contains("cannot resolve"), "{e}");
}

/// `vrdma cp`'s messages, as the peers written here send them.
fn message(tag: u8, fields: &[&[u8]]) -> Vec<u8> {
    let mut v = b"vrcp".to_vec();
    v.extend_from_slice(&2u16.to_le_bytes());
    v.extend_from_slice(&[tag, 0]);
    for f in fields {
        v.extend_from_slice(f);
    }
    v
}

fn event(ch: &vrdma::cm::EventChannel) -> vrdma::cm::CmEvent {
    ch.get_event(Some(Duration::from_secs(20))).unwrap().expect("an rdma_cm event within 20 s")
}

/// An offer no receiver serves is refused with the reason, and the
/// receiver goes on waiting for a sender it can serve.
#[test]
fn a_receiver_refuses_an_unreasonable_offer_with_its_reason_and_waits_on() {
    use vrdma::cm::{CmId, ConnParam, EventChannel, EventKind, PortSpace};
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("v.sock");
    let _d = daemon(&sock, None);
    let out = dir.path().join("out.bin");
    let port = free_port();
    let r = receiver(&sock, &out, "127.0.0.1", port);

    let ctx = vrdma::Context::open_at(&sock).unwrap();
    let ch = EventChannel::create(&ctx).unwrap();
    let id = CmId::create(&ch, PortSpace::Tcp).unwrap();
    id.resolve_addr(None, SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)).unwrap();
    assert_eq!(event(&ch).kind, EventKind::AddrResolved);
    id.resolve_route().unwrap();
    assert_eq!(event(&ch).kind, EventKind::RouteResolved);
    // 4 GiB of window: 1024 slots of 4 MiB.
    let offer = message(b'O', &[&1u64.to_le_bytes(), &(4u64 << 20).to_le_bytes(), &1024u32.to_le_bytes()]);
    id.connect(&ConnParam { private_data: offer, ..ConnParam::default() }).unwrap();
    let ev = event(&ch);
    assert_eq!(ev.kind, EventKind::Rejected, "{ev:?}");
    let why = String::from_utf8_lossy(&ev.peer.unwrap().private_data[8..]).into_owned();
    assert!(why.contains("unreasonable window"), "{why}");

    // Still waiting: a real sender gets its file across.
    let src = dir.path().join("in.bin");
    let data = random_file(&src, 100_000);
    let (s, so, se) = send(&sock, &src, &format!("127.0.0.1:{port}"), &[]).finish(Duration::from_secs(60));
    assert!(s.success(), "sender: {so}{se}");
    let (s, ro, re) = r.finish(Duration::from_secs(30));
    assert!(s.success(), "receiver: {ro}{re}");
    assert!(std::fs::read(&out).unwrap() == data, "the copy differs");
}

#[test]
fn a_receiver_that_goes_away_ends_the_sender_with_an_error_not_a_hang() {
    use vrdma::cm::{CmId, ConnParam, EventChannel, EventKind, PortSpace};
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("v.sock");
    let _d = daemon(&sock, None);
    let src = dir.path().join("f");
    random_file(&src, 1 << 20);
    // A fake receiver: it takes the connection, answers with a window it
    // does not have, and leaves.
    let port = free_port();
    let ctx = vrdma::Context::open_at(&sock).unwrap();
    let ch = EventChannel::create(&ctx).unwrap();
    let listener = CmId::create(&ch, PortSpace::Tcp).unwrap();
    listener.bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)).unwrap();
    listener.listen(1).unwrap();
    let sender = send(&sock, &src, &format!("127.0.0.1:{port}"), &[]);
    let start = Instant::now();
    let req = event(&ch);
    assert_eq!(req.kind, EventKind::ConnectRequest);
    let id = CmId::from_request(&ch, &req, PortSpace::Tcp).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(8, None).unwrap();
    let qp = pd.create_rc_qp(&cq, &cq, vrdma_it::cap(4, 1)).unwrap();
    id.attach_qp(&qp).unwrap();
    let window = message(b'A', &[&4096u64.to_le_bytes(), &1u32.to_le_bytes()]);
    id.accept(&ConnParam { private_data: window, ..ConnParam::default() }).unwrap();
    assert_eq!(event(&ch).kind, EventKind::Established);
    drop((qp, id, listener, ch, cq, pd, ctx));
    let (s, _, e) = sender.finish(Duration::from_secs(40));
    assert!(!s.success(), "{e}");
    assert!(e.contains("transfer failed") || e.contains("went away"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(35), "took {:?}", start.elapsed());
}
