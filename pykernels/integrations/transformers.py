"""Hugging Face transformers drop-in: ``attn_implementation="pykernels"``.

Usage::

    import pykernels.integrations.transformers as pk_hf
    pk_hf.register()                      # once per process; calling it again does nothing
    model = BertForMaskedLM.from_pretrained(path, attn_implementation="pykernels")
    model = GPT2LMHeadModel(config)       # with config._attn_implementation = "pykernels", or
    model = AutoModel.from_config(config, attn_implementation="pykernels")
    with pykernels.use_backend("triton"):  # optional: pin the backend (default "auto")
        out = model(**batch)
    pk_hf.fuse_residual_layer_norms(model)  # BERT's post-LN blocks: dropout + residual add + LayerNorm, one kernel
    pk_hf.fuse_lm_loss(model)             # model(**batch, labels=labels).loss by pykernels.masked_lm_loss

How it plugs in (public transformers API only, no monkeypatching of model code):

* ``AttentionInterface.register("pykernels", attention_forward)``: every model whose attention
  modules dispatch through ``ALL_ATTENTION_FUNCTIONS`` (BERT, GPT-2, Llama, ... in transformers 5.x)
  calls :func:`attention_forward` with ``(module, query, key, value, attention_mask, dropout=,
  scaling=, is_causal=?, **kwargs)``, query/key/value of shape (B, H, S, D) (key/value may have
  fewer heads: GQA), and expects ``(attn_output (B, S, H, D) contiguous, None)``.
* ``AttentionMaskInterface.register("pykernels", build_mask)``: the model's mask builders
  (``create_bidirectional_mask`` / ``create_causal_mask``) then make masks for us.
  :func:`build_mask` delegates to transformers' own SDPA mask builder (boolean, True = take part;
  ``None`` where the mask can be dropped: no padding, or plain causal that ``is_causal`` covers) and
  then narrows a pure key-padding mask from (B, 1, Sq, Sk) to (B, 1, 1, Sk), the shape that
  :func:`pykernels.scaled_dot_product_attention` serves on its key-padding fast path (it reads
  B*Sk booleans instead of B*Sq*Sk). "Pure key padding" is decided from the mask recipe (the
  builder's ``mask_function`` is transformers' plain bidirectional one, so every query row is the
  same), never from the mask's values, so it costs no device sync. A causal model's mask with
  padding (the plain causal recipe AND a 2-D padding mask, queries and keys from position 0) is
  returned as that 2-D (B, Sk) padding mask, as transformers' flash-attention builder does, and
  :func:`attention_forward` runs it as ``is_causal`` plus the (B, 1, 1, Sk) key mask: the kernels
  skip the blocks above the diagonal and read B*Sk booleans instead of the (B, 1, S, S) mask.

What reaches the kernel, per model:

=========================== ===================================== ==============================
case                        attn_mask                             is_causal
=========================== ===================================== ==============================
BERT, no padding            None                                  False
BERT, padding               (B, 1, 1, Sk) bool                    False
GPT-2 / causal, no padding  None (eager and compiled)              True (top-left; Sq == Sk)
GPT-2 / causal, padding     (B, 1, 1, Sk) bool (the padding)      True (top-left; Sq == Sk)
decoding (Sq == 1)          None or (B, 1, 1, Sk) bool            False
user-supplied 4-D mask      passed through (bool or additive)     False
=========================== ===================================== ==============================

Dropout is applied only while ``module.training`` (transformers passes 0.0 in eval already; we
check again so that a module in eval never drops). GQA (``module.num_key_value_groups > 1``) goes
to the kernel as ``enable_gqa=True`` without repeating key/value. ``output_attentions=True``
cannot return weights (the kernel never forms them): it warns once and returns ``None`` weights,
like transformers' own ``sdpa``.

Not supported (raise ``ValueError`` naming the argument): ``softcap``, attention sinks
(``s_aux``), ``position_bias`` (T5-style biases; use ``"sdpa"`` for those models).

Compatibility: written against transformers 5.x (``AttentionInterface`` in ``modeling_utils`` and
``AttentionMaskInterface`` in ``masking_utils``, present since 4.53); the mask builder forwards
every keyword to transformers' SDPA builder, so its signature changes across versions do not
matter. Models that do not dispatch through ``ALL_ATTENTION_FUNCTIONS`` (e.g. BERT in 4.x, which keeps
its own per-implementation attention classes) cannot use ``"pykernels"``: they fail when they look the
name up.

A 2-D ``attention_mask`` reaching :func:`attention_forward` (from :func:`build_mask`, or any caller
following transformers' flash-attention convention) is a (B, Sk) padding mask of bool or integer
dtype; causality then comes from ``module.is_causal`` (bottom-right aligned where Sq < Sk, as
transformers' own causal masks with a cache). Fully masked query rows (left padding before the first
token of a causal model) give 0 here, where ``eager`` gives the mean of the values; these rows are
padding either way.
"""
from __future__ import annotations

