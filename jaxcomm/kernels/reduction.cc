// Reductions: MPI_Allreduce, MPI_Reduce, MPI_Scan, MPI_Exscan and
// MPI_Reduce_scatter_block.
#include "common.h"
#include "reduce_ops.h"

namespace jaxcomm {
namespace {

using ElementwiseCall = int (*)(const void*, void*, int, MPI_Datatype, MPI_Op, MPI_Comm);

ffi::Error ReductionTypes(const Call& call, ffi::DataType type, int64_t op, MPI_Datatype* dtype,
                          MPI_Op* mpi_op) {
  JAXCOMM_RETURN_IF_ERROR(MpiDatatype(type, dtype));
  return MpiReduceOp(op, type, call.comm(), mpi_op);
}

std::string OpText(const char* function, int64_t op) {
  return std::string(function) + " op " + ReduceOpName(op);
}

// The pointers MPI reduces `x` into `y` through: MPI_IN_PLACE and y where
// XLA gave y x's buffer (the lowering of allreduce, scan and exscan aliases
// them, so a loop's carry is reduced where it is). jaxcomm's own ops run on
// the host, so their buffers are there whatever the data path.
ffi::Error ReductionBuffers(Memory& memory, int64_t op, ffi::AnyBuffer& x, ffi::AnyBuffer& y,
                            void** send, void** recv) {
  if (IsOwnReduceOp(op, x.element_type())) memory.RequireHost();
  if (SameBuffer(x, y)) {
    *send = MPI_IN_PLACE;
    JAXCOMM_RETURN_IF_ERROR(memory.InPlace(y, recv));
  } else {
    JAXCOMM_RETURN_IF_ERROR(memory.Read(x, send));
    JAXCOMM_RETURN_IF_ERROR(memory.Output(y, recv));
  }
  return memory.Ready();
}

// Allreduce, Scan and Exscan combine element i of every rank's x into element
// i of y. Predefined reductions take no derived datatypes, so large arrays
// reduce in independent pieces of at most MaxCount() elements, and smaller
// pieces where the call is pipelined.
ffi::Error ElementwiseReduction(const Call& call, Memory& memory, ElementwiseCall reduce,
                                const char* function, ffi::AnyBuffer x, ffi::AnyBuffer& y,
                                int64_t op) {
  JAXCOMM_RETURN_IF_ERROR(call.Announce(Collective::Of(x).Reduction(op)));
  JAXCOMM_RETURN_IF_ERROR(CheckOutput(call, x, y, x.element_count(), LikeTheInput));
  const ffi::DataType type = x.element_type();
  MPI_Datatype dtype;
  MPI_Op mpi_op;
  JAXCOMM_RETURN_IF_ERROR(ReductionTypes(call, type, op, &dtype, &mpi_op));
  const size_t width = ffi::ByteWidth(type);
  const size_t piece = PipelinedPiece(memory, x.element_count(), width);
  void *send, *recv;
  JAXCOMM_RETURN_IF_ERROR(ReductionBuffers(memory, op, x, y, &send, &recv));
  return ForEachChunk(
      x.element_count(),
      [&](size_t offset, int count) {
        void* in = ArgumentAt(send, type, offset);
        void* out = ElementAt(recv, type, offset);
        JAXCOMM_RETURN_IF_ERROR(memory.Arrived(in == MPI_IN_PLACE ? out : in, count * width));
        call.Log([&] { return OpText(function, op) + " " + Elements(count, type); });
        const int rc = reduce(in, out, count, dtype, mpi_op, call.comm());
        if (rc != MPI_SUCCESS) return MpiFailure(function, rc, call);
        return memory.Produced(out, count * width);
      },
      piece);
}

// Reduces `total` elements from `send` on every rank into `recv` on `root`,
// in pieces of at most `piece` elements (and MaxCount()). `recv` is only
// written on root; `send` may be MPI_IN_PLACE there, and `recv` null
// elsewhere. With `memory` (a pipelined reduce), each piece waits for its
// input to arrive and root's goes on its way to the output once reduced.
ffi::Error ChunkedReduce(const Call& call, void* send, void* recv, size_t total, ffi::DataType type,
                         int64_t op, int root, Memory* memory = nullptr,
                         size_t piece = MaxCount()) {
  MPI_Datatype dtype;
  MPI_Op mpi_op;
  JAXCOMM_RETURN_IF_ERROR(ReductionTypes(call, type, op, &dtype, &mpi_op));
  const size_t width = ffi::ByteWidth(type);
  const bool is_root = call.rank() == root;
  return ForEachChunk(
      total,
      [&](size_t offset, int count) {
        void* in = ArgumentAt(send, type, offset);
        void* out = ArgumentAt(recv, type, offset);
        if (memory != nullptr) {
          JAXCOMM_RETURN_IF_ERROR(memory->Arrived(in == MPI_IN_PLACE ? out : in, count * width));
        }
        call.Log([&] {
          return OpText("MPI_Reduce", op) + " root " + std::to_string(root) + " " +
                 Elements(count, type);
        });
        JAXCOMM_MPI_CHECK(call, MPI_Reduce, in, out, count, dtype, mpi_op, root, call.comm());
        if (memory != nullptr && is_root) return memory->Produced(out, count * width);
        return ffi::Error::Success();
      },
      piece);
}

}  // namespace

ffi::Error AllreduceImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                         ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y, int64_t op) {
  JAXCOMM_RETURN_IF_ERROR(
      ElementwiseReduction(call, memory, MPI_Allreduce, "MPI_Allreduce", x, *y, op));
  return memory.Finish();
}

