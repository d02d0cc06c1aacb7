"""Worker for test_gather_for_generation: DeepSpeed ZeRO-3 with --ds.gather_for_generation on and off.

  python gather_worker.py rl MODEL DATA REWARD OUT.pt
      one process: the RL loop (RLOO) with a ZeRO-3 actor, both modes; records the rollouts, the
      trained weights, how often the gathered-for-generation context was entered and how many gathered
      parameters ZeRO's hooks released during generation.
  torchrun --nproc_per_node 2 gather_worker.py sync MODEL OUT_DIR
      the actor's Ray worker (`RoleWorker`) over 2 ZeRO-3 ranks, both modes: its weights hash, its sync
      layout and a bucketed broadcast into an HF rollout engine (`EngineWorker`, on rank 0), with the
      `GatheredParameters` contexts entered on each rank. Rank r writes OUT_DIR/rank{r}.pt.

ZeRO-3 keeps parameters under 1e5 elements resident (all of the nano model's); the threshold is set to 0
here, so every parameter is partitioned at rest as a large model's are.
"""

import functools
import os
import socket
import sys
import threading

import torch

os.environ.setdefault("DS_BUILD_OPS", "0")
import posttrain.engines.deepspeed_engine as ds_engine  # noqa: E402
from posttrain.engines.dist import shutdown  # noqa: E402

BUCKET_BYTES = 64 * 1024  # several buckets for the nano model


def _nothing_resident():
    make = ds_engine.ds_config

    def config(**kwargs):
        cfg = make(**kwargs)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        return cfg
    ds_engine.ds_config = config


def _gathered_parameters_spy(module_of) -> list:
    """Record, for each `GatheredParameters` entered, (its parameters, the module's parameters whole)."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus

    calls = []
    enter = GatheredParameters.__enter__

    def spy(self):
        out = enter(self)
        module = module_of()
        if self.enabled and module is not None:
            whole = sum(p.ds_status == ZeroParamStatus.AVAILABLE for p in module.parameters())
            calls.append((len(self.params), whole))
        return out
    GatheredParameters.__enter__ = spy
    return calls


# ---- one process: the RL loop --------------------------------------------------------------------
def _release_counter() -> dict:
    """Counts gathered parameters ZeRO's forward hooks release (re-partition)."""
    import deepspeed.runtime.zero.partitioned_param_coordinator as ppc
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    count = {"n": 0}
    cls = ppc.PartitionedParameterCoordinator
    release = cls._PartitionedParameterCoordinator__release_param

    def spy(self, param, *args, **kwargs):
        if param.ds_status == ZeroParamStatus.AVAILABLE and not param.ds_active_sub_modules:
            count["n"] += 1
        return release(self, param, *args, **kwargs)
    cls._PartitionedParameterCoordinator__release_param = spy
    return count


