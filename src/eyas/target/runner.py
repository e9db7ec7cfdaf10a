"""A fast static-cache Llama forward (gpt-fast style) with weights taken from an HF LlamaForCausalLM.

Used by plain decoding (`generate`, also the prepare stage's regeneration), by speculative
verification (arbitrary attention masks over cache slots, for trees) and by capture of aux
hidden states (HF `hidden_states` convention: index i = residual stream entering layer i,
index N = output of the final norm; ../shared/EAGLE3.md section 1).

Cache layout: per layer k/v of shape [max_batch, kv_heads, max_seq, head_dim]. A forward writes
the new keys/values at `cache_slots` and each query attends to the first L cache slots where
`attn_mask[b, s, j]` is True (L = attn_mask.shape[-1] <= max_seq). Positions (RoPE) and slots are
independent: a tree node sits at position prefix+depth but in slot prefix+index. A one-token step whose rows
each attend a prefix of their cache (plain decoding) can pass the prefix lengths instead of a mask: flex
attention then reads only the key/value blocks each row's length reaches (`lengths_attention`).

On CUDA the single-token decode step runs as a CUDA graph (optionally of a torch.compile'd
forward); on the CPU everything runs eagerly.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from eyas.errors import EyasError
from eyas.sdpa import INFERENCE_SDPA
from eyas.target.compile import CompilePolicy, check_attention, compile_step, has_regions, raise_recompile_limit
from eyas.target.generate import generate
from eyas.target.graphs import capture
from eyas.target.hf_runner import HFRunner, HFRunnerConfig
from eyas.target.persist import Unpickled
from eyas.target.slots import SlotRunner


@dataclass(frozen=True, kw_only=True)
class RunnerConfig(HFRunnerConfig):
    """Shapes of the target, read from the HF config: HFRunnerConfig's and the attention's."""

    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA)."""
    head_dim: int
    """Per-head width."""
    rms_norm_eps: float
    """RMSNorm epsilon."""

    def __post_init__(self):
        super().__post_init__()
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads are not a multiple of {self.num_kv_heads} kv heads")


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF LlamaRMSNorm: normalise in fp32, cast back, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Non-interleaved RoPE (HF rotate_half). x (B,H,S,D), cos/sin (B,1,S,D)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (B,H,S,D)
    return x * cos + rot * sin


