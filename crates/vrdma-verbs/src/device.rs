//! Device discovery: one device, `vrdma0`, when a daemon answers.
//!
//! rdma-core finds devices in sysfs; vRDMA's device is the daemon behind
//! a Unix socket ([`vrdma::default_socket_path`], i.e. `VRDMA_SOCKET`).
//! `ibv_get_device_list` connects to it (one `Hello` and one
//! `QueryDevice` round trip) and reports one device if it answers, and
//! an empty list (not NULL) if nobody does, as rdma-core does on a host
//! without RDMA hardware.
//!
//! The context that answered is kept as the device's spare ([`Spare`]):
//! the `ibv_open_device` that nearly always follows takes it instead of
//! connecting again, so that a list then an open (librdmacm's first
//! address resolution, every verbs tool's start) costs one context
//! opened, not one opened and closed and another opened. A spare is
//! taken once, only by the process that made it (not a child after
//! `fork`, which shares its connection), only while its daemon is there,
//! and is closed when a device list is freed or a newer list replaces
//! it. So a process that holds a list it has not opened holds one more
//! context of the daemon's (counted in its tenant's `max_contexts`) until
//! it frees the list.
//!
//! The `struct ibv_device` is allocated once and never freed: programs
//! keep device pointers after `ibv_free_device_list` (they are needed by
//! open contexts), exactly as rdma-core keeps its devices alive. Its
//! sysfs paths name places that do not exist; tools that read files there
//! (`ibv_devinfo`'s `board_id`, perftest's `numa_node`) tolerate that.
//! Its `dev_name` (`uverbs-vrdma0`) names the node under `/dev/infiniband`
//! that UCX requires before it lists a device; the daemon and `vrdma run`
//! create it (`vrdmad::devnode`, which explains the name) and the two must
//! agree.

use std::ffi::{c_char, c_int, CStr};
use std::path::PathBuf;
use std::ptr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::abi::*;
use crate::util::*;

/// The one device: its C structure and what opening it needs.
#[repr(C)]
pub struct Device {
    /// First, so that a `*mut ibv_device` is a `*mut Device`.
    pub dev: ibv_device,
    /// Where the daemon answered the last time the list was taken.
    pub socket: Mutex<PathBuf>,
    /// The node GUID the daemon reported, host order.
    pub node_guid: AtomicU64,
    /// The context the last list was taken with, until opened (see the
    /// module's notes).
    spare: Mutex<Option<Spare>>,
}

/// A context `ibv_get_device_list` opened, for the next `ibv_open_device`.
pub struct Spare {
    pub ctx: vrdma::Context,
    /// Its `query_device`, which the list asked for anyway.
    pub attr: vrdma::DeviceAttr,
    /// The process that opened it.
    pid: u32,
}

impl Device {
    /// The spare context, if this process made one and its daemon is
    /// still there; it is taken (the next open connects anew).
    pub fn take_spare(&self) -> Option<Spare> {
        let s = self.spare.lock().unwrap_or_else(|e| e.into_inner()).take()?;
        if s.pid != std::process::id() {
            // A child after fork: the connection is its parent's.
            std::mem::forget(s);
            return None;
        }
        (!s.ctx.daemon_gone()).then_some(s)
    }

    /// Closes the spare context, if any (its list was freed). A child
    /// after `fork` only forgets it: the connection is its parent's.
    pub fn drop_spare(&self) {
        let s = self.spare.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(s) = s.filter(|s| s.pid != std::process::id()) {
            std::mem::forget(s);
        }
    }
}

// The application's pointer is the object's address.
const _: () = assert!(std::mem::offset_of!(Device, dev) == 0);

static DEVICE: AtomicUsize = AtomicUsize::new(0);
static INIT: Mutex<()> = Mutex::new(());

