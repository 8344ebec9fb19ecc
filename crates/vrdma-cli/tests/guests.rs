//! Unmodified verbs programs in real QEMU guests (issue 18), booted with
//! `vrdma vm run` against a daemon of this test, beside host processes,
//! another guest, and a process behind another daemon.
//!
//! The image comes from `vrdma vm image`. Two guests (`a`, `b`: two
//! `[vms]` of one daemon) boot once for this whole binary (boots cost
//! seconds under TCG) and the cases run in order against them, the last
//! one SIGKILLing guest `a`'s QEMU mid-transfer (and booting VM `a`
//! again). Each guest gets QEMU's user network (a virtio NIC at 10.0.2.15, the
//! host at 10.0.2.2, a few host ports forwarded in) for the tools'
//! out-of-band TCP exchange; their verbs traffic goes through the VM
//! transport (`docs/vms.md`). The rdma_cm programs (rping, perftest -R)
//! need no TCP: each VM has an rdma_cm address of the daemon's
//! (`[vms.NAME] address`), and the host's processes listen on the
//! daemon's own.
//!
//! As root (CI), "the host" is a network namespace of this test holding
//! the daemon, its VMs' QEMUs and the host processes, and a second
//! namespace joined by a veth holds another daemon peered with the
//! first, for the case of a VM and a process on another host. Without
//! root everything runs here and that case is skipped, saying so.
//!
//! Two cases run small C programs of this test (`tests/c/forkcopy.c` and
//! `tests/c/guestmem.c`, built here with `cc` and put in the image by
//! `vrdma vm image --program`): fork in a verbs program in a guest, and
//! a guest's registered memory against the VM's region (a span grown in
//! place, a region too small for a registration, huge pages).
//!
//! Every program runs under a bound (`timeout` in the guest, a killed pid
//! on the host) and every process is killed by its pid.

use std::ffi::OsString;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vrdma_guest::{image, Guest, GuestSpec};
use vrdma_it::harness::{built, free_port, spawn, Finished, Running};

const VRDMA: &str = env!("CARGO_BIN_EXE_vrdma");
/// A guest command's limit (the programs inside have their own, shorter).
const T: Duration = Duration::from_secs(120);
/// A host program's limit.
const LIMIT: Duration = Duration::from_secs(90);
/// ibv_*_pingpong iterations: enough to validate data both ways, few
/// enough for TCG.
const ITERS: &str = "100";
/// The VMs' rdma_cm addresses (`[vms.NAME] address`, docs/vms.md).
const CM_ADDR_A: Ipv4Addr = Ipv4Addr::new(10, 76, 0, 1);
const CM_ADDR_B: Ipv4Addr = Ipv4Addr::new(10, 76, 0, 2);
/// How long a CM server in a guest may take to listen (TCG is slow).
const CM_LISTEN_WAIT: Duration = Duration::from_secs(60);

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

/// `program` in network namespace `ns` (by `ip netns exec`, which execs
/// it: the pid is the program's), else here.
fn in_ns(ns: Option<&str>, program: &str) -> Command {
    match ns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, program]);
            c
        }
        None => Command::new(program),
    }
}

