// The Llama block's autograd nodes of our own, over our CUDA kernels (llama_kernels.cu): on a
// CUDA device, or on the CPU under the host emulation for tests.
// - SwiGLU's product (`kernels.fused_swiglu`): h = silu(g) · u, where g and u are the gate and up
//   projections' outputs. The node keeps g and u (the projections' outputs, which ATen keeps too)
//   but not silu(g). Elsewhere tg_swiglu computes the same with ATen's differentiable ops
//   (`at::silu(g) * u`), which is also what the kernels are tested against. With gate and up as
//   one matrix multiplication (`kernels.merged_projections`) the node takes their joint output
//   [.., 2f] and its backward writes the joint gradient: no copies of the halves forward, no
//   joining of their gradients backward. Where the kernels do not run (the CPU, or the switch
//   off) a joint node of ATen's ops does the same for the joint output: ATen's silu and products,
//   so ATen's bits, written into the joint gradient's halves.
// - RoPE (`kernels.fused_rope`): q or k rotated by position from the fp32 cos and sin tables, in
//   one pass each way; it keeps nothing but the tables. With q, k and v as one matrix
//   multiplication the joint node takes their output [.., (heads + 2·kv_heads)·d] and gives q and
//   k rotated and v copied out in one launch, and its backward writes the joint gradient in one.
//   Only where the kernels run: the model takes ATen's ops elsewhere (src/model/layers.rs,
//   `Rope`), which the kernels are tested against.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_jit.h"
#include "guarded.h"
#include "node.h"

namespace {
struct SwiGluNode : public torch::autograd::Function<SwiGluNode> {
  // g and u contiguous, of one shape and dtype (fp32, bf16 or fp16); h comes out alike.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& g, const at::Tensor& u) {
    at::Tensor h = at::empty_like(g);
    trainguard::cuda_swiglu_forward(g, u, h);
    ctx->save_for_backward({g, u});
    return {h};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    trainguard::check_differentiable_once("swiglu", "fused_swiglu");
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor &g = saved[0], &u = saved[1];
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    const at::Tensor dh = grads[0].to(g.scalar_type()).contiguous();
    at::Tensor dg = at::empty_like(g);
    at::Tensor du = at::empty_like(u);
    trainguard::cuda_swiglu_backward(dh, g, u, dg, du);
    return {dg, du};
  }
};

struct JointSwiGluNode : public torch::autograd::Function<JointSwiGluNode> {
  // gu [.., 2f] contiguous (gate's output, then up's) in fp32, bf16 or fp16; h [.., f] alike.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gu) {
    const int64_t f = gu.size(-1) / 2;
    std::vector<int64_t> shape = gu.sizes().vec();
    shape.back() = f;
    at::Tensor h = at::empty(shape, gu.options());
    trainguard::cuda_swiglu_forward(gu.narrow(-1, 0, f), gu.narrow(-1, f, f), h);
    ctx->save_for_backward({gu});
    return {h};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    trainguard::check_differentiable_once("swiglu", "fused_swiglu");
    const at::Tensor gu = ctx->get_saved_variables()[0];
    if (!grads[0].defined()) return {at::Tensor()};
    const int64_t f = gu.size(-1) / 2;
    const at::Tensor dh = grads[0].to(gu.scalar_type()).contiguous();
    at::Tensor dgu = at::empty_like(gu);
    at::Tensor dg = dgu.narrow(-1, 0, f), du = dgu.narrow(-1, f, f);
    trainguard::cuda_swiglu_backward(dh, gu.narrow(-1, 0, f), gu.narrow(-1, f, f), dg, du);
    return {dgu};
  }
};

