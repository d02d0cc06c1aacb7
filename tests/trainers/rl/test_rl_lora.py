"""LoRA in `posttrain ppo`: the adapters train the actor (and the critic, whose value head trains
fully), the base weights never change, the reference is the base with the adapter disabled, and
checkpoints hold the trainable tensors only and resume to the uninterrupted run."""
import json

import pytest
import torch
from rl_helpers import rewards_by_step
from rl_runs import ppo_flags

from posttrain.utils.metrics import read_metrics

pytestmark = pytest.mark.slow

LORA = ["--ds.lora.rank", "8", "--ds.lora.alpha", "16", "--actor.adam.lr", "5e-3"]
# the nano model's reward moves within 8 steps only with an adapter on its output head too (in one process the
# engine samples from the peft module itself: no sync; merged sync refuses a tied head)
WITH_HEAD = ["--ds.lora.target_modules", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
             "down_proj", "lm_head"]


def _trainer(rl_setup, out, *extra):

    from posttrain.config import parse_config
    from posttrain.trainers.rl.ppo import RLTrainer

    return RLTrainer(parse_config("ppo", [str(f) for f in ppo_flags(rl_setup, out, *LORA, *extra)],
                                  device="cpu"))


def _base(model) -> dict[str, torch.Tensor]:
    """The frozen tensors of a peft model under the base model's names."""
    from posttrain.models.lora import base_name

    return {base_name(n): p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


@pytest.mark.parametrize("estimator,extra", [
    ("group_norm", WITH_HEAD),
    # all-linear (a critic has no lm_head)
    ("gae", ["--critic.adam.lr", "3e-3", "--critic.lr_warmup_ratio", "0"]),
])
def test_lora_raises_the_reward_and_leaves_the_base_bit_identical(rl_setup, tmp_path, estimator, extra):
    from posttrain.models import load_causal_lm, load_score_model

    out = tmp_path / estimator
    trainer = _trainer(rl_setup, out, "--algo.advantage.estimator", estimator, "--train.num_episodes", "1",
                       *extra)
    trainer.fit()
    r = rewards_by_step(out)
    assert len(r) == 8
    assert sum(r[-2:]) / 2 > sum(r[:2]) / 2 + (0.15 if extra == WITH_HEAD else 0.05), (estimator, r)
    rows = read_metrics(out / "metrics.jsonl")
    assert all(row["rollout/logprob_abs_gap"] < 1e-4 for row in rows)  # the shared peft module samples
    fresh = load_causal_lm(rl_setup[0]).state_dict()
    base = _base(trainer.actor.model)
    assert base and all(torch.equal(t, fresh[n]) for n, t in base.items())
    assert (out / "adapter_config.json").exists() and not (out / "model.safetensors").exists()
    if estimator == "gae":
        critic = trainer.critic.model
        trainable = [n for n, p in critic.named_parameters() if p.requires_grad]
        assert any("score" in n for n in trainable) and any("lora_" in n for n in trainable)
        fresh = load_score_model(rl_setup[0], new_head_ok=True).state_dict()
        frozen = {n: t for n, t in _base(critic).items() if n in fresh and "score" not in n}
        assert frozen and all(torch.equal(t, fresh[n]) for n, t in frozen.items())
        assert "critic/value_loss" in rows[0]


def test_reference_is_the_base_with_the_adapter_disabled(rl_setup, tmp_path, one_torch_thread):
    """The adapter-off log-probs equal a separately loaded base model's (1e-6) and differ from the
    actor's once the adapter is non-zero; one copy of the weights, named at start-up."""
    from posttrain.models import load_causal_lm
    from posttrain.trainers.rl.roles import AdapterOffReference, Reference

    trainer = _trainer(rl_setup, tmp_path / "ref", "--algo.kl.init_coef", "0.05", "--train.max_steps", "1")
    assert isinstance(trainer.ref, AdapterOffReference)
    # the engine samples from the actor's peft module itself; the fast decode path folds the adapter in
    assert trainer.shares_actor_module and trainer.rollout_engine._fast is not None
    with torch.no_grad():
        for n, p in trainer.actor.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    scored, _, _ = trainer.produce(0)
    assert trainer.rollout_engine._fast._weight_cache == {}  # fused copies freed: the module trains next
    exp, _ = trainer.experience_maker.make(scored, 0.0)
    batches = trainer.experience_maker.batching
    separate = Reference(load_causal_lm(rl_setup[0]), 1.0, trainer.device).logprobs(exp, batches)
    adapter_off = trainer.ref.logprobs(exp, batches)
    torch.testing.assert_close(adapter_off, separate, rtol=0, atol=1e-6)
    assert (trainer.actor.logprobs(exp, batches) - adapter_off).abs().max() > 1e-3
    trainer.start.folders.close()


def test_kl_starts_at_zero_and_another_reference_loads_its_own(run_ppo, rl_setup, tmp_path, capsys):

    from posttrain.config import parse_config
    from posttrain.trainers.rl import build

    out, _ = run_ppo(*LORA, "--algo.kl.init_coef", "0.05", "--train.max_steps", "2", name="kl")
    assert read_metrics(out / "metrics.jsonl")[0]["kl/mean"] == pytest.approx(0.0, abs=1e-6)  # B starts at 0
    assert ("reference model: the actor's base weights with its LoRA adapter disabled"
            in capsys.readouterr().err)

    def cfg(*extra):
        flags = ppo_flags(rl_setup, tmp_path / "cfg", *LORA, "--algo.kl.init_coef", "0.05", *extra)
        return parse_config("ppo", [str(f) for f in flags], device="cpu")

    assert not build.needs_reference(cfg("--ref.model_name_or_path", f"{rl_setup[0]}/."))  # the same folder
    assert build.needs_reference(cfg("--ref.model_name_or_path", str(tmp_path)))  # another one: its own copy
    assert build.needs_reference(cfg("--ds.lora.rank", "0"))


def test_resume_from_a_lora_checkpoint_equals_the_uninterrupted_run(run_ppo, tmp_path):
    """gae (critic LoRA) + EMA + KL: 4 steps straight vs resumed from the step-2 checkpoint; the
    checkpoint holds the trainable tensors only (adapters, the critic's value head, their EMA)."""
    import shutil

    from safetensors.torch import load_file

    flags = [*LORA, "--algo.advantage.estimator", "gae", "--critic.adam.lr", "3e-3",
             "--critic.lr_warmup_ratio", "0", "--algo.kl.init_coef", "0.01", "--train.enable_ema",
             "--train.max_steps", "4", "--ckpt.save_steps", "2", "--ckpt.max_num", "4"]
    full, _ = run_ppo(*flags, "--ckpt.path", tmp_path / "ck_full", name="full")
    step2 = tmp_path / "ck_full" / "global_step2"
    weights = torch.load(step2 / "actor" / "model.pt", weights_only=True)
    assert weights and all("lora_" in k for k in weights)
    meta = json.loads((step2 / "actor" / "engine_state.json").read_text())
    assert meta["weights"] == "trainable" and meta["frozen_hash"]
    critic = torch.load(step2 / "critic" / "model.pt", weights_only=True)
    assert any("score" in k for k in critic) and all("lora_" in k or "score" in k for k in critic)
    assert set(torch.load(step2 / "actor" / "ema.pt", weights_only=True)) == set(weights)
    ck = tmp_path / "ck_resume"
    ck.mkdir()
    shutil.copytree(step2, ck / "global_step2")
    resumed, _ = run_ppo(*flags, "--ckpt.path", ck, "--ckpt.load_enable", name="resumed")
    assert rewards_by_step(resumed, start=3) == pytest.approx(rewards_by_step(full)[2:], abs=1e-6)
    a, b = load_file(full / "adapter_model.safetensors"), load_file(resumed / "adapter_model.safetensors")
    assert set(a) == set(b) and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=0)


