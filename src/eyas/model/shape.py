"""The drafter's shape: derived from a target's config (docs/training.md, "The drafter's shape"), counted, described.

DrafterConfig.from_target (model/drafter.py) is the entry point; this module reads the target's config in its
spellings (transformers configs, VLM wrappers, attribute views or dicts of config.json; RoPE in transformers 4's
or 5's fields; RoPE through target/fingerprint.py's rope_of, the fingerprint's reading) and derives the attention
shape and RoPE of the drafter for it. No torch in this module: a shape is plain numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

from eyas.errors import EyasError
from eyas.target.fingerprint import rope_of, text_config

ROPE_TYPES = ("default", "linear", "llama3")   # the RoPE scalings the drafter implements (drafter.rope_inv_freq)
# DeepSeek-V2/V3 / Kimi-K2(.5) targets get the Llama head of the published EAGLE-3 heads for them (docs/training.md):
MLA_HEAD_DIM = 128                 # the width of the targets' value heads (v_head_dim) and of those heads
MLA_MAX_HEADS = 64                 # Kimi's 64 heads; DeepSeek-V3's 128 would double q/k/v/o and the draft KV cache
MLA_ROPE_THETA = 1_000_000.0       # plain RoPE: the published heads' theta; its longest wavelength spans 262k tokens
DEEPSEEK_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "n_routed_experts")


@dataclass(frozen=True, kw_only=True)
class DecoderShape:
    """The widths, heads and RoPE both drafters (DrafterConfig, DFlashConfig) take from their target: target_shape's
    fields, checked in __post_init__; each drafter's config adds its own fields after these."""

    what: ClassVar[str]
    """How the config's errors name it (each drafter's config sets it)."""

    hidden_size: int
    """Drafter width h: the target's hidden size."""
    target_hidden_size: int
    """Width h_t of each aux feature; fc takes len(aux_layer_ids) * h_t."""
    intermediate_size: int
    """Width of the SiLU-gated (SwiGLU) MLP."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (GQA); divides num_attention_heads."""
    head_dim: int
    """Per-head width."""
    rms_norm_eps: float
    """RMSNorm epsilon (the target's)."""
    rope_theta: float
    """RoPE base: the target's for Llama-like targets (docs/ttt.md), MLA_ROPE_THETA for DeepSeek-class ones."""
    rope_scaling: dict | None = None
    """RoPE scaling as in HF configs ({"rope_type": "linear"|"llama3", ...}) or None (plain RoPE)."""
    max_position_embeddings: int
    """Longest position the drafter is configured for (the target's)."""
    vocab_size: int
    """The target's vocabulary size V."""

    def __post_init__(self):
        self.check_positive(("hidden_size", "target_hidden_size", "intermediate_size", "num_attention_heads",
                             "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size"))
        if self.num_attention_heads % self.num_key_value_heads:
            raise EyasError(f"{self.what}: num_attention_heads {self.num_attention_heads} is not a multiple of "
                            f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise EyasError(f"{self.what}: head_dim must be even for RoPE, got {self.head_dim}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise EyasError(f"{self.what}: rope_type {rope_type!r} is not supported (supported: {ROPE_TYPES})")

    def check_positive(self, names) -> None:
        """Refuse any of the fields `names` below 1."""
        for name in names:
            if int(getattr(self, name)) <= 0:
                raise EyasError(f"{self.what}: {name} must be positive, got {getattr(self, name)}")


def text_view(config):
    """The language model's fields of a target config (target/fingerprint.py text_config: a VLM wrapper's
    text_config, else the config itself) as attributes: a dict of config.json becomes an attribute view."""
    config = text_config(config)
    return SimpleNamespace(**config) if isinstance(config, dict) else config


def target_rope(c) -> tuple[float, dict | None]:
    """(rope_theta, 10000 where the config has none; scaling with "rope_type", or None for default RoPE), read as
    the fingerprint reads it (target/fingerprint.py rope_of: either spelling; a config, an attribute view of one or
    a dict of config.json)."""
    theta, rope = rope_of(c)
    return float(theta or 10000.0), (rope if rope["rope_type"] != "default" else None)


def mla_or_moe(c) -> bool:
    """DeepSeek-V2/V3, Kimi-K2 / K2.5 and their kin, by their config fields (MLA ranks or DeepSeek MoE), not names."""
    return any(getattr(c, k, None) for k in DEEPSEEK_FIELDS)


def target_shape(hf_config, *, intermediate_size: int | None = None) -> dict:
    """DecoderShape's fields derived from a target config; the MLP width is the target's unless `intermediate_size`
    is given.

    Llama-like targets: the target's own attention shape and RoPE; a scaling the drafter does not implement
    (yarn, dynamic, ...) is dropped for plain RoPE at the target's theta. DeepSeek-V2/V3 / Kimi (MLA or DeepSeek
    MoE fields): the Llama head of the published EAGLE-3 heads for them, head_dim 128, plain RoPE at
    MLA_ROPE_THETA."""
    c = text_view(hf_config)
    theta, scaling = target_rope(c)
    if scaling is not None and scaling["rope_type"] not in ROPE_TYPES:
        scaling = None                               # plain RoPE; config.json says so (rope_scaling null)
    heads = int(c.num_attention_heads)
    kv = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    if mla_or_moe(c):
        heads, kv = min(heads, MLA_MAX_HEADS), min(kv, heads, MLA_MAX_HEADS)
        kv = kv if heads % kv == 0 else heads
        head_dim, theta, scaling = MLA_HEAD_DIM, MLA_ROPE_THETA, None
    return dict(hidden_size=c.hidden_size, target_hidden_size=c.hidden_size,
                intermediate_size=intermediate_size or c.intermediate_size, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                rms_norm_eps=float(c.rms_norm_eps), rope_theta=theta, rope_scaling=scaling,
                max_position_embeddings=c.max_position_embeddings, vocab_size=c.vocab_size)


def param_count(cfg) -> int:
    """Trainable parameters of Eagle3Drafter(cfg) for a DrafterConfig: fc, q/k/v/o, MLP, four RMSNorms, lm_head
    (and input_norm with norm_before_fc)."""
    h, a, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return (3 * cfg.target_hidden_size * h + 2 * h * (a + 2 * kv) + a * h + 3 * h * cfg.intermediate_size
            + 4 * h + cfg.draft_vocab_size * h + (3 * cfg.target_hidden_size if cfg.norm_before_fc else 0))


def summary(cfg) -> str:
    """One line of a DrafterConfig: sizes, vocabulary, RoPE and parameter count (what `eyas train` announces)."""
    s = cfg.rope_scaling
    rope = f"{s['rope_type']} x{float(s.get('factor', 1)):g}" if s else "no scaling"
    theta = f"{cfg.rope_theta:.0f}" if float(cfg.rope_theta).is_integer() else f"{cfg.rope_theta:g}"
    fc = "" if cfg.target_hidden_size == cfg.hidden_size else f" (fc from 3 x {cfg.target_hidden_size})"
    return (f"h {cfg.hidden_size}{fc}, {cfg.num_attention_heads} x {cfg.head_dim} heads "
            f"({cfg.num_key_value_heads} kv), mlp {cfg.intermediate_size}, vocab {cfg.vocab_size} -> "
            f"{cfg.draft_vocab_size}, rope theta {theta} ({rope}), {count_text(param_count(cfg))} params")


def count_text(n: int) -> str:
    """A parameter count as a summary line shows it: 1.23B, 4.5M or 6.7K."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"
