//! Stand-in QEMUs for the tests of `vrdma vm migrate|savevm|loadvm`:
//! each a QMP server thread that answers what those commands ask
//! (`query-status`, `migrate`, `query-migrate`, `stop`, `cont`, `quit`,
//! HMP's `savevm`, `loadvm` and `info snapshots`) from one shared state
//! and logs the commands that change it; and the world they act on: real
//! daemons, A with VM `t` and a guest context of its tenant.

use std::io::{BufRead as _, BufReader, Write as _};
use std::os::fd::AsRawFd as _;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{start_daemon, text, vrdma, Daemon};

/// How the stand-in QEMUs behave, and what they were told.
#[derive(Default)]
pub(super) struct Qemus {
    /// The source's migration ends `failed` instead of `completed`.
    pub fail_migration: bool,
    /// The destination was not started with `-incoming`.
    pub destination_running: bool,
    /// The destination was started without `-S`: it runs once loaded.
    pub destination_autostart: bool,
    pub destination_stopped: bool,
    pub migrated: bool,
    pub source_running: bool,
    pub destination_cont: bool,
    /// The source's daemon, asked at the destination's `cont` and at a
    /// `loadvm` whether it still holds the tenant (it must not: the
    /// daemon step came first).
    pub source_daemon: Option<PathBuf>,
    /// A's snapshots (HMP `savevm` tags).
    pub snapshots: Vec<String>,
    /// HMP's `savevm` fails with this text.
    pub savevm_fails: Option<String>,
    /// "A:migrate", "C:cont", ... in the order they came.
    pub log: Vec<String>,
    /// The Unix sockets A's and C's chardevs are connected to (as
    /// `query-chardev` shows them); the VM's port socket at A's and C's
    /// daemon where not set.
    pub source_port: Option<PathBuf>,
    pub destination_port: Option<PathBuf>,
}

impl Qemus {
    /// Logs `what`, if A's daemon still holds the tenant at this point.
    fn source_let_go(&mut self, what: &str) {
        if let Some(a) = &self.source_daemon {
            let (_, e) = text(&vrdma(a, &["migrate", "pause", "--vm", "t"]));
            if !e.contains("has no context on this host") {
                self.log.push(format!("A held the tenant at {what}: {e}"));
            }
        }
    }

    /// A's answer to HMP `line`.
    fn hmp(&mut self, line: &str) -> String {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["savevm", tag] => {
                self.log.push(format!("A:savevm {tag}"));
                if let Some(e) = &self.savevm_fails {
                    return e.clone();
                }
                self.snapshots.retain(|t| t != tag);
                self.snapshots.push(tag.to_string());
                String::new()
            }
            ["loadvm", tag] => {
                self.log.push(format!("A:loadvm {tag}"));
                self.source_let_go("loadvm");
                match self.snapshots.iter().any(|t| t == tag) {
                    true => String::new(),
                    false => format!("Snapshot '{tag}' does not exist\r\n"),
                }
            }
            ["info", "snapshots"] => {
                let mut t = String::from("List of snapshots present on all disks:\r\nID        TAG               VM SIZE                DATE     VM CLOCK     ICOUNT\r\n");
                for (i, tag) in self.snapshots.iter().enumerate() {
                    t += &format!("--        {tag}     169 MiB 2026-11-27 10:00:0{i} 00:00:10.000\r\n");
                }
                t
            }
            _ => format!("unknown command: '{line}'\r\n"),
        }
    }
}

