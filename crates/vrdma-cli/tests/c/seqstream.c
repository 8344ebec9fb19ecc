/*
 * seqstream: a verbs program for tests/guest_migrate.rs, run in a guest
 * on vRDMA's drop-in libibverbs. It streams COUNT messages of LEN bytes
 * on an RC QP, each carrying its sequence number: even ones as SEND with
 * immediate, odd ones as RDMA WRITE with immediate to ADDR + seq * LEN
 * (the immediate is the sequence number, network order; the payload's
 * first 8 bytes too, little-endian, the rest the number's low byte). At
 * most WINDOW in flight, one post every PACE_US, and every 20th post a
 * query of the QP (a call that needs the daemon).
 *
 * It prints "LOCAL lid qpn psn gid" and waits (bounded) for PEERFILE to
 * hold "lid qpn psn gid addr rkey" (gid as 32 hex digits). Every
 * completion must come once, in order (wr_id = seq), with success; at the
 * end it prints "DONE completions=N in_order=1 max_gap_us=G" and exits 0,
 * else prints why and exits 1; after a failed completion it first checks
 * that the rest come flushed ("DRAINED ..."). No step waits without a
 * bound.
 *
 * With a fifth argument "chan" it waits on a completion channel instead
 * of polling: the CQ is made on a channel (its fd non-blocking), armed
 * with ibv_req_notify_cq, and the program takes completions only after
 * an event (poll() on the channel's fd, ibv_get_cq_event, ack, arm
 * again, then drain the CQ), its pace spent waiting on the fd. An event
 * lost leaves completions in the CQ that nothing takes: after WAIT_S
 * seconds without an event while work is outstanding it looks at the CQ
 * and fails "FAIL event lost" if a completion is there ("FAIL stalled"
 * if none). "DONE" then adds "events=E".
 *
 * The device gone (its daemon dead, past the library's reattach bound):
 * while idle (every 10 ms) and after a failed post or query (then for up
 * to 5 s) it looks at the context's async events (its fd non-blocking, each acknowledged);
 * on IBV_EVENT_DEVICE_FATAL it prints "DEVICE_FATAL posted=P
 * completed=D" and exits 1.
 */
#include <infiniband/verbs.h>
#include <arpa/inet.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <time.h>
#include <unistd.h>

#define WINDOW 16
#define SLOTS 64
/* A channel waiter's bound without an event while work is outstanding
 * (past a migration's pause and the library's reattach). */
#define WAIT_S 30

static uint64_t now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000u + (uint64_t)t.tv_nsec / 1000u;
}

/*
 * A non-blocking look at `ctx`'s async events (up to 8, each
 * acknowledged): 1 if IBV_EVENT_DEVICE_FATAL came.
 */
static int device_fatal(struct ibv_context *ctx)
{
    for (int k = 0; k < 8; k++) {
        struct ibv_async_event ev;
        if (ibv_get_async_event(ctx, &ev))
            return 0;
        int fatal = ev.event_type == IBV_EVENT_DEVICE_FATAL;
        ibv_ack_async_event(&ev);
        if (fatal)
            return 1;
    }
    return 0;
}

/*
 * Prints "DEVICE_FATAL ..." if the device is gone, looking for up to
 * `wait_ms` (after a failed call the event may follow it); 1 if so.
 */
static int report_fatal(struct ibv_context *ctx, uint64_t posted, uint64_t done, int wait_ms)
{
    int fatal = device_fatal(ctx);
    for (int k = 0; !fatal && k < wait_ms / 10; k++) {
        usleep(10000);
        fatal = device_fatal(ctx);
    }
    if (!fatal)
        return 0;
    printf("DEVICE_FATAL posted=%llu completed=%llu\n", (unsigned long long)posted, (unsigned long long)done);
    fflush(stdout);
    return 1;
}

static int fail(const char *what)
{
    printf("FAIL %s\n", what);
    fflush(stdout);
    return 1;
}

/*
 * After a failed completion: the QP is in error, so every WR posted after
 * the failed one must complete once, in order, flushed (the first `n` of
 * them may already be in `wc`). Prints "DRAINED flushed=F of=W
 * qp_state=S" (S as ibv_qp_state; 6 is ERR), within 5 s.
 */
