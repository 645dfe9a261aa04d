// The platform layer: where one handler call's buffers live and how MPI
// reaches them. The host's is here; the GPU's is in cuda_memory.h.
#ifndef JAXCOMM_KERNELS_MEMORY_H_
#define JAXCOMM_KERNELS_MEMORY_H_

#include <cstddef>
#include <cstdint>

#include "errors.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

namespace ffi = xla::ffi;

// What a nonblocking request keeps of one of its buffers from its start to
// its wait: the buffer XLA gave the start and, where MPI does not use that
// buffer itself, the platform's staging memory that MPI uses instead.
struct Held {
  void* buffer = nullptr;
  size_t bytes = 0;
  void* staging = nullptr;  // null: MPI uses `buffer`
  size_t delivered = 0;     // leading bytes Deliver already sent to the output
};

// The platform layer: where one handler call's buffers live and how MPI
// reaches them, the only thing that differs between the CPU and the CUDA
// handlers. A handler takes the pointer MPI uses for each buffer from it,
// calls Ready() before its first MPI call (the inputs are then in place) and
// Finish() after its last (the outputs then reach XLA's buffers). On the
// host (HostMemory) every pointer is the buffer itself and both calls do
// nothing; on a GPU (cuda_memory.h) the pointers are the device buffers
// themselves (CUDA-aware MPI) or pinned host copies.
class Memory {
 public:
  virtual ~Memory() = default;

  // Routes every buffer of this call through host memory, whatever the data
  // path: for reductions with jaxcomm's own MPI ops, which run on the host.
  // Call before the first Input or Output.
  virtual void RequireHost() {}
  // The pointer MPI reads input `x` through.
  virtual ffi::Error Input(const ffi::AnyBuffer& x, const void** data) = 0;
  // The pointer MPI writes output `y` through.
  virtual ffi::Error Output(ffi::AnyBuffer& y, void** data) = 0;
  // The pointer MPI reads and writes output `y` through, for a call that
  // works in place: XLA gave `y` the input's buffer (the lowering aliases
  // them), so `y` holds the input on entry.
  virtual ffi::Error InPlace(ffi::AnyBuffer& y, void** data) = 0;
  // Host memory holding input `x` (or taking output `y`) whatever the data
  // path, for the few bytes handlers read or write themselves (envelopes).
  virtual ffi::Error HostInput(const ffi::AnyBuffer& x, const void** data) = 0;
  virtual ffi::Error HostOutput(ffi::AnyBuffer& y, void** data) = 0;
  // Output `y`, already given its pointer, starts with the bytes of input `x`
  // at byte `offset` (MPI_Bcast works in place on y).
  virtual ffi::Error Preload(ffi::AnyBuffer& y, size_t offset, const ffi::AnyBuffer& x) = 0;
  // Output `y` must end up holding input `x`, and MPI only reads the data
  // (the root of MPI_Bcast): the pointer MPI reads it through. By default
  // that is y's own, with x copied in first (Output, then Preload); the host
  // overrides it.
  virtual ffi::Error Forward(const ffi::AnyBuffer& x, ffi::AnyBuffer& y, void** data);
  // Waits until MPI can read the inputs through their pointers (for a
  // pipelined call, the first piece of each; Arrived waits for the others).
  virtual ffi::Error Ready() = 0;

  // Pipelining (PieceElements, chunks.h): a handler that hands MPI its
  // buffers in pieces of `piece_bytes` says so before taking them, so that
  // staging copies are cut at the same boundaries; before MPI reads a piece
  // it calls Arrived, after MPI wrote one Produced, each with the pointer MPI
  // used (from Input, Output, InPlace or Preload) and the piece's bytes.
  // Produced may start the piece's way to the output, which is then complete
  // at Finish. On the host, and for buffers MPI reaches directly, they do
  // nothing.
  virtual void Pipeline(size_t /*piece_bytes*/) {}
  virtual ffi::Error Arrived(const void* /*data*/, size_t /*bytes*/) {
    return ffi::Error::Success();
  }
  virtual ffi::Error Produced(const void* /*data*/, size_t /*bytes*/) {
    return ffi::Error::Success();
  }
  // After the MPI calls: output `y` holds zeros from byte `offset` on.
  virtual ffi::Error ZeroFrom(ffi::AnyBuffer& y, size_t offset) = 0;
  // Moves the outputs to their buffers.
  virtual ffi::Error Finish() = 0;

