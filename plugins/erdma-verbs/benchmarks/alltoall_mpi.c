/* The seeds' sequential all-to-all report's MPI side: every rank sends BYTES to every rank with MPI_Alltoall,
 * STAGES times; prints the seconds the stages took (after MPI_Init and a barrier) and checks every byte of the
 * last stage. Built with mpicc by run_alltoall.py; run with mpirun in the guest. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int stages = argc > 1 ? atoi(argv[1]) : 100;
    int bytes = argc > 2 ? atoi(argv[2]) : 4096;
    unsigned char *out = malloc((size_t)bytes * size), *in = malloc((size_t)bytes * size);
    MPI_Barrier(MPI_COMM_WORLD);
    double start = MPI_Wtime();
    for (int s = 0; s < stages; s++) {
        for (int p = 0; p < size; p++) memset(out + (size_t)p * bytes, (rank * 31 + p * 7 + s) & 0xFF, bytes);
        MPI_Alltoall(out, bytes, MPI_BYTE, in, bytes, MPI_BYTE, MPI_COMM_WORLD);
    }
    double took = MPI_Wtime() - start;
    int bad = 0;
    for (int p = 0; p < size; p++)
        for (int i = 0; i < bytes; i++)
            bad += in[(size_t)p * bytes + i] != ((p * 31 + rank * 7 + stages - 1) & 0xFF);
    double worst;
    MPI_Reduce(&took, &worst, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) printf("mpi stages=%d bytes=%d seconds=%.4f\n", stages, bytes, worst);
    if (bad) fprintf(stderr, "rank %d: %d bytes differ\n", rank, bad);
    MPI_Finalize();
    return bad != 0;
}
