//! Live migration, deterministic: three `Hca`s (A, B, C) joined pairwise
//! by in-memory byte streams, every frame encoded and decoded as on TCP.
//! A tenant on A talks to a peer on B; it is paused, exported, imported on
//! C and resumed there (and back), while its traffic runs; faults (a
//! tenant that never resumes, a forged snapshot, a frame from the old
//! location) are injected by the tests. See `hca::migrate`.

use super::two_hosts::{conn, connect_side, frame_bytes, gid_ah, host_with};
use super::*;
use crate::hca::migrate::{MigrateError, SnapshotError, TenantSnapshot};
use crate::verbs::Gid;
use crate::wire::{parse_frame, DataRepr, FrameRepr, MovedRepr, Opcode};

const IPS: [[u8; 4]; 3] = [[10, 0, 0, 1], [10, 0, 0, 2], [10, 0, 0, 3]];
const A: usize = 0;
const B: usize = 1;
const C: usize = 2;

/// A link between two hosts: each end's id for it.
struct Wire {
    ends: [(usize, LinkId); 2],
}

struct ThreeHosts {
    hosts: Vec<Env>,
    wires: Vec<Wire>,
    /// What crossed: PAUSED NAKs, Moved frames accepted and refused.
    seen: Seen,
    /// Outstanding requests in each snapshot taken.
    outstanding: Vec<usize>,
    /// Moves during which B had received part of a message.
    mid_message: u32,
}

#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    paused_naks: u32,
    moved_ok: u32,
    moved_refused: u32,
}

/// A host whose device has no context open yet.
fn bare_host(ip: [u8; 4], tune: &dyn Fn(&mut HcaConfig)) -> Env {
    let mut env = Env::new();
    let mut config = HcaConfig::for_host(ip);
    tune(&mut config);
    env.hca = Hca::new(config, Box::new(Counter(u32::from(ip[3]) << 16)));
    env
}

impl ThreeHosts {
    /// A with the tenant's contexts, B with its peer's, C with none; a
    /// link between each pair, chunks of `chunk` bytes.
    fn new(chunk: u32, tune: impl Fn(&mut HcaConfig)) -> ThreeHosts {
        let hosts = vec![host_with(IPS[A], &tune), host_with(IPS[B], &tune), bare_host(IPS[C], &tune)];
        let mut t = ThreeHosts {
            hosts,
            wires: Vec::new(),
            seen: Seen::default(),
            outstanding: Vec::new(),
            mid_message: 0,
        };
        for (x, y) in [(A, B), (B, C), (A, C)] {
            let lx = t.link_up(x, y, chunk);
            let ly = t.link_up(y, x, chunk);
            t.wires.push(Wire { ends: [(x, lx), (y, ly)] });
        }
        t
    }

    fn link_up(&mut self, from: usize, to: usize, chunk: u32) -> LinkId {
        let lid = self.hosts[to].hca.config().port.lid;
        self.hosts[from].hca.link_up(LinkInfo { gid: Gid::from_ipv4(IPS[to]), lid, chunk, verified: true })
    }

    /// Host `x`'s link to host `y`.
    fn link(&self, x: usize, y: usize) -> LinkId {
        self.wires
            .iter()
            .find_map(|w| match w.ends {
                [(a, la), (b, _)] if a == x && b == y => Some(la),
                [(a, _), (b, lb)] if a == y && b == x => Some(lb),
                _ => None,
            })
            .expect("every pair is linked")
    }

    fn two(&mut self, x: usize, y: usize) -> (&mut Env, &mut Env) {
        assert_ne!(x, y);
        if x < y {
            let (lo, hi) = self.hosts.split_at_mut(y);
            (&mut lo[x], &mut hi[0])
        } else {
            let (lo, hi) = self.hosts.split_at_mut(x);
            (&mut hi[0], &mut lo[y])
        }
    }

    /// Moves one frame from `x` to `y`, if `x` has one on that link.
    fn carry(&mut self, x: usize, y: usize, now: Instant) -> bool {
        let (lx, ly) = (self.link(x, y), self.link(y, x));
        let (from, to) = self.two(x, y);
        let Some(t) = from.hca.poll_transmit(lx, now, &mut from.io) else { return false };
        let seen = deliver(&frame_bytes(&t), to, ly, now);
        self.seen.paused_naks += seen.paused_naks;
        self.seen.moved_ok += seen.moved_ok;
        self.seen.moved_refused += seen.moved_refused;
        true
    }

    /// One round: an engine pass on every host, a frame each way on every
    /// link. Returns whether anything moved.
    fn round(&mut self, now: Instant) -> bool {
        let mut busy = false;
        for h in &mut self.hosts {
            busy |= h.step(now).again() | h.hca.needs_pass();
        }
        for (x, y) in [(A, B), (B, A), (B, C), (C, B), (A, C), (C, A)] {
            busy |= self.carry(x, y, now);
        }
        busy
    }

    /// Rounds until nothing moves.
    fn run(&mut self, now: Instant) {
        for _ in 0..10_000 {
            if !self.round(now) {
                return;
            }
        }
        panic!("the hosts stayed busy for 10000 rounds");
    }

    /// `n` steps of `step`, running every host after each.
    fn advance(&mut self, from: Instant, step: Duration, n: u32) -> Instant {
        let mut now = from;
        for _ in 0..n {
            now = now + step;
            self.run(now);
        }
        now
    }

    /// Moves the tenant from host `x` to host `y`: pause, export, drop
    /// at `x`, import at `y` (its memory and queue rings go along, as a
    /// VM's shared memory does), resume. Returns the snapshot's size.
    fn migrate(&mut self, x: usize, y: usize, mem: &HashMap<u32, Region>, now: Instant) -> usize {
        self.hosts[x].hca.pause_tenant(TENANT).expect("pause");
        let partial = |q: &crate::hca::objects::Qp| {
            q.remote.as_ref().and_then(|r| r.recv.as_ref()).is_some_and(|r| r.cur.is_some())
        };
        if self.hosts[B].hca.qps.values().any(partial) {
            self.mid_message += 1;
        }
        let bytes = self.hosts[x].hca.export_tenant(TENANT).expect("export");
        self.hosts[x].hca.finish_export(TENANT).expect("drop at the source");
        let snap = TenantSnapshot::decode(&bytes).expect("our own snapshot decodes");
        self.outstanding.push(snap.qps.iter().filter_map(|q| q.send.as_ref()).map(|s| s.sent.len()).sum());
        let (from, to) = self.two(x, y);
        move_queues(&snap, from, to);
        let mut region_of = |m: &crate::hca::migrate::MrImport| mem.get(&m.key).cloned();
        let t = to.hca.import_tenant(&bytes, now, &mut region_of).expect("import");
        assert_eq!(t, TENANT);
        to.hca.resume_tenant(TENANT, now).expect("resume");
        bytes.len()
    }
}

/// Delivers one frame's bytes to `to` on its link `link`; says what it was.
fn deliver(bytes: &[u8], to: &mut Env, link: LinkId, now: Instant) -> Seen {
    let (repr, payload) = parse_frame(bytes).expect("a frame we emitted parses");
    let mut seen = Seen::default();
    match repr {
        FrameRepr::Data(d) => {
            if d.aeth
                .is_some_and(|a| a.syndrome == crate::wire::Syndrome::Nak(crate::wire::NakCode::QpPaused))
            {
                seen.paused_naks += 1;
            }
            match to.hca.handle_data(link, &d, now, &mut to.io) {
                Sink::Place(w) => {
                    assert_eq!(w.iter().map(|s| s.len).sum::<usize>(), payload.len());
                    let mut at = 0;
                    for s in &w {
                        s.region.write(s.off, &payload[at..at + s.len]).unwrap();
                        at += s.len;
                    }
                }
                Sink::Discard => {}
            }
            to.hca.data_placed(link, now, &mut to.io);
        }
        FrameRepr::Moved(m) => {
            if to.hca.handle_moved(link, &m, now) {
                seen.moved_ok += 1;
            } else {
                seen.moved_refused += 1;
            }
        }
        other => panic!("unexpected frame {other:?}"),
    }
    seen
}

