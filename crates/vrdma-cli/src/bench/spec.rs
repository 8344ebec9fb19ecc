//! What the user asked for: test names, the host, message sizes and
//! durations, parsed from the command line (all untrusted input).

use std::time::Duration;

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

/// The port `vrdma bench --server` listens on by default.
pub const DEFAULT_PORT: u16 = 19765;
/// The largest message a test may use.
pub const MAX_SIZE: usize = 64 << 20;
/// The largest UD message: the port's MTU.
pub const UD_MAX_SIZE: usize = 4096;

/// A named test, as qperf names them.
#[derive(ValueEnum, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[value(rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum TestName {
    /// RC sends, client to server: bandwidth and message rate.
    RcBw,
    /// RC sends both ways at once: the two directions' bandwidth added.
    RcBiBw,
    /// RC send/receive ping-pong: one-way latency (half the round trip).
    RcLat,
    /// RDMA reads of the server's memory: bandwidth.
    RcRdmaReadBw,
    /// One RDMA read at a time: latency of the whole read.
    RcRdmaReadLat,
    /// RDMA writes into the server's memory: bandwidth.
    RcRdmaWriteBw,
    /// RDMA write ping-pong, each side spinning on its memory (with
    /// --events: writes with immediate, waited for on the channel).
    RcRdmaWriteLat,
    /// One atomic compare-and-swap at a time: latency and message rate.
    RcCompareSwapMr,
    /// One atomic fetch-and-add at a time: latency and message rate.
    RcFetchAddMr,
    /// UD datagrams, client to server: bandwidth as received.
    UdBw,
    /// UD send/receive ping-pong: one-way latency.
    UdLat,
    /// Plain TCP stream, client to server, between the same hosts.
    TcpBw,
    /// Plain TCP ping-pong: one-way latency.
    TcpLat,
}

/// What a test measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Latency,
    Bandwidth,
    /// Atomics: latency of each operation and the rate they make.
    Rate,
}

/// Which transport a test runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Rc,
    Ud,
    Tcp,
}

impl TestName {
    pub fn name(self) -> &'static str {
        match self {
            TestName::RcBw => "rc_bw",
            TestName::RcBiBw => "rc_bi_bw",
            TestName::RcLat => "rc_lat",
            TestName::RcRdmaReadBw => "rc_rdma_read_bw",
            TestName::RcRdmaReadLat => "rc_rdma_read_lat",
            TestName::RcRdmaWriteBw => "rc_rdma_write_bw",
            TestName::RcRdmaWriteLat => "rc_rdma_write_lat",
            TestName::RcCompareSwapMr => "rc_compare_swap_mr",
            TestName::RcFetchAddMr => "rc_fetch_add_mr",
            TestName::UdBw => "ud_bw",
            TestName::UdLat => "ud_lat",
            TestName::TcpBw => "tcp_bw",
            TestName::TcpLat => "tcp_lat",
        }
    }

    pub fn kind(self) -> Kind {
        match self {
            TestName::RcLat
            | TestName::RcRdmaReadLat
            | TestName::RcRdmaWriteLat
            | TestName::UdLat
            | TestName::TcpLat => Kind::Latency,
            TestName::RcCompareSwapMr | TestName::RcFetchAddMr => Kind::Rate,
            _ => Kind::Bandwidth,
        }
    }

    pub fn transport(self) -> Transport {
        match self {
            TestName::UdBw | TestName::UdLat => Transport::Ud,
            TestName::TcpBw | TestName::TcpLat => Transport::Tcp,
            _ => Transport::Rc,
        }
    }

    /// The message size when none is asked for.
    pub fn default_size(self) -> usize {
        match (self.kind(), self.transport()) {
            (Kind::Bandwidth, Transport::Ud) => UD_MAX_SIZE,
            (Kind::Bandwidth, _) => 64 << 10,
            _ => 8,
        }
    }

    /// The sizes this test can carry: atomics move 8 bytes, UD at most the MTU.
    pub fn max_size(self) -> usize {
        match (self.kind(), self.transport()) {
            (Kind::Rate, _) => 8,
            (_, Transport::Ud) => UD_MAX_SIZE,
            _ => MAX_SIZE,
        }
    }

    pub fn all() -> &'static [TestName] {
        TestName::value_variants()
    }
}

/// One positional argument: a test name, or the host of a server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Test(TestName),
    Host(String),
}

pub fn test_names() -> String {
    TestName::all().iter().map(|t| t.name()).collect::<Vec<_>>().join(", ")
}

/// A test name, else a host name or address (`HOST`, `HOST:PORT`,
/// `[v6]:PORT`). A word with an underscore is taken for a misspelt test.
pub fn parse_target(s: &str) -> Result<Target, String> {
    if let Ok(t) = TestName::from_str(s, true) {
        return Ok(Target::Test(t));
    }
    let host_chars = |c: char| c.is_ascii_alphanumeric() || ".-:[]%".contains(c);
    if s.is_empty() || s.contains('_') || !s.chars().all(host_chars) || s.len() > 255 {
        return Err(format!("unknown test '{s}'; the tests are: {}", test_names()));
    }
    Ok(Target::Host(s.to_string()))
}

