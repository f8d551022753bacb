# Two entry points a fresh clone needs: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

CHROMIUM ?= /usr/bin/chromium

.PHONY: test demo lint clean browser

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch for tests and the demo; GPU users install their CUDA build instead.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	# the upscale extra without torchvision (pyproject.toml says why): tests/test_upscale.py loads upscalers
	$(PY) -m pip install -q -c constraints.txt --no-deps spandrel einops
	touch $(STAMP)

# JOBS test processes (pytest-xdist; tests/conftest.py says how files are shared out); JOBS=0 runs in this one.
JOBS ?= 2

test: lint browser
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile --durations=25

# The browser tests (tests/test_web_page.py) drive the distribution's Chromium through Playwright,
# never Playwright's own download (no network on many workstations). Installed here when missing
# and we are root with apt (a CI box); elsewhere those tests skip and say how to get it.
browser:
	@if [ ! -x $(CHROMIUM) ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update && apt-get install -y chromium; \
	fi

demo: $(STAMP)
	PY=$(PY) scripts/demo.sh

# Lint is `ruff check` (rules and the 120-column limit in pyproject.toml), then mypy on the
# package ([tool.mypy] in pyproject.toml: strict for all but pipelines and bench: the list is there). Layout is
# by hand: the code keeps related arguments on one line where `ruff format` would put one per line.
lint: $(STAMP)
	$(PY) -m ruff check diffusiond tests examples scripts
	$(PY) -m mypy

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
