//! libc's own functions, found with `dlsym(RTLD_NEXT)`: the ones this
//! library's exports stand in front of.
//!
//! Each is looked up once, on first use, and cached; a lookup that fails
//! (a libc without the function) aborts, since nothing sensible can be
//! returned in its place.

use std::sync::atomic::{AtomicUsize, Ordering};

use libc::{c_char, c_int, c_void, iovec, msghdr, off_t, size_t, sockaddr, socklen_t, ssize_t};

pub fn lookup(slot: &AtomicUsize, name: &'static [u8]) -> usize {
    let p = slot.load(Ordering::Acquire);
    if p != 0 {
        return p;
    }
    // SAFETY: `name` is a NUL-terminated C string literal; dlsym with
    // RTLD_NEXT looks the symbol up in the objects loaded after this one.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr().cast()) } as usize;
    if p == 0 {
        const MSG: &[u8] = b"libvrdma_sockets: a libc function is missing\n";
        // SAFETY: write(2) of a static buffer to stderr, then abort.
        unsafe {
            libc::syscall(libc::SYS_write, 2, MSG.as_ptr(), MSG.len());
            libc::abort();
        }
    }
    slot.store(p, Ordering::Release);
    p
}

macro_rules! real {
    ($($name:ident($($arg:ident: $ty:ty),*) -> $ret:ty;)*) => {
        $(
            #[allow(clippy::missing_safety_doc)]
            pub unsafe fn $name($($arg: $ty),*) -> $ret {
                static SLOT: AtomicUsize = AtomicUsize::new(0);
                let p = lookup(&SLOT, concat!(stringify!($name), "\0").as_bytes());
                // SAFETY: `p` is libc's function of this name, whose C
                // prototype is the one declared here.
                let f: unsafe extern "C" fn($($ty),*) -> $ret = unsafe { std::mem::transmute(p) };
                // SAFETY: the caller keeps the function's own contract.
                unsafe { f($($arg),*) }
            }
        )*
    };
}

