//! The link taking a moved context back, against a scripted daemon on a
//! Unix socket (as an emulated guest's port): a call the old port left
//! unanswered goes again on the new one, once; the context's doorbell and
//! event signal keep their descriptors and reach the new proxies; a
//! refused adoption is tried again; a context never taken back ends
//! the link after the bound, saying why; and a silent port is probed, so
//! that a context making no call is taken back too.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use vrdma_core::proto::guest::{encode, EndReason, Frame, FrameDecoder, Handle, GUEST_VERSION, HELLO_ACK};
use vrdma_core::proto::{Reply, Request, RingSpec, PROTOCOL_VERSION};

use super::link::GuestLink;
use super::GuestConfig;

const CONTEXT: u32 = 0x0300_0007;
const SEGMENT: Handle = Handle::Extent { offset: 4096, len: 8192 };

/// The daemon's end of one port connection.
struct Port {
    conn: UnixStream,
    dec: FrameDecoder,
    /// Bells the guest rang, by proxy.
    bells: Vec<u32>,
    /// The number of the last call (`None`: an unnumbered `Call`).
    number: Option<u64>,
}

impl Port {
    fn accept(l: &UnixListener) -> Port {
        let (conn, _) = l.accept().unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Port { conn, dec: FrameDecoder::new(), bells: Vec::new(), number: None }
    }

    fn send(&mut self, f: &Frame) {
        self.conn.write_all(&encode(f)).unwrap();
    }

    /// The next frame that is neither a bell (recorded) nor a probe (a
    /// `Pong` the link sends on a port silent for a second).
    fn next(&mut self) -> Frame {
        loop {
            match self.next_any() {
                Frame::Pong { .. } => {}
                f => return f,
            }
        }
    }

    /// The next frame that is not a bell (recorded).
    fn next_any(&mut self) -> Frame {
        let mut buf = [0u8; 4096];
        loop {
            match self.dec.next_frame().unwrap() {
                Some(Frame::Bell { id, .. }) => self.bells.push(id),
                Some(f) => return f,
                None => {
                    let n = self.conn.read(&mut buf).unwrap();
                    assert!(n > 0, "the guest closed the port");
                    self.dec.push(&buf[..n]);
                }
            }
        }
    }

    fn call(&mut self) -> Request {
        let (number, r) = match self.next() {
            Frame::Call(r) => (None, r),
            Frame::NumberedCall { number, req } => (Some(number), req),
            f => panic!("expected a call, got {f:?}"),
        };
        self.number = number;
        r
    }

    fn reply(&mut self, reply: Reply, handles: Vec<Handle>) {
        self.send(&Frame::Reply { reply, handles });
    }

    /// The transport's Hello, acknowledged as the daemon does.
    fn hello(&mut self) {
        assert_eq!(self.next(), Frame::Hello { version: GUEST_VERSION });
        self.send(&Frame::Ping { nonce: HELLO_ACK });
    }

    /// Hello, then `first` (Hello or AdoptContext) answered as Hello with
    /// doorbell proxies `bells`.
    fn open_session(&mut self, adopt: bool, bells: (u32, u32)) {
        self.hello();
        let want = if adopt {
            Request::AdoptContext { version: PROTOCOL_VERSION, context: CONTEXT }
        } else {
            Request::Hello { version: PROTOCOL_VERSION }
        };
        assert_eq!(self.call(), want);
        self.reply(hello(), vec![SEGMENT, bell(bells.0, false), bell(bells.1, true)]);
    }
}

/// A test's folder with the port's socket and a stand-in BAR, removed
/// when the test ends (also when it fails).
struct Scene {
    dir: std::path::PathBuf,
}

