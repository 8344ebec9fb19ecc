//! An ordinary std::net TCP client and server, run unmodified under the
//! preload library `libvrdma_sockets.so` by the sockets tests.
//!
//! `server PORT`: listens on 127.0.0.1:PORT, says `listening` on stdout,
//! accepts one connection, reads it to its end checking every byte
//! against [`pattern`], then answers `ok COUNT` and closes.
//! `client PORT BYTES`: connects, writes BYTES pattern bytes in writes of
//! varying sizes (and vectored ones), shuts its writing side down, and
//! checks the answer. Exit status 0 when the bytes and the answer are
//! right.
//! `sendclose PORT BYTES`: connects, writes BYTES pattern bytes and closes
//! at once, reading nothing (a client that sends its last message and
//! goes).
//!
//! `echo PORT` and `ping PORT ROUNDS`: an event-loop pair on non-blocking
//! sockets and poll(2). The echo server answers every byte; the client
//! sends 64-byte messages and reads each answer back in 10-byte reads,
//! polling before each read, so poll must report the bytes left in the
//! ring after a partial read.
//!
//! `forkserver PORT`: `server`, but a child forked after listen accepts
//! and serves (a pre-forking server's worker); the parent waits for it.
//!
//! `forkecho PORT MODE`: accepts one connection and forks; one process
//! echoes it (every byte back, until the end) and closes it, saying
//! `echoed N`. MODE `child`: the parent closes its copy right after the
//! fork and the child echoes (a classic forking server); `child-exit`:
//! the same, but the child exits without closing it; `parent-close`:
//! the child closes its copy and exits, and the parent echoes after
//! that; `parent-exit`: the child exits without touching it; `early-`
//! before either `parent-` mode: the parent first echoes one 16 KiB
//! chunk (so the connection is carried before the fork);
//! `child-then-parent`: `child`, but the parent keeps its copy and, once
//! the child is gone, must get `EIO` from a read of it (the process that
//! did not take the connection is told so, never given bytes);
//! `early-split`: the
//! parent echoes a chunk, forks, then the child reads the connection
//! (reads of random sizes) and hands each piece through a pipe to the
//! parent, which writes it back (rsync's receiver and generator: both
//! processes use a connection carried before the fork at once);
//! `early-split-poll`: the same, the child waiting in poll(2) before each
//! read (its first call on the connection is a poll);
//! `early-handover`: the parent echoes a chunk, forks and closes its copy
//! at once, and the child echoes the rest; `early-stopped`: the parent
//! echoes a chunk, forks and is stopped (`SIGSTOP`, by the child), whose
//! read must fail with `ECONNRESET` within the library's wait (says
//! `child: ECONNRESET`), then the child resumes it and exits and the
//! parent echoes the rest. `sink` (against `client`): the parent reads
//! 16 KiB, forks and closes its copy at once; the child reads and checks
//! the rest (the client waits for credits meanwhile), answers `ok N`.
//! `write-N` (against `readcheck`): the parent writes N pattern bytes
//! in 64 KiB writes, the first before a fork, then closes; the child, 50 ms after
//! the fork, reads the connection (which asks for its demotion) until
//! the end (`writenb-N`: the child makes one non-blocking read and
//! exits; against `readsplit`, two threads reading until the end).
//! `shut-N` (against `readreply`): the parent writes N pattern bytes
//! (carried) and forks; the child at once reads the connection (which
//! asks for its demotion) until the end and says `reply: TEXT`; the
//! parent, 200 ms after the fork, half-closes it (`shutdown(SHUT_WR)`)
//! and waits for the child (run with `VRDMA_SOCKETS_TEST_PAUSE=
//! demote-lock:US`, its shutdown comes as the demotion only began).
//! `SOCKAPP_REPLY_DELAY_MS`: `readreply` waits after the end.
//! `sink-quiet` (against `sendclose`): `sink`, but the child reads until
//! the end and answers nothing (says `received N, then the end`).
//! `echoclient PORT BYTES`:
//! writes BYTES pattern bytes in 16 KiB chunks, reading each chunk back
//! and checking it byte by byte, then half-closes and must read the end.
//! `SOCKAPP_ACCEPT_DELAY_MS`: `forkecho` pauses before its accept.
//!
//! `banner PORT`: a server that speaks first (SMTP, FTP, MySQL): accepts,
//! writes a 64-byte banner, reads a 64-byte reply and checks it.
//! `pollbanner PORT`: its client, which waits in poll(2) for the banner
//! before its first call (10 s at most), reads it, checks it and
//! replies; says `banner after N ms`.
//! `forkechos PORT N`: a forking server's accept loop, a child per
//! connection (echoing it as `forkecho`'s), N connections.
//!
//! `sendfile PORT BYTES`: `client`, but the bytes go from a file with
//! sendfile(2), half with an offset and half from the file's position.
//!
//! `rr PORT ROUNDS`: blocking 64-byte requests answered by `echo` (or
//! `becho`), each read whole; prints the median round trip in
//! nanoseconds. `becho PORT`: answers 64-byte requests with blocking
//! reads and writes until the end (no readiness call).
//!
//! `lazyserver PORT poll|epoll` and `lazyclient PORT`: readiness after
//! blocking reads. The client writes 64 bytes, reads a 1-byte answer,
//! waits for the server's 1-byte go (sent after its quiet wait, below, so
//! that no CPU stall can put the client's write inside that wait), then
//! 100 ms, writes 64 more, reads a second answer and ends. The
//! server reads the first 64 with a blocking read (no readiness call
//! before: a read that does not arm), answers, then waits 300 ms for
//! readability in `poll` (or in a level-triggered `epoll` set it
//! registers the socket in then), which must not come (nothing was
//! sent: a stale wake byte must not read as bytes), then up to 5 s,
//! which must come, reads the second 64 and answers.
//!
//! `badbuf PORT`: a 64-byte `client` (its second half a writev whose first
//! entry is null and empty; then an empty null readv and writev, which
//! give 0) whose read, readv and write of a null buffer of 10 bytes must
//! fail with EFAULT in between (says `efault 3`).
//!
//! `quiet PORT`: accepts and closes without a call; `expect-end PORT`:
//! connects and must read the end (0), as over TCP.
//!
//! `tiny PORT BYTES`: `client`, but every write is 1 to 13 bytes (every
//! fifth a vectored one of two parts): many small writes in flight at
//! once (pipelined), checked byte for byte by `server`.
//!
//! `lateserver PORT`: `server`, but it stops reading for 300 ms after its
//! first read, so that its client's ring fills. `slowserver PORT`:
//! `server`, but it stops for 105 ms after every read (of 100 003 bytes at
//! most), so that its client's ring fills again and again. `nbflood PORT BYTES`: a
//! non-blocking client that writes BYTES pattern bytes in 64 KiB writes,
//! waiting with poll(POLLOUT) after each `EAGAIN`; says how many it saw
//! (`eagain N`), then half-closes and checks the answer. `nbsendfile
//! PORT BYTES`: `nbflood`, but the bytes go from a file with sendfile(2)
//! from the file's own position (no offset), which it checks after each
//! call is where the bytes sent end.
//!
//! `sleepyserver PORT`: `server`, but it waits 400 ms after its `accept`
//! before its first call, so that a carried client's first call waits for
//! the server's hello. `alarmclient PORT BYTES`: `client` (one plain
//! `write` loop), with a `SIGALRM` handler installed without `SA_RESTART`
//! and a timer that fires every 50 ms from before its `connect` until its
//! writes are done: says `alarms N` and `eintr N` (writes that said
//! `EINTR`), and fails if 1000 writes in a row say `EINTR` (a connection
//! stuck on it).
//!
//! `fionreadserver PORT`: `server`, but after a first read of 1000
//! bytes at most (`first N`: the bytes it got) it waits 300 ms and says
//! `fionread N`: what `ioctl(FIONREAD)` counts then (the rest of a
//! client's 100 000 bytes has arrived by then, as over TCP).
//!
//! `mmsgclient PORT`: `client`, its 300 000 bytes in `sendmmsg` calls of
//! three messages each (of two pieces each). `mmsgserver PORT`: `server`,
//! reading with `recvmmsg` (four 1000-byte messages a call,
//! `MSG_WAITFORONE`) until an empty message (the end). `spliceclient
//! PORT`: writes a first byte, then tries to `splice` 4096 bytes from a
//! pipe to the connection and says `splice ERRNO-NAME` (`EINVAL` where
//! carried) or `splice N`, then writes the rest as `client` does (the
//! spliced bytes count as written where they went).
//!
//! `stallserver PORT`: `server`, but it stops reading for 3 s after its
//! first read. `idlewriter PORT poll|select|epoll`: writes one byte
//! (blocking), fills the ring (or the kernel's buffers) with
//! non-blocking 64 KiB writes until `EAGAIN`, then waits 1 s for
//! writability (and readability) in `poll`, `select` or a
//! level-triggered `epoll`, which must not report it (the server does
//! not read), and says `idle-wakeups N`: its voluntary context
//! switches, all threads, during that second (`getrusage`); then waits
//! (20 s at most) until writable, says `writable after N ms`, and
//! half-closes and checks the answer.
//!
//! `answer PORT`: accepts, reads 64 bytes (blocking), answers one byte.
//! `quietwriter PORT`: connects, writes 64 bytes, then sleeps 3 s (no call
//! on the socket, no poll) and must find the answer already there (a
//! non-blocking read): the request reached the server while its writer
//! made no call.
//!
//! `pollserver PORT`: `server`, non-blocking, one read after each `poll`
//! (as iperf3's server reads); says the socket's `nodelay` (as the
//! program sees it) after its first read (`nbflood` says it at its end).
//! `SOCKAPP_STRICT_READY=poll|select`: it waits with that call, and a read
//! that says `EAGAIN` right after it reported the socket readable fails
//! it (as ncat `--exec`'s relay takes it for the end).
//! `SOCKAPP_STRICT_READY=epoll|epoll-et|epoll-oneshot`: the same with an
//! epoll set (the connection registered for `EPOLLIN` right after its
//! accept, before any call on it: level-triggered, edge-triggered, or
//! level-triggered one-shot and armed again after each report); edge-
//! triggered, it reads until `EAGAIN` after each report, and only the
//! first read after the first report must have bytes (a later report may
//! be for bytes a read took already, as edge-triggered epoll allows).
//! `sink PORT`: accepts, reads 1 MiB, says `stalled` on stderr and stops
//! reading (the test kills it). `flood PORT`: writes until a write fails,
//! and exits 0 saying the error (1 if the connection never fails).
//!
//! `selectserver PORT ROUNDS` and `msgclient PORT ROUNDS`: the pattern of
//! iperf3's control connection. Each round the client writes a 4-byte
//! length and then the message (two writes, 0 to 450 µs apart) and reads
//! two bytes back, an
//! answer and a go. The server waits for readability (`select`, `poll`,
//! level-triggered `epoll` and `pselect` in turn, a round each), reads the message with blocking reads,
//! answers, and then waits 30 ms for readability while the client is
//! silent (waiting for the go): a readiness then must have a byte behind
//! it, else a read (bounded by a 1 s `SO_RCVTIMEO`) finds nothing and the
//! server fails ("stale readiness"), as iperf3's server would block in its
//! read instead of accepting its data connection.
//!
//! `epollflood PORT BYTES et|lt|oneshot|select|pselect`: `nbflood`, but
//! it waits for `EPOLLOUT` in epoll (registered alone, edge- or
//! level-triggered, or level-triggered one-shot and armed again before
//! each wait, with a `data` it checks), or for the socket in the write
//! set of `select` or `pselect` (with a read set of its own: a pipe that
//! never gets ready), after each `EAGAIN`, 10 s at most (`WAIT_MS` where
//! given: `epollflood PORT BYTES MODE WAIT_MS`); says `eagain N`
//! and, unless `et`, `spurious N`: reports of `EPOLLOUT` (writability)
//! after which a write still got `EAGAIN` (one the ring does not have).
//!
//! `epecho PORT` and `eprr PORT ROUNDS`: `becho` and `rr` as event
//! loops: non-blocking sockets, each end waiting for its reads in a
//! level-triggered `epoll` set (`epoll_wait` with a 10 s timeout, reads
//! until `EAGAIN`); `eprr` says `median_rtt_ns N`. `nestecho PORT
//! before|after`: `epecho` whose set is inside an outer epoll set (added
//! to it before or after the connection is registered in it): it waits
//! on the outer set, then takes the inner set's events without waiting.
//!
//! `closeserver PORT N`: accepts N connections one after another; on each
//! reads the 8-byte request, answers 16 KiB and closes (as a server
//! without keep-alive). `closeclient PORT N MS`: makes those N
//! connections one after another (each: write the request, read to the
//! end, 16 KiB expected), starting none after MS milliseconds; says
//! `done K`.
//!
//! `inetd PORT MODE`: an inetd-style server: accepts one connection
//! and, before any call on it, gives it to another program as its stdin
//! and stdout. MODE `exec`: `dup2`s it onto 0 and 1 and `execv`s
//! `stdecho` (this program); `fork-exec`: forks, the child does so with
//! `execvp("cat")`, the parent closes its copy and waits; `spawn`:
//! `std::process::Command` runs `stdecho` with it as stdin and stdout
//! (glibc's `posix_spawn`, the socket `dup2`ed by its file actions) and
//! waits; `carried-exec`: first echoes one 16 KiB chunk (the connection
//! is carried), then `execve`s `stdecho go` (`SOCKAPP_BEFORE_EXEC_MS`:
//! a pause before it); `carried-spawn`: first
//! echoes one chunk, then `spawn`s `stdecho go` (the same pause before
//! it; against `goclient`); `carried-vfork`: first echoes one chunk,
//! then a `vfork`-like child (`clone`, `CLONE_VM | CLONE_VFORK`) `dup2`s
//! the connection and execs `stdecho go`, a second one execs `true`
//! before the parent's close, and the parent waits for a second
//! connection before it exits. `vfork-first-exit`, `vfork-first-exec`:
//! before anything else, a `vfork`-like child that `_exit`s, or one that
//! execs `true`; then the connection is echoed to its end and closed, and the process
//! waits for a second connection before it exits.
//! `carried-readexec`: reads `SOCKAPP_ECHO_FIRST` bytes (64 KiB by
//! default) of a `client`'s stream, checked, while it writes on, then
//! `execve`s `stdcheck FROM`, which reads the rest to the end, checked,
//! and answers `ok TOTAL` as `server` does.
//! `SOCKAPP_EXEC_DELAY_MS`: a pause after the accept. `stdecho`: copies
//! stdin to stdout until the end, then says `stdecho N` on stderr; `stdecho
//! go` first says whether its stdin is a connected socket and writes `G`
//! (then `STDECHO_WRITE_FIRST` bytes `w` before it reads, and a sleep of
//! `STDECHO_DELAY_AFTER_WRITE_MS`; `STDECHO_COUNT_ONLY`: reads without
//! echoing and says `stdecho read N`; a `bulk` goclient given
//! `SOCKAPP_WRITTEN_FIRST` reads them while a thread writes the rest).
//! `goclient PORT BYTES WAY`: sends one chunk and reads its echo, waits for
//! the go byte (WAY `read`, `poll`, `epoll`, `late`: a sleep of
//! `SOCKAPP_GO_DELAY_MS` first, or `pipelined`: two chunks sent before
//! the first echo is read), then echoes the rest of BYTES as
//! `echoclient`; says `echoed N, then the end`, or `the end instead of
//! the go byte`.
//!
//! `execlisten PORT`: listens, forks, and the child execs `fdecho` with
//! the listening socket as descriptor 10; `fdecho` accepts one
//! connection there and echoes it, saying `echoed N` (a master that
//! starts worker programs on its inherited listener).
//!
//! `forkclient PORT BYTES`: connects, forks, and the child runs
//! `echoclient`'s work on it (its first call); the parent closes its
//! copy and waits.
//!
//! `carriedexecclient PORT BYTES [pipelined]`: connects, one chunk
//! echoed (carried; `SOCKAPP_ECHO_FIRST` bytes where set), `pipelined`: a
//! second chunk (`SOCKAPP_UNREAD` bytes) sent whose echo waits unread in
//! the ring, a pause of `SOCKAPP_BEFORE_EXEC_MS`, then `execve`s
//! `fdresume BYTES SENT PENDING` with the socket as descriptor 10, which
//! says `fdresume: descriptor 10 is a connected socket` (or `is no
//! socket`), checks the PENDING bytes of echo, echoes the rest of BYTES
//! as `echoclient` and says `echoed BYTES, then the end`. `echos` listens
//! on `SOCKAPP_BIND` too.
//!
//! `execclient PORT BYTES`: connects, `dup2`s the socket onto descriptor
//! 10 (inherited) and, before any call on it, `execv`s `fdclient BYTES`
//! (this program), which runs `echoclient` on descriptor 10 (`client`'s
//! work where `SOCKAPP_FD_SEND=1`: the pattern sent, then the half-close
//! and the server's `ok COUNT` checked).
//! `SOCKAPP_EXEC_DELAY_MS`: a pause after the connect. `echoclient`
//! waits `SOCKAPP_CONNECT_DELAY_MS` after its connect where set.
//!
//! `echos PORT N`: accepts N connections one after another and echoes
//! each until its end. `optclient PORT`: its client, reading
//! `TCP_NODELAY` as a program sees it on two connections: one it never
//! sets (says `unset fresh=V carried=V`, before its first call and after
//! a round trip; it corks that one before its first call and says `early
//! cork=V carried=V`, then uncorks it), and one it sets to 1 before its first call, clears
//! after a round trip, reads with a one-byte option, sets wrongly (a
//! two-byte option, a null one, a null buffer to read into: the errnos)
//! and sets again (says `set fresh=V early=V carried=V cleared=V
//! short=BYTE/LEN errs=E,E,E again=V`); then corks it (`TCP_CORK`),
//! makes three round trips, uncorks it and makes one more (says `cork
//! before=V corked=V uncorked=V`).
//!
//! `server`, `inetd` and `forkecho` listen on `SOCKAPP_BIND` and `client` and
//! `echoclient` connect to
//! `SOCKAPP_HOST` where they are set (an address of another network
//! namespace, for the tests across hosts, or an IPv6 one such as `::1`),
//! else on 127.0.0.1. `SOCKAPP_V6ONLY=1`: `server`'s socket (IPv6) sets
//! `IPV6_V6ONLY` before it binds. `SOCKAPP_CLIENT_BIND`: `client` binds
//! its socket to that address (port 0) before it connects to the literal
//! address `SOCKAPP_HOST` (either may be a link-local one with its scope,
//! `fe80::1%3`; elsewhere the resolver reads such a name too).
//! `SOCKAPP_DEVICE`: `server`'s socket (IPv6, dual-stack) and a bound
//! `client`'s are bound to that interface (`SO_BINDTODEVICE`) before
//! they bind.

use std::io::{IoSlice, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};

fn pattern(i: u64) -> u8 {
    ((i * 31 + 7) % 251) as u8
}

/// The address in `var`, or 127.0.0.1.
fn ip_from(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| "127.0.0.1".into())
}

fn server(port: u16) -> Result<(), String> {
    let l = if std::env::var("SOCKAPP_V6ONLY").is_ok_and(|v| v == "1") {
        v6only_listener(&ip_from("SOCKAPP_BIND"), port)?
    } else if std::env::var("SOCKAPP_DEVICE").is_ok() {
        listener6(&ip_from("SOCKAPP_BIND"), port, false)?
    } else {
        TcpListener::bind((ip_from("SOCKAPP_BIND"), port)).map_err(|e| format!("bind: {e}"))?
    };
    println!("listening");
    std::io::stdout().flush().ok();
    serve(&l)
}

/// A listener on IPv6 address `ip` with `IPV6_V6ONLY` set.
fn v6only_listener(ip: &str, port: u16) -> Result<TcpListener, String> {
    listener6(ip, port, true)
}

