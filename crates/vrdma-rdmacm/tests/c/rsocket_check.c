/*
 * Checks of the rsocket API of the drop-in librdmacm.so.1 that rstream
 * and rcopy do not reach: bad input (null pointers, bad lengths and
 * counts, unknown descriptors and options) fails with -1 and errno, never
 * a crash, also on a connection carried over vRDMA; and on such a
 * connection readv/writev, MSG_PEEK, rpoll and rselect with an ordinary
 * descriptor in the same set, O_NONBLOCK through rfcntl (EAGAIN),
 * rgetpeername, SOL_RDMA options and a half-close. The server end runs on
 * a thread: each end's first call waits for the other's.
 * Prints "rsocket_check: OK" when all pass.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/tcp.h>
#include <sys/select.h>
#include <sys/uio.h>
#include <rdma/rsocket.h>

#define CHECK_NAME "rsocket_check"
#include "rcheck.h"

static int lfd;

static void *server(void *arg)
{
	char buf[16];
	struct iovec iov[2];
	int fd;

	(void) arg;
	fd = raccept(lfd, NULL, NULL);
	CHECK(fd >= 0, "raccept");
	/* "hello" then "world" in two iovecs, as one write. */
	iov[0].iov_base = "hello";
	iov[0].iov_len = 5;
	iov[1].iov_base = "world";
	iov[1].iov_len = 5;
	CHECK(rwritev(fd, iov, 2) == 10, "rwritev");
	/* The client's answer, then its end of stream. */
	CHECK(rrecv(fd, buf, 2, MSG_WAITALL) == 2 && !memcmp(buf, "ok", 2), "rrecv the answer");
	CHECK(rread(fd, buf, sizeof buf) == 0, "the client's half-close reads as the end");
	CHECK(rclose(fd) == 0, "rclose (server)");
	return NULL;
}