// silu(g) · u from the joint output gu [.., 2f] (any dtype, any device) by ATen's ops: the ops
// autograd runs for `at::silu(g) * u` on gu's halves, so the same bits both ways. What it saves
// is what those ops save (gu, silu(g)); what it spares is autograd's join of gate's and up's
// gradients: each is written into its half of the joint gradient, so no concatenation (a copy
// of 2f per token) and 2f alive at its end instead of 4f (20 MiB less peak on bench-llama-10m).
struct JointSwiGluAtenNode : public torch::autograd::Function<JointSwiGluAtenNode> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gu) {
    const int64_t f = gu.size(-1) / 2;
    const at::Tensor s = at::silu(gu.narrow(-1, 0, f));
    ctx->save_for_backward({gu, s});
    return {s * gu.narrow(-1, f, f)};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor()};
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor &gu = saved[0], &s = saved[1];
    const int64_t f = gu.size(-1) / 2;
    const at::Tensor g = gu.narrow(-1, 0, f), u = gu.narrow(-1, f, f);
    const at::Tensor dh = grads[0].to(gu.scalar_type());
    // A second derivative (create_graph): recorded ops, joined by cat. silu(g) again from gu
    // (the saved one was made unrecorded) and silu's gradient as autograd's own SiluBackward
    // computes it then (`infinitely_differentiable_silu_backward`, not exported): the same bits.
    if (at::GradMode::is_enabled()) {
      const at::Tensor sigmoid = g.sigmoid();
      return {at::cat({dh * u * sigmoid * (1.0 + g * (1.0 - sigmoid)), dh * at::silu(g)}, -1)};
    }
    at::Tensor dgu = at::empty_like(gu, at::MemoryFormat::Contiguous);
    at::Tensor dg = dgu.narrow(-1, 0, f), du = dgu.narrow(-1, f, f);
    at::mul_out(du, dh, s);
    at::mul_out(dg, dh, u);
    at::silu_backward_out(dg, dg, g);  // in place: elementwise, each value read before it is written
    return {dgu};
  }
};

// `x` [b, t, heads·d] as the kernels read it: the last dimension contiguous, rows and batches
// evenly strided (q's or k's columns of the merged q/k/v output are read where they are).
at::Tensor rope_readable(const at::Tensor& x) {
  return x.stride(2) == 1 ? x : x.contiguous();
}

