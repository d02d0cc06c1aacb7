"""Adapter-only weight sync into a real vLLM engine, in both `lora_sync` modes: after a full sync and an
adapter-only sync of a random adapter, the engine samples from the peft policy (bf16; `adapter` runs
vLLM's LoRA kernels), and the bytes and seconds of a sync are printed."""
import time

import pytest
import torch

PROMPTS = [[5, 6, 7, 8, 9], [14, 15], [20, 21, 22, 23]]
LORA = {"rank": 8, "alpha": 16}


def recomputed(model, prompt, tokens, temperature):
    ids = torch.tensor([prompt + tokens], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens, device=ids.device)[:, None])[:, 0]


def randomise(policy, seed):
    from posttrain.models import lora_sync as ls

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ls.adapter_params(policy).values():
            p.copy_((torch.randn(p.shape, generator=g) * 0.1).to(p))


@pytest.mark.parametrize("mode", ["merged", "adapter"])
def test_adapter_sync_samples_from_the_peft_policy(mode, gpu_model_dir, cuda, tmp_path):
    from posttrain.models import apply_lora, load_causal_lm
    from posttrain.models import lora_sync as ls
    from posttrain.rollout import SamplingParams
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    engine = VLLMRolloutEngine(str(gpu_model_dir), dtype="bfloat16", gpu_memory_utilization=0.2,
                               enforce_eager=True, max_model_len=64, lora=LORA, lora_sync=mode,
                               lora_dir=str(tmp_path))
    policy = apply_lora(load_causal_lm(str(gpu_model_dir), dtype="bf16"), LORA).to(cuda).eval()
    base = load_causal_lm(str(gpu_model_dir), dtype="bf16").to(cuda).eval()
    randomise(policy, 0)
    full = engine.load_weights(policy)  # the first sync: base + adapter
    randomise(policy, 1)
    torch.cuda.synchronize()
    start = time.perf_counter()
    sent = engine.sync_weights(policy)  # adapter only
    torch.cuda.synchronize()
    print(f"\n{mode}: adapter sync {sent} bytes ({100 * sent / full:.2f}% of the full sync) in "
          f"{time.perf_counter() - start:.4f} s")
    assert sent == ls.adapter_bytes(policy) < full / 10
    params = SamplingParams(temperature=1.0, n=2, max_new_tokens=12, seed=5)
    gaps, base_gaps = [], []
    for group, prompt in zip(engine.generate(PROMPTS, params), PROMPTS):
        for o in group:
            got = torch.tensor(o.logprobs, device=cuda)
            gaps.append((got - recomputed(policy, prompt, o.output_token_ids, 1.0)).abs())
            base_gaps.append((got - recomputed(base, prompt, o.output_token_ids, 1.0)).abs())
    gap, base_gap = torch.cat(gaps).mean().item(), torch.cat(base_gaps).mean().item()
    print(f"{mode}: mean |logprob gap| to the peft policy {gap:.4f}, to the base without adapter {base_gap:.4f}")
    assert gap < 2e-2 and gap < base_gap / 3  # the engine samples with the synced adapter, not the base
    if mode == "adapter":
        assert engine.lora_request.lora_int_id == 2  # one request per sync, the first removed
    del engine
    torch.cuda.empty_cache()
