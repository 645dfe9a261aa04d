// Nonblocking operations: MPI_Isend, MPI_Irecv, MPI_Iallreduce, MPI_Ireduce,
// MPI_Iscan, MPI_Ibcast, MPI_Iallgather, MPI_Igather, MPI_Iscatter, MPI_Ialltoall,
// MPI_Ialltoallv, MPI_Ineighbor_alltoall, MPI_Ineighbor_allgather, the
// exchanges whose counts are operands (iragged_all_to_all, ialltoallv with
// this rank's counts: the header step of gather.cc, then MPI_Ialltoallv;
// ineighbor_alltoallv and ineighbor_allgatherv: neighbor.cc's, then
// MPI_Ineighbor_alltoallv or MPI_Ineighbor_allgatherv), and the MPI_Wait that
// completes each.
//
// A start handler makes the MPI call and writes a request handle: the bits
// of two int32 (slot, serial) in a float32[2] (a float type, so that a
// request's tangent or cotangent can be another request's handle), naming a
// slot of the process-wide request table below. The wait handler takes that
// handle together with every buffer the operation uses: the send buffer,
// which XLA therefore keeps alive and unmodified until then, and the receive
// buffer, which it returns aliased in place, so that XLA reads it only after
// the wait. The wait also checks that XLA handed it the very buffers the
// start was given: a copy made in between would mean MPI works on memory XLA
// no longer owns.
//
// MPI reaches the buffers through the platform layer's held memory
// (Memory::HoldInput, HoldOutput): on the host and on the direct GPU path the
// buffers themselves, on the staged GPU path pinned host copies that the
// request keeps, alive and pinned, until its wait copies what MPI received to
// the device and gives them back (Memory::Unhold).
//
// The table: slots in chunks allocated once and never moved, a free list of
// slot indices with room for every slot, and one mutex. A start and a wait
// take the mutex once each and allocate nothing (a new chunk is allocated
// when all slots are taken). A slot's serial changes every time it is
// taken, so a handle waited twice, or kept from an earlier run, is refused.
#include "nonblocking.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common.h"
#include "exchange.h"
#include "monitor.h"
#include "neighbor.h"
#include "reduce_ops.h"

namespace jaxcomm {
namespace {

constexpr int kChunkSlots = 256;
constexpr int kMaxChunks = 256;  // 65536 requests under way at once

enum class Kind { kSend, kReceive, kCollective };
enum class Check { kNone, kPosted, kAtWait };

struct Slot {
  bool busy = false;
  bool reported = false;
  uint32_t serial = 0;
  Kind kind = Kind::kSend;
  MPI_Request data = MPI_REQUEST_NULL;
  // A collective cut into pieces (pipelining, or more elements than one MPI
  // call counts): one request per piece, in order, instead of `data`, each
  // covering `piece_bytes` of the receive buffer (the last one the rest).
  // Their capacity stays with the slot.
  std::vector<MPI_Request> pieces;
  size_t piece_bytes = 0;
  // Checking a receive: the receive of the sender's signature, posted at
  // the start (kPosted) or made at the wait once the message told where it
  // came from (kAtWait: wildcard receives).
  Check check = Check::kNone;
  MPI_Request signature = MPI_REQUEST_NULL;
  alignas(8) unsigned char signature_bytes[kSignatureBytes];
  // What the request is, for errors, the watchdog and reports.
  const char* op = "";
  int64_t comm_handle = 0;
  MPI_Comm comm = MPI_COMM_NULL;
  int64_t peer = 0;  // dest, source or root; kNoPeer for none
  int64_t tag = 0;
  int64_t count = 0;  // elements of the operation's input
  ffi::DataType dtype = ffi::DataType::INVALID;
  int64_t site = -1;
  // MPI leaves this rank's result undefined (a non-root reduce or gather): the wait
  // gives zeros.
  bool undefined = false;
  // The buffers the start was given, which the wait must be handed again,
  // and the memory MPI uses for them until the wait.
  Held send;
  Held recv;
  // The int counts and displacements of MPI_Ialltoallv, and the counts,
  // byte displacements and types of MPI_Ineighbor_alltoallw, which MPI reads
  // until the wait. Their capacity stays with the slot, so a start reusing
  // it allocates nothing.
  std::vector<int> counts;
  std::vector<MPI_Aint> displs;
  std::vector<MPI_Datatype> types;
  // An exchange whose counts are operands: the zeroed memory a wrong learned
  // side moves through, and why it is wrong, which the wait raises once the
  // rows have moved ("" when nothing is).
  std::vector<char> scratch;
  std::string error;
};

struct Table {
  std::mutex mutex;
  std::array<std::unique_ptr<Slot[]>, kMaxChunks> chunks;
  int chunk_count = 0;
  std::vector<int32_t> free;  // reserved for every slot: push_back never allocates
};

Table& TheTable() {
  static Table* table = new Table;  // never destroyed: exit hooks read it
  return *table;
}

Slot& SlotAt(Table& table, int32_t index) {
  return table.chunks[index / kChunkSlots][index % kChunkSlots];
}

// Takes a free slot (holding the table's mutex).
ffi::Error Acquire(const char* op, int32_t* index, uint32_t* serial) {
  Table& table = TheTable();
  std::lock_guard<std::mutex> lock(table.mutex);
  if (table.free.empty()) {
    if (table.chunk_count == kMaxChunks) {
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        std::string("jaxcomm: ") + op + " on world rank " +
                            std::to_string(WorldRank()) + ": " +
                            std::to_string(kMaxChunks * kChunkSlots) +
                            " nonblocking requests are under way, none "
                            "waited: wait for some first");
    }
    const int chunk = table.chunk_count++;
    table.chunks[chunk].reset(new Slot[kChunkSlots]);
    table.free.reserve(static_cast<size_t>(table.chunk_count) * kChunkSlots);
    for (int i = kChunkSlots - 1; i >= 0; --i) {
      table.free.push_back(chunk * kChunkSlots + i);
    }
  }
  *index = table.free.back();
  table.free.pop_back();
  Slot& slot = SlotAt(table, *index);
  slot.busy = true;
  slot.reported = false;
  slot.serial += 1;
  *serial = slot.serial;
  return ffi::Error::Success();
}

void Release(int32_t index) {
  Table& table = TheTable();
  std::lock_guard<std::mutex> lock(table.mutex);
  Slot& slot = SlotAt(table, index);
  slot.busy = false;
  slot.data = MPI_REQUEST_NULL;
  slot.signature = MPI_REQUEST_NULL;
  slot.check = Check::kNone;
  table.free.push_back(index);
}

std::string PeerText(int64_t rank) {
  if (rank == MPI_ANY_SOURCE) return "any rank";
  if (rank == MPI_PROC_NULL) return "MPI.PROC_NULL";
  return "rank " + std::to_string(rank);
}

std::string Describe(const Slot& slot) {
  std::string text = slot.op;
  switch (slot.kind) {
    case Kind::kSend:
      text += " to " + PeerText(slot.peer);
      break;
    case Kind::kReceive:
      text += " from " + PeerText(slot.peer);
      break;
    case Kind::kCollective:
      if (slot.peer != kNoPeer) text += " (root " + std::to_string(slot.peer) + ")";
      break;
  }
  if (slot.kind != Kind::kCollective) {
    text += slot.tag == MPI_ANY_TAG ? " (any tag" : " (tag " + std::to_string(slot.tag);
    text += ", " + Elements(static_cast<size_t>(slot.count), slot.dtype) + ")";
  } else {
    text += " of " + Elements(static_cast<size_t>(slot.count), slot.dtype);
  }
  return text + " started at " + SiteText(slot.site);
}

ffi::Error NotUnderWay(const char* op, int32_t index, uint32_t serial) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    std::string("jaxcomm: ") + op + " on world rank " +
                        std::to_string(WorldRank()) + ": request (slot " + std::to_string(index) +
                        ", serial " + std::to_string(serial) +
                        ") is not under way: it was waited already, or comes from another "
                        "run of a compiled function");
}

