/*
 * Semantics through plain ibv_post_send on a loopback RC pair: every
 * opcode's data with multi-SGE gather/scatter and inline data, error
 * statuses and the flush after them, completion events under epoll and
 * the async fd under poll, RETRY_EXC, REM_OP, LOC_LEN and the post-time
 * refusals of oversized inline data and inline reads, and the channel
 * fd readable exactly while an event is unread. "hold <file>"
 * allocates objects, writes <file> and sleeps (the test SIGKILLs it);
 * "after" checks a fresh process still gets a working device.
 *
 * Exit status 0 and a last line "semantics_check: OK" mean every check passed.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

#define BUF 65536
#define ACCESS (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | \
		IBV_ACCESS_REMOTE_ATOMIC)

static int to_init(struct ibv_qp *qp)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1, .qp_access_flags = ACCESS };
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

static int to_rtr(struct ibv_qp *qp, uint32_t dest, uint16_t lid)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_1024, .dest_qp_num = dest,
				 .max_dest_rd_atomic = 1, .min_rnr_timer = 1 };
	a.ah_attr.dlid = lid;
	a.ah_attr.port_num = 1;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
					     IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
}

static int to_rts(struct ibv_qp *qp, int rnr_retry)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 7,
				 .rnr_retry = rnr_retry, .max_rd_atomic = 1 };
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
					     IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
}

struct pair {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_mr *mr;
	char *buf;
	struct ibv_comp_channel *ch;
	struct ibv_cq *ca, *cb;
	struct ibv_qp *a, *b;
	uint16_t lid;
};

/* Two RC QPs connected to each other (a uses ca, b uses cb, on channel ch)
 * up to RTS unless connect is 0 (then both stay in INIT). */
static int make_pair(struct pair *p, struct ibv_context *ctx, int rnr_retry, int connect)
{
	memset(p, 0, sizeof(*p));
	p->ctx = ctx;
	struct ibv_port_attr port;
	if (ibv_query_port(ctx, 1, &port))
		return -1;
	p->lid = port.lid;
	p->pd = ibv_alloc_pd(ctx);
	p->buf = aligned_alloc(4096, BUF);
	memset(p->buf, 0, BUF);
	p->mr = p->pd ? ibv_reg_mr(p->pd, p->buf, BUF, ACCESS) : NULL;
	p->ch = ibv_create_comp_channel(ctx);
	p->ca = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	p->cb = ibv_create_cq(ctx, 64, (void *)0xb, p->ch, 0);
	if (!p->mr || !p->ch || !p->ca || !p->cb)
		return -2;
	struct ibv_qp_init_attr ia = { .send_cq = p->ca, .recv_cq = p->ca, .qp_type = IBV_QPT_RC,
				       .cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 3,
						.max_recv_sge = 2, .max_inline_data = 64 } };
	p->a = ibv_create_qp(p->pd, &ia);
	ia.send_cq = ia.recv_cq = p->cb;
	p->b = ibv_create_qp(p->pd, &ia);
	if (!p->a || !p->b)
		return -3;
	if (to_init(p->a) || to_init(p->b))
		return -4;
	if (!connect)
		return 0;
	if (to_rtr(p->a, p->b->qp_num, p->lid) || to_rtr(p->b, p->a->qp_num, p->lid) ||
	    to_rts(p->a, rnr_retry) || to_rts(p->b, rnr_retry))
		return -5;
	return 0;
}

static void free_pair(struct pair *p)
{
	struct ibv_wc wc[64];
	CHECK(ibv_destroy_qp(p->a) == 0 && ibv_destroy_qp(p->b) == 0, "");
	while (ibv_poll_cq(p->ca, 64, wc) > 0)
		;
	CHECK(ibv_destroy_cq(p->ca) == 0 && ibv_destroy_cq(p->cb) == 0, "");
	CHECK(ibv_destroy_comp_channel(p->ch) == 0, "");
	CHECK(ibv_dereg_mr(p->mr) == 0 && ibv_dealloc_pd(p->pd) == 0, "");
	free(p->buf);
}

static void fill(char *dst, size_t n, unsigned seed)
{
	for (size_t i = 0; i < n; i++)
		dst[i] = (char)(seed * 31 + i * 7 + (i >> 8));
}

static void post_recv2(struct pair *p, struct ibv_qp *qp, uint64_t id, char *d1, uint32_t l1, char *d2,
		       uint32_t l2)
{
	struct ibv_sge s[2] = { { (uintptr_t)d1, l1, p->mr->lkey }, { (uintptr_t)d2, l2, p->mr->lkey } };
	struct ibv_recv_wr w = { .wr_id = id, .sg_list = s, .num_sge = d2 ? 2 : 1 }, *bad;
	CHECK(ibv_post_recv(qp, &w, &bad) == 0, "post_recv");
}

static int post(struct ibv_qp *qp, struct ibv_send_wr *w)
{
	struct ibv_send_wr *bad = NULL;
	return ibv_post_send(qp, w, &bad);
}

