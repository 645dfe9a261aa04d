// Point to point: MPI_Send, MPI_Recv, MPI_Sendrecv.
//
// Every receive also returns its envelope, a 3-element integer array
// (source, tag, count in elements): the Python side fills an MPI.Status
// from it (eagerly itself, in compiled code through jaxcomm_write_status),
// returns it to jitted code, and addresses derivative messages of wildcard
// receives with it (jaxcomm_sendrecv_addressed).
#include <cstring>
#include <string>
#include <vector>

#include "common.h"

namespace jaxcomm {
namespace {

// Peers and tags of jaxcomm_sendrecv_addressed: which side of the exchange
// takes its peer and tag from the envelope operand (jaxcomm/ops/p2p.py).
constexpr int64_t kReceiveFromEnvelope = 1;
constexpr int64_t kSendToEnvelope = 2;

std::string Peer(int64_t rank) {
  if (rank == MPI_ANY_SOURCE) return "any";
  if (rank == MPI_PROC_NULL) return "null";
  return std::to_string(rank);
}

std::string Tag(int64_t tag) { return tag == MPI_ANY_TAG ? "any" : std::to_string(tag); }

// Fails unless `envelope` (`what` it is, for the message) holds the three
// int32 or int64 fields of an envelope; `function` names the call in the error.
ffi::Error CheckEnvelope(const Call& call, const char* function, const ffi::AnyBuffer& envelope,
                         const char* what) {
  const ffi::DataType type = envelope.element_type();
  if ((type == ffi::DataType::S32 || type == ffi::DataType::S64) && envelope.element_count() == 3) {
    return ffi::Error::Success();
  }
  return Invalid(function, call.comm(),
                 std::string(what) + " must be 3 int32 or int64 elements, got " +
                     Elements(envelope.element_count(), type));
}

// The buffers MPI writes into must be what the Python side declared: the
// result as large as the message buffer it stands for, the envelope three
// integers. Checked before any MPI call, so a mismatch never overwrites
// memory XLA did not give us.
ffi::Error CheckOutputs(const Call& call, const char* function, const ffi::AnyBuffer& in,
                        const ffi::AnyBuffer& y, const ffi::AnyBuffer& envelope) {
  if (y.element_type() != in.element_type() || y.element_count() != in.element_count()) {
    return Invalid(function, call.comm(),
                   "the result buffer holds " + Elements(y.element_count(), y.element_type()) +
                       " but the message buffer " +
                       Elements(in.element_count(), in.element_type()));
  }
  return CheckEnvelope(call, function, envelope, "the status output");
}

// Field i of an envelope of `type` at `data` (host memory).
int64_t EnvelopeAt(ffi::DataType type, const void* data, int i) {
  if (type == ffi::DataType::S32) return static_cast<const int32_t*>(data)[i];
  return static_cast<const int64_t*>(data)[i];
}

// After a receive of up to `capacity` elements into `y`: zeros the part no
// message filled (all of it for MPI_PROC_NULL; XLA's buffers hold garbage
// and jaxcomm documents zeros), writes (source, tag, count) to `fields_out`,
// the host memory of `envelope`, and finishes the call.
ffi::Error FinishReceive(const Call& call, Memory& memory, const char* function,
                         const MPI_Status& status, MPI_Datatype type, size_t capacity,
                         ffi::AnyBuffer& y, ffi::AnyBuffer& envelope, void* fields_out) {
  MPI_Count basic = 0;
  JAXCOMM_MPI_CHECK(call, MPI_Get_elements_x, &status, type, &basic);
  if (basic == MPI_UNDEFINED || basic < 0 || static_cast<size_t>(basic) > capacity) {
    return Invalid(function, call.comm(),
                   "received a message that is not a whole number of " +
                       std::string(DtypeName(y.element_type())) + " elements");
  }
  const size_t count = static_cast<size_t>(basic);
  if (count < capacity) {
    JAXCOMM_RETURN_IF_ERROR(memory.ZeroFrom(y, count * ffi::ByteWidth(y.element_type())));
  }
  const int64_t fields[3] = {status.MPI_SOURCE, status.MPI_TAG, static_cast<int64_t>(count)};
  if (envelope.element_type() == ffi::DataType::S32) {
    if (count > static_cast<size_t>(INT32_MAX)) {
      return Invalid(function, call.comm(),
                     "received " + std::to_string(count) +
                         " elements, more than an int32 status can count; "
                         "enable jax_enable_x64 for int64 statuses");
    }
    int32_t* out = static_cast<int32_t*>(fields_out);
    for (int i = 0; i < 3; ++i) out[i] = static_cast<int32_t>(fields[i]);
  } else {
    std::memcpy(fields_out, fields, sizeof fields);
  }
  return memory.Finish();
}

// A cotangent going back to a receive from MPI_PROC_NULL, whose status
// tag is MPI_ANY_TAG, still needs a valid tag.
int SendTag(int64_t dest, int64_t tag) { return dest == MPI_PROC_NULL ? 0 : static_cast<int>(tag); }

// Takes the message the checker refused (PointToPoint::recv_dropped) from
// (source, tag) into scratch memory, so that its sender, which does not know,
// is not left waiting.
ffi::Error ReceiveDropped(const Call& call, const PointToPoint& message, int64_t source,
                          int64_t tag) {
  std::vector<char> bytes(
      static_cast<size_t>(message.dropped_count) * ffi::ByteWidth(message.dropped_dtype) + 1);
  LargeType type;
  JAXCOMM_RETURN_IF_ERROR(LargeType::Make(
      message.dropped_dtype, static_cast<size_t>(message.dropped_count), call.comm(), &type));
  JAXCOMM_MPI_CHECK(call, MPI_Recv, bytes.data(), type.count(), type.type(),
                    static_cast<int>(source), static_cast<int>(tag), call.comm(),
                    MPI_STATUS_IGNORE);
  return ffi::Error::Success();
}

}  // namespace

ffi::Error SendImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                    ffi::Result<ffi::Token>, int64_t dest, int64_t tag) {
  PointToPoint message = PointToPoint::Of(x.element_type()).Send(dest, tag, Count(x));
  int64_t no_source = kNoPeer, no_tag = 0;
  JAXCOMM_RETURN_IF_ERROR(call.Announce(message, &no_source, &no_tag));
  LargeType type;
  JAXCOMM_RETURN_IF_ERROR(LargeType::Make(x.element_type(), x.element_count(), call.comm(), &type));
  const void* in;
  JAXCOMM_RETURN_IF_ERROR(memory.Input(x, &in));
  JAXCOMM_RETURN_IF_ERROR(memory.Ready());
  call.Log([&] {
    return "MPI_Send -> " + Peer(dest) + " tag " + Tag(tag) + " " +
           Elements(x.element_count(), x.element_type());
  });
  JAXCOMM_MPI_CHECK(call, MPI_Send, in, type.count(), type.type(), static_cast<int>(dest),
                    static_cast<int>(tag), call.comm());
  return memory.Finish();
}

