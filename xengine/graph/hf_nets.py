"""Language models of the ``transformers`` package as nets (``net=hf_gpt2``, ``net=hf_llama``),
built from their configuration classes with seeded random weights: nothing is downloaded.

torch.fx cannot trace the models' own ``forward`` (cache objects, mask builders under
``vmap``, shapes unpacked into tuples), and ``transformers.utils.fx`` fails on both in 4.57.
So :class:`HFCausalLM` composes the model's *own modules* (embeddings, norms, attention, MLP,
head: the parameters and the code that runs them are transformers') in a forward written
here, the same sum a decoder layer computes (pre-norm residual blocks). The test suite checks
that it gives the model's own logits.

Granularity (``net.granularity``, :data:`xengine.graph.types.GRANULARITIES`):

* ``module``: every attention and every childless transformers module but the activations
  (GPT-2's ``Conv1D`` projections, Llama's RMSNorm) is one op, run by transformers' code;
* ``function``: those are traced through to tensor functions; attention runs
  :class:`AttentionOp`'s functional form (the module's own projections, transformers'
  ``apply_rotary_pos_emb`` for Llama, then
  :func:`torch.nn.functional.scaled_dot_product_attention`, grouped keys and values passed
  as they are), so projections, rotary embedding and the attention kernel are ops of their
  own.

Shapes: ``hf_gpt2`` is GPT-2 small (12 layers, width 768, 12 heads of 64, vocabulary 50257,
dropout 0.1); ``hf_llama`` is a Llama-style decoder small enough for two CPU cores (8 layers,
width 256, 8 heads of 32 sharing 2 key/value heads, SwiGLU MLP of 704, RMSNorm, rotary
embeddings, vocabulary 32000, no dropout). ``num_layers`` and ``width`` scale either; heads
keep their size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from xengine.graph.types import GraphError

HF_NETS = ("hf_gpt2", "hf_llama")


@dataclass(frozen=True)
class HFShape:
    """A decoder's sizes (``kv_heads < heads``: grouped-query attention)."""

    num_layers: int
    width: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq_len: int


DEFAULTS = {
    "hf_gpt2": {"num_layers": 12, "width": 768, "vocab": 50257},
    "hf_llama": {"num_layers": 8, "width": 256, "vocab": 32000},
}
HEAD_DIM = {"hf_gpt2": 64, "hf_llama": 32}


