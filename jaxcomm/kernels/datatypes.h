// The one table of element types: their MPI datatypes and their names.
#ifndef JAXCOMM_KERNELS_DATATYPES_H_
#define JAXCOMM_KERNELS_DATATYPES_H_

#include <mpi.h>

#include <cstddef>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

namespace ffi = xla::ffi;

// Element type name as NumPy spells it, for logs and error messages.
const char* DtypeName(ffi::DataType dtype);

// MPI datatype that moves one element of `dtype`. Half-precision types move
// as 16-bit words; their reductions go through jaxcomm's own ops
// (reduce_ops.h).
ffi::Error MpiDatatype(ffi::DataType dtype, MPI_Datatype* out);

// "count <n> <dtype>", the tail of most log lines.
std::string Elements(size_t count, ffi::DataType dtype);

}  // namespace jaxcomm

#endif  // JAXCOMM_KERNELS_DATATYPES_H_
