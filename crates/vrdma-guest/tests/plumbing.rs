//! Real QEMU guests, the plumbing the VM transport stands on: one guest
//! booted for this whole binary (boots cost seconds under TCG), the
//! cases run in order against it, the last one killing it.
//!
//! - the guest boots (Debian's cloud kernel, the busybox initramfs) and
//!   runs commands, with their status and output;
//! - the project's `vrdma` and drop-in libraries and Debian's verbs tools
//!   load in the guest, the tools finding vRDMA's `libibverbs.so.1`;
//! - ivshmem: a sealed memfd given to QEMU as the contract says reaches
//!   the guest as the BAR of the PCI device 1af4:1110, mapped from its
//!   sysfs `resource2`, both ways;
//! - virtio-serial: the contract's two ports reach the host's Unix
//!   socket, found in the guest by their names, bytes flowing both ways
//!   on both, and a second open of a taken port fails with EBUSY;
//! - QEMU killed by its pid: the host's ends of the ports see the end of
//!   their stream.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use rustix::fs::{MemfdFlags, SealFlags};
use vrdma_guest::{image, vm_args, DropIn, Guest, GuestSpec, ImageSpec};

const REGION_LEN: u64 = 1 << 20;
const PORTS: u32 = 2;
const HOST_PATTERN: &str = "vrdma host says hello through ivshmem";
const GUEST_REPLY: &str = "and the guest answers";
const REPLY_AT: u64 = 4096;
const T: Duration = Duration::from_secs(60);