/* One requester completion on ca and (when want_recv) one on cb. */
static void expect(struct pair *p, uint64_t id, enum ibv_wc_opcode op, struct ibv_wc *rwc, int want_recv)
{
	struct ibv_wc wc;
	int n = poll_n(p->ca, &wc, 1, 5000);
	CHECK(n == 1 && wc.status == IBV_WC_SUCCESS && wc.wr_id == id && wc.opcode == op,
	      "wr %llu: n=%d status=%s opcode=%d", (unsigned long long)id, n,
	      n == 1 ? ibv_wc_status_str(wc.status) : "-", n == 1 ? (int)wc.opcode : -1);
	if (want_recv) {
		n = poll_n(p->cb, rwc, 1, 5000);
		CHECK(n == 1 && rwc->status == IBV_WC_SUCCESS && rwc->qp_num == p->b->qp_num &&
			      rwc->src_qp == p->a->qp_num,
		      "recv for %llu: n=%d status=%d", (unsigned long long)id, n, n == 1 ? rwc->status : -1);
	}
}

/* A. Every opcode's data through ibv_post_send. Layout of buf: source at
 * 0..8K, receive/target at 16K.., read destinations at 32K.. */
static void check_data(struct ibv_context *ctx)
{
	struct pair p;
	CHECK(make_pair(&p, ctx, 7, 1) == 0, "make_pair");
	char *src = p.buf, *dst = p.buf + 16384, *rd = p.buf + 32768;
	uint32_t lk = p.mr->lkey, rk = p.mr->rkey;
	struct ibv_wc rwc;
	fill(src, 8192, 1);
	/* SEND, 3-SGE gather (100+1000+57) into a 2-SGE scatter (500+2000). */
	struct ibv_sge g[3] = { { (uintptr_t)src, 100, lk }, { (uintptr_t)src + 1000, 1000, lk },
				{ (uintptr_t)src + 4000, 57, lk } };
	char expect_bytes[1157];
	memcpy(expect_bytes, src, 100);
	memcpy(expect_bytes + 100, src + 1000, 1000);
	memcpy(expect_bytes + 1100, src + 4000, 57);
	for (int imm = 0; imm < 2; imm++) {
		memset(dst, 0, 8192);
		post_recv2(&p, p.b, 50 + imm, dst, 500, dst + 3000, 2000);
		struct ibv_send_wr w = { .wr_id = 1 + imm, .sg_list = g, .num_sge = 3,
					 .opcode = imm ? IBV_WR_SEND_WITH_IMM : IBV_WR_SEND,
					 .send_flags = IBV_SEND_SIGNALED, .imm_data = htonl(0xabcd0123) };
		CHECK(post(p.a, &w) == 0, "");
		expect(&p, 1 + imm, IBV_WC_SEND, &rwc, 1);
		CHECK(rwc.wr_id == 50u + imm && rwc.opcode == IBV_WC_RECV && rwc.byte_len == 1157,
		      "opcode=%d len=%u", rwc.opcode, rwc.byte_len);
		CHECK(!!(rwc.wc_flags & IBV_WC_WITH_IMM) == imm && (!imm || rwc.imm_data == htonl(0xabcd0123)),
		      "flags=%x imm=%x", rwc.wc_flags, rwc.imm_data);
		CHECK(!memcmp(dst, expect_bytes, 500) && !memcmp(dst + 3000, expect_bytes + 500, 657),
		      "send%s data", imm ? " with imm" : "");
		CHECK(dst[500] == 0 && dst[3000 + 657] == 0, "wrote past the message");
	}
	/* RDMA_WRITE gathered from 3 SGEs, then WRITE_WITH_IMM. */
	for (int imm = 0; imm < 2; imm++) {
		memset(dst, 0, 8192);
		if (imm)
			post_recv2(&p, p.b, 60, dst + 6000, 4, NULL, 0);
		struct ibv_send_wr w = { .wr_id = 3 + imm, .sg_list = g, .num_sge = 3,
					 .opcode = imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE,
					 .send_flags = IBV_SEND_SIGNALED, .imm_data = htonl(77) };
		w.wr.rdma.remote_addr = (uintptr_t)dst + 10;
		w.wr.rdma.rkey = rk;
		CHECK(post(p.a, &w) == 0, "");
		expect(&p, 3 + imm, IBV_WC_RDMA_WRITE, &rwc, imm);
		if (imm)
			CHECK(rwc.opcode == IBV_WC_RECV_RDMA_WITH_IMM && (rwc.wc_flags & IBV_WC_WITH_IMM) &&
				      rwc.imm_data == htonl(77) && rwc.byte_len == 1157,
			      "opcode=%d flags=%x imm=%x len=%u", rwc.opcode, rwc.wc_flags, rwc.imm_data,
			      rwc.byte_len);
		CHECK(!memcmp(dst + 10, expect_bytes, 1157) && dst[9] == 0 && dst[1167] == 0, "write data");
	}
	/* RDMA_READ scattered into 3 local SGEs. */
	memset(rd, 0, 4096);
	struct ibv_sge rs[3] = { { (uintptr_t)rd, 7, lk }, { (uintptr_t)rd + 100, 900, lk },
				 { (uintptr_t)rd + 2000, 93, lk } };
	struct ibv_send_wr r = { .wr_id = 5, .sg_list = rs, .num_sge = 3, .opcode = IBV_WR_RDMA_READ,
				 .send_flags = IBV_SEND_SIGNALED };
	r.wr.rdma.remote_addr = (uintptr_t)src + 3;
	r.wr.rdma.rkey = rk;
	CHECK(post(p.a, &r) == 0, "");
	expect(&p, 5, IBV_WC_RDMA_READ, &rwc, 0);
	CHECK(!memcmp(rd, src + 3, 7) && !memcmp(rd + 100, src + 10, 900) && !memcmp(rd + 2000, src + 910, 93) &&
		      rd[7] == 0 && rd[1000] == 0 && rd[2093] == 0,
	      "read data");
	/* Atomics: compare-and-swap hit and miss, fetch-and-add. */
	uint64_t *target = (uint64_t *)(p.buf + 40960), *old = target + 1;
	*target = 0x1111222233334444ULL;
	struct ibv_sge as = { (uintptr_t)old, 8, lk };
	struct ibv_send_wr at = { .wr_id = 6, .sg_list = &as, .num_sge = 1, .opcode = IBV_WR_ATOMIC_CMP_AND_SWP,
				  .send_flags = IBV_SEND_SIGNALED };
	at.wr.atomic.remote_addr = (uintptr_t)target;
	at.wr.atomic.rkey = rk;
	at.wr.atomic.compare_add = 0x1111222233334444ULL;
	at.wr.atomic.swap = 0x5555666677778888ULL;
	CHECK(post(p.a, &at) == 0, "");
	expect(&p, 6, IBV_WC_COMP_SWAP, &rwc, 0);
	CHECK(*old == 0x1111222233334444ULL && *target == 0x5555666677778888ULL, "cas hit: old=%llx target=%llx",
	      (unsigned long long)*old, (unsigned long long)*target);
	at.wr.atomic.swap = 1; /* compare 0x1111... no longer matches */
	CHECK(post(p.a, &at) == 0, "");
	expect(&p, 6, IBV_WC_COMP_SWAP, &rwc, 0);
	CHECK(*old == 0x5555666677778888ULL && *target == 0x5555666677778888ULL,
	      "cas miss: old=%llx target=%llx", (unsigned long long)*old, (unsigned long long)*target);
	at.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
	at.wr_id = 7;
	at.wr.atomic.compare_add = 0x10;
	CHECK(post(p.a, &at) == 0, "");
	expect(&p, 7, IBV_WC_FETCH_ADD, &rwc, 0);
	CHECK(*old == 0x5555666677778888ULL && *target == 0x5555666677778898ULL, "fetch-add: old=%llx target=%llx",
	      (unsigned long long)*old, (unsigned long long)*target);
	/* Inline send and inline write, from a gathered stack buffer that is
	 * clobbered right after posting. */
	char in[64];
	fill(in, sizeof(in), 9);
	char keep[64];
	memcpy(keep, in, 64);
	struct ibv_sge is[2] = { { (uintptr_t)in, 20, 0 }, { (uintptr_t)in + 30, 34, 0 } };
	memset(dst, 0, 8192);
	post_recv2(&p, p.b, 70, dst, 10, dst + 100, 100);
	struct ibv_send_wr iw = { .wr_id = 8, .sg_list = is, .num_sge = 2, .opcode = IBV_WR_SEND,
				  .send_flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED };
	CHECK(post(p.a, &iw) == 0, "");
	memset(in, 'X', sizeof(in));
	expect(&p, 8, IBV_WC_SEND, &rwc, 1);
	CHECK(rwc.byte_len == 54 && !memcmp(dst, keep, 10) && !memcmp(dst + 100, keep + 10, 10) &&
		      !memcmp(dst + 110, keep + 30, 34),
	      "inline send len=%u", rwc.byte_len);
	memcpy(in, keep, 64);
	iw.wr_id = 9;
	iw.opcode = IBV_WR_RDMA_WRITE;
	iw.wr.rdma.remote_addr = (uintptr_t)dst + 5000;
	iw.wr.rdma.rkey = rk;
	CHECK(post(p.a, &iw) == 0, "");
	memset(in, 'Y', sizeof(in));
	expect(&p, 9, IBV_WC_RDMA_WRITE, &rwc, 0);
	CHECK(!memcmp(dst + 5000, keep, 20) && !memcmp(dst + 5020, keep + 30, 34) && dst[5054] == 0,
	      "inline write data");
	free_pair(&p);
}

