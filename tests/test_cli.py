"""The command line and the package surface a new user meets first (items 4 and 6):
pure commands and every ``--help`` import no torch and install nothing; every ds_ext error is one
line with exit status 2; ``ds_ext.initialize`` has DeepSpeed's signature and a real docstring."""

import ast
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ds_ext.cli import DESCRIPTION, main
from ds_ext.errors import DsExtError

ROOT = Path(__file__).resolve().parents[1]

PURE_COMMANDS = (
    ["detect", "--preset", "frontier", "--world-size", "16", "--rank", "3", "--grid", "2,4,1,2", "--ted", "2,4"],
    ["schema"],
    ["autoload-path"],
    ["plan", "--model", "gpt-5b", "--nodes", "2", "--families", "zero"],
    ["plan", "--model", "gpt-5b", "--nodes", "2"],  # every family: zero, pmm3d, megatron
    ["simulate", "--nodes", "2"],
    ["tune", "--world", "8"],
)
HELP_COMMANDS = (["--help"], ["--version"], ["run", "--help"], ["detect", "--help"], ["bench", "--help"])


def test_pure_commands_and_help_import_no_torch_and_install_no_hook():
    script = f"""
import contextlib, io, sys
import ds_ext, ds_ext.config, ds_ext.entry.activation
from ds_ext.cli import main
for argv in {list(PURE_COMMANDS)!r}:
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0, argv
for argv in {list(HELP_COMMANDS)!r}:
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except SystemExit as done:
            assert done.code == 0, argv
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "deepspeed", "matplotlib"))
assert not heavy, heavy[:5]
hooks = [f for f in sys.meta_path if type(f).__module__.startswith("ds_ext")]
assert not hooks, hooks
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["detect", "--world-size", "0"], "argument --world-size: expects a positive integer, got '0'"),
        (["detect", "--rank", "-1"], "argument --rank: expects a rank (an integer >= 0), got '-1'"),
        (["detect", "--grid", "2,2"], "argument --grid: expects X,Y,Z,DATA (positive integers), got '2,2'"),
        (["detect", "--ted", "2"], "ds-ext: error: --ted expects TENSOR,EXPERT[,EXPERT_DATA], got '2'"),
        (
            ["detect", "--preset", "frontier", "--world-size", "8", "--grid", "2,2,2,2"],
            "ds-ext: error: ds_ext.pmm3d.grid",
        ),
        (["run", "missing_script.py"], "ds-ext: error: script 'missing_script.py' does not exist"),
        (["run"], "ds-ext: error: no script given; usage: python -m ds_ext.run SCRIPT"),
        (["run", "-m", "no_such_package.train"], "ds-ext: error: module 'no_such_package.train' not found"),
        (
            ["tune", "--world", "8", "--database", "missing_db.json"],
            "ds-ext: error: No such file or directory: missing_db.json",
        ),
        (
            ["plan", "--model", "gpt-5b", "--nodes", "2", "--ds-config", "missing.json"],
            "ds_config file 'missing.json' does not exist",
        ),
        (
            ["plan", "--model", "gpt-5b", "--nodes", "2", "--families", "ted"],
            "ds-ext: error: --families ted: none plans gpt-5b (a dense model); allowed: zero, pmm3d, megatron",
        ),
        (["simulate", "--nodes", "2", "--families", "ted"], "ds-ext: error: --families ted: none plans gpt-neox-20b"),
    ],
)
def test_errors_are_one_line_with_status_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        status = main(argv)
    except SystemExit as done:  # argparse's own errors
        status = done.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert message in err[-1] and "Traceback" not in "\n".join(err)


@pytest.mark.parametrize(
    "refused, message",
    [
        (["--rank", "16"], "rank 16 outside world of 16"),
        (["--grid", "2,2,2,3"], "ds_ext.pmm3d.grid: x=2 * y=2 * z=2 * data=3 = 24 != world size 16"),
        (["--ted", "3,2"], "ds_ext.ted: world size 16 is not divisible by tensor_parallel=3"),
    ],
)
def test_detect_checks_everything_before_printing(refused, message, capsys):
    assert main(["detect", "--preset", "frontier", "--world-size", "16", *refused]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("ds-ext: error: ") and message in err and len(err.splitlines()) == 1


def test_checkpoint_names_a_missing_directory_and_the_tag_flag(capsys, tmp_path):
    assert main(["checkpoint", "inspect", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == f"ds-ext: error: checkpoint directory {tmp_path / 'nope'} does not exist\n"
    assert main(["checkpoint", "consolidate", str(tmp_path), str(tmp_path / "full.pt")]) == 2
    err = capsys.readouterr().err
    assert "has no 'latest' file" in err and "pass --tag TAG" in err and "tag=" not in err


def test_top_level_help_is_whole_plain_text_and_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert done.value.code == 0 and DESCRIPTION in out and "``" not in out
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == "ds-ext 0.1.0"
    with pytest.raises(SystemExit) as done:
        main(["run", "--help"])
    assert done.value.code == 0 and "usage: python -m ds_ext.run SCRIPT" in capsys.readouterr().out


def _error_classes() -> dict[str, tuple[str, list[str]]]:
    """Every class ds_ext defines whose name ends in 'Error': 'file:name' -> (name, base names)."""
    found = {}
    for path in (ROOT / "ds_ext").rglob("*.py"):
        for name, bases in re.findall(r"^class (\w+Error)\(([^)]*)\):", path.read_text(), flags=re.M):
            found[f"{path.relative_to(ROOT)}:{name}"] = (name, [b.strip().split(".")[-1] for b in bases.split(",")])
    return found


def test_every_ds_ext_error_derives_from_one_base():
    classes = _error_classes()
    by_name = {name: bases for name, bases in classes.values()}

    def derives(name: str, seen=()) -> bool:
        return name == "DsExtError" or any(derives(b, seen + (name,)) for b in by_name.get(name, ()) if b not in seen)

    assert len(classes) >= 17
    assert [where for where, (name, _) in classes.items() if not derives(name)] == []


BUILTIN_ERRORS = ("ValueError", "RuntimeError", "TypeError")
# Internal invariants (a bug of ds_ext or of a caller's code, not an error a user meets) keep the built-in error.
INTERNAL = {
    "ds_ext/optim/tiled.py": {"TileBuffer.view", "TiledAdam.update", "piecewise_loader"},  # ds_ext's own tiles
    "ds_ext/pmm/layout.py": {"feature_slice", "chunked_index", "LinearLayout.__post_init__"},  # callers name the grid
    "ds_ext/pmm/linear.py": {"Linear.forward"},  # an input of the wrong width, as torch's own layers refuse it
    "ds_ext/pmm/tune.py": {"bandwidths"},  # --links is an argparse choice
    "ds_ext/zero_topo/perf.py": {"_Tally.__init__"},  # the algorithm comes validated by the config
    "ds_ext/perf/collectives.py": {"traffic"},  # the algorithm and groups come from the config and the topology
    "ds_ext/comm/collectives.py": {
        "_same_dtype",
        "_flat",
        "Communicator.all_gather",
        "Communicator.reduce_scatter",
        "Communicator.all_to_all",
    },  # tensor arguments, as torch.distributed checks them
    "ds_ext/comm/quantized.py": {"all_gather_quantized"},  # ds_ext quantizes whole blocks
    "ds_ext/cluster/measure.py": {"measured_topology"},  # the benchmark names the levels it measured
    "ds_ext/plotting.py": {"colours"},  # a benchmark's own variants
    "ds_ext/bench/pccl.py": {"keep_freed_memory"},  # glibc refusing valid settings
    "ds_ext/bench/tiled.py": {"_mallopt"},
}
VALIDATORS = ("field_validator", "model_validator")  # pydantic's protocol: the schema reports a ValueError by key


def _builtin_raises(tree: ast.AST) -> list[tuple[str, int]]:
    """(function qualname, line) of every ``raise ValueError / RuntimeError / TypeError`` outside a
    pydantic validator."""
    found = []

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            decorators = getattr(child, "decorator_list", [])
            if any(isinstance(d, ast.Call) and getattr(d.func, "id", None) in VALIDATORS for d in decorators):
                continue
            if isinstance(child, ast.Raise) and child.exc is not None:
                exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                if isinstance(exc, ast.Name) and exc.id in BUILTIN_ERRORS:
                    found.append((".".join(scope), child.lineno))
            named = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            visit(child, scope + (child.name,) if named else scope)

    visit(tree, ())
    return found


def test_user_errors_are_ds_ext_errors_and_builtin_ones_are_listed_invariants():
    """No ``raise ValueError / RuntimeError / TypeError`` in ds_ext but the listed internal invariants
    : an error a user meets is a :class:`ds_ext.errors.DsExtError`."""
    raw, used = [], set()
    for path in sorted((ROOT / "ds_ext").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for scope, line in _builtin_raises(ast.parse(path.read_text())):
            if scope in INTERNAL.get(rel, ()):
                used.add((rel, scope))
            else:
                raw.append(f"{rel}:{line} in {scope or 'module'}")
    assert raw == []
    assert {(rel, scope) for rel, scopes in INTERNAL.items() for scope in scopes} == used  # no stale entry


def _converted():
    """(call, error class, built-in base) of errors that are ds_ext errors."""
    from ds_ext.data import ByteCorpus
    from ds_ext.entry.initialize import _resolve_config
    from ds_ext.errors import DsExtConfigError, DsExtSetupError
    from ds_ext.models import GPTConfig, ModelConfigError
    from ds_ext.moe.cac import Frame, ReplayError
    from ds_ext.optim.tiled import refuse_closure
    from ds_ext.plugin import Plugin, PluginError, register_plugin

    reserved = type("CommPlugin", (Plugin,), {"name": "comm"})
    return [
        (lambda: GPTConfig(d_model=10, n_heads=3), ModelConfigError, ValueError),
        (lambda: register_plugin(reserved), PluginError, ValueError),
        (lambda: refuse_closure(lambda: 0.0), DsExtConfigError, ValueError),
        (lambda: ByteCorpus(root=ROOT / "configs"), DsExtSetupError, RuntimeError),
        (lambda: _resolve_config(None, None, None), DsExtConfigError, ValueError),
        (lambda: Frame("TEDMoE[0]", "replay", cac=True).decision("routing", lambda: None), ReplayError, RuntimeError),
    ]


def test_converted_errors_keep_their_builtin_base():
    for call, error, base in _converted():
        with pytest.raises(error) as err:
            call()
        assert isinstance(err.value, DsExtError) and isinstance(err.value, base) and "\n" not in str(err.value)


class _Refused(DsExtError, RuntimeError):
    pass


def test_a_ds_ext_error_in_a_command_is_one_line_with_status_2_and_a_bug_is_a_traceback(capsys, monkeypatch):
    def refuse(ns):
        raise _Refused("the world of 8 ranks does not split into 3 nodes")

    monkeypatch.setattr("ds_ext.cli.cmd_schema", refuse)
    assert main(["schema"]) == 2
    assert capsys.readouterr().err.splitlines() == ["ds-ext: error: the world of 8 ranks does not split into 3 nodes"]

    def bug(ns):
        raise RuntimeError("an internal invariant")

    monkeypatch.setattr("ds_ext.cli.cmd_schema", bug)
    with pytest.raises(RuntimeError, match="an internal invariant"):
        main(["schema"])


def test_initialize_has_deepspeeds_signature_and_a_docstring():
    """Compared with DeepSpeed's source (no DeepSpeed import)."""
    import ds_ext

    source = Path(importlib.util.find_spec("deepspeed").origin).read_text()
    theirs = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "initialize")
    ours = inspect.signature(ds_ext.initialize).parameters
    assert list(ours) == [a.arg for a in theirs.args.args]
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD and p.annotation is not p.empty for p in ours.values())
    doc = inspect.getdoc(ds_ext.initialize)
    assert len(doc.splitlines()) > 20 and all(f"{name}:" in doc for name in ours)


def test_figures_without_matplotlib_name_the_extra():
    """matplotlib and scipy are the ``bench`` extra: without them a figure fails in one line naming it."""
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from ds_ext.errors import MissingExtraError\n"
        "try:\n    import ds_ext.plotting\nexcept MissingExtraError as err:\n    print(err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == (
        "ds_ext's figures (the planner's and the benchmarks' PNGs): matplotlib is not installed; it is an "
        "extra of ds_ext: pip install 'ds_ext[bench]'"
    )