fn start_daemon(dir: &Path, name: &str, ns: Option<&str>, toml: &str) -> Daemon {
    let socket = dir.join(format!("{name}.sock"));
    let config = dir.join(format!("{name}.toml"));
    std::fs::write(&config, toml).unwrap();
    let child = in_ns(ns, VRDMA)
        .arg("daemon")
        .arg("--socket")
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

/// Whether `pid` (in whatever namespace) has a socket listening on
/// `port`: its /proc/PID/net/tcp{,6} are its namespace's.
fn listening_in(pid: i32, port: u16) -> bool {
    let want = format!(":{port:04X}");
    ["tcp", "tcp6"].iter().any(|f| {
        std::fs::read_to_string(format!("/proc/{pid}/net/{f}")).unwrap_or_default().lines().skip(1).any(|l| {
            let c: Vec<&str> = l.split_whitespace().collect();
            c.len() > 3 && c[1].ends_with(&want) && c[3] == "0A"
        })
    })
}

struct World {
    dir: tempfile::TempDir,
    /// The host's namespace (None: this one).
    ns: Option<String>,
    main: Daemon,
    /// The other host's daemon (in the other namespace).
    other: Option<Daemon>,
    a: Option<Guest>,
    b: Guest,
    /// Host ports forwarded into guest a, and into guest b.
    fwd_a: Vec<u16>,
    /// The main daemon's own address (its GID's), where host processes'
    /// rdma_cm listeners are reached.
    cm_addr: Ipv4Addr,
    img: image::Image,
    /// Whether the image has `forkcopy` and `guestmem` (cc and the verbs
    /// headers here).
    c_programs: bool,
    /// Dropped last: the namespaces.
    _net: Option<vrdma_it::Netns>,
}

impl World {
    /// `program` on the host (`main`'s namespace) or the other host, on
    /// vRDMA's `libibverbs.so.1`.
    fn host(&self, other: bool, program: &str) -> Command {
        let (ns, socket) = if other {
            let net = self._net.as_ref().expect("two hosts");
            (Some(net.ns[1].as_str()), &self.other.as_ref().expect("the other daemon").socket)
        } else {
            (self.ns.as_deref(), &self.main.socket)
        };
        let mut c = in_ns(ns, program);
        c.env("LD_LIBRARY_PATH", self.dir.path().join("lib"))
            .env("VRDMA_SOCKET", socket)
            .env("LD_BIND_NOW", "1");
        c
    }

    fn a(&mut self) -> &mut Guest {
        self.a.as_mut().expect("guest a")
    }
}

/// Boots VM `vm` of the daemon at `socket` with `vrdma vm run`, in `ns`,
/// with host `ports` forwarded to the same guest ports.
fn boot(img: &image::Image, socket: &Path, vm: &str, ns: Option<&str>, ports: &[u16]) -> Guest {
    let mut spec = GuestSpec::new(img.clone());
    let mut l: Vec<OsString> = Vec::new();
    if let Some(ns) = ns {
        l.extend(["ip", "netns", "exec", ns].map(OsString::from));
    }
    l.push(VRDMA.into());
    l.push("--socket".into());
    l.push(socket.into());
    l.extend(["vm", "run", vm, "--"].map(OsString::from));
    spec.launcher = l;
    let fwd: Vec<String> = ports.iter().map(|p| format!("hostfwd=tcp:127.0.0.1:{p}-:{p}")).collect();
    spec.extra_args = vec!["-nic".into(), format!("user,model=virtio-net-pci,{}", fwd.join(",")).into()];
    spec.boot_timeout = Duration::from_secs(180);
    Guest::boot(spec).unwrap_or_else(|e| panic!("boot guest {vm}: {e}"))
}

/// Starts `cmd` in the background in guest `g` under `timeout`, its
/// output and status kept under `/tmp/<tag>.*`.
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

/// Waits in guest `g` for `tag`'s program to listen on TCP `port` (or to
/// end, which fails).
fn guest_listening(g: &mut Guest, tag: &str, port: u16) {
    let script = format!(
        "i=0; while [ $i -lt 600 ]; do netstat -ltn | grep -q ':{port} ' && exit 0; \
         [ -e /tmp/{tag}.st ] && {{ echo ended; cat /tmp/{tag}.out; exit 1; }}; sleep 0.1; i=$((i+1)); done; \
         echo 'never listened'; cat /tmp/{tag}.out; exit 1"
    );
    g.check(&script, T).unwrap_or_else(|e| panic!("{tag} in the guest: {e}"));
}

/// Waits for `tag`'s program in guest `g` to end: its status and output.
fn guest_wait(g: &mut Guest, tag: &str) -> (i32, String) {
    let script = format!(
        "i=0; while [ ! -e /tmp/{tag}.st ] && [ $i -lt 1000 ]; do sleep 0.1; i=$((i+1)); done; \
         cat /tmp/{tag}.out; [ -e /tmp/{tag}.st ] || {{ echo '(still running)'; exit 124; }}; exit $(cat /tmp/{tag}.st)"
    );
    g.run(&script, T).unwrap_or_else(|e| panic!("{tag} in the guest: {e}"))
}

/// Starts a host program and waits for it to listen on `port`.
fn host_server(cmd: Command, name: &str, port: u16) -> Running {
    let mut r = spawn(cmd, name);
    let end = Instant::now() + Duration::from_secs(30);
    while !listening_in(r.pid(), port) {
        if r.exited() || Instant::now() > end {
            panic!("{name} never listened\n{}", r.finish(LIMIT).describe());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    r
}

/// A ping-pong's output shows it ran and validated its data.
fn pingpong_ran(who: &str, out: &str) {
    assert!(out.contains(" bytes in ") && out.contains(" iters in "), "{who}: no figures\n{out}");
    for bad in ["invalid data", "Failed status", "Couldn't", "failed"] {
        assert!(!out.contains(bad), "{who}: {bad:?} in the output\n{out}");
    }
}

fn host_ok(f: &Finished) {
    f.assert_ok();
    pingpong_ran(&f.name, &format!("{}{}", f.stdout, f.stderr));
}

#[test]
fn verbs_programs_in_real_guests() {
    if vrdma_guest::libs::which(vrdma_guest::guest::QEMU).is_none() {
        vrdma_it::skip(
            "qemu-system-x86_64 is not installed (apt-get install qemu-system-x86 busybox-static)",
        );
        return;
    }
    for t in image::DEBIAN_TOOLS {
        if vrdma_guest::libs::which(t).is_none() {
            vrdma_it::skip(format!("{t} is missing (apt-get install ibverbs-utils perftest qperf)"));
            return;
        }
    }
    let started = Instant::now();
    let mut w = setup();
    eprintln!(
        "guests: accelerator {}, kernel {}, shells after {:.1} s / {:.1} s; set up in {:.1} s",
        w.b.accel().name(),
        w.b.release(),
        w.a.as_ref().expect("guest a").boot_time().as_secs_f64(),
        w.b.boot_time().as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    let mut case = |name: &str, f: &mut dyn FnMut(&mut World)| {
        let t0 = Instant::now();
        f(&mut w);
        eprintln!("case: {name} ({:.1} s)", t0.elapsed().as_secs_f64());
    };
    case("ibv_devinfo in a guest shows the vRDMA device", &mut devinfo);
    case("ibv_rc_pingpong -c, guest server and host client", &mut rc_guest_server);
    case("ibv_rc_pingpong -c, and -c -e, host server and guest client", &mut rc_host_server);
    case("ibv_ud_pingpong -c, guest server and host client", &mut ud_guest_server);
    case("ibv_rc_pingpong -c between two VMs of one host", &mut rc_two_guests);
    case("ib_write_lat, ib_send_bw and qperf rc_lat, guest client and host server", &mut perf_tools);
    case("ibv_rc_pingpong -c, a guest and a process behind another host's daemon", &mut other_host);
    case("rping over rdma_cm between two VMs, on VM a's address", &mut rping_two_guests);
    case(
        "vrdma run, vrdma cp and vrdma stat in a guest use the host's daemon; a bad device is an error",
        &mut cli_in_guest,
    );
    case("ib_write_lat -R, guest client and host server", &mut perftest_cm);
    case(
        "fork in a guest: the child's writes miss the parent's registered pages; its QPs work on",
        &mut fork_in_guest,
    );
    case(
        "a guest's memory: a span grows in place; a region too small refuses one program (ENOMEM), \
         others work on; huge pages refused",
        &mut guest_memory,
    );
    case("figures (VRDMA_GUEST_FIGURES=1): VM-to-host beside host-to-host", &mut figures);
    case(
        "QEMU SIGKILLed mid-transfer: the host's peer fails, the daemon serves on, the VM boots again",
        &mut killed_mid_transfer,
    );
}

fn setup() -> World {
    let dir = tempfile::tempdir().unwrap();
    // The host's drop-in directory, as `vrdma run` lays it out.
    let lib = dir.path().join("lib");
    std::fs::create_dir(&lib).unwrap();
    let link = |target: &Path, name: &str| std::os::unix::fs::symlink(target, lib.join(name)).unwrap();
    link(&built("libvrdma_verbs.so"), "libibverbs.so.1");
    link(&built("libvrdma_rdmacm.so"), "librdmacm.so.1");
    for soname in vrdma_companions::SONAMES {
        link(&built("libvrdma_companions.so"), soname);
    }

    // The guests' image, by `vrdma vm image`: this build's vrdma and
    // drop-in, Debian's tools. (The cdylibs of this run are in deps/;
    // those beside `vrdma` in the profile directory are only as fresh as
    // the last build of their own package, so they are named.)
    let img_dir = dir.path().join("image");
    let c_programs = c_tools_here().then(|| ["forkcopy", "guestmem"].map(|p| build_c(dir.path(), p)));
    let mut image_cmd = Command::new(VRDMA);
    image_cmd.args(["vm", "image", "--out"]).arg(&img_dir);
    for prog in c_programs.iter().flatten() {
        image_cmd.arg("--program").arg(prog);
    }
    let out = image_cmd
        .env("VRDMA_VERBS_LIB", built("libvrdma_verbs.so"))
        .env("VRDMA_RDMACM_LIB", built("libvrdma_rdmacm.so"))
        .env("VRDMA_COMPANIONS_LIB", built("libvrdma_companions.so"))
        .output()
        .expect("run vrdma vm image");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "vrdma vm image: {}{text}", String::from_utf8_lossy(&out.stderr));
    // "kernel:    PATH (RELEASE)"
    let release = text
        .lines()
        .find_map(|l| l.strip_prefix("kernel:")?.trim_end().strip_suffix(')')?.rsplit_once('(').map(|x| x.1))
        .unwrap_or_else(|| panic!("no kernel release in {text}"))
        .to_string();
    let img =
        image::Image { kernel: img_dir.join("vmlinuz"), initramfs: img_dir.join("initramfs.cpio"), release };

    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let vms = format!(
        "[vms.a]\ntenant = {uid}\nmemory_mib = 64\nports = 4\naddress = \"{CM_ADDR_A}\"\n\
         [vms.b]\ntenant = {uid}\nmemory_mib = 64\nports = 4\naddress = \"{CM_ADDR_B}\"\n"
    );
    let net = match vrdma_it::netns_unavailable() {
        None => Some(vrdma_it::Netns::create().expect("network namespaces")),
        Some(why) => {
            vrdma_it::skip(format!("no second host (network namespaces need root and iproute2: {why})"));
            None
        }
    };
    let (main, other) = match &net {
        Some(n) => {
            let port = vrdma_it::DEFAULT_WIRE_PORT;
            let cfg = |i: usize, extra: &str| {
                vrdma_it::host_config(&n.addr[i], port, &[format!("{}:{port}", n.addr[1 - i])], extra)
            };
            let main = start_daemon(dir.path(), "main", Some(&n.ns[0]), &cfg(0, &vms));
            let other = start_daemon(dir.path(), "other", Some(&n.ns[1]), &cfg(1, ""));
            let end = Instant::now() + Duration::from_secs(20);
            let up = |d: &Daemon| {
                vrdma::Context::open_at(&d.socket)
                    .and_then(|c| c.stat())
                    .is_ok_and(|s| s.links.iter().any(|l| l.up))
            };
            while !(up(&main) && up(&other)) {
                assert!(Instant::now() < end, "the two daemons did not link");
                std::thread::sleep(Duration::from_millis(20));
            }
            (main, Some(other))
        }
        None => (start_daemon(dir.path(), "main", None, &vms), None),
    };
    let ns = net.as_ref().map(|n| n.ns[0].clone());
    let fwd_a: Vec<u16> = (0..3).map(|_| free_port()).collect();
    // Both boot at once.
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| boot(&img, &main.socket, "a", ns.as_deref(), &fwd_a));
        let b = s.spawn(|| boot(&img, &main.socket, "b", ns.as_deref(), &[]));
        (a.join().expect("boot a"), b.join().expect("boot b"))
    });
    let gid =
        vrdma::Context::open_at(&main.socket).and_then(|c| c.query_gid(1, 0)).expect("the daemon's GID");
    let cm_addr = Ipv4Addr::from(gid.ipv4().expect("an IPv4 GID"));
    let c_programs = c_programs.is_some();
    World { dir, ns, main, other, a: Some(a), b, fwd_a, cm_addr, img, c_programs, _net: net }
}

