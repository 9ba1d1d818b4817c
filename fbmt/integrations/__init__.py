"""What adapts the compiler to the libraries and habits around it, each part installed explicitly.

    bmt/             BMTrain's names (`import fbmt as bmt`), lowered onto the compiler (view mode)
    optim/           BMTrain's optimizers: AdamOptimizer, AdamOffloadOptimizer (fbmt._C), OptimManager
    transformers.py  Hugging Face's method lookup, accelerate's mark, `_init_weights`, a trace hint
    torch_guards.py  the optimizer check, the global gradient norm of clip_grad_norm_, DDP's refusal

They import the compiler's public names; the compiler imports none of them.
"""
