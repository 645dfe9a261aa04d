// The communicators handlers reach through their "handle" attribute, and the
// ranks that log lines and error messages name.
#ifndef JAXCOMM_KERNELS_HANDLES_H_
#define JAXCOMM_KERNELS_HANDLES_H_

#include <mpi.h>

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

namespace ffi = xla::ffi;

// Makes `comm` known to the handlers and returns the value of the "handle"
// attribute that stands for it: its Fortran handle in the low 32 bits and a
// serial number above, never reused in this process, so that a compiled call
// whose communicator was freed cannot reach another one that MPI created
// under the same handle.
ffi::Error RegisterComm(int64_t fortran_handle, int64_t* handle);

// Forgets a handle from RegisterComm: handlers refuse it from now on.
void UnregisterComm(int64_t handle);

// The Fortran handle inside a value from RegisterComm.
MPI_Fint FortranHandle(int64_t handle);

// The live communicator behind a "handle" attribute, or an error naming `op`
// if it was freed (or never registered). Takes no lock and allocates nothing
// unless it fails: every handler call on a communicator starts with it.
ffi::Error CommFromHandle(int64_t handle, const char* op, MPI_Comm* comm);

// Rank in `comm`, for log lines and error messages.
int CommRank(MPI_Comm comm);

// Number of ranks in `comm`.
int CommSize(MPI_Comm comm);

// Rank in MPI_COMM_WORLD, or -1 outside MPI_Init..MPI_Finalize.
int WorldRank();

}  // namespace jaxcomm

#endif  // JAXCOMM_KERNELS_HANDLES_H_
