"""Per-model sections: `model` (SFT / RM / DPO) and the PPO roles `actor`, `critic`, `ref`, `reward`, plus
the PPO algorithm section `algo` (`algo.advantage`, `algo.kl`). Estimator, KL and loss names are the
ones of docs/algorithms.md."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config import facts
from posttrain.config.facts import REF_IN_ACTOR, Inert, needs
from posttrain.config.sections import OptimizerFields
from posttrain.config.spec import opt, section

ESTIMATORS = ("gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo")
GROUP_ESTIMATORS = ("rloo", "reinforce_baseline", "group_norm", "dr_grpo")
KL_ESTIMATORS = ("k1", "k2", "k3")
# the names TRL / verl / OpenRLHF users bring for our estimators (lower case, `_` for `-`)
ESTIMATOR_ALIASES = {"grpo": "group_norm", "ppo": "gae", "reinforce++": "reinforce",
                     "reinforcepp": "reinforce", "reinforce_plus_plus": "reinforce",
                     "reinforce++_baseline": "reinforce_baseline",
                     "reinforce_plus_plus_baseline": "reinforce_baseline", "drgrpo": "dr_grpo",
                     "dr_grpo": "dr_grpo", "rloo": "rloo", "group_norm": "group_norm",
                     "reinforce_baseline": "reinforce_baseline"}
IS_CORRECTION_TYPES = ("tis", "icepop", "seq-mask-tis")
POLICY_LOSS_TYPES = ("ppo", "gspo", "seq_sum")
SEQUENCE_POLICY_LOSSES = ("gspo", "seq_sum")  # per-sequence ratio: aggregated per sequence (auto loss_agg)
WHITEN_LEVELS = ("token", "sequence")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_sum_norm")
RM_LOSS_TYPES = ("sigmoid", "logexp")
KD_LOSSES = ("forward", "reverse", "jsd")  # algorithms.distillation.KD_LOSSES
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")  # algorithms.preference.KTO_LOSS_TYPES
# `posttrain dpo --model.loss_type` (TRL's names); the last three train without a reference model
DPO_LOSS_TYPES = ("sigmoid", "ipo", "orpo", "simpo", "cpo")
REFERENCE_FREE_LOSSES = ("orpo", "simpo", "cpo")
# the --model.* parameters of the DPO family -> the losses that read them (any other refuses a set value)
DPO_LOSS_PARAMS = {"beta": ("sigmoid", "ipo", "simpo", "cpo"), "label_smoothing": ("sigmoid", "simpo", "cpo"),
                   "nll_loss_coef": ("sigmoid", "ipo", "simpo"), "orpo_lambda": ("orpo",),
                   "simpo_gamma": ("simpo",), "cpo_alpha": ("cpo",)}


def reward_endpoints(value: str) -> list[str]:
    """`--reward.remote_url` as a list of reward sources: [one .py file], [one http(s) URL] or several
    http(s) URLs given comma-separated (spaces around an entry are ignored). Raises ValueError(why)
    for anything else: an entry that is not an http(s):// URL with a host, an empty entry, a .py file
    in a list."""
    from urllib.parse import urlsplit

    text = str(value).strip()
    parts = [p.strip() for p in text.split(",")]

    def is_url(p: str) -> bool:
        return p.startswith(("http://", "https://")) and bool(urlsplit(p).netloc)

    if len(parts) == 1:
        if is_url(text) or (text.endswith(".py") and not text.startswith(("http:", "https:"))):
            return [text]
        raise ValueError("expected an http(s):// URL of a reward server (several comma-separated) or a .py "
                         "file defining reward_func")
    for i, p in enumerate(parts, 1):
        if not is_url(p):
            raise ValueError(f"entry {i} of {len(parts)} ({p!r}) is not an http(s):// URL; a comma-separated "
                             "list holds reward server URLs only")
    return parts


RESERVED_TERM_NAMES = ("mean", "std", "skipped", "zero_std_group_frac", "model", "remote", "prm", "prm_steps",
                       "prm_dropped_steps")


def reward_func_spec(value: str) -> tuple[str, str, str]:
    """One `--reward.func_path` entry as (file, function, term name): `FILE.py` names its `reward_func`,
    term name the file's stem; `FILE.py:NAME` names the function NAME, term name NAME. Raises
    ValueError(why) for an entry that is not a .py file (with an optional `:NAME`)."""
    import os

    text = str(value).strip()
    path, func = text, "reward_func"
    if not text.endswith(".py") and ":" in text:
        path, _, func = text.rpartition(":")
        if not func.isidentifier():
            raise ValueError(f"{func!r} after ':' is not a Python function name")
    if not path.endswith(".py"):
        raise ValueError("expected a .py file defining reward_func, or FILE.py:FUNCTION")
    name = func if func != "reward_func" or path != text else os.path.splitext(os.path.basename(path))[0]
    return path, func, name


REF_ON_CPU = Inert("the reference model is already in CPU memory: this machine has no accelerator, so there "
                   "is nothing to offload to", facts.on_cpu)
REWARD_ON_CPU = Inert("the reward model is already in CPU memory: this machine has no accelerator, so there "
                      "is nothing to offload to", facts.on_cpu)
TEACHER_ON_CPU = Inert("the teacher is already in CPU memory: this machine has no accelerator, so there is "
                       "nothing to offload to", facts.on_cpu)
NO_REFERENCE = Inert(f"no reference model {facts.NO_KL}", facts.no_reference)
NO_CRITIC = Inert("no critic: only --algo.advantage.estimator gae trains one", facts.no_critic)
REMOTE_ONLY = Inert("it applies to --reward.remote_url (a reward server or .py file) and --reward.func_path "
                    "only", lambda v, c, dev: not (c.reward.remote_url or c.reward.func_path))
REFERENCE_FREE = Inert("no reference model is loaded for a reference-free loss: ",
                       lambda v, c, dev: c.model.loss_type in REFERENCE_FREE_LOSSES
                       and f"--model.loss_type {c.model.loss_type}", ("dpo",))
NO_REWARD_MODEL = Inert("no reward model: rewards come from --reward.remote_url", facts.no_reward_model)


# --------------------------------------------------------------------------- single-model trainers
@dataclass
class ModelConfig:
    """The trained model (SFT / RM / DPO)."""

    model_name_or_path: str | None = opt(None, "model folder or Hugging Face hub id (required)",
                                         required="a model folder or hub id")
    gradient_checkpointing_enable: bool = opt(False, "recompute activations in the backward pass",
                                              on_resume="adjustable")
    gradient_checkpointing_reentrant: bool = opt(
        False, "use reentrant gradient checkpointing", on_resume="adjustable",
        inert=needs("--model.gradient_checkpointing_enable", lambda c: c.model.gradient_checkpointing_enable))
    aux_loss_coef: float = opt(0.0, "MoE router load-balancing loss coefficient (logged as aux_loss)", ge=0)


@dataclass
class SFTModelConfig(ModelConfig):
    """The trained model (SFT)."""

    pretrain_mode_enable: bool = opt(False, "next-token loss on the whole sequence, prompt included")


@dataclass
class RMModelConfig(ModelConfig):
    """The reward model being trained."""

    loss_type: str = opt("sigmoid", "pairwise loss", choices=RM_LOSS_TYPES)
    compute_fp32_loss_enable: bool = opt(
        False, "compute the loss in fp32",
        inert=Inert("the reward-model loss is always computed in fp32 (rewards leave the model in float32)"))
    margin_loss_enable: bool = opt(False, "subtract the row's `margin` field inside the sigmoid loss")


@dataclass
class DPOModelConfig(ModelConfig):
    """The policy trained with DPO / IPO / cDPO, or without a reference with ORPO / SimPO / CPO."""

    beta: float = opt(0.1, "DPO temperature beta (SimPO / CPO: the reward scale)", gt=0)
    ipo_enable: bool = opt(False, "IPO loss instead of DPO (= --model.loss_type ipo)")
    label_smoothing: float = opt(0.0, "cDPO label smoothing in [0, 0.5)", ge=0, lt=0.5)
    nll_loss_coef: float = opt(0.0, "weight of an NLL term on the chosen response", ge=0)
    loss_type: str = opt(
        "sigmoid", "preference loss: sigmoid (DPO / cDPO), ipo; without a reference model: orpo (NLL + "
        "odds ratio), simpo (length-normalised, margin), cpo (sigmoid on the policy alone + NLL)",
        choices=DPO_LOSS_TYPES, extension=True)
    orpo_lambda: float = opt(0.1, "ORPO weight of the odds-ratio term (TRL ORPOConfig.beta)", ge=0,
                             finite=True, extension=True)
    simpo_gamma: float = opt(0.5, "SimPO target reward margin gamma", finite=True, extension=True)
    cpo_alpha: float = opt(1.0, "CPO weight of the NLL term on the chosen response", ge=0, finite=True,
                           extension=True)

    def preference_loss(self) -> str:
        """The loss this run trains with: `--model.loss_type`, or ipo with `--model.ipo_enable`."""
        return "ipo" if self.ipo_enable else self.loss_type


@dataclass
class KTOModelConfig(ModelConfig):
    """The policy trained with KTO on unpaired rows."""

    beta: float = opt(0.1, "KTO temperature beta", gt=0)
    desirable_weight: float = opt(1.0, "weight of the loss of a desirable row (label true)", ge=0)
    undesirable_weight: float = opt(1.0, "weight of the loss of an undesirable row (label false)", ge=0)
    loss_type: str = opt("kto", "kto (with the KL estimate) or apo_zero_unpaired (no KL term)",
                         choices=KTO_LOSS_TYPES)


def _reward_tokens_problem(tokens: list[str] | None) -> bool | str:
    """--model.reward_tokens: at least two distinct tokens (the good one first)."""
    if tokens is None:
        return True
    if len(tokens) < 2:
        return "needs at least two tokens, the good one first (e.g. + -); leave it out to train on the " \
               "whole vocabulary"
    return len(set(tokens)) == len(tokens) or "names a token twice"


@dataclass
class PRMModelConfig(ModelConfig):
    """The process reward model: a causal LM whose next-token logits at each step's placeholder, over the
    reward tokens, score the step (docs/prm.md)."""

    placeholder_token: str | None = opt(
        None, "the token that ends each step in the text (one token of the tokenizer; Math-Shepherd: ки)",
        required="the step placeholder token")
    reward_tokens: list[str] | None = opt(
        None, "the label tokens, the good one first (e.g. + -); none: the whole vocabulary (hard labels "
        "only)", nargs="+", check=_reward_tokens_problem)


@dataclass
class DPORefConfig:
    """The frozen reference model (DPO, KTO)."""

    model_name_or_path: str | None = opt(None, "reference model; default: --model.model_name_or_path",
                                         inert=REFERENCE_FREE)
    offload: bool = opt(False, "keep the reference model on CPU between forwards",
                        inert=(REFERENCE_FREE, REF_ON_CPU), on_resume="adjustable")


@dataclass
class KDModelConfig(SFTModelConfig):
    """The student (KD): SFT's model flags and the distillation loss (docs/distillation.md)."""

    kd_coef: float = opt(0.4, "weight of the distillation loss: (1 - c) * NLL + c * KD (OpenRLHF 0.9)",
                         ge=0, le=1)
    kd_loss: str = opt("forward", "divergence to the teacher: forward KL(t||s), reverse KL(s||t) or jsd "
                       "(generalized JSD, --model.kd_beta)", choices=KD_LOSSES, extension=True)
    kd_beta: float = opt(0.5, "generalized JSD mix: 0 = forward KL, 1 = reverse KL (TRL GKD beta)",
                         ge=0, le=1, extension=True,
                         inert=needs("--model.kd_loss jsd", lambda c: c.model.kd_loss == "jsd"))
    kd_temperature: float = opt(1.0, "softmax temperature of both distributions in the distillation loss",
                                gt=0, extension=True)


