/*
 * A verbs program of our own, compiled against rdma-core's <infiniband/verbs.h>
 * and run against libvrdma_verbs.so (as libibverbs.so.1). It covers what the
 * ibverbs-utils examples do not: error paths and their errno values, bad_wr
 * reporting, inline data, RDMA read, atomics, non-blocking completion events,
 * async-event plumbing, and EBUSY on destroying objects in use. With an
 * argument "bench" it also prints the cost of the posting path.
 *
 * Exit status 0 and a last line "verbs_check: OK" mean every check passed.
 */
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common.h"

/* Sends one datagram of len bytes from buf to the QP qpn through ah and
 * returns the receive's completion in *rwc (0 on success). */
static int ud_send_one(struct ibv_qp *qp, struct ibv_cq *cq, struct ibv_mr *mr, char *buf,
		       struct ibv_ah *ah, uint32_t qpn, uint32_t len, struct ibv_wc *rwc)
{
	struct ibv_sge rs = { .addr = (uintptr_t)buf + 1024, .length = 40 + len, .lkey = mr->lkey };
	struct ibv_recv_wr rw = { .wr_id = 2, .sg_list = &rs, .num_sge = 1 }, *rbad;
	struct ibv_sge ss = { .addr = (uintptr_t)buf, .length = len, .lkey = mr->lkey };
	struct ibv_send_wr sw = { .wr_id = 1, .sg_list = &ss, .num_sge = 1, .opcode = IBV_WR_SEND,
				  .send_flags = IBV_SEND_SIGNALED }, *sbad;
	sw.wr.ud.ah = ah;
	sw.wr.ud.remote_qpn = qpn;
	sw.wr.ud.remote_qkey = 0x11111111;
	struct ibv_wc wc[2];
	if (ibv_post_recv(qp, &rw, &rbad) || ibv_post_send(qp, &sw, &sbad))
		return -1;
	if (poll_n(cq, wc, 2, 10000) != 2)
		return -2;
	for (int i = 0; i < 2; i++) {
		if (wc[i].status != IBV_WC_SUCCESS)
			return -3;
		if (wc[i].wr_id == 2)
			*rwc = wc[i];
	}
	return 0;
}

/* A UD QP sending datagrams to itself: LID-routed and global address
 * handles, the completion's source fields and GRH flag, the GRH in the
 * buffer, ibv_init_ah_from_wc / ibv_create_ah_from_wc, Q_Key in
 * ibv_query_qp, and the kernel-structure copies librdmacm uses. */
