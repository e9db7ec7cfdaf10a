"""The LK losses (arXiv 2602.23881): the fused head's ce / alpha / -log alpha against a naive reference written out
here (full softmax, min, sum, log) for values and gradients; the TTT losses against a step-by-step reference;
the default 'ce' path unchanged; config, CLI, recipe and resume identity; CPU runs with each loss that learn."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from eyas.train.lk import fused_lk_terms, log_draft_mass
from eyas.train.soft_ce import fused_soft_ce

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread


def _case(N=37, h=16, ht=12, Vd=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, h, generator=g, requires_grad=True)
    w = (0.5 * torch.randn(Vd, h, generator=g)).requires_grad_(True)
    f, wt = torch.randn(N, ht, generator=g), torch.randn(Vd, ht, generator=g)
    lmass = -torch.rand(N, generator=g)                  # the target puts e^-1 .. 1 of its mass on the draft vocab
    return x, w, f, wt, lmass


def reference(x, w, f, wt, lmass):
    """Per row, written out: q = softmax(x W^T), p' = softmax(f Wt^T), p = p' * mass; ce = -sum p' log q,
    alpha = sum min(p, q), nla = -log alpha. Sums over rows, and the drafter's argmax."""
    logq = F.log_softmax((x @ w.T).float(), dim=-1)                              # (N, Vd)
    q = logq.exp()
    with torch.no_grad():
        pn = F.softmax((f @ wt.T).float(), dim=-1)                               # (N, Vd)
        p = pn * lmass.exp()[:, None]
    ce = -(pn * logq).sum(-1)                                                    # (N,)
    alpha = torch.minimum(p, q).sum(-1)                                          # (N,)
    nla = -torch.log(alpha)
    return ce.sum(), alpha.sum(), nla.sum(), logq.argmax(-1)


def _grads(loss, *ts):
    gs = torch.autograd.grad(loss, ts)
    return [g.clone() for g in gs]


@pytest.mark.parametrize("grads,coef", [(("ce",), (1.3, 0, 0)), (("nla",), (0, 0, 0.7)),
                                        (("ce", "alpha"), (0.4, -2.0, 0)), (("ce", "alpha", "nla"), (0.5, 1.5, -0.25))])
@pytest.mark.parametrize("chunk", [1, 5, 4096])
def test_fused_terms_equal_the_naive_reference(grads, coef, chunk):
    x, w, f, wt, lm = _case()
    ref = reference(x, w, f, wt, lm)
    loss_r = sum(c * t for c, t in zip(coef, ref[:3]) if c)
    gx_r, gw_r = _grads(loss_r, x, w)
    out = fused_lk_terms(x, w, f, wt, lm, grads=grads, chunk=chunk)
    for a, b in zip(out[:3], ref[:3]):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[3], ref[3])
    loss = sum(c * t for c, t in zip(coef, out[:3]) if c)
    gx, gw = _grads(loss, x, w)
    torch.testing.assert_close(gx, gx_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, gw_r, rtol=1e-5, atol=1e-5)


def test_terms_without_gradients_are_metrics_and_weight_zero_rows_add_nothing():
    x, w, f, wt, lm = _case(N=23)
    keep = torch.tensor([i % 3 != 1 for i in range(23)])
    ref = reference(x[keep], w, f[keep], wt, lm[keep])
    gx_r, gw_r = _grads(ref[2], x, w)
    ce, alpha, nla, pred = fused_lk_terms(x, w, f, wt, lm, grads=("nla",), chunk=4, weight=keep.float())
    assert not ce.requires_grad and not alpha.requires_grad and nla.requires_grad
    for a, b in zip((ce, alpha, nla), ref[:3]):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(pred[keep], ref[3])
    gx, gw = _grads(nla, x, w)
    torch.testing.assert_close(gx[keep], gx_r[keep], rtol=1e-5, atol=1e-5)
    assert torch.equal(gx[~keep], torch.zeros_like(gx[~keep]))
    torch.testing.assert_close(gw, gw_r, rtol=1e-5, atol=1e-5)


