// What every handler needs: its Call (the operation, the communicator, the
// announcement, the log line and the errors), the platform's Memory, the
// datatype table, the argument checks and counts past MPI's int, and the
// declarations of the handler bodies, made from ops.def.
#ifndef JAXCOMM_KERNELS_COMMON_H_
#define JAXCOMM_KERNELS_COMMON_H_

#include <mpi.h>

#include <cstdint>
#include <utility>

#include "buffers.h"
#include "call.h"
#include "checks.h"
#include "chunks.h"
#include "datatypes.h"
#include "errors.h"
#include "memory.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

// The elements of one piece of a collective on `count` elements of `width`
// bytes (PieceElements), telling `memory` to stage the buffers in pieces of
// that size (Memory::Pipeline) where they make two or more.
inline size_t PipelinedPiece(Memory& memory, size_t count, size_t width) {
  const size_t piece = PieceElements(count, width);
  if (piece < count) memory.Pipeline(piece * width);
  return piece;
}

// Each op's binding after the attributes every target shares (handlers.cc),
// from its row of ops.def: bindings::<Name>(binding), and its handler body,
// shared by every platform:
// ffi::Error <Name>Impl(const Call&, Memory&, <buffers>, <attributes>).
#define I64(name) .template Attr<int64_t>(#name)
#define I64S(name) .template Attr<ffi::Span<const int64_t>>(#name)
#define JAXCOMM_OP(name, label, Name, buffers, attributes)              \
  template <typename Binding>                                           \
  auto Name(Binding&& binding) {                                        \
    return buffers##Buffers(std::forward<Binding>(binding)) attributes; \
  }
namespace bindings {
#include "ops.def"
}  // namespace bindings
#undef JAXCOMM_OP
#undef I64S
#undef I64

#define I64(name) , int64_t
#define I64S(name) , ffi::Span<const int64_t>
#define JAXCOMM_OP(name, label, Name, buffers, attributes) \
  ffi::Error Name##Impl(const Call&, Memory&, JAXCOMM_##buffers##_PARAMS attributes);
#include "ops.def"
#undef JAXCOMM_OP
#undef I64S
#undef I64

}  // namespace jaxcomm

#endif  // JAXCOMM_KERNELS_COMMON_H_
