//! `vrdma bench`: vRDMA's latency and bandwidth.
//!
//! Without test names it prints the default report ([`suite`]): a fixed
//! set of figures beside their anchors, and perftest and qperf through the
//! drop-in library. With test names it is a qperf-style tool: the named
//! tests ([`spec::TestName`]) between a client and a server, across hosts
//! (`vrdma bench --server`, then `vrdma bench HOST TEST...`) or locally
//! (`vrdma bench TEST...` starts its own server process).

pub mod anchors;
pub(crate) mod attack;
mod client;
pub mod cm_setup;
pub(crate) mod cmtime;
pub(crate) mod cmtime_table;
mod control;
mod direct_bw;
mod idle;
mod migrate;
mod mpi;
mod output;
mod path;
mod qos;
mod reaped;
mod report;
mod server;
mod sockets;
mod sockets_apps;
mod sockets_pg;
mod spec;
mod suite;
mod traffic;
mod ucx;
mod verbs;
mod vm;
mod worker;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;

pub use suite::Figure;
pub use worker::Role;

/// The size and time parsers, shared with `vrdma study`.
pub(crate) use spec::{parse_seconds, parse_size};
use spec::{Limit, Target};

#[derive(clap::Args, Debug, Clone)]
#[command(after_help = AFTER_HELP)]
pub struct Args {
    /// Named tests, after the host of a `vrdma bench --server` (HOST or
    /// HOST:PORT); without a host both sides run here. Without tests: the
    /// default report with anchors.
    #[arg(value_name = "[HOST] TEST", value_parser = spec::parse_target)]
    pub targets: Vec<Target>,
    /// Serve the named tests to clients until interrupted.
    #[arg(long, conflicts_with_all = ["targets", "quick", "runs", "json", "csv"])]
    pub server: bool,
    /// The address the server listens on.
    #[arg(long, value_name = "ADDR:PORT", default_value = "0.0.0.0:19765", requires = "server")]
    pub listen: SocketAddr,
    /// Internal: serve one client, then exit (the local mode's server).
    #[arg(long, hide = true, requires = "server")]
    pub once: bool,
    /// Message size in bytes (K and M suffixes) [default: 8 for latency,
    /// 64K for bandwidth, 4K for ud_bw].
    #[arg(long, value_parser = spec::parse_size, conflicts_with_all = ["sizes", "sweep"])]
    pub size: Option<usize>,
    /// Several message sizes, comma-separated: --sizes 8,64,4K.
    #[arg(long, value_parser = spec::parse_size, value_delimiter = ',', conflicts_with = "sweep")]
    pub sizes: Vec<usize>,
    /// Sweep message sizes over powers of two from 1 B up to MAX (--sweep=1M) [default MAX: 64K].
    #[arg(long, value_name = "MAX", num_args = 0..=1, require_equals = true, default_missing_value = "64K", value_parser = spec::parse_size)]
    pub sweep: Option<usize>,
    /// QPs per stream (the stream's messages take turns on them).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=control::MAX_QPS as i64))]
    pub qps: Option<u32>,
    /// Concurrent streams, each a thread with its own QPs (or TCP connection) on both sides.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=control::MAX_STREAMS as i64))]
    pub streams: Option<u32>,
    /// Wait for completions on a completion channel instead of polling the CQ.
    #[arg(long)]
    pub events: bool,
    /// Seconds each test runs [default: 2, or 0.5 with --quick].
    #[arg(long, value_parser = spec::parse_seconds, conflicts_with = "iters")]
    pub time: Option<Duration>,
    /// Messages (or round trips) per stream instead of a duration.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1_000_000_000))]
    pub iters: Option<u64>,
    /// Print the named tests' results as CSV.
    #[arg(long, conflicts_with = "json")]
    pub csv: bool,
    /// A short run (one run per figure, fewer iterations), for CI.
    #[arg(long)]
    pub quick: bool,
    /// Runs per figure of the default report; the median is reported [default: 3, or 1 with --quick].
    #[arg(long)]
    pub runs: Option<usize>,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Of the default report, only the rdma_cm connection setup figures
    /// (beside TCP connect/accept, measured in the same runs), and
    /// rdma-core's `cmtime` through the drop-in librdmacm (`-c 1` and `-c
    /// 100`, 20 with --quick) beside TCP connect/accept in cmtime's phases,
    /// where cmtime is installed.
    #[arg(long, conflicts_with = "server")]
    pub cm_setup: bool,
    /// Of the default report, only the direct path's figures
    /// (docs/direct-path.md), on a daemon with the direct path on and one
    /// with it off, each row proved to have measured the path it names:
    /// the 8 B RDMA write, send, read and fetch-and-add latencies beside the
    /// shared-memory ping-pong and UCX posix tag_lat; 64 KiB and 1 MiB
    /// write and send bandwidth beside memcpy and UCX posix put/tag
    /// bandwidth; an Open MPI 8 B ping-pong over UCX over vRDMA beside Open
    /// MPI over vader (when mpicc and mpirun are installed). All measured
    /// in the same run.
    #[arg(long, conflicts_with_all = ["server", "cm_setup"])]
    pub direct: bool,
    /// Of `--direct`, only the bandwidth rows (64 KiB and 1 MiB write and
    /// send on both paths beside memcpy and UCX posix): a shorter run when
    /// working on the copy path.
    #[arg(long, conflicts_with_all = ["server", "cm_setup", "direct"])]
    pub direct_bw: bool,
    /// Of `--direct`, only the 8 B latency rows (write, send polling and on
    /// a completion channel, write with immediate, read, fetch-and-add, the
    /// send beside idle QPs; both paths) beside the shared-memory ping-pong
    /// and UCX posix tag_lat: a shorter run when working on the latency
    /// path.
    #[arg(long, conflicts_with_all = ["server", "cm_setup", "direct", "direct_bw"])]
    pub direct_lat: bool,
    /// Of the default report, only the tenant QoS figures: fairness of
    /// four equal tenants, shares by weight, a rate limit's error, and an
    /// 8 B latency beside a 64-QP hog with and without
    /// `latency_class = "latency"` (needs root: tenants are uids).
    #[arg(long, conflicts_with_all = ["server", "cm_setup", "direct"])]
    pub qos: bool,
    /// Of the default report, only the 8 B send latency beside a tenant
    /// that misbehaves (issue 21 item 1: an overflowed, flooded or
    /// scribbled posted-QP ring; a 64-QP and a 1-QP hog), each read
    /// against unloaded runs taken between the attacked ones (needs root:
    /// the attacker is another uid).
    #[arg(long, conflicts_with_all = ["server", "cm_setup", "direct", "qos"])]
    pub attacks: bool,
    /// Of the default report, only the VM figures: 8 B RDMA write latency
    /// and 1 MiB RDMA write bandwidth between two QEMU guests of one
    /// daemon, beside two host processes on the same daemon in the same
    /// run, the accelerator named (needs qemu-system-x86 and
    /// busybox-static; two guests boot in about 30 s under TCG).
    #[arg(long, conflicts_with_all = ["server", "cm_setup", "direct", "qos", "attacks"])]
    pub vm: bool,
    /// Of the default report, only the VM migration figures (issue 19): a
    /// QEMU guest live-migrated between two daemons of this run `--runs`
    /// times without vRDMA traffic (QEMU's own downtime: the anchor) and
    /// as many while it streams to a third daemon, with the operator's
    /// daemon step: QEMU's downtime, the time the step adds before `cont`,
    /// the peer's pause and throughput dip, each beside the anchor, the
    /// accelerator named (needs qemu-system-x86, busybox-static, cc and
    /// the verbs headers; under TCG about 10 s a hop).
    #[arg(long, conflicts_with_all = ["server", "cm_setup", "direct", "qos", "attacks", "vm"])]
    pub migrate: bool,
    /// Of the default report, only the sockets figures: an unmodified
    /// std::net request/response pair and a streaming pair under the
    /// sockets preload library (docs/sockets.md), direct path off and on,
    /// beside the same programs over plain TCP in the same run.
    #[arg(long, conflicts_with_all = ["server", "cm_setup", "direct", "qos", "attacks", "vm", "migrate"])]
    pub sockets: bool,
    /// Run the embedded daemon's engine at real-time priority (needs root or CAP_SYS_NICE).
    #[arg(long)]
    pub realtime: bool,
    /// Let the embedded daemon's engine busy-poll instead of sleeping when idle.
    #[arg(long)]
    pub busy_poll: bool,
    /// How long the embedded daemon's engine spins after its last work before sleeping, in µs.
    #[arg(long)]
    pub spin_us: Option<u64>,
    /// Then how long it polls with a yield between polls before sleeping, in µs.
    #[arg(long)]
    pub yield_us: Option<u64>,
    /// Internal: run as one side of a test of the default report.
    #[arg(long, hide = true, value_enum)]
    pub worker: Option<Role>,
    #[arg(long, hide = true, default_value = "write-lat")]
    pub worker_test: worker::Test,
    #[arg(long, hide = true, default_value_t = 8)]
    pub worker_size: usize,
    #[arg(long, hide = true, default_value_t = 1000)]
    pub worker_iters: u64,
    /// Internal: idle QPs (each connected to itself) on the worker's CQ.
    #[arg(long, hide = true, default_value_t = 0)]
    pub worker_idle_qps: u32,
    /// Internal: run as one of the plain std::net programs of `--sockets`.
    #[arg(long, hide = true, value_enum)]
    pub sock_app: Option<sockets::App>,
    #[arg(long, hide = true, default_value_t = 0)]
    pub sock_port: u16,
    #[arg(long, hide = true, default_value_t = 0)]
    pub sock_n: u64,
}