def test_alpha_is_one_minus_total_variation_and_nla_finite_without_overlap():
    x, w, f, wt, _ = _case(N=9)
    lm = torch.zeros(9)                                  # the target's whole law on the draft vocabulary
    _, alpha, _, _ = fused_lk_terms(x, w, f, wt, lm)
    q, p = F.softmax(x @ w.T, -1), F.softmax(f @ wt.T, -1)
    torch.testing.assert_close(alpha, (1 - 0.5 * (p - q).abs().sum(-1)).sum().detach(), rtol=1e-5, atol=1e-5)
    # with mass m < 1 on the draft vocabulary, the renormalised labels overstate alpha by a factor of at most 1/m
    lm = torch.full((9,), math.log(0.6))
    _, alpha, _, _ = fused_lk_terms(x, w, f, wt, lm)
    a_full = torch.minimum(0.6 * p, q).sum(-1)
    a_norm = torch.minimum(p, q).sum(-1)
    torch.testing.assert_close(alpha, a_full.sum().detach(), rtol=1e-5, atol=1e-5)
    assert bool((a_full < a_norm).all() and (a_norm <= a_full / 0.6 + 1e-6).all())
    # drafter and target certain of different tokens: alpha underflows to 0 in fp32, -log alpha stays finite
    xs = torch.zeros(2, 4, requires_grad=True)
    ws = torch.zeros(6, 4)
    ws[0] = 400.0
    xs.data[:, 0] = 1.0
    zt = torch.full((2, 6), -400.0)
    zt[:, 5] = 400.0
    ws.requires_grad_(True)
    _, a, nla, _ = fused_lk_terms(xs, ws, zt, None, torch.zeros(2), grads=("nla",))
    nla.backward()
    assert float(a) == 0.0 and math.isfinite(nla.item()) and torch.isfinite(xs.grad).all()


def test_ce_term_is_bitwise_the_fused_soft_ce():
    """The CE of the LK head is soft_ce's, operation for operation: same loss and gradients to the bit."""
    x, w, f, wt, lm = _case(N=41)
    wr = torch.tensor([float(i % 4 != 0) for i in range(41)])
    ce, _, _, pred = fused_lk_terms(x, w, f, wt, lm, grads=("ce",), chunk=8, weight=wr)
    gx, gw = _grads(ce, x, w)
    ce_r, pred_r = fused_soft_ce(x, w, f, wt, chunk=8, weight=wr)
    gx_r, gw_r = _grads(ce_r, x, w)
    assert torch.equal(ce, ce_r) and torch.equal(pred, pred_r) and torch.equal(gx, gx_r) and torch.equal(gw, gw_r)


def test_log_draft_mass_is_the_log_of_the_draft_columns_probability():
    g = torch.Generator().manual_seed(3)
    z, ids = 4 * torch.randn(7, 30, generator=g), torch.tensor([0, 3, 4, 10, 29])
    ref = torch.log(F.softmax(z.double(), -1)[:, ids].sum(-1)).float()
    torch.testing.assert_close(log_draft_mass(z, ids, rows=3), ref)
    torch.testing.assert_close(log_draft_mass(z.bfloat16(), ids), torch.log(F.softmax(z.bfloat16().double(), -1)[:, ids]
                                                                                .sum(-1)).float())


# ------------------------------------------------------------------------------------ TTT with the LK losses
def naive_lk_ttt(d, c, K, loss, eta=3.0, decay=0.8):
    """The TTT objective written out per step and position (EAGLE3.md section 3, as tests/test_ttt.naive_ttt) with
    the LK per-position terms: returns (total loss, loss_k, alpha_k sums)."""
    from test_ttt import naive_finish, naive_qkv, rms

    ids, lmask, valid, aux, final, E, W = (c[k] for k in ("input_ids", "loss_mask", "valid", "aux", "final", "E", "W"))
    B, T = ids.shape
    cf, tok = d.config, d.token_ids
    hid = [[d.fc.weight @ aux[b, t] for t in range(T)] for b in range(B)]
    kv, total, loss_k, alpha_k = [], 0.0, [], []
    for k in range(K):
        kv.append([[naive_qkv(d, hid[b][t], E[ids[b, t + k + 1]] if t + k + 1 < T else torch.zeros(cf.hidden_size),
                              t + k) for t in range(T)] for b in range(B)])
        ces, alphas, new_hid = [], [], []
        for b in range(B):
            nb = []
            for t in range(T):
                pairs = [kv[0][b][j][1:] for j in range(t + 1) if valid[b, j] or j == t]
                pairs += [kv[i][b][t][1:] for i in range(1, k + 1)]
                out = naive_finish(d, hid[b][t], kv[k][b][t][0], [p[0] for p in pairs], [p[1] for p in pairs])
                nb.append(out)
                s = t + k + 2                                   # predicts x_s against P_{s-1}
                if not (s < T and all(bool(valid[b, i]) for i in range(t, s + 1)) and bool(lmask[b, s])):
                    continue
                full = W @ final[b, s - 1]                                       # (V,) target logits
                if not bool(d.t2d[full.argmax()]):
                    continue
                p_full = torch.softmax(full, 0)[tok]                             # the target's own p on draft tokens
                p_norm = torch.softmax(full[tok], 0)                             # the soft labels
                logq = torch.log_softmax(d.lm_head.weight @ rms(out, d.norm.weight, cf.rms_norm_eps), 0)
                ces.append(-(p_norm * logq).sum())
                alphas.append(torch.minimum(p_full, logq.exp()).sum())
            new_hid.append(nb)
        ce, al = torch.stack(ces), torch.stack(alphas)
        if loss == "ce":
            lk = ce.mean()
        elif loss == "lk_alpha":
            lk = -torch.log(al).mean()
        else:
            lam = torch.exp(-eta * al.detach().mean())
            lk = lam * ce.mean() + (1 - lam) * (1 - al.mean())
        total = total + decay ** k * lk
        loss_k.append(float(lk.detach()))
        alpha_k.append(float(al.sum()))
        hid = new_hid
    return total, loss_k, alpha_k