// The handle's (slot, serial): the bits of two int32 in a float32[2] (only
// ever copied, never computed on), in the platform's memory.
ffi::Error ReadHandle(Memory& memory, const char* op, const ffi::AnyBuffer& handle, int32_t* index,
                      uint32_t* serial) {
  if (handle.element_type() != ffi::DataType::F32 || handle.element_count() != 2) {
    return ffi::Error::InvalidArgument(std::string("jaxcomm: ") + op +
                                       ": a request handle is 2 float32, got " +
                                       Elements(handle.element_count(), handle.element_type()));
  }
  const void* data;
  JAXCOMM_RETURN_IF_ERROR(memory.HostInput(handle, &data));
  JAXCOMM_RETURN_IF_ERROR(memory.Ready());
  int32_t fields[2];
  std::memcpy(fields, data, sizeof(fields));
  *index = fields[0];
  *serial = static_cast<uint32_t>(fields[1]);
  return ffi::Error::Success();
}

// Reaches the handle's buffer when Memory::Finish() runs.
ffi::Error WriteHandle(Memory& memory, ffi::AnyBuffer& handle, int32_t index, uint32_t serial) {
  void* data;
  JAXCOMM_RETURN_IF_ERROR(memory.HostOutput(handle, &data));
  const int32_t fields[2] = {index, static_cast<int32_t>(serial)};
  std::memcpy(data, fields, sizeof(fields));
  return ffi::Error::Success();
}

// Gives slot `index` back with the memory it still holds: a wait's, or a
// start's that failed after it took the slot.
void GiveBack(Memory& memory, int32_t index) {
  Slot& slot = SlotAt(TheTable(), index);
  // Nothing to report a failure to here: the call fails already, or
  // completed its request.
  (void)memory.Unhold(slot.send, nullptr, 0);
  (void)memory.Unhold(slot.recv, nullptr, 0);
  Release(index);
}

// A request being started, from its slot to the MPI call that starts it:
// Begin takes a slot and writes the request's handle, HoldInput and
// HoldOutput give the pointers MPI uses until the wait, request() is where
// the MPI call puts its request, and Started keeps the slot for the wait.
// A start that fails before Started gives the slot back.
class Start {
 public:
  Start(const Call& call, Memory& memory, Kind kind) : call_(call), memory_(memory), kind_(kind) {}
  Start(const Start&) = delete;
  Start& operator=(const Start&) = delete;
  ~Start() {
    if (slot_ == nullptr || started_) return;
    // Pieces MPI has started still use the held memory: the other ranks
    // start them too, so they complete.
    for (MPI_Request& piece : slot_->pieces) (void)MPI_Wait(&piece, MPI_STATUS_IGNORE);
    GiveBack(memory_, index_);
  }

  // Takes a slot for a request with `peer` (dest, source or root; kNoPeer
  // for none) and `tag` on input (or template) `x`, and writes its handle.
  ffi::Error Begin(int64_t peer, int64_t tag, const ffi::AnyBuffer& x, ffi::AnyBuffer& handle) {
    if (handle.element_type() != ffi::DataType::F32 || handle.element_count() != 2) {
      return call_.Invalid("the request handle output must be 2 float32");
    }
    uint32_t serial = 0;
    JAXCOMM_RETURN_IF_ERROR(Acquire(call_.op(), &index_, &serial));
    Slot& s = SlotAt(TheTable(), index_);
    s.kind = kind_;
    s.op = call_.op();
    s.comm_handle = call_.handle();
    s.comm = call_.comm();
    s.peer = peer;
    s.tag = tag;
    s.count = Count(x);
    s.dtype = x.element_type();
    s.site = CurrentSite();
    s.undefined = false;
    s.send = Held{};
    s.recv = Held{};
    s.counts.clear();
    s.pieces.clear();
    s.piece_bytes = 0;
    s.error.clear();
    ffi::Error written = WriteHandle(memory_, handle, index_, serial);
    if (written.failure()) {
      Release(index_);
      return written;
    }
    slot_ = &s;
    if (Tracing()) Traced(peer, tag, x, serial);
    return ffi::Error::Success();
  }

  ffi::Error HoldInput(const ffi::AnyBuffer& x, const void** data) {
    return memory_.HoldInput(x, data, &slot_->send);
  }
  ffi::Error HoldOutput(ffi::AnyBuffer& y, void** data) {
    return memory_.HoldOutput(y, data, &slot_->recv);
  }

  // An exchange's buffers: MPI reads `x` through `in` and writes `y`, which
  // starts as the output's copy, through `out`.
  ffi::Error HoldExchange(const ffi::AnyBuffer& x, const ffi::AnyBuffer& output, ffi::AnyBuffer& y,
                          void** in, void** out) {
    const void* held;
    JAXCOMM_RETURN_IF_ERROR(HoldInput(x, &held));
    *in = const_cast<void*>(held);
    JAXCOMM_RETURN_IF_ERROR(HoldOutput(y, out));
    return memory_.Preload(y, 0, output);
  }

  // `bytes` of zeroed memory the slot keeps until the wait.
  void* Scratch(size_t bytes) {
    slot_->scratch.assign(bytes + 1, 0);
    return slot_->scratch.data();
  }

  Slot& slot() { return *slot_; }
  MPI_Request* request() { return &slot_->data; }

  // A collective in pieces of `piece_bytes` of the receive buffer: the
  // request of the next piece's MPI call.
  void Pieces(size_t piece_bytes) { slot_->piece_bytes = piece_bytes; }
  MPI_Request* NextPiece() {
    slot_->pieces.push_back(MPI_REQUEST_NULL);
    return &slot_->pieces.back();
  }

  // After the MPI call that started the request.
  ffi::Error Started() {
    started_ = true;
    return memory_.Finish();
  }

 private:
  const Call& call_;
  Memory& memory_;
  Kind kind_;
  int32_t index_ = -1;
  // The recorder's span is this request's start; a point-to-point start
  // says what it moves here (a collective's announcement did).
  void Traced(int64_t peer, int64_t tag, const ffi::AnyBuffer& x, uint32_t serial) {
    TraceStart(index_, serial);
    const int64_t bytes = Count(x) * static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
    const int32_t none = kTraceNoPeer;
    if (kind_ == Kind::kSend)
      TracePointToPoint(peer == kNoPeer ? none : peer, tag, bytes, none, 0, 0);
    if (kind_ == Kind::kReceive)
      TracePointToPoint(none, 0, 0, peer == kNoPeer ? none : peer, tag, bytes);
  }

