//! `exec` under the sockets preload library (`docs/sockets.md`, "Exec"):
//! a connection that an exec'd program inherits before any call on it
//! falls back to plain TCP cleanly (inetd-style servers, and a client
//! that execs), and a carried one is demoted to plain TCP at an exact
//! byte and inherited, or, where it cannot be, not inherited.
//!
//! Each test starts a daemon of its own and `vrdma-it-sockapp` roles
//! under `LD_PRELOAD`, on loopback; every process is waited for with a
//! bound and killed by its pid past it.

use std::process::Command;
use std::time::Duration;

use anyhow::Result;
use vrdma_it::harness::{self, built, free_port, listening, spawn, Finished};
use vrdma_it::DaemonProc;

/// Echoed through the exec'd program: four rings' worth, in 16 KiB round
/// trips checked byte by byte.
const BYTES: u64 = 1 << 20;
const LIMIT: Duration = Duration::from_secs(60);
const CARRIED: &str = "carried over vRDMA";

fn sockapp(d: &DaemonProc, args: &[String], env: &[(&str, &str)]) -> Command {
    let exe = vrdma_it::peer_exe().with_file_name("vrdma-it-sockapp");
    let mut c = Command::new(exe);
    c.args(args)
        .env(vrdma::SOCKET_ENV, &d.socket)
        .env("VRDMA_SOCKETS_DEBUG", "1")
        .env("LD_PRELOAD", built("libvrdma_sockets.so"));
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

/// An `inetd PORT MODE` server and a carried-capable `echoclient`, each
/// with its environment; both run to their ends (bounded). Returns the
/// client's and the server's output, and the daemon's counts.
fn inetd(
    mode: &str,
    server_env: &[(&str, &str)],
    client_env: &[(&str, &str)],
) -> Result<(Finished, Finished, vrdma::sockets::SockCounts)> {
    let _one = harness::one_at_a_time();
    let d = DaemonProc::start()?;
    let ctx = d.context()?;
    let port = free_port();
    let s = spawn(sockapp(&d, &["inetd".into(), port.to_string(), mode.into()], server_env), "inetd");
    vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
        listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
    })?;
    let args = ["echoclient".into(), port.to_string(), BYTES.to_string()];
    let c = spawn(sockapp(&d, &args, client_env), "echoclient").finish(LIMIT);
    let s = s.finish(LIMIT);
    Ok((c, s, ctx.sock_counts()?))
}

/// The connection fell back to plain TCP and every byte came back, then
/// the end: checked by the client; neither end carried it.
/// Whether the library said (debug) that a peer's exec resend left
/// bytes queued: ", N of them queued" with N > 0 (not "0 of them").
fn queued_some(stderr: &str) -> bool {
    stderr.lines().any(|l| {
        l.strip_suffix(" of them queued")
            .and_then(|h| h.rsplit(' ').next())
            .is_some_and(|n| n.parse::<u64>().is_ok_and(|n| n > 0))
    })
}

fn fell_back(c: &Finished, s: &Finished) {
    c.assert_ok();
    s.assert_ok();
    assert!(c.stdout.contains(&format!("echoed {BYTES}, then the end")), "{}", c.describe());
    assert!(!c.stderr.contains(CARRIED) && !s.stderr.contains(CARRIED), "{}\n{}", c.describe(), s.describe());
    assert!(c.stderr.contains(": TCP"), "the client did not say TCP\n{}", c.describe());
}

/// The client's first call comes after the server's exec: the server
/// declines the claimed connection through the daemon, the client's
/// resolve reads TCP, and nothing of the negotiation enters the stream.
#[test]
fn an_inetd_server_that_execs_before_the_clients_first_call_falls_back_through_the_daemon() -> Result<()> {
    let (c, s, counts) = inetd("exec", &[], &[("SOCKAPP_CONNECT_DELAY_MS", "800")])?;
    fell_back(&c, &s);
    assert!(s.stderr.contains(&format!("stdecho {BYTES}")), "{}", s.describe());
    assert!(s.stderr.contains("declined through the daemon before an exec"), "{}", s.describe());
    // Announced, claimed (counted carried at the claim), then declined.
    assert_eq!((counts.announced, counts.carried, counts.abandoned), (1, 1, 1), "{counts:?}");
    Ok(())
}

/// The client's first call comes before the server's exec: its hello is
/// on the socket, the server reads it and answers it with a decline, which
/// the client reads in place of the server's hello.
#[test]
fn an_inetd_server_that_execs_after_the_clients_hello_answers_it_with_a_decline() -> Result<()> {
    let (c, s, counts) = inetd("exec", &[("SOCKAPP_EXEC_DELAY_MS", "800")], &[])?;
    fell_back(&c, &s);
    assert!(s.stderr.contains(&format!("stdecho {BYTES}")), "{}", s.describe());
    assert!(s.stderr.contains("answered with a decline before an exec"), "{}", s.describe());
    assert!(c.stderr.contains("the peer declined"), "{}", c.describe());
    assert_eq!((counts.announced, counts.carried, counts.abandoned), (1, 1, 0), "{counts:?}");
    Ok(())
}

/// The classic inetd: fork, the child `dup2`s the connection onto its
/// stdin and stdout and `execvp`s `cat` (glibc's execvp does not go
/// through `execve`'s PLT entry); and a server that runs its program with
/// `std::process::Command` (glibc's `posix_spawn`, the socket `dup2`ed by
/// its file actions from a close-on-exec descriptor).
#[test]
fn a_forking_inetd_and_a_spawning_server_hand_over_a_clean_tcp_stream() -> Result<()> {
    for delay in ["0", "800"] {
        let (c, s, _) = inetd("fork-exec", &[("SOCKAPP_EXEC_DELAY_MS", delay)], &[])?;
        fell_back(&c, &s);
        let (c, s, _) = inetd("spawn", &[("SOCKAPP_EXEC_DELAY_MS", delay)], &[])?;
        fell_back(&c, &s);
        assert!(s.stderr.contains(&format!("stdecho {BYTES}")), "{}", s.describe());
    }
    Ok(())
}

/// An `inetd PORT MODE` server against a `goclient ... WAY`, as [`inetd`].
fn go_inetd(
    mode: &str,
    way: &str,
    server_env: &[(&str, &str)],
    client_env: &[(&str, &str)],
) -> Result<(Finished, Finished)> {
    let _one = harness::one_at_a_time();
    let d = DaemonProc::start()?;
    let ctx = d.context()?;
    let port = free_port();
    let s = spawn(sockapp(&d, &["inetd".into(), port.to_string(), mode.into()], server_env), "inetd");
    vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
        listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
    })?;
    let args = ["goclient".into(), port.to_string(), BYTES.to_string(), way.into()];
    let c = spawn(sockapp(&d, &args, client_env), "goclient").finish(LIMIT);
    let s = s.finish(LIMIT);
    Ok((c, s))
}

/// The connection was carried, demoted before the exec or spawn, and the
/// program got it as a connected socket and echoed every byte after the
/// first chunk.
fn handed_over(c: &Finished, s: &Finished) {
    c.assert_ok();
    s.assert_ok();
    assert!(s.stderr.contains(CARRIED) && c.stderr.contains(CARRIED), "{}\n{}", c.describe(), s.describe());
    assert!(s.stderr.contains("demoted to plain TCP for the exec'd program"), "{}", s.describe());
    assert!(s.stderr.contains("stdecho: stdin is a connected socket"), "{}", s.describe());
    assert!(s.stderr.contains(&format!("stdecho {}", BYTES - 16384)), "{}", s.describe());
    assert!(c.stdout.contains(&format!("echoed {BYTES}, then the end")), "{}", c.describe());
}