@pytest.mark.parametrize("loss", ["lk_alpha", "lk_lambda", "ce"])
def test_ttt_lk_losses_equal_the_naive_reference(loss):
    """Same positions, mask, per-step weights and alignment as the CE; values, alpha_k and every gradient agree,
    with the label table and with per-step labels (chunked), and with fixed-size row sets (weight-0 rows)."""
    from test_ttt import make_case, ttt_inputs

    from eyas.train import ttt as ttt_mod
    from eyas.train.ttt import TTTConfig, ttt_forward

    K = 3
    d, c = make_case(seed=7, B=2, T=10)
    d.zero_grad()
    total, loss_k, alpha_k = naive_lk_ttt(d, c, K, loss, eta=2.5)
    total.backward()
    ref = {n: p.grad.clone() for n, p in d.named_parameters()}
    n = int(c["valid"].sum())
    for chunk, table, bound in ((None, True, None), (4, False, None), (3, True, n)):
        d.zero_grad()
        cfg = TTTConfig(num_steps=K, chunk_size=chunk, loss=loss, lk_eta=2.5)
        mp = pytest.MonkeyPatch()
        if not table:
            mp.setattr(ttt_mod, "LABEL_TABLE_BYTES", 0)
        try:
            out = ttt_forward(d, **ttt_inputs(c), cfg=cfg, max_counted=bound, alpha=True)
        finally:
            mp.undo()
        out.loss.backward()
        torch.testing.assert_close(out.loss, total.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.loss_k, torch.tensor(loss_k), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.alpha_k, torch.tensor(alpha_k), rtol=1e-5, atol=1e-5)
        for name, g in ref.items():
            torch.testing.assert_close(d.get_parameter(name).grad, g, rtol=1e-5, atol=1e-5, msg=name)


def test_lk_lambda_at_eta_zero_is_the_ce():
    """w = exp(-0 * alpha) = 1: lk_lambda's loss and gradients are the CE's."""
    from test_ttt import make_case, ttt_inputs

    from eyas.train.ttt import TTTConfig, ttt_forward

    d, c = make_case(seed=3, B=2, T=10)
    res = []
    for loss in ("ce", "lk_lambda"):
        d.zero_grad()
        o = ttt_forward(d, **ttt_inputs(c), cfg=TTTConfig(num_steps=3, loss=loss, lk_eta=0.0))
        o.loss.backward()
        res.append((o.loss_k, {n: p.grad.clone() for n, p in d.named_parameters()}))
    torch.testing.assert_close(res[0][0], res[1][0], rtol=1e-6, atol=1e-6)
    for n, g in res[0][1].items():
        torch.testing.assert_close(res[1][1][n], g, rtol=1e-6, atol=1e-6, msg=n)