  Slot* slot_ = nullptr;
  bool started_ = false;
};

}  // namespace

std::vector<UnfinishedRequest> UnfinishedRequests() {
  Table& table = TheTable();
  std::lock_guard<std::mutex> lock(table.mutex);
  std::vector<UnfinishedRequest> out;
  for (int32_t i = 0; i < table.chunk_count * kChunkSlots; ++i) {
    const Slot& slot = SlotAt(table, i);
    if (slot.busy && !slot.reported) {
      out.push_back({i, static_cast<int64_t>(slot.serial), Describe(slot)});
    }
  }
  return out;
}

void MarkRequestReported(int64_t index, int64_t serial) {
  Table& table = TheTable();
  std::lock_guard<std::mutex> lock(table.mutex);
  if (index < 0 || index >= table.chunk_count * kChunkSlots) return;
  Slot& slot = SlotAt(table, static_cast<int32_t>(index));
  if (slot.busy && slot.serial == static_cast<uint32_t>(serial)) {
    slot.reported = true;
  }
}

// Starts ----------------------------------------------------------------------

ffi::Error IsendImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                     ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> handle, int64_t dest,
                     int64_t tag) {
  LargeType type;
  JAXCOMM_RETURN_IF_ERROR(LargeType::Make(x.element_type(), x.element_count(), call.comm(), &type));
  Start start(call, memory, Kind::kSend);
  JAXCOMM_RETURN_IF_ERROR(start.Begin(dest, tag, x, *handle));
  const void* in;
  JAXCOMM_RETURN_IF_ERROR(start.HoldInput(x, &in));
  JAXCOMM_RETURN_IF_ERROR(memory.Ready());
  if ((MonitorFlags() & kCheckCalls) && dest != MPI_PROC_NULL) {
    // Checking: the signature goes out ahead of the message, as for send,
    // but without waiting: the receive may be this rank's own, posted later.
    JAXCOMM_RETURN_IF_ERROR(
        PostSignatureSend(call.handle(), call.comm(), call.op(), x.element_type(), Count(x), dest,
                          tag, start.slot().signature_bytes, &start.slot().signature));
    start.slot().check = Check::kPosted;
  }
  call.Log([&] {
    return "MPI_Isend -> " + PeerText(dest) + " tag " + std::to_string(tag) + " " +
           Elements(x.element_count(), x.element_type());
  });
  // MPI may free the datatype now (LargeType does): the send completes
  // normally (MPI 4.1, section 5.1.10).
  JAXCOMM_MPI_CHECK(call, MPI_Isend, in, type.count(), type.type(), static_cast<int>(dest),
                    static_cast<int>(tag), call.comm(), start.request());
  return start.Started();
}

ffi::Error IrecvImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer template_buffer,
                     ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> handle,
                     ffi::Result<ffi::AnyBuffer> y, int64_t source, int64_t tag) {
  if (y->element_type() != template_buffer.element_type() ||
      y->element_count() != template_buffer.element_count()) {
    return call.Invalid("the result buffer does not match the template");
  }
  LargeType type;
  JAXCOMM_RETURN_IF_ERROR(
      LargeType::Make(y->element_type(), y->element_count(), call.comm(), &type));
  Start start(call, memory, Kind::kReceive);
  JAXCOMM_RETURN_IF_ERROR(start.Begin(source, tag, template_buffer, *handle));
  void* out;
  JAXCOMM_RETURN_IF_ERROR(start.HoldOutput(*y, &out));
  // On the direct GPU path MPI writes y itself: work XLA queued before may
  // still use that memory.
  JAXCOMM_RETURN_IF_ERROR(memory.Ready());
  const bool checked = (MonitorFlags() & kCheckCalls) && source != MPI_PROC_NULL;
  if (checked && source != MPI_ANY_SOURCE && tag != MPI_ANY_TAG) {
    // Posted now, in the order receives are posted, so that it pairs with
    // the signature of exactly the message the data receive will match.
    JAXCOMM_RETURN_IF_ERROR(PostSignatureReceive(call.handle(), call.comm(), call.op(), source, tag,
                                                 start.slot().signature_bytes,
                                                 &start.slot().signature));
    start.slot().check = Check::kPosted;
  } else if (checked) {
    start.slot().check = Check::kAtWait;
  }
  call.Log([&] {
    return "MPI_Irecv <- " + PeerText(source) + " tag " +
           (tag == MPI_ANY_TAG ? std::string("any") : std::to_string(tag)) + " " +
           Elements(y->element_count(), y->element_type());
  });
  JAXCOMM_MPI_CHECK(call, MPI_Irecv, out, type.count(), type.type(), static_cast<int>(source),
                    static_cast<int>(tag), call.comm(), start.request());
  return start.Started();
}

namespace {

// Starts a collective whose elements move independently (a reduction, a
// broadcast) in pieces of `piece` elements of `width` bytes, `count` in all:
// `begin(offset, n, request)` starts the MPI call on the n elements from
// `offset`, once MPI's memory holds the piece's input at `in` (Arrived: on a
// GPU the staging copies of the later pieces are still running). The wait
// completes the pieces in order and sends each on its way to the output as
// it completes (Memory::Deliver).
template <typename Begin>
ffi::Error StartInPieces(Start& start, Memory& memory, const void* in, size_t count, size_t width,
                         size_t piece, Begin begin) {
  start.Pieces(piece * width);
  JAXCOMM_RETURN_IF_ERROR(ForEachChunk(
      count,
      [&](size_t offset, int n) {
        JAXCOMM_RETURN_IF_ERROR(
            memory.Arrived(static_cast<const char*>(in) + offset * width, n * width));
        return begin(offset, n, start.NextPiece());
      },
      piece));
  return start.Started();
}

// The element-wise nonblocking reductions: y takes the reduction of every
// rank's x, where `reduce(in, out, count, datatype, mpi_op, request)` starts
// it (MPI_Iallreduce's arguments but the communicator). With a `root`
// (MPI_Ireduce), MPI writes only root's y; the others' waits give zeros.
// Predefined reductions take no derived datatypes: a message pipelined, or
// of more elements than one call counts, is reduced in pieces, as by the
// blocking forms.
template <typename Reduce>
ffi::Error StartReduction(const Call& call, Memory& memory, const char* function, ffi::AnyBuffer& x,
                          ffi::AnyBuffer& handle, ffi::AnyBuffer& y, int64_t op, int64_t root,
                          Reduce reduce) {
  Collective announced = Collective::Of(x).Reduction(op);
  if (root != kNoPeer) announced.Root(root);
  JAXCOMM_RETURN_IF_ERROR(call.Announce(announced));
  JAXCOMM_RETURN_IF_ERROR(CheckOutput(call, x, y, x.element_count(), LikeTheInput));
  MPI_Datatype dtype;
  MPI_Op mpi_op;
  JAXCOMM_RETURN_IF_ERROR(MpiDatatype(x.element_type(), &dtype));
  JAXCOMM_RETURN_IF_ERROR(MpiReduceOp(op, x.element_type(), call.comm(), &mpi_op));
  // jaxcomm's own ops run on the host, whatever the data path.
  if (IsOwnReduceOp(op, x.element_type())) memory.RequireHost();
  const size_t count = x.element_count();
  const size_t width = ffi::ByteWidth(x.element_type());
  const size_t pipelined = PipelinedPiece(memory, count, width);
  Start start(call, memory, Kind::kCollective);
  JAXCOMM_RETURN_IF_ERROR(start.Begin(root, 0, x, handle));
  start.slot().undefined = root != kNoPeer && call.rank() != root;
  const void* in;
  void* out;
  JAXCOMM_RETURN_IF_ERROR(start.HoldInput(x, &in));
  JAXCOMM_RETURN_IF_ERROR(start.HoldOutput(y, &out));
  JAXCOMM_RETURN_IF_ERROR(memory.Ready());
  auto begin = [&](size_t offset, int n, MPI_Request* request) {
    call.Log([&] {
      const std::string rooted = root == kNoPeer ? "" : " root " + std::to_string(root);
      return std::string(function) + " op " + ReduceOpName(op) + rooted + " " +
             Elements(n, x.element_type());
    });
    const int rc = reduce(static_cast<const char*>(in) + offset * width,
                          static_cast<char*>(out) + offset * width, n, dtype, mpi_op, request);
    if (rc != MPI_SUCCESS) return MpiFailure(function, rc, call);
    return ffi::Error::Success();
  };
  const size_t piece = std::min(pipelined, MaxCount());
  if (piece < count) return StartInPieces(start, memory, in, count, width, piece, begin);
  JAXCOMM_RETURN_IF_ERROR(begin(0, static_cast<int>(count), start.request()));
  return start.Started();
}

}  // namespace

