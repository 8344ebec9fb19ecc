/*
 * A peer SIGKILLed while it holds a connected RC QP: its survivor's QP
 * goes to ERR. Two processes of this program, started by the test
 * (tests/tools.rs) with a shared directory:
 *
 *   killed_peer_check victim <dir>    connects (<dir>/victim.connected),
 *                                     takes one message, writes
 *                                     <dir>/victim.ready, sleeps (the test
 *                                     SIGKILLs it by pid)
 *   killed_peer_check survivor <dir>  connects, sends that message, leaves
 *                                     two receives posted, writes
 *                                     <dir>/survivor.ready, then expects:
 *                                     IBV_EVENT_QP_FATAL for its QP on the
 *                                     async fd, ibv_query_qp reporting
 *                                     IBV_QPS_ERR, both receives and every
 *                                     WR posted afterwards completing with
 *                                     IBV_WC_WR_FLUSH_ERR.
 *
 * The QP numbers and LIDs travel through <dir>/<role>.qpn. Every wait is
 * bounded. Exit status 0 and a last line "killed_peer_check: OK" (the
 * survivor) mean every check passed.
 */
#include <errno.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"

#define BUF 4096
#define WAIT_MS 30000

struct side {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_mr *mr;
	char *buf;
	struct ibv_cq *cq;
	struct ibv_qp *qp;
	uint16_t lid;
};

