#!/usr/bin/env bash
# The GPU tests in one go, on a machine with a CUDA GPU: installs the vllm extra into the project's
# venv (set up by `make setup`), then runs tests/gpu and the real-vLLM engine tests (tests/rollout/test_vllm_real*,
# which also run on CPU with vLLM's CPU build). Elsewhere the GPU tests are skipped with the reason.
set -euo pipefail
cd "$(dirname "$0")/../.."
make setup
.venv/bin/python -m pip install -q --no-build-isolation -e '.[all,dev,vllm]'
# vLLM as users run it there: torch.compile on (tests/conftest.py turns it off by default, for the CPU suite)
TORCH_COMPILE_DISABLE=0 .venv/bin/python -m pytest -q -p no:cacheprovider tests/gpu tests/rollout/test_vllm_real*.py "$@"
