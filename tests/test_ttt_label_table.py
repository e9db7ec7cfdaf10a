"""The cpu-demo's training path skips multiplies it does not need, and its loss stays the naive reference's.

TTT step k at position t takes its soft labels from the target at position t+k+1, so across the K steps the same
positions are labelled K times. ttt_forward computes each needed position's target logits once (the full-vocab
product that also gives the argmax) and every step reads its rows from that table; past LABEL_TABLE_BYTES it
falls back to one draft-vocab product per step. Both must equal the step-by-step reference of test_ttt.py. The
trainer keeps each sample's full-vocab argmax after its first epoch, so later epochs multiply only the draft
vocabulary's rows; capture runs maskless causal attention over its right-padded batches. On the CPU the TTT attention
runs by blocks (eyas.model.blocks: step 0's keys through the fused kernel, the later steps' diagonal keys beside
it), equal to SDPA under the dense mask and to the step-by-step reference. Regeneration's prefill hands the head a
contiguous last row (no broadcast copy of its weight).
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import eyas.train.ttt as ttt
from eyas.train.ttt import TTTConfig, ttt_forward
from test_ttt import assert_fast_equals_naive, make_case, run_fast, run_naive, ttt_inputs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("budget", ["table", "per_step"])
@pytest.mark.parametrize("K", [1, 3])
def test_both_label_paths_equal_naive_reference(monkeypatch, budget, K):
    monkeypatch.setattr(ttt, "LABEL_TABLE_BYTES", 1 << 30 if budget == "table" else 0)
    assert_fast_equals_naive(*make_case(seed=10 + K, B=3, T=11), K)


@pytest.mark.parametrize("budget", ["table", "per_step"])
def test_given_target_ids_equal_computing_them(monkeypatch, budget):
    """A second pass that is handed the first pass's target_ids (what the trainer keeps between epochs) gives the
    same loss, counts and gradients, with either label path."""
    monkeypatch.setattr(ttt, "LABEL_TABLE_BYTES", 1 << 30 if budget == "table" else 0)
    K = 3
    d, c = make_case(seed=4, B=3, T=11, V=64, Vd=40)
    ref, grads = run_fast(d, c, K)
    d.zero_grad()
    out = ttt_forward(d, **ttt_inputs(c), cfg=TTTConfig(num_steps=K), target_ids=ref.target_ids.to(torch.int32))
    out.loss.backward()
    assert torch.equal(out.loss, ref.loss) and torch.equal(out.target_ids, ref.target_ids)
    for key in ("count_k", "correct_k", "cond_count_k", "cond_correct_k", "accept_len"):
        assert torch.equal(getattr(out, key), getattr(ref, key)), key
    for name, g in grads.items():
        assert torch.equal(d.get_parameter(name).grad, g), name


def _flops(d, c, K, budget, monkeypatch, **kw) -> tuple[int, list[int]]:
    monkeypatch.setattr(ttt, "LABEL_TABLE_BYTES", budget)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        out = ttt_forward(d, **ttt_inputs(c), cfg=TTTConfig(num_steps=K), **kw)
    return fc.get_total_flops(), out


@pytest.mark.parametrize("bounded", [False, True])
def test_labels_cost_no_product_per_step(monkeypatch, bounded):
    """With the table, the forward does exactly 2 * rows_k * V_draft * h_t fewer FLOPs per step k than the per-step
    path: the steps' draft-vocab label products are gone; what is left of the target's head is the one full-vocab
    product per needed position that the argmax needs anyway."""
    K = 3
    d, c = make_case(seed=3, B=3, T=11, V=64, Vd=40)
    h_t, Vd = c["final"].shape[-1], d.config.draft_vocab_size
    kw = {"max_counted": int(c["valid"].sum())} if bounded else {}
    per_step, ref = _flops(d, c, K, 0, monkeypatch, **kw)
    once, out = _flops(d, c, K, 1 << 30, monkeypatch, **kw)
    rows = [kw["max_counted"]] * K if bounded else out.count_k.tolist()   # rows per step's soft CE
    assert per_step - once == sum(2 * n * Vd * h_t for n in rows)
    for key in ("count_k", "correct_k", "cond_count_k", "cond_correct_k", "accept_len"):
        assert torch.equal(getattr(out, key), getattr(ref, key)), key
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)


def test_bf16_autocast_table_equals_per_step_labels(monkeypatch):
    """Under the CPU's bf16 autocast (the cpu-demo's training) the draft columns of the full-vocab product are the
    same numbers as the draft-vocab product per step: equal losses and gradients."""
    K = 3
    d, c = make_case(seed=7, B=3, T=11, V=64, Vd=40)
    res = {}
    for budget in (0, 1 << 30):
        monkeypatch.setattr(ttt, "LABEL_TABLE_BYTES", budget)
        d.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ttt_forward(d, **ttt_inputs(c), cfg=TTTConfig(num_steps=K))
        out.loss.backward()
        res[budget] = out.loss.detach(), {n: p.grad.clone() for n, p in d.named_parameters()}
    (l0, g0), (l1, g1) = res[0], res[1 << 30]
    assert torch.equal(l0, l1)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


def test_first_argmax_keeps_argmax_ties_and_nan():
    """The counted-position mask depends on which id wins a tie in the bf16 target logits (bf16 logits tie
    often): first_argmax must pick argmax's index, the first maximum, NaN included."""
    g = torch.Generator().manual_seed(0)
    z = torch.randint(-2, 3, (64, 4099), generator=g).bfloat16()           # many ties per row
    z[5, 9] = z[6, 4000] = z[6, 17] = float("nan")
    assert torch.equal(ttt.first_argmax(z), z.argmax(-1))
    assert ttt.first_argmax(z)[6] == 17
    w = torch.randn(64, 4099, generator=g)
    assert torch.equal(ttt.first_argmax(w), w.argmax(-1))


