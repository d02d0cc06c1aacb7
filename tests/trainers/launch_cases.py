"""Several trainer runs in one launch: `torchrun --nproc_per_node N tests/trainers/launch_cases.py SPEC` runs
the cases of SPEC (a JSON list of {"module", "flags", "port", "log"}) one after another. Each rank imports
torch, transformers, DeepSpeed and the trainers once, then forks one process per case, which forms a
process group of its own (its own port; rank 0 serves the store, as DeepSpeed's launcher has it) and runs
`module.main(flags)`: every case is a fresh multi-rank run, the launch and the imports are paid once. Case
stderr of rank R goes to `log`.rankR, its exit status to `log`.rankR.exit (`sft_helpers.torchrun_cases`)."""
import json
import os
import sys
import traceback
from importlib import import_module

import posttrain.trainers.dpo  # noqa: F401  (the heavy imports, before the forks)
import posttrain.trainers.kd  # noqa: F401
import posttrain.trainers.rm  # noqa: F401
import posttrain.trainers.sft  # noqa: F401
from posttrain.engines.deepspeed_engine import import_deepspeed


def run_case(case: dict, rank: str) -> int:
    """In a forked process: the case's exit status (SystemExit's code; 1 for any other exception)."""
    os.environ.update(MASTER_PORT=str(case["port"]), TORCHELASTIC_USE_AGENT_STORE="False")
    for fd, suffix in ((2, ""), (1, ".out")):
        os.dup2(os.open(f"{case['log']}.rank{rank}{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    try:
        import_module(case["module"]).main(case["flags"])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported in the case's log, as an uncaught error would be
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def main() -> None:
    import_deepspeed()
    rank = os.environ["RANK"]
    for case in json.loads(open(sys.argv[1]).read()):
        pid = os.fork()
        if pid == 0:
            os._exit(run_case(case, rank))
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        with open(f"{case['log']}.rank{rank}.exit", "w") as f:
            f.write(str(code))


if __name__ == "__main__":
    main()
