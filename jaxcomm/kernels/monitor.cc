// The collective mismatch checker and the hang watchdog.
//
// Checker: before its MPI call, a collective's ranks gather each other's
// signature (op, root, reduction, count, dtype and the Python call site) on
// a private communicator; if they differ, every rank returns the same error
// naming what each rank called, and none makes the call. A point-to-point
// message is preceded by the sender's signature on that communicator, with
// the same peer and tag as the message, so it matches exactly the receive
// the message will. A receiver that finds the message does not fit takes it
// into scratch memory (its sender, which goes on without waiting for an
// answer, as MPI lets small sends do, must not be left waiting) and fails.
//
// Watchdog: a handler records what it waits in; a thread that sleeps
// between checks aborts the job when one call has taken longer than the
// timeout, after printing what that call was.
#include "monitor.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "datatypes.h"
#include "errors.h"
#include "handles.h"
#include "peers.h"
#include "reduce_ops.h"

namespace jaxcomm {
namespace {

std::atomic<int> monitor_flags{0};

// State below is created once and never destroyed: the watchdog thread may
// still read it while the process exits.
struct Sites {
  std::mutex mutex;
  std::vector<std::string> texts;
  std::unordered_map<std::string, int64_t> ids;
};
Sites& TheSites() {
  static Sites* sites = new Sites;
  return *sites;
}

std::string SiteTextOf(int64_t site) {
  Sites& sites = TheSites();
  std::lock_guard<std::mutex> lock(sites.mutex);
  if (site >= 0 && static_cast<size_t>(site) < sites.texts.size()) {
    return sites.texts[site];
  }
  return "an unknown call site";
}

struct CheckCommTable {
  std::mutex mutex;
  std::unordered_map<int64_t, MPI_Comm> comms;
};
CheckCommTable& TheCheckComms() {
  static CheckCommTable* table = new CheckCommTable;
  return *table;
}

thread_local int64_t current_site = -1;

// Handler calls running now, and the site of the latest to start: what an
// interrupt reports (always kept: two relaxed atomic operations a call).
std::atomic<int> calls_in_flight{0};
std::atomic<int64_t> latest_site{-1};
std::atomic<const char*> latest_op{"an MPI call"};

// What one call waits in, since when.
struct Watched {
  bool busy = false;
  std::chrono::steady_clock::time_point start;
  std::string what;
};
constexpr int kWatchSlots = 16;
struct Watchdog {
  std::mutex mutex;
  std::condition_variable wake;
  double timeout_s = 0;
  bool started = false;
  Watched slots[kWatchSlots];
};
Watchdog& TheWatchdog() {
  static Watchdog* watchdog = new Watchdog;
  return *watchdog;
}
thread_local int watch_slot = -1;

// The exit status a watchdog abort asks MPI for, timeout(1)'s.
constexpr int kTimeoutExit = 124;

void WatchdogLoop() {
  Watchdog& dog = TheWatchdog();
  std::unique_lock<std::mutex> lock(dog.mutex);
  for (;;) {
    if (dog.timeout_s <= 0) {
      dog.wake.wait(lock);
      continue;
    }
    // Sleeps between checks: a late report by a fraction of the timeout
    // costs nothing, a polling loop would cost the ranks' computation.
    const double period = std::min(1.0, dog.timeout_s / 4);
    dog.wake.wait_for(lock, std::chrono::duration<double>(period));
    if (dog.timeout_s <= 0) continue;
    const auto now = std::chrono::steady_clock::now();
    for (const Watched& slot : dog.slots) {
      if (!slot.busy) continue;
      const double waited = std::chrono::duration<double>(now - slot.start).count();
      if (waited <= dog.timeout_s) continue;
      char host[256] = "?";
      gethostname(host, sizeof host - 1);
      std::fprintf(stderr,
                   "jaxcomm watchdog: rank %d on host %s has waited %.1f s in %s, "
                   "longer than the timeout of %g s (JAXCOMM_TIMEOUT, "
                   "jaxcomm.set_timeout): aborting the job\n",
                   WorldRank(), host, waited, slot.what.c_str(), dog.timeout_s);
      std::fflush(stderr);
      // mpiexec may drop what a rank wrote just before it aborts the job.
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      AbortOrExit(kTimeoutExit);
    }
  }
}

void WatchSlot(std::string what) {
  Watchdog& dog = TheWatchdog();
  std::lock_guard<std::mutex> lock(dog.mutex);
  if (watch_slot < 0) {
    for (int i = 0; i < kWatchSlots; ++i) {
      if (!dog.slots[i].busy) {
        watch_slot = i;
        break;
      }
    }
    // More concurrent handlers than slots: this one goes unwatched.
    if (watch_slot < 0) return;
  }
  Watched& slot = dog.slots[watch_slot];
  slot.busy = true;
  slot.start = std::chrono::steady_clock::now();
  slot.what = std::move(what);
}

// A fixed-size record the ranks exchange as bytes. Zero-initialised before
// it is filled, so equal signatures are equal byte for byte.
struct Signature {
  char op[24];
  int32_t dtype;
  int32_t agreed_size;
  int64_t count;
  int64_t root;
  int64_t reduce_op;
  int64_t tag;
  uint64_t agreed_hash;
  char agreed_text[64];
  char site[256];
};

static_assert(sizeof(Signature) == kSignatureBytes,
              "kSignatureBytes (monitor.h) must be the signature's size");

// The part ranks must agree on: everything before the site.
constexpr size_t kAgreedBytes = offsetof(Signature, site);

void CopyText(char* out, size_t size, const std::string& text) {
  std::strncpy(out, text.c_str(), size - 1);
  out[size - 1] = '\0';
}

std::string Describe(const Signature& s) {
  std::string text = s.op;
  std::vector<std::string> parts;
  if (s.root >= 0) parts.push_back("root " + std::to_string(s.root));
  if (s.reduce_op >= 0) parts.push_back(std::string("op ") + ReduceOpName(s.reduce_op));
  if (s.agreed_size > 0) parts.push_back(s.agreed_text);
  const auto dtype = static_cast<ffi::DataType>(s.dtype);
  if (s.count >= 0) {
    parts.push_back(Elements(static_cast<size_t>(s.count), dtype));
  } else if (dtype != ffi::DataType::INVALID) {
    parts.push_back(DtypeName(dtype));
  }
  text += "(";
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i > 0) text += ", ";
    text += parts[i];
  }
  return text + ") at " + s.site;
}

