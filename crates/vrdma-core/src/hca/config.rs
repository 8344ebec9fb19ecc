//! What the device reports about itself, and the per-tenant limits.

use serde::{Deserialize, Serialize};

use crate::verbs::{DeviceAttr, Gid, Mtu, PortAttr};

/// Limits on what one tenant may hold, across all its processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Quota {
    /// PDs, MRs, CQs, SRQs and QPs together.
    pub max_objects: u32,
    /// Sum of the lengths of registered memory regions and of the rings
    /// of the tenant's queues (CQs, SRQs, QPs' send and receive queues).
    pub max_registered_bytes: u64,
    /// Largest depth of any one queue (CQ entries, send/receive WRs).
    pub max_queue_depth: u32,
    /// Open contexts (connections to the daemon) at once.
    pub max_contexts: u32,
    /// Memory mappings the daemon holds for the tenant at once: one per
    /// context, memory region, CQ, QP, SRQ and completion channel. The
    /// daemon's mappings are a budget all tenants share (the kernel bounds
    /// them per process), so the driver enforces this, and `None` means
    /// "the driver's share": its budget divided among the tenants it
    /// admits. The core only reports it ([`Hca::device_attr`]).
    ///
    /// [`Hca::device_attr`]: crate::hca::Hca::device_attr
    pub max_mappings: Option<u32>,
    /// File descriptors the daemon holds for the tenant at once: each
    /// context's connection and doorbells, each completion channel's
    /// doorbell. Like `max_mappings`, a share of a budget all tenants
    /// share (the daemon's open-file limit) that the driver enforces;
    /// `None`: the driver's share.
    pub max_descriptors: Option<u32>,
    /// Bytes of queue rings (CQs, QPs, SRQs) at once, within
    /// `max_registered_bytes`. Rings are memory the daemon creates and
    /// maps, so it pays for them whoever touches them: a share of a budget
    /// all tenants share, enforced here; `None`: bounded only by
    /// `max_registered_bytes` (the daemon fills in its share).
    pub max_queue_bytes: Option<u64>,
}

impl Default for Quota {
    fn default() -> Self {
        // Device-wide limits are far above these, so that no one tenant
        // can use up what others need.
        Quota {
            max_objects: 16_384,
            max_registered_bytes: 16 << 30,
            // ofi_rxm's CQ (see MAX_CQE): 16 MiB of ring; QPs and SRQs
            // stay at the device's MAX_QP_WR.
            max_queue_depth: 1 << 18,
            max_contexts: 256,
            max_mappings: None,
            max_descriptors: None,
            max_queue_bytes: None,
        }
    }
}

/// How a tenant's messages are served against others' in a pass (see
/// the engine's scheduler, `hca::schedule`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LatencyClass {
    #[default]
    Normal,
    /// Served first in every pass; while such a tenant has been active
    /// lately, the shares of the others are bounded in time
    /// ([`HcaConfig::latency_slice`]), so that its messages wait for at
    /// most about one slice of another tenant's copying.
    Latency,
    /// Served last in a pass, and its shares bounded in time whenever
    /// another tenant contends.
    Bulk,
}

/// A tenant's place in the engine's service (see the engine's scheduler,
/// `hca::schedule`): its weight when tenants contend, and an optional rate
/// limit that holds even when it is alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Qos {
    /// Its share of the engine when tenants contend, against the others'
    /// (at least 1): each round, a tenant may move `contended_bytes ×
    /// weight` and have `tenant_turns × weight` busy turns.
    pub weight: u32,
    /// Most payload bytes a second its send work requests move (a token
    /// bucket holding at most `burst_bytes`).
    pub bytes_per_s: Option<u64>,
    /// Most send work requests a second it starts (a token bucket holding
    /// at most `burst_messages`).
    pub messages_per_s: Option<u64>,
    /// Bytes the tenant may move at once after a pause; default
    /// [`Qos::DEFAULT_BURST_DIVISOR`]th of a second's worth, at least
    /// [`Qos::MIN_BURST_BYTES`].
    pub burst_bytes: Option<u64>,
    /// Messages it may start at once after a pause; default a 100th of a
    /// second's worth, at least [`Qos::MIN_BURST_MESSAGES`].
    pub burst_messages: Option<u64>,
    /// Its messages' priority within a pass.
    pub class: LatencyClass,
}

