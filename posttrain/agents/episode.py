"""What an agent executor sees of the rollout engine: vLLM-shaped sampling parameters and request
outputs, so an executor written for OpenRLHF (which calls vLLM's `AsyncLLMEngine`) runs unchanged.

`EpisodeEngine(front, tokenizer, seed, image_limits)` serves one episode: its k-th `await generate(token_ids,
sampling_params)` samples one continuation through the shared `AsyncRolloutEngine` with seed
`rank_seed(seed, 0, k)`, so an episode's samples depend only on its own seed and history, never on the
other episodes running at the same time. `image_limits` (`data.images.ImageLimits`, the run's --data image
flags; None: the defaults) bound the images posttrain's executors decode in the episode."""
from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.rollout.types import PromptImages, SamplingParams, rank_seed


@dataclass
class Logprob:
    """vLLM's `Logprob`: the sampled token's log-prob (temperature-scaled, the trainer's contract)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finish_reason: str
    cumulative_logprob: float = 0.0
    stop_reason: object = None


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


@dataclass
class AgentSamplingParams:
    """The vLLM `SamplingParams` fields an agent reads or sets. `max_tokens` None: the episode's
    remaining budget. Top-k sampling and `n > 1` within an episode are not available.

    Stop ids follow vLLM: `stop_token_ids` are added to the EOS ids unless `ignore_eos`, in which case
    exactly they stop a turn (`[]`: only the budget). posttrain gives an executor the run's
    `--rollout.stop_token_ids` with `ignore_eos=True`, so they replace the EOS in agent turns as in
    single-turn runs. `min_tokens` (1 as OpenRLHF sets it): no stop id before that many tokens."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = None
    min_tokens: int = 1
    n: int = 1
    seed: int | None = None
    logprobs: int | None = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = False
    extra: dict = field(default_factory=dict)

    @classmethod
    def for_run(cls, params: SamplingParams, **fields) -> AgentSamplingParams:
        """An executor's parameters from the run's: temperature, top-p, `min_tokens`, and the run's stop
        ids replacing the EOS (`ignore_eos`) when given."""
        stop = params.stop_token_ids
        return cls(temperature=params.temperature, top_p=params.top_p, min_tokens=params.min_tokens,
                   stop_token_ids=None if stop is None else list(stop), ignore_eos=stop is not None, **fields)

    def to_engine(self, eos_token_ids=None) -> SamplingParams:
        """The engine's parameters: the stop ids as the class docstring says (None: the engine's defaults)."""
        if self.top_k not in (-1, 0, None):
            raise ValueError(f"sampling_params.top_k={self.top_k}: top-k sampling is not available in this "
                             f"version")
        if self.n != 1:
            raise ValueError(f"sampling_params.n={self.n}: an episode samples one continuation per call")
        return SamplingParams(temperature=float(self.temperature), top_p=float(self.top_p),
                              max_new_tokens=max(1, int(self.max_tokens or 1)),
                              stop_token_ids=self._stop_ids(eos_token_ids),
                              min_tokens=int(self.min_tokens or 0))

    def _stop_ids(self, eos_token_ids) -> tuple[int, ...] | None:
        extra = [int(t) for t in self.stop_token_ids or ()]
        if self.ignore_eos:
            return tuple(dict.fromkeys(extra))
        if self.stop_token_ids is None:
            return None
        return tuple(dict.fromkeys([*(eos_token_ids or []), *extra]))


def shown_tokens(tokens: list[int], finish_reason: str) -> list[int]:
    """The tokens of a turn's text, as vLLM's `.text`: a turn that ended on a stop id (EOS or any
    `stop_token_ids`, special or not) leaves it out; `token_ids` and the log-probs keep it."""
    return tokens[:-1] if finish_reason == "stop" and tokens else tokens


class EpisodeEngine:
    def __init__(self, front, tokenizer, seed: int, image_limits=None) -> None:
        self.front, self.tokenizer, self.seed = front, tokenizer, seed
        self.image_limits = image_limits
        self.calls = 0
        self.versions: set[int] = set()  # the weights versions that sampled this episode's tokens

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None, image_inputs=None,
                       **kwargs) -> RequestOutput:
        """vLLM's `generate` shape. A prompt with images (vision-language model): `image_inputs`, the
        processor's tensors of every image in the ids so far (posttrain's `MultiTurnAgentExecutor` passes
        them), and `multi_modal_data={"image": [PIL, ...]}` as vLLM takes it."""
        if multi_modal_data and image_inputs is None:
            raise ValueError("multi_modal_data without image_inputs: posttrain's engines take the "
                             "processor's image tensors beside the images; run the episode with posttrain's "
                             "MultiTurnAgentExecutor (openrlhf.utils.agent), which passes both")
        if not isinstance(sampling_params, AgentSamplingParams):
            raise TypeError(f"sampling_params must be the AgentSamplingParams the executor was given (or a "
                            f"copy), got {type(sampling_params).__name__}")
        if sampling_params.max_tokens is None or sampling_params.max_tokens < 1:
            raise ValueError(f"sampling_params.max_tokens={sampling_params.max_tokens}: set a budget >= 1")
        seed = rank_seed(self.seed, 0, self.calls)
        self.calls += 1
        ids = [int(t) for t in prompt_token_ids]
        eos = getattr(self.front.engine, "eos_token_ids", None)
        images = None
        if image_inputs is not None:
            images = PromptImages(image_inputs, list((multi_modal_data or {}).get("image") or []) or None)
        out = await self.front.generate(ids, sampling_params.to_engine(eos), seed=seed,
                                        max_new_tokens=int(sampling_params.max_tokens),
                                        **({"images": images} if images is not None else {}))
        tokens = list(out.output_token_ids)
        self.versions.update(out.policy_versions or ())
        text = self.tokenizer.decode(shown_tokens(tokens, out.finish_reason),
                                     skip_special_tokens=sampling_params.skip_special_tokens)
        entries = [{t: Logprob(lp, rank=None)} for t, lp in zip(tokens, out.logprobs)]
        completion = CompletionOutput(0, text, tokens, entries, out.finish_reason, float(sum(out.logprobs)))
        return RequestOutput(ids, [completion])
