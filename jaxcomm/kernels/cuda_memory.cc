#include "cuda_memory.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <vector>

#include "handles.h"
#include "trace.h"

#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // Open MPI's MPIX_CUDA_AWARE_SUPPORT
#endif

namespace jaxcomm {
namespace {

ffi::Error CudaFailure(const char* function, cudaError_t code) {
  return ffi::Error::Internal(std::string("jaxcomm: ") + function + " failed on world rank " +
                              std::to_string(WorldRank()) + ": " + cudaGetErrorName(code) + " (" +
                              cudaGetErrorString(code) + ")");
}

#define JAXCOMM_CUDA_CHECK(function, ...)                  \
  do {                                                     \
    const cudaError_t jaxcomm_rc_ = function(__VA_ARGS__); \
    if (jaxcomm_rc_ != cudaSuccess) {                      \
      return CudaFailure(#function, jaxcomm_rc_);          \
    }                                                      \
  } while (0)

std::atomic<int> cuda_aware_mode{-1};

std::atomic<uint64_t> clock_calls{0};
std::atomic<uint64_t> clock_handler_ns{0};
std::atomic<uint64_t> clock_wait_ns{0};

uint64_t NanosecondsSince(std::chrono::steady_clock::time_point start) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count());
}

constexpr size_t kAlignment = 256;
constexpr size_t kMinChunk = size_t{1} << 20;

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

}  // namespace

int MpiCudaSupport() {
#if defined(MPIX_GPU_SUPPORT_CUDA)  // MPICH 4 and later
  int supported = 0;
  if (MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &supported) != MPI_SUCCESS) {
    return -1;
  }
  return supported ? 1 : 0;
#elif defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return MPIX_Query_cuda_support() ? 1 : 0;  // Open MPI built with CUDA
#elif defined(MPIX_CUDA_AWARE_SUPPORT)
  return 0;  // Open MPI built without CUDA
#else
  return -1;
#endif
}

void AddHandlerTime(uint64_t ns) {
  clock_calls.fetch_add(1, std::memory_order_relaxed);
  clock_handler_ns.fetch_add(ns, std::memory_order_relaxed);
}

HandlerTimes HandlerClock() {
  return HandlerTimes{clock_calls.load(), clock_handler_ns.load(), clock_wait_ns.load()};
}

void ResetHandlerClock() {
  clock_calls.store(0);
  clock_handler_ns.store(0);
  clock_wait_ns.store(0);
}

void SetCudaAware(int mode) { cuda_aware_mode.store(mode < 0 ? -1 : mode > 0); }

bool CudaAware() {
  const int mode = cuda_aware_mode.load(std::memory_order_relaxed);
  if (mode >= 0) return mode == 1;
  // Asked once: the answer cannot change while MPI runs.
  static const int support = MpiCudaSupport();
  return support == 1;
}

// Pinned host memory for one call at a time, on one device. A call carves
// its buffers from it; the host-to-device copies of a call may still read
// them after it returns, so the arena's event marks their end, and the next
// call on another stream (or one that frees memory) waits for it first.
class StagingArena {
 public:
  explicit StagingArena(int device) : device_(device) {}

  int device() const { return device_; }

  // Makes the arena ready for a call on `stream`; the memory of one call
  // becomes one chunk as large as all of it, so a steady workload allocates
  // nothing after its first calls.
  ffi::Error Begin(cudaStream_t stream) {
    if (done_ == nullptr) {
      JAXCOMM_CUDA_CHECK(cudaEventCreateWithFlags, &done_, cudaEventDisableTiming);
    }
    if (recorded_ && (stream != last_stream_ || chunks_.size() > 1)) {
      JAXCOMM_CUDA_CHECK(cudaEventSynchronize, done_);
    }
    if (chunks_.size() > 1) {
      const size_t total = bytes();
      JAXCOMM_RETURN_IF_ERROR(Release());
      JAXCOMM_RETURN_IF_ERROR(Grow(total));
    }
    last_stream_ = stream;
    used_ = 0;
    next_event_ = 0;
    return ffi::Error::Success();
  }

