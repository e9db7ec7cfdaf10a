"""TrainConfig: every knob of `eyas train`, frozen, validated, written into RUN/manifest.json."""

from __future__ import annotations

from dataclasses import dataclass, replace

from eyas.errors import EyasError
from eyas.knobs import from_known, to_json

DEVICE_DEFAULTS = {"cuda": {"ttt_steps": 7, "draft_vocab": 32000}, "cpu": {"ttt_steps": 3, "draft_vocab": 8192}}
"""Values of the fields a config leaves None, per device kind (the draft vocabulary is also capped at the target's).
CUDA: EAGLE-3's K and vocabulary. CPU: K=3 and an 8k vocabulary, an order of magnitude faster to train on a few cores
than K=7 with 32k."""

METHODS = ("eagle3", "dflash")
"""The drafter families `eyas train --method` trains: EAGLE-3 (model/drafter.py) and DFlash blocks (model/dflash.py)."""

CHOICES = {"method": METHODS, "labels": ("soft", "hard"), "loss_on": ("assistant", "all"),
           "attention": ("auto", "dense", "flex", "blocks"),
           "pack": ("auto", "on", "off"), "autocast": ("auto", "bf16", "off"),
           "loss": ("ce", "lk_alpha", "lk_lambda")}   # loss: train.ttt.LOSSES
"""The fields that take one of a few names, and those names (checked here; the choices of `eyas train`'s flags)."""

# Fields that may change between a run and its --resume (they do not change the loss curve).
RESUME_FREE = ("resume", "progress", "checkpoint_every", "keep_checkpoints", "target", "device", "compile",
               "eval_every", "allow_target_mismatch", "trust_remote_code", "feature_cache",
               "prefetch")

EAGLE_ONLY = {"ttt_steps": None, "draft_vocab": None, "decay": 0.8, "norm_before_fc": False, "loss": "ce",
              "init_from_target": False}
"""EAGLE-3 fields a DFlash run refuses when set (DFlash drafts the target's whole vocabulary with its own head)."""
DFLASH_ONLY = {"block_size": None, "dflash_layers": None, "mask_token_id": None, "block_gamma": None, "labels": "soft"}
"""DFlash fields an EAGLE-3 run refuses when set."""


