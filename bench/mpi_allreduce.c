/* bench/mpi_allreduce.c - Open MPI's MPI_Allreduce (float32 sum, in place)
 * timed the way bench/allreduce.py times Ember and gloo: per size, warm-up
 * calls, a barrier, `iters` calls, and the slowest rank's mean time.
 *
 * usage: mpirun -np N mpi_allreduce SIZE_BYTES[:ITERS] ...
 * prints one line per size on rank 0: "mpi SIZE_BYTES SECONDS_PER_CALL" */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
  int rank = 0, size = 1;
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  for (int a = 1; a < argc; a++) {
    char *colon = NULL;
    long long bytes = strtoll(argv[a], &colon, 10);
    int iters = (colon && *colon == ':') ? atoi(colon + 1) : 10;
    if (bytes <= 0 || iters <= 0) {
      if (rank == 0) fprintf(stderr, "bad argument '%s' (SIZE_BYTES[:ITERS])\n", argv[a]);
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
    long long count = bytes / 4;
    float *buf = malloc((size_t)count * sizeof *buf);
    if (buf == NULL) MPI_Abort(MPI_COMM_WORLD, 3);
    for (long long i = 0; i < count; i++) buf[i] = (float)(i % 7);
    int warm = bytes >= (64LL << 20) ? 1 : 2;
    for (int w = 0; w < warm; w++)
      MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    for (int it = 0; it < iters; it++)
      MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double dt = (MPI_Wtime() - t0) / iters, worst = 0;
    MPI_Reduce(&dt, &worst, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) {
      printf("mpi %lld %.9f\n", bytes, worst);
      fflush(stdout);
    }
    free(buf);
  }
  MPI_Finalize();
  return 0;
}
