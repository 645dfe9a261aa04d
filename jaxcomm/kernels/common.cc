#include "common.h"

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <type_traits>

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

namespace {

// The live communicators, each in the slot its serial picks: a handler's
// lookup is a few atomic loads, with no lock, map or allocation. A serial whose slot is taken is
// skipped, which keeps serials unique; MPI libraries allow far fewer communicators than there are
// slots.
struct CommSlot {
  std::atomic<int64_t> handle;  // 0: free
  std::atomic<MPI_Comm> comm;
};
constexpr int64_t kCommSlots = int64_t{1} << 14;
CommSlot comm_slots[kCommSlots];
std::mutex register_mutex;  // held by RegisterComm and UnregisterComm only
int64_t last_serial = 0;

CommSlot& SlotOf(int64_t handle) { return comm_slots[(handle >> 32) % kCommSlots]; }

}  // namespace

int WorldRank() {
  int initialized = 0, finalized = 0, rank = -1;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

ffi::Error RegisterComm(int64_t fortran_handle, int64_t* handle) {
  if (fortran_handle < INT32_MIN || fortran_handle > INT32_MAX) {
    return ffi::Error::InvalidArgument("jaxcomm: communicator handle " +
                                       std::to_string(fortran_handle) + " does not fit 32 bits");
  }
  const MPI_Comm comm = MPI_Comm_f2c(static_cast<MPI_Fint>(fortran_handle));
  std::lock_guard<std::mutex> lock(register_mutex);
  for (int64_t tries = 0; tries < kCommSlots; ++tries) {
    // 2**31 serials before they run out keeps handles positive.
    if (last_serial == INT32_MAX) break;
    const int64_t candidate = (++last_serial << 32) | static_cast<uint32_t>(fortran_handle);
    CommSlot& slot = SlotOf(candidate);
    if (slot.handle.load() != 0) continue;
    slot.comm.store(comm);
    slot.handle.store(candidate);
    *handle = candidate;
    return ffi::Error::Success();
  }
  return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                    "jaxcomm: too many communicators created in this process");
}

void UnregisterComm(int64_t handle) {
  if (handle >> 32 <= 0) return;
  std::lock_guard<std::mutex> lock(register_mutex);
  int64_t expected = handle;
  SlotOf(handle).handle.compare_exchange_strong(expected, 0);
}

MPI_Fint FortranHandle(int64_t handle) {
  return static_cast<MPI_Fint>(static_cast<int32_t>(handle & 0xffffffff));
}

ffi::Error CommFromHandle(int64_t handle, const char* op, MPI_Comm* comm) {
  if (handle >> 32 > 0) {
    CommSlot& slot = SlotOf(handle);
    if (slot.handle.load() == handle) {
      *comm = slot.comm.load();
      // The slot may have been freed and taken again in between.
      if (slot.handle.load() == handle) return ffi::Error::Success();
    }
  }
  *comm = MPI_COMM_NULL;
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    std::string("jaxcomm: ") + op +
                        ": communicator was freed (JaxComm.free); a compiled function that "
                        "captured it cannot run again: trace it anew with a live JaxComm "
                        "(world rank " +
                        std::to_string(WorldRank()) + ")");
}

ffi::Error Invalid(const char* op, MPI_Comm comm, const std::string& why) {
  return ffi::Error::InvalidArgument(std::string("jaxcomm: ") + op + " on rank " +
                                     std::to_string(CommRank(comm)) + ": " + why);
}

ffi::Error WrongElements(const char* op, MPI_Comm comm, const char* buffer, size_t actual,
                         size_t expected, const std::string& how) {
  return Invalid(op, comm,
                 std::string(buffer) + " has " + std::to_string(actual) + " elements, expected " +
                     std::to_string(expected) + " (" + how + ")");
}

ffi::Error WrongOutputType(const char* op, MPI_Comm comm, const ffi::AnyBuffer& x,
                           const ffi::AnyBuffer& y) {
  return Invalid(op, comm,
                 std::string("output is ") + DtypeName(y.element_type()) +
                     ", expected the input's " + DtypeName(x.element_type()));
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
  return ffi::Error::Internal(std::string("jaxcomm: ") + function + " failed on rank " +
                              std::to_string(CommRank(comm)) + ": " + std::string(text, length));
}

namespace {
std::atomic<size_t> max_count{static_cast<size_t>(INT_MAX)};
}  // namespace

size_t MaxCount() { return max_count.load(std::memory_order_relaxed); }

void SetMaxCount(size_t count) {
  max_count.store(count < 1                              ? 1
                  : count > static_cast<size_t>(INT_MAX) ? static_cast<size_t>(INT_MAX)
                                                         : count);
}

ffi::Error LargeType::Make(ffi::DataType element_type, size_t count, MPI_Comm comm,
                           LargeType* out) {
  MPI_Datatype base;
  JAXCOMM_RETURN_IF_ERROR(MpiDatatype(element_type, &base));
  return Make(base, count, comm, out);
}

