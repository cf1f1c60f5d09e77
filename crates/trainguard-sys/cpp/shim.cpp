// trainguard's C++ shim: what tch does not expose, compiled by build.rs against the same libtorch.
// Every entry point catches C++ exceptions and returns them as a message: no exception crosses
// into Rust. Return value: 0 = ok, 1 = error (message in `err`), 2 = unavailable (no accelerator).
#include <ATen/DeviceAccelerator.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/headeronly/version.h>
#include <c10/core/AllocatorConfig.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Logging.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>

#include "guarded.h"

#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

namespace {
using trainguard::copy_message;
using trainguard::guarded;

bool have_accelerator() {
  return at::accelerator::getAccelerator(false).has_value() && at::accelerator::deviceCount() > 0;
}

// The caching allocator's per-device tables exist only once the accelerator is initialised
// (the first tensor on it does that): before, getDeviceStats answers "Invalid device argument".
// Telemetry at run start or from `trainguard env` must not depend on something having been
// allocated first, so every allocator entry point initialises lazily, as PyTorch's own
// torch.cuda.memory_stats() does. Idempotent and cheap after the first call.
void init_accelerator() {
  if (auto type = at::accelerator::getAccelerator(false)) at::globalContext().lazyInitDevice(*type);
}
}  // namespace

extern "C" {

// Mirrors trainguard::ffi::RawStats (repr(C)). Pools: [0] aggregate, [1] small, [2] large.
struct tg_stats {
  int64_t allocated_current[3], allocated_peak[3];
  int64_t reserved_current[3], reserved_peak[3];
  int64_t active_current, active_peak;
  int64_t requested_current, requested_peak;
  int64_t inactive_split_current;
  int64_t num_alloc_retries, num_ooms;
};

int tg_accelerator_available() { return have_accelerator() ? 1 : 0; }

int tg_device_stats(int device, tg_stats* out, char* err, size_t err_len) {
  if (!have_accelerator()) return 2;
  return guarded(err, err_len, [&] {
    init_accelerator();
    auto s = at::accelerator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
    for (int p = 0; p < 3; ++p) {
      out->allocated_current[p] = s.allocated_bytes[p].current;
      out->allocated_peak[p] = s.allocated_bytes[p].peak;
      out->reserved_current[p] = s.reserved_bytes[p].current;
      out->reserved_peak[p] = s.reserved_bytes[p].peak;
    }
    out->active_current = s.active_bytes[0].current;
    out->active_peak = s.active_bytes[0].peak;
    out->requested_current = s.requested_bytes[0].current;
    out->requested_peak = s.requested_bytes[0].peak;
    out->inactive_split_current = s.inactive_split_bytes[0].current;
    out->num_alloc_retries = s.num_alloc_retries;
    out->num_ooms = s.num_ooms;
  });
}

// Free and total device memory (cudaMemGetInfo under a device guard). Deliberately does not
// initialise the caching allocator: memory.limit reads the total to turn the cap into a memory
// fraction, and libtorch applies `per_process_memory_fraction` only when it creates its
// per-device allocators, so they must not exist before the settings carrying it are made.
int tg_memory_info(int device, int64_t* free_bytes, int64_t* total_bytes, char* err, size_t err_len) {
  if (!have_accelerator()) return 2;
  return guarded(err, err_len, [&] {
    auto info = at::accelerator::getMemoryInfo(static_cast<c10::DeviceIndex>(device));
    *free_bytes = static_cast<int64_t>(info.first);
    *total_bytes = static_cast<int64_t>(info.second);
  });
}

// Whether the accelerator's caching allocator has created its per-device allocators (after
// which a memory fraction in the settings no longer takes effect). 0 without an accelerator.
int tg_allocator_initialized() {
  if (!have_accelerator()) return 0;
  try {
    return c10::getDeviceAllocator(*at::accelerator::getAccelerator(false))->initialized() ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

int tg_empty_cache(char* err, size_t err_len) {
  if (!have_accelerator()) return 2;
  return guarded(err, err_len, [&] {
    init_accelerator();
    at::accelerator::emptyCache();
  });
}

int tg_reset_peak_stats(int device, char* err, size_t err_len) {
  if (!have_accelerator()) return 2;
  return guarded(err, err_len, [&] {
    init_accelerator();
    at::accelerator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
  });
}

// The calling thread's current device, as torch.cuda.set_device(local_rank) in a torchrun
// script: what libtorch or NCCL does without naming a device goes to this rank's GPU, not GPU 0.
// Only the device guard's setDevice (cudaSetDevice): no lazy init, so the caching allocator
// stays uncreated and the memory fraction in the settings applied later still takes effect.
int tg_set_current_device(int device, char* err, size_t err_len) {
  if (!have_accelerator()) return 2;
  return guarded(err, err_len, [&] { at::accelerator::setDeviceIndex(static_cast<c10::DeviceIndex>(device)); });
}

// Parses `key:value,...` exactly as PYTORCH_CUDA_ALLOC_CONF; must run before the first CUDA
// allocation to affect the caching allocator. Works (parses) without a GPU too.
int tg_set_allocator_settings(const char* settings, char* err, size_t err_len) {
  return guarded(err, err_len, [&] { c10::CachingAllocator::setAllocatorSettings(settings); });
}

int tg_get_allocator_settings(char* out, size_t out_len) {
  char ignored[8];
  return guarded(ignored, sizeof ignored, [&] {
    copy_message(c10::CachingAllocator::getAllocatorSettings(), out, out_len);
  });
}

// Mirrors trainguard::ffi::Versions (repr(C)).
struct tg_versions {
  int32_t torch_major, torch_minor, torch_patch;
  int32_t cuda_available, cudnn_available;
  int64_t cudart_version, cudnn_version;
  int32_t cuda_devices, intra_op_threads;
};

int tg_versions(tg_versions* out, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
    out->torch_major = TORCH_VERSION_MAJOR;
    out->torch_minor = TORCH_VERSION_MINOR;
    out->torch_patch = TORCH_VERSION_PATCH;
    const auto& cuda = at::detail::getCUDAHooks();
    out->cuda_available = cuda.hasCUDA() ? 1 : 0;
    out->cudnn_available = cuda.hasCuDNN() ? 1 : 0;
    out->cudart_version = -1;
    out->cudnn_version = -1;
    try { out->cudart_version = cuda.versionCUDART(); } catch (...) {}
    try { if (out->cudnn_available) out->cudnn_version = cuda.versionCuDNN(); } catch (...) {}
    out->cuda_devices = out->cuda_available ? cuda.getNumGPUs() : 0;
    out->intra_op_threads = at::get_num_threads();
  });
}

// Autocast for `cuda` (1) or CPU (0) devices: enabled with dtype 0 = bf16, 1 = fp16, or off.
int tg_autocast(int cuda, int enabled, int dtype, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
    auto dev = cuda ? at::kCUDA : at::kCPU;
    if (enabled) at::autocast::set_autocast_dtype(dev, dtype == 1 ? at::kHalf : at::kBFloat16);
    at::autocast::set_autocast_enabled(dev, enabled != 0);
    if (!enabled) at::autocast::clear_cache();
  });
}

