// Gather family: MPI_Allgather, MPI_Gather, MPI_Scatter, MPI_Alltoall, the
// variable-size MPI_Allgatherv, MPI_Gatherv, MPI_Scatterv, MPI_Alltoallv, and
// the exchanges whose counts are operands (ragged_all_to_all, alltoallv with
// this rank's counts): an MPI_Alltoall of per-peer headers, then one
// MPI_Alltoallv.
//
// The fixed-size ops move one rank's block as one LargeType element when it
// exceeds MaxCount(): the derived type's extent is the whole block, so MPI
// still finds block r at r block lengths. The *v ops also take int
// displacements, which no datatype widens; past MaxCount() they fall back to
// other calls (see each handler).
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "exchange.h"

namespace jaxcomm {
namespace {

// Per-rank blocks of whole rows, stored one after another in rank order, in
// elements, and their int forms for one MPI call where they fit.
class Blocks {
 public:
  // The blocks of `rows` rows of `row_elements` each, in this thread's
  // storage (`which`: 0 or 1, for a call's two sets): later calls reuse it,
  // so a steady workload allocates nothing. A thread runs one handler at a
  // time.
  static const Blocks& Of(int which, ffi::Span<const int64_t> rows, size_t row_elements) {
    thread_local Blocks scratch[2];
    Blocks& blocks = scratch[which];
    blocks.counts.clear();
    blocks.displs.clear();
    blocks.int_counts_.clear();
    blocks.int_displs_.clear();
    blocks.fit_int_ = true;
    size_t offset = 0;
    for (int64_t r : rows) {
      const size_t count = static_cast<size_t>(r) * row_elements;
      blocks.counts.push_back(count);
      blocks.displs.push_back(offset);
      blocks.fit_int_ = blocks.fit_int_ && count <= MaxCount() && offset <= MaxCount();
      offset += count;
    }
    if (blocks.fit_int_) {
      blocks.int_counts_.assign(blocks.counts.begin(), blocks.counts.end());
      blocks.int_displs_.assign(blocks.displs.begin(), blocks.displs.end());
    }
    return blocks;
  }

  // Whether every count and displacement fits the int arguments of one call.
  bool FitInt() const { return fit_int_; }

  // The int arguments, where FitInt().
  const int* IntCounts() const { return int_counts_.data(); }
  const int* IntDispls() const { return int_displs_.data(); }

  std::vector<size_t> counts, displs;