@dataclass
class KDTeacherConfig:
    """The frozen teacher (KD): same tokenizer and vocabulary as the student."""

    model_name_or_path: str | None = opt(None, "teacher model folder or hub id (required)",
                                         required="the teacher model folder or hub id")
    offload: bool = opt(False, "keep the teacher on CPU between forwards (OpenRLHF --teacher_offload)",
                        inert=TEACHER_ON_CPU,
                        on_resume="adjustable")


# --------------------------------------------------------------------------- PPO roles
IS_CORRECTION_OFF = needs("--algo.advantage.is_correction_enable",
                          lambda c: c.algo.advantage.is_correction_enable)


@dataclass
class _ActorModelFields:
    model_name_or_path: str | None = opt(None, "policy model folder or hub id (required)",
                                         required="the policy model folder or hub id")
    num_nodes: int = opt(1, "Ray nodes for the actor", ge=1, on_resume="adjustable")
    num_gpus_per_node: int = opt(1, "GPUs per node for the actor (OpenRLHF: 8)", ge=1, on_resume="adjustable")
    gradient_checkpointing_enable: bool = opt(False, "recompute activations in the backward pass (actor and "
                                                     "critic)",
                                             on_resume="adjustable")
    gradient_checkpointing_reentrant: bool = opt(
        False, "use reentrant gradient checkpointing (actor and critic)", on_resume="adjustable",
        inert=needs("--actor.gradient_checkpointing_enable", lambda c: c.actor.gradient_checkpointing_enable))
    freeze_visual_encoder: bool = opt(False, "train only the language model of a vision-language model")


