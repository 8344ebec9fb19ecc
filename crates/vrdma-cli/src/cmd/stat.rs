//! `vrdma stat`: the caller's own tenant's figures (the metrics
//! endpoint's per-tenant series, for this tenant only, from the daemon
//! over the control socket: no endpoint needed, and never another
//! tenant's), the links to other hosts' daemons, and the path each QP of
//! the caller's tenant takes (shared memory on this host, or a link).
//! The links' counters are the caller's own tenant's traffic on each,
//! unless the caller is the host's operator (root or the daemon's uid,
//! never a guest): then they are every tenant's together, which would
//! tell a tenant how much the others send (`--prometheus`: the same
//! figures in the endpoint's format).
//! With `--metrics ADDR`: the daemon's metrics endpoint (`metrics_listen`)
//! read and shown for a person: a table per tenant, the engine and the
//! links (`--prometheus`: the exposition as served).

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use vrdma_core::hca::metrics::TenantReport;
use vrdma_core::hca::{Path, StatReport};

#[derive(clap::Args)]
pub struct Args {
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    /// Read the daemon's metrics endpoint at this address (its
    /// `metrics_listen`, e.g. 127.0.0.1:9464) and show every tenant's
    /// figures, the engine's and the links'.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<std::net::SocketAddr>,
    /// Print Prometheus text: with --metrics, the endpoint's as served;
    /// without, this caller's own figures (as `vrdma stat` shows them) in
    /// the endpoint's names and labels.
    #[arg(long, conflicts_with = "json")]
    prometheus: bool,
    /// With --metrics: send the bearer token in this file (the daemon's
    /// `metrics_token_file`).
    #[arg(long, value_name = "PATH", requires = "metrics")]
    metrics_token_file: Option<PathBuf>,
}

pub fn run(socket: Option<PathBuf>, args: Args) -> Result<()> {
    if let Some(addr) = args.metrics {
        let token = args.metrics_token_file.as_deref().map(read_token).transpose()?;
        let text = scrape(addr, token.as_deref())?;
        if args.prometheus {
            emit(&text)?;
        } else {
            emit(&render_metrics(&text))?;
        }
        return Ok(());
    }
    // In a QEMU guest (no socket named, vRDMA's ports there), the host's
    // daemon through them: the VM's tenant's figures.
    let ctx = crate::embedded::open_existing(socket)?;
    let s = ctx.stat()?;
    if args.prometheus {
        emit(&vrdmad::metrics::render_stat(&s))?;
    } else if args.json {
        emit(&format!("{}\n", serde_json::to_string_pretty(&to_json(&s)?)?))?;
    } else {
        emit(&render(&s))?;
    }
    Ok(())
}

/// The quantiles shown of a tenant's latency histogram.
const QUANTILES: [(&str, f64); 3] = [("p50", 0.5), ("p90", 0.9), ("p99", 0.99)];

/// The report as JSON, the tenant's latency quantiles added (each the
/// bound of the histogram bucket it falls in, in ns; null above every
/// bound or without samples).
fn to_json(s: &StatReport) -> Result<serde_json::Value> {
    let mut v = serde_json::to_value(s)?;
    if let (Some(t), Some(obj)) = (&s.tenant, v.get_mut("tenant").and_then(|t| t.as_object_mut())) {
        let q: serde_json::Map<String, serde_json::Value> = QUANTILES
            .iter()
            .map(|(name, q)| {
                let ns = t.counters.latency.quantile_bound_ns(*q).filter(|&n| n != u64::MAX);
                (format!("{name}_ns_at_most"), ns.into())
            })
            .collect();
        obj.insert("latency_quantiles".into(), q.into());
    }
    Ok(v)
}

fn duration_ns(ns: u64) -> String {
    match ns {
        n if n >= 1_000_000_000 => format!("{:.3} s", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.3} ms", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1} us", n as f64 / 1e3),
        n => format!("{n} ns"),
    }
}

