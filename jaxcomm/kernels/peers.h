// The peer watch (peers.cc): a side channel that tells a rank when another
// rank's process ended or fell silent, which MPI does not: under a launcher
// that does not end the job when one process dies (srun without
// --kill-on-bad-exit), the survivors would wait for it forever. Each rank
// keeps a TCP connection to its two neighbours in a ring of the world's ranks
// (set up from Python, _peers.py); a thread of this library sends a
// heartbeat byte a second on each and reads what comes back. A process that
// dies has its sockets closed by the kernel at once; one that exits says
// goodbye first (with its exit status); a partition shows as silence.
// Nothing is done per MPI call.
#ifndef JAXCOMM_KERNELS_PEERS_H_
#define JAXCOMM_KERNELS_PEERS_H_

#include <string>
#include <vector>

namespace jaxcomm {

// Watch the connected sockets `fds`, to the world ranks `ranks` on the hosts
// `hosts`, from a thread started here (once; later calls are ignored).
// `me` names this rank and host in reports.
void WatchPeers(const std::vector<int>& fds, const std::vector<int>& ranks,
                const std::vector<std::string>& hosts, const std::string& me);

// Seconds without a byte from a peer before it counts as unreachable.
void SetPeerSilence(double seconds);

// Whether a non-zero exit status is announced to the peers as a failure
// (which ends the job) rather than as a plain goodbye.
void SetAnnounceFailures(bool enabled);

// Tell the peers this process exits now with `status` (an exit handler).
void SayGoodbye(int status);

// The IPv4 addresses of this host's interfaces, loopback last.
std::vector<std::string> InterfaceAddresses();

// MPI_Abort(MPI_COMM_WORLD, status); where MPI_Abort returns (MPICH does
// when its process manager cannot be reached), this process still ends,
// with `status`, after a bounded wait. Never returns.
[[noreturn]] void AbortOrExit(int status);

}  // namespace jaxcomm

#endif  // JAXCOMM_KERNELS_PEERS_H_
