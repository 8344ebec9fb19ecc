/*
 * guestmem: a guest's registered memory and the VM's region, for
 * tests/guests.rs (issue 18), run in a guest on vRDMA's drop-in
 * libibverbs (docs/vms.md, "Memory"). Every mode opens the device,
 * connects a loopback RC QP pair and checks the bytes it moves; every
 * wait is bounded. Lines start with a word the test looks for; "FAIL why"
 * and exit 1 on anything unexpected.
 *
 *   guestmem grow
 *     Registers 100 bytes at the start of a page-aligned heap buffer,
 *     creates its QPs (rings in the region), then registers the bytes
 *     from there to 5 pages further: the second registration begins in
 *     the first one's span and ends past it, so the library grows that
 *     span's extent in place (GuestGrow). RDMA-writes a pattern from the
 *     second region into a third buffer and back into the first region,
 *     checking the bytes through the program's pointers ("GROW_OK"; "MAPPED"
 *     with the maps line over the grown pages: one shared mapping).
 *   guestmem pieces
 *     Registers 100 bytes in page 2 and 200 bytes in page 5 of a
 *     page-aligned heap buffer, then the bytes from page 1 (plus 8) to the
 *     end of page 6: a registration that begins before a registered span
 *     and covers two, made of pieces (RegMrPieces). RDMA-writes its bytes
 *     out and a new pattern in, and reads the first small region's bytes
 *     out by its own key ("PIECES_OK"; "PIECES_REFUSED errno E" and exit 2).
 *   guestmem reg MIB [HOLD_S]
 *     Registers MIB MiB of page-aligned heap. Refused: "REG_REFUSED errno
 *     E (text)" and exit 2. Registered: RDMA-writes the first and last
 *     MiB of it into a small buffer and checks them ("REG_OK MIB"); with
 *     HOLD_S, then waits (at most HOLD_S seconds) for /tmp/guestmem.go,
 *     checks the same again ("HELD_OK") and exits 0.
 *   guestmem huge
 *     Maps one huge page (MAP_HUGETLB; "NO_HUGE why" and exit 3 where
 *     none can be had) and registers it: "HUGE_REFUSED errno E (text)"
 *     and exit 2, or "HUGE_OK" and exit 0.
 */
#include <errno.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define MIB (1024 * 1024)
#define PAGE 4096
#define ACCESS (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static struct ibv_cq *cq;
static struct ibv_qp *qa, *qb;

static int fail(const char *what)
{
    printf("FAIL %s (errno %d: %s)\n", what, errno, strerror(errno));
    fflush(stdout);
    return 1;
}

static uint64_t now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000u + (uint64_t)t.tv_nsec / 1000000u;
}

static unsigned char pattern(size_t i, int seed)
{
    return (unsigned char)(i * 7 + seed + i / 251);
}

static int connect_qp(struct ibv_qp *qp, uint32_t dest_qpn, uint16_t dlid, const union ibv_gid *dgid)
{
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = 1, .qp_access_flags = ACCESS};
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
        return -1;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = IBV_MTU_1024;
    a.dest_qp_num = dest_qpn;
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
    a.max_rd_atomic = 1;
    return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                     IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
}

/* The device and a PD. 0 when open. */
static int open_ctx(void)
{
    struct ibv_device **devs = ibv_get_device_list(NULL);
    if (!devs || !devs[0])
        return fail("no device");
    ctx = ibv_open_device(devs[0]);
    if (!ctx || !(pd = ibv_alloc_pd(ctx)))
        return fail("device or pd");
    return 0;
}

/* A CQ and a connected loopback RC pair (their rings: extents of the
 * region). 0 when up. */
static int make_qps(void)
{
    if (!(cq = ibv_create_cq(ctx, 16, NULL, NULL, 0)))
        return fail("cq");
    struct ibv_qp_init_attr init = {
        .send_cq = cq,
        .recv_cq = cq,
        .cap = {.max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1},
        .qp_type = IBV_QPT_RC,
    };
    struct ibv_port_attr port;
    union ibv_gid gid;
    qa = ibv_create_qp(pd, &init);
    qb = ibv_create_qp(pd, &init);
    if (!qa || !qb || ibv_query_port(ctx, 1, &port) || ibv_query_gid(ctx, 1, 0, &gid))
        return fail("qps, port or gid");
    if (connect_qp(qa, qb->qp_num, port.lid, &gid) || connect_qp(qb, qa->qp_num, port.lid, &gid))
        return fail("connecting the QP pair");
    return 0;
}

static int open_device(void)
{
    return open_ctx() || make_qps();
}

