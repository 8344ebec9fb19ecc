//! What the real-guest migration tests share: three daemons in three
//! network namespaces (A and C with VM `t`, B the peer), the guest's
//! image with `seqstream`, QMP, the operator's `vrdma migrate` steps, the
//! guest's background commands, and B's receiver, which checks every
//! message's bytes as it comes. Every wait is bounded; every process is
//! killed by its pid when its owner drops.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use vrdma::{WcOpcode, WcStatus};
pub use vrdma_guest::Qmp;
use vrdma_guest::{image, Guest, MigrationVm};
use vrdma_it::harness::built;

pub const VRDMA: &str = env!("CARGO_BIN_EXE_vrdma");
/// A guest command's limit.
pub const T: Duration = Duration::from_secs(120);
/// Every message's length.
pub const LEN: usize = 64;
/// B's receives, each 256 bytes, at `RECV_AT` in its region; the RDMA
/// writes land at `[0, count * LEN)`, below `RECV_AT` (4 MiB: 65536
/// messages, over three minutes at 3 ms, so that 20 hops under load fit
/// in one stream).
pub const RECVS: u64 = 256;
pub const RECV_AT: usize = 4 << 20;
/// The most messages a stream may have (its writes must fit below `RECV_AT`).
pub const MAX_COUNT: u64 = (RECV_AT / LEN) as u64;

