"""`posttrain lora-merge` (merge_lora): a trained-looking adapter (B != 0) merged through the CLI
gives a plain HF folder whose logits equal the adapter model's — causal LM and reward model —
and bad inputs (missing folder, full model, wrong base, lost or random head) fail clearly."""
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
)

from posttrain.cli.lora_combiner import main as lora_merge
from posttrain.models import (
    apply_lora,
    build_tiny,
    forward_logits,
    forward_values,
    load_causal_lm,
    load_score_model,
    load_tokenizer,
    merge_lora,
    save_pretrained,
)

# two rows, the second right-padded (pad id 0 masked out)
IDS = torch.tensor([[5, 17, 230, 41, 9, 88], [7, 300, 12, 64, 0, 0]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
LORA = {"rank": 4, "alpha": 8, "target_modules": "all-linear"}


def perturb(model, seed=0):
    """Random A, B (peft starts with B = 0, a no-op) and a random copy of any saved head."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n or "modules_to_save" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def cli(adapter, out, *flags):
    return lora_merge(["--lora_path", str(adapter), "--output_path", str(out), *map(str, flags)])


@pytest.fixture(scope="module")
def score_model_dir(tiny_score_model_dir):
    return tiny_score_model_dir


@pytest.fixture(scope="module")
def lm_adapter(tiny_model_dir, tmp_path_factory):
    """(adapter folder, its model's logits on IDS) for a causal-LM adapter on all linear layers."""
    model = perturb(load_causal_lm(tiny_model_dir, "fp32", lora=LORA))
    with torch.no_grad():
        want = forward_logits(model, {"input_ids": IDS, "attention_mask": MASK})
    path = tmp_path_factory.mktemp("adapters") / "lm"
    save_pretrained(model, load_tokenizer(tiny_model_dir), path)
    return path, want


def test_causal_lm_merge_equals_adapter_model(tiny_model_dir, lm_adapter, tmp_path):
    adapter, want = lm_adapter
    cli(adapter, tmp_path / "merged", "--model_path", tiny_model_dir, "--ds.param_dtype", "fp32")
    files = set(os.listdir(tmp_path / "merged"))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    assert "adapter_config.json" not in files and "prm.json" not in files
    (adapter / "prm.json").write_text('{"placeholder_token": "@"}')  # a PRM's adapter: its description kept
    try:
        cli(adapter, tmp_path / "merged_prm", "--model_path", tiny_model_dir, "--ds.param_dtype", "fp32")
    finally:
        (adapter / "prm.json").unlink()
    assert (tmp_path / "merged_prm" / "prm.json").read_text() == '{"placeholder_token": "@"}'
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")  # plain transformers, no peft
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not hasattr(merged, "peft_config")
    with torch.no_grad():
        got = merged(input_ids=IDS, attention_mask=MASK).logits
        base_logits = base(input_ids=IDS, attention_mask=MASK).logits
    keep = MASK.bool()
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=0)
    assert (base_logits[keep] - want[keep]).abs().max() > 1e-2  # the adapter really changed the model


def test_base_defaults_to_adapter_record_and_bf16_default(lm_adapter, tmp_path):
    adapter, want = lm_adapter
    cli(adapter, tmp_path / "merged")  # no --model_path, default --ds.param_dtype bf16
    with safe_open(tmp_path / "merged" / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        got = merged(input_ids=IDS[:1]).logits
    assert (got - want[:1]).abs().max() < 0.1  # bf16 rounding only


@pytest.mark.parametrize("base", ["score", "lm"])
def test_reward_model_merge_equals_adapter_model(base, score_model_dir, tiny_model_dir, tmp_path):
    """RM LoRA from a score checkpoint, or from a causal LM (fresh head, saved in the adapter)."""
    base_dir = score_model_dir if base == "score" else tiny_model_dir
    torch.manual_seed(0)
    model = perturb(load_score_model(base_dir, "fp32", lora=LORA, new_head_ok=True), seed=1)
    batch = {"input_ids": IDS, "attention_mask": MASK}
    with torch.no_grad():
        want_values = forward_values(model, batch)
        want_pooled = model(input_ids=IDS, attention_mask=MASK).logits
    save_pretrained(model, load_tokenizer(base_dir), tmp_path / "adapter")
    flags = ["--is_rm"] if base == "score" else []  # without the flag: detected from task SEQ_CLS
    cli(tmp_path / "adapter", tmp_path / "merged", "--model_path", base_dir, "--ds.param_dtype", "fp32",
        *flags)
    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged")
    assert merged.config.num_labels == 1
    with torch.no_grad():
        got_pooled = merged(input_ids=IDS, attention_mask=MASK).logits
        got_values = forward_values(merged, batch)
    torch.testing.assert_close(got_pooled, want_pooled, atol=1e-5, rtol=0)
    keep = MASK.bool()
    torch.testing.assert_close(got_values[keep], want_values[keep], atol=1e-5, rtol=0)
    head = load_file(tmp_path / "merged" / "model.safetensors")["score.weight"]
    trained = [p for n, p in model.named_parameters()
               if "score.modules_to_save" in n and n.endswith("weight")]
    torch.testing.assert_close(head, trained[0].detach(), atol=0, rtol=0)


def test_rm_head_from_base_with_value_head_prefix(score_model_dir, tmp_path):
    """An adapter without a head (no peft task type, so no saved head) takes the base's head,
    stored under another name and found with --ds.value_head_prefix, and saves it under that name."""
    renamed = tmp_path / "base"
    renamed.mkdir()
    for f in os.listdir(score_model_dir):
        if f != "model.safetensors":
            (renamed / f).write_bytes(open(os.path.join(score_model_dir, f), "rb").read())
    tensors = load_file(os.path.join(score_model_dir, "model.safetensors"))
    tensors["value_head.weight"] = tensors.pop("score.weight")
    save_file(tensors, renamed / "model.safetensors", metadata={"format": "pt"})
    base = load_score_model(renamed, "fp32", value_head_prefix="value_head")
    model = perturb(apply_lora(base, {"rank": 2, "target_modules": ["q_proj", "v_proj"]}, task_type=None))
    with torch.no_grad():
        want = forward_values(model, {"input_ids": IDS, "attention_mask": MASK})
    save_pretrained(model, None, tmp_path / "adapter")
    with pytest.raises(SystemExit) as exc:  # default prefix "score": no head anywhere
        cli(tmp_path / "adapter", tmp_path / "m0", "--model_path", renamed, "--is_rm")
    assert exc.value.code == 2
    cli(tmp_path / "adapter", tmp_path / "merged", "--model_path", renamed, "--is_rm",
        "--ds.value_head_prefix", "value_head", "--ds.param_dtype", "fp32")
    saved = load_file(tmp_path / "merged" / "model.safetensors")
    assert "value_head.weight" in saved and "score.weight" not in saved  # saved under the prefix, too
    torch.testing.assert_close(saved["value_head.weight"], tensors["value_head.weight"], atol=0, rtol=0)
    merged = load_score_model(tmp_path / "merged", "fp32", value_head_prefix="value_head")
    with torch.no_grad():
        got = forward_values(merged, {"input_ids": IDS, "attention_mask": MASK})
    torch.testing.assert_close(got[MASK.bool()], want[MASK.bool()], atol=1e-5, rtol=0)


def test_reward_stats_in_adapter_folder_are_kept(score_model_dir, tmp_path):
    model = perturb(load_score_model(score_model_dir, "fp32", lora={"rank": 2, "target_modules": ["q_proj"]}))
    save_pretrained(model, None, tmp_path / "adapter")
    stats = {"mean": 0.25, "std": 2.0, "normalize_reward": True}
    (tmp_path / "adapter" / "config.json").write_text(json.dumps(stats))
    merged = merge_lora(tmp_path / "adapter", tmp_path / "merged", base_path=score_model_dir)
    cfg = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert (cfg["mean"], cfg["std"], cfg["normalize_reward"]) == (0.25, 2.0, True)
    assert merged.config.mean == 0.25
    with pytest.raises(ValueError, match="reward-model adapter.*--is_rm"):
        merge_lora(tmp_path / "adapter", tmp_path / "m2", base_path=score_model_dir, is_rm=False)


def test_bad_inputs_fail_clearly(tiny_model_dir, lm_adapter, tmp_path, capsys):
    adapter, _ = lm_adapter

    def error(*flags):
        with pytest.raises(SystemExit) as exc:
            lora_merge([*map(str, flags)])
        assert exc.value.code == 2
        return capsys.readouterr().err

    out = tmp_path / "out"
    err = error("--lora_path", tmp_path / "nope", "--output_path", out)
    assert "posttrain lora-merge: error: lora_path" in err and "nope" in err and "no such folder" in err
    err = error("--lora_path", tiny_model_dir, "--output_path", out)
    assert "not a LoRA adapter folder" in err and "full model" in err
    (tmp_path / "empty").mkdir()
    assert "no adapter_config.json" in error("--lora_path", tmp_path / "empty", "--output_path", out)
    err = error("--lora_path", adapter, "--output_path", out, "--model_path", tmp_path / "missing-base")
    assert "missing-base" in err and "not found" in err
    # same widths, fewer layers: peft alone would silently skip layers 2-3's adapters
    cfg = LlamaConfig.from_pretrained(tiny_model_dir)
    cfg.num_hidden_layers = 2
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "two-layer")
    err = error("--lora_path", adapter, "--output_path", out, "--model_path", tmp_path / "two-layer")
    assert "does not fit the base model" in err and "layers.2" in err and "--model_path" in err
    # other widths: shape mismatch
    build_tiny(tmp_path / "wider", arch="llama", size="tiny", verbose=False)
    err = error("--lora_path", adapter, "--output_path", out, "--model_path", tmp_path / "wider")
    assert "does not fit the base model" in err and "size mismatch" in err
    # a causal-LM adapter on a causal-LM base cannot become a reward model
    err = error("--lora_path", adapter, "--output_path", out, "--model_path", tiny_model_dir, "--is_rm")
    assert "random head" in err
    assert "is the lora_path" in error("--lora_path", adapter, "--output_path", adapter)
    assert not out.exists()
    assert "Traceback" not in capsys.readouterr().err