// MPI leaves the output of non-root ranks undefined; jaxcomm documents zeros.
// Only the root's output is an MPI buffer: where XLA gave it the input's
// buffer (the lowering aliases them) the root reduces in place.
ffi::Error ReduceImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                      ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y, int64_t op,
                      int64_t root) {
  JAXCOMM_RETURN_IF_ERROR(call.Announce(Collective::Of(x).Root(root).Reduction(op)));
  JAXCOMM_RETURN_IF_ERROR(CheckOutput(call, x, *y, x.element_count(), LikeTheInput));
  const bool is_root = call.rank() == root;
  const size_t width = ffi::ByteWidth(x.element_type());
  const size_t piece = PipelinedPiece(memory, x.element_count(), width);
  void* send;
  void* recv = nullptr;
  if (is_root) {
    JAXCOMM_RETURN_IF_ERROR(ReductionBuffers(memory, op, x, *y, &send, &recv));
  } else {
    if (IsOwnReduceOp(op, x.element_type())) memory.RequireHost();
    JAXCOMM_RETURN_IF_ERROR(memory.Read(x, &send));
    JAXCOMM_RETURN_IF_ERROR(memory.Ready());
  }
  JAXCOMM_RETURN_IF_ERROR(ChunkedReduce(call, send, recv, x.element_count(), x.element_type(), op,
                                        static_cast<int>(root), &memory, piece));
  if (!is_root) JAXCOMM_RETURN_IF_ERROR(memory.Zero(*y));
  return memory.Finish();
}

ffi::Error ScanImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                    ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y, int64_t op) {
  JAXCOMM_RETURN_IF_ERROR(ElementwiseReduction(call, memory, MPI_Scan, "MPI_Scan", x, *y, op));
  return memory.Finish();
}

// MPI leaves rank 0's output undefined; jaxcomm documents zeros.
ffi::Error ExscanImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                      ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y, int64_t op) {
  JAXCOMM_RETURN_IF_ERROR(ElementwiseReduction(call, memory, MPI_Exscan, "MPI_Exscan", x, *y, op));
  if (call.rank() == 0) JAXCOMM_RETURN_IF_ERROR(memory.Zero(*y));
  return memory.Finish();
}

ffi::Error ReduceScatterImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                             ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y, int64_t op) {
  JAXCOMM_RETURN_IF_ERROR(call.Announce(Collective::Of(x).Reduction(op)));
  const ffi::DataType type = x.element_type();
  int size;
  JAXCOMM_MPI_CHECK(call, MPI_Comm_size, call.comm(), &size);
  // The block size is the output's; MPI reads `size` of them from x.
  const size_t block = y->element_count();
  JAXCOMM_RETURN_IF_ERROR(
      CheckElements(call, "input", x.element_count(), block * static_cast<size_t>(size), [&] {
        return "communicator size " + std::to_string(size) + " x output " + std::to_string(block);
      }));
  MPI_Datatype dtype;
  MPI_Op mpi_op;
  JAXCOMM_RETURN_IF_ERROR(ReductionTypes(call, type, op, &dtype, &mpi_op));
  void *send, *recv;
  JAXCOMM_RETURN_IF_ERROR(ReductionBuffers(memory, op, x, *y, &send, &recv));
  if (block > MaxCount()) {
    // MPI_Reduce_scatter_block takes one count for every block, and a piece of
    // each block would need a strided derived datatype, which predefined
    // reductions do not accept: each block is reduced onto its owner instead.
    for (int r = 0; r < size; ++r) {
      JAXCOMM_RETURN_IF_ERROR(
          ChunkedReduce(call, ElementAt(send, type, r * block), recv, block, type, op, r));
    }
    return memory.Finish();
  }
  call.Log([&] { return OpText("MPI_Reduce_scatter_block", op) + " " + Elements(block, type); });
  JAXCOMM_MPI_CHECK(call, MPI_Reduce_scatter_block, send, recv, static_cast<int>(block), dtype,
                    mpi_op, call.comm());
  return memory.Finish();
}

}  // namespace jaxcomm
