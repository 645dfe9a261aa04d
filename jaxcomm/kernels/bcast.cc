// Broadcast: MPI_Bcast.
#include "common.h"

namespace jaxcomm {

ffi::Error BcastImpl(Memory& memory, ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                     ffi::Result<ffi::AnyBuffer> y, int64_t comm_handle, int64_t root) {
  MPI_Comm comm;
  JAXCOMM_RETURN_IF_ERROR(CommFromHandle(comm_handle, "bcast", &comm));
  JAXCOMM_RETURN_IF_ERROR(
      AnnounceCollective(comm_handle, comm, Collective{"bcast", x.element_type(), Count(x), root}));
  const size_t count = x.element_count();
  JAXCOMM_RETURN_IF_ERROR(CheckOutput("bcast", comm, x, *y, x.element_count(), LikeTheInput));
  LargeType type;
  JAXCOMM_RETURN_IF_ERROR(LargeType::Make(x.element_type(), count, comm, &type));
  const bool is_root = CommRank(comm) == root;
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
  if (DebugEnabled()) {
    DebugLog(comm,
             "MPI_Bcast root " + std::to_string(root) + " " + Elements(count, x.element_type()));
  }
  JAXCOMM_MPI_CHECK(MPI_Bcast, data, type.count(), type.type(), static_cast<int>(root), comm);
  return memory.Finish();
}

}  // namespace jaxcomm