/// Binds `fd` to the interface `SOCKAPP_DEVICE` names, if it names one.
fn bind_to_device(fd: libc::c_int) -> Result<(), String> {
    let Ok(dev) = std::env::var("SOCKAPP_DEVICE") else { return Ok(()) };
    // SAFETY: `dev` is valid for its length in bytes.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_BINDTODEVICE,
            dev.as_ptr().cast(),
            dev.len() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(format!("SO_BINDTODEVICE {dev}: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// A listener on IPv6 address `ip`, `v6only` or dual-stack, on
/// `SOCKAPP_DEVICE`'s interface if it names one.
fn listener6(ip: &str, port: u16, v6only: bool) -> Result<TcpListener, String> {
    use std::os::fd::FromRawFd;
    let ip: std::net::Ipv6Addr = ip.parse().map_err(|e| format!("{ip}: {e}"))?;
    let err = |what: &str| format!("{what}: {}", std::io::Error::last_os_error());
    // SAFETY: socket(2) with constant arguments.
    let fd = unsafe { libc::socket(libc::AF_INET6, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(err("socket"));
    }
    // SAFETY: the descriptor was just made and is ours alone.
    let l = unsafe { TcpListener::from_raw_fd(fd) };
    let len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    for (opt, on) in [
        ((libc::IPPROTO_IPV6, libc::IPV6_V6ONLY), v6only as libc::c_int),
        ((libc::SOL_SOCKET, libc::SO_REUSEADDR), 1),
    ] {
        // SAFETY: `on` is valid for `len` bytes.
        if unsafe { libc::setsockopt(fd, opt.0, opt.1, (&on as *const libc::c_int).cast(), len) } != 0 {
            return Err(err("setsockopt"));
        }
    }
    bind_to_device(fd)?;
    // SAFETY: sockaddr_in6 is plain data; all zeroes is valid.
    let mut sin6: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
    sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
    sin6.sin6_port = port.to_be();
    sin6.sin6_addr.s6_addr = ip.octets();
    let sl = std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t;
    // SAFETY: `sin6` is a valid sockaddr_in6 of `sl` bytes.
    if unsafe { libc::bind(fd, (&sin6 as *const libc::sockaddr_in6).cast(), sl) } != 0 {
        return Err(err("bind"));
    }
    // SAFETY: listen(2) on our socket.
    if unsafe { libc::listen(fd, 128) } != 0 {
        return Err(err("listen"));
    }
    Ok(l)
}

fn forkserver(port: u16) -> Result<(), String> {
    let l = TcpListener::bind(("127.0.0.1", port)).map_err(|e| format!("bind: {e}"))?;
    // SAFETY: fork(2) in a single-threaded program; the child only serves
    // and exits.
    match unsafe { libc::fork() } {
        -1 => Err(format!("fork: {}", std::io::Error::last_os_error())),
        0 => {
            let code = match serve(&l) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("sockapp child: {e}");
                    1
                }
            };
            std::process::exit(code)
        }
        child => {
            let mut status = 0;
            // SAFETY: waitpid(2) on our child.
            if unsafe { libc::waitpid(child, &mut status, 0) } != child {
                return Err("waitpid".into());
            }
            if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
                Ok(())
            } else {
                Err(format!("the child ended with {status:#x}"))
            }
        }
    }
}

/// Echo chunks of `echoclient`.
const ECHO_CHUNK: usize = 16 * 1024;

fn forkecho(port: u16, mode: &str) -> Result<(), String> {
    let l = TcpListener::bind((ip_from("SOCKAPP_BIND"), port)).map_err(|e| format!("bind: {e}"))?;
    println!("listening");
    std::io::stdout().flush().ok();
    pause("SOCKAPP_ACCEPT_DELAY_MS");
    let (mut s, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(60))).map_err(|e| e.to_string())?;
    let mut echoed = 0;
    if let Some(n) = mode.strip_prefix("write-") {
        return fork_write(s, n.parse().map_err(|_| format!("mode {mode}"))?, false);
    }
    if let Some(n) = mode.strip_prefix("writenb-") {
        return fork_write(s, n.parse().map_err(|_| format!("mode {mode}"))?, true);
    }
    if let Some(n) = mode.strip_prefix("shut-") {
        return fork_shut(s, n.parse().map_err(|_| format!("mode {mode}"))?);
    }
    if mode == "sink" || mode == "sink-quiet" {
        return sink_split(s, mode == "sink");
    }
    if mode.starts_with("early-") {
        echoed = echo_upto(&mut s, ECHO_CHUNK as u64)?;
    }
    let child_serves = matches!(mode, "child" | "child-exit" | "child-then-parent" | "early-handover");
    if mode == "early-split" || mode == "early-split-poll" {
        return split_echo(s, echoed, mode == "early-split-poll");
    }
    std::io::stdout().flush().ok();
    // SAFETY: fork(2) in a single-threaded program (the library's threads
    // are not the program's); the child only serves or closes, and exits.
    match unsafe { libc::fork() } {
        -1 => Err(format!("fork: {}", std::io::Error::last_os_error())),
        0 => {
            let r = match mode {
                _ if child_serves => echo_all(&mut s).map(|n| {
                    println!("echoed {}", echoed + n);
                    // `child-exit` leaves without closing it.
                    if mode != "child-exit" {
                        drop(s);
                    }
                }),
                "early-stopped" => stopped_parent(&mut s),
                "parent-close" | "early-parent-close" => {
                    drop(s);
                    Ok(())
                }
                _ => Ok(()),
            };
            std::io::stdout().flush().ok();
            std::process::exit(match r {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("sockapp child: {e}");
                    1
                }
            })
        }
        child => {
            let keep = if matches!(mode, "child" | "child-exit" | "early-handover") {
                // The parent's copy goes at once: the child's connection
                // must live on.
                drop(s);
                None
            } else {
                Some(s)
            };
            let mut status = 0;
            // SAFETY: waitpid(2) on our child.
            if unsafe { libc::waitpid(child, &mut status, 0) } != child {
                return Err("waitpid".into());
            }
            if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
                return Err(format!("the child ended with {status:#x}"));
            }
            let Some(mut s) = keep else { return Ok(()) };
            if child_serves {
                return eio(&mut s, "parent");
            }
            let n = echo_all(&mut s)?;
            println!("echoed {}", echoed + n);
            Ok(())
        }
    }
}

/// `forkechos PORT N`: a forking server's accept loop: a child per
/// connection echoes it and closes it, the parent closes its copy at
/// once and accepts the next; then it waits for every child.
fn forkechos(port: u16, n: usize) -> Result<(), String> {
    let l = TcpListener::bind(("127.0.0.1", port)).map_err(|e| format!("bind: {e}"))?;
    println!("listening");
    std::io::stdout().flush().ok();
    let mut children = Vec::new();
    for _ in 0..n {
        let (mut s, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
        s.set_read_timeout(Some(std::time::Duration::from_secs(60))).map_err(|e| e.to_string())?;
        // SAFETY: fork(2) in a single-threaded program; the child only
        // echoes its connection and exits.
        match unsafe { libc::fork() } {
            -1 => return Err(format!("fork: {}", std::io::Error::last_os_error())),
            0 => {
                drop(l);
                let code = match echo_all(&mut s) {
                    Ok(k) => {
                        println!("echoed {k}");
                        drop(s);
                        0
                    }
                    Err(e) => {
                        eprintln!("sockapp child: {e}");
                        1
                    }
                };
                std::io::stdout().flush().ok();
                std::process::exit(code)
            }
            child => {
                drop(s);
                children.push(child);
            }
        }
    }
    for child in children {
        let mut status = 0;
        // SAFETY: waitpid(2) on our child.
        if unsafe { libc::waitpid(child, &mut status, 0) } != child {
            return Err("waitpid".into());
        }
        if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
            return Err(format!("a child ended with {status:#x}"));
        }
    }
    Ok(())
}

/// `forkecho`'s `early-split`: after the parent echoed `echoed` bytes
/// (carried), the child reads the connection in pieces of random sizes
/// and hands them through a pipe to the parent, which writes them back;
/// the child's end of stream closes the pipe, and the parent's close (the
/// last holder's) ends the stream.
fn split_echo(s: TcpStream, echoed: u64, poll_first: bool) -> Result<(), String> {
    use std::os::fd::FromRawFd;
    let mut fds = [0i32; 2];
    // SAFETY: pipe(2) into a two-element array.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        return Err(format!("pipe: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: both descriptors were just made by pipe(2) and are owned
    // here, once each.
    let (mut rd, mut wr) =
        unsafe { (std::fs::File::from_raw_fd(fds[0]), std::fs::File::from_raw_fd(fds[1])) };
    std::io::stdout().flush().ok();
    // SAFETY: fork(2) in a single-threaded program; the child only reads
    // the connection into the pipe and exits.
    match unsafe { libc::fork() } {
        -1 => Err(format!("fork: {}", std::io::Error::last_os_error())),
        0 => {
            drop(rd);
            let mut s = s;
            let mut buf = vec![0u8; 65_536];
            let mut seed = 0x9e37_79b9_7f4a_7c15u64;
            let mut n = 0u64;
            let r = loop {
                seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                let want = 1 + (seed >> 33) as usize % buf.len();
                if poll_first {
                    use std::os::fd::AsRawFd;
                    let mut p = libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                    // SAFETY: one valid pollfd.
                    if unsafe { libc::poll(&mut p, 1, 60_000) } != 1 {
                        break Err(format!("child: not readable within 60 s after {n}"));
                    }
                }
                match s.read(&mut buf[..want]) {
                    Ok(0) => break Ok(()),
                    Ok(k) => {
                        if let Err(e) = wr.write_all(&buf[..k]) {
                            break Err(format!("child: pipe write after {n}: {e}"));
                        }
                        n += k as u64;
                    }
                    Err(e) => break Err(format!("child: read after {n}: {e}")),
                }
            };
            drop(wr);
            drop(s);
            std::process::exit(match r {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("sockapp child: {e}");
                    1
                }
            })
        }
        child => {
            drop(wr);
            let mut s = s;
            let mut buf = vec![0u8; 65_536];
            let mut n = 0u64;
            loop {
                let k = rd.read(&mut buf).map_err(|e| format!("pipe read after {n}: {e}"))?;
                if k == 0 {
                    break;
                }
                s.write_all(&buf[..k]).map_err(|e| format!("parent: write after {n}: {e}"))?;
                n += k as u64;
            }
            let mut status = 0;
            // SAFETY: waitpid(2) on our child.
            if unsafe { libc::waitpid(child, &mut status, 0) } != child {
                return Err("waitpid".into());
            }
            if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
                return Err(format!("the child ended with {status:#x}"));
            }
            // Plain TCP now: the kernel holds the program's options again
            // (it set none), not the library's.
            let mut v: libc::c_int = -1;
            let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            use std::os::fd::AsRawFd;
            // SAFETY: getsockopt(2) of an int into `v`.
            unsafe {
                libc::getsockopt(
                    s.as_raw_fd(),
                    libc::IPPROTO_TCP,
                    libc::TCP_NODELAY,
                    (&raw mut v).cast(),
                    &mut len,
                )
            };
            println!("nodelay {v}");
            println!("echoed {}", echoed + n);
            Ok(())
        }
    }
}

/// `forkecho`'s `sink` (against `client`): the parent reads 16 KiB of
/// the client's pattern (the connection carried), forks and reads no
/// more (the client's writes fill the ring and wait for credits); the
/// child reads and checks the rest, answers `ok N` and says `received N`.
fn sink_split(mut s: TcpStream, answer: bool) -> Result<(), String> {
    let mut buf = vec![0u8; 65_536];
    let mut got = 0u64;
    let check = |b: &[u8], at: u64| -> Result<(), String> {
        match (0..b.len()).find(|&i| b[i] != pattern(at + i as u64)) {
            Some(i) => Err(format!("byte {} is {}, sent {}", at + i as u64, b[i], pattern(at + i as u64))),
            None => Ok(()),
        }
    };
    while got < ECHO_CHUNK as u64 {
        let want = (ECHO_CHUNK as u64 - got) as usize;
        let k = s.read(&mut buf[..want]).map_err(|e| format!("read after {got}: {e}"))?;
        if k == 0 {
            return Err(format!("the end after {got}"));
        }
        check(&buf[..k], got)?;
        got += k as u64;
    }
    std::io::stdout().flush().ok();
    // SAFETY: fork(2) in a single-threaded program; the child only reads
    // the connection, answers and exits.
    match unsafe { libc::fork() } {
        -1 => Err(format!("fork: {}", std::io::Error::last_os_error())),
        0 => {
            let r = (|| {
                loop {
                    let k = s.read(&mut buf).map_err(|e| format!("child: read after {got}: {e}"))?;
                    if k == 0 {
                        break;
                    }
                    check(&buf[..k], got)?;
                    got += k as u64;
                }
                if !answer {
                    println!("received {got}, then the end");
                    return Ok(());
                }
                s.write_all(format!("ok {got}\n").as_bytes()).map_err(|e| format!("child: answer: {e}"))?;
                println!("received {got}");
                Ok::<(), String>(())
            })();
            drop(s);
            std::io::stdout().flush().ok();
            std::process::exit(match r {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("sockapp child: {e}");
                    1
                }
            })
        }
        child => {
            drop(s);
            let mut status = 0;
            // SAFETY: waitpid(2) on our child.
            if unsafe { libc::waitpid(child, &mut status, 0) } != child {
                return Err("waitpid".into());
            }
            if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
                return Err(format!("the child ended with {status:#x}"));
            }
            Ok(())
        }
    }
}

/// `forkecho`'s `early-stopped`, in the child: stops the parent (which
/// drives the connection), then a read must fail with `ECONNRESET` (the
/// driver cannot hand it over), not hang; resumes the parent.
fn stopped_parent(s: &mut TcpStream) -> Result<(), String> {
    // SAFETY: getppid(2) and kill(2) on our parent.
    let parent = unsafe { libc::getppid() };
    // SAFETY: as above.
    unsafe { libc::kill(parent, libc::SIGSTOP) };
    // The stop is delivered when the parent next runs: its threads (the
    // library's watcher among them) must be stopped before the read asks.
    let stat = format!("/proc/{parent}/stat");
    let stopped = || {
        std::fs::read_to_string(&stat)
            .ok()
            .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| rest.starts_with('T') || rest.starts_with('t')))
            .unwrap_or(false)
    };
    let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !stopped() && std::time::Instant::now() < end {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let mut b = [0u8; 1];
    let r = s.read(&mut b);
    // SAFETY: as above.
    unsafe { libc::kill(parent, libc::SIGCONT) };
    match r {
        Err(e) if e.raw_os_error() == Some(libc::ECONNRESET) => {
            println!("child: ECONNRESET");
            Ok(())
        }
        other => Err(format!("child's read while the driver is stopped: {other:?}")),
    }
}

/// A read of `s` must fail with `EIO` (a connection another process
/// drives); says `WHO: EIO`.
fn eio(s: &mut TcpStream, who: &str) -> Result<(), String> {
    let mut b = [0u8; 1];
    match s.read(&mut b) {
        Err(e) if e.raw_os_error() == Some(libc::EIO) => {
            println!("{who}: EIO");
            Ok(())
        }
        other => Err(format!("{who}'s read of a connection the other process drives: {other:?}")),
    }
}

/// Echoes until the end; the bytes echoed.
fn echo_all(s: &mut TcpStream) -> Result<u64, String> {
    echo_upto(s, u64::MAX)
}

/// Echoes `limit` bytes, or until the end.
fn echo_upto(s: &mut TcpStream, limit: u64) -> Result<u64, String> {
    let mut buf = vec![0u8; 65_536];
    let mut n = 0u64;
    while n < limit {
        let want = (limit - n).min(buf.len() as u64) as usize;
        let r = s.read(&mut buf[..want]).map_err(|e| format!("read after {n}: {e}"))?;
        if r == 0 {
            break;
        }
        s.write_all(&buf[..r]).map_err(|e| format!("write after {n}: {e}"))?;
        n += r as u64;
    }
    Ok(n)
}

fn echoclient(port: u16, bytes: u64) -> Result<(), String> {
    let s = TcpStream::connect((ip_from("SOCKAPP_HOST"), port)).map_err(|e| format!("connect: {e}"))?;
    pause("SOCKAPP_CONNECT_DELAY_MS");
    echo_check(s, bytes)
}

/// `goclient PORT BYTES WAY`: sends one chunk and reads its echo, then
/// waits for the go byte `G` of the program the server exec'd (WAY: a
/// blocking `read`, `poll` or `epoll` first, or `late`: a sleep of
/// `SOCKAPP_GO_DELAY_MS` without any call), then sends the rest of BYTES
/// in echoed chunks, checked byte by byte, and reads the end. Says
/// `echoed BYTES, then the end`, or `the end instead of the go byte`.
fn goclient(port: u16, bytes: u64, way: &str) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let mut s = TcpStream::connect((ip_from("SOCKAPP_HOST"), port)).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(60))).map_err(|e| e.to_string())?;
    let n = ECHO_CHUNK;
    let data: Vec<u8> = (0..n as u64).map(pattern).collect();
    if way == "bulk" {
        return bulk_goclient(s, bytes);
    }
    if way == "shut" {
        // A request, this side shut, then the answer: the echo, the
        // exec'd program's go byte, the end.
        s.write_all(&data).map_err(|e| format!("write: {e}"))?;
        s.shutdown(Shutdown::Write).map_err(|e| format!("shutdown: {e}"))?;
        let mut back = Vec::new();
        s.read_to_end(&mut back).map_err(|e| format!("read: {e}"))?;
        if back.len() != n + 1 || back[..n] != data[..] || back[n] != b'G' {
            return Err(format!("the echo and the go byte expected, read {} bytes", back.len()));
        }
        println!("the echo, the go byte, then the end");
        return Ok(());
    }
    s.write_all(&data).map_err(|e| format!("write: {e}"))?;
    if way.starts_with("pipelined") {
        // The second chunk goes before the first one's echo is read: it
        // waits in the server's ring, unread, at its exec.
        let more: Vec<u8> = (n as u64..2 * n as u64).map(pattern).collect();
        s.write_all(&more).map_err(|e| format!("write: {e}"))?;
    }
    let mut back = vec![0u8; ECHO_CHUNK];
    s.read_exact(&mut back).map_err(|e| format!("read back: {e}"))?;
    if back != data {
        return Err("the first chunk echoed wrong".into());
    }
    let fd = s.as_raw_fd();
    match way {
        "read" | "pipelined" => {}
        "poll" => {
            let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd.
            let r = unsafe { libc::poll(&mut p, 1, 30_000) };
            eprintln!("goclient: poll {r} revents {:#x}", p.revents);
        }
        "epoll" => {
            // SAFETY: epoll_create1(2), no pointers.
            let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
            let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: 7 };
            // SAFETY: epoll_ctl(2) and epoll_wait(2) with an event of ours.
            let r = unsafe {
                libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev);
                libc::epoll_wait(ep, &mut ev, 1, 30_000)
            };
            eprintln!("goclient: epoll_wait {r}");
            // SAFETY: closes our epoll descriptor.
            unsafe { libc::close(ep) };
        }
        "late" | "pipelined-late" => pause("SOCKAPP_GO_DELAY_MS"),
        _ => return Err(format!("goclient: unknown way {way}")),
    }
    let mut g = [0u8; 1];
    match s.read(&mut g) {
        Ok(1) if g[0] == b'G' => {}
        Ok(0) => {
            println!("the end instead of the go byte");
            return Ok(());
        }
        Err(e) if e.raw_os_error() == Some(libc::ECONNRESET) => {
            println!("the end instead of the go byte (reset)");
            return Ok(());
        }
        other => return Err(format!("the go byte expected: {other:?} {g:?}")),
    }
    let mut sent = ECHO_CHUNK as u64;
    if way == "pipelined" {
        // The second chunk was sent already: its echo first.
        let more: Vec<u8> = (n as u64..2 * n as u64).map(pattern).collect();
        s.read_exact(&mut back).map_err(|e| format!("read back at {sent}: {e}"))?;
        if back != more {
            return Err("the second chunk echoed wrong".into());
        }
        sent += n as u64;
    }
    while sent < bytes {
        let n = (ECHO_CHUNK as u64).min(bytes - sent) as usize;
        let data: Vec<u8> = (0..n as u64).map(|k| pattern(sent + k)).collect();
        s.write_all(&data).map_err(|e| format!("write at {sent}: {e}"))?;
        s.read_exact(&mut back[..n]).map_err(|e| format!("read back at {sent}: {e}"))?;
        if let Some(i) = (0..n).find(|&i| back[i] != data[i]) {
            return Err(format!("byte {} echoed as {}, sent {}", sent + i as u64, back[i], data[i]));
        }
        sent += n as u64;
    }
    s.shutdown(Shutdown::Write).map_err(|e| format!("shutdown: {e}"))?;
    match s.read(&mut g) {
        Ok(0) => {
            println!("echoed {sent}, then the end");
            Ok(())
        }
        other => Err(format!("after {sent} bytes echoed, the end expected: {other:?}")),
    }
}

/// `goclient`'s `bulk` way: `SOCKAPP_ECHO_FIRST` bytes echoed by the
/// server itself in chunks, then `SOCKAPP_UNREAD` bytes sent at once (they
/// wait unread in the server's ring at its exec, their range wrapping the
/// ring when the first count is near its size), then the go byte read
/// (blocking), their echo by the exec'd program checked, and the rest as
/// `goclient`.
fn bulk_goclient(mut s: TcpStream, bytes: u64) -> Result<(), String> {
    let num = |v: &str| std::env::var(v).ok().and_then(|v| v.parse::<u64>().ok()).ok_or(format!("{v} unset"));
    let (first, unread) = (num("SOCKAPP_ECHO_FIRST")?, num("SOCKAPP_UNREAD")?);
    let mut back = vec![0u8; ECHO_CHUNK];
    let mut sent = 0u64;
    let round = |s: &mut TcpStream, sent: &mut u64, upto: u64, back: &mut [u8]| -> Result<(), String> {
        while *sent < upto {
            let n = (ECHO_CHUNK as u64).min(upto - *sent) as usize;
            let data: Vec<u8> = (0..n as u64).map(|k| pattern(*sent + k)).collect();
            s.write_all(&data).map_err(|e| format!("write at {sent}: {e}"))?;
            s.read_exact(&mut back[..n]).map_err(|e| format!("read back at {sent}: {e}"))?;
            if let Some(i) = (0..n).find(|&i| back[i] != data[i]) {
                return Err(format!("byte {} echoed as {}, sent {}", *sent + i as u64, back[i], data[i]));
            }
            *sent += n as u64;
        }
        Ok(())
    };
    round(&mut s, &mut sent, first, &mut back)?;
    {
        use std::os::fd::AsRawFd;
        raw_buf(s.as_raw_fd(), libc::SO_SNDBUF, "SOCKAPP_RAW_SNDBUF");
    }
    let more: Vec<u8> = (first..first + unread).map(pattern).collect();
    s.write_all(&more).map_err(|e| format!("write of the unread bytes: {e}"))?;
    eprintln!("goclient: {unread} bytes sent after {first} echoed");
    let mut g = [0u8; 1];
    if std::env::var_os("SOCKAPP_EXPECT_FAILURE").is_some() {
        // The library's switch fails midway (a test knob): this read and
        // the next call fail, and nothing more is sent.
        // `SOCKAPP_STDERR_EARLY`: descriptor 2 is the connection (`dup2`)
        // for these calls (the library's lines said while it switches,
        // with the connection's send lock held, go into it), SIGPIPE as a
        // C program has it (default), and the calls are waited for 20 s
        // at most (`the go byte read hangs`, exit status 3).
        let early = std::env::var_os("SOCKAPP_STDERR_EARLY").is_some();
        let mut saved = -1;
        if early {
            use std::os::fd::AsRawFd;
            // SAFETY: signal(2), dup(2) and dup2(2) of our descriptors.
            unsafe {
                libc::signal(libc::SIGPIPE, libc::SIG_DFL);
                saved = libc::dup(2);
                if saved < 0 || libc::dup2(s.as_raw_fd(), 2) != 2 {
                    return Err(format!("dup2 onto 2: {}", std::io::Error::last_os_error()));
                }
            }
        }
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut said = Vec::new();
            let r = s.read(&mut g).map_err(|e| e.raw_os_error());
            said.push(format!("goclient: the go byte read: {r:?}"));
            let r = s.write(b"x").map_err(|e| e.raw_os_error());
            said.push(format!("goclient: then a write: {r:?}"));
            let r = s.read(&mut g).map_err(|e| e.raw_os_error());
            said.push(format!("goclient: then a read: {r:?}"));
            let _ = tx.send((said, s));
        });
        let got = rx.recv_timeout(std::time::Duration::from_secs(20));
        if early {
            // SAFETY: dup2(2) and close(2) of our descriptors.
            unsafe {
                libc::dup2(saved, 2);
                libc::close(saved);
            }
        }
        let Ok((said, _s)) = got else {
            println!("goclient: the go byte read hangs (20 s)");
            use std::io::Write as _;
            let _ = std::io::stdout().flush();
            // SAFETY: _exit(2): the hung thread holds the library's locks.
            unsafe { libc::_exit(3) };
        };
        for l in said {
            println!("{l}");
        }
        std::thread::sleep(std::time::Duration::from_millis(300));
        return Ok(());
    }
    match s.read(&mut g) {
        Ok(1) if g[0] == b'G' => {}
        other => return Err(format!("the go byte expected: {other:?} {g:?}")),
    }
    if let Ok(wf) = num("SOCKAPP_WRITTEN_FIRST") {
        return bulk_after_written_first(s, first, unread, bytes, wf);
    }
    let mut got = vec![0u8; unread as usize];
    s.read_exact(&mut got).map_err(|e| format!("read back of the unread bytes: {e}"))?;
    if let Some(i) = (0..got.len()).find(|&i| got[i] != more[i]) {
        return Err(format!("byte {} echoed as {}, sent {}", first + i as u64, got[i], more[i]));
    }
    sent = first + unread;
    round(&mut s, &mut sent, bytes, &mut back)?;
    s.shutdown(Shutdown::Write).map_err(|e| format!("shutdown: {e}"))?;
    match s.read(&mut g) {
        Ok(0) => {
            println!("echoed {sent}, then the end");
            Ok(())
        }
        other => Err(format!("after {sent} bytes echoed, the end expected: {other:?}")),
    }
}

