// Neighbourhood collectives on communicators with a topology (a distributed
// graph, a graph or a Cartesian grid): MPI_Neighbor_alltoall, MPI_Neighbor_allgather,
// MPI_Neighbor_alltoallv and MPI_Neighbor_allgatherv, whose counts are operands.
//
// A rank's in- and out-degrees differ, so the buffers' leading axes do too:
// each rank checks its own. Blocks from MPI_PROC_NULL neighbours (the edges
// of a non-periodic grid) are left as MPI leaves them; the Python layer
// zeroes them.
#include "neighbor.h"

#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common.h"

namespace jaxcomm {

ffi::Error NeighborDegrees(const Call& call, int* indegree, int* outdegree) {
  int topology;
  JAXCOMM_MPI_CHECK(call, MPI_Topo_test, call.comm(), &topology);
  if (topology == MPI_DIST_GRAPH) {
    int weighted;
    JAXCOMM_MPI_CHECK(call, MPI_Dist_graph_neighbors_count, call.comm(), indegree, outdegree,
                      &weighted);
  } else if (topology == MPI_CART) {
    int ndims;
    JAXCOMM_MPI_CHECK(call, MPI_Cartdim_get, call.comm(), &ndims);
    *indegree = *outdegree = 2 * ndims;
  } else if (topology == MPI_GRAPH) {
    // MPI 4.1, 8.6: a graph's neighbours are both its sources and its
    // destinations.
    int rank;
    JAXCOMM_MPI_CHECK(call, MPI_Comm_rank, call.comm(), &rank);
    JAXCOMM_MPI_CHECK(call, MPI_Graph_neighbors_count, call.comm(), rank, indegree);
    *outdegree = *indegree;
  } else {
    return call.Invalid("the communicator has no graph or Cartesian topology");
  }
  return ffi::Error::Success();
}

namespace {

// What the library does with the blocks of a Cartesian dimension whose two
// neighbours are one process, as the communicator's attribute (0: not yet
// probed).
enum class DuplicateEdges : intptr_t { kUnknown = 0, kAsMpiDefines = 1, kListOrder = 2 };

int DuplicateEdgesKeyval() {
  static int keyval = MPI_KEYVAL_INVALID;
  static std::once_flag once;
  std::call_once(once, [] {
    MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, MPI_COMM_NULL_DELETE_FN, &keyval, nullptr);
  });
  return keyval;
}

// Sends block number s as block s to every neighbour and reads which
// number arrived in each of the blocks of the `doubled` dimensions.
ffi::Error ProbeDuplicateEdges(const Call& call, int ndims, const std::vector<int>& doubled,
                               DuplicateEdges* found) {
  const int blocks = 2 * ndims;
  std::vector<int> sent(blocks), received(blocks, -1), counts(blocks, 1);
  std::vector<MPI_Aint> displs(blocks);
  std::vector<MPI_Datatype> types(blocks, MPI_INT);
  for (int s = 0; s < blocks; ++s) {
    sent[s] = s;
    displs[s] = static_cast<MPI_Aint>(s * sizeof(int));
  }
  MPI_Request request;
  JAXCOMM_MPI_CHECK(call, MPI_Ineighbor_alltoallw, sent.data(), counts.data(), displs.data(),
                    types.data(), received.data(), counts.data(), displs.data(), types.data(),
                    call.comm(), &request);
  JAXCOMM_MPI_CHECK(call, MPI_Wait, &request, MPI_STATUS_IGNORE);
  bool defined = true, listed = true;
  for (int d : doubled) {
    defined = defined && received[2 * d] == 2 * d + 1 && received[2 * d + 1] == 2 * d;
    listed = listed && received[2 * d] == 2 * d && received[2 * d + 1] == 2 * d + 1;
  }
  if (defined == listed) {
    return call.Invalid(
        "MPI_Ineighbor_alltoallw delivered the blocks of a Cartesian dimension whose two "
        "neighbours are one process in an order that is neither MPI's nor list order");
  }
  *found = defined ? DuplicateEdges::kAsMpiDefines : DuplicateEdges::kListOrder;
  return ffi::Error::Success();
}

}  // namespace

