// trainguard's c10d shim: PyTorch's own process groups (TCPStore + ProcessGroupGloo) for
// data-parallel training, compiled by build.rs with -DUSE_C10D_GLOO against the same libtorch
// and Debian's gloo headers. Exceptions are caught here and returned as messages.
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef TG_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "guarded.h"

#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <cstring>
#include <exception>
#include <string>
#include <stdexcept>
#include <vector>

namespace {
using trainguard::guarded;

struct Group {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
};

// The replicated all-reduce started as backward makes the gradients (dist.overlap): a hook on
// each parameter of a block copies its gradient (plus the earlier micro-steps' sum) into its
// bucket while armed, and a bucket whose parameters all arrived is all-reduced at once, in a
// fixed order (`order`), so that every rank starts the same collectives in the same sequence.
// `finish` fills what no hook did from the step's gradients and starts the rest: every rank
// starts every bucket once an attempt, whether its backward succeeded or not.
//
// With `owner` set (dist.shard: gradients) there are no buckets: each parameter is one, and its
// gradient (added into the earlier micro-steps' sum, in place) is summed over the ranks into its
// owner's copy, in place, in pieces of `chunk` elements (c10d reduce). Nothing is allocated for
// it: a rank whose gradient is missing (its backward failed) sends `scratch` instead, one piece
// made with the layout, so that its peers' reduces complete.
struct Buckets {
  std::mutex m;
  c10::intrusive_ptr<c10d::Backend> backend;
  std::vector<at::Tensor> flats;
  std::vector<int64_t> bucket_of, offset;  // per parameter
  std::vector<int64_t> awaited;  // per bucket: its hooked parameters, + 1 if it holds others
  std::vector<int64_t> order;    // the buckets in the order they start
  bool armed = false;
  std::vector<at::Tensor> sums;  // per parameter: the earlier micro-steps' (or none)
  std::vector<char> arrived;
  std::vector<int64_t> missing;  // per bucket
  size_t next = 0;               // into order
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::string fault;  // a gradient that arrived twice: its bucket may have started without it
  // Reduced into owners (dist.shard: gradients); empty `owner`: all-reduced buckets.
  std::vector<int64_t> owner, numel;  // per parameter
  std::vector<at::Tensor> targets;    // per parameter: the flat fp32 tensor reduced in place
  at::Tensor scratch;
  int64_t chunk = 1;
  int64_t rank = 0;

  bool reduces() const { return !owner.empty(); }

  at::Tensor slot(size_t i, int64_t n) { return flats[bucket_of[i]].narrow(0, offset[i], n); }

  // Parameter i's pieces, each summed into its owner's: from its target, or from `scratch` on a
  // rank that has none (the same number of collectives either way).
  void start_reduces(size_t i) {
    at::Tensor t = targets[i];
    if (t.defined() && t.numel() != numel[i]) {
      fault = "the gradient of parameter " + std::to_string(i) + " has " + std::to_string(t.numel()) +
              " elements, not " + std::to_string(numel[i]);
      t = at::Tensor();
    }
    c10d::ReduceOptions o;
    o.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
    o.rootRank = owner[i];
    for (int64_t from = 0; from < numel[i]; from += chunk) {
      int64_t len = std::min(chunk, numel[i] - from);
      std::vector<at::Tensor> ts{t.defined() ? t.narrow(0, from, len) : scratch.narrow(0, 0, len)};
      works.push_back(backend->reduce(ts, o));
    }
  }

  void start_ready() {
    while (next < order.size() && missing[order[next]] == 0) {
      if (reduces()) {
        start_reduces(order[next]);
      } else {
        std::vector<at::Tensor> ts{flats[order[next]]};
        works.push_back(backend->allreduce(ts));
      }
      ++next;
    }
  }

