//! `vrdma vm migrate`'s order and its failures, with two real daemons and
//! two stand-in QEMUs: each a QMP server thread that answers what the
//! command asks (`query-status`, `migrate`, `query-migrate`, `cont`,
//! `quit`) from one shared state and logs the commands that change it.
//! The daemon step itself is tested with guests elsewhere
//! (`vrdma-it --test migrate_vm`, `--test guest_migrate`); here: QEMU's
//! migration first, the daemon step only once it completed and the
//! destination loaded, the destination's `cont` last; and on each failure
//! one copy of the VM left running, the one the error names.

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
struct Qemus {
    /// The source's migration ends `failed` instead of `completed`.
    fail_migration: bool,
    /// The destination was not started with `-incoming`.
    destination_running: bool,
    migrated: bool,
    source_running: bool,
    destination_cont: bool,
    /// The source's daemon, asked at the destination's `cont` whether it
    /// still holds the tenant (it must not: the daemon step came first).
    source_daemon: Option<PathBuf>,
    /// "A:migrate", "C:cont", ... in the order they came.
    log: Vec<String>,
}

/// Serves one QMP connection at `path` as QEMU `who` ('A' the source, 'C'
/// the destination), for at most a minute.
fn stand_in(path: &Path, who: char, q: Arc<Mutex<Qemus>>) -> JoinHandle<()> {
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
        writeln!(w, r#"{{"QMP": {{"version": {{}}, "capabilities": []}}}}"#).unwrap();
        for line in BufReader::new(s).lines() {
            let Ok(line) = line else { return };
            let cmd: serde_json::Value = serde_json::from_str(&line).unwrap();
            let verb = cmd["execute"].as_str().unwrap_or("?").to_string();
            let mut q = q.lock().unwrap();
            let answer = match (who, verb.as_str()) {
                (_, "qmp_capabilities") => serde_json::json!({}),
                ('A', "query-status") => {
                    let st = match (q.source_running, q.migrated) {
                        (true, _) => "running",
                        (false, true) => "postmigrate",
                        (false, false) => "paused",
                    };
                    serde_json::json!({ "status": st })
                }
                ('C', "query-status") => {
                    let st = match (q.destination_running || q.destination_cont, q.migrated) {
                        (true, _) => "running",
                        (false, true) => "paused",
                        (false, false) => "inmigrate",
                    };
                    serde_json::json!({ "status": st })
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
                ('A', "cont") => {
                    q.log.push("A:cont".into());
                    q.source_running = true;
                    serde_json::json!({})
                }
                ('C', "cont") => {
                    q.log.push("C:cont".into());
                    if let Some(a) = &q.source_daemon {
                        let (_, e) = text(&vrdma(a, &["migrate", "pause", "--vm", "t"]));
                        if !e.contains("has no context on this host") {
                            q.log.push(format!("A held the tenant at C's cont: {e}"));
                        }
                    }
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
/// there is device state to move), and C with the same VM or none.
struct World {
    dir: tempfile::TempDir,
    a: PathBuf,
    c: PathBuf,
    _daemons: (Daemon, Daemon),
    _guest: vrdma::Context,
    _pd: vrdma::ProtectionDomain,
    /// The region the guest context maps through `/proc/self/fd`.
    _region: std::os::fd::OwnedFd,
}

impl World {
    fn start(c_has_the_vm: bool) -> World {
        let dir = tempfile::tempdir().unwrap();
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        let vm = dir.path().join("vm.toml");
        std::fs::write(&vm, format!("[vms.t]\ntenant = {uid}\nmemory_mib = 8\nports = 1\n")).unwrap();
        let none = dir.path().join("none.toml");
        std::fs::write(&none, "").unwrap();
        let (a, c) = (dir.path().join("a/a.sock"), dir.path().join("c/c.sock"));
        std::fs::create_dir_all(a.parent().unwrap()).unwrap();
        std::fs::create_dir_all(c.parent().unwrap()).unwrap();
        let da = start_daemon(&a, &["--config", vm.to_str().unwrap()]);
        let c_config = if c_has_the_vm { &vm } else { &none };
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

    /// Runs `vrdma vm migrate t` from A to C against stand-ins in state
    /// `q`; the command's output and what the stand-ins were told.
    fn migrate(&self, q: Qemus, extra: &[&str]) -> (std::process::Output, Vec<String>) {
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
        // The command closed its QMP connections: the stand-ins end.
        ta.join().unwrap();
        tc.join().unwrap();
        let log = q.lock().unwrap().log.clone();
        (out, log)
    }
}

#[test]
fn vm_migrate_runs_qemus_migration_then_the_daemon_step_then_the_destinations_cont() {
    let w = World::start(true);
    let q = Qemus { source_running: true, source_daemon: Some(w.a.clone()), ..Default::default() };
    let (out, log) = w.migrate(q, &["--quit-source"]);
    let (so, se) = text(&out);
    assert!(out.status.success(), "{se}");
    assert!(so.contains("VM \"t\" moved to") && so.contains("3 dirty syncs, its downtime 7 ms"), "{so}");
    assert_eq!(log, ["A:migrate", "C:cont", "A:quit"], "{so}{se}");
    // The tenant's device state left A and is served at C.
    let (_, e) = text(&vrdma(&w.a, &["migrate", "pause", "--vm", "t"]));
    assert!(e.contains("has no context on this host"), "A still holds the tenant: {e}");
    let moved = vrdma(&w.c, &["migrate", "pause", "--vm", "t"]);
    assert!(moved.status.success(), "C does not hold the tenant: {}", text(&moved).1);
    // The guest's objects are C's now, and no port of C's leads to this
    // stand-in guest: destroying them would wait out the library's wait
    // for its port to come back (seconds each). Left to the process's end.
    let World { _guest, _pd, .. } = w;
    std::mem::forget((_guest, _pd));
}

#[test]
fn vm_migrate_leaves_the_vm_running_at_the_source_when_a_step_fails() {
    // QEMU's migration fails: QEMU runs the VM on; nothing else is done.
    let w = World::start(true);
    let q = Qemus { source_running: true, fail_migration: true, ..Default::default() };
    let (out, log) = w.migrate(q, &[]);
    let (_, se) = text(&out);
    assert!(!out.status.success());
    assert!(se.contains("QEMU's migration did not complete; the VM runs on at the source"), "{se}");
    assert_eq!(log, ["A:migrate"]);
    // The tenant was never paused at A (a pause there works, and undoes).
    let paused = vrdma(&w.a, &["migrate", "pause", "--vm", "t"]);
    assert!(paused.status.success(), "{}", text(&paused).1);
    assert!(vrdma(&w.a, &["migrate", "resume", "--vm", "t"]).status.success());

    // The destination is not waiting for a VM: refused before anything.
    let q = Qemus { source_running: true, destination_running: true, ..Default::default() };
    let (out, log) = w.migrate(q, &[]);
    let (_, se) = text(&out);
    assert!(!out.status.success());
    assert!(
        se.contains("is \"running\", not waiting for a VM: start it with `-incoming unix:/nowhere`"),
        "{se}"
    );
    assert!(log.is_empty(), "{log:?}");

    // The daemon step is refused (C has no VM `t`): the tenant resumes at
    // A, and so does A's QEMU; C's stays stopped, never continued.
    let w = World::start(false);
    let q = Qemus { source_running: true, ..Default::default() };
    let (out, log) = w.migrate(q, &[]);
    let (_, se) = text(&out);
    assert!(!out.status.success());
    assert!(se.contains("the VM runs on at the source") && se.contains("quit it"), "{se}");
    assert!(se.contains("no VM \"t\""), "{se}");
    assert_eq!(log, ["A:migrate", "A:cont"]);
    let paused = vrdma(&w.a, &["migrate", "pause", "--vm", "t"]);
    assert!(paused.status.success(), "the tenant did not resume at A: {}", text(&paused).1);
}
