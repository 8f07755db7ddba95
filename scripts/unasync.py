#!/usr/bin/env python3
"""Generate the sync face from the asyncio face: ``_async/`` is the one source of truth.

    python scripts/unasync.py           # rewrite every generated file
    python scripts/unasync.py --check   # fail if any generated file is stale (CI)

Each ``_async/*.py`` (except the hand-written ``_primitives.py``) becomes ``_sync/*.py``
through the token substitutions below, then ``ruff format``. A substitution that no
longer matches anything is an error, so the table cannot rot.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = [ROOT / "src" / "dlock" / "_async", ROOT / "tests" / "conformance" / "_async"]
HAND_WRITTEN = {"_primitives.py"}

SUBSTITUTIONS: list[tuple[str, str]] = [
    (r"\basync def\b", "def"),
    (r"\basync with\b", "with"),
    (r"\bawait ", ""),
    (r"\b__aenter__\b", "__enter__"),
    (r"\b__aexit__\b", "__exit__"),
    (r"\baclose\b", "close"),
    (r"\basynccontextmanager\b", "contextmanager"),
    (r"\bAsyncIterator\b", "Iterator"),
    # kazoo's AsyncResult is the synchronous library's own class, not an async twin.
    (r"\bAsync(?!Result\b)([A-Z]\w*)", r"\1"),
    (r"\b_async\b", "_sync"),
    (r"\bdlock\.aio\b", "dlock"),
    (r"\basyncio face\b", "sync face"),
    (r"\bredis\.asyncio\b", "redis"),
    (r"\basync for\b", "for"),
    (r"\baiomysql\b", "pymysql"),
    # httpx's AsyncClient and Client share one API; only the streaming names differ.
    (r"\baiter_lines\b", "iter_lines"),
    (r"\baread\b", "read"),
    # psycopg's wait for a generator on a socket.
    (r"\bwait_async\b", "wait"),
]


def header(source: Path) -> str:
    return f"# DO NOT EDIT: generated from {source.relative_to(ROOT)} by scripts/unasync.py.\n"


def convert(text: str, used: set[str]) -> str:
    for pattern, replacement in SUBSTITUTIONS:
        text, count = re.subn(pattern, replacement, text)
        if count:
            used.add(pattern)
    return text


def ruff(text: str, path: Path, *command: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "--stdin-filename", str(path), "-"],
        input=text,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return result.stdout


def ruff_format(text: str, path: Path) -> str:
    """Renames reorder imports and shorten lines: sort and format like hand-written code."""
    text = ruff(text, path, "check", "--select", "I", "--fix", "--quiet", "--exit-zero")
    return ruff(text, path, "format")


def generated_files(used: set[str]) -> dict[Path, str]:
    out: dict[Path, str] = {}
    for tree in TREES:
        for source in sorted(tree.rglob("*.py")):
            if source.name in HAND_WRITTEN:
                continue
            target = tree.parent / "_sync" / source.relative_to(tree)
            text = header(source) + convert(source.read_text(), used)
            out[target] = ruff_format(text, target)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail on stale generated files")
    args = parser.parse_args()
    used: set[str] = set()
    files = generated_files(used)
    problems = [f"substitution {p!r} matches nothing" for p, _ in SUBSTITUTIONS if p not in used]
    for target, text in files.items():
        current = target.read_text() if target.exists() else None
        if current == text:
            continue
        if args.check:
            problems.append(f"{target.relative_to(ROOT)} is stale: run scripts/unasync.py")
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            print(f"wrote {target.relative_to(ROOT)}")
    for tree in TREES:
        for stray in (tree.parent / "_sync").rglob("*.py"):
            if stray not in files and stray.name not in HAND_WRITTEN:
                problems.append(f"{stray.relative_to(ROOT)} has no _async source")
    for problem in problems:
        print(f"unasync: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
