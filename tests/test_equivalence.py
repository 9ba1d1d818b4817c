"""Compiled vs eager on the same global batch: losses, gathered gradients, parameters after 5 SGD steps.

Every combination of zero={3,2}, remat={block,none}, schedule={prefetch,none} on 1 and 2 gloo ranks
(on 4, two of them), for an MLP, a GPT (ModuleList blocks, tied embeddings) and a model with buffers,
kwargs and dict/tuple outputs; plus, on the GPT, gradient accumulation, gathers two blocks ahead
(prefetch=2), remat="selective" and "mincut" (on 1 and 2 ranks), and backend="inductor" (on 2).
"""

import pytest

from tests.dist import run_ranks
from tests.workers import CONFIGS, CONFIGS_ON_4, equivalence


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name", ["mlp", "gpt", "buffered"])
def test_matches_eager(world: int, name: str) -> None:
    done = run_ranks(world, equivalence, name)
    assert all(len(d) >= len(CONFIGS if world < 4 else CONFIGS_ON_4) for d in done)
