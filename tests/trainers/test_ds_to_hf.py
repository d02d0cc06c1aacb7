"""`posttrain ds-to-hf` (`models.deepspeed_export`): a DeepSpeed ZeRO checkpoint of a 2-rank run (ZeRO-2 and
ZeRO-3) becomes a plain HF folder equal to the run's own export of the same step; a wrapper's `model.` prefix
(OpenRLHF's Actor) is dropped; a crafted file is refused before it can run anything. Issue 46 (the training
runs as subprocesses, `posttrain ds-to-hf` through the console command's entry in this process: `to_hf`): the
output folder rules, a base model of another size or with custom code, a vision-language model's checkpoint
(posttrain's own, torch engine and DeepSpeed), a crafted engine/model.pt."""
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sft_helpers import sft_flags, torchrun_cases

from posttrain.models.deepspeed_export import matched_names
from posttrain.utils.errors import UserError
from tests.cli.test_cli_input_errors import in_process


@pytest.fixture(scope="module")
def zero_runs(tiny_model_dir, arithmetic_dir, tmp_path_factory):
    """stage -> the checkpoint root of a 2-rank ZeRO-`stage` SFT run (checkpoints and their HF exports at
    steps 2 and 4), for stages 2 and 3 in one launch (`torchrun_cases`)."""
    root = tmp_path_factory.mktemp("zero_runs")
    stages = (2, 3)
    runs = torchrun_cases([("posttrain.cli.train_sft",
                            sft_flags(tiny_model_dir, arithmetic_dir, root / f"run{stage}",
                                      "--train.micro_batch_size", "4", "--data.max_samples", "32",
                                      "--ds.zero_stage", stage, "--ckpt.path", root / f"ckpt{stage}",
                                      "--ckpt.save_steps", "2", "--ckpt.save_hf")) for stage in stages],
                          root / "logs")
    return {stage: (root / f"ckpt{stage}", proc) for stage, proc in zip(stages, runs)}


@pytest.mark.e2e
@pytest.mark.parametrize("stage", [2, 3])
def test_a_zero_checkpoint_becomes_the_runs_own_export(zero_runs, tiny_model_dir, tmp_path, stage):
    from posttrain.cli.main import main

    ckpt, proc = zero_runs[stage]
    proc.ok()
    out = tmp_path / "hf"
    main(["ds-to-hf", "--checkpoint", str(ckpt / "global_step2" / "engine"), "--tag", "engine",
          "--model_path", tiny_model_dir, "--output_path", str(out), "--ds.param_dtype", "fp32"])
    want, got = (load_file(str(d / "model.safetensors")) for d in (ckpt / "global_step2_hf", out))
    assert want.keys() == got.keys()
    assert max(float((want[k] - got[k]).abs().max()) for k in want) == 0.0
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)  # a plain folder
    # a crafted file in its place is refused before anything in it runs
    crafted = ckpt / "global_step2" / "engine" / "engine" / "mp_rank_00_model_states.pt"
    marker = tmp_path / "ran"
    crafted.write_bytes(pickle.dumps(_Crafted(str(marker))))
    with pytest.raises(SystemExit) as exit_info:
        main(["ds-to-hf", "--checkpoint", str(ckpt / "global_step2" / "engine"), "--tag", "engine",
              "--model_path", tiny_model_dir, "--output_path", str(tmp_path / "hf2")])
    assert exit_info.value.code == 2 and not marker.exists()


class _Crafted:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))  # what unpickling it would call: creating a file


def test_a_wrappers_model_prefix_is_dropped_and_other_names_are_refused():
    state = {"model.model.embed_tokens.weight": torch.zeros(2), "model.lm_head.weight": torch.ones(2)}
    wanted = {"model.embed_tokens.weight", "lm_head.weight"}
    assert set(matched_names(state, wanted)) == wanted
    # OpenRLHF's critic
    critic = {"model.layers.0.weight": torch.zeros(1), "value_head.weight": torch.ones(1)}
    assert set(matched_names(critic, {"model.layers.0.weight", "score.weight"})) == {"model.layers.0.weight",
                                                                                      "score.weight"}
    with pytest.raises(UserError, match="do not match the base model's"):
        matched_names({"transformer.h.0.weight": torch.zeros(1)}, wanted)