@dataclass
class ActorConfig(OptimizerFields, _ActorModelFields):
    """The policy (PPO): model, optimizer and policy-loss knobs."""

    eps_clip: float = opt(0.2, "PPO ratio clip epsilon (both sides)", gt=0)
    eps_clip_low_high: list[float] | None = opt(None, "asymmetric clip: eps_low eps_high", nargs=2, gt=0,
                                                message="both bounds must be > 0")
    dual_clip: float | None = opt(None, "dual-clip constant c > 1 for negative advantages", gt=1)
    policy_loss_type: str = opt(
        "ppo",
        "policy loss: ppo (token ratio), gspo (ratio of the mean log-ratio of a sequence), seq_sum (TRL "
        "RLOO: ratio of the summed log-ratio of a sequence, the whole response's probability ratio)",
        choices=POLICY_LOSS_TYPES,
    )
    entropy_coef: float | None = opt(None, "entropy bonus coefficient (0: log entropy only; unset: off)")
    aux_loss_coef: float = opt(0.0, "MoE router load-balancing loss coefficient (logged as aux_loss)", ge=0)
    loss_agg: str | None = opt(
        None,
        "loss aggregation over tokens and sequences; default auto: seq_mean_token_mean with "
        "--actor.policy_loss_type gspo (as OpenRLHF) or seq_sum, token_mean otherwise",
        choices=LOSS_AGGREGATIONS,
        extension=True,
    )

    def clip_bounds(self) -> tuple[float, float]:
        """(eps_low, eps_high): --actor.eps_clip_low_high if given, else (eps_clip, eps_clip)."""
        if self.eps_clip_low_high is not None:
            return float(self.eps_clip_low_high[0]), float(self.eps_clip_low_high[1])
        return self.eps_clip, self.eps_clip


