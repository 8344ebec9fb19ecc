//! What the shim costs on the data path: A/B against the native client
//! library, on one daemon in this process.
//!
//! (A) the native Rust API: a signaled 8-byte RDMA write posted on QP1 to
//! QP2 with `QueuePair::post_send`, its completion polled with
//! `CompletionQueue::poll`; (B) the same through the shim's ops table
//! (`ops.post_send`, `ops.poll_cq`, what `ibv_post_send` and `ibv_poll_cq`
//! compile to). The two alternate in rounds; each round prints ns per
//! operation, then the medians and their ratio B/A: for the round trip
//! (post and poll until the completion comes, mostly the daemon's work)
//! and for the post call alone (where the shim's conversion lies).
//!
//! ```text
//! cargo run --release -p vrdma-verbs --example shim_cost [-- OPS_PER_ROUND ROUNDS]
//! ```

#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
#[path = "../tests/rig/mod.rs"]
mod rig;

#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
fn main() {
    use std::time::{Duration, Instant};
    use vrdma::wr::{self, SendWrExt};
    use vrdma::{AccessFlags, QpCap, WcStatus, WorkCompletion};

    let mut args = std::env::args().skip(1).map(|a| a.parse::<u64>().expect("a number"));
    let n = args.next().unwrap_or(200_000);
    let rounds = args.next().unwrap_or(7) as usize;

    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("vrdma.sock");
    let daemon =
        vrdmad::Daemon::start(vrdmad::DaemonConfig { socket: Some(socket.clone()), ..Default::default() })
            .expect("daemon");
    std::env::set_var("VRDMA_SOCKET", &socket);

    // (A) the native API: two connected RC QPs of one context.
    let ctx = vrdma::Context::open_at(&socket).expect("open");
    let pd = ctx.alloc_pd().expect("pd");
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let (m1, m2) = (pd.alloc_mr(rig::BUF, access).expect("mr"), pd.alloc_mr(rig::BUF, access).expect("mr"));
    let cap =
        QpCap { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let (cq1, cq2) = (ctx.create_cq(32, None).expect("cq"), ctx.create_cq(32, None).expect("cq"));
    let qp1 = pd.create_rc_qp(&cq1, &cq1, cap).expect("qp");
    let qp2 = pd.create_rc_qp(&cq2, &cq2, cap).expect("qp");
    qp1.connect(&qp2.endpoint(&ctx).expect("endpoint"), access).expect("connect");
    qp2.connect(&qp1.endpoint(&ctx).expect("endpoint"), access).expect("connect");
    let sge = m1.sge(0, 8).expect("sge");
    let (raddr, rkey) = (m2.addr() + 64, m2.rkey());
    let native = |ops: u64| {
        let mut wc = [WorkCompletion::default()];
        let mut posting = Duration::ZERO;
        let t = Instant::now();
        for i in 0..ops {
            let p = Instant::now();
            let w = wr::rdma_write(i, &[sge], raddr, rkey).expect("wr").signaled();
            qp1.post_send(&[w]).expect("post_send");
            posting += p.elapsed();
            while cq1.poll(&mut wc).expect("poll") == 0 {}
            assert!(wc[0].wr_id == i && wc[0].status == WcStatus::Success);
        }
        let per = |d: Duration| d.as_nanos() as f64 / ops as f64;
        (per(t.elapsed()), per(posting))
    };

    // (B) the shim: the same through the ops table.
    let pair = rig::Pair::new(16);
    let shim = |ops: u64| {
        let mut posting = Duration::ZERO;
        let t = Instant::now();
        for i in 0..ops {
            let p = Instant::now();
            pair.post_write(0, i);
            posting += p.elapsed();
            let wc = pair.poll_one(0);
            assert!(wc.wr_id == i && wc.status == rig::IBV_WC_SUCCESS);
        }
        let per = |d: Duration| d.as_nanos() as f64 / ops as f64;
        (per(t.elapsed()), per(posting))
    };

    // Warm-up of both.
    native(n / 10);
    shim(n / 10);

    println!("{n} signaled 8 B RDMA writes per round, ns/op: post + poll (the round trip), and post alone");
    println!(
        "{:>6} {:>10} {:>10} {:>7}   {:>10} {:>10} {:>7}",
        "round", "A native", "B shim", "B/A", "A post", "B post", "B/A"
    );
    let (mut a, mut b, mut pa, mut pb) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for r in 0..rounds {
        // Alternate which goes first, so that neither always follows the other.
        let ((x, px), (y, py)) = if r % 2 == 0 {
            let x = native(n);
            (x, shim(n))
        } else {
            let y = shim(n);
            (native(n), y)
        };
        println!(
            "{:>6} {:>10.1} {:>10.1} {:>7.3}   {:>10.1} {:>10.1} {:>7.3}",
            r + 1,
            x,
            y,
            y / x,
            px,
            py,
            py / px
        );
        a.push(x);
        b.push(y);
        pa.push(px);
        pb.push(py);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (ma, mb, mpa, mpb) = (median(&mut a), median(&mut b), median(&mut pa), median(&mut pb));
    println!(
        "median {:>10.1} {:>10.1} {:>7.3}   {:>10.1} {:>10.1} {:>7.3}",
        ma,
        mb,
        mb / ma,
        mpa,
        mpb,
        mpb / mpa
    );

    drop(pair);
    drop((qp1, qp2, cq1, cq2, m1, m2, pd, ctx));
    daemon.shutdown();
}

#[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
fn main() {}
