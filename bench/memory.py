"""Peak resident memory per role process and step time of one GRPO step: posttrain (full, LoRA, 2 ranks
ZeRO-3 on Ray) vs TRL `GRPOTrainer` (full, PEFT LoRA), on the same model and data (issue 30 item 7).

    .venv/bin/python bench/memory.py [--sizes small,base,qwen2.5-0.5b,qwen2.5-1.5b]
        [--configs full,lora,zero3,zero3-lora,trl-full,trl-lora] [--steps 2] [--workdir DIR]
        [--markdown FILE] [--threads 0] [--max-gib G] [--force]

Model: `posttrain init-tiny` (`build_tiny`): `--size small|base` (llama presets, the tiny 2k-token
tokenizer) or `--shape qwen2.5-0.5b|qwen2.5-1.5b` (the released dimensions and 151,936-row vocabulary,
random init, fp32; the tokenizer is the same local 2k-token one: ids >= 2048 decode to nothing, so
the sampled text is short but the model computes over its full vocabulary). Built once per size in
`--workdir/models/SIZE` (reused when present).

One step = one rollout of 16 prompts x 4 samples (`--prompts`, `--n`), temperature 1, top_p 1,
`--max-new-tokens` 64, scored by the same reward function on both sides (`reward_func` in
`WORKDIR/reward.py`, a deterministic function of the response text with spread inside a group, so the
advantages are not all zero), group-normalised advantages, KL to a reference as a loss term
(k3, coefficient `--kl` 0.04, unclamped: posttrain `--algo.kl.init_coef 0.04 --algo.kl.use_loss
--algo.kl.estimator k3 --algo.kl.clamp 0`, TRL `beta=0.04`), the clipped surrogate averaged over the
step's tokens (posttrain `token_mean`, TRL `loss_type="dapo"`), exactly one AdamW step over the 64
samples in micro-batches of `--micro-batch-size` (8), fp32, sdpa, no gradient checkpointing, TRL
without vLLM. The prompts are the synthetic arithmetic ones rendered by the chat template, in
posttrain's order on both sides (TRL gets the rows pre-ordered, `shuffle_dataset=False`).

Configurations (each in its own fresh process, one after the other):
- `full`: `posttrain ppo` in one process; the reference is a second full copy.
- `lora`: the same with `--ds.lora.rank 8 --ds.lora.alpha 16 --ds.lora.target_modules all-linear`
  (the reference is the actor's base with the adapter disabled: no copy).
- `zero3`: on a local Ray instance, 2 actor ranks + 2 reference ranks (`--actor.num_gpus_per_node 2
  --ref.num_gpus_per_node 2 --ds.zero_stage 3`) + 1 HF rollout engine (`--vllm.num_engines 1`), each
  its own process; per-rank figures.
- `zero3-lora`: the same with LoRA (no reference group: the adapter-disabled base).
- `trl-full`, `trl-lora`: `GRPOTrainer` without / with `peft_config=LoraConfig(r=8, lora_alpha=16,
  target_modules="all-linear")`.

Measured per process: `baseline` = VmRSS after the imports, before any model is loaded (for a Ray
worker: when its actor answered `pid()`, before `setup`); `after setup` = VmRSS and VmHWM once every
model, engine and optimizer is built; `peak` = VmHWM (the kernel's exact high-water mark of the
resident set) at the end of the run (covers set-up and all steps); `live tensors` = the bytes of every
CPU tensor storage alive after the last step (found through `gc`, each storage once: parameters,
ZeRO shards, optimizer state, kept gradients, caches); on Ray read inside each worker through
`__ray_call__`. `s/step` = wall time of each step (the last one is reported: the first includes
warm-up). `param+opt model` = exact arithmetic from the model's tensors (built on the meta device):
fp32 parameters 4 B, and per trainable element a gradient 4 B and Adam's two moments 8 B; the
reference 4 B per element; under ZeRO-3 every tensor counts ceil(numel / 2) elements per rank
(DeepSpeed's partition), the reference counted as sharded too (what ZeRO-3 sharded loading of the
reference gives; on code that loads the reference whole per rank the live-tensor column shows it).
Ratios printed: posttrain / TRL with LoRA (peak RSS, s/step); ZeRO-3 per rank (actor rank i + ref
rank i) / single process, for the model figure, the live tensors and the peak RSS.

A configuration whose estimated memory (`estimate_gib`: parameters, optimizer, reference, engine copies,
logits of one micro-batch, ~0.8 GiB per process) exceeds `--max-gib` (default 90% of the machine's
memory) is skipped with the reason printed (`--force` runs it anyway). Not a test: nothing asserts.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, Poller, machine, md_table, run_worker, trl_grpo_args, versions  # noqa: E402

# this checkout's posttrain, not an installed copy; Ray's workers get it via PYTHONPATH
sys.path.insert(0, str(REPO))

SEED = 42
GIB = 2**30
SIZES = ("small", "base", "qwen2.5-0.5b", "qwen2.5-1.5b")
CONFIGS = ("full", "lora", "zero3", "zero3-lora", "trl-full", "trl-lora")
RAY_CONFIGS = ("zero3", "zero3-lora")
# the most elements of posttrain's reduce bucket under ZeRO-2/3 (at most the trainable ones)
BUCKET = 50_000_000
LORA = {"rank": 8, "alpha": 16, "target": "all-linear"}

REWARD_SOURCE = '''"""bench/memory.py's reward: a deterministic function of the response text (no model),
the same numbers for posttrain (`reward_func`, OpenRLHF format) and TRL (`trl_reward`)."""
import zlib


def score(text):
    return (zlib.crc32(text.encode()) % 1000) / 1000.0 + 0.001 * len(text)


def reward_func(queries, prompts, labels, **kwargs):
    import torch

    r = torch.tensor([score(q[len(p):]) for q, p in zip(queries, prompts)])
    return {"rewards": r, "scores": r, "extra_logs": {}}


def trl_reward(completions, **kwargs):
    return [score(c[0]["content"] if isinstance(c, list) else c) for c in completions]
'''


# ---- /proc readings ------------------------------------------------------------------------------
def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS and VmHWM (bytes) of a process from /proc/<pid>/status; {} when it is gone."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def live_tensor_bytes(_self=None) -> list[int]:
    """[total, largest]: bytes of every CPU tensor storage alive in this process (each storage once), and
    of the largest one (an allocated buffer counts whole even where it was never touched, so it can
    exceed the RSS). `_self` lets it run as `handle.__ray_call__.remote(live_tensor_bytes)` in
    a Ray worker."""
    import gc
    import warnings

    import torch

    storages: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() on deprecated torch module attributes warns
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        try:
            if obj.device.type == "cpu" and not obj.is_meta:
                s = obj.untyped_storage()
                if s.nbytes():
                    storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
        except Exception:  # tensor subclasses without storage, freed mid-iteration
            continue
    return [sum(storages.values()), max(storages.values(), default=0)]


def watch_optimizer_steps(_self=None) -> None:
    """From now on, before every optimizer step in this process (torch's global pre-step hook; DeepSpeed's
    ZeRO steps call the torch optimizer too), record `live_tensor_bytes()` and keep the largest: then the
    activations are freed and the parameters, gradients and optimizer state (from the 2nd step on) are
    alive, so it measures parameter + optimizer memory. `step_live_bytes` reads it."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    torch.optim._bench_step_live = [0, 0]

    def record(_optimizer, _args, _kwargs):
        now, best = live_tensor_bytes(), torch.optim._bench_step_live
        if now[0] > best[0]:
            best[:] = now
    register_optimizer_step_pre_hook(record)


