// The collective mismatch checker and the hang watchdog (monitor.cc). Every
// handler announces the MPI operation it is about to make, once, before its
// first MPI call, with everything the ranks involved must agree on (through
// its Call, call.h). When neither is on (the default), an announcement is
// one relaxed atomic load.
#ifndef JAXCOMM_KERNELS_MONITOR_H_
#define JAXCOMM_KERNELS_MONITOR_H_

#include <mpi.h>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>

#include "handles.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

namespace ffi = xla::ffi;

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

// What this rank waits in now, for a report: the watchdog's description of
// the call when it is on, otherwise the operation and call site of the
// latest handler call still running, or that none is running.
std::string CallInFlightText();

// The private communicator the checker exchanges signatures on, for the
// communicator behind `handle` (MPI_COMM_NULL: none).
void SetCheckComm(int64_t handle, IntHandle check);

// The call a handler is in, for its whole run: made by the platform layer
// (handlers.cc) around each handler body with the call's "site" attribute
// and its operation's name (a string that lives as long as the program).
class CallScope {
 public:
  CallScope(int64_t site, const char* op);
  ~CallScope();
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;
};

// Elements of `x`, as a count the checker compares.
inline int64_t Count(const ffi::AnyBuffer& x) { return static_cast<int64_t>(x.element_count()); }

// A collective about to run: what every rank of the communicator must pass
// alike. Made by one of the factories, with the fields that apply named:
//   Collective::Of(x).Root(root).Reduction(op)
// Fields left out keep the value that says they do not apply.
struct Collective {
  // The input `x`: its element type and count.
  static Collective Of(const ffi::AnyBuffer& x) { return Collective{x.element_type(), Count(x)}; }
  // Inputs of element type `dtype` whose counts may differ by rank.
  static Collective OfType(ffi::DataType dtype) { return Collective{dtype, kAnyCount}; }
  // No data at all (barrier).
  static Collective NoData() { return Collective{ffi::DataType::INVALID, kAnyCount}; }

  Collective& Root(int64_t rank) {
    root = rank;
    return *this;
  }
  Collective& Reduction(int64_t code) {
    reduce_op = code;
    return *this;
  }
  // Further integers every rank passes alike (the *v ops' counts).
  Collective& Agreed(ffi::Span<const int64_t> values) {
    agreed = values;
    return *this;
  }

  static constexpr int64_t kAnyCount = -1;
  static constexpr int64_t kNoRoot = -1;
  static constexpr int64_t kNoReduction = -1;

  ffi::DataType dtype;
  int64_t count;
  int64_t root = kNoRoot;
  int64_t reduce_op = kNoReduction;
  ffi::Span<const int64_t> agreed{};
};

ffi::Error AnnounceCollectiveSlow(int64_t handle, MPI_Comm comm, const char* op,
                                  const Collective& call);

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
// Made as PointToPoint::Of(dtype).Send(dest, tag, count).Receive(capacity),
// with the sides that apply.
struct PointToPoint {
  static PointToPoint Of(ffi::DataType dtype) {
    PointToPoint call;
    call.dtype = dtype;
    return call;
  }
  PointToPoint& Send(int64_t to, int64_t with_tag, int64_t elements) {
    dest = to;
    sendtag = with_tag;
    count = elements;
    return *this;
  }
  PointToPoint& Receive(int64_t elements) {
    capacity = elements;
    return *this;
  }

  const char* op = "";  // "send", "recv", "sendrecv": set by Call::Announce
  ffi::DataType dtype = ffi::DataType::INVALID;
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

// The text of a call site id (RegisterSite), for reports.
std::string SiteText(int64_t site);

// The id of the call site of the handler running on this thread.
int64_t CurrentSite();

// The watchdog: the handler running on this thread now waits in `what`
// (only when the watchdog is on: check Watching() first).
inline bool Watching() { return (MonitorFlags() & kWatchCalls) != 0; }
void Watch(std::string what);

// The checker's part in nonblocking point-to-point calls. A checked message
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

}  // namespace jaxcomm

#endif  // JAXCOMM_KERNELS_MONITOR_H_