ffi::Error NeighborReceiveOrder(const Call& call, std::vector<int>* order) {
  order->clear();
  int topology;
  JAXCOMM_MPI_CHECK(call, MPI_Topo_test, call.comm(), &topology);
  if (topology != MPI_CART) return ffi::Error::Success();
  int ndims;
  JAXCOMM_MPI_CHECK(call, MPI_Cartdim_get, call.comm(), &ndims);
  std::vector<int> dims(ndims), periods(ndims), coords(ndims), doubled;
  JAXCOMM_MPI_CHECK(call, MPI_Cart_get, call.comm(), ndims, dims.data(), periods.data(),
                    coords.data());
  for (int d = 0; d < ndims; ++d) {
    if (periods[d] && dims[d] <= 2) doubled.push_back(d);
  }
  if (doubled.empty()) return ffi::Error::Success();

  const int keyval = DuplicateEdgesKeyval();
  void* value = nullptr;
  int present = 0;
  JAXCOMM_MPI_CHECK(call, MPI_Comm_get_attr, call.comm(), keyval, &value, &present);
  auto rule = present ? static_cast<DuplicateEdges>(reinterpret_cast<intptr_t>(value))
                      : DuplicateEdges::kUnknown;
  if (rule == DuplicateEdges::kUnknown) {
    // Every rank of the communicator gets here at the same point: the
    // dimensions are the communicator's, and so is the attribute.
    JAXCOMM_RETURN_IF_ERROR(ProbeDuplicateEdges(call, ndims, doubled, &rule));
    JAXCOMM_MPI_CHECK(call, MPI_Comm_set_attr, call.comm(), keyval,
                      reinterpret_cast<void*>(static_cast<intptr_t>(rule)));
  }
  if (rule == DuplicateEdges::kAsMpiDefines) return ffi::Error::Success();
  order->resize(2 * ndims);
  for (int s = 0; s < 2 * ndims; ++s) (*order)[s] = s;
  for (int d : doubled) std::swap((*order)[2 * d], (*order)[2 * d + 1]);
  return ffi::Error::Success();
}

ffi::Error CheckBlocks(const Call& call, const char* buffer, const ffi::AnyBuffer& b, int blocks,
                       const char* degree) {
  if (b.dimensions().size() != 0 && b.dimensions()[0] == blocks) return ffi::Error::Success();
  return call.Invalid(std::string(buffer) + " needs a leading axis of one block per neighbour (" +
                      degree + " " + std::to_string(blocks) + ")");
}

void* NotNull(void* data) {
  static char nothing;
  return data != nullptr ? data : &nothing;
}

const void* NotNull(const void* data) { return NotNull(const_cast<void*>(data)); }

namespace {

// One row of `row` elements of `dtype` as one element of a datatype, so that
// counts and displacements are rows (ints for any array MPI can address).
class RowType {
 public:
  RowType() = default;
  RowType(const RowType&) = delete;
  RowType& operator=(const RowType&) = delete;
  ~RowType() {
    if (type_ != MPI_DATATYPE_NULL) MPI_Type_free(&type_);
  }

  ffi::Error Make(const Call& call, ffi::DataType dtype, size_t row) {
    LargeType span;
    JAXCOMM_RETURN_IF_ERROR(LargeType::Make(dtype, row, call.comm(), &span));
    JAXCOMM_MPI_CHECK(call, MPI_Type_contiguous, span.count(), span.type(), &type_);
    JAXCOMM_MPI_CHECK(call, MPI_Type_commit, &type_);
    return ffi::Error::Success();
  }

  MPI_Datatype type() const { return type_; }