ffi::Error IallreduceImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                          ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> handle,
                          ffi::Result<ffi::AnyBuffer> y, int64_t op) {
  return StartReduction(call, memory, "MPI_Iallreduce", x, *handle, *y, op, kNoPeer,
                        [&](const void* in, void* out, int count, MPI_Datatype type, MPI_Op mpi_op,
                            MPI_Request* request) {
                          return MPI_Iallreduce(in, out, count, type, mpi_op, call.comm(), request);
                        });
}

ffi::Error IreduceImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                       ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> handle,
                       ffi::Result<ffi::AnyBuffer> y, int64_t op, int64_t root) {
  return StartReduction(call, memory, "MPI_Ireduce", x, *handle, *y, op, root,
                        [&](const void* in, void* out, int count, MPI_Datatype type, MPI_Op mpi_op,
                            MPI_Request* request) {
                          return MPI_Ireduce(in, out, count, type, mpi_op, static_cast<int>(root),
                                             call.comm(), request);
                        });
}

ffi::Error IscanImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                     ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> handle,
                     ffi::Result<ffi::AnyBuffer> y, int64_t op) {
  return StartReduction(call, memory, "MPI_Iscan", x, *handle, *y, op, kNoPeer,
                        [&](const void* in, void* out, int count, MPI_Datatype type, MPI_Op mpi_op,
                            MPI_Request* request) {
                          return MPI_Iscan(in, out, count, type, mpi_op, call.comm(), request);
                        });
}

ffi::Error IbcastImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                      ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> handle,
                      ffi::Result<ffi::AnyBuffer> y, int64_t root) {
  JAXCOMM_RETURN_IF_ERROR(call.Announce(Collective::Of(x).Root(root)));
  JAXCOMM_RETURN_IF_ERROR(CheckOutput(call, x, *y, x.element_count(), LikeTheInput));
  const size_t count = x.element_count();
  const size_t width = ffi::ByteWidth(x.element_type());
  const size_t piece = PipelinedPiece(memory, count, width);
  Start start(call, memory, Kind::kCollective);
  JAXCOMM_RETURN_IF_ERROR(start.Begin(root, 0, x, *handle));
  void* out;
  JAXCOMM_RETURN_IF_ERROR(start.HoldOutput(*y, &out));
  // MPI_Ibcast works in one buffer: the root sends from y, which starts as
  // its x (x itself is not ours to write). MPI never reads x, which the wait
  // takes only to check it is the buffer the start was given.
  start.slot().send = Held{x.untyped_data(), x.size_bytes(), nullptr};
  if (call.rank() == root) JAXCOMM_RETURN_IF_ERROR(memory.Preload(*y, 0, x));
  JAXCOMM_RETURN_IF_ERROR(memory.Ready());
  auto log = [&](size_t n) {
    call.Log([&] {
      return "MPI_Ibcast root " + std::to_string(root) + " " + Elements(n, x.element_type());
    });
  };
  if (piece < count) {
    // Pipelined: pieces of at most MaxCount() elements of the base type.
    MPI_Datatype base;
    JAXCOMM_RETURN_IF_ERROR(MpiDatatype(x.element_type(), &base));
    return StartInPieces(
        start, memory, out, count, width, piece, [&](size_t offset, int n, MPI_Request* request) {
          log(n);
          JAXCOMM_MPI_CHECK(call, MPI_Ibcast, static_cast<char*>(out) + offset * width, n, base,
                            static_cast<int>(root), call.comm(), request);
          return ffi::Error::Success();
        });
  }
  LargeType type;
  JAXCOMM_RETURN_IF_ERROR(LargeType::Make(x.element_type(), count, call.comm(), &type));
  log(count);
  JAXCOMM_MPI_CHECK(call, MPI_Ibcast, out, type.count(), type.type(), static_cast<int>(root),
                    call.comm(), start.request());
  return start.Started();
}

