// Shared pieces of the jaxcomm XLA FFI handlers: datatype and reduction-op
// tables, the MPI error check, checked count narrowing and debug logging.
#ifndef JAXCOMM_KERNELS_COMMON_H_
#define JAXCOMM_KERNELS_COMMON_H_

#include <mpi.h>

#include <climits>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

// Propagates a failed ffi::Error.
#define JAXCOMM_RETURN_IF_ERROR(expr)        \
  do {                                       \
    ::xla::ffi::Error jaxcomm_err_ = (expr); \
    if (jaxcomm_err_.failure()) {            \
      return jaxcomm_err_;                   \
    }                                        \
  } while (0)

namespace jaxcomm {

namespace ffi = xla::ffi;

// Reduction codes shared with jaxcomm/ops/_base.py (REDUCTION_OPS).
enum class ReduceOp : int64_t {
  kSum = 0,
  kProd = 1,
  kMin = 2,
  kMax = 3,
  kLand = 4,
  kLor = 5,
  kLxor = 6,
  kBand = 7,
  kBor = 8,
  kBxor = 9,
};

// Element type name as NumPy spells it, for logs and error messages.
const char* DtypeName(ffi::DataType dtype);

// MPI datatype that moves one element of `dtype`. Half-precision types move
// as 16-bit words; their reductions go through HalfReduceOp.
ffi::Error MpiDatatype(ffi::DataType dtype, MPI_Datatype* out);

// MPI_Op for a reduction code and element type: a predefined op, or one of
// jaxcomm's own (created on first use, hence `comm` for errors): every
// float16/bfloat16 reduction, and MIN and MAX of every floating type, which
// propagate NaN like jnp.minimum/jnp.maximum on every rank alike.
ffi::Error MpiReduceOp(int64_t code, ffi::DataType dtype, MPI_Comm comm, MPI_Op* out);

const char* ReduceOpName(int64_t code);

// Whether MpiReduceOp gives one of jaxcomm's own ops, whose functions run on
// the host: the buffers of such a reduction must be in host memory.
bool IsOwnReduceOp(int64_t code, ffi::DataType dtype);

// What a nonblocking request keeps of one of its buffers from its start to
// its wait: the buffer XLA gave the start and, where MPI does not use that
// buffer itself, the platform's staging memory that MPI uses instead.
struct Held {
  void* buffer = nullptr;
  size_t bytes = 0;
  void* staging = nullptr;  // null: MPI uses `buffer`
};

// The platform layer: where one handler call's buffers live and how MPI
// reaches them, the only thing that differs between the CPU and the CUDA
// handlers. A handler takes the pointer MPI uses for each buffer from it,
// calls Ready() before its first MPI call (the inputs are then in place) and
// Finish() after its last (the outputs then reach XLA's buffers). On the
// host (HostMemory) every pointer is the buffer itself and both calls do
// nothing; on a GPU (cuda_memory.h) the pointers are the device buffers
// themselves (CUDA-aware MPI) or pinned host copies.
class Memory {
 public:
  virtual ~Memory() = default;

  // Routes every buffer of this call through host memory, whatever the data
  // path: for reductions with jaxcomm's own MPI ops, which run on the host.
  // Call before the first Input or Output.
  virtual void RequireHost() {}
  // The pointer MPI reads input `x` through.
  virtual ffi::Error Input(const ffi::AnyBuffer& x, const void** data) = 0;
  // The pointer MPI writes output `y` through.
  virtual ffi::Error Output(ffi::AnyBuffer& y, void** data) = 0;
  // The pointer MPI reads and writes output `y` through, for a call that
  // works in place: XLA gave `y` the input's buffer (the lowering aliases
  // them), so `y` holds the input on entry.
  virtual ffi::Error InPlace(ffi::AnyBuffer& y, void** data) = 0;
  // Host memory holding input `x` (or taking output `y`) whatever the data
  // path, for the few bytes handlers read or write themselves (envelopes).
  virtual ffi::Error HostInput(const ffi::AnyBuffer& x, const void** data) = 0;
  virtual ffi::Error HostOutput(ffi::AnyBuffer& y, void** data) = 0;
  // Output `y`, already given its pointer, starts with the bytes of input `x`
  // at byte `offset` (MPI_Bcast works in place on y).
  virtual ffi::Error Preload(ffi::AnyBuffer& y, size_t offset, const ffi::AnyBuffer& x) = 0;
  // Waits until MPI can read the inputs through their pointers.
  virtual ffi::Error Ready() = 0;
  // After the MPI calls: output `y` holds zeros from byte `offset` on.
  virtual ffi::Error ZeroFrom(ffi::AnyBuffer& y, size_t offset) = 0;
  // Moves the outputs to their buffers.
  virtual ffi::Error Finish() = 0;

