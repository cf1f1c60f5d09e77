// The linear node's kernels (`kernels.fused_linear`), compiled by NVRTC in one source after
// optim_kernels.cu (dtype loaders F32, BF16, F16; TG_THREADS, TG_WARPS), loss_kernels.cu,
// norm_kernels.cu and llama_kernels.cu. crates/trainguard-sys/cpp/linear_kernels.cpp holds the autograd node.
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

// The same band sums with a lane's 8 consecutive columns read at once (`tg_load_raw8`: a 16-byte
// pack of a 16-bit dtype, two of fp32), 256 columns a block: for rows of a multiple of 8 values
// that start on 16 bytes. A warp's 32 lanes then load 512 bytes of a bf16 row per instruction,
// where col_sum_bands loads 128 in two-byte pieces. The block's warps take the same rows in the
// same order as col_sum_bands, so each column's sum is the same, bit for bit. What is summed is
// the `Values` policy's: `load` brings in 8 values' inputs from element i on, `value` turns them
// into the 8 values added (and may store something of its own, as the GELU gradient below).
// Rows a lane loads before it adds the first. The policies load raw packs (TgRaw8) and convert
// them in `value`: converted as loaded, ptxas (sm_90) waited for each row's load before issuing
// the next row's, and the batch was never in flight at once.
#define TG_PACKED_BATCH 8
template <class Values>
__device__ __forceinline__ void col_sum_bands_packed(const Values& values, float* partial, long long rows, long long cols, long long band_rows) {
  __shared__ float part[TG_WARPS][256];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long col = static_cast<long long>(blockIdx.x) * 256 + 8 * lane;
  const long long first = static_cast<long long>(blockIdx.y) * band_rows;
  const long long last = first + band_rows < rows ? first + band_rows : rows;
  const bool lane_in = col < cols;  // cols is a multiple of 8: a lane's pack is all in or all out
  float a[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) a[k] = 0.0f;
  for (long long row0 = first + warp; row0 < last; row0 += TG_PACKED_BATCH * TG_WARPS) {
    typename Values::Loaded in[TG_PACKED_BATCH];
#pragma unroll
    for (int u = 0; u < TG_PACKED_BATCH; ++u) {
      const long long row = row0 + u * TG_WARPS;
      if (lane_in && row < last) values.load(row * cols + col, in[u]);
    }
#pragma unroll
    for (int u = 0; u < TG_PACKED_BATCH; ++u) {
      const long long row = row0 + u * TG_WARPS;
      if (lane_in && row < last) {
        float v[8];
        values.value(row * cols + col, in[u], v);
#pragma unroll
        for (int k = 0; k < 8; ++k) a[k] += v[k];
      }
    }
  }
  if (partial == nullptr) return;  // the whole block: only the policy's own output was wanted
#pragma unroll
  for (int k = 0; k < 8; ++k) part[warp][8 * lane + k] = a[k];
  __syncthreads();
  // Each thread a column: the warps' parts added in warp order (threadIdx read afresh, as above).
  const long long c = static_cast<long long>(blockIdx.x) * 256 + threadIdx.x;
  if (c >= cols) return;
  float total = 0.0f;
  for (int k = 0; k < TG_WARPS; ++k) total += part[k][threadIdx.x];
  partial[static_cast<long long>(blockIdx.y) * cols + c] = total;
}

// The packed sums' policy for a bias's gradient: dy's values as they are.
template <class D>
struct TgColumnValues {
  const typename D::T* dy;
  struct Loaded {
    TgRaw8<D> dy;
  };
  __device__ __forceinline__ void load(long long i, Loaded& in) const { tg_load_raw8<D>(dy, i, in.dy); }
  __device__ __forceinline__ void value(long long, Loaded& in, float* v) const { tg_unpack8<D>(in.dy, v); }
};

// GELU's derivative at h (GELU(h) = h·Φ(h), without the tanh approximation), ATen's
// gelu_backward's formula and constants: Φ(h) + h·φ(h), in fp32. ATen's nvcc build may fuse a
// multiply-add that NVRTC (--fmad=false) does not: the last bit may differ.
__device__ __forceinline__ float tg_gelu_grad(float h) {
  const float cdf = 0.5f * (1.0f + erff(h * 0.70710678118654752440f));   // 1/√2
  const float pdf = expf(-0.5f * h * h) * 0.39894228040143267794f;       // 1/√(2π)
  return cdf + h * pdf;
}

// The packed sums' policy for the linear-GELU node: dh = da · GELU'(h) in fp32, rounded to D and
// stored; the rounded values are what the bias's gradient sums (the column sums of dh as stored).
template <class D>
struct TgGeluGradValues {
  const typename D::T* da;
  const typename D::T* h;
  typename D::T* dh;
  struct Loaded {
    TgRaw8<D> da, h;
  };
  __device__ __forceinline__ void load(long long i, Loaded& in) const {
    tg_load_raw8<D>(da, i, in.da);
    tg_load_raw8<D>(h, i, in.h);
  }
  __device__ __forceinline__ void value(long long i, Loaded& in, float* v) const {
    float a[8], x[8], g[8];
    tg_unpack8<D>(in.da, a);
    tg_unpack8<D>(in.h, x);
#pragma unroll
    for (int k = 0; k < 8; ++k) g[k] = a[k] * tg_gelu_grad(x[k]);
    tg_store8<D>(dh, i, true, 0, g, TgRows{1, 1});
#pragma unroll
    for (int k = 0; k < 8; ++k) {  // each as stored: rounded to D
      typename D::T rounded;
      D::store(&rounded, 0, g[k]);
      v[k] = D::load(&rounded, 0);
    }
  }
};

// Packed column tile blockIdx.x of band blockIdx.y: `tg_col_sum_bands_*`'s sums, read 8 columns
// a lane; `tg_gelu_backward_bands_*`: dh from da and h, and (partial not null) its band sums.
#define TG_COL_SUM_PACKED(SUFFIX, D)                                                                                      \
  TG_KERNEL void __launch_bounds__(TG_THREADS)                                                                            \
      tg_col_sum_bands_packed_##SUFFIX(const D::T* dy, float* partial, long long rows, long long cols, long long band_rows) { \
    col_sum_bands_packed(TgColumnValues<D>{dy}, partial, rows, cols, band_rows);                                          \
  }                                                                                                                       \
  TG_KERNEL void __launch_bounds__(TG_THREADS) tg_gelu_backward_bands_##SUFFIX(                                           \
      const D::T* da, const D::T* h, D::T* dh, float* partial, long long rows, long long cols, long long band_rows) {     \
    col_sum_bands_packed(TgGeluGradValues<D>{da, h, dh}, partial, rows, cols, band_rows);                                 \
  }

TG_COL_SUM_PACKED(f32, F32)
TG_COL_SUM_PACKED(bf16, BF16)
TG_COL_SUM_PACKED(f16, F16)
