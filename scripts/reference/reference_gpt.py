"""The same GPT, batch split and AdamW as trainguard, in plain PyTorch eager mode.

Used by scripts/bench/bench_vs_pytorch.sh to measure trainguard's throughput against PyTorch on
the same machine. Reads the same YAML config (model and train keys) and prints one JSON line
with tokens/s measured over the steps after warm-up.

With --check-weights (tests/it/reference.rs) it is the reference trainguard's GPT is checked
against instead: it loads trainguard's weights (safetensors, trainguard's names), runs
--check-steps steps on the batch in --check-batch (loss, gradients, then torch.optim.AdamW with
decay on the linear weights) and writes the first step's logits and each step's loss and
gradients, under trainguard's names, to --check-out.

The vocabulary is padded as trainguard pads it (`model.pad_vocab_to`, default 64, or
--pad-vocab-to): the embedding has the padded rows (zero at the start), the loss masks the padded
logits to -inf; check mode computes the loss over the user's columns only (the definition the
padded model must equal). --compile runs the model under torch.compile (default mode); --dtype
bf16 runs forward and loss under bf16 autocast (trainguard's `precision: bf16-mixed`).
"""
import argparse
import contextlib
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml


class Block(nn.Module):
    def __init__(self, c, h, bias, dropout):
        super().__init__()
        self.h, self.dropout = h, dropout
        self.ln_1 = nn.LayerNorm(c, bias=bias)
        self.c_attn = nn.Linear(c, 3 * c, bias=bias)
        self.c_proj = nn.Linear(c, c, bias=bias)
        self.ln_2 = nn.LayerNorm(c, bias=bias)
        self.c_fc = nn.Linear(c, 4 * c, bias=bias)
        self.mlp_proj = nn.Linear(4 * c, c, bias=bias)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        x = x + F.dropout(self.c_proj(y), p, self.training)
        x = x + F.dropout(self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)))), p, self.training)
        return x


def padded_vocab(m):
    """`vocab_size` rounded up to `pad_vocab_to` (trainguard's default 64)."""
    pad = max(1, int(m.get("pad_vocab_to") or 64))
    return -(-m["vocab_size"] // pad) * pad


def zero_padding(weight, vocab):
    with torch.no_grad():
        weight[vocab:].zero_()


def masked_loss(logits, targets, vocab):
    """Cross-entropy with the padded columns' logits at -inf (no probability, no gradient)."""
    if logits.size(-1) > vocab:
        logits[..., vocab:] = float("-inf")
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class GPT(nn.Module):
    def __init__(self, m):
        super().__init__()
        c = m["n_embd"]
        self.vocab = m["vocab_size"]
        self.wte = nn.Embedding(padded_vocab(m), c)
        self.wpe = nn.Embedding(m["seq_len"], c)
        self.blocks = nn.ModuleList(Block(c, m["n_head"], m["bias"], m["dropout"]) for _ in range(m["n_layer"]))
        self.ln_f = nn.LayerNorm(c, bias=m["bias"])
        self.dropout = m["dropout"]
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * m["n_layer"]) if name.endswith("c_proj.weight") or name.endswith("mlp_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        zero_padding(self.wte.weight, self.vocab)

    def logits(self, idx):
        t = idx.shape[1]
        x = F.dropout(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)), self.dropout, self.training)
        for blk in self.blocks:
            x = blk(x)
        return F.linear(self.ln_f(x), self.wte.weight)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = F.dropout(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)), self.dropout, self.training)
        for blk in self.blocks:
            x = blk(x)
        return masked_loss(F.linear(self.ln_f(x), self.wte.weight), targets, self.vocab)


def ours_to_theirs(name):
    """trainguard's parameter name → this module's."""
    if not name.startswith("h."):
        return name
    _, i, rest = name.split(".", 2)
    rest = {"attn.c_attn": "c_attn", "attn.c_proj": "c_proj", "mlp.c_fc": "c_fc", "mlp.c_proj": "mlp_proj"}.get(rest.rsplit(".", 1)[0], rest.rsplit(".", 1)[0]) + "." + rest.rsplit(".", 1)[1]
    return f"blocks.{i}.{rest}"


def check(args, m, t):
    from safetensors.torch import load_file, save_file

    torch.set_num_threads(1)
    model = GPT(m).eval()
    ours = load_file(args.check_weights)
    theirs = {ours_to_theirs(k): v for k, v in ours.items()}
    model.load_state_dict(theirs, strict=True)
    names = {ours_to_theirs(k): k for k in ours}
    batch = load_file(args.check_batch)
    x, y = batch["x"].long(), batch["y"].long()
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith(("wte", "wpe"))]
    other = [p for n, p in model.named_parameters() if not (p.dim() == 2 and not n.startswith(("wte", "wpe")))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t["weight_decay"]}, {"params": other, "weight_decay": 0.0}],
                            lr=t["lr"], betas=(t["beta1"], t["beta2"]), eps=t.get("eps", 1e-8))
    named = [(names[n], p) for n, p in model.named_parameters()]
    save_file(check_steps(model.logits, named, opt, x, y, m["vocab_size"], args.check_steps), args.check_out)


def check_steps(logits_of, named, opt, x, y, vocab, steps, out=None):
    """Check mode (also scripts/reference/reference_llama.py's): `steps` optimizer steps on (x, y), the loss
    over the user's `vocab` columns; records step 0's logits and each step's loss and gradients
    under trainguard's names (`named`: (name, parameter) pairs)."""
    out = {} if out is None else out
    for step in range(steps):
        logits = logits_of(x)[..., :vocab]
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:
            out["logits"] = logits.detach().contiguous()
        out[f"loss.{step}"] = loss.detach().reshape(1)
        for name, p in named:
            out[f"grad.{step}.{name}"] = p.grad.detach().clone().contiguous()
        opt.step()
    return out


