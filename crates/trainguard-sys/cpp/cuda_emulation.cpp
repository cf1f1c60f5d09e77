// Our CUDA kernels (optim_kernels.cu, loss_kernels.cu, norm_kernels.cu, llama_kernels.cu, linear_kernels.cu) compiled for the host, so that a machine
// without a GPU — CI — runs their own source and checks it against the CPU kernels. Never used
// in training: only while a test has switched it on (tg_cuda_emulation_set, in cuda_jit.cpp),
// when launches on CPU tensors come here instead of to the driver.
//
// A launch runs its blocks one after another; a block's 256 threads are fibers (ucontext) on the
// calling thread. The block runs one warp at a time: a warp's 32 lanes run in turn from shuffle
// to shuffle (each __shfl_xor_sync is a barrier of the warp: all lanes publish, then all read
// lane ^ mask) until every lane waits at __syncthreads or has ended; then the next warp. Once
// all warps are there, the barrier opens. So a warp runs ahead of the others exactly as far as
// CUDA lets it, and a missing __syncthreads shows as one warp overwriting shared memory another
// has not read yet. Odd-numbered blocks take their warps and lanes in reverse order, so a race
// shows whichever side of it writes. Lanes of one warp stopping at different shuffles or
// barriers, a warp's shuffle that a lane has left, threads ending while others wait at
// __syncthreads, or two call sites of __syncthreads in one round: each is reported as an error
// naming the kernel and block (on a GPU: undefined behaviour, a hang or garbage).
//
// Shared memory is a static per kernel instantiation, which running blocks one at a time makes
// safe (a block sees what the previous one left, where a GPU gives garbage). Arithmetic is the
// host's IEEE float and double, compiled with -ffp-contract=off as NVRTC compiles with
// --fmad=false; division and square roots are correctly rounded on both. Only expf, logf and erff
// come from the host's libm and may differ from the GPU's in the last place.
#include <c10/util/Half.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda_jit.h"
#include "guarded.h"

namespace tg_emulated {
constexpr int kThreads = 256;  // TG_THREADS: every launch is of 256-thread blocks
constexpr int kLanes = 32;
constexpr int kWarps = kThreads / kLanes;
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
  const void* site = nullptr;  // the code address of the barrier it waits at
};

// The block being run: its index, its threads, the thread running now, and the lanes' words a
// shuffle exchanges.
struct Block {
  Dim3 index{0, 0, 0};
  // Zeroed: AddressSanitizer's swapcontext reads the stack it names (none here).
  ucontext_t scheduler{};
  std::vector<Fiber> fibers = std::vector<Fiber>(kThreads);
  std::vector<std::unique_ptr<char[]>> stacks;
  int current = 0;
  std::uint64_t lanes[kThreads] = {};
  std::string misuse;  // set by a thread (which cannot throw across its fiber); the scheduler throws it
  void (*body)(void**) = nullptr;
  void** args = nullptr;
};
Block* running = nullptr;  // only under launch_lock

Dim3 thread_index() { return Dim3{static_cast<unsigned int>(running->current), 0, 0}; }
Dim3 block_index() { return running->index; }

// The running thread stops at `s` (called from `site`) and hands control back to the scheduler.
void stop_at(Stop s, const void* site) {
  Fiber& me = running->fibers[running->current];
  me.stop = s;
  me.site = site;
  swapcontext(&me.context, &running->scheduler);
}

// Not inlined: the return address tells one call site from another.
__attribute__((noinline)) void __syncthreads() { stop_at(Stop::kSyncThreads, __builtin_return_address(0)); }

