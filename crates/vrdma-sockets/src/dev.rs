//! The process's vRDMA device: one context and PD for all its carried
//! connections, opened on first need. Without a daemon (or with
//! `VRDMA_SOCKETS=0`) there is none and every connection stays TCP.
//!
//! A child after `fork` shares its parent's connection to the daemon and
//! its rings' memory, which it must neither use nor destroy: it opens a
//! device of its own on first need (so a pre-forking server's workers carry
//! the connections they accept), and the parent's stays leaked in it.
//! The child's device is at its parent's daemon, whatever the child's
//! environment says by then: the listeners it inherited are registered
//! there, and servers clear their workers' environment (nginx keeps only
//! `TZ`), which would otherwise leave the workers looking for a daemon at
//! the default path and every connection they accept TCP.

use std::path::PathBuf;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::OnceLock;

use vrdma::{Context, ProtectionDomain};

pub struct Dev {
    pub ctx: Context,
    pub pd: ProtectionDomain,
    /// The completion channel of the connections' receive CQs, made on
    /// first need ([`crate::credit::channel`]).
    pub credit_chan: OnceLock<Option<vrdma::CompletionChannel>>,
}

/// A process's device, or its absence, never freed once published.
struct Slot {
    pid: u32,
    dev: Option<Dev>,
    /// The daemon's socket `dev` was opened at; none for a guest's device
    /// (a forked child finds the VM's port as its parent did) or none.
    socket: Option<PathBuf>,
}

static CURRENT: AtomicPtr<Slot> = AtomicPtr::new(std::ptr::null_mut());

/// Opens this process's device; `parent` is the slot of the process it
/// was forked from, if any.
fn open(pid: u32, parent: Option<&Slot>) -> Slot {
    let none = Slot { pid, dev: None, socket: None };
    let (ctx, socket) = match parent {
        // The parent's decision stands: the library was off there, or
        // found no device.
        Some(p) if p.dev.is_none() => return none,
        Some(Slot { socket: Some(path), .. }) => (Context::open_at(path), Some(path.clone())),
        _ => {
            if std::env::var_os("VRDMA_SOCKETS").is_some_and(|v| v == "0") {
                return none;
            }
            let path = vrdma::default_socket_path();
            let ctx = Context::open();
            let host = ctx.as_ref().is_ok_and(|c| !c.is_guest());
            (ctx, host.then_some(path))
        }
    };
    let Ok(ctx) = ctx.map_err(|e| debug(&format!("no vRDMA device, TCP only: {e}"))) else { return none };
    let Ok(pd) = ctx.alloc_pd().map_err(|e| debug(&format!("no PD, TCP only: {e}"))) else { return none };
    Slot { pid, dev: Some(Dev { ctx, pd, credit_chan: OnceLock::new() }), socket }
}

/// This process's device, or `None` (TCP only).
pub fn dev() -> Option<&'static Dev> {
    let pid = crate::pid::get();
    loop {
        let p = CURRENT.load(Ordering::Acquire);
        // SAFETY: a published slot is leaked, never freed: valid for ever.
        if let Some(s) = unsafe { p.as_ref() } {
            if s.pid == pid {
                return s.dev.as_ref();
            }
        }
        // None yet, or the parent's (this is a forked child): open one.
        // SAFETY: as above.
        let mine = Box::into_raw(Box::new(open(pid, unsafe { p.as_ref() })));
        match CURRENT.compare_exchange(p, mine, Ordering::AcqRel, Ordering::Acquire) {
            // SAFETY: `mine` is now published and never freed.
            Ok(_) => return unsafe { &*mine }.dev.as_ref(),
            // Another thread of this process was first: ours was never
            // published, so it is dropped here (its context closed).
            // SAFETY: `mine` came from Box::into_raw above and was not shared.
            Err(_) => drop(unsafe { Box::from_raw(mine) }),
        }
    }
}

/// Runs `f`, one daemon call that does not need this process's device
/// (its context, its QPs), for a process about to `exec`. Such a process
/// may have closed descriptors it does not know, the library's control
/// socket among them (Python's `subprocess` closes every one above 2 in
/// its child), or be a child made by `vfork`, which shares its parent's
/// memory and so its device (the cached process id is the parent's) but
/// not its descriptors. So `f` goes through this process's device where
/// it can, and else through a context opened for it at the same daemon
/// and closed after.
pub fn call_before_exec<T>(f: impl Fn(&Context) -> vrdma::Result<T>) -> Option<vrdma::Result<T>> {
    let vforked = crate::pid::get() != std::process::id();
    if !vforked {
        let r = f(&dev()?.ctx);
        if r.is_ok() {
            return Some(r);
        }
    }
    // SAFETY: a published slot is leaked, never freed: valid for ever.
    let slot = unsafe { CURRENT.load(Ordering::Acquire).as_ref() }?;
    let path = slot.socket.as_ref()?;
    let ctx = Context::open_at(path).map_err(|e| debug(&format!("no context before an exec: {e}"))).ok()?;
    debug(if vforked {
        "a context of its own before an exec (a vfork child)"
    } else {
        "a context of its own before an exec (the device's is gone)"
    });
    Some(f(&ctx))
}