 private:
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
};

// Why the buffers cannot make this neighbor_alltoallv, or "".
std::string CountsShapeError(const ffi::AnyBuffer& x, const ffi::AnyBuffer& output,
                             const ffi::AnyBuffer& counts, const ffi::AnyBuffer& y,
                             const ffi::AnyBuffer& received, int indegree, int outdegree) {
  if (x.dimensions().size() == 0 || output.dimensions().size() == 0) {
    return "x and the output need a leading axis of rows";
  }
  if (x.element_type() != output.element_type()) {
    return std::string("output is ") + DtypeName(output.element_type()) + ", expected x's " +
           DtypeName(x.element_type());
  }
  if (RowElements(x.dimensions()) != RowElements(output.dimensions())) {
    return "x and the output rows differ in size";
  }
  if (y.size_bytes() != output.size_bytes()) return "the result is not shaped like the output";
  const ffi::DataType type = counts.element_type();
  if (type != ffi::DataType::S32 && type != ffi::DataType::S64) {
    return std::string("counts are ") + DtypeName(type) + ", expected int32 or int64";
  }
  if (counts.element_count() != static_cast<size_t>(outdegree + indegree)) {
    return "the counts have " + std::to_string(counts.element_count()) +
           " entries, expected outdegree " + std::to_string(outdegree) + " + indegree " +
           std::to_string(indegree);
  }
  if (received.element_type() != type ||
      received.element_count() != static_cast<size_t>(indegree)) {
    return "the received counts are not [indegree] of the counts' type";
  }
  const int64_t most = std::numeric_limits<int>::max();
  if (x.dimensions()[0] > most || output.dimensions()[0] > most) {
    return "more than 2**31 - 1 rows";
  }
  return "";
}

std::string Entry(const char* name, size_t i, int64_t value) {
  return std::string(name) + "[" + std::to_string(i) + "] = " + std::to_string(value);
}

// The checks of this rank's counts, which need no neighbour. `gather`: the
// send counts are one count that every destination gets, from x's first row.
std::string CountsError(const std::vector<int64_t>& sendcounts,
                        const std::vector<int64_t>& recvcounts, bool check_sizes, int64_t rows,
                        int64_t capacity, bool gather) {
  int64_t sent = 0, expected = 0;
  for (size_t j = 0; j < sendcounts.size(); ++j) {
    if (gather) {
      if (sendcounts[j] < 0) return "sendcount = " + std::to_string(sendcounts[j]) + " is negative";
      if (sendcounts[j] != sendcounts[0]) return "the send count differs between destinations";
      if (sendcounts[j] > rows) {
        return "sendcount = " + std::to_string(sendcounts[j]) + " is more than x's " +
               std::to_string(rows) + " rows";
      }
      continue;
    }
    if (sendcounts[j] < 0) return Entry("sendcounts", j, sendcounts[j]) + " is negative";
    sent += sendcounts[j];
  }
  if (sent > rows) {
    return "sendcounts add up to " + std::to_string(sent) + " rows, more than x's " +
           std::to_string(rows);
  }
  if (!check_sizes) return "";
  for (size_t i = 0; i < recvcounts.size(); ++i) {
    if (recvcounts[i] < 0) return Entry("recvcounts", i, recvcounts[i]) + " is negative";
    expected += recvcounts[i];
  }
  if (expected > capacity) {
    return "recvcounts add up to " + std::to_string(expected) +
           " rows, more than the capacity of " + std::to_string(capacity);
  }
  return "";
}

// Blocks of up to this many bytes go by point-to-point messages, one
// MPI_Irecv and one MPI_Isend per edge and one MPI_Waitall (one MPI_Sendrecv
// where a rank has one edge each way), instead of
// MPI_Neighbor_alltoall or MPI_Neighbor_allgather: MPICH makes those a
// nonblocking schedule and waits for it, which costs about a microsecond a
// call, more than a loop of sendrecvs costs on one or two neighbours. Larger
// blocks go to MPI's own collective, but where every rank has one edge each
// way (MPI_Sendrecv, at every size). Block sizes match on every rank, so
// every rank takes the same path.
constexpr size_t kPointToPointBytes = size_t{64} << 10;

// A topology's edges as messages: a duplicate of the communicator, on which
// no other message travels, the neighbours in MPI's order, and the tag of
// each block. On a graph every tag is 0, so the k-th block to a process
// matches the k-th block it expects from this one (on an MPI_GRAPH too, whose
// adjacency jaxcomm checks is symmetric). On a Cartesian grid block
// s goes with tag s and block r is received with tag r ^ 1: a block sent
// towards the positive side of a dimension lands in the negative-side block
// of the receiver, as MPI defines, also where both neighbours of a dimension
// are one process.
struct Edges {
  MPI_Comm comm = MPI_COMM_NULL;
  std::vector<int> sources, destinations, receive_tags, send_tags;
  // Every rank of the communicator has one source and one destination.
  bool one_edge_everywhere = false;
};

// Whether the edges go as one MPI_Sendrecv: one source and one destination,
// where MPI_Sendrecv costs less than MPI_Irecv, MPI_Isend and MPI_Waitall
// (the one-neighbour exchange of a two-rank ring), and is the very call a
// loop of sendrecvs makes.
bool OneEdgeEachWay(const Edges& edges) {
  return edges.sources.size() == 1 && edges.destinations.size() == 1;
}

int DeleteEdges(MPI_Comm, int, void* value, void*) {
  auto* edges = static_cast<Edges*>(value);
  if (edges->comm != MPI_COMM_NULL) MPI_Comm_free(&edges->comm);
  delete edges;
  return MPI_SUCCESS;
}

int EdgesKeyval() {
  static int keyval = MPI_KEYVAL_INVALID;
  static std::once_flag once;
  std::call_once(
      once, [] { MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, DeleteEdges, &keyval, nullptr); });
  return keyval;
}