// torch.set_float32_matmul_precision: "highest" (fp32) or "high" (TF32 on Ampere+).
int tg_set_matmul_precision(const char* p, char* err, size_t err_len) {
  return guarded(err, err_len, [&] { at::globalContext().setFloat32MatmulPrecision(std::string(p)); });
}

// torch.backends.mkldnn.enabled: whether CPU ops may hand work to oneDNN (fp32 GELU does).
int tg_set_onednn_enabled(int on, char* err, size_t err_len) {
  return guarded(err, err_len, [&] { at::globalContext().setUserEnabledMkldnn(on != 0); });
}

// libtorch errors without their C++ stack trace: c10 records one at every throw and symbolises
// it when the message is read, which allocates; at the edge of a memory cap that can fail, and
// the message then reads "<Error computing Error::what()>", losing the "can't allocate" text.
int tg_errors_without_stack_traces(char* err, size_t err_len) {
  return guarded(err, err_len, [&] { c10::SetStackTraceFetcher(std::function<std::string()>([] { return std::string(); })); });
}

// `deterministic: true`: libtorch's own switch (torch.use_deterministic_algorithms(True,
// warn_only=False)): ops with a deterministic variant use it (flash / memory-efficient attention
// backward, index_put_ with accumulate, ...), the others throw "... does not have a deterministic
// implementation". Uninitialised memory (torch.empty) is filled, so reading it cannot differ
// between runs; cuDNN picks deterministic algorithms and does not benchmark.
int tg_set_deterministic(int on, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
    auto& ctx = at::globalContext();
    ctx.setDeterministicAlgorithms(on != 0, /*warn_only=*/false);
    ctx.setDeterministicFillUninitializedMemory(on != 0);
    ctx.setDeterministicCuDNN(on != 0);
    if (on) ctx.setBenchmarkCuDNN(false);
  });
}