/// A connection carried before an `execve` that the exec'd program
/// inherits (its stdin and stdout, `dup2`ed: not close-on-exec) is
/// demoted to plain TCP at an exact byte first, and the program reads and
/// writes the stream where it was: the client, after one chunk echoed by
/// the server itself, waits for the program's go byte blocked in `read`,
/// in `poll`, or in `epoll_wait` (each must wake at the demotion and
/// switch), then the rest is echoed by the program, every byte checked.
#[test]
fn a_connection_carried_before_exec_is_demoted_and_the_execd_program_gets_it() -> Result<()> {
    for way in ["read", "poll", "epoll"] {
        let (c, s) = go_inetd("carried-exec", way, &[], &[])?;
        handed_over(&c, &s);
    }
    Ok(())
}

/// A carried connection handed to a program spawned through
/// `posix_spawn`'s file actions (`std::process::Command` with the socket
/// as its stdin and stdout) is demoted when the action is added, and the
/// program gets it.
#[test]
fn a_carried_connection_given_to_a_spawned_program_is_demoted_first() -> Result<()> {
    let (c, s) = go_inetd("carried-spawn", "read", &[], &[])?;
    handed_over(&c, &s);
    Ok(())
}

/// The fallback: a peer that makes no call within the server's bounded
/// wait (`VRDMA_SOCKETS_WAIT_MS`) does not answer the demotion, and the
/// exec goes on as before: the connection is close-on-exec, the program
/// gets nothing (its stdin and stdout closed, it reads nothing), and the
/// peer, once it reads, finds the end.
#[test]
fn a_connection_whose_peer_does_not_answer_in_time_is_not_inherited() -> Result<()> {
    let (c, s) = go_inetd(
        "carried-exec",
        "late",
        &[("VRDMA_SOCKETS_WAIT_MS", "300")],
        &[("SOCKAPP_GO_DELAY_MS", "2500")],
    )?;
    c.assert_ok();
    s.assert_ok();
    assert!(s.stderr.contains(CARRIED) && c.stderr.contains(CARRIED), "{}\n{}", c.describe(), s.describe());
    assert!(s.stderr.contains("did not answer the demotion in time"), "{}", s.describe());
    // Said even without VRDMA_SOCKETS_DEBUG (a warning).
    assert!(s.stderr.contains("could not be demoted to plain TCP for the new program"), "{}", s.describe());
    assert!(s.stderr.contains("stdecho: stdin is no socket"), "{}", s.describe());
    assert!(s.stderr.contains("stdecho 0"), "{}", s.describe());
    assert!(c.stdout.contains("the end instead of the go byte"), "{}", c.describe());
    Ok(())
}

/// As above, with bytes of the peer's in the ring the program has not read
/// (an exec's demotion takes such a ring): they are lost with the exec,
/// so the connection is reset, not ended cleanly (the server's library
/// says so; the client's, at its late switch, fails to read them back from
/// the gone ring and reads a reset either way).
#[test]
fn a_connection_with_unread_bytes_whose_peer_does_not_answer_in_time_is_reset() -> Result<()> {
    let (c, s) = go_inetd(
        "carried-exec",
        "pipelined-late",
        &[("VRDMA_SOCKETS_WAIT_MS", "300"), ("SOCKAPP_BEFORE_EXEC_MS", "500")],
        &[("SOCKAPP_GO_DELAY_MS", "2500")],
    )?;
    c.assert_ok();
    s.assert_ok();
    assert!(s.stderr.contains("did not answer the demotion in time"), "{}", s.describe());
    assert!(s.stderr.contains("bytes of the peer's unread: reset at the exec"), "{}", s.describe());
    assert!(s.stderr.contains("no program will read: the connection is reset"), "{}", s.describe());
    assert!(s.stderr.contains("stdecho 0"), "{}", s.describe());
    assert!(c.stdout.contains("the end instead of the go byte (reset)"), "{}", c.describe());
    Ok(())
}

/// A client that sends its request and shuts its write side, then reads
/// the answer (CGI style): the server reads the request to its end, then
/// execs a program with the connection, which answers: the connection is
/// demoted (the client's library sends no marker: its end is on the
/// socket) and the program's answer reaches the client.
#[test]
fn a_connection_whose_peer_shut_its_write_side_is_handed_over() -> Result<()> {
    let (c, s) = go_inetd("carried-exec-eof", "shut", &[], &[])?;
    c.assert_ok();
    s.assert_ok();
    assert!(s.stderr.contains(CARRIED) && c.stderr.contains(CARRIED), "{}\n{}", c.describe(), s.describe());
    assert!(s.stderr.contains("demoted to plain TCP for the exec'd program"), "{}", s.describe());
    assert!(s.stderr.contains("stdecho: stdin is a connected socket"), "{}", s.describe());
    assert!(s.stderr.contains("stdecho 0"), "{}", s.describe());
    assert!(c.stdout.contains("the echo, the go byte, then the end"), "{}", c.describe());
    Ok(())
}

/// Bytes of the peer's in the ring that the program has not read when it
/// execs (the client sends two chunks before it reads the first one's
/// echo; the server reads one, waits a while, the second landing in its
/// ring meanwhile, and execs): the exec'd program gets them too. The
/// server's ring goes with its exec, so the client's library, at its
/// switch, reads them back from that ring (an RDMA read) and sends them
/// again after its marker, whose count is the server's read count.
#[test]
fn a_connection_with_unread_ring_bytes_is_handed_over_with_them() -> Result<()> {
    let (c, s) = go_inetd("carried-exec", "pipelined", &[("SOCKAPP_BEFORE_EXEC_MS", "500")], &[])?;
    handed_over(&c, &s);
    assert!(c.stderr.contains("16384 bytes sent again after the marker"), "{}", c.describe());
    Ok(())
}

/// Most of a ring unread at the exec (192 KiB), past a read count near the
/// ring's size (240 KiB), so that the range the client's library reads
/// back from the server's ring wraps, and the exec'd program echoes them
/// while the client's library still sends them: every byte comes back
/// once, in order.
#[test]
fn a_connection_with_most_of_a_wrapping_ring_unread_is_handed_over_whole() -> Result<()> {
    let first = (240 * 1024).to_string();
    let unread = (192 * 1024).to_string();
    let server = [("SOCKAPP_BEFORE_EXEC_MS", "500"), ("SOCKAPP_ECHO_FIRST", first.as_str())];
    let client = [("SOCKAPP_ECHO_FIRST", first.as_str()), ("SOCKAPP_UNREAD", unread.as_str())];
    let (c, s) = go_inetd("carried-exec", "bulk", &server, &client)?;
    c.assert_ok();
    s.assert_ok();
    assert!(s.stderr.contains(CARRIED) && c.stderr.contains(CARRIED), "{}\n{}", c.describe(), s.describe());
    assert!(s.stderr.contains("demoted to plain TCP for the exec'd program"), "{}", s.describe());
    assert!(s.stderr.contains(&format!("stdecho {}", BYTES - 240 * 1024)), "{}", s.describe());
    assert!(
        c.stderr.contains(&format!("{} bytes sent again after the marker", 192 * 1024)),
        "{}",
        c.describe()
    );
    assert!(c.stdout.contains(&format!("echoed {BYTES}, then the end")), "{}", c.describe());
    Ok(())
}

