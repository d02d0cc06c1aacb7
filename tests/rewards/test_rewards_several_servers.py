"""Several reward servers (`--reward.remote_url URL1,URL2`): each gets a contiguous share of the batch,
the requests are concurrent, the answers are joined in the batch's order, a down server is named,
and a list with an entry that is not an http(s) URL is a one-line config error. The servers run in
threads of this process on 127.0.0.1."""
import threading

import pytest
import torch
from rewards_http import free_port, in_thread_server

from posttrain.cli.main import main
from posttrain.rewards import RewardError, RewardResult, ShardedRemoteReward, make_reward_source
from posttrain.rewards.result import contiguous_chunks


class Recorder:
    """A reward source that records every batch it gets and rewards each query with its own number
    ("7" → 7.0); logs a per-sample value and a batch statistic (`server`: its id). With a barrier it
    waits until every server of the barrier is inside a request: sequential requests would time out."""

    def __init__(self, ident: int, barrier: threading.Barrier | None = None):
        self.ident, self.barrier, self.batches = ident, barrier, []

    def score(self, queries, prompts, labels=None, **kwargs):
        self.batches.append((list(queries), list(prompts), list(labels)))
        if self.barrier is not None:
            self.barrier.wait(timeout=10)
        values = [float(q) for q in queries]
        return RewardResult(values, [10 * v for v in values],
                            extra_logs={"twice": torch.tensor([2 * v for v in values]),
                                        "server": float(self.ident)})

    def close(self):
        pass


def batch(n):
    return [str(i) for i in range(n)], [f"p{i}" for i in range(n)], [f"l{i}" for i in range(n)]


def test_split_rule_is_contiguous_and_as_even_as_possible():
    assert [list(c) for c in contiguous_chunks(7, 3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [len(c) for c in contiguous_chunks(2, 3)] == [1, 1, 0]
    assert [len(c) for c in contiguous_chunks(9, 3)] == [3, 3, 3]


def test_two_servers_get_contiguous_shares_concurrently_and_results_keep_the_order():
    barrier = threading.Barrier(2)
    first, second = Recorder(1, barrier), Recorder(2, barrier)
    with in_thread_server(first) as a, in_thread_server(second) as b:
        source = make_reward_source(f"{a}/get_reward, {b}/get_reward", retries=1, timeout=20)
        assert isinstance(source, ShardedRemoteReward)
        queries, prompts, labels = batch(5)
        out = source.score(queries, prompts, labels)
        source.close()
    # the first server takes the extra sample; each share is contiguous and complete
    assert first.batches == [(["0", "1", "2"], ["p0", "p1", "p2"], ["l0", "l1", "l2"])]
    assert second.batches == [(["3", "4"], ["p3", "p4"], ["l3", "l4"])]
    assert out.rewards.tolist() == [0, 1, 2, 3, 4] and out.scores.tolist() == [0, 10, 20, 30, 40]
    assert out.extra_logs["twice"].tolist() == [0, 2, 4, 6, 8]
    assert out.extra_logs["server"] == pytest.approx((1 * 3 + 2 * 2) / 5)  # weighted by share size
    assert out.skipped.tolist() == [False] * 5


def test_a_batch_smaller_than_the_servers_sends_no_empty_request():
    first, second, third = Recorder(1), Recorder(2), Recorder(3)
    with in_thread_server(first) as a, in_thread_server(second) as b, in_thread_server(third) as c:
        source = ShardedRemoteReward([f"{a}/get_reward", f"{b}/get_reward", f"{c}/get_reward"], timeout=20)
        out = source.score(*batch(2))
        source.close()
    assert out.rewards.tolist() == [0, 1]
    assert [len(r.batches) for r in (first, second, third)] == [1, 1, 0]


def test_a_down_server_is_retried_then_named_in_one_line():
    down = f"http://127.0.0.1:{free_port()}/get_reward"
    up = Recorder(1)
    with in_thread_server(up) as a:
        source = make_reward_source(f"{a}/get_reward,{down}", retries=2, backoff=0.01, timeout=2)
        with pytest.raises(RewardError) as err:
            source.score(*batch(4))
        source.close()
    text = str(err.value)
    assert text.startswith(f"reward server {down} unreachable after 2 attempts (Connection refused)")
    assert "\n" not in text and f"{a}/get_reward" not in text
    assert up.batches and up.batches[0][0] == ["0", "1"]  # the live server still got its share


@pytest.mark.parametrize("value,entry", [("http://127.0.0.1:1/r,rewards.py", "entry 2 of 2 ('rewards.py')"),
                                         ("http://127.0.0.1:1/r,ftp://h/r", "entry 2 of 2 ('ftp://h/r')"),
                                         ("http://127.0.0.1:1/r,", "entry 2 of 2 ('')"),
                                         ("https://,http://127.0.0.1:1/r", "entry 1 of 2 ('https://')")])
def test_a_list_with_an_invalid_entry_is_a_one_line_config_error(capsys, value, entry):
    with pytest.raises(SystemExit) as exit_info:
        main(["ppo", "--actor.model_name_or_path", "m", "--data.prompt_dataset", "p.jsonl",
              "--reward.remote_url", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"posttrain ppo: error: --reward.remote_url {value}: {entry} is not an http(s):// URL; "
                   "a comma-separated list holds reward server URLs only"), err
    with pytest.raises(RewardError, match=r"is not an http\(s\):// URL"):
        make_reward_source(value)
