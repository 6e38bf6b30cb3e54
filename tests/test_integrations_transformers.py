"""attn_implementation="pykernels" in Hugging Face transformers: tiny random-init BERT, GPT-2 and
Llama (GQA) models against the same weights run with attn_implementation="eager".

Three-way rule (tests/utils.py): the pykernels model's outputs and every parameter gradient, against
the eager model in float64, must be within 2x the error of the eager model in the test dtype.
No hub access: models come from small configs (and a save_pretrained / from_pretrained round trip
in a temporary folder).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, BertConfig,  # noqa: E402
                          GPT2Config, LlamaConfig)

import pykernels  # noqa: E402
from pykernels.integrations import transformers as pk_hf  # noqa: E402
from utils import assert_close_to_ref  # noqa: E402

pk_hf.register()

VOCAB = 99


# ----------------------------------------------------------------------------------------------
# tiny models and batches

def bert_config(**kw) -> BertConfig:
    base = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
                max_position_embeddings=64, type_vocab_size=2, hidden_dropout_prob=0.1,
                attention_probs_dropout_prob=0.1)
    return BertConfig(**{**base, **kw})


def gpt2_config(**kw) -> GPT2Config:
    base = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.1, embd_pdrop=0.1,
                attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)
    return GPT2Config(**{**base, **kw})


def llama_config(**kw) -> LlamaConfig:
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.1)
    return LlamaConfig(**{**base, **kw})


def same_weight_models(auto_cls, config_fn, *attn_implementations):
    """One model per attention implementation, in that order, all with the first one's weights (drawn
    after ``torch.manual_seed(1)``). Each gets its own config object: from_config records the attention
    choice on the config."""
    torch.manual_seed(1)
    models = [auto_cls.from_config(config_fn(), attn_implementation=impl) for impl in attn_implementations]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    return models


def make_models(auto_cls, config_fn, device, dtype=torch.float32):
    """(pykernels model in dtype, eager model in dtype, eager model in float64), same weights, eval mode."""
    eager, ours, hi = same_weight_models(auto_cls, config_fn, "eager", "pykernels", "eager")
    assert ours.config._attn_implementation == "pykernels"
    assert eager.config._attn_implementation == "eager"
    return (ours.to(device, dtype).eval(), eager.to(device, dtype).eval(), hi.to(device, torch.float64).eval())


def make_batch(lengths, seqlen, device, *, left=False):
    """input_ids (B, S) and a 2-D attention mask (1 = token, 0 = padding) with the given lengths."""
    ids = torch.randint(1, VOCAB, (len(lengths), seqlen), device=device)
    mask = torch.zeros(len(lengths), seqlen, dtype=torch.long, device=device)
    for b, n in enumerate(lengths):
        if left:
            mask[b, seqlen - n:] = 1
        else:
            mask[b, :n] = 1
    return ids, mask


def main_output(out):
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def run(model, ids, mask, cotangent):
    """Forward + backward with a fixed random cotangent: (output, {param name: grad})."""
    model.zero_grad(set_to_none=True)
    y = main_output(model(input_ids=ids, attention_mask=mask))
    y.backward(cotangent.to(y.dtype))
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return y.detach(), grads


def assert_model_matches_eager(ours, eager, hi, ids, mask, *, atol_rel=1e-6):
    cot = torch.randn(*ids.shape, main_output_width(hi), device=ids.device, dtype=torch.float64)
    y_hi, g_hi = run(hi, ids, mask, cot)
    y_lo, g_lo = run(eager, ids, mask, cot)
    y, g = run(ours, ids, mask, cot)

    def atol(ref):
        return atol_rel * max(1.0, ref.abs().max().item())

    assert_close_to_ref("output", y, y_hi, y_lo, atol=atol(y_hi))
    assert set(g) == set(g_hi), f"parameters with gradients differ: {sorted(set(g) ^ set(g_hi))}"
    assert len(g) > 10
    for name in g_hi:
        assert_close_to_ref(f"grad {name}", g[name], g_hi[name], g_lo[name], atol=atol(g_hi[name]))


def main_output_width(model) -> int:
    return model.config.vocab_size if model.get_output_embeddings() is not None else model.config.hidden_size


@contextlib.contextmanager
def spy_attention(monkeypatch):
    """Record the arguments each attention call passes to pykernels.scaled_dot_product_attention."""
    calls = []
    real = pykernels.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **kw):
        calls.append(dict(q=tuple(query.shape), k=tuple(key.shape), mask=attn_mask, dropout_p=dropout_p,
                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa))
        return real(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa, **kw)

    monkeypatch.setattr(pykernels, "scaled_dot_product_attention", spy)
    yield calls


# ----------------------------------------------------------------------------------------------
# registration

def test_register_is_idempotent():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    assert pk_hf.register() == "pykernels"
    assert pk_hf.register() == "pykernels"
    assert pk_hf.is_registered()
    assert ALL_ATTENTION_FUNCTIONS["pykernels"] is pk_hf.attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["pykernels"] is pk_hf.build_mask
    assert "sdpa" in ALL_ATTENTION_FUNCTIONS and ALL_ATTENTION_FUNCTIONS["sdpa"] is not pk_hf.attention_forward
    with pytest.raises(TypeError, match="name"):
        pk_hf.register(name="")


def test_from_pretrained_round_trip(tmp_path):
    torch.manual_seed(0)
    eager = AutoModelForMaskedLM.from_config(bert_config(), attn_implementation="eager").eval()
    eager.save_pretrained(tmp_path)
    ours = AutoModelForMaskedLM.from_pretrained(tmp_path, attn_implementation="pykernels").eval()
    assert ours.config._attn_implementation == "pykernels"
    ids, mask = make_batch([9, 5], 9, "cpu")
    with torch.no_grad(), pykernels.use_backend("reference"):
        a = eager(input_ids=ids, attention_mask=mask).logits
        b = ours(input_ids=ids, attention_mask=mask).logits
    assert (a - b).abs().max().item() < 1e-4 * max(1.0, a.abs().max().item())


# ----------------------------------------------------------------------------------------------
# parity with eager (fp32; reference backend on CPU, Triton under the interpreter or on the GPU)

BACKENDS = ["reference", "triton"]


def _device_for(backend, device):
    return torch.device("cpu") if backend == "reference" else device


@pytest.mark.parametrize("backend", BACKENDS)
def test_bert_masked_lm_with_padding(backend, device):
    dev = _device_for(backend, device)
    ours, eager, hi = make_models(AutoModelForMaskedLM, bert_config, dev)
    ids, mask = make_batch([11, 7, 3], 11, dev)
    with pykernels.use_backend(backend):
        assert_model_matches_eager(ours, eager, hi, ids, mask)


@pytest.mark.parametrize("left", [False, True])
def test_bert_model_padding_sides_and_odd_length(left):
    ours, eager, hi = make_models(AutoModel, lambda: bert_config(num_attention_heads=4), "cpu")
    ids, mask = make_batch([13, 1, 6], 13, "cpu", left=left)
    with pykernels.use_backend("reference"):
        assert_model_matches_eager(ours, eager, hi, ids, mask)


def test_bert_model_without_padding():
    ours, eager, hi = make_models(AutoModel, bert_config, "cpu")
    ids, mask = make_batch([10, 10], 10, "cpu")
    with pykernels.use_backend("reference"):
        assert_model_matches_eager(ours, eager, hi, ids, mask)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lengths", [[9, 9], [9, 4, 6]], ids=["no_padding", "right_padding"])
def test_gpt2_lm_head(backend, lengths, device):
    dev = _device_for(backend, device)
    ours, eager, hi = make_models(AutoModelForCausalLM, gpt2_config, dev)
    ids, mask = make_batch(lengths, 9, dev)
    with pykernels.use_backend(backend):
        assert_model_matches_eager(ours, eager, hi, ids, mask)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpt2_left_padding(backend, device):
    # left padding (batched prompts): a causal model's padded rows before the first token see no key (0 here, the
    # values' mean in eager); every real token's logits, and the gradients of a loss on real tokens only, match eager
    dev = _device_for(backend, device)
    ours, eager, hi = make_models(AutoModelForCausalLM, gpt2_config, dev)
    ids, mask = make_batch([9, 4, 6], 9, dev, left=True)
    real = mask.bool()[..., None]
    cot = torch.randn(*ids.shape, VOCAB, device=dev, dtype=torch.float64) * real
    outs = []
    with pykernels.use_backend(backend):
        for model in (hi, eager, ours):
            model.zero_grad(set_to_none=True)
            y = model(input_ids=ids, attention_mask=mask).logits
            (y * cot.to(y.dtype)).sum().backward()
            outs.append((y.detach() * real, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (y_hi, g_hi), (y_lo, g_lo), (y, g) = outs
    assert_close_to_ref("logits at real tokens", y, y_hi, y_lo, atol=1e-6 * max(1.0, y_hi.abs().max().item()))
    assert set(g) == set(g_hi) and len(g) > 10
    for name in g_hi:
        assert_close_to_ref(f"grad {name}", g[name], g_hi[name], g_lo[name],
                            atol=1e-6 * max(1.0, g_hi[name].abs().max().item()))


def test_gpt2_layer_scaled_attention():
    # scale_attn_by_inverse_layer_idx: the per-layer scale must reach the kernel through `scaling`.
    cfg = lambda: gpt2_config(scale_attn_by_inverse_layer_idx=True)  # noqa: E731
    ours, eager, hi = make_models(AutoModelForCausalLM, cfg, "cpu")
    ids, mask = make_batch([8, 5], 8, "cpu")
    with pykernels.use_backend("reference"):
        assert_model_matches_eager(ours, eager, hi, ids, mask)


def test_llama_grouped_query_attention(monkeypatch):
    ours, eager, hi = make_models(AutoModelForCausalLM, llama_config, "cpu")
    ids, mask = make_batch([7, 4], 7, "cpu")
    with pykernels.use_backend("reference"), spy_attention(monkeypatch) as calls:
        assert_model_matches_eager(ours, eager, hi, ids, mask)
    assert calls and all(c["enable_gqa"] for c in calls)
    assert all(c["q"][1] == 4 and c["k"][1] == 2 for c in calls)  # key/value not repeated


@pytest.mark.parametrize("auto_cls, config_fn", [(AutoModel, bert_config), (AutoModelForCausalLM, gpt2_config)],
                         ids=["bert", "gpt2"])
def test_torch_compile_fullgraph(auto_cls, config_fn):
    # The mask builder and the attention function must trace without graph breaks.
    torch._dynamo.reset()
    model = auto_cls.from_config(config_fn(), attn_implementation="pykernels").eval()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    ids, mask = make_batch([9, 6, 2], 9, "cpu")
    with torch.no_grad(), pykernels.use_backend("reference"):
        for m in (mask, torch.ones_like(mask)):  # key padding, and the mask-free path
            got = main_output(compiled(input_ids=ids, attention_mask=m))
            want = main_output(model(input_ids=ids, attention_mask=m))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_build_mask_keeps_plain_causal_unmaterialised(monkeypatch):
    # the plain causal recipe (no padding, no window, queries and keys from position 0) is None from the arguments
    # alone, whatever transformers' builder would do (it materialises the mask while compiling on torch < 2.14);
    # every other recipe goes to transformers' builder
    from transformers.masking_utils import causal_mask_function
    pk_hf.register()
    delegated = []
    monkeypatch.setattr(pk_hf, "_sdpa_mask", lambda *a, **kw: delegated.append(kw) or torch.ones(1, 1, 4, 4).bool())
    plain = dict(batch_size=2, q_length=4, kv_length=4, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
                 attention_mask=None, local_size=None, allow_is_causal_skip=True, device="cpu")
    assert pk_hf.build_mask(**plain) is None
    old_api = {k: v for k, v in plain.items() if k not in ("q_length", "q_offset")}
    assert pk_hf.build_mask(**old_api, cache_position=torch.arange(4)) is None
    assert not delegated
    # causal and padding: the 2-D padding mask (bool, over kv_length keys; shorter masks padded with False), None in
    # eager mode when it keeps every key
    pad = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    got = pk_hf.build_mask(**{**plain, "attention_mask": pad})
    assert got.dtype == torch.bool and torch.equal(got, pad.bool()) and got.is_contiguous()
    got = pk_hf.build_mask(**{**plain, "attention_mask": pad[:, :3].bool()})
    assert torch.equal(got, torch.tensor([[True, True, True, False]] * 2))
    assert pk_hf.build_mask(**{**plain, "attention_mask": torch.ones(2, 4, dtype=torch.bool)}) is None
    assert pk_hf.build_mask(**{**old_api, "attention_mask": pad, "cache_position": torch.arange(4)}).shape == (2, 4)
    assert not delegated
    for change in (dict(local_size=2), dict(allow_is_causal_skip=False), dict(kv_length=6), dict(kv_offset=2),
                   dict(q_offset=2), dict(mask_function=lambda b, h, q, kv: kv <= q)):
        for pad_mask in (None, pad):
            delegated.clear()
            got = pk_hf.build_mask(**{**plain, **change, "attention_mask": pad_mask})
            assert got is not None and got.dim() == 4, change
            assert len(delegated) == 1, change


def test_compiled_gpt2_keeps_the_causal_flag(monkeypatch):
    # transformers' SDPA mask builder materialises the plain causal mask while dynamo compiles (torch < 2.14 cannot
    # tell compile from export); ours returns None from the builder's arguments, so the compiled model takes the
    # kernels' is_causal path (no mask read, the blocks above the diagonal skipped) as the eager one does; with
    # padding both take is_causal with the (B, 1, 1, S) key mask
    seen = []
    real = pykernels.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        seen.append((attn_mask is None, is_causal))
        return real(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(pykernels, "scaled_dot_product_attention", spy)
    torch._dynamo.reset()
    gpt2 = AutoModelForCausalLM.from_config(gpt2_config(), attn_implementation="pykernels").eval()
    compiled = torch.compile(gpt2, backend="aot_eager", fullgraph=True)
    ids, mask = make_batch([8, 5, 3], 8, "cpu")
    with torch.no_grad(), pykernels.use_backend("reference"):
        for m, want_seen in ((None, (True, True)), (mask, (False, True))):
            seen.clear()
            got = main_output(compiled(input_ids=ids, attention_mask=m))
            assert seen == [want_seen] * 2, m is None
            torch.testing.assert_close(got, main_output(gpt2(input_ids=ids, attention_mask=m)), rtol=1e-5, atol=1e-5)
            assert seen == [want_seen] * 4, m is None


# ----------------------------------------------------------------------------------------------
# what reaches the kernel

def test_mask_routing(monkeypatch):
    bert = AutoModel.from_config(bert_config(), attn_implementation="pykernels").eval()
    gpt2 = AutoModelForCausalLM.from_config(gpt2_config(), attn_implementation="pykernels").eval()
    with torch.no_grad(), pykernels.use_backend("reference"), spy_attention(monkeypatch) as calls:
        ids, mask = make_batch([8, 5, 3], 8, "cpu")
        bert(input_ids=ids, attention_mask=mask)
        # BERT + padding: the key-padding fast-path shape, exactly the 2-D mask's content
        assert len(calls) == 2
        for c in calls:
            assert c["mask"].shape == (3, 1, 1, 8) and c["mask"].dtype == torch.bool
            assert torch.equal(c["mask"][:, 0, 0, :], mask.bool())
            assert c["is_causal"] is False and c["dropout_p"] == 0.0
            assert c["scale"] == pytest.approx(16 ** -0.5)
        calls.clear()
        bert(input_ids=ids, attention_mask=torch.ones_like(mask))
        assert [c["mask"] for c in calls] == [None, None] and not any(c["is_causal"] for c in calls)
        calls.clear()
        gpt2(input_ids=ids)  # no padding: causal by flag, no mask
        assert [c["mask"] for c in calls] == [None, None] and all(c["is_causal"] for c in calls)
        calls.clear()
        gpt2(input_ids=ids, attention_mask=mask)  # padding: causal by flag, the padding as a key mask
        assert len(calls) == 2
        for c in calls:
            assert c["mask"].shape == (3, 1, 1, 8) and c["mask"].dtype == torch.bool and c["is_causal"] is True
            assert torch.equal(c["mask"][:, 0, 0], mask.bool())
        calls.clear()
        gpt2(input_ids=ids, attention_mask=torch.ones_like(mask))  # a mask that keeps every token: no mask
        assert [c["mask"] for c in calls] == [None, None] and all(c["is_causal"] for c in calls)


def test_dropout_only_in_training(monkeypatch):
    bert = AutoModel.from_config(bert_config(attention_probs_dropout_prob=0.25),
                                 attn_implementation="pykernels")
    ids, mask = make_batch([6, 4], 6, "cpu")
    with pykernels.use_backend("reference"), spy_attention(monkeypatch) as calls:
        bert.train()
        out = bert(input_ids=ids, attention_mask=mask).last_hidden_state
        out.sum().backward()
        assert [c["dropout_p"] for c in calls] == [0.25, 0.25]
        calls.clear()
        bert.eval()
        bert(input_ids=ids, attention_mask=mask)
        assert [c["dropout_p"] for c in calls] == [0.0, 0.0]
        calls.clear()
        # a module in eval never drops, even if a caller passes a rate
        module = bert.encoder.layer[0].attention.self
        q = torch.randn(2, 2, 6, 16)
        o, w = pk_hf.attention_forward(module, q, q, q, None, dropout=0.5, scaling=0.25)
        assert calls[-1]["dropout_p"] == 0.0 and w is None and o.shape == (2, 6, 2, 16) and o.is_contiguous()


def test_attention_forward_matches_torch_sdpa_and_layout():
    module = torch.nn.Module().eval()
    module.is_causal = False
    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    keep = torch.tensor([[True] * 5, [True, True, True, False, False]])[:, None, None, :]
    with pykernels.use_backend("reference"):
        out, w = pk_hf.attention_forward(module, q, k, v, keep, scaling=0.3)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=0.3)
    assert w is None and out.shape == (2, 5, 3, 8) and out.is_contiguous()
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_user_supplied_4d_additive_mask():
    # A prepared 4-D mask skips transformers' mask builders and reaches the kernel as given.
    ours, eager, _ = make_models(AutoModel, bert_config, "cpu")
    ids, _ = make_batch([7, 7], 7, "cpu")
    blocked = torch.rand(2, 1, 7, 7) < 0.3
    blocked[..., 0] = False
    mask4 = torch.zeros(2, 1, 7, 7).masked_fill(blocked, torch.finfo(torch.float32).min)
    with torch.no_grad(), pykernels.use_backend("reference"):
        got = ours(input_ids=ids, attention_mask=mask4).last_hidden_state
        want = eager(input_ids=ids, attention_mask=mask4).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_attention_forward_causal_rules():
    module = torch.nn.Module().eval()
    module.is_causal = True
    q = torch.randn(1, 2, 3, 8)
    kv = torch.randn(1, 2, 5, 8)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with pykernels.use_backend("reference"):
        # static-cache prefill: keys past Sq are empty slots; causal over the first Sq keys
        out, _ = pk_hf.attention_forward(module, q, kv, kv, None)
        torch.testing.assert_close(out, sdpa(q, kv[:, :, :3], kv[:, :, :3], is_causal=True).transpose(1, 2),
                                   rtol=1e-5, atol=1e-5)
        # a mask carries causality itself: applied as given, no extra causal masking
        keep = torch.rand(1, 1, 3, 5) > 0.3
        keep[..., 0] = True
        out, _ = pk_hf.attention_forward(module, q, kv, kv, keep)
        torch.testing.assert_close(out, sdpa(q, kv, kv, attn_mask=keep).transpose(1, 2), rtol=1e-5, atol=1e-5)
        # one query row (decoding) attends to every cached key
        out, _ = pk_hf.attention_forward(module, q[:, :, :1], kv, kv, None, is_causal=True)
        torch.testing.assert_close(out, sdpa(q[:, :, :1], kv, kv).transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_attention_forward_2d_padding_mask():
    # a 2-D (B, Sk) mask is key padding with the module's causality: top-left where Sq == Sk, bottom-right where the
    # queries follow cached keys (transformers' causal masks with a cache), none for a bidirectional module
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q, k, v = (torch.randn(2, 2, 5, 8) for _ in range(3))
    pad = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]])  # right and left padding
    key = pad.bool()[:, None, None, :]
    tril = torch.ones(5, 5, dtype=torch.bool).tril()
    module = torch.nn.Module().eval()
    with pykernels.use_backend("reference"):
        for causal in (True, False):
            module.is_causal = causal
            for m in (pad, pad.bool(), pad.to(torch.int32)):
                out, _ = pk_hf.attention_forward(module, q, k, v, m)
                # (a left-padded causal batch's first row sees no key: 0 here; padding either way)
                want = sdpa(q, k, v, attn_mask=key & tril if causal else key).nan_to_num(0.0)
                torch.testing.assert_close(out, want.transpose(1, 2), rtol=1e-5, atol=1e-5)
                if causal:
                    assert out[1, 0].abs().max() == 0
        module.is_causal = True
        out, _ = pk_hf.attention_forward(module, q[:, :, 3:], k, v, pad)  # 2 queries after 3 cached keys
        below = torch.ones(2, 5, dtype=torch.bool).tril(3)
        torch.testing.assert_close(out, sdpa(q[:, :, 3:], k, v, attn_mask=key & below).transpose(1, 2),
                                   rtol=1e-5, atol=1e-5)
        with pytest.raises(TypeError, match="attention_mask"):
            pk_hf.attention_forward(module, q, k, v, pad.float())
        with pytest.raises(ValueError, match=r"attention_mask.*\(2, 5\)"):
            pk_hf.attention_forward(module, q, k, v, pad[:, :4])


def test_unsupported_arguments_raise():
    module = torch.nn.Module().eval()
    q = torch.randn(1, 2, 4, 8)
    for bad in ("softcap", "s_aux", "position_bias"):
        with pytest.raises(ValueError, match=bad):
            pk_hf.attention_forward(module, q, q, q, None, **{bad: torch.ones(1) if bad != "softcap" else 30.0})


def test_output_attentions_warns_and_returns_none():
    bert = AutoModel.from_config(bert_config(), attn_implementation="pykernels").eval()
    ids, mask = make_batch([5, 3], 5, "cpu")
    pk_hf._warned_output_attentions = False
    with pytest.warns(UserWarning, match="output_attentions"), torch.no_grad(), pykernels.use_backend("reference"):
        out = bert(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert out.last_hidden_state.shape == (2, 5, 32)
    assert not out.attentions or all(a is None for a in out.attentions)


# ----------------------------------------------------------------------------------------------
# fuse_residual_layer_norms: BERT's post-LN blocks as one pykernels.layer_norm call

@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_post_ln_bert_matches_eager(backend, device):
    dev = _device_for(backend, device)
    ours, eager, hi = make_models(AutoModelForMaskedLM, bert_config, dev)
    keys = list(ours.state_dict())
    assert pk_hf.fuse_residual_layer_norms(ours) is ours
    fused = [m for m in ours.modules() if type(m).__name__.startswith("FusedBert")]
    assert sorted({type(m).__name__ for m in fused}) == ["FusedBertOutput", "FusedBertSelfOutput"]
    assert len(fused) == 2 * ours.config.num_hidden_layers
    assert list(ours.state_dict()) == keys
    ids, mask = make_batch([11, 7, 3], 11, dev)
    with pykernels.use_backend(backend):
        assert_model_matches_eager(ours, eager, hi, ids, mask)


def test_fused_post_ln_calls_and_dropout(monkeypatch):
    torch.manual_seed(0)
    bert = AutoModel.from_config(bert_config(hidden_dropout_prob=0.25), attn_implementation="pykernels")
    pk_hf.fuse_residual_layer_norms(pk_hf.fuse_residual_layer_norms(bert))  # twice: the second changes nothing
    assert all(type(m).__name__ in ("FusedBertSelfOutput", "FusedBertOutput")
               for m in bert.modules() if type(m).__name__.endswith("Output"))
    assert all(issubclass(type(m), torch.nn.Module) and type(m).__mro__[1].__name__ in pk_hf.POST_LN_OUTPUT_CLASSES
               for m in bert.modules() if type(m).__name__.startswith("Fused"))
    calls = []
    real = pykernels.layer_norm

    def spy(x, weight, bias=None, eps=1e-5, **kw):
        calls.append(dict(eps=eps, **kw))
        return real(x, weight, bias, eps, **kw)

    monkeypatch.setattr(pykernels, "layer_norm", spy)
    ids, mask = make_batch([6, 6], 6, "cpu")
    with pykernels.use_backend("reference"):
        bert.train()(input_ids=ids, attention_mask=mask)
        assert len(calls) == 4 and all(c["dropout_p"] == 0.25 and c["residual"] is not None for c in calls)
        assert all(c["eps"] == bert.config.layer_norm_eps for c in calls)
        calls.clear()
        bert.eval()(input_ids=ids, attention_mask=mask)
        assert len(calls) == 4 and all(c["dropout_p"] == 0.0 for c in calls)


def test_fused_post_ln_refuses_what_it_cannot_fuse():
    gpt2 = AutoModelForCausalLM.from_config(gpt2_config(), attn_implementation="pykernels")
    with pytest.raises(ValueError, match="no post-LN output block.*replace_layer_norms"):
        pk_hf.fuse_residual_layer_norms(gpt2)
    bert = AutoModel.from_config(bert_config(), attn_implementation="pykernels")
    bert.encoder.layer[0].output.dropout = torch.nn.Identity()
    with pytest.raises(ValueError, match="BertOutput must have dense"):
        pk_hf.fuse_residual_layer_norms(bert)
    assert not any(type(m).__name__.startswith("Fused") for m in bert.modules())  # nothing half-done


# ----------------------------------------------------------------------------------------------
# GPU: BERT-base-sized and GPT-2-small-sized layers in bf16 (three-way rule against eager fp32)

def _bf16_three_way(auto_cls, config_fn, lengths, seqlen, *, fuse=False):
    dev = torch.device("cuda")
    eager32, eager16, ours = same_weight_models(auto_cls, config_fn, "eager", "eager", "pykernels")
    if fuse:
        pk_hf.fuse_residual_layer_norms(ours)
    eager32 = eager32.to(dev, torch.float32).eval()
    eager16 = eager16.to(dev, torch.bfloat16).eval()
    ours = ours.to(dev, torch.bfloat16).eval()
    ids, mask = make_batch(lengths, seqlen, dev)
    cot = torch.randn(*ids.shape, main_output_width(eager32), device=dev)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32, whatever ran before
    try:
        y_hi, g_hi = run(eager32, ids, mask, cot)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    y_lo, g_lo = run(eager16, ids, mask, cot)
    with pykernels.use_backend("triton"):
        y, g = run(ours, ids, mask, cot)

    def atol(ref):  # 2^-10 of the tensor's largest magnitude: under a quarter of a bf16 ulp there
        return 2.0 ** -10 * ref.abs().max().item()

    assert_close_to_ref("output", y, y_hi, y_lo, atol=atol(y_hi))
    assert set(g) == set(g_hi)
    for name in g_hi:
        if name.endswith("attention.self.key.bias"):
            # Exactly 0 in exact arithmetic (a key bias adds q.b to every score of a row, and softmax
            # ignores a per-row shift), so every implementation returns only the rounding noise of
            # sum_t dK_t: a ratio of two noises says nothing. Check that it stays noise: finite and
            # far below the same layer's key-weight gradient, which is a sum of the same dK rows.
            w = g_hi[name[:-len("bias")] + "weight"].abs().max().item()
            assert torch.isfinite(g[name]).all() and g[name].abs().max().item() <= 0.25 * w, name
            continue
        assert_close_to_ref(f"grad {name}", g[name], g_hi[name], g_lo[name], atol=atol(g_hi[name]))


@pytest.mark.gpu
@pytest.mark.parametrize("fuse", [False, True], ids=["attention", "attention_and_fused_post_ln"])
def test_gpu_bert_base_bf16(fuse):
    cfg = lambda: BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=4, num_attention_heads=12,  # noqa: E731
                             intermediate_size=3072, max_position_embeddings=512)
    _bf16_three_way(AutoModelForMaskedLM, cfg, [256, 200, 131, 17], 256, fuse=fuse)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[512, 512], [512, 301]], ids=["causal_flag", "causal_and_padding"])
def test_gpu_gpt2_small_bf16(lengths):
    cfg = lambda: GPT2Config(vocab_size=50257, n_embd=768, n_layer=4, n_head=12, n_positions=1024,  # noqa: E731
                             bos_token_id=0, eos_token_id=0)
    _bf16_three_way(AutoModelForCausalLM, cfg, lengths, 512)


# ---- fuse_lm_loss: transformers' training loss through pykernels.masked_lm_loss ------------------------------

from transformers import BertForPreTraining  # noqa: E402

NO_DROPOUT = {"bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
              "gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "llama": dict(attention_dropout=0.0),
              "other": {}}


def _tiny_causal(name):
    """A tiny config of another causal LM that fuse_lm_loss covers (no dropout)."""
    def config(**kw):
        gqa = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64)
        made = {"mistral": lambda: transformers.MistralConfig(**gqa),
                "qwen2": lambda: transformers.Qwen2Config(**gqa),
                "qwen3": lambda: transformers.Qwen3Config(**gqa, head_dim=8),
                "phi3": lambda: transformers.Phi3Config(**gqa, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0),
                "gemma": lambda: transformers.GemmaConfig(**gqa, head_dim=8, pad_token_id=0),
                "gpt_neox": lambda: transformers.GPTNeoXConfig(
                    vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0),
                "opt": lambda: transformers.OPTConfig(
                    vocab_size=VOCAB, hidden_size=32, ffn_dim=37, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0)}[name]()
        for k, v in kw.items():
            setattr(made, k, v)
        return made
    return config


def _tiny_roberta(name):
    """A tiny RoBERTa-family config (its head: dense, gelu, layer_norm, decoder), no dropout."""
    def config(**kw):
        cls = {"roberta": transformers.RobertaConfig, "xlm-roberta": transformers.XLMRobertaConfig,
               "camembert": transformers.CamembertConfig}[name]
        return cls(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
                   max_position_embeddings=64, type_vocab_size=1, pad_token_id=1, hidden_dropout_prob=0.0,
                   attention_probs_dropout_prob=0.0, **kw)
    return config


def _tiny_mlm(name):
    """A tiny ELECTRA (its generator: embeddings narrower than the hidden size), ALBERT (likewise), DistilBERT,
    ModernBERT or DeBERTa config (the current head: dense, act, LayerNorm, the word embeddings and the head's bias;
    "-legacy": BERT's cls.predictions), no dropout."""
    def config(**kw):
        if name == "distilbert":
            return transformers.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=37,
                                                 max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, **kw)
        if name.startswith("modernbert"):
            return transformers.ModernBertConfig(
                vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                sep_token_id=2, attention_dropout=0.0, embedding_dropout=0.0, mlp_dropout=0.0,
                sparse_prediction=name.endswith("-sparse"), **kw)
        common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=37, max_position_embeddings=64, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, **kw)
        if name == "electra":
            return transformers.ElectraConfig(embedding_size=16, **common)
        if name == "albert":
            return transformers.AlbertConfig(embedding_size=16, **common)
        cls = transformers.DebertaConfig if name.startswith("deberta-v1") else transformers.DebertaV2Config
        return cls(legacy=name.endswith("-legacy"), **common)
    return config