impl Default for Qos {
    fn default() -> Self {
        Qos {
            weight: 1,
            bytes_per_s: None,
            messages_per_s: None,
            burst_bytes: None,
            burst_messages: None,
            class: LatencyClass::Normal,
        }
    }
}

impl Qos {
    /// The default burst is this fraction of a second's rate (10 ms): a
    /// tenant that paused gets at most 1 % more than its rate over the
    /// next second.
    pub const DEFAULT_BURST_DIVISOR: u64 = 100;
    pub const MIN_BURST_BYTES: u64 = 64 << 10;
    pub const MIN_BURST_MESSAGES: u64 = 16;
    /// The largest weight: a round of a tenant of this weight holds the
    /// engine `MAX_WEIGHT` times as long as one of weight 1.
    pub const MAX_WEIGHT: u32 = 1000;

    /// The burst of bytes in force.
    pub fn burst_bytes(&self) -> Option<u64> {
        let r = self.bytes_per_s?;
        Some(self.burst_bytes.unwrap_or((r / Self::DEFAULT_BURST_DIVISOR).max(Self::MIN_BURST_BYTES)))
    }

    /// The burst of messages in force.
    pub fn burst_messages(&self) -> Option<u64> {
        let r = self.messages_per_s?;
        Some(self.burst_messages.unwrap_or((r / Self::DEFAULT_BURST_DIVISOR).max(Self::MIN_BURST_MESSAGES)))
    }

    /// Why this policy cannot be applied, if it cannot.
    pub fn check(&self) -> Result<(), String> {
        if self.weight == 0 || self.weight > Self::MAX_WEIGHT {
            return Err(format!("weight must be 1 to {}, not {}", Self::MAX_WEIGHT, self.weight));
        }
        if self.bytes_per_s == Some(0) || self.messages_per_s == Some(0) {
            return Err("a rate limit must be positive (leave it out for none)".into());
        }
        if self.burst_bytes == Some(0) || self.burst_messages == Some(0) {
            return Err("a burst must be positive".into());
        }
        if self.burst_bytes.is_some() && self.bytes_per_s.is_none() {
            return Err("burst_bytes without rate_bytes_per_s".into());
        }
        if self.burst_messages.is_some() && self.messages_per_s.is_none() {
            return Err("burst_messages without rate_messages_per_s".into());
        }
        Ok(())
    }
}

/// The device's identity and limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HcaConfig {
    pub device: DeviceAttr,
    pub port: PortAttr,
    /// The port's GID table; entry 0 names this host.
    pub gids: Vec<Gid>,
    /// Most bytes one QP moves before the engine turns to the next QP.
    pub chunk_bytes: u64,
    /// Most QPs of one tenant that do work in one engine pass (each moves
    /// at most `chunk_bytes` or starts at most 64 WRs): a tenant with
    /// thousands of busy QPs then stretches a pass, and so every other
    /// tenant's wait, by this many turns, not by thousands.
    pub tenant_turns: u32,
    /// Most bytes one tenant's QPs move in one pass while another tenant
    /// waits for its share too (with one tenant busy, `tenant_turns`
    /// turns of `chunk_bytes` each): the longest another tenant's message
    /// waits behind a tenant that streams, however many QPs it streams on.
    pub contended_bytes: u64,
    /// How long a share of a tenant not of the latency class may hold the
    /// engine while a latency-class tenant has been active lately (and a
    /// bulk-class tenant's while another contends): the longest a
    /// latency-class tenant's message waits behind each other busy
    /// tenant. The engine's clock bounds it after each turn, so a share
    /// may run one turn (at most `chunk_bytes`) over.
    pub latency_slice: std::time::Duration,
    /// How long a responder across hosts may hold an ACK, hoping to send
    /// it with a request of the same QP or to merge it with later ACKs.
    /// Zero: at once.
    pub ack_delay: std::time::Duration,
    /// PSNs a requester across hosts has in flight at most. PSNs are 24
    /// bits and compared within half their space, so requests must never
    /// span more than that: a request waits until the ones before it leave
    /// room, and one message may take at most half of this.
    pub max_psns_in_flight: u32,
    pub default_quota: Quota,
    /// How long a requester whose peer QP answers PAUSED (its tenant is
    /// migrating) waits for it to resume before its work request fails
    /// `RETRY_EXC_ERR`, as for a dead host (`docs/migration.md`).
    pub migration_pause_limit: std::time::Duration,
    /// How often such a requester probes the paused peer (one request
    /// frame each time), so that it learns when the QP resumes where it
    /// was; a move to another host is announced by a Moved frame.
    pub migration_probe_interval: std::time::Duration,
    /// This daemon's number space (`docs/migration.md`, "Numbering"): the
    /// high bits of the QPNs, object ids and memory keys it hands out, so
    /// that two daemons of one cluster with different spaces never hand
    /// out the same number and a tenant's numbers, which keep their values
    /// when it moves, are free on its destination. 0: no prefix (QPNs from
    /// 0x11, ids from 1, keys fully random), for a daemon alone.
    pub number_space: u8,
}