static void check_ud(struct ibv_context *ctx, struct ibv_pd *pd)
{
	struct ibv_port_attr port;
	union ibv_gid gid;
	CHECK(ibv_query_port(ctx, 1, &port) == 0 && ibv_query_gid(ctx, 1, 0, &gid) == 0, "");
	char *buf = calloc(1, 4096);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	struct ibv_qp_init_attr init = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_UD,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	struct ibv_qp *qp = ibv_create_qp(pd, &init);
	CHECK(mr && cq && qp && qp->qp_type == IBV_QPT_UD, "errno=%d", errno);
	if (!mr || !cq || !qp)
		return;
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1, .qkey = 0x11111111 };
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY) == 0, "");
	a.qp_state = IBV_QPS_RTR;
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE) == 0, "");
	a.qp_state = IBV_QPS_RTS;
	a.sq_psn = 7;
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN) == 0, "");
	struct ibv_qp_init_attr qi;
	memset(&a, 0, sizeof(a));
	CHECK(ibv_query_qp(qp, &a, IBV_QP_STATE | IBV_QP_QKEY, &qi) == 0 && a.qkey == 0x11111111 &&
		      a.qp_state == IBV_QPS_RTS && qi.qp_type == IBV_QPT_UD, "qkey=%x", a.qkey);

	/* A send without an address handle is refused when posted. */
	struct ibv_sge ss = { .addr = (uintptr_t)buf, .length = 8, .lkey = mr->lkey };
	struct ibv_send_wr sw = { .wr_id = 9, .sg_list = &ss, .num_sge = 1, .opcode = IBV_WR_SEND }, *sbad = NULL;
	CHECK(ibv_post_send(qp, &sw, &sbad) == EINVAL && sbad == &sw, "");

	/* LID-routed: no GRH. */
	struct ibv_ah_attr aa = { .dlid = port.lid, .sl = 5, .port_num = 1 };
	struct ibv_ah *ah = ibv_create_ah(pd, &aa);
	CHECK(ah && ah->pd == pd && ah->context == ctx, "errno=%d", errno);
	CHECK(ibv_dealloc_pd(pd) == EBUSY, "PD with an AH");
	memcpy(buf, "datagram", 8);
	struct ibv_wc wc;
	CHECK(ah && ud_send_one(qp, cq, mr, buf, ah, qp->qp_num, 8, &wc) == 0, "");
	CHECK(wc.byte_len == 48 && wc.src_qp == qp->qp_num && wc.slid == port.lid && wc.sl == 5 &&
		      !(wc.wc_flags & IBV_WC_GRH) && memcmp(buf + 1024 + 40, "datagram", 8) == 0,
	      "len=%u src=%u slid=%u sl=%u flags=%x", wc.byte_len, wc.src_qp, wc.slid, wc.sl, wc.wc_flags);
	struct ibv_ah_attr back;
	CHECK(ibv_init_ah_from_wc(ctx, 1, &wc, (struct ibv_grh *)(buf + 1024), &back) == 0 &&
		      back.dlid == port.lid && back.sl == 5 && !back.is_global && back.port_num == 1, "");
	struct ibv_ah *reply = ibv_create_ah_from_wc(pd, &wc, (struct ibv_grh *)(buf + 1024), 1);
	CHECK(reply != NULL, "errno=%d", errno);
	CHECK(reply && ud_send_one(qp, cq, mr, buf, reply, qp->qp_num, 8, &wc) == 0, "");
	CHECK(reply && ibv_destroy_ah(reply) == 0, "");
	CHECK(ah && ibv_destroy_ah(ah) == 0, "");

	/* Global: the receiver finds a GRH and answers it. */
	struct ibv_ah_attr ga = { .is_global = 1, .dlid = port.lid, .port_num = 1 };
	ga.grh.dgid = gid;
	ga.grh.hop_limit = 64;
	ga.grh.traffic_class = 0x20;
	ga.grh.flow_label = 0x12345;
	ah = ibv_create_ah(pd, &ga);
	CHECK(ah != NULL, "errno=%d", errno);
	memset(buf + 1024, 0, 64);
	CHECK(ah && ud_send_one(qp, cq, mr, buf, ah, qp->qp_num, 8, &wc) == 0, "");
	struct ibv_grh *grh = (struct ibv_grh *)(buf + 1024);
	CHECK((wc.wc_flags & IBV_WC_GRH) && memcmp(&grh->sgid, &gid, 16) == 0 &&
		      memcmp(&grh->dgid, &gid, 16) == 0, "flags=%x", wc.wc_flags);
	memset(&back, 0xee, sizeof(back));
	CHECK(ibv_init_ah_from_wc(ctx, 1, &wc, grh, &back) == 0 && back.is_global &&
		      memcmp(&back.grh.dgid, &gid, 16) == 0 && back.grh.sgid_index == 0 &&
		      back.grh.flow_label == 0x12345 && back.grh.traffic_class == 0x20 &&
		      back.grh.hop_limit == 64 && back.dlid == port.lid,
	      "global=%d idx=%d fl=%x tc=%x hl=%d", back.is_global, back.grh.sgid_index,
	      back.grh.flow_label, back.grh.traffic_class, back.grh.hop_limit);
	reply = ibv_create_ah_from_wc(pd, &wc, grh, 1);
	CHECK(reply && ud_send_one(qp, cq, mr, buf, reply, qp->qp_num, 8, &wc) == 0 &&
		      (wc.wc_flags & IBV_WC_GRH), "");
	if (reply)
		ibv_destroy_ah(reply);
	/* A GRH naming a GID this port does not have: no SGID index. */
	grh->dgid.raw[15] ^= 0xff;
	errno = 0;
	CHECK(ibv_init_ah_from_wc(ctx, 1, &wc, grh, &back) == -1 && errno != 0, "errno=%d", errno);
	CHECK(ah && ibv_destroy_ah(ah) == 0, "");

	/* The kernel-ABI copies librdmacm calls. */
	struct ib_uverbs_ah_attr_like {
		uint8_t dgid[16];
		uint32_t flow_label;
		uint8_t sgid_index, hop_limit, traffic_class, reserved;
		uint16_t dlid;
		uint8_t sl, src_path_bits, static_rate, is_global, port_num, reserved2;
	} k = { .flow_label = 7, .sgid_index = 1, .hop_limit = 2, .dlid = 0x33, .sl = 4, .is_global = 1,
		.port_num = 1 };
	k.dgid[0] = 0xfe;
	extern void ibv_copy_ah_attr_from_kern(struct ibv_ah_attr *, void *);
	memset(&back, 0, sizeof(back));
	ibv_copy_ah_attr_from_kern(&back, &k);
	CHECK(back.grh.dgid.raw[0] == 0xfe && back.grh.flow_label == 7 && back.grh.sgid_index == 1 &&
		      back.grh.hop_limit == 2 && back.dlid == 0x33 && back.sl == 4 && back.is_global &&
		      back.port_num == 1, "");

	CHECK(ibv_destroy_qp(qp) == 0 && ibv_destroy_cq(cq) == 0 && ibv_dereg_mr(mr) == 0, "");
	free(buf);
}

