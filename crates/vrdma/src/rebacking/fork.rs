//! Re-backed pages in the child of a `fork`.
//!
//! `fork` copies private memory on write but shares `MAP_SHARED` mappings,
//! and re-backed pages are shared mappings of a memfd. Left alone, a child
//! would share the parent's registered buffers, and the heap objects next
//! to them, with the parent and the device: its writes (`malloc`'s among
//! them) would land in the parent's memory. rdma-core on current kernels
//! gives the child a copy of registered pages (`IBV_FORK_UNNEEDED`), and so
//! does this: a handler that runs in every child right after `fork`
//! replaces each re-backed mapping with a private copy of its bytes. The
//! parent, its registrations and the device are untouched.
//!
//! The copy is taken in the child as it starts, not at the instant of the
//! fork: bytes the parent's other threads or the device write in between
//! may be in it.

use std::sync::Once;

use super::{parse_maps, MapEntry};

static INSTALL: Once = Once::new();

/// Makes the child of every later `fork` take private copies of the
/// re-backed pages; called before the first re-backing.
pub(crate) fn install() {
    INSTALL.call_once(|| {
        // SAFETY: registers a handler that runs in the child only; it
        // takes no lock of ours (the registry's mutex may have been held
        // by another thread at the fork) and does not unwind.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
        if rc != 0 {
            tracing::warn!(
                rc,
                "vrdma: cannot install the fork handler; a forked child shares re-backed memory"
            );
        }
    });
}

extern "C" fn in_child() {
    // A panic must not unwind into the C caller of fork.
    let _ = std::panic::catch_unwind(|| {
        let Ok(text) = std::fs::read_to_string("/proc/self/maps") else { return };
        for e in parse_maps(&text).iter().filter(|e| e.is_our_memfd()) {
            privatize(e);
        }
    });
}

/// Replaces the shared mapping `e` by private anonymous pages holding the
/// same bytes, with the same protection. Pages that cannot be read are
/// left as they are.
fn privatize(e: &MapEntry) {
    if e.perms[0] != b'r' {
        return;
    }
    let len = e.end - e.start;
    let mut prot = libc::PROT_READ;
    if e.perms[1] == b'w' {
        prot |= libc::PROT_WRITE;
    }
    if e.perms[2] == b'x' {
        prot |= libc::PROT_EXEC;
    }
    // SAFETY: a fresh anonymous mapping of `len` bytes, checked below.
    let tmp = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if tmp == libc::MAP_FAILED {
        return;
    }
    // SAFETY: `[e.start, e.end)` is mapped readable (the maps line says
    // so, and this single-threaded child changes nothing meanwhile) and
    // `tmp` is a distinct mapping of the same length.
    unsafe { std::ptr::copy_nonoverlapping(e.start as *const u8, tmp.cast::<u8>(), len) };
    // SAFETY: `tmp` is ours; then it atomically takes the place of the
    // shared mapping at the same addresses, so every pointer into those
    // pages stays valid and sees the same bytes, now private.
    unsafe {
        if prot != libc::PROT_READ | libc::PROT_WRITE {
            libc::mprotect(tmp, len, prot);
        }
        let moved = libc::mremap(
            tmp,
            len,
            len,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            e.start as *mut libc::c_void,
        );
        if moved == libc::MAP_FAILED {
            libc::munmap(tmp, len);
        }
    }
}
