"""Multi-turn episodes of a vision-language policy (agents/agent_api.py): the prompt's images and the
images the environment returns (`environment_images`) get their image tokens in the context, stay out of
the action mask, count against the budget (left out, with their tokens, when they do not fit), and the
trainer's log-probs of every action equal the sampling ones."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from posttrain.agents.agent_api import AgentExecutorBase, AgentInstanceBase, MultiTurnAgentExecutor
from posttrain.agents.multi_turn import AgentRunner
from posttrain.data import PromptDataset
from posttrain.data.synthetic_vision import colour_rows, write_colour_dataset
from posttrain.rollout import HFRolloutEngine, SamplingParams
from posttrain.trainers.rl.batch_forward import policy_forward
from posttrain.trainers.rl.experience import build_experience

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # Qwen-style, as an OpenRLHF VLM agent writes it


def screen(seed: int) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (28, 28, 3), dtype=np.uint8))


class ScreenshotEnv(AgentInstanceBase):
    """Three turns: a screenshot after turn 1, text after turn 2, then the reward (OpenRLHF's VLM agent's
    shape: `environment_images` beside a feedback holding one placeholder per image)."""

    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.turn += 1
        if self.turn == 3:
            return {"rewards": torch.tensor(1.0), "environment_feedback": "<|im_end|>\n", "done": True}
        feedback = "<|im_end|>\n<|im_start|>user\n" + (PLACEHOLDER if self.turn == 1 else "") + \
                   "Again.<|im_end|>\n<|im_start|>assistant\n"
        result = {"rewards": torch.tensor(0.0), "environment_feedback": feedback, "done": False}
        if self.turn == 1:
            result["environment_images"] = [screen(self.turn)]
        return result


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(ScreenshotEnv)


@pytest.fixture(scope="module")
def vlm(tiny_vision_dir):
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.models.vision import load_processor

    tok = load_tokenizer(tiny_vision_dir)
    return load_causal_lm(tiny_vision_dir, "fp32"), tok, load_processor(tiny_vision_dir, tok)


def _episodes(vlm, tmp_path, max_len: int):
    model, tok, processor = vlm
    prompts = PromptDataset(colour_rows(2, seed=0, folder=tmp_path), tok, input_key="prompt",
                            label_key="answer", apply_chat_template=True, processor=processor,
                            max_images=1).prompts
    engine = HFRolloutEngine(model, tok, pad_token_id=tok.pad_token_id)
    runner = AgentRunner(AgentExecutor(), engine, tok, None, max_len=max_len, timeout=60, max_failure_frac=0,
                         turn_cap=4, processor=processor)
    return runner.run(prompts, SamplingParams(max_new_tokens=4, n=2, seed=3)), model, tok


def test_environment_images_join_the_context_outside_the_action_mask(vlm, tmp_path):
    scored, model, tok = _episodes(vlm, tmp_path, max_len=200)
    image_id = model.config.image_token_id
    for r in scored.rollouts:
        sequence = r.prompt_ids + r.output_ids
        assert r.error is None and r.turns == 3
        grid = r.image_inputs["image_grid_thw"]
        assert len(grid) == 2  # the prompt's image and the screenshot, in order
        # every image token has its image
        assert sequence.count(image_id) == int(grid.prod(axis=1).sum()) // 4
        actions = [t for t, m in zip(r.output_ids, r.action_mask) if m]
        assert image_id not in actions and sum(r.action_mask) == len(actions) > 0
        assert r.output_ids.count(image_id) == 4  # the screenshot's tokens: feedback, not actions
    exp = build_experience(scored.rollouts, scored.rewards, tok.pad_token_id)
    with torch.no_grad():
        logp, _ = policy_forward(model, exp, 1.0)
    mask = exp.action_mask.bool()
    torch.testing.assert_close(logp[mask], exp.rollout_logp[mask], rtol=0, atol=1e-5)


def test_an_image_that_does_not_fit_the_budget_is_left_out_with_its_tokens(vlm, tmp_path):
    # room for the prompt and a turn, not the screenshot
    scored, model, _ = _episodes(vlm, tmp_path, max_len=40)
    image_id = model.config.image_token_id
    for r in scored.rollouts:
        assert r.error is None and len(r.prompt_ids) + len(r.output_ids) <= 40
        assert len(r.image_inputs["image_grid_thw"]) == 1  # the prompt's image only
        assert (r.prompt_ids + r.output_ids).count(image_id) == 4


def test_environment_images_with_a_text_model_fail_the_episode(tiny_model_dir):
    from posttrain.models import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    with pytest.raises(ValueError, match="not a vision-language model"):
        MultiTurnAgentExecutor._feedback_ids("x", [screen(0)], None, 10, tok)


class FailingFirstEnv(ScreenshotEnv):
    """The first episode's environment fails at its first step; the others run."""
    failed = False

    async def step(self, states, **kwargs):
        if not FailingFirstEnv.failed:
            FailingFirstEnv.failed = True
            raise RuntimeError("the environment broke")
        return await super().step(states, **kwargs)


