/*
 * The daemon is restarted under a program of the drop-in libibverbs.so.1,
 * which sees what a program sees when a device is reset on rdma-core:
 * a thread blocked in ibv_get_async_event wakes with IBV_EVENT_DEVICE_FATAL
 * (and async_fd turns readable), later calls fail with EIO instead of
 * waiting, a thread blocked in ibv_get_cq_event returns an error, the old
 * context's verbs fail, every destroy succeeds; then a fresh device list
 * gives a device that opens and works, in the same process.
 *
 * Usage: restart_check MARKER. Creates the file MARKER once its objects
 * exist and its threads wait; the test then restarts the daemon. Prints
 * "restart_check: OK".
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

#include "common.h"

/* CHECK, and the end of the program if it failed (`cond` evaluated once). */
#define MUST(cond, ...)                                   \
	do {                                              \
		int before_ = failures;                   \
		CHECK(cond, __VA_ARGS__);                 \
		if (failures != before_)                  \
			exit(1);                          \
	} while (0)

static struct ibv_context *ctx;
static struct ibv_comp_channel *channel;

struct outcome {
	volatile int done;
	int rc, err, event_type;
};

static struct outcome async_out, comp_out;

static void *wait_async(void *arg)
{
	struct ibv_async_event ev;

	(void)arg;
	async_out.rc = ibv_get_async_event(ctx, &ev);
	async_out.err = errno;
	if (async_out.rc == 0) {
		async_out.event_type = ev.event_type;
		ibv_ack_async_event(&ev);
	}
	__atomic_store_n(&async_out.done, 1, __ATOMIC_RELEASE);
	return NULL;
}

static void *wait_comp(void *arg)
{
	struct ibv_cq *cq;
	void *cq_ctx;

	(void)arg;
	comp_out.rc = ibv_get_cq_event(channel, &cq, &cq_ctx);
	comp_out.err = errno;
	__atomic_store_n(&comp_out.done, 1, __ATOMIC_RELEASE);
	return NULL;
}

/* Whether `o` is done within `s` seconds. */
static int done_within(struct outcome *o, double s)
{
	double end = now_ns() + s * 1e9;

	while (!__atomic_load_n(&o->done, __ATOMIC_ACQUIRE) && now_ns() < end)
		usleep(1000);
	return __atomic_load_n(&o->done, __ATOMIC_ACQUIRE);
}

