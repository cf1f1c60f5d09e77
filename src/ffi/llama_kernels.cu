// The Llama block's elementwise kernels of our own, compiled by NVRTC in one source after
// optim_kernels.cu (dtype loaders, TG_THREADS, TG_PER_THREAD), loss_kernels.cu (TgPack) and
// norm_kernels.cu. src/ffi/llama_kernels.cpp holds the autograd nodes that launch them.
//
// SwiGLU (`kernels.fused_swiglu`): h = silu(g) · u elementwise, in the inputs' dtype, computed
// in fp32 and rounded once. ATen runs silu (reads g, writes silu(g)) and a multiply (reads both,
// writes h), and keeps silu(g) for backward; backward it runs two multiplies and silu's
// backward, each a pass over f-wide tensors. Here forward reads g and u and writes h; backward
// reads h's gradient, g and u and writes g's and u's gradients: 8 passes where ATen makes 14,
// and silu(g) is not kept. Each thread takes 8 consecutive values (a block 2048); where all of
// a thread's tensors start on 16 bytes and the count is a multiple of 8, it moves them in
// 16-byte packs (one for 16-bit values, two for fp32).
//
// RoPE (`kernels.fused_rope`): the "rotate half" rotation of q or k by position, on the
// projection's output [rows = b·t, heads·d] as it comes (before the heads are split), in fp32
// from the fp32 cos and sin tables, rounded once. ATen (as `transformers`) casts the tables to
// the compute dtype, then multiplies, negates, concatenates, multiplies and adds, rounding at
// each step; backward as many passes again. Here one pass each way.

// silu(g) and its derivative's factor: with σ = 1 / (1 + e^−g), silu = g·σ and
// silu' = σ·(1 + g·(1 − σ)), as ATen's silu_backward.
__device__ __forceinline__ float tg_sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

// Whether `count` values from p on (and every pointer alike) can be moved in packs.
__device__ __forceinline__ bool tg_packs_fit(const void* p, long long count) {
  return tg_on_16_bytes(p) && count % TG_PER_THREAD == 0;
}

// The 8 values of type D from `p` + `first` into v: in packs when `packed`.
template <class D>
__device__ __forceinline__ void tg_load8(const typename D::T* p, long long first, bool packed, long long n, float* v) {
  if (packed) {
    constexpr int per_pack = 16 / sizeof(typename D::T);
    for (int q = 0; q < TG_PER_THREAD / per_pack; ++q) {
      TgPack pack;
      pack.bits = reinterpret_cast<const uint4*>(p + first)[q];
      const typename D::T* values = tg_pack_values(pack, static_cast<typename D::T*>(nullptr));
      for (int k = 0; k < per_pack; ++k) v[q * per_pack + k] = D::load(values, k);
    }
  } else {
    for (int k = 0; k < TG_PER_THREAD; ++k) v[k] = first + k < n ? D::load(p, first + k) : 0.0f;
  }
}

template <class D>
__device__ __forceinline__ void tg_store8(typename D::T* p, long long first, bool packed, long long n, const float* v) {
  if (packed) {
    constexpr int per_pack = 16 / sizeof(typename D::T);
    for (int q = 0; q < TG_PER_THREAD / per_pack; ++q) {
      TgPack pack;
      typename D::T* values = tg_pack_values(pack, static_cast<typename D::T*>(nullptr));
      for (int k = 0; k < per_pack; ++k) D::store(values, k, v[q * per_pack + k]);
      reinterpret_cast<uint4*>(p + first)[q] = pack.bits;
    }
  } else {
    for (int k = 0; k < TG_PER_THREAD; ++k) {
      if (first + k < n) D::store(p, first + k, v[k]);
    }
  }
}

// h[i] = silu(g[i]) · u[i] for i < n.
template <class D>
__device__ __forceinline__ void swiglu_forward(const typename D::T* g, const typename D::T* u, typename D::T* h, long long n) {
  const long long first = (static_cast<long long>(blockIdx.x) * TG_THREADS + threadIdx.x) * TG_PER_THREAD;
  if (first >= n) return;
  const bool packed = tg_packs_fit(g, n) && tg_packs_fit(u, n) && tg_packs_fit(h, n);
  float gv[TG_PER_THREAD], uv[TG_PER_THREAD], hv[TG_PER_THREAD];
  tg_load8<D>(g, first, packed, n, gv);
  tg_load8<D>(u, first, packed, n, uv);
  for (int k = 0; k < TG_PER_THREAD; ++k) hv[k] = gv[k] * tg_sigmoid(gv[k]) * uv[k];
  tg_store8<D>(h, first, packed, n, hv);
}

