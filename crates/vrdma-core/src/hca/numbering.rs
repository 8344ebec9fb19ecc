//! The numbers a daemon hands out: QPNs, PD/CQ/SRQ/AH ids and memory keys,
//! within the daemon's number space.
//!
//! A tenant that moves to another host keeps its numbers (its peers know
//! its QPNs and rkeys), so the destination must not have handed them out
//! itself. Each daemon of a cluster therefore numbers within a space of its
//! own ([`HcaConfig::number_space`], 1..=255): the space is the high bits
//! of every number (QPN: bits 16..24, ids and keys: bits 24..32), and the
//! counter wraps within the space's low bits, skipping numbers in use
//! (imported ones included). Only when every number of the space is in use
//! does a daemon take a free one outside it, where a collision becomes
//! possible again; an import that would collide is still refused
//! (`SnapshotError::Collision`). Space 0 is a daemon alone: QPNs from
//! 0x11 over all 24 bits, ids from 1 over all 32, keys fully random.
//!
//! Keys in a space keep 24 random bits (a guess at an rkey succeeds once
//! in 16 million tries, and a wrong key ends the guessing QP in error), as
//! an InfiniBand key is a 24-bit index and an 8-bit variant.
//!
//! [`HcaConfig::number_space`]: super::HcaConfig::number_space

/// The multicast QPN: never a QP's number.
const MULTICAST_QPN: u32 = 0xff_ffff;
/// Lowest QPN of space 0 (QPN 0 and 1 are special, as in IB).
const FIRST_QPN: u32 = 0x11;

/// The first QPN the counter of `space` hands out.
pub(crate) fn first_qpn(space: u8) -> u32 {
    if space == 0 {
        FIRST_QPN
    } else {
        u32::from(space) << 16
    }
}

/// The first PD/CQ/SRQ/AH id the counter of `space` hands out.
pub(crate) fn first_id(space: u8) -> u32 {
    (u32::from(space) << 24) | 1
}

/// The next QPN after `n` in `space` (wrapping within it).
fn next_qpn(space: u8, n: u32) -> u32 {
    if space == 0 {
        if n >= MULTICAST_QPN - 1 {
            FIRST_QPN
        } else {
            n + 1
        }
    } else {
        (u32::from(space) << 16) | ((n + 1) & 0xffff)
    }
}

/// A free QPN: from `*counter` on within `space`, else (the space full)
/// any free one. `taken` says whether a number is in use.
pub(crate) fn alloc_qpn(space: u8, counter: &mut u32, taken: impl Fn(u32) -> bool) -> Option<u32> {
    let tries = if space == 0 { MULTICAST_QPN - FIRST_QPN } else { 1 << 16 };
    for _ in 0..tries {
        let n = *counter;
        *counter = next_qpn(space, n);
        if n != MULTICAST_QPN && n >= FIRST_QPN && !taken(n) {
            return Some(n);
        }
    }
    (FIRST_QPN..MULTICAST_QPN).find(|&n| !taken(n))
}

/// A free id: from `*counter` on within `space` (ids wrap within its 24
/// low bits; space 0: all of u32 but 0), else any free one.
pub(crate) fn alloc_id(space: u8, counter: &mut u32, taken: impl Fn(u32) -> bool) -> u32 {
    let (tries, high) = if space == 0 { (u32::MAX, 0) } else { (1 << 24, u32::from(space) << 24) };
    for _ in 0..tries {
        let n = *counter;
        *counter = if space == 0 { n.wrapping_add(1).max(1) } else { high | ((n + 1) & 0xff_ffff) };
        if n != 0 && !taken(n) {
            return n;
        }
    }
    // The space is full (16 million objects): any free number. The tables
    // hold far fewer objects than numbers, so this ends.
    let mut n = 1u32;
    while taken(n) {
        n += 1;
    }
    n
}

/// A memory key from the random `drawn` within `space`.
pub(crate) fn key_in_space(space: u8, drawn: u32) -> u32 {
    if space == 0 {
        drawn
    } else {
        (u32::from(space) << 24) | (drawn & 0xff_ffff)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn space_zero_numbers_as_before() {
        let mut c = first_qpn(0);
        assert_eq!(alloc_qpn(0, &mut c, |_| false), Some(0x11));
        assert_eq!(alloc_qpn(0, &mut c, |_| false), Some(0x12));
        let mut c = MULTICAST_QPN - 1;
        assert_eq!(alloc_qpn(0, &mut c, |_| false), Some(0xff_fffe));
        assert_eq!(alloc_qpn(0, &mut c, |_| false), Some(0x11), "wraps past the multicast QPN");
        let mut c = first_id(0);
        assert_eq!(alloc_id(0, &mut c, |_| false), 1);
        assert_eq!(key_in_space(0, 0xdead_beef), 0xdead_beef);
    }

    #[test]
    fn a_space_keeps_its_high_bits_and_wraps_within() {
        let mut c = first_qpn(7);
        assert_eq!(alloc_qpn(7, &mut c, |_| false), Some(0x07_0000));
        let mut c = 0x07_ffff;
        assert_eq!(alloc_qpn(7, &mut c, |_| false), Some(0x07_ffff));
        assert_eq!(alloc_qpn(7, &mut c, |_| false), Some(0x07_0000), "wraps within the space");
        // Space 255 never hands out the multicast QPN.
        let mut c = 0xff_fffe;
        assert_eq!(alloc_qpn(255, &mut c, |_| false), Some(0xff_fffe));
        assert_eq!(alloc_qpn(255, &mut c, |_| false), Some(0xff_0000));
        let mut c = first_id(9);
        assert_eq!(alloc_id(9, &mut c, |_| false), 0x0900_0001);
        let mut c = 0x09ff_ffff;
        assert_eq!(alloc_id(9, &mut c, |_| false), 0x09ff_ffff);
        assert_eq!(alloc_id(9, &mut c, |_| false), 0x0900_0000);
        assert_eq!(key_in_space(9, 0xdead_beef), 0x09ad_beef);
    }

    #[test]
    fn numbers_in_use_are_skipped_and_a_full_space_spills() {
        let mut c = first_qpn(3);
        assert_eq!(alloc_qpn(3, &mut c, |n| n < 0x03_0005), Some(0x03_0005));
        let mut c = first_qpn(3);
        let full = alloc_qpn(3, &mut c, |n| n >> 16 == 3 || n < 0x20).unwrap();
        assert_eq!(full, 0x20, "a full space takes a free number outside it");
        let mut c = first_id(3);
        assert_eq!(alloc_id(3, &mut c, |n| n >> 24 == 3), 1);
    }
}