import dataclasses
import sys
import threading
import warnings
from typing import Callable

import torch

import pykernels

NAME = "pykernels"

_lock = threading.Lock()
_registered = False
_sdpa_mask: Callable | None = None  # transformers' SDPA mask builder, captured at register()
_bidirectional_fn: Callable | None = None  # masking_utils.bidirectional_mask_function (None if absent)
_causal_fn: Callable | None = None  # masking_utils.causal_mask_function (None if absent)
_warned_output_attentions = False


def _is_pure_key_padding(mask_function) -> bool:
    """The mask recipe is "every key allowed, then AND the 2-D padding mask": all query rows equal."""
    return _bidirectional_fn is not None and mask_function is _bidirectional_fn


def _zero(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v == 0


def _is_plain_causal(args, mask_function, kwargs) -> bool:
    """The recipe is transformers' plain causal mask over keys that start with the queries: no 2-D padding mask, no
    window, no offset (``q_length == kv_length``, offsets 0). ``is_causal`` gives exactly that mask. Read from the
    builder's arguments only (never the mask's values), so it costs no device sync and holds under torch.compile."""
    if args or _causal_fn is None or mask_function is not _causal_fn:
        return False
    if kwargs.get("attention_mask") is not None or kwargs.get("local_size") is not None:
        return False
    if not kwargs.get("allow_is_causal_skip", True):
        return False
    if not (_zero(kwargs.get("kv_offset", 0)) and _zero(kwargs.get("q_offset", 0))):
        return False
    q_len = kwargs.get("q_length")
    if q_len is None:  # (older builders: the query positions as cache_position)
        pos = kwargs.get("cache_position")
        q_len = pos.shape[0] if isinstance(pos, torch.Tensor) and pos.dim() == 1 else None
    kv_len = kwargs.get("kv_length")
    return isinstance(q_len, int) and isinstance(kv_len, int) and q_len == kv_len


def _is_causal_key_padding(args, mask_function, kwargs) -> bool:
    """The recipe is transformers' plain causal mask AND a 2-D padding mask, over keys that start with the queries (no
    window, no offset, ``q_length == kv_length``): exactly ``is_causal`` plus a key-padding mask. Read from the builder's
    arguments only (no device sync, holds under torch.compile)."""
    pad = kwargs.get("attention_mask")
    if not (isinstance(pad, torch.Tensor) and pad.dim() == 2):
        return False
    return _is_plain_causal(args, mask_function, {**kwargs, "attention_mask": None})


def _tracing(t: torch.Tensor) -> bool:
    """Dynamo, a fake tensor or a CUDA-graph capture: where a mask's values cannot be read on the host."""
    try:
        from transformers.utils.import_utils import is_tracing
        return bool(is_tracing(t))
    except ImportError:  # (older transformers: the same checks by hand)
        return (torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing()
                or type(t).__name__ == "FakeTensor")


def _key_padding_2d(pad: torch.Tensor, kv_length: int) -> torch.Tensor | None:
    """The 2-D padding mask over the ``kv_length`` keys (as transformers' builders read it: columns past its end are
    padding), boolean and contiguous; ``None`` where it keeps every key and its values may be read (eager mode, as
    transformers' SDPA builder decides: one device sync there, none under compile or capture)."""
    if pad.shape[-1] < kv_length:
        pad = torch.nn.functional.pad(pad, (0, kv_length - pad.shape[-1]))
    pad = pad[:, :kv_length]
    pad = pad if pad.dtype == torch.bool else pad != 0
    if not _tracing(pad) and bool(pad.all()):
        return None
    return pad.contiguous()


def build_mask(*args, mask_function=None, **kwargs):
    """Mask builder registered under ``"pykernels"`` in transformers' ``AttentionMaskInterface``.

    Returns what transformers' SDPA builder returns (``None`` or a boolean (B, 1, Sq, Sk) mask,
    True = take part), except that a pure key-padding mask comes back as (B, 1, 1, Sk), contiguous, a causal
    mask with padding as the 2-D (B, Sk) padding mask (``None`` in eager mode where it keeps every key, as
    transformers decides: one device sync there), and a plain causal mask without padding is ``None`` under
    torch.compile too (:func:`attention_forward` then runs
    the kernels' causal path, which skips the blocks above the diagonal). transformers' own builder returns
    ``None`` there in eager mode only: while dynamo compiles (torch < 2.14 cannot tell compile from export) it
    materialises the (B, 1, S, S) mask, which the kernels would read a tile per block (GPT-2's compiled training
    step: 29 ms of attention kernels a step against 6 with ``is_causal``, H200).
    """
    if _is_plain_causal(args, mask_function, kwargs):
        return None
    if _is_causal_key_padding(args, mask_function, kwargs):
        return _key_padding_2d(kwargs["attention_mask"], kwargs["kv_length"])
    if mask_function is not None:
        kwargs["mask_function"] = mask_function
    mask = _sdpa_mask(*args, **kwargs)
    if (isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.dtype == torch.bool
            and mask.shape[-2] > 1 and _is_pure_key_padding(mask_function)):
        # Every query row of a bidirectional+padding mask is the same row: keep one.
        mask = mask[:, :, :1, :].contiguous()
    return mask


def _key_mask_from_2d(mask: torch.Tensor, batch: int, kv_len: int) -> torch.Tensor:
    """A (B, Sk) padding mask (True / nonzero = a real token) as the (B, 1, 1, Sk) boolean key mask of the kernels'
    key-padding path."""
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(f"attention_mask: a 2-D mask is a (batch, keys) padding mask of bool or integer dtype (True / 1 "
                        f"= a real token); got dtype {mask.dtype}")
    if mask.shape[0] not in (1, batch) or mask.shape[1] != kv_len:
        raise ValueError(f"attention_mask: a 2-D padding mask must have shape ({batch}, {kv_len}) (batch, keys); got "
                         f"{tuple(mask.shape)}")
    mask = mask if mask.dtype == torch.bool else mask != 0
    return mask[:, None, None, :]


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention function registered under ``"pykernels"`` in transformers' ``AttentionInterface``.

    Args:
        module: the calling attention module (read: ``training``, ``is_causal``, ``num_key_value_groups``).
        query: (B, Hq, Sq, D); key, value: (B, Hkv, Sk, D) with Hq a multiple of Hkv; fp16/bf16/fp32.
        attention_mask: None, a bool mask broadcastable to (B, Hq, Sq, Sk) (True = take part; a
            (B, 1, 1, Sk) key-padding mask takes the kernel's fast path), an additive float mask, or a 2-D
            (B, Sk) bool / integer padding mask (True / 1 = a real token), applied with the module's causality.
        dropout: attention-probability dropout, applied only while ``module.training``.
        scaling: softmax scale (default 1/sqrt(D)).
        is_causal: overrides ``module.is_causal``; causal is used only when there is no mask or a 2-D one
            (a materialised 4-D mask already carries causality) and Sq > 1.

    Returns:
        ``(attn_output, None)``: attn_output (B, Sq, Hq, D) contiguous, dtype of ``query``.
    """
    global _warned_output_attentions
    for bad in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(bad) is not None:
            raise ValueError(f"attn_implementation='pykernels' does not support {bad}; got {bad}="
                             f"{type(kwargs[bad]).__name__}. Use attn_implementation='sdpa' or 'eager' for this model")
    if kwargs.get("output_attentions", False) and not _warned_output_attentions:
        _warned_output_attentions = True
        warnings.warn("attn_implementation='pykernels' never forms the attention weights; output_attentions=True "
                      "returns None for them (use attn_implementation='eager' to get them)", stacklevel=2)

    q_len, kv_len = query.shape[2], key.shape[2]
    enable_gqa = getattr(module, "num_key_value_groups", 1) > 1

    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    padding_2d = isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
    if padding_2d:  # (B, Sk) key padding (build_mask's causal-and-padding recipe; transformers' flash convention)
        attention_mask = _key_mask_from_2d(attention_mask, query.shape[0], kv_len)
    # As transformers' sdpa: a materialised 4-D mask carries causality already; one query row attends everything.
    causal = bool(causal) and (attention_mask is None or padding_2d) and q_len > 1
    if causal and kv_len > q_len:
        if attention_mask is None:
            # Prefill into an empty static cache: keys past q_len are empty slots that the top-left
            # causal mask would hide anyway; dropping them lets Sq == Sk.
            key, value = key[:, :, :q_len], value[:, :, :q_len]
        else:
            # queries that follow cached keys: causal aligned bottom-right (query i sees keys j <= i + Sk - Sq), as
            # transformers' own masks and flash-attention's causal, materialised with the padding
            below = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
            attention_mask, causal = attention_mask & below, False

    dropout_p = float(dropout) if module.training else 0.0
    out = pykernels.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout_p,
                                                 is_causal=causal, scale=scaling, enable_gqa=enable_gqa)
    # (B, H, Sq, D) -> (B, Sq, H, D), the layout the model's output projection reads.
    return out.transpose(1, 2).contiguous(), None


def register(*, name: str = NAME) -> str:
    """Make ``attn_implementation=name`` (default ``"pykernels"``) available to transformers models.

    Registers :func:`attention_forward` in ``transformers.AttentionInterface`` and :func:`build_mask`
    in ``transformers.masking_utils.AttentionMaskInterface``. Idempotent: later calls re-register the
    same functions and change nothing. Returns the name.

    Raises:
        ImportError: transformers is not installed, or too old to have the attention interfaces.
        TypeError: ``name`` is not a non-empty string.
    """
    global _registered, _sdpa_mask, _bidirectional_fn, _causal_fn
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    try:
        from transformers import masking_utils
        from transformers.modeling_utils import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError("pykernels.integrations.transformers needs transformers >= 4.53 (AttentionInterface and "
                          f"AttentionMaskInterface); import failed: {e}") from e
    with _lock:
        if _sdpa_mask is None:
            # The global (class-level) mapping, so a local override of "sdpa" cannot redirect us.
            _sdpa_mask = AttentionMaskInterface._global_mapping["sdpa"]
            _bidirectional_fn = getattr(masking_utils, "bidirectional_mask_function", None)
            _causal_fn = getattr(masking_utils, "causal_mask_function", None)
        AttentionInterface.register(name, attention_forward)
        AttentionMaskInterface.register(name, build_mask)
        _registered = True
    return name


# The post-LN output blocks of BERT and its descendants: ``LayerNorm(dropout(dense(h)) + input_tensor)``.
POST_LN_OUTPUT_CLASSES = frozenset({
    "BertSelfOutput", "BertOutput", "RobertaSelfOutput", "RobertaOutput", "XLMRobertaSelfOutput", "XLMRobertaOutput",
    "CamembertSelfOutput", "CamembertOutput", "ElectraSelfOutput", "ElectraOutput"})
_fused_classes: dict[type, type] = {}


def _fused_post_ln_forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
    """``LayerNorm(dropout(dense(hidden_states)) + input_tensor)`` as one :func:`pykernels.layer_norm` call after the
    projection: the dropout (in training), the residual add and the norm in one kernel, forward and backward."""
    ln = self.LayerNorm
    p = self.dropout.p if self.training else 0.0
    return pykernels.layer_norm(self.dense(hidden_states), ln.weight, ln.bias, ln.eps, residual=input_tensor,
                                dropout_p=p, backend=getattr(ln, "backend", None))


def fuse_residual_layer_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Fuse the post-LN blocks of a BERT-family model, in place: each ``BertSelfOutput`` / ``BertOutput`` (and
    RoBERTa's, XLM-R's, CamemBERT's, ELECTRA's, :data:`POST_LN_OUTPUT_CLASSES`) computes
    ``LayerNorm(dropout(dense(h)) + input_tensor)`` with one :func:`pykernels.layer_norm` call (dropout, residual
    add and norm fused) instead of three ops. The module keeps its parameters, names and ``state_dict``; only its
    class changes, to a subclass named ``Fused<Name>`` whose ``forward`` does the fused call.

    Dropout draws from pykernels' stream (same rate, another mask than ``nn.Dropout``'s). Under autocast the
    output is in the projection's dtype (bf16 / fp16) where transformers' ``LayerNorm`` returns fp32.

    Returns ``model``. Raises ``ValueError`` when no module of those classes is found (e.g. a GPT-2 model, whose
    blocks are pre-LN: use :func:`pykernels.nn.replace_layer_norms` there) or one of them lacks a ``dense``
    ``nn.Linear``, a ``dropout`` ``nn.Dropout`` or a one-dim ``LayerNorm``.
    """
    found = [m for m in model.modules()
             if type(m).__name__ in POST_LN_OUTPUT_CLASSES or type(m) in _fused_classes.values()]
    for m in found:  # every block checked before any is changed: a refusal leaves the model as it was
        ln = getattr(m, "LayerNorm", None)
        if not (isinstance(getattr(m, "dense", None), torch.nn.Linear)
                and isinstance(getattr(m, "dropout", None), torch.nn.Dropout)
                and isinstance(ln, torch.nn.LayerNorm) and len(ln.normalized_shape) == 1):
            raise ValueError(f"model: {type(m).__name__} must have dense (nn.Linear), dropout (nn.Dropout) and a "
                             "one-dim LayerNorm (nn.LayerNorm) to be fused")
    for m in found:
        cls = type(m)
        if cls in _fused_classes.values():
            continue
        if cls not in _fused_classes:
            _fused_classes[cls] = type(f"Fused{cls.__name__}", (cls,), {"forward": _fused_post_ln_forward,
                                                                         "__module__": __name__})
        m.__class__ = _fused_classes[cls]
    if not found:
        raise ValueError("model: no post-LN output block to fuse (expected one of "
                         f"{sorted(POST_LN_OUTPUT_CLASSES)}); pre-LN models (GPT-2) keep their blocks: use "
                         "pykernels.nn.replace_layer_norms(model) for their LayerNorms")
    return model


# The LM heads whose loss fuse_lm_loss computes with pykernels.masked_lm_loss, by model class: "mlm" (BERT's
# transform, RoBERTa's dense / gelu / layer_norm, ELECTRA's generator predictions or DeBERTa's dense / act / LayerNorm,
# DistilBERT's, ALBERT's or ModernBERT's, then the tied decoder or word embeddings with the head's bias: _MLM_HEADS;
# HF's mean over the labelled tokens), "mlm-items" (that as transformers' ForMaskedLMLoss, which divides by a
# trainer's ``num_items_in_batch``: ModernBERT), "pretraining" (that plus
# next-sentence prediction) and "causal" (the tied or untied output embedding applied to the base model's last hidden
# state as it is, labels shifted; HF's ForCausalLMLoss, which divides by ``num_items_in_batch`` when the trainer passes
# it). Each was compared with transformers' own loss (tests/test_integrations_transformers.py). Heads that scale or
# soft-cap their logits (Gemma 2 and 3, Cohere, Granite) are not in it.
LM_LOSS_CLASSES = {"BertForMaskedLM": "mlm", "BertForPreTraining": "pretraining", "RobertaForMaskedLM": "mlm",
                   "XLMRobertaForMaskedLM": "mlm", "CamembertForMaskedLM": "mlm", "ElectraForMaskedLM": "mlm",
                   "DebertaForMaskedLM": "mlm", "DebertaV2ForMaskedLM": "mlm", "DistilBertForMaskedLM": "mlm",
                   "AlbertForMaskedLM": "mlm", "ModernBertForMaskedLM": "mlm-items", "GPT2LMHeadModel": "causal",
                   "LlamaForCausalLM": "causal", "MistralForCausalLM": "causal", "Qwen2ForCausalLM": "causal",
                   "Qwen3ForCausalLM": "causal", "Phi3ForCausalLM": "causal", "GemmaForCausalLM": "causal",
                   "GPTNeoXForCausalLM": "causal", "OPTForCausalLM": "causal"}
_fused_loss_classes: dict[type, type] = {}


def _call_arguments(sig, model, args, kwargs) -> dict:
    """The call's arguments by name (the forward's ``**kwargs`` flattened in), only those the caller passed."""
    bound = sig.bind(model, *args, **kwargs)
    named = {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind is sig.parameters[name].VAR_KEYWORD:
            named.update(value)
        elif kind is sig.parameters[name].VAR_POSITIONAL:
            if value:
                raise TypeError(f"{type(model).__name__}.forward: unexpected positional arguments {value!r}")
        elif name != "self":
            named[name] = value
    return named


def _bert_head(model):
    """BERT's ``cls.predictions`` (legacy DeBERTa's too): its ``transform`` module, then ``decoder``."""
    pred = model.cls.predictions
    return pred.decoder.weight, pred.decoder.bias, pred.transform


def _roberta_head(model):
    """RoBERTa's (XLM-R's, CamemBERT's) ``lm_head``: ``layer_norm(gelu(dense(x)))`` with the ``gelu`` its own module
    calls, then ``decoder``."""
    head = model.lm_head
    act = sys.modules[type(head).__module__].gelu
    return head.decoder.weight, head.decoder.bias, lambda x: head.layer_norm(act(head.dense(x)))


def _electra_head(model):
    """ELECTRA's generator: ``generator_predictions``, then ``generator_lm_head``."""
    head = model.generator_lm_head
    return head.weight, head.bias, model.generator_predictions


def _deberta_head(model):
    """DeBERTa's (v1 and v2) ``lm_predictions.lm_head``: ``LayerNorm(act(dense(x)))``, then the word embeddings and
    the head's own bias; with ``config.legacy`` the model keeps BERT's ``cls.predictions`` instead."""
    if hasattr(model, "cls"):
        return _bert_head(model)
    head = model.lm_predictions.lm_head
    return (model.deberta.embeddings.word_embeddings.weight, head.bias,
            lambda x: head.LayerNorm(head.transform_act_fn(head.dense(x))))


def _distilbert_head(model):
    """DistilBERT's ``vocab_transform``, ``activation``, ``vocab_layer_norm``, then ``vocab_projector``."""
    proj = model.vocab_projector
    return proj.weight, proj.bias, lambda x: model.vocab_layer_norm(model.activation(model.vocab_transform(x)))


def _albert_head(model):
    """ALBERT's ``predictions``: ``LayerNorm(activation(dense(x)))``, then its ``decoder``."""
    pred = model.predictions
    return pred.decoder.weight, pred.decoder.bias, lambda x: pred.LayerNorm(pred.activation(pred.dense(x)))


def _modernbert_head(model):
    """ModernBERT's ``head``, then its ``decoder`` (a bias or not)."""
    return model.decoder.weight, model.decoder.bias, model.head


# model class -> (weight, bias, transform) of its masked-LM head as the model's forward applies them, for every
# LM_LOSS_CLASSES entry that is not "causal" (tests/test_integrations_transformers.py checks the two tables agree)
_MLM_HEADS: dict[str, Callable] = {
    "BertForMaskedLM": _bert_head, "BertForPreTraining": _bert_head, "RobertaForMaskedLM": _roberta_head,
    "XLMRobertaForMaskedLM": _roberta_head, "CamembertForMaskedLM": _roberta_head,
    "ElectraForMaskedLM": _electra_head, "DebertaForMaskedLM": _deberta_head, "DebertaV2ForMaskedLM": _deberta_head,
    "DistilBertForMaskedLM": _distilbert_head, "AlbertForMaskedLM": _albert_head,
    "ModernBertForMaskedLM": _modernbert_head}


def _fused_lm_loss_forward(self, *args, **kwargs):
    """The model's forward with its loss from :func:`pykernels.masked_lm_loss` (:func:`fuse_lm_loss`): the base model,
    the head's transform (BERT), then the fused LM head + cross-entropy at the labelled tokens; ``logits`` is None.
    Without labels (or in eval mode, unless ``in_eval``) it is the model's own forward."""
    cls = type(self)
    base_forward = cls._pk_base_forward
    kind = cls._pk_kind
    named = _call_arguments(cls._pk_signature, self, args, kwargs)
    labels = named.pop("labels", None)
    nsp_labels = named.pop("next_sentence_label", None)
    opts = self._pk_lm_loss_options
    in_eval = self._pk_lm_loss_in_eval
    keep = named.pop("logits_to_keep", 0)
    if (labels is None or (kind == "pretraining" and nsp_labels is None) or not (self.training or in_eval)
            or not (isinstance(keep, int) and keep == 0)):
        return base_forward(self, *args, **kwargs)
    return_dict = named.pop("return_dict", None)
    num_items = named.pop("num_items_in_batch", None)
    out = getattr(self, self.base_model_prefix)(**named, return_dict=True)
    h = out[0]
    if kind == "causal":
        head = self.get_output_embeddings()
        weight, bias, transform = head.weight, head.bias, None
        target = pykernels.shift_labels(labels)
    else:
        weight, bias, transform = cls._pk_head(self)
        target = labels
        if kind == "mlm":
            num_items = None  # (their losses are the plain mean over the labelled tokens; "mlm-items" is
            # transformers' ForMaskedLMLoss, which divides by num_items_in_batch where the trainer passes it)
    if transform is not None:
        h = transform(h)
    if torch.is_autocast_enabled(h.device.type):  # the dtype autocast would give the head's matmul
        dtype = torch.get_autocast_dtype(h.device.type)
    else:
        dtype = weight.dtype
    loss = pykernels.masked_lm_loss(h.to(dtype), weight.to(dtype), target.to(h.device),
                                    bias=bias.to(dtype) if bias is not None else None, num_valid=num_items, **opts)
    fields = dict(loss=loss)
    if kind == "pretraining":
        from transformers.models.bert.modeling_bert import BertForPreTrainingOutput as Output
        rel = self.cls.seq_relationship(out.pooler_output)
        fields["loss"] = loss + torch.nn.functional.cross_entropy(rel.view(-1, 2), nsp_labels.view(-1).to(rel.device))
        fields["seq_relationship_logits"] = rel
    elif kind in ("mlm", "mlm-items"):
        from transformers.modeling_outputs import MaskedLMOutput as Output
    elif hasattr(out, "cross_attentions"):
        from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions as Output
    else:
        from transformers.modeling_outputs import CausalLMOutputWithPast as Output
    for f in dataclasses.fields(Output):  # the base model's outputs the head's output class carries on (caches,
        if f.name not in fields and f.name not in ("logits", "prediction_logits") and hasattr(out, f.name):
            fields[f.name] = getattr(out, f.name)  # hidden states, attentions: their names follow the version)
    result = Output(**fields)
    return result.to_tuple() if return_dict is False else result


def fuse_lm_loss(model: torch.nn.Module, *, z_loss: float = 0.0, label_smoothing: float = 0.0,
                 max_valid: int | None = None, dense: bool = False, graph_safe: bool = False,
                 backend: str | None = None, in_eval: bool = False) -> torch.nn.Module:
    """Compute a transformers LM's training loss with :func:`pykernels.masked_lm_loss`, in place: the LM head's matmul
    and the softmax cross-entropy only at the labelled tokens (BERT's 15%; every next token of a causal LM), fused,
    so the (tokens, vocabulary) logits are never materialised. ``model(..., labels=labels).loss`` is transformers'
    loss (the mean over the labelled tokens; a causal LM's labels shifted inside, and divided by
    ``num_items_in_batch`` when a trainer passes it, as transformers' ``ForCausalLMLoss`` does, and so is
    ModernBERT's masked-LM loss, transformers' ``ForMaskedLMLoss``; BERT pre-training adds
    the next-sentence loss), and ``.logits`` is None. Calls without labels, and calls in eval mode unless
    ``in_eval=True``, run the model's own forward (logits and all).

    Models: :data:`LM_LOSS_CLASSES` (``BertForMaskedLM``, ``BertForPreTraining``, the RoBERTa, XLM-R, CamemBERT,
    ELECTRA (its generator), DeBERTa and DeBERTa-v2 (``config.legacy`` either way), DistilBERT, ALBERT and
    ModernBERT masked LMs, ``GPT2LMHeadModel``, and the Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma, GPT-NeoX and OPT
    causal LMs). The module keeps its parameters, names and ``state_dict`` (weight tying included); only
    its class changes, to a subclass ``FusedLoss<Name>``. The keywords go to :func:`pykernels.masked_lm_loss`
    (``z_loss``, ``label_smoothing``, ``max_valid``, ``dense``, ``graph_safe``, ``backend``); under autocast the
    head runs in autocast's dtype, as its ``nn.Linear`` would. ``logits_to_keep`` other than 0 takes the model's
    own forward. Calling it again replaces the options. Returns ``model``.

    Raises ``ValueError`` for a model class outside :data:`LM_LOSS_CLASSES` (another head may scale or cap its
    logits, which the fused loss would silently skip) and ``TypeError`` / ``ValueError`` for bad options (checked
    here, by :func:`pykernels.masked_lm_loss`'s own checks, not at the first training step)."""
    cls = type(model)
    base = cls.__bases__[0] if cls in _fused_loss_classes.values() else cls
    kind = LM_LOSS_CLASSES.get(base.__name__)
    if kind is None:
        raise ValueError(f"model: fuse_lm_loss covers {sorted(LM_LOSS_CLASSES)}, got {base.__name__} (another LM head "
                         "may transform its logits, e.g. scale or soft-cap them, which the fused loss would skip)")
    if not isinstance(in_eval, bool):
        raise TypeError(f"in_eval must be a bool, got {type(in_eval).__name__}")
    # (a config may name another loss for the model's loss_function: the fused one is the kind's)
    hf_loss = {"causal": "ForCausalLMLoss", "mlm-items": "ForMaskedLMLoss"}.get(kind)
    if hf_loss is not None:
        from transformers.loss import loss_utils
        if getattr(model, "loss_function", None) is not getattr(loss_utils, hf_loss):
            raise ValueError(f"model: fuse_lm_loss computes transformers' {hf_loss}, but {base.__name__}'s "
                             f"loss_function is {getattr(model, 'loss_function', None)!r}")
    if kind == "mlm-items":
        config = model.config
        if getattr(config, "sparse_prediction", False) and getattr(config, "sparse_pred_ignore_index", -100) != -100:
            raise ValueError("model: fuse_lm_loss ignores the labels -100; this config's sparse prediction drops the "
                             f"positions labelled {config.sparse_pred_ignore_index} instead")
    options = dict(z_loss=z_loss, label_smoothing=label_smoothing, max_valid=max_valid, dense=dense,
                   graph_safe=graph_safe, backend=backend)
    from pykernels.masked_lm_loss import check_options
    check_options(**options)  # (the op's own checks, now rather than at the first training step)
    if base not in _fused_loss_classes:
        import inspect
        _fused_loss_classes[base] = type(f"FusedLoss{base.__name__}", (base,), {
            "forward": _fused_lm_loss_forward, "__module__": __name__, "_pk_base_forward": base.forward,
            "_pk_kind": kind, "_pk_head": staticmethod(_MLM_HEADS.get(base.__name__)),
            "_pk_signature": inspect.signature(base.forward)})
    model._pk_lm_loss_options, model._pk_lm_loss_in_eval = options, in_eval
    model.__class__ = _fused_loss_classes[base]
    return model


def is_registered() -> bool:
    """Whether :func:`register` has run in this process."""
    return _registered


__all__ = ["register", "is_registered", "attention_forward", "build_mask", "fuse_residual_layer_norms", "fuse_lm_loss",
           "LM_LOSS_CLASSES",
           "POST_LN_OUTPUT_CLASSES", "NAME"]
