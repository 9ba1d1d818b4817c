"""Every environment variable fbmt reads, with what it does, read in this one place.

`python -m fbmt.flags` prints them with their current values. Each is read when it is used (the
copy tiles are read once per process, when the first copy kernel launches), so a test or a
benchmark can set one for a part of a run.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Flag(Generic[T]):
    name: str
    parse: Callable[[str], T]
    default: T
    help: str

    def get(self) -> T:
        """The variable's value, or the default where it is unset or empty."""
        raw = os.environ.get(self.name, "")
        if raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"${self.name}={raw!r}: {e} ({self.help})") from None


def _bool(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError("expected 0 or 1")
    return raw == "1"


def _power_of_two(raw: str) -> int:
    v = int(raw)
    if v < 1 or v & (v - 1):
        raise ValueError("expected a power of two")
    return v


def _count(raw: str) -> int:
    v = int(raw)
    if v < 0:
        raise ValueError("expected a count of 0 or more")
    return v


CHECKS = Flag(
    "FBMT_CHECKS",
    _bool,
    False,
    "1: fbmt.compile verifies the program after every pass (the default of compile(checks=...))",
)
DUMP_DIR = Flag(
    "FBMT_DUMP_DIR",
    str,
    "",
    "a folder: fbmt.compile writes the program after every pass there, for diff (compile(dump_dir=...))",
)
MACHINE = Flag(
    "FBMT_MACHINE",
    str,
    "",
    "a file: where fbmt.calibrate() saves this machine's profile and fbmt.simulate reads it "
    "(default ~/.cache/fbmt/machine-<host>.json)",
)
INIT_TIMEOUT = Flag(
    "FBMT_INIT_TIMEOUT",
    float,
    300.0,
    "seconds init_distributed waits for the other ranks (init_distributed(timeout=...))",
)
TIMEOUT = Flag(
    "FBMT_TIMEOUT",
    float,
    600.0,
    "seconds a rank waits for the others in a collective once the job has started; a rank that stalls "
    "longer is reported by rank (init_distributed(collective_timeout=...))",
)
NARROW_WIRE: Flag[bool | None] = Flag(
    "FBMT_NARROW_WIRE",
    _bool,
    None,
    "1/0: bf16 gradients reduced in fp32 travel as bf16 everywhere / never (compile(narrow_wire=...); "
    "default: within one node)",
)
COPY_PROGRAMS: Flag[int | None] = Flag(
    "FBMT_COPY_PROGRAMS",
    _count,
    None,
    "thread blocks of the copy stream's kernels (default: a quarter of the SMs; 0: torch's copy)",
)
COPY_BLOCK = Flag("FBMT_COPY_BLOCK", _power_of_two, 65536, "elements per thread block and iteration of the copy kernel")
COPY_WARPS = Flag("FBMT_COPY_WARPS", _power_of_two, 32, "warps per thread block of the copy kernel")
SUM_BLOCK = Flag(
    "FBMT_SUM_BLOCK",
    _power_of_two,
    32768,
    "elements per thread block and iteration of the fp32 sum of two ranks' gradients",
)
SUM_WARPS = Flag("FBMT_SUM_WARPS", _power_of_two, 16, "warps per thread block of that sum kernel")

FLAGS = (
    CHECKS,
    DUMP_DIR,
    INIT_TIMEOUT,
    TIMEOUT,
    NARROW_WIRE,
    COPY_PROGRAMS,
    COPY_BLOCK,
    COPY_WARPS,
    SUM_BLOCK,
    SUM_WARPS,
)


if __name__ == "__main__":
    for flag in FLAGS:
        value = os.environ.get(flag.name)
        print(f"{flag.name:20s} {'(unset)' if value is None else repr(value):10s} {flag.help}")
