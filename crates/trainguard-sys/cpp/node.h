// Shared by our autograd nodes (loss_kernels.cpp, norm_kernels.cpp, llama_kernels.cpp,
// linear_kernels.cpp).
#pragma once
#include <ATen/core/grad_mode.h>

#include <stdexcept>
#include <string>

namespace trainguard {
// A node's backward runs our kernels, which autograd does not record: a second derivative
// (create_graph, grad mode on inside backward) is refused, naming the node `op` and its switch
// `kernels.<key>`.
inline void check_differentiable_once(const std::string& op, const std::string& key) {
  if (at::GradMode::is_enabled()) {
    throw std::runtime_error(op + ": kernels." + key + " is differentiable once; a second derivative (create_graph) needs kernels." + key +
                             ": false");
  }
}
}  // namespace trainguard