// Every lane of the warp publishes its value, then reads its partner's (lane ^ lane_mask) once
// all have. Only whole warps shuffle in these kernels: any other mask is reported.
template <class T>
__attribute__((noinline)) T __shfl_xor_sync(unsigned int mask, T value, int lane_mask) {
  static_assert(sizeof(T) <= sizeof(std::uint64_t), "a shuffle moves at most 64 bits");
  const void* site = __builtin_return_address(0);
  if ((mask != 0xffffffffu || lane_mask < 0 || lane_mask >= kLanes) && running->misuse.empty()) {
    running->misuse = "__shfl_xor_sync with mask " + std::to_string(mask) + " and lane mask " + std::to_string(lane_mask) +
                      " (only whole warps, lane masks below 32, are emulated)";
  }
  std::memcpy(&running->lanes[running->current], &value, sizeof(T));
  stop_at(Stop::kShuffleWrite, site);
  T out;
  std::memcpy(&out, &running->lanes[running->current ^ (lane_mask & (kLanes - 1))], sizeof(T));
  stop_at(Stop::kShuffleRead, site);
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
// c10::Half rounds to nearest, ties to even, as the device's cvt.rn.f16.f32, and widens exactly,
// as cvt.f32.f16: the same bits for every value but NaN, whose payload may differ.
inline float tg_half_to_float(unsigned short h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }
inline unsigned short tg_float_to_half(float v) { return c10::Half(v).x; }
// CUDA's max: for integers the larger, for floats fmaxf / fmax (a NaN loses to a number).
inline unsigned int max(unsigned int a, unsigned int b) { return a < b ? b : a; }
inline int max(int a, int b) { return a < b ? b : a; }
inline long long max(long long a, long long b) { return a < b ? b : a; }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

// A 16-byte load or store from an address that is not a multiple of 16: a GPU faults ("misaligned
// address", which ends the process's CUDA context) where the host reads it anyway; reported.
// The address is passed through an empty asm first, so that the compiler cannot assume the
// alignment uint4's type promises (and fold the test away, or copy with aligned loads).
inline const void* unassumed(const void* p) {
  asm volatile("" : "+r"(p));
  return p;
}
inline void check_pack_address(const void* p) {
  if ((reinterpret_cast<std::uintptr_t>(unassumed(p)) & 15) != 0 && running != nullptr && running->misuse.empty()) {
    running->misuse = "a 16-byte load or store (uint4) at an address not a multiple of 16";
  }
}

// CUDA's 16-byte vector, which NVRTC knows without headers. Every copy from or to one checks
// both addresses: the kernels move packs only through it. The bytes are copied as bytes (the
// packs are floats or 16-bit values in memory: read as unsigned ints, strict aliasing would let
// the compiler move the reads past the kernels' own stores).
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
  uint4() = default;
  uint4(const uint4& o) {
    check_pack_address(&o);
    std::memcpy(const_cast<void*>(unassumed(this)), unassumed(&o), sizeof(uint4));
  }
  uint4& operator=(const uint4& o) {
    check_pack_address(this);
    check_pack_address(&o);
    std::memcpy(const_cast<void*>(unassumed(this)), unassumed(&o), sizeof(uint4));
    return *this;
  }
};

#define TG_HOST_EMULATION
#define TG_KERNEL static
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define threadIdx (::tg_emulated::thread_index())
#define blockIdx (::tg_emulated::block_index())
#include "../cuda/optim_kernels.cu"
#include "../cuda/loss_kernels.cu"
#include "../cuda/norm_kernels.cu"
#include "../cuda/llama_kernels.cu"
#include "../cuda/linear_kernels.cu"

// The emulation's own checks, each a kernel that uses CUDA right or wrong as `wrong` says
// (tests: tg_cuda_emulation_selftest). `out` holds TG_THREADS floats, `bytes` 48.
// A 16-byte pack copied from byte 16 + `wrong` · 4 of `bytes` to its byte 0.
TG_KERNEL void tg_test_pack(unsigned char* bytes, float* out, int wrong) {
  if (threadIdx.x == 0) *reinterpret_cast<uint4*>(bytes) = *reinterpret_cast<const uint4*>(bytes + 16 + 4 * wrong);
}
// Each thread passes its value of `out` through shared memory to the thread 32 before it: after
// a barrier, or (wrong) without one, where a warp runs on before the next has written.
TG_KERNEL void tg_test_barrier(unsigned char* bytes, float* out, int wrong) {
  __shared__ float v[TG_THREADS];
  v[threadIdx.x] = out[threadIdx.x];
  if (!wrong) __syncthreads();
  out[threadIdx.x] = v[(threadIdx.x + 32) % TG_THREADS];
}
// A warp sum over all lanes, or (wrong) over the lower half's only.
TG_KERNEL void tg_test_shuffle(unsigned char* bytes, float* out, int wrong) {
  float v = 1.0f;
  if (!wrong || (threadIdx.x & 31) < 16) v = tg_warp_sum(v);
  out[threadIdx.x] = v;
}
// Half the block leaves (wrong) while the other half waits at a barrier.
TG_KERNEL void tg_test_leave(unsigned char* bytes, float* out, int wrong) {
  if (wrong && threadIdx.x < TG_THREADS / 2) return;
  __syncthreads();
  out[threadIdx.x] = 1.0f;
}
#undef threadIdx
#undef blockIdx
#undef __shared__
static_assert(kThreads == TG_THREADS, "the emulation runs blocks of the kernels' TG_THREADS");
static_assert(sizeof(TgRopeJobs) == sizeof(trainguard::RopeJobs) && offsetof(TgRopeJobs, pairs) == offsetof(trainguard::RopeJobs, pairs) &&
                  offsetof(TgRopeJob, op) == offsetof(trainguard::RopeJobs::Job, op),
              "cuda_jit.cpp's RopeJobs is the argument tg_rope takes");