static void drain(struct ibv_cq *cq, struct ibv_qp *qp, struct ibv_wc *wc, int n, uint64_t next,
                  uint64_t posted)
{
    uint64_t want = posted - next, got = 0, flushed = 0, deadline = now_us() + 5000000u;
    struct ibv_wc more[16];
    for (;;) {
        for (int i = 0; i < n; i++, got++)
            if (wc[i].wr_id == next + got && wc[i].status == IBV_WC_WR_FLUSH_ERR)
                flushed++;
        if (got >= want || now_us() > deadline)
            break;
        n = ibv_poll_cq(cq, 16, more);
        if (n < 0)
            break;
        wc = more;
        if (n == 0)
            usleep(1000);
    }
    struct ibv_qp_attr q;
    struct ibv_qp_init_attr qi;
    int st = ibv_query_qp(qp, &q, IBV_QP_STATE, &qi) ? -1 : (int)q.qp_state;
    printf("DRAINED flushed=%llu of=%llu qp_state=%d\n", (unsigned long long)flushed,
           (unsigned long long)want, st);
    fflush(stdout);
}

/*
 * Waits up to `ms` on the channel's fd for an event of `cq`; takes it,
 * acks it and arms the CQ again (so that a completion after this raises
 * the next event; the caller then drains the CQ). 1: an event; 0: none
 * (a timeout, or a wake-up with no event behind it); -1: an error.
 */
static int wait_event(struct ibv_comp_channel *ch, struct ibv_cq *cq, int ms)
{
    struct pollfd p = {.fd = ch->fd, .events = POLLIN};
    int r = poll(&p, 1, ms);
    if (r < 0)
        return errno == EINTR ? 0 : -1;
    if (r == 0)
        return 0;
    if (p.revents & (POLLERR | POLLHUP | POLLNVAL))
        return -1;
    struct ibv_cq *ev_cq;
    void *ev_ctx;
    if (ibv_get_cq_event(ch, &ev_cq, &ev_ctx))
        return errno == EAGAIN ? 0 : -1;
    if (ev_cq != cq)
        return -1;
    ibv_ack_cq_events(cq, 1);
    if (ibv_req_notify_cq(cq, 0))
        return -1;
    return 1;
}