/// A daemon process (`vrdma daemon`), killed by its pid on drop.
pub struct Daemon {
    pub child: Child,
    pub socket: PathBuf,
    config: PathBuf,
    ns: String,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Daemon {
    fn spawn(socket: PathBuf, config: PathBuf, ns: &str) -> Daemon {
        let child = Command::new("ip")
            .args(["netns", "exec", ns, VRDMA, "daemon", "--socket"])
            .arg(&socket)
            .arg("--config")
            .arg(&config)
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn the daemon");
        let mut d = Daemon { child, socket, config, ns: ns.to_string() };
        let end = Instant::now() + Duration::from_secs(20);
        while vrdma::Context::open_at(&d.socket).is_err() {
            assert!(Instant::now() < end, "the daemon at {} did not come up", d.socket.display());
            assert!(matches!(d.child.try_wait(), Ok(None)), "the daemon at {} exited", d.socket.display());
            std::thread::sleep(Duration::from_millis(20));
        }
        d
    }

    /// SIGKILL (by its pid: `ip netns exec` execs the daemon), reaped.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// A new daemon with the same socket and configuration, in the same
    /// namespace (after `kill`).
    pub fn restart(&mut self) {
        self.kill();
        let _ = std::fs::remove_file(&self.socket);
        let next = Daemon::spawn(self.socket.clone(), self.config.clone(), &self.ns);
        *self = next;
    }

    /// Waits (bounded) until this daemon has `n` links up.
    pub fn wait_links(&self, n: usize) {
        let ctx = vrdma::Context::open_at(&self.socket).unwrap();
        let end = Instant::now() + Duration::from_secs(20);
        while ctx.stat().unwrap().links.iter().filter(|l| l.up).count() < n {
            assert!(Instant::now() < end, "the daemon at {} did not link", self.socket.display());
            std::thread::sleep(Duration::from_millis(10));
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
    Daemon::spawn(socket, config, ns)
}

/// `vrdma --socket S migrate ARGS`: whether it succeeded, and its output.
pub fn operator_try(socket: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(VRDMA).arg("--socket").arg(socket).arg("migrate").args(args).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// `vrdma --socket S migrate ARGS`, which must succeed.
pub fn operator(socket: &Path, args: &[&str]) -> Duration {
    let t0 = Instant::now();
    let (ok, text) = operator_try(socket, args);
    assert!(ok, "vrdma migrate {args:?}: {text}");
    t0.elapsed()
}

/// Starts `cmd` in the background in `g` under `timeout`, its output and
/// status in `/tmp/<tag>.*`.
pub fn guest_bg(g: &mut Guest, tag: &str, secs: u32, cmd: &str) {
    g.check(
        &format!(
            "rm -f /tmp/{tag}.*; ( timeout {secs} {cmd} >/tmp/{tag}.out 2>&1; echo $? >/tmp/{tag}.st ) \
             </dev/null >/dev/null 2>&1 &"
        ),
        T,
    )
    .unwrap();
}

/// What the guest's kernel said last, for a program that ended early: a
/// death by a signal (the OOM killer's, a segfault's) prints nothing of
/// its own, and its exit status (128 + the signal, or 124 from
/// `timeout`) and the kernel's lines tell it from a failure the program
/// reported.
const KERNEL_TAIL: &str = "echo '(the kernel, last lines:)'; dmesg | tail -n 15";

/// Waits (bounded) for a line starting `prefix` in `tag`'s output.
pub fn guest_line(g: &mut Guest, tag: &str, prefix: &str) -> String {
    let script = format!(
        "i=0; while [ $i -lt 900 ]; do l=$(grep '^{prefix}' /tmp/{tag}.out) && {{ echo \"$l\"; exit 0; }}; \
         [ -e /tmp/{tag}.st ] && {{ echo \"ended, status $(cat /tmp/{tag}.st)\"; cat /tmp/{tag}.out; {KERNEL_TAIL}; \
         exit 1; }}; sleep 0.1; i=$((i+1)); done; echo 'no {prefix}'; cat /tmp/{tag}.out; exit 1"
    );
    g.check(&script, T).unwrap_or_else(|e| panic!("{tag} in the guest: {e}"))
}

/// Waits (bounded) for `tag` to end; its status and output.
pub fn guest_wait(g: &mut Guest, tag: &str) -> (i32, String) {
    let script = format!(
        "i=0; while [ ! -e /tmp/{tag}.st ] && [ $i -lt 1000 ]; do sleep 0.1; i=$((i+1)); done; \
         cat /tmp/{tag}.out; [ -e /tmp/{tag}.st ] || {{ echo '(still running)'; exit 124; }}; exit $(cat /tmp/{tag}.st)"
    );
    g.run(&script, T).unwrap_or_else(|e| panic!("{tag} in the guest: {e}"))
}

/// Waits (bounded, 20 s) until the guest has `n` of vRDMA's ports
/// (`org.vrdma.K`) as devices: they appear a while after boot (under
/// load, a second program found only the port the first held and failed
/// `ibv_open_device`).
pub fn guest_ports(g: &mut Guest, n: u32) {
    let script = format!(
        "i=0; while [ $i -lt 400 ]; do k=0; for p in /sys/class/virtio-ports/*; do case \"$(cat $p/name \
         2>/dev/null)\" in org.vrdma.*) [ -c /dev/${{p##*/}} ] && k=$((k+1));; esac; done; [ $k -ge {n} ] && \
         exit 0; sleep 0.05; i=$((i+1)); done; ls -l /sys/class/virtio-ports/ /dev/vport*; exit 1"
    );
    g.check(&script, T).unwrap_or_else(|e| panic!("{n} vRDMA ports in the guest: {e}"));
}

/// The guest (QMP `q`) answers a shell command, bounded (`T`), after it
/// moved or resumed `at` a host. If not, the failure says, beside the
/// console's end (in the error), what QEMU says of the VM (its status,
/// where its CPU is, its chardevs): a wedged guest, a stopped VM and a
/// harness port left unconnected look alike from the shell.
pub fn answers(g: &mut Guest, q: &mut Qmp, at: &str) {
    let e = match g.check("echo here", T) {
        Ok(out) => return assert!(out.contains("here"), "the guest {at}: {out}"),
        Err(e) => e,
    };
    let mut hmp = |cmd: &str| {
        let c = serde_json::json!({"execute": "human-monitor-command", "arguments": {"command-line": cmd}});
        match q.exec(&c.to_string()) {
            Ok(v) => v.as_str().unwrap_or("?").to_string(),
            Err(e) => format!("(no answer: {e})"),
        }
    };
    let (regs, chardevs) = (hmp("info registers"), hmp("info chardev"));
    let st = q.status().unwrap_or_else(|e| format!("(no answer: {e})"));
    panic!("the guest {at}: {e}\n-- QEMU: {st}; its CPU:\n{regs}\n-- its chardevs:\n{chardevs}");
}

/// Fails unless `tag` still runs in the guest (its output if not).
pub fn guest_running(g: &mut Guest, tag: &str) {
    let (st, out) = g
        .run(
            &format!(
                "cat /tmp/{tag}.out; [ ! -e /tmp/{tag}.st ] || {{ echo \"(status $(cat /tmp/{tag}.st))\"; \
                 {KERNEL_TAIL}; exit 1; }}"
            ),
            T,
        )
        .unwrap();
    assert_eq!(st, 0, "{tag} ended in the guest:\n{out}");
}

/// The three hosts, the guest's image, and where their files go.
pub struct World {
    pub dir: tempfile::TempDir,
    /// VM `t`'s QEMUs (the same as `vrdma bench --migrate`'s).
    pub vm: MigrationVm,
    pub a: Daemon,
    pub b: Daemon,
    pub c: Daemon,
    /// Whether the image has Debian's `rping` (the host has it).
    pub rping: bool,
    /// Whether the image has Debian's `ucmatose` and perftest's
    /// `ib_write_lat` (the host has both).
    pub cm_tools: bool,
    // Dropped after the daemons (fields drop in order).
    _net: vrdma_it::NetnsBridge,
}

impl World {
    /// Builds the image and starts the three daemons, linked; `None`
    /// (after saying why) where QEMU, a compiler and the verbs headers,
    /// or network namespaces are missing.
    pub fn new() -> Option<World> {
        if vrdma_guest::libs::which(vrdma_guest::guest::QEMU).is_none() {
            vrdma_it::skip(
                "qemu-system-x86_64 is not installed (apt-get install qemu-system-x86 busybox-static)",
            );
            return None;
        }
        if !Path::new("/usr/include/infiniband/verbs.h").exists() || vrdma_guest::libs::which("cc").is_none()
        {
            vrdma_it::skip("cc and the verbs headers are needed (apt-get install gcc libibverbs-dev)");
            return None;
        }
        if let Some(why) = vrdma_it::netns_unavailable() {
            vrdma_it::skip(format!("three hosts need network namespaces: {why}"));
            return None;
        }
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
        // Debian's rping, where the host has it (an rdma_cm program that
        // moves with the VM: `guest_migrate.rs`).
        let rping = vrdma_guest::libs::which("rping").is_some();
        if rping {
            ispec = ispec.program("rping").expect("rping in the image");
        } else {
            vrdma_it::skip("rping is missing (apt-get install rdmacm-utils): no rdma_cm program moves");
        }
        // And `ucmatose` and `ib_write_lat -R` (`cmtools.rs`).
        let cm_tools = ["ucmatose", "ib_write_lat"].iter().all(|t| vrdma_guest::libs::which(t).is_some());
        if cm_tools {
            ispec = ispec.program("ucmatose").and_then(|s| s.program("ib_write_lat")).expect("the image");
        } else {
            vrdma_it::skip("ucmatose or ib_write_lat is missing (rdmacm-utils, perftest): they do not move");
        }
        // The host's drop-in directory (`vrdma run`'s layout), for host
        // programs on vRDMA (`World::host`).
        let lib = dir.path().join("lib");
        std::fs::create_dir(&lib).unwrap();
        std::os::unix::fs::symlink(built("libvrdma_verbs.so"), lib.join("libibverbs.so.1")).unwrap();
        std::os::unix::fs::symlink(built("libvrdma_rdmacm.so"), lib.join("librdmacm.so.1")).unwrap();
        // perftest links the providers' libraries itself (`vrdma run`'s
        // layout has the companions that stand in for them).
        for soname in vrdma_companions::SONAMES {
            std::os::unix::fs::symlink(built("libvrdma_companions.so"), lib.join(soname)).unwrap();
        }
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
        // Four ports: two seqstreams, and rping (its librdmacm's context
        // and its libibverbs'); later ucmatose (two) or ib_write_lat (three).
        let vm = format!("[vms.t]\ntenant = {uid}\nmemory_mib = 16\nports = 4\n");
        let port = vrdma_it::DEFAULT_WIRE_PORT;
        let daemon = |i: usize, name: &str, extra: &str| {
            let peers: Vec<String> =
                (0..3).filter(|&j| j != i).map(|j| format!("{}:{port}", net.addr[j])).collect();
            start_daemon(
                dir.path(),
                name,
                &net.ns[i],
                &vrdma_it::host_config(&net.addr[i], port, &peers, extra),
            )
        };
        let (a, b, c) = (daemon(0, "a", &vm), daemon(1, "b", ""), daemon(2, "c", &vm));
        for d in [&a, &b, &c] {
            d.wait_links(2);
        }
        let vm = MigrationVm::new(img, VRDMA.into(), "t", dir.path());
        Some(World { dir, vm, a, b, c, rping, cm_tools, _net: net })
    }

    /// `program` as a process of host `i` (0 A, 1 B, 2 C: in its
    /// namespace, `ip netns exec` execs it, so the pid is the
    /// program's), on vRDMA's drop-in libraries and that host's daemon.
    pub fn host(&self, i: usize, program: &str) -> Command {
        let socket = [&self.a.socket, &self.b.socket, &self.c.socket][i];
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self._net.ns[i], "env"])
            .arg(format!("LD_LIBRARY_PATH={}", self.dir.path().join("lib").display()))
            .arg(format!("VRDMA_SOCKET={}", socket.display()))
            .arg(program);
        c
    }

    /// Host `i`'s address.
    pub fn addr(&self, i: usize) -> &str {
        &self._net.addr[i]
    }

    /// Gives every QEMU started from now on a blank 16 MiB qcow2 disk
    /// (`qemu-img create` in the world's folder), which QEMU's `savevm`
    /// needs; `false` (after saying why) where `qemu-img` is missing.
    pub fn with_disk(&mut self) -> bool {
        if vrdma_guest::libs::which("qemu-img").is_none() {
            vrdma_it::skip("qemu-img is not installed (apt-get install qemu-utils): no savevm/loadvm");
            return false;
        }
        let disk = self.dir.path().join("scratch.qcow2");
        let out = Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&disk)
            .arg("16M")
            .output()
            .unwrap();
        assert!(out.status.success(), "qemu-img create: {}", String::from_utf8_lossy(&out.stderr));
        // One file: source and destination share it, as on shared
        // storage. Unlocked: a cancelled migration's destination took the
        // image's write lock at the switch-over, and the source's `cont`
        // failed ("Failed to get \"write\" lock"); the tests run one of
        // them at a time, and the guest never writes it. No flushes
        // (`cache=unsafe`): on the loaded machine a second `savevm`'s
        // flush took from 2 to over 30 s; a test's scratch disk needs no
        // durability.
        self.vm.extra_args.push("-drive".into());
        self.vm.extra_args.push(
            format!("file={},if=none,id=scratch,format=qcow2,file.locking=off,cache=unsafe", disk.display())
                .into(),
        );
        self.vm.extra_args.push("-device".into());
        self.vm.extra_args.push("virtio-blk-pci,drive=scratch".into());
        true
    }

    /// Cuts (`up` false) or restores host `host`'s cable (0 A, 1 B, 2 C):
    /// its veth end down or up, its links silent meanwhile.
    pub fn set_link(&self, host: usize, up: bool) {
        self._net.set_link(host, up).unwrap_or_else(|e| panic!("host {host}'s cable: {e:#}"));
    }
}

/// B's end of a guest's stream: a host process's QP on B, receives
/// posted, connected to the guest's `seqstream` (started here).
pub struct Peer {
    pub side: vrdma_it::Side,
    pub count: u64,
}

impl Peer {
    /// Starts `seqstream COUNT LEN PACE_US` in `guest` (tag `seq`), and
    /// connects B's QP to it.
    pub fn connect(b: &Daemon, guest: &mut Guest, count: u64, pace_us: u32) -> Peer {
        Peer::connect_as(b, guest, "seq", "", count, pace_us)
    }