def test_capture_runs_causal_attention_without_a_mask_and_stores_the_unpadded_states(tmp_path, monkeypatch):
    """Capture's batches are right-padded, so no attention mask is needed: every SDPA call is the causal kernel
    (attn_mask None, is_causal), and each sample's stored states are its states computed alone, unpadded."""
    from support.models import make_tiny_llama
    from eyas.capture import CaptureConfig, run_capture
    from eyas.store import Store
    from eyas.target import target_from_model
    from eyas.target.hooks import capture_states

    model = make_tiny_llama(layers=3)
    model.config._attn_implementation = "sdpa"
    target = target_from_model(model)
    g = torch.Generator().manual_seed(1)
    samples = [(f"s{k}", torch.randint(3, 256, (n,), generator=g).tolist(), [0] * (n // 2) + [1] * (n - n // 2))
               for k, n in enumerate((31, 7, 19, 30, 4, 12))]
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *a, **kw):
        calls.append((attn_mask is None, kw.get("is_causal", False), q.shape[-2]))
        return sdpa(q, k, v, attn_mask, *a, **kw)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    run_capture(CaptureConfig(out=str(tmp_path / "s"), progress=False, batch_tokens=128), target, samples=samples)
    monkeypatch.undo()
    assert calls and all(none and causal for none, causal, _ in calls), calls
    store = Store(tmp_path / "s", target=target, dtype=torch.float32)
    for sid, tok, _ in samples:
        s = store.by_id(sid)
        alone = capture_states(model, target.aux_layer_ids, torch.tensor([tok]))[0].bfloat16().float()  # (T, 4, h)
        assert torch.equal(torch.cat([s.aux, s.final[:, None]], 1), alone), sid


def test_later_epochs_reuse_the_target_argmax_and_train_the_same_drafter(tmp_path, monkeypatch):
    """Offline and unpacked (the cpu-demo), the trainer keeps each training sample's full-vocab target argmax from
    its first pass: after epoch 0 the training steps multiply only the draft vocabulary's rows of the target's head,
    and every train and eval record and the final drafter equal a run that recomputes the argmax every step."""
    from test_train import capture, cfg, drafter_state, make_samples, records, tiny_target
    from eyas.train.trainer import Trainer

    t = tiny_target()
    store = capture(tmp_path, t, make_samples(40))
    kw = dict(steps=None, epochs=3, checkpoint_every=0, eval_fraction=0.2, device="cpu")
    V, calls, real = t.vocab_size, [], ttt.target_logits_from_final

    def spy(final, w, token_ids=None):
        calls.append((trainer.epoch, trainer.module.training, w.shape[0] if token_ids is None else len(token_ids)))
        return real(final, w, token_ids)
    monkeypatch.setattr(ttt, "target_logits_from_final", spy)
    trainer = Trainer(cfg(tmp_path, store, "kept", **kw), target=t)
    trainer.train()
    kept = [(e, rows) for e, training, rows in calls if training]
    assert {rows for e, rows in kept if e == 0} == {V}
    assert {rows for e, rows in kept if e > 0} == {64}                        # draft vocabulary only
    assert len(trainer.target_ids) == len(trainer.train_idx)

    trainer = Trainer(cfg(tmp_path, store, "recomputed", **kw), target=t)
    trainer.target_ids = None                                                 # recompute every step
    trainer.train()
    assert records(tmp_path / "kept") == records(tmp_path / "recomputed")
    assert records(tmp_path / "kept", "eval") == records(tmp_path / "recomputed", "eval")
    a, b = drafter_state(tmp_path / "kept"), drafter_state(tmp_path / "recomputed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _Largest(torch.utils._python_dispatch.TorchDispatchMode):
    """The most elements any op of the block returns (a broadcast copy of a weight shows up here)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_prefill_logits_of_the_last_position_copy_no_weight():
    """Regeneration's prefill asks for the last position's logits of B > 1 rows. On a strided (B, 1, h) view,
    F.linear broadcast the head's weight into a (B, h, V) copy (seconds per prefill chunk on the CPU at gen_batch
    32); the runner hands it a contiguous row instead: no op returns more than the head's logits or its weight, and
    the logits equal the full forward's last position bit for bit, and the product on the strided view (the old
    path) up to fp32 rounding."""
    from support.models import make_tiny_llama
    from eyas.target.runner import Runner

    model = make_tiny_llama(layers=2, vocab=512, hidden=64)
    B, T, V, h = 6, 9, 512, 64
    runner = Runner.from_hf(model, max_batch=B, max_seq=32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, V, (B, T), generator=g)
    pos = torch.arange(T).expand(B, T)
    mask = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    with _Largest() as big:
        last, _ = runner.forward(ids, pos, pos, mask, last_only=True)              # (B, 1, V)
    assert last.shape == (B, 1, V)
    assert big.numel <= max(V * h, B * T * 4 * h), big.numel                       # B * h * V = 196,608 on the old path
    final, _ = runner.forward(ids, pos, pos, mask, logits=False)                   # (B, T, h)
    head = runner.lm_head
    assert torch.equal(last, head(final)[:, -1:])
    old = torch.nn.functional.linear(final[:, -1:], head.weight)                   # the strided old path
    torch.testing.assert_close(last, old, rtol=1e-5, atol=1e-6)                    # a batched product rounds apart


# ----------------------------------------------------------------------------- TTT attention by blocks (CPU)
def _right_padded(c):
    """The case with every row one sample followed by padding (the trainer's unpacked rows)."""
    B, T = c["valid"].shape
    valid = torch.arange(T)[None] < torch.tensor([T - 1, T - 3, T][:B])[:, None]
    return dict(c, valid=valid, loss_mask=c["loss_mask"] & valid)


def _dense_attention(q, k, v, seg, s):
    """The reference: SDPA over all (s+1)T keys under dense_masks' step-s mask, kv heads repeated."""
    B, nh, T, hd = q.shape
    rep = nh // k.shape[1]
    mask = ttt.dense_masks(seg, s + 1)[:, None]                                  # (B, 1, T, (s+1)T)
    y = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                         attn_mask=mask)
    return y.transpose(1, 2).reshape(B, T, nh * hd)


