"""VLLMRolloutEngine against the real vLLM (its CPU build here, its CUDA build on a GPU: `device`), one engine
per module over the session's nano llama (fp32, prefix caching on): token ids in and out; the log-probs equal
the trainer's recomputation `log_softmax(logits / T)[token]` (also on the first `min_tokens` tokens, where
vLLM's own are those of the distribution with the stop ids banned); per-prompt seeds; `min_tokens`; explicit
stop ids replace the eos; per-prompt budgets; a bucketed weight sync checked against a fresh engine loaded
from the synced weights; sleep / wake_up (a level-2 sleep needs a sync before the next rollout)."""

import pytest
import torch

from posttrain.config.backends import vllm_unavailable

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(vllm_unavailable() is not None, reason=f"real vLLM: {vllm_unavailable()}")]

PROMPTS = [[5, 6, 7, 8, 9], [14, 15], [20, 21, 22, 23]]
# fp32 on both sides: measured max |gap| 9.5e-7 on CPU (oneDNN vs torch matmul order); 1e-5 leaves margin. GPU
# matmuls in fp32 may use TF32 reductions: 1e-3 there.
TOL = {"cpu": 1e-5, "cuda": 1e-3}
ENGINE_KW = dict(dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 * 2**20,
                 gpu_memory_utilization=0.3, enable_sleep_mode=True)


@pytest.fixture(scope="module")
def device():
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def perturbed(model_dir, device="cpu", seed=0):
    """The model of `model_dir` with every weight moved by 0.05 * N(0, 1) (seeded): "the changed HF model"."""
    from posttrain.models import load_causal_lm

    new = load_causal_lm(str(model_dir), dtype="fp32").eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return new.to(device)


@pytest.fixture(scope="module")
def policy_dir(tiny_model_dir, tmp_path_factory):
    """The changed nano llama saved with save_pretrained (+ its tokenizer): the engine loads FRESH from it."""
    from posttrain.models import load_tokenizer

    folder = tmp_path_factory.mktemp("vllm_real") / "policy"
    perturbed(tiny_model_dir).save_pretrained(folder)
    load_tokenizer(str(tiny_model_dir)).save_pretrained(folder)
    return str(folder)


GREEDY = dict(temperature=0.0, n=1, max_new_tokens=10)
SAMPLED = dict(temperature=1.0, n=2, max_new_tokens=10, seed=5)
FRESH = {}  # what the engine sampled right after loading `policy_dir`, before any weight sync


@pytest.fixture(scope="module")
def engine(policy_dir):
    from posttrain.rollout import SamplingParams
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    engine = VLLMRolloutEngine(policy_dir, enable_prefix_caching=True, **ENGINE_KW)
    FRESH.update({k: engine.generate(PROMPTS, SamplingParams(**v)) for k, v in (("greedy", GREEDY),
                                                                                ("sampled", SAMPLED))})
    return engine


@pytest.fixture(scope="module")
def model(policy_dir, device):
    from posttrain.models import load_causal_lm

    return load_causal_lm(policy_dir, dtype="fp32").to(device).eval()


