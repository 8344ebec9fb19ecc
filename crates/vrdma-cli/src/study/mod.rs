//! `vrdma study`: the multi-tenant measurement study as one command.
//!
//! The matrix: four placements ([`plan::Placement`]: processes on one
//! host, containers (network namespaces) on one host, two hosts joined by
//! veth with a daemon each, QEMU VMs of one daemon ([`vm`])), two protocols (TCP and vRDMA), one transfer
//! or four tenants transferring at once. Each cell moves `--bytes` bytes
//! `--runs` times with `vrdma bench` server/client processes (as tenants
//! of their own uids when root); the qperf-style latency and bandwidth
//! set runs per placement, and the anchors (qperf, iperf3, perftest
//! through the drop-in library) run beside them where installed. The
//! report ([`report`]) goes to `--out`: Markdown, HTML, CSV, JSON and
//! charts.
//!
//! Every process the study starts is owned by a guard that kills it by
//! pid, every namespace by one that deletes it, and SIGINT/SIGTERM stop
//! the study between steps so that the guards run.

mod anchors;
mod data;
mod netns;
pub(crate) mod placement;
mod plan;
pub(crate) mod proc;
mod progress;
mod protect;
mod report;
mod run;
pub(crate) mod vm;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;

pub use plan::Placement;

#[derive(clap::Args, Debug, Clone)]
#[command(after_help = AFTER_HELP)]
pub struct Args {
    /// Output directory [default: ./vrdma-study-<timestamp>]; created, and must be empty if it exists.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Bytes each transfer cell moves per run (K, M, G suffixes; binary) [default: 1G, or 32M with --quick].
    #[arg(long, value_parser = plan::parse_bytes)]
    pub bytes: Option<u64>,
    /// Runs of every cell and test [default: 10, or 2 with --quick].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub runs: Option<u32>,
    /// Message size of the transfers (K, M suffixes) [default: 64K].
    #[arg(long, value_parser = plan::parse_message_size)]
    pub message_size: Option<u64>,
    /// Seconds each test of the latency and bandwidth set runs [default: 1, or 0.2 with --quick].
    #[arg(long, value_parser = plan::parse_seconds)]
    pub time: Option<Duration>,
    /// Placements to run, comma-separated: process, container, hosts, vm [default: all that can run].
    #[arg(long, value_delimiter = ',', value_enum)]
    pub placements: Vec<Placement>,
    /// Leave out the anchors (qperf, iperf3, perftest).
    #[arg(long)]
    pub no_anchors: bool,
    /// A short study for CI: 32 MiB per cell, 2 runs, 0.2 s tests, shorter anchors (a minute, about 2 more with the vm placement under TCG).
    #[arg(long)]
    pub quick: bool,
}

const AFTER_HELP: &str = "\
Placements: process (two processes, one daemon), container (each tenant side in
its own network namespace, one daemon), hosts (two namespaces joined by veth, a
daemon in each, linked by the TCP transport), vm (QEMU guests of one daemon booted
once per study: a sender and a receiver VM per tenant, joined by a QEMU link of
their own; under TCG their figures are functional only). Protocols: TCP and vRDMA (RDMA
writes). Concurrency: one transfer, and four tenants (uids 61001-61004) at once.
Namespaces, other uids and VMs need root; without it the study runs what it can and
the report says what it skipped.

Examples:
  vrdma study --quick --out /tmp/study          about 3 minutes with VMs under TCG
  vrdma study                                   1 GiB per cell, 10 runs
  vrdma study --placements process,hosts --bytes 4G --runs 5";

pub fn run(socket: Option<PathBuf>, args: Args) -> Result<()> {
    if socket.is_some() {
        tracing::info!("vrdma study starts daemons of its own; --socket/VRDMA_SOCKET is not used");
    }
    let plan = match plan::Plan::from_args(&args) {
        Ok(p) => p,
        // An argument error, printed as clap prints its own (exit status 2).
        Err(msg) => clap::Error::raw(clap::error::ErrorKind::ValueValidation, format!("{msg}\n")).exit(),
    };
    run::run(plan)
}