int main(void)
{
	struct sockaddr_in sin, peer;
	socklen_t len;
	pthread_t t;
	char buf[16];
	struct iovec iov[2];
	struct msghdr msg;
	struct pollfd pfd[2];
	fd_set rset;
	struct timeval tv;
	int fd, pipefd[2], val;

	/* What rsocket takes, and descriptors it does not know. */
	FAILS(rsocket(AF_UNIX, SOCK_STREAM, 0), ENOTSUP, "rsocket(AF_UNIX)");
	FAILS(rsocket(AF_INET, SOCK_RAW, 0), ENOTSUP, "rsocket(SOCK_RAW)");
	FAILS(rsocket(AF_INET, SOCK_STREAM, IPPROTO_UDP), ENOTSUP, "rsocket(stream, UDP)");
	FAILS(rread(9999, buf, 1), EBADF, "rread of an unknown descriptor");
	FAILS(rwrite(9999, buf, 1), EBADF, "rwrite of an unknown descriptor");
	FAILS(rclose(9999), EBADF, "rclose of an unknown descriptor");
	FAILS(rconnect(9999, NULL, 0), EFAULT, "rconnect with a null address");
	FAILS(rpoll(NULL, 1, 0), EFAULT, "rpoll of a null array");
	FAILS(rselect(-1, NULL, NULL, NULL, NULL), EINVAL, "rselect of -1 descriptors");
	FAILS(rselect(FD_SETSIZE + 1, NULL, NULL, NULL, NULL), EINVAL, "rselect past FD_SETSIZE");
	val = 1;
	FAILS(rsetsockopt(9999, SOL_RDMA, RDMA_SQSIZE, &val, sizeof val), EBADF, "SOL_RDMA of an unknown descriptor");

	/* A listener on loopback, port chosen by the kernel. */
	lfd = rsocket(AF_INET, SOCK_STREAM, 0);
	CHECK(lfd >= 0, "rsocket (listener)");
	memset(&sin, 0, sizeof sin);
	sin.sin_family = AF_INET;
	sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	FAILS(rbind(lfd, NULL, sizeof sin), EFAULT, "rbind with a null address");
	CHECK(rbind(lfd, (struct sockaddr *) &sin, sizeof sin) == 0, "rbind");
	CHECK(rlisten(lfd, 4) == 0, "rlisten");
	len = sizeof sin;
	CHECK(rgetsockname(lfd, (struct sockaddr *) &sin, &len) == 0 && sin.sin_port, "rgetsockname");
	CHECK(pthread_create(&t, NULL, server, NULL) == 0, "pthread_create");

	fd = rsocket(AF_INET, SOCK_STREAM, 0);
	CHECK(fd >= 0, "rsocket (client)");

	/* SOL_RDMA: accepted, rdma-core's defaults read back. */
	val = 256;
	CHECK(rsetsockopt(fd, SOL_RDMA, RDMA_SQSIZE, &val, sizeof val) == 0, "RDMA_SQSIZE");
	CHECK(rsetsockopt(fd, SOL_RDMA, RDMA_INLINE, &val, sizeof val) == 0, "RDMA_INLINE");
	FAILS(rsetsockopt(fd, SOL_RDMA, RDMA_RQSIZE, NULL, sizeof val), EINVAL, "SOL_RDMA with a null value");
	FAILS(rsetsockopt(fd, SOL_RDMA, RDMA_RQSIZE, &val, 2), EINVAL, "SOL_RDMA with a short value");
	FAILS(rsetsockopt(fd, SOL_RDMA, 99, &val, sizeof val), ENOPROTOOPT, "an unknown SOL_RDMA option");
	len = sizeof val;
	CHECK(rgetsockopt(fd, SOL_RDMA, RDMA_INLINE, &val, &len) == 0 && val == 64 && len == sizeof val,
	      "RDMA_INLINE reads 64");
	FAILS(rgetsockopt(fd, SOL_RDMA, RDMA_INLINE, &val, NULL), EFAULT, "SOL_RDMA with a null length");
	val = 1;
	CHECK(rsetsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &val, sizeof val) == 0, "TCP_NODELAY");

	CHECK(rconnect(fd, (struct sockaddr *) &sin, sizeof sin) == 0, "rconnect");
	len = sizeof peer;
	CHECK(rgetpeername(fd, (struct sockaddr *) &peer, &len) == 0 && peer.sin_port == sin.sin_port,
	      "rgetpeername");

	/* Readiness: an ordinary pipe beside the rsocket. */
	CHECK(pipe(pipefd) == 0, "pipe");
	pfd[0].fd = pipefd[0];
	pfd[0].events = POLLIN;
	pfd[1].fd = fd;
	pfd[1].events = POLLIN;
	CHECK(rpoll(pfd, 2, 10000) == 1 && (pfd[1].revents & POLLIN) && !pfd[0].revents,
	      "rpoll: the rsocket readable, the pipe not");

	/* The bytes: peeked, then read in two iovecs and a msghdr. */
	CHECK(rrecv(fd, buf, 5, MSG_PEEK | MSG_WAITALL) == 5 && !memcmp(buf, "hello", 5), "MSG_PEEK");

	/* Bad buffers on the connection, carried now and its ring not empty:
	 * errors, not a crash (the carrier copies in user space). */
	FAILS(rread(fd, NULL, 5), EFAULT, "rread into null");
	FAILS(rrecv(fd, NULL, 5, 0), EFAULT, "rrecv into null");
	FAILS(rrecvfrom(fd, buf, 5, 0, (struct sockaddr *) &peer, NULL), EFAULT, "rrecvfrom without a length");
	FAILS(rrecvmsg(fd, NULL, 0), EFAULT, "rrecvmsg of a null header");
	iov[0].iov_base = NULL;
	iov[0].iov_len = 5;
	FAILS(rreadv(fd, iov, 1), EFAULT, "rreadv into a null base");
	FAILS(rreadv(fd, NULL, 1), EFAULT, "rreadv of a null array");
	FAILS(rreadv(fd, iov, -1), EINVAL, "rreadv of -1 iovecs");
	FAILS(rreadv(fd, iov, IOV_MAX + 1), EINVAL, "rreadv of IOV_MAX + 1 iovecs");
	FAILS(rwritev(fd, iov, 1), EFAULT, "rwritev from a null base");
	FAILS(rwrite(fd, NULL, 5), EFAULT, "rwrite from null");
	FAILS(rsend(fd, NULL, 5, 0), EFAULT, "rsend from null");
	FAILS(rsendmsg(fd, NULL, 0), EFAULT, "rsendmsg of a null header");
	FAILS(rshutdown(fd, 7), EINVAL, "rshutdown how 7");

	iov[0].iov_base = buf;
	iov[0].iov_len = 3;
	iov[1].iov_base = buf + 3;
	iov[1].iov_len = 2;
	CHECK(rreadv(fd, iov, 2) == 5 && !memcmp(buf, "hello", 5), "rreadv");
	memset(&msg, 0, sizeof msg);
	iov[0].iov_base = buf;
	iov[0].iov_len = 5;
	msg.msg_iov = iov;
	msg.msg_iovlen = 1;
	CHECK(rrecvmsg(fd, &msg, MSG_WAITALL) == 5 && !memcmp(buf, "world", 5), "rrecvmsg");

	/* Nothing left: non-blocking says EAGAIN, select says not ready. */
	CHECK(rfcntl(fd, F_SETFL, rfcntl(fd, F_GETFL) | O_NONBLOCK) == 0, "rfcntl O_NONBLOCK");
	CHECK(rfcntl(fd, F_GETFL) & O_NONBLOCK, "rfcntl F_GETFL");
	FAILS(rrecv(fd, buf, 1, 0), EAGAIN, "EAGAIN with nothing to read");
	FD_ZERO(&rset);
	FD_SET(fd, &rset);
	FD_SET(pipefd[0], &rset);
	tv.tv_sec = 0;
	tv.tv_usec = 1000;
	CHECK(rselect((fd > pipefd[0] ? fd : pipefd[0]) + 1, &rset, NULL, NULL, &tv) == 0, "rselect: nothing ready");
	CHECK(write(pipefd[1], "x", 1) == 1, "write the pipe");
	FD_SET(fd, &rset);
	FD_SET(pipefd[0], &rset);
	tv.tv_sec = 10;
	tv.tv_usec = 0;
	CHECK(rselect((fd > pipefd[0] ? fd : pipefd[0]) + 1, &rset, NULL, NULL, &tv) == 1 &&
	      FD_ISSET(pipefd[0], &rset) && !FD_ISSET(fd, &rset), "rselect: the pipe ready, the rsocket not");
	CHECK(rfcntl(fd, F_SETFL, rfcntl(fd, F_GETFL) & ~O_NONBLOCK) == 0, "rfcntl blocking");

	/* The answer, the half-close, and the server's end. */
	CHECK(rsend(fd, "ok", 2, 0) == 2, "rsend");
	CHECK(rshutdown(fd, SHUT_WR) == 0, "rshutdown SHUT_WR");
	CHECK(pthread_join(t, NULL) == 0, "pthread_join");
	CHECK(rread(fd, buf, sizeof buf) == 0, "the server's close reads as the end");
	CHECK(rclose(fd) == 0, "rclose (client)");
	CHECK(rclose(lfd) == 0, "rclose (listener)");

	printf("rsocket_check: OK\n");
	return 0;
}
