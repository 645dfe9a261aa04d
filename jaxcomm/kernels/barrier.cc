// Synchronisation: MPI_Barrier.
#include "common.h"

namespace jaxcomm {
namespace {

ffi::Error BarrierImpl(ffi::Token, ffi::Result<ffi::Token>,
                       int64_t comm_handle) {
  MPI_Comm comm = CommFromHandle(comm_handle);
  if (DebugEnabled()) {
    DebugLog(comm, "MPI_Barrier");
  }
  JAXCOMM_MPI_CHECK(MPI_Barrier, comm);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxcomm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcommBarrier, jaxcomm::BarrierImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Token>()
                                  .Ret<xla::ffi::Token>()
                                  .Attr<int64_t>("comm"));
