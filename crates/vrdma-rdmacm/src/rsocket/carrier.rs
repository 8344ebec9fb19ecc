//! The sockets carrier (`libvrdma_sockets.so`), loaded privately: the
//! machinery the rsocket functions run on.
//!
//! The carrier is an `LD_PRELOAD` library whose exports are libc's names
//! (`read`, `connect`, `poll`, ...). Linking it into this library would
//! interpose them on every program that loads `librdmacm.so.1` (`rping`
//! too), and a cargo feature cannot leave them out only here: cargo builds
//! one copy of a crate per build, with the union of the features every
//! dependent asks for, so a workspace build would give the preload library
//! and this one the same choice. So this library `dlopen`s the carrier's
//! own shared object with `RTLD_LOCAL` (its names then resolve nobody
//! else's calls) and calls its functions by address: `rread` is the
//! carrier's `read` on the descriptor, exactly what an application under
//! `vrdma run --sockets` gets from `read`. Where the carrier is already
//! preloaded, `dlopen` returns that same object, so the two share one
//! table of connections.
//!
//! `RTLD_DEEPBIND` makes the carrier's own calls of libc (its `socket`
//! for a routing probe, the daemon connection's) resolve as they do when
//! it is preloaded: to itself (which passes its own calls through) and
//! then libc, never to another preloaded library. Without it, under
//! `librspreload.so` the carrier's probe socket was one of
//! librspreload's placeholder descriptors (`/dev/null`), its `connect`
//! failed with `ENOTSOCK`, and every connection stayed TCP.
//!
//! Which file: `VRDMA_SOCKETS_LIB` if set (as `vrdma run --sockets`
//! takes it), else `libvrdma_sockets.so` beside this library's own file
//! (links followed: `vrdma run` and the tests link `librdmacm.so.1` to
//! the build's `libvrdma_rdmacm.so`, whose directory holds the carrier).
//! Without a carrier the functions are libc's own (found after this
//! library, so not a preloaded `librspreload.so`'s): rsockets are then
//! plain kernel sockets, said once on stderr.

use std::ffi::{CStr, CString, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use libc::{c_int, c_void};

const NAME: &str = "libvrdma_sockets.so";
const ENV: &str = "VRDMA_SOCKETS_LIB";

/// The carrier's handle, or 0 where there is none.
fn handle() -> usize {
    static HANDLE: OnceLock<usize> = OnceLock::new();
    *HANDLE.get_or_init(|| match load() {
        Ok(h) => h,
        Err(why) => {
            eprintln!("vrdma librdmacm: rsockets are plain kernel sockets (not carried by vRDMA): {why}");
            0
        }
    })
}

/// Whether rsockets are carried (the carrier loaded).
pub fn loaded() -> bool {
    handle() != 0
}

fn path() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os(ENV).filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    static ANCHOR: u8 = 0;
    // SAFETY: Dl_info is plain pointers, for which zero is null.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr of an address in this library's data; `info` is ours.
    let ok = unsafe { libc::dladdr(std::ptr::addr_of!(ANCHOR).cast(), &mut info) };
    if ok == 0 || info.dli_fname.is_null() {
        return Err("cannot tell where librdmacm.so.1 lies (dladdr)".into());
    }
    // SAFETY: dladdr's file name is a C string owned by the loader.
    let me = OsStr::from_bytes(unsafe { CStr::from_ptr(info.dli_fname) }.to_bytes());
    let me = std::fs::canonicalize(me).map_err(|e| format!("{}: {e}", me.to_string_lossy()))?;
    let dir = me.parent().ok_or("librdmacm.so.1 has no directory")?;
    Ok(dir.join(NAME))
}

