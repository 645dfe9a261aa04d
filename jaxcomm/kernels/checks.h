// The handlers' argument checks: buffers must hold what the attributes and
// the communicator size call for, or MPI would read or write outside them.
// A passing check builds no string.
#ifndef JAXCOMM_KERNELS_CHECKS_H_
#define JAXCOMM_KERNELS_CHECKS_H_

#include <cstddef>
#include <string>

#include "call.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

namespace ffi = xla::ffi;

// The error of CheckElements.
ffi::Error WrongElements(const Call& call, const char* buffer, size_t actual, size_t expected,
                         const std::string& how);

// The error of CheckOutput for an output whose element type is not x's.
ffi::Error WrongOutputType(const Call& call, const ffi::AnyBuffer& x, const ffi::AnyBuffer& y);

// Fails unless `buffer` holds `expected` elements. how() says how the
// attributes and the communicator size call for them; it is only called when
// the check fails.
template <typename How>
ffi::Error CheckElements(const Call& call, const char* buffer, size_t actual, size_t expected,
                         How&& how) {
  if (actual == expected) return ffi::Error::Success();
  return WrongElements(call, buffer, actual, expected, how());
}

// Fails unless the output `y` has the element type of the input `x`.
inline ffi::Error CheckType(const Call& call, const ffi::AnyBuffer& x, const ffi::AnyBuffer& y) {
  if (x.element_type() != y.element_type()) return WrongOutputType(call, x, y);
  return ffi::Error::Success();
}

// Fails unless the output `y` has the element type of the input `x` and
// `expected` elements, as CheckElements.
template <typename How>
ffi::Error CheckOutput(const Call& call, const ffi::AnyBuffer& x, const ffi::AnyBuffer& y,
                       size_t expected, How&& how) {
  JAXCOMM_RETURN_IF_ERROR(CheckType(call, x, y));
  return CheckElements(call, "output", y.element_count(), expected, how);
}

// Fails unless input `x` splits into `size` blocks of equal length, one per
// rank.
ffi::Error CheckDivisible(const Call& call, const ffi::AnyBuffer& x, size_t size);

// Elements in one leading-axis row of an array of shape `dims`.
size_t RowElements(ffi::Span<const int64_t> dims);

// Fails unless the counts attribute `name` holds one non-negative count of
// rows per rank of `size`.
ffi::Error CheckCounts(const Call& call, const char* name, ffi::Span<const int64_t> counts,
                       int size);

// The rows `counts` add up to.
size_t Sum(ffi::Span<const int64_t> counts);

// "sum(<name>) <rows> x row <n>", how a *v op's buffer size is made.
std::string RowsOf(const char* name, size_t rows, size_t row);

// The checks of an all-to-all of rows (MPI_Alltoallv, MPI_Ialltoallv): both
// counts are valid, input `x` holds sum(sendcounts) rows and output `y`
// sum(recvcounts) rows of x's row length.
ffi::Error CheckExchangedRows(const Call& call, ffi::Span<const int64_t> sendcounts,
                              ffi::Span<const int64_t> recvcounts, const ffi::AnyBuffer& x,
                              const ffi::AnyBuffer& y);

// Off the root, a rooted op's lowering (ops/_base.py, root_only) passes, in
// place of the buffer that MPI reads or writes on the root only (a gather's
// output, a scatter's input, and their nonblocking starts'), a placeholder: that buffer's shape
// behind an axis of length 0. It holds nothing, so the call costs the rank no memory of the
// communicator's size, and its dimensions still let every rank check the buffer as the root does,
// and fail alike.
class WholeBuffer {
 public:
  // `buffer` itself, or the placeholder of root's buffer off the root.
  WholeBuffer(const ffi::AnyBuffer& buffer, bool placeholder) : dims_(buffer.dimensions()) {
    if (placeholder && dims_.size() > 0) dims_ = dims_.last(dims_.size() - 1);
  }
  static WholeBuffer OfRoot(const Call& call, int64_t root, const ffi::AnyBuffer& buffer) {
    return WholeBuffer(buffer, call.rank() != root);
  }

  // The elements of the buffer (root's), and of one leading-axis row of it.
  size_t elements() const {
    size_t n = 1;
    for (int64_t d : dims_) n *= static_cast<size_t>(d);
    return n;
  }
  size_t row() const { return RowElements(dims_); }

 private:
  ffi::Span<const int64_t> dims_;
};

// The `how` of an output shaped like its input.
inline std::string LikeTheInput() { return "like the input"; }

// Whether XLA gave output `y` the buffer of input `x` (ops whose lowering
// aliases them): the MPI call then works in place.
inline bool SameBuffer(const ffi::AnyBuffer& x, const ffi::AnyBuffer& y) {
  return x.untyped_data() == y.untyped_data() && x.size_bytes() == y.size_bytes();
}

}  // namespace jaxcomm

#endif  // JAXCOMM_KERNELS_CHECKS_H_
