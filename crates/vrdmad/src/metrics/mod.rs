//! The metrics endpoint: Prometheus text on `GET /metrics`, when the
//! configuration names an address (`metrics_listen`; off by default).
//!
//! Why this shape: the engine thread owns the counters that change per
//! message (per tenant, in [`vrdma_core::hca::metrics`]; per link, in the
//! [`Hca`](vrdma_core::hca::Hca) and the link drivers) as plain integers,
//! so the data path pays no lock and no atomic for them. A scrape asks the
//! engine for a copy through its call mechanism, waiting
//! [`ENGINE_WAIT`] at most, between two passes; what other threads own
//! (the engine's pass counters, the control socket's refusals) is read
//! from atomics or under their locks. One thread serves one connection at
//! a time ([`http`]): scrapes are rare, and whoever connects is untrusted.
//!
//! Every tenant's figures and the links' totals are shown to whoever can
//! connect: TCP carries no peer credentials, so the endpoint is the
//! operator's, on an address only the operator reaches, or behind a
//! bearer token (`metrics_token_file`, [`auth`]; loopback is every local
//! user's, and user-mode QEMU guests'; see the README, "Metrics"). A
//! tenant reads its own share over the control socket, whose peer
//! credentials say who asks (`vrdma stat`, [`render_stat`]).
//! Cardinality is bounded: tenants by `max_tenants` (and the core's
//! [`MAX_TRACKED`](vrdma_core::hca::metrics::MAX_TRACKED) for those that
//! left), links by the peers, and messages of rejected inputs by the log
//! lines in the code.
//!
//! The metric list and what each means is in docs/metrics.md ("The
//! list"); the README's "Metrics" says how to turn the endpoint on.

pub mod auth;
pub mod http;
pub mod text;

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vrdma_core::hca::metrics::TenantReport;
use vrdma_core::hca::{LinkReport, TenantId};
use vrdma_core::log_limit::LogLimiter;

use crate::engine::EngineHandle;
use text::{Kind, Writer};

/// How long a scrape waits for the engine's copy of its counters.
pub const ENGINE_WAIT: Duration = Duration::from_secs(2);

/// What a scrape reads, and where.
pub(crate) struct Sources {
    pub engine: EngineHandle,
    /// The control socket's limiter and admission (refused inputs).
    pub shared: std::sync::Weak<crate::server::Shared>,
    /// The limiter of the listener for other hosts' daemons, if any.
    pub net_log: Option<Arc<Mutex<LogLimiter>>>,
}

/// A link as a scrape sees it.
#[derive(Debug, Clone)]
pub struct LinkFigures {
    pub report: LinkReport,
    pub retransmits: u64,
    pub rtt: Option<Duration>,
    /// Time the daemon's queue for the link was held at
    /// `net.max_queued_kib` while a latency-class tenant was active, in ns.
    pub queue_capped_ns: u64,
}

/// What the engine copies out for a scrape.
#[derive(Debug, Clone, Default)]
pub struct EngineFigures {
    pub tenants: Vec<TenantReport>,
    pub links: Vec<LinkFigures>,
    pub missed_wakeups: u64,
    /// Occurrences of rejected or rate-limited inputs, per log message.
    pub limited: BTreeMap<&'static str, u64>,
}

fn engine_figures(st: &mut crate::engine::EngineState) -> EngineFigures {
    let now = st.now();
    let links = st
        .hca
        .links()
        .into_iter()
        .map(|report| {
            let io = st.net.as_ref().and_then(|n| n.links.get(&report.id));
            LinkFigures {
                retransmits: st.hca.link_retransmits(report.id),
                rtt: io.and_then(|l| l.rtt),
                queue_capped_ns: io.map_or(0, |l| l.capped_ns(now)),
                report,
            }
        })
        .collect();
    let mut limited = BTreeMap::new();
    st.limited_inputs(&mut limited);
    EngineFigures {
        tenants: st.hca.tenant_reports(),
        links,
        missed_wakeups: st.hca.missed_wakeups(),
        limited,
    }
}

/// A tenant's label value: `uid:1000`, or `local:N` for a tenant a daemon
/// named for itself (a uid in another network namespace).
pub fn tenant_label(t: TenantId) -> String {
    if t.is_host_local() {
        format!("local:{}", t.0 - TenantId::HOST_LOCAL_BASE)
    } else {
        format!("uid:{}", t.0)
    }
}

