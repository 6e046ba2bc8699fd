"""What the tracked files say about themselves: no work-organisation words, and files small enough to read.

A measurement is named by its date and commit (docs/benchmarks.md), never by how the work that took it
was organised; a library file past ~300 lines is asking to be split (STYLE: "Files under ~300 lines").
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SESSION = re.compile(rb"sessions?[ _-]?[0-9]+", re.IGNORECASE)
MAX_LINES = 300
# Library files allowed past MAX_LINES, each with the reason it is one idea all the same.
LONG_FILE_EXCEPTIONS: dict[str, str] = {}


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]


def text_of(name: str) -> bytes | None:
    """The file's bytes, or None for a binary file (a NUL byte in its first 8 KiB, as git decides)."""
    data = (ROOT / name).read_bytes()
    return None if b"\0" in data[:8192] else data


def session_mentions(name: str, data: bytes) -> list[str]:
    hits = [f"{name} (its path)"] if SESSION.search(name.encode()) else []
    for number, line in enumerate(data.splitlines(), 1):
        if SESSION.search(line):
            hits.append(f"{name}:{number}: {line.decode(errors='replace').strip()[:100]}")
    return hits


def test_the_session_pattern_finds_what_it_must_and_nothing_else():
    word = "sess" + "ion"  # spelt apart, so that this file does not match itself
    text = f"ok\nmeasured in {word} 12\n{word.title()} 7 (x)\n".encode()
    assert session_mentions("a.md", text) == [f"a.md:2: measured in {word} 12", f"a.md:3: {word.title()} 7 (x)"]
    path = f"bench/results/engine_{word}10.json"
    assert session_mentions(path, b"{}") == [f"{path} (its path)"]
    assert session_mentions("c.py", b"ray_session = 1\n@pytest.fixture(scope='session')\naiohttp session\n") == []


def test_no_tracked_file_names_a_measurement_by_a_session_number():
    hits = [hit for name in tracked_files() if (data := text_of(name)) is not None
            for hit in session_mentions(name, data)]
    assert not hits, "name it by its date and commit instead:\n" + "\n".join(hits)


def library_files() -> list[str]:
    return [name for name in tracked_files() if name.endswith(".py") and not name.startswith("tests/")]


def test_every_library_file_is_at_most_300_lines_or_a_stated_exception():
    lengths = {name: len((ROOT / name).read_text().splitlines()) for name in library_files()}
    too_long = {name: n for name, n in lengths.items() if n > MAX_LINES and name not in LONG_FILE_EXCEPTIONS}
    assert not too_long, f"split these (or state why not in LONG_FILE_EXCEPTIONS): {too_long}"
    stale = [name for name in LONG_FILE_EXCEPTIONS if lengths.get(name, 0) <= MAX_LINES]
    assert not stale, f"no longer long or gone, drop them from LONG_FILE_EXCEPTIONS: {stale}"