ffi::Error RecvImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer template_buffer,
                    ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y,
                    ffi::Result<ffi::AnyBuffer> envelope, int64_t source, int64_t tag) {
  PointToPoint message =
      PointToPoint::Of(template_buffer.element_type()).Receive(Count(template_buffer));
  const ffi::Error checked = call.Announce(message, &source, &tag);
  if (message.recv_dropped) {
    JAXCOMM_RETURN_IF_ERROR(ReceiveDropped(call, message, source, tag));
  }
  JAXCOMM_RETURN_IF_ERROR(checked);
  JAXCOMM_RETURN_IF_ERROR(CheckOutputs(call, "MPI_Recv", template_buffer, *y, *envelope));
  LargeType type;
  JAXCOMM_RETURN_IF_ERROR(
      LargeType::Make(y->element_type(), y->element_count(), call.comm(), &type));
  void *out, *fields;
  JAXCOMM_RETURN_IF_ERROR(memory.Output(*y, &out));
  JAXCOMM_RETURN_IF_ERROR(memory.HostOutput(*envelope, &fields));
  JAXCOMM_RETURN_IF_ERROR(memory.Ready());
  call.Log([&] {
    return "MPI_Recv <- " + Peer(source) + " tag " + Tag(tag) + " " +
           Elements(y->element_count(), y->element_type());
  });
  MPI_Status status;
  JAXCOMM_MPI_CHECK(call, MPI_Recv, out, type.count(), type.type(), static_cast<int>(source),
                    static_cast<int>(tag), call.comm(), &status);
  return FinishReceive(call, memory, "MPI_Recv", status, type.type(), y->element_count(), *y,
                       *envelope, fields);
}

