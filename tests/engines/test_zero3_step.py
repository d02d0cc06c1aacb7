"""ZeRO-3's optimizer step without DeepSpeed's two extra copies (`engines.zero3_step`): the master weights
are the parameter partitions and the step's gradient is the flat gradient buffer; the same weights bit
for bit; and a parameter without a gradient in a step steps with zero, not with its last gradient."""
import os
import re
import subprocess
import sys

import pytest
import torch

from posttrain.engines.zero3_step import adjacent_view

HERE = os.path.dirname(os.path.abspath(__file__))


def test_adjacent_views_of_one_buffer_become_one_view():
    buf = torch.arange(10.0)
    parts = [buf.narrow(0, 2, 3), buf.narrow(0, 5, 4)]
    view = adjacent_view(parts)
    assert (torch.equal(view, torch.cat(parts))
            and view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr())
    view.mul_(2)  # a view, not a copy
    assert buf[2:9].tolist() == [4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0]


@pytest.mark.parametrize("parts", [
    lambda b: [b.narrow(0, 0, 3), b.narrow(0, 4, 2)],   # a gap
    lambda b: [b.narrow(0, 3, 2), b.narrow(0, 0, 3)],   # out of order
    lambda b: [b.narrow(0, 0, 3), torch.zeros(2)],       # another storage (a frozen parameter's zeros)
    lambda b: [b.clone()],                               # not a view
    lambda b: [b.view(2, 5)[:, :2]],                     # not contiguous
    lambda b: [],
])
def test_anything_else_keeps_deepspeeds_copy(parts):
    assert adjacent_view(parts(torch.arange(10.0))) is None


@pytest.mark.e2e
def test_the_step_shares_weights_and_gradients_and_trains_identically():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, os.path.join(HERE, "zero3_step_worker.py")], check=False, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out[-2000:] + proc.stderr[-4000:]
    runs = {(name, lean == "True"): (masters == "True", grads == "True", int(groups))
            for name, lean, masters, grads, groups
            in re.findall(r"(\w+) lean=(\w+) masters=(\w+) grads=(\w+) groups=(\d+)", out)}
    assert len(runs) == 4, out
    for name in ("default", "split"):
        assert runs[(name, True)][:2] == (True, True), out
        assert runs[(name, False)][:2] == (False, False), out  # the control: DeepSpeed's copies
        assert f"{name} identical=True" in out, out
    # several sub-groups per parameter group
    assert runs[("split", True)][2] > runs[("default", True)][2], out
    unused = dict(re.findall(r"unused lean=(\w+) gradient=(\S+)", out))
    assert float(unused["False"]) > 0, out  # DeepSpeed's own: the last step's gradient again
    # cleared after each step: a parameter without a gradient steps with 0
    assert float(unused["True"]) == 0, out
