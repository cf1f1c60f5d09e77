// The optimizers' CUDA kernels of our own, compiled at run time by NVRTC (crates/trainguard-sys/cpp/cuda_jit.cpp),
// so that building trainguard needs no CUDA toolkit: the torch wheel ships libnvrtc. No #include:
// NVRTC compiles this without the CUDA headers, so bf16 and fp16 are converted by hand (the same
// rounding as c10's BFloat16 and Half: to nearest, ties to even). Two optimizers: 8-bit AdamW
// and Adafactor (below), each the counterpart of a CPU kernel in optim_kernels.cpp.
//
// 8-bit AdamW: the CPU kernel `adamw8bit_block` of optim_kernels.cpp, one CUDA block per block of
// 2048 values (one absmax scale each; src/optim/quant.rs has the codes). 256 threads take 8
// values each, coalesced. A block dequantises both moments, moves them, updates the parameter,
// finds the new absmax scales and requantises: every value is read and written once, in one
// launch per tensor, where the tensor-op path takes ~25 launches and four fp32 scratch buffers
// per run of blocks. Blocks own their scales, so they are independent. Compiled with
// --fmad=false, as the CPU kernel is built with -ffp-contract=off: both do the same IEEE float
// operations in the same order, so they give the same bits.

// Kernels are declared TG_KERNEL: extern "C" __global__ for NVRTC; crates/trainguard-sys/cpp/cuda_emulation.cpp,
// which compiles this same source for the host so that CI can run it, defines its own.
#ifndef TG_KERNEL
#define TG_KERNEL extern "C" __global__
#endif

#define TG_BLOCK 2048
#define TG_THREADS 256
#define TG_PER_THREAD (TG_BLOCK / TG_THREADS)
#define TG_WARPS (TG_THREADS / 32)

struct F32 {
  typedef float T;
  static __device__ __forceinline__ float load(const float* x, long long i) { return x[i]; }
  static __device__ __forceinline__ void store(float* x, long long i, float v) { x[i] = v; }
};

struct BF16 {
  typedef unsigned short T;
  static __device__ __forceinline__ float load(const unsigned short* x, long long i) {
    return __uint_as_float(static_cast<unsigned int>(x[i]) << 16);
  }
  static __device__ __forceinline__ void store(unsigned short* x, long long i, float v) {
    unsigned int u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      x[i] = 0x7fc0;  // NaN
      return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    x[i] = static_cast<unsigned short>(u >> 16);
  }
};

#ifndef TG_HOST_EMULATION  // the host emulation brings its own conversions (through c10::Half)
__device__ __forceinline__ float tg_half_to_float(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ unsigned short tg_float_to_half(float v) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}
#endif

struct F16 {
  typedef unsigned short T;
  static __device__ __forceinline__ float load(const unsigned short* x, long long i) { return tg_half_to_float(x[i]); }
  static __device__ __forceinline__ void store(unsigned short* x, long long i, float v) { x[i] = tg_float_to_half(v); }
};

// ATen's scalar lerp: self + w·(end − self) for w < ½, else end − (end − self)·(1 − w).
__device__ __forceinline__ float tg_lerp(float self, float end, float w) {
  return w < 0.5f ? self + w * (end - self) : end - (end - self) * (1.0f - w);
}

// The largest of each thread's `bits` in the CUDA block (non-negative floats order as their bit
// patterns). Every thread gets the result.
__device__ __forceinline__ unsigned int block_max(unsigned int bits, unsigned int* shared) {
  for (int s = 16; s > 0; s >>= 1) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, s));
  if ((threadIdx.x & 31) == 0) shared[threadIdx.x >> 5] = bits;
  __syncthreads();
  unsigned int top = 0;
  for (int w = 0; w < TG_WARPS; ++w) top = max(top, shared[w]);
  return top;
}

