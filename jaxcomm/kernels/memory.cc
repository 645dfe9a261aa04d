#include "memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>

namespace jaxcomm {

namespace {

std::atomic<size_t> huge_page_bytes{size_t{4} << 20};

// MADV_COLLAPSE is given up after this many refusals for want of memory in
// a row (EAGAIN, ENOMEM): where Linux has no free huge pages to give, it
// would otherwise compact memory again on every call.
constexpr int kMaxCollapseRefusals = 8;
std::atomic<int> collapse_refusals{0};

// What AdviseHugePages has done, for HugePageAdvice().
std::atomic<uint64_t> advised_calls{0};
std::atomic<uint64_t> refused_calls{0};
std::atomic<int> last_refusal{0};
std::atomic<uint64_t> collapsed_calls{0};
std::atomic<uint64_t> advised_ends{0};

#ifdef MADV_COLLAPSE
constexpr int kMadvCollapse = MADV_COLLAPSE;
#else
constexpr int kMadvCollapse = 25;  // Linux's value, for older C library headers
#endif

// The size of a transparent huge page, 0 where the kernel has none, and
// why not: the errno of opening or reading Linux's file, or EINVAL for
// content that is not a power of two. Read with open(2), as Python reads it.
struct HugePage {
  size_t size = 0;
  int error = 0;
};

HugePage ReadHugePage() {
  HugePage page;
  const int fd = open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size", O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    page.error = errno;
    return page;
  }
  char text[32] = {};
  const ssize_t got = read(fd, text, sizeof(text) - 1);
  const int read_error = got < 0 ? errno : ENODATA;
  close(fd);
  if (got <= 0) {
    page.error = read_error;
    return page;
  }
  char* end = nullptr;
  const unsigned long long n = std::strtoull(text, &end, 10);
  if (end == text || n == 0 || (n & (n - 1)) != 0) {
    page.error = EINVAL;
    return page;
  }
  page.size = static_cast<size_t>(n);
  return page;
}

const HugePage& TheHugePage() {
  static const HugePage page = ReadHugePage();
  return page;
}

size_t HugePageSize() { return TheHugePage().size; }

#ifdef MADV_HUGEPAGE
// MADV_HUGEPAGE, then MADV_COLLAPSE, on [start, end), whole huge pages.
// `ends`: the pages that hold a buffer's ends (AdviseHugePages), which may
// reach past any mapping; their refusals are not counted.
void AdviseRange(uintptr_t start, uintptr_t end, bool ends) {
  void* range = reinterpret_cast<void*>(start);
  if (madvise(range, end - start, MADV_HUGEPAGE) == 0) {
    (ends ? advised_ends : advised_calls).fetch_add(1, std::memory_order_relaxed);
  } else {
    if (ends) return;
    last_refusal.store(errno, std::memory_order_relaxed);
    refused_calls.fetch_add(1, std::memory_order_relaxed);
  }
  if (collapse_refusals.load(std::memory_order_relaxed) >= kMaxCollapseRefusals) return;
  if (madvise(range, end - start, kMadvCollapse) == 0) {
    collapse_refusals.store(0, std::memory_order_relaxed);
    collapsed_calls.fetch_add(1, std::memory_order_relaxed);
  } else if (!ends && (errno == EAGAIN || errno == ENOMEM)) {
    collapse_refusals.fetch_add(1, std::memory_order_relaxed);
  }
  // EINVAL is not counted: a kernel without MADV_COLLAPSE answers it at
  // once, and Linux 6.18 also answered it here for some of XLA's buffers,
  // beside others it collapsed, in a benchmark that ran faster for them.
}

// The last few buffers whose ends AdviseHugePages left alone.
constexpr int kRecentBuffers = 4;
std::mutex recent_mutex;
std::pair<uintptr_t, size_t> recent[kRecentBuffers] = {};
int recent_next = 0;

// Whether the buffer [begin, begin + bytes) is one of the recent ones;
// remembers it where it is not.
bool SeenLately(uintptr_t begin, size_t bytes) {
  std::lock_guard<std::mutex> lock(recent_mutex);
  for (const auto& buffer : recent) {
    if (buffer.first == begin && buffer.second == bytes) return true;
  }
  recent[recent_next] = {begin, bytes};
  recent_next = (recent_next + 1) % kRecentBuffers;
  return false;
}
#endif

// Advises Linux to back the whole huge pages inside a host buffer of at
// least HugePageBytes() with transparent huge pages, as NumPy does for its
// own arrays (so mpi4py's buffers are on them). MADV_HUGEPAGE covers the
// pages not touched yet: XLA maps a fresh buffer for every large result, and
// MPI then takes one fault per huge page where it writes it, not one per
// 4 KiB. MADV_COLLAPSE (Linux 6.1 and newer) moves the pages XLA has already
// written (a loop's carry, an argument) onto huge pages; on a range that is
// on them already it returns at once, so a buffer used call after call is
// collapsed once. MPI's single-copy transfers then walk one page-table entry
// per huge page. Best effort: where Linux refuses (no THP or THP set to
// "never", an older kernel, no free huge page), nothing changes, and
// repeated refusals of MADV_COLLAPSE stop its use.
//
// XLA aligns its buffers to 64 bytes, so a buffer's ends lie in huge pages
// it shares with its neighbours: half of a 4 MiB buffer. The pages of the
// ends are advised too, neighbours and all, once the same buffer comes
// again within kRecentBuffers calls (a loop's carry, a kept argument, a
// result XLA places where an earlier one was): collapsing them for every
// fresh result cost jitted calls far more than it saved (docs/benchmarks.md,
// "Loops at 4 MiB"). Only below kEndsBelow huge pages: above, the ends are
// a small part of the buffer, and from glibc's mmap threshold on each
// buffer is a fresh mapping, whose ends collapsed call after call.
constexpr uintptr_t kEndsBelow = 8;

void AdviseHugePages(const void* data, size_t bytes) {
#ifdef MADV_HUGEPAGE
  const size_t from = huge_page_bytes.load(std::memory_order_relaxed);
  const uintptr_t huge = HugePageSize();
  if (from == 0 || bytes < from || huge == 0) return;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t start = (begin + huge - 1) & ~(huge - 1);
  const uintptr_t end = (begin + bytes) & ~(huge - 1);
  if (end <= start) return;
  AdviseRange(start, end, false);
  const uintptr_t head = begin & ~(huge - 1);
  const uintptr_t tail = (begin + bytes + huge - 1) & ~(huge - 1);
  if ((head == start && tail == end) || bytes >= kEndsBelow * huge) return;
  if (!SeenLately(begin, bytes)) return;
  if (head < start) AdviseRange(head, start, true);
  if (end < tail) AdviseRange(end, tail, true);
#endif
}

}  // namespace

