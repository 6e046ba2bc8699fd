"""engine.native.clear_stale_lock: a lock that a killed build left behind is removed before the build
(torch's builder would wait on it for ever); a fresh one, or one whose build is still running (a process
working in the build folder, as torch's ninja does), is left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from engine.native import clear_stale_lock


def make_lock(folder, age_s: float) -> str:
    lock = folder / "lock"
    lock.write_bytes(b"")
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return str(lock)


def test_an_old_lock_with_no_build_running_is_removed(tmp_path):
    lock = make_lock(tmp_path, age_s=120)
    assert clear_stale_lock(str(tmp_path), min_age_s=60) and not os.path.exists(lock)
    assert not clear_stale_lock(str(tmp_path), min_age_s=60)  # nothing left to remove


def test_a_fresh_lock_is_left_alone(tmp_path):
    lock = make_lock(tmp_path, age_s=5)
    assert not clear_stale_lock(str(tmp_path), min_age_s=60) and os.path.exists(lock)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the build's process through /proc")
def test_an_old_lock_whose_build_still_runs_is_left_alone(tmp_path):
    lock = make_lock(tmp_path, age_s=120)
    build = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=str(tmp_path))
    try:
        assert not clear_stale_lock(str(tmp_path), min_age_s=60) and os.path.exists(lock)
    finally:
        build.kill()
        build.wait()
    assert clear_stale_lock(str(tmp_path), min_age_s=60) and not os.path.exists(lock)
