#include "common.h"

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace jaxcomm {
namespace {

std::atomic<bool> debug_enabled{false};

float Bf16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((bits >> 16) | 0x40u);  // keep NaN quiet
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t FloatToF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  bits &= 0x7fffffffu;
  if (bits >= 0x7f800000u) {  // inf or NaN
    return sign | (bits > 0x7f800000u ? 0x7e00u : 0x7c00u);
  }
  if (bits >= 0x477ff000u) {  // rounds past the largest half (65504)
    return sign | 0x7c00u;
  }
  if (bits < 0x38800000u) {  // below 2**-14: a half subnormal or zero
    float magnitude;
    std::memcpy(&magnitude, &bits, sizeof magnitude);
    return sign | static_cast<uint16_t>(std::nearbyint(magnitude * 16777216.0f));
  }
  // Rebias the exponent and round the 13 dropped bits to nearest even; a
  // mantissa carry moves into the exponent, as it should.
  bits += 0xc8000fffu + ((bits >> 13) & 1u);
  return sign | static_cast<uint16_t>(bits >> 13);
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float), typename Fn>
void HalfApply(void* in, void* inout, int* len, Fn fn) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    b[i] = FromFloat(fn(ToFloat(a[i]), ToFloat(b[i])));
  }
}

float Add(float a, float b) { return a + b; }
float Mul(float a, float b) { return a * b; }
float Min(float a, float b) { return std::fmin(a, b); }
float Max(float a, float b) { return std::fmax(a, b); }

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float),
          float (*Fn)(float, float)>
void HalfUserFunction(void* in, void* inout, int* len, MPI_Datatype*) {
  HalfApply<ToFloat, FromFloat>(in, inout, len, Fn);
}

// User-defined ops, [0] float16 and [1] bfloat16, indexed by the arithmetic
// ReduceOp codes SUM, PROD, MIN, MAX. Created on first use because MPI must
// be initialised first; MPI_Finalize releases them.
MPI_Op half_ops[2][4];
std::once_flag half_ops_once;

void CreateHalfOps() {
  MPI_User_function* functions[2][4] = {
      {HalfUserFunction<F16ToFloat, FloatToF16, Add>,
       HalfUserFunction<F16ToFloat, FloatToF16, Mul>,
       HalfUserFunction<F16ToFloat, FloatToF16, Min>,
       HalfUserFunction<F16ToFloat, FloatToF16, Max>},
      {HalfUserFunction<Bf16ToFloat, FloatToBf16, Add>,
       HalfUserFunction<Bf16ToFloat, FloatToBf16, Mul>,
       HalfUserFunction<Bf16ToFloat, FloatToBf16, Min>,
       HalfUserFunction<Bf16ToFloat, FloatToBf16, Max>},
  };
  for (int t = 0; t < 2; ++t) {
    for (int o = 0; o < 4; ++o) {
      MPI_Op_create(functions[t][o], /*commute=*/1, &half_ops[t][o]);
    }
  }
}

}  // namespace

const char* DtypeName(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::C64: return "complex64";
    case ffi::DataType::C128: return "complex128";
    default: return "unsupported";
  }
}

ffi::Error MpiDatatype(ffi::DataType dtype, MPI_Datatype* out) {
  switch (dtype) {
    case ffi::DataType::PRED: *out = MPI_C_BOOL; break;
    case ffi::DataType::S8: *out = MPI_INT8_T; break;
    case ffi::DataType::S16: *out = MPI_INT16_T; break;
    case ffi::DataType::S32: *out = MPI_INT32_T; break;
    case ffi::DataType::S64: *out = MPI_INT64_T; break;
    case ffi::DataType::U8: *out = MPI_UINT8_T; break;
    case ffi::DataType::U16: *out = MPI_UINT16_T; break;
    case ffi::DataType::U32: *out = MPI_UINT32_T; break;
    case ffi::DataType::U64: *out = MPI_UINT64_T; break;
    case ffi::DataType::F16: *out = MPI_UINT16_T; break;
    case ffi::DataType::BF16: *out = MPI_UINT16_T; break;
    case ffi::DataType::F32: *out = MPI_FLOAT; break;
    case ffi::DataType::F64: *out = MPI_DOUBLE; break;
    case ffi::DataType::C64: *out = MPI_C_FLOAT_COMPLEX; break;
    case ffi::DataType::C128: *out = MPI_C_DOUBLE_COMPLEX; break;
    default:
      return ffi::Error::InvalidArgument(
          "jaxcomm: element type " +
          std::to_string(static_cast<int>(dtype)) + " has no MPI datatype");
  }
  return ffi::Error::Success();
}

const char* ReduceOpName(int64_t code) {
  static const char* names[] = {"SUM",  "PROD", "MIN",  "MAX",  "LAND",
                                "LOR",  "LXOR", "BAND", "BOR",  "BXOR"};
  return (code >= 0 && code < 10) ? names[code] : "UNKNOWN";
}

