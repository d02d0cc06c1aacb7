"""Hardware-dependent defaults and flags that have no effect in a run.

`resolve_hardware_defaults` fills the "auto" defaults for the device the run uses (and replaces
settings that cannot work there); `record_resolved` is how it (and validation, for auto defaults
such as `--actor.loss_agg`) records what was asked for and what is used. `inert_rules` lists, per
trainer, when a flag has no effect: on this device, without another flag, or never in this version
(features of later versions: Ray, vLLM, async training, ...). `inert_flags` applies them to the
flags the user set, once per flag, so the trainer can say so at start-up. Call `inert_flags` before
or after resolving: it reads what the user asked for, which resolution records on the config.
`posttrain.config.coverage` checks that every flag either acts or has a rule here."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any, NamedTuple

from posttrain.config.ray_mode import data_parallel, present_roles, uses_ray
from posttrain.config.spec import changed_values, flag_specs, get_path, set_path
from posttrain.config.values import format_value

_RESOLVED = "_posttrain_resolved"  # attribute on cfg: path -> (value asked for, value used, reason)


def device_type(device: Any = None) -> str:
    """"cpu" / "cuda" / ... of a torch.device or a device string; None → what torch sees here."""
    if device is None:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(getattr(device, "type", device)).split(":")[0]


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def resolved_values(cfg) -> dict[str, tuple[Any, Any, str]]:
    """path -> (value asked for, value used, reason) for every value set by `record_resolved`."""
    return dict(getattr(cfg, _RESOLVED, {}))


def record_resolved(cfg, path: str, new: Any, reason: str) -> str:
    """Set `path` to `new` on `cfg`, remembering what was asked for and why (shown by `format_config`);
    returns the printable note."""
    book = getattr(cfg, _RESOLVED, None)
    if book is None:
        book = {}
        object.__setattr__(cfg, _RESOLVED, book)
    asked = book[path][0] if path in book else get_path(cfg, path)
    book[path] = (asked, new, reason)
    set_path(cfg, path, new)
    asked = "auto" if asked is None else format_value(asked)
    return f"--{path}: {asked} -> {format_value(new)} ({reason})"


def resolve_hardware_defaults(cfg, device: Any) -> list[str]:
    """Resolve device-dependent settings in place; return one printable note per change.

    - `ds.param_dtype` unset -> bf16 on cuda, fp32 on cpu (bf16 matmuls are ~140x slower on CPU).
    - `ds.attn_implementation` unset -> flash_attention_2 on cuda when flash-attn is installed, else
      sdpa; a flash-attention backend asked for on CPU (or without flash-attn) -> sdpa.
    - `ds.shared_prefix` (PPO) -> off with an attention backend other than sdpa / eager (the shared-
      prefix layout needs an explicit [B, 1, T, T] mask).
    Idempotent: a second call changes nothing."""
    dev = device_type(device)
    notes = []
    ds = cfg.ds
    if ds.param_dtype is None:
        notes.append(
            record_resolved(cfg, "ds.param_dtype", "bf16" if dev == "cuda" else "fp32", f"auto for {dev}")
        )
    attn = ds.attn_implementation
    flash_ok = dev == "cuda" and _has("flash_attn")
    if attn is None:
        notes.append(
            record_resolved(
                cfg,
                "ds.attn_implementation",
                "flash_attention_2" if flash_ok else "sdpa",
                f"auto for {dev}" + ("" if flash_ok or dev != "cuda" else " without flash-attn"),
            )
        )
    elif attn.startswith("flash_attention") and not flash_ok:
        why = "flash attention needs a CUDA GPU" if dev != "cuda" else "flash-attn is not installed"
        notes.append(record_resolved(cfg, "ds.attn_implementation", "sdpa", why))
    if getattr(ds, "shared_prefix", False) and ds.attn_implementation not in ("sdpa", "eager"):
        notes.append(record_resolved(cfg, "ds.shared_prefix", False,
                                     f"{ds.attn_implementation} takes no explicit attention mask"))
    return notes


class InertRule(NamedTuple):
    """`--path` set away from its default has no effect in this run when `when(value, cfg, device_type)`
    is true; `when=None`: it never has an effect in this version. `reason` is what start-up prints,
    followed by `when`'s answer when that is a string (the run-specific why)."""

    path: str
    reason: str
    when: Callable[[Any, Any, str], bool | str] | None = None

    def explain(self, value: Any, cfg, dev: str) -> str | None:
        """The reason the flag has no effect in this run, or None when it acts."""
        answer = True if self.when is None else self.when(value, cfg, dev)
        if not answer:
            return None
        return self.reason + answer if isinstance(answer, str) else self.reason


