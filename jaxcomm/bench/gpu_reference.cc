// Copy-MPI-copy through pinned host memory: the fastest that host staging of
// GPU buffers can be, as a yardstick for jaxcomm's staging path.
//
// jaxcomm/bench/gpu.py builds this file with the MPI compiler wrapper that mpi4py's
// MPI came with, links the CUDA runtime statically and calls it through
// ctypes with the device pointers of JAX arrays (unsafe_buffer_pointer()).
// The caller has finished every write to those arrays before the call.

#include <cuda_runtime.h>
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace jaxcomm {
namespace {

// Values of `kind`, in the order gpu.py names them.
enum Kind { kAllreduce = 0, kBcast = 1, kAllgather = 2, kSendrecv = 3 };

std::string last_error;

// Pinned buffers and the copy stream live for the whole process: allocating
// them is not part of what staging costs per call.
struct Staging {
  void* send = nullptr;
  void* recv = nullptr;
  size_t send_bytes = 0;
  size_t recv_bytes = 0;
  cudaStream_t stream = nullptr;
};
Staging staging;

bool Fail(const std::string& what) {
  last_error = what;
  return false;
}

bool Cuda(cudaError_t status, const char* call) {
  if (status == cudaSuccess) return true;
  return Fail(std::string(call) + ": " + cudaGetErrorString(status));
}

bool Mpi(int status, const char* call) {
  if (status == MPI_SUCCESS) return true;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(status, text, &length);
  return Fail(std::string(call) + ": " + std::string(text, length));
}

bool Reserve(void** buffer, size_t* have, size_t bytes) {
  if (*have >= bytes) return true;
  if (*buffer != nullptr && !Cuda(cudaFreeHost(*buffer), "cudaFreeHost")) return false;
  *buffer = nullptr;
  *have = 0;
  if (!Cuda(cudaHostAlloc(buffer, bytes, cudaHostAllocDefault), "cudaHostAlloc")) return false;
  *have = bytes;
  return true;
}

// One call: device -> pinned host, MPI on the host buffers, host -> device.
bool Once(int kind, MPI_Comm comm, const void* send, void* recv, size_t bytes, int rank, int size) {
  const int count = static_cast<int>(bytes);
  const bool copies_in = kind != kBcast || rank == 0;
  const size_t out_bytes = kind == kAllgather ? bytes * size : bytes;
  // Broadcast works in place, in the buffer root filled.
  const void* result = kind == kBcast ? staging.send : staging.recv;
  if (copies_in) {
    if (!Cuda(cudaMemcpyAsync(staging.send, send, bytes, cudaMemcpyDeviceToHost, staging.stream),
              "cudaMemcpyAsync D2H") ||
        !Cuda(cudaStreamSynchronize(staging.stream), "cudaStreamSynchronize")) {
      return false;
    }
  }
  switch (kind) {
    case kAllreduce:
      if (!Mpi(MPI_Allreduce(staging.send, staging.recv, count / 4, MPI_FLOAT, MPI_SUM, comm),
               "MPI_Allreduce")) {
        return false;
      }
      break;
    case kBcast:
      if (!Mpi(MPI_Bcast(staging.send, count, MPI_BYTE, 0, comm), "MPI_Bcast")) return false;
      break;
    case kAllgather:
      if (!Mpi(MPI_Allgather(staging.send, count, MPI_BYTE, staging.recv, count, MPI_BYTE, comm),
               "MPI_Allgather")) {
        return false;
      }
      break;
    case kSendrecv:
      if (!Mpi(MPI_Sendrecv(staging.send, count, MPI_BYTE, (rank + 1) % size, 0, staging.recv,
                            count, MPI_BYTE, (rank + size - 1) % size, 0, comm, MPI_STATUS_IGNORE),
               "MPI_Sendrecv")) {
        return false;
      }
      break;
    default:
      return Fail("unknown kind " + std::to_string(kind));
  }
  return Cuda(cudaMemcpyAsync(recv, result, out_bytes, cudaMemcpyHostToDevice, staging.stream),
              "cudaMemcpyAsync H2D") &&
         Cuda(cudaStreamSynchronize(staging.stream), "cudaStreamSynchronize");
}

}  // namespace
}  // namespace jaxcomm

extern "C" {

// Median seconds of one staged call of `kind` (0 allreduce of float32 with
// MPI_SUM, 1 bcast from rank 0, 2 allgather, 3 sendrecv to rank + 1 from
// rank - 1) on `bytes` bytes per rank, over `iterations` calls after
// `warmup` untimed ones. `send` and `recv` are device pointers; `recv` holds
// size * bytes for allgather. Collective over the communicator whose Fortran
// handle is `fortran_comm`. Returns a negative number on failure; then
// jaxcomm_reference_error() says why.
double jaxcomm_reference(int kind, int64_t fortran_comm, const void* send, void* recv,
                         int64_t bytes, int iterations, int warmup) {
  using namespace jaxcomm;
  MPI_Comm comm = MPI_Comm_f2c(static_cast<MPI_Fint>(fortran_comm));
  int rank = 0, size = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  if (bytes <= 0 || bytes > INT32_MAX || (kind == kAllreduce && bytes % 4) || iterations < 1) {
    Fail("bytes must be in 1..2^31-1 (a multiple of 4 for allreduce), iterations >= 1");
    return -1;
  }
  const size_t n = static_cast<size_t>(bytes);
  const size_t out = kind == kAllgather ? n * size : n;
  if ((staging.stream == nullptr &&
       !Cuda(cudaStreamCreateWithFlags(&staging.stream, cudaStreamNonBlocking),
             "cudaStreamCreate")) ||
      !Reserve(&staging.send, &staging.send_bytes, n) ||
      !Reserve(&staging.recv, &staging.recv_bytes, out)) {
    return -1;
  }
  std::vector<double> seconds;
  seconds.reserve(iterations);
  for (int i = 0; i < warmup + iterations; ++i) {
    const double start = MPI_Wtime();
    if (!Once(kind, comm, send, recv, n, rank, size)) return -1;
    if (i >= warmup) seconds.push_back(MPI_Wtime() - start);
  }
  std::nth_element(seconds.begin(), seconds.begin() + seconds.size() / 2, seconds.end());
  return seconds[seconds.size() / 2];
}

const char* jaxcomm_reference_error() { return jaxcomm::last_error.c_str(); }

}  // extern "C"
