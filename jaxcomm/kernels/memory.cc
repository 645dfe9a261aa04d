#include "memory.h"

#include <cstring>

namespace jaxcomm {

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

}  // namespace jaxcomm
