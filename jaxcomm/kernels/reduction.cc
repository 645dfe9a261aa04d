// Reductions: MPI_Allreduce, MPI_Reduce, MPI_Scan, MPI_Exscan and
// MPI_Reduce_scatter_block.
#include <cstring>

#include "common.h"

namespace jaxcomm {
namespace {

using ElementwiseCall = int (*)(const void*, void*, int, MPI_Datatype, MPI_Op,
                                MPI_Comm);

ffi::Error ReductionTypes(ffi::DataType type, int64_t op, MPI_Comm comm,
                          MPI_Datatype* dtype, MPI_Op* mpi_op) {
  JAXCOMM_RETURN_IF_ERROR(MpiDatatype(type, dtype));
  return MpiReduceOp(op, type, comm, mpi_op);
}

std::string OpText(const char* function, int64_t op) {
  return std::string(function) + " op " + ReduceOpName(op);
}

// MPI leaves these outputs undefined; jaxcomm documents zeros.
void Zero(ffi::Result<ffi::AnyBuffer>& y) {
  if (y->size_bytes() > 0) std::memset(y->untyped_data(), 0, y->size_bytes());
}

// Allreduce, Scan and Exscan combine element i of every rank's x into element
// i of y. Predefined reductions take no derived datatypes, so large arrays
// reduce in independent pieces of at most MaxCount() elements.
ffi::Error ElementwiseReduction(ElementwiseCall call, const char* function,
                                const char* name, ffi::AnyBuffer x,
                                ffi::Result<ffi::AnyBuffer>& y, MPI_Comm comm,
                                int64_t op) {
  JAXCOMM_RETURN_IF_ERROR(
      CheckOutput(name, comm, x, *y, x.element_count(), "like the input"));
  const ffi::DataType type = x.element_type();
  MPI_Datatype dtype;
  MPI_Op mpi_op;
  JAXCOMM_RETURN_IF_ERROR(ReductionTypes(type, op, comm, &dtype, &mpi_op));
  return ForEachChunk(x.element_count(), [&](size_t offset, int count) {
    if (DebugEnabled()) {
      DebugLog(comm, OpText(function, op) + " " + Elements(count, type));
    }
    const int rc = call(ElementAt(x.untyped_data(), type, offset),
                        ElementAt(y->untyped_data(), type, offset), count,
                        dtype, mpi_op, comm);
    if (rc != MPI_SUCCESS) return MpiFailure(function, rc, comm);
    return ffi::Error::Success();
  });
}

// Reduces `total` elements from `send` on every rank into `recv` on `root`,
// in pieces of at most MaxCount() elements. `recv` is only written on root.
ffi::Error ChunkedReduce(MPI_Comm comm, void* send, void* recv, size_t total,
                         ffi::DataType type, int64_t op, int root) {
  MPI_Datatype dtype;
  MPI_Op mpi_op;
  JAXCOMM_RETURN_IF_ERROR(ReductionTypes(type, op, comm, &dtype, &mpi_op));
  return ForEachChunk(total, [&](size_t offset, int count) {
    if (DebugEnabled()) {
      DebugLog(comm, OpText("MPI_Reduce", op) + " root " +
                         std::to_string(root) + " " + Elements(count, type));
    }
    JAXCOMM_MPI_CHECK(MPI_Reduce, ElementAt(send, type, offset),
                      ElementAt(recv, type, offset), count, dtype, mpi_op, root,
                      comm);
    return ffi::Error::Success();
  });
}

ffi::Error AllreduceImpl(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                         ffi::Result<ffi::AnyBuffer> y, int64_t comm_handle,
                         int64_t op) {
  MPI_Comm comm;
  JAXCOMM_RETURN_IF_ERROR(CommFromHandle(comm_handle, "allreduce", &comm));
  return ElementwiseReduction(MPI_Allreduce, "MPI_Allreduce", "allreduce", x, y,
                              comm, op);
}

ffi::Error ReduceImpl(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                      ffi::Result<ffi::AnyBuffer> y, int64_t comm_handle,
                      int64_t op, int64_t root) {
  MPI_Comm comm;
  JAXCOMM_RETURN_IF_ERROR(CommFromHandle(comm_handle, "reduce", &comm));
  JAXCOMM_RETURN_IF_ERROR(CheckOutput("reduce", comm, x, *y, x.element_count(),
                                      "like the input"));
  JAXCOMM_RETURN_IF_ERROR(ChunkedReduce(comm, x.untyped_data(),
                                        y->untyped_data(), x.element_count(),
                                        x.element_type(), op,
                                        static_cast<int>(root)));
  if (CommRank(comm) != root) Zero(y);
  return ffi::Error::Success();
}

ffi::Error ScanImpl(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                    ffi::Result<ffi::AnyBuffer> y, int64_t comm_handle,
                    int64_t op) {
  MPI_Comm comm;
  JAXCOMM_RETURN_IF_ERROR(CommFromHandle(comm_handle, "scan", &comm));
  return ElementwiseReduction(MPI_Scan, "MPI_Scan", "scan", x, y, comm, op);
}

ffi::Error ExscanImpl(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                      ffi::Result<ffi::AnyBuffer> y, int64_t comm_handle,
                      int64_t op) {
  MPI_Comm comm;
  JAXCOMM_RETURN_IF_ERROR(CommFromHandle(comm_handle, "exscan", &comm));
  JAXCOMM_RETURN_IF_ERROR(ElementwiseReduction(MPI_Exscan, "MPI_Exscan",
                                               "exscan", x, y, comm, op));
  if (CommRank(comm) == 0) Zero(y);
  return ffi::Error::Success();
}

ffi::Error ReduceScatterImpl(ffi::Token, ffi::AnyBuffer x,
                             ffi::Result<ffi::Token>,
                             ffi::Result<ffi::AnyBuffer> y,
                             int64_t comm_handle, int64_t op) {
  MPI_Comm comm;
  JAXCOMM_RETURN_IF_ERROR(CommFromHandle(comm_handle, "reduce_scatter", &comm));
  const ffi::DataType type = x.element_type();
  int size;
  JAXCOMM_MPI_CHECK(MPI_Comm_size, comm, &size);
  // The block size is the output's; MPI reads `size` of them from x.
  const size_t block = y->element_count();
  JAXCOMM_RETURN_IF_ERROR(CheckElements(
      "reduce_scatter", comm, "input", x.element_count(),
      block * static_cast<size_t>(size),
      "communicator size " + std::to_string(size) + " x output " +
          std::to_string(block)));
  if (block > MaxCount()) {
    // MPI_Reduce_scatter_block takes one count for every block, and a piece of
    // each block would need a strided derived datatype, which predefined
    // reductions do not accept: each block is reduced onto its owner instead.
    for (int r = 0; r < size; ++r) {
      JAXCOMM_RETURN_IF_ERROR(ChunkedReduce(
          comm, ElementAt(x.untyped_data(), type, r * block), y->untyped_data(),
          block, type, op, r));
    }
    return ffi::Error::Success();
  }
  MPI_Datatype dtype;
  MPI_Op mpi_op;
  JAXCOMM_RETURN_IF_ERROR(ReductionTypes(type, op, comm, &dtype, &mpi_op));
  if (DebugEnabled()) {
    DebugLog(comm, OpText("MPI_Reduce_scatter_block", op) + " " +
                       Elements(block, type));
  }
  JAXCOMM_MPI_CHECK(MPI_Reduce_scatter_block, x.untyped_data(),
                    y->untyped_data(), static_cast<int>(block), dtype, mpi_op,
                    comm);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxcomm

JAXCOMM_DEFINE_HANDLER(JaxcommAllreduce, jaxcomm::AllreduceImpl);
JAXCOMM_DEFINE_HANDLER(JaxcommReduce, jaxcomm::ReduceImpl);
JAXCOMM_DEFINE_HANDLER(JaxcommScan, jaxcomm::ScanImpl);
JAXCOMM_DEFINE_HANDLER(JaxcommExscan, jaxcomm::ExscanImpl);
JAXCOMM_DEFINE_HANDLER(JaxcommReduceScatter, jaxcomm::ReduceScatterImpl);