real! {
    listen(fd: c_int, backlog: c_int) -> c_int;
    connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int;
    accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int;
    accept4(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int;
    read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t;
    write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t;
    recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t;
    send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t;
    recvfrom(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> ssize_t;
    sendto(fd: c_int, buf: *const c_void, n: size_t, flags: c_int, addr: *const sockaddr, len: socklen_t) -> ssize_t;
    readv(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t;
    writev(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t;
    recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t;
    sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t;
    sendfile(out: c_int, inp: c_int, off: *mut off_t, n: size_t) -> ssize_t;
    sendfile64(out: c_int, inp: c_int, off: *mut off_t, n: size_t) -> ssize_t;
    close(fd: c_int) -> c_int;
    setsockopt(fd: c_int, level: c_int, name: c_int, val: *const c_void, len: socklen_t) -> c_int;
    getsockopt(fd: c_int, level: c_int, name: c_int, val: *mut c_void, len: *mut socklen_t) -> c_int;
    shutdown(fd: c_int, how: c_int) -> c_int;
    dup(fd: c_int) -> c_int;
    dup2(fd: c_int, to: c_int) -> c_int;
    dup3(fd: c_int, to: c_int, flags: c_int) -> c_int;
    fcntl(fd: c_int, cmd: c_int, arg: libc::c_ulong) -> c_int;
    fcntl64(fd: c_int, cmd: c_int, arg: libc::c_ulong) -> c_int;
    ioctl(fd: c_int, request: libc::c_ulong, arg: *mut c_void) -> c_int;
    splice(fd_in: c_int, off_in: *mut libc::loff_t, fd_out: c_int, off_out: *mut libc::loff_t, len: size_t, flags: libc::c_uint) -> ssize_t;
    sendmmsg(fd: c_int, msgs: *mut libc::mmsghdr, n: libc::c_uint, flags: c_int) -> c_int;
    recvmmsg(fd: c_int, msgs: *mut libc::mmsghdr, n: libc::c_uint, flags: c_int, timeout: *mut libc::timespec) -> c_int;
    poll(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int) -> c_int;
    ppoll(fds: *mut libc::pollfd, n: libc::nfds_t, ts: *const libc::timespec, mask: *const libc::sigset_t) -> c_int;
    select(n: c_int, r: *mut libc::fd_set, w: *mut libc::fd_set, e: *mut libc::fd_set, tv: *mut libc::timeval) -> c_int;
    pselect(n: c_int, r: *mut libc::fd_set, w: *mut libc::fd_set, e: *mut libc::fd_set, ts: *const libc::timespec, mask: *const libc::sigset_t) -> c_int;
    epoll_wait(ep: c_int, ev: *mut libc::epoll_event, max: c_int, timeout: c_int) -> c_int;
    epoll_pwait(ep: c_int, ev: *mut libc::epoll_event, max: c_int, timeout: c_int, mask: *const libc::sigset_t) -> c_int;
    epoll_pwait2(ep: c_int, ev: *mut libc::epoll_event, max: c_int, ts: *const libc::timespec, mask: *const libc::sigset_t) -> c_int;
    epoll_ctl(ep: c_int, op: c_int, fd: c_int, ev: *mut libc::epoll_event) -> c_int;
    execve(path: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int;
    execv(path: *const c_char, argv: *const *const c_char) -> c_int;
    execvp(file: *const c_char, argv: *const *const c_char) -> c_int;
    execvpe(file: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int;
    fexecve(fd: c_int, argv: *const *const c_char, envp: *const *const c_char) -> c_int;
    execveat(dirfd: c_int, path: *const c_char, argv: *const *const c_char, envp: *const *const c_char, flags: c_int) -> c_int;
    posix_spawn(pid: *mut libc::pid_t, path: *const c_char, fa: *const c_void, attr: *const c_void, argv: *const *mut c_char, envp: *const *mut c_char) -> c_int;
    posix_spawnp(pid: *mut libc::pid_t, file: *const c_char, fa: *const c_void, attr: *const c_void, argv: *const *mut c_char, envp: *const *mut c_char) -> c_int;
    posix_spawn_file_actions_adddup2(fa: *mut c_void, fd: c_int, to: c_int) -> c_int;
    posix_spawn_file_actions_addclose(fa: *mut c_void, fd: c_int) -> c_int;
    system(cmd: *const c_char) -> c_int;
    popen(cmd: *const c_char, mode: *const c_char) -> *mut c_void;
}

/// libc's `_exit`, `_Exit` and `exit`, looked up at load (below): a
/// signal handler's or a child's `_exit` must not run `dlsym` (the
/// loader's lock, not async-signal-safe).
static EXIT_SLOTS: [AtomicUsize; 3] = [AtomicUsize::new(0), AtomicUsize::new(0), AtomicUsize::new(0)];
const EXIT_NAMES: [&[u8]; 3] = [b"_exit\0", b"_Exit\0", b"exit\0"];

extern "C" fn resolve_exits() {
    for (slot, name) in EXIT_SLOTS.iter().zip(EXIT_NAMES) {
        lookup(slot, name);
    }
}

#[used]
#[link_section = ".init_array"]
static RESOLVE_EXITS: extern "C" fn() = resolve_exits;

/// Calls libc's exit function `i` of [`EXIT_NAMES`].
unsafe fn exit_by(i: usize, code: c_int) {
    let p = lookup(&EXIT_SLOTS[i], EXIT_NAMES[i]);
    // SAFETY: `p` is libc's function of that name, `void f(int)`.
    let f: unsafe extern "C" fn(c_int) = unsafe { std::mem::transmute(p) };
    // SAFETY: the caller keeps the function's own contract.
    unsafe { f(code) }
}

/// libc's `_exit`.
#[allow(clippy::missing_safety_doc)]
pub unsafe fn _exit(code: c_int) {
    // SAFETY: as libc's `_exit`.
    unsafe { exit_by(0, code) }
}

/// libc's `_Exit` (its C name is not snake case).
#[allow(non_snake_case, clippy::missing_safety_doc)]
pub unsafe fn _Exit(code: c_int) {
    // SAFETY: as libc's `_Exit`.
    unsafe { exit_by(1, code) }
}

/// libc's `exit`.
#[allow(clippy::missing_safety_doc)]
pub unsafe fn exit(code: c_int) {
    // SAFETY: as libc's `exit`.
    unsafe { exit_by(2, code) }
}