def run_rl(model, data, reward, out) -> None:
    from safetensors.torch import load_file

    from posttrain.cli import train_ppo_ray
    from posttrain.trainers.rl import build
    from posttrain.trainers.rl.ppo import RLTrainer

    build.build_actor = functools.partial(build.build_actor, zero_stage=3)  # one process: ZeRO-3 regardless
    released = _release_counter()
    entered = {"n": 0}
    gathered = ds_engine.DeepSpeedEngine.gathered_for_generation

    def counting(self):
        entered["n"] += 1
        return gathered(self)
    ds_engine.DeepSpeedEngine.gathered_for_generation = counting
    produce = RLTrainer.produce
    record = {}

    def recording(self, step):
        before = released["n"]
        scored, metrics, cursor = produce(self, step)
        record["released"] += released["n"] - before
        record["rollouts"].append([(r.prompt_ids, r.output_ids, r.rollout_logprobs) for r in scored.rollouts])
        return scored, metrics, cursor
    RLTrainer.produce = recording
    flags = ["--actor.model_name_or_path", model, "--data.prompt_dataset", data, "--data.input_key", "prompt",
             "--data.label_key", "answer", "--data.apply_chat_template", "--data.max_len", "40",
             "--reward.remote_url", reward, "--rollout.batch_size", "4",
             "--rollout.n_samples_per_prompt", "2", "--rollout.max_new_tokens", "5",
             "--rollout.micro_batch_size", "8", "--train.batch_size", "8", "--train.micro_batch_size", "4",
             "--data.max_samples", "8", "--actor.adam.lr", "1e-2", "--actor.lr_warmup_ratio", "0",
             "--algo.kl.init_coef", "0", "--algo.advantage.estimator", "rloo", "--ds.zero_stage", "3",
             "--train.seed", "7"]
    results = {}
    for mode, extra in (("on", ["--ds.gather_for_generation"]), ("off", ["--ds.no_gather_for_generation"])):
        record.update(released=0, rollouts=[])
        entered["n"] = 0
        run_dir = os.path.join(os.path.dirname(out), mode)
        train_ppo_ray.main(flags + ["--ckpt.output_dir", run_dir] + extra)
        results[mode] = {"entered": entered["n"], "released": record["released"],
                         "rollouts": record["rollouts"],
                         "weights": load_file(os.path.join(run_dir, "model.safetensors"))}
    torch.save(results, out)


# ---- two ranks: the actor's Ray worker and a rollout engine --------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threaded(fn, *args, **kwargs) -> threading.Thread:
    t = threading.Thread(target=fn, args=args, kwargs=kwargs)
    t.start()
    return t


def run_sync(model, out_dir) -> None:
    from posttrain.config import parse_config
    from posttrain.trainers.rl.placement.workers import EngineWorker, RoleWorker

    rank = int(os.environ["RANK"])
    flags = ["--actor.model_name_or_path", model, "--data.prompt_dataset", "p.jsonl",
             "--reward.remote_url", "r.py", "--ds.zero_stage", "3", "--actor.num_gpus_per_node", "2",
             "--ds.param_dtype", "fp32"]
    worker = None
    calls = _gathered_parameters_spy(lambda: None if worker is None
                                     or worker.obj is None else worker.obj.model)
    results = {}
    for mode, extra in (("on", ["--ds.gather_for_generation"]), ("off", ["--ds.no_gather_for_generation"])):
        cfg = parse_config("ppo", flags + extra, check=False)
        worker = RoleWorker("actor", rank, 2, None, 1, {})
        worker.setup(cfg, 4)
        res = results[mode] = {}
        del calls[:]
        res["hash"] = worker.weights_hash()
        res["hash_calls"] = list(calls)
        res["layout"] = worker.sync_layout(BUCKET_BYTES)
        engine = None
        if rank == 0:  # a rollout engine with other weights than the actor's receives the broadcast
            engine = EngineWorker(1, {})
            engine.setup(cfg)
            with torch.no_grad():
                for p in engine.engine.model.parameters():
                    p.zero_()
            res["engine_before"] = engine.weights_hash()
            port = _free_port()
            joining = _threaded(engine.sync_join, "127.0.0.1", port, 1, 2, "gloo")
            worker.sync_join("127.0.0.1", port, 2, "gloo")
            joining.join()
            receiving = _threaded(engine.sync_receive, res["layout"], verify=True)
        del calls[:]
        worker.sync_send(res["layout"])
        res["send_calls"] = list(calls)
        if rank == 0:
            receiving.join()
            res["engine_after"] = engine.weights_hash()
            res["engine_received"] = engine.received.hexdigest()
        res["reference"] = worker.obj.engine.full_state_dict()  # the one-shot gather (None off rank 0)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    _nothing_resident()
    torch.set_num_threads(1)
    if sys.argv[1] == "rl":
        run_rl(*sys.argv[2:6])
    else:
        run_sync(*sys.argv[2:4])
    shutdown()  # no gloo thread left alive at exit (an exit-time abort otherwise)
