// Synchronisation: MPI_Barrier.
#include "common.h"

namespace jaxcomm {

// On a GPU, Ready() also makes the barrier wait for the work queued before it.
ffi::Error BarrierImpl(Memory& memory, ffi::Token, ffi::Result<ffi::Token>, int64_t comm_handle) {
  MPI_Comm comm;
  JAXCOMM_RETURN_IF_ERROR(CommFromHandle(comm_handle, "barrier", &comm));
  JAXCOMM_RETURN_IF_ERROR(
      AnnounceCollective(comm_handle, comm, Collective{"barrier", ffi::DataType::INVALID}));
  JAXCOMM_RETURN_IF_ERROR(memory.Ready());
  if (DebugEnabled()) {
    DebugLog(comm, "MPI_Barrier");
  }
  JAXCOMM_MPI_CHECK(MPI_Barrier, comm);
  return memory.Finish();
}

}  // namespace jaxcomm
