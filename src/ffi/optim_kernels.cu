// The optimizers' CUDA kernels of our own, compiled at run time by NVRTC (src/ffi/cuda_jit.cpp),
// so that building trainguard needs no CUDA toolkit: the torch wheel ships libnvrtc. No #include:
// NVRTC compiles this without the CUDA headers, so bf16 and fp16 are converted by hand (the same
// rounding as c10's BFloat16 and Half: to nearest, ties to even).
//
// 8-bit AdamW: the CPU kernel `adamw8bit_block` of optim_kernels.cpp, one CUDA block per block of
// 2048 values (one absmax scale each; src/optim/quant.rs has the codes). 256 threads take 8
// values each, coalesced. A block dequantises both moments, moves them, updates the parameter,
// finds the new absmax scales and requantises: every value is read and written once, in one
// launch per tensor, where the tensor-op path takes ~25 launches and four fp32 scratch buffers
// per run of blocks. Blocks own their scales, so they are independent. Compiled with
// --fmad=false, as the CPU kernel is built with -ffp-contract=off: both do the same IEEE float
// operations in the same order, so they give the same bits.

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

struct F16 {
  typedef unsigned short T;
  static __device__ __forceinline__ float load(const unsigned short* x, long long i) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x[i]));
    return f;
  }
  static __device__ __forceinline__ void store(unsigned short* x, long long i, float v) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    x[i] = h;
  }
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
  extern "C" __global__ void __launch_bounds__(TG_THREADS)                                                 \
      NAME(D::T* p, const D::T* g, signed char* qm, float* am, unsigned char* qv, float* av, long long n,  \
           float w1, float w2, float shrink, float scale, float shift, int apply) {                        \
    adamw8bit<D>(p, g, qm, am, qv, av, n, w1, w2, shrink, scale, shift, apply);                             \
  }

TG_ADAMW8BIT(tg_adamw8bit_f32, F32)
TG_ADAMW8BIT(tg_adamw8bit_bf16, BF16)
TG_ADAMW8BIT(tg_adamw8bit_f16, F16)
