// The CUDA caching allocator's history recorder and its snapshot: the C++ side of
// torch.cuda.memory._record_memory_history / _snapshot. Compiled by build.rs only when the
// libtorch it builds against has libtorch_cuda (these symbols live there); without it the Rust
// side answers "unavailable". Same conventions as shim.cpp: no exception crosses into Rust.
#include <torch/csrc/cuda/memory_snapshot.h>

#include "guarded.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <optional>
#include <string>

extern "C" {

// Starts (on != 0) or stops recording. Alloc/free/OOM events go to a ring buffer of
// `max_entries`; no stack traces are gathered (context "none"): unwinding on every allocation
// is the part of the recorder with a cost.
int tg_record_memory_history(int on, size_t max_entries, char* err, size_t err_len) {
  return trainguard::guarded(err, err_len, [&] {
    if (on) {
      torch::cuda::_record_memory_history(std::optional<std::string>("all"), std::nullopt, "python", max_entries);
    } else {
      torch::cuda::_record_memory_history(std::optional<std::string>{}, std::nullopt, "python", max_entries);
    }
  });
}

// The pickled snapshot (segments, blocks, device traces) in a malloc'd buffer that the caller
// releases with tg_free_buffer.
int tg_memory_snapshot(char** out, size_t* len, char* err, size_t err_len) {
  *out = nullptr;
  *len = 0;
  return trainguard::guarded(err, err_len, [&] {
    std::string pickle = torch::cuda::_memory_snapshot_pickled();
    char* buf = static_cast<char*>(std::malloc(pickle.size() > 0 ? pickle.size() : 1));
    if (buf == nullptr) throw std::bad_alloc();
    std::memcpy(buf, pickle.data(), pickle.size());
    *out = buf;
    *len = pickle.size();
  });
}

void tg_free_buffer(char* p) { std::free(p); }

}  // extern "C"
