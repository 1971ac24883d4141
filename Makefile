# Set-up and entry points. `make demo` and `make test` create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned to the CPU build that pip takes from this machine's disk: never a CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup chromium demo test test-unit test-e2e lint bench clean

# setup.py and the C source: a change rebuilds the optional extension (ddpdoctor/rank/_fastcall.c).
$(VENV)/.installed: pyproject.toml setup.py ddpdoctor/rank/_fastcall.c ddpdoctor/rank/_auditfilter.c \
		ddpdoctor/rank/_sitewalk.c ddpdoctor/rank/_warnsite.c ddpdoctor/rank/_ddpstep.c \
		ddpdoctor/rank/_native.h ddpdoctor/analysis/_bulkscan.c ddpdoctor/analysis/_frpickle.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_PIN)" numpy
	$(PY) -m pip install -q -e ".[dev,frameworks]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/ddpdoctor trace --hang-timeout 8 --on-hang kill -- \
		$(VENV)/bin/torchrun --standalone --nproc_per_node=2 examples/train_buggy.py; \
		status=$$?; echo "(ddpdoctor trace exited $$status: 124 = job ended after the diagnosed hang)"

# Headless Chromium renders the HTML report in tests/e2e/test_html_report.py (Debian's package).
# Idempotent; where apt is unavailable it does nothing and that test skips itself.
chromium:
	@command -v chromium >/dev/null 2>&1 || { (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 || true; }

test: setup chromium
	$(PY) -m pytest -q tests

# The hand-written-trace tests alone (seconds), and the real gloo jobs.
test-unit: setup
	$(PY) -m pytest -q tests/unit

test-e2e: setup chromium
	$(PY) -m pytest -q tests/e2e

# ruff, then the import contracts of pyproject.toml ([tool.importlinter]): which side of the trace
# contract may import which, and no import cycles.
lint: setup
	$(VENV)/bin/ruff check ddpdoctor tests bench examples checks
	$(VENV)/bin/lint-imports

bench: setup
	$(PY) -m bench

clean:
	rm -rf $(VENV) ddpdoctor-traces .pytest_cache