std::string RankList(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(ranks[i]);
  }
  return text;
}

uint64_t Hash(ffi::Span<const int64_t> values) {
  uint64_t hash = 1469598103934665603ull;  // FNV-1a over the 64-bit words
  for (int64_t v : values) {
    hash ^= static_cast<uint64_t>(v);
    hash *= 1099511628211ull;
  }
  return hash;
}

uint64_t HashBytes(const void* data, size_t bytes) {
  uint64_t hash = 1469598103934665603ull;  // FNV-1a
  for (size_t i = 0; i < bytes; ++i) {
    hash ^= static_cast<const unsigned char*>(data)[i];
    hash *= 1099511628211ull;
  }
  return hash;
}

Signature CollectiveSignature(const char* op, const Collective& call) {
  Signature s;
  std::memset(&s, 0, sizeof s);
  CopyText(s.op, sizeof s.op, op);
  s.dtype = static_cast<int32_t>(call.dtype);
  s.count = call.count;
  s.root = call.root;
  s.reduce_op = call.reduce_op;
  s.tag = -1;
  s.agreed_size = static_cast<int32_t>(call.agreed.size());
  s.agreed_hash = Hash(call.agreed);
  if (call.agreed.size() > 0) {
    std::string text = "counts ";
    for (size_t i = 0; i < call.agreed.size(); ++i) {
      if (i > 0) text += ",";
      text += std::to_string(call.agreed[i]);
    }
    CopyText(s.agreed_text, sizeof s.agreed_text, text);
  }
  CopyText(s.site, sizeof s.site, SiteTextOf(current_site));
  return s;
}

ffi::Error FindCheckComm(int64_t handle, const char* op, MPI_Comm comm, MPI_Comm* out) {
  CheckCommTable& table = TheCheckComms();
  std::lock_guard<std::mutex> lock(table.mutex);
  auto it = table.comms.find(handle);
  if (it == table.comms.end()) {
    return Invalid(op, comm,
                   "the mismatch checker is on but this communicator has no "
                   "checking communicator (jaxcomm.set_check(True) must run "
                   "on every rank, before or after the JaxComm is created)");
  }
  *out = it->second;
  return ffi::Error::Success();
}

Signature PointToPointSignature(const PointToPoint& call, int64_t count, int64_t tag,
                                const std::string& site) {
  Signature s;
  std::memset(&s, 0, sizeof s);
  CopyText(s.op, sizeof s.op, call.op);
  s.dtype = static_cast<int32_t>(call.dtype);
  s.count = count;
  s.root = -1;
  s.reduce_op = -1;
  s.tag = tag;
  CopyText(s.site, sizeof s.site, site);
  return s;
}

