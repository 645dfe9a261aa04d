// One handler call: the operation it runs (its row of ops.def), the
// communicator behind its "handle" attribute, and what every handler does
// around its MPI work: announce it to the checker, the watchdog and the
// timeline recorder, log it, and name the operation, the rank and the reason
// when it fails.
#ifndef JAXCOMM_KERNELS_CALL_H_
#define JAXCOMM_KERNELS_CALL_H_

#include <mpi.h>

#include <cstdint>
#include <string>
#include <utility>

#include "debug.h"
#include "errors.h"
#include "handles.h"
#include "memory.h"
#include "monitor.h"
#include "trace.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

namespace ffi = xla::ffi;

class Call {
 public:
  // `op` names the operation in errors, log lines and the checker's reports.
  Call(const char* op, int64_t handle, MPI_Comm comm) : op_(op), handle_(handle), comm_(comm) {}

  const char* op() const { return op_; }
  int64_t handle() const { return handle_; }
  // MPI_COMM_NULL for the calls that reach no communicator through their
  // handle (a wait uses its request's).
  MPI_Comm comm() const { return comm_; }
  int rank() const { return CommRank(comm_); }
  int size() const { return CommSize(comm_); }

  // Tells the checker, the watchdog and the recorder about the collective
  // about to run.
  ffi::Error Announce(const Collective& collective) const {
    if (Tracing()) TraceCollective(Bytes(collective.dtype, collective.count), collective.root);
    if (MonitorFlags() == 0) return ffi::Error::Success();
    return AnnounceCollectiveSlow(handle_, comm_, op_, collective);
  }

  // The same for a point-to-point call; see PointToPoint (monitor.h) for
  // what it may change in `message`, `*source` and `*tag`.
  // The recorder notes the source and tag the checker resolved a wildcard to.
  ffi::Error Announce(PointToPoint& message, int64_t* source, int64_t* tag) const {
    message.op = op_;
    if (MonitorFlags() == 0) {
      if (Tracing()) Trace(message, *source, *tag);
      return ffi::Error::Success();
    }
    ffi::Error announced = AnnouncePointToPointSlow(handle_, comm_, message, source, tag);
    if (Tracing()) Trace(message, *source, *tag);
    return announced;
  }

  // A sendrecv's incoming signature, once its own message is under way.
  ffi::Error ReceiveSignature(PointToPoint& message, int64_t* source, int64_t* tag) const {
    if (!message.signature_pending) return ffi::Error::Success();
    return ReceiveSignatureSlow(handle_, comm_, message, source, tag);
  }

  // Logs the line text() makes, which runs only when the debug log is on.
  template <typename Text>
  void Log(Text&& text) const {
    if (DebugEnabled()) DebugLog(comm_, std::forward<Text>(text)());
  }

  // "jaxcomm: <op> on rank <r>: <why>".
  ffi::Error Invalid(const std::string& why) const { return jaxcomm::Invalid(op_, comm_, why); }

 private:
  // -1 where the count differs by rank; 0 without data (barrier).
  static int64_t Bytes(ffi::DataType dtype, int64_t count) {
    if (dtype == ffi::DataType::INVALID) return 0;
    if (count < 0) return -1;
    return count * static_cast<int64_t>(ffi::ByteWidth(dtype));
  }
  static void Trace(const PointToPoint& message, int64_t source, int64_t tag) {
    TracePointToPoint(message.dest == kNoPeer ? kTraceNoPeer : message.dest, message.sendtag,
                      Bytes(message.dtype, message.count),
                      source == kNoPeer ? kTraceNoPeer : source, tag,
                      Bytes(message.dtype, message.capacity));
  }

  const char* op_;
  int64_t handle_;
  MPI_Comm comm_;
};

// JAXCOMM_MPI_CHECK(call, ...) names the call's rank.
inline ffi::Error MpiFailure(const char* function, int code, const Call& call) {
  return MpiFailure(function, code, call.comm());
}

// Runs the handler body `Impl` for one call of the operation `op`: with the
// communicator behind `handle` where `kOnComm`, else without looking it up.
// The platform layer (handlers.cc) calls it with its Memory.
template <auto Impl, bool kOnComm, typename... Args>
ffi::Error RunCall(const char* op, int64_t handle, Memory& memory, Args&&... args) {
  MPI_Comm comm = MPI_COMM_NULL;
  if constexpr (kOnComm) {
    JAXCOMM_RETURN_IF_ERROR(CommFromHandle(handle, op, &comm));
  }
  return Impl(Call(op, handle, comm), memory, std::forward<Args>(args)...);
}

}  // namespace jaxcomm

#endif  // JAXCOMM_KERNELS_CALL_H_
