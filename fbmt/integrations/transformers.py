"""What Hugging Face's libraries read from a model, on a compiled one (NOTE: [The wrapped model's methods]).

`fbmt.compile` returns an instance of a subclass of `Forwarding` made for the wrapped model's class:
- its `forward` presents the wrapped model's signature (HF's Trainer keeps only the dataset columns
  that `inspect.signature(model.forward)` names; `generate()` checks its arguments the same way);
- the wrapped model's methods and properties (`generate`, `prepare_inputs_for_generation`, ...) are
  found on the compiled model and bound to it, and its class-level lookups reach the wrapped class
  (`generate` runs `getattr(type(self), "_sample")`);
- accelerate (under Trainer) sees it as already prepared, so it neither wraps it in DDP nor runs its
  forward under autocast (refused with what to do instead); Trainer's checkpoints then save and resume
  on several ranks (integrations/trainer.py).
It also gives a model built on `meta` its own `_init_weights` as the initializer (`init_fn`), what
`from_config` runs, and adds the mixture-of-experts hint to the compiler's trace errors.

NOTE: [The wrapped model's methods]
Libraries read the model they are given. A method of the original model is looked up on the
original's class and bound to the compiled module, so that inside it `self(...)` runs the compiled
program and `self.parameters()`/`self.device` are the shards'; bound to the original, it would run
the original forward on meta placeholders. Attributes that are not methods (`config`, submodules)
are the original's.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from fbmt.compiler import CompiledModule, HostFunction, register_host_function, register_trace_hint

log = logging.getLogger("fbmt")


class _Wrapping(type):
    """The class of each compiled module forwards class-level lookups to the wrapped module's class."""

    def __getattr__(cls, name: str) -> Any:
        wrapped = cls.__dict__.get("wrapped_class")
        if wrapped is None or name.startswith("__"):
            raise AttributeError(f"type object {cls.__name__!r} has no attribute {name!r}")
        return getattr(wrapped, name)


_classes: dict[tuple[type, type], type] = {}


def compiled_class(base: type, wrapped: type) -> type:
    """The subclass of `base` (a `Forwarding` class) for a compiled `wrapped` model: one per pair. It
    derives from `wrapped` too, and finds every attribute as `base` does (NOTE: [The wrapped class as a base])."""
    if (base, wrapped) not in _classes:
        name = f"CompiledModule[{wrapped.__qualname__}]"
        namespace = {"wrapped_class": wrapped, "__qualname__": name, "forward": _presenting_signature(wrapped)}
        for c in wrapped.__mro__:
            if c in nn.Module.__mro__:
                continue
            for attr in vars(c):
                if attr.startswith("__") or attr in namespace:
                    continue
                own = inspect.getattr_static(base, attr, _MISSING)
                namespace[attr] = _Original(attr) if own is _MISSING else own
        for c in _CONTAINERS:
            if issubclass(wrapped, c):
                namespace.update({attr: _container_method(c, attr) for attr in vars(c) if attr not in _OWN})
        _classes[base, wrapped] = _metaclass(type(wrapped))("CompiledModule", (base, wrapped), namespace)
    return _classes[base, wrapped]


# NOTE: [Containers compiled whole]
# A compiled nn.Sequential, ModuleList or ModuleDict answers `model[0]`, `len(model)`, `for layer in
# model` and `keys()` from the container it compiled: its class's methods, bound to the compiled model,
# would read the compiled model's own submodules (the flat shards' list) instead, silently. Those that
# change the container (`append`, `model[0] = ...`) are refused: the program was traced without the change.
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_OWN = frozenset({"__init__", "forward", "__dir__", "__module__", "__doc__", "__constants__", "__annotations__"})
_CHANGES = frozenset(
    {"__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert", "pop", "clear", "update"}
)


