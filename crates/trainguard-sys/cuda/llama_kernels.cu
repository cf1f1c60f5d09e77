// The Llama block's elementwise kernels of our own, compiled by NVRTC in one source after
// optim_kernels.cu (dtype loaders, TG_THREADS, TG_PER_THREAD), loss_kernels.cu (TgPack) and
// norm_kernels.cu. crates/trainguard-sys/cpp/llama_kernels.cpp holds the autograd nodes that launch them.
//
// SwiGLU (`kernels.fused_swiglu`): h = silu(g) · u elementwise, in the inputs' dtype, computed
// in fp32 and rounded once. ATen runs silu (reads g, writes silu(g)) and a multiply (reads both,
// writes h), and keeps silu(g) for backward; backward it runs two multiplies and silu's
// backward, each a pass over f-wide tensors. Here forward reads g and u and writes h; backward
// reads h's gradient, g and u and writes g's and u's gradients: 8 passes where ATen makes 14,
// and silu(g) is not kept. Each thread takes 8 consecutive values (a block 2048); where all of
// a thread's tensors start on 16 bytes and the count is a multiple of 8, it moves them in
// 16-byte packs (one for 16-bit values, two for fp32). g and u (and their gradients) may be the
// two halves of one joint [rows, 2·cols] tensor (`kernels.merged_projections`: gate and up as
// one matrix multiplication): they are then read (and written) `cols` values a row, `stride`
// apart; h and dh are [rows, cols]. Separate tensors are one row of n.
//
// RoPE (`kernels.fused_rope`): the "rotate half" rotation of q or k by position, on the
// projection's output [rows = b·t, heads·d] as it comes (before the heads are split), in fp32
// from the fp32 cos and sin tables, rounded once. ATen (as `transformers`) casts the tables to
// the compute dtype, then multiplies, negates, concatenates, multiplies and adds, rounding at
// each step; backward as many passes again. Here one pass each way, 8 pairs a thread in
// 16-byte packs where the head dimension is a multiple of 16; and with q, k and v as one matrix
// multiplication one launch moves all three parts (v copied).

// silu(g) and its derivative's factor: with σ = 1 / (1 + e^−g), silu = g·σ and
// silu' = σ·(1 + g·(1 − σ)), as ATen's silu_backward.
__device__ __forceinline__ float tg_sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

// Whether `count` values from p on (and every pointer alike) can be moved in packs.
__device__ __forceinline__ bool tg_packs_fit(const void* p, long long count) {
  return tg_on_16_bytes(p) && count % TG_PER_THREAD == 0;
}

// Where value i (of n, `cols` a row) of a tensor read `stride` values a row is.
struct TgRows {
  long long cols, stride;
  __device__ __forceinline__ long long at(long long i) const { return cols == stride ? i : (i / cols) * stride + i % cols; }
  // Whether 8 values from `first` (a multiple of 8) on are consecutive in memory.
  __device__ __forceinline__ bool packs() const { return cols % TG_PER_THREAD == 0 && stride % TG_PER_THREAD == 0; }
};

// The 8 values of type D from value `first` on (of n, laid out as `rows` says) into v, one at a
// time (where they cannot be moved in packs).
template <class D>
__device__ __forceinline__ void tg_load8(const typename D::T* p, long long first, long long n, float* v, TgRows rows) {
  for (int k = 0; k < TG_PER_THREAD; ++k) v[k] = first + k < n ? D::load(p, rows.at(first + k)) : 0.0f;
}

// 8 values of type D from `first` on as loaded, not yet converted (one pack for a 16-bit dtype,
// two for fp32): loads kept apart from the conversions let a batch of them be in flight at once.
template <class D>
struct TgRaw8 {
  TgPack q[sizeof(typename D::T) / 2];
};
template <class D>
__device__ __forceinline__ void tg_load_raw8(const typename D::T* p, long long first, TgRaw8<D>& raw) {
#pragma unroll
  for (int q = 0; q < static_cast<int>(sizeof(typename D::T) / 2); ++q) raw.q[q].bits = reinterpret_cast<const uint4*>(p + first)[q];
}
template <class D>
__device__ __forceinline__ void tg_unpack8(TgRaw8<D>& raw, float* v) {
  constexpr int per_pack = 16 / sizeof(typename D::T);
#pragma unroll
  for (int q = 0; q < static_cast<int>(sizeof(typename D::T) / 2); ++q) {
    const typename D::T* values = tg_pack_values(raw.q[q], static_cast<typename D::T*>(nullptr));
#pragma unroll
    for (int k = 0; k < per_pack; ++k) v[q * per_pack + k] = D::load(values, k);
  }
}