/// The default of [`HcaConfig::migration_pause_limit`].
pub const MIGRATION_PAUSE_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);
/// The default of [`HcaConfig::migration_probe_interval`].
pub const MIGRATION_PROBE_INTERVAL: std::time::Duration = std::time::Duration::from_millis(10);

/// The default of [`HcaConfig::contended_bytes`]: two of the daemon's
/// chunks (`engine.chunk_bytes`, 256 KiB), some 50 µs of copying from
/// memory on a core of today. Four tenants streaming at once then move
/// 2 MiB a pass between them, where one alone moves up to `tenant_turns`
/// chunks (8 MiB): a share of 64 KiB cut each of their turns to a quarter
/// of a chunk and made each share one turn, so the engine paid a turn's
/// and a share's set-up (the QP's rings, the clock, the tenant's counters
/// and buckets) per 64 KiB, and in `perf` its copying fell from 91 % of
/// its time alone to 80 % with four (`vrdma bench --qos`, 2 cores; 91 %
/// with four at 512 KiB).
/// What it costs: a tenant not of the latency class waits for the other
/// busy tenants' shares, each up to this (a latency-class tenant is
/// served between their turns).
pub const CONTENDED_BYTES: u64 = 512 << 10;

/// The default of [`HcaConfig::latency_slice`]: a few turns of
/// `chunk_bytes` of copying.
pub const LATENCY_SLICE: std::time::Duration = std::time::Duration::from_micros(25);

/// The default of [`HcaConfig::tenant_turns`].
pub const TENANT_TURNS: u32 = 32;

/// The default of [`HcaConfig::max_psns_in_flight`]: a quarter of the PSN
/// space, so that a 2 GiB message fits in one window at chunks of 1 KiB
/// or more.
pub const MAX_PSNS_IN_FLIGHT: u32 = 1 << 22;

/// Our vendor id: not Mellanox's 0x02c9, so that tools take the generic
/// verbs path.
pub const VENDOR_ID: u32 = 0x5652; // "VR"
pub const MAX_QP_WR: u32 = 16_384;
/// As mlx5's 4194303 (a ring of 2^22): libfabric's `ofi_rxm` sizes its
/// CQ for (128 receives + 128 sends) × a universe of 1024 peers = 262144
/// entries and fails where the device allows fewer (as on rxe's 32767).
/// A ring's memory is sparse until written, and counts against the
/// tenant's memory quota at its full size.
pub const MAX_CQE: u32 = 1 << 22;
pub const MAX_RD_ATOMIC: u32 = 16;

/// The LID of the device of the host whose address is `ipv4`: the
/// address's low 16 bits (never 0 or the permissive LID).
pub fn lid_of_ipv4(ipv4: [u8; 4]) -> u16 {
    match u16::from_be_bytes([ipv4[2], ipv4[3]]) {
        0 | 0xffff => 1,
        l => l,
    }
}