def _container_method(container: type, name: str) -> Callable:
    """Method `name` of `container`, run on the container a compiled model took over (NOTE:
    [Containers compiled whole]); refused where it would change it."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if name in _CHANGES:
            raise RuntimeError(
                f"fbmt: {container.__name__}.{name.strip('_')}() on a compiled model would change the modules "
                "fbmt.compile took over, and its programs were traced without the change: change the "
                f"{container.__name__} before fbmt.compile"
            )
        return getattr(self._orig, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


def _metaclass(of: type) -> type:
    """`_Wrapping`, joined with the wrapped class's own metaclass (the zoo's models are `abc.ABC`s)."""
    if issubclass(_Wrapping, of):
        return _Wrapping
    if of not in _metaclasses:
        _metaclasses[of] = type(f"_Wrapping[{of.__qualname__}]", (_Wrapping, of), {})
    return _metaclasses[of]


_metaclasses: dict[type, type] = {}


# NOTE: [The wrapped class as a base]
# Hugging Face's methods call `super().prepare_inputs_for_generation(...)` (Whisper, most multimodal
# models) and `super().generate(...)` (WhisperGenerationMixin); Python's zero-argument super() requires
# `self` to be an instance of the class that defines the method. So a compiled model's class derives
# from the wrapped class too, after `base`, and `isinstance(model, LlamaForCausalLM)` holds, as it does
# for a model wrapped by accelerate or peft. Deriving must not change which attribute a name finds: each
# attribute the wrapped classes define (outside nn.Module) is pinned on the compiled class, as `base`'s
# own where `base` has one (nn.Module's `to`, `cuda`, not PreTrainedModel's overrides), otherwise as
# `_Original`, which finds it as `Forwarding.__getattr__` does (NOTE: [The wrapped model's methods]).
# super() inside a method still resolves along the wrapped class's MRO, to the next class's method.
_MISSING = object()


class _Original:
    """A class attribute that finds `name` as `Forwarding.__getattr__` does (NOTE: [The wrapped class as a base])."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj: Any, cls: type) -> Any:
        if obj is None:
            return getattr(cls.wrapped_class, self.name)
        return obj._from_original(self.name)  # no __set__: an instance's own value wins, as before


# Methods of a Hugging Face model that change its parameters or how its forward runs: on the compiled
# model they would change the module compile took over (placeholders) and leave the shards and the
# programs as they were, so they are refused by name, with what to do instead.
_RESTRUCTURE = "it makes new parameters, which a compiled model cannot take: call it before fbmt.compile"
BEFORE_COMPILE = {
    "resize_token_embeddings": _RESTRUCTURE,
    "set_input_embeddings": _RESTRUCTURE,
    "set_output_embeddings": _RESTRUCTURE,
    "prune_heads": _RESTRUCTURE,
    "add_adapter": _RESTRUCTURE,  # peft's and transformers': a new adapter's weights
}


# NOTE: [Hugging Face's checkpointing]
# `gradient_checkpointing_enable()` (and TrainingArguments(gradient_checkpointing=True), which calls it on
# the model the Trainer holds) asks for each layer to be recomputed in the backward. In a trace its
# `torch.utils.checkpoint` calls are calls (NOTE: [Checkpoints in the model's code]) and the backward
# recomputes what `remat=` says, so the model computes as eagerly: its values and gradients do not depend
# on it. fbmt says so once, and warns where `remat="none"` keeps every activation (the user asked for less
# memory). On a compiled model the call is made on the model it wraps, as eager makes it: the attributes
# and the input hook it sets are watched (NOTE: [Attributes read as constants]), so the next call traces
# the layers as checkpoint calls. That matters where a reentrant checkpoint gets no input that requires
# grad (`use_reentrant=True`, frozen embeddings of a model whose input is not `input_ids`): eager gives the
# layer's parameters no gradient, and a program traced without the checkpoints would train them.
_CHECKPOINT_METHODS = ("gradient_checkpointing_enable", "activation_checkpointing_enable")


def _checkpointing_said(model: str, remat: Any) -> None:
    if remat == "none":
        log.warning(
            "fbmt: %s has Hugging Face's gradient checkpointing on, but remat='none' keeps every activation: "
            "fbmt recomputes what remat= says, not what the model's checkpoint calls say; pass remat='block' "
            "(the default; each layer recomputed, as Hugging Face's checkpointing does) for its memory",
            model,
        )
    else:
        log.info(
            "fbmt: %s has Hugging Face's gradient checkpointing on: the backward recomputes what remat=%r says "
            "(its checkpoint calls are traced as calls; NOTE: [Hugging Face's checkpointing])",
            model,
            remat,
        )