  // An event of this call's; the arena reuses them in its next call.
  ffi::Error TakeEvent(size_t* index) {
    if (next_event_ == events_.size()) {
      cudaEvent_t event;
      JAXCOMM_CUDA_CHECK(cudaEventCreateWithFlags, &event, cudaEventDisableTiming);
      events_.push_back(event);
    }
    *index = next_event_++;
    return ffi::Error::Success();
  }
  cudaEvent_t event(size_t index) const { return events_[index]; }

  // The stream that the copies of pipelined outputs go back to the device on.
  ffi::Error CopyStream(cudaStream_t* out) {
    if (copy_stream_ == nullptr) {
      JAXCOMM_CUDA_CHECK(cudaStreamCreateWithFlags, &copy_stream_, cudaStreamNonBlocking);
    }
    *out = copy_stream_;
    return ffi::Error::Success();
  }

  // `bytes` of pinned memory, valid until the next Begin.
  ffi::Error Take(size_t bytes, char** out) {
    bytes = RoundUp(bytes == 0 ? 1 : bytes, kAlignment);
    if (chunks_.empty() || used_ + bytes > chunks_.back().size) {
      JAXCOMM_RETURN_IF_ERROR(Grow(bytes));
    }
    *out = chunks_.back().data + used_;
    used_ += bytes;
    return ffi::Error::Success();
  }

  // After a call's copies were queued on `stream`.
  ffi::Error End(cudaStream_t stream) {
    JAXCOMM_CUDA_CHECK(cudaEventRecord, done_, stream);
    recorded_ = true;
    return ffi::Error::Success();
  }

  size_t bytes() const {
    size_t total = 0;
    for (const Chunk& chunk : chunks_) total += chunk.size;
    return total;
  }

  // Frees everything; the arena's last copies must have ended.
  ffi::Error Release() {
    for (Chunk& chunk : chunks_) JAXCOMM_CUDA_CHECK(cudaFreeHost, chunk.data);
    chunks_.clear();
    used_ = 0;
    return ffi::Error::Success();
  }

  ffi::Error Destroy() {
    if (recorded_) JAXCOMM_CUDA_CHECK(cudaEventSynchronize, done_);
    JAXCOMM_RETURN_IF_ERROR(Release());
    if (done_ != nullptr) JAXCOMM_CUDA_CHECK(cudaEventDestroy, done_);
    done_ = nullptr;
    for (cudaEvent_t event : events_) JAXCOMM_CUDA_CHECK(cudaEventDestroy, event);
    events_.clear();
    if (copy_stream_ != nullptr) JAXCOMM_CUDA_CHECK(cudaStreamDestroy, copy_stream_);
    copy_stream_ = nullptr;
    return ffi::Error::Success();
  }

 private:
  struct Chunk {
    char* data;
    size_t size;
  };

  // A new chunk of at least `bytes`; earlier chunks stay valid for this call.
  ffi::Error Grow(size_t bytes) {
    Chunk chunk{nullptr, RoundUp(bytes > kMinChunk ? bytes : kMinChunk, kMinChunk)};
    void* data = nullptr;
    // Portable: pinned for every device, whichever is current.
    JAXCOMM_CUDA_CHECK(cudaHostAlloc, &data, chunk.size, cudaHostAllocPortable);
    chunk.data = static_cast<char*>(data);
    chunks_.push_back(chunk);
    used_ = 0;
    return ffi::Error::Success();
  }

  int device_;
  std::vector<Chunk> chunks_;
  size_t used_ = 0;
  cudaEvent_t done_ = nullptr;
  cudaStream_t last_stream_ = nullptr;
  bool recorded_ = false;
  std::vector<cudaEvent_t> events_;
  size_t next_event_ = 0;
  cudaStream_t copy_stream_ = nullptr;
};

