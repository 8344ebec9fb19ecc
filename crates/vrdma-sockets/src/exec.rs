//! `exec` and the calls that start programs: the connections a program
//! inherits are settled first.
//!
//! An exec'd program starts without this library's state: it loads the
//! library afresh (`LD_PRELOAD` is in its environment) or not at all (a
//! static binary, a cleared environment), and sees its inherited
//! descriptors as plain sockets. An inetd-style server (inetd, xinetd,
//! systemd's `Accept=yes`, `socat EXEC:`, tcpserver, CGI) accepts a
//! connection and execs a program with it as its stdin and stdout before
//! any call on it: the connection is claimed but not negotiated, and the
//! program would read the client's hello as data while the client waits
//! for an answer that never comes. So before every exec each connection
//! the program will inherit (not close-on-exec) that is not decided yet
//! is settled as plain TCP ([`crate::stream::Stream::settle_for_exec`]: through the
//! daemon, or by answering the client's hello with a decline), and the
//! program reads a clean stream. A carried connection is close-on-exec
//! ([`crate::table::set_cloexec`]); one the program wants its exec'd
//! program to inherit (its own flag clear: [`crate::cloexec`]) is
//! demoted to plain TCP at an exact byte first, this process as its
//! driver (`Link::demote_for_exec`), and its real flag given back, so the
//! program inherits a plain TCP socket whose stream goes on exactly;
//! where it cannot be (bytes the program has not read in the ring, a peer
//! that does not answer in time or cannot, another process's) it stays
//! close-on-exec and the peer sees the end (`docs/sockets.md`, "Exec").
//!
//! glibc's exec family does not go through `execve`'s PLT entry (each
//! calls glibc's internal `__execve` or `__execvpe`), so each is
//! interposed: `execve`, `execv`, `execvp`, `execvpe`, `fexecve`,
//! `execveat`, and the variadic `execl`, `execle` and `execlp` (x86-64:
//! a trampoline that settles and jumps to libc's with the caller's
//! registers and stack untouched). `posix_spawn` and `posix_spawnp`
//! (which `system`, `popen` and Rust's `Command` use, through glibc's
//! internal `__spawni`) settle what their child inherits; a descriptor
//! that their file actions `dup2` (close-on-exec or not: the copy is
//! inherited) is settled when the action is added, and a carried one is
//! demoted then, or, where it cannot be, its action becomes a close of
//! its target (the child does not get it, as close-on-exec keeps it from
//! an exec'd program). `system` and `popen`
//! are interposed as well, since they reach `__spawni` without a PLT
//! entry. `vfork` followed by an exec settles in the child, which shares
//! the parent's memory: the parent then finds the connection TCP too.
//!
//! Not seen: an exec made by a raw system call, and a program that a
//! `clone` without exec runs.

use libc::{c_char, c_int, c_void, pid_t};

use crate::real;
use crate::table::{self, keep_errno, Entry, Guard};

