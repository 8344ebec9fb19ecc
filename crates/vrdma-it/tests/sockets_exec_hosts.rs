//! `exec` of a carried connection across two hosts (`docs/sockets.md`,
//! "Exec", and "Other hosts"): two network namespaces joined by a veth
//! pair, one daemon in each (`NetnsHosts`), the process that execs (D) on
//! one host and its peer (P) on the other, both under the preload
//! library. D demotes the connection to plain TCP at an exact byte before
//! its exec; the bytes D had not read are sent again by P, which reads
//! them back from D's ring by an RDMA read, here across the daemons' link.
//! The one-host cases are `sockets_exec.rs`; each test here makes and
//! removes its own namespaces (skipped, with a notice, without root or
//! iproute2).

use std::process::Command;
use std::time::Duration;

use anyhow::Result;
use vrdma_it::harness::{self, built, free_port, spawn, Finished, Running};
use vrdma_it::{DaemonProc, NetnsHosts};

/// Echoed through the exec'd program: four rings' worth, in 16 KiB round
/// trips checked byte by byte.
const BYTES: u64 = 1 << 20;
const LIMIT: Duration = Duration::from_secs(60);
const CARRIED: &str = "carried over vRDMA";
const DEMOTED: &str = "demoted to plain TCP for the exec'd program";

/// The sockets test program in host `i`'s namespace, on that host's
/// daemon, preloaded, with `env`.
fn sockapp(h: &NetnsHosts, i: usize, args: &[String], env: &[(&str, &str)]) -> Command {
    let exe = vrdma_it::peer_exe().with_file_name("vrdma-it-sockapp");
    let d: &DaemonProc = if i == 0 { &h.a } else { &h.b };
    let mut c = Command::new("ip");
    c.args(["netns", "exec", &h.net.ns[i]])
        .arg(exe)
        .args(args)
        .env(vrdma::SOCKET_ENV, &d.socket)
        .env("VRDMA_SOCKETS_DEBUG", "1")
        .env("LD_PRELOAD", built("libvrdma_sockets.so"));
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

/// Whether a socket of process `pid`'s network namespace listens on `port`
/// (its /proc/PID/net/tcp: the test's own namespace is another).
fn listening_in(pid: i32, port: u16) -> bool {
    let want = format!(":{port:04X}");
    std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap_or_default().lines().skip(1).any(|l| {
        let cols: Vec<&str> = l.split_whitespace().collect();
        cols.len() > 3 && cols[1].ends_with(&want) && cols[3] == "0A"
    })
}

/// `sockapp SERVER PORT ARGS..` in host b (on every address, its listener
/// registered at b's daemon) and `sockapp CLIENT PORT ARGS..` in host a
/// towards b's address, each with its environment; both run to their ends
/// (bounded). Returns the client's and the server's output.
fn across(
    h: &NetnsHosts,
    server: &[&str],
    server_env: &[(&str, &str)],
    client: &[&str],
    client_env: &[(&str, &str)],
) -> Result<(Finished, Finished)> {
    let ctx = h.b.context()?;
    let port = free_port();
    let args = |a: &[&str]| -> Vec<String> {
        let mut v = vec![a[0].to_string(), port.to_string()];
        v.extend(a[1..].iter().map(|s| s.to_string()));
        v
    };
    let mut senv = server_env.to_vec();
    senv.push(("SOCKAPP_BIND", "0.0.0.0"));
    let s: Running = spawn(sockapp(h, 1, &args(server), &senv), &format!("{} in b", server[0]));
    let pid = s.pid();
    vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
        listening_in(pid, port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
    })?;
    let mut cenv = client_env.to_vec();
    cenv.push(("SOCKAPP_HOST", &h.net.addr[1]));
    let c = spawn(sockapp(h, 0, &args(client), &cenv), &format!("{} in a", client[0])).finish(LIMIT);
    let s = s.finish(LIMIT);
    Ok((c, s))
}