namespace {

// The arenas no call is using. Calls running at once (on several devices,
// or jitted and eager work in flight together) each take their own, so one
// call blocked in MPI never holds up another.
std::mutex arenas_mutex;
std::vector<StagingArena*> free_arenas;
std::vector<StagingArena*> all_arenas;

StagingArena* AcquireArena(int device) {
  std::lock_guard<std::mutex> lock(arenas_mutex);
  for (size_t i = 0; i < free_arenas.size(); ++i) {
    if (free_arenas[i]->device() == device) {
      StagingArena* arena = free_arenas[i];
      free_arenas.erase(free_arenas.begin() + i);
      return arena;
    }
  }
  all_arenas.push_back(new StagingArena(device));
  return all_arenas.back();
}

void ReleaseArena(StagingArena* arena) {
  std::lock_guard<std::mutex> lock(arenas_mutex);
  free_arenas.push_back(arena);
}

// A pinned block that a nonblocking request holds from its start to its
// wait. The wait queues the copy of what MPI received from it to the device
// on XLA's stream and records `copied` after it; the pool hands the block out
// again only once that event has been reached.
struct HeldBlock {
  char* data;
  size_t size;
  int device;
  cudaEvent_t copied;
  bool pending;  // `copied` recorded and perhaps not reached yet
};

std::mutex blocks_mutex;
std::vector<HeldBlock*> idle_blocks;
size_t blocks_in_use = 0;
size_t block_bytes = 0;  // of every block, idle or in use

// The smallest idle block on `device` of at least `bytes` whose last copy
// has run, or a new one.
ffi::Error TakeBlock(int device, size_t bytes, HeldBlock** out) {
  {
    std::lock_guard<std::mutex> lock(blocks_mutex);
    size_t best = idle_blocks.size();
    for (size_t i = 0; i < idle_blocks.size(); ++i) {
      HeldBlock* block = idle_blocks[i];
      if (block->device != device || block->size < bytes) continue;
      if (best < idle_blocks.size() && idle_blocks[best]->size <= block->size) {
        continue;
      }
      if (block->pending) {
        const cudaError_t rc = cudaEventQuery(block->copied);
        if (rc == cudaErrorNotReady) continue;
        if (rc != cudaSuccess) return CudaFailure("cudaEventQuery", rc);
        block->pending = false;
      }
      best = i;
    }
    if (best < idle_blocks.size()) {
      *out = idle_blocks[best];
      idle_blocks.erase(idle_blocks.begin() + best);
      ++blocks_in_use;
      return ffi::Error::Success();
    }
  }
  const size_t size = RoundUp(bytes == 0 ? 1 : bytes, kAlignment);
  void* data = nullptr;
  JAXCOMM_CUDA_CHECK(cudaHostAlloc, &data, size, cudaHostAllocPortable);
  cudaEvent_t copied;
  const cudaError_t rc = cudaEventCreateWithFlags(&copied, cudaEventDisableTiming);
  if (rc != cudaSuccess) {
    cudaFreeHost(data);
    return CudaFailure("cudaEventCreateWithFlags", rc);
  }
  std::lock_guard<std::mutex> lock(blocks_mutex);
  *out = new HeldBlock{static_cast<char*>(data), size, device, copied, false};
  ++blocks_in_use;
  block_bytes += size;
  return ffi::Error::Success();
}

void GiveBack(HeldBlock* block, bool pending) {
  std::lock_guard<std::mutex> lock(blocks_mutex);
  block->pending = pending;
  idle_blocks.push_back(block);
  --blocks_in_use;
}

}  // namespace

size_t StagingBytes() {
  size_t total = 0;
  {
    std::lock_guard<std::mutex> lock(arenas_mutex);
    for (const StagingArena* arena : all_arenas) total += arena->bytes();
  }
  std::lock_guard<std::mutex> lock(blocks_mutex);
  return total + block_bytes;
}

size_t StagingHeld() {
  std::lock_guard<std::mutex> lock(blocks_mutex);
  return blocks_in_use;
}

void FreeStaging() {
  std::lock_guard<std::mutex> lock(arenas_mutex);
  for (StagingArena* arena : free_arenas) {
    int previous;
    if (cudaGetDevice(&previous) == cudaSuccess && cudaSetDevice(arena->device()) == cudaSuccess) {
      // At exit there is no one left to tell about a failure.
      (void)arena->Destroy();
      cudaSetDevice(previous);
    }
    for (size_t i = 0; i < all_arenas.size(); ++i) {
      if (all_arenas[i] == arena) {
        all_arenas.erase(all_arenas.begin() + i);
        break;
      }
    }
    delete arena;
  }
  free_arenas.clear();
  std::lock_guard<std::mutex> blocks_lock(blocks_mutex);
  for (HeldBlock* block : idle_blocks) {
    // At exit there is no one left to tell about a failure.
    if (block->pending) (void)cudaEventSynchronize(block->copied);
    (void)cudaEventDestroy(block->copied);
    (void)cudaFreeHost(block->data);
    block_bytes -= block->size;
    delete block;
  }
  idle_blocks.clear();
}

