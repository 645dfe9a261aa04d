// Synchronisation: MPI_Barrier.
#include "common.h"

namespace jaxcomm {

// On a GPU, Ready() also makes the barrier wait for the work queued before it.
ffi::Error BarrierImpl(const Call& call, Memory& memory, ffi::Token, ffi::Result<ffi::Token>) {
  JAXCOMM_RETURN_IF_ERROR(call.Announce(Collective::NoData()));
  JAXCOMM_RETURN_IF_ERROR(memory.Ready());
  call.Log([] { return "MPI_Barrier"; });
  JAXCOMM_MPI_CHECK(call, MPI_Barrier, call.comm());
  return memory.Finish();
}

}  // namespace jaxcomm
