// Attention over documents laid end to end (`data.document_mask` on CUDA): ATen's
// variable-length fused kernels, which take each document's bounds as cumulative lengths and
// never build a t × t mask. tch 0.24 does not bind their forwards (their results include
// SymInts), so the shim calls them. Both are differentiable ATen ops: autograd records their
// backward (FlashAttentionBackward0, EfficientAttentionBackward0) as for any op.
// - 16-bit q, k, v: flash attention (`_flash_attention_forward`), which takes grouped key/value
//   heads as they are.
// - fp32: flash attention does not run in fp32, so the memory-efficient kernel
//   (`_efficient_attention_forward`, causal from the top left of each document) with the
//   key/value heads repeated to every query head (it takes no grouped heads), as the model does
//   for plain causal attention in fp32 on CUDA (model::layers::repeats_grouped_heads).
#include <ATen/ATen.h>

#include <stdexcept>
#include <string>

#include "guarded.h"

extern "C" {

// q [n, heads, d], k and v [n, kv_heads, d] (n tokens: the documents end to end), cu_seqlens
// int32 [documents + 1] on q's device, max_len the longest document. `*out`: [n, heads, d], a
// new tensor tch takes over.
int tg_varlen_attention(const void* q, const void* k, const void* v, const void* cu_seqlens, long long max_len,
                        double dropout, void** out, char* err, size_t err_len) {
  *out = nullptr;
  return trainguard::guarded(err, err_len, [&] {
    const auto& qt = *static_cast<const at::Tensor*>(q);
    const auto& kt = *static_cast<const at::Tensor*>(k);
    const auto& vt = *static_cast<const at::Tensor*>(v);
    const auto& cu = *static_cast<const at::Tensor*>(cu_seqlens);
    if (qt.dim() != 3 || kt.dim() != 3 || vt.dim() != 3)
      throw std::invalid_argument("varlen_attention: q, k and v must be [tokens, heads, head_dim]");
    if (!qt.is_cuda())
      throw std::invalid_argument("varlen_attention: the variable-length kernels run on CUDA only (the CPU takes the document mask)");
    if (cu.scalar_type() != at::kInt) throw std::invalid_argument("varlen_attention: cu_seqlens must be int32");
    const int64_t heads = qt.size(1), kv_heads = kt.size(1);
    if (kv_heads <= 0 || heads % kv_heads != 0)
      throw std::invalid_argument("varlen_attention: kv_heads must divide heads");
    const auto dtype = qt.scalar_type();
    if (dtype == at::kHalf || dtype == at::kBFloat16) {
      auto result = at::_flash_attention_forward(qt, kt, vt, cu, cu, max_len, max_len, dropout,
                                                 /*is_causal=*/true, /*return_debug_mask=*/false);
      *out = new at::Tensor(std::get<0>(result));
      return;
    }
    at::Tensor kr = kt, vr = vt;
    if (kv_heads != heads) {
      kr = kt.repeat_interleave(heads / kv_heads, 1);
      vr = vt.repeat_interleave(heads / kv_heads, 1);
    }
    const bool grad = qt.requires_grad() || kr.requires_grad() || vr.requires_grad();
    // [1, n, heads, d]: one "batch" whose sequences cu_seqlens cuts; mask type 1 is causal from
    // each sequence's top left (equal query and key lengths: the ordinary causal mask).
    auto result = at::_efficient_attention_forward(qt.unsqueeze(0), kr.unsqueeze(0), vr.unsqueeze(0), std::nullopt, cu, cu,
                                                   max_len, max_len, dropout, /*custom_mask_type=*/1,
                                                   /*compute_log_sumexp=*/grad);
    *out = new at::Tensor(std::get<0>(result).squeeze(0));
  });
}

}  // extern "C"
