"""A roofline report for one RL step: achieved GFLOP/s and % of the machine's matmul peak per phase.

    .venv/bin/python bench/roofline.py [--sizes nano tiny small base] [--prompts 16] [--n 8]
                                       [--max-new-tokens 32] [--long-prompt 128] [--repeats 2]

The peak is measured in the same run: the best fp32 GFLOP/s of square matmuls (512 ... 2048) on the
device (CUDA when there is one, else the CPU with torch's default threads), over the kernels a run
may use: torch's matmul and, on CPU, oneDNN's (`--ds.onednn_linear`, on by default). Then, for each preset of
`build_tiny` (llama, random init, fp32) and for a long-prompt config (the `small` preset with every
prompt padded to `--long-prompt` tokens), it builds `posttrain ppo`'s trainer in this process (GAE with
a critic, a reference model and a KL penalty, so that every phase runs) and times the phases of one
step as the trainer runs them, after one warm-up step:

  generation   the rollout engine's `generate` (with the reward function, negligible here)
  old logp     the actor's log-prob forward      ref logp   the reference's log-prob forward
  values       the critic's forward              actor fwd+bwd / critic fwd+bwd   one update each

Useful FLOPs come from the model's shape, per token, counted the way a minimal implementation needs
them (the map for later changes: skipping work shows up as a higher rate):
  forward of one token at context position c = 2 x (linear weights of the decoder layers) + 4 x layers
  x hidden x c (causal attention: QK and AV over the c positions it sees) + 2 x hidden x vocab where its
  logits are needed (the response positions of a log-prob pass; one per generated token);
  backward = 2 x forward (for a trained role). Every sample's prompt counts once per sample.
Wall time of a phase is the median of `--repeats` steps. Not a test: nothing asserts on time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import machine, md_table, versions  # noqa: E402

REWARD = ("def reward_func(queries, prompts, labels, **kw):\n    return {'rewards': [float(len(q)) % 2 for q "
          "in queries]}\n")
FILLER = "Read the question below carefully and answer with one integer. "


def device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _matmuls(dev) -> dict:
    """The fp32 matmul kernels a run may use on `dev`: torch's (MKL on CPU) and, on CPU, oneDNN's
    (`models/cpu_linear.py`, the default for linear layers)."""
    kernels = {"torch.mm": lambda a, b: a @ b}
    if dev.type == "cpu":
        from posttrain.models.cpu_linear import onednn_available, packed_linear, packed_weight

        if onednn_available():
            packed = {}

            def onednn(a, b):
                if b.data_ptr() not in packed:
                    packed[b.data_ptr()] = packed_weight(b.t().contiguous(), a.shape[0])
                return packed_linear(a, packed[b.data_ptr()])

            kernels["oneDNN"] = onednn
    return kernels


def matmul_peak(dev, sizes=(512, 1024, 2048), seconds: float = 1.0) -> tuple[float, str]:
    """The best fp32 GFLOP/s of an n x n @ n x n matmul over the sizes and the kernels of `_matmuls`,
    and which (size, kernel) reached it."""
    best, where = 0.0, ""
    for name, mm in _matmuls(dev).items():
        for n in sizes:
            a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
            for _ in range(2):
                mm(a, b)
            sync(dev)
            reps, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                mm(a, b)
                reps += 1
            sync(dev)
            rate = 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9
            if rate > best:
                best, where = rate, f"{n} x {n}, {name}"
    return best, where


class FlopModel:
    """Per-token forward FLOPs of a llama-style decoder (see the module docstring)."""

    def __init__(self, config) -> None:
        d, layers = config.hidden_size, config.num_hidden_layers
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        f = config.intermediate_size
        kv_dim = d // heads * kv
        self.layers, self.d, self.vocab = layers, d, config.vocab_size
        self.linear = 2 * layers * (d * d + 2 * d * kv_dim + d * d + 3 * d * f)

    def sequence(self, length: int, logits: int) -> float:
        """One forward over `length` tokens (causal), with logits at `logits` positions."""
        attention = 4 * self.layers * self.d * length * (length + 1) / 2
        return self.linear * length + attention + 2 * self.d * self.vocab * logits


def step_flops(fm: FlopModel, exp) -> dict[str, float]:
    """FLOPs of each phase for the experience `exp` (its prompt / response lengths)."""
    lengths = exp.attention_mask.sum(1).tolist()
    responses = exp.action_mask.sum(1).tolist()
    # a log-prob pass: every token, logits at the response positions; generation (prefill + decode with
    # a KV cache) does the same work once per sample; the critic has no vocabulary projection
    fwd = sum(fm.sequence(int(t), int(r)) for t, r in zip(lengths, responses))
    values = sum(fm.sequence(int(t), 0) for t in lengths)
    return {"generation": fwd, "old logp": fwd, "ref logp": fwd, "values": values,
            "actor fwd+bwd": 3 * fwd, "critic fwd+bwd": 3 * values}


def timed(dev, fn):
    sync(dev)
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    return out, time.perf_counter() - t0


def one_step(trainer, step: int, dev) -> tuple[dict[str, float], object]:
    """The phases of `RLTrainer.step`, timed one by one (the same calls, in the same order)."""
    from posttrain.trainers.rl.experience import build_experience

    t = {}
    (scored, _, _), t["generation"] = timed(dev, lambda: trainer.produce(step))
    exp = build_experience(scored.rollouts, scored.rewards.clone(), trainer.tokenizer.pad_token_id)
    mbs = trainer.experience_maker.batching
    _, t["old logp"] = timed(dev, lambda: trainer.actor.logprobs(exp, mbs))
    _, t["ref logp"] = timed(dev, lambda: trainer.ref.logprobs(exp, mbs))
    _, t["values"] = timed(dev, lambda: trainer.critic.values(exp, mbs))
    full, _ = trainer.experience_maker.make(scored, trainer.kl_ctl.value)  # the same passes, for training
    _, t["critic fwd+bwd"] = timed(dev, lambda: trainer.critic.fit(full, trainer.update_settings, step))
    _, t["actor fwd+bwd"] = timed(dev, lambda: trainer.actor.fit(full, trainer.update_settings,
                                                                 trainer.kl_ctl.value, step))
    return t, exp


def run_config(args, work: Path, size: str, long_prompt: int | None, dev) -> dict:
    from posttrain.config import parse_config
    from posttrain.data.synthetic import make_arithmetic_rows, write_jsonl
    from posttrain.models import build_tiny
    from posttrain.trainers.rl.ppo import RLTrainer

    name = size + (f", {long_prompt}-token prompts" if long_prompt else "")
    model = work / f"model_{size}"
    if not model.exists():
        build_tiny(str(model), arch="llama", size=size, head="lm", seed=0, verbose=False, overwrite=True)
    rows = make_arithmetic_rows(args.prompts * (args.repeats + 1), seed=0)
    if long_prompt:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model))
        for r in rows:
            while len(tok(r["prompt"])["input_ids"]) < long_prompt:
                r["prompt"] = FILLER + r["prompt"]
    data = work / f"data_{size}_{long_prompt or 0}"
    write_jsonl(rows, str(data / "train.jsonl"))
    reward = work / "reward.py"
    reward.write_text(REWARD)
    total = args.prompts * args.n
    argv = ["--actor.model_name_or_path", str(model), "--critic.model_name_or_path", str(model),
            "--data.prompt_dataset", str(data), "--data.input_key", "prompt", "--data.label_key", "answer",
            "--data.max_len", str((long_prompt or 64) + args.max_new_tokens + 64),
            "--reward.remote_url", str(reward), "--algo.advantage.estimator", "gae",
            "--algo.kl.init_coef", "0.01", "--rollout.batch_size", str(args.prompts),
            "--rollout.n_samples_per_prompt", str(args.n),
            "--rollout.max_new_tokens", str(args.max_new_tokens),
            "--rollout.micro_batch_size", str(min(32, total)), "--rollout.temperature", "1.0",
            "--train.batch_size", str(total), "--train.micro_batch_size", str(min(32, total)),
            "--train.max_epochs", "1", "--train.num_episodes", "1", "--ds.param_dtype", "fp32",
            "--ckpt.output_dir", str(work / f"run_{size}_{long_prompt or 0}"), "--ckpt.save_steps", "-1",
            *args.flags.split()]
    trainer = RLTrainer(parse_config("ppo", argv))
    try:
        fm = FlopModel(trainer.actor.model.config)
        samples = []
        for step in range(args.repeats + 1):
            times, exp = one_step(trainer, step, dev)
            if step:  # the first step warms up
                samples.append((times, step_flops(fm, exp)))
    finally:
        trainer.start.folders.close()
    phases = list(samples[0][0])
    out = {"name": name, "tokens": int(exp.attention_mask.sum()), "phases": {}}
    for p in phases:
        seconds = statistics.median(s[0][p] for s in samples)
        flops = statistics.median(s[1][p] for s in samples)
        out["phases"][p] = {"seconds": seconds, "gflops": flops / seconds / 1e9}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["nano", "tiny", "small", "base"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--long-prompt", type=int, default=128,
                    help="prompt tokens of the long-prompt config (0: none)")
    ap.add_argument("--repeats", type=int, default=2, help="timed steps per config (after one warm-up)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--flags", default="", help="extra `posttrain ppo` flags, e.g. "
                                                "--flags=--ds.no_onednn_linear")
    args = ap.parse_args(argv)
    dev = device()
    peak, where = matmul_peak(dev)
    configs = [(s, None) for s in args.sizes] + ([("small", args.long_prompt)] if args.long_prompt else [])
    results = []
    with tempfile.TemporaryDirectory(prefix="posttrain-roofline-") as tmp:
        for size, long_prompt in configs:
            results.append(run_config(args, Path(tmp), size, long_prompt, dev))
    print(f"# bench/roofline.py ({machine()}, device {dev})\n")
    print(f"versions: {versions()}\n")
    if args.flags:
        print(f"posttrain flags: {args.flags}\n")
    print(f"fp32 matmul peak: {peak:.1f} GFLOP/s ({where}); one step = {args.prompts} prompts x {args.n} "
          f"samples x {args.max_new_tokens} new tokens; median of {args.repeats} steps after a warm-up\n")
    phases = list(results[0]["phases"])
    rows = []
    for r in results:
        cells = [r["name"], f"{r['tokens']:,}"]
        for p in phases:
            x = r["phases"][p]
            cells.append(f"{x['seconds']:.2f} s, {x['gflops']:.1f} ({100 * x['gflops'] / peak:.0f}%)")
        rows.append(cells)
    print(md_table(["config", "tokens/step"] + [f"{p}: time, GFLOP/s (% of peak)" for p in phases], rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"peak_gflops": peak, "results": results}, indent=1))


if __name__ == "__main__":
    main()
