"""Links into BENCHMARKS.md resolve: every `BENCHMARKS.md#anchor` in the code, the benchmarks, the docs and the
README names a heading that exists and whose title no other heading repeats (GitHub's anchors: lowercase, the
punctuation dropped, spaces as hyphens), and the code's comments point to a section by such an anchor rather than
by a title in prose."""

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"BENCHMARKS\.md#([\w-]+)")


def anchor(title: str) -> str:
    """GitHub's anchor of a heading: markup and punctuation dropped, lowercase, each space a hyphen."""
    text = re.sub(r"[`*\[\]]", "", title.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(md: str) -> Counter:
    out, fenced = Counter(), False
    for line in md.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            out[anchor(m.group(1))] += 1
    return out


def sources(*globs: str) -> list[Path]:
    return sorted(p for g in globs for p in ROOT.glob(g) if p.is_file())


def test_the_anchor_rule_on_the_headings_it_meets():
    assert anchor("eyas run (gpu preset), 2026-11-30 11:13 UTC") == "eyas-run-gpu-preset-2026-11-30-1113-utc"
    assert anchor("Live engines: SGLang 0.5.14 — 2026-12-01 18:19 UTC") == "live-engines-sglang-0514--2026-12-01-1819-utc"
    assert anchor("Kernels per decode step and round (`kernels.py --compile`, ba63339)") == \
        "kernels-per-decode-step-and-round-kernelspy---compile-ba63339"
    assert anchor("with norm_before_fc, regeneration") == "with-norm_before_fc-regeneration"
    assert headings("# A\n```\n# not a heading\n```\n## A\n") == Counter({"a": 2})


def test_every_link_into_benchmarks_names_one_unique_heading():
    known = headings((ROOT / "BENCHMARKS.md").read_text())
    bad = []
    for path in sources("src/**/*.py", "src/**/*.toml", "benchmarks/**/*.py", "benchmarks/**/*.sh", "docs/*.md",
                        "README.md", "tests/*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for a in ([] if path.name == Path(__file__).name else LINK.findall(line)):
                if known[a] != 1:
                    bad.append(f"{path.relative_to(ROOT)}:{n}: #{a} " + ("names no heading" if not known[a] else
                                                                         f"names {known[a]} headings"))
    assert not bad, "\n".join(bad)


def test_the_code_points_to_sections_by_anchor():
    """A comment or docstring in src/ that cites BENCHMARKS.md gives the section's anchor, so a reader can follow it."""
    bare = [f"{p.relative_to(ROOT)}:{n}" for p in sources("src/**/*.py", "src/**/*.toml")
            for n, line in enumerate(p.read_text().splitlines(), 1)
            if "BENCHMARKS.md" in line and not LINK.search(line)]
    assert not bare, "cite a section as BENCHMARKS.md#anchor: " + ", ".join(bare)