def recomputed(model, prompt, tokens, temperature):
    """The trainer's log-probs of `tokens` after `prompt`: log_softmax(logits / T)[token] (T 1: greedy)."""
    ids = torch.tensor([prompt + tokens], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / (temperature or 1.0)
    target = torch.tensor(tokens, device=ids.device)[:, None]
    return torch.log_softmax(logits, -1).gather(-1, target)[:, 0].tolist()


def check_logprobs(outs, prompts, model, temperature, tol):
    for group, prompt in zip(outs, prompts):
        for o in group:
            assert o.prompt_token_ids == prompt and len(o.logprobs) == len(o.output_token_ids) >= 1
            trainer = recomputed(model, prompt, o.output_token_ids, temperature)
            assert o.logprobs == pytest.approx(trainer, abs=tol)


def tokens(outs):
    return [[o.output_token_ids for o in group] for group in outs]


def flat_logprobs(outs):
    return [lp for group in outs for o in group for lp in o.logprobs]


@pytest.mark.parametrize("temperature", [0.8, 1.0, 0.0])
def test_logprobs_equal_the_trainers_recomputation(engine, model, device, temperature):
    """min_tokens 1 (the default) bans the stop ids at the first token: vLLM's processed log-prob there is
    the banned distribution's (1.4e-3 higher on this model); the engine restores the full one."""
    from posttrain.rollout import SamplingParams

    params = SamplingParams(temperature=temperature, n=2, max_new_tokens=12, seed=3)
    outs = engine.generate(PROMPTS, params)
    check_logprobs(outs, PROMPTS, model, temperature, TOL[device.type])
    assert tokens(engine.generate(PROMPTS, params)) == tokens(outs)  # seeded (and prefix-cached): the same


def test_seeds_per_prompt(engine):
    """The same seeds give the same samples; a prompt's samples depend on its seed only, not on the other
    prompts of the batch; other seeds give other samples."""
    from posttrain.rollout import SamplingParams

    params = SamplingParams(temperature=1.0, n=2, max_new_tokens=10)
    seeds = [11, 2**40 + 7, 13]
    outs = tokens(engine.generate(PROMPTS, params, seeds=seeds))
    assert tokens(engine.generate(PROMPTS, params, seeds=seeds)) == outs
    assert tokens(engine.generate([PROMPTS[1]], params, seeds=[seeds[1]])) == [outs[1]]
    swapped = engine.generate([PROMPTS[2], PROMPTS[1]], params, seeds=[seeds[2], seeds[1]])
    assert tokens(swapped) == outs[:0:-1]
    assert outs[0][0] != outs[0][1]  # the n samples of a prompt differ
    assert tokens(engine.generate(PROMPTS, params, seeds=[12, 3, 14])) != outs


def test_seeded_prompts_beyond_one_steps_token_budget(engine):
    """Seeded prompts whose tokens together pass the engine's per-step budget (vLLM's CPU default: 4096):
    with chunked prefill, the CPU build rewinds a seeded request's CPU generator after a partial prefill and
    fails ("CPU Generator does not use offset"); `apply_cpu_defaults` turns chunked prefill off there. Each
    prompt's samples still depend on its seed only."""
    from posttrain.rollout import SamplingParams

    long = [[5 + (i + j) % 200 for j in range(230)] for i in range(20)]  # 4600 tokens, no shared prefix
    params = SamplingParams(temperature=1.0, n=1, max_new_tokens=3)
    outs = tokens(engine.generate(long, params, seeds=list(range(20))))
    assert tokens(engine.generate([long[7]], params, seeds=[7])) == [outs[7]]


def greedy(engine, prompt, n_tokens, stop=()):
    from posttrain.rollout import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=n_tokens, stop_token_ids=list(stop), min_tokens=0)
    return engine.generate([prompt], params)[0][0]


def test_min_tokens_bans_the_stop_ids_and_keeps_the_full_logprob(engine, model, device):
    """The greedy first token as the stop id: without min_tokens the sample stops there; with min_tokens k no
    stop id is drawn before k tokens, and the recorded log-probs are still the full distribution's (here the
    banned token is the most likely one, so vLLM's own would be far off)."""
    from posttrain.rollout import SamplingParams

    prompt = PROMPTS[0]
    first = greedy(engine, prompt, 1).output_token_ids[0]
    stopped = greedy(engine, prompt, 8, stop=[first])
    assert (stopped.output_token_ids, stopped.finish_reason) == ([first], "stop")
    for temperature, k in ((0.0, 1), (1.0, 3)):
        params = SamplingParams(temperature=temperature, n=2, max_new_tokens=8, seed=1, min_tokens=k,
                                stop_token_ids=[first])
        outs = engine.generate([prompt], params)
        assert all(first not in o.output_token_ids[:k] and len(o.output_token_ids) >= k for o in outs[0])
        check_logprobs(outs, [prompt], model, temperature, TOL[device.type])


def test_explicit_stop_ids_replace_the_eos_and_budgets_are_per_prompt(engine):
    """An engine whose default stop id is a token of a seeded sample stops there; a sample given its own
    stop ids ignores that default and stops at them; `max_new_tokens` per prompt is each prompt's budget."""
    from posttrain.rollout import SamplingParams
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    prompt = PROMPTS[1]
    seeded = dict(temperature=1.0, max_new_tokens=12, seed=9, min_tokens=0)
    run = engine.generate([prompt], SamplingParams(stop_token_ids=[], **seeded))[0][0].output_token_ids
    i = next(i for i in range(2, 12) if run[i] not in run[:i])
    j = next(j for j in range(i + 1, 12) if run[j] not in run[:j])
    with_eos = VLLMRolloutEngine(engine.llm, eos_token_ids=[run[i]])  # the same vLLM, another default
    out = with_eos.generate([prompt], SamplingParams(**seeded))[0][0]
    assert (out.output_token_ids, out.finish_reason) == (run[:i + 1], "stop")
    out = with_eos.generate([prompt], SamplingParams(stop_token_ids=[run[j]], **seeded))[0][0]
    assert (out.output_token_ids, out.finish_reason) == (run[:j + 1], "stop")

    params = SamplingParams(temperature=1.0, n=2, max_new_tokens=9, seed=4, stop_token_ids=[])
    outs = engine.generate(PROMPTS, params, max_new_tokens=[3, 7, 5])
    assert [[len(o.output_token_ids) for o in g] for g in outs] == [[3, 3], [7, 7], [5, 5]]
    assert all(o.finish_reason == "length" for g in outs for o in g)