namespace {

// Which of a block collective's buffers hold one block per rank: y
// (kGather), x (kScatter) or both (kAlltoall); or one per neighbour: both
// (kNeighborAlltoall: x per destination, y per source) or y
// (kNeighborAllgather, per source).
enum class Blocked { kGather, kScatter, kAlltoall, kNeighborAlltoall, kNeighborAllgather };

// MPI_Iallgather, MPI_Igather, MPI_Iscatter and MPI_Ialltoall: blocks of
// equal size, one per rank, where `blocks(in, count, type, out, request)`
// starts the call (a block is `count` of `type`). With a `root` (MPI_Igather,
// MPI_Iscatter), MPI reads only root's x or writes only root's y; the waits
// of a gather's other ranks give zeros.
template <typename BlockStart>
ffi::Error StartBlocks(const Call& call, Memory& memory, const char* function, ffi::AnyBuffer& x,
                       ffi::AnyBuffer& handle, ffi::AnyBuffer& y, Blocked blocked, int64_t root,
                       BlockStart blocks) {
  const bool neighbors =
      blocked == Blocked::kNeighborAlltoall || blocked == Blocked::kNeighborAllgather;
  const bool off_root = root != kNoPeer && call.rank() != root;
  // A rank's degrees, so its counts, differ from its peers'. Off root, an
  // iscatter's x is the placeholder of root's input: it announces root's.
  Collective announced = neighbors ? Collective::OfType(x.element_type()) : Collective::Of(x);
  if (blocked == Blocked::kScatter) {
    announced =
        Collective{x.element_type(), static_cast<int64_t>(WholeBuffer(x, off_root).elements())};
  }
  if (root != kNoPeer) announced.Root(root);
  JAXCOMM_RETURN_IF_ERROR(call.Announce(announced));
  const size_t size = static_cast<size_t>(call.size());
  size_t block_count;
  int indegree = 0, outdegree = 0;
  std::vector<int> order;
  if (neighbors) JAXCOMM_RETURN_IF_ERROR(NeighborDegrees(call, &indegree, &outdegree));
  if (blocked == Blocked::kNeighborAlltoall) {
    JAXCOMM_RETURN_IF_ERROR(NeighborReceiveOrder(call, &order));
  }
  const auto per_source = [&] { return "indegree " + std::to_string(indegree) + " blocks"; };
  switch (blocked) {
    case Blocked::kNeighborAlltoall:
      JAXCOMM_RETURN_IF_ERROR(CheckBlocks(call, "x", x, outdegree, "outdegree"));
      block_count = RowElements(x.dimensions());
      JAXCOMM_RETURN_IF_ERROR(CheckOutput(call, x, y, indegree * block_count, per_source));
      break;
    case Blocked::kNeighborAllgather:
      block_count = x.element_count();
      JAXCOMM_RETURN_IF_ERROR(CheckOutput(call, x, y, indegree * block_count, per_source));
      break;
    case Blocked::kGather:
      // Off root (MPI_Igather), y is the placeholder of root's output.
      block_count = x.element_count();
      JAXCOMM_RETURN_IF_ERROR(CheckType(call, x, y));
      JAXCOMM_RETURN_IF_ERROR(
          CheckElements(call, "output", WholeBuffer(y, off_root).elements(), size * block_count,
                        [&] { return std::to_string(size) + " times the input"; }));
      break;
    case Blocked::kScatter:
      // Off root, x is the placeholder of root's input.
      block_count = y.element_count();
      JAXCOMM_RETURN_IF_ERROR(CheckOutput(call, x, y, block_count, [] { return std::string(); }));
      JAXCOMM_RETURN_IF_ERROR(
          CheckElements(call, "input", WholeBuffer(x, off_root).elements(), size * block_count,
                        [&] { return std::to_string(size) + " times the output"; }));
      break;
    case Blocked::kAlltoall:
      JAXCOMM_RETURN_IF_ERROR(CheckDivisible(call, x, size));
      block_count = x.element_count() / size;
      JAXCOMM_RETURN_IF_ERROR(CheckOutput(call, x, y, x.element_count(), LikeTheInput));
      break;
  }
  LargeType block;
  JAXCOMM_RETURN_IF_ERROR(LargeType::Make(x.element_type(), block_count, call.comm(), &block));
  Start start(call, memory, Kind::kCollective);
  JAXCOMM_RETURN_IF_ERROR(start.Begin(root, 0, x, handle));
  start.slot().undefined = blocked == Blocked::kGather && root != kNoPeer && call.rank() != root;
  const void* in;
  void* out;
  JAXCOMM_RETURN_IF_ERROR(start.HoldInput(x, &in));
  JAXCOMM_RETURN_IF_ERROR(start.HoldOutput(y, &out));
  JAXCOMM_RETURN_IF_ERROR(memory.Ready());
  call.Log([&] {
    const std::string rooted = root == kNoPeer ? "" : " root " + std::to_string(root);
    return std::string(function) + rooted + " " + Elements(x.element_count(), x.element_type());
  });
  int rc;
  if (!order.empty()) {
    // Blocks of duplicate Cartesian edges go where MPI says, whatever order
    // the library matches them in (NeighborReceiveOrder).
    Slot& slot = start.slot();
    const size_t n = order.size();
    const MPI_Aint block_bytes =
        static_cast<MPI_Aint>(block_count * ffi::ByteWidth(x.element_type()));
    slot.counts.assign(n, block.count());
    slot.types.assign(n, block.type());
    slot.displs.resize(2 * n);
    for (size_t s = 0; s < n; ++s) {
      slot.displs[s] = static_cast<MPI_Aint>(s) * block_bytes;
      slot.displs[n + s] = static_cast<MPI_Aint>(order[s]) * block_bytes;
    }
    rc = MPI_Ineighbor_alltoallw(NotNull(in), slot.counts.data(), slot.displs.data(),
                                 slot.types.data(), NotNull(out), slot.counts.data(),
                                 slot.displs.data() + n, slot.types.data(), call.comm(),
                                 start.request());
  } else {
    rc = blocks(NotNull(in), block.count(), block.type(), NotNull(out), start.request());
  }
  if (rc != MPI_SUCCESS) return MpiFailure(function, rc, call);
  return start.Started();
}

}  // namespace

ffi::Error IallgatherImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                          ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> handle,
                          ffi::Result<ffi::AnyBuffer> y) {
  return StartBlocks(
      call, memory, "MPI_Iallgather", x, *handle, *y, Blocked::kGather, kNoPeer,
      [&](const void* in, int count, MPI_Datatype type, void* out, MPI_Request* request) {
        return MPI_Iallgather(in, count, type, out, count, type, call.comm(), request);
      });
}

ffi::Error IgatherImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                       ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> handle,
                       ffi::Result<ffi::AnyBuffer> y, int64_t root) {
  return StartBlocks(
      call, memory, "MPI_Igather", x, *handle, *y, Blocked::kGather, root,
      [&](const void* in, int count, MPI_Datatype type, void* out, MPI_Request* request) {
        return MPI_Igather(in, count, type, out, count, type, static_cast<int>(root), call.comm(),
                           request);
      });
}

ffi::Error IscatterImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                        ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> handle,
                        ffi::Result<ffi::AnyBuffer> y, int64_t root) {
  return StartBlocks(
      call, memory, "MPI_Iscatter", x, *handle, *y, Blocked::kScatter, root,
      [&](const void* in, int count, MPI_Datatype type, void* out, MPI_Request* request) {
        return MPI_Iscatter(in, count, type, out, count, type, static_cast<int>(root), call.comm(),
                            request);
      });
}

ffi::Error IalltoallImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                         ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> handle,
                         ffi::Result<ffi::AnyBuffer> y) {
  return StartBlocks(
      call, memory, "MPI_Ialltoall", x, *handle, *y, Blocked::kAlltoall, kNoPeer,
      [&](const void* in, int count, MPI_Datatype type, void* out, MPI_Request* request) {
        return MPI_Ialltoall(in, count, type, out, count, type, call.comm(), request);
      });
}

namespace {

// The largest count or displacement, in rows, of one side of an all-to-all.
size_t LargestRows(ffi::Span<const int64_t> counts) {
  size_t largest = 0, offset = 0;
  for (int64_t count : counts) {
    largest = std::max({largest, static_cast<size_t>(count), offset});
    offset += static_cast<size_t>(count);
  }
  return largest;
}

// Appends the int counts of `rows`, then their displacements, to `out`,
// where a row is `per_row` counted elements.
void AppendCounts(ffi::Span<const int64_t> rows, size_t per_row, std::vector<int>* out) {
  for (int64_t count : rows) {
    out->push_back(static_cast<int>(static_cast<size_t>(count) * per_row));
  }
  size_t offset = 0;
  for (int64_t count : rows) {
    out->push_back(static_cast<int>(offset * per_row));
    offset += static_cast<size_t>(count);
  }
}

// A datatype this start makes, freed when it returns: MPI may free it while
// the request is under way (MPI 4.1, section 5.1.10).
struct OwnedType {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  OwnedType() = default;
  OwnedType(const OwnedType&) = delete;
  OwnedType& operator=(const OwnedType&) = delete;
  ~OwnedType() {
    if (type != MPI_DATATYPE_NULL) MPI_Type_free(&type);
  }
};

}  // namespace