struct RopeNode : public torch::autograd::Function<RopeNode> {
  // x [b, t, heads·d] in fp32, bf16 or fp16 (rope_readable); cos and sin [≥ t, d] fp32 contiguous.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                                                const at::Tensor& sin, int64_t heads) {
    at::Tensor out = at::empty(x.sizes(), x.options());
    trainguard::cuda_rope({{&x, &out, heads, trainguard::RopeOp::kForward}}, cos, sin);
    ctx->saved_data["heads"] = heads;
    ctx->save_for_backward({cos, sin});
    return {out};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    trainguard::check_differentiable_once("rope", "fused_rope");
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor dy = rope_readable(grads[0]);
    at::Tensor dx = at::empty(dy.sizes(), dy.options());
    trainguard::cuda_rope({{&dy, &dx, ctx->saved_data["heads"].toInt(), trainguard::RopeOp::kBackward}}, saved[0], saved[1]);
    return {dx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// q, k and v from the merged q/k/v output, one launch each way: q and k rotated, v copied out
// (attention keeps it; as a view it would keep q's and k's columns alive). Backward writes the
// joint gradient whole from the three: no gradients of q and k rotated back apart and then
// concatenated with v's.
struct JointRopeNode : public torch::autograd::Function<JointRopeNode> {
  // qkv [b, t, (heads + 2·kv_heads)·d] in fp32, bf16 or fp16 (rope_readable); cos and sin as
  // RopeNode's.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& qkv, const at::Tensor& cos,
                                                const at::Tensor& sin, int64_t heads, int64_t kv_heads) {
    const int64_t d = qkv.size(2) / (heads + 2 * kv_heads), b = qkv.size(0), t = qkv.size(1);
    const at::Tensor qs = qkv.narrow(2, 0, heads * d), ks = qkv.narrow(2, heads * d, kv_heads * d);
    const at::Tensor vs = qkv.narrow(2, (heads + kv_heads) * d, kv_heads * d);
    at::Tensor q = at::empty({b, t, heads * d}, qkv.options()), k = at::empty({b, t, kv_heads * d}, qkv.options()), v = at::empty_like(k);
    using trainguard::RopeOp;
    trainguard::cuda_rope({{&qs, &q, heads, RopeOp::kForward}, {&ks, &k, kv_heads, RopeOp::kForward}, {&vs, &v, kv_heads, RopeOp::kCopy}}, cos, sin);
    ctx->saved_data["heads"] = heads;
    ctx->saved_data["kv_heads"] = kv_heads;
    ctx->saved_data["d"] = d;
    ctx->save_for_backward({cos, sin});
    return {q, k, v};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    trainguard::check_differentiable_once("rope", "fused_rope");
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const int64_t heads = ctx->saved_data["heads"].toInt(), kv_heads = ctx->saved_data["kv_heads"].toInt(), d = ctx->saved_data["d"].toInt();
    int defined = -1;
    for (int i = 2; i >= 0; --i) defined = grads[i].defined() ? i : defined;
    if (defined < 0) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const at::Tensor& some = grads[defined];
    const int64_t b = some.size(0), t = some.size(1);
    // A part without a gradient (its output unused) contributes zeros.
    const auto part = [&](int i, int64_t n) { return grads[i].defined() ? rope_readable(grads[i]) : at::zeros({b, t, n * d}, some.options()); };
    const at::Tensor dq = part(0, heads), dk = part(1, kv_heads), dv = part(2, kv_heads);
    at::Tensor dqkv = at::empty({b, t, (heads + 2 * kv_heads) * d}, some.options());
    at::Tensor gq = dqkv.narrow(2, 0, heads * d), gk = dqkv.narrow(2, heads * d, kv_heads * d);
    at::Tensor gv = dqkv.narrow(2, (heads + kv_heads) * d, kv_heads * d);
    using trainguard::RopeOp;
    trainguard::cuda_rope({{&dq, &gq, heads, RopeOp::kBackward}, {&dk, &gk, kv_heads, RopeOp::kBackward}, {&dv, &gv, kv_heads, RopeOp::kCopy}}, saved[0], saved[1]);
    return {dqkv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Checks RoPE's operands: `x` [b, t, heads·d] fp32, bf16 or fp16 on a device where our kernels
// run, cos and sin [≥ t, d] fp32 there. Returns d.
int64_t check_rope(const at::Tensor& x, int64_t heads, const at::Tensor& c, const at::Tensor& s) {
  const auto fail = [](const std::string& what) { throw std::invalid_argument("rope: " + what); };
  if (x.dim() != 3 || heads <= 0 || x.size(2) % heads != 0) fail("x must be [b, t, heads·d]");
  const int64_t d = x.size(2) / heads;
  if (d % 2 != 0) fail("the head dimension must be even");
  if (c.dim() != 2 || c.size(1) != d || c.size(0) < x.size(1) || s.sizes() != c.sizes()) fail("cos and sin must be [≥ t, head dim]");
  if (c.scalar_type() != at::kFloat || s.scalar_type() != at::kFloat) fail("cos and sin must be fp32");
  const at::ScalarType t = x.scalar_type();
  if (t != at::kFloat && t != at::kBFloat16 && t != at::kHalf) fail("x must be fp32, bf16 or fp16");
  if (!trainguard::runs_cuda_kernels(x) || c.device() != x.device() || s.device() != x.device()) fail("our kernels do not run on this device");
  return d;
}
}  // namespace

extern "C" {

// silu(gate) · up: `*h_out` is a new tensor tch takes over. Through our kernels where they run
// (CUDA, or the host emulation) when both are of one shape and dtype (fp32, bf16 or fp16);
// through ATen's ops otherwise.
int tg_swiglu(const void* gate, const void* up, void** h_out, char* err, size_t err_len) {
  *h_out = nullptr;
  return trainguard::guarded(err, err_len, [&] {
    const auto& g = *static_cast<const at::Tensor*>(gate);
    const auto& u = *static_cast<const at::Tensor*>(up);
    if (g.sizes() != u.sizes()) throw std::invalid_argument("swiglu: gate and up must have one shape");
    const at::ScalarType t = g.scalar_type();
    const bool ours = trainguard::runs_cuda_kernels(g) && u.scalar_type() == t && u.device() == g.device() &&
                      (t == at::kFloat || t == at::kBFloat16 || t == at::kHalf) && g.numel() > 0;
    at::Tensor h;
    if (ours) {
      h = SwiGluNode::apply(g.contiguous(), u.contiguous())[0];
    } else {
      h = at::silu(g) * u;
    }
    *h_out = new at::Tensor(h);
  });
}

// silu(gate) · up from their joint output `gu` [.., 2f] (gate's f columns, then up's): `*h_out`
// is a new tensor tch takes over, [.., f]. Through our kernels when `kernels` (the switch) and
// they run (CUDA, or the host emulation) for fp32, bf16 or fp16; through the joint node of
// ATen's ops otherwise.
int tg_swiglu_joint(const void* joint, int kernels, void** h_out, char* err, size_t err_len) {
  *h_out = nullptr;
  return trainguard::guarded(err, err_len, [&] {
    const auto& gu = *static_cast<const at::Tensor*>(joint);
    if (gu.dim() < 1 || gu.size(-1) % 2 != 0) throw std::invalid_argument("swiglu: the joint gate and up output must have an even last dimension");
    const at::ScalarType t = gu.scalar_type();
    const bool ours = kernels && trainguard::runs_cuda_kernels(gu) && (t == at::kFloat || t == at::kBFloat16 || t == at::kHalf) && gu.numel() > 0;
    const at::Tensor h = ours ? JointSwiGluNode::apply(gu.contiguous())[0] : JointSwiGluAtenNode::apply(gu)[0];
    *h_out = new at::Tensor(h);
  });
}

// `x` [b, t, heads·d] (the q or k projection's output) rotated by positions 0..t with the fp32
// tables `cos` and `sin` [≥ t, d]: `*out` is a new tensor tch takes over, in x's dtype. Only
// where our kernels run (CUDA, or the host emulation).
int tg_rope(const void* x, const void* cos, const void* sin, long long heads, void** out, char* err, size_t err_len) {
  *out = nullptr;
  return trainguard::guarded(err, err_len, [&] {
    const auto& xt = *static_cast<const at::Tensor*>(x);
    const auto& c = *static_cast<const at::Tensor*>(cos);
    const auto& s = *static_cast<const at::Tensor*>(sin);
    check_rope(xt, heads, c, s);
    *out = new at::Tensor(RopeNode::apply(rope_readable(xt), c.contiguous(), s.contiguous(), heads)[0]);
  });
}

// The merged q/k/v output `qkv` [b, t, (heads + 2·kv_heads)·d] as q and k rotated by positions
// 0..t and v, each [b, t, its heads·d] contiguous: `outs[0..3]` new tensors tch takes over. Only
// where our kernels run.
int tg_rope_qkv(const void* qkv, const void* cos, const void* sin, long long heads, long long kv_heads, void** outs, char* err, size_t err_len) {
  outs[0] = outs[1] = outs[2] = nullptr;
  return trainguard::guarded(err, err_len, [&] {
    const auto& x = *static_cast<const at::Tensor*>(qkv);
    const auto& c = *static_cast<const at::Tensor*>(cos);
    const auto& s = *static_cast<const at::Tensor*>(sin);
    if (heads <= 0 || kv_heads <= 0) throw std::invalid_argument("rope: heads and kv_heads must be positive");
    check_rope(x, heads + 2 * kv_heads, c, s);
    const torch::autograd::variable_list parts = JointRopeNode::apply(rope_readable(x), c.contiguous(), s.contiguous(), heads, kv_heads);
    for (int i = 0; i < 3; ++i) outs[i] = new at::Tensor(parts[i]);
  });
}

}  // extern "C"
