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
  const bool is_root = call.rank() == root;
  void* data;
  if (SameBuffer(x, *y)) {
    // XLA gave y x's buffer (the lowering aliases them): the root's data is
    // already where MPI_Bcast works, in place.
    JAXCOMM_RETURN_IF_ERROR(is_root ? memory.InPlace(*y, &data) : memory.Output(*y, &data));
  } else {
    // The input buffer is not ours to write: the root sends from the output.
    JAXCOMM_RETURN_IF_ERROR(memory.Output(*y, &data));
    if (is_root) JAXCOMM_RETURN_IF_ERROR(memory.Preload(*y, 0, x));
  }
  JAXCOMM_RETURN_IF_ERROR(memory.Ready());
  call.Log([&] {
    return "MPI_Bcast root " + std::to_string(root) + " " + Elements(count, x.element_type());
  });
  JAXCOMM_MPI_CHECK(call, MPI_Bcast, data, type.count(), type.type(), static_cast<int>(root),
                    call.comm());
  return memory.Finish();
}

}  // namespace jaxcomm
