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
// Layers that read the same input (Llama's q/k/v and gate/up, `kernels.merged_projections`) go
// through one node as one GEMM: their weights are its parts, stacked by rows. The parts' joint
// cast is kept as one tensor while casts are kept (made again in place by the refresh), where
// concatenating the fp32 weights in each forward cost a concatenation, a cast of it and, in
// backward, a joint gradient split and added into each part's (smollm2-135m: ~6 ms a step,
// BENCHMARKS.md). In backward each part's gradient is its rows of the joint one, or its GEMM adds
// into the part's accumulator (below).
// Between tg_linear_sum_weight_grads(params, accumulators) and its end (a step's later
// micro-steps, in CUDA graphs' mode all of them: `kernels.accumulate_in_gemm`) the node adds
// each listed weight's gradient into its fp32 accumulator inside the GEMM (cuBLAS with beta = 1: `at::addmm` with an out_dtype, CUDA
// only) and hands autograd no gradient for it, where it would write a new fp32 gradient that a
// multi-tensor add then reads back and adds (for GPT-2 124M 85M values a micro-step: 1 GB read
// and written, BENCHMARKS.md). The accumulator is looked up in forward, on the thread that set it
// (backward on CUDA runs on autograd's device thread), and kept in the node.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "cuda_jit.h"
#include "guarded.h"
#include "node.h"