/* RDMA-writes [src, src + len) (lkey) to dst (rkey) from qa to qb and
 * waits (30 s at most) for its completion. 0 when it succeeded. */
static int rdma_write(void *src, uint32_t lkey, void *dst, uint32_t rkey, size_t len)
{
    struct ibv_sge sge = {.addr = (uintptr_t)src, .length = (uint32_t)len, .lkey = lkey};
    struct ibv_send_wr wr = {.wr_id = 7, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
                             .send_flags = IBV_SEND_SIGNALED};
    wr.wr.rdma.remote_addr = (uintptr_t)dst;
    wr.wr.rdma.rkey = rkey;
    struct ibv_send_wr *bad;
    if (ibv_post_send(qa, &wr, &bad))
        return fail("post an RDMA write");
    struct ibv_wc wc;
    uint64_t end = now_ms() + 30000;
    while (now_ms() < end) {
        int n = ibv_poll_cq(cq, 1, &wc);
        if (n < 0)
            return fail("poll");
        if (n == 1) {
            if (wc.status != IBV_WC_SUCCESS) {
                printf("FAIL an RDMA write's completion: %s\n", ibv_wc_status_str(wc.status));
                return 1;
            }
            return 0;
        }
        usleep(100);
    }
    printf("FAIL no completion of an RDMA write within 30 s\n");
    return 1;
}

/* 0 when [p, p + len) holds pattern(i + from, seed). */
static int check(const char *what, const unsigned char *p, size_t len, size_t from, int seed)
{
    for (size_t i = 0; i < len; i++)
        if (p[i] != pattern(i + from, seed)) {
            printf("FAIL %s: byte %zu is %#x, not %#x\n", what, i, p[i], pattern(i + from, seed));
            return 1;
        }
    return 0;
}

static void print_mapping(const void *p)
{
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    while (f && fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx", &lo, &hi) == 2 && lo <= (unsigned long)p && (unsigned long)p < hi) {
            printf("MAPPED %s", line);
            break;
        }
    }
    if (f)
        fclose(f);
}

static int refused(const char *what)
{
    int e = errno;
    printf("%s errno %d (%s)\n", what, e, strerror(e));
    fflush(stdout);
    return 2;
}

static int grow(void)
{
    enum { FIRST = 100, SECOND = 5 * PAGE };
    unsigned char *buf, *other;
    if (posix_memalign((void **)&buf, PAGE, 8 * PAGE) || posix_memalign((void **)&other, PAGE, 8 * PAGE))
        return fail("buffers");
    for (size_t i = 0; i < 8 * PAGE; i++)
        buf[i] = pattern(i, 1);
    memset(other, 0, 8 * PAGE);
    if (open_ctx())
        return 1;
    /* The first region's span is the page it lies in; the QPs' rings and
     * the destination are allocated after it, so the second region's
     * growth relies on the extent's headroom. */
    struct ibv_mr *first = ibv_reg_mr(pd, buf, FIRST, ACCESS);
    if (!first)
        return fail("registering the first 100 bytes");
    if (make_qps())
        return 1;
    struct ibv_mr *dst = ibv_reg_mr(pd, other, 8 * PAGE, ACCESS);
    if (!dst)
        return fail("registering the destination");
    struct ibv_mr *second = ibv_reg_mr(pd, buf + FIRST, SECOND, ACCESS);
    if (!second)
        return refused("GROW_REFUSED");
    print_mapping(buf + FIRST + SECOND - 1);
    /* The bytes are the program's: the pattern survived the growth. */
    if (check("the grown span's bytes", buf, FIRST + SECOND, 0, 1))
        return 1;
    if (rdma_write(buf + FIRST, second->lkey, other, dst->rkey, SECOND) ||
        check("the second region written out", other, SECOND, FIRST, 1))
        return 1;
    for (size_t i = 0; i < FIRST; i++)
        other[i] = pattern(i, 9);
    if (rdma_write(other, dst->lkey, buf, first->rkey, FIRST) || check("the first region written into", buf, FIRST, 0, 9) ||
        check("the second region's bytes after", buf + FIRST, SECOND, FIRST, 1))
        return 1;
    printf("GROW_OK %d bytes then %d from inside their page, data both ways\n", FIRST, SECOND);
    return 0;
}

