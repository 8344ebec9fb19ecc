//! rdma-core's `cmtime` client output, read back (the table of rdma-core
//! 44 to 51, Debian's `rdmacm-utils`; rdma-core 52 changed its columns).
//!
//! The program is not ours and its output is untrusted: a table that is
//! not what this reader knows is an error naming what it saw, never a
//! figure read from the wrong column. What cmtime 44 prints, from
//! `librdmacm/examples/cmtime.c` (`show_perf`):
//!
//! ```text
//! step              total ms     max ms     min us  us / conn
//! create id    :        1.71       0.07       0.00      17.09
//! ```
//!
//! a row per step (`%-13s: %11.2f%11.2f%11.2f%11.2f`; `bind addr` only with
//! `-b`). The fields are fixed-width with no separator, so one wider than
//! 11 characters runs into the one before it: a step that measured no
//! connection prints its min as 999999999 (a `float`: `1000000000.00`),
//! and the row reads `0.001000000000.00`. Every field has exactly two
//! decimals, which is how this reader splits them. A connection cmtime
//! could not make is a line of its own (`event: RDMA_CM_EVENT_REJECTED,
//! error: 8`, `failure ...`) while it still exits 0 and prints its
//! table: such a run is refused ([`failures`]).

use anyhow::{bail, Context as _, Result};

/// The header cmtime 44 prints above its rows (compared word by word).
const HEADER: &str = "step total ms max ms min us us / conn";

/// cmtime 44's steps, in the order it prints them.
pub const STEPS: [&str; 8] = [
    "create id",
    "bind addr",
    "resolve addr",
    "resolve route",
    "create qp",
    "connect",
    "disconnect",
    "destroy",
];

/// The steps from `rdma_create_id` to the client's ESTABLISHED: what TCP's
/// socket, connect and accept stand for.
pub const SETUP: [&str; 5] = ["create id", "resolve addr", "resolve route", "create qp", "connect"];

/// One step's row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Step {
    /// The whole step: from its first call for the first connection to
    /// its last call, or its last connection's event.
    pub total_ms: f64,
    /// The slowest connection's own time in the step.
    pub max_ms: f64,
    /// The fastest connection's own time in the step.
    pub min_us: f64,
    /// `total_ms` over the number of connections.
    pub us_per_conn: f64,
}

/// The table of one client run.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    pub rows: Vec<(&'static str, Step)>,
}

impl Table {
    pub fn step(&self, name: &str) -> Option<Step> {
        self.rows.iter().find(|(n, _)| *n == name).map(|(_, s)| *s)
    }

    /// The sum of `names`' us per connection (all present: [`parse`]
    /// checked the steps of [`SETUP`]).
    pub fn us_per_conn(&self, names: &[&str]) -> f64 {
        names.iter().filter_map(|n| self.step(n)).map(|s| s.us_per_conn).sum()
    }
}

/// The lines of cmtime's output that say a connection failed: a rejected
/// or unreachable connect (`event: ...`), a resolution that failed
/// (`RDMA_CM_EVENT_ADDR_ERROR, ...`), a call that failed (`perror`'s
/// `failure ...: reason`, `failing connection request`).
pub fn failures(out: &str) -> Vec<&str> {
    out.lines()
        .map(str::trim)
        .filter(|l| l.starts_with("event:") || l.starts_with("RDMA_CM_EVENT_") || l.contains("fail"))
        .collect()
}

/// Whether cmtime was turned away for want of a listener (its server not
/// listening yet, or gone): a run worth one more try.
pub fn turned_away(out: &str) -> bool {
    failures(out)
        .iter()
        .any(|l| l.contains("RDMA_CM_EVENT_REJECTED") || l.contains("RDMA_CM_EVENT_UNREACHABLE"))
}

