"""CUDA-only paths of training's data movement (fp8 batches, the pinned feature cache), proved on the CPU."""

import torch

import eyas.train.data as data
import eyas.train.feature_cache as fc
from eyas.train.data import Batch

G = 10**9


def pow2_ceil(n: int) -> int:
    """What CachingHostAllocator (ATen/core/CachingHostAllocator.h, its default) allocates for an n-byte request."""
    p = 1
    while p < n:
        p *= 2
    return p


def test_an_fp8_batch_crosses_to_the_device_once():
    """Batch.to moves each host tensor of an fp8 store's batch across once (fp8 + scales, then dequantized there):
    the old code copied aux and final a second time, undoing the halved host-to-device bytes."""
    B, T, h = 2, 5, 4
    aux = (torch.randn(B, T, 3 * h) * 3).to(torch.float8_e4m3fn)
    final = (torch.randn(B, T, h) * 3).to(torch.float8_e4m3fn)
    scale = torch.rand(B, T, 4) + 0.5
    b = Batch(["a", "b"], torch.zeros(B, T, dtype=torch.long), torch.ones(B, T, dtype=torch.bool),
              torch.ones(B, T, dtype=torch.bool), aux, final, scale=scale, dtype=torch.bfloat16)
    moved: list[int] = []
    real = data.h2d

    def counting(x, device):
        moved.append(id(x))
        return real(x, device)

    data.h2d = counting
    try:
        out = b.to("cpu")
    finally:
        data.h2d = real
    assert moved.count(id(aux)) == 1 and moved.count(id(final)) == 1 and moved.count(id(scale)) == 1
    want_aux = (aux.float().unflatten(-1, (3, -1)) * scale[..., :3, None]).flatten(-2).to(torch.bfloat16)
    assert out.aux.dtype == out.final.dtype == torch.bfloat16
    assert torch.equal(out.aux, want_aux) and torch.equal(out.final, (final.float() * scale[..., 3:]).bfloat16())


def test_a_pinned_feature_cache_fits_the_host_room_after_the_allocators_rounding():
    """torch's pinned allocator rounds each request up to a power of two, so a pinned cache of 70 GB holds 137 GB
    of page-locked host memory: the plan keeps a pinned part's rounded size within the host room (the old plan
    pinned 70 GB against a 100 GB room, and 8 GB against an 8 GB one) and the device's part within its room."""
    cuda = torch.device("cuda", 0)
    for need, rooms in [(70 * G, (10 * G, 100 * G)), (10 * G, (5 * G, 8 * G)), (10 * G, (1 * G, 8 * G)),
                        (3 * G, (0, 100 * G)), (200 * G, (0, 100 * G))]:
        cache, line = fc.plan("auto", need, cuda, rooms=rooms)
        for part in getattr(cache, "parts", [cache]):
            held = pow2_ceil(part.capacity_bytes) if part.pinned else part.capacity_bytes
            assert held <= (rooms[1] if part.pinned else rooms[0]), (need, rooms, line)
    cache, _ = fc.plan("auto", 3 * G, cuda, rooms=(0, 100 * G))         # fits once rounded: all of it, pinned
    assert cache.pinned and cache.capacity_bytes == 3 * G
    cache, _ = fc.plan("auto", 70 * G, cuda, rooms=(10 * G, 100 * G))   # the device's room, then a pinned part:
    assert [p.capacity_bytes for p in cache.parts] == [10 * G, 60 * G]   # 60 GB take 2^36 bytes of the 100 GB
    cache, _ = fc.plan("auto", 200 * G, cuda, rooms=(0, 100 * G))       # a part: the largest power of two
    assert cache.pinned and cache.capacity_bytes == 1 << 36