// The 8 values from `first` on of two or three tensors (c may be null), `a` laid out as `ra`, b
// and c as `rb`. In packs where `packed`, every load issued before the first is converted (one
// wait for memory, not one a tensor: ptxas converts a pack as soon as it is loaded otherwise).
template <class D>
__device__ __forceinline__ void tg_load3x8(const typename D::T* a, const typename D::T* b, const typename D::T* c, long long first, bool packed,
                                           long long n, float* av, float* bv, float* cv, TgRows ra, TgRows rb) {
  if (packed) {
    TgRaw8<D> x, y, z;
    tg_load_raw8<D>(a, ra.at(first), x);
    tg_load_raw8<D>(b, rb.at(first), y);
    if (c != nullptr) tg_load_raw8<D>(c, rb.at(first), z);
    tg_unpack8<D>(x, av);
    tg_unpack8<D>(y, bv);
    if (c != nullptr) tg_unpack8<D>(z, cv);
  } else {
    tg_load8<D>(a, first, n, av, ra);
    tg_load8<D>(b, first, n, bv, rb);
    if (c != nullptr) tg_load8<D>(c, first, n, cv, rb);
  }
}

template <class D>
__device__ __forceinline__ void tg_store8(typename D::T* p, long long first, bool packed, long long n, const float* v, TgRows rows) {
  if (packed) {
    constexpr int per_pack = 16 / sizeof(typename D::T);
    for (int q = 0; q < TG_PER_THREAD / per_pack; ++q) {
      TgPack pack;
      typename D::T* values = tg_pack_values(pack, static_cast<typename D::T*>(nullptr));
      for (int k = 0; k < per_pack; ++k) D::store(values, k, v[q * per_pack + k]);
      reinterpret_cast<uint4*>(p + rows.at(first))[q] = pack.bits;
    }
  } else {
    for (int k = 0; k < TG_PER_THREAD; ++k) {
      if (first + k < n) D::store(p, rows.at(first + k), v[k]);
    }
  }
}

// h[i] = silu(g[i]) · u[i] for i < n; g and u laid out as `gu` says, h contiguous.
template <class D>
__device__ __forceinline__ void swiglu_forward(const typename D::T* g, const typename D::T* u, typename D::T* h, long long n, TgRows gu) {
  const long long first = (static_cast<long long>(blockIdx.x) * TG_THREADS + threadIdx.x) * TG_PER_THREAD;
  if (first >= n) return;
  const TgRows flat{n, n};
  const bool packed = gu.packs() && tg_packs_fit(g, n) && tg_packs_fit(u, n) && tg_packs_fit(h, n);
  float gv[TG_PER_THREAD], uv[TG_PER_THREAD], hv[TG_PER_THREAD];
  tg_load3x8<D>(g, u, nullptr, first, packed, n, gv, uv, nullptr, gu, gu);
  for (int k = 0; k < TG_PER_THREAD; ++k) hv[k] = gv[k] * tg_sigmoid(gv[k]) * uv[k];
  tg_store8<D>(h, first, packed, n, hv, flat);
}