/// What the driver's queues (the tenant's shared memory) hold for the
/// snapshot's QPs and CQs moves from one host's driver to the other's.
fn move_queues(snap: &TenantSnapshot, from: &mut Env, to: &mut Env) {
    let (f, t) = (&mut from.io, &mut to.io);
    for q in &snap.qps {
        let n = q.qpn;
        macro_rules! mv {
            ($field:ident) => {
                if let Some(v) = f.$field.remove(&n) {
                    t.$field.insert(n, v);
                }
            };
        }
        mv!(send);
        mv!(recv);
        mv!(states);
        mv!(pulled);
        mv!(retired);
        mv!(send_cqes);
        if let Some(ctx) = from.owner.remove(&n) {
            to.owner.insert(n, ctx);
        }
    }
    for c in &snap.cqs {
        if let Some(v) = f.cqs.remove(&c.cq) {
            t.cqs.insert(c.cq, v);
        }
        if let Some(v) = f.cq_cap.remove(&c.cq) {
            t.cq_cap.insert(c.cq, v);
        }
    }
    for s in &snap.srqs {
        if let Some(v) = f.srq.remove(&s.srq) {
            t.srq.insert(s.srq, v);
        }
    }
    // Posts not yet noticed are noticed at the destination.
    t.posted.extend(snap.qps.iter().map(|q| q.qpn));
}

/// Receive slots of 1 KiB at the start of a peer's region.
const SLOTS: u64 = 16;
const SLOT: u64 = 1024;
/// Where RDMA writes land in the peer's region.
const WRITES_AT: u64 = 32 << 10;

/// The bytes of message `k`: its number, then a pattern.
fn message(k: u64, len: usize) -> Vec<u8> {
    let mut v = pattern(len, k as u8);
    v[..8].copy_from_slice(&k.to_le_bytes());
    v
}

/// Message `k` from A to B: even numbers are sends (600 bytes: three
/// chunks of 256, so a move can fall mid-message), odd numbers RDMA
/// writes with immediate `k` (300 bytes).
fn a_to_b(k: u64, a: &End, b: &End) -> SendWr {
    let slot = (k % SLOTS) * SLOT;
    if k.is_multiple_of(2) {
        a.buf.write(slot as usize, &message(k, 600));
        wr(k, SendOpcode::Send, &[a.buf.sge(slot, 600)], SendFlags::SIGNALED)
    } else {
        a.buf.write(slot as usize, &message(k, 300));
        let mut w = rdma(
            k,
            SendOpcode::RdmaWriteWithImm,
            &[a.buf.sge(slot, 300)],
            b.buf.addr + WRITES_AT + slot,
            b.buf.key,
        );
        w.imm_data = k as u32;
        w.flags = SendFlags::SIGNALED;
        w
    }
}

/// Checks the receive completions `got` at B against messages from `next` on.
fn check_at_b(got: &[Cqe], next: &mut u64, b: &End) {
    for c in got {
        let k = *next;
        assert_eq!((c.wr_id, c.status), (k, WcStatus::Success), "message {k} at B: {c:?}");
        let slot = (k % SLOTS) * SLOT;
        if k.is_multiple_of(2) {
            assert_eq!((c.opcode, c.byte_len), (WcOpcode::Recv, 600), "message {k}");
            assert_eq!(b.buf.read(slot as usize, 600), message(k, 600), "message {k}'s bytes");
        } else {
            assert_eq!(
                (c.opcode, c.imm_data, c.byte_len),
                (WcOpcode::RecvRdmaWithImm, k as u32, 300),
                "message {k}"
            );
            assert_eq!(b.buf.read((WRITES_AT + slot) as usize, 300), message(k, 300), "message {k}'s bytes");
        }
        *next += 1;
    }
}

/// The tenant's end on A and the peer's on B, connected; the memory
/// regions of the tenant by key (its "VM memory").
fn setup(t: &mut ThreeHosts) -> (End, End, HashMap<u32, Region>) {
    let a = t.hosts[A].end(C1);
    let b = t.hosts[B].end(C1);
    connect_side(&mut t.hosts[A], a.qpn, b.qpn, IPS[B], conn());
    connect_side(&mut t.hosts[B], b.qpn, a.qpn, IPS[A], conn());
    let mem = HashMap::from([(a.buf.key, a.buf.mem.clone())]);
    (a, b, mem)
}

fn tune(c: &mut HcaConfig) {
    c.migration_pause_limit = Duration::from_secs(2);
    c.migration_probe_interval = Duration::from_millis(10);
}

/// A streams sends and writes with immediate to B, and B sends to A,
/// while A's tenant moves A → C → A → C → A, each time mid-stream, with
/// B's requests answered PAUSED meanwhile: every message arrives once and
/// in order, every completion comes once on both sides, B's QP never
/// leaves RTS.
#[test]
fn a_tenant_moves_back_and_forth_mid_stream_and_its_peer_sees_only_pauses() {
    let mut t = ThreeHosts::new(256, tune);
    let (a, b, mem) = setup(&mut t);
    // B's receives, and A's for B's messages.
    let (mut b_posted, mut a_posted) = (0u64, 0u64);
    let (mut sent_ab, mut sent_ba) = (0u64, 0u64);
    let (mut next_at_b, mut next_done_a) = (0u64, 0u64);
    let (mut next_at_a, mut next_done_b) = (0u64, 0u64);
    let mut at = A; // where the tenant is
    let route = [A, C, A, C, A];
    let mut moves = 0;
    let mut now = T0;
    const TOTAL: u64 = 120;
    for round in 0..400u32 {
        // Keep receives posted ahead on both sides (slots are reused
        // only once their message was checked).
        while b_posted < next_at_b + SLOTS / 2 {
            let slot = (b_posted % SLOTS) * SLOT;
            t.hosts[B].io.post_recv(b.qpn, recv(b_posted, &[b.buf.sge(slot, SLOT as u32)]));
            b_posted += 1;
        }
        while a_posted < next_at_a + SLOTS / 2 {
            let slot = 48 * 1024 + (a_posted % SLOTS) * 256;
            t.hosts[at].io.post_recv(a.qpn, recv(a_posted, &[a.buf.sge(slot, 256)]));
            a_posted += 1;
        }
        // A posts up to 3 new messages, within its send queue.
        for _ in 0..3 {
            if sent_ab < TOTAL && sent_ab < next_done_a + 6 {
                let w = a_to_b(sent_ab, &a, &b);
                t.hosts[at].io.post_send(a.qpn, w);
                sent_ab += 1;
            }
        }
        // B sends one to A.
        if sent_ba < TOTAL / 2 && sent_ba < next_done_b + 4 {
            let slot = 40 * 1024 + (sent_ba % SLOTS) * 64;
            b.buf.write(slot as usize, &message(sent_ba, 64));
            t.hosts[B]
                .io
                .post_send(b.qpn, wr(sent_ba, SendOpcode::Send, &[b.buf.sge(slot, 64)], SendFlags::SIGNALED));
            sent_ba += 1;
        }
        // A few rounds of progress, not to completion: the move falls
        // with requests in flight and messages half sent.
        now = now + Duration::from_micros(50);
        for _ in 0..(round % 4) {
            t.round(now);
        }
        if round % 15 == 14 && moves + 1 < route.len() {
            // B keeps probing the paused QP for a while, within the bound.
            t.hosts[at].hca.pause_tenant(TENANT).unwrap();
            now = t.advance(now, Duration::from_millis(10), 5);
            // A cancelled move first: the tenant resumes where it was.
            t.hosts[at].hca.resume_tenant(TENANT, now).unwrap();
            for _ in 0..3 {
                t.round(now);
            }
            let to = route[moves + 1];
            t.migrate(at, to, &mem, now);
            at = to;
            moves += 1;
        }
        // Check what completed so far.
        let got = t.hosts[B].poll(b.cq);
        let (recvs, sends): (Vec<Cqe>, Vec<Cqe>) = got.into_iter().partition(|c| c.opcode.is_recv());
        check_at_b(&recvs, &mut next_at_b, &b);
        for c in sends {
            assert_eq!((c.wr_id, c.status, c.opcode), (next_done_b, WcStatus::Success, WcOpcode::Send));
            next_done_b += 1;
        }
        let got = t.hosts[at].poll(a.cq);
        for c in got {
            if c.opcode.is_recv() {
                let k = next_at_a;
                assert_eq!((c.wr_id, c.status, c.byte_len), (k, WcStatus::Success, 64), "message {k} at A");
                let slot = 48 * 1024 + (k % SLOTS) * 256;
                assert_eq!(a.buf.read(slot as usize, 64), message(k, 64), "message {k}'s bytes at A");
                next_at_a += 1;
            } else {
                let k = next_done_a;
                let op = if k.is_multiple_of(2) { WcOpcode::Send } else { WcOpcode::RdmaWrite };
                assert_eq!(
                    (c.wr_id, c.status, c.opcode),
                    (k, WcStatus::Success, op),
                    "completion of {k} at A"
                );
                next_done_a += 1;
            }
        }
        assert_ne!(t.hosts[B].io.state(b.qpn), Some(QpState::Err), "B's QP in round {round}");
        for h in [A, C] {
            if h != at {
                assert!(
                    t.hosts[h].io.cqs.get(&a.cq).is_none_or(|v| v.is_empty()),
                    "a completion left behind"
                );
            }
        }
        if next_at_b == TOTAL && next_done_a == TOTAL && next_at_a == TOTAL / 2 && next_done_b == TOTAL / 2 {
            break;
        }
        t.run(now);
    }
    assert_eq!(moves, route.len() - 1, "every move happened");
    assert_eq!((next_at_b, next_done_a, next_at_a, next_done_b), (TOTAL, TOTAL, TOTAL / 2, TOTAL / 2));
    assert_eq!(at, A);
    // Nothing more comes: every completion came once.
    t.advance(now, Duration::from_millis(100), 5);
    assert!(t.hosts[B].poll(b.cq).is_empty() && t.hosts[A].poll(a.cq).is_empty());
    assert_eq!(t.hosts[A].io.retirement(a.qpn), (TOTAL as u32, TOTAL as u32));
    // The moves fell mid-stream, B was told to wait, and learnt each
    // new location (4 moves and 4 cancelled ones).
    assert!(t.outstanding.iter().any(|&n| n > 0), "no move had requests outstanding: {:?}", t.outstanding);
    assert!(t.mid_message > 0, "no move fell in the middle of a message");
    assert!(t.seen.paused_naks > 0 && t.seen.moved_ok == 8 && t.seen.moved_refused == 0, "{:?}", t.seen);
}

