# Two commands set everything up on a fresh machine: `make run` and `make test`.
# The venv is built once (torch's CPU wheel first, so nothing pulls a CUDA build) and reused.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.posttrain-installed
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check
# OpenMP's idle threads sleep instead of spinning, so a busy neighbour on a shared machine costs
# about its share of the CPU, not a 17x slowdown (docs/benchmarks/threads.md). It must be set
# before torch is imported (the `posttrain` command sets it too). Threads: one per CPU of the
# affinity mask unless OMP_NUM_THREADS or POSTTRAIN_NUM_THREADS is set (posttrain.core.threads).
export OMP_WAIT_POLICY ?= PASSIVE

# Static checks (settings in pyproject.toml: [tool.ruff], [tool.mypy]). ruff lints and checks the
# formatting of every Python file (tests/ included); mypy checks the posttrain package (sdk/,
# envs/, verifiers/, found through the `posttrain -> sdk` link) and benchmarks/.

.PHONY: install run test lint format info clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) -c constraints.txt -e '.[dev]'
	$(VENV)/bin/posttrain info
	touch $(STAMP)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Rewrites files: ruff's formatting and its safe lint fixes, on the paths `lint` checks.
format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# ARGS go to `posttrain run grpo` after the run folder, as they are: key=value overrides and
# --config PRESET.yaml, e.g. `make run ARGS="rollout.engine=vllm"` (rollouts sampled by a vLLM
# server: scripts/vllm-up.sh builds its venv once).
ARGS ?=
run: install
	$(VENV)/bin/posttrain run grpo out_dir=runs/grpo-$$(date +%Y%m%d-%H%M%S) $(ARGS)

# The local Slurm cluster (scripts/slurm-up.sh: root + apt) is started when it can be and stopped
# afterwards, but only if this run started it: a cluster started by hand stays up. Without it the
# Slurm tests skip. Chromium for the browser test (scripts/browser-up.sh: root + apt, ~30 s once)
# is installed when missing and stays; without it the browser test skips. bubblewrap for the code
# sandbox (scripts/sandbox-up.sh: root + apt, ~3 s once) likewise; without it the sandbox tests skip.
# vLLM's own venv (scripts/vllm-up.sh: ~8 min once, ~3.5 GB at /var/tmp/posttrain-vllm, outside the
# checkout, reused by later runs) likewise; without it the vLLM tests skip. MLflow's server venv
# (scripts/mlflow-up.sh --build: a few minutes once, ~860 MB at /var/tmp/posttrain-mlflow) likewise;
# without it the MLflow UI browser test skips.
# The static checks (`lint`) run first: a finding stops the run before any test.
# The tests run in TEST_WORKERS processes (pytest-xdist), each test file whole in one of them
# (`--dist loadfile`: a module's fixtures start once): much of the suite waits on processes it
# started (jobs, servers, ranks), so two workers on 2 cores took 28 min where one took 43 (the
# same machine, with the same work beside both). `make test TEST_WORKERS=1` runs them in one.
TEST_WORKERS ?= 2
test: install lint
	up=0; if ! scripts/slurm-up.sh --check; then \
	  if scripts/slurm-up.sh; then up=1; else echo "local Slurm not started: Slurm tests will skip"; fi; fi; \
	if ! scripts/browser-up.sh --check; then \
	  scripts/browser-up.sh || echo "chromium not installed: browser test will skip"; fi; \
	if ! scripts/sandbox-up.sh --check; then \
	  scripts/sandbox-up.sh || echo "no code sandbox here: sandbox tests will skip"; fi; \
	if ! scripts/vllm-up.sh --check; then \
	  scripts/vllm-up.sh || echo "vLLM venv not built: vLLM tests will skip"; fi; \
	if ! scripts/mlflow-up.sh --check; then \
	  scripts/mlflow-up.sh --build || echo "MLflow server venv not built: the MLflow UI test will skip"; fi; \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; \
	if [ $$up -eq 1 ]; then scripts/slurm-down.sh; fi; exit $$rc

info: install
	$(VENV)/bin/posttrain info

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
