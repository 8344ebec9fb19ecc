//! `vrdma bench --sockets`, PostgreSQL: pgbench's select-only
//! transactions per second (4 clients on 2 threads) against a server of
//! the bench's own, both ends preloaded (on the daemon of
//! [`super::sockets_apps`]) or both plain, interleaved in the same run.
//! PostgreSQL is the forking kind of server (the postmaster accepts, a
//! backend forked for the connection serves it), unlike redis.
//!
//! The cluster is made once per bench (initdb, then `pgbench -i` at
//! scale 1) in a private directory, removed at the end; each pass starts
//! a server on it and stops it after (fast shutdown, SIGINT, then
//! SIGKILL at the limit). As root, the server and pgbench run as the
//! `postgres` user Debian's package creates (initdb and postgres refuse
//! root): both ends one uid, one tenant, or nothing would be carried. A
//! preloaded pgbench must print the library's carried line.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::reaped::Reaped;
use super::sockets_apps::{after, client, command, free_port, listening};

/// How long a server may take to accept connections, or to stop.
const SERVER_LIMIT: Duration = Duration::from_secs(20);

/// A PostgreSQL cluster of the bench's, initialised, not running.
pub struct Cluster {
    bin: PathBuf,
    user: Option<(u32, u32)>,
    dir: PathBuf,
}

/// The binaries of the newest PostgreSQL installed (Debian keeps them in
/// /usr/lib/postgresql/VERSION/bin) and the user to run them as (`None`:
/// this process's own), or why there are none.
pub fn find() -> std::result::Result<(PathBuf, Option<(u32, u32)>), String> {
    let wanted = ["postgres", "initdb", "pgbench"];
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
        .filter(|(_, bin): &(u32, PathBuf)| wanted.iter().all(|p| bin.join(p).is_file()))
        .collect();
    found.sort();
    let Some((_, bin)) = found.pop() else {
        return Err("PostgreSQL is not installed (apt-get install postgresql)".into());
    };
    // SAFETY: geteuid(2) has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok((bin, None));
    }
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    let user = passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() > 3 && f[0] == "postgres").then(|| Some((f[2].parse().ok()?, f[3].parse().ok()?)))?
    });
    match user {
        Some(u) => Ok((bin, Some(u))),
        None => Err("there is no postgres user to run PostgreSQL as (root cannot)".into()),
    }
}

impl Cluster {
    /// initdb and `pgbench -i` (on a plain server) in a new private
    /// directory.
    pub fn init(bin: PathBuf, user: Option<(u32, u32)>) -> Result<Cluster> {
        let dir =
            std::env::temp_dir().join(format!("vrdma-bench-pg-{}-{}", std::process::id(), free_port()?));
        std::fs::create_dir_all(&dir)?;
        let c = Cluster { bin, user, dir };
        if let Some((uid, gid)) = user {
            std::os::unix::fs::chown(&c.dir, Some(uid), Some(gid))
                .with_context(|| format!("chown {} to the postgres user", c.dir.display()))?;
        }
        let data = c.data();
        let init = c.command("initdb", &["-D", &data, "-A", "trust", "-N"], None);
        client(init, false).context("initdb")?;
        let (port, _server) = c.start(None)?;
        let p = port.to_string();
        client(
            c.command("pgbench", &["-h", "127.0.0.1", "-p", &p, "-i", "-s", "1", "-q", "postgres"], None),
            false,
        )
        .context("pgbench -i")?;
        Ok(c)
    }

    fn data(&self) -> String {
        self.dir.join("data").display().to_string()
    }

    /// `PROGRAM ARGS` from the PostgreSQL binaries, as its user, at home
    /// in the cluster's directory.
    fn command(&self, program: &str, args: &[&str], preload: Option<(&Path, &Path)>) -> Command {
        use std::os::unix::process::CommandExt;
        let mut c = command(&self.bin.join(program), args, preload);
        if let Some((uid, gid)) = self.user {
            c.uid(uid).gid(gid);
        }
        c.current_dir(&self.dir).env("HOME", &self.dir).env("LC_ALL", "C");
        for v in ["PGHOST", "PGPORT", "PGUSER", "PGDATABASE", "PGDATA"] {
            c.env_remove(v);
        }
        c
    }

    /// A server on the cluster, accepting connections on the port
    /// returned; stopped when the [`Running`] is dropped.
    fn start(&self, preload: Option<(&Path, &Path)>) -> Result<(u16, Running)> {
        let port = free_port()?;
        let (p, data, dir) = (port.to_string(), self.data(), self.dir.display().to_string());
        let args = ["-D", &data, "-k", &dir, "-h", "127.0.0.1", "-p", &p, "-c", "fsync=off"];
        let mut c = self.command("postgres", &args, preload);
        // Its output is not read: nothing into a pipe that could fill.
        c.stdout(Stdio::null()).stderr(Stdio::null());
        let mut s = Running(Reaped(c.spawn().context("starting postgres")?));
        let pid_file = self.dir.join("data").join("postmaster.pid");
        let end = Instant::now() + SERVER_LIMIT;
        // Ready once its pid file says so: after its listening socket (and
        // so the library's registration of it) and the start-up process.
        let ready = || {
            let pid = std::fs::read_to_string(&pid_file).unwrap_or_default();
            listening(port) && pid.lines().nth(7).is_some_and(|l| l.trim() == "ready")
        };
        while !ready() {
            if s.0 .0.try_wait()?.is_some() || Instant::now() > end {
                bail!("postgres did not accept connections on {port} (its data in {data})");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok((port, s))
    }

    /// pgbench's select-only transactions per second over `secs` seconds,
    /// 4 clients on 2 threads, both ends preloaded or both plain.
    pub fn select_tps(&self, preload: Option<(&Path, &Path)>, secs: &str) -> Result<f64> {
        let (port, _server) = self.start(preload)?;
        let p = port.to_string();
        let args = ["-h", "127.0.0.1", "-p", &p, "-c", "4", "-j", "2", "-T", secs, "-S", "-n", "postgres"];
        let out = client(self.command("pgbench", &args, preload), preload.is_some())?;
        if !out.contains("number of failed transactions: 0") {
            bail!("pgbench -S: failed transactions: {out}");
        }
        after(&out, "tps = ")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A postmaster, told to stop (fast shutdown) on drop and killed if it
/// has not within [`SERVER_LIMIT`].
struct Running(Reaped);

impl Drop for Running {
    fn drop(&mut self) {
        let child = &mut self.0 .0;
        if let Ok(None) = child.try_wait() {
            // SAFETY: kill(2) on our child, not yet reaped (`Reaped` reaps
            // it on its drop, after this), so the pid is still its own.
            unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
            let end = Instant::now() + SERVER_LIMIT;
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < end {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        // `Reaped` kills it if it is still there.
    }
}
