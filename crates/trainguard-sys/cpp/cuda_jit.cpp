// Our own CUDA kernels (crates/trainguard-sys/cuda/optim_kernels.cu, passed in from Rust): compiled by NVRTC to
// machine code for the device's architecture (a cubin: no PTX left for the driver to JIT, so no
// PTX-version dependency on the driver), loaded and launched through the CUDA driver API. Both libraries are opened with dlopen at first
// use, so nothing here needs a CUDA toolkit to build or a GPU to link: NVRTC comes from the torch
// wheel's nvidia/cu13/lib (or the system's), the driver from libcuda.so.1. Compiling needs no GPU,
// which lets CI compile the kernels' source (tg_nvrtc_compile); loading and launching need one.
// Same conventions as shim.cpp: every entry point catches C++ exceptions.
#include "cuda_jit.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/Device.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "guarded.h"

#include <dirent.h>
#include <dlfcn.h>
#include <link.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <utility>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace {
using trainguard::guarded;

// The few NVRTC and driver entry points used, declared by hand (their C ABI is stable) so that no
// CUDA header is needed.
struct Nvrtc {
  int (*create)(void** prog, const char* src, const char* name, int n_headers, const char* const* headers,
                const char* const* include_names);
  int (*compile)(void* prog, int n_options, const char* const* options);
  int (*log_size)(void* prog, size_t* size);
  int (*log)(void* prog, char* log);
  int (*cubin_size)(void* prog, size_t* size);
  int (*cubin)(void* prog, char* cubin);
  int (*destroy)(void** prog);
  const char* (*error)(int code);
  int (*version)(int* major, int* minor);
  std::string path;  // the library loaded: its real path, or the bare name the loader searched for
};

struct Driver {
  int (*init)(unsigned flags);
  int (*device_get)(int* device, int ordinal);
  int (*attribute)(int* value, int attribute, int device);
  int (*primary_ctx_retain)(void** ctx, int device);
  int (*ctx_get_current)(void** ctx);
  int (*ctx_set_current)(void* ctx);
  int (*module_load_data)(void** module, const void* image);
  int (*module_get_function)(void** function, void* module, const char* name);
  int (*launch)(void* function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                unsigned shared, void* stream, void** params, void** extra);
  int (*error_string)(int code, const char** text);
};

template <typename F>
void bind(void* lib, const char* name, F*& slot, const std::string& from) {
  slot = reinterpret_cast<F*>(dlsym(lib, name));
  if (slot == nullptr) throw std::runtime_error(from + " has no " + name);
}