/// The client's library's resend fails midway (a test knob: half of the
/// marker and bytes sent, then an error as a send that timed out): the
/// failure is final. The client's calls fail with a reset and send
/// nothing more (no second marker, no bytes twice: before the fix the
/// next call sent them again), and the exec'd program's stream ends with
/// a reset, not a clean end after a short stream.
#[test]
fn a_resend_that_fails_midway_resets_the_connection_and_is_not_repeated() -> Result<()> {
    let first = (240 * 1024).to_string();
    let n = 192 * 1024;
    let unread = n.to_string();
    let server = [("SOCKAPP_BEFORE_EXEC_MS", "500"), ("SOCKAPP_ECHO_FIRST", first.as_str())];
    let client = [
        ("SOCKAPP_ECHO_FIRST", first.as_str()),
        ("SOCKAPP_UNREAD", unread.as_str()),
        ("SOCKAPP_EXPECT_FAILURE", "1"),
        ("VRDMA_SOCKETS_TEST_PAUSE", "resend-fails:0"),
    ];
    let (c, s) = go_inetd("carried-exec", "bulk", &server, &client)?;
    c.assert_ok();
    let reset = format!("Err(Some({}))", libc::ECONNRESET);
    assert!(c.stdout.contains(&format!("the go byte read: {reset}")), "{}", c.describe());
    assert!(c.stdout.contains(&format!("then a write: {reset}")), "{}", c.describe());
    assert!(c.stdout.contains(&format!("then a read: {reset}")), "{}", c.describe());
    assert!(c.stderr.contains("failed midway"), "{}", c.describe());
    // The program (what went of the range readable before the reset, or
    // not) ends with the reset, never at a clean end.
    let finished =
        s.stderr.lines().any(|l| l.strip_prefix("stdecho ").is_some_and(|k| k.parse::<u64>().is_ok()));
    let reset = ["Connection reset", "Broken pipe"].iter().any(|e| s.stderr.contains(e));
    assert!(!finished && reset, "{}", s.describe());
    Ok(())
}

/// As [`a_resend_that_fails_midway_resets_the_connection_and_is_not_repeated`],
/// with the client's descriptor 2 the connection itself (`dup2` before
/// the go byte read) and SIGPIPE at its default: the library's lines said
/// while the read switches P's writes, the send lock held (the debug
/// lines of the resend, the warning of the failure), go through the
/// library into that connection once the lock is let go, and fail there
/// without a signal. Nothing hangs (session 35, second review H1: their
/// write took the send lock again and waited for it for ever, `the go
/// byte read hangs`).
#[test]
fn a_line_said_under_the_send_lock_with_stderr_the_connection_does_not_hang() -> Result<()> {
    let first = (240 * 1024).to_string();
    let unread = (192 * 1024).to_string();
    let server = [("SOCKAPP_BEFORE_EXEC_MS", "500"), ("SOCKAPP_ECHO_FIRST", first.as_str())];
    let client = [
        ("SOCKAPP_ECHO_FIRST", first.as_str()),
        ("SOCKAPP_UNREAD", unread.as_str()),
        ("SOCKAPP_EXPECT_FAILURE", "1"),
        ("SOCKAPP_STDERR_EARLY", "1"),
        ("VRDMA_SOCKETS_TEST_PAUSE", "resend-fails:0"),
    ];
    let (c, s) = go_inetd("carried-exec", "bulk", &server, &client)?;
    assert!(!c.stdout.contains("hangs"), "{}", c.describe());
    c.assert_ok();
    let reset = format!("Err(Some({}))", libc::ECONNRESET);
    assert!(c.stdout.contains(&format!("the go byte read: {reset}")), "{}", c.describe());
    assert!(c.stdout.contains(&format!("then a write: {reset}")), "{}", c.describe());
    // Said into the connection (descriptor 2 then), not to the captured
    // stderr: the lines took the path the test is about.
    assert!(!c.stderr.contains("failed midway"), "{}", c.describe());
    let finished =
        s.stderr.lines().any(|l| l.strip_prefix("stdecho ").is_some_and(|k| k.parse::<u64>().is_ok()));
    assert!(!finished, "{}", s.describe());
    Ok(())
}

/// A spawn does not ask the peer to send unread ring bytes again (the
/// parent goes on, and must be left a connection it can read should the
/// peer not answer in time): a carried connection whose ring holds bytes
/// the program has not read is not given to the spawned program, as
/// before (its file action closes the target instead).
#[test]
fn a_carried_connection_with_unread_ring_bytes_is_not_given_to_a_spawned_program() -> Result<()> {
    let (c, s) = go_inetd("carried-spawn", "pipelined", &[("SOCKAPP_BEFORE_EXEC_MS", "500")], &[])?;
    c.assert_ok();
    s.assert_ok();
    assert!(s.stderr.contains(CARRIED) && c.stderr.contains(CARRIED), "{}\n{}", c.describe(), s.describe());
    assert!(
        s.stderr.contains("not demoted (the ring holds bytes the program has not read)"),
        "{}",
        s.describe()
    );
    assert!(s.stderr.contains("stdecho: stdin is no socket"), "{}", s.describe());
    assert!(c.stdout.contains("the end instead of the go byte"), "{}", c.describe());
    Ok(())
}

/// A client that connects and execs a program with the connection before
/// any call on it: it gives its announcement up (the server's claim is
/// refused) or, if the server claimed it already, sends a decline in
/// place of its hello, which the server reads at its first call. Either
/// way the exec'd program's bytes are echoed over plain TCP.
#[test]
fn a_client_that_execs_before_its_first_call_falls_back() -> Result<()> {
    // The server accepts (and claims) after the client's exec, or
    // before it.
    for (accept_delay, exec_delay, said) in
        [("800", "0", "given up before an exec"), ("0", "800", "declined before an exec")]
    {
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let port = free_port();
        let args = ["forkecho".into(), port.to_string(), "child".into()];
        let s = spawn(sockapp(&d, &args, &[("SOCKAPP_ACCEPT_DELAY_MS", accept_delay)]), "forkecho");
        vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
            listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
        })?;
        let args = ["execclient".into(), port.to_string(), BYTES.to_string()];
        let c =
            spawn(sockapp(&d, &args, &[("SOCKAPP_EXEC_DELAY_MS", exec_delay)]), "execclient").finish(LIMIT);
        let s = s.finish(LIMIT);
        c.assert_ok();
        s.assert_ok();
        assert!(c.stdout.contains(&format!("echoed {BYTES}, then the end")), "{}", c.describe());
        assert!(s.stdout.contains(&format!("echoed {BYTES}")), "{}", s.describe());
        assert!(
            !c.stderr.contains(CARRIED) && !s.stderr.contains(CARRIED),
            "{}\n{}",
            c.describe(),
            s.describe()
        );
        assert!(c.stderr.contains(said), "{}", c.describe());
        let counts = ctx.sock_counts()?;
        // Given up: the server's claim is refused; declined: claimed.
        let refused = u64::from(accept_delay != "0");
        assert_eq!((counts.announced, counts.refused_claims), (1, refused), "{counts:?}");
    }
    Ok(())
}

/// A client that connects, and declines at its exec (the server claimed
/// the connection first), to a non-blocking server that registered the
/// connection in epoll right after its accept (`pollserver` with
/// `SOCKAPP_STRICT_READY`): the server's `epoll_wait` is woken by the
/// decline, decides the connection (plain TCP) and answers for it as the
/// kernel then has it: no `EPOLLIN` until the exec'd program's bytes are
/// there (before, the decline's report was handed out and the read said
/// `EAGAIN`), and the report of those bytes still comes, also
/// edge-triggered.
#[test]
fn an_epoll_server_woken_by_a_decline_is_told_of_the_bytes_after_it() -> Result<()> {
    for how in ["epoll", "epoll-et", "epoll-oneshot"] {
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let port = free_port();
        let args = ["pollserver".into(), port.to_string()];
        let s = spawn(sockapp(&d, &args, &[("SOCKAPP_STRICT_READY", how)]), "pollserver");
        vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
            listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
        })?;
        let args = ["execclient".into(), port.to_string(), BYTES.to_string()];
        let env = [("SOCKAPP_EXEC_DELAY_MS", "800"), ("SOCKAPP_FD_SEND", "1")];
        let c = spawn(sockapp(&d, &args, &env), "execclient").finish(LIMIT);
        let s = s.finish(LIMIT);
        // (The client checks the server's count of the bytes.)
        assert!(s.status.success() && c.status.success(), "{how}:\n{}\n{}", s.describe(), c.describe());
        assert!(c.stderr.contains("declined before an exec"), "{how}: {}", c.describe());
        assert!(!s.stderr.contains(CARRIED), "{how}: {}", s.describe());
    }
    Ok(())
}

