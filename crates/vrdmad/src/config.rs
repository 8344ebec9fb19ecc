//! The daemon's configuration, read from TOML.
//!
//! ```toml
//! socket = "/run/vrdma/vrdma.sock"   # else VRDMA_SOCKET or the default
//! address = "10.0.0.1"                # the host address the GID carries
//! max_mappings = 49152  # tenants' mappings at most (default: 3/4 of vm.max_map_count)
//! max_tenants = 16      # tenants holding contexts at once; each may reach its quota
//! max_queue_memory = 4294967296  # queue rings for all tenants (default: 1/4 of MemTotal)
//! tenant_by = "uid"     # or "uid+netns": a uid in another network namespace
//!                       # than the daemon's is a tenant of this host only
//! metrics_listen = "127.0.0.1:9464"  # serve Prometheus metrics here (default: off);
//!                       # every tenant's figures, to whoever can connect
//! metrics_token_file = "/etc/vrdma/metrics.token"  # and only to a scrape that sends
//!                       # this bearer token (default: none needed)
//! migration_pause_limit_ms = 5000  # how long a paused tenant (a migration) holds its
//!                       # peers' QPs and its own held calls, 100..=7000 (docs/migration.md)
//!
//! [engine]
//! spin_us = 20          # busy-poll this long after the last work,
//! yield_us = 1000       # then poll with sched_yield until this long, then sleep
//! busy_poll = false     # never sleep: for a dedicated core
//! realtime = false      # SCHED_FIFO for the engine thread (needs CAP_SYS_NICE)
//! chunk_bytes = 262144  # most bytes one QP moves before the next QP's turn
//! tenant_turns = 32     # most QPs of one tenant with work served in one pass
//! contended_bytes = 524288  # most bytes one tenant moves in a pass while another waits
//! latency_slice_us = 25 # longest share of a pass while a latency-class tenant is active
//! yield_when_contended = false  # yield the CPU after each pass that served several tenants
//! cpu = 1               # pin the engine thread to this CPU
//! ack_delay_us = 20     # across hosts: hold an ACK this long to send it with a request
//! sweep_ms = 100        # give every QP with work a turn this often, woken or not (0: never)
//! link_wake = false     # across hosts: a thread blocked on the links runs the pass when
//!                       # a frame comes while the engine idles (engine/link_wake.rs);
//!                       # VRDMA_LINK_WAKE=1 in the environment makes the default true
//!
//! [direct]              # same host, same tenant: the library moves the bytes
//! enabled = true        # on by default (docs/direct-path.md); false sends
//!                       # every work request through the engine;
//!                       # VRDMA_DIRECT=0 in the daemon's environment makes
//!                       # the default false (to run a test suite with it off)
//!
//! [quota]               # every tenant
//! max_objects = 16384
//! max_registered_bytes = 17179869184   # memory regions and queue rings together
//! max_queue_depth = 262144
//! max_contexts = 256
//! max_mappings = 3071   # default: max_mappings / max_tenants (see below)
//! max_descriptors = 1186  # default: the tenants' descriptors / max_tenants
//! max_queue_bytes = 268435456  # queue rings; default: max_queue_memory / max_tenants
//!
//! [qos]                 # every tenant's share of the engine (see below)
//! weight = 1            # its share against the others' when they contend
//! rate_bytes_per_s = "1G"      # at most this many payload bytes a second (default: none)
//! rate_messages_per_s = "200k" # at most this many send work requests a second
//! burst_bytes = "10M"   # default: 10 ms of the rate, at least 64 KiB
//! burst_messages = 2000 # default: 10 ms of the rate, at least 16
//! latency_class = "normal"     # or "latency" (served first), "bulk" (served last)
//!
//! [tenants.1000]        # a tenant is a uid; override its quota and qos
//! max_objects = 64
//! weight = 4
//! rate_bytes_per_s = "500M"
//!
//! [net]                 # other hosts: only with a pre-shared key
//! listen = "10.0.0.1:4792"   # default: the host address, port 4792
//! psk = "at least sixteen bytes of secret"   # or psk_file = "/etc/vrdma/psk"
//! id = 1                # this daemon's id in Hellos (default: from the address)
//! port = 4792           # where peers named by a GID listen
//! peers = ["10.0.0.2:4792"]  # connect at start (needed for LID-only addressing)
//! keepalive_ms = 1000   # probe an idle link this often
//! allow = ["10.0.0.0/24"]  # dial and admit only these networks (default: any)
//! dead_ms = 5000        # a link silent this long is dead
//!
//! [vms.NAME]            # a QEMU guest (docs/vms.md); NAME: 1-32 of [a-z0-9-]
//! tenant = 1000         # the uid whose tenant the VM is (required)
//! memory_mib = 64       # its shared region (the ivshmem BAR), a power of two in 4..=4096
//! ports = 4             # virtio-serial ports = guest contexts at once, 1..=31
//! ping_ms = 2000        # ask each guest session for a sign of life this often
//! dead_ms = 10000       # and end one silent this long
//! address = "10.76.0.2" # optional: the VM's rdma_cm address, the daemon's for that tenant
//! ```
//!
//! ## Shares of the engine: weights and rate limits
//!
//! The engine serves tenants in turn (`vrdma_core::hca::schedule`). While
//! tenants contend, each moves bytes in proportion to its `weight` (an
//! integer, 1 to 1000), however many QPs it streams on; a tenant alone, or
//! beside tenants with nothing to do, gets the whole engine whatever its
//! weight. A rate limit (`rate_bytes_per_s`, `rate_messages_per_s`, each a
//! token bucket with a burst) holds even when the tenant is alone: once
//! its bucket is empty its work waits, counted as throttled time in the
//! metrics, and the engine sleeps until the bucket refills. Amounts are
//! integers or strings with a suffix: `k`/`K`, `M`, `G`, `T` (powers of
//! 1000) or `Ki`, `Mi`, `Gi`, `Ti` (powers of 1024). A `[tenants.UID]`
//! table's qos keys override `[qos]`'s one by one; a tenant without any
//! gets `[qos]`, each with buckets of its own.
//!
//! Both act on the engine's copying on this host and on the links to
//! other hosts: what a tenant sends to another host's daemon is charged to
//! the same buckets (held back while they are empty), and a contended
//! link is shared by bytes in the ratio of the weights.
//!
//! `latency_class` protects small messages from bulk transfers. A
//! `"latency"` tenant's QPs are served first in every pass of the engine,
//! and while such a tenant has been active in the last 10 ms every other
//! tenant's turns move a chunk each and the engine reads the posted rings
//! between two of them: a latency tenant's message is served there, and
//! the share it interrupted goes on where it stopped, so the message
//! waits about a turn and the busy tenant keeps its pass. Those shares
//! are also bounded in time (`engine.latency_slice_us`, 25 µs by
//! default), and go on for another slice unless a tenant that goes
//! before them has work waiting. A `"bulk"` tenant goes last in a pass,
//! and its shares are bounded in time whenever another tenant contends.
//! The engine stays work-conserving: an idle latency tenant costs the
//! others nothing after 10 ms. The default class (`"normal"`) gets fair
//! shares, not this protection: each of its messages waits for the other
//! busy tenants' shares (`engine.contended_bytes` each, 512 KiB by
//! default), since cutting every busy share short for every tenant's
//! message costs the engine (shares of 64 KiB cost four equal tenants a
//! tenth of its time).
//! On links the class does not act yet: frames take turns by bytes and
//! weights.
//!
//! ## Shared budgets: no tenant can lock the others out
//!
//! The daemon's memory mappings (one per context, region, queue and
//! completion channel) are bounded for all tenants together by
//! `max_mappings`. So that tenants that fill their quotas cannot leave
//! another unable even to open a context, at most `max_tenants` tenants
//! hold contexts at once (the next one's Hello is refused with `EUSERS`
//! until one has closed all of its), and each tenant's mappings are held
//! to its quota's `max_mappings`, by default `max_mappings / max_tenants`.
//! Quotas set by hand are checked at load: the `max_tenants` largest
//! (per-uid overrides, and the `[quota]` one for every other tenant) must
//! fit in `max_mappings` together, else the configuration is refused. So
//! every admitted tenant can always reach its quota, however many others
//! hold theirs. `ibv_query_device` shows each tenant the share it can
//! reach (`max_mr`, `max_cq`, `max_qp`, `max_srq`).
//!
//! The daemon's file descriptors are shared the same way: of its hard
//! open-file limit it keeps a quarter (at most 1024) for itself (listener,
//! links to other hosts, connections not yet admitted), and each admitted
//! tenant may hold its quota's `max_descriptors`, by default the rest
//! divided by `max_tenants` (a context takes 8: its connection, its
//! doorbells and what a request may carry; a completion channel 1; a
//! region or queue none). Past it, a context or channel is refused with
//! `EMFILE`; quotas set by hand are checked as the mappings' are.
//!
//! Queue rings (CQs, QPs, SRQs) are memory the daemon creates and maps,
//! and so pays for: each tenant's are held to its quota's
//! `max_queue_bytes`, by default `max_queue_memory` (a quarter of the
//! host's memory) divided by `max_tenants`, checked the same way; past
//! it, a queue is refused with `ENOMEM`. Registered regions are the
//! tenant's own memory (its memfds) and count only against
//! `max_registered_bytes`, as the rings do too.
//!
//! Why 16 by default: with the kernel's default `vm.max_map_count`
//! (65530) that leaves each tenant 3071 mappings, ample for the usual
//! verbs program (a few regions and queues per connection) and for a
//! host that runs a handful of jobs or containers; a host with more
//! tenants raises `max_tenants`, and one whose programs register
//! thousands of separate buffers raises `vm.max_map_count` (databases
//! commonly run with 262144 or more) or lowers `max_tenants`.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;