int main(int argc, char **argv)
{
	struct ibv_device **list;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_mr *mr;
	struct ibv_qp *qp;
	struct ibv_qp_init_attr qa;
	struct ibv_port_attr port;
	struct ibv_async_event ev;
	struct pollfd pfd;
	pthread_t ta, tc;
	FILE *marker;
	void *buf;
	double end;
	int n = 0, flags;

	MUST(argc == 2, "usage: restart_check MARKER");
	setvbuf(stdout, NULL, _IONBF, 0);
	/* Whatever hangs, the process does not outlive this. */
	alarm(90);

	list = ibv_get_device_list(&n);
	MUST(list && n == 1, "one device (%d)", n);
	ctx = ibv_open_device(list[0]);
	ibv_free_device_list(list);
	MUST(ctx, "ibv_open_device");
	pd = ibv_alloc_pd(ctx);
	channel = ibv_create_comp_channel(ctx);
	MUST(pd && channel, "ibv_alloc_pd, ibv_create_comp_channel");
	cq = ibv_create_cq(ctx, 16, NULL, channel, 0);
	MUST(cq, "ibv_create_cq");
	MUST(ibv_req_notify_cq(cq, 0) == 0, "ibv_req_notify_cq");
	buf = calloc(1, 4096);
	mr = ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE);
	MUST(mr, "ibv_reg_mr");
	memset(&qa, 0, sizeof(qa));
	qa.send_cq = qa.recv_cq = cq;
	qa.qp_type = IBV_QPT_RC;
	qa.cap.max_send_wr = qa.cap.max_recv_wr = 4;
	qa.cap.max_send_sge = qa.cap.max_recv_sge = 1;
	qp = ibv_create_qp(pd, &qa);
	MUST(qp, "ibv_create_qp");
	MUST(pthread_create(&ta, NULL, wait_async, NULL) == 0, "pthread_create");
	MUST(pthread_create(&tc, NULL, wait_comp, NULL) == 0, "pthread_create");
	usleep(100 * 1000); /* let both threads block */
	CHECK(!async_out.done && !comp_out.done, "the waits returned early");
	marker = fopen(argv[1], "w");
	MUST(marker && fclose(marker) == 0, "creating %s", argv[1]);

	/* The daemon goes. */
	pfd.fd = ctx->async_fd;
	pfd.events = POLLIN;
	MUST(poll(&pfd, 1, 20000) == 1 && (pfd.revents & POLLIN), "async_fd turns readable when the daemon goes");
	MUST(done_within(&async_out, 20), "the blocked ibv_get_async_event woke");
	CHECK(async_out.rc == 0 && async_out.event_type == IBV_EVENT_DEVICE_FATAL,
	      "IBV_EVENT_DEVICE_FATAL (rc %d, errno %d, event %d)", async_out.rc, async_out.err,
	      async_out.event_type);
	pthread_join(ta, NULL);
	errno = 0;
	CHECK(ibv_get_async_event(ctx, &ev) == -1 && errno == EIO, "then EIO, not a wait (errno %d)", errno);
	flags = fcntl(ctx->async_fd, F_GETFL);
	fcntl(ctx->async_fd, F_SETFL, flags | O_NONBLOCK);
	errno = 0;
	CHECK(ibv_get_async_event(ctx, &ev) == -1 && errno == EIO, "non-blocking: EIO too (errno %d)", errno);
	MUST(done_within(&comp_out, 20), "the blocked ibv_get_cq_event returned");
	CHECK(comp_out.rc == -1 && comp_out.err != 0, "ibv_get_cq_event fails (rc %d, errno %d)", comp_out.rc,
	      comp_out.err);
	pthread_join(tc, NULL);
	CHECK(ibv_query_port(ctx, 1, &port) != 0, "the old context's verbs fail");
	CHECK(ibv_alloc_pd(ctx) == NULL, "no new objects on the old context");

	/* Every destroy succeeds, so that the program can clean up. */
	CHECK(ibv_destroy_qp(qp) == 0, "ibv_destroy_qp");
	CHECK(ibv_dereg_mr(mr) == 0, "ibv_dereg_mr");
	CHECK(ibv_destroy_cq(cq) == 0, "ibv_destroy_cq");
	CHECK(ibv_destroy_comp_channel(channel) == 0, "ibv_destroy_comp_channel");
	CHECK(ibv_dealloc_pd(pd) == 0, "ibv_dealloc_pd");
	CHECK(ibv_close_device(ctx) == 0, "ibv_close_device");
	free(buf);
	printf("restart_check: cleaned up\n");

	/* The test starts the daemon again on the same socket. */
	end = now_ns() + 30e9;
	for (;;) {
		list = ibv_get_device_list(&n);
		MUST(list, "ibv_get_device_list");
		if (n == 1 || now_ns() > end)
			break;
		ibv_free_device_list(list);
		usleep(50 * 1000);
	}
	MUST(n == 1, "the device is back");
	ctx = ibv_open_device(list[0]);
	ibv_free_device_list(list);
	MUST(ctx, "ibv_open_device after the restart");
	CHECK(ibv_query_port(ctx, 1, &port) == 0 && port.state == IBV_PORT_ACTIVE, "the new port is active");
	pd = ibv_alloc_pd(ctx);
	CHECK(pd, "ibv_alloc_pd after the restart");
	pfd.fd = ctx->async_fd;
	CHECK(poll(&pfd, 1, 0) == 0, "the new context's async_fd is quiet");
	if (pd)
		CHECK(ibv_dealloc_pd(pd) == 0, "ibv_dealloc_pd");
	CHECK(ibv_close_device(ctx) == 0, "ibv_close_device");
	if (failures)
		return 1;
	printf("restart_check: OK\n");
	return 0;
}