/// A Python server that runs `cat` on each accepted connection with
/// `subprocess` (its stdin and stdout the socket: `_posixsubprocess`
/// `dup2`s it in a `vfork`ed child and execs there), as CGI-like servers
/// do: the connection falls back to plain TCP and every byte is echoed.
#[test]
fn a_python_server_running_cat_through_subprocess_hands_over_a_clean_tcp_stream() -> Result<()> {
    const SERVER: &str = "import socket, subprocess, sys
l = socket.socket()
l.bind(('127.0.0.1', int(sys.argv[1])))
l.listen()
print('listening', flush=True)
c, _ = l.accept()
r = subprocess.run(['cat'], stdin=c, stdout=c)
c.close()
sys.exit(r.returncode)
";
    let _one = harness::one_at_a_time();
    let d = DaemonProc::start()?;
    let ctx = d.context()?;
    for client_delay in ["0", "800"] {
        let (s, port) = python_listening(&ctx, |port| {
            let mut py = Command::new("python3");
            py.args(["-c", SERVER, &port.to_string()])
                .env(vrdma::SOCKET_ENV, &d.socket)
                .env("VRDMA_SOCKETS_DEBUG", "1")
                .env("LD_PRELOAD", built("libvrdma_sockets.so"));
            py
        })?;
        let args = ["echoclient".into(), port.to_string(), BYTES.to_string()];
        let c = spawn(sockapp(&d, &args, &[("SOCKAPP_CONNECT_DELAY_MS", client_delay)]), "echoclient")
            .finish(LIMIT);
        let s = s.finish(LIMIT);
        fell_back(&c, &s);
        assert!(s.stderr.contains("before an exec"), "{}", s.describe());
    }
    Ok(())
}

/// A server (`inetd carried-vfork`) that gives a carried connection to a
/// `vfork` child that execs `stdecho go` (the child demotes it and leaves
/// the library's descriptor of it to the parent to close), then, before
/// any other call, runs another `vfork` child (`true`), then closes its
/// copy: the second child's exec must not forget the parent's leftover
/// descriptor (before the fix, it closed it in its own table only and
/// cleared the parent's record, so the client never read the end while
/// the server lived).
#[test]
fn a_second_vfork_child_does_not_forget_the_parents_leftover_descriptor() -> Result<()> {
    let _one = harness::one_at_a_time();
    let d = DaemonProc::start()?;
    let ctx = d.context()?;
    let port = free_port();
    let s = spawn(sockapp(&d, &["inetd".into(), port.to_string(), "carried-vfork".into()], &[]), "inetd");
    vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
        listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
    })?;
    let args = ["goclient".into(), port.to_string(), BYTES.to_string(), "read".into()];
    let c = spawn(sockapp(&d, &args, &[]), "goclient").finish(Duration::from_secs(20));
    let _ = std::net::TcpStream::connect(("127.0.0.1", port));
    let s = s.finish(LIMIT);
    handed_over(&c, &s);
    assert!(s.stderr.contains("an exec that did not replace this memory: closed"), "{}", s.describe());
    Ok(())
}

/// A `vfork` child `dup2`s a carried connection onto its stdin and stdout
/// and execs, its demotion unanswered (the client makes no call in the
/// wait): the program does not get it, and the parent's own stdout is
/// still its own (before, the child's `dup2` had mapped the parent's
/// descriptor 1 to the carried connection in the shared table: the
/// parent's line went to the client).
#[test]
fn a_vfork_childs_dup2_does_not_change_its_parents_descriptors() -> Result<()> {
    let (c, s) = go_inetd(
        "carried-vfork-late",
        "late",
        &[("VRDMA_SOCKETS_WAIT_MS", "300")],
        &[("SOCKAPP_GO_DELAY_MS", "2500")],
    )?;
    s.assert_ok();
    assert!(s.stderr.contains("did not answer the demotion in time"), "{}", s.describe());
    assert!(s.stderr.contains("stdecho: stdin is no socket"), "{}", s.describe());
    assert!(s.stdout.contains("the parent's stdout is its own"), "{}\n{}", s.describe(), c.describe());
    Ok(())
}

/// A Python server that echoes a first chunk on a carried connection
/// (its library carries it), then runs a program with the socket as its
/// stdin and stdout through `subprocess` (`_posixsubprocess` `dup2`s it
/// in a `vfork`ed child, which shares the parent's memory, and execs
/// there): the child demotes the connection, the program gets it and
/// echoes the rest, and the parent, which then finds it plain TCP, closes
/// it: the client reads the end while the parent lives on, also when the
/// parent ran another program (a second `vfork` child) before its close.
#[test]
fn a_python_server_running_a_program_through_subprocess_on_a_carried_connection_hands_it_over() -> Result<()>
{
    const SERVER: &str = "import socket, subprocess, sys
l = socket.socket()
l.bind(('127.0.0.1', int(sys.argv[1])))
l.listen()
print('listening', flush=True)
c, _ = l.accept()
n = 0
while n < 16384:
    b = c.recv(16384 - n)
    if not b:
        sys.exit(3)
    c.sendall(b)
    n += len(b)
r = subprocess.run([sys.argv[2], 'stdecho', 'go'], stdin=c, stdout=c)
if sys.argv[3] == 'again':
    # Another vfork child, whose exec must not forget for the parent the
    # library's descriptor that the first one left.
    subprocess.run(['true'])
c.close()
# Alive until the test is done with the client (a second connection).
l.accept()
sys.exit(r.returncode)
";
    let _one = harness::one_at_a_time();
    let d = DaemonProc::start()?;
    let ctx = d.context()?;
    // `again`: the parent runs another program (`true`, a second vfork
    // child) before its close.
    for then in ["close", "again"] {
        let exe = vrdma_it::peer_exe().with_file_name("vrdma-it-sockapp");
        let (s, port) = python_listening(&ctx, |port| {
            let mut py = Command::new("python3");
            py.args(["-c", SERVER, &port.to_string()])
                .arg(&exe)
                .arg(then)
                .env(vrdma::SOCKET_ENV, &d.socket)
                .env("VRDMA_SOCKETS_DEBUG", "1")
                .env("LD_PRELOAD", built("libvrdma_sockets.so"));
            py
        })?;
        let args = ["goclient".into(), port.to_string(), BYTES.to_string(), "read".into()];
        // The client reads the end while the server lives on (the kernel
        // socket has no holder left: not the library's own descriptor in
        // the parent either).
        let c = spawn(sockapp(&d, &args, &[]), "goclient").finish(Duration::from_secs(20));
        let _ = std::net::TcpStream::connect(("127.0.0.1", port));
        let s = s.finish(LIMIT);
        handed_over(&c, &s);
    }
    Ok(())
}

/// Why both ends send their hello before they read the other's (the
/// order the exec settling relies on, `docs/sockets.md`): a server that
/// speaks first, to a client that waits in `poll` for the banner before
/// its first call, wakes it with its hello. A server that read the
/// client's hello first would wait for a call the client does not make,
/// until its 10 s bound, and fail.
#[test]
fn a_server_that_speaks_first_wakes_a_client_polling_before_its_first_call() -> Result<()> {
    let _one = harness::one_at_a_time();
    let d = DaemonProc::start()?;
    let ctx = d.context()?;
    let port = free_port();
    let s = spawn(sockapp(&d, &["banner".into(), port.to_string()], &[]), "banner");
    vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
        listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
    })?;
    let c = spawn(sockapp(&d, &["pollbanner".into(), port.to_string()], &[]), "pollbanner").finish(LIMIT);
    let s = s.finish(LIMIT);
    c.assert_ok();
    s.assert_ok();
    assert!(c.stderr.contains(CARRIED) && s.stderr.contains(CARRIED), "{}\n{}", c.describe(), s.describe());
    Ok(())
}