use serde::Deserialize;
use vrdma_core::hca::{Qos, Quota};

/// An amount in the configuration: an integer, or a string with a
/// decimal suffix (`k`, `M`, `G`, `T`) or a binary one (`Ki`, `Mi`, `Gi`,
/// `Ti`): `"1G"`, `"1.5M"`, `"64Ki"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Amount(pub u64);

impl Amount {
    pub fn parse(text: &str) -> Result<Amount, String> {
        let t = text.trim();
        let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let mult: u64 = match unit.trim() {
            "" => 1,
            "k" | "K" => 1_000,
            "M" => 1_000_000,
            "G" => 1_000_000_000,
            "T" => 1_000_000_000_000,
            "Ki" => 1 << 10,
            "Mi" => 1 << 20,
            "Gi" => 1 << 30,
            "Ti" => 1 << 40,
            u => return Err(format!("{text:?}: unknown unit {u:?} (k, M, G, T, Ki, Mi, Gi, Ti)")),
        };
        let v: f64 =
            num.parse().map_err(|_| format!("{text:?} is not an amount like 1000, \"1G\" or \"64Ki\""))?;
        let total = v * mult as f64;
        if !total.is_finite() || total < 0.0 || total > u64::MAX as f64 {
            return Err(format!("{text:?} is out of range"));
        }
        Ok(Amount(total.round() as u64))
    }
}

impl<'de> Deserialize<'de> for Amount {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Int(n) => Ok(Amount(n)),
            Raw::Text(t) => Amount::parse(&t).map_err(serde::de::Error::custom),
        }
    }
}

/// A tenant's latency class: `"normal"`, `"latency"` or `"bulk"` (see the
/// module's doc).
pub use vrdma_core::hca::LatencyClass;

/// A tenant's share of the engine, as configured (see the module's doc):
/// every key optional, so that a tenant's table overrides `[qos]`'s keys
/// one by one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QosConfig {
    pub weight: Option<u32>,
    pub rate_bytes_per_s: Option<Amount>,
    pub rate_messages_per_s: Option<Amount>,
    pub burst_bytes: Option<Amount>,
    pub burst_messages: Option<Amount>,
    pub latency_class: Option<LatencyClass>,
}

impl QosConfig {
    /// The keys a `[tenants.UID]` table may hold besides its quota's.
    const KEYS: [&'static str; 6] = [
        "weight",
        "rate_bytes_per_s",
        "rate_messages_per_s",
        "burst_bytes",
        "burst_messages",
        "latency_class",
    ];

    /// `self`'s keys where set, `base`'s elsewhere.
    pub fn over(&self, base: &QosConfig) -> QosConfig {
        QosConfig {
            weight: self.weight.or(base.weight),
            rate_bytes_per_s: self.rate_bytes_per_s.or(base.rate_bytes_per_s),
            rate_messages_per_s: self.rate_messages_per_s.or(base.rate_messages_per_s),
            burst_bytes: self.burst_bytes.or(base.burst_bytes),
            burst_messages: self.burst_messages.or(base.burst_messages),
            latency_class: self.latency_class.or(base.latency_class),
        }
    }

    /// What the engine applies.
    pub fn qos(&self) -> Qos {
        Qos {
            weight: self.weight.unwrap_or(1),
            bytes_per_s: self.rate_bytes_per_s.map(|a| a.0),
            messages_per_s: self.rate_messages_per_s.map(|a| a.0),
            burst_bytes: self.burst_bytes.map(|a| a.0),
            burst_messages: self.burst_messages.map(|a| a.0),
            class: self.latency_class(),
        }
    }

    pub fn latency_class(&self) -> LatencyClass {
        self.latency_class.unwrap_or_default()
    }
}

/// A `[tenants.UID]` table: quota keys and qos keys side by side.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TenantConfig {
    pub quota: Quota,
    pub qos: QosConfig,
}

impl<'de> Deserialize<'de> for TenantConfig {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let mut table = toml::Table::deserialize(d)?;
        let mut qos = toml::Table::new();
        for k in QosConfig::KEYS {
            if let Some(v) = table.remove(k) {
                qos.insert(k.to_string(), v);
            }
        }
        let quota = toml::Value::Table(table).try_into::<Quota>().map_err(D::Error::custom)?;
        let qos = toml::Value::Table(qos).try_into::<QosConfig>().map_err(D::Error::custom)?;
        Ok(TenantConfig { quota, qos })
    }
}

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
    /// Most QPs of one tenant that do work in one engine pass.
    pub tenant_turns: u32,
    /// Most bytes one tenant's QPs move in a pass while another tenant
    /// waits for its share (see `vrdma_core::hca::HcaConfig`).
    pub contended_bytes: u64,
    /// How long a share of a pass may last while a latency-class tenant
    /// is active, in microseconds (`HcaConfig::latency_slice`).
    pub latency_slice_us: u64,
    /// After a pass that served more than one tenant, yield the CPU. On a
    /// machine with fewer cores than spinning threads (the engine, a
    /// streaming tenant, a latency-sensitive one polling) this gives the
    /// others' threads the CPU at once instead of after a time slice:
    /// measured on 2 vCPUs, a victim's 8 B send beside a tenant streaming
    /// over 64 QPs went from 98 µs to 6.2 µs (p99 2 ms to 16 µs), but the
    /// streaming tenant lost some 60 % of its throughput meanwhile, so it
    /// is off by default.
    pub yield_when_contended: bool,
    /// Pin the engine thread to this CPU. On a small machine the lowest
    /// latency comes with the engine alone on its CPU and the applications
    /// on the others.
    pub cpu: Option<usize>,
    /// Across hosts: how long a responder QP that also sends requests may
    /// hold an ACK, to send it in one write with its next request (µs; 0:
    /// at once). In a ping-pong this saves a system call and a wakeup on
    /// each side per message; a QP that only receives never holds one.
    pub ack_delay_us: u64,
    /// Every this often each QP that may have work gets a turn even if
    /// nothing woke it (ms; 0: never). Only a QP whose wake-up was lost
    /// needs it: a tenant that posts without naming the QP, or a bug
    /// (`vrdma stat` counts them as missed wake-ups).
    pub sweep_ms: u64,
    /// Across hosts: while the engine idles, a thread blocked on the
    /// links' sockets runs its pass as soon as a frame comes, rather than
    /// the frame waiting for the yielding engine to be scheduled again
    /// (`engine::link_wake`). Ignored with `busy_poll`. Off by default:
    /// on 2 loaded vCPUs it cut the slow crossings (a link frame's mean
    /// wait 55 -> 31 µs) but not the median, and the extra thread on the
    /// CPUs made ping-pong latency worse (docs/measurements.md, "Across
    /// hosts").
    /// `VRDMA_LINK_WAKE=1` in the daemon's environment makes the default
    /// true (to run a test suite with it on).
    pub link_wake: bool,
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
            tenant_turns: vrdma_core::hca::TENANT_TURNS,
            contended_bytes: vrdma_core::hca::CONTENDED_BYTES,
            latency_slice_us: vrdma_core::hca::LATENCY_SLICE.as_micros() as u64,
            yield_when_contended: false,
            cpu: None,
            ack_delay_us: 20,
            sweep_ms: 100,
            link_wake: matches!(std::env::var("VRDMA_LINK_WAKE").as_deref(), Ok("1")),
        }
    }
}

