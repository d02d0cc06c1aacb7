"""The config of `posttrain serve-rm`: every flag of OpenRLHF 0.10.2's `openrlhf.cli.serve_rm` with the same
name and meaning, plus posttrain's additions (extension=True). It is parsed by the same dotted-flag parser
as the trainers (help, `--config run.yaml`, typo hints, one-line errors) and reports flags that cannot act
in the run the same way (`inert=`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from posttrain.config.facts import Inert
from posttrain.config.sections import ATTENTION_RULE, EXPERTS_IMPLEMENTATIONS, HEAD_PREFIX_RULE, PARAM_DTYPES
from posttrain.config.spec import ParsedFields, opt, section

ON_ERROR = ("raise", "skip")
DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024  # the reward server's request limit (rewards/server.py)
DEFAULT_MAX_CONCURRENT = 64  # requests being scored or waiting their turn; more get HTTP 503
DEFAULT_MAX_STUCK = 4  # timed-out reward_func calls still running at which no call starts (python_func.py)
DEFAULT_READ_TIMEOUT = 60.0  # seconds for a request's headers, then as many for its body (HTTP 408)
TOKEN_ENV = "POSTTRAIN_RM_TOKEN"  # the bearer token of the reward server and its client (rewards/remote.py)
FUNC_FILE = Inert("serve-rm serves a reward_func file, not a model",
                  lambda v, c, dev: bool(c.reward.remote_url))
FOR_FUNC_FILES = "they apply to reward_func files, not a reward model"


def _serves_model(v, c, dev: str) -> bool:
    return bool(c.reward.model_name_or_path)


@dataclass
class ServedRewardConfig:
    """The reward source (exactly one of a reward model or a reward_func file)."""

    model_name_or_path: str | None = opt(None, "reward model folder or HF hub id (a score head)")
    remote_url: str | None = opt(None, "a .py file defining reward_func(queries, prompts, labels, **kwargs)",
                                 extension=True)
    normalize_enable: bool = opt(False, "return (r - mean) / std with mean/std from the reward model's "
                                        "config.json",
                                 inert=FUNC_FILE)
    timeout: float | None = opt(None, "seconds per reward_func call on a request; unset: 300", extension=True,
                                gt=0, note="seconds", inert=Inert(FOR_FUNC_FILES, _serves_model))
    retries: int = opt(3, "attempts per reward_func call: raised or timed out", extension=True, ge=1,
                       note="(attempts in total)", inert=Inert(FOR_FUNC_FILES, _serves_model))
    max_stuck: int = opt(DEFAULT_MAX_STUCK, "timed-out reward_func calls still running (blocked in C "
                         "code) at which every request gets 503 until restart", extension=True, ge=1,
                         inert=Inert(FOR_FUNC_FILES, _serves_model))


@dataclass
class ServedModelConfig:
    """Loading the reward model."""

    value_head_prefix: str = opt("score", "score-head name prefix in the checkpoint", **HEAD_PREFIX_RULE,
                                 inert=FUNC_FILE)
    param_dtype: str | None = opt(None, "weights dtype; default auto: bf16 on GPU, fp32 on CPU",
                                  choices=PARAM_DTYPES, inert=FUNC_FILE)
    attn_implementation: str | None = opt(
        None, "eager, sdpa, flash_attention_2, flash_attention_3 or a hub kernel; default auto: "
              "flash_attention_2 on "
        "GPU when installed, else sdpa", **ATTENTION_RULE, inert=FUNC_FILE)
    experts_implementation: str | None = opt(
        None, "MoE expert kernels; default: transformers picks", choices=EXPERTS_IMPLEMENTATIONS,
        inert=FUNC_FILE)
    onednn_linear: bool = opt(True, "fp32 linear layers on CPU through oneDNN (--ds.no_onednn_linear: "
                                    "torch's "
                              "F.linear)", negation="no_onednn_linear", extension=True, inert=FUNC_FILE)
    load_in_4bit: bool = opt(False, "4-bit weights (needs a CUDA GPU)", inert=(
        FUNC_FILE, Inert("serve-rm loads the reward model unquantised (4-bit serving is not built in)",
                         lambda v, c, dev: dev == "cuda")))
    packing_samples: bool = opt(False, "pack the queries of a batch into one row", inert=(
        FUNC_FILE, Inert("serve-rm scores padded batches (the same rewards; packing only saves time)")))


@dataclass
class ServedDataConfig:
    """Tokenising the queries."""

    max_len: int | None = opt(None, "cut longer queries to this many tokens, the last one eos; never more "
                                    "than the "
                              "model's max_position_embeddings (default: that limit)", ge=2,
                              message="must be at least 2 tokens (a query and its eos)", inert=FUNC_FILE)
    disable_fast_tokenizer: bool = opt(False, "load the slow (Python) tokenizer", inert=FUNC_FILE)


@dataclass
class ServeRMConfig(ParsedFields):
    """posttrain serve-rm: serve a reward model or a reward_func file over HTTP for
    `--reward.remote_url http://HOST:PORT/get_reward` (POST /get_reward, GET /health)."""

    trainer: ClassVar[str] = "serve-rm"
    reward: ServedRewardConfig = section(ServedRewardConfig)
    ds: ServedModelConfig = section(ServedModelConfig)
    data: ServedDataConfig = section(ServedDataConfig)
    batch_size: int = opt(16, "queries per forward pass", ge=1, inert=FUNC_FILE)
    host: str = opt("127.0.0.1", "address to bind: 127.0.0.1 is this machine only; 0.0.0.0 all interfaces")
    port: int = opt(5000, "port", ge=0, le=65535, message="must be in 0..65535")
    token: str | None = opt(None, f"require `Authorization: Bearer TOKEN` on every request (default: env "
                                  f"{TOKEN_ENV})",
                            extension=True)
    max_request_bytes: int = opt(DEFAULT_MAX_REQUEST_BYTES, "larger request bodies get HTTP 413 (32 MiB)",
                                 extension=True, ge=1)
    max_queries: int | None = opt(None, "requests with more queries get HTTP 413 (default: no limit)",
                                  extension=True, ge=1)
    max_concurrent: int = opt(DEFAULT_MAX_CONCURRENT, "requests being scored or waiting their turn; more get "
                                                      "HTTP "
                              "503 at once", extension=True, ge=1)
    read_timeout: float = opt(DEFAULT_READ_TIMEOUT, "seconds a client has to send a request's headers, then "
                                                    "as "
                              "many for its body; later: HTTP 408 and the connection closed", extension=True,
                              gt=0, finite=True, note="seconds")
    on_error: str = opt("raise", "reward_func errors: fail the request (raise) or mark the samples skipped "
                                 "(skip)",
                        choices=ON_ERROR, extension=True,
                        inert=Inert("--on_error applies to reward_func files; a reward model error fails the "
                                    "request", _serves_model))
    device: str | None = opt(None, "cpu, cuda, cuda:1 ... (default: cuda when available)", extension=True)
    use_ms: bool = opt(False, "download the model from ModelScope (not supported)",
                       inert=Inert("ModelScope downloads are not supported; pass a local folder or an HF hub "
                                   "id"))
