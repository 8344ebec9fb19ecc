//! The device node UCX looks for: `/dev/infiniband/uverbs-vrdma0`.
//!
//! UCX (1.13, `uct_ib_device_is_accessible` in `src/uct/ib/base/ib_md.c`)
//! lists a verbs device only if `/dev/infiniband/` + the device's
//! `dev_name` is a character device the caller may read and write; the
//! device itself it then opens through `ibv_open_device`, never through
//! that file. vRDMA has no kernel device, so without such a node UCX (and
//! Open MPI's UCX layer on top of it) silently ignores the device.
//!
//! So the daemon at start, and `vrdma run` before it starts a program,
//! make sure the node exists ([`ensure`]): where it is missing and this
//! process may create it (root, or `CAP_MKNOD` and a writable `/dev`),
//! they create `/dev/infiniband/` and a character node with the numbers
//! of `/dev/null` (1, 3), mode 0666. That is a marker which grants
//! nothing: anyone may open `/dev/null` anyway, and vRDMA's libraries
//! never open the node (the device is the daemon behind its Unix socket).
//! Where it cannot, the caller says so once, with the command that fixes
//! it ([`fix_command`]).
//!
//! Why a name of our own (`uverbs-vrdma0`, the drop-in libibverbs'
//! `ibv_device.dev_name`) and not the kernel's `uverbsN`: on a machine
//! that also has an RDMA adapter, or gets one later, the kernel and udev
//! own `uverbs0`, and rdma-core's libibverbs opens it as the adapter; a
//! `/dev/null` node there would break the real device. Nothing in the
//! kernel or rdma-core uses our name, and rdma-core's libibverbs finds its
//! devices in sysfs (`/sys/class/infiniband_verbs`), so the node changes
//! nothing for programs that use real hardware.
//!
//! The node is never removed: it is one per machine (or per container:
//! `/dev` is shared by every network namespace, so every daemon of the
//! tests, and several daemons on one host, find the same node), it grants
//! nothing, and a daemon that removed it on exit would hide the device
//! from the programs of another daemon still running. Several processes
//! may race to create it; the loser's `EEXIST` is success.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// Where UCX (and the kernel's uverbs) put verbs device nodes.
pub const DEV_DIR: &str = "/dev/infiniband";

/// `/dev/null`'s device numbers, which the marker node carries.
const NULL_MAJOR: u32 = 1;
const NULL_MINOR: u32 = 3;

/// The `dev_name` of device `device` (as the drop-in libibverbs sets it
/// in `struct ibv_device`): `uverbs-vrdma0` for `vrdma0`.
pub fn node_name(device: &str) -> String {
    format!("uverbs-{device}")
}

/// The node's path under `dir` (normally [`DEV_DIR`]).
pub fn node_path_in(dir: &Path, device: &str) -> PathBuf {
    dir.join(node_name(device))
}

/// What [`ensure`] found or did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeState {
    /// A character device that this process may read and write was
    /// already there (ours, made earlier, or one made by hand).
    Present,
    /// This call created it.
    Created,
    /// It is missing (or unusable) and this process cannot make it; the
    /// reason. UCX will not list the device.
    Unavailable(String),
}

/// Makes sure `/dev/infiniband/uverbs-<device>` exists as UCX wants it;
/// see the module documentation.
pub fn ensure(device: &str) -> NodeState {
    ensure_in(Path::new(DEV_DIR), device)
}

/// [`ensure`] with another directory than [`DEV_DIR`] (for tests).
pub fn ensure_in(dir: &Path, device: &str) -> NodeState {
    let path = node_path_in(dir, device);
    if let Some(state) = check(&path) {
        return state;
    }
    // Missing: make it. The directory as udev makes it (0755).
    if let Err(e) = std::fs::create_dir_all(dir) {
        return NodeState::Unavailable(format!("cannot create {}: {e}", dir.display()));
    }
    match mknod_null(&path) {
        Ok(()) => NodeState::Created,
        // Another daemon or `vrdma run` made it meanwhile: judge theirs.
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
            check(&path).unwrap_or_else(|| NodeState::Unavailable(format!("{} vanished", path.display())))
        }
        Err(e) => NodeState::Unavailable(format!("cannot create {}: {e}", path.display())),
    }
}