/// The device, created on first use with `name` (the daemon's).
fn device(name: &str) -> *mut Device {
    let p = DEVICE.load(Ordering::Acquire);
    if p != 0 {
        return p as *mut Device;
    }
    let _once = INIT.lock().unwrap_or_else(|e| e.into_inner());
    let p = DEVICE.load(Ordering::Acquire);
    if p != 0 {
        return p as *mut Device;
    }
    let mut dev = ibv_device {
        _ops: _ibv_device_ops { _dummy1: None, _dummy2: None },
        node_type: IBV_NODE_CA,
        transport_type: IBV_TRANSPORT_IB,
        name: [0; IBV_SYSFS_NAME_MAX],
        dev_name: [0; IBV_SYSFS_NAME_MAX],
        dev_path: [0; IBV_SYSFS_PATH_MAX],
        ibdev_path: [0; IBV_SYSFS_PATH_MAX],
    };
    copy_cstr(&mut dev.name, name);
    copy_cstr(&mut dev.dev_name, &format!("uverbs-{name}"));
    copy_cstr(&mut dev.dev_path, &format!("/sys/class/infiniband_verbs/uverbs-{name}"));
    copy_cstr(&mut dev.ibdev_path, &format!("/sys/class/infiniband/{name}"));
    let d = Box::new(Device {
        dev,
        socket: Mutex::new(PathBuf::new()),
        node_guid: AtomicU64::new(0),
        spare: Mutex::new(None),
    });
    let p = Box::into_raw(d);
    DEVICE.store(p as usize, Ordering::Release);
    p
}

/// Our device behind `p`, or `EINVAL` for any other pointer (compared,
/// never dereferenced, so a stray pointer is refused safely).
pub fn ours(what: &str, p: *mut ibv_device) -> Res<&'static Device> {
    let d = DEVICE.load(Ordering::Acquire);
    if p.is_null() || d == 0 || p as usize != d {
        return Err(refuse(what, "not a device of this library", libc::EINVAL));
    }
    // SAFETY: `d` was leaked by `device` and is never freed.
    Ok(unsafe { &*(d as *const Device) })
}

/// Asks the daemon at the default socket who it is (or, in a guest, the
/// daemon behind the VM's port: see `vrdma::guest`).
fn probe() -> Option<*mut Device> {
    let ctx = match vrdma::Context::open() {
        Ok(c) => c,
        Err(e) => {
            fail("ibv_get_device_list: no vRDMA daemon", &e);
            return None;
        }
    };
    let attr = match ctx.query_device() {
        Ok(a) => a,
        Err(e) => {
            fail("ibv_get_device_list: query_device", &e);
            return None;
        }
    };
    let d = device(ctx.device_name());
    // SAFETY: leaked by `device`, never freed; only these two fields change.
    let dev = unsafe { &*d };
    // An empty path: open the device as `probe` did (a guest's port).
    let path = if ctx.is_guest() { PathBuf::new() } else { vrdma::default_socket_path() };
    *dev.socket.lock().unwrap_or_else(|e| e.into_inner()) = path;
    dev.node_guid.store(attr.node_guid, Ordering::Relaxed);
    let old = dev.spare.lock().unwrap_or_else(|e| e.into_inner()).replace(Spare {
        ctx,
        attr,
        pid: std::process::id(),
    });
    // A child after fork forgets its parent's spare rather than closing
    // the parent's connection's objects through it.
    if let Some(o) = old.filter(|o| o.pid != std::process::id()) {
        std::mem::forget(o);
    }
    Some(d)
}

/// `ibv_get_device_list`: a NULL-terminated array (free it with
/// `ibv_free_device_list`), empty when no daemon answers.
pub unsafe extern "C" fn ibv_get_device_list(num_devices: *mut c_int) -> *mut *mut ibv_device {
    ret_ptr("ibv_get_device_list", || {
        let found = probe();
        let n = usize::from(found.is_some());
        // SAFETY: calloc of n + 1 pointers (zeroed: the NULL terminator);
        // freed by ibv_free_device_list with free().
        let list = unsafe { libc::calloc(n + 1, size_of::<*mut ibv_device>()) }.cast::<*mut ibv_device>();
        if list.is_null() {
            return Err(libc::ENOMEM);
        }
        if let Some(d) = found {
            // SAFETY: `list` holds n + 1 >= 2 slots here.
            unsafe { *list = d.cast::<ibv_device>() };
        }
        if !num_devices.is_null() {
            // SAFETY: the caller passes a valid int pointer or NULL.
            unsafe { *num_devices = n as c_int };
        }
        Ok(list)
    })
}

