//! The start of every link: Hello both ways, then the initiator's Auth,
//! then the acceptor's, on a blocking socket with a deadline, before the
//! engine sees the socket.
//!
//! The acceptor proves nothing and decides nothing until the initiator has
//! proved it holds the key: a stranger learns no tag, and cannot make the
//! acceptor record anything about it. A Hello that carries this daemon's
//! own id is refused (a stranger reflecting our own handshake back at us
//! would otherwise get our tags to answer our challenges), and a dial made
//! for a GID must reach the daemon whose Hello says that GID (a stranger
//! named by a tenant's address handle cannot relay us to another daemon).
//!
//! Done on a thread of its own so that a slow or hostile peer (one that
//! connects and sends nothing, or trickles bytes) costs that thread its
//! deadline and nothing else: the engine only ever gets authenticated
//! links.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use vrdma_core::verbs::Gid;
use vrdma_core::wire::auth::{local_tag, verify_peer};
use vrdma_core::wire::{CloseReason, CloseRepr, Event, FrameDecoder, FrameRepr, HelloRepr, Role, NONCE_LEN};

/// How long the peer's Hello may take, at most.
pub const HELLO_LIMIT: Duration = Duration::from_secs(1);

/// Who we are in Hellos.
#[derive(Debug, Clone)]
pub struct Identity {
    pub daemon_id: u64,
    pub gid: Gid,
    pub lid: u16,
    pub max_chunk: u32,
    pub psk: Vec<u8>,
}

/// What an authenticated peer told about itself.
#[derive(Debug, Clone, Copy)]
pub struct Peer {
    pub hello: HelloRepr,
    pub chunk: u32,
    /// The wire version both daemons speak (which frames may be sent).
    pub version: u8,
}

#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("the peer sent a malformed frame: {0}")]
    Wire(#[from] vrdma_core::wire::WireError),
    /// The Hellos have no version in common (an older daemon).
    #[error("{0}")]
    Version(vrdma_core::wire::WireError),
    #[error("the peer sent {0} where the handshake expected {1}")]
    Unexpected(&'static str, &'static str),
    #[error("authentication failed: {0}")]
    Auth(#[from] vrdma_core::wire::auth::AuthError),
    #[error("the handshake took longer than {0:?}")]
    Timeout(Duration),
    #[error("the peer closed the connection ({0:?})")]
    Closed(Option<CloseReason>),
    #[error("refused: this daemon dials, or has dialled, the peer itself")]
    Refused,
    #[error(
        "the peer's Hello carries this daemon's own id {0:#x}: our handshake reflected back at us, \
         or two daemons configured with the same net.id"
    )]
    Reflected(u64),
    #[error("dialled the daemon of GID {expected}, but the one that answered says it is {said}")]
    NotThePeer { expected: Gid, said: Gid },
}

impl HandshakeError {
    /// Whether the peer closed with reason `Normal`: what an acceptor
    /// sends, after our Auth checked out and before its own Auth, when
    /// its `admit` says no (it dials us, or has dialled us, itself): its
    /// own connection to us is coming, or there. Nothing authenticates
    /// it (it comes before the acceptor's Auth, and `read_frame` takes a
    /// Close at any point, even in place of the Hello): anyone answering
    /// at the address dialled, without the key, can send it. So the caller
    /// may only make things wait on it, for a bounded time
    /// ([`super::Net::dial_crossed`]: at most the handshake's limit, and
    /// nothing goes by an unverified link for it). A key failure
    /// (`AuthFailed`, `VersionMismatch`), a dropped connection (`None`)
    /// or a timeout is not this.
    pub fn refused_by_peer(&self) -> bool {
        matches!(self, HandshakeError::Closed(Some(CloseReason::Normal)))
    }
}

fn frame_name(f: &FrameRepr) -> &'static str {
    match f {
        FrameRepr::Hello(_) => "Hello",
        FrameRepr::Auth(_) => "Auth",
        FrameRepr::Keepalive(_) => "Keepalive",
        FrameRepr::Close(_) => "Close",
        FrameRepr::Cm { .. } => "a connection manager's frame",
        FrameRepr::Moved(_) => "a Moved frame",
        FrameRepr::Sock { .. } => "a socket registry's frame",
        FrameRepr::Data(_) => "a data frame",
    }
}

