//! Issue 19, item 4 with a real guest: a TCG guest on host A streams
//! sequence-numbered RDMA traffic to a process on host B through vRDMA,
//! and QEMU live-migrates the VM to host C (QEMU's own `migrate`, over
//! QMP, to a second QEMU started with `-incoming` against C's daemon)
//! while the traffic runs, with the operator's steps (`vrdma migrate
//! pause|export|import|finish|resume`) around QEMU's switch-over, as
//! `docs/migration.md` ("Worked example: QEMU moves a VM") describes.
//!
//! The three hosts are daemons (`vrdma daemon`) in three network
//! namespaces on a bridge, each linked to the others; VM `t` is
//! configured on A and C alike. Both QEMUs run here (their ports and
//! region are Unix sockets and memfds, which reach across namespaces);
//! the migration stream goes over a Unix socket.
//!
//! The guest runs `tests/c/seqstream.c` (built here with `cc` against
//! the host's verbs headers, put in the image, run on vRDMA's drop-in):
//! sends with immediate and RDMA writes with immediate carrying their
//! sequence numbers, one every 3 ms, 16 in flight, querying its QP
//! every 20th; it checks that every completion comes once and in order.
//! B's receiver (this test, through the library) checks that every
//! message arrives once, in order, with its bytes. Nothing tells the
//! guest's program or its library about the move: the library finds
//! its port answered by C's daemon (`Ended { NoSession }`), adopts its
//! context there and carries on.
//!
//! One guest boots (TCG: tens of seconds); the binary prints its times
//! and the pause B saw.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use vrdma::{WcOpcode, WcStatus};
use vrdma_guest::{image, Guest, GuestSpec};
use vrdma_it::harness::built;

const VRDMA: &str = env!("CARGO_BIN_EXE_vrdma");
/// A guest command's limit.
const T: Duration = Duration::from_secs(120);
/// Messages streamed, their length, the pace.
const COUNT: u64 = 3000;
const LEN: usize = 64;
const PACE_US: u32 = 3000;
/// B's receives, each 256 bytes, at `RECV_AT` in its region; the RDMA
/// writes land at `[0, COUNT * LEN)`.
const RECVS: u64 = 256;
const RECV_AT: usize = 1 << 20;
/// Messages B must have before each move (since the last).
const BEFORE: u64 = 60;

/// A daemon process (`vrdma daemon`), killed by its pid on drop.
struct Daemon {
    child: Child,
    socket: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn start_daemon(dir: &Path, name: &str, ns: &str, toml: &str) -> Daemon {
    // A directory each: a VM's port socket lies beside the daemon's.
    let dir = dir.join(name);
    std::fs::create_dir(&dir).unwrap();
    let socket = dir.join(format!("{name}.sock"));
    let config = dir.join(format!("{name}.toml"));
    std::fs::write(&config, toml).unwrap();
    let child = Command::new("ip")
        .args(["netns", "exec", ns, VRDMA, "daemon", "--socket"])
        .arg(&socket)
        .arg("--config")
        .arg(&config)
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn the daemon");
    let mut d = Daemon { child, socket };
    let end = Instant::now() + Duration::from_secs(20);
    while vrdma::Context::open_at(&d.socket).is_err() {
        assert!(Instant::now() < end, "the daemon {name} did not come up");
        assert!(matches!(d.child.try_wait(), Ok(None)), "the daemon {name} exited");
        std::thread::sleep(Duration::from_millis(20));
    }
    d
}

/// A QMP connection to a QEMU (`-qmp unix:PATH,server=on,wait=off`).
struct Qmp {
    w: UnixStream,
    r: BufReader<UnixStream>,
}

impl Qmp {
    fn connect(path: &Path) -> Qmp {
        let end = Instant::now() + Duration::from_secs(30);
        let s = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) => {
                    assert!(Instant::now() < end, "QMP at {}: {e}", path.display());
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        };
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut q = Qmp { w: s.try_clone().unwrap(), r: BufReader::new(s) };
        let mut greeting = String::new();
        q.r.read_line(&mut greeting).expect("QMP greeting");
        assert!(greeting.contains("QMP"), "QMP said {greeting}");
        q.exec(r#"{"execute":"qmp_capabilities"}"#);
        q
    }

