// Cross-entropy as one autograd node (`kernels.fused_cross_entropy`), for the language-model
// loss: mean (or sum) over rows of logits [rows, cols] of log Σ exp(x) − x[target], a target of
// −100 ignored. The node keeps the logits as they came (16-bit under autocast) and one fp32
// log-sum-exp per row; its backward writes the logits' gradient directly in their dtype. What
// autograd records for `cross_entropy` under autocast instead: an fp32 copy of the logits (CPU),
// fp32 log-probabilities kept for backward, and fp32 plus 16-bit gradients in backward. In
// training (`kernels.fused_loss_gradient`) the node writes the gradient over the logits in its
// forward instead, and keeps only that.
//
// On CUDA the work is kernels of loss_kernels.cu (cuda_jit.cpp launches them). On the CPU it
// runs through ATen's vectorised ops over blocks of rows, at most kCpuBlockValues fp32 values
// at a time: bounded scratch, no full-size fp32 copy. The CPU path is also what the CUDA
// kernels are checked against (tests/gpu.rs).
#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>
#include "cuda_jit.h"
#include "guarded.h"
#include "node.h"
#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

namespace {
constexpr int64_t kIgnore = -100;
constexpr int64_t kCpuBlockValues = int64_t{1} << 20;

void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("cross_entropy: " + what);
}

// The type the loss is computed and kept in: fp32, or fp64 for fp64 logits (the CPU only; the
// CUDA kernels take fp32, bf16 and fp16).
at::ScalarType accumulate_type(const at::Tensor& x) { return at::promote_types(x.scalar_type(), at::kFloat); }

// Rows of the CPU path's blocks: about kCpuBlockValues fp32 values, at least one row.
int64_t cpu_block_rows(int64_t cols) { return std::max<int64_t>(1, kCpuBlockValues / std::max<int64_t>(cols, 1)); }

// One block of rows `xs` (in the accumulate type) with targets `t`: its log Σ exp into `lse`,
// its loss, lse − x[target], into `loss`, 0 where ignored, NaN where the target is outside
// [0, cols) (as the CUDA kernel gives).
void cpu_forward_block(const at::Tensor& xs, const at::Tensor& t, at::Tensor lse, at::Tensor loss) {
  const int64_t cols = xs.size(1);
  const at::Tensor row_lse = at::logsumexp(xs, {1});
  const at::Tensor picked = xs.gather(1, t.clamp(0, cols - 1).unsqueeze(1)).squeeze(1);
  const at::Tensor outside = t.ne(kIgnore).logical_and(t.lt(0).logical_or(t.ge(cols)));
  lse.copy_(row_lse);
  loss.copy_((row_lse - picked).masked_fill_(t.eq(kIgnore), 0.0).masked_fill_(outside, std::numeric_limits<float>::quiet_NaN()));
}

// One block of rows turned, in place, from logits `g` (a copy in the accumulate type) into their
// gradient: scale · (exp(x − lse) − one-hot(target)), exactly 0 on ignored rows (filled, not
// multiplied: an all-ignored mean's scale is 1/0, and 0 · ∞ would be NaN).
void cpu_gradient_block(at::Tensor& g, const at::Tensor& t, const at::Tensor& lse, const at::Tensor& grad_scale) {
  const int64_t cols = g.size(1);
  g.sub_(lse.unsqueeze(1)).exp_();
  const at::Tensor hit = t.ge(0).logical_and(t.lt(cols)).to(g.scalar_type());
  g.scatter_add_(1, t.clamp(0, cols - 1).unsqueeze(1), hit.neg().unsqueeze(1));
  g.mul_(grad_scale);
  g.masked_fill_(t.eq(kIgnore).unsqueeze(1), 0.0);
}

