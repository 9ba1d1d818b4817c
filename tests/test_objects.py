"""fbmt.objects: objects in a call that hold tensors (a Hugging Face cache, or the user's own)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fbmt
from fbmt.compiler import objects


class State:
    def __init__(self, t: torch.Tensor, n: int):
        self.parts = [t, {"twice": t}]  # one tensor, reachable twice
        self.n = n


def test_tensors_fingerprint_and_rebuild():
    t = torch.ones(2)
    s = State(t, 3)
    assert objects.tensors_in(s) == [t]
    assert objects.fingerprint(s) == objects.fingerprint(State(torch.zeros(2), 3))
    assert objects.fingerprint(s) != objects.fingerprint(State(torch.zeros(3), 3))  # another shape
    assert objects.fingerprint(s) != objects.fingerprint(State(t, 4))  # another plain value
    copy = objects.rebuild(s, [torch.full((2,), 5.0)])
    assert copy.parts[0] is copy.parts[1]["twice"] and copy.parts[0][0] == 5 and s.parts[0][0] == 1
    s.parts.append(object())
    with pytest.raises(TypeError, match="holds a object, which fbmt cannot compare"):
        objects.fingerprint(s)


class Accumulate(nn.Module):
    """A forward that reads an argument object and updates it in place, as a cache's update does."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, state: State) -> torch.Tensor:
        y = self.fc(x) + state.parts[0]
        state.parts[0] = y.detach()
        state.n += 1
        return y.sum()


def test_an_argument_object_is_updated_in_place_as_in_eager():
    torch.manual_seed(0)
    ref = Accumulate()
    model = fbmt.compile(Accumulate())
    model.load_state_dict(ref.state_dict())
    a, b = State(torch.zeros(2), 0), State(torch.zeros(2), 0)
    x = torch.randn(3, 2)
    for _ in range(3):
        torch.testing.assert_close(model(x, b), ref(x, a))
    torch.testing.assert_close(b.parts[0], a.parts[0])
    assert b.n == a.n == 3 and type(b.parts[0]) is torch.Tensor
    assert len(model.programs) == 3  # the state's n is part of the key: one program per value it had