def rowwise_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x @ weight.T (no bias) as an fp32 multiply + sum over the input features, which inductor compiles to one
    reduction kernel over all outputs. cuBLAS runs an M = 1 GEMM latency-bound on a few dozen thread blocks
    (BENCHMARKS.md#kernels-per-decode-step-and-round-kernelspy---compile-6c4c7d7-gemv-on)."""
    return (x.float()[..., None, :] * weight.float()).sum(-1).to(x.dtype)


def matmul_attention(q: Tensor, kc: Tensor, vc: Tensor, bias: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(D) + bias) v over cache slots 0..L-1, L = bias.shape[-1]: q (B,KV,R,D), kc/vc
    (B,KV,M,D) with M >= L, bias (B,1,R,L) additive. The scale goes on the few queries, not the many scores (exact
    for a power-of-4 head dim), the bias is added in place and softmax reads the scores in their dtype, computing
    in fp32 (its accumulate type) and rounding once: fewer passes over the scores than scale, add, upcast, softmax,
    downcast, and the same values up to the softmax kernel's summation order (tests/test_runner.py)."""
    L, D = bias.shape[-1], q.shape[-1]
    qs = q * D ** -0.5
    if kc.dtype == torch.bfloat16 and q.device.type == "cpu":
        # CPU bf16 matmul copies a key slice [:L] first (slower than the product over every slot; docs/LOG.md):
        # score all slots, then keep the first L.
        att = torch.matmul(qs, kc.transpose(-1, -2))[..., :L]  # (B,KV,R,L)
    else:
        att = torch.matmul(qs, kc[:, :, :L].transpose(-1, -2))  # (B,KV,R,L)
    return torch.matmul(torch.softmax(att.add_(bias), dim=-1), vc[:, :, :L])


LENGTHS_BLOCK = 128
"""Cache slots per key/value block of `lengths_block_mask` (flex attention's default sparse block)."""


def lengths_block_mask(lengths: Tensor, queries: int, slots: int) -> BlockMask:
    """The flex BlockMask under which each of `queries` query rows of batch row b sees cache slots [0, lengths[b])
    of `slots`: the blocks wholly inside the length need no mask, the one it ends in is cut by `kv < length`, the
    rest are not listed (never read). Built from the lengths alone: no host sync, so it records into a CUDA graph."""
    B, n = lengths.shape[0], -(-slots // LENGTHS_BLOCK)
    full = (lengths // LENGTHS_BLOCK).to(torch.int32).view(B, 1, 1)
    part = (lengths % LENGTHS_BLOCK != 0).to(torch.int32).view(B, 1, 1)
    order = torch.arange(n, dtype=torch.int32, device=lengths.device).expand(B, 1, 1, n)
    # the cut block is the one after the full ones; indices past a row's count are never read
    cut = (order + full[..., None]).clamp_(max=n - 1)

    def inside(b, h, q, kv):
        return kv < lengths[b]

    return BlockMask.from_kv_blocks(part, cut, full, order.contiguous(), BLOCK_SIZE=LENGTHS_BLOCK, mask_mod=inside,
                                    seq_lengths=(queries, slots), compute_q_blocks=False)


@functools.cache
def _compiled_flex():
    # one compile for the first batch size, one shape-generic one after it (compaction halves the batch)
    raise_recompile_limit()
    return torch.compile(flex_attention, dynamic=None)


def lengths_attention(q: Tensor, kc: Tensor, vc: Tensor, block_mask: BlockMask) -> Tensor:
    """softmax(q k^T / sqrt(D)) v with q (B,KV,R,D) over the cache kc/vc (B,KV,M,D) under a `lengths_block_mask`:
    compiled on CUDA (flex's decoding kernel splits each row's blocks across thread blocks and reads nothing past
    its length), eager elsewhere (it materialises the scores: for tests)."""
    fn = _compiled_flex() if q.is_cuda else flex_attention
    return fn(q, kc, vc, block_mask=block_mask)


class Layer(nn.Module):
    def __init__(self, cfg: RunnerConfig, dtype, device):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
        self.wqkv = nn.Linear(h, qkv, bias=False, dtype=dtype, device=device)
        self.wo = nn.Linear(cfg.num_heads * hd, h, bias=False, dtype=dtype, device=device)
        self.w13 = None  # set by from_hf: fused gate/up
        self.w2 = None
        self.attn_norm = nn.Parameter(torch.ones(h, dtype=dtype, device=device))
        self.mlp_norm = nn.Parameter(torch.ones(h, dtype=dtype, device=device))
        shape = (cfg.max_batch, cfg.num_kv_heads, cfg.max_seq, hd)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.cfg = cfg
        self.flex = False  # from_hf(attention="flex"): attend with flex_attention (one fused kernel when compiled)
        self.gemv = 0  # from_hf(gemv=R): projections of steps of <= R rows as multiply + sum (inductor reductions)
        self.fused = False  # from_hf(fuse=True): the pieces around attention compiled (_fused_pieces)

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """x @ weight.T; inside a compiled step of at most `gemv` rows (batch x tokens: 1 for a batch-1 decode step,
        K+1 for a chain verify), `rowwise_linear` instead. Eager calls (prefill chunks run eagerly) keep F.linear:
        there the product would be materialised, rows x out x in in fp32."""
        if x.shape[:-1].numel() > self.gemv or not torch.compiler.is_compiling():
            return F.linear(x, weight)
        return rowwise_linear(x, weight)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, bias: Tensor) -> Tensor:
        """bias: additive attention mask (B,1,rep*S,L) over cache slots 0..L-1, shared by all layers; with flex
        attention the bool mask (B,S,L) itself; for a step by lengths, their BlockMask."""
        cfg = self.cfg
        B, S, _ = x.shape
        H, KV, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # the layer's pieces around its attention: compiled once for all layers with `fused`, else plain functions
        # (traced into the step when the whole step is compiled)
        if self.fused:
            (attn_in, attn_out), kw = _fused_pieces(), {}
        else:
            attn_in, attn_out, kw = _attn_in, _attn_out, {"linear": self.linear}
        q, k, v = attn_in(x, self.attn_norm, self.wqkv.weight, cos, sin, cfg.rms_norm_eps, H, KV, **kw)
        rows = torch.arange(B, device=x.device)[:, None].expand(B, S)  # (B,S)
        kc, vc = self.k_cache[:B], self.v_cache[:B]
        kc[rows, :, slots] = k.transpose(1, 2)  # cache[b, :, slot[b,s]] = k[b, :, s]
        vc[rows, :, slots] = v.transpose(1, 2)
        # GQA without repeating k/v: each kv head answers its `rep` query heads as rep*S queries.
        qg = q.reshape(B, KV, -1, D)  # (B,KV,rep*S,D)
        L = None if isinstance(bias, BlockMask) else bias.shape[-1]
        if L is None:  # a one-token step by lengths (Runner.forward built their mask)
            o = lengths_attention(qg, kc, vc, bias)  # (B,KV,rep,D)
        elif self.flex:  # `bias` is the bool mask (B,S,L) here: a graph input, which compiled flex can read
            # The grouped layout, as below: query row r*S+s is position s. (Compiled flex with enable_gqa broke
            # speculative equality, S > 1, with torch 2.11 on CUDA: docs/LOG.md.)
            o = flex_attention(qg, kc[:, :, :L], vc[:, :, :L],
                               score_mod=lambda score, b, h, qi, kv: torch.where(bias[b, qi % S, kv], score,
                                                                                 -torch.inf))
        elif qg.shape[2] <= 256:
            # Few queries (decode, verify), at any batch: plain matmuls parallelise over the keys; the fused SDPA
            # kernels give each (head, query block) one thread block and crawl through long caches.
            o = matmul_attention(qg, kc, vc, bias)  # (B,KV,rep*S,D)
        else:
            with sdpa_kernel(INFERENCE_SDPA):  # no cuDNN: a new plan per prompt length
                o = F.scaled_dot_product_attention(qg, kc[:, :, :L], vc[:, :, :L], attn_mask=bias)  # (B,KV,rep*S,D)
        o = o.reshape(B, H, S, D).transpose(1, 2).reshape(B, S, H * D)  # (B,S,H*D)
        return attn_out(x, o, self.wo.weight, self.mlp_norm, self.w13.weight, self.w2.weight, cfg.rms_norm_eps, **kw)


def _attn_in(x: Tensor, norm: Tensor, wqkv: Tensor, cos: Tensor, sin: Tensor, eps: float, heads: int, kv_heads: int,
             linear=F.linear) -> tuple[Tensor, Tensor, Tensor]:
    """A layer's input norm, its fused q/k/v projection and RoPE: q (B,H,S,D), k and v (B,KV,S,D)."""
    B, S, _ = x.shape
    D = cos.shape[-1]
    q, k, v = linear(rms_norm(x, norm, eps), wqkv).split([heads * D, kv_heads * D, kv_heads * D], dim=-1)
    q = q.view(B, S, heads, D).transpose(1, 2)  # (B,H,S,D)
    k = k.view(B, S, kv_heads, D).transpose(1, 2)  # (B,KV,S,D)
    v = v.view(B, S, kv_heads, D).transpose(1, 2)  # (B,KV,S,D)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def _attn_out(x: Tensor, o: Tensor, wo: Tensor, norm: Tensor, w13: Tensor, w2: Tensor, eps: float,
              linear=F.linear) -> Tensor:
    """The attention output's projection and residual, then the MLP block: the layer's output (B,S,h)."""
    x = x + linear(o, wo)
    gate, up = linear(rms_norm(x, norm, eps), w13).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, w2)