// From h's gradient dh: dg = dh · u · silu'(g), du = dh · silu(g).
template <class D>
__device__ __forceinline__ void swiglu_backward(const typename D::T* dh, const typename D::T* g, const typename D::T* u, typename D::T* dg,
                                                typename D::T* du, long long n) {
  const long long first = (static_cast<long long>(blockIdx.x) * TG_THREADS + threadIdx.x) * TG_PER_THREAD;
  if (first >= n) return;
  const bool packed = tg_packs_fit(dh, n) && tg_packs_fit(g, n) && tg_packs_fit(u, n) && tg_packs_fit(dg, n) && tg_packs_fit(du, n);
  float dhv[TG_PER_THREAD], gv[TG_PER_THREAD], uv[TG_PER_THREAD], dgv[TG_PER_THREAD], duv[TG_PER_THREAD];
  tg_load8<D>(dh, first, packed, n, dhv);
  tg_load8<D>(g, first, packed, n, gv);
  tg_load8<D>(u, first, packed, n, uv);
  for (int k = 0; k < TG_PER_THREAD; ++k) {
    const float sig = tg_sigmoid(gv[k]);
    duv[k] = dhv[k] * (gv[k] * sig);
    dgv[k] = dhv[k] * uv[k] * (sig * (1.0f + gv[k] * (1.0f - sig)));
  }
  tg_store8<D>(dg, first, packed, n, dgv);
  tg_store8<D>(du, first, packed, n, duv);
}

#define TG_SWIGLU(SUFFIX, D)                                                                                               \
  TG_KERNEL void __launch_bounds__(TG_THREADS) tg_swiglu_forward_##SUFFIX(const D::T* g, const D::T* u, D::T* h, long long n) { \
    swiglu_forward<D>(g, u, h, n);                                                                                          \
  }                                                                                                                         \
  TG_KERNEL void __launch_bounds__(TG_THREADS) tg_swiglu_backward_##SUFFIX(const D::T* dh, const D::T* g, const D::T* u,    \
                                                                          D::T* dg, D::T* du, long long n) {               \
    swiglu_backward<D>(dh, g, u, dg, du, n);                                                                                \
  }

TG_SWIGLU(f32, F32)
TG_SWIGLU(bf16, BF16)
TG_SWIGLU(f16, F16)

// Pair (i, i + d/2) of head `head` in row `row` (position row mod t) of x [rows, heads·d]:
// out_i = x_i·cos_i − x_{i+d/2}·sin_i, out_{i+d/2} = x_{i+d/2}·cos_{i+d/2} + x_i·sin_{i+d/2}.
// Backward is the transposed rotation: dx_i = dy_i·cos_i + dy_{i+d/2}·sin_{i+d/2},
// dx_{i+d/2} = dy_{i+d/2}·cos_{i+d/2} − dy_i·sin_i. One thread a pair.
template <class D>
__device__ __forceinline__ void rope(const typename D::T* x, const float* cos, const float* sin, typename D::T* out, long long rows, long long t,
                                     long long heads, long long d, int backward) {
  const long long half = d / 2, pairs_per_row = heads * half;
  const long long p = static_cast<long long>(blockIdx.x) * TG_THREADS + threadIdx.x;
  if (p >= rows * pairs_per_row) return;
  const long long row = p / pairs_per_row, within = p % pairs_per_row;
  const long long head = within / half, i = within % half;
  const long long at = row * heads * d + head * d + i;
  const long long table = (row % t) * d + i;
  const float a = D::load(x, at), b = D::load(x, at + half);
  const float c1 = cos[table], s1 = sin[table], c2 = cos[table + half], s2 = sin[table + half];
  if (backward) {
    D::store(out, at, a * c1 + b * s2);
    D::store(out, at + half, b * c2 - a * s1);
  } else {
    D::store(out, at, a * c1 - b * s1);
    D::store(out, at + half, b * c2 + a * s2);
  }
}

#define TG_ROPE(SUFFIX, D)                                                                                              \
  TG_KERNEL void __launch_bounds__(TG_THREADS) tg_rope_##SUFFIX(const D::T* x, const float* cos, const float* sin, D::T* out, \
                                                                long long rows, long long t, long long heads, long long d,  \
                                                                int backward) {                                             \
    rope<D>(x, cos, sin, out, rows, t, heads, d, backward);                                                                 \
  }

TG_ROPE(f32, F32)
TG_ROPE(bf16, BF16)
TG_ROPE(f16, F16)
