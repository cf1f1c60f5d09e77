// A norm (LayerNorm, or RMSNorm) with the residual add before it and the rounding after it, as
// one autograd node (`kernels.fused_residual_norm`): s = x + δ (when there is a δ), y = norm(s)
// in fp32 rounded to the compute dtype. The node keeps what ATen's norms keep (the input s, a
// mean and 1/σ per row); its backward writes x's gradient in fp32 with the residual's gradient
// (ds) already added, and δ's in δ's dtype. It runs our CUDA kernels (norm_kernels.cu): on a CUDA
// device, or on the CPU under the host emulation for tests. Elsewhere tg_residual_norm computes
// the same thing with ATen's differentiable ops (`plain`), which is also what the kernels are
// tested against.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>
#include <stdexcept>
#include <string>

#include "cuda_jit.h"
#include "guarded.h"
#include "node.h"

namespace {
void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("residual_norm: " + what);
}

// The dtype y is rounded to: autocast's for x's device while autocast is on there (what the
// next matrix multiplication would cast it to), else x's. Read outside the node, whose forward
// runs with autocast's keys excluded (which is what "off" means to this query).
at::ScalarType output_type(const at::Tensor& x) {
  const c10::DeviceType type = x.device().type();
  return at::autocast::is_autocast_enabled(type) ? at::autocast::get_autocast_dtype(type) : x.scalar_type();
}

// The same maths with ATen's differentiable ops: what autocast records for an add, a norm
// (layer_norm, or rms_norm) and a cast. Returns {s, y} with a δ, {y} without.
torch::autograd::variable_list plain(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w, const at::Tensor& b, double eps,
                                     bool rms, at::ScalarType out) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const at::Tensor s = delta.defined() ? x + delta.to(x.scalar_type()) : x;
  const at::Tensor normed = rms ? at::rms_norm(s, {x.size(-1)}, w, eps) : at::layer_norm(s, {x.size(-1)}, w, b, eps);
  const at::Tensor y = normed.to(out);
  if (delta.defined()) return {s, y};
  return {y};
}

struct ResidualNormNode : public torch::autograd::Function<ResidualNormNode> {
  // x [rows, c] fp32 contiguous; delta [rows, c] in `out` or none; w [c] fp32; b [c] fp32 or
  // none; y comes out in `out`.
  // (δ and b are optional: autograd takes an undefined at::Tensor for a variable and fails on it.)
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const std::optional<at::Tensor>& delta_in, const at::Tensor& w,
                                                const std::optional<at::Tensor>& b_in, double eps, bool rms, at::ScalarType out) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::Tensor delta = delta_in.value_or(at::Tensor());
    const at::Tensor b = b_in.value_or(at::Tensor());
    const int64_t rows = x.size(0);
    at::Tensor s = delta.defined() ? at::empty_like(x) : x;
    at::Tensor y = at::empty(x.sizes(), x.options().dtype(out));
    at::Tensor mean = at::empty({rows}, x.options());
    at::Tensor rstd = at::empty({rows}, x.options());
    trainguard::cuda_residual_norm_forward(x, delta, w, b, s, y, mean, rstd, static_cast<float>(eps), rms);
    ctx->saved_data["rms"] = rms;
    ctx->saved_data["with_delta"] = delta.defined();
    ctx->saved_data["with_bias"] = b.defined();
    ctx->saved_data["out"] = static_cast<int64_t>(out);
    ctx->save_for_backward({s, w, mean, rstd});
    if (delta.defined()) return {s, y};
    return {y};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    trainguard::check_differentiable_once("residual_norm", "fused_residual_norm");
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const bool rms = ctx->saved_data["rms"].toBool();
    const bool with_delta = ctx->saved_data["with_delta"].toBool();
    const bool with_bias = ctx->saved_data["with_bias"].toBool();
    const auto out = static_cast<at::ScalarType>(ctx->saved_data["out"].toInt());
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor &s = saved[0], &w = saved[1], &mean = saved[2], &rstd = saved[3];
    const at::Tensor ds = with_delta && grads[0].defined() ? grads[0].to(at::kFloat).contiguous() : at::Tensor();
    const at::Tensor& dy_in = grads[with_delta ? 1 : 0];
    const at::Tensor dy = dy_in.defined() ? dy_in.to(out).contiguous() : at::Tensor();
    at::Tensor dx = at::empty_like(s);
    at::Tensor ddelta = with_delta && out != at::kFloat ? at::empty(s.sizes(), s.options().dtype(out)) : at::Tensor();
    // The parameters' sums write every value where there are rows and an output gradient;
    // zero-filled only where they do not run (50 fills a GPT-2 micro-step saved).
    const auto param_grad = [&] { return dy.defined() && s.size(0) > 0 ? at::empty_like(w) : at::zeros_like(w); };
    at::Tensor dw = param_grad();
    at::Tensor db = with_bias ? param_grad() : at::Tensor();
    trainguard::cuda_residual_norm_backward(s, w, mean, rstd, dy, ds, dx, ddelta, dw, db, rms);
    // δ's gradient: dx itself when δ is fp32 (the add passes it through), else its rounding.
    const at::Tensor d_delta = with_delta ? (ddelta.defined() ? ddelta : dx) : at::Tensor();
    return {dx, d_delta, dw, db, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
}  // namespace

