"""`fbmt.compile`: turn a plain single-device module into a ZeRO-sharded, recomputing, overlapped one.

This is where the three parts of fbmt meet (docs/ARCHITECTURE.md): the options are checked, the
compiler (`fbmt.compiler.compile_module`) builds the module, with the class that carries the
integrations (Hugging Face's method lookup and accelerate's mark, the refusal of DDP) and with
remat="auto"'s search from the tools (`fbmt.tools.auto_remat.choose`, priced on a fixed cost model),
and the torch guards are installed (the optimizer check, the global gradient norm).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch.nn as nn

from fbmt.compiler import CompiledModule, CompileOptions, compile_module
from fbmt.integrations import accelerate_state, torch_guards, trainer, transformers
from fbmt.tools import auto_remat

__all__ = ["compile", "CompileOptions", "CompiledModule"]

torch_guards.install_at_import()  # an optimizer's state may be loaded before any model is compiled


class _Compiled(torch_guards.NoDataParallel, transformers.Forwarding):
    """The compiled module's class: the compiler's module with the integrations' behaviour."""

    def _adopt(self) -> None:
        super()._adopt()
        torch_guards.install(self.gradient_leaves())  # its shards' gradients sum over ranks in clip_grad_norm_
        trainer.install_when_imported()  # HF Trainer's checkpoints and decay split (NOTE: [Trainer checkpoints])
        accelerate_state.install_when_imported()  # NOTE: [accelerate's checkpoints]


def compile(model: nn.Module, **options: Any) -> CompiledModule:
    """Compile `model` for training on every rank of the job; the options are `CompileOptions`'
    fields (docs/options.md).

    The returned module's `parameters()` are this rank's flat shards: build any torch optimizer on
    them. Its `state_dict()` holds full tensors under the original keys. The model is taken over:
    its parameters are replaced by `meta` placeholders so only the shards hold memory. A model built
    under `torch.device("meta")` is materialized block by block with `init_fn(module)`, a Hugging Face
    model's `_init_weights(module)` or each module's `reset_parameters()`, so no rank ever holds the
    whole model.
    """
    o = CompileOptions.from_kwargs(options)
    transformers.check_model(model, o.remat)
    if o.remat == "auto":
        auto_remat.machine_of(o.cost_model)  # a cost model of the wrong kind is named now, not at the first call
    cls = transformers.compiled_class(_Compiled, type(model)) if isinstance(model, nn.Module) else _Compiled
    return compile_module(
        model, o, module_class=cls, search=auto_remat.choose, init_fn=transformers.default_init_fn(model)
    )


# `inspect.signature(fbmt.compile)` and help() show every option with its default.
compile.__signature__ = inspect.Signature(
    [inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=nn.Module)]
    + [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in dataclasses.fields(CompileOptions)
        if f.init
    ],
    return_annotation=CompiledModule,
)