// The communicator's Edges, made on first use (MPI_Comm_dup: every rank of
// the communicator gets here at the same point, on the same path).
ffi::Error EdgesOf(const Call& call, const Edges** found) {
  const int keyval = EdgesKeyval();
  void* value = nullptr;
  int present = 0;
  JAXCOMM_MPI_CHECK(call, MPI_Comm_get_attr, call.comm(), keyval, &value, &present);
  if (present) {
    *found = static_cast<const Edges*>(value);
    return ffi::Error::Success();
  }
  auto edges = std::make_unique<Edges>();
  int topology;
  JAXCOMM_MPI_CHECK(call, MPI_Topo_test, call.comm(), &topology);
  if (topology == MPI_CART) {
    int ndims;
    JAXCOMM_MPI_CHECK(call, MPI_Cartdim_get, call.comm(), &ndims);
    for (int d = 0; d < ndims; ++d) {
      int negative, positive;
      JAXCOMM_MPI_CHECK(call, MPI_Cart_shift, call.comm(), d, 1, &negative, &positive);
      for (int side : {negative, positive}) {
        const int s = static_cast<int>(edges->sources.size());
        edges->sources.push_back(side);
        edges->destinations.push_back(side);
        edges->send_tags.push_back(s);
        edges->receive_tags.push_back(s ^ 1);
      }
    }
  } else if (topology == MPI_GRAPH) {
    int rank, degree;
    JAXCOMM_MPI_CHECK(call, MPI_Comm_rank, call.comm(), &rank);
    JAXCOMM_MPI_CHECK(call, MPI_Graph_neighbors_count, call.comm(), rank, &degree);
    edges->sources.resize(degree);
    JAXCOMM_MPI_CHECK(call, MPI_Graph_neighbors, call.comm(), rank, degree, edges->sources.data());
    edges->destinations = edges->sources;
    edges->receive_tags.assign(degree, 0);
    edges->send_tags.assign(degree, 0);
  } else {
    int indegree, outdegree, weighted;
    JAXCOMM_MPI_CHECK(call, MPI_Dist_graph_neighbors_count, call.comm(), &indegree, &outdegree,
                      &weighted);
    edges->sources.resize(indegree);
    edges->destinations.resize(outdegree);
    std::vector<int> in_weights(indegree + 1), out_weights(outdegree + 1);
    JAXCOMM_MPI_CHECK(call, MPI_Dist_graph_neighbors, call.comm(), indegree, edges->sources.data(),
                      in_weights.data(), outdegree, edges->destinations.data(), out_weights.data());
    edges->receive_tags.assign(indegree, 0);
    edges->send_tags.assign(outdegree, 0);
  }
  JAXCOMM_MPI_CHECK(call, MPI_Comm_dup, call.comm(), &edges->comm);
  int one = OneEdgeEachWay(*edges), everywhere = 0;
  JAXCOMM_MPI_CHECK(call, MPI_Allreduce, &one, &everywhere, 1, MPI_INT, MPI_LAND, edges->comm);
  edges->one_edge_everywhere = everywhere != 0;
  JAXCOMM_MPI_CHECK(call, MPI_Comm_set_attr, call.comm(), keyval, edges.get());
  *found = edges.release();
  return ffi::Error::Success();
}