int main(int argc, char **argv)
{
    if (argc != 5 && !(argc == 6 && strcmp(argv[5], "chan") == 0))
        return fail("usage: seqstream COUNT LEN PACE_US PEERFILE [chan]");
    int chan = argc == 6;
    uint64_t count = strtoull(argv[1], 0, 10);
    size_t len = strtoul(argv[2], 0, 10);
    useconds_t pace = (useconds_t)strtoul(argv[3], 0, 10);
    const char *peerfile = argv[4];
    if (len < 8 || len > 4096 || count == 0)
        return fail("bad COUNT or LEN");

    struct ibv_device **devs = ibv_get_device_list(NULL);
    if (!devs || !devs[0])
        return fail("no device");
    struct ibv_context *ctx = ibv_open_device(devs[0]);
    if (!ctx)
        return fail("ibv_open_device");
    int afl = fcntl(ctx->async_fd, F_GETFL);
    if (afl < 0 || fcntl(ctx->async_fd, F_SETFL, afl | O_NONBLOCK) < 0)
        return fail("the async fd non-blocking");
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    char *buf = calloc(SLOTS, len);
    struct ibv_mr *mr = pd && buf ? ibv_reg_mr(pd, buf, SLOTS * len, IBV_ACCESS_LOCAL_WRITE) : NULL;
    struct ibv_comp_channel *ch = NULL;
    if (chan) {
        ch = ibv_create_comp_channel(ctx);
        if (!ch)
            return fail("ibv_create_comp_channel");
        int fl = fcntl(ch->fd, F_GETFL);
        if (fl < 0 || fcntl(ch->fd, F_SETFL, fl | O_NONBLOCK) < 0)
            return fail("the channel's fd non-blocking");
    }
    struct ibv_cq *cq = ibv_create_cq(ctx, 256, NULL, ch, 0);
    if (!mr || !cq)
        return fail("pd, mr or cq");
    if (chan && ibv_req_notify_cq(cq, 0))
        return fail("ibv_req_notify_cq");
    struct ibv_qp_init_attr init = {
        .send_cq = cq,
        .recv_cq = cq,
        .cap = {.max_send_wr = 64, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1},
        .qp_type = IBV_QPT_RC,
    };
    struct ibv_qp *qp = ibv_create_qp(pd, &init);
    if (!qp)
        return fail("ibv_create_qp");
    struct ibv_port_attr port;
    union ibv_gid gid;
    if (ibv_query_port(ctx, 1, &port) || ibv_query_gid(ctx, 1, 0, &gid))
        return fail("query port or gid");
    printf("LOCAL %u %u %u ", port.lid, qp->qp_num, 0u);
    for (int i = 0; i < 16; i++)
        printf("%02x", gid.raw[i]);
    printf("\n");
    fflush(stdout);

    /* The peer's endpoint and memory, within two minutes. */
    unsigned plid = 0, pqpn = 0, ppsn = 0, rkey = 0;
    unsigned long long raddr = 0;
    char pgid[33] = {0};
    int got = 0;
    for (int tries = 0; tries < 12000 && got != 6; tries++) {
        FILE *f = fopen(peerfile, "r");
        if (f) {
            got = fscanf(f, "%u %u %u %32s %llu %u", &plid, &pqpn, &ppsn, pgid, &raddr, &rkey);
            fclose(f);
        }
        if (got != 6)
            usleep(10000);
    }
    if (got != 6 || strlen(pgid) != 32)
        return fail("no peer file");
    union ibv_gid dgid;
    for (int i = 0; i < 16; i++) {
        unsigned b;
        sscanf(pgid + 2 * i, "%2x", &b);
        dgid.raw[i] = (uint8_t)b;
    }

    struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = 1,
                            .qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE};
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
        return fail("to INIT");
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = IBV_MTU_1024;
    a.dest_qp_num = pqpn;
    a.rq_psn = ppsn;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;
    a.ah_attr.dlid = (uint16_t)plid;
    a.ah_attr.port_num = 1;
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = dgid;
    a.ah_attr.grh.hop_limit = 1;
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                  IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
        return fail("to RTR");
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.sq_psn = 0;
    a.max_rd_atomic = 1;
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                  IBV_QP_MAX_QP_RD_ATOMIC))
        return fail("to RTS");
    printf("CONNECTED\n");
    fflush(stdout);

    uint64_t posted = 0, done = 0, max_gap = 0, last = now_us();
    /* Channel mode: events taken, when the last came. */
    uint64_t events = 0, last_event = now_us();
    int draining = 0;
    /* Channel mode: when the next post may go (the pace). */
    uint64_t next_post = 0;
    /* The QP read as ERR: post no more; its failed completion is due. */
    int in_error = 0;
    uint64_t deadline = now_us() + 600ull * 1000000u;
    /* When the async events were last looked at. */
    uint64_t looked = now_us();
    struct ibv_wc wc[16];
    while (done < count) {
        if (now_us() > deadline) {
            printf("FAIL timed out: posted %llu, completed %llu\n", (unsigned long long)posted,
                   (unsigned long long)done);
            return 1;
        }
        if (!in_error && posted < count && posted - done < WINDOW && (!chan || now_us() >= next_post)) {
            char *p = buf + (posted % SLOTS) * len;
            memset(p, (int)(posted & 0xff), len);
            for (int i = 0; i < 8; i++)
                p[i] = (char)((posted >> (8 * i)) & 0xff);
            struct ibv_sge sge = {.addr = (uintptr_t)p, .length = (uint32_t)len, .lkey = mr->lkey};
            struct ibv_send_wr wr = {.wr_id = posted, .sg_list = &sge, .num_sge = 1,
                                     .send_flags = IBV_SEND_SIGNALED, .imm_data = htonl((uint32_t)posted)};
            if (posted % 2 == 0) {
                wr.opcode = IBV_WR_SEND_WITH_IMM;
            } else {
                wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
                wr.wr.rdma.remote_addr = raddr + posted * len;
                wr.wr.rdma.rkey = rkey;
            }
            struct ibv_send_wr *bad;
            if (ibv_post_send(qp, &wr, &bad)) {
                report_fatal(ctx, posted, done, 5000);
                printf("FAIL post_send %llu\n", (unsigned long long)posted);
                return 1;
            }
            posted++;
            if (posted % 20 == 0) {
                struct ibv_qp_attr q;
                struct ibv_qp_init_attr qi;
                if (ibv_query_qp(qp, &q, IBV_QP_STATE, &qi)) {
                    report_fatal(ctx, posted, done, 5000);
                    printf("FAIL query_qp at %llu\n", (unsigned long long)posted);
                    return 1;
                }
                /* A QP that failed (a snapshot's stale copy) may read ERR
                 * before its failed completion is polled: report it
                 * through that completion, below, as when it came first. */
                if (q.qp_state == IBV_QPS_ERR && posted > done) {
                    in_error = 1;
                } else if (q.qp_state != IBV_QPS_RTS) {
                    printf("FAIL query_qp at %llu: state %d\n", (unsigned long long)posted, (int)q.qp_state);
                    return 1;
                }
            }
            if (pace && !chan)
                usleep(pace);
            next_post = now_us() + pace;
        }
        int n;
        if (chan) {
            /* Wait on the channel: the pace while posts may go on, else
             * up to a second at a time, bounded by WAIT_S without an
             * event. */
            int can_post = !in_error && posted < count && posted - done < WINDOW;
            uint64_t t = now_us();
            int ms = !can_post ? 1000 : t >= next_post ? 0 : (int)((next_post - t + 999) / 1000);
            int woke = draining ? 0 : wait_event(ch, cq, ms);
            if (woke < 0)
                return fail("the channel");
            if (woke > 0) {
                events++;
                last_event = now_us();
                draining = 1;
            } else if (!draining && posted > done && now_us() - last_event > WAIT_S * 1000000ull) {
                n = ibv_poll_cq(cq, 16, wc);
                printf("FAIL %s: no event for %d s with %llu outstanding\n", n > 0 ? "event lost" : "stalled",
                       WAIT_S, (unsigned long long)(posted - done));
                return 1;
            }
            /* Only after an event: what the CQ holds, all of it. */
            n = draining ? ibv_poll_cq(cq, 16, wc) : 0;
            if (n < 16)
                draining = 0;
        } else {
            n = ibv_poll_cq(cq, 16, wc);
        }
        if (n < 0)
            return fail("poll_cq");
        if (n == 0 && now_us() - looked > 10000) {
            looked = now_us();
            if (report_fatal(ctx, posted, done, 0))
                return 1;
        }
        for (int i = 0; i < n; i++) {
            if (wc[i].status != IBV_WC_SUCCESS) {
                printf("FAIL completion %llu: %s\n", (unsigned long long)wc[i].wr_id,
                       ibv_wc_status_str(wc[i].status));
                drain(cq, qp, wc + i + 1, n - i - 1, wc[i].wr_id + 1, posted);
                return 1;
            }
            if (wc[i].wr_id != done) {
                printf("FAIL completion %llu where %llu was next\n", (unsigned long long)wc[i].wr_id,
                       (unsigned long long)done);
                return 1;
            }
            done++;
            uint64_t t = now_us();
            if (t - last > max_gap)
                max_gap = t - last;
            last = t;
        }
        if (!chan && n == 0 && (in_error || posted == count || posted - done >= WINDOW))
            usleep(100);
    }
    /* Nothing more (a completion twice) within 300 ms. */
    for (int k = 0; k < 30; k++) {
        int n = ibv_poll_cq(cq, 16, wc);
        if (n != 0) {
            printf("FAIL %d completion(s) after the last\n", n);
            return 1;
        }
        usleep(10000);
    }
    if (chan)
        printf("DONE completions=%llu in_order=1 max_gap_us=%llu events=%llu\n", (unsigned long long)done,
               (unsigned long long)max_gap, (unsigned long long)events);
    else
        printf("DONE completions=%llu in_order=1 max_gap_us=%llu\n", (unsigned long long)done,
               (unsigned long long)max_gap);
    return 0;
}