@functools.cache
def _fused_pieces():
    """_attn_in and _attn_out compiled (from_hf(fuse=True)): their weights are inputs, so one compile serves every
    layer of every runner; shapes go dynamic at the second batch or token count (compaction, prefill chunks). The
    attention and the cache writes between them stay outside (a step with flex inside its compiled graph decoded
    wrong tokens: Runner.graphed)."""
    raise_recompile_limit()
    # eps as a constant (dynamic shapes would make it a symbolic float input)
    pin = torch._dynamo.config.patch(specialize_float=True)
    return pin(torch.compile(_attn_in, dynamic=None)), pin(torch.compile(_attn_out, dynamic=None))


def runner_config(hf, max_batch: int, max_seq: int) -> RunnerConfig:
    """The runner's shapes from an HF Llama-family config, for a cache of max_batch rows of max_seq slots."""
    heads = hf.num_attention_heads
    return RunnerConfig(
        num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, num_heads=heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        vocab_size=hf.vocab_size, rms_norm_eps=hf.rms_norm_eps, max_batch=max_batch, max_seq=max_seq)


def llama_family(hf) -> bool:
    """Whether `Runner` copies this target's weights into its own forward: bias-free SiLU Llama-family configs.
    Others decode through `HFRunner` (target/hf_runner.py), their own HF forward."""
    return (getattr(hf, "model_type", "llama") in ("llama", "mistral", "qwen2") and not getattr(hf, "attention_bias", False)
            and not getattr(hf, "mlp_bias", False) and getattr(hf, "hidden_act", "silu") == "silu")