// Block i of `out` from source i, block j of `in` (or all of `in`, for a
// stride of 0) to destination j, each `count` elements of `type` and
// `block_bytes` apart; blocks from MPI_PROC_NULL are left as they are.
ffi::Error ExchangeBlocks(const Call& call, const Edges& edges, const void* in, size_t in_stride,
                          void* out, size_t block_bytes, int count, MPI_Datatype type) {
  if (OneEdgeEachWay(edges)) {
    JAXCOMM_MPI_CHECK(call, MPI_Sendrecv, in, count, type, edges.destinations[0],
                      edges.send_tags[0], out, count, type, edges.sources[0], edges.receive_tags[0],
                      edges.comm, MPI_STATUS_IGNORE);
    return ffi::Error::Success();
  }
  thread_local std::vector<MPI_Request> requests;
  const size_t n_in = edges.sources.size(), n_out = edges.destinations.size();
  requests.assign(n_in + n_out, MPI_REQUEST_NULL);
  for (size_t i = 0; i < n_in; ++i) {
    JAXCOMM_MPI_CHECK(call, MPI_Irecv, static_cast<char*>(out) + i * block_bytes, count, type,
                      edges.sources[i], edges.receive_tags[i], edges.comm, &requests[i]);
  }
  for (size_t j = 0; j < n_out; ++j) {
    JAXCOMM_MPI_CHECK(call, MPI_Isend, static_cast<const char*>(in) + j * in_stride, count, type,
                      edges.destinations[j], edges.send_tags[j], edges.comm, &requests[n_in + j]);
  }
  JAXCOMM_MPI_CHECK(call, MPI_Waitall, static_cast<int>(requests.size()), requests.data(),
                    MPI_STATUSES_IGNORE);
  return ffi::Error::Success();
}

// One block of `count` elements of `type` (`block_bytes` long) per edge, by
// point-to-point messages where the blocks are small, else by `collective`.
template <typename Collective>
ffi::Error NeighborBlocks(const Call& call, const char* function, const void* in, size_t in_stride,
                          void* out, size_t block_bytes, int count, MPI_Datatype type,
                          size_t elements, ffi::DataType dtype, Collective collective) {
  const Edges* edges;
  JAXCOMM_RETURN_IF_ERROR(EdgesOf(call, &edges));
  if (block_bytes <= kPointToPointBytes || edges->one_edge_everywhere) {
    call.Log([&] {
      return std::string(function) + " " + Elements(elements, dtype) +
             (OneEdgeEachWay(*edges) ? ", as MPI_Sendrecv"
                                     : ", as MPI_Isend and MPI_Irecv per edge");
    });
    return ExchangeBlocks(call, *edges, in, in_stride, out, block_bytes, count, type);
  }
  call.Log([&] { return std::string(function) + " " + Elements(elements, dtype); });
  const int rc = collective();
  if (rc != MPI_SUCCESS) return MpiFailure(function, rc, call);
  return ffi::Error::Success();
}

enum Header : int { kRows, kFlags, kHeaderWords };
constexpr int64_t kFlagInvalid = 1;

}  // namespace

ffi::Error NeighborAlltoallImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                                ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y) {
  JAXCOMM_RETURN_IF_ERROR(call.Announce(Collective::OfType(x.element_type())));
  int indegree, outdegree;
  JAXCOMM_RETURN_IF_ERROR(NeighborDegrees(call, &indegree, &outdegree));
  JAXCOMM_RETURN_IF_ERROR(CheckBlocks(call, "x", x, outdegree, "outdegree"));
  const size_t block = RowElements(x.dimensions());
  JAXCOMM_RETURN_IF_ERROR(CheckOutput(call, x, *y, indegree * block, [&] {
    return "indegree " + std::to_string(indegree) + " x block " + std::to_string(block);
  }));
  LargeType type;
  JAXCOMM_RETURN_IF_ERROR(LargeType::Make(x.element_type(), block, call.comm(), &type));
  void *in, *out;
  JAXCOMM_RETURN_IF_ERROR(memory.Buffers(x, *y, &in, &out));
  const size_t block_bytes = block * ffi::ByteWidth(x.element_type());
  JAXCOMM_RETURN_IF_ERROR(NeighborBlocks(
      call, "MPI_Neighbor_alltoall", NotNull(in), block_bytes, NotNull(out), block_bytes,
      type.count(), type.type(), x.element_count(), x.element_type(), [&] {
        return MPI_Neighbor_alltoall(NotNull(in), type.count(), type.type(), NotNull(out),
                                     type.count(), type.type(), call.comm());
      }));
  return memory.Finish();
}

