// The debug log (JAXCOMM_DEBUG, jaxcomm.set_debug): one line on stderr per
// MPI call a handler makes.
#ifndef JAXCOMM_KERNELS_DEBUG_H_
#define JAXCOMM_KERNELS_DEBUG_H_

#include <mpi.h>

#include <string>

namespace jaxcomm {

bool DebugEnabled();
void SetDebug(bool enabled);

// Writes one line to stderr: "r<rank> | <text>".
void DebugLog(MPI_Comm comm, const std::string& text);

}  // namespace jaxcomm

#endif  // JAXCOMM_KERNELS_DEBUG_H_