@pytest.mark.parametrize("rows", ["packed", "right_padded"])
@pytest.mark.parametrize("s", [0, 1, 2])
def test_block_attention_equals_dense_masked_sdpa(rows, s):
    """block_attend (step 0's keys through the fused kernel, each later step's key as a diagonal, merged by
    log-sum-exp, with a hand-written backward) equals SDPA under the dense TTT mask at step s, forward and
    gradients, with GQA, on packed rows (two samples, leading and trailing padding) and right-padded ones."""
    from eyas.model.blocks import StepBlocks, block_attend

    g = torch.Generator().manual_seed(s)
    B, nh, nkv, T, hd = 3, 4, 2, 13, 8
    if rows == "packed":
        seg = torch.tensor([[1] * 6 + [2] * 5 + [0] * 2, [1] * 13, [0] * 2 + [1] * 11])
    else:
        seg = (torch.arange(T)[None] < torch.tensor([13, 9, 4])[:, None]).long()
    q = torch.randn(B, nh, T, hd, generator=g, requires_grad=True)
    k = torch.randn(B, nkv, (s + 1) * T, hd, generator=g, requires_grad=True)
    v = torch.randn(B, nkv, (s + 1) * T, hd, generator=g, requires_grad=True)
    dy = torch.randn(B, T, nh * hd, generator=g)
    res = []
    for fn in (lambda: _dense_attention(q, k, v, seg, s),
               lambda: block_attend(q, k, v, StepBlocks(ttt.dense_masks(seg, 1)))):
        y = fn()
        y.backward(dy)
        res.append((y.detach(), q.grad, k.grad, v.grad))
        q.grad = k.grad = v.grad = None
    for name, a, b in zip(("y", "dq", "dk", "dv"), *res):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("padding", ["left_and_right", "right"])
