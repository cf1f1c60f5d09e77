// Cross-entropy's CUDA kernels (`kernels.fused_cross_entropy`), compiled by NVRTC in one source
// after optim_kernels.cu, whose dtype loaders (F32, BF16, F16) and TG_THREADS / TG_WARPS they
// use. crates/trainguard-sys/cpp/loss_kernels.cpp holds the autograd node that launches them and the CPU path they
// are tested against.
//
// One CUDA block per row of logits, in the logits' own dtype: the forward reads the row once
// (the running maximum and sum of exponentials together) and writes two floats, its
// log-sum-exp and its loss; the backward reads the row once more and writes its gradient,
// softmax − one-hot times the row's scale, in the logits' dtype. Where a row starts on 16 bytes
// and holds whole 16-byte packs (8 bf16 or fp16 logits, 4 fp32: a vocabulary padded to 64
// always does), each thread moves a pack per load and store: a profile on an H200 had the
// one-logit-per-load kernels at 1.1 (forward) and 1.9 TB/s (backward), and the forward's
// running maximum made each logit wait for the one before; a pack's eight are exponentiated
// independently against the pack's maximum. Other rows take the one-logit loop. No fp32 copy of the logits, no
// log-probabilities, no fp32 gradient: where autocast's log_softmax keeps 4 bytes per logit and
// its backward writes 4 + 2 more, this keeps the 16-bit logits and writes 2. In training
// (`kernels.fused_loss_gradient`) one kernel does both: the loss, then the gradient written over
// the row it has just read (the H100 trace of gpt2-124m had the two at 0.86 and 1.14 ms a
// micro-step over 1.65 GB of bf16 logits); that kernel reads the row twice, the second time
// from its end (mostly from L2). On an H100 two other forms ran slower and are gone: a grid of a
// few blocks per SM walking the rows (2.5–3.3%) and the row read once into registers (8.5%).
//
// A row's target of −100 is ignored (loss 0, gradient 0), as in PyTorch; any other target
// outside [0, columns) gives the row a NaN loss, which the training loop reports as a
// non-finite loss, rather than a device-side abort.

#define TG_CE_IGNORE (-100LL)
#define TG_CE_BATCH 4  // 16-byte packs a thread loads before it uses the first

__device__ __forceinline__ float tg_neg_inf() { return __int_as_float(0xff800000); }

// Merges (m2, s2) into (m, s), each a part of a row as (maximum, Σ exp(x − maximum)); an empty
// part is (−∞, 0).
__device__ __forceinline__ void tg_lse_merge(float& m, float& s, float m2, float s2) {
  const float top = m < m2 ? m2 : m;
  if (top == tg_neg_inf()) {  // both parts empty (or only −∞ logits): no scaling, but a NaN sum stays NaN
    s = s + s2;
    return;
  }
  s = s * expf(m - top) + s2 * expf(m2 - top);
  m = top;
}

// 16 bytes of a row, as the device loads and stores them in one instruction (uint4) and as
// values of the row's dtype.
union TgPack {
  uint4 bits;
  float f32[4];
  unsigned short b16[8];
};
__device__ __forceinline__ float* tg_pack_values(TgPack& p, float*) { return p.f32; }
__device__ __forceinline__ unsigned short* tg_pack_values(TgPack& p, unsigned short*) { return p.b16; }
// Whether `p` starts on 16 bytes (a pack's alignment).
__device__ __forceinline__ bool tg_on_16_bytes(const void* p) { return (reinterpret_cast<unsigned long long>(p) & 15) == 0; }
// Whether rows of `cols` values of type T from `row` on can be read in packs.
template <class T>
__device__ __forceinline__ bool tg_packed_rows(const void* row, long long cols) {
  return tg_on_16_bytes(row) && cols % (16 / sizeof(T)) == 0;
}

// Merges the values v[0, n) into the running (m, s); −∞ values count for nothing, a NaN makes s
// NaN.
__device__ __forceinline__ void tg_lse_add(float& m, float& s, const float* v, int n) {
  float top = m;
  for (int k = 0; k < n; ++k) top = v[k] > top ? v[k] : top;
  if (top != m) {  // m < top: rescale what was summed (m = −∞ leaves s = 0 as it is)
    s = s * expf(m - top);
    m = top;
  }
  for (int k = 0; k < n; ++k) {  // v = m counts 1 exactly, also where both are +∞
    if (v[k] != tg_neg_inf()) s += v[k] == m ? 1.0f : expf(v[k] - m);
  }
}

// The k-th pack of a row of `packs` a thread takes, counted from the row's end where `backwards`.
__device__ __forceinline__ long long tg_ce_pack(long long k, long long packs, bool backwards) { return backwards ? packs - 1 - k : k; }