/// A master that listens and starts a worker program (fork and exec) on
/// its inherited listening socket, which accepts: the worker's library
/// did not register the listener (the master's did) and registers it at
/// its first accept, and claims the connection, so it is carried. Before
/// this, nobody claimed it: the client waited its whole claim wait (here
/// 20 s) and fell back to TCP.
#[test]
fn a_worker_program_execd_on_an_inherited_listener_carries_what_it_accepts() -> Result<()> {
    let _one = harness::one_at_a_time();
    let d = DaemonProc::start()?;
    let ctx = d.context()?;
    let port = free_port();
    let s = spawn(sockapp(&d, &["execlisten".into(), port.to_string()], &[]), "execlisten");
    vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
        listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
    })?;
    let args = ["echoclient".into(), port.to_string(), BYTES.to_string()];
    let start = std::time::Instant::now();
    let c = spawn(sockapp(&d, &args, &[("VRDMA_SOCKETS_WAIT_MS", "20000")]), "echoclient").finish(LIMIT);
    let took = start.elapsed();
    let s = s.finish(LIMIT);
    c.assert_ok();
    s.assert_ok();
    assert!(c.stdout.contains(&format!("echoed {BYTES}, then the end")), "{}", c.describe());
    assert!(s.stdout.contains(&format!("echoed {BYTES}")), "{}", s.describe());
    assert!(c.stderr.contains(CARRIED) && s.stderr.contains(CARRIED), "{}\n{}", c.describe(), s.describe());
    assert!(took < Duration::from_secs(20), "the client waited {took:?} for a claim");
    Ok(())
}

/// A `vfork` child that `dup2`s a carried connection onto its stdin,
/// closes it and leaves by `_exit` without an exec (`if (chdir(d) < 0)
/// _exit(1);`) gives its parent's table back: the parent, after two such
/// children, echoes the rest of the stream on the connection, still
/// carried, every byte checked by the client. (Before, the parent's entry
/// stayed set aside: its reads went to the kernel socket under the rings,
/// and the second child's exit put an old entry back.)
#[test]
fn a_vfork_child_that_exits_without_exec_leaves_its_parents_connection_whole() -> Result<()> {
    let (c, s, _) = inetd("carried-vfork-exit", &[], &[])?;
    c.assert_ok();
    s.assert_ok();
    assert!(s.stderr.contains(CARRIED) && c.stderr.contains(CARRIED), "{}\n{}", c.describe(), s.describe());
    assert!(c.stdout.contains(&format!("echoed {BYTES}, then the end")), "{}", c.describe());
    assert!(
        s.stderr.contains(&format!("echoed {} more after the vfork children", BYTES - 16384)),
        "{}",
        s.describe()
    );
    Ok(())
}

/// As the wrapping case, with an exec'd program that takes 11 s before it
/// reads its stdin (longer than the old 10 s limit on the client's
/// library's resend, which then reset the connection), and the kernel
/// buffers of both ends shrunk so that the resend cannot fit: it waits
/// for it, as a blocking TCP write would, and every byte comes back.
#[test]
fn a_resend_waits_for_a_slow_exec_d_program() -> Result<()> {
    let first = (240 * 1024).to_string();
    let unread = (192 * 1024).to_string();
    let server = [
        ("SOCKAPP_BEFORE_EXEC_MS", "500"),
        ("SOCKAPP_ECHO_FIRST", first.as_str()),
        ("STDECHO_DELAY_MS", "11000"),
        ("SOCKAPP_RAW_RCVBUF", "4096"),
    ];
    let client = [
        ("SOCKAPP_ECHO_FIRST", first.as_str()),
        ("SOCKAPP_UNREAD", unread.as_str()),
        ("SOCKAPP_RAW_SNDBUF", "4096"),
    ];
    let (c, s) = go_inetd("carried-exec", "bulk", &server, &client)?;
    c.assert_ok();
    s.assert_ok();
    assert!(s.stderr.contains("demoted to plain TCP for the exec'd program"), "{}", s.describe());
    assert!(c.stdout.contains(&format!("echoed {BYTES}, then the end")), "{}", c.describe());
    Ok(())
}

/// As the slow case, with an exec'd program that writes 8 MiB before it
/// reads (`cat big; cat`), both ends' kernel buffers shrunk: the
/// client's library sends what the kernel takes of its resend and queues
/// the rest, so its reads go on and take the program's 8 MiB, the
/// program then reads the resend, and a thread of the client that writes
/// the rest of the pattern meanwhile (blocking writes, then non-blocking
/// ones with `poll`, then with an edge-triggered `EPOLLOUT`) has its bytes after the resent ones, every byte
/// checked, then the end. Before: both waited for ever (the test killed
/// at 60 s), then the deadlock guess reset the connection.
#[test]
fn a_resend_to_a_program_that_writes_before_it_reads_completes_byte_exact() -> Result<()> {
    for writer in ["blocking", "nonblocking", "epoll"] {
        let (c, s) = written_first(8 << 20, None, writer)?;
        assert!(
            c.stdout.contains(&format!("echoed {BYTES} after {} written first", 8 << 20)),
            "{}",
            c.describe()
        );
        assert!(s.stderr.contains(&format!("stdecho {}", BYTES - 240 * 1024)), "{}", s.describe());
    }
    Ok(())
}

/// An exec'd program that writes 64 KiB, then sleeps 5 s before it reads
/// (a healthy connection: plain TCP delivers everything): not reset,
/// every byte arrives both ways. Before, the deadlock guess took it for
/// a deadlock after 3 s and reset it.
#[test]
fn a_resend_to_a_program_that_writes_then_sleeps_before_it_reads_is_not_reset() -> Result<()> {
    let (c, s) = written_first(256 << 10, Some("5000"), "blocking")?;
    assert!(
        c.stdout.contains(&format!("echoed {BYTES} after {} written first", 256 << 10)),
        "{}",
        c.describe()
    );
    assert!(s.stderr.contains(&format!("stdecho {}", BYTES - 240 * 1024)), "{}", s.describe());
    assert!(!c.stderr.contains("the connection is reset"), "{}", c.describe());
    Ok(())
}

/// As the program that writes before it reads, the client shutting its
/// write side right after the go byte, while its resend is still queued:
/// the FIN waits until the queue is sent, so the program reads every
/// resent byte, then the end, and echoes them (the client reads them,
/// then the end).
#[test]
fn a_shutdown_while_the_resend_is_queued_sends_the_fin_after_it() -> Result<()> {
    let (c, s) = written_first(256 << 10, Some("2000"), "shut")?;
    let upto = 240 * 1024 + 192 * 1024;
    assert!(
        c.stdout.contains(&format!("echoed {upto} after {} written first", 256 << 10)),
        "{}",
        c.describe()
    );
    assert!(s.stderr.contains(&format!("stdecho {}", 192 * 1024)), "{}", s.describe());
    assert!(c.stderr.contains("bytes sent again after the marker, "), "{}", c.describe());
    Ok(())
}

