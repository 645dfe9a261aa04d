/* The floor: the benchmarked ops as plain MPI calls from C, per call and in a loop.
 *
 * Each op makes the MPI call that the mpi4py reference makes (same buffers,
 * counts, datatype, roots and peers), so the time left is MPI's alone. In a
 * loop, the result times 0.5 is the next input, as in the jitted fori_loop:
 * the first block of a larger result, a smaller one repeated over the input.
 * Built at bench time with the MPI's mpicc and loaded with ctypes
 * (jaxcomm/bench/routes/c_floor.py).
 */
#include <mpi.h>
#include <stdint.h>
#include <string.h>

/* Where a call leaves its result; the loop's result is always the input. */
enum { IN_RECV = 0, IN_SEND = 1, NO_RESULT = 2, UNKNOWN_OP = -1 };

static int ring_source(int rank, int size) { return (rank - 1 + size) % size; }

static int ring_dest(int rank, int size) { return (rank + 1) % size; }

/* Even ranks send then receive, odd ranks echo; the last of an odd count idles. */
static int pingpong(MPI_Comm comm, int rank, int size, float* send, float* recv, int count) {
  int peer = rank ^ 1;
  if (peer >= size) return IN_SEND;
  if (rank % 2 == 0) {
    MPI_Send(send, count, MPI_FLOAT, peer, 0, comm);
    MPI_Recv(recv, count, MPI_FLOAT, peer, MPI_ANY_TAG, comm, MPI_STATUS_IGNORE);
  } else {
    MPI_Recv(recv, count, MPI_FLOAT, peer, MPI_ANY_TAG, comm, MPI_STATUS_IGNORE);
    MPI_Send(recv, count, MPI_FLOAT, peer, 0, comm);
  }
  return IN_RECV;
}

/* The ragged exchange (a migration step): rank i sends rank j a block of
 * `block` rows when i + j is even, half of one (rounded up) when odd, taken one
 * after another from the buffer's start (operations.py's ragged_counts). The
 * receive counts are learned with MPI_Alltoall, then MPI_Alltoallv moves the
 * rows, packed in rank order. */
static void ragged(MPI_Comm comm, int rank, int size, const float* send, int block, float* recv) {
  int sendcounts[size], recvcounts[size], senddispls[size], recvdispls[size];
  for (int j = 0; j < size; ++j) sendcounts[j] = (rank + j) % 2 == 0 ? block : (block + 1) / 2;
  MPI_Alltoall(sendcounts, 1, MPI_INT, recvcounts, 1, MPI_INT, comm);
  int sent = 0, received = 0;
  for (int j = 0; j < size; ++j) {
    senddispls[j] = sent;
    recvdispls[j] = received;
    sent += sendcounts[j];
    received += recvcounts[j];
  }
  MPI_Alltoallv(send, sendcounts, senddispls, MPI_FLOAT, recv, recvcounts, recvdispls, MPI_FLOAT,
                comm);
}

