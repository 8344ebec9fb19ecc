//! The Open MPI rows of `vrdma bench --direct` (issue 17, item 6): an 8 B
//! `MPI_Send`/`MPI_Recv` ping-pong (`mpi_pingpong.c`, built here with
//! `mpicc`) over UCX's `rc_verbs` over vRDMA (`vrdma run -- mpirun`, as
//! `tests/ucx.rs` runs Open MPI), on a private daemon with the direct
//! path on and one with it off, beside the same program over Open MPI's
//! own shared memory (`--mca btl self,vader`) in the same run, and beside
//! `vrdma bench`'s own 8 B send on the same daemon (the issue: within
//! 1.5×). Skipped, with the reason, when `mpicc` or `mpirun` is missing.
//!
//! Which path: the drop-in library's carried counts stay in the ranks, so
//! the row reads the daemon's count of the tenant's engine messages
//! (`vrdma stat --json`, `messages_sent`) before and after each run, and
//! names the path from it: fewer engine messages than a tenth of the
//! ping-pong's is the direct path, at least as many as its messages is
//! the engine's, anything between "both paths". The row never claims the
//! direct path without that count.
//!
//! Every process runs in a process group of its own under a deadline and
//! the group is killed by its id past it (mpirun starts ranks and orted).

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};

use super::anchors::Stat;
use super::suite::{latency, Figure, Outcome};
use super::Args;

const SOURCE: &str = include_str!("mpi_pingpong.c");
/// One mpirun (or mpicc) at most.
const LIMIT: Duration = Duration::from_secs(180);

fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(program)).find(|p| p.is_file())
}

/// Why the rows cannot be measured here, if they cannot.
pub fn unavailable() -> Option<String> {
    for (tool, pkg) in [("mpicc", "libopenmpi-dev"), ("mpirun", "openmpi-bin")] {
        if which(tool).is_none() {
            return Some(format!("{tool} is not installed ({pkg})"));
        }
    }
    None
}

/// The built program in a directory of its own, removed on drop.
struct Program {
    dir: PathBuf,
    exe: PathBuf,
}

