//! The study's raw data: one record per run and figure, their summaries
//! (average, min, max) and Jain's fairness index; written as CSV and JSON.

use serde::Serialize;

use super::plan::{Placement, Protocol};

/// Which part of the study a record belongs to.
#[derive(Serialize, Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Section {
    /// A transfer cell's bandwidth (all its tenants together).
    Transfer,
    /// One tenant's bandwidth in a four-tenant cell.
    Tenant,
    /// The latency set (one-way µs, the median of the run).
    Latency,
    /// The bandwidth set (GB/s).
    Bandwidth,
    /// The latency-beside-a-hog cell: a victim's 8 B latency unloaded and
    /// beside a tenant streaming over 64 QPs, without and with
    /// `latency_class = "latency"` (one-way µs, the median of the run).
    Protection,
}

impl Section {
    pub fn name(self) -> &'static str {
        match self {
            Section::Transfer => "transfer",
            Section::Tenant => "tenant",
            Section::Latency => "latency",
            Section::Bandwidth => "bandwidth",
            Section::Protection => "protection",
        }
    }
}

/// One figure of one run.
#[derive(Serialize, Debug, Clone)]
pub struct Record {
    pub section: Section,
    pub placement: Placement,
    pub protocol: Protocol,
    /// Tenants transferring at once (1 or 4).
    pub tenants: u32,
    /// The tenant (1..=4) of a per-tenant record.
    pub tenant: Option<u32>,
    /// "vrdma bench", or the anchor: "qperf", "iperf3", "perftest".
    pub tool: &'static str,
    /// The test: vrdma bench's name, or the anchor's ("ib_write_bw", ...).
    pub test: String,
    pub size: u64,
    /// 1-based.
    pub run: u32,
    /// GB/s (10^9 B/s) or µs.
    pub value: f64,
    pub unit: &'static str,
    pub bytes: Option<u64>,
    pub seconds: Option<f64>,
    /// Latency records: the run's average and p99 (µs), where known.
    pub average_us: Option<f64>,
    pub p99_us: Option<f64>,
}

/// A run or test that failed, for the report.
#[derive(Serialize, Debug, Clone)]
pub struct Failure {
    pub what: String,
    pub error: String,
}

/// Average, min, max of samples.
#[derive(Serialize, Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    pub n: usize,
    pub avg: f64,
    pub min: f64,
    pub max: f64,
}

impl Summary {
    pub fn of(v: &[f64]) -> Option<Summary> {
        if v.is_empty() {
            return None;
        }
        let min = v.iter().copied().fold(f64::INFINITY, f64::min);
        let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        Some(Summary { n: v.len(), avg: v.iter().sum::<f64>() / v.len() as f64, min, max })
    }
}

/// Jain's fairness index of the allocations `x`: (Σx)² / (n·Σx²), from
/// 1/n (one gets everything) to 1 (all equal). `None` without
/// allocations or when all are zero.
pub fn jain(x: &[f64]) -> Option<f64> {
    let n = x.len() as f64;
    let sum: f64 = x.iter().sum();
    let squares: f64 = x.iter().map(|v| v * v).sum();
    if x.is_empty() || squares <= 0.0 || !squares.is_finite() {
        return None;
    }
    Some((sum * sum / (n * squares)).clamp(1.0 / n, 1.0))
}

const CSV_COLUMNS: &str =
    "section,placement,protocol,tenants,tenant,tool,test,size,run,value,unit,bytes,seconds,average_us,p99_us";

pub fn csv(records: &[Record]) -> String {
    let opt = |v: Option<f64>| v.map_or(String::new(), |v| v.to_string());
    let mut out = String::from(CSV_COLUMNS);
    out.push('\n');
    for r in records {
        let cols = [
            r.section.name().to_string(),
            r.placement.name().to_string(),
            r.protocol.name().to_string(),
            r.tenants.to_string(),
            r.tenant.map_or(String::new(), |t| t.to_string()),
            r.tool.to_string(),
            r.test.replace([',', '"', '\n'], " "),
            r.size.to_string(),
            r.run.to_string(),
            r.value.to_string(),
            r.unit.to_string(),
            r.bytes.map_or(String::new(), |b| b.to_string()),
            opt(r.seconds),
            opt(r.average_us),
            opt(r.p99_us),
        ];
        out.push_str(&cols.join(","));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jain_bounds_and_known_values() {
        assert_eq!(jain(&[1.0, 1.0, 1.0, 1.0]), Some(1.0));
        assert_eq!(jain(&[5.0, 0.0, 0.0, 0.0]), Some(0.25));
        let j = jain(&[1.0, 2.0, 3.0, 4.0]).unwrap();
        assert!((j - 100.0 / 120.0).abs() < 1e-12, "{j}");
        assert_eq!(jain(&[]), None);
        assert_eq!(jain(&[0.0, 0.0]), None);
        // Scale-free.
        let a = jain(&[0.3, 0.9, 1.2, 2.0]).unwrap();
        let b = jain(&[3.0, 9.0, 12.0, 20.0]).unwrap();
        assert!((a - b).abs() < 1e-12);
        assert!((0.25..=1.0).contains(&a));
    }

    #[test]
    fn summaries() {
        let s = Summary::of(&[2.0, 4.0, 9.0]).unwrap();
        assert_eq!((s.n, s.avg, s.min, s.max), (3, 5.0, 2.0, 9.0));
        assert!(Summary::of(&[]).is_none());
    }

    #[test]
    fn csv_rows_have_every_column() {
        let r = Record {
            section: Section::Tenant,
            placement: Placement::Hosts,
            protocol: Protocol::Vrdma,
            tenants: 4,
            tenant: Some(2),
            tool: "vrdma bench",
            test: "rc_rdma_write_bw".into(),
            size: 65536,
            run: 1,
            value: 1.5,
            unit: "GB/s",
            bytes: Some(100),
            seconds: None,
            average_us: None,
            p99_us: None,
        };
        let out = csv(&[r]);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0].split(',').count(), lines[1].split(',').count());
        assert!(
            lines[1].starts_with("tenant,hosts,vRDMA,4,2,vrdma bench,rc_rdma_write_bw,65536,1,1.5,GB/s,100,")
        );
    }
}