  // Nonblocking starts, whose buffers MPI uses after the handler returned:
  // as Input and Output, but the pointer stays valid until Unhold (at the
  // wait), and `held` records what to give back then.
  virtual ffi::Error HoldInput(const ffi::AnyBuffer& x, const void** data, Held* held) = 0;
  virtual ffi::Error HoldOutput(ffi::AnyBuffer& y, void** data, Held* held) = 0;
  // At the wait, once MPI is done: `out` (null for an input) takes the first
  // `filled` bytes MPI wrote through the held output, and zeros after them;
  // then the held memory is given back and `held` emptied. Also for a start
  // that failed (out null).
  virtual ffi::Error Unhold(Held& held, ffi::AnyBuffer* out, size_t filled) = 0;

  // Input and Output typed for pointer arithmetic on elements.
  ffi::Error Read(const ffi::AnyBuffer& x, void** data) {
    const void* in;
    JAXCOMM_RETURN_IF_ERROR(Input(x, &in));
    *data = const_cast<void*>(in);
    return ffi::Error::Success();
  }
  ffi::Error Zero(ffi::AnyBuffer& y) { return ZeroFrom(y, 0); }
};

// Buffers in host memory: the CPU handlers'.
class HostMemory final : public Memory {
 public:
  ffi::Error Input(const ffi::AnyBuffer& x, const void** data) override;
  ffi::Error Output(ffi::AnyBuffer& y, void** data) override;
  ffi::Error InPlace(ffi::AnyBuffer& y, void** data) override;
  ffi::Error HostInput(const ffi::AnyBuffer& x, const void** data) override;
  ffi::Error HostOutput(ffi::AnyBuffer& y, void** data) override;
  ffi::Error Preload(ffi::AnyBuffer& y, size_t offset, const ffi::AnyBuffer& x) override;
  ffi::Error Ready() override { return ffi::Error::Success(); }
  ffi::Error ZeroFrom(ffi::AnyBuffer& y, size_t offset) override;
  ffi::Error Finish() override { return ffi::Error::Success(); }
  ffi::Error HoldInput(const ffi::AnyBuffer& x, const void** data, Held* held) override;
  ffi::Error HoldOutput(ffi::AnyBuffer& y, void** data, Held* held) override;
  ffi::Error Unhold(Held& held, ffi::AnyBuffer* out, size_t filled) override;
};

// The buffer parts of the handlers' FFI bindings, named in ops.def, each
// continuing `binding` (which may already hold the platform's context), and
// the parameters they give the handler body, which follow its Memory&.
// Token in and out: ops that only synchronise.
template <typename Binding>
auto TokenBuffers(Binding&& binding) {
  return std::forward<Binding>(binding).template Arg<ffi::Token>().template Ret<ffi::Token>();
}
#define JAXCOMM_Token_PARAMS ffi::Token, ffi::Result<ffi::Token>

// The token and one array in, the token out.
template <typename Binding>
auto SinkBuffers(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::Token>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::Token>();
}
#define JAXCOMM_Sink_PARAMS ffi::Token, ffi::AnyBuffer, ffi::Result<ffi::Token>

// The token and one array in, the token and one array out.
template <typename Binding>
auto ArrayBuffers(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::Token>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::Token>()
      .template Ret<ffi::AnyBuffer>();
}
#define JAXCOMM_Array_PARAMS \
  ffi::Token, ffi::AnyBuffer, ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer>

// The token and one array in, the token, one array and a receive's envelope
// ([source, tag, count]) out.
template <typename Binding>
auto ReceiveBuffers(Binding&& binding) {
  return ArrayBuffers(std::forward<Binding>(binding)).template Ret<ffi::AnyBuffer>();
}
#define JAXCOMM_Receive_PARAMS JAXCOMM_Array_PARAMS, ffi::Result<ffi::AnyBuffer>

// As ReceiveBuffers, with a second array in: the envelope of an earlier
// receive that addresses this one.
template <typename Binding>
auto AddressedBuffers(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::Token>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::Token>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>();
}
#define JAXCOMM_Addressed_PARAMS                                       \
  ffi::Token, ffi::AnyBuffer, ffi::AnyBuffer, ffi::Result<ffi::Token>, \
      ffi::Result<ffi::AnyBuffer>, ffi::Result<ffi::AnyBuffer>

// Nonblocking starts (nonblocking.cc): the token and one array in, the
// token and the request handle (two int32: slot and serial) out.
template <typename Binding>
auto StartBuffers(Binding&& binding) {
  return SinkBuffers(std::forward<Binding>(binding)).template Ret<ffi::AnyBuffer>();
}
#define JAXCOMM_Start_PARAMS JAXCOMM_Sink_PARAMS, ffi::Result<ffi::AnyBuffer>

// As StartBuffers, with the array MPI will fill out too.
template <typename Binding>
auto StartReceiveBuffers(Binding&& binding) {
  return StartBuffers(std::forward<Binding>(binding)).template Ret<ffi::AnyBuffer>();
}
#define JAXCOMM_StartReceive_PARAMS JAXCOMM_Start_PARAMS, ffi::Result<ffi::AnyBuffer>

// Waits: the token, the handle and the buffers the operation uses in (the
// send buffer, kept alive until here; the receive buffer), the token and
// the receive buffer, aliased to the one in, out.
template <typename Binding>
auto WaitSendBuffers(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::Token>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::Token>();
}
#define JAXCOMM_WaitSend_PARAMS ffi::Token, ffi::AnyBuffer, ffi::AnyBuffer, ffi::Result<ffi::Token>

template <typename Binding>
auto WaitReceiveBuffers(Binding&& binding) {
  return WaitSendBuffers(std::forward<Binding>(binding)).template Ret<ffi::AnyBuffer>();
}
#define JAXCOMM_WaitReceive_PARAMS JAXCOMM_WaitSend_PARAMS, ffi::Result<ffi::AnyBuffer>

template <typename Binding>
auto WaitExchangeBuffers(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::Token>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::Token>()
      .template Ret<ffi::AnyBuffer>();
}
#define JAXCOMM_WaitExchange_PARAMS                                                    \
  ffi::Token, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::Result<ffi::Token>, \
      ffi::Result<ffi::AnyBuffer>

// A fence: the token and any arrays in (only waited for), the token and an
// int32 scalar out.
template <typename Binding>
auto FenceBuffers(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::Token>()
      .RemainingArgs()
      .template Ret<ffi::Token>()
      .template Ret<ffi::AnyBuffer>();
}
#define JAXCOMM_Fence_PARAMS \
  ffi::Token, ffi::RemainingArgs, ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer>

// Each op's complete binding, from its row of ops.def:
// bindings::<Name>(binding), and its handler body, shared by every platform:
// ffi::Error <Name>Impl(Memory&, <buffers>, <attributes>).
#define I64(name) .template Attr<int64_t>(#name)
#define I64S(name) .template Attr<ffi::Span<const int64_t>>(#name)
#define JAXCOMM_OP(name, Name, buffers, attributes)                     \
  template <typename Binding>                                           \
  auto Name(Binding&& binding) {                                        \
    return buffers##Buffers(std::forward<Binding>(binding)) attributes; \
  }
namespace bindings {
#include "ops.def"
}  // namespace bindings
#undef JAXCOMM_OP
#undef I64S
#undef I64

#define I64(name) , int64_t
#define I64S(name) , ffi::Span<const int64_t>
#define JAXCOMM_OP(name, Name, buffers, attributes) \
  ffi::Error Name##Impl(Memory&, JAXCOMM_##buffers##_PARAMS attributes);
#include "ops.def"
#undef JAXCOMM_OP
#undef I64S
#undef I64

// Makes `comm` known to the handlers and returns the value of the "comm"
// attribute that stands for it: its Fortran handle in the low 32 bits and a
// serial number above, never reused in this process, so that a compiled call
// whose communicator was freed cannot reach another one that MPI created
// under the same handle.
ffi::Error RegisterComm(int64_t fortran_handle, int64_t* handle);

// Forgets a handle from RegisterComm: handlers refuse it from now on.
void UnregisterComm(int64_t handle);

// The Fortran handle inside a value from RegisterComm.
MPI_Fint FortranHandle(int64_t handle);

// The live communicator behind a "comm" attribute, or an error naming `op`
// if it was freed (or never registered). Takes no lock and allocates nothing
// unless it fails: every handler call starts with it.
ffi::Error CommFromHandle(int64_t handle, const char* op, MPI_Comm* comm);

// The error for arguments of `op` that do not fit together:
// "jaxcomm: <op> on rank <r>: <why>".
ffi::Error Invalid(const char* op, MPI_Comm comm, const std::string& why);

// The error of CheckElements.
ffi::Error WrongElements(const char* op, MPI_Comm comm, const char* buffer, size_t actual,
                         size_t expected, const std::string& how);

// The error of CheckOutput for an output whose element type is not x's.
ffi::Error WrongOutputType(const char* op, MPI_Comm comm, const ffi::AnyBuffer& x,
                           const ffi::AnyBuffer& y);

// Fails unless `buffer` of `op` holds `expected` elements, the number its
// attributes and the communicator size call for: MPI would read or write
// outside the buffer otherwise. how() says how they call for it; it is only
// called when the check fails, so a passing check builds no string.
template <typename How>
ffi::Error CheckElements(const char* op, MPI_Comm comm, const char* buffer, size_t actual,
                         size_t expected, How&& how) {
  if (actual == expected) return ffi::Error::Success();
  return WrongElements(op, comm, buffer, actual, expected, how());
}

// Fails unless the output `y` has the element type of the input `x` and
// `expected` elements, as CheckElements.
template <typename How>
ffi::Error CheckOutput(const char* op, MPI_Comm comm, const ffi::AnyBuffer& x,
                       const ffi::AnyBuffer& y, size_t expected, How&& how) {
  if (x.element_type() != y.element_type()) {
    return WrongOutputType(op, comm, x, y);
  }
  return CheckElements(op, comm, "output", y.element_count(), expected, how);
}

// The `how` of an output shaped like its input.
inline std::string LikeTheInput() { return "like the input"; }

// Whether XLA gave output `y` the buffer of input `x` (ops whose lowering
// aliases them): the MPI call then works in place.
inline bool SameBuffer(const ffi::AnyBuffer& x, const ffi::AnyBuffer& y) {
  return x.untyped_data() == y.untyped_data() && x.size_bytes() == y.size_bytes();
}

// Rank in `comm`, for log lines and error messages.
int CommRank(MPI_Comm comm);

// Rank in MPI_COMM_WORLD, or -1 outside MPI_Init..MPI_Finalize.
int WorldRank();

// Number of ranks in `comm`.
int CommSize(MPI_Comm comm);

// Builds the error returned to XLA when an MPI call fails.
ffi::Error MpiFailure(const char* function, int code, MPI_Comm comm);

// Largest count handed to one MPI call: INT_MAX (MPI's int counts) unless
// lowered, which the tests do to run the large-message paths on small arrays.
size_t MaxCount();
void SetMaxCount(size_t count);

// `count` elements of `base` as MPI arguments: (base, count) when count fits
// MaxCount(), else one element of a derived datatype that spans them all.
// Frees the derived datatypes when destroyed. For data movement only: MPI's
// predefined reductions do not apply to derived datatypes (use ForEachChunk).
class LargeType {
 public:
  LargeType() = default;
  LargeType(const LargeType&) = delete;
  LargeType& operator=(const LargeType&) = delete;
  ~LargeType();