/// Settles every undecided connection a program started now would
/// inherit (every descriptor not close-on-exec), and demotes the carried
/// ones it would inherit (the program's own flag clear). `exec`: this
/// process's image goes (or is a `vfork` child's, sharing its parent's
/// memory): a demoted connection's state is left as it is, not dropped
/// (a `vfork` child may have closed the descriptors its drop would
/// close, and Rust's descriptors abort on that).
fn settle(exec: bool) {
    let Some(_g) = Guard::enter() else { return };
    // One bound for the whole settle, however many connections wait for
    // a peer; each still gets a look of its own (`at_least`: a second, or
    // the bound if shorter), so that one silent peer does not leave the
    // others a moment only.
    let wait = crate::link::demote_wait();
    let end = std::time::Instant::now() + wait;
    keep_errno(|| {
        left::close();
        let mut demoted: Vec<(std::sync::Arc<crate::stream::Stream>, c_int)> = Vec::new();
        // In descriptor order: the program's stdin and stdout (0, 1) first,
        // the connections it hands on most often.
        let mut streams = table::streams();
        streams.sort_unstable_by_key(|(fd, _)| *fd);
        for (fd, s) in streams {
            // What this process wrote on its carried connections lands
            // before its address space (the rings, the QP's context) goes
            // with the exec, as a TCP socket's sent bytes would: a server
            // that echoed and then exec'd lost its last write (the peer
            // read a reset instead, 1 CI run).
            if let Some(l) = s.link_now().filter(|_| s.owner.mine()) {
                l.flush_all_writes();
            }
            // (Its other descriptors find it plain TCP: settled below as
            // such, their flags given back at the end.)
            if carried_now(&s) && crate::cloexec::inherited(fd) && demote(fd, &s, exec, at_least(end, wait)) {
                demoted.push((s.clone(), fd));
                crate::cloexec::restore(fd);
                continue;
            }
            // An exec's resend this process still queues (`link/outq.rs`)
            // goes with its memory: sent first, within the settle's bound
            // (a look of its own: `at_least`); what is left resets the
            // connection (never a clean, short stream at the other end).
            // Only for a real exec: a spawn (`posix_spawn`, `system`,
            // `popen`) leaves this process living, its queue pushed as
            // before (a flush here would drop the program's incoming
            // bytes, or reset a healthy connection). Not in a `vfork`
            // child: the queue is its parent's (shared memory), which
            // goes on after the exec. What comes in meanwhile is not read
            // and dropped (as a close's flush does): the exec may fail,
            // and the process then reads on (a program there that writes
            // before it reads keeps the queue from going: the bound, then
            // the reset; an exec that succeeds closes the socket with the
            // bytes unread, which the kernel answers with a reset too).
            if let Some(l) = s.link_now().filter(|_| exec && !crate::pid::vforked()) {
                l.flush_out_or_reset(at_least(end, wait), "an exec", false);
            }
            // A carried connection goes with the exec (close-on-exec):
            // this process no longer holds it (`crate::forkshare`).
            if s.link_now().is_some() {
                crate::forkshare::leaving(&s);
            }
            if !table::is_cloexec(fd) {
                s.settle_for_exec(fd, at_least(end, wait));
            }
        }
        if exec {
            for (s, via) in &demoted {
                left::record(s.own_fd(), *via);
            }
            std::mem::forget(demoted);
        }
        restore_plain();
        if crate::pid::vforked() {
            vfork::end();
        }
    });
}

/// `end`, or a second from now (`wait` if shorter) if that is later: a
/// connection settled after others used the bound still gets a look at
/// its peer long enough for a busy one to answer (a peer answers at its
/// next call on the connection, or at once where it waits in one). A
/// settle with `n` connections so waits `wait + n` seconds at most.
fn at_least(end: std::time::Instant, wait: std::time::Duration) -> std::time::Instant {
    end.max(std::time::Instant::now() + wait.min(std::time::Duration::from_secs(1)))
}

/// Descriptors whose connection is plain TCP by now (demoted: by this
/// process, by a `vfork` child's exec in this memory, or after a fork)
/// get the program's own flag back.
fn restore_plain() {
    for fd in crate::cloexec::all() {
        if !matches!(table::get(fd), Some(Entry::Stream(s)) if carried_now(&s)) {
            crate::cloexec::restore(fd);
        }
    }
}

