"""The train / held-out split: a pure function of the conversation id.

`is_heldout(key)` hashes the key, so the split does not depend on --limit, on the order of
reading, or on which command asks. ShareGPT splits one chat into parts `<id>_0, <id>_1, ...`;
`split_key` maps every part to the same key so that no chat straddles the split.
"""

from __future__ import annotations

import hashlib
import re

_SHAREGPT_PART = re.compile(r"^(?P<base>[A-Za-z0-9]{7})_\d+$")


def is_heldout(conv_id: str, fraction: float = 0.05) -> bool:
    """True when `conv_id` belongs to the held-out split (about `fraction` of all ids)."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"held-out fraction must be in [0, 1), got {fraction}")
    h = int.from_bytes(hashlib.sha256(conv_id.encode("utf-8", "surrogatepass")).digest()[:8], "big")
    return h < fraction * 2**64


def split_key(conv_id: str, *, sharegpt: bool = False) -> str:
    """The key the split hashes: for ShareGPT the id without its `_N` part suffix."""
    if sharegpt:
        m = _SHAREGPT_PART.match(conv_id)
        if m:
            return m.group("base")
    return conv_id
