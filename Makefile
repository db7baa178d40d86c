VENV ?= .venv
PY := $(VENV)/bin/python
WHEELS := $(wildcard /opt/wheels)
PIP_FLAGS := $(if $(WHEELS),--find-links $(WHEELS),)

.PHONY: install test demo teacher

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

# The testbed teacher from scratch (seeded; see configs/testbed-teacher.yaml for its time on 2 cores):
# trains, copies the Hugging Face folder to assets/, and plots the learning curve next to it.
teacher: install
	$(PY) train.py --config configs/testbed-teacher.yaml
	rm -rf assets/testbed-teacher.tmp && cp -r runs/testbed-teacher/hf assets/testbed-teacher.tmp
	rm -rf assets/testbed-teacher && mv assets/testbed-teacher.tmp assets/testbed-teacher
	$(PY) -m kvjax.evaluation.learning_curve runs/testbed-teacher --out assets/testbed-teacher-curve.png