static enum ibv_qp_state qp_state(struct ibv_qp *qp)
{
	struct ibv_qp_attr a;
	struct ibv_qp_init_attr i;
	if (ibv_query_qp(qp, &a, IBV_QP_STATE, &i))
		return (enum ibv_qp_state)-1;
	return a.qp_state;
}

static int one_wc(struct ibv_cq *cq, struct ibv_wc *wc)
{
	return poll_n(cq, wc, 1, 10000) == 1;
}

/* B and C. Error statuses, flushes, async and completion events. */
static void check_errors(struct ibv_context *ctx)
{
	struct pair p;
	struct ibv_wc wc;
	/* Bad rkey: REM_ACCESS_ERR, the next WR flushes, QP in ERR; the
	 * responder raises IBV_EVENT_QP_ACCESS_ERR through the async fd. */
	CHECK(make_pair(&p, ctx, 7, 1) == 0, "");
	struct ibv_sge s = { (uintptr_t)p.buf, 8, p.mr->lkey };
	struct ibv_send_wr w = { .wr_id = 11, .sg_list = &s, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
				 .send_flags = IBV_SEND_SIGNALED };
	w.wr.rdma.remote_addr = (uintptr_t)p.buf + 1024;
	w.wr.rdma.rkey = p.mr->rkey + 1000;
	CHECK(post(p.a, &w) == 0, "");
	CHECK(one_wc(p.ca, &wc) && wc.wr_id == 11 && wc.status == IBV_WC_REM_ACCESS_ERR, "status=%s",
	      ibv_wc_status_str(wc.status));
	w.wr_id = 12;
	w.wr.rdma.rkey = p.mr->rkey;
	CHECK(post(p.a, &w) == 0, "posting in ERR is allowed");
	CHECK(one_wc(p.ca, &wc) && wc.wr_id == 12 && wc.status == IBV_WC_WR_FLUSH_ERR, "status=%s",
	      ibv_wc_status_str(wc.status));
	CHECK(qp_state(p.a) == IBV_QPS_ERR, "state=%d", qp_state(p.a));
	struct pollfd pf = { .fd = ctx->async_fd, .events = POLLIN };
	CHECK(poll(&pf, 1, 5000) == 1 && (pf.revents & POLLIN), "async fd not readable");
	struct ibv_async_event ev;
	CHECK(ibv_get_async_event(ctx, &ev) == 0, "");
	CHECK(ev.event_type == IBV_EVENT_QP_ACCESS_ERR && ev.element.qp == p.b, "event %s",
	      ibv_event_type_str(ev.event_type));
	ibv_ack_async_event(&ev);
	free_pair(&p);

	/* Bad lkey: LOC_PROT_ERR. */
	CHECK(make_pair(&p, ctx, 7, 1) == 0, "");
	s.addr = (uintptr_t)p.buf;
	s.lkey = p.mr->lkey + 1000;
	w.wr_id = 13;
	w.wr.rdma.remote_addr = (uintptr_t)p.buf + 1024;
	w.wr.rdma.rkey = p.mr->rkey;
	CHECK(post(p.a, &w) == 0, "");
	CHECK(one_wc(p.ca, &wc) && wc.wr_id == 13 && wc.status == IBV_WC_LOC_PROT_ERR, "status=%s",
	      ibv_wc_status_str(wc.status));
	free_pair(&p);

	/* Receive too small: REM_INV_REQ_ERR / LOC_LEN_ERR. */
	CHECK(make_pair(&p, ctx, 7, 1) == 0, "");
	post_recv2(&p, p.b, 80, p.buf + 4096, 4, NULL, 0);
	s.addr = (uintptr_t)p.buf;
	s.lkey = p.mr->lkey;
	s.length = 64;
	w.wr_id = 14;
	w.opcode = IBV_WR_SEND;
	CHECK(post(p.a, &w) == 0, "");
	CHECK(one_wc(p.ca, &wc) && wc.wr_id == 14 && wc.status == IBV_WC_REM_INV_REQ_ERR, "status=%s",
	      ibv_wc_status_str(wc.status));
	CHECK(one_wc(p.cb, &wc) && wc.wr_id == 80 && wc.status == IBV_WC_LOC_LEN_ERR, "status=%s",
	      ibv_wc_status_str(wc.status));
	free_pair(&p);

	/* RNR with rnr_retry=1 and no receive. */
	CHECK(make_pair(&p, ctx, 1, 1) == 0, "");
	s.addr = (uintptr_t)p.buf;
	s.lkey = p.mr->lkey;
	w.wr_id = 15;
	CHECK(post(p.a, &w) == 0, "");
	CHECK(one_wc(p.ca, &wc) && wc.wr_id == 15 && wc.status == IBV_WC_RNR_RETRY_EXC_ERR, "status=%s",
	      ibv_wc_status_str(wc.status));
	free_pair(&p);

	/* Posting a send in INIT: EINVAL and bad_wr. A wrong modify mask:
	 * EINVAL. */
	CHECK(make_pair(&p, ctx, 7, 0) == 0, "");
	s.addr = (uintptr_t)p.buf;
	s.lkey = p.mr->lkey;
	struct ibv_send_wr *bad = NULL;
	w.wr_id = 16;
	CHECK(ibv_post_send(p.a, &w, &bad) == EINVAL && bad == &w, "bad=%p", (void *)bad);
	struct ibv_qp_attr qa = { .qp_state = IBV_QPS_RTR };
	CHECK(ibv_modify_qp(p.a, &qa, IBV_QP_STATE) == EINVAL, "INIT->RTR without its required attributes");
	CHECK(qp_state(p.a) == IBV_QPS_INIT, "");

	/* Completion channel under epoll: b's CQ. */
	CHECK(to_rtr(p.a, p.b->qp_num, p.lid) == 0 && to_rtr(p.b, p.a->qp_num, p.lid) == 0 &&
		      to_rts(p.a, 7) == 0 && to_rts(p.b, 7) == 0,
	      "");
	int ep = epoll_create1(0);
	struct epoll_event ee = { .events = EPOLLIN }, out;
	CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, p.ch->fd, &ee) == 0, "");
	CHECK(epoll_wait(ep, &out, 1, 0) == 0, "readable before anything happened");
	CHECK(ibv_req_notify_cq(p.cb, 0) == 0, "");
	post_recv2(&p, p.b, 90, p.buf + 4096, 64, NULL, 0);
	w.wr_id = 17;
	CHECK(post(p.a, &w) == 0, "");
	CHECK(epoll_wait(ep, &out, 1, 5000) == 1 && (out.events & EPOLLIN), "no event within 5 s");
	struct ibv_cq *ecq = NULL;
	void *ectx = NULL;
	CHECK(ibv_get_cq_event(p.ch, &ecq, &ectx) == 0 && ecq == p.cb && ectx == (void *)0xb, "");
	ibv_ack_cq_events(p.cb, 1);
	CHECK(one_wc(p.cb, &wc) && wc.wr_id == 90 && wc.status == IBV_WC_SUCCESS, "");
	CHECK(one_wc(p.ca, &wc) && wc.wr_id == 17 && wc.status == IBV_WC_SUCCESS, "");
	close(ep);

	/* Overfilling the send queue. The QP is drained into SQD first: there
	 * the engine starts no new WR, so exactly max_send_wr fit. (In RTS the
	 * engine takes the head WR out of the ring while it waits on an RNR,
	 * which would leave room for one more than hardware allows.) */
	struct ibv_qp_init_attr qi;
	struct ibv_qp_attr sqd = { .qp_state = IBV_QPS_SQD };
	CHECK(ibv_modify_qp(p.a, &sqd, IBV_QP_STATE) == 0, "RTS -> SQD");
	CHECK(ibv_query_qp(p.a, &qa, IBV_QP_CAP, &qi) == 0, "");
	int max = qi.cap.max_send_wr, rc = 0, i;
	w.send_flags = 0;
	for (i = 0; i <= max && rc == 0; i++) {
		w.wr_id = 1000 + i;
		bad = NULL;
		rc = ibv_post_send(p.a, &w, &bad);
	}
	CHECK(rc == ENOMEM && bad == &w && i == max + 1, "rc=%d after %d posts (max_send_wr=%d)", rc, i, max);
	free_pair(&p);
}

