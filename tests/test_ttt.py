"""TTT fast path vs a naive step-by-step reference (plain loops over steps and positions, explicit key lists).

The reference below is written from EAGLE3.md section 3 alone; it does not call the drafter's modules, only
reads their weights. Mutated variants of it (target shifted by one, RoPE position t instead of t+k, wrong key
set, loss mask at the input token) must disagree with the fast path, so the equality test is sensitive.
"""

import math

import pytest
import torch

from eyas.model.drafter import DrafterConfig, Eagle3Drafter
from eyas.model.vocab import build_draft_vocab
from eyas.train.ttt import TTTConfig, target_logits_from_final, ttt_forward


# ----------------------------------------------------------------------------- naive reference
def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):
    """x (n_heads, hd) rotated to position pos (HF Llama rotate-half convention)."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    f = (pos * inv).float()
    cos, sin = torch.cat([f.cos(), f.cos()]), torch.cat([f.sin(), f.sin()])
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def naive_qkv(d, hid, emb, pos):
    c, L = d.config, d.midlayer
    x = torch.cat([rms(emb, L.input_layernorm.weight, c.rms_norm_eps), rms(hid, L.hidden_norm.weight, c.rms_norm_eps)])
    q = (L.self_attn.q_proj.weight @ x).view(c.num_attention_heads, c.head_dim)
    k = (L.self_attn.k_proj.weight @ x).view(c.num_key_value_heads, c.head_dim)
    v = (L.self_attn.v_proj.weight @ x).view(c.num_key_value_heads, c.head_dim)
    return rope(q, pos, c.rope_theta), rope(k, pos, c.rope_theta), v


def naive_finish(d, hid, q, keys, vals):
    c, L = d.config, d.midlayer
    rep = c.num_attention_heads // c.num_key_value_heads
    K, V = torch.stack(keys), torch.stack(vals)                 # (L, nkv, hd)
    heads = []
    for h in range(c.num_attention_heads):
        s = torch.stack([K[j, h // rep] @ q[h] for j in range(len(keys))]) / math.sqrt(c.head_dim)
        w = torch.softmax(s, 0)
        heads.append(sum(w[j] * V[j, h // rep] for j in range(len(keys))))
    h1 = hid + L.self_attn.o_proj.weight @ torch.cat(heads)
    m = L.mlp
    z = rms(h1, L.post_attention_layernorm.weight, c.rms_norm_eps)
    return h1 + m.down_proj.weight @ (torch.nn.functional.silu(m.gate_proj.weight @ z) * (m.up_proj.weight @ z))


def naive_ttt(d, ids, loss_mask, valid, aux, final, E, W, K, decay, *, tgt_shift=1, pred_shift=2,
              rope_step=True, keys_rule="eagle", mask_at_pred=True):
    B, T = ids.shape
    c = d.config
    tok = d.token_ids
    total, loss_k, count_k, correct_k, ccount_k, ccorrect_k = 0.0, [], [], [], [], []
    hid = [[d.fc.weight @ aux[b, t] for t in range(T)] for b in range(B)]
    kv = []                                                         # kv[k][b][t] = (key, value)
    prev_right = [[True] * T for _ in range(B)]
    for k in range(K):
        qs, kv_k = [], []
        for b in range(B):
            qb, kvb = [], []
            for t in range(T):
                j = t + k + 1
                emb = E[ids[b, j]] if j < T else torch.zeros(c.hidden_size)
                q, kk, vv = naive_qkv(d, hid[b][t], emb, t + k if rope_step else t)
                qb.append(q)
                kvb.append((kk, vv))
            qs.append(qb)
            kv_k.append(kvb)
        kv.append(kv_k)
        new_hid = []
        lsum, cnt, cor, ccnt, ccor = 0.0, 0, 0, 0, 0
        for b in range(B):
            nb = []
            for t in range(T):
                if keys_rule == "eagle":        # step-0 keys at j <= t (valid or self) + steps 1..k at t
                    pairs = [kv[0][b][j] for j in range(t + 1) if valid[b, j] or j == t]
                    pairs += [kv[i][b][t] for i in range(1, k + 1)]
                else:                           # a plausible bug: step k attends causally to its own keys
                    pairs = [kv[k][b][j] for j in range(t + 1) if valid[b, j] or j == t]
                out = naive_finish(d, hid[b][t], qs[b][t], [p[0] for p in pairs], [p[1] for p in pairs])
                nb.append(out)
                s, tp = t + k + pred_shift, t + k + tgt_shift   # predicted token x_s, target P_tp
                mpos = s if mask_at_pred else t + k + 1
                span = (s < T and tp < T and all(bool(valid[b, i]) for i in range(t, s + 1))
                        and bool(loss_mask[b, mpos]))
                counted = span and bool(d.t2d[(W @ final[b, tp]).argmax()])
                if span and not counted and prev_right[b][t]:
                    ccnt += 1                   # a target outside the draft vocab: decoding misses it
                if not counted:                 # an uncounted step also breaks the chain for later steps
                    prev_right[b][t] = False
                    continue
                full = W @ final[b, tp]
                p = torch.softmax(full[tok], 0)
                logits = d.lm_head.weight @ rms(out, d.norm.weight, c.rms_norm_eps)
                lsum = lsum - (p * torch.log_softmax(logits, 0)).sum()
                right = bool(logits.argmax() == full[tok].argmax())
                cnt += 1
                cor += right
                if prev_right[b][t]:
                    ccnt += 1
                    ccor += right
                prev_right[b][t] = prev_right[b][t] and right
            new_hid.append(nb)
        lk = lsum / max(cnt, 1)
        total = total + decay ** k * lk
        loss_k.append(float(lk.detach()) if torch.is_tensor(lk) else lk)
        count_k.append(cnt), correct_k.append(cor), ccount_k.append(ccnt), ccorrect_k.append(ccor)
        hid = new_hid
    return total, dict(loss_k=loss_k, count_k=count_k, correct_k=correct_k, cond_count_k=ccount_k,
                       cond_correct_k=ccorrect_k)


# ----------------------------------------------------------------------------- cases
def make_case(seed=0, B=2, T=9, h=32, V=40, Vd=24, std=0.3, head_dim=8):
    """Random drafter + batch with left padding (row 0), right padding (row 1) and loss-mask holes."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=h, target_hidden_size=h, intermediate_size=48, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=10000.0,
                        max_position_embeddings=64, vocab_size=V, draft_vocab_size=Vd, aux_layer_ids=(1, 2, 3))
    d = Eagle3Drafter(cfg)
    d.init_weights(std=std)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5, generator=g)
    vocab = build_draft_vocab(torch.randint(0, 100, (V,), generator=g), Vd)
    d.set_vocab(vocab.d2t, vocab.t2d)
    ids = torch.randint(0, V, (B, T), generator=g)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[0, :2] = False
    if B > 1:
        valid[1, T - 3:] = False
    loss_mask = (torch.rand(B, T, generator=g) > 0.25) & valid
    aux = torch.randn(B, T, 3 * h, generator=g)
    final = torch.randn(B, T, h, generator=g)
    E = torch.randn(V, h, generator=g)
    W = torch.randn(V, h, generator=g)
    return d, dict(input_ids=ids, loss_mask=loss_mask, valid=valid, aux=aux, final=final, E=E, W=W)


