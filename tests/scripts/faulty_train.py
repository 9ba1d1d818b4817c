"""`python -m fbmt.train` under torchrun with one fault in the first attempt (TORCHELASTIC_RESTART_COUNT
0), on rank 1: FBMT_TEST_FAULT=step:N kills it (SIGKILL) right after optimizer step N; save:N kills it
while it writes the checkpoint of step N, before the checkpoint is complete."""

import os
import signal

import torch.distributed.checkpoint as dcp
from torch.optim.optimizer import register_optimizer_step_post_hook

from fbmt import train

kind, at = os.environ["FBMT_TEST_FAULT"].split(":")
if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and os.environ["RANK"] == "1":
    if kind == "step":
        steps = [0]

        def count(optimizer, args, kwargs):
            steps[0] += 1
            if steps[0] == int(at):
                os.kill(os.getpid(), signal.SIGKILL)

        register_optimizer_step_post_hook(count)
    else:
        write = dcp.FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            if f"step-{int(at):08d}" in str(self.path):
                os.kill(os.getpid(), signal.SIGKILL)
            return write(self, plan, planner)

        dcp.FileSystemWriter.write_data = write_then_die

train.main(train.parse_args())