template <class D>
__device__ __forceinline__ void adamw8bit(typename D::T* p, const typename D::T* g, signed char* qm, float* am,
                                          unsigned char* qv, float* av, long long n, float w1, float w2,
                                          float shrink, float scale, float shift, int apply) {
  __shared__ unsigned int top_m_warp[TG_WARPS], top_v_warp[TG_WARPS];
  const long long off = static_cast<long long>(blockIdx.x) * TG_BLOCK;
  const long long rest = n - off;
  const int len = rest < TG_BLOCK ? static_cast<int>(rest) : TG_BLOCK;
  // quant::dequantise_signed / _unsigned: m = q·|q|·A/127², v = (q/255)⁴·A. Every thread reads
  // the old scales before the block_max barriers; thread 0 writes the new ones after them.
  const float a_m = am[blockIdx.x] * (1.0f / 16129.0f), a_v = av[blockIdx.x];
  float m[TG_PER_THREAD], v[TG_PER_THREAD];
  unsigned int top_m = 0, top_v = 0;
#pragma unroll
  for (int j = 0; j < TG_PER_THREAD; ++j) {
    const int i = j * TG_THREADS + threadIdx.x;
    m[j] = 0.0f;
    v[j] = 0.0f;
    if (i < len) {
      const float q = static_cast<float>(qm[off + i]);
      float c = static_cast<float>(qv[off + i]) * (1.0f / 255.0f);
      c = c * c;
      const float gi = D::load(g, off + i);
      m[j] = tg_lerp(q * fabsf(q) * a_m, gi, w1);
      v[j] = tg_lerp(c * c * a_v, gi * gi, w2);
      top_m = max(top_m, __float_as_uint(m[j]) & 0x7fffffffu);
      top_v = max(top_v, __float_as_uint(v[j]) & 0x7fffffffu);
    }
  }
  if (apply) {
#pragma unroll
    for (int j = 0; j < TG_PER_THREAD; ++j) {
      const int i = j * TG_THREADS + threadIdx.x;
      if (i < len) D::store(p, off + i, D::load(p, off + i) * shrink + m[j] / (sqrtf(v[j]) * scale + shift));
    }
  }
  // quant::quantise_signed / _unsigned with the new absmax A (floored at 1e-30):
  // round(127·sign(m)·√(|m|/A)), round(255·⁴√(v/A)); rintf rounds half to even, as at::round.
  // As the CPU's std::max(top, 1e-30): a NaN maximum stays NaN (fmaxf would drop it).
  const float top_m_f = __uint_as_float(block_max(top_m, top_m_warp)), top_v_f = __uint_as_float(block_max(top_v, top_v_warp));
  const float new_m = top_m_f < 1e-30f ? 1e-30f : top_m_f, new_v = top_v_f < 1e-30f ? 1e-30f : top_v_f;
  const float inv_m = 1.0f / new_m, inv_v = 1.0f / new_v;
#pragma unroll
  for (int j = 0; j < TG_PER_THREAD; ++j) {
    const int i = j * TG_THREADS + threadIdx.x;
    if (i < len) {
      const float code_m = sqrtf(fabsf(m[j]) * inv_m) * 127.0f;
      qm[off + i] = static_cast<signed char>(static_cast<int>(rintf(m[j] < 0.0f ? -code_m : code_m)));
      qv[off + i] = static_cast<unsigned char>(static_cast<int>(rintf(sqrtf(sqrtf(v[j] * inv_v)) * 255.0f)));
    }
  }
  if (threadIdx.x == 0) {
    am[blockIdx.x] = new_m;
    av[blockIdx.x] = new_v;
  }
}

#define TG_ADAMW8BIT(NAME, D)                                                                              \
  TG_KERNEL void __launch_bounds__(TG_THREADS)                                                             \
      NAME(D::T* p, const D::T* g, signed char* qm, float* am, unsigned char* qv, float* av, long long n,  \
           float w1, float w2, float shrink, float scale, float shift, int apply) {                        \
    adamw8bit<D>(p, g, qm, am, qv, av, n, w1, w2, shrink, scale, shift, apply);                             \
  }

TG_ADAMW8BIT(tg_adamw8bit_f32, F32)
TG_ADAMW8BIT(tg_adamw8bit_bf16, BF16)
TG_ADAMW8BIT(tg_adamw8bit_f16, F16)

