/*
 * The daemon goes away under a program of the drop-in librdmacm.so.1: an
 * id whose address was resolved hears RDMA_CM_EVENT_DEVICE_REMOVAL (its
 * channel's descriptor turns readable), an id with no address hears
 * nothing, and the channel then fails with ENODEV instead of waiting.
 * Usage: cm_restart PORT MARKER. Creates the file MARKER once the id is
 * resolved; the test then stops the daemon. Prints "cm_restart: OK".
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <rdma/rdma_cma.h>

#define CHECK(cond, ...)                                                    \
	do {                                                                \
		if (!(cond)) {                                              \
			fprintf(stderr, "cm_restart: line %d: ", __LINE__); \
			fprintf(stderr, __VA_ARGS__);                       \
			fprintf(stderr, " (errno %d)\n", errno);            \
			exit(1);                                            \
		}                                                           \
	} while (0)

int main(int argc, char **argv)
{
	struct rdma_event_channel *ch;
	struct rdma_cm_id *id, *idle;
	struct rdma_cm_event *ev;
	struct sockaddr_in dst;
	struct pollfd pfd;
	FILE *marker;

	CHECK(argc == 3, "usage: cm_restart PORT MARKER");
	ch = rdma_create_event_channel();
	CHECK(ch, "rdma_create_event_channel");
	CHECK(rdma_create_id(ch, &id, NULL, RDMA_PS_TCP) == 0, "rdma_create_id");
	CHECK(rdma_create_id(ch, &idle, NULL, RDMA_PS_TCP) == 0, "rdma_create_id (idle)");
	memset(&dst, 0, sizeof(dst));
	dst.sin_family = AF_INET;
	dst.sin_port = htons(atoi(argv[1]));
	dst.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	CHECK(rdma_resolve_addr(id, NULL, (struct sockaddr *)&dst, 2000) == 0, "rdma_resolve_addr");
	CHECK(rdma_get_cm_event(ch, &ev) == 0, "rdma_get_cm_event");
	CHECK(ev->event == RDMA_CM_EVENT_ADDR_RESOLVED, "ADDR_RESOLVED, got %s", rdma_event_str(ev->event));
	rdma_ack_cm_event(ev);

	marker = fopen(argv[2], "w");
	CHECK(marker && fclose(marker) == 0, "creating %s", argv[2]);

	pfd.fd = ch->fd;
	pfd.events = POLLIN;
	CHECK(poll(&pfd, 1, 20000) == 1, "the channel's descriptor turns readable when the daemon goes");
	CHECK(rdma_get_cm_event(ch, &ev) == 0, "rdma_get_cm_event after the daemon went");
	CHECK(ev->event == RDMA_CM_EVENT_DEVICE_REMOVAL, "DEVICE_REMOVAL, got %s", rdma_event_str(ev->event));
	CHECK(ev->id == id, "the removal is the resolved id's");
	rdma_ack_cm_event(ev);
	errno = 0;
	CHECK(rdma_get_cm_event(ch, &ev) == -1 && errno == ENODEV, "then ENODEV, not a wait");
	/* What is left of the ids goes without a daemon to tell. */
	rdma_destroy_id(idle);
	rdma_destroy_id(id);
	rdma_destroy_event_channel(ch);
	printf("cm_restart: OK\n");
	return 0;
}
