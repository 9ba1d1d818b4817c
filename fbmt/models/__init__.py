"""Reference models written in plain PyTorch (used by the main job, the tests and the benchmarks)."""

from fbmt.models.gpt import GPT, GPTConfig, init_weights

__all__ = ["GPT", "GPTConfig", "init_weights"]
