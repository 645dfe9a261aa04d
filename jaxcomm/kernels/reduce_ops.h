// The one table of reductions: jaxcomm's reduction codes and the MPI_Op each
// reduces an element type with, MPI's own or one of jaxcomm's.
#ifndef JAXCOMM_KERNELS_REDUCE_OPS_H_
#define JAXCOMM_KERNELS_REDUCE_OPS_H_

#include <mpi.h>

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

namespace ffi = xla::ffi;

// Reduction codes shared with jaxcomm/ops/_base.py (REDUCTION_OPS).
enum class ReduceOp : int64_t {
  kSum = 0,
  kProd = 1,
  kMin = 2,
  kMax = 3,
  kLand = 4,
  kLor = 5,
  kLxor = 6,
  kBand = 7,
  kBor = 8,
  kBxor = 9,
};

// MPI_Op for a reduction code and element type: a predefined op, or one of
// jaxcomm's own (created on first use, hence `comm` for errors): every
// float16/bfloat16 reduction, and MIN and MAX of every floating type, which
// propagate NaN like jnp.minimum/jnp.maximum on every rank alike.
ffi::Error MpiReduceOp(int64_t code, ffi::DataType dtype, MPI_Comm comm, MPI_Op* out);

const char* ReduceOpName(int64_t code);

// Whether MpiReduceOp gives one of jaxcomm's own ops, whose functions run on
// the host: the buffers of such a reduction must be in host memory.
bool IsOwnReduceOp(int64_t code, ffi::DataType dtype);

}  // namespace jaxcomm

#endif  // JAXCOMM_KERNELS_REDUCE_OPS_H_