impl Drop for Program {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn build() -> Result<Program> {
    let dir = std::env::temp_dir().join(format!("vrdma-bench-mpi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let program = Program { exe: dir.join("mpi_pingpong"), dir };
    let src = program.dir.join("mpi_pingpong.c");
    std::fs::write(&src, SOURCE)?;
    let mut c = Command::new("mpicc");
    c.args(["-O2", "-o"]).arg(&program.exe).arg(&src);
    bounded(c).context("mpicc")?;
    Ok(program)
}

/// A child in a process group of its own, the group killed on drop.
struct Group(Child);

impl Drop for Group {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            // SAFETY: kill(2) of the process group this child leads (it was
            // spawned with process_group(0), so its pgid is its pid).
            unsafe { libc::kill(-(self.0.id() as libc::pid_t), libc::SIGKILL) };
        }
        let _ = self.0.wait();
    }
}

/// Runs `cmd` to its end within `LIMIT`; its stdout, or an error with its
/// stderr's tail.
fn bounded(mut cmd: Command) -> Result<String> {
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
    let mut g = Group(cmd.spawn()?);
    let reader = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut r) = r {
                let _ = r.read_to_string(&mut s);
            }
            s
        })
    };
    let out = reader(g.0.stdout.take().map(|o| Box::new(o) as Box<dyn Read + Send>));
    let err = reader(g.0.stderr.take().map(|o| Box::new(o) as Box<dyn Read + Send>));
    let end = Instant::now() + LIMIT;
    let status = loop {
        if let Some(s) = g.0.try_wait()? {
            break s;
        }
        if Instant::now() > end {
            drop(g);
            bail!("ran past {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (out, err) = (out.join().unwrap_or_default(), err.join().unwrap_or_default());
    if !status.success() {
        let tail: String =
            err.lines().rev().take(8).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
        bail!("{status}: {tail}");
    }
    Ok(out)
}

/// `pingpong <n> median_ns <m> mean_ns <a>` → (m, a).
fn parse(out: &str) -> Option<(f64, f64)> {
    let line = out.lines().find(|l| l.starts_with("pingpong "))?;
    let w: Vec<&str> = line.split_whitespace().collect();
    let (m, a): (f64, f64) = (w.get(3)?.parse().ok()?, w.get(5)?.parse().ok()?);
    (m.is_finite() && m > 0.0 && a.is_finite()).then_some((m, a))
}

fn mpirun(pml: &[&str], exe: &Path, n: u64) -> Vec<String> {
    let mut a: Vec<String> =
        ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2"].map(String::from).into();
    a.extend(pml.iter().map(|s| s.to_string()));
    a.push(exe.display().to_string());
    a.push(n.to_string());
    a
}

fn over_vader(exe: &Path, n: u64) -> Result<f64> {
    let args = mpirun(&["--mca", "pml", "ob1", "--mca", "btl", "self,vader"], exe, n);
    let mut c = Command::new(&args[0]);
    c.args(&args[1..]);
    let out = bounded(c).context("mpirun over vader")?;
    parse(&out).map(|(m, _)| m).ok_or_else(|| anyhow!("mpirun over vader printed no result: {out}"))
}

fn over_vrdma(sock: &Path, exe: &Path, n: u64) -> Result<f64> {
    let pml = ["--mca", "pml", "ucx", "--mca", "btl", "^vader,tcp,openib,uct"];
    let mut c = Command::new(std::env::current_exe()?);
    c.arg("--socket").arg(sock).args(["run", "--"]).args(mpirun(&pml, exe, n)).env("UCX_TLS", "rc_v");
    let out = bounded(c).context("vrdma run -- mpirun over UCX rc_verbs")?;
    parse(&out).map(|(m, _)| m).ok_or_else(|| anyhow!("mpirun over vRDMA printed no result: {out}"))
}

/// The tenant's engine messages so far (`vrdma stat --json`).
fn engine_messages(sock: &Path) -> Result<u64> {
    let mut c = Command::new(std::env::current_exe()?);
    c.arg("--socket").arg(sock).args(["stat", "--json"]);
    let out = bounded(c).context("vrdma stat")?;
    let v: serde_json::Value = serde_json::from_str(&out).context("vrdma stat --json")?;
    v["tenant"]["counters"]["messages_sent"].as_u64().ok_or_else(|| anyhow!("no messages_sent in vrdma stat"))
}

/// The path named from the engine's count of `through` messages of a
/// ping-pong of `messages` (see the module documentation).
fn path_of(through: u64, messages: u64) -> &'static str {
    if through.saturating_mul(10) < messages {
        "direct path"
    } else if through >= messages {
        "engine path"
    } else {
        "both paths"
    }
}

/// The rows; `sends` is `vrdma bench`'s own 8 B send (poll CQ) on the
/// daemon with the switch on and off, in that order.
pub fn figures(
    args: &Args,
    runs: usize,
    cores: usize,
    sends: &[Option<Stat>],
    progress: &dyn Fn(&str),
) -> Result<Vec<Figure>> {
    if let Some(why) = unavailable() {
        eprintln!("Open MPI ping-pong not measured: {why}");
        return Ok(Vec::new());
    }
    let n: u64 = if args.quick { 5_000 } else { 20_000 };
    // Both ranks send n + n/10 messages (the warm-up untimed).
    let messages = 2 * (n + n / 10);
    // The ranks load the drop-in library: a stale one fails here, saying
    // so, rather than in UCX's first call.
    crate::cmd::run::check_build_id(&crate::cmd::run::find_library()?)?;
    progress("building the MPI ping-pong (mpicc)");
    let program = build()?;
    progress("Open MPI 8 B ping-pong over vader");
    let vader = (0..runs).map(|_| over_vader(&program.exe, n)).collect::<Result<Vec<_>>>()?;
    let vader = Stat::from_samples(&vader);
    let mut out = Vec::new();
    for (i, (direct, switch)) in
        [(true, "direct path on"), (false, "direct path off")].into_iter().enumerate()
    {
        let dev = crate::embedded::private_device(super::engine_config(args), direct)?;
        let (mut lat, mut paths) = (Vec::new(), Vec::new());
        for _ in 0..runs {
            progress(&format!("Open MPI 8 B ping-pong over UCX over vRDMA, {switch}"));
            let before = engine_messages(dev.socket())?;
            let m = over_vrdma(dev.socket(), &program.exe, n)?;
            let through = engine_messages(dev.socket())?.saturating_sub(before);
            lat.push(Outcome { lat_ns: vec![m], messages: n, ..Default::default() });
            paths.push((path_of(through, messages), through));
        }
        let path = if paths.iter().all(|p| p.0 == paths[0].0) { paths[0].0 } else { "both paths" };
        if !direct && path == "direct path" {
            bail!("the Open MPI run on the daemon with the direct path off counted no engine messages");
        }
        let through: Vec<String> = paths.iter().map(|p| p.1.to_string()).collect();
        let name = format!(
            "Open MPI 8 B ping-pong, one way, UCX rc_verbs over vRDMA, {switch}: {path} \
             (engine messages per run {} of {messages})",
            through.join(", ")
        );
        let mut f = latency(
            &name,
            lat.clone(),
            "Open MPI over vader (shared memory), same program",
            Some(vader),
            cores,
        );
        (f.p99, f.target) = (None, "none (reference)".into());
        out.push(f);
        if let Some(Some(own)) = sends.get(i) {
            let anchor = format!("vrdma bench send 8 B, poll CQ, {switch}");
            let mut f = latency(&name, lat, &anchor, Some(*own), cores);
            (f.p99, f.target) = (None, "<= 1.5x vrdma bench".into());
            out.push(f);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_programs_line_is_read_and_the_path_named_from_the_engines_count() {
        assert_eq!(parse("x\npingpong 20000 median_ns 376.0 mean_ns 31513.2\n"), Some((376.0, 31513.2)));
        assert_eq!(parse("pingpong 1 median_ns nan mean_ns 1"), None);
        assert_eq!(parse("nothing"), None);
        assert_eq!(path_of(10, 44_000), "direct path");
        assert_eq!(path_of(44_000, 44_000), "engine path");
        assert_eq!(path_of(20_000, 44_000), "both paths");
    }
}