def step_live_bytes(_self=None) -> list[int] | None:
    """[total, largest] of `watch_optimizer_steps`' largest reading; None before it was started."""
    import torch

    return getattr(torch.optim, "_bench_step_live", None)


def _worker_status(_self=None) -> dict:
    """VmRSS / VmHWM of the Ray worker this runs in (`__ray_call__`)."""
    return proc_status()


# ---- worker side ---------------------------------------------------------------------------------
def posttrain_argv(spec: dict, config: str, out_dir: Path) -> list[str]:
    total, mbs = spec["prompts"] * spec["n"], spec["micro_batch_size"]
    argv = ["--actor.model_name_or_path", spec["model"], "--data.prompt_dataset", spec["data"],
            "--data.input_key", "prompt", "--data.label_key", "answer", "--data.apply_chat_template",
            "--reward.remote_url", spec["reward"], "--algo.advantage.estimator", "group_norm",
            "--rollout.batch_size", str(spec["prompts"]), "--rollout.n_samples_per_prompt", str(spec["n"]),
            "--rollout.max_new_tokens", str(spec["max_new_tokens"]), "--rollout.temperature", "1.0",
            "--rollout.top_p", "1.0", "--rollout.micro_batch_size", str(mbs),
            "--train.batch_size", str(total), "--train.micro_batch_size", str(mbs),
            "--train.max_epochs", "1", "--train.num_episodes", "1", "--train.seed", str(SEED),
            "--actor.loss_agg", "token_mean", "--actor.eps_clip", "0.2",
            "--algo.kl.init_coef", str(spec["kl"]), "--algo.kl.use_loss", "--algo.kl.estimator", "k3",
            "--algo.kl.clamp", "0",
            "--actor.adam.lr", str(spec["lr"]), "--actor.adam.betas", "0.9", "0.95",
            "--actor.adam.eps", "1e-8", "--actor.adam.weight_decay", "0.0", "--actor.max_norm", "1.0",
            "--actor.lr_scheduler", "constant", "--ds.param_dtype", "fp32",
            "--ds.attn_implementation", "sdpa", "--ckpt.output_dir", str(out_dir),
            "--ckpt.path", str(out_dir / "checkpoints"), "--ckpt.save_steps", "-1",
            "--logger.logging_steps", "1"]
    if config in ("lora", "zero3-lora"):
        argv += ["--ds.lora.rank", str(LORA["rank"]), "--ds.lora.alpha", str(LORA["alpha"]),
                 "--ds.lora.target_modules", LORA["target"]]
    if config in RAY_CONFIGS:
        argv += ["--actor.num_gpus_per_node", "2", "--ds.zero_stage", "3", "--vllm.num_engines", "1"]
        if config == "zero3":
            argv += ["--ref.num_gpus_per_node", "2"]
    return argv


