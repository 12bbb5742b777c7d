# The two commands: `make demo` and `make test`. Each creates and uses .venv by itself.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed

.PHONY: demo test bench lint clean k8s-tools

$(INSTALLED): pyproject.toml setup.py native/build_ffi.py native/include/sneppx.h $(wildcard native/src/*.c)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel cffi
	$(PY) -m pip install -q --no-build-isolation -e '.[test,bench,interop-test]'
	touch $@

demo: $(INSTALLED)
	$(PY) -m SneppX_ALG.demo

k8s-tools:
	bash tests/tools/build.sh >/dev/null

test: $(INSTALLED) k8s-tools
	$(VENV)/bin/lint-imports
	$(PY) -m pytest

bench: $(INSTALLED)
	$(PY) -m bench

clean:
	rm -rf $(VENV) build *.egg-info runtime/SneppX_ALG/*.so