// Adafactor: the CPU kernel `adafactor` of optim_kernels.cpp as a chain of launches on one stream
// (src/optim/adafactor.rs has the maths). The work is cut into units: a row of a matrix, or a run
// of TG_BLOCK values of anything else, one CUDA block each. Sums are taken in double, as on the
// CPU, over a partition fixed by the shapes alone (per-unit sums, then one block adding those in
// a fixed tree), so a step gives the same bits every time it runs; they can differ from the
// CPU's in the last place of a double, since the CPU adds in another order. Nothing crosses to
// the host: the scalars one launch hands to the next (α, the row normaliser, the update's
// coefficient) stay in the workspace, a buffer of doubles the optimizer allocates once:
//   [0, 4)                        the scalars (TG_WS_*)
//   [4, 4 + units)                a sum per unit: Σp², later Σu²
//   [4 + rows, … + bands·cols)    a matrix's column sums of g², per band of rows
// Launches: rows → (cols → col_var) → scale → usq → coef → apply; five for a vector, seven for a
// matrix, where the tensor-op path takes ~20.

#define TG_WS_ALPHA 0
#define TG_WS_ROW_SCALE 1
#define TG_WS_COEF 2
#define TG_WS_UNITS 4

// std::max's choice (the first unless the second is larger), so a NaN picks as on the CPU.
__device__ __forceinline__ float tg_max(float a, float b) { return a < b ? b : a; }
__device__ __forceinline__ double tg_max(double a, double b) { return a < b ? b : a; }

// The sum of every thread's `x` in the CUDA block, in a fixed order: a butterfly within each warp
// (pairs add commutatively, so all lanes agree), then the warps in order. Every thread gets it.
__device__ __forceinline__ double block_sum(double x, double* shared) {
  for (int s = 16; s > 0; s >>= 1) x += __shfl_xor_sync(0xffffffffu, x, s);
  if ((threadIdx.x & 31) == 0) shared[threadIdx.x >> 5] = x;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < TG_WARPS; ++w) total += shared[w];
  __syncthreads();  // `shared` is free again for the next call
  return total;
}

// The values of unit `blockIdx.x`: [begin, begin + len).
__device__ __forceinline__ void tg_unit(long long n, long long cols, int factored, long long* begin, long long* len) {
  const long long u = blockIdx.x;
  if (factored) {
    *begin = u * cols;
    *len = cols;
  } else {
    *begin = u * TG_BLOCK;
    *len = n - *begin < TG_BLOCK ? n - *begin : TG_BLOCK;
  }
}

// u = g / √max(row_factor·second, eps1²), in float as the CPU's update_value.
__device__ __forceinline__ float tg_update(float g, float second, float row_factor, float eps1_sq) {
  return g / sqrtf(tg_max(row_factor * second, eps1_sq));
}

// Per unit: Σp² into the workspace, and the second moment moved towards g² (a matrix's row mean
// of g², or each value's g²).
template <class D>
__device__ __forceinline__ void adafactor_rows(const typename D::T* p, const typename D::T* g, typename D::T* second, double* ws,
                                               long long n, long long cols, int factored, float w) {
  __shared__ double partial[TG_WARPS];
  long long begin, len;
  tg_unit(n, cols, factored, &begin, &len);
  double pp = 0.0, gg = 0.0;
  for (long long i = threadIdx.x; i < len; i += TG_THREADS) {
    const double x = D::load(p, begin + i);
    pp += x * x;
    const float gi = D::load(g, begin + i);
    if (factored) {
      const double gd = gi;
      gg += gd * gd;
    } else {
      D::store(second, begin + i, tg_lerp(D::load(second, begin + i), gi * gi, w));
    }
  }
  const double sum_p = block_sum(pp, partial);
  const double sum_g = block_sum(gg, partial);
  if (threadIdx.x == 0) {
    ws[TG_WS_UNITS + blockIdx.x] = sum_p;
    if (factored) D::store(second, blockIdx.x, tg_lerp(D::load(second, blockIdx.x), static_cast<float>(sum_g / static_cast<double>(cols)), w));
  }
}