def ttt_inputs(c):
    """The keyword arguments of ttt_forward for a case from make_case."""
    return dict(input_ids=c["input_ids"], loss_mask=c["loss_mask"], valid=c["valid"], aux=c["aux"], final=c["final"],
                embed=torch.nn.Embedding.from_pretrained(c["E"]), lm_head_weight=c["W"])


def run_fast(d, c, K, chunk_size=None, reduction="mean"):
    d.zero_grad()
    out = ttt_forward(d, input_ids=c["input_ids"], loss_mask=c["loss_mask"], valid=c["valid"], aux=c["aux"],
                      final=c["final"], embed=torch.nn.Embedding.from_pretrained(c["E"]), lm_head_weight=c["W"],
                      cfg=TTTConfig(num_steps=K, chunk_size=chunk_size, reduction=reduction))
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in d.named_parameters()}


def run_naive(d, c, K, **mut):
    d.zero_grad()
    loss, metrics = naive_ttt(d, c["input_ids"], c["loss_mask"], c["valid"], c["aux"], c["final"], c["E"], c["W"],
                              K, 0.8, **mut)
    loss.backward()
    return loss, metrics, {n: p.grad.clone() for n, p in d.named_parameters()}


def assert_fast_equals_naive(d, c, K):
    """ttt_forward's loss, per-step losses and counts and its gradients equal the naive reference's, whole and in
    logits chunks of 4."""
    loss_n, met_n, grads_n = run_naive(d, c, K)
    assert all(n > 0 for n in met_n["count_k"]), met_n          # every step has counted positions
    for chunk in (None, 4):
        out, grads = run_fast(d, c, K, chunk_size=chunk)
        torch.testing.assert_close(out.loss, loss_n.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.loss_k, torch.tensor(met_n["loss_k"]), rtol=1e-5, atol=1e-5)
        for name in grads_n:
            torch.testing.assert_close(grads[name], grads_n[name], rtol=1e-5, atol=1e-5, msg=name)
        for key in ("count_k", "correct_k", "cond_count_k", "cond_correct_k"):
            assert getattr(out, key).tolist() == met_n[key], key