// A sendrecv's own signature, on its way while the handler goes on (one at
// a time per thread: handlers on a thread run one after the other).
thread_local Signature pending_signature;
thread_local MPI_Request pending_request = MPI_REQUEST_NULL;

ffi::Error Mismatch(const std::string& text) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, text);
}

}  // namespace

std::string SiteText(int64_t site) { return SiteTextOf(site); }

int64_t CurrentSite() { return current_site; }

void Watch(std::string what) { WatchSlot(std::move(what)); }

int MonitorFlags() { return monitor_flags.load(std::memory_order_relaxed); }

void SetCheck(bool enabled) {
  if (enabled) {
    monitor_flags.fetch_or(kCheckCalls);
  } else {
    monitor_flags.fetch_and(~kCheckCalls);
  }
}

void SetTimeout(double seconds) {
  Watchdog& dog = TheWatchdog();
  {
    std::lock_guard<std::mutex> lock(dog.mutex);
    dog.timeout_s = seconds > 0 ? seconds : 0;
    if (dog.timeout_s > 0 && !dog.started) {
      std::thread(WatchdogLoop).detach();
      dog.started = true;
    }
  }
  dog.wake.notify_all();
  if (seconds > 0) {
    monitor_flags.fetch_or(kWatchCalls);
  } else {
    monitor_flags.fetch_and(~kWatchCalls);
  }
}

int CallsInFlight() { return calls_in_flight.load(std::memory_order_relaxed); }

std::string CallInFlightText() {
  {
    Watchdog& dog = TheWatchdog();
    std::lock_guard<std::mutex> lock(dog.mutex);
    for (const Watched& slot : dog.slots) {
      if (slot.busy) return slot.what;
    }
  }
  if (CallsInFlight() > 0) {
    return std::string(latest_op.load(std::memory_order_relaxed)) + " at " + LatestSite();
  }
  return "no MPI call (its latest was made at " + LatestSite() + ")";
}

std::string LatestSite() { return SiteTextOf(latest_site.load(std::memory_order_relaxed)); }

int64_t RegisterSite(const std::string& text) {
  Sites& sites = TheSites();
  std::lock_guard<std::mutex> lock(sites.mutex);
  auto it = sites.ids.find(text);
  if (it != sites.ids.end()) return it->second;
  const int64_t id = static_cast<int64_t>(sites.texts.size());
  sites.texts.push_back(text);
  sites.ids.emplace(text, id);
  return id;
}

void SetCheckComm(int64_t handle, IntHandle check) {
  CheckCommTable& table = TheCheckComms();
  std::lock_guard<std::mutex> lock(table.mutex);
  const MPI_Comm comm = CommFromInt(check);
  if (comm == MPI_COMM_NULL) {
    table.comms.erase(handle);
  } else {
    table.comms[handle] = comm;
  }
}

CallScope::CallScope(int64_t site, const char* op) {
  current_site = site;
  latest_site.store(site, std::memory_order_relaxed);
  latest_op.store(op, std::memory_order_relaxed);
  calls_in_flight.fetch_add(1, std::memory_order_relaxed);
}

CallScope::~CallScope() {
  calls_in_flight.fetch_sub(1, std::memory_order_relaxed);
  if (watch_slot < 0) return;
  Watchdog& dog = TheWatchdog();
  std::lock_guard<std::mutex> lock(dog.mutex);
  dog.slots[watch_slot].busy = false;
  watch_slot = -1;
}