# ---- issue 46: the CLI; user mistakes end in one line and exit status 2 ------------------------------------

ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
       "DS_ACCELERATOR": "cpu"}


def cli(*args):
    return subprocess.run([sys.executable, "-m", "posttrain.cli.main", *map(str, args)], capture_output=True,
                          text=True, env=ENV, timeout=600, check=False)


def one_error_line(proc, *needles):
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback (most recent call last)" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1, proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def sft_run(model, data, root, *extra, vision=False):
    """A 2-step SFT run of `model` saving a checkpoint at each step (and its HF export: `--ckpt.save_hf`) into
    `root`/ckpt, its model into `root`/run; the finished process."""
    image = ["--data.max_images_per_prompt", "1", "--data.apply_chat_template"] if vision else []
    return cli("sft", "--model.model_name_or_path", model, "--data.dataset", data, "--data.input_key",
               "prompt", "--data.output_key", "response", "--data.max_len", "64", "--train.batch_size", "4",
               "--train.micro_batch_size", "4", "--train.max_epochs", "1", "--data.max_samples", "8",
               "--adam.lr", "1e-2", "--ds.param_dtype", "fp32", "--ckpt.output_dir", root / "run",
               "--ckpt.path", root / "ckpt", "--ckpt.save_steps", "1", "--ckpt.save_hf", *image, *extra)


def sft_checkpoint(model, data, root, *extra, vision=False):
    """`sft_run`, asserted to succeed: (the run folder, its checkpoint root: global_step1, global_step2)."""
    proc = sft_run(model, data, root, *extra, vision=vision)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "run", root / "ckpt"


@pytest.fixture(scope="module")
def llm_ckpt(tiny_model_dir, arithmetic_dir, tmp_path_factory):
    """(run folder, checkpoint root) of a one-process SFT run of the nano model under DeepSpeed ZeRO-2
    (`--ds.overlap_comm` starts DeepSpeed on one rank); `engine(ckpt, step)` names a step's ZeRO files."""
    return sft_checkpoint(tiny_model_dir, arithmetic_dir / "train.jsonl", tmp_path_factory.mktemp("llm_ckpt"),
                          "--ds.zero_stage", "2", "--ds.overlap_comm")


def engine(ckpt, step):
    """`--checkpoint`, `--tag` of step `step`'s DeepSpeed files: the flags the old code read as well."""
    return ckpt / f"global_step{step}" / "engine", "--tag", "engine"


def to_hf(capfd, source, model, out, *extra):
    """`posttrain ds-to-hf` in this process (`in_process`: its exit status and what it wrote); `source`: a
    `--checkpoint` folder, or (folder, "--tag", tag)."""
    checkpoint, *tag = source if isinstance(source, tuple) else (source,)
    return in_process(capfd, "ds-to-hf", "--checkpoint", checkpoint, *tag, "--model_path", model,
                      "--output_path", out, "--ds.param_dtype", "fp32", *extra)


