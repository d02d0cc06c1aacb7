"""`posttrain dpo --model.loss_type`: each DPO-family parameter is read by some losses only; set away from
its default with another loss it is refused (one line, exit 2), and the reference flags are reported as
having no effect with a reference-free loss."""
from __future__ import annotations

import pytest
from config_args import BASE
from test_validate import problem

from posttrain.config import inert_flags, parse_config
from posttrain.config.roles import DPO_LOSS_TYPES, REFERENCE_FREE_LOSSES

# flag -> (a non-default value, the losses that read it); written out here, not read from the config
READERS = {"beta": ("0.5", ("sigmoid", "ipo", "simpo", "cpo")),
           "label_smoothing": ("0.1", ("sigmoid", "simpo", "cpo")),
           "nll_loss_coef": ("0.5", ("sigmoid", "ipo", "simpo")),
           "orpo_lambda": ("0.5", ("orpo",)), "simpo_gamma": ("1.0", ("simpo",)),
           "cpo_alpha": ("0.5", ("cpo",))}
NAMES = {"sigmoid": "DPO", "ipo": "IPO", "orpo": "ORPO", "simpo": "SimPO", "cpo": "CPO"}


def dpo(*extra: str):
    return parse_config("dpo", BASE["dpo"] + list(extra), device="cpu")


def test_the_default_is_dpo_and_ipo_enable_is_loss_type_ipo():
    assert dpo().model.preference_loss() == "sigmoid"
    assert dpo("--model.ipo_enable").model.preference_loss() == "ipo"
    assert dpo("--model.loss_type", "ipo").model.preference_loss() == "ipo"
    assert dpo("--model.loss_type", "ipo", "--model.ipo_enable").model.preference_loss() == "ipo"
    assert set(DPO_LOSS_TYPES) == set(NAMES) and set(REFERENCE_FREE_LOSSES) == {"orpo", "simpo", "cpo"}


@pytest.mark.parametrize("flag, loss", [(f, lt) for f, (_, readers) in READERS.items() for lt in NAMES
                                        if lt not in readers])
def test_a_parameter_is_refused_with_a_loss_that_does_not_read_it(flag, loss):
    value = READERS[flag][0]
    line = problem("dpo", "--model.loss_type", loss, f"--model.{flag}", value)
    assert line.startswith(f"--model.{flag} {value} is ") and "\n" not in line
    assert f"; {NAMES[loss]} (--model.loss_type {loss}) does not use it" in line
    assert line.endswith("Drop one of the two flags.")


@pytest.mark.parametrize("flag, loss", [(f, lt) for f, (_, readers) in READERS.items() for lt in readers])
def test_a_parameter_is_accepted_with_the_losses_that_read_it(flag, loss):
    cfg = dpo("--model.loss_type", loss, f"--model.{flag}", READERS[flag][0])
    assert getattr(cfg.model, flag) == float(READERS[flag][0])


def test_the_refusals_name_the_losss_own_knob():
    assert problem("dpo", "--model.loss_type", "orpo", "--model.beta", "0.5") == (
        "--model.beta 0.5 is the reward scale of sigmoid / ipo / simpo / cpo; ORPO (--model.loss_type orpo) "
        "does not use it (its weight is --model.orpo_lambda). Drop one of the two flags.")
    assert problem("dpo", "--model.loss_type", "cpo", "--model.nll_loss_coef", "0.5") == (
        "--model.nll_loss_coef 0.5 is the NLL weight of sigmoid / ipo / simpo; CPO (--model.loss_type cpo) "
        "does not use it (its NLL weight is --model.cpo_alpha). Drop one of the two flags.")
    orpo_nll = problem("dpo", "--model.loss_type", "orpo", "--model.nll_loss_coef", "1")
    assert "ORPO (--model.loss_type orpo) does not use it (its NLL weight is 1)" in orpo_nll
    assert problem("dpo", "--model.ipo_enable", "--model.simpo_gamma", "1") == (
        "--model.simpo_gamma 1.0 is SimPO's; IPO (--model.ipo_enable) does not use it. Drop one of the two "
        "flags.")


@pytest.mark.parametrize("loss", ["orpo", "simpo", "cpo"])
def test_ipo_enable_with_another_loss_type_is_refused(loss):
    assert problem("dpo", "--model.ipo_enable", "--model.loss_type", loss) == (
        f"--model.ipo_enable selects IPO; --model.loss_type {loss} selects {NAMES[loss]}. Drop one of the "
        "two flags.")


def test_the_cli_exits_2_before_anything_loads(capsys):
    from posttrain.cli.main import main

    with pytest.raises(SystemExit) as exit_info:  # the model path does not exist
        main(["dpo", *BASE["dpo"], "--model.loss_type", "simpo", "--model.cpo_alpha", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--model.cpo_alpha 2.0 is CPO's; SimPO (--model.loss_type simpo) does not use it" in err


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "orpo", "simpo", "cpo"])
def test_reference_flags_are_reported_with_a_reference_free_loss(loss):
    notes = inert_flags(dpo("--model.loss_type", loss, "--ref.model_name_or_path", "other"), "cpu")
    ref_notes = [n for n in notes if n.startswith("--ref.model_name_or_path")]
    if loss in ("orpo", "simpo", "cpo"):
        assert ref_notes == ["--ref.model_name_or_path other has no effect here: no reference model is "
                             f"loaded for a reference-free loss: --model.loss_type {loss}"]
    else:
        assert ref_notes == []