  void arrive(size_t i, const at::Tensor& grad) {
    std::lock_guard<std::mutex> lock(m);
    // Undefined: added somewhere else (kernels.accumulate_in_gemm's sums), which `finish` reads.
    if (!armed || !grad.defined()) return;
    if (arrived[i]) {
      fault = "the gradient of parameter " + std::to_string(i) + " arrived twice in one backward";
      return;
    }
    auto g = grad.reshape({-1});
    if (reduces()) {
      // Into the sum the caller holds (fp32, contiguous: checked when armed), or the gradient
      // itself (a copy only where it is not flat fp32, written back to the caller's by finish).
      targets[i] = sums[i].defined() ? sums[i].view({-1}).add_(g) : g.to(at::kFloat);
    } else {
      auto dst = slot(i, g.numel());
      if (sums[i].defined()) {
        at::add_out(dst, sums[i].reshape({-1}), g);
      } else {
        dst.copy_(g);
      }
    }
    arrived[i] = 1;
    --missing[bucket_of[i]];
    start_ready();
  }

  void reset() {
    armed = false;
    std::fill(arrived.begin(), arrived.end(), 0);
    for (auto& t : sums) t = at::Tensor();
    for (auto& t : targets) t = at::Tensor();
    missing = awaited;
    next = 0;
    works.clear();
    fault.clear();
  }
};

// Registers a hook on each hooked parameter that hands its gradient to `b` while it lives.
void hook_parameters(const std::shared_ptr<Buckets>& b, void** params, const uint8_t* hooked, size_t n) {
  // The hooks stay on the parameters for the process's life; once the buckets are freed they
  // find nothing and return.
  std::weak_ptr<Buckets> weak = b;
  for (size_t i = 0; i < n; ++i) {
    if (!hooked[i]) continue;
    static_cast<at::Tensor*>(params[i])->register_hook([weak, i](const at::Tensor& grad) {
      if (auto b = weak.lock()) b->arrive(i, grad);
    });
  }
}
}  // namespace

extern "C" {

int tg_pg_nccl_built() {
#ifdef TG_WITH_NCCL
  return 1;
#else
  return 0;
#endif
}

// Joins (or, with host_store, hosts) the TCPStore at host:port and builds a process group of
// `world` ranks: backend 0 = Gloo, 1 = NCCL (when built in). Keys live under `prefix`, so a
// restarted group never reads the keys of an earlier attempt. Returns an opaque handle or null
// (message in err).
void* tg_pg_new(int backend, const char* host, int port, int rank, int world, int host_store,
                int64_t timeout_ms, const char* prefix, char* err, size_t err_len) {
  Group* out = nullptr;
  guarded(err, err_len, [&] {
    auto timeout = std::chrono::milliseconds(timeout_ms);
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<std::uint16_t>(port);
    opts.isServer = host_store != 0;
    opts.numWorkers = world;
    opts.waitWorkers = false;
    opts.timeout = timeout;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(std::string(host), opts);
    c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), tcp);
    if (backend == 1) {
#ifdef TG_WITH_NCCL
      // Blocking wait: without it `wait()` only orders the CUDA stream, the options' timeout
      // is unused, and a dead or hung peer ends in NCCL's watchdog aborting the process. With
      // it, `wait()` blocks this thread and throws after `timeout`, so the error reaches
      // trainguard (exit code, the silent rank named). The constructor reads it; a user's own
      // setting wins.
      if (!std::getenv("TORCH_NCCL_BLOCKING_WAIT") && !std::getenv("NCCL_BLOCKING_WAIT")) {
        setenv("TORCH_NCCL_BLOCKING_WAIT", "1", 0);
      }
      auto nopts = c10d::ProcessGroupNCCL::Options::create();
      nopts->timeout = timeout;
      auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world, nopts);
      out = new Group{store, pg};
      return;
#else
      throw std::runtime_error("this trainguard was built without NCCL");
#endif
    }
    auto gopts = c10d::ProcessGroupGloo::Options::create(timeout);
    gopts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, gopts);
    out = new Group{store, pg};
  });
  return out;
}