// The directory of the libtorch this process runs on ("" if it cannot be told).
std::string torch_lib_dir() {
  void* h = dlopen("libtorch_cpu.so", RTLD_NOW | RTLD_NOLOAD);
  if (h == nullptr) return "";
  struct link_map* map = nullptr;
  std::string dir;
  if (dlinfo(h, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr) {
    dir = map->l_name;
    dir = dir.substr(0, dir.rfind('/'));
  }
  dlclose(h);
  return dir;
}

// libnvrtc: the torch wheel's (site-packages/nvidia/cu13/lib beside site-packages/torch/lib),
// else whatever the loader finds. libnvrtc opens its builtins library by name at compile time,
// and the wheel's directory is on no search path: loading it first, globally, satisfies that.
const Nvrtc& nvrtc() {
  static std::mutex lock;
  static Nvrtc api{};
  static void* lib = nullptr;  // set once every entry point is bound
  std::lock_guard<std::mutex> g(lock);
  if (lib != nullptr) return api;
  std::vector<std::string> tried;
  void* l = nullptr;
  const std::string wheel = torch_lib_dir() + "/../../nvidia/cu13/lib";
  if (DIR* d = opendir(wheel.c_str())) {
    while (struct dirent* e = readdir(d)) {
      if (std::strncmp(e->d_name, "libnvrtc-builtins.so.13.", 24) == 0) dlopen((wheel + "/" + e->d_name).c_str(), RTLD_NOW | RTLD_GLOBAL);
    }
    closedir(d);
  }
  for (const std::string& name : {wheel + "/libnvrtc.so.13", std::string("libnvrtc.so.13"), std::string("libnvrtc.so")}) {
    l = dlopen(name.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (l != nullptr) {
      char* real = name.find('/') != std::string::npos ? realpath(name.c_str(), nullptr) : nullptr;
      api.path = real != nullptr ? real : name;
      std::free(real);
      break;
    }
    const char* why = dlerror();
    tried.push_back(why != nullptr ? why : name);
  }
  if (l == nullptr) {
    std::string msg = "NVRTC (libnvrtc.so.13, from the torch wheel's nvidia-cuda-nvrtc) not found:";
    for (const auto& t : tried) msg += " " + t + ";";
    throw std::runtime_error(msg);
  }
  const std::string from = "libnvrtc";
  bind(l, "nvrtcCreateProgram", api.create, from);
  bind(l, "nvrtcCompileProgram", api.compile, from);
  bind(l, "nvrtcGetProgramLogSize", api.log_size, from);
  bind(l, "nvrtcGetProgramLog", api.log, from);
  bind(l, "nvrtcGetCUBINSize", api.cubin_size, from);
  bind(l, "nvrtcGetCUBIN", api.cubin, from);
  bind(l, "nvrtcDestroyProgram", api.destroy, from);
  bind(l, "nvrtcGetErrorString", api.error, from);
  bind(l, "nvrtcVersion", api.version, from);
  lib = l;
  return api;
}

const Driver& driver() {
  static std::mutex lock;
  static Driver api{};
  static void* lib = nullptr;
  std::lock_guard<std::mutex> g(lock);
  if (lib != nullptr) return api;
  void* l = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (l == nullptr) {
    const char* why = dlerror();
    throw std::runtime_error(std::string("the CUDA driver (libcuda.so.1) cannot be loaded: ") + (why ? why : "unknown"));
  }
  const std::string from = "libcuda.so.1";
  bind(l, "cuInit", api.init, from);
  bind(l, "cuDeviceGet", api.device_get, from);
  bind(l, "cuDeviceGetAttribute", api.attribute, from);
  bind(l, "cuDevicePrimaryCtxRetain", api.primary_ctx_retain, from);
  bind(l, "cuCtxGetCurrent", api.ctx_get_current, from);
  bind(l, "cuCtxSetCurrent", api.ctx_set_current, from);
  bind(l, "cuModuleLoadData", api.module_load_data, from);
  bind(l, "cuModuleGetFunction", api.module_get_function, from);
  bind(l, "cuLaunchKernel", api.launch, from);
  bind(l, "cuGetErrorString", api.error_string, from);
  lib = l;
  return api;
}

void check_cu(int code, const char* what) {
  if (code == 0) return;
  const char* text = nullptr;
  driver().error_string(code, &text);
  // CUDA_ERROR_OUT_OF_MEMORY in the runtime's words, which the guard reads as an out-of-memory
  // (guard/classify.rs): a module load or launch that found the card full is halved and replayed.
  const std::string kind = code == 2 ? "CUDA error: out of memory, CUDA driver error 2" : "CUDA driver error " + std::to_string(code);
  throw std::runtime_error(std::string(what) + ": " + kind + " (" + (text ? text : "unknown") + ")");
}

// Machine code (a cubin) of `src` for compute capability major.minor; the compiler's log in the
// error on failure.
std::string compile(const char* src, int major, int minor) {
  const Nvrtc& api = nvrtc();
  void* prog = nullptr;
  int rc = api.create(&prog, src, "optim_kernels.cu", 0, nullptr, nullptr);
  if (rc != 0) throw std::runtime_error(std::string("nvrtcCreateProgram: ") + api.error(rc));
  const std::string arch = "--gpu-architecture=sm_" + std::to_string(major) + std::to_string(minor);
  // No multiply-add contraction: the kernels round as the CPU ones (built with -ffp-contract=off).
  const char* options[] = {arch.c_str(), "--fmad=false", "--std=c++17"};
  rc = api.compile(prog, 3, options);
  size_t size = 0;
  std::string log;
  if (api.log_size(prog, &size) == 0 && size > 1) {
    log.resize(size);
    api.log(prog, &log[0]);
    log.resize(size - 1);
  }
  std::string cubin;
  if (rc == 0 && api.cubin_size(prog, &size) == 0) {
    cubin.resize(size);
    api.cubin(prog, &cubin[0]);
  }
  api.destroy(&prog);
  if (rc != 0) throw std::runtime_error(std::string("NVRTC could not compile the kernels for ") + arch + ": " + api.error(rc) + "\n" + log);
  if (cubin.empty()) throw std::runtime_error("NVRTC compiled the kernels for " + arch + " but returned no machine code");
  return cubin;
}

// The kernels optim_kernels.cu, loss_kernels.cu, norm_kernels.cu, llama_kernels.cu and
// linear_kernels.cu define: 8-bit AdamW, cross-entropy's forward and backward, LayerNorm's five
// (forward and backward a block a row and a warp a row, the parameters' gradients), SwiGLU's two,
// RoPE's and the column sums' bands per dtype, Adafactor's stages per dtype, plus the dtype-free
// Adafactor coefficient, LayerNorm parameter-gradient sum and column sums' finish. Their handles
// are looked up by name once, when the module is loaded; a launch indexes them (no string is
// built per launch: ~1000 a step).
const char* const kDtypes[] = {"f32", "bf16", "f16"};
// Rows per band of the column sums (LayerNorm's weight and bias gradients, a linear layer's bias
// gradient): a band's sums stay short; the bands' sums, a few rows, are added in order.
constexpr long long kBandRows = 256;
long long band_count(long long rows) { return (rows + kBandRows - 1) / kBandRows; }
// Values per CUDA block of the elementwise kernels (SwiGLU's): TG_BLOCK, 8 per thread.
constexpr long long kBlockValues = 2048;
// The widest row LayerNorm's warp kernels take (TG_ROW_VALUES · 32), and the rows a block of
// them takes (TG_WARPS; the backward's TG_WARPS · TG_NORM_WARP_ROWS); a wider row takes a block
// of the other form. cuda_emulation.cpp asserts these against the kernels' source.
constexpr long long kWarpRowCols = 1024;
constexpr long long kWarpRowsPerBlock = 8;
long long warp_row_blocks(long long rows) { return (rows + kWarpRowsPerBlock - 1) / kWarpRowsPerBlock; }
// The rows a block of the warp-a-row backward takes (TG_WARPS · TG_NORM_WARP_ROWS): its warps'
// weight and bias sums over them become one band of the parameters' gradients.
constexpr long long kWarpBackwardRowsPerBlock = 64;
long long warp_backward_blocks(long long rows) { return (rows + kWarpBackwardRowsPerBlock - 1) / kWarpBackwardRowsPerBlock; }
constexpr int kDtypeCount = 3;
enum AdafactorStage { kRows, kCols, kColVar, kScale, kUsq, kApply, kStageCount };
const char* const kAdafactorStages[kStageCount] = {"rows", "cols", "col_var", "scale", "usq", "apply"};

// One dtype's kernels.
struct DtypeKernels {
  void* adamw8bit = nullptr;
  void* adafactor[kStageCount] = {};
  void* ce_forward = nullptr;
  void* ce_backward = nullptr;
  void* ce_forward_grad = nullptr;
  void* ce_scale_grad = nullptr;
  void* ln_forward = nullptr;
  void* ln_forward_warp = nullptr;
  void* ln_backward = nullptr;
  void* ln_backward_warp = nullptr;
  void* ln_param_grads = nullptr;
  void* swiglu_forward = nullptr;
  void* swiglu_backward = nullptr;
  void* rope = nullptr;
  void* col_sum_bands = nullptr;
  void* col_sum_bands_packed = nullptr;
  void* gelu_backward_bands = nullptr;
};

// Per CUDA device: its primary context (PyTorch's) and the loaded kernels.
struct Loaded {
  void* ctx = nullptr;
  DtypeKernels per_dtype[kDtypeCount];
  void* adafactor_coef = nullptr;
  void* ln_param_sum = nullptr;
  void* col_sum_finish = nullptr;
};

std::mutex loaded_lock;
std::map<int, Loaded>& loaded() {
  static std::map<int, Loaded> m;
  return m;
}

const Loaded& loaded_for(int ordinal) {
  std::lock_guard<std::mutex> g(loaded_lock);
  auto it = loaded().find(ordinal);
  if (it == loaded().end()) throw std::logic_error("cuda_jit: kernels used on cuda:" + std::to_string(ordinal) + " before tg_cuda_jit_prepare");
  return it->second;
}

// The driver's handle of PyTorch's current stream on `device` (nullptr, the legacy default
// stream, unless someone switched streams), so the kernels queue behind the ops that made their
// inputs, as ATen's own kernels do.
void* current_stream(const c10::Device& device) {
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return impl->getStreamNativeHandle(impl->getStream(device));
}

// Makes `ctx` the thread's current context for its lifetime and then restores the previous one:
// the CUDA runtime that PyTorch uses reads its current device from it.
class ContextScope {
 public:
  explicit ContextScope(void* ctx) {
    check_cu(driver().ctx_get_current(&previous_), "cuCtxGetCurrent");
    if (previous_ != ctx) check_cu(driver().ctx_set_current(ctx), "cuCtxSetCurrent");
    switched_ = previous_ != ctx;
  }
  ~ContextScope() {
    if (switched_) driver().ctx_set_current(previous_);
  }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

 private:
  void* previous_ = nullptr;
  bool switched_ = false;
};

// Which of `kDtypes` the kernels for parameters of `dtype` are.
int dtype_index(at::ScalarType dtype, const char* kernel) {
  switch (dtype) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: throw std::invalid_argument(std::string(kernel) + ": CUDA parameters must be fp32, bf16 or fp16");
  }
}

// Every kernel's handle, each found by `get(out, name)`: from the loaded module, or the host
// emulation's table.
template <class Get>
void look_up(Loaded& k, Get get) {
  get(&k.adafactor_coef, "tg_adafactor_coef");
  get(&k.ln_param_sum, "tg_ln_param_sum");
  get(&k.col_sum_finish, "tg_col_sum_finish");
  for (int d = 0; d < kDtypeCount; ++d) {
    get(&k.per_dtype[d].adamw8bit, std::string("tg_adamw8bit_") + kDtypes[d]);
    get(&k.per_dtype[d].ce_forward, std::string("tg_ce_forward_") + kDtypes[d]);
    get(&k.per_dtype[d].ce_backward, std::string("tg_ce_backward_") + kDtypes[d]);
    get(&k.per_dtype[d].ce_forward_grad, std::string("tg_ce_forward_grad_") + kDtypes[d]);
    get(&k.per_dtype[d].ce_scale_grad, std::string("tg_ce_scale_grad_") + kDtypes[d]);
    get(&k.per_dtype[d].ln_forward, std::string("tg_ln_forward_") + kDtypes[d]);
    get(&k.per_dtype[d].ln_forward_warp, std::string("tg_ln_forward_warp_") + kDtypes[d]);
    get(&k.per_dtype[d].ln_backward, std::string("tg_ln_backward_") + kDtypes[d]);
    get(&k.per_dtype[d].ln_backward_warp, std::string("tg_ln_backward_warp_") + kDtypes[d]);
    get(&k.per_dtype[d].ln_param_grads, std::string("tg_ln_param_grads_") + kDtypes[d]);
    get(&k.per_dtype[d].swiglu_forward, std::string("tg_swiglu_forward_") + kDtypes[d]);
    get(&k.per_dtype[d].swiglu_backward, std::string("tg_swiglu_backward_") + kDtypes[d]);
    get(&k.per_dtype[d].rope, std::string("tg_rope_") + kDtypes[d]);
    get(&k.per_dtype[d].col_sum_bands, std::string("tg_col_sum_bands_") + kDtypes[d]);
    get(&k.per_dtype[d].col_sum_bands_packed, std::string("tg_col_sum_bands_packed_") + kDtypes[d]);
    get(&k.per_dtype[d].gelu_backward_bands, std::string("tg_gelu_backward_bands_") + kDtypes[d]);
    for (int stage = 0; stage < kStageCount; ++stage) get(&k.per_dtype[d].adafactor[stage], std::string("tg_adafactor_") + kAdafactorStages[stage] + "_" + kDtypes[d]);
  }
}

// The host emulation's kernels (cuda_emulation.cpp), for CPU tensors while a test has it on.
const Loaded& emulated() {
  static const Loaded k = [] {
    Loaded e;
    look_up(e, [](void** out, const std::string& name) { *out = trainguard::emulated_kernel(name); });
    return e;
  }();
  return k;
}

thread_local bool emulating = false;

// The kernels of `device` (prepared by tg_cuda_jit_prepare) made current for launching: the
// device's context for the scope's lifetime and PyTorch's current stream on it. On the CPU (under
// the emulation) the host-compiled kernels, run at once.
class Launcher {
 public:
  explicit Launcher(const c10::Device& device) : on_host_(device.is_cpu()), loaded_(on_host_ ? emulated() : loaded_for(device.index())) {
    if (!on_host_) {
      stream_ = current_stream(device);
      scope_.emplace(loaded_.ctx);
    }
  }
  const Loaded& kernels() const { return loaded_; }
  // Queues `kernel` (`what` names it in an error), grid gx × gy of 256-thread blocks, with the
  // argument values `values` (the driver copies them at the launch). Their count and sizes reach
  // the emulation, which checks them against the kernel's parameters; the driver cannot (it
  // reads as many bytes as the kernel's parameters take, whatever was passed).
  template <class... A>
  void operator()(void* kernel, const char* what, long long gx, long long gy, A&... values) const {
    // CUDA's grid limits (x < 2^31, y < 2^16): beyond them the casts below would wrap silently.
    if (gx > 0x7fffffffLL || gy > 0xffffLL) {
      throw std::invalid_argument(std::string(what) + ": a grid of " + std::to_string(gx) + " x " + std::to_string(gy) +
                                  " blocks is beyond CUDA's limits (2^31 - 1 x 65535)");
    }
    void* args[] = {const_cast<void*>(static_cast<const void*>(&values))...};
    if (on_host_) {
      const std::size_t sizes[] = {sizeof(A)...};
      trainguard::emulated_launch(kernel, gx, gy, args, sizes, sizeof...(A));
      return;
    }
    check_cu(driver().launch(kernel, static_cast<unsigned>(gx), static_cast<unsigned>(gy), 1, 256, 1, 1, 0, stream_, args, nullptr), what);
  }

 private:
  bool on_host_;
  const Loaded& loaded_;
  void* stream_ = nullptr;
  std::optional<ContextScope> scope_;
};
}  // namespace

