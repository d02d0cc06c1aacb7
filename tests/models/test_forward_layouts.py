"""The one forward of `models.forward` over every layout a trainer hands over: a padded batch, a packed row
and the context-parallel slices of that row (`ContextGroups.shard` / `.split`) give the same aligned labels,
per-sample log-prob sums and last-token rewards, checked against each sample run alone. The two-slice split
runs in one process: each rank's slice of the packed row's logits, summed over the two (a one-rank group
makes `group_sum` the identity); a slice's own forward runs over a one-rank group with the context-parallel
attention (the multi-process runs are in test_context_parallel.py and the trainers' ring tests)."""
import pytest
import torch
import torch.distributed as dist

from posttrain.algorithms.losses import token_logprobs
from posttrain.data import pack_collate, pad_collate
from posttrain.models import (
    forward_logits,
    forward_values,
    last_token_values,
    load_causal_lm,
    load_score_model,
    next_token_logits,
    sequence_logprobs,
)
from posttrain.models.context_parallel import register, slice_context, slice_row, traffic
from posttrain.models.forward import align_next_tokens
from posttrain.models.parallel_groups import ContextGroups

LENGTHS = (5, 8, 4)  # two prompt tokens each, then the response (its loss mask 1)


def items(vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": torch.randint(3, vocab, (n,), generator=g).tolist(),
             "loss_mask": [0, 0] + [1] * (n - 2)} for n in LENGTHS]


def by_hand(model, rows: list[dict]) -> torch.Tensor:
    """Per sample: Σ log p(x_t | x_<t) over its loss-masked tokens, each sample run alone."""
    out = []
    for row in rows:
        ids = torch.tensor(row["input_ids"])[None]
        logp = torch.log_softmax(forward_logits(model, {"input_ids": ids})[0, :-1], -1)
        picked = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)
        out.append((picked * torch.tensor(row["loss_mask"][1:], dtype=torch.float32)).sum())
    return torch.stack(out)


@pytest.fixture
def one_rank_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def groups(size: int, rank: int, group) -> ContextGroups:
    return ContextGroups(size=size, rank=rank, group=group, dp_rank=0, dp_size=1, head_stride=1)


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return load_causal_lm(tiny_model_dir, "fp32").eval()


@torch.no_grad()
def test_sums_and_aligned_tokens_agree_padded_packed_and_two_slices(lm, one_rank_group):
    rows = items(lm.config.vocab_size)
    want, counts = by_hand(lm, rows), torch.tensor([n - 2 for n in LENGTHS], dtype=torch.float32)
    padded, packed = pad_collate(rows, 0), pack_collate(rows)
    for batch in (padded, packed):
        sums, n = sequence_logprobs(forward_logits(lm, batch), batch)
        torch.testing.assert_close(sums, want, atol=1e-5, rtol=0)
        assert torch.equal(n, counts)
        logits, labels, mask = next_token_logits(lm, batch)  # SFT's tokens: the same targets in every layout
        assert float(mask.sum()) == sum(counts.tolist())
        tokens = (token_logprobs(logits, labels) * mask).sum()
        torch.testing.assert_close(tokens, want.sum(), atol=1e-5, rtol=0)
    whole = forward_logits(lm, packed)  # [1, T, V]; each rank holds its slice of it
    total, total_n, tokens = torch.zeros(3), torch.zeros(3), torch.zeros(())
    for rank in range(2):
        part = groups(2, rank, one_rank_group).shard(packed)
        local = slice_row(whole, rank, 2, 0.0)
        sums, n = sequence_logprobs(local, part)
        total, total_n = total + sums, total_n + n
        logits, labels, mask = align_next_tokens(local, part)
        tokens = tokens + (token_logprobs(logits, labels) * mask).sum()
    torch.testing.assert_close(total, want, atol=1e-5, rtol=0)
    assert torch.equal(total_n, counts)
    torch.testing.assert_close(tokens, want.sum(), atol=1e-5, rtol=0)


@torch.no_grad()
def test_a_slice_runs_its_own_forward_over_its_group_set_up_once(tiny_model_dir, lm, one_rank_group):
    """A slice's forward enters its group's context itself; DPO's two forwards inside one `slice_context`
    share one set-up (its collectives run once)."""
    ring = load_causal_lm(tiny_model_dir, "fp32").eval()
    ring.set_attn_implementation(register())
    rows = items(lm.config.vocab_size)
    part = groups(1, 0, one_rank_group).shard(pack_collate(rows))
    torch.testing.assert_close(sequence_logprobs(forward_logits(ring, part), part)[0], by_hand(lm, rows),
                               atol=1e-5, rtol=0)
    traffic(reset=True)
    with slice_context(part):  # the set-up alone: three gathers of the row's positions
        pass
    set_up = traffic()["bytes"]
    forward_logits(ring, part)
    one = traffic()["bytes"]
    with slice_context(part):
        forward_logits(ring, part)
        forward_logits(ring, part)
    assert 0 < set_up < one and traffic()["bytes"] == 2 * one - set_up


@torch.no_grad()
def test_last_token_values_padded_packed_and_slices(tiny_score_model_dir, one_rank_group):
    rm = load_score_model(tiny_score_model_dir, "fp32").eval()
    ring = load_score_model(tiny_score_model_dir, "fp32").eval()
    ring.set_attn_implementation(register())
    rows = items(rm.config.vocab_size)
    want = torch.stack([forward_values(rm, {"input_ids": torch.tensor(r["input_ids"])[None]})[0, -1]
                        for r in rows])  # each sample alone: its last token's value
    padded, packed = pad_collate(rows, 0), pack_collate(rows)
    left = {"input_ids": padded["input_ids"].clone(), "attention_mask": padded["attention_mask"].clone()}
    for i, n in enumerate(LENGTHS):  # the same rows padded on the left
        left["input_ids"][i] = padded["input_ids"][i].roll(max(LENGTHS) - n)
        left["attention_mask"][i] = padded["attention_mask"][i].roll(max(LENGTHS) - n)
    for batch in (padded, packed, left):
        torch.testing.assert_close(last_token_values(rm, batch), want, atol=1e-5, rtol=0)
    part = groups(1, 0, one_rank_group).shard(packed)  # the whole row as one slice: its values gathered
    torch.testing.assert_close(last_token_values(ring, part), want, atol=1e-5, rtol=0)
    split = groups(1, 0, one_rank_group).split(packed["input_ids"], packed["position_ids"])
    torch.testing.assert_close(last_token_values(ring, {**split, "seq_lens": packed["seq_lens"]}), want,
                               atol=1e-5, rtol=0)
