// The communicators handlers reach through their "handle" attribute, and the
// ranks that log lines and error messages name.
#ifndef JAXCOMM_KERNELS_HANDLES_H_
#define JAXCOMM_KERNELS_HANDLES_H_

#include <mpi.h>

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

namespace ffi = xla::ffi;

// The integers that stand for communicators and ops between Python and the
// kernels are what mpi4py's py2f() gives and f2py() takes: Fortran handles
// (MPI_Comm_c2f), except under the MPI-5 standard ABI (mpi_abi.h), whose C
// library has no Fortran handles and where mpi4py converts with
// MPI_Comm_toint instead. The kernels convert as mpi4py does.
#if defined(MPI_ABI_VERSION) && MPI_ABI_VERSION >= 1
using IntHandle = int;
inline MPI_Comm CommFromInt(IntHandle comm) { return MPI_Comm_fromint(comm); }
inline IntHandle CommToInt(MPI_Comm comm) { return MPI_Comm_toint(comm); }
inline IntHandle OpToInt(MPI_Op op) { return MPI_Op_toint(op); }
#else
using IntHandle = MPI_Fint;
inline MPI_Comm CommFromInt(IntHandle comm) { return MPI_Comm_f2c(comm); }
inline IntHandle CommToInt(MPI_Comm comm) { return MPI_Comm_c2f(comm); }
inline IntHandle OpToInt(MPI_Op op) { return MPI_Op_c2f(op); }
#endif

// Makes `comm` known to the handlers and returns the value of the "handle"
// attribute that stands for it: its mpi4py py2f() integer in the low 32 bits and a
// serial number above, never reused in this process, so that a compiled call
// whose communicator was freed cannot reach another one that MPI created
// under the same handle.
ffi::Error RegisterComm(int64_t fortran_handle, int64_t* handle);

// Forgets a handle from RegisterComm: handlers refuse it from now on.
void UnregisterComm(int64_t handle);

// The py2f() integer inside a value from RegisterComm.
IntHandle FortranHandle(int64_t handle);

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
