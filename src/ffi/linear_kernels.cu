// The linear node's kernels (`kernels.fused_linear`), compiled by NVRTC in one source after
// optim_kernels.cu (dtype loaders F32, BF16, F16; TG_THREADS, TG_WARPS), loss_kernels.cu,
// norm_kernels.cu and llama_kernels.cu. src/ffi/linear_kernels.cpp holds the autograd node.
//
// A bias's gradient is the column sum of the layer's output gradient dy [rows, cols] (rows = the
// micro-batch's tokens, 16,384 for GPT-2 at micro 16). ATen computes it in AddmmBackward with a
// general reduction over dimension 0 into the compute dtype, which autocast's cast then returns
// to fp32: GPT-2's 48 bias gradients a micro-step took 7 ms of a 152 ms step on an H200
// (BENCHMARKS.md, "GPU checks on an H200, second session"), where reading dy once takes about a
// third of that. Here each warp reads 64 consecutive columns of a row (two per lane: 128 bytes
// of bf16) down a band of rows, the block's warps every 8th row; the bands' fp32 sums are then
// added in band order into the fp32 gradient. Fixed order throughout: the same bits every run.

// Column tile blockIdx.x (64 columns, two per lane) of band blockIdx.y (`band_rows` rows): the
// band's column sums of dy, written to partial[band][0..cols).
template <class D>
__device__ __forceinline__ void col_sum_bands(const typename D::T* dy, float* partial, long long rows, long long cols, long long band_rows) {
  __shared__ float part[TG_WARPS][64];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long col = static_cast<long long>(blockIdx.x) * 64 + 2 * lane;
  const long long first = static_cast<long long>(blockIdx.y) * band_rows;
  const long long last = first + band_rows < rows ? first + band_rows : rows;
  float a0 = 0.0f, a1 = 0.0f;
  // TG_BATCH rows at a time (norm_kernels.cu): their loads in flight together, the sums in order.
  for (long long row0 = first + warp; row0 < last; row0 += TG_BATCH * TG_WARPS) {
    float v0[TG_BATCH], v1[TG_BATCH];
#pragma unroll
    for (int u = 0; u < TG_BATCH; ++u) {
      const long long row = row0 + u * TG_WARPS;
      v0[u] = row < last && col < cols ? D::load(dy, row * cols + col) : 0.0f;
      v1[u] = row < last && col + 1 < cols ? D::load(dy, row * cols + col + 1) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < TG_BATCH; ++u) {
      if (row0 + u * TG_WARPS < last) {
        a0 += v0[u];
        a1 += v1[u];
      }
    }
  }
  part[warp][2 * lane] = a0;
  part[warp][2 * lane + 1] = a1;
  __syncthreads();
  // Warps 0 and 1 (threads 0..63, a column each) add the warps' parts in warp order (threadIdx
  // read afresh, so that no compiler splits the barrier above by a condition known before it).
  const long long c = static_cast<long long>(blockIdx.x) * 64 + threadIdx.x;
  if (threadIdx.x >= 64 || c >= cols) return;
  float total = 0.0f;
  for (int k = 0; k < TG_WARPS; ++k) total += part[k][threadIdx.x];
  partial[static_cast<long long>(blockIdx.y) * cols + c] = total;
}

#define TG_COL_SUM(SUFFIX, D)                                                                                                  \
  TG_KERNEL void __launch_bounds__(TG_THREADS)                                                                                 \
      tg_col_sum_bands_##SUFFIX(const D::T* dy, float* partial, long long rows, long long cols, long long band_rows) {          \
    col_sum_bands<D>(dy, partial, rows, cols, band_rows);                                                                      \
  }

TG_COL_SUM(f32, F32)
TG_COL_SUM(bf16, BF16)
TG_COL_SUM(f16, F16)

// Column blockIdx.x · 256 + thread: the bands' sums added in band order into out (fp32).
TG_KERNEL void __launch_bounds__(TG_THREADS) tg_col_sum_finish(const float* partial, float* out, long long bands, long long cols) {
  const long long col = static_cast<long long>(blockIdx.x) * TG_THREADS + threadIdx.x;
  if (col >= cols) return;
  out[col] = tg_ordered_sum(partial + col, bands, cols);
}
