/*
 * The extended QP API, compiled against rdma-core's <infiniband/verbs.h> and
 * run against libvrdma_verbs.so (as libibverbs.so.1): ibv_create_qp_ex with
 * IBV_QP_INIT_ATTR_SEND_OPS_FLAGS, ibv_qp_to_qp_ex, and the ibv_wr_* builders
 * (send, send with immediate, inline data, RDMA write and read, atomics,
 * several requests in one batch, abort, latched errors) on a loopback RC QP
 * pair, checking the data moved and the completions; and ibv_create_cq_ex with
 * ibv_start_poll / ibv_next_poll / ibv_end_poll and the ibv_wc_read_* accessors.
 *
 * Exit status 0 and a last line "qp_ex_check: OK" mean every check passed.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common.h"

static struct ibv_qp *create(struct ibv_context *ctx, struct ibv_pd *pd, struct ibv_cq *cq,
			     uint64_t ops)
{
	struct ibv_qp_init_attr_ex a = {
		.send_cq = cq,
		.recv_cq = cq,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 2,
			 .max_recv_sge = 2, .max_inline_data = 64 },
		.qp_type = IBV_QPT_RC,
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
		.pd = pd,
		.send_ops_flags = ops,
	};
	struct ibv_qp *qp = ibv_create_qp_ex(ctx, &a);
	CHECK(qp != NULL, "errno=%d", errno);
	CHECK(!qp || a.cap.max_send_wr >= 16, "max_send_wr=%u", a.cap.max_send_wr);
	return qp;
}

static void post_recv(struct ibv_qp *qp, struct ibv_mr *mr, char *buf, uint32_t len, uint64_t id)
{
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = len, .lkey = mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = id, .sg_list = &sge, .num_sge = 1 }, *bad;
	CHECK(ibv_post_recv(qp, &wr, &bad) == 0, "");
}

/* Polls the extended CQ until it yields a completion (bounded): 0, or the
 * last result of ibv_start_poll. */
static int start_poll(struct ibv_cq_ex *cq)
{
	struct ibv_poll_cq_attr pa = { .comp_mask = 0 };
	double end = now_ns() + 5e9;
	int r;
	while ((r = ibv_start_poll(cq, &pa)) == ENOENT && now_ns() < end)
		;
	return r;
}