/// The whole exposition.
pub(crate) fn render(src: &Sources) -> String {
    let mut w = Writer::default();
    let engine = src.engine.call_within(ENGINE_WAIT, engine_figures).ok();
    w.family("vrdma_engine_snapshot_ok", Kind::Gauge, "1 if the engine answered this scrape in time (else the engine's, tenants' and links' figures are missing)");
    w.sample_u64("vrdma_engine_snapshot_ok", &[], u64::from(engine.is_some()));
    let stats = &src.engine.stats;
    let up = stats.started.elapsed().as_secs_f64();
    let busy = stats.busy_ns.load(Ordering::Relaxed) as f64 / 1e9;
    for (name, kind, help, v) in [
        ("vrdma_engine_passes_total", Kind::Counter, "Passes the engine made over the queues and links", stats.passes.load(Ordering::Relaxed) as f64),
        ("vrdma_engine_sleeps_total", Kind::Counter, "Times the engine went to sleep on the doorbells", stats.sleeps.load(Ordering::Relaxed) as f64),
        ("vrdma_engine_busy_seconds_total", Kind::Counter, "Time in engine passes that did work", busy),
        ("vrdma_engine_uptime_seconds", Kind::Gauge, "Time since the engine started", up),
        ("vrdma_engine_busy_ratio", Kind::Gauge, "Busy time over uptime, since the engine started (rate(vrdma_engine_busy_seconds_total) gives it over a window)", if up > 0.0 { (busy / up).min(1.0) } else { 0.0 }),
    ] {
        w.family(name, kind, help);
        w.sample(name, &[], v);
    }
    if let Some(e) = &engine {
        w.family(
            "vrdma_engine_missed_wakeups_total",
            Kind::Counter,
            "QPs a sweep found with work that nothing had woken",
        );
        w.sample_u64("vrdma_engine_missed_wakeups_total", &[], e.missed_wakeups);
        tenants(&mut w, &e.tenants);
        links(&mut w, &e.links, true);
    }
    refused(&mut w, engine.as_ref(), src);
    if let Some(s) = src.shared.upgrade() {
        vms(&mut w, &s.vms);
    }
    w.finish()
}

fn tenants(w: &mut Writer, ts: &[TenantReport]) {
    let labels: Vec<String> = ts.iter().map(|t| tenant_label(t.tenant)).collect();
    type Get = fn(&TenantReport) -> f64;
    let families: [(&str, Kind, &str, Get); 13] = [
        (
            "vrdma_tenant_objects",
            Kind::Gauge,
            "Objects (PDs, MRs, CQs, QPs, SRQs, AHs) the tenant holds",
            |t| t.objects as f64,
        ),
        (
            "vrdma_tenant_registered_bytes",
            Kind::Gauge,
            "Bytes of memory regions and queue rings the tenant holds",
            |t| t.registered_bytes as f64,
        ),
        (
            "vrdma_tenant_messages_sent_total",
            Kind::Counter,
            "Send work requests of the tenant that completed successfully",
            |t| t.counters.messages_sent as f64,
        ),
        ("vrdma_tenant_bytes_sent_total", Kind::Counter, "Message bytes of those work requests", |t| {
            t.counters.bytes_sent as f64
        }),
        (
            "vrdma_tenant_messages_received_total",
            Kind::Counter,
            "Receive work requests of the tenant that completed successfully",
            |t| t.counters.messages_received as f64,
        ),
        (
            "vrdma_tenant_bytes_received_total",
            Kind::Counter,
            "Bytes received into those work requests",
            |t| t.counters.bytes_received as f64,
        ),
        (
            "vrdma_tenant_completion_errors_total",
            Kind::Counter,
            "Completions written to the tenant with an error status (flushes included)",
            |t| t.counters.completions_error as f64,
        ),
        (
            "vrdma_tenant_engine_turns_total",
            Kind::Counter,
            "Turns the tenant's QPs had in engine passes",
            |t| t.counters.turns as f64,
        ),
        (
            "vrdma_tenant_engine_seconds_total",
            Kind::Counter,
            "Engine time spent in the tenant's turns",
            |t| t.counters.engine_ns as f64 / 1e9,
        ),
        (
            "vrdma_tenant_throttled_seconds_total",
            Kind::Counter,
            "Time the tenant had work pending after its share of a pass was spent (or its rate limit held it back), until its next share",
            |t| t.counters.throttled_ns as f64 / 1e9,
        ),
        (
            "vrdma_tenant_rate_limited_total",
            Kind::Counter,
            "Shares of engine passes that the tenant's rate limit ended or passed over with work pending",
            |t| t.counters.throttled_shares as f64,
        ),
        (
            "vrdma_tenant_link_throttled_seconds_total",
            Kind::Counter,
            "Time the tenant's requests on links to other hosts waited for its rate limit while its QPs there had frames to send, summed over the links",
            |t| t.counters.link_throttled_ns as f64 / 1e9,
        ),
        (
            "vrdma_tenant_missed_wakeups_total",
            Kind::Counter,
            "Turns of the tenant's QPs in which a sweep found work that nothing had woken",
            |t| t.counters.missed_wakeups as f64,
        ),
    ];
    for (name, kind, help, get) in families {
        w.family(name, kind, help);
        for (t, l) in ts.iter().zip(&labels) {
            let v = get(t);
            w.sample(name, &[("tenant", l)], v);
        }
    }
    let name = "vrdma_tenant_message_latency_seconds";
    w.family(name, Kind::Histogram, "Time from the engine taking a send work request to writing its completion (per turn: see the README)");
    for (t, l) in ts.iter().zip(&labels) {
        w.histogram_ns(name, &[("tenant", l)], &t.counters.latency);
    }
}

