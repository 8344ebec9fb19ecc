//! `vrdma`: the one command of vRDMA.

mod bench;
mod cmd;
mod cp;
mod embedded;
mod study;
mod tool_output;

use anyhow::Result;
use clap::{CommandFactory, Parser, Subcommand};

#[derive(Parser)]
#[command(name = "vrdma", version, about = "A paravirtual RDMA device in user space")]
struct Cli {
    /// The daemon's control socket [default: $VRDMA_SOCKET, else under $XDG_RUNTIME_DIR or /run/vrdma]
    #[arg(long, global = true, env = "VRDMA_SOCKET")]
    socket: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon (the software HCA) in the foreground.
    Daemon(cmd::daemon::Args),
    /// Show the device, its port and limits, like `ibv_devinfo -v`.
    Devinfo(cmd::devinfo::Args),
    /// Show the links to other hosts and the path each of your QPs takes.
    Stat(cmd::stat::Args),
    /// Measure vRDMA: the default report beside its anchors, or qperf-style named tests.
    Bench(bench::Args),
    /// Copy a file to another tenant or host over vRDMA (RDMA writes with immediate, credit flow control).
    Cp(cp::Args),
    /// Measure vRDMA between two hosts (network namespaces on a veth pair) beside iperf3 and TCP ping-pong.
    BenchHosts(cmd::hostbench::Args),
    /// The multi-tenant measurement study: placements x protocols x tenants, a report with tables and charts.
    Study(study::Args),
    /// Run an unmodified verbs or rdma_cm program (ibv_rc_pingpong, rping, ...) on vRDMA through its libibverbs.so.1 and librdmacm.so.1.
    Run(cmd::run::Args),
    /// QEMU guests on vRDMA: run QEMU attached to a configured VM, print its arguments, build a guest image.
    #[command(subcommand)]
    Vm(cmd::vm::Command),
    /// Live migration of a tenant's device state (operator only): pause, export, import, resume, finish, or move.
    #[command(subcommand)]
    Migrate(cmd::migrate::Command),
    /// A busy-polling TCP ping-pong (bench-hosts' reference anchor).
    #[command(hide = true)]
    TcpPingpong(cmd::hostbench::pingpong::Args),
    /// rdma_cm connection setup between two processes beside TCP connect + accept (bench-hosts' figure).
    #[command(hide = true)]
    CmSetup(cmd::hostbench::cm_setup::Args),
    /// TCP in cmtime's phases between two processes (bench-hosts' cmtime anchor).
    #[command(hide = true)]
    TcpPhases(cmd::hostbench::tcp_phases::Args),
    /// A tenant that breaks the shared-memory protocol on purpose (`vrdma bench`'s other tenant).
    #[command(hide = true)]
    Misbehave(bench::attack::Args),
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("VRDMA_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Daemon(a) => cmd::daemon::run(cli.socket, a),
        Command::Devinfo(a) => cmd::devinfo::run(cli.socket, a),
        Command::Stat(a) => cmd::stat::run(cli.socket, a),
        Command::Cp(a) => cp::run(cli.socket, a),
        Command::BenchHosts(a) => cmd::hostbench::run(a),
        Command::Bench(a) => {
            if let Err(msg) = a.validate() {
                let mut cmd = Cli::command();
                cmd.build();
                let mut bench = cmd.find_subcommand_mut("bench").map(|b| b.clone()).unwrap_or(cmd);
                bench.error(clap::error::ErrorKind::ArgumentConflict, msg).exit();
            }
            bench::run(cli.socket, a)
        }
        Command::Study(a) => study::run(cli.socket, a),
        Command::Run(a) => std::process::exit(cmd::run::run(cli.socket, a)?),
        Command::Vm(c) => {
            if let Some(what) = c.needs_daemon() {
                embedded::host_only(
                    what,
                    cli.socket.as_deref(),
                    "run it on the host, where the daemon's config names this VM (or name a daemon with --socket)",
                )?;
            }
            cmd::vm::run(cli.socket, c)
        }
        Command::Migrate(c) => {
            embedded::host_only(
                "migrate",
                cli.socket.as_deref(),
                "run it on the host (the guest's side of a move needs nothing: its library takes its contexts back)",
            )?;
            cmd::migrate::run(cli.socket, c)
        }
        Command::TcpPingpong(a) => cmd::hostbench::pingpong::run(a),
        Command::CmSetup(a) => cmd::hostbench::cm_setup::run(cli.socket, a),
        Command::TcpPhases(a) => cmd::hostbench::tcp_phases::run(a),
        Command::Misbehave(a) => bench::attack::misbehave(cli.socket, a),
    }
}
