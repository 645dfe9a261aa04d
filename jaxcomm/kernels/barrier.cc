// Synchronisation: MPI_Barrier.
#include "common.h"

namespace jaxcomm {
namespace {

ffi::Error BarrierImpl(ffi::Token, ffi::Result<ffi::Token>,
                       int64_t comm_handle) {
  MPI_Comm comm;
  JAXCOMM_RETURN_IF_ERROR(CommFromHandle(comm_handle, "barrier", &comm));
  if (DebugEnabled()) {
    DebugLog(comm, "MPI_Barrier");
  }
  JAXCOMM_MPI_CHECK(MPI_Barrier, comm);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxcomm

JAXCOMM_DEFINE_HANDLER(JaxcommBarrier, jaxcomm::BarrierImpl);
