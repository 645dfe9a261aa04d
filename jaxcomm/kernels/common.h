// Shared pieces of the jaxcomm XLA FFI handlers: datatype and reduction-op
// tables, the MPI error check, checked count narrowing and debug logging.
#ifndef JAXCOMM_KERNELS_COMMON_H_
#define JAXCOMM_KERNELS_COMMON_H_

#include <mpi.h>

#include <climits>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

namespace ffi = xla::ffi;

// Reduction codes shared with jaxcomm/ops/_base.py (REDUCTION_OPS).
enum class ReduceOp : int64_t {
  kSum = 0,
  kProd = 1,
  kMin = 2,
  kMax = 3,
  kLand = 4,
  kLor = 5,
  kLxor = 6,
  kBand = 7,
  kBor = 8,
  kBxor = 9,
};

// Element type name as NumPy spells it, for logs and error messages.
const char* DtypeName(ffi::DataType dtype);

// MPI datatype that moves one element of `dtype`. Half-precision types move
// as 16-bit words; their reductions go through HalfReduceOp.
ffi::Error MpiDatatype(ffi::DataType dtype, MPI_Datatype* out);

// MPI_Op for a reduction code and element type: a predefined op, or one of
// jaxcomm's own (created on first use, hence `comm` for errors): every
// float16/bfloat16 reduction, and MIN and MAX of every floating type, which
// propagate NaN like jnp.minimum/jnp.maximum on every rank alike.
ffi::Error MpiReduceOp(int64_t code, ffi::DataType dtype, MPI_Comm comm,
                       MPI_Op* out);

const char* ReduceOpName(int64_t code);

// The buffer parts of the handlers' FFI bindings, named in ops.def.
// Token in and out: ops that only synchronise.
inline auto TokenBuffers() {
  return ffi::Ffi::Bind().Arg<ffi::Token>().Ret<ffi::Token>();
}

// The token and one array in, the token out.
inline auto SinkBuffers() {
  return ffi::Ffi::Bind().Arg<ffi::Token>().Arg<ffi::AnyBuffer>().Ret<ffi::Token>();
}

// The token and one array in, the token and one array out.
inline auto ArrayBuffers() {
  return ffi::Ffi::Bind()
      .Arg<ffi::Token>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::Token>()
      .Ret<ffi::AnyBuffer>();
}

// The token and one array in, the token, one array and a receive's envelope
// ([source, tag, count]) out.
inline auto ReceiveBuffers() { return ArrayBuffers().Ret<ffi::AnyBuffer>(); }

// As ReceiveBuffers, with a second array in: the envelope of an earlier
// receive that addresses this one.
inline auto AddressedBuffers() {
  return ffi::Ffi::Bind()
      .Arg<ffi::Token>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::Token>()
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>();
}

// Each handler's complete binding, generated from its row of ops.def:
// bindings::<HandlerSymbol>().
namespace bindings {
#define I64(name) .Attr<int64_t>(#name)
#define I64S(name) .Attr<ffi::Span<const int64_t>>(#name)
#define JAXCOMM_OP(name, symbol, buffers, attributes) \
  inline auto symbol() { return buffers##Buffers() attributes; }
#include "ops.def"
#undef JAXCOMM_OP
#undef I64S
#undef I64
}  // namespace bindings

// Makes `comm` known to the handlers and returns the value of the "comm"
// attribute that stands for it: its Fortran handle in the low 32 bits and a
// serial number above, never reused in this process, so that a compiled call
// whose communicator was freed cannot reach another one that MPI created
// under the same handle.
ffi::Error RegisterComm(int64_t fortran_handle, int64_t* handle);

// Forgets a handle from RegisterComm: handlers refuse it from now on.
void UnregisterComm(int64_t handle);

// The Fortran handle inside a value from RegisterComm.
MPI_Fint FortranHandle(int64_t handle);

// The live communicator behind a "comm" attribute, or an error naming `op`
// if it was freed (or never registered).
ffi::Error CommFromHandle(int64_t handle, const char* op, MPI_Comm* comm);

// The error for arguments of `op` that do not fit together:
// "jaxcomm: <op> on rank <r>: <why>".
ffi::Error Invalid(const char* op, MPI_Comm comm, const std::string& why);

// Fails unless `buffer` of `op` holds `expected` elements, the number its
// attributes and the communicator size call for (`how` says how they do):
// MPI would read or write outside the buffer otherwise.
ffi::Error CheckElements(const char* op, MPI_Comm comm, const char* buffer,
                         size_t actual, size_t expected, const std::string& how);

// Fails unless the output `y` has the element type of the input `x` and
// `expected` elements, as CheckElements.
ffi::Error CheckOutput(const char* op, MPI_Comm comm, const ffi::AnyBuffer& x,
                       const ffi::AnyBuffer& y, size_t expected,
                       const std::string& how);

// Rank in `comm`, for log lines and error messages.
int CommRank(MPI_Comm comm);

// Number of ranks in `comm`.
int CommSize(MPI_Comm comm);

// Builds the error returned to XLA when an MPI call fails.
ffi::Error MpiFailure(const char* function, int code, MPI_Comm comm);

// Largest count handed to one MPI call: INT_MAX (MPI's int counts) unless
// lowered, which the tests do to run the large-message paths on small arrays.
size_t MaxCount();
void SetMaxCount(size_t count);

// `count` elements of `base` as MPI arguments: (base, count) when count fits
// MaxCount(), else one element of a derived datatype that spans them all.
// Frees the derived datatypes when destroyed. For data movement only: MPI's
// predefined reductions do not apply to derived datatypes (use ForEachChunk).
class LargeType {
 public:
  LargeType() = default;
  LargeType(const LargeType&) = delete;
  LargeType& operator=(const LargeType&) = delete;
  ~LargeType();

