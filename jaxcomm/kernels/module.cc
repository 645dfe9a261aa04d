// The pybind11 modules jaxcomm._kernels_cpu and, compiled with JAXCOMM_CUDA,
// jaxcomm._kernels_cuda: the addresses of the FFI handlers listed in ops.def
// for one platform (handlers.cc, in the kernels libraries), their
// attributes, and the switches the Python package needs. The CPU module also
// owns the registry of live communicators; both modules share it, with every
// other piece of state, through libjaxcomm_core. Only this file depends on
// the Python version.
#include <pybind11/pybind11.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"
#include "debug.h"
#include "handlers.h"
#include "handles.h"
#include "monitor.h"
#include "nonblocking.h"
#include "peers.h"
#include "reduce_ops.h"
#include "trace.h"
#ifdef JAXCOMM_CUDA
#include "cuda_memory.h"
#endif

namespace py = pybind11;

namespace {

#ifndef JAXCOMM_CUDA
void ThrowIfError(const xla::ffi::Error& error) {
  if (error.failure()) throw std::runtime_error(error.message());
}

// The status the process ends with, set by jaxcomm's exit hook when it
// reports a failure. Python fixes its own exit status before it runs exit
// hooks, so the status is applied from C's exit(), once Python and MPI are
// finalised.
int exit_status = 0;

// Calling exit() again from an exit handler is undefined, hence _Exit, which
// also skips the handlers registered before this one (destructors of loaded
// libraries, the peer watch's goodbye, said here instead); MPI is finalised
// by then.
void ExitWithStatus() {
  jaxcomm::SayGoodbye(exit_status);
  std::fflush(nullptr);
  std::_Exit(exit_status);
}
#endif

}  // namespace

#if defined(JAXCOMM_CUDA_EMULATION)
#define JAXCOMM_MODULE _kernels_cuda_emulated
long EmulatedHostAllocations();
long EmulatedLiveHostAllocations();
void EmulatedHoldEvents(bool pending);
#elif defined(JAXCOMM_CUDA)
#define JAXCOMM_MODULE _kernels_cuda
#else
#define JAXCOMM_MODULE _kernels_cpu
#endif

