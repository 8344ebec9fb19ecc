//! A busy tenant's share beside an active latency-class tenant: not cut
//! at each slice while the latency tenant has nothing waiting
//! (`schedule::ServiceOrder::preempts`), and the latency tenant's message
//! served between two of its turns, the share going on where it stopped
//! (`Hca::run_share`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::*;

/// Every read of the engine's clock moves it on by this much: a turn
/// takes 10 µs, some three to a slice (25 µs by default).
const TICK: u64 = 10_000;

/// Queues that post each of `post` (WR to QP, as its owner would, naming
/// the QP) once `after` send WRs were pulled: messages that arrive while
/// another tenant's share is under way.
struct PostsMidway<'a> {
    io: &'a mut FakeQueues,
    after: u32,
    post: Vec<(u32, SendWr)>,
    /// The QP of each completion pushed, in order.
    order: Vec<u32>,
}

impl Queues for PostsMidway<'_> {
    fn pull_send(&mut self, qpn: u32) -> Option<Pulled<SendWr>> {
        let pulled = self.io.pull_send(qpn);
        if pulled.is_some() {
            self.after = self.after.saturating_sub(1);
            if self.after == 0 {
                for (q, wr) in self.post.drain(..) {
                    self.io.post_send(q, wr);
                }
            }
        }
        pulled
    }
    fn send_retired(&mut self, qpn: u32, count: u32) {
        self.io.send_retired(qpn, count)
    }
    fn pull_recv(&mut self, src: RecvSource) -> Option<Pulled<RecvWr>> {
        self.io.pull_recv(src)
    }
    fn recv_posted(&mut self, src: RecvSource) -> u32 {
        self.io.recv_posted(src)
    }
    fn discard(&mut self, qpn: u32) {
        self.io.discard(qpn)
    }
    fn push_cqe(&mut self, cqn: u32, cqe: &Cqe) -> Result<(), CqFull> {
        self.order.push(cqe.qp_num);
        self.io.push_cqe(cqn, cqe)
    }
    fn async_event(&mut self, ctx: ContextId, event: AsyncEvent) {
        self.io.async_event(ctx, event)
    }
    fn qp_state_changed(&mut self, qpn: u32, state: QpState) {
        self.io.qp_state_changed(qpn, state)
    }
    fn take_posted(&mut self, per_tenant: u32, out: &mut Vec<u32>) -> bool {
        self.io.take_posted(per_tenant, out)
    }
    fn named_since_parked(&mut self, qpn: u32) -> bool {
        self.io.named_since_parked(qpn)
    }
    fn park_queues(&mut self, qpn: u32, recv_too: bool) -> bool {
        self.io.park_queues(qpn, recv_too)
    }
}

/// The streamer (eight QP pairs of `TENANT`) and a latency-class
/// `OTHER_TENANT` pair that has just had a share (so it is active), on an
/// engine whose clock moves [`TICK`] a read.
fn streamer_beside_an_active_latency_tenant() -> StreamerAndOther {
    let (mut env, chunk, many, (x, y)) = streamer_and_other();
    env.hca.set_qos(OTHER_TENANT, Qos { class: LatencyClass::Latency, ..Qos::default() }).unwrap();
    let t = Arc::new(AtomicU64::new(T0.0));
    env.hca.set_clock(Box::new(move || Instant(t.fetch_add(TICK, Ordering::Relaxed))));
    env.io.post_send(x.qpn, rdma(9, SendOpcode::RdmaWrite, &[x.buf.sge(0, 8)], y.buf.addr, y.buf.key));
    env.run(T0);
    assert_eq!(env.poll(x.cq).len(), 1);
    (env, chunk, many, (x, y))
}

/// Completions each streaming QP has had so far, added to `done`.
fn count(env: &mut Env, many: &[(End, End)], done: &mut [usize]) {
    for (d, (a, _)) in done.iter_mut().zip(many) {
        *d += env.poll(a.cq).len();
    }
}

