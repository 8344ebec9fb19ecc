/*
 * The daemon is restarted under a program of the drop-in librdmacm.so.1,
 * which goes on as a program does after a device reset on rdma-core: its
 * connection hears RDMA_CM_EVENT_DEVICE_REMOVAL, then its channels fail
 * with ENODEV; the old device's verbs fail instead of hanging; every
 * destroy call succeeds; and once the daemon is back, new channels, ids
 * and QPs in the same process connect again and exchange a message.
 *
 * Usage: cm_reconnect PORT1 PORT2 MARKER. Each phase is a server (a
 * listener on 127.0.0.1:PORTn) and a client in this process, connected
 * and exchanging one message. After the first, it creates the file
 * MARKER; the test then restarts the daemon. Prints "cm_reconnect: OK".
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <rdma/rdma_cma.h>

#define CHECK(cond, ...)                                                      \
	do {                                                                  \
		if (!(cond)) {                                                \
			fprintf(stderr, "cm_reconnect: line %d: ", __LINE__); \
			fprintf(stderr, __VA_ARGS__);                         \
			fprintf(stderr, " (errno %d)\n", errno);              \
			exit(1);                                              \
		}                                                             \
	} while (0)

struct conn {
	struct rdma_event_channel *sch, *cch;
	struct rdma_cm_id *listen, *srv, *cli;
	struct ibv_mr *smr, *cmr;
	char *sbuf, *cbuf; /* heap: vRDMA registers no stack memory */
};

#define BUF 64

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

/* The next event of `ch`, which must be `want`; returns its id. */
static struct rdma_cm_id *expect(struct rdma_event_channel *ch, enum rdma_cm_event_type want)
{
	struct rdma_cm_event *ev;
	struct rdma_cm_id *id;
	struct pollfd pfd = { .fd = ch->fd, .events = POLLIN };

	CHECK(poll(&pfd, 1, 20000) == 1, "no %s within 20 s", rdma_event_str(want));
	CHECK(rdma_get_cm_event(ch, &ev) == 0, "rdma_get_cm_event (waiting for %s)", rdma_event_str(want));
	CHECK(ev->event == want, "%s, got %s (status %d)", rdma_event_str(want), rdma_event_str(ev->event),
	      ev->status);
	id = ev->id;
	rdma_ack_cm_event(ev);
	return id;
}

/* One completion of `cq`, within 10 s. */
static void one_completion(struct ibv_cq *cq, const char *what)
{
	struct ibv_wc wc;
	double end = now() + 10;
	int n;

	while ((n = ibv_poll_cq(cq, 1, &wc)) == 0 && now() < end)
		usleep(100);
	CHECK(n == 1, "%s: no completion", what);
	CHECK(wc.status == IBV_WC_SUCCESS, "%s: %s", what, ibv_wc_status_str(wc.status));
}

/* A server and a client of this process connect on `port` and the
 * client sends `msg` to the server. */
static void connect_and_send(struct conn *c, int port, const char *msg)
{
	struct sockaddr_in addr;
	struct ibv_qp_init_attr attr;
	struct rdma_conn_param param;
	struct ibv_sge sge;
	struct ibv_recv_wr rwr, *bad_rwr;
	struct ibv_send_wr swr, *bad_swr;

	memset(c, 0, sizeof(*c));
	c->sbuf = calloc(1, BUF);
	c->cbuf = calloc(1, BUF);
	CHECK(c->sbuf && c->cbuf, "calloc");
	c->sch = rdma_create_event_channel();
	CHECK(c->sch, "rdma_create_event_channel (server)");
	c->cch = rdma_create_event_channel();
	CHECK(c->cch, "rdma_create_event_channel (client)");
	memset(&addr, 0, sizeof(addr));
	addr.sin_family = AF_INET;
	addr.sin_port = htons(port);
	addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	CHECK(rdma_create_id(c->sch, &c->listen, NULL, RDMA_PS_TCP) == 0, "rdma_create_id (listener)");
	CHECK(rdma_bind_addr(c->listen, (struct sockaddr *)&addr) == 0, "rdma_bind_addr");
	CHECK(rdma_listen(c->listen, 4) == 0, "rdma_listen");

	CHECK(rdma_create_id(c->cch, &c->cli, NULL, RDMA_PS_TCP) == 0, "rdma_create_id (client)");
	CHECK(rdma_resolve_addr(c->cli, NULL, (struct sockaddr *)&addr, 2000) == 0, "rdma_resolve_addr");
	expect(c->cch, RDMA_CM_EVENT_ADDR_RESOLVED);
	CHECK(rdma_resolve_route(c->cli, 2000) == 0, "rdma_resolve_route");
	expect(c->cch, RDMA_CM_EVENT_ROUTE_RESOLVED);
	memset(&attr, 0, sizeof(attr));
	attr.qp_type = IBV_QPT_RC;
	attr.cap.max_send_wr = attr.cap.max_recv_wr = 4;
	attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
	CHECK(rdma_create_qp(c->cli, NULL, &attr) == 0, "rdma_create_qp (client)");
	c->cmr = ibv_reg_mr(c->cli->pd, c->cbuf, BUF, IBV_ACCESS_LOCAL_WRITE);
	CHECK(c->cmr, "ibv_reg_mr (client)");
	memset(&param, 0, sizeof(param));
	param.retry_count = 7;
	param.rnr_retry_count = 7;
	CHECK(rdma_connect(c->cli, &param) == 0, "rdma_connect");

	c->srv = expect(c->sch, RDMA_CM_EVENT_CONNECT_REQUEST);
	memset(&attr, 0, sizeof(attr));
	attr.qp_type = IBV_QPT_RC;
	attr.cap.max_send_wr = attr.cap.max_recv_wr = 4;
	attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
	CHECK(rdma_create_qp(c->srv, NULL, &attr) == 0, "rdma_create_qp (server)");
	c->smr = ibv_reg_mr(c->srv->pd, c->sbuf, BUF, IBV_ACCESS_LOCAL_WRITE);
	CHECK(c->smr, "ibv_reg_mr (server)");
	sge.addr = (uintptr_t)c->sbuf;
	sge.length = BUF;
	sge.lkey = c->smr->lkey;
	memset(&rwr, 0, sizeof(rwr));
	rwr.wr_id = 1;
	rwr.sg_list = &sge;
	rwr.num_sge = 1;
	CHECK(ibv_post_recv(c->srv->qp, &rwr, &bad_rwr) == 0, "ibv_post_recv");
	CHECK(rdma_accept(c->srv, &param) == 0, "rdma_accept");
	expect(c->cch, RDMA_CM_EVENT_ESTABLISHED);
	expect(c->sch, RDMA_CM_EVENT_ESTABLISHED);

	snprintf(c->cbuf, BUF, "%s", msg);
	sge.addr = (uintptr_t)c->cbuf;
	sge.length = strlen(msg) + 1;
	sge.lkey = c->cmr->lkey;
	memset(&swr, 0, sizeof(swr));
	swr.wr_id = 2;
	swr.sg_list = &sge;
	swr.num_sge = 1;
	swr.opcode = IBV_WR_SEND;
	swr.send_flags = IBV_SEND_SIGNALED;
	CHECK(ibv_post_send(c->cli->qp, &swr, &bad_swr) == 0, "ibv_post_send");
	one_completion(c->cli->send_cq, "the send");
	one_completion(c->srv->recv_cq, "the receive");
	CHECK(strcmp(c->sbuf, msg) == 0, "received \"%s\", sent \"%s\"", c->sbuf, msg);
}

