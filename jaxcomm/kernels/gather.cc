// Gather family: MPI_Allgather, MPI_Gather, MPI_Scatter, MPI_Alltoall and the
// variable-size MPI_Allgatherv, MPI_Gatherv, MPI_Scatterv, MPI_Alltoallv.
//
// The fixed-size ops move one rank's block as one LargeType element when it
// exceeds MaxCount(): the derived type's extent is the whole block, so MPI
// still finds block r at r block lengths. The *v ops also take int
// displacements, which no datatype widens; past MaxCount() they fall back to
// other calls (see each handler).
#include <algorithm>
#include <vector>

#include "common.h"

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
ffi::Error CheckStacked(const Call& call, const ffi::AnyBuffer& x, const ffi::AnyBuffer& y) {
  const int size = call.size();
  return CheckOutput(call, x, y, size * x.element_count(),
                     [&] { return PerRank(size, "input", x.element_count()); });
}

// The checks every *v op with one counts attribute makes: `counts` is valid,
// `whole` holds sum(counts) rows and `own` this rank's count of them.
// `whole_is_output` says which of x and y `whole` is.
ffi::Error CheckRows(const Call& call, ffi::Span<const int64_t> counts, const ffi::AnyBuffer& x,
                     const ffi::AnyBuffer& y, bool whole_is_output) {
  JAXCOMM_RETURN_IF_ERROR(CheckCounts(call, "counts", counts, call.size()));
  const ffi::AnyBuffer& whole = whole_is_output ? y : x;
  const size_t row = RowElements(whole.dimensions());
  const size_t own = static_cast<size_t>(counts[call.rank()]);
  const size_t all = Sum(counts);
  const auto all_rows = [&] { return RowsOf("sum(counts)", all, row); };
  const auto own_rows = [&] { return RowsOf("counts[rank]", own, row); };
  if (whole_is_output) {
    JAXCOMM_RETURN_IF_ERROR(CheckOutput(call, x, y, all * row, all_rows));
    return CheckElements(call, "input", x.element_count(), own * row, own_rows);
  }
  JAXCOMM_RETURN_IF_ERROR(CheckElements(call, "input", x.element_count(), all * row, all_rows));
  return CheckOutput(call, x, y, own * row, own_rows);
}

// MPI_Alltoallw arguments for blocks of any length at any offset: a non-empty
// block is one element of a derived datatype that starts at the block's
// offset, so every int count is 0 or 1 and every int displacement 0.
class PeerBlocks {
 public:
  PeerBlocks() = default;
  PeerBlocks(const PeerBlocks&) = delete;
  PeerBlocks& operator=(const PeerBlocks&) = delete;
  ~PeerBlocks() {
    for (MPI_Datatype& t : owned_) {
      if (t != MPI_DATATYPE_NULL) MPI_Type_free(&t);
    }
  }