// MPI_Ialltoallv counts elements where every count and displacement fits an
// int, and rows otherwise, as elements of a datatype of one row. Each rank
// chooses for itself: n rows of that datatype are the same sequence of
// elements as n times the row's elements, which is all MPI matches.
ffi::Error IalltoallvImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                          ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> handle,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Span<const int64_t> sendcounts,
                          ffi::Span<const int64_t> recvcounts) {
  JAXCOMM_RETURN_IF_ERROR(call.Announce(Collective::OfType(x.element_type())));
  JAXCOMM_RETURN_IF_ERROR(CheckExchangedRows(call, sendcounts, recvcounts, x, *y));
  const size_t row = RowElements(x.dimensions());
  const size_t largest = std::max(LargestRows(sendcounts), LargestRows(recvcounts));
  MPI_Datatype type;
  JAXCOMM_RETURN_IF_ERROR(MpiDatatype(x.element_type(), &type));
  OwnedType row_type;
  size_t per_row = row;
  if (largest * row > MaxCount()) {
    if (largest > MaxCount()) {
      return call.Invalid(std::to_string(largest) +
                          " rows are more than one nonblocking alltoallv can count (" +
                          std::to_string(MaxCount()) + "); use the blocking form");
    }
    LargeType span;
    JAXCOMM_RETURN_IF_ERROR(LargeType::Make(type, row, call.comm(), &span));
    JAXCOMM_MPI_CHECK(call, MPI_Type_contiguous, span.count(), span.type(), &row_type.type);
    JAXCOMM_MPI_CHECK(call, MPI_Type_commit, &row_type.type);
    type = row_type.type;
    per_row = 1;
  }
  Start start(call, memory, Kind::kCollective);
  JAXCOMM_RETURN_IF_ERROR(start.Begin(kNoPeer, 0, x, *handle));
  std::vector<int>& counts = start.slot().counts;
  AppendCounts(sendcounts, per_row, &counts);
  AppendCounts(recvcounts, per_row, &counts);
  const size_t size = sendcounts.size();
  const void* in;
  void* out;
  JAXCOMM_RETURN_IF_ERROR(start.HoldInput(x, &in));
  JAXCOMM_RETURN_IF_ERROR(start.HoldOutput(*y, &out));
  JAXCOMM_RETURN_IF_ERROR(memory.Ready());
  call.Log([&] {
    const char* unit = type == row_type.type ? "in rows " : "";
    return std::string("MPI_Ialltoallv ") + unit + Elements(x.element_count(), x.element_type());
  });
  JAXCOMM_MPI_CHECK(call, MPI_Ialltoallv, in, &counts[0], &counts[size], type, out,
                    &counts[2 * size], &counts[3 * size], type, call.comm(), start.request());
  return start.Started();
}

namespace {

// The started forms of the exchanges whose counts are operands: the request
// holds the operand and the result (which starts as the output's copy) until
// the wait, and the rows move by MPI_Ialltoallv (MPI_Ialltoallw past
// MaxCount()), whose arrays the slot keeps. A wrong learned side is raised
// by the wait.
class StartedMove final : public ExchangeMover {
 public:
  StartedMove(const Call& call, Memory& memory, ffi::AnyBuffer& handle)
      : call_(call), handle_(handle), start_(call, memory, Kind::kCollective) {}

  ffi::Error Buffers(const Exchange& e, ffi::AnyBuffer& y, void** in, void** out) override {
    JAXCOMM_RETURN_IF_ERROR(start_.Begin(kNoPeer, 0, e.operand, handle_));
    return start_.HoldExchange(e.operand, e.output, y, in, out);
  }

  void* Scratch(size_t bytes) override { return start_.Scratch(bytes); }

  ffi::Error Move(const Rows& r) override {
    Slot& slot = start_.slot();
    slot.error = r.learned_error;
    const size_t size = static_cast<size_t>(call_.size());
    std::vector<int>& ints = slot.counts;
    ints.resize(4 * size);
    int rc;
    if (r.large) {
      // Every int count is 0 or 1 and every displacement 0; the datatypes,
      // freed when this returns, carry the offsets.
      PeerBlocks send_blocks, recv_blocks;
      JAXCOMM_RETURN_IF_ERROR(RowBlocks(r, call_.comm(), send_blocks, recv_blocks));
      std::copy(send_blocks.counts(), send_blocks.counts() + size, ints.begin());
      std::copy(recv_blocks.counts(), recv_blocks.counts() + size, ints.begin() + 2 * size);
      std::fill(ints.begin() + size, ints.begin() + 2 * size, 0);
      std::fill(ints.begin() + 3 * size, ints.end(), 0);
      slot.types.assign(send_blocks.types(), send_blocks.types() + size);
      slot.types.insert(slot.types.end(), recv_blocks.types(), recv_blocks.types() + size);
      call_.Log([&] { return "MPI_Ialltoallw " + Sent(r); });
      rc = MPI_Ialltoallw(r.send_data, &ints[0], &ints[size], &slot.types[0], r.recv_data,
                          &ints[2 * size], &ints[3 * size], &slot.types[size], call_.comm(),
                          start_.request());
      if (rc != MPI_SUCCESS) return MpiFailure("MPI_Ialltoallw", rc, call_);
    } else {
      r.IntArguments(ints);
      call_.Log([&] { return "MPI_Ialltoallv " + Sent(r); });
      rc =
          MPI_Ialltoallv(NotNull(r.send_data), &ints[0], &ints[size], r.dtype, NotNull(r.recv_data),
                         &ints[2 * size], &ints[3 * size], r.dtype, call_.comm(), start_.request());
      if (rc != MPI_SUCCESS) return MpiFailure("MPI_Ialltoallv", rc, call_);
    }
    return start_.Started();
  }

 private:
  std::string Sent(const Rows& r) {
    size_t sent = 0;
    for (size_t c : r.send.counts) sent += c;
    return Elements(sent, start_.slot().dtype);
  }

  const Call& call_;
  ffi::AnyBuffer& handle_;
  Start start_;
};

}  // namespace

ffi::Error IraggedAllToAllImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer operand,
                               ffi::AnyBuffer output, ffi::AnyBuffer indices,
                               ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> handle,
                               ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> info,
                               int64_t reverse) {
  const Exchange e{operand, output, indices, reverse != 0, false, true};
  StartedMove mover(call, memory, *handle);
  return RunExchange(call, memory, e, *y, *info, mover);
}

// As AlltoallvCountsImpl (gather.cc), started.
ffi::Error IalltoallvCountsImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                                ffi::AnyBuffer output, ffi::AnyBuffer indices,
                                ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> handle,
                                ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> info,
                                int64_t reverse, int64_t check_sizes) {
  const Exchange e{x, output, indices, reverse != 0, true, check_sizes != 0};
  StartedMove mover(call, memory, *handle);
  return RunExchange(call, memory, e, *y, *info, mover);
}