/// Reads one frame header (control frames carry no payload) by the deadline.
fn read_frame(
    s: &mut TcpStream,
    dec: &mut FrameDecoder,
    deadline: Instant,
    limit: Duration,
) -> Result<FrameRepr, HandshakeError> {
    let mut byte = [0u8; 128];
    loop {
        let left = deadline.checked_duration_since(Instant::now()).ok_or(HandshakeError::Timeout(limit))?;
        s.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
        let want = match dec.want() {
            vrdma_core::wire::Want::Header(n) => n.min(byte.len()),
            vrdma_core::wire::Want::Payload(_) => {
                return Err(HandshakeError::Unexpected("a payload", "a control frame"))
            }
            vrdma_core::wire::Want::Failed(e) => return Err(e.into()),
        };
        let n = match s.read(&mut byte[..want]) {
            Ok(0) => return Err(HandshakeError::Closed(None)),
            Ok(n) => n,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return Err(HandshakeError::Timeout(limit))
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        };
        let mut at = 0;
        while at < n {
            let (used, ev) = dec.feed(&byte[at..n])?;
            at += used;
            match ev {
                Some(Event::Header(FrameRepr::Close(c))) => {
                    return Err(HandshakeError::Closed(Some(c.reason)))
                }
                Some(Event::Header(f)) => {
                    debug_assert_eq!(at, n, "read no further than the header");
                    return Ok(f);
                }
                Some(Event::Payload { .. }) => {
                    return Err(HandshakeError::Unexpected("a payload", "a control frame"))
                }
                None => {}
            }
        }
    }
}

fn send(s: &mut TcpStream, f: &FrameRepr) -> Result<(), HandshakeError> {
    let mut b = [0u8; vrdma_core::wire::MAX_HEADER_LEN];
    let n = f.emit(&mut b)?;
    s.write_all(&b[..n])?;
    Ok(())
}

/// Tells the peer why we are leaving, if it still listens.
pub fn send_close(s: &mut TcpStream, reason: CloseReason) {
    let _ = s.set_write_timeout(Some(Duration::from_millis(100)));
    let _ = send(s, &FrameRepr::Close(CloseRepr { reason, detail: 0 }));
    let _ = s.shutdown(std::net::Shutdown::Both);
}

/// Runs the handshake in `role`; on success the socket is ready for data
/// frames, and the peer is who the pre-shared key says.
pub fn handshake(
    s: &mut TcpStream,
    role: Role,
    me: &Identity,
    limit: Duration,
) -> Result<Peer, HandshakeError> {
    run(s, role, me, limit, None, |_| true)
}

/// The initiator's handshake; with `expect`, the peer's Hello must say
/// that GID (a dial made because a QP names it).
pub fn dial_handshake(
    s: &mut TcpStream,
    me: &Identity,
    limit: Duration,
    expect: Option<Gid>,
) -> Result<Peer, HandshakeError> {
    run(s, Role::Initiator, me, limit, expect, |_| true)
}

/// The acceptor's handshake, which asks `admit` about the peer once it has
/// proved it holds the key, before it sends its own Auth; refused, it
/// closes the connection (reason `Normal`: no QP used it), so the
/// initiator's handshake fails too and neither side ever has a link.
pub fn handshake_admitting(
    s: &mut TcpStream,
    me: &Identity,
    limit: Duration,
    admit: impl FnOnce(&HelloRepr) -> bool,
) -> Result<Peer, HandshakeError> {
    run(s, Role::Acceptor, me, limit, None, admit)
}

