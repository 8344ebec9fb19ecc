//! The pure helpers of libibverbs: enum names and rate conversions, with
//! rdma-core's exact strings and tables (programs print them and tests
//! compare their output).

use std::ffi::{c_char, c_int, CStr};

/// `ibv_node_type_str`.
pub extern "C" fn ibv_node_type_str(node_type: c_int) -> *const c_char {
    let s: &CStr = match node_type {
        1 => c"InfiniBand channel adapter",
        2 => c"InfiniBand switch",
        3 => c"InfiniBand router",
        4 => c"iWARP NIC",
        5 => c"usNIC",
        6 => c"usNIC UDP",
        7 => c"unspecified",
        _ => c"unknown",
    };
    s.as_ptr()
}

/// `ibv_port_state_str`.
pub extern "C" fn ibv_port_state_str(port_state: c_int) -> *const c_char {
    let s: &CStr = match port_state {
        0 => c"no state change (NOP)",
        1 => c"down",
        2 => c"init",
        3 => c"armed",
        4 => c"active",
        5 => c"active defer",
        _ => c"unknown",
    };
    s.as_ptr()
}

/// `ibv_event_type_str`.
pub extern "C" fn ibv_event_type_str(event: c_int) -> *const c_char {
    let s: &CStr = match event {
        0 => c"CQ error",
        1 => c"local work queue catastrophic error",
        2 => c"invalid request local work queue error",
        3 => c"local access violation work queue error",
        4 => c"communication established",
        5 => c"send queue drained",
        6 => c"path migrated",
        7 => c"path migration request error",
        8 => c"local catastrophic error",
        9 => c"port active",
        10 => c"port error",
        11 => c"LID change",
        12 => c"P_Key change",
        13 => c"SM change",
        14 => c"SRQ catastrophic error",
        15 => c"SRQ limit reached",
        16 => c"last WQE reached",
        17 => c"client reregistration",
        18 => c"GID table change",
        19 => c"WQ fatal",
        _ => c"unknown",
    };
    s.as_ptr()
}

/// `ibv_wc_status_str`.
pub extern "C" fn ibv_wc_status_str(status: c_int) -> *const c_char {
    let s: &CStr = match status {
        0 => c"success",
        1 => c"local length error",
        2 => c"local QP operation error",
        3 => c"local EE context operation error",
        4 => c"local protection error",
        5 => c"Work Request Flushed Error",
        6 => c"memory management operation error",
        7 => c"bad response error",
        8 => c"local access error",
        9 => c"remote invalid request error",
        10 => c"remote access error",
        11 => c"remote operation error",
        12 => c"transport retry counter exceeded",
        13 => c"RNR retry counter exceeded",
        14 => c"local RDD violation error",
        15 => c"remote invalid RD request",
        16 => c"aborted error",
        17 => c"invalid EE context number",
        18 => c"invalid EE context state",
        19 => c"fatal error",
        20 => c"response timeout error",
        21 => c"general error",
        22 => c"TM error",
        23 => c"TM software rendezvous",
        _ => c"unknown",
    };
    s.as_ptr()
}

/// `enum ibv_rate` values with their multiple of 2.5 Gb/s (where the IB
/// rates define one) and their rate in Mb/s.
const RATES: &[(c_int, Option<c_int>, c_int)] = &[
    (2, Some(1), 2500),
    (5, Some(2), 5000),
    (3, Some(4), 10000),
    (6, Some(8), 20000),
    (4, Some(12), 30000),
    (7, Some(16), 40000),
    (8, Some(24), 60000),
    (9, Some(32), 80000),
    (10, Some(48), 120000),
    (11, None, 14062),
    (12, None, 56250),
    (13, None, 112500),
    (14, None, 168750),
    (15, None, 25781),
    (16, None, 103125),
    (17, None, 206250),
    (18, None, 309375),
    (19, Some(11), 28125),
    (20, Some(20), 53125),
    (21, Some(160), 425000),
    (22, Some(240), 637500),
    (23, Some(320), 850000),
    (24, Some(480), 1275000),
];

/// `IBV_RATE_MAX`, the answer for a value with no rate.
const IBV_RATE_MAX: c_int = 0;

/// `ibv_rate_to_mult@IBVERBS_1.0`: -1 for a rate that is no multiple.
pub extern "C" fn ibv_rate_to_mult(rate: c_int) -> c_int {
    RATES.iter().find(|r| r.0 == rate).and_then(|r| r.1).unwrap_or(-1)
}

/// `mult_to_ibv_rate@IBVERBS_1.0`.
pub extern "C" fn mult_to_ibv_rate(mult: c_int) -> c_int {
    RATES.iter().find(|r| r.1 == Some(mult)).map_or(IBV_RATE_MAX, |r| r.0)
}

/// `ibv_rate_to_mbps`: -1 for an unknown rate.
pub extern "C" fn ibv_rate_to_mbps(rate: c_int) -> c_int {
    RATES.iter().find(|r| r.0 == rate).map_or(-1, |r| r.2)
}

/// `mbps_to_ibv_rate`.
pub extern "C" fn mbps_to_ibv_rate(mbps: c_int) -> c_int {
    RATES.iter().find(|r| r.2 == mbps).map_or(IBV_RATE_MAX, |r| r.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(p: *const c_char) -> &'static str {
        // SAFETY: the functions return static C strings.
        unsafe { CStr::from_ptr(p) }.to_str().unwrap()
    }

    #[test]
    fn names() {
        assert_eq!(s(ibv_wc_status_str(5)), "Work Request Flushed Error");
        assert_eq!(s(ibv_wc_status_str(99)), "unknown");
        assert_eq!(s(ibv_node_type_str(1)), "InfiniBand channel adapter");
        assert_eq!(s(ibv_port_state_str(4)), "active");
        assert_eq!(s(ibv_event_type_str(15)), "SRQ limit reached");
        assert_eq!(s(ibv_event_type_str(-1)), "unknown");
    }

    #[test]
    fn rates() {
        assert_eq!(ibv_rate_to_mult(3), 4);
        assert_eq!(mult_to_ibv_rate(4), 3);
        assert_eq!(ibv_rate_to_mult(16), -1);
        assert_eq!(ibv_rate_to_mbps(16), 103125);
        assert_eq!(mbps_to_ibv_rate(103125), 16);
        assert_eq!(mbps_to_ibv_rate(1), IBV_RATE_MAX);
        for &(rate, mult, mbps) in RATES {
            assert_eq!(ibv_rate_to_mbps(rate), mbps);
            if let Some(m) = mult {
                assert_eq!(mult_to_ibv_rate(m), rate);
            }
        }
    }
}