const AFTER_HELP: &str = "\
Tests: rc_bw rc_bi_bw rc_lat rc_rdma_read_bw rc_rdma_read_lat rc_rdma_write_bw
rc_rdma_write_lat rc_compare_swap_mr rc_fetch_add_mr ud_bw ud_lat tcp_bw tcp_lat

Examples:
  vrdma bench                                  the default report with anchors
  vrdma bench --cm-setup --runs 5              only its rdma_cm connection setup figures
  vrdma bench --sockets --runs 5               only the sockets preload's figures beside plain TCP
  vrdma bench --migrate --runs 3               a VM's migration downtime with and without vRDMA traffic
  vrdma bench rc_lat rc_bw tcp_lat tcp_bw      named tests, both sides on this host
  vrdma bench --server                         serve clients on port 19765
  vrdma bench host2 rc_bw --sweep=1M --csv     against the server on host2
  vrdma bench rc_bw --qps 4 --streams 2 --time 5
  vrdma bench rc_lat --events --iters 10000";

impl Args {
    fn tests(&self) -> Vec<spec::TestName> {
        self.targets.iter().filter_map(|t| if let Target::Test(t) = t { Some(*t) } else { None }).collect()
    }

    fn host(&self) -> Option<&str> {
        self.targets.iter().find_map(|t| if let Target::Host(h) = t { Some(h.as_str()) } else { None })
    }

