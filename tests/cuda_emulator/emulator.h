// A CPU stand-in for the CUDA runtime, just enough to run csrc/cuda/tree_ops.cu's kernels
// and launch code unchanged on a machine without a GPU (tests/ops/test_cuda_emulated.py). Each
// thread of a block is a std::thread; __syncthreads() is a barrier, which the block's
// threads must reach from one place (a divergent one is reported); a block's dynamic
// shared memory is a fresh buffer of exactly the launch's size, filled with junk (CUDA does
// not zero it) and followed by guard bytes checked after the block. Launches are checked
// against an H200's limits, the 48 KiB default of dynamic shared memory included, and a bad
// one fails as on a GPU: nothing runs and the error surfaces at C10_CUDA_KERNEL_LAUNCH_CHECK.
// Blocks run one after another, in a shuffled order (a GPU promises none); what it cannot
// show is timing, or a race between blocks. Warp shuffles exchange through a per-warp
// barrier, which a warp's threads must likewise reach from one place.
// Only runtime calls that never wait for the device are defined, so a cudaMemcpy or a
// stream synchronize added to the .cu fails to build here.
#pragma once
#include <ATen/ATen.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <source_location>
#include <string>
#include <thread>
#include <vector>

#define DDTREE_CUDA_EMULATOR 1
#define __global__
#define __device__
#define DDTREE_LAUNCH(kernel, grid, block, smem, stream) \
  cuda_emulator::Launch(kernel, grid, block, smem, stream)
#define DDTREE_DYNAMIC_SMEM(name) unsigned char* const name = cuda_emulator::dynamic_smem()
// The build kernel's threads per block at most (1024 on a GPU): a test sets it, to run the
// kernel's multi-warp paths at several widths and the many small cases quickly.
#define DDTREE_BUILD_MAX_THREADS cuda_emulator::build_max_threads
// Requests the build kernel built in parallel, and serially.
#define DDTREE_COUNT_BUILD(parallel) ++cuda_emulator::builds[(parallel) ? 0 : 1]

struct dim3 {
  unsigned int x, y, z;
  dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
  unsigned int x = 0, y = 0, z = 0;
};
inline thread_local uint3 threadIdx, blockIdx;
inline thread_local dim3 blockDim, gridDim;

using cudaStream_t = void*;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorLaunchFailure = 2 };
enum cudaDeviceAttr { cudaDevAttrMaxSharedMemoryPerBlockOptin };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };

namespace cuda_emulator {

// An H200's (sm_90) limits.
constexpr size_t kDefaultSmem = 48 * 1024, kOptinSmem = 227 * 1024;
constexpr unsigned int kMaxThreads = 1024, kMaxGridX = 2147483647u, kMaxGridYZ = 65535;
constexpr size_t kMaxParamBytes = 4096;  // the classic limit (sm_90 allows more since 12.1)
constexpr size_t kGuardBytes = 64;
constexpr unsigned char kJunk = 0xA5, kGuard = 0x5A;
inline int build_max_threads = 1024;
inline std::atomic<int64_t> builds[2];

inline std::string& last_error() {
  static std::string error;
  return error;
}
inline std::map<const void*, size_t>& max_dynamic_smem() {  // set by cudaFuncSetAttribute
  static std::map<const void*, size_t> sizes;
  return sizes;
}

// A barrier whose threads may leave early (a returned thread no longer holds others up).
// It notes a phase whose threads arrived from different places: __syncthreads() in
// divergent code, which CUDA leaves undefined and a count of arrivals would hide.
class Barrier {
 public:
  explicit Barrier(unsigned int count, std::function<void()> on_phase = {})
      : expected_(count), on_phase_(std::move(on_phase)) {}
  // Returns the sum of `add` over the phase's threads (__syncthreads_count).
  int arrive_and_wait(const std::source_location& site = std::source_location::current(),
                      int add = 0) {
    uint64_t phase;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      phase = phase_.load();
      if (arrived_ == 0) {
        line_ = site.line();
      } else if (site.line() != line_) {
        divergent_ = true;
      }
      sum_ += add;
      if (++arrived_ == expected_) {
        next_phase();
        return last_sum_;
      }
    }
    phase_.wait(phase);  // a futex wait: no lock to take back on waking
    return last_sum_;  // stable until every thread of the phase has arrived again
  }
  void arrive_and_drop() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (--expected_ > 0 && arrived_ == expected_) next_phase();
  }
  bool divergent() {
    std::lock_guard<std::mutex> lock(mutex_);
    return divergent_;
  }

 private:
  void next_phase() {
    if (on_phase_) on_phase_();
    last_sum_ = sum_;
    sum_ = 0;
    arrived_ = 0;
    ++phase_;
    phase_.notify_all();
  }
  std::mutex mutex_;
  unsigned int expected_, arrived_ = 0;
  std::atomic<uint64_t> phase_ = 0;
  uint32_t line_ = 0;
  int sum_ = 0, last_sum_ = 0;
  bool divergent_ = false;
  std::function<void()> on_phase_;
};

