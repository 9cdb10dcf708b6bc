# Two commands set up everything on a fresh machine: `make test` and `make demo`.
# Each creates .venv when missing: `make demo` installs the runtime set (requirements.txt), all the demo
# runs; `make test` (and `make install`) the test stack too (requirements-dev.txt: torch, peft, pingouin...).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
PYTEST_ARGS ?=

.PHONY: test format demo install install-runtime install-gpu install-tpu install-tpu-compiler install-bench-gpu system-tools clean

install: $(VENV)/.installed
install-runtime: $(VENV)/.installed-runtime
# Accelerator stacks (docs/install.md): requirements.txt plus the matching JAX build, pinned, and never
# PyTorch; each in a venv of its own (VENV=.venv by default, the launchers' OODJAX_VENV).
install-gpu: $(VENV)/.installed-gpu
install-tpu: $(VENV)/.installed-tpu
# The TPU compiler alone, for `python -m launch.preflight --topology` on a machine without a TPU: requirements-tpu.txt's
# libtpu unpacked into TPU_COMPILER, outside the venv, so that JAX never looks for a TPU on start-up (a TPU VM's
# stack, install-tpu, has it in the venv). Needs only the venv's pip, of the venv's Python.
TPU_COMPILER := .tpu-compiler
install-tpu-compiler: $(TPU_COMPILER)/.installed
# The GPU benchmark (PyTorch beside JAX, one CUDA major) in a venv of its own; TORCH_CUDA names PyTorch's
# CUDA 12 build and index.
BENCH_VENV ?= .venv-bench
TORCH_CUDA ?= cu129
install-bench-gpu: $(BENCH_VENV)/.installed-bench-gpu

# One stack a venv: torch's CUDA 13 libraries beside jax[cuda12]'s is how two CUDA majors met in one .venv.
STACKS := installed installed-gpu installed-tpu installed-bench-gpu
define only_stack
	@for other in $(filter-out $(1),$(STACKS)); do \
		if [ -e $(2)/.$$other ]; then \
			echo "$(2) already holds another stack ($(2)/.$$other): make clean, or pick another VENV=" >&2; exit 1; \
		fi; \
	done
endef
# After an accelerator install: pip's own check, then no torch and no NVIDIA library of another CUDA major
# than $(1) (empty: none at all).
define check_stack
	$(2) -m pip check
	$(2) -c "import importlib.metadata as m, sys; \
	names = sorted({d.metadata['Name'].lower().replace('_', '-') for d in m.distributions()}); \
	bad = [n for n in names if n == 'torch' or (n.startswith('nvidia-') and not ('$(1)' and n.endswith('-$(1)')))]; \
	sys.exit(f'not one $(or $(1),CPU/TPU) stack: {bad}' if bad else 0)"
endef

# Tests compile LaTeX tables (pdflatex + booktabs) and lint the launch scripts (shellcheck).
# Installed from Debian's packages when missing; needs root or sudo.
APT := $(shell [ "$$(id -u)" = 0 ] || echo sudo) env DEBIAN_FRONTEND=noninteractive apt-get
system-tools:
	@if ! command -v pdflatex >/dev/null || ! kpsewhich booktabs.sty >/dev/null || ! command -v shellcheck >/dev/null; then \
		$(APT) update -q && $(APT) install -y -q --no-install-recommends texlive-latex-recommended shellcheck; \
	fi

# The runtime set alone, a part of every stack (so no stack is refused): what the demo needs.
$(VENV)/.installed-runtime: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $@

# The test stack holds the runtime set: one pip call installs both, and the runtime's stamp is kept up to date.
$(VENV)/.installed: requirements.txt requirements-dev.txt
	$(call only_stack,installed,$(VENV))
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-dev.txt
	touch $@ $(VENV)/.installed-runtime

$(VENV)/.installed-gpu $(VENV)/.installed-tpu: $(VENV)/.installed-%: requirements.txt requirements-%.txt
	$(call only_stack,installed-$*,$(VENV))
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-$*.txt
	$(call check_stack,$(if $(filter gpu,$*),cu12),$(PY))
	touch $@

$(TPU_COMPILER)/.installed: requirements-tpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	rm -rf $(TPU_COMPILER)
	$(PY) -m pip install -q --no-deps --target $(TPU_COMPILER) $$(grep '^libtpu==' requirements-tpu.txt)
	touch $@

$(BENCH_VENV)/.installed-bench-gpu: requirements.txt requirements-bench-gpu.txt
	$(call only_stack,installed-bench-gpu,$(BENCH_VENV))
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install -q -r requirements-bench-gpu.txt "torch==2.13.0+$(TORCH_CUDA)" \
		--extra-index-url https://download.pytorch.org/whl/$(TORCH_CUDA)
	$(BENCH_VENV)/bin/python -m pip check
	touch $@

# The formatter, the linter and the type checker first (ruff and mypy, configured in pyproject.toml; `make format`
# applies ruff's fixes), then the tests (those of TPU slices with the TPU compiler).
test: install system-tools install-tpu-compiler
	$(PY) -m ruff format --check --quiet .
	$(PY) -m ruff check --quiet .
	$(PY) -m mypy
	$(OFFLINE) $(PY) -m pytest -q --durations=25 $(PYTEST_ARGS) tests

format: install
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

demo: install-runtime
	$(OFFLINE) $(PY) -m oodjax.main --config configs/demo.py
	$(PY) -m analysis results/demo --out results/demo-analysis

clean:
	rm -rf $(VENV) $(BENCH_VENV) $(TPU_COMPILER) .pytest_cache