impl HcaConfig {
    /// The device of a host whose address is `ipv4`: GID `::ffff:a.b.c.d`
    /// and a LID taken from the address's low 16 bits (never 0).
    pub fn for_host(ipv4: [u8; 4]) -> HcaConfig {
        let gid = Gid::from_ipv4(ipv4);
        let lid = lid_of_ipv4(ipv4);
        let guid = u64::from_be_bytes([0x02, 0x00, 0x5e, 0xff, ipv4[0], ipv4[1], ipv4[2], ipv4[3]]);
        HcaConfig {
            device: DeviceAttr {
                fw_ver: concat!("vrdma ", env!("CARGO_PKG_VERSION")).to_string(),
                node_guid: guid,
                sys_image_guid: guid,
                max_mr_size: 1 << 40,
                page_size_cap: 4096,
                vendor_id: VENDOR_ID,
                vendor_part_id: 1,
                hw_ver: 1,
                max_qp: 1 << 20,
                max_qp_wr: MAX_QP_WR,
                device_cap_flags: 0,
                max_sge: crate::ring::MAX_SGE as u32,
                max_sge_rd: crate::ring::MAX_SGE as u32,
                max_cq: 1 << 20,
                max_cqe: MAX_CQE,
                max_mr: 1 << 22,
                max_pd: 1 << 20,
                max_qp_rd_atom: MAX_RD_ATOMIC,
                max_ee_rd_atom: 0,
                max_res_rd_atom: MAX_RD_ATOMIC * 16_384,
                max_qp_init_rd_atom: MAX_RD_ATOMIC,
                atomic_cap: 1, // IBV_ATOMIC_HCA
                max_ah: 1 << 22,
                max_srq: 1 << 20,
                max_srq_wr: MAX_QP_WR,
                max_srq_sge: crate::ring::MAX_SGE as u32,
                max_pkeys: 1,
                local_ca_ack_delay: 15,
                phys_port_cnt: 1,
                max_inline_data: crate::ring::MAX_INLINE as u32,
            },
            port: PortAttr {
                state: 4, // IBV_PORT_ACTIVE
                max_mtu: Mtu::Mtu4096,
                active_mtu: Mtu::Mtu4096,
                gid_tbl_len: 1,
                port_cap_flags: 0,
                max_msg_sz: 1 << 31,
                pkey_tbl_len: 1,
                lid,
                sm_lid: 0,
                lmc: 0,
                max_vl_num: 1,
                sm_sl: 0,
                active_width: 2,  // 4x
                active_speed: 32, // EDR-like: a nominal figure, not a measurement
                phys_state: 5,    // LinkUp
                link_layer: 1,    // InfiniBand: LID routing works without a GRH
            },
            gids: vec![gid],
            chunk_bytes: 64 << 10,
            tenant_turns: TENANT_TURNS,
            contended_bytes: CONTENDED_BYTES,
            latency_slice: LATENCY_SLICE,
            ack_delay: std::time::Duration::ZERO,
            max_psns_in_flight: MAX_PSNS_IN_FLIGHT,
            default_quota: Quota::default(),
            migration_pause_limit: MIGRATION_PAUSE_LIMIT,
            migration_probe_interval: MIGRATION_PROBE_INTERVAL,
            number_space: 0,
        }
    }

    /// The limits `ibv_modify_qp` values are checked against.
    pub fn modify_limits(&self) -> crate::qp::fsm::ModifyLimits {
        crate::qp::fsm::ModifyLimits {
            max_mtu: self.port.max_mtu,
            gid_tbl_len: self.gids.len() as u32,
            pkey_tbl_len: self.port.pkey_tbl_len,
            max_qp_rd_atom: self.device.max_qp_rd_atom,
            max_qp_dest_rd_atom: self.device.max_qp_rd_atom,
            phys_port_cnt: self.device.phys_port_cnt,
        }
    }
}