/// Families of a link that `vrdma stat` does not carry (the endpoint's
/// only, see [`render_stat`]): what they count is every tenant's
/// together, and kept by the link drivers.
const ENDPOINT_LINK_FAMILIES: [&str; 2] = ["vrdma_link_retransmissions_total", "vrdma_link_rtt_seconds"];

/// A caller's `vrdma stat` (its own tenant's figures; the links as the
/// daemon showed them to it: a tenant's own traffic, or the operator's
/// totals) in the exposition's format, with the endpoint's names and
/// labels: what `vrdma stat --prometheus` prints without `--metrics`.
/// Without the link families that only the endpoint has (retransmissions,
/// round trips, the links' held time): a tenant may not see them, and the
/// operator reads them there. The daemon's missed wake-ups only for the
/// operator; a tenant's own are in its tenant series.
pub fn render_stat(s: &vrdma_core::hca::StatReport) -> String {
    let mut w = Writer::default();
    if let Some(t) = s.tenant.as_deref() {
        tenants(&mut w, std::slice::from_ref(t));
    }
    if s.totals {
        let name = "vrdma_engine_missed_wakeups_total";
        w.family(name, Kind::Counter, "QPs a sweep found with work that nothing had woken");
        w.sample_u64(name, &[], s.missed_wakeups);
    }
    let ls: Vec<LinkFigures> = s
        .links
        .iter()
        .map(|&report| LinkFigures { report, retransmits: 0, rtt: None, queue_capped_ns: 0 })
        .collect();
    links(&mut w, &ls, false);
    w.finish()
}

/// The links' families (`all`: the endpoint-only ones too, see
/// [`ENDPOINT_LINK_FAMILIES`]).
fn links(w: &mut Writer, ls: &[LinkFigures], all: bool) {
    let ids: Vec<(String, String)> =
        ls.iter().map(|l| (l.report.id.0.to_string(), l.report.info.gid.to_string())).collect();
    type Get = fn(&LinkFigures) -> Option<f64>;
    let families: [(&str, Kind, &str, Get); 11] = [
        ("vrdma_link_up", Kind::Gauge, "1 while the link to the peer daemon is up", |l| {
            Some(u8::from(l.report.up) as f64)
        }),
        ("vrdma_link_qps", Kind::Gauge, "QPs that send on the link", |l| Some(l.report.qps as f64)),
        ("vrdma_link_frames_sent_total", Kind::Counter, "Data frames sent on the link", |l| {
            Some(l.report.stats.frames_out as f64)
        }),
        ("vrdma_link_bytes_sent_total", Kind::Counter, "Payload bytes sent on the link", |l| {
            Some(l.report.stats.payload_out as f64)
        }),
        ("vrdma_link_frames_received_total", Kind::Counter, "Data frames received on the link", |l| {
            Some(l.report.stats.frames_in as f64)
        }),
        ("vrdma_link_bytes_received_total", Kind::Counter, "Payload bytes received on the link", |l| {
            Some(l.report.stats.payload_in as f64)
        }),
        (
            "vrdma_link_frames_dropped_total",
            Kind::Counter,
            "Frames received and discarded (no such QP, out of sequence, refused)",
            |l| Some(l.report.stats.dropped_in as f64),
        ),
        (
            "vrdma_link_retransmissions_total",
            Kind::Counter,
            "Times a QP sent its unanswered requests again (timer expired or sequence NAK)",
            |l| Some(l.retransmits as f64),
        ),
        (
            "vrdma_link_rtt_seconds",
            Kind::Gauge,
            "Round trip of the last keepalive probe answered (absent until one is)",
            |l| l.rtt.map(|d| d.as_secs_f64()),
        ),
        (
            "vrdma_link_cut_frames_total",
            Kind::Counter,
            "Request frames of tenants not of the latency class cut to a quarter chunk while a latency-class tenant was active on the link",
            |l| Some(l.report.stats.throttle.cut_frames as f64),
        ),
        (
            "vrdma_link_cut_bytes_total",
            Kind::Counter,
            "Payload bytes of those cut frames",
            |l| Some(l.report.stats.throttle.cut_bytes as f64),
        ),
    ];
    for (name, kind, help, get) in families {
        if !all && ENDPOINT_LINK_FAMILIES.contains(&name) {
            continue;
        }
        w.family(name, kind, help);
        for (l, (id, peer)) in ls.iter().zip(&ids) {
            if let Some(v) = get(l) {
                w.sample(name, &[("link", id), ("peer", peer)], v);
            }
        }
    }
    if !all {
        return;
    }
    let name = "vrdma_link_throttled_seconds_total";
    w.family(
        name,
        Kind::Counter,
        "Time the link's scheduler held frames back: reason rate_limit, while at least one tenant's requests waited for its rate limit with frames to send; reason queue_cap, while the daemon's queue for the link was held at net.max_queued_kib for a latency-class tenant",
    );
    for (l, (id, peer)) in ls.iter().zip(&ids) {
        for (reason, ns) in
            [("rate_limit", l.report.stats.throttle.rate_limited_ns), ("queue_cap", l.queue_capped_ns)]
        {
            w.sample(name, &[("link", id), ("peer", peer), ("reason", reason)], ns as f64 / 1e9);
        }
    }
}

