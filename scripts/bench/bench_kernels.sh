#!/usr/bin/env bash
# What the `kernels:` switches buy, each table against its first row (tokens/s, peak allocated):
# 1. (rms) a Llama (configs/smollm2-135m.yaml, bf16-mixed, sequence 2048, micro-batch 8, global 32)
#    with `kernels.fused_rms_norm` off and on;
# 2. (optim) gpt2-124m bf16-mixed (micro 16, global 64) with fused AdamW, then 8-bit AdamW and Adafactor,
#    each as tensor ops and as our NVRTC kernels (`kernels.cuda_optimizers`): issue 15 asks both
#    within 5% of fused AdamW per step;
# 3. (loss) gpt2-124m bf16-mixed (micro 16, global 64) with PyTorch's cross-entropy and ours
#    (`kernels.fused_cross_entropy`): its peak is the logits' (10 bytes a logit against 4); ours
#    with the logits' gradient in its backward and written over them in its forward
#    (`kernels.fused_loss_gradient`: one kernel, 2 bytes a logit);
# 4. (norms) the norms with their residual add and cast fused (`kernels.fused_residual_norm`): gpt2-124m
#    bf16-mixed (micro 16, global 64) and smollm2-135m bf16-mixed (micro 8, seq 2048), each with
#    ATen's ops (the fused RMSNorm for the Llama) and with our node.
# 5. (swiglu) smollm2-135m bf16-mixed (micro 8, seq 2048) with ATen's silu and multiply and with
#    our SwiGLU node (`kernels.fused_swiglu`);
# 6. (rope) the same with ATen's RoPE ops and with our RoPE node (`kernels.fused_rope`);
# 7. (linear) gpt2-124m bf16-mixed (micro 16, global 64) and smollm2-135m (micro 8) with autocast's
#    linear and with our linear node (`kernels.fused_linear`: fp32 weight and bias gradients);
# 8. (graphs) gpt2-124m bf16-mixed (micro 16, global 64) and smollm2-135m (micro 8, seq 2048)
#    with each micro-step's kernels launched one by one and replayed as a CUDA graph
#    (`kernels.cuda_graphs`); smollm2 also with the SwiGLU and RoPE nodes beside the graphs.
# 9. (merged) smollm2-135m (micro 8, seq 2048) with q/k/v and gate/up as separate matrix
#    multiplications and merged (`kernels.merged_projections`), with ATen's SwiGLU and RoPE and
#    with our nodes.
# 10. (gelu) gpt2-124m bf16-mixed (micro 16, global 64) with ATen's GELU after the linear node and
#    with the GELU in the node (`kernels.fused_gelu`: GELU's and the bias's gradients in one pass);
# 11. (sums) gpt2-124m bf16-mixed (micro 16, global 64) and smollm2-135m (micro 8, seq 2048) with
#    the linear node's weight gradients added into the step's sums by a multi-tensor add and inside
#    the GEMM (`kernels.accumulate_in_gemm`), both also as CUDA graphs;
# 12. (levers) gpt2-124m and smollm2-135m with the defaults, with every speed switch off
#    (ATen's ops, what the defaults buy at once) and with CUDA graphs on (the one speed switch
#    off by default).
# 13. (ckpt) what activation checkpointing costs: gpt2-124m and smollm2-135m with CUDA graphs, without
#    it, every block recomputed (`blocks`, issue 15 asks ≤ 25% slower) and the first 6 (`first_n:6`).
# Needs a CUDA device (scripts/gpu/gpu_checks.sh part `kernels`); `--device cpu` runs small configs,
# where ATen has no fused RMSNorm and 8-bit AdamW and Adafactor always run their CPU kernels: rows
# that run the same code there.
# Usage: scripts/bench/bench_kernels.sh [--device cuda|cpu]   (env STEPS=30; TABLES: some of
#   `rms optim loss norms swiglu rope linear graphs merged gelu sums levers ckpt`, in that order by default: all)
set -euo pipefail
here=$(dirname "$0")
gpt2="--config configs/gpt2-124m.yaml --set precision=bf16-mixed --set train.micro_batch_size=16 --set train.global_batch_size=64"
gpt2_cpu="--config configs/bench-10m.yaml --set precision=bf16-mixed --set train.micro_batch_size=8 --set train.global_batch_size=16"
smollm="--config configs/smollm2-135m.yaml --set train.micro_batch_size=8 --set train.global_batch_size=32"
smollm_cpu="--config configs/bench-llama-10m.yaml --set train.micro_batch_size=8 --set train.global_batch_size=16"

failed=0
rows() {  # SHAPE CPU_SHAPE "NAME|switches"...: one shape's rows (scripts/bench/bench_switches.sh); a failed row is in the table, and the later tables still run
  bash "$here/bench_switches.sh" ${args[@]+"${args[@]}"} "$@" || failed=1
}
gpt2_rows() { rows "$gpt2" "$gpt2_cpu" "$@"; }
smollm_rows() { rows "$smollm" "$smollm_cpu" "$@"; }

