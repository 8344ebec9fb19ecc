/*
 * Direct placement (riomap, riounmap, riowrite) of the drop-in
 * librdmacm.so.1 on a carried connection, the cases riostream does not
 * reach: a riowrite before the peer mapped, past its mapping's end, to
 * an offset no mapping holds, after riounmap, from a null buffer; riomap
 * with a bad protection, buffer, offset or overlap, offset -1, a full
 * table; riounmap of what is not mapped; descriptors that carry nothing
 * (a pipe, an unknown one, a listener, a UDP rsocket). And the order:
 * bytes a riowrite placed are there when a message sent after it is
 * received. The server end runs on a thread (each end's first call waits
 * for the other's). Prints "riomap_check: OK" when all pass.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <sys/mman.h>
#include <rdma/rsocket.h>

#define CHECK_NAME "riomap_check"
#include "rcheck.h"

#define PAGE 4096
#define SLOTS 16

static int lfd;

static void expect(int fd, char c)
{
	char got = 0;

	CHECK(rrecv(fd, &got, 1, MSG_WAITALL) == 1 && got == c, "receive '%c' (got '%c')", c, got);
}

static char *page(void)
{
	void *p = mmap(NULL, PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

	CHECK(p != MAP_FAILED, "mmap");
	return p;
}

static void *server(void *arg)
{
	char *buf = page(), *more[SLOTS];
	int fd, i;

	(void) arg;
	fd = raccept(lfd, NULL, NULL);
	CHECK(fd >= 0, "raccept");
	/* The client tries to write before anything is mapped. */
	expect(fd, 'g');

	FAILS(riomap(fd, buf, PAGE, PROT_READ, 0, 0), EINVAL, "riomap PROT_READ");
	FAILS(riomap(fd, NULL, PAGE, PROT_WRITE, 0, 0), EINVAL, "riomap of a null buffer");
	FAILS(riomap(fd, buf, 0, PROT_WRITE, 0, 0), EINVAL, "riomap of no bytes");
	FAILS(riomap(fd, buf, PAGE, PROT_WRITE, 0, -2), EINVAL, "riomap at offset -2");
	CHECK(riomap(fd, buf, PAGE, PROT_WRITE, 0, 0) == 0, "riomap at offset 0");
	more[0] = page();
	FAILS(riomap(fd, more[0], 64, PROT_WRITE, 0, 100), EINVAL, "riomap overlapping a mapping");
	/* Offset -1: the buffer's address. The table holds 16, what
	 * RDMA_IOMAPSIZE reads. */
	{
		int size = -1;
		socklen_t len = sizeof(size);
		CHECK(rgetsockopt(fd, SOL_RDMA, RDMA_IOMAPSIZE, &size, &len) == 0, "rgetsockopt RDMA_IOMAPSIZE");
		CHECK(size == SLOTS, "RDMA_IOMAPSIZE reads %d, the table holds %d", size, SLOTS);
	}
	for (i = 1; i < SLOTS; i++) {
		more[i] = page();
		CHECK(riomap(fd, more[i], 64, PROT_WRITE, 0, -1) == (off_t) (uintptr_t) more[i], "riomap at -1");
	}
	FAILS(riomap(fd, more[0], 64, PROT_WRITE, 0, -1), ENOMEM, "a 17th mapping");
	for (i = 1; i < SLOTS; i++)
		CHECK(riounmap(fd, more[i], 64) == 0, "riounmap");
	FAILS(riounmap(fd, buf, 100), EINVAL, "riounmap of another length");
	FAILS(riounmap(fd, more[1], 64), EINVAL, "riounmap twice");
	CHECK(rsend(fd, "m", 1, 0) == 1, "rsend 'm'");

	/* The client's riowrites, then its message: the bytes are there. */
	expect(fd, 'w');
	for (i = 0; i < 4000; i++)
		CHECK(buf[i] == (char) (i * 7 + 1), "byte %d placed", i);
	CHECK(!memcmp(buf + PAGE - 6, "abcdef", 6), "the short write's bytes");

	CHECK(riounmap(fd, buf, PAGE) == 0, "riounmap");
	CHECK(rsend(fd, "u", 1, 0) == 1, "rsend 'u'");
	expect(fd, 'x');
	CHECK(rclose(fd) == 0, "rclose (server)");
	return NULL;
}

