// The FFI handlers of ops.def bound for one platform (handlers.h names
// them): the CPU's, compiled into libjaxcomm_core; the CUDA ones, compiled
// with JAXCOMM_CUDA into libjaxcomm_cuda; the emulated CUDA runtime's
// (tests/cuda_emulation), into that test module. None of them links Python
// or depends on its version; the pybind11 modules (module.cc) only hand
// their addresses to JAX.
#include "handlers.h"

#include <chrono>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "monitor.h"
#include "trace.h"
#ifdef JAXCOMM_CUDA
#include "cuda_memory.h"
#endif

namespace {

// The handler XLA calls for the body `Impl` of the operation `op`: on a GPU
// it takes the stream first, then every target takes the call site (the
// "site" attribute, for the checker and the watchdog) and the communicator
// (the "handle" attribute), then the buffers and attributes of its row of
// ops.def. It runs the body with this platform's Memory (RunCall, call.h),
// as one span of the timeline when the recorder is on (trace.h).
// The emulated CUDA module (tests/cuda_emulation) runs the CUDA platform
// layer on XLA's CPU, which has no stream.
#ifdef JAXCOMM_CUDA
// Runs one handler call on the handler clock (HandlerClock, cuda_memory.h):
// the whole call, the CudaMemory's destructor included.
template <typename Body>
xla::ffi::Error Timed(Body&& body) {
  const auto start = std::chrono::steady_clock::now();
  xla::ffi::Error error = body();
  jaxcomm::AddHandlerTime(static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count()));
  return error;
}
#endif

#if defined(JAXCOMM_CUDA_EMULATION)
template <auto Impl, bool kOnComm>
struct OnPlatform {
  const char* op;
  template <typename... Args>
  xla::ffi::Error operator()(int64_t site, int64_t handle, Args... args) const {
    return Timed([&] {
      jaxcomm::CallScope scope(site, op);
      jaxcomm::TraceScope traced(op, site, handle);
      jaxcomm::CudaMemory memory(nullptr);
      xla::ffi::Error error =
          jaxcomm::Outcome(jaxcomm::RunCall<Impl, kOnComm>(op, handle, memory, args...));
      traced.Failed(error.failure());
      return error;
    });
  }
};
auto PlatformBinding() { return xla::ffi::Ffi::Bind(); }
#elif defined(JAXCOMM_CUDA)
template <auto Impl, bool kOnComm>
struct OnPlatform {
  const char* op;
  template <typename... Args>
  xla::ffi::Error operator()(cudaStream_t stream, int64_t site, int64_t handle,
                             Args... args) const {
    return Timed([&] {
      jaxcomm::CallScope scope(site, op);
      jaxcomm::TraceScope traced(op, site, handle);
      jaxcomm::CudaMemory memory(stream);
      xla::ffi::Error error =
          jaxcomm::Outcome(jaxcomm::RunCall<Impl, kOnComm>(op, handle, memory, args...));
      traced.Failed(error.failure());
      return error;
    });
  }
};
auto PlatformBinding() {
  return xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t> >();
}
#else
template <auto Impl, bool kOnComm>
struct OnPlatform {
  const char* op;
  template <typename... Args>
  xla::ffi::Error operator()(int64_t site, int64_t handle, Args... args) const {
    jaxcomm::CallScope scope(site, op);
    jaxcomm::TraceScope traced(op, site, handle);
    jaxcomm::HostMemory memory;
    xla::ffi::Error error =
        jaxcomm::Outcome(jaxcomm::RunCall<Impl, kOnComm>(op, handle, memory, args...));
    traced.Failed(error.failure());
    return error;
  }
};
auto PlatformBinding() { return xla::ffi::Ffi::Bind(); }
#endif

// The attributes every target takes first, in this order.
auto SharedBinding() { return PlatformBinding().Attr<int64_t>("site").Attr<int64_t>("handle"); }

}  // namespace

#define JAXCOMM_OP(name, label, Name, buffers, attributes)                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                               \
      JAXCOMM_HANDLER(Name),                                                   \
      (OnPlatform<&jaxcomm::Name##Impl, JAXCOMM_##buffers##_ON_COMM>{#label}), \
      jaxcomm::bindings::Name(SharedBinding()));
#include "ops.def"
#undef JAXCOMM_OP

#ifndef JAXCOMM_CUDA
// Not an operation: the zero that the zeros an op returns off root are
// broadcast from (ops/_base.py, _zeros_after). It takes the token of the
// call before it, so XLA computes those zeros after that call and cannot
// fold them into a constant. CPU only.
namespace {
xla::ffi::Error ZeroAfterImpl(xla::ffi::Token, xla::ffi::Result<xla::ffi::AnyBuffer> out) {
  std::memset(out->untyped_data(), 0, out->size_bytes());
  return xla::ffi::Error::Success();
}
}  // namespace
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxcommZeroAfter, ZeroAfterImpl,
    xla::ffi::Ffi::Bind().Arg<xla::ffi::Token>().Ret<xla::ffi::AnyBuffer>());
#endif