/// The caller's tenant's figures, for a person.
fn render_tenant(t: &TenantReport) -> String {
    let c = &t.counters;
    let mut out = String::new();
    out.push_str(&format!(
        "tenant:		{} ({} objects, {} registered)
",
        tenant_name(t.tenant),
        t.objects,
        human_bytes(t.registered_bytes as f64)
    ));
    out.push_str(&format!(
        "  sent:		{} messages / {}
  received:	{} messages / {}
  errors:	{} completions
",
        c.messages_sent,
        human_bytes(c.bytes_sent as f64),
        c.messages_received,
        human_bytes(c.bytes_received as f64),
        c.completions_error
    ));
    out.push_str(&format!(
        "  engine:	{} in {} turns, throttled {} ({} rate-limited shares), held back on links {}
",
        duration_ns(c.engine_ns),
        c.turns,
        duration_ns(c.throttled_ns),
        c.throttled_shares,
        duration_ns(c.link_throttled_ns)
    ));
    let h = &c.latency;
    if h.count == 0 {
        out.push_str(
            "  latency:	no message yet
",
        );
    } else {
        let q: Vec<String> = QUANTILES
            .iter()
            .map(|(name, q)| match h.quantile_bound_ns(*q) {
                Some(u64::MAX) => format!(
                    "{name} > {}",
                    duration_ns(vrdma_core::hca::metrics::bucket_bound_ns(
                        vrdma_core::hca::metrics::LATENCY_BUCKETS - 1
                    ))
                ),
                Some(ns) => format!("{name} <= {}", duration_ns(ns)),
                None => format!("{name} -"),
            })
            .collect();
        out.push_str(&format!(
            "  latency:	{} messages, mean {}, {}
",
            h.count,
            duration_ns(h.sum_ns / h.count),
            q.join(", ")
        ));
    }
    out
}

/// A tenant as the metrics label it.
fn tenant_name(t: vrdma_core::hca::TenantId) -> String {
    if t.is_host_local() {
        format!("local:{}", t.0 - vrdma_core::hca::TenantId::HOST_LOCAL_BASE)
    } else {
        format!("uid:{}", t.0)
    }
}

/// Writes `text` to stdout. A reader that went away (`vrdma stat | head`)
/// ends the output quietly, as it does for other tools, instead of the
/// panic `print!` gives on a closed pipe.
fn emit(text: &str) -> Result<()> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

/// The text form, also used by `vrdma devinfo`.
pub fn render_links(s: &StatReport) -> String {
    let mut out = String::new();
    if s.links.is_empty() {
        out.push_str("links:\t\tnone (same-host transfers only; see [net] in the daemon config)\n");
    } else if s.totals {
        out.push_str("links:\t\tevery tenant's traffic (the operator's view)\n");
    } else {
        out.push_str("links:\t\tthis tenant's own traffic and QPs on each (the operator sees the totals)\n");
    }
    for l in &s.links {
        out.push_str(&format!(
            "link {}:\t\tpeer gid {} lid {} chunk {} {}, {} QPs, out {} frames / {} B, in {} frames / {} B, dropped {}, rate-limited {}, cut frames {} / {} B\n",
            l.id.0,
            l.info.gid,
            l.info.lid,
            l.info.chunk,
            if l.up { "UP" } else { "DOWN" },
            l.qps,
            l.stats.frames_out,
            l.stats.payload_out,
            l.stats.frames_in,
            l.stats.payload_in,
            l.stats.dropped_in,
            duration_ns(l.stats.throttle.rate_limited_ns),
            l.stats.throttle.cut_frames,
            l.stats.throttle.cut_bytes
        ));
    }
    out
}

fn render(s: &StatReport) -> String {
    let mut out = s.tenant.as_deref().map(render_tenant).unwrap_or_default();
    out.push_str(&render_links(s));
    if s.qps.is_empty() {
        out.push_str("qps:\t\tnone of this tenant\n");
    }
    for q in &s.qps {
        let path = match q.path {
            Path::None => "not connected".to_string(),
            Path::SharedMemory if q.direct_grants > 0 => {
                format!("shared memory (same host), direct path: {} region grant(s)", q.direct_grants)
            }
            Path::SharedMemory => "shared memory (same host)".to_string(),
            Path::Link(Some(l)) => format!("tcp link {}", l.0),
            Path::Link(None) => "tcp (no link yet)".to_string(),
        };
        out.push_str(&format!(
            "qp {:#08x}:\t{:?} {:?} -> qpn {:#08x}, {}\n",
            q.qpn, q.qp_type, q.state, q.dest_qpn, path
        ));
    }
    if s.missed_wakeups > 0 {
        out.push_str(&format!(
            "missed wake-ups:	{} ({}QPs found with work by the engine's sweep, not named after a post)
",
            s.missed_wakeups,
            if s.totals { "" } else { "this tenant's " }
        ));
    }
    out
}

/// The token in the file at `path`: its content without surrounding
/// whitespace, one line of visible characters.
fn read_token(path: &std::path::Path) -> Result<String> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the metrics token file {}", path.display()))?;
    let token = text.trim();
    if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
        anyhow::bail!("the metrics token file {} does not hold one token on one line", path.display());
    }
    Ok(token.to_string())
}