// The process's helper thread for HostMemory::Forward's copies. It makes one
// copy at a time: a handler that finds it busy (another communicator's call
// on another of XLA's threads) copies for itself.
class CopyHelper {
 public:
  // The helper, its thread started at first use; null where no thread could
  // be started. A child of fork() has no helper thread, so it starts its own.
  static CopyHelper* Get() {
    static std::mutex mutex;
    static CopyHelper* helper = nullptr;
    std::lock_guard<std::mutex> lock(mutex);
    if (helper == nullptr || helper->pid_ != getpid()) {
      auto* fresh = new CopyHelper;  // never freed: its thread waits on it until exit
      try {
        std::thread(&CopyHelper::Run, fresh).detach();
        helper = fresh;
      } catch (const std::system_error&) {
        delete fresh;
        return nullptr;
      }
    }
    return helper;
  }

  // Starts copying `bytes` bytes from `src` to `dst`; false where the helper
  // is busy with another handler's copy.
  bool Start(void* dst, const void* src, size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (claimed_) return false;
    claimed_ = pending_ = true;
    dst_ = dst;
    src_ = src;
    bytes_ = bytes;
    changed_.notify_all();
    return true;
  }

  // Waits for the copy Start began, and frees the helper for the next one.
  void Wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [this] { return !pending_; });
    claimed_ = false;
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      changed_.wait(lock, [this] { return pending_ && dst_ != nullptr; });
      void* dst = dst_;
      dst_ = nullptr;
      lock.unlock();
      std::memcpy(dst, src_, bytes_);
      lock.lock();
      pending_ = false;
      changed_.notify_all();
    }
  }

  const pid_t pid_ = getpid();
  std::mutex mutex_;
  std::condition_variable changed_;
  bool claimed_ = false;  // a handler holds the helper, from Start to Wait
  bool pending_ = false;  // its copy is not done yet
  void* dst_ = nullptr;   // set by Start, taken by the thread
  const void* src_ = nullptr;
  size_t bytes_ = 0;
};

ffi::Error Memory::Forward(const ffi::AnyBuffer& x, ffi::AnyBuffer& y, void** data) {
  JAXCOMM_RETURN_IF_ERROR(Output(y, data));
  return Preload(y, 0, x);
}