 private:
  std::vector<int> int_counts_, int_displs_;
  bool fit_int_ = true;
};

// "communicator size <size> x <what> <n>", how a block-per-rank count is made.
std::string PerRank(int size, const char* what, size_t n) {
  return "communicator size " + std::to_string(size) + " x " + what + " " + std::to_string(n);
}

// Allgather and Gather stack one input per rank into y. Checked on every rank,
// though Gather only writes y on the root, so that all ranks fail alike.
ffi::Error CheckStacked(const Call& call, const ffi::AnyBuffer& x, const ffi::AnyBuffer& y,
                        const WholeBuffer& whole) {
  const int size = call.size();
  JAXCOMM_RETURN_IF_ERROR(CheckType(call, x, y));
  return CheckElements(call, "output", whole.elements(), size * x.element_count(),
                       [&] { return PerRank(size, "input", x.element_count()); });
}

// The checks every *v op with one counts attribute makes: `counts` is valid,
// `whole` holds sum(counts) rows and `own` this rank's count of them.
// `whole_is_output` says which of x and y `whole` is.
// `whole` describes that buffer as root has it.
ffi::Error CheckRows(const Call& call, ffi::Span<const int64_t> counts, const ffi::AnyBuffer& x,
                     const ffi::AnyBuffer& y, bool whole_is_output, const WholeBuffer& whole) {
  JAXCOMM_RETURN_IF_ERROR(CheckCounts(call, "counts", counts, call.size()));
  const size_t row = whole.row();
  const size_t own = static_cast<size_t>(counts[call.rank()]);
  const size_t all = Sum(counts);
  const auto all_rows = [&] { return RowsOf("sum(counts)", all, row); };
  const auto own_rows = [&] { return RowsOf("counts[rank]", own, row); };
  if (whole_is_output) {
    JAXCOMM_RETURN_IF_ERROR(CheckType(call, x, y));
    JAXCOMM_RETURN_IF_ERROR(CheckElements(call, "output", whole.elements(), all * row, all_rows));
    return CheckElements(call, "input", x.element_count(), own * row, own_rows);
  }
  JAXCOMM_RETURN_IF_ERROR(CheckElements(call, "input", whole.elements(), all * row, all_rows));
  return CheckOutput(call, x, y, own * row, own_rows);
}

}  // namespace

PeerBlocks::~PeerBlocks() {
  for (MPI_Datatype& t : owned_) {
    if (t != MPI_DATATYPE_NULL) MPI_Type_free(&t);
  }
}

ffi::Error PeerBlocks::Add(MPI_Datatype base, size_t offset, size_t count, MPI_Comm comm) {
  MPI_Datatype type = base;
  if (count > 0) {
    LargeType span;
    JAXCOMM_RETURN_IF_ERROR(LargeType::Make(base, count, comm, &span));
    MPI_Aint lb, extent;
    JAXCOMM_MPI_CHECK(comm, MPI_Type_get_extent, base, &lb, &extent);
    const int length = span.count();
    const MPI_Aint displacement = static_cast<MPI_Aint>(offset) * extent;
    owned_.push_back(MPI_DATATYPE_NULL);
    JAXCOMM_MPI_CHECK(comm, MPI_Type_create_hindexed, 1, &length, &displacement, span.type(),
                      &owned_.back());
    JAXCOMM_MPI_CHECK(comm, MPI_Type_commit, &owned_.back());
    type = owned_.back();
  }
  counts_.push_back(count > 0 ? 1 : 0);
  displs_.push_back(0);
  types_.push_back(type);
  return ffi::Error::Success();
}

ffi::Error RowBlocks(const Rows& rows, MPI_Comm comm, PeerBlocks& send, PeerBlocks& recv) {
  for (size_t p = 0; p < rows.send.counts.size(); ++p) {
    JAXCOMM_RETURN_IF_ERROR(send.Add(rows.dtype, rows.send.displs[p], rows.send.counts[p], comm));
    JAXCOMM_RETURN_IF_ERROR(recv.Add(rows.dtype, rows.recv.displs[p], rows.recv.counts[p], comm));
  }
  return ffi::Error::Success();
}

void Rows::IntArguments(std::vector<int>& ints) const {
  const size_t size = send.counts.size();
  ints.resize(4 * size);
  for (size_t p = 0; p < size; ++p) {
    ints[p] = static_cast<int>(send.counts[p]);
    ints[size + p] = static_cast<int>(send.displs[p]);
    ints[2 * size + p] = static_cast<int>(recv.counts[p]);
    ints[3 * size + p] = static_cast<int>(recv.displs[p]);
  }
}

namespace {

// The *v ops' fallback past MaxCount(): one MPI_Alltoallw, whose per-peer
// datatypes carry the offsets as MPI_Aint. It stays a collective, so unlike
// point-to-point messages (every tag belongs to the user) it can never match
// the user's own sends and receives on this communicator.
// `x` is the input, `elements` its elements (root's, where x is a placeholder).
ffi::Error Alltoallw(const Call& call, const ffi::AnyBuffer& x, const void* in,
                     const PeerBlocks& send, void* out, const PeerBlocks& recv, size_t elements) {
  call.Log([&] { return "MPI_Alltoallw " + Elements(elements, x.element_type()); });
  JAXCOMM_MPI_CHECK(call, MPI_Alltoallw, in, send.counts(), send.displs(), send.types(), out,
                    recv.counts(), recv.displs(), recv.types(), call.comm());
  return ffi::Error::Success();
}

// A pipelined allgather: piece k of every rank's block at a time, received
// at its place in each block through a datatype whose extent is the block.
ffi::Error AllgatherPieces(const Call& call, Memory& memory, ffi::DataType dtype, size_t count,
                           size_t piece, void* in, void* out) {
  MPI_Datatype base;
  JAXCOMM_RETURN_IF_ERROR(MpiDatatype(dtype, &base));
  const size_t width = ffi::ByteWidth(dtype);
  const int size = call.size();
  // One datatype per piece length: the full one and the last, shorter one.
  MPI_Datatype strided[2] = {MPI_DATATYPE_NULL, MPI_DATATYPE_NULL};
  int lengths[2] = {0, 0};
  const ffi::Error done = ForEachChunk(
      count,
      [&](size_t offset, int n) {
        const int which = n == static_cast<int>(piece) ? 0 : 1;
        if (lengths[which] != n) {
          if (strided[which] != MPI_DATATYPE_NULL) MPI_Type_free(&strided[which]);
          MPI_Datatype run;
          JAXCOMM_MPI_CHECK(call, MPI_Type_contiguous, n, base, &run);
          const int rc = MPI_Type_create_resized(run, 0, static_cast<MPI_Aint>(count * width),
                                                 &strided[which]);
          MPI_Type_free(&run);
          if (rc != MPI_SUCCESS) return MpiFailure("MPI_Type_create_resized", rc, call);
          JAXCOMM_MPI_CHECK(call, MPI_Type_commit, &strided[which]);
          lengths[which] = n;
        }
        void* mine = ElementAt(in, dtype, offset);
        JAXCOMM_RETURN_IF_ERROR(memory.Arrived(mine, n * width));
        call.Log([&] { return "MPI_Allgather " + Elements(n, dtype); });
        JAXCOMM_MPI_CHECK(call, MPI_Allgather, mine, n, base, ElementAt(out, dtype, offset), 1,
                          strided[which], call.comm());
        for (int r = 0; r < size; ++r) {
          JAXCOMM_RETURN_IF_ERROR(
              memory.Produced(ElementAt(out, dtype, r * count + offset), n * width));
        }
        return ffi::Error::Success();
      },
      piece);
  for (MPI_Datatype& t : strided) {
    if (t != MPI_DATATYPE_NULL) MPI_Type_free(&t);
  }
  return done;
}

}  // namespace

ffi::Error AllgatherImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                         ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y) {
  JAXCOMM_RETURN_IF_ERROR(call.Announce(Collective::Of(x)));
  JAXCOMM_RETURN_IF_ERROR(CheckStacked(call, x, *y, WholeBuffer(*y, false)));
  LargeType block;
  JAXCOMM_RETURN_IF_ERROR(
      LargeType::Make(x.element_type(), x.element_count(), call.comm(), &block));
  const size_t count = x.element_count();
  const size_t width = ffi::ByteWidth(x.element_type());
  const size_t piece = PipelinedPiece(memory, count, width);
  void *in, *out;
  JAXCOMM_RETURN_IF_ERROR(memory.Buffers(x, *y, &in, &out));
  if (piece < count) {
    JAXCOMM_RETURN_IF_ERROR(AllgatherPieces(call, memory, x.element_type(), count, piece, in, out));
    return memory.Finish();
  }
  call.Log([&] { return "MPI_Allgather " + Elements(count, x.element_type()); });
  JAXCOMM_MPI_CHECK(call, MPI_Allgather, in, block.count(), block.type(), out, block.count(),
                    block.type(), call.comm());
  return memory.Finish();
}