def files_of(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.e2e
def test_a_non_empty_output_folder_is_refused_unless_overwrite_replaces_it(llm_ckpt, tiny_model_dir,
                                                                           tmp_path, capfd):
    _, ckpt = llm_ckpt
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    one_error_line(to_hf(capfd, engine(ckpt, 2), tiny_model_dir, out),
                   f"--output_path {out} is not empty", "notes.txt", "--overwrite")
    assert files_of(out) == {"notes.txt": b"mine"}
    proc = to_hf(capfd, engine(ckpt, 2), tiny_model_dir, out, "--overwrite")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (out / "notes.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary folder left beside it
    want, got = (load_file(str(d / "model.safetensors")) for d in (ckpt / "global_step2_hf", out))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.e2e
@pytest.mark.parametrize("where, overwrite", [("engine", False), ("engine", True), ("step", False),
                                             ("root", False), ("run", False)])
def test_ds_to_hf_never_writes_inside_a_checkpoint_or_run_folder(llm_ckpt, tiny_model_dir, capfd, where,
                                                                  overwrite):
    from posttrain.utils.checkpoint import CheckpointManager, verify_checkpoint

    run, ckpt = llm_ckpt
    out, owner = {"engine": (ckpt / "global_step2" / "engine", ckpt / "global_step2"),
                  "step": (ckpt / "global_step2" / "hf2", ckpt / "global_step2"),
                  "root": (ckpt / "converted", ckpt), "run": (run / "converted" / "hf", run)}[where]
    before = files_of(ckpt), files_of(run)
    proc = to_hf(capfd, engine(ckpt, 1), tiny_model_dir, out, *(["--overwrite"] if overwrite else []))
    one_error_line(proc, f"--output_path {out}: {owner} is a posttrain checkpoint or run folder",
                   "--overwrite included")
    assert (files_of(ckpt), files_of(run)) == before
    assert verify_checkpoint(ckpt / "global_step2") is None
    assert CheckpointManager(ckpt).latest() == ckpt / "global_step2"


@pytest.mark.e2e
def test_overwrite_never_deletes_a_folder_that_holds_a_checkpoint(llm_ckpt, tiny_model_dir, tmp_path, capfd):
    import shutil

    _, ckpt = llm_ckpt
    out = tmp_path / "out"
    shutil.copytree(ckpt / "global_step1", out / "kept" / "global_step1")
    proc = to_hf(capfd, engine(ckpt, 1), tiny_model_dir, out, "--overwrite")
    one_error_line(proc, f"--output_path {out} holds {out / 'kept' / 'global_step1'}", "would delete it")
    assert (out / "kept" / "global_step1" / "manifest.json").is_file()


def test_a_failed_conversion_leaves_no_output_folder(tiny_model_dir, tmp_path, monkeypatch):
    """The model is written into a temporary folder and renamed into place: a write that fails half-way (here
    after the weights are written) leaves neither the output folder nor the temporary one."""
    import posttrain.models.saving as saving
    from posttrain.models import deepspeed_export

    weights = load_file(str(os.path.join(tiny_model_dir, "model.safetensors")))
    monkeypatch.setattr(deepspeed_export, "zero_fp32_state", lambda *a, **k: dict(weights))
    real = saving.save_pretrained

    def fails_half_way(model, tokenizer, out_dir, state_dict=None):
        real(model, None, out_dir, state_dict)
        raise OSError("the tokenizer could not be written")

    monkeypatch.setattr(saving, "save_pretrained", fails_half_way)
    out = tmp_path / "parent" / "hf"
    with pytest.raises(OSError, match="tokenizer"):
        deepspeed_export.export_zero_checkpoint("unused", tiny_model_dir, out, dtype="fp32")
    assert not out.exists() and list((tmp_path / "parent").iterdir()) == []


@pytest.mark.e2e
@pytest.mark.parametrize("field", ["intermediate_size", "vocab_size"])
def test_a_base_model_of_another_size_is_one_line(llm_ckpt, tiny_model_dir, tmp_path, capfd, field):
    import shutil

    _, ckpt = llm_ckpt
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    config = json.loads((base / "config.json").read_text())
    config[field] *= 2
    (base / "config.json").write_text(json.dumps(config))
    proc = to_hf(capfd, engine(ckpt, 2), base, tmp_path / "hf")
    one_error_line(proc, "the checkpoint's", "has shape", f"the base model --model_path {base} has",
                   "pass the base model the run started from")
    assert not (tmp_path / "hf").exists()


@pytest.mark.e2e
def test_a_base_model_with_custom_code_is_one_line(llm_ckpt, tiny_model_dir, tmp_path, capfd):
    import shutil

    _, ckpt = llm_ckpt
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    config = json.loads((base / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (base / "config.json").write_text(json.dumps(config))
    (base / "modeling_custom.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    proc = to_hf(capfd, engine(ckpt, 2), base, tmp_path / "hf")
    one_error_line(proc, "has `auto_map`", "trust_remote_code", "does not run")
    assert not (tmp_path / "ran").exists() and not (tmp_path / "hf").exists()


@pytest.mark.e2e
@pytest.mark.parametrize("engine", ["torch", pytest.param("deepspeed", marks=pytest.mark.slow)])
def test_a_vision_language_models_checkpoint_converts_to_its_trained_weights(tiny_vision_dir, tmp_path, capfd,
                                                                              engine):
    from posttrain.data.synthetic_vision import write_colour_dataset
    from posttrain.models.vision import is_vision_folder, load_processor

    data = write_colour_dataset(tmp_path / "data", 8, seed=0)
    # --ds.overlap_comm: DeepSpeed on one rank
    extra = ["--ds.zero_stage", "2", "--ds.overlap_comm"] if engine == "deepspeed" else []
    _, ckpt = sft_checkpoint(tiny_vision_dir, data, tmp_path, *extra, vision=True)
    step = ckpt / "global_step2"
    # a global_stepN folder, as either engine wrote it
    proc = to_hf(capfd, step, tiny_vision_dir, tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = ckpt / "global_step2_hf"  # the run's own --ckpt.save_hf export of that step
    want, got, start = (load_file(str(Path(d) / "model.safetensors"))
                        for d in (exported, tmp_path / "hf", tiny_vision_dir))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert any(not torch.equal(start[k], got[k]) for k in got)  # trained weights, not the base model's
    assert is_vision_folder(tmp_path / "hf") and load_processor(tmp_path / "hf").image_processor is not None


def crafted_torch_file(path, marker):
    torch.save({"weight": _Crafted(str(marker))}, path)


@pytest.mark.e2e
def test_a_crafted_engine_model_file_is_refused_in_one_line(tiny_model_dir, arithmetic_dir, tmp_path, capfd):
    """engine/model.pt replaced by a pickle that would create a file, its manifest entry updated to match:
    resuming and ds-to-hf refuse it with one line naming the file, and nothing in it runs."""
    import zlib

    _, ckpt = sft_checkpoint(tiny_model_dir, arithmetic_dir / "train.jsonl", tmp_path)
    step = ckpt / "global_step2"
    marker = tmp_path / "ran"
    crafted_torch_file(step / "engine" / "model.pt", marker)
    manifest = json.loads((step / "manifest.json").read_text())
    data = (step / "engine" / "model.pt").read_bytes()
    manifest["files"]["engine/model.pt"] = [len(data), zlib.crc32(data)]
    (step / "manifest.json").write_text(json.dumps(manifest))
    proc = sft_run(tiny_model_dir, arithmetic_dir / "train.jsonl", tmp_path, "--ckpt.load_enable")
    needles = (f"checkpoint file {step / 'engine' / 'model.pt'} holds objects other than tensors",
               "Unsupported global: GLOBAL io.open", "nothing in it ran")
    one_error_line(proc, *needles)
    assert "Weights only load failed" not in proc.stderr
    one_error_line(to_hf(capfd, step, tiny_model_dir, tmp_path / "hf"), *needles)
    assert not marker.exists()


def test_the_checkpoint_folder_rule_follows_symlinks_and_dot_dot(tmp_path):
    """A symlink into a run folder is inside it; `ckpt/global_step1/../../other/out` is not."""
    from posttrain.models.deepspeed_export import check_output_folder
    from posttrain.utils.run_lock import LOCK_FILE

    run = tmp_path / "run"
    (run / "global_step1").mkdir(parents=True)
    (run / LOCK_FILE).write_text("")
    (tmp_path / "link").symlink_to(run / "global_step1")
    with pytest.raises(UserError, match=rf"--output_path {tmp_path / 'link' / 'hf'}: {run} is a posttrain "
                                        "checkpoint or run folder"):
        check_output_folder(tmp_path / "link" / "hf")
    assert not (run / "global_step1" / "hf").exists()
    out = run / "global_step1" / ".." / ".." / "other" / "out"
    assert check_output_folder(out) == tmp_path / "other" / "out"
