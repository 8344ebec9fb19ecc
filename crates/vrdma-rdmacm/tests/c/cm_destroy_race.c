/* A thread reads a channel's events while the main thread destroys their
 * ids, many times. librdmacm's contract: rdma_destroy_id waits until
 * every event handed out for the id was acknowledged (rdma_ack_cm_event),
 * so an event's id is never freed under the thread that holds the event.
 * The reader holds each event a moment, and checks that its id was not
 * destroyed meanwhile (the main thread marks an id destroyed once
 * rdma_destroy_id returned). Bounded by alarm(). Prints
 * "cm_destroy_race: OK (N events held)" and exits 0. */
#include <arpa/inet.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <rdma/rdma_cma.h>

#define ROUNDS 300

static struct rdma_event_channel *ch;
static volatile int destroyed[ROUNDS];
static volatile int held;

static void *reader(void *arg)
{
	struct rdma_cm_event *ev;
	(void)arg;
	for (;;) {
		if (rdma_get_cm_event(ch, &ev)) {
			perror("cm_destroy_race: rdma_get_cm_event");
			exit(3);
		}
		intptr_t n = (intptr_t)ev->id->context;
		if (n < 0 || n >= ROUNDS) {
			fprintf(stderr, "cm_destroy_race: an event of id %ld\n", (long)n);
			exit(4);
		}
		usleep(500 + rand() % 500);
		if (destroyed[n]) {
			fprintf(stderr, "cm_destroy_race: id %ld destroyed while its event was held\n", (long)n);
			exit(5);
		}
		if ((intptr_t)ev->id->context != n) {
			fprintf(stderr, "cm_destroy_race: id %ld changed under its event\n", (long)n);
			exit(6);
		}
		held++;
		rdma_ack_cm_event(ev);
	}
	return NULL;
}

int main(void)
{
	pthread_t t;
	struct sockaddr_in dst;

	alarm(60);
	srand(1);
	memset(&dst, 0, sizeof dst);
	dst.sin_family = AF_INET;
	dst.sin_port = htons(7471);
	dst.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	ch = rdma_create_event_channel();
	if (!ch) { perror("rdma_create_event_channel"); return 1; }
	if (pthread_create(&t, NULL, reader, NULL)) { perror("pthread_create"); return 1; }
	for (intptr_t n = 0; n < ROUNDS; n++) {
		struct rdma_cm_id *id;
		if (rdma_create_id(ch, &id, (void *)n, RDMA_PS_TCP)) { perror("rdma_create_id"); return 1; }
		if (rdma_resolve_addr(id, NULL, (struct sockaddr *)&dst, 1000)) { perror("rdma_resolve_addr"); return 1; }
		usleep(rand() % 1000);
		if (rdma_destroy_id(id)) { perror("rdma_destroy_id"); return 1; }
		destroyed[n] = 1;
	}
	printf("cm_destroy_race: OK (%d events held)\n", held);
	fflush(stdout);
	return 0;
}
