//! vrdmad: the host daemon that is the vRDMA device.
//!
//! It owns the data path so that tenants never touch each other: a tenant
//! process connects to the control socket, the kernel tells us who it is
//! (peer credentials, never what it claims), and every object it creates
//! lives here. The engine thread moves bytes between registered regions
//! that both the tenants and the daemon map.
//!
//! ```no_run
//! let daemon = vrdmad::Daemon::start(vrdmad::DaemonConfig::default()).unwrap();
//! println!("listening on {}", daemon.socket_path().display());
//! daemon.shutdown();
//! ```

pub mod cm;
pub mod config;
pub mod devnode;
pub mod direct;
pub mod engine;
pub mod host;
mod keys;
mod logs;
pub mod metrics;
pub mod net;
mod server;
#[cfg(test)]
mod testing;
mod vm;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

pub use config::{Budgets, ConfigError, DaemonConfig, DirectConfig, EngineConfig, TenantBy, VmConfig};
use vrdma_core::hca::{Hca, HcaConfig, TenantId};

/// Name the device reports, as `ibv_get_device_name` does.
pub const DEVICE_NAME: &str = "vrdma0";

/// The control socket when neither the config nor `VRDMA_SOCKET` names one:
/// under `$XDG_RUNTIME_DIR/vrdma/`, else `/run/vrdma/`.
pub fn default_socket_path() -> PathBuf {
    if let Some(p) = std::env::var_os("VRDMA_SOCKET") {
        return PathBuf::from(p);
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) => PathBuf::from(d).join("vrdma/vrdma.sock"),
        None => PathBuf::from("/run/vrdma/vrdma.sock"),
    }
}

/// Bounds the mappings the daemon makes for tenants, below the kernel's
/// bound on the process (`vm.max_map_count`): past that, the daemon's own
/// allocations would fail, and a failed allocation aborts it. Each
/// tenant's share of it is enforced per tenant (`server::admission`).
fn limit_mappings(limit: usize) {
    vrdma_shm::set_mapping_limit(limit);
    tracing::debug!(limit, "memory mappings for tenants at most");
}