ffi::Error AnnounceCollectiveSlow(int64_t handle, MPI_Comm comm, const char* op,
                                  const Collective& call) {
  const int flags = MonitorFlags();
  const Signature mine = CollectiveSignature(op, call);
  if (flags & kWatchCalls) {
    WatchSlot(Describe(mine) + " on a communicator of " + std::to_string(CommSize(comm)) +
              " ranks (rank " + std::to_string(CommRank(comm)) + " there)");
  }
  if (!(flags & kCheckCalls)) return ffi::Error::Success();
  MPI_Comm check;
  JAXCOMM_RETURN_IF_ERROR(FindCheckComm(handle, op, comm, &check));
  // The ranks agree when the largest hash of what they must agree on and the
  // largest complement of it are this rank's: one small allreduce, whatever
  // the communicator's size. Only a mismatch gathers every rank's signature,
  // to say who called what.
  const uint64_t hash = HashBytes(&mine, kAgreedBytes);
  uint64_t largest[2] = {hash, ~hash};
  JAXCOMM_MPI_CHECK(comm, MPI_Allreduce, MPI_IN_PLACE, largest, 2, MPI_UINT64_T, MPI_MAX, check);
  if (largest[0] == hash && largest[1] == ~hash) return ffi::Error::Success();
  const int size = CommSize(comm);
  std::vector<Signature> all(size);
  JAXCOMM_MPI_CHECK(comm, MPI_Allgather, &mine, static_cast<int>(sizeof mine), MPI_BYTE, all.data(),
                    static_cast<int>(sizeof mine), MPI_BYTE, check);
  // Every rank gathered the same signatures, so every rank fails here, with
  // the same message: ranks grouped by what they called, where.
  std::map<std::string, std::vector<int>> groups;
  std::vector<std::string> order;
  for (int r = 0; r < size; ++r) {
    const std::string text = Describe(all[r]);
    if (groups.find(text) == groups.end()) order.push_back(text);
    groups[text].push_back(r);
  }
  std::string text = "jaxcomm: collective mismatch on a communicator of " + std::to_string(size) +
                     " ranks (this is rank " + std::to_string(CommRank(comm)) + "): ";
  for (size_t i = 0; i < order.size(); ++i) {
    if (i > 0) text += "; ";
    text += RankList(groups[order[i]]) + " called " + order[i];
  }
  return Mismatch(text + ". No rank made the call.");
}

ffi::Error AnnouncePointToPointSlow(int64_t handle, MPI_Comm comm, PointToPoint& call,
                                    int64_t* source, int64_t* tag) {
  const int flags = MonitorFlags();
  const bool sends = call.dest != kNoPeer && call.dest != MPI_PROC_NULL;
  const bool receives = *source != kNoPeer && *source != MPI_PROC_NULL;
  if (!sends && !receives) return ffi::Error::Success();
  const std::string site = SiteTextOf(current_site);
  const int rank = CommRank(comm);
  auto peer = [](int64_t r) {
    return r == MPI_ANY_SOURCE ? std::string("any rank") : "rank " + std::to_string(r);
  };
  auto tag_text = [](int64_t t) {
    return t == MPI_ANY_TAG ? std::string("any tag") : "tag " + std::to_string(t);
  };
  if (flags & kWatchCalls) {
    std::string what = call.op;
    if (sends) {
      what += " to " + peer(call.dest) + " (" + tag_text(call.sendtag) + ", " +
              Elements(call.count, call.dtype) + ")";
    }
    if (receives) {
      what += std::string(sends ? " and" : "") + " from " + peer(*source) + " (" + tag_text(*tag) +
              ", up to " + Elements(call.capacity, call.dtype) + ")";
    }
    WatchSlot(what + " at " + site + " on rank " + std::to_string(rank));
  }
  if (!(flags & kCheckCalls)) return ffi::Error::Success();
  MPI_Comm check;
  JAXCOMM_RETURN_IF_ERROR(FindCheckComm(handle, call.op, comm, &check));
  if (sends && receives) {
    // A sendrecv starts its own message before it waits for its peer's
    // signature: that peer may send what this rank waits for only after it
    // received this rank's message (receives ordered by tag). Its peer may
    // be itself, so the signature goes out without waiting either.
    pending_signature = PointToPointSignature(call, call.count, call.sendtag, site);
    JAXCOMM_MPI_CHECK(
        comm, MPI_Isend, &pending_signature, static_cast<int>(sizeof pending_signature), MPI_BYTE,
        static_cast<int>(call.dest), static_cast<int>(call.sendtag), check, &pending_request);
    call.signature_pending = true;
    return ffi::Error::Success();
  }
  if (sends) {
    const Signature out = PointToPointSignature(call, call.count, call.sendtag, site);
    // A blocking send: a signature is small enough to go out at once, as
    // small messages do (the data message relies on the same).
    JAXCOMM_MPI_CHECK(comm, MPI_Send, &out, static_cast<int>(sizeof out), MPI_BYTE,
                      static_cast<int>(call.dest), static_cast<int>(call.sendtag), check);
    return ffi::Error::Success();
  }
  return ReceiveSignatureSlow(handle, comm, call, source, tag);
}