namespace {

// MPI_Sendrecv of `x` to (dest, sendtag) and into `y` from (source,
// recvtag); shared by the plain and the addressed handler.
ffi::Error Exchange(const Call& call, Memory& memory, ffi::AnyBuffer& x, ffi::AnyBuffer& y,
                    ffi::AnyBuffer& envelope, int64_t source, int64_t dest, int64_t sendtag,
                    int64_t recvtag) {
  JAXCOMM_RETURN_IF_ERROR(CheckOutputs(call, "MPI_Sendrecv", x, y, envelope));
  PointToPoint message = PointToPoint::Of(x.element_type())
                             .Send(dest, SendTag(dest, sendtag), Count(x))
                             .Receive(Count(y));
  const ffi::Error checked = call.Announce(message, &source, &recvtag);
  LargeType send, recv;
  JAXCOMM_RETURN_IF_ERROR(LargeType::Make(x.element_type(), x.element_count(), call.comm(), &send));
  JAXCOMM_RETURN_IF_ERROR(LargeType::Make(y.element_type(), y.element_count(), call.comm(), &recv));
  const void* in;
  void *out, *fields;
  JAXCOMM_RETURN_IF_ERROR(memory.Input(x, &in));
  JAXCOMM_RETURN_IF_ERROR(memory.Output(y, &out));
  JAXCOMM_RETURN_IF_ERROR(memory.HostOutput(envelope, &fields));
  JAXCOMM_RETURN_IF_ERROR(memory.Ready());
  JAXCOMM_RETURN_IF_ERROR(checked);
  // One line per exchange, however the checker splits it into MPI calls.
  const auto log = [&] {
    call.Log([&] {
      return "MPI_Sendrecv -> " + Peer(dest) + " tag " + Tag(sendtag) + " " +
             Elements(x.element_count(), x.element_type()) + " <- " + Peer(source) + " tag " +
             Tag(recvtag) + " " + Elements(y.element_count(), y.element_type());
    });
  };
  if (message.signature_pending) {
    // Checking: this rank's message goes out before it waits for the
    // signature of the one it receives (see AnnouncePointToPoint).
    MPI_Request request;
    JAXCOMM_MPI_CHECK(call, MPI_Isend, in, send.count(), send.type(), static_cast<int>(dest),
                      SendTag(dest, sendtag), call.comm(), &request);
    const ffi::Error fits = call.ReceiveSignature(message, &source, &recvtag);
    log();
    MPI_Status status;
    if (message.recv_dropped) {
      JAXCOMM_RETURN_IF_ERROR(ReceiveDropped(call, message, source, recvtag));
    } else if (fits.success()) {
      JAXCOMM_MPI_CHECK(call, MPI_Recv, out, recv.count(), recv.type(), static_cast<int>(source),
                        static_cast<int>(recvtag), call.comm(), &status);
    }
    JAXCOMM_MPI_CHECK(call, MPI_Wait, &request, MPI_STATUS_IGNORE);
    JAXCOMM_RETURN_IF_ERROR(fits);
    return FinishReceive(call, memory, "MPI_Sendrecv", status, recv.type(), y.element_count(), y,
                         envelope, fields);
  }
  log();
  MPI_Status status;
  JAXCOMM_MPI_CHECK(call, MPI_Sendrecv, in, send.count(), send.type(), static_cast<int>(dest),
                    SendTag(dest, sendtag), out, recv.count(), recv.type(),
                    static_cast<int>(source), static_cast<int>(recvtag), call.comm(), &status);
  return FinishReceive(call, memory, "MPI_Sendrecv", status, recv.type(), y.element_count(), y,
                       envelope, fields);
}

}  // namespace