// The CPU path, a block of rows at a time (at most kCpuBlockValues values of the accumulate
// type): the loss (`loss` defined), the gradient into `grad` (defined; from `lse` where the
// loss is not computed here), or both, the block's fp32 copy shared (`grad` may be `x`: each
// block is read before it is written).
void cpu_pass(const at::Tensor& x, const at::Tensor& target, const at::Tensor& lse, at::Tensor* loss, const at::Tensor& grad_scale, at::Tensor* grad) {
  const int64_t rows = x.size(0), step = cpu_block_rows(x.size(1));
  for (int64_t r = 0; r < rows; r += step) {
    const int64_t n = std::min(step, rows - r);
    const at::Tensor t = target.narrow(0, r, n);
    at::Tensor xs = x.narrow(0, r, n).to(lse.scalar_type(), /*non_blocking=*/false, /*copy=*/grad != nullptr);
    if (loss != nullptr) cpu_forward_block(xs, t, lse.narrow(0, r, n), loss->narrow(0, r, n));
    if (grad != nullptr) {
      cpu_gradient_block(xs, t, lse.narrow(0, r, n), grad_scale);
      grad->narrow(0, r, n).copy_(xs);
    }
  }
}

// The gradient's scale: the loss's gradient `upstream` (0-dim, the accumulate type) times
// `weight`, divided by the rows `counted` for a mean (undefined for a sum). One function for the
// forward that assumes a gradient of 1 and the backward that is given one: the same bits.
at::Tensor gradient_scale(at::Tensor upstream, double weight, const at::Tensor& counted) {
  if (weight != 1.0) upstream = upstream * weight;
  if (counted.defined()) upstream = upstream / counted;
  return upstream.contiguous();
}

// `weight` · the loss: mean over the counted rows (`mean`) or sum. With `grad_now` the logits'
// gradient for a backward given 1 (the loss as the root of backward, as training calls it) is
// written over `x` in the pass that computes the loss (`kernels.fused_loss_gradient`): no second
// pass over the logits and no gradient buffer beside them. The caller gives `x` up for it (the
// LM head's fresh output, which no other node keeps). A backward given another gradient
// rescales it (CUDA: a kernel whose blocks return at once where it is 1, so no host sync), a
// gradient already rounded to the logits' dtype: fp16 loss scaling must come in through
// `weight` (as training's does), not from a later multiply.
struct CrossEntropyNode : public torch::autograd::Function<CrossEntropyNode> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& target, bool mean, double weight,
                            bool grad_now) {
    // The node computes in fp32 itself; autocast must not recast what it calls.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    at::Tensor lse = at::empty({x.size(0)}, x.options().dtype(accumulate_type(x)));
    at::Tensor loss = at::empty_like(lse);
    // Divided on the device by the rows counted: no host sync (all ignored: 0/0, NaN, as PyTorch).
    const at::Tensor counted = mean ? target.ne(kIgnore).sum().to(lse.scalar_type()) : at::Tensor();
    const bool cuda = trainguard::runs_cuda_kernels(x);
    if (grad_now) {
      // The scale backward would compute from a loss gradient of 1 (1 · weight rounds as the
      // weight itself: no multiply needed).
      const at::Tensor scale = gradient_scale(at::scalar_tensor(weight, lse.options()), 1.0, counted);
      at::Tensor g = x;  // written over
      if (cuda) {
        trainguard::cuda_cross_entropy_forward_grad(g, target, lse, loss, scale);
        // As an ATen in-place op would (the CPU path's copy_ does): a node that kept these
        // logits then fails autograd's version check instead of reading their gradient.
        g.unsafeGetTensorImpl()->bump_version();
      } else {
        cpu_pass(x, target, lse, &loss, scale, &g);
      }
      ctx->save_for_backward({g, target});
    } else {
      if (cuda) {
        trainguard::cuda_cross_entropy_forward(x, target, lse, loss);
      } else {
        cpu_pass(x, target, lse, &loss, at::Tensor(), nullptr);
      }
      ctx->save_for_backward(mean ? torch::autograd::variable_list{x, target, lse, counted} : torch::autograd::variable_list{x, target, lse});
    }
    ctx->saved_data["grad_now"] = grad_now;
    ctx->saved_data["weight"] = weight;
    at::Tensor total = loss.sum();
    if (mean) total = total / counted;
    return weight == 1.0 ? total : total * weight;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    // The gradient is computed outside autograd's view: it has no derivative of its own.
    trainguard::check_differentiable_once("cross_entropy", "fused_cross_entropy");
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor& target = saved[1];
    const at::Tensor nothing;
    if (!grads[0].defined()) return {nothing, nothing, nothing, nothing, nothing};
    if (ctx->saved_data["grad_now"].toBool()) {
      // Rescaled in place: a second backward through the same graph would rescale it again.
      if (ctx->saved_data.count("backward_ran") != 0) {
        throw std::runtime_error("cross_entropy: kernels.fused_loss_gradient runs backward once; retain_graph needs kernels.fused_loss_gradient: false");
      }
      ctx->saved_data["backward_ran"] = true;
      at::Tensor g = saved[0];
      const bool cuda = trainguard::runs_cuda_kernels(g);
      const at::Tensor factor = grads[0].to(cuda ? at::kFloat : accumulate_type(g)).contiguous();
      if (cuda) {
        trainguard::cuda_cross_entropy_scale_grad(g, target, factor);
      } else if (const double f = factor.item<double>(); f != 1.0) {
        g.mul_(f).masked_fill_(target.eq(kIgnore).unsqueeze(1), 0.0);  // in fp32 (fp64), as the kernel
      }
      return {g, nothing, nothing, nothing, nothing};
    }
    const at::Tensor &x = saved[0], &lse = saved[2];
    const at::Tensor scale = gradient_scale(grads[0].to(lse.scalar_type()), ctx->saved_data["weight"].toDouble(), saved.size() == 4 ? saved[3] : nothing);
    at::Tensor grad = at::empty_like(x, at::MemoryFormat::Contiguous);
    if (trainguard::runs_cuda_kernels(x)) {
      trainguard::cuda_cross_entropy_backward(x, target, lse, scale, grad);
    } else {
      cpu_pass(x, target, lse, nullptr, scale, &grad);
    }
    return {grad, nothing, nothing, nothing, nothing};
  }
};
}  // namespace

