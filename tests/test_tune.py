"""``souffle-tvm tune`` and ``compile --database``: MetaSchedule per Souffle stage, on llvm here.

One module-scoped tuning run (mmoe small, its first two distinct stages, 8 trials each) pays
MetaSchedule's one-time start (``tvm.s_tir.tensor_intrin`` takes 20-50 s to import on this
machine); the other tests reuse its database.
"""

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from conftest import run_and_compare
from souffle_tvm import tune
from souffle_tvm.codegen import database
from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.errors import SouffleError
from souffle_tvm.core.targets import make_target
from souffle_tvm.errors import CacheWarning, TuningError

EXE = shutil.which("souffle-tvm", path=os.path.dirname(sys.executable)) or "souffle-tvm"
TRIALS = 8


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("tune") / "db")
    lines = []
    summary = tune.tune("mmoe", make_target("llvm"), work, TRIALS, small=True, max_tasks=2, log=lines.append)
    return work, summary, lines


def test_tuning_writes_records_per_distinct_stage(tuned):
    work, summary, lines = tuned
    assert [t.name for t in summary.tasks] == ["souffle_matmul_h4", "souffle_matmul_h2"]
    for t in summary.tasks:
        assert 1 <= t.trials <= TRIALS and t.best_seconds is not None and t.best_seconds > 0
    # every measured trial is one JSON line; the workloads file names both stages
    assert summary.records == database.record_count(work) == sum(t.trials for t in summary.tasks)
    assert os.path.getsize(os.path.join(work, database.WORKLOADS)) > 0
    progress = [ln for ln in lines if ln.startswith("[")]
    assert any(ln.startswith("[1/2] souffle_matmul_h4") and "best" in ln for ln in progress)
    assert any(ln.startswith("[2/2] souffle_matmul_h2") and "best" in ln for ln in progress)


def test_compile_applies_the_database_and_matches_onnxruntime(tuned):
    work, summary, _ = tuned
    compiled = compile_model("mmoe", "llvm", "souffle", small=True, database=work)
    rep = compiled.report
    assert rep.database == work
    by_name = {k.primfunc: k for k in rep.kernels}
    tuned_names = {t.name for t in summary.tasks}
    assert {n for n, k in by_name.items() if k.schedule == "database"} == tuned_names
    assert all(k.schedule == "default: none" for n, k in by_name.items() if n not in tuned_names)
    assert "schedules: 2 of 7 kernels from the database" in rep.table()
    # the applied schedule is MetaSchedule's, not the plain loop nest
    func = compiled.model.mod["souffle_matmul_h4"]
    assert func.attrs["tirx.is_scheduled"] and ("parallel" in func.script() or "vectorized" in func.script())
    for c in run_and_compare(compiled):
        assert c.ok(1e-5), c
    plain = compile_model("mmoe", "llvm", "souffle", small=True)
    assert plain.report.database is None and all(k.schedule is None for k in plain.report.kernels)


def test_a_cut_database_line_is_skipped_with_a_note(tuned, tmp_path):
    """What a tuning run killed mid-append by MetaSchedule used to leave: TVM's loader fails on
    it; open_database skips it (and says so) and the whole records still apply."""
    work, summary, _ = tuned
    cut = str(tmp_path / "cut")
    shutil.copytree(work, cut)
    with open(os.path.join(cut, database.RECORDS), "a") as f:
        f.write('[0,[[[["GetSBlock",[],["matmul')
    with pytest.warns(CacheWarning, match="0 workload and 1 tuning record lines cannot be read"):
        compiled = compile_model("mmoe", "llvm", "souffle", small=True, database=cut)
    assert {k.primfunc for k in compiled.report.kernels if k.schedule == "database"} == {t.name for t in summary.tasks}
    assert database.record_count(cut) == database.record_count(work)


def test_tuning_writes_the_database_whole(tuned):
    """Tuning merges each stage's records into the directory by renaming whole files (no
    staging or temp file left there; every line reads back)."""
    work, summary, _ = tuned
    assert sorted(os.listdir(work)) == sorted([".lock", database.WORKLOADS, database.RECORDS, "logs"])
    workloads, records, dropped = database.read_lines(work)
    assert dropped == 0 and len(records) == summary.records and len(workloads) >= len(summary.tasks)