@dataclass
class _CriticModelFields:
    model_name_or_path: str | None = opt(None, "critic model; default: the reward model (not a "
                                               "--reward.prm), else the actor")
    num_nodes: int = opt(1, "Ray nodes for the critic", ge=1, on_resume="adjustable")
    num_gpus_per_node: int = opt(1, "GPUs per node for the critic (OpenRLHF: 8)", ge=1,
                                 on_resume="adjustable")


@dataclass
class CriticConfig(OptimizerFields, _CriticModelFields):
    """The value model (PPO with the gae estimator): model, optimizer and value-loss knobs."""

    value_clip: float | None = opt(0.5, "value-loss clip range", gt=0, note="(or none)")
    save_value_network: bool = opt(False, "also save the critic at the end", on_resume="adjustable")
    freezing_steps: int = opt(-1, "freeze the actor for the first N steps while the critic warms up")


@dataclass
class RefConfig:
    """The frozen reference policy (PPO, used for the KL term)."""

    model_name_or_path: str | None = opt(None, "reference model; default: the actor's initial weights (with "
                                               "LoRA: "
                                         "the actor's base, adapter disabled)",
                                         inert=NO_REFERENCE)
    num_nodes: int = opt(1, "Ray nodes for the reference model", ge=1, inert=(NO_REFERENCE, REF_IN_ACTOR),
                         on_resume="adjustable")
    num_gpus_per_node: int = opt(1, "GPUs per node for the reference model (OpenRLHF: 8)", ge=1,
                                 inert=(NO_REFERENCE, REF_IN_ACTOR), on_resume="adjustable")
    offload: bool = opt(False, "keep the reference model on CPU between forwards (ZeRO-3 shards: DeepSpeed's "
                        "offload_param)", inert=(NO_REFERENCE, REF_IN_ACTOR, REF_ON_CPU),
                        on_resume="adjustable")