def test_default_ce_path_is_unchanged():
    """loss='ce' without alpha runs soft_ce.fused_soft_ce, as before the LK losses: the same loss and gradients to
    the bit as a direct re-implementation of the step loop's CE call would give; alpha=True leaves them equal too,
    and only then is alpha_k measured."""
    from test_ttt import make_case, ttt_inputs

    from eyas.train import ttt as ttt_mod
    from eyas.train.ttt import TTTConfig, ttt_forward

    K = 3
    d, c = make_case(seed=2, B=2, T=10)
    calls = []
    orig = ttt_mod.fused_soft_ce
    mp = pytest.MonkeyPatch()
    mp.setattr(ttt_mod, "fused_soft_ce", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    try:
        outs, grads = [], []
        for alpha in (False, True):
            d.zero_grad()
            o = ttt_forward(d, **ttt_inputs(c), cfg=TTTConfig(num_steps=K), alpha=alpha)
            o.loss.backward()
            outs.append(o)
            grads.append({n: p.grad.clone() for n, p in d.named_parameters()})
    finally:
        mp.undo()
    assert len(calls) == K and outs[0].alpha_k is None and outs[1].alpha_k.shape == (K,)
    assert torch.equal(outs[0].loss, outs[1].loss) and torch.equal(outs[0].loss_k, outs[1].loss_k)
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    assert TTTConfig().loss == "ce"


# ------------------------------------------------------------------------- config, CLI, recipe, resume, training
def test_loss_is_a_flag_a_recipe_key_and_part_of_the_resume_identity(tmp_path):
    import test_train as tt

    from eyas.cli import build_parser
    from eyas.errors import EyasError
    from eyas.knobs import from_args
    from eyas.run import RunConfig, resolve_stages
    from eyas.train.config import TrainConfig
    from eyas.train.trainer import run_train

    a = build_parser().parse_args(["train", "--store", "S", "--out", "R", "--loss", "lk_lambda", "--lk-eta", "2"])
    assert from_args(TrainConfig, a) == TrainConfig(store="S", out="R", loss="lk_lambda", lk_eta=2.0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--store", "S", "--out", "R", "--loss", "kl"])
    with pytest.raises(EyasError, match="loss must be ce, lk_alpha or lk_lambda"):
        TrainConfig(store="S", out="R", loss="tv")
    with pytest.raises(EyasError, match="lk_eta"):
        TrainConfig(store="S", out="R", lk_eta=-1.0)
    # the default is CE; a --resume must match the loss and its eta
    assert TrainConfig(store="S", out="R").loss == "ce"
    from eyas.train.config import CHOICES
    from eyas.train.ttt import LOSSES
    assert CHOICES["loss"] == LOSSES
    assert {k: TrainConfig(store="S", out="R").identity()[k] for k in ("loss", "lk_eta")} == {"loss": "ce",
                                                                                             "lk_eta": 3.0}
    assert TrainConfig(store="S", out="R", loss="lk_alpha").identity()["loss"] == "lk_alpha"

    for over in ({"train.loss": "lk_lambda", "train.lk_eta": 1.5}, {"loss": "lk_lambda", "lk_eta": 1.5}):
        t = resolve_stages(RunConfig(preset="gpu", overrides=over), tmp_path / "RUN", vocab_size=49152).train
        assert (t.loss, t.lk_eta) == ("lk_lambda", 1.5)
    with pytest.raises(EyasError, match=r"recipe gpu \[train\]: loss must be"):
        RunConfig(preset="gpu", overrides={"train.loss": "kl"})

    t = tt.tiny_target()
    store = tt.capture(tmp_path, t, tt.make_samples(24))
    run_train(tt.cfg(tmp_path, store, "r", steps=2), target=t)
    recs = [json.loads(x) for x in open(tmp_path / "r" / "metrics.jsonl")]      # a ce run: alpha in eval only
    assert {r["split"]: "alpha_k" in r for r in recs} == {"train": False, "eval": True}
    with pytest.raises(EyasError, match=r"training configuration does not match \(.*loss"):
        run_train(tt.cfg(tmp_path, store, "r", steps=2, loss="lk_alpha", resume=True), target=t)


@pytest.mark.parametrize("loss", ["lk_alpha", "lk_lambda"])
def test_a_cpu_run_with_each_lk_loss_learns(tmp_path, loss):
    """On a sharpened tiny target (as tests/test_norm_before_fc.py): held-out acc_0 beats the frequency baseline,
    and the mean alpha the loss raises rises in training and is reported in eval."""
    import test_decode as td
    import test_train as tt
    from support.models import make_tiny_llama

    from eyas.target import target_from_model
    from eyas.train.trainer import run_train

    t = target_from_model(td.peaky(make_tiny_llama(layers=4, hidden=32, heads=4, kv_heads=2, vocab=tt.V, inter=64),
                                   8.0, 0.3))
    store = tt.capture(tmp_path, t, tt.make_samples(80))
    res = run_train(tt.cfg(tmp_path, store, steps=60, lr=1e-2, loss=loss, eval_fraction=0.2), target=t)
    recs = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    alpha0 = [r["alpha_k"][0] for r in recs if r["split"] == "train"]
    ev = res["eval"]
    assert len(alpha0) == 60 and sum(alpha0[-10:]) / 10 > sum(alpha0[:5]) / 5 + 0.03, alpha0
    assert ev["acc_k"][0] > ev["baseline_acc_0"] + 0.08, ev
    assert len(ev["alpha_k"]) == 3 and 0.0 < ev["alpha_k"][0] <= 1.0


@pytest.mark.parametrize("loss", ["lk_alpha", "lk_lambda"])
def test_lk_losses_under_bf16_autocast_are_close_to_fp32(loss):
    """The GPU trains under bf16 autocast: the matmuls in bf16, everything per row in fp32; the loss and alpha stay
    within a few percent of fp32's and every gradient is finite."""
    from test_ttt import make_case, ttt_inputs

    from eyas.train.ttt import TTTConfig, ttt_forward

    d, c = make_case(seed=8, B=2, T=12, h=64, V=300, Vd=200)
    cfg = TTTConfig(num_steps=3, loss=loss)
    ref = ttt_forward(d, **ttt_inputs(c), cfg=cfg)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = ttt_forward(d, **ttt_inputs(c), cfg=cfg)
    o.loss.backward()
    assert abs(float(o.loss) - float(ref.loss)) < 0.03 * abs(float(ref.loss))
    torch.testing.assert_close(o.alpha_k, ref.alpha_k, rtol=0.03, atol=0.03)
    assert all(p.grad.dtype == p.dtype and torch.isfinite(p.grad).all() for p in d.parameters() if p.grad is not None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("grads", [("nla",), ("ce", "alpha")])
def test_compiled_cuda_terms_equal_the_reference(grads):
    """On CUDA the chunk step is compiled (training) or eager (no gradients): both equal the fp32 reference; the row
    count changes between calls, as the last chunk's does in training."""
    for N in (37, 29):
        x, w, f, wt, lm = _case(N=N, Vd=300)
        ref = reference(x, w, f, wt, lm)
        coef = {"ce": 0.7, "alpha": -1.3, "nla": 1.1}
        gx_r, gw_r = _grads(sum(coef[g] * ref[("ce", "alpha", "nla").index(g)] for g in grads), x, w)
        xc, wc = x.detach().cuda().requires_grad_(True), w.detach().cuda().requires_grad_(True)
        out = fused_lk_terms(xc, wc, f.cuda(), wt.cuda(), lm.cuda(), grads=grads, chunk=16)
        gx, gw = _grads(sum(coef[g] * out[("ce", "alpha", "nla").index(g)] for g in grads), xc, wc)
        for a, b in zip(out[:3], ref[:3]):
            torch.testing.assert_close(a.cpu(), b.detach(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(gx.cpu(), gx_r, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(gw.cpu(), gw_r, rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            eager = fused_lk_terms(xc, wc, f.cuda(), wt.cuda(), lm.cuda(), chunk=16)
        for a, b in zip(eager[:3], ref[:3]):
            torch.testing.assert_close(a.cpu(), b.detach(), rtol=1e-4, atol=1e-4)


def test_an_lk_run_resumes_bit_identically(tmp_path, monkeypatch):
    """An lk_lambda run cut after step 6 (checkpoint at 4) and resumed equals the uninterrupted run to the bit:
    the per-micro-batch weight w holds no state that a checkpoint could miss."""
    import test_train as tt

    from eyas.train.trainer import run_train

    t = tt.tiny_target()
    store = tt.capture(tmp_path, t, tt.make_samples(40))
    kw = dict(steps=8, checkpoint_every=4, loss="lk_lambda", lk_eta=2.0)
    run_train(tt.cfg(tmp_path, store, "full", **kw), target=t)
    tt.crashed_run(monkeypatch, lambda: run_train(tt.cfg(tmp_path, store, "cut", **kw), target=t))
    run_train(tt.cfg(tmp_path, store, "cut", resume=True, **kw), target=t)
    recs = [[json.loads(x) for x in open(tmp_path / n / "metrics.jsonl")] for n in ("full", "cut")]
    for r in recs[0] + recs[1]:
        r.pop("tokens_per_s", None), r.pop("data_wait_s", None)
    assert len(recs[0]) > 8 and recs[0] == recs[1] and all("alpha_k" in r for r in recs[0])
    sa, sb = tt.drafter_state(tmp_path / "full"), tt.drafter_state(tmp_path / "cut")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
