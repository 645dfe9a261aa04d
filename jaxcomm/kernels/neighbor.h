// What the neighbourhood collectives' handlers share (neighbor.cc, and the
// nonblocking starts in nonblocking.cc).
#ifndef JAXCOMM_KERNELS_NEIGHBOR_H_
#define JAXCOMM_KERNELS_NEIGHBOR_H_

#include <mpi.h>

#include <cstddef>
#include <vector>

#include "call.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

namespace ffi = xla::ffi;

// This rank's numbers of neighbours it receives from and sends to, on a
// communicator with a distributed graph or Cartesian topology; an error on
// any other.
ffi::Error NeighborDegrees(const Call& call, int* indegree, int* outdegree);

// Where each incoming block of MPI_Ineighbor_alltoall must land, on a
// communicator whose MPI library matches the blocks of two neighbours that
// are the same process in list order instead of as MPI defines.
//
// In a periodic dimension of 1 or 2 processes of a Cartesian grid, both
// neighbours of a dimension are the same process, and MPI-4.1 (section 8.6,
// an erratum to MPI-3.1) says block 2d+1 sent lands in block 2d received and
// block 2d in block 2d+1. The blocking collectives of MPICH and Open MPI do
// so; Open MPI's nonblocking ones (libnbc, 5.0.11 and earlier) instead put
// block s in block s. Which rule the library follows is found once per
// communicator, on its first MPI_Ineighbor_alltoall, by a probe exchange of
// block numbers (MPI_Ineighbor_alltoallw, the call the fix uses) and kept
// as an attribute of the communicator.
//
// `order` comes back empty when nothing needs fixing (no such dimension, or
// the library follows MPI); otherwise it has one entry per incoming block,
// the block of the result it must land in (the two blocks of each such
// dimension swapped), for MPI_Ineighbor_alltoallw's receive displacements.
ffi::Error NeighborReceiveOrder(const Call& call, std::vector<int>* order);

// Fails unless `b` has a leading axis of `blocks` (a degree) entries.
ffi::Error CheckBlocks(const Call& call, const char* buffer, const ffi::AnyBuffer& b, int blocks,
                       const char* degree);

// The rows of a neighbor_alltoallv once its headers are exchanged and
// checked: MPI_Neighbor_alltoallv's arguments, counts and displacements in
// rows of `row` (`row_bytes` long).
struct NeighborRows {
  const void* in;
  void* out;
  // Send counts and displacements (outdegree each), then receive counts and
  // displacements (indegree each).
  const int* ints;
  int outdegree, indegree;
  MPI_Datatype row;
  size_t row_bytes;
  size_t sent;  // elements, for the log
  ffi::DataType dtype;
  // neighbor_allgatherv: every destination gets the same rows (all send
  // counts equal, every send displacement 0), so they move by
  // MPI_Neighbor_allgatherv with this send count; -1 for an alltoallv.
  int gather_count = -1;

  const int* send_counts() const { return ints; }
  const int* send_displs() const { return ints + outdegree; }
  const int* recv_counts() const { return ints + 2 * outdegree; }
  const int* recv_displs() const { return ints + 2 * outdegree + indegree; }
};

// How a neighbor_alltoallv reaches its buffers and moves its rows: blocking
// (neighbor.cc) or started (nonblocking.cc).
class NeighborMover {
 public:
  virtual ~NeighborMover() = default;
  // The pointers MPI reads x through and writes the result `y` through
  // (left null unless `shaped`); `y` must start as the output's copy.
  virtual ffi::Error Buffers(const ffi::AnyBuffer& x, const ffi::AnyBuffer& output,
                             ffi::AnyBuffer& y, bool shaped, void** in, void** out) = 0;
  // `bytes` of memory that live until the rows have moved.
  virtual void* Scratch(size_t bytes) = 0;
  // Moves the rows, or starts moving them.
  virtual ffi::Error Move(const NeighborRows& rows) = 0;
  // After Move: the call fails with `error` once the rows have moved.
  virtual ffi::Error Fail(ffi::Error error) = 0;
  // After Move: the call succeeds.
  virtual ffi::Error Finish() = 0;
};

// neighbor_alltoallv of the rows of `x` by `counts` (outdegree send counts,
// then indegree receive counts; `reverse`: the other way round) into `y`,
// the output's copy, with the rows received from each source written to
// `received`: the header exchange and every check, then the rows by `mover`.
// `gather`: a neighbor_allgatherv, whose send counts are one count repeated
// and whose blocks all start at x's first row.
ffi::Error RunNeighborAlltoallv(const Call& call, Memory& memory, const ffi::AnyBuffer& x,
                                const ffi::AnyBuffer& output, const ffi::AnyBuffer& counts,
                                ffi::AnyBuffer& y, ffi::AnyBuffer& received, bool check_sizes,
                                bool reverse, NeighborMover& mover, bool gather = false);

// MPI refuses null buffers even where a rank has no neighbours to move them
// to (MPICH checks the pointer before the count): a zero-length buffer of
// XLA's is given another address.
void* NotNull(void* data);
const void* NotNull(const void* data);

}  // namespace jaxcomm

#endif  // JAXCOMM_KERNELS_NEIGHBOR_H_