/// Both ends carried the connection, the server demoted it for its exec,
/// the exec'd program got a connected socket and echoed what it was sent.
fn handed_over(c: &Finished, s: &Finished, execd_echoed: u64) {
    c.assert_ok();
    s.assert_ok();
    assert!(s.stderr.contains(CARRIED) && c.stderr.contains(CARRIED), "{}\n{}", c.describe(), s.describe());
    assert!(s.stderr.contains(DEMOTED), "{}", s.describe());
    assert!(s.stderr.contains("stdecho: stdin is a connected socket"), "{}", s.describe());
    assert!(s.stderr.contains(&format!("stdecho {execd_echoed}\n")), "{}", s.describe());
    assert!(c.stdout.contains(&format!("echoed {BYTES}, then the end")), "{}", c.describe());
}

/// A connection carried from a client in host a to a server in host b
/// (`inetd carried-exec`: one 16 KiB chunk echoed by the server itself),
/// which then `execve`s its echo program with it as stdin and stdout: the
/// server's library demotes it to plain TCP at an exact byte, and the
/// exec'd program gets a connected socket and echoes the rest of 1 MiB,
/// every byte checked by the client, which waits for the program's go
/// byte blocked in `read`, then in `epoll_wait` (each wakes at the
/// marker from the other host and switches).
#[test]
fn a_connection_carried_across_hosts_is_demoted_and_the_execd_program_gets_it() -> Result<()> {
    let _one = harness::one_at_a_time();
    let Some(h) = NetnsHosts::start("")? else { return Ok(()) };
    let bytes = BYTES.to_string();
    for way in ["read", "epoll"] {
        let (c, s) = across(&h, &["inetd", "carried-exec"], &[], &["goclient", &bytes, way], &[])?;
        handed_over(&c, &s, BYTES - 16384);
        // Nothing was unread in the server's ring: nothing sent again.
        assert!(c.stderr.contains(": 0 bytes sent again after the marker"), "{way}: {}", c.describe());
    }
    Ok(())
}

/// Bytes of the client's in the server's ring that the server had not
/// read when it exec'd: the client's library, on the other host, reads
/// them back from that ring by an RDMA read across the daemons' link and
/// sends them again after its marker; the exec'd program reads them once,
/// in order. First one chunk sent past what the server read (the second
/// chunk of `goclient pipelined`), then 192 KiB unread past a read count
/// of 240 KiB (`bulk`), so that the range read back wraps the 256 KiB
/// ring, echoed by the program while the client's library still sends it.
#[test]
fn unread_ring_bytes_are_read_back_across_hosts_and_handed_over_once() -> Result<()> {
    let _one = harness::one_at_a_time();
    let Some(h) = NetnsHosts::start("")? else { return Ok(()) };
    let bytes = BYTES.to_string();
    let pause = [("SOCKAPP_BEFORE_EXEC_MS", "500")];
    let (c, s) = across(&h, &["inetd", "carried-exec"], &pause, &["goclient", &bytes, "pipelined"], &[])?;
    handed_over(&c, &s, BYTES - 16384);
    assert!(c.stderr.contains(": 16384 bytes sent again after the marker"), "{}", c.describe());

    let first = (240 * 1024).to_string();
    let unread = (192 * 1024).to_string();
    let server = [("SOCKAPP_BEFORE_EXEC_MS", "500"), ("SOCKAPP_ECHO_FIRST", first.as_str())];
    let client = [("SOCKAPP_ECHO_FIRST", first.as_str()), ("SOCKAPP_UNREAD", unread.as_str())];
    let (c, s) = across(&h, &["inetd", "carried-exec"], &server, &["goclient", &bytes, "bulk"], &client)?;
    handed_over(&c, &s, BYTES - 240 * 1024);
    assert!(
        c.stderr.contains(&format!(": {} bytes sent again after the marker", 192 * 1024)),
        "{}",
        c.describe()
    );
    Ok(())
}

