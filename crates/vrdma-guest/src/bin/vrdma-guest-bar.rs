//! `vrdma-guest-bar FILE read OFFSET LEN` / `vrdma-guest-bar FILE write
//! OFFSET TEXT`: maps FILE shared (in a guest, the ivshmem device's
//! sysfs `resource2`, which can be mapped but not read) and prints or
//! writes bytes at OFFSET. The plumbing tests run it in the guest to
//! check that the VM's region reaches user space there the way the guest
//! library maps it.

use std::os::fd::AsRawFd;

fn main() {
    if let Err(e) = run() {
        eprintln!("vrdma-guest-bar: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let a: Vec<String> = std::env::args().collect();
    let usage = "usage: vrdma-guest-bar FILE (read OFFSET LEN | write OFFSET TEXT)";
    let [_, file, op, off, arg] = a.as_slice() else { return Err(usage.into()) };
    let off: usize = off.parse().map_err(|_| format!("offset {off}"))?;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)
        .map_err(|e| format!("open {file}: {e}"))?;
    let len = f.metadata().map_err(|e| format!("stat {file}: {e}"))?.len() as usize;
    let n = match op.as_str() {
        "read" => arg.parse::<usize>().map_err(|_| format!("length {arg}"))?,
        "write" => arg.len(),
        _ => return Err(usage.into()),
    };
    if off.checked_add(n).filter(|&end| end <= len).is_none() {
        return Err(format!("{off}+{n} is outside the {len} bytes of {file}"));
    }
    // SAFETY: a fresh shared mapping of the whole file, not aliased by
    // any Rust reference; it is accessed below only within `len` bytes
    // (checked above) and unmapped before returning.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(format!("mmap {file}: {}", std::io::Error::last_os_error()));
    }
    let base = p as *mut u8;
    if op == "read" {
        // Volatile: the host writes this memory behind the guest's back.
        // SAFETY: off + i < len, inside the mapping.
        let bytes: Vec<u8> = (0..n).map(|i| unsafe { base.add(off + i).read_volatile() }).collect();
        println!("{}", String::from_utf8_lossy(&bytes));
    } else {
        for (i, b) in arg.bytes().enumerate() {
            // SAFETY: off + i < off + n <= len, inside the mapping.
            unsafe { base.add(off + i).write_volatile(b) };
        }
    }
    // SAFETY: the mapping made above, not used after this.
    unsafe { libc::munmap(p, len) };
    Ok(())
}