NO_TEACHER = Inert("no teacher: on-policy distillation needs --teacher.model_name_or_path",
                   lambda v, c, dev: not c.teacher.model_name_or_path)


@dataclass
class TeacherConfig:
    """The frozen teacher of on-policy distillation (PPO): every sampled token is scored by it, and the
    per-token reverse KL to it is a reward term (`--algo.teacher_coef`)."""

    model_name_or_path: str | None = opt(None, "teacher model folder or hub id (on-policy distillation); "
                                         "the same tokenizer as the policy", extension=True)
    num_nodes: int = opt(1, "Ray nodes for the teacher", ge=1, inert=NO_TEACHER, on_resume="adjustable",
                         extension=True)
    num_gpus_per_node: int = opt(1, "GPUs per node for the teacher", ge=1, inert=NO_TEACHER,
                                 on_resume="adjustable", extension=True)
    offload: bool = opt(False, "keep the teacher on CPU between forwards (ZeRO-3 shards: DeepSpeed's "
                        "offload_param)", inert=(NO_TEACHER, TEACHER_ON_CPU), on_resume="adjustable",
                        extension=True)


@dataclass
class RewardConfig:
    """Reward source and reward shaping (PPO)."""

    model_name_or_path: str | None = opt(None, "reward model folder or hub id")
    remote_url: str | None = opt(None, "a reward server's http(s):// URL, several comma-separated (each "
                                       "batch is "
                                 "spread over them), or a local .py file defining reward_func")
    func_path: list[str] | None = opt(
        None, "reward function files summed as weighted terms: FILE.py (its reward_func) or "
        "FILE.py:FUNCTION; with --reward.model_name_or_path / --reward.remote_url, that source is one more "
        "term", nargs="+", extension=True)
    func_weights: list[float] | None = opt(
        None, "one weight per --reward.func_path file (default 1 each)", nargs="+", finite=True,
        extension=True,
        inert=needs("--reward.func_path", lambda c: c.reward.func_path))
    model_weight: float = opt(
        1.0, "weight of the reward model's or server's term beside --reward.func_path (of a PRM's token "
        "rewards always)", finite=True,
        extension=True, inert=Inert("it weighs --reward.model_name_or_path / --reward.remote_url against "
                                    "--reward.func_path terms; this run has not both",
                                    lambda v, c, dev: not (c.reward.prm or c.reward.func_path and (
                                        c.reward.model_name_or_path or c.reward.remote_url))))
    prm: bool = opt(
        False, "--reward.model_name_or_path is a process reward model (a causal LM, `posttrain prm`): it "
        "scores each step of a response, and each step's score is a token reward on the step's last token",
        extension=True)
    prm_placeholder_token: str | None = opt(
        None, "the PRM's step-end token (default: prm.json's placeholder_token in the model folder)",
        extension=True, inert=needs("--reward.prm", lambda c: c.reward.prm))
    prm_reward_tokens: list[str] | None = opt(
        None, "the PRM's label tokens, the good one first (default: prm.json's reward_tokens)", nargs="+",
        extension=True, check=lambda v: len(set(v)) == len(v) >= 2,
        message="needs at least two distinct tokens (good first)",
        inert=needs("--reward.prm", lambda c: c.reward.prm))
    prm_step_separator: str | None = opt(
        None, "the text between a response's steps (default: prm.json's step_separator, else a newline)",
        extension=True, check=lambda v: v != "", message="must be non-empty",
        inert=needs("--reward.prm", lambda c: c.reward.prm))
    num_nodes: int = opt(1, "Ray nodes for the reward model", ge=1, inert=NO_REWARD_MODEL,
                         on_resume="adjustable")
    num_gpus_per_node: int = opt(1, "GPUs per node for the reward model (OpenRLHF: 8)", ge=1,
                                 inert=NO_REWARD_MODEL, on_resume="adjustable")
    offload: bool = opt(False, "keep the reward model on CPU between forwards (ZeRO-3 shards: DeepSpeed's "
                        "offload_param)", inert=(NO_REWARD_MODEL, REWARD_ON_CPU), on_resume="adjustable")
    normalize_enable: bool = opt(
        False, "normalise reward-model scores with the mean/std stored in the model",
        inert=Inert("it normalises a reward model's scores (and a critic started from it); there is neither "
                    "--reward.model_name_or_path nor a critic", facts.no_reward_model_nor_critic))
    clip_range: list[float] = opt([-10.0, 10.0], "clip rewards to [low, high]", nargs=2,
                                  check=lambda p: p[0] < p[1], message="needs low < high")
    overlong_buffer_len: float | None = opt(None, "DAPO overlong penalty buffer length (tokens)", gt=0)
    overlong_penalty_factor: float = opt(
        1.0, "DAPO overlong penalty at max length",
        inert=needs("--reward.overlong_buffer_len", lambda c: c.reward.overlong_buffer_len))
    stop_properly_penalty_coef: float | None = opt(
        None, "truncated samples: coef in [0, 1] scales the reward, coef < 0 replaces it",
        check=lambda v: not v > 1, message="must be in [0, 1] (scale) or < 0 (replacement reward)",
    )
    missing_eos_penalty: float | None = opt(
        None, "subtract this from the reward of a sample whose generated tokens contain no EOS (the engine's "
        "default stop ids), first, before any other shaping (TRL missing_eos_penalty)", extension=True,
        ge=0, finite=True, note="(it is subtracted from the reward)",
    )
    batch_normalize_enable: bool = opt(
        False, "normalise the rewards over the rollout batch: (r - mean) / (unbiased std + 1e-8), clamped to "
        "+-batch_normalize_clip, after the reward shaping and before the KL and the baseline (TRL "
        "normalize_reward)", extension=True,
    )
    batch_normalize_clip: float = opt(
        10.0, "clip of --reward.batch_normalize_enable's normalised rewards (TRL reward_clip_range)",
        extension=True, gt=0, finite=True,
        inert=needs("--reward.batch_normalize_enable", lambda c: c.reward.batch_normalize_enable),
    )
    whiten_enable: bool = opt(
        False, "whiten scalar rewards over the batch before the baseline", extension=True
    )
    skip_errors_enable: bool = opt(
        False, "a reward that cannot be computed (reward_func raises or returns a bad value) skips those "
        "samples (counted in reward/skipped) instead of stopping the run", extension=True,
        inert=Inert("it applies to reward functions (--reward.remote_url FILE.py, --reward.func_path) only",
                    lambda v, c, dev: not (str(c.reward.remote_url or "").endswith(".py")
                                           or c.reward.func_path)),
    )
    timeout: float | None = opt(None, "seconds per reward call: an HTTP request (default 30) or one "
                                      "reward_func "
                                "call on a rollout batch (default 300)", extension=True,
                                gt=0, note="seconds (or unset for the default)", inert=REMOTE_ONLY,
                                on_resume="adjustable")
    retries: int = opt(3, "attempts per reward call (HTTP: connection errors, timeouts, 5xx; reward_func: "
                          "raised or timed out)", extension=True, ge=1, note="(attempts in total)",
                       inert=REMOTE_ONLY, on_resume="adjustable")