/// Whether `cc` and the verbs headers are here to build this test's C
/// programs (else their cases are skipped, saying so).
fn c_tools_here() -> bool {
    if !Path::new("/usr/include/infiniband/verbs.h").exists() || vrdma_guest::libs::which("cc").is_none() {
        vrdma_it::skip(
            "no fork or guest-memory case in the guests: cc and the verbs headers are needed \
             (apt-get install gcc libibverbs-dev)",
        );
        return false;
    }
    true
}

/// `tests/c/NAME.c` built in `dir`.
fn build_c(dir: &Path, name: &str) -> PathBuf {
    let prog = dir.join(name);
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let cc = Command::new("cc")
        .args(["-O1", "-Wall", "-o"])
        .arg(&prog)
        .arg(&src)
        .arg("-libverbs")
        .output()
        .unwrap();
    assert!(cc.status.success(), "cc {name}.c: {}", String::from_utf8_lossy(&cc.stderr));
    prog
}

/// `fork` in a verbs program in guest a (`tests/c/forkcopy.c`, docs/vms.md
/// "fork in a guest"): its registered pages are re-backed by the VM's
/// BAR; the child sees the parent's bytes, overwrites them all and exits;
/// the parent's bytes are unchanged, and its loopback QP pair then moves
/// them (an RDMA write, a send) with the right bytes at the peer. Without
/// the fork handler the child's writes land in the parent's pages (the
/// BAR is a shared mapping) and the parent's check fails.
fn fork_in_guest(w: &mut World) {
    if !w.c_programs {
        return;
    }
    let (st, out) = w.a().run("timeout 60 forkcopy", T).unwrap();
    assert_eq!(st, 0, "forkcopy in guest a:\n{out}");
    for want in ["CHILD_OK", "PARENT_UNCHANGED", "WRITE_OK", "SEND_OK", "DONE"] {
        assert!(out.lines().any(|l| l.starts_with(want)), "forkcopy: no {want}\n{out}");
    }
    // The registered pages are re-backed: a shared mapping (of the BAR),
    // which without the handler a child would share.
    let mapped = out.lines().find_map(|l| l.strip_prefix("MAPPED ")).unwrap_or_else(|| panic!("{out}"));
    assert_eq!(mapped.split_whitespace().nth(1), Some("rw-s"), "the registered pages are not shared:\n{out}");
    eprintln!(
        "  forkcopy in guest a:\n{}",
        out.lines().map(|l| format!("    {l}")).collect::<Vec<_>>().join("\n")
    );
}