def shape_of(
    net: str, vocab: int | None, seq_len: int, num_layers: int | None, width: int | None
) -> HFShape:
    """``net``'s shape with the options given; one :class:`GraphError` line for sizes the
    model cannot take."""
    base = DEFAULTS[net]
    layers = base["num_layers"] if num_layers is None else num_layers
    w = base["width"] if width is None else width
    vocab = base["vocab"] if vocab is None else vocab
    head = HEAD_DIM[net]
    if layers < 1:
        raise GraphError(f"{net}: net.num_layers must be at least 1, got {layers}")
    if w < head or w % head:
        raise GraphError(f"{net}: net.width must be a multiple of the head size {head}, got {w}")
    if seq_len < 2 or vocab < 2:
        raise GraphError(f"{net}: the sequence and the vocabulary need 2 or more, got {seq_len}")
    heads = w // head
    if net == "hf_gpt2":
        return HFShape(layers, w, heads, heads, 4 * w, vocab, seq_len)
    kv = max(1, heads // 4)
    while heads % kv:
        kv -= 1
    ffn = 32 * math.ceil(8 * w / 3 / 32)  # Llama's SwiGLU: 2/3 of 4x, rounded up
    return HFShape(layers, w, heads, kv, ffn, vocab, seq_len)


def _transformers():
    try:
        import transformers
    except ImportError as exc:  # a dependency; an install without it gets one line
        raise GraphError(
            "hf_gpt2 / hf_llama need the transformers package: pip install transformers"
        ) from exc
    return transformers


class AttentionOp(nn.Module):
    """One transformers attention module as one op of the graph.

    ``traced=False`` (module granularity): the module's own forward, without a mask (causal
    attention over the whole sequence, as the model runs without padding). ``traced=True``
    (function granularity): the same computation in functional form, for fx to trace."""

    def __init__(self, attn: nn.Module, kind: str, traced: bool) -> None:
        super().__init__()
        self.attn, self.kind, self.traced = attn, kind, traced

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.traced:
            return self._functional(x, cos, sin)
        if self.kind == "hf_gpt2":
            return self.attn(x)[0]
        return self.attn(x, position_embeddings=(cos, sin), attention_mask=None)[0]

    def _functional(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a = self.attn
        b, t, c = x.shape
        d = a.head_dim
        p = a.attn_dropout.p if self.kind == "hf_gpt2" else a.attention_dropout
        p = p if self.training else 0.0
        if self.kind == "hf_gpt2":
            q, k, v = a.c_attn(x).split(c, dim=2)
            q, k, v = (z.view(b, t, -1, d).transpose(1, 2) for z in (q, k, v))
        else:
            from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

            q = a.q_proj(x).view(b, t, -1, d).transpose(1, 2)
            k = a.k_proj(x).view(b, t, -1, d).transpose(1, 2)
            v = a.v_proj(x).view(b, t, -1, d).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
        # GPT-2 scales by 1/sqrt(head size), sdpa's default; Llama names its scale. Grouped
        # keys and values go to the kernel as they are (enable_gqa), as transformers' sdpa
        # path does without a mask: no repeated copies
        scale = getattr(a, "scaling", None)
        gqa = {"enable_gqa": True} if self.kind == "hf_llama" else {}
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, scale=scale, is_causal=True, **gqa)
        y = y.transpose(1, 2).reshape(b, t, -1)
        if self.kind == "hf_gpt2":
            return a.resid_dropout(a.c_proj(y))
        return a.o_proj(y)


class DecoderBlock(nn.Module):
    """One transformers decoder layer as the pair of residual sums it computes: a module of
    its own, so that the blocks PyTorch's checkpointing wraps (``torch_checkpoint``,
    ``torch_sac``: ``baselines.pytorch.find_blocks``) are the layers."""

    def __init__(self, layer: nn.Module, names: tuple[str, str, str, str]) -> None:
        super().__init__()
        self.layer, self.names = layer, names

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        norm_1, attn, norm_2, mlp = (getattr(self.layer, n) for n in self.names)
        h = h + attn(norm_1(h), cos, sin)
        return h + mlp(norm_2(h))


class HFCausalLM(nn.Module):
    """Token ids ``[batch, seq]`` -> logits ``[batch, seq, vocab]`` through a transformers
    causal LM's modules: embeddings (plus learned positions and dropout for GPT-2), per layer
    (:class:`DecoderBlock`) ``h + attn(norm_1(h))`` then ``h + mlp(norm_2(h))``, a final norm
    and the head (tied to the
    token embedding for GPT-2, as transformers ties it). The model's layers are changed in
    place (their attention wrapped in :class:`AttentionOp`): ``model`` itself no longer runs.
    The rotary ``cos``/``sin`` tables of Llama are computed once by the model's own rotary
    module (buffers: a plain step computes them every step from constants)."""

    def __init__(self, model: nn.Module, kind: str, traced: bool) -> None:
        super().__init__()
        self.kind = kind
        if kind == "hf_gpt2":
            body = model.transformer
            self.embed, self.norm, layers = body.wte, body.ln_f, body.h
            self.wpe, self.drop = body.wpe, body.drop
            names = ("ln_1", "attn", "ln_2", "mlp")
        else:
            body = model.model
            self.embed, self.norm, layers = body.embed_tokens, body.norm, body.layers
            names = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
        self.head = model.lm_head
        for layer in layers:  # the attention module becomes one op (or its functions)
            setattr(layer, names[1], AttentionOp(getattr(layer, names[1]), kind, traced))
        self.blocks = nn.ModuleList(DecoderBlock(layer, names) for layer in layers)
        cfg = model.config
        seq = cfg.max_position_embeddings if kind == "hf_llama" else cfg.n_positions
        pos = torch.arange(seq)
        self.register_buffer("pos", pos, persistent=False)
        cos, sin = torch.zeros(1, seq, 1), torch.zeros(1, seq, 1)  # unused by GPT-2
        if kind == "hf_llama":
            with torch.no_grad():
                probe = torch.zeros(1, seq, 1)
                cos, sin = body.rotary_emb(probe, pos[None])
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        if self.kind == "hf_gpt2":
            h = self.drop(h + self.wpe(self.pos))
        for block in self.blocks:
            h = block(h, self.cos, self.sin)
        return self.head(self.norm(h))


def hf_model(net: str, s: HFShape) -> nn.Module:
    """transformers' own causal LM of shape ``s``, random weights (the caller seeds torch)."""
    tf = _transformers()
    if net == "hf_gpt2":
        cfg = tf.GPT2Config(
            vocab_size=s.vocab, n_positions=s.seq_len, n_embd=s.width, n_layer=s.num_layers,
            n_head=s.heads, n_inner=s.ffn, use_cache=False, attn_implementation="sdpa",
        )  # fmt: skip
        return tf.GPT2LMHeadModel(cfg)
    cfg = tf.LlamaConfig(
        vocab_size=s.vocab, hidden_size=s.width, intermediate_size=s.ffn,
        num_hidden_layers=s.num_layers, num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads, max_position_embeddings=s.seq_len,
        use_cache=False, tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    return tf.LlamaForCausalLM(cfg)


def build_hf(
    net: str,
    vocab: int | None,
    seq_len: int,
    num_layers: int | None = None,
    width: int | None = None,
    granularity: str = "module",
) -> tuple[HFCausalLM, tuple[type[nn.Module], ...]]:
    """``net`` with random weights (the caller seeds torch: the same seed gives
    :func:`hf_model`'s weights) and the module classes that are one op each at
    ``granularity``."""
    model = hf_model(net, shape_of(net, vocab, seq_len, num_layers, width))
    traced = granularity == "function"
    lm = HFCausalLM(model, net, traced)
    if traced:
        return lm, ()
    return lm, (AttentionOp, *_childless_classes(lm))


def _childless_classes(root: nn.Module) -> tuple[type[nn.Module], ...]:
    """transformers' own module classes without children (GPT-2's Conv1D projections,
    Llama's RMSNorm), which fx would otherwise trace into tensor functions. Activations are
    traced all the same: GPT-2's GELU is eight tensor functions whose backward frees its
    saved tensors one by one, which one op's state cannot say (kept whole, the simulator
    put keep-everything 2.3 % over a plain step on GPT-2 small; traced, 0.77 %)."""
    found: dict[type[nn.Module], None] = {}
    for m in root.modules():
        cls = type(m)
        ours = cls.__module__.startswith("transformers.")
        activation = cls.__module__ == "transformers.activations"
        if ours and not activation and not any(True for _ in m.children()):
            found[cls] = None
    return tuple(found)
