// The nonblocking requests under way (nonblocking.cc), for the reports of
// requests never waited.
#ifndef JAXCOMM_KERNELS_NONBLOCKING_H_
#define JAXCOMM_KERNELS_NONBLOCKING_H_

#include <cstdint>
#include <string>
#include <vector>

namespace jaxcomm {

// Requests started and not yet completed by a wait, as (slot, serial,
// description), skipping those already reported; MarkRequestReported stops
// reporting one.
struct UnfinishedRequest {
  int64_t slot;
  int64_t serial;
  std::string text;
};
std::vector<UnfinishedRequest> UnfinishedRequests();
void MarkRequestReported(int64_t slot, int64_t serial);

}  // namespace jaxcomm

#endif  // JAXCOMM_KERNELS_NONBLOCKING_H_
