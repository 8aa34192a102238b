# Both targets build their own virtualenv from nothing. On a CPU machine the torch pin takes
# the CPU wheel (torch==2.13.0); a plain `torch` requirement would download a CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvtier-installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps nixl-cu13==1.5.1
	$(PY) -m pip install -q -e ".[test,bench,triton]" "crc32c>=2.4"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/decode_demo.py

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

bench: $(STAMP)
	$(PY) benchmarks/pool_overhead.py

clean:
	rm -rf $(VENV) build *.egg-info