extern "C" {

int64_t tg_cross_entropy_cpu_block_rows(int64_t cols) { return cpu_block_rows(cols); }

// `weight` · the cross-entropy of `logits` [..., cols] against `targets` [...] (int64, −100
// ignored), mean over the rows counted (`mean`) or sum, as one autograd node: `*out` is a new
// tensor (0-dim fp32) that tch takes over. With `grad_now`, where autograd will want the
// logits' gradient, it is written over the logits now (the node's comment), on CUDA by a block a
// row. The logits must be fp32, bf16 or fp16 on CUDA (whose kernels must be prepared: tg_cuda_jit_prepare), any float
// dtype on the CPU.
int tg_cross_entropy(const void* logits, const void* targets, int mean, double weight, int grad_now, void** out, char* err, size_t err_len) {
  *out = nullptr;
  return trainguard::guarded(err, err_len, [&] {
    const auto& l = *static_cast<const at::Tensor*>(logits);
    const auto& y = *static_cast<const at::Tensor*>(targets);
    check(l.dim() >= 1 && l.size(-1) >= 1, "logits need a last dimension of at least one column");
    check(at::isFloatingType(l.scalar_type()), "logits must be floating point");
    check(y.scalar_type() == at::kLong, "targets must be int64");
    check(y.device() == l.device(), "logits and targets must be on one device");
    check(l.is_cpu() || l.is_cuda(), "tensors must be on the CPU or a CUDA device");
    const int64_t cols = l.size(-1);
    check(y.numel() * cols == l.numel(), "one target per row of logits");
    // Reshaped outside the node, so autograd carries the gradient back through the view.
    const at::Tensor x = l.reshape({-1, cols}).contiguous();
    const at::Tensor t = y.reshape({-1}).contiguous();
    const bool wanted = grad_now != 0 && at::GradMode::is_enabled() && l.requires_grad();
    *out = new at::Tensor(CrossEntropyNode::apply(x, t, mean != 0, weight, wanted));
  });
}

}  // extern "C"
