// The pybind11 module jaxcomm._kernels_cpu: the FFI handlers listed in
// ops.def, their attributes, the registry of live communicators and the
// switches the Python package needs.
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "common.h"

#define JAXCOMM_OP(name, symbol, buffers, attributes) \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(symbol);
#include "ops.def"
#undef JAXCOMM_OP

namespace py = pybind11;

namespace {

void ThrowIfError(const xla::ffi::Error& error) {
  if (error.failure()) throw std::runtime_error(error.message());
}

}  // namespace

PYBIND11_MODULE(_kernels_cpu, m) {
  m.doc() = "jaxcomm CPU kernels (XLA FFI handlers calling MPI).";
  m.def("registrations", []() {
    py::dict targets;
#define JAXCOMM_OP(name, symbol, buffers, attributes) \
  targets["jaxcomm_" #name] = py::capsule(reinterpret_cast<void*>(symbol));
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
#define JAXCOMM_OP(name, symbol, buffers, attributes) \
  {                                                   \
    py::list attrs;                                   \
    attributes                                        \
    targets["jaxcomm_" #name] = py::tuple(attrs);     \
  }
#include "ops.def"
#undef JAXCOMM_OP
#undef I64S
#undef I64
        return targets;
      },
      "{target: ((attribute, type), ...)} as the handlers bind them; type is "
      "'int64' or 'int64[]'.");
  m.def(
      "register_comm",
      [](int64_t fortran_handle) {
        int64_t handle;
        ThrowIfError(jaxcomm::RegisterComm(fortran_handle, &handle));
        return handle;
      },
      py::arg("fortran_handle"),
      "Make a communicator known to the kernels; returns its 'comm' "
      "attribute value.");
  m.def("unregister_comm", &jaxcomm::UnregisterComm, py::arg("handle"),
        "Make the kernels refuse a 'comm' attribute value from now on.");
  m.def(
      "fortran_handle",
      [](int64_t handle) {
        return static_cast<int64_t>(jaxcomm::FortranHandle(handle));
      },
      py::arg("handle"), "The Fortran handle inside a 'comm' attribute value.");
  m.def(
      "reduce_op",
      [](int64_t code, const std::string& dtype) {
        namespace ffi = xla::ffi;
        for (ffi::DataType type :
             {ffi::DataType::S8, ffi::DataType::S16, ffi::DataType::S32,
              ffi::DataType::S64, ffi::DataType::U8, ffi::DataType::U16,
              ffi::DataType::U32, ffi::DataType::U64, ffi::DataType::F16,
              ffi::DataType::BF16, ffi::DataType::F32, ffi::DataType::F64,
              ffi::DataType::C64, ffi::DataType::C128, ffi::DataType::PRED}) {
          if (dtype == jaxcomm::DtypeName(type)) {
            MPI_Op op;
            ThrowIfError(jaxcomm::MpiReduceOp(code, type, MPI_COMM_WORLD, &op));
            return static_cast<int64_t>(MPI_Op_c2f(op));
          }
        }
        throw std::invalid_argument("jaxcomm: no MPI datatype for " + dtype);
      },
      py::arg("code"), py::arg("dtype"),
      "The Fortran handle of the MPI_Op the kernels reduce a dtype (NumPy's "
      "name) with for a reduction code: MPI's own or one of jaxcomm's.");
  m.def("set_debug", &jaxcomm::SetDebug, py::arg("enabled"),
        "Turn the one-line-per-MPI-call log on stderr on or off.");
  m.def("debug_enabled", &jaxcomm::DebugEnabled);
  m.def("set_max_count", &jaxcomm::SetMaxCount, py::arg("count"),
        "Cap the count of one MPI call (tests use small caps to exercise the "
        "large-message paths).");
  m.def("max_count", &jaxcomm::MaxCount);
}
