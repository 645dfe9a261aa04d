// Copy-MPI-copy through pinned host memory: the fastest that host staging of
// GPU buffers can be, as a yardstick for jaxcomm's staging path; and, for a
// CUDA-aware MPI, the MPI call on the device pointers alone, the yardstick
// for jaxcomm's direct path.
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
enum Kind { kAllreduce = 0, kBcast = 1, kAllgather = 2, kSendrecv = 3, kAlltoall = 4, kRagged = 5 };

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

// The ragged exchange's rows (float32 elements) from rank i to rank j, out of
// `chunk` = elements / size: every other pair sends half a chunk, as gpu.py's
// ragged_layout does; each slice lands at chunk * (its sender) on the receiver.
int RaggedRows(int i, int j, int chunk) { return chunk - ((i + j) % 2) * (chunk / 2); }

// The MPI call of `kind` on `bytes` bytes per rank, from `send` into `recv`
// (host or device memory alike); broadcast works in place in `send` on root
// and in `recv` elsewhere.
bool Call(int kind, MPI_Comm comm, const void* send, void* recv, size_t bytes, int rank, int size) {
  const int count = static_cast<int>(bytes);
  switch (kind) {
    case kAllreduce:
      return Mpi(MPI_Allreduce(send, recv, count / 4, MPI_FLOAT, MPI_SUM, comm), "MPI_Allreduce");
    case kBcast:
      return Mpi(MPI_Bcast(rank == 0 ? const_cast<void*>(send) : recv, count, MPI_BYTE, 0, comm),
                 "MPI_Bcast");
    case kAllgather:
      return Mpi(MPI_Allgather(send, count, MPI_BYTE, recv, count, MPI_BYTE, comm),
                 "MPI_Allgather");
    case kSendrecv:
      return Mpi(MPI_Sendrecv(send, count, MPI_BYTE, (rank + 1) % size, 0, recv, count, MPI_BYTE,
                              (rank + size - 1) % size, 0, comm, MPI_STATUS_IGNORE),
                 "MPI_Sendrecv");
    case kAlltoall:
      return Mpi(MPI_Alltoall(send, count / size, MPI_BYTE, recv, count / size, MPI_BYTE, comm),
                 "MPI_Alltoall");
    case kRagged: {
      const int chunk = count / 4 / size;
      std::vector<int> send_counts(size), send_displs(size), recv_counts(size), recv_displs(size);
      for (int j = 0; j < size; ++j) {
        send_counts[j] = RaggedRows(rank, j, chunk);
        send_displs[j] = j * chunk;
        recv_counts[j] = RaggedRows(j, rank, chunk);
        recv_displs[j] = j * chunk;
      }
      return Mpi(MPI_Alltoallv(send, send_counts.data(), send_displs.data(), MPI_FLOAT, recv,
                               recv_counts.data(), recv_displs.data(), MPI_FLOAT, comm),
                 "MPI_Alltoallv");
    }
    default:
      return Fail("unknown kind " + std::to_string(kind));
  }
}

// One call: device -> pinned host, MPI on the host buffers, host -> device.
bool Once(int kind, MPI_Comm comm, const void* send, void* recv, size_t bytes, int rank, int size) {
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
  if (!Call(kind, comm, staging.send, kind == kBcast ? staging.send : staging.recv, bytes, rank,
            size)) {
    return false;
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
// rank - 1, 4 alltoall, 5 the ragged exchange, an MPI_Alltoallv of float32)
// on `bytes` bytes per rank, over `iterations` calls after `warmup` untimed
// ones; with `direct` nonzero, of the MPI call alone on the device pointers
// (a CUDA-aware MPI only). `send` and `recv` are device pointers; `recv` holds
// size * bytes for allgather. Collective over the communicator whose Fortran
// handle is `fortran_comm`. Returns a negative number on failure; then
// jaxcomm_reference_error() says why.
double jaxcomm_reference(int kind, int64_t fortran_comm, const void* send, void* recv,
                         int64_t bytes, int iterations, int warmup, int direct) {
  using namespace jaxcomm;
  MPI_Comm comm = MPI_Comm_f2c(static_cast<MPI_Fint>(fortran_comm));
  int rank = 0, size = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  const bool floats = kind == kAllreduce || kind == kRagged;
  const int64_t multiple = (floats ? 4 : 1) * (kind == kAlltoall || kind == kRagged ? size : 1);
  if (bytes <= 0 || bytes > INT32_MAX || bytes % multiple || iterations < 1) {
    Fail(
        "bytes must be in 1..2^31-1 and a multiple of 4 for float32 ops and of size for "
        "alltoall; iterations >= 1");
    return -1;
  }
  const size_t n = static_cast<size_t>(bytes);
  const size_t out = kind == kAllgather ? n * size : n;
  if (!direct && ((staging.stream == nullptr &&
                   !Cuda(cudaStreamCreateWithFlags(&staging.stream, cudaStreamNonBlocking),
                         "cudaStreamCreate")) ||
                  !Reserve(&staging.send, &staging.send_bytes, n) ||
                  !Reserve(&staging.recv, &staging.recv_bytes, out))) {
    return -1;
  }
  std::vector<double> seconds;
  seconds.reserve(iterations);
  for (int i = 0; i < warmup + iterations; ++i) {
    const double start = MPI_Wtime();
    if (!(direct ? Call(kind, comm, send, recv, n, rank, size)
                 : Once(kind, comm, send, recv, n, rank, size))) {
      return -1;
    }
    if (i >= warmup) seconds.push_back(MPI_Wtime() - start);
  }
  std::nth_element(seconds.begin(), seconds.begin() + seconds.size() / 2, seconds.end());
  return seconds[seconds.size() / 2];
}

const char* jaxcomm_reference_error() { return jaxcomm::last_error.c_str(); }

}  // extern "C"
