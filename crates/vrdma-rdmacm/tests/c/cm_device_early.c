/*
 * The device context is opened with the library's connection to the
 * daemon (the first rdma_create_event_channel), as rdma-core's ucma_init
 * takes its device list at the first librdmacm call, not at the first
 * address resolution: a fresh process's first rdma_resolve_addr (and a
 * wildcard listener's first connect request) then makes no connection
 * to the daemon of its own. Counts the process's sockets around
 * rdma_resolve_addr and its ADDR_RESOLVED (none new) and checks that the
 * event's id names the device. Prints "cm_device_early: OK".
 * Usage: cm_device_early PORT (any port: only the address is resolved).
 */
#define CHECK_NAME "cm_device_early"
#include "rcheck.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <rdma/rdma_cma.h>
#include <string.h>
#include <unistd.h>

/* The process's open sockets (its connections to the daemon among them). */
static int sockets(void)
{
	DIR *d = opendir("/proc/self/fd");
	CHECK(d != NULL, "opendir /proc/self/fd");
	int n = 0;
	struct dirent *e;
	while ((e = readdir(d)) != NULL) {
		char path[300], target[300];
		snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
		ssize_t len = readlink(path, target, sizeof target - 1);
		if (len > 0) {
			target[len] = 0;
			if (strncmp(target, "socket:", 7) == 0)
				n++;
		}
	}
	closedir(d);
	return n;
}

int main(int argc, char **argv)
{
	CHECK(argc == 2, "usage: cm_device_early PORT");
	struct rdma_event_channel *ch = rdma_create_event_channel();
	CHECK(ch != NULL, "rdma_create_event_channel");
	struct rdma_cm_id *id;
	CHECK(rdma_create_id(ch, &id, NULL, RDMA_PS_TCP) == 0, "rdma_create_id");
	CHECK(id->verbs == NULL, "a new id names no device yet");
	int before = sockets();

	struct sockaddr_in dst = { .sin_family = AF_INET, .sin_port = htons(atoi(argv[1])) };
	dst.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	CHECK(rdma_resolve_addr(id, NULL, (struct sockaddr *) &dst, 2000) == 0, "rdma_resolve_addr");
	struct rdma_cm_event *ev;
	CHECK(rdma_get_cm_event(ch, &ev) == 0, "rdma_get_cm_event");
	CHECK(ev->event == RDMA_CM_EVENT_ADDR_RESOLVED, "ADDR_RESOLVED, not %s", rdma_event_str(ev->event));
	CHECK(ev->id == id && id->verbs != NULL && id->pd != NULL, "the resolved id names the device and its PD");
	CHECK(rdma_ack_cm_event(ev) == 0, "rdma_ack_cm_event");
	int after = sockets();
	CHECK(after == before, "the resolve opened %d socket(s) (the device context was not open yet)",
	      after - before);

	CHECK(rdma_destroy_id(id) == 0, "rdma_destroy_id");
	rdma_destroy_event_channel(ch);
	printf("cm_device_early: OK\n");
	return 0;
}
