#include "handles.h"

#include <atomic>
#include <mutex>
#include <string>

namespace jaxcomm {
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
  const MPI_Comm comm = CommFromInt(static_cast<IntHandle>(fortran_handle));
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

IntHandle FortranHandle(int64_t handle) {
  return static_cast<IntHandle>(static_cast<int32_t>(handle & 0xffffffff));
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

}  // namespace jaxcomm