// A matrix's Σg² down each column over band blockIdx.y of `bands` runs of rows: a thread per
// column, so neighbouring threads read neighbouring values.
template <class D>
__device__ __forceinline__ void adafactor_cols(const typename D::T* g, double* ws, long long rows, long long cols, long long bands) {
  const long long c = static_cast<long long>(blockIdx.x) * TG_THREADS + threadIdx.x;
  if (c >= cols) return;
  const long long band = blockIdx.y, r0 = band * rows / bands, r1 = (band + 1) * rows / bands;
  double acc = 0.0;
  for (long long r = r0; r < r1; ++r) {
    const double v = D::load(g, r * cols + c);
    acc += v * v;
  }
  ws[TG_WS_UNITS + rows + band * cols + c] = acc;
}

// The column means of g² from the bands' sums (in band order), into the running column means.
template <class D>
__device__ __forceinline__ void adafactor_col_var(typename D::T* col_var, const double* ws, long long rows, long long cols, long long bands, float w) {
  const long long c = static_cast<long long>(blockIdx.x) * TG_THREADS + threadIdx.x;
  if (c >= cols) return;
  double acc = 0.0;
  for (long long b = 0; b < bands; ++b) acc += ws[TG_WS_UNITS + rows + b * cols + c];
  D::store(col_var, c, tg_lerp(D::load(col_var, c), static_cast<float>(acc / static_cast<double>(rows)), w));
}

// One block: α = max(eps2, RMS(p))·ρ and, for a matrix, the row normaliser 1 / max(mean(row_var), eps1).
template <class D>
__device__ __forceinline__ void adafactor_scale(const typename D::T* row_var, double* ws, long long units, long long n, long long rows,
                                                int factored, float eps2, float rho, float eps1_sq) {
  __shared__ double partial[TG_WARPS];
  double s = 0.0, r = 0.0;
  for (long long i = threadIdx.x; i < units; i += TG_THREADS) s += ws[TG_WS_UNITS + i];
  if (factored) {
    for (long long i = threadIdx.x; i < rows; i += TG_THREADS) r += static_cast<double>(D::load(row_var, i));
  }
  const double sum_p = block_sum(s, partial);
  const double row_sum = block_sum(r, partial);
  if (threadIdx.x == 0) {
    const double rms_p = sqrt(sum_p / static_cast<double>(n));
    ws[TG_WS_ALPHA] = static_cast<float>(tg_max(static_cast<double>(eps2), rms_p) * static_cast<double>(rho));
    ws[TG_WS_ROW_SCALE] = factored ? 1.0f / tg_max(static_cast<float>(row_sum / static_cast<double>(rows)), sqrtf(eps1_sq)) : 1.0f;
  }
}

// Per unit: Σu² into the workspace (Σp² there has been read by adafactor_scale).
template <class D>
__device__ __forceinline__ void adafactor_usq(const typename D::T* g, const typename D::T* second, const typename D::T* row_var, double* ws,
                                              long long n, long long cols, int factored, float eps1_sq) {
  __shared__ double partial[TG_WARPS];
  long long begin, len;
  tg_unit(n, cols, factored, &begin, &len);
  const float row_factor = factored ? D::load(row_var, blockIdx.x) * static_cast<float>(ws[TG_WS_ROW_SCALE]) : 1.0f;
  const long long at = factored ? 0 : begin;  // a matrix's second moment is indexed by column
  double acc = 0.0;
  for (long long i = threadIdx.x; i < len; i += TG_THREADS) {
    const double u = tg_update(D::load(g, begin + i), D::load(second, at + i), row_factor, eps1_sq);
    acc += u * u;
  }
  const double sum = block_sum(acc, partial);
  if (threadIdx.x == 0) ws[TG_WS_UNITS + blockIdx.x] = sum;
}

