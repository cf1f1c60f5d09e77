// LayerNorm's and RMSNorm's CUDA kernels (`kernels.fused_residual_norm`), compiled by NVRTC in one source after
// optim_kernels.cu (dtype loaders F32, BF16, F16; TG_THREADS, TG_WARPS) and loss_kernels.cu.
// crates/trainguard-sys/cpp/norm_kernels.cpp holds the autograd node that launches them and the plain ATen form
// they are tested against.
//
// What they fuse, on rows of width c: the residual add before a norm (s = x + δ, x the fp32
// residual stream, δ a block's output in the compute dtype D), the norm in fp32 (LayerNorm, or
// with `rms` RMSNorm: no mean taken off, no bias), and the rounding of its output to D, which
// autocast would do with a separate cast (once per reading matrix multiplication); backward, the
// norm's input gradient, the residual's gradient added to it (ds) and its rounding to δ's dtype.
// Where ATen under autocast reads and writes the row about seven times forward and twelve
// backward (add, norm, cast; cast, norm, accumulate, cast), these read and write it three and
// five times; the weight and bias gradients' sums ride along the backward's reads (rows of up to
// TG_ROW_VALUES · 32; wider rows: one more pass).
//
// Rows of at most TG_ROW_VALUES · 32 values (GPT-2's 768 to 1024, the small Llamas' 576 and
// 960) take a warp each, TG_WARPS rows a block, every lane holding its values in registers: the
// row is read from memory once and its sums are warp shuffles (the backward's blocks meet at
// barriers only at the end, to add their warps' parameter sums).
// Wider rows take a block each and read the row again per pass (from L2), across four barriers:
// with one row a block, those waits, not the memory, set the pace.
//
// Every reduction runs in a fixed order (a butterfly within each warp, then the warps in
// order; rows in bands summed in band order), so every run gives the same bits.
#define TG_ROW_VALUES 32
// Rows (or bands) a lane loads before it adds the first of them, in the column sums below and in
// linear_kernels.cu's.
#define TG_BATCH 8
// Rows each warp of the warp-a-row backward takes, one after another (so that its weight and
// bias sums stay in registers across them).
#define TG_NORM_WARP_ROWS 8
// w and b values a lane of the warp-a-row forward loads together, before it stores their outputs.
#define TG_NORM_PARAM_CHUNK 8

// The sum of each lane's `v` over its warp; every lane gets it.
__device__ __forceinline__ float tg_warp_sum(float v) {
  for (int k = 16; k > 0; k >>= 1) v += __shfl_xor_sync(0xffffffffu, v, k);
  return v;
}

// The sum of p[0], p[stride], …, p[(n − 1) · stride] in that order, TG_SUM_BATCH loaded before
// the first of them is added (the bands' column sums into a parameter's gradient, here and in
// linear_kernels.cu: 64 bands for 16,384 rows, so 4 waits for memory where 8 were).
#define TG_SUM_BATCH 16
__device__ __forceinline__ float tg_ordered_sum(const float* p, long long n, long long stride) {
  float total = 0.0f;
  for (long long k0 = 0; k0 < n; k0 += TG_SUM_BATCH) {
    float v[TG_SUM_BATCH];
#pragma unroll
    for (int u = 0; u < TG_SUM_BATCH; ++u) v[u] = k0 + u < n ? p[(k0 + u) * stride] : 0.0f;
#pragma unroll
    for (int u = 0; u < TG_SUM_BATCH; ++u) {
      if (k0 + u < n) total += v[u];
    }
  }
  return total;
}

// The sum of each thread's `v` over the CUDA block; every thread gets it.
__device__ __forceinline__ float tg_block_sum(float v, float* shared) {
  v = tg_warp_sum(v);
  __syncthreads();  // `shared` may still be read by an earlier call's threads
  if ((threadIdx.x & 31) == 0) shared[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < TG_WARPS; ++w) total += shared[w];
  return total;
}

