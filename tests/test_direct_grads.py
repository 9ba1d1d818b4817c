"""`compile(direct_grads=True)` (NOTE: [Direct gradients]): weight gradients written by their matrix
products straight into the reduce-scatter buffer. Equivalence with eager training is in
test_equivalence (fp32) and test_mixed_precision (bf16 compute); here, what the pass rewrites and
what the runtime then skips."""

from __future__ import annotations

import torch

import fbmt
from fbmt.runtime import collectives
from tests.models.reference import gpt


def _program(direct: bool, **options) -> fbmt.Program:
    torch.manual_seed(0)
    return fbmt.compile(gpt(n_layer=2), world_size=2, direct_grads=direct, checks=True, **options).trace(
        torch.randint(0, 64, (4, 16)))


def _calls(program: fbmt.Program, fn: object) -> list:
    return [n for n in program.graph.nodes if n.target is fn]


def test_every_linear_weight_gradient_is_written_in_place_and_its_product_is_gone():
    plain, direct = _program(False, param_dtype=torch.bfloat16), _program(True, param_dtype=torch.bfloat16)
    into = _calls(direct, collectives.mm_into)
    assert len(into) == 8  # 4 Linear weights in each of 2 blocks; the tied embedding's sum is not a product
    mms = len(_calls(plain, torch.ops.aten.mm.default))
    assert len(_calls(direct, torch.ops.aten.mm.default)) == mms - len(into)  # replaced, not duplicated
    buffers = _calls(direct, collectives.grad_buffer)
    assert len(buffers) == 2 and all(b.args[2] == torch.float32 for b in buffers)  # the fp32 reduce dtype
    for n in into:
        start = next(u for u in n.users if u.target is collectives.reduce_scatter)
        assert n.args[2] is start.args[6]  # written into the buffer its reduce-scatter sends
    assert "8 gradients written in place" in str(direct)


def test_a_reduce_scatter_waits_before_the_next_buffer_is_made():
    program = _program(True)
    order = {n: i for i, n in enumerate(program.graph.nodes)}
    starts = _calls(program, collectives.reduce_scatter)
    checked = 0
    for earlier, later in zip(starts, starts[1:]):
        wait = next(u for u in earlier.users if u.target is collectives.wait)
        if len(later.args) > 6 and order[later.args[6]] > order[earlier]:
            assert order[wait] < order[later.args[6]]  # one flat buffer in flight at a time
            checked += 1
    assert checked == 2  # ln_f's before block 1's buffer, block 1's before block 0's


def test_pieces_already_in_place_are_not_copied():
    buffer = torch.full((12,), float("nan"))
    a, b = torch.randn(2, 3), torch.randn(3, 2)
    in_place = collectives.mm_into(a, b, buffer, 5)  # written at [5, 9)
    torch.testing.assert_close(in_place, (a @ b).view(-1))
    assert in_place.data_ptr() == buffer[5:].data_ptr()
    other = torch.arange(5.0)
    copied = []
    collectives._fill(buffer, [other, in_place], lambda dst, src: copied.append(src) or dst.copy_(src))
    assert len(copied) == 1 and copied[0] is other
    torch.testing.assert_close(buffer, torch.cat([other, (a @ b).view(-1), torch.zeros(3)]))


def test_low_precision_product_into_fp32_buffer():
    buffer = torch.zeros(6)
    a, b = torch.randn(2, 3).bfloat16(), torch.randn(3, 3).bfloat16()
    out = collectives.mm_into(a, b, buffer, 0)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, (a @ b).float().view(-1))  # off CUDA: the product, then the cast
