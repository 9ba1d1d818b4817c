"""The compiler passes: one file per pass, each a pure function `pass(program, **options) ->
(program, stats)` that returns a new Program and a typed record of what it did (or why it
declined). `fbmt/compiler/pipeline.py` lists them in order with their options; `runner.run_passes`
runs such a list: it times, records, verifies and dumps every pass.

    loss      a cross-entropy over a large vocabulary, computed chunk by chunk over the tokens
    blocks    tag forward nodes with their block (the unit of sharding and recompute)
    remat     recompute block activations in the backward instead of saving them
    merge     products that read one input, weights side by side, become one product
    fp8       with fp8=: the blocks' products in FP8, scaled dynamically
    shard     ZeRO-3/2: flat shards, all-gather before use, release after, reduce gradients
    schedule  overlap: issue gathers ahead, wait for gradient reductions late (strategies.py: the
              built-in strategies; or replay a saved fbmt.Schedule)
    verify    static invariants (also run after every pass when checks are on)

Passes import the IR (`program`, `layout`, `meta`, `ops`, `collectives`), never the runtime.

NOTE: [Pass stats]
What a pass did is data: each pass returns a frozen dataclass of its own (`BlockStats`,
`RematStats`, `LossStats`, `MergeStats`, `Fp8Stats`, `ShardStats`, `ScheduleStats`; `Note` for a
sentence: "ok", "disabled by the user") holding its counts, the policies it applied, the blocks it
treated specially and what it declined, and whose `str()` is the one line `print(program)` shows.
The runner keeps it in the program's history (`PassRecord.stats`); `program.stats("shard").gathers`
reads it, tests assert on it, and remat="auto"'s choice reaches the remat pass as such a record
(`RematChoice`), not as text.
"""

from fbmt.compiler.passes import strategies  # noqa: F401  (registers the built-in strategies)
from fbmt.compiler.passes.blocks import BlockStats, assign_blocks
from fbmt.compiler.passes.fp8 import RECIPES as FP8_RECIPES
from fbmt.compiler.passes.fp8 import Fp8Stats, fp8_products
from fbmt.compiler.passes.loss import LossStats, chunk_losses
from fbmt.compiler.passes.merge import MergeStats, merge_products
from fbmt.compiler.passes.remat import (
    POLICIES,
    BlockRecompute,
    Costs,
    RematChoice,
    RematStats,
    Trailing,
    block_costs,
    recompute_blocks,
)
from fbmt.compiler.passes.runner import REQUIRED, Pass, run_passes
from fbmt.compiler.passes.schedule import (
    STRATEGIES,
    ScheduleStats,
    register_strategy,
    schedule_overlap,
    strategy_options,
)
from fbmt.compiler.passes.shard import ShardStats, shard_parameters
from fbmt.compiler.passes.verify import VerifyError, check, verify_program

__all__ = [
    "BlockRecompute",
    "BlockStats",
    "Costs",
    "FP8_RECIPES",
    "Fp8Stats",
    "LossStats",
    "MergeStats",
    "RematChoice",
    "RematStats",
    "ScheduleStats",
    "ShardStats",
    "Trailing",
    "assign_blocks",
    "block_costs",
    "chunk_losses",
    "fp8_products",
    "merge_products",
    "recompute_blocks",
    "schedule_overlap",
    "shard_parameters",
    "verify_program",
    "check",
    "run_passes",
    "register_strategy",
    "strategy_options",
    "Pass",
    "POLICIES",
    "REQUIRED",
    "STRATEGIES",
    "VerifyError",
]
