"""Mixture-of-experts models in `posttrain dpo` and `posttrain rm` (one process): the router loss joins the
loss (`--model.aux_loss_coef`, logged as train/aux_loss) and moves the weights; a dense model with the flag,
or --ds.experts_implementation on a dense model, stops in one line with exit code 2. (SFT on 1 vs 2 ranks
under ZeRO-3: tests/trainers/test_sft_distributed.py; GRPO on Ray: tests/trainers/rl/test_rl_ray.py.)"""
import pytest
from safetensors.torch import load_file

from posttrain.data.synthetic import make_preference_rows, write_jsonl
from posttrain.utils.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pairs_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe_pairs")
    write_jsonl(make_preference_rows(16, seed=2), path / "train.jsonl")
    return path


def flags(model, data, out, *extra):
    return ["--model.model_name_or_path", str(model), "--data.dataset", str(data),
            "--data.prompt_key", "prompt", "--data.apply_chat_template", "--data.max_len", "48",
            "--train.batch_size", "8", "--train.micro_batch_size", "4", "--ckpt.output_dir", str(out),
            "--logger.logging_steps", "1", "--adam.lr", "1e-3", *map(str, extra)]


def _max_diff(a, b) -> float:
    wa, wb = (load_file(str(d / "model.safetensors")) for d in (a, b))
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


@pytest.mark.parametrize("trainer", ["dpo", "rm"])
def test_router_loss_joins_the_loss(trainer, tiny_moe_dir, pairs_dir, tmp_path):
    from posttrain.cli.main import main
    from posttrain.models import build_tiny

    model = tiny_moe_dir
    if trainer == "rm":  # a score model of the same shape
        model = tmp_path / "moe_rm"
        build_tiny(model, arch="qwen3_moe", size="nano", head="score", seed=1, verbose=False)
    with_aux, without = tmp_path / "aux", tmp_path / "plain"
    main([trainer, *flags(model, pairs_dir, with_aux, "--model.aux_loss_coef", "0.5",
                          "--ds.experts_implementation", "eager")])
    main([trainer, *flags(model, pairs_dir, without)])
    rows = [r for r in read_metrics(with_aux / "metrics.jsonl") if "train/loss" in r]
    assert len(rows) == 2 and all(1.0 <= r["train/aux_loss"] <= 4.0 for r in rows)
    assert "train/aux_loss" not in [r for r in read_metrics(without / "metrics.jsonl")
                                    if "train/loss" in r][0]
    assert _max_diff(with_aux, without) > 1e-4


def test_moe_flags_on_a_dense_model_stop_in_one_line(tiny_model_dir, pairs_dir, tmp_path, capsys):
    from posttrain.cli.main import main

    for extra, message in ((("--model.aux_loss_coef", "0.01"), "--model.aux_loss_coef 0.01: LlamaForCausalLM "
                                                               "is "
                            "not a mixture of experts"),
                           (("--ds.experts_implementation", "eager"),
                            "--ds.experts_implementation eager: model")):
        with pytest.raises(SystemExit) as exit_info:
            main(["dpo", *flags(tiny_model_dir, pairs_dir, tmp_path / "x", *extra)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
