"""A Llama-family decoder written out with torch.nn.functional: the reference trainguard's
`model.arch: llama` is checked against (tests/it/reference.rs).

Reads the model's weights (safetensors, Hugging Face names), token ids and targets, runs
`--steps` training steps (loss, gradients, then torch.optim.AdamW with decay on the linear
weights only, as trainguard), and writes logits of the first step, each step's loss and
gradients to --out (safetensors). Attention is spelled out (repeat the key/value heads, scores,
causal mask, softmax), not taken from scaled_dot_product_attention, so grouped-query attention is
checked against its definition. With --transformers it also loads the same weights into
`transformers`' LlamaForCausalLM and writes its logits as `hf_logits` (no download: the model is
built from a config).

The weights may have trainguard's padded vocabulary (`model.pad_vocab_to`): more rows in the
embedding (and lm_head) than `vocab_size`. The logits and the loss are then taken over the user's
columns only (the definition the padded model must equal), and transformers gets the user's rows.

  python scripts/reference/reference_llama.py --model model.json --weights w.safetensors \
      --batch batch.safetensors --out ref.safetensors [--steps 2 --lr 1e-3 ...] [--transformers]
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from reference_gpt import check_steps


def rms_norm(x, w, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def rope_tables(head_dim, t, theta):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(t).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def linear(p, name, x):
    return F.linear(x, p[name + ".weight"], p.get(name + ".bias"))


def forward(p, m, idx):
    b, t = idx.shape
    nh, nkv = m["n_head"], m.get("n_kv_head") or m["n_head"]
    hd = m["n_embd"] // nh
    eps = m["norm_eps"]
    cos, sin = rope_tables(hd, t, m["rope_theta"])
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    x = F.embedding(idx, p["model.embed_tokens.weight"])
    for i in range(m["n_layer"]):
        pre = f"model.layers.{i}."
        h = rms_norm(x, p[pre + "input_layernorm.weight"], eps)
        q = linear(p, pre + "self_attn.q_proj", h).view(b, t, nh, hd).transpose(1, 2)
        k = linear(p, pre + "self_attn.k_proj", h).view(b, t, nkv, hd).transpose(1, 2)
        v = linear(p, pre + "self_attn.v_proj", h).view(b, t, nkv, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # Each key/value head serves nh / nkv consecutive query heads.
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        scores = scores.masked_fill(~causal, float("-inf"))
        y = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, nh * hd)
        x = x + linear(p, pre + "self_attn.o_proj", y)
        h = rms_norm(x, p[pre + "post_attention_layernorm.weight"], eps)
        gate = F.silu(linear(p, pre + "mlp.gate_proj", h))
        x = x + linear(p, pre + "mlp.down_proj", gate * linear(p, pre + "mlp.up_proj", h))
    x = rms_norm(x, p["model.norm.weight"], eps)
    head = p["model.embed_tokens.weight"] if m["tie_embeddings"] else p["lm_head.weight"]
    return F.linear(x, head)


def transformers_logits(p, m, idx):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=m["vocab_size"], hidden_size=m["n_embd"], intermediate_size=m["ffn_hidden"],
        num_hidden_layers=m["n_layer"], num_attention_heads=m["n_head"],
        num_key_value_heads=m.get("n_kv_head") or m["n_head"], max_position_embeddings=m["seq_len"],
        rms_norm_eps=m["norm_eps"], rope_theta=m["rope_theta"], tie_word_embeddings=m["tie_embeddings"],
        attention_bias=m["bias"], mlp_bias=m["bias"], attn_implementation="eager",
    )
    model = LlamaForCausalLM(cfg).float().eval()
    vocab_rows = ("model.embed_tokens.weight", "lm_head.weight")
    state = {k: v.detach()[:m["vocab_size"]].clone() if k in vocab_rows else v.detach().clone() for k, v in p.items()}
    if m["tie_embeddings"]:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    assert not missing and not unexpected, f"names differ from transformers': missing {missing}, unexpected {unexpected}"
    with torch.no_grad():
        return model(input_ids=idx).logits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="JSON of trainguard's model config")
    ap.add_argument("--weights", required=True)
    ap.add_argument("--batch", required=True, help="safetensors with int64 `x` and `y`")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--transformers", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    m = json.load(open(a.model))
    params = {k: v.float().requires_grad_(True) for k, v in load_file(a.weights).items()}
    batch = load_file(a.batch)
    x, y = batch["x"].long(), batch["y"].long()
    out = {}
    if a.transformers:
        out["hf_logits"] = transformers_logits(params, m, x).contiguous()
    decay = [v for k, v in params.items() if v.dim() == 2 and "embed_tokens" not in k]
    no_decay = [v for k, v in params.items() if not (v.dim() == 2 and "embed_tokens" not in k)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps,
    )
    save_file(check_steps(lambda x: forward(params, m, x), list(params.items()), opt, x, y, m["vocab_size"], a.steps, out), a.out)


if __name__ == "__main__":
    main()