def _layer_body(layer: Layer, x: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, bias: Tensor) -> Tensor:
    return layer(x, cos, sin, slots, bias)


def _decode_step(runner, input_ids, positions, cache_slots, attn_mask):
    """One decode step's logits, as a function of the runner (Runner._decode; what `persist` saves, with the runner an
    argument, not a constant)."""
    # Every keyword passed: a default read from forward's __kwdefaults__ becomes a dynamo guard (DefaultsSource) that
    # torch 2.11 pickles but cannot load (fixed in 2.12), so `persist` could not reload the step there.
    return runner.forward(input_ids, positions, cache_slots, attn_mask, capture=(), logits=True, last_only=False)[0]


def _verify_step(runner, ids, pos, slots, mask, capture):
    """Runner.step_fn's step as a function of the runner and the captured ids (see _decode_step)."""
    logits, cap = runner.forward(ids, pos, slots, mask, capture=capture, logits=True, last_only=False)
    return logits, (torch.cat([cap[i] for i in capture], -1) if capture else logits[..., :0])


# compile regions: dynamo traces the whole step, but inductor compiles this body once and calls it for every
# layer (their weights and caches are its inputs), instead of compiling N copies of it. None where torch lacks it.
_layer_region = torch.compiler.nested_compile_region(_layer_body) if has_regions() else None


