"""Worker launched by torchrun from tests/trainers/rl/test_rl_zero3.py: the PPO roles under ZeRO-3 on
2 ranks (gloo), each compared on rank 0 with the same role built whole in this process.

Usage: torchrun --nproc_per_node 2 zero3_roles_worker.py OUT.pt POLICY_DIR RM_DIR RM_VALUE_HEAD_DIR
(the last: RM_DIR with its head stored as `value_head.weight`)

Writes (rank 0) [rank 0's results, rank 1's], each {role: ...}, which the test compares with the
same roles built whole in its own process:
- "actor_lora": a LoRA actor built by `build_actor(..., zero_stage=3)`: the parameters the rank held
  once loaded, its log-probs of ROWS["actor"][rank], and (rank 0) its full weights, base and new
  adapters, gathered;
- "ref": `build_reference(..., zero_stage=3)` (FrozenShards): held parameters and log-probs, the ranks
  running different numbers of micro-batches;
- "reward": `RewardModelSource(..., zero_stage=3)`: held parameters and the scores of ROWS["reward"][rank]
  (batches of two; a rank with fewer batches, or none, runs discarded ones);
- "prm": a process reward model (the policy's nano LM, `ProcessRewardSource(..., zero_stage=3)`): its step
  rewards of PRM_ROWS[rank] (batches of two; a rank with fewer batches, or none, runs discarded ones);
- "reward_value_head": the same reward model with its head stored under `value_head` (--ds.value_head_prefix),
  copied into the sharded score head;
- "actor_chunks": a full actor's log-probs (`forward_logprobs`, 2 micro-batches with a backward each) and
  (rank 0) its full gradients, with a logits budget that sends rank 0's micro-batches down the chunked path
  and rank 1's down the whole-logits one ("chunked"), and with every micro-batch whole ("whole"); and how
  many forwards took the chunked path on the rank.
"""

import os
import sys

import torch

from posttrain.config import parse_config
from posttrain.engines.dist import shutdown
from posttrain.models import load_tokenizer
from posttrain.models.setup import ModelSetup
from posttrain.rewards.reward_model import RewardModelSource
from posttrain.trainers.rl import build
from posttrain.trainers.rl.batch_forward import Batching
from posttrain.trainers.rl.experience import Experience

SEQUENCES = [[5, 9, 11, 3], [7, 8], [12, 4, 6, 9, 10, 2], [3, 3, 3], [20, 21, 22], [6]]
LORA = ("--ds.lora.rank", "4", "--ds.lora.alpha", "8")
BATCHES = Batching(2, None, False, False)
# the rows each rank computes (rank 0, rank 1): different numbers of micro-batches, so a rank pads
ROWS = {"actor": (SEQUENCES[:4], SEQUENCES[4:5]), "ref": (SEQUENCES[:5], SEQUENCES[4:5]),
        "reward": ([SEQUENCES[:5], SEQUENCES[5:]], [[], SEQUENCES[:3]]),
        "chunks": ([SEQUENCES[:2], SEQUENCES[2:4]], [SEQUENCES[1:2], SEQUENCES[3:4]])}
# (prompt, response) texts a PRM scores (an empty response: no steps, no forward): rank 0 forwards two batches
# then one, rank 1 none then two
PRM_TEXTS = [("Q: 1+1?", "1 + 1\n= 2"), ("Q: 2+2?", "4"), ("Q", "a\nb\nc"), ("Q: 3?", ""), ("x", "so 3\n"),
             ("y", "7 @ 8")]
PRM_ROWS = ([PRM_TEXTS[:5], PRM_TEXTS[5:]], [[], PRM_TEXTS[:3]])
CHUNK_ROWS = 3  # rows of logits per chunk: rank 0's micro-batches have 6 and 10, rank 1's 1 and 2


def config(policy: str, rm: str, *extra: str):
    return parse_config("ppo", ["--actor.model_name_or_path", policy, "--reward.model_name_or_path", rm,
                                "--data.prompt_dataset", policy, "--ds.zero_stage", "3",
                                "--ds.param_dtype", "fp32", *extra], check=False)


