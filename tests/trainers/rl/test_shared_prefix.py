"""Shared-prefix layout (trainers/rl/batch_layout.py, --ds.shared_prefix, on by default): the samples of a
prompt share one copy of it in every RL forward. Log-probs, entropies, values and the accumulated
gradients equal the per-row (padded) computation to 1e-5, for every layout, mask shape and loss."""
import pytest
import torch
from test_rl_semantics import RecordingEngine, settings

from posttrain.algorithms import gathered_logprobs, token_logprobs
from posttrain.models import load_causal_lm, load_score_model, load_tokenizer
from posttrain.rollout.single_turn import Rollout
from posttrain.trainers.rl.batch_forward import Batching, policy_forward, value_forward
from posttrain.trainers.rl.batch_layout import build_layout
from posttrain.trainers.rl.experience import build_experience
from posttrain.trainers.rl.roles import Actor, Critic
from posttrain.trainers.rl.updates import update_actor, update_critic

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

LAYOUTS = [dict(shared=True), dict(shared=True, packed=True), dict(packed=True)]


def grouped_experience(tok, seed=0):
    """3 prompts x 4 samples of varied lengths; the third prompt appears again in a lone row at the end
    (same tokens, not contiguous); a sample with an empty response (no action) and a multi-turn sample
    whose environment tokens are outside its action mask."""
    g = torch.Generator().manual_seed(seed)
    rolls = []
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 9, 3)]
    for k, p in enumerate(prompts):
        for j in range(4):
            o = torch.randint(3, 300, (1 + (3 * j + k) % 6,), generator=g).tolist()
            rolls.append(Rollout(p, o, [-1.0] * len(o), "length", "", ""))
    rolls[5] = Rollout(prompts[1], [], [], "stop", "", "")  # no response: nothing to read
    env = torch.randint(3, 300, (7,), generator=g).tolist()
    rolls[6] = Rollout(prompts[1], env, [-1.0] * 7, "stop", "", "", action_mask=[1, 1, 0, 0, 0, 1, 1])
    rolls.append(Rollout(prompts[2], [11, 12, 13], [-1.0] * 3, "length", "", ""))
    exp = build_experience(rolls, torch.zeros(len(rolls)), tok.pad_token_id)
    exp.advantages = torch.randn(exp.action_mask.shape, generator=g) * exp.action_mask
    exp.old_logp = torch.randn(exp.action_mask.shape, generator=g) * 0.1 * exp.action_mask - 5.0
    exp.values = torch.randn(exp.action_mask.shape, generator=g) * exp.action_mask
    exp.returns = torch.randn(exp.action_mask.shape, generator=g) * exp.action_mask
    return exp


@pytest.fixture(scope="module")
def models(tiny_model_dir, tiny_score_model_dir):
    return (load_causal_lm(tiny_model_dir), load_score_model(tiny_score_model_dir),
            load_tokenizer(tiny_model_dir))


def test_a_group_computes_its_prompt_once(models):
    _, _, tok = models
    exp = grouped_experience(tok)
    real_tokens = int(exp.attention_mask.sum())
    lay = build_layout(exp, shared=True, packed=True)
    # prompts of 5, 9 and 3 tokens shared by 4 samples each (the lone fifth copy of the third prompt joins
    # its group, and the response-less sample keeps its own row): 3*5 + 3*9 + 4*3 tokens saved... minus
    # the +1 column of each prefix that is also the continuation's first scored position
    groups = {5: 4, 9: 3, 3: 5}  # prefix length (prompt) -> members sharing it
    saved = sum(p * (m - 1) for p, m in groups.items())
    assert lay.inputs["input_ids"].shape == (1, real_tokens - saved)
    mask = lay.inputs["attention_mask"][0, 0]
    pos = lay.inputs["position_ids"][0]
    # the first continuation token of every member attends exactly its prompt and itself
    assert int(mask.sum()) < int(torch.ones_like(mask).tril().sum())
    assert pos.max() < exp.sequences.shape[1]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["shared", "shared+packed", "packed"])