_NOT_YET = "not available in this version: "
_ONE_PROCESS = ("every role runs in this one process (no role has more than one rank, no --vllm.num_engines, "
                "no RAY_ADDRESS), so there is nothing to place or sync")
_VLLM = _NOT_YET + "vLLM rollouts (rollouts use the Hugging Face engine)"
_VLLM_ENGINE = "the rollout engines run the Hugging Face engine, not vLLM: "
_VLM = _NOT_YET + "vision-language models (prompts are text only)"
_MOE = _NOT_YET + "the MoE load-balancing (router auxiliary) loss is not added"
_PPO_ENGINE = ("DeepSpeed ZeRO shards a role over its ranks: the actor and critic have one rank each here "
               "(--actor/--critic.num_nodes x num_gpus_per_node), so they train with the plain torch engine")
_PPO_LORA = (
    "posttrain ppo trains the full actor and critic (LoRA is for sft, rm and dpo; merge an adapter "
    "first with posttrain lora-merge)"
)


def _in_process(v, c, dev: str) -> bool:
    return not uses_ray(c)


def _no_vllm(v, c, dev: str) -> bool | str:
    """The reason the rollout engines cannot run vLLM here (falsy: they can)."""
    if not (c.vllm.num_engines or 0) >= 1:
        return "--vllm.num_engines is unset"
    if dev != "cuda":
        return "this machine has no CUDA GPU"
    from posttrain.config.backends import hybrid_refusal, vllm_missing

    return vllm_missing() or hybrid_refusal(c) or False


def _on_cpu(v, c, dev: str) -> bool:
    return dev != "cuda"


def _no_eval_dataset(v, c, dev: str) -> bool:
    return not c.eval.dataset


def _common_rules(cfg) -> list[InertRule]:
    rules = [
        InertRule(
            "local_rank",
            "the device comes from the LOCAL_RANK environment variable the launcher sets",
            lambda v, c, dev: str(v) != os.environ.get("LOCAL_RANK", ""),
        ),
        InertRule("use_ms", "ModelScope downloads are not supported; pass a local folder or an HF hub id"),
        InertRule("ds.ring_attn_size", _NOT_YET + "ring attention (sequence parallelism)"),
        InertRule("ds.ring_attn_head_stride", _NOT_YET + "ring attention (sequence parallelism)"),
        InertRule("ds.deepcompile", _NOT_YET + "DeepSpeed DeepCompile"),
        InertRule("ds.tensor_parallel_size", _NOT_YET + "DeepSpeed AutoTP tensor parallelism"),
        InertRule("ds.use_universal_ckpt", _NOT_YET + "DeepSpeed universal checkpoints"),
        InertRule("ds.experts_implementation", _NOT_YET + "choosing MoE expert kernels (transformers picks)"),
        InertRule("ds.use_liger_kernel", _NOT_YET + "Liger fused kernels"),
        InertRule(
            "ds.attn_implementation",
            "flash attention needs a CUDA GPU with flash-attn; sdpa is used",
            lambda v, c, dev: (
                str(v).startswith("flash_attention") and (dev != "cuda" or not _has("flash_attn"))
            ),
        ),
        InertRule("ds.adam_offload", "the optimizer state is already in CPU memory", _on_cpu),
        InertRule("ds.zpg", "ZeRO++ partitioning needs GPUs", _on_cpu),
        InertRule("ds.overlap_comm", "communication overlap needs GPU streams", _on_cpu),
        InertRule(
            "data.dataloader_num_workers",
            "samples are tokenised once, up front, in the main process (no DataLoader workers)",
        ),
        InertRule(
            "train.full_determinism_enable",
            _NOT_YET + "deterministic kernels are not forced (runs are seeded with --train.seed)",
        ),
        InertRule("ds.onednn_linear", "oneDNN computes fp32 linear layers on CPU; on a GPU they use torch's F.linear",
                  lambda v, c, dev: dev != "cpu"),
        InertRule("eval.split", "no --eval.dataset", _no_eval_dataset),
        InertRule("eval.steps", "no --eval.dataset", _no_eval_dataset),
        InertRule("train.max_tokens_per_gpu", "needs --train.dynamic_batch_enable",
                  lambda v, c, dev: not c.train.dynamic_batch_enable),
    ]
    no_saves = lambda v, c, dev: c.ckpt.save_steps <= 0 or c.ckpt.disable_ds
    rules += [
        InertRule(f"ckpt.{name}", "no checkpoints are saved (--ckpt.save_steps <= 0 or --ckpt.disable_ds)",
                  no_saves)
        for name in ("save_hf", "max_num", "max_mem")
    ]
    rules += [
        InertRule(
            f"logger.wandb.{name}",
            "W&B is off (no --logger.wandb.key)",
            lambda v, c, dev: c.logger.wandb.key is None,
        )
        for name in ("org", "group", "project", "run_name")
    ]
    if hasattr(cfg, "ref") and hasattr(cfg.ref, "offload"):
        rules.append(InertRule("ref.offload", "the reference model is already in CPU memory", _on_cpu))
    return rules


