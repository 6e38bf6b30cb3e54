"""Whole training steps of Hugging Face BERT-base (MLM) and GPT-2 small (causal LM): transformers' own models
with ``attn_implementation="sdpa"`` against the same models on pykernels' three ops, in one run.

The setup is ANCHORS.md's "whole training step" (transformers, bf16 autocast, fused AdamW): BERT-base
(``BertConfig()``: 12 layers, hidden 768, vocab 30522) on 32 x 512 tokens with 15% of them labelled (the
80/10/10 rule on the inputs), and GPT-2 small (``GPT2Config()``) on 8 x 1024 tokens, every position a target.
Models start from one random init each (no hub access), in train mode (dropout on), so every variant runs the
same weights on the same batch. A step is ``zero_grad; loss = forward; loss.backward(); optimizer.step()``.

Variants (each its own model and ``torch.optim.AdamW(fused=True)``):

* ``hf sdpa``: transformers' model and loss as a user runs them (``model(..., labels=...).loss``): the LM head
  over every position, its logits in bf16, the loss on them in fp32.
* ``pykernels``: the same model with ``attn_implementation="pykernels"`` (``auto``: the C++ attention op for the
  training steps' calls with dropout, the Triton / Gluon kernels for the eval loss's), every ``nn.LayerNorm``
  swapped by ``pykernels.nn.replace_layer_norms``, BERT's post-LN blocks fused (``fuse_residual_layer_norms``:
  branch dropout, residual add and LayerNorm in one kernel), and the LM head and loss by
  ``pykernels.masked_lm_loss`` through ``integrations.transformers.fuse_lm_loss`` (BERT: only the labelled rows;
  GPT-2: ``dense=True`` on the shifted labels), the tied word embeddings cast to bf16 as autocast casts them for a
  linear layer.
* ``pykernels, C++ attention``: the same with the attention on ``backend="cuda"`` (the C++ op: its autograd is
  C++, so an eager step spends less host time in it; ``auto`` takes it too for eager calls with dropout, so the
  training steps of the two variants run the same kernels), where the extension is built.
* ``--models gpt2-padded`` (not in the default set): GPT-2 on a right-padded fine-tuning batch (lengths uniform in
  [512, 1024], one row full; labels -100 at the padding) with its attention mask: the causal-and-padding case, which
  ``attn_implementation="pykernels"`` runs as ``is_causal`` plus a key-padding mask.
* ``--max-valid`` adds BERT's ``pykernels`` variants with ``masked_lm_loss(..., max_valid=tokens // 5)``: the
  loss's backward sized by a bound instead of the count of labelled rows, so the step never waits for the GPU.
* ``--compile`` adds each of the first two with its forward and loss under ``torch.compile`` (default mode).
* ``--graph`` adds each of the first two with the whole step (forward, loss, backward, the fused AdamW step with
  ``capturable=True``) captured once in a CUDA graph and replayed (``torch.cuda.graph``, autocast without its weight
  cache as CUDA graphs need): no host time a step. Dropout stays on: transformers' own dropout and pykernels' draw
  their seeds on the device, so each replay draws fresh masks. BERT's masked-LM loss takes its bounded backward
  there (the labelled rows are not counted on the host: the capacity path for the warm-up's count plus a margin,
  graph-safe kernels for any rows past it), GPT-2's the dense one.

Reported per variant: milliseconds a step (wall clock over ``--steps`` steps after ``--warmup``, host
included, as a training loop sees it), tokens a second, peak memory allocated during the timed steps, and the
loss of the first batch in eval mode (no dropout) next to ``hf sdpa``'s on the same weights: the variants must
agree on it (bf16 autocast: within 2%; this run prints and records the difference, ``--check`` fails on it).

Usage (GPU): ``python benchmarks/train_step.py [--models bert gpt2] [--steps 20] [--warmup 5] [--compile]
[--budget-s 300]``; rows go to ``benchmarks/results/train_step_<card>_<date>.csv`` and ``$OUT/train_step.csv``.
``--smoke`` runs tiny configs on CPU (the reference backend; nothing written); without CUDA and without
``--smoke`` it says so and exits 0.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

BERT_MASK_ID = 103  # bert-base-uncased's [MASK]


@dataclass
class Case:
    name: str
    batch: int
    seqlen: int
    config: Callable[[], object]
    causal: bool
    padded: bool = False  # right-padded rows (an attention mask, labels -100 at the padding)


def bert_batch(batch: int, seqlen: int, vocab: int, device, gen: torch.Generator):
    """input_ids with 15% of positions chosen, labels at those positions (-100 elsewhere); of the chosen inputs
    80% become [MASK], 10% a random token, 10% stay (BERT's rule)."""
    ids = torch.randint(1000, vocab, (batch, seqlen), generator=gen)
    chosen = torch.rand(batch, seqlen, generator=gen) < 0.15
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    r = torch.rand(batch, seqlen, generator=gen)
    inputs = torch.where(chosen & (r < 0.8), torch.full_like(ids, BERT_MASK_ID), ids)
    inputs = torch.where(chosen & (r >= 0.8) & (r < 0.9), torch.randint(1000, vocab, ids.shape, generator=gen), inputs)
    return inputs.to(device), labels.to(device)


def gpt2_batch(batch: int, seqlen: int, vocab: int, device, gen: torch.Generator):
    ids = torch.randint(0, vocab, (batch, seqlen), generator=gen).to(device)
    return ids, ids, None


def gpt2_padded_batch(batch: int, seqlen: int, vocab: int, device, gen: torch.Generator):
    """Right-padded sequences of lengths uniform in [seqlen / 2, seqlen] (a fine-tuning batch): the attention mask
    (1 = token), and labels -100 at the padding."""
    ids = torch.randint(0, vocab, (batch, seqlen), generator=gen)
    lengths = torch.randint(seqlen // 2, seqlen + 1, (batch,), generator=gen)
    lengths[0] = seqlen  # (one full row: the batch's padded length is seqlen)
    mask = (torch.arange(seqlen)[None, :] < lengths[:, None]).long()
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    return ids.to(device), labels.to(device), mask.to(device)


def hf_loss_fn(model, causal: bool):
    def fwd(inputs, labels, mask=None):
        return model(input_ids=inputs, attention_mask=mask, labels=labels).loss
    return fwd


def pykernels_loss_fn(model, causal: bool, attn_backend: str | None, max_valid: bool = False, tokens: int = 0):
    """Forward + loss through pykernels' ops (the model's norms and attention already patched): the loss by
    ``pykernels.integrations.transformers.fuse_lm_loss`` (``dense=True`` for GPT-2; ``max_valid``: BERT's loss with
    ``max_valid = tokens // 5``, no host wait for the count of labelled rows; ``in_eval``: the eval loss too), the
    model called as a user calls it, ``model(..., labels=labels).loss``."""
    import pykernels
    from pykernels.integrations import transformers as pk_hf

    pk_hf.fuse_lm_loss(model, dense=causal, max_valid=tokens // 5 if max_valid else None, backend="auto",
                       in_eval=True)

    def fwd(inputs, labels, mask=None):
        with pykernels.use_backend(attn_backend) if attn_backend else contextlib.nullcontext():
            return model(input_ids=inputs, attention_mask=mask, labels=labels).loss
    return fwd


def case_inputs(case: Case, device) -> tuple[dict, tuple]:
    """What every variant of a case starts from: the model's weights (one random init from seed 0) and the batch
    (seed 1)."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM
    torch.manual_seed(0)
    state = (AutoModelForCausalLM if case.causal else AutoModelForMaskedLM).from_config(
        case.config(), attn_implementation="sdpa").state_dict()
    gen = torch.Generator().manual_seed(1)
    make = (gpt2_padded_batch if case.padded else gpt2_batch) if case.causal else bert_batch
    batch = make(case.batch, case.seqlen, case.config().vocab_size, device, gen)
    return state, batch


def build(case: Case, variant: str, state: dict, device):
    """(model, loss function) for a variant, the model loaded with ``state``."""
    import pykernels
    from pykernels.integrations import transformers as pk_hf
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    auto = AutoModelForCausalLM if case.causal else AutoModelForMaskedLM
    ours = variant.startswith("pykernels")
    if ours:
        pk_hf.register()
    model = auto.from_config(case.config(), attn_implementation="pykernels" if ours else "sdpa")
    model.load_state_dict(state)
    model.to(device).train()
    if not ours:
        fwd = hf_loss_fn(model, case.causal)
    else:
        pykernels.nn.replace_layer_norms(model)
        for m in model.modules():  # the norms take what auto serves (the C++ op; Triton for BERT's first block,
            if isinstance(m, pykernels.nn.LayerNorm):  # whose residual is fp32), even under use_backend("cuda")
                m.backend = "auto"
        if not case.causal:
            pk_hf.fuse_residual_layer_norms(model)
        fwd = pykernels_loss_fn(model, case.causal, "cuda" if "C++" in variant else None, "max_valid" in variant,
                                case.batch * case.seqlen)
    if variant.endswith("+ compile"):
        fwd = torch.compile(fwd)
    return model, fwd


def run_variant(case: Case, variant: str, state: dict, batch, device, *, steps: int, warmup: int,
                amp: bool) -> dict:
    model, fwd = build(case, variant, state, device)
    inputs, labels, mask = (*batch, None)[:3]

    graphed = variant.endswith(", CUDA graph")

    def autocast():
        # (a captured graph must not keep autocast's cached weight casts: they are made once, at capture)
        return (torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=not graphed) if amp
                else contextlib.nullcontext())

    with torch.no_grad(), autocast():
        model.eval()
        loss0 = float(fwd(inputs, labels, mask))
        model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda", capturable=graphed)

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = fwd(inputs, labels, mask)
        loss.backward()
        opt.step()
        return loss

    cuda = device.type == "cuda"
    t_warm = time.perf_counter()
    if graphed:  # warm up on a side stream, then capture one step (torch.cuda.graph's whole-network recipe)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(warmup, 3)):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)  # backward allocates the gradients from the graph's pool
        with torch.cuda.graph(graph):
            with autocast():
                static_loss = fwd(inputs, labels, mask)
            static_loss.backward()
            opt.step()
        # (torch 2.11: the first replay can draw the dropout seeds from the capture-time generator state unless the
        # device is idle first: README, Known issues)
        torch.cuda.synchronize()

        def step():  # noqa: F811 - the replay is the step
            graph.replay()
            return static_loss
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    warm_s = time.perf_counter() - t_warm
    t0 = time.perf_counter()
    for _ in range(steps):
        last = step()
    if cuda:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    tokens = inputs.numel()
    row = dict(case=case.name, variant=variant, batch=case.batch, seqlen=case.seqlen, ms_per_step=round(ms, 2),
               tokens_per_s=round(tokens / ms * 1e3), peak_GiB=round(peak, 2), eval_loss0=round(loss0, 5),
               train_loss_last=round(last.item(), 4), warmup_s=round(warm_s, 1), steps=steps)
    del model, fwd, opt
    if graphed:
        del graph, static_loss, step
    if cuda:
        torch.cuda.empty_cache()
    return row


def cases(smoke: bool) -> list[Case]:
    from transformers import BertConfig, GPT2Config
    if smoke:
        return [Case("bert", 2, 16, lambda: BertConfig(vocab_size=1100, hidden_size=32, num_hidden_layers=2,
                                                       num_attention_heads=2, intermediate_size=37,
                                                       max_position_embeddings=64), False),
                Case("gpt2", 2, 16, lambda: GPT2Config(vocab_size=1100, n_embd=32, n_layer=2, n_head=2,
                                                       n_positions=64, bos_token_id=0, eos_token_id=0), True),
                Case("gpt2-padded", 2, 16, lambda: GPT2Config(vocab_size=1100, n_embd=32, n_layer=2, n_head=2,
                                                              n_positions=64, bos_token_id=0, eos_token_id=0),
                     True, True)]
    return [Case("bert", 32, 512, BertConfig, False), Case("gpt2", 8, 1024, GPT2Config, True),
            Case("gpt2-padded", 8, 1024, GPT2Config, True, True)]


def main(argv=None, rows_out: list | None = None) -> int:
    """Run the cases; the rows are also appended to ``rows_out`` when given (tests)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["bert", "gpt2"], choices=["bert", "gpt2", "gpt2-padded"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="add the torch.compile variants")
    ap.add_argument("--graph", action="store_true", help="add the variants whose whole step is one CUDA graph")
    ap.add_argument("--max-valid", action="store_true",
                    help="add BERT's pykernels variant with masked_lm_loss(max_valid=tokens // 5): no host wait")
    ap.add_argument("--budget-s", type=float, default=300.0, help="skip the variants left past this")
    ap.add_argument("--check", action="store_true", help="exit 1 if a variant's eval loss is off by > 2%%")
    ap.add_argument("--smoke", action="store_true", help="tiny configs on CPU, nothing written")
    args, _ = ap.parse_known_args(argv)  # (gpu_run.sh passes every benchmark the same BENCH_ARGS)
    if not args.smoke and not torch.cuda.is_available():
        print("train_step benchmark: no CUDA device; nothing to time (use --smoke to check the plumbing)")
        return 0
    import pykernels
    device = torch.device("cpu" if args.smoke else "cuda")
    amp = not args.smoke
    variants = ["hf sdpa", "pykernels"]
    if not args.smoke and pykernels.backends()["cuda"].available:
        variants.append("pykernels, C++ attention")
    if args.max_valid:
        variants += [v + ", max_valid" for v in variants if v.startswith("pykernels")]
    if args.compile:
        variants += ["hf sdpa + compile", "pykernels + compile"]
    if args.graph and not args.smoke:
        variants += ["hf sdpa, CUDA graph", "pykernels, CUDA graph"]
    t_start = time.perf_counter()
    rows, bad = [], []
    for case in cases(args.smoke):
        if case.name not in args.models:
            continue
        state, batch = case_inputs(case, device)
        base = None
        for variant in variants:
            if case.causal and "max_valid" in variant:
                continue  # (GPT-2's loss is dense=True: no count to wait for)
            if time.perf_counter() - t_start > args.budget_s:
                rows.append(dict(case=case.name, variant=variant, status="skipped (time budget)"))
                continue
            try:
                row = run_variant(case, variant, state, batch, device, steps=args.steps, warmup=args.warmup,
                                  amp=amp)
                row["status"] = "ok"
            except Exception as e:  # noqa: BLE001 - a failing variant is recorded, the others still run
                row = dict(case=case.name, variant=variant, status=f"error: {type(e).__name__}: {e}"[:300])
                bad.append(row)
            if variant == "hf sdpa" and row["status"] == "ok":
                base = row
            if base is not None and row["status"] == "ok":
                row["speedup_vs_hf_sdpa"] = round(base["ms_per_step"] / row["ms_per_step"], 3)
                row["eval_loss0_rel_diff"] = round(abs(row["eval_loss0"] - base["eval_loss0"]) / abs(base["eval_loss0"]), 5)
                if row["eval_loss0_rel_diff"] > 0.02:
                    bad.append(row)
            rows.append(row)
            print(row, flush=True)
    from common import print_table, write_rows
    cols = ["case", "variant", "status", "ms_per_step", "tokens_per_s", "peak_GiB", "speedup_vs_hf_sdpa",
            "eval_loss0", "eval_loss0_rel_diff", "warmup_s"]
    print_table(rows, cols)
    if rows_out is not None:
        rows_out.extend(rows)
    if not args.smoke:
        print("wrote", write_rows("train_step", rows))
    return 1 if (args.check and bad) else 0


if __name__ == "__main__":
    sys.exit(main())
