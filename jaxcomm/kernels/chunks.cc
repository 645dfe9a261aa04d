#include "chunks.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <string>

#include "datatypes.h"

namespace jaxcomm {
namespace {
std::atomic<size_t> max_count{static_cast<size_t>(INT_MAX)};
// 4 MiB: the best piece size measured for staged GPU buffers (docs/gpu.md).
std::atomic<size_t> pipeline_bytes{size_t{4} << 20};
}  // namespace

size_t PipelineBytes() { return pipeline_bytes.load(std::memory_order_relaxed); }

void SetPipelineBytes(size_t bytes) { pipeline_bytes.store(bytes); }

size_t PieceElements(size_t count, size_t width) {
  const size_t piece = PipelineBytes();
  if (piece == 0 || width == 0 || count * width < 2 * piece) return count;
  return std::max<size_t>(1, std::min(std::max<size_t>(piece / width, 1), MaxCount()));
}

size_t MaxCount() { return max_count.load(std::memory_order_relaxed); }

void SetMaxCount(size_t count) {
  max_count.store(count < 1                              ? 1
                  : count > static_cast<size_t>(INT_MAX) ? static_cast<size_t>(INT_MAX)
                                                         : count);
}

ffi::Error LargeType::Make(ffi::DataType element_type, size_t count, MPI_Comm comm,
                           LargeType* out) {
  MPI_Datatype base;
  JAXCOMM_RETURN_IF_ERROR(MpiDatatype(element_type, &base));
  return Make(base, count, comm, out);
}

LargeType::~LargeType() {
  for (MPI_Datatype& t : owned_) {
    if (t != MPI_DATATYPE_NULL) MPI_Type_free(&t);
  }
}

ffi::Error LargeType::Make(MPI_Datatype base, size_t count, MPI_Comm comm, LargeType* out) {
  const size_t max = MaxCount();
  if (count <= max) {
    out->type_ = base;
    out->count_ = static_cast<int>(count);
    return ffi::Error::Success();
  }
  // count = blocks * max + rest: a contiguous run of `blocks` chunks of `max`
  // elements, then `rest` elements, as one struct element.
  const size_t blocks = count / max, rest = count % max;
  if (blocks > max) {
    return ffi::Error::InvalidArgument(
        "jaxcomm: " + std::to_string(count) + " elements exceed the " +
        std::to_string(max * max + max - 1) + " elements one MPI call can describe");
  }
  MPI_Datatype& chunk = out->owned_[0];
  MPI_Datatype& body = out->owned_[1];
  JAXCOMM_MPI_CHECK(comm, MPI_Type_contiguous, static_cast<int>(max), base, &chunk);
  JAXCOMM_MPI_CHECK(comm, MPI_Type_contiguous, static_cast<int>(blocks), chunk, &body);
  MPI_Datatype whole = body;
  if (rest > 0) {
    MPI_Aint lb, extent;
    JAXCOMM_MPI_CHECK(comm, MPI_Type_get_extent, base, &lb, &extent);
    int lengths[2] = {1, static_cast<int>(rest)};
    MPI_Aint displacements[2] = {0, static_cast<MPI_Aint>(blocks * max) * extent};
    MPI_Datatype types[2] = {body, base};
    JAXCOMM_MPI_CHECK(comm, MPI_Type_create_struct, 2, lengths, displacements, types,
                      &out->owned_[2]);
    whole = out->owned_[2];
  }
  JAXCOMM_MPI_CHECK(comm, MPI_Type_commit, &whole);
  out->type_ = whole;
  out->count_ = 1;
  return ffi::Error::Success();
}

}  // namespace jaxcomm