CudaMemory::CudaMemory(cudaStream_t stream) : stream_(stream), direct_(CudaAware()) {
  // The handler runs on one of XLA's threads; CUDA calls below must act on
  // the stream's device.
#if CUDART_VERSION >= 12080
  cudaError_t rc = cudaStreamGetDevice(stream, &device_);
  if (rc != cudaSuccess) {
    init_error_ = CudaFailure("cudaStreamGetDevice", rc);
    return;
  }
  // Reading the current device is a thread-local lookup; setting it is not.
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess || current != device_) {
    rc = cudaSetDevice(device_);
    if (rc != cudaSuccess) init_error_ = CudaFailure("cudaSetDevice", rc);
  }
#else
  cudaError_t rc = cudaGetDevice(&device_);
  if (rc != cudaSuccess) init_error_ = CudaFailure("cudaGetDevice", rc);
#endif
}

CudaMemory::~CudaMemory() {
  if (arena_ != nullptr) {
    // A call that failed after Produced: its copies still read the arena.
    // If joining or recording fails the stream is broken, and XLA reports that.
    (void)Join();
    (void)arena_->End(stream_);
    ReleaseArena(arena_);
  }
}

CudaMemory::Staged* CudaMemory::Find(const void* device) {
  for (int i = 0; i < num_staged_; ++i) {
    if (staged_[i].device == device) return &staged_[i];
  }
  return nullptr;
}

CudaMemory::Staged* CudaMemory::Holding(const void* host) {
  const char* at = static_cast<const char*>(host);
  for (int i = 0; i < num_staged_; ++i) {
    const Staged& staged = staged_[i];
    if (at >= staged.host && at < staged.host + staged.bytes) return &staged_[i];
  }
  return nullptr;
}

ffi::Error CudaMemory::WaitFor(cudaEvent_t event) {
  TraceCopy traced(static_cast<int64_t>(copied_in_));
  const auto start = std::chrono::steady_clock::now();
  JAXCOMM_CUDA_CHECK(cudaEventSynchronize, event);
  clock_wait_ns.fetch_add(NanosecondsSince(start), std::memory_order_relaxed);
  return ffi::Error::Success();
}

ffi::Error CudaMemory::MarkEntry() {
  if (entry_ != nullptr) return ffi::Error::Success();
  size_t index;
  JAXCOMM_RETURN_IF_ERROR(arena_->TakeEvent(&index));
  JAXCOMM_CUDA_CHECK(cudaEventRecord, arena_->event(index), stream_);
  entry_ = arena_->event(index);
  return ffi::Error::Success();
}

ffi::Error CudaMemory::CopyIn(Staged& staged, size_t offset, const void* source, size_t bytes) {
  copied_in_ += bytes;
  if (piece_ == 0 || bytes <= piece_) {
    JAXCOMM_CUDA_CHECK(cudaMemcpyAsync, staged.host + offset, source, bytes, cudaMemcpyDeviceToHost,
                       stream_);
    if (pieced_) whole_after_pieces_ = true;
    return ffi::Error::Success();
  }
  // The copies back start from before these: MPI's first piece need not
  // wait for the other pieces to reach the host.
  JAXCOMM_RETURN_IF_ERROR(MarkEntry());
  staged.copied_from = offset;
  staged.events = 0;
  for (size_t done = 0; done < bytes; done += piece_) {
    const size_t n = bytes - done < piece_ ? bytes - done : piece_;
    JAXCOMM_CUDA_CHECK(cudaMemcpyAsync, staged.host + offset + done,
                       static_cast<const char*>(source) + done, n, cudaMemcpyDeviceToHost, stream_);
    size_t index;
    JAXCOMM_RETURN_IF_ERROR(arena_->TakeEvent(&index));
    JAXCOMM_CUDA_CHECK(cudaEventRecord, arena_->event(index), stream_);
    if (staged.events++ == 0) staged.first_event = index;
    if (!pieced_) {
      pieced_ = true;
      first_piece_event_ = index;
    }
  }
  return ffi::Error::Success();
}

