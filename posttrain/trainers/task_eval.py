"""Held-out task accuracy by greedy generation: the fraction of prompts whose generated answer
`posttrain.data.synthetic.is_correct` accepts. Used by the demo to report before/after numbers."""
from __future__ import annotations

import torch

from posttrain.data.synthetic import is_correct


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: list[dict], *, max_new_tokens: int = 12, batch_size: int = 64,
                    prompt_key: str = "prompt", answer_key: str = "answer") -> tuple[float, list[dict]]:
    """Return (accuracy, samples) with samples = [{"prompt", "response", "answer", "correct"}]."""
    model.eval()
    samples = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": r[prompt_key]}], tokenize=False,
                                                 add_generation_prompt=True) for r in chunk]
        enc = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        width = max(len(e) for e in enc)
        pad = tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc])  # left padding for generation
        attn = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
        out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
        for r, row_out in zip(chunk, out[:, width:]):
            text = tokenizer.decode(row_out, skip_special_tokens=True)
            ok = is_correct(text, r[answer_key])
            samples.append({"prompt": r[prompt_key], "response": text, "answer": r[answer_key],
                            "correct": ok})
    acc = sum(s["correct"] for s in samples) / max(len(samples), 1)
    return acc, samples


def agent_success(model_dir, rows: list[dict], agent_file: str | None, *, max_len: int = 96,
                  max_new_tokens: int = 12, prompt_key: str = "prompt", answer_key: str = "answer",
                  tool_path: str | None = None, reward_file: str | None = None) -> tuple[float, list[dict]]:
    """Greedy multi-turn episodes of the agent file's executor on `rows` (prompts under the chat
    template), or with `tool_path` of that tool file's episodes (prompts rendered with its tools, scored by
    the reward file `reward_file`): (fraction with reward 1, samples = [{"prompt", "episode", "reward",
    "turns"}])."""
    from posttrain.agents.agent_file import load_agent_executor
    from posttrain.agents.multi_turn import AgentRunner
    from posttrain.agents.tool_env import ToolAgentExecutor, load_tool_file
    from posttrain.data import Prompt
    from posttrain.data.templates import render_chat
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.rewards import make_reward_source
    from posttrain.rollout import SamplingParams
    from posttrain.rollout.engine_builder import make_rollout_engine

    tok = load_tokenizer(str(model_dir))
    engine = make_rollout_engine("hf", load_causal_lm(str(model_dir), dtype="fp32").eval(), tok,
                                 pad_token_id=tok.pad_token_id)
    tools = load_tool_file(tool_path, tok) if tool_path else None
    prompts = []
    for r in rows:
        messages = [{"role": "user", "content": r[prompt_key]}]
        if tools is not None and tools.system_prompt:
            messages.insert(0, {"role": "system", "content": tools.system_prompt})
        text = render_chat(tok, messages, add_generation_prompt=True, tools=tools and tools.schemas)
        prompts.append(Prompt(text=text, token_ids=tok(text, add_special_tokens=False)["input_ids"],
                              label=r[answer_key], source="eval"))
    executor = ToolAgentExecutor(tools) if tools is not None else load_agent_executor(agent_file)
    reward = make_reward_source(reward_file) if reward_file else None
    runner = AgentRunner(executor, engine, tok, reward, max_len=max_len, timeout=60, max_failure_frac=1.0,
                         turn_cap=max_new_tokens)
    batch = runner.run(prompts, SamplingParams(temperature=0.0, n=1, seed=0, max_new_tokens=max_new_tokens))
    samples = [{"prompt": r[prompt_key], "episode": x.response_text, "reward": float(w), "turns": x.turns}
               for r, x, w in zip(rows, batch.rollouts, batch.rewards.tolist())]
    return sum(s["reward"] == 1.0 for s in samples) / max(len(samples), 1), samples


@torch.no_grad()
def colour_accuracy(model_dir, rows: list[dict], *, max_new_tokens: int = 4) -> tuple[float, list[dict]]:
    """Held-out accuracy of a vision-language model on the colour task (`data.synthetic_vision`): greedy
    generation with the images (the HF engine's path), correct when the response's first word is the colour.
    Returns (accuracy, samples) with samples = [{"image", "response", "answer", "correct"}]."""
    import re

    from posttrain.data import PromptDataset
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.models.vision import load_processor
    from posttrain.rollout.engine_builder import make_rollout_engine
    from posttrain.rollout.types import SamplingParams

    tok = load_tokenizer(str(model_dir))
    processor = load_processor(str(model_dir), tok)
    prompts = PromptDataset(rows, tok, input_key="prompt", label_key="answer", apply_chat_template=True,
                            processor=processor, max_images=1).prompts
    engine = make_rollout_engine("hf", load_causal_lm(str(model_dir), dtype="fp32"), tok,
                                 pad_token_id=tok.pad_token_id)
    outputs = engine.generate([p.token_ids for p in prompts],
                              SamplingParams(temperature=0, max_new_tokens=max_new_tokens),
                              images=[p.image_inputs for p in prompts])
    samples = []
    for row, p, (out,) in zip(rows, prompts, outputs):
        text = tok.decode(out.output_token_ids, skip_special_tokens=True)
        words = re.findall(r"[a-z]+", text.lower())
        samples.append({"image": row["images"][0], "response": text, "answer": p.label,
                        "correct": bool(words) and words[0] == p.label})
    return sum(s["correct"] for s in samples) / max(len(samples), 1), samples