/// `ibv_free_device_list`: frees the array; the devices stay valid. The
/// spare context of a list that holds our device goes with it.
pub unsafe extern "C" fn ibv_free_device_list(list: *mut *mut ibv_device) {
    guard("ibv_free_device_list", (), || {
        // SAFETY: `list` came from ibv_get_device_list (or is NULL): NULL
        // or a NULL-terminated array, whose first slot is read.
        let first = if list.is_null() { ptr::null_mut() } else { unsafe { *list } };
        let d = DEVICE.load(Ordering::Acquire);
        if d != 0 && first as usize == d {
            // SAFETY: `d` was leaked by `device` and is never freed.
            unsafe { &*(d as *const Device) }.drop_spare();
        }
        // SAFETY: `list` came from ibv_get_device_list's calloc (or is NULL).
        unsafe { libc::free(list.cast()) }
    })
}

/// `ibv_get_device_name`: the device's name, or NULL (`EINVAL`) for a
/// pointer that is not one of ours.
pub unsafe extern "C" fn ibv_get_device_name(device: *mut ibv_device) -> *const c_char {
    ret_ptr("ibv_get_device_name", || Ok(ours("ibv_get_device_name", device)?.dev.name.as_ptr().cast_mut()))
}

/// `ibv_get_device_guid`: the node GUID in network byte order, as the
/// daemon reported it when the device list was taken (0 with `errno =
/// EINVAL` for a foreign pointer).
pub unsafe extern "C" fn ibv_get_device_guid(device: *mut ibv_device) -> u64 {
    guard("ibv_get_device_guid", 0, || match ours("ibv_get_device_guid", device) {
        Ok(d) => d.node_guid.load(Ordering::Relaxed).to_be(),
        Err(e) => {
            set_errno(e);
            0
        }
    })
}

/// `ibv_get_device_index`: the kernel's index of the device. vRDMA's
/// device is not a kernel device, so there is none: -1, as rdma-core
/// returns for a device without one (`errno = EOPNOTSUPP`).
pub unsafe extern "C" fn ibv_get_device_index(device: *mut ibv_device) -> c_int {
    guard("ibv_get_device_index", -1, || {
        set_errno(match ours("ibv_get_device_index", device) {
            Ok(_) => libc::EOPNOTSUPP,
            Err(e) => e,
        });
        -1
    })
}

/// `ibv_get_sysfs_path`: where sysfs is mounted (`$SYSFS_PATH` without
/// trailing slashes when the caller is not set-uid, else `/sys`), as
/// rdma-core computes it. vRDMA's device has no sysfs presence; other
/// rdma-core libraries use the path for kernel devices.
pub unsafe extern "C" fn ibv_get_sysfs_path() -> *const c_char {
    static PATH: std::sync::OnceLock<std::ffi::CString> = std::sync::OnceLock::new();
    guard("ibv_get_sysfs_path", c"/sys".as_ptr(), || {
        PATH.get_or_init(|| {
            // SAFETY: getuid/geteuid cannot fail.
            let same = unsafe { libc::getuid() == libc::geteuid() };
            let env = if same { std::env::var("SYSFS_PATH").ok() } else { None };
            let p = env.map(|s| s.trim_end_matches('/').to_string()).unwrap_or_else(|| "/sys".into());
            std::ffi::CString::new(p).unwrap_or_else(|_| c"/sys".into())
        })
        .as_ptr()
    })
}