def test_save_hf_writes_the_adapter_and_the_merged_model(run_ppo, rl_setup):
    from posttrain.cli import lora_combiner
    from posttrain.models import forward_logits, load_causal_lm

    out, _ = run_ppo(*LORA, "--train.max_steps", "1", "--ckpt.save_steps", "1", "--ckpt.save_hf",
                     "--ckpt.save_merged", name="hf")
    export = out / "checkpoints" / "global_step1_hf"
    assert (export / "adapter_config.json").exists()
    assert (out / "merged" / "model.safetensors").exists()
    from peft import PeftModel

    peft = PeftModel.from_pretrained(load_causal_lm(rl_setup[0]), str(out))
    ids = {"input_ids": torch.tensor([[5, 17, 30, 41, 9]]),
           "attention_mask": torch.ones(1, 5, dtype=torch.long)}
    merged = load_causal_lm(out / "merged")
    torch.testing.assert_close(forward_logits(merged, ids), forward_logits(peft, ids), rtol=0, atol=1e-5)
    lora_combiner.main(["--model_path", str(rl_setup[0]), "--lora_path", str(out), "--output_path",
                        str(out / "combined"), "--ds.param_dtype", "fp32"])
    combined = load_causal_lm(out / "combined")
    torch.testing.assert_close(forward_logits(combined, ids), forward_logits(merged, ids), rtol=0, atol=1e-6)


def _sync_sizes(model) -> tuple[int, int]:
    """(adapter bytes, base + adapter bytes) of a peft model."""
    from posttrain.models import lora_sync as ls

    adapter = ls.adapter_bytes(model)
    return adapter, adapter + ls.pair_bytes(ls.base_pairs(model))


@pytest.mark.parametrize("mode", ["merged", "adapter"])
def test_async_engine_takes_the_adapter_only(rl_setup, tmp_path, mode):
    """Async in one process (queue 0: no staleness): the engine's own copy takes base + adapter once
    (hash-checked at start-up), then the adapter alone after every step (`sync/bytes`), and samples what
    the trainer recomputes."""
    out = tmp_path / mode
    trainer = _trainer(rl_setup, out, "--train.async_enable", "--train.async_queue_size", "0",
                       "--train.max_steps", "3", "--vllm.lora_sync", mode)
    assert trainer.rollout_engine.lora_sync == mode and not trainer.shares_actor_module
    trainer.fit()
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "rollout/logprob_abs_gap" in r]
    assert len(rows) == 3 and all(r["rollout/logprob_abs_gap"] < 1e-4 for r in rows)
    adapter, full = _sync_sizes(trainer.actor.model)
    assert [r["sync/bytes"] for r in rows] == [adapter] * 3 and adapter < full / 10
    assert trainer.rollout_engine.weights_hash() == trainer.actor.weights_hash()


