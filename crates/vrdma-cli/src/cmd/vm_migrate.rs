//! `vrdma vm migrate NAME --to SOCKET --qmp PATH --to-qmp PATH --uri URI`:
//! a live migration of a VM with vRDMA attached, QEMU's part and the
//! daemons' in one command (issue 19, `docs/migration.md`, "Worked
//! example: QEMU moves a VM").
//!
//! The order is the one the worked example gives, and it is the point of
//! the command: QEMU's live pass runs while the guest and its RDMA
//! traffic go on; only once QEMU's migration completed (the source's
//! CPUs stopped) and the destination loaded the VM does the daemon step
//! run (`migrate::move_steps`: pause, export, the region's last copy,
//! import, finish, resume), and only then do the destination's CPUs run.
//! Each failure leaves at most one copy of the VM able to run, and says
//! where it is (a VM the operator had paused is continued nowhere):
//!
//! - QEMU's migration fails or is cancelled: QEMU itself runs the VM on
//!   at the source; nothing of vRDMA was touched. One that does not
//!   complete within QEMU's wait (`qmp::MIGRATION_LIMIT`) is cancelled,
//!   and goes on if it completed meanwhile. The error says what the
//!   source's QEMU reports, never a guess.
//! - The destination does not load the VM, or the daemon step is refused
//!   before the point of return (the tenant resumed at the source): the
//!   destination's QEMU, whose copy never ran, quits first, then the
//!   source's CPUs are continued (`cont`, which QEMU allows after a
//!   completed migration; the destination was told `late-block-activate`
//!   so that it does not hold the disks' image locks before its own
//!   `cont`).
//! - A destination started without `-S` runs the VM as soon as it loaded
//!   it, without its vRDMA state and ahead of the source's copy: it is
//!   stopped, nothing of vRDMA moves, and both stay stopped for the
//!   operator to choose.
//! - The daemon step fails past that point: both QEMUs stay stopped and
//!   the error says where the tenant is.
//!
//! Both QEMUs' QMP sockets and both daemons' control sockets must be
//! reachable from here (one machine, or sockets forwarded); between
//! machines without that, run the worked example's steps by hand.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use vrdma_guest::qmp::Qmp;

use super::migrate::{move_steps, MoveError};
use super::vm_qemu::{check_runs_vm, qmp};

/// What the command is told.
pub struct Request<'a> {
    pub name: &'a str,
    /// The source's and the destination's daemons.
    pub from: &'a Path,
    pub to: &'a Path,
    /// The source's and the destination's QMP sockets.
    pub qmp: &'a Path,
    pub to_qmp: &'a Path,
    /// Where the source's QEMU sends the VM (the destination's
    /// `-incoming`), as QMP's `migrate` takes it.
    pub uri: &'a str,
    /// Quit the source's QEMU once the VM runs at the destination.
    pub quit_source: bool,
}

