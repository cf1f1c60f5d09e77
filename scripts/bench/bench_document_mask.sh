#!/usr/bin/env bash
# `data.document_mask` against plain causal attention on a GPU: tokens/s (median from step 5) and
# the peak allocated of gpt2-124m and smollm2-135m in bf16-mixed, trained on the example corpus
# (scripts/data/example_corpus.py, prepared by `trainguard prepare`: stories and notes of
# ~40-150 tokens, so a 1024- or 2048-token window packs tens of documents, each ended by
# <|endoftext|>). The figure the issue asks for: the masked line's "vs first" at 0.95× or above
# (the variable-length flash kernel, no t × t mask). Needs a CUDA device.
# Usage: scripts/bench/bench_document_mask.sh   (env STEPS=30)
set -euo pipefail
source "$(dirname "$0")/../tools.sh"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
"$PY" scripts/data/example_corpus.py "$work/example" >/dev/null
"$BIN" prepare --tokenizer "$work/example/tokenizer.json" --out "$work/data" "$work/example/corpus" --val-tokens 20000 >/dev/null
data="--set data.source=tokens:$work/data --set precision=bf16-mixed"
for shape in "configs/gpt2-124m.yaml --set train.global_batch_size=16 --set train.micro_batch_size=16" \
             "configs/smollm2-135m.yaml --set train.global_batch_size=8 --set train.micro_batch_size=8"; do
  echo "### ${shape%% *}"
  bash scripts/bench/bench_switches.sh --device cuda "--config $shape $data" "unused" \
    "causal|data.document_mask=false" "document mask|data.document_mask=true"
done
