// Our own CUDA kernels (src/ffi/optim_kernels.cu), compiled at run time by NVRTC and launched
// through the CUDA driver API, both loaded with dlopen (cuda_jit.cpp): the build needs no CUDA
// toolkit and a machine without a GPU still builds, links and runs everything else.
#pragma once
#include <ATen/core/Tensor.h>

namespace trainguard {
// The CUDA side of tg_adamw8bit_update (optim_kernels.cpp), which has checked the tensors: one
// launch over `p`'s blocks of 2048 values on PyTorch's current stream. The kernels must have
// been prepared for p's device (tg_cuda_jit_prepare).
void cuda_adamw8bit_update(at::Tensor& p, const at::Tensor& g, at::Tensor& qm, at::Tensor& am, at::Tensor& qv,
                           at::Tensor& av, float w1, float w2, float shrink, float scale, float shift, bool apply);
}  // namespace trainguard
