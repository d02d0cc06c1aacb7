"""Test tiers and shared fixtures.

Tiers: every test under tests/unit/ is `unit` (no model training); a test marked `e2e` (several
processes: Ray, DeepSpeed, torchrun, subprocess CLI runs and faults, the demo) is end-to-end; every
other test is `integration` (tiny-model trainers, rollouts, servers in one process). `slow` marks
integration tests that train for more than a few seconds. `make test` runs every tier; `make test-fast`
runs `-m "not e2e and not slow"`.

Fixtures: `tiny_model_dir`: a llama "nano" (~1M params) causal LM + tokenizer built
once per session with `build_tiny` (seed 0), loadable with `from_pretrained`; `tiny_score_model_dir`, its
score-head twin; `tiny_vision_dir`, a tiny Qwen2.5-VL (vision-language). `one_torch_thread`:
request it (module scope) where tiny models run many small ops. `ray_session` / `ray_address`: one local Ray
instance for the session, and its address for a command-line run to join (RAY_ADDRESS)."""
import functools
import os
import re
import sys
from pathlib import Path

import pytest

# vLLM compiles one sampler helper (`batched_count_greater_than`, inductor) on an engine's first sampling
# step, also under enforce_eager: 2-4 CPU-s per engine process (dynamo, the FX-graph cache, 10 ISA probes in
# subprocesses), ~30 engines a suite. The suite runs without torch.compile (vLLM then also leaves a model
# uncompiled without enforce_eager): set before torch is imported, inherited by the session's Ray workers
# and every subprocess. README's Ray + vLLM command (tests/docs, in a Ray of its own) and the vLLM
# rollout bench's test run with it on, as users do, and so does the GPU tier (tests/gpu/run.sh).
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

# A run draws its PNG charts when it ends: 1-3 CPU-s (matplotlib's import, ~10 figures for an RL run), ~200
# runs a suite. The suite's runs skip them (POSTTRAIN_PLOTS=0, inherited by every subprocess); the tests of
# the charts, of the SFT run folder and of the demo's stages set it back to 1.
os.environ.setdefault("POSTTRAIN_PLOTS", "0")

# The suite starts ~600 Python processes (Ray ranks, command-line runs, launches). Where the environment says
# PYTHONDONTWRITEBYTECODE, each would compile posttrain's modules from source again (~0.3 CPU-s a process
# that trains) and each pytest worker rewrite every test module again (collection 13.4 -> 8.1 CPU-s with
# the cache): the suite writes its bytecode (`__pycache__/`, ignored by git), for itself and its children.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

UNIT_DIR = Path(__file__).parent / "unit"


# Under `pytest -n N` (make test), the tests that share the session's Ray or run vLLM engines go to one
# worker, one after another: one Ray instance serves them, and no two vLLM engines bind the same cores at
# once. The scheduler sees only test ids, so such a test says "ray" or "vllm" in its id (file or test name);
# collection refuses one that uses Ray's fixtures or a vLLM fixture without it.
SHARES_RAY_OR_VLLM = re.compile(r"vllm|(?<![a-z])ray(?![a-z])", re.IGNORECASE)
RAY_OR_VLLM_FIXTURES = re.compile(r"^ray_session$|^ray_address$|vllm")


# modules that run whole with their Ray tests: test_documented_commands's tests share a module-scoped fixture
# with a Ray test (README's runs, which its Ray + vLLM command and every page's commands read: built once);
# test_install's other tests (~45 s) go with its two Ray-named ones to even the two workers' load (the
# Ray/vLLM worker summed 1664 s, the other 1767 s, in a full run of 2026-12-06)
WITH_THE_RAY_TESTS = {"tests/docs/test_documented_commands.py", "tests/cli/test_install.py"}


@functools.cache
def shares_one_launch(module: str) -> bool:
    """Whether the module runs its multi-rank cases in one launch (sft_helpers.torchrun_cases)."""
    path = Path(__file__).parent.parent / module
    return path.is_file() and "torchrun_cases(" in path.read_text()


def shares_ray_or_vllm(nodeid: str) -> bool:
    return bool(SHARES_RAY_OR_VLLM.search(nodeid))


def unnamed_ray_or_vllm_tests(items) -> list[str]:
    """The tests that use Ray's fixtures or a vLLM fixture but whose ids name neither."""
    found = []
    for item in items:
        used = [name for name in item.fixturenames if RAY_OR_VLLM_FIXTURES.search(name)]
        if used and not shares_ray_or_vllm(item.nodeid):
            found.append(f"{item.nodeid} (uses {', '.join(used)})")
    return found


try:
    import xdist.scheduler
except ImportError:  # pytest-xdist is a dev dependency; without it the suite runs in one process
    xdist = None
else:
    class RayAndVllmOnOneWorker(xdist.scheduler.LoadScopeScheduling):
        """`--dist load` for every test, except that the tests `shares_ray_or_vllm` names form one scope (one
        worker, in order; scheduled first, as the largest scope) and so does each module that runs its cases
        in one shared torchrun launch (`torchrun_cases`: the launch runs once)."""

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if shares_ray_or_vllm(nodeid) or module in WITH_THE_RAY_TESTS:
                return "ray-vllm"
            return module if shares_one_launch(module) else nodeid

    def pytest_xdist_make_scheduler(config, log):
        return RayAndVllmOnOneWorker(config, log)


if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers share the cores: 2 cores, -n 2: one torch thread each
    WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORKERS))


