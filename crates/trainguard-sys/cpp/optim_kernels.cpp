// The optimizers' and clipping's kernels (Rust side: crates/trainguard-sys/src/kernels.rs). Every entry point
// catches C++ exceptions and returns them as a message, as shim.cpp's do.
// - ATen's multi-tensor kernels tch does not expose (CPU and CUDA): fused AdamW and SGD, a tensor
//   list's global norm and scaling.
// - Our own fused CPU updates for the optimizers ATen has no kernel for: 8-bit AdamW reads and
//   writes every value once, Adafactor in four reads and one write, where the same maths from
//   ATen ops takes ~20 passes. Their CUDA counterparts are in optim_kernels.cu, compiled at run
//   time (cuda_jit.cpp); tg_adamw8bit_update and tg_adafactor_update take tensors on either
//   device. The maths and the state layout are those of src/optim
//   (adamw8bit.rs, quant.rs, adafactor.rs); the tensor-op versions there stay as the CUDA path
//   and as the reference these are tested against.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/_foreach_zero.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/_fused_sgd.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "cuda_jit.h"
#include "guarded.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

namespace {
using trainguard::guarded;

// Values per absmax scale (quant::BLOCK) and the floor of a scale (quant::TINY).
constexpr int64_t kBlock = 2048;
constexpr float kTiny = 1e-30f;

// Round half to even, as at::round: adding and subtracting 1.5·2^23 leaves the nearest integer
// for |x| < 2^22 under the default rounding mode, in plain arithmetic that vectorises (nearbyint
// is a libm call per value on baseline x86-64). Codes are within ±255.
inline float round_even(float x) {
  const float magic = 12582912.0f;
  return (x + magic) - magic;
}

// ATen's scalar lerp: self + w·(end − self) for w < ½, else end − (end − self)·(1 − w).
inline float lerp(float self, float end, float w) {
  return w < 0.5f ? self + w * (end - self) : end - (end - self) * (1.0f - w);
}

// Non-negative floats order as their bit patterns: a max over those vectorises where a float max
// (with its NaN rules) does not. NaN never gets here: a step with a non-finite gradient is skipped.
inline uint32_t magnitude_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b & 0x7fffffffu;
}

inline float from_bits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

struct Adamw8bitStep {
  float w1, w2;          // 1 − β1, 1 − β2: the lerp weights of the moments
  float shrink;          // 1 − lr·wd, or 1 without decay
  float scale, shift;    // p += m / (√v·scale + shift): bias correction and lr folded in
  bool apply;            // lr > 0 (else moments move and parameters stay)
};

// One block of `len` values: dequantise both moments, AdamW, requantise with fresh scales. Three
// loops over the block (held in L1) so that each vectorises. Compiled for AVX-512, AVX2 and plain
// x86-64, picked at load time (GCC's target_clones); built with -ffp-contract=off (build.rs), every
// clone rounds the same way (IEEE sqrt and division, no fused multiply-add), so results do not
// depend on the CPU.
template <typename P>
__attribute__((target_clones("avx512f", "avx2", "default")))
void adamw8bit_block(P* __restrict p, const P* __restrict g, int8_t* __restrict qm, float* am, uint8_t* __restrict qv,
                     float* av, int64_t len, const Adamw8bitStep& s) {
  float m[kBlock], v[kBlock];
  // quant::dequantise_signed / _unsigned: m = q·|q|·A/127², v = (q/255)⁴·A.
  const float a_m = *am * (1.0f / 16129.0f), a_v = *av;
  uint32_t top_m = 0, top_v = 0;
  for (int64_t i = 0; i < len; ++i) {
    const float q = static_cast<float>(qm[i]);
    float c = static_cast<float>(qv[i]) * (1.0f / 255.0f);
    c = c * c;
    const float gi = static_cast<float>(g[i]);
    m[i] = lerp(q * std::fabs(q) * a_m, gi, s.w1);
    v[i] = lerp(c * c * a_v, gi * gi, s.w2);
    top_m = std::max(top_m, magnitude_bits(m[i]));
    top_v = std::max(top_v, magnitude_bits(v[i]));
  }
  if (s.apply) {
    for (int64_t i = 0; i < len; ++i) {
      p[i] = static_cast<P>(static_cast<float>(p[i]) * s.shrink + m[i] / (std::sqrt(v[i]) * s.scale + s.shift));
    }
  }
  // quant::quantise_signed / _unsigned with the new absmax A: round(127·sign(m)·√(|m|/A)),
  // round(255·⁴√(v/A)).
  const float new_m = std::max(from_bits(top_m), kTiny), new_v = std::max(from_bits(top_v), kTiny);
  const float inv_m = 1.0f / new_m, inv_v = 1.0f / new_v;
  for (int64_t i = 0; i < len; ++i) {
    const float code_m = std::sqrt(std::fabs(m[i]) * inv_m) * 127.0f;
    qm[i] = static_cast<int8_t>(static_cast<int32_t>(round_even(m[i] < 0.0f ? -code_m : code_m)));
    qv[i] = static_cast<uint8_t>(static_cast<int32_t>(round_even(std::sqrt(std::sqrt(v[i] * inv_v)) * 255.0f)));
  }
  *am = new_m;
  *av = new_v;
}