/// `bulk_goclient` against an exec'd program that writes `wf` bytes `w`
/// before it reads (`STDECHO_WRITE_FIRST`), the go byte read: a thread
/// writes the rest of the pattern (from `first + unread` to `bytes`) at
/// once, while the resend may still be queued in this process's library
/// (`SOCKAPP_WRITER`: `blocking` writes, or `nonblocking`: `send` with
/// `MSG_DONTWAIT` and `poll` for `POLLOUT`; `epoll`: the same with an
/// edge-triggered `EPOLLOUT` in `epoll_wait`; `shut`: nothing, its side
/// shut at once, `bytes` taken as `first + unread`; `close`: nothing, and
/// the connection is closed once the `wf` bytes are read; `exit`: the
/// process exits then, the connection open; `_exit`: as `exit`, by
/// `_exit` (no handler runs), after a `setsockopt(SO_LINGER)` of 1, 5 s
/// and its `getsockopt` (`linger set R got R: ON SECS`); `readend`: nothing, and once
/// the `wf` bytes are read, a second later, one more read, whose result
/// it says (`then a read: ...`); `readblock`: as `readend`, the read at
/// once; `abort`: blocking writes, and once the
/// `wf` bytes are read, a `shutdown(SHUT_RDWR)` while the writer waits
/// behind the queue, the writer's result said (`the writer: ...`);
/// `spawn`: blocking writes, and before the `wf` bytes are read, `true`
/// run by a `Command` (`posix_spawnp`) and by `system` (`spawned: ...`);
/// `forkclose`: nothing, and once the `wf` bytes are read, a child is
/// forked that keeps the descriptor (it waits on a pipe) while this
/// process closes its own, then lets the child go (`closed with a forked
/// child holding it`); `stderr`: blocking writes, and once the `wf`
/// bytes are read, SIGPIPE is set to its default (as a C program's)
/// and descriptor 2 becomes the connection (`dup2`) while the writer
/// waits behind the queue, and the writer's result is waited
/// for 20 s at most (`the writer: ...`, or `the writer hangs` and exit
/// status 3), descriptor 2 given back first; `execfail`: nothing, and
/// before anything is read, an `execv` of a path that does not exist
/// (`execv of /no/such failed`), then this side is shut (a byte written
/// first where `SOCKAPP_EXECFAIL_WRITE`: `after the failed exec, a write:
/// ...`), the `wf` bytes read and the connection closed (`closed after
/// ...`); `vforkexit`:
/// blocking writes, and before the `wf` bytes are read, a `vfork`-like
/// child (made from a thread of its own) that calls `exit`, which runs
/// the exit handlers in this memory (`a vfork child called exit`)), and this thread
/// reads the `wf`
/// bytes, then the echo of everything from `first` on, checked byte by
/// byte (the resent bytes, then the thread's, in order, each once), then
/// the end. Says `echoed BYTES after WF written first, then the end`.
fn bulk_after_written_first(
    s: TcpStream,
    first: u64,
    unread: u64,
    bytes: u64,
    wf: u64,
) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let mut w = s.try_clone().map_err(|e| format!("clone: {e}"))?;
    let writer_way = std::env::var("SOCKAPP_WRITER").unwrap_or_default();
    // `epoll`: as `nonblocking`, waiting in `epoll_wait` for an
    // edge-triggered `EPOLLOUT` instead of `poll`.
    let epoll = writer_way == "epoll";
    let nonblocking = writer_way == "nonblocking" || epoll;
    // `shut`: nothing more is written, and the write side is shut at
    // once (while the resend may still be queued: its FIN must wait).
    let shut = writer_way == "shut";
    // `close`: nothing more is written; the program's bytes read, the
    // connection is closed (while the resend may still be queued: the
    // close sends it first).
    let close = writer_way == "close";
    // `exit`: as `close`, with the process's exit in place of the close.
    let exit = writer_way == "exit";
    let underscore_exit = writer_way == "_exit";
    // `readblock`: as `readend`, the read at once (blocked in it when
    // the program's end comes).
    let readblock = writer_way == "readblock";
    let readend = writer_way == "readend" || readblock;
    // `fork`: nothing written by the thread; 64 KiB of the program's
    // bytes read, a child writes one byte on the connection (this process
    // demotes its end for it, the resend still queued) while this one
    // waits for it without reading, then reads the rest of the program's
    // bytes, shuts its side and reads the end (`after the fork: ...`).
    let forked = writer_way == "fork";
    let readend = readend || forked;
    // `execs`: as `close`, with an exec of `/bin/true` in place of the
    // close (the connection close-on-exec, the resend maybe queued).
    let execs = writer_way == "execs";
    let close = close || execs;
    let abort = writer_way == "abort";
    let spawned = writer_way == "spawn";
    let forkclose = writer_way == "forkclose";
    let stderr_way = writer_way == "stderr";
    let vforkexit = writer_way == "vforkexit";
    let execfail = writer_way == "execfail";
    let close = close || exit || underscore_exit || readend || forkclose || execfail;
    let bytes = if shut { first + unread } else { bytes };
    let writer = std::thread::spawn(move || -> Result<u64, String> {
        let fd = w.as_raw_fd();
        let mut at = first + unread;
        if close {
            drop(w);
            return Ok(at);
        }
        if shut {
            w.shutdown(Shutdown::Write).map_err(|e| format!("shutdown: {e}"))?;
            eprintln!("goclient: the writer shut its side at once");
        }
        let (mut eagains, mut polls) = (0u64, 0u64);
        let ep = if epoll {
            // SAFETY: epoll_create1(2) and epoll_ctl(2) with an event of ours.
            unsafe {
                let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
                let mut ev = libc::epoll_event { events: (libc::EPOLLOUT | libc::EPOLLET) as u32, u64: 1 };
                if ep < 0 || libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) != 0 {
                    return Err(format!("epoll: {}", std::io::Error::last_os_error()));
                }
                ep
            }
        } else {
            -1
        };
        while at < bytes {
            let n = (ECHO_CHUNK as u64).min(bytes - at) as usize;
            let data: Vec<u8> = (0..n as u64).map(|k| pattern(at + k)).collect();
            if !nonblocking {
                w.write_all(&data).map_err(|e| format!("write at {at}: {e}"))?;
                at += n as u64;
                continue;
            }
            let mut off = 0;
            while off < n {
                // SAFETY: send(2) from our buffer.
                let r = unsafe { libc::send(fd, data[off..].as_ptr().cast(), n - off, libc::MSG_DONTWAIT) };
                if r > 0 {
                    off += r as usize;
                    continue;
                }
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EAGAIN) {
                    return Err(format!("send at {}: {e}", at + off as u64));
                }
                eagains += 1;
                let r = if epoll {
                    let mut ev = libc::epoll_event { events: 0, u64: 0 };
                    // SAFETY: epoll_wait(2) into one event of ours.
                    unsafe { libc::epoll_wait(ep, &mut ev, 1, 60_000) }
                } else {
                    let mut p = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
                    // SAFETY: one valid pollfd.
                    unsafe { libc::poll(&mut p, 1, 60_000) }
                };
                if r != 1 {
                    return Err(format!("waiting for POLLOUT at {}: {r}", at + off as u64));
                }
                polls += 1;
            }
            at += n as u64;
        }
        if ep >= 0 {
            // SAFETY: closes our epoll descriptor.
            unsafe { libc::close(ep) };
        }
        eprintln!("goclient: the writer sent up to {at} ({eagains} EAGAIN, {polls} polls)");
        Ok(at)
    });
    let mut r = s;
    let mut buf = vec![0u8; 65_536];
    let mut got = 0u64;
    if forked {
        let fd = r.as_raw_fd();
        r.read_exact(&mut buf[..65_536]).map_err(|e| format!("read of 64 KiB: {e}"))?;
        // SAFETY: fork(2); the child only writes, says and _exits.
        let child = unsafe { libc::fork() };
        if child == 0 {
            // SAFETY: write(2) of a byte of ours; _exit(2).
            unsafe {
                let w = libc::write(fd, b"x".as_ptr().cast(), 1);
                let e = std::io::Error::last_os_error();
                eprintln!("goclient: the child's write: {w} ({e})");
                libc::_exit(0);
            }
        }
        let mut st = 0;
        // SAFETY: waitpid(2) for our child.
        unsafe { libc::waitpid(child, &mut st, 0) };
        let mut more = 65_536u64;
        let end = loop {
            match r.read(&mut buf) {
                Ok(0) => break format!("the end after {more}"),
                Ok(n) => more += n as u64,
                Err(e) => break format!("{e} after {more}"),
            }
            if more == wf {
                let _ = r.shutdown(Shutdown::Write);
            }
        };
        println!("after the fork: {end}");
        return Ok(());
    }
    if execfail {
        // (The resend queued, as a rule: the program writes before it
        // reads, and nothing of it is read yet.)
        let argv = [c"/no/such".as_ptr(), std::ptr::null()];
        // SAFETY: execv(2) with a NUL-terminated path and a
        // null-terminated vector of ours; it fails (no such file).
        let rc = unsafe { libc::execv(c"/no/such".as_ptr(), argv.as_ptr()) };
        eprintln!("goclient: execv of /no/such failed: {rc} ({})", std::io::Error::last_os_error());
        // The program reads the resend, then this end (the connection
        // reset instead: the reads below fail, an error, not a loss).
        if std::env::var_os("SOCKAPP_EXECFAIL_WRITE").is_some() {
            // A byte written, the shutdown's result said (a queue cut
            // short at the exec: they must fail, never go out behind it).
            let w = (&r).write(b"x").map_err(|e| e.raw_os_error());
            let sh = r.shutdown(Shutdown::Write).map_err(|e| e.raw_os_error());
            eprintln!("goclient: after the failed exec, a write: {w:?}, the shutdown: {sh:?}");
        } else {
            let _ = r.shutdown(Shutdown::Write);
        }
    }
    if vforkexit {
        // (The resend queued, as a rule, a blocking writer behind it.) A
        // thread of its own: the child shares its thread-local storage,
        // whose destructors `exit` runs.
        let st = std::thread::spawn(vfork_libc_exit)
            .join()
            .map_err(|_| "the vfork thread panicked".to_string())??;
        eprintln!("goclient: a vfork child called exit: {st}");
    }
    if spawned {
        // (While the resend is queued, as a rule: the program writes
        // before it reads, and nothing of it is read yet.)
        let st = std::process::Command::new("true").status().map_err(|e| format!("spawn: {e}"))?;
        // SAFETY: system(3) with a NUL-terminated command of ours.
        let rc = unsafe { libc::system(c"true".as_ptr()) };
        eprintln!("goclient: spawned: {st}, system: {rc}");
    }
    while got < wf {
        let want = (wf - got).min(buf.len() as u64) as usize;
        let n = r.read(&mut buf[..want]).map_err(|e| format!("read of the program's bytes at {got}: {e}"))?;
        if n == 0 {
            return Err(format!("the end after {got} of the program's {wf} bytes"));
        }
        if let Some(i) = buf[..n].iter().position(|&b| b != b'w') {
            return Err(format!("the program's byte {} read as {}", got + i as u64, buf[i]));
        }
        got += n as u64;
    }
    eprintln!("goclient: the program's {wf} bytes read");
    if stderr_way {
        // (The writer waits behind the queue by now, as a rule; the
        // program there ends a second after its writes, unread: the
        // writer's push meets the reset, and the library warns on
        // descriptor 2, this very connection.)
        let fd = r.as_raw_fd();
        // SIGPIPE as a C program has it (default): the library's own
        // line meeting the reset on descriptor 2 must not kill it.
        // SAFETY: signal(2) with the default disposition.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
        // SAFETY: dup(2) and dup2(2) of our descriptors.
        let saved = unsafe { libc::dup(2) };
        // SAFETY: as above.
        if saved < 0 || unsafe { libc::dup2(fd, 2) } != 2 {
            return Err(format!("dup2 onto 2: {}", std::io::Error::last_os_error()));
        }
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(writer.join());
        });
        let got = rx.recv_timeout(std::time::Duration::from_secs(20));
        // SAFETY: dup2(2) and close(2) of our descriptors.
        unsafe {
            libc::dup2(saved, 2);
            libc::close(saved);
        }
        match got {
            Ok(w) => {
                let w = w.map_err(|_| "the writer panicked".to_string())?;
                println!("the writer: {w:?}");
                return Ok(());
            }
            Err(_) => {
                println!("the writer hangs (20 s) after the reset met with descriptor 2 the connection");
                use std::io::Write as _;
                let _ = std::io::stdout().flush();
                // SAFETY: _exit(2): the writer holds the library's lock.
                unsafe { libc::_exit(3) };
            }
        }
    }
    if abort {
        // (The writer waits behind the queue by now, as a rule.)
        std::thread::sleep(std::time::Duration::from_millis(300));
        r.shutdown(Shutdown::Both).map_err(|e| format!("shutdown: {e}"))?;
        println!("shut down while the writer waits");
        let w = writer.join().map_err(|_| "the writer panicked".to_string())?;
        println!("the writer: {w:?}");
        return Ok(());
    }
    if readend {
        writer.join().map_err(|_| "the writer panicked".to_string())??;
        // (The library's progress thread meets the program's end first:
        // the program ends a second after its writes, this read comes
        // three seconds after them.)
        if !readblock {
            std::thread::sleep(std::time::Duration::from_millis(3000));
        }
        let mut g = [0u8; 1];
        let rr = r.read(&mut g).map_err(|e| e.raw_os_error());
        println!("then a read: {rr:?}");
        return Ok(());
    }
    if close {
        writer.join().map_err(|_| "the writer panicked".to_string())??;
        if exit {
            println!("exits after {wf} written first");
            std::process::exit(0);
        }
        if underscore_exit {
            use std::io::Write as _;
            // A linger of the program's own, set while the resend is
            // queued: what it reads back is its own, and the end still
            // resets.
            let lg = libc::linger { l_onoff: 1, l_linger: 5 };
            let size = std::mem::size_of::<libc::linger>() as libc::socklen_t;
            // SAFETY: setsockopt(2) and getsockopt(2) on our connection with
            // a linger of ours, its size.
            let (set, got, back) = unsafe {
                let set = libc::setsockopt(
                    r.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_LINGER,
                    (&lg as *const libc::linger).cast(),
                    size,
                );
                let mut back = libc::linger { l_onoff: 0, l_linger: 0 };
                let mut n = size;
                let got = libc::getsockopt(
                    r.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_LINGER,
                    (&mut back as *mut libc::linger).cast(),
                    &mut n,
                );
                (set, got, back)
            };
            println!("linger set {set} got {got}: {} {}", back.l_onoff, back.l_linger);
            println!("_exits after {wf} written first");
            let _ = std::io::stdout().flush();
            // SAFETY: _exit(2): no handler of the library runs.
            unsafe { libc::_exit(0) };
        }
        if execs {
            use std::io::Write as _;
            use std::os::unix::process::CommandExt as _;
            println!("execs after {wf} written first");
            let _ = std::io::stdout().flush();
            let e = std::process::Command::new("/bin/true").exec();
            return Err(format!("exec: {e}"));
        }
        if forkclose {
            let mut p = [0; 2];
            // SAFETY: pipe(2) into our array.
            if unsafe { libc::pipe(p.as_mut_ptr()) } != 0 {
                return Err(format!("pipe: {}", std::io::Error::last_os_error()));
            }
            // SAFETY: fork(2); the child only reads its pipe and _exits.
            let child = unsafe { libc::fork() };
            if child == 0 {
                // SAFETY: close(2), read(2) into a byte of ours, _exit(2).
                unsafe {
                    libc::close(p[1]);
                    let mut b = 0u8;
                    libc::read(p[0], (&mut b as *mut u8).cast(), 1);
                    libc::_exit(0);
                }
            }
            drop(r);
            // SAFETY: closes our pipe's ends; waitpid(2) for our child.
            unsafe {
                libc::close(p[1]);
                libc::close(p[0]);
                let mut st = 0;
                libc::waitpid(child, &mut st, 0);
            }
            println!("closed with a forked child holding it, after {wf} written first");
            return Ok(());
        }
        drop(r);
        println!("closed after {wf} written first");
        return Ok(());
    }
    let mut at = first;
    while at < bytes {
        let want = (bytes - at).min(buf.len() as u64) as usize;
        let n = r.read(&mut buf[..want]).map_err(|e| format!("read back at {at}: {e}"))?;
        if n == 0 {
            return Err(format!("the end at {at} of the echo"));
        }
        if let Some(i) = (0..n).find(|&i| buf[i] != pattern(at + i as u64)) {
            return Err(format!(
                "byte {} echoed as {}, sent {}",
                at + i as u64,
                buf[i],
                pattern(at + i as u64)
            ));
        }
        at += n as u64;
    }
    writer.join().map_err(|_| "the writer panicked".to_string())??;
    if !shut {
        r.shutdown(Shutdown::Write).map_err(|e| format!("shutdown: {e}"))?;
    }
    let mut g = [0u8; 1];
    match r.read(&mut g) {
        Ok(0) => {
            println!("echoed {bytes} after {wf} written first, then the end");
            Ok(())
        }
        other => Err(format!("after {bytes} bytes echoed, the end expected: {other:?}")),
    }
}

/// A `vfork` child's work (`vfork_run`): `dup2`s `fd` onto 0 and 1 if
/// it is not -1, then `execve`s `path` with `argv` and this process's
/// environment (the library's interposed calls, in the child).
struct VforkJob {
    fd: i32,
    path: *const libc::c_char,
    argv: *const *const libc::c_char,
}

extern "C" fn vfork_child(arg: *mut libc::c_void) -> libc::c_int {
    extern "C" {
        static environ: *const *const libc::c_char;
    }
    // SAFETY: `arg` is the parent's `VforkJob`, alive while this child
    // runs (the parent waits until it execs or exits: CLONE_VFORK).
    let job = unsafe { &*(arg as *const VforkJob) };
    // SAFETY: dup2(2), execve(2) with the parent's NUL-terminated strings
    // and null-terminated vector, and _exit(2); nothing else in the child.
    unsafe {
        if job.fd >= 0 && (libc::dup2(job.fd, 0) != 0 || libc::dup2(job.fd, 1) != 1) {
            libc::_exit(126);
        }
        libc::execve(job.path, job.argv, environ);
        libc::_exit(127)
    }
}

/// Runs `args` (a path, then its arguments) in a child made as `vfork`
/// makes one (`clone` with `CLONE_VM | CLONE_VFORK`: the child shares this
/// memory until it execs), with `fd` as its stdin and stdout if not -1.
fn vfork_run(fd: i32, args: &[&std::ffi::OsStr]) -> Result<libc::pid_t, String> {
    use std::os::unix::ffi::OsStrExt;
    let c: Vec<std::ffi::CString> = args
        .iter()
        .map(|a| std::ffi::CString::new(a.as_bytes()).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let mut argv: Vec<*const libc::c_char> = c.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let job = VforkJob { fd, path: c[0].as_ptr(), argv: argv.as_ptr() };
    let mut stack = vec![0u8; 1 << 20];
    // SAFETY: the end of our stack buffer, 16-byte aligned (the stack
    // grows down); it outlives the child's use (CLONE_VFORK waits).
    let top = unsafe { stack.as_mut_ptr().add(stack.len()) } as usize & !15;
    // SAFETY: clone(2) with a child function that only dup2s, execs and
    // _exits, its own stack, and a job alive across the call.
    let pid = unsafe {
        libc::clone(
            vfork_child,
            top as *mut libc::c_void,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            (&job as *const VforkJob).cast_mut().cast(),
        )
    };
    if pid < 0 {
        return Err(format!("clone: {}", std::io::Error::last_os_error()));
    }
    Ok(pid)
}

extern "C" fn vfork_child_exit(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the parent's descriptor number, alive while this
    // child runs (CLONE_VFORK).
    let fd = unsafe { *(arg as *const i32) };
    // SAFETY: dup2(2), close(2) and _exit(2) on the parent's descriptor
    // numbers, in this child's own table; nothing else in the child.
    unsafe {
        libc::dup2(fd, 0);
        libc::close(fd);
        // As `if (chdir(d) < 0) _exit(1);`: no exec.
        libc::_exit(1)
    }
}

/// A child made as `vfork` makes one that `dup2`s `fd` onto its stdin,
/// closes `fd`, and leaves by `_exit(1)` without an exec; waited for.
extern "C" fn vfork_child_libc_exit(_: *mut libc::c_void) -> libc::c_int {
    // SAFETY: exit(3) in a child sharing this memory: the exit handlers
    // run here (the library's among them), as a C program's `vfork`
    // child that calls `exit` runs them.
    unsafe { libc::exit(5) }
}

/// A `vfork`-like child (`clone` with `CLONE_VM | CLONE_VFORK`) that
/// calls `exit(5)`; its exit status.
fn vfork_libc_exit() -> Result<i32, String> {
    let mut stack = vec![0u8; 1 << 16];
    // SAFETY: the end of our stack buffer, 16-byte aligned.
    let top = unsafe { stack.as_mut_ptr().add(stack.len()) } as usize & !15;
    // SAFETY: clone(2) with a child function that only calls exit(3), its
    // own stack.
    let pid = unsafe {
        libc::clone(
            vfork_child_libc_exit,
            top as *mut libc::c_void,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            std::ptr::null_mut(),
        )
    };
    if pid < 0 {
        return Err(format!("clone: {}", std::io::Error::last_os_error()));
    }
    let mut status = 0;
    // SAFETY: waitpid(2) on our child.
    if unsafe { libc::waitpid(pid, &mut status, 0) } != pid {
        return Err("waitpid".into());
    }
    if !libc::WIFEXITED(status) {
        return Err(format!("the vfork child ended with {status:#x}"));
    }
    Ok(libc::WEXITSTATUS(status))
}

fn vfork_exit(fd: i32) -> Result<(), String> {
    let mut stack = vec![0u8; 1 << 16];
    // SAFETY: the end of our stack buffer, 16-byte aligned.
    let top = unsafe { stack.as_mut_ptr().add(stack.len()) } as usize & !15;
    // SAFETY: clone(2) with a child function that only dup2s, closes and
    // _exits, its own stack, and `fd` alive across the call.
    let pid = unsafe {
        libc::clone(
            vfork_child_exit,
            top as *mut libc::c_void,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            (&fd as *const i32).cast_mut().cast(),
        )
    };
    if pid < 0 {
        return Err(format!("clone: {}", std::io::Error::last_os_error()));
    }
    let mut status = 0;
    // SAFETY: waitpid(2) on our child.
    if unsafe { libc::waitpid(pid, &mut status, 0) } != pid {
        return Err("waitpid".into());
    }
    if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 1) {
        return Err(format!("the vfork child ended with {status:#x}"));
    }
    Ok(())
}