ffi::Error NeighborAllgatherImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                                 ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y) {
  JAXCOMM_RETURN_IF_ERROR(call.Announce(Collective::OfType(x.element_type())));
  int indegree, outdegree;
  JAXCOMM_RETURN_IF_ERROR(NeighborDegrees(call, &indegree, &outdegree));
  const size_t block = x.element_count();
  JAXCOMM_RETURN_IF_ERROR(CheckOutput(call, x, *y, indegree * block, [&] {
    return "indegree " + std::to_string(indegree) + " x input " + std::to_string(block);
  }));
  LargeType type;
  JAXCOMM_RETURN_IF_ERROR(LargeType::Make(x.element_type(), block, call.comm(), &type));
  void *in, *out;
  JAXCOMM_RETURN_IF_ERROR(memory.Buffers(x, *y, &in, &out));
  const size_t block_bytes = block * ffi::ByteWidth(x.element_type());
  JAXCOMM_RETURN_IF_ERROR(NeighborBlocks(
      call, "MPI_Neighbor_allgather", NotNull(in), 0, NotNull(out), block_bytes, type.count(),
      type.type(), block, x.element_type(), [&] {
        return MPI_Neighbor_allgather(NotNull(in), type.count(), type.type(), NotNull(out),
                                      type.count(), type.type(), call.comm());
      }));
  return memory.Finish();
}

