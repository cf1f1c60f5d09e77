#!/usr/bin/env bash
# Every check that needs a CUDA GPU, for a machine with one (see BENCHMARKS.md, "GPU checks").
# Works without a Rust toolchain given the binaries from scripts/gpu/gpu_bundle.sh, and with one
# (then it builds them). Each part's output goes to $OUT (default runs/gpu-checks)/<part>.log and
# one line per part to summary.txt; a failing part does not stop the others, and the script
# exits 1 if any failed. PART_TIMEOUT=S kills each part, every process it started included,
# after S seconds (what it wrote stays: "timed out" in the summary), PART_TIMEOUT_<part>=S one
# part's; DEADLINE=S gives each part at most what is left of S seconds from the script's start
# (a part with under 10 s left is skipped), so that on a lent machine's short budget one slow
# part cannot starve the rest and the call ends before the device's limit; PADS (default "64 1") picks the `bench` part's vocabulary
# paddings, BENCH_CONFIGS (default gpt2-124m and smollm2-135m) its and `profile`'s models.
#   scripts/gpu/gpu_checks.sh [part ...]     parts: env tests plan bench profile optim savers offload cap detcost kernels fill
#                                        (default: all)
#   tests   tests/it/gpu.rs: allocator stats, empty_cache, CUDA OOM replay under memory.limit (bitwise,
#           deterministic mode), kill -9 + --resume auto bitwise (deterministic mode), the OOM
#           snapshot (pickle.load, _memory_viz), a leak stopped with its diagnosis,
#           expandable_segments + NVML, NCCL with one rank, the planner within ±10% (llama with
#           the fused RMSNorm too), offload (losses unchanged), the optimizer offloaded (its state off the
#           card, the losses within rounding), batches uploaded without waiting,
#           the fused RMSNorm against the step-by-step form, 8-bit AdamW's CUDA kernel against
#           the CPU's, thrash shrink, the fused cross-entropy's kernels against its CPU path
#           (and its peak against PyTorch's loss; the gradient written in the forward against the
#           two kernels', kernels.fused_loss_gradient), the residual-norm, SwiGLU and RoPE nodes against ATen's ops,
#           metrics.trace counting the GPU's kernels
#   plan    scripts/bench/plan_accuracy.sh --device cuda: the planner's accuracy table (issue 6)
#   bench   scripts/bench/bench_vs_pytorch.sh --device cuda --dtype bf16 on gpt2-124m and smollm2-135m,
#           vocabulary padded to 64 and unpadded: tokens/s, MFU, ratios to eager and torch.compile
#   profile scripts/bench/bench_vs_pytorch.sh --trace on gpt2-124m (micro 16) and smollm2-135m (micro 8)
#           bf16-mixed, global 64, padded:
#           two steps of trainguard, of eager PyTorch (fused AdamW) and of torch.compile through
#           PyTorch's profiler; `trainguard trace` tables of where each spends its GPU time
#   optim   scripts/bench/bench_optimizers.sh --device cuda: one update of each optimizer against fused
#           AdamW on gpt2-124m's parameters
#   savers  scripts/bench/bench_savers.sh --device cuda: peak allocated per memory saver
#   offload scripts/bench/bench_offload.sh --device cuda: Llama-3.2-1B bf16-mixed at micro-batch 1 with the
#           optimizer state on the card and in host memory (memory.offload_optimizer): step time and
#           peaks; a memory.limit between the peaks: exit 3 without offload, trained with it and
#           through oom.escalate: [offload_optimizer]
#   cap     gpt2-124m at micro-batch 64 under memory.limit=16GiB: the guard settles the size
#   detcost scripts/bench/bench_determinism.sh: tokens/s of gpt2-124m bf16-mixed with deterministic and
#           memory.snapshot_on_oom on and off
#   kernels scripts/bench/bench_kernels.sh: tokens/s and peak allocated of smollm2-135m bf16-mixed with
#           kernels.fused_rms_norm off and on; gpt2-124m bf16-mixed with fused AdamW, 8-bit
#           AdamW and Adafactor as tensor ops and as the CUDA kernels (kernels.cuda_optimizers)
#           and with PyTorch's cross-entropy and ours (kernels.fused_cross_entropy; its gradient
#           in its backward and in its forward, kernels.fused_loss_gradient); gpt2-124m
#           and smollm2-135m with ATen's norms and our residual-norm node (kernels.fused_residual_norm);
#           smollm2-135m with ATen's SwiGLU and RoPE and ours (kernels.fused_swiglu, kernels.fused_rope);
#           gpt2-124m and smollm2-135m with and without CUDA graphs (kernels.cuda_graphs);
#           smollm2-135m with q/k/v and gate/up separate and merged (kernels.merged_projections);
#           gpt2-124m with ATen's GELU after the linear node and with it in the node (kernels.fused_gelu);
#           gpt2-124m and smollm2-135m with the weight gradients summed after the backward and in
#           the GEMM (kernels.accumulate_in_gemm, sums), gpt2-124m also as CUDA graphs;
#           both with the defaults, with every speed switch off and with CUDA graphs (levers)
#   fill    scripts/gpu/fill_card.sh: plan --gpu auto --profile --apply on gpt2-124m bf16-mixed (global
#           480), 200 steps: peak reserved ÷ card, OOMs, retries; expandable segments on vs off
set -uo pipefail
source "$(dirname "$0")/../tools.sh"
dest=${OUT:-runs/gpu-checks}; mkdir -p "$dest"
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || { echo "no CUDA device visible to $PY: nothing to check here" >&2; exit 2; }
parts=("$@"); [ ${#parts[@]} -gt 0 ] || parts=(env tests plan bench profile optim savers offload cap detcost kernels fill)

failed=0
part() {  # part NAME COMMAND...: runs it (within its time limit), logs it, records its exit status and time
  local name=$1 t0=$SECONDS rc own="PART_TIMEOUT_$1" limit; shift
  limit=${!own:-${PART_TIMEOUT:-}}
  if [ -n "${DEADLINE:-}" ]; then
    local left=$((DEADLINE - SECONDS))
    if [ -z "$limit" ] || [ "$left" -lt "$limit" ]; then limit=$left; fi
    if [ "$left" -lt 10 ]; then
      echo "$name: skipped, ${left} s left of DEADLINE=$DEADLINE" | tee -a "$dest/summary.txt" >&2; failed=1; return
    fi
  fi
  echo "== $name: $*${limit:+ (at most $limit s)}" >&2
  # KILL to the part's whole process group: a TERM would end bash at once and leave trainguard
  # (which takes TERM as "checkpoint, then stop") running beside the next part.
  if [ -n "$limit" ]; then set -- timeout -s KILL "$limit" "$@"; fi
  "$@" >"$dest/$name.log" 2>&1; rc=$?
  local how="exit $rc"
  if [ -n "$limit" ] && [ "$rc" -eq 137 ] && [ $((SECONDS - t0)) -ge "$limit" ]; then how="timed out (killed after $limit s)"; fi
  [ "$rc" -eq 0 ] || failed=1
  echo "$name: $how, $((SECONDS - t0)) s" | tee -a "$dest/summary.txt" >&2
}

tests_bin=target/release/gpu-tests
# The `bench` and `profile` parts' models: BENCH_CONFIGS="configs/smollm2-135m.yaml" runs one (its
# torch.compile takes minutes of a device call's budget by itself).
export BENCH_CONFIGS=${BENCH_CONFIGS:-configs/gpt2-124m.yaml configs/smollm2-135m.yaml}
# TG_SETS="key=value ...": switches for trainguard's side of the `bench` and `profile` rows.
tg_sets=(); for s in ${TG_SETS:-}; do tg_sets+=(--tg-set "$s"); done
for p in "${parts[@]}"; do
  case "$p" in
    env) part env bash -c "nvidia-smi; '$BIN' env" ;;
    tests)
      if [ ! -x "$tests_bin" ]; then bash scripts/gpu/gpu_bundle.sh >/dev/null; fi
      # The host-emulated kernel checks run in CI; no device time for them here.
      # TRAINGUARD_REQUIRE_CUDA=1: a GPU test that finds no device fails instead of skipping.
      part tests env TRAINGUARD_REPO="$PWD" TRAINGUARD_REQUIRE_CUDA=1 "$tests_bin" gpu:: --nocapture --test-threads=1 --skip emulated_on_the_host ;;
    plan) part plan bash scripts/bench/plan_accuracy.sh --device cuda ;;
    bench)  # issue 15's table: bf16-mixed, padded (default 64) and unpadded, against eager and compile
      # Global 64 as the issue's table (the configs' 512 and 256 are ~0.5M-token steps: minutes).
      part bench bash -c 'rc=0; for pad in ${PADS:-64 1}; do STEPS="${STEPS:-10}" ROUNDS="${ROUNDS:-1}" bash scripts/bench/bench_vs_pytorch.sh --device cuda --dtype bf16 --global-batch 64 --pad-vocab-to $pad "$@" $BENCH_CONFIGS || rc=$?; done; exit $rc' _ ${tg_sets[@]+"${tg_sets[@]}"} ;;
    profile)  # the traces as one file: a device call brings back at most eight
      part profile env STEPS="${STEPS:-5}" ROUNDS=1 bash scripts/bench/bench_vs_pytorch.sh --device cuda --dtype bf16 --global-batch 64 \
        --trace "$dest/profile" ${tg_sets[@]+"${tg_sets[@]}"} $BENCH_CONFIGS
      tar czf "$dest/profile.tgz" -C "$dest" profile && rm -rf "$dest/profile" ;;
    optim) part optim bash scripts/bench/bench_optimizers.sh --device cuda ;;
    savers) part savers bash scripts/bench/bench_savers.sh --device cuda ;;
    offload) part offload bash scripts/bench/bench_offload.sh --device cuda ;;
    cap)
      run_dir=$(mktemp -d)  # not under $dest: the run's checkpoints are gigabytes
      part cap "$BIN" train --config configs/gpt2-124m.yaml --set device=cuda --set out_dir="$run_dir" \
        --set train.micro_batch_size=64 --set train.global_batch_size=64 --set train.max_steps=6 \
        --set train.warmup_steps=1 --set train.eval_interval=0 --set checkpoint.interval=0 --set checkpoint.at_end=false --set memory.limit=16GiB
      cp "$run_dir/events.jsonl" "$dest/cap-events.jsonl" 2>/dev/null; rm -rf "$run_dir" ;;
    detcost) part detcost bash scripts/bench/bench_determinism.sh --device cuda ;;
    kernels) part kernels bash scripts/bench/bench_kernels.sh --device cuda ;;
    fill)  # its nine files as one: a device call brings back at most eight
      part fill env OUT="$dest/fill" bash scripts/gpu/fill_card.sh
      tar czf "$dest/fill.tgz" -C "$dest" fill && rm -rf "$dest/fill" ;;
    *) echo "unknown part '$p' (env tests plan bench profile optim savers offload cap detcost kernels fill)" >&2; exit 2 ;;
  esac
done
cat "$dest/summary.txt"
exit $failed
