# Ember: one build system for libember, its tests, fuzzers and the CPython
# extension.  `make demo` and `make test` set up a fresh machine themselves.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# Python writes byte code for what it imports.  Some environments (this
# project's sessions, likely CI too) set PYTHONDONTWRITEBYTECODE=1, and then
# every process compiles TensorFlow, PySpark and the rest from source again:
# importing TensorFlow took 12 CPU seconds instead of 5, and test_spark_local.py
# 60 CPU seconds instead of 39-43 (docs/testing.md).
unexport PYTHONDONTWRITEBYTECODE

VENV   := .venv
PY     := $(VENV)/bin/python
BUILD  := build
CC     ?= cc
FUZZ_SECONDS ?= 30

WARN   := -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes -Wno-unused-parameter
BASE   := -std=c11 -D_GNU_SOURCE -Icsrc/include -pthread $(WARN)
OPT    := -O2 -g -fPIC
SAN    := -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined
LIBS   := -lcrypto -lz -lcurl -lgssapi_krb5 -lkrb5 -lpthread -lm

LIB_SRCS  := $(wildcard csrc/*.c)
LIB_HDRS  := $(wildcard csrc/include/ember/*.h csrc/*.h)
LIB_OBJS  := $(patsubst csrc/%.c,$(BUILD)/obj/%.o,$(LIB_SRCS))
SAN_OBJS  := $(patsubst csrc/%.c,$(BUILD)/san/%.o,$(LIB_SRCS))
CTESTS    := $(patsubst tests/c/%.c,$(BUILD)/san/%,$(wildcard tests/c/test_*.c))
FUZZERS   := $(patsubst tests/fuzz/%.c,$(BUILD)/fuzz/%,$(wildcard tests/fuzz/fuzz_*.c))
EXT_SRCS  := $(wildcard python/ember/_ember*.c)
EXT_HDRS  := $(wildcard python/ember/_ember*.h)

APT_PACKAGES := dataset-fashion-mnist clang libssl-dev zlib1g-dev libcurl4-openssl-dev libkrb5-dev maven libprotobuf-c-dev protobuf-c-compiler openmpi-bin libopenmpi-dev
# make test-c-install builds examples/c the way a C user would, through pkg-config
APT_PACKAGES += pkg-config
# the Kerberized test Hadoop's users get their tickets with MIT kinit
APT_PACKAGES += krb5-user
# the simulated hosts' network faults (tests/python/simcluster.py): nft, tc
APT_PACKAGES += nftables iproute2

.PHONY: hadoop yarn-app
.PHONY: shlib install test-c-install
.PHONY: test-torch
.PHONY: help setup apt venv build lib ext spark-jar test test-c test-py typecheck fuzz fuzz-smoke demo demo-quick \
        bench-reservation bench-allreduce bench-tfrecord bench-feed clean

help:
	@echo "make demo   - set up this machine and run the Fashion-MNIST main job"
	@echo "make test   - set up this machine and run every test (C under ASan/UBSan, fuzz, pytest, main job), stages timed"
	@echo "make test-profile - where the Python suite's time goes, per module (build/test-profile.txt)"
	@echo "make cluster-test - Ember on a simulated multi-host cluster (network namespaces; root)"
	@echo "make test-torch - the PyTorch path: ember.torch, EmberTorchModel, run_on_yarn PyTorch experiments (part of make test)"
	@echo "make test-compat - a subset of the tests on pyspark 3.5 and TensorFlow 2.20 (.venv-compat)"
	@echo "make typecheck - mypy over python/ember; stubtest of the extension's stub (_ember.pyi) against the built module"
	@echo "make wheel  - sdist + wheel (python -m build), auditwheel show, and a manylinux wheel in dist/"
	@echo "make bench-reservation - Ember vs TensorFlowOnSpark reservation server"
	@echo "make bench-allreduce - allreduce on one host: Ember vs Open MPI over shared memory; Ember vs Open MPI vs gloo over TCP"
	@echo "make bench-cluster - allreduce and feed over TCP between simulated hosts (netns): Ember vs Open MPI TCP vs gloo vs one TCP stream"
	@echo "make bench-train - the main job's training end to end: Ember vs the limit, TensorFlowOnSpark and TorchDistributor"
	@echo "make bench-tf-feed - Keras fit from the feed: Ember's TensorFlow op vs from_generator over next_batch vs in-memory arrays, records/s"
	@echo "make bench-ps - parameter server between simulated hosts (netns), 2 workers, 1 and 2 ps: Ember vs TensorFlow ParameterServerStrategy vs PyTorch RPC, rounds/s"
	@echo "make bench-feed - Spark -> trainer feed: Ember vs TensorFlowOnSpark, records/s and GB/s"
	@echo "make bench-tfrecord - TFRecord reading: Ember vs tf.data; CRC-32C; Example decoder vs protobuf-c"
	@echo "make bench-inference - Spark ML inference: ember.ml.EmberModel vs predict_batch_udf vs TFoS TFModel"
	@echo "make bench-smoke - every bench-* at a tiny size (EMBER_BENCH_QUICK=1), checking each RESULT line"
	@echo "make install PREFIX=/usr/local - libember for C programs: lib/libember.{a,so}, include/ember/*.h, lib/pkgconfig/ember.pc (DESTDIR honoured)"
	@echo "make test-c-install - install into build/install-test; build and run examples/c through pkg-config (static and shared)"

# ---------------------------------------------------------------- set-up
apt: $(BUILD)/.apt-stamp
$(BUILD)/.apt-stamp: Makefile
	@mkdir -p $(BUILD)
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi
	@java -version >/dev/null 2>&1 || { echo "Java 17 is required (java not found)"; exit 1; }
	@touch $@

# The venvs' pinned requirements are installed by uv (from PyPI, pinned
# here), not pip: it downloads in parallel and links the files of the wheels
# it has unpacked once into each venv.  The main venv (7.2 GB, most of it
# torch's CUDA libraries) took 129 s with pip's cache warm, 85 s with uv's
# cache cold and 37 s warm.  pip stays in each venv: Ember itself is
# installed with pip, the way users install it.  No byte code at install
# time (uv's default; pip's --no-compile): Python compiles the modules a
# process imports on first use, and most files of TensorFlow, torch and
# Spark are never imported here.
UV_VERSION := 0.13.9
# $(call VENV_REQUIREMENTS,venv dir,requirement files)
VENV_REQUIREMENTS = test -x $(1)/bin/python || python3 -m venv $(1); \
	$(1)/bin/python -m pip install -q --upgrade pip uv==$(UV_VERSION) && \
	$(1)/bin/uv pip install -q --python $(1)/bin/python $(foreach r,$(2),-r $(r))
venv: $(VENV)/.stamp
$(VENV)/.stamp: requirements.txt requirements-bench.txt
	$(call VENV_REQUIREMENTS,$(VENV),requirements.txt requirements-bench.txt)
	$(VENV)/bin/uv pip uninstall -q --python $(PY) triton  # requirements.txt says why
	@touch $@

# The tests' MLflow tracking server (tests/python/test_mlflow.py) runs from a
# venv of its own: the full mlflow brings scikit-learn, SciPy and matplotlib,
# which Keras imports whenever they are installed, so in the main venv every
# `import tensorflow` (each node, worker and driver) would cost 1.2 CPU s
# more; the main venv has mlflow-skinny, the client ember.mlflow uses.
MLFLOW_VENV := .venv-mlflow
.PHONY: venv-mlflow
venv-mlflow: $(MLFLOW_VENV)/.stamp
$(MLFLOW_VENV)/.stamp: requirements-mlflow-server.txt
	$(call VENV_REQUIREMENTS,$(MLFLOW_VENV),requirements-mlflow-server.txt)
	@touch $@

setup: apt venv build venv-mlflow

# The byte code of what every test process imports (the venvs are installed
# without it), written once by one process: otherwise the first dozen
# nodes, workers and drivers that make test's two lanes start at once would
# each compile TensorFlow, Keras, PyTorch and PySpark (importing TensorFlow
# and Keras: 15 s here the first time, 5 s once compiled).
.PHONY: warm-imports
#: the heavy imports whose byte code the set-up writes (the compat venv: all but torch)
HEAVY_IMPORTS := tensorflow, keras, pyspark.sql, pandas, pyarrow
warm-imports: venv
	$(PY) -c "import $(HEAVY_IMPORTS), torch"

# ---------------------------------------------------------------- build
build: lib ext
lib: $(BUILD)/libember.a

$(BUILD)/obj/%.o: csrc/%.c $(LIB_HDRS)
	@mkdir -p $(@D)
	$(CC) $(BASE) $(OPT) -c $< -o $@
$(BUILD)/libember.a: $(LIB_OBJS)
	rm -f $@ && ar rcs $@ $^

# libember for C programs.  The shared library is linked from the same -fPIC
# objects as libember.a and exports only the public API (csrc/libember.map);
# -z defs makes a missing -l fail here, not in the user's link.  The version
# has one source, python/ember/_version.py; the soname carries its major.
VERSION   := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' python/ember/_version.py)
SOVERSION := $(firstword $(subst ., ,$(VERSION)))
SHLIB     := $(BUILD)/libember.so.$(VERSION)
PREFIX    ?= /usr/local
INSTALL_TO = $(DESTDIR)$(PREFIX)
shlib: $(SHLIB)
$(SHLIB): $(LIB_OBJS) csrc/libember.map
	$(CC) -shared -pthread -Wl,-soname,libember.so.$(SOVERSION) -Wl,--version-script=csrc/libember.map \
	  -Wl,-z,defs $(LIB_OBJS) $(LIBS) -o $@

# Only csrc/include/ember/*.h is public (csrc/*.h are internals).  ember.pc
# gets PREFIX, not DESTDIR: DESTDIR is a staging root for packagers.
install: $(BUILD)/libember.a $(SHLIB)
	@test -n "$(VERSION)" || { echo "no __version__ in python/ember/_version.py"; exit 1; }
	install -d $(INSTALL_TO)/lib/pkgconfig $(INSTALL_TO)/include/ember
	install -m 644 $(BUILD)/libember.a $(INSTALL_TO)/lib/libember.a
	install -m 755 $(SHLIB) $(INSTALL_TO)/lib/libember.so.$(VERSION)
	ln -sfn libember.so.$(VERSION) $(INSTALL_TO)/lib/libember.so.$(SOVERSION)
	ln -sfn libember.so.$(SOVERSION) $(INSTALL_TO)/lib/libember.so
	install -m 644 csrc/include/ember/*.h $(INSTALL_TO)/include/ember/
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@VERSION@|$(VERSION)|g' csrc/ember.pc.in >$(INSTALL_TO)/lib/pkgconfig/ember.pc

# The Python package is installed into the venv the way a user installs it:
# `pip install -e .` (pyproject.toml + setup.py), which compiles the C
# extension in place and builds the two jars it ships as package data
# (python/ember/jars: EmberModel's direct path and run_on_yarn's
# ApplicationMaster; Maven's local repository is M2_REPO, as for the mini
# cluster).  Rerun when any source of the extension or the jars changes.
PKG_SRCS      := pyproject.toml setup.py python/ember/_version.py $(LIB_SRCS) $(LIB_HDRS) \
                 $(EXT_SRCS) $(EXT_HDRS) $(wildcard python/ember/_tf_*.c python/ember/_tf_*.h) \
                 $(wildcard spark/src/ember/spark/*.java spark/src-scala-*/ember/spark/*.java) \
                 $(shell find hadoop/yarn-app -type f 2>/dev/null)
PIP_EDITABLE  = EMBER_M2_REPO=$(M2_REPO) $(1) -m pip install -q --no-build-isolation --no-deps -e .
ext: $(VENV)/.ember-installed
spark-jar yarn-app: ext
$(VENV)/.ember-installed: $(PKG_SRCS) $(VENV)/.stamp | $(BUILD)/.apt-stamp
	$(call PIP_EDITABLE,$(PY))
	$(PY) -c "import ember, ember._ember as e; assert e.__version__ == '$(VERSION)'; print('ember', ember.__version__, 'installed (editable) from', ember.__file__)"
	@touch $@

# ---------------------------------------------------------------- the compatibility venv
# .venv-compat: pyspark 3.5 (Scala 2.12) and TensorFlow 2.20 (requirements-compat.txt),
# with Ember installed the way a user installs it (pip install ., not editable)
# from a copy of the package's sources in build/compat-src: its Spark jar and
# TensorFlow op compile there against that venv's Spark and TensorFlow (an
# editable install would replace the checkout's jar, which serves .venv's Scala
# 2.13).  The C extension and run_on_yarn's jar depend on neither and come
# built (setup.py keeps a built file newer than its sources).
COMPAT_VENV := .venv-compat
COMPAT_PY   := $(COMPAT_VENV)/bin/python
COMPAT_SRC  := $(BUILD)/compat-src
.PHONY: venv-compat venv-compat-deps test-compat
venv-compat: $(COMPAT_VENV)/.ember-installed
# its pip part alone (make test starts it before the main venv is ready)
venv-compat-deps: $(COMPAT_VENV)/.stamp
$(COMPAT_VENV)/.stamp: requirements-compat.txt
	$(call VENV_REQUIREMENTS,$(COMPAT_VENV),requirements-compat.txt)
	# the byte code of its heavy imports, as warm-imports writes the main venv's:
	# written here, on the cores the set-up leaves half idle, not by the first
	# processes of make test's compat stage, each compiling TensorFlow at once
	$(COMPAT_PY) -c "import $(HEAVY_IMPORTS)"
	@touch $@
$(COMPAT_VENV)/.ember-installed: $(VENV)/.ember-installed $(COMPAT_VENV)/.stamp
	rm -rf $(COMPAT_SRC) && mkdir -p $(COMPAT_SRC)/hadoop
	cp -rp pyproject.toml setup.py MANIFEST.in README.md csrc python spark $(COMPAT_SRC)/
	cp -rp hadoop/yarn-app $(COMPAT_SRC)/hadoop/
	rm -f $(COMPAT_SRC)/python/ember/_ember_tf*.so $(COMPAT_SRC)/python/ember/jars/ember-spark.jar
	cd $(COMPAT_SRC) && EMBER_M2_REPO=$(abspath $(M2_REPO)) $(abspath $(COMPAT_PY)) -m pip install \
	  -q --no-build-isolation --no-deps .
	$(COMPAT_PY) -c "import ember, pyspark; from ember import _jars; \
	  print('ember', ember.__version__, 'in $(COMPAT_VENV): pyspark', pyspark.__version__, \
	        '- its Spark jar built against Spark %s, Scala %s' % _jars.built_against())"
	@touch $@

# ---------------------------------------------------------------- test Hadoop (HDFS + YARN)
# hadoop/minicluster: one JVM with a MiniDFSCluster and a MiniYARNCluster, for
# tests (tests/python/hadoop_fixture.py).  Maven's local repository,
# M2_REPO, is Maven's own default (filled from Maven Central by the first
# build on a machine; later builds, of any clone, run offline): a fresh
# clone's set-up took 50 s longer with one of its own (build/m2) to fill.
# The fixture runs build/hadoop/ember-minicluster.jar with the jars listed
# in build/hadoop/classpath.txt.
MVN       ?= mvn
M2_REPO   ?= $(HOME)/.m2/repository
HADOOP_MVN = $(MVN) -B -q -f hadoop/minicluster/pom.xml -Dmaven.repo.local=$(M2_REPO) -Drevision=$(VERSION) \
             -Dember.out=$(abspath $(BUILD)/hadoop) package
hadoop: apt $(BUILD)/hadoop/classpath.txt ext
# (after the extension: its jars are Maven's too, and two Mavens must not
# fill one local repository at once under make -j)
$(BUILD)/hadoop/classpath.txt: hadoop/minicluster/pom.xml $(shell find hadoop/minicluster/src -type f 2>/dev/null) \
                               | $(VENV)/.ember-installed
	@java -version >/dev/null 2>&1 || { echo "Java 17 is required (java not found)"; exit 1; }
	@command -v $(MVN) >/dev/null || { echo "Maven is required ($(MVN) not found; apt-get install maven)"; exit 1; }
	@nice -n 10 $(HADOOP_MVN) -o >/dev/null 2>&1 || nice -n 10 $(HADOOP_MVN)
	@touch $@

# ---------------------------------------------------------------- the tests' JVMs
# A class-data-sharing archive of pyspark's classes for every Spark JVM the
# tests start (tests/python/jvm_archive.py; conftest.py hands it to them):
# about half of a Spark JVM's start-up CPU.  Remade when the venv changes.
.PHONY: test-jvm-archive
test-jvm-archive: $(BUILD)/jvm/.stamp
$(BUILD)/jvm/.stamp: $(VENV)/.stamp tests/python/jvm_archive.py
	@mkdir -p $(@D)
	@$(PY) tests/python/jvm_archive.py >$(BUILD)/jvm/archive.log 2>&1 || \
	  { tail -n 30 $(BUILD)/jvm/archive.log; exit 1; }
	@touch $@

# ---------------------------------------------------------------- C tests (ASan + UBSan)
$(BUILD)/san/%.o: csrc/%.c $(LIB_HDRS)
	@mkdir -p $(@D)
	$(CC) $(BASE) $(SAN) -c $< -o $@
$(BUILD)/san/libember.a: $(SAN_OBJS)
	rm -f $@ && ar rcs $@ $^
$(BUILD)/san/test_%: tests/c/test_%.c tests/c/harness.h tests/c/strangers.h $(BUILD)/san/libember.a
	$(CC) $(BASE) $(SAN) -Itests/c $< $(BUILD)/san/libember.a $(LIBS) -o $@

test-c: $(CTESTS)
	@rc=0; for t in $(CTESTS); do echo "== $$t"; \
	  ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 timeout 300 $$t || rc=1; \
	done; exit $$rc

# libember as a C user gets it: make install into build/install-test (and
# once more with DESTDIR), then tests/c/test_install.sh builds examples/c
# with pkg-config against libember.a and libember.so and runs them.
INSTALL_TEST := $(abspath $(BUILD)/install-test)
test-c-install:
	rm -rf $(INSTALL_TEST)
	$(MAKE) --no-print-directory install PREFIX=$(INSTALL_TEST)
	$(MAKE) --no-print-directory install DESTDIR=$(INSTALL_TEST)/destdir PREFIX=/opt/ember
	grep -qx 'prefix=/opt/ember' $(INSTALL_TEST)/destdir/opt/ember/lib/pkgconfig/ember.pc
	CC="$(CC)" timeout 300 tests/c/test_install.sh $(INSTALL_TEST)

# ---------------------------------------------------------------- fuzzing (libFuzzer, clang)
# libember is compiled for the fuzzers once (fuzzer-no-link instruments it
# for coverage), then each harness links against that archive.
FUZZ_FLAGS := -O1 -g -fsanitize=address,undefined
FUZZ_OBJS  := $(patsubst csrc/%.c,$(BUILD)/fuzz/obj/%.o,$(LIB_SRCS))
$(BUILD)/fuzz/obj/%.o: csrc/%.c $(LIB_HDRS)
	@mkdir -p $(@D)
	clang $(BASE) $(FUZZ_FLAGS) -fsanitize=fuzzer-no-link -c $< -o $@
$(BUILD)/fuzz/libember.a: $(FUZZ_OBJS)
	rm -f $@ && ar rcs $@ $^
$(BUILD)/fuzz/fuzz_%: tests/fuzz/fuzz_%.c $(BUILD)/fuzz/libember.a
	clang $(BASE) $(FUZZ_FLAGS) -fsanitize=fuzzer $< $(BUILD)/fuzz/libember.a $(LIBS) -o $@

# Replays each committed corpus, then fuzzes each harness for FUZZ_SECONDS.
fuzz: apt $(FUZZERS)
	@set -e; for f in $(FUZZERS); do n=$$(basename $$f); \
	  mkdir -p $(BUILD)/corpus/$$n; cp -n tests/fuzz/corpus/$$n/* $(BUILD)/corpus/$$n/ 2>/dev/null || true; \
	  echo "== $$n: $(FUZZ_SECONDS)s"; \
	  $$f -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 -timeout=10 $(BUILD)/corpus/$$n 2>&1 | tail -n 4; \
	  test $${PIPESTATUS[0]} -eq 0; \
	done

# ---------------------------------------------------------------- Python tests and the main job
test-py: setup hadoop test-jvm-archive
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=15 tests/python

# The PyTorch tests alone (make test runs them in the whole suite)
test-torch: setup hadoop test-jvm-archive
	$(PY) -m pytest -q tests/python/test_torch.py tests/python/test_torch_ps.py \
		tests/python/test_ml_torch.py \
		tests/python/test_yarn_experiment_local.py tests/python/test_yarn_experiments.py \
		tests/python/test_kerberos.py::test_run_on_yarn_pytorch_reads_hdfs_tfrecords_on_a_kerberized_grid

# The compatibility subset on .venv-compat (pyspark 3.5, TensorFlow 2.20): the
# classic driver's run/train/inference, TFRecords, restarts, the ML stages
# (their save and load, EmberModel's Arrow paths and the Spark jar's direct
# path) and the jar's version check.
COMPAT_TESTS := tests/python/test_spark_local.py tests/python/test_tfrecord_spark.py \
	tests/python/test_recovery.py tests/python/test_errors.py tests/python/test_jars.py \
	"tests/python/test_ml.py::test_estimator_persistence_and_args" \
	"tests/python/test_ml.py::test_signature_model_types_and_values[mapInArrow]" \
	"tests/python/test_ml.py::test_direct_path_tensor_column"
test-compat: venv-compat
	$(COMPAT_PY) -m pytest -q -p no:cacheprovider --durations=5 $(COMPAT_TESTS)

# Types: mypy over python/ember (pyproject.toml [tool.mypy]), then mypy's
# stubtest, which fails when python/ember/_ember.pyi and the built extension
# disagree on a name or a constant (the C functions carry no signatures for it
# to compare: keep the stub's arguments in step with the kwlists by hand).
typecheck: setup
	$(PY) -m mypy
	$(PY) -m mypy.stubtest ember._ember --mypy-config-file pyproject.toml \
		--allowlist tests/stubtest-allowlist.txt

demo: setup
	PYTHONUNBUFFERED=1 $(PY) -m examples.fashion_mnist.main $(DEMO_ARGS)

# A shorter main job for CI: fewer epochs, still must reach accuracy >= 0.85.
demo-quick: setup
	PYTHONUNBUFFERED=1 $(PY) -m examples.fashion_mnist.main --epochs 3 --require-accuracy 0.85

# Ember on many hosts: a Spark standalone master and three workers, and the
# driver, each on a simulated host (tests/python/simcluster.py: network, UTS
# and /dev/shm namespaces on a bridge in 198.18.0.0/24; needs root, as in CI).
# `make test` runs it as part of tests/python.
.PHONY: cluster-test
cluster-test: setup test-jvm-archive
	$(PY) -m pytest -q tests/python/test_cluster.py

# Tests too long for CI's budget (each also has a shorter variant that CI
# runs): 10,000 train() calls on one cluster (~40 min on 2 cores).
.PHONY: test-long
test-long: setup
	EMBER_LONG_TESTS=1 $(PY) -m pytest -q -s tests/python/test_feed_spark.py -k ten_thousand

# Every stage of the suite, timed, the independent ones at once
# (tests/stages.py: set-up beside the C tests and fuzzers, the Python suite in
# two xdist workers, from when its first lane ends the compatibility subset
# then mypy, and once it ends six of the ten smoke benchmarks beside them; make
# bench-smoke runs all ten); it ends with each stage's duration.  The main job runs in
# tests/python/test_cluster.py, both modes on simulated hosts with the same
# accuracy bar as demo-quick; where those hosts cannot be made (not root),
# demo-quick runs it on this host instead.  Each fuzzer runs 5 s here (make
# fuzz: FUZZ_SECONDS, 30 s).
# docs/testing.md: where the time goes, and which fixture a new test uses.
test:
	EMBER_CALLER_DONTWRITEBYTECODE=$(PYTHONDONTWRITEBYTECODE) python3 tests/stages.py

# Where the Python suite's time goes, module by module (tests/python/timing_plugin.py),
# one worker so that each module's CPU share is its own: build/test-profile.txt
.PHONY: test-profile
test-profile: setup hadoop test-jvm-archive
	EMBER_TEST_PROFILE=$(BUILD)/test-profile.txt PYTHONPATH=tests/python \
	  $(PY) -m pytest -q -p timing_plugin -p no:xdist --durations=0 tests/python

# ---------------------------------------------------------------- benchmarks
# Every bench-* below takes EMBER_BENCH_QUICK=1: tiny sizes, record counts or
# rounds (the same code and measurements), seconds to a minute or two each.
# bench-smoke runs them all so, and fails naming the benchmark whose RESULT
# line is missing or lacks a numeric key (bench/smoke.py; logs in
# build/bench-smoke/; BENCH_SMOKE_ARGS="--only bench-allreduce" for a subset).
.PHONY: bench-smoke
bench-smoke: setup
	PYTHONUNBUFFERED=1 $(PY) bench/smoke.py $(BENCH_SMOKE_ARGS)

bench-reservation: setup
	PYTHONUNBUFFERED=1 $(PY) bench/reservation.py

# The CRC-32C and Example-decoder microbenchmarks are C; protobuf-c (Debian's
# libprotobuf-c-dev + protoc-c) is used by this benchmark only.
$(BUILD)/bench/crc32c: bench/crc32c.c $(BUILD)/libember.a
	@mkdir -p $(@D)
	$(CC) $(BASE) -O2 -g $< $(BUILD)/libember.a $(LIBS) -o $@
$(BUILD)/bench/pb/example.pb-c.c: bench/proto/example.proto bench/proto/feature.proto
	@mkdir -p $(@D)
	protoc-c --c_out=$(@D) -Ibench/proto bench/proto/feature.proto bench/proto/example.proto
$(BUILD)/bench/example_decode: bench/example_decode.c $(BUILD)/bench/pb/example.pb-c.c $(BUILD)/libember.a
	$(CC) -std=c11 -D_GNU_SOURCE -Icsrc/include -I$(BUILD)/bench/pb -O2 -g $< \
	  $(BUILD)/bench/pb/example.pb-c.c $(BUILD)/bench/pb/feature.pb-c.c $(BUILD)/libember.a \
	  -lprotobuf-c $(LIBS) -o $@

bench-tfrecord: setup $(BUILD)/bench/crc32c $(BUILD)/bench/example_decode
	PYTHONUNBUFFERED=1 $(PY) bench/tfrecord.py

# Allreduce on one host, like for like: Ember shm vs Open MPI's default (vader
# shm); Ember TCP vs Open MPI --mca btl tcp,self vs gloo (bench/allreduce.py).
# Peers: Open MPI (APT_PACKAGES) and gloo through torch.distributed (the venv's
# torch, requirements.txt).
$(BUILD)/bench/mpi_allreduce: bench/mpi_allreduce.c
	@mkdir -p $(@D)
	mpicc -O2 -g $< -o $@

bench-allreduce: setup $(BUILD)/bench/mpi_allreduce
	PYTHONUNBUFFERED=1 $(PY) bench/allreduce.py

# Allreduce and the feed between hosts (issue 16): hosts simulated as network
# namespaces (tests/python/simcluster.py, root), Ember vs Open MPI (btl
# tcp,self) vs gloo, against one TCP stream (bench/tcp_stream.c) between two
# of them.  EMBER_BENCH_QUICK=1: a smoke run (1 MiB only, under a minute).
.PHONY: bench-cluster
$(BUILD)/bench/tcp_stream: bench/tcp_stream.c
	@mkdir -p $(@D)
	$(CC) $(BASE) -O2 -g $< -o $@

bench-cluster: setup $(BUILD)/bench/mpi_allreduce $(BUILD)/bench/tcp_stream
	PYTHONUNBUFFERED=1 $(PY) bench/cluster.py $(BENCH_CLUSTER_ARGS)

# The parameter server between hosts: 2 workers and 1 or 2 ps on simulated
# hosts (tests/python/simcluster.py, root; loopback otherwise), 10 Gbit/s
# links; dense (10M parameters) and sparse (4,096 of 1M rows x 64) pull+push
# rounds; Ember vs TensorFlow's ParameterServerStrategy (gRPC) vs PyTorch's
# RPC parameter server.  EMBER_BENCH_QUICK=1: tiny tables, one
# round.  BENCH_PS_ARGS passes options to bench/ps.py.
.PHONY: bench-ps
bench-ps: setup
	PYTHONUNBUFFERED=1 $(PY) bench/ps.py $(BENCH_PS_ARGS)

.PHONY: bench-train
# The main job's training end to end and in steady state: Ember (both input
# modes, and its PyTorch path) against the limit of the cores,
# TensorFlowOnSpark 2.2.5 and TorchDistributor (bench/train.py).
# BENCH_TRAIN_ARGS passes options, e.g. "--sides ember_spark,limit --rounds 1".
bench-train: setup
	PYTHONUNBUFFERED=1 $(PY) bench/train.py $(BENCH_TRAIN_ARGS)

.PHONY: bench-tf-feed
# Keras fit from the feed: Ember's TensorFlow op (ember.tf.feed_dataset)
# against from_generator over next_batch (TensorFlowOnSpark's way) and the
# same rows from memory (the limit); bench/tf_feed.py.
bench-tf-feed: setup
	PYTHONUNBUFFERED=1 $(PY) bench/tf_feed.py

# The bare feed channel (issue 3): shared-memory ring, feed over shm, feed over
# TCP loopback, memcpy; C only.  bench/feed.py runs the binary and parses its
# CHANNEL line; the last line is RESULT feed_channel.
.PHONY: bench-feed-channel
$(BUILD)/bench/feed_channel: bench/feed_channel.c $(BUILD)/libember.a
	@mkdir -p $(@D)
	$(CC) $(BASE) -O2 -g $< $(BUILD)/libember.a $(LIBS) -o $@

bench-feed-channel: setup $(BUILD)/bench/feed_channel
	$(BUILD)/bench/feed_channel

# Spark -> trainer feed: Ember (DataFrame and RDD) vs TensorFlowOnSpark's
# InputMode.SPARK queue, with the bare channel and memcpy as limits.
bench-feed: setup $(BUILD)/bench/feed_channel
	PYTHONUNBUFFERED=1 $(PY) bench/feed.py

# Spark ML inference (issue 5): 200,000 Fashion-MNIST rows through one
# SavedModel by ember.ml.EmberModel, predict_batch_udf and TFoS's TFModel.
.PHONY: bench-inference
bench-inference: setup
	PYTHONUNBUFFERED=1 $(PY) bench/inference.py

# sdist and wheel as a user builds them (isolated build), then the wheel's
# external libraries (libcurl, OpenSSL) vendored for hosts that lack them
.PHONY: wheel
wheel: setup
	rm -rf dist && $(PY) -m build --outdir dist .
	$(PY) -m auditwheel show dist/*.whl
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m auditwheel repair --plat manylinux_2_34_x86_64 \
	  -w dist dist/ember-$(VERSION)-*-linux_x86_64.whl
	@ls -l dist

clean:
	rm -rf $(BUILD) dist python/ember/_ember*.so python/ember/jars $(VENV)/.ember-installed $(COMPAT_VENV)/.ember-installed
