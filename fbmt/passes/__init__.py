"""The compiler passes: one file per pass, each a pure function `pass(program, **options) ->
(program, summary)` that returns a new Program and one line saying what it did (or why it
declined). `fbmt/pipeline.py` lists them in order with their options; `runner.run_passes` runs such
a list: it times, records, verifies and dumps every pass.

    blocks    tag forward nodes with their block (the unit of sharding and recompute)
    remat     recompute block activations in the backward instead of saving them
    merge     products that read one input, weights side by side, become one product
    shard     ZeRO-3/2: flat shards, all-gather before use, release after, reduce gradients
    schedule  overlap: issue gathers ahead, wait for gradient reductions late (strategies.py: the
              built-in strategies; or replay a saved fbmt.Schedule)
    verify    static invariants (also run after every pass when checks are on)

Passes import the IR (`fbmt.program`, `fbmt.layout`, `fbmt.ops`), never the runtime.
"""

from fbmt.passes import strategies  # noqa: F401  (registers the built-in strategies)
from fbmt.passes.blocks import assign_blocks
from fbmt.passes.merge import merge_products
from fbmt.passes.remat import POLICIES, recompute_blocks
from fbmt.passes.runner import REQUIRED, Pass, run_passes
from fbmt.passes.schedule import STRATEGIES, register_strategy, schedule_overlap
from fbmt.passes.shard import shard_parameters
from fbmt.passes.verify import VerifyError, check, verify_program

# The pipeline's passes in order (fbmt/pipeline.py binds their options), for `disable=` to be checked
# against when the options are made.
PASS_NAMES = ("blocks", "remat", "merge", "shard", "schedule", "verify")

__all__ = [
    "assign_blocks",
    "merge_products",
    "recompute_blocks",
    "schedule_overlap",
    "shard_parameters",
    "verify_program",
    "check",
    "run_passes",
    "register_strategy",
    "Pass",
    "POLICIES",
    "PASS_NAMES",
    "REQUIRED",
    "STRATEGIES",
    "VerifyError",
]
