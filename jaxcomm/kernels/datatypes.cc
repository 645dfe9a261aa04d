#include "datatypes.h"

#include <string>

namespace jaxcomm {

const char* DtypeName(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::PRED:
      return "bool";
    case ffi::DataType::S8:
      return "int8";
    case ffi::DataType::S16:
      return "int16";
    case ffi::DataType::S32:
      return "int32";
    case ffi::DataType::S64:
      return "int64";
    case ffi::DataType::U8:
      return "uint8";
    case ffi::DataType::U16:
      return "uint16";
    case ffi::DataType::U32:
      return "uint32";
    case ffi::DataType::U64:
      return "uint64";
    case ffi::DataType::F16:
      return "float16";
    case ffi::DataType::BF16:
      return "bfloat16";
    case ffi::DataType::F32:
      return "float32";
    case ffi::DataType::F64:
      return "float64";
    case ffi::DataType::C64:
      return "complex64";
    case ffi::DataType::C128:
      return "complex128";
    default:
      return "unsupported";
  }
}

ffi::Error MpiDatatype(ffi::DataType dtype, MPI_Datatype* out) {
  switch (dtype) {
    case ffi::DataType::PRED:
      *out = MPI_C_BOOL;
      break;
    case ffi::DataType::S8:
      *out = MPI_INT8_T;
      break;
    case ffi::DataType::S16:
      *out = MPI_INT16_T;
      break;
    case ffi::DataType::S32:
      *out = MPI_INT32_T;
      break;
    case ffi::DataType::S64:
      *out = MPI_INT64_T;
      break;
    case ffi::DataType::U8:
      *out = MPI_UINT8_T;
      break;
    case ffi::DataType::U16:
      *out = MPI_UINT16_T;
      break;
    case ffi::DataType::U32:
      *out = MPI_UINT32_T;
      break;
    case ffi::DataType::U64:
      *out = MPI_UINT64_T;
      break;
    case ffi::DataType::F16:
      *out = MPI_UINT16_T;
      break;
    case ffi::DataType::BF16:
      *out = MPI_UINT16_T;
      break;
    case ffi::DataType::F32:
      *out = MPI_FLOAT;
      break;
    case ffi::DataType::F64:
      *out = MPI_DOUBLE;
      break;
    case ffi::DataType::C64:
      *out = MPI_C_FLOAT_COMPLEX;
      break;
    case ffi::DataType::C128:
      *out = MPI_C_DOUBLE_COMPLEX;
      break;
    default:
      return ffi::Error::InvalidArgument("jaxcomm: element type " +
                                         std::to_string(static_cast<int>(dtype)) +
                                         " has no MPI datatype");
  }
  return ffi::Error::Success();
}

std::string Elements(size_t count, ffi::DataType dtype) {
  return "count " + std::to_string(count) + " " + DtypeName(dtype);
}

}  // namespace jaxcomm