// p ← p·shrink + coef·u, coef = −α / max(1, RMS(u)/d).
template <class D>
__device__ __forceinline__ void adafactor_apply(typename D::T* p, const typename D::T* g, const typename D::T* second,
                                                const typename D::T* row_var, const double* ws, long long n, long long cols,
                                                int factored, float eps1_sq, float shrink) {
  long long begin, len;
  tg_unit(n, cols, factored, &begin, &len);
  const float row_factor = factored ? D::load(row_var, blockIdx.x) * static_cast<float>(ws[TG_WS_ROW_SCALE]) : 1.0f;
  const float coef = static_cast<float>(ws[TG_WS_COEF]);
  const long long at = factored ? 0 : begin;
  for (long long i = threadIdx.x; i < len; i += TG_THREADS) {
    const float u = tg_update(D::load(g, begin + i), D::load(second, at + i), row_factor, eps1_sq);
    D::store(p, begin + i, D::load(p, begin + i) * shrink + coef * u);
  }
}

// One block: the update's coefficient from the units' Σu² (dtype-free: one kernel for all).
TG_KERNEL void __launch_bounds__(TG_THREADS) tg_adafactor_coef(double* ws, long long units, long long n, float d) {
  __shared__ double partial[TG_WARPS];
  double s = 0.0;
  for (long long i = threadIdx.x; i < units; i += TG_THREADS) s += ws[TG_WS_UNITS + i];
  const double sum_u = block_sum(s, partial);
  if (threadIdx.x == 0) {
    const double rms_u = sqrt(sum_u / static_cast<double>(n));
    ws[TG_WS_COEF] = -static_cast<float>(ws[TG_WS_ALPHA]) / static_cast<float>(tg_max(1.0, rms_u / static_cast<double>(d)));
  }
}

#define TG_ADAFACTOR(SUFFIX, D)                                                                                          \
  TG_KERNEL void __launch_bounds__(TG_THREADS)                                                                           \
      tg_adafactor_rows_##SUFFIX(const D::T* p, const D::T* g, D::T* second, double* ws, long long n, long long cols,    \
                                 int factored, float w) {                                                                \
    adafactor_rows<D>(p, g, second, ws, n, cols, factored, w);                                                           \
  }                                                                                                                      \
  TG_KERNEL void __launch_bounds__(TG_THREADS)                                                                           \
      tg_adafactor_cols_##SUFFIX(const D::T* g, double* ws, long long rows, long long cols, long long bands) {           \
    adafactor_cols<D>(g, ws, rows, cols, bands);                                                                         \
  }                                                                                                                      \
  TG_KERNEL void __launch_bounds__(TG_THREADS)                                                                           \
      tg_adafactor_col_var_##SUFFIX(D::T* col_var, const double* ws, long long rows, long long cols, long long bands,    \
                                    float w) {                                                                           \
    adafactor_col_var<D>(col_var, ws, rows, cols, bands, w);                                                             \
  }                                                                                                                      \
  TG_KERNEL void __launch_bounds__(TG_THREADS)                                                                           \
      tg_adafactor_scale_##SUFFIX(const D::T* row_var, double* ws, long long units, long long n, long long rows,         \
                                  int factored, float eps2, float rho, float eps1_sq) {                                  \
    adafactor_scale<D>(row_var, ws, units, n, rows, factored, eps2, rho, eps1_sq);                                       \
  }                                                                                                                      \
  TG_KERNEL void __launch_bounds__(TG_THREADS)                                                                           \
      tg_adafactor_usq_##SUFFIX(const D::T* g, const D::T* second, const D::T* row_var, double* ws, long long n,         \
                                long long cols, int factored, float eps1_sq) {                                           \
    adafactor_usq<D>(g, second, row_var, ws, n, cols, factored, eps1_sq);                                                \
  }                                                                                                                      \
  TG_KERNEL void __launch_bounds__(TG_THREADS)                                                                           \
      tg_adafactor_apply_##SUFFIX(D::T* p, const D::T* g, const D::T* second, const D::T* row_var, const double* ws,     \
                                  long long n, long long cols, int factored, float eps1_sq, float shrink) {              \
    adafactor_apply<D>(p, g, second, row_var, ws, n, cols, factored, eps1_sq, shrink);                                   \
  }

TG_ADAFACTOR(f32, F32)
TG_ADAFACTOR(bf16, BF16)
TG_ADAFACTOR(f16, F16)
