// The timeline recorder: see trace.h.
#include "trace.h"

#include <fcntl.h>
#include <mpi.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <vector>

#include "handles.h"

namespace jaxcomm {

namespace trace_state {
std::atomic<bool> on{false};
}  // namespace trace_state

namespace {

// 4096 records of 104 bytes: one write of about 400 KiB per full ring.
constexpr size_t kRingRecords = 4096;
// A ring whose oldest record waited this long is written at the next span,
// so that a process killed while busy loses at most about this much.
constexpr int64_t kFlushAfterNs = 500'000'000;

// The file starts with this header: magic, format version, record size.
constexpr char kMagic[8] = {'J', 'C', 'T', 'R', 'A', 'C', 'E', '\0'};
constexpr uint32_t kVersion = 1;

struct Recorder {
  std::mutex mutex;
  int fd = -1;
  std::vector<TraceRecord> ring;  // capacity kRingRecords, reserved once
  int64_t oldest_ns = 0;
  std::vector<int64_t> comms_seen;  // whose members the file already holds
};
Recorder& TheRecorder() {
  static Recorder* recorder = new Recorder;
  return *recorder;
}

thread_local TraceRecord span;
thread_local bool in_span = false;

void WriteAll(int fd, const void* data, size_t bytes) {
  const char* next = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, next, bytes);
    if (n < 0 && errno == EINTR) continue;
    // A full disk loses records, never the program's run.
    if (n <= 0) return;
    next += n;
    bytes -= static_cast<size_t>(n);
  }
}

// Holding the recorder's mutex.
void WriteRing(Recorder& recorder) {
  if (recorder.fd >= 0 && !recorder.ring.empty()) {
    WriteAll(recorder.fd, recorder.ring.data(), recorder.ring.size() * sizeof(TraceRecord));
  }
  recorder.ring.clear();
}

// Holding the recorder's mutex.
void Push(Recorder& recorder, const TraceRecord& record) {
  if (recorder.ring.empty()) recorder.oldest_ns = record.end_ns;
  recorder.ring.push_back(record);
  if (recorder.ring.size() == kRingRecords || record.end_ns - recorder.oldest_ns > kFlushAfterNs) {
    WriteRing(recorder);
  }
}

// The world ranks of communicator `handle`'s members, once per recording,
// so that the merge can name every peer by its world rank. Holding the
// recorder's mutex.
void NoteMembers(Recorder& recorder, int64_t handle, int64_t now) {
  for (int64_t seen : recorder.comms_seen) {
    if (seen == handle) return;
  }
  recorder.comms_seen.push_back(handle);
  MPI_Comm comm;
  if (CommFromHandle(handle, "trace", &comm).failure()) return;
  MPI_Group group;
  MPI_Group world;
  if (MPI_Comm_group(comm, &group) != MPI_SUCCESS) return;
  if (MPI_Comm_group(MPI_COMM_WORLD, &world) != MPI_SUCCESS) {
    MPI_Group_free(&group);
    return;
  }
  int size = 0;
  MPI_Group_size(group, &size);
  std::vector<int> ranks(size);
  std::vector<int> in_world(size, MPI_UNDEFINED);
  for (int i = 0; i < size; ++i) ranks[i] = i;
  MPI_Group_translate_ranks(group, size, ranks.data(), world, in_world.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world);
  for (int i = 0; i < size; ++i) {
    TraceRecord member{};
    member.start_ns = member.end_ns = now;
    member.site = -1;
    member.comm = handle;
    member.bytes = member.recv_bytes = member.request = -1;
    member.kind = static_cast<int32_t>(SpanKind::kMember);
    member.peer = i;
    member.source = in_world[i];
    std::strncpy(member.op, "member", sizeof(member.op) - 1);
    Push(recorder, member);
  }
}

int32_t Peer(int64_t rank) {
  return rank < INT32_MIN || rank > INT32_MAX ? kTraceNoPeer : static_cast<int32_t>(rank);
}

}  // namespace

