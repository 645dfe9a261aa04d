#include "reduce_ops.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include "datatypes.h"
#include "errors.h"

namespace jaxcomm {
namespace {

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

float Add(float a, float b) { return a + b; }
float Mul(float a, float b) { return a * b; }

// MIN (kMax false) and MAX as jnp.minimum and jnp.maximum compute them: any
// NaN gives NaN and -0 is below +0. The result does not depend on the
// operands' order, which MPI leaves open (it may differ between ranks), so
// every rank gets the same bits: even the NaN is the one canonical quiet NaN.
// Free of branches, so that compilers vectorise the loops calling it.
template <typename T, bool kMax>
T Extremum(T a, T b) {
  using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  Bits bits_a, bits_b;
  std::memcpy(&bits_a, &a, sizeof a);
  std::memcpy(&bits_b, &b, sizeof b);
  // Equal operands differ at most in the sign of zero: AND keeps +0, OR -0.
  const Bits bits_equal = kMax ? bits_a & bits_b : bits_a | bits_b;
  T equal;
  std::memcpy(&equal, &bits_equal, sizeof equal);
  T pick = (kMax ? a > b : a < b) ? a : b;
  pick = a == b ? equal : pick;
  return std::isunordered(a, b) ? std::numeric_limits<T>::quiet_NaN() : pick;
}

template <typename T>
T Same(T x) {
  return x;
}

// An MPI_User_function combining elements stored as `Word` in `Value`
// arithmetic: float16 and bfloat16 in float32, as XLA computes them.
template <typename Word, typename Value, Value (*Load)(Word), Word (*Store)(Value),
          Value (*Fn)(Value, Value)>
void UserFunction(void* in, void* inout, int* len, MPI_Datatype*) {
  const Word* a = static_cast<const Word*>(in);
  Word* b = static_cast<Word*>(inout);
  const int n = *len;
  for (int i = 0; i < n; ++i) b[i] = Store(Fn(Load(a[i]), Load(b[i])));
}

template <float (*Load)(uint16_t), uint16_t (*Store)(float)>
constexpr MPI_User_function* kHalfFunctions[4] = {
    UserFunction<uint16_t, float, Load, Store, Add>,
    UserFunction<uint16_t, float, Load, Store, Mul>,
    UserFunction<uint16_t, float, Load, Store, Extremum<float, false>>,
    UserFunction<uint16_t, float, Load, Store, Extremum<float, true>>,
};

template <typename T>
constexpr MPI_User_function* kMinMaxFunctions[2] = {
    UserFunction<T, T, Same<T>, Same<T>, Extremum<T, false>>,
    UserFunction<T, T, Same<T>, Same<T>, Extremum<T, true>>,
};

// jaxcomm's own MPI ops, all commutative. MPI must be initialised before
// they are created, hence on first use; MPI_Finalize releases them.
struct UserOps {
  int status = MPI_SUCCESS;
  // [0] float16, [1] bfloat16; by the arithmetic ReduceOp codes SUM, PROD,
  // MIN, MAX.
  MPI_Op half[2][4];
  // [0] float32, [1] float64; MIN, MAX.
  MPI_Op min_max[2][2];
};

UserOps CreateUserOps() {
  UserOps ops;
  const auto create = [&ops](MPI_User_function* fn, MPI_Op* op) {
    if (ops.status == MPI_SUCCESS) {
      ops.status = MPI_Op_create(fn, /*commute=*/1, op);
    }
  };
  for (int o = 0; o < 4; ++o) {
    create(kHalfFunctions<F16ToFloat, FloatToF16>[o], &ops.half[0][o]);
    create(kHalfFunctions<Bf16ToFloat, FloatToBf16>[o], &ops.half[1][o]);
  }
  for (int o = 0; o < 2; ++o) {
    create(kMinMaxFunctions<float>[o], &ops.min_max[0][o]);
    create(kMinMaxFunctions<double>[o], &ops.min_max[1][o]);
  }
  return ops;
}

const UserOps& GetUserOps() {
  static const UserOps ops = CreateUserOps();
  return ops;
}

}  // namespace

const char* ReduceOpName(int64_t code) {
  static const char* names[] = {"SUM", "PROD", "MIN",  "MAX", "LAND",
                                "LOR", "LXOR", "BAND", "BOR", "BXOR"};
  return (code >= 0 && code < 10) ? names[code] : "UNKNOWN";
}

bool IsOwnReduceOp(int64_t code, ffi::DataType dtype) {
  const bool half = dtype == ffi::DataType::F16 || dtype == ffi::DataType::BF16;
  const bool min_max =
      code == static_cast<int64_t>(ReduceOp::kMin) || code == static_cast<int64_t>(ReduceOp::kMax);
  const bool wide = dtype == ffi::DataType::F32 || dtype == ffi::DataType::F64;
  return half || (wide && min_max);
}

ffi::Error MpiReduceOp(int64_t code, ffi::DataType dtype, MPI_Comm comm, MPI_Op* out) {
  const bool half = dtype == ffi::DataType::F16 || dtype == ffi::DataType::BF16;
  if (IsOwnReduceOp(code, dtype)) {
    if (code < 0 || code > static_cast<int64_t>(ReduceOp::kMax)) {
      return ffi::Error::InvalidArgument(std::string("jaxcomm: MPI.") + ReduceOpName(code) +
                                         " is not defined for " + DtypeName(dtype));
    }
    const UserOps& ops = GetUserOps();
    if (ops.status != MPI_SUCCESS) {
      return MpiFailure("MPI_Op_create", ops.status, comm);
    }
    if (half) {
      *out = ops.half[dtype == ffi::DataType::BF16][code];
    } else {
      *out = ops.min_max[dtype == ffi::DataType::F64][code - static_cast<int64_t>(ReduceOp::kMin)];
    }
    return ffi::Error::Success();
  }
  switch (static_cast<ReduceOp>(code)) {
    case ReduceOp::kSum:
      *out = MPI_SUM;
      break;
    case ReduceOp::kProd:
      *out = MPI_PROD;
      break;
    case ReduceOp::kMin:
      *out = MPI_MIN;
      break;
    case ReduceOp::kMax:
      *out = MPI_MAX;
      break;
    case ReduceOp::kLand:
      *out = MPI_LAND;
      break;
    case ReduceOp::kLor:
      *out = MPI_LOR;
      break;
    case ReduceOp::kLxor:
      *out = MPI_LXOR;
      break;
    case ReduceOp::kBand:
      *out = MPI_BAND;
      break;
    case ReduceOp::kBor:
      *out = MPI_BOR;
      break;
    case ReduceOp::kBxor:
      *out = MPI_BXOR;
      break;
    default:
      return ffi::Error::InvalidArgument("jaxcomm: unknown reduction code " + std::to_string(code));
  }
  return ffi::Error::Success();
}

}  // namespace jaxcomm