def _checkpointing_enabled(enable: Callable[..., Any], model: str, remat: Any, *args: Any, **kwargs: Any) -> None:
    enable(*args, **kwargs)
    _checkpointing_said(model, remat)


def check_model(model: nn.Module, remat: Any) -> None:
    """Say what becomes of Hugging Face's gradient checkpointing, where the model has it on."""
    on = getattr(model, "is_activation_checkpointing", None)
    if on is None and hasattr(type(model), "is_gradient_checkpointing"):  # transformers before 5
        on = model.is_gradient_checkpointing
    if on:
        _checkpointing_said(type(model).__name__, remat)


# A generation's bound where the config names no longest position (T5's positions are relative, so any
# length runs): the fourfold bound cost T5 a decoder program at each of 8, 32, 128, ... tokens. The bound
# only widens what a program admits (every call is still checked against its guards), and a step without
# gradients keeps no activations whose memory an estimate at the bound would decide; models that do name a
# longest position name 2048 to 131072, so this sits among them (NOTE: [A cache that grows]).
_UNNAMED_LONGEST = 1 << 15


class Forwarding(CompiledModule, metaclass=_Wrapping):
    """A compiled module that answers for the module it wraps (NOTE: [The wrapped model's methods])."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.__dict__["_built"] = True  # from now on an attribute set here is the wrapped model's

    def __getattr__(self, name: str) -> Any:
        try:
            return nn.Module.__getattr__(self, name)  # by name: the wrapped class follows in the MRO
        except AttributeError:
            if self.__dict__.get("_orig") is None:
                raise
        return self._from_original(name)

    def __setattr__(self, name: str, value: Any) -> None:
        """An attribute is set on the wrapped model, as eager sets it, and the next call reads it (NOTE:
        [Attributes read as constants] in fbmt/compiler/module.py); this module's own (set while it was
        built) and its class's stay here."""
        if self._for_original(name):
            setattr(self._orig, name, value)
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if self._for_original(name):
            delattr(self._orig, name)
        else:
            super().__delattr__(name)

    def _for_original(self, name: str) -> bool:
        own = self.__dict__
        return (
            own.get("_built", False)
            and name not in own
            and name not in own["_modules"]
            and inspect.getattr_static(type(self), name, None) is None
        )

    def _from_original(self, name: str) -> Any:
        """Attribute `name` of the wrapped model: its class's methods and properties bound to this one
        (NOTE: [The wrapped model's methods]), a method that restructures refused, anything else the original's."""
        orig = self._orig
        if name in BEFORE_COMPILE and hasattr(orig, name):
            return _refused(type(orig).__name__, name)
        if name in _CHECKPOINT_METHODS and hasattr(orig, name):
            return functools.partial(
                _checkpointing_enabled, getattr(orig, name), type(orig).__name__, self.options.remat
            )
        found = inspect.getattr_static(type(orig), name, None)
        if isinstance(found, (types.FunctionType, property)) and name not in vars(orig):
            if name in BY_NAMES:
                return types.MethodType(_by_names(found), self)
            return found.fget(self) if isinstance(found, property) else types.MethodType(found, self)
        return getattr(orig, name)

    @property
    def _is_accelerate_prepared(self) -> bool:
        # accelerate (under HF Trainer) wraps a model it has not prepared in DDP, and runs its forward
        # under autocast for bf16=True/fp16=True: the first is refused (integrations/torch_guards.py),
        # the second would trace the autocast casts into the program. A compiled model needs neither:
        # it is prepared.
        from fbmt.integrations import trainer

        trainer.install()  # Trainer's checkpoints on several ranks (NOTE: [Trainer checkpoints])
        state = sys.modules.get("accelerate.state")
        precision = _mixed_precision(state) if state is not None else None
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

    def _growing(
        self, args: tuple, kwargs: dict, inputs: list[torch.Tensor]
    ) -> tuple[dict[int, tuple[int, ...]], tuple[tuple[int, tuple], ...]] | None:
        """A step of generation: the cache's length, and the attention mask's, which covers the cache and the
        new tokens; and the count of tokens each sliding window's layer keeps.

        NOTE: [A cache that grows]
        `generate()` calls the model once with the prompt, then once per new token with a `DynamicCache` that
        the call before extended by its tokens, and a mask one longer. A program of symbolic sizes is made for
        calls that differ from an existing one in sizes alone (NOTE: [Dynamic sizes]), so the first step with a
        cache compiled a program for its exact sizes, and the second one for every length: three programs where
        two serve. A call that passes a `DynamicCache` holding tokens is such a step, and its next call passes
        the cache longer: its program is made symbolic at once in the length of the cache's tensors, and in the
        mask's where that is the cache's length plus the new tokens' (an encoder-decoder's cache: its
        self-attention's part, once it holds two tokens). A layer that keeps a sliding window counts its tokens
        in a Python int (`cumulative_length`; a static cache's, whose tensors keep their shapes,
        `cumulative_length_int`), which the program takes as a size too (NOTE: [Numbers in an object]); its keys
        stop growing once the window is full, and the steps at its edge get programs of their own. What the
        trace assumed of those sizes is checked at every call, as for any program of symbolic sizes; a call it
        does not admit gets a program of its own. A step's program admits lengths up to the model's longest
        position (`max_position_embeddings`, `_grows_to`), not four times the length it was traced at: a
        generation runs far past four times its prompt, which cost a program for every fourfold, and a program
        without gradients keeps no activations whose memory the bound would decide (NOTE: [Dynamic sizes])."""
        try:
            from transformers.cache_utils import Cache, DynamicCache
        except ImportError:
            return None
        # `cache=` in recent transformers, `past_key_values=` before
        cache = next((v for v in (*args, *kwargs.values()) if isinstance(v, Cache)), None)
        if cache is None:
            return None
        layers = list(getattr(cache, "layers", ()))
        leaf = next((i for i, x in enumerate(pytree.tree_leaves((args, kwargs))) if x is cache), None)
        # a sliding window's count of the tokens it has seen: `cumulative_length` (`_int` in a static cache)
        numbers = tuple(
            (leaf, (("attr", "layers"), ("item", i), ("attr", name)))
            for i, layer in enumerate(layers)
            if leaf is not None and getattr(layer, "is_sliding", False)
            for name in ("cumulative_length", "cumulative_length_int")
            if type(getattr(layer, name, None)) is int and getattr(layer, name) > 0
        )
        # an encoder-decoder's: its self-attention's part grows, its cross-attention's is the encoder's length
        own = getattr(cache, "self_attention_cache", cache)
        dims = self._grown(own, kwargs, inputs) if isinstance(own, DynamicCache) else {}
        if dims is None:  # no tokens held yet: the prompt's call
            return None
        return (dims, numbers) if dims or numbers else None

    def _grows_to(self) -> int:
        """The model's longest position, which bounds a generation's cache (NOTE: [A cache that grows]):
        its decoder's, where the config names that apart (Whisper's `max_target_positions`);
        `_UNNAMED_LONGEST` where it names none (T5's relative positions)."""
        config = getattr(self._orig, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        for name in ("max_target_positions", "max_position_embeddings"):
            longest = getattr(text, name, None)
            if isinstance(longest, int) and longest > 0:
                return longest
        return _UNNAMED_LONGEST

    @staticmethod
    def _grown(cache: Any, kwargs: dict, inputs: list[torch.Tensor]) -> dict[int, tuple[int, ...]] | None:
        """The dimensions a `DynamicCache` and the attention mask grow in at each step (NOTE: [A cache that
        grows]); None where the cache holds fewer than two tokens, or has no length (Mamba's recurrent states)."""
        try:
            held = cache.get_seq_length()
        except ValueError:  # a cache of recurrent states alone (Mamba's) has no length, and does not grow
            return None
        if held < 2:  # none yet (the prompt's call), or one: a size of one is traced as a constant
            return None
        # its keys and values: by layer (`layers[i].keys`), or in lists (`key_cache[i]`, transformers 4)
        held_tensors = [getattr(layer, k, None) for layer in getattr(cache, "layers", ()) for k in ("keys", "values")]
        held_tensors += [*getattr(cache, "key_cache", ()), *getattr(cache, "value_cache", ())]
        where = {id(x): i for i, x in enumerate(inputs)}
        dims = {
            where[id(t)]: (t.dim() - 2,)
            for t in held_tensors
            if isinstance(t, torch.Tensor) and id(t) in where and t.dim() >= 3 and t.shape[-2] == held
        }
        tokens = next(
            (kwargs[k] for k in ("input_ids", "inputs_embeds") if isinstance(kwargs.get(k), torch.Tensor)), None
        )
        mask = kwargs.get("attention_mask")
        if (
            tokens is not None
            and isinstance(mask, torch.Tensor)
            and mask.dim() == 2
            and mask.shape[1] == held + tokens.shape[1]
            and id(mask) in where
        ):
            dims[where[id(mask)]] = (1,)
        return dims

    # NOTE: [Generation on every rank]
    # A compiled model's every call gathers parameters from every rank, so every rank must make the same
    # calls. `generate()` stops where its sequences end: with prompts of its own, a rank whose sequences
    # ended first stopped calling while the others waited in their next call, until the timeout. ZeRO-3
    # and FSDP need the same, and transformers keeps a finished rank calling (`synced_gpus`: generate,
    # Seq2SeqTrainer's predict_with_generate) where `is_fsdp_managed_module(model)` says the model's
    # parameters are sharded, which it reads from this attribute. A `synced_gpus=False` passed on purpose
    # is kept.
    @property
    def _is_fsdp_managed_module(self) -> bool:
        return self.layout.world_size > 1

    @_is_fsdp_managed_module.setter
    def _is_fsdp_managed_module(self, value: bool) -> None:
        """FSDP's fully_shard marks what it takes: the mark is taken without a word, and fully_shard
        around a compiled model is refused at its next call (the shards' check)."""


# NOTE: [Adapters loaded by name]
# peft's `load_adapter` (what HF's Trainer calls to resume a LoRA run from its checkpoint) keys the
# adapter's weights by the model's parameter names: where no name of `model.named_parameters()` starts
# with "base_model.model.", it strips that prefix. A compiled model's named parameters are its flat
# shards (`flat_params.N`), so the prefix was stripped, no key matched, and `load_state_dict(...,
# strict=False)` loaded nothing: the resumed run trained the adapters from their initial values,
# silently. Such methods (`BY_NAMES`) run with `named_parameters()` naming the compiled model's
# parameters (`CompiledModule.by_names`); what they load goes through the compiled model's
# `load_state_dict` into the shards. So do the counts (`num_parameters`, peft's
# `print_trainable_parameters`): on the shards they counted this rank's part, and `num_parameters` could
# not tell the embeddings apart.
BY_NAMES = frozenset({"load_adapter", "num_parameters", "get_nb_trainable_parameters", "print_trainable_parameters"})


def _by_names(method: Callable) -> Callable:
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.by_names():
            return method(self, *args, **kwargs)

    return run


def _refused(model: str, method: str) -> Callable:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"fbmt: {model}.{method}() on a compiled model: {BEFORE_COMPILE[method]}")

    refuse.__name__ = method
    return refuse


