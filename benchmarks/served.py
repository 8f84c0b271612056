"""What the server benchmarks share: the URL a ``python -m llamax serve``
process prints when it is ready."""
from __future__ import annotations

import re
import subprocess
import time


def served_url(proc: subprocess.Popen, timeout: float = 180.0) -> str | None:
    """Read the server's stdout until its "serving ... at http://HOST:PORT/v1"
    line; the base URL, or None if it exits or ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            return None
        m = re.search(r"at (http://[\d.]+:\d+)/v1", line)
        if m:
            return m.group(1)
    return None