/// The library's own descriptors of the connections an exec demoted and
/// left undropped: the exec replaces this memory, except for a `vfork`
/// child's (its parent's) or an exec that failed. Then this memory's
/// process still holds them, and the socket would not end when the
/// program closes its descriptor (the peer would not read the end): each
/// is closed at the next close or exec of the program, if it is still
/// that socket (the same inode; the program may have closed the number
/// and reused it). Each connection's QP and regions stay with the
/// process (a `vfork` child's drop could not close them: the program may
/// have closed their descriptors in the child, and Rust's abort then).
pub(crate) mod left {
    use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};

    use libc::c_int;

    const SLOTS: usize = 16;
    static FD: [AtomicI32; SLOTS] = [const { AtomicI32::new(-1) }; SLOTS];
    static INO: [AtomicU64; SLOTS] = [const { AtomicU64::new(0) }; SLOTS];
    static DEV: [AtomicU64; SLOTS] = [const { AtomicU64::new(0) }; SLOTS];
    static ANY: AtomicBool = AtomicBool::new(false);

    /// The socket's identity (device and inode), if `fd` is a socket.
    fn inode(fd: c_int) -> Option<(u64, u64)> {
        // SAFETY: fstat(2) into a zeroed stat of ours.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let r = unsafe { libc::fstat(fd, &mut st) };
        (r == 0 && st.st_mode & libc::S_IFMT == libc::S_IFSOCK).then_some((st.st_dev, st.st_ino))
    }

    /// `fd`, the library's descriptor of a demoted connection, is left;
    /// `via`: the program's descriptor of the same socket (a `vfork`
    /// child may have closed `fd` in its own table, not in its parent's).
    pub fn record(fd: c_int, via: c_int) {
        let Some((dev, ino)) = inode(via) else { return };
        for ((f, i), d) in FD.iter().zip(INO.iter()).zip(DEV.iter()) {
            if f.compare_exchange(-1, -2, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                i.store(ino, Ordering::Release);
                d.store(dev, Ordering::Release);
                f.store(fd, Ordering::Release);
                ANY.store(true, Ordering::Release);
                return;
            }
        }
        static SAID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        crate::dev::warn_once(
            &SAID,
            &format!(
                "more than {SLOTS} connections demoted for execs that did not replace this memory: \
                 the library's descriptor {fd} stays open (the peer reads the end only when this process ends)"
            ),
        );
    }

    /// Closes the descriptors left, that are still their sockets. Not in
    /// a `vfork` child (its calls before its exec run in its parent's
    /// memory): it would close them in its own table only and clear its
    /// parent's record of them, which the parent then never closes.
    pub fn close() {
        // (The flag first: every close of the program comes here, and the
        // id check is a system call.)
        if !ANY.load(Ordering::Acquire) || crate::pid::vforked() || !ANY.swap(false, Ordering::AcqRel) {
            return;
        }
        for ((f, i), d) in FD.iter().zip(INO.iter()).zip(DEV.iter()) {
            // (-2: a slot being filled; left for the next close.)
            if f.load(Ordering::Acquire) == -2 {
                ANY.store(true, Ordering::Release);
                continue;
            }
            // The identity read first, then the slot taken only if it
            // still holds that descriptor (a `record` that reused the slot
            // in between fails the exchange: its own, left for later).
            let fd = f.load(Ordering::Acquire);
            let id = (d.load(Ordering::Acquire), i.load(Ordering::Acquire));
            if fd < 0 || f.compare_exchange(fd, -1, Ordering::AcqRel, Ordering::Acquire).is_err() {
                if fd != -1 {
                    ANY.store(true, Ordering::Release);
                }
                continue;
            }
            if inode(fd) == Some(id) {
                crate::dev::debug(&format!("the library's descriptor {fd} of a connection demoted for an exec that did not replace this memory: closed"));
                // SAFETY: the library's own descriptor (the same socket).
                unsafe { crate::real::close(fd) };
            }
        }
    }
}

/// A `vfork` child's view of the descriptor table. The child shares its
/// parent's memory (the table) but not its descriptors: its `close` and
/// `dup2` must not change what the parent's descriptors map to (a
/// child's `dup2(c, 1)` made the parent's descriptor 1 the carried
/// connection, which stayed so where the demotion failed), nor drop a
/// connection the parent holds. So in the child a descriptor it closes or
/// replaces has the parent's entry kept aside (once), the entries it adds
/// are noted, and before its exec (after the settle) the table is put
/// back as the parent had it (also as it leaves by `_exit`, `_Exit` or
/// `exit` without an exec: [`vfork::exiting`]): its entries out, the
/// parent's back, but a
/// connection the child demoted (plain TCP: the parent finds it so,
/// forgotten, its entry leaked rather than dropped: its drop would close
/// descriptors in the child's table only). The child's own copies are
/// dropped: never the last holders. The view names its child (another
/// child's left view is put back first), and the parent's own close or
/// copy of a descriptor meanwhile wins over it.
pub(crate) mod vfork {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Mutex;

    use libc::c_int;

    use crate::table::{self, Entry};

    struct View {
        /// The `vfork` child whose view this is (its real id).
        pid: u32,
        /// The parent's entries of descriptors the child closed or
        /// replaced, as they were before the child's first change.
        aside: HashMap<c_int, Option<Entry>>,
        /// Descriptors the child mapped, with its copies: taken out of the
        /// table at its end only where they still are (the parent's close
        /// or copy of the number meanwhile wins).
        added: HashMap<c_int, Entry>,
    }