void check(bool ok, const char* kernel, const char* what) {
  if (!ok) throw std::invalid_argument(std::string(kernel) + ": " + what);
}

struct AdafactorStep {
  float w;              // 1 − β2,t: the lerp weight of the second moments
  float rho;            // min(lr, 1/√t)
  float eps1_sq, eps2;  // floors of the second moment (squared) and of RMS(p)
  float d;              // clipping threshold of RMS(u)
  float shrink;         // 1 − lr·wd, or 1 without decay
};

// Reductions are summed in double over at most kMaxPieces fixed pieces (runs of rows, or of
// values) whose partial sums are then added in order, so the result does not depend on the
// thread count; the partial sums live on the stack, so the update allocates nothing (an
// allocation failing half-way would leave some parameters updated and others not, and the
// guard's replay would update those twice).
constexpr int64_t kMaxPieces = 256;
constexpr int64_t kPiece = 4096;  // values per piece of an unfactored tensor, before the cap

template <typename F>
double ordered_sum(int64_t pieces, F&& piece_sum) {
  double partial[kMaxPieces];
  at::parallel_for(0, pieces, 1, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) partial[i] = piece_sum(i);
  });
  double total = 0.0;
  for (int64_t i = 0; i < pieces; ++i) total += partial[i];
  return total;
}

// Σ term(i)² over i < len in kLanes partial sums (lane k takes every kLanes-th term), added up
// at the end: independent lanes vectorise without reassociating anything, so the order is fixed.
constexpr int64_t kLanes = 8;

template <typename Term>
__attribute__((target_clones("avx512f", "avx2", "default")))
double sum_of_squares(int64_t len, Term term) {
  double lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    for (int64_t k = 0; k < kLanes; ++k) {
      const double v = term(i + k);
      lane[k] += v * v;
    }
  }
  for (; i < len; ++i) {
    const double v = term(i);
    lane[0] += v * v;
  }
  double acc = 0.0;
  for (double l : lane) acc += l;
  return acc;
}

template <typename P>
double sum_squares(const P* x, int64_t len) {
  return sum_of_squares(len, [x](int64_t i) { return static_cast<float>(x[i]); });
}

// Σ over rows of x[r, c0 + j]² for j < width, into acc[j] (a tile of columns, rows in order).
template <typename P>
__attribute__((target_clones("avx512f", "avx2", "default")))
void column_squares(const P* __restrict x, int64_t rows, int64_t cols, int64_t c0, int64_t width, double* __restrict acc) {
  for (int64_t j = 0; j < width; ++j) acc[j] = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    const P* row = x + r * cols + c0;
    for (int64_t j = 0; j < width; ++j) {
      const double v = static_cast<float>(row[j]);
      acc[j] += v * v;
    }
  }
}

// u = g / √max(second moment, eps1²) over one row (factored: row factor × column factors) or run
// (full: one second moment per value).
template <typename P>
inline float update_value(const P* g, const P* second, float row_factor, float eps1_sq, int64_t i) {
  return static_cast<float>(g[i]) / std::sqrt(std::max(row_factor * static_cast<float>(second[i]), eps1_sq));
}

// Σu² over a run.
template <typename P>
double update_squares(const P* g, const P* second, float row_factor, int64_t len, float eps1_sq) {
  return sum_of_squares(len, [=](int64_t i) { return update_value(g, second, row_factor, eps1_sq, i); });
}

