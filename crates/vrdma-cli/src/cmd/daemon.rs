//! `vrdma daemon`: the device in the foreground until SIGINT or SIGTERM.

use std::path::PathBuf;

use anyhow::{Context, Result};

#[derive(clap::Args)]
pub struct Args {
    /// TOML configuration (quotas, engine mode, address); see vrdmad::config.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Busy-poll on a dedicated core: lowest latency, one core always busy.
    #[arg(long)]
    busy_poll: bool,
    /// Run the engine thread at real-time priority (SCHED_FIFO; needs root or CAP_SYS_NICE).
    #[arg(long)]
    realtime: bool,
    /// How long the engine spins after its last work before it sleeps, in µs.
    #[arg(long)]
    spin_us: Option<u64>,
    /// Then how long it polls with a yield between polls before sleeping, in µs.
    #[arg(long)]
    yield_us: Option<u64>,
    /// Pin the engine thread to this CPU.
    #[arg(long)]
    engine_cpu: Option<usize>,
    /// The IPv4 address the port's GID carries [default: the first non-loopback address].
    #[arg(long)]
    address: Option<std::net::Ipv4Addr>,
}

pub fn run(socket: Option<PathBuf>, args: Args) -> Result<()> {
    let mut config = match &args.config {
        Some(p) => vrdmad::DaemonConfig::load(p)?,
        None => vrdmad::DaemonConfig::default(),
    };
    if socket.is_some() {
        config.socket = socket;
    }
    crate::embedded::host_only(
        "daemon",
        config.socket.as_deref(),
        "a daemon here on the default socket would hide that device from this guest's programs; \
         name a socket of its own with --socket for a daemon of the guest's own",
    )?;
    if args.address.is_some() {
        config.address = args.address;
    }
    config.engine.busy_poll |= args.busy_poll;
    config.engine.realtime |= args.realtime;
    if let Some(s) = args.spin_us {
        config.engine.spin_us = s;
    }
    if let Some(y) = args.yield_us {
        config.engine.yield_us = y;
    }
    if args.engine_cpu.is_some() {
        config.engine.cpu = args.engine_cpu;
    }
    // Block the stop signals in every thread the daemon starts, and wait
    // for them here: shutdown then runs as ordinary code, not in a handler.
    let signals = block_stop_signals()?;
    let daemon = vrdmad::Daemon::start(config).context("starting the daemon")?;
    eprintln!("vrdma daemon listening on {}", daemon.socket_path().display());
    let sig = wait_signal(&signals);
    tracing::info!(signal = sig, "stopping");
    daemon.shutdown();
    Ok(())
}

fn block_stop_signals() -> Result<libc::sigset_t> {
    // SAFETY: sigset_t is plain data; sigemptyset/sigaddset initialise it,
    // and pthread_sigmask changes only this thread's mask (inherited by the
    // threads it spawns afterwards).
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        let rc = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        if rc != 0 {
            anyhow::bail!("cannot block SIGINT/SIGTERM: {}", std::io::Error::from_raw_os_error(rc));
        }
        Ok(set)
    }
}

fn wait_signal(set: &libc::sigset_t) -> i32 {
    let mut sig = 0;
    loop {
        // SAFETY: `set` was initialised by block_stop_signals; sigwait
        // writes the received signal into `sig`.
        if unsafe { libc::sigwait(set, &mut sig) } == 0 {
            return sig;
        }
    }
}