namespace trainguard {
bool runs_cuda_kernels(const at::Tensor& t) { return t.is_cuda() || (emulating && t.is_cpu()); }

void cuda_adamw8bit_update(at::Tensor& p, const at::Tensor& g, at::Tensor& qm, at::Tensor& am, at::Tensor& qv,
                           at::Tensor& av, long long blocks, float w1, float w2, float shrink, float scale, float shift, bool apply) {
  long long n = p.numel();
  if (n == 0) return;
  const int d = dtype_index(p.scalar_type(), "adamw8bit_update");
  void* pp = p.data_ptr();
  const void* gp = g.data_ptr();
  void* qmp = qm.data_ptr();
  void* amp = am.data_ptr();
  void* qvp = qv.data_ptr();
  void* avp = av.data_ptr();
  int apply_flag = apply ? 1 : 0;
  const Launcher launch(p.device());
  launch(launch.kernels().per_dtype[d].adamw8bit, "cuLaunchKernel(tg_adamw8bit)", blocks, 1, pp, gp, qmp, amp, qvp, avp, n, w1, w2, shrink, scale, shift, apply_flag);
}

void cuda_adafactor_update(at::Tensor& p, const at::Tensor& g, at::Tensor& first, at::Tensor* col_var, at::Tensor& ws,
                           long long units, long long bands, float w, float rho, float eps1_sq, float eps2, float d, float shrink) {
  long long n = p.numel();
  if (n == 0) return;
  const int dtype = dtype_index(p.scalar_type(), "adafactor_update");
  int factored = col_var != nullptr ? 1 : 0;
  long long rows = factored ? p.size(0) : 1, cols = factored ? p.size(1) : n;
  void* pp = p.data_ptr();
  const void* gp = g.data_ptr();
  void* fp = first.data_ptr();                          // row_var, or the full variance
  void* sp = factored ? col_var->data_ptr() : fp;       // what u divides by, per column or per value
  void* rp = factored ? fp : nullptr;                   // the row factors (matrices only)
  void* wsp = ws.data_ptr();
  const Launcher launch(p.device());
  void* const* stage = launch.kernels().per_dtype[dtype].adafactor;
  launch(stage[kRows], "cuLaunchKernel(tg_adafactor_rows)", units, 1, pp, gp, fp, wsp, n, cols, factored, w);
  if (factored) {
    const long long col_blocks = (cols + 255) / 256;
    launch(stage[kCols], "cuLaunchKernel(tg_adafactor_cols)", col_blocks, bands, gp, wsp, rows, cols, bands);
    launch(stage[kColVar], "cuLaunchKernel(tg_adafactor_col_var)", col_blocks, 1, sp, wsp, rows, cols, bands, w);
  }
  launch(stage[kScale], "cuLaunchKernel(tg_adafactor_scale)", 1, 1, rp, wsp, units, n, rows, factored, eps2, rho, eps1_sq);
  launch(stage[kUsq], "cuLaunchKernel(tg_adafactor_usq)", units, 1, gp, sp, rp, wsp, n, cols, factored, eps1_sq);
  launch(launch.kernels().adafactor_coef, "cuLaunchKernel(tg_adafactor_coef)", 1, 1, wsp, units, n, d);
  launch(stage[kApply], "cuLaunchKernel(tg_adafactor_apply)", units, 1, pp, gp, sp, rp, wsp, n, cols, factored, eps1_sq, shrink);
}

void cuda_cross_entropy_forward(const at::Tensor& x, const at::Tensor& target, at::Tensor& lse, at::Tensor& loss) {
  long long rows = x.size(0), cols = x.size(1);
  if (rows == 0) return;
  const int d = dtype_index(x.scalar_type(), "cross_entropy");
  const void* xp = x.data_ptr();
  const void* tp = target.data_ptr();
  void* lp = lse.data_ptr();
  void* op = loss.data_ptr();
  const Launcher launch(x.device());
  launch(launch.kernels().per_dtype[d].ce_forward, "cuLaunchKernel(tg_ce_forward)", rows, 1, xp, tp, lp, op, cols);
}

void cuda_cross_entropy_backward(const at::Tensor& x, const at::Tensor& target, const at::Tensor& lse, const at::Tensor& grad_scale,
                                 at::Tensor& grad) {
  long long rows = x.size(0), cols = x.size(1);
  if (rows == 0) return;
  const int d = dtype_index(x.scalar_type(), "cross_entropy");
  const void* xp = x.data_ptr();
  const void* tp = target.data_ptr();
  const void* lp = lse.data_ptr();
  const void* sp = grad_scale.data_ptr();
  void* gp = grad.data_ptr();
  const Launcher launch(x.device());
  launch(launch.kernels().per_dtype[d].ce_backward, "cuLaunchKernel(tg_ce_backward)", rows, 1, xp, tp, lp, sp, gp, cols);
}

void cuda_cross_entropy_forward_grad(at::Tensor& x, const at::Tensor& target, at::Tensor& lse, at::Tensor& loss, const at::Tensor& grad_scale) {
  long long rows = x.size(0), cols = x.size(1);
  if (rows == 0) return;
  const int d = dtype_index(x.scalar_type(), "cross_entropy");
  void* xp = x.data_ptr();
  const void* tp = target.data_ptr();
  void* lp = lse.data_ptr();
  void* op = loss.data_ptr();
  const void* sp = grad_scale.data_ptr();
  const Launcher launch(x.device());
  launch(launch.kernels().per_dtype[d].ce_forward_grad, "cuLaunchKernel(tg_ce_forward_grad)", rows, 1, xp, tp, lp, op, sp, cols);
}

void cuda_cross_entropy_scale_grad(at::Tensor& grad, const at::Tensor& target, const at::Tensor& factor) {
  long long rows = grad.size(0), cols = grad.size(1);
  if (rows == 0) return;
  const int d = dtype_index(grad.scalar_type(), "cross_entropy");
  void* gp = grad.data_ptr();
  const void* tp = target.data_ptr();
  const void* fp = factor.data_ptr();
  const Launcher launch(grad.device());
  launch(launch.kernels().per_dtype[d].ce_scale_grad, "cuLaunchKernel(tg_ce_scale_grad)", rows, 1, gp, tp, fp, cols);
}

// A tensor's data for a kernel argument: null when it is undefined (an optional input).
const void* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }
void* mutable_data_or_null(at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

void cuda_residual_norm_forward(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w, const at::Tensor& b, at::Tensor& s,
                             at::Tensor& y, at::Tensor& mean, at::Tensor& rstd, float eps, bool rms) {
  long long rows = x.size(0), cols = x.size(1);
  int rms_flag = rms ? 1 : 0;
  if (rows == 0) return;
  const int d = dtype_index(y.scalar_type(), "residual_norm");
  const void* xp = x.data_ptr();
  const void* dp = data_or_null(delta);
  const void* wp = w.data_ptr();
  const void* bp = data_or_null(b);
  // Written only with a delta (without one, s is x).
  void* sp = delta.defined() ? s.data_ptr() : nullptr;
  void* yp = y.data_ptr();
  void* mp = mean.data_ptr();
  void* rp = rstd.data_ptr();
  const Launcher launch(x.device());
  const auto& k = launch.kernels().per_dtype[d];
  if (cols <= kWarpRowCols) {
    launch(k.ln_forward_warp, "cuLaunchKernel(tg_ln_forward_warp)", warp_row_blocks(rows), 1, xp, dp, wp, bp, sp, yp, mp, rp, rows, cols, eps, rms_flag);
  } else {
    launch(k.ln_forward, "cuLaunchKernel(tg_ln_forward)", rows, 1, xp, dp, wp, bp, sp, yp, mp, rp, cols, eps, rms_flag);
  }
}

void cuda_residual_norm_backward(const at::Tensor& s, const at::Tensor& w, const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& dy,
                              const at::Tensor& ds, at::Tensor& dx, at::Tensor& ddelta, at::Tensor& dw, at::Tensor& db, bool rms) {
  long long rows = s.size(0), cols = s.size(1);
  int rms_flag = rms ? 1 : 0;
  if (rows == 0) return;
  const int d = dtype_index(dy.defined() ? dy.scalar_type() : ddelta.defined() ? ddelta.scalar_type() : at::kFloat, "residual_norm");
  const void* sp = s.data_ptr();
  const void* wp = w.data_ptr();
  const void* mp = mean.data_ptr();
  const void* rp = rstd.data_ptr();
  const void* dyp = data_or_null(dy);
  const void* dsp = data_or_null(ds);
  void* dxp = dx.data_ptr();
  void* ddp = mutable_data_or_null(ddelta);
  const Launcher launch(s.device());
  const auto& k = launch.kernels().per_dtype[d];
  void* dwp = dw.data_ptr();
  void* dbp = mutable_data_or_null(db);
  // The weight and bias gradients: each band's sums into `partial`, then the bands added in order.
  const auto sum_bands = [&](at::Tensor& partial, long long bands) {
    void* pp = partial.data_ptr();
    launch(launch.kernels().ln_param_sum, "cuLaunchKernel(tg_ln_param_sum)", (cols + 31) / 32, 2, pp, dwp, dbp, bands, cols);
  };
  if (cols <= kWarpRowCols) {
    // A warp a row: the band sums in the same pass (a band a block), where there is a dy.
    long long bands = warp_backward_blocks(rows);
    at::Tensor partial = dy.defined() ? at::empty({bands, 2 * cols}, s.options()) : at::Tensor();
    void* pp = mutable_data_or_null(partial);
    launch(k.ln_backward_warp, "cuLaunchKernel(tg_ln_backward_warp)", bands, 1, sp, wp, mp, rp, dyp, dsp, dxp, ddp, pp, rows, cols, rms_flag);
    if (dy.defined()) sum_bands(partial, bands);  // (without one, dw and db stay zero)
    return;
  }
  launch(k.ln_backward, "cuLaunchKernel(tg_ln_backward)", rows, 1, sp, wp, mp, rp, dyp, dsp, dxp, ddp, cols, rms_flag);
  if (!dy.defined()) return;
  // A block a row: bands of rows per column tile in a pass of their own.
  long long band_rows = kBandRows;
  long long bands = band_count(rows);
  at::Tensor partial = at::empty({bands, 2 * cols}, s.options());
  void* pp = partial.data_ptr();
  launch(k.ln_param_grads, "cuLaunchKernel(tg_ln_param_grads)", (cols + 31) / 32, bands, sp, mp, rp, dyp, pp, rows, cols, band_rows);
  sum_bands(partial, bands);
}

namespace {
// SwiGLU's layout of g (and u, dg, du): contiguous, one row of n; else rows of `cols` values
// `stride` apart (the halves of a joint [rows, 2·cols] tensor).
std::pair<long long, long long> swiglu_rows(const at::Tensor& g) {
  if (g.is_contiguous()) return {g.numel(), g.numel()};
  return {g.size(-1), g.stride(-2)};
}
}  // namespace

void cuda_swiglu_forward(const at::Tensor& g, const at::Tensor& u, at::Tensor& h) {
  long long n = g.numel();
  if (n == 0) return;
  const int d = dtype_index(g.scalar_type(), "swiglu");
  const void* gp = g.data_ptr();
  const void* up = u.data_ptr();
  void* hp = h.data_ptr();
  auto [cols, stride] = swiglu_rows(g);
  const Launcher launch(g.device());
  launch(launch.kernels().per_dtype[d].swiglu_forward, "cuLaunchKernel(tg_swiglu_forward)", (n + kBlockValues - 1) / kBlockValues, 1, gp, up, hp, n, cols, stride);
}

void cuda_swiglu_backward(const at::Tensor& dh, const at::Tensor& g, const at::Tensor& u, at::Tensor& dg, at::Tensor& du) {
  long long n = g.numel();
  if (n == 0) return;
  const int d = dtype_index(g.scalar_type(), "swiglu");
  const void* dhp = dh.data_ptr();
  const void* gp = g.data_ptr();
  const void* up = u.data_ptr();
  void* dgp = dg.data_ptr();
  void* dup = du.data_ptr();
  auto [cols, stride] = swiglu_rows(g);
  const Launcher launch(g.device());
  launch(launch.kernels().per_dtype[d].swiglu_backward, "cuLaunchKernel(tg_swiglu_backward)", (n + kBlockValues - 1) / kBlockValues, 1, dhp, gp, up, dgp, dup, n, cols, stride);
}

void cuda_rope(const std::vector<RopePart>& parts, const at::Tensor& cos, const at::Tensor& sin) {
  if (parts.empty() || parts.size() > 3) throw std::invalid_argument("rope: one to three parts a launch");
  const at::Tensor& first = *parts[0].src;
  long long rows = first.size(0) * first.size(1);
  int t = static_cast<int>(first.size(1)), d = static_cast<int>(cos.size(1));
  if (rows == 0) return;
  if (rows > std::numeric_limits<int>::max()) throw std::invalid_argument("rope: more than 2^31 rows");
  const auto on_16_bytes = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  // 16-byte packs of 8 values where a head's halves hold whole packs and every row starts on 16 bytes.
  bool packed = d % 16 == 0 && on_16_bytes(cos.data_ptr()) && on_16_bytes(sin.data_ptr());
  RopeJobs jobs{};  // the jobs not given: 0 heads
  for (std::size_t k = 0; k < parts.size(); ++k) {
    const RopePart& part = parts[k];
    RopeJobs::Job& j = jobs.job[k];
    j = {part.src->data_ptr(), part.dst->data_ptr(), part.src->stride(0), part.src->stride(1), part.dst->stride(0), part.dst->stride(1), part.heads, static_cast<int>(part.op), 0};
    for (long long stride : {j.src_batch, j.src_row, j.dst_batch, j.dst_row}) packed = packed && stride % 8 == 0;
    packed = packed && on_16_bytes(j.src) && on_16_bytes(j.dst);
  }
  jobs.pairs = packed ? 8 : 1;
  const long long units = rows * (d / 2 / jobs.pairs) * (jobs.job[0].heads + jobs.job[1].heads + jobs.job[2].heads);
  const int dt = dtype_index(first.scalar_type(), "rope");
  const void* cp = cos.data_ptr();
  const void* sp = sin.data_ptr();
  const Launcher launch(first.device());
  launch(launch.kernels().per_dtype[dt].rope, "cuLaunchKernel(tg_rope)", (units + 255) / 256, 1, jobs, cp, sp, rows, t, d);
}

namespace {
// Whether these [rows, cols] tensors can be read 8 values a lane (the packed column sums): all
// contiguous with rows of a multiple of 8 values, every start on 16 bytes.
bool packs_fit(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    if (!t->is_contiguous() || t->size(1) % 8 != 0 || reinterpret_cast<std::uintptr_t>(t->data_ptr()) % 16 != 0) return false;
  }
  return true;
}

// The bands' sums in `partial` [bands, cols] added in band order into `out` [cols].
void finish_column_sum(const Launcher& launch, at::Tensor& partial, at::Tensor& out) {
  long long bands = partial.size(0), cols = partial.size(1);
  void* pp = partial.data_ptr();
  void* op = out.data_ptr();
  launch(launch.kernels().col_sum_finish, "cuLaunchKernel(tg_col_sum_finish)", (cols + 255) / 256, 1, pp, op, bands, cols);
}
}  // namespace