  // Nonblocking starts, whose buffers MPI uses after the handler returned:
  // as Input and Output, but the pointer stays valid until Unhold (at the
  // wait), and `held` records what to give back then.
  virtual ffi::Error HoldInput(const ffi::AnyBuffer& x, const void** data, Held* held) = 0;
  virtual ffi::Error HoldOutput(ffi::AnyBuffer& y, void** data, Held* held) = 0;
  // At the wait, once MPI is done: `out` (null for an input) takes the first
  // `filled` bytes MPI wrote through the held output, and zeros after them;
  // then the held memory is given back and `held` emptied. Also for a start
  // that failed (out null).
  virtual ffi::Error Unhold(Held& held, ffi::AnyBuffer* out, size_t filled) = 0;
  // At the wait of a request cut into pieces, once MPI completed the pieces
  // that cover its first `upto` bytes: may start those bytes' way from the
  // held output to `out` now, while MPI finishes the others. Unhold then
  // moves only what is left. Where MPI wrote `out` itself, or the host's
  // Unhold copies all at once, it does nothing.
  virtual ffi::Error Deliver(Held& /*held*/, ffi::AnyBuffer& /*out*/, size_t /*upto*/) {
    return ffi::Error::Success();
  }

  // Input and Output typed for pointer arithmetic on elements.
  ffi::Error Read(const ffi::AnyBuffer& x, void** data) {
    const void* in;
    JAXCOMM_RETURN_IF_ERROR(Input(x, &in));
    *data = const_cast<void*>(in);
    return ffi::Error::Success();
  }
  ffi::Error Zero(ffi::AnyBuffer& y) { return ZeroFrom(y, 0); }
  // A call of one input and one output: the pointers MPI moves `x` and `y`
  // through, ready for the MPI calls.
  ffi::Error Buffers(const ffi::AnyBuffer& x, ffi::AnyBuffer& y, void** in, void** out) {
    JAXCOMM_RETURN_IF_ERROR(Read(x, in));
    JAXCOMM_RETURN_IF_ERROR(Output(y, out));
    return Ready();
  }
};

// Host buffers MPI reads or writes of at least this many bytes (4 MiB by
// default, as NumPy's arrays; 0: none) are advised onto transparent huge
// pages (memory.cc).
size_t HugePageBytes();
void SetHugePageBytes(size_t bytes);

// What the huge-page advice has done in this process: the kernel's
// transparent huge page size (0: none, so nothing is advised, with the errno
// of reading it), the calls of madvise(MADV_HUGEPAGE) that succeeded and
// that Linux refused (with the errno of the last refusal), the ranges
// MADV_COLLAPSE moved, whether repeated refusals stopped MADV_COLLAPSE, and
// the ranges of a buffer's ends advised (AdviseHugePages, memory.cc).
struct HugePageCounts {
  size_t page_size = 0;
  int page_size_errno = 0;
  uint64_t advised = 0;
  uint64_t refused = 0;
  int last_errno = 0;
  uint64_t collapsed = 0;
  bool collapse_stopped = false;
  uint64_t advised_ends = 0;
};
HugePageCounts HugePageAdvice();

class CopyHelper;  // memory.cc

// Host copies of at least this many bytes that a handler makes beside its
// MPI calls (HostMemory::Forward) run on a helper thread.
constexpr size_t kCopyAsideBytes = size_t{256} << 10;

// Buffers in host memory: the CPU handlers'.
class HostMemory final : public Memory {
 public:
  HostMemory() = default;
  HostMemory(const HostMemory&) = delete;
  HostMemory& operator=(const HostMemory&) = delete;
  // Waits for a copy still running aside (a handler that failed before
  // Finish), so that none outlives the call's buffers.
  ~HostMemory() override;
  ffi::Error Input(const ffi::AnyBuffer& x, const void** data) override;
  ffi::Error Output(ffi::AnyBuffer& y, void** data) override;
  ffi::Error InPlace(ffi::AnyBuffer& y, void** data) override;
  ffi::Error HostInput(const ffi::AnyBuffer& x, const void** data) override;
  ffi::Error HostOutput(ffi::AnyBuffer& y, void** data) override;
  ffi::Error Preload(ffi::AnyBuffer& y, size_t offset, const ffi::AnyBuffer& x) override;
  // MPI reads x itself, and x is copied into y at the same time: on a helper
  // thread for kCopyAsideBytes or more (done at Finish), else here. The
  // root's copy then overlaps the transfer instead of delaying it.
  ffi::Error Forward(const ffi::AnyBuffer& x, ffi::AnyBuffer& y, void** data) override;
  ffi::Error Ready() override { return ffi::Error::Success(); }
  ffi::Error ZeroFrom(ffi::AnyBuffer& y, size_t offset) override;
  ffi::Error Finish() override;
  ffi::Error HoldInput(const ffi::AnyBuffer& x, const void** data, Held* held) override;
  ffi::Error HoldOutput(ffi::AnyBuffer& y, void** data, Held* held) override;
  ffi::Error Unhold(Held& held, ffi::AnyBuffer* out, size_t filled) override;

 private:
  CopyHelper* aside_ = nullptr;  // runs this call's Forward copy, until Finish
};

}  // namespace jaxcomm

#endif  // JAXCOMM_KERNELS_MEMORY_H_
