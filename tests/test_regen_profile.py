"""benchmarks.regen --profile on the CPU with a tiny target: the decode-step section has every field, its times
are consistent with each other, its byte counts equal a hand computation from the target's shapes, and it counts the
loop's one compaction check (a nonzero) per 16 steps."""

import re

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")

# benchmarks.regen's tiny_shaped: 3 layers, h 64, MLP 128, 4 heads and 2 kv heads of 16, vocab 512; fp32 here.
LAYERS, H, INTER, HEADS, KV, D, V, F32 = 3, 64, 128, 4, 2, 16, 512, 4
BATCH, SKIP, STEPS = 6, 4, 8


def _num(s: str) -> float:
    return float(s.replace(",", "").rstrip("%"))


@pytest.fixture(scope="module")
def section(one_thread):
    import io
    from contextlib import redirect_stdout

    from benchmarks import regen

    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = regen.main(["--device", "cpu", "--dtype", "fp32", "--shape", "tiny", "--prompts", "12", "--batch",
                         str(BATCH), "--max-new", "40", "--max-seq", "160", "--prompt-len", "10,60", "--eos", "4",
                         "--modes", "", "--profile", "--profile-skip", str(SKIP), "--profile-steps", str(STEPS),
                         "--no-record"])
    assert rc == 0
    text = buf.getvalue()
    return text[text.index("### Decode step profile"):]


def _rows(text: str) -> dict[str, list[str]]:
    """First cell -> the other cells, for every table row."""
    out = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            out[cells[0]] = cells[1:]
    return out


def test_fields_and_times_are_consistent(section):
    t = _rows(section)
    wall, wall_p = _num(t["wall ms (timed window)"][0]), _num(t["wall ms (profiled window)"][0])
    fwd = _num(t["forward ms (timed window, timer around the step's call)"][0])
    busy = _num(t["device busy ms (sum of aten ops)"][0])
    assert 0 < fwd <= wall and 0 < busy <= wall_p
    assert _num(t["device idle share (host bound)"][0]) == pytest.approx(100 * (1 - busy / wall_p), abs=0.15)
    assert _num(t["aten ops"][0]) > LAYERS * 4  # at least the projections of every layer
    groups = {g: _num(t[g][0]) for g in ("attention", "matmul", "elementwise+other")}
    assert sum(groups.values()) == pytest.approx(busy, abs=0.004)
    assert groups["matmul"] > 0 and groups["attention"] > 0  # eager decode attention: bmm + softmax
    assert t["`aten::mm`"][0] == "matmul"
    # The window holds steps 12..19 of the first chunk: one compaction check (t % 16 == 15), whose nonzero waits.
    assert t["aten::item / aten::nonzero"][0].split(" / ")[1] == f"{1 / STEPS:.3f}"
    tok_s = _num(t["measured tok/s (rows / timed wall; finished rows still computed count)"][0])
    assert tok_s == pytest.approx(BATCH / wall * 1e3, rel=0.01)


def test_bytes_equal_a_hand_computation(section):
    m = re.search(r"; (\d+) rows per step over ([\d.]+) cache slots", section)
    rows, slots = int(m.group(1)), float(m.group(2))
    assert rows == BATCH  # no row finished early enough to compact inside the window
    # Eager decoding attends the T + t + 1 slots in use: over 16 consecutive steps the mean ends in .5.
    assert slots % 1 == 0.5
    layer = ((HEADS + 2 * KV) * D * H + H * HEADS * D + 2 * INTER * H + INTER * H + 2 * H) * F32
    weights = LAYERS * layer + H * F32 + V * H * F32 + rows * H * F32  # layers, final norm, head, embedding rows
    kv = rows * LAYERS * 2 * KV * slots * D * F32
    logits = 2 * rows * V * F32
    t = _rows(section)
    got = {k: int(t[k][0].replace(",", "")) for k in t if k.startswith(("weights", "K/V", "logits", "total"))}
    assert got[f"weights (incl. {rows} embedding rows)"] == weights
    assert got[f"K/V window: {rows} rows x {slots:g} slots"] == kv
    assert got["logits: written, read once by sampling"] == logits
    assert got["total"] == weights + kv + logits
    bw = float(re.search(r"Copy bandwidth ([\d,.]+) GB/s", section).group(1).replace(",", "")) * 1e9
    bound = float(re.search(r"\*\*([\d,]+) tok/s bandwidth-bound", section).group(1).replace(",", ""))
    assert bound == pytest.approx(rows / ((weights + kv + logits) / bw), rel=0.01)
