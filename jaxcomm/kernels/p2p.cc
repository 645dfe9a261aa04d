// Point to point: MPI_Send, MPI_Recv, MPI_Sendrecv.
#include <cstring>

#include "common.h"

namespace jaxcomm {
namespace {

std::string Peer(int64_t rank) {
  if (rank == MPI_ANY_SOURCE) return "any";
  if (rank == MPI_PROC_NULL) return "null";
  return std::to_string(rank);
}

// A receive from MPI_PROC_NULL leaves the buffer alone, and XLA's output
// buffer holds garbage: jaxcomm documents zeros.
void ZeroIfNoSource(int64_t source, ffi::AnyBuffer& y) {
  if (source == MPI_PROC_NULL && y.size_bytes() > 0) {
    std::memset(y.untyped_data(), 0, y.size_bytes());
  }
}

std::string Tag(int64_t tag) {
  return tag == MPI_ANY_TAG ? "any" : std::to_string(tag);
}

ffi::Error SendImpl(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                    int64_t comm_handle, int64_t dest, int64_t tag) {
  MPI_Comm comm = CommFromHandle(comm_handle);
  LargeType type;
  JAXCOMM_RETURN_IF_ERROR(
      LargeType::Make(x.element_type(), x.element_count(), comm, &type));
  if (DebugEnabled()) {
    DebugLog(comm, "MPI_Send -> " + Peer(dest) + " tag " + Tag(tag) + " " +
                       Elements(x.element_count(), x.element_type()));
  }
  JAXCOMM_MPI_CHECK(MPI_Send, x.untyped_data(), type.count(), type.type(),
                    static_cast<int>(dest), static_cast<int>(tag), comm);
  return ffi::Error::Success();
}

ffi::Error RecvImpl(ffi::Token, ffi::AnyBuffer /*template*/,
                    ffi::Result<ffi::Token>,
                    ffi::Result<ffi::AnyBuffer> y, int64_t comm_handle,
                    int64_t source, int64_t tag, int64_t status_address) {
  MPI_Comm comm = CommFromHandle(comm_handle);
  LargeType type;
  JAXCOMM_RETURN_IF_ERROR(
      LargeType::Make(y->element_type(), y->element_count(), comm, &type));
  if (DebugEnabled()) {
    DebugLog(comm, "MPI_Recv <- " + Peer(source) + " tag " + Tag(tag) + " " +
                       Elements(y->element_count(), y->element_type()));
  }
  MPI_Status status;
  JAXCOMM_MPI_CHECK(MPI_Recv, y->untyped_data(), type.count(), type.type(),
                    static_cast<int>(source), static_cast<int>(tag), comm,
                    &status);
  ZeroIfNoSource(source, *y);
  StoreStatus(status_address, status);
  return ffi::Error::Success();
}

ffi::Error SendrecvImpl(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                        ffi::Result<ffi::AnyBuffer> y, int64_t comm_handle,
                        int64_t source, int64_t dest, int64_t sendtag,
                        int64_t recvtag, int64_t status_address) {
  MPI_Comm comm = CommFromHandle(comm_handle);
  LargeType send, recv;
  JAXCOMM_RETURN_IF_ERROR(
      LargeType::Make(x.element_type(), x.element_count(), comm, &send));
  JAXCOMM_RETURN_IF_ERROR(
      LargeType::Make(y->element_type(), y->element_count(), comm, &recv));
  if (DebugEnabled()) {
    DebugLog(comm, "MPI_Sendrecv -> " + Peer(dest) + " tag " + Tag(sendtag) + " " +
                       Elements(x.element_count(), x.element_type()) + " <- " +
                       Peer(source) + " tag " + Tag(recvtag) + " " +
                       Elements(y->element_count(), y->element_type()));
  }
  MPI_Status status;
  JAXCOMM_MPI_CHECK(MPI_Sendrecv, x.untyped_data(), send.count(), send.type(),
                    static_cast<int>(dest), static_cast<int>(sendtag),
                    y->untyped_data(), recv.count(), recv.type(),
                    static_cast<int>(source), static_cast<int>(recvtag), comm,
                    &status);
  ZeroIfNoSource(source, *y);
  StoreStatus(status_address, status);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxcomm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcommSend, jaxcomm::SendImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Token>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Token>()
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("dest")
                                  .Attr<int64_t>("tag"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcommRecv, jaxcomm::RecvImpl,
                              jaxcomm::ArrayOpBinding()
                                  .Attr<int64_t>("source")
                                  .Attr<int64_t>("tag")
                                  .Attr<int64_t>("status"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcommSendrecv, jaxcomm::SendrecvImpl,
                              jaxcomm::ArrayOpBinding()
                                  .Attr<int64_t>("source")
                                  .Attr<int64_t>("dest")
                                  .Attr<int64_t>("sendtag")
                                  .Attr<int64_t>("recvtag")
                                  .Attr<int64_t>("status"));