ffi::Error CudaMemory::RoomToStage() const {
  if (num_staged_ < kMaxStaged) return ffi::Error::Success();
  return ffi::Error::Internal("jaxcomm: too many staged buffers in one call");
}

ffi::Error CudaMemory::UseArena() {
  if (arena_ != nullptr) return ffi::Error::Success();
  arena_ = AcquireArena(device_);
  ffi::Error begun = arena_->Begin(stream_);
  if (begun.failure()) {
    ReleaseArena(arena_);
    arena_ = nullptr;
  }
  return begun;
}

ffi::Error CudaMemory::Stage(void* device, size_t bytes, bool copy_in, bool copy_out, void** host) {
  JAXCOMM_RETURN_IF_ERROR(init_error_);
  JAXCOMM_RETURN_IF_ERROR(RoomToStage());
  JAXCOMM_RETURN_IF_ERROR(UseArena());
  char* data;
  JAXCOMM_RETURN_IF_ERROR(arena_->Take(bytes, &data));
  Staged& staged = staged_[num_staged_++];
  staged = Staged{device, data, bytes, copy_out ? bytes : 0};
  if (copy_in && bytes > 0) JAXCOMM_RETURN_IF_ERROR(CopyIn(staged, 0, device, bytes));
  *host = data;
  return ffi::Error::Success();
}

ffi::Error CudaMemory::Reach(void* device, size_t bytes, bool copy_in, bool copy_out, void** data) {
  JAXCOMM_RETURN_IF_ERROR(init_error_);
  if (direct_) {
    *data = device;
    return ffi::Error::Success();
  }
  return Stage(device, bytes, copy_in, copy_out, data);
}

ffi::Error CudaMemory::Input(const ffi::AnyBuffer& x, const void** data) {
  void* reached;
  JAXCOMM_RETURN_IF_ERROR(Reach(x.untyped_data(), x.size_bytes(), true, false, &reached));
  *data = reached;
  return ffi::Error::Success();
}

ffi::Error CudaMemory::Output(ffi::AnyBuffer& y, void** data) {
  return Reach(y.untyped_data(), y.size_bytes(), false, true, data);
}

ffi::Error CudaMemory::InPlace(ffi::AnyBuffer& y, void** data) {
  return Reach(y.untyped_data(), y.size_bytes(), true, true, data);
}

ffi::Error CudaMemory::HostInput(const ffi::AnyBuffer& x, const void** data) {
  void* host;
  JAXCOMM_RETURN_IF_ERROR(Stage(x.untyped_data(), x.size_bytes(), true, false, &host));
  *data = host;
  return ffi::Error::Success();
}

ffi::Error CudaMemory::HostOutput(ffi::AnyBuffer& y, void** data) {
  return Stage(y.untyped_data(), y.size_bytes(), false, true, data);
}

ffi::Error CudaMemory::Preload(ffi::AnyBuffer& y, size_t offset, const ffi::AnyBuffer& x) {
  if (x.size_bytes() == 0) return ffi::Error::Success();
  if (Staged* staged = Find(y.untyped_data())) {
    JAXCOMM_RETURN_IF_ERROR(CopyIn(*staged, offset, x.untyped_data(), x.size_bytes()));
  } else {
    JAXCOMM_CUDA_CHECK(cudaMemcpyAsync, static_cast<char*>(y.untyped_data()) + offset,
                       x.untyped_data(), x.size_bytes(), cudaMemcpyDeviceToDevice, stream_);
  }
  return ffi::Error::Success();
}

// Also waits for the kernels that wrote the inputs: XLA queued them on the
// stream before this call.
// A pipelined call waits only for its first piece: the event after it also
// marks the end of all the work queued before (later pieces: Arrived).
ffi::Error CudaMemory::Ready() {
  JAXCOMM_RETURN_IF_ERROR(init_error_);
  if (pieced_ && !whole_after_pieces_) return WaitFor(arena_->event(first_piece_event_));
  TraceCopy traced(static_cast<int64_t>(copied_in_));
  const auto start = std::chrono::steady_clock::now();
  JAXCOMM_CUDA_CHECK(cudaStreamSynchronize, stream_);
  clock_wait_ns.fetch_add(NanosecondsSince(start), std::memory_order_relaxed);
  return ffi::Error::Success();
}

