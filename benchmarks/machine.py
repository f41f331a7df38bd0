"""What machine a benchmark ran on, for the line every benchmark prints beside its numbers."""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
