"""The train / held-out split: a pure function of the conversation id.

`is_heldout(key)` hashes the key, so the split does not depend on --limit, on the order of
reading, or on which command asks. ShareGPT splits one chat into parts `<id>_0, <id>_1, ...`;
prepare writes N sampled replies of one conversation as `<id>#s1 ... <id>#sN`. `split_key` maps
every part and every sample to the same key, so that no chat straddles a split (prepare's
held-out split here, and the training-time eval split of eyas.train.data.is_eval).
"""

from __future__ import annotations

import hashlib
import re

_SHAREGPT_PART = re.compile(r"^(?P<base>[A-Za-z0-9]{7})_\d+$")
_SAMPLE = re.compile(r"^(?P<base>.+)#s\d+$")


def is_heldout(conv_id: str, fraction: float = 0.05) -> bool:
    """True when `conv_id` belongs to the held-out split (about `fraction` of all ids)."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"held-out fraction must be in [0, 1), got {fraction}")
    h = int.from_bytes(hashlib.sha256(conv_id.encode("utf-8", "surrogatepass")).digest()[:8], "big")
    return h < fraction * 2**64


def sample_id(conv_id: str, k: int) -> str:
    """The id of the k-th (1-based) sampled reply set of a conversation."""
    return f"{conv_id}#s{k}"


def sample_number(conv_id: str) -> int | None:
    """K of a sampled reply set's id `<id>#sK`, None for any other id."""
    m = _SAMPLE.match(conv_id)
    return int(conv_id[m.end("base") + 2:]) if m else None


def split_key(conv_id: str, *, sharegpt: bool = False) -> str:
    """The key the split hashes: the id without a `#sK` sample suffix and, for ShareGPT, its `_N` part suffix."""
    m = _SAMPLE.match(conv_id)
    if m:
        conv_id = m.group("base")
    if sharegpt:
        m = _SHAREGPT_PART.match(conv_id)
        if m:
            return m.group("base")
    return conv_id