HostMemory::~HostMemory() { Finish(); }

ffi::Error HostMemory::Forward(const ffi::AnyBuffer& x, ffi::AnyBuffer& y, void** data) {
  const void* in;
  void* out;
  JAXCOMM_RETURN_IF_ERROR(Input(x, &in));
  JAXCOMM_RETURN_IF_ERROR(Output(y, &out));
  *data = const_cast<void*>(in);        // MPI only reads it
  const size_t bytes = x.size_bytes();  // y's too: the handler checked the output
  CopyHelper* helper = bytes >= kCopyAsideBytes && aside_ == nullptr ? CopyHelper::Get() : nullptr;
  if (helper != nullptr && helper->Start(out, in, bytes)) {
    aside_ = helper;
    return ffi::Error::Success();
  }
  return Preload(y, 0, x);
}

ffi::Error HostMemory::Finish() {
  if (aside_ != nullptr) {
    aside_->Wait();
    aside_ = nullptr;
  }
  return ffi::Error::Success();
}

size_t HugePageBytes() { return huge_page_bytes.load(std::memory_order_relaxed); }

void SetHugePageBytes(size_t bytes) { huge_page_bytes.store(bytes); }

HugePageCounts HugePageAdvice() {
  HugePageCounts counts;
  counts.page_size = TheHugePage().size;
  counts.page_size_errno = TheHugePage().error;
  counts.advised = advised_calls.load(std::memory_order_relaxed);
  counts.refused = refused_calls.load(std::memory_order_relaxed);
  counts.last_errno = last_refusal.load(std::memory_order_relaxed);
  counts.collapsed = collapsed_calls.load(std::memory_order_relaxed);
  counts.advised_ends = advised_ends.load(std::memory_order_relaxed);
  counts.collapse_stopped =
      collapse_refusals.load(std::memory_order_relaxed) >= kMaxCollapseRefusals;
  return counts;
}

ffi::Error HostMemory::Input(const ffi::AnyBuffer& x, const void** data) {
  AdviseHugePages(x.untyped_data(), x.size_bytes());
  *data = x.untyped_data();
  return ffi::Error::Success();
}

ffi::Error HostMemory::Output(ffi::AnyBuffer& y, void** data) {
  AdviseHugePages(y.untyped_data(), y.size_bytes());
  *data = y.untyped_data();
  return ffi::Error::Success();
}

ffi::Error HostMemory::InPlace(ffi::AnyBuffer& y, void** data) { return Output(y, data); }

ffi::Error HostMemory::HostInput(const ffi::AnyBuffer& x, const void** data) {
  return Input(x, data);
}

ffi::Error HostMemory::HostOutput(ffi::AnyBuffer& y, void** data) { return Output(y, data); }

ffi::Error HostMemory::Preload(ffi::AnyBuffer& y, size_t offset, const ffi::AnyBuffer& x) {
  if (x.size_bytes() > 0) {
    std::memcpy(static_cast<char*>(y.untyped_data()) + offset, x.untyped_data(), x.size_bytes());
  }
  return ffi::Error::Success();
}

ffi::Error HostMemory::ZeroFrom(ffi::AnyBuffer& y, size_t offset) {
  if (offset < y.size_bytes()) {
    std::memset(static_cast<char*>(y.untyped_data()) + offset, 0, y.size_bytes() - offset);
  }
  return ffi::Error::Success();
}

ffi::Error HostMemory::HoldInput(const ffi::AnyBuffer& x, const void** data, Held* held) {
  AdviseHugePages(x.untyped_data(), x.size_bytes());
  *held = Held{x.untyped_data(), x.size_bytes(), nullptr};
  *data = x.untyped_data();
  return ffi::Error::Success();
}

ffi::Error HostMemory::HoldOutput(ffi::AnyBuffer& y, void** data, Held* held) {
  AdviseHugePages(y.untyped_data(), y.size_bytes());
  *held = Held{y.untyped_data(), y.size_bytes(), nullptr};
  *data = y.untyped_data();
  return ffi::Error::Success();
}

ffi::Error HostMemory::Unhold(Held& held, ffi::AnyBuffer* out, size_t filled) {
  if (out != nullptr) {
    char* data = static_cast<char*>(out->untyped_data());
    if (filled > out->size_bytes()) filled = out->size_bytes();
    if (data != held.buffer && filled > 0) std::memcpy(data, held.buffer, filled);
    ZeroFrom(*out, filled);
  }
  held = Held{};
  return ffi::Error::Success();
}

}  // namespace jaxcomm