    static VIEW: Mutex<Option<View>> = Mutex::new(None);

    /// The id of the child whose view is kept, 0 for none: the parent's
    /// descriptor calls look at it without a lock or a system call.
    static ACTIVE: AtomicU32 = AtomicU32::new(0);

    /// Views made so far (wrapping), counted after the view is marked
    /// kept (`ACTIVE`) and before it sets anything aside: a parent's
    /// change that looked before a view was made finds this moved after
    /// its change, and looks again under the view's lock ([`Look::after`]).
    static MADE: AtomicU32 = AtomicU32::new(0);

    /// What a parent's close or copy of a descriptor saw of the views
    /// before it changed the table.
    #[derive(Clone, Copy)]
    pub struct Look {
        /// A child's view was kept.
        pub active: bool,
        made: u32,
    }

    /// The look before a parent's change (atomics only: every close of
    /// every program makes it). `MADE` first: where it counts a view, that
    /// view was marked kept before, and is seen kept unless it ended (its
    /// putting back done: `end` unmarks it last).
    pub fn look() -> Look {
        let made = MADE.load(Ordering::SeqCst);
        Look { active: ACTIVE.load(Ordering::SeqCst) != 0, made }
    }

    impl Look {
        /// A view was made since this look.
        pub fn moved(&self) -> bool {
            MADE.load(Ordering::SeqCst) != self.made
        }

        /// After the parent's change of `fd` in the table (a close's
        /// removal, a copy's insertion of `ours`): a `vfork` child of
        /// another thread whose view was made since the look, and whose
        /// first close or `dup2` of the same number came before the
        /// change, set the parent's entry aside, and puts it back over the
        /// number at its exec or exit (or did already). A child counts its
        /// view made before it sets anything aside under the table's lock,
        /// and this look follows the parent's own use of that lock:
        /// whichever of the two took the lock second sees the other. So
        /// where a view was made since, under the view's lock (no child
        /// puts back meanwhile): an entry the kept view set aside for `fd`
        /// is taken back, unless it is `ours` (set aside after the change:
        /// the view puts it back, as it should); nothing is done where the
        /// view set nothing of the parent's aside (the child's first change
        /// came after the parent's: what the table holds for `fd` may be
        /// the child's own copy); and where no view touched `fd` (it
        /// ended, or this one never changed `fd`), a table entry for `fd`
        /// other than `ours` came from an ended view's putting back, and
        /// is replaced by `ours` (a close: removed). Returns what the
        /// parent must drop.
        pub fn after(self, fd: c_int, ours: Option<&Entry>) -> Vec<Entry> {
            if !self.active && !self.moved() {
                return Vec::new();
            }
            let mut g = view();
            let mut out = Vec::new();
            let is_ours = |e: &Entry| ours.is_some_and(|o| o.same(e));
            if let Some(v) = g.as_mut() {
                // A child's copy of the same connection at the number: the
                // parent's copy is there now (the child's, replaced or
                // taken out by the parent's change, is told from it only
                // by its connection), and stays at the child's end.
                if v.added.get(&fd).is_some_and(is_ours) {
                    v.added.remove(&fd);
                }
            }
            match g.as_mut().map(|v| (v.aside.get(&fd).map(|e| e.as_ref().map(is_ours)), v)) {
                Some((Some(Some(false)), v)) => {
                    out.extend(v.aside.remove(&fd).flatten());
                }
                Some((Some(_), _)) => {}
                Some((None, _)) | None => {
                    if table::get(fd).is_some_and(|e| !is_ours(&e)) {
                        out.extend(table::remove(fd));
                        if let Some(o) = ours {
                            out.extend(table::insert(fd, o.clone()));
                        }
                    }
                }
            }
            drop(g);
            out
        }
    }

    fn view() -> std::sync::MutexGuard<'static, Option<View>> {
        VIEW.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// This child's view; one left by another child (killed, or gone by a
    /// raw system call, before its exec or exit) is put back first.
    fn mine(v: &mut Option<View>) -> &mut View {
        let me = std::process::id();
        if v.as_ref().is_some_and(|x| x.pid != me) {
            if let Some(old) = v.take() {
                put_back(old);
            }
        }
        ACTIVE.store(me, Ordering::SeqCst);
        if v.is_none() {
            MADE.fetch_add(1, Ordering::SeqCst);
        }
        v.get_or_insert_with(|| View { pid: me, aside: HashMap::new(), added: HashMap::new() })
    }