/// The direct path between QPs of one tenant on this host
/// (`docs/direct-path.md`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DirectConfig {
    /// Grant connected same-tenant QP pairs on this host the direct path.
    /// On by default; the default follows `VRDMA_DIRECT` (`0`: off), so
    /// that a test suite whose daemons use defaults runs with it off.
    pub enabled: bool,
}

impl DirectConfig {
    /// The default of `enabled` as `VRDMA_DIRECT` sets it: `0` turns the
    /// path off; unset, or anything else, leaves it on. Tests that check
    /// a path-dependent figure read it the same way as the daemons they
    /// start.
    pub fn enabled_by_default() -> bool {
        !matches!(std::env::var("VRDMA_DIRECT").as_deref(), Ok("0"))
    }
}

impl Default for DirectConfig {
    fn default() -> Self {
        DirectConfig { enabled: DirectConfig::enabled_by_default() }
    }
}

/// How the daemon names a connecting process's tenant (see the control
/// server's `tenancy` module).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub enum TenantBy {
    /// Its uid.
    #[default]
    #[serde(rename = "uid")]
    Uid,
    /// Its uid, and its network namespace when that is not the daemon's.
    #[serde(rename = "uid+netns")]
    UidAndNetns,
}

/// The default TCP port of the daemon-to-daemon transport.
pub const DEFAULT_WIRE_PORT: u16 = 4792;

/// The transport to other hosts' daemons. It is off unless a pre-shared
/// key is configured: an unauthenticated daemon port would let anyone on
/// the network write into tenants' memory.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NetConfig {
    pub listen: Option<std::net::SocketAddr>,
    pub psk: Option<String>,
    pub psk_file: Option<PathBuf>,
    pub id: Option<u64>,
    pub port: u16,
    pub peers: Vec<std::net::SocketAddr>,
    pub keepalive_ms: u64,
    pub dead_ms: u64,
    /// Largest chunk offered in the Hello (a power of two, 256..=65536).
    pub max_chunk: u32,
    /// KiB a link may hold queued for the kernel (unsent bytes in its
    /// socket) and in the daemon's own queue while a latency-class tenant
    /// is active on it: a later latency frame waits behind no more (see
    /// `net::link`). 16..=65536.
    pub max_queued_kib: u32,
    /// A latency-class tenant's frame goes ahead of the other tenants'
    /// frames already in the daemon's queue for the link (behind the one
    /// being written): it waits for at most that frame there, not for
    /// `max_queued_kib` (see `net::link`). Default true; false only to
    /// compare.
    pub latency_first: bool,
    /// The networks of the other daemons: a QP's GID is dialled, and a
    /// connection taken, only from these (and the configured peers).
    /// Empty: any address.
    pub allow: Vec<ipnet::IpNet>,
    /// This daemon's number space, 1..=255 (`docs/migration.md`,
    /// "Numbering"): the high bits of its QPNs, object ids, memory keys
    /// and context ids, different on every daemon of a cluster so that a
    /// tenant moved here keeps its numbers. Default, on a daemon with
    /// links: `id % 255 + 1` (the sum of the address's bytes mod 255, plus
    /// one, for the default id); without links: 0 (no prefix).
    pub number_space: Option<u8>,
}

impl Default for NetConfig {
    fn default() -> Self {
        NetConfig {
            listen: None,
            psk: None,
            psk_file: None,
            id: None,
            port: DEFAULT_WIRE_PORT,
            peers: Vec::new(),
            keepalive_ms: 1000,
            dead_ms: 5000,
            max_chunk: vrdma_core::wire::MAX_CHUNK,
            max_queued_kib: crate::net::DEFAULT_MAX_QUEUED_KIB,
            latency_first: true,
            allow: Vec::new(),
            number_space: None,
        }
    }
}

impl NetConfig {
    /// The pre-shared key, if the transport is configured.
    pub fn key(&self) -> Result<Option<Vec<u8>>, ConfigError> {
        let key = match (&self.psk, &self.psk_file) {
            (Some(_), Some(_)) => {
                return Err(ConfigError::Invalid("net: give psk or psk_file, not both".into()))
            }
            (Some(k), None) => k.as_bytes().to_vec(),
            (None, Some(p)) => {
                let mut k =
                    std::fs::read(p).map_err(|source| ConfigError::Read { path: p.clone(), source })?;
                while k.last().is_some_and(|b| b.is_ascii_whitespace()) {
                    k.pop();
                }
                k
            }
            (None, None) => return Ok(None),
        };
        if key.len() < vrdma_core::wire::auth::MIN_KEY_LEN {
            return Err(ConfigError::Invalid(format!(
                "net: the pre-shared key must be at least {} bytes",
                vrdma_core::wire::auth::MIN_KEY_LEN
            )));
        }
        Ok(Some(key))
    }