ffi::Error GatherImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                      ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y, int64_t root) {
  JAXCOMM_RETURN_IF_ERROR(call.Announce(Collective::Of(x).Root(root)));
  JAXCOMM_RETURN_IF_ERROR(CheckStacked(call, x, *y, WholeBuffer::OfRoot(call, root, *y)));
  LargeType block;
  JAXCOMM_RETURN_IF_ERROR(
      LargeType::Make(x.element_type(), x.element_count(), call.comm(), &block));
  void *in, *out;
  JAXCOMM_RETURN_IF_ERROR(memory.Buffers(x, *y, &in, &out));
  call.Log([&] {
    return "MPI_Gather root " + std::to_string(root) + " " +
           Elements(x.element_count(), x.element_type());
  });
  JAXCOMM_MPI_CHECK(call, MPI_Gather, in, block.count(), block.type(), out, block.count(),
                    block.type(), static_cast<int>(root), call.comm());
  return memory.Finish();
}

ffi::Error ScatterImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                       ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y, int64_t root) {
  const WholeBuffer whole = WholeBuffer::OfRoot(call, root, x);
  const int64_t elements = static_cast<int64_t>(whole.elements());
  JAXCOMM_RETURN_IF_ERROR(call.Announce(Collective{x.element_type(), elements}.Root(root)));
  const int size = call.size();
  // The output's element type; its count is the block size.
  JAXCOMM_RETURN_IF_ERROR(
      CheckOutput(call, x, *y, y->element_count(), [] { return std::string(); }));
  JAXCOMM_RETURN_IF_ERROR(
      CheckElements(call, "input", whole.elements(), size * y->element_count(),
                    [&] { return PerRank(size, "output", y->element_count()); }));
  LargeType block;
  JAXCOMM_RETURN_IF_ERROR(
      LargeType::Make(x.element_type(), y->element_count(), call.comm(), &block));
  void *in, *out;
  JAXCOMM_RETURN_IF_ERROR(memory.Buffers(x, *y, &in, &out));
  call.Log([&] {
    return "MPI_Scatter root " + std::to_string(root) + " " +
           Elements(whole.elements(), x.element_type());
  });
  JAXCOMM_MPI_CHECK(call, MPI_Scatter, in, block.count(), block.type(), out, block.count(),
                    block.type(), static_cast<int>(root), call.comm());
  return memory.Finish();
}

ffi::Error AlltoallImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                        ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y) {
  JAXCOMM_RETURN_IF_ERROR(call.Announce(Collective::Of(x)));
  const int size = call.size();
  JAXCOMM_RETURN_IF_ERROR(CheckDivisible(call, x, size));
  JAXCOMM_RETURN_IF_ERROR(CheckOutput(call, x, *y, x.element_count(), LikeTheInput));
  LargeType block;
  JAXCOMM_RETURN_IF_ERROR(
      LargeType::Make(x.element_type(), x.element_count() / size, call.comm(), &block));
  void *in, *out;
  JAXCOMM_RETURN_IF_ERROR(memory.Buffers(x, *y, &in, &out));
  call.Log([&] { return "MPI_Alltoall " + Elements(x.element_count(), x.element_type()); });
  JAXCOMM_MPI_CHECK(call, MPI_Alltoall, in, block.count(), block.type(), out, block.count(),
                    block.type(), call.comm());
  return memory.Finish();
}

