/* Two ranks over MPI: a 64 MiB MPI_Send/MPI_Recv whose every byte is
 * checked, then an 8-byte ping-pong. Prints one line per result; exits
 * non-zero on any mismatch. */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BIG (64u << 20)
#define PINGS 1000

static unsigned char pattern(size_t i) { return (unsigned char)((i * 2654435761u) >> 13); }

int main(int argc, char **argv)
{
    int rank, size, bad = 0;
    char host[MPI_MAX_PROCESSOR_NAME];
    int hlen;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Get_processor_name(host, &hlen);
    printf("rank %d of %d on %s\n", rank, size, host);
    fflush(stdout);
    if (size != 2) {
        if (rank == 0)
            fprintf(stderr, "needs exactly 2 ranks, got %d\n", size);
        MPI_Finalize();
        return 2;
    }
    unsigned char *buf = malloc(BIG);
    if (!buf) {
        fprintf(stderr, "rank %d: no memory\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 3);
    }
    if (rank == 0) {
        for (size_t i = 0; i < BIG; i++)
            buf[i] = pattern(i);
        MPI_Send(buf, BIG, MPI_BYTE, 1, 7, MPI_COMM_WORLD);
    } else {
        MPI_Status st;
        int count;
        memset(buf, 0, BIG);
        MPI_Recv(buf, BIG, MPI_BYTE, 0, 7, MPI_COMM_WORLD, &st);
        MPI_Get_count(&st, MPI_BYTE, &count);
        size_t wrong = 0;
        for (size_t i = 0; i < BIG; i++)
            wrong += buf[i] != pattern(i);
        if (count != (int)BIG || wrong) {
            fprintf(stderr, "rank 1: received %d bytes, %zu wrong\n", count, wrong);
            bad = 1;
        } else {
            printf("rank 1: 64 MiB received intact\n");
        }
    }
    MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);

    uint64_t v = 0;
    double t0 = MPI_Wtime();
    for (uint64_t i = 0; i < PINGS && !bad; i++) {
        if (rank == 0) {
            v = i;
            MPI_Send(&v, 8, MPI_BYTE, 1, 9, MPI_COMM_WORLD);
            MPI_Recv(&v, 8, MPI_BYTE, 1, 9, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            if (v != i + 1000000) {
                fprintf(stderr, "rank 0: ping %llu came back as %llu\n", (unsigned long long)i,
                        (unsigned long long)v);
                bad = 1;
            }
        } else {
            MPI_Recv(&v, 8, MPI_BYTE, 0, 9, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            v += 1000000;
            MPI_Send(&v, 8, MPI_BYTE, 0, 9, MPI_COMM_WORLD);
        }
    }
    double t = MPI_Wtime() - t0;
    MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0 && !bad)
        printf("ping-pong: %d round trips of 8 bytes, %.2f us one way\n", PINGS, t / PINGS / 2 * 1e6);
    free(buf);
    MPI_Finalize();
    return bad;
}