def _mixed_precision(state: Any) -> str | None:
    """accelerate's mixed-precision setting, where an AcceleratorState was made (its public property
    raises before one is)."""
    shared = getattr(state.AcceleratorState, "_shared_state", {})
    return shared.get("_mixed_precision") if shared else None


def _presenting_signature(wrapped: type) -> Callable:
    """The compiled class's `forward`, with the wrapped class's signature and docstring."""

    def forward(self: CompiledModule, *args: Any, **kwargs: Any) -> Any:
        return CompiledModule.forward(self, *args, **kwargs)

    try:
        forward.__signature__ = inspect.signature(wrapped.forward)
    except (TypeError, ValueError):  # a forward inspect cannot read: keep (*args, **kwargs)
        pass
    forward.__doc__ = wrapped.forward.__doc__
    forward.__qualname__ = f"{wrapped.__qualname__}.forward (compiled by fbmt)"
    return forward


def default_init_fn(model: nn.Module) -> Callable[[nn.Module], None] | None:
    """A Hugging Face model's own `_init_weights(module)` (what `from_config` runs; fbmt's zoo defines
    it too, to read its checkpoint), for a model built on `meta`; None for other models."""
    init = getattr(model, "_init_weights", None) if hasattr(model, "config") else None
    return init if callable(init) else None