/* D. The remaining statuses: RETRY_EXC_ERR, REM_OP_ERR, LOC_LEN_ERR and
 * the post-time refusals that stand in for LOC_LEN_ERR / LOC_QP_OP_ERR. */
static void check_more_errors(struct ibv_context *ctx)
{
	struct pair p;
	struct ibv_wc wc;
	struct ibv_send_wr *bad;

	/* RETRY_EXC_ERR: a connected to a QP number never created on this
	 * device (0xfffffe), timeout=1 (8 us) and retry_cnt=1; the core
	 * gives up once timeout * (retry_cnt + 1) has passed with no peer.
	 * The next WR then flushes. */
	CHECK(make_pair(&p, ctx, 7, 0) == 0, "");
	CHECK(to_rtr(p.a, 0xfffffe, p.lid) == 0, "");
	struct ibv_qp_attr ra = { .qp_state = IBV_QPS_RTS, .timeout = 1, .retry_cnt = 1, .rnr_retry = 1,
				  .max_rd_atomic = 1 };
	CHECK(ibv_modify_qp(p.a, &ra, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
					      IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC) == 0,
	      "RTS with timeout=1 retry_cnt=1");
	struct ibv_sge s = { (uintptr_t)p.buf, 8, p.mr->lkey };
	struct ibv_send_wr w = { .wr_id = 21, .sg_list = &s, .num_sge = 1, .opcode = IBV_WR_SEND,
				 .send_flags = IBV_SEND_SIGNALED };
	CHECK(post(p.a, &w) == 0, "");
	double t0 = now_ns();
	int n = poll_n(p.ca, &wc, 1, 3000);
	CHECK(n == 1 && wc.wr_id == 21 && wc.status == IBV_WC_RETRY_EXC_ERR, "n=%d status=%s after %.0f ms", n,
	      n == 1 ? ibv_wc_status_str(wc.status) : "-", (now_ns() - t0) / 1e6);
	w.wr_id = 22;
	CHECK(post(p.a, &w) == 0, "posting in ERR is allowed");
	CHECK(one_wc(p.ca, &wc) && wc.wr_id == 22 && wc.status == IBV_WC_WR_FLUSH_ERR, "status=%s",
	      ibv_wc_status_str(wc.status));
	CHECK(qp_state(p.a) == IBV_QPS_ERR, "state=%d", qp_state(p.a));
	free_pair(&p);

	/* REM_OP_ERR: b's receive names the lkey of a deregistered MR. The
	 * core (datapath/rc.rs) fails the send with REM_OP_ERR, the receive
	 * with LOC_PROT_ERR, and raises IBV_EVENT_QP_FATAL on b. */
	CHECK(make_pair(&p, ctx, 7, 1) == 0, "");
	struct ibv_mr *gone = ibv_reg_mr(p.pd, p.buf + 8192, 4096, ACCESS);
	CHECK(gone != NULL, "errno=%d", errno);
	uint32_t dead = gone ? gone->lkey : p.mr->lkey + 1000;
	CHECK(!gone || ibv_dereg_mr(gone) == 0, "");
	struct ibv_sge rs = { (uintptr_t)p.buf + 8192, 64, dead };
	struct ibv_recv_wr rw = { .wr_id = 23, .sg_list = &rs, .num_sge = 1 }, *rbad;
	CHECK(ibv_post_recv(p.b, &rw, &rbad) == 0, "post_recv with a dead lkey");
	s.addr = (uintptr_t)p.buf;
	s.lkey = p.mr->lkey;
	w.wr_id = 24;
	CHECK(post(p.a, &w) == 0, "");
	CHECK(one_wc(p.ca, &wc) && wc.wr_id == 24 && wc.status == IBV_WC_REM_OP_ERR, "status=%s",
	      ibv_wc_status_str(wc.status));
	CHECK(one_wc(p.cb, &wc) && wc.wr_id == 23 && wc.status == IBV_WC_LOC_PROT_ERR, "status=%s",
	      ibv_wc_status_str(wc.status));
	/* Earlier checks may have left events queued; look for b's. */
	int fatal = 0;
	struct pollfd pf = { .fd = ctx->async_fd, .events = POLLIN };
	for (int i = 0; i < 16 && !fatal && poll(&pf, 1, 5000) == 1; i++) {
		struct ibv_async_event ev;
		if (ibv_get_async_event(ctx, &ev))
			break;
		fatal = ev.event_type == IBV_EVENT_QP_FATAL && ev.element.qp == p.b;
		ibv_ack_async_event(&ev);
	}
	CHECK(fatal, "no IBV_EVENT_QP_FATAL on the responder");
	free_pair(&p);

	/* LOC_LEN_ERR: an atomic whose local SGE is shorter than 8 bytes is
	 * accepted at post and completes with LOC_LEN_ERR (datapath/rc.rs). */
	CHECK(make_pair(&p, ctx, 7, 1) == 0, "");
	uint64_t *target = (uint64_t *)(p.buf + 40960);
	*target = 5;
	struct ibv_sge as = { (uintptr_t)(target + 1), 4, p.mr->lkey };
	struct ibv_send_wr at = { .wr_id = 25, .sg_list = &as, .num_sge = 1,
				  .opcode = IBV_WR_ATOMIC_FETCH_AND_ADD, .send_flags = IBV_SEND_SIGNALED };
	at.wr.atomic.remote_addr = (uintptr_t)target;
	at.wr.atomic.rkey = p.mr->rkey;
	at.wr.atomic.compare_add = 1;
	CHECK(post(p.a, &at) == 0, "");
	CHECK(one_wc(p.ca, &wc) && wc.wr_id == 25 && wc.status == IBV_WC_LOC_LEN_ERR, "status=%s",
	      ibv_wc_status_str(wc.status));
	CHECK(*target == 5, "the atomic ran: target=%llu", (unsigned long long)*target);
	free_pair(&p);

	/* Inline data longer than the QP's max_inline_data, and an RDMA READ
	 * with IBV_SEND_INLINE: the library refuses both at post time with
	 * EINVAL and bad_wr (vrdma's check_send), as rdma-core's mlx5 provider
	 * does, so no LOC_LEN_ERR / LOC_QP_OP_ERR completion is produced (the
	 * core's own LOC_LEN_ERR / LOC_QP_OP_ERR checks for these are only a
	 * backstop). The QP stays usable. */
	CHECK(make_pair(&p, ctx, 7, 1) == 0, "");
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qi;
	CHECK(ibv_query_qp(p.a, &qa, IBV_QP_CAP, &qi) == 0, "");
	uint32_t maxin = qi.cap.max_inline_data;
	CHECK(maxin >= 64 && maxin < 4096, "max_inline_data=%u", maxin);
	struct ibv_sge is = { (uintptr_t)p.buf, maxin + 1, 0 };
	struct ibv_send_wr iw = { .wr_id = 26, .sg_list = &is, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
				  .send_flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED };
	iw.wr.rdma.remote_addr = (uintptr_t)p.buf + 16384;
	iw.wr.rdma.rkey = p.mr->rkey;
	bad = NULL;
	CHECK(ibv_post_send(p.a, &iw, &bad) == EINVAL && bad == &iw, "inline %u > %u: bad=%p", maxin + 1, maxin,
	      (void *)bad);
	struct ibv_sge rd = { (uintptr_t)p.buf + 32768, 16, p.mr->lkey };
	struct ibv_send_wr rr = { .wr_id = 27, .sg_list = &rd, .num_sge = 1, .opcode = IBV_WR_RDMA_READ,
				  .send_flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED };
	rr.wr.rdma.remote_addr = (uintptr_t)p.buf;
	rr.wr.rdma.rkey = p.mr->rkey;
	bad = NULL;
	CHECK(ibv_post_send(p.a, &rr, &bad) == EINVAL && bad == &rr, "inline read: bad=%p", (void *)bad);
	CHECK(poll_n(p.ca, &wc, 1, 200) == 0, "a refused WR completed: status=%s", ibv_wc_status_str(wc.status));
	CHECK(qp_state(p.a) == IBV_QPS_RTS, "state=%d", qp_state(p.a));
	is.length = maxin;
	iw.wr_id = 28;
	CHECK(post(p.a, &iw) == 0, "inline of exactly max_inline_data");
	CHECK(one_wc(p.ca, &wc) && wc.wr_id == 28 && wc.status == IBV_WC_SUCCESS, "status=%s",
	      ibv_wc_status_str(wc.status));
	free_pair(&p);
}

