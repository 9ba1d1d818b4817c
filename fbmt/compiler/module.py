"""The module `fbmt.compile` returns: shards as parameters, a program per input signature.

`CompiledModule.forward` looks up the program for the call's input shapes, dtypes, training flags and
grad mode (loading it from the compile cache, or building it with `fbmt.compiler.pipeline`), checks
that every rank runs the same one, then runs it. With gradients, the forward and backward graphs run
inside one `autograd.Function` (`runtime.autograd`), so the training loop stays plain PyTorch and
autograd accumulates each shard's gradient into `shard.grad`. Its `state_dict` holds full tensors
under the original names.

It is the compiler's own module and knows nothing of the libraries around it: `fbmt.compile` returns
a subclass that adds what they need (`fbmt/integrations`: Hugging Face's method lookup, accelerate's
and DDP's, the torch guards), and BMTrain's layer a subclass whose parameters are per-parameter views.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import inspect
import itertools
import logging
import operator
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import sympy
import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.utils.hooks import RemovableHandle

from fbmt import job
from fbmt.compiler import cache, host_draws, objects, owners, pipeline, sizes, trace
from fbmt.compiler.agreement import check_ranks_agree
from fbmt.compiler.layout import Layout, copy_into_shard
from fbmt.compiler.ops import record
from fbmt.compiler.options import CompileOptions
from fbmt.compiler.plan import Plan
from fbmt.compiler.program import Program
from fbmt.compiler.runtime.autograd import Routes, RunProgram
from fbmt.compiler.runtime.graphs import Graphed
from fbmt.compiler.runtime.params import Placeholders, broadcast_buffers, gather_group
from fbmt.compiler.runtime.partition import Executable
from fbmt.compiler.runtime.regions import COMPILING, RegionCache, in_background, workers_for
from fbmt.compiler.runtime.unsynced import Unsynced

log = logging.getLogger("fbmt")
# A program loaded with Inductor's artifacts of all its regions but at most this many has its regions
# made by the loader thread alone, the missing ones compiled in full there, one after another (seconds
# each); with more missing, workers compile them side by side, and find the others in torch's caches,
# but their first answers come only after they have started (NOTE: [Compiles in the background]).
LOADED_AT_MOST_MISSING = 4
_SHAPES_WARNING = 4  # programs that differ in input shapes (or numbers) alone before the warning


def _same_but_shapes(old: tuple, new: tuple, numbers: bool = False) -> bool:
    """Two calls' input signatures (`_key`'s) that differ at most in their tensors' shapes (with
    `numbers`, and in the values of their plain numbers)."""
    if len(old) != len(new):
        return False
    for a, b in zip(old, new):
        tensors = isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 4
        if a != b and not (tensors and a[1:] == b[1:] and len(a[0]) == len(b[0])):
            if not (numbers and (_number(a) and _number(b) or _held_alike(a, b))):
                return False
    return True


def _held(fp: Any) -> bool:
    """An argument object's `objects.fingerprint` (in a call's signature)."""
    return isinstance(fp, tuple) and len(fp) == 2 and isinstance(fp[0], type) and isinstance(fp[1], tuple)


def _held_tensor(fp: Any) -> bool:
    """A tensor inside an argument object's fingerprint: `("T", shape, dtype, device, requires_grad)`."""
    return isinstance(fp, tuple) and len(fp) == 5 and fp[0] == "T"


def _held_alike(a: Any, b: Any) -> bool:
    """Two argument objects' fingerprints that differ at most in their tensors' shapes and their numbers."""

    def alike(x: Any, y: Any) -> bool:
        tensors = _held_tensor(x) and _held_tensor(y)
        return (tensors and x[2:] == y[2:] and len(x[1]) == len(y[1])) or (_number(x) and _number(y))

    return _held(a) and _held(b) and all(alike(x, y) for _, x, y in objects.differences(a, b))


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _numbers_differing(old: tuple, new: tuple, args: tuple, kwargs: dict) -> list[str]:
    """The arguments that are plain numbers in both calls' signatures (`_key`'s) and differ, by name, and
    the numbers argument objects hold that differ (`cache.layers[0].cumulative_length`)."""
    leaves = pytree.tree_flatten_with_path((args, kwargs))[0]
    found = []
    for (path, _), a, b in zip(leaves, old, new):
        if a != b and _number(a) and _number(b):
            found.append(_argument_name(path))
        elif a != b and _held(a) and _held(b):
            found += [
                _argument_name(path) + objects.path_text(at)
                for at, x, y in objects.differences(a, b)
                if _number(x) and _number(y)
            ]
    return found


def _number_name(at: tuple[int, tuple], args: tuple, kwargs: dict) -> str:
    """A number an argument object holds (`Program.numbers`' entry), as a user names it."""
    i, path = at
    return _argument_name(pytree.tree_flatten_with_path((args, kwargs))[0][i][0]) + objects.path_text(path)


def _argument_name(path: tuple) -> str:
    """An argument leaf's path in `(args, kwargs)`, as a user names it."""
    kind, name, rest = path[0].idx, path[1], pytree.keystr(path[2:])  # (args, kwargs)[kind][name]...
    return f"argument {name.idx}{rest}" if kind == 0 else f"{name.key}{rest}"


# NOTE: [Attributes read as constants]
# A trace records what the forward reads of its modules' Python attributes as constants of the program:
# `nn.Dropout.p`, an attention's `scaling`, a Hugging Face config's `output_hidden_states`. Eager PyTorch
# reads them at every call, so a user who sets `dropout.p = 0.0` or `model.config.output_hidden_states =
# True` after compile would get the old program's results, silently. So a call's key holds the values
# of the plain attributes (numbers, strings, dtypes, tuples of them) of every module and of the configs
# the modules hold (objects with `to_dict`), and a changed value builds (or loads) the program of the
# new values, `FBMT_LOG=info` naming the attribute. Read from each object's `__dict__` kept at compile
# (each object's values by one C getter, their types checked as one set: small beside a step). An
# attribute added or deleted since is watched from then on, found by each object's count of attributes,
# which every call compares: a forward may have read its absence (`getattr(self, "flag", False)`). So are
# the modules' forward and backward hooks, which the trace runs: one registered or removed since builds
# (or finds) the program of the hooks there now. An attribute the forward itself sets at every call (a
# counter) would build a program per call: where the programs of two of its values are the same it is
# watched no more, with a warning, and where they differ it is refused (`_written_at_every_call`).
# A loop over the compiled model's `modules()` reaches these modules (NOTE: [The compiled model's
# modules]), and an attribute set on the compiled model is set on the model it wraps.
_EXACT = frozenset(t for t in cache.PLAIN if t is not enum.Enum)  # the compile cache's plain values, by type
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _value(v: Any) -> Any:
    """A watched attribute's value as a key: a list as a tuple, an object that took a plain value's place
    by its type (a forward that makes a new one each call would otherwise build a program each call)."""
    if type(v) in _EXACT or isinstance(v, enum.Enum):
        return v
    if isinstance(v, (tuple, list)):
        return tuple(_value(x) for x in v)
    return ("object", type(v).__qualname__)


def _plain(v: Any) -> bool:
    return isinstance(v, cache.PLAIN) or (
        isinstance(v, (tuple, list)) and len(v) <= 16 and all(isinstance(x, cache.PLAIN) for x in v)
    )


