/* Helpers shared by the C tests of the drop-in libibverbs.so.1. */
#ifndef VRDMA_TEST_COMMON_H
#define VRDMA_TEST_COMMON_H

#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static int failures;

#define CHECK(cond, ...)                                                       \
	do {                                                                   \
		if (!(cond)) {                                                 \
			fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, \
				#cond);                                        \
			fprintf(stderr, __VA_ARGS__);                          \
			fprintf(stderr, "\n");                                 \
			failures++;                                            \
		}                                                              \
	} while (0)

static double now_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e9 + t.tv_nsec;
}

/* Polls until n completions arrived or the deadline (ms) passed. */
static int poll_n(struct ibv_cq *cq, struct ibv_wc *wc, int n, double ms)
{
	int got = 0;
	double end = now_ns() + ms * 1e6;
	while (got < n && now_ns() < end) {
		int r = ibv_poll_cq(cq, n - got, wc + got);
		if (r < 0)
			return r;
		got += r;
	}
	return got;
}

/* RESET -> INIT -> RTR -> RTS, connected to dest_qpn at dlid. */
static int connect_rc(struct ibv_qp *qp, uint32_t dest_qpn, uint16_t dlid)
{
	struct ibv_qp_attr a = {
		.qp_state = IBV_QPS_INIT,
		.pkey_index = 0,
		.port_num = 1,
		.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
				   IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC,
	};
	int r = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
					    IBV_QP_ACCESS_FLAGS);
	if (r)
		return r;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_1024;
	a.dest_qp_num = dest_qpn;
	a.max_dest_rd_atomic = 1;
	a.min_rnr_timer = 12;
	a.ah_attr.dlid = dlid;
	a.ah_attr.port_num = 1;
	r = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
				      IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
				      IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
	if (r)
		return r;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.max_rd_atomic = 1;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT |
					     IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
					     IBV_QP_MAX_QP_RD_ATOMIC);
}

#endif
