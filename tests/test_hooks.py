"""target/hooks.py against the runner and the trainer: one layer-id convention everywhere.

The hooks (capture, online training) and the static-cache runner (regeneration, decoding) record the target's
residual stream separately. Here, on a tiny random Llama, they must agree id for id (HF hidden_states indices:
id i < N is the state entering layer i, id N the final norm's output), and online training's features must be
the capture stage's, bit for bit.
"""

import torch

from support.models import make_tiny_llama
from eyas.target.hooks import LayerInputs, capture_states, decoder_stack
from eyas.target.load import target_from_model
from eyas.target.runner import Runner
from eyas.train.data import Batch, target_features

N = 5


def causal(T):
    return torch.ones(T, T, dtype=torch.bool).tril()[None]  # (1,T,T)


def test_runner_capture_equals_hooks_for_every_id():
    model = make_tiny_llama(layers=N, seed=11)
    ids = torch.randint(3, 256, (2, 13), generator=torch.Generator().manual_seed(0))
    base = decoder_stack(model)
    with torch.no_grad(), LayerInputs(base.layers, range(N + 1)) as hooks:   # id N is skipped: not a layer input
        final = base(input_ids=ids, use_cache=False).last_hidden_state       # (B, T, h)
    assert sorted(hooks.states) == list(range(N))
    hooked = {**hooks.states, N: final}

    r = Runner.from_hf(model, max_batch=2, max_seq=16)
    pos = torch.arange(13)[None].expand(2, -1)
    out, ran = r(ids, pos, pos, causal(13).expand(2, -1, -1), capture=tuple(range(N + 1)), logits=False)
    torch.testing.assert_close(out, final, atol=1e-5, rtol=1e-5)
    for i in range(N + 1):
        torch.testing.assert_close(ran[i], hooked[i], atol=1e-5, rtol=1e-5, msg=f"id {i}")
    for i in range(N):  # the comparison tells neighbours apart: an off-by-one would fail above
        assert (ran[i] - hooked[i + 1]).abs().max() > 1e-2, f"ids {i} and {i + 1} look alike"

    # capture_states (the capture stage) gives the same ids, id N being the final state
    got = capture_states(model, (0, 2, N), ids)                              # (B, T, 4, h)
    for slot, i in enumerate((0, 2, N, N)):
        assert torch.equal(got[:, :, slot], hooked[i]), f"slot {slot} (id {i})"


def test_online_features_equal_capture_and_runner_step():
    """Training's target_features == capture_states as the capture stage calls it (no mask for right-padded rows)
    bit for bit on real tokens, zeros on padding; its real tokens equal the padding-masked forward's bit for bit; and
    the runner's verify step (what a drafter sees when decoding) returns the same concatenated aux states."""
    model = make_tiny_llama(layers=N, seed=12)
    aux_ids = (1, 2, 4)
    target = target_from_model(model, aux_layer_ids=aux_ids)
    ids = torch.randint(3, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, 7:] = False
    ids[1, 7:] = 0
    b = target_features(target, Batch(["a", "b"], ids, valid.clone(), valid))
    ref = capture_states(model, aux_ids, ids, None)                          # (B, T, 4, h)
    pad = ~valid[..., None]
    assert torch.equal(b.aux, ref[:, :, :3].flatten(2) * ~pad) and torch.equal(b.final, ref[:, :, 3] * ~pad)
    masked = capture_states(model, aux_ids, ids, valid.long())               # (B, T, 4, h)
    assert torch.equal(b.aux[valid], masked[:, :, :3].flatten(2)[valid]) and torch.equal(b.final[valid],
                                                                                         masked[:, :, 3][valid])

    r = Runner.from_hf(model, max_batch=1, max_seq=16)
    for row, n in ((0, 10), (1, 7)):
        pos = torch.arange(n)[None]
        _, aux = r.step_fn(aux_ids)(ids[row:row + 1, :n], pos, pos, causal(n))  # (1, n, 3h)
        torch.testing.assert_close(aux[0], b.aux[row, :n], atol=1e-5, rtol=1e-5)
