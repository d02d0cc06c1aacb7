"""Reward-model training on preference pairs (Bradley-Terry).

A score model (a causal LM with a scalar head, `load_score_model`) reads each sequence (prompt +
response + EOS) and its reward is the head's value at the sequence's LAST real token: index
`attention_mask.sum - 1` per row of a right-padded batch (`last_token_index` also handles left
padding), `cumsum(seq_lens) - 1` in a packed row. Per pair, with r_c / r_r the rewards of the
chosen / rejected side and m the row's `margin` (`--model.margin_loss_enable`, else 0):

    sigmoid (default):  ℓ = -log σ(r_c - r_r - m)
    logexp:             ℓ = log(1 + exp(r_r - r_c))

The step loss is Σ_pairs ℓ / P with P the pairs of the whole optimizer step (all micro-batches, all
ranks), so micro-batching does not change it. Rewards leave `forward_values` in float32, so the loss
is always computed in fp32 (`--model.compute_fp32_loss_enable` is accepted and changes nothing).

Logged (means over pairs): `loss`, `acc` (share of pairs with r_c > r_r), `chosen_reward`,
`rejected_reward`, `margin` (r_c - r_r); over all 2P rewards: `reward_mean`, `reward_std`.
After training, the mean / std of the rewards on the eval set (the training set without one) are
stored as `mean` / `std` in the saved config.json, which `--reward.normalize_enable` reads.
With `--ds.value_head_prefix X` (X != score) the exported head is stored as `X.weight` (OpenRLHF's
naming); `load_score_model(path, value_head_prefix=X)` loads it back.

Reward models read text only: the `--data` image flags are refused
(`config.validate`), as a score model (AutoModelForSequenceClassification) has no vision-language form for
most families (Qwen-VL among them), and the reward-model scorers of `ppo` and `serve-rm` score text.
"""
from __future__ import annotations

import math

import torch

from posttrain.algorithms.preference import reward_model_loss
from posttrain.config import RMConfig
from posttrain.data.validation import MARGIN_KEY
from posttrain.models import last_token_values, unwrap_model
from posttrain.models.loading import check_model_path, read_head
from posttrain.trainers.pairs import PairObjective, preference_items
from posttrain.trainers.session import ExportHooks, SingleModelRun
from posttrain.utils.log import info


class RMObjective(PairObjective):
    """The step loop's `Objective` for reward models (pairs as units, see `PairObjective`)."""

    def __init__(self, pad_id: int, packing: bool, loss_type: str = "sigmoid",
                 use_margin: bool = False) -> None:
        super().__init__(pad_id, packing)
        self.loss_type, self.use_margin = loss_type, use_margin

    # float32 rewards [N], one per sequence: its value at its last real token (padded, packed or a slice)
    rewards = staticmethod(last_token_values)

    def loss(self, model, batch: dict, num_units: float):
        r = self.rewards(model, batch)
        b = r.shape[0] // 2
        chosen, rejected = r[:b], r[b:]
        margin = batch["margin"].to(r.device) if self.use_margin else None
        per_pair_mean = reward_model_loss(chosen, rejected, margin=margin, loss_type=self.loss_type)
        loss = per_pair_mean * b / num_units
        with torch.no_grad():
            n = float(b)
            stats = {"loss_sum": float(per_pair_mean.detach()) * n,
                     "acc_sum": float((chosen > rejected).sum()), "chosen_reward_sum": float(chosen.sum()),
                     "rejected_reward_sum": float(rejected.sum()),
                     "margin_sum": float((chosen - rejected).sum())}
            stats.update({k.replace("_sum", "_count"): n for k in list(stats)})
            rd = r.double()
            stats.update({"reward_sum": float(rd.sum()), "reward_sqsum": float((rd * rd).sum()),
                          "reward_count": float(r.shape[0])})
        return loss, stats


def rename_head(state: dict, prefix: str) -> dict:
    """`score.weight` / `score.bias` → `{prefix}.weight` / `.bias` (other tensors unchanged)."""
    return {(f"{prefix}.{k[len('score.'):]}" if k in ("score.weight", "score.bias") else k): v
            for k, v in state.items()}


def load_prefix(path, prefix: str) -> str:
    """The head prefix to load `path` with: `prefix` when the checkpoint stores `{prefix}.weight`
    (a reward model saved under that name), else "score" (an HF score model, or a causal LM that
    gets a fresh head): training a new RM with `--ds.value_head_prefix value_head` starts from an
    SFT model that has no such tensor."""
    if prefix == "score":
        return prefix
    try:
        return prefix if read_head(check_model_path(path), prefix) else "score"
    except FileNotFoundError:
        return "score"


def _model_config(model):
    base = unwrap_model(model)
    if hasattr(base, "peft_config"):
        base = base.get_base_model()
    return base.config


def train_rm(cfg: RMConfig) -> dict:
    """Train a reward model as configured (the flags validated: `config.validate`); returns the final eval
    metrics (empty without an eval set)."""
    use_margin = cfg.model.margin_loss_enable
    prefix = cfg.ds.value_head_prefix

    def head_prefix() -> str:
        return load_prefix(cfg.model.model_name_or_path, prefix)

    with SingleModelRun(cfg, head_prefix=head_prefix) as run:  # a failure before training leaves no run files
        tok = run.tokenizer
        margin_key = MARGIN_KEY if use_margin else None
        train_items = preference_items(run.train_rows, tok, cfg, "train set", margin_key)
        eval_items = preference_items(run.eval_rows, tok, cfg, "eval set", margin_key) \
            if run.eval_rows else None
        objective = RMObjective(tok.pad_token_id, cfg.ds.packing_samples, cfg.model.loss_type, use_margin)
        lora = run.setup.lora is not None
        export = ExportHooks()
        if prefix != "score":
            if lora:
                info(f"--ds.value_head_prefix {prefix}: a LoRA adapter keeps peft's names for the head; "
                     "merge it with posttrain lora-merge to get a plain score model")
            else:
                export = ExportHooks(state=lambda state: rename_head(state, prefix))

        def store_reward_stats(loop, final: dict) -> None:
            if "eval/reward_mean" in final:
                mean, std = final["eval/reward_mean"], final["eval/reward_std"]
                source = f"{len(eval_items)} eval pairs"
            else:
                stats = loop.evaluate(train_items, prefix="train_set")
                mean, std, source = stats["train_set/reward_mean"], stats["train_set/reward_std"], \
                    f"{len(train_items)} training pairs"
            std = max(std, 1e-8) if math.isfinite(std) else 1.0
            config = _model_config(loop.engine.module)
            config.mean, config.std = float(mean), float(std)
            info(f"reward statistics over {source}: mean {mean:.4g}, std {std:.4g} (stored in config.json as "
                 "mean/std for --reward.normalize_enable)")
            if lora and loop.engine.is_main:  # an adapter folder has no config.json of its own
                run.output_dir.mkdir(parents=True, exist_ok=True)
                config.to_json_file(str(run.output_dir / "config.json"))

        return run.fit(objective, train_items, eval_items, on_trained=store_reward_stats, export=export)