/// Serves one QMP connection at `path` as QEMU `who` ('A' the source, 'C'
/// the destination), for at most a minute.
pub(super) fn stand_in(path: &Path, who: char, q: Arc<Mutex<Qemus>>) -> JoinHandle<()> {
    let listener = UnixListener::bind(path).unwrap();
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let end = Instant::now() + Duration::from_secs(60);
        let s = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(_) if Instant::now() < end => std::thread::sleep(Duration::from_millis(10)),
                Err(_) => return,
            }
        };
        s.set_nonblocking(false).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut w = s.try_clone().unwrap();
        if writeln!(w, r#"{{"QMP": {{"version": {{}}, "capabilities": []}}}}"#).is_err() {
            return;
        }
        for line in BufReader::new(s).lines() {
            let Ok(line) = line else { return };
            let cmd: serde_json::Value = serde_json::from_str(&line).unwrap();
            let verb = cmd["execute"].as_str().unwrap_or("?").to_string();
            let mut q = q.lock().unwrap();
            let answer = match (who, verb.as_str()) {
                (_, "qmp_capabilities") => serde_json::json!({}),
                (_, "query-chardev") => {
                    let port = if who == 'A' { &q.source_port } else { &q.destination_port };
                    let mut devs =
                        vec![serde_json::json!({"label": "serial0", "filename": "pty:/dev/pts/9"})];
                    if port.is_some() {
                        // As QEMU shows a connected client socket: no path.
                        devs.push(serde_json::json!({"label": "vrdma-p0", "filename": "unix:"}));
                    }
                    serde_json::Value::Array(devs)
                }
                (_, "qom-get") if cmd["arguments"]["path"] == "/chardevs/vrdma-p0" => {
                    let port = if who == 'A' { &q.source_port } else { &q.destination_port };
                    let path = port.as_ref().map(|p| p.display().to_string()).unwrap_or_default();
                    serde_json::json!({"type": "unix", "path": path})
                }
                ('A', "query-status") => {
                    let st = match (q.source_running, q.migrated) {
                        (true, _) => "running",
                        (false, true) => "postmigrate",
                        (false, false) => "paused",
                    };
                    serde_json::json!({ "status": st })
                }
                ('C', "query-status") => {
                    let autostarted = q.migrated && q.destination_autostart && !q.destination_stopped;
                    let st = match (q.destination_running || q.destination_cont || autostarted, q.migrated) {
                        (true, _) => "running",
                        (false, true) => "paused",
                        (false, false) => "inmigrate",
                    };
                    serde_json::json!({ "status": st })
                }
                ('C', "migrate-set-capabilities") => {
                    let caps = &cmd["arguments"]["capabilities"][0];
                    q.log.push(format!("C:{}={}", caps["capability"].as_str().unwrap_or("?"), caps["state"]));
                    serde_json::json!({})
                }
                ('C', "stop") => {
                    q.log.push("C:stop".into());
                    q.destination_stopped = true;
                    serde_json::json!({})
                }
                ('A', "migrate") => {
                    q.log.push("A:migrate".into());
                    // The source stops at the switch-over, or runs on
                    // after a failed migration.
                    q.source_running = q.fail_migration;
                    q.migrated = !q.fail_migration;
                    // An event between a command and its answer.
                    writeln!(w, r#"{{"event": "MIGRATION", "data": {{"status": "setup"}}}}"#).unwrap();
                    serde_json::json!({})
                }
                ('A', "query-migrate") => match q.fail_migration {
                    true => serde_json::json!({ "status": "failed" }),
                    false => {
                        serde_json::json!({ "status": "completed", "downtime": 7, "ram": { "dirty-sync-count": 3 } })
                    }
                },
                ('A', "stop") => {
                    q.log.push("A:stop".into());
                    q.source_running = false;
                    serde_json::json!({})
                }
                ('A', "human-monitor-command") => {
                    let line = cmd["arguments"]["command-line"].as_str().unwrap_or("").to_string();
                    serde_json::Value::String(q.hmp(&line))
                }
                ('A', "cont") => {
                    q.log.push("A:cont".into());
                    q.source_running = true;
                    serde_json::json!({})
                }
                ('C', "cont") => {
                    q.log.push("C:cont".into());
                    q.source_let_go("C's cont");
                    q.destination_cont = true;
                    serde_json::json!({})
                }
                (_, "quit") => {
                    q.log.push(format!("{who}:quit"));
                    writeln!(w, r#"{{"return": {{}}}}"#).unwrap();
                    return;
                }
                _ => {
                    q.log.push(format!("{who}:{verb}?"));
                    writeln!(w, r#"{{"error": {{"class": "CommandNotFound", "desc": "{verb}"}}}}"#).unwrap();
                    continue;
                }
            };
            writeln!(w, "{}", serde_json::json!({ "return": answer })).unwrap();
        }
    })
}

/// Two daemons, A with VM `t` and a guest context of its tenant (so
/// there is device state to move), and C with VM `t` (of the same region
/// size, or another) or none.
pub(super) struct World {
    pub dir: tempfile::TempDir,
    pub a: PathBuf,
    pub c: PathBuf,
    _daemons: (Daemon, Daemon),
    pub _guest: vrdma::Context,
    pub _pd: vrdma::ProtectionDomain,
    /// The region the guest context maps through `/proc/self/fd`.
    _region: std::os::fd::OwnedFd,
}