/// Every context and completion channel holds descriptors in the daemon;
/// the soft limit (often 1024) would cap the device far below the quotas,
/// so take the hard limit.
fn raise_fd_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let lim = getrlimit(Resource::Nofile);
    if lim.current < lim.maximum {
        let raised = Rlimit { current: lim.maximum, maximum: lim.maximum };
        if let Err(e) = setrlimit(Resource::Nofile, raised) {
            tracing::warn!(error = %e, "cannot raise the open-file limit");
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot listen on {path}: {source}")]
    Bind { path: PathBuf, source: std::io::Error },
    #[error("cannot accept links from other hosts on {addr}: {source}")]
    Listen { addr: std::net::SocketAddr, source: std::io::Error },
    #[error("cannot serve metrics on {addr}: {source}")]
    Metrics { addr: std::net::SocketAddr, source: std::io::Error },
    #[error(transparent)]
    MetricsToken(#[from] metrics::auth::TokenError),
    #[error("cannot make VM {name:?}'s region or port socket: {source}")]
    Vm { name: String, source: std::io::Error },
    #[error("cannot start the daemon: {0}")]
    Start(#[from] std::io::Error),
}

/// A running daemon. Dropping it (or [`Daemon::shutdown`]) stops it.
pub struct Daemon {
    listener: Arc<server::Listener>,
    shared: Arc<server::Shared>,
    acceptor: Option<std::thread::JoinHandle<()>>,
    engine: Option<engine::Engine>,
    net_listener: Option<net::Listener>,
    /// Boxed: the daemon is held by value in enums (the CLI's `Device`).
    metrics: Option<Box<metrics::MetricsServer>>,
}

/// Gives the engine every tenant's weight, rate limit and latency class
/// (checked when the configuration was read).
fn apply_qos(config: &DaemonConfig, hca: &mut Hca) -> Result<(), DaemonError> {
    let invalid = |e: String| DaemonError::from(config::ConfigError::Invalid(e));
    let all = std::iter::once((None, config.qos))
        .chain(config.tenant_qos()?.into_iter().map(|(u, q)| (Some(u), q)));
    for (uid, q) in all {
        match uid {
            None => hca.set_default_qos(q.qos()).map_err(invalid)?,
            Some(u) => hca.set_qos(TenantId(u), q.qos()).map_err(invalid)?,
        }
        if q != config::QosConfig::default() {
            tracing::info!(uid, qos = ?q.qos(), "tenant share of the engine");
        }
    }
    Ok(())
}

impl Daemon {
    pub fn start(config: DaemonConfig) -> Result<Daemon, DaemonError> {
        raise_fd_limit();
        // The shares of what the daemon really has: its open-file limit as
        // raised (the configuration was checked against the hard limit).
        let open_files = rustix::process::getrlimit(rustix::process::Resource::Nofile).current;
        let budgets = config.budgets_within(
            config.max_mappings.unwrap_or_else(config::default_max_mappings),
            open_files.map_or(usize::MAX, |n| usize::try_from(n).unwrap_or(usize::MAX)),
        )?;
        limit_mappings(budgets.max_mappings);
        let path = config.socket.clone().unwrap_or_else(default_socket_path);
        let address = config.address.unwrap_or_else(host::detect_ipv4);
        let mut hca_cfg = HcaConfig::for_host(address.octets());
        hca_cfg.chunk_bytes = config.engine.chunk_bytes;
        hca_cfg.tenant_turns = config.engine.tenant_turns;
        hca_cfg.contended_bytes = config.engine.contended_bytes;
        hca_cfg.latency_slice = std::time::Duration::from_micros(config.engine.latency_slice_us);
        hca_cfg.ack_delay = std::time::Duration::from_micros(config.engine.ack_delay_us);
        hca_cfg.default_quota = budgets.quota;
        hca_cfg.number_space = config.net.number_space_of(address);
        if let Some(limit) = config.migration_pause_limit() {
            hca_cfg.migration_pause_limit = limit;
        }
        let number_space = hca_cfg.number_space;
        let pause_limit = hca_cfg.migration_pause_limit;
        tracing::info!(number_space, "numbering QPNs, ids and keys in this space");
        let mut hca = Hca::new(hca_cfg, Box::new(keys::RandomKeys::new()));
        for &(uid, q) in &budgets.tenants {
            hca.set_quota(TenantId(uid), q);
        }
        apply_qos(&config, &mut hca)?;
        let net = match config.net.key()? {
            Some(psk) => {
                let listen = config.net.listen.unwrap_or_else(|| (address, config::DEFAULT_WIRE_PORT).into());
                let gid = vrdma_core::verbs::Gid::from_ipv4(address.octets());
                let id = config.net.id.unwrap_or(u64::from(u32::from(address)));
                let lid = hca.config().port.lid;
                Some(Arc::new(net::NetSetup {
                    identity: net::identity(id, gid, lid, config.net.max_chunk, psk),
                    listen,
                    port: config.net.port,
                    peers: config.net.peers.clone(),
                    allow: config.net.allow.clone(),
                    keepalive: std::time::Duration::from_millis(config.net.keepalive_ms),
                    dead: std::time::Duration::from_millis(config.net.dead_ms),
                    max_queued: config.net.max_queued_kib as usize * 1024,
                    latency_first: config.net.latency_first,
                }))
            }
            None => None,
        };
        // The connection manager owns this host's address (and loopback).
        let mut manager = vrdma_core::cm::ConnectionManager::new(
            vrdma_core::cm::CmConfig::default(),
            vec![address],
            Box::new(keys::RandomKeys::new()),
        );
        // Its ids in this daemon's number space: a VM's keep their
        // numbers when it moves (docs/migration.md).
        manager.set_number_space(number_space);
        // And each VM's address, for its tenant (docs/vms.md).
        for (name, vc) in &config.vms {
            if let Some(a) = vc.address {
                manager.add_tenant_addr(a, TenantId(vc.tenant)).map_err(|e| {
                    DaemonError::Config(config::ConfigError::Invalid(format!(
                        "[vms.{name}]: address {a}: {e} (the daemon's address is {address})"
                    )))
                })?;
            }
        }
        let cm = cm::CmDriver::new(manager);
        let engine = engine::Engine::start(hca, cm, config.engine.clone(), net.clone())?;
        let net_listener = match net {
            Some(setup) => Some(
                net::Listener::start(setup.clone(), engine.handle())
                    .map_err(|source| DaemonError::Listen { addr: setup.listen, source })?,
            ),
            None => None,
        };
        let listener = Arc::new(
            server::Listener::bind(&path)
                .map_err(|source| DaemonError::Bind { path: path.clone(), source })?,
        );
        // Beside the control socket: vm-NAME.sock for each VM.
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."));
        let mut vms = std::collections::BTreeMap::new();
        for (name, vc) in &config.vms {
            let vm = vm::Vm::create(name, vc, &dir)
                .map_err(|source| DaemonError::Vm { name: name.clone(), source })?;
            tracing::info!(vm = %name, tenant = vc.tenant, socket = %vm.socket.display(), "VM ready to attach");
            vms.insert(name.clone(), Arc::new(vm));
        }
        let shared = Arc::new(server::Shared {
            engine: engine.handle(),
            device_name: DEVICE_NAME.to_string(),
            // Context ids move with a tenant too: in the number space.
            next_context: AtomicU32::new((u32::from(number_space) << 24) | 1),
            tenancy: server::Tenancy::new(config.tenant_by)?,
            admission: server::Admission::new(budgets.max_tenants),
            sessions: Mutex::new(Vec::new()),
            log: Mutex::default(),
            vms,
            vm_acceptors: Mutex::default(),
            stopping: AtomicBool::new(false),
            moved: Mutex::default(),
            gate: server::pause_gate::PauseGate::new(pause_limit),
        });
        // A context whose tenant broke the shared-memory protocol is closed
        // as if its process had gone (the engine tells it why first).
        let weak = Arc::downgrade(&shared);
        let end: Box<dyn Fn(vrdma_core::hca::ContextId) + Send> = Box::new(move |ctx| {
            if let Some(s) = weak.upgrade() {
                s.end_session(ctx.0);
            }
        });
        engine.handle().call(move |st| st.on_broken = Some(end)).map_err(std::io::Error::other)?;
        let direct = config.direct.enabled;
        engine.handle().call(move |st| st.direct.enabled = direct).map_err(std::io::Error::other)?;
        if direct {
            tracing::info!(
                "direct path on: same-tenant QPs on this host may write, read and apply atomics to each other's regions"
            );
        }
        let token = config.metrics_token_file.as_deref().map(metrics::auth::load_token).transpose()?;
        let metrics = match config.metrics_listen {
            Some(addr) => Some(Box::new(
                metrics::MetricsServer::start(
                    addr,
                    token,
                    metrics::Sources {
                        engine: engine.handle(),
                        shared: Arc::downgrade(&shared),
                        net_log: net_listener.as_ref().map(|l| l.log.clone()),
                    },
                )
                .map_err(|source| DaemonError::Metrics { addr, source })?,
            )),
            None => None,
        };
        let (l, s) = (listener.clone(), shared.clone());
        let acceptor = std::thread::Builder::new().name("vrdma-accept".into()).spawn(move || l.serve(s))?;
        let mut vm_acceptors = shared.vm_acceptors.lock().unwrap_or_else(|p| p.into_inner());
        for vm in shared.vms.values() {
            let (vm, s) = (vm.clone(), shared.clone());
            vm_acceptors
                .push(std::thread::Builder::new().name("vrdma-vm-accept".into()).spawn(move || vm.serve(s))?);
        }
        drop(vm_acceptors);
        // UCX lists the device only if its /dev node exists (devnode).
        match devnode::ensure(DEVICE_NAME) {
            devnode::NodeState::Present => {}
            devnode::NodeState::Created => {
                tracing::info!(node = %devnode::node_path_in(devnode::DEV_DIR.as_ref(), DEVICE_NAME).display(),
                    "created the device node UCX looks for (a /dev/null marker)")
            }
            devnode::NodeState::Unavailable(why) => tracing::warn!(
                "UCX will not list the vRDMA device: {why}; fix: {}",
                devnode::fix_command(DEVICE_NAME)
            ),
        }
        tracing::info!(socket = %path.display(), %address, "vrdma daemon ready");
        Ok(Daemon { listener, shared, acceptor: Some(acceptor), engine: Some(engine), net_listener, metrics })
    }

    pub fn socket_path(&self) -> &Path {
        self.listener.path()
    }

    pub fn engine(&self) -> engine::EngineHandle {
        self.shared.engine.clone()
    }

    /// Stops accepting, ends every session (destroying its objects) and
    /// stops the engine.
    pub fn shutdown(mut self) {
        self.stop();
    }

    /// Where links from other hosts are accepted, if the transport is on.
    pub fn wire_addr(&self) -> Option<std::net::SocketAddr> {
        self.net_listener.as_ref().map(|l| l.addr)
    }

    /// Where the metrics are served, if `metrics_listen` is set.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.metrics.as_ref().map(|m| m.addr())
    }

    fn stop(&mut self) {
        self.metrics.take();
        if let Some(mut l) = self.net_listener.take() {
            l.shutdown();
        }
        self.listener.shutdown();
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
        self.shared.stopping.store(true, Ordering::SeqCst);
        for vm in self.shared.vms.values() {
            vm.shutdown();
        }
        let acceptors =
            std::mem::take(&mut *self.shared.vm_acceptors.lock().unwrap_or_else(|p| p.into_inner()));
        for a in acceptors {
            let _ = a.join();
        }
        for (_, _, fd) in self.shared.sessions.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let _ = rustix::net::shutdown(fd, rustix::net::Shutdown::Both);
        }
        // Give sessions a moment to close their contexts on the engine.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while !self.shared.sessions.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        self.engine.take();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}
