"""Loading and saving Hugging Face checkpoint folders for fbmt's model zoo (ModelCenter's role).

A folder is what `transformers`' `save_pretrained` writes: `config.json`, the weights in
`model.safetensors` or in shards listed by `model.safetensors.index.json`, and usually a
`tokenizer.json`. Tensors are read with the `safetensors` library one at a time, when the module
that owns them is initialized, so a model built on the meta device and compiled by fbmt loads
block by block and no rank ever holds the whole model (NOTE: [Materializing shard by shard]).

Each zoo model says how its parameters map to the checkpoint's names (`hf_names`): one name, or
several that are concatenated (a fused q/k/v projection is HF's three), with a transpose where the
layouts differ (GPT-2's Conv1D). `save_pretrained` writes the inverse, so HF loads what fbmt saves.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

log = logging.getLogger("fbmt")
WEIGHTS, INDEX, CONFIG, TOKENIZER = "model.safetensors", "model.safetensors.index.json", "config.json", "tokenizer.json"


class CheckpointError(ValueError):
    """A checkpoint folder is missing a file, or its tensors do not fit the model."""


@dataclass(frozen=True)
class Source:
    """Where a parameter's value comes from: these checkpoint names, concatenated along dim 0, and
    transposed first where `transpose` (a Conv1D weight stored as (in, out))."""

    names: tuple[str, ...]
    transpose: bool = False

    def read(self, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
        parts = [get(n).t() if self.transpose else get(n) for n in self.names]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def split(self, value: torch.Tensor, sizes: list[int]) -> dict[str, torch.Tensor]:
        parts = value.split(sizes, dim=0) if len(self.names) > 1 else [value]
        return {n: (p.t() if self.transpose else p).contiguous() for n, p in zip(self.names, parts)}


def read_config(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, CONFIG)
    if not os.path.isfile(path):
        raise CheckpointError(f"{folder!r} has no {CONFIG}: expected a folder written by save_pretrained")
    with open(path) as f:
        return json.load(f)


class Checkpoint:
    """The tensors of a checkpoint folder by name, each read from its file when asked for."""

    def __init__(self, folder: str):
        self.folder = folder
        index, single = os.path.join(folder, INDEX), os.path.join(folder, WEIGHTS)
        if os.path.isfile(index):
            with open(index) as f:
                self.files = {k: os.path.join(folder, v) for k, v in json.load(f)["weight_map"].items()}
        elif os.path.isfile(single):
            self.files = dict.fromkeys(_keys(single), single)
        else:
            found = sorted(os.listdir(folder)) if os.path.isdir(folder) else "no such folder"
            raise CheckpointError(
                f"{folder!r} has neither {WEIGHTS} nor {INDEX} (found: {found}); fbmt reads safetensors "
                "checkpoints (transformers' save_pretrained writes them by default)"
            )
        missing = sorted({f for f in self.files.values() if not os.path.isfile(f)})
        if missing:
            raise CheckpointError(f"{INDEX} in {folder!r} names shard files that are not there: {missing}")

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.files:
            raise CheckpointError(f"{self.folder!r} holds no tensor {name!r}")
        with safe_open(self.files[name], framework="pt") as f:
            return f.get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        from safetensors import safe_open

        with safe_open(self.files[name], framework="pt") as f:
            return tuple(f.get_slice(name).get_shape())


def _keys(path: str) -> list[str]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return list(f.keys())


def split_config(cls: type, hf: dict[str, Any], model: str, required: dict[str, Any] = {}) -> Any:  # noqa: B006
    """`cls` (a config dataclass with an `extra` field) from an HF config.json: its own fields, the rest
    kept in `extra` (written back by `to_hf`); a key of `required` with another value is an error, since
    the model would silently compute something else."""
    for key, ok in required.items():
        if hf.get(key, ok) not in (ok, None):
            raise CheckpointError(f"fbmt.models.{model}: config {key}={hf[key]!r} is not implemented")
    rest = dict(hf)
    known = {k: rest.pop(k) for k in list(rest) if k in cls.__dataclass_fields__ and k != "extra"}
    return cls(**known, extra=rest)


class PretrainedModel(nn.Module, abc.ABC):
    """A zoo model: a plain `nn.Module` with a config dataclass, loadable from and savable to a Hugging
    Face folder. Subclasses set `config_class`, and define `hf_names()` and `init_module(module)`."""

    config_class: type
    hf_architecture: str  # the "architectures" entry of the config.json it writes

    @abc.abstractmethod
    def hf_names(self) -> dict[str, Source]:
        """Each parameter's source in a Hugging Face checkpoint (tied parameters once, by first name)."""

    @abc.abstractmethod
    def init_module(self, module: nn.Module) -> None:
        """Random values for what `module` owns directly (buffers included), as HF's `_init_weights`."""

    # ---- initialization: random, or from a checkpoint, module by module ----
    def init_weights(self) -> None:
        """Random values for every module, as HF initializes a model built from its config (subclasses call
        it at the end of __init__; on the meta device it waits for fbmt.compile or from_pretrained)."""
        if not any(t.is_meta for t in [*self.parameters(), *self.buffers()]):
            with torch.no_grad():
                for m in self.modules():
                    self.init_module(m)

    def _init_weights(self, module: nn.Module) -> None:
        """Give `module`'s own parameters and buffers their values (fbmt.compile calls this for each module
        of a model built on the meta device, as it does a Hugging Face model's)."""
        self.init_module(module)  # buffers (rotary frequencies, position ids) and any random values
        checkpoint = self.__dict__.get("_checkpoint")
        if checkpoint is None:
            return
        sources, path, fresh = self._sources(), self._paths()[module], self.__dict__.get("_fresh", ())
        with torch.no_grad():
            for k, p in module._parameters.items():
                name = f"{path}.{k}" if path else k
                if p is not None and name in sources and name not in fresh:
                    p.copy_(sources[name].read(checkpoint.get))

    def _paths(self) -> dict[nn.Module, str]:
        return {m: path for path, m in self.named_modules(remove_duplicate=False)}

    def _sources(self) -> dict[str, Source]:
        if "_sources_cache" not in self.__dict__:
            sources = self.hf_names()
            first = {id(p): n for n, p in self.named_parameters()}
            for name, p in self.named_parameters(remove_duplicate=False):  # tied names: the first one's source
                if first[id(p)] in sources:
                    sources.setdefault(name, sources[first[id(p)]])
            self.__dict__["_sources_cache"] = sources
        return self.__dict__["_sources_cache"]

    @classmethod
    def from_pretrained(
        cls,
        folder: str,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **config: Any,
    ) -> PretrainedModel:
        """The model of a Hugging Face folder. Built on the meta device (under `torch.device("meta")`, or
        `device="meta"`), it reads only the config and the index: `fbmt.compile` then loads each block's
        tensors as it materializes the block. Elsewhere it loads every tensor now. Keywords replace
        config fields, as HF's do (`num_labels=4` for a new classification head)."""
        unknown = sorted(set(config) - set(cls.config_class.__dataclass_fields__))
        if unknown:
            raise TypeError(f"{cls.__name__}.from_pretrained: {unknown} are not fields of {cls.config_class.__name__}")
        config = dataclasses.replace(cls.config_class.from_hf(read_config(folder)), **config)
        checkpoint = Checkpoint(folder)
        with torch.device("meta"):
            model = cls(config)
        if dtype is not None:
            model.to(dtype)
        model._check(checkpoint)
        model.__dict__["_checkpoint"] = checkpoint
        target = torch.device(device) if device is not None else torch.get_default_device()
        if target.type != "meta":
            ties: dict[int, list[tuple[nn.Module, str]]] = {}
            for m in model.modules():
                for k, p in m._parameters.items():
                    if p is not None:
                        ties.setdefault(id(p), []).append((m, k))
            model.to_empty(device=target)  # from meta it makes a new tensor per owner: tie them again
            for owners in ties.values():
                for m, k in owners[1:]:
                    m._parameters[k] = owners[0][0]._parameters[owners[0][1]]
            for m in model.modules():
                model._init_weights(m)
        return model

    def _check(self, checkpoint: Checkpoint) -> None:
        sources = self.hf_names()
        params = dict(self.named_parameters())
        head = set(self.head_parameters())
        missing = {n: [k for k in s.names if k not in checkpoint.files] for n, s in sources.items()}
        missing = {n: ks for n, ks in missing.items() if ks}
        fresh = sorted(n for n in missing if n in head)
        lacking = sorted(k for n, ks in missing.items() if n not in head for k in ks)
        if lacking:
            raise CheckpointError(
                f"{checkpoint.folder!r} lacks {len(lacking)} tensors {type(self).__name__} needs, e.g. {lacking[:5]}; "
                "is it a checkpoint of this architecture and configuration?"
            )
        for name, source in sources.items():
            if name in missing:
                continue
            want = tuple(params[name].shape)
            shapes = [checkpoint.shape(n) for n in source.names]
            if source.transpose:
                shapes = [s[::-1] for s in shapes]
            got = (sum(s[0] for s in shapes), *shapes[0][1:]) if shapes[0] else ()
            if got != want:
                raise CheckpointError(
                    f"{checkpoint.folder!r}: {source.names} give {name} the shape {got}, the model has {want} "
                    "(config.json and the weights disagree)"
                )
        wanted = {n for s in sources.values() for n in s.names}
        other = tuple(self.other_heads())
        unused = sorted(set(checkpoint.files) - wanted - set(self.ignored_hf_names()))
        foreign = [n for n in unused if n.startswith(other)]
        unused = [n for n in unused if not n.startswith(other)]
        if unused:
            raise CheckpointError(
                f"{checkpoint.folder!r} holds {len(unused)} tensors {type(self).__name__} has no place for, e.g. "
                f"{unused[:5]}; a head or a feature this model does not implement would be dropped silently"
            )
        quiet = torch.distributed.is_initialized() and torch.distributed.get_rank() != 0  # rank 0 says it
        if fresh and not quiet:  # a new task head on a pretrained body, as HF's from_pretrained allows, said out loud
            log.warning(
                "fbmt.models: %s: %d parameters of its head are not in %r and start from random values: %s",
                type(self).__name__,
                len(fresh),
                checkpoint.folder,
                ", ".join(fresh),
            )
        if foreign and not quiet:
            log.warning(
                "fbmt.models: %s: not using another head's tensors: %s", type(self).__name__, ", ".join(foreign)
            )
        self.__dict__["_fresh"] = set(fresh)

    def head_parameters(self) -> list[str]:
        """Parameters of the task head, which a checkpoint of the bare model or of another task may lack:
        they then start from random values (and `from_pretrained` says so)."""
        return []

    def other_heads(self) -> list[str]:
        """Checkpoint name prefixes of other task heads on the same body, not used by this model."""
        return []

    def ignored_hf_names(self) -> list[str]:
        """Checkpoint tensors that hold nothing this model needs (buffers HF saves, tied copies)."""
        return []

    def save_pretrained(self, folder: str) -> None:
        """Write `config.json` and `model.safetensors` in Hugging Face's layout (HF's `from_pretrained` loads
        it). On a compiled model it gathers the full tensors (call it on every rank); rank 0 writes."""
        from safetensors.torch import save_file

        state = self.state_dict()  # on a compiled model: gathered from every rank's shards
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return
        config = self.config
        model = self._model()
        out: dict[str, torch.Tensor] = {}
        for name, source in model.hf_names().items():
            sizes = [state[name].shape[0] // len(source.names)] * len(source.names)
            sizes = model.split_sizes(name, sizes)
            out.update(source.split(state[name].detach().cpu(), sizes))
        os.makedirs(folder, exist_ok=True)
        hf = config.to_hf()
        hf["architectures"] = [model.hf_architecture]
        # each file whole or not at all: a crash while saving over an earlier save leaves that one intact
        _write_whole(os.path.join(folder, WEIGHTS), lambda path: save_file(out, path, metadata={"format": "pt"}))
        _write_whole(os.path.join(folder, CONFIG), lambda path: _dump_json(hf, path))

    def split_sizes(self, name: str, even: list[int]) -> list[int]:
        """The row counts of each source of a fused parameter (default: equal parts)."""
        return even

    def _model(self) -> PretrainedModel:
        """This model; on a compiled one (whose methods run bound to the compiled module), the model it
        was compiled from (`compiled_from`, fbmt.compile's public name for it), whose methods' `super()`
        needs an instance of their class."""
        return getattr(self, "compiled_from", self)


def _write_whole(path: str, write: Callable[[str], None]) -> None:
    """`write(temporary)`, flushed to disk, then renamed over `path` (atomic on POSIX file systems)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _dump_json(value: Any, path: str) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)


def load_tokenizer(folder: str) -> Any:
    """The folder's `tokenizer.json`, as a `tokenizers.Tokenizer`."""
    path = os.path.join(folder, TOKENIZER)
    if not os.path.isfile(path):
        raise CheckpointError(f"{folder!r} has no {TOKENIZER} (a tokenizer saved by tokenizers or transformers)")
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)