def pytest_collection_modifyitems(config, items):
    """Mark each test with its tier (`unit`, `integration` or `e2e`), so `-m` selects tiers; refuse a Ray or
    vLLM test whose id does not say so (`shares_ray_or_vllm`)."""
    unnamed = unnamed_ray_or_vllm_tests(items)
    if unnamed:
        raise pytest.UsageError("these tests use Ray or vLLM but their ids name neither (put ray or vllm in "
                                "the file or test name: tests/conftest.py groups them onto one pytest-xdist "
                                "worker by id): " + "; ".join(unnamed))
    for item in items:
        if UNIT_DIR in Path(item.fspath).parents:
            item.add_marker(pytest.mark.unit)
        elif item.get_closest_marker("e2e") is None:
            item.add_marker(pytest.mark.integration)

# Property tests draw the same examples on every run, so CI results do not depend on luck.
settings.register_profile("posttrain", derandomize=True, deadline=None)
settings.load_profile("posttrain")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from posttrain.models import build_tiny

    path = tmp_path_factory.mktemp("tiny") / "llama-nano"
    build_tiny(path, arch="llama", size="nano", head="lm", seed=0, verbose=False)
    return str(path)


@pytest.fixture(scope="session")
def tiny_score_model_dir(tmp_path_factory):
    """A llama "nano" score model (reward model / critic, `score` head), seed 1; read-only: copy it
    before changing its files."""
    from posttrain.models import build_tiny

    path = tmp_path_factory.mktemp("tiny-rm") / "llama-nano-score"
    build_tiny(path, arch="llama", size="nano", head="score", seed=1, verbose=False)
    return str(path)


@pytest.fixture(scope="session")
def tiny_vision_dir(tmp_path_factory):
    """A tiny Qwen2.5-VL ("nano" language model, `init-tiny --vision`), seed 0; read-only."""
    from posttrain.models import build_tiny

    path = tmp_path_factory.mktemp("tiny-vlm") / "qwen2_5_vl-nano"
    build_tiny(path, size="nano", seed=0, verbose=False, vision=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory):
    """A tiny Qwen3-MoE ("nano" attention, 4 experts, 2 per token; `init-tiny --moe`), seed 0; read-only."""
    from posttrain.models import build_tiny

    path = tmp_path_factory.mktemp("tiny-moe") / "qwen3_moe-nano"
    build_tiny(path, arch="qwen3_moe", size="nano", seed=0, verbose=False)
    return str(path)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one thread (and stay fast when other processes load the CPUs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def session_environ():
    """Environment variables a session-scoped fixture set and later modules need (`ray.init` sets
    RAY_AUTH_MODE=token: a subprocess joining the session's Ray without it is refused); `process_state`
    puts them back after restoring a module's environment."""
    return {}


@pytest.fixture(scope="module", autouse=True)
def process_state(session_environ):
    """What building an in-process vLLM engine changes for the rest of the process is put back after each test
    module: the environment (it sets LD_PRELOAD, VLLM_*, OMP variables; `session_environ` is kept),
    `torch.set_num_threads` (vLLM's CPU worker replaces it with a function that only warns) and the thread
    count, the CPU affinity (its thread binding), and no default process group (its engine core, in this
    process, starts a one-rank one, which vLLM ends only when the engine is shut down or collected; a later
    test starting its own would be refused)."""
    environ, set_threads, threads = dict(os.environ), torch.set_num_threads, torch.get_num_threads()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    grouped = torch.distributed.is_available() and torch.distributed.is_initialized()
    yield
    try:
        if not grouped and torch.distributed.is_available() and torch.distributed.is_initialized():
            end_process_group()
    finally:
        os.environ.clear()
        os.environ.update(environ)
        os.environ.update(session_environ)
        torch.set_num_threads = set_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        if affinity is not None and os.sched_getaffinity(0) != affinity:
            os.sched_setaffinity(0, affinity)


def end_process_group() -> None:
    """End the default process group, and vLLM's groups over it where vLLM made them (its parallel state
    then starts afresh for the next engine, as in a new process)."""
    vllm_state = sys.modules.get("vllm.distributed.parallel_state")
    if vllm_state is not None:
        vllm_state.destroy_model_parallel()
        vllm_state.destroy_distributed_environment()  # (ends torch's default group too)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="session")
def ray_session(session_environ):
    """One local Ray instance for the whole test session (start-up costs seconds); every run places
    its groups in it and removes them when it ends. 16 logical CPUs: a rank asks for one. No runtime_env, as
    in a run's own local Ray (each worker applies posttrain's environment in its constructor, and Ray's
    prestarted workers stay usable). What `ray.init`
    sets in the environment (RAY_AUTH_MODE) outlives the module that started it."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        from posttrain.trainers.rl.placement.ray_placement import LOCAL_SYSTEM_CONFIG

        before = dict(os.environ)
        ray.init(num_cpus=16, include_dashboard=False, log_to_driver=True, _system_config=LOCAL_SYSTEM_CONFIG)
        session_environ.update({k: v for k, v in os.environ.items() if before.get(k) != v})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_address(ray_session):
    """The session Ray's address: a command-line run given it as RAY_ADDRESS joins that instance, as
    OpenRLHF's scripts join a running cluster (`ray job submit`), instead of starting and stopping one
    of its own (seconds of start-up on 2 cores)."""
    return ray_session.get_runtime_context().gcs_address
