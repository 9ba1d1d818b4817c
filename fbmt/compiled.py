"""The module `fbmt.compile` returns: shards as parameters, a program per input signature.

`CompiledModule.forward` looks up (or builds, with `fbmt.pipeline.build`) the program for the call's
input shapes, dtypes, training flags and grad mode, then runs it. With gradients, the forward and
backward graphs run inside one `autograd.Function` (`fbmt.runtime.autograd`), so the training loop
stays plain PyTorch and autograd accumulates each shard's gradient into `shard.grad`.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import time
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from fbmt import distributed, objects, pipeline
from fbmt.layout import Layout, copy_into_shard, local_range
from fbmt.ops import record
from fbmt.options import CompileOptions
from fbmt.program import Program
from fbmt.runtime.autograd import Routes, RunProgram
from fbmt.runtime.graphs import Graphed
from fbmt.runtime.params import gather_group
from fbmt.runtime.partition import Executable
from fbmt.runtime.regions import RegionCache

log = logging.getLogger("fbmt")


class _Wrapping(type):
    """The class of each compiled module forwards class-level lookups to the wrapped module's class
    (HF's `generate` runs `getattr(type(self), "_sample")`): NOTE: [The wrapped model's methods]."""

    def __getattr__(cls, name: str) -> Any:
        wrapped = cls.__dict__.get("_fbmt_wraps")
        if wrapped is None or name.startswith("__"):
            raise AttributeError(f"type object {cls.__name__!r} has no attribute {name!r}")
        return getattr(wrapped, name)


_classes: dict[type, type] = {}


class CompiledModule(nn.Module, metaclass=_Wrapping):
    """A module compiled by `fbmt.compile`; see that function for the options.

    View mode (`views`, used by fbmt's BMTrain layer): for each group, one leaf Parameter per slot,
    viewing this rank's part of that parameter inside the group's shard (possibly empty). Autograd
    then accumulates a slice of the shard gradient into each view's `.grad`, so optimizers and
    `named_parameters()` see ordinary per-parameter tensors; the flat shards hold no gradients.
    """

    def __new__(cls, module: nn.Module | None = None, *args: Any, **kwargs: Any) -> CompiledModule:
        if cls is CompiledModule and module is not None:  # one class per wrapped class (copies: already one)
            wrapped = type(module)
            if wrapped not in _classes:
                name = f"CompiledModule[{wrapped.__qualname__}]"
                namespace = {"_fbmt_wraps": wrapped, "__qualname__": name, "forward": _presenting_signature(wrapped)}
                _classes[wrapped] = _Wrapping("CompiledModule", (cls,), namespace)
            cls = _classes[wrapped]
        return super().__new__(cls)

    def __init__(
        self,
        module: nn.Module,
        layout: Layout,
        shards: list[nn.Parameter],
        *,
        options: CompileOptions,
        device: torch.device,
        rank: int,
        views: list[list[nn.Parameter]] | None = None,
    ):
        super().__init__()
        self.__dict__["_orig"] = module  # not a submodule: its parameters are meta placeholders
        self.flat_params = nn.ParameterList(shards)
        for shard, group in zip(shards, layout.groups):
            shard._fbmt_group = group  # for code that meets a shard alone (OptimManager.state_dict)
        self.views = views
        self._routes: Routes | None = None
        if views is not None:
            self._routes, index = {}, 0
            for group, vs in zip(layout.groups, views):
                base, self._routes[group.index] = rank * group.shard_numel, []
                for slot, v in zip(group.slots, vs):
                    lo, hi = local_range(group, slot, rank)
                    assert v.numel() == max(0, hi - lo), f"view of {slot.name} has the wrong size"
                    self._routes[group.index].append((index, max(0, lo - base), max(lo, hi) - base))
                    index += 1
        self.layout, self.options, self.device, self.rank = layout, options, device, rank
        self.programs: dict[Any, Program] = {}
        self._executables: dict[Any, Executable] = {}
        self.program: Program | None = None
        self.compile_seconds = 0.0  # tracing, passes and partitioning, over every program built so far
        self.regions = RegionCache()  # backend="inductor": compiled compute regions, shared by all programs
        # what every call reads, found once: walking the module tree on every call costs host time before the
        # step's first kernel
        self._submodules = list(module.modules())
        self._buffer_owners: dict[str, tuple[nn.Module, str]] = {}  # buffer name -> (module, attribute)
        self._graphed: tuple[Any, Graphed] | None = None  # cuda_graph=True: (key, graphs) of one program
        # The placeholders the module holds, by owner: a user who deletes, replaces or (un)freezes one
        # after compiling must not be ignored silently (`_check_parameters`).
        group_of = {s.name: g.index for g in layout.groups for s in g.slots}
        self._placeholders = [
            (m, k, p, name, group_of[layout.aliases[name]])
            for path, m in module.named_modules(remove_duplicate=False)
            for k, p in m._parameters.items()
            if p is not None
            for name in [f"{path}.{k}" if path else k]
        ]
        self._flags_seen = self._flags()
        self._shards = list(shards)  # what the flat shards must stay (FSDP around the model would replace them)
        _refuse_optimizers_of_moved_parameters()
        _global_gradient_norms(shards if views is None else [v for vs in views for v in vs])
        self.train(module.training)

    # NOTE: [The wrapped model's methods]
    # Libraries read the model they are given: HF's Trainer keeps only the dataset columns that
    # `inspect.signature(model.forward)` names, and `generate()` validates its arguments the same
    # way, so `forward` presents the original signature (each wrapped class gets a class of its
    # own, whose `forward` carries that signature). A method of the original model (`generate`,
    # `prepare_inputs_for_generation`, a property) is looked up on the original's class and bound
    # to this module, so that inside it `self(...)` runs the compiled program and
    # `self.parameters()`/`self.device` are the shards'; bound to the original, it would run the
    # original forward on meta placeholders. Attributes that are not methods (`config`,
    # submodules) are the original's.

    # ---- calling ----
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        dtype = self.options.param_dtype
        if dtype is not None:  # mixed precision: floating inputs in the compute dtype, as FSDP2 does
            args, kwargs = pytree.tree_map_only(
                torch.Tensor, lambda x: x.to(dtype) if x.is_floating_point() else x, (args, kwargs)
            )
        leaves, _ = pytree.tree_flatten((args, kwargs))
        inputs = objects.input_tensors(leaves)
        for i, x in enumerate(inputs):
            if x.device != self.device:
                raise ValueError(
                    f"fbmt: tensor input #{i} (shape {tuple(x.shape)}) is on {x.device}, but this "
                    f"model's parameters are on {self.device}; move the inputs with .to({str(self.device)!r})"
                )
        trainable = self.trainable()
        needs_grad = torch.is_grad_enabled() and (any(trainable) or any(x.requires_grad for x in inputs))
        key = self._key(args, kwargs, needs_grad, trainable)
        exe = self._executables.get(key)
        if exe is None:
            exe = self._build(key, args, kwargs, needs_grad, trainable)
        self._check_ranks_agree(exe, self.programs[key])
        if exe.updated_buffers and needs_grad and self.options.broadcast_buffers and self.layout.world_size > 1:
            self._broadcast_buffers(exe.updated_buffers)
        feed = self._feed(exe, inputs)
        if exe.backward is None:
            with torch.no_grad():
                outs = exe.run_forward(*feed)[0]
        else:
            # recording ops report from the host, which a replayed graph does not run
            graphed = self.options.cuda_graph and not exe.records
            runner = self._graphs(key, exe) if graphed else exe
            if self.views is None:
                outs = RunProgram.apply(exe, runner, None, *feed)
            else:
                outs = RunProgram.apply(exe, runner, self._routes, *feed, *(v for vs in self.views for v in vs))
        program = self.programs[key]
        flat = program.results.assemble(dict(zip(exe.output_keys, outs)), leaves)
        return pytree.tree_unflatten(flat, program.out_spec)

    def trace(self, *args: Any, device: torch.device | str | None = None, **kwargs: Any) -> Program:
        """The transformed program for this call, without running it (works at any world size).

        `device`: trace as if the parameters lived there (default: where they live). A model
        compiled on "meta" for inspection or simulation traces on "cpu" fakes, so fused kernels
        (attention) appear as they would on a real device instead of decomposed."""
        trainable = self.trainable()
        needs_grad = torch.is_grad_enabled() and any(trainable)
        key = (*self._key(args, kwargs, needs_grad, trainable), str(device))
        if key not in self.programs:
            self._build(key, args, kwargs, needs_grad, trainable, device=device)
        return self.programs[key]

    def trainable(self) -> tuple[bool, ...]:
        """Per flat group: does any of its parameters require a gradient now."""
        if self.views is None:
            self._check_parameters()
            return tuple(p.requires_grad for p in self.flat_params._parameters.values())
        return tuple(any(v.requires_grad for v in vs) for vs in self.views)

    def _flags(self) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
        return (
            tuple(p.requires_grad for _, _, p, _, _ in self._placeholders),
            tuple(p.requires_grad for p in self.flat_params._parameters.values()),
        )

    def _check_parameters(self) -> None:
        """The module's parameters are still the placeholders compile left, and `requires_grad_` on
        one (`model.fc.weight.requires_grad_(False)`) or on a shard applies to the shard's group."""
        current = list(self.flat_params._parameters.values())
        if len(current) != len(self._shards) or any(a is not b for a, b in zip(current, self._shards)):
            raise RuntimeError(
                "fbmt: the compiled model's flat shards were replaced after fbmt.compile (FSDP's fully_shard or "
                "FullyShardedDataParallel around a compiled model does this): fbmt already shards the parameters "
                "and reduces the gradients; use the compiled model as it is, without FSDP or DDP around it"
            )
        for m, k, p, name, _ in self._placeholders:
            if m._parameters.get(k) is not p:
                raise RuntimeError(
                    f"fbmt: parameter '{name}' was deleted or replaced after fbmt.compile, but the compiled "
                    "program computes with the original, whose values live in the flat shards; change the "
                    "module before compiling it, or load new values with model.load_state_dict(...)"
                )
        flags = self._flags()
        if flags == self._flags_seen:
            return
        shards = list(self.flat_params._parameters.values())
        if flags[0] != self._flags_seen[0]:  # a placeholder changed: its whole group follows
            for group in self.layout.groups:
                mine = [(name, p.requires_grad) for _, _, p, name, g in self._placeholders if g == group.index]
                wanted = {rg for _, rg in mine}
                if len(wanted) > 1:
                    frozen = [n for n, rg in mine if not rg]
                    raise RuntimeError(
                        f"fbmt: {frozen[:3]} of flat group '{group.name}' are frozen but other parameters of "
                        "that group still train, and a group's shard trains as one. Freeze before fbmt.compile "
                        "(frozen parameters then get a shard of their own), or freeze the whole block "
                        f"'{group.block or '<root>'}' (e.g. model.get_submodule(...).requires_grad_(False))"
                    )
                shards[group.index].requires_grad_(wanted.pop())
        else:  # a shard changed (through model.parameters()): its placeholders follow, for the next check
            for _, _, p, _, g in self._placeholders:
                p.requires_grad_(shards[g].requires_grad)
        self._flags_seen = self._flags()

    def _key(self, args: tuple, kwargs: dict, needs_grad: bool, trainable: tuple[bool, ...]) -> tuple:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        sig = tuple(
            (tuple(x.shape), x.dtype, x.device, x.requires_grad)
            if isinstance(x, torch.Tensor)
            else objects.fingerprint(x)
            if objects.is_object(x)
            else x
            for x in leaves
        )
        # autocast changes what the forward computes, and tracing records its casts: a program per state
        kinds = ("cpu",) if self.device.type in ("cpu", "meta") else ("cpu", self.device.type)  # meta has none
        autocast = tuple(
            (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) if torch.is_autocast_enabled(d) else False
            for d in kinds
        )
        return (
            spec,
            sig,
            tuple(m.training for m in self._submodules),
            needs_grad,
            trainable,
            record.active(),
            autocast,
        )

    def _build(
        self,
        key: tuple,
        args: tuple,
        kwargs: dict,
        needs_grad: bool,
        trainable: tuple[bool, ...],
        device: torch.device | str | None = None,
    ) -> Executable:
        started = time.perf_counter()
        if self.programs:
            log.info("fbmt: compiling a new program for a new input signature (%d cached)", len(self.programs))
        program, exe = pipeline.build(
            self._orig,
            self.layout,
            self.options,
            args,
            kwargs,
            needs_grad=needs_grad,
            trainable=trainable,
            regions=self.regions,
            device=torch.device(device) if device is not None else self.device,
        )
        log.info("fbmt: traced, passed and partitioned in %.2fs", time.perf_counter() - started)
        self.compile_seconds += time.perf_counter() - started
        self.programs[key], self._executables[key], self.program = program, exe, program
        return exe

    @contextlib.contextmanager
    def _instrumented(self, wrap: Callable[[Any, str], Callable]) -> Iterator[None]:
        """Meanwhile, every program's forward and backward graph runs as `wrap(graph, phase)`
        (`fbmt.profile` times each node so). Not with CUDA graphs: a replay runs no node."""
        if self.options.cuda_graph:
            raise RuntimeError("fbmt.profile: a model compiled with cuda_graph=True replays graphs that run no node")
        saved = [(exe, exe.forward, exe.backward) for exe in self._executables.values()]
        try:
            for exe, fwd, bwd in saved:
                exe.forward = wrap(fwd, "fwd")
                if bwd is not None:
                    exe.backward = wrap(bwd, "bwd")
            yield
        finally:
            for exe, fwd, bwd in saved:
                exe.forward, exe.backward = fwd, bwd

    def _graphs(self, key: Any, exe: Executable) -> Graphed:
        """The CUDA graphs of this training program (NOTE: [CUDA graphs]); one program's at a time."""
        if self._graphed is None or self._graphed[0] != key:
            if self._graphed is not None:
                log.info("fbmt: cuda_graph: new input signature; dropping the previous program's graphs")
            self.release_graphs()  # the old graphs' pool goes before the new one is made
            leaves = list(self.flat_params) if self.views is None else [v for vs in self.views for v in vs]
            self._graphed = (key, Graphed(exe, self.device, leaves))
        return self._graphed[1]

    def release_graphs(self) -> None:
        """Drop the CUDA graphs of `cuda_graph=True` and their memory; the next calls warm up and
        capture again. Call it before `dist.destroy_process_group()`, which otherwise waits for them."""
        if self._graphed is not None:
            self._graphed[1].release()
            self._graphed = None

    @property
    def capture_seconds(self) -> float:
        """Seconds spent capturing CUDA graphs (cuda_graph=True), 0 before the capture."""
        return self._graphed[1].capture_seconds if self._graphed is not None else 0.0

    def _feed(self, exe: Executable, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        shards = list(self.flat_params._parameters.values())

        def buffer(name: str) -> torch.Tensor:  # read at every call: a module may assign a new buffer tensor
            if name not in self._buffer_owners:
                path, _, attr = name.rpartition(".")
                self._buffer_owners[name] = (self._orig.get_submodule(path), attr)
            owner, attr = self._buffer_owners[name]
            return owner._buffers[attr]

        feeders: dict[str, Callable[[Any], torch.Tensor]] = {
            "shard": shards.__getitem__,
            "buffer": buffer,
            "input": inputs.__getitem__,
            "constant": exe.constants.__getitem__,
        }
        return [feeders[r.kind](r.key) for r in exe.fwd_inputs]

    def _broadcast_buffers(self, names: list[str]) -> None:
        """Rank 0's values of these buffers on every rank (`broadcast_buffers`), one broadcast per dtype."""
        buffers = dict(self._orig.named_buffers())
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for name in names:
            by_dtype.setdefault(buffers[name].dtype, []).append(buffers[name])
        with torch.no_grad():
            for tensors in by_dtype.values():
                flat = torch.cat([t.reshape(-1) for t in tensors])
                dist.broadcast(flat, src=0)
                for t, v in zip(tensors, flat.split([t.numel() for t in tensors])):
                    t.copy_(v.view_as(t))

    def _check_ranks_agree(self, exe: Executable, program: Program) -> None:
        """Ranks about to run different programs (one compiled a new one, one runs a cached one) would
        deadlock in mismatched collectives, or pair the wrong ones: fail instead, saying where the
        programs part. Every call, on the host, so that a rank that stalls is named too
        (`distributed.agree`)."""
        if self.layout.world_size == 1:  # compiled for one rank (world_size=1): no collectives to pair
            return
        digests = distributed.agree(int(exe.signature[:15], 16), "a call of the compiled model")
        if len(set(digests)) == 1:
            return
        by_program: dict[int, list[int]] = {}
        for r, d in enumerate(digests):
            by_program.setdefault(d, []).append(r)
        sequences = distributed.gather_objects([_describe(n) for n in program.collectives()])
        raise RuntimeError(
            f"fbmt: ranks compiled different programs (ranks by program: {list(by_program.values())}); "
            f"{_first_difference(sequences)}. Every rank must call the model with the same input shapes, "
            "dtypes, train/eval mode and grad mode, and the same calls in the same order (a call on some "
            "ranks only, under no_grad on one rank, or after an exception caught on one rank breaks this)"
        )

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

    @property
    def _is_accelerate_prepared(self) -> bool:
        # accelerate (under HF Trainer) wraps a model it has not prepared in DDP, and runs its forward
        # under autocast for bf16=True/fp16=True: the first is refused (above), the second would trace
        # the autocast casts into the program. A compiled model needs neither: it is prepared.
        state = sys.modules.get("accelerate.state")
        precision = state.AcceleratorState._shared_state.get("_mixed_precision") if state is not None else None
        if precision not in (None, "no"):
            raise RuntimeError(
                f"fbmt: accelerate is set to mixed precision {str(precision)!r} (TrainingArguments(bf16=True) or "
                "fp16=True), which runs the forward under autocast; fbmt compiles mixed precision into the program "
                "instead: leave bf16/fp16 off and compile with fbmt.compile(model, param_dtype=torch.bfloat16)"
            )
        return True

    @_is_accelerate_prepared.setter
    def _is_accelerate_prepared(self, value: bool) -> None:
        pass  # accelerate marks what it prepared; a compiled model stays prepared

    # ---- module protocol ----
    def train(self, mode: bool = True) -> CompiledModule:
        super().train(mode)
        self._orig.train(mode)
        return self

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Any:
        """The original module's buffers (replicated on every rank, not sharded)."""
        return self._orig.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            orig = self.__dict__.get("_orig")
            if orig is None:
                raise
        found = inspect.getattr_static(type(orig), name, None)  # NOTE: [The wrapped model's methods]
        if isinstance(found, (types.FunctionType, property)) and name not in vars(orig):
            return found.fget(self) if isinstance(found, property) else types.MethodType(found, self)
        return getattr(orig, name)

    def gather(self, group: int) -> torch.Tensor:
        """The whole flat buffer of flat group `group` (a collective: call it on every rank)."""
        return gather_group(self.flat_params[group].detach(), self.layout.groups[group])

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, gathered whole, by canonical name (a collective: call it on every rank)."""
        out = {}
        with torch.no_grad():
            for group, shard in zip(self.layout.groups, self.flat_params):
                flat = gather_group(shard, group)
                for s in group.slots:
                    out[s.name] = flat[s.offset : s.offset + s.numel].view(s.shape).clone()
        return out

    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        """Every parameter's gradient, gathered whole (a collective: call it on every rank)."""
        out: dict[str, torch.Tensor | None] = {}
        for group, shard in zip(self.layout.groups, self.flat_params):
            flat = gather_group(shard.grad, group) if shard.grad is not None else None
            for s in group.slots:
                out[s.name] = None if flat is None else flat[s.offset : s.offset + s.numel].view(s.shape).clone()
        return out

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The original module's state dict, with full (gathered) parameters. A collective."""
        self._check_parameters()
        full = self.full_parameters()
        out = OrderedDict() if destination is None else destination
        for k, v in self._orig.state_dict(keep_vars=True).items():
            out[prefix + k] = full[self.layout.aliases[k]] if k in self.layout.aliases else v.detach()
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load full tensors (as `state_dict()` returns); each rank keeps only its shard."""
        self._check_parameters()
        expected = list(self._orig.state_dict(keep_vars=True))
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(self._orig).__name__}: "
                f"missing keys {missing}, unexpected keys {unexpected}"
            )
        by_canonical = {self.layout.aliases[k]: v for k, v in state_dict.items() if k in self.layout.aliases}
        buffers = dict(self._orig.named_buffers())
        with torch.no_grad():
            for group, shard in zip(self.layout.groups, self.flat_params):
                for s in group.slots:
                    v = by_canonical.get(s.name)
                    if v is not None and tuple(v.shape) != s.shape:
                        raise RuntimeError(
                            f"size mismatch for {s.name}: checkpoint has {tuple(v.shape)}, model has {s.shape}"
                        )
                copy_into_shard(shard, group, self.rank, by_canonical)
            for k, b in buffers.items():
                if k in state_dict:
                    v = state_dict[k]
                    if tuple(v.shape) != tuple(b.shape):  # copy_ would broadcast where torch refuses
                        raise RuntimeError(
                            f"size mismatch for {k}: checkpoint has {tuple(v.shape)}, model has {tuple(b.shape)}"
                        )
                    b.copy_(v)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)


def _describe(start: Any) -> str:
    """A collective start node, as a rank mismatch names it."""
    return f"{start.target.__name__} of group {start.meta.get('fbmt_group')} ({start.meta.get('fbmt_phase')})"


def _first_difference(sequences: list[list[str]]) -> str:
    """Where ranks' collective sequences first differ, and what each rank issues there."""
    longest = max(len(s) for s in sequences)
    for k in range(longest):
        at = [s[k] if k < len(s) else f"nothing (its program has {len(s)} collectives)" for s in sequences]
        if len(set(at)) > 1:
            ranks: dict[str, list[int]] = {}
            for r, what in enumerate(at):
                ranks.setdefault(what, []).append(r)
            issued = "; ".join(f"ranks {rs} issue {what}" for what, rs in ranks.items())
            return f"they first differ at collective #{k + 1}: {issued}"
    return "their collectives are the same, but their flat groups differ in size"


def _presenting_signature(wrapped: type) -> Callable:
    """The compiled class's `forward`, with the wrapped class's signature and docstring (NOTE: [The
    wrapped model's methods])."""

    def forward(self: CompiledModule, *args: Any, **kwargs: Any) -> Any:
        return CompiledModule.forward(self, *args, **kwargs)

    try:
        forward.__signature__ = inspect.signature(wrapped.forward)
    except (TypeError, ValueError):  # a forward inspect cannot read: keep (*args, **kwargs)
        pass
    forward.__doc__ = wrapped.forward.__doc__
    forward.__qualname__ = f"{wrapped.__qualname__}.forward (compiled by fbmt)"
    return forward


_hook_installed = False


def _refuse_optimizers_of_moved_parameters() -> None:
    """Once per process: an optimizer that holds a parameter compile took over fails at its first step
    (it would update a tensor nothing reads any more, and the model would silently not train)."""
    global _hook_installed
    if not _hook_installed:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_check_optimizer)
        _hook_installed = True


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    if getattr(optimizer, "_fbmt_checked", None) == count:  # checked, and no parameter added since
        return
    for g in optimizer.param_groups:
        for p in g["params"]:
            name = getattr(p, "_fbmt_moved", None)
            if name is not None:
                raise RuntimeError(
                    f"fbmt: this {type(optimizer).__name__} holds parameter '{name}' of a module that "
                    "fbmt.compile took over; its values now live in the compiled model's flat shards, so "
                    "this optimizer would never change the model. Build the optimizer after compiling, on "
                    "the compiled model: torch.optim.AdamW(model.parameters())"
                )
    _refuse_a_decay_split_that_cannot_see_into_shards(optimizer)
    optimizer._fbmt_checked = count


def _refuse_a_decay_split_that_cannot_see_into_shards(optimizer: torch.optim.Optimizer) -> None:
    """HF Trainer (and scripts written like it) split parameters by name into a decayed group and a
    weight_decay=0 group for biases and norm weights. On a compiled model the names are the flat
    shards', so the second group comes out empty and biases and norms decay: unlike eager, silently."""
    groups = optimizer.param_groups
    if not any(g.get("weight_decay", 0) == 0 and not g["params"] for g in groups):
        return
    for g in groups:
        if g.get("weight_decay", 0) > 0:
            for p in g["params"]:
                group = getattr(p, "_fbmt_group", None)
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
# part (an all-reduce; call it on every rank, as one does), and elsewhere it is torch's own.
_SHARDS: weakref.WeakSet = weakref.WeakSet()


def _global_gradient_norms(leaves: list[torch.Tensor]) -> None:
    _SHARDS.update(leaves)
    import torch.nn.utils.clip_grad as clip_grad

    if getattr(clip_grad, "_get_total_norm", None) is None:  # a torch without it: say so, never be silent
        raise RuntimeError(
            f"fbmt: torch {torch.__version__} has no torch.nn.utils.clip_grad._get_total_norm, through which fbmt "
            "makes clip_grad_norm_ use the norm over every rank's shards; use a torch fbmt supports (2.11+)"
        )
    if not getattr(clip_grad._get_total_norm, "_fbmt", False):
        clip_grad._get_total_norm = _total_norm(clip_grad._get_total_norm)


def _total_norm(torch_norm: Callable) -> Callable:
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
        dist.all_reduce(total, op=dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM)
        if norm_type != float("inf"):
            total = total ** (1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot "
                "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`"
            )
        return total.to(local.dtype)

    total_norm._fbmt = True
    return total_norm
