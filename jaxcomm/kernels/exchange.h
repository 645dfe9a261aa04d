// Exchanges whose counts are operands (gather.cc): the header step every
// form shares, and how the rows then move. The blocking forms
// (ragged_all_to_all, alltoallv with this rank's counts) move them with one
// MPI_Alltoallv; their nonblocking forms (nonblocking.cc) start an
// MPI_Ialltoallv that a wait completes.
#ifndef JAXCOMM_KERNELS_EXCHANGE_H_
#define JAXCOMM_KERNELS_EXCHANGE_H_

#include <mpi.h>

#include <cstddef>
#include <string>
#include <vector>

#include "call.h"
#include "memory.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

namespace ffi = xla::ffi;

// The buffers and the mode of one exchange.
struct Exchange {
  const ffi::AnyBuffer& operand;
  const ffi::AnyBuffer& output;
  const ffi::AnyBuffer& indices;  // [4, size]
  bool reverse;
  bool packed;
  bool check_sizes;
};

// MPI arguments of one side of the exchange, in elements.
struct Side {
  std::vector<size_t> counts, displs;
  void Clear() {
    counts.clear();
    displs.clear();
  }
};

// The rows' move, once the headers are exchanged and checked.
struct Rows {
  const void* send_data;
  const Side& send;
  void* recv_data;
  const Side& recv;
  MPI_Datatype dtype;
  // Some rank needs MPI_Alltoallw (counts past MaxCount()).
  bool large;
  // Why this rank's learned side is wrong, or "": the rows still move
  // (through scratch memory), and the call fails after.
  const std::string& learned_error;

  // MPI_Alltoallv's int arguments: send counts, send displacements, receive
  // counts, receive displacements, `size` each (only when !large).
  void IntArguments(std::vector<int>& ints) const;
};

// How an exchange reaches its buffers and moves its rows: blocking or started.
class ExchangeMover {
 public:
  virtual ~ExchangeMover() = default;
  // The pointers MPI reads the operand through and writes the result `y`
  // through; `y` must start as the output's copy.
  virtual ffi::Error Buffers(const Exchange& e, ffi::AnyBuffer& y, void** in, void** out) = 0;
  // `bytes` of zeroed memory that live until the rows have moved.
  virtual void* Scratch(size_t bytes) = 0;
  // Moves the rows (after Memory::Ready) and, blocking, finishes the call.
  virtual ffi::Error Move(const Rows& rows) = 0;
};

// The exchange `e` into `y`, with what it learned written to `info`: the
// header MPI_Alltoall and every check (the same for each form), then the
// rows by `mover`.
ffi::Error RunExchange(const Call& call, Memory& memory, const Exchange& e, ffi::AnyBuffer& y,
                       ffi::AnyBuffer& info, ExchangeMover& mover);

// MPI_Alltoallw arguments for blocks of any length at any offset: a non-empty
// block is one element of a derived datatype that starts at the block's
// offset, so every int count is 0 or 1 and every int displacement 0.
class PeerBlocks {
 public:
  PeerBlocks() = default;
  PeerBlocks(const PeerBlocks&) = delete;
  PeerBlocks& operator=(const PeerBlocks&) = delete;
  ~PeerBlocks();

  // Appends the next peer's block: `count` elements of `base`, starting
  // `offset` elements into the buffer.
  ffi::Error Add(MPI_Datatype base, size_t offset, size_t count, MPI_Comm comm);

  const int* counts() const { return counts_.data(); }
  const int* displs() const { return displs_.data(); }
  const MPI_Datatype* types() const { return types_.data(); }

 private:
  std::vector<int> counts_, displs_;
  std::vector<MPI_Datatype> types_, owned_;
};

// MPI_Alltoallw's blocks for both sides of `rows` (when rows.large).
ffi::Error RowBlocks(const Rows& rows, MPI_Comm comm, PeerBlocks& send, PeerBlocks& recv);

}  // namespace jaxcomm

#endif  // JAXCOMM_KERNELS_EXCHANGE_H_
