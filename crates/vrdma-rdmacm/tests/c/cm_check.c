/*
 * Checks of the drop-in librdmacm.so.1 that rping and ucmatose do not
 * reach: a non-blocking channel answers EAGAIN, the descriptor is
 * pollable, an event's id has the device, its PD (UCX's rdmacm
 * connection manager makes a UD QP on id->pd) and addresses filled in,
 * rdma_getaddrinfo's passive wildcard, rdma_get_devices, and rdma_notify
 * (not implemented) failing with ENOSYS. Prints "cm_check: OK" when all pass.
 * Usage: cm_check PORT (a port nobody listens on).
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <rdma/rdma_cma.h>
#include <rdma/rsocket.h>

#define CHECK(cond, ...)                                                   \
	do {                                                               \
		if (!(cond)) {                                             \
			fprintf(stderr, "cm_check: line %d: ", __LINE__);  \
			fprintf(stderr, __VA_ARGS__);                      \
			fprintf(stderr, " (errno %d)\n", errno);           \
			exit(1);                                           \
		}                                                          \
	} while (0)

int main(int argc, char **argv)
{
	struct rdma_event_channel *ch;
	struct rdma_cm_id *id;
	struct rdma_cm_event *ev;
	struct rdma_addrinfo hints, *rai;
	struct sockaddr_in dst, *sin;
	struct ibv_context **devs;
	struct pollfd pfd;
	int n, flags;

	CHECK(argc == 2, "usage: cm_check PORT");

	ch = rdma_create_event_channel();
	CHECK(ch, "rdma_create_event_channel");
	flags = fcntl(ch->fd, F_GETFL);
	CHECK(flags >= 0 && !(flags & O_NONBLOCK), "the channel starts blocking");
	CHECK(fcntl(ch->fd, F_SETFL, flags | O_NONBLOCK) == 0, "set O_NONBLOCK");
	errno = 0;
	CHECK(rdma_get_cm_event(ch, &ev) == -1 && errno == EAGAIN, "EAGAIN on an empty non-blocking channel");

	CHECK(rdma_create_id(ch, &id, (void *)0x1234, RDMA_PS_TCP) == 0, "rdma_create_id");
	CHECK(id->channel == ch && id->context == (void *)0x1234 && id->ps == RDMA_PS_TCP, "the id's fields");
	memset(&dst, 0, sizeof dst);
	dst.sin_family = AF_INET;
	dst.sin_port = htons(atoi(argv[1]));
	dst.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	CHECK(rdma_resolve_addr(id, NULL, (struct sockaddr *)&dst, 2000) == 0, "rdma_resolve_addr");

	pfd.fd = ch->fd;
	pfd.events = POLLIN;
	CHECK(poll(&pfd, 1, 5000) == 1, "the descriptor becomes readable");
	CHECK(rdma_get_cm_event(ch, &ev) == 0, "rdma_get_cm_event");
	CHECK(ev->event == RDMA_CM_EVENT_ADDR_RESOLVED && ev->id == id && ev->status == 0,
	      "ADDR_RESOLVED for the id, got %s", rdma_event_str(ev->event));
	CHECK(id->verbs != NULL && id->port_num == 1, "the id has the device");
	CHECK(id->pd != NULL && id->pd->context == id->verbs, "the id has the device's PD");
	{
		/* What UCX's rdmacm connection manager does with it. */
		struct ibv_cq *cq = ibv_create_cq(id->verbs, 4, NULL, NULL, 0);
		CHECK(cq, "ibv_create_cq on id->verbs");
		struct ibv_qp_init_attr qa = {
			.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_UD,
			.cap = { .max_send_wr = 2, .max_recv_wr = 2, .max_send_sge = 1, .max_recv_sge = 1 },
		};
		struct ibv_qp *qp = ibv_create_qp(id->pd, &qa);
		CHECK(qp, "a UD QP on id->pd");
		CHECK(ibv_destroy_qp(qp) == 0 && ibv_destroy_cq(cq) == 0, "destroy the QP and CQ");
	}
	sin = (struct sockaddr_in *)rdma_get_peer_addr(id);
	CHECK(sin->sin_family == AF_INET && sin->sin_port == dst.sin_port, "the peer address");
	CHECK(rdma_get_dst_port(id) == dst.sin_port, "rdma_get_dst_port");
	sin = (struct sockaddr_in *)rdma_get_local_addr(id);
	CHECK(sin->sin_family == AF_INET && sin->sin_addr.s_addr != htonl(INADDR_ANY) && sin->sin_port != 0,
	      "the local address is bound");
	CHECK(rdma_ack_cm_event(ev) == 0, "rdma_ack_cm_event");
	errno = 0;
	CHECK(rdma_get_cm_event(ch, &ev) == -1 && errno == EAGAIN, "nothing else waits");
	pfd.revents = 0;
	CHECK(poll(&pfd, 1, 0) == 0, "the descriptor is quiet once the event is read");

	/* The route (which the library resolves itself): one event, which
	 * makes the non-blocking descriptor readable when the call returns. */
	CHECK(rdma_resolve_route(id, 2000) == 0, "rdma_resolve_route");
	pfd.revents = 0;
	CHECK(poll(&pfd, 1, 5000) == 1, "ROUTE_RESOLVED makes the descriptor readable");
	CHECK(rdma_get_cm_event(ch, &ev) == 0, "rdma_get_cm_event (route)");
	CHECK(ev->event == RDMA_CM_EVENT_ROUTE_RESOLVED && ev->id == id && ev->status == 0,
	      "ROUTE_RESOLVED for the id, got %s", rdma_event_str(ev->event));
	CHECK(rdma_ack_cm_event(ev) == 0, "rdma_ack_cm_event (route)");
	errno = 0;
	CHECK(rdma_get_cm_event(ch, &ev) == -1 && errno == EAGAIN, "ROUTE_RESOLVED once");
	pfd.revents = 0;
	CHECK(poll(&pfd, 1, 0) == 0, "the descriptor is quiet once the route's event is read");
	errno = 0;
	CHECK(rdma_resolve_route(id, 2000) == -1 && errno == EINVAL, "a route resolved twice is EINVAL");
	CHECK(rdma_destroy_id(id) == 0, "rdma_destroy_id");
	rdma_destroy_event_channel(ch);

	memset(&hints, 0, sizeof hints);
	hints.ai_flags = RAI_PASSIVE;
	hints.ai_port_space = RDMA_PS_TCP;
	CHECK(rdma_getaddrinfo(NULL, argv[1], &hints, &rai) == 0, "rdma_getaddrinfo (passive)");
	sin = (struct sockaddr_in *)rai->ai_src_addr;
	CHECK(rai->ai_family == AF_INET && sin && sin->sin_addr.s_addr == htonl(INADDR_ANY) &&
	      sin->sin_port == dst.sin_port && rai->ai_qp_type == IBV_QPT_RC,
	      "the passive wildcard address");
	rdma_freeaddrinfo(rai);

	devs = rdma_get_devices(&n);
	CHECK(devs && n == 1 && devs[0] && !devs[1], "one device");
	CHECK(strcmp(ibv_get_device_name(devs[0]->device), "vrdma0") == 0, "it is vrdma0");
	rdma_free_devices(devs);

	errno = 0;
	CHECK(rdma_notify(NULL, IBV_EVENT_COMM_EST) == -1 && errno == ENOSYS, "rdma_notify is not there");

	printf("cm_check: OK\n");
	return 0;
}