/// `ibv_read_sysfs_file`: reads `dir/file` into `buf` as rdma-core does
/// (a trailing newline becomes the terminator; -1 if the contents would
/// not fit with one). The paths of vRDMA's device do not exist, so reads
/// there fail with `ENOENT`, which the tools tolerate; other paths (a
/// kernel device's) are read for real.
pub unsafe extern "C" fn ibv_read_sysfs_file(
    dir: *const c_char,
    file: *const c_char,
    buf: *mut c_char,
    size: usize,
) -> c_int {
    guard("ibv_read_sysfs_file", -1, || {
        if dir.is_null() || file.is_null() || (buf.is_null() && size > 0) {
            set_errno(libc::EINVAL);
            return -1;
        }
        // SAFETY: non-NULL C strings from the caller.
        let (d, f) = unsafe { (CStr::from_ptr(dir), CStr::from_ptr(file)) };
        let mut path = d.to_bytes().to_vec();
        path.push(b'/');
        path.extend_from_slice(f.to_bytes());
        let Ok(path) = std::ffi::CString::new(path) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        // SAFETY: a valid C path; the fd is closed below.
        let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        if fd < 0 {
            return -1;
        }
        // SAFETY: `buf` holds `size` bytes (the caller's contract).
        let len = unsafe { libc::read(fd, buf.cast(), size) };
        // SAFETY: closing the fd opened above.
        unsafe { libc::close(fd) };
        if len > 0 {
            let len = len as usize;
            // SAFETY: indices below `size`, inside the caller's buffer.
            unsafe {
                if *buf.add(len - 1) == b'\n' as c_char {
                    *buf.add(len - 1) = 0;
                    return (len - 1) as c_int;
                } else if len < size {
                    *buf.add(len) = 0;
                } else {
                    return -1;
                }
            }
        }
        len as c_int
    })
}

/// The device's pointer for a context opened on it.
pub fn device_ptr(d: &'static Device) -> *mut ibv_device {
    ptr::from_ref(&d.dev).cast_mut()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::{ibv_close_device, ibv_open_device, Ctx};

    /// The context of `ibv_open_device` after `ibv_get_device_list` is
    /// the one the list was taken with: the daemon numbers contexts in
    /// the order it accepts them, so the open's is the next one after a
    /// context opened just before the list. A second open, the spare
    /// taken, and one after the list was freed connect anew.
    #[test]
    fn the_open_after_a_list_takes_the_lists_context() {
        let dir = tempfile::tempdir().expect("temp dir");
        let socket = dir.path().join("vrdma.sock");
        let _daemon = vrdmad::Daemon::start(vrdmad::DaemonConfig {
            socket: Some(socket.clone()),
            ..Default::default()
        })
        .expect("daemon");
        // The only test of this crate that reaches a daemon.
        std::env::set_var(vrdma::SOCKET_ENV, &socket);
        let before = vrdma::Context::open_at(&socket).expect("context").context_id();
        let mut n: c_int = 0;
        // SAFETY: the verbs as a C program calls them; every list is
        // freed once and every context closed once.
        unsafe {
            let list = ibv_get_device_list(&mut n);
            assert_eq!(n, 1);
            let c = ibv_open_device(*list);
            assert!(!c.is_null());
            assert_eq!(Ctx::from_ptr(c).inner.context_id(), before + 1, "the list's context, not a new one");
            let c2 = ibv_open_device(*list);
            assert!(!c2.is_null());
            assert_eq!(Ctx::from_ptr(c2).inner.context_id(), before + 2, "the spare is taken once");
            ibv_free_device_list(list);

            let list = ibv_get_device_list(&mut n);
            let dev = *list;
            ibv_free_device_list(list);
            let c3 = ibv_open_device(dev);
            assert!(!c3.is_null());
            assert_eq!(
                Ctx::from_ptr(c3).inner.context_id(),
                before + 4,
                "the freed list's context was closed; the open made a new one"
            );
            for c in [c, c2, c3] {
                assert_eq!(ibv_close_device(c), 0);
            }
        }
    }
}