// Rows of x in blocks of sendcounts (one per destination, in order) go to the
// destinations; the received blocks are packed in source order into the
// output, whose rows past them keep their values (the output is aliased to
// the result). One MPI_Neighbor_alltoall of a header per edge (rows, flags)
// comes first: receivers learn the counts, or check recvcounts. No rank
// leaves a neighbour waiting: every rank makes both calls with exactly the
// rows it announced (none where its own arguments are invalid), and a rank
// that cannot take what its sources announced (invalid arguments, rows that
// overflow the capacity or differ from recvcounts) receives them into
// scratch memory and fails once they have arrived. Its out-neighbours see an
// invalid rank's flag and fail too, naming it.
ffi::Error RunNeighborAlltoallv(const Call& call, Memory& memory, const ffi::AnyBuffer& x,
                                const ffi::AnyBuffer& output, const ffi::AnyBuffer& counts,
                                ffi::AnyBuffer& y, ffi::AnyBuffer& received, bool check_sizes,
                                bool reverse, NeighborMover& mover, bool gather) {
  JAXCOMM_RETURN_IF_ERROR(call.Announce(Collective::OfType(x.element_type())));
  int indegree, outdegree;
  JAXCOMM_RETURN_IF_ERROR(NeighborDegrees(call, &indegree, &outdegree));
  std::string local_error = CountsShapeError(x, output, counts, y, received, indegree, outdegree);
  const bool shaped = local_error.empty();
  const size_t row = shaped ? RowElements(x.dimensions()) : 0;
  const int64_t rows = shaped ? x.dimensions()[0] : 0;
  const int64_t capacity = shaped ? output.dimensions()[0] : 0;

  void *in = nullptr, *out = nullptr, *received_data = nullptr;
  const void* counts_data = nullptr;
  JAXCOMM_RETURN_IF_ERROR(mover.Buffers(x, output, y, shaped, &in, &out));
  if (shaped) {
    JAXCOMM_RETURN_IF_ERROR(memory.HostInput(counts, &counts_data));
    JAXCOMM_RETURN_IF_ERROR(memory.HostOutput(received, &received_data));
  }
  JAXCOMM_RETURN_IF_ERROR(memory.Ready());

  // Reversed, the counts are the forward exchange's: its recvcounts (the
  // rows to send back) come first.
  const int send_at = reverse ? indegree : 0;
  const int recv_at = reverse ? 0 : outdegree;
  thread_local std::vector<int64_t> sendcounts, recvcounts;
  sendcounts.assign(outdegree, 0);
  recvcounts.assign(indegree, 0);
  if (shaped) {
    for (int j = 0; j < outdegree; ++j) {
      sendcounts[j] = IndexAt(counts_data, counts.element_type(), send_at + j);
    }
    for (int i = 0; i < indegree; ++i) {
      recvcounts[i] = IndexAt(counts_data, counts.element_type(), recv_at + i);
    }
    local_error = CountsError(sendcounts, recvcounts, check_sizes, rows, capacity, gather);
  }
  const bool valid = local_error.empty();
  if (!valid) sendcounts.assign(outdegree, 0);

  thread_local std::vector<int64_t> mine, theirs;
  mine.assign(static_cast<size_t>(outdegree) * kHeaderWords + 1, 0);
  // Blocks from MPI_PROC_NULL stay as they are: no rows, no flags.
  theirs.assign(static_cast<size_t>(indegree) * kHeaderWords + 1, 0);
  for (int j = 0; j < outdegree; ++j) {
    mine[j * kHeaderWords + kRows] = sendcounts[j];
    mine[j * kHeaderWords + kFlags] = valid ? 0 : kFlagInvalid;
  }
  constexpr size_t kHeaderBytes = kHeaderWords * sizeof(int64_t);
  JAXCOMM_RETURN_IF_ERROR(NeighborBlocks(
      call, "MPI_Neighbor_alltoall", mine.data(), kHeaderBytes, theirs.data(), kHeaderBytes,
      kHeaderWords, MPI_INT64_T, mine.size() - 1, ffi::DataType::S64, [&] {
        return MPI_Neighbor_alltoall(mine.data(), kHeaderWords, MPI_INT64_T, theirs.data(),
                                     kHeaderWords, MPI_INT64_T, call.comm());
      }));

  // What arrives, and whether this rank can take it.
  std::string learned_error;
  int64_t total = 0;
  for (int i = 0; i < indegree; ++i) {
    const int64_t got = theirs[i * kHeaderWords + kRows];
    total += got;
    if (!learned_error.empty()) continue;
    if (theirs[i * kHeaderWords + kFlags] & kFlagInvalid) {
      learned_error =
          "the arguments of source " + std::to_string(i) + " are invalid (its error says why)";
    } else if (check_sizes && got != recvcounts[i]) {
      learned_error = Entry("recvcounts", i, recvcounts[i]) + ", but source " + std::to_string(i) +
                      " sends " + std::to_string(got) + " rows";
    } else if (total > capacity) {
      learned_error = "sources 0 to " + std::to_string(i) + " send " + std::to_string(total) +
                      " rows, more than the capacity of " + std::to_string(capacity);
    }
  }
  if (shaped) {
    for (int i = 0; i < indegree; ++i) {
      SetIndex(received_data, received.element_type(), i, theirs[i * kHeaderWords + kRows]);
    }
  }

  RowType row_type;
  JAXCOMM_RETURN_IF_ERROR(row_type.Make(call, x.element_type(), row));
  void* recv_data = out;
  const bool take = valid && learned_error.empty();
  if (!take) {
    recv_data = mover.Scratch(static_cast<size_t>(total) * row * ffi::ByteWidth(x.element_type()));
  }
  thread_local std::vector<int> ints;
  ints.assign(2 * static_cast<size_t>(outdegree + indegree) + 1, 0);
  int* scounts = ints.data();
  int* sdispls = scounts + outdegree;
  int* rcounts = sdispls + outdegree;
  int* rdispls = rcounts + indegree;
  for (int j = 0, at = 0; j < outdegree; at += gather ? 0 : scounts[j], ++j) {
    scounts[j] = static_cast<int>(sendcounts[j]);
    sdispls[j] = at;
  }
  for (int i = 0, at = 0; i < indegree; ++i) {
    rcounts[i] = static_cast<int>(theirs[i * kHeaderWords + kRows]);
    rdispls[i] = at;
    at += rcounts[i];
  }
  int64_t sent = 0;
  for (int64_t c : sendcounts) sent += c;
  const int gather_count = !gather ? -1 : outdegree > 0 ? scounts[0] : 0;
  if (gather) sent = gather_count;
  const NeighborRows moved{NotNull(in),
                           NotNull(recv_data),
                           ints.data(),
                           outdegree,
                           indegree,
                           row_type.type(),
                           row * ffi::ByteWidth(x.element_type()),
                           static_cast<size_t>(sent) * row,
                           x.element_type(),
                           gather_count};
  JAXCOMM_RETURN_IF_ERROR(mover.Move(moved));
  if (!valid) return mover.Fail(call.Invalid(local_error + "; nothing was sent"));
  if (!learned_error.empty()) return mover.Fail(call.Invalid(learned_error));
  return mover.Finish();
}

