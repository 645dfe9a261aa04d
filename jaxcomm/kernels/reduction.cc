// Reductions: MPI_Allreduce.
#include "common.h"

namespace jaxcomm {
namespace {

ffi::Error AllreduceImpl(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                         ffi::Result<ffi::AnyBuffer> y, int64_t comm_handle,
                         int64_t op) {
  MPI_Comm comm = CommFromHandle(comm_handle);
  MPI_Datatype dtype;
  JAXCOMM_RETURN_IF_ERROR(MpiDatatype(x.element_type(), &dtype));
  MPI_Op mpi_op;
  JAXCOMM_RETURN_IF_ERROR(MpiReduceOp(op, x.element_type(), &mpi_op));
  // Predefined reductions take no derived datatypes: large arrays reduce in
  // pieces of at most MaxCount() elements.
  return ForEachChunk(x.element_count(), [&](size_t offset, int count) {
    if (DebugEnabled()) {
      DebugLog(comm, std::string("MPI_Allreduce op ") + ReduceOpName(op) + " " +
                         Elements(count, x.element_type()));
    }
    JAXCOMM_MPI_CHECK(MPI_Allreduce, ElementAt(x.untyped_data(), x.element_type(), offset),
                      ElementAt(y->untyped_data(), x.element_type(), offset), count, dtype,
                      mpi_op, comm);
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jaxcomm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcommAllreduce, jaxcomm::AllreduceImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Token>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Token>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("op"));
