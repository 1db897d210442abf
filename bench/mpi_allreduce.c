/* bench/mpi_allreduce.c - Open MPI's MPI_Allreduce (float32 sum, in place)
 * timed the way bench/allreduce.py times Ember and gloo: per size, warm-up
 * calls, a barrier, `iters` calls, and the slowest rank's mean time.
 *
 * usage: mpirun -np N mpi_allreduce SIZE_BYTES[:ITERS[:TARGET_SECONDS]] ...
 * With TARGET_SECONDS > 0, the warm-up goes on in doubling runs of calls
 * (8 first) until the ranks have warmed up for 20 ms (or TARGET_SECONDS if
 * less), and the last run's time per call raises ITERS to fill
 * TARGET_SECONDS (at most 100000), the ranks agreeing on the largest count.
 * Prints one line per size on rank 0: "mpi SIZE_BYTES SECONDS_PER_CALL". */
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
    char *rest = NULL;
    int iters = (colon && *colon == ':') ? (int)strtol(colon + 1, &rest, 10) : 10;
    double target = (rest && *rest == ':') ? strtod(rest + 1, NULL) : 0.0;
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
    if (target > 0) {
      enum { PROBE = 8, MOST = 100000 };
      double warm_s = target < 0.02 ? target : 0.02, start = MPI_Wtime(), per = 0;
      for (int run = PROBE;; run *= 2) {
        double p0 = MPI_Wtime();
        for (int w = 0; w < run; w++)
          MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        double now = MPI_Wtime(), warmed = now - start;
        per = (now - p0) / run;
        MPI_Allreduce(MPI_IN_PLACE, &warmed, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (warmed >= warm_s) break;
      }
      double want = target / (per > 1e-9 ? per : 1e-9);
      int calls = want > MOST ? MOST : (int)want;
      if (calls > iters) iters = calls;
      MPI_Allreduce(MPI_IN_PLACE, &iters, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    }
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