  // Appends the next peer's block: `count` elements of `base`, starting
  // `offset` elements into the buffer.
  ffi::Error Add(MPI_Datatype base, size_t offset, size_t count, MPI_Comm comm) {
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

  const int* counts() const { return counts_.data(); }
  const int* displs() const { return displs_.data(); }
  const MPI_Datatype* types() const { return types_.data(); }

 private:
  std::vector<int> counts_, displs_;
  std::vector<MPI_Datatype> types_, owned_;
};

// The *v ops' fallback past MaxCount(): one MPI_Alltoallw, whose per-peer
// datatypes carry the offsets as MPI_Aint. It stays a collective, so unlike
// point-to-point messages (every tag belongs to the user) it can never match
// the user's own sends and receives on this communicator.
ffi::Error Alltoallw(const Call& call, const ffi::AnyBuffer& x, const void* in,
                     const PeerBlocks& send, void* out, const PeerBlocks& recv) {
  call.Log([&] { return "MPI_Alltoallw " + Elements(x.element_count(), x.element_type()); });
  JAXCOMM_MPI_CHECK(call, MPI_Alltoallw, in, send.counts(), send.displs(), send.types(), out,
                    recv.counts(), recv.displs(), recv.types(), call.comm());
  return ffi::Error::Success();
}

// The pointers MPI moves `x` and `y` through, ready for the MPI calls.
ffi::Error Buffers(Memory& memory, ffi::AnyBuffer& x, ffi::AnyBuffer& y, void** in, void** out) {
  JAXCOMM_RETURN_IF_ERROR(memory.Read(x, in));
  JAXCOMM_RETURN_IF_ERROR(memory.Output(y, out));
  return memory.Ready();
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
  JAXCOMM_RETURN_IF_ERROR(CheckStacked(call, x, *y));
  LargeType block;
  JAXCOMM_RETURN_IF_ERROR(
      LargeType::Make(x.element_type(), x.element_count(), call.comm(), &block));
  const size_t count = x.element_count();
  const size_t width = ffi::ByteWidth(x.element_type());
  const size_t piece = PieceElements(count, width);
  if (piece < count) memory.Pipeline(piece * width);
  void *in, *out;
  JAXCOMM_RETURN_IF_ERROR(Buffers(memory, x, *y, &in, &out));
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
  JAXCOMM_RETURN_IF_ERROR(CheckStacked(call, x, *y));
  LargeType block;
  JAXCOMM_RETURN_IF_ERROR(
      LargeType::Make(x.element_type(), x.element_count(), call.comm(), &block));
  void *in, *out;
  JAXCOMM_RETURN_IF_ERROR(Buffers(memory, x, *y, &in, &out));
  call.Log([&] {
    return "MPI_Gather root " + std::to_string(root) + " " +
           Elements(x.element_count(), x.element_type());
  });
  JAXCOMM_MPI_CHECK(call, MPI_Gather, in, block.count(), block.type(), out, block.count(),
                    block.type(), static_cast<int>(root), call.comm());
  if (call.rank() != root) JAXCOMM_RETURN_IF_ERROR(memory.Zero(*y));
  return memory.Finish();
}

ffi::Error ScatterImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                       ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y, int64_t root) {
  JAXCOMM_RETURN_IF_ERROR(call.Announce(Collective::Of(x).Root(root)));
  const int size = call.size();
  // The output's element type; its count is the block size.
  JAXCOMM_RETURN_IF_ERROR(
      CheckOutput(call, x, *y, y->element_count(), [] { return std::string(); }));
  JAXCOMM_RETURN_IF_ERROR(
      CheckElements(call, "input", x.element_count(), size * y->element_count(),
                    [&] { return PerRank(size, "output", y->element_count()); }));
  LargeType block;
  JAXCOMM_RETURN_IF_ERROR(
      LargeType::Make(x.element_type(), y->element_count(), call.comm(), &block));
  void *in, *out;
  JAXCOMM_RETURN_IF_ERROR(Buffers(memory, x, *y, &in, &out));
  call.Log([&] {
    return "MPI_Scatter root " + std::to_string(root) + " " +
           Elements(x.element_count(), x.element_type());
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
  JAXCOMM_RETURN_IF_ERROR(Buffers(memory, x, *y, &in, &out));
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
  JAXCOMM_RETURN_IF_ERROR(CheckRows(call, counts, x, *y, true));
  MPI_Datatype dtype;
  JAXCOMM_RETURN_IF_ERROR(MpiDatatype(x.element_type(), &dtype));
  const Blocks& blocks = Blocks::Of(0, counts, RowElements(y->dimensions()));
  void *in, *out;
  if (blocks.FitInt()) {
    JAXCOMM_RETURN_IF_ERROR(Buffers(memory, x, *y, &in, &out));
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
  JAXCOMM_RETURN_IF_ERROR(CheckRows(call, counts, x, *y, true));
  MPI_Datatype dtype;
  JAXCOMM_RETURN_IF_ERROR(MpiDatatype(x.element_type(), &dtype));
  const Blocks& blocks = Blocks::Of(0, counts, RowElements(y->dimensions()));
  const int rank = call.rank();
  void *in, *out;
  JAXCOMM_RETURN_IF_ERROR(Buffers(memory, x, *y, &in, &out));
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
    JAXCOMM_RETURN_IF_ERROR(Alltoallw(call, x, in, send, out, recv));
  }
  if (rank != root) JAXCOMM_RETURN_IF_ERROR(memory.Zero(*y));
  return memory.Finish();
}

ffi::Error ScattervImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                        ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y,
                        ffi::Span<const int64_t> counts, int64_t root) {
  JAXCOMM_RETURN_IF_ERROR(
      call.Announce(Collective::OfType(x.element_type()).Root(root).Agreed(counts)));
  JAXCOMM_RETURN_IF_ERROR(CheckRows(call, counts, x, *y, false));
  MPI_Datatype dtype;
  JAXCOMM_RETURN_IF_ERROR(MpiDatatype(x.element_type(), &dtype));
  const Blocks& blocks = Blocks::Of(0, counts, RowElements(x.dimensions()));
  void *in, *out;
  JAXCOMM_RETURN_IF_ERROR(Buffers(memory, x, *y, &in, &out));
  if (blocks.FitInt()) {
    call.Log([&] {
      return "MPI_Scatterv root " + std::to_string(root) + " " +
             Elements(x.element_count(), x.element_type());
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
  JAXCOMM_RETURN_IF_ERROR(Alltoallw(call, x, in, send, out, recv));
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
  JAXCOMM_RETURN_IF_ERROR(Buffers(memory, x, *y, &in, &out));
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
  JAXCOMM_RETURN_IF_ERROR(Alltoallw(call, x, in, send, out, recv));
  return memory.Finish();
}

}  // namespace jaxcomm
