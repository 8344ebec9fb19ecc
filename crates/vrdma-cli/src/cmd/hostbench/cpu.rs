//! What a bandwidth figure costs in CPU: the whole machine's busy time,
//! per gigabyte moved.
//!
//! A bandwidth figure alone hides its cost. Where CPUs are to spare, two
//! transports can reach the same Gbit/s while one burns twice the CPU
//! time doing it; where the run keeps every CPU busy (two hosts sharing a
//! 2-CPU machine), the cost is the inverse of the bandwidth and says
//! which side needs more work per byte. Busy time counts everything: both
//! daemons, both applications and the kernel's TCP work, wherever it ran.
//! It is read from `/proc/stat` over the middle of a measurement (not its
//! start-up or end), the same way for vRDMA and for its TCP anchor, so
//! anything else the machine runs meanwhile is counted too.

use std::thread::JoinHandle;
use std::time::Duration;

/// Busy and total jiffies of all CPUs, from `/proc/stat`'s `cpu` line.
fn parse_proc_stat(s: &str) -> Option<(u64, u64)> {
    let line = s.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line.split_whitespace().skip(1).map(|x| x.parse().ok()).collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal (guest time is
    // already counted in user).
    if v.len() < 8 {
        return None;
    }
    let idle = v[3] + v[4];
    let busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7];
    Some((busy, busy + idle))
}

fn read_proc_stat() -> Option<(u64, u64)> {
    parse_proc_stat(&std::fs::read_to_string("/proc/stat").ok()?)
}

/// The part of a `secs`-long measurement to sample: a third of it (at
/// most a second) is left out at each end.
fn window(secs: u32) -> (Duration, Duration) {
    let total = Duration::from_secs(secs.into());
    let edge = (total / 3).min(Duration::from_secs(1));
    (edge, total - 2 * edge)
}

/// CPUs kept busy on average, from two `/proc/stat` readings.
fn busy_cpus(a: (u64, u64), b: (u64, u64), cpus: usize) -> Option<f64> {
    let (busy, total) = (b.0.checked_sub(a.0)?, b.1.checked_sub(a.1)?);
    (total > 0).then(|| busy as f64 / total as f64 * cpus as f64)
}

/// Samples the machine's CPU use over the middle of a measurement that
/// starts now and lasts `secs`.
pub struct CpuSample(JoinHandle<Option<f64>>);

impl CpuSample {
    pub fn start(secs: u32) -> CpuSample {
        let (skip, len) = window(secs);
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        CpuSample(std::thread::spawn(move || {
            std::thread::sleep(skip);
            let a = read_proc_stat()?;
            std::thread::sleep(len);
            busy_cpus(a, read_proc_stat()?, cpus)
        }))
    }

    /// Milliseconds of CPU per gigabyte at `gbit_s`; None if `/proc/stat`
    /// could not be read or nothing moved.
    pub fn ms_per_gb(self, gbit_s: f64) -> Option<f64> {
        let cpus = self.0.join().ok()??;
        (gbit_s > 0.0).then(|| cpus * 1000.0 / (gbit_s / 8.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_busy_and_total_from_the_cpu_line() {
        let s = "cpu  100 5 50 800 20 3 7 15 0 0\ncpu0 50 2 25 400 10 1 3 7 0 0\n";
        assert_eq!(parse_proc_stat(s), Some((100 + 5 + 50 + 3 + 7 + 15, 1000)));
        assert_eq!(parse_proc_stat("cpu0 1 2 3\n"), None);
        assert_eq!(parse_proc_stat("cpu  1 2 x 4 5 6 7 8\n"), None);
        assert_eq!(parse_proc_stat("cpu  1 2 3\n"), None);
    }

    #[test]
    fn busy_cpus_and_cost_per_gigabyte() {
        // Half of 2 CPUs' time busy: one CPU.
        assert_eq!(busy_cpus((0, 0), (100, 200), 2), Some(1.0));
        assert_eq!(busy_cpus((10, 10), (10, 10), 2), None);
        assert_eq!(busy_cpus((10, 10), (5, 20), 2), None);
        // One CPU busy at 8 Gbit/s (1 GB/s): 1000 ms of CPU per GB.
        let one_cpu = CpuSample(std::thread::spawn(|| Some(1.0)));
        assert_eq!(one_cpu.ms_per_gb(8.0), Some(1000.0));
        assert_eq!(CpuSample(std::thread::spawn(|| Some(1.0))).ms_per_gb(0.0), None);
    }

    #[test]
    fn the_window_leaves_out_both_ends() {
        assert_eq!(window(5), (Duration::from_secs(1), Duration::from_secs(3)));
        let (skip, len) = window(2);
        assert!(skip > Duration::ZERO && len > Duration::ZERO && 2 * skip + len == Duration::from_secs(2));
    }

    #[test]
    fn this_machine_has_a_cpu_line() {
        let (busy, total) = read_proc_stat().expect("/proc/stat");
        assert!(busy <= total && total > 0);
    }
}