def run_posttrain(spec: dict, config: str, out_dir: Path, status: dict) -> dict:
    from posttrain.config import parse_config
    from posttrain.trainers.rl.placement import ray_placement
    from posttrain.trainers.rl.ppo import RLTrainer

    argv = posttrain_argv(spec, config, out_dir)
    cfg = parse_config("ppo", argv)
    worker_base: dict[int, dict] = {}
    inner_wait = ray_placement.wait_all

    def wait_all(calls, timeout=None):  # the first call that returns only pids: workers up, no model yet
        out = inner_wait(calls, timeout)
        if not worker_base and out and all(isinstance(x, int) for x in out):
            worker_base.update({pid: proc_status(pid) for pid in out})
        return out

    ray_placement.wait_all = wait_all
    watch_optimizer_steps()
    trainer = RLTrainer(cfg)
    procs: list[dict] = []
    try:
        trainer._sync_engines(verify=True)  # what fit() does before its first step
        status["after_setup"] = proc_status()
        if trainer.placement is not None:
            import ray

            for group in trainer.placement.groups:
                for rank, h in enumerate(group.handles):
                    pid = ray.get(h.pid.remote())
                    procs.append({"role": group.name, "rank": rank, "pid": pid, "handle": h,
                                  "baseline": worker_base.get(pid, {}).get("VmRSS"),
                                  "after_setup": ray.get(h.__ray_call__.remote(_worker_status))})
                ray.get(h.__ray_call__.remote(watch_optimizer_steps))
        steps, rows = [], []
        for _ in range(spec["steps"]):
            t0 = time.perf_counter()
            metrics = trainer.step()
            steps.append(time.perf_counter() - t0)
            trainer.global_step += 1
            trainer.logger.log(trainer.global_step, metrics)
            rows.append({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))})
        trainer.logger.close()
        live = live_tensor_bytes()  # while the trainer (and every model it holds) is alive
        if procs:
            import ray

            for p in procs:
                h = p.pop("handle")
                p["end"] = ray.get(h.__ray_call__.remote(_worker_status))
                p["live_tensors"] = ray.get(h.__ray_call__.remote(live_tensor_bytes))
                p["step_live"] = ray.get(h.__ray_call__.remote(step_live_bytes))
    finally:
        if trainer.reward_source is not None:
            trainer.reward_source.close()
        trainer._release_placement()
        trainer.start.folders.close()
    return {"step_seconds": steps, "procs": procs, "argv": "posttrain ppo " + shlex.join(argv),
            "live_tensors": live, "step_live": step_live_bytes(),
            "reward_mean": [r.get("reward/mean") for r in rows],
            "phases": [{k: r[k] for k in r if k.startswith("timing/")} for r in rows]}


