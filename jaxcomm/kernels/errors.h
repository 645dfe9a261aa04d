// How the handlers fail: the MPI error check, the error for arguments that do
// not fit together, and the slot that keeps a failure until Python asks.
#ifndef JAXCOMM_KERNELS_ERRORS_H_
#define JAXCOMM_KERNELS_ERRORS_H_

#include <mpi.h>

#include <string>

#include "xla/ffi/api/ffi.h"

// Propagates a failed ffi::Error.
#define JAXCOMM_RETURN_IF_ERROR(expr)        \
  do {                                       \
    ::xla::ffi::Error jaxcomm_err_ = (expr); \
    if (jaxcomm_err_.failure()) {            \
      return jaxcomm_err_;                   \
    }                                        \
  } while (0)

// Runs an MPI call and returns an ffi::Error naming it, the rank and MPI's
// error string when it fails. `where` is what the rank is taken from: an
// MPI_Comm, or the Call a handler is in (call.h).
#define JAXCOMM_MPI_CHECK(where, function, ...)                    \
  do {                                                             \
    int jaxcomm_rc_ = function(__VA_ARGS__);                       \
    if (jaxcomm_rc_ != MPI_SUCCESS) {                              \
      return ::jaxcomm::MpiFailure(#function, jaxcomm_rc_, where); \
    }                                                              \
  } while (0)

namespace jaxcomm {

namespace ffi = xla::ffi;

// The error of a failed MPI call: "jaxcomm: <function> failed on rank <r>:
// <MPI's error string>".
ffi::Error MpiFailure(const char* function, int code, MPI_Comm comm);

// The error for arguments of `op` that do not fit together:
// "jaxcomm: <op> on rank <r>: <why>".
ffi::Error Invalid(const char* op, MPI_Comm comm, const std::string& why);

// The process-wide slot for the first failure of a handler not yet reported
// to Python. XLA drops the error of a computation that has no outputs and
// runs after its dispatch returned, so every failure is kept here until
// jaxcomm.sync() or the exit hook raises it, or JAX raises it to the program
// from the computation's results (ForgetRecordedError).
// Returns `error` unchanged.
ffi::Error Recorded(ffi::Error error);

// A handler's result. When XLA runs a computation on the Python thread that
// dispatched it (inline), a failure fails that very call and JAX raises it
// to the caller, who has it then. A failure on one of XLA's own threads may
// reach nobody (a computation without outputs, outputs never read), so it is
// Recorded for jaxcomm.sync() and the exit hook.
ffi::Error Outcome(ffi::Error error);

// How Outcome tells a Python thread from one of XLA's: the kernels
// libraries link no Python (one build serves every Python version), so the
// Python module that loads them hands in the test at import. Until then
// every failure is recorded.
void SetPythonThreadProbe(bool (*on_python_thread)());

// Moves the recorded failure's message into `message`, emptying the slot;
// false if there is none.
bool TakeRecordedError(std::string* message);

// Empties the slot if the recorded failure's message is part of `delivered`,
// the text of an error JAX has handed to the program: a failure the program
// was given is its own. True if it did.
bool ForgetRecordedError(const std::string& delivered);

}  // namespace jaxcomm

#endif  // JAXCOMM_KERNELS_ERRORS_H_
