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

}  // namespace jaxcomm
