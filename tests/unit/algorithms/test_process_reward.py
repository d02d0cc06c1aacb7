"""Process-reward-model math (`algorithms.process_reward`) against hand-computed numbers."""
import math

import pytest
import torch

from posttrain.algorithms import placeholder_logits, prm_correct, prm_loss, render_steps, step_scores


def test_render_steps_is_math_shepherds_layout():
    assert render_steps("Q: 1+1+1?\n", ["1+1=2", "2+1=3"], "ки") == "Q: 1+1+1?\n1+1=2 ки\n2+1=3 ки"
    assert render_steps("", ["a"], "<s>", separator="\n\n") == "a <s>"
    with pytest.raises(ValueError, match="placeholder"):
        render_steps("", ["a"], "")


def test_placeholder_logits_picks_the_placeholders_own_position_and_reward_tokens():
    ids = torch.tensor([[5, 9, 7, 9], [9, 1, 2, 3]])
    logits = torch.arange(2 * 4 * 6, dtype=torch.float32).reshape(2, 4, 6)
    got = placeholder_logits(logits, ids, placeholder_id=9, reward_token_ids=[4, 2])
    # placeholders at (0, 1), (0, 3), (1, 0): row-major; columns 4 then 2
    assert got.tolist() == [[10.0, 8.0], [22.0, 20.0], [28.0, 26.0]]
    assert placeholder_logits(logits, ids, 9).shape == (3, 6)
    with pytest.raises(ValueError, match="two reward tokens"):
        placeholder_logits(logits, ids, 9, [4])
    with pytest.raises(ValueError, match="share"):
        placeholder_logits(logits, ids[:, :3], 9)


def test_prm_loss_hard_and_soft_labels_by_hand():
    z = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    log_s = [[2 - math.log(math.exp(2) + 1), -math.log(math.exp(2) + 1)],
             [-math.log(1 + math.e), 1 - math.log(1 + math.e)], [-math.log(2), -math.log(2)]]
    hard = torch.tensor([0, 0, 1])
    want = -(log_s[0][0] + log_s[1][0] + log_s[2][1]) / 3
    assert prm_loss(z, hard).item() == pytest.approx(want, abs=1e-6)
    assert prm_loss(z, hard, num_steps=6).item() == pytest.approx(want / 2, abs=1e-6)  # the step's count
    soft = torch.tensor([1.0, 0.25, 0.5])
    want = -(log_s[0][0] + 0.25 * log_s[1][0] + 0.75 * log_s[1][1] + 0.5 * (log_s[2][0] + log_s[2][1])) / 3
    assert prm_loss(z, soft).item() == pytest.approx(want, abs=1e-6)
    # torch's soft-target cross entropy (the formula of OpenRLHF's PRMLoss soft branch) is the same number
    ref = torch.nn.functional.cross_entropy(z, torch.stack([soft, 1 - soft], -1))
    assert prm_loss(z, soft).item() == pytest.approx(ref.item(), abs=1e-6)
    assert prm_loss(z[:0], hard[:0]).item() == 0.0


def test_prm_loss_refuses_labels_that_do_not_fit():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="two reward tokens"):
        prm_loss(z, torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        prm_loss(z, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="probabilities"):
        prm_loss(torch.zeros(1, 2), torch.tensor([1.5]))
    with pytest.raises(ValueError, match="1 steps"):
        prm_loss(z, torch.tensor([0]))


def test_accuracy_and_scores():
    z = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert prm_correct(z, torch.tensor([0, 0, 1])).tolist() == [1.0, 0.0, 0.0]
    assert prm_correct(z, torch.tensor([0.9, 0.2, 0.5])).tolist() == [1.0, 1.0, 1.0]
    assert step_scores(z).tolist() == pytest.approx([1 / (1 + math.exp(-2)), 1 / (1 + math.e), 0.5], abs=1e-7)


def test_rendered_steps_gives_each_placeholders_offset():
    from posttrain.algorithms.process_reward import rendered_steps

    text, offsets = rendered_steps("Q\n", ["ab", "c"], "@", "\n\n")
    assert text == "Q\nab @\n\nc @" and [text[o] for o in offsets] == ["@", "@"] and offsets == [5, 10]


@pytest.mark.parametrize("spec, problem", [
    (("@", ["+", "+"]), "two distinct"), (("@", ["+"]), "two distinct"), (("+", ["+", "-"]), "also a reward"),
    (("@", ["+", "-"], ""), "separator is empty")])
def test_a_prm_description_that_cannot_score_names_why(spec, problem):
    from posttrain.models.prm_spec import PRMSpec

    assert problem in PRMSpec(*spec).problem()
    assert PRMSpec("@").problem() is None


def test_a_placeholder_that_merges_after_a_space_is_refused(tiny_model_dir):
    """"How" is one token of the tiny tokenizer, and so is " How": rendered after a step's space the
    placeholder would never be found, so the description is refused at start-up."""
    from posttrain.models import load_tokenizer
    from posttrain.models.prm_spec import PRMSpec
    from posttrain.utils.errors import UserError

    tok = load_tokenizer(tiny_model_dir)
    assert len(tok.encode("How", add_special_tokens=False)) == 1
    with pytest.raises(UserError, match="merges with the text around it"):
        PRMSpec("How").token_ids(tok)
    with pytest.raises(UserError, match="two are the same token"):
        PRMSpec("@", ["+", "+"]).token_ids(tok)
    assert PRMSpec("@").token_ids(tok)[0] == tok.encode("@", add_special_tokens=False)[0]