// Row blockIdx.x: s = x (+ δ), written to `s_out` when there is a δ; mean and 1/σ over the row
// (two passes, fp32; with `rms` the mean is 0 and σ the root mean square); y = (s − mean)/σ · w
// (+ b), rounded to D.
template <class D>
__device__ __forceinline__ void ln_forward(const float* x, const typename D::T* delta, const float* w, const float* b, float* s_out,
                                           typename D::T* y, float* mean_out, float* rstd_out, long long cols, float eps, int rms) {
  __shared__ float part[TG_WARPS];
  const long long row = blockIdx.x, base = row * cols;
  float sum = 0.0f;
  for (long long j = threadIdx.x; j < cols; j += TG_THREADS) {
    float v = x[base + j];
    if (delta != nullptr) {
      v += D::load(delta, base + j);
      s_out[base + j] = v;
    }
    sum += v;
  }
  // `rms` is the same for every thread: all take the barriers inside tg_block_sum or none do.
  const float mean = rms ? 0.0f : tg_block_sum(sum, part) / static_cast<float>(cols);
  const float* s = delta != nullptr ? s_out : x;
  float sq = 0.0f;
  for (long long j = threadIdx.x; j < cols; j += TG_THREADS) {
    const float d = s[base + j] - mean;
    sq += d * d;
  }
  const float rstd = 1.0f / sqrtf(tg_block_sum(sq, part) / static_cast<float>(cols) + eps);
  for (long long j = threadIdx.x; j < cols; j += TG_THREADS) {
    const float v = (s[base + j] - mean) * rstd * w[j];
    D::store(y, base + j, b != nullptr ? v + b[j] : v);
  }
  if (threadIdx.x == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

// ln_forward for the row of this warp (rows of at most TG_ROW_VALUES · 32): the same values, the
// row's values loaded once into registers before anything is stored (so the loads are all in
// flight at once).
template <class D>
__device__ __forceinline__ void ln_forward_warp(const float* __restrict__ x, const typename D::T* __restrict__ delta, const float* __restrict__ w,
                                                const float* __restrict__ b, float* __restrict__ s_out, typename D::T* __restrict__ y,
                                                float* __restrict__ mean_out, float* __restrict__ rstd_out, long long rows, long long cols,
                                                float eps, int rms) {
  const int lane = threadIdx.x & 31;
  const long long row = static_cast<long long>(blockIdx.x) * TG_WARPS + (threadIdx.x >> 5);
  if (row >= rows) return;  // the whole warp: the last block's spare rows
  const long long base = row * cols;
  // x and δ all loaded before any is used (δ raw, converted in the loop after: converted as
  // loaded, ptxas may wait for each few loads).
  float v[TG_ROW_VALUES];
  typename D::T raw[TG_ROW_VALUES];
#pragma unroll
  for (int k = 0; k < TG_ROW_VALUES; ++k) {
    const long long j = lane + 32LL * k;
    v[k] = 0.0f;
    raw[k] = 0;
    if (j < cols) {
      v[k] = x[base + j];
      if (delta != nullptr) raw[k] = delta[base + j];
    }
  }
#pragma unroll
  for (int k = 0; k < TG_ROW_VALUES; ++k) {
    if (delta != nullptr) v[k] += D::load(raw, k);
  }
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < TG_ROW_VALUES; ++k) {
    const long long j = lane + 32LL * k;
    if (j < cols) {
      if (delta != nullptr) s_out[base + j] = v[k];
      sum += v[k];
    }
  }
  const float mean = rms ? 0.0f : tg_warp_sum(sum) / static_cast<float>(cols);
  float sq = 0.0f;
#pragma unroll
  for (int k = 0; k < TG_ROW_VALUES; ++k) {
    const float d = v[k] - mean;
    if (lane + 32LL * k < cols) sq += d * d;
  }
  const float rstd = 1.0f / sqrtf(tg_warp_sum(sq) / static_cast<float>(cols) + eps);
  // w and b a chunk of TG_NORM_PARAM_CHUNK values at a time, the chunk's loads issued before its
  // stores: loaded beside each store, ptxas waited (on L1) for every w and b, 32 waits a row
  // (`scripts/gpu/load_waits.py tg_ln_forward_warp`); the whole row's w and b at once would not fit
  // beside v in 128 registers.
#pragma unroll
  for (int k0 = 0; k0 < TG_ROW_VALUES; k0 += TG_NORM_PARAM_CHUNK) {
    float wk[TG_NORM_PARAM_CHUNK], bk[TG_NORM_PARAM_CHUNK];
#pragma unroll
    for (int k = 0; k < TG_NORM_PARAM_CHUNK; ++k) {
      // Past the row's end the last column's, loaded without a condition: no branch for ptxas
      // to keep the loads behind.
      const int last = static_cast<int>(cols) - 1, at = lane + 32 * (k0 + k);  // cols ≤ 32 · TG_ROW_VALUES
      const int j = at < last ? at : last;
      wk[k] = w[j];
      bk[k] = b != nullptr ? b[j] : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < TG_NORM_PARAM_CHUNK; ++k) {
      const long long j = lane + 32LL * (k0 + k);
      if (j < cols) {
        const float o = (v[k0 + k] - mean) * rstd * wk[k];
        D::store(y, base + j, b != nullptr ? o + bk[k] : o);
      }
    }
  }
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

// Row blockIdx.x's input gradient: with x̂ = (s − mean)/σ and g = dy · w,
// dx = (g − mean(g) − x̂ · mean(g · x̂))/σ (+ ds) (with `rms`, no mean(g) term: the mean was not
// taken off), written in fp32 and, when δ had a dtype of its own, rounded to it as dδ. `dy` or
// `ds` may be null (their output was not used).
template <class D>
__device__ __forceinline__ void ln_backward(const float* s, const float* w, const float* mean, const float* rstd, const typename D::T* dy,
                                            const float* ds, float* dx, typename D::T* ddelta, long long cols, int rms) {
  __shared__ float part[TG_WARPS];
  const long long row = blockIdx.x, base = row * cols;
  const float mu = mean[row], r = rstd[row];
  float sg = 0.0f, sgx = 0.0f;
  if (dy != nullptr) {
    for (long long j = threadIdx.x; j < cols; j += TG_THREADS) {
      const float g = D::load(dy, base + j) * w[j];
      sg += g;
      sgx += g * ((s[base + j] - mu) * r);
    }
  }
  const float c1 = tg_block_sum(sgx, part) / static_cast<float>(cols);
  const float c2 = rms ? 0.0f : tg_block_sum(sg, part) / static_cast<float>(cols);
  for (long long j = threadIdx.x; j < cols; j += TG_THREADS) {
    float v = 0.0f;
    if (dy != nullptr) {
      const float g = D::load(dy, base + j) * w[j];
      v = (g - c2 - (s[base + j] - mu) * r * c1) * r;
    }
    if (ds != nullptr) v += ds[base + j];
    if (dx != nullptr) dx[base + j] = v;
    if (ddelta != nullptr) D::store(ddelta, base + j, v);
  }
}

// ln_backward, a warp a row, for TG_NORM_WARP_ROWS rows per warp (rows of at most TG_ROW_VALUES
// · 32): the same values, g and x̂ kept in registers between the sums and the output. Where
// `partial` is not null the block's share of dw = Σ dy · x̂ and db = Σ dy is also written, to
// partial[blockIdx.x][0..cols) and partial[blockIdx.x][cols..2·cols) (tg_ln_param_sum adds the
// blocks' shares): each lane adds its columns' values of its rows in registers as it reads them,
// so dy and s are not read again by a kernel of their own. Block b takes rows b · R … b · R + R −
// 1 (R = TG_WARPS · TG_NORM_WARP_ROWS), warp w of it every TG_WARPS-th from b · R + w; a column's
// sum runs over a warp's rows in order, then over the warps, then over the blocks: an order fixed
// by the row count alone, so every device and run gives the same bits.
template <class D>
__device__ __forceinline__ void ln_backward_warp(const float* __restrict__ s, const float* __restrict__ w, const float* __restrict__ mean,
                                                 const float* __restrict__ rstd, const typename D::T* __restrict__ dy,
                                                 const float* __restrict__ ds, float* __restrict__ dx, typename D::T* __restrict__ ddelta,
                                                 float* __restrict__ partial, long long rows, long long cols, int rms) {
  __shared__ float part_w[TG_WARPS][32], part_b[TG_WARPS][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long first = static_cast<long long>(blockIdx.x) * (TG_WARPS * TG_NORM_WARP_ROWS) + warp;
  // Written only where `partial` is given, a choice the same for every thread.
  const bool sums = partial != nullptr && dy != nullptr;
  float aw[TG_ROW_VALUES], ab[TG_ROW_VALUES];
#pragma unroll
  for (int k = 0; k < TG_ROW_VALUES; ++k) {
    aw[k] = 0.0f;
    ab[k] = 0.0f;
  }
  for (int i = 0; i < TG_NORM_WARP_ROWS; ++i) {
    const long long row = first + static_cast<long long>(i) * TG_WARPS;
    if (row >= rows) break;  // the whole warp: no barrier inside this loop
    const long long base = row * cols;
    const float mu = mean[row], r = rstd[row];
    // The row's dy, s and ds all loaded before any is used: one wait for memory a row. dy stays
    // raw and x̂ is not formed until the loop after: converted in the loading loop, ptxas (sm_90)
    // waited for every dozen loads or so, some eight waits a row (the fourth H100 session's
    // 122 µs a call; `scripts/gpu/load_waits.py tg_ln_backward_warp` shows the loads' groups).
    typename D::T raw[TG_ROW_VALUES];
    float g[TG_ROW_VALUES], h[TG_ROW_VALUES], e[TG_ROW_VALUES];
#pragma unroll
    for (int k = 0; k < TG_ROW_VALUES; ++k) {
      const long long j = lane + 32LL * k;
      raw[k] = 0;
      h[k] = 0.0f;
      e[k] = 0.0f;
      if (dy != nullptr && j < cols) {
        raw[k] = dy[base + j];
        h[k] = s[base + j];
      }
      if (ds != nullptr && j < cols) e[k] = ds[base + j];
    }
#pragma unroll
    for (int k = 0; k < TG_ROW_VALUES; ++k) {
      g[k] = D::load(raw, k);
      h[k] = lane + 32LL * k < cols ? (h[k] - mu) * r : 0.0f;
    }
    float sg = 0.0f, sgx = 0.0f;
#pragma unroll
    for (int k = 0; k < TG_ROW_VALUES; ++k) {
      if (sums) {
        aw[k] += g[k] * h[k];
        ab[k] += g[k];
      }
      g[k] *= lane + 32LL * k < cols ? w[lane + 32LL * k] : 0.0f;
      sg += g[k];
      sgx += g[k] * h[k];
    }
    const float c1 = tg_warp_sum(sgx) / static_cast<float>(cols);
    const float c2 = rms ? 0.0f : tg_warp_sum(sg) / static_cast<float>(cols);
#pragma unroll
    for (int k = 0; k < TG_ROW_VALUES; ++k) {
      const long long j = lane + 32LL * k;
      if (j < cols) {
        float v = dy != nullptr ? (g[k] - c2 - h[k] * c1) * r : 0.0f;
        if (ds != nullptr) v += e[k];
        if (dx != nullptr) dx[base + j] = v;
        if (ddelta != nullptr) D::store(ddelta, base + j, v);
      }
    }
  }
  if (!sums) return;  // every thread alike: no barrier left waiting
  // The warps' sums added in warp order, 32 columns at a time, by warp 0.
  float* band = partial + static_cast<long long>(blockIdx.x) * 2 * cols;
#pragma unroll
  for (int k = 0; k < TG_ROW_VALUES; ++k) {
    if (32LL * k < cols) {  // the same for every thread of the block
      part_w[warp][lane] = aw[k];
      part_b[warp][lane] = ab[k];
      __syncthreads();
      // threadIdx read afresh, so that no compiler splits the barriers by a condition known
      // before them.
      const long long j = 32LL * k + (threadIdx.x & 31);
      if (threadIdx.x < 32 && j < cols) {
        float tw = 0.0f, tb = 0.0f;
        for (int q = 0; q < TG_WARPS; ++q) {
          tw += part_w[q][threadIdx.x];
          tb += part_b[q][threadIdx.x];
        }
        band[j] = tw;
        band[cols + j] = tb;
      }
      __syncthreads();
    }
  }
}

// Column tile blockIdx.x (32 columns, a lane each) of band blockIdx.y (`band_rows` rows, the
// block's 8 warps taking every 8th): this band's part of dw = Σ dy · x̂ and db = Σ dy, written to
// partial[band][0..cols) and partial[band][cols..2·cols).
template <class D>
__device__ __forceinline__ void ln_param_grads(const float* s, const float* mean, const float* rstd, const typename D::T* dy, float* partial,
                                               long long rows, long long cols, long long band_rows) {
  __shared__ float part_w[TG_WARPS][32], part_b[TG_WARPS][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long col = static_cast<long long>(blockIdx.x) * 32 + lane;
  const long long first = static_cast<long long>(blockIdx.y) * band_rows;
  // A lane past the last column reads no rows.
  const long long last = col >= cols ? first : first + band_rows < rows ? first + band_rows : rows;
  float aw = 0.0f, ab = 0.0f;
  // TG_BATCH rows at a time: their loads all in flight before the first sum, where a row at a
  // time waits for memory each row. The sums keep their order.
  for (long long row0 = first + warp; row0 < last; row0 += TG_BATCH * TG_WARPS) {
    float g[TG_BATCH], h[TG_BATCH];
#pragma unroll
    for (int u = 0; u < TG_BATCH; ++u) {
      const long long row = row0 + u * TG_WARPS;
      g[u] = row < last ? D::load(dy, row * cols + col) : 0.0f;
      h[u] = row < last ? (s[row * cols + col] - mean[row]) * rstd[row] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < TG_BATCH; ++u) {
      if (row0 + u * TG_WARPS < last) {
        aw += g[u] * h[u];
        ab += g[u];
      }
    }
  }
  part_w[warp][lane] = aw;
  part_b[warp][lane] = ab;
  __syncthreads();
  // Warp 0's lanes of real columns add the warps' parts (threadIdx read afresh, so that no
  // compiler — the host emulation's included — splits the barrier above by a condition known
  // before it).
  if (threadIdx.x >= 32 || static_cast<long long>(blockIdx.x) * 32 + threadIdx.x >= cols) return;
  float tw = 0.0f, tb = 0.0f;
  for (int k = 0; k < TG_WARPS; ++k) {
    tw += part_w[k][lane];
    tb += part_b[k][lane];
  }
  float* band = partial + static_cast<long long>(blockIdx.y) * 2 * cols;
  band[col] = tw;
  band[cols + col] = tb;
}

// Forward and backward in two forms each: a block a row (`tg_ln_forward_*`, `tg_ln_backward_*`,
// any width) and a warp a row, TG_WARPS rows a block (`*_warp_*`, rows of at most TG_ROW_VALUES ·
// 32). Separate kernels, so that the warp form's registers (128 a thread forward, 254 backward
// with its parameter sums, for sm_90) do not cut how many blocks of the block form an SM holds.
#define TG_LAYER_NORM(SUFFIX, D)                                                                                        \
  TG_KERNEL void __launch_bounds__(TG_THREADS)                                                                          \
      tg_ln_forward_##SUFFIX(const float* x, const D::T* delta, const float* w, const float* b, float* s_out, D::T* y, \
                             float* mean, float* rstd, long long cols, float eps, int rms) {                            \
    ln_forward<D>(x, delta, w, b, s_out, y, mean, rstd, cols, eps, rms);                                                \
  }                                                                                                                     \
  TG_KERNEL void __launch_bounds__(TG_THREADS)                                                                          \
      tg_ln_forward_warp_##SUFFIX(const float* x, const D::T* delta, const float* w, const float* b, float* s_out,      \
                                  D::T* y, float* mean, float* rstd, long long rows, long long cols, float eps, int rms) { \
    ln_forward_warp<D>(x, delta, w, b, s_out, y, mean, rstd, rows, cols, eps, rms);                                     \
  }                                                                                                                     \
  TG_KERNEL void __launch_bounds__(TG_THREADS)                                                                          \
      tg_ln_backward_##SUFFIX(const float* s, const float* w, const float* mean, const float* rstd, const D::T* dy,     \
                              const float* ds, float* dx, D::T* ddelta, long long cols, int rms) {                      \
    ln_backward<D>(s, w, mean, rstd, dy, ds, dx, ddelta, cols, rms);                                                    \
  }                                                                                                                     \
  TG_KERNEL void __launch_bounds__(TG_THREADS)                                                                          \
      tg_ln_backward_warp_##SUFFIX(const float* s, const float* w, const float* mean, const float* rstd, const D::T* dy,\
                                   const float* ds, float* dx, D::T* ddelta, float* partial, long long rows, long long cols,\
                                   int rms) {                                                                           \
    ln_backward_warp<D>(s, w, mean, rstd, dy, ds, dx, ddelta, partial, rows, cols, rms);                                \
  }                                                                                                                     \
  TG_KERNEL void __launch_bounds__(TG_THREADS) tg_ln_param_grads_##SUFFIX(                                             \
      const float* s, const float* mean, const float* rstd, const D::T* dy, float* partial, long long rows, long long cols, \
      long long band_rows) {                                                                                            \
    ln_param_grads<D>(s, mean, rstd, dy, partial, rows, cols, band_rows);                                               \
  }

