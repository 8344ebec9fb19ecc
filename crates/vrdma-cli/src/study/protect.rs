//! The latency-beside-a-hog cell (issue 21, item 7): a victim tenant's 8 B
//! `rc_lat` unloaded, then beside a tenant streaming 64 KiB RDMA writes
//! over 64 QPs (`vrdma misbehave --how stream`, as the bench's hog), as a
//! tenant of the default class and as one of `latency_class = "latency"`,
//! in the same run on the same daemon.
//!
//! Two cells, each with daemons of its own, the direct path off (the
//! hog's writes go through the engine, whose order of service is what is
//! measured) and the protected uid's class set:
//!
//! - one host ([`cell`]), processes on one daemon;
//! - across hosts ([`cell_hosts`]): two network namespaces joined by veth,
//!   a daemon in each linked by the TCP transport (as the study's hosts
//!   placement); the victims' `rc_lat` clients on host A, their servers
//!   on host B, the hog's 64 QPs on host A writing to QPs on host B, so
//!   that what the victim waits behind is the link (the daemons' rounds,
//!   queues and sockets: `hca::remote`, `net.max_queued_kib`).
//!
//! Tenants are uids, so the cells run only as root.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::Command;
use std::time::Duration;

use anyhow::{anyhow, Result};

use super::data::{Record, Section};
use super::netns::Namespaces;
use super::placement::{daemon, host_pair, Env, Place};
use super::plan::{Placement, Plan, Protocol, FIRST_UID, TENANTS};
use super::proc::{self, Proc};
use super::run::{client, rows};

/// The victim's uid without the class, with it, and the hog's: after the
/// four-tenant cells' uids.
pub const PLAIN_UID: u32 = FIRST_UID + TENANTS;
pub const PROTECTED_UID: u32 = FIRST_UID + TENANTS + 1;
pub const HOG_UID: u32 = FIRST_UID + TENANTS + 2;

/// The tests' names in the records, in the order of the table.
pub const UNLOADED: &str = "rc_lat 8 B, unloaded (anchor of this cell)";
pub const BESIDE: &str = "rc_lat 8 B beside a 64-QP hog, latency_class \"normal\"";
pub const PROTECTED: &str = "rc_lat 8 B beside a 64-QP hog, latency_class \"latency\"";

/// A `vrdma bench --server` as `uid` on `place`.
fn server(env: &Env, place: &Place, uid: u32) -> Result<(SocketAddr, Proc)> {
    let mut cmd = Command::new(env.exe);
    cmd.args(["bench", "--server", "--listen", &SocketAddr::new(place.addr, 0).to_string()])
        .env(vrdma::SOCKET_ENV, &place.socket)
        .env("VRDMA_LOG", "warn");
    let name = format!("protect server {uid}");
    let log = env.logs.join(format!("protect-server-{uid}.log"));
    let mut p = proc::spawn(&name, cmd, &place.at(Some(uid)), env.run_id, &log)?;
    let line = p.line(Duration::from_secs(20))?;
    let addr = line
        .trim()
        .rsplit(' ')
        .next()
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| anyhow!("{name} said {line:?}"))?;
    Ok((addr, p))
}

/// The daemons' configuration of both cells (after any table of their own).
fn config() -> String {
    format!("[direct]\nenabled = false\n[tenants.{PROTECTED_UID}]\nlatency_class = \"latency\"\n")
}

/// Every run of the one-host cell.
pub fn cell(env: &Env, plan: &Plan, interrupted: &dyn Fn() -> bool) -> Result<Vec<Record>> {
    let sock = env.dir.join("protect.sock");
    let _daemon = daemon(env, "protect", &sock, None, &config())?;
    let place = Place { netns: None, socket: sock, addr: IpAddr::V4(Ipv4Addr::LOCALHOST) };
    runs(env, plan, interrupted, Placement::Process, &place, &place, "protect")
}

/// Every run of the cell across hosts: two namespaces, a daemon in each.
pub fn cell_hosts(env: &Env, plan: &Plan, interrupted: &dyn Fn() -> bool) -> Result<Vec<Record>> {
    // Dropped in reverse order: the daemons before their namespaces.
    let mut ns = Namespaces::default();
    let (_daemons, [a, b], _) = host_pair(env, &mut ns, "p", 30, "protect-host", &config())?;
    runs(env, plan, interrupted, Placement::Hosts, &a, &b, "protect-hosts")
}

/// The runs of a cell: the victims' clients on `from`, their servers on
/// `to`, the hog's QPs on `from` writing to QPs on `to` (on one daemon
/// when they are one place, each QP to itself).
fn runs(
    env: &Env,
    plan: &Plan,
    interrupted: &dyn Fn() -> bool,
    placement: Placement,
    from: &Place,
    to: &Place,
    tag: &str,
) -> Result<Vec<Record>> {
    let (plain_addr, _plain) = server(env, to, PLAIN_UID)?;
    let (protected_addr, _protected) = server(env, to, PROTECTED_UID)?;
    let lat = ["rc_lat".to_string(), "--time".into(), format!("{}", plan.set_seconds)];
    let limit = Duration::from_secs_f64(60.0 + 4.0 * plan.set_seconds);
    let mut out = Vec::new();
    for run in 1..=plan.runs {
        if interrupted() {
            break;
        }
        let measure = |uid: u32, addr: SocketAddr, test: &str| -> Result<Record> {
            let name = format!("{tag}-{uid}-run{run}");
            let o = client(env, from, Some(uid), addr, &lat, &name)?.finish(limit)?;
            let row = rows(&o)?.into_iter().next().ok_or_else(|| anyhow!("no result row"))?;
            let l = row["latency"].as_object().ok_or_else(|| anyhow!("no latency in {row}"))?;
            let f = |k: &str| l.get(k).and_then(|v| v.as_f64());
            Ok(Record {
                section: Section::Protection,
                placement,
                protocol: Protocol::Vrdma,
                tenants: 2,
                tenant: None,
                tool: "vrdma bench",
                test: test.to_string(),
                size: 8,
                run,
                value: f("median_us").ok_or_else(|| anyhow!("no median in {row}"))?,
                unit: "us",
                bytes: None,
                seconds: None,
                average_us: f("average_us"),
                p99_us: f("p99_us"),
            })
        };
        out.push(measure(PLAIN_UID, plain_addr, UNLOADED)?);
        let mut cmd = Command::new(env.exe);
        cmd.args(["misbehave", "--how", "stream", "--qps", "64", "--millis", "600000"])
            .env(vrdma::SOCKET_ENV, &from.socket)
            .env("VRDMA_LOG", "error");
        if to.socket != from.socket {
            cmd.arg("--to").arg(&to.socket);
        }
        let log = env.logs.join(format!("{tag}-hog-run{run}.log"));
        let mut hog =
            proc::spawn_piped(&format!("{tag} hog"), cmd, &from.at(Some(HOG_UID)), env.run_id, &log)?;
        let ready = hog.line(Duration::from_secs(60))?;
        if !ready.starts_with("ready ") {
            return Err(anyhow!("the hog said {ready:?}"));
        }
        std::thread::sleep(Duration::from_millis(200));
        out.push(measure(PLAIN_UID, plain_addr, BESIDE)?);
        out.push(measure(PROTECTED_UID, protected_addr, PROTECTED)?);
        drop(hog);
    }
    Ok(out)
}
