"""`souffle-tvm report`, help texts, progress and exit codes, through the real entry point."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import require_nvcc
from souffle_tvm import cli

EXE = shutil.which("souffle-tvm", path=os.path.dirname(sys.executable)) or "souffle-tvm"


def run(*args, cwd=None, progress=None):
    env = dict(os.environ)
    env.pop("SOUFFLE_TVM_PROGRESS", None)
    if progress is not None:
        env["SOUFFLE_TVM_PROGRESS"] = progress
    return subprocess.run([EXE, *args], capture_output=True, text=True, cwd=cwd, timeout=600, env=env)


def _subparsers(parser, prefix=()):
    """Every (sub)command parser, as (words, parser)."""
    yield prefix, parser
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for name, sp in action.choices.items():
                yield from _subparsers(sp, prefix + (name,))


def test_every_flag_of_every_subcommand_is_explained():
    commands = list(_subparsers(cli.build_parser()))
    assert {c[0] for c, _ in commands if c} >= {"compile", "run", "analyze", "zoo", "report"}
    for words, parser in commands:
        for action in parser._actions:
            if action.__class__.__name__ in ("_HelpAction", "_SubParsersAction"):
                continue
            assert action.help and len(action.help) > 10, f"{' '.join(words)} {action.option_strings or action.dest}"
    # and what the user sees: each subcommand's --help, from the installed entry point, names
    # each of its flags
    for words, parser in commands:
        proc = run(*words, "--help")
        assert proc.returncode == 0, proc.stderr
        for action in parser._actions:
            for flag in action.option_strings:
                assert flag in proc.stdout, (words, flag)
    assert "self-contained" in run("report", "--help").stdout


@pytest.fixture(scope="module")
def saved_report(tmp_path_factory):
    """`compile --report` of a small model at v3 for CUDA (one stitched kernel), with progress."""
    d = tmp_path_factory.mktemp("rep")
    proc = run("compile", "bert", "--small", "--fusion", "souffle", "--level", "v3", "--report", "r.json", cwd=d,
               progress="1")
    assert proc.returncode == 0, proc.stderr
    return d, proc


def test_compile_shows_progress_on_stderr_and_quiet_silences_it(saved_report, tmp_path):
    """Progress shows on a terminal or with SOUFFLE_TVM_PROGRESS=1; captured output (a pipe) and
    -q stay clean, so scripts parsing stderr see only errors."""
    _, proc = saved_report
    steps = [ln for ln in proc.stderr.splitlines() if ln.startswith("souffle-tvm:")]
    for word in ("importing bert", "souffle pipeline v3", "building with TVM"):
        assert any(word in s for s in steps), steps
    require_nvcc()
    assert any("nvcc -> ptxas resource figures for 1 kernel" in s for s in steps), steps
    for args, progress in ((("-q",), "1"), ((), None)):
        quiet = run(*args, "compile", "mmoe", "--small", "--target", "llvm", cwd=tmp_path, progress=progress)
        assert quiet.returncode == 0 and quiet.stderr == "", (args, quiet.stderr)


def test_report_table_and_html(saved_report):
    d, _ = saved_report
    data = json.loads((d / "r.json").read_text())
    proc = run("report", "r.json", "--html", "r.html", "--rows", "1", cwd=d)
    assert proc.returncode == 0, proc.stderr
    assert f"launches/inference {data['launches']}" in proc.stdout
    top = max(data["kernels"], key=lambda k: k["launches"] * max(k["bytes"], 1))    # the table's first row
    assert top["name"] in proc.stdout and "html: r.html" in proc.stdout
    page = (d / "r.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page
    assert all(g["name"] in page for g in data["groups"])
    no_rows = run("report", "r.json", "--rows", "0", cwd=d).stdout
    assert data["kernels"][0]["name"] not in no_rows and f"{len(data['kernels'])} more kernels" in no_rows


def test_report_bad_input_exits_2_with_one_line(tmp_path):
    (tmp_path / "garbage.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    for args, words in ((["missing.json"], "missing.json"), (["garbage.json"], "is not JSON"),
                        (["other.json"], "is not a souffle-tvm report"), (["other.json", "--rows", "-1"], "--rows")):
        proc = run("report", *args, cwd=tmp_path)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.startswith("souffle-tvm: error:") and words in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "Traceback" not in proc.stderr
    proc = run("report", cwd=tmp_path)                 # argparse usage errors are bad input too
    assert proc.returncode == 2 and "REPORT.json" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_progress_on_a_terminal_overwrites_and_erases_its_line():
    import io

    from souffle_tvm.core import progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    with progress.enabled(tty):
        progress.step("ptxas feedback", 2, 6)
        progress.step("building")
        progress.clear()                      # what api.compile does before returning
    out = tty.getvalue()
    assert "\n" not in out and out.count("\r\033[K") == 3
    assert "ptxas feedback [######..............] 2/6" in out and out.endswith("\r\033[K")
    progress.step("not shown")                 # disabled again after the block
    assert tty.getvalue() == out


def test_exit_codes_for_a_bug_and_an_interrupt(tmp_path, capsys, monkeypatch):
    """3 with the traceback for anything that is our bug; 130 for Ctrl-C; in-process through
    ``cli.main`` with the report handler made to fail (the entry point calls exactly this)."""
    path = tmp_path / "r.json"
    path.write_text("{}")

    def boom(_args):
        raise RuntimeError("planted bug")

    monkeypatch.setattr(cli, "cmd_report", boom)
    # main() builds its parser on each call, so the planted handler is the one dispatched
    assert cli.main(["report", str(path)]) == cli.EXIT_INTERNAL
    err = capsys.readouterr().err
    assert "Traceback" in err and "planted bug" in err and "internal error" in err

    def interrupted(_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_report", interrupted)
    assert cli.main(["report", str(path)]) == 130
