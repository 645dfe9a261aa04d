// The CUDA side of the platform layer: buffers in GPU memory, reached by MPI
// directly (CUDA-aware MPI) or through pinned host staging buffers, with every
// copy ordered on XLA's stream.
#ifndef JAXCOMM_KERNELS_CUDA_MEMORY_H_
#define JAXCOMM_KERNELS_CUDA_MEMORY_H_

#include <cuda_runtime_api.h>

#include <cstddef>

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
  ffi::Error ZeroFrom(ffi::AnyBuffer& y, size_t offset) override;
  ffi::Error Finish() override;
  ffi::Error HoldInput(const ffi::AnyBuffer& x, const void** data, Held* held) override;
  ffi::Error HoldOutput(ffi::AnyBuffer& y, void** data, Held* held) override;
  ffi::Error Unhold(Held& held, ffi::AnyBuffer* out, size_t filled) override;

 private:
  // A device buffer and its host copy; `copy_back` leading bytes go back to
  // the device in Finish().
  struct Staged {
    void* device;
    char* host;
    size_t copy_back;
  };
  static constexpr int kMaxStaged = 4;

  ffi::Error Stage(void* device, size_t bytes, bool copy_in, bool copy_out, void** host);
  // The pointer MPI uses for a device buffer: the buffer itself on the direct
  // path, else its staged host copy.
  ffi::Error Reach(void* device, size_t bytes, bool copy_in, bool copy_out, void** data);
  Staged* Find(const void* device);
  // The pointer MPI uses for a nonblocking request's buffer until Unhold:
  // the buffer itself on the direct path, else a pinned block of its own
  // (holding a copy of the buffer if `copy_in`).
  ffi::Error Hold(void* buffer, size_t bytes, bool copy_in, Held* held, void** data);

  cudaStream_t stream_;
  int device_ = 0;
  bool direct_;
  StagingArena* arena_ = nullptr;
  Staged staged_[kMaxStaged];
  int num_staged_ = 0;
  ffi::Error init_error_;
};

}  // namespace jaxcomm

#endif  // JAXCOMM_KERNELS_CUDA_MEMORY_H_
