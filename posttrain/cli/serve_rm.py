"""`posttrain serve-rm`: serve a reward model or a reward_func file over HTTP for
`--reward.remote_url http://HOST:PORT/get_reward` (POST /get_reward, GET /health).

Every flag of OpenRLHF 0.10.2's `openrlhf.cli.serve_rm` is accepted with the same name and meaning
(`posttrain.config.serving`); [posttrain] marks additions. Flags that cannot act in this run are named
once at start-up, and device-dependent settings (dtype, attention backend, the query length limit) are
resolved with a note."""
from __future__ import annotations

import errno
import os
import sys

from posttrain.config import ConfigError, inert_flags, parse_config
from posttrain.config.hardware import device_type, record_resolved, resolve_hardware_defaults
from posttrain.config.serving import TOKEN_ENV, ServeRMConfig
from posttrain.config.validate import check_serving_model
from posttrain.utils.extras import require

__all__ = ["main", "make_source", "parse_args", "startup_notes"]
PROG = "posttrain serve-rm"
_LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def parse_args(argv: list[str] | None) -> ServeRMConfig:
    """serve-rm's flags (`posttrain.config.serving.ServeRMConfig`, through the trainers' dotted-flag parser:
    `--help`, `--config run.yaml`, typo hints). A bad flag or value ends in one `posttrain serve-rm: error:`
    line and exit status 2. `token` falls back to env POSTTRAIN_RM_TOKEN. Nothing is loaded here."""
    try:
        args = parse_config("serve-rm", argv)
    except ConfigError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.token is None:
        args.token = os.environ.get(TOKEN_ENV) or None
    return args


def resolve_max_len(args: ServeRMConfig) -> list[str]:
    """Set `args.data.max_len` to the truncation length actually used: --data.max_len, capped at the
    model's position limit (the limit itself when --data.max_len is not given). Returns a note per change."""
    from posttrain.models.folders import position_limit

    asked, limit = args.data.max_len, position_limit(args.reward.model_name_or_path)
    if limit is None:
        if asked is None:
            return ["--data.max_len: no limit (the model config names no position limit); pass "
                    "--data.max_len"]
        return []
    if asked is not None and asked <= limit:
        return []
    return [record_resolved(args, "data.max_len", max(limit, 2),
                            "the model's position limit; longer queries are cut")]


def startup_notes(args: ServeRMConfig, device) -> list[str]:
    """Check and resolve the run for `device` before anything loads: raises ConfigError for a setting
    that cannot work here; resolves auto dtype / attention / --data.max_len in `args`; returns one line
    per resolution, warning and flag without effect, to print at start-up."""
    dev = device_type(device)
    notes = []
    if args.reward.model_name_or_path:
        notes += [f"WARNING: {w}" for w in check_serving_model(args.ds, dev)]
        notes += resolve_hardware_defaults(args, dev)
        notes += resolve_max_len(args)
    return notes + [f"note: {text}" for text in inert_flags(args, dev)]


def main(argv: list[str] | None = None):
    """Serve until stopped: Ctrl-C (SIGINT) ends it with status 0, after the requests being scored."""
    args = parse_args(argv)
    from posttrain.utils.errors import UserError
    from posttrain.utils.log import info

    try:
        require("serving over HTTP", "fastapi", "uvicorn")
        check_port_free(args.host, args.port)
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

    from posttrain.rewards.server import build_app, server_config

    info(f"serving {source!r} at http://{args.host}:{args.port}/get_reward"
         f"{' (bearer token required)' if args.token else ''}")
    app = build_app(source, token=args.token, max_request_bytes=args.max_request_bytes,
                    max_queries=args.max_queries, max_concurrent=args.max_concurrent,
                    read_timeout=args.read_timeout)
    try:  # uvicorn stops on Ctrl-C (SIGINT), then raises it again once its requests are done
        uvicorn.Server(server_config(app, args.host, args.port, args.read_timeout)).run()
    except KeyboardInterrupt:
        info("serve-rm stopped (Ctrl-C)")
    finally:
        source.close()


def check_port_free(host: str, port: int) -> None:
    """OSError naming --host/--port when `host:port` cannot be bound (in use, or not an address of this
    machine), tested with a socket bound and closed at once, before any model loads. Port 0 (any free
    port) is not checked."""
    import socket

    if not port:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise OSError(f"--host {host}: cannot resolve it ({err.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            sock.bind(address)
        except OSError as err:
            why = ("is already in use" if err.errno == errno.EADDRINUSE
                   else f"cannot be bound ({err.strerror})")
            raise OSError(f"--port {port}: {host}:{port} {why}; pick another --port, or stop the process "
                          f"that holds it") from None


def _pick_device(device: str | None) -> str:
    return device or device_type()


def make_source(args: ServeRMConfig, device: str):
    """The reward source to serve; call `startup_notes` first (it resolves dtype and --data.max_len)."""
    from posttrain.models.setup import ModelSetup
    from posttrain.rewards import make_reward_source

    path, tokenizer = args.reward.model_name_or_path, None
    if path:
        from posttrain.models import load_tokenizer

        tokenizer = load_tokenizer(path, use_fast=not args.data.disable_fast_tokenizer)
    return make_reward_source(args.reward.remote_url, path, setup=ModelSetup.of(args),
                              normalize=args.reward.normalize_enable, batch_size=args.batch_size,
                              max_len=args.data.max_len, tokenizer=tokenizer, device=device,
                              on_error=args.on_error, timeout=args.reward.timeout,
                              retries=args.reward.retries, max_stuck=args.reward.max_stuck)


if __name__ == "__main__":
    main()