@pytest.mark.parametrize("K", [1, 2, 3, 4])
def test_fast_path_equals_naive_reference(K):
    assert_fast_equals_naive(*make_case(seed=K), K)


@pytest.mark.parametrize("bound", ["tight", "all"])
def test_fixed_size_row_sets_equal_boolean_selection(bound):
    """max_counted (an upper bound on the loss positions, known on the host) gathers fixed-size row sets instead
    of boolean indexing, so no step waits for the device: same counts, accept lengths and loss, same gradients.
    'tight' is the count of the largest row set (the positions whose next token is a loss position)."""
    K = 4
    d, c = make_case(seed=5, B=3, T=11)
    ref, grads_r = run_fast(d, c, K, chunk_size=4)
    tight = int((c["loss_mask"] & c["valid"])[:, 1:].sum())
    n = tight if bound == "tight" else c["valid"].numel()
    d.zero_grad()
    short = ttt_forward(d, **ttt_inputs(c), cfg=TTTConfig(num_steps=K, chunk_size=4),
                        max_counted=int(ref.count_k.max()) - 1)
    assert not torch.allclose(short.loss, ref.loss)   # a bound too small drops a row: the test can see it
    d.zero_grad()
    out = ttt_forward(d, **ttt_inputs(c), cfg=TTTConfig(num_steps=K, chunk_size=4), max_counted=n)
    out.loss.backward()
    for key in ("count_k", "correct_k", "cond_count_k", "cond_correct_k", "accept_len"):
        assert torch.equal(getattr(out, key), getattr(ref, key)), key
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.loss_k, ref.loss_k, rtol=1e-6, atol=1e-6)
    for name, g in grads_r.items():
        torch.testing.assert_close(d.get_parameter(name).grad, g, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("mutation", [dict(tgt_shift=2), dict(tgt_shift=0, pred_shift=1), dict(rope_step=False),
                                      dict(keys_rule="own_step_causal"), dict(mask_at_pred=False)])
def test_reference_is_sensitive_to_alignment(mutation):
    """Each off-by-one / wrong-mask variant of the reference disagrees with the fast path."""
    K = 3
    d, c = make_case(seed=11)
    out, _ = run_fast(d, c, K)
    loss_m, met_m, _ = run_naive(d, c, K, **mutation)
    differs = abs(float(out.loss.detach()) - float(loss_m.detach())) > 1e-3 or out.count_k.tolist() != met_m["count_k"]
    assert differs, mutation


def test_metrics_match_reference_and_are_nontrivial():
    """Small draft vocab so the random drafter agrees with the target often enough to exercise acc/cond-acc."""
    K = 3
    d, c = make_case(seed=5, B=4, T=12, V=8, Vd=5)
    out, _ = run_fast(d, c, K)
    _, met_n, _ = run_naive(d, c, K)
    for key in ("count_k", "correct_k", "cond_count_k", "cond_correct_k"):
        assert getattr(out, key).tolist() == met_n[key], key
    assert out.correct_k.sum() > 0 and out.cond_count_k[1] > 0
    assert out.cond_count_k[0] >= out.count_k[0]          # step 0 also sees the out-of-draft-vocab targets
    assert out.acc_k[0] == pytest.approx(float(out.correct_k[0]) / float(out.count_k[0]))


def test_masks_remove_out_of_draft_targets_and_holes():
    """Counts equal a direct count of the masking rule; the out-of-draft rule and holes each remove positions."""
    K = 2
    d, c = make_case(seed=3)
    out, _ = run_fast(d, c, K)
    ids, lm, valid = c["input_ids"], c["loss_mask"], c["valid"]
    B, T = ids.shape
    in_draft = d.t2d[target_logits_from_final(c["final"], c["W"]).argmax(-1)]
    for k in range(K):
        span = [(b, t) for b in range(B) for t in range(T) if t + k + 2 < T and valid[b, t:t + k + 3].all()]
        with_lm = [(b, t) for b, t in span if lm[b, t + k + 2]]
        counted = [(b, t) for b, t in with_lm if in_draft[b, t + k + 1]]
        assert len(counted) < len(with_lm) < len(span)
        assert out.count_k[k] == len(counted)


def test_reduction_sum_and_empty_mask():
    d, c = make_case(seed=2)
    mean, _ = run_fast(d, c, 3)
    summed, _ = run_fast(d, c, 3, reduction="sum")
    torch.testing.assert_close(summed.loss_k, mean.loss_k * mean.count_k, rtol=1e-5, atol=1e-5)
    c["loss_mask"] = torch.zeros_like(c["loss_mask"])
    empty, grads = run_fast(d, c, 3)
    assert float(empty.loss.detach()) == 0.0 and empty.count_k.tolist() == [0, 0, 0]
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_target_logits_from_final_restricts_columns():
    torch.manual_seed(0)
    final, W = torch.randn(2, 5, 16), torch.randn(30, 16)
    tok = torch.tensor([1, 4, 7, 29])
    full = target_logits_from_final(final, W)
    assert full.shape == (2, 5, 30)
    torch.testing.assert_close(target_logits_from_final(final, W, tok), full[..., tok])
    torch.testing.assert_close(full, final @ W.T)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_and_bf16_autocast_runs():
    K = 4
    d, c = make_case(seed=7, B=2, T=33)
    cpu, cpu_grads = run_fast(d, c, K)
    dc = d.cuda()
    cc = {k: v.cuda() for k, v in c.items()}
    gpu, gpu_grads = run_fast(dc, cc, K, chunk_size=8)
    torch.testing.assert_close(gpu.loss.cpu(), cpu.loss.detach(), rtol=1e-4, atol=1e-4)
    for name in cpu_grads:
        torch.testing.assert_close(gpu_grads[name].cpu(), cpu_grads[name], rtol=1e-3, atol=1e-4, msg=name)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        bf, bf_grads = run_fast(dc, cc, K, chunk_size=8)
    assert torch.isfinite(bf.loss) and abs(float(bf.loss) - float(cpu.loss)) < 0.1 * float(cpu.loss)
    assert bf.count_k.tolist() == cpu.count_k.tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention", ["dense", "flex"])
def test_fixed_size_step_equals_boolean_and_does_not_sync_on_cuda(attention):
    """On CUDA, with max_counted the TTT forward and backward never wait for the device (sync debug mode
    'error' raises on any synchronising call), and they equal the boolean-selection path."""
    K = 3
    d, c = make_case(seed=9, B=2, T=64, h=64, head_dim=16)
    d = d.cuda()
    c = {k: v.cuda() for k, v in c.items()}
    n = int((c["loss_mask"] & c["valid"]).sum())
    cfg = TTTConfig(num_steps=K, chunk_size=16, attention=attention)
    ref = ttt_forward(d, **ttt_inputs(c), cfg=cfg)
    for _ in range(2):   # warm up: compiles and caches that may synchronise once
        ttt_forward(d, **ttt_inputs(c), cfg=cfg, max_counted=n).loss.backward()
    d.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = ttt_forward(d, **ttt_inputs(c), cfg=cfg, max_counted=n)
        out.loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for key in ("count_k", "correct_k", "accept_len"):
        assert torch.equal(getattr(out, key), getattr(ref, key)), key
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)
