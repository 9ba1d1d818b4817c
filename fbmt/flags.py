"""Every environment variable fbmt reads, with what it does, read in this one place.

`python -m fbmt.flags` prints them with their current values: fbmt's own (`FLAGS`), and those the
launcher (torchrun) or other tools set, which fbmt reads too (`LAUNCHER`, `OTHERS`). Each is read when
it is used (the copy tiles are read once per process, when the first copy kernel launches), so a test
or a benchmark can set one for a part of a run. No other module of fbmt reads `os.environ`
(tests/test_layers.py checks it).
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
    "a file: where fbmt.calibrate() saves this machine's profile and fbmt.simulate reads it by default "
    "(default ~/.cache/fbmt/machine-<host>-<ranks>.json); never what fbmt.compile(remat='auto') prices with",
)


def _level(raw: str) -> str:
    if raw.lower() not in ("debug", "info", "warning", "error"):
        raise ValueError("expected debug, info, warning or error")
    return raw.lower()


LOG = Flag(
    "FBMT_LOG",
    _level,
    "",
    "info/debug: print what fbmt does to stderr, each line with its rank: every compile stage, pass and "
    "Inductor region with its seconds, and why a new program is built (fbmt.logs.show)",
)
CACHE_DIR = Flag(
    "FBMT_CACHE_DIR",
    str,
    "",
    "a folder: where fbmt.compile keeps compiled programs between runs (default ~/.cache/fbmt/compile); "
    "off: no compile cache (compile(cache_dir=...))",
)
STAMP = Flag(
    "FBMT_STAMP",
    _bool,
    True,
    "0: trace every block call, never each kind of block once (NOTE: [Stamped blocks] in fbmt/compiler/stamp.py)",
)
COMPILE_WORKERS: Flag[int | None] = Flag(
    "FBMT_COMPILE_WORKERS",
    _count,
    None,
    "worker processes per rank that compile Inductor's regions while the first steps run them as traced "
    "(compile(background_compile=...)); default: a quarter of the rank's cores, 1 to 4; 0: none, every "
    "region compiles in the rank's own process before its first run",
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
STALL_WARNING = Flag(
    "FBMT_STALL_WARNING",
    float,
    30.0,
    "seconds a rank waits at the per-call rank agreement before it names the ranks it waits for (it waits "
    "on until FBMT_TIMEOUT)",
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

# What the launcher sets (torchrun, or the tests' spawner); fbmt reads them to join the job.
RANK: Flag[int | None] = Flag("RANK", int, None, "this process's rank in the job (torchrun)")
WORLD_SIZE: Flag[int | None] = Flag("WORLD_SIZE", int, None, "the number of ranks in the job (torchrun)")
LOCAL_RANK: Flag[int | None] = Flag("LOCAL_RANK", int, None, "this process's rank on its machine (torchrun)")
LOCAL_WORLD_SIZE: Flag[int | None] = Flag("LOCAL_WORLD_SIZE", int, None, "ranks on this machine (torchrun)")
MASTER_ADDR = Flag("MASTER_ADDR", str, "", "the host of the job's store (torchrun)")
MASTER_PORT: Flag[int | None] = Flag("MASTER_PORT", int, None, "the port of the job's store (torchrun)")
AGENT_STORE = Flag(
    "TORCHELASTIC_USE_AGENT_STORE", str, "", "'True': torchrun's agent hosts the store (torchrun --rdzv-backend)"
)
RESTART_COUNT = Flag("TORCHELASTIC_RESTART_COUNT", int, 0, "how many times torchrun restarted the job's ranks")
# Read for other libraries' sake.
OMP_NUM_THREADS: Flag[int | None] = Flag(
    "OMP_NUM_THREADS", int, None, "threads per CPU rank; the main job sets it for the ranks it launches"
)
PYTHONPATH = Flag("PYTHONPATH", str, "", "Python's module path; fbmt's compile workers get fbmt's folder before it")
XDG_CACHE_HOME = Flag(
    "XDG_CACHE_HOME", str, "", "the user's cache folder; fbmt's compile cache goes in its fbmt/compile"
)
MPLBACKEND = Flag("MPLBACKEND", str, "", "matplotlib's backend; fbmt.viz picks a headless one where it is unset")

FLAGS = (
    CHECKS,
    DUMP_DIR,
    LOG,
    CACHE_DIR,
    STAMP,
    COMPILE_WORKERS,
    MACHINE,
    INIT_TIMEOUT,
    TIMEOUT,
    STALL_WARNING,
    NARROW_WIRE,
    COPY_PROGRAMS,
    COPY_BLOCK,
    COPY_WARPS,
    SUM_BLOCK,
    SUM_WARPS,
)


LAUNCHER = (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, AGENT_STORE, RESTART_COUNT)
OTHERS = (OMP_NUM_THREADS, MPLBACKEND, XDG_CACHE_HOME, PYTHONPATH)


def is_set(flag: Flag) -> bool:
    """Whether the variable is set to something (an empty value counts as unset)."""
    return os.environ.get(flag.name, "") != ""


if __name__ == "__main__":
    for flag in FLAGS + LAUNCHER + OTHERS:
        value = os.environ.get(flag.name)
        print(f"{flag.name:20s} {'(unset)' if value is None else repr(value):10s} {flag.help}")
