# Quick start on a fresh machine:
#   make train   # set up .venv (MPI from PyPI included) and train the GPT on 4 MPI ranks
#   make test    # set up .venv and run the whole test suite (serial, then 2 and 4 MPI ranks)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
NP     ?= 4
ARGS   ?=

.PHONY: venv train test clean

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[mpi,data,hf,test,plot]'
	touch $@

venv: $(VENV)/.installed

train: venv
	$(VENV)/bin/mpiexec -n $(NP) $(PY) -m ringpipe.train --overwrite $(ARGS)

test: venv
	PATH=$(abspath $(VENV))/bin:$$PATH bash tests/run_all.sh

clean:
	rm -rf $(VENV) runs
