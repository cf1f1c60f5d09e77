// CUDA graphs through ATen's CUDAGraph (`kernels.cuda_graphs`): the Rust side captures one
// micro-step's forward and backward between tg_graph_capture_begin and tg_graph_capture_end, then
// replays it with one launch. Compiled by build.rs only against a libtorch with libtorch_cuda and
// with the CUDA headers present (the wheels scripts/setup.sh installs); without them the Rust side
// answers "unavailable". Same conventions as shim.cpp: no exception crosses into Rust.
//
// What a capture needs, as torch.cuda.graph does it: a side stream (the legacy default stream
// cannot capture), the device synchronised and the allocator's cache emptied first (a warm-up's
// cached blocks would otherwise stay reserved beside the graph's private pool), and autocast's
// cast cache off while capturing (a cached cast made inside the capture would be read later by
// code outside the graph; PyTorch's make_graphed_callables asks for cache_enabled=False).
#include <ATen/autocast_mode.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/core/Event.h>
#include <dlfcn.h>

#include <optional>
#include <stdexcept>

#include "guarded.h"

namespace {
// Clears the CUDA runtime's last error, which a failed capture leaves for the next kernel launch
// check to report as its own. Looked up in the runtime torch loaded (our link has no -lcudart).
void clear_cuda_error() {
  using GetLastError = int (*)();
  static const auto get = reinterpret_cast<GetLastError>(dlsym(RTLD_DEFAULT, "cudaGetLastError"));
  if (get != nullptr) (void)get();
}

struct Graph {
  at::cuda::CUDAGraph graph;
  // The private memory pool the capture allocates from (ours, so a failed capture can hand it
  // back: CUDAGraph learns its own pool's id only once a capture ended).
  c10::DeviceIndex device = 0;
  c10::cuda::MempoolId_t pool{0, 0};
  // While capturing: the stream to go back to, and autocast's cache setting to restore.
  std::optional<c10::cuda::CUDAStream> prior;
  bool autocast_cache = true;
  bool capturing = false;

  // Back to the stream the caller had, which then waits for the side stream's (captured) work.
  void leave_capture() {
    if (!capturing) return;
    capturing = false;
    const c10::cuda::CUDAStream side = c10::cuda::getCurrentCUDAStream(prior->device_index());
    c10::cuda::setCurrentCUDAStream(*prior);
    at::autocast::set_autocast_cache_enabled(autocast_cache);
    // Nothing captured ran; the wait orders whatever the side stream ran before the capture.
    c10::Event done(c10::DeviceType::CUDA);
    done.record(side);
    done.block(*prior);
  }

  // After a capture that failed before it ended (invalidated by CUDA, or by an op that cannot
  // be captured): CUDAGraph then neither stops routing the capture's allocations to the pool
  // nor releases it (its reset releases a pool only after a successful end), so the pool's
  // blocks would stay reserved and both allocators would keep a filter that points into this
  // graph. Undone here as capture_end and reset do it. `capture_end_ran`: capture_end may have
  // ended the allocation itself before failing (a few of its checks come after), so the pool is
  // released even where ending it here finds nothing to end; after a failed capture_begin only a
  // pool this ends was registered (a shared pool's count must not drop for a capture that never
  // took it).
  void abandon_pool(bool capture_end_ran) {
    try {
      (void)graph.pool();
      return;  // the capture ended: the graph's reset releases the pool
    } catch (...) {
    }
    const auto quietly = [](auto&& f) {
      try {
        f();
        return true;
      } catch (...) {
        return false;
      }
    };
    const bool ended_here = quietly([&] { c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool); });
    quietly([&] { at::getHostAllocator(at::kCUDA)->end_allocate_to_pool(pool); });
    if (!ended_here && !capture_end_ran) return;
    quietly([&] { c10::cuda::CUDACachingAllocator::releasePool(device, pool); });
    quietly([&] { at::getHostAllocator(at::kCUDA)->release_pool(pool); });
  }

  // After a failed capture_begin or capture_end: back to the caller's stream, the pool handed
  // back, CUDA's last error cleared.
  void fail_capture(bool capture_end_ran) {
    leave_capture();
    abandon_pool(capture_end_ran);
    clear_cuda_error();
  }

  // Ends the capture and instantiates the graph, the caller's stream current again; on failure
  // as fail_capture says, and the error rethrown.
  void end_capture() {
    try {
      graph.capture_end();
    } catch (...) {
      fail_capture(true);
      throw;
    }
    leave_capture();
  }
};

Graph* graph_of(void* g) {
  if (g == nullptr) throw std::invalid_argument("CUDA graph: null handle");
  return static_cast<Graph*>(g);
}
}  // namespace

extern "C" {

// A new graph, capturing from now on: the device synchronised, the allocator's cache emptied,
// a side stream from PyTorch's pool made current, autocast's cast cache off. `share` (null: none)
// is a graph whose private memory pool this capture uses too (graphs replayed one after the other
// on one stream, never at once). Every CUDA op the thread queues until tg_graph_capture_end is
// recorded, not run.
int tg_graph_capture_begin(int device, void* share, void** out, char* err, size_t err_len) {
  *out = nullptr;
  return trainguard::guarded(err, err_len, [&] {
    const auto index = static_cast<c10::DeviceIndex>(device);
    c10::cuda::set_device(index);
    // Autocast's cached casts of the weights hold their AccumulateGrad nodes, made on the
    // caller's stream by a warm-up earlier in the step: the captured backward would then make that
    // stream wait on the capture (CUDA refuses: cudaErrorStreamCaptureImplicit). Freed, the
    // capture's forward makes new ones on its own stream.
    at::autocast::clear_cache();
    c10::cuda::device_synchronize();
    c10::cuda::CUDACachingAllocator::emptyCache();
    auto g = std::make_unique<Graph>();
    g->device = index;
    g->pool = share != nullptr ? graph_of(share)->pool : at::cuda::graph_pool_handle();
    g->prior = c10::cuda::getCurrentCUDAStream(index);
    g->autocast_cache = at::autocast::is_autocast_cache_enabled();
    c10::cuda::setCurrentCUDAStream(c10::cuda::getStreamFromPool(false, index));
    at::autocast::set_autocast_cache_enabled(false);
    g->capturing = true;
    try {
      g->graph.capture_begin(g->pool);
    } catch (...) {
      g->fail_capture(false);
      throw;
    }
    *out = g.release();
  });
}

// Ends the capture and instantiates the graph; the caller's stream is current again. On failure
// (an op that cannot be captured, a capture invalidated) the graph is unusable: free it.
int tg_graph_capture_end(void* g, char* err, size_t err_len) {
  return trainguard::guarded(err, err_len, [&] {
    Graph* graph = graph_of(g);
    if (!graph->capturing) throw std::logic_error("CUDA graph: not capturing");
    graph->end_capture();
  });
}

// Launches the graph on the current stream.
int tg_graph_replay(void* g, char* err, size_t err_len) {
  return trainguard::guarded(err, err_len, [&] { graph_of(g)->graph.replay(); });
}

// Frees the graph (and, with the last graph sharing it, its private pool). A capture still open
// (the code being captured failed) is ended first and its error cleared.
void tg_graph_free(void* g) {
  if (g == nullptr) return;
  Graph* graph = static_cast<Graph*>(g);
  if (graph->capturing) {
    try {
      graph->end_capture();
    } catch (...) {
    }
    clear_cuda_error();  // the captured code's own failure, where the capture ended regardless
  }
  try {
    delete graph;
  } catch (...) {
  }
}

}  // extern "C"