// p ← p·shrink + coef·u over a run.
template <typename P>
__attribute__((target_clones("avx512f", "avx2", "default")))
void apply_update(P* __restrict p, const P* __restrict g, const P* __restrict second, float row_factor, int64_t len,
                  float eps1_sq, float shrink, float coef) {
  for (int64_t i = 0; i < len; ++i) {
    p[i] = static_cast<P>(static_cast<float>(p[i]) * shrink + coef * update_value(g, second, row_factor, eps1_sq, i));
  }
}

template <typename P>
void adafactor(P* p, const P* g, P* row_var, P* col_var, P* variance, int64_t rows, int64_t cols, const AdafactorStep& s) {
  const int64_t n = rows * cols;
  const bool factored = variance == nullptr;
  // Pieces: runs of rows of a matrix, runs of values of anything else.
  const int64_t units = factored ? rows : n;
  const int64_t pieces = std::min(kMaxPieces, factored ? rows : (n + kPiece - 1) / kPiece);
  float row_scale = 1.0f;  // factored: 1 / mean(row_var), which normalises the outer product
  // f(offset, len, second moments, row factor) for each row of piece i, or once for its run.
  auto each_run = [&](int64_t i, auto&& f) {
    const int64_t b = i * units / pieces, e = (i + 1) * units / pieces;
    if (factored) {
      for (int64_t r = b; r < e; ++r) f(r * cols, cols, col_var, static_cast<float>(row_var[r]) * row_scale);
    } else {
      f(b, e - b, variance + b, 1.0f);
    }
  };
  auto total = [&](auto&& run_sum) {
    return ordered_sum(pieces, [&](int64_t i) {
      double acc = 0.0;
      each_run(i, [&](int64_t o, int64_t l, const P* second, float row_factor) { acc += run_sum(o, l, second, row_factor); });
      return acc;
    });
  };
  // α = max(eps2, RMS(p))·ρ from the parameter before this step's decay.
  const double rms_p = std::sqrt(total([&](int64_t o, int64_t l, const P*, float) { return sum_squares(p + o, l); }) / n);
  const float alpha = static_cast<float>(std::max<double>(s.eps2, rms_p) * s.rho);
  if (factored) {
    // Running means of g² per row and per column.
    at::parallel_for(0, rows, 16, [&](int64_t a, int64_t b) {
      for (int64_t r = a; r < b; ++r) {
        const float mean = static_cast<float>(sum_squares(g + r * cols, cols) / cols);
        row_var[r] = static_cast<P>(lerp(static_cast<float>(row_var[r]), mean, s.w));
      }
    });
    constexpr int64_t kTile = 64;
    at::parallel_for(0, (cols + kTile - 1) / kTile, 1, [&](int64_t a, int64_t b) {
      double acc[kTile];
      for (int64_t t = a; t < b; ++t) {
        const int64_t c0 = t * kTile, width = std::min(kTile, cols - c0);
        column_squares(g, rows, cols, c0, width, acc);
        for (int64_t j = 0; j < width; ++j) {
          col_var[c0 + j] = static_cast<P>(lerp(static_cast<float>(col_var[c0 + j]), static_cast<float>(acc[j] / rows), s.w));
        }
      }
    });
    double row_sum = 0.0;
    for (int64_t r = 0; r < rows; ++r) row_sum += static_cast<float>(row_var[r]);
    row_scale = 1.0f / std::max(static_cast<float>(row_sum / rows), std::sqrt(s.eps1_sq));
  } else {
    at::parallel_for(0, n, kPiece, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) {
        const float gi = static_cast<float>(g[i]);
        variance[i] = static_cast<P>(lerp(static_cast<float>(variance[i]), gi * gi, s.w));
      }
    });
  }
  // The update u, its RMS clipped to d: p ← p·shrink − α·u / max(1, RMS(u)/d). Two passes: one for
  // Σu², one to apply (u is recomputed rather than stored).
  const double rms_u = std::sqrt(total([&](int64_t o, int64_t l, const P* second, float row_factor) {
    return update_squares(g + o, second, row_factor, l, s.eps1_sq);
  }) / n);
  const float coef = -alpha / static_cast<float>(std::max(1.0, rms_u / s.d));
  at::parallel_for(0, pieces, 1, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      each_run(i, [&](int64_t o, int64_t l, const P* second, float row_factor) {
        apply_update(p + o, g + o, second, row_factor, l, s.eps1_sq, s.shrink, coef);
      });
    }
  });
}