impl Scene {
    fn new(tag: &str) -> Scene {
        let dir = std::env::temp_dir().join(format!("{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("bar"), vec![0u8; 1 << 16]).unwrap();
        Scene { dir }
    }

    /// The daemon's end: the port's listening socket.
    fn listener(&self) -> UnixListener {
        UnixListener::bind(self.dir.join("port")).unwrap()
    }

    /// The guest's configuration: that port and the BAR.
    fn cfg(&self) -> GuestConfig {
        GuestConfig { ports: vec![self.dir.join("port")], bar: self.dir.join("bar") }
    }
}

impl Drop for Scene {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn hello() -> Reply {
    let ring = RingSpec { offset: 0, capacity: 4, stride: 64 };
    Reply::Hello {
        context: CONTEXT,
        tenant: 1000,
        device_name: "vrdma0".into(),
        segment_len: 8192,
        async_ring: ring,
        posted_ring: ring,
        channels: Vec::new(),
    }
}

fn bell(id: u32, hangup: bool) -> Handle {
    Handle::Bell { id, hangup }
}

fn readable(fd: &OwnedFd, within: Duration) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::new(fd, PollFlags::IN)];
    let ts = Timespec::try_from(within).unwrap();
    matches!(rustix::event::poll(&mut fds, Some(&ts)), Ok(1))
}

#[test]
fn a_moved_context_is_taken_back_under_the_same_descriptors_then_lost_after_the_bound() {
    let scene = Scene::new("vrdma-reattach");
    let (listener, cfg) = (scene.listener(), scene.cfg());
    let limit = Duration::from_millis(400);

    let daemon = std::thread::spawn(move || {
        // The first port: the session, then a call it leaves unanswered.
        let mut a = Port::accept(&listener);
        a.open_session(false, (1, 2));
        assert_eq!(a.call(), Request::DeallocPd { pd: 9 });
        // Hello opens the context unnumbered; its first call is number 1.
        assert_eq!(a.number, Some(1));
        a.send(&Frame::Ended { reason: EndReason::Moved });
        // The destination refuses once (not imported yet), then hands
        // the context over with new proxies 5 and 6.
        let mut b = Port::accept(&listener);
        b.hello();
        assert!(matches!(b.call(), Request::AdoptContext { context: CONTEXT, .. }));
        b.reply(Reply::Error { errno: libc::ENOENT, message: "not imported here".into() }, Vec::new());
        let mut c = Port::accept(&listener);
        c.open_session(true, (5, 6));
        assert_eq!(c.number, None, "AdoptContext is not numbered");
        // The call again, once, on the new port, with its number (the
        // daemon there answers it from memory if the source ran it);
        // answered there.
        assert_eq!(c.call(), Request::DeallocPd { pd: 9 });
        assert_eq!(c.number, Some(1), "sent again under its own number");
        c.reply(Reply::Done, Vec::new());
        // The library's doorbell reaches proxy 5; proxy 6 rings its
        // event signal.
        assert_eq!(c.call(), Request::DeallocPd { pd: 10 });
        assert_eq!(c.number, Some(2), "the next call, the next number");
        c.reply(Reply::Done, Vec::new());
        c.send(&Frame::Bell { id: 6, count: 1 });
        // The guest rang the doorbell meanwhile (and the link once after
        // the adoption, for what was posted while it moved).
        let end = Instant::now() + Duration::from_secs(10);
        while c.bells.iter().filter(|&&b| b == 5).count() < 2 {
            assert!(Instant::now() < end, "bells at the new port: {:?}", c.bells);
            let _ = c.next_with_timeout();
        }
        assert!(!c.bells.contains(&1), "a bell under the old number: {:?}", c.bells);
        // Moved again, and this time nobody takes it back.
        c.send(&Frame::Ended { reason: EndReason::Moved });
        listener.set_nonblocking(true).unwrap();
        let end = Instant::now() + Duration::from_secs(2);
        let mut tries = 0;
        while Instant::now() < end {
            match listener.accept() {
                Ok((conn, _)) => {
                    // The link may have given up meanwhile: what fails
                    // here is not the test's business.
                    tries += 1;
                    let _ = conn.set_nonblocking(false);
                    let mut conn = conn;
                    let no = Frame::Reply {
                        reply: Reply::Error { errno: libc::ENOENT, message: "no such context".into() },
                        handles: Vec::new(),
                    };
                    let mut out = encode(&Frame::Ping { nonce: HELLO_ACK });
                    out.extend(encode(&no));
                    let _ = conn.write_all(&out);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
        tries
    });

    let link = GuestLink::open_with(&cfg, limit).unwrap();
    let (reply, mut carried) = link.call(&Request::Hello { version: PROTOCOL_VERSION }).unwrap();
    assert_eq!(reply, hello());
    assert_eq!(carried.len(), 3);
    let (events, _) = carried.pop().unwrap();
    let (doorbell, _) = carried.pop().unwrap();
    // Sent on the first port, answered on the third.
    assert_eq!(link.call(&Request::DeallocPd { pd: 9 }).unwrap().0, Reply::Done);
    rustix::net::send(&doorbell, &[1], rustix::net::SendFlags::DONTWAIT).unwrap();
    assert_eq!(link.call(&Request::DeallocPd { pd: 10 }).unwrap().0, Reply::Done);
    assert!(readable(&events, Duration::from_secs(10)), "the event signal did not ring");
    let mut b = [0u8; 8];
    assert_eq!(rustix::net::recv(&events, &mut b, rustix::net::RecvFlags::DONTWAIT).unwrap().0, 1);
    // After the second move: calls wait the bound, then fail saying why,
    // and both the link and the event signal hang up.
    let start = Instant::now();
    let e = loop {
        match link.call(&Request::DeallocPd { pd: 11 }) {
            Err(e) => break e,
            // Answered before the second end reached the link: again.
            Ok(_) => assert!(start.elapsed() < Duration::from_secs(10)),
        }
    };
    assert!(start.elapsed() >= limit - Duration::from_millis(100), "failed after {:?}", start.elapsed());
    assert!(e.to_string().contains("not taken back within"), "{e}");
    assert!(readable(link.gone_fd(), Duration::from_secs(5)), "the link did not hang up");
    assert!(readable(&events, Duration::from_secs(5)));
    assert_eq!(rustix::net::recv(&events, &mut b, rustix::net::RecvFlags::DONTWAIT).unwrap().0, 0, "hung up");
    drop(link);
    let tries = daemon.join().unwrap();
    assert!(tries >= 2, "the adoption was tried {tries} times");
}

/// A call whose reply the VM's move lost (the source wrote it into its
/// port after QEMU stopped the VM; no `Ended` follows): the call probes
/// the port, which now reaches the destination; told there that the port
/// holds no session, the link takes the context back and sends the call
/// again. (It waited 60 s, then the device was gone.)
/// What an earlier opener of the port left unread (QEMU hands the next
/// program what the daemon wrote while none had the port open: a dead
/// program's last reply, an end for its session) is not taken as this
/// program's: frames before the daemon's `HELLO_ACK` are dropped. (Taken,
/// the stale reply answered the new program's Hello and
/// `ibv_get_device_list` found no device, 2 of 20 real-guest runs.)
#[test]
fn frames_an_earlier_opener_left_on_the_port_are_not_taken_as_ours() {
    let scene = Scene::new("vrdma-reattach-stale");
    let (listener, cfg) = (scene.listener(), scene.cfg());

    let daemon = std::thread::spawn(move || {
        let mut a = Port::accept(&listener);
        // Left over from the port's previous opener, ahead of anything
        // written for this one.
        let stale = Frame::Reply {
            reply: Reply::Error { errno: libc::ENOENT, message: "nothing to adopt".into() },
            handles: Vec::new(),
        };
        a.send(&stale);
        a.send(&Frame::Ended { reason: EndReason::Moved });
        a.send(&Frame::Ping { nonce: 7 });
        a.open_session(false, (1, 2));
        assert_eq!(a.call(), Request::DeallocPd { pd: 3 });
        a.reply(Reply::Done, Vec::new());
    });

    let link = GuestLink::open_with(&cfg, Duration::from_secs(10)).unwrap();
    let (reply, carried) = link.call(&Request::Hello { version: PROTOCOL_VERSION }).unwrap();
    assert_eq!(reply, hello(), "a stale frame was taken as the Hello's reply");
    assert_eq!(carried.len(), 3);
    assert_eq!(link.call(&Request::DeallocPd { pd: 3 }).unwrap().0, Reply::Done);
    daemon.join().unwrap();
    drop(link);
}

/// The last adoption try of a context never taken back: its answer
/// comes after the bound passed, and the link reads it before it lets the
/// port go. Left unread in a virtio port (QEMU keeps what the daemon
/// writes while no program holds the port), the try's `HELLO_ACK` and
/// refusal were taken by the port's next opener as the answers to its own
/// Hello ("nothing to adopt": no device; a real guest's next program
/// after a `DEVICE_FATAL`, half of the runs under load). Here the port is
/// a Unix socket: closed with the answer unread, the daemon's read gets
/// `ECONNRESET` (or its write `EPIPE`) instead of the end.
#[test]
fn the_last_adoption_try_reads_its_answer_before_the_port_goes() {
    let scene = Scene::new("vrdma-reattach-last");
    let (listener, cfg) = (scene.listener(), scene.cfg());
    let limit = Duration::from_millis(300);

    let daemon = std::thread::spawn(move || {
        let mut a = Port::accept(&listener);
        a.open_session(false, (1, 2));
        // A call (so the link holds its context), then the move.
        assert_eq!(a.call(), Request::DeallocPd { pd: 1 });
        a.send(&Frame::Ended { reason: EndReason::Moved });
        let ended = Instant::now();
        // The first try: acknowledged at once, refused after the bound.
        let mut b = Port::accept(&listener);
        b.hello();
        assert!(matches!(b.call(), Request::AdoptContext { context: CONTEXT, .. }));
        std::thread::sleep((limit + Duration::from_millis(400)).saturating_sub(ended.elapsed()));
        let no = Frame::Reply {
            reply: Reply::Error { errno: libc::ENOENT, message: "nothing to adopt".into() },
            handles: Vec::new(),
        };
        let wrote = b.conn.write_all(&encode(&no)).map_err(|e| e.to_string());
        // The link lets the port go once it read the answer: the end,
        // not a reset.
        let mut rest = Vec::new();
        let read = b.conn.read_to_end(&mut rest).map_err(|e| e.to_string());
        (wrote, read)
    });

    let link = GuestLink::open_with(&cfg, limit).unwrap();
    let (_, _carried) = link.call(&Request::Hello { version: PROTOCOL_VERSION }).unwrap();
    let e = link.call(&Request::DeallocPd { pd: 1 }).unwrap_err();
    assert!(readable(link.gone_fd(), Duration::from_secs(10)), "the link did not hang up");
    let (wrote, read) = daemon.join().unwrap();
    assert_eq!(wrote, Ok(()), "the link let the port go before the answer came");
    assert!(read.is_ok(), "the link let the port go with the answer unread: {read:?}");
    assert!(e.to_string().contains("nothing to adopt"), "the last try's answer was not read: {e}");
    drop(link);
}

#[test]
fn a_call_whose_reply_the_move_lost_probes_and_goes_again_where_the_context_went() {
    let scene = Scene::new("vrdma-reattach-lost");
    let (listener, cfg) = (scene.listener(), scene.cfg());

    let daemon = std::thread::spawn(move || {
        let mut a = Port::accept(&listener);
        a.open_session(false, (1, 2));
        // The call, whose reply is lost: nothing more comes from the
        // source. The port now reaches the destination, which hears the
        // probe on a port with no session, and says so.
        assert_eq!(a.call(), Request::QueryQp { qp: 9 });
        let first = a.number;
        let probed = Instant::now();
        let f = a.next_any();
        assert!(matches!(f, Frame::Pong { .. }), "no probe: {f:?}");
        let waited = probed.elapsed();
        a.send(&Frame::Ended { reason: EndReason::NoSession });
        let mut c = Port::accept(&listener);
        c.open_session(true, (5, 6));
        assert_eq!(c.call(), Request::QueryQp { qp: 9 });
        assert_eq!((first, c.number), (Some(1), Some(1)), "sent again under its own number");
        c.reply(Reply::Done, Vec::new());
        waited
    });

    let link = GuestLink::open_with(&cfg, Duration::from_secs(10)).unwrap();
    // The context's doorbell and event signal, kept open.
    let (_, _carried) = link.call(&Request::Hello { version: PROTOCOL_VERSION }).unwrap();
    let start = Instant::now();
    assert_eq!(link.call(&Request::QueryQp { qp: 9 }).unwrap().0, Reply::Done);
    let took = start.elapsed();
    let waited = daemon.join().unwrap();
    assert!(took < Duration::from_secs(30), "the call took {took:?}");
    assert!(waited < Duration::from_secs(5), "the probe came {waited:?} after the call");
    drop(link);
}

/// A guest that makes no call (its program waits on a completion
/// channel) and whose port went silent, reaching a daemon with no session
/// on it (the destination of a move whose `Ended` was lost with the
/// source): the link probes the silent port by itself, is told
/// `NoSession`, takes the context back, and the wake-up the destination
/// holds reaches the waiter. (Without the probe nothing told the guest:
/// its waiter waited for ever.)
#[test]
fn a_silent_port_is_probed_and_a_context_making_no_call_is_taken_back() {
    let scene = Scene::new("vrdma-reattach-silent");
    let (listener, cfg) = (scene.listener(), scene.cfg());

    let daemon = std::thread::spawn(move || {
        let mut a = Port::accept(&listener);
        a.open_session(false, (1, 2));
        // Silence: no ping, no reply. The link probes within a second or
        // so of it; the port reaches the destination now, which says it
        // holds no session here.
        let silent = Instant::now();
        let f = a.next_any();
        assert!(matches!(f, Frame::Pong { nonce: 0 }), "no probe: {f:?}");
        let waited = silent.elapsed();
        a.send(&Frame::Ended { reason: EndReason::NoSession });
        let mut c = Port::accept(&listener);
        c.open_session(true, (5, 6));
        // The wake-up the destination held for the context: its event
        // signal rings.
        c.send(&Frame::Bell { id: 6, count: 1 });
        // Kept open until the guest heard it.
        let _ = c.next_with_timeout();
        (waited, c)
    });

    let link = GuestLink::open_with(&cfg, Duration::from_secs(10)).unwrap();
    let (_, mut carried) = link.call(&Request::Hello { version: PROTOCOL_VERSION }).unwrap();
    let (events, _) = carried.pop().unwrap();
    // No call from here on: only a waiter on the event signal.
    assert!(readable(&events, Duration::from_secs(20)), "the waiter was never woken");
    let mut b = [0u8; 8];
    assert_eq!(rustix::net::recv(&events, &mut b, rustix::net::RecvFlags::DONTWAIT).unwrap().0, 1);
    let (waited, _c) = daemon.join().unwrap();
    assert!(waited < Duration::from_secs(5), "the probe came {waited:?} into the silence");
    drop(link);
}

impl Port {
    /// One frame within 100 ms, if any (bells recorded).
    fn next_with_timeout(&mut self) -> Option<Frame> {
        self.conn.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        let mut buf = [0u8; 4096];
        let f = match self.dec.next_frame().unwrap() {
            Some(f) => Some(f),
            None => match self.conn.read(&mut buf) {
                Ok(n) if n > 0 => {
                    self.dec.push(&buf[..n]);
                    self.dec.next_frame().unwrap()
                }
                _ => None,
            },
        };
        self.conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        match f {
            Some(Frame::Bell { id, .. }) => {
                self.bells.push(id);
                None
            }
            f => f,
        }
    }
}

/// A daemon that dies under a running guest whose port never hangs up
/// (seen with real guests: the chardev's end went, the guest's port
/// stayed open and silent): a live daemon answers every probe, so a port
/// that answers none for `DAEMON_SILENT_LIMIT` is the device gone, and
/// the link says so (its `gone` descriptor hangs up, calls fail). Without
/// the bound the guest waited for ever.
#[test]
fn a_port_that_answers_no_probe_is_the_device_gone() {
    let scene = Scene::new("vrdma-reattach-silent-daemon");
    let (listener, cfg) = (scene.listener(), scene.cfg());
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let daemon = std::thread::spawn(move || {
        let mut a = Port::accept(&listener);
        a.open_session(false, (1, 2));
        // Silent from now on, the connection kept open (probes unread).
        let _ = done_rx.recv_timeout(Duration::from_secs(30));
        drop(a);
    });

    let link = GuestLink::open_with(&cfg, Duration::from_secs(10)).unwrap();
    let (_, _carried) = link.call(&Request::Hello { version: PROTOCOL_VERSION }).unwrap();
    let start = Instant::now();
    assert!(readable(link.gone_fd(), Duration::from_secs(20)), "the link never gave the device up");
    let took = start.elapsed();
    assert!(took >= Duration::from_secs(7), "given up after {took:?}, before the bound");
    assert!(link.call(&Request::DeallocPd { pd: 1 }).is_err(), "a call on a gone device succeeded");
    done_tx.send(()).unwrap();
    daemon.join().unwrap();
}

/// An rdma_cm channel's library side as a move sees it: whether the
/// note of the call's reply had finished when the move matched the
/// channel's wake-ups again.
struct Probe {
    noted: std::sync::Arc<std::sync::atomic::AtomicBool>,
    seen: std::sync::Mutex<Option<bool>>,
}

impl super::link::MovedCmChannel for Probe {
    fn moved(&self, _ring: &mut dyn FnMut(usize)) -> (usize, usize) {
        *self.seen.lock().unwrap() = Some(self.noted.load(std::sync::atomic::Ordering::SeqCst));
        (0, 0)
    }
}

/// A reply's note (an rdma_cm reply's events kept, with the wake-ups
/// they stand for) finishes before a move that came right after the
/// reply matches the rdma_cm channels' wake-ups to their kept events
/// again: noted after it, the event was kept with a wake-up the move had
/// dropped and not rung again.
#[test]
fn a_move_right_after_a_reply_waits_for_the_reply_to_be_noted() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use vrdma_core::proto::{CmReply, MovedChannel};
    let scene = Scene::new("vrdma-reattach-note");
    let (listener, cfg) = (scene.listener(), scene.cfg());

    let daemon = std::thread::spawn(move || {
        let mut a = Port::accept(&listener);
        a.open_session(false, (1, 2));
        // An rdma_cm event channel, its doorbell proxy 3.
        assert_eq!(a.call(), Request::DeallocPd { pd: 1 });
        a.reply(Reply::Cm(CmReply::Channel { channel: 9 }), vec![bell(3, true)]);
        // A call answered, and the VM moves right after.
        assert_eq!(a.call(), Request::DeallocPd { pd: 2 });
        a.reply(Reply::Done, Vec::new());
        a.send(&Frame::Ended { reason: EndReason::Moved });
        let mut c = Port::accept(&listener);
        c.hello();
        assert!(matches!(c.call(), Request::AdoptContext { context: CONTEXT, .. }));
        let Reply::Hello { context, tenant, device_name, segment_len, async_ring, posted_ring, .. } = hello()
        else {
            unreachable!()
        };
        let adopted = Reply::Hello {
            context,
            tenant,
            device_name,
            segment_len,
            async_ring,
            posted_ring,
            channels: vec![MovedChannel { channel: 9, raised_before: 0 }],
        };
        c.reply(adopted, vec![SEGMENT, bell(5, false), bell(6, true), bell(7, true)]);
        assert_eq!(c.call(), Request::DeallocPd { pd: 3 });
        c.reply(Reply::Done, Vec::new());
    });

    let link = GuestLink::open_with(&cfg, Duration::from_secs(10)).unwrap();
    let (_, _carried) = link.call(&Request::Hello { version: PROTOCOL_VERSION }).unwrap();
    let (_, _channel) = link.call(&Request::DeallocPd { pd: 1 }).unwrap();
    let noted = Arc::new(AtomicBool::new(false));
    let probe = Arc::new(Probe { noted: noted.clone(), seen: Mutex::new(None) });
    let end: Arc<dyn super::link::MovedCmChannel> = probe.clone();
    link.note_cm_channel(9, Arc::downgrade(&end));
    let (answer, ()) = link
        .call_noting(&Request::DeallocPd { pd: 2 }, |_| {
            // (The move is taken back meanwhile: its Ended and adoption
            // come right after this reply.)
            std::thread::sleep(Duration::from_millis(300));
            noted.store(true, Ordering::SeqCst);
        })
        .unwrap();
    assert_eq!(answer.0, Reply::Done);
    assert_eq!(link.call(&Request::DeallocPd { pd: 3 }).unwrap().0, Reply::Done);
    assert_eq!(
        *probe.seen.lock().unwrap(),
        Some(true),
        "the move matched the wake-ups before the reply was noted"
    );
    daemon.join().unwrap();
    drop(link);
}