/// A guest's registered memory against its VM's region (`tests/c/guestmem.c`,
/// docs/vms.md "Memory"; the region is 64 MiB, fixed: the daemon seals
/// it and QEMU maps it as the BAR, so it never grows):
/// - a registration that begins in a registered page and ends past its
///   span grows that span's extent in place (`GuestGrow`), with the QP
///   rings allocated in between, and moves the right bytes both ways;
/// - a registration that begins before a registered span and covers two
///   is made of pieces (`RegMrPieces`) and moves the right bytes both
///   ways, the small regions under it still by their own keys;
/// - while one program holds 40 MiB registered, a second asking for 40 MiB
///   more is refused with `ENOMEM` and the daemon's reason (the region's
///   fixed size, what is free) on its stderr, a third registers 4 MiB and moves it, and the first
///   program's 40 MiB still moves afterwards; once it ended, 40 MiB
///   registers again (its extents went back with its session);
/// - a registration of huge pages (`MAP_HUGETLB`) is refused with
///   `EOPNOTSUPP`, saying why, where the guest kernel gives a huge page.
fn guest_memory(w: &mut World) {
    if !w.c_programs {
        return;
    }
    let g = w.a();
    let (st, out) = g.run("VRDMA_VERBS_DEBUG=1 timeout 60 guestmem grow", T).unwrap();
    assert_eq!(st, 0, "guestmem grow in guest a:\n{out}");
    assert!(out.lines().any(|l| l.starts_with("GROW_OK")), "guestmem grow:\n{out}");
    let mapped = out.lines().find_map(|l| l.strip_prefix("MAPPED ")).unwrap_or_else(|| panic!("{out}"));
    assert_eq!(mapped.split_whitespace().nth(1), Some("rw-s"), "the grown pages are not the BAR's:\n{out}");
    let (st, out) = g.run("VRDMA_VERBS_DEBUG=1 timeout 60 guestmem pieces", T).unwrap();
    assert_eq!(st, 0, "guestmem pieces in guest a:\n{out}");
    assert!(out.lines().any(|l| l.starts_with("PIECES_OK")), "guestmem pieces:\n{out}");

    g.check("rm -f /tmp/guestmem.go", T).unwrap();
    guest_bg(g, "hold", 120, "guestmem reg 40 100");
    let held = "i=0; while [ $i -lt 900 ]; do grep -q REG_OK /tmp/hold.out && exit 0; \
                [ -e /tmp/hold.st ] && { cat /tmp/hold.out; exit 1; }; sleep 0.1; i=$((i+1)); done; \
                echo 'never registered'; cat /tmp/hold.out; exit 1";
    g.check(held, T).unwrap_or_else(|e| panic!("guestmem reg 40 (held): {e}"));
    let (st, refused) = g.run("timeout 60 guestmem reg 40", T).unwrap();
    let (st_small, small) = g.run("timeout 60 guestmem reg 4", T).unwrap();
    g.check("touch /tmp/guestmem.go", T).unwrap();
    let (st_held, held) = guest_wait(g, "hold");
    assert_eq!(st, 2, "a second 40 MiB in a 64 MiB region was not refused:\n{refused}");
    let line = refused.lines().find(|l| l.starts_with("REG_REFUSED")).unwrap_or_else(|| panic!("{refused}"));
    assert!(line.starts_with(&format!("REG_REFUSED errno {}", libc::ENOMEM)), "{refused}");
    let why = refused.lines().find(|l| l.starts_with("libibverbs (vRDMA): Warning: ibv_reg_mr:"));
    assert!(
        why.is_some_and(|l| l.contains("VM \"a\"'s region (64 MiB, fixed by the host's [vms.a] memory_mib)")),
        "the refusal does not say why:\n{refused}"
    );
    assert_eq!(st_small, 0, "guestmem reg 4 beside the held 40 MiB:\n{small}");
    assert!(small.contains("REG_OK 4 MiB"), "{small}");
    assert_eq!(st_held, 0, "the program holding 40 MiB:\n{held}");
    assert!(held.contains("HELD_OK 40 MiB"), "{held}");
    let (st, again) = g.run("timeout 60 guestmem reg 40", T).unwrap();
    assert_eq!(st, 0, "40 MiB after the holder ended:\n{again}");
    eprintln!("  refused in guest a: {}", why.unwrap_or(line));

    // Huge pages: the guest's own (the guest kernel's pool, set here).
    let (st, out) = g
        .run(
            "echo 2 > /proc/sys/vm/nr_hugepages; VRDMA_VERBS_DEBUG=1 timeout 60 guestmem huge; s=$?; \
             echo 0 > /proc/sys/vm/nr_hugepages; exit $s",
            T,
        )
        .unwrap();
    if st == 3 {
        vrdma_it::skip(format!("no huge page in the guest: the huge-page case is not run\n{out}"));
        return;
    }
    assert_eq!(st, 2, "huge pages registered in a guest:\n{out}");
    assert!(out.contains(&format!("HUGE_REFUSED errno {}", libc::EOPNOTSUPP)), "{out}");
    assert!(out.contains("registering huge pages from a guest"), "the refusal does not say why:\n{out}");
}

/// What the guest library sees, for a failure's message.
const DIAGNOSE: &str =
    "for p in /sys/class/virtio-ports/*; do echo \"$p: $(cat $p/name)\"; ls -l /dev/${p##*/}; done; \
    for d in /sys/bus/pci/devices/*; do echo \"$d $(cat $d/vendor) $(cat $d/device)\"; done; \
    VRDMA_VERBS_DEBUG=1 VRDMA_LOG=debug timeout 30 ibv_devinfo; timeout 30 vrdma devinfo";

fn devinfo(w: &mut World) {
    let out = w.a().check("timeout 60 ibv_devinfo", T).unwrap_or_else(|e| {
        let why = w.a().run(DIAGNOSE, T).map(|r| r.1).unwrap_or_else(|e| e.to_string());
        panic!("{e}\n-- in the guest:\n{why}")
    });
    for want in ["hca_id:\tvrdma0", "PORT_ACTIVE (4)", "vendor_id:\t\t\t0x5652"] {
        assert!(out.contains(want), "{want:?} missing:\n{out}");
    }
    // And the CLI in the guest, through the same library.
    let out = w.a().check("timeout 60 vrdma devinfo", T).unwrap();
    assert!(out.contains("vrdma0"), "{out}");
}

/// `tool` (a ping-pong) with the server in guest a on forwarded port
/// `port` and the client a host process.
fn guest_server_host_client(w: &mut World, tool: &str, port: u16, args: &str) {
    let tag = tool.replace('_', "-");
    let cmd = format!("{tool} -p {port} -n {ITERS} {args}");
    guest_bg(w.a(), &tag, 90, &cmd);
    guest_listening(w.a(), &tag, port);
    let mut client = w.host(false, &format!("/usr/bin/{tool}"));
    client.args(["-p", &port.to_string(), "-n", ITERS]).args(args.split_whitespace()).arg("127.0.0.1");
    let client = spawn(client, &format!("{tool} (host client) {args}")).finish(LIMIT);
    let (st, out) = guest_wait(w.a(), &tag);
    assert_eq!(st, 0, "{tool} in the guest:\n{out}\n{}", client.describe());
    pingpong_ran(&format!("{tool} (guest server)"), &out);
    host_ok(&client);
}

fn rc_guest_server(w: &mut World) {
    let p = w.fwd_a[0];
    guest_server_host_client(w, "ibv_rc_pingpong", p, "-c");
}