/// As the shutdown, the client closing the connection once it read the
/// program's bytes, its resend still queued (the program sleeps before
/// it reads): the close sends the queue first, so the program reads every
/// resent byte, then a clean end. The same where the client exits (no
/// close: the library's `atexit` handler sends it, within
/// `VRDMA_SOCKETS_WAIT_MS`).
#[test]
fn a_close_or_exit_while_the_resend_is_queued_sends_it_first() -> Result<()> {
    for way in ["close", "exit"] {
        let first = (240 * 1024).to_string();
        let unread = (192 * 1024).to_string();
        let wf = (256 << 10).to_string();
        let server = [
            ("SOCKAPP_BEFORE_EXEC_MS", "500"),
            ("SOCKAPP_ECHO_FIRST", first.as_str()),
            ("STDECHO_WRITE_FIRST", wf.as_str()),
            ("STDECHO_DELAY_AFTER_WRITE_MS", "2000"),
            ("STDECHO_COUNT_ONLY", "1"),
            ("SOCKAPP_RAW_RCVBUF", "4096"),
        ];
        let client = [
            ("SOCKAPP_ECHO_FIRST", first.as_str()),
            ("SOCKAPP_UNREAD", unread.as_str()),
            ("SOCKAPP_RAW_SNDBUF", "4096"),
            ("SOCKAPP_WRITTEN_FIRST", wf.as_str()),
            ("SOCKAPP_WRITER", way),
            // The exit's bound (the 4 KiB buffers make the resend slow).
            ("VRDMA_SOCKETS_WAIT_MS", "30000"),
        ];
        let (c, s) = go_inetd("carried-exec", "bulk", &server, &client)?;
        c.assert_ok();
        s.assert_ok();
        let said = if way == "close" { "closed" } else { "exits" };
        assert!(c.stdout.contains(&format!("{said} after {wf} written first")), "{way}: {}", c.describe());
        assert!(queued_some(&c.stderr), "{way}: {}", c.describe());
        assert!(
            s.stderr.contains(&format!("stdecho read {}", 192 * 1024)),
            "{way}: {}\n{}",
            s.describe(),
            c.describe()
        );
    }
    Ok(())
}

/// As the close or exit while the resend is queued, the program there
/// sleeping far longer (8 s) than the client's bound
/// (`VRDMA_SOCKETS_WAIT_MS` 300): the close (or exit) does not wait for
/// it, and since the queue is not all sent, the connection is reset: the
/// program reads an error, never a clean, short stream (review M3, M1's
/// exit case). Before: the close blocked until the program read (no
/// bound), and the exit ended with a FIN behind a truncated resend. The
/// same where the client execs `/bin/true` (the connection close-on-exec,
/// review M1): before, nothing flushed the queue and the kernel's close
/// was a FIN, the program reading a clean, short stream.
#[test]
fn a_close_or_exit_that_cannot_send_the_queue_within_the_bound_resets() -> Result<()> {
    for way in ["close", "exit", "execs"] {
        let (c, s) = queued_against(
            way,
            &[("STDECHO_DELAY_AFTER_WRITE_MS", "8000")],
            &[("VRDMA_SOCKETS_WAIT_MS", "300")],
        )?;
        c.assert_ok();
        assert!(queued_some(&c.stderr), "{way}: {}", c.describe());
        assert!(c.stderr.contains("the connection is reset"), "{way}: {}", c.describe());
        assert!(!s.stderr.contains("stdecho read "), "{way}: {}\n{}", s.describe(), c.describe());
        assert!(s.stderr.contains("Connection reset by peer"), "{way}: {}\n{}", s.describe(), c.describe());
    }
    Ok(())
}

/// The client ends by `_exit` (no handler of the library runs: as a
/// fatal signal or `SIGKILL`) while the resend is queued, after setting a
/// linger of its own (1, 5 s): the kernel's close resets the connection
/// (the socket lingers 0 while the queue holds bytes), so the program
/// there reads an error, never a clean end behind a truncated resend; and
/// the client read back the linger it set. Before (session 35): a FIN,
/// the program reading a short stream as whole.
#[test]
fn an_end_that_runs_no_handler_while_the_resend_is_queued_resets() -> Result<()> {
    let (c, s) = queued_against("_exit", &[("STDECHO_DELAY_AFTER_WRITE_MS", "2000")], &[])?;
    c.assert_ok();
    assert!(queued_some(&c.stderr), "{}", c.describe());
    assert!(c.stdout.contains("linger set 0 got 0: 1 5"), "{}", c.describe());
    assert!(c.stdout.contains("_exits after"), "{}", c.describe());
    assert!(!s.stderr.contains("stdecho read "), "{}\n{}", s.describe(), c.describe());
    assert!(s.stderr.contains("Connection reset by peer"), "{}\n{}", s.describe(), c.describe());
    Ok(())
}

/// The program there exits without reading while the resend is queued
/// (its close with bytes unread is a reset): the library's push meets the
/// reset, and the client's next read gets `ECONNRESET`, not a clean end
/// (review M2: the failing send consumed the socket's error and the
/// connection went on as plain TCP, so the read returned 0).
#[test]
fn a_reset_met_by_the_queue_push_is_the_programs_next_error() -> Result<()> {
    // (A second after its writes, so that they all arrive first: its
    // close's reset drops what it has not sent yet; the client's read
    // comes three seconds after them.)
    // `readblock`: the read is made at once, blocked in it when the reset
    // comes (review M2's reader: woken with 0 after the push took the
    // error; the kernel mostly hands the blocked reader the reset itself,
    // so that case seldom fails without the fix).
    for way in ["readend", "readblock"] {
        let (c, _s) = queued_against(
            way,
            &[("STDECHO_EXIT_AFTER_WRITE", "1"), ("STDECHO_DELAY_AFTER_WRITE_MS", "1000")],
            &[],
        )?;
        c.assert_ok();
        assert!(queued_some(&c.stderr), "{way}: {}", c.describe());
        assert!(c.stdout.contains("then a read: Err(Some(104))"), "{way}: {}", c.describe());
    }
    Ok(())
}

/// The client's descriptor 2 is the connection itself (`dup2`) while a
/// blocking writer of it waits behind the queue; the program there ends
/// a second after its writes without reading: the writer's push meets
/// the reset, and the library's warning goes to descriptor 2, through the
/// library, into the same connection. The writer's call gets the error
/// (`ECONNRESET`) at its first byte, and nothing hangs (session 35,
/// review M1: the warning was written under the queue's lock, before
/// the queue's count was 0, so its write waited behind the queue for
/// that lock: the writer hung for ever, `the writer hangs`).
#[test]
fn a_warning_on_stderr_that_is_the_connection_whose_push_fails_does_not_hang() -> Result<()> {
    let (c, _s) = queued_against(
        "stderr",
        &[("STDECHO_EXIT_AFTER_WRITE", "1"), ("STDECHO_DELAY_AFTER_WRITE_MS", "1000")],
        &[],
    )?;
    assert!(queued_some(&c.stderr), "{}", c.describe());
    assert!(!c.stdout.contains("the writer hangs"), "{}", c.describe());
    // The warning went into the connection (descriptor 2 then), not to
    // the captured stderr: the test took the path it is about.
    assert!(!c.stderr.contains("the rest of a resend"), "{}", c.describe());
    let at = 240 * 1024 + 192 * 1024;
    assert!(
        c.stdout.contains(&format!("the writer: Err(\"write at {at}: Connection reset by peer")),
        "{}",
        c.describe()
    );
    c.assert_ok();
    Ok(())
}

/// The resend queued (the program there writes 16 KiB before it reads),
/// the client's `execv` of a path that does not exist fails: the exec's
/// flush of the queue reads nothing (session 35, review M2: it read and
/// dropped the program's bytes while it waited for room, and the client,
/// living on after the failed exec, read a clean end after fewer of
/// them). Now every one of the program's bytes is read after the failed
/// exec, and the program reads the whole resend.
#[test]
fn an_exec_that_fails_after_the_queue_is_flushed_loses_no_incoming_bytes() -> Result<()> {
    // (16 KiB: held by the client's receive buffer whatever the defaults,
    // so that the program there goes on to read the resend.)
    let wf = 16 * 1024;
    let first = (240 * 1024).to_string();
    let unread = (192 * 1024).to_string();
    let wfs = wf.to_string();
    let server = [
        ("SOCKAPP_BEFORE_EXEC_MS", "500"),
        ("SOCKAPP_ECHO_FIRST", first.as_str()),
        ("STDECHO_WRITE_FIRST", wfs.as_str()),
        ("STDECHO_COUNT_ONLY", "1"),
        ("SOCKAPP_RAW_RCVBUF", "4096"),
    ];
    let client = [
        ("SOCKAPP_ECHO_FIRST", first.as_str()),
        ("SOCKAPP_UNREAD", unread.as_str()),
        ("SOCKAPP_RAW_SNDBUF", "4096"),
        ("SOCKAPP_WRITTEN_FIRST", wfs.as_str()),
        ("SOCKAPP_WRITER", "execfail"),
        // The exec's bound (the 4 KiB buffers make the resend slow).
        ("VRDMA_SOCKETS_WAIT_MS", "30000"),
    ];
    let (c, s) = go_inetd("carried-exec", "bulk", &server, &client)?;
    assert!(queued_some(&c.stderr), "{}", c.describe());
    assert!(c.stderr.contains("execv of /no/such failed"), "{}", c.describe());
    c.assert_ok();
    s.assert_ok();
    assert!(c.stdout.contains(&format!("closed after {wf} written first")), "{}", c.describe());
    assert!(s.stderr.contains(&format!("stdecho read {}", 192 * 1024)), "{}\n{}", s.describe(), c.describe());
    assert!(!c.stderr.contains("dropped unread"), "{}", c.describe());
    Ok(())
}

