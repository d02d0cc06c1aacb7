"""Several trainer runs in one launch: `torchrun --nproc_per_node N tests/trainers/launch_cases.py SPEC` runs
the cases of SPEC (a JSON list of {"module", "flags", "log", "copies"}) one after another. Each rank
imports torch, transformers, DeepSpeed and the trainers once (with what a run loads lazily: `warm_up`), then
forks one process per case, which forms a process group of its own (its own port, which rank 0 picks when the
case starts, `case_port`; rank 0 serves the store, as DeepSpeed's launcher has it) and runs
`module.main(flags)`: every case is a fresh multi-rank run, the launch and the imports are paid once. Before
a case, rank 0 copies each of its "copies" ([source, target] folders: an earlier case's checkpoint that this
case resumes) and the other ranks wait for it. Case stderr of rank R goes to `log`.rankR, its exit status to
`log`.rankR.exit (`sft_helpers.torchrun_cases`)."""
import json
import os
import shutil
import socket
import sys
import time
import traceback
from importlib import import_module

import posttrain.trainers.dpo  # noqa: F401  (the heavy imports, before the forks)
import posttrain.trainers.kd  # noqa: F401
import posttrain.trainers.rm  # noqa: F401
import posttrain.trainers.sft  # noqa: F401
from posttrain.engines.deepspeed_engine import import_deepspeed


def run_case(case: dict, rank: str, port: str) -> int:
    """In a forked process: the case's exit status (SystemExit's code; 1 for any other exception)."""
    os.environ.update(MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="False")
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


def warm_up() -> None:
    """Import, before the forks, what every case would otherwise import again in its own process: the
    lazily loaded parts of transformers (the auto classes, the llama model, the tokenizer), DeepSpeed's
    optimizer check (torch.compile: dynamo, inductor, sympy) and tensor-parallel code. (Not matplotlib: the
    suite's runs draw no charts, tests/conftest.py.)"""
    import_deepspeed()
    import deepspeed.module_inject.auto_ep_layer  # noqa: F401
    import deepspeed.module_inject.auto_tp  # noqa: F401
    import deepspeed.ops.op_builder.all_ops  # noqa: F401
    import deepspeed.runtime.superoffload.superoffload_stage3  # noqa: F401
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    import torch.utils.cpp_extension  # noqa: F401  (DeepSpeed's op builders: setuptools)
    import transformers.models.auto.modeling_auto  # noqa: F401
    import transformers.models.auto.tokenization_auto  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401


def published(path: str, rank: str, make) -> str:
    """Rank 0 writes `make()` to `path` (via a rename, so it appears whole); every rank waits for the file and
    returns what it holds."""
    if rank == "0":
        value = make()  # (which may create path's folder)
        with open(f"{path}.part", "w") as f:
            f.write(value)
        os.rename(f"{path}.part", path)
    while not os.path.exists(path):
        time.sleep(0.05)
    with open(path) as f:
        return f.read()


def free_port() -> str:
    """As tests/rewards_http.free_port (not importable here: torchrun runs this from tests/trainers)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def case_port(case: dict, rank: str) -> str:
    """The case's store port: rank 0 picks a free one as the case starts and publishes it (`log`.port). A port
    picked when the launch starts could be taken by another process (the suite's other worker, Ray) by the
    time a later case binds it: rank 0's case would fail to serve the store and ranks 1-N wait for one that
    never answers (a hang until the launch's timeout)."""
    return published(f"{case['log']}.port", rank, free_port)


def copied(copies: list, rank: str) -> str:
    """Rank 0 copies each [source, target] folder (into target.part, renamed into place) and publishes
    target.done ("" or why it failed); every rank waits for it: what failed ("" for nothing)."""
    def copy(source: str, target: str) -> str:
        try:
            shutil.copytree(source, f"{target}.part")
            os.rename(f"{target}.part", target)
            return ""
        except OSError as e:
            return f"copying {source} to {target}: {e}"

    errors = [published(f"{target}.done", rank, lambda s=source, t=target: copy(s, t))
              for source, target in copies]
    return "; ".join(e for e in errors if e)


def main() -> None:
    warm_up()
    rank = os.environ["RANK"]
    for case in json.loads(open(sys.argv[1]).read()):
        failed = copied(case.get("copies", []), rank)
        if failed:  # the case does not run: its log says why
            with open(f"{case['log']}.rank{rank}", "w") as f:
                f.write(failed + "\n")
            code = 1
        else:
            port = case_port(case, rank)
            pid = os.fork()
            if pid == 0:
                os._exit(run_case(case, rank, port))
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        with open(f"{case['log']}.rank{rank}.exit", "w") as f:
            f.write(str(code))


if __name__ == "__main__":
    main()
