//! The socket registry through a real daemon (`docs/sockets.md`), and the
//! preload library `libvrdma_sockets.so` under unmodified std::net
//! programs: carried over vRDMA between two libraries, plain TCP when
//! either end is not one.

use std::net::SocketAddr;

use anyhow::Result;
use vrdma::sockets::{Outcome, Tuple};
use vrdma_it::DaemonProc;

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

#[test]
fn the_registry_decides_through_the_daemon() -> Result<()> {
    let _one = vrdma_it::harness::one_at_a_time();
    let d = DaemonProc::start()?;
    let server = d.context()?;
    let client = d.context()?;
    let tuple = Tuple { client: addr("127.0.0.1:41000"), server: addr("127.0.0.1:5999") };
    assert!(!client.sock_lookup(tuple.server, true)?);
    server.sock_listen(addr("0.0.0.0:5999"))?;
    assert!(client.sock_lookup(tuple.server, true)?);
    // Not local: a wildcard listener does not own it.
    assert!(!client.sock_lookup(tuple.server, false)?);
    assert!(client.sock_announce(tuple, true)?);
    assert_eq!(client.sock_resolve(tuple, false)?, Outcome::Pending);
    assert!(server.sock_claim(tuple)?);
    assert_eq!(client.sock_resolve(tuple, false)?, Outcome::Carried);
    // A connection nobody announced is refused: plain TCP.
    let plain = Tuple { client: addr("127.0.0.1:41001"), ..tuple };
    assert!(!server.sock_claim(plain)?);
    // Given up before the claim: TCP for both.
    let late = Tuple { client: addr("127.0.0.1:41002"), ..tuple };
    assert!(client.sock_announce(late, true)?);
    assert_eq!(client.sock_resolve(late, true)?, Outcome::Tcp);
    assert!(!server.sock_claim(late)?);
    let c = client.sock_counts()?;
    assert_eq!((c.listeners, c.announced, c.carried, c.refused_claims, c.abandoned), (1, 2, 1, 2, 1));
    // Port 0 is refused with an error, and the connection lives on.
    assert!(server.sock_listen(addr("0.0.0.0:0")).is_err());
    // The listener goes with its context.
    drop(server);
    vrdma_it::wait_until(std::time::Duration::from_secs(10), "listener gone", || {
        client.sock_lookup(tuple.server, true).ok() == Some(false)
    })?;
    Ok(())
}

mod preload {
    use std::path::Path;
    use std::process::Command;
    use std::time::Duration;

    use anyhow::Result;
    use vrdma::sockets::SockCounts;
    use vrdma_it::harness::{self, built, free_port, listening, spawn, Finished, Running};
    use vrdma_it::DaemonProc;

    /// 16 MiB through the ring (64 times its size).
    const BYTES: u64 = 16 << 20;
    const LIMIT: Duration = Duration::from_secs(120);

    fn sockapp(d: &DaemonProc, preload: bool, args: &[String]) -> Command {
        let exe = vrdma_it::peer_exe().with_file_name("vrdma-it-sockapp");
        let mut c = Command::new(exe);
        c.args(args).env(vrdma::SOCKET_ENV, &d.socket).env("VRDMA_SOCKETS_DEBUG", "1");
        if preload {
            c.env("LD_PRELOAD", built("libvrdma_sockets.so"));
        }
        c
    }

    fn server(d: &DaemonProc, preload: bool, port: u16) -> Running {
        spawn(sockapp(d, preload, &["server".into(), port.to_string()]), "server")
    }

