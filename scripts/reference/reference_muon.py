"""Muon in plain PyTorch, written from the published description, for tests/it/optimizers.rs.

Reads parameters and per-step gradients from --inputs (safetensors: `param.<i>`, `grad.<step>.<i>`,
`matrix.<i>` and `decay.<i>` as 0/1 scalars), runs --steps updates and writes the parameters and
the matrices' momentum to --out (`param.<i>`, `momentum.<i>`). The block matrices take Nesterov
momentum orthogonalised by the quintic Newton-Schulz iteration, scaled by sqrt(max(1, rows/cols)),
with decoupled weight decay, at --muon-lr; every other parameter takes torch.optim.AdamW at --lr
(decay only where `decay.<i>` is 1). fp32 throughout.
"""
import argparse

import torch
from safetensors.torch import load_file, save_file


def newton_schulz(g, steps):
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--muon-lr", type=float, required=True)
    ap.add_argument("--momentum", type=float, default=0.95)
    ap.add_argument("--ns-steps", type=int, default=5)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95))
    ap.add_argument("--eps", type=float, default=1e-8)
    args = ap.parse_args()
    t = load_file(args.inputs)
    n = sum(1 for k in t if k.startswith("param."))
    params = [t[f"param.{i}"].clone() for i in range(n)]
    matrix = [bool(t[f"matrix.{i}"].item()) for i in range(n)]
    decay = [bool(t[f"decay.{i}"].item()) for i in range(n)]
    others = [i for i in range(n) if not matrix[i]]
    for i in others:
        params[i].requires_grad_(True)
    groups = [
        {"params": [params[i] for i in others if decay[i]], "weight_decay": args.weight_decay},
        {"params": [params[i] for i in others if not decay[i]], "weight_decay": 0.0},
    ]
    adamw = torch.optim.AdamW(groups, lr=args.lr, betas=tuple(args.betas), eps=args.eps)
    momentum = {i: torch.zeros_like(params[i]) for i in range(n) if matrix[i]}
    beta = args.momentum
    for step in range(args.steps):
        grads = [t[f"grad.{step}.{i}"] for i in range(n)]
        with torch.no_grad():
            for i, m in momentum.items():
                g = grads[i]
                m.lerp_(g, 1 - beta)
                update = newton_schulz(g.lerp(m, beta), args.ns_steps)
                update = update * max(1.0, g.size(0) / g.size(1)) ** 0.5
                params[i].mul_(1 - args.muon_lr * args.weight_decay)
                params[i].add_(update, alpha=-args.muon_lr)
        for i in others:
            params[i].grad = grads[i].clone()
        adamw.step()
    out = {f"param.{i}": p.detach().contiguous() for i, p in enumerate(params)}
    out.update({f"momentum.{i}": m.contiguous() for i, m in momentum.items()})
    save_file(out, args.out)


if __name__ == "__main__":
    main()
