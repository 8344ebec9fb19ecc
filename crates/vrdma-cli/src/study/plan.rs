//! What the study runs: the parameters resolved from the command line,
//! the placements that can run on this machine, and why others cannot.

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use super::Args;

/// Where the two sides of a transfer live.
#[derive(clap::ValueEnum, Serialize, Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// Process to process on one host, one daemon.
    Process,
    /// Container to container: each tenant side in its own network namespace, one daemon.
    Container,
    /// Across hosts: two namespaces joined by veth, a daemon in each, the TCP transport.
    Hosts,
    /// VM to VM on one host: QEMU guests of one daemon, a virtual link per VM pair.
    Vm,
}

impl Placement {
    pub const ALL: [Placement; 4] =
        [Placement::Process, Placement::Container, Placement::Hosts, Placement::Vm];

    pub fn name(self) -> &'static str {
        match self {
            Placement::Process => "process",
            Placement::Container => "container",
            Placement::Hosts => "hosts",
            Placement::Vm => "vm",
        }
    }

    /// The heading a paper would use.
    pub fn title(self) -> &'static str {
        match self {
            Placement::Process => "process-process (1 host)",
            Placement::Container => "container-container (1 host)",
            Placement::Hosts => "host-host (veth, TCP link)",
            Placement::Vm => "VM-VM (1 host, QEMU)",
        }
    }
}

/// How the bytes travel.
#[derive(Serialize, Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    Tcp,
    Vrdma,
}

impl Protocol {
    pub const ALL: [Protocol; 2] = [Protocol::Vrdma, Protocol::Tcp];

    pub fn name(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Vrdma => "vRDMA",
        }
    }

    /// The `vrdma bench` test a transfer cell runs.
    pub fn transfer_test(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp_bw",
            Protocol::Vrdma => "rc_rdma_write_bw",
        }
    }
}

/// The tenants of the four-tenant cells (uids when root).
pub const TENANTS: u32 = 4;
/// The first tenant's uid; tenant i is FIRST_UID + i.
pub const FIRST_UID: u32 = 61001;

/// The qperf-style set run per placement: latency tests (8 B) and
/// bandwidth tests (the message size), with the protocol each belongs to.
pub const LATENCY_SET: [(&str, Protocol); 3] =
    [("rc_lat", Protocol::Vrdma), ("rc_rdma_write_lat", Protocol::Vrdma), ("tcp_lat", Protocol::Tcp)];
pub const BANDWIDTH_SET: [(&str, Protocol); 3] =
    [("rc_bw", Protocol::Vrdma), ("rc_rdma_write_bw", Protocol::Vrdma), ("tcp_bw", Protocol::Tcp)];

#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    #[serde(skip)]
    pub out: PathBuf,
    pub quick: bool,
    /// Bytes per transfer cell and run (split between the tenants).
    pub bytes: u64,
    pub runs: u32,
    pub message_size: u64,
    /// Seconds per test of the latency/bandwidth set.
    pub set_seconds: f64,
    pub placements: Vec<Placement>,
    /// Whether the four-tenant cells run (as four uids).
    pub four_tenants: bool,
    /// Whether the workers run as tenant uids (root only).
    pub as_uids: bool,
    /// VM pairs the vm placement boots (its four-tenant cells' tenants).
    pub vm_pairs: u32,
    pub anchors: bool,
    /// What was left out and why: (what, why).
    pub skipped: Vec<(String, String)>,
}

impl Plan {
    pub fn from_args(a: &Args) -> Result<Plan, String> {
        let runs = a.runs.unwrap_or(if a.quick { 2 } else { 10 });
        let bytes = a.bytes.unwrap_or(if a.quick { 32 << 20 } else { 1 << 30 });
        let message_size = a.message_size.unwrap_or(64 << 10);
        let set = a.time.unwrap_or(Duration::from_millis(if a.quick { 200 } else { 1000 }));
        if bytes < u64::from(TENANTS) * message_size {
            return Err(format!(
                "--bytes {bytes} is less than {TENANTS} messages of {message_size} bytes (the four-tenant cells \
                 split it between the tenants); use at least {}",
                u64::from(TENANTS) * message_size
            ));
        }
        let out = match &a.out {
            Some(p) => p.clone(),
            None => PathBuf::from(format!("vrdma-study-{}", timestamp())),
        };
        check_out(&out)?;
        let mut placements: Vec<Placement> =
            if a.placements.is_empty() { Placement::ALL.to_vec() } else { a.placements.clone() };
        placements.sort();
        placements.dedup();
        let mut skipped = Vec::new();
        let root = is_root();
        let needs_netns = |p: &Placement| matches!(p, Placement::Container | Placement::Hosts);
        if let Some(why) = netns_unavailable(root) {
            for p in placements.iter().filter(|p| needs_netns(p)) {
                skipped.push((format!("placement {}", p.name()), why.clone()));
            }
            placements.retain(|p| !needs_netns(p));
        }
        if placements.contains(&Placement::Vm) {
            if let Some(why) = vm_unavailable(root) {
                skipped.push(("placement vm".into(), why));
                placements.retain(|p| *p != Placement::Vm);
            }
        }
        if !root {
            skipped.push((
                "the four-tenant cells".into(),
                "tenants are uids (the daemon tells them apart by SO_PEERCRED); running workers as other \
                 uids needs root"
                    .into(),
            ));
        }
        if placements.is_empty() {
            return Err("no placement can run here: ".to_string()
                + &skipped.iter().map(|(w, y)| format!("{w}: {y}")).collect::<Vec<_>>().join("; "));
        }
        if a.no_anchors {
            skipped.push(("the anchors (qperf, iperf3, perftest)".into(), "--no-anchors".into()));
        }
        Ok(Plan {
            out,
            quick: a.quick,
            bytes,
            runs,
            message_size,
            set_seconds: set.as_secs_f64(),
            placements,
            four_tenants: root,
            as_uids: root,
            vm_pairs: TENANTS,
            anchors: !a.no_anchors,
            skipped,
        })
    }

