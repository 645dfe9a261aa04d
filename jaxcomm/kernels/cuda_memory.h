// The CUDA side of the platform layer: buffers in GPU memory, reached by MPI
// directly (CUDA-aware MPI) or through pinned host staging buffers, with every
// copy ordered on XLA's stream.
#ifndef JAXCOMM_KERNELS_CUDA_MEMORY_H_
#define JAXCOMM_KERNELS_CUDA_MEMORY_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "memory.h"

namespace jaxcomm {

// What the MPI library says about device buffers: 1 CUDA-aware, 0 not, -1 it
// has no way to say (no MPIX_GPU_query_support or MPIX_Query_cuda_support).
int MpiCudaSupport();

// The data path of device buffers: 1 straight to MPI, 0 host staging, -1 as
// MpiCudaSupport() says (the default).
void SetCudaAware(int mode);
bool CudaAware();

// Pinned host memory held for staging, and its release (of the buffers no call
// or request is using; called at exit).
size_t StagingBytes();
void FreeStaging();

// Pinned blocks nonblocking requests hold now, from their start to their wait.
size_t StagingHeld();

// The handler clock: how many handler calls ran on a GPU, the time spent in
// them, and the part of it spent waiting for the GPU (stream and event
// synchronisation), in nanoseconds since the last reset.
struct HandlerTimes {
  uint64_t calls, handler_ns, wait_ns;
};
void AddHandlerTime(uint64_t ns);
HandlerTimes HandlerClock();
void ResetHandlerClock();

class StagingArena;

// One handler call on buffers in GPU memory. Host staging copies go through
// an arena of pinned memory, allocated once and reused by later calls (grown
// when a call needs more), and only the copies each buffer needs are made:
// inputs device-to-host, outputs host-to-device (both for a buffer worked on
// in place), zeros with cudaMemsetAsync. A nonblocking request's staging
// copies live longer than the call that starts it: each is a pinned block of
// its own, taken from a pool at the start and given back at the wait, once
// the copy of what MPI received to the device has been queued (the pool
// reuses it only after that copy ran).
class CudaMemory final : public Memory {
 public:
  explicit CudaMemory(cudaStream_t stream);
  ~CudaMemory() override;
  CudaMemory(const CudaMemory&) = delete;
  CudaMemory& operator=(const CudaMemory&) = delete;

  void RequireHost() override { direct_ = false; }
  ffi::Error Input(const ffi::AnyBuffer& x, const void** data) override;
  ffi::Error Output(ffi::AnyBuffer& y, void** data) override;
  ffi::Error InPlace(ffi::AnyBuffer& y, void** data) override;
  ffi::Error HostInput(const ffi::AnyBuffer& x, const void** data) override;
  ffi::Error HostOutput(ffi::AnyBuffer& y, void** data) override;
  ffi::Error Preload(ffi::AnyBuffer& y, size_t offset, const ffi::AnyBuffer& x) override;
  ffi::Error Ready() override;
  void Pipeline(size_t piece_bytes) override { piece_ = piece_bytes; }
  ffi::Error Arrived(const void* data, size_t bytes) override;
  ffi::Error Produced(const void* data, size_t bytes) override;
  ffi::Error ZeroFrom(ffi::AnyBuffer& y, size_t offset) override;
  ffi::Error Finish() override;
  ffi::Error HoldInput(const ffi::AnyBuffer& x, const void** data, Held* held) override;
  ffi::Error HoldOutput(ffi::AnyBuffer& y, void** data, Held* held) override;
  ffi::Error Unhold(Held& held, ffi::AnyBuffer* out, size_t filled) override;
  ffi::Error Deliver(Held& held, ffi::AnyBuffer& out, size_t upto) override;

 private:
  // A device buffer and its host copy; `copy_back` leading bytes go back to
  // the device in Finish(), unless Produced sent them piece by piece. A
  // pipelined copy to the host records one event per piece (`events` of the
  // arena's, from `first_event`), for the piece's bytes from `copied_from`.
  struct Staged {
    void* device;
    char* host;
    size_t bytes;
    size_t copy_back;
    size_t copied_from = 0;
    size_t first_event = 0;
    size_t events = 0;
    bool produced = false;
  };
  static constexpr int kMaxStaged = 4;

  // Fails where the call already lists kMaxStaged staged buffers.
  ffi::Error RoomToStage() const;
  // Takes the call's staging arena, once.
  ffi::Error UseArena();
  ffi::Error Stage(void* device, size_t bytes, bool copy_in, bool copy_out, void** host);
  // The pointer MPI uses for a device buffer: the buffer itself on the direct
  // path, else its staged host copy.
  ffi::Error Reach(void* device, size_t bytes, bool copy_in, bool copy_out, void** data);
  Staged* Find(const void* device);
  // The staged buffer whose host copy holds `host`, or null.
  Staged* Holding(const void* host);
  // Queues the copy of `bytes` from device memory at `source` into `staged`'s
  // host copy at `offset`: in pieces, each followed by an event, when the
  // call is pipelined and the copy spans more than one piece.
  ffi::Error CopyIn(Staged& staged, size_t offset, const void* source, size_t bytes);
  // An event recorded now on XLA's stream: the point the copies of Produced,
  // on the arena's copy stream, start from.
  ffi::Error MarkEntry();
  // Makes XLA's stream wait for the copies Produced queued.
  ffi::Error Join();
  // Waits for `event`, counting the time on the handler clock.
  ffi::Error WaitFor(cudaEvent_t event);
  // The pointer MPI uses for a nonblocking request's buffer until Unhold:
  // the buffer itself on the direct path, else a pinned block of its own
  // (holding a copy of the buffer if `copy_in`, made piece by piece when the
  // start is pipelined, for Arrived).
  ffi::Error Hold(void* buffer, size_t bytes, bool copy_in, Held* held, void** data);

  cudaStream_t stream_;
  int device_ = 0;
  bool direct_;
  StagingArena* arena_ = nullptr;
  Staged staged_[kMaxStaged];
  int num_staged_ = 0;
  // Pipelining (Memory::Pipeline): the piece size, the entry event, whether
  // a pieced copy was queued (the first event it recorded), whether a whole
  // copy to the host followed it, and whether Produced copies wait to be
  // joined.
  size_t piece_ = 0;
  cudaEvent_t entry_ = nullptr;
  bool pieced_ = false;
  size_t first_piece_event_ = 0;
  bool whole_after_pieces_ = false;
  bool producing_ = false;
  // Bytes this call queued for copying to the host: what a staging span
  // of the timeline (TraceCopy, trace.h) waits for.
  size_t copied_in_ = 0;
  ffi::Error init_error_;
};

}  // namespace jaxcomm

#endif  // JAXCOMM_KERNELS_CUDA_MEMORY_H_
