"""RewardModelSource on a tiny score model: the reward is the head's value at the last real token
whatever the padding side, equal to a forward of the unpadded sample; normalisation from
config.mean/std; a head saved under another prefix loads with value_head_prefix."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from rewards_http import in_thread_server
from safetensors.torch import load_file, save_file

from posttrain.models.forward import last_token_index
from posttrain.models.setup import ModelSetup
from posttrain.rewards import (
    PythonRewardFunction,
    RemoteReward,
    RewardError,
    RewardModelSource,
    ShardedRemoteReward,
    make_reward_source,
)


@pytest.fixture(scope="module")
def rm_dir(tiny_score_model_dir):
    return Path(tiny_score_model_dir)


@pytest.fixture(scope="module")
def source(rm_dir):
    return RewardModelSource(rm_dir, batch_size=2)


def alone(model, ids: list[int]) -> float:
    """Reward of one unpadded sample, computed without posttrain helpers: head(h_last)."""
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state
        return model.score(hidden)[0, -1, 0].item()


def pad(rows, side, pad_id):
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(0, len(r)) if side == "right" else slice(width - len(r), width)
        ids[i, sl], mask[i, sl] = torch.tensor(r), 1
    return ids, mask


def test_last_token_index_both_sides():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 0, 0]])
    assert last_token_index(mask).tolist() == [1, 3, 3, 1]
    with pytest.raises(ValueError, match="row without any token"):
        last_token_index(torch.tensor([[0, 0]]))


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_reward_equals_unpadded_forward(source, side):
    rows = [[5, 17, 33, 2], [40, 2], [7, 8, 9, 10, 11, 2], [12]]
    expected = [alone(source.model, r) for r in rows]
    assert len(set(round(e, 6) for e in expected)) == 4  # the test can tell samples apart
    ids, mask = pad(rows, side, source.tokenizer.pad_token_id)
    out = source.score(["ignored"] * 4, None, None, sequences=ids, attention_mask=mask)
    torch.testing.assert_close(out.rewards, torch.tensor(expected), atol=1e-5, rtol=1e-4)
    assert out.skipped.tolist() == [False] * 4


def test_a_context_parallel_group_scores_as_one_process(rm_dir, source, tmp_path):
    """With `context` the rows are packed into one and this rank's slice is run over the group
    (`models.last_token_values`); a one-rank group (its slice the whole row) gives the unsplit rewards."""
    import torch.distributed as dist

    from posttrain.models.context_parallel import register
    from posttrain.models.parallel_groups import ContextGroups

    rows = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    ring = RewardModelSource(rm_dir, batch_size=2)
    ring.model.set_attn_implementation(register())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ring.context = ContextGroups(1, 0, dist.group.WORLD, 0, 1, head_stride=1)
        got = ring.score_tokens(rows).rewards
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(got, torch.tensor([alone(source.model, r) for r in rows]), atol=1e-5, rtol=0)


def test_text_queries_are_scored_as_given(source):
    """OpenRLHF's serve_rm: no automatic special tokens, nothing appended — a query ending in the EOS
    text is scored at that EOS, one without it (a truncated response) at its own last token."""
    tok = source.tokenizer
    queries = ["2+3=5", "a longer query about 7*8=56" + tok.eos_token]
    expected = [alone(source.model, tok(q, add_special_tokens=False)["input_ids"]) for q in queries]
    out = source.score(queries, [""] * 2, None)
    torch.testing.assert_close(out.rewards, torch.tensor(expected), atol=1e-5, rtol=1e-4)
    finished = source.score(["2+3=5" + tok.eos_token], [""], None).rewards
    assert not torch.allclose(out.rewards[:1], finished)  # no EOS is appended to the truncated one
    assert out.extra_logs["reward_model/truncated"].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="needs attention_mask"):
        source.score(["a"], None, None, sequences=torch.tensor([[1, 2]]))


def test_max_len_cuts_ends_with_eos_and_counts(rm_dir, source):
    tok = source.tokenizer
    cut = RewardModelSource(rm_dir, max_len=4, tokenizer=tok)
    long_ids = tok("one two three four five six")["input_ids"]
    assert len(long_ids) > 4
    out = cut.score(["one two three four five six", "hi"], None, None)
    assert out.extra_logs["reward_model/truncated"].tolist() == [1.0, 0.0] and cut.num_truncated == 1
    assert out.rewards[0].item() == pytest.approx(alone(cut.model, long_ids[:3] + [tok.eos_token_id]),
                                                  abs=1e-5)


def test_normalisation_from_config(rm_dir, source, tmp_path):
    norm_dir = tmp_path / "rm-norm"
    shutil.copytree(rm_dir, norm_dir)
    cfg = json.loads((norm_dir / "config.json").read_text())
    cfg.update(mean=0.25, std=2.0)
    (norm_dir / "config.json").write_text(json.dumps(cfg))
    queries = ["1+1=2", "3*3=9"]
    raw = source.score(queries, None, None).rewards
    normed = make_reward_source(model_name_or_path=str(norm_dir), normalize=True).score(queries, None, None)
    torch.testing.assert_close(normed.rewards, (raw - 0.25) / 2.0)
    plain = RewardModelSource(norm_dir).score(queries, None, None)  # stats stored but normalisation off
    torch.testing.assert_close(plain.rewards, raw)
    with pytest.raises(RewardError, match="no `mean`/`std`.*train the RM with posttrain rm, or drop "
                                         "--reward.normalize_enable"):
        RewardModelSource(rm_dir, normalize=True)


def test_head_under_another_prefix(rm_dir, source, tmp_path):
    other = tmp_path / "rm-value-head"
    shutil.copytree(rm_dir, other)
    weights = load_file(other / "model.safetensors")
    weights["value_head.weight"] = weights.pop("score.weight")
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    queries = ["5-2=3", "the reward model reads this"]
    head = ModelSetup(value_head_prefix="value_head")
    loaded = RewardModelSource(other, setup=head).score(queries, None, None)
    torch.testing.assert_close(loaded.rewards, source.score(queries, None, None).rewards)
    with pytest.raises(ValueError, match="value_head_prefix='value_head': no tensor value_head.weight"):
        RewardModelSource(rm_dir, setup=ModelSetup(value_head_prefix="value_head"))


def test_reward_model_served_over_http(source):
    queries = ["2+2=4", "a reward model behind a server"]
    with in_thread_server(source) as base:
        remote = RemoteReward(base + "/get_reward", timeout=10)
        torch.testing.assert_close(remote.score(queries, ["", ""], None).rewards,
                                   source.score(queries, None, None).rewards)


def test_make_reward_source_dispatch(rm_dir, tmp_path):
    fn = tmp_path / "r.py"
    fn.write_text("def reward_func(queries, prompts, labels, **kw):\n    return [0.0] * len(queries)\n")
    assert isinstance(make_reward_source(str(fn)), PythonRewardFunction)
    assert isinstance(make_reward_source("http://127.0.0.1:9/get_reward"), RemoteReward)
    assert isinstance(make_reward_source(model_name_or_path=str(rm_dir)), RewardModelSource)
    with pytest.raises(RewardError, match=r"--reward.remote_url='r.py' and --reward.model_name_or_path='m' "
                                          r"both"):
        make_reward_source("r.py", "m")
    with pytest.raises(RewardError, match="no reward source: give --reward.model_name_or_path"):
        make_reward_source()
    with pytest.raises(RewardError, match=r"--reward.remote_url='rm.json': expected an http\(s\):// URL"):
        make_reward_source("rm.json")
    several = make_reward_source("http://127.0.0.1:9/a,http://127.0.0.1:10/a")
    assert (isinstance(several, ShardedRemoteReward)
            and several.urls == ["http://127.0.0.1:9/a", "http://127.0.0.1:10/a"])
    with pytest.raises(RewardError, match=r"entry 2 of 2 \('r.py'\) is not an http\(s\):// URL"):
        make_reward_source("http://127.0.0.1:9/a,r.py")
