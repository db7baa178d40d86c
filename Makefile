VENV ?= .venv
PY := $(VENV)/bin/python
WHEELS := $(wildcard /opt/wheels)
PIP_FLAGS := $(if $(WHEELS),--find-links $(WHEELS),)

.PHONY: install test demo

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(PIP_FLAGS) -e '.[test]'
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q -n 2 --dist loadfile

demo: install
	$(PY) -m kvjax.demo