def _no_std_division(value, c, device) -> bool:
    adv = c.algo.advantage
    return adv.estimator != "group_norm" and (
        (adv.estimator in ("rloo", "dr_grpo") and not adv.whiten_enable) or adv.no_std_norm)


@dataclass
class AdvantageConfig:
    """Advantage estimation."""

    estimator: str = opt("gae", "advantage estimator", choices=ESTIMATORS, aliases=ESTIMATOR_ALIASES)
    gamma: float = opt(1.0, "discount factor in [0, 1]", ge=0, le=1)
    lambd: float = opt(1.0, "GAE lambda in [0, 1]", ge=0, le=1,
                       inert=Inert("only --algo.advantage.estimator gae reads it", facts.no_critic))
    no_std_norm: bool = opt(False, "whiten advantages by the mean only (no division by the std)")
    whiten_enable: bool = opt(
        False, "whiten the final advantages for every estimator", extension=True
    )
    whiten_level: str = opt(
        "token",
        "statistics of --algo.advantage.whiten_enable: token (every action token counts, population std) or "
        "sequence (one value per sequence, unbiased std, / (std + 1e-8): TRL normalize_advantage)",
        choices=WHITEN_LEVELS,
        extension=True,
        inert=needs("--algo.advantage.whiten_enable", lambda c: c.algo.advantage.whiten_enable),
    )
    std_eps: float | None = opt(None, "epsilon of the std division: added to the std by group_norm and "
                                      "sequence-level whitening, the floor of the variance in token-level "
                                      "whitening (unset: 1e-9 for group_norm, 1e-8 for whitening; TRL 1.x: "
                                      "1e-4)",
                                extension=True, gt=0, note="(or unset for the defaults)",
                                inert=Inert("only --algo.advantage.estimator group_norm and the advantage "
                                            "whitening read it", _no_std_division))
    is_correction_enable: bool = opt(False, "importance-sampling correction of rollout/training mismatch")
    is_correction_type: str = opt("tis", "IS correction type", choices=IS_CORRECTION_TYPES,
                                  inert=IS_CORRECTION_OFF)
    is_correction_threshold: list[float] = opt(
        [0.5, 5.0], "IS weight bounds: low high", nargs=2,
        check=lambda p: "needs low < high" if p[0] >= p[1] else p[0] >= 0 or "low must be >= 0",
        inert=IS_CORRECTION_OFF)


