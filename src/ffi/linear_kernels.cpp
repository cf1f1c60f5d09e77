// The linear layer as one autograd node of ours (`kernels.fused_linear`), for fp32 weights under
// autocast: y = x·wᵀ + b computed in autocast's dtype D as autocast's linear does (x, w and b
// rounded to D, one GEMM with the bias in its epilogue). What differs is backward. Autocast's
// linear gives the weight and bias gradients in D, and the casts' own backward (ToCopyBackward)
// then returns them to fp32: two passes and ~100 small kernels a GPT-2 micro-step. Here the
// weight's gradient comes out of the GEMM in fp32 (cuBLAS, D in, fp32 out: `at::mm` with an
// out_dtype, CUDA only) and the bias's from our column-sum kernels in fp32 (linear_kernels.cu),
// which read dy once; gradients nobody asked for (the LM head's padding mask) are not computed.
// It keeps what autocast's linear keeps: x and w in D.
// With GELU after it (GPT-2's MLP up-projection, `kernels.fused_gelu`) the node also keeps GELU's
// input h, as ATen's gelu does, and its backward takes GELU's gradient and the bias's column sums
// in one kernel (linear_kernels.cu, tg_gelu_backward_bands): the GELU gradient dh written once
// and summed from registers, where ATen's gelu_backward writes it and the column sums read it
// back (16384 × 3072 bf16 values, 100 MB, per layer and micro-step of GPT-2 124M at micro 16).
// It runs where our CUDA kernels run (CUDA, or the CPU under the host emulation for tests; there
// the weight's gradient is the GEMM in D cast to fp32, as autocast computes it). Elsewhere, or
// without autocast, tg_linear is ATen's linear.
// Between tg_linear_keep_casts(1) and (0) on one thread (an optimizer step's micro-steps) the
// weight's and bias's casts to D are made once and reused while their source is unchanged (its
// version counter), where autocast casts every weight again in every micro-step: for GPT-2 124M
// 744 MB moved and ~100 launches per micro-step (BENCHMARKS.md, "GPU checks on an H100, third
// session": bf16 copies 2.9 ms of a 148 ms step of four micro-steps). Nothing else changes: the
// same cast, so the same bits.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include "cuda_jit.h"
#include "guarded.h"
#include "node.h"

namespace {
// The casts kept on this thread while keeping is on: by source tensor, the source (held, so its
// address is not reused), its version when cast, and the cast.
struct KeptCast {
  at::Tensor source;
  int64_t version;
  at::Tensor cast;
};
thread_local int keeping_casts = 0;  // scopes open (tg_linear_keep_casts)
thread_local std::unordered_map<const c10::TensorImpl*, KeptCast> kept_casts;
thread_local uint64_t casts_reused = 0;

// `t` in dtype `d`: the kept cast where there is one of this version, else a new one (kept while
// keeping is on, where `t` is a parameter: a leaf that wants a gradient, not a tensor made anew
// each forward, such as merged projections' concatenated weights, whose casts would pile up).
at::Tensor cast_once(const at::Tensor& t, at::ScalarType d) {
  if (keeping_casts == 0 || t.scalar_type() == d || !t.is_leaf() || !t.requires_grad()) return t.to(d);
  auto it = kept_casts.find(t.unsafeGetTensorImpl());
  if (it != kept_casts.end() && it->second.version == t._version() && it->second.cast.scalar_type() == d) {
    ++casts_reused;
    return it->second.cast;
  }
  at::Tensor cast = t.to(d);
  kept_casts.insert_or_assign(t.unsafeGetTensorImpl(), KeptCast{t, t._version(), cast});
  return cast;
}

struct LinearNode : public torch::autograd::Function<LinearNode> {
  // x [rows, in] (fp32 or D); w [out, in] fp32; b [out] (any float dtype) or none; y [rows, out] in D
  // (with `gelu`, GELU of it: GPT-2's MLP up-projection, kernels.fused_gelu).
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                                                const std::optional<at::Tensor>& b, at::ScalarType d, bool gelu) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::Tensor xd = x.to(d), wd = cast_once(w, d);
    const at::Tensor y = b.has_value() ? at::addmm(cast_once(*b, d), xd, wd.t()) : at::mm(xd, wd.t());
    ctx->saved_data["x_type"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["with_bias"] = b.has_value();
    ctx->saved_data["gelu"] = gelu;
    if (!gelu) {
      ctx->save_for_backward({xd, wd});
      return {y};
    }
    // What ATen's gelu keeps (its input); the next layer keeps GELU's output, as without the node.
    ctx->save_for_backward({xd, wd, y});
    return {at::gelu(y)};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    trainguard::check_differentiable_once("linear", "fused_linear");
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor &xd = saved[0], &wd = saved[1];
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    at::Tensor dy = grads[0].to(xd.scalar_type()).contiguous();
    at::Tensor dx, dw, db;
    if (ctx->saved_data["with_bias"].toBool() && ctx->needs_input_grad(2)) db = at::empty({dy.size(1)}, dy.options().dtype(at::kFloat));
    if (ctx->saved_data["gelu"].toBool()) {
      // The GELU's gradient and the bias's in one pass (dy read once where ATen's gelu_backward
      // and the column sums read it and then dh), where the kernel can take the rows.
      const at::Tensor& h = saved[2];
      at::Tensor dh = trainguard::cuda_gelu_backward(dy, h, db.defined() ? &db : nullptr);
      if (!dh.defined()) {
        dh = at::gelu_backward(dy, h);
        if (db.defined()) trainguard::cuda_column_sum(dh, db);
      }
      dy = dh;
    } else if (db.defined()) {
      trainguard::cuda_column_sum(dy, db);
    }
    if (ctx->needs_input_grad(0)) dx = at::mm(dy, wd).to(static_cast<at::ScalarType>(ctx->saved_data["x_type"].toInt()));
    if (ctx->needs_input_grad(1)) dw = dy.is_cuda() ? at::mm(dy.t(), xd, at::kFloat) : at::mm(dy.t(), xd).to(at::kFloat);
    return {dx, dw, db, at::Tensor(), at::Tensor()};
  }
};
}  // namespace

