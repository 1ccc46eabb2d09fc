# dcredit_hvd: `make demo` runs the main job, `make test` passes the tests.
# Both install what is missing first (scripts/install.sh is idempotent: seconds when done).

VENV      ?= $(CURDIR)/.venv
PY        := $(VENV)/bin/python
export PATH := $(VENV)/bin:$(PATH)
# Open MPI refuses root without these; CI and these machines run as root.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
# A stalled block raises StallError (naming it) well before the run's own timeout.
export DCREDIT_STALL_ABORT_SECONDS ?= 120
# Each multi-rank run is killed (and fails) rather than hanging CI.
MULTIRANK_TIMEOUT ?= 1500
MPIRUN    := timeout -k 10 $(MULTIRANK_TIMEOUT) mpirun -np 2 --oversubscribe --bind-to none \
             --map-by slot --mca btl self,vader,tcp
HVDRUN    := timeout -k 10 $(MULTIRANK_TIMEOUT) horovodrun -np 2 -H localhost:2 --gloo
# make test leaves out the tests marked `full` (repeats of covered behaviour); make test-full runs them.
PYTEST_MARK ?= -m "not full"
PYTEST_MR := $(PY) -m pytest -q -p no:cacheprovider $(PYTEST_MARK) tests/multirank
# Under horovodrun --gloo, make test keeps what depends on Horovod's Gloo back-end and on
# horovodrun's process model (tests/README.md says why); make test-full runs all of multirank/.
GLOO_TESTS := $(addprefix tests/multirank/,test_parity.py test_reliability.py test_agreement.py \
              test_dropin_swap.py test_horovod_contract.py test_liveness_outsider.py \
              test_sharded.py test_dear.py)
#: make test's suites, in order; each prints its wall time.
SUITES      := test-unit test-mpi test-gloo test-torchrun test-frameworks vcluster-report
SUITES_FULL := test-unit test-mpi test-gloo-full test-torchrun test-frameworks vcluster-report

.PHONY: install test test-full test-unit test-mpi test-gloo test-gloo-full test-torchrun \
        test-frameworks run-suites vcluster-report demo demo-frameworks demo-drift bench lint clean \
        gpu-wheelhouse gpu-check

install:
	VENV=$(VENV) ./scripts/install.sh

test: install
	@$(MAKE) --no-print-directory run-suites RUN_SUITES="$(SUITES)"

# Everything, every multi-rank suite under every launcher (as make test did before 0.2).
test-full: install
	@$(MAKE) --no-print-directory run-suites RUN_SUITES="$(SUITES_FULL)" PYTEST_MARK=

run-suites:
	@all=$$(date +%s); for suite in $(RUN_SUITES); do s=$$(date +%s); \
	  $(MAKE) --no-print-directory $$suite || { echo "== $$suite FAILED after $$(( $$(date +%s) - s )) s"; exit 1; }; \
	  echo "== $$suite: $$(( $$(date +%s) - s )) s"; done; \
	echo "== all suites: $$(( $$(date +%s) - all )) s"

# Both cores: the unit tests are independent (pytest-xdist, one worker per core).
XDIST ?= -n 2
test-unit:
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) $(PYTEST_MARK) tests --ignore=tests/multirank \
	  --ignore=tests/torchrun --ignore=tests/frameworks

test-mpi:
	$(MPIRUN) $(PYTEST_MR)
	$(MPIRUN) $(PY) tests/multirank/exit_applies_updates.py

test-gloo:
	$(HVDRUN) $(PY) -m pytest -q -p no:cacheprovider $(PYTEST_MARK) $(GLOO_TESTS)
	$(HVDRUN) $(PY) tests/multirank/exit_applies_updates.py

test-gloo-full:
	$(HVDRUN) $(PYTEST_MR)
	$(HVDRUN) $(PY) tests/multirank/exit_applies_updates.py

# PyTorch Lightning and the Hugging Face Trainer against their own DDP: each test file launches
# its driver under torchrun (Lightning also under horovodrun) once and checks every case.
# Each file's launches stay in one worker (--dist loadfile); two files run at once.
test-frameworks:
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) $(PYTEST_MARK) --dist loadfile tests/frameworks