int64_t TraceNow() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string StartTrace(const std::string& path) {
  StopTrace();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return "cannot open " + path + ": " + std::strerror(errno);
  char header[16];
  std::memcpy(header, kMagic, 8);
  const uint32_t size = sizeof(TraceRecord);
  std::memcpy(header + 8, &kVersion, 4);
  std::memcpy(header + 12, &size, 4);
  WriteAll(fd, header, sizeof(header));
  Recorder& recorder = TheRecorder();
  {
    std::lock_guard<std::mutex> lock(recorder.mutex);
    recorder.fd = fd;
    recorder.ring.clear();
    recorder.ring.reserve(kRingRecords);
    recorder.comms_seen.clear();
  }
  trace_state::on.store(true, std::memory_order_relaxed);
  return "";
}

void StopTrace() {
  trace_state::on.store(false, std::memory_order_relaxed);
  Recorder& recorder = TheRecorder();
  std::lock_guard<std::mutex> lock(recorder.mutex);
  WriteRing(recorder);
  if (recorder.fd >= 0) ::close(recorder.fd);
  recorder.fd = -1;
}

void FlushTrace() {
  Recorder& recorder = TheRecorder();
  std::lock_guard<std::mutex> lock(recorder.mutex);
  WriteRing(recorder);
}

void TraceScope::Open(const char* op, int64_t site, int64_t handle) {
  span = TraceRecord{};
  span.site = site;
  span.comm = handle;
  span.bytes = span.recv_bytes = span.request = -1;
  span.kind = static_cast<int32_t>(SpanKind::kCall);
  span.peer = span.source = kTraceNoPeer;
  std::strncpy(span.op, op, sizeof(span.op) - 1);
  in_span = open_ = true;
  // Last: the span's time is the call's, not the bookkeeping's.
  span.start_ns = TraceNow();
}

void TraceScope::MarkFailed() { span.failed = 1; }

void TraceScope::Close() {
  span.end_ns = TraceNow();
  in_span = false;
  Recorder& recorder = TheRecorder();
  std::lock_guard<std::mutex> lock(recorder.mutex);
  // Stopped while the call ran: its span belongs to no file.
  if (recorder.fd < 0) return;
  NoteMembers(recorder, span.comm, span.start_ns);
  Push(recorder, span);
}

void TraceCollective(int64_t bytes, int64_t root) {
  if (!in_span) return;
  span.bytes = bytes;
  span.peer = Peer(root);
}

void TracePointToPoint(int64_t dest, int64_t tag, int64_t bytes, int64_t source, int64_t recvtag,
                       int64_t recv_bytes) {
  if (!in_span) return;
  span.peer = Peer(dest);
  span.tag = static_cast<int32_t>(tag);
  span.bytes = span.peer == kTraceNoPeer ? 0 : bytes;
  span.source = Peer(source);
  span.recvtag = static_cast<int32_t>(recvtag);
  span.recv_bytes = span.source == kTraceNoPeer ? 0 : recv_bytes;
}

void TraceStart(int32_t slot, uint32_t serial) {
  if (!in_span) return;
  span.kind = static_cast<int32_t>(SpanKind::kStart);
  span.request = (static_cast<int64_t>(slot) << 32) | serial;
}

void TraceWait(int32_t slot, uint32_t serial, int64_t comm, const char* op) {
  if (!in_span) return;
  span.kind = static_cast<int32_t>(SpanKind::kWait);
  span.request = (static_cast<int64_t>(slot) << 32) | serial;
  span.comm = comm;
  std::memset(span.op, 0, sizeof(span.op));
  std::strncpy(span.op, op, sizeof(span.op) - 1);
}

void TraceCopy::Begin(int64_t bytes) {
  bytes_ = bytes;
  start_ns_ = TraceNow();
}

void TraceCopy::End() {
  if (!in_span) return;
  TraceRecord copy = span;
  copy.kind = static_cast<int32_t>(SpanKind::kCopy);
  copy.start_ns = start_ns_;
  copy.end_ns = TraceNow();
  copy.bytes = bytes_;
  copy.recv_bytes = -1;
  Recorder& recorder = TheRecorder();
  std::lock_guard<std::mutex> lock(recorder.mutex);
  if (recorder.fd >= 0) Push(recorder, copy);
}

}  // namespace jaxcomm
