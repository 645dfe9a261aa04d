#include "errors.h"

#include <atomic>
#include <cstdio>
#include <mutex>
#include <utility>

#include "handles.h"

namespace jaxcomm {

ffi::Error MpiFailure(const char* function, int code, MPI_Comm comm) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) {
    length = std::snprintf(text, sizeof text, "MPI error code %d", code);
  }
  return ffi::Error::Internal(std::string("jaxcomm: ") + function + " failed on rank " +
                              std::to_string(CommRank(comm)) + ": " + std::string(text, length));
}

ffi::Error Invalid(const char* op, MPI_Comm comm, const std::string& why) {
  return ffi::Error::InvalidArgument(std::string("jaxcomm: ") + op + " on rank " +
                                     std::to_string(CommRank(comm)) + ": " + why);
}

namespace {
std::atomic<bool> error_recorded{false};
std::mutex error_mutex;
std::string recorded_error;
}  // namespace

ffi::Error Recorded(ffi::Error error) {
  if (error.failure()) {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (!error_recorded.load(std::memory_order_relaxed)) {
      recorded_error = error.message();
      error_recorded.store(true, std::memory_order_release);
    }
  }
  return error;
}

namespace {
std::atomic<bool (*)()> python_thread_probe{nullptr};
}  // namespace

void SetPythonThreadProbe(bool (*on_python_thread)()) {
  python_thread_probe.store(on_python_thread, std::memory_order_release);
}

ffi::Error Outcome(ffi::Error error) {
  if (!error.failure()) return error;
  bool (*on_python_thread)() = python_thread_probe.load(std::memory_order_acquire);
  if (on_python_thread != nullptr && on_python_thread()) return error;
  return Recorded(std::move(error));
}

bool TakeRecordedError(std::string* message) {
  if (!error_recorded.load(std::memory_order_acquire)) return false;
  std::lock_guard<std::mutex> lock(error_mutex);
  if (!error_recorded.load(std::memory_order_relaxed)) return false;
  *message = std::move(recorded_error);
  recorded_error.clear();
  error_recorded.store(false, std::memory_order_relaxed);
  return true;
}

bool ForgetRecordedError(const std::string& delivered) {
  if (!error_recorded.load(std::memory_order_acquire)) return false;
  std::lock_guard<std::mutex> lock(error_mutex);
  if (!error_recorded.load(std::memory_order_relaxed) ||
      delivered.find(recorded_error) == std::string::npos) {
    return false;
  }
  recorded_error.clear();
  error_recorded.store(false, std::memory_order_relaxed);
  return true;
}

}  // namespace jaxcomm