namespace {

// The blocking form: the output's buffer in place where XLA gave it to the
// result, and one MPI_Neighbor_alltoallv.
class BlockingNeighborMove final : public NeighborMover {
 public:
  BlockingNeighborMove(const Call& call, Memory& memory) : call_(call), memory_(memory) {}

  ffi::Error Buffers(const ffi::AnyBuffer& x, const ffi::AnyBuffer& output, ffi::AnyBuffer& y,
                     bool shaped, void** in, void** out) override {
    if (!shaped) return ffi::Error::Success();
    JAXCOMM_RETURN_IF_ERROR(memory_.Read(x, in));
    if (SameBuffer(output, y)) return memory_.InPlace(y, out);
    JAXCOMM_RETURN_IF_ERROR(memory_.Output(y, out));
    return memory_.Preload(y, 0, output);
  }

  void* Scratch(size_t bytes) override {
    thread_local std::vector<char> scratch;
    scratch.assign(bytes + 1, 0);
    return scratch.data();
  }

  ffi::Error Move(const NeighborRows& r) override {
    if (r.gather_count >= 0) {
      call_.Log([&] { return "MPI_Neighbor_allgatherv " + Elements(r.sent, r.dtype); });
      JAXCOMM_MPI_CHECK(call_, MPI_Neighbor_allgatherv, r.in, r.gather_count, r.row, r.out,
                        r.recv_counts(), r.recv_displs(), r.row, call_.comm());
      return ffi::Error::Success();
    }
    call_.Log([&] { return "MPI_Neighbor_alltoallv " + Elements(r.sent, r.dtype); });
    JAXCOMM_MPI_CHECK(call_, MPI_Neighbor_alltoallv, r.in, r.send_counts(), r.send_displs(), r.row,
                      r.out, r.recv_counts(), r.recv_displs(), r.row, call_.comm());
    return ffi::Error::Success();
  }

  ffi::Error Fail(ffi::Error error) override { return error; }
  ffi::Error Finish() override { return memory_.Finish(); }

 private:
  const Call& call_;
  Memory& memory_;
};

}  // namespace

ffi::Error NeighborAlltoallvImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                                 ffi::AnyBuffer output, ffi::AnyBuffer counts,
                                 ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y,
                                 ffi::Result<ffi::AnyBuffer> received, int64_t check_sizes) {
  BlockingNeighborMove mover(call, memory);
  return RunNeighborAlltoallv(call, memory, x, output, counts, *y, *received, check_sizes != 0,
                              false, mover);
}

// neighbor_alltoallv's exchange with x's first sendcount rows to every
// destination (the counts: sendcount repeated outdegree times, then the
// receive counts), as MPI_Neighbor_allgatherv.
ffi::Error NeighborAllgathervImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                                  ffi::AnyBuffer output, ffi::AnyBuffer counts,
                                  ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y,
                                  ffi::Result<ffi::AnyBuffer> received, int64_t check_sizes) {
  BlockingNeighborMove mover(call, memory);
  return RunNeighborAlltoallv(call, memory, x, output, counts, *y, *received, check_sizes != 0,
                              false, mover, true);
}

}  // namespace jaxcomm