/// While the latency tenant has nothing waiting, the streamer's share
/// beside it is not cut at each slice: it has every QP's turn in one
/// pass, as alone (each turn here takes 10 µs of the engine's clock, so
/// a share that ended with its 25 µs slice had three).
#[test]
fn a_busy_tenant_keeps_its_share_across_slices_while_the_latency_tenant_has_nothing_waiting() {
    let (mut env, chunk, many, _) = streamer_beside_an_active_latency_tenant();
    for (a, b) in &many {
        env.io
            .post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, chunk)], b.buf.addr, b.buf.key));
    }
    env.step(T0);
    let mut done = vec![0; many.len()];
    count(&mut env, &many, &mut done);
    assert_eq!(done, vec![1; many.len()], "every QP's turn in the one pass");
}

/// A message of the latency tenant posted while the streamer's share is
/// under way is served after the streamer's turn in progress, in the same
/// pass, and the streamer's share goes on from the QP where it stopped:
/// every write of it once, in queue order, in that one pass.
#[test]
fn a_latency_tenants_message_is_served_between_two_turns_and_the_busy_share_goes_on_where_it_stopped() {
    let (mut env, chunk, many, (x, y)) = streamer_beside_an_active_latency_tenant();
    for (a, b) in &many {
        env.io
            .post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, chunk)], b.buf.addr, b.buf.key));
    }
    let late = rdma(10, SendOpcode::RdmaWrite, &[x.buf.sge(0, 8)], y.buf.addr, y.buf.key);
    let mut io = PostsMidway { io: &mut env.io, after: 1, post: vec![(x.qpn, late)], order: Vec::new() };
    env.hca.process(T0, &mut io);
    let order = std::mem::take(&mut io.order);
    let mut expected: Vec<u32> = many.iter().map(|(a, _)| a.qpn).collect();
    expected.insert(1, x.qpn);
    assert_eq!(order, expected, "the streamer's first turn, the message, the streamer's other QPs");
    let mut done = vec![0; many.len()];
    count(&mut env, &many, &mut done);
    assert_eq!(done, vec![1; many.len()], "each write once");
    assert_eq!(env.poll(x.cq).len(), 1);
}

/// A latency tenant that streams, its four QPs named while the streamer's
/// share is under way, gets one turn between two of the streamer's, not
/// a share of its stream there: the streamer's turns and its alternate.
#[test]
fn a_streaming_latency_tenant_gets_one_turn_between_two_of_the_busy_shares() {
    let (mut env, chunk, many, (x, y)) = streamer_beside_an_active_latency_tenant();
    let mut pairs = vec![(x, y)];
    for _ in 0..3 {
        let (a, b) = (env.end_with(C3, true), env.end(C3));
        env.connect(a.qpn, b.qpn);
        env.connect(b.qpn, a.qpn);
        pairs.push((a, b));
    }
    for (a, b) in &many {
        env.io
            .post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, chunk)], b.buf.addr, b.buf.key));
    }
    let post = pairs
        .iter()
        .map(|(a, b)| (a.qpn, rdma(7, SendOpcode::RdmaWrite, &[a.buf.sge(0, chunk)], b.buf.addr, b.buf.key)))
        .collect();
    let mut io = PostsMidway { io: &mut env.io, after: 1, post, order: Vec::new() };
    env.hca.process(T0, &mut io);
    let order = std::mem::take(&mut io.order);
    let ours: Vec<u32> = pairs.iter().map(|(a, _)| a.qpn).collect();
    let theirs: Vec<u32> = many.iter().map(|(a, _)| a.qpn).collect();
    // The streamer's turns in its queue order, a latency turn between
    // each two (until the streamer's slice ends with the latency tenant
    // still waiting: then the pass ends, and the next serves it first).
    let is_ours = |q: &u32| ours.contains(q);
    assert!(order.len() >= 4, "{order:?}");
    for (i, q) in order.iter().enumerate() {
        assert_eq!(is_ours(q), i % 2 == 1, "alternate turns, the streamer's first: {order:?}");
    }
    let streamer: Vec<u32> = order.iter().copied().filter(|q| !is_ours(q)).collect();
    assert_eq!(streamer[..], theirs[..streamer.len()], "the streamer's QPs in order: {order:?}");
}