MLM_TINY = ("electra", "albert", "distilbert", "modernbert", "modernbert-sparse", "deberta-v1", "deberta-v2",
            "deberta-v2-legacy")
MLM_CASES = ("bert-mlm", "bert-pretraining", "roberta", "xlm-roberta", "camembert", *MLM_TINY)
LM_CASES = {"bert-mlm": (AutoModelForMaskedLM, bert_config, "bert"),
            "bert-pretraining": (BertForPreTraining, bert_config, "bert"),
            **{name: (AutoModelForMaskedLM, _tiny_roberta(name), "other")
               for name in ("roberta", "xlm-roberta", "camembert")},
            **{name: (AutoModelForMaskedLM, _tiny_mlm(name), "other") for name in MLM_TINY},
            "gpt2": (AutoModelForCausalLM, gpt2_config, "gpt2"), "llama": (AutoModelForCausalLM, llama_config, "llama"),
            **{name: (AutoModelForCausalLM, _tiny_causal(name), "other")
               for name in ("mistral", "qwen2", "qwen3", "phi3", "gemma", "gpt_neox", "opt")}}


def _lm_models(case, device="cpu", dtype=torch.float32):
    """(fused, transformers' own in dtype, transformers' own in float64): same weights, eager attention, no dropout,
    train mode (the fused loss applies in training)."""
    auto_cls, config_fn, family = LM_CASES[case]
    torch.manual_seed(1)
    models = [(auto_cls.from_config(config_fn(**NO_DROPOUT[family]), attn_implementation="eager")
               if hasattr(auto_cls, "from_config")  # (a model class itself: BertForPreTraining)
               else auto_cls(config_fn(**NO_DROPOUT[family], _attn_implementation="eager"))) for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    fused = pk_hf.fuse_lm_loss(models[0].to(device, dtype).train())
    return fused, models[1].to(device, dtype).train(), models[2].to(device, torch.float64).train()


def _lm_batch(case, device="cpu"):
    ids, mask = make_batch([11, 7, 9], 11, device)
    if case in MLM_CASES:
        labels = torch.where(torch.rand(ids.shape, device=device) < 0.3, ids, -100)
        labels[0, 0] = ids[0, 0]
        labels[mask == 0] = -100
        batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
        if case == "bert-pretraining":
            batch["next_sentence_label"] = torch.tensor([0, 1, 1], device=device)
        return batch
    return dict(input_ids=ids, attention_mask=mask, labels=torch.where(mask == 1, ids, -100))


def _loss_grads(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out, out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_fuse_lm_loss_has_a_head_for_every_masked_lm_class():
    # The head table the fused forward reads (weight, bias, transform) covers exactly the masked-LM classes that
    # fuse_lm_loss takes (a class added to one table and not the other would fail here, not at a user's first step);
    # each head is checked against transformers' loss in the test below.
    masked = {name for name, kind in pk_hf.LM_LOSS_CLASSES.items() if kind != "causal"}
    assert set(pk_hf._MLM_HEADS) == masked
    tested = set()
    for case in MLM_CASES:  # (and the cases below test every one of them)
        auto_cls, config_fn, _ = LM_CASES[case]
        model = auto_cls.from_config(config_fn()) if hasattr(auto_cls, "from_config") else auto_cls(config_fn())
        tested.add(type(model).__name__)
    assert tested == masked


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("case", LM_CASES)
def test_fuse_lm_loss_matches_transformers_loss(case, backend, device):
    # The fused model's loss and every parameter gradient against transformers' own loss (float64 truth, the 2x rule
    # against the same model in fp32); its logits are never formed (None); the state_dict is unchanged.
    fused, eager, hi = _lm_models(case, device)
    keys = list(eager.state_dict())
    pk_hf.fuse_lm_loss(fused, backend=backend)
    assert type(fused).__name__.startswith("FusedLoss") and list(fused.state_dict()) == keys
    batch = _lm_batch(case, device)
    out, loss, g = _loss_grads(fused, batch)
    _, loss_lo, g_lo = _loss_grads(eager, batch)
    _, loss_hi, g_hi = _loss_grads(hi, batch)
    assert (out.logits if hasattr(out, "logits") else out.prediction_logits) is None
    assert_close_to_ref("loss", loss, loss_hi, loss_lo, atol=1e-6)
    assert set(g) == set(g_hi) and len(g) > 10
    for name in g_hi:
        assert_close_to_ref(f"grad {name}", g[name], g_hi[name], g_lo[name],
                            atol=1e-6 * max(1.0, g_hi[name].abs().max().item()))
    if case == "bert-pretraining":
        torch.testing.assert_close(out.seq_relationship_logits, eager(**batch).seq_relationship_logits)


def test_fuse_lm_loss_without_labels_in_eval_and_with_logits_to_keep_is_the_model_forward(monkeypatch):
    fused, eager, _ = _lm_models("gpt2")
    calls = []
    real = pykernels.masked_lm_loss
    monkeypatch.setattr(pykernels, "masked_lm_loss", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    batch = _lm_batch("gpt2")
    plain = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    torch.testing.assert_close(fused(**plain).logits, eager(**plain).logits)  # no labels
    fused.eval(), eager.eval()
    a, b = fused(**batch), eager(**batch)  # eval: logits and transformers' loss
    torch.testing.assert_close(a.logits, b.logits)
    torch.testing.assert_close(a.loss, b.loss)
    assert calls == []
    pk_hf.fuse_lm_loss(fused, in_eval=True)
    out = fused(**batch)
    assert calls == [1] and out.logits is None
    torch.testing.assert_close(out.loss, b.loss, rtol=1e-5, atol=1e-6)
    fused.train(), eager.train()
    # logits_to_keep other than 0: the model's own forward (which with labels fails as transformers' does)
    with pytest.raises(ValueError, match="batch_size"):
        eager(**batch, logits_to_keep=1)
    with pytest.raises(ValueError, match="batch_size"):
        fused(**batch, logits_to_keep=1)
    assert calls == [1]


def test_fuse_lm_loss_num_items_in_batch_return_dict_and_z_loss():
    fused, eager, _ = _lm_models("gpt2")
    batch = _lm_batch("gpt2")
    n = torch.tensor(40)  # a trainer's count over the accumulated micro-batches: the loss divides by it
    torch.testing.assert_close(fused(**batch, num_items_in_batch=n).loss, eager(**batch, num_items_in_batch=n).loss,
                               rtol=1e-5, atol=1e-6)
    tup = fused(**batch, return_dict=False)
    torch.testing.assert_close(tup[0], eager(**batch).loss, rtol=1e-5, atol=1e-6)
    # z_loss reaches the op: the loss grows by z mean(lse**2) over the labelled (shifted) tokens
    logits = eager(**batch).logits[:, :-1].double()
    valid = batch["labels"][:, 1:] != -100
    lse2 = torch.logsumexp(logits, -1)[valid].square().mean()
    base = fused(**batch).loss.double()
    pk_hf.fuse_lm_loss(fused, z_loss=0.01)
    torch.testing.assert_close(fused(**batch).loss.double(), base + 0.01 * lse2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["modernbert", "modernbert-sparse", "bert-mlm"])
def test_fuse_lm_loss_masked_lm_num_items_in_batch(case):
    # ModernBERT's loss is transformers' ForMaskedLMLoss: a trainer's num_items_in_batch divides its sum (sparse
    # prediction or not); BERT's is a plain mean over the labelled tokens, which ignores it. The fused loss does each.
    fused, eager, _ = _lm_models(case)
    batch = _lm_batch(case)
    n = torch.tensor(40)
    want = eager(**batch, num_items_in_batch=n).loss
    torch.testing.assert_close(fused(**batch, num_items_in_batch=n).loss, want, rtol=1e-5, atol=1e-6)
    valid = int((batch["labels"] != -100).sum())
    scale = valid / 40 if case.startswith("modernbert") else 1.0
    torch.testing.assert_close(want, eager(**batch).loss * scale, rtol=1e-5, atol=1e-6)


def test_fuse_lm_loss_refuses_other_heads_and_bad_options():
    from transformers import AutoModelForSequenceClassification
    with pytest.raises(ValueError, match="fuse_lm_loss covers"):
        pk_hf.fuse_lm_loss(AutoModel.from_config(bert_config()))
    with pytest.raises(ValueError, match="fuse_lm_loss covers"):
        pk_hf.fuse_lm_loss(AutoModelForSequenceClassification.from_config(bert_config()))
    gemma2 = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0)
    with pytest.raises(ValueError, match="soft-cap"):  # (its logits are soft-capped: not the plain head)
        pk_hf.fuse_lm_loss(AutoModelForCausalLM.from_config(gemma2))
    other_loss = AutoModelForCausalLM.from_config(gpt2_config())
    other_loss.loss_type = "ForMaskedLM"  # (a config naming another loss for the model's loss_function)
    with pytest.raises(ValueError, match="ForCausalLMLoss"):
        pk_hf.fuse_lm_loss(other_loss)
    modern = AutoModelForMaskedLM.from_config(_tiny_mlm("modernbert")())
    modern.loss_type = "ForCausalLM"
    with pytest.raises(ValueError, match="ForMaskedLMLoss"):
        pk_hf.fuse_lm_loss(modern)
    modern = AutoModelForMaskedLM.from_config(_tiny_mlm("modernbert-sparse")(sparse_pred_ignore_index=0))
    with pytest.raises(ValueError, match="sparse prediction drops the positions labelled 0"):
        pk_hf.fuse_lm_loss(modern)
    model = AutoModelForMaskedLM.from_config(bert_config())
    with pytest.raises(ValueError, match="z_loss"):
        pk_hf.fuse_lm_loss(model, z_loss=-1.0)
    with pytest.raises(ValueError, match="max_valid"):
        pk_hf.fuse_lm_loss(model, max_valid=0)
    with pytest.raises(ValueError, match="backend"):
        pk_hf.fuse_lm_loss(model, backend="cudnn")
    with pytest.raises(TypeError, match="in_eval"):
        pk_hf.fuse_lm_loss(model, in_eval=1)
    assert type(model).__name__ == "BertForMaskedLM"  # a refusal leaves the model as it was
    assert pk_hf.fuse_lm_loss(pk_hf.fuse_lm_loss(model)) is model  # again: the same class, new options
    assert type(model).__name__ == "FusedLossBertForMaskedLM" and type(model).__bases__[0].__name__ == "BertForMaskedLM"


def test_fuse_lm_loss_under_torch_compile():
    torch._dynamo.reset()
    fused, eager, _ = _lm_models("bert-mlm")
    batch = _lm_batch("bert-mlm")
    compiled = torch.compile(fused, backend="aot_eager")
    loss = compiled(**batch).loss
    loss.backward()
    got = {n: p.grad for n, p in fused.named_parameters() if p.grad is not None}
    want = _loss_grads(eager, batch)
    torch.testing.assert_close(loss.detach(), want[1], rtol=1e-5, atol=1e-6)
    assert set(got) == set(want[2])
    for name, g in want[2].items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["bert-base", "gpt2"])
def test_gpu_fuse_lm_loss_bf16_autocast(case):
    # Realistic vocabularies under bf16 autocast (the head's matmul in bf16, as transformers' nn.Linear under
    # autocast): the fused loss and gradients against transformers' own loss in float64 by the 2x rule.
    if case == "bert-base":
        cfg = BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=2, num_attention_heads=12,
                         intermediate_size=3072, max_position_embeddings=512, **NO_DROPOUT["bert"])
        auto_cls = AutoModelForMaskedLM
    else:
        cfg = GPT2Config(vocab_size=50257, n_embd=768, n_layer=2, n_head=12, n_positions=1024, bos_token_id=0,
                         eos_token_id=0, **NO_DROPOUT["gpt2"])
        auto_cls = AutoModelForCausalLM
    torch.manual_seed(1)
    models = [auto_cls.from_config(cfg, attn_implementation="sdpa") for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    fused = pk_hf.fuse_lm_loss(models[0].cuda().train())
    eager, hi = models[1].cuda().train(), models[2].cuda().double().train()
    ids = torch.randint(0, cfg.vocab_size, (4, 256), device="cuda")
    if case == "bert-base":
        labels = torch.where(torch.rand(ids.shape, device="cuda") < 0.15, ids, -100)
    else:
        labels = ids
    batch = dict(input_ids=ids, labels=labels)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss, g = _loss_grads(fused, batch)
        _, loss_lo, g_lo = _loss_grads(eager, batch)
    _, loss_hi, g_hi = _loss_grads(hi, batch)
    assert_close_to_ref("loss", loss, loss_hi, loss_lo, atol=1e-4)
    for name in ("bert.embeddings.word_embeddings.weight", "cls.predictions.bias",
                 "cls.predictions.transform.dense.weight", "bert.encoder.layer.1.output.dense.weight",
                 "transformer.wte.weight", "transformer.h.1.mlp.c_proj.weight", "transformer.ln_f.weight"):
        if name in g_hi:
            assert_close_to_ref(f"grad {name}", g[name].float(), g_hi[name], g_lo[name].float(),
                                atol=1e-4 * max(1.0, g_hi[name].abs().max().item()))