class _Attributes:
    """The plain attributes of a model's modules and of their configs (NOTE: [Attributes read as
    constants]): `values()` at each call, and which changed between two."""

    def __init__(self, named: list[tuple[str, nn.Module]], unwatched: set[tuple[str, str]] = frozenset()):
        self.objects: list[tuple[str, dict, tuple[str, ...]]] = []  # (where, its __dict__, names never watched)
        self.set_by_forward: set[tuple[str, str]] = set()
        self.unwatched = set(unwatched)  # set by the forward at every call (`written`)
        # the modules' forward and backward hooks: read again where one was registered or removed anywhere
        # since (a handle made, a count changed)
        self.hook_dicts = [getattr(m, k) for _, m in named for k in _HOOKS]
        self.hook_mark: tuple[int, int] | None = None
        self.first_hooks: tuple | None = None  # the hooks at the first call: what programs are traced with
        self.hooks: tuple = ()  # which hooks are registered, where they differ from the first call's
        seen: set[int] = set()
        for path, m in named:
            self.objects.append((path or type(m).__name__, vars(m), ("training",)))
            for name, v in vars(m).items():
                if not isinstance(v, (nn.Module, torch.Tensor, type)) and hasattr(v, "to_dict") and id(v) not in seen:
                    seen.add(id(v))
                    self.objects.append((f"{path}.{name}" if path else name, vars(v), ()))
        self._scan()

    def of(self, named: list[tuple[str, nn.Module]]) -> _Attributes:
        """The same watch over a copy's modules (a deep copy of the `__dict__`s is not the copy's own)."""
        twin = _Attributes(named, self.unwatched)
        twin.set_by_forward = set(self.set_by_forward)
        twin.first_hooks = self.first_hooks  # a copy's hooks keep their handles' ids: the programs' keys hold
        return twin

    def _scan(self) -> None:
        """Watch each object's plain attributes (not what each process salts anew: the key is the compile
        cache's too); read in C where it can: a getter of the names, the types checked as one set."""
        self.watched: list[tuple[str, dict, tuple[str, ...]]] = []
        self.getters: list[tuple[dict, tuple[str, ...], Callable[[dict], tuple]]] = []
        for where, d, never in self.objects:
            names = tuple(
                k
                for k, v in d.items()
                if k not in never and k not in cache.SALTED and (where, k) not in self.unwatched and _plain(v)
            )
            if names:
                self.watched.append((where, d, names))
                get = operator.itemgetter(*names) if len(names) > 1 else (lambda d, n=names[0]: (d[n],))
                self.getters.append((d, names, get))
        self.dicts = [d for _, d, _ in self.objects]
        self.sizes = tuple(map(len, self.dicts))

    def values(self) -> tuple:
        if tuple(map(len, self.dicts)) != self.sizes:  # an attribute added or deleted since: watch what is now
            self._scan()
        mark = (RemovableHandle.next_id, sum(map(len, self.hook_dicts)))
        if mark != self.hook_mark:
            self.hook_mark = mark
            now = tuple((i, tuple(d)) for i, d in enumerate(self.hook_dicts) if d)  # by handle id
            self.first_hooks = now if self.first_hooks is None else self.first_hooks
            self.hooks = () if now == self.first_hooks else now  # (the compile cache's key has the hooks' code)
        out: list[tuple] = [self.hooks]
        for d, names, get in self.getters:
            try:
                vals = get(d)
            except KeyError:  # an attribute deleted and another added since
                vals = tuple(map(d.get, names))
            out.append(vals if _EXACT.issuperset(map(type, vals)) else tuple(map(_value, vals)))
        return tuple(out)

    def _differences(self, old: tuple, new: tuple) -> Iterator[tuple[str, str, Any, Any]]:
        """(where, name, old value, new value) of each watched attribute that differs."""
        for (where, _, names), a, b in zip(self.watched, old[1:], new[1:]):
            for name, x, y in zip(names, a, b):
                if x != y:
                    yield where, name, x, y

    def changed(self, old: tuple, new: tuple) -> str:
        if old[0] != new[0]:
            return "a module hook registered or removed"
        if not _same_names(old, new):
            return "an attribute added or deleted"
        for where, name, x, y in self._differences(old, new):
            return f"{where}.{name} = {y!r}, where it was {x!r}"
        return "other module attributes"

    def written(self, before: tuple, after: tuple) -> list[tuple[str, str]]:
        """The attributes the forward set while a program was traced that it set at another trace too (a
        counter, `self.calls += 1`): the program of each value would be a program per call. The caller
        decides (`CompiledModule._written_at_every_call`)."""
        if not _same_names(before, after):
            return []  # the forward added an attribute: the next call's program reads it (once)
        changed = [(where, name) for where, name, _, _ in self._differences(before, after)]
        again = [c for c in changed if c in self.set_by_forward]
        self.set_by_forward.update(changed)
        return again

    def unwatch(self, names: list[tuple[str, str]]) -> None:
        """Watch these no more: a call's key stops holding them."""
        self.unwatched.update(names)
        self._scan()

    def differ_only_in(self, old: tuple, new: tuple, names: list[tuple[str, str]]) -> bool:
        """Two `values()` of the same watched names that differ, and only in `names`."""
        if old[0] != new[0] or not _same_names(old, new):
            return False
        differing = {(where, name) for where, name, _, _ in self._differences(old, new)}
        return bool(differing) and differing <= set(names)


_ENTRY = 7  # where a call's key (`CompiledModule._key`) holds the submodule called ("" the model)
_ATTRIBUTES = 8  # where a call's key (`CompiledModule._key`) holds the values of the attributes


def _same_computation(a: Program, b: Program) -> bool:
    """Two programs of one call, traced at two values of an attribute, compute the same: the same graph
    (its constants' numbers included), the same tensor constants, the same plain results."""
    if str(a.graph) != str(b.graph) or a.constants.keys() != b.constants.keys():
        return False
    for name, x in a.constants.items():
        y = b.constants[name]
        if x.shape != y.shape or x.dtype != y.dtype or not (x.is_meta or y.is_meta or torch.equal(x, y)):
            return False  # (on meta, where nothing runs, the metadata alone)
    try:
        return bool(a.results.constants == b.results.constants)
    except Exception:  # a result that cannot say whether it equals another
        return False


def _same_names(old: tuple, new: tuple) -> bool:
    """Two `_Attributes.values()` of the same watched names (none added or deleted between them)."""
    return len(old) == len(new) and all(len(a) == len(b) for a, b in zip(old[1:], new[1:]))


def _difference(old: tuple, new: tuple, args: tuple, kwargs: dict, attributes: _Attributes | None = None) -> str:
    """What tells the call with key `new` from the one with key `old` (`_key`'s), in a user's words."""
    said = []
    if old[0] != new[0]:
        said.append("arguments of another structure (other keyword arguments, or None where a tensor was)")
    elif old[1] != new[1]:
        leaves = pytree.tree_flatten_with_path((args, kwargs))[0]
        path, a, b = next((path, a, b) for (path, _), a, b in zip(leaves, old[1], new[1]) if a != b)
        where = _argument_name(path)
        if _held(a) and _held(b):  # an argument object: where inside it (a tensor's shape, a number)
            at, a, b = objects.differences(a, b)[0]
            where += objects.path_text(at)
            if _held_tensor(a) and _held_tensor(b):
                a, b = a[1:], b[1:]  # as a tensor argument's signature: (shape, dtype, device, grad)
        tensors = isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 4
        if tensors and a[1:] == b[1:]:
            said.append(f"{where} of shape {tuple(b[0])}, where it was {tuple(a[0])}")
        else:
            said.append(f"{where} {str(b)[:80]}, where it was {str(a)[:80]}")
    labels = ("", "", "submodules' train()/eval() modes", "grad mode", "which parameters require grad")
    labels += ("recording (fbmt.inspect)", "autocast", "entry (the submodule called)", "", "the device traced for")
    said += [f"another {labels[i]}" for i in range(2, min(len(old), len(new))) if old[i] != new[i] and labels[i]]
    if attributes is not None and min(len(old), len(new)) > 8 and old[8] != new[8]:  # `_key`'s module attributes
        said.append(f"a module attribute set since: {attributes.changed(old[8], new[8])}")
    return "; ".join(said) or "another call signature"