    /// The concurrency levels of the transfer cells.
    pub fn concurrency(&self) -> Vec<u32> {
        if self.four_tenants {
            vec![1, TENANTS]
        } else {
            vec![1]
        }
    }

    /// The concurrency levels of the vm placement's transfer cells.
    pub fn vm_concurrency(&self) -> Vec<u32> {
        if self.four_tenants && self.vm_pairs > 1 {
            vec![1, self.vm_pairs]
        } else {
            vec![1]
        }
    }

    /// The uid of tenant `i` (None: this process's own).
    pub fn uid(&self, i: u32) -> Option<u32> {
        self.as_uids.then_some(FIRST_UID + i)
    }
}

pub fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Why the namespace placements cannot run, if they cannot.
fn netns_unavailable(root: bool) -> Option<String> {
    if !root {
        return Some("network namespaces and veth pairs need root".into());
    }
    let ip = std::process::Command::new("ip")
        .arg("-V")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
    if !ip.is_ok_and(|s| s.success()) {
        return Some("no `ip` command (apt-get install iproute2)".into());
    }
    None
}

/// Why the vm placement cannot run, if it cannot (the image's kernel
/// and the guests' boots are found out when it is set up).
fn vm_unavailable(root: bool) -> Option<String> {
    if !root {
        return Some(
            "its VMs are tenants of uids 61001-61004, which only root (or that uid) may attach, and the study \
             runs as one uid"
                .into(),
        );
    }
    if vrdma_guest::libs::which(vrdma_guest::guest::QEMU).is_none() {
        return Some(format!(
            "{} is not installed (apt-get install qemu-system-x86 busybox-static)",
            vrdma_guest::guest::QEMU
        ));
    }
    if !std::path::Path::new(vrdma_guest::image::BUSYBOX).is_file() {
        return Some(format!(
            "no {} for the guests' initramfs (apt-get install busybox-static)",
            vrdma_guest::image::BUSYBOX
        ));
    }
    None
}

/// The output directory must be new, or empty.
fn check_out(out: &std::path::Path) -> Result<(), String> {
    match std::fs::metadata(out) {
        Err(_) => Ok(()),
        Ok(m) if !m.is_dir() => Err(format!("--out {}: exists and is not a directory", out.display())),
        Ok(_) => match std::fs::read_dir(out).map(|mut d| d.next().is_none()) {
            Ok(true) => Ok(()),
            Ok(false) => Err(format!(
                "--out {}: the directory is not empty (the study will not overwrite)",
                out.display()
            )),
            Err(e) => Err(format!("--out {}: {e}", out.display())),
        },
    }
}

/// Local time as YYYYmmdd-HHMMSS.
pub fn timestamp() -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let t = now as libc::time_t;
    // SAFETY: localtime_r writes into the tm we own; a zeroed tm is valid.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are valid for the call.
    unsafe { libc::localtime_r(&t, &mut tm) };
    format!(
        "{:04}{:02}{:02}-{:02}{:02}{:02}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec
    )
}

/// A byte count with an optional binary unit: 1048576, 64K, 512M, 1G, 2GiB.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let n: u64 = num.parse().map_err(|_| format!("'{s}' is not a byte count (e.g. 64M, 1G)"))?;
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(format!("'{s}': unknown unit '{unit}' (use K, M, G or T)")),
    };
    let bytes = n.checked_shl(shift).filter(|b| b >> shift == n).unwrap_or(u64::MAX);
    const MAX: u64 = 1 << 40;
    if bytes == 0 || bytes > MAX {
        return Err(format!("'{s}': the byte count must be 1 B to 1 TiB"));
    }
    Ok(bytes)
}

/// A message size: 1 B to 64 MiB (what `vrdma bench` carries).
pub fn parse_message_size(s: &str) -> Result<u64, String> {
    crate::bench::parse_size(s).map(|v| v as u64)
}

pub fn parse_seconds(s: &str) -> Result<Duration, String> {
    let d = crate::bench::parse_seconds(s)?;
    if d > Duration::from_secs(60) {
        return Err(format!("'{s}': at most 60 seconds per test"));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_parse() {
        assert_eq!(parse_bytes("1G"), Ok(1 << 30));
        assert_eq!(parse_bytes("64M"), Ok(64 << 20));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("2P").unwrap_err().contains("unknown unit"));
        assert!(parse_bytes("2T").is_err());
        assert!(parse_bytes("-5").is_err());
        assert!(parse_bytes("99999999999999999999").is_err());
    }
}