def test_a_failed_episode_with_an_image_prompt_keeps_its_images(vlm, tmp_path):
    """A failed episode stays in the batch (zero action mask) with its prompt's image tokens: its row carries
    the prompt's image tensors, so the batch's forward passes still match tokens to images."""
    model, tok, processor = vlm

    class Executor(MultiTurnAgentExecutor):
        def __init__(self):
            super().__init__(FailingFirstEnv)

    prompts = PromptDataset(colour_rows(2, seed=0, folder=tmp_path), tok, input_key="prompt",
                            label_key="answer", apply_chat_template=True, processor=processor,
                            max_images=1).prompts
    engine = HFRolloutEngine(model, tok, pad_token_id=tok.pad_token_id)
    runner = AgentRunner(Executor(), engine, tok, None, max_len=200, timeout=60, max_failure_frac=0.5,
                         turn_cap=4, processor=processor)
    scored = runner.run(prompts, SamplingParams(max_new_tokens=4, n=2, seed=3))
    failed = [r for r in scored.rollouts if r.error is not None]
    assert len(failed) == 1 and failed[0].image_inputs is not None
    exp = build_experience(scored.rollouts, scored.rewards, tok.pad_token_id)
    with torch.no_grad():
        logp, _ = policy_forward(model, exp, 1.0)  # no "image features and image tokens do not match"
    mask = exp.action_mask.bool()
    torch.testing.assert_close(logp[mask], exp.rollout_logp[mask], rtol=0, atol=1e-5)


class RecordingExecutor(AgentExecutorBase):
    """A custom executor (OpenRLHF's contract): records the `images` it is given and the images that reach the
    engine, and runs `MultiTurnAgentExecutor(env)` with them."""

    def __init__(self, env):
        self.inner, self.given, self.sent = MultiTurnAgentExecutor(env), [], []

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine,
                      images=None):
        self.given.append(images)
        recorder = self

        class Engine:
            async def generate(self, ids, params, multi_modal_data=None, **kw):
                recorder.sent += (multi_modal_data or {}).get("image", [])
                return await llm_engine.generate(ids, params, multi_modal_data=multi_modal_data, **kw)

        return await self.inner.execute(prompt, label, sampling_params, max_length, hf_tokenizer, Engine(),
                                        images=images)


def _run(vlm, executor, prompts):
    model, tok, processor = vlm
    runner = AgentRunner(executor, HFRolloutEngine(model, tok, pad_token_id=tok.pad_token_id), tok, None,
                         max_len=200, timeout=60, max_failure_frac=0, turn_cap=4, processor=processor)
    scored = runner.run(prompts, SamplingParams(max_new_tokens=4, n=2, seed=3))
    assert all(r.error is None for r in scored.rollouts)
    return scored


def test_a_custom_executor_gets_the_rows_image_references(vlm, tmp_path, monkeypatch):
    """As in OpenRLHF, `images=` is the row's image column (here a list of paths relative to the data file),
    not decoded images; a relative path the data resolved comes absolute, so it opens from any folder, and
    posttrain's executor decodes it."""
    path = write_colour_dataset(tmp_path / "data", 2, seed=0)
    rows = [{**json.loads(line), "__source__": path, "__row__": i + 1} for i, line in enumerate(open(path))]
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    _, tok, processor = vlm
    prompts = PromptDataset(rows, tok, input_key="prompt", label_key="answer", apply_chat_template=True,
                            processor=processor, max_images=1).prompts
    executor = RecordingExecutor(ScreenshotEnv)
    scored = _run(vlm, executor, prompts)
    expected = [[str(tmp_path / "data" / row["images"][0])] for row in rows]
    assert sorted(executor.given) == sorted(expected * 2)  # two samples per prompt
    assert all(os.path.isfile(p) for refs in executor.given for p in refs)
    assert all(len(r.image_inputs["image_grid_thw"]) == 2 for r in scored.rollouts)  # prompt's, screenshot