// `counts` holds every rank's rows, so every rank takes the same path.
ffi::Error AllgathervImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                          ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Span<const int64_t> counts) {
  JAXCOMM_RETURN_IF_ERROR(call.Announce(Collective::OfType(x.element_type()).Agreed(counts)));
  const WholeBuffer whole(*y, false);
  JAXCOMM_RETURN_IF_ERROR(CheckRows(call, counts, x, *y, true, whole));
  MPI_Datatype dtype;
  JAXCOMM_RETURN_IF_ERROR(MpiDatatype(x.element_type(), &dtype));
  const Blocks& blocks = Blocks::Of(0, counts, whole.row());
  void *in, *out;
  if (blocks.FitInt()) {
    JAXCOMM_RETURN_IF_ERROR(memory.Buffers(x, *y, &in, &out));
    call.Log([&] { return "MPI_Allgatherv " + Elements(x.element_count(), x.element_type()); });
    JAXCOMM_MPI_CHECK(call, MPI_Allgatherv, in, static_cast<int>(x.element_count()), dtype, out,
                      blocks.IntCounts(), blocks.IntDispls(), dtype, call.comm());
    return memory.Finish();
  }
  // Each rank broadcasts its block in turn, which needs no displacement
  // argument. Broadcast trees share the sending among ranks, where an
  // MPI_Alltoallw would have each owner send its block size - 1 times.
  // MPI_Bcast works in place: this rank's block goes to the output first.
  const int rank = call.rank();
  JAXCOMM_RETURN_IF_ERROR(memory.Output(*y, &out));
  JAXCOMM_RETURN_IF_ERROR(
      memory.Preload(*y, blocks.displs[rank] * ffi::ByteWidth(y->element_type()), x));
  JAXCOMM_RETURN_IF_ERROR(memory.Ready());
  for (size_t r = 0; r < blocks.counts.size(); ++r) {
    // Every rank knows every count, so all skip the same empty broadcasts.
    if (blocks.counts[r] == 0) continue;
    LargeType block;
    JAXCOMM_RETURN_IF_ERROR(LargeType::Make(dtype, blocks.counts[r], call.comm(), &block));
    call.Log([&] {
      return "MPI_Bcast root " + std::to_string(r) + " " +
             Elements(blocks.counts[r], x.element_type());
    });
    JAXCOMM_MPI_CHECK(call, MPI_Bcast, ElementAt(out, y->element_type(), blocks.displs[r]),
                      block.count(), block.type(), static_cast<int>(r), call.comm());
  }
  return memory.Finish();
}

ffi::Error GathervImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                       ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Span<const int64_t> counts, int64_t root) {
  JAXCOMM_RETURN_IF_ERROR(
      call.Announce(Collective::OfType(x.element_type()).Root(root).Agreed(counts)));
  const WholeBuffer whole = WholeBuffer::OfRoot(call, root, *y);
  JAXCOMM_RETURN_IF_ERROR(CheckRows(call, counts, x, *y, true, whole));
  MPI_Datatype dtype;
  JAXCOMM_RETURN_IF_ERROR(MpiDatatype(x.element_type(), &dtype));
  const Blocks& blocks = Blocks::Of(0, counts, whole.row());
  const int rank = call.rank();
  void *in, *out;
  JAXCOMM_RETURN_IF_ERROR(memory.Buffers(x, *y, &in, &out));
  if (blocks.FitInt()) {
    call.Log([&] {
      return "MPI_Gatherv root " + std::to_string(root) + " " +
             Elements(x.element_count(), x.element_type());
    });
    JAXCOMM_MPI_CHECK(call, MPI_Gatherv, in, static_cast<int>(x.element_count()), dtype, out,
                      blocks.IntCounts(), blocks.IntDispls(), dtype, static_cast<int>(root),
                      call.comm());
  } else {
    PeerBlocks send, recv;
    for (size_t p = 0; p < blocks.counts.size(); ++p) {
      const bool to_root = static_cast<int64_t>(p) == root;
      JAXCOMM_RETURN_IF_ERROR(send.Add(dtype, 0, to_root ? x.element_count() : 0, call.comm()));
      JAXCOMM_RETURN_IF_ERROR(
          recv.Add(dtype, blocks.displs[p], rank == root ? blocks.counts[p] : 0, call.comm()));
    }
    JAXCOMM_RETURN_IF_ERROR(Alltoallw(call, x, in, send, out, recv, x.element_count()));
  }
  return memory.Finish();
}

ffi::Error ScattervImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                        ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y,
                        ffi::Span<const int64_t> counts, int64_t root) {
  JAXCOMM_RETURN_IF_ERROR(
      call.Announce(Collective::OfType(x.element_type()).Root(root).Agreed(counts)));
  const WholeBuffer whole = WholeBuffer::OfRoot(call, root, x);
  JAXCOMM_RETURN_IF_ERROR(CheckRows(call, counts, x, *y, false, whole));
  MPI_Datatype dtype;
  JAXCOMM_RETURN_IF_ERROR(MpiDatatype(x.element_type(), &dtype));
  const Blocks& blocks = Blocks::Of(0, counts, whole.row());
  void *in, *out;
  JAXCOMM_RETURN_IF_ERROR(memory.Buffers(x, *y, &in, &out));
  if (blocks.FitInt()) {
    call.Log([&] {
      return "MPI_Scatterv root " + std::to_string(root) + " " +
             Elements(whole.elements(), x.element_type());
    });
    JAXCOMM_MPI_CHECK(call, MPI_Scatterv, in, blocks.IntCounts(), blocks.IntDispls(), dtype, out,
                      static_cast<int>(y->element_count()), dtype, static_cast<int>(root),
                      call.comm());
    return memory.Finish();
  }
  const int rank = call.rank();
  PeerBlocks send, recv;
  for (size_t p = 0; p < blocks.counts.size(); ++p) {
    const bool from_root = static_cast<int64_t>(p) == root;
    JAXCOMM_RETURN_IF_ERROR(
        send.Add(dtype, blocks.displs[p], rank == root ? blocks.counts[p] : 0, call.comm()));
    JAXCOMM_RETURN_IF_ERROR(recv.Add(dtype, 0, from_root ? y->element_count() : 0, call.comm()));
  }
  JAXCOMM_RETURN_IF_ERROR(Alltoallw(call, x, in, send, out, recv, whole.elements()));
  return memory.Finish();
}