impl World {
    /// `c_vm_mib`: C's VM `t`'s region in MiB (A's is 8), or no VM `t` at C.
    pub fn start(c_vm_mib: Option<u32>) -> World {
        let dir = tempfile::tempdir().unwrap();
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        let vm_of = |mib: u32| format!("[vms.t]\ntenant = {uid}\nmemory_mib = {mib}\nports = 1\n");
        let vm = dir.path().join("vm.toml");
        std::fs::write(&vm, vm_of(8)).unwrap();
        let c_config = dir.path().join("c.toml");
        std::fs::write(&c_config, c_vm_mib.map(vm_of).unwrap_or_default()).unwrap();
        let (a, c) = (dir.path().join("a/a.sock"), dir.path().join("c/c.sock"));
        std::fs::create_dir_all(a.parent().unwrap()).unwrap();
        std::fs::create_dir_all(c.parent().unwrap()).unwrap();
        let da = start_daemon(&a, &["--config", vm.to_str().unwrap()]);
        let dc = start_daemon(&c, &["--config", c_config.to_str().unwrap()]);
        let at = vrdma::vm::attach_at(&a, "t").expect("attach VM t at A");
        let cfg = vrdma::guest::GuestConfig {
            ports: vec![at.port_socket.clone()],
            bar: format!("/proc/self/fd/{}", at.region.as_raw_fd()).into(),
        };
        let guest = vrdma::Context::open_guest(&cfg).expect("a guest context at A");
        let pd = guest.alloc_pd().expect("a PD");
        World { dir, a, c, _daemons: (da, dc), _guest: guest, _pd: pd, _region: at.region }
    }

    /// VM `t`'s port socket at the daemon at `socket`, if it has the VM.
    fn port(&self, socket: &Path) -> Option<PathBuf> {
        vrdma::vm::attach_at(socket, "t").ok().map(|a| a.port_socket)
    }

    /// Runs `vrdma vm migrate t` from A to C against stand-ins in state
    /// `q`; the command's output and what the stand-ins were told.
    pub fn migrate(&self, mut q: Qemus, extra: &[&str]) -> (std::process::Output, Vec<String>) {
        q.source_port = q.source_port.or_else(|| self.port(&self.a));
        q.destination_port = q.destination_port.or_else(|| self.port(&self.c));
        let q = Arc::new(Mutex::new(q));
        let (qa, qc) = (self.dir.path().join("qmp-a.sock"), self.dir.path().join("qmp-c.sock"));
        let _ = std::fs::remove_file(&qa);
        let _ = std::fs::remove_file(&qc);
        let ta = stand_in(&qa, 'A', q.clone());
        let tc = stand_in(&qc, 'C', q.clone());
        let mut args = vec!["vm", "migrate", "t", "--to", self.c.to_str().unwrap()];
        args.extend([
            "--qmp",
            qa.to_str().unwrap(),
            "--to-qmp",
            qc.to_str().unwrap(),
            "--uri",
            "unix:/nowhere",
        ]);
        args.extend(extra);
        let out = vrdma(&self.a, &args);
        // The command closed its QMP connections: the stand-ins end (one
        // it never reached ends at this connection's close).
        finish(&qa, ta);
        finish(&qc, tc);
        let log = q.lock().unwrap().log.clone();
        (out, log)
    }
}

/// Runs `vrdma --socket A vm ARGS --qmp QMP` against a stand-in A in
/// state `q`; the command's output and the stand-in's state after.
pub(super) fn with_source(w: &World, mut q: Qemus, args: &[&str]) -> (std::process::Output, Qemus) {
    q.source_port = q.source_port.or_else(|| w.port(&w.a));
    let q = Arc::new(Mutex::new(q));
    let qa = w.dir.path().join("qmp-a.sock");
    let _ = std::fs::remove_file(&qa);
    let ta = stand_in(&qa, 'A', q.clone());
    let mut all = vec!["vm"];
    all.extend(args);
    all.extend(["--qmp", qa.to_str().unwrap()]);
    let out = vrdma(&w.a, &all);
    finish(&qa, ta);
    let q = std::mem::take(&mut *q.lock().unwrap());
    (out, q)
}

/// Waits for the stand-in at `path` to end, connecting (and closing) once
/// in case the command under test never did.
fn finish(path: &Path, t: JoinHandle<()>) {
    drop(std::os::unix::net::UnixStream::connect(path));
    t.join().unwrap();
}
