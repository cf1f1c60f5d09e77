// Our CUDA kernels (optim_kernels.cu, loss_kernels.cu) compiled for the host, so that a machine
// without a GPU — CI — runs their own source and checks it against the CPU kernels. Never used
// in training: only while a test has switched it on (tg_cuda_emulation_set, in cuda_jit.cpp),
// when launches on CPU tensors come here instead of to the driver.
//
// A launch runs its blocks one after another; a block's 256 threads are fibers (ucontext) on the
// calling thread, run in turn until each reaches a barrier or its end. __syncthreads and every
// __shfl_xor_sync are block-wide barriers here: the kernels call them with the whole block, and
// a block whose threads do not all reach the same barrier (or leave while others wait at one) is
// reported as an error, where a GPU would hang or read garbage. Shared memory is a static per
// kernel instantiation, which running blocks one at a time makes safe. Arithmetic is the host's
// IEEE float and double, compiled with -ffp-contract=off as NVRTC compiles with --fmad=false;
// expf, logf and sqrt come from the host's libm, so the bits of the cross-entropy's exponentials
// and of a double square root may differ from a GPU's in the last place, the rest is the same
// operations in the same order.
#include <c10/util/Half.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda_jit.h"

namespace tg_emulated {
constexpr int kThreads = 256;  // TG_THREADS: every launch is of 256-thread blocks
constexpr std::size_t kStack = 64 * 1024;  // a thread's stack: the kernels keep a few floats

struct Dim3 {
  unsigned int x, y, z;
};

// Where a thread has stopped: at a barrier of some kind, or finished.
enum class Stop { kRunning, kSyncThreads, kShuffleWrite, kShuffleRead, kDone };
const char* stop_name(Stop s) {
  switch (s) {
    case Stop::kSyncThreads: return "__syncthreads";
    case Stop::kShuffleWrite:
    case Stop::kShuffleRead: return "__shfl_xor_sync";
    case Stop::kDone: return "the kernel's end";
    default: return "running";
  }
}

struct Fiber {
  ucontext_t context;
  Stop stop = Stop::kRunning;
};

// The block being run: its index, its threads, the thread running now, and the lanes' words a
// shuffle exchanges.
struct Block {
  Dim3 index{0, 0, 0};
  ucontext_t scheduler;
  std::vector<Fiber> fibers = std::vector<Fiber>(kThreads);
  std::vector<std::unique_ptr<char[]>> stacks;
  int current = 0;
  std::uint64_t lanes[kThreads] = {};
  void (*body)(void**) = nullptr;
  void** args = nullptr;
};
Block* running = nullptr;  // only under launch_lock

Dim3 thread_index() { return Dim3{static_cast<unsigned int>(running->current), 0, 0}; }
Dim3 block_index() { return running->index; }

// The running thread stops at `s` and hands control back to the block's scheduler.
void stop_at(Stop s) {
  Fiber& me = running->fibers[running->current];
  me.stop = s;
  swapcontext(&me.context, &running->scheduler);
}

void __syncthreads() { stop_at(Stop::kSyncThreads); }

// Every lane publishes its value, then reads its partner's (lane ^ lane_mask) once all have.
template <class T>
T __shfl_xor_sync(unsigned int, T value, int lane_mask) {
  static_assert(sizeof(T) <= sizeof(std::uint64_t), "a shuffle moves at most 64 bits");
  std::memcpy(&running->lanes[running->current], &value, sizeof(T));
  stop_at(Stop::kShuffleWrite);
  T out;
  std::memcpy(&out, &running->lanes[running->current ^ lane_mask], sizeof(T));
  stop_at(Stop::kShuffleRead);
  return out;
}

inline unsigned int __float_as_uint(float f) {
  unsigned int u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float __uint_as_float(unsigned int u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float __int_as_float(int i) { return __uint_as_float(static_cast<unsigned int>(i)); }
// c10::Half rounds to nearest, ties to even, as the device's cvt.rn.f16.f32.
inline float tg_half_to_float(unsigned short h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }
inline unsigned short tg_float_to_half(float v) { return c10::Half(v).x; }
using std::max;

#define TG_HOST_EMULATION
#define TG_KERNEL static
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static
#define threadIdx (::tg_emulated::thread_index())
#define blockIdx (::tg_emulated::block_index())
#include "optim_kernels.cu"
#include "loss_kernels.cu"
#undef threadIdx
#undef blockIdx
#undef __shared__

// A kernel's arguments as cuLaunchKernel takes them (an array of pointers to each argument's
// value), unpacked into a call.
template <class... A, std::size_t... I>
void call_with(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
  std::tuple<A...> values;
  ((std::memcpy(&std::get<I>(values), args[I], sizeof(A))), ...);
  kernel(std::get<I>(values)...);
}
template <class... A>
void call(void (*kernel)(A...), void** args) {
  call_with(kernel, args, std::index_sequence_for<A...>{});
}

struct Kernel {
  const char* name;
  void (*body)(void**);
};

#define TG_EMULATED(k) Kernel{#k, [](void** a) { call(&k, a); }}
#define TG_EMULATED_DTYPE(s)                                                                                             \
  TG_EMULATED(tg_adamw8bit_##s), TG_EMULATED(tg_ce_forward_##s), TG_EMULATED(tg_ce_backward_##s),                      \
      TG_EMULATED(tg_adafactor_rows_##s), TG_EMULATED(tg_adafactor_cols_##s), TG_EMULATED(tg_adafactor_col_var_##s),   \
      TG_EMULATED(tg_adafactor_scale_##s), TG_EMULATED(tg_adafactor_usq_##s), TG_EMULATED(tg_adafactor_apply_##s)
const Kernel kKernels[] = {TG_EMULATED(tg_adafactor_coef), TG_EMULATED_DTYPE(f32), TG_EMULATED_DTYPE(bf16), TG_EMULATED_DTYPE(f16)};

std::mutex launch_lock;  // one emulated launch at a time: shared memory and `running` are global
thread_local unsigned long long launches = 0;  // emulated launches made on this thread

void fiber_main() {
  running->body(running->args);
  running->fibers[running->current].stop = Stop::kDone;
  // Returning resumes uc_link, the scheduler.
}

// Runs one block to its end, a round of its threads per barrier.
void run_block(Block& b, const char* kernel) {
  for (int t = 0; t < kThreads; ++t) {
    Fiber& f = b.fibers[t];
    f.stop = Stop::kRunning;
    if (getcontext(&f.context) != 0) throw std::runtime_error("cuda emulation: getcontext failed");
    f.context.uc_stack.ss_sp = b.stacks[t].get();
    f.context.uc_stack.ss_size = kStack;
    f.context.uc_link = &b.scheduler;
    makecontext(&f.context, fiber_main, 0);
  }
  for (;;) {
    for (int t = 0; t < kThreads; ++t) {
      if (b.fibers[t].stop == Stop::kDone) continue;
      b.current = t;
      b.fibers[t].stop = Stop::kRunning;
      swapcontext(&b.scheduler, &b.fibers[t].context);
    }
    const Stop first = b.fibers[0].stop;
    int done = 0;
    for (int t = 0; t < kThreads; ++t) {
      const Stop s = b.fibers[t].stop;
      done += s == Stop::kDone;
      if (s != first && s != Stop::kDone) {
        throw std::logic_error(std::string("cuda emulation: ") + kernel + " block (" + std::to_string(b.index.x) + ", " + std::to_string(b.index.y) +
                               "): thread 0 stopped at " + stop_name(first) + ", thread " + std::to_string(t) + " at " + stop_name(s));
      }
    }
    if (done == kThreads) return;
    if (done > 0) {
      throw std::logic_error(std::string("cuda emulation: ") + kernel + ": " + std::to_string(done) + " threads of block (" +
                             std::to_string(b.index.x) + ", " + std::to_string(b.index.y) + ") ended while the others wait at a barrier");
    }
  }
}
}  // namespace tg_emulated

namespace trainguard {
void* emulated_kernel(const std::string& name) {
  for (const tg_emulated::Kernel& k : tg_emulated::kKernels) {
    if (name == k.name) return const_cast<tg_emulated::Kernel*>(&k);
  }
  throw std::logic_error("cuda emulation: no kernel " + name);
}

void emulated_launch(void* kernel, long long gx, long long gy, void** args) {
  using namespace tg_emulated;
  const Kernel& k = *static_cast<const Kernel*>(kernel);
  std::lock_guard<std::mutex> g(launch_lock);
  ++launches;
  Block b;
  b.body = k.body;
  b.args = args;
  for (int t = 0; t < kThreads; ++t) b.stacks.emplace_back(new char[kStack]);
  running = &b;
  try {
    for (long long y = 0; y < gy; ++y) {
      for (long long x = 0; x < gx; ++x) {
        b.index = Dim3{static_cast<unsigned int>(x), static_cast<unsigned int>(y), 0};
        run_block(b, k.name);
      }
    }
  } catch (...) {
    running = nullptr;
    throw;
  }
  running = nullptr;
}
}  // namespace trainguard

// Emulated launches made on this thread so far: a test's proof that its run took the kernels.
extern "C" unsigned long long tg_cuda_emulation_launches() { return tg_emulated::launches; }
