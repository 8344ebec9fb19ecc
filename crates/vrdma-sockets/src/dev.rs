//! The process's vRDMA device: one context and PD for all its carried
//! connections, opened on first need. Without a daemon (or with
//! `VRDMA_SOCKETS=0`) there is none and every connection stays TCP.

use std::sync::OnceLock;

use vrdma::{Context, ProtectionDomain};

pub struct Dev {
    pub ctx: Context,
    pub pd: ProtectionDomain,
}

/// The device, or `None` (TCP only). Never in a forked child.
pub fn dev() -> Option<&'static Dev> {
    static DEV: OnceLock<Option<Dev>> = OnceLock::new();
    if crate::table::forked() {
        return None;
    }
    DEV.get_or_init(|| {
        if std::env::var_os("VRDMA_SOCKETS").is_some_and(|v| v == "0") {
            return None;
        }
        crate::table::watch_fork();
        let ctx = Context::open().map_err(|e| debug(&format!("no vRDMA device, TCP only: {e}"))).ok()?;
        let pd = ctx.alloc_pd().map_err(|e| debug(&format!("no PD, TCP only: {e}"))).ok()?;
        Some(Dev { ctx, pd })
    })
    .as_ref()
}

/// One line on stderr when `VRDMA_SOCKETS_DEBUG` is set.
pub fn debug(msg: &str) {
    static ON: OnceLock<bool> = OnceLock::new();
    if *ON.get_or_init(|| std::env::var_os("VRDMA_SOCKETS_DEBUG").is_some()) {
        eprintln!("vrdma-sockets[{}]: {msg}", std::process::id());
    }
}
