/*
 * forkcopy: fork in a verbs program, for tests/guests.rs (issue 18), run
 * in a guest on vRDMA's drop-in libibverbs (and runnable on a host).
 *
 * With rdma-core on current kernels (IBV_FORK_UNNEEDED) a child of fork
 * gets a copy of the parent's registered pages; vRDMA re-backs those
 * pages with shared memory (in a guest, the VM's BAR), so its library
 * replaces them by private copies in the child
 * (crates/vrdma/src/rebacking/fork.rs). This checks that, end to end:
 *
 * 1. It opens the device, registers SRC (LEN bytes, page-aligned heap
 *    memory holding a pattern; "MAPPED" and the maps line of its pages,
 *    re-backed: a shared mapping) and DST, creates a CQ and two RC QPs and
 *    connects them to each other (a loopback pair on this device's port).
 * 2. It forks. The child checks it sees the parent's pattern in SRC (its
 *    copy), overwrites all of SRC with 0xee, allocates (malloc's pages sit
 *    beside the re-backed ones) and exits normally (exit, not _exit).
 * 3. The parent (child reaped within a bound) checks SRC still holds the
 *    pattern ("PARENT_UNCHANGED"), then RDMA-writes SRC into DST from one
 *    QP to the other and SENDs part of SRC into a posted receive, and
 *    checks the bytes that arrived ("WRITE_OK", "SEND_OK").
 *
 * Prints "DONE" and exits 0, else "FAIL why" and exits 1. Every wait is
 * bounded.
 */
#include <infiniband/verbs.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define LEN (4 * 4096)
#define SEND_LEN 3000
#define SEND_AT 100

static int fail(const char *what)
{
    printf("FAIL %s\n", what);
    fflush(stdout);
    return 1;
}

static uint64_t now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000u + (uint64_t)t.tv_nsec / 1000000u;
}

static unsigned char pattern(size_t i)
{
    return (unsigned char)(i * 7 + 1 + i / 251);
}

/* The first completion on CQ within 30 s: its status, or -1. */
static int poll_one(struct ibv_cq *cq, struct ibv_wc *wc)
{
    uint64_t end = now_ms() + 30000;
    while (now_ms() < end) {
        int n = ibv_poll_cq(cq, 1, wc);
        if (n < 0)
            return -1;
        if (n == 1)
            return 0;
        usleep(100);
    }
    return -1;
}

static int connect_qp(struct ibv_qp *qp, uint32_t dest_qpn, uint16_t dlid, const union ibv_gid *dgid)
{
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = 1,
                            .qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE};
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
        return -1;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = IBV_MTU_1024;
    a.dest_qp_num = dest_qpn;
    a.rq_psn = 0;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;
    a.ah_attr.dlid = dlid;
    a.ah_attr.port_num = 1;
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = *dgid;
    a.ah_attr.grh.hop_limit = 1;
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                  IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
        return -1;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.sq_psn = 0;
    a.max_rd_atomic = 1;
    return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                     IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
}

/* Prints the /proc/self/maps line of the mapping holding P ("MAPPED
 * line"): the registered pages are re-backed, a shared mapping (of the
 * VM's BAR in a guest). 0 when found. */
static int print_mapping(const void *p)
{
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    int found = -1;
    while (f && found && fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx", &lo, &hi) == 2 && lo <= (unsigned long)p && (unsigned long)p < hi) {
            printf("MAPPED %s", line);
            found = 0;
        }
    }
    if (f)
        fclose(f);
    return found;
}

/* In the child: 0 when it saw the parent's bytes and overwrote them. */
static int child(unsigned char *src)
{
    for (size_t i = 0; i < LEN; i++)
        if (src[i] != pattern(i))
            return 2;
    memset(src, 0xee, LEN);
    /* The heap beside the registered pages, as any child's would. */
    char *p = malloc(100000);
    if (!p)
        return 3;
    memset(p, 0x5a, 100000);
    free(p);
    return 0;
}