namespace {
// The casts kept on this thread while keeping is on, by their (first) source: the sources (held,
// so their addresses are not reused: one weight or bias, or the parts of merged layers), their
// versions when cast, and the cast (the parts' rows in turn).
struct KeptCast {
  std::vector<at::Tensor> sources;
  std::vector<int64_t> versions;
  at::Tensor cast;
};
thread_local int keeping_casts = 0;  // scopes open (tg_linear_keep_casts)
thread_local std::unordered_map<const c10::TensorImpl*, KeptCast> kept_casts;
thread_local uint64_t casts_reused = 0;

// Each part's rows of `joint` (a view of them), in turn.
std::vector<at::Tensor> part_rows(const at::Tensor& joint, at::TensorList parts) {
  std::vector<at::Tensor> rows;
  int64_t at_row = 0;
  for (const at::Tensor& p : parts) {
    rows.push_back(joint.narrow(0, at_row, p.size(0)));
    at_row += p.size(0);
  }
  return rows;
}

// `parts` (one weight [out, in] or bias [out], or merged layers' weights [out_i, in] or biases
// [out_i]) stacked by rows in dtype `d`: the kept cast where the same parts are at the versions
// it was made of, else a new one, kept while keeping is on and every part is a parameter (a leaf
// that wants a gradient, not a tensor made anew each forward, whose casts would pile up).
at::Tensor cast_once(at::TensorList parts, at::ScalarType d) {
  const bool keep = keeping_casts != 0 && std::all_of(parts.begin(), parts.end(), [&](const at::Tensor& p) {
    return p.scalar_type() != d && p.is_leaf() && p.requires_grad();
  });
  if (!keep) {
    if (parts.size() == 1) return parts[0].to(d);
    std::vector<at::Tensor> casts;
    for (const at::Tensor& p : parts) casts.push_back(p.to(d));
    return at::cat(casts, 0);
  }
  auto it = kept_casts.find(parts[0].unsafeGetTensorImpl());
  if (it != kept_casts.end() && it->second.cast.scalar_type() == d && it->second.sources.size() == parts.size()) {
    bool current = true;
    for (size_t i = 0; i < parts.size() && current; ++i) {
      current = it->second.sources[i].unsafeGetTensorImpl() == parts[i].unsafeGetTensorImpl() && it->second.versions[i] == parts[i]._version();
    }
    if (current) {
      ++casts_reused;
      return it->second.cast;
    }
  }
  std::vector<int64_t> shape = parts[0].sizes().vec();
  shape[0] = 0;
  for (const at::Tensor& p : parts) shape[0] += p.size(0);
  KeptCast kept{{}, {}, at::empty(shape, parts[0].options().dtype(d))};
  const std::vector<at::Tensor> rows = part_rows(kept.cast, parts);
  for (size_t i = 0; i < parts.size(); ++i) {
    rows[i].copy_(parts[i]);
    kept.sources.push_back(parts[i]);
    kept.versions.push_back(parts[i]._version());
  }
  const at::Tensor cast = kept.cast;
  kept_casts.insert_or_assign(parts[0].unsafeGetTensorImpl(), std::move(kept));
  return cast;
}

// The accumulators the node adds weights' gradients into, by weight, while a scope set them on
// this thread (tg_linear_sum_weight_grads): the weight (held, so its address is not reused) and
// its accumulator.
struct SumTarget {
  at::Tensor weight;
  at::Tensor acc;
};
thread_local std::unordered_map<const c10::TensorImpl*, SumTarget> sum_targets;
thread_local uint64_t sums_attached = 0;  // weights given to nodes made here with an accumulator (tests)
// Scopes are numbered; `live_scope` is the open one's (0: none). A node whose backward runs
// after its scope ended (a graph kept past the step) computes its gradient as usual instead of
// adding into stale sums. Read in backward, on autograd's device thread: hence atomic.
std::atomic<uint64_t> scopes_started{0};
std::atomic<uint64_t> live_scope{0};

// The accumulator `w`'s gradient is added into, or an undefined tensor.
at::Tensor sum_target(const at::Tensor& w) {
  if (sum_targets.empty()) return {};
  auto it = sum_targets.find(w.unsafeGetTensorImpl());
  return it == sum_targets.end() ? at::Tensor() : it->second.acc;
}

// acc += dyᵀ · xd (dy, xd in D; acc fp32): on CUDA in the GEMM's epilogue, fp32 out; where our
// kernels run on the host (tests), as the node's host path computes the gradient (the GEMM in D,
// cast to fp32) and then added, as the multi-tensor add would.
void add_weight_grad(at::Tensor& acc, const at::Tensor& dy, const at::Tensor& xd) {
  if (acc.is_cuda()) {
    at::addmm_out(acc, acc, dy.t(), xd, at::kFloat, 1, 1);
  } else {
    acc.add_(at::mm(dy.t(), xd).to(at::kFloat));
  }
}

// Whether this libtorch's CUDA GEMM adds products of `half` (bf16 or fp16) matrices into an fp32
// matrix (`addmm`'s out_dtype overload with an fp32 input, which older releases refused): tried
// once a process and dtype on 2 × 2 values, the sum read back (the one host sync). Where it does
// not, no node adds into a sum for that dtype and the gradients are added as before.
std::atomic<int> gemm_adds_works[2] = {-1, -1};  // bf16, fp16; -1 not tried yet
std::atomic<int>& gemm_adds_known(at::ScalarType half) { return gemm_adds_works[half == at::kHalf ? 1 : 0]; }
bool gemm_adds_into_fp32(const at::Tensor& like, at::ScalarType half) {
  std::atomic<int>& works = gemm_adds_known(half);
  int known = works.load();
  if (known < 0) {
    try {
      const at::Tensor a = at::ones({2, 2}, like.options().dtype(half));
      at::Tensor acc = at::ones({2, 2}, like.options().dtype(at::kFloat));
      at::addmm_out(acc, acc, a, a, at::kFloat, 1, 1);
      known = acc.eq(3).all().item<bool>() ? 1 : 0;
    } catch (const c10::OutOfMemoryError&) {
      throw;
    } catch (const std::exception&) {
      known = 0;
    }
    works.store(known);
  }
  return known == 1;
}

// Whether a node computing in `d` adds its weight's gradient into `acc`: on the host always (the
// emulated path adds after its GEMM); on CUDA where the scope's probe found the GEMM adds `d`'s
// products into fp32 (read, never tried here: a node's forward may run inside a CUDA graph's
// capture, where a host sync is refused).
bool adds_in_gemm(const at::Tensor& acc, at::ScalarType d) {
  return !acc.is_cuda() || ((d == at::kBFloat16 || d == at::kHalf) && gemm_adds_known(d).load() == 1);
}

// dyᵀ · xd as an fp32 weight gradient: on CUDA the GEMM writes fp32; where our kernels run on the
// host (tests), the GEMM in D cast to fp32, as autocast computes it.
at::Tensor weight_grad(const at::Tensor& dy, const at::Tensor& xd) {
  return dy.is_cuda() ? at::mm(dy.t(), xd, at::kFloat) : at::mm(dy.t(), xd).to(at::kFloat);
}

struct LinearNode : public torch::autograd::Function<LinearNode> {
  // x [rows, in] (fp32 or D); ws: the weights [out_i, in] fp32, one or the parts of merged layers;
  // bs: their biases [out_i] (any float dtype), one each or none; y [rows, Σ out_i] in D (with
  // `gelu`, GELU of it: GPT-2's MLP up-projection, kernels.fused_gelu).
  // With `graph_only` the product is not computed: y is zeros (see GraphOnlyLinear), backward
  // is the same.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, at::TensorList ws, at::TensorList bs,
                                                at::ScalarType d, bool gelu, bool graph_only) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::Tensor xd = x.to(d), wd = cast_once(ws, d);
    const at::Tensor y = graph_only  ? at::zeros({xd.size(0), wd.size(0)}, xd.options())
                         : bs.empty() ? at::mm(xd, wd.t())
                                      : at::addmm(cast_once(bs, d), xd, wd.t());
    ctx->saved_data["x_type"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["with_bias"] = !bs.empty();
    ctx->saved_data["gelu"] = gelu;
    std::vector<int64_t> rows;
    for (const at::Tensor& w : ws) rows.push_back(w.size(0));
    ctx->saved_data["rows"] = rows;
    for (size_t i = 0; i < ws.size(); ++i) {
      if (const at::Tensor acc = sum_target(ws[i]); acc.defined() && adds_in_gemm(acc, d)) {
        ctx->saved_data["sum_into_" + std::to_string(i)] = acc;
        ctx->saved_data["sum_scope"] = static_cast<int64_t>(live_scope.load());
        ++sums_attached;
      }
    }
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
    const std::vector<int64_t> rows = ctx->saved_data["rows"].toIntVector();
    const size_t parts = rows.size(), biases = ctx->saved_data["with_bias"].toBool() ? parts : 0;
    // One gradient for x, each weight and each bias, and none for the dtype and the two switches.
    torch::autograd::variable_list out(1 + parts + biases + 3);
    if (!grads[0].defined()) return out;
    at::Tensor dy = grads[0].to(xd.scalar_type()).contiguous();
    bool bias_wanted = false;
    for (size_t i = 0; i < biases; ++i) bias_wanted = bias_wanted || ctx->needs_input_grad(1 + parts + i);
    at::Tensor db;
    if (bias_wanted) db = at::empty({dy.size(1)}, dy.options().dtype(at::kFloat));
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
    if (ctx->needs_input_grad(0)) out[0] = at::mm(dy, wd).to(static_cast<at::ScalarType>(ctx->saved_data["x_type"].toInt()));
    // Each part's weight gradient: added into the step's accumulator where a scope named one
    // (autograd then gets none), else its rows of the joint gradient (one GEMM for the parts
    // that want one, where none adds; a GEMM each otherwise).
    auto scope_entry = ctx->saved_data.find("sum_scope");
    const uint64_t scope = scope_entry == ctx->saved_data.end() ? 0 : static_cast<uint64_t>(scope_entry->second.toInt());
    const bool live = scope != 0 && scope == live_scope.load();
    std::vector<at::Tensor> accs(parts);
    bool any_adds = false, all_want = true;
    for (size_t i = 0; i < parts; ++i) {
      auto into = ctx->saved_data.find("sum_into_" + std::to_string(i));
      if (live && into != ctx->saved_data.end()) accs[i] = into->second.toTensor();
      any_adds = any_adds || accs[i].defined();
      all_want = all_want && ctx->needs_input_grad(1 + i);
    }
    const at::Tensor joint_dw = !any_adds && all_want ? weight_grad(dy, xd) : at::Tensor();
    int64_t at_row = 0;
    for (size_t i = 0; i < parts; ++i) {
      const int64_t n = rows[i];
      if (ctx->needs_input_grad(1 + i)) {
        const at::Tensor dy_i = parts == 1 ? dy : dy.narrow(1, at_row, n);
        if (accs[i].defined()) {
          add_weight_grad(accs[i], dy_i, xd);
        } else {
          out[1 + i] = joint_dw.defined() ? (parts == 1 ? joint_dw : joint_dw.narrow(0, at_row, n)) : weight_grad(dy_i, xd);
        }
      }
      if (i < biases && ctx->needs_input_grad(1 + parts + i)) out[1 + parts + i] = parts == 1 ? db : db.narrow(0, at_row, n);
      at_row += n;
    }
    return out;
  }
};
// A linear layer's graph without its product (tg_linear with `graph_only`, where our node does not
// run): zeros [rows, out] in the dtype linear gives, and linear's backward as autograd computes it
// (x and w in that dtype, the gradients returned to x's, w's and b's). For the last layer of a
// block recomputed in backward (activation checkpointing, src/step/savers.rs): the block's output
// is never read there, only its gradient flows back, so its GEMM would be computed for nothing.
struct GraphOnlyLinear : public torch::autograd::Function<GraphOnlyLinear> {
  // x [rows, in]; w [out, in]; bs: none or the bias [out].
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, at::TensorList bs,
                                                at::ScalarType d) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::Tensor xd = x.to(d), wd = w.to(d);
    ctx->saved_data["x_type"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["w_type"] = static_cast<int64_t>(w.scalar_type());
    if (!bs.empty()) ctx->saved_data["b_type"] = static_cast<int64_t>(bs[0].scalar_type());
    ctx->save_for_backward({xd, wd});
    return {at::zeros({xd.size(0), wd.size(0)}, xd.options())};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor &xd = saved[0], &wd = saved[1];
    const bool bias = ctx->saved_data.count("b_type") != 0;
    torch::autograd::variable_list out(2 + (bias ? 1 : 0) + 1);  // x, w, the bias, none for the dtype
    if (!grads[0].defined()) return out;
    const at::Tensor dy = grads[0].to(xd.scalar_type());
    const auto type = [&](const char* key) { return static_cast<at::ScalarType>(ctx->saved_data[key].toInt()); };
    if (ctx->needs_input_grad(0)) out[0] = at::mm(dy, wd).to(type("x_type"));
    if (ctx->needs_input_grad(1)) out[1] = at::mm(dy.t(), xd).to(type("w_type"));
    if (bias && ctx->needs_input_grad(2)) out[2] = dy.sum(0).to(type("b_type"));
    return out;
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
// One multi-tensor copy per (device, source dtype, cast dtype): GPT-2's ~100 casts were ~100
// launches at every step's start, the GPU idle while the host made them (the fourth H100
// session's trace); ATen's _foreach_copy_ converts as copy_ does, value for value.
int tg_linear_refresh_casts(char* err, size_t err_len) {
  return trainguard::guarded(err, err_len, [&] {
    at::NoGradGuard no_grad;
    struct Group {
      std::tuple<c10::Device, at::ScalarType, at::ScalarType> key;
      std::vector<at::Tensor> casts, sources;
    };
    std::vector<Group> groups;
    auto add = [&](const at::Tensor& cast, const at::Tensor& source) {
      const auto key = std::make_tuple(cast.device(), source.scalar_type(), cast.scalar_type());
      auto g = std::find_if(groups.begin(), groups.end(), [&](const Group& x) { return x.key == key; });
      if (g == groups.end()) g = groups.insert(groups.end(), Group{key, {}, {}});
      g->casts.push_back(cast);
      g->sources.push_back(source);
    };
    // Each source is copied into its rows of its cast (a merged layers' parts into theirs).
    for (auto& entry : kept_casts) {
      const std::vector<at::Tensor> rows = part_rows(entry.second.cast, entry.second.sources);
      for (size_t i = 0; i < rows.size(); ++i) add(rows[i], entry.second.sources[i]);
    }
    for (auto& g : groups) at::_foreach_copy_(g.casts, g.sources);
    for (auto& entry : kept_casts) {
      for (size_t i = 0; i < entry.second.sources.size(); ++i) entry.second.versions[i] = entry.second.sources[i]._version();
    }
  });
}

// Casts reused on this thread so far (tests).
uint64_t tg_linear_casts_reused() { return casts_reused; }

// From now on the node adds the gradient of weight `params[i]` into `accs[i]` (tch handles, `n`
// pairs) in its backward, for the nodes whose forward runs on this thread, until
// tg_linear_end_weight_grad_sums(*scope). A scope started replaces the last. Pairs
// that cannot be are left out: an accumulator that is not a contiguous fp32 tensor of the
// weight's shape on its device, a weight that is not a leaf wanting a gradient, and every pair on
// CUDA where the GEMM can add neither bf16's nor fp16's products into fp32 (`gemm_adds_into_fp32`).
// `*held` is the pairs taken.
int tg_linear_sum_weight_grads(const void* const* params, const void* const* accs, size_t n, size_t* held, uint64_t* scope, char* err, size_t err_len) {
  *held = 0;
  *scope = 0;
  sum_targets.clear();  // the last scope ends first, whether this one starts or fails
  live_scope.store(0);
  return trainguard::guarded(err, err_len, [&] {
    std::unordered_map<const c10::TensorImpl*, SumTarget> targets;
    for (size_t i = 0; i < n; ++i) {
      const auto& w = *static_cast<const at::Tensor*>(params[i]);
      const auto& acc = *static_cast<const at::Tensor*>(accs[i]);
      const bool fits = acc.defined() && w.defined() && w.is_leaf() && w.requires_grad() && acc.scalar_type() == at::kFloat &&
                        acc.is_contiguous() && acc.sizes() == w.sizes() && acc.device() == w.device();
      // Both 16-bit dtypes tried here, outside any capture; a node takes the scope only for the
      // dtypes that work (adds_in_gemm).
      if (!fits || (acc.is_cuda() && !(gemm_adds_into_fp32(acc, at::kBFloat16) | gemm_adds_into_fp32(acc, at::kHalf)))) continue;
      targets.insert_or_assign(w.unsafeGetTensorImpl(), SumTarget{w, acc});
    }
    sum_targets = std::move(targets);
    *held = sum_targets.size();
    *scope = ++scopes_started;
    live_scope.store(*scope);
  });
}

// Ends scope `scope` if it is still the open one (a later scope is left as it is).
void tg_linear_end_weight_grad_sums(uint64_t scope) {
  if (scope == 0 || live_scope.load() != scope) return;
  live_scope.store(0);
  sum_targets.clear();
}

// Weights given to nodes made on this thread so far with an accumulator for their gradient
// (tests; a merged layers' node counts each part that has one).
uint64_t tg_linear_sums_attached() { return sums_attached; }

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

// Casts held on this thread now, a merged layers' joint cast one (tests).
size_t tg_linear_casts_held() { return kept_casts.size(); }

// The kept casts' addresses, ascending, into `out` (up to `n`; tests: a refresh keeps them).
size_t tg_linear_casts_addresses(uintptr_t* out, size_t n) {
  std::vector<uintptr_t> all;
  for (const auto& entry : kept_casts) all.push_back(reinterpret_cast<uintptr_t>(entry.second.cast.data_ptr()));
  std::sort(all.begin(), all.end());
  for (size_t i = 0; i < all.size() && i < n; ++i) out[i] = all[i];
  return all.size();
}

// x [..., in] · weightᵀ [in, out] (+ bias [out]), then GELU of it where `gelu` is 1: `*y_out` is
// a new tensor tch takes over. `weights` (tch handles, `n_weights` of them) are one layer's weight
// or the parts of merged layers that read x, whose outputs come in turn; `biases` their biases,
// one each or none (`n_biases` 0). Through our node where `our_node` is 1, our kernels run and
// autocast is on for x's device with a 16-bit dtype, the weights fp32; through ATen's linear
// (autocast's, when it is on) of the parts concatenated otherwise. With `graph_only` 1 the output
// is zeros and only its backward is linear's (no GELU then): our node without its GEMM, or
// GraphOnlyLinear.
int tg_linear(const void* x, const void* const* weights, size_t n_weights, const void* const* biases, size_t n_biases, int gelu, int graph_only,
              int our_node, void** y_out, char* err, size_t err_len) {
  *y_out = nullptr;
  return trainguard::guarded(err, err_len, [&] {
    const auto& xt = *static_cast<const at::Tensor*>(x);
    std::vector<at::Tensor> ws, bs;
    for (size_t i = 0; i < n_weights; ++i) ws.push_back(*static_cast<const at::Tensor*>(weights[i]));
    for (size_t i = 0; i < n_biases; ++i) bs.push_back(*static_cast<const at::Tensor*>(biases[i]));
    if (ws.empty()) throw std::invalid_argument("linear: no weight");
    if (!bs.empty() && bs.size() != ws.size()) throw std::invalid_argument("linear: merged layers must all have a bias or none");
    if (gelu != 0 && graph_only != 0) throw std::invalid_argument("linear: a graph-only layer has no GELU (its output is not computed)");
    int64_t out_features = 0;
    for (size_t i = 0; i < ws.size(); ++i) {
      const at::Tensor& w = ws[i];
      if (xt.dim() < 1 || w.dim() != 2 || w.size(1) != xt.size(-1)) throw std::invalid_argument("linear: weight must be [out, in] for inputs [..., in]");
      if (w.scalar_type() != ws[0].scalar_type() || w.device() != ws[0].device()) throw std::invalid_argument("linear: merged layers' weights must share a dtype and device");
      if (!bs.empty() && (bs[i].dim() != 1 || bs[i].size(0) != w.size(0))) throw std::invalid_argument("linear: bias must be [out]");
      out_features += w.size(0);
    }
    const c10::DeviceType type = xt.device().type();
    const bool autocast = at::autocast::is_autocast_enabled(type);
    const at::ScalarType d = autocast ? at::autocast::get_autocast_dtype(type) : xt.scalar_type();
    const at::Tensor& w0 = ws[0];
    const bool ours = our_node != 0 && autocast && (d == at::kBFloat16 || d == at::kHalf) && trainguard::runs_cuda_kernels(xt) && w0.scalar_type() == at::kFloat &&
                      (xt.scalar_type() == at::kFloat || xt.scalar_type() == d) && w0.device() == xt.device() && xt.numel() > 0;
    at::Tensor y;
    if (ours) {
      // Flattened outside the node, so autograd carries the gradient back through the view.
      const at::Tensor x2 = xt.reshape({-1, xt.size(-1)}).contiguous();
      std::vector<int64_t> shape(xt.sizes().begin(), xt.sizes().end());
      shape.back() = out_features;
      y = LinearNode::apply(x2, at::TensorList(ws), at::TensorList(bs), d, gelu != 0, graph_only != 0)[0].view(shape);
    } else {
      const at::Tensor w = ws.size() == 1 ? w0 : at::cat(ws, 0);
      const std::optional<at::Tensor> b = bs.empty() ? std::nullopt : std::optional<at::Tensor>(bs.size() == 1 ? bs[0] : at::cat(bs, 0));
      if (graph_only != 0) {
        std::vector<int64_t> shape(xt.sizes().begin(), xt.sizes().end());
        shape.back() = w.size(0);
        const std::vector<at::Tensor> b_list = b ? std::vector<at::Tensor>{*b} : std::vector<at::Tensor>{};
        y = GraphOnlyLinear::apply(xt.reshape({-1, xt.size(-1)}), w, at::TensorList(b_list), d)[0].view(shape);
      } else {
        y = at::linear(xt, w, b);
        if (gelu != 0) y = at::gelu(y);
      }
    }
    *y_out = new at::Tensor(y);
  });
}

}  // extern "C"