namespace {

// neighbor_alltoallv started: the header exchange and the checks of the
// blocking form (neighbor.cc), then MPI_Ineighbor_alltoallv, whose arrays the
// slot keeps (MPI_Ineighbor_alltoallw, with the receive order fixed, where
// the library mismatches the blocks of duplicate Cartesian edges:
// NeighborReceiveOrder). A call that fails waits for its rows first, so that
// it fails at the start, as the blocking form does, with no request left.
class StartedNeighborMove final : public NeighborMover {
 public:
  StartedNeighborMove(const Call& call, Memory& memory, ffi::AnyBuffer& handle)
      : call_(call), handle_(handle), start_(call, memory, Kind::kCollective) {}

  ffi::Error Buffers(const ffi::AnyBuffer& x, const ffi::AnyBuffer& output, ffi::AnyBuffer& y,
                     bool shaped, void** in, void** out) override {
    JAXCOMM_RETURN_IF_ERROR(start_.Begin(kNoPeer, 0, x, handle_));
    if (!shaped) return ffi::Error::Success();
    return start_.HoldExchange(x, output, y, in, out);
  }

  void* Scratch(size_t bytes) override { return start_.Scratch(bytes); }

  ffi::Error Move(const NeighborRows& r) override {
    Slot& slot = start_.slot();
    const size_t n_out = r.outdegree, n_in = r.indegree;
    if (r.gather_count >= 0) {
      // Every block from one process holds the same rows, so the order in
      // which the library matches duplicate Cartesian edges cannot matter.
      slot.counts.assign(r.recv_counts(), r.recv_counts() + 2 * n_in);
      const int* ints = slot.counts.data();
      call_.Log([&] { return "MPI_Ineighbor_allgatherv " + Elements(r.sent, r.dtype); });
      const int rc = MPI_Ineighbor_allgatherv(r.in, r.gather_count, r.row, r.out, ints, ints + n_in,
                                              r.row, call_.comm(), start_.request());
      if (rc != MPI_SUCCESS) return MpiFailure("MPI_Ineighbor_allgatherv", rc, call_);
      return ffi::Error::Success();
    }
    std::vector<int> order;
    JAXCOMM_RETURN_IF_ERROR(NeighborReceiveOrder(call_, &order));
    call_.Log([&] { return "MPI_Ineighbor_alltoallv " + Elements(r.sent, r.dtype); });
    int rc;
    if (order.empty()) {
      slot.counts.assign(r.ints, r.ints + 2 * (n_out + n_in));
      const int* ints = slot.counts.data();
      rc = MPI_Ineighbor_alltoallv(r.in, ints, ints + n_out, r.row, r.out, ints + 2 * n_out,
                                   ints + 2 * n_out + n_in, r.row, call_.comm(), start_.request());
      if (rc != MPI_SUCCESS) return MpiFailure("MPI_Ineighbor_alltoallv", rc, call_);
      return ffi::Error::Success();
    }
    // Incoming block s lands where block order[s] belongs, with its count.
    slot.counts.resize(n_out + n_in);
    slot.displs.resize(n_out + n_in);
    slot.types.assign(n_out + n_in, r.row);
    const MPI_Aint row_bytes = static_cast<MPI_Aint>(r.row_bytes);
    for (size_t j = 0; j < n_out; ++j) {
      slot.counts[j] = r.send_counts()[j];
      slot.displs[j] = r.send_displs()[j] * row_bytes;
    }
    for (size_t s = 0; s < n_in; ++s) {
      slot.counts[n_out + s] = r.recv_counts()[order[s]];
      slot.displs[n_out + s] = r.recv_displs()[order[s]] * row_bytes;
    }
    rc = MPI_Ineighbor_alltoallw(r.in, slot.counts.data(), slot.displs.data(), slot.types.data(),
                                 r.out, slot.counts.data() + n_out, slot.displs.data() + n_out,
                                 slot.types.data() + n_out, call_.comm(), start_.request());
    if (rc != MPI_SUCCESS) return MpiFailure("MPI_Ineighbor_alltoallw", rc, call_);
    return ffi::Error::Success();
  }

  ffi::Error Fail(ffi::Error error) override {
    JAXCOMM_MPI_CHECK(call_, MPI_Wait, start_.request(), MPI_STATUS_IGNORE);
    return error;
  }

  ffi::Error Finish() override { return start_.Started(); }

 private:
  const Call& call_;
  ffi::AnyBuffer& handle_;
  Start start_;
};

}  // namespace

// As NeighborAlltoallvImpl (neighbor.cc), started; `reverse`: the counts are
// the forward exchange's, receive counts first (the transpose's).
ffi::Error IneighborAlltoallvImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                                  ffi::AnyBuffer output, ffi::AnyBuffer counts,
                                  ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> handle,
                                  ffi::Result<ffi::AnyBuffer> y,
                                  ffi::Result<ffi::AnyBuffer> received, int64_t reverse,
                                  int64_t check_sizes) {
  StartedNeighborMove mover(call, memory, *handle);
  return RunNeighborAlltoallv(call, memory, x, output, counts, *y, *received, check_sizes != 0,
                              reverse != 0, mover);
}

// As NeighborAllgathervImpl (neighbor.cc), started.
ffi::Error IneighborAllgathervImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                                   ffi::AnyBuffer output, ffi::AnyBuffer counts,
                                   ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> handle,
                                   ffi::Result<ffi::AnyBuffer> y,
                                   ffi::Result<ffi::AnyBuffer> received, int64_t check_sizes) {
  StartedNeighborMove mover(call, memory, *handle);
  return RunNeighborAlltoallv(call, memory, x, output, counts, *y, *received, check_sizes != 0,
                              false, mover, true);
}

// Waits -----------------------------------------------------------------------

namespace {

// Whether XLA handed the wait another buffer than the one `held` records
// from the start (a copy made in between).
bool MovedSince(const ffi::AnyBuffer* buffer, const Held& held) {
  return buffer != nullptr && buffer->size_bytes() > 0 && buffer->untyped_data() != held.buffer;
}

ffi::Error Moved(const Slot& slot, const char* which) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("jaxcomm: wait on world rank ") + std::to_string(WorldRank()) +
                        ": the " + which + " buffer of " + Describe(slot) +
                        " is not the one the start was given (XLA copied it in "
                        "between); please report this as a jaxcomm bug");
}

