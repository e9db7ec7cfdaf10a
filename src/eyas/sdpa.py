"""Attention backends for inference (decoding, prefill, verification).

cuDNN attention builds an execution plan for every new input shape (about 0.1 s on an H200), and
decoding changes the key length every round: with it the eager tree drafter ran at 14 tok/s on the
H200, without it at 122 (benchmarks/profile_decode.py; BENCHMARKS.md). Training keeps PyTorch's choice.
"""

from torch.nn.attention import SDPBackend

INFERENCE_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