/// B sends to A; A's tenant pauses and never resumes (its destination
/// died, the move was abandoned): B's requester waits, spending no retry
/// (its transport timer alone would fail it in about 0.2 s), and fails
/// RETRY_EXC_ERR once the pause outlasts the bound (2 s here), not before.
#[test]
fn a_peer_that_never_resumes_fails_its_requester_after_the_bound_not_before() {
    let mut t = ThreeHosts::new(256, tune);
    let (a, b, _mem) = setup(&mut t);
    t.hosts[A].io.post_recv(a.qpn, recv(1, &[a.buf.sge(0, 64)]));
    t.hosts[B].io.post_send(b.qpn, wr(7, SendOpcode::Send, &[b.buf.sge(0, 64)], SendFlags::SIGNALED));
    t.run(T0);
    assert_eq!(t.hosts[B].poll(b.cq).len(), 1, "the first send completes");
    t.hosts[A].hca.pause_tenant(TENANT).unwrap();
    t.hosts[B].io.post_send(b.qpn, wr(8, SendOpcode::Send, &[b.buf.sge(0, 64)], SendFlags::SIGNALED));
    t.run(T0);
    assert!(t.seen.paused_naks >= 1, "B was told the peer is paused");
    // 1.9 s in 100 ms steps: B probes, is told PAUSED each time, waits.
    let now = t.advance(T0, Duration::from_millis(100), 19);
    assert!(t.hosts[B].poll(b.cq).is_empty(), "B's send failed before the bound");
    assert_ne!(t.hosts[B].io.state(b.qpn), Some(QpState::Err));
    assert!(t.seen.paused_naks >= 10, "B probed the paused QP: {:?}", t.seen);
    // Past the bound: as for a dead host.
    t.advance(now, Duration::from_millis(100), 2);
    let got = t.hosts[B].poll(b.cq);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!((got[0].wr_id, got[0].status), (8, WcStatus::RetryExcErr));
    assert_eq!(t.hosts[B].io.state(b.qpn), Some(QpState::Err));
}

/// A move in one step, for the fault tests: the tenant's snapshot taken
/// on A (paused), and the region map.
fn paused_snapshot() -> (ThreeHosts, End, End, HashMap<u32, Region>, Vec<u8>) {
    let mut t = ThreeHosts::new(256, tune);
    let (a, b, mem) = setup(&mut t);
    // Something outstanding and something in progress.
    t.hosts[B].io.post_recv(b.qpn, recv(1, &[b.buf.sge(0, 1024)]));
    t.hosts[A].io.post_send(a.qpn, a_to_b(0, &a, &b));
    t.round(T0);
    t.round(T0);
    t.hosts[A].hca.pause_tenant(TENANT).unwrap();
    let bytes = t.hosts[A].hca.export_tenant(TENANT).unwrap();
    (t, a, b, mem, bytes)
}