    /// The child closes `fd` (or is about to replace it).
    pub fn closed(fd: c_int) {
        let mut g = view();
        let v = mine(&mut g);
        if let std::collections::hash_map::Entry::Vacant(a) = v.aside.entry(fd) {
            a.insert(table::remove(fd));
        } else if let Some(own) = v.added.get(&fd) {
            // Its own copy: a clone of an entry still held.
            drop(table::remove_if_same(fd, own));
        }
        v.added.remove(&fd);
    }

    /// The child mapped `fd` to `copy`.
    pub fn added(fd: c_int, copy: Entry) {
        let mut g = view();
        mine(&mut g).added.insert(fd, copy);
    }

    thread_local! {
        /// The view's lock, held by the forking thread across `fork`.
        static HELD: std::cell::RefCell<Option<std::sync::MutexGuard<'static, Option<View>>>> =
            const { std::cell::RefCell::new(None) };
    }

    /// A forked child must not inherit the view's lock held by another
    /// thread of its parent (a parent's close takes it, then the table's,
    /// which the forking thread holds across `fork`): the forking thread
    /// takes it first (`crate::table`'s fork handlers), and both sides let
    /// it go after.
    pub fn hold_across_fork() {
        let g = view();
        let _ = HELD.try_with(|h| *h.borrow_mut() = Some(g));
    }

    /// After `fork`, in the parent and in the child.
    pub fn release_after_fork() {
        let _ = HELD.try_with(|h| h.borrow_mut().take());
    }

    /// The parent closes or replaces `fd` while a child's view is kept:
    /// its own change wins (the child's exec or exit must not put back an
    /// older entry over it, nor take its new one out). The parent's entry
    /// the child set aside is the parent's to drop: given back.
    pub fn parent_changed(fd: c_int) -> Option<Entry> {
        let mut g = view();
        let v = g.as_mut()?;
        v.aside.remove(&fd).flatten()
    }

    /// Before the child's exec, or as it exits without one: the parent's
    /// table back.
    ///
    /// The view's lock is held across the putting back, and the view is
    /// unmarked (`ACTIVE`) only after it: a parent thread's close or copy
    /// of a descriptor that sees no view kept finds what was put back in
    /// the table, and one that waits for the lock (`Look::after`) finds it
    /// too.
    pub fn end() {
        {
            let mut g = view();
            if let Some(v) = g.take() {
                put_back(v);
            }
            ACTIVE.store(0, Ordering::SeqCst);
        }
        crate::cloexec::end_vfork();
    }

    fn put_back(v: View) {
        for (fd, copy) in v.added {
            // (A copy: the entry it copied is the table's or aside.) Only
            // where it still is: the parent's own close or copy of the
            // number meanwhile wins.
            drop(table::remove_if_same(fd, &copy));
        }
        for (fd, e) in v.aside {
            match e {
                Some(Entry::Stream(s)) if s.owner.driver() == crate::owner::TCP => {
                    // Demoted or settled by the child: the parent finds it
                    // plain TCP, as the table's other descriptors of it.
                    std::mem::forget(s);
                }
                Some(e) => {
                    if let Some(old) = table::insert(fd, e) {
                        std::mem::forget(old);
                    }
                }
                None => {}
            }
        }
    }

    /// A `vfork` child leaves by `_exit`, `_Exit` or `exit` without an
    /// exec: the parent's table and flag records as they were (else its
    /// connection's entry stays aside, and its I/O goes straight to the
    /// kernel socket under the rings).
    ///
    /// No lock, allocation or table access unless this child really set
    /// something aside (its view, or flag records): a `_Fork` or raw
    /// `clone` child, or a signal handler's `_exit`, that changed nothing
    /// leaves at once (a lock another thread of the parent held at the
    /// fork stays held in such a child for good).
    pub fn exiting() {
        // SAFETY: getpid(2), async-signal-safe.
        let me = unsafe { libc::getpid() } as u32;
        if ACTIVE.load(Ordering::Acquire) != me && !crate::cloexec::vfork_kept() {
            return;
        }
        if let Some(_g) = table::Guard::enter() {
            if crate::pid::vforked() {
                end();
            }
        }
    }

