// An emulated CUDA runtime for checking jaxcomm's CUDA kernels on a machine
// without a GPU: "device" memory is host memory, every asynchronous call runs
// at once (a stream is then always finished), and a pinned allocation is a
// plain one. Only the functions cuda_memory.cc calls exist. Linked into the
// test-only module jaxcomm._kernels_cuda_emulated (CMake option
// JAXCOMM_CUDA_EMULATION), never into the CUDA module users get.
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace {
// The emulation's own bookkeeping, read by the tests through the module.
std::atomic<long> host_allocations{0};
std::atomic<long> live_host_allocations{0};
// While set, cudaEventQuery reports every event as not reached yet, as a
// real GPU does for work still queued.
std::atomic<bool> events_pending{false};
}  // namespace

long EmulatedHostAllocations() { return host_allocations.load(); }
long EmulatedLiveHostAllocations() { return live_host_allocations.load(); }
void EmulatedHoldEvents(bool pending) { events_pending.store(pending); }

extern "C" {

const char* cudaGetErrorName(cudaError_t) { return "cudaErrorEmulated"; }
const char* cudaGetErrorString(cudaError_t) { return "emulated CUDA error"; }

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : cudaErrorInvalidDevice; }

cudaError_t cudaStreamGetDevice(cudaStream_t, int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int) {
  static char token;
  *stream = reinterpret_cast<cudaStream_t>(&token);
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned int) { return cudaSuccess; }

cudaError_t cudaHostAlloc(void** data, size_t bytes, unsigned int) {
  *data = std::malloc(bytes);
  if (*data == nullptr) return cudaErrorMemoryAllocation;
  // Stale bytes, as real pinned memory may hold: nothing may rely on zeros.
  std::memset(*data, 0xA5, bytes);
  ++host_allocations;
  ++live_host_allocations;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* data) {
  std::free(data);
  --live_host_allocations;
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, enum cudaMemcpyKind,
                            cudaStream_t) {
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t) {
  std::memset(dst, value, bytes);
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  static char token;
  *event = reinterpret_cast<cudaEvent_t>(&token);
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return cudaSuccess; }
cudaError_t cudaEventQuery(cudaEvent_t) {
  return events_pending.load() ? cudaErrorNotReady : cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventDestroy(cudaEvent_t) { return cudaSuccess; }

}  // extern "C"
