#include "checks.h"

#include "datatypes.h"

namespace jaxcomm {

ffi::Error WrongElements(const Call& call, const char* buffer, size_t actual, size_t expected,
                         const std::string& how) {
  return call.Invalid(std::string(buffer) + " has " + std::to_string(actual) +
                      " elements, expected " + std::to_string(expected) + " (" + how + ")");
}

ffi::Error WrongOutputType(const Call& call, const ffi::AnyBuffer& x, const ffi::AnyBuffer& y) {
  return call.Invalid(std::string("output is ") + DtypeName(y.element_type()) +
                      ", expected the input's " + DtypeName(x.element_type()));
}

ffi::Error CheckDivisible(const Call& call, const ffi::AnyBuffer& x, size_t size) {
  if (x.element_count() % size == 0) return ffi::Error::Success();
  return call.Invalid("input has " + std::to_string(x.element_count()) +
                      " elements, expected a multiple of the communicator size " +
                      std::to_string(size));
}

size_t RowElements(ffi::Span<const int64_t> dims) {
  size_t n = 1;
  for (size_t i = 1; i < dims.size(); ++i) n *= static_cast<size_t>(dims[i]);
  return n;
}

ffi::Error CheckCounts(const Call& call, const char* name, ffi::Span<const int64_t> counts,
                       int size) {
  if (counts.size() != static_cast<size_t>(size)) {
    return call.Invalid(std::string(name) + " has " + std::to_string(counts.size()) +
                        " entries, expected one per rank (" + std::to_string(size) + ")");
  }
  for (size_t r = 0; r < counts.size(); ++r) {
    if (counts[r] < 0) {
      return call.Invalid(std::string(name) + "[" + std::to_string(r) + "] is " +
                          std::to_string(counts[r]) + ", expected a count of rows >= 0");
    }
  }
  return ffi::Error::Success();
}

size_t Sum(ffi::Span<const int64_t> counts) {
  size_t total = 0;
  for (int64_t c : counts) total += static_cast<size_t>(c);
  return total;
}

std::string RowsOf(const char* name, size_t rows, size_t row) {
  return std::string(name) + " " + std::to_string(rows) + " rows x " + std::to_string(row) +
         " elements";
}

ffi::Error CheckExchangedRows(const Call& call, ffi::Span<const int64_t> sendcounts,
                              ffi::Span<const int64_t> recvcounts, const ffi::AnyBuffer& x,
                              const ffi::AnyBuffer& y) {
  JAXCOMM_RETURN_IF_ERROR(CheckCounts(call, "sendcounts", sendcounts, call.size()));
  JAXCOMM_RETURN_IF_ERROR(CheckCounts(call, "recvcounts", recvcounts, call.size()));
  const size_t row = RowElements(x.dimensions());
  const size_t sent = Sum(sendcounts), received = Sum(recvcounts);
  JAXCOMM_RETURN_IF_ERROR(CheckElements(call, "input", x.element_count(), sent * row,
                                        [&] { return RowsOf("sum(sendcounts)", sent, row); }));
  return CheckOutput(call, x, y, received * row,
                     [&] { return RowsOf("sum(recvcounts)", received, row); });
}

}  // namespace jaxcomm
