"""`RolloutPipeline` (trainers/rl/async_pipeline.py) with a fake producer and trainer loop: each batch
starts with exactly the version the protocol promises, memory stays bounded, errors reach the
trainer, and closing never hangs."""
import threading
import time

import pytest

from posttrain.trainers.rl.async_pipeline import PipelineClosed, RolloutPipeline, staleness_metrics


class Loop:
    """The trainer's side of the protocol: take batch s, 'train', wait for the producer, sync, done."""

    def __init__(self, lookahead, first=0, last=10, hold_lock=True, produce_s=0.0, train_s=0.002):
        self.version, self.lock, self.started = first, threading.Lock(), {}
        self.produce_s, self.train_s = produce_s, train_s
        self.pipe = RolloutPipeline(self.produce, lambda: self.version, first=first, last=last,
                                    lookahead=lookahead, lock=self.lock, hold_lock=hold_lock)

    def produce(self, step):
        self.started[step] = self.version
        time.sleep(self.produce_s)
        return f"batch {step}"

    def run(self):
        self.pipe.start()
        got = []
        for s in range(self.pipe.first, self.pipe.last):
            item = self.pipe.get(s)
            got.append((item.step, item.version, item.result))
            time.sleep(self.train_s)
            self.pipe.before_sync(s)
            with self.lock:
                self.version = s + 1
            self.pipe.step_done(s)
        self.pipe.close(timeout=10)
        return got


@pytest.mark.parametrize("lookahead", [0, 1, 2, 3])
@pytest.mark.parametrize("speeds", [(0.0, 0.01), (0.01, 0.0)], ids=["fast-producer", "slow-producer"])
def test_batch_j_is_sampled_by_version_j_minus_the_lookahead(lookahead, speeds):
    loop = Loop(lookahead, first=2, last=12, produce_s=speeds[0], train_s=speeds[1])
    got = loop.run()
    assert [g[0] for g in got] == list(range(2, 12))  # every batch once, in order
    assert {step: version for step, version, _ in got} == {j: max(2, j - lookahead) for j in range(2, 12)}
    assert loop.started == {j: max(2, j - lookahead) for j in range(2, 12)}
    assert loop.pipe.max_queued <= lookahead + 1  # bounded: never more than Q (+ the one just finished)


def test_partial_rollout_mode_keeps_the_bound_without_waiting():
    loop = Loop(1, last=8, hold_lock=False, produce_s=0.005)
    loop.run()
    assert all(v >= j - 1 for j, v in loop.started.items())  # never more than the queue behind


def test_a_producer_error_reaches_the_trainer_at_its_next_batch():
    def produce(step):
        if step == 2:
            raise ValueError("reward server down")
        return step

    pipe = RolloutPipeline(produce, lambda: 0, first=0, last=5, lookahead=3, lock=threading.Lock(),
                           hold_lock=True).start()
    assert pipe.get(0).result == 0 and pipe.get(1).result == 1
    with pytest.raises(ValueError, match="reward server down"):
        pipe.get(2)
    pipe.before_sync(1)  # returns: the producer has finished (it would otherwise wait for batch 4)
    pipe.close()


def test_close_while_the_producer_is_inside_a_batch_returns_and_it_stops_after_it():
    release, inside = threading.Event(), threading.Event()
    produced = []

    def produce(step):
        inside.set()
        release.wait(30)
        produced.append(step)
        return step

    pipe = RolloutPipeline(produce, lambda: 0, first=0, last=100, lookahead=5, lock=threading.Lock(),
                           hold_lock=True).start()
    assert inside.wait(10)
    assert pipe.close(timeout=0.2) == 0
    assert pipe.running and produced == []  # it returned while the batch was still being produced
    release.set()
    pipe._thread.join(10)
    assert not pipe.running and produced == [0]  # it finished that batch and started no other
    with pytest.raises(PipelineClosed):
        pipe.get(1)


def test_staleness_counts_the_oldest_token_and_falls_back_to_the_batch_version():
    class R:
        def __init__(self, versions):
            self.policy_versions = versions

    m = staleness_metrics([R([3, 4]), R([5]), R(None)], batch_version=3, current_version=5)
    assert m == {"async/staleness_mean": pytest.approx((2 + 0 + 2) / 3), "async/staleness_max": 2.0,
                 "rollout/policy_versions_per_sample": pytest.approx(4 / 3)}


def test_a_sync_may_run_while_a_generated_batch_is_still_scored():
    """`generated()` releases the lock: the trainer's sync does not wait for a slow reward."""
    lock, events, synced = threading.Lock(), [], threading.Event()
    pipe = None

    def produce(step):
        events.append(("generated", step))
        pipe.generated()
        if step == 1:  # the reward server answers batch 1 once the sync is done (if the sync waited: in 60 s)
            synced.wait(60)
        events.append(("scored", step))
        return step

    pipe = RolloutPipeline(produce, lambda: 0, first=0, last=3, lookahead=1, lock=lock, hold_lock=True)
    pipe.start()
    pipe.get(0)
    pipe.before_sync(0)  # batch 1 has started
    with lock:  # the sync: granted while batch 1 is being scored
        events.append(("synced", 0))
    synced.set()
    pipe.step_done(0)
    pipe.close()
    assert events.index(("synced", 0)) < events.index(("scored", 1))


def test_the_group_buffer_serves_batches_from_larger_generation_calls():
    """G = 3 groups per call, B = 2 per batch (n = 2): calls happen only when the buffer runs short,
    groups come out oldest first, renumbered, and each batch's cursor is its last group's position."""
    import torch

    from posttrain.rollout.single_turn import Rollout, ScoredRollouts
    from posttrain.trainers.rl.collect import GroupBuffer

    calls = []

    def draw():
        start = 3 * len(calls)
        calls.append(start)
        rollouts = [Rollout([1], [2], [0.0], "stop", f"p{start + g}", "", group=g, cursor=start + g + 1)
                    for g in range(3) for _ in range(2)]
        rewards = torch.arange(6, dtype=torch.float32) + 10 * start
        return (ScoredRollouts(rollouts, rewards, rewards.clone(), {}, torch.zeros(6, dtype=torch.bool)),
                {"x": 1})

    buf = GroupBuffer(batch_size=2, n=2)
    taken = [buf.take(draw) for _ in range(3)]
    # batch 1 from call 1; batch 2 = call 1's last group + call 2's first; batch 3 from call 2
    assert calls == [0, 3]
    prompts = [[r.prompt_text for r in b.rollouts[::2]] for b, _, _ in taken]
    assert prompts == [["p0", "p1"], ["p2", "p3"], ["p4", "p5"]]
    assert [c for _, _, c in taken] == [2, 4, 6]
    assert all([r.group for r in b.rollouts] == [0, 0, 1, 1] for b, _, _ in taken)
    assert [m["rollout/generation_calls"] for _, m, _ in taken] == [1, 1, 0]
    assert [m["rollout/buffered_groups"] for _, m, _ in taken] == [1, 2, 0]
    assert taken[1][0].rewards.tolist() == [4.0, 5.0, 30.0, 31.0]  # rewards travel with their groups