/// `inetd`'s `carried-vfork-exit`: one chunk echoed (carried), then two
/// `vfork` children in turn `dup2` the connection onto their stdin,
/// close it and `_exit` without an exec; then this process echoes the
/// rest on the connection, which must still be carried here.
fn carried_vfork_exit(mut s: TcpStream) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    s.set_read_timeout(Some(std::time::Duration::from_secs(15))).map_err(|e| e.to_string())?;
    let n = echo_upto(&mut s, ECHO_CHUNK as u64)?;
    eprintln!("echoed {n} before the vfork children");
    vfork_exit(s.as_raw_fd())?;
    vfork_exit(s.as_raw_fd())?;
    let m = echo_upto(&mut s, u64::MAX)?;
    eprintln!("echoed {m} more after the vfork children");
    Ok(())
}

/// Waits for the child `pid`; an error unless it exited with 0.
fn wait_ok(pid: libc::pid_t, what: &str) -> Result<(), String> {
    let mut status = 0;
    // SAFETY: waitpid(2) on our child.
    if unsafe { libc::waitpid(pid, &mut status, 0) } != pid {
        return Err(format!("waitpid {what}"));
    }
    if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
        return Err(format!("{what} ended with {status:#x}"));
    }
    Ok(())
}

/// `inetd`'s `carried-vfork`: one chunk echoed (carried), then a `vfork`
/// child gets the connection as its stdin and stdout and execs `stdecho
/// go`, then, before any other call of this process, a second `vfork`
/// child execs `true`; then the close, and the wait for `stdecho`; alive
/// until a second connection comes (the test's, once it is done).
fn carried_vfork(l: TcpListener, mut s: TcpStream) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    s.set_read_timeout(Some(std::time::Duration::from_secs(60))).map_err(|e| e.to_string())?;
    let n = echo_upto(&mut s, ECHO_CHUNK as u64)?;
    eprintln!("echoed {n} before the vfork");
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let echo = vfork_run(s.as_raw_fd(), &[exe.as_os_str(), "stdecho".as_ref(), "go".as_ref()])?;
    let t = vfork_run(-1, &["/bin/true".as_ref()])?;
    wait_ok(t, "true")?;
    drop(s);
    wait_ok(echo, "stdecho")?;
    let _ = l.accept();
    Ok(())
}

/// `inetd`'s `carried-vfork-late`: one chunk echoed (carried), then a
/// `vfork` child `dup2`s the connection onto its stdin and stdout and
/// execs `stdecho go` (against a client that does not answer the
/// demotion in time: the program does not get it); then this process
/// writes a line to its own stdout, which the child's `dup2` did not
/// change.
fn carried_vfork_late(mut s: TcpStream) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    s.set_read_timeout(Some(std::time::Duration::from_secs(60))).map_err(|e| e.to_string())?;
    let n = echo_upto(&mut s, ECHO_CHUNK as u64)?;
    eprintln!("echoed {n} before the vfork");
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let echo = vfork_run(s.as_raw_fd(), &[exe.as_os_str(), "stdecho".as_ref(), "go".as_ref()])?;
    wait_ok(echo, "stdecho")?;
    let line = b"the parent's stdout is its own\n";
    // SAFETY: write(2) of our buffer to descriptor 1, through the library.
    let w = unsafe { libc::write(1, line.as_ptr().cast(), line.len()) };
    eprintln!("the parent's write to its stdout: {w}");
    drop(s);
    Ok(())
}

/// Sets the kernel socket's buffer `opt` of `fd` to the bytes in `var`,
/// if set, by a raw system call (past the library, which keeps a carried
/// connection's options for later): the kernel buffers shrunk, so that a
/// demotion's resend cannot fit in them.
fn raw_buf(fd: i32, opt: libc::c_int, var: &str) {
    if let Some(v) = std::env::var(var).ok().and_then(|v| v.parse::<libc::c_int>().ok()) {
        // SAFETY: setsockopt(2) with an int of ours, its size.
        unsafe {
            libc::syscall(
                libc::SYS_setsockopt,
                fd,
                libc::SOL_SOCKET,
                opt,
                &v as *const libc::c_int,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
    }
}

/// Sleeps for the milliseconds in `var`, if set.
fn pause(var: &str) {
    if let Some(ms) = std::env::var(var).ok().and_then(|v| v.parse().ok()) {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

/// `echoclient`'s work on a connected stream.
fn echo_check(s: TcpStream, bytes: u64) -> Result<(), String> {
    echo_check_from(s, 0, bytes)
}

/// `echo_check` from byte `sent` of the pattern on (the bytes before it
/// echoed already).
fn echo_check_from(mut s: TcpStream, mut sent: u64, bytes: u64) -> Result<(), String> {
    s.set_read_timeout(Some(std::time::Duration::from_secs(60))).map_err(|e| e.to_string())?;
    let mut back = vec![0u8; ECHO_CHUNK];
    while sent < bytes {
        let n = (ECHO_CHUNK as u64).min(bytes - sent) as usize;
        let data: Vec<u8> = (0..n as u64).map(|k| pattern(sent + k)).collect();
        s.write_all(&data).map_err(|e| format!("write at {sent}: {e}"))?;
        s.read_exact(&mut back[..n]).map_err(|e| format!("read back at {sent}: {e}"))?;
        if let Some(i) = (0..n).find(|&i| back[i] != data[i]) {
            return Err(format!("byte {} echoed as {}, sent {}", sent + i as u64, back[i], data[i]));
        }
        sent += n as u64;
    }
    s.shutdown(Shutdown::Write).map_err(|e| format!("shutdown: {e}"))?;
    let mut b = [0u8; 1];
    match s.read(&mut b) {
        Ok(0) => {
            println!("echoed {sent}, then the end");
            Ok(())
        }
        other => Err(format!("after {sent} bytes echoed, the end expected: {other:?}")),
    }
}

/// `dup2`s `fd` onto each of `to` (the copies are inherited by an exec).
fn dup_onto(fd: i32, to: &[i32]) -> Result<(), String> {
    for &t in to {
        // SAFETY: dup2(2) on descriptors of ours.
        if unsafe { libc::dup2(fd, t) } != t {
            return Err(format!("dup2 onto {t}: {}", std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// `execv`s this program with `args` (returns only on failure).
fn exec_self(args: &[&str]) -> String {
    let exe = std::env::current_exe().map(|p| p.into_os_string());
    let Ok(exe) = exe else { return "current_exe".into() };
    use std::os::unix::ffi::OsStrExt;
    let c = |b: &[u8]| std::ffi::CString::new(b).expect("no NUL");
    let path = c(exe.as_bytes());
    let argv: Vec<std::ffi::CString> =
        std::iter::once(path.clone()).chain(args.iter().map(|a| c(a.as_bytes()))).collect();
    let mut ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    ptrs.push(std::ptr::null());
    // SAFETY: a NUL-terminated path and a null-terminated argv of
    // NUL-terminated strings, alive across the call.
    unsafe { libc::execv(path.as_ptr(), ptrs.as_ptr()) };
    format!("execv: {}", std::io::Error::last_os_error())
}

/// `execve`s this program with `args` and this process's environment
/// (returns only on failure).
fn execve_self(args: &[&str]) -> String {
    extern "C" {
        static environ: *const *const libc::c_char;
    }
    let exe = std::env::current_exe().map(|p| p.into_os_string());
    let Ok(exe) = exe else { return "current_exe".into() };
    use std::os::unix::ffi::OsStrExt;
    let c = |b: &[u8]| std::ffi::CString::new(b).expect("no NUL");
    let path = c(exe.as_bytes());
    let argv: Vec<std::ffi::CString> =
        std::iter::once(path.clone()).chain(args.iter().map(|a| c(a.as_bytes()))).collect();
    let mut ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    ptrs.push(std::ptr::null());
    // SAFETY: a NUL-terminated path, a null-terminated argv of
    // NUL-terminated strings alive across the call, and the process's
    // environment (read once, nothing changes it meanwhile).
    unsafe { libc::execve(path.as_ptr(), ptrs.as_ptr(), environ) };
    format!("execve: {}", std::io::Error::last_os_error())
}

fn inetd(port: u16, mode: &str) -> Result<(), String> {
    use std::os::fd::{AsRawFd, OwnedFd};
    // `vfork-first-exit` and `vfork-first-exec`: before any other call
    // of interest, a `vfork` child that `_exit`s, or one that execs
    // `true`; then the connection is carried, echoed to its end, closed.
    if mode == "vfork-first-exit" {
        vfork_exit(-1)?;
    }
    if mode == "vfork-first-exec" {
        let t = vfork_run(-1, &["/bin/true".as_ref()])?;
        wait_ok(t, "true")?;
    }
    let l = TcpListener::bind((ip_from("SOCKAPP_BIND"), port)).map_err(|e| format!("bind: {e}"))?;
    println!("listening");
    std::io::stdout().flush().ok();
    let (mut s, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
    if mode.starts_with("vfork-first-") {
        s.set_read_timeout(Some(std::time::Duration::from_secs(60))).map_err(|e| e.to_string())?;
        let n = echo_upto(&mut s, u64::MAX)?;
        eprintln!("echoed {n} after a first vfork child");
        drop(s);
        // Alive until the test is done with the client (a second
        // connection): the client reads the end from the close alone.
        let _ = l.accept();
        return Ok(());
    }
    if mode == "carried-vfork" {
        return carried_vfork(l, s);
    }
    if mode == "carried-vfork-late" {
        return carried_vfork_late(s);
    }
    if mode == "carried-vfork-exit" {
        return carried_vfork_exit(s);
    }
    drop(l);
    pause("SOCKAPP_EXEC_DELAY_MS");
    match mode {
        "exec" => {
            dup_onto(s.as_raw_fd(), &[0, 1])?;
            drop(s);
            Err(exec_self(&["stdecho"]))
        }
        "carried-exec-eof" => {
            // Carried, the request read to its end (the client shut its
            // write side) and echoed, then `execve` of `stdecho go`, which
            // answers with its go byte.
            s.set_read_timeout(Some(std::time::Duration::from_secs(60))).map_err(|e| e.to_string())?;
            let n = echo_upto(&mut s, u64::MAX)?;
            eprintln!("echoed {n}, then the end, before the exec");
            dup_onto(s.as_raw_fd(), &[0, 1])?;
            drop(s);
            Err(execve_self(&["stdecho", "go"]))
        }
        "carried-exec" => {
            // Carried, one chunk echoed (the client then waits for the go
            // byte of the exec'd program): `execve` of `stdecho go` with
            // the connection as its stdin and stdout.
            s.set_read_timeout(Some(std::time::Duration::from_secs(60))).map_err(|e| e.to_string())?;
            let first = std::env::var("SOCKAPP_ECHO_FIRST").ok().and_then(|v| v.parse().ok());
            let n = echo_upto(&mut s, first.unwrap_or(ECHO_CHUNK as u64))?;
            eprintln!("echoed {n} before the exec");
            pause("SOCKAPP_BEFORE_EXEC_MS");
            raw_buf(s.as_raw_fd(), libc::SO_RCVBUF, "SOCKAPP_RAW_RCVBUF");
            dup_onto(s.as_raw_fd(), &[0, 1])?;
            drop(s);
            Err(execve_self(&["stdecho", "go"]))
        }
        "carried-readexec" => {
            // Carried, `SOCKAPP_ECHO_FIRST` bytes (64 KiB by default) of
            // the client's stream read and checked while the client
            // writes on, then `execve` of `stdcheck FIRST`, which reads
            // the rest.
            s.set_read_timeout(Some(std::time::Duration::from_secs(60))).map_err(|e| e.to_string())?;
            let first = std::env::var("SOCKAPP_ECHO_FIRST").ok().and_then(|v| v.parse().ok());
            let first: u64 = first.unwrap_or(64 << 10);
            let mut buf = vec![0u8; 65_536];
            let mut n = 0u64;
            while n < first {
                let want = (first - n).min(buf.len() as u64) as usize;
                let r = s.read(&mut buf[..want]).map_err(|e| format!("read after {n}: {e}"))?;
                if r == 0 {
                    return Err(format!("the end after {n}"));
                }
                if let Some(k) = (0..r).find(|&k| buf[k] != pattern(n + k as u64)) {
                    return Err(format!("byte {} is {}", n + k as u64, buf[k]));
                }
                n += r as u64;
            }
            eprintln!("read {n} before the exec");
            pause("SOCKAPP_BEFORE_EXEC_MS");
            dup_onto(s.as_raw_fd(), &[0, 1])?;
            drop(s);
            Err(execve_self(&["stdcheck", &n.to_string()]))
        }
        "fork-exec" => {
            // SAFETY: fork(2) in a single-threaded program; the child only
            // dup2s and execs.
            match unsafe { libc::fork() } {
                -1 => Err(format!("fork: {}", std::io::Error::last_os_error())),
                0 => {
                    let r = dup_onto(s.as_raw_fd(), &[0, 1]).map(|()| {
                        drop(s);
                        let argv = [c"cat".as_ptr(), std::ptr::null()];
                        // SAFETY: a NUL-terminated name and a
                        // null-terminated argv of static strings.
                        unsafe { libc::execvp(c"cat".as_ptr(), argv.as_ptr()) };
                        std::io::Error::last_os_error()
                    });
                    eprintln!("sockapp child: exec cat: {r:?}");
                    std::process::exit(1)
                }
                child => {
                    drop(s);
                    let mut status = 0;
                    // SAFETY: waitpid(2) on our child.
                    if unsafe { libc::waitpid(child, &mut status, 0) } != child {
                        return Err("waitpid".into());
                    }
                    if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
                        return Err(format!("cat ended with {status:#x}"));
                    }
                    Ok(())
                }
            }
        }
        "spawn" | "carried-spawn" => {
            s.set_read_timeout(Some(std::time::Duration::from_secs(60))).map_err(|e| e.to_string())?;
            let mut args = vec!["stdecho"];
            if mode == "carried-spawn" {
                let echoed = echo_upto(&mut s, ECHO_CHUNK as u64)?;
                eprintln!("echoed {echoed} before the spawn");
                pause("SOCKAPP_BEFORE_EXEC_MS");
                args.push("go");
            }
            let exe = std::env::current_exe().map_err(|e| e.to_string())?;
            let a = OwnedFd::from(s.try_clone().map_err(|e| e.to_string())?);
            let b = OwnedFd::from(s.try_clone().map_err(|e| e.to_string())?);
            let st = std::process::Command::new(exe)
                .args(&args)
                .stdin(a)
                .stdout(b)
                .status()
                .map_err(|e| format!("spawn: {e}"))?;
            if !st.success() {
                return Err(format!("stdecho ended with {st}"));
            }
            Ok(())
        }
        _ => Err(format!("inetd: unknown mode {mode}")),
    }
}

/// `execlisten PORT`: listens, forks, and the child execs `fdecho` with
/// the listening socket as descriptor 10 (a master that starts worker
/// programs on its listener); the parent keeps its copy and waits.
fn execlisten(port: u16) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let l = TcpListener::bind(("127.0.0.1", port)).map_err(|e| format!("bind: {e}"))?;
    println!("listening");
    std::io::stdout().flush().ok();
    // SAFETY: fork(2) in a single-threaded program; the child only dup2s
    // and execs.
    match unsafe { libc::fork() } {
        -1 => Err(format!("fork: {}", std::io::Error::last_os_error())),
        0 => {
            let e = dup_onto(l.as_raw_fd(), &[10]).err().unwrap_or_else(|| exec_self(&["fdecho"]));
            eprintln!("sockapp child: {e}");
            std::process::exit(1)
        }
        child => {
            let mut status = 0;
            // SAFETY: waitpid(2) on our child.
            if unsafe { libc::waitpid(child, &mut status, 0) } != child {
                return Err("waitpid".into());
            }
            if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
                return Err(format!("fdecho ended with {status:#x}"));
            }
            drop(l);
            Ok(())
        }
    }
}

/// `fdecho`: accepts one connection on the listening socket at
/// descriptor 10 and echoes it; says `echoed N`.
fn fdecho() -> Result<(), String> {
    use std::os::fd::FromRawFd;
    // SAFETY: descriptor 10 is the listener `execlisten` left us, ours alone.
    let l = unsafe { TcpListener::from_raw_fd(10) };
    let (mut s, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(60))).map_err(|e| e.to_string())?;
    let n = echo_all(&mut s)?;
    println!("echoed {n}");
    Ok(())
}

/// Copies stdin to stdout until the end; says `stdecho N` on stderr.
/// With `go`, first says whether its stdin is a connected socket and
/// writes the byte `G` (the client sends the rest once it read it).
fn stdecho(go: bool) -> Result<(), String> {
    let mut buf = vec![0u8; 65_536];
    let mut n = 0u64;
    if go {
        // SAFETY: getpeername(2) into a sockaddr_storage of ours, its size.
        let connected = unsafe {
            let mut a: libc::sockaddr_storage = std::mem::zeroed();
            let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            libc::getpeername(0, (&mut a as *mut libc::sockaddr_storage).cast(), &mut len) == 0
        };
        // One write(2) for the whole line: the parent's library may log on
        // the same stderr at the same time, and `eprintln!` may split it.
        let line =
            format!("stdecho: stdin {}\n", if connected { "is a connected socket" } else { "is no socket" });
        // SAFETY: write(2) of our buffer, its length.
        unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
        // SAFETY: write(2) of one byte of ours.
        unsafe { libc::write(1, b"G".as_ptr().cast(), 1) };
        // A program slow to read its stdin (the peer's resend must wait).
        pause("STDECHO_DELAY_MS");
        // A program that writes before it reads (`cat big; cat`):
        // `STDECHO_WRITE_FIRST` bytes first.
        if let Some(k) = std::env::var("STDECHO_WRITE_FIRST").ok().and_then(|v| v.parse::<usize>().ok()) {
            let junk = vec![b'w'; k];
            let mut off = 0;
            while off < k {
                // SAFETY: write(2) from our buffer.
                let w = unsafe { libc::write(1, junk[off..].as_ptr().cast(), k - off) };
                if w <= 0 {
                    return Err(format!("write first at {off}: {}", std::io::Error::last_os_error()));
                }
                off += w as usize;
            }
            // Then a sleep before it reads.
            pause("STDECHO_DELAY_AFTER_WRITE_MS");
            // `STDECHO_EXIT_AFTER_WRITE`: ends without reading (its
            // close, with bytes unread, is a reset).
            if std::env::var_os("STDECHO_EXIT_AFTER_WRITE").is_some() {
                // SAFETY: write(2) of a line of ours.
                unsafe { libc::write(2, b"stdecho exits unread\n".as_ptr().cast(), 21) };
                return Ok(());
            }
        }
        if std::env::var_os("STDECHO_COUNT_ONLY").is_some() {
            // Reads to the end without echoing: says `stdecho read N`.
            loop {
                // SAFETY: read(2) into our buffer.
                let r = unsafe { libc::read(0, buf.as_mut_ptr().cast(), buf.len()) };
                if r < 0 {
                    return Err(format!("read after {n}: {}", std::io::Error::last_os_error()));
                }
                if r == 0 {
                    break;
                }
                n += r as u64;
            }
            let line = format!("stdecho read {n}\n");
            // SAFETY: write(2) of our buffer, its length.
            unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
            return Ok(());
        }
    }
    loop {
        // SAFETY: read(2) into our buffer.
        let r = unsafe { libc::read(0, buf.as_mut_ptr().cast(), buf.len()) };
        if r < 0 {
            return Err(format!("read after {n}: {}", std::io::Error::last_os_error()));
        }
        if r == 0 {
            break;
        }
        let mut off = 0;
        while off < r as usize {
            // SAFETY: write(2) from our buffer.
            let w = unsafe { libc::write(1, buf[off..r as usize].as_ptr().cast(), r as usize - off) };
            if w <= 0 {
                return Err(format!("write after {n}: {}", std::io::Error::last_os_error()));
            }
            off += w as usize;
        }
        n += r as u64;
    }
    let line = format!("stdecho {n}\n");
    // SAFETY: write(2) of our buffer, its length (one write, as above).
    unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
    Ok(())
}

/// `stdcheck FROM`: reads stdin to its end, checking every byte against
/// the pattern from FROM on, then answers `ok TOTAL` (FROM and the bytes
/// read) on stdout, as `server` does; says `stdcheck N` on stderr.
fn stdcheck(from: u64) -> Result<(), String> {
    let mut buf = vec![0u8; 65_536];
    let mut n = 0u64;
    loop {
        // SAFETY: read(2) into our buffer.
        let r = unsafe { libc::read(0, buf.as_mut_ptr().cast(), buf.len()) };
        if r < 0 {
            return Err(format!("read after {n}: {}", std::io::Error::last_os_error()));
        }
        if r == 0 {
            break;
        }
        if let Some(k) = (0..r as usize).find(|&k| buf[k] != pattern(from + n + k as u64)) {
            return Err(format!("byte {} is {}", from + n + k as u64, buf[k]));
        }
        n += r as u64;
    }
    let answer = format!("ok {}\n", from + n);
    // SAFETY: write(2) of our buffer, its length.
    if unsafe { libc::write(1, answer.as_ptr().cast(), answer.len()) } != answer.len() as isize {
        return Err(format!("answer: {}", std::io::Error::last_os_error()));
    }
    let line = format!("stdcheck {n}\n");
    // SAFETY: write(2) of our buffer, its length (one write).
    unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
    Ok(())
}

/// `forkclient PORT BYTES`: connects, forks, and the child runs
/// `echoclient`'s work on the connection (its first call); the parent
/// closes its copy at once and waits for the child.
fn forkclient(port: u16, bytes: u64) -> Result<(), String> {
    let s = TcpStream::connect((ip_from("SOCKAPP_HOST"), port)).map_err(|e| format!("connect: {e}"))?;
    std::io::stdout().flush().ok();
    // SAFETY: fork(2) in a single-threaded program; the child only uses
    // the connection and exits.
    match unsafe { libc::fork() } {
        -1 => Err(format!("fork: {}", std::io::Error::last_os_error())),
        0 => {
            let code = match echo_check(s, bytes) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("sockapp child: {e}");
                    1
                }
            };
            std::io::stdout().flush().ok();
            std::process::exit(code)
        }
        child => {
            drop(s);
            let mut status = 0;
            // SAFETY: waitpid(2) on our child.
            if unsafe { libc::waitpid(child, &mut status, 0) } != child {
                return Err("waitpid".into());
            }
            if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
                return Err(format!("the child ended with {status:#x}"));
            }
            Ok(())
        }
    }
}

/// `execclient PORT BYTES`: connects, and execs `fdclient` with the socket
/// as descriptor 10, before any call on it.
fn execclient(port: u16, bytes: u64) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    pause("SOCKAPP_EXEC_DELAY_MS");
    dup_onto(s.as_raw_fd(), &[10])?;
    drop(s);
    Err(exec_self(&["fdclient", &bytes.to_string()]))
}

fn fdclient(bytes: u64) -> Result<(), String> {
    use std::os::fd::FromRawFd;
    // SAFETY: descriptor 10 is the socket `execclient` left us, ours alone.
    let mut s = unsafe { TcpStream::from_raw_fd(10) };
    if std::env::var("SOCKAPP_FD_SEND").as_deref() != Ok("1") {
        return echo_check(s, bytes);
    }
    let mut sent = 0u64;
    while sent < bytes {
        let n = (64u64 << 10).min(bytes - sent);
        let data: Vec<u8> = (0..n).map(|k| pattern(sent + k)).collect();
        s.write_all(&data).map_err(|e| format!("write: {e}"))?;
        sent += n;
    }
    half_close_and_check(&mut s, bytes)
}

/// `carriedexecclient PORT BYTES [pipelined]`: connects, sends one chunk
/// (`SOCKAPP_ECHO_FIRST` bytes in chunks where set) and reads its echo
/// (the connection is carried), then, `pipelined`, sends a second chunk
/// (`SOCKAPP_UNREAD` bytes where set) whose echo lands in this process's
/// ring unread;
/// after a pause of `SOCKAPP_BEFORE_EXEC_MS` it `execve`s `fdresume BYTES
/// SENT PENDING` with the connection as descriptor 10 (a client that
/// hands its connection to another program once it used it).
fn carriedexecclient(port: u16, bytes: u64, pipelined: bool) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let mut s = TcpStream::connect((ip_from("SOCKAPP_HOST"), port)).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(60))).map_err(|e| e.to_string())?;
    let num = |v: &str| std::env::var(v).ok().and_then(|v| v.parse::<u64>().ok());
    let first = num("SOCKAPP_ECHO_FIRST").unwrap_or(ECHO_CHUNK as u64);
    let mut back = vec![0u8; ECHO_CHUNK];
    let mut sent = 0u64;
    while sent < first {
        let n = (ECHO_CHUNK as u64).min(first - sent) as usize;
        let data: Vec<u8> = (0..n as u64).map(|k| pattern(sent + k)).collect();
        s.write_all(&data).map_err(|e| format!("write at {sent}: {e}"))?;
        s.read_exact(&mut back[..n]).map_err(|e| format!("read back at {sent}: {e}"))?;
        if back[..n] != data[..] {
            return Err(format!("the chunk at {sent} echoed wrong"));
        }
        sent += n as u64;
    }
    let mut pending = 0;
    if pipelined {
        pending = num("SOCKAPP_UNREAD").unwrap_or(ECHO_CHUNK as u64);
        let more: Vec<u8> = (sent..sent + pending).map(pattern).collect();
        s.write_all(&more).map_err(|e| format!("write: {e}"))?;
        sent += pending;
    }
    eprintln!("carriedexecclient: {sent} sent, {pending} of their echo unread, before the exec");
    pause("SOCKAPP_BEFORE_EXEC_MS");
    dup_onto(s.as_raw_fd(), &[10])?;
    drop(s);
    Err(execve_self(&["fdresume", &bytes.to_string(), &sent.to_string(), &pending.to_string()]))
}

