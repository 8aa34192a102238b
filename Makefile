# Both targets build their own virtualenv from nothing, with the CPU build of torch: public
# PyPI's Linux torch wheel is a CUDA build, so torch comes from PyTorch's CPU index when that
# index answers, else from pip's own configuration (a local wheel directory); the +cpu pin
# refuses a CUDA build either way. An importable torch (a reused venv) is kept.
VENV ?= .venv
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvtier-installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || { \
	  if $(PY) -c "import urllib.request as u; u.urlopen('$(TORCH_INDEX)/torch/', timeout=10)" 2>/dev/null; \
	  then $(PY) -m pip install -q "torch==2.13.0+cpu" --index-url $(TORCH_INDEX); \
	  else $(PY) -m pip install -q "torch==2.13.0+cpu"; fi; }
	$(PY) -m pip install -q --no-deps nixl-cu13==1.5.1
	$(PY) -m pip install -q -e ".[test,bench,triton]" "crc32c>=2.4"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

bench: $(STAMP)
	$(PY) benchmarks/pool_overhead.py

clean:
	rm -rf $(VENV) build dist *.egg-info