// A thread's batch of packs of `row` from its k0-th on: k0, k0 + TG_THREADS, … (TG_CE_BATCH of
// them, those below `packs`), all loads issued before any is used.
__device__ __forceinline__ void tg_ce_load_packs(const void* row, long long k0, long long packs, bool backwards, TgPack* p) {
#pragma unroll
  for (int u = 0; u < TG_CE_BATCH; ++u) {
    const long long k = k0 + u * TG_THREADS;
    if (k < packs) p[u].bits = reinterpret_cast<const uint4*>(row)[tg_ce_pack(k, packs, backwards)];
  }
}

// Merges a pack's values into the thread's running (m, s).
template <class D>
__device__ __forceinline__ void tg_ce_add_pack(float& m, float& s, uint4 bits) {
  constexpr int n = 16 / sizeof(typename D::T);
  TgPack p;
  p.bits = bits;
  const typename D::T* packed = tg_pack_values(p, static_cast<typename D::T*>(nullptr));
  float v[n];
  for (int k = 0; k < n; ++k) v[k] = D::load(packed, k);
  tg_lse_add(m, s, v, n);
}

// The row's log-sum-exp from each thread's (m, s) over its part of row `row` (starting at xr);
// lse[row] and loss[row] (lse − x[target], 0 for an ignored target) are written by thread 0;
// every thread gets the log-sum-exp back, after the row's target logit was read (so the row may
// be overwritten next). The parts merge in a fixed order: a butterfly within each warp, then
// the warps in order, so every run gives the same bits.
template <class D>
__device__ __forceinline__ float ce_row_finish(float m, float s, const typename D::T* xr, const long long* target, float* lse, float* loss,
                                               long long cols, long long row) {
  __shared__ float part_m[TG_WARPS], part_s[TG_WARPS];
  __shared__ float row_lse;
  for (int k = 16; k > 0; k >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, k), s2 = __shfl_xor_sync(0xffffffffu, s, k);
    tg_lse_merge(m, s, m2, s2);
  }
  if ((threadIdx.x & 31) == 0) {
    part_m[threadIdx.x >> 5] = m;
    part_s[threadIdx.x >> 5] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    m = part_m[0];
    s = part_s[0];
    for (int w = 1; w < TG_WARPS; ++w) tg_lse_merge(m, s, part_m[w], part_s[w]);
    row_lse = m + logf(s);
    const long long t = target[row];
    lse[row] = row_lse;
    if (t == TG_CE_IGNORE) {
      loss[row] = 0.0f;
    } else if (t < 0 || t >= cols) {
      loss[row] = __int_as_float(0x7fc00000);  // NaN: a target outside the vocabulary
    } else {
      loss[row] = row_lse - D::load(xr, t);
    }
  }
  __syncthreads();
  return row_lse;
}

// Row `row` of `x` [rows, cols]: lse[row] = log Σ exp(x), loss[row] = lse − x[target] (0 for an
// ignored target), as ce_row_finish; each thread sums its values in order of their column (its
// packs k = thread, + TG_THREADS, …, where the row is in packs).
template <class D>
__device__ __forceinline__ float ce_row(const typename D::T* x, const long long* target, float* lse, float* loss, long long cols, long long row) {
  const typename D::T* xr = x + row * cols;
  float m = tg_neg_inf(), s = 0.0f;
  if (tg_packed_rows<typename D::T>(xr, cols)) {
    const long long packs = cols / (16 / sizeof(typename D::T));
    // TG_CE_BATCH packs loaded before the first is added (in the same order as one at a time:
    // the same bits), so that a thread has that many loads in flight, not one.
    for (long long i0 = threadIdx.x; i0 < packs; i0 += TG_CE_BATCH * TG_THREADS) {
      TgPack p[TG_CE_BATCH];
      tg_ce_load_packs(xr, i0, packs, false, p);
#pragma unroll
      for (int u = 0; u < TG_CE_BATCH; ++u) {
        if (i0 + u * TG_THREADS >= packs) break;
        tg_ce_add_pack<D>(m, s, p[u].bits);
      }
    }
  } else {
    for (long long j = threadIdx.x; j < cols; j += TG_THREADS) {
      const float v = D::load(xr, j);
      tg_lse_add(m, s, &v, 1);
    }
  }
  return ce_row_finish<D>(m, s, xr, target, lse, loss, cols, row);
}

// Pack i of a row's gradient from its logits `in`: scale · (exp(x − lse) − [column = t]).
template <class D>
__device__ __forceinline__ uint4 tg_ce_gradient_pack(TgPack& in, long long i, long long t, float row_lse, float scale) {
  constexpr int n = 16 / sizeof(typename D::T);
  TgPack out;
  const typename D::T* x_values = tg_pack_values(in, static_cast<typename D::T*>(nullptr));
  typename D::T* g_values = tg_pack_values(out, static_cast<typename D::T*>(nullptr));
  for (int j = 0; j < n; ++j) {
    const float p = expf(D::load(x_values, j) - row_lse);
    D::store(g_values, j, scale * (i * n + j == t ? p - 1.0f : p));
  }
  return out.bits;
}