ffi::Error ReceiveSignatureSlow(int64_t handle, MPI_Comm comm, PointToPoint& call, int64_t* source,
                                int64_t* tag) {
  call.signature_pending = false;
  MPI_Comm check;
  JAXCOMM_RETURN_IF_ERROR(FindCheckComm(handle, call.op, comm, &check));
  const std::string site = SiteTextOf(current_site);
  const int rank = CommRank(comm);
  const Signature expected = PointToPointSignature(call, call.capacity, *tag, site);
  Signature in;
  MPI_Status status;
  JAXCOMM_MPI_CHECK(comm, MPI_Recv, &in, static_cast<int>(sizeof in), MPI_BYTE,
                    static_cast<int>(*source), static_cast<int>(*tag), check, &status);
  if (pending_request != MPI_REQUEST_NULL) {
    JAXCOMM_MPI_CHECK(comm, MPI_Wait, &pending_request, MPI_STATUS_IGNORE);
  }
  // The data receive now takes exactly the message just checked: the sender
  // sends it next, and MPI does not reorder one sender's messages.
  *source = status.MPI_SOURCE;
  *tag = status.MPI_TAG;
  if (in.dtype == expected.dtype && in.count <= expected.count) {
    return ffi::Error::Success();
  }
  call.recv_dropped = true;
  call.dropped_dtype = static_cast<ffi::DataType>(in.dtype);
  call.dropped_count = in.count;
  const auto elements = [](const Signature& s) {
    return Elements(static_cast<size_t>(s.count), static_cast<ffi::DataType>(s.dtype));
  };
  return Mismatch("jaxcomm: point-to-point mismatch on rank " + std::to_string(rank) + ": rank " +
                  std::to_string(*source) + " called " + in.op + " sending " + elements(in) +
                  " (tag " + std::to_string(in.tag) + ") at " + in.site + "; rank " +
                  std::to_string(rank) + " called " + call.op + " receiving up to " +
                  elements(expected) + " at " + site + ". The message was discarded.");
}

ffi::Error PostSignatureSend(int64_t handle, MPI_Comm comm, const char* op, ffi::DataType dtype,
                             int64_t count, int64_t dest, int64_t tag, void* signature,
                             MPI_Request* request) {
  MPI_Comm check;
  JAXCOMM_RETURN_IF_ERROR(FindCheckComm(handle, op, comm, &check));
  PointToPoint call = PointToPoint::Of(dtype).Send(dest, tag, count);
  call.op = op;
  const Signature out = PointToPointSignature(call, count, tag, SiteTextOf(current_site));
  std::memcpy(signature, &out, sizeof out);
  JAXCOMM_MPI_CHECK(comm, MPI_Isend, signature, static_cast<int>(kSignatureBytes), MPI_BYTE,
                    static_cast<int>(dest), static_cast<int>(tag), check, request);
  return ffi::Error::Success();
}

ffi::Error PostSignatureReceive(int64_t handle, MPI_Comm comm, const char* op, int64_t source,
                                int64_t tag, void* signature, MPI_Request* request) {
  MPI_Comm check;
  JAXCOMM_RETURN_IF_ERROR(FindCheckComm(handle, op, comm, &check));
  JAXCOMM_MPI_CHECK(comm, MPI_Irecv, signature, static_cast<int>(kSignatureBytes), MPI_BYTE,
                    static_cast<int>(source), static_cast<int>(tag), check, request);
  return ffi::Error::Success();
}

ffi::Error ReceiveSignatureNow(int64_t handle, MPI_Comm comm, const char* op, int64_t source,
                               int64_t tag, void* signature) {
  MPI_Comm check;
  JAXCOMM_RETURN_IF_ERROR(FindCheckComm(handle, op, comm, &check));
  JAXCOMM_MPI_CHECK(comm, MPI_Recv, signature, static_cast<int>(kSignatureBytes), MPI_BYTE,
                    static_cast<int>(source), static_cast<int>(tag), check, MPI_STATUS_IGNORE);
  return ffi::Error::Success();
}

ffi::Error CheckSignature(MPI_Comm comm, const void* signature, int64_t source, const char* op,
                          ffi::DataType dtype, int64_t capacity, int64_t site) {
  Signature in;
  std::memcpy(&in, signature, sizeof in);
  if (in.dtype == static_cast<int32_t>(dtype) && in.count <= capacity) {
    return ffi::Error::Success();
  }
  const int rank = CommRank(comm);
  const auto elements = [](int64_t count, int32_t type) {
    return Elements(static_cast<size_t>(count), static_cast<ffi::DataType>(type));
  };
  return Mismatch("jaxcomm: point-to-point mismatch on rank " + std::to_string(rank) + ": rank " +
                  std::to_string(source) + " called " + in.op + " sending " +
                  elements(in.count, in.dtype) + " (tag " + std::to_string(in.tag) + ") at " +
                  in.site + "; rank " + std::to_string(rank) + " called " + op +
                  " receiving up to " + elements(capacity, static_cast<int32_t>(dtype)) + " at " +
                  SiteTextOf(site) + ".");
}

}  // namespace jaxcomm
