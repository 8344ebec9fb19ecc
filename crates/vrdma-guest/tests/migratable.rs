//! A VM attached as `vm_args` attaches it can be live-migrated by QEMU:
//! its ivshmem device is the migration's master (`master=on`), so QEMU
//! copies the region with the VM (issue 19) instead of refusing to
//! migrate ("Migration is disabled when using feature 'peer mode' in
//! device 'ivshmem'", QEMU 7.2's answer with the default, off).
//!
//! No guest boots: QEMU starts stopped (`-S`) and migrates to a file.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rustix::fs::MemfdFlags;
use vrdma_guest::vm_args;

const REGION_LEN: u64 = 1 << 20;
const T: Duration = Duration::from_secs(60);

#[test]
fn qemu_migrates_a_vm_with_the_contracts_device() {
    if vrdma_guest::libs::which(vrdma_guest::guest::QEMU).is_none() {
        vrdma_it::skip("qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Inherited by QEMU: no close-on-exec, as the contract says.
    let region = rustix::fs::memfd_create("vrdma-test-region", MemfdFlags::empty()).unwrap();
    rustix::fs::ftruncate(&region, REGION_LEN).unwrap();
    // The port's chardev connects to the daemon's socket; a listener
    // whose backlog takes the connection stands in for the daemon.
    let port = dir.path().join("vm.sock");
    let _listener = UnixListener::bind(&port).unwrap();
    let out = dir.path().join("migration.bin");

    let mut qemu = Command::new(vrdma_guest::guest::QEMU)
        .args(["-S", "-nodefaults", "-display", "none", "-machine", "pc", "-m", "32", "-monitor", "stdio"])
        .args(vm_args(region.as_raw_fd(), REGION_LEN, &port, 1).unwrap())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start QEMU");
    let (lines, said) = mpsc::channel();
    let stdout = qemu.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines() {
            let Ok(l) = l else { break };
            if lines.send(l).is_err() {
                break;
            }
        }
    });
    let mut monitor = qemu.stdin.take().unwrap();
    writeln!(monitor, "migrate \"exec:cat > {}\"", out.display()).unwrap();
    let end = Instant::now() + T;
    let mut seen = Vec::new();
    let status = loop {
        writeln!(monitor, "info migrate").unwrap();
        let mut status = None;
        while let Ok(l) = said.recv_timeout(Duration::from_millis(100)) {
            if l.contains("Migration is disabled") || l.contains("Error") {
                status = Some(l.clone());
            }
            if let Some(s) = l.strip_prefix("Migration status: ") {
                status = Some(s.trim().to_string());
            }
            // Not the monitor's echo of what we typed (terminal escapes).
            if !l.contains('\u{1b}') {
                seen.push(l);
            }
        }
        match status.as_deref() {
            Some("active" | "setup") | None if Instant::now() < end => continue,
            _ => break status,
        }
    };
    let _ = writeln!(monitor, "quit");
    drop(monitor);
    let end = Instant::now() + Duration::from_secs(10);
    while qemu.try_wait().unwrap().is_none() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
    }
    // By its pid, should `quit` not have ended it.
    let _ = qemu.kill();
    let _ = qemu.wait();
    assert_eq!(status.as_deref(), Some("completed"), "QEMU said:\n{}", seen.join("\n"));
    let len = std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0);
    assert!(len > 0, "the migration stream is empty");
}
