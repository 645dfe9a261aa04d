// The FFI handlers XLA calls, one per row of ops.def, for the platform this
// file is compiled for (handlers.cc defines them; module.cc registers them):
// JaxcommCpu<Name>, JaxcommCuda<Name> with JAXCOMM_CUDA, JaxcommEmulated<Name>
// with JAXCOMM_CUDA_EMULATION too. Plain C symbols, so a kernels library can
// hold the handlers of several platforms and the modules find them by name.
#ifndef JAXCOMM_KERNELS_HANDLERS_H_
#define JAXCOMM_KERNELS_HANDLERS_H_

#include "xla/ffi/api/c_api.h"

#if defined(JAXCOMM_CUDA_EMULATION)
#define JAXCOMM_HANDLER(Name) JaxcommEmulated##Name
#elif defined(JAXCOMM_CUDA)
#define JAXCOMM_HANDLER(Name) JaxcommCuda##Name
#else
#define JAXCOMM_HANDLER(Name) JaxcommCpu##Name
#endif

extern "C" {
#define JAXCOMM_OP(name, label, Name, buffers, attributes) \
  XLA_FFI_Error* JAXCOMM_HANDLER(Name)(XLA_FFI_CallFrame * call_frame);
#include "ops.def"
#undef JAXCOMM_OP

#ifndef JAXCOMM_CUDA
// Not an operation: jaxcomm_zero_after (handlers.cc). CPU only.
XLA_FFI_Error* JaxcommZeroAfter(XLA_FFI_CallFrame* call_frame);
#endif
}

#endif  // JAXCOMM_KERNELS_HANDLERS_H_