/// `fdresume BYTES SENT PENDING`: on the connection at descriptor 10
/// (`carriedexecclient`'s), says whether it is a connected socket, reads
/// the PENDING bytes of echo that were unread at the exec (the pattern's
/// `SENT - PENDING..SENT`), then echoes the rest of BYTES from SENT on,
/// checked, as `echoclient`.
fn fdresume(bytes: u64, sent: u64, pending: u64) -> Result<(), String> {
    use std::os::fd::FromRawFd;
    // SAFETY: getpeername(2) into a sockaddr_storage of ours, its size.
    let connected = unsafe {
        let mut a: libc::sockaddr_storage = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        libc::getpeername(10, (&mut a as *mut libc::sockaddr_storage).cast(), &mut len) == 0
    };
    eprintln!("fdresume: descriptor 10 {}", if connected { "is a connected socket" } else { "is no socket" });
    // SAFETY: descriptor 10 is the socket `carriedexecclient` left us, ours alone.
    let mut s = unsafe { TcpStream::from_raw_fd(10) };
    s.set_read_timeout(Some(std::time::Duration::from_secs(60))).map_err(|e| e.to_string())?;
    let mut got = vec![0u8; pending as usize];
    s.read_exact(&mut got).map_err(|e| format!("read of the {pending} bytes unread at the exec: {e}"))?;
    if let Some(i) = (0..got.len()).find(|&i| got[i] != pattern(sent - pending + i as u64)) {
        return Err(format!("byte {} of those unread at the exec is {}", sent - pending + i as u64, got[i]));
    }
    echo_check_from(s, sent, bytes)
}

fn serve(l: &TcpListener) -> Result<(), String> {
    serve_pausing(l, None, false)
}

fn lateserver(port: u16) -> Result<(), String> {
    let l = TcpListener::bind(("127.0.0.1", port)).map_err(|e| format!("bind: {e}"))?;
    println!("listening");
    std::io::stdout().flush().ok();
    serve_pausing(&l, Some(std::time::Duration::from_millis(300)), false)
}

fn stallserver(port: u16) -> Result<(), String> {
    let l = TcpListener::bind(("127.0.0.1", port)).map_err(|e| format!("bind: {e}"))?;
    println!("listening");
    std::io::stdout().flush().ok();
    serve_pausing(&l, Some(std::time::Duration::from_secs(3)), false)
}

/// This process's voluntary context switches so far (every thread's).
fn voluntary_switches() -> i64 {
    // SAFETY: an all-zero rusage is valid; getrusage(2) fills it.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage(2) into our struct.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    u.ru_nvcsw
}

/// Waits up to `ms` for `fd` to be writable (asked for reading too) in
/// `mode`; whether it is (readable is an error: the server sends nothing).
fn wait_writable(fd: i32, mode: &str, ms: i32) -> Result<bool, String> {
    let (rd, wr) = match mode {
        "poll" => {
            let mut p = libc::pollfd { fd, events: libc::POLLIN | libc::POLLOUT, revents: 0 };
            // SAFETY: one valid pollfd.
            match unsafe { libc::poll(&mut p, 1, ms) } {
                k if k < 0 => return Err(format!("poll: {}", std::io::Error::last_os_error())),
                _ => (p.revents & libc::POLLIN != 0, p.revents & libc::POLLOUT != 0),
            }
        }
        "select" => {
            // SAFETY: zeroed fd_sets are empty sets.
            let (mut r, mut w): (libc::fd_set, libc::fd_set) =
                unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
            // SAFETY: FD_SET of a descriptor below FD_SETSIZE into our sets.
            unsafe {
                libc::FD_SET(fd, &mut r);
                libc::FD_SET(fd, &mut w);
            }
            let mut tv = libc::timeval { tv_sec: (ms / 1000) as _, tv_usec: ((ms % 1000) * 1000) as _ };
            // SAFETY: valid sets and timeval.
            let k = unsafe { libc::select(fd + 1, &mut r, &mut w, std::ptr::null_mut(), &mut tv) };
            if k < 0 {
                return Err(format!("select: {}", std::io::Error::last_os_error()));
            }
            // SAFETY: valid sets.
            unsafe { (libc::FD_ISSET(fd, &r), libc::FD_ISSET(fd, &w)) }
        }
        "epoll" => {
            // SAFETY: epoll_create1(2), no pointers.
            let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
            let mut e = libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLOUT) as u32, u64: 7 };
            // SAFETY: a valid event for our own set.
            if ep < 0 || unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut e) } != 0 {
                return Err(format!("epoll: {}", std::io::Error::last_os_error()));
            }
            let mut out = [libc::epoll_event { events: 0, u64: 0 }; 4];
            // SAFETY: room for 4 events.
            let k = unsafe { libc::epoll_wait(ep, out.as_mut_ptr(), 4, ms) };
            let err = std::io::Error::last_os_error();
            // SAFETY: our own set.
            unsafe { libc::close(ep) };
            if k < 0 {
                return Err(format!("epoll_wait: {err}"));
            }
            let ev = out[..k as usize].iter().fold(0u32, |a, e| a | e.events);
            (ev & libc::EPOLLIN as u32 != 0, ev & libc::EPOLLOUT as u32 != 0)
        }
        _ => return Err(format!("idlewriter: unknown mode {mode}")),
    };
    if rd {
        return Err(format!("{mode}: readable, but the server sent nothing"));
    }
    Ok(wr)
}

fn idlewriter(port: u16, mode: &str) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    s.write_all(&[pattern(0)]).map_err(|e| format!("first write: {e}"))?;
    let mut sent = 1u64;
    s.set_nonblocking(true).map_err(|e| e.to_string())?;
    // Twice, 200 ms apart: credits for the first byte (the server's
    // arming after its first read) may land after the first EAGAIN.
    for _ in 0..2 {
        // Bounded: the kernel's buffers hold a few MiB, the ring 256 KiB.
        let mut full = false;
        for _ in 0..4096 {
            let data: Vec<u8> = (0..65_536u64).map(|k| pattern(sent + k)).collect();
            match s.write(&data) {
                Ok(w) => sent += w as u64,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    full = true;
                    break;
                }
                Err(e) => return Err(format!("write after {sent}: {e}")),
            }
        }
        if !full {
            return Err(format!("no EAGAIN after {sent} bytes"));
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let (before, start) = (voluntary_switches(), std::time::Instant::now());
    if wait_writable(s.as_raw_fd(), mode, 1000)? {
        return Err(format!("{mode}: writable after {} ms while nobody reads", start.elapsed().as_millis()));
    }
    println!("idle-wakeups {}", voluntary_switches() - before);
    println!("idle-ms {}", start.elapsed().as_millis());
    let start = std::time::Instant::now();
    while !wait_writable(s.as_raw_fd(), mode, 1000)? {
        if start.elapsed() > std::time::Duration::from_secs(20) {
            return Err(format!("{mode}: not writable within 20 s of the server's reading"));
        }
    }
    println!("writable after {} ms", start.elapsed().as_millis());
    s.set_nonblocking(false).map_err(|e| e.to_string())?;
    half_close_and_check(&mut s, sent)
}

fn slowserver(port: u16) -> Result<(), String> {
    let l = TcpListener::bind(("127.0.0.1", port)).map_err(|e| format!("bind: {e}"))?;
    println!("listening");
    std::io::stdout().flush().ok();
    serve_pausing(&l, Some(std::time::Duration::from_millis(105)), true)
}

/// `serve`, stopping for `pause` after the first read (`every`: after
/// each read).
fn fionreadserver(port: u16) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let l = TcpListener::bind(("127.0.0.1", port)).map_err(|e| format!("bind: {e}"))?;
    println!("listening");
    std::io::stdout().flush().ok();
    let (mut s, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
    let mut first = vec![0u8; 1000];
    let got = s.read(&mut first).map_err(|e| format!("first read: {e}"))?;
    if let Some(k) = (0..got).find(|&k| first[k] != pattern(k as u64)) {
        return Err(format!("byte {k} is {}, not {}", first[k], pattern(k as u64)));
    }
    println!("first {got}");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let mut n: libc::c_int = -1;
    // SAFETY: FIONREAD writes one int through the valid pointer.
    if unsafe { libc::ioctl(s.as_raw_fd(), libc::FIONREAD, &mut n) } != 0 {
        return Err(format!("FIONREAD: {}", std::io::Error::last_os_error()));
    }
    println!("fionread {n}");
    let mut rest = vec![0u8; 100_000];
    let mut count = got as u64;
    loop {
        let k = s.read(&mut rest).map_err(|e| format!("read after {count}: {e}"))?;
        if k == 0 {
            break;
        }
        if let Some(j) = (0..k).find(|&j| rest[j] != pattern(count + j as u64)) {
            return Err(format!("byte {} is wrong", count + j as u64));
        }
        count += k as u64;
    }
    s.write_all(format!("ok {count}\n").as_bytes()).map_err(|e| format!("answer: {e}"))?;
    Ok(())
}

fn mmsgclient(port: u16) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    const BYTES: usize = 300_000;
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    let data: Vec<u8> = (0..BYTES as u64).map(pattern).collect();
    let mut sent = 0;
    // Bounded: each call sends at least one byte or fails.
    while sent < BYTES {
        // Three messages of two pieces each, 1000 bytes at most a piece.
        let mut iovs = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; 6];
        let mut at = sent;
        for v in iovs.iter_mut() {
            let n = (BYTES - at).min(1000);
            *v = libc::iovec { iov_base: data[at..].as_ptr() as *mut _, iov_len: n };
            at += n;
        }
        // SAFETY: an all-zero mmsghdr is valid; each points at two iovecs.
        let mut msgs: [libc::mmsghdr; 3] = unsafe { std::mem::zeroed() };
        for (k, m) in msgs.iter_mut().enumerate() {
            m.msg_hdr.msg_iov = iovs[2 * k..].as_mut_ptr();
            m.msg_hdr.msg_iovlen = 2;
        }
        // SAFETY: three valid mmsghdrs over live buffers.
        let r = unsafe { libc::sendmmsg(s.as_raw_fd(), msgs.as_mut_ptr(), 3, 0) };
        if r <= 0 {
            return Err(format!("sendmmsg after {sent}: {}", std::io::Error::last_os_error()));
        }
        // Messages go whole in order; a short one ends what was taken.
        for (k, m) in msgs[..r as usize].iter().enumerate() {
            let want = iovs[2 * k].iov_len + iovs[2 * k + 1].iov_len;
            sent += m.msg_len as usize;
            if (m.msg_len as usize) < want {
                break;
            }
        }
    }
    half_close_and_check(&mut s, BYTES as u64)
}

fn mmsgserver(port: u16) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let l = TcpListener::bind(("127.0.0.1", port)).map_err(|e| format!("bind: {e}"))?;
    println!("listening");
    std::io::stdout().flush().ok();
    let (mut s, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
    let mut bufs = vec![[0u8; 1000]; 4];
    let mut count = 0u64;
    // Bounded: each call takes at least one message, and an empty one ends.
    'read: for _ in 0..1_000_000 {
        let mut iovs: Vec<libc::iovec> = bufs
            .iter_mut()
            .map(|b| libc::iovec { iov_base: b.as_mut_ptr().cast(), iov_len: b.len() })
            .collect();
        // SAFETY: an all-zero mmsghdr is valid; each points at one iovec.
        let mut msgs: [libc::mmsghdr; 4] = unsafe { std::mem::zeroed() };
        for (m, v) in msgs.iter_mut().zip(iovs.iter_mut()) {
            m.msg_hdr.msg_iov = v;
            m.msg_hdr.msg_iovlen = 1;
        }
        // SAFETY: four valid mmsghdrs over live buffers.
        let r = unsafe {
            libc::recvmmsg(s.as_raw_fd(), msgs.as_mut_ptr(), 4, libc::MSG_WAITFORONE, std::ptr::null_mut())
        };
        if r <= 0 {
            return Err(format!("recvmmsg after {count}: {}", std::io::Error::last_os_error()));
        }
        for (m, b) in msgs[..r as usize].iter().zip(&bufs) {
            let n = m.msg_len as usize;
            if n == 0 {
                break 'read;
            }
            for (k, byte) in b[..n].iter().enumerate() {
                if *byte != pattern(count + k as u64) {
                    return Err(format!("byte {} is {byte}", count + k as u64));
                }
            }
            count += n as u64;
        }
    }
    s.write_all(format!("ok {count}\n").as_bytes()).map_err(|e| format!("answer: {e}"))?;
    Ok(())
}

fn spliceclient(port: u16) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    const BYTES: u64 = 100_000;
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    s.write_all(&[pattern(0)]).map_err(|e| format!("first byte: {e}"))?;
    let mut sent = 1u64;
    let mut p = [0; 2];
    // SAFETY: pipe(2) into a valid array of two ints.
    if unsafe { libc::pipe(p.as_mut_ptr()) } != 0 {
        return Err("pipe".into());
    }
    let chunk: Vec<u8> = (1..4097).map(pattern).collect();
    // SAFETY: write(2) of a live buffer into our pipe (it holds 64 KiB).
    unsafe { libc::write(p[1], chunk.as_ptr().cast(), chunk.len()) };
    // SAFETY: splice(2) from our pipe to our socket, no offsets.
    let r = unsafe {
        libc::splice(p[0], std::ptr::null_mut(), s.as_raw_fd(), std::ptr::null_mut(), chunk.len(), 0)
    };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        println!(
            "splice {}",
            if e.raw_os_error() == Some(libc::EINVAL) { "EINVAL".into() } else { e.to_string() }
        );
    } else {
        println!("splice {r}");
        sent += r as u64;
    }
    // SAFETY: closing the two ends of our pipe.
    unsafe {
        libc::close(p[0]);
        libc::close(p[1]);
    }
    let rest: Vec<u8> = (sent..BYTES).map(pattern).collect();
    s.write_all(&rest).map_err(|e| format!("the rest: {e}"))?;
    half_close_and_check(&mut s, BYTES)
}

fn sleepyserver(port: u16) -> Result<(), String> {
    let l = TcpListener::bind(("127.0.0.1", port)).map_err(|e| format!("bind: {e}"))?;
    println!("listening");
    std::io::stdout().flush().ok();
    let (s, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
    std::thread::sleep(std::time::Duration::from_millis(400));
    serve_stream(s, None, false)
}

static ALARMS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

extern "C" fn count_alarm(_: libc::c_int) {
    ALARMS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// Fires `SIGALRM` every `ms` (0: stops it).
fn alarm_every(ms: i64) {
    let t = libc::timeval { tv_sec: 0, tv_usec: ms * 1000 };
    let it = libc::itimerval { it_interval: t, it_value: t };
    // SAFETY: setitimer(2) with a valid itimerval and no old value asked.
    unsafe { libc::setitimer(libc::ITIMER_REAL, &it, std::ptr::null_mut()) };
}

fn alarmclient(port: u16, bytes: u64) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    // SAFETY: an all-zero sigaction is valid; the handler only bumps an
    // atomic counter (async-signal-safe). No SA_RESTART: a blocking call
    // the signal interrupts returns EINTR, as with signal handlers that
    // programs install for timeouts (pgbench's SIGALRM).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = count_alarm as extern "C" fn(libc::c_int) as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        sa.sa_flags = 0;
        libc::sigaction(libc::SIGALRM, &sa, std::ptr::null_mut());
    }
    alarm_every(50);
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    let data: Vec<u8> = (0..bytes).map(pattern).collect();
    let (mut sent, mut eintr, mut in_a_row) = (0usize, 0u64, 0u32);
    while sent < data.len() {
        let n = (data.len() - sent).min(65_536);
        // SAFETY: write(2) of `n` bytes of `data` from `sent`.
        let r = unsafe { libc::write(s.as_raw_fd(), data[sent..].as_ptr().cast(), n) };
        if r > 0 {
            sent += r as usize;
            in_a_row = 0;
            continue;
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(format!("write after {sent}: {e}"));
        }
        eintr += 1;
        in_a_row += 1;
        if in_a_row >= 1000 {
            return Err(format!(
                "1000 writes in a row said EINTR after {sent} bytes: the connection is stuck"
            ));
        }
    }
    alarm_every(0);
    println!("alarms {}", ALARMS.load(std::sync::atomic::Ordering::Relaxed));
    println!("eintr {eintr}");
    half_close_and_check(&mut s, bytes)
}

fn serve_pausing(l: &TcpListener, pause: Option<std::time::Duration>, every: bool) -> Result<(), String> {
    let (s, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
    serve_stream(s, pause, every)
}

/// Reads `s` to its end checking the pattern (pausing as
/// [`serve_pausing`] says), then answers `ok COUNT`.
fn serve_stream(mut s: TcpStream, mut pause: Option<std::time::Duration>, every: bool) -> Result<(), String> {
    let mut buf = vec![0u8; 100_003];
    let mut count = 0u64;
    loop {
        let n = s.read(&mut buf).map_err(|e| format!("read after {count}: {e}"))?;
        if n == 0 {
            break;
        }
        for (k, b) in buf[..n].iter().enumerate() {
            if *b != pattern(count + k as u64) {
                return Err(format!("byte {} is {b}, not {}", count + k as u64, pattern(count + k as u64)));
            }
        }
        count += n as u64;
        if let Some(p) = if every { pause } else { pause.take() } {
            std::thread::sleep(p);
        }
    }
    s.write_all(format!("ok {count}\n").as_bytes()).map_err(|e| format!("answer: {e}"))?;
    Ok(())
}

/// `pollserver PORT`: reads as iperf3's server does, non-blocking, one
/// read after each `poll` for `POLLIN` (10 s at most: a lost wake-up is
/// an error), checks the pattern, and answers `ok COUNT` at the end.
fn pollserver(port: u16) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let l = TcpListener::bind((ip_from("SOCKAPP_BIND"), port)).map_err(|e| format!("bind: {e}"))?;
    println!("listening");
    std::io::stdout().flush().ok();
    let (mut s, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
    s.set_nonblocking(true).map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 128 * 1024];
    let mut told = false;
    let mut count = 0u64;
    let strict = std::env::var("SOCKAPP_STRICT_READY").ok();
    let ep = match strict.as_deref() {
        Some(mode @ ("epoll" | "epoll-et" | "epoll-oneshot")) => Some(EpollOne::new(s.as_raw_fd(), mode)?),
        _ => None,
    };
    let et = strict.as_deref() == Some("epoll-et");
    // Bounded: each pass reads a byte, or waits (10 s at most).
    'reads: for reports in 0..(1u64 << 30) {
        match (strict.as_deref(), &ep) {
            (_, Some(ep)) => ep.wait()?,
            (Some("select"), _) => wait_select(s.as_raw_fd())?,
            _ => wait(s.as_raw_fd(), libc::POLLIN)?,
        }
        // Edge-triggered: read until EAGAIN (no report comes otherwise).
        for first in std::iter::once(true).chain(std::iter::repeat(false)) {
            let n = match s.read(&mut buf) {
                Ok(0) => break 'reads,
                Ok(n) => n,
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        && first
                        && strict.is_some()
                        && (!et || reports == 0) =>
                {
                    return Err(format!("readable after {count}, but the read says EAGAIN"))
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(format!("read after {count}: {e}")),
            };
            if let Some(k) = (0..n).find(|&k| buf[k] != pattern(count + k as u64)) {
                return Err(format!(
                    "byte {} is {}, not {}",
                    count + k as u64,
                    buf[k],
                    pattern(count + k as u64)
                ));
            }
            count += n as u64;
            if !told {
                told = true;
                println!("nodelay {}", nodelay(s.as_raw_fd()));
            }
            if !et {
                break;
            }
        }
    }
    s.set_nonblocking(false).map_err(|e| e.to_string())?;
    s.write_all(format!("ok {count}\n").as_bytes()).map_err(|e| format!("answer: {e}"))?;
    Ok(())
}