/* Whether fd is readable, waiting up to ms (0: just look). */
static int readable(int fd, int ms)
{
	struct pollfd pf = { .fd = fd, .events = POLLIN };
	return poll(&pf, 1, ms) == 1 && (pf.revents & POLLIN);
}

/* E. The completion channel fd is readable exactly while an event is
 * unread, as rdma-core's is: not before anything happened, readable once
 * an armed CQ completes, and no longer readable once ibv_get_cq_event has
 * taken the last event. Two CQs (x, y) on one channel, their QPs
 * connected to each other. */
static void check_channel_readiness(struct ibv_context *ctx)
{
	struct pair p;
	CHECK(make_pair(&p, ctx, 7, 0) == 0, "");
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	struct ibv_cq *x = ibv_create_cq(ctx, 16, (void *)0x1, ch, 0);
	struct ibv_cq *y = ibv_create_cq(ctx, 16, (void *)0x2, ch, 0);
	CHECK(ch && x && y, "errno=%d", errno);
	if (!ch || !x || !y)
		return;
	struct ibv_qp_init_attr ia = { .send_cq = x, .recv_cq = x, .qp_type = IBV_QPT_RC,
				       .cap = { .max_send_wr = 8, .max_recv_wr = 8, .max_send_sge = 1,
						.max_recv_sge = 1 } };
	struct ibv_qp *qx = ibv_create_qp(p.pd, &ia);
	ia.send_cq = ia.recv_cq = y;
	struct ibv_qp *qy = ibv_create_qp(p.pd, &ia);
	CHECK(qx && qy, "errno=%d", errno);
	if (!qx || !qy)
		return;
	CHECK(to_init(qx) == 0 && to_init(qy) == 0 && to_rtr(qx, qy->qp_num, p.lid) == 0 &&
		      to_rtr(qy, qx->qp_num, p.lid) == 0 && to_rts(qx, 7) == 0 && to_rts(qy, 7) == 0,
	      "connect");
	struct ibv_sge s = { (uintptr_t)p.buf, 8, p.mr->lkey };
	struct ibv_send_wr w = { .sg_list = &s, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
				 .send_flags = IBV_SEND_SIGNALED };
	w.wr.rdma.remote_addr = (uintptr_t)p.buf + 8192;
	w.wr.rdma.rkey = p.mr->rkey;
	struct ibv_wc wc;
	struct ibv_cq *ecq;
	void *ectx;
	int ep = epoll_create1(0);
	struct epoll_event ee = { .events = EPOLLIN }, out;
	CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, ch->fd, &ee) == 0, "");

	/* No event: not readable. */
	CHECK(!readable(ch->fd, 0), "readable before anything happened");
	/* A completion of an unarmed CQ raises no event. */
	w.wr_id = 100;
	CHECK(post(qx, &w) == 0, "");
	CHECK(one_wc(x, &wc) && wc.wr_id == 100 && wc.status == IBV_WC_SUCCESS, "");
	CHECK(!readable(ch->fd, 100), "readable after a completion of an unarmed CQ");

	/* Armed, then a completion: readable; the event taken: not readable,
	 * under poll and under level-triggered epoll. Three rounds. */
	for (int round = 0; round < 3; round++) {
		CHECK(ibv_req_notify_cq(x, 0) == 0, "");
		w.wr_id = 101 + round;
		CHECK(post(qx, &w) == 0, "");
		CHECK(readable(ch->fd, 5000), "round %d: not readable after an armed completion", round);
		CHECK(ibv_get_cq_event(ch, &ecq, &ectx) == 0 && ecq == x && ectx == (void *)0x1, "round %d",
		      round);
		CHECK(!readable(ch->fd, 0), "round %d: still readable after the last event was taken", round);
		CHECK(epoll_wait(ep, &out, 1, 0) == 0, "round %d: epoll reports the fd after the last event",
		      round);
		ibv_ack_cq_events(x, 1);
		CHECK(one_wc(x, &wc) && wc.wr_id == 101u + round && wc.status == IBV_WC_SUCCESS, "");
		CHECK(!readable(ch->fd, 0), "round %d: readable after polling the completion", round);
	}

	/* Two CQs fire: readable until both events are taken, one each. */
	CHECK(ibv_req_notify_cq(x, 0) == 0 && ibv_req_notify_cq(y, 0) == 0, "");
	struct ibv_sge rs = { (uintptr_t)p.buf + 4096, 64, p.mr->lkey };
	struct ibv_recv_wr rw = { .wr_id = 200, .sg_list = &rs, .num_sge = 1 }, *rbad;
	CHECK(ibv_post_recv(qy, &rw, &rbad) == 0, "");
	w.wr_id = 201;
	w.opcode = IBV_WR_SEND;
	CHECK(post(qx, &w) == 0, "");
	CHECK(one_wc(y, &wc) && wc.wr_id == 200 && wc.status == IBV_WC_SUCCESS, "");
	CHECK(one_wc(x, &wc) && wc.wr_id == 201 && wc.status == IBV_WC_SUCCESS, "");
	int seen_x = 0, seen_y = 0;
	for (int i = 0; i < 2; i++) {
		CHECK(readable(ch->fd, 5000), "event %d: not readable", i);
		ecq = NULL;
		CHECK(ibv_get_cq_event(ch, &ecq, &ectx) == 0, "event %d", i);
		seen_x += ecq == x;
		seen_y += ecq == y;
	}
	CHECK(seen_x == 1 && seen_y == 1, "events: x %d, y %d", seen_x, seen_y);
	CHECK(!readable(ch->fd, 0), "still readable after both events were taken");
	CHECK(epoll_wait(ep, &out, 1, 0) == 0, "epoll reports the fd after both events");
	ibv_ack_cq_events(x, 1);
	ibv_ack_cq_events(y, 1);
	close(ep);

	CHECK(ibv_destroy_qp(qx) == 0 && ibv_destroy_qp(qy) == 0, "");
	CHECK(ibv_destroy_cq(x) == 0 && ibv_destroy_cq(y) == 0, "");
	CHECK(ibv_destroy_comp_channel(ch) == 0, "");
	free_pair(&p);
}

