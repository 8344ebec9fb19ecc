//! The registrations' counts, and the epoll waits' decision of connections
//! registered before their first call (`docs/sockets.md`, "More programs
//! tried by hand": issue 20's review).

use super::*;
use crate::owner::Take;
use crate::stream::Elsewhere;
use crate::table::{self, Entry};
use std::cell::Cell;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::mpsc;
use std::time::Duration;

thread_local! {
    /// Stores of the mirrored counts made by this thread ([`mirror`]).
    pub(super) static MIRROR_STORES: Cell<usize> = const { Cell::new(0) };
}

fn reg(data: u64, pending: bool, undecided: bool, stream: Weak<Stream>) -> Reg {
    Reg { events: IN, data, stream, link: Weak::new(), fired: false, stripped: false, pending, undecided }
}

/// A small deterministic generator (xorshift): the sequence is the same
/// in every run.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// A connection, undecided (no call on it yet) and registered for
/// reading in an epoll set of its own: a server's accepted one, claimed,
/// or a client's, announced.
struct Conn {
    /// The other end (plain).
    client: Option<TcpStream>,
    /// The end registered (a server's unless [`Conn::announced`]).
    server: TcpStream,
    /// `None` where the test let it go (the table, the registration's
    /// weak reference and the test's own may hold it).
    stream: Option<Arc<Stream>>,
    ep: c_int,
}

/// A connected pair over loopback: (the connecting end, the accepted
/// end, the connection's tuple).
fn pair() -> (TcpStream, TcpStream, vrdma::sockets::Tuple) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (server, peer) = l.accept().unwrap();
    (client, server, vrdma::sockets::Tuple { client: peer, server: l.local_addr().unwrap() })
}

/// Registers `fd` for reading in `ep` (the interposed `epoll_ctl`).
fn register(ep: c_int, fd: c_int) {
    let mut ev = epoll_event { events: IN, u64: fd as u64 };
    // SAFETY: the interposed epoll_ctl with a valid event.
    assert_eq!(unsafe { epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) }, 0);
}

impl Conn {
    fn new() -> Conn {
        let (client, server, tuple) = pair();
        let stream = Stream::claimed(server.as_raw_fd(), tuple).unwrap();
        Conn::of(client, server, stream)
    }

    /// A client's connection, announced (the accepted end is the peer).
    fn announced() -> Conn {
        let (client, server, tuple) = pair();
        let stream = Stream::announced(client.as_raw_fd(), tuple).unwrap();
        Conn::of(server, client, stream)
    }

    fn of(peer: TcpStream, mine: TcpStream, stream: Arc<Stream>) -> Conn {
        let fd = mine.as_raw_fd();
        table::insert(fd, Entry::Stream(stream.clone()));
        // SAFETY: epoll_create1(2), no pointers.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        assert!(ep >= 0);
        register(ep, fd);
        let c = Conn { client: Some(peer), server: mine, stream: Some(stream), ep };
        assert_eq!(c.undecided(), 1, "registered before its first call: undecided");
        c
    }

    fn stream(&self) -> &Arc<Stream> {
        self.stream.as_ref().expect("let go")
    }

    fn fd(&self) -> c_int {
        self.server.as_raw_fd()
    }

    /// Undecided registrations in its set, by the count kept.
    fn undecided(&self) -> usize {
        let s = sets();
        assert!(s.counted());
        s.sets.get(&self.ep).map_or(0, |x| x.counts.undecided)
    }

    /// An interposed `epoll_wait` on its set.
    fn wait(&self, ms: c_int) -> Vec<epoll_event> {
        let mut ev = [epoll_event { events: 0, u64: 0 }; 8];
        // SAFETY: room for 8 events.
        let n = unsafe { crate::readiness::epoll_wait(self.ep, ev.as_mut_ptr(), 8, ms) };
        assert!(n >= 0, "epoll_wait failed");
        ev[..n as usize].to_vec()
    }

