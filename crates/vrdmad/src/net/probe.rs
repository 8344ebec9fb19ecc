//! TEMPORARY measurement probe (reverted in the next commit; cherry-pick
//! to measure again): the kernel's receive timestamp (SO_TIMESTAMPNS) of
//! each header read from a link against the time the engine read it.
//!
//! `VRDMA_LINKLAT_PROBE=1 vrdma bench-hosts --quick --only write_lat_8b
//! --only cm_setup_each --only sockets_lat_8b [--engine link_wake=true]`
//! (the daemons inherit the environment); each daemon appends `delay_ns
//! phase` lines to /tmp/s23/linklat/probe-<pid>.txt (the folder must
//! exist), 500 at a time. The phase is what ran before the pass that read:
//! 0 a busy pass, 1 a spin, 2 a yield, 3 a sleep, 4 the pass inside
//! try_sleep, 5 the links' waker.
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;

pub static PHASE: AtomicU8 = AtomicU8::new(0);
static SAMPLES: Mutex<Vec<(u64, u8)>> = Mutex::new(Vec::new());

pub fn on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("VRDMA_LINKLAT_PROBE").is_some())
}

pub fn enable(fd: i32) {
    let v: libc::c_int = 1;
    unsafe {
        libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_TIMESTAMPNS, &v as *const _ as *const _, 4);
    }
}

/// recv with the timestamp cmsg; records the delay.
pub fn read(fd: i32, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr() as *mut _, iov_len: buf.len() };
    let mut cbuf = [0u64; 16];
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr() as *mut _;
    msg.msg_controllen = std::mem::size_of_val(&cbuf) as _;
    let n = unsafe { libc::recvmsg(fd, &mut msg, 0) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut now: libc::timespec = unsafe { std::mem::zeroed() };
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut now) };
    let mut c = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !c.is_null() {
        let h = unsafe { &*c };
        if h.cmsg_level == libc::SOL_SOCKET && h.cmsg_type == libc::SO_TIMESTAMPNS {
            let ts: libc::timespec = unsafe { std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::timespec) };
            let d = (now.tv_sec - ts.tv_sec) as i64 * 1_000_000_000 + (now.tv_nsec - ts.tv_nsec) as i64;
            record(d.max(0) as u64);
        }
        c = unsafe { libc::CMSG_NXTHDR(&msg, c) };
    }
    Ok(n as usize)
}

fn record(d: u64) {
    let mut s = SAMPLES.lock().unwrap();
    s.push((d, PHASE.load(Ordering::Relaxed)));
    if s.len() >= 500 {
        use std::io::Write;
        let path = format!("/tmp/s23/linklat/probe-{}.txt", std::process::id());
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
            let mut out = String::new();
            for (d, p) in s.iter() {
                out.push_str(&format!("{d} {p}\n"));
            }
            let _ = f.write_all(out.as_bytes());
        }
        s.clear();
    }
}