@contextlib.contextmanager
def _apart_from_the_callers_autograd_modes() -> Iterator[None]:
    """Where a program is built: outside the autograd modes a caller may have on, which the trace (fake
    tensors under make_fx) cannot run in, and which act on the compiled call as it runs instead:
    inference_mode (a call under it traces as one under no_grad: what it computes), anomaly detection
    (its NaN checks read values; it checks the compiled backward's gradients at run time), and saved
    tensors' hooks (torch.utils.checkpoint's, save_on_cpu's: they would take the trace's fakes)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.autograd.set_detect_anomaly(False))
        with contextlib.suppress(RuntimeError):  # hooks turned off where the caller is (torch.func's transforms)
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(trace.itself, trace.itself))
        yield


def _dims_text(dims: dict[int, tuple[int, ...]]) -> str:
    return ", ".join(f"input {i} dimension{'s' * (len(ds) > 1)} {', '.join(map(str, ds))}" for i, ds in dims.items())


def _without_shapes(key: tuple, numbers: tuple[tuple[int, tuple], ...] = ()) -> tuple:
    """A call's key with each tensor's shape replaced by its number of dimensions, the tensors an
    argument object holds included (a Hugging Face cache, one longer at each step of `generate`), and
    the `numbers` argument objects hold that a program takes as sizes (NOTE: [Numbers in an object])."""

    def held(fp: Any) -> Any:  # inside `objects.fingerprint`: a tensor is ("T", shape, dtype, device, grad)
        if isinstance(fp, tuple) and len(fp) == 5 and fp[0] == "T" and isinstance(fp[1], tuple):
            return ("T", len(fp[1]), *fp[2:])
        return tuple(held(v) for v in fp) if isinstance(fp, tuple) else fp

    spec, sig, *rest = key
    bare = [(len(x[0]), *x[1:]) if isinstance(x, tuple) and x and isinstance(x[0], tuple) else held(x) for x in sig]
    for i, path in numbers:
        if i < len(bare):
            bare[i] = objects.replaced(bare[i], path, ("number",))
    return (spec, tuple(bare), *rest)


def _numbers_between(old: tuple, new: tuple) -> tuple[tuple[int, tuple], ...]:
    """(argument leaf, path) of each int that argument objects hold in two calls' signatures (`_key`'s),
    at least 0 in both, and differs: what a program may take as a size (NOTE: [Numbers in an object])."""
    found = []
    for i, (a, b) in enumerate(zip(old, new)):
        if a != b and _held(a) and _held(b):
            found += [
                (i, path)
                for path, x, y in objects.differences(a, b)
                if type(x) is int and type(y) is int and x >= 0 and y >= 0
            ]
    return tuple(found)


# a module a compile took over -> (the compiled model, its class name, the module's path there): where a call
# of the module alone goes (`_Routed`), and what `_called_alone`'s message names
_TAKEN_PATHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# NOTE: [Submodules through the program]
# A module a compile took over has only meta placeholders for parameters; their values live in the
# compiled model's shards. Code outside the model's forward still calls its submodules: encoder-decoder
# generate() runs `model.get_encoder()(...)` before the decoder steps, multimodal and prompt-tuning code
# builds `inputs_embeds` with `model.get_input_embeddings()(ids)`, evaluation code calls `model.lm_head(h)`.
# Each such module's `forward` is therefore routed (an instance attribute, a `_Routed`): while fbmt
# traces, it is the class's forward; outside, the call runs as a program of the compiled model whose
# entry is that submodule (`CompiledModule.call_submodule`), traced over the whole model's parameters, so
# the passes gather the groups it reads from the same shards and reduce its gradients into them. Calls
# with gradients train: autograd joins that program's backward to the next program's, as it joins two
# calls of the model. A module that already had a `forward` of its own on the instance (a library's
# hook) keeps it, and a call of it alone is refused, named, by `_called_alone`.
class _Routed:
    """The `forward` of a module a compile took over (NOTE: [Submodules through the program]): the class's
    while fbmt traces, a program of the compiled model outside. It presents the class's signature, which
    libraries read (generate() keeps the keyword arguments the encoder's forward names). A copy of the
    module (`copy.deepcopy`) gets a copy of it, bound to the copy."""

    def __init__(self, module: nn.Module):
        self.module = module

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.module).forward.__get__(self.module))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        if trace.tracing():
            return type(module).forward(module, *args, **kwargs)
        compiled, _, path = _TAKEN_PATHS[module]
        model = compiled()
        if model is None:
            raise RuntimeError(
                f"fbmt: `{path}` ({type(module).__name__}) was taken over by a compiled model that no longer exists; "
                "its parameters went with that model's shards"
            )
        return model(*args, **kwargs) if path == "" else model.call_submodule(path, args, kwargs)


def _called_alone(module: nn.Module, args: tuple) -> None:
    """A forward pre-hook on every module a compile took over whose forward cannot be routed (it had an
    instance `forward` of its own): outside fbmt's trace it has only meta placeholders for parameters,
    and a call of it would compute on meta tensors and fail later, far from here, or send the caller the
    wrong way; so it is refused where it happens."""
    if trace.tracing():
        return
    _, root, path = _TAKEN_PATHS.get(module, (None, "model", None))
    what = f"`{path}` ({type(module).__name__}) of a compiled {root}" if path else f"the {root} fbmt.compile took over"
    raise RuntimeError(
        f"fbmt: {what} was called on its own, and its forward is one of its own (an attribute of the instance, "
        "as a library's hook sets), which fbmt cannot run as a program of the compiled model. fbmt.compile moved "
        "its parameters into the compiled model's shards, so alone it has only meta placeholders to compute with. "
        "Call the compiled model itself, or remove the instance's forward before fbmt.compile"
    )


def _route(module: nn.Module) -> None:
    """Send calls of `module` outside fbmt's trace to the compiled model (NOTE: [Submodules through the
    program]); a module whose instance already has a forward is refused instead (`_called_alone`)."""
    if "forward" in module.__dict__:
        module.register_forward_pre_hook(_called_alone)
    else:
        module.forward = _Routed(module)


class CompiledModule(nn.Module):
    """A module compiled by `fbmt.compile`; see that function for the options."""

    def __init__(
        self,
        module: nn.Module,
        layout: Layout,
        shards: list[nn.Parameter],
        *,
        options: CompileOptions,
        plan: Plan,
        device: torch.device,
        rank: int,
        search: pipeline.Search | None = None,
    ):
        nn.Module.__init__(self)  # by name: a compiled Hugging Face model's class derives from the model's too
        self.__dict__["_orig"] = module  # not a submodule: its parameters are meta placeholders
        self.flat_params = nn.ParameterList(shards)
        self.layout, self.options, self.device, self.rank = layout, options, device, rank
        self.plan = plan  # every option resolved once (NOTE: [Plan])
        self.search = search  # remat="auto"'s (pipeline.Search)
        self.programs: dict[Any, Program] = {}
        self._executables: dict[Any, Executable] = {}
        self.program: Program | None = None
        self.compile_seconds = 0.0  # tracing, passes and partitioning, over every program built so far
        self._warned_shapes = False  # the warning that programs pile up for new input shapes, given once
        self._warned_numbers = False  # ... and for new values of a number argument
        self._sync = Unsynced(self._group_leaves)  # DDP's no_sync (NOTE: [Accumulation without sync])
        self._warned_sync = False
        self._input_shapes: dict[Any, list[tuple[int, ...]]] = {}  # a program's key -> its inputs' shapes
        self._admitted: dict[Any, Any] = {}  # a call's key -> the key of the symbolic program that runs it
        self._fixed_sizes: set[Any] = set()  # call families whose forward failed on symbolic sizes
        self._said_unused: set[tuple[str, ...]] = set()  # NOTE: [Unused parameters], warned once per set
        # backend="inductor": compiled compute regions, shared by all programs; made in worker processes
        # while the first steps run them as traced (NOTE: [Compiles in the background])
        background = plan.backend == "inductor" and in_background(
            options.background_compile, device, options.cuda_graph
        )
        self.regions = RegionCache(workers_for(device) if background else None)
        self.cache_dir = cache.resolve_dir(options.cache_dir)  # the compile cache (NOTE: [Compile cache]); None: off
        self._entries: list[Path] = []  # cache entries that take Inductor's artifacts as regions compile
        self._artifacts_at = 0  # regions compiled when the artifacts were last saved
        self._regions_on_disk: set[int] = set()  # programs (by id) whose cache entry held Inductor's regions
        # what every call reads, found once: walking the module tree on every call costs host time before the
        # step's first kernel
        self._submodules = list(module.modules())
        self._attributes = _Attributes(list(module.named_modules()))  # NOTE: [Attributes read as constants]
        self._buffer_owners: dict[str, tuple[nn.Module, str]] = {}  # buffer name -> (module, attribute)
        self._graphed: tuple[Any, Graphed] | None = None  # cuda_graph=True: (key, graphs) of one program
        self._placeholders = Placeholders(module, layout, shards)
        # this module's own mode, the model's as it is: a module of it the user set apart (a BatchNorm
        # frozen with `.eval()` in a model that trains) keeps its mode, as in eager PyTorch
        nn.Module.train(self, module.training)
        for m in module.modules():  # a copy of this module (`__deepcopy__`) copies the routes
            _route(m)
        self._adopt()

    def _adopt(self) -> None:
        """Register what this module owns beside it (`owners`): its shards' groups, the module it
        took over. A subclass adds what its integrations keep (the torch guards' shards)."""
        owners.own_shards(list(self.flat_params), self.layout.groups)
        owners.take(self._orig)
        for path, m in self._orig.named_modules():
            _TAKEN_PATHS[m] = (weakref.ref(self), type(self._orig).__name__, path)

    def __deepcopy__(self, memo: dict) -> CompiledModule:
        """A copy (an EMA twin) computes with copies of the shards, and owns them as the original owns
        its own (`_adopt`): a copy's gradient norms, shard groups and placeholders are known too."""
        cls = type(self)
        twin = cls.__new__(cls)
        memo[id(self)] = twin
        for k, v in self.__dict__.items():
            twin.__dict__[k] = copy.deepcopy(v, memo)
        twin._attributes = self._attributes.of(list(twin._orig.named_modules()))  # its modules' own __dict__s
        twin._adopt()
        return twin

    @property
    def compiled_from(self) -> nn.Module:
        """The module compile took over: its structure, buffers and attributes; its parameters are
        `meta` placeholders (their values live in `flat_params`). Not named `module`: scripts unwrap
        DDP with `model.module if hasattr(model, "module") else model`, and would save placeholders."""
        return self._orig

    # ---- calling ----
    # torch.compile around the compiled model would trace fbmt's runtime, and the trace a new program makes,
    # with Dynamo: the call runs as it is instead (fbmt.compile(..., backend="inductor") is Inductor's way in)
    @torch.compiler.disable
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("", args, kwargs)

    def call_submodule(self, path: str, args: tuple, kwargs: dict) -> Any:
        """`self.compiled_from.get_submodule(path)(*args, **kwargs)`, as a program of this model over its
        shards (NOTE: [Submodules through the program]); what a call of that submodule does."""
        self._orig.get_submodule(path)  # a path that names no submodule raises here, naming it
        return self._call(path, args, kwargs)

    def _call(self, entry: str, args: tuple, kwargs: dict) -> Any:
        """Run the program of this call of the model ("") or of its submodule at path `entry`."""
        if self.regions.pending:  # a step begins: it runs the regions compiled since the last one
            self.regions.poll()
        dtype = self.options.param_dtype
        if dtype is not None:  # mixed precision: floating inputs in the compute dtype, as FSDP2 does
            args, kwargs = pytree.tree_map_only(
                torch.Tensor, lambda x: x.to(dtype) if x.is_floating_point() else x, (args, kwargs)
            )
        leaves, _ = pytree.tree_flatten((args, kwargs))
        inputs = objects.input_tensors(leaves)
        for i, x in enumerate(inputs):
            # a number in a CPU tensor of no dimensions, which eager's ops take beside any device's (the size
            # of a sliding window a Hugging Face cache layer keeps before its first update)
            if x.device != self.device and not (x.dim() == 0 and x.device.type == "cpu"):
                raise ValueError(
                    f"fbmt: tensor input #{i} (shape {tuple(x.shape)}) is on {x.device}, but this "
                    f"model's parameters are on {self.device}; move the inputs with .to({str(self.device)!r})"
                )
        trainable = self.trainable()
        needs_grad = torch.is_grad_enabled() and (any(trainable) or any(x.requires_grad for x in inputs))
        key = self._key(args, kwargs, needs_grad, trainable, entry)
        self._keep_artifacts()
        key = self._admitted.get(key, key)  # a size a symbolic program ran before (NOTE: [Dynamic sizes])
        exe = self._executables.get(key)
        if exe is None:
            exe, key = self._symbolic_or_new(key, inputs, args, kwargs, needs_grad, trainable, entry)
        program = self.programs[key]
        if program.numbers:  # NOTE: [Numbers in an object]
            inputs = self._with_numbers(inputs, leaves, program.numbers)
        check_ranks_agree(exe.signature, program)
        if exe.updated_buffers and needs_grad and self.options.broadcast_buffers and self.layout.world_size > 1:
            broadcast_buffers(dict(self._orig.named_buffers()), exe.updated_buffers)
        feed = self._feed(exe, inputs)
        if exe.backward is None:
            with torch.no_grad():
                outs = exe.run_forward(*feed)[0]
        else:
            # recording ops and host calls run on the host, which a replayed graph does not
            graphed = self.options.cuda_graph and not exe.on_host
            runner = self._graphs(key, exe) if graphed else exe
            sync = None if graphed else self._sync  # graphs replay their reductions (NOTE: [Accumulation without sync])
            outs = RunProgram.apply(exe, runner, self._routes(), sync, *feed, *self._view_arguments())
        host_draws.leave(program.seeded)  # where eager's draws leave them (NOTE: [Host draws])
        held = program.sizes.values(inputs) if program.results.sized else None  # numbers its objects hold
        flat = program.results.assemble(dict(zip(exe.output_keys, outs)), leaves, self._orig, held)
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

    def wait_compiled(self) -> float:
        """backend="inductor" with background compiles: wait until every region met so far is
        compiled, so that the next call runs them all compiled (NOTE: [Compiles in the background]);
        the seconds waited. Benchmarks call it before timing steps."""
        started = time.perf_counter()
        self.regions.poll(wait=True)
        return time.perf_counter() - started

    def trainable(self) -> tuple[bool, ...]:
        """Per flat group: does any of its parameters require a gradient now."""
        self.check_parameters()
        return tuple(p.requires_grad for p in self.flat_params._parameters.values())

    def check_parameters(self) -> None:
        """The module's parameters are still the placeholders compile left, and `requires_grad_` on one
        or on a shard applies to its whole flat group (`runtime.params.Placeholders`)."""
        self._placeholders.check(list(self.flat_params._parameters.values()))

    def gradient_leaves(self) -> list[torch.Tensor]:
        """The tensors autograd accumulates this model's gradients into (the flat shards)."""
        return list(self.flat_params)

    def slot_views(self, group: int) -> list[torch.Tensor]:
        """Tensors that stand for this rank's part of each parameter of flat group `group`, beside its
        shard (BMTrain's per-parameter views); none here: the shard is the only one."""
        return []

    def _routes(self) -> Routes | None:
        """Which slice of each shard gradient is which extra argument's (view mode); None: the shards'."""
        return None

    def _view_arguments(self) -> list[torch.Tensor]:
        """Extra leaves given to the autograd function, after the forward's inputs (view mode)."""
        return []

    def executables(self) -> list[Executable]:
        """Every program built so far, as it runs (its forward and backward GraphModules)."""
        return list(self._executables.values())

    def _key(self, args: tuple, kwargs: dict, needs_grad: bool, trainable: tuple[bool, ...], entry: str = "") -> tuple:
        """What decides the program of a call: its arguments' structure and tensors' metadata, modes,
        grad mode, trainable groups, recording, autocast, and the submodule called ("" the model)."""
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
            entry,  # at _ENTRY
            self._attributes.values(),  # at _ATTRIBUTES
        )

    # ---- programs for many input sizes (NOTE: [Dynamic sizes]) ----
    def _symbolic_or_new(
        self,
        key: tuple,
        inputs: list[torch.Tensor],
        args: tuple,
        kwargs: dict,
        needs_grad: bool,
        trainable: tuple,
        entry: str,
    ) -> tuple[Executable, tuple]:
        """The Executable for a call no program has the key of, and the key it is kept under: a
        symbolic program that admits the call's sizes, else a new program (symbolic in the
        dimensions this call differs from an existing program in, where `dynamic=True`)."""
        leaves = pytree.tree_leaves((args, kwargs))
        for known, program in self.programs.items():
            numbers = program.numbers
            if program.sizes is None or _without_shapes(known, numbers) != _without_shapes(key, numbers):
                continue
            given = self._with_numbers(inputs, leaves, numbers)
            why_not = program.sizes.admits(given) if given is not None else "a number it takes is not there"
            if why_not is None:
                self._admitted[key] = known
                return self._executables[known], known
            log.info("a program of symbolic sizes does not take this call: %s", why_not)
        family = _without_shapes(key)
        if self._may_vary() and not any(_without_shapes(k) == family for k in self.programs):
            exe = self._family_from_cache(key, family, inputs)
            if exe is not None:
                return exe, key
        growing = self._growing(args, kwargs, inputs) if self._may_vary() else None
        found = self._varying(key, inputs) or growing or self._varied_in_other_modes(key, inputs)
        dims, numbers = found or ({}, ())
        family = _without_shapes(key, numbers)
        if family in self._fixed_sizes:
            dims, numbers = {}, ()
        if self._with_numbers(inputs, leaves, numbers) is None:  # not an int of at least 0 at every path
            dims, numbers = {}, ()
        dims = {**dims, **{len(inputs) + j: (0,) for j in range(len(numbers))}}
        at_most = self._bounds(key, dims, generating=bool(growing) and not needs_grad)
        exe = None
        if dims:
            said = _dims_text(dims) + "".join(f", {_number_name(at, args, kwargs)}" for at in numbers)
            log.info("one program for many input sizes: symbolic in %s (NOTE: [Dynamic sizes])", said)
            try:
                exe = self._build(
                    key,
                    args,
                    kwargs,
                    needs_grad,
                    trainable,
                    dynamic=dims,
                    numbers=numbers,
                    at_most=at_most,
                    entry=entry,
                )
            except Exception as e:  # a forward that needs its sizes as numbers (a size as a dict key, say)
                self._fixed_sizes.add(family)
                log.warning(
                    "fbmt: %s cannot be traced with symbolic sizes (%s), so each new input shape compiles a "
                    "program of its own (dynamic=False skips this attempt): %s",
                    type(self._orig).__name__,
                    said,
                    str(e).splitlines()[0] if str(e) else type(e).__name__,
                )
            fixed = exe is not None and self.programs[key].sizes is not None and self.programs[key].sizes.fixed()
            if fixed:  # the trace read the size as a number: symbolic attempts would each give one size
                self._fixed_sizes.add(family)
                log.warning(
                    "fbmt: %s's forward fixes the size that varies (%s), so a program holds for one shape and "
                    "each new input shape compiles a program of its own. Keep the size symbolic there (tensor "
                    "ops on x.shape, not int()/float()/math on it) for one program for every length",
                    type(self._orig).__name__,
                    fixed,
                )
        if exe is None:
            exe = self._build(key, args, kwargs, needs_grad, trainable, entry=entry)
        self._input_shapes[key] = [tuple(x.shape) for x in inputs]
        return exe, key

    def _with_numbers(
        self, inputs: list[torch.Tensor], leaves: list[Any], numbers: tuple[tuple[int, tuple], ...]
    ) -> list[torch.Tensor] | None:
        """A call's input tensors and, after them, an input for each of `numbers` (NOTE: [Numbers in an
        object]); None where one is not an int of at least 0."""
        if not numbers:
            return inputs
        values = [objects.number_at(leaves, at) for at in numbers]
        if any(v is None or v < 0 for v in values):
            return None
        return [*inputs, *(sizes.number_input(v, self.device) for v in values)]

    def _may_vary(self) -> bool:
        """Whether programs of symbolic sizes are made (`dynamic=True`; CUDA graphs replay fixed shapes)."""
        return self.options.dynamic and not self.options.cuda_graph

    def _family_from_cache(self, key: tuple, family: tuple, inputs: list[torch.Tensor]) -> Executable | None:
        """At the first call of a family (calls alike but for shapes), the symbolic program a run saved for
        it, where this call's own program is not in the cache and that one admits the call; else None
        (NOTE: [A family's program on disk]).

        NOTE: [A family's program on disk]
        A symbolic program is saved under the call it was traced at, which a warm run starting at another
        length never makes: it would compile a program for its first length, then find the symbolic one.
        So the symbolic program is saved under its family too (the call's key without its shapes), and the
        first call of a family whose own program the cache lacks runs it where it admits the call. Each
        rank decides alone, as `_from_cache` does, and for the same reason: a collective here would pair
        with the per-call agreement of a rank that is not at a new call. A rank whose disk lacks the entry
        compiles this call's program instead; the two programs compute the same call with the same
        collectives, which is what the per-call agreement compares (`check_ranks_agree`), and it stops
        every rank where they differ."""
        k, _ = self._cache_key((*family, ("symbolic family",)), self.device)
        own, _ = self._cache_key(key, self.device)
        if k is None or own is None or cache.exists(self.cache_dir, own) or not cache.exists(self.cache_dir, k):
            return None
        found = cache.load(self.cache_dir, k, self.layout)
        if found is None or found[0].sizes is None or found[0].sizes.admits(inputs) is not None:
            return None
        started = time.perf_counter()
        program = self._loaded(k, *found)
        exe = pipeline.lower(program, self.plan, self.regions, send=id(program) not in self._regions_on_disk)
        self.compile_seconds += time.perf_counter() - started
        self.programs[key], self._executables[key], self.program = program, exe, program
        self._input_shapes[key] = [tuple(x.shape) for x in inputs]
        log.info("compile cache: the family's program of symbolic sizes takes this call (%s)", program.sizes)
        return exe

    def _growing(
        self, args: tuple, kwargs: dict, inputs: list[torch.Tensor]
    ) -> tuple[dict[int, tuple[int, ...]], tuple[tuple[int, tuple], ...]] | None:
        """The dimensions of this call's inputs that the caller's next call passes longer, and the numbers
        its argument objects hold that it passes larger ((argument leaf, path) each, NOTE: [Numbers in an
        object]), where its convention says so at the first call (a cache each call extends): none for a
        plain module; a subclass adds what its integration knows (NOTE: [A cache that grows])."""
        return None

    def _grows_to(self) -> int:
        """How long the sizes `_growing` names may grow in the calls of one generation, where its convention
        bounds them (a model's longest position): a program of symbolic sizes for those calls admits that
        much instead of four times its traced sizes (NOTE: [A cache that grows]); 0 for a plain module."""
        return 0

    def _varying(
        self, key: tuple, inputs: list[torch.Tensor]
    ) -> tuple[dict[int, tuple[int, ...]], tuple[tuple[int, tuple], ...]] | None:
        """The dimensions in which this call's inputs differ from the programs of the same key but for shapes
        and the numbers argument objects hold, and those numbers (NOTE: [Numbers in an object]); None: no
        such program, or `dynamic=False`, or CUDA graphs, which replay fixed shapes.

        Every such program counts, not only the first: a batch of another size after lengths that varied
        differs from the first program in its batch alone, and from the one of many lengths in both, so the
        new program takes both as symbols, and the next batch of another size and length runs on it too."""
        if not self._may_vary():
            return None
        shapes = [tuple(x.shape) for x in inputs]
        dims: dict[int, set[int]] = {}
        numbers: dict[tuple[int, tuple], None] = {}  # ordered, without repeats
        for known, old in self._input_shapes.items():
            differ = _numbers_between(known[1], key[1]) if len(known[1]) == len(key[1]) else ()
            if _without_shapes(known, differ) != _without_shapes(key, differ) or len(old) != len(shapes):
                continue
            for i, (was, now) in enumerate(zip(old, shapes)):
                if was != now and len(was) == len(now):
                    dims.setdefault(i, set()).update(d for d, (a, b) in enumerate(zip(was, now)) if a != b)
            numbers.update(dict.fromkeys(differ))
        if not dims and not numbers:
            return None
        return {i: tuple(sorted(ds)) for i, ds in sorted(dims.items())}, tuple(numbers)

    def _bounds(self, key: tuple, dims: dict[int, tuple[int, ...]], generating: bool) -> dict[tuple[int, int], int]:
        """The bound of each symbol of a new program where it is above four times its traced size (NOTE:
        [Dynamic sizes]): a generation step's, the model's longest position (NOTE: [A cache that grows]);
        a dimension an earlier program of the key took as a symbol keeps that program's bound at least, so
        a program made for a batch of another size admits every length the one before admitted."""
        if generating:
            longest = self._grows_to()
            return {(i, d): longest for i, ds in dims.items() for d in ds} if longest else {}
        family, bounds = _without_shapes(key), {}
        for known, program in self.programs.items():
            if program.sizes is None or program.numbers or _without_shapes(known) != family:
                continue
            for at, symbol in program.sizes.symbols.items():
                span = program.sizes.shape_env.var_to_range.get(symbol)
                # sympy.Integer: not int_oo, torch's unbounded
                if span is not None and isinstance(span.upper, sympy.Integer) and at[1] in dims.get(at[0], ()):
                    bounds[at] = max(bounds.get(at, 0), int(span.upper))
        return bounds

    def _varied_in_other_modes(self, key: tuple, inputs: list[torch.Tensor]) -> tuple[dict, tuple] | None:
        """The dimensions in which the calls of the same arguments in other modes (with gradients or without,
        training or evaluating) varied: a first evaluation after training at many lengths takes them as symbols
        at once, as their next call would (NOTE: [Dynamic sizes]). None: no such calls, or none that varied."""
        if not self._may_vary():
            return None

        def bare(k: tuple) -> tuple:  # the arguments without shapes, nor whether a tensor requires grad; the entry
            spec, sig = _without_shapes(k)[:2]
            tensors = tuple(x[:3] if isinstance(x, tuple) and len(x) == 4 and isinstance(x[0], int) else x for x in sig)
            return spec, tensors, k[_ENTRY]

        mine = bare(key)
        seen = [old for known, old in self._input_shapes.items() if bare(known) == mine and len(old) == len(inputs)]
        dims = {}
        for i, x in enumerate(inputs):
            shapes = {s[i] for s in seen if len(s[i]) == x.dim()}
            varied = tuple(d for d in range(x.dim()) if len({s[d] for s in shapes}) > 1)
            if varied:
                dims[i] = varied
        return (dims, ()) if dims else None

    @pipeline.fewer_collections()  # NOTE: [Collections while compiling]
    @_apart_from_the_callers_autograd_modes()
    def _build(
        self,
        key: tuple,
        args: tuple,
        kwargs: dict,
        needs_grad: bool,
        trainable: tuple[bool, ...],
        device: torch.device | str | None = None,
        dynamic: dict[int, tuple[int, ...]] | None = None,
        numbers: tuple[tuple[int, tuple], ...] = (),
        at_most: dict[tuple[int, int], int] | None = None,
        entry: str = "",
    ) -> Executable:
        started = time.perf_counter()
        if self.programs:
            self._say_why_new(key, args, kwargs, numbers)
        where = torch.device(device) if device is not None else self.device
        # the key is made once, before tracing: a forward may change its modules' attributes as it runs; a
        # symbolic program's: the call it was traced at and its symbolic dimensions (NOTE: [Symbolic programs on disk])
        extra = ((numbers,) if numbers else ()) + ((("at most", tuple(sorted(at_most.items()))),) if at_most else ())
        symbolic = ("symbolic", sorted(dynamic.items()), *extra) if dynamic else None
        k, why_not = self._cache_key((*key, symbolic) if symbolic else key, where)
        before = self._attributes.values()
        cached = self._from_cache(k)
        if cached is not None:
            program = cached
        else:
            if where.type != "meta":  # while this program is traced (NOTE: [Compiles in the background])
                self.regions.start_workers()
            # not beside the loader thread's Inductor compile: make_fx (ours, and AOTAutograd's within
            # Inductor) keeps its current tracer and the node metadata it records in globals of the process
            with COMPILING:
                program = pipeline.compile_program(
                    self._orig,
                    self.layout,
                    self.plan,
                    args,
                    kwargs,
                    needs_grad=needs_grad,
                    trainable=trainable,
                    device=where,
                    search=self.search,
                    dynamic=dynamic,
                    numbers=numbers,
                    at_most=at_most,
                    entry=entry,
                )
            program.numbers = numbers
            program.origin = f"compiled in {time.perf_counter() - started:.2f}s"
            if k is not None:
                why_not = self._to_cache(k, program, time.perf_counter() - started)
            # NOTE: [A family's program on disk]; not one that takes numbers, which a family's first call cannot name
            if k is not None and dynamic and not numbers and not why_not:
                family, _ = self._cache_key((*_without_shapes(key), ("symbolic family",)), where)
                if family is not None:
                    self._to_cache(family, program, time.perf_counter() - started)
            if why_not:
                program.origin += f"; not kept in the compile cache: {why_not}"
        # after the trace, or the program's writes done again (`_loaded`): what the forward set on its modules
        again = self._attributes.written(before, self._attributes.values())
        if again and self._written_at_every_call(again, key, program):  # the next call's key: this program
            at = _ATTRIBUTES
            self._admitted[(*key[:at], self._attributes.values(), *key[at + 1 :])] = key
        exe = pipeline.lower(program, self.plan, self.regions, send=id(program) not in self._regions_on_disk)
        self._say_unused(program)
        log.info("program %d built in %.2fs", len(self.programs) + 1, time.perf_counter() - started)
        self.compile_seconds += time.perf_counter() - started
        self.programs[key], self._executables[key], self.program = program, exe, program
        return exe

    def _written_at_every_call(self, names: list[tuple[str, str]], key: tuple, program: Program) -> bool:
        """The forward sets these attributes at every call (NOTE: [Attributes read as constants]). Where the
        program of the value before is the same as this one, the forward does not compute with them: they
        are watched no more, and keep the value they have now, which fbmt says. Where it is another, each
        call would compile a program: refused, naming them. With no such program to tell by (this call
        differs in more than them), they stay watched: a program per value, as eager computes. True where
        they are watched no more."""
        said = ", ".join(f"{where}.{name}" for where, name in names)
        at = _ATTRIBUTES
        for known, other in self.programs.items():
            if len(known) != len(key) or known[:at] + known[at + 1 :] != key[:at] + key[at + 1 :]:
                continue
            if not self._attributes.differ_only_in(known[at], key[at], names):
                continue
            if not _same_computation(other, program):
                raise RuntimeError(
                    f"fbmt: the forward sets {said} at every call and computes with it: a compiled program "
                    "runs no Python, so each value would compile a program of its own. Pass the value to the "
                    "forward as an argument (a tensor, which the program reads at every call), or keep it "
                    "outside the forward"
                )
            log.warning(
                "fbmt: the forward sets %s at every call; the program does not compute with it and runs no "
                "Python, so from this call on it keeps the value it has now, where eager's would change at "
                "every call. Keep it outside the forward (count the steps in the training loop)",
                said,
            )
            self._attributes.unwatch(names)
            return True
        return False

    # ---- the compile cache (NOTE: [Compile cache]) ----
    def _cache_key(self, key: tuple, where: torch.device) -> tuple[cache.Key | None, str]:
        """This call's key in the compile cache, or None and why not (the cache is off, or the program
        cannot be keyed)."""
        if self.cache_dir is None:
            return None, ""
        if self.plan.dump_dir:
            return None, "dump_dir asks for every pass's program"
        try:
            return cache.make_key(self._orig, self.layout, self.plan, key, where), ""
        except cache.Uncacheable as e:
            log.info("compile cache: this program is compiled every time: %s", e)
            return None, str(e)

    def _from_cache(self, k: cache.Key | None) -> Program | None:
        """The program of key `k` loaded from the cache, or None.

        Each rank decides alone: a rank that loads and one that compiles (another machine's disk held
        no entry) have the same program, and the agreement before every call (`check_ranks_agree`)
        compares what they run whatever its origin. A collective of its own here would pair with that
        check on a rank that is not building, and hide the rank that runs another program."""
        found = cache.load(self.cache_dir, k, self.layout) if k is not None else None
        if found is None:
            if k is not None:
                log.info("compile cache: miss (%s): %s", k.digest[:8], cache.why_missed(self.cache_dir, k))
            return None
        return self._loaded(k, *found)

    def _loaded(self, k: cache.Key, program: Program, entry: cache.Entry) -> Program:
        """A program loaded from the cache, said as such, with Inductor's artifacts of its entry."""
        program.origin = (
            f"loaded from the compile cache ({entry.path}; compiled in {entry.about.get('compile_seconds')}s "
            f"on {entry.about.get('saved')})"
        )
        log.info("compile cache: hit %s (%d nodes)", k.digest[:8], len(program.graph.nodes))
        for path, name, value in program.writes:  # as its trace left them (NOTE: [What a forward keeps on
            # its modules] in fbmt/compiler/trace.py)
            vars(self._orig.get_submodule(path))[name] = value
        if self.plan.backend == "inductor":
            if cache.load_artifacts(entry.path):
                missing = cache.artifacts_missing(entry.path)
                if missing is not None and missing <= LOADED_AT_MOST_MISSING:
                    self._regions_on_disk.add(id(program))  # they load here faster than workers start
                else:
                    log.info(
                        "compile cache: the entry lacks %s of its regions (its run stopped while they compiled); "
                        "they compile in workers",
                        "some" if missing is None else missing,
                    )
            self._entries.append(entry.path)
        return program

    def _to_cache(self, k: cache.Key, program: Program, seconds: float) -> str:
        """Keep a program just compiled in the cache (the first rank of each machine writes it); returns
        why it was not kept, or ""."""
        cache.trim(program)  # as a loaded program is, so both lower alike
        if not cache.writer():
            return ""
        try:
            path = cache.save(self.cache_dir, k, program, seconds)
        except cache.Uncacheable as e:
            log.info("compile cache: this program is compiled every time: %s", e)
            return str(e)
        except OSError as e:
            log.warning(
                "fbmt: the compile cache could not save into %s (%s); the next run compiles again", self.cache_dir, e
            )
            return f"{type(e).__name__}: {e}"
        program.origin += f"; saved to the compile cache ({path})"
        log.info("compile cache: saved %s", path)
        if self.plan.backend == "inductor":
            self._entries.append(path)
        return ""

    def _keep_artifacts(self) -> None:
        """Add Inductor's regions compiled since the last call to this model's cache entries. Not while
        the loader thread compiles (it records artifacts that the save reads): the next call saves."""
        if not (self._entries and self.regions.misses != self._artifacts_at and cache.writer()):
            return
        if not COMPILING.acquire(blocking=False):
            return
        try:
            self._artifacts_at = self.regions.misses
            for path in self._entries:
                try:
                    cache.save_artifacts(path, compiling=len(self.regions.pending))
                except Exception as e:  # torch's own format and files: a failure costs a later compile, not this step
                    log.warning("fbmt: the compile cache could not save Inductor's artifacts into %s (%s)", path, e)
        finally:
            COMPILING.release()

    def _say_unused(self, program: Program) -> None:
        """Warn, once per set, of trainable parameters a program does not read whose shards' gradients
        hold zeros for them where eager leaves `.grad` None (NOTE: [Unused parameters] in passes/shard.py)."""
        try:
            unused = tuple(program.stats("shard").unused)
        except (KeyError, AttributeError):  # no shard pass ran (forward only), or a stats record without it
            return
        if not unused or unused in self._said_unused:
            return
        self._said_unused.add(unused)
        names = ", ".join(unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
        log.warning(
            "fbmt: this call of %s does not use %s: %s. Eager PyTorch leaves an unused "
            "parameter's .grad None and the optimizer skips it; these share a flat shard with parameters the "
            "call uses, so their gradients are zeros, and an optimizer with weight decay (AdamW) or momentum "
            "still changes them. To keep them as they are, freeze them before fbmt.compile "
            "(.requires_grad_(False))",
            type(self._orig).__name__,
            f"{len(unused)} trainable parameter{'s' if len(unused) > 1 else ''}",
            names,
        )

    def _say_why_new(self, key: tuple, args: tuple, kwargs: dict, taken: tuple = ()) -> None:
        """Log what differs from the last program built; warn once when programs pile up for input
        shapes alone (each new sequence length traces and compiles again), or for numbers the program
        does not take as sizes (`taken`: those it does)."""
        last = next(reversed(self.programs))
        why = _difference(last, key, args, kwargs, self._attributes)
        log.info("a new program for %s (%d built so far)", why, len(self.programs))
        # the programs of calls like this one but for shapes (and numbers): a prompt's program before them is not
        alike = [k for k in self.programs if k[0] == key[0] and k[2:] == key[2:]]
        numbers = _numbers_differing(last[1], key[1], args, kwargs) if key[0] == last[0] and not taken else []
        by_number = numbers and sum(_same_but_shapes(k[1], key[1], numbers=True) for k in alike) + 1 >= _SHAPES_WARNING
        if by_number and not self._warned_numbers:
            self._warned_numbers = True
            if all("." in n for n in numbers):  # held by argument objects, which fbmt cannot pass a tensor into
                log.warning(
                    "fbmt: program %d for %s: a number an argument object holds (%s) is traced as a constant, so "
                    "each new value traces and compiles a program (%.1fs so far). A Hugging Face cache whose "
                    "layers keep a sliding window counts its tokens so. With dynamic=True (the default) and no "
                    "CUDA graphs, a program takes such a number as a size where the forward computes with it as "
                    "one (FBMT_LOG=info says why a program did not)",
                    len(self.programs) + 1,
                    why,
                    ", ".join(numbers[:3]) + (f" and {len(numbers) - 3} more" if len(numbers) > 3 else ""),
                    self.compile_seconds,
                )
                return
            log.warning(
                "fbmt: program %d for %s: a number among a call's arguments (%s) is traced as a constant, so "
                "each new value traces and compiles a program (%.1fs so far). Pass it as a tensor (torch.tensor(n), "
                "as Hugging Face's Trainer passes num_items_in_batch): one program then takes every value",
                len(self.programs) + 1,
                why,
                ", ".join(numbers),
                self.compile_seconds,
            )
        by_shape = sum(_same_but_shapes(k[1], key[1]) for k in alike) + 1 >= _SHAPES_WARNING
        if by_shape and not self._warned_shapes:
            self._warned_shapes = True
            log.warning(
                "fbmt: program %d for new input shapes (%s): each shape no compiled program admits traces and "
                "compiles a new program (%.1fs so far): with dynamic=False every new shape, with dynamic=True "
                "(the default) a shape a symbolic program's assumptions refuse (print(model.program) lists "
                "them). Pad batches to a few fixed lengths to bound them (Hugging Face: "
                "DataCollatorWithPadding(pad_to_multiple_of=64), or the tokenizer's padding='max_length')",
                len(self.programs) + 1,
                why,
                self.compile_seconds,
            )

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

    # ---- CUDA graphs (cuda_graph=True) ----
    def _graphs(self, key: Any, exe: Executable) -> Graphed:
        """The CUDA graphs of this training program (NOTE: [CUDA graphs]); one program's at a time."""
        if self._graphed is None or self._graphed[0] != key:
            if self._graphed is not None:
                log.info("fbmt: cuda_graph: new input signature; dropping the previous program's graphs")
            self.release_graphs()  # the old graphs' pool goes before the new one is made
            self._graphed = (key, Graphed(exe, self.device, self.gradient_leaves()))
        return self._graphed[1]

    def release_graphs(self) -> None:
        """Drop the CUDA graphs of `cuda_graph=True` and their memory; the next calls warm up and
        capture again. Call it before `dist.destroy_process_group()`, which otherwise waits for them."""
        if self._graphed is not None:
            self._graphed[1].release()
            self._graphed = None

    @property
    def graphs(self) -> Graphed | None:
        """The CUDA graphs of the program captured last (cuda_graph=True), or None."""
        return self._graphed[1] if self._graphed is not None else None

    @property
    def capture_seconds(self) -> float:
        """Seconds spent capturing CUDA graphs (cuda_graph=True), 0 before the capture."""
        return self._graphed[1].capture_seconds if self._graphed is not None else 0.0

    # ---- accumulation loops written for DDP and FSDP (NOTE: [Accumulation without sync]) ----
    @contextlib.contextmanager
    def no_sync(self) -> Any:
        """DDP's `no_sync()`: backward passes within accumulate gradients on this rank; the first backward
        after it reduces them with its own, once (accelerate's `accumulate()` and loops written for DDP
        call it). See `set_requires_gradient_sync`."""
        was = self.require_backward_grad_sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(was)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's: whether backward passes reduce gradients over ranks. Off, each backward adds each flat
        group's gradient into a buffer of this rank's own (a full gradient per group, as DDP keeps); the
        next backward with sync on reduces the sum once, in the reduction its program already runs, so
        each group is reduced once per optimizer step. With `cuda_graph=True` the graphs replay their
        reductions, so every micro-batch still reduces (the same sums; said once, as a warning)."""
        if not requires_gradient_sync and self.options.cuda_graph and not self._warned_sync:
            self._warned_sync = True
            log.warning(
                "fbmt: gradient sync turned off (no_sync() or set_requires_gradient_sync(False)) on a model compiled "
                "with cuda_graph=True: its graphs replay the reductions they captured, so each micro-batch's gradients "
                "are still reduced as they go; they accumulate in the shards to the same sums"
            )
        self._sync.deferring = not requires_gradient_sync

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's and FSDP1's attribute for `no_sync` (see `set_requires_gradient_sync`)."""
        return not self._sync.deferring

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.set_requires_gradient_sync(value)

    @property
    def gradient_reductions(self) -> int:
        """How many flat groups' gradients this rank's backward passes have reduced over ranks so far
        (a group's reduction counts once; accumulation without sync runs none until its last backward)."""
        return self._sync.reductions

    def _group_leaves(self, group: int) -> list[torch.Tensor]:
        """The tensors that receive flat group `group`'s gradient: its shard, and its views in view mode."""
        return [self.flat_params[group], *self.slot_views(group)]

    # ---- module protocol ----
    def to(self, *args: Any, **kwargs: Any) -> CompiledModule:
        """Move the shards to a device; a dtype other than the shards' is refused (`_keep_dtype`)."""
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None:
            self._keep_dtype(dtype, "to")
        if self.options.offload and device is not None and not _same_device(job.compute_device(device), self.device):
            raise ValueError(
                f"fbmt: model.to({str(device)!r}) on a model compiled with offload=True for {self.device}: its "
                "shards stay in host memory and its programs compute on that device; compile it with "
                f"device={str(device)!r} to compute there"
            )
        return nn.Module.to(self, *args, **kwargs)

    def _apply(self, fn: Any, recurse: bool = True) -> CompiledModule:
        """What `to`, `cuda`, `cpu` and `type` do to the shards: a cast (`model.type(torch.float16)`) is
        refused as `to` refuses it, and so is a move to another device than the programs' (the same one
        is nothing: Trainer moves the model to its device); with offload=True nothing else either, the
        shards stay in host memory (NOTE: [Offload] in passes/shard.py; `to` refuses another device)."""
        for dtype in {p.dtype for p in self.flat_params}:
            cast = fn(torch.empty(0, dtype=dtype)).dtype  # what fn would make of a shard
            if cast != dtype:
                self._keep_dtype(cast, "type")
        if self.options.offload:
            return self
        if self.device.type != "meta" and not _same_device(
            moved := fn(torch.empty(0, device=self.device)).device, self.device
        ):
            # the programs hold the device in their factories, streams and kernels: shards moved under them
            # would make every call fail in a product of two devices, or refuse inputs on the new one
            raise ValueError(
                f"fbmt: moving a model compiled for {self.device} to {moved} after fbmt.compile; its programs were "
                f"compiled for {self.device}. Move the model before compiling (fbmt.compile(model.to({str(moved)!r}))) "
                f"or compile with device={str(moved)!r}"
            )
        return nn.Module._apply(self, fn, recurse)

    def half(self) -> CompiledModule:
        self._keep_dtype(torch.float16, "half")
        return self

    def bfloat16(self) -> CompiledModule:
        self._keep_dtype(torch.bfloat16, "bfloat16")
        return self

    def float(self) -> CompiledModule:
        self._keep_dtype(torch.float32, "float")
        return self

    def double(self) -> CompiledModule:
        self._keep_dtype(torch.float64, "double")
        return self

    def _keep_dtype(self, dtype: torch.dtype, call: str) -> None:
        """The shards' dtypes are the layout's, which every program was traced with: casting them after
        compile would make each call fail in a product of mismatched dtypes."""
        stored = {g.dtype for g in self.layout.groups if g.dtype.is_floating_point}
        if stored - {dtype}:
            raise TypeError(
                f"fbmt: model.{call}(...) would cast a compiled model's flat shards ({sorted(map(str, stored))}) to "
                f"{dtype}; the programs were compiled for their dtypes. To compute in {dtype} while the shards and the "
                f"optimizer keep theirs, compile with fbmt.compile(model, param_dtype={dtype}); to store the model in "
                f"{dtype}, cast it before compiling: fbmt.compile(model.to({dtype}))"
            )

    def train(self, mode: bool = True) -> CompiledModule:
        nn.Module.train(self, mode)
        self._orig.train(mode)
        return self

    # NOTE: [The compiled model's modules]
    # Scripts change a model through its module tree: `for m in model.modules(): if isinstance(m,
    # nn.Dropout): m.p = 0.0`, `model.apply(fn)`, a search for the layers of a kind. A compiled model's own
    # tree is itself and its flat shards' list, so such a loop would find nothing and change nothing,
    # silently. `modules()`/`named_modules()` list this module in the place of the model it compiled, that
    # model's modules under their paths, then the shards' list; `apply` visits them all, children first.
    # What a loop sets there the next call reads (NOTE: [Attributes read as constants]); what it does to
    # their parameters, `meta` placeholders, raises and names the parameter. The parameters stay the
    # shards (`named_parameters`, what an optimizer steps), and `children()` stays this module's own:
    # `to()`, `train()` and `state_dict()` walk it, and on the placeholders they would move or save nothing.
    @contextlib.contextmanager
    def by_names(self) -> Iterator[None]:
        """Within: `named_parameters()` names the compiled model's parameters (placeholders), for library
        code that reads the names to key a state dict it then loads (NOTE: [Adapters loaded by name] in
        fbmt/integrations/transformers.py)."""
        before = self.__dict__.get("_by_names", False)
        self.__dict__["_by_names"] = True
        try:
            yield
        finally:
            self.__dict__["_by_names"] = before

    def named_modules(self, memo: set | None = None, prefix: str = "", remove_duplicate: bool = True) -> Any:
        """This module, the compiled model's modules under their paths, then the flat shards' list
        (NOTE: [The compiled model's modules])."""
        memo = set() if memo is None else memo
        own = nn.Module.named_modules(self, memo, prefix, remove_duplicate)
        yield from itertools.islice(own, 1)  # this module, where the model it compiled stood
        for path, m in self._orig.named_modules(memo, prefix, remove_duplicate):
            if m is not self._orig:
                yield path, m
        yield from own

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Any:
        """This rank's flat shards (`flat_params.N`), which an optimizer steps; the compiled model's own
        parameters are `meta` placeholders (NOTE: [The compiled model's modules]). Within `by_names()`, the
        compiled model's parameters by their names, as placeholders."""
        if self.__dict__.get("_by_names"):
            yield from self._orig.named_parameters(prefix, recurse, remove_duplicate)
            return
        modules = nn.Module.named_modules(self, prefix=prefix, remove_duplicate=remove_duplicate)
        seen: set[nn.Parameter] = set()
        for path, m in modules if recurse else [(prefix, self)]:
            for name, p in m._parameters.items():
                if p is None or p in seen:
                    continue
                if remove_duplicate:
                    seen.add(p)
                yield (f"{path}.{name}" if path else name), p

    def apply(self, fn: Callable[[nn.Module], None]) -> CompiledModule:
        """`fn` on each module `modules()` lists, children before their parents, as eager applies it
        (NOTE: [The compiled model's modules])."""
        for _, m in reversed(list(self.named_modules())):
            fn(m)
        return self

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Any:
        """The original module's buffers (replicated on every rank, not sharded)."""
        return self._orig.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def gather(self, group: int) -> torch.Tensor:
        """The whole flat buffer of flat group `group` (a collective: call it on every rank)."""
        return gather_group(self.flat_params[group].detach(), self.layout.groups[group], self.device)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, gathered whole, by canonical name (a collective: call it on every rank)."""
        out = {}
        with torch.no_grad():
            for group, shard in zip(self.layout.groups, self.flat_params):
                flat = gather_group(shard, group, self.device)
                for s in group.slots:
                    out[s.name] = flat[s.offset : s.offset + s.numel].view(s.shape).clone()
        return out

    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        """Every parameter's gradient, gathered whole (a collective: call it on every rank)."""
        out: dict[str, torch.Tensor | None] = {}
        for group, shard in zip(self.layout.groups, self.flat_params):
            flat = gather_group(shard.grad, group, self.device) if shard.grad is not None else None
            for s in group.slots:
                out[s.name] = None if flat is None else flat[s.offset : s.offset + s.numel].view(s.shape).clone()
        return out

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The original module's state dict, with full (gathered) parameters. A collective."""
        self.check_parameters()
        full = self.full_parameters()
        out = OrderedDict() if destination is None else destination
        for k, v in self._orig.state_dict(keep_vars=True).items():
            out[prefix + k] = full[self.layout.aliases[k]] if k in self.layout.aliases else v.detach()
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load full tensors (as `state_dict()` returns); each rank keeps only its shard."""
        self.check_parameters()
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


def _same_device(a: torch.device, b: torch.device) -> bool:
    """One device, however it is written: "cpu" and "cpu:0" are the host (Trainer writes the latter)."""
    return a.type == b.type and (a.type == "cpu" or a.index is None or b.index is None or a.index == b.index)