/// A client in host a that sends its request and shuts its write side,
/// then reads the answer (CGI style): the server in host b reads the
/// request to its end and execs its program with the connection, which
/// answers. The connection is demoted (the client's library, its end on
/// the socket, sends no marker) and the answer reaches the client.
#[test]
fn a_connection_whose_peer_on_another_host_shut_its_write_side_is_handed_over() -> Result<()> {
    let _one = harness::one_at_a_time();
    let Some(h) = NetnsHosts::start("")? else { return Ok(()) };
    let bytes = BYTES.to_string();
    let (c, s) = across(&h, &["inetd", "carried-exec-eof"], &[], &["goclient", &bytes, "shut"], &[])?;
    c.assert_ok();
    s.assert_ok();
    assert!(s.stderr.contains(CARRIED) && c.stderr.contains(CARRIED), "{}\n{}", c.describe(), s.describe());
    assert!(s.stderr.contains(DEMOTED), "{}", s.describe());
    assert!(s.stderr.contains("stdecho: stdin is a connected socket"), "{}", s.describe());
    assert!(s.stderr.contains("stdecho 0\n"), "{}", s.describe());
    assert!(c.stdout.contains("the echo, the go byte, then the end"), "{}", c.describe());
    Ok(())
}

/// The exec'ing side is the client: a client in host a carries its
/// connection to an echo server in host b (`echos`), then `execve`s a
/// program with it as descriptor 10 (`carriedexecclient`): its library
/// demotes it, and the program (`fdresume`) finds a connected socket and
/// echoes the rest of 1 MiB through the server, every byte checked. Then
/// with echoed bytes unread in the client's ring at its exec
/// (`pipelined`): one chunk, and 192 KiB past 240 KiB read (the range
/// wraps the ring): the server's library reads them back from the
/// client's ring across the hosts and sends them again; the program reads
/// them once, first, in order.
#[test]
fn a_client_that_execs_a_connection_carried_across_hosts_hands_it_over() -> Result<()> {
    let _one = harness::one_at_a_time();
    let Some(h) = NetnsHosts::start("")? else { return Ok(()) };
    let bytes = BYTES.to_string();
    let (first, unread) = ((240 * 1024).to_string(), (192 * 1024).to_string());
    let wrapping = [("SOCKAPP_ECHO_FIRST", first.as_str()), ("SOCKAPP_UNREAD", unread.as_str())];
    for (how, env, resent) in
        [("plain", &[][..], 0), ("pipelined", &[][..], 16384), ("pipelined", &wrapping[..], 192 * 1024)]
    {
        let mut env = env.to_vec();
        env.push(("SOCKAPP_BEFORE_EXEC_MS", "500"));
        let (c, s) = across(&h, &["echos", "1"], &[], &["carriedexecclient", &bytes, how], &env)?;
        c.assert_ok();
        s.assert_ok();
        assert!(
            s.stderr.contains(CARRIED) && c.stderr.contains(CARRIED),
            "{how}: {}\n{}",
            c.describe(),
            s.describe()
        );
        assert!(c.stderr.contains(DEMOTED), "{how}: {}", c.describe());
        assert!(
            c.stderr.contains("fdresume: descriptor 10 is a connected socket"),
            "{how}: {}",
            c.describe()
        );
        assert!(c.stdout.contains(&format!("echoed {BYTES}, then the end")), "{how}: {}", c.describe());
        let said = format!(": {resent} bytes sent again after the marker");
        assert!(s.stderr.contains(&said), "{how} {resent}: {}", s.describe());
    }
    Ok(())
}

