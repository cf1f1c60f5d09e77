"""Document-masked attention written out with torch.nn.functional: the reference trainguard's
`data.document_mask` is checked against (tests/it/reference.rs), for GPT-2 and Llama.

A packed row holds documents that each end at the EOS id (as `trainguard prepare` writes them);
the row's first token starts a document, and so does every token after an EOS. A token attends
only to the tokens of its own document up to itself (a block-diagonal causal mask, spelled out
on the scores: no scaled_dot_product_attention), and positions restart at 0 at each document's
first token: RoPE's angles (Llama) and the learned position embedding's rows (GPT-2) are those
of the position inside the document.

Reads trainguard's model config (JSON), its weights (safetensors, trainguard's names; a padded
vocabulary is cut to `vocab_size`), int64 `x` and `y`; writes the logits, the mean
cross-entropy (`loss`) and every weight's gradient (`grad.<name>`) to --out.

  python scripts/reference/reference_document_mask.py --model model.json --weights w.safetensors \
      --batch batch.safetensors --eos 0 --out ref.safetensors
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file


def documents(idx, eos):
    """Each token's document number and its position inside its document, [b, t] each."""
    b, t = idx.shape
    starts = torch.ones(b, t, dtype=torch.bool)
    starts[:, 1:] = idx[:, :-1] == eos
    doc = starts.long().cumsum(1)
    pos = torch.zeros(b, t, dtype=torch.long)
    for r in range(b):
        p = 0
        for i in range(t):
            p = 0 if starts[r, i] else p + 1
            pos[r, i] = p
    return doc, pos


def allowed(doc):
    """[b, 1, t, t]: query i may read key j (same document, j <= i)."""
    t = doc.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def attend(q, k, v, mask):
    """q [b, h, t, d] over k, v [b, kv, t, d] (each kv head serving h / kv query heads)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def linear(p, name, x):
    return F.linear(x, p[name + ".weight"], p.get(name + ".bias"))


def gpt2(p, m, idx, doc, pos):
    b, t = idx.shape
    nh, c = m["n_head"], m["n_embd"]
    mask = allowed(doc)
    ln = lambda name, x: F.layer_norm(x, (c,), p[name + ".weight"], p.get(name + ".bias"), 1e-5)
    x = F.embedding(idx, p["wte.weight"]) + F.embedding(pos, p["wpe.weight"])
    for i in range(m["n_layer"]):
        pre = f"h.{i}."
        q, k, v = linear(p, pre + "attn.c_attn", ln(pre + "ln_1", x)).split(c, dim=2)
        heads = lambda z: z.view(b, t, nh, c // nh).transpose(1, 2)
        y = attend(heads(q), heads(k), heads(v), mask).transpose(1, 2).reshape(b, t, c)
        x = x + linear(p, pre + "attn.c_proj", y)
        x = x + linear(p, pre + "mlp.c_proj", F.gelu(linear(p, pre + "mlp.c_fc", ln(pre + "ln_2", x))))
    return F.linear(ln("ln_f", x), p["wte.weight"])


def rms_norm(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def llama(p, m, idx, doc, pos):
    b, t = idx.shape
    nh, nkv = m["n_head"], m.get("n_kv_head") or m["n_head"]
    hd, eps = m["n_embd"] // nh, m["norm_eps"]
    inv_freq = 1.0 / (m["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    angles = pos.float()[..., None] * inv_freq  # [b, t, hd/2]: the position inside the document
    emb = torch.cat([angles, angles], dim=-1)[:, None]  # [b, 1, t, hd]
    cos, sin = emb.cos(), emb.sin()
    mask = allowed(doc)
    x = F.embedding(idx, p["model.embed_tokens.weight"])
    for i in range(m["n_layer"]):
        pre = f"model.layers.{i}."
        h = rms_norm(x, p[pre + "input_layernorm.weight"], eps)
        q = linear(p, pre + "self_attn.q_proj", h).view(b, t, nh, hd).transpose(1, 2)
        k = linear(p, pre + "self_attn.k_proj", h).view(b, t, nkv, hd).transpose(1, 2)
        v = linear(p, pre + "self_attn.v_proj", h).view(b, t, nkv, hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        y = attend(q, k, v, mask).transpose(1, 2).reshape(b, t, nh * hd)
        x = x + linear(p, pre + "self_attn.o_proj", y)
        h = rms_norm(x, p[pre + "post_attention_layernorm.weight"], eps)
        x = x + linear(p, pre + "mlp.down_proj", F.silu(linear(p, pre + "mlp.gate_proj", h)) * linear(p, pre + "mlp.up_proj", h))
    x = rms_norm(x, p["model.norm.weight"], eps)
    head = p["model.embed_tokens.weight"] if m["tie_embeddings"] else p["lm_head.weight"]
    return F.linear(x, head)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="JSON of trainguard's model config")
    ap.add_argument("--weights", required=True)
    ap.add_argument("--batch", required=True, help="safetensors with int64 `x` and `y`")
    ap.add_argument("--eos", type=int, required=True, help="the id that ends a document")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    m = json.load(open(a.model))
    params = {k: v.float().requires_grad_(True) for k, v in load_file(a.weights).items()}
    batch = load_file(a.batch)
    x, y = batch["x"].long(), batch["y"].long()
    doc, pos = documents(x, a.eos)
    forward = llama if m["arch"] == "llama" else gpt2
    logits = forward(params, m, x, doc, pos)[..., : m["vocab_size"]]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    names = list(params)
    grads = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)
    out = {"logits": logits.detach().contiguous(), "loss": loss.detach().reshape(1), "positions": pos}
    for n, g in zip(names, grads):
        out["grad." + n] = (torch.zeros_like(params[n]) if g is None else g).contiguous()
    save_file(out, a.out)


if __name__ == "__main__":
    main()