// ATen's fused CPU kernels walk each parameter's elements and read the other lists at the same
// offsets without comparing sizes: a mismatch would read or write out of bounds, so it is an
// error here.
void check_same_shapes(const char* what, const std::vector<at::Tensor>& params,
                       std::initializer_list<const std::vector<at::Tensor>*> others) {
  for (const auto* list : others) {
    for (size_t i = 0; i < params.size(); ++i) {
      TORCH_CHECK(params[i].sizes() == (*list)[i].sizes(), what, ": tensor ", i, " has shape ", (*list)[i].sizes(),
                  ", its parameter ", params[i].sizes());
    }
  }
}
// One tensor's L2 norm on the CPU, in fp64. ATen's CPU norm kernel accumulates a whole tensor in
// fp32 lanes, which drifts on tens of millions of values: a [50304, 768] gradient came out 0.24%
// low (62.016 against 62.163 in fp64; the CUDA kernel gave 62.163). Rows of 4096 values are short
// enough to stay within 1e-8; their norms are combined in fp64. Same speed, no copy (a `dtype`
// of fp64 would cast the whole tensor and run 17 times slower).
at::Tensor cpu_norm(const at::Tensor& t) {
  constexpr int64_t kRow = 4096;
  const auto flat = t.reshape({-1});
  const int64_t n = flat.numel(), rows = n / kRow;
  const auto row_dtype = t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  std::vector<at::Tensor> parts;
  if (rows > 0) {
    auto row_norms = at::linalg_vector_norm(flat.narrow(0, 0, rows * kRow).view({rows, kRow}), 2, {1}, false, row_dtype);
    parts.push_back(row_norms.to(at::kDouble));
  }
  if (n > rows * kRow) {
    parts.push_back(at::linalg_vector_norm(flat.narrow(0, rows * kRow, n - rows * kRow), 2, {}, false, row_dtype).to(at::kDouble).reshape({1}));
  }
  if (parts.empty()) return at::zeros({}, flat.options().dtype(at::kDouble));
  return at::linalg_vector_norm(at::cat(parts), 2);
}
}  // namespace

extern "C" {

// The tch handles (`at::Tensor*`) of a list, as ATen's tensor lists want them.
static std::vector<at::Tensor> tensor_list(const void* const* ptrs, size_t n) {
  std::vector<at::Tensor> v;
  v.reserve(n);
  for (size_t i = 0; i < n; ++i) v.push_back(*static_cast<const at::Tensor*>(ptrs[i]));
  return v;
}

// The global L2 norm of `n` tensors into the 0-dim `out`: each tensor's norm in one multi-tensor
// launch on CUDA (`_foreach_norm`), on the CPU by `cpu_norm`; then the norm of those.
int tg_global_norm(const void* const* ts, size_t n, void* out, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
    auto list = tensor_list(ts, n);
    std::vector<at::Tensor> norms;
    if (!list.empty() && list[0].is_cpu()) {
      for (const auto& t : list) norms.push_back(cpu_norm(t));
    } else {
      norms = at::_foreach_norm(list, 2);
    }
    static_cast<at::Tensor*>(out)->copy_(at::linalg_vector_norm(at::stack(norms), 2));
  });
}

// Every one of `n` tensors times `factor`, in place, in one multi-tensor launch on CUDA.
int tg_scale_all(const void* const* ts, size_t n, double factor, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
    auto list = tensor_list(ts, n);
    at::_foreach_mul_(list, factor);
  });
}

// dst[i] += src[i] for `n` pairs of tensors, in place, in one multi-tensor launch on CUDA.
int tg_add_all(const void* const* dst, const void* const* src, size_t n, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
    auto d = tensor_list(dst, n), s = tensor_list(src, n);
    check_same_shapes("add_all", d, {&s});
    at::_foreach_add_(d, s);
  });
}

// Every one of `n` tensors set to zero, in place, in one multi-tensor launch on CUDA.
int tg_zero_all(const void* const* ts, size_t n, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
    auto list = tensor_list(ts, n);
    at::_foreach_zero_(list);
  });
}