// A rank only gets its own row and column of the counts matrix; `max_rows`,
// the largest count or displacement in the whole matrix, lets every rank
// take the same path.
ffi::Error AlltoallvImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                         ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Span<const int64_t> sendcounts, ffi::Span<const int64_t> recvcounts,
                         int64_t max_rows) {
  JAXCOMM_RETURN_IF_ERROR(call.Announce(
      Collective::OfType(x.element_type()).Agreed(ffi::Span<const int64_t>(&max_rows, 1))));
  JAXCOMM_RETURN_IF_ERROR(CheckExchangedRows(call, sendcounts, recvcounts, x, *y));
  const size_t row = RowElements(x.dimensions());
  MPI_Datatype dtype;
  JAXCOMM_RETURN_IF_ERROR(MpiDatatype(x.element_type(), &dtype));
  const Blocks& send_blocks = Blocks::Of(0, sendcounts, row);
  const Blocks& recv_blocks = Blocks::Of(1, recvcounts, row);
  // max_rows picks the int-count path below: it must bound every count and
  // displacement that path narrows to int.
  size_t largest = 0;
  for (const Blocks* blocks : {&send_blocks, &recv_blocks}) {
    for (size_t p = 0; p < blocks->counts.size(); ++p) {
      largest = std::max({largest, blocks->counts[p], blocks->displs[p]});
    }
  }
  if (max_rows < 0 || static_cast<size_t>(max_rows) * row < largest) {
    return call.Invalid("max_rows is " + std::to_string(max_rows) + ", expected at least " +
                        std::to_string(row == 0 ? 0 : largest / row) +
                        " (the largest count or displacement, in rows)");
  }
  void *in, *out;
  JAXCOMM_RETURN_IF_ERROR(memory.Buffers(x, *y, &in, &out));
  if (static_cast<size_t>(max_rows) * row <= MaxCount()) {
    call.Log([&] { return "MPI_Alltoallv " + Elements(x.element_count(), x.element_type()); });
    JAXCOMM_MPI_CHECK(call, MPI_Alltoallv, in, send_blocks.IntCounts(), send_blocks.IntDispls(),
                      dtype, out, recv_blocks.IntCounts(), recv_blocks.IntDispls(), dtype,
                      call.comm());
    return memory.Finish();
  }
  PeerBlocks send, recv;
  for (size_t p = 0; p < sendcounts.size(); ++p) {
    JAXCOMM_RETURN_IF_ERROR(
        send.Add(dtype, send_blocks.displs[p], send_blocks.counts[p], call.comm()));
    JAXCOMM_RETURN_IF_ERROR(
        recv.Add(dtype, recv_blocks.displs[p], recv_blocks.counts[p], call.comm()));
  }
  JAXCOMM_RETURN_IF_ERROR(Alltoallw(call, x, in, send, out, recv, x.element_count()));
  return memory.Finish();
}