static void check_cq_ex(struct ibv_context *ctx, struct ibv_pd *pd, struct ibv_mr *mr,
			char *buf, uint16_t lid)
{
	uint64_t std_flags = IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_IMM | IBV_WC_EX_WITH_QP_NUM |
			     IBV_WC_EX_WITH_SRC_QP | IBV_WC_EX_WITH_SLID | IBV_WC_EX_WITH_SL |
			     IBV_WC_EX_WITH_DLID_PATH_BITS;
	struct ibv_cq_init_attr_ex ca = { .cqe = 32, .wc_flags = std_flags };
	struct ibv_cq_ex *cqx = ibv_create_cq_ex(ctx, &ca);
	CHECK(cqx != NULL, "errno=%d", errno);
	/* Only the byte count: the other accessors are absent. */
	struct ibv_cq_init_attr_ex ca2 = { .cqe = 4, .wc_flags = IBV_WC_EX_WITH_BYTE_LEN,
					   .comp_mask = IBV_CQ_INIT_ATTR_MASK_FLAGS,
					   .flags = IBV_CREATE_CQ_ATTR_SINGLE_THREADED };
	struct ibv_cq_ex *small = ibv_create_cq_ex(ctx, &ca2);
	CHECK(small && small->read_byte_len && !small->read_imm_data && !small->read_qp_num &&
		      small->read_opcode && small->read_wc_flags,
	      "errno=%d", errno);
	struct ibv_cq_init_attr_ex bad = { .cqe = 4,
					   .wc_flags = IBV_WC_EX_WITH_COMPLETION_TIMESTAMP };
	errno = 0;
	CHECK(ibv_create_cq_ex(ctx, &bad) == NULL && errno == EOPNOTSUPP, "errno=%d", errno);
	if (!cqx || !small)
		return;
	struct ibv_poll_cq_attr pa = { .comp_mask = 0 };
	CHECK(ibv_start_poll(small, &pa) == ENOENT, "an empty CQ");
	CHECK(ibv_start_poll(cqx, &pa) == ENOENT, "an empty CQ");

	struct ibv_cq *cq = ibv_cq_ex_to_cq(cqx);
	uint64_t ops = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM | IBV_QP_EX_WITH_RDMA_WRITE;
	struct ibv_qp *a = create(ctx, pd, cq, ops), *b = create(ctx, pd, cq, ops);
	if (!a || !b)
		return;
	CHECK(connect_rc(a, b->qp_num, lid) == 0, "");
	CHECK(connect_rc(b, a->qp_num, lid) == 0, "");
	char *src = buf + 8192, *dst = buf + 8192 + 1024;
	strcpy(src, "through the extended CQ");
	post_recv(b, mr, dst, 256, 201);
	struct ibv_qp_ex *x = ibv_qp_to_qp_ex(a);
	ibv_wr_start(x);
	x->wr_id = 200;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send_imm(x, htonl(0x1234));
	ibv_wr_set_sge(x, mr->lkey, (uintptr_t)src, 24);
	x->wr_id = 199;
	ibv_wr_rdma_write(x, mr->rkey, (uintptr_t)(dst + 512));
	ibv_wr_set_sge(x, mr->lkey, (uintptr_t)src, 24);
	CHECK(ibv_wr_complete(x) == 0, "");

	int seen = 0, n = 0;
	int r = start_poll(cqx);
	CHECK(r == 0, "start_poll=%d", r);
	while (r == 0 && n < 10) {
		n++;
		CHECK(cqx->status == IBV_WC_SUCCESS, "status=%d", cqx->status);
		enum ibv_wc_opcode op = ibv_wc_read_opcode(cqx);
		uint32_t qpn = ibv_wc_read_qp_num(cqx);
		CHECK(ibv_wc_read_vendor_err(cqx) == 0, "");
		CHECK(ibv_wc_read_dlid_path_bits(cqx) == 0, "");
		(void)ibv_wc_read_sl(cqx);
		switch (cqx->wr_id) {
		case 200:
			seen |= 1;
			CHECK(op == IBV_WC_SEND && qpn == a->qp_num, "op=%d qpn=%u", op, qpn);
			break;
		case 199:
			seen |= 2;
			CHECK(op == IBV_WC_RDMA_WRITE && qpn == a->qp_num, "op=%d qpn=%u", op, qpn);
			break;
		case 201:
			seen |= 4;
			CHECK(op == IBV_WC_RECV && qpn == b->qp_num, "op=%d qpn=%u", op, qpn);
			CHECK(ibv_wc_read_byte_len(cqx) == 24, "len=%u", ibv_wc_read_byte_len(cqx));
			CHECK(ibv_wc_read_wc_flags(cqx) & IBV_WC_WITH_IMM, "");
			CHECK(ibv_wc_read_imm_data(cqx) == htonl(0x1234), "");
			CHECK(ibv_wc_read_src_qp(cqx) == a->qp_num, "src_qp=%u", ibv_wc_read_src_qp(cqx));
			CHECK(ibv_wc_read_slid(cqx) == lid, "slid=%u", ibv_wc_read_slid(cqx));
			break;
		default:
			CHECK(0, "wr_id=%llu", (unsigned long long)cqx->wr_id);
		}
		if (seen == 7)
			break;
		double end = now_ns() + 5e9;
		while ((r = ibv_next_poll(cqx)) == ENOENT && now_ns() < end)
			;
	}
	if (r == 0)
		ibv_end_poll(cqx);
	CHECK(seen == 7, "seen=%x", seen);
	CHECK(!strcmp(dst, "through the extended CQ") && !strcmp(dst + 512, src), "%s", dst);
	/* A CQ from ibv_create_cq_ex also answers ibv_poll_cq. */
	post_recv(b, mr, dst, 256, 202);
	ibv_wr_start(x);
	x->wr_id = 203;
	x->wr_flags = 0;
	ibv_wr_send(x);
	ibv_wr_set_inline_data(x, "x", 2);
	CHECK(ibv_wr_complete(x) == 0, "");
	struct ibv_wc wc;
	CHECK(poll_n(cq, &wc, 1, 5000) == 1 && wc.wr_id == 202 && wc.byte_len == 2, "");

	CHECK(ibv_destroy_qp(a) == 0, "");
	CHECK(ibv_destroy_qp(b) == 0, "");
	CHECK(ibv_destroy_cq(cq) == 0, "");
	CHECK(ibv_destroy_cq(ibv_cq_ex_to_cq(small)) == 0, "");
}

