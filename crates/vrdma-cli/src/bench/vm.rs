//! `vrdma bench --vm`: VM-to-VM figures (issue 18, item 7) beside
//! process-to-process ones measured in the same run on the same daemon.
//!
//! One daemon of this run's own with a VM pair (the study's vm placement,
//! [`crate::study::vm::VmSite`]: booted with `vrdma vm run`, joined by a
//! QEMU link of their own), both VMs tenants of this uid; then, per run,
//! `vrdma bench` 8 B RDMA write latency (`rc_rdma_write_lat`) and 1 MiB
//! RDMA write bandwidth (`rc_rdma_write_bw`) from one VM to the other,
//! and the same between two host processes (the local mode: a client and
//! its server process) on the same daemon. The accelerator is named: under
//! TCG the guests' figures are functional, not comparable (the goal,
//! latency at most 1.5x and bandwidth at least 0.9x process-to-process,
//! is for KVM).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{anyhow, Context as _, Result};

use super::suite::Figure;
use super::{anchors, Args};
use crate::study::placement::Env;
use crate::study::vm::VmSite;

/// A directory of this run (the daemon's socket and config, the link
/// socket, logs), removed on drop.
struct WorkDir(std::path::PathBuf);

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn figures(args: &Args, runs: usize, cores: usize, progress: &dyn Fn(&str)) -> Result<Vec<Figure>> {
    let secs = if args.quick { 0.5 } else { 2.0 };
    let work = WorkDir(std::env::temp_dir().join(format!("vrdma-bench-vm-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&work.0);
    std::fs::create_dir_all(&work.0)?;
    let exe = std::env::current_exe().context("where is the vrdma executable")?;
    let run_id = format!("{}-bench-vm", std::process::id());
    let env = Env { exe: &exe, dir: &work.0, logs: &work.0, run_id: &run_id };
    // SAFETY: geteuid cannot fail.
    let uid = unsafe { libc::geteuid() };
    progress("building the guest image and booting two VMs (about 30 s under TCG)");
    let mut notes = Vec::new();
    let mut site = VmSite::setup(&env, &[uid], false, &mut notes)?;
    let accel = site.accel.name();
    let tests = [
        ("rc_rdma_write_lat", 8usize, "RDMA write 8 B, one way", "us"),
        ("rc_rdma_write_bw", 1 << 20, "RDMA write 1 MiB, bandwidth", "GB/s"),
    ];
    let mut out = Vec::new();
    for (test, size, what, unit) in tests {
        progress(&format!("measuring {what}: VM to VM and process to process, {runs} run(s)"));
        let (mut vm, mut host) = (Vec::new(), Vec::new());
        let a = format!("{test} --size {size} --time {secs}");
        for _ in 0..runs {
            let o = site.bench(0, &a, Duration::from_secs_f64(120.0 + 4.0 * secs))?;
            vm.push(figure(&o, unit)?);
            host.push(figure(&host_bench(&exe, site.socket(), &a, secs)?, unit)?);
        }
        let (value, anchor) = (anchors::Stat::from_samples(&vm), anchors::Stat::from_samples(&host));
        let goal = if unit == "us" { "<= 1.5x" } else { ">= 0.9x" };
        let target = if site.accel == vrdma_guest::Accel::Kvm {
            goal.to_string()
        } else {
            format!("{goal} under KVM; TCG: functional only")
        };
        let name = format!("VM to VM ({accel}): {what}");
        out.push(Figure::beside(name, unit, value, "2 host processes, same daemon", anchor, target, cores));
    }
    Ok(out)
}

/// `vrdma bench ARGS --json` between two host processes on the daemon at `socket`.
fn host_bench(exe: &Path, socket: &Path, args: &str, secs: f64) -> Result<String> {
    let mut c = Command::new(exe);
    c.arg("bench").args(args.split_whitespace()).arg("--json");
    c.env(vrdma::SOCKET_ENV, socket).env("VRDMA_LOG", "warn");
    c.stdin(std::process::Stdio::null());
    let mut child = c.stdout(std::process::Stdio::piped()).spawn().context("starting vrdma bench")?;
    let mut stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut stdout, &mut s);
        s
    });
    let end = std::time::Instant::now() + Duration::from_secs_f64(60.0 + 4.0 * secs);
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break st;
        }
        if std::time::Instant::now() > end {
            // Our unreaped child: the pid is still its.
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!("vrdma bench {args} between host processes did not finish in time; killed");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let out = reader.join().unwrap_or_default();
    if !status.success() {
        anyhow::bail!("vrdma bench {args} between host processes: {status}");
    }
    Ok(out)
}

/// The first row's median latency (µs) or bandwidth (GB/s).
fn figure(json: &str, unit: &str) -> Result<f64> {
    let v: serde_json::Value = serde_json::from_str(json).context("vrdma bench's JSON")?;
    let row = &v["results"][0];
    let f = if unit == "us" {
        row["latency"]["median_us"].as_f64()
    } else {
        row["bandwidth"]["gb_per_s"].as_f64()
    };
    f.ok_or_else(|| anyhow!("no {unit} figure in {row}"))
}
