//! `vrdma vm migrate`'s order and its failures, with two real daemons and
//! two stand-in QEMUs (`stand_in.rs`). The daemon step itself is tested
//! with guests elsewhere (`vrdma-it --test migrate_vm`, `--test
//! guest_migrate`); here: QEMU's migration first, the daemon step only
//! once it completed and the destination loaded, the destination's `cont`
//! last; and on each failure one copy of the VM left running, the one the
//! error names.

use super::stand_in::{Qemus, World};
use super::{text, vrdma};

#[test]
fn vm_migrate_runs_qemus_migration_then_the_daemon_step_then_the_destinations_cont() {
    let w = World::start(Some(8));
    let q = Qemus { source_running: true, source_daemon: Some(w.a.clone()), ..Default::default() };
    let (out, log) = w.migrate(q, &["--quit-source"]);
    let (so, se) = text(&out);
    assert!(out.status.success(), "{se}");
    assert!(so.contains("VM \"t\" moved to") && so.contains("3 dirty syncs, its downtime 7 ms"), "{so}");
    assert_eq!(log, ["C:late-block-activate=true", "A:migrate", "C:cont", "A:quit"], "{so}{se}");
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
    let w = World::start(Some(8));
    let q = Qemus { source_running: true, fail_migration: true, ..Default::default() };
    let (out, log) = w.migrate(q, &[]);
    let (_, se) = text(&out);
    assert!(!out.status.success());
    assert!(se.contains("QEMU's migration did not complete; the VM runs on at the source"), "{se}");
    assert_eq!(log, ["C:late-block-activate=true", "A:migrate"]);
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

    // The source's QEMU is another VM (none of its chardevs on VM t's
    // port at A): refused before anything.
    let q = Qemus {
        source_running: true,
        source_port: Some(w.dir.path().join("another-vm.sock")),
        ..Default::default()
    };
    let (out, log) = w.migrate(q, &[]);
    let (_, se) = text(&out);
    assert!(!out.status.success());
    assert!(se.contains("the source's QEMU") && se.contains("does not run VM \"t\""), "{se}");
    assert!(se.contains("another-vm.sock") && se.contains("nothing was done"), "{se}");
    assert!(log.is_empty(), "{log:?}");
    // So is the destination's.
    let q = Qemus {
        source_running: true,
        destination_port: Some(w.dir.path().join("another-vm.sock")),
        ..Default::default()
    };
    let (out, log) = w.migrate(q, &[]);
    let (_, se) = text(&out);
    assert!(se.contains("the destination's QEMU") && se.contains("does not run VM \"t\""), "{se}");
    assert!(log.is_empty(), "{log:?}");

    // C's daemon has no VM `t`: refused before anything.
    let w = World::start(None);
    let q = Qemus { source_running: true, ..Default::default() };
    let (out, log) = w.migrate(q, &[]);
    let (_, se) = text(&out);
    assert!(!out.status.success());
    assert!(se.contains("no VM \"t\""), "{se}");
    assert!(log.is_empty(), "{log:?}");

    // The daemon step is refused (C's VM `t` has another region size): the
    // tenant resumes at A, and so does A's QEMU; C's stays stopped, never
    // continued.
    let w = World::start(Some(16));
    let q = Qemus { source_running: true, ..Default::default() };
    let (out, log) = w.migrate(q, &[]);
    let (_, se) = text(&out);
    assert!(!out.status.success());
    assert!(se.contains("the VM runs on at the source; the destination's QEMU quit"), "{se}");
    // The destination's copy goes before the source's runs again.
    assert_eq!(log, ["C:late-block-activate=true", "A:migrate", "C:quit", "A:cont"]);
    let paused = vrdma(&w.a, &["migrate", "pause", "--vm", "t"]);
    assert!(paused.status.success(), "the tenant did not resume at A: {}", text(&paused).1);
    assert!(vrdma(&w.a, &["migrate", "resume", "--vm", "t"]).status.success());

    // A VM the operator had paused is continued nowhere.
    let q = Qemus { source_running: false, ..Default::default() };
    let (out, log) = w.migrate(q, &[]);
    let se = text(&out).1;
    assert!(se.contains("stays paused at the source, as it was"), "{se}");
    assert_eq!(log, ["C:late-block-activate=true", "A:migrate", "C:quit"]);

    // A destination started without -S runs the VM as soon as it loaded
    // it: stopped, and nothing of vRDMA moves; the source is not
    // continued (the destination's copy is ahead of it).
    let q = Qemus { source_running: true, destination_autostart: true, ..Default::default() };
    let (out, log) = w.migrate(q, &[]);
    let se = text(&out).1;
    assert!(se.contains("started without -S") && se.contains("nothing of vRDMA moved"), "{se}");
    assert_eq!(log, ["C:late-block-activate=true", "A:migrate", "C:stop"]);
    let paused = vrdma(&w.a, &["migrate", "pause", "--vm", "t"]);
    assert!(paused.status.success(), "the tenant left A: {}", text(&paused).1);
}
