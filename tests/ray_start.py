"""Start Ray for a test module, retrying when a loaded machine makes node start-up time out.

Ray waits a fixed 30 s for its raylet to register; on a busy 2-core machine
that can lapse although nothing is wrong. A failed start is shut down and
retried, so the tests measure the project, not the machine's load.
"""

from __future__ import annotations

import time

import ray


def start_ray(attempts: int = 3, **kwargs) -> None:
    kwargs.setdefault("include_dashboard", False)
    kwargs.setdefault("log_to_driver", False)
    for attempt in range(1, attempts + 1):
        try:
            ray.init(**kwargs)
            return
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception here
            ray.shutdown()
            if "timed out during startup" not in str(exc) or attempt == attempts:
                raise
            time.sleep(2)
