"""W&B logging (`--logger.wandb.key`) in a real SFT run, offline: wandb writes its run under WANDB_DIR,
and the run's record holds, step by step, the training loss that metrics.jsonl logged. Needs the
`wandb` extra (listed in the `dev` extra); skipped where it is not installed. Without wandb, the flag
is one error line."""
import json
import sys
from pathlib import Path

import pytest

from posttrain.utils.metrics import read_metrics


def wandb_records(path: Path):
    """The records of an offline run file (`run-<id>.wandb`): a 7-byte header (`:W&B`, magic,
    version), then a LevelDB-style log in 32 KiB blocks, each chunk a 7-byte header (crc32, length
    little-endian, type: 1 full, 2 first, 3 middle, 4 last) before its bytes."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, parts = 7, 32 * 1024, []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:
            break
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


@pytest.mark.slow
def test_offline_wandb_run_gets_the_training_metrics(run_sft, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wb").mkdir()
    out = run_sft("--logger.wandb.key", "True", "--logger.wandb.project", "posttrain_test",
                  "--logger.wandb.run_name", "sft-offline", "--data.max_samples", "16", name="wb")
    logged = {r["step"]: r["train/loss"] for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r}
    assert sorted(logged) == [1, 2]
    runs = sorted((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "wb").rglob("*"))
    record_file, = runs[0].glob("run-*.wandb")
    history, names = {}, []
    for record in wandb_records(record_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            names.append((record.run.project, record.run.display_name))
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            if "train/loss" in items:
                history[items["_step"]] = items["train/loss"]
    assert ("posttrain_test", "sft-offline") in names
    assert history.keys() == logged.keys()
    for step, loss in logged.items():
        assert history[step] == pytest.approx(loss, rel=1e-6)


def test_wandb_flag_without_wandb_installed_is_one_error_line(run_sft, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(SystemExit) as exit_info:
        run_sft("--logger.wandb.key", "True", "--data.max_samples", "8", name="no-wandb")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "posttrain sft: error: --logger.wandb.key needs wandb, which is not installed: "
        "pip install -e '.[wandb]'")
