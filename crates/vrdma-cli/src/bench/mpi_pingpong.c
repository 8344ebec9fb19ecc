/* vrdma bench --direct: an 8-byte MPI_Send/MPI_Recv ping-pong between two
 * ranks (osu_latency's loop). argv[1] round trips after a tenth as many
 * untimed; each round trip timed with MPI_Wtime at rank 0, which prints
 * "pingpong <n> median_ns <m> mean_ns <a>" (one way: half a round trip).
 * Every reply is checked; a wrong one exits non-zero. */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    int rank, size, bad = 0;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    long n = argc > 1 ? atol(argv[1]) : 10000;
    if (size != 2 || n < 1 || n > 10000000) {
        if (rank == 0)
            fprintf(stderr, "needs 2 ranks and 1..10000000 round trips\n");
        MPI_Finalize();
        return 2;
    }
    long warm = n / 10;
    double *t = malloc(sizeof(double) * (size_t)n);
    if (!t)
        MPI_Abort(MPI_COMM_WORLD, 3);
    uint64_t v = 0;
    for (long i = 0; i < warm + n && !bad; i++) {
        double t0 = MPI_Wtime();
        if (rank == 0) {
            v = (uint64_t)i;
            MPI_Send(&v, 8, MPI_BYTE, 1, 9, MPI_COMM_WORLD);
            MPI_Recv(&v, 8, MPI_BYTE, 1, 9, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            if (v != (uint64_t)i + 1000000)
                bad = 1;
            if (i >= warm)
                t[i - warm] = (MPI_Wtime() - t0) / 2 * 1e9;
        } else {
            MPI_Recv(&v, 8, MPI_BYTE, 0, 9, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            v += 1000000;
            MPI_Send(&v, 8, MPI_BYTE, 0, 9, MPI_COMM_WORLD);
        }
    }
    MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0 && !bad) {
        double sum = 0;
        for (long i = 0; i < n; i++)
            sum += t[i];
        qsort(t, (size_t)n, sizeof(double), cmp);
        printf("pingpong %ld median_ns %.1f mean_ns %.1f\n", n, t[n / 2], sum / (double)n);
    } else if (rank == 0) {
        fprintf(stderr, "a reply came back wrong\n");
    }
    free(t);
    MPI_Finalize();
    return bad;
}