static int pieces(void)
{
    enum { FROM = PAGE + 8, LEN = 6 * PAGE - 8, SMALL_A = 2 * PAGE + 16 };
    unsigned char *buf, *other;
    if (posix_memalign((void **)&buf, PAGE, 8 * PAGE) || posix_memalign((void **)&other, PAGE, 8 * PAGE))
        return fail("buffers");
    for (size_t i = 0; i < 8 * PAGE; i++)
        buf[i] = pattern(i, 4);
    memset(other, 0, 8 * PAGE);
    if (open_ctx())
        return 1;
    struct ibv_mr *a = ibv_reg_mr(pd, buf + SMALL_A, 100, ACCESS);
    struct ibv_mr *b = ibv_reg_mr(pd, buf + 5 * PAGE, 200, ACCESS);
    if (!a || !b)
        return fail("registering the two small regions");
    if (make_qps())
        return 1;
    struct ibv_mr *dst = ibv_reg_mr(pd, other, 8 * PAGE, ACCESS);
    if (!dst)
        return fail("registering the destination");
    struct ibv_mr *big = ibv_reg_mr(pd, buf + FROM, LEN, ACCESS);
    if (!big)
        return refused("PIECES_REFUSED");
    if (check("the buffer's bytes after the registrations", buf, 8 * PAGE, 0, 4))
        return 1;
    if (rdma_write(buf + FROM, big->lkey, other, dst->rkey, LEN) || check("the region written out", other, LEN, FROM, 4))
        return 1;
    for (size_t i = 0; i < LEN; i++)
        other[i] = pattern(i, 11);
    if (rdma_write(other, dst->lkey, buf + FROM, big->rkey, LEN) || check("the region written into", buf + FROM, LEN, 0, 11))
        return 1;
    memset(other, 0, 8 * PAGE);
    if (rdma_write(buf + SMALL_A, a->lkey, other, dst->rkey, 100) ||
        check("the first small region by its own key", other, 100, SMALL_A - FROM, 11))
        return 1;
    printf("PIECES_OK %d bytes over two registered spans, data both ways\n", LEN);
    return 0;
}

/* The first and last MiB of the region, written out into `small` and checked. */
static int ends(unsigned char *buf, size_t len, struct ibv_mr *mr, unsigned char *small, struct ibv_mr *smr)
{
    for (int k = 0; k < 2; k++) {
        size_t from = k ? len - MIB : 0;
        memset(small, 0, MIB);
        if (rdma_write(buf + from, mr->lkey, small, smr->rkey, MIB) || check("a MiB written out", small, MIB, from, 3))
            return 1;
    }
    return 0;
}

static int reg(size_t mib, int hold_s)
{
    size_t len = mib * MIB;
    unsigned char *buf, *small;
    if (open_device())
        return 1;
    if (posix_memalign((void **)&small, PAGE, MIB))
        return fail("the small buffer");
    struct ibv_mr *smr = ibv_reg_mr(pd, small, MIB, ACCESS);
    if (!smr)
        return fail("registering the small buffer");
    if (posix_memalign((void **)&buf, PAGE, len))
        return fail("the buffer");
    for (size_t i = 0; i < len; i++)
        buf[i] = pattern(i, 3);
    struct ibv_mr *mr = ibv_reg_mr(pd, buf, len, ACCESS);
    if (!mr)
        return refused("REG_REFUSED");
    if (ends(buf, len, mr, small, smr))
        return 1;
    printf("REG_OK %zu MiB\n", mib);
    fflush(stdout);
    if (hold_s <= 0)
        return 0;
    uint64_t end = now_ms() + (uint64_t)hold_s * 1000;
    while (access("/tmp/guestmem.go", F_OK) != 0) {
        if (now_ms() > end) {
            printf("FAIL no /tmp/guestmem.go within %d s\n", hold_s);
            return 1;
        }
        usleep(20000);
    }
    if (ends(buf, len, mr, small, smr))
        return 1;
    printf("HELD_OK %zu MiB\n", mib);
    return 0;
}

static int huge(void)
{
    size_t len = 2 * MIB;
    unsigned char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
    if (p == MAP_FAILED) {
        printf("NO_HUGE %s\n", strerror(errno));
        return 3;
    }
    memset(p, 0x5a, len);
    if (open_device())
        return 1;
    struct ibv_mr *mr = ibv_reg_mr(pd, p, len, ACCESS);
    if (!mr)
        return refused("HUGE_REFUSED");
    printf("HUGE_OK\n");
    return 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc >= 2 && !strcmp(argv[1], "grow"))
        return grow();
    if (argc >= 2 && !strcmp(argv[1], "pieces"))
        return pieces();
    if (argc >= 3 && !strcmp(argv[1], "reg"))
        return reg(strtoul(argv[2], NULL, 10), argc >= 4 ? atoi(argv[3]) : 0);
    if (argc >= 2 && !strcmp(argv[1], "huge"))
        return huge();
    fprintf(stderr, "usage: guestmem grow | pieces | reg MIB [HOLD_S] | huge\n");
    return 64;
}
