"""Compiled vs eager on the same global batch: losses, gathered gradients, parameters after 5 SGD steps.

Every combination of zero={3,2}, remat={block,none}, schedule={prefetch,none} on 1, 2 and 4 gloo
ranks, for an MLP, a GPT (ModuleList blocks, tied embeddings) and a model with buffers, kwargs and
dict/tuple outputs; plus, on the GPT, gradient accumulation, remat="selective" and "mincut", gathers
two blocks ahead (prefetch=2), and (on 2 ranks) backend="inductor".
"""

import pytest

from tests.dist import run_ranks
from tests.workers import CONFIGS, equivalence


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name", ["mlp", "gpt", "buffered"])
def test_matches_eager(world: int, name: str) -> None:
    done = run_ranks(world, equivalence, name)
    assert all(len(d) >= len(CONFIGS) for d in done)
