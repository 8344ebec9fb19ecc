//! The InfiniBand encodings of the transport timers.

use std::time::Duration;

/// Local ACK timeout: `4.096 µs * 2^timeout`; 0 means wait forever.
pub fn ack_timeout(timeout: u8) -> Option<Duration> {
    match timeout {
        0 => None,
        t => Some(Duration::from_nanos(4096u64 << t.min(31))),
    }
}

/// The RNR NAK timer table of the IB specification (9.7.5.2.8), in
/// microseconds; index 0 is the longest, 655.36 ms.
const RNR_TIMER_US: [u32; 32] = [
    655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560, 3_840, 5_120,
    7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840, 245_760, 327_680,
    491_520,
];

/// How long a requester waits after an RNR NAK carrying `min_rnr_timer`.
pub fn rnr_delay(min_rnr_timer: u8) -> Duration {
    Duration::from_micros(RNR_TIMER_US[(min_rnr_timer & 31) as usize] as u64)
}

/// `rnr_retry` of 7 means retry forever.
pub const RNR_RETRY_INFINITE: u8 = 7;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodings() {
        assert_eq!(ack_timeout(0), None);
        assert_eq!(ack_timeout(14), Some(Duration::from_nanos(4096 << 14)));
        assert_eq!(rnr_delay(0), Duration::from_micros(655_360));
        assert_eq!(rnr_delay(12), Duration::from_micros(640));
        assert_eq!(rnr_delay(31), Duration::from_micros(491_520));
    }
}