ffi::Error SendrecvImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                        ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y,
                        ffi::Result<ffi::AnyBuffer> envelope, int64_t source, int64_t dest,
                        int64_t sendtag, int64_t recvtag) {
  return Exchange(call, memory, x, *y, *envelope, source, dest, sendtag, recvtag);
}

// MPI_Sendrecv whose receiving (or sending) side takes its peer and tag
// from `address`, the envelope of an earlier receive: the derivative
// messages of a wildcard receive travel on the path its primal took.
ffi::Error SendrecvAddressedImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer x,
                                 ffi::AnyBuffer address, ffi::Result<ffi::Token>,
                                 ffi::Result<ffi::AnyBuffer> y,
                                 ffi::Result<ffi::AnyBuffer> envelope, int64_t source, int64_t dest,
                                 int64_t sendtag, int64_t recvtag, int64_t addressed) {
  JAXCOMM_RETURN_IF_ERROR(CheckEnvelope(call, "MPI_Sendrecv", address, "the address operand"));
  const void* fields;
  JAXCOMM_RETURN_IF_ERROR(memory.HostInput(address, &fields));
  JAXCOMM_RETURN_IF_ERROR(memory.Ready());
  const int64_t peer = EnvelopeAt(address.element_type(), fields, 0);
  const int64_t tag = EnvelopeAt(address.element_type(), fields, 1);
  if (addressed == kReceiveFromEnvelope) {
    source = peer;
    recvtag = tag;
  } else if (addressed == kSendToEnvelope) {
    dest = peer;
    sendtag = tag;
  } else {
    return Invalid("MPI_Sendrecv", call.comm(),
                   "unknown addressing mode " + std::to_string(addressed));
  }
  return Exchange(call, memory, x, *y, *envelope, source, dest, sendtag, recvtag);
}

// status= inside compiled code: the MPI_Status of an mpi4py MPI.Status
// (at `address`; jaxcomm/ops/p2p.py keeps the object alive for good) takes
// the envelope of the receive before it in program order, when the compiled
// code runs. The fields are those an eager call sets from Python: source,
// tag, no error, and the count in bytes (`itemsize` bytes an element).
ffi::Error WriteStatusImpl(const Call& call, Memory& memory, ffi::Token, ffi::AnyBuffer envelope,
                           ffi::Result<ffi::Token>, int64_t address, int64_t itemsize) {
  JAXCOMM_RETURN_IF_ERROR(CheckEnvelope(call, call.op(), envelope, "the envelope operand"));
  const void* fields;
  JAXCOMM_RETURN_IF_ERROR(memory.HostInput(envelope, &fields));
  JAXCOMM_RETURN_IF_ERROR(memory.Ready());
  const ffi::DataType type = envelope.element_type();
  MPI_Status* status = reinterpret_cast<MPI_Status*>(address);
  status->MPI_SOURCE = static_cast<int>(EnvelopeAt(type, fields, 0));
  status->MPI_TAG = static_cast<int>(EnvelopeAt(type, fields, 1));
  status->MPI_ERROR = MPI_SUCCESS;
  JAXCOMM_MPI_CHECK(call, MPI_Status_set_elements_x, status, MPI_BYTE,
                    static_cast<MPI_Count>(EnvelopeAt(type, fields, 2) * itemsize));
  JAXCOMM_MPI_CHECK(call, MPI_Status_set_cancelled, status, 0);
  return memory.Finish();
}

}  // namespace jaxcomm
