//! `vrdma cp` as a user runs it: a daemon process (or two, as two hosts),
//! a receiver and a sender process, a real file.

use std::io::{BufRead, BufReader, Write};
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

/// A receiver on `socket`, listening on `port`; returns once it listens.
fn receiver(socket: &Path, out: &Path, port: u16) -> Proc {
    let mut p = Proc(
        Command::new(VRDMA)
            .arg("--socket")
            .arg(socket)
            .args(["cp", "--quiet", "--recv"])
            .arg(out)
            .args(["--listen", &format!("127.0.0.1:{port}")])
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

fn copy_and_check(recv_socket: &Path, send_socket: &Path, dir: &Path) {
    let src = dir.join("in.bin");
    let out = dir.join("out.bin");
    // Five MiB and a bit through a window of four 64 KiB slots: the file
    // streams through the window some twenty times.
    let data = random_file(&src, (5 << 20) + 12_345);
    let port = free_port();
    let r = receiver(recv_socket, &out, port);
    let (s, so, se) =
        send(send_socket, &src, &format!("127.0.0.1:{port}"), &["--window", "256K", "--segment", "64K"])
            .finish(Duration::from_secs(60));
    assert!(s.success(), "sender: {so}{se}");
    assert!(so.contains("verified by the receiver"), "{so}");
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
    copy_and_check(&sock, &sock, dir.path());
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
    copy_and_check(&dir.path().join("h0.sock"), &dir.path().join("h1.sock"), dir.path());
    // The bytes crossed between the daemons.
    let st = vrdma::Context::open_at(dir.path().join("h0.sock")).unwrap().stat().unwrap();
    assert!(st.links.iter().map(|l| l.stats.payload_in).sum::<u64>() >= 5 << 20, "{st:?}");
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
    let port = free_port();
    let (s, _, e) = send(&sock, &src, &format!("127.0.0.1:{port}"), &[]).finish(Duration::from_secs(40));
    assert!(!s.success() && e.contains("no `vrdma cp --recv` answers"), "{e}");
}

#[test]
fn a_receiver_that_goes_away_ends_the_sender_with_an_error_not_a_hang() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("v.sock");
    let _d = daemon(&sock, None);
    let src = dir.path().join("f");
    random_file(&src, 1 << 20);
    // A fake receiver: it reads the offer, answers with a window on a QP
    // that does not exist, and leaves.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let fake = std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        let ep = vrdma::Endpoint { lid: 0, gid: vrdma::Gid::from_ipv4([127, 0, 0, 1]), qpn: 0xabcd, psn: 0 };
        let hex: String = ep.to_bytes().iter().map(|b| format!("{b:02x}")).collect();
        (&s).write_all(format!("{{\"endpoint\":\"{hex}\",\"addr\":4096,\"rkey\":1}}\n").as_bytes()).unwrap();
    });
    let start = Instant::now();
    let (s, _, e) = send(&sock, &src, &format!("127.0.0.1:{port}"), &[]).finish(Duration::from_secs(40));
    fake.join().unwrap();
    assert!(!s.success(), "{e}");
    assert!(e.contains("transfer failed") || e.contains("control connection"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(35), "took {:?}", start.elapsed());
}