/// A reader that execs while its writer on the other host floods it: a
/// `client` in host a writes 16 MiB as fast as the ring takes them, and
/// the server in host b reads 64 KiB (then, again, 1 byte) of them and
/// execs a program (`stdcheck`) that reads the rest. At the exec the
/// server's ring is full or nearly so with bytes it has not read, and the
/// client's writes are in flight or waiting for credits: its library
/// switches in its write or credit wait, reads the unread range back
/// from the server's ring across the hosts and sends it again; the
/// program checks every byte from the read count on and answers the
/// whole count, which the client checks.
#[test]
fn a_reader_that_execs_while_its_writer_on_another_host_floods_gets_every_byte() -> Result<()> {
    let _one = harness::one_at_a_time();
    let Some(h) = NetnsHosts::start("")? else { return Ok(()) };
    let bytes: u64 = 16 << 20;
    for first in [64u64 << 10, 1] {
        let f = first.to_string();
        let server = [("SOCKAPP_ECHO_FIRST", f.as_str())];
        let (c, s) =
            across(&h, &["inetd", "carried-readexec"], &server, &["client", &bytes.to_string()], &[])?;
        c.assert_ok();
        s.assert_ok();
        assert!(
            s.stderr.contains(CARRIED) && c.stderr.contains(CARRIED),
            "{first}: {}\n{}",
            c.describe(),
            s.describe()
        );
        assert!(s.stderr.contains(DEMOTED), "{first}: {}", s.describe());
        assert!(s.stderr.contains(&format!("stdcheck {}\n", bytes - first)), "{first}: {}", s.describe());
        assert!(
            c.stderr.contains(&format!("the peer demoted for an exec at {first}: ")),
            "{first}: {}",
            c.describe()
        );
    }
    Ok(())
}

/// The fallbacks across hosts: a client in host a that makes no call
/// within the server's bounded wait (`VRDMA_SOCKETS_WAIT_MS`) does not
/// answer the demotion, and the exec'd program in host b does not get the
/// connection (its stdin no socket); the client, once it reads, finds the
/// end. With bytes of the client's unread in the server's ring at that
/// exec, they are lost with it: the connection is reset, not ended
/// cleanly (the client's late switch fails to read them back from the
/// gone ring and reads a reset either way).
#[test]
fn a_connection_whose_peer_on_another_host_does_not_answer_in_time_is_not_inherited() -> Result<()> {
    let _one = harness::one_at_a_time();
    let Some(h) = NetnsHosts::start("")? else { return Ok(()) };
    let bytes = BYTES.to_string();
    let late = [("SOCKAPP_GO_DELAY_MS", "2500")];
    let (c, s) = across(
        &h,
        &["inetd", "carried-exec"],
        &[("VRDMA_SOCKETS_WAIT_MS", "300")],
        &["goclient", &bytes, "late"],
        &late,
    )?;
    c.assert_ok();
    s.assert_ok();
    assert!(s.stderr.contains(CARRIED) && c.stderr.contains(CARRIED), "{}\n{}", c.describe(), s.describe());
    assert!(s.stderr.contains("did not answer the demotion in time"), "{}", s.describe());
    assert!(s.stderr.contains("stdecho: stdin is no socket"), "{}", s.describe());
    assert!(s.stderr.contains("stdecho 0\n"), "{}", s.describe());
    assert!(c.stdout.contains("the end instead of the go byte\n"), "{}", c.describe());

    let server = [("VRDMA_SOCKETS_WAIT_MS", "300"), ("SOCKAPP_BEFORE_EXEC_MS", "500")];
    let (c, s) =
        across(&h, &["inetd", "carried-exec"], &server, &["goclient", &bytes, "pipelined-late"], &late)?;
    c.assert_ok();
    s.assert_ok();
    assert!(s.stderr.contains("did not answer the demotion in time"), "{}", s.describe());
    assert!(s.stderr.contains("bytes of the peer's unread: reset at the exec"), "{}", s.describe());
    assert!(s.stderr.contains("stdecho 0\n"), "{}", s.describe());
    assert!(c.stdout.contains("the end instead of the go byte (reset)"), "{}", c.describe());
    Ok(())
}