#[test]
fn guest_plumbing() {
    if vrdma_guest::libs::which(vrdma_guest::guest::QEMU).is_none() {
        vrdma_it::skip(
            "qemu-system-x86_64 is not installed (apt-get install qemu-system-x86 busybox-static)",
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();

    // The image: the BAR helper, and where they are built, the project's
    // binary and drop-in libraries with Debian's verbs tools.
    let mut spec = ImageSpec::default();
    spec.files.push(vrdma_guest::GuestFile {
        host: env!("CARGO_BIN_EXE_vrdma-guest-bar").into(),
        guest: "/usr/bin/vrdma-guest-bar".into(),
        libraries: true,
    });
    let drop_in = vrdma_guest::cache::profile_dir().ok_or("no profile dir").map_err(|e| e.to_string());
    let drop_in = drop_in.and_then(|d| DropIn::from_profile_dir(&d).map_err(|e| e.to_string()));
    let tools = match drop_in {
        Ok(d) => {
            spec = spec
                .with_drop_in(d)
                .debian_tools()
                .expect("Debian's verbs tools (ibverbs-utils, perftest, qperf)");
            true
        }
        Err(e) => {
            vrdma_it::skip(format!("the guest gets no vRDMA binaries: {e}"));
            false
        }
    };
    let t0 = Instant::now();
    let img = image::build(&spec).expect("build the guest image");
    let size = std::fs::metadata(&img.initramfs).unwrap().len();
    // `vrdma vm image --out DIR`: the same image, copied out.
    let out = image::export(&spec, &dir.path().join("image")).unwrap();
    assert_eq!(std::fs::metadata(&out.initramfs).unwrap().len(), size);
    assert_eq!(std::fs::read(&out.kernel).unwrap(), std::fs::read(&img.kernel).unwrap());
    eprintln!(
        "image: kernel {}, initramfs {} MiB, ready in {:.1} s",
        img.release,
        size >> 20,
        t0.elapsed().as_secs_f64()
    );

    // The VM's region: a sealed memfd with a pattern, as the daemon makes.
    let memfd: OwnedFd =
        rustix::fs::memfd_create("vrdma-test-region", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .unwrap();
    rustix::fs::ftruncate(&memfd, REGION_LEN).unwrap();
    rustix::fs::fcntl_add_seals(&memfd, SealFlags::SHRINK | SealFlags::GROW).unwrap();
    let region = std::fs::File::from(memfd.try_clone().unwrap());
    region.write_all_at(HOST_PATTERN.as_bytes(), 0).unwrap();

    // The ports' host end.
    let sock = dir.path().join("vm-test.sock");
    let listener = UnixListener::bind(&sock).unwrap();

    let mut gspec = GuestSpec::new(img);
    let fd = gspec.inherit(memfd);
    gspec.extra_args = vm_args(fd, REGION_LEN, &sock, PORTS).unwrap();
    let mut g = Guest::boot(gspec).expect("boot the guest");
    eprintln!("guest: accelerator {}, shell after {:.2} s", g.accel().name(), g.boot_time().as_secs_f64());
    if let Some(why) = vrdma_guest::accel::kvm_unsuitable() {
        eprintln!("KVM not probed: {why}");
    } else if let Ok(Some((a, why))) = vrdma_guest::accel::remembered(g.release()) {
        eprintln!("KVM probe (remembered in the cache): {} ({why})", a.name());
    }

    boots_and_runs_commands(&mut g);
    if tools {
        binaries_load_with_vrdmas_libraries(&mut g);
    }
    ivshmem_region_both_ways(&mut g, &region);
    let streams = serial_ports_both_ways_and_exclusive(&mut g, &listener);
    killed_qemu_closes_the_ports(g, streams);
}

/// A guest that never reaches its shell fails to boot with its console in
/// the error (here the kernel finds no init, panics, and QEMU exits).
#[test]
fn a_failed_boot_shows_the_console() {
    if vrdma_guest::libs::which(vrdma_guest::guest::QEMU).is_none() {
        vrdma_it::skip("qemu-system-x86_64 is not installed");
        return;
    }
    let img = image::build(&ImageSpec::default()).expect("build the bare guest image");
    let mut spec = GuestSpec::new(img);
    spec.append = "rdinit=/nonexistent".into();
    match Guest::boot(spec) {
        Err(vrdma_guest::Error::Boot { why, console }) => {
            assert!(console.contains("Kernel panic"), "{why}\n{console}");
            eprintln!("failed boot reported: {why}");
        }
        Err(e) => panic!("not a boot error: {e}"),
        Ok(_) => panic!("a guest without init booted"),
    }
}

fn boots_and_runs_commands(g: &mut Guest) {
    let (st, out) = g.run("uname -r; echo 'two words'; printf 'no newline'; exit 3", T).unwrap();
    assert_eq!(st, 3, "{out}");
    assert_eq!(out, format!("{}\ntwo words\nno newline", g.release()));
    // Quotes, newlines and a long script survive the trip.
    let (st, out) = g.run("printf '%s\\n' \"it's \\\"quoted\\\" \\$HOME\"\nx=", T).unwrap();
    assert_eq!((st, out.as_str()), (0, "it's \"quoted\" $HOME\n"));
    let long = format!("x={}\necho ${{#x}}", "a".repeat(5000));
    assert_eq!(g.check(&long, T).unwrap(), "5000\n");
    // A command past its deadline is reported with what it printed so
    // far, the serial console's end (what the kernel said) and whether
    // it began; the next one runs after it, its stale output skipped.
    match g.run("echo early; echo serial-mark >/dev/console; sleep 4; echo late", Duration::from_secs(1)) {
        Err(vrdma_guest::Error::Timeout { output, console, .. }) => {
            assert_eq!(output, "early\n");
            assert!(
                console.contains("serial-mark") && console.contains("(the guest began the command)"),
                "{console}"
            );
        }
        other => panic!("a 4 s command with a 1 s deadline: {other:?}"),
    }
    assert_eq!(g.check("echo after", T).unwrap(), "after\n");
    let mods = g.check("cat /proc/modules | cut -d' ' -f1", T).unwrap();
    for m in ["virtio_pci", "virtio_console"] {
        assert!(mods.lines().any(|l| l == m), "{m} not loaded: {mods}");
    }
    eprintln!("case: boots and runs commands");
}

fn binaries_load_with_vrdmas_libraries(g: &mut Guest) {
    let out = g.check("vrdma --version", T).unwrap();
    assert!(out.starts_with("vrdma "), "{out}");
    for t in
        image::DEBIAN_TOOLS.iter().map(|t| format!("/usr/bin/{t}")).chain(["/opt/vrdma/bin/vrdma".into()])
    {
        let out = g.check(&format!("/lib64/ld-linux-x86-64.so.2 --list {t}"), T).unwrap();
        assert!(!out.contains("not found"), "{t}:\n{out}");
        if t.starts_with("/usr/bin/ib") || t.contains("qperf") {
            assert!(out.contains("libibverbs.so.1 => /opt/vrdma/lib/libibverbs.so.1"), "{t}:\n{out}");
        }
    }
    eprintln!("case: vrdma and Debian's verbs tools load vRDMA's libraries in the guest");
}

/// The guest's shell finding the BAR as the guest library does.
const FIND_BAR: &str = "for d in /sys/bus/pci/devices/*; do \
    if [ \"$(cat $d/vendor)\" = 0x1af4 ] && [ \"$(cat $d/device)\" = 0x1110 ]; then bar=$d/resource2; fi; done; \
    [ -n \"$bar\" ] || { echo no ivshmem device; exit 1; }";

fn ivshmem_region_both_ways(g: &mut Guest, region: &std::fs::File) {
    let size = g.check(&format!("{FIND_BAR}; stat -c %s $bar"), T).unwrap();
    // (A memory BAR's resource file can be mapped, not read: its size is
    // its length.)
    assert_eq!(size.trim(), REGION_LEN.to_string(), "the BAR is the region's size");
    let read =
        g.check(&format!("{FIND_BAR}; vrdma-guest-bar $bar read 0 {}", HOST_PATTERN.len()), T).unwrap();
    assert_eq!(read.trim_end(), HOST_PATTERN);
    g.check(&format!("{FIND_BAR}; vrdma-guest-bar $bar write {REPLY_AT} '{GUEST_REPLY}'"), T).unwrap();
    let mut back = vec![0u8; GUEST_REPLY.len()];
    region.read_exact_at(&mut back, REPLY_AT).unwrap();
    assert_eq!(String::from_utf8_lossy(&back), GUEST_REPLY);
    eprintln!("case: ivshmem region read and written from the guest's resource2");
}

/// Answers one port: reads the guest's hello line (naming the port),
/// replies, returns the port's name and the stream.
fn answer(s: UnixStream) -> (String, UnixStream) {
    s.set_read_timeout(Some(T)).unwrap();
    let mut line = String::new();
    BufReader::new(&s).read_line(&mut line).unwrap();
    let name =
        line.trim().strip_prefix("hello from ").unwrap_or_else(|| panic!("odd hello {line:?}")).to_string();
    (&s).write_all(format!("reply to {name}\n").as_bytes()).unwrap();
    (name, s)
}

fn serial_ports_both_ways_and_exclusive(g: &mut Guest, listener: &UnixListener) -> Vec<UnixStream> {
    // QEMU connected its chardevs while starting; they are queued here.
    listener.set_nonblocking(true).unwrap();
    let mut streams = Vec::new();
    let until = Instant::now() + T;
    while streams.len() < PORTS as usize && Instant::now() < until {
        match listener.accept() {
            Ok((s, _)) => streams.push(s),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => panic!("accept: {e}"),
        }
    }
    assert_eq!(streams.len(), PORTS as usize, "QEMU connected {} of {PORTS} ports", streams.len());
    let answering: Vec<_> = streams
        .into_iter()
        .map(|s| {
            s.set_nonblocking(false).unwrap();
            std::thread::spawn(move || answer(s))
        })
        .collect();
    // Each port: open it read-write, say hello, read the reply, and try a
    // second open while it is held.
    let script = "for p in /sys/class/virtio-ports/*; do \
        name=$(cat $p/name); case $name in org.vrdma.*) ;; *) continue;; esac; \
        dev=/dev/$(basename $p); exec 3<>$dev; echo \"hello from $name\" >&3; \
        read -r line <&3; echo \"$name got: $line\"; \
        echo \"$name second open: $( (exec 4<>$dev) 2>&1 )\"; exec 3<&-; done";
    let out = g.check(script, T).unwrap();
    let mut names: Vec<String> = Vec::new();
    let mut streams = Vec::new();
    for a in answering {
        let (name, s) = a.join().expect("a port's answering thread");
        names.push(name);
        streams.push(s);
    }
    names.sort();
    assert_eq!(names, ["org.vrdma.0", "org.vrdma.1"], "the guest's hellos named the ports");
    for k in 0..PORTS {
        let name = format!("org.vrdma.{k}");
        assert!(out.contains(&format!("{name} got: reply to {name}")), "{out}");
        let busy = out.lines().find(|l| l.starts_with(&format!("{name} second open:"))).unwrap_or("");
        assert!(
            busy.to_lowercase().contains("busy"),
            "a second open of a held port must fail with EBUSY: {busy:?}\n{out}"
        );
    }
    eprintln!("case: two virtio-serial ports both ways, a held port refuses a second open (EBUSY)");
    streams
}

fn killed_qemu_closes_the_ports(mut g: Guest, streams: Vec<UnixStream>) {
    let pid = rustix::process::Pid::from_raw(g.pid() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).unwrap();
    for mut s in streams {
        s.set_read_timeout(Some(T)).unwrap();
        let mut b = [0u8; 64];
        let started = Instant::now();
        // Bytes the guest sent earlier may come first; then the end.
        let mut ended = false;
        for _ in 0..100 {
            match s.read(&mut b) {
                Ok(0) => {
                    ended = true;
                    break;
                }
                Ok(_) => continue,
                Err(e) => panic!("reading a port after QEMU was killed: {e} (after {:?})", started.elapsed()),
            }
        }
        assert!(ended, "the port's stream did not end");
    }
    let st = g.kill().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(st.signal(), Some(libc::SIGKILL), "{st:?}");
    eprintln!("case: QEMU killed by its pid, the host sees both ports' streams end");
}
