//! `vrdma vm savevm` and `vrdma vm loadvm` against a real daemon and a
//! stand-in QEMU (`stand_in.rs`): the daemon's step beside QEMU's snapshot
//! in the documented order (the running copy's state dropped before
//! `loadvm`, the saved one imported after), the state's files beside it,
//! and every refusal leaving the VM as it was. A real guest's save and
//! restore: `cargo test -p vrdma-cli --test guest_migrate faults`.

use std::os::unix::fs::PermissionsExt as _;

use super::stand_in::{with_source, Qemus, World};
use super::{text, vrdma};

/// What the daemon at A says to an export of VM `t`'s tenant: it refuses
/// one that is not paused.
fn export_says(w: &World) -> String {
    let out = w.dir.path().join("probe.snap");
    let _ = std::fs::remove_file(&out);
    let o = vrdma(&w.a, &["migrate", "export", "--vm", "t", "--out", out.to_str().unwrap()]);
    let (so, se) = text(&o);
    format!("{so}{se}")
}

#[test]
fn vm_savevm_and_loadvm_keep_the_daemons_state_beside_qemus_snapshot() {
    let w = World::start(Some(8));
    let keep = w.dir.path().join("keep");
    std::fs::create_dir(&keep).unwrap();
    let dir = keep.to_str().unwrap();
    let running = || Qemus { source_running: true, ..Default::default() };

    // A running VM: stopped, its tenant paused and exported, QEMU's
    // savevm, then both go on.
    let (out, q) = with_source(&w, running(), &["savevm", "t", "--tag", "sv1", "--dir", dir]);
    let (so, se) = text(&out);
    assert!(out.status.success(), "{se}");
    assert!(so.contains("saved as \"sv1\"") && so.contains("it runs on"), "{so}");
    assert_eq!(q.log, ["A:stop", "A:savevm sv1", "A:cont"]);
    let snap = std::fs::read(keep.join("t@sv1.snap")).unwrap();
    assert!(snap.starts_with(b"vRMS"), "not a snapshot");
    let region = std::fs::metadata(keep.join("t@sv1.region")).unwrap();
    assert_eq!(region.len(), 8 << 20);
    assert_eq!(region.permissions().mode() & 0o777, 0o600, "the region is guest memory");
    assert!(export_says(&w).contains("is not paused"), "the tenant was not resumed");

    // A typo changes nothing: no files for the tag, or no such snapshot.
    let q = Qemus { snapshots: vec!["sv1".into()], ..running() };
    let (out, q) = with_source(&w, q, &["loadvm", "t", "--tag", "sv2", "--dir", dir]);
    assert!(!out.status.success());
    assert!(text(&out).1.contains("(was \"sv2\" saved with `vrdma vm savevm`"), "{}", text(&out).1);
    assert!(q.log.is_empty(), "{:?}", q.log);
    std::fs::write(keep.join("t@sv3.snap"), b"").unwrap();
    let q = Qemus { snapshots: vec!["sv1".into()], ..running() };
    let (out, q) = with_source(&w, q, &["loadvm", "t", "--tag", "sv3", "--dir", dir]);
    assert!(text(&out).1.contains("QEMU has no snapshot \"sv3\""), "{}", text(&out).1);
    assert!(q.log.is_empty(), "{:?}", q.log);
    let (out, _) = with_source(&w, running(), &["savevm", "t", "--tag", "../x", "--dir", dir]);
    assert!(text(&out).1.contains("it names files"), "{}", text(&out).1);
    // Another VM's QEMU (none of its chardevs on VM t's port): refused,
    // neither saved nor loaded, the VM untouched.
    let other = || Some(w.dir.path().join("another-vm.sock"));
    let q = Qemus { source_port: other(), ..running() };
    let (out, q) = with_source(&w, q, &["savevm", "t", "--tag", "sv6", "--dir", dir]);
    assert!(text(&out).1.contains("does not run VM \"t\""), "{}", text(&out).1);
    assert!(q.log.is_empty() && q.source_running, "{:?}", q.log);
    assert!(!keep.join("t@sv6.snap").exists());
    let q = Qemus { source_port: other(), snapshots: vec!["sv1".into()], ..running() };
    let (out, q) = with_source(&w, q, &["loadvm", "t", "--tag", "sv1", "--dir", dir]);
    assert!(text(&out).1.contains("does not run VM \"t\""), "{}", text(&out).1);
    assert!(q.log.is_empty(), "{:?}", q.log);
    assert!(export_says(&w).contains("is not paused"), "the tenant was touched");

    // QEMU refuses the save: the VM goes on as before, nothing kept.
    let q = Qemus { savevm_fails: Some("Error: no block device can store vmstate\r\n".into()), ..running() };
    let (out, q) = with_source(&w, q, &["savevm", "t", "--tag", "sv4", "--dir", dir]);
    let se = text(&out).1;
    assert!(se.contains("no block device can store vmstate") && se.contains("nothing saved"), "{se}");
    assert_eq!(q.log, ["A:stop", "A:savevm sv4", "A:cont"]);
    let left: Vec<_> = std::fs::read_dir(&keep).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(!left.iter().any(|n| n.to_string_lossy().contains("sv4")), "{left:?}");
    assert!(export_says(&w).contains("is not paused"), "the tenant was not resumed");

    // --stay-stopped: the VM and its tenant stay as the save left them.
    let (out, q) =
        with_source(&w, running(), &["savevm", "t", "--tag", "sv5", "--dir", dir, "--stay-stopped"]);
    assert!(out.status.success(), "{}", text(&out).1);
    assert_eq!(q.log, ["A:stop", "A:savevm sv5"]);
    assert!(!export_says(&w).contains("not paused"), "the tenant was resumed");

    // The restore: the running copy's state goes before QEMU's loadvm
    // (the stand-in checks at its loadvm), the saved one is imported and
    // resumed, then the CPUs run.
    let q =
        Qemus { snapshots: vec!["sv1".into(), "sv5".into()], source_daemon: Some(w.a.clone()), ..running() };
    let (out, q) = with_source(&w, q, &["loadvm", "t", "--tag", "sv1", "--dir", dir]);
    let (so, se) = text(&out);
    assert!(out.status.success(), "{se}");
    assert!(so.contains("restored from \"sv1\""), "{so}");
    assert_eq!(q.log, ["A:stop", "A:loadvm sv1", "A:cont"]);
    assert!(export_says(&w).contains("is not paused"), "the saved state is not back, resumed");

    // A VM that was stopped stays stopped after its restore.
    let q = Qemus { snapshots: vec!["sv1".into()], ..Default::default() };
    let (out, q) = with_source(&w, q, &["loadvm", "t", "--tag", "sv1", "--dir", dir]);
    assert!(text(&out).0.contains("it stays stopped, as it was"), "{}", text(&out).1);
    assert_eq!(q.log, ["A:loadvm sv1"]);

    // The guest's session ended with the restore's drop of its state, and
    // no port leads this stand-in guest back: destroying its objects
    // would wait out the library's wait for its port (seconds each).
    let World { _guest, _pd, .. } = w;
    std::mem::forget((_guest, _pd));
}