static int open_side(struct side *s)
{
	int num;
	struct ibv_device **list = ibv_get_device_list(&num);
	if (!list || num < 1)
		return -1;
	s->ctx = ibv_open_device(list[0]);
	ibv_free_device_list(list);
	struct ibv_port_attr port;
	if (!s->ctx || ibv_query_port(s->ctx, 1, &port))
		return -2;
	s->lid = port.lid;
	s->pd = ibv_alloc_pd(s->ctx);
	s->buf = aligned_alloc(4096, BUF);
	if (!s->pd || !s->buf)
		return -3;
	memset(s->buf, 0, BUF);
	s->mr = ibv_reg_mr(s->pd, s->buf, BUF, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	s->cq = ibv_create_cq(s->ctx, 16, NULL, NULL, 0);
	if (!s->mr || !s->cq)
		return -4;
	struct ibv_qp_init_attr ia = { .send_cq = s->cq, .recv_cq = s->cq, .qp_type = IBV_QPT_RC,
				       .cap = { .max_send_wr = 8, .max_recv_wr = 8, .max_send_sge = 1,
						.max_recv_sge = 1 } };
	s->qp = ibv_create_qp(s->pd, &ia);
	return s->qp ? 0 : -5;
}

static void path(char *out, size_t n, const char *dir, const char *name)
{
	snprintf(out, n, "%s/%s", dir, name);
}

/* Writes <dir>/<name> atomically (a temporary file renamed into place). */
static int publish(const char *dir, const char *name, const char *text)
{
	char tmp[4096], final[4096];
	path(final, sizeof(final), dir, name);
	snprintf(tmp, sizeof(tmp), "%s.tmp", final);
	FILE *f = fopen(tmp, "w");
	if (!f)
		return -1;
	fputs(text, f);
	if (fclose(f))
		return -1;
	return rename(tmp, final);
}

/* Waits up to WAIT_MS for <dir>/<name>; reads its first line into line. */
static int await_file(const char *dir, const char *name, char *line, size_t n)
{
	char p[4096];
	path(p, sizeof(p), dir, name);
	double end = now_ns() + WAIT_MS * 1e6;
	while (now_ns() < end) {
		FILE *f = fopen(p, "r");
		if (f) {
			int ok = fgets(line, (int)n, f) != NULL;
			fclose(f);
			if (ok)
				return 0;
		}
		usleep(2000);
	}
	return -1;
}

/* Publishes our QP, reads the peer's, and connects to it. */
static int exchange_and_connect(struct side *s, const char *dir, const char *me, const char *peer)
{
	char text[64], name[64];
	snprintf(text, sizeof(text), "%u %u\n", s->qp->qp_num, (unsigned)s->lid);
	snprintf(name, sizeof(name), "%s.qpn", me);
	if (publish(dir, name, text))
		return -1;
	snprintf(name, sizeof(name), "%s.qpn", peer);
	if (await_file(dir, name, text, sizeof(text)))
		return -2;
	unsigned qpn, lid;
	if (sscanf(text, "%u %u", &qpn, &lid) != 2)
		return -3;
	return connect_rc(s->qp, qpn, (uint16_t)lid) ? -4 : 0;
}

static int post_recv_one(struct side *s, uint64_t id, uint32_t at)
{
	struct ibv_sge g = { (uintptr_t)s->buf + at, 64, s->mr->lkey };
	struct ibv_recv_wr w = { .wr_id = id, .sg_list = &g, .num_sge = 1 }, *bad = NULL;
	return ibv_post_recv(s->qp, &w, &bad);
}

static int post_send_one(struct side *s, uint64_t id)
{
	struct ibv_sge g = { (uintptr_t)s->buf, 16, s->mr->lkey };
	struct ibv_send_wr w = { .wr_id = id, .sg_list = &g, .num_sge = 1, .opcode = IBV_WR_SEND,
				 .send_flags = IBV_SEND_SIGNALED },
			   *bad = NULL;
	return ibv_post_send(s->qp, &w, &bad);
}

static int victim(const char *dir)
{
	struct side s;
	int r = open_side(&s);
	if (r) {
		fprintf(stderr, "victim: setup failed (%d), errno %d\n", r, errno);
		return 2;
	}
	r = exchange_and_connect(&s, dir, "victim", "survivor");
	if (r) {
		fprintf(stderr, "victim: connect failed (%d), errno %d\n", r, errno);
		return 3;
	}
	if (post_recv_one(&s, 1, 0)) {
		fprintf(stderr, "victim: post_recv failed\n");
		return 4;
	}
	if (publish(dir, "victim.connected", "connected\n"))
		return 6;
	struct ibv_wc wc;
	if (poll_n(s.cq, &wc, 1, WAIT_MS) != 1 || wc.status != IBV_WC_SUCCESS || wc.wr_id != 1 ||
	    strcmp(s.buf, "before the kill")) {
		fprintf(stderr, "victim: no message from the survivor\n");
		return 5;
	}
	if (publish(dir, "victim.ready", "ready\n"))
		return 7;
	printf("victim: ready\n");
	fflush(stdout);
	/* Holding the connected QP until the test kills us. */
	sleep(120);
	return 8;
}

static enum ibv_qp_state qp_state(struct ibv_qp *qp)
{
	struct ibv_qp_attr a;
	struct ibv_qp_init_attr i;
	if (ibv_query_qp(qp, &a, IBV_QP_STATE, &i))
		return (enum ibv_qp_state)-1;
	return a.qp_state;
}

static int survivor(const char *dir)
{
	struct side s;
	int r = open_side(&s);
	if (r) {
		fprintf(stderr, "survivor: setup failed (%d), errno %d\n", r, errno);
		return 2;
	}
	r = exchange_and_connect(&s, dir, "survivor", "victim");
	if (r) {
		fprintf(stderr, "survivor: connect failed (%d), errno %d\n", r, errno);
		return 3;
	}
	/* The connection works: one message to the victim, once its QP is
	 * ready to receive it. */
	char line[64];
	if (await_file(dir, "victim.connected", line, sizeof(line))) {
		fprintf(stderr, "survivor: the victim never connected\n");
		return 4;
	}
	strcpy(s.buf, "before the kill");
	struct ibv_wc wc[4];
	CHECK(post_send_one(&s, 10) == 0, "errno %d", errno);
	int n = poll_n(s.cq, wc, 1, WAIT_MS);
	CHECK(n == 1 && wc[0].wr_id == 10 && wc[0].status == IBV_WC_SUCCESS, "n=%d status=%s", n,
	      n == 1 ? ibv_wc_status_str(wc[0].status) : "-");
	/* Two receives left outstanding. */
	CHECK(post_recv_one(&s, 20, 1024) == 0 && post_recv_one(&s, 21, 2048) == 0, "post_recv");
	CHECK(qp_state(s.qp) == IBV_QPS_RTS, "state=%d", qp_state(s.qp));
	struct pollfd pf = { .fd = s.ctx->async_fd, .events = POLLIN };
	CHECK(poll(&pf, 1, 0) == 0, "async fd readable before the kill");
	if (failures || await_file(dir, "victim.ready", line, sizeof(line))) {
		fprintf(stderr, "survivor: the victim never got ready\n");
		return 4;
	}
	if (publish(dir, "survivor.ready", "ready\n"))
		return 5;
	printf("survivor: ready\n");
	fflush(stdout);

	/* The test SIGKILLs the victim now. Its QP's death reaches us as
	 * IBV_EVENT_QP_FATAL for our QP on the async fd. */
	int fatal = 0;
	for (int i = 0; i < 8 && !fatal; i++) {
		pf.revents = 0;
		if (poll(&pf, 1, WAIT_MS) != 1 || !(pf.revents & POLLIN))
			break;
		struct ibv_async_event ev;
		if (ibv_get_async_event(s.ctx, &ev))
			break;
		fatal = ev.event_type == IBV_EVENT_QP_FATAL && ev.element.qp == s.qp;
		if (!fatal)
			fprintf(stderr, "survivor: event %s\n", ibv_event_type_str(ev.event_type));
		ibv_ack_async_event(&ev);
	}
	CHECK(fatal, "no IBV_EVENT_QP_FATAL for the survivor's QP within %d ms", WAIT_MS);
	CHECK(qp_state(s.qp) == IBV_QPS_ERR, "state=%d", qp_state(s.qp));
	/* The outstanding receives flush. */
	n = poll_n(s.cq, wc, 2, WAIT_MS);
	CHECK(n == 2, "%d of the 2 outstanding receives completed", n);
	for (int i = 0; i < n; i++)
		CHECK(wc[i].wr_id == 20u + i && wc[i].status == IBV_WC_WR_FLUSH_ERR, "wr %llu: %s",
		      (unsigned long long)wc[i].wr_id, ibv_wc_status_str(wc[i].status));
	/* A send and a receive posted now are accepted and flush. */
	CHECK(post_send_one(&s, 30) == 0, "posting a send in ERR: errno %d", errno);
	n = poll_n(s.cq, wc, 1, WAIT_MS);
	CHECK(n == 1 && wc[0].wr_id == 30 && wc[0].status == IBV_WC_WR_FLUSH_ERR, "n=%d status=%s", n,
	      n == 1 ? ibv_wc_status_str(wc[0].status) : "-");
	CHECK(post_recv_one(&s, 31, 0) == 0, "posting a receive in ERR: errno %d", errno);
	n = poll_n(s.cq, wc, 1, WAIT_MS);
	CHECK(n == 1 && wc[0].wr_id == 31 && wc[0].status == IBV_WC_WR_FLUSH_ERR, "n=%d status=%s", n,
	      n == 1 ? ibv_wc_status_str(wc[0].status) : "-");
	CHECK(poll_n(s.cq, wc, 1, 50) == 0, "an extra completion");
	CHECK(qp_state(s.qp) == IBV_QPS_ERR, "state=%d", qp_state(s.qp));
	/* Everything is still destroyed cleanly. */
	CHECK(ibv_destroy_qp(s.qp) == 0 && ibv_destroy_cq(s.cq) == 0, "");
	CHECK(ibv_dereg_mr(s.mr) == 0 && ibv_dealloc_pd(s.pd) == 0, "");
	CHECK(ibv_close_device(s.ctx) == 0, "");
	free(s.buf);
	if (failures) {
		fprintf(stderr, "killed_peer_check: %d failures\n", failures);
		return 1;
	}
	printf("killed_peer_check: OK\n");
	return 0;
}

int main(int argc, char **argv)
{
	if (argc == 3 && !strcmp(argv[1], "victim"))
		return victim(argv[2]);
	if (argc == 3 && !strcmp(argv[1], "survivor"))
		return survivor(argv[2]);
	fprintf(stderr, "usage: %s victim|survivor <dir>\n", argv[0]);
	return 2;
}