LargeType::~LargeType() {
  for (MPI_Datatype& t : owned_) {
    if (t != MPI_DATATYPE_NULL) MPI_Type_free(&t);
  }
}

ffi::Error LargeType::Make(MPI_Datatype base, size_t count, MPI_Comm comm, LargeType* out) {
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
        std::to_string(max * max + max - 1) + " elements one MPI call can describe");
  }
  MPI_Datatype& chunk = out->owned_[0];
  MPI_Datatype& body = out->owned_[1];
  JAXCOMM_MPI_CHECK(MPI_Type_contiguous, static_cast<int>(max), base, &chunk);
  JAXCOMM_MPI_CHECK(MPI_Type_contiguous, static_cast<int>(blocks), chunk, &body);
  MPI_Datatype whole = body;
  if (rest > 0) {
    MPI_Aint lb, extent;
    JAXCOMM_MPI_CHECK(MPI_Type_get_extent, base, &lb, &extent);
    int lengths[2] = {1, static_cast<int>(rest)};
    MPI_Aint displacements[2] = {0, static_cast<MPI_Aint>(blocks * max) * extent};
    MPI_Datatype types[2] = {body, base};
    JAXCOMM_MPI_CHECK(MPI_Type_create_struct, 2, lengths, displacements, types, &out->owned_[2]);
    whole = out->owned_[2];
  }
  JAXCOMM_MPI_CHECK(MPI_Type_commit, &whole);
  out->type_ = whole;
  out->count_ = 1;
  return ffi::Error::Success();
}

ffi::Error HostMemory::Input(const ffi::AnyBuffer& x, const void** data) {
  *data = x.untyped_data();
  return ffi::Error::Success();
}

ffi::Error HostMemory::Output(ffi::AnyBuffer& y, void** data) {
  *data = y.untyped_data();
  return ffi::Error::Success();
}

ffi::Error HostMemory::InPlace(ffi::AnyBuffer& y, void** data) { return Output(y, data); }

ffi::Error HostMemory::HostInput(const ffi::AnyBuffer& x, const void** data) {
  return Input(x, data);
}

ffi::Error HostMemory::HostOutput(ffi::AnyBuffer& y, void** data) { return Output(y, data); }

ffi::Error HostMemory::Preload(ffi::AnyBuffer& y, size_t offset, const ffi::AnyBuffer& x) {
  if (x.size_bytes() > 0) {
    std::memcpy(static_cast<char*>(y.untyped_data()) + offset, x.untyped_data(), x.size_bytes());
  }
  return ffi::Error::Success();
}

ffi::Error HostMemory::ZeroFrom(ffi::AnyBuffer& y, size_t offset) {
  if (offset < y.size_bytes()) {
    std::memset(static_cast<char*>(y.untyped_data()) + offset, 0, y.size_bytes() - offset);
  }
  return ffi::Error::Success();
}

ffi::Error HostMemory::HoldInput(const ffi::AnyBuffer& x, const void** data, Held* held) {
  *held = Held{x.untyped_data(), x.size_bytes(), nullptr};
  *data = x.untyped_data();
  return ffi::Error::Success();
}

ffi::Error HostMemory::HoldOutput(ffi::AnyBuffer& y, void** data, Held* held) {
  *held = Held{y.untyped_data(), y.size_bytes(), nullptr};
  *data = y.untyped_data();
  return ffi::Error::Success();
}

ffi::Error HostMemory::Unhold(Held& held, ffi::AnyBuffer* out, size_t filled) {
  if (out != nullptr) {
    char* data = static_cast<char*>(out->untyped_data());
    if (filled > out->size_bytes()) filled = out->size_bytes();
    if (data != held.buffer && filled > 0) std::memcpy(data, held.buffer, filled);
    ZeroFrom(*out, filled);
  }
  held = Held{};
  return ffi::Error::Success();
}

std::string Elements(size_t count, ffi::DataType dtype) {
  return "count " + std::to_string(count) + " " + DtypeName(dtype);
}

bool DebugEnabled() { return debug_enabled.load(std::memory_order_relaxed); }

void SetDebug(bool enabled) { debug_enabled.store(enabled); }

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

bool TakeRecordedError(std::string* message) {
  if (!error_recorded.load(std::memory_order_acquire)) return false;
  std::lock_guard<std::mutex> lock(error_mutex);
  if (!error_recorded.load(std::memory_order_relaxed)) return false;
  *message = std::move(recorded_error);
  recorded_error.clear();
  error_recorded.store(false, std::memory_order_relaxed);
  return true;
}

void DebugLog(MPI_Comm comm, const std::string& text) {
  // One fprintf per line keeps lines whole when ranks share a terminal.
  std::fprintf(stderr, "r%d | %s\n", CommRank(comm), text.c_str());
  std::fflush(stderr);
}

}  // namespace jaxcomm