/// As [`an_exec_that_fails_after_the_queue_is_flushed_loses_no_incoming_bytes`],
/// the program there reading nothing for 5 s, so that the exec's flush
/// is cut short (`VRDMA_SOCKETS_WAIT_MS` 300: a second) and the
/// connection reset, whose `connect(AF_UNSPEC)` fails (a test knob: its
/// fallback, a linger of 0, leaves the connection up until the close).
/// The client lives on after the failed exec: its write and its shutdown
/// fail, and nothing goes out behind the bytes dropped (session 35,
/// second review M3: the write went out on the live socket behind the
/// hole, `Ok(1)`, and the shutdown's FIN after it); the program there
/// reads a reset, never a clean end.
#[test]
fn a_reset_that_cannot_disconnect_leaves_no_gap_for_a_program_living_on() -> Result<()> {
    let first = (240 * 1024).to_string();
    let unread = (192 * 1024).to_string();
    let wfs = (16 * 1024).to_string();
    let server = [
        ("SOCKAPP_BEFORE_EXEC_MS", "500"),
        ("SOCKAPP_ECHO_FIRST", first.as_str()),
        ("STDECHO_WRITE_FIRST", wfs.as_str()),
        ("STDECHO_DELAY_AFTER_WRITE_MS", "5000"),
        ("STDECHO_COUNT_ONLY", "1"),
        ("SOCKAPP_RAW_RCVBUF", "4096"),
    ];
    let client = [
        ("SOCKAPP_ECHO_FIRST", first.as_str()),
        ("SOCKAPP_UNREAD", unread.as_str()),
        ("SOCKAPP_RAW_SNDBUF", "4096"),
        ("SOCKAPP_WRITTEN_FIRST", wfs.as_str()),
        ("SOCKAPP_WRITER", "execfail"),
        ("SOCKAPP_EXECFAIL_WRITE", "1"),
        ("VRDMA_SOCKETS_WAIT_MS", "300"),
        ("VRDMA_SOCKETS_TEST_PAUSE", "reset-falls-back:0"),
    ];
    let (c, s) = go_inetd("carried-exec", "bulk", &server, &client)?;
    assert!(queued_some(&c.stderr), "{}", c.describe());
    assert!(c.stderr.contains("execv of /no/such failed"), "{}", c.describe());
    assert!(c.stderr.contains("an exec with"), "the flush was not cut short: {}", c.describe());
    let (reset, notconn) = (libc::ECONNRESET, libc::ENOTCONN);
    assert!(
        c.stderr.contains(&format!(
            "after the failed exec, a write: Err(Some({reset})), the shutdown: Err(Some({notconn}))"
        )),
        "{}",
        c.describe()
    );
    let finished =
        s.stderr.lines().any(|l| l.strip_prefix("stdecho read ").is_some_and(|k| k.parse::<u64>().is_ok()));
    assert!(!finished, "{}", s.describe());
    Ok(())
}

/// The resend queued (the program there writes 8 MiB before it reads),
/// the client runs `true` twice, by a `Command` (`posix_spawnp`) and by
/// `system`, before it reads anything, a blocking writer of it behind the
/// queue meanwhile: the client goes on living, so the spawns leave the
/// queue alone, and the exchange completes byte-exact, no reset (review
/// H-new: the spawn's settle flushed the queue as an exec's would,
/// reading and dropping the program's bytes while it waited for room, or
/// resetting the connection when the writer held the queue past the
/// bound).
#[test]
fn a_program_spawned_while_the_resend_is_queued_leaves_the_queue_alone() -> Result<()> {
    let (c, s) = written_first(8 << 20, None, "spawn")?;
    assert!(queued_some(&c.stderr), "{}", c.describe());
    assert!(c.stderr.contains("spawned: exit status: 0, system: 0"), "{}", c.describe());
    assert!(
        c.stdout.contains(&format!("echoed {BYTES} after {} written first, then the end", 8 << 20)),
        "{}",
        c.describe()
    );
    assert!(s.stderr.contains(&format!("stdecho {}", BYTES - 240 * 1024)), "{}", s.describe());
    assert!(!c.stderr.contains("the connection is reset"), "{}", c.describe());
    Ok(())
}

/// The resend queued (the program there writes 8 MiB before it reads),
/// a blocking writer behind it, the client makes a `vfork` child that
/// calls `exit` (not `_exit`) before it reads anything: the exit
/// handlers run in the client's memory, and the library's one leaves the
/// queue alone (it is the parent's, which lives on); the exchange
/// completes byte-exact, no reset (session 35, review low: the child's
/// handler flushed the parent's queue, and with the writer holding it,
/// reset the connection past the bound).
#[test]
fn a_vfork_child_that_calls_exit_leaves_its_parents_queue_alone() -> Result<()> {
    let (c, s) = written_first(8 << 20, None, "vforkexit")?;
    assert!(queued_some(&c.stderr), "{}", c.describe());
    assert!(c.stderr.contains("a vfork child called exit: 5"), "{}", c.describe());
    assert!(
        c.stdout.contains(&format!("echoed {BYTES} after {} written first, then the end", 8 << 20)),
        "{}",
        c.describe()
    );
    assert!(s.stderr.contains(&format!("stdecho {}", BYTES - 240 * 1024)), "{}", s.describe());
    assert!(!c.stderr.contains("the connection is reset"), "{}", c.describe());
    Ok(())
}

/// The resend queued, the client forks a child that keeps the
/// descriptor (it makes no call on it) and closes its own, while the
/// program there sleeps 10 s without reading or writing: the close
/// demotes this end for the child, its queue first, and that send is
/// bounded by `VRDMA_SOCKETS_WAIT_MS` (300): past it, the connection is
/// reset, and the program reads an error, not the resend (review M3
/// after fork: the close waited with no bound, until the program read).
#[test]
fn a_close_after_fork_that_cannot_send_the_queue_within_the_bound_resets() -> Result<()> {
    let (c, s) = queued_against(
        "forkclose",
        &[("STDECHO_DELAY_AFTER_WRITE_MS", "10000")],
        &[("VRDMA_SOCKETS_WAIT_MS", "300")],
    )?;
    c.assert_ok();
    assert!(queued_some(&c.stderr), "{}", c.describe());
    assert!(c.stdout.contains("closed with a forked child holding it"), "{}", c.describe());
    assert!(!s.stderr.contains("stdecho read "), "{}\n{}", s.describe(), c.describe());
    assert!(s.stderr.contains("Connection reset by peer"), "{}\n{}", s.describe(), c.describe());
    Ok(())
}