int main(void)
{
	struct sockaddr_in sin;
	socklen_t len;
	pthread_t t;
	char src[4096];
	int fd, ufd, pipefd[2], i;

	CHECK(pipe(pipefd) == 0, "pipe");
	FAILS(riomap(pipefd[0], src, 64, PROT_WRITE, 0, -1), ENOTSOCK, "riomap of a pipe");
	FAILS(riomap(9999, src, 64, PROT_WRITE, 0, -1), EBADF, "riomap of an unknown descriptor");
	FAILS(riowrite(9999, src, 64, 0, 0), EBADF, "riowrite of an unknown descriptor");
	FAILS(riounmap(9999, src, 64), EBADF, "riounmap of an unknown descriptor");
	ufd = rsocket(AF_INET, SOCK_DGRAM, 0);
	CHECK(ufd >= 0, "rsocket (UDP)");
	FAILS(riomap(ufd, src, 64, PROT_WRITE, 0, -1), EOPNOTSUPP, "riomap of a UDP rsocket");

	lfd = rsocket(AF_INET, SOCK_STREAM, 0);
	CHECK(lfd >= 0, "rsocket (listener)");
	memset(&sin, 0, sizeof sin);
	sin.sin_family = AF_INET;
	sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	CHECK(rbind(lfd, (struct sockaddr *) &sin, sizeof sin) == 0, "rbind");
	CHECK(rlisten(lfd, 4) == 0, "rlisten");
	len = sizeof sin;
	CHECK(rgetsockname(lfd, (struct sockaddr *) &sin, &len) == 0 && sin.sin_port, "rgetsockname");
	FAILS(riomap(lfd, src, 64, PROT_WRITE, 0, -1), EOPNOTSUPP, "riomap of a listener");
	CHECK(pthread_create(&t, NULL, server, NULL) == 0, "pthread_create");

	fd = rsocket(AF_INET, SOCK_STREAM, 0);
	CHECK(fd >= 0, "rsocket (client)");
	CHECK(rconnect(fd, (struct sockaddr *) &sin, sizeof sin) == 0, "rconnect");
	FAILS(riowrite(fd, src, 10, 0, 0), EINVAL, "riowrite before the peer mapped");
	CHECK(rsend(fd, "g", 1, 0) == 1, "rsend 'g'");
	expect(fd, 'm');

	for (i = 0; i < 4000; i++)
		src[i] = (char) (i * 7 + 1);
	FAILS(riowrite(fd, NULL, 10, 0, 0), EFAULT, "riowrite from null");
	FAILS(riowrite(fd, src, 10, -1, 0), EINVAL, "riowrite at offset -1");
	FAILS(riowrite(fd, src, 10, PAGE, 0), EINVAL, "riowrite at the mapping's end");
	FAILS(riowrite(fd, src, 10, 1 << 20, 0), EINVAL, "riowrite where nothing is mapped");
	CHECK(riowrite(fd, src, 0, 1 << 20, 0) == 0, "riowrite of no bytes");
	CHECK(riowrite(fd, src, 4000, 0, 0) == 4000, "riowrite");
	/* Past the end: short, as rdma-core's. */
	CHECK(riowrite(fd, "abcdefgh", 8, PAGE - 6, 0) == 6, "a riowrite past the end is short");
	CHECK(rsend(fd, "w", 1, 0) == 1, "rsend 'w'");

	expect(fd, 'u');
	FAILS(riowrite(fd, src, 10, 0, 0), EINVAL, "riowrite after the peer's riounmap");
	FAILS(riounmap(fd, src, 10), EINVAL, "riounmap of what was never mapped");
	CHECK(rsend(fd, "x", 1, 0) == 1, "rsend 'x'");
	CHECK(pthread_join(t, NULL) == 0, "pthread_join");
	CHECK(rclose(fd) == 0, "rclose (client)");
	CHECK(rclose(lfd) == 0, "rclose (listener)");
	CHECK(rclose(ufd) == 0, "rclose (UDP)");

	printf("riomap_check: OK\n");
	return 0;
}
