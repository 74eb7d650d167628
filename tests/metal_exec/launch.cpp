// Runs a Metal kernel's launch on the CPU: threadgroups taken in turn by a few OS threads,
// each running one threadgroup at a time (threadgroup.cpp). Buffers are copied into mappings
// that end at an inaccessible page, inputs read-only, so a write to an input or a read past a
// buffer's end faults, which ends the launch with an error instead of the process.
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

#include "worker.h"

namespace {

struct Buffer {
  char* map = nullptr;
  size_t len = 0;
  char* data = nullptr;
};

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

// A copy of n bytes at src ending at an inaccessible page, read-only unless writable.
bool guarded_copy(Buffer& b, const void* src, size_t n, bool writable) {
  const size_t page = tqx::page_size();
  const size_t len = round_up(n, 16);
  const size_t body = round_up(len, page);
  b.len = body + page;
  b.map = static_cast<char*>(
      mmap(nullptr, b.len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (b.map == MAP_FAILED) return false;
  mprotect(b.map + body, page, PROT_NONE);
  b.data = b.map + body - len;
  std::memcpy(b.data, src, n);
  if (!writable) mprotect(b.map, body, PROT_READ);
  return true;
}

}  // namespace

// Runs the kernel over `grid` threads in threadgroups of `group` threads, as MLX dispatches
// a metal_kernel (dispatchThreads; group clipped to the grid, the last threadgroup of a
// dimension smaller where the grid does not divide). buffers: the kernel's buffer arguments
// in order, nbytes each; writable ones are copied back. Returns 0, or 1 with the error in
// err. stats: [peak threadgroup bytes, bitmask of the declaration sites reached].
extern "C" int tqx_launch(void* const* buffers, const unsigned long* nbytes, const int* writable,
                          int nbuf, const unsigned* grid, const unsigned* group,
                          unsigned long smem_limit, int workers, unsigned long long seed,
                          unsigned long long* stats, char* err, int errlen) {
  using namespace tqx;
  auto report = [&](const std::string& msg) {
    std::snprintf(err, size_t(errlen), "%s", msg.c_str());
    return 1;
  };
  const Dim3 gd{std::min(group[0], grid[0]), std::min(group[1], grid[1]),
                std::min(group[2], grid[2])};
  if (gd.x == 0 || gd.y == 0 || gd.z == 0) return report("empty grid or threadgroup");
  const unsigned long threads = (unsigned long)group[0] * group[1] * group[2];
  if (threads > (unsigned long)kMaxThreads) {
    return report("threadgroup of " + std::to_string(threads) + " threads, over " +
                  std::to_string(kMaxThreads));
  }
  const Dim3 groups{(grid[0] + gd.x - 1) / gd.x, (grid[1] + gd.y - 1) / gd.y,
                    (grid[2] + gd.z - 1) / gd.z};
  const uint64_t total = uint64_t(groups.x) * groups.y * groups.z;

  std::vector<Buffer> bufs(static_cast<size_t>(nbuf));
  std::vector<void*> ptrs(static_cast<size_t>(nbuf));
  bool mapped = true;
  for (int i = 0; i < nbuf; ++i) {
    mapped = mapped && guarded_copy(bufs[size_t(i)], buffers[i], nbytes[i], writable[i] != 0);
    ptrs[size_t(i)] = bufs[size_t(i)].data;
  }

  std::atomic<uint64_t> next{0};
  std::atomic<bool> stop{!mapped};
  std::mutex mu;
  std::string first_error = mapped ? "" : "mmap failed";
  unsigned long long peak = 0, reached = 0;
  auto work = [&]() {
    Worker w;
    worker_begin(w, int(gd.x * gd.y * gd.z), smem_limit, ptrs.data());
    for (uint64_t id; !stop && (id = next++) < total;) {
      ThreadPos p{};
      p.group = {unsigned(id % groups.x), unsigned(id / groups.x % groups.y),
                 unsigned(id / (uint64_t(groups.x) * groups.y))};
      p.dispatch_size = gd;
      p.group_size = {std::min(gd.x, grid[0] - p.group.x * gd.x),
                      std::min(gd.y, grid[1] - p.group.y * gd.y),
                      std::min(gd.z, grid[2] - p.group.z * gd.z)};
      p.groups = groups;
      p.grid = {grid[0], grid[1], grid[2]};
      p.threads = p.group_size.x * p.group_size.y * p.group_size.z;
      if (!run_group(w, p, seed == 0 ? 0 : seed ^ (id * 0xD1B54A32D192ED03ull))) {
        std::lock_guard<std::mutex> lock(mu);
        if (first_error.empty()) {
          first_error = "threadgroup (" + std::to_string(p.group.x) + ", " +
                        std::to_string(p.group.y) + ", " + std::to_string(p.group.z) +
                        "): " + w.error;
        }
        stop = true;
      }
    }
    worker_end(w);
    std::lock_guard<std::mutex> lock(mu);
    peak = std::max<unsigned long long>(peak, w.peak);
    reached |= w.reached;
  };
  install_fault_handler();
  const int nw = int(std::min<uint64_t>(uint64_t(std::max(workers, 1)), total));
  std::vector<std::thread> pool;
  for (int i = 1; i < nw; ++i) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
  remove_fault_handler();

  for (int i = 0; i < nbuf; ++i) {
    if (writable[i] && first_error.empty()) {
      std::memcpy(buffers[i], bufs[size_t(i)].data, nbytes[i]);
    }
    if (bufs[size_t(i)].map != nullptr && bufs[size_t(i)].map != MAP_FAILED) {
      munmap(bufs[size_t(i)].map, bufs[size_t(i)].len);
    }
  }
  stats[0] = peak;
  stats[1] = reached;
  return first_error.empty() ? 0 : report(first_error);
}