table() {  # NAME: one table, then a blank line
  case "$1" in
    rms) smollm_rows "RMSNorm step by step|kernels.fused_rms_norm=false" "RMSNorm fused|kernels.fused_rms_norm=true" ;;
    optim) rows "$gpt2" "--config configs/debug.yaml --set train.micro_batch_size=8 --set train.global_batch_size=16" \
      "fused AdamW|optimizer.name=adamw" \
      "8-bit AdamW, tensor ops|optimizer.name=adamw8bit kernels.cuda_optimizers=false" \
      "8-bit AdamW, CUDA kernel|optimizer.name=adamw8bit kernels.cuda_optimizers=true" \
      "Adafactor, tensor ops|optimizer.name=adafactor kernels.cuda_optimizers=false" \
      "Adafactor, CUDA kernels|optimizer.name=adafactor kernels.cuda_optimizers=true" ;;
    loss) gpt2_rows "PyTorch's cross-entropy|kernels.fused_cross_entropy=false" "fused cross-entropy, gradient in its backward|kernels.fused_cross_entropy=true kernels.fused_loss_gradient=false" \
      "fused cross-entropy, gradient in its forward|kernels.fused_cross_entropy=true kernels.fused_loss_gradient=true" ;;
    norms)
      gpt2_rows "ATen's add, LayerNorm, cast|kernels.fused_residual_norm=false" "residual-norm node|kernels.fused_residual_norm=true"
      echo
      smollm_rows "ATen's add, fused RMSNorm, casts|kernels.fused_residual_norm=false" "residual-norm node|kernels.fused_residual_norm=true" ;;
    swiglu) smollm_rows "ATen's silu and multiply|kernels.fused_swiglu=false" "SwiGLU node|kernels.fused_swiglu=true" ;;
    rope) smollm_rows "ATen's RoPE ops|kernels.fused_rope=false" "RoPE node|kernels.fused_rope=true" ;;
    linear)
      gpt2_rows "autocast's linear|kernels.fused_linear=false" "linear node|kernels.fused_linear=true"
      echo
      smollm_rows "autocast's linear|kernels.fused_linear=false" "linear node|kernels.fused_linear=true" ;;
    graphs)
      gpt2_rows "kernels launched one by one|kernels.cuda_graphs=false" "CUDA graphs|kernels.cuda_graphs=true"
      echo
      smollm_rows "kernels launched one by one|kernels.cuda_graphs=false" "CUDA graphs|kernels.cuda_graphs=true" \
        "CUDA graphs, SwiGLU and RoPE nodes|kernels.cuda_graphs=true kernels.fused_swiglu=true kernels.fused_rope=true" ;;
    merged) smollm_rows "separate projections|kernels.merged_projections=false" "merged q/k/v, gate/up|kernels.merged_projections=true" \
      "separate, SwiGLU and RoPE nodes|kernels.merged_projections=false kernels.fused_swiglu=true kernels.fused_rope=true" \
      "merged, SwiGLU and RoPE nodes|kernels.merged_projections=true kernels.fused_swiglu=true kernels.fused_rope=true" ;;
    gelu) gpt2_rows "ATen's GELU after the linear node|kernels.fused_gelu=false" "GELU in the linear node|kernels.fused_gelu=true" ;;
    sums)
      gpt2_rows "weight gradients added after the backward|kernels.accumulate_in_gemm=false" "added in the GEMM|kernels.accumulate_in_gemm=true" \
        "after the backward, CUDA graphs|kernels.accumulate_in_gemm=false kernels.cuda_graphs=true" "in the GEMM, CUDA graphs|kernels.accumulate_in_gemm=true kernels.cuda_graphs=true"
      echo
      smollm_rows "weight gradients added after the backward|kernels.accumulate_in_gemm=false" "added in the GEMM|kernels.accumulate_in_gemm=true" ;;
    levers)
      off="kernels.fused_cross_entropy=false kernels.fused_residual_norm=false kernels.fused_swiglu=false kernels.fused_rope=false kernels.fused_linear=false kernels.merged_projections=false"
      gpt2_rows "defaults|" "every speed switch off|$off" "defaults, CUDA graphs|kernels.cuda_graphs=true"
      echo
      smollm_rows "defaults|" "every speed switch off|$off" "defaults, CUDA graphs|kernels.cuda_graphs=true" ;;
    ckpt)
      g=kernels.cuda_graphs=true; c=memory.activation_checkpointing
      gpt2_rows "no checkpointing|$g" "every block recomputed|$g $c=blocks" "first 6 of 12 blocks|$g $c=first_n:6"
      echo
      smollm_rows "no checkpointing|$g" "every block recomputed|$g $c=blocks" "first 6 of 30 blocks|$g $c=first_n:6" ;;
    *) echo "unknown table '$1' (rms optim loss norms swiglu rope linear graphs merged gelu sums levers ckpt)" >&2; exit 2 ;;
  esac
  echo
}

args=("$@")
for t in ${TABLES:-rms optim loss norms swiglu rope linear graphs merged gelu sums levers ckpt}; do table "$t"; done
exit $failed
