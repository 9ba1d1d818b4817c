"""Guards on torch's own entry points around a compiled model, installed by `fbmt.compile` (two at import).

A compiled model's parameters are this rank's flat shards, and the module it took over holds `meta`
placeholders. These habits of training scripts would then go wrong without an error; each is
caught here, on torch's documented hooks where torch has one:

- an optimizer built on the model *before* compiling holds parameters nothing reads any more: one of
  torch's steps the shards instead from its first step, `zero_grad`, `load_state_dict` or `unscale_` on
  (NOTE: [Optimizers built before compiling] in adopt.py); an optimizer step pre-hook
  (`register_optimizer_step_pre_hook`) refuses another such optimizer at its first step, naming the
  parameter, refuses a weight-decay split (by name or by dimension) that cannot see inside flat shards,
  an optimizer whose update reads a parameter's shape (NOTE: [Optimizers of flat shards]), and a state
  loaded from another rank's optimizer (NOTE: [Another rank's optimizer state]);
- `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` would clip each rank's shard by that
  shard's own norm, and `torch.nn.utils.get_total_norm` would give it (NOTE: [Global gradient norms]);
- `torch.amp.GradScaler` would look for inf/nan in this rank's shards alone, so one rank skipped an
  overflowed step while the others took it (NOTE: [Overflow found on any rank]);
- DDP or FSDP around the compiled model would broadcast over the shards and reduce reduced
  gradients: `NoDataParallel`, a base of the class `fbmt.compile` returns, refuses DDP when it is
  constructed (the shards' check refuses FSDP's replaced parameters at the next call).

`install(leaves)` puts the process-wide hooks in place (once per process) and registers the
tensors whose gradients are sharded; the BMTrain layer installs them for its views too.
`install_at_import()` (when fbmt is imported) wraps `load_state_dict`, `zero_grad` and `state_dict` before
any model is compiled: a state saved from shards (which says so, from before the first step on) may be
loaded into a plain model's optimizer first (nanoGPT's resume), and waits for them (NOTE: [Optimizers
built before compiling]).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fbmt.compiler import group_of, moved_name, replaced, unreduced
from fbmt.integrations import decay
from fbmt.integrations.adopt import (
    forget_kept,
    keep_for_shards,
    shards_for_parameters,
    still_waiting,
    torch_elementwise,
)

log = logging.getLogger("fbmt")
_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> (parameters, replaced()) checked
_hook: Any = None  # the optimizer step pre-hook's handle, once installed
_waiting_hook: Any = None  # the one installed at import


def install_at_import() -> None:
    """What must be in place before any model is compiled: an optimizer's state saved from shards may be
    loaded before `fbmt.compile` (nanoGPT's resume), and must then wait for them."""
    global _waiting_hook
    _shards_before_zero_grad_and_load()
    if _waiting_hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _waiting_hook = register_optimizer_step_pre_hook(_refuse_a_step_without_its_state)


def _refuse_a_step_without_its_state(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not still_waiting(optimizer):  # every optimizer's every step: nothing more unless it waits
        return
    shards_for_parameters(optimizer)  # loads the state it keeps, where its groups hold the shards now
    if still_waiting(optimizer):
        raise RuntimeError(
            f"fbmt: this {type(optimizer).__name__} was given a state saved from a compiled model's optimizer "
            "(of its flat shards), but the parameters it holds were never compiled, so it would step without "
            "that state: fbmt.compile the model it was built on before its first step"
        )


def install(leaves: list[torch.Tensor]) -> None:
    """The optimizer check and the global gradient norm, for a compiled model whose gradients
    accumulate into `leaves` (its flat shards, or BMTrain's views of them)."""
    global _hook
    if _hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _hook = register_optimizer_step_pre_hook(_before_step)
    _global_gradient_norms(leaves)
    _overflow_on_any_rank()
    _shards_before_zero_grad_and_load()


class NoDataParallel:
    """A base of the compiled model's class: DDP reads this property first thing in its constructor."""

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> Any:
        # DistributedDataParallel reads this first thing in its constructor: before its start-up
        # broadcast would overwrite every rank's shards with rank 0's, and its all-reduce would sum
        # gradients that fbmt has already reduced.
        raise RuntimeError(
            "fbmt: torch.nn.parallel.DistributedDataParallel wraps a model fbmt.compile already distributes "
            "(each rank holds its own shard of every parameter, and the compiled backward reduces the "
            "gradients); its start-up broadcast would overwrite the shards. Use the compiled model as it is "
            "(with HF Trainer/accelerate, do not let it wrap the model in DDP)"
        )


_installed: dict[str, Any] = {}  # Optimizer's methods fbmt wrapped, by name


def _shards_before_zero_grad_and_load() -> None:
    """An optimizer built before compiling holds the shards from its first `zero_grad` or `load_state_dict`
    on, as from its first step (NOTE: [Optimizers built before compiling]): a backward run before its
    first step and zeroed would otherwise be added to the first step's gradients, and a state saved from
    the shards (Trainer's or accelerate's resume, before any step) would not fit its groups. A state that
    fits the groups as they are (the model's own parameters') loads first and moves with them. torch has
    no hook on zero_grad, nor one that could change the groups before a load. `state_dict` says whose a
    state of shards is from the optimizer's making on (NOTE: [Another rank's optimizer state]), not from
    its first step, where a per-optimizer hook would first be registered."""
    optimizer = torch.optim.Optimizer
    if optimizer.zero_grad is not _installed.get("zero_grad"):
        torch_zero_grad = optimizer.zero_grad

        @functools.wraps(torch_zero_grad)
        def zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
            shards_for_parameters(self)
            return torch_zero_grad(self, set_to_none)

        _installed["zero_grad"] = optimizer.zero_grad = zero_grad
    if optimizer.load_state_dict is not _installed.get("load_state_dict"):
        torch_load = optimizer.load_state_dict

        @functools.wraps(torch_load)
        def load_state_dict(self: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
            saved = state_dict.get("param_groups", [])
            sizes = [len(g["params"]) for g in saved]
            if sizes != [len(g["params"]) for g in self.param_groups]:
                shards_for_parameters(self)
            from_shards = any(SHARDS_KEY in g for g in saved)
            if (
                from_shards
                and sizes != [len(g["params"]) for g in self.param_groups]
                and keep_for_shards(self, state_dict)
            ):
                return None  # loaded when the optimizer holds the shards (NOTE: [Optimizers built before compiling])
            forget_kept(self)
            return torch_load(self, state_dict)

        _installed["load_state_dict"] = optimizer.load_state_dict = load_state_dict
    if optimizer.state_dict is not _installed.get("state_dict"):
        torch_state_dict = optimizer.state_dict

        @functools.wraps(torch_state_dict)
        def state_dict(self: torch.optim.Optimizer) -> dict[str, Any]:
            return _say_whose(self, torch_state_dict(self))  # NOTE: [Another rank's optimizer state]

        _installed["state_dict"] = optimizer.state_dict = state_dict


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    shards_for_parameters(optimizer)  # NOTE: [Optimizers built before compiling]
    _check_optimizer(optimizer)
    decay.before_step(optimizer, kwargs)  # NOTE: [Decay split inside flat shards]


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer that holds a parameter compile took over fails at its first step (it would update
    a tensor nothing reads any more, and the model would silently not train)."""
    why = unreduced([p for g in optimizer.param_groups for p in g["params"]])
    if why is not None:  # NOTE: [Accumulation without sync]
        raise RuntimeError(
            f"fbmt: {type(optimizer).__name__}.step() would read gradients that were never reduced over ranks: {why}. "
            "Run the last micro-batch's backward with sync on (outside no_sync()), as DDP and FSDP require, then step"
        )
    if any(SHARDS_KEY in g for g in optimizer.param_groups):  # a state dict was loaded since the last step
        _refuse_another_ranks_state(optimizer)
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    if _checked.get(optimizer) == (count, replaced()):  # checked, and no parameter added or replaced since
        return
    for g in optimizer.param_groups:
        for p in g["params"]:
            name = moved_name(p)
            if name is not None:
                raise RuntimeError(
                    f"fbmt: this {type(optimizer).__name__} holds parameter '{name}' of a module that "
                    "fbmt.compile took over; its values now live in the compiled model's flat shards, so "
                    "this optimizer would never change the model (fbmt moves torch's own optimizers, built "
                    "before compiling, onto the shards, but not this class). Build the optimizer after "
                    "compiling, on the compiled model: torch.optim.AdamW(model.parameters())"
                )
    _refuse_a_decay_split_that_cannot_see_into_shards(optimizer)
    _refuse_an_update_that_reads_shapes(optimizer)
    _checked[optimizer] = (count, replaced())


# NOTE: [Another rank's optimizer state]
# Each rank's optimizer holds the state of its own flat shards (Adam's moments of its part of every
# parameter). A script written for DDP saves the optimizer on rank 0 alone (`if rank == 0:
# torch.save(opt.state_dict(), path)`, as HF's Trainer does) and every rank loads that file: rank 1
# then stepped with rank 0's moments, which have the same size, silently. So the state dict of an
# optimizer of shards says whose it is: a key of each parameter group holding shards, `fbmt_shards`
# = (rank, world size), added by `state_dict` (wrapped when fbmt is imported, so that a state saved before
# the first step says it too, and loads before compile: NOTE: [Optimizers built before compiling]); torch's
# `load_state_dict` keeps a saved group's keys, and at the first step after a load the key is checked
# (and dropped): another rank's or another world size's state is refused, saying how to save every
# rank's. fbmt's own checkpoints (fbmt.checkpoint, OptimManager's gathered state) are keyed by
# parameter, not by rank, and leave the key out.
SHARDS_KEY = "fbmt_shards"


def _whose() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _holds_shards(group: dict[str, Any], shards: set[int]) -> bool:
    return any(id(p) in shards for p in group["params"])


def _refuse_another_ranks_state(optimizer: torch.optim.Optimizer) -> None:
    """A state loaded from another rank's (or another world size's) optimizer is refused (NOTE:
    [Another rank's optimizer state])."""
    shards = _shard_ids()
    me = _whose()
    for group in optimizer.param_groups:
        saved = group.pop(SHARDS_KEY, None)
        if saved is not None and tuple(saved) != me and _holds_shards(group, shards):
            raise RuntimeError(
                f"fbmt: this {type(optimizer).__name__}'s state was saved by rank {saved[0]} of {saved[1]} and "
                f"loaded on rank {me[0]} of {me[1]}: each rank's optimizer holds the state of its own flat shards, "
                "so it would step with another rank's moments. Save every rank's state and load each its own "
                "(torch.save(opt.state_dict(), f'optim.{rank}.pt')), or use fbmt.checkpoint.save/load, which "
                "resume on any number of ranks"
            )


def unmarked(state_dict: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's `state_dict` without the key that says whose it is: for a state that serves every
    rank (gathered, or keyed by parameter name)."""
    groups = [{k: v for k, v in g.items() if k != SHARDS_KEY} for g in state_dict["param_groups"]]
    return {**state_dict, "param_groups": groups}


def _say_whose(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    shards = _shard_ids()
    if not shards:  # no model compiled in this process
        return state_dict
    for saved, group in zip(state_dict["param_groups"], optimizer.param_groups):
        if _holds_shards(group, shards):
            saved[SHARDS_KEY] = _whose()
    return state_dict


# NOTE: [Optimizers of flat shards]
# A compiled model's optimizer steps its flat shards: 1-D slices of many parameters laid end to end.
# An optimizer that updates each element from its own gradient and state (SGD, Adam, AdamW, Lion, and
# the rest of torch.optim but Adafactor and LBFGS) computes there what it computes on the model. One
# that reads a parameter's shape or a norm over it does not: Adafactor factors a matrix's second moment
# into row and column statistics and scales its step by the parameter's RMS, LAMB and LARS by its
# norm, Muon and Shampoo precondition the matrix. On a shard each computes another update, silently.
# So those, known by name anywhere in the optimizer's class hierarchy (torch's, Hugging Face's, apex's,
# timm's), are refused at the first step, and an optimizer fbmt does not know is warned about once,
# naming what it assumes.
_READS_SHAPES = frozenset(
    ("Adafactor", "LBFGS", "Lamb", "LAMB", "FusedLAMB", "Lars", "LARS", "LARC", "Muon", "Shampoo", "SOAP", "SM3")
    + ("NovoGrad", "FusedNovoGrad", "GaLoreAdamW", "GaLoreAdamW8bit", "GaLoreAdafactor")
)
_warned_unknown: set[str] = set()


def _refuse_an_update_that_reads_shapes(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer of a compiled model's shards whose update reads a parameter's shape or norm is refused;
    one fbmt does not know is warned about once (NOTE: [Optimizers of flat shards])."""
    shards = _shard_ids()
    if not any(id(p) in shards for g in optimizer.param_groups for p in g["params"]):
        return
    mro = type(optimizer).__mro__
    name = type(optimizer).__name__
    shaped = next((c.__name__ for c in mro if c.__name__ in _READS_SHAPES), None)
    if shaped is not None:
        kind = f" (an {shaped})" if shaped != name else ""
        raise RuntimeError(
            f"fbmt: {name}{kind} reads each parameter's shape or norm, but the optimizer of a compiled model "
            "steps its flat shards (1-D slices of many parameters), where it would compute another update than "
            "on the model. Use an optimizer that updates each element from its own gradient and state "
            "(torch.optim.AdamW, SGD, Adam; Lion), or with HF Trainer optim='adamw_torch'"
        )
    fbmt_own = any(c.__module__.startswith("fbmt.") for c in mro)
    if fbmt_own or torch_elementwise(optimizer) or name == "Lion" or name in _warned_unknown:
        return
    _warned_unknown.add(name)
    log.warning(
        "fbmt: %s steps the compiled model's flat shards (1-D slices of many parameters): right if it updates "
        "each element from its own gradient and state, as Adam and SGD do; if it reads a parameter's shape or a "
        "norm over it (factored moments, trust ratios, matrix preconditioners) it computes another update than "
        "on the model (NOTE: [Optimizers of flat shards])",
        name,
    )


def _refuse_a_decay_split_that_cannot_see_into_shards(optimizer: torch.optim.Optimizer) -> None:
    """HF Trainer (and scripts written like it) split parameters by name into a decayed group and a
    weight_decay=0 group for biases and norm weights. On a compiled model the names are the flat
    shards', so the second group comes out empty and biases and norms decay: unlike eager, silently.
    nanoGPT's `configure_optimizers` (and scripts written like it) split by `p.dim() >= 2`, and every
    flat shard is 1-D: the decayed group comes out empty and nothing decays, silently too. Trainer's own
    split is kept inside the shards (NOTE: [Decay split inside flat shards]): not refused."""
    if decay.holds_split(optimizer):
        return
    groups = optimizer.param_groups
    if any(g.get("weight_decay", 0) > 0 and not g["params"] for g in groups):
        for g in groups:
            for p in g["params"] if g.get("weight_decay", 0) == 0 else []:
                group = group_of(p)
                matrices = [s.name for s in group.slots if len(s.shape) >= 2] if group else []
                if matrices:
                    raise RuntimeError(
                        f"fbmt: this {type(optimizer).__name__} does not decay flat shard '{group.name}', which "
                        f"holds matrices {matrices[:2]}, while its decayed group is empty: a split by p.dim() "
                        "(nanoGPT's configure_optimizers) sees every flat shard as 1-D. Decay every parameter on "
                        "purpose, torch.optim.AdamW(model.parameters(), weight_decay=wd), or set weight_decay=0"
                    )
    if not any(g.get("weight_decay", 0) == 0 and not g["params"] for g in groups):
        return
    for g in groups:
        if g.get("weight_decay", 0) > 0:
            for p in g["params"]:
                group = group_of(p)
                exempt = [s.name for s in group.slots if "bias" in s.name or "norm" in s.name.lower()] if group else []
                if exempt:
                    raise RuntimeError(
                        f"fbmt: this {type(optimizer).__name__} decays flat shard '{group.name}', which holds "
                        f"{exempt[:2]}, while its weight_decay=0 group (meant for biases and norm weights) is empty: "
                        "a split by parameter name (HF Trainer's) cannot see inside flat shards. Decay every "
                        "parameter on purpose, e.g. Trainer(..., optimizers=(torch.optim.AdamW(model.parameters(), "
                        "weight_decay=wd), None)), or set weight_decay=0"
                    )


# NOTE: [Global gradient norms]
# `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`, which nearly every training script
# calls, would clip each rank's shard by that shard's norm: each rank a different factor, none the
# true one. Its norm comes from `torch.nn.utils.clip_grad._get_total_norm`, looked up at every call,
# so fbmt replaces that one function (which also serves scripts that imported clip_grad_norm_
# before fbmt): where the gradients are those of compiled models' shards, it adds up every rank's
# part (an all-reduce; call it on every rank, as one does), and elsewhere it is torch's own. The same
# function is public as `torch.nn.utils.get_total_norm` (a loop logs the gradient norm with it, and
# torchtitan clips with it and `clip_grads_with_norm_`): that name is replaced too. A script that
# bound it before `fbmt.compile` (`from torch.nn.utils import get_total_norm`) keeps torch's, which
# fbmt cannot reach. torch offers no hook for this; the replacement is installed by `fbmt.compile`
# (never at import), once.
_SHARDS: weakref.WeakSet = weakref.WeakSet()
_installed_norm: Callable | None = None


def _shard_ids() -> set[int]:
    """The ids of every compiled model's flat shards alive in this process (gradients' owners)."""
    return {id(p) for p in list(_SHARDS)}


def _global_gradient_norms(leaves: list[torch.Tensor]) -> None:
    global _installed_norm
    _SHARDS.update(leaves)
    import torch.nn.utils.clip_grad as clip_grad

    if getattr(clip_grad, "_get_total_norm", None) is None:  # a torch without it: say so, never be silent
        raise RuntimeError(
            f"fbmt: torch {torch.__version__} has no torch.nn.utils.clip_grad._get_total_norm, through which fbmt "
            "makes clip_grad_norm_ use the norm over every rank's shards; use a torch fbmt supports (2.11+)"
        )
    if clip_grad._get_total_norm is not _installed_norm:
        torch_norm = clip_grad._get_total_norm
        _installed_norm = clip_grad._get_total_norm = _total_norm(torch_norm)
        if getattr(torch.nn.utils, "get_total_norm", None) is torch_norm:
            torch.nn.utils.get_total_norm = _installed_norm


def _total_norm(torch_norm: Callable) -> Callable:
    @functools.wraps(torch_norm)
    def total_norm(
        tensors: Any, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None
    ) -> torch.Tensor:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        sharded = {id(p.grad) for p in list(_SHARDS) if p.grad is not None}
        mine = [id(t) in sharded for t in tensors]
        if not any(mine) or not dist.is_initialized() or dist.get_world_size() == 1:
            return torch_norm(tensors, norm_type, error_if_nonfinite, foreach)
        if not all(mine):
            raise RuntimeError(
                "fbmt: clip_grad_norm_ got gradients of a compiled model's shards together with others; the "
                "shards' norm sums over ranks and the others' does not: clip them in separate calls"
            )
        norm_type = float(norm_type)
        local = torch_norm(tensors, norm_type, False, foreach)
        total = local.float() if norm_type == float("inf") else local.float() ** norm_type
        if dist.get_backend() == "nccl" and not total.is_cuda:  # shards in host memory (offload=True)
            total = total.cuda()
        dist.all_reduce(total, op=dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM)
        if norm_type != float("inf"):
            total = total ** (1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot "
                "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`"
            )
        return total.to(local.device, local.dtype)

    return total_norm


# NOTE: [Overflow found on any rank]
# Mixed precision as torch documents it, `scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`
# with `torch.amp.GradScaler`, skips the step where any gradient is inf or nan and halves the scale. The
# scaler looks at the gradients the optimizer holds: of a compiled model, this rank's shards. An
# overflow in one rank's shard was seen by that rank alone, which skipped the step and halved its scale,
# while the others stepped on the overflowed gradients and grew theirs; from then on every rank scaled
# its loss by another factor, and the reduced gradients summed them, silently. So the scaler's search
# (`GradScaler._unscale_grads_`, through which both its `unscale_` and a fused optimizer's step find
# overflow) is followed, where the optimizer holds a compiled model's shards, by the largest finding
# over every rank (an all-reduce; every rank calls `scaler.step`, as one does): each rank skips the same
# steps and keeps the same scale, as one process would. torch offers no hook for this; like the norm
# above, the replacement is installed by `fbmt.compile`, once, and elsewhere the scaler is torch's own.
_installed_unscale: Callable | None = None


def _overflow_on_any_rank() -> None:
    global _installed_unscale
    from torch.amp.grad_scaler import GradScaler

    if GradScaler._unscale_grads_ is not _installed_unscale:
        _installed_unscale = GradScaler._unscale_grads_ = _found_on_any_rank(GradScaler._unscale_grads_)


def _found_on_any_rank(torch_unscale: Callable) -> Callable:
    @functools.wraps(torch_unscale)
    def unscale_grads_(
        self: Any, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        shards_for_parameters(optimizer)  # NOTE: [Optimizers built before compiling]
        found = torch_unscale(self, optimizer, inv_scale, found_inf, allow_fp16)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return found
        shards = _shard_ids()
        if not any(id(p) in shards for group in optimizer.param_groups for p in group["params"]):
            return found
        anywhere = found_inf.new_zeros(())
        for f in found.values():
            anywhere = torch.maximum(anywhere, f.to(anywhere.device))
        if dist.get_backend() == "nccl" and not anywhere.is_cuda:  # a scaler of the host (offload=True)
            reduced = anywhere.cuda()
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
            anywhere = reduced.to(anywhere.device)
        else:
            dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
        for f in found.values():
            f.copy_(anywhere)
        found.setdefault(found_inf.device, found_inf.copy_(anywhere))  # a rank whose shards had no gradient
        return found

    return unscale_grads_