extern "C" {

// A scope keeping the weights' casts on this thread opens (1) or closes (0); when the last one
// closes, the kept casts are freed.
void tg_linear_keep_casts(int open) {
  keeping_casts += open != 0 ? 1 : -1;
  if (keeping_casts <= 0) {
    keeping_casts = 0;
    kept_casts.clear();
  }
}

// Every kept cast made again, in place, from its source, whatever the source's version says (our
// CUDA optimizers write parameters through raw pointers, which no version counter sees). In place,
// so that a CUDA graph that reads a cast reads the new values. Where a scope outlives the
// optimizer's update (the CUDA graphs' one), this runs before the next step reads a cast.
int tg_linear_refresh_casts(char* err, size_t err_len) {
  return trainguard::guarded(err, err_len, [&] {
    at::NoGradGuard no_grad;
    for (auto& entry : kept_casts) {
      entry.second.cast.copy_(entry.second.source);
      entry.second.version = entry.second.source._version();
    }
  });
}

// Casts reused on this thread so far (tests).
uint64_t tg_linear_casts_reused() { return casts_reused; }

// For tests: cuda_column_sum(dy, out).
int tg_linear_test_column_sum(const void* dy, void* out, char* err, size_t err_len) {
  return trainguard::guarded(err, err_len, [&] { trainguard::cuda_column_sum(*static_cast<const at::Tensor*>(dy), *static_cast<at::Tensor*>(out)); });
}

// For tests: cuda_gelu_backward(da, h, db (null: none)) into `dh` (left as it is where the kernel
// did not take the rows); `*took` 1 where it did.
int tg_linear_test_gelu_backward(const void* da, const void* h, void* dh, void* db, int* took, char* err, size_t err_len) {
  return trainguard::guarded(err, err_len, [&] {
    const at::Tensor out = trainguard::cuda_gelu_backward(*static_cast<const at::Tensor*>(da), *static_cast<const at::Tensor*>(h), static_cast<at::Tensor*>(db));
    *took = out.defined();
    if (out.defined()) static_cast<at::Tensor*>(dh)->copy_(out);
  });
}

// Casts held on this thread now (tests).
size_t tg_linear_casts_held() { return kept_casts.size(); }

// The kept casts' addresses, ascending, into `out` (up to `n`; tests: a refresh keeps them).
size_t tg_linear_casts_addresses(uintptr_t* out, size_t n) {
  std::vector<uintptr_t> all;
  for (const auto& entry : kept_casts) all.push_back(reinterpret_cast<uintptr_t>(entry.second.cast.data_ptr()));
  std::sort(all.begin(), all.end());
  for (size_t i = 0; i < all.size() && i < n; ++i) out[i] = all[i];
  return all.size();
}

// x [..., in] · weightᵀ [in, out] (+ bias [out]; null: none), then GELU of it where `gelu` is 1:
// `*y_out` is a new tensor tch takes over. Through our node where our kernels run and autocast is
// on for x's device with a 16-bit dtype, the weight fp32; through ATen's linear (autocast's, when
// it is on) otherwise.
int tg_linear(const void* x, const void* weight, const void* bias, int gelu, void** y_out, char* err, size_t err_len) {
  *y_out = nullptr;
  return trainguard::guarded(err, err_len, [&] {
    const auto& xt = *static_cast<const at::Tensor*>(x);
    const auto& w = *static_cast<const at::Tensor*>(weight);
    const at::Tensor b = bias != nullptr ? *static_cast<const at::Tensor*>(bias) : at::Tensor();
    if (xt.dim() < 1 || w.dim() != 2 || w.size(1) != xt.size(-1)) throw std::invalid_argument("linear: weight must be [out, in] for inputs [..., in]");
    if (b.defined() && (b.dim() != 1 || b.size(0) != w.size(0))) throw std::invalid_argument("linear: bias must be [out]");
    const c10::DeviceType type = xt.device().type();
    const bool autocast = at::autocast::is_autocast_enabled(type);
    const at::ScalarType d = autocast ? at::autocast::get_autocast_dtype(type) : xt.scalar_type();
    const bool ours = autocast && (d == at::kBFloat16 || d == at::kHalf) && trainguard::runs_cuda_kernels(xt) && w.scalar_type() == at::kFloat &&
                      (xt.scalar_type() == at::kFloat || xt.scalar_type() == d) && w.device() == xt.device() && xt.numel() > 0;
    at::Tensor y;
    if (ours) {
      // Flattened outside the node, so autograd carries the gradient back through the view.
      const at::Tensor x2 = xt.reshape({-1, xt.size(-1)}).contiguous();
      const std::optional<at::Tensor> b_opt = b.defined() ? std::optional<at::Tensor>(b) : std::nullopt;
      std::vector<int64_t> shape(xt.sizes().begin(), xt.sizes().end());
      shape.back() = w.size(0);
      y = LinearNode::apply(x2, w, b_opt, d, gelu != 0)[0].view(shape);
    } else {
      y = at::linear(xt, w, b.defined() ? std::optional<at::Tensor>(b) : std::nullopt);
      if (gelu != 0) y = at::gelu(y);
    }
    *y_out = new at::Tensor(y);
  });
}

}  // extern "C"
