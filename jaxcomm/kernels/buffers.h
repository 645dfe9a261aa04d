// The buffer parts of the handlers' FFI bindings, which ops.def names by
// family. Each family gives three things that must agree: <Family>Buffers(),
// which continues a binding with the family's arguments and results, the
// parameters they give the handler body (JAXCOMM_<Family>_PARAMS, after its
// Call and Memory), and whether its calls reach a communicator through their
// "handle" attribute (JAXCOMM_<Family>_ON_COMM).
#ifndef JAXCOMM_KERNELS_BUFFERS_H_
#define JAXCOMM_KERNELS_BUFFERS_H_

#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

namespace ffi = xla::ffi;

// Token in and out: ops that only synchronise.
template <typename Binding>
auto TokenBuffers(Binding&& binding) {
  return std::forward<Binding>(binding).template Arg<ffi::Token>().template Ret<ffi::Token>();
}
#define JAXCOMM_Token_PARAMS ffi::Token, ffi::Result<ffi::Token>

// The token and one array in, the token out.
template <typename Binding>
auto SinkBuffers(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::Token>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::Token>();
}
#define JAXCOMM_Sink_PARAMS ffi::Token, ffi::AnyBuffer, ffi::Result<ffi::Token>

// The token and one array in, the token and one array out.
template <typename Binding>
auto ArrayBuffers(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::Token>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::Token>()
      .template Ret<ffi::AnyBuffer>();
}
#define JAXCOMM_Array_PARAMS \
  ffi::Token, ffi::AnyBuffer, ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer>

// The token and one array in, the token, one array and a receive's envelope
// ([source, tag, count]) out.
template <typename Binding>
auto ReceiveBuffers(Binding&& binding) {
  return ArrayBuffers(std::forward<Binding>(binding)).template Ret<ffi::AnyBuffer>();
}
#define JAXCOMM_Receive_PARAMS JAXCOMM_Array_PARAMS, ffi::Result<ffi::AnyBuffer>

// As ReceiveBuffers, with a second array in: the envelope of an earlier
// receive that addresses this one.
template <typename Binding>
auto AddressedBuffers(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::Token>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::Token>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>();
}
#define JAXCOMM_Addressed_PARAMS                                       \
  ffi::Token, ffi::AnyBuffer, ffi::AnyBuffer, ffi::Result<ffi::Token>, \
      ffi::Result<ffi::AnyBuffer>, ffi::Result<ffi::AnyBuffer>

// Nonblocking starts (nonblocking.cc): the token and one array in, the
// token and the request handle (two int32: slot and serial) out.
template <typename Binding>
auto StartBuffers(Binding&& binding) {
  return SinkBuffers(std::forward<Binding>(binding)).template Ret<ffi::AnyBuffer>();
}
#define JAXCOMM_Start_PARAMS JAXCOMM_Sink_PARAMS, ffi::Result<ffi::AnyBuffer>

// As StartBuffers, with the array MPI will fill out too.
template <typename Binding>
auto StartReceiveBuffers(Binding&& binding) {
  return StartBuffers(std::forward<Binding>(binding)).template Ret<ffi::AnyBuffer>();
}
#define JAXCOMM_StartReceive_PARAMS JAXCOMM_Start_PARAMS, ffi::Result<ffi::AnyBuffer>

// Waits: the token, the handle and the buffers the operation uses in (the
// send buffer, kept alive until here; the receive buffer), the token and
// the receive buffer, aliased to the one in, out.
template <typename Binding>
auto WaitSendBuffers(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::Token>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::Token>();
}
#define JAXCOMM_WaitSend_PARAMS ffi::Token, ffi::AnyBuffer, ffi::AnyBuffer, ffi::Result<ffi::Token>

template <typename Binding>
auto WaitReceiveBuffers(Binding&& binding) {
  return WaitSendBuffers(std::forward<Binding>(binding)).template Ret<ffi::AnyBuffer>();
}
#define JAXCOMM_WaitReceive_PARAMS JAXCOMM_WaitSend_PARAMS, ffi::Result<ffi::AnyBuffer>

template <typename Binding>
auto WaitExchangeBuffers(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::Token>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::Token>()
      .template Ret<ffi::AnyBuffer>();
}
#define JAXCOMM_WaitExchange_PARAMS                                                    \
  ffi::Token, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::Result<ffi::Token>, \
      ffi::Result<ffi::AnyBuffer>

// A wait that also takes the index arrays of an exchange whose counts are
// operands (wait_ragged), between the send and the receive buffer.
template <typename Binding>
auto WaitRaggedBuffers(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::Token>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::Token>()
      .template Ret<ffi::AnyBuffer>();
}
#define JAXCOMM_WaitRagged_PARAMS                                             \
  ffi::Token, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, \
      ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer>

// Exchanges whose counts are operands (gather.cc: ragged_all_to_all and
// alltoallv with this rank's counts): the token, the operand, the output and
// the index arrays (input_offsets, send_sizes, output_offsets, recv_sizes
// stacked, [4, size]) in; the token, the output, aliased to the one in, and
// what the exchange learned from its peers (offsets and rows, [2, size], of
// the index arrays' type) out. Four buffers at most reach the host, which is
// what the GPU platform layer stages in one call. The layout is a three-array
// wait's with one more result.
template <typename Binding>
auto RaggedBuffers(Binding&& binding) {
  return WaitExchangeBuffers(std::forward<Binding>(binding)).template Ret<ffi::AnyBuffer>();
}
#define JAXCOMM_Ragged_PARAMS JAXCOMM_WaitExchange_PARAMS, ffi::Result<ffi::AnyBuffer>

// Their starts (nonblocking.cc): as Ragged, with the request handle out
// before the output (the layout is Ragged's with one more result).
template <typename Binding>
auto StartRaggedBuffers(Binding&& binding) {
  return RaggedBuffers(std::forward<Binding>(binding)).template Ret<ffi::AnyBuffer>();
}
#define JAXCOMM_StartRagged_PARAMS JAXCOMM_Ragged_PARAMS, ffi::Result<ffi::AnyBuffer>

// A fence: the token and any arrays in (only waited for), the token and an
// int32 scalar out.
template <typename Binding>
auto FenceBuffers(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::Token>()
      .RemainingArgs()
      .template Ret<ffi::Token>()
      .template Ret<ffi::AnyBuffer>();
}
#define JAXCOMM_Fence_PARAMS \
  ffi::Token, ffi::RemainingArgs, ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer>

// Every family reaches the communicator of its call but the waits, which
// complete a request on the communicator it started on, and the fence, which
// makes no MPI call.
#define JAXCOMM_Token_ON_COMM true
#define JAXCOMM_Sink_ON_COMM true
#define JAXCOMM_Array_ON_COMM true
#define JAXCOMM_Receive_ON_COMM true
#define JAXCOMM_Addressed_ON_COMM true
#define JAXCOMM_Ragged_ON_COMM true
#define JAXCOMM_Start_ON_COMM true
#define JAXCOMM_StartReceive_ON_COMM true
#define JAXCOMM_StartRagged_ON_COMM true
#define JAXCOMM_WaitSend_ON_COMM false
#define JAXCOMM_WaitReceive_ON_COMM false
#define JAXCOMM_WaitExchange_ON_COMM false
#define JAXCOMM_WaitRagged_ON_COMM false
#define JAXCOMM_Fence_ON_COMM false

}  // namespace jaxcomm

#endif  // JAXCOMM_KERNELS_BUFFERS_H_
