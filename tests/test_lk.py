"""The LK losses (arXiv 2602.23881): the fused head's ce / alpha / -log alpha against a naive reference written out
here (full softmax, min, sum, log) for values and gradients; the TTT losses against a step-by-step reference;
the default 'ce' path unchanged; config, CLI, recipe and resume identity; CPU runs with each loss that learn."""

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
