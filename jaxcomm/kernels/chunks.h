// Counts past MPI's int: the cap on one MPI call's count, derived datatypes
// that describe more elements as one, and pieces for what no datatype can
// describe (reductions).
#ifndef JAXCOMM_KERNELS_CHUNKS_H_
#define JAXCOMM_KERNELS_CHUNKS_H_

#include <mpi.h>

#include <cstddef>

#include "errors.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

namespace ffi = xla::ffi;

// Largest count handed to one MPI call: INT_MAX (MPI's int counts) unless
// lowered, which the tests do to run the large-message paths on small arrays.
size_t MaxCount();
void SetMaxCount(size_t count);

// `count` elements of `base` as MPI arguments: (base, count) when count fits
// MaxCount(), else one element of a derived datatype that spans them all.
// Frees the derived datatypes when destroyed. For data movement only: MPI's
// predefined reductions do not apply to derived datatypes (use ForEachChunk).
class LargeType {
 public:
  LargeType() = default;
  LargeType(const LargeType&) = delete;
  LargeType& operator=(const LargeType&) = delete;
  ~LargeType();

  static ffi::Error Make(MPI_Datatype base, size_t count, MPI_Comm comm, LargeType* out);
  // The same for `count` elements of an XLA element type.
  static ffi::Error Make(ffi::DataType element_type, size_t count, MPI_Comm comm, LargeType* out);

  MPI_Datatype type() const { return type_; }
  int count() const { return count_; }

 private:
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
  int count_ = 0;
  MPI_Datatype owned_[3] = {MPI_DATATYPE_NULL, MPI_DATATYPE_NULL, MPI_DATATYPE_NULL};
};

// Pipelining: a collective of at least two pieces of PipelineBytes() bytes
// goes to MPI piece by piece, so that on a GPU without CUDA-aware MPI the
// staging copy of one piece runs while MPI moves another. 0 turns it off.
// The pieces are cut the same way on every platform (a GPU rank and a CPU
// rank make the same MPI calls), so the setting must be the same on every
// rank of a communicator. 4 MiB by default.
size_t PipelineBytes();
void SetPipelineBytes(size_t bytes);

// Elements of one piece of a collective on `count` elements of `width`
// bytes each: `count` (no pipelining) when the message spans fewer than two
// pieces, else PipelineBytes() worth (at least one element) and at most
// MaxCount().
size_t PieceElements(size_t count, size_t width);

// Calls fn(offset, count) over consecutive pieces of at most `max` elements
// (MaxCount() unless given) covering [0, total), at least once (with count 0
// when total is 0), and stops at the first error.
template <typename Fn>
ffi::Error ForEachChunk(size_t total, Fn&& fn, size_t max = MaxCount()) {
  if (max > MaxCount()) max = MaxCount();
  size_t offset = 0;
  do {
    const size_t n = total - offset < max ? total - offset : max;
    ffi::Error err = fn(offset, static_cast<int>(n));
    if (err.failure()) return err;
    offset += n;
  } while (offset < total);
  return ffi::Error::Success();
}

// Address of element `offset` of a buffer of `dtype`.
inline void* ElementAt(void* data, ffi::DataType dtype, size_t offset) {
  return static_cast<char*>(data) + offset * ffi::ByteWidth(dtype);
}

// The same for a buffer argument of an MPI call, which may also be
// MPI_IN_PLACE or null (not significant on this rank): those stay as they are.
inline void* ArgumentAt(void* data, ffi::DataType dtype, size_t offset) {
  if (data == MPI_IN_PLACE || data == nullptr) return data;
  return ElementAt(data, dtype, offset);
}

}  // namespace jaxcomm

#endif  // JAXCOMM_KERNELS_CHUNKS_H_