// op: 0 = sum, 1 = max. In place on one tensor (a flat bucket).
int tg_pg_allreduce(void* group, void* tensor, int op, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
    auto* g = static_cast<Group*>(group);
    std::vector<at::Tensor> ts{*static_cast<at::Tensor*>(tensor)};
    c10d::AllreduceOptions o;
    o.reduceOp = op == 1 ? c10d::ReduceOp(c10d::ReduceOp::MAX) : c10d::ReduceOp(c10d::ReduceOp::SUM);
    g->backend->allreduce(ts, o)->wait();
  });
}

int tg_pg_broadcast(void* group, void* tensor, int root, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
    auto* g = static_cast<Group*>(group);
    std::vector<at::Tensor> ts{*static_cast<at::Tensor*>(tensor)};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    g->backend->broadcast(ts, o)->wait();
  });
}

// Sharded data parallel: `input` holds world × n elements, `output` n; output = the sum over
// ranks of this rank's n-element piece of every rank's input (c10d's reduce_scatter_tensor).
int tg_pg_reduce_scatter(void* group, void* output, void* input, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
    auto* g = static_cast<Group*>(group);
    c10d::ReduceScatterOptions o;
    o.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
    g->backend->_reduce_scatter_base(*static_cast<at::Tensor*>(output), *static_cast<at::Tensor*>(input), o)->wait();
  });
}

// `input` n elements, `output` world × n: every rank's input, rank after rank
// (all_gather_into_tensor).
int tg_pg_all_gather(void* group, void* output, void* input, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
    auto* g = static_cast<Group*>(group);
    g->backend->_allgather_base(*static_cast<at::Tensor*>(output), *static_cast<at::Tensor*>(input))->wait();
  });
}

// A collective `launch` starts (on one tensor, root `root`), not waited for: the work, which
// holds the tensor until it completes, for tg_work_wait (null on failure, with the message in
// err). What overlaps compute (dist.overlap): on Gloo its own threads run it, on NCCL its stream.
extern "C++" {
template <typename Options, typename Launch>
void* start_rooted(void* group, void* tensor, int root, char* err, size_t err_len, Options o, Launch launch) {
  c10::intrusive_ptr<c10d::Work>* out = nullptr;
  guarded(err, err_len, [&] {
    auto* g = static_cast<Group*>(group);
    std::vector<at::Tensor> ts{*static_cast<at::Tensor*>(tensor)};
    o.rootRank = root;
    out = new c10::intrusive_ptr<c10d::Work>(launch(*g->backend, ts, o));
  });
  return out;
}
}  // extern "C++": a template, used by the two below

// tg_pg_broadcast, started.
void* tg_pg_broadcast_start(void* group, void* tensor, int root, char* err, size_t err_len) {
  return start_rooted(group, tensor, root, err, err_len, c10d::BroadcastOptions{},
                      [](c10d::Backend& b, std::vector<at::Tensor>& ts, const c10d::BroadcastOptions& o) {
                        return b.broadcast(ts, o);
                      });
}

// `tensor` summed over the ranks into root's (the others' are left undefined), started.
void* tg_pg_reduce_start(void* group, void* tensor, int root, char* err, size_t err_len) {
  c10d::ReduceOptions sum;
  sum.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
  return start_rooted(group, tensor, root, err, err_len, sum,
                      [](c10d::Backend& b, std::vector<at::Tensor>& ts, const c10d::ReduceOptions& o) {
                        return b.reduce(ts, o);
                      });
}

// Waits for a started collective to complete, then frees it (whatever the outcome).
int tg_work_wait(void* work, char* err, size_t err_len) {
  auto* w = static_cast<c10::intrusive_ptr<c10d::Work>*>(work);
  int rc = guarded(err, err_len, [&] { (*w)->wait(); });
  delete w;
  return rc;
}

