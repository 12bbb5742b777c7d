# The two commands: `make demo` and `make test`. Each creates and uses .venv by itself.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed

.PHONY: demo test bench fuzz chaos chaos-operator lint clean k8s-tools

$(INSTALLED): pyproject.toml setup.py native/build_ffi.py native/include/sneppx.h $(wildcard native/src/*.c)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel cffi
	$(PY) -m pip install -q --no-build-isolation -e '.[test,bench,interop-test]'
	touch $@

demo: $(INSTALLED)
	$(PY) -m SneppX_ALG.demo

k8s-tools:
	bash tests/tools/build.sh >/dev/null

# The linters: ruff and mypy (exceptions in pyproject.toml, each with its reason) and the import layers
# (.importlinter).
lint: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The suite in one process by default; `make test TEST_WORKERS=4` runs it on pytest-xdist workers, tests that share
# a cluster or the image on one worker (tests/conftest.py; docs/TESTING.md, "Running tests in parallel"). Serial
# until the wedged-agent k8s test passes in parallel runs too: it failed in both (two Hang restarts for one wedge).
TEST_WORKERS ?= 0
test: lint k8s-tools
	$(PY) -m pytest -n $(TEST_WORKERS)

bench: $(INSTALLED)
	$(PY) -m bench

# A campaign of the operator simulation (tests/unit/sneppx_operator/operator_sim.py; docs/TESTING.md): first
# SIM_SCHEDULES seeds past the fixed ones pytest runs, without the open defects' triggers (they must pass), then as
# many with every adversity (a failure prints its seed, its shrunk schedule and the defects it shows).
SIM_SCHEDULES ?= 2000
chaos-operator: $(INSTALLED)
	$(PY) tests/unit/sneppx_operator/operator_sim.py --profile no-known-defects --first 1000 --schedules $(SIM_SCHEDULES)
	$(PY) tests/unit/sneppx_operator/operator_sim.py --profile everything --schedules $(SIM_SCHEDULES)

# Every fuzz target for FUZZ_SECONDS each (default 60), what they learn kept under ~/.cache/sneppx/fuzz;
# `make test` runs the same targets 4 s each. docs/TESTING.md, "Fuzzing", says how to triage a finding.
FUZZ_SECONDS ?= 60
fuzz: $(INSTALLED)
	SNEPPX_FUZZ_SECONDS=$(FUZZ_SECONDS) SNEPPX_FUZZ_KEEP=$(HOME)/.cache/sneppx/fuzz \
		$(PY) -m pytest tests/fuzz -p no:randomly --timeout=0 -v

# Campaigns of the randomized tests with an exact oracle, outside `make test` (which runs a fixed set of their
# seeds): SEEDS new seeds from SEED_START each, failures shrunk and printed with their replay line
# (docs/TESTING.md, "Recovery chaos"). Another campaign is one more line here.
SEEDS ?= 20
SEED_START ?= 1000
chaos: $(INSTALLED)
	SNEPPX_CHAOS_KNOWN=1 $(PY) -m pytest tests/chaos -p no:randomly -k known_failing -v
	$(PY) tests/chaos/campaign.py --seeds $(SEEDS) --start $(SEED_START)

clean:
	rm -rf $(VENV) build *.egg-info runtime/SneppX_ALG/*.so
