"""bench/rollout_vllm.py --quick (a tiny model, batch 4, 8 new tokens) runs both engines and prints one
table row with their tokens/s and the ratio. It builds a real vLLM engine (its CPU build here), in a
subprocess: vLLM's CPU worker makes `torch.set_num_threads` a no-op in the process that builds it; with
torch.compile on (tests/conftest.py turns it off for the rest of the suite), as users run vLLM."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.config.backends import vllm_unavailable

WHY_NOT = vllm_unavailable()
pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(bool(WHY_NOT), reason=f"vLLM does not run here: {WHY_NOT}")]

ROOT = Path(__file__).resolve().parent.parent
NUMBER = r"[\d,]+"


def test_quick_rollout_bench_measures_both_engines():
    env = {k: v for k, v in os.environ.items() if k != "TORCH_COMPILE_DISABLE"}  # vLLM as users run it
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "rollout_vllm.py"), "--quick", "--eager"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900, check=False, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    ratio = r"\*\*(\d+\.\d\d)x\*\*"
    row = rf"\| tiny \| 4 \| 8 \| ({NUMBER}) \| ({NUMBER}) \| {ratio} \| {NUMBER} \| {NUMBER} \| {ratio} \|"
    rows = re.findall(row, run.stdout)
    assert len(rows) == 2, run.stdout  # printed as measured, then in the final table
    hf, vllm, wall_ratio, _cpu_ratio = rows[-1]
    hf, vllm = (float(x.replace(",", "")) for x in (hf, vllm))
    assert hf > 0 and vllm > 0 and float(wall_ratio) == pytest.approx(vllm / hf, rel=0.02, abs=0.01)
