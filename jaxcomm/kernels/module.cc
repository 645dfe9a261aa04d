// The pybind11 module jaxcomm._kernels_cpu: the FFI handlers listed in
// ops.def, and the switches the Python package needs.
#include <pybind11/pybind11.h>

#include "common.h"

#define JAXCOMM_OP(name, symbol) XLA_FFI_DECLARE_HANDLER_SYMBOL(symbol);
#include "ops.def"
#undef JAXCOMM_OP

namespace py = pybind11;

PYBIND11_MODULE(_kernels_cpu, m) {
  m.doc() = "jaxcomm CPU kernels (XLA FFI handlers calling MPI).";
  m.def("registrations", []() {
    py::dict targets;
#define JAXCOMM_OP(name, symbol) \
  targets["jaxcomm_" #name] = py::capsule(reinterpret_cast<void*>(symbol));
#include "ops.def"
#undef JAXCOMM_OP
    return targets;
  });
  m.def("set_debug", &jaxcomm::SetDebug, py::arg("enabled"),
        "Turn the one-line-per-MPI-call log on stderr on or off.");
  m.def("debug_enabled", &jaxcomm::DebugEnabled);
  m.def("set_max_count", &jaxcomm::SetMaxCount, py::arg("count"),
        "Cap the count of one MPI call (tests use small caps to exercise the "
        "large-message paths).");
  m.def("max_count", &jaxcomm::MaxCount);
}
