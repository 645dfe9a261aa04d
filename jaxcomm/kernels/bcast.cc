// Broadcast: MPI_Bcast.
#include <cstring>

#include "common.h"

namespace jaxcomm {
namespace {

ffi::Error BcastImpl(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                     ffi::Result<ffi::AnyBuffer> y, int64_t comm_handle,
                     int64_t root) {
  MPI_Comm comm;
  JAXCOMM_RETURN_IF_ERROR(CommFromHandle(comm_handle, "bcast", &comm));
  const size_t count = x.element_count();
  JAXCOMM_RETURN_IF_ERROR(CheckOutput("bcast", comm, x, *y, x.element_count(),
                                      "like the input"));
  LargeType type;
  JAXCOMM_RETURN_IF_ERROR(LargeType::Make(x.element_type(), count, comm, &type));
  if (DebugEnabled()) {
    DebugLog(comm, "MPI_Bcast root " + std::to_string(root) + " " +
                       Elements(count, x.element_type()));
  }
  // MPI_Bcast works in place, and XLA's input buffer is not ours to write:
  // the root sends from the output buffer, the one copy this op needs.
  if (CommRank(comm) == root && count > 0) {
    std::memcpy(y->untyped_data(), x.untyped_data(), x.size_bytes());
  }
  JAXCOMM_MPI_CHECK(MPI_Bcast, y->untyped_data(), type.count(), type.type(),
                    static_cast<int>(root), comm);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxcomm

JAXCOMM_DEFINE_HANDLER(JaxcommBcast, jaxcomm::BcastImpl);