fn ud_guest_server(w: &mut World) {
    let p = w.fwd_a[1];
    guest_server_host_client(w, "ibv_ud_pingpong", p, "-c -s 1024");
}

fn rc_host_server(w: &mut World) {
    // With -e both sides sleep on completion channels: in the guest, the
    // doorbell proxies over the VM's port (docs/vms.md).
    for args in ["-c", "-c -e"] {
        let port = free_port();
        let mut server = w.host(false, "/usr/bin/ibv_rc_pingpong");
        server.args(["-p", &port.to_string(), "-n", ITERS]).args(args.split_whitespace());
        let server = host_server(server, &format!("ibv_rc_pingpong (host server) {args}"), port);
        let cmd = format!("timeout 90 ibv_rc_pingpong -p {port} -n {ITERS} {args} 10.0.2.2");
        let out = w.a().check(&cmd, T);
        let server = server.finish(LIMIT);
        let out = out.unwrap_or_else(|e| panic!("the guest client {args}: {e}\n{}", server.describe()));
        pingpong_ran(&format!("ibv_rc_pingpong (guest client) {args}"), &out);
        host_ok(&server);
    }
}

fn rc_two_guests(w: &mut World) {
    let port = w.fwd_a[2];
    let cmd = format!("ibv_rc_pingpong -p {port} -n {ITERS} -c");
    guest_bg(w.a(), "two", 90, &cmd);
    guest_listening(w.a(), "two", port);
    let client = w.b.run(&format!("timeout 90 {cmd} 10.0.2.2"), T).unwrap();
    let (st, out) = guest_wait(w.a(), "two");
    assert_eq!((st, client.0), (0, 0), "guest a:\n{out}\nguest b:\n{}", client.1);
    pingpong_ran("ibv_rc_pingpong (guest a, server)", &out);
    pingpong_ran("ibv_rc_pingpong (guest b, client)", &client.1);
}

fn perf_tools(w: &mut World) {
    for tool in ["ib_write_lat", "ib_send_bw"] {
        let port = free_port();
        let p = port.to_string();
        let common = ["-p", p.as_str(), "-d", "vrdma0", "-n", "50", "-F"];
        let mut server = w.host(false, &format!("/usr/bin/{tool}"));
        server.args(common);
        let server = host_server(server, &format!("{tool} (host server)"), port);
        let out = w.a().run(&format!("timeout 90 {tool} {} 10.0.2.2", common.join(" ")), T).unwrap();
        let server = server.finish(LIMIT);
        assert_eq!(out.0, 0, "{tool} in the guest:\n{}\n{}", out.1, server.describe());
        assert!(vrdma_it::harness::has_results(&out.1), "{tool}: no results in the guest\n{}", out.1);
        server.assert_ok();
        eprintln!("  {tool} in the guest (client):\n{}", results(&out.1));
    }
    let port = free_port();
    let lp = port.to_string();
    let mut server = w.host(false, "/usr/bin/qperf");
    server.args(["-lp", &lp]);
    let server = host_server(server, "qperf (host server)", port);
    let out = w.a().run(&format!("timeout 90 qperf 10.0.2.2 -lp {lp} -t 2 rc_lat"), T).unwrap();
    // The qperf server serves until killed (by its pid, on drop).
    drop(server);
    assert_eq!(out.0, 0, "qperf in the guest:\n{}", out.1);
    assert!(out.1.contains("latency  ="), "qperf in the guest:\n{}", out.1);
    eprintln!("  qperf rc_lat in the guest (client):\n{}", out.1.trim_end());
}

/// perftest's result table, for the log.
fn results(out: &str) -> String {
    out.lines().skip_while(|l| !l.trim_start().starts_with("#bytes")).take(2).collect::<Vec<_>>().join("\n")
}

fn other_host(w: &mut World) {
    let Some(net) = w._net.as_ref() else {
        vrdma_it::skip("a VM and a process on another host need network namespaces (root)");
        return;
    };
    let addr = net.addr[1].clone();
    let frames = |w: &World| -> u64 {
        let c = vrdma::Context::open_at(&w.main.socket).expect("open");
        c.stat().expect("stat").links.iter().map(|l| l.stats.frames_out + l.stats.frames_in).sum()
    };
    let before = frames(w);
    let port = free_port();
    let mut server = w.host(true, "/usr/bin/ibv_rc_pingpong");
    server.args(["-p", &port.to_string(), "-n", ITERS, "-c"]);
    let server = host_server(server, "ibv_rc_pingpong (server on the other host)", port);
    // Guest a's QEMU runs in the host's namespace, whose veth reaches
    // the other host's address.
    let out = w.a().check(&format!("timeout 90 ibv_rc_pingpong -p {port} -n {ITERS} -c {addr}"), T);
    let server = server.finish(LIMIT);
    let out = out.unwrap_or_else(|e| panic!("the guest client: {e}\n{}", server.describe()));
    pingpong_ran("ibv_rc_pingpong (guest client)", &out);
    host_ok(&server);
    assert!(frames(w) > before, "no frame crossed between the daemons");
}

/// Whether Debian's rdma_cm programs are in the image (it carries
/// `rping` and `ucmatose` where the host has them); says so if not.
fn rdmacm_tools() -> bool {
    let missing = image::RDMACM_TOOLS.iter().find(|t| vrdma_guest::libs::which(t).is_none());
    if let Some(t) = missing {
        vrdma_it::skip(format!("{t} is missing (apt-get install rdmacm-utils): no rdma_cm case in guests"));
    }
    missing.is_none()
}

