"""Issue 49: a flag of how a model is loaded and run is named (as text anywhere in a file) by at most five
files of `posttrain/`: its declaration (`config/sections.py`), its rules (`config/validate.py`), its one
owner, and the places that genuinely differ (vLLM's own argument, a checkpoint meta key); everything else
asks the owner. OpenRLHF's old flat names (`--ds_X`, `--vllm_X`) are derived by rule, not listed.

`--ds.tensor_parallel_size` and `--vllm.tensor_parallel_size` share their field name: a file counts for a
flag when it names the flag's section-qualified field, or the bare field name without any section (counted
for both flags: a checkpoint meta key, vLLM's keyword)."""
from __future__ import annotations

from pathlib import Path

import posttrain

PACKAGE = Path(posttrain.__file__).resolve().parent  # the package under test
MOST_FILES = 5
FLAGS = ("ds.ring_attn_size", "ds.experts_implementation", "model.aux_loss_coef",
         "data.max_images_per_prompt", "ds.tensor_parallel_size", "vllm.tensor_parallel_size")


def files_naming(flag: str, texts: dict[str, str]) -> list[str]:
    """The files of `texts` (path -> source) that name `flag` ("section.field"): its qualified name, or the
    bare field where no flag of that field name is qualified in the file."""
    field = flag.split(".", 1)[1]
    qualified = {f for f in FLAGS if f.split(".", 1)[1] == field}
    return sorted(path for path, text in texts.items()
                  if flag in text or (field in text and not any(f in text for f in qualified)))


def test_the_model_flags_are_named_by_few_files():
    texts = {str(p.relative_to(PACKAGE)): p.read_text(encoding="utf-8") for p in PACKAGE.rglob("*.py")}
    over = {flag: named for flag in FLAGS if len(named := files_naming(flag, texts)) > MOST_FILES}
    assert over == {}


def test_a_shared_field_name_counts_for_each_flag_that_has_it():
    texts = {"a.py": "cfg.ds.tensor_parallel_size", "b.py": "meta['tensor_parallel_size']",
             "c.py": "cfg.vllm.tensor_parallel_size", "d.py": "cfg.actor.aux_loss_coef"}
    assert files_naming("ds.tensor_parallel_size", texts) == ["a.py", "b.py"]
    assert files_naming("vllm.tensor_parallel_size", texts) == ["b.py", "c.py"]
    assert files_naming("model.aux_loss_coef", texts) == ["d.py"]
