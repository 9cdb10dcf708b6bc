# Two commands set up everything on a fresh machine: `make test` and `make demo`.
# Each creates .venv when missing and installs the pinned stack into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
PYTEST_ARGS ?=

.PHONY: test demo install clean

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-dev.txt
	touch $@

test: install
	$(OFFLINE) $(PY) -m pytest -q $(PYTEST_ARGS) tests

demo: install
	$(OFFLINE) $(PY) -m oodjax.main --config configs/demo.py

clean:
	rm -rf $(VENV) .pytest_cache
