# Two commands set up everything on a fresh machine: `make test` and `make demo`.
# Each creates .venv when missing and installs the pinned stack into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
PYTEST_ARGS ?=

.PHONY: test demo install system-tools clean

install: $(VENV)/.installed

# Tests compile LaTeX tables (pdflatex + booktabs) and lint the launch scripts (shellcheck).
# Installed from Debian's packages when missing; needs root or sudo.
APT := $(shell [ "$$(id -u)" = 0 ] || echo sudo) env DEBIAN_FRONTEND=noninteractive apt-get
system-tools:
	@if ! command -v pdflatex >/dev/null || ! kpsewhich booktabs.sty >/dev/null || ! command -v shellcheck >/dev/null; then \
		$(APT) update -q && $(APT) install -y -q --no-install-recommends texlive-latex-recommended shellcheck; \
	fi

$(VENV)/.installed: requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-dev.txt
	touch $@

test: install system-tools
	$(OFFLINE) $(PY) -m pytest -q $(PYTEST_ARGS) tests

demo: install
	$(OFFLINE) $(PY) -m oodjax.main --config configs/demo.py
	$(PY) -m analysis results/demo --out results/demo-analysis

clean:
	rm -rf $(VENV) .pytest_cache
