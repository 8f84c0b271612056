"""What the server benchmarks share: the URL a ``python -m llamax serve``
process prints when it is ready, the CPU's name and the commit for their tables."""
from __future__ import annotations

import platform
from pathlib import Path
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


def commit() -> str | None:
    """``git describe --always --dirty`` of the checkout the benchmark ran from (None outside one)."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_name() -> str:
    """The CPU's model name and whether it has AVX-512 (else: AVX2)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return platform.machine()
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip() + (" (AVX-512)" if "avx512f" in text else " (AVX2)")
    return platform.machine()