/// One connection in an epoll set of its own, registered for `EPOLLIN`
/// as `pollserver`'s `SOCKAPP_STRICT_READY` says (`epoll`: level-triggered,
/// `epoll-et`: edge-triggered, `epoll-oneshot`: level-triggered one-shot).
struct EpollOne {
    ep: i32,
    fd: i32,
    events: u32,
    /// Reported once (a one-shot registration is disabled since).
    waited: std::cell::Cell<bool>,
}

impl EpollOne {
    const DATA: u64 = 0x5eed;

    fn new(fd: i32, mode: &str) -> Result<EpollOne, String> {
        let events = libc::EPOLLIN as u32
            | match mode {
                "epoll-et" => libc::EPOLLET as u32,
                "epoll-oneshot" => libc::EPOLLONESHOT as u32,
                _ => 0,
            };
        // SAFETY: epoll_create1(2), no pointers.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        let one = EpollOne { ep, fd, events, waited: std::cell::Cell::new(false) };
        if ep < 0 || one.ctl(libc::EPOLL_CTL_ADD) != 0 {
            return Err(format!("epoll: {}", std::io::Error::last_os_error()));
        }
        Ok(one)
    }

    fn ctl(&self, op: i32) -> i32 {
        let mut e = libc::epoll_event { events: self.events, u64: Self::DATA };
        // SAFETY: a valid event for our own set.
        unsafe { libc::epoll_ctl(self.ep, op, self.fd, &mut e) }
    }

    /// Waits (10 s at most) for the connection's report; a one-shot
    /// registration is armed again first (after the reads of the last
    /// report, as an event loop does).
    fn wait(&self) -> Result<(), String> {
        if self.events & libc::EPOLLONESHOT as u32 != 0
            && self.waited.replace(true)
            && self.ctl(libc::EPOLL_CTL_MOD) != 0
        {
            return Err(format!("epoll_ctl MOD: {}", std::io::Error::last_os_error()));
        }
        let mut out = [libc::epoll_event { events: 0, u64: 0 }; 2];
        // SAFETY: room for 2 events.
        let k = unsafe { libc::epoll_wait(self.ep, out.as_mut_ptr(), 2, 10_000) };
        let (events, data) = (out[0].events, out[0].u64);
        match k {
            1 if data == Self::DATA
                && events & (libc::EPOLLIN | libc::EPOLLHUP | libc::EPOLLERR) as u32 != 0 => {}
            0 => return Err("epoll_wait timed out: readiness lost".into()),
            k if k < 0 => return Err(format!("epoll_wait: {}", std::io::Error::last_os_error())),
            k => return Err(format!("epoll_wait: {k} events, the first {events:#x} with data {data:#x}")),
        }
        Ok(())
    }
}

impl Drop for EpollOne {
    fn drop(&mut self) {
        // SAFETY: our own set, closed once.
        unsafe { libc::close(self.ep) };
    }
}

/// `badbuf PORT`: `client` of 64 bytes, then read, readv and write with a
/// null buffer of 10 bytes on the (carried) connection: each must fail
/// with EFAULT, as on the kernel, the connection unharmed.
fn badbuf(port: u16) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let mut s = TcpStream::connect((ip_from("SOCKAPP_HOST"), port)).map_err(|e| format!("connect: {e}"))?;
    let data: Vec<u8> = (0..64).map(pattern).collect();
    s.write_all(&data[..32]).map_err(|e| format!("write: {e}"))?;
    let fd = s.as_raw_fd();
    // An empty null entry is no fault (the kernel skips it), nor is an
    // empty null vector.
    let two = [
        libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 },
        libc::iovec { iov_base: data[32..].as_ptr() as *mut libc::c_void, iov_len: 32 },
    ];
    // SAFETY: two iovecs, the second over `data`.
    let w = unsafe { libc::writev(fd, two.as_ptr(), 2) };
    // SAFETY: an empty vector, null on purpose.
    let (rv, wv) = unsafe { (libc::readv(fd, std::ptr::null(), 0), libc::writev(fd, std::ptr::null(), 0)) };
    if (w, rv, wv) != (32, 0, 0) {
        return Err(format!("writev with an empty null entry {w}, empty readv {rv}, empty writev {wv}"));
    }
    let iov = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 10 }];
    let calls: [(&str, &dyn Fn() -> isize); 3] = [
        // SAFETY: a null buffer on purpose: the call must refuse it.
        ("read", &|| unsafe { libc::read(fd, std::ptr::null_mut(), 10) }),
        // SAFETY: as above, one iovec with a null base.
        ("readv", &|| unsafe { libc::readv(fd, iov.as_ptr(), 1) }),
        // SAFETY: as above.
        ("write", &|| unsafe { libc::write(fd, std::ptr::null(), 10) }),
    ];
    for (name, call) in calls {
        let r = call();
        let e = std::io::Error::last_os_error().raw_os_error();
        if r != -1 || e != Some(libc::EFAULT) {
            return Err(format!("{name} of a null buffer gave {r} ({e:?}), not EFAULT"));
        }
    }
    println!("efault 3");
    half_close_and_check(&mut s, 64)
}

/// A socket of `from`'s family, bound to `from` port 0, connected to
/// `host`:`port` (a literal address; `0.0.0.0` and `::` as the kernel
/// routes them from that source).
fn connect_from(from: &str, host: &str, port: u16) -> Result<TcpStream, String> {
    use std::net::{IpAddr, SocketAddr};
    use std::os::fd::FromRawFd;
    // An address, or an IPv6 one with its scope id (`fe80::1%3`).
    let parse_at = |a: &str, port: u16| -> Result<SocketAddr, String> {
        match a.split_once('%') {
            Some((ip, scope)) => {
                let ip = ip.parse::<std::net::Ipv6Addr>().map_err(|e| format!("{a}: {e}"))?;
                let scope = scope.parse::<u32>().map_err(|e| format!("{a}: {e}"))?;
                Ok(std::net::SocketAddrV6::new(ip, port, 0, scope).into())
            }
            None => Ok(SocketAddr::new(a.parse::<IpAddr>().map_err(|e| format!("{a}: {e}"))?, port)),
        }
    };
    let raw = |a: SocketAddr| -> (libc::sockaddr_storage, libc::socklen_t) {
        // SAFETY: sockaddr_storage is plain data; all zeroes is valid.
        let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let len = match a {
            SocketAddr::V4(v4) => {
                // SAFETY: sockaddr_in is plain data; all zeroes is valid.
                let mut sin: libc::sockaddr_in = unsafe { std::mem::zeroed() };
                sin.sin_family = libc::AF_INET as libc::sa_family_t;
                sin.sin_port = v4.port().to_be();
                sin.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
                // SAFETY: a sockaddr_in fits in (aligned) storage.
                unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
                std::mem::size_of::<libc::sockaddr_in>()
            }
            SocketAddr::V6(v6) => {
                // SAFETY: sockaddr_in6 is plain data; all zeroes is valid.
                let mut sin6: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
                sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
                sin6.sin6_port = v6.port().to_be();
                sin6.sin6_addr.s6_addr = v6.ip().octets();
                sin6.sin6_scope_id = v6.scope_id();
                // SAFETY: as above, for a sockaddr_in6.
                unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
                std::mem::size_of::<libc::sockaddr_in6>()
            }
        };
        (ss, len as libc::socklen_t)
    };
    let src = parse_at(from, 0)?;
    let dst = parse_at(host, port)?;
    let err = |what: &str| format!("{what}: {}", std::io::Error::last_os_error());
    let domain = if src.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    // SAFETY: socket(2) with constant arguments.
    let fd = unsafe { libc::socket(domain, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(err("socket"));
    }
    // SAFETY: the descriptor was just made and is ours alone.
    let s = unsafe { TcpStream::from_raw_fd(fd) };
    bind_to_device(fd)?;
    let (ss, len) = raw(src);
    // SAFETY: `ss` holds a valid sockaddr of `len` bytes.
    if unsafe { libc::bind(fd, (&ss as *const libc::sockaddr_storage).cast(), len) } != 0 {
        return Err(err("bind"));
    }
    let (ss, len) = raw(dst);
    // SAFETY: as above; connect(2) through the preload library, if any.
    if unsafe { libc::connect(fd, (&ss as *const libc::sockaddr_storage).cast(), len) } != 0 {
        return Err(err("connect"));
    }
    Ok(s)
}

/// `forkecho PORT write-N`: the parent writes while its child's read
/// asks for the demotion.
fn fork_write(mut s: TcpStream, bytes: u64, child_nb: bool) -> Result<(), String> {
    // The first write carries the connection, before the fork.
    let first = 65_536u64.min(bytes);
    let data: Vec<u8> = (0..first).map(pattern).collect();
    s.write_all(&data).map_err(|e| format!("write: {e}"))?;
    std::io::stdout().flush().ok();
    // SAFETY: fork(2) in a single-threaded program; the child only reads
    // the connection and exits.
    match unsafe { libc::fork() } {
        -1 => Err(format!("fork: {}", std::io::Error::last_os_error())),
        0 => {
            std::thread::sleep(std::time::Duration::from_millis(50));
            let mut b = [0u8; 16];
            if child_nb {
                // One non-blocking read (the demotion, then nothing: the
                // client sends none), and gone.
                let r = s.set_nonblocking(true).and_then(|()| s.read(&mut b));
                drop(s);
                std::process::exit(match r {
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => 0,
                    r => {
                        eprintln!("sockapp child: read: {r:?}");
                        1
                    }
                })
            }
            let r = s.read(&mut b);
            drop(s);
            std::process::exit(match r {
                Ok(0) => 0,
                Ok(n) => {
                    eprintln!("sockapp child: read {n} bytes, the client sends none");
                    1
                }
                Err(e) => {
                    eprintln!("sockapp child: read: {e}");
                    1
                }
            })
        }
        child => {
            let mut sent = first;
            while sent < bytes {
                let n = 65_536u64.min(bytes - sent);
                let data: Vec<u8> = (0..n).map(|k| pattern(sent + k)).collect();
                s.write_all(&data).map_err(|e| format!("write after {sent}: {e}"))?;
                sent += n;
            }
            drop(s);
            println!("wrote {sent}");
            let mut status = 0;
            // SAFETY: waitpid(2) on our child.
            if unsafe { libc::waitpid(child, &mut status, 0) } != child {
                return Err("waitpid".into());
            }
            if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
                return Err(format!("the child ended with {status:#x}"));
            }
            Ok(())
        }
    }
}

/// What `readreply` answers after the server's half-close.
const REPLY: &str = "the answer after the half-close";

/// `forkecho PORT shut-N`: the parent's half-close while its child's read
/// asks for the demotion; the child reads the client's answer.
fn fork_shut(mut s: TcpStream, bytes: u64) -> Result<(), String> {
    // Carried before the fork.
    let data: Vec<u8> = (0..bytes).map(pattern).collect();
    s.write_all(&data).map_err(|e| format!("write: {e}"))?;
    std::io::stdout().flush().ok();
    // SAFETY: fork(2) in a single-threaded program; the child only reads
    // the connection and exits.
    match unsafe { libc::fork() } {
        -1 => Err(format!("fork: {}", std::io::Error::last_os_error())),
        0 => {
            let mut got = Vec::new();
            let r = s.read_to_end(&mut got);
            drop(s);
            let code = match r {
                Ok(_) => {
                    println!("reply: {}", String::from_utf8_lossy(&got));
                    0
                }
                Err(e) => {
                    println!("child: read: {e} after {} bytes", got.len());
                    1
                }
            };
            std::io::stdout().flush().ok();
            std::process::exit(code)
        }
        child => {
            std::thread::sleep(std::time::Duration::from_millis(200));
            s.shutdown(Shutdown::Write).map_err(|e| format!("shutdown: {e}"))?;
            let mut status = 0;
            // SAFETY: waitpid(2) on our child.
            if unsafe { libc::waitpid(child, &mut status, 0) } != child {
                return Err("waitpid".into());
            }
            drop(s);
            if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
                return Err(format!("the child ended with {status:#x}"));
            }
            Ok(())
        }
    }
}

/// `readreply PORT BYTES`: reads BYTES pattern bytes, checking each, then
/// the end; answers [`REPLY`] (`SOCKAPP_REPLY_DELAY_MS` after the end)
/// and closes. Says `read N, then the end`.
fn readreply(port: u16, bytes: u64) -> Result<(), String> {
    let mut s = TcpStream::connect((ip_from("SOCKAPP_HOST"), port)).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(60))).map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 65_536];
    let mut got = 0u64;
    loop {
        let k = s.read(&mut buf).map_err(|e| format!("read after {got}: {e}"))?;
        if k == 0 {
            break;
        }
        if let Some(i) = (0..k).find(|&i| buf[i] != pattern(got + i as u64)) {
            return Err(format!("byte {} is {}, sent {}", got + i as u64, buf[i], pattern(got + i as u64)));
        }
        got += k as u64;
    }
    if got != bytes {
        return Err(format!("the end after {got} of {bytes}"));
    }
    println!("read {got}, then the end");
    std::io::stdout().flush().ok();
    // A server that works out its answer: the server's demotion goes on
    // meanwhile.
    pause("SOCKAPP_REPLY_DELAY_MS");
    s.write_all(REPLY.as_bytes()).map_err(|e| format!("reply: {e}"))?;
    Ok(())
}

/// `readcheck PORT BYTES`: reads BYTES pattern bytes, checking each, and
/// closes.
fn readcheck(port: u16, bytes: u64) -> Result<(), String> {
    let mut s = TcpStream::connect((ip_from("SOCKAPP_HOST"), port)).map_err(|e| format!("connect: {e}"))?;
    let mut buf = vec![0u8; 65_536];
    let mut got = 0u64;
    while got < bytes {
        let want = buf.len().min((bytes - got) as usize);
        let k = s.read(&mut buf[..want]).map_err(|e| format!("read after {got}: {e}"))?;
        if k == 0 {
            return Err(format!("the end after {got} of {bytes}"));
        }
        if let Some(i) = (0..k).find(|&i| buf[i] != pattern(got + i as u64)) {
            return Err(format!("byte {} is {}, sent {}", got + i as u64, buf[i], pattern(got + i as u64)));
        }
        got += k as u64;
    }
    // (The end comes only once the server's child closes too, after this
    // close.)
    println!("read {got}");
    Ok(())
}

/// `readsplit PORT BYTES`: two threads read the connection at once
/// until its end; the bytes' count and sum must be the pattern's.
fn readsplit(port: u16, bytes: u64) -> Result<(), String> {
    use std::sync::atomic::{AtomicU64, Ordering};
    let s = TcpStream::connect((ip_from("SOCKAPP_HOST"), port)).map_err(|e| format!("connect: {e}"))?;
    let (got, sum) = (AtomicU64::new(0), AtomicU64::new(0));
    std::thread::scope(|sc| {
        let readers: Vec<_> = (0..2)
            .map(|_| {
                sc.spawn(|| {
                    let mut buf = vec![0u8; 65_536];
                    loop {
                        let k = (&s).read(&mut buf).map_err(|e| format!("read: {e}"))?;
                        if k == 0 {
                            return Ok::<(), String>(());
                        }
                        got.fetch_add(k as u64, Ordering::Relaxed);
                        sum.fetch_add(buf[..k].iter().map(|&b| b as u64).sum(), Ordering::Relaxed);
                    }
                })
            })
            .collect();
        readers.into_iter().try_for_each(|r| r.join().map_err(|_| "a reader panicked".to_string())?)
    })?;
    let want: u64 = (0..bytes).map(|i| pattern(i) as u64).sum();
    let (got, sum) = (got.into_inner(), sum.into_inner());
    if got != bytes || sum != want {
        return Err(format!("read {got} bytes of sum {sum}, sent {bytes} of sum {want}"));
    }
    println!("read {got}, then the end");
    Ok(())
}

/// `sendclose PORT BYTES`: writes the bytes, closes, reads nothing.
fn sendclose(port: u16, bytes: u64) -> Result<(), String> {
    let mut s = TcpStream::connect((ip_from("SOCKAPP_HOST"), port)).map_err(|e| format!("connect: {e}"))?;
    let mut sent = 0u64;
    while sent < bytes {
        let n = 65_536u64.min(bytes - sent);
        let data: Vec<u8> = (0..n).map(|k| pattern(sent + k)).collect();
        s.write_all(&data).map_err(|e| format!("write after {sent}: {e}"))?;
        sent += n;
    }
    drop(s);
    println!("sent {sent}, closed");
    Ok(())
}

fn client(port: u16, bytes: u64) -> Result<(), String> {
    client_sizes(port, bytes, &[1, 7, 4096, 65_536, 100_000, 300_000])
}

fn client_sizes(port: u16, bytes: u64, sizes: &[usize]) -> Result<(), String> {
    let mut s = match std::env::var("SOCKAPP_CLIENT_BIND") {
        Ok(from) => connect_from(&from, &ip_from("SOCKAPP_HOST"), port)?,
        Err(_) => TcpStream::connect((ip_from("SOCKAPP_HOST"), port)).map_err(|e| format!("connect: {e}"))?,
    };
    {
        use std::os::fd::AsRawFd;
        // SAFETY: fcntl(2) on our socket: inheritable, as a program that
        // means to exec a child with it would make it.
        unsafe { libc::fcntl(s.as_raw_fd(), libc::F_SETFD, 0) };
    }
    let mut sent = 0u64;
    let mut i = 0;
    while sent < bytes {
        let n = (sizes[i % sizes.len()] as u64).min(bytes - sent) as usize;
        let data: Vec<u8> = (0..n as u64).map(|k| pattern(sent + k)).collect();
        if i % 5 == 4 && n > 1 {
            // A vectored write in two parts.
            let (a, b) = data.split_at(n / 2);
            let mut done = 0;
            while done < n {
                let w = if done < a.len() {
                    s.write_vectored(&[IoSlice::new(&a[done..]), IoSlice::new(b)])
                } else {
                    s.write(&b[done - a.len()..])
                }
                .map_err(|e| format!("writev: {e}"))?;
                done += w;
            }
        } else {
            s.write_all(&data).map_err(|e| format!("write: {e}"))?;
        }
        sent += n as u64;
        i += 1;
    }
    {
        // Whether the descriptor is close-on-exec now, having been made
        // inheritable after connect (the tests compare carried and TCP).
        use std::os::fd::AsRawFd;
        // SAFETY: fcntl(2) flag calls on our socket.
        let f = unsafe { libc::fcntl(s.as_raw_fd(), libc::F_GETFD) };
        println!("cloexec={}", (f & libc::FD_CLOEXEC != 0) as u8);
    }
    half_close_and_check(&mut s, bytes)
}

/// Waits (10 s at most) until `fd` is readable (or writable).
fn wait(fd: i32, events: i16) -> Result<(), String> {
    let mut p = libc::pollfd { fd, events, revents: 0 };
    // SAFETY: one valid pollfd.
    match unsafe { libc::poll(&mut p, 1, 10_000) } {
        1 => Ok(()),
        0 => Err(format!("poll({events:#x}) timed out: readiness lost")),
        _ => Err(format!("poll: {}", std::io::Error::last_os_error())),
    }
}

/// `wait` for reading, with select(2).
fn wait_select(fd: i32) -> Result<(), String> {
    // SAFETY: a zeroed fd_set is an empty set.
    let mut r: libc::fd_set = unsafe { std::mem::zeroed() };
    // SAFETY: FD_SET of a descriptor below FD_SETSIZE into our set.
    unsafe { libc::FD_SET(fd, &mut r) };
    let mut tv = libc::timeval { tv_sec: 10, tv_usec: 0 };
    // SAFETY: a valid set and timeval.
    match unsafe { libc::select(fd + 1, &mut r, std::ptr::null_mut(), std::ptr::null_mut(), &mut tv) } {
        1 => Ok(()),
        0 => Err("select timed out: readiness lost".into()),
        _ => Err(format!("select: {}", std::io::Error::last_os_error())),
    }
}

fn read_some(s: &mut TcpStream, buf: &mut [u8]) -> Result<usize, String> {
    use std::os::fd::AsRawFd;
    loop {
        wait(s.as_raw_fd(), libc::POLLIN)?;
        match s.read(buf) {
            Ok(n) => return Ok(n),
            // A spurious wake-up is allowed; a lost one is not (poll times out).
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(format!("read: {e}")),
        }
    }
}

fn write_all_nb(s: &mut TcpStream, mut b: &[u8]) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    while !b.is_empty() {
        match s.write(b) {
            Ok(n) => b = &b[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => wait(s.as_raw_fd(), libc::POLLOUT)?,
            Err(e) => return Err(format!("write: {e}")),
        }
    }
    Ok(())
}

fn echo(port: u16) -> Result<(), String> {
    let l = TcpListener::bind(("127.0.0.1", port)).map_err(|e| format!("bind: {e}"))?;
    let (mut s, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
    s.set_nonblocking(true).map_err(|e| e.to_string())?;
    let mut buf = [0u8; 4096];
    loop {
        let n = read_some(&mut s, &mut buf)?;
        if n == 0 {
            return Ok(());
        }
        write_all_nb(&mut s, &buf[..n])?;
    }
}

fn ping(port: u16, rounds: u64) -> Result<(), String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    s.set_nonblocking(true).map_err(|e| e.to_string())?;
    for r in 0..rounds {
        let msg: Vec<u8> = (0..64u64).map(|k| pattern(r * 64 + k)).collect();
        write_all_nb(&mut s, &msg)?;
        let mut got = Vec::new();
        while got.len() < msg.len() {
            let mut b = [0u8; 10];
            let n = read_some(&mut s, &mut b)?;
            if n == 0 {
                return Err(format!("round {r}: the end after {} bytes", got.len()));
            }
            got.extend_from_slice(&b[..n]);
        }
        if got != msg {
            return Err(format!("round {r}: answer differs"));
        }
    }
    s.shutdown(Shutdown::Write).map_err(|e| e.to_string())?;
    // The server's end follows ours.
    let mut b = [0u8; 1];
    match read_some(&mut s, &mut b)? {
        0 => Ok(()),
        n => Err(format!("{n} bytes after the last answer")),
    }
}