// Row `row`'s gradient into `grad` (which may be `x` itself: each value is read before it
// is written, by the thread that writes it): scale · (exp(x − lse) − [column = target]), where
// scale is *grad_scale (the loss's gradient, divided by the counted rows for a mean) and 0 for
// an ignored row. `backwards` walks the row from its end: right after the row was read front to
// back, its last values are the likeliest still in L2.
template <class D>
__device__ __forceinline__ void ce_gradient(const typename D::T* x, const long long* target, float row_lse, const float* grad_scale,
                                            typename D::T* grad, long long cols, long long row, bool backwards) {
  const long long t = target[row];
  const float scale = t == TG_CE_IGNORE ? 0.0f : *grad_scale;
  const typename D::T* xr = x + row * cols;
  typename D::T* gr = grad + row * cols;
  if (tg_packed_rows<typename D::T>(xr, cols) && tg_packed_rows<typename D::T>(gr, cols)) {
    constexpr int n = 16 / sizeof(typename D::T);
    const long long packs = cols / n;
    // TG_CE_BATCH packs loaded, then each turned into its gradient and stored: x and grad may
    // be one tensor, so without the batch each load would wait for the store before it.
    for (long long k0 = threadIdx.x; k0 < packs; k0 += TG_CE_BATCH * TG_THREADS) {
      TgPack in[TG_CE_BATCH];
      tg_ce_load_packs(xr, k0, packs, backwards, in);
#pragma unroll
      for (int u = 0; u < TG_CE_BATCH; ++u) {
        const long long k = k0 + u * TG_THREADS;
        if (k >= packs) break;
        const long long i = tg_ce_pack(k, packs, backwards);
        reinterpret_cast<uint4*>(gr)[i] = tg_ce_gradient_pack<D>(in[u], i, t, row_lse, scale);
      }
    }
  } else {
    for (long long j0 = threadIdx.x; j0 < cols; j0 += TG_THREADS) {
      const long long j = backwards ? cols - 1 - j0 : j0;
      const float p = expf(D::load(xr, j) - row_lse);
      D::store(gr, j, scale * (j == t ? p - 1.0f : p));
    }
  }
}

// Row blockIdx.x of a gradient that ce_forward_grad wrote for a loss gradient of 1, times the
// loss gradient *factor the backward was given; nothing to do (every block returns at once)
// where that is 1, the usual case. Ignored rows stay exactly 0.
template <class D>
__device__ __forceinline__ void ce_scale_grad(typename D::T* grad, const long long* target, const float* factor, long long cols) {
  const float f = *factor;
  const long long row = blockIdx.x;
  if (f == 1.0f || target[row] == TG_CE_IGNORE) return;
  typename D::T* gr = grad + row * cols;
  for (long long j = threadIdx.x; j < cols; j += TG_THREADS) D::store(gr, j, D::load(gr, j) * f);
}

// Per dtype: the loss alone (forward), its gradient (backward), and both in one kernel that
// writes the gradient over the logits (`kernels.fused_loss_gradient`: the row is read twice,
// the second time mostly from L2, where the two kernels read it three times and write a
// separate gradient), with the rescaling for a backward given another loss gradient than 1.
// Each kernel runs a block a row.
#define TG_CROSS_ENTROPY(SUFFIX, D)                                                                                  \
  TG_KERNEL void __launch_bounds__(TG_THREADS)                                                                       \
      tg_ce_forward_##SUFFIX(const D::T* x, const long long* target, float* lse, float* loss, long long cols) {    \
    ce_row<D>(x, target, lse, loss, cols, blockIdx.x);                                                              \
  }                                                                                                                  \
  TG_KERNEL void __launch_bounds__(TG_THREADS) tg_ce_backward_##SUFFIX(                                             \
      const D::T* x, const long long* target, const float* lse, const float* grad_scale, D::T* grad, long long cols) { \
    ce_gradient<D>(x, target, lse[blockIdx.x], grad_scale, grad, cols, blockIdx.x, false);                          \
  }                                                                                                                  \
  TG_KERNEL void __launch_bounds__(TG_THREADS) tg_ce_forward_grad_##SUFFIX(                                         \
      D::T* x, const long long* target, float* lse, float* loss, const float* grad_scale, long long cols) {         \
    const float row_lse = ce_row<D>(x, target, lse, loss, cols, blockIdx.x);                                        \
    ce_gradient<D>(x, target, row_lse, grad_scale, x, cols, blockIdx.x, true);                                      \
  }                                                                                                                  \
  TG_KERNEL void __launch_bounds__(TG_THREADS)                                                                       \
      tg_ce_scale_grad_##SUFFIX(D::T* grad, const long long* target, const float* factor, long long cols) {          \
    ce_scale_grad<D>(grad, target, factor, cols);                                                                   \
  }

TG_CROSS_ENTROPY(f32, F32)
TG_CROSS_ENTROPY(bf16, BF16)
TG_CROSS_ENTROPY(f16, F16)