ffi::Error MpiReduceOp(int64_t code, ffi::DataType dtype, MPI_Op* out) {
  if (dtype == ffi::DataType::F16 || dtype == ffi::DataType::BF16) {
    if (code < 0 || code > static_cast<int64_t>(ReduceOp::kMax)) {
      return ffi::Error::InvalidArgument(
          std::string("jaxcomm: MPI.") + ReduceOpName(code) +
          " is not defined for " + DtypeName(dtype));
    }
    std::call_once(half_ops_once, CreateHalfOps);
    *out = half_ops[dtype == ffi::DataType::BF16][code];
    return ffi::Error::Success();
  }
  switch (static_cast<ReduceOp>(code)) {
    case ReduceOp::kSum: *out = MPI_SUM; break;
    case ReduceOp::kProd: *out = MPI_PROD; break;
    case ReduceOp::kMin: *out = MPI_MIN; break;
    case ReduceOp::kMax: *out = MPI_MAX; break;
    case ReduceOp::kLand: *out = MPI_LAND; break;
    case ReduceOp::kLor: *out = MPI_LOR; break;
    case ReduceOp::kLxor: *out = MPI_LXOR; break;
    case ReduceOp::kBand: *out = MPI_BAND; break;
    case ReduceOp::kBor: *out = MPI_BOR; break;
    case ReduceOp::kBxor: *out = MPI_BXOR; break;
    default:
      return ffi::Error::InvalidArgument("jaxcomm: unknown reduction code " +
                                         std::to_string(code));
  }
  return ffi::Error::Success();
}

MPI_Comm CommFromHandle(int64_t handle) {
  return MPI_Comm_f2c(static_cast<MPI_Fint>(handle));
}

int CommRank(MPI_Comm comm) {
  int rank = -1;
  MPI_Comm_rank(comm, &rank);
  return rank;
}

int CommSize(MPI_Comm comm) {
  int size = 0;
  MPI_Comm_size(comm, &size);
  return size;
}

ffi::Error MpiFailure(const char* function, int code, MPI_Comm comm) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) {
    length = std::snprintf(text, sizeof text, "MPI error code %d", code);
  }
  return ffi::Error::Internal(std::string("jaxcomm: ") + function +
                              " failed on rank " +
                              std::to_string(CommRank(comm)) + ": " +
                              std::string(text, length));
}

namespace {
std::atomic<size_t> max_count{static_cast<size_t>(INT_MAX)};
}  // namespace

size_t MaxCount() { return max_count.load(std::memory_order_relaxed); }

void SetMaxCount(size_t count) {
  max_count.store(count < 1 ? 1 : count > static_cast<size_t>(INT_MAX)
                                      ? static_cast<size_t>(INT_MAX)
                                      : count);
}

ffi::Error LargeType::Make(ffi::DataType element_type, size_t count,
                           MPI_Comm comm, LargeType* out) {
  MPI_Datatype base;
  JAXCOMM_RETURN_IF_ERROR(MpiDatatype(element_type, &base));
  return Make(base, count, comm, out);
}

LargeType::~LargeType() {
  for (MPI_Datatype& t : owned_) {
    if (t != MPI_DATATYPE_NULL) MPI_Type_free(&t);
  }
}

ffi::Error LargeType::Make(MPI_Datatype base, size_t count, MPI_Comm comm,
                           LargeType* out) {
  const size_t max = MaxCount();
  if (count <= max) {
    out->type_ = base;
    out->count_ = static_cast<int>(count);
    return ffi::Error::Success();
  }
  // count = blocks * max + rest: a contiguous run of `blocks` chunks of `max`
  // elements, then `rest` elements, as one struct element.
  const size_t blocks = count / max, rest = count % max;
  if (blocks > max) {
    return ffi::Error::InvalidArgument(
        "jaxcomm: " + std::to_string(count) + " elements exceed the " +
        std::to_string(max * max + max - 1) +
        " elements one MPI call can describe");
  }
  MPI_Datatype& chunk = out->owned_[0];
  MPI_Datatype& body = out->owned_[1];
  JAXCOMM_MPI_CHECK(MPI_Type_contiguous, static_cast<int>(max), base, &chunk);
  JAXCOMM_MPI_CHECK(MPI_Type_contiguous, static_cast<int>(blocks), chunk,
                    &body);
  MPI_Datatype whole = body;
  if (rest > 0) {
    MPI_Aint lb, extent;
    JAXCOMM_MPI_CHECK(MPI_Type_get_extent, base, &lb, &extent);
    int lengths[2] = {1, static_cast<int>(rest)};
    MPI_Aint displacements[2] = {
        0, static_cast<MPI_Aint>(blocks * max) * extent};
    MPI_Datatype types[2] = {body, base};
    JAXCOMM_MPI_CHECK(MPI_Type_create_struct, 2, lengths, displacements, types,
                      &out->owned_[2]);
    whole = out->owned_[2];
  }
  JAXCOMM_MPI_CHECK(MPI_Type_commit, &whole);
  out->type_ = whole;
  out->count_ = 1;
  return ffi::Error::Success();
}

std::string Elements(size_t count, ffi::DataType dtype) {
  return "count " + std::to_string(count) + " " + DtypeName(dtype);
}

bool DebugEnabled() { return debug_enabled.load(std::memory_order_relaxed); }

void SetDebug(bool enabled) { debug_enabled.store(enabled); }

void DebugLog(MPI_Comm comm, const std::string& text) {
  // One fprintf per line keeps lines whole when ranks share a terminal.
  std::fprintf(stderr, "r%d | %s\n", CommRank(comm), text.c_str());
  std::fflush(stderr);
}

void StoreStatus(int64_t address, const MPI_Status& status) {
  if (address != 0) {
    std::memcpy(reinterpret_cast<void*>(address), &status, sizeof status);
  }
}

}  // namespace jaxcomm