/* One op; the counts are whole buffers (a split input has `size` blocks). */
static int call(const char* op, MPI_Comm comm, int rank, int size, float* send, int count,
                float* recv) {
  int block = count / size;
  if (!strcmp(op, "allreduce")) {
    MPI_Allreduce(send, recv, count, MPI_FLOAT, MPI_SUM, comm);
  } else if (!strcmp(op, "reduce")) {
    MPI_Reduce(send, recv, count, MPI_FLOAT, MPI_SUM, 0, comm);
  } else if (!strcmp(op, "bcast")) {
    MPI_Bcast(send, count, MPI_FLOAT, 0, comm);
    return IN_SEND;
  } else if (!strcmp(op, "allgather")) {
    MPI_Allgather(send, count, MPI_FLOAT, recv, count, MPI_FLOAT, comm);
  } else if (!strcmp(op, "gather")) {
    MPI_Gather(send, count, MPI_FLOAT, recv, count, MPI_FLOAT, 0, comm);
  } else if (!strcmp(op, "scatter")) {
    MPI_Scatter(send, block, MPI_FLOAT, recv, block, MPI_FLOAT, 0, comm);
  } else if (!strcmp(op, "alltoall")) {
    MPI_Alltoall(send, block, MPI_FLOAT, recv, block, MPI_FLOAT, comm);
  } else if (!strcmp(op, "ragged")) {
    ragged(comm, rank, size, send, block, recv);
  } else if (!strcmp(op, "reduce_scatter")) {
    MPI_Reduce_scatter_block(send, recv, block, MPI_FLOAT, MPI_SUM, comm);
  } else if (!strcmp(op, "scan")) {
    MPI_Scan(send, recv, count, MPI_FLOAT, MPI_SUM, comm);
  } else if (!strcmp(op, "exscan")) {
    MPI_Exscan(send, recv, count, MPI_FLOAT, MPI_SUM, comm);
  } else if (!strcmp(op, "sendrecv")) {
    MPI_Sendrecv(send, count, MPI_FLOAT, ring_dest(rank, size), 0, recv, count, MPI_FLOAT,
                 ring_source(rank, size), MPI_ANY_TAG, comm, MPI_STATUS_IGNORE);
  } else if (!strcmp(op, "send_recv")) {
    return pingpong(comm, rank, size, send, recv, count);
  } else if (!strcmp(op, "barrier")) {
    MPI_Barrier(comm);
    return NO_RESULT;
  } else {
    return UNKNOWN_OP;
  }
  return IN_RECV;
}

/* send = from * 0.5, `from` repeated where it is shorter. Whole blocks keep
 * the inner loop free of divisions, so the compiler vectorises it. */
static void halve_into(float* send, int64_t send_count, const float* from, int64_t from_count) {
  if (from == send || from_count > send_count) from_count = send_count;
  for (int64_t start = 0; start < send_count; start += from_count) {
    int64_t n = send_count - start < from_count ? send_count - start : from_count;
    for (int64_t k = 0; k < n; ++k) send[start + k] = from[k] * 0.5f;
  }
}

/* `iters` ops of `op` on `send` (`send_count` floats) into `recv` (`recv_count`).
 *
 * With `loop` set, each result times 0.5 becomes `send` before the next op,
 * and `send` (the carry) is the result. Returns where the last result is
 * (IN_RECV, IN_SEND, NO_RESULT) or UNKNOWN_OP. MPI errors abort, as MPI's
 * default handler does.
 */
int jaxcomm_floor(int64_t handle, const char* op, int loop, float* send, int64_t send_count,
                  float* recv, int64_t recv_count, int64_t iters) {
#if defined(MPI_ABI_VERSION) && MPI_ABI_VERSION >= 1
  /* The MPI-5 standard ABI has no Fortran handles: mpi4py's py2f() is MPI_Comm_toint. */
  MPI_Comm comm = MPI_Comm_fromint((int)handle);
#else
  MPI_Comm comm = MPI_Comm_f2c((MPI_Fint)handle);
#endif
  int rank, size;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  int where = NO_RESULT;
  for (int64_t i = 0; i < iters; ++i) {
    where = call(op, comm, rank, size, send, (int)send_count, recv);
    if (where == UNKNOWN_OP) return where;
    if (!loop || where == NO_RESULT) continue;
    halve_into(send, send_count, where == IN_SEND ? send : recv, recv_count);
  }
  return loop ? IN_SEND : where;
}

/* The MPI library this was built with, to compare with the one mpi4py loaded. */
void jaxcomm_floor_mpi_library(char* version, int* length) {
  MPI_Get_library_version(version, length);
}

/* The size of a communicator handle in the ABI this was built for: MPICH's
 * own ABI and the standard ABI of the same MPICH print the same version line. */
int jaxcomm_floor_comm_size(void) { return (int)sizeof(MPI_Comm); }