void cuda_column_sum(const at::Tensor& dy, at::Tensor& out) {
  long long rows = dy.size(0), cols = dy.size(1);
  if (cols == 0) return;
  if (rows == 0) {
    out.zero_();
    return;
  }
  const int d = dtype_index(dy.scalar_type(), "column_sum");
  long long band_rows = kBandRows;
  long long bands = band_count(rows);
  at::Tensor partial = at::empty({bands, cols}, dy.options().dtype(at::kFloat));
  const void* dyp = dy.data_ptr();
  void* pp = partial.data_ptr();
  const Launcher launch(dy.device());
  const auto& k = launch.kernels().per_dtype[d];
  if (packs_fit({&dy})) {
    launch(k.col_sum_bands_packed, "cuLaunchKernel(tg_col_sum_bands_packed)", (cols + 255) / 256, bands, dyp, pp, rows, cols, band_rows);
  } else {
    launch(k.col_sum_bands, "cuLaunchKernel(tg_col_sum_bands)", (cols + 63) / 64, bands, dyp, pp, rows, cols, band_rows);
  }
  finish_column_sum(launch, partial, out);
}

at::Tensor cuda_gelu_backward(const at::Tensor& da, const at::Tensor& h, at::Tensor* db) {
  long long rows = h.size(0), cols = h.size(1);
  if (rows == 0 || cols == 0 || da.sizes() != h.sizes() || da.scalar_type() != h.scalar_type() || !packs_fit({&da, &h})) return at::Tensor();
  at::Tensor dh = at::empty_like(h, at::MemoryFormat::Contiguous);
  if (!packs_fit({&dh})) return at::Tensor();
  const int d = dtype_index(h.scalar_type(), "gelu_backward");
  long long band_rows = kBandRows;
  long long bands = band_count(rows);
  at::Tensor partial = db != nullptr ? at::empty({bands, cols}, h.options().dtype(at::kFloat)) : at::Tensor();
  const void* dap = da.data_ptr();
  const void* hp = h.data_ptr();
  void* dhp = dh.data_ptr();
  void* pp = db != nullptr ? partial.data_ptr() : nullptr;
  const Launcher launch(h.device());
  launch(launch.kernels().per_dtype[d].gelu_backward_bands, "cuLaunchKernel(tg_gelu_backward_bands)", (cols + 255) / 256, bands, dap, hp, dhp, pp, rows, cols, band_rows);
  if (db != nullptr) finish_column_sum(launch, partial, *db);
  return dh;
}
}  // namespace trainguard

