"""The Llama-family decoder trainguard trains (`model.arch: llama`), with the same batch split,
clipping and AdamW, in plain PyTorch eager mode: scripts/bench/bench_vs_pytorch.sh's reference for
Llama configs, as scripts/reference/reference_gpt.py is for GPT-2 ones (the same loop and output: one JSON
line with tokens/s over the steps after warm-up).

The model is written as Hugging Face's `LlamaForCausalLM` computes it: RMSNorm in fp32 then back
to the input's dtype, rotary embedding in the "rotate half" layout with tables made once,
grouped-query attention through `scaled_dot_product_attention(enable_gqa=True)`, a SwiGLU MLP, a
head tied to the embedding or not. Speed only: correctness against trainguard (same weights in,
logits and gradients out) is scripts/reference/reference_llama.py's job. The vocabulary is padded and
masked as in scripts/reference/reference_gpt.py, which also has the shared options (--compile, --dtype,
--pad-vocab-to).
"""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml

# The same training loop, timing, options and vocabulary padding as the GPT-2 reference.
from reference_gpt import add_bench_args, bench, masked_loss, padded_vocab, zero_padding

STD = 0.02


class RMSNorm(nn.Module):
    def __init__(self, c, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotary_tables(head_dim, max_len, theta):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin


class Block(nn.Module):
    def __init__(self, m):
        super().__init__()
        c, bias = m["n_embd"], m["bias"]
        self.h = m["n_head"]
        self.kv = m.get("n_kv_head") or self.h
        self.d = c // self.h
        f = m["ffn_hidden"]
        self.dropout = m["dropout"]
        self.input_layernorm = RMSNorm(c, m["norm_eps"])
        self.q_proj = nn.Linear(c, self.h * self.d, bias=bias)
        self.k_proj = nn.Linear(c, self.kv * self.d, bias=bias)
        self.v_proj = nn.Linear(c, self.kv * self.d, bias=bias)
        self.o_proj = nn.Linear(self.h * self.d, c, bias=bias)
        self.post_attention_layernorm = RMSNorm(c, m["norm_eps"])
        self.gate_proj = nn.Linear(c, f, bias=bias)
        self.up_proj = nn.Linear(c, f, bias=bias)
        self.down_proj = nn.Linear(f, c, bias=bias)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        p = self.dropout if self.training else 0.0
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, t, self.h, self.d).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.kv, self.d).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.kv, self.d).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=self.kv != self.h)
        y = y.transpose(1, 2).contiguous().view(b, t, self.h * self.d)
        x = x + F.dropout(self.o_proj(y), p, self.training)
        h = self.post_attention_layernorm(x)
        x = x + F.dropout(self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)), p, self.training)
        return x


class Llama(nn.Module):
    def __init__(self, m):
        super().__init__()
        c = m["n_embd"]
        self.vocab = m["vocab_size"]
        self.embed_tokens = nn.Embedding(padded_vocab(m), c)
        self.layers = nn.ModuleList(Block(m) for _ in range(m["n_layer"]))
        self.norm = RMSNorm(c, m["norm_eps"])
        self.lm_head = None if m["tie_embeddings"] else nn.Linear(c, padded_vocab(m), bias=False)
        self.dropout = m["dropout"]
        cos, sin = rotary_tables(c // m["n_head"], m["seq_len"], m["rope_theta"])
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, STD)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        for head in (self.embed_tokens, self.lm_head):
            if head is not None:
                zero_padding(head.weight, self.vocab)

    def forward(self, idx, targets):
        t = idx.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = F.dropout(self.embed_tokens(idx), self.dropout, self.training)
        for layer in self.layers:
            x = layer(x, cos, sin)
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return masked_loss(F.linear(self.norm(x), head), targets, self.vocab)


def main():
    ap = argparse.ArgumentParser()
    add_bench_args(ap)
    args = ap.parse_args()
    cfg = yaml.safe_load(open(args.config))
    m = {"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 256, "seq_len": 64, "dropout": 0.0, "bias": True, "n_kv_head": None,
         "rope_theta": 10000.0, "norm_eps": 1e-5, "tie_embeddings": True, **(cfg.get("model") or {})}
    if args.pad_vocab_to is not None:
        m["pad_vocab_to"] = args.pad_vocab_to
    assert m.get("arch") == "llama", f"{args.config}: not a llama config (model.arch: {m.get('arch', 'gpt2')})"
    t = {"global_batch_size": 32, "micro_batch_size": 8, "lr": 3e-3, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "grad_clip": 1.0, **(cfg.get("train") or {})}
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(1337)
    model = Llama(m).to(torch.device(args.device))
    # Decay on the linear weights only (an untied lm_head included), as trainguard.
    print(json.dumps(bench(model, m, t, args, no_decay=("embed_tokens",), arch="llama")))

if __name__ == "__main__":
    main()