def test_records_for_another_target_keep_the_default_rules_and_say_why(tuned):
    work, _, _ = tuned
    compiled = compile_model("mmoe", "cuda", "souffle", small=True, database=work, nvcc=False, level="v2")
    rep = {k.primfunc: k for k in compiled.report.kernels}
    k = rep["souffle_matmul_h4"]
    assert k.schedule.startswith("default: ") and "tuned for llvm, not this target" in k.schedule_note


def test_compile_database_errors(tmp_path):
    with pytest.raises(SouffleError, match="no tuning database"):
        compile_model("mmoe", "llvm", "souffle", small=True, database=str(tmp_path / "none"))
    with pytest.raises(SouffleError, match="--fusion souffle"):
        compile_model("mmoe", "llvm", "tvm", small=True, database=str(tmp_path))


def _cli(*args, timeout=120):
    t = time.perf_counter()
    proc = subprocess.run([EXE, *args], capture_output=True, text=True, timeout=timeout)
    return proc, time.perf_counter() - t


def test_cli_cuda_without_gpu_or_tracker_exits_2(tmp_path):
    proc, _ = _cli("tune", "mmoe", "--small", "--target", "cuda", "--database", str(tmp_path / "db"), "--trials", "4")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("souffle-tvm: error:") and "Traceback" not in proc.stderr
    assert "GPU" in proc.stderr and "--rpc-tracker" in proc.stderr
    assert not (tmp_path / "db").exists()     # nothing was started


def test_cli_bad_tracker_fails_fast(tmp_path):
    with socket.socket() as s:       # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc, seconds = _cli("tune", "mmoe", "--small", "--target", "cuda", "--database", str(tmp_path / "db"),
                         "--rpc-tracker", f"127.0.0.1:{port}", "--rpc-key", "h200", timeout=60)
    assert proc.returncode == 2 and "cannot reach the RPC tracker" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert seconds < 30
    proc, _ = _cli("tune", "mmoe", "--small", "--target", "cuda", "--database", str(tmp_path / "db"),
                   "--rpc-tracker", "nohostport", "--rpc-key", "h200")
    assert proc.returncode == 2 and "HOST:PORT" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_silent_tracker_times_out():
    with socket.socket() as s:       # accepts connections (backlog) but never answers
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        t = time.perf_counter()
        with pytest.raises(TuningError, match="did not answer"):
            tune.check_tracker("127.0.0.1", s.getsockname()[1], "h200", timeout=2)
        assert time.perf_counter() - t < 10


def test_tune_help_explains_every_flag():
    proc, _ = _cli("tune", "--help")
    for flag in ("--target", "--database", "--trials", "--rpc-tracker", "--rpc-key", "--small", "--fusion-level",
                 "--max-stages"):
        assert flag in proc.stdout
    assert "--database" in _cli("compile", "--help")[0].stdout


# -- CUDA records, made by hand: there is no GPU here to tune one, so these test how the compile
# -- path treats a CUDA schedule from the database (v2 uses it; v3 only at its block size).
@pytest.fixture(scope="module")
def bert_cuda():
    from souffle_tvm.frontend.importer import import_onnx

    model = import_onnx("bert", None, small=True)
    target = make_target("cuda")
    return model, target, tune.extract_tasks(model.mod, target, model.params, "v3")[0]


def _hand_record(work: str, func, target, threads: int) -> None:
    """A tuning record whose trace fuses each block's spatial loops and binds them to
    ``threads`` threads per block (what a MetaSchedule trace looks like, minus the search)."""
    from tvm import s_tir
    from tvm.s_tir import meta_schedule as ms

    db = database.open_database(work, create=True)
    mod = database._workload_mod(func)
    sch = s_tir.Schedule(mod)
    for b in sch.get_child_blocks(sch.get_sblock("root")):
        spatial = [lp for lp, iv in zip(sch.get_loops(b), sch.get(b).iter_vars) if int(iv.iter_type) == 0]
        bx, tx = sch.split(sch.fuse(*spatial), [None, threads])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
    db.commit_tuning_record(ms.database.TuningRecord(sch.trace, db.commit_workload(mod), [1e-5], target,
                                                     ms.arg_info.ArgInfo.from_prim_func(func)))