// Buckets over `flats` (fp32, contiguous) for `n` parameters: parameter i's gradient at
// `offset[i]` of bucket `bucket[i]`, with a hook where hooked[i]. Buckets start in `order`.
void* tg_buckets_new(void* group, void** params, const int64_t* bucket, const int64_t* offset,
                     const uint8_t* hooked, size_t n, void** flats, const int64_t* order, size_t n_buckets,
                     char* err, size_t err_len) {
  std::shared_ptr<Buckets>* out = nullptr;
  guarded(err, err_len, [&] {
    auto b = std::make_shared<Buckets>();
    b->backend = static_cast<Group*>(group)->backend;
    for (size_t k = 0; k < n_buckets; ++k) {
      b->flats.push_back(*static_cast<at::Tensor*>(flats[k]));
      b->order.push_back(order[k]);
    }
    std::vector<int64_t> hooks(n_buckets, 0), others(n_buckets, 0);
    for (size_t i = 0; i < n; ++i) {
      b->bucket_of.push_back(bucket[i]);
      b->offset.push_back(offset[i]);
      ++(hooked[i] ? hooks : others)[bucket[i]];
    }
    for (size_t k = 0; k < n_buckets; ++k) b->awaited.push_back(hooks[k] + (others[k] > 0 ? 1 : 0));
    b->sums.resize(n);
    b->arrived.assign(n, 0);
    b->reset();
    hook_parameters(b, params, hooked, n);
    out = new std::shared_ptr<Buckets>(b);
  });
  return out;
}

// dist.shard: gradients: each of the `n` parameters summed into its owner's (`owner[i]`, of
// `numel[i]` elements), the hooked ones from inside backward, in pieces of `chunk` elements;
// parameters start in `order`. `scratch` (fp32, at least `chunk` elements) is what a rank with
// no gradient sends. `rank`: this rank, whose owned gradients finish writes back.
void* tg_reduces_new(void* group, void** params, const uint8_t* hooked, const int64_t* owner,
                     const int64_t* numel, const int64_t* order, size_t n, int64_t chunk, int64_t rank,
                     void* scratch, char* err, size_t err_len) {
  std::shared_ptr<Buckets>* out = nullptr;
  guarded(err, err_len, [&] {
    auto b = std::make_shared<Buckets>();
    b->backend = static_cast<Group*>(group)->backend;
    b->scratch = *static_cast<at::Tensor*>(scratch);
    b->chunk = chunk;
    b->rank = rank;
    for (size_t i = 0; i < n; ++i) {
      b->owner.push_back(owner[i]);
      b->numel.push_back(numel[i]);
      b->order.push_back(order[i]);
      b->bucket_of.push_back(static_cast<int64_t>(i));
      b->offset.push_back(0);
      b->awaited.push_back(1);
    }
    b->sums.resize(n);
    b->targets.resize(n);
    b->arrived.assign(n, 0);
    b->reset();
    hook_parameters(b, params, hooked, n);
    out = new std::shared_ptr<Buckets>(b);
  });
  return out;
}

// Arms the hooks for the next backward (the step's last micro-step): `sums[i]` (or null) is
// what the earlier micro-steps gave parameter i, added to its gradient on the way.
int tg_buckets_arm(void* buckets, void** sums, char* err, size_t err_len) {
  return guarded(err, err_len, [&] {
    auto& b = **static_cast<std::shared_ptr<Buckets>*>(buckets);
    std::lock_guard<std::mutex> lock(b.m);
    for (size_t i = 0; i < b.sums.size(); ++i) {
      b.sums[i] = sums && sums[i] ? *static_cast<at::Tensor*>(sums[i]) : at::Tensor();
      // Reduced in place: the sum must be the caller's own fp32 memory, flat-viewable.
      if (b.reduces() && b.sums[i].defined() &&
          (b.sums[i].scalar_type() != at::kFloat || !b.sums[i].is_contiguous())) {
        throw std::runtime_error("the sum of parameter " + std::to_string(i) + " is not contiguous fp32");
      }
    }
    b.armed = true;
  });
}

