//! The built library against rdma-core 44's provider libraries: every
//! function those installed export is exported here at the same version
//! (and the same default or older binding), nothing else is; and a C
//! program built against rdma-core's headers and run on a vRDMA device
//! gets "not supported" from each library.
//!
//! The tests read the libraries with `objdump -T` (binutils) and build
//! the C program with `cc` (`$CC`); without them, or without rdma-core's
//! libraries and headers (`ibverbs-providers`, `libibverbs-dev`), they
//! skip, saying so, and under `VRDMA_TEST_STRICT=1` fail instead. Every
//! wait is bounded: a program still running at its deadline is killed by
//! pid and the test fails.

// The library exists for x86-64 Linux only (see src/lib.rs).
#![cfg(all(target_os = "linux", target_arch = "x86_64"))]

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vrdma_companions::{EXPORTS, SONAMES};
use vrdma_it::harness::built;

/// Where Debian installs rdma-core's provider libraries.
const REAL_DIR: &str = "/usr/lib/x86_64-linux-gnu";
const LIMIT: Duration = Duration::from_secs(60);

/// A defined dynamic function: name, version node, and whether it is the
/// default version (`objdump -T` shows an older one in parentheses).
type Symbol = (String, String, bool);

/// The functions `file` defines, per `objdump -T`; `None`, having said
/// why (see `vrdma_it::skip`), without objdump.
fn functions(file: &Path) -> Option<BTreeSet<Symbol>> {
    let out = match Command::new("objdump").arg("-T").arg(file).output() {
        Ok(o) if o.status.success() => o,
        Ok(o) => panic!("objdump -T {}: {}", file.display(), String::from_utf8_lossy(&o.stderr)),
        Err(e) => {
            vrdma_it::skip(format!("objdump (binutils) is not available: {e}"));
            return None;
        }
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let symbols = text
        .lines()
        .filter(|l| l.contains(" DF ") && !l.contains("*UND*"))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (version, name) = (f[f.len() - 2], f[f.len() - 1]);
            let old = version.starts_with('(');
            (name.to_string(), version.trim_matches(['(', ')']).to_string(), !old)
        })
        .collect();
    Some(symbols)
}

/// The table in src/lib.rs is what the linked library exports, exactly.
#[test]
fn the_library_exports_its_table() {
    let Some(ours) = functions(&built("libvrdma_companions.so")) else { return };
    let table: BTreeSet<Symbol> =
        EXPORTS.iter().map(|e| (e.name.to_string(), e.node.to_string(), e.default)).collect();
    assert_eq!(ours, table);
}

/// Every function each installed rdma-core provider library exports (the
/// ones with a direct-verbs interface: all that Debian's ibverbs-providers
/// links under a soname) is exported here at its version, and no other
/// function is exported under that library's version nodes.
#[test]
fn every_provider_export_is_there() {
    let Some(ours) = functions(&built("libvrdma_companions.so")) else { return };
    for soname in SONAMES {
        let real = Path::new(REAL_DIR).join(soname);
        if !real.exists() {
            vrdma_it::skip(format!(
                "rdma-core's {} is not installed (apt-get install ibverbs-providers)",
                real.display()
            ));
            continue;
        }
        let Some(theirs) = functions(&real) else { return };
        assert!(!theirs.is_empty(), "{} exports no function?", real.display());
        let prefix = |s: &Symbol| s.1.split('_').next().map(str::to_string);
        let nodes: BTreeSet<_> = theirs.iter().filter_map(prefix).collect();
        for s in &theirs {
            assert!(ours.contains(s), "{soname} exports {}{}{}; the stand-in does not", s.0, at(s.2), s.1);
        }
        for s in ours.iter().filter(|s| prefix(s).is_some_and(|p| nodes.contains(&p))) {
            assert!(theirs.contains(s), "the stand-in exports {}{}{}; {soname} does not", s.0, at(s.2), s.1);
        }
        eprintln!("{soname}: {} functions, all exported at their versions", theirs.len());
    }
    // Debian's ibverbs-providers ships no other library with a
    // direct-verbs interface: a new one is to be added to SONAMES.
    let Ok(entries) = std::fs::read_dir(REAL_DIR) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let provider = ["libmlx", "libefa", "libmana", "libhns", "libbnxt", "libirdma", "liberdma"];
        if name.ends_with(".so.1") && provider.iter().any(|p| name.starts_with(p)) {
            assert!(SONAMES.contains(&name.as_str()), "{REAL_DIR}/{name} has no stand-in");
        }
    }
}

fn at(default: bool) -> &'static str {
    if default {
        "@@"
    } else {
        "@"
    }
}

/// `tests/c/companions_check.c`, built against rdma-core's headers and
/// linked against vRDMA's `libibverbs.so.1` and this library under each
/// of its sonames (a directory of links, as `vrdma run` makes), run on a
/// daemon's device: every library answers "not supported" and claims no
/// device.
#[test]
fn c_program_gets_not_supported() {
    let headers = ["verbs.h", "mlx5dv.h", "mlx4dv.h", "efadv.h", "manadv.h"];
    if let Some(h) = headers.iter().find(|h| !Path::new("/usr/include/infiniband").join(h).exists()) {
        vrdma_it::skip(format!("/usr/include/infiniband/{h} is missing (apt-get install libibverbs-dev)"));
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let lib = dir.path().join("lib");
    std::fs::create_dir(&lib).expect("lib dir");
    let link =
        |target: &Path, name: &str| std::os::unix::fs::symlink(target, lib.join(name)).expect("symlink");
    link(&built("libvrdma_verbs.so"), "libibverbs.so.1");
    let companions = built("libvrdma_companions.so");
    for soname in SONAMES {
        link(&companions, soname);
    }

    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/companions_check.c");
    let exe = dir.path().join("companions_check");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let mut build = Command::new(&cc);
    build.args(["-O2", "-Wall", "-Werror", "-o"]).arg(&exe).arg(&src).arg("-L").arg(&lib);
    // Each soname a DT_NEEDED entry, as in a program linked against
    // rdma-core's libraries, even where the toolchain links as needed.
    build.arg("-Wl,--no-as-needed").arg("-l:libibverbs.so.1");
    for soname in SONAMES {
        build.arg(format!("-l:{soname}"));
    }
    match build.arg("-ldl").output() {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!("{cc} failed:\n{}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => {
            vrdma_it::skip(format!("no C compiler ({cc}: {e})"));
            return;
        }
    }

    let socket = dir.path().join("vrdma.sock");
    let config = vrdmad::DaemonConfig { socket: Some(socket.clone()), ..Default::default() };
    let _daemon = vrdmad::Daemon::start(config).expect("start daemon");
    let (stdout, stderr) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let mut child = Command::new(&exe)
        .env("LD_LIBRARY_PATH", &lib)
        .env("VRDMA_SOCKET", &socket)
        .env("LD_BIND_NOW", "1")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&stdout).expect("stdout file"))
        .stderr(std::fs::File::create(&stderr).expect("stderr file"))
        .spawn()
        .expect("spawn companions_check");
    let end = Instant::now() + LIMIT;
    let status = loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            break s;
        }
        if Instant::now() > end {
            // SAFETY: kill(2) on our child, not yet reaped, so the pid is
            // still its.
            unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
            let _ = child.wait();
            panic!("companions_check ran past {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    let (out, err) = (read(&stdout), read(&stderr));
    let describe = format!("companions_check: {status}\n--- stdout\n{out}--- stderr\n{err}");
    assert!(status.success() && out.contains("companions_check: OK"), "{describe}");
}
