// PyTorch's own profiler (Kineto, as torch.profiler uses it) driven from Rust (`metrics.trace`):
// start it, mark ranges (a step), stop it and write its Chrome trace (which src/trace.rs reads
// back for its summary). On CUDA it records the kernels, copies and sets the device ran (through
// CUPTI, which the torch wheel ships) beside the operators the CPU ran; autograd's backward
// threads are recorded too (they inherit the profiler's thread-local state).
#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <cstdlib>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>

#include "guarded.h"

namespace {
namespace prof = torch::profiler::impl;

bool& tracing() {
  static bool on = false;
  return on;
}
}  // namespace

extern "C" {

// Starts the profiler on the calling thread: CPU operators, and with `cuda` the device's
// kernels, copies and sets. An error if it is already running (ours or anyone's).
int tg_trace_start(int cuda, char* err, size_t err_len) {
  return trainguard::guarded(err, err_len, [&] {
    if (tracing() || torch::autograd::profiler::isProfilerEnabledInMainThread()) {
      throw std::logic_error("trace: the profiler is already running");
    }
    // Without CUDA activities Kineto still probes for GPUs and logs "gpuGetDeviceCount failed"
    // as an ERROR on a machine without one: its errors are silenced then, unless the user set
    // a level.
    if (cuda == 0) setenv("KINETO_LOG_LEVEL", "5", /*overwrite=*/0);
    const prof::ProfilerConfig config(prof::ProfilerState::KINETO);
    std::set<prof::ActivityType> activities{prof::ActivityType::CPU};
    if (cuda != 0) activities.insert(prof::ActivityType::CUDA);
    torch::autograd::profiler::prepareProfiler(config, activities);
    torch::autograd::profiler::enableProfiler(config, activities);
    tracing() = true;
  });
}

// Stops the profiler started by tg_trace_start and writes its Chrome trace to `path`.
int tg_trace_stop(const char* path, char* err, size_t err_len) {
  return trainguard::guarded(err, err_len, [&] {
    if (!tracing()) throw std::logic_error("trace: the profiler is not running");
    tracing() = false;
    std::unique_ptr<torch::autograd::profiler::ProfilerResult> result = torch::autograd::profiler::disableProfiler();
    if (!result) throw std::runtime_error("trace: the profiler returned no result");
    if (path != nullptr && path[0] != '\0') result->save(path);
  });
}

// A named range on the calling thread (a user annotation in the trace) until tg_trace_range_end
// with the handle returned here; null when nothing records ranges.
void* tg_trace_range_begin(const char* name) {
  try {
    auto range = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
    if (!range->isActive()) return nullptr;
    range->before(name);
    return range.release();
  } catch (...) {
    return nullptr;
  }
}

void tg_trace_range_end(void* range) {
  try {
    delete static_cast<at::RecordFunction*>(range);
  } catch (...) {
  }
}

}  // extern "C"