fn sendfile(port: u16, bytes: u64) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let path = std::env::temp_dir().join(format!("sockapp-{}", std::process::id()));
    let data: Vec<u8> = (0..bytes).map(pattern).collect();
    std::fs::write(&path, &data).map_err(|e| format!("temp file: {e}"))?;
    let f = std::fs::File::open(&path).map_err(|e| format!("open: {e}"))?;
    let _ = std::fs::remove_file(&path);
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    let half = bytes / 2;
    let mut off: libc::off_t = 0;
    while (off as u64) < half {
        // SAFETY: sendfile(2) between two descriptors we hold, with our offset.
        let n =
            unsafe { libc::sendfile(s.as_raw_fd(), f.as_raw_fd(), &mut off, (half - off as u64) as usize) };
        if n <= 0 {
            return Err(format!("sendfile: {}", std::io::Error::last_os_error()));
        }
    }
    // From the file's own position, which starts at 0: move it to `half`.
    // SAFETY: lseek(2) on our file.
    unsafe { libc::lseek(f.as_raw_fd(), half as libc::off_t, libc::SEEK_SET) };
    let mut sent = half;
    while sent < bytes {
        // SAFETY: as above, without an offset.
        let n = unsafe {
            libc::sendfile(s.as_raw_fd(), f.as_raw_fd(), std::ptr::null_mut(), (bytes - sent) as usize)
        };
        if n <= 0 {
            return Err(format!("sendfile: {}", std::io::Error::last_os_error()));
        }
        sent += n as u64;
    }
    half_close_and_check(&mut s, bytes)
}

fn rr(port: u16, rounds: usize) -> Result<(), String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    s.set_nodelay(true).map_err(|e| e.to_string())?;
    let msg = [5u8; 64];
    let mut got = [0u8; 64];
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t = std::time::Instant::now();
        s.write_all(&msg).map_err(|e| format!("write: {e}"))?;
        s.read_exact(&mut got).map_err(|e| format!("read: {e}"))?;
        times.push(t.elapsed().as_nanos() as u64);
    }
    times.sort_unstable();
    println!("median_rtt_ns {}", times.get(rounds / 2).copied().unwrap_or(0));
    Ok(())
}

/// A level-triggered epoll set holding `fd` for reading.
fn ep_for(fd: i32) -> Result<i32, String> {
    // SAFETY: epoll_create1(2), no pointers.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    let mut e = libc::epoll_event { events: libc::EPOLLIN as u32, u64: 3 };
    // SAFETY: a valid event.
    if ep < 0 || unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut e) } != 0 {
        return Err(format!("epoll: {}", std::io::Error::last_os_error()));
    }
    Ok(ep)
}

/// Reads what waits on the non-blocking `s` into `buf` (at its end at
/// most `buf.len()`), after an `epoll_wait` on `ep`; the count (0: the
/// end of the stream).
fn ep_read(s: &mut TcpStream, ep: i32, buf: &mut [u8]) -> Result<usize, String> {
    for _ in 0..10_000 {
        match s.read(buf) {
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(format!("read: {e}")),
        }
        let mut out = [libc::epoll_event { events: 0, u64: 0 }; 4];
        // SAFETY: room for 4 events.
        let k = unsafe { libc::epoll_wait(ep, out.as_mut_ptr(), 4, 10_000) };
        if k == 0 {
            return Err("nothing in 10 s".into());
        }
        if k < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return Err(format!("epoll_wait: {}", std::io::Error::last_os_error()));
        }
    }
    Err("10000 wake-ups without bytes".into())
}

fn epecho(port: u16) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let l = TcpListener::bind(("127.0.0.1", port)).map_err(|e| format!("bind: {e}"))?;
    println!("listening");
    std::io::stdout().flush().ok();
    let (mut s, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
    s.set_nodelay(true).map_err(|e| e.to_string())?;
    s.set_nonblocking(true).map_err(|e| e.to_string())?;
    let ep = ep_for(s.as_raw_fd())?;
    let mut b = [0u8; 256];
    loop {
        let n = ep_read(&mut s, ep, &mut b)?;
        if n == 0 {
            return Ok(());
        }
        let mut off = 0;
        while off < n {
            match s.write(&b[off..n]) {
                Ok(k) => off += k,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => return Err(format!("answer: {e}")),
            }
        }
    }
}

fn nestecho(port: u16, mode: &str) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let l = TcpListener::bind(("127.0.0.1", port)).map_err(|e| format!("bind: {e}"))?;
    println!("listening");
    std::io::stdout().flush().ok();
    let (mut s, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
    s.set_nodelay(true).map_err(|e| e.to_string())?;
    s.set_nonblocking(true).map_err(|e| e.to_string())?;
    // SAFETY: epoll_create1(2), no pointers.
    let (outer, inner) =
        unsafe { (libc::epoll_create1(libc::EPOLL_CLOEXEC), libc::epoll_create1(libc::EPOLL_CLOEXEC)) };
    if outer < 0 || inner < 0 {
        return Err(format!("epoll: {}", std::io::Error::last_os_error()));
    }
    let nest = || {
        let mut e = libc::epoll_event { events: libc::EPOLLIN as u32, u64: 1 };
        // SAFETY: a valid event.
        match unsafe { libc::epoll_ctl(outer, libc::EPOLL_CTL_ADD, inner, &mut e) } {
            0 => Ok(()),
            _ => Err(format!("nest: {}", std::io::Error::last_os_error())),
        }
    };
    if mode == "before" {
        nest()?;
    }
    let mut e = libc::epoll_event { events: libc::EPOLLIN as u32, u64: 2 };
    // SAFETY: a valid event.
    if unsafe { libc::epoll_ctl(inner, libc::EPOLL_CTL_ADD, s.as_raw_fd(), &mut e) } != 0 {
        return Err(format!("epoll_ctl: {}", std::io::Error::last_os_error()));
    }
    if mode != "before" {
        nest()?;
    }
    let mut b = [0u8; 256];
    let mut out = [libc::epoll_event { events: 0, u64: 0 }; 4];
    loop {
        // SAFETY: room for 4 events.
        let k = unsafe { libc::epoll_wait(outer, out.as_mut_ptr(), 4, 10_000) };
        if k == 0 {
            return Err("the outer set: nothing in 10 s".into());
        }
        // SAFETY: room for 4 events.
        if k < 0 || unsafe { libc::epoll_wait(inner, out.as_mut_ptr(), 4, 0) } <= 0 {
            continue;
        }
        loop {
            let n = match s.read(&mut b) {
                Ok(0) => return Ok(()),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(format!("read: {e}")),
            };
            s.write_all(&b[..n]).map_err(|e| format!("answer: {e}"))?;
        }
    }
}

fn eprr(port: u16, rounds: usize) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    s.set_nodelay(true).map_err(|e| e.to_string())?;
    s.set_nonblocking(true).map_err(|e| e.to_string())?;
    let ep = ep_for(s.as_raw_fd())?;
    let msg = [5u8; 64];
    let mut got = [0u8; 64];
    let mut times = Vec::with_capacity(rounds);
    for r in 0..rounds {
        let t = std::time::Instant::now();
        // A 64-byte write into an empty ring is whole.
        if s.write(&msg).map_err(|e| format!("write: {e}"))? != 64 {
            return Err(format!("round {r}: a short write"));
        }
        let mut have = 0;
        while have < 64 {
            match ep_read(&mut s, ep, &mut got[have..])? {
                0 => return Err(format!("round {r}: the end after {have} bytes")),
                n => have += n,
            }
        }
        times.push(t.elapsed().as_nanos() as u64);
    }
    times.sort_unstable();
    println!("median_rtt_ns {}", times.get(rounds / 2).copied().unwrap_or(0));
    Ok(())
}

/// Waits up to `ms` for `fd` to be readable in `mode` (`epoll`: the set
/// `ep`, made by the caller); whether it is.
fn wait_readable(fd: i32, mode: &str, ep: i32, ms: i32) -> Result<bool, String> {
    if mode == "poll" {
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        return match unsafe { libc::poll(&mut p, 1, ms) } {
            k if k < 0 => Err(format!("poll: {}", std::io::Error::last_os_error())),
            _ => Ok(p.revents & libc::POLLIN != 0),
        };
    }
    let mut out = [libc::epoll_event { events: 0, u64: 0 }; 4];
    // SAFETY: room for 4 events.
    match unsafe { libc::epoll_wait(ep, out.as_mut_ptr(), 4, ms) } {
        k if k < 0 => Err(format!("epoll_wait: {}", std::io::Error::last_os_error())),
        k => Ok(out[..k as usize].iter().any(|e| e.events & libc::EPOLLIN as u32 != 0)),
    }
}

fn lazyserver(port: u16, mode: &str) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let l = TcpListener::bind(("127.0.0.1", port)).map_err(|e| format!("bind: {e}"))?;
    println!("listening");
    std::io::stdout().flush().ok();
    let (mut s, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
    let mut b = [0u8; 64];
    s.read_exact(&mut b).map_err(|e| format!("first read: {e}"))?;
    s.write_all(b"a").map_err(|e| format!("first answer: {e}"))?;
    let fd = s.as_raw_fd();
    let mut ep = -1;
    if mode == "epoll" {
        // SAFETY: epoll_create1(2), no pointers.
        ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        let mut e = libc::epoll_event { events: libc::EPOLLIN as u32, u64: 9 };
        // SAFETY: a valid event for our own set.
        if ep < 0 || unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut e) } != 0 {
            return Err(format!("epoll: {}", std::io::Error::last_os_error()));
        }
    }
    if wait_readable(fd, mode, ep, 300)? {
        return Err(format!("{mode}: readable while the client sent nothing (stale readiness)"));
    }
    // The client writes its second message only after this: a CPU stall
    // longer than the quiet wait cannot make its write land inside it.
    s.write_all(b"g").map_err(|e| format!("go: {e}"))?;
    let start = std::time::Instant::now();
    if !wait_readable(fd, mode, ep, 5000)? {
        return Err(format!("{mode}: the second message not readable within 5 s: readiness lost"));
    }
    println!("readable after {} ms", start.elapsed().as_millis());
    s.read_exact(&mut b).map_err(|e| format!("second read: {e}"))?;
    s.write_all(b"b").map_err(|e| format!("second answer: {e}"))?;
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).map_err(|e| format!("end: {e}"))?;
    if ep >= 0 {
        // SAFETY: our own set.
        unsafe { libc::close(ep) };
    }
    Ok(())
}

fn lazyclient(port: u16) -> Result<(), String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    let mut a = [0u8; 1];
    s.write_all(&[1u8; 64]).map_err(|e| format!("first write: {e}"))?;
    s.read_exact(&mut a).map_err(|e| format!("first answer: {e}"))?;
    // The server's go, after its quiet wait; then a pause so that the
    // server is in its second wait when the bytes come.
    s.read_exact(&mut a).map_err(|e| format!("go: {e}"))?;
    if &a != b"g" {
        return Err(format!("go {a:?}"));
    }
    std::thread::sleep(std::time::Duration::from_millis(100));
    s.write_all(&[2u8; 64]).map_err(|e| format!("second write: {e}"))?;
    s.read_exact(&mut a).map_err(|e| format!("second answer: {e}"))?;
    if &a != b"b" {
        return Err(format!("second answer {a:?}"));
    }
    s.shutdown(Shutdown::Write).map_err(|e| format!("shutdown: {e}"))
}

fn becho(port: u16) -> Result<(), String> {
    let l = TcpListener::bind(("127.0.0.1", port)).map_err(|e| format!("bind: {e}"))?;
    println!("listening");
    std::io::stdout().flush().ok();
    let (mut s, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
    s.set_nodelay(true).map_err(|e| e.to_string())?;
    let mut b = [0u8; 64];
    loop {
        match s.read_exact(&mut b) {
            Ok(()) => s.write_all(&b).map_err(|e| format!("answer: {e}"))?,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(format!("read: {e}")),
        }
    }
}

/// `echos PORT N`: accepts N connections one after another and echoes
/// each (blocking) until its end.
fn echos(port: u16, n: u64) -> Result<(), String> {
    let l = TcpListener::bind((ip_from("SOCKAPP_BIND"), port)).map_err(|e| format!("bind: {e}"))?;
    println!("listening");
    std::io::stdout().flush().ok();
    for i in 0..n {
        let (mut s, _) = l.accept().map_err(|e| format!("accept {i}: {e}"))?;
        s.set_read_timeout(Some(std::time::Duration::from_secs(30))).map_err(|e| e.to_string())?;
        echo_all(&mut s).map_err(|e| format!("connection {i}: {e}"))?;
    }
    Ok(())
}

/// Sets `TCP_NODELAY` of `fd` to `v` with an option of `len` bytes at
/// `val` (an int of `v` where null is not asked); the errno if it fails.
fn set_nodelay_raw(fd: i32, v: i32, len: u32, null: bool) -> Result<(), i32> {
    set_tcp_raw(fd, libc::TCP_NODELAY, v, len, null)
}

/// Sets option `name` of `IPPROTO_TCP`, as [`set_nodelay_raw`].
fn set_tcp_raw(fd: i32, name: i32, v: i32, len: u32, null: bool) -> Result<(), i32> {
    let val: *const libc::c_int = if null { std::ptr::null() } else { &v };
    // SAFETY: setsockopt(2) with an int of ours (or null, which the kernel
    // refuses) and a length of at most its size.
    let r = unsafe { libc::setsockopt(fd, libc::IPPROTO_TCP, name, val.cast(), len) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(-1))
    }
}

fn set_nodelay(fd: i32, v: i32) -> Result<(), String> {
    set_nodelay_raw(fd, v, 4, false).map_err(|e| format!("setsockopt(TCP_NODELAY, {v}): errno {e}"))
}

fn set_cork(fd: i32, v: i32) -> Result<(), String> {
    set_tcp_raw(fd, libc::TCP_CORK, v, 4, false).map_err(|e| format!("setsockopt(TCP_CORK, {v}): errno {e}"))
}

/// One 64-byte round trip through `echos`.
fn round_trip(s: &mut TcpStream, r: u64) -> Result<(), String> {
    let msg: Vec<u8> = (0..64u64).map(|k| pattern(r * 64 + k)).collect();
    s.write_all(&msg).map_err(|e| format!("write: {e}"))?;
    let mut got = [0u8; 64];
    s.read_exact(&mut got).map_err(|e| format!("read: {e}"))?;
    if got[..] != msg[..] {
        return Err(format!("round {r}: the answer differs"));
    }
    Ok(())
}

/// `optclient PORT`: `TCP_NODELAY` as a program sees it, on two
/// connections to `echos PORT 2`, each read before its first call, after
/// a round trip and after changes.
fn optclient(port: u16) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let connect = || TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"));
    let end = |mut s: TcpStream| -> Result<(), String> {
        s.shutdown(Shutdown::Write).map_err(|e| format!("shutdown: {e}"))?;
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).map_err(|e| format!("the end: {e}"))?;
        if rest.is_empty() {
            Ok(())
        } else {
            Err(format!("{} bytes after the last answer", rest.len()))
        }
    };
    // `TCP_NODELAY` never set by the program; `TCP_CORK` set before the
    // first call (the kernel's then), cleared before the end.
    let mut a = connect()?;
    let fresh = nodelay(a.as_raw_fd());
    set_cork(a.as_raw_fd(), 1)?;
    let early = tcp_opt(a.as_raw_fd(), libc::TCP_CORK);
    round_trip(&mut a, 0)?;
    println!("unset fresh={fresh} carried={}", nodelay(a.as_raw_fd()));
    println!("early cork={early} carried={}", tcp_opt(a.as_raw_fd(), libc::TCP_CORK));
    set_cork(a.as_raw_fd(), 0)?;
    end(a)?;
    // Set before the first call (not decided yet), then cleared.
    let mut b = connect()?;
    let fd = b.as_raw_fd();
    let fresh = nodelay(fd);
    set_nodelay(fd, 1)?;
    let early = nodelay(fd);
    round_trip(&mut b, 1)?;
    let carried = nodelay(fd);
    set_nodelay(fd, 0)?;
    let cleared = nodelay(fd);
    // A one-byte option: the kernel writes one byte of the int.
    let (mut short, mut len) = (0xAAu8, 1 as libc::socklen_t);
    // SAFETY: getsockopt(2) into a byte of ours, with its size.
    unsafe {
        libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_NODELAY, (&mut short as *mut u8).cast(), &mut len)
    };
    // A short option, a null one, and a null buffer to read into.
    let e1 = set_nodelay_raw(fd, 1, 2, false).err().unwrap_or(0);
    let e2 = set_nodelay_raw(fd, 1, 4, true).err().unwrap_or(0);
    let mut len4 = 4 as libc::socklen_t;
    // SAFETY: getsockopt(2) with a null buffer, which the kernel refuses.
    let r = unsafe {
        libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_NODELAY, std::ptr::null_mut(), &mut len4)
    };
    let e3 = if r == 0 { 0 } else { std::io::Error::last_os_error().raw_os_error().unwrap_or(-1) };
    round_trip(&mut b, 2)?;
    set_nodelay(fd, 1)?;
    let again = nodelay(fd);
    println!(
        "set fresh={fresh} early={early} carried={carried} cleared={cleared} short={short}/{len} \
         errs={e1},{e2},{e3} again={again}"
    );
    // Corked (as a server around a header and a sendfile): the round trips
    // still complete (the read bounded), then uncorked.
    b.set_read_timeout(Some(std::time::Duration::from_secs(10))).map_err(|e| e.to_string())?;
    let before = tcp_opt(fd, libc::TCP_CORK);
    set_cork(fd, 1)?;
    let corked = tcp_opt(fd, libc::TCP_CORK);
    for r in 3..6 {
        round_trip(&mut b, r)?;
    }
    set_cork(fd, 0)?;
    let uncorked = tcp_opt(fd, libc::TCP_CORK);
    round_trip(&mut b, 6)?;
    println!("cork before={before} corked={corked} uncorked={uncorked}");
    end(b)
}

fn quiet(port: u16) -> Result<(), String> {
    let l = TcpListener::bind(("127.0.0.1", port)).map_err(|e| format!("bind: {e}"))?;
    let (s, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
    drop(s);
    Ok(())
}

fn expect_end(port: u16) -> Result<(), String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    // Let the server close first.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let mut b = [0u8; 16];
    match s.read(&mut b) {
        Ok(0) => Ok(()),
        Ok(n) => Err(format!("read {n} bytes from a server that sent none")),
        Err(e) => Err(format!("read: {e} (TCP reads the end)")),
    }
}

/// The `TCP_NODELAY` of socket `fd` as the program sees it (-1 if it
/// cannot say).
fn nodelay(fd: i32) -> i32 {
    tcp_opt(fd, libc::TCP_NODELAY)
}

/// Option `name` of `IPPROTO_TCP` of socket `fd` as the program sees it
/// (-1 if it cannot say).
fn tcp_opt(fd: i32, name: i32) -> i32 {
    let mut v: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt(2) into an int of ours, with its size.
    unsafe { libc::getsockopt(fd, libc::IPPROTO_TCP, name, (&mut v as *mut libc::c_int).cast(), &mut len) };
    v
}

fn nbflood(port: u16, bytes: u64) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let mut s = TcpStream::connect((ip_from("SOCKAPP_HOST"), port)).map_err(|e| format!("connect: {e}"))?;
    s.set_nonblocking(true).map_err(|e| e.to_string())?;
    let mut sent = 0u64;
    let mut eagain = 0u64;
    // Bounded: each pass writes at least a byte or waits in poll.
    for _ in 0..(1u64 << 26) {
        if sent == bytes {
            break;
        }
        let n = (bytes - sent).min(64 * 1024) as usize;
        let data: Vec<u8> = (0..n as u64).map(|k| pattern(sent + k)).collect();
        match s.write(&data) {
            Ok(w) => sent += w as u64,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                eagain += 1;
                wait(s.as_raw_fd(), libc::POLLOUT)?;
            }
            Err(e) => return Err(format!("write after {sent}: {e}")),
        }
    }
    if sent != bytes {
        return Err(format!("{sent} of {bytes} bytes written"));
    }
    println!("eagain {eagain}");
    println!("nodelay {}", nodelay(s.as_raw_fd()));
    s.set_nonblocking(false).map_err(|e| e.to_string())?;
    half_close_and_check(&mut s, bytes)
}

fn nbsendfile(port: u16, bytes: u64) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let path = std::env::temp_dir().join(format!("sockapp-nbsendfile-{}", std::process::id()));
    let data: Vec<u8> = (0..bytes).map(pattern).collect();
    std::fs::write(&path, &data).map_err(|e| format!("temp file: {e}"))?;
    let f = std::fs::File::open(&path).map_err(|e| format!("open: {e}"))?;
    let _ = std::fs::remove_file(&path);
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    s.set_nonblocking(true).map_err(|e| e.to_string())?;
    let (mut sent, mut eagain) = (0u64, 0u64);
    // Bounded: each pass sends at least a byte or waits in poll.
    for _ in 0..(1u64 << 26) {
        if sent == bytes {
            break;
        }
        // SAFETY: sendfile(2) between two descriptors we hold, from the
        // file's own position.
        let n = unsafe {
            libc::sendfile(s.as_raw_fd(), f.as_raw_fd(), std::ptr::null_mut(), (bytes - sent) as usize)
        };
        if n > 0 {
            sent += n as u64;
        } else if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::WouldBlock {
            eagain += 1;
            wait(s.as_raw_fd(), libc::POLLOUT)?;
        } else {
            return Err(format!("sendfile after {sent}: {n}, {}", std::io::Error::last_os_error()));
        }
        // The file's position is where the bytes sent end.
        // SAFETY: lseek(2) on our file, moving nothing.
        let at = unsafe { libc::lseek(f.as_raw_fd(), 0, libc::SEEK_CUR) };
        if at != sent as libc::off_t {
            return Err(format!("the file's position is {at} after {sent} bytes sent ({eagain} EAGAINs)"));
        }
    }
    if sent != bytes {
        return Err(format!("{sent} of {bytes} bytes sent"));
    }
    println!("eagain {eagain}");
    s.set_nonblocking(false).map_err(|e| e.to_string())?;
    half_close_and_check(&mut s, bytes)
}