ffi::Error CudaMemory::Arrived(const void* data, size_t bytes) {
  Staged* staged = piece_ > 0 && bytes > 0 ? Holding(data) : nullptr;
  if (staged == nullptr || staged->events == 0) return ffi::Error::Success();
  const char* start = staged->host + staged->copied_from;
  const char* end = static_cast<const char*>(data) + bytes;
  if (end <= start) return ffi::Error::Success();
  size_t last = static_cast<size_t>(end - start - 1) / piece_;
  if (last >= staged->events) last = staged->events - 1;
  return WaitFor(arena_->event(staged->first_event + last));
}

ffi::Error CudaMemory::Produced(const void* data, size_t bytes) {
  Staged* staged = piece_ > 0 && bytes > 0 ? Holding(data) : nullptr;
  if (staged == nullptr || staged->copy_back == 0) return ffi::Error::Success();
  cudaStream_t copy;
  JAXCOMM_RETURN_IF_ERROR(arena_->CopyStream(&copy));
  if (!producing_) {
    // The output's memory may still be in use by work queued on XLA's stream
    // before this call.
    JAXCOMM_RETURN_IF_ERROR(MarkEntry());
    JAXCOMM_CUDA_CHECK(cudaStreamWaitEvent, copy, entry_, 0);
    producing_ = true;
  }
  const size_t offset = static_cast<size_t>(static_cast<const char*>(data) - staged->host);
  JAXCOMM_CUDA_CHECK(cudaMemcpyAsync, static_cast<char*>(staged->device) + offset, data, bytes,
                     cudaMemcpyHostToDevice, copy);
  staged->produced = true;
  return ffi::Error::Success();
}

ffi::Error CudaMemory::Join() {
  if (!producing_) return ffi::Error::Success();
  producing_ = false;
  cudaStream_t copy;
  JAXCOMM_RETURN_IF_ERROR(arena_->CopyStream(&copy));
  size_t index;
  JAXCOMM_RETURN_IF_ERROR(arena_->TakeEvent(&index));
  JAXCOMM_CUDA_CHECK(cudaEventRecord, arena_->event(index), copy);
  JAXCOMM_CUDA_CHECK(cudaStreamWaitEvent, stream_, arena_->event(index), 0);
  return ffi::Error::Success();
}

ffi::Error CudaMemory::ZeroFrom(ffi::AnyBuffer& y, size_t offset) {
  if (offset >= y.size_bytes()) return ffi::Error::Success();
  // After the pieces Produced copied there.
  JAXCOMM_RETURN_IF_ERROR(Join());
  if (Staged* staged = Find(y.untyped_data())) {
    if (staged->copy_back > offset) staged->copy_back = offset;
  }
  JAXCOMM_CUDA_CHECK(cudaMemsetAsync, static_cast<char*>(y.untyped_data()) + offset, 0,
                     y.size_bytes() - offset, stream_);
  return ffi::Error::Success();
}

ffi::Error CudaMemory::Finish() {
  for (int i = 0; i < num_staged_; ++i) {
    const Staged& staged = staged_[i];
    if (staged.copy_back > 0 && !staged.produced) {
      JAXCOMM_CUDA_CHECK(cudaMemcpyAsync, staged.device, staged.host, staged.copy_back,
                         cudaMemcpyHostToDevice, stream_);
    }
  }
  return Join();
}

// Nonblocking starts and waits --------------------------------------------

ffi::Error CudaMemory::Hold(void* buffer, size_t bytes, bool copy_in, Held* held, void** data) {
  JAXCOMM_RETURN_IF_ERROR(init_error_);
  *held = Held{buffer, bytes, nullptr};
  if (direct_) {
    *data = buffer;
    return ffi::Error::Success();
  }
  const bool pieced = copy_in && piece_ > 0 && bytes > piece_;
  if (pieced) {
    // The pieces' events come from the call's arena, and Arrived finds the
    // block among the call's staged buffers.
    JAXCOMM_RETURN_IF_ERROR(RoomToStage());
    JAXCOMM_RETURN_IF_ERROR(UseArena());
  }
  HeldBlock* block;
  JAXCOMM_RETURN_IF_ERROR(TakeBlock(device_, bytes, &block));
  held->staging = block;
  *data = block->data;
  if (pieced) {
    Staged& staged = staged_[num_staged_++];
    staged = Staged{buffer, block->data, bytes, 0};
    return CopyIn(staged, 0, buffer, bytes);
  }
  if (copy_in && bytes > 0) {
    copied_in_ += bytes;
    JAXCOMM_CUDA_CHECK(cudaMemcpyAsync, block->data, buffer, bytes, cudaMemcpyDeviceToHost,
                       stream_);
  }
  return ffi::Error::Success();
}

