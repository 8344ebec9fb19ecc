/*
 * The checks of the rsocket C tests (rsocket_check.c, riomap_check.c):
 * CHECK(cond, fmt, ...) ends the program with its line, the message and
 * errno when cond is false; FAILS(call, err, what) wants call to return
 * -1 with errno err. The including file defines CHECK_NAME first.
 */
#ifndef RCHECK_H
#define RCHECK_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(cond, ...)                                                      \
	do {                                                                  \
		if (!(cond)) {                                                \
			fprintf(stderr, CHECK_NAME ": line %d: ", __LINE__);  \
			fprintf(stderr, __VA_ARGS__);                         \
			fprintf(stderr, " (errno %d)\n", errno);              \
			exit(1);                                              \
		}                                                             \
	} while (0)

#define FAILS(call, err, what)                                               \
	do {                                                                 \
		errno = 0;                                                   \
		CHECK((long) (call) == -1 && errno == (err), "%s", what);    \
	} while (0)

#endif