TG_LAYER_NORM(f32, F32)
TG_LAYER_NORM(bf16, BF16)
TG_LAYER_NORM(f16, F16)

// Column tile blockIdx.x (32 columns, a lane each) of dw (blockIdx.y 0) or db (1; none where
// there is no bias): the parts in partial[band][0..cols) (dw's) and partial[band][cols..2·cols)
// (db's) added, warp q taking bands q, q + TG_WARPS, … in order, then the warps in order. fp32,
// as the parameters.
TG_KERNEL void __launch_bounds__(TG_THREADS) tg_ln_param_sum(const float* partial, float* dw, float* db, long long bands, long long cols) {
  __shared__ float part[TG_WARPS][32];
  float* out = blockIdx.y == 0 ? dw : db;
  if (out == nullptr) return;  // the whole block
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long col = static_cast<long long>(blockIdx.x) * 32 + lane;
  const long long n = col < cols && warp < bands ? (bands - warp + TG_WARPS - 1) / TG_WARPS : 0;
  const float* first = partial + (static_cast<long long>(blockIdx.y) + 2LL * warp) * cols + col;
  part[warp][lane] = n > 0 ? tg_ordered_sum(first, n, 2LL * TG_WARPS * cols) : 0.0f;
  __syncthreads();
  // threadIdx read afresh, so that no compiler splits the barrier above by a condition known
  // before it.
  if (threadIdx.x >= 32 || static_cast<long long>(blockIdx.x) * 32 + threadIdx.x >= cols) return;
  float total = 0.0f;
  for (int q = 0; q < TG_WARPS; ++q) total += part[q][threadIdx.x];
  out[static_cast<long long>(blockIdx.x) * 32 + threadIdx.x] = total;
}
