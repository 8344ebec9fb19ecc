//! The named tests' results: one row per test and message size, printed
//! as a table, JSON or CSV.

use serde::Serialize;

/// Latency figures, in microseconds.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Latency {
    pub samples: usize,
    pub median_us: f64,
    pub average_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub min_us: f64,
    pub max_us: f64,
}

impl Latency {
    /// From samples in nanoseconds; `None` without samples.
    pub fn from_ns(samples: &[f64]) -> Option<Latency> {
        if samples.is_empty() {
            return None;
        }
        let mut s: Vec<f64> = samples.iter().map(|v| v / 1000.0).collect();
        s.sort_by(f64::total_cmp);
        let n = s.len();
        let rank = |q: f64| s[((n - 1) as f64 * q).round() as usize];
        let median = if n % 2 == 1 { s[n / 2] } else { (s[n / 2 - 1] + s[n / 2]) / 2.0 };
        Some(Latency {
            samples: n,
            median_us: median,
            average_us: s.iter().sum::<f64>() / n as f64,
            p99_us: rank(0.99),
            p999_us: rank(0.999),
            min_us: s[0],
            max_us: s[n - 1],
        })
    }
}

/// Bandwidth figures.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Bandwidth {
    /// 10^9 bytes per second.
    pub gb_per_s: f64,
    /// 10^6 messages per second.
    pub mmsg_per_s: f64,
    pub bytes: u64,
    pub messages: u64,
    pub seconds: f64,
}

impl Bandwidth {
    pub fn new(bytes: u64, messages: u64, seconds: f64) -> Bandwidth {
        let per = |v: u64, unit: f64| if seconds > 0.0 { v as f64 / seconds / unit } else { 0.0 };
        Bandwidth { gb_per_s: per(bytes, 1e9), mmsg_per_s: per(messages, 1e6), bytes, messages, seconds }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub test: &'static str,
    pub size: usize,
    pub qps: u32,
    pub streams: u32,
    /// "poll" or "event".
    pub completions: &'static str,
    pub latency: Option<Latency>,
    pub bandwidth: Option<Bandwidth>,
    /// Anything the figures alone do not say (UD datagrams lost).
    pub note: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Table,
    Json,
    Csv,
}

const COLUMNS: [&str; 11] = [
    "test",
    "size",
    "qps",
    "streams",
    "completions",
    "median_us",
    "average_us",
    "p99_us",
    "p99.9_us",
    "GB/s",
    "Mmsg/s",
];

fn cells(r: &Row, precise: bool) -> Vec<String> {
    let f = |v: Option<f64>, digits: usize| {
        v.map_or(String::new(), |v| if precise { format!("{v}") } else { format!("{v:.digits$}") })
    };
    let l = r.latency.as_ref();
    let b = r.bandwidth.as_ref();
    vec![
        r.test.to_string(),
        r.size.to_string(),
        r.qps.to_string(),
        r.streams.to_string(),
        r.completions.to_string(),
        f(l.map(|l| l.median_us), 2),
        f(l.map(|l| l.average_us), 2),
        f(l.map(|l| l.p99_us), 2),
        f(l.map(|l| l.p999_us), 2),
        // Atomics (rows with latency) move 8 bytes: their rate is the figure.
        f(b.filter(|_| l.is_none()).map(|b| b.gb_per_s), 3),
        f(b.map(|b| b.mmsg_per_s), 3),
    ]
}

pub fn render(rows: &[Row], format: Format, header: &str) -> anyhow::Result<String> {
    Ok(match format {
        Format::Json => {
            serde_json::to_string_pretty(&serde_json::json!({ "about": header, "results": rows }))? + "\n"
        }
        Format::Csv => {
            let mut out = COLUMNS.join(",") + ",note\n";
            for r in rows {
                let note = r.note.as_deref().unwrap_or("").replace(['"', ','], " ");
                out += &format!("{},{note}\n", cells(r, true).join(","));
            }
            out
        }
        Format::Table => {
            let body: Vec<Vec<String>> = rows.iter().map(|r| cells(r, false)).collect();
            let widths: Vec<usize> = (0..COLUMNS.len())
                .map(|c| body.iter().map(|r| r[c].len()).chain([COLUMNS[c].len()]).max().unwrap_or(0))
                .collect();
            let line = |cols: Vec<String>| {
                let padded: Vec<String> = cols
                    .iter()
                    .enumerate()
                    .map(|(i, c)| {
                        if i == 0 {
                            format!("{c:<w$}", w = widths[i])
                        } else {
                            format!("{c:>w$}", w = widths[i])
                        }
                    })
                    .collect();
                padded.join("  ").trim_end().to_string() + "\n"
            };
            let mut out = format!("{header}\n\n");
            out += &line(COLUMNS.iter().map(|c| c.to_string()).collect());
            for b in body {
                out += &line(b);
            }
            for r in rows.iter().filter(|r| r.note.is_some()) {
                out += &format!("{} {} B: {}\n", r.test, r.size, r.note.as_deref().unwrap_or(""));
            }
            out +=
                "\nLatency: one way (half a round trip) for rc_lat, ud_lat, tcp_lat and rc_rdma_write_lat;\n";
            out += "the whole operation for rc_rdma_read_lat and the atomics. GB/s = 10^9 bytes/s.\n";
            out
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_a_known_set() {
        let ns: Vec<f64> = (1..=1000).map(|v| v as f64 * 1000.0).collect();
        let l = Latency::from_ns(&ns).unwrap();
        assert_eq!((l.samples, l.min_us, l.max_us), (1000, 1.0, 1000.0));
        assert_eq!(l.median_us, 500.5);
        assert_eq!(l.average_us, 500.5);
        assert_eq!(l.p99_us, 990.0);
        assert_eq!(l.p999_us, 999.0);
        assert!(Latency::from_ns(&[]).is_none());
    }

    #[test]
    fn formats_carry_the_figures() {
        let row = Row {
            test: "rc_bw",
            size: 65536,
            qps: 1,
            streams: 2,
            completions: "poll",
            latency: None,
            bandwidth: Some(Bandwidth::new(2_000_000_000, 1000, 1.0)),
            note: Some("a, \"b\"".into()),
        };
        let csv = render(std::slice::from_ref(&row), Format::Csv, "h").unwrap();
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines[0].split(',').count(), lines[1].split(',').count());
        assert!(lines[1].starts_with("rc_bw,65536,1,2,poll,,,,,2,0.001,"), "{csv}");
        let table = render(std::slice::from_ref(&row), Format::Table, "h").unwrap();
        assert!(table.contains("2.000") && table.contains("p99.9_us"), "{table}");
        let json: serde_json::Value =
            serde_json::from_str(&render(&[row], Format::Json, "h").unwrap()).unwrap();
        assert_eq!(json["results"][0]["bandwidth"]["gb_per_s"], 2.0);
    }
}