def feature_cache_budget(setting: str) -> float | str | None:
    """TrainConfig.feature_cache as a budget: 'auto' -> 'auto', 'off' -> None, '<GB>' -> bytes; ValueError else."""
    s = str(setting).strip().lower()
    if s in ("auto", "off"):
        return None if s == "off" else "auto"
    gb = float(s)
    if not 0 < gb < float("inf"):
        raise ValueError(s)
    return gb * 1e9


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    out: str
    """Run directory RUN (manifest.json, drafter/, vocab, checkpoints/, metrics.jsonl, tb/)."""
    method: str = "eagle3"
    """Drafter family: 'eagle3' (one layer, TTT chains) or 'dflash' (a block drafter: one forward proposes
    block_size - 1 tokens; docs/dflash.md)."""
    store: str | None = None
    """Offline mode: the hidden-state store to train from."""
    data: str | None = None
    """Online mode: a prepared-data directory; the target runs inside each step (needs `target`)."""
    target: str | None = None
    """Target spec (online mode; offline: for the frozen embedding/lm_head, default = the store's target)."""
    epochs: int | None = None
    """Passes over the training split (default 1 when `steps` is not set)."""
    steps: int | None = None
    """Optimizer steps; overrides `epochs` (epochs then repeat as needed)."""
    resume: bool = False
    """Continue from the latest checkpoint in RUN/checkpoints (refuses another configuration)."""
    init: str | None = None
    """Start from the weights (and draft vocab) of a saved drafter directory instead of random init."""
    lr: float = 1e-4
    """Peak learning rate (SpecForge 1e-4; the EAGLE reference 5e-5)."""
    min_lr_ratio: float = 0.0
    """Cosine decays to lr * min_lr_ratio."""
    warmup_ratio: float = 0.02
    """Share of the total steps spent in linear warm-up."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    grad_clip: float = 0.5
    """Global gradient-norm clip (0 disables)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step on each rank."""
    batch_tokens: int = 4096
    """Token budget of one micro-batch: rows * padded length <= this (a longer sample gets a row alone)."""
    max_len: int = 2048
    """Samples are truncated to this many tokens."""
    ttt_steps: int | None = None
    """K, unrolled draft steps of training-time test (None: the device's default, DEVICE_DEFAULTS)."""
    decay: float = 0.8
    """Loss weight of step k is decay**k."""
    chunk_size: int | None = None
    """Positions per logits chunk in the TTT loss (None: whole sequence; set it on long sequences on GPU)."""
    attention: str = "auto"
    """TTT attention: 'flex' (block-sparse flex_attention, CUDA), 'blocks' (fused step 0 + diagonals, CPU), 'dense'
    (explicit mask) or 'auto' (flex on CUDA, blocks on the CPU)."""
    pack: str = "auto"
    """Pack samples into rows of max_len tokens (batch_tokens // max_len rows per micro-batch, a fixed shape):
    'on', 'off' or 'auto' (on with CUDA)."""
    compile: bool = False
    """torch.compile the drafter's decoder layer (fixed shapes with packing: one graph per TTT step)."""
    draft_vocab: int | None = None
    """Draft vocabulary size (None: the device's default, DEVICE_DEFAULTS, or the whole target vocabulary when that
    is smaller; a larger explicit value is refused)."""
    autocast: str = "auto"
    """bf16 autocast: 'auto' (on CUDA, and on CPUs with native bf16 instructions, where it is faster than fp32;
    emulated bf16 is far slower), 'bf16' (always), 'off'."""
    loss: str = "ce"
    """Per-step TTT loss: 'ce' (soft cross-entropy against the target's draft-vocab law), 'lk_alpha' (mean of -log
    alpha, alpha = sum_v min(p_v, q_v) the chance that the target accepts a token sampled from the drafter) or
    'lk_lambda' (w CE + (1 - w)(1 - mean alpha), w = exp(-lk_eta * mean alpha)): the LK losses, arXiv 2602.23881."""
    lk_eta: float = 3.0
    """lk_lambda's decay: the CE's weight is exp(-lk_eta * the step's mean alpha over the micro-batch) (the paper's
    eta; 0 gives the plain CE)."""
    loss_on: str = "assistant"
    """Positions that train the drafter: 'assistant' (the loss mask from prepare) or 'all' (every position,
    prompts included: the labels are the target's own distributions, so a prompt position is as valid an
    example of the target's next-token law as a reply position; evaluation always uses the loss mask)."""
    allow_target_mismatch: bool = False
    """Train although the store's (or the --init drafter's) recorded target differs from the loaded one; the
    warning is recorded in the run's manifest."""
    trust_remote_code: bool = False
    """Allow the target's own code (its tokenizer or config); a target that needs it is refused without."""
    init_from_target: bool = False
    """Without --init: start the drafter's norm and LM head from the target's final norm and LM-head rows."""
    intermediate_size: int | None = None
    """Drafter MLP width (default: the target's)."""
    norm_before_fc: bool = False
    """EAGLE 3.1: one RMSNorm over the concatenated aux features before fc (exported as the engines read it)."""
    block_size: int | None = None
    """DFlash: tokens per block, the last committed token and block_size - 1 mask slots (None: 16, 8 for
    DeepSeek-V3 / Kimi-class targets; model/dflash.py default_block)."""
    dflash_layers: int | None = None
    """DFlash: decoder layers (None: the target's layers / 8, 1 to 5; model/dflash.py default_layers)."""
    mask_token_id: int | None = None
    """DFlash: the mask slots' token id, inside the target's vocabulary; its embedding is the target's own row
    (None: the tokenizer's mask token, else <|MASK|>, else the vocabulary's last id)."""
    anchors: int = 512
    """DFlash: blocks per row in a training step, anchored at random positions of the replies."""
    block_gamma: float | None = None
    """DFlash: slot k's loss weight is exp(-(k-1)/block_gamma) (None: 7 for blocks of 16 and up, 4 below)."""
    labels: str = "soft"
    """DFlash: 'soft' (the target's distribution from its final state) or 'hard' (the data's tokens)."""
    device: str = "auto"
    """'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:N'. Under torchrun: cuda:LOCAL_RANK."""
    seed: int = 0
    """Seeds the drafter init and the data order."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms and fp32 math (no autocast): bitwise-repeatable runs."""
    eval_fraction: float = 0.05
    """Share of samples held out for evaluation, by a hash of the sample id (0 disables eval)."""
    eval_every: int = 0
    """Evaluate on the held-out split every N optimizer steps and after the last (0: at the end of each epoch)."""
    checkpoint_every: int = 0
    """Checkpoint every N optimizer steps (0: only at the end). A checkpoint is also written at the end."""
    keep_checkpoints: int = 2
    """How many step-N checkpoints to keep (the newest)."""
    log_every: int = 1
    """Write train metrics every N optimizer steps."""
    feature_cache: str = "auto"
    """Online: keep each sample's target states from its first forward for later epochs and evals (train/
    feature_cache.py): 'auto' (on the device up to the room left after a margin, the rest in pinned host memory up
    to the host's room), a budget in GB (10^9 bytes), or 'off' (the target runs every step)."""
    fsdp: bool = False
    """Shard the drafter with FSDP2 (torch.distributed.fsdp.fully_shard) instead of DDP."""
    progress: bool = True
    """Show a tqdm progress bar (rank 0)."""
    prefetch: bool = True
    """Make the next step's input (store read, dtype conversion, padding, pinning) in a background thread while
    this step runs; each rank prefetches its own micro-batches. Off: the step reads its input itself."""

    def __post_init__(self):
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        if (self.store is None) == (self.data is None):
            raise EyasError("train: give exactly one of --store (offline) or --data (online)")
        if self.data is not None and self.target is None:
            raise EyasError("train: online training (--data) needs --target")
        if self.epochs is not None and self.epochs < 1:
            raise EyasError(f"train: --epochs must be >= 1, got {self.epochs}")
        if self.steps is not None and self.steps < 1:
            raise EyasError(f"train: --steps must be >= 1, got {self.steps}")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise EyasError(f"train: {name} must be {', '.join(allowed[:-1])} or {allowed[-1]}, "
                                f"got {getattr(self, name)!r}")
        if not self.lr > 0:
            raise EyasError(f"train: --lr must be positive, got {self.lr}")
        if not 0.0 <= self.min_lr_ratio <= 1.0 or not 0.0 <= self.warmup_ratio < 1.0:
            raise EyasError("train: min_lr_ratio must be in [0, 1] and warmup_ratio in [0, 1)")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise EyasError(f"train: betas must be two numbers in [0, 1), got {self.betas}")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise EyasError(f"train: draft_vocab must be >= 1, got {self.draft_vocab}")
        for name in ("grad_accum", "batch_tokens", "max_len", "ttt_steps", "log_every",
                     "keep_checkpoints"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise EyasError(f"train: {name} must be >= 1, got {getattr(self, name)}")
        if self.max_len < 3:
            raise EyasError(f"train: max_len must be >= 3 (TTT predicts x[t+2]), got {self.max_len}")
        if self.checkpoint_every < 0 or self.grad_clip < 0 or self.eval_every < 0:
            raise EyasError("train: checkpoint_every, eval_every and grad_clip must be >= 0")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise EyasError(f"train: eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if not 0.0 < self.decay <= 1.0:
            raise EyasError(f"train: decay must be in (0, 1], got {self.decay}")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise EyasError(f"train: intermediate_size must be >= 1, got {self.intermediate_size}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise EyasError(f"train: chunk_size must be >= 1, got {self.chunk_size}")
        try:
            feature_cache_budget(self.feature_cache)
        except ValueError:
            raise EyasError(f"train: feature_cache must be auto, off or a size in GB (a positive number), got "
                            f"{self.feature_cache!r}") from None
        if not self.lk_eta >= 0.0:
            raise EyasError(f"train: lk_eta must be >= 0, got {self.lk_eta}")
        other = EAGLE_ONLY if self.method == "dflash" else DFLASH_ONLY
        wrong = [k for k, v in other.items() if getattr(self, k) != v]
        if wrong:
            raise EyasError(f"train: {', '.join(wrong)} {'do' if len(wrong) > 1 else 'does'} not apply to --method "
                            f"{self.method}")
        if self.block_size is not None and not 2 <= self.block_size <= 32:
            raise EyasError(f"train: block_size must be 2 to 32, got {self.block_size}")
        if self.dflash_layers is not None and self.dflash_layers < 1:
            raise EyasError(f"train: dflash_layers must be >= 1, got {self.dflash_layers}")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise EyasError(f"train: mask_token_id must be >= 0, got {self.mask_token_id}")
        if self.anchors < 1:
            raise EyasError(f"train: anchors must be >= 1, got {self.anchors}")
        if self.block_gamma is not None and not self.block_gamma > 0:
            raise EyasError(f"train: block_gamma must be > 0, got {self.block_gamma}")

    def for_device(self, device) -> tuple["TrainConfig", str | None]:
        """This config with the fields left None that have per-device defaults filled in, and a line saying what was
        chosen (None when nothing was left open)."""
        kind = "cuda" if getattr(device, "type", str(device)).startswith("cuda") else "cpu"
        if self.method == "dflash":  # no TTT steps, the whole vocabulary: the device defaults are EAGLE-3's
            return self, None
        chosen = {k: v for k, v in DEVICE_DEFAULTS[kind].items() if getattr(self, k) is None}
        if not chosen:
            return self, None
        what = ", ".join(f"{k} {v}" for k, v in chosen.items())
        return replace(self, **chosen), f"eyas train: on {kind}: {what} (defaults for {kind}; set them to change)"

    def packs(self, device) -> bool:
        """Whether micro-batches are packed rows on this device."""
        return self.pack == "on" or (self.pack == "auto" and getattr(device, "type", str(device)) == "cuda")

    @property
    def online(self) -> bool:
        return self.data is not None

    def to_dict(self) -> dict:
        return to_json(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        return from_known(cls, d, "train config")

    def identity(self) -> dict:
        """The fields a --resume must match."""
        return {k: v for k, v in self.to_dict().items() if k not in RESUME_FREE}
