"""Tiny random EAGLE-3 drafters the test modules share."""

import torch

from eyas.model.drafter import DrafterConfig, Eagle3Drafter


def eagle3_for_model(model, seed=0, draft_vocab=None, aux=(1, 2, 3)):
    """An untrained EAGLE-3 drafter (default init, eval) for a HF model; draft_vocab < V: a random sorted subset
    of the target ids."""
    torch.manual_seed(seed)
    V = model.config.vocab_size
    cfg = DrafterConfig.from_target(model.config, draft_vocab_size=draft_vocab or V, aux_layer_ids=aux)
    d = Eagle3Drafter(cfg).eval()
    if draft_vocab and draft_vocab < V:
        ids = torch.randperm(V)[:draft_vocab].sort().values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        d.set_vocab(ids - torch.arange(draft_vocab), t2d)
    return d


def eagle3_for_target(target, *, draft_vocab=100, seed=1):
    """An untrained EAGLE-3 drafter for an eyas Target (its aux layers), a random sorted draft vocabulary and
    norms drawn in [0.5, 1.5]."""
    cfg = DrafterConfig.from_target(target.config, draft_vocab_size=draft_vocab, aux_layer_ids=target.aux_layer_ids)
    torch.manual_seed(seed)
    d = Eagle3Drafter(cfg)
    tok = torch.sort(torch.randperm(cfg.vocab_size)[:draft_vocab]).values   # ascending target ids
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[tok] = True
    d.set_vocab(tok - torch.arange(draft_vocab), t2d)
    with torch.no_grad():   # non-trivial norms so a swapped norm would show
        for n, p in d.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return d