constexpr unsigned int kWarpSize = 32;

// A warp's shuffle exchange: each lane's value, then a barrier, then the reads.
struct Warp {
  explicit Warp(unsigned int lanes) : barrier(lanes) {}
  Barrier barrier;
  uint64_t slots[kWarpSize] = {};
};

struct Block {
  Barrier barrier;
  std::vector<std::unique_ptr<Warp>> warps;
  std::vector<unsigned char> smem;
  size_t size;
  Block(unsigned int threads, size_t bytes)
      : barrier(threads), smem(bytes + kGuardBytes, kJunk), size(bytes) {
    std::memset(smem.data() + bytes, kGuard, kGuardBytes);
    for (unsigned int t = 0; t < threads; t += kWarpSize) {
      warps.push_back(std::make_unique<Warp>(std::min(kWarpSize, threads - t)));
    }
  }
  bool divergent() {
    bool any = barrier.divergent();
    for (auto& w : warps) any = any || w->barrier.divergent();
    return any;
  }
  bool guard_intact() const {
    for (size_t i = size; i < smem.size(); ++i) {
      if (smem[i] != kGuard) return false;
    }
    return true;
  }
};
inline thread_local Block* current_block = nullptr;
inline thread_local unsigned int linear_thread = 0;

inline unsigned char* dynamic_smem() { return current_block->smem.data(); }

// Runs the grid: blockDim threads take every block in turn, so a block's threads run
// concurrently and blocks one after another, in an order shuffled per launch.
template <typename... Params>
std::string run(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                Params... params) {
  const unsigned int threads = block.x * block.y * block.z;
  const uint64_t blocks = static_cast<uint64_t>(grid.x) * grid.y * grid.z;
  static std::mt19937_64 shuffler(0);
  std::vector<uint64_t> order(blocks);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), shuffler);
  auto current = std::make_unique<Block>(threads, smem);
  uint64_t overflows = 0, divergent = 0;
  Barrier between(threads, [&] {
    overflows += !current->guard_intact();
    divergent += current->divergent();
    current = std::make_unique<Block>(threads, smem);
  });
  std::vector<std::thread> workers;
  for (unsigned int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      threadIdx = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
      linear_thread = t;
      blockDim = block;
      gridDim = grid;
      for (const uint64_t b : order) {
        current_block = current.get();  // replaced only while every thread waits below
        blockIdx = {static_cast<unsigned int>(b % grid.x),
                    static_cast<unsigned int>(b / grid.x % grid.y),
                    static_cast<unsigned int>(b / grid.x / grid.y)};
        kernel(params...);
        current_block->barrier.arrive_and_drop();
        current_block->warps[t / kWarpSize]->barrier.arrive_and_drop();
        between.arrive_and_wait();
      }
    });
  }
  for (auto& w : workers) w.join();
  if (overflows > 0) {
    return "a kernel wrote past its dynamic shared memory (" + std::to_string(smem) +
           " bytes) in " + std::to_string(overflows) + " block(s)";
  }
  if (divergent > 0) {
    return "__syncthreads() or a shuffle reached from different places by one block's "
           "(or warp's) threads, in " +
           std::to_string(divergent) + " block(s)";
  }
  return "";
}

