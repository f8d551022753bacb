# Two entry points a fresh clone needs: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test demo lint clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch for tests and the demo; GPU users install their CUDA build instead.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check diffusiond tests
	$(PY) -m pytest -q

demo: $(STAMP)
	PY=$(PY) scripts/demo.sh

# Lint is `ruff check` (rules and the 120-column limit in pyproject.toml). Layout is by hand:
# the code keeps related arguments on one line where `ruff format` would put one per line.
lint: $(STAMP)
	$(PY) -m ruff check diffusiond tests

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