fn load() -> Result<usize, String> {
    let p = path()?;
    if !p.is_file() {
        return Err(format!(
            "{} is missing (build it: cargo build -p vrdma-sockets; or name it with {ENV})",
            p.display()
        ));
    }
    let c =
        CString::new(p.as_os_str().as_bytes()).map_err(|_| format!("{}: a NUL in the path", p.display()))?;
    // SAFETY: dlopen of the carrier by path; RTLD_LOCAL keeps its exports
    // from resolving any other object's calls, RTLD_DEEPBIND resolves its
    // own before the global scope's (see the module documentation).
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL | libc::RTLD_DEEPBIND) };
    if h.is_null() {
        // SAFETY: dlerror returns NULL or a C string valid until the next
        // dl call on this thread.
        let why = unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                "unknown".into()
            } else {
                CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        return Err(format!("cannot load {}: {why}", p.display()));
    }
    Ok(h as usize)
}

/// The function `name` (NUL-terminated) of the carrier, or libc's; 0 if
/// neither has it.
fn lookup(slot: &AtomicUsize, name: &'static [u8]) -> usize {
    let p = slot.load(Ordering::Acquire);
    if p != 0 {
        return p;
    }
    let h = handle();
    let from = if h == 0 { libc::RTLD_NEXT } else { h as *mut c_void };
    // SAFETY: `name` is a C string literal; `from` a handle from dlopen or
    // RTLD_NEXT.
    let p = unsafe { libc::dlsym(from, name.as_ptr().cast()) } as usize;
    slot.store(p, Ordering::Release);
    p
}

macro_rules! carried {
    ($($name:ident($($arg:ident: $ty:ty),*) -> $ret:ty;)*) => {
        $(
            /// The carrier's (or libc's) function of this name; -1 with
            /// `ENOSYS` if neither has it.
            pub unsafe fn $name($($arg: $ty),*) -> $ret {
                static SLOT: AtomicUsize = AtomicUsize::new(0);
                let p = lookup(&SLOT, concat!(stringify!($name), "\0").as_bytes());
                if p == 0 {
                    super::set_errno(libc::ENOSYS);
                    return -1 as $ret;
                }
                // SAFETY: `p` is the function of this name, in the carrier
                // (whose exports keep libc's prototypes) or in libc; its C
                // prototype is the one declared here.
                let f: unsafe extern "C" fn($($ty),*) -> $ret = unsafe { std::mem::transmute(p) };
                // SAFETY: the caller keeps the function's own contract.
                unsafe { f($($arg),*) }
            }
        )*
    };
}

use libc::{iovec, msghdr, nfds_t, pollfd, size_t, sockaddr, socklen_t, ssize_t};

carried! {
    socket(domain: c_int, ty: c_int, protocol: c_int) -> c_int;
    bind(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int;
    listen(fd: c_int, backlog: c_int) -> c_int;
    accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int;
    connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int;
    shutdown(fd: c_int, how: c_int) -> c_int;
    close(fd: c_int) -> c_int;
    recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t;
    recvfrom(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int, from: *mut sockaddr, len: *mut socklen_t) -> ssize_t;
    recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t;
    send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t;
    sendto(fd: c_int, buf: *const c_void, n: size_t, flags: c_int, to: *const sockaddr, len: socklen_t) -> ssize_t;
    sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t;
    read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t;
    readv(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t;
    write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t;
    writev(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t;
    poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int;
    select(n: c_int, r: *mut libc::fd_set, w: *mut libc::fd_set, e: *mut libc::fd_set, tv: *mut libc::timeval) -> c_int;
    getpeername(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int;
    getsockname(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int;
    setsockopt(fd: c_int, level: c_int, name: c_int, val: *const c_void, len: socklen_t) -> c_int;
    getsockopt(fd: c_int, level: c_int, name: c_int, val: *mut c_void, len: *mut socklen_t) -> c_int;
    fcntl(fd: c_int, cmd: c_int, arg: libc::c_ulong) -> c_int;
    vrdma_sockets_riomap(fd: c_int, buf: *mut c_void, len: size_t, prot: c_int, flags: c_int, offset: libc::off_t) -> libc::off_t;
    vrdma_sockets_riounmap(fd: c_int, buf: *mut c_void, len: size_t) -> c_int;
    vrdma_sockets_riowrite(fd: c_int, buf: *const c_void, n: size_t, offset: libc::off_t, flags: c_int) -> ssize_t;
}
