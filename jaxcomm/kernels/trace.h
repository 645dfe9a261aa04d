// The timeline recorder (trace.cc; jaxcomm.trace on the Python side). While
// it is on, every handler call is one span: the platform layer (handlers.cc)
// opens it around the call with the operation, the call site and the
// communicator, and the handler's announcement (call.h), its request start
// or its wait (nonblocking.cc) fill in what moves where. Spans go to a fixed
// ring that is written to this rank's file whenever it fills or half a
// second after its oldest unwritten span, so memory stays bounded and a
// killed process leaves a file that is readable up to its last write. When
// the recorder is off (the default), each hook is one relaxed atomic load.
#ifndef JAXCOMM_KERNELS_TRACE_H_
#define JAXCOMM_KERNELS_TRACE_H_

#include <atomic>
#include <cstdint>
#include <string>

namespace jaxcomm {

namespace trace_state {
extern std::atomic<bool> on;
}  // namespace trace_state

inline bool Tracing() { return trace_state::on.load(std::memory_order_relaxed); }

// What a record is. Values are part of the file format (jaxcomm/trace).
enum class SpanKind : int32_t {
  kCall = 0,    // a blocking handler call (or a start/wait before it says so)
  kStart = 1,   // a nonblocking operation's start
  kWait = 2,    // the wait that completes it: its whole span is time blocked
  kCopy = 3,    // a GPU staging copy and the synchronisation it waits for
  kMember = 4,  // not a span: `peer` of communicator `comm` is world rank `source`
};

// One fixed-size record of the file. The layout is the file format:
// jaxcomm/trace/_files.py reads it with the same fields in the same order.
struct TraceRecord {
  int64_t start_ns;  // steady (monotonic) clock
  int64_t end_ns;
  int64_t site;        // call site id (jaxcomm._runtime.site_id), -1: none
  int64_t comm;        // the "handle" attribute: a communicator, never reused
  int64_t bytes;       // sent or contributed; -1: not known (counts per rank)
  int64_t recv_bytes;  // a receive's capacity
  int64_t request;     // start and wait: slot << 32 | serial; else -1
  int32_t kind;        // SpanKind
  int32_t peer;        // dest or root (kTraceNoPeer: none)
  int32_t source;      // a receive's source (kTraceNoPeer: none)
  int32_t tag;         // the send's tag
  int32_t recvtag;     // the receive's tag
  int32_t failed;      // 1: the call returned an error
  char op[24];         // the operation's label, NUL-padded
};
static_assert(sizeof(TraceRecord) == 104, "the trace file format has 104-byte records");

constexpr int32_t kTraceNoPeer = INT32_MIN;

// The clock spans are measured on, in nanoseconds.
int64_t TraceNow();

// Starts writing this rank's records to `path` (created or truncated), or
// returns why it cannot. Stops a recording already running first.
std::string StartTrace(const std::string& path);
// Writes what the ring holds and closes the file.
void StopTrace();
// Writes what the ring holds now.
void FlushTrace();

// The span of the handler call on this thread, from its platform layer.
class TraceScope {
 public:
  TraceScope(const char* op, int64_t site, int64_t handle) {
    if (Tracing()) Open(op, site, handle);
  }
  ~TraceScope() {
    if (open_) Close();
  }
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;
  // Marks the span failed when `failed`.
  void Failed(bool failed) {
    if (open_ && failed) MarkFailed();
  }

 private:
  void Open(const char* op, int64_t site, int64_t handle);
  void Close();
  void MarkFailed();
  bool open_ = false;
};

// What the handler on this thread moves (no effect outside a span). Peers
// are the call's own (dest, root, source), kTraceNoPeer where none applies.
void TraceCollective(int64_t bytes, int64_t root);
void TracePointToPoint(int64_t dest, int64_t tag, int64_t bytes, int64_t source, int64_t recvtag,
                       int64_t recv_bytes);
// The span is a nonblocking start or a wait of request (slot, serial).
void TraceStart(int32_t slot, uint32_t serial);
void TraceWait(int32_t slot, uint32_t serial, int64_t comm, const char* op);

// A wait for `bytes` of staging copies inside the current span: from its
// construction to its destruction (none for 0 bytes: the direct path's wait
// for XLA's stream moves nothing).
class TraceCopy {
 public:
  explicit TraceCopy(int64_t bytes) {
    if (Tracing() && bytes > 0) Begin(bytes);
  }
  ~TraceCopy() {
    if (start_ns_ >= 0) End();
  }
  TraceCopy(const TraceCopy&) = delete;
  TraceCopy& operator=(const TraceCopy&) = delete;

 private:
  void Begin(int64_t bytes);
  void End();
  int64_t start_ns_ = -1;
  int64_t bytes_ = 0;
};

}  // namespace jaxcomm

#endif  // JAXCOMM_KERNELS_TRACE_H_
