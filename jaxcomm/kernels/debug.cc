#include "debug.h"

#include <atomic>
#include <cstdio>

#include "handles.h"

namespace jaxcomm {
namespace {
std::atomic<bool> debug_enabled{false};
}  // namespace

bool DebugEnabled() { return debug_enabled.load(std::memory_order_relaxed); }

void SetDebug(bool enabled) { debug_enabled.store(enabled); }

void DebugLog(MPI_Comm comm, const std::string& text) {
  // One fprintf per line keeps lines whole when ranks share a terminal.
  std::fprintf(stderr, "r%d | %s\n", CommRank(comm), text.c_str());
  std::fflush(stderr);
}

}  // namespace jaxcomm