    /// The number space the daemon at `address` uses (see the field).
    pub fn number_space_of(&self, address: Ipv4Addr) -> u8 {
        if let Some(s) = self.number_space {
            return s;
        }
        if self.psk.is_none() && self.psk_file.is_none() {
            return 0;
        }
        let id = self.id.unwrap_or(u64::from(u32::from(address)));
        (id % 255) as u8 + 1
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self.number_space == Some(0) {
            return Err(ConfigError::Invalid(
                "net.number_space 0 is the space of a daemon alone: give 1..=255".into(),
            ));
        }
        let c = self.max_chunk;
        if !(vrdma_core::wire::MIN_CHUNK..=vrdma_core::wire::MAX_CHUNK).contains(&c) || !c.is_power_of_two() {
            return Err(ConfigError::Invalid(format!(
                "net.max_chunk {c} is not a power of two in 256..=65536"
            )));
        }
        if !(16..=65536).contains(&self.max_queued_kib) {
            return Err(ConfigError::Invalid(format!(
                "net.max_queued_kib {} is not in 16..=65536",
                self.max_queued_kib
            )));
        }
        if self.keepalive_ms == 0 || self.dead_ms <= self.keepalive_ms || self.dead_ms > 3_600_000 {
            return Err(ConfigError::Invalid("net: need 0 < keepalive_ms < dead_ms <= 3600000".into()));
        }
        if self.psk.is_some() && self.psk_file.is_some() {
            return Err(ConfigError::Invalid("net: give psk or psk_file, not both".into()));
        }
        if let Some(k) = &self.psk {
            if k.len() < vrdma_core::wire::auth::MIN_KEY_LEN {
                return Err(ConfigError::Invalid(format!(
                    "net: the pre-shared key must be at least {} bytes",
                    vrdma_core::wire::auth::MIN_KEY_LEN
                )));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DaemonConfig {
    pub socket: Option<PathBuf>,
    pub address: Option<Ipv4Addr>,
    /// How a connecting process's tenant is named (see `server::tenancy`).
    pub tenant_by: TenantBy,
    /// Most memory mappings the daemon makes for tenants (regions, rings,
    /// contexts); default three quarters of `vm.max_map_count`, the rest
    /// left to the daemon itself (threads, allocations).
    pub max_mappings: Option<usize>,
    /// Most tenants holding contexts at once (default
    /// [`DEFAULT_MAX_TENANTS`]); the shared budgets are shared among them.
    pub max_tenants: Option<u32>,
    /// Bytes of queue rings the daemon creates for all tenants (default
    /// a quarter of the host's memory).
    pub max_queue_memory: Option<u64>,
    /// Where to serve the Prometheus metrics (`GET /metrics`, see
    /// `crate::metrics`); off when unset. Anyone who can connect sees
    /// every tenant's figures: keep it on loopback or a management
    /// network, and set `metrics_token_file`.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// A file holding a bearer token that every scrape of the metrics
    /// endpoint must send (`Authorization: Bearer ...`; read when the
    /// daemon starts, `crate::metrics::auth`); none needed when unset.
    pub metrics_token_file: Option<std::path::PathBuf>,
    /// How long a requester here waits for a peer QP that answers PAUSED
    /// (its tenant migrating) before it fails `RETRY_EXC_ERR`, and how long
    /// a paused tenant's state-changing call waits at the pause gate
    /// (`HcaConfig::migration_pause_limit`; default 5000). At most
    /// [`MAX_MIGRATION_PAUSE_LIMIT_MS`]: a guest's library counts a port
    /// silent for 8 s as the device gone, and a held call keeps its port's
    /// answer that long.
    pub migration_pause_limit_ms: Option<u64>,
    pub engine: EngineConfig,
    pub net: NetConfig,
    pub direct: DirectConfig,
    pub quota: Quota,
    /// Every tenant's share of the engine (see the module's doc).
    pub qos: QosConfig,
    /// Per-uid quota and qos overrides; keys are uids.
    pub tenants: BTreeMap<String, TenantConfig>,
    /// QEMU guests served over virtio-serial and ivshmem (`docs/vms.md`).
    pub vms: BTreeMap<String, VmConfig>,
}

/// A `[vms.NAME]` table: a guest the host attaches, whose tenant is the
/// one configured here whatever the guest says.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    /// The uid whose tenant the VM is: it shares that tenant with the
    /// host processes of the uid.
    pub tenant: u32,
    /// Size of the shared region (the ivshmem BAR) in MiB.
    #[serde(default = "VmConfig::default_memory_mib")]
    pub memory_mib: u64,
    /// virtio-serial ports, each one guest context at a time.
    #[serde(default = "VmConfig::default_ports")]
    pub ports: u32,
    /// How often a guest session is pinged (ms).
    #[serde(default = "VmConfig::default_ping_ms")]
    pub ping_ms: u64,
    /// A guest session that answers nothing for this long is ended (ms).
    #[serde(default = "VmConfig::default_dead_ms")]
    pub dead_ms: u64,
    /// The VM's rdma_cm address (docs/vms.md, "rdma_cm in a guest"): the
    /// daemon's connection manager owns it beside the host's, for the
    /// VM's tenant only to bind; anyone of this host may connect to it.
    #[serde(default)]
    pub address: Option<Ipv4Addr>,
}

impl VmConfig {
    fn default_memory_mib() -> u64 {
        64
    }
    fn default_ports() -> u32 {
        4
    }
    fn default_ping_ms() -> u64 {
        2000
    }
    fn default_dead_ms() -> u64 {
        10_000
    }

    /// A VM of `tenant` with the defaults.
    pub fn new(tenant: u32) -> VmConfig {
        VmConfig {
            tenant,
            memory_mib: Self::default_memory_mib(),
            ports: Self::default_ports(),
            ping_ms: Self::default_ping_ms(),
            dead_ms: Self::default_dead_ms(),
            address: None,
        }
    }

    /// Checks the table of VM `name`.
    pub fn validate(&self, name: &str) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(format!("[vms.{name}]: {m}")));
        if !valid_vm_name(name) {
            return Err(ConfigError::Invalid(format!(
                "VM name {name:?}: use 1 to 32 characters of a-z, 0-9 and -"
            )));
        }
        if !(4..=4096).contains(&self.memory_mib) {
            return bad(format!("memory_mib {} is not in 4..=4096", self.memory_mib));
        }
        // QEMU's ivshmem aborts on a BAR of another size
        // (`pci_register_bar: Assertion is_power_of_2(size)`, QEMU 7.2).
        if !self.memory_mib.is_power_of_two() {
            return bad(format!(
                "memory_mib {} is not a power of two (QEMU's ivshmem needs one: 4, 8, 16, ... 4096)",
                self.memory_mib
            ));
        }
        if !(1..=31).contains(&self.ports) {
            return bad(format!("ports {} is not in 1..=31", self.ports));
        }
        if self.ping_ms == 0 || self.dead_ms <= self.ping_ms || self.dead_ms > 3_600_000 {
            return bad("need 0 < ping_ms < dead_ms <= 3600000".into());
        }
        if let Some(a) = self.address {
            if a.is_unspecified() || a.is_loopback() || a.is_multicast() || a.is_broadcast() {
                return bad(format!("address {a} is not a unicast, non-loopback IPv4 address"));
            }
        }
        Ok(())
    }

    /// Bytes of the shared region.
    pub fn region_len(&self) -> u64 {
        self.memory_mib << 20
    }
}

/// Whether `name` may name a VM: 1 to 32 of `[a-z0-9-]` (it becomes part
/// of a socket's file name).
pub fn valid_vm_name(name: &str) -> bool {
    (1..=32).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// The default of [`DaemonConfig::max_tenants`] (see the module's doc).
pub const DEFAULT_MAX_TENANTS: u32 = 16;

/// Fewest mappings a tenant's share may have: its context and one region
/// or queue. A smaller share would admit tenants that can do nothing.
pub const MIN_MAPPINGS_PER_TENANT: u32 = 2;

/// The daemon's default bound on its mappings for tenants: three quarters
/// of the kernel's bound on the process (`vm.max_map_count`), the rest
/// left to the daemon itself (threads, allocations).
pub fn default_max_mappings() -> usize {
    let max = std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .unwrap_or(65530);
    max / 4 * 3
}

/// Fewest bytes of queue rings a tenant's share may have: a few queues of
/// modest depth.
pub const MIN_QUEUE_BYTES_PER_TENANT: u64 = 1 << 20;

/// The daemon's default bound on the queue rings it creates for all
/// tenants: a quarter of the host's memory (`MemTotal`), 16 GiB where
/// that cannot be read.
pub fn default_max_queue_memory() -> u64 {
    let kib = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
    });
    kib.map_or(64 << 30, |k| k.saturating_mul(1024)) / 4
}

/// Fewest descriptors a tenant's share may have: one context
/// ([`DESCRIPTORS_PER_CONTEXT`]) and one completion channel.
pub const MIN_DESCRIPTORS_PER_TENANT: u32 = DESCRIPTORS_PER_CONTEXT + 1;

/// Descriptors the daemon holds for one context: its connection and the
/// duplicate it keeps to end it at shutdown, its two doorbells, and the
/// descriptors that may come with the request being handled.
pub const DESCRIPTORS_PER_CONTEXT: u32 = 4 + vrdma_core::proto::MAX_FDS as u32;

