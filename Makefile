# Both targets build their own virtualenv from nothing, with the CPU build of torch: public
# PyPI's Linux torch wheel is a CUDA build, so torch comes from PyTorch's CPU index when that
# index answers, else from pip's own configuration (a local wheel directory); the +cpu pin
# refuses a CUDA build either way. An importable torch (a reused venv) is kept.
VENV ?= .venv
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PY := $(VENV)/bin/python
# The cluster tier's tests run a real mooncake_master (the wheel ships it and the store client;
# its Python dependencies serve parts kvtier does not use). Its binaries link libibverbs.so.1
# even over TCP: Debian's libibverbs1, installed when missing and apt-get can (CI runs as root).
MOONCAKE := mooncake-transfer-engine-non-cuda==0.3.13.post1
LIBIBVERBS := ldconfig -p | grep -q libibverbs.so.1 || { apt-get update -qq && apt-get install -y -qq libibverbs1; } \
	|| echo "libibverbs1 did not install: the cluster tier's tests will skip"
STAMP := $(VENV)/.kvtier-installed
# make test runs the suite on TEST_WORKERS processes (pytest-xdist) without the tests marked
# stress (the long thread, process and fault-injection runs); make stress runs those. CI runs both.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS)

.PHONY: demo test stress bench clean gpu-sglang-kit prebuilt-cubins

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || { \
	  if $(PY) -c "import urllib.request as u; u.urlopen('$(TORCH_INDEX)/torch/', timeout=10)" 2>/dev/null; \
	  then $(PY) -m pip install -q "torch==2.13.0+cpu" --index-url $(TORCH_INDEX); \
	  else $(PY) -m pip install -q "torch==2.13.0+cpu"; fi; }
	$(PY) -m pip install -q --no-deps nixl-cu13==1.5.1
	$(PY) -m pip install -q --no-deps $(MOONCAKE)
	$(LIBIBVERBS)
	$(PY) -m pip install -q -e ".[test,bench,triton]" "crc32c>=2.4"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/decode_demo.py

# The pool's tests once more on the index's Python twins (KVTIER_HOST_CACHE=off: no C paths),
# which a machine without a C compiler runs.
test: $(STAMP)
	$(PYTEST) -m "not stress"
	KVTIER_HOST_CACHE=off $(PYTEST) -m "not stress" tests/test_pool.py tests/test_pool_*.py

stress: $(STAMP)
	$(PYTEST) -m stress

bench: $(STAMP)
	$(PY) benchmarks/pool_overhead.py

clean:
	rm -rf $(VENV) build dist *.egg-info

# SGLang harness: its own virtualenv under build/ with sglang 0.5.23's wheel unpacked onto the
# path through a .pth file (the wheel pins a CUDA torch 2.14.1; the pure-Python host pools,
# storage factory and plugin loader run on the CPU torch) and a torchvision import stub
# (tests/sglang/harness). Pinned packages: requirements/sglang-harness.txt.
SGLANG_VERSION := 0.5.23
SGLANG_HARNESS ?= build/sglang-harness
SGLANG_PY := $(SGLANG_HARNESS)/venv/bin/python
SGLANG_STAMP := $(SGLANG_HARNESS)/.installed

.PHONY: test-sglang

$(SGLANG_STAMP): requirements/sglang-harness.txt pyproject.toml Makefile
	rm -rf $(SGLANG_HARNESS)
	python3 -m venv $(SGLANG_HARNESS)/venv
	$(SGLANG_PY) -m pip install -q --upgrade pip
	$(SGLANG_PY) -m pip install -q "torch==2.13.0+cpu"
	$(SGLANG_PY) -m pip install -q --no-deps nixl-cu13==1.5.1
	$(SGLANG_PY) -m pip install -q --no-deps $(MOONCAKE)
	$(LIBIBVERBS)
	$(SGLANG_PY) -m pip install -q -r requirements/sglang-harness.txt
	$(SGLANG_PY) -m pip install -q --no-deps -e .
	$(SGLANG_PY) -m pip download -q --no-deps --only-binary=:all: -d $(SGLANG_HARNESS)/wheel sglang==$(SGLANG_VERSION)
	$(SGLANG_PY) -m zipfile -e $(SGLANG_HARNESS)/wheel/sglang-$(SGLANG_VERSION)-*.whl $(SGLANG_HARNESS)/sglang
	$(SGLANG_PY) -c "import site, sys; open(site.getsitepackages()[0] + '/kvtier-sglang-harness.pth', 'w').write('\n'.join(sys.argv[1:]) + '\n')" \
		$(abspath $(SGLANG_HARNESS)/sglang) $(abspath tests/sglang/harness)
	touch $(SGLANG_STAMP)

test-sglang: $(SGLANG_STAMP)
	KVTIER_REQUIRE_SGLANG=1 $(SGLANG_PY) -m pytest -q -p no:cacheprovider tests/sglang

# The folder a GPU call carries for scripts/sglang_server_check.sh: a real SGLang 0.5.17 server's
# wheel set and a trimmed nixl for the H200's Python 3.12 / torch 2.11, built by the kit the
# project keeps beside its checkout (../shared/gpu-sglang). Ignored by git; ~58 MiB.
GPU_SGLANG_KIT ?= ../shared/gpu-sglang

gpu-sglang-kit:
	@test -f $(GPU_SGLANG_KIT)/build.sh || { echo "no kit at $(GPU_SGLANG_KIT) (set GPU_SGLANG_KIT=...)"; exit 2; }
	@grep -qx '/.gpu-sglang/' .git/info/exclude 2>/dev/null || echo /.gpu-sglang/ >> .git/info/exclude
	bash $(GPU_SGLANG_KIT)/build.sh

# The prebuilt cubins shipped in kvtier/native/prebuilt (scripts/build_prebuilt_cubins.py): NVRTC
# 13.0 (native.PREBUILT_NVRTC) and cuda-bindings installed under build/nvrtc; no GPU needed.
# Run after editing native/*.cu or the compile options, and commit native/prebuilt.
prebuilt-cubins: $(STAMP)
	$(PY) -m pip install -q --upgrade --target build/nvrtc "nvidia-cuda-nvrtc==13.0.88" "cuda-bindings>=13,<14"
	$(PY) scripts/build_prebuilt_cubins.py