// Exchanges whose counts are operands ------------------------------------------
//
// Each rank knows one side of every block it exchanges: the "local" side, rows
// [input_offsets[p], + send_sizes[p]) of one of its buffers, and learns the
// other, "learned", side from peer p: where in its other buffer p's block
// lies (p's output_offsets[rank], or packed in rank order) and its rows (p's
// send_sizes[rank]). Forward, the local side is sent from the operand and the
// learned side received into the output (ragged_all_to_all, alltoallv);
// reversed, as their transposes, the learned side is sent from the operand
// and the local side received into the output.
//
// One MPI_Alltoall of a header per peer comes first: the offset and rows the
// peer learns, the rows this rank expects from it (recv_sizes) and flags. No
// rank can leave the others waiting:
// - Arguments a rank can check alone (negative or overrunning offsets and
//   sizes, overlapping blocks it writes) set the invalid flag in every header
//   it sends, with zero rows; every rank then sees the flag and returns an
//   error before any data moves.
// - What only a receiver sees (a learned block that overruns its buffer or
//   the capacity, a peer's rows that differ from recv_sizes) fails that rank
//   after the exchange, which it makes with exactly the rows its peers
//   announced, through scratch memory instead of its buffers.
// - The large-count flag makes every rank use MPI_Alltoallw when one needs it.
namespace {

enum Header : int { kOffset, kRows, kExpect, kFlags, kHeaderWords };
constexpr int64_t kFlagInvalid = 1;
constexpr int64_t kFlagLarge = 2;
constexpr int64_t kUnknown = -1;

// Why the buffers cannot make this exchange, or "" (the same on every rank
// that passes the shapes the Python layer checks).
std::string ShapeError(const Call& call, const Exchange& e, const ffi::AnyBuffer& y,
                       const ffi::AnyBuffer& info) {
  const auto dims = [](const ffi::AnyBuffer& b) {
    std::vector<int64_t> d(b.dimensions().begin(), b.dimensions().end());
    return d;
  };
  std::vector<int64_t> op = dims(e.operand), out = dims(e.output);
  if (op.empty() || out.empty()) return "operand and output need a leading axis";
  if (e.operand.element_type() != e.output.element_type()) {
    return std::string("output is ") + DtypeName(e.output.element_type()) +
           ", expected the operand's " + DtypeName(e.operand.element_type());
  }
  if (!std::equal(op.begin() + 1, op.end(), out.begin() + 1, out.end())) {
    return "operand and output rows differ in shape";
  }
  if (y.size_bytes() != e.output.size_bytes()) return "the result is not shaped like the output";
  const ffi::DataType index_type = e.indices.element_type();
  if (index_type != ffi::DataType::S32 && index_type != ffi::DataType::S64) {
    return std::string("index arrays are ") + DtypeName(index_type) + ", expected int32 or int64";
  }
  if (e.indices.element_count() != 4 * static_cast<size_t>(call.size())) {
    return "the index arrays have " + std::to_string(e.indices.element_count()) +
           " entries, expected four per rank (" + std::to_string(call.size()) + ")";
  }
  if (info.element_type() != index_type ||
      info.element_count() != 2 * static_cast<size_t>(call.size())) {
    return "the learned counts are not [2, size] of the index type";
  }
  return "";
}

std::string Entry(const char* name, size_t p, int64_t value) {
  return std::string(name) + "[" + std::to_string(p) + "] = " + std::to_string(value);
}

// Why the ranges [offsets[p], + rows[p]) overlap, or "" (empty ones never do).
std::string Overlap(const std::vector<int64_t>& offsets, const std::vector<int64_t>& rows,
                    const char* what) {
  thread_local std::vector<std::pair<int64_t, size_t>> starts;
  starts.clear();
  for (size_t p = 0; p < offsets.size(); ++p) {
    if (rows[p] > 0) starts.emplace_back(offsets[p], p);
  }
  std::sort(starts.begin(), starts.end());
  for (size_t i = 1; i < starts.size(); ++i) {
    const size_t before = starts[i - 1].second, p = starts[i].second;
    if (offsets[before] + rows[before] > offsets[p]) {
      return std::string(what) + " of peers " + std::to_string(before) + " and " +
             std::to_string(p) + " overlap (rows " + std::to_string(offsets[before]) + "+" +
             std::to_string(rows[before]) + " and " + std::to_string(offsets[p]) + "+" +
             std::to_string(rows[p]) + ")";
    }
  }
  return "";
}

// The checks of this rank's own index arrays, which need no peer.
std::string LocalError(const Exchange& e, const std::vector<int64_t>* index, size_t local_rows,
                       size_t learned_rows) {
  const std::vector<int64_t>& input_offsets = index[0];
  const std::vector<int64_t>& send_sizes = index[1];
  const std::vector<int64_t>& output_offsets = index[2];
  const std::vector<int64_t>& recv_sizes = index[3];
  const char* local = e.reverse ? "output" : "operand";
  const char* learned = e.reverse ? "operand" : "output";
  int64_t expected = 0;
  for (size_t p = 0; p < input_offsets.size(); ++p) {
    if (input_offsets[p] < 0) return Entry("input_offsets", p, input_offsets[p]) + " is negative";
    if (send_sizes[p] < 0) return Entry("send_sizes", p, send_sizes[p]) + " is negative";
    if (input_offsets[p] > static_cast<int64_t>(local_rows) - send_sizes[p]) {
      return Entry("input_offsets", p, input_offsets[p]) + " + " +
             Entry("send_sizes", p, send_sizes[p]) + " overruns the " + local + "'s " +
             std::to_string(local_rows) + " rows";
    }
    if (!e.packed) {
      if (output_offsets[p] < 0) {
        return Entry("output_offsets", p, output_offsets[p]) + " is negative";
      }
      // Every rank's buffers have the same shape, so the block's place on
      // its peer can be checked here, before anything moves.
      if (output_offsets[p] > static_cast<int64_t>(learned_rows) - send_sizes[p]) {
        return Entry("output_offsets", p, output_offsets[p]) + " + " +
               Entry("send_sizes", p, send_sizes[p]) + " overruns the peer's " + learned + " of " +
               std::to_string(learned_rows) + " rows";
      }
    }
    if (e.check_sizes) {
      if (recv_sizes[p] < 0) return Entry("recv_sizes", p, recv_sizes[p]) + " is negative";
      expected += recv_sizes[p];
    }
  }
  if (e.packed && e.check_sizes && expected > static_cast<int64_t>(learned_rows)) {
    return "recvcounts add up to " + std::to_string(expected) + " rows, more than the " +
           std::to_string(learned_rows) + " of the capacity";
  }
  if (e.reverse) {
    // Received blocks must not overlap (MPI writes each place once); the
    // transpose of a forward exchange that sends one row to several peers
    // would have to add their cotangents.
    std::string overlap = Overlap(input_offsets, send_sizes, "the output blocks");
    if (!overlap.empty()) {
      return overlap +
             ": the transpose of an exchange that sends a row more than once "
             "is not supported";
    }
  }
  return "";
}

}  // namespace

