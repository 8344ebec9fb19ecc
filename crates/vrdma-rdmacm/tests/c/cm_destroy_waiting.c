/* A thread waits in rdma_get_cm_event while the main thread destroys the
 * channel and returns from main, as rping does at its end. With the
 * kernel's librdmacm the waiter's read() holds the file: it goes on
 * waiting (and would get an event that came). It must not return an
 * error (rping's event thread exits the process with it) nor touch freed
 * memory. Prints "cm_destroy_waiting: OK" and exits 0. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <rdma/rdma_cma.h>

static struct rdma_event_channel *ch;
static volatile int waiting;

static void *waiter(void *arg)
{
	struct rdma_cm_event *ev;
	(void)arg;
	waiting = 1;
	int ret = rdma_get_cm_event(ch, &ev);
	/* Never reached while the channel has no event. */
	fprintf(stderr, "cm_destroy_waiting: rdma_get_cm_event returned %d\n", ret);
	exit(3);
	return NULL;
}

int main(void)
{
	pthread_t t;
	struct rdma_cm_id *id;

	ch = rdma_create_event_channel();
	if (!ch) { perror("rdma_create_event_channel"); return 1; }
	if (rdma_create_id(ch, &id, NULL, RDMA_PS_TCP)) { perror("rdma_create_id"); return 1; }
	if (pthread_create(&t, NULL, waiter, NULL)) { perror("pthread_create"); return 1; }
	while (!waiting)
		usleep(1000);
	usleep(100000); /* the waiter is inside its wait */
	if (rdma_destroy_id(id)) { perror("rdma_destroy_id"); return 1; }
	rdma_destroy_event_channel(ch);
	/* Past the library's one-second wait slice: a waiter that looked
	 * again would have returned by now. */
	sleep(2);
	printf("cm_destroy_waiting: OK\n");
	fflush(stdout);
	return 0;
}