/// A snapshot is untrusted: truncated at every length, with any byte
/// changed, or with forged fields, it is refused with an error (or, for
/// a change that leaves it consistent, accepted), never a panic; a
/// refused import changes nothing.
#[test]
fn a_corrupt_truncated_or_forged_snapshot_is_refused_without_a_panic() {
    let (_t, _a, _b, mem, bytes) = paused_snapshot();
    let fresh = || bare_host(IPS[C], &tune);
    let mut region_of = |m: &crate::hca::migrate::MrImport| mem.get(&m.key).cloned();
    // The good one imports.
    let mut c = fresh();
    assert_eq!(c.hca.import_tenant(&bytes, T0, &mut region_of), Ok(TENANT));
    // Truncated anywhere.
    for n in 0..bytes.len() {
        let mut c = fresh();
        assert!(c.hca.import_tenant(&bytes[..n], T0, &mut region_of).is_err(), "truncated at {n}");
        assert!(c.hca.qps.is_empty() && c.hca.contexts.is_empty() && c.hca.usage(TENANT) == (0, 0));
    }
    // Every byte changed: refused, or consistent and accepted.
    let (mut refused, mut accepted) = (0, 0);
    for i in 0..bytes.len() {
        let mut v = bytes.clone();
        v[i] ^= 0x5a;
        let mut c = fresh();
        match c.hca.import_tenant(&v, T0, &mut region_of) {
            Ok(_) => accepted += 1,
            Err(_) => {
                assert!(c.hca.qps.is_empty() && c.hca.mrs.is_empty() && c.hca.contexts.is_empty());
                refused += 1;
            }
        }
    }
    // Most bytes are values (ids, addresses, attributes) that stay in
    // range when changed; what matters is that none panics and a
    // refusal changes nothing.
    assert!(refused > 0 && refused + accepted == bytes.len(), "{refused} refused, {accepted} accepted");
    // Forged fields, each refused with its reason.
    let snap = TenantSnapshot::decode(&bytes).unwrap();
    let forge = |f: &dyn Fn(&mut TenantSnapshot)| {
        let mut s = snap.clone();
        f(&mut s);
        s.encode()
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("magic", [b"XXXX".as_slice(), &bytes[4..]].concat()),
        ("version 1 (before placements)", [b"vRMS\x00\x01".as_slice(), &bytes[6..]].concat()),
        ("version 2 (before channels)", [b"vRMS\x00\x02".as_slice(), &bytes[6..]].concat()),
        ("version 3 (before remembered answers)", [b"vRMS\x00\x03".as_slice(), &bytes[6..]].concat()),
        ("version 4 (before rdma_cm state)", [b"vRMS\x00\x04".as_slice(), &bytes[6..]].concat()),
        (
            "version 5 (before memory extents' owners and regions of pieces)",
            [b"vRMS\x00\x05".as_slice(), &bytes[6..]].concat(),
        ),
        ("version 7", [b"vRMS\x00\x07".as_slice(), &bytes[6..]].concat()),
        ("trailing bytes", [bytes.as_slice(), &[0]].concat()),
        ("host-local tenant", forge(&|s| s.tenant = TenantId::HOST_LOCAL_BASE + 1)),
        ("QP of a context not in it", forge(&|s| s.qps[0].ctx = 99)),
        ("QP on a CQ not in it", forge(&|s| s.qps[0].init.send_cq = 0x777)),
        ("QPN above 24 bits", forge(&|s| s.qps[0].qpn = 1 << 24)),
        (
            "two QPs with one number",
            forge(&|s| {
                let q = s.qps[0].clone();
                s.qps.push(q)
            }),
        ),
        (
            "a key twice",
            forge(&|s| {
                let m = s.mrs[0].clone();
                s.mrs.push(m)
            }),
        ),
        ("region past the address space", forge(&|s| s.mrs[0].addr = u64::MAX - 10)),
        ("unknown access bits", forge(&|s| s.mrs[0].access = 0xffff_0000)),
        ("CQ ring not a power of two", forge(&|s| s.cqs[0].ring_bytes = 3 * crate::ring::CQE_SIZE as u64)),
        ("epoch 0", forge(&|s| s.qps[0].epoch = 0)),
        (
            "PSN gap",
            forge(&|s| {
                let q = s.qps[0].send.as_mut().unwrap();
                q.next_psn = psn(q.next_psn + 5);
            }),
        ),
        ("a WR that does not decode", forge(&|s| s.qps[0].send.as_mut().unwrap().sent[0].wr.0[8] = 0xee)),
        (
            "more WRs than the queue",
            forge(&|s| {
                let q = s.qps[0].send.as_mut().unwrap();
                let w = q.sent[0].clone();
                for i in 0..20 {
                    let mut w = w.clone();
                    w.first_psn = psn(q.next_psn + i);
                    w.npsn = 1;
                    q.sent.push(w);
                }
                q.next_psn = psn(q.next_psn + 20);
            }),
        ),
    ];
    assert!(
        snap.qps[0].send.as_ref().is_some_and(|s| !s.sent.is_empty()),
        "the snapshot has a request outstanding"
    );
    for (what, v) in cases {
        let mut c = fresh();
        let r = c.hca.import_tenant(&v, T0, &mut region_of);
        assert!(r.is_err(), "{what}: accepted");
        assert!(c.hca.qps.is_empty() && c.hca.contexts.is_empty(), "{what}: changed the host");
    }
    // No memory for a region.
    let mut c = fresh();
    let r = c.hca.import_tenant(&bytes, T0, &mut |_| None);
    assert!(matches!(r, Err(SnapshotError::Invalid(_))), "{r:?}");
    assert!(c.hca.qps.is_empty());
}