static_assert(TG_ROW_VALUES * 32 == 1024 && TG_WARPS == 8 && TG_NORM_WARP_ROWS == 8,
              "cuda_jit.cpp's kWarpRowCols, kWarpRowsPerBlock and kWarpBackwardRowsPerBlock launch the warp-a-row norms");

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
template <class... A>
constexpr std::size_t arity_of(void (*)(A...)) {
  return sizeof...(A);
}
template <class... A>
const std::size_t* sizes_of(void (*)(A...)) {
  static const std::size_t sizes[] = {sizeof(A)..., 0};
  return sizes;
}

struct Kernel {
  const char* name;
  void (*body)(void**);
  std::size_t arity;          // its parameters: a launch must pass as many
  const std::size_t* sizes;   // and each of its parameter's size (in bytes)
};

#define TG_EMULATED(k) Kernel{#k, [](void** a) { call(&k, a); }, arity_of(&k), sizes_of(&k)}
#define TG_EMULATED_DTYPE(s)                                                                                             \
  TG_EMULATED(tg_adamw8bit_##s), TG_EMULATED(tg_ce_forward_##s), TG_EMULATED(tg_ce_backward_##s), TG_EMULATED(tg_ce_forward_grad_##s), TG_EMULATED(tg_ce_scale_grad_##s),                      \
      TG_EMULATED(tg_ln_forward_##s), TG_EMULATED(tg_ln_backward_##s), TG_EMULATED(tg_ln_param_grads_##s),             \
      TG_EMULATED(tg_ln_forward_warp_##s), TG_EMULATED(tg_ln_backward_warp_##s),                                         \
      TG_EMULATED(tg_swiglu_forward_##s), TG_EMULATED(tg_swiglu_backward_##s), TG_EMULATED(tg_rope_##s),               \
      TG_EMULATED(tg_col_sum_bands_##s), TG_EMULATED(tg_col_sum_bands_packed_##s), TG_EMULATED(tg_gelu_backward_bands_##s), \
      TG_EMULATED(tg_adafactor_rows_##s), TG_EMULATED(tg_adafactor_cols_##s), TG_EMULATED(tg_adafactor_col_var_##s),   \
      TG_EMULATED(tg_adafactor_scale_##s), TG_EMULATED(tg_adafactor_usq_##s), TG_EMULATED(tg_adafactor_apply_##s)
const Kernel kKernels[] = {TG_EMULATED(tg_test_pack), TG_EMULATED(tg_test_barrier), TG_EMULATED(tg_test_shuffle), TG_EMULATED(tg_test_leave), TG_EMULATED(tg_adafactor_coef), TG_EMULATED(tg_ln_param_sum), TG_EMULATED(tg_col_sum_finish), TG_EMULATED_DTYPE(f32), TG_EMULATED_DTYPE(bf16), TG_EMULATED_DTYPE(f16)};

std::mutex launch_lock;  // one emulated launch at a time: shared memory and `running` are global
thread_local unsigned long long launches = 0;  // emulated launches made on this thread
thread_local std::map<std::string, unsigned long long> launches_of;  // the same, by kernel

void fiber_main() {
  running->body(running->args);
  running->fibers[running->current].stop = Stop::kDone;
  // Returning resumes uc_link, the scheduler.
}

[[noreturn]] void fail(const Block& b, const char* kernel, const std::string& what) {
  throw std::logic_error(std::string("cuda emulation: ") + kernel + ", block (" + std::to_string(b.index.x) + ", " +
                         std::to_string(b.index.y) + "): " + what);
}

std::string thread_stop(const Block& b, int t) { return "thread " + std::to_string(t) + " at " + stop_name(b.fibers[t].stop); }

// Runs the lanes of warp `w` from shuffle to shuffle until each waits at __syncthreads or has
// ended.
void run_warp(Block& b, const char* kernel, int w, bool reversed) {
  for (;;) {
    for (int i = 0; i < kLanes; ++i) {
      const int t = w * kLanes + (reversed ? kLanes - 1 - i : i);
      Fiber& f = b.fibers[t];
      if (f.stop == Stop::kDone || f.stop == Stop::kSyncThreads) continue;
      b.current = t;
      f.stop = Stop::kRunning;
      swapcontext(&b.scheduler, &f.context);
      if (!b.misuse.empty()) fail(b, kernel, b.misuse);
    }
    const int first = w * kLanes;
    const Fiber& lead = b.fibers[first];
    bool shuffling = false;
    for (int t = first; t < first + kLanes; ++t) shuffling = shuffling || b.fibers[t].stop == Stop::kShuffleWrite || b.fibers[t].stop == Stop::kShuffleRead;
    if (!shuffling) return;
    for (int t = first + 1; t < first + kLanes; ++t) {
      const Fiber& f = b.fibers[t];
      if (f.stop != lead.stop || f.site != lead.site) fail(b, kernel, "a shuffle not met by its whole warp: " + thread_stop(b, first) + ", " + thread_stop(b, t));
    }
  }
}

// Runs one block to its end: its warps in turn up to each __syncthreads, which then opens.
void run_block(Block& b, const char* kernel) {
  for (int t = 0; t < kThreads; ++t) {
    Fiber& f = b.fibers[t];
    f.stop = Stop::kRunning;
    f.site = nullptr;
    if (getcontext(&f.context) != 0) throw std::runtime_error("cuda emulation: getcontext failed");
    f.context.uc_stack.ss_sp = b.stacks[t].get();
    f.context.uc_stack.ss_size = kStack;
    f.context.uc_link = &b.scheduler;
    makecontext(&f.context, fiber_main, 0);
  }
  const bool reversed = ((b.index.x + b.index.y) & 1u) != 0;
  for (;;) {
    for (int i = 0; i < kWarps; ++i) run_warp(b, kernel, reversed ? kWarps - 1 - i : i, reversed);
    int done = 0, waiting = -1;
    for (int t = 0; t < kThreads; ++t) {
      const Fiber& f = b.fibers[t];
      if (f.stop == Stop::kDone) {
        ++done;
      } else if (waiting < 0) {
        waiting = t;
      } else if (f.site != b.fibers[waiting].site) {
        fail(b, kernel, "threads " + std::to_string(waiting) + " and " + std::to_string(t) + " wait at different __syncthreads");
      }
    }
    if (done == kThreads) return;
    if (done > 0) fail(b, kernel, std::to_string(done) + " threads ended while " + thread_stop(b, waiting) + " waits for them");
    for (Fiber& f : b.fibers) f.stop = Stop::kRunning;  // the barrier opens
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

void emulated_launch(void* kernel, long long gx, long long gy, void** args, const std::size_t* sizes, std::size_t n_args) {
  using namespace tg_emulated;
  const Kernel& k = *static_cast<const Kernel*>(kernel);
  if (gx < 1 || gy < 1) throw std::invalid_argument(std::string("cuda emulation: ") + k.name + ": an empty grid (the driver refuses it)");
  // The driver takes the array as it is: too few would read past it, too many shift nothing
  // but say the launch and the kernel disagree. Either way undefined on a GPU, so said here.
  if (n_args != k.arity) {
    throw std::invalid_argument(std::string("cuda emulation: ") + k.name + " takes " + std::to_string(k.arity) + " arguments; the launch passes " +
                                std::to_string(n_args));
  }
  // The driver copies each parameter's size from its pointer: a value of another size (an int
  // where the kernel takes a long long) is read short or with its neighbour's bytes.
  for (std::size_t i = 0; i < n_args; ++i) {
    if (sizes[i] != k.sizes[i]) {
      throw std::invalid_argument(std::string("cuda emulation: ") + k.name + "'s parameter " + std::to_string(i) + " takes " +
                                  std::to_string(k.sizes[i]) + " bytes; the launch passes " + std::to_string(sizes[i]));
    }
  }
  std::lock_guard<std::mutex> g(launch_lock);
  ++launches;
  ++launches_of[k.name];
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

// Emulated launches of the kernel `name` made on this thread so far: which of two forms ran.
extern "C" unsigned long long tg_cuda_emulation_launches_of(const char* name) {
  const auto it = tg_emulated::launches_of.find(name);
  return it == tg_emulated::launches_of.end() ? 0 : it->second;
}

// Runs the emulation's check kernel `tg_test_<name>` (one block) on `bytes` (48) and `out` (256
// floats), CUDA used wrongly where `wrong` is 1, launched with its last argument missing where
// `wrong` is 2, and with its last argument (an int) passed as a long long where it is 3; what the
// emulation reports comes back in `err`.
extern "C" int tg_cuda_emulation_selftest(const char* name, unsigned char* bytes, float* out, int wrong, char* err, size_t err_len) {
  return trainguard::guarded(err, err_len, [&] {
    void* const kernel = trainguard::emulated_kernel(std::string("tg_test_") + name);
    long long wide = wrong;
    void* args[] = {&bytes, &out, wrong == 3 ? static_cast<void*>(&wide) : static_cast<void*>(&wrong)};
    const std::size_t sizes[] = {sizeof bytes, sizeof out, wrong == 3 ? sizeof wide : sizeof wrong};
    trainguard::emulated_launch(kernel, 1, 1, args, sizes, wrong == 2 ? 2 : 3);
  });
}