def run_trl(spec: dict, config: str, out_dir: Path, status: dict) -> dict:
    import importlib.util

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    mod_spec = importlib.util.spec_from_file_location("bench_reward", spec["reward"])
    reward = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(reward)
    rows = [json.loads(line) for line in Path(spec["data"], "train.jsonl").read_text().splitlines()]
    ordered = [rows[i] for i in spec["order"]]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                                 for r in ordered])
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32,
                                                 attn_implementation="sdpa")
    peft_config = None
    if config == "trl-lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], target_modules=LORA["target"],
                                 lora_dropout=0.0, task_type="CAUSAL_LM")
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    args = GRPOConfig(**trl_grpo_args(spec, out_dir, beta=spec["kl"], seed=SEED),
                      lr_scheduler_type="constant")
    trainer = GRPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tok,
                          reward_funcs=[reward.trl_reward], callbacks=[Clock()], peft_config=peft_config)
    # the optimizer is created lazily in train(): counted in the peak only
    status["after_setup"] = proc_status()
    watch_optimizer_steps()
    trainer.train()
    live = live_tensor_bytes()  # while the trainer, its models and optimizer are alive
    # a step = on_step_begin -> on_step_end: the generation of the step's rollout happens inside it
    steps = [b - a for a, b in zip(stamps[0::2], stamps[1::2])]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"step_seconds": steps, "procs": [], "reward_mean": [h.get("reward") for h in logs],
            "live_tensors": live, "step_live": step_live_bytes(), "ref_model": trainer.ref_model is not None,
            "trainable": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)}


def worker(args) -> None:
    status: dict = {}
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x)
    if args.config in RAY_CONFIGS:
        # a Ray instance of its own: without this, ray.init() joins whatever local cluster another program
        # started last (/tmp/ray/ray_current_cluster), and posttrain's ray.init(num_cpus=...) then fails
        os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rmb", dir="/tmp")
    import torch  # noqa: F401  (the baseline is read after the heavy imports)
    import transformers  # noqa: F401

    if args.config.startswith("trl"):
        import trl  # noqa: F401
    else:
        import posttrain.trainers.rl.ppo  # noqa: F401
    status["baseline"] = proc_status()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = json.loads(Path(args.spec).read_text())
    run = run_trl if args.config.startswith("trl") else run_posttrain
    res = run(spec, args.config, Path(args.out), status)
    status["end"] = proc_status()
    res.update({"config": args.config, "status": status, "num_threads": torch.get_num_threads()})
    Path(args.result).write_text(json.dumps(res))
    if "RAY_TMPDIR" in os.environ:
        import shutil

        shutil.rmtree(os.environ["RAY_TMPDIR"], ignore_errors=True)


