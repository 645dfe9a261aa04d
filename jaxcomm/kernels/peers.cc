// The peer watch: see peers.h. The bytes on a connection are 'h' (a
// heartbeat), 'b' (goodbye: exiting normally) and 'f' followed by one byte
// (exiting with that non-zero status). A peer's connection that ends after
// 'b' is forgotten; one that ends otherwise, or after 'f', or stays silent
// longer than the limit ends the job.
#include "peers.h"

#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <mpi.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <thread>

#include "handles.h"
#include "monitor.h"

namespace jaxcomm {
namespace {

using Clock = std::chrono::steady_clock;

struct Peer {
  int fd;
  int rank;
  std::string host;
  Clock::time_point last_heard;
  bool said_goodbye = false;
  bool status_next = false;  // the byte after 'f'
};

// Created once and never destroyed: the thread may run while the process exits.
struct PeerTable {
  std::mutex mutex;
  std::vector<Peer> peers;
  std::string me;
  bool started = false;
};
PeerTable& ThePeers() {
  static PeerTable* table = new PeerTable;
  return *table;
}

std::atomic<double> silence_s{60.0};
std::atomic<bool> announce_failures{true};
std::atomic<bool> ending{false};
// The process that watches: a child forked later inherits the sockets and
// the exit handler, but must not say goodbye on them.
std::atomic<pid_t> watcher{0};

// How long a process whose MPI_Abort returned waits before it ends itself:
// the process manager may still be killing the job, and its own report of
// that is worth keeping.
constexpr int kAbortGraceMs = 2000;
// The pause before MPI_Abort that lets the launcher forward the report.
constexpr int kForwardMs = 500;

bool MpiLive() {
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

void EndJob(const Peer& peer, const std::string& what, int status) {
  if (ending.exchange(true)) return;
  PeerTable& watch = ThePeers();
  std::fprintf(stderr,
               "jaxcomm: rank %d on host %s %s; %s was in %s: aborting the job "
               "(JAXCOMM_PEER_WATCH=0 turns this off)\n",
               peer.rank, peer.host.c_str(), what.c_str(), watch.me.c_str(),
               CallInFlightText().c_str());
  std::fflush(stderr);
  // A peer that is gone while this process has finalised MPI ended a job
  // that had finished its communication: nothing is left waiting.
  if (!MpiLive()) return;
  std::this_thread::sleep_for(std::chrono::milliseconds(kForwardMs));
  AbortOrExit(status);
}

void Send(Peer& peer, const char* bytes, size_t n) {
  // MSG_NOSIGNAL: a dead peer's socket must not SIGPIPE this process; the
  // closed connection is read as such on the next poll.
  if (peer.fd >= 0) send(peer.fd, bytes, n, MSG_NOSIGNAL | MSG_DONTWAIT);
}

// Reads what `peer` sent; false when its connection ended.
bool Read(Peer& peer, Clock::time_point now, int* failed_status) {
  char buffer[256];
  const ssize_t got = recv(peer.fd, buffer, sizeof buffer, MSG_DONTWAIT);
  if (got == 0) return false;
  if (got < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
  peer.last_heard = now;
  for (ssize_t i = 0; i < got; ++i) {
    const unsigned char byte = static_cast<unsigned char>(buffer[i]);
    if (peer.status_next) {
      peer.status_next = false;
      *failed_status = byte == 0 ? 1 : byte;
    } else if (byte == 'b') {
      peer.said_goodbye = true;
    } else if (byte == 'f') {
      peer.status_next = true;
    }
  }
  return true;
}

void WatchLoop() {
  PeerTable& watch = ThePeers();
  auto last_sent = Clock::now() - std::chrono::seconds(1);
  for (;;) {
    std::vector<pollfd> fds;
    {
      std::lock_guard<std::mutex> lock(watch.mutex);
      for (const Peer& peer : watch.peers) {
        if (peer.fd >= 0) fds.push_back(pollfd{peer.fd, POLLIN, 0});
      }
    }
    if (fds.empty()) return;
    const double limit = silence_s.load();
    // One heartbeat a second at most, and four per silence limit: a late
    // report by a fraction of the limit costs nothing.
    const double period = std::min(1.0, limit / 4);
    poll(fds.data(), fds.size(), static_cast<int>(period * 1000));
    const auto now = Clock::now();
    std::lock_guard<std::mutex> lock(watch.mutex);
    const bool beat = std::chrono::duration<double>(now - last_sent).count() >= period;
    if (beat) last_sent = now;
    for (Peer& peer : watch.peers) {
      if (peer.fd < 0) continue;
      int failed_status = 0;
      const bool open = Read(peer, now, &failed_status);
      if (failed_status != 0) {
        EndJob(peer, "exited with status " + std::to_string(failed_status), failed_status);
      }
      if (!open) {
        close(peer.fd);
        peer.fd = -1;
        if (!peer.said_goodbye) {
          EndJob(peer,
                 "ended without a goodbye (its process died: killed, crashed, or "
                 "os._exit)",
                 1);
        }
        continue;
      }
      const double silent = std::chrono::duration<double>(now - peer.last_heard).count();
      if (!peer.said_goodbye && silent > limit) {
        EndJob(peer,
               "has not been heard from for " + std::to_string(static_cast<int>(silent)) +
                   " s (a network partition, or its host is down), longer than the limit of " +
                   std::to_string(static_cast<int>(limit)) + " s (JAXCOMM_TIMEOUT)",
               1);
      }
      if (beat && !ending.load()) Send(peer, "h", 1);
    }
  }
}

}  // namespace

void WatchPeers(const std::vector<int>& fds, const std::vector<int>& ranks,
                const std::vector<std::string>& hosts, const std::string& me) {
  PeerTable& watch = ThePeers();
  {
    std::lock_guard<std::mutex> lock(watch.mutex);
    if (watch.started) return;
    watch.started = true;
    watch.me = me;
    watcher.store(getpid());
    const auto now = Clock::now();
    for (size_t i = 0; i < fds.size(); ++i) {
      Peer peer;
      peer.fd = fds[i];
      peer.rank = ranks[i];
      peer.host = hosts[i];
      peer.last_heard = now;
      watch.peers.push_back(peer);
    }
  }
  std::thread(WatchLoop).detach();
}

void SetPeerSilence(double seconds) { silence_s.store(seconds); }

void SetAnnounceFailures(bool enabled) { announce_failures.store(enabled); }

void SayGoodbye(int status) {
  PeerTable& watch = ThePeers();
  // Checked before the lock, which a child may have inherited held.
  if (watcher.load() != getpid()) return;
  std::lock_guard<std::mutex> lock(watch.mutex);
  const char failed[2] = {'f', static_cast<char>(status & 0xff)};
  for (Peer& peer : watch.peers) {
    if (status != 0 && announce_failures.load()) {
      Send(peer, failed, 2);
    } else {
      Send(peer, "b", 1);
    }
  }
}

std::vector<std::string> InterfaceAddresses() {
  std::vector<std::string> out;
  std::vector<std::string> loopback;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (ifaddrs* entry = list; entry != nullptr; entry = entry->ifa_next) {
    if (entry->ifa_addr == nullptr || entry->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN];
    const auto* address = reinterpret_cast<const sockaddr_in*>(entry->ifa_addr);
    if (inet_ntop(AF_INET, &address->sin_addr, text, sizeof text) == nullptr) continue;
    const bool is_loopback = (ntohl(address->sin_addr.s_addr) >> 24) == 127;
    (is_loopback ? loopback : out).push_back(text);
  }
  freeifaddrs(list);
  out.insert(out.end(), loopback.begin(), loopback.end());
  return out;
}

void AbortOrExit(int status) {
  MPI_Abort(MPI_COMM_WORLD, status);
  std::fprintf(stderr,
               "jaxcomm: MPI_Abort returned on rank %d: this process ends itself "
               "with status %d in %d ms\n",
               WorldRank(), status, kAbortGraceMs);
  std::fflush(stderr);
  std::this_thread::sleep_for(std::chrono::milliseconds(kAbortGraceMs));
  _exit(status);
}

}  // namespace jaxcomm