# The third launcher: tests/torchrun on the torch.distributed transport (Gloo, no Horovod), one
# pytest per rank; --standalone picks a free port.  A test that runs past 300 s prints every
# thread's stack.  The jobs that kill or desynchronise a rank are tests/jobs/test_torchrun_jobs.py.
test-torchrun:
	@start=$$(date +%s); timeout -k 10 $(MULTIRANK_TIMEOUT) torchrun --standalone \
	  --nproc-per-node 2 -m pytest -q -p no:cacheprovider $(PYTEST_MARK) -o faulthandler_timeout=300 \
	  tests/torchrun && timeout -k 10 300 torchrun --standalone --nproc-per-node 4 -m pytest -q \
	  -p no:cacheprovider tests/torchrun/test_sharded.py -k "one_nth or full_form"; status=$$?; \
	echo "test-torchrun: $$(( $$(date +%s) - start )) s, exit status $$status"; exit $$status

# Beside the instrument check (tests/bench/test_vcluster.py, in test-unit): what a 24 MiB hvd.allreduce
# takes on 2 virtual hosts at 1 Gbit/s with Open MPI's default all-reduce and with the one the
# bench uses there (recursive doubling), against what the link needs. Prints figures, asserts none.
VCLUSTER_ALGO := --mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm
vcluster-report:
	@if [ "$$(id -u)" != 0 ]; then echo "vcluster-report: skipped, scripts/vcluster.sh needs root"; else \
	  timeout -k 10 300 ./scripts/vcluster.sh 2 1gbit -- bash -c '\
	    mpirun -np 2 -H h0,h1 --bind-to none $(PY) scripts/allreduce_probe.py && \
	    mpirun -np 2 -H h0,h1 --bind-to none $(VCLUSTER_ALGO) 3 $(PY) scripts/allreduce_probe.py'; fi

demo: install
	./scripts/demo.sh

# The frameworks on 2 virtual hosts at 1 Gbit/s (about 4 minutes, root): one CNN under Lightning
# (strategy="ddp"/"dcredit"), Fabric (strategy="ddp"/DCreditFabricStrategy) and a plain torchrun
# loop with dcredit_hvd; one GPT-2 under transformers.Trainer (DDP)/DCreditTrainer,
# accelerate.Accelerator (DDP)/DCreditAccelerator and the plain loop; ms per step, then one summary
# table (medians): each framework's own DDP, with dcredit, the plain loop, overhead and speed-up.
demo-frameworks: install
	@rm -f .demo-frameworks.md
	$(PY) scripts/bench_lightning.py --summary .demo-frameworks.md
	$(PY) scripts/bench_hf.py --summary .demo-frameworks.md
	@printf '\nSummary (median ms/step; overhead: framework+dcredit against the plain dcredit loop)\n\n'
	@printf '| framework | own DDP ms | framework+dcredit ms | plain loop ms | overhead vs plain loop | speed-up over own DDP |\n|---|---:|---:|---:|---:|---:|\n'
	@cat .demo-frameworks.md; rm -f .demo-frameworks.md

# The network changes during training (1 Gbit/s, 250 Mbit/s from 25 s, 1 Gbit/s from 50 s):
# dcredit (re-plans online), dcredit-static, bytescheduler and horovod, 75 s each on 2 virtual
# hosts (about 7.5 minutes with the compute- and communication-only launches); DRIFT_ARGS="--schedule 1gbit,100mbit@30,1gbit@60 --duration 90".
demo-drift: install
	$(PY) scripts/bench_drift.py $(DRIFT_ARGS)

# The full comparison on virtual clusters (zoo models x 2 and 4 hosts x 1 and 10 Gbit/s); writes
# results/bench/benchmarks.md and PNGs. BENCH_ARGS="--hosts 2 --rates 1gbit" runs a part.
bench: install
	$(PY) scripts/bench_all.py $(BENCH_ARGS)

# GPU check (docs/gpu.md): gpu-wheelhouse here (PyPI reachable) fills .gpu_wheels; carry the
# tree and .gpu_wheels to a machine with one CUDA GPU and run gpu-check there (no network needed).
GPU_CHECK_OUT ?= $(CURDIR)/results/gpu

gpu-wheelhouse:
	bash scripts/gpu_wheelhouse.sh $(CURDIR)/.gpu_wheels

gpu-check:
	bash scripts/gpu_check.sh $(GPU_CHECK_OUT)

lint:
	$(VENV)/bin/ruff check dcredit_hvd tests scripts examples

clean:
	rm -rf .build results .pytest_cache