    /// Bytes a read would find on its socket now.
    fn readable(&self) -> bool {
        let mut b = [0u8; 1];
        // SAFETY: libc's recv into our byte.
        let r =
            unsafe { real::recv(self.fd(), b.as_mut_ptr().cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
        r > 0
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        forget(self.ep);
        forget(self.fd());
        table::remove(self.fd());
        // SAFETY: our epoll set, closed once.
        unsafe { real::close(self.ep) };
    }
}

/// Every report of the wait that says `EPOLLIN` has bytes behind it.
fn no_false_readable(c: &Conn, got: &[epoll_event]) {
    for e in got {
        let events = e.events;
        assert!(
            events & IN == 0 || c.readable(),
            "told readable ({events:#x}), but a read would find nothing"
        );
    }
}

/// The counts kept change by change stay what a count over every
/// registration says, through random sequences of every kind of change
/// (issue 20's review: `epoll_ctl` used to count them all each time).
#[test]
fn the_counts_kept_are_the_registrations_through_random_changes() {
    // A live undecided stream for some registrations (its decision stays
    // open: a report of it is to be decided, not cleared).
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let _client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (server, peer) = l.accept().unwrap();
    let tuple = vrdma::sockets::Tuple { client: peer, server: l.local_addr().unwrap() };
    let live = Stream::claimed(server.as_raw_fd(), tuple).unwrap();
    for seed in 1..=20u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let mut s = Sets::new();
        for step in 0..2000 {
            let ep = 100 + rng.below(4) as c_int;
            let fd = 200 + rng.below(24) as c_int;
            match rng.below(9) {
                0..=2 => {
                    let stream = if rng.below(2) == 0 { Arc::downgrade(&live) } else { Weak::new() };
                    let r = reg(rng.below(30), rng.below(2) == 0, rng.below(2) == 0, stream);
                    s.add(ep, fd, r, false);
                }
                3 => s.remove(ep, fd),
                4 => s.forget(if rng.below(3) == 0 { ep } else { fd }),
                5 => drop(s.take_pending(ep)),
                6 => s.nest(ep),
                7 => {
                    let n = rng.below(6) as usize;
                    let events: Vec<_> = (0..n)
                        .map(|i| {
                            (i, epoll_event { events: IN | (rng.below(2) as u32 * OUT), u64: rng.below(30) })
                        })
                        .collect();
                    drop(s.undecided(ep, events.into_iter()));
                }
                _ => {
                    let stream = if rng.below(2) == 0 { Arc::downgrade(&live) } else { Weak::new() };
                    s.decided(ep, fd, &stream)
                }
            }
            assert!(s.counted(), "seed {seed}, step {step}: {:?} kept, {:?} counted", s.counts, s.recount());
        }
    }
    // The live stream is dropped undecided, never taken: nothing to send.
}

/// The peer ended before the connection's first call: a level-triggered
/// report of the end (no hello on the socket, nobody deciding it) is left
/// as the kernel's, and the registration is not looked at again, so that
/// a set holding it pays no decision per wait (issue 20's review).
#[test]
fn an_end_before_the_first_call_is_looked_at_once() {
    let mut c = Conn::new();
    drop(c.client.take());
    let got = c.wait(5000);
    assert_eq!(got.len(), 1, "the end is reported");
    assert_eq!(c.undecided(), 0, "the registration is still looked at for a decision");
    assert!(c.stream().undecided(), "decided by the wait: the program's call decides it");
    // Still reported as the kernel has it (level-triggered).
    assert_eq!(c.wait(0).len(), 1);
}

/// A parent whose forked child took the connection: its wait reports the
/// socket as the kernel has it and stops looking at it for a decision
/// (which would fail, at every report: `EIO`, another process's).
#[test]
fn a_connection_another_process_took_is_not_decided_at_every_report() {
    let mut c = Conn::new();
    let took = crate::pid::in_forked_child(|| c.stream().take() == Take::Mine);
    assert!(took, "the child did not take it");
    c.client.as_mut().unwrap().write_all(b"x").unwrap();
    let got = c.wait(5000);
    assert_eq!(got.len(), 1, "the kernel's report stands");
    assert_eq!(c.undecided(), 0, "still looked at for a decision, at every report");
    assert_eq!(c.stream().elsewhere(), Elsewhere::ForGood);
}

/// A forked child starts with no registrations and counts none (the
/// parent's counts were reset at the child's first look, racing with its
/// other threads' changes).
#[test]
fn a_forked_child_counts_no_registrations() {
    let c = Conn::new();
    let empty = crate::pid::in_forked_child(|| {
        TRACKED.load(Ordering::SeqCst) == 0 && PENDING.load(Ordering::SeqCst) == 0 && !tracks(c.ep) && {
            let s = sets();
            s.sets.is_empty() && s.counts == Counts::default()
        }
    });
    assert!(empty, "the child counts its parent's registrations");
    assert!(tracks(c.ep), "the parent's are its own still");
}

/// Another thread's wait is deciding the connection when this one's
/// report comes: the message the kernel reported is gone from the socket
/// when this wait counts it (the decision took it), and the decision
/// turns out plain TCP with nothing after. This wait must not say
/// `EPOLLIN` for it (it did: the report stood as the kernel's).
#[test]
fn a_wait_given_a_report_another_thread_is_deciding_waits_for_the_outcome() {
    let mut c = Conn::new();
    c.client.as_mut().unwrap().write_all(b"h").unwrap();
    let (held_tx, held) = mpsc::channel();
    let (go, go_rx) = mpsc::channel::<()>();
    let stream = c.stream().clone();
    let decider = std::thread::spawn(move || {
        stream.decide_tcp_for_test(|| {
            held_tx.send(()).unwrap();
            go_rx.recv().unwrap();
            // Still negotiating a while after it took the message.
            std::thread::sleep(Duration::from_millis(100));
        })
    });
    held.recv().unwrap();
    let fd = c.fd();
    crate::readiness::hook::set(move || {
        // The decision takes the peer's message off the socket.
        let mut b = [0u8; 1];
        // SAFETY: libc's recv into our byte.
        assert_eq!(unsafe { real::recv(fd, b.as_mut_ptr().cast(), 1, libc::MSG_DONTWAIT) }, 1);
        go.send(()).unwrap();
    });
    let got = c.wait(300);
    decider.join().unwrap();
    no_false_readable(&c, &got);
}

/// As above, with the other thread's decision done (plain TCP, its
/// message taken) between the kernel's report and this wait's look.
#[test]
fn a_wait_given_a_report_another_thread_decided_meanwhile_answers_as_it_turned_out() {
    let mut c = Conn::new();
    c.client.as_mut().unwrap().write_all(b"h").unwrap();
    let (fd, stream) = (c.fd(), c.stream().clone());
    crate::readiness::hook::set(move || {
        stream.decide_tcp_for_test(|| {
            let mut b = [0u8; 1];
            // SAFETY: libc's recv into our byte.
            assert_eq!(unsafe { real::recv(fd, b.as_mut_ptr().cast(), 1, libc::MSG_DONTWAIT) }, 1);
        })
    });
    let got = c.wait(300);
    no_false_readable(&c, &got);
}

/// Takes the peer's byte off `fd`'s socket, as a decision does.
fn take_the_message(fd: c_int) {
    let mut b = [0u8; 1];
    // SAFETY: libc's recv into our byte.
    assert_eq!(unsafe { real::recv(fd, b.as_mut_ptr().cast(), 1, libc::MSG_DONTWAIT) }, 1);
}

/// As above, with the other thread's decision (plain TCP, its message
/// taken) done meanwhile and its stream let go: the decision took it off
/// the table, and nothing else holds it, so this wait's look finds no
/// stream behind the registration. It must still answer as it turned
/// out (it answered as the kernel had it: `EPOLLIN`, nothing to read;
/// issue 20's second review).
#[test]
fn a_wait_given_a_report_whose_stream_another_thread_decided_and_let_go_answers_as_it_turned_out() {
    let mut c = Conn::new();
    c.client.as_mut().unwrap().write_all(b"h").unwrap();
    let (fd, stream) = (c.fd(), c.stream.take().unwrap());
    crate::readiness::hook::set(move || {
        stream.decide_tcp_for_test(|| take_the_message(fd));
        // `stream`, the last holder, goes with this closure.
    });
    let got = c.wait(300);
    no_false_readable(&c, &got);
}

/// A thread of the parent was deciding the connection (its phase lock
/// held) when another forked: the child's copy of that lock stays locked
/// for ever. The decision turns out plain TCP; the child, which
/// registered the connection meanwhile (undecided, as the lock says),
/// is told of the peer's end. Its wait must answer (it waited on the
/// lock for ever: the child's alarm ends it here).
#[test]
fn a_forked_child_does_not_wait_for_a_decision_its_parent_held_at_the_fork() {
    let c = Conn::new();
    let mut p = [0; 2];
    // SAFETY: pipe(2) into our array.
    assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0);
    let (held_tx, held) = mpsc::channel();
    let stream = c.stream().clone();
    let decider = std::thread::spawn(move || {
        stream.decide_tcp_for_test(|| {
            held_tx.send(()).unwrap();
            // Until the child registered it (or is gone).
            let mut b = [0u8; 1];
            // SAFETY: read(2) of one byte from our pipe.
            unsafe { real::read(p[0], b.as_mut_ptr().cast(), 1) };
        })
    });
    held.recv().unwrap();
    let (fd, peer, stream) = (c.fd(), c.client.as_ref().unwrap().as_raw_fd(), c.stream().clone());
    let answered = crate::pid::in_forked_child(|| {
        // SAFETY: alarm(2): a child stuck in the wait is ended (its
        // wait has no timeout, and the longest a decision is waited for
        // otherwise, `settle_wait`, is longer).
        unsafe { libc::alarm(5) };
        // SAFETY: epoll_create1(2), no pointers.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        register(ep, fd);
        let undecided = sets().sets.get(&ep).map_or(0, |x| x.counts.undecided) == 1;
        // SAFETY: write(2) of one byte to our pipe.
        unsafe { real::write(p[1], b"r".as_ptr().cast(), 1) };
        let start = std::time::Instant::now();
        while !stream.owner.is_tcp() && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
        // SAFETY: shutdown(2) of the peer's socket: its end.
        unsafe { real::shutdown(peer, libc::SHUT_WR) };
        let mut ev = [epoll_event { events: 0, u64: 0 }; 8];
        // SAFETY: room for 8 events.
        let n = unsafe { crate::readiness::epoll_wait(ep, ev.as_mut_ptr(), 8, -1) };
        undecided && stream.owner.is_tcp() && n == 1
    });
    // SAFETY: our pipe's write end, closed once: the decider's read ends
    // even if the child never wrote.
    unsafe { real::close(p[1]) };
    decider.join().unwrap();
    // SAFETY: our pipe's read end, closed once.
    unsafe { real::close(p[0]) };
    assert!(answered, "the child's wait did not answer (or the setup failed)");
}