def test_cuda_record_v2_uses_it_v3_keeps_default_at_another_block_size(tmp_path, bert_cuda):
    model, target, task = bert_cuda
    work = str(tmp_path / "db512")
    _hand_record(work, task.func, target, 512)
    v2 = compile_model(model, target, "souffle", level="v2", nvcc=False, database=work)
    mine = [k for k in v2.report.kernels if k.primfunc == task.name]
    assert mine and all(k.schedule == "database" and k.block == [512, 1, 1] for k in mine)
    assert all(k.schedule.startswith("default: ") for k in v2.report.kernels if k.primfunc != task.name)
    v3 = compile_model(model, target, "souffle", level="v3", nvcc=False, database=work)
    (kernel,) = [k for k in v3.report.kernels if k.stages and task.name in {s.split(".")[0] for s in k.stages}]
    assert kernel.block == [256, 1, 1] and kernel.schedule == "default"
    assert "tuned schedule not used: its schedule uses 512 threads per block, the stitched kernel 256" in kernel.schedule_note


def test_cuda_record_at_the_stitched_block_size_is_stitched(tmp_path, bert_cuda):
    model, target, task = bert_cuda
    work = str(tmp_path / "db256")
    _hand_record(work, task.func, target, 256)
    v3 = compile_model(model, target, "souffle", level="v3", nvcc=False, database=work)
    (kernel,) = [k for k in v3.report.kernels if k.stages and task.name in {s.split(".")[0] for s in k.stages}]
    assert kernel.schedule.startswith("mixed: ") and kernel.schedule_note is None
    # the hand schedule launches twice (matmul, then the bias add): both became stitched stages
    assert {f"{task.name}.0", f"{task.name}.1"} <= set(kernel.stages)


def _fake_tracker(queue_info: dict) -> tuple[socket.socket, int]:
    """A one-connection stand-in for TVM's RPC tracker (its server needs tornado, which the
    project does not install): the magic handshake, then one SUMMARY answer, in TVM's framing."""
    import json
    import struct
    import threading

    from tvm.rpc import base

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                if len(conn.recv(4)) < 4:       # the reachability probe connects and closes
                    continue
                conn.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
                assert base.recvjson(conn) == [base.TrackerCode.SUMMARY]
                data = json.dumps([base.TrackerCode.SUCCESS, {"queue_info": queue_info, "server_info": []}])
                conn.sendall(struct.pack("<i", len(data)) + data.encode())

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


def test_tracker_key_is_checked():
    srv, port = _fake_tracker({"h200": {"free": 2, "pending": 0}})
    with srv:
        assert tune.check_tracker("127.0.0.1", port, "h200") == 2
        with pytest.raises(TuningError, match="no server registered with key 'a100'.*keys: h200"):
            tune.check_tracker("127.0.0.1", port, "a100")


def test_tuning_targets():
    from souffle_tvm.core.geometry import STITCH_BLOCK

    v3 = tune.tuning_target(make_target("cuda", "sm_80"), "v3")
    assert int(v3.attrs["max_threads_per_block"]) == STITCH_BLOCK and str(v3.attrs["arch"]) == "sm_80"
    assert int(tune.tuning_target(make_target("cuda"), "v2").attrs["max_threads_per_block"]) == 1024
    assert int(tune.tuning_target(make_target("llvm")).attrs["num-cores"]) == (os.cpu_count() or 1)
    assert database.same_target(v3, make_target("cuda", "sm_80"))
    assert not database.same_target(v3, make_target("cuda", "sm_90"))


def test_tune_defaults_to_the_stages_compile_builds_by_default_for_the_same_target():
    import inspect

    import tvm
    import tvm_ffi

    from souffle_tvm import cli
    from souffle_tvm.frontend.importer import import_onnx
    from souffle_tvm.pipeline import driver, results
    from souffle_tvm.pipeline.options import Options

    parser = cli.build_parser()
    compile_level = parser.parse_args(["compile", "mmoe"]).level
    assert parser.parse_args(["tune", "mmoe", "--database", "db"]).fusion_level == compile_level
    default = inspect.signature(driver.compile).parameters["level"].default
    assert inspect.signature(tune.tune).parameters["level"].default == default == compile_level
    # CUDA: searched at the thread limit of the stitched kernels the default level builds
    cuda = make_target("cuda", "sm_80")
    assert tune.tuning_target(cuda).attrs["max_threads_per_block"] == tune.tuning_target(cuda, "v3").attrs[
        "max_threads_per_block"]
    # the tasks are the stage functions of that build, time-driven partitioner included
    model = import_onnx("mmoe", None, small=True)
    built = results.run(model.mod, cuda, model.params, Options(level=default))
    want = {tvm_ffi.structural_hash(f) for f in built.unscheduled.functions.values() if isinstance(f, tvm.tirx.PrimFunc)}
    assert {tvm_ffi.structural_hash(t.func) for t in tune.extract_tasks(model.mod, cuda, model.params)} == want