// What libtorch reports back: bit 0 algorithms, bit 1 warn-only, bit 2 fill uninitialised
// memory, bit 3 cuDNN deterministic.
int tg_deterministic_state() {
  const auto& ctx = at::globalContext();
  return (ctx.deterministicAlgorithms() ? 1 : 0) | (ctx.deterministicAlgorithmsWarnOnly() ? 2 : 0) |
         (ctx.deterministicFillUninitializedMemory() ? 4 : 0) | (ctx.deterministicCuDNN() ? 8 : 0);
}

// Backward from `roots` (tch handles, `n_roots`) seeded with `grads` (one each, of the root's shape;
// autograd casts one of another dtype to the root's), into `inputs` (`n_inputs`, each wanting a
// gradient): `out[i]` is input i's gradient, a new tensor tch takes over (undefined where the
// graph does not reach it). tch's run_backward seeds ones only, so pushing a given gradient
// through a graph took a sum of the output weighted by it: two more passes over the output.
int tg_backward(const void* const* roots, const void* const* grads, size_t n_roots, const void* const* inputs, size_t n_inputs, void** out, char* err,
                size_t err_len) {
  for (size_t i = 0; i < n_inputs; ++i) out[i] = nullptr;
  return guarded(err, err_len, [&] {
    std::vector<torch::autograd::Edge> root_edges, input_edges;
    std::vector<at::Tensor> seeds;
    for (size_t i = 0; i < n_roots; ++i) {
      const auto& r = *static_cast<const at::Tensor*>(roots[i]);
      const auto& g = *static_cast<const at::Tensor*>(grads[i]);
      if (!r.requires_grad()) throw std::invalid_argument("backward: root " + std::to_string(i) + " is not part of a graph");
      if (!g.defined() || g.sizes() != r.sizes()) throw std::invalid_argument("backward: the gradient of root " + std::to_string(i) + " must have its shape");
      root_edges.push_back(torch::autograd::impl::gradient_edge(r));
      seeds.push_back(g);
    }
    for (size_t i = 0; i < n_inputs; ++i) {
      const auto& t = *static_cast<const at::Tensor*>(inputs[i]);
      if (!t.requires_grad()) throw std::invalid_argument("backward: input " + std::to_string(i) + " wants no gradient");
      input_edges.push_back(torch::autograd::impl::gradient_edge(t));
    }
    const torch::autograd::variable_list got =
        torch::autograd::Engine::get_default_engine().execute(root_edges, seeds, /*keep_graph=*/false, /*create_graph=*/false, /*accumulate_grad=*/false, input_edges);
    for (size_t i = 0; i < n_inputs; ++i) out[i] = new at::Tensor(got[i]);
  });
}

// Frees (nbytes 0) or allocates anew (nbytes > 0, contents undefined) the memory under `tensor`'s
// storage, keeping the storage object, so every tensor sharing it (the model's parameter, its
// shallow clones, the optimizer's views) sees the change. What `dist.shard: parameters` does with
// the parameters a rank does not own between their uses, as FSDP resizes its storages.
int tg_storage_resize(void* tensor, int64_t nbytes, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
    c10::StorageImpl* s = static_cast<at::Tensor*>(tensor)->storage().unsafeGetStorageImpl();
    if (nbytes == 0) {
      s->set_data_ptr_noswap(c10::DataPtr(nullptr, s->device()));
      s->set_nbytes(0);
      return;
    }
    c10::Allocator* a = s->allocator();
    TORCH_CHECK(a != nullptr, "the storage has no allocator to allocate it again with");
    s->set_data_ptr_noswap(a->allocate(static_cast<size_t>(nbytes)));
    s->set_nbytes(static_cast<size_t>(nbytes));
  });
}

// `dst.copy_(src)` without waiting for it: between a CUDA device and pinned host memory the
// copy is queued on the current stream and the call returns at once (elsewhere it is the
// ordinary copy). The caller keeps both tensors alive, and synchronizes before the host reads
// or writes the pinned side.
int tg_copy_async(void* dst, const void* src, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
    static_cast<at::Tensor*>(dst)->copy_(*static_cast<const at::Tensor*>(src), /*non_blocking=*/true);
  });
}

}  // extern "C"