/// A VM tenant's placement (where each region and ring lies in the VM's
/// region) travels in the snapshot and is checked as untrusted: every
/// object placed once, inside the region, rings aligned, long enough and
/// clear of each other and of memory regions; each context's own segment
/// (event and posted rings) placed likewise. The importer is told each
/// region's offset.
#[test]
fn a_placement_is_carried_and_checked_against_the_region_and_the_objects() {
    use crate::hca::migrate::{ChannelAt, Extent, MemoryAt, MrAt, MrPiecesAt, Placement, QpAt, RingAt};
    let (_t, _a, _b, mem, bytes) = paused_snapshot();
    let snap = TenantSnapshot::decode(&bytes).unwrap();
    assert_eq!(snap.placement, None, "the core knows no region; the driver fills it");
    let (mr, cq, qp) = (&snap.mrs[0], &snap.cqs[0], &snap.qps[0]);
    let page = 4096u64;
    let mr_span = mr.len.next_multiple_of(page);
    // The MR's context's memory extent (the MR a page into it), then an
    // extent holding the CQ's ring, one the QP's, one the contexts'
    // segments and the channel's ring.
    let cq_extent = 3 * page + mr_span;
    let placed = Placement {
        region_len: 16 << 20,
        extents: vec![
            Extent { at: 2 * page, len: page + mr_span },
            Extent { at: cq_extent, len: (1 << 20) - page - mr_span },
            Extent { at: 8 << 20, len: 2 << 20 },
        ],
        mrs: vec![MrAt { key: mr.key, at: 3 * page }],
        cqs: vec![RingAt { id: cq.cq, at: 3 * page + mr_span, len: cq.ring_bytes.next_multiple_of(page) }],
        srqs: Vec::new(),
        qps: vec![QpAt { qpn: qp.qpn, at: 8 << 20, len: 1 << 20, inbox: false, retired: 7, held: 1 }],
        contexts: (snap.contexts.iter())
            .zip(0u64..)
            .map(|(&id, i)| RingAt { id, at: (9 << 20) + i * (64 << 10), len: 64 << 10 })
            .collect(),
        // A completion channel serving the CQ, its ring after the
        // contexts' segments.
        channels: vec![ChannelAt {
            id: 0x0300_0001,
            ctx: cq.ctx,
            at: (9 << 20) + (256 << 10),
            len: 3 * page,
            cqs: vec![cq.cq],
        }],
        memory: vec![MemoryAt { ctx: mr.ctx, at: 2 * page, len: page + mr_span }],
        mr_pieces: Vec::new(),
    };
    assert_eq!(placed.contexts.len(), 2, "the tenant's two contexts");
    let other_ctx = *snap.contexts.iter().find(|&&c| c != cq.ctx).unwrap();
    let with = |f: &dyn Fn(&mut Placement)| {
        let mut s = snap.clone();
        let mut p = placed.clone();
        f(&mut p);
        s.placement = Some(p);
        s.encode()
    };
    // A region placed in pieces (version 6) passes, as one placed whole.
    let mut pieced = snap.clone();
    let mut p = placed.clone();
    let key = p.mrs.remove(0).key;
    p.mr_pieces = vec![MrPiecesAt {
        key,
        pieces: vec![Extent { at: 8 * page, len: 1 }, Extent { at: 3 * page, len: mr.len - 1 }],
    }];
    pieced.placement = Some(p.clone());
    pieced.check_placement(page).unwrap();
    // A context's segment 64-byte aligned but off a page: refused by the
    // check a driver runs before it maps anything.
    let mut off_page = pieced.clone();
    off_page.placement.as_mut().unwrap().contexts.last_mut().unwrap().at += 64;
    let e = off_page.check_placement(page).expect_err("a context's segment off a page");
    assert!(e.to_string().contains("not on a page"), "{e}");
    assert_eq!(TenantSnapshot::decode(&pieced.encode()).unwrap().placement, Some(p));
    // The good one imports, and decodes to what was encoded.
    let good = with(&|_| {});
    assert_eq!(TenantSnapshot::decode(&good).unwrap().placement.as_ref(), Some(&placed));
    let mut asked = Vec::new();
    let mut c = bare_host(IPS[C], &tune);
    let r = c.hca.import_tenant(&good, T0, &mut |m| {
        asked.push((m.key, m.at));
        mem.get(&m.key).cloned()
    });
    assert_eq!(r, Ok(TENANT));
    assert_eq!(asked, vec![(mr.key, Some(3 * page))], "the importer is told where the region is");
    // Forged placements, each refused, nothing changed.
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("a region of 0 bytes", with(&|p| p.region_len = 0)),
        ("a memory region unplaced", with(&|p| p.mrs.clear())),
        ("a memory region placed twice", with(&|p| p.mrs.push(p.mrs[0]))),
        (
            "a memory region placed whole and in pieces",
            with(&|p| {
                p.mr_pieces
                    .push(MrPiecesAt { key: mr.key, pieces: vec![Extent { at: 3 * page, len: mr.len }] })
            }),
        ),
        (
            "a region of no pieces",
            with(&|p| p.mr_pieces = vec![MrPiecesAt { key: p.mrs.remove(0).key, pieces: vec![] }]),
        ),
        (
            "a region of 65 pieces",
            with(&|p| {
                let key = p.mrs.remove(0).key;
                p.mr_pieces = vec![MrPiecesAt { key, pieces: vec![Extent { at: 3 * page, len: 1 }; 65] }];
            }),
        ),
        (
            "a region's pieces short of its length",
            with(&|p| {
                p.mr_pieces = vec![MrPiecesAt {
                    key: p.mrs.remove(0).key,
                    pieces: vec![Extent { at: 3 * page, len: mr.len - 1 }],
                }]
            }),
        ),
        (
            "a region's piece in no extent",
            with(&|p| {
                let key = p.mrs.remove(0).key;
                p.mr_pieces = vec![MrPiecesAt {
                    key,
                    pieces: vec![Extent { at: 3 * page, len: 1 }, Extent { at: 0, len: mr.len - 1 }],
                }];
            }),
        ),
        (
            "a region's piece on a ring",
            with(&|p| {
                let key = p.mrs.remove(0).key;
                let at = p.qps[0].at;
                p.mr_pieces = vec![MrPiecesAt {
                    key,
                    pieces: vec![Extent { at: 3 * page, len: 1 }, Extent { at, len: mr.len - 1 }],
                }];
            }),
        ),
        ("a key the snapshot lacks", with(&|p| p.mrs.push(MrAt { key: 0xdead, at: 0 }))),
        ("a CQ unplaced", with(&|p| p.cqs.clear())),
        ("a QP unplaced", with(&|p| p.qps.clear())),
        ("a context unplaced", with(&|p| p.contexts.clear())),
        ("a context placed twice", with(&|p| p.contexts.push(p.contexts[0]))),
        (
            "a context the snapshot lacks",
            with(&|p| p.contexts.push(RingAt { id: 77, at: 10 << 20, len: page })),
        ),
        ("a context's segment too short", with(&|p| p.contexts[0].len = page)),
        ("a context's segment misaligned", with(&|p| p.contexts[0].at += 8)),
        ("a context's segment on a QP's rings", with(&|p| p.contexts[0].at = p.qps[0].at)),
        ("two contexts' segments overlapping", with(&|p| p.contexts[1].at = p.contexts[0].at + 4096)),
        ("a context's segment on a memory region", with(&|p| p.contexts[0].at = p.mrs[0].at)),
        ("a context's segment in no extent", with(&|p| p.contexts[0].at = 12 << 20)),
        ("an SRQ the snapshot lacks", with(&|p| p.srqs.push(RingAt { id: 9, at: 0, len: page }))),
        ("a memory region past the end", with(&|p| p.mrs[0].at = p.region_len - 1)),
        ("a memory region wrapping", with(&|p| p.mrs[0].at = u64::MAX - 1)),
        ("a ring past the end", with(&|p| p.qps[0].at = p.region_len - page)),
        ("a ring wrapping", with(&|p| p.qps[0].at = !63)),
        ("a ring misaligned", with(&|p| p.cqs[0].at += 8)),
        ("a ring too short", with(&|p| p.cqs[0].len = 64)),
        ("a QP's rings too short", with(&|p| p.qps[0].len = 64)),
        ("more WRs held than the send queue", with(&|p| p.qps[0].held = 1 << 20)),
        ("a QP's capacities overflowing", {
            let mut f = snap.clone();
            f.qps[0].init.cap.max_send_wr = u32::MAX;
            f.qps[0].init.cap.max_send_sge = u32::MAX;
            f.placement = Some(placed.clone());
            f.check_placement(page).expect_err("a ring of 2^68 bytes fits nowhere");
            f.encode()
        }),
        ("rings overlapping", with(&|p| p.qps[0].at = p.cqs[0].at)),
        ("a memory region on a ring", with(&|p| p.mrs[0].at = p.qps[0].at + page)),
        ("a memory region in no extent", with(&|p| p.mrs[0].at = 0)),
        ("a ring in no extent", with(&|p| p.qps[0].at = 12 << 20)),
        ("a ring whose extent is elsewhere", with(&|p| p.extents[2].at = p.extents[1].at + p.extents[1].len)),
        ("extents overlapping", with(&|p| p.extents[2].at = p.extents[1].at)),
        ("extents unsorted", with(&|p| p.extents.reverse())),
        ("an extent past the end", with(&|p| p.extents[2].len = 9 << 20)),
        ("a channel numbered 0", with(&|p| p.channels[0].id = 0)),
        ("a channel placed twice", with(&|p| p.channels.push(p.channels[0].clone()))),
        ("a channel of a context the snapshot lacks", with(&|p| p.channels[0].ctx = 77)),
        ("a channel serving a CQ of another context", with(&|p| p.channels[0].ctx = other_ctx)),
        ("a channel serving a CQ the snapshot lacks", with(&|p| p.channels[0].cqs.push(0xdead))),
        ("a CQ twice on a channel", with(&|p| p.channels[0].cqs.push(cq.cq))),
        ("a CQ on two channels", {
            with(&|p| {
                let mut second = p.channels[0].clone();
                second.id += 1;
                second.at += 4 * page;
                p.channels.push(second);
            })
        }),
        ("a channel's ring too short", with(&|p| p.channels[0].len = 64)),
        ("a channel's ring misaligned", with(&|p| p.channels[0].at += 8)),
        ("a channel's ring on a context's segment", with(&|p| p.channels[0].at = p.contexts[0].at)),
        ("a channel's ring on a memory region", with(&|p| p.channels[0].at = p.mrs[0].at)),
        ("a channel's ring in no extent", with(&|p| p.channels[0].at = 12 << 20)),
        ("a channel's ring past the end", with(&|p| p.channels[0].at = p.region_len - 64)),
        ("more channels than a tenant may hold", {
            with(&|p| {
                let one = p.channels[0].clone();
                p.channels = (0..=crate::hca::migrate::MAX_CHANNELS_PER_TENANT as u32)
                    .map(|i| ChannelAt { id: one.id + i, cqs: Vec::new(), ..one.clone() })
                    .collect();
            })
        }),
    ];
    for (what, v) in cases {
        let mut c = bare_host(IPS[C], &tune);
        let r = c.hca.import_tenant(&v, T0, &mut |m| mem.get(&m.key).cloned());
        assert!(matches!(r, Err(SnapshotError::Invalid(_))), "{what}: {r:?}");
        assert!(c.hca.qps.is_empty() && c.hca.mrs.is_empty() && c.hca.contexts.is_empty(), "{what}");
    }
    // Memory extents (version 6), each refused for its reason.
    let memory: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "a memory region in no memory extent",
            with(&|p| p.memory.clear()),
            "in no memory extent of its context",
        ),
        (
            "a memory region in another context's memory extent",
            with(&|p| p.memory[0].ctx = other_ctx),
            "in no memory extent of its context",
        ),
        (
            "a memory extent of a context the snapshot lacks",
            with(&|p| p.memory[0].ctx = 77),
            "no such context",
        ),
        ("a memory extent listed twice", with(&|p| p.memory.push(p.memory[0])), "listed twice"),
        ("a memory extent past the end", with(&|p| p.memory[0].at = p.region_len - page), "outside a region"),
        ("a memory extent wrapping", with(&|p| p.memory[0].at = u64::MAX - page + 1), "outside a region"),
        ("a memory extent of 0 bytes", with(&|p| p.memory[0].len = 0), "outside a region"),
        (
            "a memory extent overlapping another",
            with(&|p| {
                p.memory[0].len = page;
                p.memory.push(MemoryAt { ctx: mr.ctx, at: 2 * page, len: page + mr_span });
            }),
            "not an extent of the placement",
        ),
        (
            "a memory extent across two extents",
            with(&|p| p.memory[0].len = page + mr_span + p.extents[1].len),
            "not an extent of the placement",
        ),
        (
            "a memory extent in free bytes",
            with(&|p| p.memory.push(MemoryAt { ctx: mr.ctx, at: 12 << 20, len: page })),
            "not an extent of the placement",
        ),
        (
            "a memory extent holding a ring",
            with(&|p| p.memory.push(MemoryAt { ctx: mr.ctx, at: p.extents[1].at, len: p.extents[1].len })),
            "holds a ring",
        ),
    ];
    for (what, v, why) in memory {
        let mut c = bare_host(IPS[C], &tune);
        let r = c.hca.import_tenant(&v, T0, &mut |m| mem.get(&m.key).cloned());
        assert!(matches!(&r, Err(SnapshotError::Invalid(m)) if m.contains(why)), "{what}: {r:?}");
        assert!(c.hca.qps.is_empty() && c.hca.mrs.is_empty() && c.hca.contexts.is_empty(), "{what}");
    }
    // Two memory regions on the same bytes are fine (a buffer registered
    // twice); that a region and a ring only touch, too.
    let mut c = bare_host(IPS[C], &tune);
    let touching = with(&|p| p.mrs[0].at = p.cqs[0].at - mr.len);
    assert_eq!(c.hca.import_tenant(&touching, T0, &mut |m| mem.get(&m.key).cloned()), Ok(TENANT));
}