@pytest.mark.parametrize("mode", ["merged", "adapter"])
def test_start_up_hash_covers_base_and_adapter(rl_setup, tmp_path, one_torch_thread, mode):
    """The verified first sync sends base + adapter (their bytes), and the check fails on an engine whose
    adapter (or base) differs from the actor's by one element."""
    from posttrain.models import lora_sync as ls

    trainer = _trainer(rl_setup, tmp_path / mode, "--train.async_enable", "--vllm.lora_sync", mode)
    actor, engine = trainer.actor, trainer.rollout_engine
    with torch.no_grad():
        for n, p in actor.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    assert trainer._sync_engines(verify=True) == _sync_sizes(actor.model)[1]
    assert engine.weights_hash() == actor.weights_hash() == ls.model_lora_hash(actor.model)
    assert sorted(n for n, _ in actor.sync_pairs("adapter")) == [n for n, _ in ls.adapter_pairs(actor.model)]
    actor.broadcast_weights = lambda *args, **kwargs: 0  # the check alone, on what the engine holds now
    name = "model.layers.0.self_attn.q_proj.lora_B.weight"
    held = engine.weights.merged.adapter if mode == "merged" else ls.adapter_params(engine.model)
    with torch.no_grad():
        held[name][0, 0] += 1e-3
    with pytest.raises(RuntimeError, match="weight sync failed"):
        trainer._sync_engines(verify=True)
    with torch.no_grad():
        held[name][0, 0] -= 1e-3
        trainer._sync_engines(verify=True)
        # the base (a merged mode W0 is kept apart: corrupt that)
        engine.weights._own_state()["model.layers.0.mlp.up_proj.weight"][0, 0] += 1.0
        if mode == "merged":
            engine.weights.merged.base["model.layers.0.mlp.up_proj.weight"][0, 0] += 1.0
    with pytest.raises(RuntimeError, match="weight sync failed"):
        trainer._sync_engines(verify=True)


def test_a_tied_head_adapter_syncs_in_adapter_mode_only(rl_setup, tmp_path, one_torch_thread):
    """An adapter on the output head tied to the embeddings: a merging engine would change the embeddings
    too, so merged sync refuses it in one line; adapter mode syncs it (hash-checked)."""
    flags = ("--train.async_enable", "--algo.advantage.estimator", "group_norm", *WITH_HEAD)  # no critic
    trainer = _trainer(rl_setup, tmp_path / "adapter", *flags, "--vllm.lora_sync", "adapter")
    trainer._sync_engines(verify=True)
    trainer = _trainer(rl_setup, tmp_path / "merged", *flags)
    with pytest.raises(ValueError, match="tied to the input embeddings.*--vllm.lora_sync adapter"):
        trainer._sync_engines(verify=True)


def test_lora_trains_on_multi_turn_agent_episodes(rl_setup, tmp_path):
    """An OpenRLHF agent file with a LoRA actor and critic (gae) and the adapter-off reference (KL); the
    critic's adapter (with its value head) merges with `posttrain lora-merge` into a score model."""
    from peft import PeftModel
    from test_rl_agents import OPENRLHF_STYLE_AGENT, agent_flags

    from posttrain.cli import lora_combiner, train_ppo_ray
    from posttrain.models import forward_values, load_score_model

    agent = tmp_path / "agent_func.py"
    agent.write_text(OPENRLHF_STYLE_AGENT)
    out = tmp_path / "agent"
    train_ppo_ray.main(agent_flags(rl_setup, out, agent, *LORA, "--algo.advantage.estimator", "gae",
                                   "--algo.kl.init_coef", "0.01", "--data.max_samples", "4",
                                   "--critic.save_value_network"))
    (row,) = [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    assert row["agent/turns_mean"] >= 1.0 and row["actor/policy_loss"] == row["actor/policy_loss"]
    assert "critic/value_loss" in row and row["kl/mean"] == pytest.approx(0.0, abs=1e-6)
    assert (out / "adapter_config.json").exists() and (out / "critic" / "adapter_config.json").exists()
    lora_combiner.main(["--model_path", str(rl_setup[0]), "--lora_path", str(out / "critic"), "--output_path",
                        str(tmp_path / "critic_merged"), "--ds.param_dtype", "fp32"])
    ids = {"input_ids": torch.tensor([[5, 17, 30, 41, 9]]),
           "attention_mask": torch.ones(1, 5, dtype=torch.long)}
    merged = forward_values(load_score_model(tmp_path / "critic_merged"), ids)
    peft = PeftModel.from_pretrained(load_score_model(rl_setup[0], new_head_ok=True), str(out / "critic"))
    torch.testing.assert_close(merged, forward_values(peft, ids), rtol=0, atol=1e-5)