ffi::Error RunExchange(const Call& call, Memory& memory, const Exchange& e, ffi::AnyBuffer& y,
                       ffi::AnyBuffer& info, ExchangeMover& mover) {
  const int64_t modes[3] = {e.reverse, e.packed, e.check_sizes};
  JAXCOMM_RETURN_IF_ERROR(call.Announce(
      Collective::OfType(e.operand.element_type()).Agreed(ffi::Span<const int64_t>(modes, 3))));
  const int size = call.size();
  const int rank = call.rank();
  std::string local_error = ShapeError(call, e, y, info);
  const bool shaped = local_error.empty();
  const size_t row = RowElements(e.operand.dimensions());
  const ffi::AnyBuffer& local = e.reverse ? e.output : e.operand;
  const ffi::AnyBuffer& learned = e.reverse ? e.operand : e.output;
  const size_t local_rows = shaped ? local.dimensions()[0] : 0;
  const size_t learned_rows = shaped ? learned.dimensions()[0] : 0;

  void *in = nullptr, *out = nullptr, *info_data = nullptr;
  const void* index_data = nullptr;
  if (shaped) {
    JAXCOMM_RETURN_IF_ERROR(mover.Buffers(e, y, &in, &out));
    JAXCOMM_RETURN_IF_ERROR(memory.HostInput(e.indices, &index_data));
    JAXCOMM_RETURN_IF_ERROR(memory.HostOutput(info, &info_data));
  }
  JAXCOMM_RETURN_IF_ERROR(memory.Ready());

  thread_local std::vector<int64_t> index[4];
  for (int i = 0; i < 4; ++i) {
    index[i].assign(size, 0);
    if (!shaped) continue;
    for (int p = 0; p < size; ++p) {
      index[i][p] = IndexAt(index_data, e.indices.element_type(), i * size + p);
    }
  }
  if (local_error.empty()) local_error = LocalError(e, index, local_rows, learned_rows);
  const bool valid = local_error.empty();
  const bool large = local_rows * row > MaxCount() || learned_rows * row > MaxCount();

  thread_local std::vector<int64_t> mine, theirs;
  mine.assign(static_cast<size_t>(size) * kHeaderWords, 0);
  theirs.assign(static_cast<size_t>(size) * kHeaderWords, 0);
  for (int p = 0; p < size; ++p) {
    int64_t* h = &mine[static_cast<size_t>(p) * kHeaderWords];
    h[kOffset] = valid && !e.packed ? index[2][p] : 0;
    h[kRows] = valid ? index[1][p] : 0;
    h[kExpect] = valid && e.check_sizes ? index[3][p] : kUnknown;
    h[kFlags] = (valid ? 0 : kFlagInvalid) | (large ? kFlagLarge : 0);
  }
  call.Log([&] { return "MPI_Alltoall " + Elements(mine.size(), ffi::DataType::S64); });
  JAXCOMM_MPI_CHECK(call, MPI_Alltoall, mine.data(), kHeaderWords, MPI_INT64_T, theirs.data(),
                    kHeaderWords, MPI_INT64_T, call.comm());
  int64_t flags = 0;
  int invalid_peer = -1;
  for (int p = 0; p < size; ++p) {
    const int64_t f = theirs[static_cast<size_t>(p) * kHeaderWords + kFlags];
    flags |= f;
    if ((f & kFlagInvalid) && invalid_peer < 0) invalid_peer = p;
  }
  if (!valid) return call.Invalid(local_error + "; nothing was exchanged");
  if (flags & kFlagInvalid) {
    return call.Invalid("rank " + std::to_string(invalid_peer) +
                        "'s arguments are invalid (its error says why); nothing was exchanged");
  }

  // The learned side, from the peers' headers.
  thread_local std::vector<int64_t> offsets, rows;
  offsets.assign(size, 0);
  rows.assign(size, 0);
  std::string learned_error;
  int64_t packed_offset = 0;
  for (int p = 0; p < size; ++p) {
    const int64_t* h = &theirs[static_cast<size_t>(p) * kHeaderWords];
    rows[p] = h[kRows];
    offsets[p] = e.packed ? packed_offset : h[kOffset];
    packed_offset += rows[p];
    if (!learned_error.empty()) continue;
    if (e.check_sizes && rows[p] != index[3][p]) {
      learned_error = Entry("recv_sizes", p, index[3][p]) + ", but rank " + std::to_string(p) +
                      " sends " + std::to_string(rows[p]) + " rows";
    } else if (h[kExpect] != kUnknown && h[kExpect] != index[1][p]) {
      learned_error = Entry("send_sizes", p, index[1][p]) + ", but rank " + std::to_string(p) +
                      " expects " + std::to_string(h[kExpect]) + " rows (its recv_sizes[" +
                      std::to_string(rank) + "])";
    } else if (offsets[p] < 0 || offsets[p] > static_cast<int64_t>(learned_rows) - rows[p]) {
      learned_error =
          e.packed ? "ranks 0 to " + std::to_string(p) + " send " + std::to_string(packed_offset) +
                         " rows here, more than the capacity of " + std::to_string(learned_rows)
                   : "rank " + std::to_string(p) + "'s block, " + std::to_string(rows[p]) +
                         " rows at " + std::to_string(offsets[p]) + ", overruns the " +
                         std::to_string(learned_rows) + " rows here";
    }
  }
  if (learned_error.empty() && !e.reverse) {
    learned_error = Overlap(offsets, rows, "the received blocks");
  }
  for (int p = 0; p < size; ++p) {
    SetIndex(info_data, info.element_type(), p, offsets[p]);
    SetIndex(info_data, info.element_type(), size + p, rows[p]);
  }

  // A failed learned side moves through zeroed scratch memory, packed, so
  // that the peers still get and send exactly what they announced.
  void* learned_data = e.reverse ? in : out;
  const size_t width = ffi::ByteWidth(e.operand.element_type());
  if (!learned_error.empty()) {
    learned_data = mover.Scratch(static_cast<size_t>(packed_offset) * row * width + 1);
    for (int p = 0, at = 0; p < size; at += rows[p], ++p) offsets[p] = at;
  }
  thread_local Side local_side, learned_side;
  local_side.Clear();
  learned_side.Clear();
  for (int p = 0; p < size; ++p) {
    local_side.counts.push_back(static_cast<size_t>(index[1][p]) * row);
    local_side.displs.push_back(static_cast<size_t>(index[0][p]) * row);
    learned_side.counts.push_back(static_cast<size_t>(rows[p]) * row);
    learned_side.displs.push_back(static_cast<size_t>(offsets[p]) * row);
  }
  MPI_Datatype dtype;
  JAXCOMM_RETURN_IF_ERROR(MpiDatatype(e.operand.element_type(), &dtype));
  return mover.Move(Rows{e.reverse ? learned_data : in, e.reverse ? learned_side : local_side,
                         e.reverse ? out : learned_data, e.reverse ? local_side : learned_side,
                         dtype, (flags & kFlagLarge) != 0, learned_error});
}