ffi::Error CudaMemory::HoldInput(const ffi::AnyBuffer& x, const void** data, Held* held) {
  void* reached;
  JAXCOMM_RETURN_IF_ERROR(Hold(x.untyped_data(), x.size_bytes(), true, held, &reached));
  *data = reached;
  return ffi::Error::Success();
}

ffi::Error CudaMemory::HoldOutput(ffi::AnyBuffer& y, void** data, Held* held) {
  JAXCOMM_RETURN_IF_ERROR(RoomToStage());
  JAXCOMM_RETURN_IF_ERROR(Hold(y.untyped_data(), y.size_bytes(), false, held, data));
  if (held->staging != nullptr) {
    // Listed with the call's staged buffers for Preload; nothing goes back
    // to the device in Finish(): Unhold copies at the wait.
    staged_[num_staged_++] = Staged{y.untyped_data(), static_cast<char*>(*data), y.size_bytes(), 0};
  }
  return ffi::Error::Success();
}

ffi::Error CudaMemory::Deliver(Held& held, ffi::AnyBuffer& out, size_t upto) {
  HeldBlock* block = static_cast<HeldBlock*>(held.staging);
  if (block == nullptr) return ffi::Error::Success();
  JAXCOMM_RETURN_IF_ERROR(init_error_);
  if (upto > out.size_bytes()) upto = out.size_bytes();
  if (upto <= held.delivered) return ffi::Error::Success();
  // On XLA's stream, which has run everything before the wait already (the
  // wait read its handle): the copy starts at once, beside the MPI calls
  // still to come.
  JAXCOMM_CUDA_CHECK(cudaMemcpyAsync, static_cast<char*>(out.untyped_data()) + held.delivered,
                     block->data + held.delivered, upto - held.delivered, cudaMemcpyHostToDevice,
                     stream_);
  held.delivered = upto;
  return ffi::Error::Success();
}

ffi::Error CudaMemory::Unhold(Held& held, ffi::AnyBuffer* out, size_t filled) {
  HeldBlock* block = static_cast<HeldBlock*>(held.staging);
  const char* source = static_cast<const char*>(block != nullptr ? block->data : held.buffer);
  // What Deliver sent already (only ever from a block, whose copies then
  // read it after this call whatever happens here).
  const size_t delivered = held.delivered;
  held = Held{};
  ffi::Error error = init_error_;
  bool copied = delivered > 0;
  if (out != nullptr && error.success()) {
    if (filled > out->size_bytes()) filled = out->size_bytes();
    if (filled > delivered && out->untyped_data() != source) {
      const cudaError_t rc = cudaMemcpyAsync(
          static_cast<char*>(out->untyped_data()) + delivered, source + delivered,
          filled - delivered, block != nullptr ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToDevice,
          stream_);
      if (rc != cudaSuccess) error = CudaFailure("cudaMemcpyAsync", rc);
      copied = copied || (block != nullptr && rc == cudaSuccess);
    }
    if (error.success()) error = ZeroFrom(*out, std::max(filled, delivered));
  }
  if (block == nullptr) return error;
  // A copy from the block runs after this call returned: the pool reuses the
  // block only once the event recorded after it is reached. Recording needs
  // the stream on the block's device; otherwise, or if it fails, wait for
  // the copy here.
  bool pending = false;
  if (copied) {
    if (block->device == device_ && cudaEventRecord(block->copied, stream_) == cudaSuccess) {
      pending = true;
    } else {
      const cudaError_t rc = cudaStreamSynchronize(stream_);
      if (error.success() && rc != cudaSuccess) {
        error = CudaFailure("cudaStreamSynchronize", rc);
      }
    }
  }
  GiveBack(block, pending);
  return error;
}

}  // namespace jaxcomm
