"""Issue 49: a flag of how a model is loaded and run is named (as text anywhere in a file) by few files of
`posttrain/`: its declaration (`config/sections.py`), its one owner, and the places that genuinely differ
(OpenRLHF's old flag names, vLLM's own argument, a checkpoint meta key); everything else asks the owner.
The ceilings are the counts reached; `--ds.tensor_parallel_size` keeps its rules (`config/validate.py`) and
vLLM's CPU settings (`rollout/vllm_cpu.py`, which reads vLLM's own keyword) beside the five."""
from __future__ import annotations

from pathlib import Path

import posttrain

PACKAGE = Path(posttrain.__file__).resolve().parent  # the package under test
MOST_FILES = {"ring_attn_size": 5, "experts_implementation": 5, "aux_loss_coef": 5,
              "max_images_per_prompt": 5, "tensor_parallel_size": 7}


def test_the_model_flags_are_named_by_few_files():
    files = {name: sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                          if name in p.read_text(encoding="utf-8")) for name in MOST_FILES}
    over = {name: named for name, named in files.items() if len(named) > MOST_FILES[name]}
    assert over == {}