/// `GET /metrics` from `addr` (the body), with timeouts, sending `token`
/// if given.
fn scrape(addr: std::net::SocketAddr, token: Option<&str>) -> Result<String> {
    use std::io::{Read, Write};
    let t = std::time::Duration::from_secs(10);
    let mut c = std::net::TcpStream::connect_timeout(&addr, t)
        .with_context(|| format!("no metrics endpoint answers on {addr} (the daemon's metrics_listen)"))?;
    c.set_read_timeout(Some(t))?;
    c.set_write_timeout(Some(t))?;
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    c.write_all(
        format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n\r\n").as_bytes(),
    )?;
    let mut out = Vec::new();
    c.take(64 << 20).read_to_end(&mut out)?;
    let out = String::from_utf8(out).context("the metrics endpoint answered something other than text")?;
    let (head, body) = out.split_once("\r\n\r\n").context("a truncated HTTP answer")?;
    if head.starts_with("HTTP/1.1 401") {
        anyhow::bail!(
            "the metrics endpoint wants a bearer token: give the daemon's metrics_token_file with \
             --metrics-token-file{}",
            if token.is_some() { " (the one given is not it)" } else { "" }
        );
    }
    if !head.starts_with("HTTP/1.1 200") {
        anyhow::bail!("the metrics endpoint answered {}", head.lines().next().unwrap_or(""));
    }
    Ok(body.to_string())
}

/// A sample: its name, labels and value.
type Sample<'a> = (&'a str, Vec<(String, String)>, f64);

/// The samples of an exposition.
fn samples(text: &str) -> Vec<Sample<'_>> {
    let mut out = Vec::new();
    for l in text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
        let Some((series, value)) = l.rsplit_once(' ') else { continue };
        let Ok(v) = value.parse::<f64>() else { continue };
        let (name, labels) = match series.split_once('{') {
            Some((n, rest)) => (n, parse_labels(rest.trim_end_matches('}'))),
            None => (series, Vec::new()),
        };
        out.push((name, labels, v));
    }
    out
}

/// `a="x",b="y"` with the format's escapes.
fn parse_labels(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        let key: String = chars.by_ref().take_while(|&c| c != '=').collect();
        if key.is_empty() || chars.next() != Some('"') {
            break;
        }
        let mut v = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some('n') => v.push('\n'),
                    Some(o) => v.push(o),
                    None => break,
                },
                '"' => break,
                c => v.push(c),
            }
        }
        out.push((key.trim_start_matches(',').to_string(), v));
        if chars.next().is_none() {
            break;
        }
    }
    out
}