/// A blocking writer waits behind the queue (the program there sleeps
/// 4 s before it reads); `shutdown(SHUT_RDWR)` from another thread does
/// not wait for the writer's hold on the queue, and the writer's write
/// fails with `EPIPE` at once, at its first byte (review M3). Before:
/// the shutdown waited until the queue was sent, and the writer's first
/// write went through.
#[test]
fn a_shutdown_does_not_wait_for_a_writer_behind_the_queue_and_fails_its_write() -> Result<()> {
    let (c, _s) = queued_against(
        "abort",
        &[("STDECHO_DELAY_AFTER_WRITE_MS", "4000")],
        &[("VRDMA_SOCKETS_WAIT_MS", "300")],
    )?;
    c.assert_ok();
    assert!(queued_some(&c.stderr), "{}", c.describe());
    assert!(c.stdout.contains("shut down while the writer waits"), "{}", c.describe());
    let at = 240 * 1024 + 192 * 1024;
    assert!(c.stdout.contains(&format!("the writer: Err(\"write at {at}: Broken pipe")), "{}", c.describe());
    Ok(())
}

/// The resend queued, the client forks a child that writes on the
/// connection while the parent waits for it without reading: the
/// parent's end is demoted for the child, and its queue must go first,
/// synchronously (the deadlock guess: the program there writes 8 MiB
/// before it reads, so nothing moves); the guess ends it, and the
/// connection is reset: the program there gets an error, never a stream
/// with the rest of the resend missing (review H1: the connection went
/// on as plain TCP, and the program read a short stream, no error).
#[test]
fn a_queue_whose_flush_fails_before_this_ends_demotion_resets() -> Result<()> {
    let wf = (8 << 20).to_string();
    let first = (240 * 1024).to_string();
    let unread = (192 * 1024).to_string();
    let server = [
        ("SOCKAPP_BEFORE_EXEC_MS", "500"),
        ("SOCKAPP_ECHO_FIRST", first.as_str()),
        ("STDECHO_WRITE_FIRST", wf.as_str()),
        ("STDECHO_COUNT_ONLY", "1"),
        ("SOCKAPP_RAW_RCVBUF", "4096"),
    ];
    let client = [
        ("SOCKAPP_ECHO_FIRST", first.as_str()),
        ("SOCKAPP_UNREAD", unread.as_str()),
        ("SOCKAPP_RAW_SNDBUF", "4096"),
        ("SOCKAPP_WRITTEN_FIRST", wf.as_str()),
        ("SOCKAPP_WRITER", "fork"),
    ];
    let (c, s) = go_inetd("carried-exec", "bulk", &server, &client)?;
    c.assert_ok();
    assert!(queued_some(&c.stderr), "{}", c.describe());
    assert!(c.stdout.contains("after the fork: "), "{}", c.describe());
    assert!(!s.stderr.contains("stdecho read "), "{}\n{}", s.describe(), c.describe());
    assert!(s.stderr.contains("Connection reset by peer"), "{}\n{}", s.describe(), c.describe());
    Ok(())
}

/// The `bulk` exchange with a resend queued at the client (4 KiB
/// buffers, a program that writes 256 KiB before it reads), the client's
/// writer `way`, more environment for each side.
fn queued_against(
    way: &str,
    server_more: &[(&str, &str)],
    client_more: &[(&str, &str)],
) -> Result<(Finished, Finished)> {
    let mut server = vec![("STDECHO_COUNT_ONLY", "1")];
    server.extend_from_slice(server_more);
    bulk_against_written_first(256 << 10, way, &server, client_more)
}

/// The `bulk` exchange against a program that writes `wf` bytes first
/// (then sleeps `sleep_ms`), the client's later writes by `writer`.
fn written_first(wf: u64, sleep_ms: Option<&str>, writer: &str) -> Result<(Finished, Finished)> {
    let server: Vec<_> = sleep_ms.map(|ms| ("STDECHO_DELAY_AFTER_WRITE_MS", ms)).into_iter().collect();
    let (c, s) = bulk_against_written_first(wf, writer, &server, &[])?;
    c.assert_ok();
    s.assert_ok();
    assert!(s.stderr.contains("demoted to plain TCP for the exec'd program"), "{}", s.describe());
    Ok((c, s))
}

/// The `bulk` exchange (240 KiB echoed, 192 KiB left unread) against a
/// program that writes `wf` bytes before it reads, 4 KiB kernel buffers
/// on both sides, the client's writer `way`; and `server_more`,
/// `client_more` in their environments.
fn bulk_against_written_first(
    wf: u64,
    way: &str,
    server_more: &[(&str, &str)],
    client_more: &[(&str, &str)],
) -> Result<(Finished, Finished)> {
    let first = (240 * 1024).to_string();
    let unread = (192 * 1024).to_string();
    let wf = wf.to_string();
    let mut server = vec![
        ("SOCKAPP_BEFORE_EXEC_MS", "500"),
        ("SOCKAPP_ECHO_FIRST", first.as_str()),
        ("STDECHO_WRITE_FIRST", wf.as_str()),
        ("SOCKAPP_RAW_RCVBUF", "4096"),
    ];
    server.extend_from_slice(server_more);
    let mut client = vec![
        ("SOCKAPP_ECHO_FIRST", first.as_str()),
        ("SOCKAPP_UNREAD", unread.as_str()),
        ("SOCKAPP_RAW_SNDBUF", "4096"),
        ("SOCKAPP_WRITTEN_FIRST", wf.as_str()),
        ("SOCKAPP_WRITER", way),
    ];
    client.extend_from_slice(client_more);
    go_inetd("carried-exec", "bulk", &server, &client)
}

/// A program whose first child, before any other call of interest, is
/// made by `vfork` and leaves by `_exit` (or execs `true`), then carries
/// a connection, echoes it to the end and closes it: the client reads
/// the end. (Before, the child stored its own id as the parent's cached
/// one, shared memory: the parent then took itself for a `vfork` child
/// for good, and its close was set aside: the client never read the end.)
#[test]
fn a_first_vfork_child_does_not_take_its_parents_id() -> Result<()> {
    for mode in ["vfork-first-exit", "vfork-first-exec"] {
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let port = free_port();
        let s = spawn(sockapp(&d, &["inetd".into(), port.to_string(), mode.into()], &[]), "inetd");
        vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
            listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
        })?;
        let args = ["echoclient".into(), port.to_string(), BYTES.to_string()];
        // The client reads the end while the server lives on.
        let c = spawn(sockapp(&d, &args, &[]), "echoclient").finish(Duration::from_secs(20));
        let _ = std::net::TcpStream::connect(("127.0.0.1", port));
        let s = s.finish(LIMIT);
        c.assert_ok();
        s.assert_ok();
        assert!(
            s.stderr.contains(CARRIED) && c.stderr.contains(CARRIED),
            "{mode}: {}\n{}",
            c.describe(),
            s.describe()
        );
        assert!(c.stdout.contains(&format!("echoed {BYTES}, then the end")), "{mode}: {}", c.describe());
        assert!(
            s.stderr.contains(&format!("echoed {BYTES} after a first vfork child")),
            "{mode}: {}",
            s.describe()
        );
    }
    Ok(())
}

/// A Python server (`make(port)`) that listens on a free port and is
/// registered at the daemon: tried again on another port when it exits
/// first (a port taken between the look and its bind); where it does not
/// listen, its output and what was seen are the error.
fn python_listening(ctx: &vrdma::Context, make: impl Fn(u16) -> Command) -> Result<(harness::Running, u16)> {
    let mut last = String::new();
    for _ in 0..3 {
        let port = free_port();
        let mut s = spawn(make(port), "python server");
        let end = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let listeners = ctx.sock_counts().ok().map(|c| c.listeners);
            if listening(port) && listeners == Some(1) {
                return Ok((s, port));
            }
            if s.exited() || std::time::Instant::now() > end {
                let seen = format!("port {port} listening: {}, listeners: {listeners:?}", listening(port));
                let f = s.finish(Duration::from_millis(200));
                last = format!("the python server did not listen ({seen}): {}", f.describe());
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        if !last.contains("Address already in use") {
            break;
        }
    }
    anyhow::bail!("{last}")
}