def _single_model_rules(cfg) -> list[InertRule]:
    """SFT / RM / DPO."""
    rules = [InertRule("model.aux_loss_coef", _MOE)]
    lora_off = lambda v, c, dev: c.ds.lora.rank <= 0
    rules += [
        InertRule(f"ds.lora.{name}", "LoRA is off (--ds.lora.rank 0)", lora_off)
        for name in ("alpha", "dropout", "target_modules")
    ]
    if cfg.trainer == "rm":
        rules.append(
            InertRule(
                "model.compute_fp32_loss_enable",
                "the reward-model loss is always computed in fp32 (rewards leave the model in float32)",
            )
        )
    return rules


def _ppo_rules(cfg) -> list[InertRule]:
    specs = flag_specs(type(cfg))
    on_ray = {"vllm.num_engines", "vllm.sync_backend", "vllm.sync_with_ray", "vllm.tensor_parallel_size"}
    on_vllm = {"vllm.gpu_memory_utilization", "vllm.enforce_eager", "vllm.enable_prefix_caching"}
    rules = [InertRule(s.path, _VLLM) for s in specs
             if s.section == "vllm" and s.path not in on_ray | on_vllm]
    rules += [InertRule(path, _VLLM_ENGINE, _no_vllm) for path in sorted(on_vllm)]
    rules += [InertRule(f"vllm.{name}", _ONE_PROCESS, _in_process) for name in ("sync_backend", "sync_with_ray")]
    rules += [
        InertRule(f"train.{name}", _ONE_PROCESS, _in_process)
        for name in ("colocate_actor_ref", "colocate_critic_reward", "colocate_all")
    ]
    rules.append(InertRule("train.async_queue_size", "only read with --train.async_enable",
                           lambda v, c, dev: not c.train.async_enable))
    rules.append(
        InertRule("ds.enable_sleep", _NOT_YET + "the hybrid engine's sleep mode (it needs vLLM)")
    )
    rules += [
        InertRule(f"ds.{name}", _PPO_ENGINE, lambda v, c, dev: not data_parallel(c))
        for name in ("zero_stage", "zpg", "adam_offload", "overlap_comm", "grad_accum_dtype")
    ]
    rules.append(InertRule("ds.gather_for_generation", "only read under --ds.zero_stage 3 with several actor ranks "
                           "(in one process the actor trains without ZeRO)",
                           lambda v, c, dev: not data_parallel(c) or c.ds.zero_stage != 3))
    no_rm = lambda v, c, dev: "reward" not in present_roles(c)
    rules += [
        InertRule(f"reward.{name}", "no reward model: rewards come from --reward.remote_url", no_rm)
        for name in ("num_nodes", "num_gpus_per_node")
    ]
    rules += [
        InertRule(f"ds.{name}", _PPO_LORA)
        for name in ("lora.rank", "lora.alpha", "lora.dropout", "lora.target_modules", "load_in_4bit")
    ]
    rules += [
        InertRule(path, _VLM)
        for path in ("actor.freeze_visual_encoder", "data.image_key", "data.max_images_per_prompt")
    ]
    rules.append(InertRule("actor.aux_loss_coef", _MOE))
    rules.append(
        InertRule("reward.offload", _NOT_YET + "offloading the reward model (it stays on the run's device)")
    )
    # flags that matter only together with another flag
    no_critic = lambda v, c, dev: c.algo.advantage.estimator != "gae"
    rules += [
        InertRule(s.path, "no critic: only --algo.advantage.estimator gae trains one", no_critic)
        for s in specs
        if s.section.split(".")[0] == "critic" and s.path != "critic.freezing_steps"
    ]
    no_ref = lambda v, c, dev: c.algo.kl.init_coef == 0 and not c.algo.kl.use_loss
    rules += [
        InertRule(
            f"ref.{name}", "no reference model (--algo.kl.init_coef 0 and no --algo.kl.use_loss)", no_ref
        )
        for name in ("model_name_or_path", "offload", "num_nodes", "num_gpus_per_node")
    ]
    rules.append(InertRule("train.num_episodes", "--train.max_steps sets the run's length",
                           lambda v, c, dev: c.train.max_steps is not None))
    rules.append(InertRule("algo.kl.clamp", "no KL term (--algo.kl.init_coef 0 and no --algo.kl.use_loss)", no_ref))
    rules.append(
        InertRule(
            "reward.normalize_enable",
            "it normalises a reward model's scores (and a critic started from it); there is neither "
            "--reward.model_name_or_path nor a critic",
            lambda v, c, dev: not c.reward.model_name_or_path and c.algo.advantage.estimator != "gae",
        )
    )
    no_remote = lambda v, c, dev: not c.reward.remote_url
    rules += [
        InertRule(f"reward.{name}", "it applies to --reward.remote_url (a reward server or .py file) only",
                  no_remote)
        for name in ("timeout", "retries")
    ]
    rules.append(
        InertRule(
            "reward.skip_errors_enable",
            "it applies to a reward_func file (--reward.remote_url FILE.py) only",
            lambda v, c, dev: not str(c.reward.remote_url or "").endswith(".py"),
        )
    )
    rules.append(
        InertRule("train.ema_beta", "needs --train.enable_ema", lambda v, c, dev: not c.train.enable_ema)
    )
    rules += [
        InertRule("rollout.max_tokens_per_gpu", "needs --train.dynamic_batch_enable",
                  lambda v, c, dev: not c.train.dynamic_batch_enable),
        InertRule("reward.overlong_penalty_factor", "needs --reward.overlong_buffer_len",
                  lambda v, c, dev: not c.reward.overlong_buffer_len),
        InertRule("algo.kl.horizon", "needs --algo.kl.target (the adaptive controller)",
                  lambda v, c, dev: not c.algo.kl.target),
        InertRule("reward.batch_normalize_clip", "needs --reward.batch_normalize_enable",
                  lambda v, c, dev: not c.reward.batch_normalize_enable),
        InertRule("algo.advantage.whiten_level", "needs --algo.advantage.whiten_enable",
                  lambda v, c, dev: not c.algo.advantage.whiten_enable),
        InertRule("ckpt.best_metric_key", "no --eval.dataset", _no_eval_dataset),
        InertRule("ds.value_head_prefix", "no reward model and no critic (--algo.advantage.estimator gae)",
                  lambda v, c, dev: not c.reward.model_name_or_path and c.algo.advantage.estimator != "gae"),
    ]
    rules.append(
        InertRule(
            "algo.dynamic_filtering_range",
            "needs --algo.dynamic_filtering_enable",
            lambda v, c, dev: not c.algo.dynamic_filtering_enable,
        )
    )
    rules += [
        InertRule(
            f"algo.advantage.{name}",
            "needs --algo.advantage.is_correction_enable",
            lambda v, c, dev: not c.algo.advantage.is_correction_enable,
        )
        for name in ("is_correction_type", "is_correction_threshold")
    ]
    rules += [
        InertRule(f"eval.{name}", "no --eval.dataset", _no_eval_dataset)
        for name in ("temperature", "n_samples_per_prompt")
    ]
    return rules