// One AdamW update of `n` tensors with ATen's fused kernel (CPU and CUDA): reads each tensor
// once. The tensors are tch handles (`at::Tensor*`). `steps` must already be incremented.
int tg_fused_adamw(const void* const* params, const void* const* grads, const void* const* exp_avgs,
                   const void* const* exp_avg_sqs, const void* const* steps, size_t n, double lr,
                   double beta1, double beta2, double weight_decay, double eps, char* err,
                   size_t err_len) {
  return guarded(err, err_len, [&] {
    auto list = [n](const void* const* ptrs) { return tensor_list(ptrs, n); };
    auto p = list(params), g = list(grads), m = list(exp_avgs), v = list(exp_avg_sqs), s = list(steps);
    check_same_shapes("fused AdamW", p, {&g, &m, &v});
    at::_fused_adamw_(p, g, m, v, /*max_exp_avg_sqs=*/{}, s, lr, beta1, beta2, weight_decay, eps,
                      /*amsgrad=*/false, /*maximize=*/false);
  });
}

// One SGD update of `n` tensors with ATen's fused kernel (CPU and CUDA), as torch.optim.SGD with
// fused=True: coupled decay, then (with `bufs`, `n` of them, else null) heavy-ball momentum whose
// first step copies the gradient. Dampening 0, no Nesterov.
int tg_fused_sgd(const void* const* params, const void* const* grads, const void* const* bufs, size_t n,
                 double weight_decay, double momentum, double lr, int is_first_step, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
    auto p = tensor_list(params, n), g = tensor_list(grads, n);
    auto b = bufs ? tensor_list(bufs, n) : std::vector<at::Tensor>{};
    check_same_shapes("fused SGD", p, {&g});
    if (bufs) check_same_shapes("fused SGD", p, {&b});
    at::_fused_sgd_(p, g, b, weight_decay, momentum, lr, /*dampening=*/0.0, /*nesterov=*/false,
                    /*maximize=*/false, is_first_step != 0);
  });
}

// One 8-bit AdamW update of a whole parameter on the CPU, block by block across the intra-op
// threads. Tensors are tch handles: parameter and gradient (same dtype: fp32, bf16 or fp16; flat
// and contiguous), int8 / uint8 codes of the moments and one fp32 scale per block for each.
int tg_adamw8bit_update(void* param, const void* grad, void* exp_avg, void* exp_avg_absmax,
                        void* exp_avg_sq, void* exp_avg_sq_absmax, double beta1, double beta2,
                        double shrink, double scale, double shift, int apply, char* err,
                        size_t err_len) {
  return guarded(err, err_len, [&] {
    auto& p = *static_cast<at::Tensor*>(param);
    const auto& g = *static_cast<const at::Tensor*>(grad);
    auto& qm = *static_cast<at::Tensor*>(exp_avg);
    auto& am = *static_cast<at::Tensor*>(exp_avg_absmax);
    auto& qv = *static_cast<at::Tensor*>(exp_avg_sq);
    auto& av = *static_cast<at::Tensor*>(exp_avg_sq_absmax);
    const int64_t n = p.numel(), blocks = (n + kBlock - 1) / kBlock;
    for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&p, &g, &qm, &am, &qv, &av}) check(t->device() == p.device() && t->is_contiguous(), "adamw8bit_update", "tensors must be contiguous and on one device");
    check(p.is_cpu() || p.is_cuda(), "adamw8bit_update", "tensors must be on the CPU or a CUDA device");
    check(g.numel() == n && qm.numel() == n && qv.numel() == n, "adamw8bit_update", "parameter, gradient and codes differ in length");
    check(am.numel() == blocks && av.numel() == blocks, "adamw8bit_update", "one scale per block of 2048 values");
    check(g.scalar_type() == p.scalar_type(), "adamw8bit_update", "gradient and parameter dtypes differ");
    check(qm.scalar_type() == at::kChar && qv.scalar_type() == at::kByte && am.scalar_type() == at::kFloat && av.scalar_type() == at::kFloat, "adamw8bit_update", "codes int8/uint8, scales fp32");
    const Adamw8bitStep s{static_cast<float>(1.0 - beta1), static_cast<float>(1.0 - beta2), static_cast<float>(shrink),
                          static_cast<float>(scale), static_cast<float>(shift), apply != 0};
    if (trainguard::runs_cuda_kernels(p)) {
      trainguard::cuda_adamw8bit_update(p, g, qm, am, qv, av, blocks, s.w1, s.w2, s.shrink, s.scale, s.shift, s.apply);
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, p.scalar_type(), "adamw8bit_update", [&] {
      scalar_t* pp = p.data_ptr<scalar_t>();
      const scalar_t* gp = g.data_ptr<scalar_t>();
      int8_t* qmp = qm.data_ptr<int8_t>();
      uint8_t* qvp = qv.data_ptr<uint8_t>();
      float* amp = am.data_ptr<float>();
      float* avp = av.data_ptr<float>();
      // Blocks are independent (each owns its scales): any split over threads gives the same bits.
      at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t off = b * kBlock, len = std::min(kBlock, n - off);
          adamw8bit_block<scalar_t>(pp + off, gp + off, qmp + off, amp + b, qvp + off, avp + b, len, s);
        }
      });
    });
  });
}