// From h's gradient dh: dg = dh · u · silu'(g), du = dh · silu(g); g, u, dg and du laid out as
// `gu` says, dh contiguous.
template <class D>
__device__ __forceinline__ void swiglu_backward(const typename D::T* dh, const typename D::T* g, const typename D::T* u, typename D::T* dg,
                                                typename D::T* du, long long n, TgRows gu) {
  const long long first = (static_cast<long long>(blockIdx.x) * TG_THREADS + threadIdx.x) * TG_PER_THREAD;
  if (first >= n) return;
  const TgRows flat{n, n};
  const bool packed = gu.packs() && tg_packs_fit(dh, n) && tg_packs_fit(g, n) && tg_packs_fit(u, n) && tg_packs_fit(dg, n) && tg_packs_fit(du, n);
  float dhv[TG_PER_THREAD], gv[TG_PER_THREAD], uv[TG_PER_THREAD], dgv[TG_PER_THREAD], duv[TG_PER_THREAD];
  tg_load3x8<D>(dh, g, u, first, packed, n, dhv, gv, uv, flat, gu);
  for (int k = 0; k < TG_PER_THREAD; ++k) {
    const float sig = tg_sigmoid(gv[k]);
    duv[k] = dhv[k] * (gv[k] * sig);
    dgv[k] = dhv[k] * uv[k] * (sig * (1.0f + gv[k] * (1.0f - sig)));
  }
  tg_store8<D>(dg, first, packed, n, dgv, gu);
  tg_store8<D>(du, first, packed, n, duv, gu);
}

#define TG_SWIGLU(SUFFIX, D)                                                                                               \
  TG_KERNEL void __launch_bounds__(TG_THREADS) tg_swiglu_forward_##SUFFIX(const D::T* g, const D::T* u, D::T* h, long long n, \
                                                                         long long cols, long long stride) {               \
    swiglu_forward<D>(g, u, h, n, TgRows{cols, stride});                                                                    \
  }                                                                                                                         \
  TG_KERNEL void __launch_bounds__(TG_THREADS) tg_swiglu_backward_##SUFFIX(const D::T* dh, const D::T* g, const D::T* u,    \
                                                                          D::T* dg, D::T* du, long long n, long long cols,  \
                                                                          long long stride) {                               \
    swiglu_backward<D>(dh, g, u, dg, du, n, TgRows{cols, stride});                                                          \
  }

TG_SWIGLU(f32, F32)
TG_SWIGLU(bf16, BF16)
TG_SWIGLU(f16, F16)

// RoPE's work: up to three jobs, each `heads` heads of d values a row taken from src and
// written to dst, both [b, t, heads·d] with their own batch and row strides (a row's columns
// contiguous): q or k rotated (forward), a gradient rotated back, or v copied. One launch moves a
// merged q/k/v output's three parts to q, k and v, or their three gradients into the joint one
// (crates/trainguard-sys/cpp/llama_kernels.cpp). Laid out as the host's RopeJobs (cuda_jit.h).
#define TG_ROPE_COPY 0
#define TG_ROPE_FORWARD 1
#define TG_ROPE_BACKWARD 2
struct TgRopeJob {
  const void* src;
  void* dst;
  long long src_batch, src_row, dst_batch, dst_row, heads;
  int op, unused;
};
struct TgRopeJobs {
  TgRopeJob job[3];  // the jobs not used of 0 heads
  int pairs;         // pairs a thread: 8 (16-byte packs) where every pointer and stride allows, else 1
};