/// Descriptors the daemon keeps for itself out of `open_files` (its
/// listener, links and handshakes with other hosts, connections not yet
/// admitted): a quarter, at most 1024. The rest is the tenants'.
pub fn descriptors_for_tenants(open_files: usize) -> usize {
    open_files - (open_files / 4).min(1024)
}

/// A budget of the daemon's that all tenants share, and how to talk
/// about it in errors.
struct Budget {
    key: &'static str,
    what: &'static str,
    total: u64,
    min: u64,
    why_min: &'static str,
    raise: &'static str,
}

impl Budget {
    /// Fills in each quota's share of the budget (`total / n` where the
    /// quota names none), and checks that the `n` largest shares fit in it
    /// together, so that any `n` admitted tenants can each reach theirs.
    fn share_out<T: Copy + Into<u64> + TryFrom<u64>>(
        &self,
        n: u32,
        quota: &mut Quota,
        tenants: &mut [(u32, Quota)],
        field: impl Fn(&mut Quota) -> &mut Option<T>,
    ) -> Result<(), ConfigError> {
        let (key, what, total, min) = (self.key, self.what, self.total, self.min);
        let share = total / u64::from(n);
        if share < min {
            return Err(ConfigError::Invalid(format!(
                "{total} {what} for tenants leave fewer than {min} to each of max_tenants {n} tenants \
                 ({}): {}, or lower max_tenants",
                self.why_min, self.raise
            )));
        }
        // A share too large for the field is no bound at all.
        let filled = T::try_from(share).ok();
        let mut all: Vec<(String, &mut Quota)> = std::iter::once(("[quota]".to_string(), quota))
            .chain(tenants.iter_mut().map(|(u, q)| (format!("[tenants.{u}]"), q)))
            .collect();
        let mut largest = Vec::with_capacity(all.len() + n as usize);
        for (i, (who, q)) in all.iter_mut().enumerate() {
            let f = field(q);
            if f.is_none() {
                *f = filled;
            }
            let v = f.map_or(share, Into::into);
            if v < min {
                return Err(ConfigError::Invalid(format!(
                    "{who} {key} {v} is below {min} ({}): its tenant could not work",
                    self.why_min
                )));
            }
            // The worst case: the max_tenants tenants with the largest
            // shares admitted at once (overrides where larger, and every
            // other tenant at the [quota] share).
            let copies = if i == 0 { n as usize } else { 1 };
            largest.extend(std::iter::repeat_n(v, copies));
        }
        largest.sort_unstable_by(|a, b| b.cmp(a));
        let worst: u64 = largest.iter().take(n as usize).sum();
        if worst > total {
            return Err(ConfigError::Invalid(format!(
                "max_tenants {n} tenants at their quotas could hold {worst} {what} in the daemon, more than \
                 the {total} it has for tenants: lower the quotas' {key} or max_tenants, or {}",
                self.raise
            )));
        }
        Ok(())
    }
}

/// The shared budgets as the daemon applies them: every quota with its
/// shares filled in, checked to fit together.
#[derive(Debug, Clone, PartialEq)]
pub struct Budgets {
    /// Mappings for all tenants together.
    pub max_mappings: usize,
    /// Descriptors for all tenants together.
    pub max_descriptors: usize,
    /// Bytes of queue rings for all tenants together.
    pub max_queue_memory: u64,
    /// Tenants holding contexts at once.
    pub max_tenants: u32,
    /// The quota of every tenant without an override.
    pub quota: Quota,
    /// Per-uid quotas.
    pub tenants: Vec<(u32, Quota)>,
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

/// The bounds of `migration_pause_limit_ms`: ten probe intervals at
/// least; below the guest library's 8 s limit of a silent port at most.
pub const MIN_MIGRATION_PAUSE_LIMIT_MS: u64 = 100;
pub const MAX_MIGRATION_PAUSE_LIMIT_MS: u64 = 7000;

impl DaemonConfig {
    /// The bound of a tenant's pause, where the configuration sets one
    /// (else the core's default, `HcaConfig::migration_pause_limit`).
    pub fn migration_pause_limit(&self) -> Option<std::time::Duration> {
        self.migration_pause_limit_ms.map(std::time::Duration::from_millis)
    }

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
        self.budgets()?;
        self.validate_qos()?;
        self.net.validate()?;
        let mut addresses = std::collections::BTreeMap::new();
        for (name, vm) in &self.vms {
            vm.validate(name)?;
            if let Some(a) = vm.address {
                if self.address == Some(a) {
                    return Err(ConfigError::Invalid(format!(
                        "[vms.{name}]: address {a} is the daemon's own `address`"
                    )));
                }
                if let Some(first) = addresses.insert(a, name) {
                    return Err(ConfigError::Invalid(format!(
                        "[vms.{name}]: address {a} is [vms.{first}]'s already"
                    )));
                }
            }
            let local = vrdma_core::hca::TenantId(vm.tenant).is_host_local();
            if self.tenant_by == TenantBy::UidAndNetns && local {
                return Err(ConfigError::Invalid(format!(
                    "[vms.{name}]: uid {} lies in the numbers kept for tenants of this host only",
                    vm.tenant
                )));
            }
        }
        if let Some(ms) = self.migration_pause_limit_ms {
            if !(MIN_MIGRATION_PAUSE_LIMIT_MS..=MAX_MIGRATION_PAUSE_LIMIT_MS).contains(&ms) {
                return Err(ConfigError::Invalid(format!(
                    "migration_pause_limit_ms = {ms}: give {MIN_MIGRATION_PAUSE_LIMIT_MS} to \
                     {MAX_MIGRATION_PAUSE_LIMIT_MS} (below a probe's few intervals a pause fails its \
                     peers at once; above it a guest whose call is held takes its device for gone)"
                )));
            }
        }
        if self.metrics_listen.is_some_and(|a| a.port() == 0) {
            return Err(ConfigError::Invalid("metrics_listen needs a port (the usual one is 9464)".into()));
        }
        if self.metrics_token_file.is_some() && self.metrics_listen.is_none() {
            return Err(ConfigError::Invalid(
                "metrics_token_file guards the metrics endpoint, which is off: set metrics_listen too".into(),
            ));
        }
        if self.engine.chunk_bytes == 0 {
            return Err(ConfigError::Invalid("engine.chunk_bytes must be positive".into()));
        }
        if self.engine.latency_slice_us == 0 || self.engine.latency_slice_us > 1_000_000 {
            return Err(ConfigError::Invalid("engine.latency_slice_us must be 1 to 1000000".into()));
        }
        if self.engine.contended_bytes == 0 {
            return Err(ConfigError::Invalid("engine.contended_bytes must be positive".into()));
        }
        if self.engine.tenant_turns == 0 {
            return Err(ConfigError::Invalid("engine.tenant_turns must be positive".into()));
        }
        if self.engine.ack_delay_us > 1000 {
            return Err(ConfigError::Invalid("engine.ack_delay_us must be at most 1000".into()));
        }
        if self.engine.spin_us > 1_000_000 || self.engine.yield_us > 1_000_000 {
            return Err(ConfigError::Invalid(
                "engine.spin_us and yield_us must be at most one second".into(),
            ));
        }
        Ok(())
    }

    /// The shared budgets, with `max_mappings` read from the kernel where
    /// the configuration leaves it out, and the descriptors from the hard
    /// open-file limit (the daemon raises its soft limit to it).
    pub fn budgets(&self) -> Result<Budgets, ConfigError> {
        let fds = rustix::process::getrlimit(rustix::process::Resource::Nofile);
        let limit = fds.maximum.or(fds.current).unwrap_or(u64::MAX);
        self.budgets_within(
            self.max_mappings.unwrap_or_else(default_max_mappings),
            usize::try_from(limit).unwrap_or(usize::MAX),
        )
    }