class Runner(SlotRunner):
    """Static-cache Llama forward. Build with `Runner.from_hf(model, max_batch=, max_seq=)`."""

    attends_by_lengths = True
    """Its forward can take each row's prefix length in place of a mask (target/generate.py asks; HFRunner cannot)."""

    def __init__(self, cfg: RunnerConfig, *, dtype=torch.float32, device="cpu"):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(Layer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size, dtype=dtype, device=device))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        self.register_buffer("cos", torch.zeros(cfg.max_seq, cfg.head_dim, dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", torch.zeros(cfg.max_seq, cfg.head_dim, dtype=dtype, device=device), persistent=False)
        # (batch, seq, fn, slots) -> the callable `graphed` built for it; on the runner, not in a module-level weak
        # map: its values hold the runner, which would then never be freed
        self._graphs: dict = Unpickled()
        self._compiled = None
        self._step_fns: dict = {}
        self._call_layer = _layer_body
        self.policy = CompilePolicy()  # from_hf's compile settings (target/compile.py); eager by default

    # ------------------------------------------------------------------ construction
    @classmethod
    @torch.no_grad()
    def from_hf(cls, model, *, max_batch: int = 1, max_seq: int = 2048, dtype=None, device=None,
                compile: bool = False, dynamic: bool = False, regions: bool = False,
                compile_options: dict | None = None, attention: str = "matmul", gemv: int | None = None,
                persist: str | os.PathLike | None = None, fuse: bool = False) -> "Runner":
        """Copy the weights of an HF LlamaForCausalLM into a Runner with a static KV cache of max_batch rows of
        max_seq slots. A target that is not Llama-family (`llama_family`) gets the generic `HFRunner` instead (its
        own HF forward, eager; the compile options do not apply), with a note on stderr.

        compile, dynamic, regions, compile_options (inductor `options`), attention ("matmul" or "flex"), gemv (None:
        the default for the device), persist (a directory of saved compiled steps) and fuse (each layer's pieces
        around its attention compiled, the step eager) are the fields of `CompilePolicy` (target/compile.py), which
        documents and checks them."""
        check_attention(attention)
        if not llama_family(model.config):
            print(f"eyas: note: runner: {model.config.model_type} is not a bias-free SiLU Llama; decoding through its "
                  f"own HF forward (target/hf_runner.py: generic, eager, slow{'; compile ignored' if compile else ''})",
                  file=sys.stderr)
            return HFRunner.from_hf(model, max_batch=max_batch, max_seq=max_seq, dtype=dtype, device=device)
        device = torch.device(device) if device is not None else next(model.parameters()).device
        policy = CompilePolicy.resolve(compile=compile, dynamic=dynamic, regions=regions,
                                       compile_options=compile_options, attention=attention, gemv=gemv,
                                       persist=persist, fuse=fuse, device=device)
        r = cls(runner_config(model.config, max_batch, max_seq), dtype=dtype or next(model.parameters()).dtype,
                device=device)
        r.copy_hf_weights(model)
        r.eval().requires_grad_(False)
        r.policy = policy
        for layer in r.layers:
            layer.flex = policy.attention == "flex"
            layer.gemv = policy.gemv
            layer.fused = policy.fuse
        if policy.compile:
            if policy.regions:
                r._call_layer = _layer_region
            r._compiled = r._compile(r._decode, dynamic=policy.dynamic, free=_decode_step)
        return r

    @torch.no_grad()
    def copy_hf_weights(self, model) -> None:
        """Copy an HF Llama-family model's weights into this runner, and its RoPE table (HF's own rotary module,
        so rope_scaling variants are covered, computed in fp32) for this runner's max_seq positions."""
        base, dtype, device = model.model, self.dtype, self.device
        self.embed.weight.copy_(base.embed_tokens.weight)
        self.lm_head.weight.copy_(model.lm_head.weight)
        self.norm.copy_(base.norm.weight)
        for mine, theirs in zip(self.layers, base.layers):
            a, m = theirs.self_attn, theirs.mlp
            mine.wqkv.weight.copy_(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
            mine.wo.weight.copy_(a.o_proj.weight)
            mine.w13 = nn.Linear(self.cfg.hidden_size, 2 * m.gate_proj.out_features, bias=False, dtype=dtype,
                                 device=device)
            mine.w13.weight.copy_(torch.cat([m.gate_proj.weight, m.up_proj.weight]))
            mine.w2 = nn.Linear(m.down_proj.in_features, self.cfg.hidden_size, bias=False, dtype=dtype, device=device)
            mine.w2.weight.copy_(m.down_proj.weight)
            mine.attn_norm.copy_(theirs.input_layernorm.weight)
            mine.mlp_norm.copy_(theirs.post_attention_layernorm.weight)
        pos = torch.arange(self.cfg.max_seq, device=device)[None]
        probe = torch.zeros(1, dtype=torch.float32, device=device)
        cos, sin = base.rotary_emb.to(device)(probe, pos)
        self.cos.copy_(cos[0])
        self.sin.copy_(sin[0])

    def _compile(self, fn, dynamic, free=None, extra=()):
        """`compile_step` under this runner's policy; a persisted step's files are named also by this runner's
        shapes, dtype and layer settings."""
        first = self.layers[0]
        config = repr((self.cfg, str(self.dtype), first.gemv, first.flex, self._call_layer is _layer_region))
        return compile_step(self.policy, fn, dynamic=dynamic, owner=self, free=free, extra=extra, config=config)

    @property
    def compiled(self) -> bool:
        """Whether the decode steps are torch.compile'd (from_hf(compile=True))."""
        return self._compiled is not None

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, input_ids: Tensor, positions: Tensor, cache_slots: Tensor, attn_mask: Tensor, *,
                capture: tuple[int, ...] = (), logits: bool = True, last_only: bool = False
                ) -> tuple[Tensor, dict[int, Tensor]]:
        """input_ids/positions/cache_slots (B,S) long, attn_mask bool (B,S,L) over cache slots 0..L-1; or, for a
        one-token step (S = 1), attn_mask long (B,): row b attends cache slots [0, attn_mask[b]) of all max_seq.

        Returns (logits (B,S,V), or the final-norm hidden (B,S,h) with logits=False; with last_only only
        position S-1) and {aux id: hidden (B,S,h)} for each id in `capture` (HF hidden_states indices).
        """
        B, S = input_ids.shape
        cfg = self.cfg
        by_lengths = attn_mask.dtype == torch.long
        if by_lengths and (S != 1 or attn_mask.shape != (B,)):
            raise EyasError(f"runner: attention by lengths takes one token per row and (B,) lengths, got "
                            f"{S} tokens and lengths {tuple(attn_mask.shape)}")
        L = cfg.max_seq if by_lengths else attn_mask.shape[-1]
        if B > cfg.max_batch or L > cfg.max_seq:
            raise EyasError(f"runner: batch {B} x {L} slots exceeds the cache ({cfg.max_batch} x {cfg.max_seq})")
        cos = self.cos[positions][:, None]  # (B,1,S,D)
        sin = self.sin[positions][:, None]  # (B,1,S,D)
        x = self.embed(input_ids)  # (B,S,h)
        # One additive mask for all layers, laid out for the grouped-query trick in Layer.forward.
        rep = cfg.num_heads // cfg.num_kv_heads
        if by_lengths:
            bias = lengths_block_mask(attn_mask, rep, L)
        elif self.layers[0].flex:
            bias = attn_mask
        else:
            bias = torch.zeros(attn_mask.shape, dtype=x.dtype, device=x.device).masked_fill_(~attn_mask, float("-inf"))
            bias = bias[:, None, None].expand(B, 1, rep, S, L).reshape(B, 1, rep * S, L)  # (B,1,rep*S,L)
        captured = {}
        for i, layer in enumerate(self.layers):
            if i in capture:
                captured[i] = x
            x = self._call_layer(layer, x, cos, sin, cache_slots, bias)
        x = rms_norm(x, self.norm, cfg.rms_norm_eps)
        if cfg.num_layers in capture:
            captured[cfg.num_layers] = x
        if last_only:
            # contiguous: on a strided (B,1,h) view of B > 1 rows, F.linear broadcasts the head's weight into a
            # (B, h, V) copy for a batched product (seconds per prefill on the CPU); (B,1,h) folds to one product
            x = x[:, -1:].contiguous()  # (B,1,h)
        return (self.lm_head(x) if logits else x), captured

    def _decode(self, input_ids, positions, cache_slots, attn_mask):
        return _decode_step(self, input_ids, positions, cache_slots, attn_mask)

    def step_fn(self, capture: tuple[int, ...] = ()):
        """(ids, pos, slots, mask) -> (logits (B,S,V), aux (B,S,len(capture)*h)): one verify/decode step that
        also returns the concatenated hidden states `capture`; torch.compile'd when the runner is. Cached per
        capture tuple, so every decoder on this runner shares one compiled function (and its CUDA graphs)."""
        capture = tuple(capture)
        if capture not in self._step_fns:
            def step(ids, pos, slots, mask):
                return _verify_step(self, ids, pos, slots, mask, capture)
            # dynamic=None: the draft length S varies (prompt lookup, trees), so after the first shape
            # change dynamo compiles one S-generic version instead of one per S.
            self._step_fns[capture] = (self._compile(step, dynamic=None, free=_verify_step, extra=(capture,))
                                       if self._compiled is not None else step)
        return self._step_fns[capture]

    # ------------------------------------------------------------------ graphed step
    def graphed(self, batch: int, seq: int, fn=None, slots: int | None = None, lengths: bool = False):
        """A callable with static inputs running `fn` (default: forward logits) for (batch, seq) tokens
        attending over the first `slots` cache slots (default all max_seq), or with `lengths` (seq 1) taking
        (B,) prefix lengths for the mask (Runner.forward); CUDA graph on CUDA, plain call elsewhere."""
        if lengths and (seq != 1 or slots not in (None, self.cfg.max_seq)):
            raise EyasError(f"runner: a step by lengths is one token over all cache slots, got {seq} tokens, "
                            f"{slots} slots")
        if lengths and fn is None and self._compiled is not None:
            raise EyasError("runner: steps by lengths run eager (CUDA graphs around compiled flex); inside a compiled "
                            "step they decoded wrong tokens on CUDA: decode a compiled runner with lengths=False")
        L = slots or self.cfg.max_seq
        key = (batch, seq, fn, L, lengths)
        if key in self._graphs:
            return self._graphs[key]
        fn = fn or (self._compiled or self._decode)
        dev = self.device
        if dev.type != "cuda":
            g = lambda ids, pos, slots, mask: fn(ids, pos, slots, mask)  # noqa: E731
            self._graphs[key] = g
            return g
        ids = torch.zeros(batch, seq, dtype=torch.long, device=dev)
        pos = torch.zeros(batch, seq, dtype=torch.long, device=dev)
        slots = torch.full((batch, seq), L - 1, dtype=torch.long, device=dev)
        if lengths:
            mask = torch.full((batch,), L, dtype=torch.long, device=dev)
        else:
            mask = torch.zeros(batch, seq, L, dtype=torch.bool, device=dev)
            mask[..., -1] = True
        replay = capture(fn, ids, pos, slots, mask, warmup=3)

        def run(i, p, s, m):
            ids.copy_(i)
            pos.copy_(p)
            slots.copy_(s)
            mask.copy_(m)
            return replay()

        self._graphs[key] = run
        return run

    # ------------------------------------------------------------------ plain decoding
    def generate(self, prompts: list[list[int]], max_new_tokens: int, **kw) -> list[list[int]]:
        """Plain batched decoding on this runner: `eyas.target.generate.generate` (its docstring has the options)."""
        return generate(self, prompts, max_new_tokens, **kw)