/// Another thread is deciding the connection when a wait that does not
/// wait (timeout 0) is told of the peer's end: it answers at once, as
/// the kernel reported it, and looks again at the next report (it waited
/// for the whole of the other thread's negotiation).
#[test]
fn a_wait_that_does_not_wait_does_not_wait_for_another_threads_decision() {
    let mut c = Conn::new();
    let (held_tx, held) = mpsc::channel();
    let (go, go_rx) = mpsc::channel::<()>();
    let stream = c.stream().clone();
    let decider = std::thread::spawn(move || {
        let mut gave_up = false;
        stream.decide_tcp_for_test(|| {
            held_tx.send(()).unwrap();
            gave_up = go_rx.recv_timeout(Duration::from_secs(15)).is_err();
        });
        gave_up
    });
    held.recv().unwrap();
    drop(c.client.take());
    let got = c.wait(0);
    let _ = go.send(());
    assert!(!decider.join().unwrap(), "the wait waited for the other thread's decision");
    assert_eq!(got.len(), 1, "the end is reported");
    assert_eq!(c.undecided(), 1, "an outcome not known yet was taken as nothing to decide");
}

/// The program closes a connection reported with nothing to decide on
/// and a new connection gets its descriptor, registered in its place,
/// before the report says which registrations have nothing to decide:
/// the new one's is still looked at for its hello (it was cleared).
#[test]
fn nothing_to_decide_leaves_a_new_connection_on_the_same_descriptor_alone() {
    let mut c = Conn::new();
    drop(c.client.take());
    let (ep, fd) = (c.ep, c.fd());
    let (_next_client, next, tuple) = pair();
    let next_fd = next.as_raw_fd();
    crate::readiness::hook::set_before_nothing(move || {
        // SAFETY: libc's epoll_ctl (DEL: no event) and dup2 on our
        // descriptors: the old connection's registration and descriptor
        // go (as a close), the new connection takes its number.
        unsafe {
            assert_eq!(real::epoll_ctl(ep, libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()), 0);
            forget(fd);
            table::remove(fd);
            assert_eq!(real::dup2(next_fd, fd), fd);
        }
        table::insert(fd, Entry::Stream(Stream::claimed(fd, tuple).unwrap()));
        register(ep, fd);
    });
    let got = c.wait(5000);
    assert_eq!(got.len(), 1, "the old connection's end is reported");
    assert_eq!(c.undecided(), 1, "the new connection's registration is not looked at for its hello");
}

