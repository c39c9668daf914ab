/* Open MPI's side of the ping-pong (run_pingpong.py): rank 0 sends SIZE bytes to rank 1, which sends them
 * back, N times after a warm-up round of N; prints the microseconds per round trip. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    int n = atoi(argv[1]), size = atoi(argv[2]);
    char *buf = calloc((size_t)size, 1);
    for (int round = 0; round < 2; round++) {
        MPI_Barrier(MPI_COMM_WORLD);
        double start = MPI_Wtime();
        for (int i = 0; i < n; i++) {
            if (rank == 0) {
                MPI_Send(buf, size, MPI_BYTE, 1, 0, MPI_COMM_WORLD);
                MPI_Recv(buf, size, MPI_BYTE, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            } else {
                MPI_Recv(buf, size, MPI_BYTE, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                MPI_Send(buf, size, MPI_BYTE, 0, 0, MPI_COMM_WORLD);
            }
        }
        if (rank == 0 && round == 1)
            printf("pingpong system=%s bytes=%d usec=%.1f\n", argc > 3 ? argv[3] : "mpi", size,
                   (MPI_Wtime() - start) * 1e6 / n);
    }
    free(buf);
    MPI_Finalize();
    return 0;
}