// The pairs (i + k, i + k + d/2), k < W, of head `head` of row (bi, ti) of job j:
// out_i = x_i·cos_i − x_{i+d/2}·sin_i, out_{i+d/2} = x_{i+d/2}·cos_{i+d/2} + x_i·sin_{i+d/2}.
// Backward is the transposed rotation: dx_i = dy_i·cos_i + dy_{i+d/2}·sin_{i+d/2},
// dx_{i+d/2} = dy_{i+d/2}·cos_{i+d/2} − dy_i·sin_i. With W = 8 every load (two packs of x, two
// of each table half) is issued before any is used.
template <class D, int W>
__device__ __forceinline__ void rope_pairs(const TgRopeJob& j, const float* cos, const float* sin, long long bi, long long ti, long long d,
                                           long long head, long long i) {
  const long long half = d / 2, table = ti * d + i;
  const typename D::T* src = static_cast<const typename D::T*>(j.src) + bi * j.src_batch + ti * j.src_row + head * d + i;
  typename D::T* dst = static_cast<typename D::T*>(j.dst) + bi * j.dst_batch + ti * j.dst_row + head * d + i;
  float a[W], b[W], c1[W], s1[W], c2[W], s2[W];
  if constexpr (W == TG_PER_THREAD) {
    TgRaw8<D> ra, rb;
    TgRaw8<F32> rc1, rs1, rc2, rs2;
    tg_load_raw8<D>(src, 0, ra);
    tg_load_raw8<D>(src, half, rb);
    if (j.op != TG_ROPE_COPY) {
      tg_load_raw8<F32>(cos, table, rc1);
      tg_load_raw8<F32>(sin, table, rs1);
      tg_load_raw8<F32>(cos, table + half, rc2);
      tg_load_raw8<F32>(sin, table + half, rs2);
      tg_unpack8<F32>(rc1, c1);
      tg_unpack8<F32>(rs1, s1);
      tg_unpack8<F32>(rc2, c2);
      tg_unpack8<F32>(rs2, s2);
    }
    tg_unpack8<D>(ra, a);
    tg_unpack8<D>(rb, b);
  } else {
    for (int k = 0; k < W; ++k) {
      a[k] = D::load(src, k);
      b[k] = D::load(src, half + k);
      if (j.op != TG_ROPE_COPY) {
        c1[k] = cos[table + k], s1[k] = sin[table + k], c2[k] = cos[table + half + k], s2[k] = sin[table + half + k];
      }
    }
  }
  float lo[W], hi[W];
  for (int k = 0; k < W; ++k) {
    if (j.op == TG_ROPE_FORWARD) {
      lo[k] = a[k] * c1[k] - b[k] * s1[k];
      hi[k] = b[k] * c2[k] + a[k] * s2[k];
    } else if (j.op == TG_ROPE_BACKWARD) {
      lo[k] = a[k] * c1[k] + b[k] * s2[k];
      hi[k] = b[k] * c2[k] - a[k] * s1[k];
    } else {
      lo[k] = a[k];
      hi[k] = b[k];
    }
  }
  const TgRows flat{W, W};
  tg_store8<D>(dst, 0, W == TG_PER_THREAD, W, lo, flat);
  tg_store8<D>(dst + half, 0, W == TG_PER_THREAD, W, hi, flat);
}

// One thread a unit of W pairs of a head of a row: the row's units run through the jobs in
// turn. The job's fields are picked by selects (a dynamic index into the parameters would copy
// them to local memory).
template <class D, int W>
__device__ __forceinline__ void rope(const TgRopeJobs& jobs, const float* cos, const float* sin, long long rows, int t, int d) {
  const int units_per_head = d / 2 / W;
  const int units_per_row = static_cast<int>(jobs.job[0].heads + jobs.job[1].heads + jobs.job[2].heads) * units_per_head;
  const long long p = static_cast<long long>(blockIdx.x) * TG_THREADS + threadIdx.x;
  if (p >= rows * units_per_row) return;
  const int row = static_cast<int>(p / units_per_row);  // rows < 2^31 (cuda_rope checks)
  int unit = static_cast<int>(p - static_cast<long long>(row) * units_per_row);
  TgRopeJob j = jobs.job[0];
  const int first = static_cast<int>(jobs.job[0].heads) * units_per_head, second = static_cast<int>(jobs.job[1].heads) * units_per_head;
  if (unit >= first) {
    unit -= first;
    j = jobs.job[1];
    if (unit >= second) {
      unit -= second;
      j = jobs.job[2];
    }
  }
  const int head = unit / units_per_head;
  const int bi = row / t;
  rope_pairs<D, W>(j, cos, sin, bi, row - bi * t, d, head, static_cast<long long>(unit - head * units_per_head) * W);
}

#define TG_ROPE(SUFFIX, D)                                                                                               \
  TG_KERNEL void __launch_bounds__(TG_THREADS) tg_rope_##SUFFIX(TgRopeJobs jobs, const float* cos, const float* sin, long long rows, \
                                                                int t, int d) {                                           \
    if (jobs.pairs == TG_PER_THREAD) {                                                                                     \
      rope<D, TG_PER_THREAD>(jobs, cos, sin, rows, t, d);                                                                  \
    } else {                                                                                                               \
      rope<D, 1>(jobs, cos, sin, rows, t, d);                                                                              \
    }                                                                                                                      \
  }

TG_ROPE(f32, F32)
TG_ROPE(bf16, BF16)
TG_ROPE(f16, F16)