/// Waits until the main daemon has a listener of the VMs' tenant (this
/// test's) for `addr` (rdma_cm listeners show in no socket table), at
/// most [`CM_LISTEN_WAIT`]; else fails with the output of guest a's `tag`.
fn cm_listening_in_a(w: &mut World, tag: &str, addr: SocketAddrV4) {
    let ctx = vrdma::Context::open_at(&w.main.socket).expect("open");
    let end = Instant::now() + CM_LISTEN_WAIT;
    while !vrdma::cm::is_listening(&ctx, vrdma::cm::PortSpace::Tcp, addr).expect("HasListener") {
        if Instant::now() > end {
            let (st, out) = guest_wait(w.a(), tag);
            panic!("{tag} in guest a never listened on {addr} (status {st}):\n{out}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// rping's lines `<prefix><n>: ...` for n in 0..count, in order.
fn rping_lines(who: &str, out: &str, prefix: &str, count: usize) {
    let lines: Vec<&str> = out.lines().filter(|l| l.starts_with(prefix)).collect();
    assert_eq!(lines.len(), count, "{who}: {count} lines {prefix:?} wanted\n{out}");
    for (n, l) in lines.iter().enumerate() {
        assert!(l.starts_with(&format!("{prefix}{n}: ")), "{who}: line {n}: {l:?}\n{out}");
    }
    for bad in ["data mismatch", "vrdma librdmacm:", "vrdma-verbs:", "error", "failed"] {
        assert!(!out.contains(bad), "{who}: {bad:?} in the output\n{out}");
    }
}

/// Debian's `rping` on the drop-in librdmacm in both guests: the server
/// in VM a on VM a's address, the client in VM b, which validates what
/// comes back (`-V`). No TCP: the whole exchange is rdma_cm's.
fn rping_two_guests(w: &mut World) {
    if !rdmacm_tools() {
        return;
    }
    let port = free_port();
    let common = format!("-a {CM_ADDR_A} -p {port} -C 5 -v");
    guest_bg(w.a(), "rping", 90, &format!("rping -s {common}"));
    cm_listening_in_a(w, "rping", SocketAddrV4::new(CM_ADDR_A, port));
    let client = w.b.run(&format!("timeout 90 rping -c {common} -V"), T).unwrap();
    let (st, out) = guest_wait(w.a(), "rping");
    assert_eq!((st, client.0), (0, 0), "guest a (server):\n{out}\nguest b (client):\n{}", client.1);
    rping_lines("rping -c (guest b)", &client.1, "ping data: rdma-ping-", 5);
    rping_lines("rping -s (guest a)", &out, "server ping data: rdma-ping-", 5);
}

/// perftest's words when its test connection (the second) was turned
/// away: its server listens again only after the first, and a client
/// faster than that is rejected; the pair starts over (as in
/// crates/vrdma-rdmacm/tests/more_clients.rs).
const PERFTEST_RESTART: &str = "RDMA_CM_EVENT_REJECTED; error: 8";
const PERFTEST_TRIES: usize = 3;

/// `ib_write_lat -R` (connection and the exchange of its buffers' keys
/// over rdma_cm): a host process serves on every address, the guest's
/// client connects to the daemon's own.
fn perftest_cm(w: &mut World) {
    if !rdmacm_tools() {
        return;
    }
    for attempt in 1..=PERFTEST_TRIES {
        let port = free_port();
        let p = port.to_string();
        let common = ["-R", "-F", "-d", "vrdma0", "-p", p.as_str(), "-n", "50"];
        let mut server = w.host(false, "/usr/bin/ib_write_lat");
        server.args(common);
        let mut server = spawn(server, "ib_write_lat -R (host server)");
        let ctx = vrdma::Context::open_at(&w.main.socket).expect("open");
        let end = Instant::now() + Duration::from_secs(30);
        let at = SocketAddrV4::new(w.cm_addr, port);
        while !vrdma::cm::is_listening(&ctx, vrdma::cm::PortSpace::Tcp, at).expect("HasListener") {
            if server.exited() || Instant::now() > end {
                panic!("ib_write_lat -R never listened\n{}", server.finish(LIMIT).describe());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let cmd = format!("timeout 90 ib_write_lat {} {}", common.join(" "), w.cm_addr);
        let (st, out) = w.a().run(&cmd, T).unwrap();
        if st != 0 && out.contains(PERFTEST_RESTART) && attempt < PERFTEST_TRIES {
            eprintln!("  ib_write_lat -R: the test connection was turned away; the pair starts over");
            continue; // the server, waiting for a second client, is killed on drop
        }
        let server = server.finish(LIMIT);
        assert_eq!(st, 0, "ib_write_lat -R in the guest:\n{out}\n{}", server.describe());
        server.assert_ok();
        for (who, text) in [("guest client", out.as_str()), ("host server", server.stdout.as_str())] {
            assert!(vrdma_it::harness::has_results(text), "{who}: no results\n{text}");
            assert!(text.contains("Data ex. method : rdma_cm"), "{who}: not over rdma_cm\n{text}");
        }
        eprintln!("  ib_write_lat -R in the guest (client):\n{}", results(&out));
        return;
    }
}

fn killed_mid_transfer(w: &mut World) {
    let port = free_port();
    let mut server = w.host(false, "/usr/bin/ibv_rc_pingpong");
    server.args(["-p", &port.to_string(), "-n", "100000000", "-s", "1024"]);
    let mut server = host_server(server, "ibv_rc_pingpong (host server, long)", port);
    guest_bg(w.a(), "long", 300, &format!("ibv_rc_pingpong -p {port} -n 100000000 -s 1024 10.0.2.2"));
    // Mid-transfer: the server stopped listening (it took the client) and
    // runs on; a moment of traffic.
    let end = Instant::now() + Duration::from_secs(60);
    while listening_in(server.pid(), port) {
        assert!(!server.exited() && Instant::now() < end, "the transfer never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_secs(2));
    assert!(!server.exited(), "the host server ended before the guest was killed");
    let mut a = w.a.take().expect("guest a");
    let killed = Instant::now();
    let st = a.kill().expect("kill QEMU");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(st.signal(), Some(libc::SIGKILL), "{st:?}");
    // The host's side fails (its QP in the error state, its work flushed),
    // within a bound, rather than hanging.
    let f = server.finish(Duration::from_secs(30));
    let took = killed.elapsed();
    assert!(!f.status.success(), "the host's peer of a killed VM exited 0\n{}", f.describe());
    eprintln!(
        "  the host's peer failed {:.1} s after QEMU was killed: {}",
        took.as_secs_f64(),
        f.stderr.trim()
    );
    // The daemon freed what the VM held: no QP of the tenant (the VM's
    // and this test's) is left once the host's peer is gone.
    let ctx = vrdma::Context::open_at(&w.main.socket).expect("open");
    let end = Instant::now() + Duration::from_secs(15);
    loop {
        let qps = ctx.stat().expect("stat").qps;
        if qps.is_empty() {
            break;
        }
        assert!(Instant::now() < end, "QPs left after the VM was killed: {qps:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(ctx);
    // The daemon serves on: its CLI, and guest b on a new session.
    let stat = Command::new(VRDMA).arg("--socket").arg(&w.main.socket).arg("stat").output().unwrap();
    assert!(stat.status.success(), "vrdma stat: {}", String::from_utf8_lossy(&stat.stderr));
    let out = w.b.check("timeout 60 ibv_devinfo", T).unwrap();
    assert!(out.contains("PORT_ACTIVE"), "{out}");
    let port = free_port();
    let mut server = w.host(false, "/usr/bin/ibv_rc_pingpong");
    server.args(["-p", &port.to_string(), "-n", ITERS, "-c"]);
    let server = host_server(server, "ibv_rc_pingpong (host server)", port);
    let out = w.b.check(&format!("timeout 90 ibv_rc_pingpong -p {port} -n {ITERS} -c 10.0.2.2"), T);
    let server = server.finish(LIMIT);
    let out = out.unwrap_or_else(|e| panic!("guest b after a was killed: {e}\n{}", server.describe()));
    pingpong_ran("ibv_rc_pingpong (guest b)", &out);
    host_ok(&server);
    drop(a);
    // And VM a comes back: a new QEMU attaches the same region and
    // ports, and its guest's sessions work.
    let a = boot(&w.img, &w.main.socket, "a", w.ns.as_deref(), &[]);
    w.a = Some(a);
    let port = free_port();
    let mut server = w.host(false, "/usr/bin/ibv_rc_pingpong");
    server.args(["-p", &port.to_string(), "-n", ITERS, "-c"]);
    let server = host_server(server, "ibv_rc_pingpong (host server)", port);
    let out = w.a().check(&format!("timeout 90 ibv_rc_pingpong -p {port} -n {ITERS} -c 10.0.2.2"), T);
    let server = server.finish(LIMIT);
    let out = out.unwrap_or_else(|e| panic!("VM a booted again: {e}\n{}", server.describe()));
    pingpong_ran("ibv_rc_pingpong (VM a, booted again)", &out);
    host_ok(&server);
}

/// Runs of each figure; the median is shown.
const FIGURE_RUNS: usize = 3;

/// Not a check: with `VRDMA_GUEST_FIGURES=1`, perftest's 8 B RDMA write
/// latency (`t_typical`) and 1 MiB send bandwidth (`BW average`) from
/// guest a to a host process, beside the same between two host processes
/// (the anchor) in the same run, medians of [`FIGURE_RUNS`], with the
/// accelerator named. Under TCG the guest's figures are functional, not
/// comparable with KVM's.
fn figures(w: &mut World) {
    if std::env::var_os("VRDMA_GUEST_FIGURES").is_none() {
        eprintln!("  (set VRDMA_GUEST_FIGURES=1 for VM-to-host figures)");
        return;
    }
    let accel = w.b.accel().name();
    let mut rows = Vec::new();
    for (tool, args, col, what) in [
        ("ib_write_lat", "-s 8 -n 1000", 4, "8 B RDMA write latency, t_typical [us]"),
        ("ib_send_bw", "-s 1048576 -n 200", 3, "1 MiB send bandwidth, BW average [MB/s]"),
    ] {
        let (mut vm, mut host) = (Vec::new(), Vec::new());
        for _ in 0..FIGURE_RUNS {
            for from_vm in [false, true] {
                let port = free_port();
                let common = format!("-p {port} -d vrdma0 -F {args}");
                let mut server = w.host(false, &format!("/usr/bin/{tool}"));
                server.args(common.split_whitespace());
                let server = host_server(server, &format!("{tool} (host server)"), port);
                let out = if from_vm {
                    let (st, out) = w.a().run(&format!("timeout 120 {tool} {common} 10.0.2.2"), T).unwrap();
                    assert_eq!(st, 0, "{tool} in the guest:\n{out}");
                    out
                } else {
                    let mut c = w.host(false, &format!("/usr/bin/{tool}"));
                    c.args(common.split_whitespace()).arg("127.0.0.1");
                    let f = spawn(c, &format!("{tool} (host client)")).finish(LIMIT);
                    f.assert_ok();
                    f.stdout
                };
                server.finish(LIMIT).assert_ok();
                let v = result_column(&out, col).unwrap_or_else(|| panic!("{tool}: no result\n{out}"));
                if from_vm {
                    vm.push(v)
                } else {
                    host.push(v)
                }
            }
        }
        let (v, h) = (median(&mut vm), median(&mut host));
        rows.push(format!("  {what}: VM ({accel}) to host {v:.2}, host to host {h:.2}, ratio {:.2} (runs: VM {vm:?}, host {host:?})", v / h));
    }
    eprintln!("  figures, medians of {FIGURE_RUNS} runs, accelerator {accel}:\n{}", rows.join("\n"));
}

/// Column `col` of the first row of perftest's result table.
fn result_column(out: &str, col: usize) -> Option<f64> {
    let mut lines = out.lines().skip_while(|l| !l.trim_start().starts_with("#bytes"));
    lines.next()?;
    lines.next()?.split_whitespace().nth(col)?.parse().ok()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// `vrdma stat --json` in guest a, parsed.
fn guest_stat(w: &mut World) -> serde_json::Value {
    let out = w.a().check("VRDMA_LOG=warn timeout 60 vrdma stat --json", T).unwrap();
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("vrdma stat --json in the guest: {e}\n{out}"))
}

fn counter(v: &serde_json::Value, name: &str) -> u64 {
    v["tenant"]["counters"][name].as_u64().unwrap_or_else(|| panic!("no counter {name}: {v}"))
}

/// The CLI inside guest a, served by the host's daemon through the VM's
/// ports (it starts no daemon of its own there, which nothing outside
/// the VM could reach): `vrdma run -- ibv_rc_pingpong` against a host
/// process, `vrdma cp` of a file to a host receiver over rdma_cm (the
/// bytes checked on both ends), and `vrdma stat --json`, which shows the
/// VM's tenant (this test's uid) and its counters moving with that
/// traffic. Then a guest device named but not there is a clear error.
/// As root: a host tenant other than the VM's (uid 61071, by `setpriv`)
/// runs a ping-pong on the same daemon; guest a's `vrdma stat` shows
/// none of it: not its QP while it waits, nor its messages after
/// (`after`: guest a's figures before).
fn other_tenant_unseen(w: &mut World, after: &serde_json::Value) {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        vrdma_it::skip("not root: no other tenant's ping-pong beside guest a's vrdma stat");
        return;
    }
    const OTHER: &str = "61071";
    // The other uid reaches the daemon's socket (0666) and the drop-in.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(w.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let as_other = |w: &World| {
        let mut c = w.host(false, "/usr/bin/setpriv");
        c.args([
            &format!("--reuid={OTHER}"),
            &format!("--regid={OTHER}"),
            "--clear-groups",
            "/usr/bin/ibv_rc_pingpong",
        ]);
        c
    };
    let qpns = |v: &serde_json::Value| -> Vec<u64> {
        v["qps"].as_array().map(|q| q.iter().filter_map(|q| q["qpn"].as_u64()).collect()).unwrap_or_default()
    };
    let port = free_port();
    let mut server = as_other(w);
    server.args(["-p", &port.to_string(), "-n", ITERS, "-c"]);
    let server = host_server(server, "ibv_rc_pingpong (host server, another tenant)", port);
    let waiting = guest_stat(w);
    let mut client = as_other(w);
    client.args(["-p", &port.to_string(), "-n", ITERS, "-c", "127.0.0.1"]);
    let client = spawn(client, "ibv_rc_pingpong (host client, another tenant)").finish(LIMIT);
    let server = server.finish(LIMIT);
    host_ok(&client);
    host_ok(&server);
    let done = guest_stat(w);
    assert_eq!(qpns(&waiting), qpns(after), "guest a sees another tenant's QP:\n{after}\n{waiting}");
    for c in ["messages_sent", "messages_received", "bytes_sent", "bytes_received"] {
        assert_eq!(
            counter(&done, c),
            counter(after, c),
            "guest a counts another tenant's {c}:\n{after}\n{done}"
        );
    }
    for v in [&waiting, &done] {
        assert_eq!(v["tenant"]["tenant"].as_u64(), after["tenant"]["tenant"].as_u64(), "{v}");
    }
}

fn cli_in_guest(w: &mut World) {
    // SAFETY: geteuid has no preconditions.
    let uid = u64::from(unsafe { libc::geteuid() });
    let before = guest_stat(w);
    assert_eq!(before["tenant"]["tenant"].as_u64(), Some(uid), "the VM's tenant: {before}");

    // vrdma run: the program's drop-in reaches a host process.
    let port = free_port();
    let mut server = w.host(false, "/usr/bin/ibv_rc_pingpong");
    server.args(["-p", &port.to_string(), "-n", ITERS, "-c"]);
    let server = host_server(server, "ibv_rc_pingpong (host server)", port);
    let cmd = format!("timeout 90 vrdma run -- ibv_rc_pingpong -p {port} -n {ITERS} -c 10.0.2.2");
    let out = w.a().check(&cmd, T);
    let server = server.finish(LIMIT);
    let out = out.unwrap_or_else(|e| panic!("vrdma run in the guest: {e}\n{}", server.describe()));
    pingpong_ran("vrdma run -- ibv_rc_pingpong (guest client)", &out);
    assert!(
        out.contains("using the host's daemon"),
        "vrdma run did not say it uses the host's daemon:\n{out}"
    );
    host_ok(&server);

    // vrdma cp: guest to a host receiver listening on every address; the
    // guest's sender connects to the daemon's own.
    let port = free_port();
    let received = w.dir.path().join("cp.out");
    let mut recv = in_ns(w.ns.as_deref(), VRDMA);
    recv.arg("--socket")
        .arg(&w.main.socket)
        .arg("cp")
        .arg("--quiet")
        .arg("--recv")
        .arg(&received)
        .args(["--listen", &format!("0.0.0.0:{port}")]);
    let mut recv = spawn(recv, "vrdma cp --recv (host)");
    let ctx = vrdma::Context::open_at(&w.main.socket).expect("open");
    let at = SocketAddrV4::new(w.cm_addr, port);
    let end = Instant::now() + Duration::from_secs(30);
    while !vrdma::cm::is_listening(&ctx, vrdma::cm::PortSpace::Tcp, at).expect("HasListener") {
        if recv.exited() || Instant::now() > end {
            panic!("vrdma cp --recv never listened\n{}", recv.finish(LIMIT).describe());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(ctx);
    const CP_KIB: u64 = 700;
    let cmd = format!(
        "dd if=/dev/urandom of=/tmp/cp.in bs=1024 count={CP_KIB} 2>/dev/null && \
         timeout 90 vrdma cp --quiet /tmp/cp.in {}:{port} && sha256sum /tmp/cp.in",
        w.cm_addr
    );
    let out = w.a().check(&cmd, T);
    let recv = recv.finish(LIMIT);
    let out = out.unwrap_or_else(|e| panic!("vrdma cp in the guest: {e}\n{}", recv.describe()));
    recv.assert_ok();
    let sent = out
        .lines()
        .find_map(|l| match l.split_whitespace().collect::<Vec<_>>()[..] {
            [h, "/tmp/cp.in"] if h.len() == 64 => Some(h.to_string()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no sha256sum of the sent file:\n{out}"));
    let bytes = std::fs::read(&received).expect("the received file");
    assert_eq!(bytes.len() as u64, CP_KIB * 1024, "{}", recv.describe());
    use sha2::Digest;
    let got: String = sha2::Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(got, sent, "the file the host received differs from the guest's\n{out}");

    // vrdma stat: the tenant's counters moved with that traffic (the
    // file at least, sent from the guest).
    let after = guest_stat(w);
    assert_eq!(after["tenant"]["tenant"].as_u64(), Some(uid), "{after}");
    for c in ["messages_sent", "messages_received"] {
        assert!(counter(&after, c) > counter(&before, c), "{c} did not move: {before}\n{after}");
    }
    assert!(
        counter(&after, "bytes_sent") >= counter(&before, "bytes_sent") + CP_KIB * 1024,
        "bytes_sent did not grow by the file: {before}\n{after}"
    );

    // vrdma run of a program that only asks the device.
    let out = w.a().check("timeout 60 vrdma run -- ibv_devinfo", T).unwrap();
    assert!(
        out.contains("hca_id:\tvrdma0") && out.contains("PORT_ACTIVE"),
        "vrdma run -- ibv_devinfo:\n{out}"
    );

    other_tenant_unseen(w, &after);

    // The host operator's commands: an error saying they are the host's,
    // not a daemon of the guest's own that would hide the VM's device.
    for cmd in ["vrdma vm args a --fd 3", "vrdma migrate pause --vm a", "vrdma daemon"] {
        let (st, out) = w.a().run(&format!("timeout 60 {cmd}"), T).unwrap();
        assert_ne!(st, 0, "{cmd} in a guest:\n{out}");
        assert!(
            out.contains("is the host operator's command") && out.contains("QEMU guest"),
            "{cmd} in a guest does not say it is the host's:\n{out}"
        );
    }

    // A guest device named but not there: an error saying so, no daemon.
    let bad = "VRDMA_GUEST_PORT=/dev/vrdma-none VRDMA_GUEST_BAR=/vrdma-none";
    let (st, out) = w.a().run(&format!("{bad} timeout 60 vrdma run -- true"), T).unwrap();
    assert_ne!(st, 0, "vrdma run with no device:\n{out}");
    assert!(out.contains("is not usable") && out.contains("/vrdma-none"), "{out}");
    let (st, out) = w.a().run(&format!("{bad} timeout 60 vrdma stat"), T).unwrap();
    assert_ne!(st, 0, "vrdma stat with no device:\n{out}");
    assert!(out.contains("does not answer through this VM's ports"), "{out}");
}