    /// What clap cannot check: the positional arguments' order, and
    /// options that only mean something with test names.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let hosts = self.targets.iter().filter(|t| matches!(t, Target::Host(_))).count();
        if hosts > 1 || (hosts == 1 && !matches!(self.targets.first(), Some(Target::Host(_)))) {
            let extra = self.targets.iter().skip(1).find_map(|t| match t {
                Target::Host(h) => Some(h.clone()),
                _ => None,
            });
            return Err(format!(
                "unknown test '{}'; the tests are: {} (a host comes first, once)",
                extra.unwrap_or_default(),
                spec::test_names()
            ));
        }
        if let Some(h) = self.host() {
            spec::split_host(h)?;
            if self.tests().is_empty() {
                return Err(format!("name at least one test after the host, e.g. vrdma bench {h} rc_lat"));
            }
        }
        let named = !self.tests().is_empty();
        if !named && !self.server && self.worker.is_none() {
            let used = [
                ("--size", self.size.is_some()),
                ("--sizes", !self.sizes.is_empty()),
                ("--sweep", self.sweep.is_some()),
                ("--qps", self.qps.is_some()),
                ("--streams", self.streams.is_some()),
                ("--events", self.events),
                ("--time", self.time.is_some()),
                ("--iters", self.iters.is_some()),
                ("--csv", self.csv),
            ];
            if let Some((name, _)) = used.iter().find(|(_, on)| *on) {
                return Err(format!("{name} applies to named tests, e.g. vrdma bench rc_bw {name} ..."));
            }
        }
        if named && (self.cm_setup || self.qos || self.vm || self.sockets || self.migrate) {
            let flag = if self.qos {
                "--qos"
            } else if self.vm {
                "--vm"
            } else if self.migrate {
                "--migrate"
            } else if self.sockets {
                "--sockets"
            } else {
                "--cm-setup"
            };
            return Err(format!(
                "{flag} selects part of the default report (vrdma bench without test names)"
            ));
        }
        if named && self.runs.is_some() {
            return Err("--runs applies to the default report (vrdma bench without test names)".into());
        }
        if self.server
            && (self.size.is_some() || self.qps.is_some() || self.time.is_some() || self.iters.is_some())
        {
            return Err("the client chooses the tests and their options; --server takes only --listen".into());
        }
        for t in self.tests() {
            for size in spec::sizes_for(t, &self.asked_sizes(), self.sweep.is_some())? {
                control::check_limits(t, size, self.qps.unwrap_or(1), self.streams.unwrap_or(1))?;
            }
        }
        Ok(())
    }

    fn asked_sizes(&self) -> Vec<usize> {
        match (self.size, self.sweep) {
            (Some(s), _) => vec![s],
            (_, Some(max)) => spec::sweep(max),
            _ => self.sizes.clone(),
        }
    }
}