fn psn(v: u32) -> u32 {
    v & crate::wire::MAX_24
}

/// Numbers already in use on the importing host are refused, by kind:
/// a context, a QPN, a memory key, an object id; and a tenant's quota
/// there is charged or the import refused.
#[test]
fn an_import_that_collides_or_passes_the_quota_is_refused() {
    let (_t, a, _b, mem, bytes) = paused_snapshot();
    let mut region_of = |m: &crate::hca::migrate::MrImport| mem.get(&m.key).cloned();
    // A host like A, with the same numbers in use.
    let mut c = host_with(IPS[C], tune);
    let r = c.hca.import_tenant(&bytes, T0, &mut region_of);
    assert!(matches!(&r, Err(SnapshotError::Collision(m)) if m.contains("context")), "{r:?}");
    // Contexts free, but a QP with the same number.
    let mut c = bare_host(IPS[C], &tune);
    c.hca.open_context(ContextId(50), OTHER_TENANT).unwrap();
    let mut qpns = Vec::new();
    while !qpns.contains(&a.qpn) {
        qpns.push(c.end(ContextId(50)).qpn);
    }
    let r = c.hca.import_tenant(&bytes, T0, &mut region_of);
    assert!(
        matches!(&r, Err(SnapshotError::Collision(m)) if m.contains("QPN") || m.contains("object id") || m.contains("key")),
        "{r:?}"
    );
    // The tenant's quota here is too small for it.
    let mut c = bare_host(IPS[C], &tune);
    c.hca.set_quota(TENANT, Quota { max_objects: 2, ..Quota::default() });
    let r = c.hca.import_tenant(&bytes, T0, &mut region_of);
    assert!(matches!(r, Err(SnapshotError::Quota(_))), "{r:?}");
    assert!(c.hca.qps.is_empty() && c.hca.usage(TENANT) == (0, 0));
    // And a good import charges it.
    let mut c = bare_host(IPS[C], &tune);
    c.hca.import_tenant(&bytes, T0, &mut region_of).unwrap();
    let (objects, registered) = c.hca.usage(TENANT);
    assert_eq!(objects, 4, "a PD, an MR, a CQ and a QP");
    assert!(registered >= 64 << 10);
    // The driver's objects (a guest's completion channels) are counted in
    // the same check: room for the snapshot's four, not for a fifth, is a
    // refusal that changes nothing; room for five charges five.
    let mut c = bare_host(IPS[C], &tune);
    c.hca.set_quota(TENANT, Quota { max_objects: 4, ..Quota::default() });
    let r = c.hca.import_tenant_with(&bytes, T0, &mut region_of, 1);
    assert!(matches!(&r, Err(SnapshotError::Quota(m)) if m.contains("1 of them the driver's")), "{r:?}");
    assert!(c.hca.qps.is_empty() && c.hca.usage(TENANT) == (0, 0));
    let mut c = bare_host(IPS[C], &tune);
    c.hca.set_quota(TENANT, Quota { max_objects: 5, ..Quota::default() });
    c.hca.import_tenant_with(&bytes, T0, &mut region_of, 1).unwrap();
    assert_eq!(c.hca.usage(TENANT).0, 5);
}

/// A guest context's remembered answer (the number and reply of the last
/// numbered call its session answered, snapshot version 4) travels with
/// the snapshot, and a forged one is refused with nothing imported: of a
/// context the snapshot lacks, twice for one context, numbered 0, over
/// the size cap, or bytes that are no reply.
#[test]
fn remembered_answers_travel_and_forged_ones_are_refused() {
    use crate::hca::migrate::AnswerSnap;
    use crate::proto::guest::{encode_reply_body, Handle, MAX_REMEMBERED_REPLY};
    let (_t, _a, _b, mem, bytes) = paused_snapshot();
    let mut region_of = |m: &crate::hca::migrate::MrImport| mem.get(&m.key).cloned();
    let snap = TenantSnapshot::decode(&bytes).unwrap();
    assert!(snap.answers.is_empty(), "the core remembers nothing: the daemon fills them");
    let ctx = snap.contexts[0];
    let reply = encode_reply_body(
        &crate::proto::Reply::Pd { pd: 0x77 },
        &[Handle::Extent { offset: 4096, len: 4096 }],
    );
    let good = AnswerSnap { ctx, number: 41, reply: reply.clone() };
    let with = |answers: Vec<AnswerSnap>| {
        let mut s = snap.clone();
        s.answers = answers;
        s.encode()
    };
    // Round trip; the header says version 6 (4 added the answers, 6 the
    // owners of memory extents and the regions of pieces).
    let carried = with(vec![good.clone()]);
    assert_eq!(u16::from_be_bytes([carried[4], carried[5]]), 6);
    assert_eq!(TenantSnapshot::decode(&carried).unwrap().answers, vec![good.clone()]);
    let mut c = bare_host(IPS[C], &tune);
    assert_eq!(c.hca.import_tenant(&carried, T0, &mut region_of), Ok(TENANT));
    // A reply too large to keep travels as answered, without its bytes.
    let empty = AnswerSnap { reply: Vec::new(), ..good.clone() };
    let mut c = bare_host(IPS[C], &tune);
    assert_eq!(c.hca.import_tenant(&with(vec![empty]), T0, &mut region_of), Ok(TENANT));
    let huge = encode_reply_body(
        &crate::proto::Reply::Error { errno: 5, message: "x".repeat(MAX_REMEMBERED_REPLY) },
        &[],
    );
    let cases = [
        ("a context the snapshot lacks", vec![AnswerSnap { ctx: ctx ^ 0x40, ..good.clone() }]),
        ("twice for one context", vec![good.clone(), AnswerSnap { number: 42, ..good.clone() }]),
        ("numbered 0", vec![AnswerSnap { number: 0, ..good.clone() }]),
        ("over the cap", vec![AnswerSnap { reply: huge, ..good.clone() }]),
        ("bytes that are no reply", vec![AnswerSnap { reply: vec![0xff; 16], ..good.clone() }]),
        (
            "more handles than a reply holds",
            vec![AnswerSnap {
                reply: encode_reply_body(
                    &crate::proto::Reply::Done,
                    &[Handle::Bell { id: 1, hangup: false }; crate::proto::guest::MAX_HANDLES + 1],
                ),
                ..good.clone()
            }],
        ),
    ];
    for (what, answers) in cases {
        let mut c = bare_host(IPS[C], &tune);
        let r = c.hca.import_tenant(&with(answers), T0, &mut region_of);
        assert!(
            matches!(&r, Err(SnapshotError::Invalid(m)) if m.contains("remembered answer")),
            "{what}: {r:?}"
        );
        assert!(c.hca.qps.is_empty() && c.hca.mrs.is_empty() && c.hca.contexts.is_empty(), "{what}");
    }
}