static int hold(const char *file)
{
	int num;
	struct ibv_device **list = ibv_get_device_list(&num);
	if (!list || num < 1)
		return 1;
	struct ibv_context *ctx = ibv_open_device(list[0]);
	struct pair p;
	if (!ctx || make_pair(&p, ctx, 7, 1))
		return 2;
	struct ibv_srq_init_attr sa = { .attr = { .max_wr = 8, .max_sge = 1 } };
	if (!ibv_create_srq(p.pd, &sa))
		return 3;
	post_recv2(&p, p.b, 1, p.buf, 64, NULL, 0);
	/* Stdout first: the test kills us as soon as the file exists. */
	printf("ready\n");
	fflush(stdout);
	FILE *f = fopen(file, "w");
	if (!f)
		return 4;
	fprintf(f, "ready\n");
	fclose(f);
	sleep(120);
	return 5;
}

int main(int argc, char **argv)
{
	if (argc > 2 && !strcmp(argv[1], "hold"))
		return hold(argv[2]);
	int num;
	struct ibv_device **list = ibv_get_device_list(&num);
	CHECK(list && num == 1, "num=%d", num);
	if (!list || num < 1)
		return 1;
	struct ibv_context *ctx = ibv_open_device(list[0]);
	CHECK(ctx != NULL, "errno=%d", errno);
	if (!ctx)
		return 1;
	ibv_free_device_list(list);
	if (argc > 1 && !strcmp(argv[1], "after")) {
		/* A fresh process after a SIGKILLed holder: same objects, and data flows. */
		struct pair p;
		CHECK(make_pair(&p, ctx, 7, 1) == 0, "");
		struct ibv_srq_init_attr sa = { .attr = { .max_wr = 8, .max_sge = 1 } };
		struct ibv_srq *srq = ibv_create_srq(p.pd, &sa);
		CHECK(srq != NULL, "errno=%d", errno);
		strcpy(p.buf, "after the kill");
		post_recv2(&p, p.b, 1, p.buf + 1024, 64, NULL, 0);
		struct ibv_sge s = { (uintptr_t)p.buf, 15, p.mr->lkey };
		struct ibv_send_wr w = { .wr_id = 2, .sg_list = &s, .num_sge = 1, .opcode = IBV_WR_SEND,
					 .send_flags = IBV_SEND_SIGNALED };
		struct ibv_wc wc;
		CHECK(post(p.a, &w) == 0, "");
		expect(&p, 2, IBV_WC_SEND, &wc, 1);
		CHECK(!strcmp(p.buf + 1024, "after the kill"), "");
		CHECK(srq && ibv_destroy_srq(srq) == 0, "");
		free_pair(&p);
	} else {
		check_data(ctx);
		check_errors(ctx);
		check_more_errors(ctx);
		check_channel_readiness(ctx);
	}
	CHECK(ibv_close_device(ctx) == 0, "");
	if (failures) {
		fprintf(stderr, "semantics_check: %d failures\n", failures);
		return 1;
	}
	printf("semantics_check: OK\n");
	return 0;
}