fn run(
    s: &mut TcpStream,
    role: Role,
    me: &Identity,
    limit: Duration,
    expect: Option<Gid>,
    admit: impl FnOnce(&HelloRepr) -> bool,
) -> Result<Peer, HandshakeError> {
    let deadline = Instant::now() + limit;
    s.set_write_timeout(Some(limit))?;
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::fill(&mut nonce).map_err(|e| std::io::Error::other(e.to_string()))?;
    let mut hello = HelloRepr::new(role, me.daemon_id, me.gid, me.lid, nonce);
    hello.max_chunk = me.max_chunk;
    send(s, &FrameRepr::Hello(hello))?;
    let mut dec = FrameDecoder::new();
    // A daemon sends its Hello as soon as it is connected; a connection
    // that does not is dropped sooner than the whole handshake's limit, so
    // that strangers hold the acceptor's handshake slots for less.
    let hello_limit = limit.min(HELLO_LIMIT);
    let peer = match read_frame(s, &mut dec, deadline.min(Instant::now() + hello_limit), hello_limit)? {
        FrameRepr::Hello(h) => h,
        other => return Err(HandshakeError::Unexpected(frame_name(&other), "Hello")),
    };
    let version = match hello.negotiate_version(&peer) {
        Ok(v) => v,
        Err(e) => {
            send_close(s, CloseReason::VersionMismatch);
            return Err(HandshakeError::Version(e));
        }
    };
    if peer.daemon_id == me.daemon_id {
        send_close(s, CloseReason::AuthFailed);
        return Err(HandshakeError::Reflected(peer.daemon_id));
    }
    if let Some(expected) = expect.filter(|g| *g != peer.gid) {
        send_close(s, CloseReason::AuthFailed);
        return Err(HandshakeError::NotThePeer { expected, said: peer.gid });
    }
    let tag = match local_tag(&me.psk, &hello, &peer) {
        Ok(t) => t,
        Err(e) => {
            send_close(s, CloseReason::AuthFailed);
            return Err(e.into());
        }
    };
    if role == Role::Initiator {
        send(s, &FrameRepr::Auth(tag))?;
    }
    let theirs = match read_frame(s, &mut dec, deadline, limit)? {
        FrameRepr::Auth(t) => t,
        other => {
            send_close(s, CloseReason::AuthFailed);
            return Err(HandshakeError::Unexpected(frame_name(&other), "Auth"));
        }
    };
    if let Err(e) = verify_peer(&me.psk, &hello, &peer, &theirs) {
        send_close(s, CloseReason::AuthFailed);
        return Err(e.into());
    }
    if role == Role::Acceptor {
        if !admit(&peer) {
            send_close(s, CloseReason::Normal);
            return Err(HandshakeError::Refused);
        }
        send(s, &FrameRepr::Auth(tag))?;
    }
    s.set_read_timeout(None)?;
    s.set_write_timeout(None)?;
    Ok(Peer { hello: peer, chunk: hello.negotiate_chunk(&peer), version })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn id(n: u64, key: &[u8]) -> Identity {
        Identity {
            daemon_id: n,
            gid: Gid::from_ipv4([10, 0, 0, n as u8]),
            lid: n as u16,
            max_chunk: 4096,
            psk: key.to_vec(),
        }
    }

    fn pair(
        ka: &'static [u8],
        kb: &'static [u8],
    ) -> (Result<Peer, HandshakeError>, Result<Peer, HandshakeError>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            handshake(&mut s, Role::Acceptor, &id(2, kb), Duration::from_secs(2))
        });
        let mut c = TcpStream::connect(addr).unwrap();
        let a = handshake(&mut c, Role::Initiator, &id(1, ka), Duration::from_secs(2));
        (a, t.join().unwrap())
    }

    /// A daemon that speaks only wire version 1 (no migration extension):
    /// its Hello is read, the link refused with VersionMismatch and an
    /// error that says which versions each side speaks.
    #[test]
    fn a_version_one_daemon_is_refused_at_the_hello_saying_why() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            handshake(&mut s, Role::Acceptor, &id(2, b"0123456789abcdef"), Duration::from_secs(2))
        });
        let mut c = TcpStream::connect(addr).unwrap();
        let mut old = HelloRepr::new(Role::Initiator, 1, Gid::from_ipv4([10, 0, 0, 1]), 1, [3; NONCE_LEN]);
        old.min_version = 1;
        old.max_version = 1;
        send(&mut c, &FrameRepr::Hello(old)).unwrap();
        let mut dec = FrameDecoder::new();
        let limit = Duration::from_secs(2);
        let deadline = Instant::now() + limit;
        let theirs = read_frame(&mut c, &mut dec, deadline, limit).unwrap();
        assert!(matches!(theirs, FrameRepr::Hello(h) if h.min_version == 2), "{theirs:?}");
        let r = read_frame(&mut c, &mut dec, deadline, limit);
        assert!(matches!(r, Err(HandshakeError::Closed(Some(CloseReason::VersionMismatch)))), "{r:?}");
        let e = t.join().unwrap().unwrap_err();
        assert!(matches!(e, HandshakeError::Version(_)), "{e:?}");
        assert!(e.to_string().contains("peer speaks 1..=1"), "{e}");
    }

    #[test]
    fn peers_with_the_same_key_learn_each_other() {
        let (a, b) = pair(b"0123456789abcdef", b"0123456789abcdef");
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a.hello.daemon_id, 2);
        assert_eq!(b.hello.gid, Gid::from_ipv4([10, 0, 0, 1]));
        assert_eq!(a.chunk, 4096);
    }

    #[test]
    fn an_acceptor_that_refuses_the_peer_leaves_neither_side_linked() {
        let (addr, t) = admitting_acceptor(Duration::from_secs(2), false);
        let mut c = TcpStream::connect(addr).unwrap();
        let a = handshake(&mut c, Role::Initiator, &id(1, b"0123456789abcdef"), Duration::from_secs(2));
        let (b, asked) = t.join().unwrap();
        assert_eq!(asked, Some(Gid::from_ipv4([10, 0, 0, 1])), "admit sees the peer's Hello");
        assert!(matches!(b, Err(HandshakeError::Refused)), "{b:?}");
        assert!(matches!(a, Err(HandshakeError::Closed(Some(CloseReason::Normal)))), "{a:?}");
        assert!(a.is_err_and(|e| e.refused_by_peer()), "the dialler reads it as a refusal");
    }

    /// What is not a crossing refusal: a key failure, a dropped
    /// connection, a timeout. And what is, though it proves nothing (M-A
    /// of review 2): a bare `Close(Normal)` from anyone, with no Hello;
    /// its effect is bounded by `Net::dial_crossed`.
    #[test]
    fn only_a_close_normal_reads_as_a_refusal_and_a_strangers_does_too() {
        let (a, b) = pair(b"0123456789abcdef", b"fedcba9876543210");
        let (a, b) = (a.unwrap_err(), b.unwrap_err());
        assert!(!a.refused_by_peer() && !b.refused_by_peer(), "{a:?} / {b:?}");
        let gid = Some(Gid::from_ipv4([10, 0, 0, 2]));
        let bare = |frame: Option<FrameRepr>| {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            let t = std::thread::spawn(move || {
                let (mut s, _) = l.accept().unwrap();
                if let Some(f) = frame {
                    send(&mut s, &f).unwrap();
                    std::thread::sleep(Duration::from_millis(200));
                }
            });
            let mut c = TcpStream::connect(addr).unwrap();
            let r = dial_handshake(&mut c, &id(1, b"0123456789abcdef"), Duration::from_secs(2), gid);
            t.join().unwrap();
            r.unwrap_err()
        };
        let dropped = bare(None);
        // (EOF, or a reset: our Hello was left unread.)
        let eof_or_reset = matches!(dropped, HandshakeError::Closed(None) | HandshakeError::Io(_));
        assert!(eof_or_reset && !dropped.refused_by_peer(), "{dropped:?}");
        let close = |reason| Some(FrameRepr::Close(CloseRepr { reason, detail: 0 }));
        let failed = bare(close(CloseReason::AuthFailed));
        assert!(!failed.refused_by_peer(), "{failed:?}");
        assert!(!HandshakeError::Timeout(Duration::from_secs(1)).refused_by_peer());
        let stranger = bare(close(CloseReason::Normal));
        assert!(stranger.refused_by_peer(), "unauthenticated, and read as a refusal: {stranger:?}");
    }

    /// An acceptor (daemon 2) on a port of its own that runs `n`
    /// handshakes with deadline `limit`: their results and how long each took.
    #[allow(clippy::type_complexity)]
    fn acceptor(
        n: usize,
        limit: Duration,
    ) -> (std::net::SocketAddr, std::thread::JoinHandle<Vec<(Result<Peer, HandshakeError>, Duration)>>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            (0..n)
                .map(|_| {
                    let (mut s, _) = l.accept().unwrap();
                    let start = Instant::now();
                    (handshake(&mut s, Role::Acceptor, &id(2, b"0123456789abcdef"), limit), start.elapsed())
                })
                .collect()
        });
        (addr, t)
    }

    /// An acceptor (daemon 2) on a port of its own whose `admit` answers
    /// `answer`: the handshake's result, and the GID `admit` was asked
    /// about, if it was.
    #[allow(clippy::type_complexity)]
    fn admitting_acceptor(
        limit: Duration,
        answer: bool,
    ) -> (std::net::SocketAddr, std::thread::JoinHandle<(Result<Peer, HandshakeError>, Option<Gid>)>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut asked = None;
            let r = handshake_admitting(&mut s, &id(2, b"0123456789abcdef"), limit, |h| {
                asked = Some(h.gid);
                answer
            });
            (r, asked)
        });
        (addr, t)
    }

    /// Reads the raw bytes of the next frame, or None once the peer closed.
    fn raw_frame(s: &mut TcpStream) -> Option<(FrameRepr, Vec<u8>)> {
        let mut dec = FrameDecoder::new();
        let mut bytes = Vec::new();
        let mut b = [0u8; 1];
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        loop {
            if s.read(&mut b).ok()? == 0 {
                return None;
            }
            bytes.push(b[0]);
            if let (_, Some(Event::Header(f))) = dec.feed(&b).unwrap() {
                return Some((f, bytes));
            }
        }
    }

    #[test]
    fn a_stranger_that_reflects_our_own_handshake_at_us_is_refused() {
        // Daemon A listens and, at a tenant's request, dials stranger X, who
        // holds no key and answers each of A's connections with A's own
        // frames from the other.
        let a = || id(42, b"0123456789abcdef-secret");
        let a_listen = TcpListener::bind("127.0.0.1:0").unwrap();
        let a_addr = a_listen.local_addr().unwrap();
        let accepting = std::thread::spawn(move || {
            let (mut s, _) = a_listen.accept().unwrap();
            handshake_admitting(&mut s, &a(), Duration::from_secs(3), |_| true)
        });
        let x_listen = TcpListener::bind("127.0.0.1:0").unwrap();
        let x_addr = x_listen.local_addr().unwrap();
        let dialling = std::thread::spawn(move || {
            let mut s = TcpStream::connect(x_addr).unwrap();
            dial_handshake(&mut s, &a(), Duration::from_secs(3), None)
        });
        let (mut c1, _) = x_listen.accept().unwrap();
        let (_, a_initiator_hello) = raw_frame(&mut c1).unwrap();
        let mut c2 = TcpStream::connect(a_addr).unwrap();
        let (_, a_acceptor_hello) = raw_frame(&mut c2).unwrap();
        c2.write_all(&a_initiator_hello).unwrap();
        c1.write_all(&a_acceptor_hello).unwrap();
        // Neither connection yields a tag to replay on the other.
        for c in [&mut c1, &mut c2] {
            let next = raw_frame(c).map(|(f, _)| f);
            assert!(!matches!(next, Some(FrameRepr::Auth(_))), "A proved itself to a stranger: {next:?}");
        }
        let (d, acc) = (dialling.join().unwrap(), accepting.join().unwrap());
        assert!(matches!(d, Err(HandshakeError::Reflected(42))), "{d:?}");
        assert!(matches!(acc, Err(HandshakeError::Reflected(42))), "{acc:?}");
    }

    #[test]
    fn the_acceptor_proves_nothing_and_admits_nothing_before_the_initiator_proves_the_key() {
        let (addr, t) = admitting_acceptor(Duration::from_millis(500), true);
        // A stranger: a well-formed Hello, then it waits for the acceptor's Auth.
        let mut c = TcpStream::connect(addr).unwrap();
        let (f, _) = raw_frame(&mut c).unwrap();
        assert!(matches!(f, FrameRepr::Hello(_)), "{f:?}");
        let hello = HelloRepr::new(Role::Initiator, 7, Gid::from_ipv4([10, 0, 0, 7]), 7, [9; NONCE_LEN]);
        send(&mut c, &FrameRepr::Hello(hello)).unwrap();
        let next = raw_frame(&mut c).map(|(f, _)| f);
        assert!(!matches!(next, Some(FrameRepr::Auth(_))), "the acceptor proved itself first: {next:?}");
        let (r, asked) = t.join().unwrap();
        assert!(matches!(r, Err(HandshakeError::Timeout(_))), "{r:?}");
        assert_eq!(asked, None, "admit asked about a peer that proved nothing");

        // And a peer with the wrong key is not asked about either.
        let (addr, t) = admitting_acceptor(Duration::from_secs(2), true);
        let mut c = TcpStream::connect(addr).unwrap();
        let a = handshake(&mut c, Role::Initiator, &id(1, b"fedcba9876543210"), Duration::from_secs(2));
        let (r, asked) = t.join().unwrap();
        assert!(a.is_err() && r.is_err(), "{a:?} {r:?}");
        assert_eq!(asked, None);
    }

    #[test]
    fn a_dial_for_a_gid_must_reach_the_daemon_of_that_gid() {
        let (addr, t) = acceptor(2, Duration::from_secs(2));
        let key = b"0123456789abcdef";
        let mut c = TcpStream::connect(addr).unwrap();
        let other = Gid::from_ipv4([10, 0, 0, 3]);
        let wrong = dial_handshake(&mut c, &id(1, key), Duration::from_secs(2), Some(other));
        assert!(
            matches!(wrong, Err(HandshakeError::NotThePeer { expected, said }) if expected == other && said == Gid::from_ipv4([10, 0, 0, 2])),
            "{wrong:?}"
        );
        let mut c = TcpStream::connect(addr).unwrap();
        let right =
            dial_handshake(&mut c, &id(1, key), Duration::from_secs(2), Some(Gid::from_ipv4([10, 0, 0, 2])));
        assert!(right.is_ok(), "{right:?}");
        let acc = t.join().unwrap();
        assert!(
            matches!(acc[0].0, Err(HandshakeError::Closed(Some(CloseReason::AuthFailed)))),
            "{:?}",
            acc[0].0
        );
        assert!(acc[1].0.is_ok());
    }

    #[test]
    fn a_wrong_key_fails_on_both_sides() {
        let (a, b) = pair(b"0123456789abcdef", b"fedcba9876543210");
        assert!(a.is_err());
        assert!(b.is_err());
    }

    #[test]
    fn garbage_and_silence_are_refused_within_the_deadline() {
        let (addr, t) = acceptor(2, Duration::from_millis(300));
        let mut g = TcpStream::connect(addr).unwrap();
        g.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let _silent = TcpStream::connect(addr).unwrap();
        let out = t.join().unwrap();
        assert!(matches!(out[0].0, Err(HandshakeError::Wire(_))), "{:?}", out[0].0);
        assert!(matches!(out[1].0, Err(HandshakeError::Timeout(_))), "{:?}", out[1].0);
        assert!(out[1].1 < Duration::from_secs(2));
        // With a long handshake limit, a silent connection still goes
        // once the Hello is overdue.
        let (addr, t) = acceptor(1, Duration::from_secs(10));
        let _silent = TcpStream::connect(addr).unwrap();
        let out = t.join().unwrap();
        assert!(matches!(out[0].0, Err(HandshakeError::Timeout(_))), "{:?}", out[0].0);
        assert!(out[0].1 >= HELLO_LIMIT && out[0].1 < HELLO_LIMIT * 3, "{:?}", out[0].1);
    }
}
