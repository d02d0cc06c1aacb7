"""`posttrain serve-rm`: serve a reward model or a reward_func file over HTTP for
`--reward.remote_url http://HOST:PORT/get_reward` (POST /get_reward, GET /health).

Every flag of OpenRLHF 0.10.2's `openrlhf.cli.serve_rm` is accepted with the same name and meaning;
[posttrain] marks additions. Flags that cannot act in this run are named once at start-up, and
device-dependent settings (dtype, attention backend, the query length limit) are resolved with a note."""
from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

from posttrain.rewards.remote import TOKEN_ENV
from posttrain.rewards.server import DEFAULT_MAX_REQUEST_BYTES, build_app

__all__ = ["build_app", "main", "make_source", "parse_args", "startup_notes"]
PROG = "posttrain serve-rm"
_LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
# config attributes that hold a model's position limit, most common first
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
# flags that only matter when a model is served (inert for a reward_func file)
_MODEL_FLAGS = ("reward.normalize_enable", "ds.value_head_prefix", "data.max_len", "ds.load_in_4bit",
                "ds.param_dtype", "ds.attn_implementation", "ds.experts_implementation",
                "data.disable_fast_tokenizer", "ds.packing_samples", "ds.onednn_linear", "batch_size")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One `posttrain serve-rm: error: ...` line (no usage block) and exit status 2, like the trainers."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    from posttrain.config.sections import EXPERTS_IMPLEMENTATIONS, PARAM_DTYPES

    p = _Parser(prog=PROG, description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("reward source (exactly one)")
    src.add_argument("--reward.model_name_or_path", dest="reward.model_name_or_path", metavar="DIR",
                     help="reward model folder or HF hub id (a score head)")
    src.add_argument("--reward.remote_url", dest="reward.remote_url", metavar="FILE.py",
                     help="[posttrain] a .py file defining reward_func(queries, prompts, labels, **kwargs)")
    model = p.add_argument_group("reward model")
    model.add_argument("--reward.normalize_enable", dest="reward.normalize_enable", action="store_true",
                       help="return (r - mean) / std with mean/std from the reward model's config.json")
    model.add_argument("--ds.value_head_prefix", dest="ds.value_head_prefix", default="score", metavar="PREFIX",
                       help="score-head name prefix in the checkpoint (default: score)")
    model.add_argument("--ds.param_dtype", dest="ds.param_dtype", choices=PARAM_DTYPES,
                       help="weights dtype (default: auto, bf16 on GPU and fp32 on CPU)")
    model.add_argument("--ds.attn_implementation", dest="ds.attn_implementation", metavar="IMPL",
                       help="eager, sdpa, flash_attention_2, flash_attention_3 or a hub kernel (default: auto, "
                            "flash_attention_2 on GPU when installed, else sdpa)")
    model.add_argument("--ds.experts_implementation", dest="ds.experts_implementation",
                       choices=EXPERTS_IMPLEMENTATIONS, help="MoE expert kernels (default: transformers picks)")
    model.add_argument("--ds.no_onednn_linear", dest="ds.onednn_linear", action="store_false",
                       help="[posttrain] fp32 linear layers on CPU through torch's F.linear, not oneDNN")
    model.add_argument("--ds.load_in_4bit", dest="ds.load_in_4bit", action="store_true",
                       help="4-bit weights (needs a CUDA GPU)")
    model.add_argument("--ds.packing_samples", dest="ds.packing_samples", action="store_true",
                       help="pack the queries of a batch into one row")
    model.add_argument("--data.max_len", dest="data.max_len", type=int, metavar="TOKENS",
                       help="cut longer queries to this many tokens, the last one eos; never more than the "
                            "model's max_position_embeddings (default: that limit)")
    model.add_argument("--data.disable_fast_tokenizer", dest="data.disable_fast_tokenizer", action="store_true",
                       help="load the slow (Python) tokenizer")
    model.add_argument("--batch_size", type=int, default=16, metavar="N", help="queries per forward pass (default: 16)")
    srv = p.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to bind (default: 127.0.0.1, this machine only; 0.0.0.0 for all)")
    srv.add_argument("--port", type=int, default=5000, help="port (default: 5000)")
    srv.add_argument("--token", help=f"[posttrain] require `Authorization: Bearer TOKEN` on every request "
                                     f"(default: env {TOKEN_ENV})")
    srv.add_argument("--max_request_bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
                     help=f"[posttrain] larger request bodies get HTTP 413 (default: {DEFAULT_MAX_REQUEST_BYTES}"
                          ", 32 MiB)")
    srv.add_argument("--max_queries", type=int, metavar="N",
                     help="[posttrain] requests with more queries get HTTP 413 (default: no limit)")
    srv.add_argument("--on_error", default="raise", choices=["raise", "skip"],
                     help="[posttrain] reward_func errors: fail the request (raise) or mark the samples "
                          "skipped (skip)")
    srv.add_argument("--reward.timeout", dest="reward.timeout", type=float, metavar="SECONDS",
                     help="[posttrain] seconds per reward_func call on a request (default: 300)")
    srv.add_argument("--reward.retries", dest="reward.retries", type=int, default=3, metavar="N",
                     help="[posttrain] attempts per reward_func call: raised or timed out (default: 3)")
    srv.add_argument("--device", help="[posttrain] cpu, cuda, cuda:1 ... (default: cuda when available)")
    srv.add_argument("--use_ms", action="store_true", help="download the model from ModelScope (not supported)")
    return p


def _unknown_flag(flag: str, known: set[str]) -> str:
    """One sentence for an unknown flag: its OpenRLHF 0.10.2 name if it was renamed, else the closest flag."""
    import difflib

    from posttrain.compat.flag_migration import renamed_to

    new = renamed_to(flag, "ppo")
    if new and new.split()[0] in known:
        return f"unknown flag {flag}: renamed in OpenRLHF 0.10.2; use {new}"
    close = difflib.get_close_matches(flag, sorted(known), n=1)
    return f"unknown flag {flag}" + (f"; did you mean {close[0]}?" if close else "")


def _check_numbers(p: argparse.ArgumentParser, ns) -> None:
    limits = (("data.max_len", 2, "at least 2 tokens (a query and its eos)"), ("batch_size", 1, ">= 1"),
              ("max_request_bytes", 1, ">= 1"), ("max_queries", 1, ">= 1"), ("port", 0, "in 0..65535"),
              ("reward.retries", 1, ">= 1 (attempts in total)"), ("reward.timeout", 1e-9, "> 0 seconds"))
    for dest, low, why in limits:
        value = getattr(ns, dest)
        if value is not None and (value < low or (dest == "port" and value > 65535)):
            p.error(f"--{dest} {value}: must be {why}")


def _sections(ns, given: dict) -> SimpleNamespace:
    """The parsed flags as OpenRLHF's sections (args.reward, args.ds, args.data) plus the flat ones.
    `ds` is the trainers' DSHead section, so the trainers' engine checks and hardware defaults apply."""
    from posttrain.config.sections import DSHead

    ds = DSHead(**{k[3:]: v for k, v in vars(ns).items() if k.startswith("ds.")})
    reward = SimpleNamespace(**{k[7:]: v for k, v in vars(ns).items() if k.startswith("reward.")})
    data = SimpleNamespace(**{k[5:]: v for k, v in vars(ns).items() if k.startswith("data.")})
    flat = {k: v for k, v in vars(ns).items() if "." not in k}
    return SimpleNamespace(reward=reward, ds=ds, data=data, given=given, **flat)


def parse_args(argv: list[str] | None) -> SimpleNamespace:
    """Parse serve-rm's flags (argparse errors exit 2 with one line). Returns the values as sections
    (`args.reward.model_name_or_path`, `args.ds.param_dtype`, `args.data.max_len`, `args.port`, ...);
    `args.given` maps each flag set away from its default to its value. Nothing is loaded here."""
    p = _parser()
    ns, unknown = p.parse_known_args(argv)
    if unknown:
        flags = [a for a in unknown if a.startswith("-")]
        if not flags:
            p.error(f"unexpected value {unknown[0]!r} (not after any flag that takes it)")
        p.error(_unknown_flag(flags[0].split("=")[0], set(p._option_string_actions)))
    if bool(getattr(ns, "reward.model_name_or_path")) == bool(getattr(ns, "reward.remote_url")):
        p.error("give exactly one of --reward.model_name_or_path DIR or --reward.remote_url FILE.py")
    url = getattr(ns, "reward.remote_url")
    if url and not url.endswith(".py"):
        p.error(f"--reward.remote_url={url!r}: serve-rm serves a .py reward function file")
    _check_numbers(p, ns)
    if ns.token is None:
        ns.token = os.environ.get(TOKEN_ENV) or None
    given = {dest: value for dest, value in vars(ns).items() if value != p.get_default(dest) and dest != "token"}
    return _sections(ns, given)


def _inert(args, device_type: str) -> list[str]:
    """`--flag value has no effect here: reason` for each flag the user set that this run ignores."""
    rules = {"use_ms": "ModelScope downloads are not supported; pass a local folder or an HF hub id"}
    if args.reward.remote_url:
        rules.update({flag: "serve-rm serves a reward_func file, not a model" for flag in _MODEL_FLAGS})
    else:
        rules["on_error"] = "--on_error applies to reward_func files; a reward model error fails the request"
        rules["reward.timeout"] = rules["reward.retries"] = "they apply to reward_func files, not a reward model"
        rules["ds.experts_implementation"] = ("not available in this version: choosing MoE expert kernels "
                                              "(transformers picks)")
        rules["ds.packing_samples"] = "serve-rm scores padded batches (the same rewards; packing only saves time)"
        if device_type == "cuda":
            rules["ds.load_in_4bit"] = "serve-rm loads the reward model unquantised (4-bit serving is not built in)"
    out = []
    for flag, value in args.given.items():
        if flag in rules:
            shown = "" if isinstance(value, bool) else f" {value}"
            section, _, name = flag.rpartition(".")
            typed = f"{section}.no_{name}" if value is False else flag  # store_false: --ds.no_onednn_linear
            out.append(f"--{typed}{shown} has no effect here: {rules[flag]}")
    return out


def position_limit(model_path: str) -> int | None:
    """The model's position limit (max_position_embeddings or its equivalent) from its config, or None."""
    from transformers import AutoConfig

    from posttrain.models.loading import check_model_path

    config = AutoConfig.from_pretrained(check_model_path(model_path))
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for key in _POSITION_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def resolve_max_len(args) -> list[str]:
    """Set `args.data.max_len` to the truncation length actually used: --data.max_len, capped at the
    model's position limit (the limit itself when --data.max_len is not given). Returns a note per change."""
    asked, limit = args.data.max_len, position_limit(args.reward.model_name_or_path)
    if limit is None:
        if asked is None:
            return ["--data.max_len: no limit (the model config names no position limit); pass --data.max_len"]
        return []
    if asked is not None and asked <= limit:
        return []
    args.data.max_len = max(limit, 2)
    shown = "auto" if asked is None else str(asked)
    return [f"--data.max_len: {shown} -> {args.data.max_len} (the model's position limit; longer queries are cut)"]


def startup_notes(args, device) -> list[str]:
    """Check and resolve the run for `device` before anything loads: raises ConfigError for a setting
    that cannot work here; resolves auto dtype / attention / --data.max_len in `args`; returns one line
    per resolution, warning and inert flag, to print at start-up."""
    from posttrain.config.hardware import device_type, resolve_hardware_defaults
    from posttrain.config.validate import check_serving_model

    dev = device_type(device)
    notes = []
    if args.reward.model_name_or_path:
        notes += [f"WARNING: {w}" for w in check_serving_model(args.ds, dev)]
        notes += resolve_hardware_defaults(args, dev)
        notes += resolve_max_len(args)
    return notes + [f"note: {text}" for text in _inert(args, dev)]


def main(argv: list[str] | None = None):
    args = parse_args(argv)
    from posttrain.utils.errors import UserError
    from posttrain.utils.log import info

    try:
        device = _pick_device(args.device)
        for note in startup_notes(args, device):
            info(note)
        source = make_source(args, device)
    except (UserError, ValueError, OSError) as err:  # bad flags, files or model: one line, exit 2
        print(f"{PROG}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.host not in _LOCAL_HOSTS:
        exposure = "" if args.token else " WITHOUT a token (anyone who can reach it can use it; pass --token)"
        info(f"WARNING: serve-rm binds {args.host}:{args.port}, reachable from other machines{exposure}")
    import uvicorn

    info(f"serving {source!r} at http://{args.host}:{args.port}/get_reward"
         f"{' (bearer token required)' if args.token else ''}")
    app = build_app(source, token=args.token, max_request_bytes=args.max_request_bytes, max_queries=args.max_queries)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        source.close()


def _pick_device(device: str | None) -> str:
    import torch

    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def make_source(args, device: str):
    """The reward source to serve; call `startup_notes` first (it resolves dtype and --data.max_len)."""
    from posttrain.rewards import make_reward_source

    path, tokenizer = args.reward.model_name_or_path, None
    if path:
        from posttrain.models import load_tokenizer

        tokenizer = load_tokenizer(path, use_fast=not args.data.disable_fast_tokenizer)
    return make_reward_source(args.reward.remote_url, path, value_head_prefix=args.ds.value_head_prefix,
                              normalize=args.reward.normalize_enable, dtype=args.ds.param_dtype or "fp32",
                              batch_size=args.batch_size, max_len=args.data.max_len, tokenizer=tokenizer,
                              device=device, attn_implementation=args.ds.attn_implementation,
                              onednn_linear=args.ds.onednn_linear, on_error=args.on_error, timeout=args.reward.timeout, retries=args.reward.retries)


if __name__ == "__main__":
    main()
