// Broadcast: MPI_Bcast.
#include "common.h"

namespace jaxcomm {

ffi::Error BcastImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                     ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y, int64_t root) {
  JAXCOMM_RETURN_IF_ERROR(call.Announce(Collective::Of(x).Root(root)));
  const size_t count = x.element_count();
  JAXCOMM_RETURN_IF_ERROR(CheckOutput(call, x, *y, x.element_count(), LikeTheInput));
  LargeType type;
  JAXCOMM_RETURN_IF_ERROR(LargeType::Make(x.element_type(), count, call.comm(), &type));
  const size_t width = ffi::ByteWidth(x.element_type());
  const size_t piece = PipelinedPiece(memory, count, width);
  const bool is_root = call.rank() == root;
  void* data;
  if (SameBuffer(x, *y)) {
    // XLA gave y x's buffer (the lowering aliases them): the root's data is
    // already where MPI_Bcast works, in place.
    JAXCOMM_RETURN_IF_ERROR(is_root ? memory.InPlace(*y, &data) : memory.Output(*y, &data));
  } else if (is_root) {
    // The input buffer is not ours to write, and MPI_Bcast only reads the
    // root's: the root sends x, and y takes its copy beside the transfer.
    JAXCOMM_RETURN_IF_ERROR(memory.Forward(x, *y, &data));
  } else {
    JAXCOMM_RETURN_IF_ERROR(memory.Output(*y, &data));
  }
  JAXCOMM_RETURN_IF_ERROR(memory.Ready());
  if (piece < count) {
    MPI_Datatype base;
    JAXCOMM_RETURN_IF_ERROR(MpiDatatype(x.element_type(), &base));
    JAXCOMM_RETURN_IF_ERROR(ForEachChunk(
        count,
        [&](size_t offset, int n) {
          void* at = ElementAt(data, x.element_type(), offset);
          JAXCOMM_RETURN_IF_ERROR(memory.Arrived(at, n * width));
          call.Log([&] {
            return "MPI_Bcast root " + std::to_string(root) + " " + Elements(n, x.element_type());
          });
          JAXCOMM_MPI_CHECK(call, MPI_Bcast, at, n, base, static_cast<int>(root), call.comm());
          return memory.Produced(at, n * width);
        },
        piece));
    return memory.Finish();
  }
  call.Log([&] {
    return "MPI_Bcast root " + std::to_string(root) + " " + Elements(count, x.element_type());
  });
  JAXCOMM_MPI_CHECK(call, MPI_Bcast, data, type.count(), type.type(), static_cast<int>(root),
                    call.comm());
  return memory.Finish();
}

}  // namespace jaxcomm
