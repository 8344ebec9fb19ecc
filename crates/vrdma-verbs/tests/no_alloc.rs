//! The shim's data path allocates nothing (issue 3, item 7).
//!
//! Two RC QPs connected to each other through the shim's C entry points
//! on a daemon in this process, warmed up, then a measured loop of
//! signaled RDMA writes and sends with receives, posted through the ops
//! table (`post_send`, `post_recv`) and through the `ibv_wr_*` builders,
//! completions polled through `poll_cq` and through the extended CQ
//! (`start_poll`/`next_poll`/`end_poll`), and `req_notify_cq` on a CQ
//! with a channel. A counting global allocator counts the allocations of
//! the test's thread (a thread-local counter: the daemon's threads in
//! this process do not count); the loop must make none.

// The library exists for x86-64 Linux only (see src/lib.rs).
#![cfg(all(target_os = "linux", target_arch = "x86_64"))]

mod rig;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Mutex;

use rig::*;

/// Counts the allocations of the threads that turned counting on.
struct Counting;

thread_local! {
    /// Whether this thread counts; its count.
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static COUNT: Cell<u64> = const { Cell::new(0) };
}

/// Where the first counted allocation came from.
static FIRST: Mutex<Option<String>> = Mutex::new(None);

fn counted() {
    let on = COUNTING.try_with(Cell::get).unwrap_or(false);
    if !on {
        return;
    }
    let n = COUNT.with(|c| {
        c.set(c.get() + 1);
        c.get()
    });
    if n == 1 {
        // Record the stack once, without counting what recording allocates.
        COUNTING.with(|c| c.set(false));
        let bt = std::backtrace::Backtrace::force_capture().to_string();
        *FIRST.lock().unwrap_or_else(|e| e.into_inner()) = Some(bt);
        COUNTING.with(|c| c.set(true));
    }
}

// SAFETY: delegates to the system allocator.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        counted();
        // SAFETY: the caller's contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        counted();
        // SAFETY: the caller's contract.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        counted();
        // SAFETY: the caller's contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Allocations this thread makes while running `f`.
fn allocations(f: impl FnOnce()) -> u64 {
    COUNT.with(|c| c.set(0));
    COUNTING.with(|c| c.set(true));
    f();
    COUNTING.with(|c| c.set(false));
    COUNT.with(Cell::get)
}

const ITERS: u64 = 1000;

/// One round of every data-path operation; checks each completion.
fn round(p: &Pair, i: u64) {
    // RDMA write through the ops table, polled with poll_cq.
    p.post_write(0, i);
    let wc = p.poll_one(0);
    assert_eq!((wc.wr_id, wc.status, wc.opcode), (i, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE));

    // Send and receive through the ops table; the receive side polled
    // through the extended CQ.
    p.post_recv(1, i + 1);
    p.post_send(0, i + 2);
    let wc = p.poll_one(0);
    assert_eq!((wc.wr_id, wc.status, wc.opcode), (i + 2, IBV_WC_SUCCESS, IBV_WC_SEND));
    assert_eq!(p.poll_one_ex(1), (i + 1, IBV_WC_SUCCESS, IBV_WC_RECV, 8));

    // RDMA write through ibv_wr_*, polled through the extended CQ.
    p.wr_post(1, i + 3, false);
    let (wr_id, status, opcode, _) = p.poll_one_ex(1);
    assert_eq!((wr_id, status, opcode), (i + 3, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE));

    // Send through ibv_wr_*; receive posted through the ops table.
    p.post_recv(0, i + 4);
    p.wr_post(1, i + 5, true);
    let (wr_id, status, opcode, _) = p.poll_one_ex(1);
    assert_eq!((wr_id, status, opcode), (i + 5, IBV_WC_SUCCESS, IBV_WC_SEND));
    let wc = p.poll_one(0);
    assert_eq!((wc.wr_id, wc.status, wc.opcode, wc.byte_len), (i + 4, IBV_WC_SUCCESS, IBV_WC_RECV, 8));

    // Nothing left: next_poll on an empty CQ, poll_cq that finds nothing.
    p.next_poll_empty(0);
    p.next_poll_empty(1);

    p.req_notify();
}

#[test]
fn data_path_does_not_allocate() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("vrdma.sock");
    let daemon =
        vrdmad::Daemon::start(vrdmad::DaemonConfig { socket: Some(socket.clone()), ..Default::default() })
            .expect("daemon");
    // The shim finds the daemon through VRDMA_SOCKET; this is the only
    // test of this executable.
    std::env::set_var("VRDMA_SOCKET", &socket);
    let pair = Pair::new(16);

    // Warm-up: first-use initialisation (thread-locals, lazily mapped
    // ring pages, the shim's debug switch) is not the per-request cost.
    for i in 0..100 {
        round(&pair, i * 10);
    }

    let n = allocations(|| {
        for i in 0..ITERS {
            round(&pair, 1_000_000 + i * 10);
        }
    });
    let first = FIRST.lock().unwrap_or_else(|e| e.into_inner()).take();
    assert_eq!(
        n,
        0,
        "the data path allocated {n} times in {ITERS} rounds; the first allocation:\n{}",
        first.unwrap_or_default()
    );

    drop(pair);
    daemon.shutdown();
}
