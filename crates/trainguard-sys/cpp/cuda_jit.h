// Our own CUDA kernels (crates/trainguard-sys/cuda/optim_kernels.cu), compiled at run time by NVRTC and launched
// through the CUDA driver API, both loaded with dlopen (cuda_jit.cpp): the build needs no CUDA
// toolkit and a machine without a GPU still builds, links and runs everything else.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace trainguard {
// Whether `t` goes through the CUDA kernels: on a CUDA device, or on the CPU while a test has
// switched on the host emulation (tg_cuda_emulation_set) on this thread.
bool runs_cuda_kernels(const at::Tensor& t);

// The host emulation (cuda_emulation.cpp): a kernel's handle by name, and a launch of a grid of
// gx × gy 256-thread blocks that returns when it has run; `args` holds `n_args` pointers to values
// of `sizes` bytes, which must be as many as the kernel's parameters and each of its parameter's
// size (an error otherwise).
void* emulated_kernel(const std::string& name);
void emulated_launch(void* kernel, long long gx, long long gy, void** args, const std::size_t* sizes, std::size_t n_args);

// The CUDA side of tg_adamw8bit_update (optim_kernels.cpp), which has checked the tensors: one
// launch over `p`'s `blocks` blocks of 2048 values on PyTorch's current stream. The kernels must
// have been prepared for p's device (tg_cuda_jit_prepare).
void cuda_adamw8bit_update(at::Tensor& p, const at::Tensor& g, at::Tensor& qm, at::Tensor& am, at::Tensor& qv,
                           at::Tensor& av, long long blocks, float w1, float w2, float shrink, float scale, float shift, bool apply);

// The CUDA side of tg_adafactor_update: `first` is a matrix's row_var (with `col_var`) or a
// vector's full variance (`col_var` null); `ws` the fp64 workspace (4 + units + bands·cols for a
// matrix split into `bands` runs of rows for its column sums; units: rows for a matrix, else
// blocks of 2048 values). Five to seven launches on PyTorch's current stream, nothing read back
// to the host.
void cuda_adafactor_update(at::Tensor& p, const at::Tensor& g, at::Tensor& first, at::Tensor* col_var, at::Tensor& ws,
                           long long units, long long bands, float w, float rho, float eps1_sq, float eps2, float d, float shrink);

// The CUDA side of cross-entropy's autograd node (loss_kernels.cpp), which has checked the
// tensors: `x` [rows, cols] contiguous logits, `target` [rows] int64, `lse` and `loss` [rows]
// fp32 written by the forward; the backward writes `grad` (x's shape and dtype) from the fp32
// 0-dim `grad_scale`. One launch each, one CUDA block per row, on PyTorch's current stream.
void cuda_cross_entropy_forward(const at::Tensor& x, const at::Tensor& target, at::Tensor& lse, at::Tensor& loss);
void cuda_cross_entropy_backward(const at::Tensor& x, const at::Tensor& target, const at::Tensor& lse, const at::Tensor& grad_scale,
                                 at::Tensor& grad);
// Forward and backward in one launch (`kernels.fused_loss_gradient`): lse and loss as the
// forward, then the gradient for `grad_scale` written over `x`. And that gradient times the
// fp32 0-dim `factor` where it is not 1 (a backward given another loss gradient than the one
// the forward assumed); blocks return at once where it is 1. Both launch a block a row.
void cuda_cross_entropy_forward_grad(at::Tensor& x, const at::Tensor& target, at::Tensor& lse, at::Tensor& loss, const at::Tensor& grad_scale);
void cuda_cross_entropy_scale_grad(at::Tensor& grad, const at::Tensor& target, const at::Tensor& factor);

