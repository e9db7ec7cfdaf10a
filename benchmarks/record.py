"""The one writer of BENCHMARKS.md sections. A tool's measurement becomes a section headed by when (UTC), where
(the machine), which code (the git commit) and how (the exact command), appended to the repository's
BENCHMARKS.md, or to the file its --md names:

    record.add_options(ap)                                   # --md FILE, --no-record
    ...
    record.write(args, "Capture throughput", table, command=record.command_line(__spec__.name))
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"
HEADING = "# Benchmarks\n\nAppend-only; each section says when, where and how it was measured.\n"


def add_options(ap: argparse.ArgumentParser) -> None:
    """--md FILE (append the section there instead of BENCHMARKS.md) and --no-record (print it only)."""
    ap.add_argument("--md", default=None, metavar="FILE", help="append the section to FILE instead of BENCHMARKS.md")
    ap.add_argument("--no-record", action="store_true", help="print the section only, append it nowhere")


def command_line(module: str, argv: list[str] | None = None) -> str:
    """The command that runs this measurement again, from the repository root: `python -m MODULE ARGS`, or under
    torchrun `torchrun --nproc_per_node N -m MODULE ARGS` (N: the launch's WORLD_SIZE). argv: the tool's arguments
    (default: this process's)."""
    args = [shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launch = f"torchrun --nproc_per_node {world}" if world > 1 else "python"
    return " ".join([launch, "-m", module, *args])


def device_name(device=None) -> str:
    """The card's name for a CUDA device (a torch.device or its string; None: CUDA when there is one), else the
    CPU's: processor and cores."""
    import torch

    dev = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def commit() -> str:
    """The short hash of the checkout's HEAD, said to carry uncommitted changes when tracked files differ from it;
    "unknown" where the tools do not run from a git checkout's root (a tree copied to a device machine)."""
    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60)
        if r.returncode:
            raise OSError(r.stderr.strip())
        return r.stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != ROOT:
            return "unknown (not run from a git checkout)"
        changed = git("status", "--porcelain", "--untracked-files=no")
        return git("rev-parse", "--short", "HEAD") + (" with uncommitted changes" if changed else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (not run from a git checkout)"


def section(title: str, body: str, *, command: str, machine: str | None = None, details: Iterable[str] = (),
            measured_here: bool = True) -> str:
    """A section: `## TITLE — YYYY-MM-DD HH:MM UTC`, a list of the machine (default: device_name()) with this
    process's torch version (measured_here=False, for tables of results measured elsewhere: the machine alone), the
    commit, the command and each of `details`, then BODY (markdown: tables and notes)."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    where = machine or device_name()
    if measured_here:
        import torch

        where += f"; torch {torch.__version__}"
    head = [f"- machine: {where}", f"- commit: {commit()}", f"- command: `{command}`", *(f"- {d}" for d in details)]
    return f"## {title} — {now}\n\n" + "\n".join(head) + f"\n\n{body.strip()}\n"


def append(text: str, md: str | Path | None = None) -> Path:
    """Append a section to MD (default: BENCHMARKS.md at the repository root, begun with its heading if new)."""
    path = Path(md) if md else BENCHMARKS
    with open(path, "a") as f:
        if f.tell() == 0 and path == BENCHMARKS:
            f.write(HEADING)
        f.write("\n" + text)
    return path


def write(args: argparse.Namespace, title: str, body: str, *, command: str, machine: str | None = None,
          details: Iterable[str] = (), measured_here: bool = True) -> str:
    """The section of this run (`section`), appended where add_options' flags say (nowhere with --no-record);
    returns its text."""
    text = section(title, body, command=command, machine=machine, details=details, measured_here=measured_here)
    if not args.no_record:
        append(text, args.md)
    return text
