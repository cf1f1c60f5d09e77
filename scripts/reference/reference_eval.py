"""Downstream evaluation as trainguard's `eval` computes it, with `transformers`, for tests/it/eval.rs.

Reads a multiple-choice task file in HellaSwag's JSONL layout (`ctx`, or `ctx_a` + " " + `ctx_b`;
`endings`; `label`, a number or a string of digits), loads an `export --hf` directory with
AutoModelForCausalLM and AutoTokenizer (fp32, CPU), and scores each ending on its own (one forward
per ending, no batching): the context's tokens after the end-of-document token, the ending
encoded as " " + ending, the last n_positions + 1 tokens of the two kept, and the sum of the
ending's token log-probabilities. `pred` is the ending with the largest sum, `pred_norm` the one
with the largest sum per character of " " + ending (lm-eval's acc_norm); ties take the first.
Writes one JSON line per example to --scores and prints {"acc", "acc_norm", "examples"}.
"""
import argparse
import json

import torch
import transformers


def context_of(o):
    if o.get("ctx") is not None:
        return o["ctx"]
    b = o.get("ctx_b") or ""
    return o["ctx_a"] + (" " + b if b else "")


def first_argmax(values):
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--task", required=True)
    ap.add_argument("--scores", required=True)
    args = ap.parse_args()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    window = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
    lines = [l for l in open(args.task, encoding="utf-8").read().splitlines() if l.strip()]
    correct = correct_norm = 0
    with open(args.scores, "w") as out, torch.no_grad():
        for index, line in enumerate(lines):
            o = json.loads(line)
            label = int(o["label"])
            ctx = [tok.eos_token_id] + tok(context_of(o), add_special_tokens=False).input_ids
            sums, tokens, chars = [], [], []
            for ending in o["endings"]:
                cont = " " + ending
                end = tok(cont, add_special_tokens=False).input_ids
                kept = (ctx + end)[-(window + 1):]
                logits = model(torch.tensor([kept[:-1]])).logits[0].float()
                logp = torch.log_softmax(logits, dim=-1)
                targets = torch.tensor(kept[1:])
                per_token = logp[torch.arange(len(targets)), targets][-len(end):]
                sums.append(per_token.double().sum().item())
                tokens.append(len(end))
                chars.append(len(cont))
            pred = first_argmax(sums)
            pred_norm = first_argmax([s / c for s, c in zip(sums, chars)])
            correct += pred == label
            correct_norm += pred_norm == label
            out.write(json.dumps({"index": index, "label": label, "sums": sums, "tokens": tokens,
                                  "chars": chars, "pred": pred, "pred_norm": pred_norm}) + "\n")
    n = len(lines)
    print(json.dumps({"acc": correct / n, "acc_norm": correct_norm / n, "examples": n}))


if __name__ == "__main__":
    main()