    /// Sends `cmd` and returns its answer's `return` (events skipped);
    /// an `error` fails.
    fn exec(&mut self, cmd: &str) -> serde_json::Value {
        writeln!(self.w, "{cmd}").unwrap();
        for _ in 0..1000 {
            let mut l = String::new();
            let n = self.r.read_line(&mut l).unwrap_or_else(|e| panic!("QMP, after {cmd}: {e}"));
            assert!(n > 0, "QMP closed after {cmd}");
            let v: serde_json::Value =
                serde_json::from_str(&l).unwrap_or_else(|e| panic!("QMP said {l}: {e}"));
            if let Some(r) = v.get("return") {
                return r.clone();
            }
            assert!(v.get("error").is_none(), "QMP {cmd}: {l}");
        }
        panic!("no answer to {cmd}");
    }

    fn status(&mut self) -> String {
        self.exec(r#"{"execute":"query-status"}"#)["status"].as_str().unwrap_or("?").to_string()
    }
}

/// `vrdma --socket S migrate ARGS`, which must succeed.
fn operator(socket: &Path, args: &[&str]) -> Duration {
    let t0 = Instant::now();
    let out = Command::new(VRDMA).arg("--socket").arg(socket).arg("migrate").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "vrdma migrate {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    t0.elapsed()
}

/// Copies VM `t`'s region on `from` into its region on `to` (the last
/// pass over the region after the pause, which QEMU's migration cannot
/// make: it does not see the daemon's writes).
fn copy_region(from: &Path, to: &Path) {
    let a = vrdma::vm::attach_at(from, "t").expect("attach t at the source");
    let c = vrdma::vm::attach_at(to, "t").expect("attach t at the destination");
    assert_eq!(a.region_len, c.region_len);
    let (a, c) = (std::fs::File::from(a.region), std::fs::File::from(c.region));
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0u64;
    while at < c.metadata().unwrap().len() {
        let n = a.read_at(&mut buf, at).unwrap();
        assert!(n > 0, "the source's region ends at {at}");
        c.write_all_at(&buf[..n], at).unwrap();
        at += n as u64;
    }
}

/// Starts `cmd` in the background in `g` under `timeout`, its output and
/// status in `/tmp/<tag>.*`.
fn guest_bg(g: &mut Guest, tag: &str, secs: u32, cmd: &str) {
    g.check(
        &format!(
            "rm -f /tmp/{tag}.*; ( timeout {secs} {cmd} >/tmp/{tag}.out 2>&1; echo $? >/tmp/{tag}.st ) \
             </dev/null >/dev/null 2>&1 &"
        ),
        T,
    )
    .unwrap();
}

/// Waits (bounded) for a line starting `prefix` in `tag`'s output.
fn guest_line(g: &mut Guest, tag: &str, prefix: &str) -> String {
    let script = format!(
        "i=0; while [ $i -lt 900 ]; do l=$(grep '^{prefix}' /tmp/{tag}.out) && {{ echo \"$l\"; exit 0; }}; \
         [ -e /tmp/{tag}.st ] && {{ echo ended; cat /tmp/{tag}.out; exit 1; }}; sleep 0.1; i=$((i+1)); done; \
         echo 'no {prefix}'; cat /tmp/{tag}.out; exit 1"
    );
    g.check(&script, T).unwrap_or_else(|e| panic!("{tag} in the guest: {e}"))
}

fn guest_wait(g: &mut Guest, tag: &str) -> (i32, String) {
    let script = format!(
        "i=0; while [ ! -e /tmp/{tag}.st ] && [ $i -lt 1000 ]; do sleep 0.1; i=$((i+1)); done; \
         cat /tmp/{tag}.out; [ -e /tmp/{tag}.st ] || {{ echo '(still running)'; exit 124; }}; exit $(cat /tmp/{tag}.st)"
    );
    g.run(&script, T).unwrap_or_else(|e| panic!("{tag} in the guest: {e}"))
}

/// The spec of VM `t` on the daemon at `socket`, QMP at `qmp`.
fn spec(img: &image::Image, socket: &Path, qmp: &Path, more: &[&str]) -> GuestSpec {
    let mut s = GuestSpec::new(img.clone());
    s.memory_mib = 256;
    s.launcher = vec![
        VRDMA.into(),
        "--socket".into(),
        socket.into(),
        "vm".into(),
        "run".into(),
        "t".into(),
        "--".into(),
    ];
    s.extra_args = vec!["-qmp".into(), format!("unix:{},server=on,wait=off", qmp.display()).into()];
    s.extra_args.extend(more.iter().map(Into::into));
    s.boot_timeout = Duration::from_secs(180);
    s
}

fn seq_of(imm: u32) -> u64 {
    // The drop-in takes the immediate in network order; accept either.
    if u64::from(imm) < COUNT {
        u64::from(imm)
    } else {
        u64::from(imm.swap_bytes())
    }
}

#[test]
fn qemu_moves_a_streaming_guest_to_another_host() {
    if vrdma_guest::libs::which(vrdma_guest::guest::QEMU).is_none() {
        vrdma_it::skip(
            "qemu-system-x86_64 is not installed (apt-get install qemu-system-x86 busybox-static)",
        );
        return;
    }
    if !Path::new("/usr/include/infiniband/verbs.h").exists() || vrdma_guest::libs::which("cc").is_none() {
        vrdma_it::skip("cc and the verbs headers are needed (apt-get install gcc libibverbs-dev)");
        return;
    }
    if let Some(why) = vrdma_it::netns_unavailable() {
        vrdma_it::skip(format!("three hosts need network namespaces: {why}"));
        return;
    }
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();

    // The guest's program, and the image.
    let prog = dir.path().join("seqstream");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/seqstream.c");
    let cc = Command::new("cc")
        .args(["-O1", "-Wall", "-o"])
        .arg(&prog)
        .arg(&src)
        .arg("-libverbs")
        .output()
        .unwrap();
    assert!(cc.status.success(), "cc seqstream.c: {}", String::from_utf8_lossy(&cc.stderr));
    let drop_in = vrdma_guest::DropIn {
        vrdma: VRDMA.into(),
        verbs: built("libvrdma_verbs.so"),
        rdmacm: Some(built("libvrdma_rdmacm.so")),
        companions: Some(built("libvrdma_companions.so")),
    };
    let mut ispec = vrdma_guest::ImageSpec::default().with_drop_in(drop_in);
    ispec.files.push(vrdma_guest::GuestFile {
        host: prog,
        guest: "/usr/bin/seqstream".into(),
        libraries: true,
    });
    let img = image::build(&ispec).expect("the guest image");

    // Three hosts; VM t on A and C.
    let net = vrdma_it::NetnsBridge::create(3).expect("three namespaces");
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let vm = format!("[vms.t]\ntenant = {uid}\nmemory_mib = 16\nports = 2\n");
    let port = vrdma_it::DEFAULT_WIRE_PORT;
    let daemon = |i: usize, name: &str, extra: &str| {
        let peers: Vec<String> =
            (0..3).filter(|&j| j != i).map(|j| format!("{}:{port}", net.addr[j])).collect();
        start_daemon(dir.path(), name, &net.ns[i], &vrdma_it::host_config(&net.addr[i], port, &peers, extra))
    };
    let (a, b, c) = (daemon(0, "a", &vm), daemon(1, "b", ""), daemon(2, "c", &vm));
    let end = Instant::now() + Duration::from_secs(20);
    for d in [&a, &b, &c] {
        let ctx = vrdma::Context::open_at(&d.socket).unwrap();
        while ctx.stat().unwrap().links.iter().filter(|l| l.up).count() < 2 {
            assert!(Instant::now() < end, "the three daemons did not link");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    // The guest on A, its program waiting for B's endpoint.
    let qmp_a = dir.path().join("qmp-a.sock");
    let mut guest = Guest::boot(spec(&img, &a.socket, &qmp_a, &[])).expect("boot the guest on A");
    eprintln!(
        "guest_migrate: accelerator {}, shell after {:.1} s, set up in {:.1} s",
        guest.accel().name(),
        guest.boot_time().as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    guest_bg(&mut guest, "seq", 600, &format!("seqstream {COUNT} {LEN} {PACE_US} /tmp/peer"));
    let local = guest_line(&mut guest, "seq", "LOCAL ");
    let f: Vec<&str> = local.split_whitespace().collect();
    assert_eq!(f.len(), 5, "{local}");
    let gid_hex = f[4];
    let mut gid = [0u8; 16];
    for (i, g) in gid.iter_mut().enumerate() {
        *g = u8::from_str_radix(&gid_hex[2 * i..2 * i + 2], 16).unwrap();
    }
    let eg = vrdma::Endpoint {
        lid: 0,
        gid: vrdma::Gid(gid),
        qpn: f[2].parse().unwrap(),
        psn: f[3].parse().unwrap(),
    };

    // B: a host process's QP, receives posted.
    let bctx = vrdma::Context::open_at(&b.socket).unwrap();
    let side = vrdma_it::Side::new(&bctx, RECV_AT + (RECVS as usize) * 256).unwrap();
    let recv = |k: u64| {
        let sge = side.mr.sge(RECV_AT + (k % RECVS) as usize * 256, 256).unwrap();
        side.qp.post_recv(&[vrdma::wr::recv(k, &[sge]).unwrap()]).unwrap();
    };
    side.qp.connect(&eg, vrdma_it::access_all()).unwrap();
    for k in 0..RECVS {
        recv(k);
    }
    let eb = side.endpoint().unwrap();
    let gb: String = eb.gid.0.iter().map(|x| format!("{x:02x}")).collect();
    guest
        .check(
            &format!(
                "echo '0 {} {} {gb} {} {}' >/tmp/peer.new && mv /tmp/peer.new /tmp/peer",
                eb.qpn,
                eb.psn,
                side.mr.addr(),
                side.mr.rkey()
            ),
            T,
        )
        .unwrap();

    let received = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let (seqs, arrived, moved) = std::thread::scope(|s| {
        let receiver = s.spawn(|| {
            let mut seqs = Vec::new();
            let mut buf = vrdma::wc_buffer(64);
            let mut arrived = Vec::new();
            let end = Instant::now() + Duration::from_secs(120);
            while (seqs.len() as u64) < COUNT && !stop.load(Ordering::Acquire) {
                if Instant::now() > end {
                    eprintln!("B received {} of {COUNT} in two minutes", seqs.len());
                    break;
                }
                let n = side.cq.poll(&mut buf).unwrap();
                if n == 0 {
                    std::thread::sleep(Duration::from_micros(200));
                }
                for wc in &buf[..n] {
                    assert_eq!(wc.status, WcStatus::Success, "at B: {wc:?}");
                    let seq = seq_of(wc.imm_data);
                    let mut expect = vec![seq as u8; LEN];
                    expect[..8].copy_from_slice(&seq.to_le_bytes());
                    let mut got = vec![0u8; LEN];
                    match wc.opcode {
                        WcOpcode::Recv => {
                            side.mr.read(RECV_AT + (wc.wr_id % RECVS) as usize * 256, &mut got).unwrap()
                        }
                        WcOpcode::RecvRdmaWithImm => side.mr.read(seq as usize * LEN, &mut got).unwrap(),
                        o => panic!("at B: {o:?}"),
                    }
                    assert_eq!(got, expect, "message {seq}'s bytes at B ({:?})", wc.opcode);
                    arrived.push(Instant::now());
                    seqs.push(seq);
                    received.fetch_add(1, Ordering::AcqRel);
                    // A write with immediate takes a receive too.
                    recv(wc.wr_id + RECVS);
                }
            }
            (seqs, arrived)
        });
        let some = |least: u64| {
            let end = Instant::now() + Duration::from_secs(120);
            while received.load(Ordering::Acquire) < least {
                assert!(Instant::now() < end, "B got fewer than {least} messages");
                std::thread::sleep(Duration::from_millis(5));
            }
        };
        let moved = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut g = guest;
            let mut qmp = qmp_a;
            let mut reports = Vec::new();
            let mut switchovers = Vec::new();
            // A -> C -> A, each move with at least BEFORE messages before
            // it and the stream still running after it.
            for (k, (from, to)) in [(&a.socket, &c.socket), (&c.socket, &a.socket)].into_iter().enumerate() {
                some(received.load(Ordering::Acquire) + BEFORE);
                let (next, q, r, stopped) = migrate(&img, dir.path(), k, from, to, g, &qmp);
                switchovers.push(stopped);
                let at = received.load(Ordering::Acquire);
                assert!(at < COUNT, "the stream ended before move {}", k + 1);
                reports.push(format!("move {}: {r}", k + 1));
                g = next;
                qmp = q;
            }
            (g, reports.join("; "), switchovers)
        }));
        if moved.is_err() {
            stop.store(true, Ordering::Release);
        }
        let (seqs, gap) = receiver.join().expect("B's receiver");
        (seqs, gap, moved)
    });
    let (mut guest, report, switchovers) = match moved {
        Ok(x) => x,
        Err(p) => std::panic::resume_unwind(p),
    };
    let (st, out) = guest_wait(&mut guest, "seq");
    if seqs.len() as u64 != COUNT {
        let stat = Command::new(VRDMA).arg("--socket").arg(&c.socket).args(["stat"]).output().unwrap();
        eprintln!("the guest's stream:\n{out}\nC's stat:\n{}", String::from_utf8_lossy(&stat.stdout));
    }
    assert_eq!(seqs, (0..COUNT).collect::<Vec<_>>(), "every message once, in order, at B");
    assert_eq!(st, 0, "the guest's stream:\n{out}");
    assert!(out.contains(&format!("DONE completions={COUNT} in_order=1")), "the guest's stream:\n{out}");
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        vrdma_it::poll_for(&side.cq, Duration::from_millis(50)).unwrap().is_empty(),
        "a message twice at B"
    );
    assert_eq!(side.qp.query().unwrap().0.qp_state, vrdma::QpState::Rts);
    // The pause B saw at each switch-over: from its last message before
    // QEMU's migration completed to its first after.
    let pauses: Vec<String> = switchovers
        .iter()
        .map(|&at| {
            let k = arrived.partition_point(|&t| t < at);
            match (k.checked_sub(1).map(|i| arrived[i]), arrived.get(k)) {
                (Some(before), Some(&after)) => format!("{:.0} ms", (after - before).as_secs_f64() * 1e3),
                _ => "none measured".into(),
            }
        })
        .collect();
    eprintln!(
        "guest_migrate: {report}; the pause B saw at each switch-over (last message before to first \
         after): {}; the guest: {}; {:.1} s in all",
        pauses.join(", "),
        out.lines().find(|l| l.starts_with("DONE")).unwrap_or(""),
        started.elapsed().as_secs_f64()
    );
}

/// QEMU moves the VM from A to C while it runs, the operator's steps
/// around the switch-over. Returns the guest on C and what it measured.
fn migrate(
    img: &image::Image,
    dir: &Path,
    k: usize,
    a: &Path,
    c: &Path,
    from: Guest,
    qmp_a: &Path,
) -> (Guest, PathBuf, String, Instant) {
    let qmp_c = dir.join(format!("qmp-{k}.sock"));
    let mig = dir.join(format!("migration-{k}.sock"));
    let mut to = Guest::incoming(
        spec(img, c, &qmp_c, &["-S", "-incoming", &format!("unix:{}", mig.display())]),
        &from,
    )
    .expect("the destination QEMU");
    let mut qa = Qmp::connect(qmp_a);
    let mut qc = Qmp::connect(&qmp_c);
    assert_eq!(qc.status(), "inmigrate");
    let t0 = Instant::now();
    qa.exec(&format!(r#"{{"execute":"migrate","arguments":{{"uri":"unix:{}"}}}}"#, mig.display()));
    let end = Instant::now() + Duration::from_secs(240);
    let mut passes = 0;
    loop {
        let m = qa.exec(r#"{"execute":"query-migrate"}"#);
        match m["status"].as_str() {
            Some("completed") => {
                passes = m["ram"]["dirty-sync-count"].as_u64().unwrap_or(passes);
                break;
            }
            Some("failed" | "cancelled") => panic!("QEMU's migration: {m}"),
            _ => {}
        }
        assert!(Instant::now() < end, "QEMU's migration did not complete: {m}");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The source's CPUs stopped at the switch-over; from here the guest
    // is paused until the destination's `cont`.
    let stopped = Instant::now();
    let live = stopped - t0;
    let end = Instant::now() + Duration::from_secs(60);
    while qc.status() == "inmigrate" {
        assert!(Instant::now() < end, "the destination never finished loading");
        std::thread::sleep(Duration::from_millis(10));
    }
    if k == 0 {
        // The operator's steps one by one, the region copied by hand.
        let snap = dir.join("t.snap");
        let snap_s = snap.to_str().unwrap();
        operator(a, &["pause", "--vm", "t"]);
        operator(a, &["export", "--vm", "t", "--out", snap_s]);
        copy_region(a, c);
        operator(c, &["import", "--in", snap_s]);
        operator(a, &["finish", "--vm", "t"]);
        operator(c, &["resume", "--vm", "t"]);
    } else {
        // The one daemon step: `move --vm` copies the region itself.
        operator(a, &["move", "--vm", "t", "--to", c.to_str().unwrap()]);
    }
    qc.exec(r#"{"execute":"cont"}"#);
    let paused = stopped.elapsed();
    assert_eq!(qc.status(), "running");
    drop(from);
    // The guest answers on C.
    let out = to.check("echo here", T).unwrap_or_else(|e| panic!("the guest on C: {e}"));
    assert!(out.contains("here"), "{out}");
    let report = format!(
        "QEMU's live pass {:.1} s ({passes} dirty syncs), VM stopped {:.0} ms from the switch-over to the \
         destination's cont (operator steps and the region's copy included)",
        live.as_secs_f64(),
        paused.as_secs_f64() * 1e3
    );
    (to, qmp_c, report, stopped)
}