/// A client's connection that a forked child took may come back (the
/// child could not adopt it and gave it back): a report of it is left as
/// the kernel's that time, but the registration is still looked at for a
/// decision (it was cleared for good).
#[test]
fn a_client_connection_a_child_took_and_may_give_back_is_still_looked_at() {
    let mut c = Conn::announced();
    let took = crate::pid::in_forked_child(|| c.stream().take() == Take::Mine);
    assert!(took, "the child did not take it");
    assert_eq!(c.stream().elsewhere(), Elsewhere::ForNow);
    c.client.as_mut().unwrap().write_all(b"x").unwrap();
    let got = c.wait(5000);
    assert_eq!(got.len(), 1, "the kernel's report stands");
    assert_eq!(c.undecided(), 1, "cleared for good, though the connection may come back");
}

/// A wait whose report changes no count leaves the mirrored counts alone
/// (each wait stored both, a shared line taken from every core).
#[test]
fn a_wait_that_changes_nothing_stores_no_mirror() {
    let mut c = Conn::new();
    drop(c.client.take());
    assert_eq!(c.wait(5000).len(), 1);
    assert_eq!(c.undecided(), 0);
    let before = MIRROR_STORES.with(Cell::get);
    assert_eq!(c.wait(0).len(), 1, "the end is reported (level-triggered)");
    assert_eq!(MIRROR_STORES.with(Cell::get), before, "a wait that changed nothing stored the mirrors");
}