    /// A worker forked after `listen` accepts and serves: it carries the
    /// connection with a device of its own (the parent's is not its to use).
    #[test]
    fn a_worker_forked_after_listen_carries_what_it_accepts() -> Result<()> {
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let port = free_port();
        let s = spawn(sockapp(&d, true, &["forkserver".into(), port.to_string()]), "forkserver");
        vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
            listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
        })?;
        let c = client(&d, true, port).finish(LIMIT);
        let s = s.finish(LIMIT);
        c.assert_ok();
        s.assert_ok();
        assert!(s.stderr.contains("carried over vRDMA"), "{}", s.describe());
        let counts = ctx.sock_counts()?;
        assert_eq!((counts.announced, counts.carried), (1, 1), "{counts:?}");
        Ok(())
    }

    /// A non-blocking server whose first call comes after `poll` or
    /// `select` reported the connection readable: that readiness was the
    /// client's hello, which the readiness call now decides (the exchange
    /// of hellos) before it answers, so the read that follows finds bytes
    /// and never `EAGAIN` (ncat `--exec`'s relay took that `EAGAIN` for the
    /// end and closed the connection).
    #[test]
    fn a_connection_reported_readable_before_its_first_call_has_bytes_to_read() -> Result<()> {
        for how in ["poll", "select"] {
            let (s, c) = strict_ready_pair(how)?;
            s.assert_ok();
            c.assert_ok();
            assert!(s.stderr.contains("carried over vRDMA"), "{how}: {}", s.describe());
        }
        Ok(())
    }

    /// A preloaded `pollserver` that waits with `how` (`SOCKAPP_STRICT_READY`)
    /// and fails on a report with nothing to read, and a preloaded client
    /// of it, both finished (on a daemon of their own, one pair at a time).
    fn strict_ready_pair(how: &str) -> Result<(Finished, Finished)> {
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let port = free_port();
        let mut cmd = sockapp(&d, true, &["pollserver".into(), port.to_string()]);
        cmd.env("SOCKAPP_STRICT_READY", how);
        let s = spawn(cmd, "pollserver");
        vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
            listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
        })?;
        let c = client(&d, true, port).finish(LIMIT);
        Ok((s.finish(LIMIT), c))
    }

    /// As `a_connection_reported_readable_before_its_first_call_has_bytes_to_read`,
    /// with the connection registered in an epoll set right after its
    /// accept (before any call on it): level-triggered, edge-triggered and
    /// level-triggered one-shot. The interposed `epoll_wait` decides the
    /// connection when the client's hello is what it reports, and answers
    /// for it as it then is: the first report has bytes behind it (before,
    /// it was the hello, and the read said `EAGAIN`), and the reports that
    /// follow still come (an edge the decision took is not lost: the
    /// server's waits would time out).
    #[test]
    fn an_epoll_connection_reported_readable_before_its_first_call_has_bytes_to_read() -> Result<()> {
        for how in ["epoll", "epoll-et", "epoll-oneshot"] {
            let (s, c) = strict_ready_pair(how)?;
            // (The client checks the server's count of the bytes.)
            assert!(s.status.success() && c.status.success(), "{how}:\n{}\n{}", s.describe(), c.describe());
            assert!(s.stderr.contains("carried over vRDMA"), "{how}: {}", s.describe());
        }
        Ok(())
    }

    /// Echoed by `forkecho`: four rings' worth, in 16 KiB round trips.
    const ECHO_BYTES: u64 = 1 << 20;

    /// A carried connection accepted before `fork` (`sockapp forkecho
    /// PORT MODE`), echoed to a carried `echoclient` that checks every
    /// byte and then the end. Returns the server's output.
    fn fork_echo(mode: &str) -> Result<harness::Finished> {
        fork_echo_with(mode, &[])
    }

    /// [`fork_echo`], the server run with `env` too.
    fn fork_echo_with(mode: &str, env: &[(&str, &str)]) -> Result<harness::Finished> {
        fork_echo_envs(mode, env, &[])
    }

    /// [`fork_echo`], the server run with `env` too, the client with
    /// `client_env`.
    fn fork_echo_envs(
        mode: &str,
        env: &[(&str, &str)],
        client_env: &[(&str, &str)],
    ) -> Result<harness::Finished> {
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let port = free_port();
        let mut cmd = sockapp(&d, true, &["forkecho".into(), port.to_string(), mode.into()]);
        cmd.envs(env.iter().copied());
        let s = spawn(cmd, "forkecho");
        vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
            listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
        })?;
        let args = ["echoclient".into(), port.to_string(), ECHO_BYTES.to_string()];
        let mut cmd = sockapp(&d, true, &args);
        cmd.envs(client_env.iter().copied());
        let c = spawn(cmd, "echoclient").finish(LIMIT);
        let s = s.finish(LIMIT);
        c.assert_ok();
        s.assert_ok();
        assert!(c.stdout.contains(&format!("echoed {ECHO_BYTES}, then the end")), "{}", c.describe());
        // Carried: both libraries said so, and the daemon counted it.
        const CARRIED: &str = "carried over vRDMA";
        assert!(
            c.stderr.contains(CARRIED) && s.stderr.contains(CARRIED),
            "{}\n{}",
            c.describe(),
            s.describe()
        );
        let counts = ctx.sock_counts()?;
        assert_eq!((counts.announced, counts.carried), (1, 1), "{counts:?}");
        Ok(s)
    }

    /// The classic forking server: accept, fork, the parent closes its
    /// copy at once and the child serves. The parent's close does not end
    /// the child's connection; the child's close (or its exit) ends it.
    #[test]
    fn a_connection_accepted_before_fork_is_served_by_the_child() -> Result<()> {
        for mode in ["child", "child-exit"] {
            let s = fork_echo(mode)?;
            assert!(s.stdout.contains(&format!("echoed {ECHO_BYTES}")), "{mode}: {}", s.describe());
        }
        Ok(())
    }

    /// A forking server's accept loop (a child per connection, the
    /// parent closing its copy at once and accepting the next), with
    /// four carried clients at once: each child carries its own.
    #[test]
    fn a_forking_server_carries_a_child_per_connection() -> Result<()> {
        const N: usize = 4;
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let port = free_port();
        let s = spawn(sockapp(&d, true, &["forkechos".into(), port.to_string(), N.to_string()]), "forkechos");
        vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
            listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
        })?;
        let args = ["echoclient".into(), port.to_string(), ECHO_BYTES.to_string()];
        let clients: Vec<_> =
            (0..N).map(|i| spawn(sockapp(&d, true, &args), &format!("echoclient {i}"))).collect();
        let clients: Vec<_> = clients.into_iter().map(|c| c.finish(LIMIT)).collect();
        let s = s.finish(LIMIT);
        s.assert_ok();
        for c in &clients {
            c.assert_ok();
            assert!(c.stdout.contains(&format!("echoed {ECHO_BYTES}, then the end")), "{}", c.describe());
            assert!(c.stderr.contains("carried over vRDMA"), "{}", c.describe());
        }
        assert_eq!(s.stdout.matches(&format!("echoed {ECHO_BYTES}")).count(), N, "{}", s.describe());
        assert_eq!(s.stderr.matches("carried over vRDMA").count(), N, "{}", s.describe());
        let counts = ctx.sock_counts()?;
        assert_eq!((counts.announced, counts.carried), (N as u64, N as u64), "{counts:?}");
        Ok(())
    }

    /// A holder whose copy of a forked connection was not carried before
    /// the fork (the child took it and carried it; the parent kept its
    /// copy) is told `EIO` by a read of it once the child is gone, never
    /// given bytes: it cannot ask a driver to demote it. A connection
    /// carried before the fork is shared instead
    /// (`a_connection_carried_before_fork_is_shared_by_parent_and_child`).
    #[test]
    fn the_process_that_did_not_take_a_forked_connection_gets_eio() -> Result<()> {
        let s = fork_echo("child-then-parent")?;
        assert!(s.stdout.contains("parent: EIO"), "{}", s.describe());
        // Said once, whether or not debugging, with what to do.
        let why = "it cannot be shared";
        assert_eq!(s.stderr.matches(why).count(), 1, "{}", s.describe());
        assert!(s.stderr.contains("VRDMA_SOCKETS=0"), "{}", s.describe());
        Ok(())
    }

    /// A connection carried before the fork, then used by both processes
    /// at once (rsync's generator and receiver): the child reads it in
    /// pieces of random sizes and the parent writes every piece back; the
    /// carried client checks each of its 1 MiB byte by byte, then the end.
    /// Needs the fork demotion (`docs/sockets.md`, "Fork": designed, not
    /// built): today the child gets `EIO`.
    #[test]
    fn a_connection_carried_before_fork_is_shared_by_parent_and_child() -> Result<()> {
        for mode in ["early-split", "early-split-poll"] {
            let s = fork_echo(mode)?;
            assert!(s.stdout.contains(&format!("echoed {ECHO_BYTES}")), "{mode}: {}", s.describe());
            // Plain TCP after: the kernel has the program's TCP_NODELAY
            // (never set: 0) again, not the library's (1).
            assert!(s.stdout.contains("nodelay 0"), "{mode}: {}", s.describe());
        }
        Ok(())
    }

    /// As above (`early-split`), with test pauses that force the peer's
    /// last ring write and its marker into the window between a demoted
    /// read's look at the ring (empty) and its look at the socket: the
    /// client pauses before each ring write, the server's reads after
    /// finding the ring empty. The read must look at the ring again (the
    /// bytes before the marker), not reset the connection.
    #[test]
    fn a_demoted_read_reads_ring_bytes_that_landed_before_the_peers_marker() -> Result<()> {
        let s = fork_echo_envs(
            "early-split",
            &[("VRDMA_SOCKETS_TEST_PAUSE", "ring-then-socket:50000")],
            &[("VRDMA_SOCKETS_TEST_PAUSE", "ring-write:20000")],
        )?;
        assert!(s.stdout.contains(&format!("echoed {ECHO_BYTES}")), "{}", s.describe());
        Ok(())
    }

    /// The parent carried the connection and read some of it, forks and
    /// closes its copy: the child serves the rest alone. Needs the fork
    /// demotion: today the child gets `EIO`.
    #[test]
    fn a_child_takes_over_a_connection_its_parent_carried_and_closed() -> Result<()> {
        let s = fork_echo("early-handover")?;
        assert!(s.stdout.contains(&format!("echoed {ECHO_BYTES}")), "{}", s.describe());
        Ok(())
    }

    /// A client streaming 16 MiB to a server that read 16 KiB (carried),
    /// forked and closed its copy: the client's writes wait for credits
    /// on the full ring until the demotion (its blocking write leaves the
    /// wait and goes on over the kernel socket); the child reads and
    /// checks every byte and answers.
    #[test]
    fn a_writer_waiting_for_credits_goes_on_when_the_forked_reader_demotes() -> Result<()> {
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let port = free_port();
        let s =
            spawn(sockapp(&d, true, &["forkecho".into(), port.to_string(), "sink".into()]), "forkecho sink");
        vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
            listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
        })?;
        let c = spawn(sockapp(&d, true, &["client".into(), port.to_string(), BYTES.to_string()]), "client")
            .finish(LIMIT);
        let s = s.finish(LIMIT);
        c.assert_ok();
        s.assert_ok();
        assert!(s.stdout.contains(&format!("received {BYTES}")), "{}", s.describe());
        assert!(s.stderr.contains("demoted after"), "{}", s.describe());
        assert!(c.stderr.contains("the peer demoted"), "{}", c.describe());
        Ok(())
    }

    /// The parent writes 8 MiB while its child's read asks for the
    /// demotion; each write pauses (a test hook) after its look at the
    /// demotion state, before the send lock, so the demotion takes the
    /// lock in that window: the write must not go into the ring after
    /// the marker. The carried client reads and checks every byte.
    #[test]
    fn a_write_that_waited_for_the_send_lock_during_a_demotion_goes_to_the_kernel() -> Result<()> {
        const N: u64 = 8 << 20;
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let port = free_port();
        let mut cmd = sockapp(&d, true, &["forkecho".into(), port.to_string(), format!("write-{N}")]);
        cmd.env("VRDMA_SOCKETS_TEST_PAUSE", "send-lock:20000");
        let s = spawn(cmd, "forkecho write");
        vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
            listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
        })?;
        let c = spawn(sockapp(&d, true, &["readcheck".into(), port.to_string(), N.to_string()]), "readcheck")
            .finish(LIMIT);
        let s = s.finish(LIMIT);
        c.assert_ok();
        s.assert_ok();
        assert!(c.stdout.contains(&format!("read {N}")), "{}", c.describe());
        assert!(s.stderr.contains("demoted after"), "{}", s.describe());
        Ok(())
    }

    /// The parent half-closes a carried connection (`shutdown(SHUT_WR)`,
    /// then its peer answers: the usual request and response) while its
    /// child's read asks for the demotion; the driver pauses (a test
    /// hook) between the state's `D_DEMOTING` and its send lock, so the
    /// shutdown takes the lock first. The ring must be shut (the driver
    /// then sends no marker): taken as demoted, the kernel's FIN went
    /// ahead of the marker, whose send failed and the demotion with it,
    /// and the child's read of the answer got `ECONNRESET`.
    #[test]
    fn a_shutdown_as_a_fork_demotion_only_began_still_gets_the_answer() -> Result<()> {
        const N: u64 = 64 << 10;
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let port = free_port();
        let mut cmd = sockapp(&d, true, &["forkecho".into(), port.to_string(), format!("shut-{N}")]);
        // The parent's shutdown comes 200 ms after the fork, in the
        // driver's pause; the client answers after the driver went on.
        cmd.env("VRDMA_SOCKETS_TEST_PAUSE", "demote-lock:500000");
        let s = spawn(cmd, "forkecho shut");
        vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
            listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
        })?;
        let mut cmd = sockapp(&d, true, &["readreply".into(), port.to_string(), N.to_string()]);
        cmd.env("SOCKAPP_REPLY_DELAY_MS", "1000");
        let c = spawn(cmd, "readreply").finish(LIMIT);
        let s = s.finish(LIMIT);
        c.assert_ok();
        s.assert_ok();
        assert!(c.stdout.contains(&format!("read {N}, then the end")), "{}", c.describe());
        assert!(s.stdout.contains("reply: the answer after the half-close"), "{}", s.describe());
        assert!(s.stderr.contains("demoted after"), "{}", s.describe());
        Ok(())
    }

    /// Two reader threads at the peer of a demotion: each read pauses (a
    /// test hook) before the receive lock, so one thread switches the
    /// reads (takes the marker) while the other waits for the lock; that
    /// one must read the kernel socket, not look for the marker again
    /// (which took data bytes for wake bytes, or reset).
    #[test]
    fn a_second_reader_thread_at_the_peer_reads_the_kernel_after_the_switch() -> Result<()> {
        const N: u64 = 4 << 20;
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let port = free_port();
        let s = spawn(
            sockapp(&d, true, &["forkecho".into(), port.to_string(), format!("writenb-{N}")]),
            "forkecho writenb",
        );
        vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
            listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
        })?;
        let mut cmd = sockapp(&d, true, &["readsplit".into(), port.to_string(), N.to_string()]);
        cmd.env("VRDMA_SOCKETS_TEST_PAUSE", "recv-lock:20000");
        let c = spawn(cmd, "readsplit").finish(LIMIT);
        let s = s.finish(LIMIT);
        c.assert_ok();
        s.assert_ok();
        assert!(c.stdout.contains(&format!("read {N}, then the end")), "{}", c.describe());
        assert!(c.stderr.contains("reading the kernel socket"), "{}", c.describe());
        Ok(())
    }

    /// A client streaming 16 MiB to a server that read 16 KiB, forked and
    /// closed its copy (as above), that closes at once after its last
    /// write, reading nothing: its close takes the demoting end's marker
    /// off, so its kernel sends FIN, not RST; the child reads every byte,
    /// then the end (a reset lost the client's unsent bytes).
    #[test]
    fn a_peer_that_closes_after_its_last_write_in_a_demotion_ends_with_fin() -> Result<()> {
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let port = free_port();
        let args = ["forkecho".into(), port.to_string(), "sink-quiet".into()];
        let s = spawn(sockapp(&d, true, &args), "forkecho sink-quiet");
        vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
            listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
        })?;
        let c =
            spawn(sockapp(&d, true, &["sendclose".into(), port.to_string(), BYTES.to_string()]), "sendclose")
                .finish(LIMIT);
        let s = s.finish(LIMIT);
        c.assert_ok();
        s.assert_ok();
        assert!(s.stdout.contains(&format!("received {BYTES}, then the end")), "{}", s.describe());
        assert!(c.stderr.contains("the peer demoted"), "{}", c.describe());
        Ok(())
    }

    /// The child asks for a connection its stopped parent drives: its
    /// read fails with `ECONNRESET` within the library's wait (2 s here),
    /// not a hang; resumed, the parent echoes the rest. Needs the fork
    /// demotion: today the child gets `EIO` at once.
    #[test]
    fn a_child_asking_a_stopped_driver_gets_econnreset() -> Result<()> {
        let s = fork_echo_with("early-stopped", &[("VRDMA_SOCKETS_WAIT_MS", "2000")])?;
        assert!(s.stdout.contains("child: ECONNRESET"), "{}", s.describe());
        assert!(s.stdout.contains(&format!("echoed {ECHO_BYTES}")), "{}", s.describe());
        Ok(())
    }

    /// rsync against an rsync daemon, both under the preload: the client
    /// negotiates, then forks its receiver, which reads the connection
    /// while the generator (the parent) writes to it. A module of a few
    /// MiB of random files, pulled and compared byte by byte. Needs the
    /// fork demotion: today the receiver gets `EIO` (exit 12).
    #[test]
    fn rsync_pulls_from_an_rsync_daemon_both_under_the_preload() -> Result<()> {
        if Command::new("rsync").arg("--version").output().is_err() {
            eprintln!("no rsync: skipped");
            return Ok(());
        }
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let dir = tempfile::tempdir()?;
        let src = dir.path().join("src");
        let dst = dir.path().join("dst");
        std::fs::create_dir_all(&src)?;
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for i in 0..6 {
            let len = (1 << 20) + i * 77_777;
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect();
            std::fs::write(src.join(format!("f{i}")), bytes)?;
        }
        let port = free_port();
        let conf = dir.path().join("rsyncd.conf");
        std::fs::write(
            &conf,
            format!(
                "use chroot = no\nlog file = {}\npid file = {}\n[m]\npath = {}\nread only = yes\n",
                dir.path().join("rsyncd.log").display(),
                dir.path().join("rsyncd.pid").display(),
                src.display()
            ),
        )?;
        let preloaded = |args: &[String]| {
            let mut c = Command::new("rsync");
            c.args(args)
                .env(vrdma::SOCKET_ENV, &d.socket)
                .env("VRDMA_SOCKETS_DEBUG", "1")
                .env("LD_PRELOAD", built("libvrdma_sockets.so"));
            c
        };
        let daemon = spawn(
            preloaded(&[
                "--daemon".into(),
                "--no-detach".into(),
                format!("--config={}", conf.display()),
                format!("--port={port}"),
                "--address=127.0.0.1".into(),
            ]),
            "rsync --daemon",
        );
        vrdma_it::wait_until(Duration::from_secs(20), "the rsync daemon listens", || {
            listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
        })?;
        let c = spawn(
            preloaded(&["-a".into(), format!("rsync://127.0.0.1:{port}/m/"), format!("{}/", dst.display())]),
            "rsync",
        )
        .finish(LIMIT);
        drop(daemon);
        c.assert_ok();
        assert!(c.stderr.contains("carried over vRDMA"), "{}", c.describe());
        for i in 0..6 {
            let f = format!("f{i}");
            assert!(std::fs::read(src.join(&f))? == std::fs::read(dst.join(&f))?, "{f} differs");
        }
        Ok(())
    }

    /// A client that connects and forks, and whose child makes the first
    /// call (`sockapp forkclient`): the child adopts its parent's
    /// announcement at the daemon and carries the connection through its
    /// own device (1 MiB echoed in 16 KiB round trips, every byte checked,
    /// then the end). Before, the child got `EIO`.
    #[test]
    fn a_client_forked_before_its_first_call_is_carried_by_the_child() -> Result<()> {
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let port = free_port();
        let s = spawn(sockapp(&d, true, &["forkecho".into(), port.to_string(), "child".into()]), "forkecho");
        vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
            listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
        })?;
        let args = ["forkclient".into(), port.to_string(), ECHO_BYTES.to_string()];
        let c = spawn(sockapp(&d, true, &args), "forkclient").finish(LIMIT);
        let s = s.finish(LIMIT);
        c.assert_ok();
        s.assert_ok();
        assert!(c.stdout.contains(&format!("echoed {ECHO_BYTES}, then the end")), "{}", c.describe());
        assert!(c.stderr.contains("adopted from the process that announced it"), "{}", c.describe());
        const CARRIED: &str = "carried over vRDMA";
        assert!(
            c.stderr.contains(CARRIED) && s.stderr.contains(CARRIED),
            "{}\n{}",
            c.describe(),
            s.describe()
        );
        let counts = ctx.sock_counts()?;
        assert_eq!((counts.announced, counts.carried), (1, 1), "{counts:?}");
        Ok(())
    }

    /// The mirror case: the child closes its copy (or exits without
    /// touching it) and the parent goes on, with the connection carried
    /// before the fork or not yet.
    #[test]
    fn a_child_that_closes_or_leaves_a_forked_connection_leaves_it_to_the_parent() -> Result<()> {
        for mode in ["parent-close", "parent-exit", "early-parent-close", "early-parent-exit"] {
            let s = fork_echo(mode)?;
            assert!(s.stdout.contains(&format!("echoed {ECHO_BYTES}")), "{mode}: {}", s.describe());
        }
        Ok(())
    }

    fn client(d: &DaemonProc, preload: bool, port: u16) -> Running {
        spawn(sockapp(d, preload, &["client".into(), port.to_string(), BYTES.to_string()]), "client")
    }

    /// Runs a server and a client to their ends; both must succeed.
    fn pair(d: &DaemonProc, server_preload: bool, client_preload: bool) -> Result<(SockCounts, bool)> {
        let ctx = d.context()?;
        let port = free_port();
        let s = server(d, server_preload, port);
        // A preloaded server's listener is registered after the kernel's
        // listen: wait for the registration, not only the port.
        vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
            listening(port) && (!server_preload || ctx.sock_counts().ok().map(|c| c.listeners) == Some(1))
        })?;
        let c = client(d, client_preload, port);
        let c = c.finish(LIMIT);
        let s = s.finish(LIMIT);
        c.assert_ok();
        s.assert_ok();
        // Each library says so (VRDMA_SOCKETS_DEBUG) once its connection
        // is carried.
        const CARRIED: &str = "carried over vRDMA";
        let carried = c.stderr.contains(CARRIED);
        // A carried descriptor is kept close-on-exec (an exec'd program
        // would read the raw socket); a TCP one is left as the program
        // made it (inheritable).
        let cloexec = if carried { "cloexec=1" } else { "cloexec=0" };
        assert!(c.stdout.contains(cloexec), "{}", c.describe());
        assert_eq!(carried, s.stderr.contains(CARRIED), "{}\n{}", c.describe(), s.describe());
        Ok((ctx.sock_counts()?, carried))
    }

    /// On the direct path a write goes from the program's buffer straight
    /// into the peer's ring (one copy, not two through the staging
    /// region): the client's writes of varying sizes, vectored ones among
    /// them, are checked byte for byte by the server, and the client
    /// says how many of its ring writes went so. The engine path stages
    /// every one.
    #[test]
    fn a_stream_on_the_direct_path_is_written_from_the_programs_buffer() -> Result<()> {
        let _one = harness::one_at_a_time();
        // The path named, whatever the default is (CI's VRDMA_DIRECT=0 run).
        let direct = DaemonProc::start_with_config("[direct]\nenabled = true\n")?;
        for (path, d) in [("engine", engine_daemon()?), ("direct", direct)] {
            let ctx = d.context()?;
            let port = free_port();
            let s = server(&d, true, port);
            registered(&ctx, port)?;
            let c = client(&d, true, port).finish(LIMIT);
            let s = s.finish(LIMIT);
            c.assert_ok();
            s.assert_ok();
            let (writes, direct) = c
                .stderr
                .lines()
                .find_map(|l| {
                    let rest = l.split("ring writes ").nth(1)?;
                    let (w, d) = rest.split_once(", from the caller's buffer ")?;
                    Some((w.parse::<u64>().ok()?, d.trim().parse::<u64>().ok()?))
                })
                .unwrap_or_else(|| panic!("{path}: the client's counts: {}", c.describe()));
            eprintln!("{path}: {writes} ring writes, {direct} from the caller's buffer");
            assert!(writes > 0, "{path}: {}", c.describe());
            if path == "engine" {
                assert_eq!(direct, 0, "{}", c.describe());
            } else {
                // Some may stage (a write while the engine still has one
                // of the QP's in flight); most must not.
                assert!(direct * 2 > writes, "{path}: {direct} of {writes}: {}", c.describe());
            }
        }
        Ok(())
    }

    /// A null buffer of some length on a carried connection is EFAULT, as
    /// on the kernel, never a crash of the program; the stream goes on.
    #[test]
    fn a_null_buffer_on_a_carried_connection_is_efault() -> Result<()> {
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let port = free_port();
        let s = server(&d, true, port);
        registered(&ctx, port)?;
        let c = spawn(sockapp(&d, true, &["badbuf".into(), port.to_string()]), "badbuf").finish(LIMIT);
        let s = s.finish(LIMIT);
        c.assert_ok();
        s.assert_ok();
        assert!(c.stderr.contains("carried over vRDMA"), "{}", c.describe());
        assert!(c.stdout.contains("efault 3"), "{}", c.describe());
        Ok(())
    }

    #[test]
    fn an_event_loop_pair_on_poll_sees_every_byte_ready() -> Result<()> {
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let port = free_port();
        let s = spawn(sockapp(&d, true, &["echo".into(), port.to_string()]), "echo");
        vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
            listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
        })?;
        let c = spawn(sockapp(&d, true, &["ping".into(), port.to_string(), "300".into()]), "ping");
        let c = c.finish(LIMIT);
        let s = s.finish(LIMIT);
        c.assert_ok();
        s.assert_ok();
        assert!(c.stderr.contains("carried over vRDMA"), "{}", c.describe());
        assert_eq!(ctx.sock_counts()?.carried, 1);
        Ok(())
    }

    /// A writer whose reader is killed (SIGKILL) mid-stream gets an error,
    /// as over TCP, instead of waiting for credits for ever.
    #[test]
    fn a_writer_whose_reader_is_killed_gets_an_error() -> Result<()> {
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let port = free_port();
        let mut s = spawn(sockapp(&d, true, &["sink".into(), port.to_string()]), "sink");
        vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
            listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
        })?;
        let c = spawn(sockapp(&d, true, &["flood".into(), port.to_string()]), "flood");
        // Carried, and the reader stopped reading with the ring full.
        vrdma_it::wait_until(Duration::from_secs(30), "the connection is carried", || {
            ctx.sock_counts().ok().map(|c| c.carried) == Some(1)
        })?;
        std::thread::sleep(Duration::from_millis(500));
        assert!(!s.exited(), "the sink ended early");
        // SAFETY: kill(2) of our own child, not yet reaped.
        assert_eq!(unsafe { libc::kill(s.pid(), libc::SIGKILL) }, 0);
        let c = c.finish(Duration::from_secs(30));
        c.assert_ok();
        assert!(c.stderr.contains("write failed"), "{}", c.describe());
        assert!(c.stderr.contains("carried over vRDMA"), "{}", c.describe());
        Ok(())
    }

    /// `TCP_NODELAY` and `TCP_CORK` on a carried connection are the
    /// program's (`docs/sockets.md`, "Writing"): the library keeps the
    /// kernel socket's `TCP_NODELAY` on and its `TCP_CORK` off (it carries
    /// only wake bytes, which Nagle's algorithm would hold for the peer's
    /// delayed ACK, and a cork for 200 ms), and the program reads what it
    /// set, 0 if it set nothing, as over TCP. `optclient` reads
    /// `TCP_NODELAY` on a connection it never sets (but corks before its
    /// first call: uncorked at the carry, 1 to the program), and on one
    /// it sets before its first call (which the kernel gets: not decided
    /// yet), clears once carried, reads with a one-byte option, sets wrongly
    /// (the kernel's errnos) and sets again; then corks that one, reads 1,
    /// makes round trips (each read bounded), uncorks it and reads 0: it
    /// sees the same carried (preloaded both ends), as plain TCP without
    /// the library, and as TCP under the library (a plain server). Each
    /// library says the kernel socket's values, read back, at the carry
    /// and at each change.
    #[test]
    fn tcp_nodelay_and_cork_on_a_carried_connection_are_the_programs() -> Result<()> {
        const SEEN: &str = "unset fresh=0 carried=0\n\
            early cork=1 carried=1\n\
            set fresh=0 early=1 carried=1 cleared=0 short=0/1 errs=22,14,14 again=1\n\
            cork before=0 corked=1 uncorked=0\n";
        let _one = harness::one_at_a_time();
        assert!(have_lib());
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        for (server_preload, client_preload) in [(true, true), (false, false), (false, true)] {
            let case = format!("server preloaded {server_preload}, client {client_preload}");
            let port = free_port();
            let s =
                spawn(sockapp(&d, server_preload, &["echos".into(), port.to_string(), "2".into()]), "echos");
            vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
                listening(port) && (!server_preload || ctx.sock_counts().ok().map(|c| c.listeners) == Some(1))
            })?;
            let c = spawn(sockapp(&d, client_preload, &["optclient".into(), port.to_string()]), "optclient");
            let c = c.finish(LIMIT);
            let s = s.finish(LIMIT);
            c.assert_ok();
            s.assert_ok();
            assert!(c.stdout.contains(SEEN), "{case}: {}", c.describe());
            let carried = server_preload && client_preload;
            assert_eq!(
                c.stderr.matches("carried over vRDMA").count(),
                2 * carried as usize,
                "{case}: {}",
                c.describe()
            );
            if !carried {
                assert!(!c.stderr.contains("TCP_NODELAY"), "{case}: {}", c.describe());
                assert!(!c.stderr.contains("TCP_CORK"), "{case}: {}", c.describe());
                continue;
            }
            for said in [
                // The first connection's, never set; the second's, set
                // before its first call.
                "TCP_NODELAY 1 on the socket of a connection being carried (the program's: 0)",
                "TCP_NODELAY 1 on the socket of a connection being carried (the program's: 1)",
                "TCP_NODELAY kept at 1 on a carried connection (the program asked 0)",
                "TCP_NODELAY kept at 1 on a carried connection (the program asked 1)",
                // The kernel's never corked: not at the carry, nor when
                // the program corks.
                "TCP_CORK 0 on the socket of a connection being carried (the program's: 0)",
                // The first connection's, corked before its first call:
                // taken off at the carry, the program's.
                "TCP_CORK 0 on the socket of a connection being carried (the program's: 1)",
                "TCP_CORK kept at 0 on a carried connection (the program asked 1)",
                "TCP_CORK kept at 0 on a carried connection (the program asked 0)",
            ] {
                assert!(c.stderr.contains(said), "{case}: {said:?} missing: {}", c.describe());
            }
            for said in [
                "TCP_NODELAY 1 on the socket of a connection being carried (the program's: 0)",
                "TCP_CORK 0 on the socket of a connection being carried (the program's: 0)",
            ] {
                assert_eq!(s.stderr.matches(said).count(), 2, "{case}: {}", s.describe());
            }
            assert!(!c.stderr.contains("TCP_CORK 1") && !s.stderr.contains("TCP_CORK 1"), "{case}");
            // Each hello went with the library's values, also that of the
            // connection the program corked before its first call (its
            // hello would have waited for the cork's 200 ms).
            for out in [&c, &s] {
                let hellos: Vec<&str> = out.stderr.lines().filter(|l| l.contains("hello sent")).collect();
                assert_eq!(hellos.len(), 2, "{case}: {}", out.describe());
                for l in hellos {
                    assert!(
                        l.ends_with("hello sent (the kernel's TCP_NODELAY 1, TCP_CORK 0)"),
                        "{case}: {l}"
                    );
                }
            }
        }
        Ok(())
    }

    /// Python's asyncio (epoll, non-blocking sockets, a stream reader and
    /// writer) on both ends, carried.
    #[test]
    fn python_asyncio_echo_runs_carried() -> Result<()> {
        let path = std::env::var_os("PATH").unwrap_or_default();
        if !std::env::split_paths(&path).any(|d| d.join("python3").is_file()) {
            vrdma_it::skip("python3 is missing (apt-get install python3)");
            return Ok(());
        }
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let port = free_port().to_string();
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/sockets_asyncio.py");
        let py = |args: &[&str]| {
            let mut c = Command::new("python3");
            c.arg(script)
                .args(args)
                .env(vrdma::SOCKET_ENV, &d.socket)
                .env("VRDMA_SOCKETS_DEBUG", "1")
                .env("LD_PRELOAD", built("libvrdma_sockets.so"));
            c
        };
        let s = spawn(py(&["server", &port]), "asyncio server");
        vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
            ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
        })?;
        let c = spawn(py(&["client", &port, "2000"]), "asyncio client").finish(LIMIT);
        drop(s);
        c.assert_ok();
        assert!(c.stdout.contains("ok "), "{}", c.describe());
        assert!(c.stderr.contains("carried over vRDMA"), "{}", c.describe());
        assert_eq!(ctx.sock_counts()?.carried, 1);
        Ok(())
    }

    /// A server that accepts and closes at once: its client reads the end,
    /// as over TCP (not a reset, though the hellos were never exchanged).
    #[test]
    fn a_connection_closed_before_its_first_call_reads_as_the_end() -> Result<()> {
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let port = free_port();
        let s = spawn(sockapp(&d, true, &["quiet".into(), port.to_string()]), "quiet");
        vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
            listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
        })?;
        let c =
            spawn(sockapp(&d, true, &["expect-end".into(), port.to_string()]), "expect-end").finish(LIMIT);
        s.finish(LIMIT).assert_ok();
        c.assert_ok();
        assert_eq!(ctx.sock_counts()?.carried, 1);
        Ok(())
    }

    /// sendfile(2) to a carried socket goes through the ring (the kernel
    /// would put the file's bytes into the TCP stream, past it).
    #[test]
    fn sendfile_to_a_carried_socket_arrives_whole() -> Result<()> {
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let port = free_port();
        let s = server(&d, true, port);
        vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
            listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
        })?;
        let args = ["sendfile".into(), port.to_string(), (3 << 20).to_string()];
        let c = spawn(sockapp(&d, true, &args), "sendfile").finish(LIMIT);
        let s = s.finish(LIMIT);
        c.assert_ok();
        s.assert_ok();
        assert!(c.stderr.contains("carried over vRDMA"), "{}", c.describe());
        Ok(())
    }

    /// The engine carries the bytes (the direct path off): a write's
    /// completion comes later than its post, so writes are in flight
    /// when the program moves on (`docs/sockets.md`, pipelined writes).
    fn engine_daemon() -> Result<DaemonProc> {
        DaemonProc::start_with_config("[direct]\nenabled = false\n")
    }

    /// Waits until a preloaded server on `port` listens and is registered.
    fn registered(ctx: &vrdma::Context, port: u16) -> Result<()> {
        vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
            listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
        })
    }

    /// Many writes of 1 to 13 bytes, pipelined (several in flight at
    /// once), arrive whole and in order, through the engine.
    #[test]
    fn many_small_pipelined_writes_arrive_in_order() -> Result<()> {
        let _one = harness::one_at_a_time();
        let d = engine_daemon()?;
        let ctx = d.context()?;
        let port = free_port();
        let s = server(&d, true, port);
        registered(&ctx, port)?;
        let args = ["tiny".into(), port.to_string(), (2u64 << 20).to_string()];
        let c = spawn(sockapp(&d, true, &args), "tiny").finish(LIMIT);
        let s = s.finish(LIMIT);
        c.assert_ok();
        s.assert_ok();
        assert!(c.stderr.contains("carried over vRDMA"), "{}", c.describe());
        Ok(())
    }

    /// `sendmmsg` and `recvmmsg` on carried connections move the stream's
    /// bytes in order through the ring (the kernel's would write into, or
    /// read from, the TCP socket under it: the peer took them for wake
    /// bytes), and `splice` to one is refused with `EINVAL`, nothing lost
    /// (the kernel's moved the pipe's bytes past the ring).
    #[test]
    fn several_messages_at_once_and_splice_on_carried_connections() -> Result<()> {
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        for (server, client) in
            [("server", "mmsgclient"), ("mmsgserver", "client"), ("server", "spliceclient")]
        {
            let port = free_port();
            let s = spawn(sockapp(&d, true, &[server.into(), port.to_string()]), server);
            registered(&ctx, port)?;
            let mut args = vec![client.to_string(), port.to_string()];
            if client == "client" {
                args.push("300000".into());
            }
            let c = spawn(sockapp(&d, true, &args), client).finish(LIMIT);
            let s = s.finish(LIMIT);
            c.assert_ok();
            s.assert_ok();
            assert!(c.stderr.contains("carried over vRDMA"), "{client}: {}", c.describe());
            if client == "spliceclient" {
                assert!(c.stdout.contains("splice EINVAL"), "{}", c.describe());
            }
        }
        Ok(())
    }

    /// `ioctl(FIONREAD)` on a carried connection counts the bytes waiting
    /// in its ring, as the kernel counts a TCP socket's: after a first
    /// read and a pause, the rest of the client's bytes (the kernel
    /// socket under it holds a wake byte at most: that was the count
    /// before).
    #[test]
    fn fionread_counts_the_bytes_a_carried_connection_holds() -> Result<()> {
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let port = free_port();
        let s = spawn(sockapp(&d, true, &["fionreadserver".into(), port.to_string()]), "fionreadserver");
        registered(&ctx, port)?;
        let c = spawn(sockapp(&d, true, &["client".into(), port.to_string(), "100000".into()]), "client")
            .finish(LIMIT);
        let s = s.finish(LIMIT);
        c.assert_ok();
        s.assert_ok();
        assert!(s.stderr.contains("carried over vRDMA"), "{}", s.describe());
        let (first, counted) = (printed(&s, "first").unwrap_or(0), printed(&s, "fionread").unwrap_or(0));
        assert_eq!(first + counted, 100_000, "after a first read of {first}: {}", s.describe());
        Ok(())
    }

    /// A signal the program handles (no `SA_RESTART`, every 50 ms) while
    /// its first call waits in the exchange of hellos (the server makes
    /// its first call 400 ms after its accept): the exchange goes on and
    /// the connection is carried, every byte checked. Before, the
    /// exchange failed with `EINTR` and every later call said `EINTR`:
    /// `pgbench -C -T` spun for ever in libpq, which retries such a send
    /// at once (the client here gives up after 1000 in a row).
    #[test]
    fn a_signal_during_the_exchange_of_hellos_does_not_break_the_connection() -> Result<()> {
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let port = free_port();
        let s = spawn(sockapp(&d, true, &["sleepyserver".into(), port.to_string()]), "sleepyserver");
        registered(&ctx, port)?;
        let args = ["alarmclient".into(), port.to_string(), (1u64 << 20).to_string()];
        let c = spawn(sockapp(&d, true, &args), "alarmclient").finish(LIMIT);
        let s = s.finish(LIMIT);
        c.assert_ok();
        s.assert_ok();
        assert!(c.stderr.contains("carried over vRDMA"), "{}", c.describe());
        assert!(printed(&c, "alarms").unwrap_or(0) > 0, "no alarm came: {}", c.describe());
        Ok(())
    }

    /// A non-blocking writer whose reader stops reading fills the ring
    /// and gets EAGAIN (not a hang, not an error); waiting for POLLOUT and
    /// writing on, every byte arrives in order once the reader reads
    /// again, and POLLOUT comes only with room in the ring.
    #[test]
    fn a_non_blocking_writer_facing_a_full_ring_gets_eagain_then_goes_on() -> Result<()> {
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let port = free_port();
        let s = spawn(sockapp(&d, true, &["lateserver".into(), port.to_string()]), "lateserver");
        registered(&ctx, port)?;
        // 4 ring sizes: more than the ring holds while the reader pauses.
        let args = ["nbflood".into(), port.to_string(), (1u64 << 20).to_string()];
        let c = spawn(sockapp(&d, true, &args), "nbflood").finish(LIMIT);
        let s = s.finish(LIMIT);
        c.assert_ok();
        s.assert_ok();
        assert!(c.stderr.contains("carried over vRDMA"), "{}", c.describe());
        let eagain: u64 = c
            .stdout
            .lines()
            .find_map(|l| l.strip_prefix("eagain ").and_then(|n| n.parse().ok()))
            .unwrap_or(0);
        assert!(eagain > 0, "no EAGAIN with a full ring: {}", c.describe());
        // POLLOUT is the ring's: a poll after EAGAIN returns once credits
        // came back, not at once (the kernel socket is writable all
        // along), so the writer does not spin on EAGAIN through the
        // reader's pause.
        assert!(eagain <= 16, "{eagain} EAGAINs: POLLOUT reported without room: {}", c.describe());
        Ok(())
    }

    /// A non-blocking sendfile(2) from the file's own position (no
    /// offset) that meets a full ring: the position moves by what was
    /// sent, so what an `EAGAIN` or a short write did not take is sent by
    /// the next call, and every byte arrives in order (the library read
    /// the file, moving its position, and lost those bytes before).
    #[test]
    fn a_non_blocking_sendfile_without_an_offset_loses_nothing_at_a_full_ring() -> Result<()> {
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let port = free_port();
        let s = spawn(sockapp(&d, true, &["lateserver".into(), port.to_string()]), "lateserver");
        registered(&ctx, port)?;
        let args = ["nbsendfile".into(), port.to_string(), (1u64 << 20).to_string()];
        let c = spawn(sockapp(&d, true, &args), "nbsendfile").finish(LIMIT);
        let s = s.finish(LIMIT);
        c.assert_ok();
        s.assert_ok();
        assert!(c.stderr.contains("carried over vRDMA"), "{}", c.describe());
        assert!(printed(&c, "eagain").unwrap_or(0) > 0, "no EAGAIN with a full ring: {}", c.describe());
        Ok(())
    }

    /// A writer that writes a request and then makes no call for a while
    /// (no poll either): its bytes still reach the sleeping reader (the
    /// library's progress thread sends the wake byte once they landed),
    /// so the answer is there when the writer looks.
    #[test]
    fn a_writer_that_makes_no_call_after_writing_still_wakes_its_reader() -> Result<()> {
        let _one = harness::one_at_a_time();
        let d = engine_daemon()?;
        let ctx = d.context()?;
        let port = free_port();
        let s = spawn(sockapp(&d, true, &["answer".into(), port.to_string()]), "answer");
        registered(&ctx, port)?;
        let c =
            spawn(sockapp(&d, true, &["quietwriter".into(), port.to_string()]), "quietwriter").finish(LIMIT);
        let s = s.finish(LIMIT);
        c.assert_ok();
        s.assert_ok();
        assert!(c.stderr.contains("carried over vRDMA"), "{}", c.describe());
        Ok(())
    }

    /// A number the program printed as `NAME N` on stdout.
    fn printed(f: &harness::Finished, name: &str) -> Option<u64> {
        f.stdout.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
    }

    /// A non-blocking writer that waits in epoll, edge-triggered, for
    /// `EPOLLOUT` after each `EAGAIN` from a full ring gets it once the
    /// reader drains (with its registration's `data`), and every byte
    /// arrives; level-triggered (also one-shot, armed again before each
    /// wait), it gets `EPOLLOUT` only when a write can
    /// go on (the kernel socket is writable all along: without the
    /// library's epoll registrations the edge never comes, and the level
    /// is always there).
    #[test]
    fn an_epoll_writer_facing_a_full_ring_gets_epollout_when_the_reader_drains() -> Result<()> {
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        for mode in ["et", "lt", "oneshot"] {
            let port = free_port();
            let s = spawn(sockapp(&d, true, &["lateserver".into(), port.to_string()]), "lateserver");
            registered(&ctx, port)?;
            // 4 ring sizes: more than the ring holds while the reader pauses.
            let args = ["epollflood".into(), port.to_string(), (1u64 << 20).to_string(), mode.into()];
            let c = spawn(sockapp(&d, true, &args), "epollflood").finish(LIMIT);
            let s = s.finish(LIMIT);
            c.assert_ok();
            s.assert_ok();
            assert!(c.stderr.contains("carried over vRDMA"), "{}", c.describe());
            assert!(
                printed(&c, "eagain").unwrap_or(0) > 0,
                "{mode}: no EAGAIN with a full ring: {}",
                c.describe()
            );
            if mode != "et" {
                // Each EPOLLOUT reported came with room in the ring (a
                // few may race with a write that took the room).
                let spurious = printed(&c, "spurious").expect("spurious");
                assert!(
                    spurious <= 2,
                    "{mode}: {spurious} reports of EPOLLOUT without room: {}",
                    c.describe()
                );
            }
        }
        Ok(())
    }

    /// Credit wake-up (`docs/sockets.md`, "Writing"): a writer blocked on
    /// a full ring goes on as soon as its reader gives credits back, not
    /// at the progress thread's next look. The progress thread's interval
    /// is set to 60 s here, so each wait below would need it without the
    /// wake-up: an epoll writer (edge- and level-triggered) waits at most
    /// 5 s for `EPOLLOUT` after each `EAGAIN` (the program fails if one
    /// runs out), and a blocking writer's waits for an answer are counted
    /// by the library (`credit waits W, woken K, missed M` on its close: K
    /// waits ended by an answer, none without the wake-up; M ran out,
    /// after up to 10 ms, with credits there: some may, where the answer
    /// came later than the wait's end, as on 2 loaded cores where the
    /// progress thread waits for a CPU for milliseconds; without answers
    /// every wait that saw credits come back is one). Engine and direct
    /// path; the epoll writers' reader pauses 300 ms after its first read,
    /// the blocking writer's 105 ms after each read (of 100 003 bytes at
    /// most: the ring fills again and again, and the writer, which yields
    /// 64 times before it waits, waits even on 2 loaded cores, where a
    /// yield can take milliseconds).
    #[test]
    fn a_writer_blocked_on_a_full_ring_wakes_when_credits_come_back() -> Result<()> {
        let _one = harness::one_at_a_time();
        for (path, d) in [("engine", engine_daemon()?), ("direct", DaemonProc::start()?)] {
            let ctx = d.context()?;
            for mode in ["et", "lt", "blocking"] {
                let port = free_port();
                let reader = if mode == "blocking" { "slowserver" } else { "lateserver" };
                let s = spawn(sockapp(&d, true, &[reader.into(), port.to_string()]), reader);
                registered(&ctx, port)?;
                // 16 ring sizes (8 for the blocking writer's slower reader).
                let bytes = if mode == "blocking" { 2u64 << 20 } else { 4u64 << 20 }.to_string();
                let args: Vec<String> = if mode == "blocking" {
                    vec!["client".into(), port.to_string(), bytes]
                } else {
                    vec!["epollflood".into(), port.to_string(), bytes, mode.into(), "5000".into()]
                };
                let mut cmd = sockapp(&d, true, &args);
                cmd.env("VRDMA_SOCKETS_PROGRESS_US", "60000000");
                let c = spawn(cmd, "writer").finish(LIMIT);
                let s = s.finish(LIMIT);
                c.assert_ok();
                s.assert_ok();
                assert!(c.stderr.contains("carried over vRDMA"), "{}", c.describe());
                if mode == "blocking" {
                    let (waits, woken, missed) = c
                        .stderr
                        .lines()
                        .find_map(|l| {
                            let rest = l.split("credit waits ").nth(1)?;
                            let (w, rest) = rest.split_once(", woken ")?;
                            let (k, rest) = rest.split_once(", missed ")?;
                            let (m, _late) = rest.split_once(", late ")?;
                            Some((w.parse::<u64>().ok()?, k.parse::<u64>().ok()?, m.parse::<u64>().ok()?))
                        })
                        .expect("the writer's credit counts");
                    eprintln!(
                        "{path}: blocking writer: {waits} waits for credits, {woken} ended by an answer, \
                         {missed} ran out with credits there"
                    );
                    // Without answers no wait ends by one (K = 0), and every
                    // wait that saw credits come back runs out (M).
                    assert!(
                        woken > 0 && missed <= woken,
                        "{path}: {woken} of {waits} waits for credits ended by an answer, {missed} ran out \
                         with credits there: {}",
                        c.describe()
                    );
                } else {
                    let eagain = printed(&c, "eagain").unwrap_or(0);
                    eprintln!("{path}: epoll {mode}: {eagain} EAGAINs, each woken within 5 s");
                    assert!(eagain > 0, "{path} {mode}: no EAGAIN with a full ring: {}", c.describe());
                }
            }
        }
        Ok(())
    }

    /// `select` and `pselect` as the epoll writer above: a non-blocking
    /// writer facing a full ring that waits for its socket in the write
    /// set is told it is writable only when the ring has room, so it meets
    /// few `EAGAIN`s that follow a report (the kernel socket's write set
    /// is always there: with it, every `EAGAIN` follows one, and the
    /// writer spins through thousands); the pipe in its read set, never
    /// readable, stays out of the answer.
    #[test]
    fn a_select_writer_facing_a_full_ring_is_told_writable_when_the_reader_drains() -> Result<()> {
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        for mode in ["select", "pselect"] {
            let port = free_port();
            let s = spawn(sockapp(&d, true, &["lateserver".into(), port.to_string()]), "lateserver");
            registered(&ctx, port)?;
            // 4 ring sizes: more than the ring holds while the reader pauses.
            let args = ["epollflood".into(), port.to_string(), (1u64 << 20).to_string(), mode.into()];
            let c = spawn(sockapp(&d, true, &args), "epollflood").finish(LIMIT);
            let s = s.finish(LIMIT);
            c.assert_ok();
            s.assert_ok();
            assert!(c.stderr.contains("carried over vRDMA"), "{}", c.describe());
            let eagain = printed(&c, "eagain").unwrap_or(0);
            assert!(eagain > 0, "{mode}: no EAGAIN with a full ring: {}", c.describe());
            let spurious = printed(&c, "spurious").expect("spurious");
            eprintln!("{mode}: {eagain} EAGAINs, {spurious} after a report of writability");
            assert!(
                spurious <= 2,
                "{mode}: {spurious} reports of writability without room ({eagain} EAGAINs): {}",
                c.describe()
            );
        }
        Ok(())
    }

    /// A writer idle on a full ring, waiting for writability in `poll`,
    /// `select` or a level-triggered `epoll` while its reader does not read
    /// (3 s), sleeps: the library neither looks at the ring again and
    /// again (it asks the reader for a sound, `WANT`, and polls an eventfd
    /// that the answer rings) nor keeps its progress thread ticking; and
    /// it is told writable once the reader reads. Its voluntary context
    /// switches (every thread's) during one idle second are compared with
    /// a plain TCP writer's on a full socket buffer in the same run: before,
    /// `poll`/`select` looked every 100 µs and the progress thread every
    /// 500 µs (thousands a second).
    #[test]
    fn a_writer_idle_on_a_full_ring_sleeps_until_credits_come() -> Result<()> {
        // Generous: a few wake-ups of the library's threads (the
        // progress thread's slow look, the daemon's probes) are allowed.
        const MORE: u64 = 40;
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let mut rows = Vec::new();
        for (preload, mode) in [(false, "poll"), (true, "poll"), (true, "select"), (true, "epoll")] {
            let port = free_port();
            let s = spawn(sockapp(&d, preload, &["stallserver".into(), port.to_string()]), "stallserver");
            if preload {
                registered(&ctx, port)?;
            } else {
                vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || listening(port))?;
            }
            let args = ["idlewriter".into(), port.to_string(), mode.into()];
            let c = spawn(sockapp(&d, preload, &args), "idlewriter").finish(LIMIT);
            let s = s.finish(LIMIT);
            c.assert_ok();
            s.assert_ok();
            assert_eq!(c.stderr.contains("carried over vRDMA"), preload, "{}", c.describe());
            let w = printed(&c, "idle-wakeups").expect("idle-wakeups");
            eprintln!(
                "{} {mode}: {w} voluntary switches in {} ms idle; writable {} after",
                if preload { "carried" } else { "plain TCP" },
                printed(&c, "idle-ms").unwrap_or(0),
                c.stdout.lines().find_map(|l| l.strip_prefix("writable after ")).unwrap_or("?")
            );
            rows.push((preload, mode, w));
        }
        let plain = rows[0].2;
        for &(_, mode, w) in &rows[1..] {
            assert!(
                w <= 2 * plain + MORE,
                "carried {mode}: {w} wake-ups in an idle second against plain TCP's {plain}: a periodic look"
            );
        }
        Ok(())
    }

    /// Blocking 64-byte request/response (`rr` against `becho`, no
    /// readiness call on either side): a read that empties its ring does
    /// not arm; the next read watches the ring first and arms only if the
    /// answer did not come within its spin. So most round trips cost no
    /// arming (an RDMA write) and no wake byte (a `send`, and two `recv`s
    /// to take it off); before, every read that emptied the ring armed
    /// (one arming per message, and about one wake byte). Bounded
    /// generously: at most half of the messages arm, on the engine path
    /// and the direct path (a loaded machine can outlast a spin).
    #[test]
    fn a_blocking_request_response_arms_only_when_it_must_wait() -> Result<()> {
        const ROUNDS: u64 = 2000;
        let _one = harness::one_at_a_time();
        for (path, d) in [("engine", engine_daemon()?), ("direct", DaemonProc::start()?)] {
            let ctx = d.context()?;
            let port = free_port();
            // A debug build's answers take longer than the default
            // 50 µs watch (an engine round trip each way).
            let app = |args: &[String]| {
                let mut c = sockapp(&d, true, args);
                c.env("VRDMA_SOCKETS_SPIN_US", "5000");
                c
            };
            let s = spawn(app(&["becho".into(), port.to_string()]), "becho");
            registered(&ctx, port)?;
            let c = spawn(app(&["rr".into(), port.to_string(), ROUNDS.to_string()]), "rr").finish(LIMIT);
            let s = s.finish(LIMIT);
            c.assert_ok();
            s.assert_ok();
            let counts = |f: &harness::Finished| {
                f.stderr.lines().find_map(|l| {
                    let rest = l.split("armings ").nth(1)?;
                    let (a, w) = rest.split_once(", wake bytes sent ")?;
                    Some((a.parse::<u64>().ok()?, w.trim().parse::<u64>().ok()?))
                })
            };
            let (ca, cw) = counts(&c).expect("the client's counts");
            let (sa, sw) = counts(&s).expect("the server's counts");
            eprintln!(
                "{path}: {ROUNDS} round trips, median {} ns; client armed {ca} times and sent {cw} wake \
                 bytes, server {sa} and {sw}",
                printed(&c, "median_rtt_ns").unwrap_or(0)
            );
            for (who, armings) in [("client", ca), ("server", sa)] {
                assert!(
                    armings <= ROUNDS / 2,
                    "{path}: the {who} armed {armings} times in {ROUNDS} round trips: {}",
                    c.describe()
                );
            }
        }
        Ok(())
    }

    /// An event-loop request/response (`eprr` against `epecho`: both ends
    /// non-blocking, waiting in a level-triggered `epoll` set) with lazy
    /// arming under epoll on (`VRDMA_SOCKETS_LAZY_EPOLL=1`): a
    /// non-blocking read that empties its ring does not arm, the epoll
    /// wait watches the ring first and arms only before it sleeps, so an
    /// answer that comes meanwhile costs its writer no wake byte. At most
    /// half of the messages may send one at either end; the same pair
    /// with it off, in the same run, is the anchor (every read arms: about
    /// one wake byte per message at each end). Direct path, a 5 ms watch
    /// (a debug build).
    #[test]
    fn an_epoll_request_response_sends_no_wake_bytes_with_lazy_arming() -> Result<()> {
        const ROUNDS: u64 = 1000;
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        for lazy in [false, true] {
            let port = free_port();
            let app = |args: &[String]| {
                let mut c = sockapp(&d, true, args);
                c.env("VRDMA_SOCKETS_SPIN_US", "5000")
                    .env("VRDMA_SOCKETS_LAZY_EPOLL", if lazy { "1" } else { "0" });
                c
            };
            let s = spawn(app(&["epecho".into(), port.to_string()]), "epecho");
            registered(&ctx, port)?;
            let c = spawn(app(&["eprr".into(), port.to_string(), ROUNDS.to_string()]), "eprr").finish(LIMIT);
            let s = s.finish(LIMIT);
            c.assert_ok();
            s.assert_ok();
            let counts = |f: &harness::Finished| {
                f.stderr.lines().find_map(|l| {
                    let rest = l.split("armings ").nth(1)?;
                    let (a, w) = rest.split_once(", wake bytes sent ")?;
                    Some((a.parse::<u64>().ok()?, w.trim().parse::<u64>().ok()?))
                })
            };
            let (ca, cw) = counts(&c).expect("the client's counts");
            let (sa, sw) = counts(&s).expect("the server's counts");
            eprintln!(
                "lazy {lazy}: {ROUNDS} round trips, median {} ns; client armed {ca} times and sent {cw} wake \
                 bytes, server {sa} and {sw}",
                printed(&c, "median_rtt_ns").unwrap_or(0)
            );
            for (who, wakes) in [("client", cw), ("server", sw)] {
                if lazy {
                    assert!(wakes <= ROUNDS / 2, "the {who} sent {wakes} wake bytes in {ROUNDS} round trips");
                } else {
                    assert!(wakes >= ROUNDS / 2, "anchor: the {who} sent only {wakes} wake bytes");
                }
            }
        }
        Ok(())
    }

    /// An epoll set inside another (`nestecho`: the program waits on the
    /// outer set, then takes the inner set's events without waiting, and
    /// reads until `EAGAIN`), nested before and after the connection is
    /// registered in it: the outer wait sleeps on the inner set without
    /// the library arming its connection, so its reads must arm (no lazy
    /// arming): 200 round trips complete, lazy arming on
    /// (`VRDMA_SOCKETS_LAZY_EPOLL=1`). With the nesting not seen (lazy
    /// arming under the inner set), the server waits on the outer set
    /// after its first read for ever (its 10 s, then fails).
    #[test]
    fn a_nested_epoll_set_keeps_waking_its_waiter() -> Result<()> {
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        for mode in ["before", "after"] {
            let port = free_port();
            // Lazy arming on (off by default): the nesting must turn it off.
            let lazy = |args: &[String]| {
                let mut c = sockapp(&d, true, args);
                c.env("VRDMA_SOCKETS_LAZY_EPOLL", "1");
                c
            };
            let s = spawn(lazy(&["nestecho".into(), port.to_string(), mode.into()]), "nestecho");
            registered(&ctx, port)?;
            let c = spawn(lazy(&["eprr".into(), port.to_string(), "200".into()]), "eprr").finish(LIMIT);
            let s = s.finish(LIMIT);
            c.assert_ok();
            s.assert_ok();
            assert!(s.stderr.contains("carried over vRDMA"), "{}", s.describe());
        }
        Ok(())
    }

    /// A connection read with blocking reads (which do not arm: above)
    /// and then waited on in `poll`, or registered in an `epoll` set: the
    /// readiness call arms it first, so that a wake byte left over from
    /// the blocking reads does not read as bytes (300 ms with nothing
    /// sent must report nothing), and bytes sent later are reported
    /// (`sockapp lazyserver`). Engine path and direct path.
    #[test]
    fn a_connection_read_blocking_and_then_polled_reports_exactly_its_bytes() -> Result<()> {
        let _one = harness::one_at_a_time();
        for (path, d) in [("engine", engine_daemon()?), ("direct", DaemonProc::start()?)] {
            let ctx = d.context()?;
            for mode in ["poll", "epoll"] {
                let port = free_port();
                let s = spawn(
                    sockapp(&d, true, &["lazyserver".into(), port.to_string(), mode.into()]),
                    "lazyserver",
                );
                registered(&ctx, port)?;
                let c = spawn(sockapp(&d, true, &["lazyclient".into(), port.to_string()]), "lazyclient")
                    .finish(LIMIT);
                let s = s.finish(LIMIT);
                c.assert_ok();
                s.assert_ok();
                assert!(s.stderr.contains("carried over vRDMA"), "{}", s.describe());
                eprintln!("{path} {mode}: {}", s.stdout.lines().last().unwrap_or(""));
            }
        }
        Ok(())
    }

    /// A server that closes each connection after its answer, and a client
    /// that makes N connections one after another, each read to its end:
    /// carried, each end is read at once (the server's close is told
    /// through the ring), not after the QP's retry timeout (about 0.5 s)
    /// of an arming towards the closed server's QP. The same loop over
    /// plain TCP in the same run is the anchor: both must make all N
    /// within the same bound, N × 150 ms (without the close told through
    /// the ring, 12 to 19 of 24 connections fit in it, about 0.3 s each;
    /// with it, about 25 ms each, debug build, 2 loaded cores).
    #[test]
    fn connections_closed_by_the_server_end_at_once() -> Result<()> {
        const N: u64 = 24;
        let budget_ms = N * 150;
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let ctx = d.context()?;
        let mut done = Vec::new();
        for preload in [false, true] {
            let port = free_port();
            let s = spawn(
                sockapp(&d, preload, &["closeserver".into(), port.to_string(), N.to_string()]),
                "closeserver",
            );
            if preload {
                registered(&ctx, port)?;
            } else {
                vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || listening(port))?;
            }
            let args = ["closeclient".into(), port.to_string(), N.to_string(), budget_ms.to_string()];
            let c = spawn(sockapp(&d, preload, &args), "closeclient").finish(LIMIT);
            c.assert_ok();
            let k = printed(&c, "done").expect("done");
            if k == N {
                s.finish(LIMIT).assert_ok();
            }
            assert_eq!(c.stderr.matches("carried over vRDMA").count() as u64, if preload { k } else { 0 });
            eprintln!(
                "{}: {k} connections in {} ms",
                if preload { "carried" } else { "plain TCP" },
                printed(&c, "ms").unwrap_or(0)
            );
            done.push(k);
        }
        assert_eq!(done, [N, N], "connections made within {budget_ms} ms: plain TCP, carried");
        assert_eq!(ctx.sock_counts()?.carried, N);
        Ok(())
    }

    fn have_lib() -> bool {
        Path::new(&built("libvrdma_sockets.so")).exists()
    }

    #[test]
    fn two_preloaded_programs_move_16_mib_over_vrdma() -> Result<()> {
        let _one = harness::one_at_a_time();
        assert!(have_lib());
        let d = DaemonProc::start()?;
        let (c, carried) = pair(&d, true, true)?;
        // Announced by the client, claimed by the server: carried.
        assert_eq!((c.announced, c.carried, c.refused_claims), (1, 1, 0), "{c:?}");
        assert!(carried);
        Ok(())
    }

    #[test]
    fn a_preloaded_server_and_a_plain_client_talk_tcp() -> Result<()> {
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let (c, carried) = pair(&d, true, false)?;
        assert!(!carried);
        // The server's claim found no announcement.
        assert_eq!((c.announced, c.carried, c.refused_claims), (0, 0, 1), "{c:?}");
        Ok(())
    }

    #[test]
    fn a_preloaded_client_and_a_plain_server_talk_tcp() -> Result<()> {
        let _one = harness::one_at_a_time();
        let d = DaemonProc::start()?;
        let (c, carried) = pair(&d, false, true)?;
        assert!(!carried);
        // No listener was registered, so nothing was announced.
        assert_eq!((c.announced, c.carried, c.refused_claims, c.listeners), (0, 0, 0, 0), "{c:?}");
        Ok(())
    }

    /// IPv6 between two programs on one host (`docs/sockets.md`,
    /// "IPv6"): 4 MiB, every byte checked by the server.
    mod ipv6 {
        use super::*;

        const BYTES: u64 = 4 << 20;

        /// Whether this host has IPv6 loopback (else the tests skip: a
        /// kernel or container without IPv6; under
        /// `VRDMA_TEST_STRICT=1`, as CI runs them, they fail instead).
        fn have_ipv6() -> bool {
            let ok = std::net::TcpListener::bind("[::1]:0").is_ok();
            if !ok {
                vrdma_it::skip("no IPv6 loopback on this host");
            }
            ok
        }

        fn run(d: &DaemonProc, preload: bool, args: &[&str], env: &[(&str, &str)], name: &str) -> Running {
            let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
            let mut c = sockapp(d, preload, &args);
            c.envs(env.iter().copied());
            spawn(c, name)
        }

        /// A preloaded server on `bind` (`v6only`: `IPV6_V6ONLY` set),
        /// registered as `listeners` addresses.
        fn server(
            d: &DaemonProc,
            ctx: &vrdma::Context,
            bind: &str,
            v6only: bool,
            port: u16,
            listeners: u32,
        ) -> Result<Running> {
            let v6only = if v6only { "1" } else { "0" };
            let env = [("SOCKAPP_BIND", bind), ("SOCKAPP_V6ONLY", v6only)];
            let s = run(d, true, &["server", &port.to_string()], &env, "server");
            vrdma_it::wait_until(Duration::from_secs(20), "the server's listener registered", || {
                listening(port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(listeners)
            })?;
            Ok(s)
        }

        /// A preloaded client to `host`; both ends must succeed, and
        /// whether it was carried is returned.
        fn client(d: &DaemonProc, s: Running, host: &str, port: u16) -> Result<bool> {
            client_from(d, s, None, host, port)
        }

        /// [`client`], its socket bound to `from` (port 0) first if given.
        fn client_from(
            d: &DaemonProc,
            s: Running,
            from: Option<&str>,
            host: &str,
            port: u16,
        ) -> Result<bool> {
            let mut env = vec![("SOCKAPP_HOST", host)];
            env.extend(from.map(|f| ("SOCKAPP_CLIENT_BIND", f)));
            let c = run(d, true, &["client", &port.to_string(), &BYTES.to_string()], &env, "client");
            let c = c.finish(LIMIT);
            let s = s.finish(LIMIT);
            c.assert_ok();
            s.assert_ok();
            const CARRIED: &str = "carried over vRDMA";
            let carried = c.stderr.contains(CARRIED);
            assert_eq!(carried, s.stderr.contains(CARRIED), "{}\n{}", c.describe(), s.describe());
            Ok(carried)
        }

        /// `[::1]` to a server on `[::1]`: carried, as `127.0.0.1` is.
        #[test]
        fn ipv6_loopback_is_carried() -> Result<()> {
            if !have_ipv6() {
                return Ok(());
            }
            let _one = harness::one_at_a_time();
            let d = DaemonProc::start()?;
            let ctx = d.context()?;
            let port = free_port();
            let s = server(&d, &ctx, "::1", false, port, 1)?;
            assert!(client(&d, s, "::1", port)?, "not carried");
            let c = ctx.sock_counts()?;
            assert_eq!((c.announced, c.carried, c.refused_claims), (1, 1, 0), "{c:?}");
            Ok(())
        }

        /// A dual-stack `::` server registers `0.0.0.0` and `[::]`: a
        /// client to `127.0.0.1` (a v4-mapped connection at the server),
        /// one to `[::1]` and an unbound IPv6 client to
        /// `[::ffff:127.0.0.1]` (bound to `[::]:0` before it announces)
        /// are carried, and so is one to `localhost`, whichever family
        /// it resolves to first (Debian's is `::1` for many programs).
        #[test]
        fn ipv6_a_dual_stack_server_carries_both_families() -> Result<()> {
            if !have_ipv6() {
                return Ok(());
            }
            let _one = harness::one_at_a_time();
            let d = DaemonProc::start()?;
            let ctx = d.context()?;
            for (i, host) in ["127.0.0.1", "::1", "::ffff:127.0.0.1", "localhost"].into_iter().enumerate() {
                let port = free_port();
                let s = server(&d, &ctx, "::", false, port, 2)?;
                assert!(client(&d, s, host, port)?, "{host}: not carried");
                let c = ctx.sock_counts()?;
                let n = i as u64 + 1;
                assert_eq!((c.announced, c.carried, c.refused_claims), (n, n, 0), "{host}: {c:?}");
                vrdma_it::wait_until(Duration::from_secs(10), "the listener gone", || {
                    ctx.sock_counts().ok().map(|c| c.listeners) == Some(0)
                })?;
            }
            Ok(())
        }

        /// A connection to an unspecified address goes where the kernel
        /// sends it from the client's bound address: an IPv4 client
        /// bound to `127.0.0.2` connecting to `0.0.0.0` reaches
        /// `127.0.0.2`, and an IPv6 one bound to `::ffff:127.0.0.2`
        /// connecting to `::` reaches `::ffff:127.0.0.1`. Announced as
        /// such, both are claimed at once: carried, and no announcement
        /// was abandoned (a wrong tuple waits the whole claim wait, is
        /// abandoned and goes TCP).
        #[test]
        fn ipv6_a_bound_client_of_the_unspecified_address_is_carried() -> Result<()> {
            let _one = harness::one_at_a_time();
            let d = DaemonProc::start()?;
            let ctx = d.context()?;
            let mut cases = vec![("0.0.0.0", 1, "127.0.0.2", "0.0.0.0")];
            if have_ipv6() {
                cases.push(("::", 2, "::ffff:127.0.0.2", "::"));
            }
            for (i, (bind, listeners, from, host)) in cases.into_iter().enumerate() {
                let port = free_port();
                let s = server(&d, &ctx, bind, false, port, listeners)?;
                assert!(client_from(&d, s, Some(from), host, port)?, "{from} -> {host}: not carried");
                let c = ctx.sock_counts()?;
                let n = i as u64 + 1;
                assert_eq!(
                    (c.announced, c.carried, c.abandoned, c.refused_claims),
                    (n, n, 0, 0),
                    "{from} -> {host}: {c:?}"
                );
                vrdma_it::wait_until(Duration::from_secs(10), "the listener gone", || {
                    ctx.sock_counts().ok().map(|c| c.listeners) == Some(0)
                })?;
            }
            Ok(())
        }

        /// A v6only `[::]` server is registered (it refuses nothing) but
        /// owns IPv6 only: a v4 client to `127.0.0.1` of that port, which
        /// reaches a plain IPv4 server there, stays TCP and is announced
        /// nowhere; a client to `[::1]` is carried.
        #[test]
        fn ipv6_a_v6only_server_carries_only_ipv6() -> Result<()> {
            if !have_ipv6() {
                return Ok(());
            }
            let _one = harness::one_at_a_time();
            let d = DaemonProc::start()?;
            let ctx = d.context()?;
            let port = free_port();
            let s6 = server(&d, &ctx, "::", true, port, 1)?;
            let s4 = run(
                &d,
                false,
                &["server", &port.to_string()],
                &[("SOCKAPP_BIND", "127.0.0.1")],
                "plain v4 server",
            );
            // /proc/net/tcp has the IPv4 listener (the v6only one is in tcp6).
            let want = format!(":{port:04X}");
            vrdma_it::wait_until(Duration::from_secs(20), "the v4 server listens", || {
                std::fs::read_to_string("/proc/net/tcp").unwrap_or_default().lines().skip(1).any(|l| {
                    let cols: Vec<&str> = l.split_whitespace().collect();
                    cols.len() > 3 && cols[1].ends_with(&want) && cols[3] == "0A"
                })
            })?;
            assert!(!client(&d, s4, "127.0.0.1", port)?, "a v4 connection carried by a v6only listener");
            let c = ctx.sock_counts()?;
            assert_eq!((c.announced, c.carried), (0, 0), "{c:?}");
            assert!(client(&d, s6, "::1", port)?, "not carried");
            let c = ctx.sock_counts()?;
            assert_eq!((c.announced, c.carried, c.refused_claims), (1, 1, 0), "{c:?}");
            Ok(())
        }
    }

    /// Link-local IPv6 between two programs on one host (`docs/sockets.md`,
    /// "Link-local"): the registry keys a link-local address with its
    /// scope, so the same address on two interfaces is two keys. Each test
    /// makes a network namespace of its own with two veth pairs, `fe80::1`
    /// on one end of each (`nodad`), and runs the programs in it (their
    /// daemon is the test's: its socket is a path).
    mod link_local {
        use super::*;
        use vrdma_it::run_cmd;

        const BYTES: u64 = 1 << 20;
        const CARRIED: &str = "carried over vRDMA";

        /// A namespace with `fe80::1/64` on two interfaces, removed on drop.
        struct TwoLinks {
            ns: String,
            /// The interfaces' indices (scope ids) in it.
            index: [u32; 2],
        }

        impl TwoLinks {
            fn create() -> Result<Option<TwoLinks>> {
                if let Some(why) = vrdma_it::netns_unavailable() {
                    vrdma_it::skip(format!("link-local tests: {why}"));
                    return Ok(None);
                }
                static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
                let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let ns = format!("vrdma-ll-{}-{n}", std::process::id());
                run_cmd(&["ip", "netns", "add", &ns])?;
                let mut links = TwoLinks { ns, index: [0, 0] };
                let ns = links.ns.clone();
                let ns = ns.as_str();
                run_cmd(&["ip", "-n", ns, "link", "set", "lo", "up"])?;
                for i in 0..2 {
                    let (dev, peer) = (format!("ll6d{i}"), format!("ll6p{i}"));
                    run_cmd(&["ip", "-n", ns, "link", "add", &dev, "type", "veth", "peer", "name", &peer])?;
                    for d in [&dev, &peer] {
                        run_cmd(&["ip", "-n", ns, "link", "set", d, "up"])?;
                    }
                    run_cmd(&["ip", "-n", ns, "-6", "addr", "add", "fe80::1/64", "dev", &dev, "nodad"])?;
                    let out = Command::new("ip")
                        .args(["netns", "exec", ns, "cat", &format!("/sys/class/net/{dev}/ifindex")])
                        .output()?;
                    links.index[i] = String::from_utf8_lossy(&out.stdout).trim().parse()?;
                }
                Ok(Some(links))
            }

            /// The sockets test program in the namespace.
            fn app(&self, d: &DaemonProc, preload: bool, args: &[&str], env: &[(&str, &str)]) -> Command {
                let exe = vrdma_it::peer_exe().with_file_name("vrdma-it-sockapp");
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &self.ns]).arg(exe).args(args);
                c.env(vrdma::SOCKET_ENV, &d.socket).env("VRDMA_SOCKETS_DEBUG", "1");
                if preload {
                    c.env("LD_PRELOAD", built("libvrdma_sockets.so"));
                }
                c.envs(env.iter().copied());
                c
            }

            /// A server on `bind` (`port`), waited for until the tenant
            /// registers `listeners` addresses (a preloaded one) or it
            /// said it listens (a plain one).
            fn server(
                &self,
                d: &DaemonProc,
                ctx: &vrdma::Context,
                preload: bool,
                bind: &str,
                port: u16,
                listeners: u32,
            ) -> Result<Running> {
                self.server_with(d, ctx, preload, bind, port, listeners, &[])
            }

            /// [`Self::server`] with more of the program's environment.
            #[allow(clippy::too_many_arguments)]
            fn server_with(
                &self,
                d: &DaemonProc,
                ctx: &vrdma::Context,
                preload: bool,
                bind: &str,
                port: u16,
                listeners: u32,
                env: &[(&str, &str)],
            ) -> Result<Running> {
                let mut all = vec![("SOCKAPP_BIND", bind)];
                all.extend(env.iter().copied());
                let s = spawn(self.app(d, preload, &["server", &port.to_string()], &all), bind);
                // `ip netns exec` execs the program: its pid is the server's.
                let pid = s.pid();
                vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
                    listening6_in(pid, port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(listeners)
                })?;
                Ok(s)
            }

            /// A preloaded client to `host` (bound to `from` first if
            /// given), finished.
            fn client(&self, d: &DaemonProc, from: Option<&str>, host: &str, port: u16) -> Finished {
                self.client_with(d, from, host, port, &[])
            }

            /// [`Self::client`] with more of the program's environment.
            fn client_with(
                &self,
                d: &DaemonProc,
                from: Option<&str>,
                host: &str,
                port: u16,
                more: &[(&str, &str)],
            ) -> Finished {
                let mut env = vec![("SOCKAPP_HOST", host)];
                env.extend(from.map(|f| ("SOCKAPP_CLIENT_BIND", f)));
                env.extend(more.iter().copied());
                let c = self.app(d, true, &["client", &port.to_string(), &BYTES.to_string()], &env);
                spawn(c, "client").finish(LIMIT)
            }

            fn at(&self, i: usize) -> String {
                format!("fe80::1%{}", self.index[i])
            }
        }

        /// Whether a socket of process `pid`'s network namespace listens
        /// on IPv6 `port` (its /proc/PID/net/tcp6).
        fn listening6_in(pid: i32, port: u16) -> bool {
            let want = format!(":{port:04X}");
            let tcp6 = std::fs::read_to_string(format!("/proc/{pid}/net/tcp6")).unwrap_or_default();
            tcp6.lines().skip(1).any(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                cols.len() > 3 && cols[1].ends_with(&want) && cols[3] == "0A"
            })
        }

        impl Drop for TwoLinks {
            fn drop(&mut self) {
                // The veth pairs go with the namespace.
                let _ = run_cmd(&["ip", "netns", "del", &self.ns]);
            }
        }

        /// Both ends succeeded; whether both say the connection was carried.
        fn carried(c: &Finished, s: &Finished) -> bool {
            c.assert_ok();
            s.assert_ok();
            let carried = c.stderr.contains(CARRIED);
            assert_eq!(carried, s.stderr.contains(CARRIED), "{}\n{}", c.describe(), s.describe());
            carried
        }

        /// A client to `fe80::1%IFINDEX`, of a server bound to that address
        /// with its scope and of a dual-stack `::` server: carried, each
        /// claimed at once (nothing abandoned: the two ends named the
        /// connection alike, scope included).
        #[test]
        fn link_local_on_one_host_is_carried() -> Result<()> {
            let Some(net) = TwoLinks::create()? else { return Ok(()) };
            let _one = harness::one_at_a_time();
            let d = DaemonProc::start()?;
            let ctx = d.context()?;
            for (n, (bind, listeners)) in [(net.at(0), 1), ("::".to_string(), 2)].into_iter().enumerate() {
                let port = free_port();
                let s = net.server(&d, &ctx, true, &bind, port, listeners)?;
                let c = net.client(&d, None, &net.at(0), port);
                let s = s.finish(LIMIT);
                assert!(carried(&c, &s), "{bind}: not carried\n{}\n{}", c.describe(), s.describe());
                let claimed = format!("claimed [fe80::1%{}]", net.index[0]);
                assert!(s.stderr.contains(&claimed), "{bind}: {}", s.describe());
                let k = n as u64 + 1;
                let c = ctx.sock_counts()?;
                assert_eq!(
                    (c.announced, c.carried, c.abandoned, c.refused_claims),
                    (k, k, 0, 0),
                    "{bind}: {c:?}"
                );
                vrdma_it::wait_until(Duration::from_secs(10), "the listener gone", || {
                    ctx.sock_counts().ok().map(|c| c.listeners) == Some(0)
                })?;
            }
            Ok(())
        }

        /// `fe80::1` on two interfaces, a server bound to each (one port):
        /// while only the first's is preloaded, a client of the second's
        /// stays plain TCP and announces nothing (with the scope out of the
        /// key it was the first's listener's); with both preloaded each
        /// client is carried to its own server, claimed by it alone.
        #[test]
        fn the_same_link_local_address_on_two_interfaces_is_two() -> Result<()> {
            let Some(net) = TwoLinks::create()? else { return Ok(()) };
            let _one = harness::one_at_a_time();
            let d = DaemonProc::start()?;
            let ctx = d.context()?;
            let port = free_port();
            let s0 = net.server(&d, &ctx, true, &net.at(0), port, 1)?;
            let s1 = net.server(&d, &ctx, false, &net.at(1), port, 1)?;
            let c1 = net.client(&d, None, &net.at(1), port);
            assert!(!carried(&c1, &s1.finish(LIMIT)), "a plain server's connection carried");
            let c = ctx.sock_counts()?;
            assert_eq!((c.announced, c.carried, c.refused_claims), (0, 0, 0), "{c:?}");
            let c0 = net.client(&d, None, &net.at(0), port);
            assert!(carried(&c0, &s0.finish(LIMIT)), "not carried");
            vrdma_it::wait_until(Duration::from_secs(10), "the listener gone", || {
                ctx.sock_counts().ok().map(|c| c.listeners) == Some(0)
            })?;

            let port = free_port();
            let s0 = net.server(&d, &ctx, true, &net.at(0), port, 1)?;
            let s1 = net.server(&d, &ctx, true, &net.at(1), port, 2)?;
            for (i, s) in [(1, s1), (0, s0)] {
                let c = net.client(&d, None, &net.at(i), port);
                let s = s.finish(LIMIT);
                assert!(carried(&c, &s), "interface {i}: not carried");
                let mine = format!("claimed [fe80::1%{}]", net.index[i]);
                assert!(s.stderr.contains(&mine), "interface {i}: {}", s.describe());
            }
            let c = ctx.sock_counts()?;
            assert_eq!((c.announced, c.carried, c.abandoned, c.refused_claims), (3, 3, 0, 0), "{c:?}");
            Ok(())
        }

        /// A connect to `fe80::1` with scope 0 from an unbound socket is
        /// refused by the kernel (`EINVAL`), and so it is under the
        /// library, announcing nothing; from a socket bound to `fe80::1`
        /// with a scope the kernel takes that scope, and so does the
        /// library: carried.
        #[test]
        fn a_link_local_connect_without_a_scope_is_the_kernels() -> Result<()> {
            let Some(net) = TwoLinks::create()? else { return Ok(()) };
            let _one = harness::one_at_a_time();
            let d = DaemonProc::start()?;
            let ctx = d.context()?;
            let port = free_port();
            let s = net.server(&d, &ctx, true, "::", port, 2)?;
            let c = net.client(&d, None, "fe80::1", port);
            assert!(!c.status.success(), "{}", c.describe());
            assert!(c.stderr.contains("Invalid argument"), "{}", c.describe());
            let c = ctx.sock_counts()?;
            assert_eq!((c.announced, c.carried), (0, 0), "{c:?}");
            let c = net.client(&d, Some(&net.at(1)), "fe80::1", port);
            let s = s.finish(LIMIT);
            assert!(carried(&c, &s), "not carried");
            let mine = format!("claimed [fe80::1%{}]", net.index[1]);
            assert!(s.stderr.contains(&mine), "{}", s.describe());
            let c = ctx.sock_counts()?;
            assert_eq!((c.announced, c.carried, c.abandoned), (1, 1, 0), "{c:?}");
            Ok(())
        }

        /// A `[::]` listener registered by a library that names no scopes
        /// (an older build's, as the test's context registers it: a plain
        /// `Sock` call) owns no link-local destination: its library never
        /// claims one, so a client of `fe80::1%IFINDEX` asks, hears no,
        /// and connects plain TCP at once (nothing announced, nothing
        /// abandoned after a wait for a claim).
        #[test]
        fn an_older_librarys_unspecified_listener_owns_no_link_local_destination() -> Result<()> {
            let Some(net) = TwoLinks::create()? else { return Ok(()) };
            let _one = harness::one_at_a_time();
            let d = DaemonProc::start()?;
            let ctx = d.context()?;
            let port = free_port();
            let any: std::net::SocketAddr = format!("[::]:{port}").parse()?;
            ctx.sock_listen(any)?;
            let s = net.server(&d, &ctx, false, "::", port, 1)?;
            let c = net.client(&d, None, &net.at(0), port);
            assert!(!carried(&c, &s.finish(LIMIT)), "carried by a plain server");
            let c = ctx.sock_counts()?;
            assert_eq!((c.announced, c.abandoned, c.carried), (0, 0, 0), "{c:?}");
            ctx.sock_unlisten(any)?;
            Ok(())
        }

        /// A `::` listener bound to a device (`SO_BINDTODEVICE`) owns no
        /// link-local destination: a plain listener of its port may sit on
        /// another interface, as here, whose client must not wait for a
        /// claim. A client bound to a device alone (`::`, scope 0 to
        /// `fe80::1`) is scoped by it, as the kernel scopes it: carried
        /// to the undevice-bound `::` server.
        #[test]
        fn link_local_and_bound_devices() -> Result<()> {
            let Some(net) = TwoLinks::create()? else { return Ok(()) };
            let _one = harness::one_at_a_time();
            let d = DaemonProc::start()?;
            let ctx = d.context()?;
            let port = free_port();
            // The plain one first: its start is seen as the port listening.
            let s1 = net.server_with(&d, &ctx, false, "::", port, 0, &[("SOCKAPP_DEVICE", "ll6d1")])?;
            let s0 = net.server_with(&d, &ctx, true, "::", port, 2, &[("SOCKAPP_DEVICE", "ll6d0")])?;
            let c = net.client(&d, None, &net.at(1), port);
            assert!(!carried(&c, &s1.finish(LIMIT)), "carried by a plain server");
            let c = ctx.sock_counts()?;
            assert_eq!((c.announced, c.abandoned, c.carried), (0, 0, 0), "{c:?}");
            drop(s0);
            vrdma_it::wait_until(Duration::from_secs(10), "the listener gone", || {
                ctx.sock_counts().ok().map(|c| c.listeners) == Some(0)
            })?;

            let port = free_port();
            let s = net.server(&d, &ctx, true, "::", port, 2)?;
            let c = net.client_with(&d, Some("::"), "fe80::1", port, &[("SOCKAPP_DEVICE", "ll6d1")]);
            let s = s.finish(LIMIT);
            assert!(carried(&c, &s), "not carried");
            let mine = format!("claimed [fe80::1%{}]", net.index[1]);
            assert!(s.stderr.contains(&mine), "{}", s.describe());
            let c = ctx.sock_counts()?;
            assert_eq!((c.announced, c.carried, c.abandoned), (1, 1, 0), "{c:?}");
            Ok(())
        }

        /// One link-local end and one global end on one host (a client
        /// bound to one connecting to the other): plain TCP for both, at
        /// once (nothing announced, nothing claimed).
        #[test]
        fn a_link_local_end_with_a_global_end_stays_tcp() -> Result<()> {
            let Some(net) = TwoLinks::create()? else { return Ok(()) };
            run_cmd(&["ip", "-n", &net.ns, "-6", "addr", "add", "fd00::1/64", "dev", "ll6d0", "nodad"])?;
            let _one = harness::one_at_a_time();
            let d = DaemonProc::start()?;
            let ctx = d.context()?;
            for (from, to) in [(net.at(0), "fd00::1".to_string()), ("fd00::1".to_string(), net.at(0))] {
                let port = free_port();
                let s = net.server(&d, &ctx, true, "::", port, 2)?;
                let c = net.client(&d, Some(&from), &to, port);
                assert!(!carried(&c, &s.finish(LIMIT)), "{from} -> {to} carried");
                let c = ctx.sock_counts()?;
                assert_eq!((c.announced, c.abandoned, c.refused_claims), (0, 0, 0), "{from} -> {to}: {c:?}");
                vrdma_it::wait_until(Duration::from_secs(10), "the listener gone", || {
                    ctx.sock_counts().ok().map(|c| c.listeners) == Some(0)
                })?;
            }
            Ok(())
        }
    }
}