    #[cfg(test)]
    mod tests {
        /// A child made without glibc's fork handlers (a raw `fork`
        /// system call: taken for a `vfork` child, its cached id its
        /// parent's) that changed nothing leaves by `exiting` without
        /// taking the view's lock, here held by its parent at the fork
        /// (before, it waited for it for good).
        #[test]
        fn exiting_takes_no_lock_in_a_child_that_kept_nothing() {
            let _held = super::view();
            // SAFETY: a raw fork(2); the child only calls `exiting`
            // (atomics and getpid) and leaves by the exit system call.
            let pid = unsafe { libc::syscall(libc::SYS_fork) } as libc::pid_t;
            if pid == 0 {
                super::exiting();
                // SAFETY: exit(2) of this child.
                unsafe { libc::syscall(libc::SYS_exit, 7) };
            }
            assert!(pid > 0);
            let mut status = 0;
            let mut done = false;
            // A hang is the failure: bounded only to end the test.
            for _ in 0..1000 {
                // SAFETY: waitpid(2) on our child, without waiting.
                if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
                    done = true;
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            if !done {
                // SAFETY: kill(2) and waitpid(2) on our own stuck child.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, &mut status, 0);
                }
            }
            assert!(
                done && libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 7,
                "the child hung in exiting"
            );
        }
    }
}

/// Whether `s` goes over vRDMA still (not demoted to plain TCP).
fn carried_now(s: &crate::stream::Stream) -> bool {
    s.is_carried() && s.owner.driver() != crate::owner::TCP
}

/// Demotes the carried connection `s` (a descriptor of it, `fd`, goes to
/// an exec'd or spawned program) to plain TCP at an exact byte, this
/// process as its driver, waiting `VRDMA_SOCKETS_WAIT_MS` at most for
/// the peer (`docs/sockets.md`, "Exec"). Whether it is plain TCP now;
/// else it stays close-on-exec, as before (the peer sees the end), and
/// is this process's still (`exec` false: a spawn), carried or, where the
/// demotion began, demoted at this end.
fn demote(fd: c_int, s: &std::sync::Arc<crate::stream::Stream>, exec: bool, end: std::time::Instant) -> bool {
    let Some(l) = s.link_now() else { return false };
    if !s.owner.mine() {
        crate::dev::debug(&format!("descriptor {fd}: another process drives its connection: not inherited"));
        return false;
    }
    if s.owner.demote().is_some_and(|d| d.held_elsewhere()) {
        crate::dev::debug(&format!("descriptor {fd}: another process holds its connection: not inherited"));
        return false;
    }
    // The demotion's socket I/O goes through `fd`: it must be this
    // connection's socket (the table may be stale after a close the
    // library did not see). The library's own descriptor may be closed
    // (a `vfork` child's close): then the table is trusted.
    let ino = crate::cloexec::inode;
    if let (Some(own), mine) = (ino(s.own_fd()), ino(fd)) {
        if mine != Some(own) {
            crate::dev::debug(&format!("descriptor {fd}: not its connection's socket: not demoted"));
            return false;
        }
    }
    match l.demote_for_exec(fd, end, exec) {
        Ok(()) => {
            crate::dev::debug(&format!("descriptor {fd}: demoted to plain TCP for the exec'd program"));
            // Plain TCP for this process too: its calls go to the kernel
            // (a `vfork` child's table is its parent's, whose descriptors
            // the child's `dup2`s do not change).
            table::forget_stream(s);
            true
        }
        Err((why, lost)) => {
            crate::dev::debug(&format!("descriptor {fd}: not demoted ({why}): not inherited"));
            // The program's descriptor (its stdin, its stdout) goes
            // without a word otherwise.
            static NOT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            crate::dev::warn_once(
                &NOT,
                &format!("a carried connection could not be demoted to plain TCP for the new program ({why}): it does not get it"),
            );
            if lost && exec {
                // Bytes of the peer's that no program will read: a reset,
                // as a TCP close with unread data, not a clean end. (A
                // process that spawns keeps them: its reads take them, the
                // demoted way.)
                crate::dev::debug(&format!("descriptor {fd}: bytes of the peer's unread: reset at the exec"));
                static RESET: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
                crate::dev::warn_once(
                    &RESET,
                    "bytes of a carried connection's peer that no program will read: the connection is reset at the exec",
                );
                let lg = libc::linger { l_onoff: 1, l_linger: 0 };
                // SAFETY: setsockopt(2) with a linger of ours, its size.
                unsafe {
                    libc::setsockopt(
                        fd,
                        libc::SOL_SOCKET,
                        libc::SO_LINGER,
                        (&lg as *const libc::linger).cast(),
                        std::mem::size_of::<libc::linger>() as libc::socklen_t,
                    )
                };
            }
            false
        }
    }
}

