"""Attention backends for inference (decoding, prefill, verification).

cuDNN attention builds an execution plan for every new input shape, and decoding changes the key length
every round, so inference leaves it out (the eager tree drafter with and without it: benchmarks.profile_decode,
BENCHMARKS.md#speculative-round-profile-2026-11-30-1220-utc). Training keeps PyTorch's choice.
"""

from torch.nn.attention import SDPBackend

INFERENCE_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