    /// As `connect`, the program's tag `tag` (its peer file
    /// `/tmp/peer-TAG`), `mode` its fifth argument (`chan`: it waits on a
    /// completion channel) or empty.
    pub fn connect_as(
        b: &Daemon,
        guest: &mut Guest,
        tag: &str,
        mode: &str,
        count: u64,
        pace_us: u32,
    ) -> Peer {
        Peer::connect_with(b, guest, tag, "", mode, count, pace_us)
    }

    /// As `connect_as`, the program started with `env` (`NAME=VALUE ...`,
    /// or empty) in its environment.
    pub fn connect_with(
        b: &Daemon,
        guest: &mut Guest,
        tag: &str,
        env: &str,
        mode: &str,
        count: u64,
        pace_us: u32,
    ) -> Peer {
        assert!(count <= MAX_COUNT);
        let peerfile = format!("/tmp/peer-{tag}");
        // The drop-in says why a verb failed (on stderr, in the output).
        guest_bg(
            guest,
            tag,
            600,
            &format!("env VRDMA_VERBS_DEBUG=1 {env} seqstream {count} {LEN} {pace_us} {peerfile} {mode}"),
        );
        let local = guest_line(guest, tag, "LOCAL ");
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
        let bctx = vrdma::Context::open_at(&b.socket).unwrap();
        let side = vrdma_it::Side::new(&bctx, RECV_AT + (RECVS as usize) * 256).unwrap();
        side.qp.connect(&eg, vrdma_it::access_all()).unwrap();
        let p = Peer { side, count };
        for k in 0..RECVS {
            p.recv(k);
        }
        let eb = p.side.endpoint().unwrap();
        let gb: String = eb.gid.0.iter().map(|x| format!("{x:02x}")).collect();
        guest
            .check(
                &format!(
                    "echo '0 {} {} {gb} {} {}' >{peerfile}.new && mv {peerfile}.new {peerfile}",
                    eb.qpn,
                    eb.psn,
                    p.side.mr.addr(),
                    p.side.mr.rkey()
                ),
                T,
            )
            .unwrap();
        p
    }