/// cmtime's table from a client run of `n` connections. Refused: a run
/// with a failed connection, no header, a row of an unknown or repeated
/// step or out of order, a field that is not a non-negative number with
/// two decimals, a line after the header that is no row, a step of
/// [`SETUP`] or `disconnect`/`destroy` missing, or a total that is not
/// `n` times the per-connection figure (a table of another count).
pub fn parse(out: &str, n: usize) -> Result<Table> {
    if n == 0 {
        bail!("a run of no connections has no table");
    }
    if let Some(l) = failures(out).first() {
        bail!("cmtime reported a failed connection: {l:?}");
    }
    let mut lines = out.lines();
    lines
        .by_ref()
        .find(|l| l.split_whitespace().eq(HEADER.split_whitespace()))
        .with_context(|| format!("no table in cmtime's output (no header {HEADER:?}): {:?}", clip(out)))?;
    let mut rows: Vec<(&'static str, Step)> = Vec::new();
    for line in lines {
        if line.trim().is_empty() {
            continue;
        }
        let (name, fields) =
            line.split_once(':').with_context(|| format!("not a row of cmtime's table: {line:?}"))?;
        let at = STEPS
            .iter()
            .position(|s| *s == name.trim())
            .with_context(|| format!("unknown step {:?} in cmtime's table: {line:?}", name.trim()))?;
        if let Some((last, _)) = rows.last() {
            let last_at = STEPS.iter().position(|s| s == last).unwrap_or(0);
            if at <= last_at {
                bail!("step {:?} repeated or out of order in cmtime's table: {line:?}", STEPS[at]);
            }
        }
        let v = numbers(fields).with_context(|| format!("cmtime's row {line:?}"))?;
        let [total_ms, max_ms, min_us, us_per_conn] = v[..] else {
            bail!("cmtime's row {line:?} has {} fields, not 4", v.len());
        };
        let step = Step { total_ms, max_ms, min_us, us_per_conn };
        // Printed with two decimals: the total to 10 us, so over n
        // connections to 5/n us each, and the figure itself to 0.005 us
        // (a `float`: to 1e-6 of itself besides).
        let each = total_ms * 1000.0 / n as f64;
        let slack = 5.0 / n as f64 + 0.006 + 1e-5 * each.max(us_per_conn);
        if (each - us_per_conn).abs() > slack {
            bail!(
                "cmtime's {:?} row: {total_ms} ms in all is not {us_per_conn} us for each of {n} connections \
                 (not a run of {n}?): {line:?}",
                STEPS[at]
            );
        }
        rows.push((STEPS[at], step));
    }
    for want in SETUP.iter().chain(&["disconnect", "destroy"]) {
        if !rows.iter().any(|(n, _)| n == want) {
            bail!("no {want:?} row in cmtime's table: {:?}", clip(out));
        }
    }
    Ok(Table { rows })
}

/// The fields of a row: numbers of exactly two decimals, with or without
/// blanks between them (see the module documentation).
fn numbers(s: &str) -> Result<Vec<f64>> {
    let b = s.as_bytes();
    let (mut i, mut out) = (0, Vec::new());
    while i < b.len() {
        if b[i] == b' ' || b[i] == b'\t' {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        let int = i - start;
        if int == 0
            || b.get(i) != Some(&b'.')
            || !b.get(i + 1..i + 3).is_some_and(|d| d.iter().all(u8::is_ascii_digit))
        {
            bail!("{:?} is not a number with two decimals", &s[start..]);
        }
        i += 3;
        out.push(s[start..i].parse::<f64>().with_context(|| format!("{:?}", &s[start..i]))?);
    }
    Ok(out)
}

/// At most the first 600 characters of `s`, for an error message.
fn clip(s: &str) -> &str {
    match s.char_indices().nth(600) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `cmtime -s 127.0.0.1 -p PORT -c 100` (rdma-core 44.0, Debian's
    /// rdmacm-utils) through the drop-in librdmacm, as captured.
    const REAL_100: &str = "\
creating id
resolving address
resolving route
creating qp
connecting
disconnecting
destroying id
step              total ms     max ms     min us  us / conn
create id    :        1.71       0.07       0.00      17.09
resolve addr :        4.46       1.46      13.00      44.59
resolve route:        0.27       0.13      17.00       2.68
create qp    :        4.84       0.63      19.00      48.43
connect      :       14.64       7.46    2630.00     146.36
disconnect   :       15.63       0.50      33.00     156.31
destroy      :        4.36       0.09      37.00      43.64
";

    /// `-c 1`, as captured.
    const REAL_1: &str = "\
creating id
resolving address
resolving route
creating qp
connecting
disconnecting
destroying id
step              total ms     max ms     min us  us / conn
create id    :        0.02       0.02      23.00      23.00
resolve addr :        0.85       0.82     823.00     850.00
resolve route:        0.01       0.01      10.00      14.00
create qp    :        0.25       0.25     248.00     248.00
connect      :        0.22       0.21     212.00     224.00
disconnect   :        0.34       0.09      85.00     337.00
destroy      :        0.02       0.02      20.00      20.00
";

    /// `-c 3` with no listener on the port, as captured: exit status 0,
    /// a table, and three rejected connections.
    const REAL_REJECTED: &str = "\
creating id
resolving address
resolving route
creating qp
connecting
event: RDMA_CM_EVENT_REJECTED, error: 8
event: RDMA_CM_EVENT_REJECTED, error: 8
event: RDMA_CM_EVENT_REJECTED, error: 8
disconnecting
destroying id
step              total ms     max ms     min us  us / conn
create id    :        0.10       0.05       0.00      34.67
resolve addr :        0.99       0.85      51.00     329.00
resolve route:        0.02       0.01       8.00       5.67
create qp    :        0.31       0.26      22.00     102.67
connect      :        0.25       0.16      72.00      82.67
disconnect   :        0.00       0.001000000000.00       0.00
destroy      :        0.12       0.05      25.00      41.33
";

    #[test]
    fn a_real_table_is_read() {
        let t = parse(REAL_100, 100).unwrap();
        assert_eq!(t.rows.len(), 7);
        assert_eq!(
            t.step("connect"),
            Some(Step { total_ms: 14.64, max_ms: 7.46, min_us: 2630.0, us_per_conn: 146.36 })
        );
        let setup = t.us_per_conn(&SETUP);
        assert!((setup - (17.09 + 44.59 + 2.68 + 48.43 + 146.36)).abs() < 1e-9, "{setup}");
        let one = parse(REAL_1, 1).unwrap();
        assert_eq!(one.step("resolve addr").unwrap().us_per_conn, 850.0);
        assert_eq!(one.step("bind addr"), None);
    }

    /// A run with a failed connection still exits 0 with a table; it is
    /// refused, and is the kind worth another try.
    #[test]
    fn a_run_with_a_rejected_connection_is_refused() {
        let e = format!("{:#}", parse(REAL_REJECTED, 3).unwrap_err());
        assert!(e.contains("RDMA_CM_EVENT_REJECTED"), "{e}");
        assert!(turned_away(REAL_REJECTED));
        assert!(!turned_away(REAL_100));
        // Other failures are refused, but not retried.
        let perror = REAL_100.replace("connecting\n", "connecting\nfailure rconnecting: Invalid argument\n");
        assert!(parse(&perror, 100).is_err());
        assert!(!turned_away(&perror));
        let addr = REAL_100.replace("connecting\n", "connecting\nRDMA_CM_EVENT_ADDR_ERROR, error: -110\n");
        assert!(parse(&addr, 100).is_err());
    }

    /// Fields run together when one is wider than its 11 columns.
    #[test]
    fn glued_fields_are_split_at_their_decimals() {
        assert_eq!(
            numbers("        0.00       0.001000000000.00       0.00").unwrap(),
            vec![0.0, 0.0, 1e9, 0.0]
        );
        assert_eq!(numbers(" 123456789012.00").unwrap(), vec![123456789012.0]);
        let glued = REAL_100.replace(
            "connect      :       14.64       7.46    2630.00     146.36",
            "connect      :       14.64       7.461000000000.00     146.36",
        );
        assert_eq!(parse(&glued, 100).unwrap().step("connect").unwrap().min_us, 1e9);
    }

    #[test]
    fn malformed_tables_are_refused_with_what_was_seen() {
        let cases: Vec<(String, &str)> = vec![
            (String::new(), "no table"),
            ("creating id\nSegmentation fault\n".into(), "no table"),
            // rdma-core 52's header.
            (
                "step             avg/conn  total(us)    us/conn    sum(us)    max(us)    min(us)\n".into(),
                "no table",
            ),
            (REAL_100.replace("create qp    :", "create cq    :"), "unknown step"),
            (REAL_100.replace("resolve route:", "resolve addr :"), "repeated or out of order"),
            (REAL_100.replace("      48.43", ""), "has 3 fields"),
            (REAL_100.replace("146.36", "146.36       1.00"), "has 5 fields"),
            (REAL_100.replace("146.36", "146.4"), "two decimals"),
            (REAL_100.replace("146.36", "-146.36"), "two decimals"),
            (REAL_100.replace("146.36", "nan"), "two decimals"),
            (REAL_100.replace("146.36", "1e3"), "two decimals"),
            (
                REAL_100.replace("connect      :       14.64       7.46    2630.00     146.36\n", ""),
                "no \"connect\" row",
            ),
            (REAL_100.replace("destroy      :", "destroy       "), "not a row"),
            (format!("{REAL_100}trailing garbage\n"), "not a row"),
        ];
        for (out, want) in cases {
            let e = format!("{:#}", parse(&out, 100).unwrap_err());
            assert!(e.contains(want), "{want:?} not in {e:?} for\n{out}");
        }
    }

    /// A table of another count than the one asked for is refused.
    #[test]
    fn a_table_of_another_count_is_refused() {
        assert!(parse(REAL_100, 100).is_ok());
        let e = format!("{:#}", parse(REAL_100, 20).unwrap_err());
        assert!(e.contains("not a run of 20"), "{e}");
        assert!(parse(REAL_1, 2).is_err());
        assert!(parse(REAL_1, 0).is_err());
    }
}