fn human_bytes(b: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{v:.0} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// The metrics for a person.
pub fn render_metrics(text: &str) -> String {
    use std::collections::BTreeMap;
    use std::fmt::Write as _;
    let all = samples(text);
    let label = |ls: &[(String, String)], k: &str| ls.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let scalar =
        |name: &str| all.iter().find(|(n, l, _)| *n == name && l.is_empty()).map(|s| s.2).unwrap_or(0.0);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "engine:\t{:.0} passes, busy {:.1} s of {:.1} s ({:.1} %), {:.0} sleeps",
        scalar("vrdma_engine_passes_total"),
        scalar("vrdma_engine_busy_seconds_total"),
        scalar("vrdma_engine_uptime_seconds"),
        scalar("vrdma_engine_busy_ratio") * 100.0,
        scalar("vrdma_engine_sleeps_total"),
    );
    // Per tenant: name -> value.
    let mut tenants: BTreeMap<String, BTreeMap<&str, f64>> = BTreeMap::new();
    for (n, l, v) in &all {
        if let (Some(t), true) = (label(l, "tenant"), n.starts_with("vrdma_tenant_")) {
            if label(l, "le").is_none() {
                tenants.entry(t).or_default().insert(n, *v);
            }
        }
    }
    let _ = writeln!(
        out,
        "{:<14} {:>7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>7} {:>9} {:>9} {:>9} {:>9}",
        "tenant",
        "objects",
        "registered",
        "msgs out",
        "bytes out",
        "msgs in",
        "bytes in",
        "errors",
        "engine s",
        "throttled",
        "link held",
        "mean lat"
    );
    for (t, m) in &tenants {
        let g = |k: &str| m.get(k).copied().unwrap_or(0.0);
        let count = g("vrdma_tenant_message_latency_seconds_count");
        let mean = if count > 0.0 {
            format!("{:.1} us", g("vrdma_tenant_message_latency_seconds_sum") / count * 1e6)
        } else {
            "-".into()
        };
        let _ = writeln!(
            out,
            "{:<14} {:>7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>7} {:>9.3} {:>9.3} {:>9.3} {:>9}",
            t,
            g("vrdma_tenant_objects"),
            human_bytes(g("vrdma_tenant_registered_bytes")),
            g("vrdma_tenant_messages_sent_total"),
            human_bytes(g("vrdma_tenant_bytes_sent_total")),
            g("vrdma_tenant_messages_received_total"),
            human_bytes(g("vrdma_tenant_bytes_received_total")),
            g("vrdma_tenant_completion_errors_total"),
            g("vrdma_tenant_engine_seconds_total"),
            g("vrdma_tenant_throttled_seconds_total"),
            g("vrdma_tenant_link_throttled_seconds_total"),
            mean
        );
    }
    if tenants.is_empty() {
        out.push_str("(no tenant yet)\n");
    }
    // Per link: name (with its reason, if any: `name:reason`) -> value.
    let mut links: BTreeMap<(String, String), BTreeMap<String, f64>> = BTreeMap::new();
    for (n, l, v) in &all {
        if let (Some(id), Some(peer)) = (label(l, "link"), label(l, "peer")) {
            let key = match label(l, "reason") {
                Some(r) => format!("{n}:{r}"),
                None => n.to_string(),
            };
            links.entry((id, peer)).or_default().insert(key, *v);
        }
    }
    for ((id, peer), m) in &links {
        let g = |k: &str| m.get(k).copied().unwrap_or(0.0);
        let rtt = m.get("vrdma_link_rtt_seconds").map_or("-".to_string(), |r| format!("{:.0} us", r * 1e6));
        let _ = writeln!(
            out,
            "link {id} ({peer}): {}, out {} frames / {}, in {} frames / {}, dropped {}, retransmissions {}, rtt {rtt}",
            if g("vrdma_link_up") > 0.0 { "UP" } else { "DOWN" },
            g("vrdma_link_frames_sent_total"),
            human_bytes(g("vrdma_link_bytes_sent_total")),
            g("vrdma_link_frames_received_total"),
            human_bytes(g("vrdma_link_bytes_received_total")),
            g("vrdma_link_frames_dropped_total"),
            g("vrdma_link_retransmissions_total"),
        );
        let _ = writeln!(
            out,
            "link {id} held back: rate limits {:.3} s, latency-class queue cap {:.3} s, {} frames / {} cut for the latency class",
            g("vrdma_link_throttled_seconds_total:rate_limit"),
            g("vrdma_link_throttled_seconds_total:queue_cap"),
            g("vrdma_link_cut_frames_total"),
            human_bytes(g("vrdma_link_cut_bytes_total")),
        );
    }
    for (n, l, v) in &all {
        if *v > 0.0 && (*n == "vrdma_limited_inputs_total" || *n == "vrdma_admission_refused_total") {
            let what = label(l, "message").or_else(|| label(l, "reason")).unwrap_or_default();
            let _ = writeln!(out, "refused or limited: {v:.0} x {what}");
        }
    }
    out
}

#[cfg(test)]
mod metrics_tests {
    use super::*;

    #[test]
    fn the_exposition_is_shown_as_a_table_per_tenant() {
        let text = "# HELP vrdma_engine_passes_total x\n# TYPE vrdma_engine_passes_total counter\n\
                    vrdma_engine_passes_total 12\n\
                    vrdma_tenant_messages_sent_total{tenant=\"uid:1000\"} 5\n\
                    vrdma_tenant_bytes_sent_total{tenant=\"uid:1000\"} 2048\n\
                    vrdma_tenant_message_latency_seconds_bucket{tenant=\"uid:1000\",le=\"+Inf\"} 5\n\
                    vrdma_tenant_message_latency_seconds_sum{tenant=\"uid:1000\"} 0.00001\n\
                    vrdma_tenant_message_latency_seconds_count{tenant=\"uid:1000\"} 5\n\
                    vrdma_limited_inputs_total{message=\"a \\\"quoted\\\" line\"} 3\n\
                    vrdma_link_up{link=\"1\",peer=\"::1\"} 1\n\
                    vrdma_link_throttled_seconds_total{link=\"1\",peer=\"::1\",reason=\"rate_limit\"} 0.25\n\
                    vrdma_link_throttled_seconds_total{link=\"1\",peer=\"::1\",reason=\"queue_cap\"} 0.5\n\
                    vrdma_link_cut_frames_total{link=\"1\",peer=\"::1\"} 4\n";
        let out = render_metrics(text);
        assert!(out.contains("12 passes"), "{out}");
        let row = out.lines().find(|l| l.starts_with("uid:1000")).expect("a row for the tenant");
        assert!(row.contains(" 5 ") && row.contains("2.0 KiB") && row.contains("2.0 us"), "{row}");
        assert!(out.contains("3 x a \"quoted\" line"), "{out}");
        assert!(
            out.contains("link 1 held back: rate limits 0.250 s, latency-class queue cap 0.500 s, 4 frames"),
            "{out}"
        );
    }
}