/// Settles the connection of `fd`, which a child is about to get; true
/// when it is carried (the child must not get it): a carried one is
/// demoted first, if it can be.
fn settle_fd(fd: c_int) -> bool {
    let Some(_g) = Guard::enter() else { return false };
    keep_errno(|| match table::get(fd) {
        Some(Entry::Stream(s)) => {
            if carried_now(&s) {
                if let Some(l) = s.link_now().filter(|_| s.owner.mine()) {
                    l.flush_all_writes();
                }
                if demote(fd, &s, false, std::time::Instant::now() + crate::link::demote_wait()) {
                    // Its descriptors' flags are the program's again now
                    // (not at the next exec: a record kept until then
                    // would undo an `F_SETFD` made meanwhile).
                    restore_plain();
                    return false;
                }
                return true;
            }
            s.settle_for_exec(fd, std::time::Instant::now() + crate::link::demote_wait());
            carried_now(&s)
        }
        _ => false,
    })
}

#[no_mangle]
pub unsafe extern "C" fn execve(
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    settle(true);
    // SAFETY: libc's execve with the caller's arguments.
    unsafe { real::execve(path, argv, envp) }
}

#[no_mangle]
pub unsafe extern "C" fn execv(path: *const c_char, argv: *const *const c_char) -> c_int {
    settle(true);
    // SAFETY: libc's execv with the caller's arguments.
    unsafe { real::execv(path, argv) }
}

#[no_mangle]
pub unsafe extern "C" fn execvp(file: *const c_char, argv: *const *const c_char) -> c_int {
    settle(true);
    // SAFETY: libc's execvp with the caller's arguments.
    unsafe { real::execvp(file, argv) }
}

#[no_mangle]
pub unsafe extern "C" fn execvpe(
    file: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    settle(true);
    // SAFETY: libc's execvpe with the caller's arguments.
    unsafe { real::execvpe(file, argv, envp) }
}

#[no_mangle]
pub unsafe extern "C" fn fexecve(fd: c_int, argv: *const *const c_char, envp: *const *const c_char) -> c_int {
    settle(true);
    // SAFETY: libc's fexecve with the caller's arguments.
    unsafe { real::fexecve(fd, argv, envp) }
}