  static ffi::Error Make(MPI_Datatype base, size_t count, MPI_Comm comm,
                         LargeType* out);
  // The same for `count` elements of an XLA element type.
  static ffi::Error Make(ffi::DataType element_type, size_t count,
                         MPI_Comm comm, LargeType* out);

  MPI_Datatype type() const { return type_; }
  int count() const { return count_; }

 private:
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
  int count_ = 0;
  MPI_Datatype owned_[3] = {MPI_DATATYPE_NULL, MPI_DATATYPE_NULL,
                            MPI_DATATYPE_NULL};
};

// Calls fn(offset, count) over consecutive pieces of at most MaxCount()
// elements covering [0, total), at least once (with count 0 when total is 0),
// and stops at the first error.
template <typename Fn>
ffi::Error ForEachChunk(size_t total, Fn&& fn) {
  const size_t max = MaxCount();
  size_t offset = 0;
  do {
    const size_t n = total - offset < max ? total - offset : max;
    ffi::Error err = fn(offset, static_cast<int>(n));
    if (err.failure()) return err;
    offset += n;
  } while (offset < total);
  return ffi::Error::Success();
}

// Address of element `offset` of a buffer of `dtype`.
inline void* ElementAt(void* data, ffi::DataType dtype, size_t offset) {
  return static_cast<char*>(data) + offset * ffi::ByteWidth(dtype);
}

// "count <n> <dtype>", the tail of most log lines.
std::string Elements(size_t count, ffi::DataType dtype);

bool DebugEnabled();
void SetDebug(bool enabled);

// Writes one line to stderr: "r<rank> | <text>".
void DebugLog(MPI_Comm comm, const std::string& text);

}  // namespace jaxcomm

// Runs an MPI call and returns an ffi::Error naming it, the rank and MPI's
// error string when it fails. Needs `comm` in scope.
#define JAXCOMM_MPI_CHECK(function, ...)                      \
  do {                                                        \
    int jaxcomm_rc_ = function(__VA_ARGS__);                  \
    if (jaxcomm_rc_ != MPI_SUCCESS) {                         \
      return ::jaxcomm::MpiFailure(#function, jaxcomm_rc_, comm); \
    }                                                         \
  } while (0)

// Propagates a failed ffi::Error.
#define JAXCOMM_RETURN_IF_ERROR(expr)          \
  do {                                         \
    ::xla::ffi::Error jaxcomm_err_ = (expr);   \
    if (jaxcomm_err_.failure()) {              \
      return jaxcomm_err_;                     \
    }                                          \
  } while (0)

// Defines the FFI handler `symbol` calling `impl`, with the binding its row of
// ops.def gives.
#define JAXCOMM_DEFINE_HANDLER(symbol, impl)         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, impl, \
                                ::jaxcomm::bindings::symbol())

#endif  // JAXCOMM_KERNELS_COMMON_H_