    /// The shared budgets for a daemon that maps at most `max_mappings`
    /// for its tenants and may open `open_files` descriptors: each quota's
    /// share of each (the budget divided by `max_tenants` where it names
    /// none), refused if the `max_tenants` largest quotas could not all be
    /// reached at once.
    pub fn budgets_within(&self, max_mappings: usize, open_files: usize) -> Result<Budgets, ConfigError> {
        let queue_memory = self.max_queue_memory.unwrap_or_else(default_max_queue_memory);
        let n = self.max_tenants.unwrap_or(DEFAULT_MAX_TENANTS);
        if n == 0 {
            return Err(ConfigError::Invalid("max_tenants must be positive".into()));
        }
        let mut quota = self.quota;
        let mut tenants = self.tenant_quotas()?;
        let mappings = Budget {
            key: "max_mappings",
            what: "memory mappings",
            total: max_mappings as u64,
            min: MIN_MAPPINGS_PER_TENANT.into(),
            why_min: "a context takes one",
            raise: "raise max_mappings (or vm.max_map_count)",
        };
        mappings.share_out(n, &mut quota, &mut tenants, |q| &mut q.max_mappings)?;
        let max_descriptors = descriptors_for_tenants(open_files);
        let descriptors = Budget {
            key: "max_descriptors",
            what: "file descriptors",
            total: max_descriptors as u64,
            min: MIN_DESCRIPTORS_PER_TENANT.into(),
            why_min: "a context takes 8, a completion channel 1",
            raise: "raise the daemon's hard open-file limit (ulimit -Hn, LimitNOFILE)",
        };
        descriptors.share_out(n, &mut quota, &mut tenants, |q| &mut q.max_descriptors)?;
        let max_queue_memory = queue_memory;
        let queues = Budget {
            key: "max_queue_bytes",
            what: "bytes of queue rings",
            total: max_queue_memory,
            min: MIN_QUEUE_BYTES_PER_TENANT,
            why_min: "a few queues of modest depth",
            raise: "raise max_queue_memory",
        };
        queues.share_out(n, &mut quota, &mut tenants, |q| &mut q.max_queue_bytes)?;
        Ok(Budgets { max_mappings, max_descriptors, max_queue_memory, max_tenants: n, quota, tenants })
    }

    /// The per-tenant overrides with their uids parsed.
    pub fn tenant_quotas(&self) -> Result<Vec<(u32, Quota)>, ConfigError> {
        self.tenants
            .iter()
            .map(|(k, t)| {
                k.parse::<u32>().map(|uid| (uid, t.quota)).map_err(|_| ConfigError::BadTenant(k.clone()))
            })
            .collect()
    }

    /// The tenants whose table sets a qos key, with `[qos]` filled in
    /// where it leaves one out.
    pub fn tenant_qos(&self) -> Result<Vec<(u32, QosConfig)>, ConfigError> {
        self.tenants
            .iter()
            .filter(|(_, t)| t.qos != QosConfig::default())
            .map(|(k, t)| {
                k.parse::<u32>()
                    .map(|uid| (uid, t.qos.over(&self.qos)))
                    .map_err(|_| ConfigError::BadTenant(k.clone()))
            })
            .collect()
    }