def main():
    ap = argparse.ArgumentParser()
    add_bench_args(ap)
    ap.add_argument("--check-weights", help="check mode: trainguard's weights (safetensors)")
    ap.add_argument("--check-batch", help="check mode: safetensors with int64 `x` and `y`")
    ap.add_argument("--check-out", help="check mode: where logits, losses and gradients go")
    ap.add_argument("--check-steps", type=int, default=2)
    args = ap.parse_args()
    # JSON is read as JSON: PyYAML takes `1e-8` (no dot) for a string.
    cfg = json.load(open(args.config)) if args.config.endswith(".json") else yaml.safe_load(open(args.config))
    m = {"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 256, "seq_len": 64, "dropout": 0.0, "bias": True, **(cfg.get("model") or {})}
    t = {"global_batch_size": 32, "micro_batch_size": 8, "lr": 3e-3, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "grad_clip": 1.0, **(cfg.get("train") or {})}
    if args.pad_vocab_to is not None:
        m["pad_vocab_to"] = args.pad_vocab_to
    if args.check_weights:
        return check(args, m, t)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(1337)
    model = GPT(m).to(torch.device(args.device))
    print(json.dumps(bench(model, m, t, args, no_decay=("wte", "wpe"))))


def add_bench_args(ap):
    """The options both references share (this one and scripts/reference/reference_llama_bench.py)."""
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fused", action="store_true", help="torch.optim.AdamW(fused=True), as trainguard's default")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (default mode)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: bf16 autocast (bf16-mixed)")
    ap.add_argument("--pad-vocab-to", type=int, help="pad the vocabulary rows to a multiple of this (default: the config's model.pad_vocab_to, else 64)")
    ap.add_argument("--global-batch", type=int, help="sequences per optimizer step (default: the config's train.global_batch_size)")
    ap.add_argument("--trace", help="after the timed steps, profile two more with torch.profiler and write their Chrome trace here "
                                    "(`trainguard trace FILE` tabulates it beside trainguard's own)")


def flops_per_token(model, m):
    """Training FLOPs per token: 6 × the parameters of the user's vocabulary (the padded rows do
    no useful work) plus attention's 12 × layers × width × sequence (PaLM's MFU formula)."""
    n = sum(p.numel() for p in model.parameters())
    heads = 1 + int(not m.get("tie_embeddings", True))
    n -= heads * (padded_vocab(m) - m["vocab_size"]) * m["n_embd"]
    return 6 * n + 12 * m["n_layer"] * m["n_embd"] * m["seq_len"]


def bench(model, m, t, args, no_decay, **extra):
    """trainguard's step on `model` (micro-batches, token-weighted losses, clip, AdamW with decay
    on 2-D weights whose names do not start with `no_decay`): tokens/s after warm-up, as a dict.
    Shared by the Llama reference (scripts/reference/reference_llama_bench.py)."""
    if args.global_batch:
        t = {**t, "global_batch_size": args.global_batch}
    dev = torch.device(args.device)
    flops = flops_per_token(model, m)
    params = sum(p.numel() for p in model.parameters())
    step_model = torch.compile(model) if args.compile else model
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith(no_decay)]
    other = [p for n, p in model.named_parameters() if not (p.dim() == 2 and not n.startswith(no_decay))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t["weight_decay"]}, {"params": other, "weight_decay": 0.0}],
                            lr=t["lr"], betas=(t["beta1"], t["beta2"]), eps=1e-8, fused=args.fused or None)
    # On the device, batches gathered there: a blocking copy from the host per micro-step would
    # wait for the GPU's queue to drain each time (trainguard's uploads do not), and slow this side.
    corpus = torch.randint(0, m["vocab_size"], (1 << 20,), dtype=torch.int64, device=dev)
    g, micro, s = t["global_batch_size"], t["micro_batch_size"], m["seq_len"]
    window = torch.arange(s, device=dev)
    accum = g // micro
    times = []
    timed = args.warmup + args.steps
    traced = 2 if getattr(args, "trace", None) else 0
    profiler = None
    for step in range(timed + traced):
        if step == timed:
            # After the timed steps, so the profiler's cost is in no timing. Each step is a
            # ProfilerStep#N range, as torch.profiler's schedule marks them; N counts from 1, as
            # trainguard's steps do, so both traces name the same steps.
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            profiler = torch.profiler.profile(activities=acts)
            profiler.__enter__()
        mark = torch.profiler.record_function(f"ProfilerStep#{step + 1}") if profiler else contextlib.nullcontext()
        mark.__enter__()
        t0 = time.perf_counter()
        for _ in range(accum):
            at = torch.randint(0, corpus.numel() - s - 1, (micro, 1), device=dev) + window
            x, y = corpus[at], corpus[at + 1]
            with autocast:
                loss = step_model(x, y) * (micro / g)
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()  # the same one host sync per step as trainguard's
        float(norm)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        mark.__exit__(None, None, None)
        if args.warmup <= step < timed:
            times.append(time.perf_counter() - t0)
    if profiler:
        profiler.__exit__(None, None, None)
        profiler.export_chrome_trace(args.trace)
    mean = sum(times) / len(times)
    impl = "pytorch" + ("-compile" if args.compile else "") + ("-fused-adamw" if args.fused else "")
    return {"impl": impl, **extra, "dtype": args.dtype, "tokens_per_s": g * s / mean, "step_s": mean, "steps": len(times),
            "params": params, "padded_vocab": padded_vocab(m), "flops_per_token": flops, "threads": torch.get_num_threads(), "last_loss": loss_value}


if __name__ == "__main__":
    main()