/// The configured VMs: their ports and sessions now, and how much of
/// each one's region its rings and registered memory hold.
fn vms(w: &mut Writer, vms: &BTreeMap<String, Arc<crate::vm::Vm>>) {
    if vms.is_empty() {
        return;
    }
    type Get = fn(&crate::vm::Vm) -> u64;
    let families: [(&str, &str, Get); 4] = [
        ("vrdma_vm_ports_connected", "The VM's ports QEMU holds connected now", |v| {
            u64::from(v.connected.load(Ordering::Relaxed))
        }),
        ("vrdma_vm_sessions", "Guest processes holding a context through the VM's ports now", |v| {
            u64::from(v.sessions.load(Ordering::Relaxed))
        }),
        ("vrdma_vm_region_bytes", "The size of the VM's shared region (memory_mib)", |v| v.region_len),
        (
            "vrdma_vm_region_used_bytes",
            "Bytes of the VM's region its rings and registered memory hold now",
            |v| {
                let e = v.extents();
                e.len() - e.free_bytes()
            },
        ),
    ];
    for (name, help, get) in families {
        w.family(name, Kind::Gauge, help);
        for (vm_name, vm) in vms {
            let tenant = tenant_label(TenantId(vm.config.tenant));
            w.sample_u64(name, &[("vm", vm_name), ("tenant", &tenant)], get(vm));
        }
    }
}

fn refused(w: &mut Writer, engine: Option<&EngineFigures>, src: &Sources) {
    let mut limited: BTreeMap<&'static str, u64> = engine.map(|e| e.limited.clone()).unwrap_or_default();
    let shared = src.shared.upgrade();
    let mut add = |l: &LogLimiter| {
        for (m, n) in l.occurred() {
            *limited.entry(*m).or_default() += n;
        }
    };
    if let Some(s) = &shared {
        add(&crate::logs::lock(&s.log));
    }
    if let Some(l) = &src.net_log {
        add(&crate::logs::lock(l));
    }
    if let Some(s) = &shared {
        s.tenancy.limited_inputs(&mut limited);
    }
    let name = "vrdma_limited_inputs_total";
    w.family(name, Kind::Counter, "Rejected or rate-limited inputs (tenants', peers', strangers'), by the log line that reports them (each counted, logged or not)");
    for (m, n) in &limited {
        w.sample_u64(name, &[("message", m)], *n);
    }
    if let Some(s) = &shared {
        let name = "vrdma_admission_refused_total";
        w.family(name, Kind::Counter, "Contexts or completion channels refused: max_tenants reached, or the tenant's share of descriptors");
        w.sample_u64(name, &[("reason", "max_tenants")], s.admission.refused_full.load(Ordering::Relaxed));
        w.sample_u64(
            name,
            &[("reason", "descriptors")],
            s.admission.refused_descriptors.load(Ordering::Relaxed),
        );
    }
}

/// The endpoint's thread. Dropping it stops the thread.
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl MetricsServer {
    /// Serves `src` on `addr`; with `token`, a scrape must carry it.
    pub(crate) fn start(
        addr: SocketAddr,
        token: Option<String>,
        src: Sources,
    ) -> std::io::Result<MetricsServer> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new().name("vrdma-metrics".into()).spawn({
            let token = token.clone();
            move || http::serve(listener, &s, token.as_deref(), &|| render(&src))
        })?;
        tracing::info!(%addr, token = token.is_some(), "serving metrics on http://{addr}/metrics");
        Ok(MetricsServer { addr, stop, thread: Some(thread) })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