int main(void)
{
	int num;
	struct ibv_device **list = ibv_get_device_list(&num);
	CHECK(list && num == 1, "num=%d", num);
	if (!list || num < 1)
		return 1;
	struct ibv_context *ctx = ibv_open_device(list[0]);
	ibv_free_device_list(list);
	CHECK(ctx != NULL, "errno=%d", errno);
	if (!ctx)
		return 1;
	struct ibv_port_attr port;
	CHECK(ibv_query_port(ctx, 1, &port) == 0, "");
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	CHECK(pd != NULL, "");
	size_t len = 16384;
	char *buf = aligned_alloc(4096, len);
	memset(buf, 0, len);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, len,
				       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
					       IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC);
	CHECK(mr != NULL, "errno=%d", errno);
	struct ibv_cq *cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	CHECK(cq != NULL, "");
	if (!pd || !mr || !cq)
		return 1;

	uint64_t all = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM |
		       IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM |
		       IBV_QP_EX_WITH_RDMA_READ | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP |
		       IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD;
	/* Operations vRDMA does not have are refused at creation. */
	struct ibv_qp_init_attr_ex bad_attr = {
		.send_cq = cq, .recv_cq = cq, .cap = { .max_send_wr = 1, .max_recv_wr = 1 },
		.qp_type = IBV_QPT_RC,
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
		.pd = pd, .send_ops_flags = IBV_QP_EX_WITH_BIND_MW,
	};
	errno = 0;
	CHECK(ibv_create_qp_ex(ctx, &bad_attr) == NULL && errno == EOPNOTSUPP, "errno=%d", errno);

	struct ibv_qp *a = create(ctx, pd, cq, all);
	struct ibv_qp *b = create(ctx, pd, cq, all);
	/* Only sends: the other builders are absent (NULL), as in rdma-core. */
	struct ibv_qp *s = create(ctx, pd, cq, IBV_QP_EX_WITH_SEND);
	if (!a || !b || !s)
		return 1;
	struct ibv_qp_ex *x = ibv_qp_to_qp_ex(a);
	CHECK(x != NULL && &x->qp_base == a, "");
	struct ibv_qp_ex *sx = ibv_qp_to_qp_ex(s);
	CHECK(sx && sx->wr_send && !sx->wr_rdma_read && !sx->wr_atomic_fetch_add, "");
	if (!x)
		return 1;
	CHECK(connect_rc(a, b->qp_num, port.lid) == 0, "");
	CHECK(connect_rc(b, a->qp_num, port.lid) == 0, "");

	/* Layout of buf: [0,4096) a's side, [4096,8192) b's side. */
	char *la = buf, *lb = buf + 4096;
	struct ibv_wc wc[8];

	/* Send, send with immediate (inline), in one batch. */
	post_recv(b, mr, lb, 256, 101);
	post_recv(b, mr, lb + 256, 256, 102);
	strcpy(la, "hello through ibv_wr_send");
	ibv_wr_start(x);
	x->wr_id = 1;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send(x);
	ibv_wr_set_sge(x, mr->lkey, (uintptr_t)la, 26);
	x->wr_id = 2;
	ibv_wr_send_imm(x, htonl(0xabcd));
	struct ibv_data_buf parts[2] = { { "inline ", 7 }, { "list", 5 } };
	ibv_wr_set_inline_data_list(x, 2, parts);
	CHECK(ibv_wr_complete(x) == 0, "");
	int n = poll_n(cq, wc, 4, 5000);
	CHECK(n == 4, "n=%d", n);
	int seen = 0;
	for (int i = 0; i < n; i++) {
		CHECK(wc[i].status == IBV_WC_SUCCESS, "wr_id=%llu status=%d",
		      (unsigned long long)wc[i].wr_id, wc[i].status);
		switch (wc[i].wr_id) {
		case 1:
		case 2:
			seen |= (int)wc[i].wr_id;
			CHECK(wc[i].opcode == IBV_WC_SEND, "opcode=%d", wc[i].opcode);
			break;
		case 101:
			seen |= 4;
			CHECK(wc[i].opcode == IBV_WC_RECV && wc[i].byte_len == 26 &&
				      !(wc[i].wc_flags & IBV_WC_WITH_IMM),
			      "opcode=%d len=%u", wc[i].opcode, wc[i].byte_len);
			break;
		case 102:
			seen |= 8;
			CHECK(wc[i].opcode == IBV_WC_RECV && wc[i].byte_len == 12 &&
				      (wc[i].wc_flags & IBV_WC_WITH_IMM) && wc[i].imm_data == htonl(0xabcd),
			      "opcode=%d len=%u", wc[i].opcode, wc[i].byte_len);
			break;
		}
	}
	CHECK(seen == 15, "seen=%x", seen);
	CHECK(!strcmp(lb, "hello through ibv_wr_send"), "%s", lb);
	CHECK(!strcmp(lb + 256, "inline list"), "%s", lb + 256);

	/* RDMA write (inline), then write with immediate, then read back. */
	post_recv(b, mr, lb + 512, 16, 103);
	ibv_wr_start(x);
	x->wr_id = 3;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(x, mr->rkey, (uintptr_t)(lb + 1024));
	ibv_wr_set_inline_data(x, "written inline", 15);
	x->wr_id = 4;
	strcpy(la + 1024, "written with imm");
	ibv_wr_rdma_write_imm(x, mr->rkey, (uintptr_t)(lb + 2048), htonl(7));
	struct ibv_sge two[2] = { { (uintptr_t)la + 1024, 8, mr->lkey },
				  { (uintptr_t)la + 1032, 9, mr->lkey } };
	ibv_wr_set_sge_list(x, 2, two);
	CHECK(ibv_wr_complete(x) == 0, "");
	n = poll_n(cq, wc, 3, 5000);
	CHECK(n == 3, "n=%d", n);
	for (int i = 0; i < n; i++) {
		CHECK(wc[i].status == IBV_WC_SUCCESS, "status=%d", wc[i].status);
		if (wc[i].wr_id == 3 || wc[i].wr_id == 4)
			CHECK(wc[i].opcode == IBV_WC_RDMA_WRITE, "opcode=%d", wc[i].opcode);
		if (wc[i].wr_id == 103)
			CHECK(wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM &&
				      wc[i].imm_data == htonl(7),
			      "opcode=%d", wc[i].opcode);
	}
	CHECK(!strcmp(lb + 1024, "written inline"), "%s", lb + 1024);
	CHECK(!strcmp(lb + 2048, "written with imm"), "%s", lb + 2048);

	strcpy(lb + 3000, "read me back");
	ibv_wr_start(x);
	x->wr_id = 5;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_read(x, mr->rkey, (uintptr_t)(lb + 3000));
	ibv_wr_set_sge(x, mr->lkey, (uintptr_t)(la + 3000), 13);
	CHECK(ibv_wr_complete(x) == 0, "");
	n = poll_n(cq, wc, 1, 5000);
	CHECK(n == 1 && wc[0].status == IBV_WC_SUCCESS && wc[0].wr_id == 5 &&
		      wc[0].opcode == IBV_WC_RDMA_READ && wc[0].byte_len == 13,
	      "n=%d", n);
	CHECK(!strcmp(la + 3000, "read me back"), "%s", la + 3000);

	/* Atomics on b's memory: compare-and-swap, then fetch-and-add. */
	uint64_t *target = (uint64_t *)(lb + 3584), *old1 = (uint64_t *)(la + 3584),
		 *old2 = (uint64_t *)(la + 3592);
	*target = 40;
	ibv_wr_start(x);
	x->wr_id = 6;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_atomic_cmp_swp(x, mr->rkey, (uintptr_t)target, 40, 100);
	ibv_wr_set_sge(x, mr->lkey, (uintptr_t)old1, 8);
	x->wr_id = 7;
	ibv_wr_atomic_fetch_add(x, mr->rkey, (uintptr_t)target, 5);
	ibv_wr_set_sge(x, mr->lkey, (uintptr_t)old2, 8);
	CHECK(ibv_wr_complete(x) == 0, "");
	n = poll_n(cq, wc, 2, 5000);
	CHECK(n == 2, "n=%d", n);
	for (int i = 0; i < n; i++)
		CHECK(wc[i].status == IBV_WC_SUCCESS &&
			      (wc[i].opcode == IBV_WC_COMP_SWAP || wc[i].opcode == IBV_WC_FETCH_ADD),
		      "status=%d opcode=%d", wc[i].status, wc[i].opcode);
	CHECK(*old1 == 40 && *old2 == 100 && *target == 105, "old1=%llu old2=%llu target=%llu",
	      (unsigned long long)*old1, (unsigned long long)*old2, (unsigned long long)*target);

	/* Abort: nothing is posted. */
	ibv_wr_start(x);
	x->wr_id = 8;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(x, mr->rkey, (uintptr_t)(lb + 3800));
	ibv_wr_set_inline_data(x, "aborted", 8);
	ibv_wr_abort(x);
	CHECK(poll_n(cq, wc, 1, 100) == 0, "a completion after abort");
	CHECK(lb[3800] == 0, "aborted write landed");

	/* Errors are kept until ibv_wr_complete, which then posts nothing. */
	ibv_wr_start(x);
	ibv_wr_set_sge(x, mr->lkey, (uintptr_t)la, 8); /* no request yet */
	CHECK(ibv_wr_complete(x) == EINVAL, "");
	ibv_wr_start(x);
	x->wr_id = 9;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(x, mr->rkey, (uintptr_t)(lb + 3800));
	ibv_wr_set_inline_data(x, "first", 6);
	char big[4096] = { 0 };
	ibv_wr_rdma_write(x, mr->rkey, (uintptr_t)(lb + 3900));
	ibv_wr_set_inline_data(x, big, sizeof(big)); /* more than max inline */
	CHECK(ibv_wr_complete(x) == EINVAL, "");
	CHECK(poll_n(cq, wc, 1, 100) == 0, "a completion of a failed batch");
	CHECK(lb[3800] == 0, "a write of a failed batch landed");
	/* More requests than the queue holds. */
	ibv_wr_start(x);
	x->wr_flags = 0;
	for (int i = 0; i < 64; i++) {
		ibv_wr_rdma_write(x, mr->rkey, (uintptr_t)(lb + 3800));
		ibv_wr_set_sge(x, mr->lkey, (uintptr_t)la, 0);
	}
	CHECK(ibv_wr_complete(x) == ENOMEM, "");
	/* The QP still works after all that. */
	ibv_wr_start(x);
	x->wr_id = 10;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(x, mr->rkey, (uintptr_t)(lb + 3800));
	ibv_wr_set_inline_data(x, "after", 6);
	CHECK(ibv_wr_complete(x) == 0, "");
	n = poll_n(cq, wc, 1, 5000);
	CHECK(n == 1 && wc[0].wr_id == 10 && wc[0].status == IBV_WC_SUCCESS, "n=%d", n);
	CHECK(!strcmp(lb + 3800, "after"), "%s", lb + 3800);

	check_cq_ex(ctx, pd, mr, buf, port.lid);

	CHECK(ibv_destroy_qp(s) == 0, "");
	CHECK(ibv_destroy_qp(a) == 0, "");
	CHECK(ibv_destroy_qp(b) == 0, "");
	CHECK(ibv_destroy_cq(cq) == 0, "");
	CHECK(ibv_dereg_mr(mr) == 0, "");
	CHECK(ibv_dealloc_pd(pd) == 0, "");
	CHECK(ibv_close_device(ctx) == 0, "");
	free(buf);
	if (failures) {
		fprintf(stderr, "qp_ex_check: %d failures\n", failures);
		return 1;
	}
	printf("qp_ex_check: OK\n");
	return 0;
}
