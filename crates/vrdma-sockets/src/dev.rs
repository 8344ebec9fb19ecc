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
fn line(text: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(text.as_bytes());
}