fn epollflood(port: u16, bytes: u64, mode: &str, wait_ms: i32) -> Result<(), String> {
    let (edge, oneshot) = (mode == "et", mode == "oneshot");
    use std::os::fd::AsRawFd;
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    s.set_nonblocking(true).map_err(|e| e.to_string())?;
    let fd = s.as_raw_fd();
    // SAFETY: epoll_create1(2), no pointers.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if ep < 0 {
        return Err(format!("epoll_create1: {}", std::io::Error::last_os_error()));
    }
    let token = 0x5eed_0000_0000_0000u64 | fd as u64;
    let flags = if edge {
        libc::EPOLLET as u32
    } else if oneshot {
        libc::EPOLLONESHOT as u32
    } else {
        0
    };
    let mut ev = libc::epoll_event { events: libc::EPOLLOUT as u32 | flags, u64: token };
    // SAFETY: epoll_ctl(2) with a valid event, on our descriptors.
    if unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) } != 0 {
        return Err(format!("epoll_ctl: {}", std::io::Error::last_os_error()));
    }
    let mut quiet = [0 as libc::c_int; 2];
    // SAFETY: pipe(2) into our array of 2.
    if unsafe { libc::pipe(quiet.as_mut_ptr()) } != 0 {
        return Err(format!("pipe: {}", std::io::Error::last_os_error()));
    }
    let wait_out = || -> Result<(), String> {
        if mode == "select" || mode == "pselect" {
            return select_out(fd, quiet[0], mode == "pselect", wait_ms);
        }
        if oneshot {
            let mut ev = libc::epoll_event { events: libc::EPOLLOUT as u32 | flags, u64: token };
            // SAFETY: epoll_ctl(2) with a valid event: arms the one-shot
            // registration again.
            if unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_MOD, fd, &mut ev) } != 0 {
                return Err(format!("epoll_ctl MOD: {}", std::io::Error::last_os_error()));
            }
        }
        let mut got = [libc::epoll_event { events: 0, u64: 0 }; 4];
        // SAFETY: epoll_wait(2) into our array of 4.
        let n = unsafe { libc::epoll_wait(ep, got.as_mut_ptr(), 4, wait_ms) };
        match n {
            1 => {
                let (events, data) = (got[0].events, got[0].u64);
                if data != token {
                    return Err(format!("epoll reported data {data:#x}, not {token:#x}"));
                }
                if events & libc::EPOLLOUT as u32 == 0 {
                    return Err(format!("epoll reported {events:#x} without EPOLLOUT"));
                }
                Ok(())
            }
            0 => Err(format!("no EPOLLOUT within {wait_ms} ms after EAGAIN: writability lost")),
            n => Err(format!("epoll_wait: {n}: {}", std::io::Error::last_os_error())),
        }
    };
    // The registration's first report (the socket is writable).
    wait_out()?;
    let (mut sent, mut eagain, mut spurious, mut after_report) = (0u64, 0u64, 0u64, false);
    // Bounded: each pass writes at least a byte or waits in epoll (WAIT_MS).
    for _ in 0..(1u64 << 26) {
        if sent == bytes {
            break;
        }
        let n = (bytes - sent).min(64 * 1024) as usize;
        let data: Vec<u8> = (0..n as u64).map(|k| pattern(sent + k)).collect();
        match s.write(&data) {
            Ok(w) => {
                sent += w as u64;
                after_report = false;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                eagain += 1;
                if after_report {
                    spurious += 1;
                }
                wait_out()?;
                after_report = true;
            }
            Err(e) => return Err(format!("write after {sent}: {e}")),
        }
    }
    if sent != bytes {
        return Err(format!("{sent} of {bytes} bytes written"));
    }
    println!("eagain {eagain}");
    println!("nodelay {}", nodelay(s.as_raw_fd()));
    if !edge {
        println!("spurious {spurious}");
    }
    s.set_nonblocking(false).map_err(|e| e.to_string())?;
    let r = half_close_and_check(&mut s, bytes);
    // SAFETY: our epoll and pipe descriptors, each closed once.
    unsafe {
        libc::close(ep);
        libc::close(quiet[0]);
        libc::close(quiet[1]);
    }
    r
}

/// Waits for `fd` in the write set of `select` (`pselect`: of `pselect`),
/// `wait_ms` at most, with `quiet` (never readable) in the read set: the other
/// descriptors' answers are the kernel's, and must stay so.
fn select_out(fd: libc::c_int, quiet: libc::c_int, p: bool, wait_ms: i32) -> Result<(), String> {
    // SAFETY: fd_sets are plain bits; zeroed is empty (FD_ZERO's result).
    let (mut r, mut w): (libc::fd_set, libc::fd_set) = unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
    // SAFETY: our sets; both descriptors are below FD_SETSIZE in this
    // small program.
    unsafe {
        libc::FD_SET(fd, &mut w);
        libc::FD_SET(quiet, &mut r);
    }
    let n = fd.max(quiet) + 1;
    let k = if p {
        let ts =
            libc::timespec { tv_sec: (wait_ms / 1000) as _, tv_nsec: ((wait_ms % 1000) * 1_000_000) as _ };
        // SAFETY: pselect(2) on our sets and timespec, no mask.
        unsafe { libc::pselect(n, &mut r, &mut w, std::ptr::null_mut(), &ts, std::ptr::null()) }
    } else {
        let mut tv = libc::timeval { tv_sec: (wait_ms / 1000) as _, tv_usec: ((wait_ms % 1000) * 1000) as _ };
        // SAFETY: select(2) on our sets and timeval.
        unsafe { libc::select(n, &mut r, &mut w, std::ptr::null_mut(), &mut tv) }
    };
    // SAFETY: our sets, descriptors below FD_SETSIZE.
    let (rd, wr) = unsafe { (libc::FD_ISSET(quiet, &r), libc::FD_ISSET(fd, &w)) };
    match k {
        1 if wr && !rd => Ok(()),
        0 => Err(format!("no writability within {wait_ms} ms after EAGAIN: writability lost")),
        k if k < 0 => Err(format!("select: {}", std::io::Error::last_os_error())),
        k => Err(format!("select said {k}, write set {wr}, read set {rd}")),
    }
}

const CLOSE_ANSWER: usize = 16 << 10;

fn closeserver(port: u16, n: u64) -> Result<(), String> {
    let l = TcpListener::bind(("127.0.0.1", port)).map_err(|e| format!("bind: {e}"))?;
    println!("listening");
    std::io::stdout().flush().ok();
    let answer: Vec<u8> = (0..CLOSE_ANSWER as u64).map(pattern).collect();
    for i in 0..n {
        let (mut s, _) = l.accept().map_err(|e| format!("accept {i}: {e}"))?;
        let mut req = [0u8; 8];
        s.read_exact(&mut req).map_err(|e| format!("request {i}: {e}"))?;
        s.write_all(&answer).map_err(|e| format!("answer {i}: {e}"))?;
        drop(s);
    }
    Ok(())
}

fn closeclient(port: u16, n: u64, ms: u64) -> Result<(), String> {
    let start = std::time::Instant::now();
    let mut done = 0u64;
    while done < n && start.elapsed() < std::time::Duration::from_millis(ms) {
        let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
        s.write_all(b"request\n").map_err(|e| format!("request {done}: {e}"))?;
        let mut got = Vec::new();
        s.read_to_end(&mut got).map_err(|e| format!("answer {done}: {e}"))?;
        if got.len() != CLOSE_ANSWER || got.iter().enumerate().any(|(k, b)| *b != pattern(k as u64)) {
            return Err(format!("answer {done}: {} bytes, or wrong ones", got.len()));
        }
        done += 1;
    }
    println!("done {done}");
    println!("ms {}", start.elapsed().as_millis());
    Ok(())
}

fn banner(port: u16) -> Result<(), String> {
    let l = TcpListener::bind(("127.0.0.1", port)).map_err(|e| format!("bind: {e}"))?;
    let (mut s, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(30))).map_err(|e| e.to_string())?;
    let out: Vec<u8> = (0..64).map(pattern).collect();
    s.write_all(&out).map_err(|e| format!("banner: {e}"))?;
    let mut b = [0u8; 64];
    s.read_exact(&mut b).map_err(|e| format!("read the reply: {e}"))?;
    if b.iter().enumerate().any(|(i, &x)| x != pattern(i as u64 + 64)) {
        return Err(format!("reply {b:?}"));
    }
    Ok(())
}

fn pollbanner(port: u16) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    let t = std::time::Instant::now();
    let mut p = libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    if unsafe { libc::poll(&mut p, 1, 10_000) } != 1 {
        return Err(format!("no banner within 10 s: {}", std::io::Error::last_os_error()));
    }
    s.set_read_timeout(Some(std::time::Duration::from_secs(30))).map_err(|e| e.to_string())?;
    let mut b = [0u8; 64];
    s.read_exact(&mut b).map_err(|e| format!("read the banner: {e}"))?;
    if b.iter().enumerate().any(|(i, &x)| x != pattern(i as u64)) {
        return Err(format!("banner {b:?}"));
    }
    println!("banner after {} ms", t.elapsed().as_millis());
    let out: Vec<u8> = (64..128).map(pattern).collect();
    s.write_all(&out).map_err(|e| format!("reply: {e}"))?;
    Ok(())
}

fn answer(port: u16) -> Result<(), String> {
    let l = TcpListener::bind(("127.0.0.1", port)).map_err(|e| format!("bind: {e}"))?;
    let (mut s, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
    let mut b = [0u8; 64];
    s.read_exact(&mut b).map_err(|e| format!("read: {e}"))?;
    s.write_all(&[1]).map_err(|e| format!("write: {e}"))?;
    // The client reads the answer before it closes.
    let mut end = [0u8; 1];
    let _ = s.read(&mut end);
    Ok(())
}

fn quietwriter(port: u16) -> Result<(), String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    s.write_all(&[9u8; 64]).map_err(|e| format!("write: {e}"))?;
    std::thread::sleep(std::time::Duration::from_secs(3));
    s.set_nonblocking(true).map_err(|e| e.to_string())?;
    let mut b = [0u8; 1];
    match s.read(&mut b) {
        Ok(1) => Ok(()),
        Ok(n) => Err(format!("read {n} bytes")),
        Err(e) => Err(format!("no answer after 3 s ({e}): the request did not reach the server")),
    }
}

fn sink(port: u16) -> Result<(), String> {
    let l = TcpListener::bind(("127.0.0.1", port)).map_err(|e| format!("bind: {e}"))?;
    let (mut s, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
    let mut buf = vec![0u8; 1 << 20];
    s.read_exact(&mut buf).map_err(|e| format!("read: {e}"))?;
    eprintln!("stalled");
    std::thread::sleep(std::time::Duration::from_secs(600));
    Err("not killed".into())
}

fn flood(port: u16) -> Result<(), String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    let buf = vec![7u8; 64 * 1024];
    // Bounded: 64 GiB is far more than any buffer between the two.
    for _ in 0..(1u64 << 20) {
        if let Err(e) = s.write_all(&buf) {
            eprintln!("write failed: {e}");
            return Ok(());
        }
    }
    Err("every write succeeded".into())
}

/// How `selectserver` waits for readability, by round.
#[derive(Clone, Copy, Debug)]
enum Wait {
    Select,
    Poll,
    /// A level-triggered registration in a fresh epoll set.
    Epoll,
    Pselect,
}

/// Whether `fd` reads ready within `ms`, asked as `how` says.
fn readable(fd: i32, ms: i32, how: Wait) -> Result<bool, String> {
    let r = match how {
        // SAFETY: an fd_set on the stack, zeroed and with one descriptor
        // below FD_SETSIZE (a fresh test process); a valid timeval or
        // timespec.
        Wait::Select | Wait::Pselect => unsafe {
            let mut set: libc::fd_set = std::mem::zeroed();
            libc::FD_ZERO(&mut set);
            libc::FD_SET(fd, &mut set);
            let null = std::ptr::null_mut();
            let r = if matches!(how, Wait::Select) {
                let mut tv = libc::timeval { tv_sec: (ms / 1000) as _, tv_usec: ((ms % 1000) * 1000) as _ };
                libc::select(fd + 1, &mut set, null, null, &mut tv)
            } else {
                let ts = libc::timespec { tv_sec: (ms / 1000) as _, tv_nsec: ((ms % 1000) * 1_000_000) as _ };
                libc::pselect(fd + 1, &mut set, null, null, &ts, std::ptr::null())
            };
            if r > 0 && !libc::FD_ISSET(fd, &set) {
                return Err("select counted a descriptor it did not set".into());
            }
            r
        },
        Wait::Poll => {
            let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut p, 1, ms) }
        }
        Wait::Epoll => {
            // SAFETY: epoll(7) calls on a set of our own, closed here,
            // with valid events.
            unsafe {
                let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
                if ep < 0 {
                    return Err(format!("epoll_create1: {}", std::io::Error::last_os_error()));
                }
                let token = 0xdead_beef_0000_0000u64 | fd as u64;
                let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: token };
                let mut r = libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev);
                if r == 0 {
                    let mut got = [libc::epoll_event { events: 0, u64: 0 }; 2];
                    r = libc::epoll_wait(ep, got.as_mut_ptr(), 2, ms);
                    let data = got[0].u64;
                    if r > 0 && data != token {
                        libc::close(ep);
                        return Err(format!("epoll reported data {data:#x}, not {token:#x}"));
                    }
                }
                libc::close(ep);
                r
            }
        }
    };
    match r {
        0 => Ok(false),
        1.. => Ok(true),
        _ => Err(format!("{how:?}: {}", std::io::Error::last_os_error())),
    }
}

fn selectserver(port: u16, rounds: u64) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let l = TcpListener::bind((ip_from("SOCKAPP_BIND"), port)).map_err(|e| format!("bind: {e}"))?;
    println!("listening");
    std::io::stdout().flush().ok();
    let (mut s, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(1))).map_err(|e| format!("timeout: {e}"))?;
    let fd = s.as_raw_fd();
    let mut msg = vec![0u8; 4096];
    for round in 0..rounds {
        let how = [Wait::Select, Wait::Poll, Wait::Epoll, Wait::Pselect][(round % 4) as usize];
        if !readable(fd, 10_000, how)? {
            return Err(format!("round {round}: no message within 10 s"));
        }
        let mut len = [0u8; 4];
        s.read_exact(&mut len).map_err(|e| format!("round {round}: length: {e}"))?;
        let n = u32::from_le_bytes(len) as usize;
        if n > msg.len() {
            return Err(format!("round {round}: length {n}"));
        }
        s.read_exact(&mut msg[..n]).map_err(|e| format!("round {round}: message: {e}"))?;
        if let Some(i) = (0..n).find(|&i| msg[i] != pattern(round + i as u64)) {
            return Err(format!("round {round}: byte {i} wrong"));
        }
        s.write_all(b"a").map_err(|e| format!("round {round}: answer: {e}"))?;
        // The client sends nothing until the go.
        if readable(fd, 30, how)? {
            let mut b = [0u8; 1];
            return Err(match s.read(&mut b) {
                Ok(0) => format!("round {round}: the end before the go"),
                Ok(_) => format!("round {round}: the client wrote before the go"),
                Err(e) => {
                    format!("round {round}: stale readiness ({how:?}): ready with nothing to read: {e}")
                }
            });
        }
        s.write_all(b"g").map_err(|e| format!("round {round}: go: {e}"))?;
    }
    println!("rounds {rounds}");
    Ok(())
}

fn msgclient(port: u16, rounds: u64) -> Result<(), String> {
    let mut s = TcpStream::connect((ip_from("SOCKAPP_HOST"), port)).map_err(|e| format!("connect: {e}"))?;
    for round in 0..rounds {
        let n = 1 + (round as usize * 37) % 3000;
        let msg: Vec<u8> = (0..n).map(|i| pattern(round + i as u64)).collect();
        s.write_all(&(n as u32).to_le_bytes()).map_err(|e| format!("round {round}: length: {e}"))?;
        // The message lands while the server reads the length and arms,
        // or just before, or after: 0 to 450 µs later.
        let pause = (round % 16) * 30;
        if pause > 0 {
            std::thread::sleep(std::time::Duration::from_micros(pause));
        }
        s.write_all(&msg).map_err(|e| format!("round {round}: message: {e}"))?;
        let mut b = [0u8; 2];
        s.read_exact(&mut b).map_err(|e| format!("round {round}: answer: {e}"))?;
        if &b != b"ag" {
            return Err(format!("round {round}: answer {b:?}"));
        }
    }
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let port = || args.get(2).and_then(|p| p.parse().ok()).expect("PORT");
    let r = match args.get(1).map(String::as_str) {
        Some("server") => server(port()),
        Some("client") => client(port(), args.get(3).and_then(|b| b.parse().ok()).expect("BYTES")),
        Some("readsplit") => readsplit(port(), args.get(3).and_then(|b| b.parse().ok()).expect("BYTES")),
        Some("readreply") => readreply(port(), args.get(3).and_then(|b| b.parse().ok()).expect("BYTES")),
        Some("readcheck") => readcheck(port(), args.get(3).and_then(|b| b.parse().ok()).expect("BYTES")),
        Some("sendclose") => sendclose(port(), args.get(3).and_then(|b| b.parse().ok()).expect("BYTES")),
        Some("echo") => echo(port()),
        Some("forkserver") => forkserver(port()),
        Some("forkechos") => forkechos(port(), args.get(3).and_then(|b| b.parse().ok()).expect("N")),
        Some("forkecho") => forkecho(port(), args.get(3).map(String::as_str).expect("MODE")),
        Some("inetd") => inetd(port(), args.get(3).map(String::as_str).expect("MODE")),
        Some("stdcheck") => stdcheck(args.get(2).and_then(|b| b.parse().ok()).expect("FROM")),
        Some("stdecho") => stdecho(args.get(2).is_some_and(|a| a == "go")),
        Some("execlisten") => execlisten(port()),
        Some("fdecho") => fdecho(),
        Some("banner") => banner(port()),
        Some("pollbanner") => pollbanner(port()),
        Some("forkclient") => forkclient(port(), args.get(3).and_then(|b| b.parse().ok()).expect("BYTES")),
        Some("execclient") => execclient(port(), args.get(3).and_then(|b| b.parse().ok()).expect("BYTES")),
        Some("carriedexecclient") => carriedexecclient(
            port(),
            args.get(3).and_then(|b| b.parse().ok()).expect("BYTES"),
            args.get(4).is_some_and(|a| a == "pipelined"),
        ),
        Some("fdresume") => {
            let num = |i: usize| args.get(i).and_then(|b| b.parse().ok());
            fdresume(num(2).expect("BYTES"), num(3).expect("SENT"), num(4).expect("PENDING"))
        }
        Some("fdclient") => fdclient(args.get(2).and_then(|b| b.parse().ok()).expect("BYTES")),
        Some("goclient") => goclient(
            port(),
            args.get(3).and_then(|b| b.parse().ok()).expect("BYTES"),
            args.get(4).map(String::as_str).expect("WAY"),
        ),
        Some("echoclient") => echoclient(port(), args.get(3).and_then(|b| b.parse().ok()).expect("BYTES")),
        Some("sink") => sink(port()),
        Some("badbuf") => badbuf(port()),
        Some("pollserver") => pollserver(port()),
        Some("quiet") => quiet(port()),
        Some("becho") => becho(port()),
        Some("lazyserver") => lazyserver(port(), args.get(3).map(String::as_str).expect("MODE")),
        Some("lazyclient") => lazyclient(port()),
        Some("epecho") => epecho(port()),
        Some("nestecho") => nestecho(port(), args.get(3).map(String::as_str).expect("MODE")),
        Some("eprr") => eprr(port(), args.get(3).and_then(|b| b.parse().ok()).expect("ROUNDS")),
        Some("rr") => rr(port(), args.get(3).and_then(|b| b.parse().ok()).expect("ROUNDS")),
        Some("sendfile") => sendfile(port(), args.get(3).and_then(|b| b.parse().ok()).expect("BYTES")),
        Some("expect-end") => expect_end(port()),
        Some("flood") => flood(port()),
        Some("tiny") => client_sizes(
            port(),
            args.get(3).and_then(|b| b.parse().ok()).expect("BYTES"),
            &[1, 13, 2, 11, 3, 7, 5, 12, 4, 9],
        ),
        Some("lateserver") => lateserver(port()),
        Some("slowserver") => slowserver(port()),
        Some("stallserver") => stallserver(port()),
        Some("sleepyserver") => sleepyserver(port()),
        Some("mmsgclient") => mmsgclient(port()),
        Some("mmsgserver") => mmsgserver(port()),
        Some("spliceclient") => spliceclient(port()),
        Some("fionreadserver") => fionreadserver(port()),
        Some("alarmclient") => alarmclient(port(), args.get(3).and_then(|b| b.parse().ok()).expect("BYTES")),
        Some("idlewriter") => idlewriter(port(), args.get(3).map(String::as_str).expect("MODE")),
        Some("nbflood") => nbflood(port(), args.get(3).and_then(|b| b.parse().ok()).expect("BYTES")),
        Some("nbsendfile") => nbsendfile(port(), args.get(3).and_then(|b| b.parse().ok()).expect("BYTES")),
        Some("answer") => answer(port()),
        Some("epollflood") => epollflood(
            port(),
            args.get(3).and_then(|b| b.parse().ok()).expect("BYTES"),
            args.get(4).map(String::as_str).unwrap_or("et"),
            args.get(5).and_then(|b| b.parse().ok()).unwrap_or(10_000),
        ),
        Some("closeserver") => closeserver(port(), args.get(3).and_then(|b| b.parse().ok()).expect("N")),
        Some("closeclient") => closeclient(
            port(),
            args.get(3).and_then(|b| b.parse().ok()).expect("N"),
            args.get(4).and_then(|b| b.parse().ok()).expect("MS"),
        ),
        Some("selectserver") => {
            selectserver(port(), args.get(3).and_then(|b| b.parse().ok()).expect("ROUNDS"))
        }
        Some("msgclient") => msgclient(port(), args.get(3).and_then(|b| b.parse().ok()).expect("ROUNDS")),
        Some("quietwriter") => quietwriter(port()),
        Some("echos") => echos(port(), args.get(3).and_then(|b| b.parse().ok()).expect("N")),
        Some("optclient") => optclient(port()),
        Some("ping") => ping(port(), args.get(3).and_then(|b| b.parse().ok()).expect("ROUNDS")),
        _ => {
            Err("usage: vrdma-it-sockapp server PORT | client PORT BYTES | echo PORT | ping PORT ROUNDS"
                .into())
        }
    };
    if let Err(e) = r {
        eprintln!("sockapp: {e}");
        std::process::exit(1);
    }
}

/// Ends our half of the stream and checks the server's answer: that it
/// counted `bytes` bytes before our EOF.
fn half_close_and_check(s: &mut TcpStream, bytes: u64) -> Result<(), String> {
    s.shutdown(Shutdown::Write).map_err(|e| format!("shutdown: {e}"))?;
    let mut answer = String::new();
    s.read_to_string(&mut answer).map_err(|e| format!("answer: {e}"))?;
    if answer != format!("ok {bytes}\n") {
        return Err(format!("answer {answer:?}"));
    }
    Ok(())
}
