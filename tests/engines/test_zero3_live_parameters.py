"""ZeRO-3 holds at most `live_parameters(model numel)` elements gathered and keeps a gathered one only for a
reuse within that distance (deepspeed_engine): with DeepSpeed's defaults (1e9) a model under 1B parameters
stays whole-gathered at the turn from forward to backward once DeepSpeed has traced a step; with 1/8 of the
model, a fraction of it is."""
import os
import re
import subprocess
import sys

import pytest

from posttrain.engines.deepspeed_engine import ds_config, live_parameters

pytestmark = [pytest.mark.e2e]
HERE = os.path.dirname(os.path.abspath(__file__))


def gathered_fractions(mode: str) -> list[float]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, os.path.join(HERE, "zero3_live_worker.py"), mode], check=False,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    pairs = re.findall(r"gathered (\d+) of (\d+)", proc.stdout)
    assert len(pairs) == 3, proc.stdout[-2000:]
    return [int(a) / int(b) for a, b in pairs]


def test_a_rank_holds_a_fraction_of_the_model_gathered():
    ours, default = gathered_fractions("posttrain"), gathered_fractions("deepspeed")
    assert default[-1] > 0.9, default  # the control: DeepSpeed's default holds (nearly) the whole model
    assert ours[-1] < 0.2, ours


def test_the_bound_is_an_eighth_of_the_model_within_limits():
    assert live_parameters(494_032_768) == 61_754_096  # Qwen2.5-0.5B
    assert live_parameters(10_199_424) == 10_000_000 and live_parameters(70_000_000_000) == 1_000_000_000
    zero = ds_config(zero_stage=3, world_size=2, max_norm=1.0, model_numel=494_032_768)["zero_optimization"]
    assert zero["stage3_max_live_parameters"] == zero["stage3_max_reuse_distance"] == 61_754_096
    assert "stage3_max_live_parameters" not in ds_config(zero_stage=2, world_size=2, max_norm=1.0,
                                                         model_numel=494_032_768)["zero_optimization"]