// The CUDA side of the residual norm's autograd node (norm_kernels.cpp; `rms`: RMSNorm, else
// LayerNorm), which has checked the tensors:
// `x` [rows, c] fp32 contiguous, `delta` (undefined: none) in y's dtype, `w` and `b` (undefined:
// none) [c] fp32; the forward writes s (with a delta), y, and a mean and 1/σ per row. The
// backward takes dy in y's dtype and ds fp32 (either undefined: no gradient), writes dx fp32,
// ddelta (when defined) in y's dtype, dw and db (when defined; left as they are without dy).
// One launch forward, three backward, on PyTorch's current stream.
void cuda_residual_norm_forward(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w, const at::Tensor& b, at::Tensor& s,
                             at::Tensor& y, at::Tensor& mean, at::Tensor& rstd, float eps, bool rms);
void cuda_residual_norm_backward(const at::Tensor& s, const at::Tensor& w, const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& dy,
                              const at::Tensor& ds, at::Tensor& dx, at::Tensor& ddelta, at::Tensor& dw, at::Tensor& db, bool rms);

// The CUDA side of SwiGLU's autograd node (llama_kernels.cpp), which has checked the tensors:
// of one shape and dtype; h and dh contiguous; g, u, dg and du either all contiguous or all
// the two halves of joint [rows, 2·cols] tensors (rows of cols values, 2·cols apart). Forward
// writes h = silu(g) · u, backward dg and du from dh. One launch each, blocks of 2048 values,
// on PyTorch's current stream.
void cuda_swiglu_forward(const at::Tensor& g, const at::Tensor& u, at::Tensor& h);
void cuda_swiglu_backward(const at::Tensor& dh, const at::Tensor& g, const at::Tensor& u, at::Tensor& dg, at::Tensor& du);

// The CUDA side of RoPE's autograd nodes (llama_kernels.cpp), which have checked the tensors: up
// to three parts, each `heads` heads of `src` [b, t, heads·d] (its last dimension contiguous,
// rows and batches evenly strided: contiguous, or columns of a wider tensor) rotated by position
// (kForward), rotated back (kBackward: a gradient) or copied (kCopy) into `dst` alike; `cos` and
// `sin` [≥ t, d] fp32 contiguous. Every part of one b, t, d and dtype. One launch, on PyTorch's
// current stream.
enum class RopeOp { kCopy = 0, kForward = 1, kBackward = 2 };
struct RopePart {
  const at::Tensor* src;
  at::Tensor* dst;
  long long heads;
  RopeOp op;
};
void cuda_rope(const std::vector<RopePart>& parts, const at::Tensor& cos, const at::Tensor& sin);
// The launch's argument, laid out as llama_kernels.cu's TgRopeJobs (the emulation checks that).
struct RopeJobs {
  struct Job {
    const void* src;
    void* dst;
    long long src_batch, src_row, dst_batch, dst_row, heads;
    int op, unused;
  } job[3];  // the jobs not used of 0 heads
  int pairs;
};

// The column sums of `dy` [rows, cols] (contiguous; fp32, bf16 or fp16) into `out` [cols] fp32
// (linear_kernels.cpp: a bias's gradient). Two launches (bands of rows, then the bands in
// order) on PyTorch's current stream.
void cuda_column_sum(const at::Tensor& dy, at::Tensor& out);

// GELU's backward for the linear-GELU node (linear_kernels.cpp): dh = da · GELU'(h), rounded to
// h's dtype, returned; with `db` its column sums (fp32, the bias's gradient) in the bits
// cuda_column_sum(dh) gives. da and h [rows, cols] of one dtype. One launch (and the bands'
// finish). Undefined, with nothing allocated or launched, where the rows cannot be read 8 values
// a lane (not contiguous, a width not a multiple of 8, a start off 16 bytes): the caller then
// takes ATen's ops. dh may differ from ATen's CUDA gelu_backward in the last bit (NVRTC compiles
// without fused multiply-adds, nvcc with them).
at::Tensor cuda_gelu_backward(const at::Tensor& da, const at::Tensor& h, at::Tensor* db);
}  // namespace trainguard