#[no_mangle]
pub unsafe extern "C" fn execveat(
    dirfd: c_int,
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
    flags: c_int,
) -> c_int {
    settle(true);
    // SAFETY: libc's execveat with the caller's arguments.
    unsafe { real::execveat(dirfd, path, argv, envp, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn posix_spawn(
    pid: *mut pid_t,
    path: *const c_char,
    fa: *const c_void,
    attr: *const c_void,
    argv: *const *mut c_char,
    envp: *const *mut c_char,
) -> c_int {
    settle(false);
    // SAFETY: libc's posix_spawn with the caller's arguments.
    unsafe { real::posix_spawn(pid, path, fa, attr, argv, envp) }
}

#[no_mangle]
pub unsafe extern "C" fn posix_spawnp(
    pid: *mut pid_t,
    file: *const c_char,
    fa: *const c_void,
    attr: *const c_void,
    argv: *const *mut c_char,
    envp: *const *mut c_char,
) -> c_int {
    settle(false);
    // SAFETY: libc's posix_spawnp with the caller's arguments.
    unsafe { real::posix_spawnp(pid, file, fa, attr, argv, envp) }
}

/// A spawned child will get a copy of `fd` (inherited whatever `fd`'s
/// close-on-exec flag): its connection is settled now if it is not
/// decided yet, and a carried one demoted. A carried one that cannot be
/// is not given: the action closes `to` in the child instead, as the
/// close-on-exec flag of a carried descriptor would (the child reads its
/// stdin's end, say, while the parent keeps the connection).
#[no_mangle]
pub unsafe extern "C" fn posix_spawn_file_actions_adddup2(fa: *mut c_void, fd: c_int, to: c_int) -> c_int {
    if settle_fd(fd) {
        crate::dev::debug(&format!("a spawned program does not get carried descriptor {fd} (as {to})"));
        // SAFETY: libc's posix_spawn_file_actions_addclose with the
        // caller's actions and target.
        return unsafe { real::posix_spawn_file_actions_addclose(fa, to) };
    }
    // SAFETY: libc's posix_spawn_file_actions_adddup2 with the caller's
    // arguments.
    unsafe { real::posix_spawn_file_actions_adddup2(fa, fd, to) }
}

#[no_mangle]
pub unsafe extern "C" fn system(cmd: *const c_char) -> c_int {
    // `system(NULL)` only asks whether a shell exists.
    if !cmd.is_null() {
        settle(false);
    }
    // SAFETY: libc's system with the caller's argument.
    unsafe { real::system(cmd) }
}

#[no_mangle]
pub unsafe extern "C" fn popen(cmd: *const c_char, mode: *const c_char) -> *mut c_void {
    settle(false);
    // SAFETY: libc's popen with the caller's arguments.
    unsafe { real::popen(cmd, mode) }
}

/// A `vfork` child that leaves without an exec (`if (chdir(d) < 0)
/// _exit(1);`) puts its parent's table back first ([`vfork::exiting`]).
#[no_mangle]
pub unsafe extern "C" fn _exit(code: c_int) -> ! {
    vfork::exiting();
    // SAFETY: libc's _exit, which does not return.
    unsafe { real::_exit(code) };
    std::process::abort()
}

/// As [`_exit`].
#[no_mangle]
pub unsafe extern "C" fn _Exit(code: c_int) -> ! {
    vfork::exiting();
    // SAFETY: libc's _Exit, which does not return.
    unsafe { real::_Exit(code) };
    std::process::abort()
}

/// As [`_exit`] (a `vfork` child's `exit` runs its parent's `atexit`
/// handlers: the program's doing; the table is put back before them).
#[no_mangle]
pub unsafe extern "C" fn exit(code: c_int) -> ! {
    vfork::exiting();
    // SAFETY: libc's exit, which does not return.
    unsafe { real::exit(code) };
    std::process::abort()
}

/// Settles, then gives the address of libc's function of that name.
fn settle_then(slot: &std::sync::atomic::AtomicUsize, name: &'static [u8]) -> usize {
    settle(true);
    real::lookup(slot, name)
}

/// An exported variadic function of libc's exec family (its arguments
/// are a list ended by a null pointer, which stable Rust cannot take): a
/// trampoline that keeps the caller's argument registers (and `rax`, the
/// count of vector registers a variadic call passes), calls `$prep`
/// (settle, then libc's function's address), restores them and jumps to
/// libc's function, whose stack arguments are where the caller put them.
#[cfg(target_arch = "x86_64")]
macro_rules! variadic_exec {
    ($name:ident, $prep:ident, $libc:literal) => {
        #[unsafe(naked)]
        #[no_mangle]
        pub unsafe extern "C" fn $name() {
            // Entry: rsp is 8 past a 16-byte boundary (the return
            // address); seven pushes make it 16-aligned for the call.
            core::arch::naked_asm!(
                "push rdi",
                "push rsi",
                "push rdx",
                "push rcx",
                "push r8",
                "push r9",
                "push rax",
                "call {prep}",
                "mov r11, rax",
                "pop rax",
                "pop r9",
                "pop r8",
                "pop rcx",
                "pop rdx",
                "pop rsi",
                "pop rdi",
                "jmp r11",
                prep = sym $prep,
            )
        }

        extern "C" fn $prep() -> usize {
            static SLOT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            settle_then(&SLOT, $libc)
        }
    };
}

#[cfg(target_arch = "x86_64")]
variadic_exec!(execl, execl_prep, b"execl\0");
#[cfg(target_arch = "x86_64")]
variadic_exec!(execle, execle_prep, b"execle\0");
#[cfg(target_arch = "x86_64")]
variadic_exec!(execlp, execlp_prep, b"execlp\0");
