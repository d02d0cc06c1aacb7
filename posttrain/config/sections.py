"""Config sections shared by several trainers: `ds` (+ `ds.lora`), `vllm`, `rollout`, `train`, `eval`,
`ckpt`, `logger` (+ `logger.wandb`), `adam`, `muon` and the optimizer block (`data`, per trainer:
`config/data_sections.py`).

Flag names, meanings and defaults follow OpenRLHF 0.10.2's CLI reference (docs/from-openrlhf.md).
Where a trainer lacks a field it gets a subclass without it; where only a default differs the trainer
config builds the section with `section(Cls, field=value)`. Fields marked `extension=True` are posttrain
additions. Deliberate default changes: `ds.param_dtype` and `ds.attn_implementation` default to None
("auto", resolved per device at start-up by `resolve_hardware_defaults`), and `param_dtype` also
accepts fp32; `ckpt.path` defaults to None, resolved at start-up to `<ckpt.output_dir>/checkpoints`
(`checkpoint_dir`), so runs started from one folder never share checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config import facts
from posttrain.config.facts import (
    EVAL_OFF,
    LORA_OFF,
    ON_ONE_RANK,
    ONE_PROCESS_ENGINE,
    PPO,
    REF_IN_ACTOR,
    ROLE_PLACEMENT,
    SAVES_OFF,
    WANDB_OFF,
    Inert,
    in_section,
    needs,
    not_yet,
)
from posttrain.config.spec import opt, section

KNOWN_ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
ATTENTION_RULE = dict(
    check=lambda v: v in KNOWN_ATTENTION or "/" in v,
    message=f"valid values: {', '.join(KNOWN_ATTENTION)} or a hub kernel like "
            f"kernels-community/vllm-flash-attn3")

# a score head is stored as `{prefix}.weight` and reached as an attribute of the model
HEAD_PREFIX_RULE = dict(check=str.isidentifier,
                        message="must be a Python identifier such as score or value_head")
PARAM_DTYPES = ("bf16", "fp16", "fp32")
EXPERTS_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm", "deepgemm")
GRAD_ACCUM_DTYPES = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adam", "muon")
# transformers' SchedulerType names (the multipliers are posttrain's own: posttrain/engines/schedulers.py)
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "inverse_sqrt", "reduce_lr_on_plateau", "cosine_with_min_lr", "cosine_warmup_with_min_lr",
                 "warmup_stable_decay", "greedy")
# accepted names that are refused with this reason: they follow a metric, not the optimizer step
METRIC_LR_SCHEDULERS = {
    name: f"{name} changes the learning rate from a metric handed to it after each evaluation, and "
          f"posttrain's schedules are functions of the optimizer step; use a step schedule "
          f"(cosine_with_min_lr, linear, warmup_stable_decay, ...)"
    for name in ("reduce_lr_on_plateau", "greedy")}
POLYNOMIAL_LR_END = 1e-7  # the absolute end LR of `polynomial` (transformers' default lr_end)
# read --min_lr_ratio
MIN_LR_SCHEDULERS = ("cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay")


# --------------------------------------------------------------------------- DeepSpeed + model loading
@dataclass
class LoRAConfig:
    """LoRA / QLoRA adapter; set --ds.lora.rank > 0 to enable (SFT / RM / DPO, and the PPO
    actor and critic)."""

    rank: int = opt(0, "LoRA rank; 0 disables LoRA", ge=0, note="(0 disables LoRA)")
    alpha: int = opt(16, "LoRA alpha (the update is scaled by alpha / rank)", gt=0, inert=LORA_OFF)
    dropout: float = opt(0.0, "dropout on the LoRA branch, in [0, 1)", ge=0, lt=1, inert=LORA_OFF)
    target_modules: list[str] = opt(
        ["all-linear"], "modules that get adapters, e.g. q_proj v_proj, or all-linear", nargs="*",
        inert=LORA_OFF)


@dataclass
class DSConfig:
    """DeepSpeed engine and model loading (shared by every model of the run)."""

    zero_stage: int = opt(2, "DeepSpeed ZeRO stage: 0, 1, 2 or 3", ge=0, le=3,
                          message="valid values: 0, 1, 2, 3", inert=(ON_ONE_RANK, ONE_PROCESS_ENGINE),
                          on_resume="adjustable")
    param_dtype: str | None = opt(
        None, "parameter dtype; default auto: bf16 on GPU, fp32 on CPU", choices=PARAM_DTYPES
    )
    zpg: int = opt(1, "ZeRO++ max partition size", ge=1,
                   inert=(ON_ONE_RANK, Inert("ZeRO++ partitioning needs GPUs", facts.on_cpu)),
                   on_resume="adjustable")
    adam_offload: bool = opt(False, "keep the Adam optimizer state on CPU (not with --optim muon)",
                             inert=(ON_ONE_RANK,
                                    Inert("the optimizer state is already in CPU memory", facts.on_cpu)),
                             on_resume="adjustable")
    overlap_comm: bool = opt(False, "overlap the backward pass with the gradient reduction (more memory)",
                             inert=(ON_ONE_RANK,
                                    Inert("communication overlap needs GPU streams", facts.on_cpu)),
                             on_resume="adjustable")
    grad_accum_dtype: str | None = opt(
        None, "dtype of the gradient accumulation buffer", choices=GRAD_ACCUM_DTYPES, inert=ON_ONE_RANK
    )
    deepcompile: bool = opt(False, "enable DeepSpeed DeepCompile graph compilation",
                            inert=not_yet("DeepSpeed DeepCompile"), on_resume="adjustable")
    tensor_parallel_size: int = opt(1, "ranks per model copy: each decoder layer split over them with "
                                       "DeepSpeed "
                                    "AutoTP (ZeRO stage 0/1/2; ppo: the actor and critic; docs/scaling.md)",
                                    ge=1, on_resume="adjustable")
    ring_attn_size: int = opt(1, "ring-attention sequence-parallel group size (with --ds.packing_samples)",
                              ge=1, on_resume="adjustable")
    ring_attn_head_stride: int = opt(1, "key/value heads gathered per ring-attention step", ge=1,
                                     inert=needs("--ds.ring_attn_size > 1", lambda c: c.ds.ring_attn_size
                                                 > 1),
                                     on_resume="adjustable")
    use_universal_ckpt: bool = opt(False, "write DeepSpeed universal checkpoints (stage/world-size agnostic)",
                                   inert=Inert("posttrain's checkpoints always hold a layout-free copy that "
                                               "resumes on other ranks and ZeRO stages "
                                               "(docs/runs.md#elastic-resume)"),
                                   on_resume="adjustable")
    attn_implementation: str | None = opt(
        None,
        "attention backend: eager, sdpa, flash_attention_2, flash_attention_3 or a hub kernel "
        "(kernels-community/...); default auto: flash_attention_2 on GPU when installed, else sdpa",
        **ATTENTION_RULE,
        inert=Inert("flash attention needs a CUDA GPU with flash-attn; sdpa is used",
                    facts.flash_unavailable),
    on_resume="adjustable",
)
    experts_implementation: str | None = opt(
        None, "MoE expert kernels; default: transformers picks", choices=EXPERTS_IMPLEMENTATIONS,
        on_resume="adjustable",
)
    use_liger_kernel: bool = opt(False, "use Liger fused kernels", inert=not_yet("Liger fused kernels"),
                                 on_resume="adjustable")
    onednn_linear: bool = opt(
        True, "fp32 linear layers on CPU compute through oneDNN instead of torch's MKL call (1.2-1.6x faster "
        "matmuls where MKL is slow, e.g. AMD CPUs; the same math up to float rounding); no effect on GPU "
        "(--ds.no_onednn_linear turns it off)", negation="no_onednn_linear", extension=True,
        inert=Inert("oneDNN computes fp32 linear layers on CPU; on a GPU they use torch's F.linear",
                    lambda v, c, dev: dev != "cpu"), on_resume="adjustable")
    load_in_4bit: bool = opt(False, "load the base model in 4-bit (QLoRA; needs --ds.lora.rank > 0 and CUDA)")
    lora: LoRAConfig = section(LoRAConfig)
    packing_samples: bool = opt(False, "pack several samples into one row (no padding)",
                                on_resume="adjustable")

    @property
    def model_ranks(self) -> int:
        """The ranks one copy of a trained model spans: its tensor-parallel group x its ring-attention group
        (they take the same samples; a micro-batch's token budget is shared by them)."""
        return self.tensor_parallel_size * self.ring_attn_size


@dataclass
class ScoreDSConfig(DSConfig):
    """DeepSpeed engine and model loading; also names the score head of reward models."""

    value_head_prefix: str = opt(
        "score", "attribute name of the scalar score head of reward models", **HEAD_PREFIX_RULE,
        inert=Inert("no reward model and no critic (--algo.advantage.estimator gae)",
                    facts.no_reward_model_nor_critic, PPO))


@dataclass
class PPODSConfig(ScoreDSConfig):
    """DeepSpeed engine and model loading (shared by actor, critic, reference and reward model)."""

    enable_sleep: bool = opt(False, "free DeepSpeed memory between training phases (hybrid engine)",
                             inert=not_yet("the hybrid engine's sleep mode (it needs vLLM)"),
                             on_resume="adjustable")
    shared_prefix: bool = opt(
        True, "RL forwards compute a prompt once for all its samples in a micro-batch, exact to float "
        "rounding (--ds.no_shared_prefix turns it off; off with flash attention)",
        negation="no_shared_prefix", extension=True, on_resume="adjustable")
    gather_for_generation: bool = opt(
        False, "ZeRO-3 with several actor ranks: gather the actor's whole weights once for generation and "
               "for "
        "each weight sync (fast; every rank holds the whole model meanwhile: TRL's "
        "ds3_gather_for_generation); default: one tensor at a time (OpenRLHF's weight sync; fits models "
        "larger than one device)", negation="no_gather_for_generation", extension=True,
        inert=Inert("only read under --ds.zero_stage 3 with several actor ranks (in one process the actor "
                    "trains without ZeRO)", lambda v, c, dev: facts.single_rank_roles(v, c, dev)
                    or c.ds.zero_stage != 3), on_resume="adjustable")


# --------------------------------------------------------------------------- vLLM + rollout (PPO)
VLLM_ENGINE = Inert("the rollout engines run the Hugging Face engine, not vLLM: ", facts.no_vllm)
CPU_KV_CACHE = Inert("vLLM's CPU build sizes its KV cache by VLLM_CPU_KVCACHE_SPACE (GiB; posttrain's "
                     "default 1 GiB), not by a fraction of memory", facts.on_cpu, PPO)
NOT_HYBRID = Inert("needs --train.colocate_all: an engine sleeps only when it shares its GPU with the "
                   "trainer (OpenRLHF turns the flag off without it)",
                   lambda v, c, dev: not c.train.colocate_all, PPO)
SHARED_MODULE = Inert("the rollout engine samples from the actor's own module (one process, no "
                      "--train.async_enable): nothing is "
                      "synced", lambda v, c, dev: facts.in_process(v, c, dev) and not c.train.async_enable,
                      PPO)


@dataclass
class VLLMConfig:
    """vLLM generation engines (PPO)."""

    num_engines: int | None = opt(None, "number of vLLM engines; 0 or unset: no vLLM")
    tensor_parallel_size: int = opt(1, "tensor-parallel size of each vLLM engine", ge=1)
    gpu_memory_utilization: float = opt(0.95, "fraction of GPU memory vLLM may use for weights + KV cache",
                                        inert=(VLLM_ENGINE, CPU_KV_CACHE))
    sync_backend: str = opt("nccl", "backend for trainer -> vLLM weight sync", inert=ROLE_PLACEMENT)
    sync_with_ray: bool = opt(False, "sync weights through Ray collective groups", inert=ROLE_PLACEMENT)
    enforce_eager: bool = opt(False, "disable CUDA graphs in vLLM", inert=VLLM_ENGINE)
    enable_prefix_caching: bool = opt(False, "enable vLLM prefix caching", inert=VLLM_ENGINE)
    enable_sleep: bool = opt(
        False, "let vLLM release memory between rollouts (hybrid engine, not async); on vLLM's CPU build, "
               "which "
        "has no sleep mode, posttrain frees the engines' KV cache instead", inert=(VLLM_ENGINE, NOT_HYBRID))
    sleep_level: int = opt(
        1, "what a sleeping vLLM engine releases: 1 the KV cache, the weights offloaded to CPU memory (GPU); "
           "2 the "
        "weights discarded too (GPU), so every sync after a sleep sends all of them", choices=(1, 2),
        extension=True, inert=needs("--vllm.enable_sleep", lambda c: c.vllm.enable_sleep, PPO))
    lora_sync: str = opt(
        "merged", "how rollout engines apply the LoRA adapter synced after each update (only the adapter "
                  "travels): "
        "merged (W0 + scaling * B A written into plain weights: plain kernels, a copy of the adapted base "
        "weights) or adapter (vLLM's enable_lora with a LoRARequest per version; a peft copy in the HF "
        "engine)", choices=("merged", "adapter"), extension=True, inert=(LORA_OFF, SHARED_MODULE))

    @property
    def engine_ranks(self) -> int:
        """The ranks (GPU bundles) one engine spans: its tensor-parallel size."""
        return self.tensor_parallel_size


VLLM_RANKS = "--vllm.num_engines x --vllm.tensor_parallel_size"  # the GPUs the vLLM engines take, in messages


@dataclass
class RolloutConfig:
    """Sampling of experience (PPO)."""

    batch_size: int = opt(1024, "prompts per rollout step", ge=1)
    micro_batch_size: int = opt(1, "per-GPU micro-batch of the forward passes over generated samples", ge=1,
                                on_resume="adjustable")
    n_samples_per_prompt: int = opt(1, "completions per prompt (> 1 for group estimators)", ge=1)
    temperature: float = opt(1.0, "sampling temperature", gt=0)
    top_p: float = opt(1.0, "nucleus sampling threshold", gt=0, le=1)
    max_new_tokens: int | None = opt(
        None, "max generated tokens per sample; default: max_len - prompt length"
    )
    stop_token_ids: list[int] | None = opt(
        None, "token ids that end a sample; default: the tokenizer's and generation config's EOS; given with "
              "no "
        "ids: only --rollout.max_new_tokens ends a sample (TRL without stop_token)", nargs="*",
        extension=True)
    max_tokens_per_gpu: int | None = opt(
        None,
        "token budget per GPU for rollout-side forwards (dynamic batching; a micro-batch holds up to this x "
        "--ds.ring_attn_size x --ds.tensor_parallel_size tokens, the reference's x --ds.ring_attn_size); "
        "default: --train.max_tokens_per_gpu", gt=0,
        inert=needs("--train.dynamic_batch_enable", lambda c: c.train.dynamic_batch_enable),
    on_resume="adjustable",
)
    vllm_generate_batch_size: int | None = opt(
        None, "prompts per generation call; above --rollout.batch_size needs --train.async_enable", ge=1
    )
    engine: str = opt(
        "auto", "which engine the --vllm.num_engines rollout engines run: auto (vLLM where this machine runs "
                "it: "
        "a CUDA GPU with vllm, or a CPU with vllm-cpu; else the Hugging Face engine, with the reason at "
        "start-up), vllm (the same, said as a requirement: a machine without vLLM ends with that reason) or "
        "hf (the Hugging Face engine in each engine process)", choices=("auto", "vllm", "hf"), extension=True,
        inert=needs("--vllm.num_engines", lambda c: (c.vllm.num_engines or 0) >= 1), on_resume="adjustable")


# --------------------------------------------------------------------------- train / eval / ckpt / logger
@dataclass
class TrainConfig:
    """Training loop."""

    batch_size: int = opt(128, "global training batch size (samples per optimizer step)", ge=1)
    micro_batch_size: int = opt(8, "samples per GPU per forward/backward", ge=1, on_resume="adjustable")
    max_epochs: int = opt(1, "epochs over the dataset", ge=1,
                          on_resume={"ppo": "trajectory", "*": "adjustable"})
    seed: int = opt(42, "random seed")
    full_determinism_enable: bool = opt(
        False, "bit-reproducible kernels (slower)",
        inert=not_yet("deterministic kernels are not forced (runs are seeded with --train.seed)"),
        on_resume="adjustable")
    dynamic_batch_enable: bool = opt(False, "form micro-batches by token budget instead of sample count",
                                     on_resume="adjustable")
    max_tokens_per_gpu: int | None = opt(
        None, "token budget per GPU with --train.dynamic_batch_enable: a micro-batch holds up to this x "
        "--ds.ring_attn_size x --ds.tensor_parallel_size tokens (its group's GPUs share it)", gt=0,
        inert=needs("--train.dynamic_batch_enable", lambda c: c.train.dynamic_batch_enable),
    on_resume="adjustable",
)


@dataclass
class PPOTrainConfig(TrainConfig):
    """Training loop and Ray placement (PPO)."""

    num_episodes: int = opt(1, "passes over the prompt dataset", ge=1,
                            inert=Inert("--train.max_steps sets the run's length",
                                        lambda v, c, dev: c.train.max_steps is not None),
                            on_resume="adjustable")
    max_steps: int | None = opt(
        None, "stop after this many rollout steps, cycling the prompts (a fresh shuffle per pass) as often "
        "as needed; replaces --train.num_episodes when set (TRL's total_episodes / batch size)",
        extension=True, ge=1, note="(or unset)", on_resume="adjustable")
    async_enable: bool = opt(False, "overlap rollout and training (async pipeline)")
    async_queue_size: int = opt(
        1, "rollout batches buffered between sampler and trainer", ge=0,
        note="(batches generated ahead of training; 0: none, as the synchronous loop)",
        inert=Inert("only read with --train.async_enable", lambda v, c, dev: not c.train.async_enable))
    partial_rollout_enable: bool = opt(False, "weight sync may interrupt in-flight generation (async only)")
    enable_ema: bool = opt(False, "keep an exponential moving average of the actor")
    ema_beta: float = opt(0.992, "EMA decay", gt=0, lt=1,
                          inert=needs("--train.enable_ema", lambda c: c.train.enable_ema))
    agent_func_path: str | None = opt(None, "Python file defining a multi-turn agent",
                                      check=lambda v: not v or v.endswith(".py"),
                                      message="must be a .py file defining AgentExecutor")
    tool_path: str | None = opt(None, "Python file of tool functions (or an ENVIRONMENT class of them, one "
                                "per episode): multi-turn tool episodes with no agent loop (docs/agents.md, "
                                "Tool environments)", extension=True,
                                check=lambda v: not v or v.endswith(".py"),
                                message="must be a .py file of tool functions")
    colocate_actor_ref: bool = opt(False, "actor and reference model share GPUs",
                                   inert=(ROLE_PLACEMENT, REF_IN_ACTOR), on_resume="adjustable")
    colocate_critic_reward: bool = opt(False, "critic and reward model share GPUs", inert=ROLE_PLACEMENT,
                                       on_resume="adjustable")
    colocate_all: bool = opt(False, "all models and vLLM engines share GPUs (hybrid engine)",
                             inert=ROLE_PLACEMENT, on_resume="adjustable")


@dataclass
class AgentConfig:
    """Multi-turn agent episodes (--train.agent_func_path, --train.tool_path; posttrain extensions)."""

    timeout: float = opt(300.0, "seconds per episode; an episode that runs longer fails (counted in "
                                "agent/failed)",
                         extension=True, gt=0, note="seconds", on_resume="adjustable")
    max_failure_frac: float = opt(0.1, "stop the run when more than this fraction of a batch's episodes fail "
                                  "(raise, time out or return a malformed result)", extension=True, ge=0,
                                  le=1, on_resume="adjustable")


@dataclass
class EvalConfig:
    """Evaluation."""

    dataset: str | None = opt(None, "evaluation dataset path(s)")
    split: str = opt("train", "evaluation split", inert=EVAL_OFF)
    steps: int = opt(-1, "evaluate every N steps and after the last one (-1: only after the last one); ppo "
                     "also evaluates the starting model (step 0) unless --ckpt.best_metric_key none",
                     check=lambda v: v == -1 or v >= 1, inert=EVAL_OFF,
                     message="must be -1 (only the last step; ppo also evaluates step 0, the starting model, "
                             "unless --ckpt.best_metric_key none) or >= 1")


@dataclass
class PPOEvalConfig(EvalConfig):
    """Evaluation rollouts (PPO)."""

    temperature: float = opt(0.6, "sampling temperature of evaluation rollouts", ge=0, inert=EVAL_OFF)
    n_samples_per_prompt: int = opt(4, "samples per evaluation prompt", ge=1, inert=EVAL_OFF)


@dataclass
class CkptConfig:
    """Checkpoints and the final model."""

    output_dir: str = opt("./ckpt", "where the final Hugging Face model (and run files) are written",
                          required="where the final model goes")
    path: str | None = opt(
        None,
        "directory of resumable training checkpoints; unset: <--ckpt.output_dir>/checkpoints "
        "(each run directory holds its own; OpenRLHF: ./ckpt/checkpoints_<trainer>)",
    )
    save_steps: int = opt(-1, "save a checkpoint every N steps (-1: never)", check=lambda v: v == -1
                          or v >= 1, message="must be -1 (never) or >= 1")
    save_hf: bool = opt(False, "also export a Hugging Face model with every checkpoint, to "
                         "<--ckpt.path>/global_step<N>_hf (never rotated)", inert=SAVES_OFF)
    disable_ds: bool = opt(False, "skip resumable checkpoints (progress cannot be resumed)")
    max_num: int = opt(3, "checkpoints kept (rotation deletes those without an eval metric first, then the "
                       "worst metric, then the oldest)", ge=1, inert=SAVES_OFF)
    max_mem: float = opt(1e8, "max total size of kept checkpoints in GB", gt=0, note="(GB)", inert=SAVES_OFF)
    load_enable: bool = opt(False, "resume from the newest checkpoint in --ckpt.path if there is one")
    overwrite: bool = opt(False, "write into a --ckpt.output_dir holding a finished run (its saved "
                          "model or summary.json; nothing is deleted); without it such a folder is refused",
                          extension=True, on_resume="volatile")


@dataclass
class PPOCkptConfig(CkptConfig):
    """Checkpoints and the final model (PPO)."""

    best_metric_key: str = opt(
        "", "eval metric (higher is better) that ranks checkpoints and picks the best one ('' auto: the "
        "first pass1 metric; 'none': off)", inert=EVAL_OFF
    )
    save_merged: bool = opt(
        False, "with LoRA, also write the merged weights (base + adapter) into merged/ next to each adapter "
        "export (the final model and --ckpt.save_hf)", extension=True, on_resume="adjustable",
        inert=Inert("LoRA is off (--ds.lora.rank 0): the exports already hold full weights",
                    lambda v, c, dev: c.ds.lora.rank <= 0))


@dataclass
class WandbConfig:
    """Weights & Biases logging (on when --logger.wandb.key is set)."""

    key: str | None = opt(None, "W&B API key, or True to use a prior `wandb login`")
    org: str | None = opt(None, "W&B entity", inert=WANDB_OFF)
    group: str | None = opt(None, "W&B group", inert=WANDB_OFF)
    project: str = opt("posttrain", "W&B project", inert=WANDB_OFF)
    run_name: str | None = opt(None, "W&B run name; default <trainer>_<MMDDTHH:MM>", inert=WANDB_OFF)


@dataclass
class LoggerConfig:
    """Logging (metrics.jsonl is always written to the run directory)."""

    logging_steps: int = opt(1, "log every N steps", ge=1)
    tensorboard_dir: str | None = opt(None, "TensorBoard folder; a run logs to <dir>/<run name> "
                                            "(--logger.wandb.run_name)")
    wandb: WandbConfig = section(WandbConfig)


# --------------------------------------------------------------------------- optimizer
LR_NOTE = "(a learning rate cannot be negative)"
# facts of the schedule flags, read in the flag's own optimizer section (flat, --actor.* or --critic.*)
NO_WARMUP = Inert("the constant schedule has no warm-up (constant_with_warmup has one)",
                  in_section(lambda v, sec, dev, at: sec.lr_scheduler == "constant"))
WARMUP_STEPS_SET = Inert("the warm-up length comes from ", in_section(
    lambda v, sec, dev, at: sec.lr_warmup_steps is not None and f"--{at}lr_warmup_steps "
                                                                f"{sec.lr_warmup_steps}"))
NO_FLOOR = Inert("the schedule has no floor: ", in_section(
    lambda v, sec, dev, at: sec.lr_scheduler not in MIN_LR_SCHEDULERS and (
        f"--{at}lr_scheduler {sec.lr_scheduler} (only {', '.join(MIN_LR_SCHEDULERS[:-1])} and "
        f"{MIN_LR_SCHEDULERS[-1]} end at one)")))
MUON_OFF = Inert("the Muon group exists only under ", in_section(
    lambda v, sec, dev, at: sec.optim != "muon" and f"--{at}optim muon (here {sec.optim})", up=1))


@dataclass
class AdamConfig:
    """AdamW; with --optim muon it drives the auxiliary Adam group (embeddings, head, 1-D params)."""

    lr: float = opt(5e-6, "learning rate", ge=0, finite=True, note=LR_NOTE)
    betas: list[float] = opt([0.9, 0.95], "Adam beta1 beta2", nargs=2, ge=0, lt=1,
                             message="each beta must be in [0, 1)")
    eps: float = opt(1e-8, "Adam epsilon", gt=0)
    weight_decay: float = opt(0.0, "decoupled weight decay (also applied to the Muon group)", ge=0)


@dataclass
class MuonConfig:
    """Muon for 2-D hidden weight matrices (with --optim muon)."""

    lr: float = opt(0.02, "learning rate of the Muon group", ge=0, finite=True, note=LR_NOTE)
    momentum: float = opt(0.95, "Muon momentum", ge=0, lt=1)
    ns_steps: int = opt(5, "Newton-Schulz iterations", ge=1)
    nesterov: bool = opt(True, "Nesterov momentum (--muon.no_nesterov turns it off)", negation="no_nesterov")


@dataclass
class OptimizerFields:
    """Optimizer, LR schedule and gradient clipping (flat in SFT/RM/DPO, per entity in PPO)."""

    optim: str = opt("adam", "optimizer", choices=OPTIMIZERS)
    adam: AdamConfig = section(AdamConfig)
    muon: MuonConfig = section(MuonConfig, inert=MUON_OFF)
    lr_scheduler: str = opt("cosine_with_min_lr", "learning-rate schedule (transformers' names; formulas in "
                                                  "docs)",
                            choices=LR_SCHEDULERS, check=lambda v: METRIC_LR_SCHEDULERS.get(v, True))
    lr_warmup_ratio: float = opt(0.03, "fraction of the steps spent in warm-up: ceil(steps x ratio) steps",
                                 ge=0, le=1, inert=(NO_WARMUP, WARMUP_STEPS_SET))
    lr_warmup_steps: int | None = opt(None, "warm-up length in optimizer steps; set, it replaces "
                                            "--lr_warmup_ratio",
                                      ge=0, extension=True, inert=NO_WARMUP)
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of the peak "
                                   "(" + ", ".join(MIN_LR_SCHEDULERS)
                              + ")", ge=0, le=1, inert=NO_FLOOR)
    max_norm: float = opt(1.0, "gradient clipping norm (0: no clipping)", ge=0, note="(0: no clipping)")