/// Whether `VRDMA_SOCKETS_DEBUG` is set: [`debug`] prints.
pub fn debugging() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("VRDMA_SOCKETS_DEBUG").is_some())
}

/// One line on stderr whether or not `VRDMA_SOCKETS_DEBUG` is set, once
/// per process for each `said` (a process forked after it was said says
/// it again): a call is about to fail for a reason the program cannot
/// see, and the person running it needs that reason.
pub fn warn_once(said: &std::sync::atomic::AtomicU32, msg: &str) {
    let me = std::process::id();
    if said.swap(me, std::sync::atomic::Ordering::Relaxed) != me {
        line(&format!("vrdma-sockets[{me}]: {msg}\n"));
    }
}

/// One line on stderr when `VRDMA_SOCKETS_DEBUG` is set.
pub fn debug(msg: &str) {
    if debugging() {
        line(&format!("vrdma-sockets[{}]: {msg}\n", std::process::id()));
    }
}

/// Writes one whole line to stderr in one `write(2)`: the program (or a
/// child sharing the stderr) may write at the same time, and `eprintln!`
/// may split a formatted line into several writes that theirs interleave.
///
/// Through the library where a call of the program's makes it (its
/// descriptor 2 may be a carried connection, whose bytes go over the
/// ring: a raw write there would put them on the kernel socket, out of
/// the stream's order), so never while this thread holds a lock of a
/// connection (its write may need that lock, and would wait for it for
/// ever): such a line is held back and said once the last is let go
/// (`crate::connlock`). Marked [`saying`] while it writes: an error the
/// library keeps for the program's next call on the connection is not
/// the line's to take.
fn line(text: &str) {
    if DEPTH.with(|d| d.get()) > 0 {
        HELD.with(|h| {
            let mut v = take_held(h);
            v.push(text.to_owned());
            h.set(Box::into_raw(Box::new(v)));
        });
        return;
    }
    as_saying(|| crate::table::keep_errno(|| write_stderr(text.as_bytes())));
}

/// The lines held in `h`, which is left empty.
fn take_held(h: &std::cell::Cell<*mut Vec<String>>) -> Vec<String> {
    let p = h.replace(std::ptr::null_mut());
    if p.is_null() {
        return Vec::new();
    }
    // SAFETY: a non-null pointer in HELD came from `Box::into_raw` in
    // `line` and was taken out of the cell above, so it is owned here.
    *unsafe { Box::from_raw(p) }
}

/// This thread takes a lock of a connection (`crate::connlock`): its
/// lines are held back until [`let_go`] brings the count back to 0.
pub fn hold() {
    DEPTH.with(|d| d.set(d.get() + 1));
}

/// This thread let a lock of a connection go (after [`hold`]): at the
/// last, the lines held meanwhile are said, in order (a line said while
/// saying them, its write taking and letting a lock go, is said too).
pub fn let_go() {
    let last = DEPTH.with(|d| {
        let n = d.get().saturating_sub(1);
        d.set(n);
        n == 0
    });
    if !last {
        return;
    }
    loop {
        let held = HELD.with(take_held);
        if held.is_empty() {
            return;
        }
        for text in held {
            line(&text);
        }
    }
}

/// The lines this thread holds back now.
#[cfg(test)]
pub fn held_lines() -> usize {
    HELD.with(|h| {
        let v = take_held(h);
        let n = v.len();
        if n > 0 {
            h.set(Box::into_raw(Box::new(v)));
        }
        n
    })
}