pub fn run(r: &Request<'_>) -> Result<()> {
    let tenant = vrdma::migrate::vm_tenant(r.from, r.name)
        .with_context(|| format!("the tenant of VM {:?} (daemon at {})", r.name, r.from.display()))?;
    let mut qa = qmp(r.qmp, "the source's")?;
    let mut qc = qmp(r.to_qmp, "the destination's")?;
    let (sa, sc) = (qa.status()?, qc.status()?);
    if sc != "inmigrate" {
        bail!(
            "the destination's QEMU ({}) is {sc:?}, not waiting for a VM: start it with `-incoming {}` \
             (and -S), attached with `vrdma --socket {} vm run {}`",
            r.to_qmp.display(),
            r.uri,
            r.to.display(),
            r.name
        );
    }
    if !matches!(sa.as_str(), "running" | "paused") {
        bail!("the source's QEMU ({}) is {sa:?}: it has no VM to migrate", r.qmp.display());
    }
    // Each QEMU is VM NAME of its daemon (`vm_qemu`), before any step.
    check_runs_vm(&mut qa, r.qmp, "the source's", r.from, r.name)?;
    check_runs_vm(&mut qc, r.to_qmp, "the destination's", r.to, r.name)?;
    // Where the VM ran before: only a running VM is continued, here or
    // there.
    let was_running = sa == "running";
    // The destination activates its disks (and takes their image locks)
    // at its `cont`, not at the end of the load, so that the source can
    // take them back if the move is refused. Best effort: without it a
    // refused move's `cont` of the source may fail on the locks.
    let late = r#"{"execute":"migrate-set-capabilities","arguments":{"capabilities":[{"capability":"late-block-activate","state":true}]}}"#;
    if let Err(e) = qc.exec(late) {
        eprintln!(
            "vrdma: the destination's QEMU did not take late-block-activate ({e}): were the move refused, \
             the source's disks might stay locked by it"
        );
    }

    // QEMU's live pass, the guest and its traffic running meanwhile.
    let t0 = Instant::now();
    qa.migrate(r.uri).context("the source's QEMU refused to migrate")?;
    let m = match qa.wait_completed() {
        Ok(m) => m,
        // Still running after QEMU's limit: cancelled (it might complete
        // later with nobody to make the daemon step and continue the VM),
        // unless it completed meanwhile.
        Err(e @ vrdma_guest::qmp::Error::Waited { .. }) => {
            let _ = qa.exec(r#"{"execute":"migrate_cancel"}"#);
            match qa.wait_migration(|m| {
                !matches!(
                    m["status"].as_str(),
                    Some("active" | "setup" | "device" | "pre-switchover" | "cancelling")
                )
            }) {
                Ok(m) if m["status"].as_str() == Some("completed") => m,
                _ => {
                    return Err(anyhow::Error::new(e).context(source_state(
                        &mut qa,
                        "QEMU's migration did not complete in time and was cancelled",
                    )))
                }
            }
        }
        Err(e) => {
            return Err(
                anyhow::Error::new(e).context(source_state(&mut qa, "QEMU's migration did not complete"))
            )
        }
    };
    let completed = Instant::now();
    // Back to the source, before the point of return: the destination's
    // copy, which never ran, goes first, so that only one can ever run.
    let resume_source = |qa: &mut Qmp, qc: &mut Qmp, why: anyhow::Error| -> anyhow::Error {
        let _ = qc.exec(r#"{"execute":"quit"}"#);
        if !was_running {
            return why.context("the VM stays paused at the source, as it was; the destination's QEMU quit");
        }
        match qa.exec(r#"{"execute":"cont"}"#) {
            Ok(_) => why.context("the VM runs on at the source; the destination's QEMU quit"),
            Err(e) => why.context(format!(
                "the destination's QEMU quit, and continuing the source's failed: {e} (the VM runs nowhere)"
            )),
        }
    };
    if let Err(e) = qc.wait_loaded() {
        let e = anyhow::Error::new(e).context("the destination did not load the VM");
        return Err(resume_source(&mut qa, &mut qc, e));
    }
    match qc.status() {
        Ok(st) if st == "paused" => {}
        Ok(st) if st == "running" => {
            // Started without -S: it runs the VM already, without its
            // vRDMA state, and the source's copy is behind it.
            let _ = qc.exec(r#"{"execute":"stop"}"#);
            bail!(
                "the destination's QEMU ran the VM as soon as it loaded it (started without -S): stopped; \
                 nothing of vRDMA moved (its state is at the source, untouched). Both copies are stopped, \
                 the destination's ahead of the source's: decide which goes on"
            );
        }
        Ok(st) => {
            let e = anyhow::anyhow!("the destination's QEMU is {st:?} after the load");
            return Err(resume_source(&mut qa, &mut qc, e));
        }
        Err(e) => {
            let e = anyhow::Error::new(e).context("the destination's QEMU after the load");
            return Err(resume_source(&mut qa, &mut qc, e));
        }
    }
    let step = Instant::now();
    let moved = match move_steps(r.from, r.to, tenant, Some(r.name)) {
        Ok(m) => m,
        Err(MoveError::AtSource(e)) => return Err(resume_source(&mut qa, &mut qc, e)),
        Err(MoveError::Stuck(e)) => {
            return Err(
                e.context("both QEMUs are left stopped (`cont` the one whose daemon serves the tenant)")
            )
        }
    };
    let step = step.elapsed();
    if was_running {
        qc.exec(r#"{"execute":"cont"}"#).context("continuing the destination's QEMU")?;
    }
    let stopped = completed.elapsed();
    if r.quit_source {
        // QEMU answers `quit` and closes: an error here is its going.
        let _ = qa.exec(r#"{"execute":"quit"}"#);
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "VM {:?} moved to {}: QEMU's live pass {:.0} ms ({} dirty syncs, its downtime {} ms); the vRDMA step \
         {:.0} ms ({} QPs, {} bytes of device state); the VM stopped {:.0} ms from QEMU's completion to the \
         destination's cont{}",
        r.name,
        r.to.display(),
        ms(completed - t0),
        m["ram"]["dirty-sync-count"].as_u64().unwrap_or(0),
        m["downtime"].as_u64().map_or("?".to_string(), |d| d.to_string()),
        ms(step),
        moved.qps,
        moved.bytes,
        ms(stopped),
        if was_running { "" } else { " (not continued: it was paused at the source)" },
    );
    Ok(())
}

/// `what` happened to QEMU's migration: where the VM is now, as the
/// source's QEMU says (QEMU continues a VM that ran when its migration
/// fails or is cancelled).
fn source_state(qa: &mut Qmp, what: &str) -> String {
    match qa.status() {
        Ok(st) if st == "running" => format!("{what}; the VM runs on at the source"),
        Ok(st) => format!("{what}; the source's QEMU is {st:?} (see its query-migrate)"),
        Err(e) => {
            format!("{what}; the source's QEMU does not say where the VM is ({e}): see its query-migrate")
        }
    }
}

/// The CLI's arguments of `vrdma vm migrate`.
#[derive(clap::Args)]
pub struct Args {
    /// The VM's name in both daemons' configs (the same `[vms.NAME]`).
    pub name: String,
    /// The destination daemon's control socket (`--socket` is the source's).
    #[arg(long, value_name = "SOCKET")]
    pub to: PathBuf,
    /// The source QEMU's QMP socket.
    #[arg(long, value_name = "PATH")]
    pub qmp: PathBuf,
    /// The destination QEMU's QMP socket (started with -incoming URI and -S).
    #[arg(long, value_name = "PATH")]
    pub to_qmp: PathBuf,
    /// Where the source's QEMU sends the VM: the destination's -incoming URI (e.g. unix:/run/mig.sock).
    #[arg(long, value_name = "URI")]
    pub uri: String,
    /// Quit the source's QEMU once the VM runs at the destination.
    #[arg(long)]
    pub quit_source: bool,
}
