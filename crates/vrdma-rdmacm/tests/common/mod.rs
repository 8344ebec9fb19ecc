//! The process harness these tests share with the other drop-in
//! libraries' (`vrdma_it::harness`), and how to wait for an rdma_cm
//! server to listen.

#![allow(dead_code, unused_imports)] // each test file uses a different part

use std::time::{Duration, Instant};

pub use vrdma_it::harness::*;

/// A directory for one test binary: `lib/` with the drop-in libraries
/// under the names programs load (`libibverbs.so.1`, `librdmacm.so.1`,
/// and the provider libraries' names for the companions, as `vrdma run`
/// links them), and a daemon of this process on `vrdma.sock` in it. The
/// directory is 0755 so that other uids' programs (another tenant) reach
/// the socket (0666) and the libraries.
pub fn drop_in_dir() -> (tempfile::TempDir, vrdmad::Daemon) {
    let dir = tempfile::tempdir().expect("temp dir");
    let lib = dir.path().join("lib");
    std::fs::create_dir(&lib).expect("lib dir");
    let link = |target: &std::path::Path, name: &str| {
        std::os::unix::fs::symlink(target, lib.join(name)).expect("symlink");
    };
    link(&built("libvrdma_verbs.so"), "libibverbs.so.1");
    link(&built("libvrdma_rdmacm.so"), "librdmacm.so.1");
    let companions = built("libvrdma_companions.so");
    for name in vrdma_companions::SONAMES {
        link(&companions, name);
    }
    std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let config = vrdmad::DaemonConfig { socket: Some(dir.path().join("vrdma.sock")), ..Default::default() };
    let daemon = vrdmad::Daemon::start(config).expect("start daemon");
    (dir, daemon)
}

/// Where the client `args` of an rdmacm-utils program connect to, for the
/// programs that make several connections (a first try could find the
/// server listening for some of them only, which it then waits for
/// forever): `ucmatose`, `cmtime`, `udaddy` (`-s HOST`, `-p PORT`),
/// `rping` (`-a HOST`), and perftest's `-R` clients (whose first try,
/// turned away, can end in a crash of their own rather than a retry).
/// `None` for anything else.
pub fn listen_target(program: &str, args: &[&str]) -> Option<(vrdma::cm::PortSpace, std::net::SocketAddrV4)> {
    use vrdma::cm::PortSpace;
    let name = program.rsplit('/').next()?;
    let value = |flag: &str| args.iter().position(|a| *a == flag).and_then(|i| args.get(i + 1)).copied();
    let (ps, host_flag, default_port) = match name {
        "ucmatose" | "cmtime" => (PortSpace::Tcp, "-s", 7471),
        "udaddy" => (PortSpace::Udp, "-s", 7174),
        "rping" => (PortSpace::Tcp, "-a", 7174),
        // perftest with -R: the server's address is the last argument,
        // its port -p (18515 by default). (Not UD: its server's listener
        // is not where this looks, and the wait ran out its limit; the
        // client's retries serve it.)
        n if n.starts_with("ib_") && args.contains(&"-R") => {
            let host = args.last()?.parse().ok()?;
            let port = value("-p").map_or(Some(18515), |p| p.parse().ok())?;
            if value("-c") == Some("UD") {
                return None;
            }
            let ps = PortSpace::Tcp;
            return Some((ps, std::net::SocketAddrV4::new(host, port)));
        }
        _ => return None,
    };
    let host = value(host_flag).unwrap_or("127.0.0.1").parse().ok()?;
    let port = value("-p").map_or(Some(default_port), |p| p.parse().ok())?;
    Some((ps, std::net::SocketAddrV4::new(host, port)))
}

/// Waits until the daemon at `socket` has a listener of our tenant for
/// `target` (rdma_cm listeners show in no socket table), as long as the
/// server runs and at most `limit`. Returns whether it came.
pub fn wait_listening(
    socket: &std::path::Path,
    target: (vrdma::cm::PortSpace, std::net::SocketAddrV4),
    server: &mut Running,
    limit: Duration,
) -> bool {
    let Ok(ctx) = vrdma::Context::open_at(socket) else { return false };
    let end = Instant::now() + limit;
    while Instant::now() < end && !server.exited() {
        if vrdma::cm::is_listening(&ctx, target.0, target.1).unwrap_or(false) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}