/// `None` if `path` does not exist; else whether UCX would accept it.
/// Anything there that is not a usable character device is left alone
/// (it is someone else's) and reported.
fn check(path: &Path) -> Option<NodeState> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => return Some(NodeState::Unavailable(format!("cannot stat {}: {e}", path.display()))),
    };
    if !meta.file_type().is_char_device() {
        return Some(NodeState::Unavailable(format!(
            "{} exists but is not a character device",
            path.display()
        )));
    }
    if rustix::fs::access(path, rustix::fs::Access::READ_OK | rustix::fs::Access::WRITE_OK).is_err() {
        return Some(NodeState::Unavailable(format!(
            "{} (mode {:o}) is not readable and writable by this user",
            path.display(),
            meta.mode() & 0o7777
        )));
    }
    Some(NodeState::Present)
}

/// Creates `path` as a character device 1:3, mode 0666 whatever the umask.
fn mknod_null(path: &Path) -> std::io::Result<()> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    let dev = libc::makedev(NULL_MAJOR, NULL_MINOR);
    // SAFETY: mknod(2) with a NUL-terminated path that lives across the
    // call; it creates a file and touches no memory of ours.
    if unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, dev) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // mknod applies the umask; the node must be usable by every user.
    // SAFETY: chmod(2) with the same valid path.
    if unsafe { libc::chmod(c.as_ptr(), 0o666) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The command that makes the node by hand (as root), for messages and
/// the README.
pub fn fix_command(device: &str) -> String {
    let path = node_path_in(Path::new(DEV_DIR), device);
    format!("sudo sh -c 'mkdir -p {DEV_DIR} && mknod -m 666 {} c {NULL_MAJOR} {NULL_MINOR}'", path.display())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn is_root() -> bool {
        rustix::process::geteuid().is_root()
    }

    #[test]
    fn names_follow_the_drop_in_library() {
        assert_eq!(node_name("vrdma0"), "uverbs-vrdma0");
        assert!(fix_command("vrdma0").contains("mknod -m 666 /dev/infiniband/uverbs-vrdma0 c 1 3"));
    }

    #[test]
    fn creates_a_null_marker_once_and_then_finds_it() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("infiniband");
        if !is_root() {
            // Without CAP_MKNOD the answer is a reason, never a panic.
            assert!(matches!(ensure_in(&dir, "vrdma0"), NodeState::Unavailable(_)));
            return;
        }
        assert_eq!(ensure_in(&dir, "vrdma0"), NodeState::Created);
        let meta = std::fs::metadata(dir.join("uverbs-vrdma0")).unwrap();
        assert!(meta.file_type().is_char_device());
        assert_eq!(meta.rdev(), libc::makedev(1, 3));
        assert_eq!(meta.permissions().mode() & 0o7777, 0o666);
        assert_eq!(ensure_in(&dir, "vrdma0"), NodeState::Present);
    }

    #[test]
    fn leaves_a_file_that_is_not_a_device_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("uverbs-vrdma0");
        std::fs::write(&path, b"someone else's").unwrap();
        let state = ensure_in(tmp.path(), "vrdma0");
        assert!(
            matches!(&state, NodeState::Unavailable(w) if w.contains("not a character device")),
            "{state:?}"
        );
        assert_eq!(std::fs::read(&path).unwrap(), b"someone else's");
    }

    #[test]
    fn racing_creators_all_succeed() {
        if !is_root() {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("infiniband");
        let states: Vec<NodeState> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4).map(|_| s.spawn(|| ensure_in(&dir, "vrdma0"))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(states.iter().filter(|s| **s == NodeState::Created).count(), 1, "{states:?}");
        assert!(states.iter().all(|s| matches!(s, NodeState::Created | NodeState::Present)), "{states:?}");
    }
}