def _experts_hint(module: nn.Module, kind: str) -> str | None:
    """Transformers' mixture-of-experts layers other than "grouped_mm" choose experts by value; said
    only of a model whose experts can be set (JetMoE's cannot: its router reads values itself)."""
    experts = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if kind not in ("DynamicOutputShapeException", "DataDependentOutputException") or experts in (None, "grouped_mm"):
        return None
    settable = getattr(type(module), "_can_set_experts_implementation", None)
    try:
        if callable(settable) and not settable():
            return None
    except Exception:  # transformers' check reads the model's source: where it cannot, say nothing of it
        return None
    return (
        f"this model's mixture-of-experts layers run transformers' {experts!r} experts, which choose "
        'the experts to run by value; build or load it with experts_implementation="grouped_mm" '
        "(transformers' default), e.g. AutoModelForCausalLM.from_config(config, "
        'experts_implementation="grouped_mm") or from_pretrained(path, experts_implementation='
        '"grouped_mm"), which fbmt traces'
    )


register_trace_hint(_experts_hint)


def _layerdrop_hint(module: nn.Module, kind: str) -> str | None:
    """LayerDrop (BART, mBART, Pegasus, Marian, Whisper, ...) skips a layer where `torch.rand([])` falls
    under the layer's drop probability, a Python `if` on a value no trace has. Transformers 5.17 draws
    and compares in every training call, even where the probability is 0, which the trace decides (NOTE:
    [Draws compared with a bound]); later versions (5.24) only where it is above 0."""
    drops = [m.layerdrop for m in module.modules() if isinstance(getattr(m, "layerdrop", None), (int, float))]
    if kind != "DataDependentOutputException" or not drops:
        return None
    p = max(drops)
    if p > 0:
        return (
            f"LayerDrop (a layer skipped at random, here with probability {p}) chooses in Python which layers "
            "run, which no program can hold: set the config's encoder_layerdrop / decoder_layerdrop (or "
            "layerdrop) to 0 before building the model"
        )
    return (
        "this transformers version draws each layer's LayerDrop probability in every training call, though "
        "the drop probability is 0, and compares it in a way the trace cannot decide (it decides "
        "`torch.rand([]) < 0`); a newer transformers (5.24) skips the draw where it is 0"
    )


register_trace_hint(_layerdrop_hint)


def _spec_augment() -> Iterator[HostFunction]:
    """SpecAugment's draws of masked spans (wav2vec2, HuBERT, WavLM, Data2Vec-Audio, SEW, UniSpeech,
    SpeechT5, Whisper, ...): `_compute_mask_indices(shape, ...)`, a boolean array of `shape`, wherever
    a loaded modeling module defines or imports it, called on the host at every call (NOTE: [Host calls])."""
    for name, module in list(sys.modules.items()):
        # read from the module's own names: transformers' lazy packages import on a missing attribute
        if name.startswith("transformers.models.") and callable(
            getattr(module, "__dict__", {}).get("_compute_mask_indices")
        ):
            yield HostFunction(module, "_compute_mask_indices", _mask_shape)


def _mask_shape(bound: inspect.BoundArguments) -> tuple[tuple, torch.dtype]:
    return tuple(bound.arguments["shape"]), torch.bool


register_host_function(_spec_augment)