// kernel<<<grid, block, smem, stream>>>(args...), spelt Launch(kernel, grid, block, smem,
// stream)(args...).
template <typename... Params>
struct Launch {
  void (*kernel)(Params...);
  dim3 grid, block;
  size_t smem;
  Launch(void (*k)(Params...), dim3 g, dim3 b, size_t s, cudaStream_t)
      : kernel(k), grid(g), block(b), smem(s) {}
  template <typename... Args>
  void operator()(Args&&... args) const {
    std::string& error = last_error();
    const unsigned int threads = block.x * block.y * block.z;
    const auto optin = max_dynamic_smem().find(reinterpret_cast<const void*>(kernel));
    const size_t allowed = optin == max_dynamic_smem().end() ? kDefaultSmem : optin->second;
    if (threads == 0 || threads > kMaxThreads) {
      error = "invalid block of " + std::to_string(threads) + " threads";
    } else if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > kMaxGridX ||
               grid.y > kMaxGridYZ || grid.z > kMaxGridYZ) {
      error = "invalid grid";
    } else if (smem > allowed) {
      error = "too many resources requested for launch: " + std::to_string(smem) +
              " bytes of dynamic shared memory, " + std::to_string(allowed) + " allowed";
    } else if ((sizeof(Params) + ... + 0) > kMaxParamBytes) {
      error = "kernel parameters exceed " + std::to_string(kMaxParamBytes) + " bytes";
    } else {
      const std::string failed = run<Params...>(kernel, grid, block, smem,
                                                static_cast<Params>(args)...);
      if (!failed.empty()) error = failed;
    }
  }
};

}  // namespace cuda_emulator

inline void __syncthreads(std::source_location site = std::source_location::current()) {
  cuda_emulator::current_block->barrier.arrive_and_wait(site);
}

inline int __syncthreads_count(int predicate,
                               std::source_location site = std::source_location::current()) {
  return cuda_emulator::current_block->barrier.arrive_and_wait(site, predicate != 0);
}

// Lane `src_of(lane)`'s value (its own where that is out of the warp), as every lane of the
// warp calls it with the full mask.
template <typename T, typename Src>
T emulated_shuffle(T value, Src src_of, const std::source_location& site) {
  static_assert(sizeof(T) <= sizeof(uint64_t));
  using cuda_emulator::kWarpSize;
  const unsigned int t = cuda_emulator::linear_thread, lane = t % kWarpSize;
  auto& warp = *cuda_emulator::current_block->warps[t / kWarpSize];
  std::memcpy(&warp.slots[lane], &value, sizeof(T));
  warp.barrier.arrive_and_wait(site);
  const int src = src_of(static_cast<int>(lane));
  T got = value;
  if (src >= 0 && src < static_cast<int>(kWarpSize)) std::memcpy(&got, &warp.slots[src], sizeof(T));
  warp.barrier.arrive_and_wait(site);
  return got;
}

template <typename T>
T __shfl_up_sync(unsigned int, T value, unsigned int delta,
                 std::source_location site = std::source_location::current()) {
  return emulated_shuffle(value, [&](int lane) { return lane - static_cast<int>(delta); },
                          site);
}

template <typename T>
T __shfl_sync(unsigned int, T value, int src_lane,
              std::source_location site = std::source_location::current()) {
  return emulated_shuffle(value, [&](int) { return src_lane; }, site);
}

inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr, int) {
  *value = static_cast<int>(cuda_emulator::kOptinSmem);
  return cudaSuccess;
}

template <typename Kernel>
cudaError_t cudaFuncSetAttribute(Kernel* kernel, cudaFuncAttribute, int value) {
  if (value < 0 || static_cast<size_t>(value) > cuda_emulator::kOptinSmem) {
    return cudaErrorInvalidValue;
  }
  cuda_emulator::max_dynamic_smem()[reinterpret_cast<const void*>(kernel)] = value;
  return cudaSuccess;
}

namespace c10::cuda {
struct CUDAGuard {
  explicit CUDAGuard(c10::Device) {}
};
struct CUDAStream {
  operator cudaStream_t() const { return nullptr; }
};
inline CUDAStream getCurrentCUDAStream() { return {}; }
}  // namespace c10::cuda

#define C10_CUDA_CHECK(expr) \
  TORCH_CHECK((expr) == cudaSuccess, "emulated CUDA call failed: " #expr)
#define C10_CUDA_KERNEL_LAUNCH_CHECK()                                       \
  do {                                                                       \
    const std::string error = std::exchange(cuda_emulator::last_error(), ""); \
    TORCH_CHECK(error.empty(), "CUDA kernel launch failed: ", error);        \
  } while (0)