pub(crate) fn engine_config(args: &Args) -> vrdmad::EngineConfig {
    let mut engine =
        vrdmad::EngineConfig { realtime: args.realtime, busy_poll: args.busy_poll, ..Default::default() };
    if let Some(s) = args.spin_us {
        engine.spin_us = s;
    }
    if let Some(y) = args.yield_us {
        engine.yield_us = y;
    }
    engine
}

pub fn run(socket: Option<PathBuf>, args: Args) -> Result<()> {
    if let Some(role) = args.sock_app {
        return sockets::app(role, args.sock_port, args.sock_n);
    }
    if let Some(role) = args.worker {
        return worker::run(
            role,
            args.worker_test,
            args.worker_size,
            args.worker_iters,
            args.worker_idle_qps,
        );
    }
    if args.server {
        if let Some(cfg) = crate::embedded::guest(socket.as_deref())? {
            return server::serve(args.listen, args.once, crate::embedded::Opener::Guest(cfg));
        }
        let device = crate::embedded::device(socket, engine_config(&args))?;
        return server::serve(
            args.listen,
            args.once,
            crate::embedded::Opener::Socket(device.socket().to_owned()),
        );
    }
    if args.tests().is_empty() {
        return suite::run(socket, &args);
    }
    named(socket, &args)
}

/// The named tests, against a remote server or a local one.
fn named(socket: Option<PathBuf>, args: &Args) -> Result<()> {
    let mut plan = Vec::new();
    for t in args.tests() {
        for size in
            spec::sizes_for(t, &args.asked_sizes(), args.sweep.is_some()).map_err(anyhow::Error::msg)?
        {
            plan.push((t, size));
        }
    }
    let limit = match (args.iters, args.time) {
        (Some(n), _) => Limit::Iters(n),
        (_, Some(d)) => Limit::Time(d),
        _ => Limit::Time(Duration::from_millis(if args.quick { 500 } else { 2000 })),
    };
    let options = client::Options {
        qps: args.qps.unwrap_or(1),
        streams: args.streams.unwrap_or(1),
        events: args.events,
        limit,
    };
    let format = match (args.json, args.csv) {
        (true, _) => output::Format::Json,
        (_, true) => output::Format::Csv,
        _ => output::Format::Table,
    };
    // Reach the server first: a wrong host fails before anything starts.
    let remote = match args.host() {
        Some(h) => {
            let (host, port) = spec::split_host(h).map_err(anyhow::Error::msg)?;
            Some((client::connect(&host, port)?, format!("server {host}:{port}")))
        }
        None => None,
    };
    // In a guest, the VM's ports; else a daemon (started here if none runs).
    let (device, opener) = match crate::embedded::guest(socket.as_deref())? {
        Some(cfg) => (None, crate::embedded::Opener::Guest(cfg)),
        None => {
            let d = crate::embedded::device(socket, engine_config(args))?;
            let o = crate::embedded::Opener::Socket(d.socket().to_owned());
            (Some(d), o)
        }
    };
    let ctx = opener.open()?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let progress = format == output::Format::Table;
    let (rows, peer) = match remote {
        Some((conn, peer)) => (client::run(conn, &ctx, &plan, &options, progress)?, peer),
        None => {
            let server = client::ServerProc::spawn(device.as_ref().map(|d| d.socket()))?;
            let conn = client::connect(&server.addr.ip().to_string(), server.addr.port())?;
            let rows = client::run(conn, &ctx, &plan, &options, progress)?;
            drop(server);
            (rows, "a local server process".to_string())
        }
    };
    let header = format!("vrdma bench against {peer} ({cores} cores here)");
    print!("{}", output::render(&rows, format, &header)?);
    Ok(())
}