    /// Checks every tenant's qos as the engine will apply it.
    fn validate_qos(&self) -> Result<(), ConfigError> {
        let all = std::iter::once(("[qos]".to_string(), self.qos))
            .chain(self.tenant_qos()?.into_iter().map(|(u, q)| (format!("[tenants.{u}]"), q)));
        for (table, q) in all {
            q.qos().check().map_err(|e| ConfigError::Invalid(format!("{table}: {e}")))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_direct_path_is_switched_by_its_section() {
        // The default follows `VRDMA_DIRECT`, which this test leaves alone
        // (other tests of the process run beside it): only what the
        // section says is checked here.
        assert_eq!(DaemonConfig::from_toml("").unwrap().direct.enabled, DirectConfig::enabled_by_default());
        assert!(!DaemonConfig::from_toml("[direct]\nenabled = false").unwrap().direct.enabled);
        assert!(DaemonConfig::from_toml("[direct]\nenabled = true").unwrap().direct.enabled);
        assert!(DaemonConfig::from_toml("[direct]\nenabled = 1").is_err());
    }

    #[test]
    fn the_migration_pause_limit_is_the_cores_default_unless_set_and_is_bounded() {
        let d = DaemonConfig::from_toml("").unwrap();
        assert_eq!(d.migration_pause_limit(), None);
        let c = DaemonConfig::from_toml("migration_pause_limit_ms = 800").unwrap();
        assert_eq!(c.migration_pause_limit(), Some(std::time::Duration::from_millis(800)));
        for bad in ["0", "99", "7001", "3600000"] {
            let e = DaemonConfig::from_toml(&format!("migration_pause_limit_ms = {bad}")).unwrap_err();
            assert!(e.to_string().contains("give 100 to 7000"), "{bad}: {e}");
        }
        assert!(DaemonConfig::from_toml("migration_pause_limit_ms = \"5s\"").is_err());
    }

    #[test]
    fn metrics_listen_is_off_by_default_and_needs_an_address_with_a_port() {
        assert_eq!(DaemonConfig::from_toml("").unwrap().metrics_listen, None);
        let c = DaemonConfig::from_toml("metrics_listen = \"127.0.0.1:9464\"").unwrap();
        assert_eq!(c.metrics_listen, Some("127.0.0.1:9464".parse().unwrap()));
        assert!(DaemonConfig::from_toml("metrics_listen = \"127.0.0.1\"").is_err());
        let e = DaemonConfig::from_toml("metrics_listen = \"127.0.0.1:0\"").unwrap_err();
        assert!(e.to_string().contains("needs a port"), "{e}");
        assert_eq!(c.metrics_token_file, None);
        let c = DaemonConfig::from_toml("metrics_listen = \"127.0.0.1:9464\"\nmetrics_token_file = \"/t\"")
            .unwrap();
        assert_eq!(c.metrics_token_file, Some("/t".into()));
        let e = DaemonConfig::from_toml("metrics_token_file = \"/t\"").unwrap_err();
        assert!(e.to_string().contains("set metrics_listen too"), "{e}");
    }

    #[test]
    fn amounts_take_decimal_and_binary_suffixes() {
        assert_eq!(Amount::parse("1G"), Ok(Amount(1_000_000_000)));
        assert_eq!(Amount::parse("1.5M"), Ok(Amount(1_500_000)));
        assert_eq!(Amount::parse("200k"), Ok(Amount(200_000)));
        assert_eq!(Amount::parse("64Ki"), Ok(Amount(65_536)));
        assert_eq!(Amount::parse("12345"), Ok(Amount(12_345)));
        assert!(Amount::parse("1X").is_err());
        assert!(Amount::parse("G").is_err());
        assert!(Amount::parse("-1").is_err());
    }

    #[test]
    fn qos_is_set_for_every_tenant_and_per_uid_beside_its_quota() {
        let c = DaemonConfig::from_toml(
            r#"
            [qos]
            rate_bytes_per_s = "1G"
            [tenants.1000]
            max_objects = 64
            weight = 4
            rate_messages_per_s = 100000
            latency_class = "latency"
            [tenants.2000]
            max_objects = 32
            "#,
        )
        .unwrap();
        assert_eq!(c.qos.qos(), Qos { bytes_per_s: Some(1_000_000_000), ..Qos::default() });
        assert_eq!(c.tenant_quotas().unwrap()[0], (1000, Quota { max_objects: 64, ..Quota::default() }));
        let per_uid = c.tenant_qos().unwrap();
        assert_eq!(per_uid.len(), 1, "2000 sets no qos key: it gets [qos]");
        let (uid, q) = per_uid[0];
        assert_eq!(uid, 1000);
        assert_eq!(
            q.qos(),
            Qos {
                weight: 4,
                bytes_per_s: Some(1_000_000_000),
                messages_per_s: Some(100_000),
                class: LatencyClass::Latency,
                ..Qos::default()
            },
            "[qos]'s keys where the tenant's table leaves them out"
        );
        assert_eq!(q.latency_class(), LatencyClass::Latency);
    }

    #[test]
    fn bad_qos_is_refused_with_its_table() {
        for (text, what) in [
            ("[qos]\nweight = 0", "[qos]: weight"),
            ("[tenants.7]\nweight = 1001", "[tenants.7]: weight"),
            ("[tenants.7]\nrate_bytes_per_s = 0", "positive"),
            ("[tenants.7]\nburst_bytes = \"1M\"", "burst_bytes without"),
        ] {
            let e = DaemonConfig::from_toml(text).unwrap_err().to_string();
            assert!(e.contains(what), "{text}: {e}");
        }
        assert!(DaemonConfig::from_toml("[tenants.7]\nlatency_class = \"fast\"").is_err());
        for slice in ["0", "1000001"] {
            let e = DaemonConfig::from_toml(&format!("[engine]\nlatency_slice_us = {slice}")).unwrap_err();
            assert!(e.to_string().contains("latency_slice_us"), "{e}");
        }
        let c = DaemonConfig::from_toml("[engine]\nlatency_slice_us = 40").unwrap();
        assert_eq!(c.engine.latency_slice_us, 40);
        assert!(DaemonConfig::from_toml("[tenants.7]\nweigth = 2").is_err(), "unknown keys still refused");
        assert!(DaemonConfig::from_toml("[tenants.7]\nrate_bytes_per_s = \"1Q\"").is_err());
    }

    #[test]
    fn parses_the_documented_example() {
        let c = DaemonConfig::from_toml(
            r#"
            socket = "/tmp/x.sock"
            address = "10.0.0.1"
            [engine]
            spin_us = 20
            yield_when_contended = true
            [quota]
            max_objects = 100
            [tenants.1000]
            max_objects = 64
            "#,
        )
        .unwrap();
        assert_eq!(c.quota.max_objects, 100);
        assert!(c.engine.yield_when_contended && !EngineConfig::default().yield_when_contended);
        assert_eq!(c.quota.max_queue_depth, Quota::default().max_queue_depth);
        assert_eq!(c.tenant_quotas().unwrap()[0].0, 1000);
        assert_eq!(c.address, Some(Ipv4Addr::new(10, 0, 0, 1)));
        assert_eq!(c.net.key().unwrap(), None, "no key: no transport");
    }

    #[test]
    fn parses_the_transport_section() {
        let c = DaemonConfig::from_toml(
            r#"
            [net]
            listen = "127.0.0.2:4800"
            psk = "0123456789abcdef0123"
            peers = ["127.0.0.3:4800"]
            "#,
        )
        .unwrap();
        assert_eq!(c.net.key().unwrap().unwrap(), b"0123456789abcdef0123");
        assert_eq!(c.net.port, DEFAULT_WIRE_PORT);
        assert_eq!(c.net.peers.len(), 1);
    }

    /// Each daemon of a cluster numbers in a space of its own: configured,
    /// else from its id (the address's for the default id), 0 alone.
    #[test]
    fn the_number_space_is_configured_or_derived_from_the_id() {
        let ip = Ipv4Addr::new(10, 0, 0, 1);
        let net = |extra: &str| {
            DaemonConfig::from_toml(&format!("[net]\npsk = \"0123456789abcdef\"\n{extra}")).map(|c| c.net)
        };
        assert_eq!(net("").unwrap().number_space_of(ip), 12, "(10 + 0 + 0 + 1) % 255 + 1");
        assert_eq!(net("").unwrap().number_space_of(Ipv4Addr::new(10, 0, 0, 2)), 13);
        assert_eq!(net("id = 509").unwrap().number_space_of(ip), 255);
        assert_eq!(net("number_space = 7").unwrap().number_space_of(ip), 7);
        let e = net("number_space = 0").unwrap_err().to_string();
        assert!(e.contains("number_space 0"), "{e}");
        assert!(net("number_space = 256").is_err());
        assert_eq!(DaemonConfig::default().net.number_space_of(ip), 0, "a daemon without links");
    }

    #[test]
    fn each_tenants_share_of_mappings_is_derived_from_the_budget() {
        let c = DaemonConfig::from_toml("max_mappings = 49146\n[tenants.1000]\nmax_objects = 64").unwrap();
        let b = c.budgets().unwrap();
        assert_eq!(b.max_tenants, DEFAULT_MAX_TENANTS);
        assert_eq!(b.quota.max_mappings, Some(49146 / 16));
        // An override that names no share gets the same one.
        assert_eq!(b.tenants[0].0, 1000);
        assert_eq!((b.tenants[0].1.max_objects, b.tenants[0].1.max_mappings), (64, Some(3071)));
        let b = DaemonConfig::from_toml("max_mappings = 100\nmax_tenants = 3").unwrap().budgets().unwrap();
        assert_eq!(b.quota.max_mappings, Some(33));
        // Left out, the budget comes from the kernel's bound.
        let b = DaemonConfig::default().budgets().unwrap();
        assert_eq!(b.max_mappings, default_max_mappings());
        assert_eq!(b.quota.max_mappings, Some((default_max_mappings() / 16) as u32));
    }

    #[test]
    fn each_tenants_share_of_descriptors_is_derived_from_the_open_file_limit() {
        let c = DaemonConfig::from_toml("max_tenants = 4\n[tenants.7]\nmax_objects = 1").unwrap();
        // A quarter of the limit is the daemon's own, at most 1024.
        assert_eq!(descriptors_for_tenants(1024), 768);
        assert_eq!(descriptors_for_tenants(20_000), 18_976);
        let b = c.budgets_within(400, 1024).unwrap();
        assert_eq!(b.max_descriptors, 768);
        assert_eq!(b.quota.max_descriptors, Some(192));
        assert_eq!(b.tenants[0].1.max_descriptors, Some(192));
        // Too few for a context and a channel each.
        let m = c.budgets_within(400, 40).unwrap_err().to_string();
        assert!(m.contains("30 file descriptors for tenants leave fewer than 9"), "{m}");
        // Set by hand, the largest must fit together.
        let c = DaemonConfig::from_toml("max_tenants = 4\n[tenants.7]\nmax_descriptors = 300").unwrap();
        let m = c.budgets_within(400, 1024).unwrap_err().to_string();
        assert!(m.contains("could hold 876 file descriptors"), "{m}");
        let c = DaemonConfig::from_toml(
            "max_tenants = 4\n[quota]\nmax_descriptors = 150\n[tenants.7]\nmax_descriptors = 300",
        )
        .unwrap();
        assert_eq!(c.budgets_within(400, 1024).unwrap().tenants[0].1.max_descriptors, Some(300));
    }

    #[test]
    fn each_tenants_share_of_queue_memory_is_derived_from_the_budget() {
        let c = DaemonConfig::from_toml("max_tenants = 4\nmax_queue_memory = 1073741824").unwrap();
        let b = c.budgets_within(400, 1024).unwrap();
        assert_eq!(b.quota.max_queue_bytes, Some(256 << 20));
        // Left out, a quarter of the host's memory.
        let b = DaemonConfig::default().budgets().unwrap();
        assert_eq!(b.max_queue_memory, default_max_queue_memory());
        assert!(b.max_queue_memory >= 64 << 20, "{}", b.max_queue_memory);
        let m =
            DaemonConfig::from_toml("max_tenants = 4\nmax_queue_memory = 1048576").unwrap_err().to_string();
        assert!(m.contains("fewer than 1048576"), "{m}");
        let t = "max_tenants = 4\nmax_queue_memory = 1073741824\n[tenants.7]\nmax_queue_bytes = 536870912";
        let m = DaemonConfig::from_toml(t).unwrap_err().to_string();
        assert!(m.contains("could hold 1342177280 bytes of queue rings"), "{m}");
    }

    /// Quotas set by hand must leave every admitted tenant able to reach
    /// its own: the max_tenants largest must fit in the budget together.
    #[test]
    fn quotas_that_could_not_all_be_reached_are_refused() {
        let err = |t: &str| match DaemonConfig::from_toml(t) {
            Err(ConfigError::Invalid(m)) => m,
            other => panic!("{t:?} gave {other:?}"),
        };
        // [quota] above the share: N of them do not fit.
        let m = err("max_mappings = 100\nmax_tenants = 4\n[quota]\nmax_mappings = 26");
        assert!(m.contains("could hold 104 memory mappings") && m.contains("the 100 it has"), "{m}");
        assert!(DaemonConfig::from_toml("max_mappings = 100\nmax_tenants = 4\n[quota]\nmax_mappings = 25")
            .is_ok());
        // One override above the share fits only if the rest leave room.
        let m = err("max_mappings = 100\nmax_tenants = 4\n[tenants.7]\nmax_mappings = 40");
        assert!(m.contains("could hold 115"), "{m}");
        let ok =
            "max_mappings = 100\nmax_tenants = 4\n[quota]\nmax_mappings = 20\n[tenants.7]\nmax_mappings = 40";
        assert_eq!(
            DaemonConfig::from_toml(ok).unwrap().budgets().unwrap().tenants[0].1.max_mappings,
            Some(40)
        );
        // Two large overrides both count, however many tenants there are.
        let m = err("max_mappings = 100\nmax_tenants = 4\n[quota]\nmax_mappings = 10\n[tenants.7]\nmax_mappings = 45\n[tenants.8]\nmax_mappings = 45");
        assert!(m.contains("could hold 110"), "{m}");
        // Too small a share, or none at all.
        let m = err("max_mappings = 40\nmax_tenants = 21");
        assert!(m.contains("40 memory mappings for tenants leave fewer than 2"), "{m}");
        assert!(err("max_tenants = 0").contains("positive"));
        assert!(err("[tenants.7]\nmax_mappings = 1").contains("[tenants.7] max_mappings 1"));
    }

    #[test]
    fn vms_are_parsed_with_defaults_and_checked() {
        let c = DaemonConfig::from_toml(
            "[vms.guest-1]\ntenant = 1000\n[vms.b]\ntenant = 0\nmemory_mib = 4\nports = 31",
        )
        .unwrap();
        assert_eq!(c.vms["guest-1"], VmConfig::new(1000));
        assert_eq!(c.vms["guest-1"].region_len(), 64 << 20);
        assert_eq!((c.vms["b"].memory_mib, c.vms["b"].ports), (4, 31));
        let err = |t: &str| DaemonConfig::from_toml(t).unwrap_err().to_string();
        assert!(err("[vms.a]\nmemory_mib = 8").contains("tenant"));
        assert!(err("[vms.a]\ntenant = 1\nmemory_mib = 3").contains("memory_mib 3"));
        assert!(err("[vms.a]\ntenant = 1\nmemory_mib = 4097").contains("memory_mib 4097"));
        let odd = err("[vms.a]\ntenant = 1\nmemory_mib = 100");
        assert!(odd.contains("memory_mib 100 is not a power of two"), "{odd}");
        assert!(DaemonConfig::from_toml("[vms.a]\ntenant = 1\nmemory_mib = 4096").is_ok());
        assert!(err("[vms.a]\ntenant = 1\nports = 0").contains("ports 0"));
        assert!(err("[vms.a]\ntenant = 1\nports = 32").contains("ports 32"));
        assert!(err("[vms.a]\ntenant = 1\nping_ms = 10\ndead_ms = 10").contains("ping_ms"));
        assert!(err("[vms.a]\ntenant = 1\ncolour = 1").contains("colour"));
        let c = DaemonConfig::from_toml("[vms.a]\ntenant = 1\naddress = \"10.76.0.2\"").unwrap();
        assert_eq!(c.vms["a"].address, Some(std::net::Ipv4Addr::new(10, 76, 0, 2)));
        assert!(err("[vms.a]\ntenant = 1\naddress = \"127.0.0.1\"").contains("127.0.0.1"));
        assert!(err("[vms.a]\ntenant = 1\naddress = \"10.76.0\"").contains("address"));
        let two =
            "[vms.a]\ntenant = 1\naddress = \"10.76.0.2\"\n[vms.b]\ntenant = 2\naddress = \"10.76.0.2\"";
        assert!(err(two).contains("[vms.a]'s already"));
        assert!(err("address = \"10.76.0.2\"\n[vms.a]\ntenant = 1\naddress = \"10.76.0.2\"")
            .contains("daemon's own"));
        assert!(err("[vms.Big]\ntenant = 1").contains("a-z"));
        assert!(err("[vms.\"a/b\"]\ntenant = 1").contains("a-z"));
        let long = "a".repeat(33);
        assert!(err(&format!("[vms.{long}]\ntenant = 1")).contains("a-z"));
        assert!(valid_vm_name(&"a".repeat(32)) && !valid_vm_name(""));
        let big = vrdma_core::hca::TenantId::HOST_LOCAL_BASE + 1;
        assert!(
            err(&format!("tenant_by = \"uid+netns\"\n[vms.a]\ntenant = {big}")).contains("this host only")
        );
        assert!(DaemonConfig::from_toml(&format!("[vms.a]\ntenant = {big}")).is_ok());
    }

    #[test]
    fn rejects_what_it_does_not_understand() {
        assert!(DaemonConfig::from_toml("nonsense = 1").is_err());
        assert!(DaemonConfig::from_toml("[tenants.bob]\nmax_objects = 1").is_err());
        assert!(DaemonConfig::from_toml("[engine]\nchunk_bytes = 0").is_err());
        assert!(DaemonConfig::from_toml("[engine]\ntenant_turns = 0").is_err());
        assert!(DaemonConfig::from_toml("[net]\nmax_queued_kib = 0").is_err());
        assert!(DaemonConfig::from_toml("[net]\nmax_queued_kib = 1048576").is_err());
        assert_eq!(DaemonConfig::from_toml("[net]\nmax_queued_kib = 64").unwrap().net.max_queued_kib, 64);
        assert_eq!(DaemonConfig::from_toml("").unwrap().tenant_by, TenantBy::Uid);
        let c = DaemonConfig::from_toml("tenant_by = \"uid+netns\"").unwrap();
        assert_eq!(c.tenant_by, TenantBy::UidAndNetns);
        assert!(DaemonConfig::from_toml("tenant_by = \"netns\"").is_err());
        let c = DaemonConfig::from_toml("[net]\nallow = [\"10.0.0.0/24\", \"fd00::/8\"]").unwrap();
        assert_eq!(c.net.allow.len(), 2);
        assert!(DaemonConfig::from_toml("[net]\nallow = [\"10.0.0.0/33\"]").is_err());
        assert!(DaemonConfig::from_toml("[quota]\nmax_objects = -1").is_err());
        assert!(DaemonConfig::from_toml("[net]\npsk = \"short\"").is_err());
        assert!(DaemonConfig::from_toml("[net]\nmax_chunk = 1000").is_err());
        assert!(DaemonConfig::from_toml("[net]\nkeepalive_ms = 10\ndead_ms = 5").is_err());
        assert!(DaemonConfig::from_toml("[net]\nlisten = \"nowhere\"").is_err());
    }
}
