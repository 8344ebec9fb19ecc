//! The Prometheus text exposition format (version 0.0.4), written by
//! hand: a few dozen lines, where a client library would bring a registry
//! and global state the daemon does not want.
//!
//! Each family gets its `# HELP` and `# TYPE` lines once, before its
//! samples; label values are escaped (`\`, `"`, newline), as is help text
//! (`\`, newline); histograms are written as cumulative `_bucket` series
//! with `le` bounds in seconds, ending with `+Inf`, then `_sum` and
//! `_count`.

use std::fmt::Write as _;

use vrdma_core::hca::metrics::{bucket_bound_ns, Histogram, LATENCY_BUCKETS};

/// The kind of a metric family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// Builds one exposition.
#[derive(Debug, Default)]
pub struct Writer {
    out: String,
}

/// A label value, escaped as the format wants.
pub fn escape_label(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

/// A float as the format writes it.
fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        }
    } else {
        format!("{v}")
    }
}

impl Writer {
    /// Starts a family: its HELP and TYPE lines.
    pub fn family(&mut self, name: &str, kind: Kind, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {}", escape_help(help));
        let _ = writeln!(self.out, "# TYPE {name} {}", kind.name());
    }

    fn labels(&mut self, labels: &[(&str, &str)], extra: Option<(&str, &str)>) {
        let all = labels.iter().copied().chain(extra);
        let mut first = true;
        for (k, v) in all {
            self.out.push(if first { '{' } else { ',' });
            first = false;
            let _ = write!(self.out, "{k}=\"{}\"", escape_label(v));
        }
        if !first {
            self.out.push('}');
        }
    }

    /// One sample of the current family.
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.out.push_str(name);
        self.labels(labels, None);
        let _ = writeln!(self.out, " {}", number(value));
    }

    /// An integer sample (exact, however large).
    pub fn sample_u64(&mut self, name: &str, labels: &[(&str, &str)], value: u64) {
        self.out.push_str(name);
        self.labels(labels, None);
        let _ = writeln!(self.out, " {value}");
    }

    /// A histogram's series for `labels` (the family must be of kind
    /// [`Kind::Histogram`]); nanosecond samples are shown in seconds.
    pub fn histogram_ns(&mut self, name: &str, labels: &[(&str, &str)], h: &Histogram) {
        let mut cumulative = 0u64;
        let bucket = format!("{name}_bucket");
        for i in 0..LATENCY_BUCKETS {
            cumulative += h.counts[i];
            let le = number(bucket_bound_ns(i) as f64 / 1e9);
            self.out.push_str(&bucket);
            self.labels(labels, Some(("le", &le)));
            let _ = writeln!(self.out, " {cumulative}");
        }
        self.out.push_str(&bucket);
        self.labels(labels, Some(("le", "+Inf")));
        let _ = writeln!(self.out, " {}", h.count);
        self.sample(&format!("{name}_sum"), labels, h.sum_ns as f64 / 1e9);
        self.sample_u64(&format!("{name}_count"), labels, h.count);
    }

    pub fn finish(self) -> String {
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_have_help_and_type_and_label_values_are_escaped() {
        let mut w = Writer::default();
        w.family("vrdma_x_total", Kind::Counter, "a help\nwith a \\ in it");
        w.sample_u64("vrdma_x_total", &[("message", "say \"hi\"\\\nbye")], 7);
        w.sample_u64("vrdma_x_total", &[], u64::MAX);
        w.family("vrdma_y", Kind::Gauge, "y");
        w.sample("vrdma_y", &[("a", "1"), ("b", "2")], 0.25);
        let out = w.finish();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            lines,
            [
                "# HELP vrdma_x_total a help\\nwith a \\\\ in it",
                "# TYPE vrdma_x_total counter",
                r#"vrdma_x_total{message="say \"hi\"\\\nbye"} 7"#,
                "vrdma_x_total 18446744073709551615",
                "# HELP vrdma_y y",
                "# TYPE vrdma_y gauge",
                r#"vrdma_y{a="1",b="2"} 0.25"#,
            ]
        );
    }

    #[test]
    fn histogram_buckets_are_cumulative_and_end_with_inf_sum_and_count() {
        let mut h = Histogram::default();
        for ns in [100, 1500, 1600, 3000, u64::MAX / 2] {
            h.record(ns);
        }
        let mut w = Writer::default();
        w.family("vrdma_lat_seconds", Kind::Histogram, "lat");
        w.histogram_ns("vrdma_lat_seconds", &[("tenant", "uid:1")], &h);
        let out = w.finish();
        let buckets: Vec<(String, u64)> = out
            .lines()
            .filter(|l| l.starts_with("vrdma_lat_seconds_bucket"))
            .map(|l| {
                let le = l.split("le=\"").nth(1).unwrap().split('"').next().unwrap().to_string();
                (le, l.rsplit(' ').next().unwrap().parse().unwrap())
            })
            .collect();
        assert_eq!(buckets.len(), LATENCY_BUCKETS + 1);
        assert_eq!(buckets[0], ("0.000001024".to_string(), 1));
        assert_eq!(buckets[1].1, 3);
        assert_eq!(buckets[2].1, 4);
        assert!(buckets.windows(2).all(|w| w[0].1 <= w[1].1), "cumulative: {buckets:?}");
        assert_eq!(buckets.last().unwrap(), &("+Inf".to_string(), 5));
        assert!(out.contains("vrdma_lat_seconds_count{tenant=\"uid:1\"} 5\n"), "{out}");
        assert!(out.contains("vrdma_lat_seconds_sum{tenant=\"uid:1\"} "), "{out}");
        assert!(out.lines().all(|l| !l.starts_with("vrdma_lat_seconds_bucket{le")), "tenant label first");
    }
}