/// `HOST`, `HOST:PORT`, `IPv6` or `[IPv6]:PORT` as a host and port.
pub fn split_host(s: &str) -> Result<(String, u16), String> {
    if let Ok(a) = s.parse::<std::net::SocketAddr>() {
        return Ok((a.ip().to_string(), a.port()));
    }
    if let Ok(ip) = s.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>() {
        return Ok((ip.to_string(), DEFAULT_PORT));
    }
    match s.rsplit_once(':') {
        Some((h, p)) => {
            let port = p.parse::<u16>().map_err(|_| format!("'{p}' in '{s}' is not a port number"))?;
            if h.is_empty() || port == 0 {
                return Err(format!("'{s}' is not HOST:PORT"));
            }
            Ok((h.to_string(), port))
        }
        None => Ok((s.to_string(), DEFAULT_PORT)),
    }
}

/// A byte count: `4096`, `64K`, `64KiB`, `1M`, `1MiB` (binary multiples).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let n: u64 = num.parse().map_err(|_| format!("'{s}' is not a size (e.g. 8, 4096, 64K, 1M)"))?;
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        _ => return Err(format!("'{s}': unknown unit '{unit}' (use K or M)")),
    };
    let bytes = n.checked_shl(shift).filter(|b| b >> shift == n).unwrap_or(u64::MAX);
    if bytes == 0 || bytes > MAX_SIZE as u64 {
        return Err(format!("'{s}': a message size must be 1 B to {} MiB", MAX_SIZE >> 20));
    }
    Ok(bytes as usize)
}

/// Seconds, as a positive decimal up to an hour.
pub fn parse_seconds(s: &str) -> Result<Duration, String> {
    let v: f64 = s.trim().parse().map_err(|_| format!("'{s}' is not a number of seconds"))?;
    if !v.is_finite() || v <= 0.0 || v > 3600.0 {
        return Err(format!("'{s}': the time must be more than 0 and at most 3600 seconds"));
    }
    Ok(Duration::from_secs_f64(v))
}

/// How long each test runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Limit {
    Time(Duration),
    /// Iterations (messages, or round trips) per stream.
    Iters(u64),
}

/// Powers of two from 1 up to `max`.
pub fn sweep(max: usize) -> Vec<usize> {
    std::iter::successors(Some(1usize), |s| s.checked_mul(2)).take_while(|s| *s <= max).collect()
}

/// The sizes `test` runs at: the asked ones it can carry, else its default.
/// Errors when the user asked for one size it cannot carry.
pub fn sizes_for(test: TestName, asked: &[usize], swept: bool) -> Result<Vec<usize>, String> {
    if test.kind() == Kind::Rate {
        return Ok(vec![8]);
    }
    if asked.is_empty() {
        return Ok(vec![test.default_size()]);
    }
    let fit: Vec<usize> = asked.iter().copied().filter(|s| *s <= test.max_size()).collect();
    if fit.len() < asked.len() && !swept {
        return Err(format!(
            "{} carries at most {} bytes per message (asked for {})",
            test.name(),
            test.max_size(),
            asked.iter().max().copied().unwrap_or(0)
        ));
    }
    Ok(fit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units_and_bounds() {
        assert_eq!(parse_size("8"), Ok(8));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert!(parse_size("0").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("1G").is_err());
        assert!(parse_size("99999999999999999999").is_err());
        assert!(parse_size("18446744073709551615M").is_err());
        assert!(parse_size("65M").is_err());
    }

    #[test]
    fn targets_are_tests_or_hosts() {
        assert_eq!(parse_target("rc_bw"), Ok(Target::Test(TestName::RcBw)));
        assert_eq!(parse_target("10.0.0.1:7"), Ok(Target::Host("10.0.0.1:7".into())));
        assert!(parse_target("rc_bww").unwrap_err().contains("unknown test"));
        assert!(parse_target("a b").is_err());
        assert_eq!(split_host("h"), Ok(("h".into(), DEFAULT_PORT)));
        assert_eq!(split_host("h:9"), Ok(("h".into(), 9)));
        assert_eq!(split_host("[::1]:9"), Ok(("::1".into(), 9)));
        assert_eq!(split_host("::1"), Ok(("::1".into(), DEFAULT_PORT)));
        assert!(split_host("h:x").is_err());
        assert!(split_host(":9").is_err());
    }

    #[test]
    fn every_name_round_trips() {
        for t in TestName::all() {
            assert_eq!(parse_target(t.name()), Ok(Target::Test(*t)));
        }
        assert_eq!(TestName::all().len(), 13);
    }

    #[test]
    fn sweeps_and_size_fits() {
        assert_eq!(sweep(8), vec![1, 2, 4, 8]);
        assert_eq!(sizes_for(TestName::UdBw, &sweep(8192), true).unwrap().last(), Some(&4096));
        assert!(sizes_for(TestName::UdLat, &[8192], false).is_err());
        assert_eq!(sizes_for(TestName::RcFetchAddMr, &[64], false).unwrap(), vec![8]);
        assert_eq!(sizes_for(TestName::RcBw, &[], false).unwrap(), vec![65536]);
    }
}
