// The one table of element types: their MPI datatypes and their names.
#ifndef JAXCOMM_KERNELS_DATATYPES_H_
#define JAXCOMM_KERNELS_DATATYPES_H_

#include <mpi.h>

#include <cstddef>
#include <cstdint>
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

// Entry `i` of an index array (counts, offsets) of element type int32 or
// int64, read and written as int64.
inline int64_t IndexAt(const void* data, ffi::DataType type, size_t i) {
  if (type == ffi::DataType::S32) return static_cast<const int32_t*>(data)[i];
  return static_cast<const int64_t*>(data)[i];
}

inline void SetIndex(void* data, ffi::DataType type, size_t i, int64_t value) {
  if (type == ffi::DataType::S32) {
    static_cast<int32_t*>(data)[i] = static_cast<int32_t>(value);
  } else {
    static_cast<int64_t*>(data)[i] = value;
  }
}

}  // namespace jaxcomm

#endif  // JAXCOMM_KERNELS_DATATYPES_H_