// One Adafactor update of a whole parameter (see src/optim/adafactor.rs for the maths), on the CPU
// or, through optim_kernels.cu, on a CUDA device. Tensors are tch handles, all contiguous, on one
// device and of the parameter's dtype: for a matrix [R, C] `a` is row_var [R, 1] and `b` col_var
// [1, C]; for anything else `a` is the full variance and `b` is null. CUDA needs `workspace`, an
// fp64 buffer of at least 4 + units + bands·C values (units: R for a matrix, else one per 2048
// values; `bands` ≤ R runs of rows share a matrix's column sums); the CPU takes none (null).
int tg_adafactor_update(void* param, const void* grad, void* a, void* b, void* workspace, long long bands,
                        double one_minus_beta2, double rho, double eps1, double eps2, double d, double shrink, char* err,
                        size_t err_len) {
  return guarded(err, err_len, [&] {
    auto& p = *static_cast<at::Tensor*>(param);
    const auto& g = *static_cast<const at::Tensor*>(grad);
    auto& first = *static_cast<at::Tensor*>(a);
    at::Tensor* second = static_cast<at::Tensor*>(b);
    const bool factored = second != nullptr;
    const char* k = "adafactor_update";
    check(!factored || p.dim() == 2, k, "row and column factors are for matrices");
    check(p.is_cpu() || p.is_cuda(), k, "tensors must be on the CPU or a CUDA device");
    const int64_t rows = factored ? p.size(0) : 1, cols = factored ? p.size(1) : p.numel();
    for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&p, &g, &first, factored ? second : &first}) {
      check(t->device() == p.device() && t->is_contiguous() && t->scalar_type() == p.scalar_type(), k, "tensors must be contiguous, on one device and of the parameter's dtype");
    }
    check(g.numel() == p.numel(), k, "gradient and parameter differ in length");
    check(factored ? first.numel() == rows && second->numel() == cols : first.numel() == p.numel(), k, "second-moment shapes do not fit the parameter");
    if (p.numel() == 0) return;
    const AdafactorStep s{static_cast<float>(one_minus_beta2), static_cast<float>(rho), static_cast<float>(eps1 * eps1),
                          static_cast<float>(eps2), static_cast<float>(d), static_cast<float>(shrink)};
    if (trainguard::runs_cuda_kernels(p)) {
      check(workspace != nullptr, k, "CUDA needs a workspace");
      auto& ws = *static_cast<at::Tensor*>(workspace);
      const int64_t units = factored ? rows : (p.numel() + kBlock - 1) / kBlock;
      check(!factored || (bands >= 1 && bands <= rows && bands <= 65535), k, "column bands must be between 1 and the rows (and at most 65535)");
      check(ws.device() == p.device() && ws.is_contiguous() && ws.scalar_type() == at::kDouble, k, "the workspace must be a contiguous fp64 tensor on the parameter's device");
      check(ws.numel() >= 4 + units + (factored ? bands * cols : 0), k, "the workspace is too small for this parameter");
      trainguard::cuda_adafactor_update(p, g, first, second, ws, units, factored ? bands : 1, s.w, s.rho, s.eps1_sq, s.eps2, s.d, s.shrink);
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, p.scalar_type(), "adafactor_update", [&] {
      scalar_t* f = first.data_ptr<scalar_t>();
      adafactor<scalar_t>(p.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(), factored ? f : nullptr,
                          factored ? second->data_ptr<scalar_t>() : nullptr, factored ? nullptr : f, rows, cols, s);
    });
  });
}

}  // extern "C"