@pytest.mark.parametrize("K", [1, 3])
def test_blocks_ttt_equals_naive_reference_and_dense(padding, K):
    """With attention 'blocks' (the CPU's default) the TTT loss, counts and gradients equal the step-by-step
    reference and the dense-mask path, on make_case's rows (leading and trailing padding) and right-padded ones."""
    d, c = make_case(seed=20 + K, B=3, T=11)
    if padding == "right":
        c = _right_padded(c)
    loss_n, met_n, grads_n = run_naive(d, c, K)
    outs = {}
    for attention in ("blocks", "dense"):
        d.zero_grad()
        out = ttt_forward(d, **ttt_inputs(c), cfg=TTTConfig(num_steps=K, attention=attention))
        out.loss.backward()
        outs[attention] = out, {n: p.grad.clone() for n, p in d.named_parameters()}
    for attention, (out, grads) in outs.items():
        torch.testing.assert_close(out.loss, loss_n.detach(), rtol=1e-5, atol=1e-5)
        for key in ("count_k", "correct_k", "cond_count_k", "cond_correct_k"):
            assert getattr(out, key).tolist() == met_n[key], (attention, key)
        for name in grads_n:
            torch.testing.assert_close(grads[name], grads_n[name], rtol=1e-5, atol=1e-5, msg=f"{attention} {name}")
    (ob, gb), (od, gd) = outs["blocks"], outs["dense"]
    assert torch.equal(ob.accept_len, od.accept_len)


def test_blocks_ttt_under_bf16_autocast_matches_dense():
    """Under the CPU's bf16 autocast (the cpu-demo's training) blocks and dense give the same counts and the same loss
    and gradients up to bf16 rounding (both round q, k, v to bf16; the fused kernels accumulate in fp32)."""
    K = 3
    d, c = make_case(seed=9, B=3, T=11, V=64, Vd=40)
    c = _right_padded(c)
    res = {}
    for attention in ("blocks", "dense"):
        d.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ttt_forward(d, **ttt_inputs(c), cfg=TTTConfig(num_steps=K, attention=attention))
        out.loss.backward()
        res[attention] = out, {n: p.grad.clone() for n, p in d.named_parameters()}
    (ob, gb), (od, gd) = res["blocks"], res["dense"]
    assert ob.count_k.tolist() == od.count_k.tolist()
    torch.testing.assert_close(ob.loss, od.loss, rtol=2e-2, atol=2e-2)
    for name in gd:
        rel = (gb[name] - gd[name]).norm() / gd[name].norm().clamp(min=1e-12)
        assert rel < 3e-2, (name, float(rel))
