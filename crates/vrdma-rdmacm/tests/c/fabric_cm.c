/*
 * The rdma_cm behaviour libfabric's verbs provider (1.17) relies on,
 * which rdmacm-utils do not reach:
 *
 * - an id created without a channel is synchronous: rdma_resolve_addr
 *   returns once the address is resolved. rdma_migrate_id to a channel
 *   makes it asynchronous: rdma_resolve_route then returns at once and
 *   ROUTE_RESOLVED arrives on that channel (libfabric resolves an
 *   endpoint's address so, moves the id to its event queue and connects
 *   from there; an id that stayed synchronous waited for ever). Moved
 *   back with a NULL channel it is synchronous again: rdma_connect to a
 *   port nobody listens on fails with ECONNREFUSED in the call.
 * - binding to 127.0.0.1 leaves id->verbs NULL (as a wildcard bind; the
 *   kernel has no RDMA device behind lo), so that libfabric publishes the
 *   device's interface address rather than loopback.
 *
 * Prints "fabric_cm: OK" when all pass.
 * Usage: fabric_cm PORT (a port nobody listens on).
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <rdma/rdma_cma.h>

#define CHECK(cond, ...)                                                   \
	do {                                                               \
		if (!(cond)) {                                             \
			fprintf(stderr, "fabric_cm: line %d: ", __LINE__); \
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
	struct sockaddr_in dst, lo;
	struct pollfd pfd;

	CHECK(argc == 2, "usage: fabric_cm PORT");
	memset(&dst, 0, sizeof dst);
	dst.sin_family = AF_INET;
	dst.sin_port = htons(atoi(argv[1]));
	dst.sin_addr.s_addr = htonl(INADDR_LOOPBACK);

	/* A synchronous id, moved to a channel. */
	CHECK(rdma_create_id(NULL, &id, NULL, RDMA_PS_TCP) == 0, "rdma_create_id (synchronous)");
	CHECK(rdma_resolve_addr(id, NULL, (struct sockaddr *)&dst, 2000) == 0, "rdma_resolve_addr");
	CHECK(id->verbs != NULL, "the resolved id has the device");
	ch = rdma_create_event_channel();
	CHECK(ch, "rdma_create_event_channel");
	CHECK(rdma_migrate_id(id, ch) == 0, "rdma_migrate_id to a channel");
	CHECK(id->channel == ch, "the id's channel is the new one");
	/* Asynchronous now: this returns without waiting for its event. */
	CHECK(rdma_resolve_route(id, 2000) == 0, "rdma_resolve_route");
	pfd.fd = ch->fd;
	pfd.events = POLLIN;
	CHECK(poll(&pfd, 1, 5000) == 1, "ROUTE_RESOLVED makes the new channel readable");
	CHECK(rdma_get_cm_event(ch, &ev) == 0, "rdma_get_cm_event");
	CHECK(ev->event == RDMA_CM_EVENT_ROUTE_RESOLVED && ev->id == id && ev->status == 0,
	      "ROUTE_RESOLVED for the id, got %s", rdma_event_str(ev->event));
	CHECK(rdma_ack_cm_event(ev) == 0, "rdma_ack_cm_event");

	/* Back to a channel of its own: synchronous again. */
	CHECK(rdma_migrate_id(id, NULL) == 0, "rdma_migrate_id to NULL");
	CHECK(id->channel != NULL && id->channel != ch, "the id has a channel of its own");
	CHECK(rdma_migrate_id(id, NULL) == -1 && errno == EINVAL, "a synchronous id cannot go synchronous");
	errno = 0;
	CHECK(rdma_connect(id, NULL) == -1 && errno == ECONNREFUSED,
	      "rdma_connect waits for the reject of a port nobody listens on");
	CHECK(rdma_destroy_id(id) == 0, "rdma_destroy_id");
	rdma_destroy_event_channel(ch);

	/* Loopback has no device behind it; the bind itself works. */
	CHECK(rdma_create_id(NULL, &id, NULL, RDMA_PS_TCP) == 0, "rdma_create_id");
	memset(&lo, 0, sizeof lo);
	lo.sin_family = AF_INET;
	lo.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	CHECK(rdma_bind_addr(id, (struct sockaddr *)&lo) == 0, "rdma_bind_addr 127.0.0.1");
	CHECK(id->verbs == NULL, "no device behind loopback");
	CHECK(((struct sockaddr_in *)rdma_get_local_addr(id))->sin_addr.s_addr == htonl(INADDR_LOOPBACK),
	      "bound to 127.0.0.1");
	CHECK(rdma_listen(id, 1) == 0, "rdma_listen on 127.0.0.1");
	CHECK(rdma_destroy_id(id) == 0, "rdma_destroy_id");

	printf("fabric_cm: OK\n");
	return 0;
}
