"""`posttrain serve-rm`: serve a reward model or a reward_func file over HTTP for
`--reward.remote_url http://HOST:PORT/get_reward` (POST /get_reward, GET /health)."""
from __future__ import annotations

import argparse
import os
import sys

from posttrain.agents.rewards.remote import TOKEN_ENV
from posttrain.agents.rewards.server import build_app

__all__ = ["build_app", "main", "parse_args"]
_LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="posttrain serve-rm", description=__doc__)
    src = p.add_argument_group("reward source (exactly one)")
    src.add_argument("--reward.model_name_or_path", dest="model_name_or_path", default=None,
                     help="reward model folder (score head)")
    src.add_argument("--reward.remote_url", dest="remote_url", default=None,
                     help="a .py file defining reward_func(queries, prompts, labels, **kwargs) to serve")
    p.add_argument("--ds.value_head_prefix", dest="value_head_prefix", default="score",
                   help="score-head name prefix in the checkpoint (default score)")
    p.add_argument("--reward.normalize_enable", dest="normalize", action="store_true",
                   help="apply (r - mean) / std with mean/std from the reward model's config.json")
    p.add_argument("--ds.param_dtype", dest="dtype", default=None, choices=["fp32", "bf16", "fp16"],
                   help="reward model dtype (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--ds.attn_implementation", dest="attn_implementation", default=None)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--batch_size", type=int, default=16, help="reward model forward batch size")
    p.add_argument("--max_len", type=int, default=None, help="cut longer queries to this many tokens (counted)")
    p.add_argument("--on_error", default="raise", choices=["raise", "skip"],
                   help="reward_func errors: fail the request (raise) or mark the samples skipped (skip)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--token", default=None,
                   help=f"require `Authorization: Bearer TOKEN` on every request (default: env {TOKEN_ENV})")
    return p


def parse_args(argv: list[str] | None):
    from posttrain.config.migration import renamed_to

    p = _parser()
    args, unknown = p.parse_known_args(argv)
    if unknown:
        flag = unknown[0].split("=")[0]
        new = renamed_to(flag, "ppo") if flag.startswith("--") else None
        p.error(f"unknown flag {flag}" + (f": renamed in OpenRLHF 0.10.2; use {new}" if new else ""))
    if bool(args.model_name_or_path) == bool(args.remote_url):
        p.error("give exactly one of --reward.model_name_or_path DIR or --reward.remote_url FILE.py")
    if args.remote_url and not args.remote_url.endswith(".py"):
        p.error(f"--reward.remote_url={args.remote_url!r}: serve-rm serves a .py reward function file")
    if args.token is None:
        args.token = os.environ.get(TOKEN_ENV) or None
    return args


def main(argv: list[str] | None = None):
    args = parse_args(argv)
    from posttrain.agents.rewards import RewardError

    try:
        source = _make_source(args)
    except (ValueError, FileNotFoundError, RewardError) as err:
        print(f"posttrain serve-rm: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.host not in _LOCAL_HOSTS:
        exposure = "" if args.token else " WITHOUT a token (anyone who can reach it can use it; pass --token)"
        print(f"[posttrain] WARNING: serve-rm binds {args.host}:{args.port}, reachable from other machines"
              f"{exposure}", file=sys.stderr, flush=True)
    import uvicorn

    print(f"[posttrain] serving {source!r} at http://{args.host}:{args.port}/get_reward"
          f"{' (bearer token required)' if args.token else ''}", file=sys.stderr, flush=True)
    try:
        uvicorn.run(build_app(source, token=args.token), host=args.host, port=args.port, log_level="warning")
    finally:
        source.close()


def _make_source(args):
    import torch

    from posttrain.agents.rewards import make_reward_source

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bf16" if str(device).startswith("cuda") else "fp32")
    return make_reward_source(args.remote_url, args.model_name_or_path, value_head_prefix=args.value_head_prefix,
                              normalize=args.normalize, dtype=dtype, batch_size=args.batch_size,
                              max_len=args.max_len, device=device, attn_implementation=args.attn_implementation,
                              on_error=args.on_error)


if __name__ == "__main__":
    main()