/// After a move, the host the tenant left cannot speak for its QP: a
/// request frame from the old link is dropped, a Moved frame from there
/// with the old or the same epoch is refused; the new location's traffic
/// goes on.
#[test]
fn frames_from_the_old_location_are_dropped_after_a_move() {
    let mut t = ThreeHosts::new(256, tune);
    let (a, b, mem) = setup(&mut t);
    t.hosts[B].io.post_recv(b.qpn, recv(0, &[b.buf.sge(0, 1024)]));
    t.hosts[B].io.post_recv(b.qpn, recv(1, &[b.buf.sge(1024, 1024)]));
    t.hosts[A].io.post_send(a.qpn, a_to_b(0, &a, &b));
    t.run(T0);
    t.migrate(A, C, &mem, T0);
    t.run(T0);
    assert_eq!(t.seen.moved_ok, 1);
    let lb_a = t.link(B, A);
    let dropped =
        |t: &ThreeHosts| t.hosts[B].hca.links().iter().find(|l| l.id == lb_a).unwrap().stats.dropped_in;
    let before = dropped(&t);
    // A forged (or late) send from the old location, in sequence.
    let epsn = t.hosts[B].hca.qps[&b.qpn].remote.as_ref().unwrap().recv.as_ref().unwrap().epsn;
    let mut d = DataRepr::new(Opcode::SendOnly, TENANT.0, b.qpn, a.qpn, epsn);
    d.payload_len = 8;
    let mut frame = vec![0u8; d.header_len()];
    FrameRepr::Data(d).emit(&mut frame).unwrap();
    frame.extend(99u64.to_le_bytes());
    deliver(&frame, &mut t.hosts[B], lb_a, T0);
    assert_eq!(dropped(&t), before + 1, "the frame from the old link was dropped");
    let got = t.hosts[B].poll(b.cq);
    let mut next = 0;
    check_at_b(&got, &mut next, &b);
    assert_eq!(next, 1, "message 0 only, nothing from the forged frame: {got:?}");
    // Stale claims of the QP's location from the host it left (one from
    // the host it is on is a restored copy: `a_snapshot_restored_twice`).
    for (link, epoch) in [(lb_a, 1), (lb_a, 0)] {
        let m = MovedRepr { vnet: TENANT.0, qpn: a.qpn, peer_qpn: b.qpn, epoch };
        assert!(!t.hosts[B].hca.handle_moved(link, &m, T0), "epoch {epoch} on link {link:?} accepted");
    }
    // One for another tenant's network, or another QP, neither.
    let m = MovedRepr { vnet: OTHER_TENANT.0, qpn: a.qpn, peer_qpn: b.qpn, epoch: 9 };
    assert!(!t.hosts[B].hca.handle_moved(lb_a, &m, T0));
    let m = MovedRepr { vnet: TENANT.0, qpn: a.qpn + 1, peer_qpn: b.qpn, epoch: 9 };
    assert!(!t.hosts[B].hca.handle_moved(lb_a, &m, T0));
    // The new location still works.
    t.hosts[C].io.post_send(a.qpn, a_to_b(1, &a, &b));
    t.run(T0);
    let got = t.hosts[B].poll(b.cq);
    check_at_b(&got, &mut next, &b);
    assert_eq!(next, 2, "{got:?}");
    // The peer's completions still name the LID it had.
    assert_eq!(got[0].slid, t.hosts[A].hca.config().port.lid);
    let done: Vec<u64> = t.hosts[C].poll(a.cq).iter().map(|c| c.wr_id).collect();
    assert_eq!(done, vec![0, 1], "A's completions, the one made before the move included");
}

/// A snapshot of A's tenant (paused, exported, dropped at A: the VM saved
/// to a file) restored on C goes on where B holds its QP; restored there a
/// second time, after B moved on with the first copy, its Moved frame is
/// refused (same epoch, on the link the first came on), and its requests,
/// whose PSNs B has seen, are dropped rather than answered as duplicates:
/// the restored QP fails `RETRY_EXC_ERR` by its retry count, what it
/// posted after is flushed, B delivers nothing twice and stays in RTS.
#[test]
fn a_snapshot_restored_twice_fails_its_second_copy_cleanly() {
    let mut t = ThreeHosts::new(256, tune);
    let (a, b, mem) = setup(&mut t);
    for k in 0..4 {
        t.hosts[B].io.post_recv(b.qpn, recv(k, &[b.buf.sge(k * SLOT, SLOT as u32)]));
    }
    t.hosts[A].io.post_send(a.qpn, a_to_b(0, &a, &b));
    t.run(T0);
    let mut next = 0;
    check_at_b(&t.hosts[B].poll(b.cq), &mut next, &b);
    assert_eq!(next, 1);
    assert_eq!(t.hosts[A].poll(a.cq).len(), 1);
    // The snapshot: paused, exported, dropped at A.
    t.hosts[A].hca.pause_tenant(TENANT).unwrap();
    let snap = t.hosts[A].hca.export_tenant(TENANT).unwrap();
    t.hosts[A].hca.finish_export(TENANT).unwrap();
    let decoded = TenantSnapshot::decode(&snap).unwrap();
    let restore = |t: &mut ThreeHosts, now: Instant| {
        let (from, to) = t.two(A, C);
        move_queues(&decoded, from, to);
        let mut region_of = |m: &crate::hca::migrate::MrImport| mem.get(&m.key).cloned();
        to.hca.import_tenant(&snap, now, &mut region_of).expect("import");
        to.hca.resume_tenant(TENANT, now).expect("resume");
    };
    // First restore: B follows it, message 1 goes out from C.
    restore(&mut t, T0);
    t.hosts[C].io.post_send(a.qpn, a_to_b(1, &a, &b));
    t.run(T0);
    check_at_b(&t.hosts[B].poll(b.cq), &mut next, &b);
    assert_eq!(next, 2, "message 1 from the first restored copy");
    assert_eq!(
        t.hosts[C].poll(a.cq).iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        [(1, WcStatus::Success)]
    );
    assert_eq!((t.seen.moved_ok, t.seen.moved_refused), (1, 0));
    // That copy goes (the VM stopped), and the same snapshot is restored
    // again on C: it posts message 1 again (its PSN is one B has seen),
    // then 2.
    t.hosts[C].hca.pause_tenant(TENANT).unwrap();
    t.hosts[C].hca.finish_export(TENANT).unwrap();
    restore(&mut t, T0);
    t.hosts[C].io.post_send(a.qpn, a_to_b(1, &a, &b));
    t.run(T0);
    assert_eq!((t.seen.moved_ok, t.seen.moved_refused), (1, 1), "the second copy's Moved is refused");
    t.hosts[C].io.post_send(a.qpn, a_to_b(2, &a, &b));
    let now = t.advance(T0, Duration::from_millis(100), 10);
    let got: Vec<(u64, WcStatus)> = t.hosts[C].poll(a.cq).iter().map(|c| (c.wr_id, c.status)).collect();
    assert_eq!(got, [(1, WcStatus::RetryExcErr), (2, WcStatus::WrFlushErr)], "the second copy's completions");
    assert_eq!(t.hosts[C].io.state(a.qpn), Some(QpState::Err));
    assert!(t.hosts[B].poll(b.cq).is_empty(), "B delivered something from the stale copy");
    assert_eq!(t.hosts[B].io.state(b.qpn), Some(QpState::Rts));
    // A copy with a newer epoch (a real move) is followed again.
    let m = MovedRepr { vnet: TENANT.0, qpn: a.qpn, peer_qpn: b.qpn, epoch: decoded.qps[0].epoch + 1 };
    let lb_c = t.link(B, C);
    assert!(t.hosts[B].hca.handle_moved(lb_c, &m, now));
}

/// Pausing and exporting refuse what cannot move yet, with a reason.
#[test]
fn what_cannot_move_is_refused_on_the_source() {
    let mut t = ThreeHosts::new(256, tune);
    let (_a, _b, _mem) = setup(&mut t);
    let h = &mut t.hosts[A].hca;
    assert_eq!(h.export_tenant(TENANT), Err(MigrateError::NotPaused(TENANT.0)));
    assert_eq!(h.pause_tenant(TenantId(4242)), Err(MigrateError::NoSuchTenant(4242)));
    let local = TenantId(TenantId::HOST_LOCAL_BASE + 3);
    assert_eq!(h.pause_tenant(local), Err(MigrateError::HostLocal(local.0)));
    // A QP connected to another QP on the same host.
    let env = &mut t.hosts[A];
    let x = env.end(C1);
    let y = env.end(C2);
    env.connect(x.qpn, y.qpn);
    env.connect(y.qpn, x.qpn);
    env.hca.pause_tenant(TENANT).unwrap();
    assert!(matches!(env.hca.export_tenant(TENANT), Err(MigrateError::Unsupported(_))));
}

