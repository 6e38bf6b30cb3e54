"""``benchmarks/train_step.py`` on CPU (``--smoke``: tiny BERT and GPT-2, the reference backend): every variant
runs its steps, and the pykernels models (attention, swapped and fused LayerNorms, the LM-head loss) give the
same first-batch loss as transformers' own on the same weights."""
from __future__ import annotations

import pytest

from utils import load_benchmark

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bench():
    yield from load_benchmark("train_step")


def test_smoke_variants_agree(bench):
    rows = []
    assert bench.main(["--smoke", "--steps", "2", "--warmup", "1", "--check"], rows_out=rows) == 0
    assert [(r["case"], r["variant"]) for r in rows] == [("bert", "hf sdpa"), ("bert", "pykernels"),
                                                       ("gpt2", "hf sdpa"), ("gpt2", "pykernels")]
    for r in rows:
        assert r["status"] == "ok" and r["ms_per_step"] > 0
        assert r["eval_loss0_rel_diff"] < 1e-5, r  # fp32 on CPU: the same loss up to rounding


def test_bert_batch_follows_the_80_10_10_rule(bench):
    import torch
    gen = torch.Generator().manual_seed(0)
    inputs, labels = bench.bert_batch(64, 512, 30522, "cpu", gen)
    chosen = labels != -100
    frac = chosen.float().mean().item()
    assert 0.14 < frac < 0.16
    masked = (inputs == bench.BERT_MASK_ID) & chosen
    kept = (inputs == labels) & chosen
    assert 0.78 < masked.sum().item() / chosen.sum().item() < 0.82
    assert 0.08 < kept.sum().item() / chosen.sum().item() < 0.12  # (a random replacement may hit the label: rare)
    assert torch.equal(inputs[~chosen] >= 1000, torch.ones_like(inputs[~chosen], dtype=torch.bool))


def test_pykernels_variant_is_patched(bench):
    import torch
    import pykernels
    case = bench.cases(True)[0]
    torch.manual_seed(0)
    from transformers import AutoModelForMaskedLM
    state = AutoModelForMaskedLM.from_config(case.config(), attn_implementation="sdpa").state_dict()
    model, _ = bench.build(case, "pykernels", state, torch.device("cpu"))
    assert model.config._attn_implementation == "pykernels"
    assert not any(type(m) is torch.nn.LayerNorm for m in model.modules())
    assert any(isinstance(m, pykernels.nn.LayerNorm) for m in model.modules())
    assert sum(type(m).__name__.startswith("FusedBert") for m in model.modules()) == 2 * 2
    assert type(model).__name__ == "FusedLossBertForMaskedLM"  # the loss by masked_lm_loss (fuse_lm_loss)


def test_smoke_gpt2_padded_agrees(bench):
    # the causal-and-padding case: the attention mask reaches both models, the loss skips the padding
    rows = []
    assert bench.main(["--smoke", "--models", "gpt2-padded", "--steps", "1", "--warmup", "1", "--check"],
                      rows_out=rows) == 0
    assert [(r["case"], r["variant"]) for r in rows] == [("gpt2-padded", "hf sdpa"), ("gpt2-padded", "pykernels")]
    assert all(r["status"] == "ok" and r["eval_loss0_rel_diff"] < 1e-5 for r in rows), rows


def test_gpt2_padded_batch(bench):
    import torch
    ids, labels, mask = bench.gpt2_padded_batch(16, 64, 1000, "cpu", torch.Generator().manual_seed(0))
    lengths = mask.sum(1)
    assert lengths[0] == 64 and bool((lengths >= 32).all()) and lengths.unique().numel() > 2
    assert torch.equal(mask, (torch.arange(64)[None] < lengths[:, None]).long())  # right padding
    assert torch.equal(labels == -100, mask == 0) and torch.equal(labels[mask.bool()], ids[mask.bool()])