PYBIND11_MODULE(JAXCOMM_MODULE, m) {
#ifdef JAXCOMM_CUDA
  m.doc() = "jaxcomm CUDA kernels (XLA FFI handlers calling MPI).";
#else
  m.doc() = "jaxcomm CPU kernels (XLA FFI handlers calling MPI).";
#endif
  // A failure on one of XLA's threads is kept for sync() and the exit hook,
  // one on the dispatching Python thread is raised there (Outcome, errors.h).
  jaxcomm::SetPythonThreadProbe([] { return PyGILState_GetThisThreadState() != nullptr; });
  m.def("registrations", []() {
    py::dict targets;
#define JAXCOMM_OP(name, label, Name, buffers, attributes) \
  targets["jaxcomm_" #name] = py::capsule(reinterpret_cast<void*>(JAXCOMM_HANDLER(Name)));
#include "ops.def"
#undef JAXCOMM_OP
    return targets;
  });
  m.def(
      "attributes",
      []() {
        py::dict targets;
#define I64(name) attrs.append(py::make_tuple(#name, "int64"));
#define I64S(name) attrs.append(py::make_tuple(#name, "int64[]"));
#define JAXCOMM_OP(name, label, Name, buffers, attributes)   \
  {                                                          \
    py::list attrs;                                          \
    I64(site)                                                \
    I64(handle)                                              \
    attributes targets["jaxcomm_" #name] = py::tuple(attrs); \
  }
#include "ops.def"
#undef JAXCOMM_OP
#undef I64S
#undef I64
        return targets;
      },
      "{target: ((attribute, type), ...)} as the handlers bind them, the "
      "call site and the communicator first; type is 'int64' or 'int64[]'.");
#ifdef JAXCOMM_CUDA
  m.def("mpi_cuda_support", &jaxcomm::MpiCudaSupport,
        "What the MPI library says about device buffers: 1 CUDA-aware, 0 not, "
        "-1 it has no way to say.");
  m.def("set_cuda_aware", &jaxcomm::SetCudaAware, py::arg("mode"),
        "Data path of device buffers: 1 straight to MPI, 0 host staging, -1 "
        "as the MPI library says (the default).");
  m.def("cuda_aware", &jaxcomm::CudaAware, "Whether device buffers go straight to MPI now.");
  m.def(
      "handler_clock",
      []() {
        const jaxcomm::HandlerTimes times = jaxcomm::HandlerClock();
        return py::make_tuple(times.calls, times.handler_ns, times.wait_ns);
      },
      "(calls, ns in handlers, ns of it waiting for the GPU) since the last reset.");
  m.def("reset_handler_clock", &jaxcomm::ResetHandlerClock, "Zero the handler clock.");
  m.def("staging_bytes", &jaxcomm::StagingBytes, "Pinned host memory held for staging, in bytes.");
  m.def("free_staging", &jaxcomm::FreeStaging,
        "Release the pinned staging memory no call or request is using.");
  m.def("staging_held", &jaxcomm::StagingHeld,
        "Pinned staging blocks nonblocking requests hold now (from their "
        "start to their wait).");
#ifdef JAXCOMM_CUDA_EMULATION
  m.def("host_allocations", &EmulatedHostAllocations,
        "Pinned allocations made so far (emulated runtime).");
  m.def("live_host_allocations", &EmulatedLiveHostAllocations,
        "Pinned allocations not yet freed (emulated runtime).");
  m.def("hold_events", &EmulatedHoldEvents, py::arg("pending"),
        "While true, cudaEventQuery reports every event as not reached "
        "(emulated runtime: work still queued on the stream).");
#endif
#else
  m.def(
      "zero_after", []() { return py::capsule(reinterpret_cast<void*>(JaxcommZeroAfter)); },
      "The FFI handler of jaxcomm_zero_after: a token in, a zero-filled result out.");
  m.def(
      "register_comm",
      [](int64_t fortran_handle) {
        int64_t handle;
        ThrowIfError(jaxcomm::RegisterComm(fortran_handle, &handle));
        return handle;
      },
      py::arg("fortran_handle"),
      "Make a communicator known to the kernels; returns its 'handle' "
      "attribute value.");
  m.def("unregister_comm", &jaxcomm::UnregisterComm, py::arg("handle"),
        "Make the kernels refuse a 'handle' attribute value from now on.");
  m.def(
      "fortran_handle",
      [](int64_t handle) { return static_cast<int64_t>(jaxcomm::FortranHandle(handle)); },
      py::arg("handle"), "The Fortran handle inside a 'handle' attribute value.");
  m.def(
      "reduce_op",
      [](int64_t code, const std::string& dtype) {
        namespace ffi = xla::ffi;
        for (ffi::DataType type :
             {ffi::DataType::S8, ffi::DataType::S16, ffi::DataType::S32, ffi::DataType::S64,
              ffi::DataType::U8, ffi::DataType::U16, ffi::DataType::U32, ffi::DataType::U64,
              ffi::DataType::F16, ffi::DataType::BF16, ffi::DataType::F32, ffi::DataType::F64,
              ffi::DataType::C64, ffi::DataType::C128, ffi::DataType::PRED}) {
          if (dtype == jaxcomm::DtypeName(type)) {
            MPI_Op op;
            ThrowIfError(jaxcomm::MpiReduceOp(code, type, MPI_COMM_WORLD, &op));
            return static_cast<int64_t>(jaxcomm::OpToInt(op));
          }
        }
        throw std::invalid_argument("jaxcomm: no MPI datatype for " + dtype);
      },
      py::arg("code"), py::arg("dtype"),
      "The Fortran handle of the MPI_Op the kernels reduce a dtype (NumPy's "
      "name) with for a reduction code: MPI's own or one of jaxcomm's.");
  m.def(
      "dup_watched",
      [](int64_t fortran_handle, int64_t site) {
        MPI_Comm comm = jaxcomm::CommFromInt(static_cast<jaxcomm::IntHandle>(fortran_handle));
        MPI_Comm dup = MPI_COMM_NULL;
        int rc;
        {
          py::gil_scoped_release release;
          jaxcomm::CallScope scope(site, "JaxComm creation (MPI_Comm_dup)");
          if (jaxcomm::Watching()) {
            jaxcomm::Watch("JaxComm creation (MPI_Comm_dup, collective) at " +
                           jaxcomm::SiteText(site) + " on a communicator of " +
                           std::to_string(jaxcomm::CommSize(comm)) + " ranks (rank " +
                           std::to_string(jaxcomm::CommRank(comm)) + " there)");
          }
          rc = MPI_Comm_dup(comm, &dup);
        }
        if (rc != MPI_SUCCESS) {
          ThrowIfError(jaxcomm::MpiFailure("MPI_Comm_dup", rc, comm));
        }
        return static_cast<int64_t>(jaxcomm::CommToInt(dup));
      },
      py::arg("fortran_handle"), py::arg("site"),
      "MPI_Comm_dup of a communicator (Fortran handles), as a call of its "
      "own that the watchdog and interrupts see, made at a call site's id.");
  m.def("set_debug", &jaxcomm::SetDebug, py::arg("enabled"),
        "Turn the one-line-per-MPI-call log on stderr on or off.");
  m.def("debug_enabled", &jaxcomm::DebugEnabled);
  m.def(
      "take_error",
      []() -> py::object {
        std::string message;
        if (!jaxcomm::TakeRecordedError(&message)) return py::none();
        return py::str(message);
      },
      "The first failure of a handler not yet reported (emptying the slot), "
      "or None.");
  m.def("forget_error", &jaxcomm::ForgetRecordedError, py::arg("delivered"),
        "Empty the slot if its failure is part of the text of an error the "
        "program was given; true if it was.");
  m.def("register_site", &jaxcomm::RegisterSite, py::arg("text"),
        "The id of a call site's text, the 'site' attribute of its calls.");
  m.def("set_check", &jaxcomm::SetCheck, py::arg("enabled"),
        "Turn the collective mismatch checker on or off.");
  m.def("set_timeout", &jaxcomm::SetTimeout, py::arg("seconds"),
        "Abort the job when one call takes longer (0: no watchdog).");
  m.def(
      "watch_peers",
      [](const py::list& fds, const py::list& ranks, const py::list& hosts, const std::string& me) {
        std::vector<int> fd_list;
        std::vector<int> rank_list;
        std::vector<std::string> host_list;
        for (size_t i = 0; i < fds.size(); ++i) {
          fd_list.push_back(fds[i].cast<int>());
          rank_list.push_back(ranks[i].cast<int>());
          host_list.push_back(hosts[i].cast<std::string>());
        }
        jaxcomm::WatchPeers(fd_list, rank_list, host_list, me);
        // Said after MPI_Finalize, which Python's exit makes before C's
        // exit handlers run; a status that is not 0 there ends the job.
        static bool registered = false;
        if (!registered) {
          registered = true;
          on_exit([](int status, void*) { jaxcomm::SayGoodbye(status); }, nullptr);
        }
      },
      py::arg("fds"), py::arg("ranks"), py::arg("hosts"), py::arg("me"),
      "Watch connected sockets to peer ranks (world ranks, host names) from a "
      "thread of the library; `me` names this rank in reports. Once.");
  m.def("set_peer_silence", &jaxcomm::SetPeerSilence, py::arg("seconds"),
        "Seconds without a byte from a watched peer before it counts as unreachable.");
  m.def("set_announce_failures", &jaxcomm::SetAnnounceFailures, py::arg("enabled"),
        "Whether a non-zero exit status is announced to the peers as a failure.");
  m.def(
      "interface_addresses",
      []() {
        py::list out;
        for (const std::string& address : jaxcomm::InterfaceAddresses()) out.append(address);
        return out;
      },
      "This host's IPv4 interface addresses, loopback last.");
  m.def(
      "abort_or_exit",
      [](int status) {
        py::gil_scoped_release release;
        jaxcomm::AbortOrExit(status);
      },
      py::arg("status"),
      "MPI_Abort on MPI_COMM_WORLD; where it returns, end this process with "
      "`status` after a bounded wait. Never returns.");
  m.def("calls_in_flight", &jaxcomm::CallsInFlight, "How many handler calls are running now.");
  m.def("latest_site", &jaxcomm::LatestSite, "The call site of the latest handler call to start.");
  m.def("monitor_flags", &jaxcomm::MonitorFlags, "1: checking calls, 2: watching them (bits).");
  m.def(
      "start_trace",
      [](const std::string& path) {
        const std::string error = jaxcomm::StartTrace(path);
        if (!error.empty()) throw std::runtime_error("jaxcomm: trace: " + error);
      },
      py::arg("path"), "Record every handler call's span to the file `path` (trace.h).");
  m.def("stop_trace", &jaxcomm::StopTrace, "Write the recorded spans and close the trace file.");
  m.def("flush_trace", &jaxcomm::FlushTrace, "Write the spans recorded so far.");
  m.def("tracing", &jaxcomm::Tracing, "Whether the timeline recorder is on.");
  m.def("trace_now", &jaxcomm::TraceNow, "The recorder's clock, in nanoseconds.");
  m.def(
      "set_check_comm",
      [](int64_t handle, int64_t check) {
        jaxcomm::SetCheckComm(handle, static_cast<jaxcomm::IntHandle>(check));
      },
      py::arg("handle"), py::arg("check"),
      "The checker's private communicator (Fortran handle) for a 'handle' "
      "attribute value; MPI_COMM_NULL's forgets it.");
  m.def(
      "exit_with_status",
      [](int status) {
        if (exit_status == 0 && status != 0 && std::atexit(ExitWithStatus) == 0) {
          exit_status = status;
        }
      },
      py::arg("status"),
      "End the process with a non-zero status once Python and MPI are "
      "finalised, whatever status Python ends with; the first one set holds.");
  m.def(
      "unfinished_requests",
      []() {
        py::list out;
        for (const jaxcomm::UnfinishedRequest& r : jaxcomm::UnfinishedRequests()) {
          out.append(py::make_tuple(r.slot, r.serial, r.text));
        }
        return out;
      },
      "Nonblocking requests started and not completed by a wait, not yet "
      "reported: [(slot, serial, description)].");
  m.def("mark_request_reported", &jaxcomm::MarkRequestReported, py::arg("slot"), py::arg("serial"),
        "Leave a request out of unfinished_requests() from now on.");
  m.def("set_max_count", &jaxcomm::SetMaxCount, py::arg("count"),
        "Cap the count of one MPI call (tests use small caps to exercise the "
        "large-message paths).");
  m.def("max_count", &jaxcomm::MaxCount);
  m.def("set_pipeline_bytes", &jaxcomm::SetPipelineBytes, py::arg("bytes"),
        "Piece size of pipelined collectives in bytes (0: whole messages).");
  m.def("pipeline_bytes", &jaxcomm::PipelineBytes);
  m.def("set_huge_page_bytes", &jaxcomm::SetHugePageBytes, py::arg("bytes"),
        "Host buffers of at least this many bytes go on transparent huge pages (0: none).");
  m.def("huge_page_bytes", &jaxcomm::HugePageBytes);
  m.def(
      "huge_page_advice",
      [] {
        const jaxcomm::HugePageCounts c = jaxcomm::HugePageAdvice();
        py::dict d;
        d["page_size"] = c.page_size;
        d["page_size_errno"] = c.page_size_errno;
        d["advised"] = c.advised;
        d["refused"] = c.refused;
        d["last_errno"] = c.last_errno;
        d["collapsed"] = c.collapsed;
        d["collapse_stopped"] = c.collapse_stopped;
        d["advised_ends"] = c.advised_ends;
        return d;
      },
      "What the huge-page advice has done in this process: the transparent huge "
      "page size (0: none, nothing advised; page_size_errno: why), "
      "madvise(MADV_HUGEPAGE) calls that "
      "succeeded and were refused (last_errno: the last refusal's), ranges "
      "MADV_COLLAPSE moved, whether refusals stopped MADV_COLLAPSE, and "
      "advised_ends: the ranges of buffers' ends advised (a buffer seen again).");
#endif
}