    fn recv(&self, k: u64) {
        let sge = self.side.mr.sge(RECV_AT + (k % RECVS) as usize * 256, 256).unwrap();
        self.side.qp.post_recv(&[vrdma::wr::recv(k, &[sge]).unwrap()]).unwrap();
    }

    fn seq_of(&self, imm: u32) -> u64 {
        // The drop-in takes the immediate in network order; accept either.
        if u64::from(imm) < self.count {
            u64::from(imm)
        } else {
            u64::from(imm.swap_bytes())
        }
    }

    /// B's receiver: takes messages until `count` came, `stop` is set, or
    /// `limit` passed; checks each one's bytes as it comes, counts them in
    /// `received`. Returns their sequence numbers and arrival times.
    pub fn receive(
        &self,
        received: &AtomicU64,
        stop: &AtomicBool,
        limit: Duration,
    ) -> (Vec<u64>, Vec<Instant>) {
        let mut seqs = Vec::new();
        let mut buf = vrdma::wc_buffer(64);
        let mut arrived = Vec::new();
        let end = Instant::now() + limit;
        while (seqs.len() as u64) < self.count && !stop.load(Ordering::Acquire) {
            if Instant::now() > end {
                eprintln!("B received {} of {} in {limit:?}", seqs.len(), self.count);
                break;
            }
            let n = self.side.cq.poll(&mut buf).unwrap();
            if n == 0 {
                std::thread::sleep(Duration::from_micros(200));
            }
            for wc in &buf[..n] {
                assert_eq!(wc.status, WcStatus::Success, "at B: {wc:?}");
                let seq = self.seq_of(wc.imm_data);
                let mut expect = vec![seq as u8; LEN];
                expect[..8].copy_from_slice(&seq.to_le_bytes());
                let mut got = vec![0u8; LEN];
                match wc.opcode {
                    WcOpcode::Recv => {
                        self.side.mr.read(RECV_AT + (wc.wr_id % RECVS) as usize * 256, &mut got).unwrap()
                    }
                    WcOpcode::RecvRdmaWithImm => self.side.mr.read(seq as usize * LEN, &mut got).unwrap(),
                    o => panic!("at B: {o:?}"),
                }
                assert_eq!(got, expect, "message {seq}'s bytes at B ({:?})", wc.opcode);
                arrived.push(Instant::now());
                seqs.push(seq);
                received.fetch_add(1, Ordering::AcqRel);
                // A write with immediate takes a receive too.
                self.recv(wc.wr_id + RECVS);
            }
        }
        (seqs, arrived)
    }
}

/// Waits (bounded) until `received` reaches `least`.
pub fn wait_received(received: &AtomicU64, least: u64) {
    let end = Instant::now() + Duration::from_secs(120);
    while received.load(Ordering::Acquire) < least {
        assert!(Instant::now() < end, "B got fewer than {least} messages");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The pause B saw around `at`: from its last message before to its
/// first after.
pub fn pause_around(arrived: &[Instant], at: Instant) -> Option<Duration> {
    let k = arrived.partition_point(|&t| t < at);
    Some(*arrived.get(k)? - arrived[k.checked_sub(1)?])
}

/// The `DRAINED flushed=F of=W qp_state=S` line of a failed stream: the
/// rest flushed, once each, and the QP in ERR.
pub fn drained(out: &str) -> String {
    let drained = out.lines().find(|l| l.starts_with("DRAINED ")).unwrap_or_else(|| panic!("{out}"));
    let field = |k: &str| {
        drained
            .split_whitespace()
            .find_map(|f| f.strip_prefix(k))
            .and_then(|v| v.parse::<i64>().ok())
            .unwrap_or_else(|| panic!("{drained}"))
    };
    assert_eq!(field("flushed="), field("of="), "the rest flushed, once each, in order: {drained}");
    assert_eq!(field("qp_state="), 6, "the QP in ERR: {drained}");
    drained.to_string()
}
