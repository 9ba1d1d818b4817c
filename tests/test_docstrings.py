"""Every public name of fbmt, and every public method of its classes, says what it does (`help()`
is the first documentation a user reads)."""

import inspect

import fbmt


def _public(obj):
    for name in getattr(obj, "__all__", None) or [n for n in vars(obj) if not n.startswith("_")]:
        value = getattr(obj, name, None)
        if (inspect.isclass(value) or inspect.isfunction(value)) and value.__module__.startswith("fbmt"):
            yield name, value


def test_every_public_name_and_method_has_a_docstring():
    missing = []
    modules = [
        fbmt,
        fbmt.checkpoint,
        fbmt.optim,
        fbmt.lr_scheduler,
        fbmt.inspect,
        fbmt.loss,
        fbmt.utils,
        fbmt.sim,
        fbmt.viz,
    ]
    for module in modules:
        for name, value in _public(module):
            if not (value.__doc__ or "").strip():
                missing.append(f"{module.__name__}.{name}")
            if inspect.isclass(value):
                for m, f in vars(value).items():
                    if not m.startswith("_") and inspect.isfunction(f) and not (inspect.getdoc(f) or "").strip():
                        missing.append(f"{module.__name__}.{name}.{m}")
    assert not missing, missing
