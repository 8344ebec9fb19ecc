//! `vrdma`: the one command of vRDMA.

mod bench;
mod cmd;
mod embedded;

use anyhow::Result;
use clap::{Parser, Subcommand};

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
    /// Measure vRDMA beside shared-memory and memcpy anchors.
    Bench(bench::Args),
    /// Measure vRDMA between two hosts (network namespaces on a veth pair) beside iperf3 and TCP ping-pong.
    BenchHosts(cmd::hostbench::Args),
    /// Run an unmodified verbs program (ibv_rc_pingpong, ...) on vRDMA through its libibverbs.so.1.
    Run(cmd::run::Args),
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
        Command::Bench(a) => bench::run(cli.socket, a),
        Command::BenchHosts(a) => cmd::hostbench::run(a),
        Command::Run(a) => std::process::exit(cmd::run::run(cli.socket, a)?),
    }
}
