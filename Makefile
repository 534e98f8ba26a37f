# Two commands for a new user on a fresh machine (each builds .venv and installs what it needs):
#   make demo   - the end-to-end demo on the embedded disk store
#   make test   - the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
TORCH := torch==2.14.1 torchvision==0.29.1

.PHONY: demo test test-long bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# One stamp per set of extras, so a second run installs nothing.
$(VENV)/.core: pyproject.toml | $(PY)
	$(PIP) install -e ".[test,bench]"
	touch $@

demo: $(VENV)/.core
	$(PY) examples/demo.py

test: $(VENV)/.core
	$(PY) -m pytest

test-long: $(VENV)/.core
	$(PY) -m pytest -m "slow or not slow"

bench: $(VENV)/.core
	$(PY) bench/store_bench.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis bench/out .demo-store