def test_prefix_caching_gives_the_same_samples(engine, model, device):
    """A prompt longer than a KV block, sampled twice (the second time from the cached prefix) and once with
    the cache skipped: the same tokens and log-probs."""
    from posttrain.rollout import SamplingParams
    from posttrain.rollout.vllm_engine import convert_vllm_outputs

    block = engine.llm.llm_engine.vllm_config.cache_config.block_size
    long = [5 + i % 50 for i in range(block + 9)]
    params = SamplingParams(temperature=1.0, n=2, max_new_tokens=6, seed=2, min_tokens=0)
    if engine.llm.model_config.max_model_len < len(long) + 6:
        pytest.skip(f"a KV block ({block} tokens) does not fit the context")
    first = engine.generate([long], params)
    cached = engine.generate([long], params)
    uncached = engine.vllm_sampling_params(params, 0)
    uncached.skip_reading_prefix_cache = True
    skipped = convert_vllm_outputs([long], engine.llm.generate([{"prompt_token_ids": long}], [uncached],
                                                                use_tqdm=False), 2)
    assert tokens(first) == tokens(cached) == tokens(skipped)
    for outs in (cached, skipped):
        assert flat_logprobs(outs) == pytest.approx(flat_logprobs(first), abs=TOL[device.type])
    check_logprobs(cached, [long], model, 1.0, TOL[device.type])


def sync(engine, model, version):
    """A full weight sync in two buckets of one reload (each layer's weights within the sync)."""
    state = list(model.state_dict().items())
    engine.update_weights(state[:len(state) // 2])
    engine.update_weights(state[len(state) // 2:])
    engine.weights_updated(version)


def test_a_weight_sync_is_checked_against_a_fresh_engine(engine, model, tiny_model_dir, device):
    """Weight sync checked, not assumed: the engine, loaded fresh from the changed model's save_pretrained
    folder, is synced to the original weights (it then samples other tokens, with the original's log-probs)
    and back to the changed model from memory: it then samples exactly what it sampled fresh, greedy and
    seeded."""
    from posttrain.models import load_causal_lm
    from posttrain.rollout import SamplingParams

    original = load_causal_lm(str(tiny_model_dir), dtype="fp32").to(device).eval()
    sync(engine, original, 1)
    assert tokens(engine.generate(PROMPTS, SamplingParams(**GREEDY))) != tokens(FRESH["greedy"])
    outs = engine.generate(PROMPTS, SamplingParams(**SAMPLED))
    check_logprobs(outs, PROMPTS, original, 1.0, TOL[device.type])
    sync(engine, model, 2)
    assert tokens(engine.generate(PROMPTS, SamplingParams(**GREEDY))) == tokens(FRESH["greedy"])
    outs = engine.generate(PROMPTS, SamplingParams(**SAMPLED))
    assert tokens(outs) == tokens(FRESH["sampled"])
    assert flat_logprobs(outs) == pytest.approx(flat_logprobs(FRESH["sampled"]), abs=TOL[device.type])


def test_sleep_and_wake_up(engine, model, device):
    """The engine samples the same after sleep(1) + wake_up; after sleep(2) (weights dropped on a GPU) it
    refuses to sample until weights are synced again, then samples as before. On vLLM's CPU build sleep frees
    nothing (vLLM ignores it there): the resident memory is printed."""
    from posttrain.rollout import SamplingParams

    params = SamplingParams(**GREEDY)
    engine.load_weights(model)
    ref = tokens(engine.generate(PROMPTS, params))
    for level in (1, 2):
        before = rss_mib()
        engine.sleep(level=level)
        print(f"\nsleep(level={level}) on {device.type}: resident {before:.0f} -> {rss_mib():.0f} MiB")
        engine.wake_up()
        if level == 2:
            with pytest.raises(RuntimeError, match="sync the weights"):
                engine.generate(PROMPTS, params)
            engine.load_weights(model)
        assert tokens(engine.generate(PROMPTS, params)) == ref


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))