namespace {

// The blocking forms: the output's buffer in place where XLA gave it to the
// result, and one MPI_Alltoallv (MPI_Alltoallw past MaxCount()).
class BlockingMove final : public ExchangeMover {
 public:
  BlockingMove(const Call& call, Memory& memory, const ffi::AnyBuffer& operand)
      : call_(call), memory_(memory), operand_(operand) {}

  ffi::Error Buffers(const Exchange& e, ffi::AnyBuffer& y, void** in, void** out) override {
    JAXCOMM_RETURN_IF_ERROR(memory_.Read(e.operand, in));
    if (SameBuffer(e.output, y)) return memory_.InPlace(y, out);
    JAXCOMM_RETURN_IF_ERROR(memory_.Output(y, out));
    return memory_.Preload(y, 0, e.output);
  }

  void* Scratch(size_t bytes) override {
    thread_local std::vector<char> scratch;
    scratch.assign(bytes, 0);
    return scratch.data();
  }

  ffi::Error Move(const Rows& r) override {
    const int size = call_.size();
    if (r.large) {
      PeerBlocks send_blocks, recv_blocks;
      JAXCOMM_RETURN_IF_ERROR(RowBlocks(r, call_.comm(), send_blocks, recv_blocks));
      JAXCOMM_RETURN_IF_ERROR(Alltoallw(call_, operand_, r.send_data, send_blocks, r.recv_data,
                                        recv_blocks, operand_.element_count()));
    } else {
      thread_local std::vector<int> ints;
      r.IntArguments(ints);
      call_.Log([&] {
        size_t sent = 0;
        for (size_t c : r.send.counts) sent += c;
        return "MPI_Alltoallv " + Elements(sent, operand_.element_type());
      });
      JAXCOMM_MPI_CHECK(call_, MPI_Alltoallv, r.send_data, ints.data(), ints.data() + size, r.dtype,
                        r.recv_data, ints.data() + 2 * size, ints.data() + 3 * size, r.dtype,
                        call_.comm());
    }
    if (!r.learned_error.empty()) return call_.Invalid(r.learned_error);
    return memory_.Finish();
  }

 private:
  const Call& call_;
  Memory& memory_;
  const ffi::AnyBuffer& operand_;
};

}  // namespace

ffi::Error RaggedAllToAllImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer operand,
                              ffi::AnyBuffer output, ffi::AnyBuffer indices,
                              ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y,
                              ffi::Result<ffi::AnyBuffer> info, int64_t reverse) {
  const Exchange e{operand, output, indices, reverse != 0, false, true};
  BlockingMove mover(call, memory, operand);
  return RunExchange(call, memory, e, *y, *info, mover);
}

// The indices of alltoallv: each block's start and rows, unused offsets and
// the rows expected from each rank.
ffi::Error AlltoallvCountsImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                               ffi::AnyBuffer output, ffi::AnyBuffer indices,
                               ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y,
                               ffi::Result<ffi::AnyBuffer> info, int64_t reverse,
                               int64_t check_sizes) {
  const Exchange e{x, output, indices, reverse != 0, true, check_sizes != 0};
  BlockingMove mover(call, memory, x);
  return RunExchange(call, memory, e, *y, *info, mover);
}

}  // namespace jaxcomm