def _transparent(img: Image.Image, seed: int) -> Image.Image:
    """`img` with a random alpha band; its transparent pixels keep their colours underneath."""
    out = img.convert("RGBA")
    out.putalpha(Image.fromarray(np.random.RandomState(seed).randint(0, 256, img.size[::-1], dtype=np.uint8)))
    return out


def _on_white(img: Image.Image) -> Image.Image:
    return Image.alpha_composite(Image.new("RGBA", img.size, (255, 255, 255, 255)), img).convert("RGB")


class TransparentScreenshotEnv(ScreenshotEnv):
    white = False

    async def step(self, states, **kwargs):
        result = await super().step(states, **kwargs)
        if "environment_images" in result:
            shot = _transparent(result["environment_images"][0], 1)
            result["environment_images"] = [_on_white(shot) if self.white else shot]
        return result


class WhiteScreenshotEnv(TransparentScreenshotEnv):
    white = True


def test_transparent_images_are_composited_over_white_everywhere(vlm, tmp_path):
    """A transparent prompt image and a transparent screenshot give the episodes (tokens, image tensors) of
    the same images composited on white, and the engine gets them composited: one rule for the data, the
    environment's images and what an engine that takes raw images (vLLM) receives."""
    _, tok, processor = vlm
    runs = []
    for env, white in ((TransparentScreenshotEnv, False), (WhiteScreenshotEnv, True)):
        rows = colour_rows(2, seed=0, folder=tmp_path / env.__name__)
        for row in rows:
            shot = _transparent(Image.open(row["images"][0]), 2)
            (_on_white(shot) if white else shot).save(row["images"][0])
        prompts = PromptDataset(rows, tok, input_key="prompt", label_key="answer", apply_chat_template=True,
                                processor=processor, max_images=1).prompts
        executor = RecordingExecutor(env)
        runs.append((_run(vlm, executor, prompts), executor.sent))
    (transparent, sent), (white, _) = runs
    assert sent and all(im.mode == "RGB" for im in sent)
    for a, b in zip(transparent.rollouts, white.rollouts):
        assert a.prompt_ids + a.output_ids == b.prompt_ids + b.output_ids
        assert len(a.image_inputs["image_grid_thw"]) == 2
        assert all(np.array_equal(a.image_inputs[k], b.image_inputs[k]) for k in b.image_inputs)


class FileScreenshotEnv(ScreenshotEnv):
    """The screenshot as a file reference, read by posttrain's executor (`environment_images`)."""
    path = ""

    async def step(self, states, **kwargs):
        result = await super().step(states, **kwargs)
        if "environment_images" in result:
            result["environment_images"] = [FileScreenshotEnv.path]
        return result


def test_the_executor_reads_images_within_the_runs_image_limits(vlm, tmp_path):
    """posttrain's executors decode the environment's image references within --data.max_image_pixels (and
    the other --data image limits), not the built-in defaults: the run's engine handle carries them."""
    from posttrain.config import parse_config

    model, tok, processor = vlm
    screen(1).resize((70, 70)).save(tmp_path / "shot.png")  # 4,900 pixels
    FileScreenshotEnv.path = str(tmp_path / "shot.png")

    class Executor(MultiTurnAgentExecutor):
        def __init__(self):
            super().__init__(FileScreenshotEnv)

    rows = colour_rows(1, seed=0, folder=tmp_path)
    prompts = PromptDataset(rows, tok, input_key="prompt", label_key="answer", apply_chat_template=True,
                            processor=processor, max_images=1).prompts
    errors = {}
    for pixels in ("5000", "4000"):
        cfg = parse_config("ppo", ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p.jsonl",
                                   "--train.agent_func_path", "a.py", "--data.max_len", "200",
                                   "--rollout.max_new_tokens", "4", "--agent.max_failure_frac", "1",
                                   "--data.max_image_pixels", pixels], check=False)
        engine = HFRolloutEngine(model, tok, pad_token_id=tok.pad_token_id)
        runner = AgentRunner.from_config(Executor(), engine, tok, None, cfg, processor=processor)
        scored = runner.run(prompts, SamplingParams(max_new_tokens=4, n=1, seed=3))
        errors[pixels] = scored.rollouts[0].error
    assert errors["5000"] is None  # the flag raised to admit it (as it admits any image the defaults refuse)
    assert "4,900 pixels, more than --data.max_image_pixels 4,000" in errors["4000"]