@dataclass
class KLConfig:
    """KL penalty towards the reference policy."""

    init_coef: float = opt(0.01, "KL coefficient (0: no reference model)", ge=0)
    target: float | None = opt(None, "target KL; set to use the adaptive controller", gt=0,
                               note="(or unset for a fixed coefficient)")
    horizon: int = opt(10000, "adaptive KL controller horizon", ge=1,
                       inert=needs("--algo.kl.target (the adaptive controller)", lambda c: c.algo.kl.target))
    estimator: str = opt("k1", "KL estimator", choices=KL_ESTIMATORS)
    use_loss: bool = opt(False, "KL as a loss term instead of a reward penalty")
    clamp: float = opt(10.0, "bound of the per-token KL estimate, +-clamp (OpenRLHF); 0: unbounded (TRL)",
                       extension=True, ge=0, note="(0: unbounded)",
                       inert=Inert(f"no KL term {facts.NO_KL}", facts.no_reference))
    sequence_level_enable: bool = opt(
        False,
        "subtract the summed sequence KL from the scalar reward "
        "before the baseline (TRL token_level_kl=False)",
        extension=True,
    )


@dataclass
class AlgoConfig:
    """RL algorithm (PPO family)."""

    advantage: AdvantageConfig = section(AdvantageConfig)
    kl: KLConfig = section(KLConfig)
    dynamic_filtering_enable: bool = opt(False, "drop prompt groups whose mean score is outside the range")
    dynamic_filtering_range: list[float] = opt(
        [0.0, 1.0], "dynamic filtering bounds: low high (exclusive)", nargs=2,
        inert=needs("--algo.dynamic_filtering_enable", lambda c: c.algo.dynamic_filtering_enable),
    )
    teacher_coef: float | None = opt(
        None, "weight c of the on-policy distillation term: r_t += -c * (log pi_old(y_t) - "
        "log pi_teacher(y_t)) on every sampled token (default 1 with --teacher.model_name_or_path)", ge=0,
        finite=True, extension=True)