/// Writes `bytes` whole to descriptor 2, as `send` with `MSG_NOSIGNAL`
/// where it is a socket: the library's own line must not raise
/// `SIGPIPE` (a program that does not ignore it dies of a diagnostic)
/// where descriptor 2 is a connection its peer has reset, which a line
/// made inside the library's own threads or calls meets raw. Gives up on
/// an error: a diagnostic that cannot be written is dropped. Allocates
/// nothing (a forked child may call it).
fn write_stderr(mut bytes: &[u8]) {
    let mut socket = true;
    // Bounded: each pass writes a byte at least, or changes `socket`, or
    // was interrupted (a few times at most in practice).
    for _ in 0..1024 {
        if bytes.is_empty() {
            return;
        }
        // SAFETY: `bytes` is valid for its length; descriptor 2 is the
        // process's, whatever it is (an error if closed).
        let n = unsafe {
            if socket {
                libc::send(2, bytes.as_ptr().cast(), bytes.len(), libc::MSG_NOSIGNAL)
            } else {
                libc::write(2, bytes.as_ptr().cast(), bytes.len())
            }
        };
        if n >= 0 {
            bytes = &bytes[(n as usize).min(bytes.len())..];
            continue;
        }
        match crate::table::errno() {
            libc::ENOTSOCK if socket => socket = false,
            libc::EINTR => {}
            _ => return,
        }
    }
}

/// Runs `f` (the write of a line) marked [`saying`], the mark as it was
/// after (a line said inside another's write leaves the outer marked).
fn as_saying(f: impl FnOnce()) {
    let before = SAYING.with(|s| s.replace(true));
    f();
    SAYING.with(|s| s.set(before));
}

// None of these has a destructor, so none is torn down before the
// process's exit handlers run (glibc runs the thread's destructors first)
// and a `vfork` child, which runs on its parent thread's, destroys none.
thread_local! {
    /// This thread writes one of the library's own lines ([`line`]).
    static SAYING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// The locks of connections this thread holds ([`hold`]).
    static DEPTH: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    /// Lines held back meanwhile, boxed (null: none); a thread that ends
    /// holding some (it cannot: every lock is let go first) leaks them.
    static HELD: std::cell::Cell<*mut Vec<String>> = const { std::cell::Cell::new(std::ptr::null_mut()) };
}

/// Whether this thread is writing one of the library's own lines: its
/// write must leave the program's kept errors alone (`link/outq.rs`).
pub fn saying() -> bool {
    SAYING.with(|s| s.get())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A line's write is marked (an error kept for the program is not
    /// its to take: `link/outq.rs`), and nothing else is.
    #[test]
    fn a_lines_write_and_only_it_is_marked_saying() {
        assert!(!saying());
        let mut during = false;
        as_saying(|| during = saying());
        assert!(during);
        assert!(!saying());
    }

    /// A line said inside another's write (nested) leaves the outer one
    /// marked for the rest of its write.
    #[test]
    fn a_nested_line_leaves_the_outer_marked() {
        let (mut inner, mut after) = (false, false);
        as_saying(|| {
            as_saying(|| inner = saying());
            after = saying();
        });
        assert!(inner && after);
        assert!(!saying());
    }

    /// A line written to a descriptor 2 that is a socket whose peer is
    /// gone raises no `SIGPIPE` (the process is not killed by the
    /// library's diagnostic); to one that is not a socket it is written
    /// whole. In a forked child, whose descriptor 2 is its own.
    #[test]
    fn a_line_to_a_reset_socket_on_stderr_raises_no_sigpipe_and_to_a_pipe_arrives_whole() {
        let mut sv = [0; 2];
        // SAFETY: socketpair(2) writes two descriptors into `sv`.
        assert_eq!(unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, sv.as_mut_ptr()) }, 0);
        let mut pipe = [0; 2];
        // SAFETY: pipe(2) writes two descriptors into `pipe`.
        assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
        // SAFETY: the peer's end, ours to close.
        unsafe { libc::close(sv[1]) };
        // SAFETY: fork(2); the child makes only system calls and exits
        // with `_exit`, allocating nothing.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            // SAFETY: the child's own descriptors; `_exit` ends it.
            unsafe {
                // (Rust's runtime ignores SIGPIPE; a C program does not.)
                libc::signal(libc::SIGPIPE, libc::SIG_DFL);
                libc::dup2(sv[0], 2);
                write_stderr(b"vrdma-sockets unit test: to a socket whose peer is gone\n");
                libc::dup2(pipe[1], 2);
                write_stderr(b"whole line\n");
                libc::_exit(0);
            }
        }
        // SAFETY: our copies of the child's ends.
        unsafe {
            libc::close(sv[0]);
            libc::close(pipe[1]);
        }
        let mut status = 0;
        // SAFETY: waitpid(2) on our child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the child ended with status {status:#x} (signal {})",
            if libc::WIFSIGNALED(status) { libc::WTERMSIG(status) } else { 0 }
        );
        let mut got = [0u8; 64];
        // SAFETY: read(2) into our buffer.
        let n = unsafe { libc::read(pipe[0], got.as_mut_ptr().cast(), got.len()) };
        // SAFETY: our end.
        unsafe { libc::close(pipe[0]) };
        assert_eq!(&got[..n.max(0) as usize], b"whole line\n");
    }
}
