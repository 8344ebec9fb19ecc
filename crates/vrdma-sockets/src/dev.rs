//! The process's vRDMA device: one context and PD for all its carried
//! connections, opened on first need. Without a daemon (or with
//! `VRDMA_SOCKETS=0`) there is none and every connection stays TCP.
//!
//! A child after `fork` shares its parent's connection to the daemon and
//! its rings' memory, which it must neither use nor destroy: it opens a
//! device of its own on first need (so a pre-forking server's workers carry
//! the connections they accept), and the parent's stays leaked in it.

use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::OnceLock;

use vrdma::{Context, ProtectionDomain};

pub struct Dev {
    pub ctx: Context,
    pub pd: ProtectionDomain,
}

/// A process's device, or its absence, never freed once published.
struct Slot {
    pid: u32,
    dev: Option<Dev>,
}

static CURRENT: AtomicPtr<Slot> = AtomicPtr::new(std::ptr::null_mut());

fn open() -> Option<Dev> {
    if std::env::var_os("VRDMA_SOCKETS").is_some_and(|v| v == "0") {
        return None;
    }
    let ctx = Context::open().map_err(|e| debug(&format!("no vRDMA device, TCP only: {e}"))).ok()?;
    let pd = ctx.alloc_pd().map_err(|e| debug(&format!("no PD, TCP only: {e}"))).ok()?;
    Some(Dev { ctx, pd })
}

/// This process's device, or `None` (TCP only).
pub fn dev() -> Option<&'static Dev> {
    let pid = std::process::id();
    loop {
        let p = CURRENT.load(Ordering::Acquire);
        // SAFETY: a published slot is leaked, never freed: valid for ever.
        if let Some(s) = unsafe { p.as_ref() } {
            if s.pid == pid {
                return s.dev.as_ref();
            }
        }
        // None yet, or the parent's (this is a forked child): open one.
        let mine = Box::into_raw(Box::new(Slot { pid, dev: open() }));
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

/// One line on stderr when `VRDMA_SOCKETS_DEBUG` is set.
pub fn debug(msg: &str) {
    static ON: OnceLock<bool> = OnceLock::new();
    if *ON.get_or_init(|| std::env::var_os("VRDMA_SOCKETS_DEBUG").is_some()) {
        eprintln!("vrdma-sockets[{}]: {msg}", std::process::id());
    }
}