  static ffi::Error Make(MPI_Datatype base, size_t count, MPI_Comm comm, LargeType* out);
  // The same for `count` elements of an XLA element type.
  static ffi::Error Make(ffi::DataType element_type, size_t count, MPI_Comm comm, LargeType* out);

  MPI_Datatype type() const { return type_; }
  int count() const { return count_; }

 private:
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
  int count_ = 0;
  MPI_Datatype owned_[3] = {MPI_DATATYPE_NULL, MPI_DATATYPE_NULL, MPI_DATATYPE_NULL};
};

// Calls fn(offset, count) over consecutive pieces of at most MaxCount()
// elements covering [0, total), at least once (with count 0 when total is 0),
// and stops at the first error.
template <typename Fn>
ffi::Error ForEachChunk(size_t total, Fn&& fn) {
  const size_t max = MaxCount();
  size_t offset = 0;
  do {
    const size_t n = total - offset < max ? total - offset : max;
    ffi::Error err = fn(offset, static_cast<int>(n));
    if (err.failure()) return err;
    offset += n;
  } while (offset < total);
  return ffi::Error::Success();
}

// Address of element `offset` of a buffer of `dtype`.
inline void* ElementAt(void* data, ffi::DataType dtype, size_t offset) {
  return static_cast<char*>(data) + offset * ffi::ByteWidth(dtype);
}

// The same for a buffer argument of an MPI call, which may also be
// MPI_IN_PLACE or null (not significant on this rank): those stay as they are.
inline void* ArgumentAt(void* data, ffi::DataType dtype, size_t offset) {
  if (data == MPI_IN_PLACE || data == nullptr) return data;
  return ElementAt(data, dtype, offset);
}

// "count <n> <dtype>", the tail of most log lines.
std::string Elements(size_t count, ffi::DataType dtype);

bool DebugEnabled();
void SetDebug(bool enabled);

// The process-wide slot for the first failure of a handler not yet reported
// to Python. XLA drops the error of a computation that has no outputs and
// runs after its dispatch returned, so every failure is kept here until
// jaxcomm.sync(), the next jaxcomm call or the exit hook raises it.
// Returns `error` unchanged.
ffi::Error Recorded(ffi::Error error);

// Moves the recorded failure's message into `message`, emptying the slot;
// false if there is none.
bool TakeRecordedError(std::string* message);

// Writes one line to stderr: "r<rank> | <text>".
void DebugLog(MPI_Comm comm, const std::string& text);

// The collective mismatch checker and the hang watchdog (monitor.cc). Every
// handler announces the MPI operation it is about to make, once, before its
// first MPI call, with everything the ranks involved must agree on. When
// neither is on (the default), an announcement is one relaxed atomic load.

// Switches, set from Python (jaxcomm.set_check, jaxcomm.set_timeout).
constexpr int kCheckCalls = 1;
constexpr int kWatchCalls = 2;
int MonitorFlags();
void SetCheck(bool enabled);
// Seconds a call may take before the watchdog aborts the job; 0 turns it off.
void SetTimeout(double seconds);

// The call-site table: a Python call site ("file:line (function)") gets an
// id, which every handler receives as its "site" attribute.
int64_t RegisterSite(const std::string& text);

// How many handler calls are running now, and the call site of the latest
// to start (for the report of an interrupt that cannot stop them).
int CallsInFlight();
std::string LatestSite();

// The private communicator the checker exchanges signatures on, for the
// communicator behind `handle` (MPI_COMM_NULL: none).
void SetCheckComm(int64_t handle, MPI_Fint check);

// The call a handler is in, for its whole run: made by the platform layer
// (module.cc) around each handler body with the call's "site" attribute.
class CallScope {
 public:
  explicit CallScope(int64_t site);
  ~CallScope();
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;
};

// A collective about to run: what every rank of the communicator must pass
// alike. Fields that do not apply keep their defaults.
struct Collective {
  const char* op;          // jaxcomm's name, "allreduce"
  ffi::DataType dtype;     // element type of the input
  int64_t count = -1;      // elements of the input; -1: may differ by rank
  int64_t root = -1;       // -1: no root
  int64_t reduce_op = -1;  // reduction code; -1: none
  // Further integers every rank passes alike (the *v ops' counts).
  ffi::Span<const int64_t> agreed{};
};

// Elements of `x`, as a Collective's count.
inline int64_t Count(const ffi::AnyBuffer& x) { return static_cast<int64_t>(x.element_count()); }

ffi::Error AnnounceCollectiveSlow(int64_t handle, MPI_Comm comm, const Collective& call);
inline ffi::Error AnnounceCollective(int64_t handle, MPI_Comm comm, const Collective& call) {
  if (MonitorFlags() == 0) return ffi::Error::Success();
  return AnnounceCollectiveSlow(handle, comm, call);
}

// A peer no MPI names (MPI_ANY_SOURCE and MPI_PROC_NULL are small negative
// numbers that differ between MPI libraries).
constexpr int64_t kNoPeer = INT64_MIN;

// A point-to-point call about to run: `count` elements of `dtype` sent to
// `dest` with `sendtag` (dest MPI_PROC_NULL or kNoPeer: nothing sent), and
// up to `capacity` elements received from `*source` with `*tag` (*source
// MPI_PROC_NULL or kNoPeer: nothing received). When checking, a wildcard source
// or tag is resolved here, to the message whose signature was checked: the
// caller then receives with the values it finds in *source and *tag. A
// message that does not fit its receive (another dtype, or more elements)
// fails the receiving rank's call (recv_dropped): the caller must still take
// that message, `dropped_count` elements of `dropped_dtype`, into scratch
// memory, because its sender goes on without waiting, and fail.
struct PointToPoint {
  const char* op;  // "send", "recv", "sendrecv"
  ffi::DataType dtype;
  int64_t dest = kNoPeer;
  int64_t sendtag = 0;
  int64_t count = 0;
  int64_t capacity = 0;
  // A sendrecv's incoming signature, which the caller receives with
  // ReceiveSignature once its own message is under way.
  bool signature_pending = false;
  bool recv_dropped = false;
  ffi::DataType dropped_dtype = ffi::DataType::INVALID;
  int64_t dropped_count = 0;
};

ffi::Error AnnouncePointToPointSlow(int64_t handle, MPI_Comm comm, PointToPoint& call,
                                    int64_t* source, int64_t* tag);
ffi::Error ReceiveSignatureSlow(int64_t handle, MPI_Comm comm, PointToPoint& call, int64_t* source,
                                int64_t* tag);
inline ffi::Error ReceiveSignature(int64_t handle, MPI_Comm comm, PointToPoint& call,
                                   int64_t* source, int64_t* tag) {
  if (!call.signature_pending) return ffi::Error::Success();
  return ReceiveSignatureSlow(handle, comm, call, source, tag);
}
inline ffi::Error AnnouncePointToPoint(int64_t handle, MPI_Comm comm, PointToPoint& call,
                                       int64_t* source, int64_t* tag) {
  if (MonitorFlags() == 0) return ffi::Error::Success();
  return AnnouncePointToPointSlow(handle, comm, call, source, tag);
}

// The text of a call site id (RegisterSite), for reports.
std::string SiteText(int64_t site);

// The id of the call site of the handler running on this thread.
int64_t CurrentSite();

// The watchdog: the handler running on this thread now waits in `what`
// (only when the watchdog is on: check Watching() first).
inline bool Watching() { return (MonitorFlags() & kWatchCalls) != 0; }
void Watch(std::string what);

// The checker's part in nonblocking receives (monitor.cc). A checked message
// is preceded by its sender's signature of kSignatureBytes bytes on the
// checking communicator. A nonblocking receive posts the receive of that
// signature when it starts (PostSignatureReceive), or, for a wildcard, takes
// it once the message came from a known sender and tag (ReceiveSignatureNow),
// and compares it at its wait (CheckSignature).
constexpr size_t kSignatureBytes = 392;
// A nonblocking send's signature goes out without waiting (its receive may
// be posted later by this very rank); `signature` must live until `request`
// completes.
ffi::Error PostSignatureSend(int64_t handle, MPI_Comm comm, const char* op, ffi::DataType dtype,
                             int64_t count, int64_t dest, int64_t tag, void* signature,
                             MPI_Request* request);
ffi::Error PostSignatureReceive(int64_t handle, MPI_Comm comm, const char* op, int64_t source,
                                int64_t tag, void* signature, MPI_Request* request);
ffi::Error ReceiveSignatureNow(int64_t handle, MPI_Comm comm, const char* op, int64_t source,
                               int64_t tag, void* signature);
// Fails with the checker's point-to-point mismatch unless the signature
// fits a receive by `op` at `site` of up to `capacity` elements of `dtype`.
ffi::Error CheckSignature(MPI_Comm comm, const void* signature, int64_t source, const char* op,
                          ffi::DataType dtype, int64_t capacity, int64_t site);

// Nonblocking requests (nonblocking.cc): requests started and not yet
// completed by a wait, as (slot, serial, description), skipping those
// already reported; MarkRequestReported stops reporting one.
struct UnfinishedRequest {
  int64_t slot;
  int64_t serial;
  std::string text;
};
std::vector<UnfinishedRequest> UnfinishedRequests();
void MarkRequestReported(int64_t slot, int64_t serial);

}  // namespace jaxcomm

// Runs an MPI call and returns an ffi::Error naming it, the rank and MPI's
// error string when it fails. Needs `comm` in scope.
#define JAXCOMM_MPI_CHECK(function, ...)                          \
  do {                                                            \
    int jaxcomm_rc_ = function(__VA_ARGS__);                      \
    if (jaxcomm_rc_ != MPI_SUCCESS) {                             \
      return ::jaxcomm::MpiFailure(#function, jaxcomm_rc_, comm); \
    }                                                             \
  } while (0)

#endif  // JAXCOMM_KERNELS_COMMON_H_
