#!/usr/bin/env bash
# Tokenization throughput: `trainguard prepare` against the Python `tokenizers` package's
# `encode_batch` (the same tokenizer.json, the same documents, the same number of threads).
#   scripts/bench/bench_prepare.sh [SIZE_MB=200] [THREADS=all cores]
# Generates a corpus of SIZE_MB (Zipf-distributed pseudo-words, blank-line-separated documents
# of 0.5–4 KB), trains a byte-level BPE of 8,192 tokens on its first 20 MB with Python
# `tokenizers` (not timed), then times
#   - trainguard prepare (end to end: read, split, tokenize, write shards), and
#   - Python: encode_batch(docs, add_special_tokens=False) over batches of 1,000 documents,
#     timing the encoding only (reading and splitting the file are not counted).
# Prints one Markdown table row per tool; MB is 10^6 bytes of input text.
set -euo pipefail
cd "$(dirname "$0")/../.."
SIZE_MB=${1:-200}
THREADS=${2:-$(nproc)}
PY=.venv/bin/python
BIN=${TRAINGUARD_BIN:-target/release/trainguard}
[ -x "$BIN" ] || cargo build --release -q
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

"$PY" - "$WORK" "$SIZE_MB" <<'EOF'
import random, sys
work, size = sys.argv[1], int(sys.argv[2]) * 10**6
rng = random.Random(0)
letters = "etaoinshrdlcumwfgypbvkjxqz"
words = ["".join(rng.choice(letters) for _ in range(rng.randint(1, 9))) for _ in range(20000)]
weights = [1.0 / (i + 1) for i in range(len(words))]
written = 0
with open(f"{work}/corpus.txt", "w") as f:
    while written < size:
        n = rng.randint(80, 700)
        doc = " ".join(rng.choices(words, weights, k=n))
        doc = ".\n".join(doc[i:i + 120] for i in range(0, len(doc), 120)) + ".\n\n"
        f.write(doc)
        written += len(doc)
from tokenizers import Tokenizer, models, trainers, pre_tokenizers, decoders
with open(f"{work}/corpus.txt") as f:
    head = f.read(20 * 10**6)
with open(f"{work}/head.txt", "w") as f:
    f.write(head)
t = Tokenizer(models.BPE())
t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
t.decoder = decoders.ByteLevel()
t.train([f"{work}/head.txt"], trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
t.save(f"{work}/tokenizer.json")
EOF
BYTES=$(stat -c %s "$WORK/corpus.txt")

start=$(date +%s.%N)
TRAINGUARD_NO_PROGRESS=1 "$BIN" prepare --tokenizer "$WORK/tokenizer.json" --out "$WORK/data" --threads "$THREADS" "$WORK/corpus.txt" >"$WORK/prepare.log"
end=$(date +%s.%N)
TG_S=$(echo "$end - $start" | bc -l)
TG_TOKENS=$("$PY" -c "import json,sys; m=json.load(open(sys.argv[1])); print(m['train_tokens']+m['val_tokens']-m['documents'])" "$WORK/data/dataset.json")

PY_OUT=$(RAYON_NUM_THREADS=$THREADS RAYON_RS_NUM_CPUS=$THREADS TOKENIZERS_PARALLELISM=true "$PY" - "$WORK" <<'EOF'
import sys, time
from tokenizers import Tokenizer
work = sys.argv[1]
t = Tokenizer.from_file(f"{work}/tokenizer.json")
docs = []
for block in open(f"{work}/corpus.txt").read().split("\n\n"):
    lines = [l for l in block.split("\n") if l.strip()]
    if lines:
        docs.append("\n".join(lines))
start = time.perf_counter()
n = 0
for i in range(0, len(docs), 1000):
    n += sum(len(e.ids) for e in t.encode_batch(docs[i:i + 1000], add_special_tokens=False))
print(time.perf_counter() - start, n)
EOF
)
PY_S=${PY_OUT% *}
PY_TOKENS=${PY_OUT#* }
[ "$PY_TOKENS" = "$TG_TOKENS" ] || echo "warning: token counts differ: trainguard $TG_TOKENS, python $PY_TOKENS" >&2

mbs() { echo "scale=1; $BYTES / 1000000 / $1" | bc -l; }
echo "corpus: $((BYTES / 1000000)) MB, $TG_TOKENS tokens (without EOS), tokenizer: byte-level BPE 8192, threads: $THREADS, cores: $(nproc)"
echo "| tool | what is timed | seconds | MB/s | ratio |"
echo "|---|---|---|---|---|"
printf '| trainguard prepare | read + tokenize + write shards | %.1f | %s | %.2f× |\n' "$TG_S" "$(mbs "$TG_S")" "$(echo "$PY_S / $TG_S" | bc -l)"
printf '| tokenizers %s encode_batch | tokenize only | %.1f | %s | 1.00× |\n' "$("$PY" -c 'import tokenizers; print(tokenizers.__version__)')" "$PY_S" "$(mbs "$PY_S")"
