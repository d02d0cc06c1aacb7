"""Turn the clear errors raised below the CLI into one `prog: error:` line and exit code 2, and
the one way a trainer command runs: parse its config, then call its trainer."""
from __future__ import annotations

import importlib
import sys
from contextlib import contextmanager, nullcontext


@contextmanager
def user_errors(prog: str):
    """Any `UserError` (bad flags, data, reward code, checkpoint, run folder) and a missing file
    end in one `prog: error: ...` line on stderr and exit status 2 (or the error's own `exit_code`:
    143 for SIGTERM), without a traceback."""
    from posttrain.utils.errors import UserError

    try:
        yield
    except (UserError, FileNotFoundError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(getattr(e, "exit_code", 2)) from None
    except KeyboardInterrupt:  # Ctrl-C before training started (training turns it into a UserError)
        from posttrain.utils.interrupt import stopping

        stopping()  # the command line: a second Ctrl-C must not cut the line or change the exit status
        print(f"{prog}: error: interrupted before training started", file=sys.stderr)
        raise SystemExit(2) from None


TRAINERS = {"sft": "posttrain.trainers.sft:train_sft", "rm": "posttrain.trainers.rm:train_rm",
            "dpo": "posttrain.trainers.dpo:train_dpo", "ppo": "posttrain.trainers.rl.ppo:train_rl",
            "kd": "posttrain.trainers.kd:train_kd", "kto": "posttrain.trainers.kto:train_kto",
            "prm": "posttrain.trainers.prm:train_prm"}


def run_trainer(trainer: str, argv: list[str] | None, prog: str) -> dict:
    """Parse `argv` as `trainer`'s flags and run it; bad flags or data exit 2 with one line. `argv` None:
    the process's own arguments, i.e. the command line (`command_line`). The trainer module (torch,
    transformers) is imported only after the flags parse, the inputs check (`check_inputs`) and no finished
    run is in the way (`refuse_finished_run`): a user's mistake is reported at once. (The trainer's start,
    `RunStart`, checks these again for callers that do not come through here.) Returns the trainer's final
    metrics."""
    from posttrain.config import parse_config
    from posttrain.trainers.inputs import check_inputs
    from posttrain.trainers.run_folders import refuse_finished_run

    with command_line(argv is None), user_errors(prog):
        cfg = parse_config(trainer, sys.argv[1:] if argv is None else argv)
        check_inputs(cfg)
        refuse_finished_run(cfg)
        module, name = TRAINERS[trainer].split(":")
        return getattr(importlib.import_module(module), name)(cfg)


def command_line(active: bool = True):
    """When `active` (the process runs this command and exits after it): after the first Ctrl-C or SIGTERM
    the run ends with its line and status, a second is ignored, a third exits at once
    (`signals_end_the_process`). Inactive (an in-process caller): a no-op, its handlers come back."""
    from posttrain.utils.interrupt import signals_end_the_process

    return signals_end_the_process() if active else nullcontext()
