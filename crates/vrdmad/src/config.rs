//! The daemon's configuration, read from TOML.
//!
//! ```toml
//! socket = "/run/vrdma/vrdma.sock"   # else VRDMA_SOCKET or the default
//! address = "10.0.0.1"                # the host address the GID carries
//!
//! [engine]
//! spin_us = 20          # busy-poll this long after the last work,
//! yield_us = 1000       # then poll with sched_yield until this long, then sleep
//! busy_poll = false     # never sleep: for a dedicated core
//! realtime = false      # SCHED_FIFO for the engine thread (needs CAP_SYS_NICE)
//! chunk_bytes = 262144  # most bytes one QP moves before the next QP's turn
//! cpu = 1               # pin the engine thread to this CPU
//!
//! [quota]               # every tenant
//! max_objects = 16384
//! max_registered_bytes = 17179869184
//! max_queue_depth = 16384
//!
//! [tenants.1000]        # a tenant is a uid; override its quota
//! max_objects = 64
//! ```

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;

use serde::Deserialize;
use vrdma_core::hca::Quota;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// Busy-poll this long after the last work.
    pub spin_us: u64,
    /// Then poll, yielding the CPU between polls, until this long after the
    /// last work; then sleep on the doorbells.
    pub yield_us: u64,
    pub busy_poll: bool,
    pub realtime: bool,
    pub chunk_bytes: u64,
    /// Pin the engine thread to this CPU. On a small machine the lowest
    /// latency comes with the engine alone on its CPU and the applications
    /// on the others.
    pub cpu: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        // On a machine with cores to spare the engine may spin a while
        // after work dries up. With two cores or fewer a spin steals the
        // time slice the applications need (DESIGN.md, "Polling and
        // cores"): there it polls with a yield between polls, so that an
        // application with work gets the CPU at once, and sleeps on the
        // doorbells when nothing came for a while.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        EngineConfig {
            spin_us: if cores > 2 { 200 } else { 0 },
            yield_us: 1000,
            busy_poll: false,
            realtime: false,
            chunk_bytes: 256 << 10,
            cpu: None,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DaemonConfig {
    pub socket: Option<PathBuf>,
    pub address: Option<Ipv4Addr>,
    pub engine: EngineConfig,
    pub quota: Quota,
    /// Per-uid quota overrides; keys are uids.
    pub tenants: BTreeMap<String, Quota>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("invalid configuration: {0}")]
    Parse(#[from] toml::de::Error),
    #[error("invalid configuration: tenant key {0:?} is not a uid")]
    BadTenant(String),
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

impl DaemonConfig {
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let c: DaemonConfig = toml::from_str(text)?;
        c.validate()?;
        Ok(c)
    }

    pub fn load(path: &std::path::Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
        Self::from_toml(&text)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        self.tenant_quotas()?;
        if self.engine.chunk_bytes == 0 {
            return Err(ConfigError::Invalid("engine.chunk_bytes must be positive".into()));
        }
        if self.engine.spin_us > 1_000_000 || self.engine.yield_us > 1_000_000 {
            return Err(ConfigError::Invalid(
                "engine.spin_us and yield_us must be at most one second".into(),
            ));
        }
        Ok(())
    }

    /// The per-tenant overrides with their uids parsed.
    pub fn tenant_quotas(&self) -> Result<Vec<(u32, Quota)>, ConfigError> {
        self.tenants
            .iter()
            .map(|(k, q)| {
                k.parse::<u32>().map(|uid| (uid, *q)).map_err(|_| ConfigError::BadTenant(k.clone()))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_example() {
        let c = DaemonConfig::from_toml(
            r#"
            socket = "/tmp/x.sock"
            address = "10.0.0.1"
            [engine]
            spin_us = 20
            [quota]
            max_objects = 100
            [tenants.1000]
            max_objects = 64
            "#,
        )
        .unwrap();
        assert_eq!(c.quota.max_objects, 100);
        assert_eq!(c.quota.max_queue_depth, Quota::default().max_queue_depth);
        assert_eq!(c.tenant_quotas().unwrap()[0].0, 1000);
        assert_eq!(c.address, Some(Ipv4Addr::new(10, 0, 0, 1)));
    }

    #[test]
    fn rejects_what_it_does_not_understand() {
        assert!(DaemonConfig::from_toml("nonsense = 1").is_err());
        assert!(DaemonConfig::from_toml("[tenants.bob]\nmax_objects = 1").is_err());
        assert!(DaemonConfig::from_toml("[engine]\nchunk_bytes = 0").is_err());
        assert!(DaemonConfig::from_toml("[quota]\nmax_objects = -1").is_err());
    }
}