def experience(rows: list[list[int]], pad_id: int) -> Experience:
    """Right-padded sequences whose last half is the response (enough for log-probs)."""
    width = max(len(r) for r in rows)
    seq = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        seq[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    action = mask[:, 1:].clone()
    action[:, : max(1, width // 2) - 1] = 0
    action = (action * mask[:, 1:]).float()
    zeros = torch.zeros(action.shape)
    return Experience(sequences=seq, attention_mask=mask, action_mask=action, rollout_logp=zeros,
                      rewards=torch.zeros(len(rows)))


def prm_ids(tok, rows) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, response ids) of (prompt, response) texts."""
    enc = [[tok(text, add_special_tokens=False)["input_ids"] for text in row] for row in rows]
    return [p for p, _ in enc], [r for _, r in enc]


def chunked_logprobs_and_grads(cfg, tok, rank: int, budget: int) -> dict:
    """One ZeRO-3 actor's log-probs of ROWS["chunks"][rank] and, after their backwards, its full gradients
    (collective gathers), with `LOGITS_CHUNK_BYTES` = `budget`."""
    from deepspeed.utils import safe_get_full_grad

    from posttrain.models import forward

    forward.LOGITS_CHUNK_BYTES = budget
    chunked, replace = [0], forward._head_returns_logprobs

    def counted(*args, **kwargs):
        chunked[0] += 1
        return replace(*args, **kwargs)

    forward._head_returns_logprobs = counted
    actor = build.build_actor(cfg, tok, torch.device("cpu"), 4, zero_stage=3)
    values = []
    for rows in ROWS["chunks"][rank]:
        exp = experience(rows, tok.pad_token_id)
        keep = torch.arange(exp.sequences.shape[1] - 1)
        index = torch.arange(exp.sequences.shape[0] * len(keep))
        logp = forward.forward_logprobs(actor.engine.model, {"input_ids": exp.sequences,
                                                             "attention_mask": exp.attention_mask},
                                        keep, index, exp.sequences[:, 1:].reshape(-1))
        actor.engine.backward((logp * torch.linspace(-1, 1, len(logp))).sum())
        values.append(logp.detach())
    grads = {n: safe_get_full_grad(p) for n, p in actor.engine.module.named_parameters()}
    forward._head_returns_logprobs = replace
    return {"logprobs": values, "grads": grads if rank == 0 else None, "chunked_forwards": chunked[0]}


def main():
    out, policy, rm, rm_value_head = sys.argv[1:5]
    rank = int(os.environ["RANK"])
    device = torch.device("cpu")
    tok = load_tokenizer(policy)
    results = {}

    # LoRA actor: peft adds unpartitioned adapters to the sharded base; DeepSpeed partitions them
    actor = build.build_actor(config(policy, rm, *LORA), tok, device, 4, zero_stage=3)
    from posttrain.models import tied_lora_layers

    results["actor_lora"] = {"held": actor.loaded_numel, "peft": actor.peft,
                             "tied": tied_lora_layers(actor.model),
                             "logprobs": actor.logprobs(experience(ROWS["actor"][rank], tok.pad_token_id),
                                                        BATCHES),
                             "weights": actor.engine.full_state_dict()}  # rank 0: every weight, adapters too
    del actor

    # reference model (FrozenShards): rank 0 runs three micro-batches, rank 1 one (padded in lockstep)
    ref = build.build_reference(config(policy, rm), tok, device, zero_stage=3)
    results["ref"] = {"held": ref.loaded_numel, "engine": type(ref.engine).__name__,
                      "logprobs": ref.logprobs(experience(ROWS["ref"][rank], tok.pad_token_id), BATCHES)}
    del ref

    # reward model: rank 0 scores three batches of two and rank 1 none, then one and three
    source = RewardModelSource(rm, batch_size=2, tokenizer=tok, ds=config(policy, rm).ds, zero_stage=3)
    results["reward"] = {"held": source.loaded_numel, "sharded": source.engine is not None,
                         "scores": [source.score_tokens(rows).rewards for rows in ROWS["reward"][rank]]}

    # a process reward model (the nano LM): rank 0 forwards two batches then one, rank 1 none then two
    from dataclasses import asdict

    from posttrain.models.prm_spec import PRMSpec
    from posttrain.rewards.process_reward_model import ProcessRewardSource

    prm = ProcessRewardSource(policy, PRMSpec("@"), tok, batch_size=2, ds=config(policy, rm).ds, zero_stage=3)
    results["prm"] = {"sharded": prm.engine is not None,
                      "steps": [asdict(prm.score_steps(*prm_ids(tok, rows))) for rows in PRM_ROWS[rank]]}
    del prm

    # a reward model whose head is stored as value_head.weight: copied into the sharded score head
    source = RewardModelSource(rm_value_head, setup=ModelSetup(value_head_prefix="value_head"), batch_size=2,
                               tokenizer=tok, ds=config(policy, rm).ds, zero_stage=3)
    results["reward_value_head"] = {"sharded": source.engine is not None,
                                    "scores": source.score_tokens(ROWS["reward"][rank][1]).rewards}

    # a full actor's log-probs and gradients with rank 0 chunked and rank 1 whole, and with both whole
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(policy).vocab_size
    results["actor_chunks"] = {mode: chunked_logprobs_and_grads(config(policy, rm), tok, rank, budget)
                               for mode, budget in (("chunked", CHUNK_ROWS * vocab * 4), ("whole", 2 ** 40))}

    gathered = [None, None]
    torch.distributed.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out)


if __name__ == "__main__":
    main()
    shutdown()  # no gloo thread left alive at exit (an exit-time abort otherwise)