int main(void)
{
    struct ibv_device **devs = ibv_get_device_list(NULL);
    if (!devs || !devs[0])
        return fail("no device");
    struct ibv_context *ctx = ibv_open_device(devs[0]);
    if (!ctx)
        return fail("ibv_open_device");
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    unsigned char *src = NULL, *dst = NULL;
    if (!pd || posix_memalign((void **)&src, 4096, LEN) || posix_memalign((void **)&dst, 4096, LEN))
        return fail("pd or buffers");
    for (size_t i = 0; i < LEN; i++)
        src[i] = pattern(i);
    memset(dst, 0, LEN);
    int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
    struct ibv_mr *smr = ibv_reg_mr(pd, src, LEN, access);
    struct ibv_mr *dmr = ibv_reg_mr(pd, dst, LEN, access);
    struct ibv_cq *cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
    if (!smr || !dmr || !cq)
        return fail("mr or cq");
    struct ibv_qp_init_attr init = {
        .send_cq = cq,
        .recv_cq = cq,
        .cap = {.max_send_wr = 8, .max_recv_wr = 8, .max_send_sge = 1, .max_recv_sge = 1},
        .qp_type = IBV_QPT_RC,
    };
    struct ibv_qp *qa = ibv_create_qp(pd, &init);
    struct ibv_qp *qb = ibv_create_qp(pd, &init);
    struct ibv_port_attr port;
    union ibv_gid gid;
    if (!qa || !qb || ibv_query_port(ctx, 1, &port) || ibv_query_gid(ctx, 1, 0, &gid))
        return fail("qps, port or gid");
    if (connect_qp(qa, qb->qp_num, port.lid, &gid) || connect_qp(qb, qa->qp_num, port.lid, &gid))
        return fail("connecting the QP pair");
    printf("CONNECTED qpn %u <-> %u, %d bytes registered at %p\n", qa->qp_num, qb->qp_num, LEN, (void *)src);
    if (print_mapping(src))
        return fail("no mapping holds the registered buffer");
    fflush(stdout);

    pid_t pid = fork();
    if (pid < 0)
        return fail("fork");
    if (pid == 0)
        exit(child(src));
    int status = 0;
    uint64_t end = now_ms() + 30000;
    pid_t got;
    while ((got = waitpid(pid, &status, WNOHANG)) == 0 && now_ms() < end)
        usleep(1000);
    if (got != pid) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        return fail("the child did not end within 30 s");
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        printf("FAIL the child: status %#x (exit 2: it did not see the parent's bytes)\n", status);
        return 1;
    }
    printf("CHILD_OK it saw the parent's bytes and overwrote all %d with 0xee\n", LEN);
    size_t changed = 0;
    for (size_t i = 0; i < LEN; i++)
        changed += src[i] != pattern(i);
    if (changed) {
        printf("FAIL the child's writes reached the parent: %zu of %d registered bytes changed\n", changed, LEN);
        return 1;
    }
    printf("PARENT_UNCHANGED all %d registered bytes\n", LEN);
    fflush(stdout);

    /* The parent's QPs work on, with its bytes. */
    struct ibv_sge sge = {.addr = (uintptr_t)src, .length = LEN, .lkey = smr->lkey};
    struct ibv_send_wr wr = {.wr_id = 1, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
                             .send_flags = IBV_SEND_SIGNALED};
    wr.wr.rdma.remote_addr = (uintptr_t)dst;
    wr.wr.rdma.rkey = dmr->rkey;
    struct ibv_send_wr *bad;
    struct ibv_wc wc;
    if (ibv_post_send(qa, &wr, &bad))
        return fail("post the RDMA write");
    if (poll_one(cq, &wc) || wc.status != IBV_WC_SUCCESS || wc.wr_id != 1) {
        printf("FAIL the RDMA write's completion: %s\n", ibv_wc_status_str(wc.status));
        return 1;
    }
    for (size_t i = 0; i < LEN; i++)
        if (dst[i] != pattern(i)) {
            printf("FAIL the RDMA write: byte %zu is %#x, not %#x\n", i, dst[i], pattern(i));
            return 1;
        }
    printf("WRITE_OK %d bytes at the peer\n", LEN);

    memset(dst, 0, LEN);
    struct ibv_sge rsge = {.addr = (uintptr_t)dst, .length = LEN, .lkey = dmr->lkey};
    struct ibv_recv_wr rwr = {.wr_id = 2, .sg_list = &rsge, .num_sge = 1};
    struct ibv_recv_wr *rbad;
    if (ibv_post_recv(qb, &rwr, &rbad))
        return fail("post the receive");
    sge.addr = (uintptr_t)(src + SEND_AT);
    sge.length = SEND_LEN;
    struct ibv_send_wr swr = {.wr_id = 3, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
                              .send_flags = IBV_SEND_SIGNALED};
    if (ibv_post_send(qa, &swr, &bad))
        return fail("post the send");
    int sent = 0, received = 0;
    for (int k = 0; k < 2; k++) {
        if (poll_one(cq, &wc) || wc.status != IBV_WC_SUCCESS) {
            printf("FAIL the send's completions: %s\n", ibv_wc_status_str(wc.status));
            return 1;
        }
        if (wc.wr_id == 3)
            sent = 1;
        if (wc.wr_id == 2 && wc.byte_len == SEND_LEN)
            received = 1;
    }
    if (!sent || !received)
        return fail("the send's two completions");
    for (size_t i = 0; i < SEND_LEN; i++)
        if (dst[i] != pattern(SEND_AT + i)) {
            printf("FAIL the send: byte %zu is %#x, not %#x\n", i, dst[i], pattern(SEND_AT + i));
            return 1;
        }
    printf("SEND_OK %d bytes at the peer\n", SEND_LEN);
    ibv_destroy_qp(qa);
    ibv_destroy_qp(qb);
    ibv_destroy_cq(cq);
    ibv_dereg_mr(smr);
    ibv_dereg_mr(dmr);
    ibv_dealloc_pd(pd);
    ibv_close_device(ctx);
    ibv_free_device_list(devs);
    printf("DONE\n");
    return 0;
}
