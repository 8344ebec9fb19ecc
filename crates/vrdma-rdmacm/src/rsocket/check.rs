//! What the rsocket functions check before the carrier: the carrier
//! copies a carried connection's bytes in user space, where a null buffer
//! would be a crash (a Rust precondition abort) rather than the kernel's
//! `EFAULT`.

use libc::{c_int, c_void, iovec, msghdr, size_t};

/// Whether a buffer of `n` bytes at `p` can be handed on: not null unless
/// empty.
pub(super) fn buf_ok(p: *const c_void, n: size_t) -> bool {
    !p.is_null() || n == 0
}

/// Checks `n` iovecs at `iov` as the kernel would before a copy: a count
/// in `0..=UIO_MAXIOV`, no null array or base with a length, a total that
/// fits `ssize_t`.
///
/// # Safety
/// `iov` is null or points to `n` iovecs.
pub(super) unsafe fn iov_ok(iov: *const iovec, n: usize) -> Result<(), (c_int, &'static str)> {
    if n > libc::UIO_MAXIOV as usize {
        return Err((libc::EINVAL, "more iovecs than UIO_MAXIOV"));
    }
    if n == 0 {
        return Ok(());
    }
    if iov.is_null() {
        return Err((libc::EFAULT, "a null iovec array"));
    }
    // SAFETY: as the caller promised.
    let v = unsafe { std::slice::from_raw_parts(iov, n) };
    if v.iter().any(|v| v.iov_base.is_null() && v.iov_len > 0) {
        return Err((libc::EFAULT, "an iovec with a null base"));
    }
    let total = v.iter().try_fold(0usize, |t, v| t.checked_add(v.iov_len));
    if total.is_none_or(|t| t > isize::MAX as usize) {
        return Err((libc::EINVAL, "the iovecs' lengths overflow"));
    }
    Ok(())
}

/// Checks a message header for `rrecvmsg` / `rsendmsg`.
///
/// # Safety
/// `msg` is null or a valid msghdr whose `msg_iov` holds `msg_iovlen`
/// iovecs.
pub(super) unsafe fn msg_ok(msg: *const msghdr) -> Result<(), (c_int, &'static str)> {
    // SAFETY: as the caller promised.
    let Some(m) = (unsafe { msg.as_ref() }) else { return Err((libc::EFAULT, "a null msghdr")) };
    if m.msg_control.is_null() && m.msg_controllen > 0 {
        return Err((libc::EFAULT, "a null control buffer with a length"));
    }
    // SAFETY: as the caller promised.
    unsafe { iov_ok(m.msg_iov, m.msg_iovlen) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iovecs_are_checked_as_the_kernel_would() {
        let mut b = [0u8; 4];
        let good = [iovec { iov_base: b.as_mut_ptr().cast(), iov_len: 4 }];
        let null_base = [iovec { iov_base: std::ptr::null_mut(), iov_len: 1 }];
        let empty_null = [iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }];
        let huge = [
            iovec { iov_base: b.as_mut_ptr().cast(), iov_len: usize::MAX / 2 + 1 },
            iovec { iov_base: b.as_mut_ptr().cast(), iov_len: usize::MAX / 2 + 1 },
        ];
        // SAFETY: each array holds the count given.
        unsafe {
            assert_eq!(iov_ok(good.as_ptr(), 1), Ok(()));
            assert_eq!(iov_ok(empty_null.as_ptr(), 1), Ok(()));
            assert_eq!(iov_ok(std::ptr::null(), 0), Ok(()));
            assert_eq!(iov_ok(std::ptr::null(), 1).unwrap_err().0, libc::EFAULT);
            assert_eq!(iov_ok(null_base.as_ptr(), 1).unwrap_err().0, libc::EFAULT);
            assert_eq!(iov_ok(good.as_ptr(), libc::UIO_MAXIOV as usize + 1).unwrap_err().0, libc::EINVAL);
            assert_eq!(iov_ok(huge.as_ptr(), 2).unwrap_err().0, libc::EINVAL);
        }
    }

    #[test]
    fn a_message_header_is_checked() {
        // SAFETY: null, or a zeroed msghdr (no iovecs, no control).
        unsafe {
            assert_eq!(msg_ok(std::ptr::null()).unwrap_err().0, libc::EFAULT);
            let mut m: msghdr = std::mem::zeroed();
            assert_eq!(msg_ok(&m), Ok(()));
            m.msg_controllen = 8;
            assert_eq!(msg_ok(&m).unwrap_err().0, libc::EFAULT);
        }
    }
}