extern "C" {

// The machine code (an ELF cubin) of the kernels in `src` for compute capability major.minor, in
// a malloc'd buffer released with tg_cuda_jit_free. Needs NVRTC, not a GPU.
int tg_nvrtc_compile(const char* src, int major, int minor, char** out, size_t* len, char* err, size_t err_len) {
  *out = nullptr;
  *len = 0;
  return guarded(err, err_len, [&] {
    const std::string cubin = compile(src, major, minor);
    char* buf = static_cast<char*>(std::malloc(cubin.size()));
    if (buf == nullptr) throw std::bad_alloc();
    std::memcpy(buf, cubin.data(), cubin.size());
    *out = buf;
    *len = cubin.size();
  });
}

void tg_cuda_jit_free(char* p) { std::free(p); }

// NVRTC's version and the library loaded (`trainguard env`); the error says why none loads.
int tg_nvrtc_info(int* major, int* minor, char* path, size_t path_len, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
    const Nvrtc& api = nvrtc();
    const int rc = api.version(major, minor);
    if (rc != 0) throw std::runtime_error(std::string("nvrtcVersion: ") + api.error(rc));
    trainguard::copy_message(api.path, path, path_len);
  });
}

// Compiles `src` for CUDA device `ordinal`'s compute capability and loads its kernels into the
// device's primary context, once per device (later calls return at once).
int tg_cuda_jit_prepare(int ordinal, const char* src, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
    std::lock_guard<std::mutex> g(loaded_lock);
    if (loaded().count(ordinal) != 0) return;
    const Driver& cu = driver();
    check_cu(cu.init(0), "cuInit");
    int device = 0, major = 0, minor = 0;
    check_cu(cu.device_get(&device, ordinal), "cuDeviceGet");
    check_cu(cu.attribute(&major, 75, device), "cuDeviceGetAttribute(compute capability major)");
    check_cu(cu.attribute(&minor, 76, device), "cuDeviceGetAttribute(compute capability minor)");
    Loaded k;
    check_cu(cu.primary_ctx_retain(&k.ctx, device), "cuDevicePrimaryCtxRetain");
    ContextScope scope(k.ctx);
    const std::string cubin = compile(src, major, minor);
    void* module = nullptr;
    check_cu(cu.module_load_data(&module, cubin.data()), "cuModuleLoadData");
    look_up(k, [&](void** out, const std::string& name) { check_cu(cu.module_get_function(out, module, name.c_str()), name.c_str()); });
    loaded()[ordinal] = k;
  });
}

// For tests: while on (on this thread), CPU tensors take the CUDA paths and run the kernels'
// source compiled for the host (cuda_emulation.cpp).
void tg_cuda_emulation_set(int on) { emulating = on != 0; }
int tg_cuda_emulation_on() { return emulating ? 1 : 0; }

}  // extern "C"
