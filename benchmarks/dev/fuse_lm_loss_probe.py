"""``integrations.transformers.fuse_lm_loss`` against transformers' own LM loss, through the whole model: a step's
``model(input_ids, labels=labels).loss.backward()`` (bf16 autocast, fp32 weights, eager attention off: ``sdpa``) on
two-layer models with real vocabularies, where the LM head and its loss are most of the step. Per model and variant:
do_bench time of the step (host included), GPU time (the kernels' summed device time), peak memory above the
model and batch, and the loss (the variants must agree).

Models: a two-layer Llama at Llama 3's vocabulary (128256, hidden 2048) on 4 x 2048 tokens, and a two-layer GPT-2
(50257, 768) on 8 x 1024, every next token a target; a two-layer BERT-base (30522, 768) on 32 x 512 with 15%
labelled.

Usage (GPU): ``python benchmarks/dev/fuse_lm_loss_probe.py``; writes ``$OUT/fuse_lm_loss_probe.txt``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402


def _models():
    from transformers import BertConfig, GPT2Config, LlamaConfig
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM
    return [
        ("llama-2l-v128256", AutoModelForCausalLM,
         LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=2,
                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096), 4, 2048, 1.0),
        ("gpt2-2l", AutoModelForCausalLM,
         GPT2Config(vocab_size=50257, n_embd=768, n_layer=2, n_head=12, n_positions=1024, bos_token_id=0,
                    eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), 8, 1024, 1.0),
        ("bert-base-2l", AutoModelForMaskedLM,
         BertConfig(num_hidden_layers=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), 32, 512, 0.15),
    ]


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a GPU")
        return 0
    from pykernels.integrations import transformers as pk_hf
    out_dir = Path(os.environ.get("OUT", "."))
    lines = [" ".join(f"{k} {v}," for k, v in common.env_record().items())]
    for name, auto, cfg, b, s, frac in _models():
        torch.manual_seed(0)
        base = auto.from_config(cfg, attn_implementation="sdpa")
        ids = torch.randint(0, cfg.vocab_size, (b, s), device="cuda")
        labels = torch.where(torch.rand(b, s, device="cuda") < frac, ids, -100) if frac < 1 else ids
        for variant in ("transformers", "fuse_lm_loss"):
            model = auto.from_config(cfg, attn_implementation="sdpa")
            model.load_state_dict(base.state_dict())
            model.cuda().train()
            if variant == "fuse_lm_loss":
                pk_hf.fuse_lm_loss(model)

            def step(model=model):
                model.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=labels).loss
                loss.backward()
                return loss

            loss = float(step())
            ms = common.bench(step, warmup=3, rep=20)
            gpu = common.gpu_kernel_ms(step)
            model.zero_grad(set_to_none=True)
            peak = common.peak_extra_mib(step)
            lines.append(f"{name:18s} {variant:13s} step {ms:8.2f} ms   GPU {gpu:8.2f} ms   peak extra "
                         f"{peak:9.1f} MiB   loss {loss:.5f}")
            print(lines[-1], flush=True)
            del model
            torch.cuda.empty_cache()
    (out_dir / "fuse_lm_loss_probe.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