# ---- model arithmetic and estimates -------------------------------------------------------------
def model_numbers(model_dir: str) -> dict:
    """Exact element counts from the model's tensors, built on the meta device: `params` (unique, tied
    once), `lora` (adapter elements, rank 8 all-linear), `linear` (elements of the adapted base weights),
    and their ZeRO-3 per-rank shares on 2 ranks (ceil(numel / 2) per tensor)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from posttrain.models import LoraSpec, apply_lora

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        params = list(model.parameters())
        peft = apply_lora(model,
                          LoraSpec(rank=LORA["rank"], alpha=LORA["alpha"], target_modules=LORA["target"]))
    adapters = [p for n, p in peft.named_parameters() if "lora_" in n]
    linear = [m.base_layer.weight for m in peft.modules() if hasattr(m, "base_layer")
              and hasattr(m, "lora_A")]
    half = lambda ts: sum(math.ceil(t.numel() / 2) for t in ts)  # noqa: E731
    return {"params": sum(p.numel() for p in params), "lora": sum(p.numel() for p in adapters),
            "linear": sum(p.numel() for p in linear), "params_half": half(params),
            "lora_half": half(adapters), "vocab": config.vocab_size, "hidden": config.hidden_size,
            "layers": config.num_hidden_layers}


def param_opt_bytes(config: str, m: dict) -> dict[str, int]:
    """Parameter + gradient + Adam bytes (fp32) per process kind; ZeRO-3 configurations per rank."""
    P, A = m["params"], m["lora"]
    if config in ("full", "trl-full"):
        return {"trainer": 16 * P + 4 * P}  # actor + grads + Adam, reference copy
    if config in ("lora", "trl-lora"):
        return {"trainer": 4 * P + 16 * A}  # frozen base (also the reference), adapter + grads + Adam
    if config == "zero3":
        return {"actor rank": 16 * m["params_half"], "ref rank": 4 * m["params_half"],
                "per rank (actor + ref)": 20 * m["params_half"], "engine": 4 * P}
    return {"actor rank": 4 * m["params_half"] + 16 * m["lora_half"], "per rank (actor + ref)":
            # merged sync: W0 of adapted weights
            4 * m["params_half"] + 16 * m["lora_half"], "engine": 4 * P + 4 * m["linear"]}


def estimate_gib(config: str, m: dict, spec: dict) -> float:
    """Rough peak of the whole machine for a configuration (all its processes): the fp32 tensors the
    roles hold, the logits of one micro-batch (x4: logits, log-softmax, their gradients), ~0.8 GiB per
    process, DeepSpeed's reduce bucket on each actor rank (`BUCKET` elements at most, touched as the
    gradients fill it). Ray under ZeRO-3: every actor and reference rank loads and keeps its half."""
    P, A = m["params"], m["lora"]
    tokens = spec["prompt_tokens"] + spec["max_new_tokens"]
    act = 4 * spec["micro_batch_size"] * tokens * m["vocab"] * 4 + 16 * spec["micro_batch_size"] * tokens * \
        m["hidden"] * m["layers"] * 4
    if config in ("full", "trl-full"):
        b, procs = 20 * P, 1
    elif config in ("lora", "trl-lora"):
        b, procs = 4 * P + 16 * A, 1
    # actor halves (param, grad, Adam) + reduce bucket, reference halves, the engine's copy
    elif config == "zero3":
        b, procs = 2 * (16 * m["params_half"] + 4 * min(P, BUCKET) + 4 * m["params_half"]) + 4 * P, 6
    else:
        b, procs = (2 * (4 * m["params_half"] + 16 * m["lora_half"] + 4 * min(max(A, 1_000_000), BUCKET))
                    + 4 * P + 4 * A, 4)
    return (b + act) / GIB + 0.8 * procs


# ---- driver side ---------------------------------------------------------------------------------
def prepare(args, work: Path) -> tuple[dict, dict[str, dict]]:
    from posttrain.data.synthetic import make_arithmetic_rows, write_jsonl
    from posttrain.models import build_tiny
    from posttrain.trainers.rl.collect import PromptStream

    n_prompts = args.steps * args.prompts  # exactly `steps` rollout batches in one episode
    rows = make_arithmetic_rows(n_prompts, seed=0)
    write_jsonl(rows, str(work / "data" / "train.jsonl"))
    (work / "reward.py").write_text(REWARD_SOURCE)
    common = {"data": str(work / "data"), "reward": str(work / "reward.py"), "prompts": args.prompts,
              "n": args.n, "max_new_tokens": args.max_new_tokens, "steps": args.steps,
              "micro_batch_size": args.micro_batch_size, "lr": args.lr, "kl": args.kl,
              "order": PromptStream(n_prompts, SEED).take(n_prompts)}
    per_size = {}
    for size in args.sizes:
        folder = work / "models" / size
        if not (folder / "config.json").exists():
            kind = {"shape": size} if size.startswith("qwen") else {"size": size}
            t0 = time.perf_counter()
            build_tiny(str(folder), head="lm", seed=0, verbose=False, overwrite=True, **kind)
            print(f"built {size} in {folder} ({time.perf_counter() - t0:.0f} s)", flush=True)
        per_size[size] = {"model": str(folder), "numbers": model_numbers(str(folder)),
                          "prompt_tokens": prompt_tokens(str(folder), rows)}
    return common, per_size


def prompt_tokens(model: str, rows: list[dict]) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return max(len(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False))
               for r in rows)


class RayWatch(Poller):
    """While a Ray configuration runs: the summed RSS of Ray's daemons (raylet, gcs, agents), sampled."""

    def __init__(self, interval: float = 0.5) -> None:
        super().__init__(interval)
        self.peak = 0

    def poll(self) -> None:
        import psutil

        total = 0
        for p in psutil.process_iter(["cmdline", "memory_info"]):
            cmd = p.info["cmdline"] or []
            if cmd and not cmd[0].startswith("ray::") and any("site-packages/ray/" in c for c in cmd) \
                    and p.info["memory_info"] is not None:
                total += p.info["memory_info"].rss
        self.peak = max(self.peak, total)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="small,base", help="comma-separated: " + ", ".join(SIZES))
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=2, help="RL steps per run (the last one's time is reported)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--micro-batch-size", type=int, default=8,
                    help="train / log-prob micro-batch, both sides")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--kl", type=float, default=0.04, help="KL coefficient (k3 loss term): > 0 keeps a "
                                                           "reference")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads in the trainer process (0: torch's default); Ray's ranks set their "
                         "own")
    ap.add_argument("--max-gib", type=float, default=None,
                    help="skip a configuration estimated above this (default: 90%% of the machine's memory)")
    ap.add_argument("--force", action="store_true", help="run configurations estimated above --max-gib too")
    ap.add_argument("--timeout", type=float, default=7200, help="seconds per configuration")
    ap.add_argument("--workdir", help="models, data, logs (default: a temp dir; models are reused when "
                                      "present)")
    ap.add_argument("--markdown", help="also append the markdown report to this file")
    ap.add_argument("--config", help=argparse.SUPPRESS)  # worker mode (internal)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.config:
        return worker(args)
    args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for name, given, valid in (("--sizes", args.sizes, SIZES), ("--configs", args.configs, CONFIGS)):
        if bad := [x for x in given if x not in valid]:
            raise SystemExit(f"{name}: unknown {bad}; valid: {list(valid)}")
    if (args.prompts * args.n) % args.micro_batch_size:
        raise SystemExit("--prompts x --n must be a multiple of --micro-batch-size")
    import psutil

    if args.max_gib is None:
        args.max_gib = 0.9 * psutil.virtual_memory().total / GIB
    started = time.perf_counter()
    tmp = None if args.workdir else tempfile.TemporaryDirectory()
    work = Path(args.workdir or tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    common, per_size = prepare(args, work)
    results: dict[str, dict[str, dict]] = {}
    for size in args.sizes:
        results[size] = {}
        spec = dict(common, model=per_size[size]["model"], prompt_tokens=per_size[size]["prompt_tokens"])
        spec_path = work / f"spec_{size}.json"
        spec_path.write_text(json.dumps(spec))
        for config in args.configs:
            est = estimate_gib(config, per_size[size]["numbers"], spec)
            if est > args.max_gib and not args.force:
                reason = f"estimated {est:.1f} GiB > --max-gib {args.max_gib:.1f}"
                print(f"[{size} {config}] skipped: {reason}", flush=True)
                results[size][config] = {"skipped": reason, "estimate": est}
                continue
            tag = f"{size}_{config}"
            t0 = time.perf_counter()
            try:
                with RayWatch() if config in RAY_CONFIGS else _Null() as watch:
                    res = run_worker(Path(__file__).resolve(), ["--config", config, "--spec", str(spec_path),
                                                                "--threads", str(args.threads), "--out",
                                                                str(work / tag)], work / f"{tag}.log",
                                     timeout=args.timeout)
                res["ray_daemons_peak"] = getattr(watch, "peak", None)
            except Exception as e:  # report and go on
                print(f"[{size} {config}] FAILED: {e}", flush=True)
                results[size][config] = {"failed": str(e).splitlines()[0][:300], "estimate": est}
                continue
            res["estimate"] = est
            results[size][config] = res
            print(f"[{datetime.datetime.now():%H:%M:%S}] {size} {config}: peak "
                  f"{res['status']['end']['VmHWM'] / GIB:.2f} GiB (trainer process), steps "
                  f"{', '.join(f'{s:.1f}' for s in res['step_seconds'])} s, process "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    text = report(args, common, per_size, results, started)
    print(text)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(text + "\n")
    if tmp is not None:
        tmp.cleanup()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _g(x) -> str:
    return "-" if x is None else f"{x / GIB:.2f}"


def rows_of(size: str, config: str, res: dict, m: dict) -> list[list[str]]:
    """Table rows of one configuration: the trainer process, then (Ray) every worker."""
    model = param_opt_bytes(config, m)
    st = res["status"]
    step = res["step_seconds"][-1]
    rows = [[size, config, "trainer process" if config in RAY_CONFIGS else "trainer (all roles)",
             _g(st["baseline"].get("VmRSS")), _g(st["after_setup"].get("VmRSS")),
             _g(st["after_setup"].get("VmHWM")), f"**{_g(st['end'].get('VmHWM'))}**",
             _g(res["live_tensors"][0]), _g(res["live_tensors"][1]), _g(model.get("trainer")),
             _g(_measured(res)), f"{step:.1f}"]]
    for p in res["procs"]:
        key = {"actor": "actor rank", "ref": "ref rank", "rollout engine": "engine"}.get(p["role"])
        rows.append([size, config, f"{p['role']} {p['rank']}", _g(p["baseline"]),
                     _g(p["after_setup"].get("VmRSS")), _g(p["after_setup"].get("VmHWM")),
                     f"**{_g(p['end'].get('VmHWM'))}**", _g(p["live_tensors"][0]), _g(p["live_tensors"][1]),
                     _g(model.get(key)), _g(_measured(p)), ""])
    return rows


def _measured(res: dict) -> int | None:
    """Parameter + optimizer memory as measured: the live tensors before the optimizer step (largest over the
    steps) of a process that trains; a frozen model's process: its live tensors after the last step."""
    step = (res.get("step_live") or [0])[0]
    return step or (res.get("live_tensors") or [None])[0]


def ratios(size: str, res: dict[str, dict], m: dict) -> list[str]:
    ok = {k: v for k, v in res.items() if "status" in v}
    out = []
    if "lora" in ok and "trl-lora" in ok:
        a, b = ok["lora"], ok["trl-lora"]
        out.append(f"- {size}, LoRA: posttrain / TRL peak RSS = "
                   f"**{a['status']['end']['VmHWM'] / b['status']['end']['VmHWM']:.2f}x** (goal <= 1), "
                   f"s/step = **{a['step_seconds'][-1] / b['step_seconds'][-1]:.2f}x** (goal <= 0.8)")
    if "full" in ok and "trl-full" in ok:
        a, b = ok["full"], ok["trl-full"]
        out.append(f"- {size}, full: posttrain / TRL peak RSS = "
                   f"{a['status']['end']['VmHWM'] / b['status']['end']['VmHWM']:.2f}x, s/step = "
                   f"{a['step_seconds'][-1] / b['step_seconds'][-1]:.2f}x")
    for z, single in (("zero3", "full"), ("zero3-lora", "lora")):
        if z in ok and single in ok:
            procs, one = ok[z]["procs"], ok[single]
            model = param_opt_bytes(z, m)["per rank (actor + ref)"] / param_opt_bytes(single, m)["trainer"]
            parts, measured = [], []
            for r in range(2):
                mine = [p for p in procs if p["role"] in ("actor", "ref") and p["rank"] == r]
                measured.append(sum(_measured(p) or 0 for p in mine) / (_measured(one) or 1))
                live = sum(p["live_tensors"][0] for p in mine) / one["live_tensors"][0]
                # the actor rank's largest storage is DeepSpeed's reduce bucket, allocated whole,
                # touched in part
                bucket = max((p["live_tensors"][1] for p in mine if p["role"] == "actor"), default=0)
                rest = (sum(p["live_tensors"][0] for p in mine) - bucket) / one["live_tensors"][0]
                peak = sum(p["end"]["VmHWM"] for p in mine) / one["status"]["end"]["VmHWM"]
                parts.append(f"rank {r}: live tensors {live:.2f}x ({rest:.2f}x without the reduce bucket), "
                             f"peak RSS {peak:.2f}x")
            out.append(f"- {size}, {z} per rank (actor rank i + ref rank i) / {single} in one process: param "
                       f"+ optimizer measured (live tensors before the optimizer step) "
                       f"**{max(measured):.2f}x** (goal <= 0.6; rank 0 {measured[0]:.2f}x, rank 1 "
                       f"{measured[1]:.2f}x), model {model:.2f}x; " + "; ".join(parts))
    return out


def report(args, common, per_size, results, started) -> str:
    lines = ["", "## Issue 30 item 7: peak memory per role (bench/memory.py)", ""]
    lines.append(f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    lines.append(f"- machine: {machine()}, "
                 f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.1f} GiB")
    try:
        import ray

        rv = ray.__version__
    except ImportError:
        rv = "not installed"
    lines.append("- versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()) + f", ray {rv}")
    cmd = ["--sizes", ",".join(args.sizes), "--configs", ",".join(args.configs), "--steps", str(args.steps),
           "--threads", str(args.threads)]
    for k, d in (("prompts", 16), ("n", 4), ("max_new_tokens", 64), ("micro_batch_size", 8), ("lr", 1e-6),
                 ("kl", 0.04)):
        if getattr(args, k) != d:
            cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    lines.append(f"- command: `.venv/bin/python bench/memory.py {shlex.join(cmd)}`")
    lines.append(f"- setup: {common['prompts']} prompts x {common['n']} samples, {common['max_new_tokens']} "
                 f"new tokens, micro-batch {common['micro_batch_size']}, KL k3 loss {common['kl']} with a "
                 f"reference, LoRA rank {LORA['rank']} alpha {LORA['alpha']} {LORA['target']}, fp32, "
                 f"{args.steps} step(s) per run (s/step: the last)")
    for size in args.sizes:
        m, pt = per_size[size]["numbers"], per_size[size]["prompt_tokens"]
        lines.append(f"- {size}: {m['params']:,} parameters (vocab {m['vocab']:,}, hidden {m['hidden']}, "
                     f"{m['layers']} layers), LoRA adapter {m['lora']:,} elements; prompts <= {pt} tokens")
    lines.append("")
    rows, notes = [], []
    for size in args.sizes:
        for config, res in results[size].items():
            if "skipped" in res or "failed" in res:
                rows.append([size, config, "skipped" if "skipped" in res else "FAILED",
                             res.get("skipped") or res.get("failed"), "", "", "", "", "", "", "", ""])
                continue
            rows += rows_of(size, config, res, per_size[size]["numbers"])
            if res.get("ray_daemons_peak"):
                notes.append(f"{size} {config}: Ray's daemons (raylet, gcs, agents) held up to "
                             f"{res['ray_daemons_peak'] / GIB:.2f} GiB RSS (sampled every 0.5 s), not in the "
                             f"table")
    lines.append(md_table(["size", "config", "process", "baseline GiB", "after setup RSS", "after setup HWM",
                           "peak RSS (VmHWM) GiB", "live tensors GiB", "largest tensor GiB",
                           "param+opt model GiB", "param+opt measured GiB", "s/step"], rows))
    lines.append("")
    for size in args.sizes:
        lines += ratios(size, results[size], per_size[size]["numbers"])
    lines += [f"- {n}" for n in notes]
    lines.append(f"- total wall time {time.perf_counter() - started:.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