/// A responder-only QP (RTR) that received nothing before the move: it
/// announces itself all the same, and the peer's first request reaches
/// the new host.
#[test]
fn an_idle_connection_moves_and_its_peer_reaches_the_new_host() {
    let mut t = ThreeHosts::new(256, tune);
    let a = t.hosts[A].end(C1);
    let b = t.hosts[B].end(C1);
    t.hosts[A].bring_to_init(a.qpn, conn());
    t.hosts[A].bring_to_rtr_via(a.qpn, b.qpn, conn(), gid_ah(IPS[B], 1), 100, 4);
    connect_side(&mut t.hosts[B], b.qpn, a.qpn, IPS[A], conn());
    let mem = HashMap::from([(a.buf.key, a.buf.mem.clone())]);
    t.run(T0);
    assert!(t.hosts[A].hca.qps[&a.qpn].remote.is_none(), "A's QP carried nothing");
    t.migrate(A, C, &mem, T0);
    t.run(T0);
    assert_eq!(t.seen.moved_ok, 1);
    t.hosts[C].io.post_recv(a.qpn, recv(5, &[a.buf.sge(0, 64)]));
    b.buf.write(0, &message(77, 64));
    t.hosts[B].io.post_send(b.qpn, wr(9, SendOpcode::Send, &[b.buf.sge(0, 64)], SendFlags::SIGNALED));
    t.run(T0);
    let got = t.hosts[B].poll(b.cq);
    assert_eq!(got.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(), vec![(9, WcStatus::Success)]);
    let got = t.hosts[C].poll(a.cq);
    assert_eq!(got.iter().map(|c| (c.wr_id, c.byte_len)).collect::<Vec<_>>(), vec![(5, 64)]);
    assert_eq!(a.buf.read(0, 64), message(77, 64));
}

/// Daemons of one cluster number within spaces of their own
/// (`HcaConfig::number_space`): a tenant from A (space 1) imports onto a
/// C (space 3) that already serves another tenant with as many objects,
/// and C's later objects do not take the imported numbers. The same
/// load on a C numbering like A (same space) collides and is refused.
#[test]
fn daemons_with_their_own_number_spaces_import_onto_a_busy_host() {
    let space = |s: u8| {
        move |c: &mut HcaConfig| {
            tune(c);
            c.number_space = s;
        }
    };
    let busy = |s: u8| {
        let mut c = bare_host(IPS[C], &space(s));
        let ctx = ContextId((u32::from(s) << 24) | 1);
        c.hca.open_context(ctx, OTHER_TENANT).unwrap();
        let ends: Vec<End> = (0..8).map(|_| c.end(ctx)).collect();
        (c, ends)
    };
    let mut a = host_with(IPS[A], space(1));
    let e = a.end(C1);
    assert_eq!((e.qpn >> 16, e.pd >> 24, e.cq >> 24, e.buf.key >> 24), (1, 1, 1, 1), "A numbers in space 1");
    a.hca.pause_tenant(TENANT).unwrap();
    let bytes = a.hca.export_tenant(TENANT).unwrap();
    let mem = HashMap::from([(e.buf.key, e.buf.mem.clone())]);
    let mut region_of = |m: &crate::hca::migrate::MrImport| mem.get(&m.key).cloned();

    // C numbering in the same space as A, as busy: refused, clearly.
    let (mut same, _) = busy(1);
    let r = same.hca.import_tenant(&bytes, T0, &mut region_of);
    assert!(matches!(&r, Err(SnapshotError::Collision(m)) if m.contains("in use here")), "{r:?}");

    // C in its own space: the import goes in, numbers kept exactly.
    let (mut c, ends) = busy(3);
    assert!(ends.iter().all(|x| x.qpn >> 16 == 3 && x.pd >> 24 == 3 && x.buf.key >> 24 == 3));
    assert_eq!(c.hca.import_tenant(&bytes, T0, &mut region_of), Ok(TENANT));
    assert!(
        c.hca.qps.contains_key(&e.qpn) && c.hca.mrs.contains_key(&e.buf.key) && c.hca.cqs.contains_key(&e.cq)
    );
    // C goes on numbering in its own space, around the imported numbers.
    let later = c.end(ContextId((3 << 24) | 1));
    assert_eq!((later.qpn >> 16, later.pd >> 24, later.buf.key >> 24), (3, 3, 3));
    c.hca.resume_tenant(TENANT, T0).unwrap();
}

/// Issue 19: a call that changes a paused tenant's device state is
/// refused, not run (the snapshot, taken after the pause, would not hold
/// it, and the destination would never see it); queries run, and other
/// tenants are not held. `is_paused` is the pause itself: a tenant with a
/// context and no QPs, never paused, is not paused (it used to be).
#[test]
fn a_paused_tenants_calls_that_change_its_state_are_refused() {
    let mut a = host_with(IPS[A], tune);
    assert!(!a.hca.is_paused(TENANT), "a tenant with a context and no QPs, never paused");
    assert_eq!(a.hca.export_tenant(TENANT), Err(MigrateError::NotPaused(TENANT.0)));
    assert_eq!(a.hca.finish_export(TENANT).map(drop), Err(MigrateError::NotPaused(TENANT.0)));
    let e = a.end(C1);
    a.hca.pause_tenant(TENANT).unwrap();
    assert!(a.hca.is_paused(TENANT) && !a.hca.is_paused(OTHER_TENANT));
    let before = a.hca.snapshot_tenant(TENANT).unwrap();
    let no = Err(HcaError::TenantPaused(TENANT.0));
    assert_eq!(a.hca.alloc_pd(C1).map(drop), no);
    assert_eq!(a.hca.create_cq(C2, 8).map(drop), no);
    assert_eq!(a.hca.create_qp(C1, e.pd, qp_init(e.cq, e.cq, None)).map(drop), no);
    let init = QpAttr { qp_state: QpState::Init, port_num: 1, qp_access_flags: FULL, ..QpAttr::default() };
    let mask = QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS;
    assert_eq!(a.hca.modify_qp(C1, e.qpn, &init, mask, &mut a.io).map(drop), no);
    assert_eq!(a.hca.destroy_qp(C1, e.qpn, &mut a.io), no);
    assert_eq!(a.hca.dereg_mr(C1, e.buf.key), no);
    assert_eq!(a.hca.destroy_cq(C1, e.cq), no);
    assert_eq!(a.hca.dealloc_pd(C1, e.pd), no);
    let ah = AhAttr { dlid: 1, port_num: 1, ..AhAttr::default() };
    assert_eq!(a.hca.create_ah(C1, e.pd, ah).map(drop), no);
    let region = Region::heap(4096);
    assert_eq!(a.hca.reg_mr(C1, e.pd, 0x4000_0000, FULL, region).map(drop), no);
    // Queries run; another tenant's calls run.
    assert_eq!(a.hca.query_qp(C1, e.qpn).unwrap().0.qp_state, QpState::Reset);
    assert!(a.hca.alloc_pd(C3).is_ok(), "another tenant is not paused");
    // Nothing changed: the snapshot is the one taken right after the pause.
    assert_eq!(a.hca.snapshot_tenant(TENANT).unwrap(), before);
    // A cancelled migration: resumed where it was, its calls run again.
    a.hca.resume_tenant(TENANT, T0).unwrap();
    assert!(!a.hca.is_paused(TENANT));
    assert_eq!(a.hca.modify_qp(C1, e.qpn, &init, mask, &mut a.io), Ok(QpState::Init));
    // Paused, then gone: not paused any more, and nothing to refuse.
    a.hca.pause_tenant(TENANT).unwrap();
    a.hca.finish_export(TENANT).unwrap();
    assert!(!a.hca.is_paused(TENANT));
}
