"""The compile cache: a program built once is loaded by every later run of the same job.

NOTE: [Compile cache]
Tracing and the passes take seconds to minutes on a big model, and what they make depends only on
what the model computes and how it is compiled. So each Program the pipeline builds is saved on
disk under a key of everything that decides it (`key`), in parts:

    code      the code as it runs in this process, by Python module: the code objects (bytecode,
              constants, names, defaults) of every function and class defined in the modules of
              the model's classes and of a registered strategy the options name; the user's
              modules also by their plain globals, and followed to every module their globals come
              from; a library's (standard library, installed package, no Python source) by its
              version instead, and not followed
    model     the module tree: each module's class, attributes (a Hugging Face config included),
              hooks, and each parameter's and buffer's shape, dtype and requires_grad
    layout    the flat groups and the world size they are sharded for; ranks per node
    options   the resolved options (NOTE: [Plan])
    call      the call's signature: its structure, each tensor's shape, dtype and device, plain
              values, train/eval and grad modes, autocast, and the device traced for
    registries  fbmt's tables a user may add to: the collective kinds and the schedule strategies
    settings  torch's process-wide settings a trace reads (attention kernels enabled, default
              dtype, deterministic algorithms, float32 matmul precision)
    versions  the digest of fbmt's own sources, torch, transformers, Python, the entry format

A run looks its key up before tracing. Each rank loads or compiles alone: a rank that found its
entry and one that did not (another machine's disk) end with the same program, and the agreement
before every call (`agreement.check_ranks_agree`) compares what every rank runs, whatever its
origin; a collective of the cache's own would pair with that check on a rank not building and
hide the rank that runs another program. A miss says why under FBMT_LOG:
which parts differ from the closest entry of the same model class. Inductor's compiled regions are
kept by torch's own FX graph and AOTAutograd caches (`runtime/regions.py` compiles them where
those caches can key them); fbmt adds torch's cache artifacts (`torch.compiler.save_cache_artifacts`)
to the entry once the regions have compiled, and loads them before a loaded program first runs, for
a machine whose torch caches are empty (on a CPU, Inductor builds its C++ kernels again all the same).
A key is the same in every process (no object's address, no set in the order of salted hashes,
no value a library draws at import): tests/test_cache.py checks it across hash seeds.

An entry is a folder written whole (a temporary folder renamed into place: a reader never sees half
of one) by the first rank of each machine: `program.pkl` (the Program, its graph as a list of nodes
with their `meta` facts and each value's shape, dtype and strides; nothing that runs), `about.json`
(the key's parts, the pickle's SHA-256, the model, when it was saved) and, with Inductor,
`inductor.bin` beside its SHA-256 (`inductor.sha256`: compiled code is loaded only where it holds),
and `inductor.json` (how many regions were still compiling when they were saved).
An entry whose checksum, format or contents do not hold is ignored with a warning and deleted;
nothing unverified is loaded. A model whose key cannot be made (an attribute with no stable
description) is compiled every time, and FBMT_LOG says why. Programs of symbolic sizes are kept too
(NOTE: [Symbolic programs on disk]).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import io
import json
import logging
import os
import pickle
import shutil
import sys
import sysconfig
import types
import uuid
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from fbmt import flags, job
from fbmt.compiler import objects
from fbmt.compiler.layout import Layout
from fbmt.compiler.program import Program

log = logging.getLogger("fbmt")
FORMAT = 2  # the entry format: a change of what an entry holds or how bumps it
_KEPT_META = ("val", "fbmt_")  # the node facts a Program's readers use (`meta`, and each value's shape)


class Uncacheable(Exception):
    """This program cannot be keyed or saved; the message says what stands in the way."""


# ---- where ---------------------------------------------------------------------------------


def default_dir() -> Path | None:
    """$FBMT_CACHE_DIR, else ~/.cache/fbmt/compile ($XDG_CACHE_HOME's fbmt/compile); None: "off"."""
    given = flags.CACHE_DIR.get()
    if given.lower() in ("off", "0", "none"):
        return None
    if given:
        return Path(given).expanduser()
    base = flags.XDG_CACHE_HOME.get() or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fbmt" / "compile"


def resolve_dir(option: str | os.PathLike | bool | None) -> Path | None:
    """The folder `fbmt.compile(cache_dir=...)` means: None or True the default, False off."""
    if option is None or option is True:
        return default_dir()
    if option is False:
        return None
    return Path(option).expanduser()


# ---- the key -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Key:
    parts: dict[str, str]  # part -> its digest (NOTE: [Compile cache])
    model: str  # the model's class, to find the closest entry on a miss
    modules: dict[str, str]  # the code part by Python module, to name the modules that differ on a miss

    @property
    def digest(self) -> str:
        return _sha("\n".join(f"{k}={v}" for k, v in sorted(self.parts.items())))[:32]


def _sha(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def make_key(module: nn.Module, layout: Layout, plan: Any, call: tuple, device: torch.device) -> Key:
    """The key of the program `module` compiles to for `call` (CompiledModule's call key); raises
    `Uncacheable` where a part has no description that is the same in every process, or where
    describing one fails (a compile never fails for its cache's sake)."""
    try:
        return _make_key(module, layout, plan, call, device)
    except Uncacheable:
        raise
    except Exception as e:
        raise Uncacheable(f"describing the model for its key failed ({type(e).__name__}: {str(e)[:200]})") from None


def _make_key(module: nn.Module, layout: Layout, plan: Any, call: tuple, device: torch.device) -> Key:
    strategy = plan.strategy if isinstance(plan.strategy, str) else None
    modules = _code_digest(module, strategy)
    described = {
        "code": repr(sorted(modules.items())),
        "model": _describe_module(module),
        "layout": f"{layout!r} ranks per node {job.ranks_per_node(layout.world_size)}",
        "options": repr(dataclasses.replace(plan, dump_dir=None)),
        "call": f"{_stable(repr(call), 'the call')} on {device}",
        "registries": _stable(_registries(), "the registered collective kinds and strategies"),
        "settings": _settings(),
        "versions": _versions(),
    }
    _stable(described["options"], "the options")
    model = f"{type(module).__module__}.{type(module).__qualname__}"
    return Key({k: _sha(v)[:16] for k, v in described.items()}, model, modules)


def _registries() -> str:
    """What fbmt's tables hold that a program depends on: the collective kinds (one a user registers
    changes what the shard pass emits) and the schedule strategies, by their code."""
    from fbmt.compiler import collectives
    from fbmt.compiler.passes import STRATEGIES

    return _describe([collectives.kinds(), STRATEGIES], {}, set(), 0)


def _settings() -> str:
    """torch's process-wide settings that a trace reads: the attention kernels it may choose, the
    dtype of the constants a forward makes, deterministic algorithms."""
    sdp = torch.backends.cuda
    return (
        f"sdp flash {sdp.flash_sdp_enabled()} mem_efficient {sdp.mem_efficient_sdp_enabled()} "
        f"math {sdp.math_sdp_enabled()} cudnn {sdp.cudnn_sdp_enabled()} cudnn_backend {torch.backends.cudnn.enabled} "
        f"default dtype {torch.get_default_dtype()} deterministic {torch.are_deterministic_algorithms_enabled()} "
        f"float32 matmul {torch.get_float32_matmul_precision()}"
    )


def _stable(text: str, what: str) -> str:
    """`text`, if it says the same in every process (no object address, no object identity)."""
    if " at 0x" in text or "'opaque'" in text:
        at = text.find(" at 0x") if " at 0x" in text else text.find("'opaque'")
        raise Uncacheable(f"{what} hold an object with no stable description ({text[max(0, at - 60) : at + 20]}...)")
    return text


@functools.cache
def _fbmt_digest() -> str:
    """fbmt's own Python sources: a program depends on every pass and table of them."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _versions() -> str:
    transformers = sys.modules.get("transformers")
    return (
        f"format {FORMAT} fbmt {_fbmt_digest()[:16]} torch {torch.__version__} "
        f"transformers {getattr(transformers, '__version__', None)} python {sys.version.split()[0]}"
    )


def _library_dirs() -> tuple[str, ...]:
    """Where installed packages and the standard library live, however this Python was installed."""
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    dirs |= {os.path.dirname(os.__file__), os.path.dirname(torch.__file__)}
    return tuple(os.path.realpath(d) + os.sep for d in dirs)


def _is_users(mod: types.ModuleType) -> bool:
    """A module of the user's own (followed through its globals, its plain values keyed): Python source
    outside the standard library and installed packages, or a notebook's or script's `__main__`. A
    module with no Python source (built into the interpreter, compiled) is a library's."""
    if mod.__name__ == "__main__":
        return True
    path = getattr(mod, "__file__", None) or ""
    if not path.endswith(".py") or mod.__name__.split(".")[0] in sys.stdlib_module_names:
        return False
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    return not (path.startswith(_library_dirs()) or "site-packages" in parts or "dist-packages" in parts)


def _module_of(obj: Any) -> types.ModuleType | None:
    """The module `obj` is, or the one a function or class was defined in."""
    if isinstance(obj, types.ModuleType):
        return obj
    return sys.modules.get(getattr(obj, "__module__", None) or "")


def _code_digest(module: nn.Module, strategy: str | None) -> dict[str, str]:
    """The code the model runs, as it runs in this process (NOTE: [Compile cache], part code).

    From the Python modules that define the model's classes (and a registered strategy the options
    name), each module is described by the code objects of every function and class defined in it
    (bytecode, constants, names, defaults: what is loaded, not what the file says now, so a file
    edited after its import or a class typed into a notebook are keyed as they run) and its plain
    global values. A user's module leads on to every module its globals come from; a library's (an
    installed package, the standard library) does not, and its package's version stands for the
    rest of it. fbmt's own code is in the versions part."""
    classes = {c for m in module.modules() for c in type(m).__mro__ if c not in (nn.Module, object)}
    roots: list[Any] = [c for c in classes if not c.__module__.startswith(("torch.", "fbmt."))]
    if strategy is not None:
        from fbmt.compiler.passes import STRATEGIES

        if strategy in STRATEGIES:
            roots.append(STRATEGIES[strategy])
    described: dict[str, str] = {}
    todo = [m for m in map(_module_of, roots) if m is not None]
    while todo:
        mod = todo.pop()
        name = mod.__name__
        if name in described or name.split(".")[0] in ("torch", "fbmt"):
            continue
        users = _is_users(mod)
        top = sys.modules.get(name.split(".")[0])
        lines = [] if users else [f"version {getattr(top, '__version__', None)}"]
        for key, v in sorted(vars(mod).items(), key=lambda kv: kv[0]):
            if key.startswith("__"):
                continue
            if isinstance(v, (types.FunctionType, type)) and getattr(v, "__module__", None) == name:
                lines.append(f"{key} = {_definition(v, users)}")
            elif not users:
                continue  # its version stands for its values (some are drawn anew in every process)
            elif isinstance(v, (types.ModuleType, types.FunctionType, type)):
                other = _module_of(v)
                if other is not None and other.__name__ not in described:
                    todo.append(other)
            elif (data := _data(v)) is not None:
                lines.append(f"{key} = {data}")
        described[name] = "\n".join(lines)
    return {name: _sha(text)[:16] for name, text in described.items()}


def _data(v: Any) -> str | None:
    """A user module's global that a forward may read as data, by its value: plain values, tensors
    and arrays (a trace bakes what it reads of them into the program) and containers of those; None
    for anything else (a logger, a lock), which no trace turns into a value."""
    if isinstance(v, PLAIN):
        return repr(v)
    if type(v).__module__ == "numpy" and type(v).__name__ == "ndarray":
        try:
            v = torch.from_numpy(v)
        except TypeError:  # an array of objects
            return None
    if isinstance(v, (torch.Tensor, tuple, list, dict, set, frozenset)):
        try:
            return _stable(_describe(v, {}, set(), 0), "a global")
        except Uncacheable:
            return None
    return None


def _definition(v: Any, values: bool = True) -> str:
    """A function by its code and defaults; a class by the code of what it defines, and its plain
    values where `values` (a library's may be drawn anew in every process)."""
    if isinstance(v, types.FunctionType):
        return f"{_code(v.__code__)}{_value(v.__defaults__)}{_value(v.__kwdefaults__)}"
    parts = []
    for key, member in getattr(v, "__dict__", {}).items():
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if isinstance(member, property):
            accessors = (member.fget, member.fset)
            parts.append(
                f"{key}:"
                + ",".join(_definition(f) if isinstance(f, types.FunctionType) else _value(f) for f in accessors)
            )
        elif isinstance(member, types.FunctionType):
            parts.append(f"{key}:{_definition(member)}")
        elif isinstance(member, type) and member.__module__ == v.__module__:  # a class defined inside
            parts.append(f"{key}:{_definition(member, values)}")
        elif values and isinstance(member, PLAIN):
            parts.append(f"{key}={member!r}")
    return f"class {_qualname(v)}({', '.join(map(_qualname, v.__bases__))}) " + " ".join(parts)


def _value(x: Any) -> str:
    """A default argument's value as text, a function or class by its name (not its address)."""
    if isinstance(x, PLAIN):
        return repr(x)
    if isinstance(x, (tuple, list)):
        return "(" + ",".join(map(_value, x)) + ")"
    if isinstance(x, (set, frozenset)):
        return "{" + ",".join(sorted(map(_value, x))) + "}"
    if isinstance(x, dict):
        return "{" + ",".join(f"{k!r}:{_value(v)}" for k, v in x.items()) + "}"
    if isinstance(x, (types.FunctionType, types.BuiltinFunctionType, type)):
        return f"{getattr(x, '__module__', None)}.{getattr(x, '__qualname__', None)}"
    return f"<{type(x).__qualname__}>"


def _qualname(c: type) -> str:
    """A class's own qualified name (read past a metaclass or class attribute that shadows it)."""
    return type.__dict__["__qualname__"].__get__(c)


def _describe_module(module: nn.Module) -> str:
    """Every module's class and state that a trace could read (NOTE: [Compile cache], part model)."""
    paths = {id(m): p for p, m in module.named_modules(remove_duplicate=False)}
    lines = []
    for path, m in module.named_modules(remove_duplicate=False):
        lines.append(f"{path}: {type(m).__module__}.{type(m).__qualname__}")
        for name, v in vars(m).items():
            if name == "_modules":
                continue
            if name in ("_parameters", "_buffers"):
                v = {k: None if t is None else (tuple(t.shape), t.dtype, t.requires_grad) for k, t in v.items()}
            elif "hooks" in name or name.endswith(("_with_kwargs", "_always_called")):
                v = list(v.values()) if isinstance(v, dict) else v  # keyed by a process-wide counter
            lines.append(f"  {name} = {_stable(_describe(v, paths, set(), 0), f'{path or type(m).__name__}.{name}')}")
    return "\n".join(lines)


# attributes that hold Python's hash() of a string, which each process salts anew (transformers'
# GenerationConfig keeps one), and that no forward reads
SALTED = frozenset({"_original_object_hash"})
PLAIN = objects.PLAIN


def _describe(x: Any, paths: dict[int, str], seen: set[int], depth: int) -> str:
    """A text that is the same for equal values in any process (objects by their state, functions
    by their code, modules of the tree by their path)."""
    if isinstance(x, PLAIN):
        return repr(x)
    if isinstance(x, torch.Tensor):
        text = f"tensor{tuple(x.shape)}:{x.dtype}:{x.device.type}"
        # by content too: a forward that reads a tensor attribute bakes its values into the program
        if x.device.type != "meta" and not torch._subclasses.fake_tensor.is_fake(x):
            data = x.detach().cpu().contiguous().flatten()
            text += ":" + _sha(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")[:16]
        return text
    if isinstance(x, nn.Module):
        return f"module {paths[id(x)]}" if id(x) in paths else f"module {type(x).__qualname__}"
    if isinstance(x, types.MethodType):  # a bound method: its function and the object it is bound to
        return f"{_function(x.__func__)} of {_describe(x.__self__, paths, seen, depth + 1)}"
    if isinstance(x, types.FunctionType):  # what a closure captured decides what it computes, too
        cells = [c.cell_contents for c in x.__closure__ or () if _filled(c)]
        captured = f" capturing {_describe(cells, paths, seen, depth + 1)}" if cells else ""
        return f"{_function(x)}{_value(x.__defaults__)}{_value(x.__kwdefaults__)}{captured}"
    if isinstance(x, types.BuiltinFunctionType):
        return _function(x)
    if isinstance(x, functools.partial):
        return f"partial({_describe(x.func, paths, seen, depth + 1)}, {_describe(x.args, paths, seen, depth + 1)}, " + (
            f"{_describe(x.keywords, paths, seen, depth + 1)})"
        )
    if isinstance(x, type):
        return f"class {x.__module__}.{x.__qualname__}"
    if id(x) in seen or depth > 8:
        return f"<{type(x).__qualname__}>"
    seen = seen | {id(x)}
    if isinstance(x, dict):
        items = [(k, v) for k, v in x.items() if k not in SALTED]
        return "{" + ", ".join(f"{k!r}: {_describe(v, paths, seen, depth + 1)}" for k, v in items) + "}"
    if isinstance(x, (list, tuple)):
        return f"{type(x).__name__}[" + ", ".join(_describe(v, paths, seen, depth + 1) for v in x) + "]"
    if isinstance(x, (set, frozenset)):
        return "{" + ", ".join(sorted(_describe(v, paths, seen, depth + 1) for v in x)) + "}"
    if hasattr(x, "__dict__") and not isinstance(x, types.ModuleType):
        return f"{type(x).__qualname__}({_describe(vars(x), paths, seen, depth + 1)})"
    return repr(x)


def _filled(cell: types.CellType) -> bool:
    """Whether a closure's cell holds a value yet."""
    try:
        cell.cell_contents  # noqa: B018 - reading an empty cell raises
    except ValueError:
        return False
    return True


def _function(f: Any) -> str:
    """A function by its name and, for Python code, its code (bytecode, constants, names)."""
    name = f"{getattr(f, '__module__', None)}.{getattr(f, '__qualname__', repr(f))}"
    code = getattr(getattr(f, "__func__", f), "__code__", None)
    return f"function {name}" + (f":{_code(code)}" if code is not None else "")


def _code(code: types.CodeType) -> str:
    """A code object's digest: its bytecode, names and constants (a set's in sorted order: Python salts
    the hashes of strings, so a set literal's order differs from process to process)."""
    consts = [_code(c) if isinstance(c, types.CodeType) else _value(c) for c in code.co_consts]
    return _sha(code.co_code + repr((consts, code.co_names)).encode())[:16]


# ---- a Program on disk ---------------------------------------------------------------------


class _Pickler(pickle.Pickler):
    """Pickles a Program's parts: nodes by name, ops by name, fake tensors by their description."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, fx.Node):
            return ("node", obj.name)
        if isinstance(obj, torch._ops.OpOverload):
            return ("op", obj.namespace, obj._opname, obj._overloadname)
        if isinstance(obj, torch._ops.HigherOrderOperator):
            return ("hop", obj.name())
        if isinstance(obj, torch.SymInt):  # NOTE: [Symbolic programs on disk]
            env = obj.node.shape_env
            return ("sym", env.replace(obj.node.expr), obj.node.hint)
        if isinstance(obj, torch.SymFloat | torch.SymBool):
            raise Uncacheable(f"the program holds a symbolic {type(obj).__name__}")
        if isinstance(obj, ShapeEnv):
            ranges = {s: (r.lower, r.upper) for s, r in obj.var_to_range.items()}
            guards, fixed_at = [g.expr for g in obj.guards], getattr(obj, "fbmt_fixed_at", {})
            return ("shape_env", dict(obj.backed_var_to_val), ranges, guards, fixed_at)
        if isinstance(obj, torch.Tensor) and (obj.device.type == "meta" or torch._subclasses.fake_tensor.is_fake(obj)):
            return (
                "fake",
                tuple(obj.shape),
                obj.stride(),
                obj.storage_offset(),
                obj.dtype,
                str(obj.fake_device if hasattr(obj, "fake_device") else obj.device),
                obj.requires_grad,
            )
        return None


@dataclass(frozen=True)
class _Ref:
    name: str  # a node, by name, until the node exists


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, fake_mode: Any):
        super().__init__(io.BytesIO(data))
        self.fake_mode = fake_mode
        self.shape_env = None

    def persistent_load(self, pid: Any) -> Any:
        kind, *rest = pid
        if kind == "shape_env":  # first in the pickle: every symbolic size after it is one of its
            if self.shape_env is None:
                self.shape_env = _restored_shape_env(*rest)
                self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=self.shape_env)
            return self.shape_env
        if kind == "sym":
            expr, hint = rest
            if self.shape_env is None:
                raise pickle.UnpicklingError("a symbolic size before its shape environment")
            return self.shape_env.create_symintnode(expr, hint=hint)
        if kind == "node":
            return _Ref(rest[0])
        if kind == "op":
            namespace, name, overload = rest
            return getattr(getattr(getattr(torch.ops, namespace), name), overload)
        if kind == "hop":
            return getattr(torch.ops.higher_order, rest[0])
        if kind == "fake":  # made as fake tensors are, but straight from a meta tensor: a mode's dispatch costs 5x
            shape, stride, offset, dtype, device, requires_grad = rest
            t = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
            if offset:
                t = t.as_strided(shape, stride, offset)
            t = FakeTensor(self.fake_mode, t, torch.device(device))
            return t.requires_grad_(requires_grad) if requires_grad else t
        raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")


# NOTE: [Symbolic programs on disk]
# A program of symbolic sizes (NOTE: [Dynamic sizes]) is saved as a static one is, its symbolic sizes
# as their sympy expressions (after the shape environment's replacements) with the size they were
# traced at. Its shape environment goes first: the symbols' traced sizes and ranges, the guards
# the trace and passes left, and where the trace fixed a size (`SymbolicSizes.fixed`). Loading makes
# a new environment with those symbols, ranges and sizes (no guard is added to it:
# `SymbolicSizes.guards` reads the saved ones beside any the loaded program's own lowering adds), so
# a loaded program admits exactly the calls the compiled one did.
# The key is the call's (the exact shapes it was traced at: the passes estimate at that size) and
# the dimensions made symbolic.


def _restored_shape_env(values: dict, ranges: dict, guards: list, fixed_at: dict) -> ShapeEnv:
    from torch.utils._sympy.value_ranges import ValueRanges

    env = ShapeEnv()
    env.backed_var_to_val.update(values)
    env.var_to_range.update({s: ValueRanges(lower, upper) for s, (lower, upper) in ranges.items()})
    env.fbmt_saved_guards = list(guards)
    env.fbmt_fixed_at = dict(fixed_at)  # where a trace fixed a size, for the warning a loaded program gives too
    return env


def dumps(program: Program) -> bytes:
    """The program as bytes: every field but its layout (the key holds it), the graph node by node."""
    if program.writes is None:
        raise Uncacheable(
            "its forward changed its modules in a way a loaded program cannot do again (installed hooks, "
            "deleted an attribute, or set one to an object)"
        )
    nodes = []
    for n in program.graph.nodes:
        if n.op in ("call_module", "get_attr"):
            raise Uncacheable(f"the program calls {n.op} {n.target}")
        kept = {k: v for k, v in n.meta.items() if k.startswith(_KEPT_META)}
        nodes.append((n.name, n.op, n.target, n.args, n.kwargs, kept))
    fields = {
        f.name: getattr(program, f.name) for f in dataclasses.fields(program) if f.name not in ("graph", "layout")
    }
    stream = io.BytesIO()
    env = program.sizes.shape_env if program.sizes is not None else None  # first (NOTE: [Symbolic programs on disk])
    try:
        _Pickler(stream, protocol=pickle.HIGHEST_PROTOCOL).dump((env, nodes, fields))
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise Uncacheable(f"a part of the program cannot be saved ({type(e).__name__}: {str(e)[:200]})") from None
    return zlib.compress(stream.getvalue(), 1)


def loads(data: bytes, layout: Layout) -> Program:
    """The program `dumps` saved, for a model of `layout`; its values are fakes of a new fake mode."""
    with warnings.catch_warnings():  # a pytree spec of an older torch's class names says so when unpickled
        warnings.simplefilter("ignore", FutureWarning)
        _, nodes, fields = _Unpickler(zlib.decompress(data), FakeTensorMode(allow_non_fake_inputs=True)).load()
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}

    def resolve(a: Any) -> Any:
        return env[a.name] if isinstance(a, _Ref) else a

    for name, op, target, args, kwargs, kept in nodes:
        args, kwargs = fx.node.map_aggregate(args, resolve), fx.node.map_aggregate(kwargs, resolve)
        n = graph.create_node(op, target, args, kwargs, name=name)
        if n.name != name:
            raise ValueError(f"node {name!r} came back named {n.name!r}")
        n.meta.update(kept)
        env[name] = n
    return Program(graph=graph, layout=layout, **fields)


def trim(program: Program) -> None:
    """Keep only the node facts an entry keeps, so a program compiled here and one loaded from the
    cache are the same to partition and to Inductor's own caches (a trace's stack traces differ)."""
    for n in program.graph.nodes:
        for k in [k for k in n.meta if not k.startswith(_KEPT_META)]:
            del n.meta[k]


# ---- the store -----------------------------------------------------------------------------


@dataclass
class Entry:
    path: Path
    about: dict[str, Any]

    @property
    def size(self) -> int:
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())


def entries(root: Path) -> list[Entry]:
    """The entries under `root`, newest first (one whose about.json cannot be read is left out)."""
    found = []
    for d in (root / "programs").glob("*") if (root / "programs").is_dir() else ():
        if d.name.startswith("."):  # a folder being written, or left by a writer that died
            continue
        try:
            found.append(Entry(d, json.loads((d / "about.json").read_text())))
        except (OSError, ValueError):
            continue
    return sorted(found, key=lambda e: e.about.get("saved", ""), reverse=True)


def writer() -> bool:
    """Whether this rank writes entries: the first rank of each machine (all read)."""
    local = flags.LOCAL_RANK.get()
    return (local if local is not None else job.rank()) == 0


def save(root: Path, key: Key, program: Program, seconds: float) -> Path:
    """Write the entry of `key` (whole or not at all) and return its folder."""
    data = dumps(program)
    about = {
        "format": FORMAT,
        "key": key.digest,
        "parts": key.parts,
        "model": key.model,
        "modules": key.modules,
        "saved": datetime.datetime.now().isoformat(timespec="seconds"),
        "compile_seconds": round(seconds, 2),
        "nodes": len(program.graph.nodes),
        "sha256": _sha(data),
    }
    final = root / "programs" / key.digest
    tmp = root / "programs" / f".{key.digest}.{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        (tmp / "program.pkl").write_bytes(data)
        (tmp / "about.json").write_text(json.dumps(about, indent=1))
        if final.exists():
            shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def exists(root: Path, key: Key) -> bool:
    """Whether an entry is saved under `key` (not whether it loads)."""
    return (root / "programs" / key.digest / "about.json").exists()


def load(root: Path, key: Key, layout: Layout) -> tuple[Program, Entry] | None:
    """The program saved under `key`, verified; None where there is none. A broken entry is
    deleted with a warning and counts as none."""
    d = root / "programs" / key.digest
    if not (d / "about.json").exists():
        return None
    try:
        about = json.loads((d / "about.json").read_text())
        data = (d / "program.pkl").read_bytes()
        if about.get("format") != FORMAT or about.get("parts") != key.parts:
            raise ValueError("its key does not match its folder")
        if _sha(data) != about.get("sha256"):
            raise ValueError("program.pkl does not match its checksum (a partial or damaged write)")
        program = loads(data, layout)
    except Exception as e:  # anything at all: the entry is not loaded
        log.warning("fbmt: compile cache entry %s is broken (%s: %s); compiling instead", d, type(e).__name__, e)
        shutil.rmtree(d, ignore_errors=True)
        return None
    return program, Entry(d, about)


def why_missed(root: Path, key: Key) -> str:
    """Which parts of `key` differ from the closest entry of the same model class."""
    names = {"code": "its code", "model": "its modules", "layout": "its flat groups or world size"}
    names |= {"options": "the options", "call": "the call's inputs", "versions": "fbmt, torch or transformers"}
    names |= {"settings": "torch's settings (attention kernels, default dtype, determinism)"}
    names |= {"registries": "the registered collective kinds or strategies"}
    same_model = [e for e in entries(root) if e.about.get("model") == key.model]
    if not same_model:
        return f"no entry for {key.model} yet"

    def differ(e: Entry) -> list[str]:
        return [p for p in key.parts if e.about.get("parts", {}).get(p) != key.parts[p]]

    closest = min(same_model, key=lambda e: len(differ(e)))
    said = [names.get(p, p) for p in differ(closest)]
    if "code" in differ(closest):
        saved = closest.about.get("modules", {})
        changed = sorted(m for m in set(saved) | set(key.modules) if saved.get(m) != key.modules.get(m))
        said[said.index("its code")] = f"its code (Python modules {', '.join(changed[:5])})"
    return f"the closest entry for {key.model} ({closest.path.name[:8]}) differs in " + ", ".join(said)


def save_artifacts(entry: Path, compiling: int) -> None:
    """Add torch's cache artifacts (Inductor's compiled regions so far) to an entry, beside those it
    holds (another run's: a run that compiled fewer of a symbolic program's sizes loses none).
    `compiling`: how many regions this run met are still compiling, and so not among them."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return
    try:
        held = _verified_artifacts(entry)
    except (OSError, ValueError):  # damaged: replaced by this run's
        held = None
    data = _one_batch_per_kind([held, saved[0]] if held is not None else [saved[0]])
    held_missing = artifacts_missing(entry) if held is not None else None
    if held_missing is not None:  # both runs' regions are there: at most as many missing as either left
        compiling = min(compiling, held_missing)
    # the checksum first, then the artifacts: a reader that finds artifacts finds their checksum
    files = {"inductor.sha256": _sha(data).encode(), "inductor.bin": data}
    files["inductor.json"] = json.dumps({"compiling": compiling}).encode()
    for name, content in files.items():
        tmp = entry / f".{name}.{uuid.uuid4().hex[:8]}"
        tmp.write_bytes(content)
        os.replace(tmp, entry / name)


def artifacts_missing(entry: Path) -> int | None:
    """How many regions were still compiling when an entry's artifacts were saved (a run that stopped
    early), as far as its saves knew; None where it does not say."""
    try:
        compiling = json.loads((entry / "inductor.json").read_text())["compiling"]
        return compiling if isinstance(compiling, int) and compiling >= 0 else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _verified_artifacts(entry: Path) -> bytes | None:
    """The artifacts an entry holds, where their checksum holds; None where it holds none."""
    f = entry / "inductor.bin"
    if not f.exists():
        return None
    data = f.read_bytes()
    if _sha(data).encode() != (entry / "inductor.sha256").read_bytes():
        raise ValueError("they do not match their checksum")
    return data


def _one_batch_per_kind(blobs: list[bytes]) -> bytes:
    """torch's cache artifacts `blobs` (`save_cache_artifacts`' bytes, in order) as one, each kind's
    artifacts in one batch, each artifact once.

    NOTE: [Artifacts saved more than once]
    `torch.compiler.save_cache_artifacts` returns every artifact the process recorded so far, as a
    batch per kind per call; a model saves each time regions come in (`CompiledModule._keep_artifacts`:
    a run that stops early keeps what it compiled), so an entry holds many batches of each kind. torch's
    `load_cache_artifacts` reads them into a dict by kind, so that only the last batch of each kind
    loads: a machine given the entry with Inductor's own caches empty found one of the 1.36B's sixteen
    regions and compiled the fifteen others in full. Merged into one batch per kind, they all load
    through torch's public loader. A save keeps what the entry held (an earlier run's artifacts: a
    run that met fewer of a symbolic program's sizes, or stopped before its regions all loaded, would
    otherwise leave the entry with fewer); an artifact both hold (the same key and bytes, as a
    cache hit records it) is kept once. torch's own (private) helpers read and write the format; where
    they are missing or fail, the last blob is kept as torch wrote it (a slower start, never a wrong
    region)."""
    try:
        from torch.compiler._cache import CacheArtifactManager, _deserialize_single_cache, _serialize_single_cache
        from torch.utils._appending_byte_serializer import AppendingByteSerializer

        CacheArtifactManager._ensure_cache_artifacts_registered()
        merged: dict[str, dict] = {}  # kind -> its artifacts (key and content), in order
        for data in blobs:
            for kind, batch in AppendingByteSerializer.to_list(data, deserialize_fn=_deserialize_single_cache):
                merged.setdefault(kind, {}).update(dict.fromkeys(batch))
        out = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
        out.extend((kind, list(artifacts)) for kind, artifacts in merged.items())
        return out.to_bytes()
    except Exception as e:
        log.debug("torch's cache artifacts are saved as torch wrote them (%s: %s)", type(e).__name__, e)
        return blobs[-1]


@functools.cache
def load_artifacts(entry: Path) -> bool:
    """Give torch's caches the artifacts an entry holds, where their checksum holds (once per
    process and entry): they are compiled code, which a flipped byte could make compute otherwise.
    Whether there were any, and they were given."""
    try:
        data = _verified_artifacts(entry)
        if data is None:
            return False
        torch.compiler.load_cache_artifacts(data)
        return True
    except Exception as e:  # a failure costs a compile, never a wrong region
        log.warning(
            "fbmt: Inductor's artifacts in %s are not loaded (%s); Inductor compiles anew", entry / "inductor.bin", e
        )
        return False


def clear(root: Path) -> int:
    """Delete every entry under `root`; returns how many."""
    found = entries(root)
    shutil.rmtree(root / "programs", ignore_errors=True)
    return len(found)