int main(int argc, char **argv)
{
	int bench = argc > 1 && !strcmp(argv[1], "bench");
	int num;
	struct ibv_device **list = ibv_get_device_list(&num);
	CHECK(list && num == 1, "num=%d", num);
	if (!list || num < 1)
		return 1;
	CHECK(!strcmp(ibv_get_device_name(list[0]), "vrdma0"), "%s", ibv_get_device_name(list[0]));

	/* NULL and foreign pointers are refused, not dereferenced. */
	errno = 0;
	CHECK(ibv_open_device(NULL) == NULL && errno == EINVAL, "errno=%d", errno);
	errno = 0;
	CHECK(ibv_alloc_pd(NULL) == NULL && errno == EINVAL, "errno=%d", errno);
	CHECK(ibv_dealloc_pd(NULL) == EINVAL, "");
	CHECK(ibv_get_device_name(NULL) == NULL, "");
	CHECK(ibv_is_fork_initialized() == IBV_FORK_UNNEEDED, "");
	CHECK(ibv_fork_init() == 0, "");

	struct ibv_context *ctx = ibv_open_device(list[0]);
	CHECK(ctx != NULL, "errno=%d", errno);
	if (!ctx)
		return 1;
	ibv_free_device_list(list);

	struct ibv_port_attr port;
	CHECK(ibv_query_port(ctx, 1, &port) == 0, "");
	CHECK(port.state == IBV_PORT_ACTIVE && port.lid != 0, "state=%d lid=%d", port.state, port.lid);
	CHECK(ibv_query_port(ctx, 9, &port) != 0, "port 9 exists?");
	union ibv_gid gid;
	CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0, "");
	errno = 0;
	CHECK(ibv_query_gid(ctx, 1, 5, &gid) == -1 && errno != 0, "errno=%d", errno);
	__be16 pkey;
	CHECK(ibv_query_pkey(ctx, 1, 0, &pkey) == 0 && pkey == 0xffff, "");
	CHECK(ibv_get_pkey_index(ctx, 1, 0xffff) == 0, "");
	struct ibv_gid_entry entry;
	CHECK(ibv_query_gid_ex(ctx, 1, 0, &entry, 0) == 0 && entry.gid_type == IBV_GID_TYPE_IB, "");
	struct ibv_device_attr_ex dx;
	CHECK(ibv_query_device_ex(ctx, NULL, &dx) == 0 && dx.orig_attr.phys_port_cnt == 1, "");

	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	CHECK(pd != NULL, "errno=%d", errno);
	size_t len = 8192;
	char *buf = aligned_alloc(4096, len);
	memset(buf, 0, len);
	int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
		     IBV_ACCESS_REMOTE_ATOMIC;
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, len, access);
	CHECK(mr != NULL && mr->lkey == mr->rkey && mr->addr == buf && mr->length == len, "errno=%d", errno);
	errno = 0;
	CHECK(ibv_reg_mr_iova2(pd, buf, 64, 0x1000, access) == NULL && errno == EOPNOTSUPP, "errno=%d", errno);
	errno = 0;
	CHECK(ibv_reg_mr(pd, buf, 64, IBV_ACCESS_REMOTE_WRITE) == NULL && errno == EINVAL, "errno=%d", errno);
	errno = 0;
	CHECK(ibv_reg_mr(pd, buf, 64, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_ZERO_BASED) == NULL &&
		      errno == EOPNOTSUPP, "errno=%d", errno);
	/* Not supported, and the region stays as it was. */
	errno = 0;
	CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0, IBV_ACCESS_LOCAL_WRITE) ==
			      IBV_REREG_MR_ERR_CMD && errno == EOPNOTSUPP, "errno=%d", errno);
	CHECK(mr->lkey == mr->rkey && mr->addr == buf && mr->length == len, "");
	/* A forked child gets its own copy of registered memory: its writes
	 * stay out of the parent's buffer. */
	buf[0] = 'P';
	pid_t child = fork();
	if (child == 0) {
		buf[0] = 'C';
		_exit(buf[0] == 'C' ? 0 : 1);
	}
	int wstatus = -1;
	CHECK(child > 0 && waitpid(child, &wstatus, 0) == child && WIFEXITED(wstatus) &&
		      WEXITSTATUS(wstatus) == 0, "status=%x", wstatus);
	CHECK(buf[0] == 'P', "the child's write reached the parent: %c", buf[0]);
	errno = 0;
	CHECK(ibv_import_pd(ctx, pd->handle) == NULL && errno == EOPNOTSUPP, "errno=%d", errno);
	errno = 0;
	CHECK(ibv_import_mr(pd, mr->handle) == NULL && errno == EOPNOTSUPP, "errno=%d", errno);

	/* A queue above what the device shows is an invalid argument, as on
	 * hardware (programs probing for the largest queue read EINVAL), and
	 * the command descriptor is a valid one, as programs check. */
	struct ibv_device_attr da;
	CHECK(ibv_query_device(ctx, &da) == 0, "");
	errno = 0;
	CHECK(ibv_create_cq(ctx, da.max_cqe + 1, NULL, NULL, 0) == NULL && errno == EINVAL, "errno=%d", errno);
	struct ibv_cq *deepest = ibv_create_cq(ctx, da.max_cqe, NULL, NULL, 0);
	CHECK(deepest != NULL && ibv_destroy_cq(deepest) == 0, "errno=%d", errno);
	CHECK(ctx->cmd_fd >= 0 && fcntl(ctx->cmd_fd, F_GETFD) >= 0, "cmd_fd=%d", ctx->cmd_fd);
	errno = 0;
	CHECK(ibv_create_cq(ctx, 0, NULL, NULL, 0) == NULL && errno == EINVAL, "errno=%d", errno);
	errno = 0;
	CHECK(ibv_create_cq(ctx, 16, NULL, NULL, 1) == NULL && errno == EINVAL, "errno=%d", errno);
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	CHECK(ch != NULL && ch->fd >= 0, "");
	struct ibv_cq *cq = ibv_create_cq(ctx, 64, (void *)0x1234, ch, 0);
	CHECK(cq != NULL && cq->cqe >= 64 && cq->channel == ch, "");
	CHECK(ibv_destroy_comp_channel(ch) == EBUSY, "channel in use");
	CHECK(ibv_resize_cq(cq, 128) == EOPNOTSUPP, "");

	struct ibv_qp_init_attr init = {
		.send_cq = cq,
		.recv_cq = cq,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 2,
			 .max_recv_sge = 2, .max_inline_data = 64 },
		.qp_type = IBV_QPT_RC,
	};
	struct ibv_qp *qp = ibv_create_qp(pd, &init);
	CHECK(qp != NULL && init.cap.max_inline_data >= 64 && qp->state == IBV_QPS_RESET, "errno=%d", errno);
	CHECK(ibv_qp_to_qp_ex(qp) == NULL && errno == EOPNOTSUPP, "");
	CHECK(ibv_dealloc_pd(pd) == EBUSY, "PD in use");
	CHECK(ibv_destroy_cq(cq) == EBUSY, "CQ in use");
	check_ud(ctx, pd);

	/* Posting to a QP in RESET: EINVAL, bad_wr is the first request. */
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = 8, .lkey = mr->lkey };
	struct ibv_send_wr wr = { .wr_id = 1, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND };
	struct ibv_send_wr *bad = NULL;
	CHECK(ibv_post_send(qp, &wr, &bad) == EINVAL && bad == &wr, "");

	CHECK(connect_rc(qp, qp->qp_num, port.lid) == 0, "to_rts");
	CHECK(qp->state == IBV_QPS_RTS, "state %d", qp->state);
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qi;
	CHECK(ibv_query_qp(qp, &qa, IBV_QP_STATE | IBV_QP_CAP, &qi) == 0 && qa.qp_state == IBV_QPS_RTS &&
		      qi.send_cq == cq && qi.cap.max_inline_data >= 64 && qa.dest_qp_num == qp->qp_num,
	      "");

	/* A chain: write, inline send, then a malformed request. */
	strcpy(buf, "hello, write");
	char inline_src[32] = "inline bytes!";
	struct ibv_recv_wr rwr = { .wr_id = 100, .sg_list = &(struct ibv_sge){ .addr = (uintptr_t)buf + 4096,
									 .length = 64,
									 .lkey = mr->lkey },
				   .num_sge = 1 };
	struct ibv_recv_wr *rbad;
	CHECK(ibv_post_recv(qp, &rwr, &rbad) == 0, "");
	struct ibv_sge wsge = { .addr = (uintptr_t)buf, .length = 13, .lkey = mr->lkey };
	struct ibv_sge isge = { .addr = (uintptr_t)inline_src, .length = 14, .lkey = 0 };
	struct ibv_send_wr w3 = { .wr_id = 3, .sg_list = &wsge, .num_sge = 17, .opcode = IBV_WR_SEND };
	struct ibv_send_wr w2 = { .wr_id = 2, .next = &w3, .sg_list = &isge, .num_sge = 1,
				  .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED };
	struct ibv_send_wr w1 = { .wr_id = 1, .next = &w2, .sg_list = &wsge, .num_sge = 1,
				  .opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED };
	w1.wr.rdma.remote_addr = (uintptr_t)buf + 1024;
	w1.wr.rdma.rkey = mr->rkey;
	bad = NULL;
	CHECK(ibv_post_send(qp, &w1, &bad) == EINVAL && bad == &w3, "bad=%p", (void *)bad);
	/* The inline bytes were copied at post time: clobbering them now is fine. */
	memset(inline_src, 'X', sizeof(inline_src));
	struct ibv_wc wc[4];
	int n = poll_n(cq, wc, 3, 10000);
	CHECK(n == 3, "n=%d", n);
	for (int i = 0; i < n; i++)
		CHECK(wc[i].status == IBV_WC_SUCCESS, "wr %llu: %s", (unsigned long long)wc[i].wr_id,
		      ibv_wc_status_str(wc[i].status));
	CHECK(!strcmp(buf + 1024, "hello, write"), "write landed: %s", buf + 1024);
	CHECK(!strcmp(buf + 4096, "inline bytes!"), "inline landed: %s", buf + 4096);
	for (int i = 0; i < n; i++)
		if (wc[i].wr_id == 100)
			CHECK(wc[i].opcode == IBV_WC_RECV && wc[i].byte_len == 14 && wc[i].qp_num == qp->qp_num,
			      "recv wc");

	/* Unknown opcode: EINVAL, nothing posted. */
	struct ibv_send_wr wbad = { .wr_id = 9, .sg_list = &wsge, .num_sge = 1, .opcode = IBV_WR_LOCAL_INV };
	CHECK(ibv_post_send(qp, &wbad, &bad) == EINVAL && bad == &wbad, "");

	/* RDMA read and atomics. */
	uint64_t *words = (uint64_t *)(buf + 2048);
	words[0] = 40;
	words[1] = 0;
	struct ibv_sge asge = { .addr = (uintptr_t)&words[1], .length = 8, .lkey = mr->lkey };
	struct ibv_send_wr fa = { .wr_id = 20, .sg_list = &asge, .num_sge = 1,
				  .opcode = IBV_WR_ATOMIC_FETCH_AND_ADD, .send_flags = IBV_SEND_SIGNALED };
	fa.wr.atomic.remote_addr = (uintptr_t)&words[0];
	fa.wr.atomic.rkey = mr->rkey;
	fa.wr.atomic.compare_add = 2;
	CHECK(ibv_post_send(qp, &fa, &bad) == 0, "");
	n = poll_n(cq, wc, 1, 10000);
	CHECK(n == 1 && wc[0].status == IBV_WC_SUCCESS && wc[0].opcode == IBV_WC_FETCH_ADD, "");
	CHECK(words[0] == 42 && words[1] == 40, "fetch-add: %llu %llu", (unsigned long long)words[0],
	      (unsigned long long)words[1]);
	struct ibv_sge rsge = { .addr = (uintptr_t)buf + 3072, .length = 13, .lkey = mr->lkey };
	struct ibv_send_wr rd = { .wr_id = 21, .sg_list = &rsge, .num_sge = 1, .opcode = IBV_WR_RDMA_READ,
				  .send_flags = IBV_SEND_SIGNALED };
	rd.wr.rdma.remote_addr = (uintptr_t)buf;
	rd.wr.rdma.rkey = mr->rkey;
	CHECK(ibv_post_send(qp, &rd, &bad) == 0, "");
	n = poll_n(cq, wc, 1, 10000);
	CHECK(n == 1 && wc[0].status == IBV_WC_SUCCESS && wc[0].opcode == IBV_WC_RDMA_READ, "");
	CHECK(!strcmp(buf + 3072, "hello, write"), "read: %s", buf + 3072);

	/* Completion events: non-blocking fd first, then a real event. */
	struct ibv_cq *ev_cq;
	void *ev_ctx;
	int flags = fcntl(ch->fd, F_GETFL);
	CHECK(!(flags & O_NONBLOCK), "the channel fd starts out blocking");
	fcntl(ch->fd, F_SETFL, flags | O_NONBLOCK);
	errno = 0;
	CHECK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == -1 && errno == EAGAIN, "errno=%d", errno);
	CHECK(ibv_post_recv(qp, &rwr, &rbad) == 0, "");
	CHECK(ibv_req_notify_cq(cq, 0) == 0, "");
	CHECK(ibv_post_send(qp, &w1, &bad) == EINVAL && bad == &w3, "");
	n = 0;
	for (double end = now_ns() + 10e9; now_ns() < end;) {
		if (ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == 0) {
			n = 1;
			break;
		}
		CHECK(errno == EAGAIN, "errno=%d", errno);
		usleep(100);
	}
	CHECK(n == 1 && ev_cq == cq && ev_ctx == (void *)0x1234, "event");
	ibv_ack_cq_events(cq, 1);
	n = poll_n(cq, wc, 3, 10000);
	CHECK(n == 3, "n=%d", n);
	fcntl(ch->fd, F_SETFL, flags);

	/* Async events: none pending, non-blocking. */
	struct ibv_async_event aev;
	int aflags = fcntl(ctx->async_fd, F_GETFL);
	fcntl(ctx->async_fd, F_SETFL, aflags | O_NONBLOCK);
	errno = 0;
	CHECK(ibv_get_async_event(ctx, &aev) == -1 && errno == EAGAIN, "errno=%d", errno);

	/* SRQ: posting, limits, and the limit event through the async fd. */
	struct ibv_srq_init_attr sattr = { .srq_context = (void *)0x5678, .attr = { .max_wr = 8, .max_sge = 1 } };
	struct ibv_srq *srq = ibv_create_srq(pd, &sattr);
	CHECK(srq != NULL && sattr.attr.max_wr >= 8, "");
	struct ibv_srq_attr sa = { .max_wr = 64 };
	CHECK(ibv_modify_srq(srq, &sa, IBV_SRQ_MAX_WR) == EINVAL, "resize");
	struct ibv_recv_wr sr = { .wr_id = 7, .sg_list = &rsge, .num_sge = 2 };
	CHECK(ibv_post_srq_recv(srq, &sr, &rbad) == EINVAL && rbad == &sr, "too many SGEs");
	sr.num_sge = 1;
	for (int i = 0; i < 3; i++)
		CHECK(ibv_post_srq_recv(srq, &sr, &rbad) == 0, "");
	sa.srq_limit = 2;
	CHECK(ibv_modify_srq(srq, &sa, IBV_SRQ_LIMIT) == 0, "");
	CHECK(ibv_query_srq(srq, &sa) == 0 && sa.srq_limit == 2, "");
	struct ibv_qp_init_attr si = { .send_cq = cq, .recv_cq = cq, .srq = srq,
				       .cap = { .max_send_wr = 4, .max_send_sge = 1, .max_inline_data = 16 },
				       .qp_type = IBV_QPT_RC };
	struct ibv_qp *sq = ibv_create_qp(pd, &si);
	CHECK(sq != NULL && sq->srq == srq, "errno=%d", errno);
	CHECK(ibv_post_recv(sq, &rwr, &rbad) == EINVAL, "a QP with an SRQ has no receive queue");
	CHECK(ibv_destroy_srq(srq) == EBUSY, "SRQ in use");
	CHECK(connect_rc(sq, sq->qp_num, port.lid) == 0, "");
	struct ibv_sge msg = { .addr = (uintptr_t)"ping", .length = 4 };
	struct ibv_send_wr sends[2] = {
		{ .wr_id = 30, .next = &sends[1], .sg_list = &msg, .num_sge = 1, .opcode = IBV_WR_SEND,
		  .send_flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED },
		{ .wr_id = 31, .sg_list = &msg, .num_sge = 1, .opcode = IBV_WR_SEND,
		  .send_flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED },
	};
	CHECK(ibv_post_send(sq, sends, &bad) == 0, "");
	n = poll_n(cq, wc, 4, 10000);
	CHECK(n == 4, "n=%d", n);
	n = 0;
	for (double end = now_ns() + 10e9; now_ns() < end;) {
		if (ibv_get_async_event(ctx, &aev) == 0) {
			n = 1;
			break;
		}
		CHECK(errno == EAGAIN, "errno=%d", errno);
		usleep(100);
	}
	CHECK(n == 1 && aev.event_type == IBV_EVENT_SRQ_LIMIT_REACHED && aev.element.srq == srq &&
		      aev.element.srq->srq_context == (void *)0x5678,
	      "async event %d (%s)", aev.event_type, ibv_event_type_str(aev.event_type));
	if (n == 1)
		ibv_ack_async_event(&aev);
	CHECK(ibv_destroy_qp(sq) == 0, "");

	if (bench) {
		/* The posting path alone: a request refused by the QP's state
		 * after its conversion (a QP in RESET). */
		struct ibv_qp_init_attr i2 = init;
		i2.qp_type = IBV_QPT_RC;
		struct ibv_qp *q2 = ibv_create_qp(pd, &i2);
		int iters = 1000000;
		double t0 = now_ns();
		for (int i = 0; i < iters; i++)
			ibv_post_send(q2, &wr, &bad);
		double t1 = now_ns();
		printf("bench: post_send conversion + refusal: %.1f ns/call\n", (t1 - t0) / iters);
		/* The cost of posting, per request: chains of 32 unsignalled
		 * 8-byte writes (the last one signalled), timed around the post
		 * call only; the completion is awaited outside the timing. */
		enum { CHAIN = 15 };
		struct ibv_sge cs = { .addr = (uintptr_t)buf, .length = 8, .lkey = mr->lkey };
		struct ibv_send_wr chain[CHAIN];
		for (int i = 0; i < CHAIN; i++) {
			chain[i] = (struct ibv_send_wr){ .wr_id = i, .next = i + 1 < CHAIN ? &chain[i + 1] : NULL,
							 .sg_list = &cs, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE };
			chain[i].wr.rdma.remote_addr = (uintptr_t)buf + 512;
			chain[i].wr.rdma.rkey = mr->rkey;
		}
		chain[CHAIN - 1].send_flags = IBV_SEND_SIGNALED;
		double posting = 0;
		int rounds = 20000;
		for (int r = 0; r < rounds; r++) {
			double a = now_ns();
			int rc = ibv_post_send(qp, chain, &bad);
			posting += now_ns() - a;
			if (rc) {
				printf("bench: post failed: %d\n", rc);
				break;
			}
			poll_n(cq, wc, 1, 10000);
		}
		printf("bench: post_send, %d-request chains: %.1f ns/request\n", CHAIN, posting / rounds / CHAIN);
		/* A signalled 8-byte RDMA write to itself, posted and polled. */
		struct ibv_sge s8 = { .addr = (uintptr_t)buf, .length = 8, .lkey = mr->lkey };
		struct ibv_send_wr w8 = { .wr_id = 8, .sg_list = &s8, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
					  .send_flags = IBV_SEND_SIGNALED };
		w8.wr.rdma.remote_addr = (uintptr_t)buf + 512;
		w8.wr.rdma.rkey = mr->rkey;
		iters = 20000;
		t0 = now_ns();
		for (int i = 0; i < iters; i++) {
			ibv_post_send(qp, &w8, &bad);
			poll_n(cq, wc, 1, 10000);
		}
		t1 = now_ns();
		printf("bench: 8 B RDMA write to itself, post + poll: %.2f us/op\n", (t1 - t0) / iters / 1e3);
		ibv_destroy_qp(q2);
	}

	CHECK(ibv_destroy_qp(qp) == 0, "");
	CHECK(ibv_destroy_srq(srq) == 0, "");
	CHECK(ibv_destroy_cq(cq) == 0, "");
	CHECK(ibv_destroy_comp_channel(ch) == 0, "");
	CHECK(ibv_dereg_mr(mr) == 0, "");
	CHECK(ibv_dealloc_pd(pd) == 0, "");
	CHECK(ibv_close_device(ctx) == 0, "");
	free(buf);
	if (failures) {
		fprintf(stderr, "verbs_check: %d failures\n", failures);
		return 1;
	}
	printf("verbs_check: OK\n");
	return 0;
}
