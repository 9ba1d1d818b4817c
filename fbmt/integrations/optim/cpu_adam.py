"""Python face of the native fused CPU Adam (`fbmt._C`): validates tensors, passes raw pointers."""

from __future__ import annotations

import torch

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NO_OUT = 3
CHECKS = {"none": 0, "report": 1, "skip": 2}
LEVELS = {0: "baseline", 1: "avx2", 2: "avx512"}


def native():
    """The compiled extension, or an ImportError that says how to get it."""
    try:
        from fbmt import _C
    except ImportError as e:
        raise ImportError(
            "fbmt's native extension fbmt._C is not built; reinstall fbmt with a C++ compiler "
            "and pybind11 present (`pip install pybind11 && pip install -e .`)"
        ) from e
    return _C


def _check(t: torch.Tensor, name: str, n: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() != n or t.dtype not in dtypes:
        raise ValueError(
            f"fused_adam_: `{name}` must be a contiguous CPU tensor of {n} elements with dtype in "
            f"{[str(d) for d in dtypes]}; got {t.dtype} {tuple(t.shape)} on {t.device}"
            f"{'' if t.is_contiguous() else ' (not contiguous)'}"
        )


def fused_adam_(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    inv_scale: float = 1.0,
    decoupled: bool = True,
    check: str = "none",
    threads: int = 0,
) -> bool:
    """One Adam(W) step in place over fp32 `master`, `exp_avg`, `exp_avg_sq`, in one pass over memory.

    `grad` is fp32, bf16 or fp16 and is multiplied by `inv_scale` (1 / loss scale) first; `out`, if
    given, receives the updated parameter rounded (to nearest even) to its dtype. `decoupled`: AdamW
    weight decay, else L2 (torch.optim.Adam). `check`: "report" detects inf/nan gradients in the same
    pass (the step is applied regardless); "skip" scans the gradients first and changes nothing if one
    is inf/nan. Returns whether a non-finite gradient was seen. `threads=0`: the process's CPUs.
    """
    n = master.numel()
    for t, name in ((master, "master"), (exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")):
        _check(t, name, n, (torch.float32,))
    _check(grad, "grad", n, tuple(_DTYPE_CODES))
    if out is not None:
        _check(out, "out", n, tuple(_DTYPE_CODES))
    if check not in CHECKS:
        raise ValueError(f"fused_adam_(check={check!r}): expected one of {list(CHECKS)}")
    return native().adam_step(
        master.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        grad.data_ptr(),
        _DTYPE_CODES[grad.dtype],
        0 if out is None else out.data_ptr(),
        NO_OUT if out is None else _DTYPE_CODES[out.dtype],
        n,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        step,
        inv_scale,
        decoupled,
        CHECKS[check],
        threads,
    )


def has_nonfinite(grad: torch.Tensor, threads: int = 0) -> bool:
    _check(grad, "grad", grad.numel(), tuple(_DTYPE_CODES))
    return native().has_nonfinite(grad.data_ptr(), _DTYPE_CODES[grad.dtype], grad.numel(), threads)


def simd_level() -> str:
    return LEVELS[native().simd_level()]


def set_simd_level(level: str) -> str:
    """Force the dispatch level ("baseline", "avx2", "avx512"); returns the previous one."""
    codes = {v: k for k, v in LEVELS.items()}
    if level not in codes:
        raise ValueError(f"set_simd_level({level!r}): expected one of {list(codes)}")
    return LEVELS[native().set_simd_level(codes[level])]


def supported_simd_levels() -> list[str]:
    return [LEVELS[i] for i in range(native().max_simd_level() + 1)]