// Completes the request behind `handle`: waits for it, checks that `send`
// and `recv` (null: none) are the buffers the start was given, checks a
// receive's message against its signature, and gives `out` (null: none) what
// MPI received, zeros where no message filled it.
ffi::Error Complete(const Call& call, Memory& memory, const ffi::AnyBuffer& handle,
                    const ffi::AnyBuffer* send, ffi::AnyBuffer* recv, ffi::AnyBuffer* out) {
  const char* op = call.op();
  int32_t index = 0;
  uint32_t serial = 0;
  JAXCOMM_RETURN_IF_ERROR(ReadHandle(memory, op, handle, &index, &serial));
  Table& table = TheTable();
  {
    std::lock_guard<std::mutex> lock(table.mutex);
    if (index < 0 || index >= table.chunk_count * kChunkSlots || !SlotAt(table, index).busy ||
        SlotAt(table, index).serial != serial) {
      return NotUnderWay(op, index, serial);
    }
  }
  Slot& slot = SlotAt(table, index);
  if (Tracing()) TraceWait(index, serial, slot.comm_handle, slot.op);
  // However the wait ends, the request is over.
  struct Done {
    Memory& memory;
    int32_t index;
    ~Done() { GiveBack(memory, index); }
  } done{memory, index};
  if (Watching()) {
    Watch("wait for " + Describe(slot) + ", at " + SiteText(CurrentSite()) + " on world rank " +
          std::to_string(WorldRank()));
  }
  MPI_Comm comm = slot.comm;
  MPI_Status status;
  // The wait's own call has no communicator: the request's names the rank.
  if (DebugEnabled()) DebugLog(comm, "MPI_Wait " + Describe(slot));
  const bool send_moved = MovedSince(send, slot.send);
  const bool recv_moved = MovedSince(recv, slot.recv);
  int rc = MPI_SUCCESS;
  ffi::Error delivered = ffi::Error::Success();
  if (slot.pieces.empty()) {
    rc = MPI_Wait(&slot.data, &status);
  } else {
    // Each piece goes on its way to the output as it completes, while MPI
    // finishes the next ones; only where the output is MPI's and whole.
    bool deliver =
        out != nullptr && !slot.undefined && slot.error.empty() && !send_moved && !recv_moved;
    for (size_t i = 0; i < slot.pieces.size(); ++i) {
      const int piece_rc = MPI_Wait(&slot.pieces[i], MPI_STATUS_IGNORE);
      if (piece_rc != MPI_SUCCESS && rc == MPI_SUCCESS) rc = piece_rc;
      if (!deliver || rc != MPI_SUCCESS) continue;
      delivered = memory.Deliver(slot.recv, *out, (i + 1) * slot.piece_bytes);
      deliver = delivered.success();
    }
  }
  if (slot.kind == Kind::kReceive && slot.check != Check::kNone) {
    // Checking: a message that does not fit is named as a mismatch, also
    // when MPI refused it (truncation).
    bool signed_message = false;
    if (slot.check == Check::kPosted) {
      JAXCOMM_MPI_CHECK(comm, MPI_Wait, &slot.signature, MPI_STATUS_IGNORE);
      signed_message = true;
    } else if (status.MPI_SOURCE != MPI_PROC_NULL) {
      JAXCOMM_RETURN_IF_ERROR(ReceiveSignatureNow(slot.comm_handle, comm, op, status.MPI_SOURCE,
                                                  status.MPI_TAG, slot.signature_bytes));
      signed_message = true;
    }
    if (signed_message) {
      JAXCOMM_RETURN_IF_ERROR(CheckSignature(comm, slot.signature_bytes, status.MPI_SOURCE, "irecv",
                                             slot.dtype, slot.count, slot.site));
    }
  }
  if (slot.kind == Kind::kSend && slot.check == Check::kPosted) {
    JAXCOMM_MPI_CHECK(comm, MPI_Wait, &slot.signature, MPI_STATUS_IGNORE);
  }
  if (rc != MPI_SUCCESS) return MpiFailure("MPI_Wait", rc, comm);
  JAXCOMM_RETURN_IF_ERROR(delivered);
  if (!slot.error.empty()) return Invalid(slot.op, comm, slot.error);
  if (send_moved) return Moved(slot, "send");
  if (recv_moved) return Moved(slot, "receive");
  size_t filled = slot.undefined ? 0 : slot.recv.bytes;
  if (slot.kind == Kind::kReceive) {
    MPI_Datatype base;
    JAXCOMM_RETURN_IF_ERROR(MpiDatatype(slot.dtype, &base));
    // The receive used `base` unless the message was too large for one
    // count; then a derived type of `base` elements (freed by now), which MPI
    // counts in `base` elements all the same.
    MPI_Count received = 0;
    JAXCOMM_MPI_CHECK(comm, MPI_Get_elements_x, &status, base, &received);
    if (received == MPI_UNDEFINED || received < 0 || received > slot.count) {
      return Invalid("irecv", comm,
                     "received a message that is not a whole number of " +
                         std::string(DtypeName(slot.dtype)) + " elements");
    }
    filled = static_cast<size_t>(received) * ffi::ByteWidth(slot.dtype);
  }
  JAXCOMM_RETURN_IF_ERROR(memory.Unhold(slot.recv, out, filled));
  JAXCOMM_RETURN_IF_ERROR(memory.Unhold(slot.send, nullptr, 0));
  return memory.Finish();
}

}  // namespace

ffi::Error WaitSendImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer handle,
                        ffi::AnyBuffer x, ffi::Result<ffi::Token>) {
  return Complete(call, memory, handle, &x, nullptr, nullptr);
}

// The result is the receive buffer in place (the lowering aliases them);
// without the alias, MPI's data is moved to the result.
ffi::Error WaitRecvImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer handle,
                        ffi::AnyBuffer y, ffi::Result<ffi::Token>,
                        ffi::Result<ffi::AnyBuffer> y_out) {
  return Complete(call, memory, handle, nullptr, &y, &*y_out);
}

ffi::Error WaitExchangeImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer handle,
                            ffi::AnyBuffer x, ffi::AnyBuffer y, ffi::Result<ffi::Token>,
                            ffi::Result<ffi::AnyBuffer> y_out) {
  return Complete(call, memory, handle, &x, &y, &*y_out);
}

// The index arrays only ride along: the derivative rules read them here.
ffi::Error WaitRaggedImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer handle,
                          ffi::AnyBuffer x, ffi::AnyBuffer, ffi::AnyBuffer y,
                          ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y_out) {
  return Complete(call, memory, handle, &x, &y, &*y_out);
}

// JaxComm.during: no MPI call. The arrays are only operands, so XLA computes
// them before this call; the int32 1 it writes is a value XLA cannot know
// before it runs, so whatever is computed from it comes after.
ffi::Error FenceImpl(const Call& call, Memory& memory, ffi::Token, ffi::RemainingArgs,
                     ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> one) {
  if (one->element_type() != ffi::DataType::S32 || one->element_count() != 1) {
    return ffi::Error::InvalidArgument(std::string("jaxcomm: ") + call.op() +
                                       ": the output must be one int32");
  }
  void* data;
  JAXCOMM_RETURN_IF_ERROR(memory.HostOutput(*one, &data));
  const int32_t value = 1;
  std::memcpy(data, &value, sizeof(value));
  return memory.Finish();
}

ffi::Error IneighborAlltoallImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                                 ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> handle,
                                 ffi::Result<ffi::AnyBuffer> y) {
  return StartBlocks(
      call, memory, "MPI_Ineighbor_alltoall", x, *handle, *y, Blocked::kNeighborAlltoall, kNoPeer,
      [&](const void* in, int count, MPI_Datatype type, void* out, MPI_Request* request) {
        return MPI_Ineighbor_alltoall(in, count, type, out, count, type, call.comm(), request);
      });
}

ffi::Error IneighborAllgatherImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                                  ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> handle,
                                  ffi::Result<ffi::AnyBuffer> y) {
  return StartBlocks(
      call, memory, "MPI_Ineighbor_allgather", x, *handle, *y, Blocked::kNeighborAllgather, kNoPeer,
      [&](const void* in, int count, MPI_Datatype type, void* out, MPI_Request* request) {
        return MPI_Ineighbor_allgather(in, count, type, out, count, type, call.comm(), request);
      });
}

}  // namespace jaxcomm