extern "C" {

// LayerNorm (RMSNorm with `rms`, which takes no bias) over the last dimension of `x` (+ `delta`
// when it is not null) with `weight` and `bias` (null: none), epsilon `eps`: `*s_out` is the sum
// (a new tensor tch takes over; null without a delta), `*y_out` the normalised output in
// autocast's dtype (x's without autocast).
// Through our kernels where they run (CUDA, or the host emulation) when x, weight and bias are
// fp32 and delta is in the output's dtype; through ATen's ops otherwise.
int tg_residual_norm(const void* x, const void* delta, const void* weight, const void* bias, double eps, int rms, void** s_out, void** y_out,
                     char* err, size_t err_len) {
  *s_out = nullptr;
  *y_out = nullptr;
  return trainguard::guarded(err, err_len, [&] {
    const auto& xt = *static_cast<const at::Tensor*>(x);
    const at::Tensor d = delta != nullptr ? *static_cast<const at::Tensor*>(delta) : at::Tensor();
    const auto& w = *static_cast<const at::Tensor*>(weight);
    const at::Tensor b = bias != nullptr ? *static_cast<const at::Tensor*>(bias) : at::Tensor();
    check(xt.dim() >= 1 && w.dim() == 1 && w.size(0) == xt.size(-1), "weight must be [c] for inputs [..., c]");
    check(!b.defined() || b.sizes() == w.sizes(), "bias must be shaped as the weight");
    check(!(rms && b.defined()), "RMSNorm takes no bias");
    check(!d.defined() || d.sizes() == xt.sizes(), "the residual's delta must be shaped as the input");
    const at::ScalarType out = output_type(xt);
    const bool ours = trainguard::runs_cuda_kernels(xt) && xt.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
                      (!b.defined() || b.scalar_type() == at::kFloat) && (!d.defined() || d.scalar_type() == out) &&
                      (out == at::kFloat || out == at::kBFloat16 || out == at::kHalf) && xt.numel() > 0;
    torch::autograd::variable_list r;
    if (ours) {
      const int64_t c = xt.size(-1);
      // Flattened outside the node, so autograd carries the gradients back through the views.
      const at::Tensor x2 = xt.reshape({-1, c}).contiguous();
      const at::Tensor d2 = d.defined() ? d.reshape({-1, c}).contiguous() : at::Tensor();
      const auto optional = [](const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t.contiguous()) : std::nullopt; };
      r = ResidualNormNode::apply(x2, optional(d2), w.contiguous(), optional(b), eps, rms != 0, out);
      for (auto& t : r) t = t.view(xt.sizes());
    } else {
      r = plain(xt, d, w, b, eps, rms != 0, out);
    }
    if (d.defined()) *s_out = new at::Tensor(r[0]);
    *y_out = new at::Tensor(r.back());
  });
}

}  // extern "C"