/* Every destroy succeeds, whether or not the daemon is still there. */
static void clean_up(struct conn *c)
{
	rdma_destroy_qp(c->cli);
	rdma_destroy_qp(c->srv);
	CHECK(ibv_dereg_mr(c->cmr) == 0, "ibv_dereg_mr (client)");
	CHECK(ibv_dereg_mr(c->smr) == 0, "ibv_dereg_mr (server)");
	CHECK(rdma_destroy_id(c->cli) == 0, "rdma_destroy_id (client)");
	CHECK(rdma_destroy_id(c->srv) == 0, "rdma_destroy_id (server)");
	CHECK(rdma_destroy_id(c->listen) == 0, "rdma_destroy_id (listener)");
	rdma_destroy_event_channel(c->cch);
	rdma_destroy_event_channel(c->sch);
	free(c->cbuf);
	free(c->sbuf);
}

/* After the daemon went: DEVICE_REMOVAL for each id of `ch` with a
 * device, then ENODEV; returns how many removals. */
static int removals(struct rdma_event_channel *ch)
{
	struct rdma_cm_event *ev;
	struct pollfd pfd = { .fd = ch->fd, .events = POLLIN };
	int n = 0;

	CHECK(poll(&pfd, 1, 20000) == 1, "the channel's descriptor turns readable when the daemon goes");
	for (;;) {
		CHECK(n < 16, "more removals than ids");
		errno = 0;
		if (rdma_get_cm_event(ch, &ev) != 0) {
			CHECK(errno == ENODEV, "after the removals, ENODEV");
			return n;
		}
		CHECK(ev->event == RDMA_CM_EVENT_DEVICE_REMOVAL, "DEVICE_REMOVAL, got %s",
		      rdma_event_str(ev->event));
		rdma_ack_cm_event(ev);
		n++;
	}
}

int main(int argc, char **argv)
{
	struct conn c;
	struct ibv_port_attr port;
	struct rdma_event_channel *probe = NULL;
	FILE *marker;
	double end;

	CHECK(argc == 4, "usage: cm_reconnect PORT1 PORT2 MARKER");
	setvbuf(stdout, NULL, _IONBF, 0);
	connect_and_send(&c, atoi(argv[1]), "before the restart");
	marker = fopen(argv[3], "w");
	CHECK(marker && fclose(marker) == 0, "creating %s", argv[3]);

	/* The listener and the accepted id (server), the client's id. */
	CHECK(removals(c.sch) == 2, "two removals on the server's channel");
	CHECK(removals(c.cch) == 1, "one removal on the client's channel");
	/* The old device's verbs fail, and do not hang. */
	errno = 0;
	CHECK(ibv_query_port(c.cli->verbs, 1, &port) != 0, "ibv_query_port on the old device fails");
	clean_up(&c);
	printf("cm_reconnect: cleaned up\n");

	/* The test starts the daemon again on the same socket. */
	end = now() + 30;
	while (!(probe = rdma_create_event_channel()) && now() < end)
		usleep(50 * 1000);
	CHECK(probe, "rdma_create_event_channel once the daemon is back");
	rdma_destroy_event_channel(probe);
	connect_and_send(&c, atoi(argv[2]), "after the restart");
	clean_up(&c);
	printf("cm_reconnect: OK\n");
	return 0;
}
