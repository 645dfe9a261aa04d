// What the neighbourhood collectives' handlers share (neighbor.cc, and the
// nonblocking starts in nonblocking.cc).
#ifndef JAXCOMM_KERNELS_NEIGHBOR_H_
#define JAXCOMM_KERNELS_NEIGHBOR_H_

#include "call.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

namespace ffi = xla::ffi;

// This rank's numbers of neighbours it receives from and sends to, on a
// communicator with a distributed graph or Cartesian topology; an error on
// any other.
ffi::Error NeighborDegrees(const Call& call, int* indegree, int* outdegree);

// Fails unless `b` has a leading axis of `blocks` (a degree) entries.
ffi::Error CheckBlocks(const Call& call, const char* buffer, const ffi::AnyBuffer& b, int blocks,
                       const char* degree);

// MPI refuses null buffers even where a rank has no neighbours to move them
// to (MPICH checks the pointer before the count): a zero-length buffer of
// XLA's is given another address.
void* NotNull(void* data);
const void* NotNull(const void* data);

}  // namespace jaxcomm

#endif  // JAXCOMM_KERNELS_NEIGHBOR_H_