def test_outputs_equal_the_padded_computation(models, layout):
    model, critic, tok = models
    exp = grouped_experience(tok)
    mask = exp.action_mask
    lp, ent = policy_forward(model, exp, 0.7, with_entropy=True)
    lp_s, ent_s = policy_forward(model, exp, 0.7, with_entropy=True, **layout)
    torch.testing.assert_close(lp_s * mask, lp * mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_s * mask, ent * mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(value_forward(critic, exp, **layout) * mask, value_forward(critic, exp) * mask,
                               atol=1e-5, rtol=0)
    assert float(mask.sum()) > 30 and bool((lp * mask).abs().sum() > 0)


def test_a_context_parallel_group_of_one_rank_equals_the_packed_computation(tiny_model_dir,
                                                                             tiny_score_model_dir, models,
                                                                             tmp_path):
    """`context`: the row packed, this rank's slice run by `models.forward` over its group with the
    context-parallel attention, the per-token outputs gathered (the group here: one rank, so its slice is the
    row; two ranks run in test_rl_ray.py)."""
    import torch.distributed as dist

    from posttrain.models.context_parallel import register
    from posttrain.models.parallel_groups import ContextGroups

    model, critic, tok = models
    exp = grouped_experience(tok)
    mask = exp.action_mask
    ring, ring_critic = load_causal_lm(tiny_model_dir), load_score_model(tiny_score_model_dir)
    for m in (ring, ring_critic):
        m.set_attn_implementation(register())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        context = ContextGroups(1, 0, dist.group.WORLD, 0, 1, head_stride=1)
        lp, ent = policy_forward(model, exp, 0.7, with_entropy=True, packed=True)
        lp_c, ent_c = policy_forward(ring, exp, 0.7, with_entropy=True, context=context)
        values = value_forward(critic, exp, packed=True)
        values_c = value_forward(ring_critic, exp, context=context)
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(lp_c * mask, lp * mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_c * mask, ent * mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(values_c * mask, values * mask, atol=1e-5, rtol=0)
    assert bool((values * mask).abs().sum() > 0)


def test_only_read_columns_are_computed(models):
    """The LM head runs at the read positions only: a padded batch of one long prompt and a 2-token
    response computes 2 columns of logits, not T."""
    model, _, tok = models
    rolls = [Rollout(list(range(3, 40)), [5, 6], [-1.0, -1.0], "length", "", "")]
    exp = build_experience(rolls, torch.zeros(1), tok.pad_token_id)
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    try:
        policy_forward(model, exp, 1.0)
    finally:
        hook.remove()
    assert seen == [torch.Size([1, 2, model.config.vocab_size])]


def _grads(model_dir, loader, exp, fit):
    m = loader(model_dir)
    engine = RecordingEngine(m)
    captured = {}
    engine.step = lambda: captured.update({k: p.grad.clone() for k, p in m.named_parameters()
                                           if p.grad is not None}) or 0.0
    fit(m, engine)
    return captured


@pytest.mark.parametrize("loss_type,agg", [("ppo", "token_mean"), ("gspo", "seq_mean_token_mean"),
                                           ("seq_sum", "seq_mean_token_mean"), ("ppo", "seq_sum_norm"),
                                           ("ppo", "seq_mean_token_sum")])
def test_policy_gradient_equals_the_padded_gradient(tiny_model_dir, models, loss_type, agg):
    """The prompt's gradient accumulates from every sample that shares it: the optimizer step's gradient
    equals the per-row computation (micro-batches of 3 and 5 rows split groups; a KL loss and an entropy
    bonus also read the shared positions)."""
    _, _, tok = models
    exp = grouped_experience(tok)
    exp.ref_logp = exp.old_logp + 0.05

    def fit(batching):
        s = settings(len(exp), batching=batching, policy_loss_type=loss_type, loss_agg=agg, kl_use_loss=True,
                     kl_estimator="k3", entropy_coef=0.01)
        return lambda m, engine: update_actor(Actor(m, engine, 0.7, torch.device("cpu")), exp, s, 0.1, step=0)

    base = _grads(tiny_model_dir, load_causal_lm, exp, fit(Batching(len(exp))))
    for batching in (Batching(5, shared_prefix=True), Batching(3, packed=True, shared_prefix=True),
                     Batching(1, max_tokens=40, shared_prefix=True)):
        other = _grads(tiny_model_dir, load_causal_lm, exp, fit(batching))
        assert other.keys() == base.keys()
        for k in base:
            torch.testing.assert_close(other[k], base[k], atol=1e-5, rtol=1e-4)


def test_critic_gradient_equals_the_padded_gradient(tiny_score_model_dir, models):
    _, _, tok = models
    exp = grouped_experience(tok)

    def fit(batching):
        s = settings(len(exp), batching=batching, value_clip=0.2)
        return lambda m, engine: update_critic(Critic(m, engine, torch.device("cpu")), exp, s, step=0)

    base = _grads(tiny_score_model_dir, load_score_model, exp, fit(Batching(len(exp))))
    other = _grads(tiny_score_model_dir, load_score_model, exp, fit(Batching(4, shared_prefix=True)))
    for k in base:
        torch.testing.assert_close(other[k], base[k], atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """A tiny Qwen3-MoE policy and critic (`init-tiny --moe`, `--head score`)."""
    from posttrain.models import build_tiny

    root = tmp_path_factory.mktemp("moe-shared")
    for head in ("lm", "score"):
        build_tiny(root / head, arch="qwen3_moe", size="nano", head=head, seed=2, verbose=False)
    return str(root / "lm"), str(root / "score")


@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=["shared", "shared+packed", "packed"])
def test_router_loss_equals_the_padded_one(moe_dirs, models, layout, role):
    """MoE router loss (--actor.aux_loss_coef) of the actor and the critic: the logged aux_loss and the step's
    gradient equal the per-row padded computation's (a shared prompt counts once per sample, padding never),
    with micro-batches of 6 rows that split the prompts' groups. The step's rows come in experience order, so
    both layouts' micro-batches hold the same rows (the router loss is a mean per micro-batch)."""
    from posttrain.models.moe import track_router_loss

    _, _, tok = models
    exp = grouped_experience(tok)
    model_dir = moe_dirs[role == "critic"]
    loader = load_score_model if role == "critic" else load_causal_lm
    rows, logged = [list(range(len(exp)))], []

    def fit(batching):
        s = settings(len(exp), batching=batching, router_loss_coef=0.5)

        def run(m, engine):
            track_router_loss(m)
            if role == "critic":
                critic = Critic(m, engine, torch.device("cpu"))
                logged.append(update_critic(critic, exp, s, 0, step_rows=rows))
            else:
                logged.append(update_actor(Actor(m, engine, 0.7, torch.device("cpu")), exp, s, 0.1, 0,
                                           step_rows=rows))
        return run

    base = _grads(model_dir, loader, exp, fit(Batching(6)))
    other = _grads(model_dir, loader, exp, fit(Batching(6, packed=layout.get("packed", False),
                                                        shared_prefix=layout.get("shared", False))))
    assert logged[0][f"{role}/aux_loss"] > 1.0
    assert logged[1][f"{role}/aux_loss"] == pytest.approx(logged[0][f"{role}/aux_loss"], rel=1e-5)
    assert other.keys() == base.keys()
    for k in base:
        torch.testing.assert_close(other[k], base[k], atol=1e-5, rtol=1e-4, msg=lambda m: f"{k}: {m}")


def test_moe_training_step_equals_the_unshared_one(moe_dirs, tmp_path):
    """`posttrain ppo` with a MoE actor and --actor.aux_loss_coef: one step with the shared prefix (default)
    and with --ds.no_shared_prefix logs the same router loss, gradient norm and policy loss (one micro-batch
    per step, so both hold the same rows)."""
    from posttrain.cli import train_ppo_ray
    from posttrain.data.synthetic import make_arithmetic_rows, write_jsonl
    from posttrain.utils.metrics import read_metrics

    write_jsonl(make_arithmetic_rows(8, seed=11, difficulty=0), tmp_path / "data" / "train.jsonl")
    reward = tmp_path / "varied.py"
    reward.write_text("import torch\n\ndef reward_func(queries, prompts, labels, **kwargs):\n"
                      "    return {'rewards': torch.tensor([len(set(q[len(p):])) / 8 for q, p in "
                      "zip(queries, prompts)])}\n")

    def run(name, *extra):
        train_ppo_ray.main([
            "--actor.model_name_or_path", moe_dirs[0], "--data.prompt_dataset", str(tmp_path / "data"),
            "--data.input_key", "prompt", "--data.apply_chat_template", "--data.max_len", "48",
            "--reward.remote_url", str(reward), "--rollout.batch_size", "4",
            "--rollout.n_samples_per_prompt", "4", "--rollout.max_new_tokens", "4",
            "--rollout.micro_batch_size", "16", "--train.batch_size", "16", "--train.micro_batch_size", "16",
            "--data.max_samples", "4", "--actor.aux_loss_coef", "0.01",
            "--ckpt.output_dir", str(tmp_path / name), *extra])
        (metrics,) = read_metrics(tmp_path / name / "metrics.jsonl")
        return metrics

    shared, plain = run("shared"), run("plain", "--ds.no_shared_prefix")
    assert plain["actor/aux_loss"] > 1.0
    for k in ("actor/aux_loss", "actor/grad_norm", "actor/policy_loss"):
        assert shared[k] == pytest.approx(plain[k], rel=1e-5, abs=1e-6), k


def test_gathered_logprobs_equal_token_logprobs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 11, generator=g) * 3
    index = torch.tensor([0, 0, 2, 3, 3])
    labels = torch.tensor([1, 7, 0, 10, 10])
    expected = token_logprobs(logits[index], labels, 0.6)
    torch.testing.assert_close(gathered_logprobs(logits, index, labels, 0.6), expected)
    # hand-computed: log softmax([0, ln 3])[1] = ln(3/4)
    two = torch.tensor([[0.0, float(torch.log(torch.tensor(3.0)))]])
    assert (float(gathered_logprobs(two, torch.tensor([0]), torch.tensor([1])))
            == pytest.approx(-0.2876821, abs=1e-6))
    with pytest.raises(ValueError, match="token ids in"):
        gathered_logprobs(logits, index, labels + 5)


@pytest.mark.parametrize("layout", [dict()] + LAYOUTS, ids=["padded", "shared", "shared+packed", "packed"])
def test_log_probs_in_row_chunks_equal_the_whole_logits(models, layout, monkeypatch):
    """models.forward_logprobs with a budget of 3 rows of logits per chunk: values and gradients equal."""
    import posttrain.models.forward as fwd

    model, _, tok = models
    exp = grouped_experience(tok)
    mask = exp.action_mask

    def run():
        model.zero_grad(set_to_none=True)
        lp, _ = policy_forward(model, exp, 0.7, **layout)
        (lp * mask * exp.advantages).sum().backward()
        return lp * mask, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    whole, whole_grads = run()
    monkeypatch.setattr(fwd, "LOGITS_CHUNK_BYTES", 3 * model.config.vocab_size * 4)
    chunked, chunked_grads = run()
    assert fwd._chunking_ok.get(model) is True  # the chunked path ran (its first-call check passed)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=0)
    assert chunked_grads.keys() == whole_grads.keys()
    for name, g in whole_grads.items():
        scale = max(1.0, float(g.abs().max()))  # float rounding: another summation order over the chunks
        torch.testing.assert_close(chunked_grads[name], g, atol=1e-5 * scale, rtol=1e-5)



@pytest.mark.parametrize("estimator",
                         ["gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo"])
def test_training_step_equals_the_unshared_one(run_ppo, estimator):
    """One RL step (two passes over the rollout, so the old log-probs are a forward of their own, a
    reference model and a KL penalty in the reward, the critic for GAE) with the shared prefix (default)
    and with --ds.no_shared_prefix: every logged loss, gradient norm, KL and advantage agrees to 1e-5."""
    from posttrain.utils.metrics import read_metrics

    flags = ["--algo.advantage.estimator", estimator, "--data.max_samples", "8", "--train.max_epochs", "2",
             "--train.batch_size", "16", "--train.micro_batch_size", "8", "--algo.kl.init_coef", "0.05"]
    shared, _ = run_ppo(*flags, name="shared")
    plain, _ = run_ppo(*flags, "--ds.no_shared_prefix", name="plain")
    a, b = read_metrics(shared / "metrics.jsonl"), read_metrics(plain / "metrics.jsonl")
    assert len(a) == len(b) == 1
    keys = [k for k in b[0] if isinstance(b[0][k], float) and not k.startswith("timing/")
            and k not in ("time", "elapsed") and "per_sec" not in k]
    assert {"actor/policy_loss", "actor/grad_norm", "kl/mean"} <= set(keys)
    if estimator == "gae":
        assert "critic/value_loss" in keys
    for k in keys:
        assert a[0][k] == pytest.approx(b[0][k], rel=1e-5, abs=1e-5), k
