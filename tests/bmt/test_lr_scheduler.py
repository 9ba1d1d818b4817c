"""BMTrain's lr schedulers: each formula at several iterations, param groups, jumps and resume."""

import math

import pytest
import torch

from fbmt import lr_scheduler

START, W, E = 1e-3, 10, 110


def _opt():
    return torch.optim.SGD(
        [{"params": [torch.nn.Parameter(torch.zeros(2))]}, {"params": [torch.nn.Parameter(torch.zeros(3))], "lr": 5.0}],
        lr=1.0,
    )


EXPECTED = {
    "NoDecay": lambda i: START * i / W if i < W else START,
    "Noam": lambda i: START / math.sqrt(W) * i / W if i < W else START / math.sqrt(i),
    "Linear": lambda i: START * i / W if i < W else max(0.0, START * (E - i) / (E - W)),
    "Cosine": lambda i: START * i / W if i < W else max(0.0, 0.5 * START * (1 + math.cos(math.pi * (i - W) / (E - W)))),
    "Exponential": lambda i: START * i / W if i < W else max(0.0, START * 0.95 ** (i - W)),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_formula_at_every_iteration_and_every_group(name):
    opt = _opt()
    sched = getattr(lr_scheduler, name)(opt, start_lr=START, warmup_iter=W, end_iter=E)
    for i in range(0, 130):
        if i:
            sched.step()
        want = EXPECTED[name](i)
        assert sched.num_iter == i and sched.current_lr == pytest.approx(want, rel=1e-12, abs=1e-15), i
        assert all(g["lr"] == sched.current_lr for g in opt.param_groups)


def test_construction_sets_lr_at_num_iter_and_step_can_jump():
    opt = _opt()
    sched = lr_scheduler.Cosine(opt, start_lr=START, warmup_iter=W, end_iter=E, num_iter=60)
    assert opt.param_groups[0]["lr"] == pytest.approx(EXPECTED["Cosine"](60))
    sched.step(5)
    assert sched.num_iter == 5 and opt.param_groups[1]["lr"] == pytest.approx(START * 5 / W)
    assert lr_scheduler.Linear(_opt(), START, W, E, num_iter=E + 50).current_lr == 0.0


def test_state_dict_round_trip_resumes_the_same_schedule():
    a = lr_scheduler.Exponential(_opt(), START, W, E, gamma=0.9)
    for _ in range(37):
        a.step()
    b = lr_scheduler.Exponential(_opt(), 1.0, 0, 1)
    b.load_state_dict(a.state_dict())
    for _ in range(5):
        a.step()
        b.step()
        assert a.current_lr == b.current_lr and b.gamma == 0.9


def test_noam_without_warmup_does_not_divide_by_zero():
    assert lr_scheduler.Noam(_opt(), START, 0, E).current_lr == START