// Ends the attempt: each parameter no hook gave is copied from `grads[i]` (null: left as it
// is, on a rank whose backward failed and whose buckets are reduced only to keep the ranks in
// step), the buckets not started yet are, and every bucket is waited for.
// `started_early`: how many had started from inside backward.
int tg_buckets_finish(void* buckets, void** grads, size_t* started_early, char* err, size_t err_len) {
  auto& b = **static_cast<std::shared_ptr<Buckets>*>(buckets);
  std::lock_guard<std::mutex> lock(b.m);
  *started_early = b.next;
  int rc = guarded(err, err_len, [&] {
    b.armed = false;
    std::string first_error;
    try {
      for (size_t i = 0; i < b.offset.size(); ++i) {
        if (b.arrived[i] || !grads[i]) continue;
        auto g = static_cast<at::Tensor*>(grads[i])->reshape({-1});
        if (b.reduces()) {
          b.targets[i] = g.to(at::kFloat);
        } else {
          b.slot(i, g.numel()).copy_(g);
        }
      }
    } catch (const std::exception& e) {
      first_error = e.what();
    }
    std::fill(b.missing.begin(), b.missing.end(), 0);
    b.start_ready();
    // Every bucket waited for, a failed one too: the next collective must come after all.
    for (auto& w : b.works) {
      try {
        w->wait();
      } catch (const std::exception& e) {
        if (first_error.empty()) first_error = e.what();
      }
    }
    if (first_error.empty() && !b.fault.empty()) first_error = b.fault;
    if (!first_error.empty()) throw std::runtime_error(first_error);
    // This rank's sums where they were reduced into a copy (not flat fp32) of its gradient.
    for (size_t i = 0; b.reduces() && i < b.owner.size(); ++i) {
      if (b.owner[i] != b.rank || !grads[i] || !b.targets[i].defined()) continue;
      auto& g = *static_cast<at::Tensor*>(grads[i]);
      if (b.targets[i].data_ptr() != g.data_ptr()) g.copy_(b.targets[i].view(g.sizes()));
    }
  });
  b.reset();
  return rc;
}

// Which parameters' gradients a hook took in the armed backward (one byte each into `out`).
void tg_buckets_arrived(void* buckets, uint8_t* out, size_t n) {
  auto& b = **static_cast<std::shared_ptr<Buckets>*>(buckets);
  std::lock_guard<std::mutex> lock(b.m);
  for (size_t i = 0; i < n && i < b.arrived.size(); ++i) out[i] = b.arrived[i] ? 1 : 0;
}

void tg_buckets_free(void* buckets) { delete static_cast<std::shared_ptr<Buckets>*>(buckets); }

int tg_pg_barrier(void* group, char* err, size_t err_len) {
  return guarded(err, err_len, [&] { static_cast<Group*>(group)->backend->barrier()->wait(); });
}

// A plain client of the group's TCPStore (its own connection, under `prefix`): the heartbeat
// thread keeps a per-rank counter in it, so a rank that stops answering can be named.
void* tg_store_new(const char* host, int port, int64_t timeout_ms, const char* prefix, char* err, size_t err_len) {
  c10d::Store* out = nullptr;
  guarded(err, err_len, [&] {
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<std::uint16_t>(port);
    opts.isServer = false;
    opts.waitWorkers = false;
    opts.timeout = std::chrono::milliseconds(timeout_ms);
    auto tcp = c10::make_intrusive<c10d::TCPStore>(std::string(host), opts);
    auto store = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), tcp);
    out = store.release();
  });
  return out;
}

// Atomically adds `delta` to the integer at `key` (0 when missing); the new value in *value.
int tg_store_add(void* store, const char* key, int64_t delta, int64_t* value, char* err, size_t err_len) {
  return guarded(err, err_len, [&] { *value = static_cast<c10d::Store*>(store)->add(std::string(key), delta); });
}

void tg_store_free(void* store) {
  try {
    c10::intrusive_ptr<c10d::Store>::reclaim(static_cast<c10d::Store*>(store));
  } catch (...) {
  }
}

void tg_pg_free(void* group) {
  try {
    delete static_cast<Group*>(group);
  } catch (...) {
  }
}

}  // extern "C"