def inert_rules(cfg) -> list[InertRule]:
    """Every inert rule of `cfg`'s trainer. Where several rules name one flag, the first that applies
    is the one reported (trainer-specific rules come first)."""
    specific = _ppo_rules(cfg) if cfg.trainer == "ppo" else _single_model_rules(cfg)
    return specific + _common_rules(cfg)


def inert_flags(cfg, device: Any) -> list[str]:
    """`--flag value: reason` for every flag set away from its default that has no effect in this run
    (on `device`), once per flag, in --help order. Flags still parse everywhere; this only reports them.
    Which flags act and which are covered by a rule here is checked by `posttrain.config.coverage`."""
    dev = device_type(device)
    changed = changed_values(cfg)
    for path, (asked, _used, _why) in resolved_values(cfg).items():
        if asked is None:
            changed.pop(path, None)  # an auto default, not something the user set
        else:
            changed[path] = asked
    specs = flag_specs(type(cfg))
    order = {s.path: i for i, s in enumerate(specs)}
    negations = {s.path: s.negation_flag for s in specs if s.negation}  # a default-True flag set off: --ds.no_x
    found: dict[str, str] = {}
    for rule in inert_rules(cfg):
        if rule.path not in changed or rule.path in found:
            continue
        value = changed[rule.path]
        reason = rule.explain(value, cfg, dev)
        if reason is not None:
            shown = "" if isinstance(value, bool) else " " + format_value(value)
            flag = negations[rule.path] if value is False and rule.path in negations else "--" + rule.path
            found[rule.path] = f"{flag}{shown} has no effect here: {reason}"
    return [found[path] for path in sorted(found, key=order.__getitem__)]
